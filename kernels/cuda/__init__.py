"""The CUDA backend: every op of docs/BACKEND.md on an NVIDIA GPU (sm_90a: Hopper) through CuPy.

Thin launchers over the kernels in this folder (one `.cu` per op family, compiled once by loader.py).
Imported only by `kernels.get_backend("cuda")`: nothing on the CPU path imports CuPy. Follows the NumPy
backend (kernels/numpy/, the executable spec) op for op, with the same precision contract: fp32
residual, fp16 activations and KV pages, fp32 accumulation, fp32 logits, lowest index on an argmax tie,
no atomics (results do not depend on timing).

Quantized linears: one launcher module per format, `kernels/cuda/<format>.py` next to its
`<format>.cu` (catalog.py lists them from their source; each assigns `LINEAR`, a kernels/cuda/linear.py
object). `formats` is the formats with a launcher; another format is `FormatNotSupportedError`. With
T = 1 (decode) a linear is one of its format's GEMV kernels, which unpack in registers, split over the
input dimension inside each block, with the op's epilogue fused; `gemv_config[format][op]` picks the
variant (threads and rows per block, or a tensor-core tiling). With T > 1 (prefill) the launcher's
`matmul_f32` leaves x W^T in fp32 (tensor-core kernels on the weights' exact fp16 values with fp32 sums,
scaled per group or per row: the INT4 formats' wgmma kernel, the 8-bit formats' ring; or, as
`prefill_variant` picks, the exact fp32 dequantization and one cuBLAS fp32 GEMM), then a shared epilogue
kernel (epilogues.cu) runs. Attention with T = 1 splits the used pages evenly over a fixed number of
blocks (computed on the device from the current length) and merges the splits in a fixed order: by
default the splits are the blocks of one thread block cluster, which merge them after a cluster barrier
where the page table is short enough (paged_attention_tc_cluster_d<D>), else attention_combine_f16 runs
after the attention kernel (catalog.attention_plan lays out each launch); within a block, each warp
owns whole pages in registers and runs both products of a page on the tensor cores
(paged_attention_tc_d64/_d128, for head_dim 64 or 128 and up to 8 query heads per KV head;
paged_attention_warp_d<D> does them on the CUDA cores; other layouts take paged_attention_f16). A
prefill (T > 1) runs on wgmma (attention_prefill_wg_d64/_d128: 64 query rows of one KV head a block, 64
keys a step, each K/V page staged once per tile; attention_prefill_tc_d64/_d128 is the same tile on
mma.sync, a page a step).

Every launch goes to CuPy's current stream, and nothing in a T = 1 op allocates memory once its scratch
exists, so the decode step can be captured as a CUDA graph (engine/cuda_graph.py).

The kernels are compiled for one architecture (loader.OPTIONS: sm_90a, Hopper with its wgmma and
setmaxnreg), so a GPU of another compute capability cannot run them: `is_available` says so in one
line, naming the GPU, and the constructor refuses such a device with `BackendUnavailableError` before
it compiles anything.
"""

from __future__ import annotations

import importlib
import math
import os
import re

import numpy as np

from kernels.base import Backend, BackendUnavailableError, FormatNotSupportedError, QuantizedWeight, switch_value

try:
    import cupy as cp
except ImportError as e:  # re-raised by get_backend as BackendUnavailableError
    raise ImportError(f"CuPy is not importable: {e}") from e

from kernels.cuda import catalog, loader
# the decode attention's kernels and launch plan live in catalog.py (read there without CuPy, and tested so)
from kernels.cuda.catalog import (ATT_WARP_HEAD_DIMS, ATTENTION_PREFILL_VARIANTS, ATTENTION_VARIANTS, COMBINE_THREADS,
                                  AttentionPlan)

