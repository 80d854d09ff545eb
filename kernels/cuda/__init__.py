"""The CUDA backend: every op of docs/BACKEND.md on an NVIDIA GPU (sm_90) through CuPy.

Thin launchers over the kernels in this folder (one `.cu` per op family, compiled once by loader.py).
Imported only by `kernels.get_backend("cuda")`: nothing on the CPU path imports CuPy. Follows the NumPy
backend (kernels/numpy/, the executable spec) op for op, with the same precision contract: fp32
residual, fp16 activations and KV pages, fp32 accumulation, fp32 logits, lowest index on an argmax tie,
no atomics (results do not depend on timing).

Paths: with T = 1 (decode) the quantized linears are INT4 GEMV kernels that unpack in registers, split
over the input dimension inside each block (`gemv_config` picks threads and rows per block for each
op). With T > 1 (prefill) a tensor-core kernel multiplies fp16 x by the unscaled nibbles (exact in
fp16) one 128-group at a time with fp32 accumulation and applies the scales per group (no weight is
rounded), then a fused epilogue kernel runs. Attention with T = 1 splits the used pages evenly over a
fixed number of blocks (computed on the device from the current length) and merges the splits in a
fixed order.

Every launch goes to CuPy's current stream, and nothing in a T = 1 op allocates memory once its scratch
exists, so the decode step can be captured as a CUDA graph (engine/cuda_graph.py).
"""

from __future__ import annotations

import numpy as np

from kernels.base import Backend, BackendUnavailableError, FormatNotSupportedError, QuantizedWeight

try:
    import cupy as cp
except ImportError as e:  # re-raised by get_backend as BackendUnavailableError
    raise ImportError(f"CuPy is not importable: {e}") from e

from kernels.cuda import loader

PAGE = 16
GROUP = 128
# GEMV variant per op, each one of int4_gemv.cu's entry points int4_gemv_*_{variant}: "t{threads}_r{rows}"
# (CUDA cores: threads per block, accumulator rows per block, gate/up counting gate and up rows) or
# "tc_w{warps}_u{groups}" (tensor cores: 16-row tiles, warps per block, groups per load batch).
GEMV_VARIANTS = ("t64_r4", "t128_r4", "t128_r8", "t256_r8", "tc_w4_u4", "tc_w8_u4", "tc_w8_u2")
# the fastest per op in the bench sweep on an H200 (bench/NOTES.md, v2); `nanoqwen bench` re-picks on its machine
GEMV_CONFIG = {"qkv_proj": "tc_w8_u4", "o_proj_residual": "t128_r4", "gate_up_silu": "tc_w4_u4", "down_residual": "t128_r4"}
MMA_BM, MMA_BN = 64, 128  # must match int4_gemv.cu
LM_WARPS, LM_ROWS = 4, 4  # must match embed_lmhead_argmax.cu
ATT_THREADS, ATT_MAX_ITEMS = 128, 16  # must match paged_attention.cu
SHARED_LIMIT = 48 * 1024  # static+dynamic shared memory without an opt-in attribute
_EW_BLOCK = 256


def _i32(v):
    return np.int32(v)


