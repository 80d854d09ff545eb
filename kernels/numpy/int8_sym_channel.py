"""`int8_sym_channel` linear kernels for the NumPy backend: an independent reading of docs/FORMAT.md.

`qweight` int8 `[out, in]`, `scales` fp16 `[out]`; the value of element (o, i) is qweight[o, i] *
scales[o], exact in fp32. The stored int8 is already 1 byte a weight, so past the fp32 budget nothing
is repacked: rows are widened per call (kernels/numpy/linear.py).
"""

from __future__ import annotations

import numpy as np

from kernels.numpy import linear

FORMAT = "int8_sym_channel"


def _rows(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scales.astype(np.float32)[:, None]


def dequantize(tensors: dict) -> np.ndarray:
    return _rows(tensors["qweight"], tensors["scales"])


def repack(tensors: dict, fp32: bool) -> dict:
    return linear.fp32_transposed(dequantize(tensors)) if fp32 else {}


def repacked_nbytes(out_features: int, in_features: int, fp32: bool) -> int:
    return out_features * in_features * 4 if fp32 else 0


def matmul(x: np.ndarray, w) -> np.ndarray:
    t = w.tensors
    return linear.matmul(x, w, lambda r0, r1: _rows(t["qweight"][r0:r1], t["scales"][r0:r1]))
