"""Unit rung: the `int4_sym_g128` format, read three ways (engine/formats, kernels/numpy, reference).

The definition is docs/FORMAT.md's; these tests pin it: the word layout bit for bit, the round trip, the
per-group error bound, all-zero groups, values exactly on rounding ties, and refusal of weights the
format cannot hold.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.formats import FORMATS, get_format
from engine.formats.int4_sym_g128 import pack, unpack
from engine.errors import UnknownFormatError
from fixtures.strategies import quantizable_weight, rng_for, seeds
from kernels.numpy.int4_sym_g128 import dequantize as numpy_dequantize, unpack_int4_pairs
from ladder.judges.compare import assert_close, assert_equal
from reference.formats import ref_dequant_int4_sym_g128, ref_unpack_int4

INT4 = get_format("int4_sym_g128")


def test_word_layout_matches_the_documented_map():
    # Elements 0..7 hold their own index: nibble k must hold element (0, 2, 4, 6, 1, 3, 5, 7)[k].
    word = pack(np.arange(8, dtype=np.uint32).reshape(1, 8))
    assert word.dtype == np.uint32 and word.shape == (1, 1)
    assert int(word[0, 0]) == 0x75316420
    # The pair rule: (word >> 4k) & 0x000F000F yields elements 2k (low half) and 2k+1 (high half).
    for k in range(4):
        pair = (int(word[0, 0]) >> (4 * k)) & 0x000F000F
        assert (pair & 0xF, pair >> 16) == (2 * k, 2 * k + 1)


def test_qweight_bytes_are_little_endian():
    word = pack(np.arange(8, dtype=np.uint32).reshape(1, 8))
    assert word.tobytes() == bytes([0x20, 0x64, 0x31, 0x75])


@given(rows=st.integers(1, 8), words=st.integers(1, 48), seed=seeds)
def test_three_unpacks_agree_with_pack(rows, words, seed):
    nib = rng_for(seed).integers(0, 16, size=(rows, words * 8)).astype(np.uint8)
    q = pack(nib)
    assert_equal("unpack_engine", unpack(q), nib, backend="numpy", seed=seed)
    assert_equal("unpack_reference", ref_unpack_int4(q), nib, backend="reference", seed=seed)
    assert_equal("unpack_numpy_kernel", unpack_int4_pairs(q) + 8, nib, backend="numpy", seed=seed)


@given(out_f=st.integers(1, 16), groups=st.integers(1, 4), scale=st.sampled_from((1e-4, 0.05, 3.0, 300.0)), seed=seeds)
@example(out_f=2, groups=1, scale=0.05, seed=0)
def test_round_trip_within_half_a_step_per_group(out_f, groups, scale, seed):
    rng = rng_for(seed)
    w = quantizable_weight(rng, out_f, 128 * groups, scale)
    t = INT4.quantize(w)
    assert t["qweight"].dtype == np.uint32 and t["qweight"].shape == (out_f, 16 * groups)
    assert t["scales"].dtype == np.float16 and t["scales"].shape == (out_f, groups)
    deq = INT4.dequantize(t)
    # Three readings of the stored bytes agree exactly.
    assert_close("dequantize", deq, ref_dequant_int4_sym_g128(t["qweight"], t["scales"]), backend="reference", seed=seed)
    assert_close("dequantize", numpy_dequantize(t), deq.astype(np.float64), backend="numpy", seed=seed)
    # Error bound: rint to the nearest step of the (fp16) scale, so at most half a step per element.
    s = np.repeat(t["scales"].astype(np.float64), 128, axis=1)
    err = np.abs(deq.astype(np.float64) - w)
    assert (err <= s / 2 * (1 + 1e-6) + 1e-12).all(), f"max error / (scale/2) = {(err / (s / 2)).max():.4f}"
    # The scale definition: fp16(max|w| / 7) per group.
    expect = (np.abs(w.reshape(out_f, groups, 128)).max(axis=2) / np.float32(7)).astype(np.float16)
    assert_equal("scales", t["scales"], expect, backend="numpy", seed=seed)


def test_all_zero_group_stores_scale_zero_and_nibble_eight():
    w = np.zeros((2, 256), dtype=np.float32)
    w[1, 128:] = np.linspace(-1, 1, 128)
    t = INT4.quantize(w)
    assert t["scales"][0, 0] == 0 and t["scales"][0, 1] == 0 and t["scales"][1, 0] == 0
    assert (unpack(t["qweight"])[0] == 8).all() and (unpack(t["qweight"])[1, :128] == 8).all()
    assert np.array_equal(INT4.dequantize(t)[0], np.zeros(256, dtype=np.float32))


def test_values_on_rounding_ties_round_half_to_even():
    # Scale exactly 1.0 (max |w| = 7); w = k + 0.5 lies exactly between two steps: rint goes to even.
    w = np.zeros((1, 128), dtype=np.float32)
    w[0, 0] = 7.0
    w[0, 1:9] = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5]
    t = INT4.quantize(w)
    assert t["scales"][0, 0] == np.float16(1.0)
    q = unpack(t["qweight"]).astype(int)[0, :9] - 8
    assert q.tolist() == [7, 0, 2, 2, 0, -2, -2, 4, -4]


def test_extremes_clamp_to_the_signed_range():
    w = np.full((1, 128), -1.0, dtype=np.float32)
    w[0, 0] = -7.0
    t = INT4.quantize(w)
    q = unpack(t["qweight"]).astype(int) - 8
    assert q.min() >= -8 and q.max() <= 7 and q[0, 0] == -7


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e6])
def test_weights_the_format_cannot_hold_are_refused(bad):
    w = np.zeros((1, 128), dtype=np.float32)
    w[0, 5] = bad
    with pytest.raises(ValueError):
        INT4.quantize(w)


def test_in_features_must_be_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="not a multiple of 128"):
        INT4.quantize(np.ones((2, 100), dtype=np.float32))


def test_format_registry_names_and_refuses():
    assert "int4_sym_g128" in FORMATS
    with pytest.raises(UnknownFormatError, match="int3_magic"):
        get_format("int3_magic")
