"""`int8_sym_channel` linear kernels for the NumPy backend: an independent reading of docs/FORMAT.md.

`qweight` int8 `[out, in]`, `scales` fp16 `[out]`; the value of element (o, i) is qweight[o, i] *
scales[o], exact in fp32. The stored int8 is already 1 byte a weight, so past the fp32 budget nothing
is repacked: rows are widened per call (kernels/numpy/linear.py).
"""

from __future__ import annotations

import numpy as np

from kernels.numpy import linear

FORMAT = "int8_sym_channel"


def rows(t: dict, r0: int, r1: int) -> np.ndarray:
    """fp32 rows r0 .. r1-1: q * the row's scale."""
    return t["qweight"][r0:r1].astype(np.float32) * t["scales"][r0:r1].astype(np.float32)[:, None]


def dequantize(tensors: dict) -> np.ndarray:
    return rows(tensors, 0, len(tensors["qweight"]))


repack, repacked_nbytes, matmul = linear.row_kernels(rows)
