"""The quantized-linear launchers of this folder, read from their source text (no CuPy needed).

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
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
