"""INT4 `int4_sym_g128` linear kernels for the NumPy backend.

An independent reading of docs/FORMAT.md (this module never imports engine/formats). It unpacks the
way the CUDA kernel does, two elements at a time, from one 32-bit word:

    bit   31..28  27..24  23..20  19..16  15..12  11..8   7..4    3..0
         +-------+-------+-------+-------+-------+-------+-------+-------+
         |  e7   |  e5   |  e3   |  e1   |  e6   |  e4   |  e2   |  e0   |
         +-------+-------+-------+-------+-------+-------+-------+-------+
    nibble   7       6       5       4       3       2       1       0

    pair k = (word >> 4k) & 0x000F000F:  bits 0..3 = element 2k, bits 16..19 = element 2k+1

Values are (nibble - 8) * scale, scale fp16 per row and group of 128 inputs; products accumulate in
fp32 (the precision contract), outputs are rounded to their storage dtype by the caller's buffer.

Repacking (kernels/numpy/linear.py): within the backend's budget the weight is dequantized once into
`wt_f32`; past it, the nibbles are widened once into `q_i8` (the values `nibble - 8`, int8 `[out, in]`,
1 byte/weight) and dequantized per call a block of rows at a time. A QuantizedWeight with neither
(made without `prepare_linear`) is unpacked from its packed words per call, by blocks.
"""

from __future__ import annotations

import numpy as np

from kernels.numpy import linear

FORMAT = "int4_sym_g128"
GROUP = 128
PAIR_MASK = np.uint32(0x000F000F)


def unpack_int4_pairs(qweight: np.ndarray) -> np.ndarray:
    """uint32 `[out, in/8]` -> int8 values `nibble - 8`, `[out, in]`, by the pair rule above."""
    out_f, n_words = qweight.shape
    vals = np.empty((out_f, n_words, 8), dtype=np.int8)
    for k in range(4):
        pair = (qweight >> np.uint32(4 * k)) & PAIR_MASK
        vals[:, :, 2 * k] = (pair & np.uint32(0xF)).astype(np.int8) - 8
        vals[:, :, 2 * k + 1] = (pair >> np.uint32(16)).astype(np.int8) - 8
    return vals.reshape(out_f, n_words * 8)


def _scaled(vals: np.ndarray, scales: np.ndarray) -> np.ndarray:
    out_f, in_f = vals.shape
    s = scales.astype(np.float32).reshape(out_f, in_f // GROUP, 1)
    return (vals.astype(np.float32).reshape(out_f, in_f // GROUP, GROUP) * s).reshape(out_f, in_f)


def dequantize(tensors: dict) -> np.ndarray:
    """float32 `[out, in]` weight from the packed words and fp16 group scales."""
    return _scaled(unpack_int4_pairs(tensors["qweight"]), tensors["scales"])


def repack(tensors: dict, fp32: bool) -> dict:
    """The arrays the matmul reads, made once: {"wt_f32": W^T} (fp32) or {"q_i8": nibble - 8} (int8)."""
    if fp32:
        return linear.fp32_transposed(dequantize(tensors))
    return {"q_i8": unpack_int4_pairs(tensors["qweight"])}


def repacked_nbytes(out_features: int, in_features: int, fp32: bool) -> int:
    """Bytes `repack` adds for a weight of this shape."""
    return out_features * in_features * (4 if fp32 else 1)


def matmul(x: np.ndarray, w) -> np.ndarray:
    """fp32 `x @ W.T` for fp16 activations `x [T, in]` and a QuantizedWeight `W [out, in]`."""
    t = w.tensors

    def rows(r0, r1):
        vals = t["q_i8"][r0:r1] if "q_i8" in t else unpack_int4_pairs(t["qweight"][r0:r1])
        return _scaled(vals, t["scales"][r0:r1])

    return linear.matmul(x, w, rows)
