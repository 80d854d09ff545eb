"""Unit rung: how the NumPy backend stays fast at a real size, pinned as properties (kernels/numpy/).

`prepare_linear` repacks each quantized weight once: its dequantized fp32 transpose while the backend's
budget lasts, int8 values dequantized per call past it; `lm_head` widens a read-only fp16 table once per
table object; the matmuls run on a set number of BLAS threads. The fp32 layout must be exactly the
dequantized weight, every layout must pass the unit rung's linear check, the budget must decide the
layout and come back when a weight is freed, and the lm_head cache must never serve the copy of another
table or of a table that can change.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.formats import get_format
from fixtures.strategies import fp16, linear_shapes, quantizable_weight, rng_for, seeds
from kernels import QuantizedWeight
from engine.formats import FORMATS
from kernels.numpy import NumpyBackend, blas, linear
from ladder.judges.compare import assert_close, assert_equal
from reference import ops as ref_ops
from reference.formats import REF_DEQUANT, ref_dequant_int4_sym_g128, ref_unpack_int4

F16, F32 = np.float16, np.float32
INT4 = get_format("int4_sym_g128")


def _prepared(be, w, fmt=INT4):
    t = fmt.quantize(w)
    return be.prepare_linear(fmt.name, t, w.shape[0], w.shape[1]), t


def _read_only(a):
    a = np.array(a, copy=True)
    a.flags.writeable = False
    return a


def _logits(be, x, table):
    out = np.full((x.shape[0], table.shape[0]), np.nan, F32)
    be.lm_head(x, table, out)
    return out


# --- prepare_linear -------------------------------------------------------------------------------


@given(out_f=st.integers(1, 40), groups=st.integers(1, 4), seed=seeds)
@example(out_f=2, groups=1, seed=0)
def test_repacked_weights_are_exactly_the_stored_weight(out_f, groups, seed):
    w = quantizable_weight(rng_for(seed), out_f, 128 * groups)
    qw, t = _prepared(NumpyBackend(), w)
    wt = qw["wt_f32"]
    assert wt.dtype == F32 and wt.shape == (128 * groups, out_f) and wt.flags.c_contiguous
    assert_equal("repack_fp32", wt.T, ref_dequant_int4_sym_g128(t["qweight"], t["scales"]), backend="numpy", seed=seed)
    qi8, _ = _prepared(NumpyBackend(repack_bytes=0), w)
    assert "wt_f32" not in qi8.tensors
    assert_equal("repack_int8", qi8["q_i8"].astype(np.int64) + 8, ref_unpack_int4(t["qweight"]), backend="numpy", seed=seed)
    for q in (qw, qi8):  # the stored tensors stay as they came
        assert_equal("stored_qweight", q["qweight"], t["qweight"], backend="numpy", seed=seed)
        assert_equal("stored_scales", q["scales"], t["scales"], backend="numpy", seed=seed)


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("layout", ["fp32", "per_call", "packed"])
@given(shape=linear_shapes(), seed=seeds)
@example(shape=(1, 512, 136, 0), seed=0)
def test_every_weight_layout_passes_the_linear_check(fmt_name, layout, shape, seed):
    """fp32: dequantized once; per_call: past the budget (int4_sym_g128: int8 values), rows dequantized
    per call in blocks; packed: a weight made without prepare_linear, only its stored tensors."""
    fmt = FORMATS[fmt_name]
    T, in_f, out_f, _ = shape
    rng = rng_for(seed)
    x = fp16(rng, (T, in_f))
    w = quantizable_weight(rng, out_f, in_f)
    resid = (rng.standard_normal((T, out_f)) * 4).astype(F32)
    be = NumpyBackend(repack_bytes=0 if layout == "per_call" else None)
    qw, t = _prepared(be, w, fmt)
    if layout == "packed":  # made without prepare_linear: only the stored tensors
        qw = QuantizedWeight(fmt.name, out_f, in_f, dict(t))
    assert ("wt_f32" in qw.tensors) == (layout == "fp32")
    wref = REF_DEQUANT[fmt.name](t)
    ref = resid + ref_ops.ref_linear(x, wref)
    plain = resid + ref_ops.ref_linear(x, wref, dtype=F32)
    out = resid.copy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear, "BLOCK_FLOATS", 3 * in_f)  # blocks of 3 rows: several blocks and a short last one
        be.o_proj_residual(x, qw, out)
    assert_close("o_proj_residual", out, ref, plain, backend="numpy", case=f"{fmt.name},{layout},T={T},in={in_f},out={out_f}", seed=seed)


@pytest.mark.parametrize("fp32", [True, False], ids=["fp32", "past_the_budget"])
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_repacked_nbytes_is_what_repack_adds(fmt_name, fp32):
    """The budget is charged `repacked_nbytes` for a weight: it must be the bytes `repack` adds, in either
    layout (int4_sym_g128's int8 values past the budget are one byte a weight, the other formats add none)."""
    fmt = FORMATS[fmt_name]
    w = quantizable_weight(rng_for(0), 48, 256)
    kernels = NumpyBackend._kernels(fmt_name)
    added = kernels.repack({k: np.ascontiguousarray(v) for k, v in fmt.quantize(w).items()}, fp32)
    assert sum(a.nbytes for a in added.values()) == kernels.repacked_nbytes(*w.shape, fp32)


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_the_budget_decides_the_layout_and_comes_back_when_a_weight_is_freed(fmt_name):
    fmt = FORMATS[fmt_name]
    w = quantizable_weight(rng_for(0), 64, 256)
    be = NumpyBackend(repack_bytes=w.size * 4)  # room for exactly one fp32 copy
    first, _ = _prepared(be, w, fmt)
    second, _ = _prepared(be, w, fmt)
    assert "wt_f32" in first.tensors and "wt_f32" not in second.tensors
    if fmt_name == "int4_sym_g128":
        assert "q_i8" in second.tensors  # past the budget INT4 keeps its values widened to int8
    assert be.repacked_bytes == w.size * 4
    del first
    gc.collect()
    assert be.repacked_bytes == 0
    third, _ = _prepared(be, w, fmt)
    assert "wt_f32" in third.tensors


# --- lm_head --------------------------------------------------------------------------------------


@given(V=st.sampled_from((128, 1000, 4096)), H=st.sampled_from((128, 256)), T=st.integers(1, 3), seed=seeds)
@example(V=1000, H=128, T=1, seed=0)
def test_lm_head_widens_a_read_only_table_once(V, H, T, seed):
    rng = rng_for(seed)
    x, table = fp16(rng, (T, H)), _read_only(fp16(rng, (V, H), 0.2))
    be = NumpyBackend()
    first = _logits(be, x, table)
    assert be.repacked_bytes == V * H * 4
    again = _logits(be, x, table)
    assert be.repacked_bytes == V * H * 4
    assert_equal("lm_head_cached", again, first, backend="numpy", seed=seed)
    assert_close("lm_head", first, ref_ops.ref_lm_head(x, table), ref_ops.ref_lm_head(x, table, dtype=F32), backend="numpy",
                 case=f"cached,V={V},H={H},T={T}", seed=seed)


def test_lm_head_never_serves_the_copy_of_a_freed_table():
    """A fresh table per example, freed after use: CPython hands a new array the freed one's id()."""
    rng = rng_for(7)
    be = NumpyBackend()
    x = fp16(rng, (1, 128))
    for i in range(12):
        table = _read_only(fp16(rng, (1000, 128), 0.2))
        out = _logits(be, x, table)
        assert_close("lm_head", out, ref_ops.ref_lm_head(x, table), ref_ops.ref_lm_head(x, table, dtype=F32), backend="numpy",
                     case=f"fresh table {i}")
        del table
        gc.collect()
        assert be.repacked_bytes == 0  # the freed table's copy went with it


def test_a_stale_cache_entry_under_a_reused_id_is_dropped_and_its_bytes_returned():
    """The entry of a freed table whose weakref callback has not run yet (no CPython run shows it: the
    callback runs at the free) is found under the id a new table got: its copy must not be served, and
    its bytes go back to the budget before the new table's are taken."""
    rng = rng_for(8)
    be = NumpyBackend()
    x = fp16(rng, (1, 128))
    table = _read_only(fp16(rng, (300, 128), 0.2))
    gone = _read_only(np.zeros((1, 1), np.float16))
    stale_ref = weakref.ref(gone)
    del gone  # a dead reference, as the freed table's would be
    stale = np.full((128, 500), np.nan, np.float32)
    be._tables[id(table)] = (stale_ref, stale)
    be.repacked_bytes = stale.nbytes  # what the stale copy still holds of the budget
    out = _logits(be, x, table)
    assert_close("lm_head", out, ref_ops.ref_lm_head(x, table), ref_ops.ref_lm_head(x, table, dtype=F32), backend="numpy",
                 case="a stale entry under the table's id")
    assert be.repacked_bytes == table.size * 4, "the stale copy's bytes were not returned, or the new ones not taken"


def test_lm_head_widens_per_call_a_table_that_can_change():
    rng = rng_for(3)
    be = NumpyBackend()
    x = fp16(rng, (1, 256))
    writable = fp16(rng, (4096, 256), 0.2)
    view = writable.view()
    view.flags.writeable = False  # read-only itself, but its memory is writable through `writable`
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear, "BLOCK_FLOATS", 256 * 1000)  # the per-call path in blocks of 1000 rows
        for table in (writable, view):
            for step in range(2):
                out = _logits(be, x, table)
                assert_close("lm_head", out, ref_ops.ref_lm_head(x, table), ref_ops.ref_lm_head(x, table, dtype=F32),
                             backend="numpy", case=f"per call, step {step}")
                writable[step::7] *= F16(-1.5)  # changed in place between calls
    assert be.repacked_bytes == 0


