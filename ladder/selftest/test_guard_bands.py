"""Self-test: the guard bands around the unit rung's outputs catch a write outside them.

ladder/checks/harness.py hands every op an output (`sentinel`) or an in-place buffer (`guarded`) that is a
view into the middle of a larger buffer, with canary bytes on either side, and `host` checks the canaries
when it reads the output back. These cases plant the writes a kernel's tail block could make (one element
past the last row, one before the first) on the NumPy backend and hold the harness to naming them; the
same views go to the CUDA kernels, where the write would come from the kernel itself.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine.formats import get_format
from kernels import get_backend
from ladder.checks import harness, ops


def _flat_beyond(out, before: int = 0, after: int = 0) -> np.ndarray:
    """A 1-D view of `out` widened by `before` and `after` elements: what a kernel's wrong index reaches."""
    flat = out.reshape(-1)
    start = flat.ctypes.data - before * flat.itemsize
    raw = (ctypes.c_char * ((flat.size + before + after) * flat.itemsize)).from_address(start)
    return np.frombuffer(raw, dtype=flat.dtype)


def test_an_output_keeps_the_alignment_of_a_fresh_allocation_and_its_sentinel():
    backend = get_backend("numpy")
    out = harness.sentinel(backend, (3, 5), np.float16)
    whole = harness._GUARDED[id(out)][1]
    offset = out.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
    assert offset == harness.GUARD_BYTES and offset % 256 == 0
    assert out.shape == (3, 5) and out.flags.c_contiguous and np.isnan(out).all()
    harness.host(backend, out)  # untouched bands pass


@pytest.mark.parametrize("side,before,after,words", [("past its last element", 0, 1, "0 bytes away"),
                                                     ("before its first element", 1, 0, "0 bytes away")])
def test_a_write_just_outside_an_output_fails_naming_the_side(side, before, after, words):
    backend = get_backend("numpy")
    out = harness.sentinel(backend, (4, 8), np.float32)
    out[...] = 1.0
    wide = _flat_beyond(out, before, after)
    wide[0 if before else -1] = 2.0
    with pytest.raises(AssertionError, match=f"{side}.*{words}"):
        harness.host(backend, out)


def test_an_op_that_writes_one_row_past_its_output_fails_its_check():
    """qkv_proj that writes a correct result, then one more row: every value the check compares is right."""
    backend = get_backend("numpy")
    original = backend.qkv_proj

    def overrun(x, w, bias, out):
        original(x, w, bias, out)
        _flat_beyond(out, after=out.shape[1])[-out.shape[1]:] = out[-1]

    backend.qkv_proj = overrun
    with pytest.raises(AssertionError, match="^qkv_proj wrote outside its output: .* past its last element"):
        ops.check_qkv_proj(backend, get_format("int4_sym_g128"), **ops.check_qkv_proj.examples[0])


def test_an_in_place_buffer_is_guarded_too():
    backend = get_backend("numpy")
    original = backend.o_proj_residual

    def underrun(x, w, residual):
        original(x, w, residual)
        _flat_beyond(residual, before=1)[0] = 0.0

    backend.o_proj_residual = underrun
    with pytest.raises(AssertionError, match="before its first element"):
        ops.check_o_proj_residual(backend, get_format("int4_sym_g128"), **ops.check_o_proj_residual.examples[0])


def test_a_block_whose_op_writes_past_a_workspace_buffer_fails_the_layer_rung():
    """The layer rung's blocks run with every workspace and KV cache buffer between guard bands
    (ladder/checks/blockrun.py): an o_proj that adds one element past the residual stream fails the block."""
    from engine.config import SHAPES
    from fixtures.layer_cases import LayerCase
    from ladder.checks.block import BlockUnderTest
    from ladder.checks.blockrun import run_engine_block

    backend = get_backend("numpy")
    block = BlockUnderTest.synthetic(SHAPES["tiny"], seed=1)
    case = LayerCase(layer=0, L=5, steps=2, seed=1)
    for _ in range(harness._MAX_GUARDED):  # the outputs' table full, as after a run of unit cases
        harness.sentinel(backend, (1,), np.float32)
    kept = dict(harness._GUARDED)
    out, k, v = run_engine_block(backend, block.config, block.quant, block.get, case)  # green: bands intact
    assert harness._GUARDED == kept  # the block's buffers are checked and let go, not kept in the outputs' table
    assert np.isfinite(out).all() and out.shape == (7, block.config.hidden_size)
    original = backend.o_proj_residual

    def overrun(x, w, resid):
        original(x, w, resid)
        _flat_beyond(resid, after=1)[-1] += 1.0

    backend.o_proj_residual = overrun
    with pytest.raises(AssertionError, match=r"^the block \(layer 0, .*\) wrote outside a buffer: .* past its last element"):
        run_engine_block(backend, block.config, block.quant, block.get, case)
    assert "empty" not in vars(backend) and "full" not in vars(backend)  # the backend is left as it was


def test_an_op_that_reads_one_element_past_its_input_fails_its_check():
    """rmsnorm that adds the square of one element past its input's end to the last row's sum: the input is
    followed by NaN (harness `dev`), so the row comes out NaN, where a bare allocation's slack could hold 0."""
    backend = get_backend("numpy")
    original = backend.rmsnorm

    def over_read(x, w, eps, out):
        original(x, w, eps, out)
        past = float(_flat_beyond(x, after=1)[-1])
        out[-1] = out[-1] * np.float16(1.0 + past * past)

    backend.rmsnorm = over_read
    with pytest.raises(AssertionError, match="rmsnorm"):
        ops.check_rmsnorm(backend, **ops.check_rmsnorm.examples[0])
    x = harness.dev(backend, np.ones((2, 3), np.float16))
    assert np.isnan(_flat_beyond(x, after=harness.GUARD_BYTES // 2)[6:]).all()  # the whole band is NaN


def test_under_memcheck_an_input_is_its_own_allocation_ending_where_the_array_ends(monkeypatch):
    """With the pool off for compute-sanitizer (mutate's second look), `dev` hands each input out in an
    allocation of exactly its size, so a read one past it is an access memcheck reports; the NaN band would
    show it only if the value reached an output (an over-read into a slot that is overwritten before it is
    read, as a surviving attention mutant did, passes the bands)."""
    backend = get_backend("numpy")
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    banded = harness.dev(backend, a)
    assert banded.base is not None and banded.base.nbytes == a.nbytes + harness.GUARD_BYTES
    monkeypatch.setenv(harness.POOL_VARIABLE, "0")
    assert harness.under_memcheck()
    exact = harness.dev(backend, a)
    assert np.array_equal(exact, a) and (exact.base is None or exact.base.nbytes == a.nbytes)