def _blocks(n: int, block: int = _EW_BLOCK, cap: int = 65535) -> int:
    return max(1, min(cap, -(-n // block)))


def _need(a, dtype, name: str):
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{name}: expected a CuPy array on the cuda backend, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected {np.dtype(dtype)}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    return a


def _device_name(device: int) -> str:
    name = cp.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


class CudaBackend(Backend):
    name = "cuda"
    formats = ("int4_sym_g128",)
    supports_graphs = True  # every T = 1 op launches on the current stream and allocates nothing
    needs_device = True

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, no device
            return False, f"CuPy sees no CUDA device ({type(e).__name__}: {e})"
        if n == 0:
            return False, "CuPy sees no CUDA device"
        return True, _device_name(0)

    @classmethod
    def worker_options(cls, worker: int) -> dict:
        """Parallel test worker N takes GPU N modulo the GPU count."""
        return {"device": worker % cp.cuda.runtime.getDeviceCount()}

    @property
    def device_name(self) -> str:
        return _device_name(cp.cuda.Device().id)

    def __init__(self, device: int | None = None, pages_per_split: int | None = None):
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, no device
            raise BackendUnavailableError(f"backend 'cuda' sees no CUDA device: {e}") from None
        if n == 0:
            raise BackendUnavailableError("backend 'cuda' sees no CUDA device")
        if device is not None:
            cp.cuda.Device(device).use()
        # decode attention: KV pages per block (split-K); None spreads the used pages over att_blocks
        # blocks, computed on the device from the current length (the split count is fixed per launch)
        self.pages_per_split = pages_per_split
        self.att_blocks = 2 * cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
        self.gemv_config = dict(GEMV_CONFIG)
        self.gemv_max_tokens = 1  # T above this takes the dequantize + cuBLAS path
        self._k = loader.kernels()
        self._scratch: dict[str, cp.ndarray] = {}
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

    def scratch(self, key: str, shape, dtype) -> cp.ndarray:
        """A reusable buffer of at least `shape`; never freed while the backend lives (graph safety)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buf = self._scratch.get(key)
        if buf is None or buf.nbytes < n:
            if buf is not None:
                self._retired.append(buf)
            buf = cp.empty(max(n, 256), dtype=np.uint8)
            self._scratch[key] = buf
        return buf[:n].view(dtype).reshape(shape)

    def prepare_linear(self, fmt: str, tensors: dict, out_features: int, in_features: int) -> QuantizedWeight:
        if fmt not in self.formats:
            raise FormatNotSupportedError(f"backend 'cuda' has no kernel for format {fmt!r}")
        if in_features % GROUP:
            raise ValueError(f"in_features {in_features} is not a multiple of the group size {GROUP}")
        qweight = np.ascontiguousarray(tensors["qweight"], dtype=np.uint32)
        scales = np.ascontiguousarray(tensors["scales"], dtype=np.float16)
        if qweight.shape != (out_features, in_features // 8) or scales.shape != (out_features, in_features // GROUP):
            raise ValueError(f"int4_sym_g128 tensors of shapes {qweight.shape}, {scales.shape} do not fit a "
                             f"[{out_features}, {in_features}] weight")
        return QuantizedWeight(fmt, out_features, in_features, {"qweight": cp.asarray(qweight), "scales": cp.asarray(scales)})

    # --- quantized linears --------------------------------------------------------------------

    def _weight(self, w) -> tuple[cp.ndarray, cp.ndarray]:
        if w.format not in self.formats:
            raise FormatNotSupportedError(f"backend 'cuda' has no kernel for format {w.format!r}")
        return w["qweight"], w["scales"]

    def _gemv(self, op: str, kernel: str, x, w, rows: int, *args) -> None:
        qweight, scales = self._weight(w)
        if x.data.ptr % 16:
            raise ValueError("x: the GEMV kernels read activations in 16-byte loads; x is not 16-byte aligned")
        variant = self.gemv_config[op]
        if variant not in GEMV_VARIANTS:
            raise ValueError(f"gemv_config[{op!r}] = {variant!r} is not one of {GEMV_VARIANTS}")
        silu = op == "gate_up_silu"
        if variant.startswith("tc_"):
            threads = 32 * int(variant.split("_")[1][1:])
            per_block = 8 if silu else 16
        else:
            threads, r = (int(v[1:]) for v in variant.split("_"))
            per_block = r // 2 if silu else r
        T = x.shape[0]
        grid = (-(-rows // per_block), T)
        self._k[f"{kernel}_{variant}"](grid, (threads,), (x, qweight, scales, *args, _i32(rows), _i32(w.in_features)))

    def _matmul_f32(self, x, w):
        """fp32 [T, out] = x W^T on the tensor cores, exact products, fp32 sums (prefill path)."""
        qweight, scales = self._weight(w)
        if x.data.ptr % 16:
            raise ValueError("x: the prefill kernel reads activations in 16-byte loads; x is not 16-byte aligned")
        T, N, K = x.shape[0], w.out_features, w.in_features
        y = self.scratch("prefill_y", (T, N), np.float32)
        self._k["int4_mma_f32"]((-(-N // MMA_BN), -(-T // MMA_BM)), (256,), (x, qweight, scales, y, _i32(T), _i32(N), _i32(K)))
        return y

    def qkv_proj(self, x, w, bias, out):
        _need(x, np.float16, "x"), _need(bias, np.float16, "bias"), _need(out, np.float16, "out")
        T, rows = x.shape[0], w.out_features
        if T <= self.gemv_max_tokens:
            self._gemv("qkv_proj", "int4_gemv_bias_f16", x, w, rows, bias, out)
        else:
            y = self._matmul_f32(x, w)
            self._k["epi_bias_f16"]((_blocks(T * rows),), (_EW_BLOCK,), (y, bias, out, _i32(T), _i32(rows)))

    def _linear_residual(self, op, x, w, residual):
        _need(x, np.float16, "x"), _need(residual, np.float32, "residual")
        T, rows = x.shape[0], w.out_features
        if T <= self.gemv_max_tokens:
            self._gemv(op, "int4_gemv_residual_f32", x, w, rows, residual)
        else:
            y = self._matmul_f32(x, w)
            self._k["epi_residual_f32"]((_blocks(T * rows),), (_EW_BLOCK,), (y, residual, _i32(T), _i32(rows)))

    def o_proj_residual(self, x, w, residual):
        self._linear_residual("o_proj_residual", x, w, residual)

    def down_residual(self, x, w, residual):
        self._linear_residual("down_residual", x, w, residual)

    def gate_up_silu(self, x, w, out):
        _need(x, np.float16, "x"), _need(out, np.float16, "out")
        T, inter = x.shape[0], w.out_features // 2
        if T <= self.gemv_max_tokens:
            self._gemv("gate_up_silu", "int4_gemv_silu_mul_f16", x, w, inter, out)
        else:
            y = self._matmul_f32(x, w)
            self._k["epi_silu_mul_f16"]((_blocks(T * inter),), (_EW_BLOCK,), (y, out, _i32(T), _i32(inter)))

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
        self._k["rmsnorm_f32_f16"]((T,), (1024 if T == 1 else 256,), (x, weight, out, _i32(H), np.int64(x.strides[0] // 4), np.float32(eps)))

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
        blocks = max(1, min(16, -(-((nq + nkv) * d // 2) // 128)))
        self._k["rope_kv_write_f16"]((T, blocks), (128,), (qkv, positions, self._rope_inv_freq(theta, d), k_pages, v_pages,
                                                   page_table, q_out, _i32(nq), _i32(nkv), _i32(d)))

    def _attention(self, q, k_pages, v_pages, page_table, positions, out, split: bool):
        _need(q, np.float16, "q"), _need(k_pages, np.float16, "k_pages"), _need(v_pages, np.float16, "v_pages")
        _need(page_table, np.int32, "page_table"), _need(positions, np.int32, "positions"), _need(out, np.float16, "out")
        T, nq, d = q.shape
        nkv = k_pages.shape[1]
        group = nq // nkv
        if group * d > ATT_THREADS * ATT_MAX_ITEMS:
            raise ValueError(f"attention: {group} query heads per KV head x head_dim {d} exceeds the kernel's "
                             f"{ATT_THREADS * ATT_MAX_ITEMS} accumulators per block")
        smem = 4 * (PAGE * (d + 1) + PAGE * d + group * d + group * PAGE + 3 * group)
        if smem > SHARED_LIMIT:
            raise ValueError(f"attention: head_dim {d} with {group} heads per KV head needs {smem} B of shared memory")
        max_pages = page_table.shape[0]
        if not split:
            pps, splits = max_pages, 1
        elif self.pages_per_split:
            pps = self.pages_per_split
            splits = -(-max_pages // pps)
        else:  # dynamic: the kernel spreads the used pages over `splits` blocks per (KV head, token)
            pps, splits = 0, max(1, min(max_pages, -(-self.att_blocks // (nkv * T))))
        scale = np.float32(1.0 / np.sqrt(d))
        if splits == 1:
            dummy = out  # partial buffers are not touched with one split
            args = (q, k_pages, v_pages, page_table, positions, out, dummy, dummy, dummy)
        else:
            pm = self.scratch("att_m", (T, nq, splits), np.float32)
            pl = self.scratch("att_l", (T, nq, splits), np.float32)
            pa = self.scratch("att_acc", (T, nq, splits, d), np.float32)
            args = (q, k_pages, v_pages, page_table, positions, out, pm, pl, pa)
        self._k["paged_attention_f16"]((nkv, T, splits), (ATT_THREADS,),
                                       (*args, _i32(nq), _i32(nkv), _i32(d), _i32(pps), _i32(max_pages), scale),
                                       shared_mem=smem)
        if splits > 1:
            self._k["attention_combine_f16"]((nq, T), (min(128, -(-d // 32) * 32),),
                                             (pm, pl, pa, out, _i32(nq), _i32(d), _i32(splits)))

    def attention_prefill(self, q, k_pages, v_pages, page_table, positions, out):
        self._attention(q, k_pages, v_pages, page_table, positions, out, split=q.shape[0] == 1)

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
            self._k["argmax_f32_i32"]((1,), (1024,), (logits, np.uint64(0), out, _i32(V)))  # null part_i
            return
        nb = min(132, -(-V // 1024))
        pv = self.scratch("argmax_v", (nb,), np.float32)
        pi = self.scratch("argmax_i", (nb,), np.int32)
        self._k["argmax_partial_f32"]((nb,), (1024,), (logits, pv, pi, _i32(V)))
        self._k["argmax_f32_i32"]((1,), (1024,), (pv, pi, out, _i32(nb)))
