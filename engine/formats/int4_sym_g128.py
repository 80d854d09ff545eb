"""`int4_sym_g128`: INT4 symmetric, one fp16 scale per 128 inputs, nibbles in the ValueShuffle order.

This module is the definition (docs/FORMAT.md, "int4_sym_g128"). For a weight `W[out, in]` (float32), group `j`
covering inputs `128j .. 128j+127`:

    s[o, j] = fp16(max |W[o, 128j : 128j+128]| / 7)
    q       = clamp(rint(W / s), -8, 7)        (with the fp16 scale; q = 0 where s = 0)
    nibble  = q + 8                            (0 .. 15)
    W~      = (nibble - 8) * s                 (dequantized)

`qweight` is uint32 `[out, in/8]`, little-endian; word `j` of row `o` holds elements `8j .. 8j+7`:

    bit   31..28  27..24  23..20  19..16  15..12  11..8   7..4    3..0
         +-------+-------+-------+-------+-------+-------+-------+-------+
         |  e7   |  e5   |  e3   |  e1   |  e6   |  e4   |  e2   |  e0   |
         +-------+-------+-------+-------+-------+-------+-------+-------+
    nibble   7       6       5       4       3       2       1       0

    nibble k holds element 8j + (0, 2, 4, 6, 1, 3, 5, 7)[k]
    (word >> 4k) & 0x000F000F  ->  element 2k in bits 0..3, element 2k+1 in bits 16..19:
    the pair (2k, 2k+1) in the two 16-bit halves, one OR with 0x6400 away from a half2.

`scales` is fp16 `[out, in/128]`.
"""

from __future__ import annotations

import numpy as np

from engine.formats import Format, register

GROUP = 128
# NIBBLE_ELEMENT[k] = which of a word's 8 elements sits in nibble k (bits 4k .. 4k+3)
NIBBLE_ELEMENT = np.array([0, 2, 4, 6, 1, 3, 5, 7])


class Int4SymG128(Format):
    name = "int4_sym_g128"
    suffixes = (".qweight", ".scales")
    in_multiple = GROUP
    group_size = GROUP
    describes = "INT4 symmetric, an fp16 scale per 128 inputs, ValueShuffle nibbles (W4A16)"

    def tensor_specs(self, out_features: int, in_features: int):
        return {
            ".qweight": ("uint32", (out_features, in_features // 8)),
            ".scales": ("float16", (out_features, in_features // GROUP)),
        }

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        w = np.asarray(w, dtype=np.float32)
        out_f, in_f = w.shape
        self._check_shape(w)
        g = w.reshape(out_f, in_f // GROUP, GROUP)  # [out, groups, 128]
        self._check_finite(w)
        # One float32 temporary of the weight's size, reused step by step: a 7B linear is 68 M weights,
        # and every fresh array of it costs more in page faults than the arithmetic.
        q = np.abs(g)
        with np.errstate(over="ignore"):
            scales = (q.max(axis=2) / np.float32(7.0)).astype(np.float16)  # [out, groups]
        if not np.isfinite(scales).all():
            raise ValueError("a group's max |w| / 7 overflows fp16 (|w| > 458528); int4_sym_g128 cannot hold it")
        s32 = scales.astype(np.float32)[:, :, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(g, s32, out=q)
        np.rint(q, out=q)
        zero = scales == 0  # q = 0 where s = 0 (g / 0 is inf or nan there)
        if zero.any():
            q[zero] = 0.0
        np.clip(q, -8, 7, out=q)
        q += np.float32(8.0)  # nibble = q + 8, exact in float32
        return {"qweight": pack(q.reshape(out_f, in_f).astype(np.uint8)), "scales": scales}

    def dequantize(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        w = unpack(tensors["qweight"]).astype(np.float32)  # [out, in]; then in place, one array
        scales = np.asarray(tensors["scales"]).astype(np.float32)
        out_f, in_f = w.shape
        w -= np.float32(8.0)
        w.reshape(out_f, in_f // GROUP, GROUP)[...] *= scales[:, :, None]
        return w

    def step(self, tensors):
        return np.repeat(np.asarray(tensors["scales"], dtype=np.float64), GROUP, axis=1)

    def swap_pair(self, tensors):
        """Elements 0 and 1 of every row trade places: the low and high halves of word 0's pair 0."""
        t = {k: np.array(v, copy=True) for k, v in tensors.items()}
        w = t["qweight"][:, 0]
        lo, hi = w & np.uint32(0xF), (w >> np.uint32(16)) & np.uint32(0xF)
        t["qweight"][:, 0] = (w & ~np.uint32(0x000F000F)) | hi | (lo << np.uint32(16))
        return t

    def shift_scale(self, tensors):
        """The last group of every row takes the scale of the group before it (one group: no change)."""
        t = {k: np.array(v, copy=True) for k, v in tensors.items()}
        if t["scales"].shape[1] > 1:
            t["scales"][:, -1] = t["scales"][:, -2]
        return t


def pack(nibbles: np.ndarray) -> np.ndarray:
    """Nibble values 0..15 `[out, in]` -> ValueShuffle uint32 words `[out, in/8]` (map in the docstring).
    Built a byte at a time: byte b of a little-endian word holds nibbles 2b (low) and 2b + 1 (high)."""
    nibbles = np.asarray(nibbles)
    if nibbles.size and (nibbles.min() < 0 or nibbles.max() > 15):
        raise ValueError("a nibble outside 0..15")
    e = nibbles.astype(np.uint8)
    out_f, in_f = e.shape
    e = e.reshape(out_f, in_f // 8, 8)  # [out, words, 8 elements]
    b = np.empty((out_f, in_f // 8, 4), dtype=np.uint8)
    for byte in range(4):
        np.left_shift(e[:, :, NIBBLE_ELEMENT[2 * byte + 1]], np.uint8(4), out=b[:, :, byte])
        b[:, :, byte] |= e[:, :, NIBBLE_ELEMENT[2 * byte]]
    return b.view(np.dtype("<u4")).reshape(out_f, in_f // 8).astype(np.uint32, copy=False)


def unpack(words: np.ndarray) -> np.ndarray:
    """ValueShuffle uint32 words `[out, in/8]` -> nibble values 0..15 `[out, in]` (uint8)."""
    words = np.asarray(words, dtype=np.uint32)
    out_f, n_words = words.shape
    e = np.empty((out_f, n_words, 8), dtype=np.uint8)
    for k in range(8):
        e[:, :, NIBBLE_ELEMENT[k]] = (words >> np.uint32(4 * k)) & np.uint32(0xF)
    return e.reshape(out_f, n_words * 8)


FORMAT = register(Int4SymG128())
