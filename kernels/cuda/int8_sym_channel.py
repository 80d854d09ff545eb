"""The `int8_sym_channel` linears on the CUDA backend: the launcher of int8_sym_channel.cu.

qweight int8 [out, in] row-major, scales fp16 [out] (docs/FORMAT.md), read as stored; in % 16 == 0
(a 16-byte load is 16 weights of a row). Decode: int8_sym_channel_gemv_<epilogue>_t<threads>_r<R>
(gemv_rows.cuh's CUDA-core body). Prefill, by backend.prefill_variant: "pipe64" (the default) or "pipe",
the tensor-core kernels int8_sym_channel_mma_pipe{64,}_f32 (pipe8.cuh, linear.PipeLinear); or
"cublas", int8_sym_channel_dequant_f32 into an fp32 scratch weight (q * s is exact in fp32), then one
cuBLAS fp32 GEMM (linear.DequantLinear).
"""

from __future__ import annotations

import numpy as np

from kernels.cuda.linear import PipeLinear

GEMV_KERNEL = "int8_sym_channel_gemv"
CHUNK_INPUTS = 16  # inputs of one 16-byte weight load (8-bit weights): the step of the CUDA-core
# variants' thread loop (thread i takes loads i, i + threads, ...); catalog.loop_stride reads it
VARIANTS = ("t64_r4", "t128_r4", "t128_r8", "t256_r8")
# the fastest correct variant per op on an H200 (python -m bench.format_gemv --all-variants, bench/NOTES.md)
DEFAULT_CONFIG = {"qkv_proj": "t128_r4", "o_proj_residual": "t128_r4", "gate_up_silu": "t64_r4",
                  "down_residual": "t128_r4"}


# prefill kernels (linear.PipeLinear): pipe64 was the fastest at every prompt length from 16 to 8192 on
# an H200, 3.7x cuBLAS fp32 at 512 tokens (python -m bench.prefill_gemm, bench/NOTES.md v5)
PREFILL_VARIANTS = ("pipe64", "pipe", "cublas")
DEFAULT_PREFILL = "pipe64"


def specs(out_features: int, in_features: int) -> dict:
    return {"qweight": (np.int8, (out_features, in_features)), "scales": (np.float16, (out_features,))}


LINEAR = PipeLinear("int8_sym_channel", specs=specs, in_multiple=CHUNK_INPUTS, gemv_kernel=GEMV_KERNEL, variants=VARIANTS,
                        default_config=DEFAULT_CONFIG, dequant_kernel="int8_sym_channel_dequant_f32",
                        dequant_items=lambda out_f, in_f: out_f * in_f, prefill_variants=PREFILL_VARIANTS,
                        default_prefill=DEFAULT_PREFILL)
