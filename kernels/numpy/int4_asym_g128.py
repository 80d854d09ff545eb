"""`int4_asym_g128` linear kernels for the NumPy backend: an independent reading of docs/FORMAT.md.

`qweight` uint32 `[out, in/8]` holds the unsigned nibbles q in the ValueShuffle order (pair k of a
word = (word >> 4k) & 0x000F000F: element 2k in bits 0..3, element 2k+1 in bits 16..19);
`scale_zero` uint32 `[out, in/128]` holds per group the fp16 scale in bits 0..15 and the fp16 number
1024 + z in bits 16..31. The value of an element is (q - z) * s, exact in fp32. Read the way the GPU
reads it: 1024 + q (the nibble OR-ed into 0x6400) minus the stored 1024 + z.
"""

from __future__ import annotations

import numpy as np

from kernels.numpy import linear

FORMAT = "int4_asym_g128"
GROUP = 128
PAIR_MASK = np.uint32(0x000F000F)


def _fp16(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def rows(t: dict, r0: int, r1: int) -> np.ndarray:
    """fp32 rows r0 .. r1-1: (1024 + q) - (1024 + z), times the group's scale."""
    qweight, scale_zero = t["qweight"][r0:r1], t["scale_zero"][r0:r1]
    out_f, n_words = qweight.shape
    biased = np.empty((out_f, n_words, 8), dtype=np.float32)  # 1024 + q, as the fp16 the GPU builds
    for k in range(4):
        pair = ((qweight >> np.uint32(4 * k)) & PAIR_MASK) | np.uint32(0x64006400)
        biased[:, :, 2 * k] = _fp16(pair & np.uint32(0xFFFF))
        biased[:, :, 2 * k + 1] = _fp16(pair >> np.uint32(16))
    s = _fp16(scale_zero & np.uint32(0xFFFF))[:, :, None]
    zb = _fp16(scale_zero >> np.uint32(16))[:, :, None]  # 1024 + z
    groups = scale_zero.shape[1]
    vals = biased.reshape(out_f, groups, GROUP) - zb  # q - z, exact
    return (vals * s).reshape(out_f, n_words * 8)


def dequantize(tensors: dict) -> np.ndarray:
    return rows(tensors, 0, len(tensors["qweight"]))


repack, repacked_nbytes, matmul = linear.row_kernels(rows)
