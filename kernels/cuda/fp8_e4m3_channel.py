"""The `fp8_e4m3_channel` linears on the CUDA backend: the launcher of fp8_e4m3_channel.cu.

qweight uint8 e4m3 codes [out, in] row-major, scales fp16 [out] (docs/FORMAT.md), read as stored;
in % 16 == 0 (a 16-byte load is 16 weights of a row). Decode: fp8_e4m3_channel_gemv_<epilogue>_
t<threads>_r<R> (gemv_rows.cuh's CUDA-core body; the hardware conversion cvt.rn.f16x2.e4m3x2 decodes).
Prefill, by backend.prefill_variant: "pipe64" (the default) or "pipe", the tensor-core kernels
fp8_e4m3_channel_mma_pipe{64,}_f32 (pipe8.cuh, linear.PipeLinear); or "cublas",
fp8_e4m3_channel_dequant_f32 into an fp32 scratch weight (decode(q) * s is exact in fp32), then one cuBLAS
fp32 GEMM (linear.DequantLinear).

`hardware_encode` / `hardware_decode` run the GPU's own e4m3 conversions on host arrays, for the unit
test that holds the format's NumPy definition to them bit for bit (ladder/unit/test_fp8_hardware.py).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from kernels.cuda import loader
from kernels.cuda.linear import PipeLinear, blocks, i32

GEMV_KERNEL = "fp8_e4m3_channel_gemv"
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
    return {"qweight": (np.uint8, (out_features, in_features)), "scales": (np.float16, (out_features,))}


class Fp8Linear(PipeLinear):
    """PipeLinear with the hardware conversions the format's definition is held to (the unit test
    reaches them as `backend.linears["fp8_e4m3_channel"]`; the backend class knows nothing of e4m3)."""

    @staticmethod
    def hardware_encode(values) -> np.ndarray:
        return hardware_encode(values)

    @staticmethod
    def hardware_decode(codes) -> np.ndarray:
        return hardware_decode(codes)


LINEAR = Fp8Linear("fp8_e4m3_channel", specs=specs, in_multiple=CHUNK_INPUTS, gemv_kernel=GEMV_KERNEL, variants=VARIANTS,
                   default_config=DEFAULT_CONFIG, dequant_kernel="fp8_e4m3_channel_dequant_f32",
                   dequant_items=lambda out_f, in_f: out_f * in_f // 2, prefill_variants=PREFILL_VARIANTS,
                   default_prefill=DEFAULT_PREFILL)


def _even(a: np.ndarray) -> np.ndarray:
    """`a` with one element appended when its length is odd (the conversions work on pairs)."""
    return a if a.size % 2 == 0 else np.concatenate([a, np.zeros(1, a.dtype)])


def hardware_encode(values) -> np.ndarray:
    """float32 values -> uint8 e4m3 codes by cvt.rn.satfinite.e4m3x2.f32, in element order.

    The kernel writes pair i as one 16-bit word, code of element 2i in its low byte; read back as bytes
    (little-endian, as both the GPU and the host store it) that is element order."""
    v = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    n = v.size
    d = cp.asarray(_even(v))
    pairs = d.size // 2
    codes = cp.empty(max(pairs, 1), dtype=cp.uint16)
    loader.kernels()["fp8_e4m3_encode_pairs"]((blocks(pairs),), (256,), (d, codes, i32(pairs)))
    return cp.asnumpy(codes).view(np.uint8)[:n]


def hardware_decode(codes) -> np.ndarray:
    """uint8 e4m3 codes -> float16 values by cvt.rn.f16x2.e4m3x2, in element order (the low byte of a
    pair decodes into the low half of its half2)."""
    c = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    n = c.size
    d = cp.asarray(_even(c)).view(cp.uint16)
    pairs = d.size
    halves = cp.empty(max(pairs, 1), dtype=cp.uint32)
    loader.kernels()["fp8_e4m3_decode_pairs"]((blocks(pairs),), (256,), (d, halves, i32(pairs)))
    return cp.asnumpy(halves).view(np.float16)[:n]
