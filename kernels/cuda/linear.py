"""The launcher side of a quantized format's linears on the CUDA backend, shared by every format.

Each format's module here (`kernels/cuda/<format>.py`, listed by catalog.py) builds its `LINEAR` from
these classes; CudaBackend calls it for the four quantized ops:

- `prepare(backend, tensors, out, in)` checks the file's host tensors against the layout the kernels
  read (names, dtypes, shapes, `in` a multiple of the format's load width or group) and copies them to
  the GPU; a mismatch is a ValueError naming the tensor;
- `gemv(backend, op, x, w, rows, *epilogue_args)`, the decode path (T <= backend.gemv_max_tokens):
  the format's GEMV entry point for `op` in the variant `backend.gemv_config[format][op]`, epilogue
  fused (qkv_proj: bias, out; o_proj_residual / down_residual: residual; gate_up_silu: out, with `rows`
  = I and w's rows [gate; up]);
- `matmul_f32(backend, x, w)`, the prefill path: fp32 [T, out] = x W^T; the backend then runs the
  shared epilogue kernels (epilogues.cu). `DequantLinear` does it with the format's dequantize kernel
  into an fp32 scratch weight (every shipped format's values are exact in fp32) and one cuBLAS fp32
  GEMM; `PipeLinear` (the 8-bit formats, int4_asym_g128) may instead take the format's tensor-core
  ring kernels (pipe8.cuh, int4_pipe.cuh), and the INT4 formats their wgmma kernel (int4_wgmma.cuh,
  `launch_wgmma`); int4_sym_g128 has its own launcher for its tensor-core kernels.

Nothing here allocates on the T = 1 path (graph capture); scratch comes from `backend.scratch`, never
freed while the backend lives.
"""

from __future__ import annotations

import os

import cupy as cp
import numpy as np

from kernels.cuda import catalog, loader

_EW_BLOCK = 256


def i32(v) -> np.int32:
    return np.int32(v)


