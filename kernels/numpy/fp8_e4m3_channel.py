"""`fp8_e4m3_channel` linear kernels for the NumPy backend: an independent reading of docs/FORMAT.md.

`qweight` uint8 e4m3 bytes `[out, in]`, `scales` fp16 `[out]`. The bytes are decoded through a
256-entry table built here from the bit layout (`s eeee mmm`, bias 7, subnormals at e = 0, NaN at
0x7F / 0xFF, no infinities), the way the GPU's `cvt.rn.f16x2.e4m3x2` decodes them; every value is
exact in fp16, and value * fp16 scale is exact in fp32.
"""

from __future__ import annotations

import numpy as np

from kernels.numpy import linear

FORMAT = "fp8_e4m3_channel"


def _decode_table() -> np.ndarray:
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 0x7
        if e == 15 and m == 7:
            table[code] = np.nan
        elif e == 0:
            table[code] = sign * m * 2.0**-9  # subnormal: m/8 * 2^-6
        else:
            table[code] = sign * (8 + m) * 2.0 ** (e - 10)  # (1 + m/8) * 2^(e-7)
    return table


E4M3 = _decode_table()


def rows(t: dict, r0: int, r1: int) -> np.ndarray:
    """fp32 rows r0 .. r1-1: the e4m3 value * the row's scale."""
    return E4M3[t["qweight"][r0:r1]] * t["scales"][r0:r1].astype(np.float32)[:, None]


def dequantize(tensors: dict) -> np.ndarray:
    return rows(tensors, 0, len(tensors["qweight"]))


repack, repacked_nbytes, matmul = linear.row_kernels(rows)
