"""`int8_sym_channel`: INT8 symmetric, one fp16 scale per output row (W8A16).

This module is the definition (docs/FORMAT.md, "int8_sym_channel"). For a weight `W[out, in]` (float32):

    s[o]  = fp16(max |W[o, :]| / 127)
    q     = clamp(rint(W / s), -127, 127)     (with the fp16 scale; q = 0 where s = 0; -128 is never stored)
    W~    = q * s                             (dequantized; exact in fp32: 8 x 11 significant bits)

`qweight` is int8 `[out, in]`, row-major: a 16-byte load is 16 consecutive inputs of one row.
`scales` is fp16 `[out]`. The scale is per row, so a kernel sums `x . q` in fp32 and multiplies once.
"""

from __future__ import annotations

import numpy as np

from engine.formats import RowScaledFormat, register

QMAX = 127


class Int8SymChannel(RowScaledFormat):
    name = "int8_sym_channel"
    suffixes = (".qweight", ".scales")
    in_multiple = 16  # the kernels read a row in 16-byte loads (16 weights)
    describes = "INT8 symmetric, an fp16 scale per output row (W8A16)"

    def tensor_specs(self, out_features: int, in_features: int):
        return {".qweight": ("int8", (out_features, in_features)), ".scales": ("float16", (out_features,))}

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        w = np.asarray(w, dtype=np.float32)
        self._check_shape(w)
        self._check_finite(w)
        with np.errstate(over="ignore"):
            scales = (np.abs(w).max(axis=1) / np.float32(QMAX)).astype(np.float16)
        if not np.isfinite(scales).all():
            raise ValueError(f"a row's max |w| / {QMAX} overflows fp16 (|w| > {65504 * QMAX}); {self.name} cannot hold it")
        s32 = scales.astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s32 > 0, np.rint(w / s32), 0.0)
        return {"qweight": np.clip(q, -QMAX, QMAX).astype(np.int8), "scales": scales}

    def dequantize(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        q = np.asarray(tensors["qweight"]).astype(np.float32)
        return q * np.asarray(tensors["scales"]).astype(np.float32)[:, None]

    def step(self, tensors):
        s = np.asarray(tensors["scales"], dtype=np.float64)[:, None]
        return np.broadcast_to(s, np.shape(tensors["qweight"]))


FORMAT = register(Int8SymChannel())