def test_a_tied_table_serves_embed_and_lm_head():
    rng = rng_for(5)
    be = NumpyBackend()
    table = _read_only(fp16(rng, (1000, 128)))
    ids = np.array([0, 999, 17, 17], np.int32)
    x = fp16(rng, (1, 128))
    for _ in range(2):  # embed before and after lm_head has widened the shared table
        rows = np.full((len(ids), 128), np.nan, F32)
        be.embed(ids, table, rows)
        assert_equal("embed", rows, ref_ops.ref_embed(ids, table), backend="numpy")
        out = _logits(be, x, table)
        assert_close("lm_head", out, ref_ops.ref_lm_head(x, table), ref_ops.ref_lm_head(x, table, dtype=F32), backend="numpy",
                     case="tied table")
    assert be.repacked_bytes == table.size * 4


# --- BLAS threads ---------------------------------------------------------------------------------


def test_blas_threads_sets_the_count_inside_and_restores_it():
    if not blas.available():
        pytest.skip("NumPy's BLAS is not an OpenBLAS whose thread count can be set")
    before = blas.current()
    with blas.blas_threads(1):
        assert blas.current() == 1
    assert blas.current() == before
    with blas.blas_threads(None):  # None leaves it alone
        assert blas.current() == before


def _numpy_blas() -> str:
    """The BLAS NumPy says it was built with ("scipy-openblas" for the wheels), or "" where it does not say."""
    try:
        return str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]).lower()
    except Exception:  # noqa: BLE001 - an older NumPy without the dicts mode, or another layout
        return ""


