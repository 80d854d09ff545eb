"""Unit rung: the fp8_e4m3_channel definition (engine/formats) is the GPU's own e4m3 conversion, bit for bit.

The format's NumPy `encode_e4m3` / `decode_e4m3` claim to match `cvt.rn.satfinite.e4m3x2.f32` and
`cvt.rn.f16x2.e4m3x2` (the conversions the CUDA kernels decode with). A backend whose fp8 kernels
expose the hardware conversions (`hardware_encode`, `hardware_decode` of `backend.linears[...]`: the
cuda backend, through two test entry points of kernels/cuda/fp8_e4m3_channel.cu) is held to that here:

- decode: all 256 codes; every non-NaN value has the same bits (the sign of zero included), and the
  NaN codes (0x7F, 0xFF) are exactly the codes that decode to NaN on both sides; and the 256 codes
  tiled into a long array (many blocks of the kernel's grid), each element its code's value;
- encode: every e4m3 value, every midpoint between neighbouring values (ties to even), the floats
  just above and below each midpoint, the subnormal range and the 2^-10 tie at the bottom, +-0, the
  saturating range +-448 .. +-1e30 and +-float32 max, +-inf, NaN, and 200,000 random floats across the
  whole range: the same code for every input.

A backend without the conversions (numpy) skips with that reason; so does cuda where it cannot run.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.formats.fp8_e4m3_channel import FP8_MAX, decode_e4m3, encode_e4m3

F32 = np.float32


def _hardware(backend):
    """The backend's fp8 kernels, where they carry the hardware conversions (cuda's launcher does)."""
    kernels = getattr(backend, "linears", {}).get("fp8_e4m3_channel")
    if not hasattr(kernels, "hardware_encode"):
        pytest.skip(f"backend {backend.name} has no hardware e4m3 conversion to hold the definition to")
    return kernels


def _hex(a) -> str:
    return " ".join(f"{int(v):#04x}" for v in np.asarray(a).reshape(-1))


def _encode_inputs() -> np.ndarray:
    """The float32 inputs the encode test runs (see the module docstring), both signs."""
    codes = np.arange(256, dtype=np.uint8)
    values = decode_e4m3(codes)
    grid = np.unique(np.abs(values[~np.isnan(values)]).astype(np.float64))  # 0, 2^-9 .. 448
    step_past_max = 32.0  # the grid step at 256..448; 480 would be the next value (it is the NaN code)
    grid_ext = np.append(grid, FP8_MAX + step_past_max)
    mids = (grid_ext[:-1] + grid_ext[1:]) / 2  # exact in float32: at most 5 significant bits
    mids32 = mids.astype(F32)
    near = np.concatenate([np.nextafter(mids32, F32(np.inf)), np.nextafter(mids32, F32(0))])
    grid32 = grid.astype(F32)
    around_grid = np.concatenate([np.nextafter(grid32[1:], F32(np.inf)), np.nextafter(grid32[1:], F32(0))])
    tiny = np.array([2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-12, 2.0**-20, 1e-30, 1e-45, 2.0**-126], dtype=F32)
    tiny = np.concatenate([tiny, np.nextafter(tiny, F32(np.inf)), np.nextafter(tiny, F32(0))])
    subnormal = (np.arange(0, 8 * 16 + 1) * 2.0**-13).astype(F32)  # 0 .. 2^-6 in eighths of the subnormal step
    large = np.concatenate([np.geomspace(FP8_MAX, 1e30, 200), [449, 463, 464, 465, 479, 480, 481, 500, 1e4, 65504,
                                                                 65536, np.finfo(F32).max]]).astype(F32)
    rng = np.random.default_rng(0)
    wide = (2.0 ** rng.uniform(-14, 10, 200_000)).astype(F32)
    special = np.array([0.0, np.inf, np.nan], dtype=F32)
    mags = np.concatenate([grid32, mids32, near, around_grid, tiny, subnormal, large, wide, special])
    return np.concatenate([mags, -mags[:-1]]).astype(F32)  # -NaN: see the test of its own below


def test_hardware_e4m3_decode_is_the_definition_bit_for_bit(backend):
    be = _hardware(backend)
    codes = np.arange(256, dtype=np.uint8)
    hw = np.asarray(be.hardware_decode(codes)).astype(F32)  # fp16 -> fp32 is exact, NaN stays NaN
    ref = decode_e4m3(codes)
    hw_nan, ref_nan = np.isnan(hw), np.isnan(ref)
    assert np.array_equal(hw_nan, ref_nan), \
        f"NaN codes differ: hardware {_hex(codes[hw_nan])}, definition {_hex(codes[ref_nan])}"
    assert _hex(codes[ref_nan]) == "0x7f 0xff"
    bad = codes[~ref_nan][hw[~ref_nan].view(np.uint32) != ref[~ref_nan].view(np.uint32)]
    assert bad.size == 0, (f"{bad.size} codes decode differently, e.g. {_hex(bad[:8])}: hardware "
                           f"{hw[bad[:8]].tolist()}, definition {ref[bad[:8]].tolist()}")


def test_hardware_e4m3_decode_covers_every_pair_of_a_long_array(backend):
    """The 256 codes tiled 1,024 times and shuffled (131,072 pairs: 512 blocks of the decode kernel's
    grid-stride loop, where the test above fits one): every element decodes to its code's value, so a
    kernel that skips or repeats a block's pairs shows."""
    be = _hardware(backend)
    codes = np.random.default_rng(0).permutation(np.tile(np.arange(256, dtype=np.uint8), 1024))
    hw = np.asarray(be.hardware_decode(codes)).astype(F32)
    ref = decode_e4m3(codes)
    assert hw.shape == ref.shape
    same = (hw.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(hw) & np.isnan(ref))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (f"{bad.size} of {codes.size} elements decode differently, first at {bad[:8].tolist()}: codes "
                           f"{_hex(codes[bad[:8]])}, hardware {hw[bad[:8]].tolist()}, definition {ref[bad[:8]].tolist()}")


def test_hardware_e4m3_encode_is_the_definition_bit_for_bit(backend):
    be = _hardware(backend)
    v = _encode_inputs()
    hw = np.asarray(be.hardware_encode(v), dtype=np.uint8)
    ref = encode_e4m3(v)
    assert hw.shape == ref.shape == v.shape
    bad = np.flatnonzero(hw != ref)
    shown = ", ".join(f"{v[i]!r} ({v[i:i + 1].view(np.uint32)[0]:#010x}): hardware {hw[i]:#04x}, definition {ref[i]:#04x}"
                      for i in bad[:8])
    assert bad.size == 0, f"{bad.size} of {v.size} inputs encode differently, e.g. {shown}"


def test_hardware_e4m3_encodes_negative_nan_as_the_definition_does(backend):
    be = _hardware(backend)
    v = np.array([np.nan, -np.nan], dtype=F32)
    assert np.signbit(v[1]), "-nan must carry its sign bit for this case to mean anything"
    hw = np.asarray(be.hardware_encode(v), dtype=np.uint8)
    assert _hex(hw) == _hex(encode_e4m3(v)), f"NaN, -NaN: hardware {_hex(hw)}, definition {_hex(encode_e4m3(v))}"
