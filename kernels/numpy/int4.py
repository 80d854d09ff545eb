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
"""

from __future__ import annotations

import numpy as np

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


def dequant_int4_sym_g128(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 `[out, in]` weight from the packed words and fp16 group scales."""
    vals = unpack_int4_pairs(qweight).astype(np.float32)
    out_f, in_f = vals.shape
    s = scales.astype(np.float32).reshape(out_f, in_f // GROUP, 1)
    return (vals.reshape(out_f, in_f // GROUP, GROUP) * s).reshape(out_f, in_f)


def matmul_int4_sym_g128(x: np.ndarray, w) -> np.ndarray:
    """fp32 `x @ W.T` for fp16 activations `x [T, in]` and a QuantizedWeight `W [out, in]`."""
    wf = dequant_int4_sym_g128(w["qweight"], w["scales"])
    return x.astype(np.float32) @ wf.T


# format name -> kernel computing fp32 x @ W.T; a format missing here is reported, never emulated
LINEAR_KERNELS = {"int4_sym_g128": matmul_int4_sym_g128}
