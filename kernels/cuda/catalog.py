"""The quantized-linear launchers of this folder, read from their source text, and the decode attention's
launch plan (no CuPy needed).

A launcher is a module `kernels/cuda/<format>.py` (named after its format, next to its `<format>.cu`)
that assigns `LINEAR` (a kernels/cuda/linear.py object: prepare, gemv, matmul_f32) and declares, as
plain literals:

- `VARIANTS`: the GEMV variants it ships, e.g. "t128_r4" (CUDA cores: threads per block, accumulator
  rows per block) or "tc_w8_u4" (tensor cores: warps per block, groups per load batch);
- `DEFAULT_CONFIG`: op -> variant, for each of the four quantized ops;
- `GEMV_KERNEL`: the prefix of its GEMV entry points, `<GEMV_KERNEL>_<epilogue>_<variant>`;
- `CHUNK_INPUTS`: the inputs of one 16-byte weight load (32 for 4-bit weights, 16 for 8-bit ones), the
  step of the CUDA-core variants' thread loop (`loop_stride`);
- optionally `PREFILL_VARIANTS`: its prefill kernels, when it ships more than one.

The backend (kernels/cuda/__init__.py) imports every launcher this lists; the CPU-side tests
(ladder/unit/test_cuda_build.py, test_cuda_variants.py) read the same literals from here, by file
path, on machines without CuPy.

`attention_plan` lays out one attention launch (kernel, splits, whether the kernel merges its own splits)
from the backend's settings; the backend launches what it says, and ladder/unit/test_attention_plan.py
holds it to its edges on any machine.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
LINEAR_OPS = ("qkv_proj", "o_proj_residual", "gate_up_silu", "down_residual")
# The epilogue fused into each op's GEMV, by its entry-point name part (common.cuh's EPI_*).
EPILOGUE = {"qkv_proj": "bias_f16", "o_proj_residual": "residual_f32", "gate_up_silu": "silu_mul_f16",
            "down_residual": "residual_f32"}
_LITERALS = ("VARIANTS", "DEFAULT_CONFIG", "GEMV_KERNEL", "CHUNK_INPUTS")


def _read(path: Path) -> dict | None:
    """The launcher literals of `path`, or None when it assigns no `LINEAR` (not a launcher)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node.value
    if "LINEAR" not in names:
        return None
    found = {}
    for key in _LITERALS:
        if key not in names:
            raise LookupError(f"kernels/cuda/{path.name} assigns LINEAR but no {key} literal")
        found[key.lower()] = ast.literal_eval(names[key])
    # optional: a format with more than one prefill kernel lists them (backend.prefill_variant picks)
    prefill = tuple(ast.literal_eval(names["PREFILL_VARIANTS"])) if "PREFILL_VARIANTS" in names else ()
    variants, config = tuple(found["variants"]), dict(found["default_config"])
    if set(config) != set(LINEAR_OPS) or not set(config.values()) <= set(variants):
        raise LookupError(f"kernels/cuda/{path.name}: DEFAULT_CONFIG must pick one of VARIANTS {variants} "
                          f"for each of {LINEAR_OPS}, got {config}")
    return {"variants": variants, "default_config": config, "gemv_kernel": str(found["gemv_kernel"]),
            "prefill_variants": prefill, "chunk_inputs": int(found["chunk_inputs"])}


