"""INT4 `int4_sym_g128` linear kernels for the NumPy backend.

An independent reading of docs/FORMAT.md (this module never imports engine/formats). It unpacks the
way the CUDA kernel does, two elements at a time, from one 32-bit word:

    bit   31..28  27..24  23..20  19..16  15..12  11..8   7..4    3..0
         +-------+-------+-------+-------+-------+-------+-------+-------+
         |  e7   |  e5   |  e3   |  e1   |  e6   |  e4   |  e2   |  e0   |
         +-------+-------+-------+-------+-------+-------+-------+-------+
    nibble   7       6       5       4       3       2       1       0

    pair k = (word >> 4k) & 0x000F000F:  bits 0..3 = element 2k, bits 16..19 = element 2k+1

Values are (nibble - 8) * scale, scale fp16 per row and group of 128 inputs; products accumulate in
fp32 (the precision contract), outputs are rounded to their storage dtype by the caller's buffer.

Repacking (`prepare_linear`, docs/BACKEND.md): the packed words are unpacked once, at load, into one of
two layouts the matmul reads, beside the stored `qweight` and `scales` (kept as they came):

- `wt_f32`: the dequantized weight, transposed: float32 `[in, out]`, C order (4 bytes/weight). Exact:
  (nibble - 8) * an fp16 scale needs at most 15 significant bits. One BLAS call per op (`x @ wt`, which
  OpenBLAS ran up to 40% faster than `x @ w.T` at the 0.5 B shapes); a decode step is bound by reading it.
- `q_i8`: the values `nibble - 8`, int8 `[out, in]` (1 byte/weight), dequantized per call a block of
  rows at a time (a block of ~1 MB of fp32, cache-sized) and multiplied block by block.

The backend picks `wt_f32` while its size budget lasts (kernels/numpy/__init__.py). A QuantizedWeight
with neither (made without `prepare_linear`) is dequantized from its packed words per call, by blocks.
"""

from __future__ import annotations

import numpy as np

GROUP = 128
PAIR_MASK = np.uint32(0x000F000F)


def unpack_int4_pairs(qweight: np.ndarray) -> np.ndarray:
    """uint32 `[out, in/8]` -> int8 values `nibble - 8`, `[out, in]`, by the pair rule above."""
    out_f, n_words = qweight.shape
    vals = np.empty((out_f, n_words, 8), dtype=np.int8)
    for k in range(4):
        pair = (qweight >> np.uint32(4 * k)) & PAIR_MASK
        vals[:, :, 2 * k] = (pair & np.uint32(0xF)).astype(np.int8) - 8
        vals[:, :, 2 * k + 1] = (pair >> np.uint32(16)).astype(np.int8) - 8
    return vals.reshape(out_f, n_words * 8)


def dequant_int4_sym_g128(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 `[out, in]` weight from the packed words and fp16 group scales."""
    vals = unpack_int4_pairs(qweight).astype(np.float32)
    out_f, in_f = vals.shape
    s = scales.astype(np.float32).reshape(out_f, in_f // GROUP, 1)
    return (vals.reshape(out_f, in_f // GROUP, GROUP) * s).reshape(out_f, in_f)


BLOCK_FLOATS = 1 << 18  # rows per block in the per-call paths: ~1 MB of fp32 weight at a time


def repack_int4_sym_g128(tensors: dict, fp32: bool) -> dict:
    """The arrays the matmul reads, made once: {"wt_f32": W^T} (fp32) or {"q_i8": nibble - 8} (int8)."""
    if fp32:
        return {"wt_f32": np.ascontiguousarray(dequant_int4_sym_g128(tensors["qweight"], tensors["scales"]).T)}
    return {"q_i8": unpack_int4_pairs(tensors["qweight"])}


def repacked_nbytes(out_features: int, in_features: int, fp32: bool) -> int:
    """Bytes `repack_int4_sym_g128` adds for a weight of this shape."""
    return out_features * in_features * (4 if fp32 else 1)


def matmul_int4_sym_g128(x: np.ndarray, w) -> np.ndarray:
    """fp32 `x @ W.T` for fp16 activations `x [T, in]` and a QuantizedWeight `W [out, in]`."""
    xf = x.astype(np.float32)
    t = w.tensors
    if "wt_f32" in t:
        return xf @ t["wt_f32"]
    out_f, in_f = w.out_features, w.in_features
    groups = in_f // GROUP
    scales = t["scales"].astype(np.float32)[:, :, None]  # [out, groups, 1]
    step = max(1, BLOCK_FLOATS // in_f)
    block = np.empty((min(step, out_f), groups, GROUP), dtype=np.float32)  # rows of W, dequantized
    y = np.empty((xf.shape[0], out_f), dtype=np.float32)
    for r0 in range(0, out_f, step):
        r1 = min(out_f, r0 + step)
        vals = t["q_i8"][r0:r1] if "q_i8" in t else unpack_int4_pairs(t["qweight"][r0:r1])
        b = block[: r1 - r0]
        np.multiply(vals.reshape(r1 - r0, groups, GROUP), scales[r0:r1], out=b)  # (nibble - 8) * s, fp32
        y[:, r0:r1] = xf @ b.reshape(r1 - r0, in_f).T
    return y


# format name -> kernel computing fp32 x @ W.T; a format missing here is reported, never emulated
LINEAR_KERNELS = {"int4_sym_g128": matmul_int4_sym_g128}
# format name -> (repack(tensors, fp32) -> arrays to add, nbytes(out, in, fp32) -> their size)
REPACKERS = {"int4_sym_g128": (repack_int4_sym_g128, repacked_nbytes)}
