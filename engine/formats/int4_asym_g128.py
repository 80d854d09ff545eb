"""`int4_asym_g128`: INT4 asymmetric (the AWQ / GPTQ family), a scale and a zero point per 128 inputs.

This module is the definition (docs/FORMAT.md, "int4_asym_g128", with the drawing). For a weight
`W[out, in]` (float32), group `j` covering inputs `128j .. 128j+127` of row `o`:

    lo   = min(min W[o, group], 0)          hi = max(max W[o, group], 0)     (the range holds 0)
    s    = fp16((hi - lo) / 15)
    z    = clamp(rint(-lo / s), 0, 15)       (with the fp16 scale; s = 0: z = 0)
    q    = clamp(rint(W / s) + z, 0, 15)     (s = 0: q = 0)
    W~   = (q - z) * s                       (dequantized; exact in fp32)

Two tensors, both laid out for the GPU's unpack:

- `qweight`: uint32 `[out, in/8]`, the unsigned nibbles `q` in int4_sym_g128's ValueShuffle order,
  so `(word >> 4k) & 0x000F000F` puts elements 2k and 2k+1 in the two halves of a 32-bit word and one
  OR with 0x6400 makes the half2 `(1024 + q_2k, 1024 + q_2k+1)`.
- `scale_zero`: uint32 `[out, in/128]`, one word per group: bits 0..15 the fp16 scale `s`, bits 16..31
  the fp16 number `1024 + z` (the bit pattern `0x6400 | z`). One 4-byte load per group gives the
  kernel both; `half2(1024 + q) - half2(1024 + z)` is `q - z` exactly (integers under 2048 are exact
  in fp16), with no integer-to-float conversion and no separate zero-point tensor to fetch.
"""

from __future__ import annotations

import numpy as np

from engine.formats import Format, register
from engine.formats.int4_sym_g128 import Int4SymG128, pack, unpack

GROUP = 128
MAGIC = 0x6400  # fp16 1024.0: its ulp is 1, so 0x6400 | n is the fp16 number 1024 + n (n < 1024)


def pack_scale_zero(scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """fp16 scales and zero points 0..15 -> uint32 words (low half: scale bits, high half: 0x6400 | z)."""
    bits = np.asarray(scales, dtype=np.float16).view(np.uint16).astype(np.uint32)
    return bits | ((np.uint32(MAGIC) | np.asarray(zeros).astype(np.uint32)) << np.uint32(16))


def unpack_scale_zero(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint32 words -> (fp16 scales, zero points as int32); a high half that is not 0x6400 | z is refused."""
    words = np.asarray(words, dtype=np.uint32)
    high = (words >> np.uint32(16)).astype(np.int32)
    if ((high & ~0xF) != MAGIC).any():
        raise ValueError("int4_asym_g128: a scale_zero word's high half is not 0x6400 | z (z = 0..15)")
    scales = (words & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
    return scales, high & 0xF


class Int4AsymG128(Format):
    name = "int4_asym_g128"
    suffixes = (".qweight", ".scale_zero")
    in_multiple = GROUP
    group_size = GROUP
    describes = "INT4 asymmetric, an fp16 scale and a zero point per 128 inputs (AWQ/GPTQ-style, W4A16)"

    def tensor_specs(self, out_features: int, in_features: int):
        return {
            ".qweight": ("uint32", (out_features, in_features // 8)),
            ".scale_zero": ("uint32", (out_features, in_features // GROUP)),
        }

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        w = np.asarray(w, dtype=np.float32)
        self._check_shape(w)
        self._check_finite(w)
        out_f, in_f = w.shape
        g = w.reshape(out_f, in_f // GROUP, GROUP)
        lo = np.minimum(g.min(axis=2), np.float32(0))
        hi = np.maximum(g.max(axis=2), np.float32(0))
        with np.errstate(over="ignore"):
            scales = ((hi - lo) / np.float32(15.0)).astype(np.float16)
        if not np.isfinite(scales).all():
            raise ValueError(f"a group's (max - min) / 15 overflows fp16; {self.name} cannot hold it")
        s32 = scales.astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(s32 > 0, np.clip(np.rint(-lo / s32), 0, 15), 0.0)
            q = np.divide(g, s32[:, :, None])  # then in place: one float32 array of the weight's size
        np.rint(q, out=q)
        q += z[:, :, None]
        zero = scales == 0  # q = 0 where s = 0 (g / 0 is inf or nan there)
        if zero.any():
            q[zero] = 0.0
        np.clip(q, 0, 15, out=q)
        return {"qweight": pack(q.reshape(out_f, in_f).astype(np.uint8)),
                "scale_zero": pack_scale_zero(scales, z.astype(np.uint32))}

    def dequantize(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        w = unpack(tensors["qweight"]).astype(np.float32)  # then in place, one array
        scales, zeros = unpack_scale_zero(tensors["scale_zero"])
        out_f, in_f = w.shape
        g = w.reshape(out_f, in_f // GROUP, GROUP)
        g -= zeros[:, :, None].astype(np.float32)
        g *= scales.astype(np.float32)[:, :, None]
        return w

    # A range whose zero point was rounded shifts the grid's ends by up to half a step: one step at most.
    max_error_steps = 1.0

    def step(self, tensors):
        return np.repeat(unpack_scale_zero(tensors["scale_zero"])[0].astype(np.float64), GROUP, axis=1)

    swap_pair = Int4SymG128.swap_pair  # the same words: the pair (0, 1) is the halves of word 0's pair 0

    def shift_scale(self, tensors):
        """The last group of every row takes the scale and zero point of the group before it."""
        t = {k: np.array(v, copy=True) for k, v in tensors.items()}
        if t["scale_zero"].shape[1] > 1:
            t["scale_zero"][:, -1] = t["scale_zero"][:, -2]
        return t


FORMAT = register(Int4AsymG128())