# format name -> its launcher's LINEAR (prepare, gemv, matmul_f32, variants, default_config)
_LAUNCHERS = {name: importlib.import_module(f"kernels.cuda.{name}") for name in catalog.launchers()}
LINEARS = {name: mod.LINEAR for name, mod in _LAUNCHERS.items()}
# the prefill kernel of each launcher that ships more than one (its PREFILL_VARIANTS)
DEFAULT_PREFILL = {name: mod.DEFAULT_PREFILL for name, mod in _LAUNCHERS.items() if hasattr(mod, "DEFAULT_PREFILL")}
_LM = catalog.defines("embed_lmhead_argmax.cu")  # the kernels' own tiling: one reading, not a copy
LM_WARPS, LM_ROWS = _LM["LM_WARPS"], _LM["LM_ROWS"]
ARGMAX_THREADS = _LM["ARGMAX_THREADS"]  # both argmax kernels' block: block_argmax's warp 0 takes one winner a warp
_ATT = catalog.defines("paged_attention.cu")
_RMS = catalog.defines("rmsnorm.cu")
RMS_THREADS, RMS_THREADS_ONE = _RMS["RMS_THREADS"], _RMS["RMS_THREADS_ONE"]  # rmsnorm_f32_f16's block, T > 1 / T = 1
TC_ROWS = 64  # must match paged_attention.cu (attention_prefill_tc_d<D>, attention_prefill_wg_d<D>)
WG_ATT_KEYS = _ATT["WG_ATT_KEYS"]  # attention_prefill_wg_d<D>'s keys a step
_EW_BLOCK = 256


def _i32(v):
    return np.int32(v)