def blocks(n: int, block: int = _EW_BLOCK, cap: int = 65535) -> int:
    """Blocks for a grid-stride loop over n elements."""
    return max(1, min(cap, -(-n // block)))


# int4_wgmma.cuh's geometry, read from its source: 384 threads (a producer warpgroup, two consumers), 128 x
# 128 tiles, WG_SMEM bytes of dynamic shared memory (above the 48 KB a launch gets without asking)
_WG = catalog.defines("int4_wgmma.cuh")
WG_THREADS, WG_BM, WG_BN, WG_SMEM = _WG["WG_THREADS"], _WG["WG_BM"], _WG["WG_BN"], _WG["WG_SMEM"]
WG_GROUP_N = _WG["WG_GROUP_N"]
WG_CARRY_FLOATS = 64 * 256  # a spread block's carry slot: each consumer thread's 64 fp32 totals
WG_SPREAD_GAIN = 1.05  # spread a launch when one block a tile runs at least this many times its work's waves
_WG_READY: set = set()  # (kernel, device) whose dynamic shared-memory limit was raised to WG_SMEM


def wgmma_spread_blocks(T: int, N: int, blocks: int) -> int:
    """Blocks for the wgmma kernel's spread launch over the T x N tiles (int4_wgmma.cuh), or 0 for one
    block a tile. `blocks` is the backend's `wgmma_spread_blocks` (its SM count; 0: never spread).

    Spread only where it pays and stays right:
    - more tiles than blocks: each block's share (at least one tile's groups) then cuts a tile between two
      blocks at most, and every block is resident at once (one an SM), as the carry's wait needs;
    - one block a tile would lose at least 5% to its last wave (WG_SPREAD_GAIN): the 7B qkv_proj at 512
      tokens is 144 tiles, two waves on 132 SMs for 1.09 waves' work; gate_up's 1,184 are 8.97 waves in 9;
    - at most WG_GROUP_N token tiles (2,048 tokens): the spread takes tiles in the grid's order, whose waves
      reread x, which L2 holds up to there (past it, the grouped launch order)."""
    mt, nt = -(-T // WG_BM), -(-N // WG_BN)
    tiles = mt * nt
    if blocks <= 0 or tiles <= blocks or mt > WG_GROUP_N:
        return 0
    if -(-tiles // blocks) * blocks < WG_SPREAD_GAIN * tiles:
        return 0
    return blocks


def launch_wgmma(backend, kernel_name: str, x, weight_args: tuple, y, T: int, N: int, K: int) -> None:
    """One of int4_wgmma.cuh's entry points: y fp32 [T, N] = x W^T, x (fp16 [T, K], row-major) handed over
    as its tensor map (TMA boxes of 128 tokens x 64 inputs, one swizzle atom each). One block a tile, grid
    (token tiles, weight-row tiles): the token tiles of a weight tile run side by side (the kernel's header
    says why); or spread over `wgmma_spread_blocks` blocks (above), with a carry slot and a flag a block."""
    if not x.flags.c_contiguous or x.shape != (T, K):
        raise ValueError(f"launch_wgmma: x must be a row-major fp16 [{T}, {K}], not {x.shape} (contiguous: "
                         f"{x.flags.c_contiguous})")
    xmap = loader.tensor_map_2d(x.data.ptr, T, K, WG_BM, 64)
    kernel = loader.kernels()[kernel_name]
    key = (kernel_name, cp.cuda.Device().id)
    if key not in _WG_READY:  # a function attribute, per device
        kernel.kernel.max_dynamic_shared_size_bytes = WG_SMEM
        _WG_READY.add(key)
    P = wgmma_spread_blocks(T, N, getattr(backend, "wgmma_spread_blocks", 0))
    if P:
        carry = backend.scratch("wgmma_carry", (P, WG_CARRY_FLOATS), np.float32)
        flags = backend.scratch("wgmma_flags", (P,), np.uint32, zeroed=True)  # each launch leaves them 0
        grid, links = (P,), (carry, flags)
    else:
        grid, links = (-(-T // WG_BM), -(-N // WG_BN)), (np.uint64(0), np.uint64(0))
    kernel(grid, (WG_THREADS,), (xmap, *weight_args, y, i32(T), i32(N), i32(K), *links), shared_mem=WG_SMEM)


class GemvLinear:
    """A format whose decode path is one GEMV entry point per (op, variant).

    `specs(out, in)` -> {tensor name: (dtype, shape)}: the layout the kernels read, in the order the
    kernels take the tensors after x. `in_multiple`: inputs must be a multiple of it (16-byte loads of
    a row, or a scale group).
    """

    def __init__(self, name: str, *, specs, in_multiple: int, gemv_kernel: str, variants: tuple[str, ...],
                 default_config: dict[str, str]):
        self.name = name
        self.specs = specs
        self.in_multiple = in_multiple
        self.gemv_kernel = gemv_kernel
        self.variants = tuple(variants)
        self.default_config = dict(default_config)
        # Per-launch work done once (the eager decode step calls gemv 96 times at 24 layers, on the host's
        # clock): the tensor order of each weight shape, and each (op, variant)'s kernel and geometry.
        self._arg_names: dict[tuple[int, int], tuple[str, ...]] = {}
        self._launches: dict[tuple[str, str], tuple] = {}

    # --- weights --------------------------------------------------------------------------------

    def prepare(self, backend, tensors: dict, out_features: int, in_features: int) -> dict:
        if in_features % self.in_multiple:
            raise ValueError(f"{self.name}: {in_features} inputs are not a multiple of {self.in_multiple}, "
                             f"which its CUDA kernels read in whole chunks")
        host = {}
        for key, (dtype, shape) in self.specs(out_features, in_features).items():
            if key not in tensors:
                raise ValueError(f"{self.name}: tensor {key!r} is missing (got {sorted(tensors)})")
            a = np.asarray(tensors[key])
            if a.dtype != np.dtype(dtype):
                raise ValueError(f"{self.name}: tensor {key!r} is {a.dtype}, the kernels read {np.dtype(dtype)}")
            if a.shape != tuple(shape):
                raise ValueError(f"{self.name}: tensor {key!r} has shape {a.shape}, a [{out_features}, {in_features}] "
                                 f"weight needs {tuple(shape)}")
            host[key] = np.ascontiguousarray(a)
        self.check_values(host)
        return {k: cp.asarray(v) for k, v in host.items()}

    def check_values(self, host: dict[str, np.ndarray]) -> None:
        """Refuse stored values the kernels would misread (ValueError); most formats have none."""

    def weight_args(self, w) -> tuple:
        shape = (w.out_features, w.in_features)
        names = self._arg_names.get(shape)
        if names is None:
            names = self._arg_names[shape] = tuple(self.specs(*shape))
        return tuple(w[k] for k in names)

    # --- decode ---------------------------------------------------------------------------------

    def gemv(self, backend, op: str, x, w, rows: int, *epilogue_args) -> None:
        if x.data.ptr % 16:
            raise ValueError("x: the GEMV kernels read activations in 16-byte loads; x is not 16-byte aligned")
        variant = backend.gemv_config[self.name][op]
        launch = self._launches.get((op, variant))
        if launch is None:
            if variant not in self.variants:
                raise ValueError(f"gemv_config[{self.name!r}][{op!r}] = {variant!r} is not one of {self.variants}")
            threads, per_block = catalog.variant_geometry(variant, op == "gate_up_silu")
            kernel = loader.kernels()[catalog.gemv_kernel_name(self.gemv_kernel, op, variant)]
            launch = self._launches[(op, variant)] = (kernel, threads, per_block)
        kernel, threads, per_block = launch
        kernel((-(-rows // per_block), x.shape[0]), (threads,),
               (x, *self.weight_args(w), *epilogue_args, i32(rows), i32(w.in_features)))

    # --- prefill --------------------------------------------------------------------------------

    def matmul_f32(self, backend, x, w):
        raise NotImplementedError


class DequantLinear(GemvLinear):
    """A GemvLinear whose prefill path dequantizes into fp32 and multiplies on cuBLAS in fp32.

    `dequant_kernel(weight tensors..., float* w, int rows, int in_f)` writes the exact fp32 weight
    [out, in] (grid-stride; `dequant_items(out, in)` is how many items its loop covers). The GEMM is
    cupy.dot(x32, W32.T) into scratch: both operands are exact copies (x fp16 -> fp32, W exact), the
    products and sums are fp32, and cuBLAS gives the same bits on every run on one GPU model (no
    atomics in a plain GEMM). TF32 would round the weights to 10 mantissa bits: CuPy uses it only
    when CUPY_TF32 is set, which this refuses.
    """

    def __init__(self, name: str, *, dequant_kernel: str, dequant_items, **kw):
        super().__init__(name, **kw)
        self.dequant_kernel = dequant_kernel
        self.dequant_items = dequant_items

    def matmul_f32(self, backend, x, w):
        if int(os.environ.get("CUPY_TF32", "0") or 0) > 0:
            raise RuntimeError(f"{self.name}: CUPY_TF32 is set, so cuBLAS would round fp32 weights to TF32; "
                               "the prefill path needs fp32 products (unset CUPY_TF32)")
        T, N, K = x.shape[0], w.out_features, w.in_features
        wf = backend.scratch("prefill_w_f32", (N, K), np.float32)
        n = self.dequant_items(N, K)
        loader.kernels()[self.dequant_kernel]((blocks(n),), (_EW_BLOCK,), (*self.weight_args(w), wf, i32(N), i32(K)))
        xf = backend.scratch("prefill_x_f32", (T, K), np.float32)
        xf[...] = x  # fp16 -> fp32, exact
        y = backend.scratch("prefill_y", (T, N), np.float32)
        cp.dot(xf, wf.T, out=y)  # both operands in cuBLAS's own layouts: no copies
        return y


class PipeLinear(DequantLinear):
    """A DequantLinear whose prefill can also run on the tensor cores: `<name>_mma_pipe_f32` ("pipe", 128 x
    128 tiles) or `<name>_mma_pipe64_f32` ("pipe64", 64 x 128 tiles), each called as (x, the weight
    tensors, y, T, N, K). The 8-bit formats' come from pipe8.cuh (each weight decoded to its exact fp16
    value in the B fragments, the row's scale once at the end), int4_asym_g128's from int4_pipe.cuh
    (q - z exact in fp16, each group's scale on its partial); both keep 128-input fp32 partials.
    `backend.prefill_variant[name]` picks among `prefill_variants`; "cublas" is DequantLinear's
    dequantize-and-cuBLAS path; "wgmma" (where `wgmma_kernel` names one) the format's int4_wgmma.cuh
    kernel; "auto" (with `pipe_from_tokens`) takes "pipe64" below that many tokens and, from there,
    `auto_from` ("pipe" unless set)."""

    PIPE_KERNELS = {"pipe": ("_mma_pipe_f32", 128), "pipe64": ("_mma_pipe64_f32", 64)}  # suffix, tokens a tile
    PIPE_BN = 128  # weight rows a tile: pipe8.cuh P8_BN, int4_pipe.cuh PIPE_BN

    def __init__(self, name: str, *, prefill_variants: tuple, default_prefill: str, pipe_from_tokens: int | None = None,
                 wgmma_kernel: str | None = None, auto_from: str = "pipe", **kw):
        super().__init__(name, **kw)
        known = {"cublas", *self.PIPE_KERNELS, *(("wgmma",) if wgmma_kernel else ())}
        if pipe_from_tokens and auto_from not in known:
            raise ValueError(f"{name}: auto_from {auto_from!r} is not among {', '.join(sorted(known))}")
        known |= {"auto"} if pipe_from_tokens else set()
        unknown = set(prefill_variants) - known
        if unknown or default_prefill not in prefill_variants:
            raise ValueError(f"{name}: prefill variants {prefill_variants} (default {default_prefill!r}) are not "
                             f"among {', '.join(sorted(known))}")
        self.prefill_variants, self.default_prefill = tuple(prefill_variants), default_prefill
        self.pipe_from_tokens = pipe_from_tokens
        self.wgmma_kernel, self.auto_from = wgmma_kernel, auto_from

    def matmul_f32(self, backend, x, w):
        variant = getattr(backend, "prefill_variant", {}).get(self.name, self.default_prefill)
        if variant not in self.prefill_variants:
            raise ValueError(f"prefill_variant[{self.name!r}] = {variant!r} is not one of {self.prefill_variants}")
        if variant == "cublas":
            return super().matmul_f32(backend, x, w)
        if x.data.ptr % 16:
            raise ValueError("x: the prefill kernel reads activations in 16-byte loads; x is not 16-byte aligned")
        T, N, K = x.shape[0], w.out_features, w.in_features
        if variant == "auto":
            variant = self.auto_from if T >= self.pipe_from_tokens else "pipe64"
        y = backend.scratch("prefill_y", (T, N), np.float32)
        if variant == "wgmma":
            launch_wgmma(backend, self.wgmma_kernel, x, self.weight_args(w), y, T, N, K)
            return y
        suffix, bm = self.PIPE_KERNELS[variant]
        loader.kernels()[self.name + suffix]((-(-N // self.PIPE_BN), -(-T // bm)), (256,),
                                             (x, *self.weight_args(w), y, i32(T), i32(N), i32(K)))
        return y
