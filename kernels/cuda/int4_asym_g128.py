"""The `int4_asym_g128` linears on the CUDA backend: the launcher of int4_asym_g128.cu.

qweight uint32 [out, in/8] (ValueShuffle nibbles q), scale_zero uint32 [out, in/128] (low half the fp16
scale, high half the fp16 number 1024 + z), docs/FORMAT.md, read as stored; in % 128 == 0. Decode:
int4_asym_g128_gemv_<epilogue>_<variant>, CUDA-core "t<threads>_r<R>" (gemv_rows.cuh) or tensor-core
"tc_w<warps>_u<groups>" (int4_sym_g128.cu's with a zero point per group). Prefill, by
backend.prefill_variant: "auto" (the default: "pipe64" below WGMMA_FROM_TOKENS tokens, "wgmma" from
there); "wgmma", int4_sym_g128's warp-specialized wgmma kernel with this format's zero point per group
(int4_wgmma.cuh: int4_asym_g128_wgmma_f32); "pipe64" or "pipe", int4_sym_g128's tensor-core ring with it
(int4_pipe.cuh: int4_asym_g128_mma_pipe{64,}_f32, linear.PipeLinear); or "cublas",
int4_asym_g128_dequant_f32 into an fp32 scratch weight ((q - z) * s is exact in fp32), then one cuBLAS
fp32 GEMM (linear.DequantLinear).

The kernels subtract the high half of a scale_zero word as an fp16 number: a word whose high half is
not 0x6400 | z (z = 0..15) would be read as some other zero point, so `prepare` refuses it.
"""

from __future__ import annotations

import numpy as np

from kernels.cuda.linear import PipeLinear

GROUP = 128
MAGIC = 0x6400  # fp16 1024.0: 0x6400 | z is the fp16 number 1024 + z
GEMV_KERNEL = "int4_asym_g128_gemv"
CHUNK_INPUTS = 32  # inputs of one 16-byte weight load (4-bit weights): the step of the CUDA-core
# variants' thread loop (thread i takes loads i, i + threads, ...); catalog.loop_stride reads it
VARIANTS = ("t64_r4", "t128_r4", "t128_r8", "t256_r8", "tc_w4_u4", "tc_w8_u4", "tc_w8_u2")
# the fastest correct variant per op on an H200 (python -m bench.format_gemv --all-variants, bench/NOTES.md)
DEFAULT_CONFIG = {"qkv_proj": "tc_w8_u2", "o_proj_residual": "tc_w8_u4", "gate_up_silu": "tc_w4_u4",
                  "down_residual": "tc_w8_u4"}


# prefill kernels (linear.PipeLinear): int4_sym_g128's ring and wgmma kernel with a zero point per group.
# "auto": measured per layer of the 7B shape on an H200 (python -m bench.prefill_gemm, bench/NOTES.md v5),
# the wgmma kernel is the fastest at every length from 16 tokens (13% ahead of the ring's 64-token tiles at
# 16, 33% at 256, 26-31% ahead of its 128-token ones from 512 to 8192); below 16 tokens, "pipe64"
PREFILL_VARIANTS = ("auto", "wgmma", "pipe64", "pipe", "cublas")
DEFAULT_PREFILL = "auto"
WGMMA_FROM_TOKENS = 16


def specs(out_features: int, in_features: int) -> dict:
    return {"qweight": (np.uint32, (out_features, in_features // 8)),
            "scale_zero": (np.uint32, (out_features, in_features // GROUP))}


class Int4AsymG128Linear(PipeLinear):
    def check_values(self, host):
        high = host["scale_zero"] >> np.uint32(16)
        bad = (high & np.uint32(0xFFF0)) != MAGIC
        if bad.any():
            row, group = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{self.name}: scale_zero[{row}, {group}] has high half {int(high[row, group]):#06x}, "
                             f"not 0x6400 | z (z = 0..15)")


LINEAR = Int4AsymG128Linear("int4_asym_g128", specs=specs, in_multiple=GROUP, gemv_kernel=GEMV_KERNEL,
                            variants=VARIANTS, default_config=DEFAULT_CONFIG,
                            dequant_kernel="int4_asym_g128_dequant_f32",
                            dequant_items=lambda out_f, in_f: out_f * in_f // 8, prefill_variants=PREFILL_VARIANTS,
                            default_prefill=DEFAULT_PREFILL, pipe_from_tokens=WGMMA_FROM_TOKENS,
                            wgmma_kernel="int4_asym_g128_wgmma_f32", auto_from="wgmma")