def _blocks(n: int, block: int = _EW_BLOCK, cap: int = 65535) -> int:
    return max(1, min(cap, -(-n // block)))


def _rows_grid(T: int, rows: int) -> tuple[int, int]:
    """epilogues.cu's row-wise grid: x over rows in 4-row steps, y over tokens (each capped; both loop)."""
    return _blocks(-(-rows // 4)), min(T, 65535)


def _need(a, dtype, name: str):
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{name}: expected a CuPy array on the cuda backend, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected {np.dtype(dtype)}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    return a


def _need_attention(q, k_pages, v_pages, page_table, positions, out):
    """The arrays every attention kernel reads and writes, in the dtypes it assumes."""
    _need(q, np.float16, "q"), _need(k_pages, np.float16, "k_pages"), _need(v_pages, np.float16, "v_pages")
    _need(page_table, np.int32, "page_table"), _need(positions, np.int32, "positions"), _need(out, np.float16, "out")


def _device_name(device: int) -> str:
    name = cp.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _built_for(options=loader.OPTIONS) -> tuple[int, int, bool]:
    """(major, minor, arch-specific) of the one architecture the loader compiles for: `sm_90` is (9, 0,
    False); `sm_90a` would be (9, 0, True)."""
    found = re.findall(r"\bsm_(\d+)(\d)(a?)\b", " ".join(options))
    if len(found) != 1:
        raise RuntimeError(f"kernels/cuda/loader.py: OPTIONS {options} should name exactly one sm_NN architecture")
    major, minor, specific = found[0]
    return int(major), int(minor), specific == "a"


ARCH = _built_for()
_FAMILIES = {9: "Hopper"}  # the architecture's name, for the one line that refuses another GPU


def arch_name(arch: tuple[int, int, bool] = ARCH) -> str:
    """`sm_90a (Hopper)`: the architecture the kernels are built for, in words."""
    major, minor, specific = arch
    family = _FAMILIES.get(major)
    return f"sm_{major}{minor}{'a' if specific else ''}" + (f" ({family})" if family else "")


def runs_on(capability: str, arch: tuple[int, int, bool] = ARCH) -> bool:
    """Whether a device of compute capability `capability` (CuPy's spelling: "90" for 9.0, "120" for 12.0)
    runs code compiled for `arch`. A cubin for sm_XY runs on X.Z with Z >= Y (binary compatibility holds
    within a major version only); an arch-specific one (sm_90a) on X.Y alone."""
    major, minor = int(capability[:-1]), int(capability[-1])
    want_major, want_minor, specific = arch
    return major == want_major and (minor == want_minor if specific else minor >= want_minor)


def device_refusal(device: int) -> str | None:
    """Why GPU `device` cannot run the kernels, in one line, or None when it can."""
    try:
        capability = str(cp.cuda.Device(device).compute_capability)
        name = _device_name(device)
    except Exception as e:  # CUDARuntimeError: the device cannot be queried
        return f"GPU {device} cannot be queried ({type(e).__name__}: {e})"
    if runs_on(capability):
        return None
    return (f"GPU {device} ({name}) is compute capability {capability[:-1]}.{capability[-1]}; "
            f"the CUDA kernels are built for {arch_name()} only")


class CudaBackend(Backend):
    name = "cuda"
    formats = tuple(LINEARS)
    linears = LINEARS
    supports_graphs = True  # every T = 1 op launches on the current stream and allocates nothing
    needs_device = True

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """(True, GPU 0's name) when CuPy sees a GPU and every visible GPU runs the kernels, else (False, the
        reason in one line).

        Every visible GPU must be of the architecture the kernels are built for (`ARCH`), not just one:
        the test workers take GPU N modulo the GPU count (`worker_options`), so a run on a machine with one
        GPU of another kind would fail deep inside a kernel launch on the workers that drew it. The reason
        names the first GPU that cannot run them and, when others can, the CUDA_VISIBLE_DEVICES that keeps
        only those."""
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, no device
            return False, f"CuPy sees no CUDA device ({type(e).__name__}: {e})"
        if n == 0:
            return False, "CuPy sees no CUDA device"
        refusals = {i: device_refusal(i) for i in range(n)}
        bad = [i for i, why in refusals.items() if why]
        if not bad:
            return True, _device_name(0)
        why = refusals[bad[0]]
        good = [i for i in range(n) if i not in bad]
        if good:
            # device i is the i-th entry of an existing CUDA_VISIBLE_DEVICES, not physical GPU i
            shown = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            ids = [shown[i] for i in good] if len(shown) == n else [str(i) for i in good]
            why += f", and every visible GPU must run them (CUDA_VISIBLE_DEVICES={','.join(ids)} keeps those that can)"
        return False, why

    @classmethod
    def warm_up(cls) -> None:
        """Compile every module once, before the workers start: each then loads the cubins from CuPy's
        on-disk kernel cache (keyed by the inlined source) instead of running NVRTC on the same
        modules itself (12.5 s per worker measured on an H200 with 16 workers compiling at once). The
        modules compile side by side (loader.compile_all), then load."""
        from kernels.cuda.loader import compile_all, kernels

        compile_all()
        kernels()

    @classmethod
    def test_workers(cls) -> int:
        """Four workers per GPU: one per format, each keeping its format's cases (--dist loadgroup).
        Measured on one H200: the graph rung of one format ran 103 cases in 36 s with 2 workers and in
        72 s with 8 (a worker costs 26-46 s to start, and the GPU runs one worker's kernels at a time);
        the four formats' 412 cases took 105 s with 2 workers (two formats each, in turn). Whatever the
        model's size: on a 0.5B-shape model 16 workers (one per host core, each format's cases spread over
        all of them) ran the graph rung at the rate 4 did (2.9 cases a second on a first run; 68 s for
        412 cases on a second), each case about three times as long, and the layer rung in 37-40 s as 4
        did in 40-45, with GPU memory at 78 GB instead of 30 and host memory at 46 GB instead of 29."""
        return 4 * cp.cuda.runtime.getDeviceCount()

    @classmethod
    def worker_options(cls, worker: int) -> dict:
        """Parallel test worker N takes GPU N modulo the GPU count."""
        return {"device": worker % cp.cuda.runtime.getDeviceCount()}

    @property
    def device_name(self) -> str:
        return _device_name(cp.cuda.Device().id)

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch, in captured CUDA graphs, of the kernels that wait for their
        predecessor (common.cuh, loader.py): on by default. One switch for the process, since the
        compiled kernels are shared; `nanoqwen bench --before-set pdl=off` times a step without it."""
        return loader.PDL["on"]

    @pdl.setter
    def pdl(self, value) -> None:
        if isinstance(value, str):
            value = switch_value(value, "pdl")
        loader.PDL["on"] = bool(value)

    def launch_settings(self) -> tuple:
        """Every setting that picks a kernel or its geometry, frozen: pdl and the public plain-data
        attributes (gemv_config, attention_variant, pages_per_split, ...; the ops, callables, are not
        among them). A captured decode graph keys on it (engine/cuda_graph.py), so a setting changed while
        a model keeps its graph (the bench's --before-set, a variant test) captures again rather than
        replay the kernels of before. Read from the attributes themselves, so a new setting is covered."""
        def frozen(v):
            return tuple(sorted((k, frozen(x)) for k, x in v.items())) if isinstance(v, dict) else v

        plain = (str, int, float, bool, type(None), dict)
        return (("pdl", self.pdl), *sorted((k, frozen(v)) for k, v in vars(self).items()
                                           if not k.startswith("_") and isinstance(v, plain)))

    def __init__(self, device: int | None = None, pages_per_split: int | None = None):
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, no device
            raise BackendUnavailableError(f"backend 'cuda' sees no CUDA device: {e}") from None
        if n == 0:
            raise BackendUnavailableError("backend 'cuda' sees no CUDA device")
        # the device this object runs on must run the kernels; refused here, before any compile or launch
        why = device_refusal(cp.cuda.Device().id if device is None else device)
        if why:
            raise BackendUnavailableError(f"backend 'cuda' cannot run here: {why}")
        if device is not None:
            cp.cuda.Device(device).use()
        # decode attention: KV pages per block (split-K); None spreads the used pages over att_blocks
        # blocks, computed on the device from the current length (the split count is fixed per launch)
        self.pages_per_split = pages_per_split
        self.sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
        self.att_blocks = 2 * self.sms
        # one of ATTENTION_VARIANTS (bench and the variant tests set it). "tc_cluster" measured 0.05 ms a
        # decode step faster than "tc" at 512 keys, 7B (bench/NOTES.md v5, sixteenth step)
        self.attention_variant = "tc_cluster"
        self.attention_prefill_variant = "wgmma"  # one of ATTENTION_PREFILL_VARIANTS
        self._att_smem_set: set[str] = set()  # the prefill attention kernels given their dynamic shared memory
        # rmsnorm: rows of up to RMS_HELD x its block held in registers (True), or its strided loop at any length
        self.rmsnorm_held = True
        # rmsnorm's block for the one row of a decode step (T = 1): up to RMS_THREADS_ONE (its launch bounds).
        # 256 measured 0.03 ms a decode step faster than 1024 at 7B (57 norms; bench/NOTES.md v5)
        self.rmsnorm_threads_one = 256
        # the fused ops o_proj_residual_rmsnorm / down_residual_rmsnorm on the prefill path: the residual add
        # and the rmsnorm in one kernel (True, rmsnorm.cu residual_add_rmsnorm_f32_f16), or the two ops
        self.rmsnorm_fold = True
        # RoPE and the KV write: no more blocks in all than this many an SM on a long prefill (0: 16 a token)
        self.rope_blocks_per_sm = 8
        # prefill kernel per format, for launchers that ship more than one (PREFILL_VARIANTS)
        self.prefill_variant = dict(DEFAULT_PREFILL)
        # the wgmma prefill kernel spread over this many blocks where one block a tile would waste most of a
        # wave (kernels/cuda/linear.py wgmma_spread_blocks; the same bits); 0: always one block a tile
        self.wgmma_spread_blocks = self.sms
        # GEMV variant per format and op (bench and the variant tests set entries; each launcher's
        # DEFAULT_CONFIG to start)
        self.gemv_config = {name: dict(lin.default_config) for name, lin in self.linears.items()}
        self.gemv_max_tokens = 1  # T above this takes the launcher's matmul_f32 (prefill) path
        self._k = loader.kernels()
        self._scratch: dict[str, cp.ndarray] = {}
        self._scratch_views: dict[tuple, tuple] = {}  # (key, shape, dtype) -> (its buffer, the view)
        self._retired: list[cp.ndarray] = []  # outgrown scratch stays alive: a captured graph may use it
        self._inv_freq: dict[tuple[float, int], cp.ndarray] = {}

    # --- memory -------------------------------------------------------------------------------

    def asarray(self, a, dtype=None):
        return cp.ascontiguousarray(cp.asarray(a, dtype=dtype))

    def empty(self, shape, dtype):
        return cp.empty(shape, dtype=dtype)

    def full(self, shape, value, dtype):
        return cp.full(shape, value, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        return cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)

    def synchronize(self) -> None:
        cp.cuda.get_current_stream().synchronize()

    def release_memory(self) -> None:
        """CuPy's memory pool keeps every freed block for CuPy's next allocation; torch's allocator in the
        same process cannot use them. Wait for the queued work (a block is free once no queued launch
        reads it), then give the pool's free blocks on this device, and the pinned host pool's, back.
        The scratch buffers stay: a captured graph of another live model may read them."""
        self.synchronize()
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()

    def scratch(self, key: str, shape, dtype, zeroed: bool = False) -> cp.ndarray:
        """A reusable buffer of at least `shape`; never freed while the backend lives (graph safety).
        The view of a (key, shape, dtype) asked for before is handed out again while its buffer is the
        key's (slicing, viewing and reshaping cost three CuPy calls: decode attention asks three times a
        layer). `zeroed`: a new buffer starts as zeros (then it holds what its users left in it)."""
        shape = tuple(shape)
        buf = self._scratch.get(key)
        seen = self._scratch_views.get((key, shape, dtype))
        if seen is not None and seen[0] is buf:
            return seen[1]
        n = math.prod(shape) * np.dtype(dtype).itemsize
        if buf is None or buf.nbytes < n:
            if buf is not None:
                self._retired.append(buf)
            buf = (cp.zeros if zeroed else cp.empty)(max(n, 256), dtype=np.uint8)
            self._scratch[key] = buf
        view = buf[:n].view(dtype).reshape(shape)
        if len(self._scratch_views) >= 256:  # prefill shapes vary with the prompt's length
            self._scratch_views.clear()
        self._scratch_views[(key, shape, dtype)] = (buf, view)
        return view

    def prepare_linear(self, fmt: str, tensors: dict, out_features: int, in_features: int) -> QuantizedWeight:
        lin = self.linears.get(fmt)
        if lin is None:
            raise FormatNotSupportedError(f"backend 'cuda' has no kernel for format {fmt!r}")
        return QuantizedWeight(fmt, out_features, in_features, lin.prepare(self, tensors, out_features, in_features))

    # --- quantized linears --------------------------------------------------------------------

    def _linear(self, w):
        try:
            return self.linears[w.format]
        except KeyError:
            raise FormatNotSupportedError(f"backend 'cuda' has no kernel for format {w.format!r}") from None

    def qkv_proj(self, x, w, bias, out):
        _need(x, np.float16, "x"), _need(bias, np.float16, "bias"), _need(out, np.float16, "out")
        lin, T, rows = self._linear(w), x.shape[0], w.out_features
        if T <= self.gemv_max_tokens:
            lin.gemv(self, "qkv_proj", x, w, rows, bias, out)
        else:
            y = lin.matmul_f32(self, x, w)
            self._k["epi_bias_f16"](_rows_grid(T, rows), (_EW_BLOCK,), (y, bias, out, _i32(T), _i32(rows)))

    def _linear_residual(self, op, x, w, residual):
        _need(x, np.float16, "x"), _need(residual, np.float32, "residual")
        lin, T, rows = self._linear(w), x.shape[0], w.out_features
        if T <= self.gemv_max_tokens:
            lin.gemv(self, op, x, w, rows, residual)
        else:
            y = lin.matmul_f32(self, x, w)
            self._k["epi_residual_f32"]((_blocks(T * rows),), (_EW_BLOCK,), (y, residual, _i32(T), _i32(rows)))

    def o_proj_residual(self, x, w, residual):
        self._linear_residual("o_proj_residual", x, w, residual)

    def down_residual(self, x, w, residual):
        self._linear_residual("down_residual", x, w, residual)

    def _residual_rmsnorm(self, fused, x, w, residual, norm_weight, eps, out) -> bool:
        """A fused op of FUSED_OPS on the prefill path as the GEMM and one epilogue kernel that adds its
        output into the residual and normalises the new rows (rmsnorm.cu residual_add_rmsnorm_f32_f16), when
        `rmsnorm_fold` is on and neither part is wrapped on this object (Backend.parts_wrapped); False when
        the parts must run instead. The decode step's GEMV (T up to gemv_max_tokens) takes the parts: its
        rmsnorm, launched under programmatic dependent launch, measured no slower than a fold into the
        GEMV's last block (bench/NOTES.md v5)."""
        T = x.shape[0]
        if not self.rmsnorm_fold or T <= self.gemv_max_tokens or self.parts_wrapped(fused):
            return False
        _need(x, np.float16, "x"), _need(residual, np.float32, "residual")
        _need(norm_weight, np.float16, "norm_weight"), _need(out, np.float16, "out")
        rows = w.out_features
        if residual.shape != (T, rows) or out.shape != (T, rows) or norm_weight.shape != (rows,):
            raise ValueError(f"{fused}: residual {residual.shape}, out {out.shape} and norm_weight {norm_weight.shape} "
                             f"must be [{T}, {rows}], [{T}, {rows}] and [{rows}]")
        y = self._linear(w).matmul_f32(self, x, w)
        self._k["residual_add_rmsnorm_f32_f16"]((T,), (RMS_THREADS,), (y, residual, norm_weight, out, _i32(rows),
                                                                      np.float32(eps)))
        return True

    def o_proj_residual_rmsnorm(self, x, w, residual, norm_weight, eps, out):
        if not self._residual_rmsnorm("o_proj_residual_rmsnorm", x, w, residual, norm_weight, eps, out):
            super().o_proj_residual_rmsnorm(x, w, residual, norm_weight, eps, out)

    def down_residual_rmsnorm(self, x, w, residual, norm_weight, eps, out):
        if not self._residual_rmsnorm("down_residual_rmsnorm", x, w, residual, norm_weight, eps, out):
            super().down_residual_rmsnorm(x, w, residual, norm_weight, eps, out)

    def gate_up_silu(self, x, w, out):
        _need(x, np.float16, "x"), _need(out, np.float16, "out")
        lin, T, inter = self._linear(w), x.shape[0], w.out_features // 2
        if T <= self.gemv_max_tokens:
            lin.gemv(self, "gate_up_silu", x, w, inter, out)
        else:
            y = lin.matmul_f32(self, x, w)
            self._k["epi_silu_mul_f16"](_rows_grid(T, inter), (_EW_BLOCK,), (y, out, _i32(T), _i32(inter)))

    # --- the other ops ------------------------------------------------------------------------

    def embed(self, ids, table, out):
        _need(ids, np.int32, "ids"), _need(table, np.float16, "table"), _need(out, np.float32, "out")
        V, H = table.shape
        self._k["embed_f16_f32"]((ids.shape[0],), (256,), (ids, table, out, _i32(V), _i32(H)))

    def rmsnorm(self, x, weight, eps, out):
        if x.dtype != np.float32 or x.strides[-1] != 4:
            raise TypeError("x: expected fp32 rows with contiguous elements")
        _need(weight, np.float16, "weight"), _need(out, np.float16, "out")
        T, H = x.shape
        threads = self.rmsnorm_threads_one if T == 1 else RMS_THREADS
        if not (threads % 32 == 0 and 32 <= threads <= RMS_THREADS_ONE):
            raise ValueError(f"rmsnorm_threads_one {threads} is not a multiple of 32 from 32 to {RMS_THREADS_ONE}")
        self._k["rmsnorm_f32_f16"]((T,), (threads,), (x, weight, out, _i32(H), np.int64(x.strides[0] // 4), np.float32(eps),
                                                      _i32(1 if self.rmsnorm_held else 0)))

    def _rope_inv_freq(self, theta: float, d: int) -> cp.ndarray:
        key = (float(theta), d)
        if key not in self._inv_freq:  # NumPy's expression, so both backends use the same fp32 values
            inv = (1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(np.float32)
            self._inv_freq[key] = cp.asarray(inv)
        return self._inv_freq[key]

    def rope_kv_write(self, qkv, positions, k_pages, v_pages, page_table, theta, q_out):
        _need(qkv, np.float16, "qkv"), _need(positions, np.int32, "positions"), _need(page_table, np.int32, "page_table")
        _need(k_pages, np.float16, "k_pages"), _need(v_pages, np.float16, "v_pages"), _need(q_out, np.float16, "q_out")
        T, nq, d = q_out.shape
        nkv = k_pages.shape[1]
        # a token's rotation pairs over up to 16 blocks of 128 threads, but no more blocks in all than
        # rope_blocks_per_sm an SM: each block pays a chain of dependent loads (position, page, row) before
        # its pairs (a 512-token prefill on an H200: 25.4 us a call at 16 blocks a token, 15.7 at 2 in
        # another run; in one run, with rmsnorm_held, TTFT 30.90 -> 30.88 ms: within noise, bench/NOTES.md v5)
        cap = -(-self.rope_blocks_per_sm * self.sms // T) if self.rope_blocks_per_sm > 0 else 16
        blocks = max(1, min(16, -(-((nq + nkv) * d // 2) // 128), cap))
        self._k["rope_kv_write_f16"]((T, blocks), (128,), (qkv, positions, self._rope_inv_freq(theta, d), k_pages, v_pages,
                                                   page_table, q_out, _i32(nq), _i32(nkv), _i32(d)))

    def attention_kernel(self, nq: int, nkv: int, d: int) -> str:
        """The kernel `attention_variant` names for this head layout (catalog.attention_kernel)."""
        return catalog.attention_kernel(self.attention_variant, nq, nkv, d)

    def attention_plan(self, T: int, nq: int, nkv: int, d: int, max_pages: int, split: bool) -> AttentionPlan:
        """The launch of attention over a page table of `max_pages` for T tokens with this backend's settings
        (attention_variant, pages_per_split, att_blocks): catalog.attention_plan."""
        return catalog.attention_plan(self.attention_variant, T, nq, nkv, d, max_pages, split, self.pages_per_split,
                                      self.att_blocks)

    def _attention(self, q, k_pages, v_pages, page_table, positions, out, split: bool):
        _need_attention(q, k_pages, v_pages, page_table, positions, out)
        T, nq, d = q.shape
        nkv, max_pages = k_pages.shape[1], page_table.shape[0]
        plan = self.attention_plan(T, nq, nkv, d, max_pages, split)
        splits = plan.splits
        if splits == 1:
            dummy = out  # partial buffers are not touched with one split
            args = (q, k_pages, v_pages, page_table, positions, out, dummy, dummy, dummy)
        else:
            pm = self.scratch("att_m", (T, nq, splits), np.float32)
            pl = self.scratch("att_l", (T, nq, splits), np.float32)
            pa = self.scratch("att_acc", (T, nq, splits, d), np.float32)
            args = (q, k_pages, v_pages, page_table, positions, out, pm, pl, pa)
        self._k[plan.kernel]((nkv, T, splits), (plan.threads,),
                             (*args, _i32(nq), _i32(nkv), _i32(d), _i32(plan.pages_per_split), _i32(max_pages),
                              np.float32(1.0 / np.sqrt(d))), shared_mem=plan.smem)
        if plan.combines:
            self._k["attention_combine_f16"]((nq, T), (COMBINE_THREADS,), (pm, pl, pa, out, _i32(nq), _i32(d), _i32(splits)))

    def attention_prefill(self, q, k_pages, v_pages, page_table, positions, out):
        T, nq, d = q.shape
        nkv = k_pages.shape[1]
        variant = self.attention_prefill_variant
        if variant not in ATTENTION_PREFILL_VARIANTS:
            raise ValueError(f"attention_prefill_variant {variant!r} is not one of {ATTENTION_PREFILL_VARIANTS}")
        if T > 1 and variant in ("wgmma", "tc") and d in ATT_WARP_HEAD_DIMS and nq // nkv <= TC_ROWS:
            _need_attention(q, k_pages, v_pages, page_table, positions, out)
            qt = TC_ROWS // (nq // nkv)  # query tokens per block
            smem = 0
            if variant == "wgmma":  # two stages of K and V, [64 keys][d] halves each
                smem = 2 * 2 * WG_ATT_KEYS * d * 2
                name = f"attention_prefill_wg_d{d}"
                if name not in self._att_smem_set:  # a function attribute: past 48 KB only on request
                    self._k[name].kernel.max_dynamic_shared_size_bytes = smem
                    self._att_smem_set.add(name)
            else:
                name = f"attention_prefill_tc_d{d}"
            self._k[name]((nkv, -(-T // qt)), (128,),
                          (q, k_pages, v_pages, page_table, positions, out, _i32(nq), _i32(nkv), _i32(T), _i32(qt),
                           _i32(page_table.shape[0]), np.float32(1.0 / np.sqrt(d))), shared_mem=smem)
            return
        saved = self.attention_variant
        if variant in ATTENTION_VARIANTS:
            self.attention_variant = variant
        try:
            self._attention(q, k_pages, v_pages, page_table, positions, out, split=T == 1)
        finally:
            self.attention_variant = saved

    def attention_decode(self, q, k_pages, v_pages, page_table, positions, out):
        self._attention(q, k_pages, v_pages, page_table, positions, out, split=True)

    def lm_head(self, x, weight, out):
        _need(x, np.float16, "x"), _need(weight, np.float16, "weight"), _need(out, np.float32, "out")
        V, H = weight.shape
        if H % 8:
            raise ValueError(f"lm_head: hidden size {H} is not a multiple of 8 (16-byte loads)")
        if x.data.ptr % 16 or weight.data.ptr % 16:
            raise ValueError("lm_head: x and weight must be 16-byte aligned (16-byte loads)")
        T = x.shape[0]
        self._k["lm_head_f16_f32"]((-(-V // (LM_WARPS * LM_ROWS)), T), (LM_WARPS * 32,), (x, weight, out, _i32(V), _i32(H)))

    def decode_advance(self, next_id, ids, positions):
        """ids[0] = next_id[0]; positions[0] += 1 (on the device; the fast decode loop's glue)."""
        self._k["decode_advance_i32"]((1,), (32,), (next_id, ids, positions))

    def argmax(self, logits, out):
        _need(logits, np.float32, "logits"), _need(out, np.int32, "out")
        V = logits.size
        if V <= 32768:
            self._k["argmax_f32_i32"]((1,), (ARGMAX_THREADS,), (logits, np.uint64(0), out, _i32(V)))  # null part_i
            return
        nb = min(132, -(-V // ARGMAX_THREADS))
        pv = self.scratch("argmax_v", (nb,), np.float32)
        pi = self.scratch("argmax_i", (nb,), np.int32)
        self._k["argmax_partial_f32"]((nb,), (ARGMAX_THREADS,), (logits, pv, pi, _i32(V)))
        self._k["argmax_f32_i32"]((1,), (ARGMAX_THREADS,), (pv, pi, out, _i32(nb)))
