"""Unit rung: every quantization format, read three ways (engine/formats, kernels/numpy, reference/formats).

What each format must do, whatever its layout (docs/FORMAT.md): the three readings of its stored bytes
agree exactly; its tensors have the dtypes and shapes `tensor_specs` promises; the dequantized weight
is within the format's step of the original; `fuse` stacks rows; the fault edits change exactly what
they say; weights it cannot hold and shapes it cannot take are refused. Then what each new format
pins bit for bit: the int8 clamp, the int4_asym_g128 scale_zero word, and the e4m3 encoder against
PyTorch's float8_e4m3fn on every value and midpoint of the grid (the GPU's own conversion is checked in
test_fp8_hardware.py).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.formats import FORMATS, get_format
from engine.formats.fp8_e4m3_channel import FP8_MAX, decode_e4m3, encode_e4m3
from engine.formats.int4_asym_g128 import pack_scale_zero, unpack_scale_zero
from engine.formats.int4_sym_g128 import unpack
from fixtures.strategies import quantizable_weight, rng_for, seeds
from ladder.checks.harness import by_row_blocks
from ladder.judges.compare import assert_close, assert_equal
from ladder.run.nested import REPO, child_env, skip_inside_nested_run
from reference.formats import REF_DEQUANT, ref_e4m3, ref_unpack_int4

NAMES = sorted(FORMATS)


def _numpy_kernel(name):
    return importlib.import_module(f"kernels.numpy.{name}")


@pytest.mark.parametrize("name", NAMES)
@given(out_f=st.integers(1, 12), units=st.integers(1, 3), scale=st.sampled_from((1e-3, 0.05, 3.0)), seed=seeds)
@example(out_f=2, units=1, scale=0.05, seed=0)
def test_three_readings_agree_and_stay_within_a_step(name, out_f, units, scale, seed):
    fmt = get_format(name)
    in_f = 128 * units
    w = quantizable_weight(rng_for(seed), out_f, in_f, scale)
    t = fmt.quantize(w)
    specs = fmt.tensor_specs(out_f, in_f)
    assert sorted("." + k for k in t) == sorted(specs) == sorted(fmt.suffixes)
    for suffix, (dtype, shape) in specs.items():
        a = t[suffix.lstrip(".")]
        assert a.dtype == np.dtype(dtype) and a.shape == shape, (suffix, a.dtype, a.shape)
    deq = fmt.dequantize(t)
    assert deq.dtype == np.float32 and deq.shape == (out_f, in_f)
    assert_close("dequantize", deq, REF_DEQUANT[name](t), backend="reference", case=name, seed=seed)
    assert_close("dequantize", _numpy_kernel(name).dequantize(t), deq.astype(np.float64), backend="numpy", case=name, seed=seed)
    # Round to nearest on the format's grid: within its max_error_steps of the element's step.
    bound = fmt.step(t) * fmt.max_error_steps
    err = np.abs(deq.astype(np.float64) - w)
    assert (err <= bound * (1 + 1e-6) + 1e-30).all(), f"{name}: max error / bound = {(err / np.maximum(bound, 1e-30)).max():.4f}"


@pytest.mark.parametrize("name", NAMES)
def test_fuse_stacks_the_rows_of_its_parts(name):
    fmt, rng = get_format(name), rng_for(3)
    parts = [fmt.quantize(quantizable_weight(rng, rows, 256)) for rows in (3, 5, 2)]
    fused = fmt.fuse(parts)
    assert_equal("fuse", fmt.dequantize(fused), np.concatenate([fmt.dequantize(p) for p in parts]), backend="numpy", case=name)


@pytest.mark.parametrize("name", NAMES)
def test_row_blocks_quantized_and_read_apart_are_the_whole_weight_bit_for_bit(name):
    """The unit rung quantizes and reads its 7B-shape weights by row blocks in threads (ladder/checks/harness.py
    by_row_blocks): that is the same as one call only if every tensor of the format is kept row by row."""
    fmt, rng = get_format(name), rng_for(5)
    w = quantizable_weight(rng, 37, 512)
    whole = fmt.quantize(w)
    fused = fmt.fuse(by_row_blocks(lambda part: fmt.quantize(part["w"]), {"w": w}, blocks=4))
    assert fused.keys() == whole.keys()
    for k in whole:
        assert fused[k].dtype == whole[k].dtype and np.array_equal(fused[k], whole[k]), f"{name}: tensor {k} differs"
    apart = np.concatenate(by_row_blocks(REF_DEQUANT[name], whole, blocks=4))
    assert np.array_equal(apart, REF_DEQUANT[name](whole)), f"{name}: the reference reading differs by row blocks"


@pytest.mark.parametrize("name", NAMES)
def test_fault_edits_change_exactly_what_they_say(name):
    fmt = get_format(name)
    w = quantizable_weight(rng_for(4), 6, 256)
    w[:, 0], w[:, 1] = 0.04, -0.02  # elements 0 and 1 differ in every row
    t = fmt.quantize(w)
    before = fmt.dequantize(t)
    swapped = fmt.dequantize(fmt.swap_pair(t))
    assert_equal("swap_pair", swapped[:, [1, 0]], before[:, :2], backend="numpy", case=name)
    assert_equal("swap_pair_rest", swapped[:, 2:], before[:, 2:], backend="numpy", case=name)
    changed = fmt.dequantize(fmt.shift_scale(t)) != before
    assert changed.any(), f"{name}: shift_scale changed nothing"
    last_row_only = not changed[:-1].any()  # per-row scales: the last row takes its neighbour's
    last_group_only = not changed[:, :-128].any()  # per-group scales: each row's last group
    assert last_row_only or last_group_only, f"{name}: shift_scale changed more than one scale's elements"
    assert_equal("dequantize", fmt.dequantize(t), before, backend="numpy", case=f"{name}: the edits copy")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_weights_holding_nan_or_inf_are_refused(name, bad):
    w = np.zeros((2, 128), dtype=np.float32)
    w[1, 7] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        get_format(name).quantize(w)


@pytest.mark.parametrize("name", NAMES)
def test_input_widths_off_the_format_rule_are_refused_with_the_rule(name):
    fmt = get_format(name)
    bad = fmt.in_multiple + 8 if fmt.in_multiple > 8 else 7
    assert fmt.check_linear(4, bad) is not None and fmt.check_linear(4, 2 * fmt.in_multiple) is None
    with pytest.raises(ValueError, match=f"multiple of {fmt.in_multiple}"):
        fmt.quantize(np.ones((2, bad), dtype=np.float32))


@pytest.mark.parametrize("name", NAMES)
def test_all_zero_rows_dequantize_to_zero(name):
    fmt = get_format(name)
    w = np.zeros((3, 256), dtype=np.float32)
    w[1] = np.linspace(-1, 1, 256)
    deq = fmt.dequantize(fmt.quantize(w))
    assert (deq[0] == 0).all() and (deq[2] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_bytes_per_weight_counts_every_stored_tensor(name):
    fmt = get_format(name)
    t = fmt.quantize(quantizable_weight(rng_for(1), 64, 512))
    assert fmt.bytes_per_weight(64, 512) == sum(a.nbytes for a in t.values()) / (64 * 512)


def test_bytes_per_weight_of_the_shipped_formats():
    expect = {"int4_sym_g128": 0.5 + 2 / 128, "int4_asym_g128": 0.5 + 4 / 128,
              "int8_sym_channel": 1 + 2 / 4096, "fp8_e4m3_channel": 1 + 2 / 4096}
    assert {n: get_format(n).bytes_per_weight(4096, 4096) for n in expect} == pytest.approx(expect)


# --- the INT4 quantizers, element by element ------------------------------------------------------


def _int4_edge_weight(seed: int) -> np.ndarray:
    """Three rows of two groups: a plain group, an all-zero and an all -0.0 group, a group whose fp16 scale
    rounds to 0 though a weight is not 0, a group of rint ties (multiples of half a step), an outlier."""
    rng = rng_for(seed)
    w = (rng.standard_normal((3, 256)) * 0.05).astype(np.float32)
    w[0, 128:] = 0.0
    w[1, :128] = -0.0
    w[1, 128:] = 0.0
    w[1, 130] = 1e-9  # max / 7 is below fp16's smallest subnormal: the scale is 0
    step = np.float32(0.25)
    w[2, :128] = rng.integers(-16, 16, 128).astype(np.float32) * (step / np.float32(2))
    w[2, 0] = np.float32(7) * step  # the group's max: the scale is exactly `step`
    w[2, 200] = 300.0
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int4_sym_quantizer_is_its_definition_element_by_element(seed):
    """docs/FORMAT.md: s = fp16(max |W| / 7) per group of 128, q = clamp(rint(W / s), -8, 7) with the fp16
    scale in float32 (q = 0 where s = 0), nibble q + 8; computed here one element at a time, and the
    stored nibbles read by reference/formats.py's own unpack."""
    w = _int4_edge_weight(seed)
    t = get_format("int4_sym_g128").quantize(w)
    nib = ref_unpack_int4(t["qweight"])
    for o in range(w.shape[0]):
        for j in range(w.shape[1] // 128):
            g = w[o, 128 * j:128 * j + 128]
            s = np.float16(max(abs(v) for v in g) / np.float32(7))
            assert t["scales"][o, j].tobytes() == s.tobytes(), (o, j)
            s32 = np.float32(s)
            for k, v in enumerate(g):
                q = 0 if s32 == 0 else int(min(7, max(-8, np.rint(np.float32(v) / s32))))
                assert nib[o, 128 * j + k] == q + 8, (o, j, k, v, s)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int4_asym_quantizer_is_its_definition_element_by_element(seed):
    """docs/FORMAT.md: lo = min(min W, 0), hi = max(max W, 0), s = fp16((hi - lo) / 15),
    z = clamp(rint(-lo / s), 0, 15), q = clamp(rint(W / s) + z, 0, 15) in float32 (q = z = 0 where s = 0)."""
    w = _int4_edge_weight(seed)
    t = get_format("int4_asym_g128").quantize(w)
    nib = ref_unpack_int4(t["qweight"])
    scales, zeros = unpack_scale_zero(t["scale_zero"])
    for o in range(w.shape[0]):
        for j in range(w.shape[1] // 128):
            g = w[o, 128 * j:128 * j + 128]
            lo, hi = min(np.float32(0), min(g)), max(np.float32(0), max(g))
            s = np.float16((hi - lo) / np.float32(15))
            assert scales[o, j].tobytes() == s.tobytes(), (o, j)
            s32 = np.float32(s)
            z = 0 if s32 == 0 else int(min(15, max(0, np.rint(-lo / s32))))
            assert zeros[o, j] == z, (o, j)
            for k, v in enumerate(g):
                q = 0 if s32 == 0 else int(min(15, max(0, np.rint(np.float32(v) / s32) + np.float32(z))))
                assert nib[o, 128 * j + k] == q, (o, j, k, v, s, z)


# --- int8_sym_channel ------------------------------------------------------------------------------


def test_int8_scale_is_max_over_127_and_minus_128_is_never_stored():
    w = np.linspace(-2.0, 1.0, 256, dtype=np.float32).reshape(2, 128)
    t = get_format("int8_sym_channel").quantize(w)
    assert_equal("scales", t["scales"], (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float16), backend="numpy")
    assert t["qweight"].min() >= -127 and t["qweight"][0, 0] == -127


# --- int4_asym_g128 --------------------------------------------------------------------------------


def test_scale_zero_word_holds_the_scale_then_1024_plus_z():
    # scale 1.0 (0x3C00) and z = 5: the high half is 0x6405, the fp16 number 1029.
    word = pack_scale_zero(np.float16([1.0]), np.array([5]))
    assert int(word[0]) == 0x64053C00
    assert word.tobytes() == bytes([0x00, 0x3C, 0x05, 0x64])
    s, z = unpack_scale_zero(word)
    assert s[0] == np.float16(1.0) and z[0] == 5
    assert np.float16(1029.0).view(np.uint16) == 0x6405


def test_scale_zero_words_without_the_magic_high_half_are_refused():
    with pytest.raises(ValueError, match="0x6400"):
        unpack_scale_zero(np.array([0x3C00], dtype=np.uint32))


def test_asymmetric_range_spends_all_sixteen_levels_on_a_one_sided_group():
    # All-positive group 0 .. 15: lo = 0, so z = 0, s = 1, and every level 0..15 is an exact value.
    w = np.tile(np.arange(16, dtype=np.float32), 8).reshape(1, 128)
    fmt = get_format("int4_asym_g128")
    t = fmt.quantize(w)
    s, z = unpack_scale_zero(t["scale_zero"])
    assert s[0, 0] == np.float16(1.0) and z[0, 0] == 0
    assert_equal("dequantize", fmt.dequantize(t), w, backend="numpy")
    assert sorted(set(unpack(t["qweight"])[0].tolist())) == list(range(16))


# --- fp8_e4m3_channel ------------------------------------------------------------------------------


def test_e4m3_decode_matches_the_bit_fields_and_torch_for_all_256_codes():
    torch = pytest.importorskip("torch")
    codes = np.arange(256, dtype=np.uint8)
    ours = decode_e4m3(codes)
    fields = np.array([ref_e4m3(int(c)) for c in codes], dtype=np.float32)
    theirs = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(ours, fields, equal_nan=True)
    assert np.array_equal(ours, theirs, equal_nan=True)
    assert np.isnan(ours[[0x7F, 0xFF]]).all() and np.isnan(ours).sum() == 2
    assert ours[0x7E] == FP8_MAX and ours[0x01] == 2.0**-9 and ours[0x08] == 2.0**-6


def test_every_e4m3_code_reads_the_same_three_ways():
    """All 256 codes, NaN codes included (a quantizer never writes them, a file may hold them)."""
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    t = {"qweight": codes, "scales": np.full(16, 0.5, dtype=np.float16)}
    engine_w = get_format("fp8_e4m3_channel").dequantize(t)
    assert np.isnan(engine_w).sum() == 2
    assert np.array_equal(_numpy_kernel("fp8_e4m3_channel").dequantize(t), engine_w, equal_nan=True)
    assert np.array_equal(REF_DEQUANT["fp8_e4m3_channel"](t), engine_w.astype(np.float64), equal_nan=True)


def _grid_and_midpoints() -> np.ndarray:
    values = np.unique(decode_e4m3(np.arange(256, dtype=np.uint8))[~np.isnan(decode_e4m3(np.arange(256, dtype=np.uint8)))])
    v64 = values.astype(np.float64)
    mids = ((v64[:-1] + v64[1:]) / 2).astype(np.float32)  # exact in fp32: ties
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    return np.concatenate([values, mids, near, np.float32([2.0**-10, -(2.0**-10), 2.0**-11, 3 * 2.0**-11, 0.0, -0.0])])


def test_e4m3_encode_rounds_to_nearest_even_like_torch_on_every_value_and_midpoint():
    torch = pytest.importorskip("torch")
    v = _grid_and_midpoints()
    ours = encode_e4m3(v)
    theirs = torch.from_numpy(v).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    bad = np.flatnonzero(ours != theirs)
    assert bad.size == 0, f"{bad.size} values differ, first {v[bad[:5]]}: ours {ours[bad[:5]]}, torch {theirs[bad[:5]]}"
    grid = decode_e4m3(np.arange(256, dtype=np.uint8))
    finite = ~np.isnan(grid)
    assert np.array_equal(encode_e4m3(grid[finite]), np.arange(256, dtype=np.uint8)[finite]), "every e4m3 value encodes to itself"


def test_e4m3_encode_saturates_overflow_and_inf_and_keeps_nan_and_signed_zero():
    # (torch's own cast turns overflow into NaN; the H200's .satfinite conversion, which the engine's
    # kernels follow, clamps to +-448: that is the definition.)
    v = np.float32([448.0, 460.0, 464.0, 1e4, 3e38, np.inf, -np.inf, -500.0, np.nan, -0.0, 0.0])
    assert encode_e4m3(v).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F, 0x80, 0x00]


def test_fp8_scale_maps_each_rows_max_onto_448():
    w = quantizable_weight(rng_for(7), 4, 256)
    t = get_format("fp8_e4m3_channel").quantize(w)
    assert_equal("scales", t["scales"], (np.abs(w).max(axis=1) / np.float32(FP8_MAX)).astype(np.float16), backend="numpy")
    assert (np.abs(decode_e4m3(t["qweight"])) <= FP8_MAX).all()


# --- a backend without a format's kernel -------------------------------------------------------------

_PARTIAL_BACKEND = '''
"""A NumPy backend with the kernels of int4_sym_g128 only (a test plugin, loaded with -p)."""
from kernels import register_backend
from kernels.base import FormatNotSupportedError
from kernels.numpy import NumpyBackend


class Int4OnlyBackend(NumpyBackend):
    name = "int4only"
    formats = ("int4_sym_g128",)

    def prepare_linear(self, fmt, tensors, out_features, in_features):
        if fmt not in self.formats:
            raise FormatNotSupportedError(f"backend 'int4only' has no kernel for format {fmt!r}")
        return super().prepare_linear(fmt, tensors, out_features, in_features)


register_backend("int4only", Int4OnlyBackend)
'''


@skip_inside_nested_run
def test_a_format_without_a_kernel_fails_and_is_reported_as_unsupported(tmp_path):
    (tmp_path / "int4only_backend.py").write_text(_PARTIAL_BACKEND)
    env = child_env(None, pythonpath=f"{REPO}{os.pathsep}{tmp_path}")
    results = {}
    for quant in ("int4_sym_g128", "int8_sym_channel"):
        out = tmp_path / f"{quant}.json"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                            "-p", "int4only_backend", "--backend", "int4only", "--quant", quant, "--ladder-json", str(out),
                            "ladder/unit/test_ops.py", "-k", "qkv_proj"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
        results[quant] = (r, json.loads(out.read_text()))
    ok, ok_json = results["int4_sym_g128"]
    assert ok.returncode == 0 and ok_json["unsupported"] == [], ok.stdout[-2000:]
    bad, bad_json = results["int8_sym_channel"]
    assert bad.returncode == 1, bad.stdout[-2000:]
    assert bad_json["rungs"]["unit"].get("passed", 0) == 0 and bad_json["rungs"]["unit"]["failed"] > 0
    [entry] = bad_json["unsupported"]
    assert (entry["backend"], entry["format"]) == ("int4only", "int8_sym_channel")
    assert entry["tests"] == bad_json["rungs"]["unit"]["failed"]
    assert "UNSUPPORTED: backend int4only has no kernel for format int8_sym_channel" in bad.stdout
