"""The quantized linear on the NumPy backend, for every format: `x @ W.T` in fp32 from a format's rows.

Each format's kernel module (`kernels/numpy/<format>.py`, found by name) reads its own stored tensors
into fp32 rows; this module holds what the formats share (docs/BACKEND.md, "Repacking"), and
`row_kernels(rows)` gives a format with nothing to repack past the budget its repack, size and matmul:

- `wt_f32`: the whole weight dequantized once, at load, transposed: float32 `[in, out]`, C order. One
  BLAS call per op (`x @ wt`, which OpenBLAS ran up to 40% faster than `x @ w.T` at the 0.5 B shapes).
  The backend makes it while its size budget lasts (kernels/numpy/__init__.py).
- past the budget, rows are dequantized per call, a block of ~1 MB of fp32 at a time (cache-sized),
  and multiplied block by block.

Every shipped format dequantizes exactly into fp32 (the products of its integers or e4m3 values with
an fp16 scale need at most 19 significant bits), so both paths give the same products; the sums are
fp32 (the precision contract).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

BLOCK_FLOATS = 1 << 18  # rows per block in the per-call path: ~1 MB of fp32 weight at a time


def fp32_transposed(w_fp32: np.ndarray) -> dict:
    """The repacked array of the one-BLAS-call path."""
    return {"wt_f32": np.ascontiguousarray(w_fp32.T)}


def matmul(x: np.ndarray, w, rows: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """fp32 `x @ W.T` for fp16 activations `x [T, in]` and a QuantizedWeight `W [out, in]`;
    `rows(r0, r1)` is the format's fp32 reading of rows r0 .. r1-1 (used when there is no `wt_f32`)."""
    xf = x.astype(np.float32)
    if "wt_f32" in w.tensors:
        return xf @ w.tensors["wt_f32"]
    out_f, in_f = w.out_features, w.in_features
    step = max(1, BLOCK_FLOATS // in_f)
    y = np.empty((xf.shape[0], out_f), dtype=np.float32)
    for r0 in range(0, out_f, step):
        r1 = min(out_f, r0 + step)
        y[:, r0:r1] = xf @ rows(r0, r1).T
    return y


def row_kernels(rows: Callable[[dict, int, int], np.ndarray]):
    """(repack, repacked_nbytes, matmul) of a format whose stored bytes need no repacking past the budget
    (its module's `rows(tensors, r0, r1)`: the fp32 reading of rows r0 .. r1-1)."""

    def repack(tensors: dict, fp32: bool) -> dict:
        return fp32_transposed(rows(tensors, 0, _n_rows(tensors))) if fp32 else {}

    def repacked_nbytes(out_features: int, in_features: int, fp32: bool) -> int:
        return out_features * in_features * 4 if fp32 else 0

    def matmul_(x: np.ndarray, w) -> np.ndarray:
        return matmul(x, w, lambda r0, r1: rows(w.tensors, r0, r1))

    return repack, repacked_nbytes, matmul_


def _n_rows(tensors: dict) -> int:
    return len(next(iter(tensors.values())))