def test_blas_threads_finds_the_openblas_numpy_was_built_with():
    """Where NumPy's own build says its BLAS is an OpenBLAS, `blas_threads` must find it: a lookup that
    fails is silent (every matmul would run on all of OpenBLAS's busy-waiting threads, 50x slower on a
    loaded machine), and the case above would skip instead of failing."""
    name = _numpy_blas()
    if "openblas" not in name:
        pytest.skip(f"NumPy's BLAS is {name or 'not named by its build'}, not an OpenBLAS")
    assert blas.available(), f"NumPy was built with {name}, but kernels/numpy/blas.py found no OpenBLAS to set"
    with blas.blas_threads(1):
        assert blas.current() == 1


def test_the_backend_runs_its_matmuls_on_its_own_thread_count(monkeypatch):
    """`NumpyBackend(threads=N)` runs its matmuls on N BLAS threads, and without N on its share of the
    machine (`default_threads`): a backend that lost the count would run on whatever the process had."""
    import kernels.numpy as numpy_backend

    seen = []
    real = numpy_backend.blas_threads
    monkeypatch.setattr(numpy_backend, "blas_threads", lambda n: (seen.append(n), real(n))[1])
    assert NumpyBackend().threads == blas.default_threads()
    backend = NumpyBackend(threads=1)
    assert backend.threads == 1
    out = np.empty(8, np.float32)
    backend.lm_head(np.ones((1, 16), np.float16), np.ones((8, 16), np.float16), out)
    assert seen == [1] and np.all(out == 16)


@pytest.mark.parametrize("cpus,workers,env,expected", [
    (8, None, None, 8),  # all the CPUs this process may run on
    (8, "3", None, 2),  # a pytest-xdist worker's whole share
    (2, "4", None, 1),  # never below one
    (8, "0", None, 8),  # a worker count of 0 counts as one, never a division by zero
    (8, "", None, 8),  # so does an empty one (the variable set, with nothing in it)
    (8, "3", "5", 5),  # NANOQWEN_NUMPY_THREADS wins
    (8, None, "0", 1),  # ... but never below one
    (8, None, "1", 1),
])
def test_the_default_thread_count_is_a_whole_share_of_the_cpus(monkeypatch, cpus, workers, env, expected):
    """OpenBLAS's thread count is a C int: a float share (4 / 3 workers) would stop the first GEMM that sets
    it. Read from this process's CPU affinity (a container or `taskset` narrows it), not the machine's."""
    asked = []
    monkeypatch.setattr(blas.os, "sched_getaffinity", lambda pid: asked.append(pid) or set(range(cpus)), raising=False)
    for var, value in (("PYTEST_XDIST_WORKER_COUNT", workers), ("NANOQWEN_NUMPY_THREADS", env)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    threads = blas.default_threads()
    assert threads == expected and type(threads) is int
    assert asked in ([0], []), f"the affinity asked of process {asked}, not of this one (0)"


@pytest.mark.parametrize("count,expected", [(6, 6), (None, 1)])
def test_without_an_affinity_call_the_share_is_of_the_cpu_count(monkeypatch, count, expected):
    """Where the OS has no sched_getaffinity (macOS), the share is of os.cpu_count(), and of one CPU where
    that count is unknown (None)."""
    monkeypatch.delattr(blas.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(blas.os, "cpu_count", lambda: count)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.delenv("NANOQWEN_NUMPY_THREADS", raising=False)
    assert blas.default_threads() == expected
