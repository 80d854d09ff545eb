"""`fp8_e4m3_channel`: FP8 E4M3 weights with one fp16 scale per output row (W8A16, the OCP "e4m3fn").

This module is the definition (docs/FORMAT.md, "fp8_e4m3_channel"), written to match the H200's own
conversion (`cvt.rn.satfinite.e4m3x2.f32` to encode, `cvt.rn.f16x2.e4m3x2` to decode) bit for bit.

An e4m3 byte is `s eeee mmm`, exponent bias 7, no infinities:

    e = 0          subnormal: (-1)^s * m/8 * 2^-6          (m = 1..7: 2^-9 .. 0.875 * 2^-6; m = 0: +-0)
    e = 1 .. 15    normal:    (-1)^s * (1 + m/8) * 2^(e-7)  (largest: e = 15, m = 6: 448)
    e = 15, m = 7  NaN (0x7F, 0xFF)

Encoding a float32 `v` (`encode_e4m3`): round to nearest, ties to even, on the e4m3 grid (subnormals
included: |v| <= 2^-10 rounds to 0, a tie at 2^-10 to even, i.e. to 0); a finite result past 448, and
+-inf, saturate to +-448 (0x7E / 0xFE); NaN encodes as 0x7F; the sign of zero is kept.

For a weight `W[out, in]` (float32):

    s[o] = fp16(max |W[o, :]| / 448)
    q    = encode_e4m3(fp32(W) / fp32(s))     (q = 0 where s = 0; saturation catches s rounded down)
    W~   = decode(q) * s                      (exact in fp32: 4 x 11 significant bits)

`qweight` is uint8 `[out, in]` (the e4m3 bytes), row-major; `scales` is fp16 `[out]`.
"""

from __future__ import annotations

import numpy as np

from engine.formats import RowScaledFormat, register

FP8_MAX = 448.0
NAN_CODE = 0x7F


def _e4m3_values(c: np.ndarray) -> np.ndarray:
    """The e4m3 reading of int codes `c`: sign, 4 exponent bits (bias 7, subnormals at 0), 3 mantissa bits."""
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return (sign * mag).astype(np.float32)


# All 256 codes read once: decoding is then one gather (a 7B block's 233 M weights took 23 s through
# the arithmetic above, element by element, and take a second through the table; the values are the same).
E4M3_VALUES = _e4m3_values(np.arange(256, dtype=np.int32))


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3 bytes -> float32 values (NaN for 0x7F / 0xFF)."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def encode_e4m3(v: np.ndarray) -> np.ndarray:
    """float32 values -> uint8 e4m3 bytes: round to nearest even, saturate finite overflow and inf to 448.

    On the float32 bits: a normal e4m3 value (|v| >= 2^-6) keeps the top 3 of the 23 mantissa bits, rounded
    to nearest even by adding 0x7FFFF plus the lowest kept bit before the shift (a carry out of the mantissa
    moves into the exponent, as rounding up to the next binade should); the exponent's bias goes from 127
    to 7. Below 2^-6 the grid is the multiples of 2^-9 (subnormals), where rint rounds ties to even, and
    8 x 2^-9 = 2^-6 is code 8, the first normal. |v| is clipped to 448 first, so 448 < |v| <= 464 rounds to
    448 and nothing reaches the NaN code 0x7F; NaN becomes 0x7F with its sign. Bit-identical to the
    log2/exp2 reading of the grid it replaced, on every float16 value, 20 million random float32 bit
    patterns and every midpoint between e4m3 values and its neighbours.
    """
    v = np.asarray(v, dtype=np.float32)
    flat, out = v.reshape(-1), np.empty(v.size, dtype=np.uint8)
    # Elementwise, so a block at a time gives the same bytes: the dozen temporaries of a block stay in
    # cache instead of being fresh arrays the size of the weight (a 7B weight: 5.5 s -> about 1 s).
    for i in range(0, flat.size, _ENCODE_BLOCK):
        out[i:i + _ENCODE_BLOCK] = _encode_block(flat[i:i + _ENCODE_BLOCK])
    return out.reshape(v.shape)


_ENCODE_BLOCK = 1 << 18


def _encode_block(v: np.ndarray) -> np.ndarray:
    nan = np.isnan(v)
    a = np.where(nan, np.float32(0), np.minimum(np.abs(v), np.float32(FP8_MAX)))
    bits = a.view(np.uint32)
    one = np.uint32(1)
    normal = ((bits + np.uint32(0x7FFFF) + ((bits >> np.uint32(20)) & one)) >> np.uint32(20)).astype(np.int32) - (120 << 3)
    subnormal = np.rint(a * np.float32(512.0)).astype(np.int32)
    code = np.where(a >= np.float32(2.0**-6), normal, subnormal)
    code = np.where(np.signbit(v), code | 0x80, code)
    code = np.where(nan, NAN_CODE, code)
    return code.astype(np.uint8)


class Fp8E4m3Channel(RowScaledFormat):
    name = "fp8_e4m3_channel"
    suffixes = (".qweight", ".scales")
    in_multiple = 16  # the kernels read a row in 16-byte loads (16 weights)
    describes = "FP8 E4M3 (e4m3fn), an fp16 scale per output row (W8A16)"

    qweight_dtype = "uint8"
    qmax = FP8_MAX

    def encode(self, v: np.ndarray) -> np.ndarray:
        return encode_e4m3(v)

    def decode(self, qweight: np.ndarray) -> np.ndarray:
        return decode_e4m3(qweight)

    def step(self, tensors):
        """The e4m3 grid step at each stored value, 2^(exponent - 3) (subnormals: 2^-9), times the row's scale."""
        v = np.abs(decode_e4m3(tensors["qweight"]).astype(np.float64))
        e = np.floor(np.log2(np.maximum(v, 2.0**-6)))
        return np.exp2(e - 3) * np.asarray(tensors["scales"], dtype=np.float64)[:, None]


FORMAT = register(Fp8E4m3Channel())
