"""The `int4_sym_g128` linears on the CUDA backend: the launcher of int4_sym_g128.cu.

qweight uint32 [out, in/8] (ValueShuffle nibbles), scales fp16 [out, in/128] (docs/FORMAT.md), read as
stored. Decode: the GEMV entry points int4_gemv_<epilogue>_<variant>, CUDA-core "t<threads>_r<R>" or
tensor-core "tc_w<warps>_u<groups>" (int4_sym_g128.cu explains both). Prefill: tensor-core kernels that
multiply fp16 x by the unscaled nibbles (exact in fp16) one 128-group at a time with fp32 accumulation
and scale each group's partial (no weight is rounded): the warp-specialized wgmma kernel int4_wgmma_f32
("wgmma", int4_wgmma.cuh), the cp.async ring int4_mma_pipe_f32 ("pipe"), its 64-token tiles ("pipe64")
or the register-staged int4_mma_f32 ("mma"); `backend.prefill_variant` picks, and the default "auto"
takes "mma" below WGMMA_FROM_TOKENS tokens and "wgmma" from there (bench/prefill_gemm.py measured the
crossing on an H200, bench/NOTES.md v4 and v5). All of them give the same bits.
"""

from __future__ import annotations

import numpy as np

from kernels.cuda import loader
from kernels.cuda.linear import GemvLinear, i32, launch_wgmma

GROUP = 128
MMA_BM, MMA_BN = 64, 128  # must match int4_sym_g128.cu (int4_mma_f32)
PIPE_BN = 128  # must match int4_sym_g128.cu (int4_mma_pipe<MI>)
# prefill kernels: "pipe" int4_mma_pipe_f32 (cp.async ring, 128 x 128 tiles), "pipe64" the same with
# 64 x 128 tiles, "mma" int4_mma_f32 (the previous one, 64 x 128 tiles, registers staged);
# backend.prefill_variant["int4_sym_g128"] picks (the bench times each)
PREFILL_KERNELS = {"pipe": ("int4_mma_pipe_f32", 128, PIPE_BN), "pipe64": ("int4_mma_pipe64_f32", 64, PIPE_BN),
                   "mma": ("int4_mma_f32", MMA_BM, MMA_BN)}
PREFILL_VARIANTS = ("auto", "wgmma", "pipe", "pipe64", "mma")
WGMMA_KERNEL = "int4_wgmma_f32"  # "wgmma": launched by linear.launch_wgmma (its own grid, threads, shared memory)
DEFAULT_PREFILL = "auto"
# "auto": measured per layer of the 7B shape on an H200 (python -m bench.prefill_gemm, bench/NOTES.md v5),
# the wgmma kernel (x by TMA, five stages) is the fastest from 16 tokens: 0.376 ms a layer against the
# register-staged "mma"'s 0.520 at 16, 0.375 against 0.566 at 64, 28-30% ahead of the ring from 512 to 8192.
# Below 16 tokens "mma" stays (not measured there; int4_asym_g128 crosses at 16 too)
WGMMA_FROM_TOKENS = 16
GEMV_KERNEL = "int4_gemv"
CHUNK_INPUTS = 32  # inputs of one 16-byte weight load (4-bit weights): the step of the CUDA-core
# variants' thread loop (thread i takes loads i, i + threads, ...); catalog.loop_stride reads it
VARIANTS = ("t64_r4", "t128_r4", "t128_r8", "t256_r8", "tc_w4_u4", "tc_w8_u4", "tc_w8_u2", "f64_r4", "f128_r4",
            "f128_r8", "f256_r8")
# the fastest per op in the bench sweep on an H200 (bench/NOTES.md, v2); `nanoqwen bench` re-picks on its machine
DEFAULT_CONFIG = {"qkv_proj": "tc_w8_u2", "o_proj_residual": "tc_w8_u4", "gate_up_silu": "tc_w4_u4",
                  "down_residual": "tc_w8_u4"}


def specs(out_features: int, in_features: int) -> dict:
    return {"qweight": (np.uint32, (out_features, in_features // 8)),
            "scales": (np.float16, (out_features, in_features // GROUP))}


class Int4SymG128Linear(GemvLinear):
    def matmul_f32(self, backend, x, w):
        """fp32 [T, out] = x W^T on the tensor cores, exact products, fp32 sums (prefill path)."""
        if x.data.ptr % 16:
            raise ValueError("x: the prefill kernel reads activations in 16-byte loads; x is not 16-byte aligned")
        T, N, K = x.shape[0], w.out_features, w.in_features
        y = backend.scratch("prefill_y", (T, N), np.float32)
        variant = getattr(backend, "prefill_variant", {}).get(self.name, DEFAULT_PREFILL)
        if variant not in PREFILL_VARIANTS:
            raise ValueError(f"prefill_variant[{self.name!r}] = {variant!r} is not one of {PREFILL_VARIANTS}")
        if variant == "auto":
            variant = "wgmma" if T >= WGMMA_FROM_TOKENS else "mma"
        if variant == "wgmma":
            launch_wgmma(backend, WGMMA_KERNEL, x, self.weight_args(w), y, T, N, K)
            return y
        kernel, bm, bn = PREFILL_KERNELS[variant]
        loader.kernels()[kernel]((-(-N // bn), -(-T // bm)), (256,), (x, w["qweight"], w["scales"], y, i32(T), i32(N), i32(K)))
        return y


LINEAR = Int4SymG128Linear("int4_sym_g128", specs=specs, in_multiple=GROUP, gemv_kernel=GEMV_KERNEL,
                           variants=VARIANTS, default_config=DEFAULT_CONFIG)