def launchers() -> dict[str, dict]:
    """format name -> {"variants", "default_config", "gemv_kernel", "prefill_variants"} for every launcher here."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        info = _read(path)
        if info is not None:
            found[path.stem] = info
    return found


def variant_geometry(variant: str, silu: bool) -> tuple[int, int]:
    """(threads per block, output rows per block) of a GEMV variant, read from its name: "t<threads>_r<R>"
    (and "f<threads>_r<R>") owns R accumulator rows (gate/up: R/2 gate and R/2 up rows); "tc_w<warps>_u<U>"
    owns a 16-row tensor-core tile (gate/up: 8 gate and 8 up rows). The launcher's block and grid come
    from here; ladder/unit/test_cuda_build.py holds each entry point's `__launch_bounds__` and template
    arguments to the same name."""
    if variant.startswith("tc_"):
        return 32 * int(variant.split("_")[1][1:]), 8 if silu else 16
    threads, r = (int(v[1:]) for v in variant.split("_"))
    return threads, r // 2 if silu else r


def loop_stride(variant: str, chunk_inputs: int) -> int:
    """The inputs one pass of a block's loop covers, read from the variant's name: "t<threads>_r<R>" and
    "f<threads>_r<R>": thread i takes the 16-byte loads i, i + threads, ... (`chunk_inputs` each);
    "tc_w<warps>_u<U>": warp w takes the 128-groups w U .. w U + U - 1, then steps warps x U groups. An
    input count past one stride makes the loop wrap; the unit rung draws on either side of it."""
    if variant.startswith("tc_"):
        warps, batch = (int(v[1:]) for v in variant.split("_")[1:])
        return warps * batch * 128
    return int(variant.split("_")[0][1:]) * chunk_inputs


_DEFINE = re.compile(r"^[ \t]*#define[ \t]+(\w+)[ \t]+(\d+)\b", re.M)


def defines(source: str) -> dict[str, int]:
    """The integer `#define NAME VALUE` lines of kernels/cuda/<source> (a .cu or .cuh file)."""
    return {name: int(value) for name, value in _DEFINE.findall((HERE / source).read_text())}


def lm_head_tiling() -> tuple[int, int, int]:
    """(vocab rows per block, rows per warp, inputs one pass of a warp's loop covers) of the lm_head kernel,
    read from its source: a block is LM_WARPS warps of LM_ROWS rows each, and lane i takes the 16-byte
    (8 fp16) loads i, i + WARP, ... of the hidden row."""
    lm, common = defines("embed_lmhead_argmax.cu"), defines("common.cuh")
    return lm["LM_WARPS"] * lm["LM_ROWS"], lm["LM_ROWS"], common["WARP"] * 8


def gemv_kernel_name(prefix: str, op: str, variant: str) -> str:
    """The entry point of `op`'s GEMV in `variant`: <prefix>_<epilogue>_<variant>."""
    return f"{prefix}_{EPILOGUE[op]}_{variant}"


# ---- the attention launch (paged_attention.cu) -------------------------------------------------------------

_ATT = defines("paged_attention.cu")
PAGE = _ATT["PAGE"]
ATT_THREADS, ATT_MAX_ITEMS = _ATT["ATT_THREADS"], _ATT["ATT_MAX_ITEMS"]  # paged_attention_f16
ATT_WARPS, ATT_MAX_GROUP = _ATT["ATT_WARPS"], _ATT["ATT_MAX_GROUP"]  # paged_attention_warp_d<D>, _tc_d<D>
ATT_WARP_HEAD_DIMS = (64, 128)
COMBINE_THREADS, COMBINE_MAX_SPLITS = _ATT["COMBINE_THREADS"], _ATT["COMBINE_MAX_SPLITS"]  # attention_combine_f16
CLUSTER_SPLITS, CLUSTER_WARPS = _ATT["CLUSTER_SPLITS"], _ATT["CLUSTER_WARPS"]  # paged_attention_tc_cluster_d<D>
CLUSTER_MAX_PAGES = CLUSTER_SPLITS * CLUSTER_WARPS * 2  # the cluster kernel's page tables: two pages a warp at most
SHARED_LIMIT = 48 * 1024  # static+dynamic shared memory without an opt-in attribute
# "tc": paged_attention_tc_d<D> (both products of a page on the tensor cores) where the warp kernel
# fits; "tc_cluster" (the default): the same kernel (CLUSTER_WARPS warps a block) in CLUSTER_SPLITS splits of
# one thread block cluster, merged by the cluster after one cluster barrier (paged_attention_tc_cluster_d<D>,
# no attention_combine_f16 launch), for page tables of up to CLUSTER_MAX_PAGES, else "tc"; "warp":
# paged_attention_warp_d<D> where it fits (head_dim 64 or 128, at most 8 query heads per KV head); else, and
# for "block": paged_attention_f16 (the first kernel, kept for any shape)
ATTENTION_VARIANTS = ("tc", "tc_cluster", "warp", "block")
# prefill (T > 1): "wgmma" attention_prefill_wg_d<D> (wgmma, 64 query rows and 64 keys a step) and "tc"
# attention_prefill_tc_d<D> (mma.sync, 64 query rows, a page a step) where they fit (head_dim 64 or 128),
# else what attention_variant picks; "warp" / "block" force those kernels
ATTENTION_PREFILL_VARIANTS = ("wgmma", "tc", "warp", "block")
# the kernels that merge their own splits, each to the kernel that runs in its place where it cannot
CLUSTER_KERNELS = {f"paged_attention_tc_cluster_d{d}": f"paged_attention_tc_d{d}" for d in ATT_WARP_HEAD_DIMS}


class AttentionPlan(NamedTuple):
    """One attention launch as `attention_plan` lays it out: grid (nkv, T, splits), `threads` a block."""
    kernel: str
    pages_per_split: int  # 0: the kernel spreads the used pages over the splits
    splits: int
    smem: int  # dynamic shared memory, bytes
    threads: int
    merges: bool  # the kernel merges its splits itself (no attention_combine_f16 launch)

    @property
    def combines(self) -> bool:
        """attention_combine_f16 runs after the kernel: more than one split, and the kernel does not merge them."""
        return self.splits > 1 and not self.merges


def attention_kernel(variant: str, nq: int, nkv: int, d: int) -> str:
    """The kernel `variant` names for this head layout ("tc": the tensor-core kernel, "tc_cluster": the same
    in one thread block cluster that merges its splits, "warp": the warp-per-page kernel) where it fits,
    else paged_attention_f16. What a launch runs also depends on its splits and pages: `attention_plan`."""
    if variant not in ATTENTION_VARIANTS:
        raise ValueError(f"attention_variant {variant!r} is not one of {ATTENTION_VARIANTS}")
    if variant != "block" and d in ATT_WARP_HEAD_DIMS and nq // nkv <= ATT_MAX_GROUP:
        return f"paged_attention_{variant}_d{d}"
    return "paged_attention_f16"


def attention_plan(variant: str, T: int, nq: int, nkv: int, d: int, max_pages: int, split: bool,
                   pages_per_split: int | None, att_blocks: int) -> AttentionPlan:
    """The launch of attention over a page table of `max_pages` for T tokens (`split`: decode's split-K
    over the pages; without it one block a (KV head, token) holds every page), with the backend's settings
    (`variant`, `pages_per_split`: None spreads the used pages over about `att_blocks` blocks, computed on
    the device from the current length): the kernel, its pages a split (0: that spread), the split count,
    its dynamic shared memory, its block, and whether the kernel merges the splits itself: the cluster
    kernel, CLUSTER_SPLITS splits over a page table of up to CLUSTER_MAX_PAGES (or as many splits of
    `pages_per_split` as cover it). Where it cannot, its variant runs "tc"'s kernel and
    attention_combine_f16 after it. ValueError for a layout or a split count no kernel holds."""
    group = nq // nkv
    kernel = attention_kernel(variant, nq, nkv, d)
    if kernel in CLUSTER_KERNELS:
        if split and -(-max_pages // (pages_per_split or 2 * CLUSTER_WARPS)) <= CLUSTER_SPLITS:
            return AttentionPlan(kernel, pages_per_split or 0, CLUSTER_SPLITS, 0, CLUSTER_WARPS * 32, merges=True)
        kernel = CLUSTER_KERNELS[kernel]
    warp = kernel != "paged_attention_f16"
    smem = 0
    if not warp:
        if group * d > ATT_THREADS * ATT_MAX_ITEMS:
            raise ValueError(f"attention: {group} query heads per KV head x head_dim {d} exceeds the kernel's "
                             f"{ATT_THREADS * ATT_MAX_ITEMS} accumulators per block")
        smem = 4 * (PAGE * (d + 1) + PAGE * d + group * d + group * PAGE + 3 * group)
        if smem > SHARED_LIMIT:
            raise ValueError(f"attention: head_dim {d} with {group} heads per KV head needs {smem} B of shared memory")
    if not split:
        pps, splits = max_pages, 1
    elif pages_per_split:
        pps = pages_per_split
        splits = -(-max_pages // pps)
    else:  # dynamic: the kernel spreads the used pages over `splits` blocks per (KV head, token)
        # (the warp kernels' blocks hold ATT_WARPS pages at a time: no more splits than that fills)
        most = -(-max_pages // ATT_WARPS) if warp else max_pages
        pps, splits = 0, max(1, min(most, -(-att_blocks // (nkv * T))))
    if splits > COMBINE_MAX_SPLITS:
        raise ValueError(f"attention: {splits} splits exceed the combine kernel's {COMBINE_MAX_SPLITS} "
                         f"(raise pages_per_split)")
    return AttentionPlan(kernel, pps, splits, smem, ATT_WARPS * 32 if warp else ATT_THREADS, merges=False)
