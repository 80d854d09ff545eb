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

    qweight_dtype = "int8"
    qmax = QMAX

    def encode(self, v: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(v), -QMAX, QMAX).astype(np.int8)  # rint ties to even; -128 is never stored

    def decode(self, qweight: np.ndarray) -> np.ndarray:
        return np.asarray(qweight).astype(np.float32)

    def step(self, tensors):
        s = np.asarray(tensors["scales"], dtype=np.float64)[:, None]
        return np.broadcast_to(s, np.shape(tensors["qweight"]))


FORMAT = register(Int8SymChannel())
