"""The `int4_sym_g128` linears on the CUDA backend: the launcher of int4_sym_g128.cu.

qweight uint32 [out, in/8] (ValueShuffle nibbles), scales fp16 [out, in/128] (docs/FORMAT.md), read as
stored. Decode: the GEMV entry points int4_gemv_<epilogue>_<variant>, CUDA-core "t<threads>_r<R>" or
tensor-core "tc_w<warps>_u<groups>" (int4_sym_g128.cu explains both). Prefill: int4_mma_f32, a
tensor-core kernel that multiplies fp16 x by the unscaled nibbles (exact in fp16) one 128-group at a
time with fp32 accumulation and scales each group's partial (no weight is rounded).
"""

from __future__ import annotations

import numpy as np

from kernels.cuda import loader
from kernels.cuda.linear import GemvLinear, i32

GROUP = 128
MMA_BM, MMA_BN = 64, 128  # must match int4_sym_g128.cu
GEMV_KERNEL = "int4_gemv"
VARIANTS = ("t64_r4", "t128_r4", "t128_r8", "t256_r8", "tc_w4_u4", "tc_w8_u4", "tc_w8_u2")
# the fastest per op in the bench sweep on an H200 (bench/NOTES.md, v2); `nanoqwen bench` re-picks on its machine
DEFAULT_CONFIG = {"qkv_proj": "tc_w8_u4", "o_proj_residual": "t128_r4", "gate_up_silu": "tc_w4_u4",
                  "down_residual": "t128_r4"}


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
        loader.kernels()["int4_mma_f32"]((-(-N // MMA_BN), -(-T // MMA_BM)), (256,),
                                         (x, w["qweight"], w["scales"], y, i32(T), i32(N), i32(K)))
        return y


LINEAR = Int4SymG128Linear("int4_sym_g128", specs=specs, in_multiple=GROUP, gemv_kernel=GEMV_KERNEL,
                           variants=VARIANTS, default_config=DEFAULT_CONFIG)
