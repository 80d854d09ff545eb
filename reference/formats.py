"""Every quantization format read a third time, from docs/FORMAT.md alone, in float64.

The engine's definition (engine/formats/) and each backend's kernels (kernels/<backend>/) read the same
bytes; this module never imports either, and reads them the plainest way: element by element where a
layout packs several values in a word, the e4m3 bytes from their bit fields. `REF_DEQUANT[format]`
turns a format's stored tensors into the float64 weight `[out, in]` the reference ops multiply with.
"""

from __future__ import annotations

import numpy as np

# Nibble k (bits 4k .. 4k+3) of an INT4 word holds element VALUE_SHUFFLE[k] of the word's 8 elements.
VALUE_SHUFFLE = (0, 2, 4, 6, 1, 3, 5, 7)


def ref_unpack_int4(qweight: np.ndarray) -> np.ndarray:
    """uint32 `[out, in/8]` -> nibbles 0..15 `[out, in]` (uint8). Nibble k of word j is element 8j + VALUE_SHUFFLE[k]."""
    qweight = np.asarray(qweight, dtype=np.uint32)
    out_f, n_words = qweight.shape
    res = np.zeros((out_f, n_words, 8), dtype=np.uint8)  # [row, word j, element e of the word]
    for k, e in enumerate(VALUE_SHUFFLE):  # every word at once, one nibble position at a time
        res[:, :, e] = (qweight >> np.uint32(4 * k)) & np.uint32(0xF)
    return res.reshape(out_f, n_words * 8)


def ref_dequant_int4_sym_g128(qweight, scales, dtype=np.float64) -> np.ndarray:
    """`[out, in]` = (nibble - 8) * scale of the row's group of 128."""
    nib = ref_unpack_int4(qweight)
    out_f, in_f = nib.shape
    s = np.asarray(scales, dtype=dtype)[:, :, None]  # [out, group, 1]: one scale for the group's 128
    return ((nib.astype(dtype) - 8).reshape(out_f, in_f // 128, 128) * s).reshape(out_f, in_f)


def ref_dequant_int4_asym_g128(qweight, scale_zero, dtype=np.float64) -> np.ndarray:
    """`[out, in]` = (q - z) * s of the row's group of 128; a group's word holds fp16 s (bits 0..15)
    and the fp16 number 1024 + z (bits 16..31)."""
    q = ref_unpack_int4(qweight)
    sz = np.asarray(scale_zero, dtype=np.uint32)
    s = (sz & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(dtype)
    z = (sz >> np.uint32(16)).astype(np.uint16).view(np.float16).astype(np.float64) - 1024.0
    if ((z < 0) | (z > 15) | (z != np.floor(z))).any():
        raise ValueError("int4_asym_g128: a zero point is not an integer 0..15")
    out_f, in_f = q.shape
    groups = (q.astype(np.float64).reshape(out_f, in_f // 128, 128) - z[:, :, None]).astype(dtype)
    return (groups * s[:, :, None]).reshape(out_f, in_f)


def ref_dequant_int8_sym_channel(qweight, scales, dtype=np.float64) -> np.ndarray:
    """`[out, in]` = q * the row's scale."""
    return np.asarray(qweight, dtype=np.int64).astype(dtype) * np.asarray(scales, dtype=dtype)[:, None]


def ref_e4m3(code: int) -> float:
    """One e4m3 byte `s eeee mmm` (bias 7, subnormals at e = 0, NaN at e = 15, m = 7) as a float."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 15 and m == 7:
        return float("nan")
    if e == 0:
        return sign * (m / 8.0) * 2.0**-6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def ref_dequant_fp8_e4m3_channel(qweight, scales, dtype=np.float64) -> np.ndarray:
    """`[out, in]` = e4m3 value * the row's scale."""
    values = np.array([ref_e4m3(c) for c in range(256)], dtype=np.float64)
    return values[np.asarray(qweight, dtype=np.uint8)].astype(dtype) * np.asarray(scales, dtype=dtype)[:, None]


# format name -> its reference reading: (stored tensors, dtype) -> [out, in]
REF_DEQUANT = {
    "int4_sym_g128": lambda t, dtype=np.float64: ref_dequant_int4_sym_g128(t["qweight"], t["scales"], dtype),
    "int4_asym_g128": lambda t, dtype=np.float64: ref_dequant_int4_asym_g128(t["qweight"], t["scale_zero"], dtype),
    "int8_sym_channel": lambda t, dtype=np.float64: ref_dequant_int8_sym_channel(t["qweight"], t["scales"], dtype),
    "fp8_e4m3_channel": lambda t, dtype=np.float64: ref_dequant_fp8_e4m3_channel(t["qweight"], t["scales"], dtype),
}
