"""Unit rung: the Backend interface of kernels/base.py, and a third backend added the way docs/BACKEND.md says.

Every registered backend class implements every op of `OPS` and every memory helper (read from its
source, so the CUDA class is checked on a machine without CuPy too). A counting backend, a `Backend`
subclass that wraps the NumPy one and counts its calls, is registered with one line and then runs the
engine end to end and the unit rung's op checks (ladder/checks/ops.py) on their explicit examples:
nothing outside kernels/ needs to know it exists. Last, a scan of engine/, ladder/, fixtures/ and bench/
for a comparison against a backend's name: code there asks a capability (`supports_graphs`,
`needs_device`) or the registry instead.
"""

from __future__ import annotations

import abc
import ast
import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import engine
import kernels
from engine.formats import get_format
from kernels import (BACKENDS, FUSED_OPS, HELPERS, OPS, Backend, backend_available, backend_class, backend_names,
                     backend_needs_device, get_backend, register_backend, unregister_backend)
from kernels.base import _REGISTRY
from kernels.numpy import NumpyBackend
from ladder.checks import ops
from ladder.checks.harness import quantized

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("engine", "ladder", "fixtures", "bench")


class CountingBackend(Backend):
    """The NumPy backend behind a counter: every op and helper call is counted, then forwarded."""

    name = "counting"
    formats = NumpyBackend.formats

    def __init__(self, **options):
        self.inner = NumpyBackend(**options)
        self.calls: Counter = Counter()


def _forward(method: str):
    def call(self, *args, **kwargs):
        self.calls[method] += 1
        return getattr(self.inner, method)(*args, **kwargs)

    call.__name__ = method
    return call


for _method in (*OPS, *HELPERS):
    setattr(CountingBackend, _method, _forward(_method))
abc.update_abstractmethods(CountingBackend)  # every abstract method now has its forwarder


@pytest.fixture
def counting():
    register_backend("counting", CountingBackend)  # the one line that adds a backend
    try:
        yield get_backend("counting")
    finally:
        unregister_backend("counting")


def _class_methods(name: str) -> set[str]:
    """The methods a registered backend's class defines or inherits within kernels/, from its source."""
    target = _REGISTRY[name].target
    module, _, cls_name = target.partition(":")
    source = Path(importlib.util.find_spec(module).origin).read_text()
    classes = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}
    cls = classes[cls_name]
    assert [ast.unparse(b) for b in cls.bases] == ["Backend"], f"{target} does not subclass kernels.base.Backend"
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_base_class_declares_every_op_and_helper_abstract():
    assert set(Backend.__abstractmethods__) == set(OPS) | set(HELPERS)
    assert "decode_advance" in OPS  # the graph loop's on-device token advance is an op like the others


@pytest.mark.parametrize("name", BACKENDS)
def test_every_registered_backend_implements_every_op_and_helper(name):
    missing = (set(OPS) | set(HELPERS)) - _class_methods(name)
    assert not missing, f"backend {name!r} does not implement {sorted(missing)}"
    ok, why = backend_available(name)
    if ok:  # importable here: the class is concrete too
        assert not backend_class(name).__abstractmethods__


def test_the_registry_answers_capabilities_without_importing_a_device_backend():
    assert backend_names()[:2] == ("numpy", "cuda")
    assert not backend_needs_device("numpy") and backend_needs_device("cuda")
    assert backend_available("numpy") == (True, "cpu")
    ok, why = backend_available("cuda")
    assert ok or why  # where it cannot run, a reason (and no exception)
    assert kernels.cuda_available() == (ok, why)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        get_backend("nope")
    np_backend = get_backend("numpy")
    assert isinstance(np_backend, Backend) and not np_backend.supports_graphs and np_backend.device_name == "cpu"


def test_a_registered_third_backend_runs_the_engine_end_to_end(counting):
    """The registry's end-to-end proof needs a model, any model: the default one, whatever --model names
    (a user's 7B-size model on the NumPy engine, twice, took three minutes of the unit rung)."""
    from fixtures.default_model import default_model_file

    model_path = default_model_file()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    reference = engine.load(model_path, backend="numpy").generate(prompt, 6)
    model = engine.load(model_path, backend="counting")
    assert model.backend is not counting and isinstance(model.backend, CountingBackend)
    assert model.generate(prompt, 6) == reference  # same kernels behind it: the same tokens
    calls = model.backend.calls
    layers = model.config.num_hidden_layers
    assert calls["attention_prefill"] == layers and calls["lm_head"] >= 6 and calls["argmax"] >= 6
    never = [op for op in OPS if op != "decode_advance" and not calls[op]]
    assert not never, f"the engine never called {never} on the counting backend"


@pytest.mark.parametrize("T", (1, 3))  # the decode step's GEMV path and a prefill's
@pytest.mark.parametrize("fused", sorted(FUSED_OPS))
def test_a_fused_op_calls_its_parts_where_one_is_wrapped(backend, fused, T):
    """A fused op (FUSED_OPS) a backend runs as one kernel must call its parts instead while one of them is
    replaced on the object (the ladder's op recorder, call counter, planted faults wrap the parts): each
    wrapper sees its call, and the norm is written."""
    fmt = get_format("int4_sym_g128")
    if fmt.name not in backend.formats:
        pytest.skip(f"backend {backend.name} has no {fmt.name} kernel")
    rng = np.random.default_rng(0)
    qw, _ = quantized(backend, fmt, rng.standard_normal((136, 256)).astype(np.float32) * 0.05)
    x = backend.asarray(rng.standard_normal((T, 256)).astype(np.float16))
    norm_w = backend.asarray(np.ones(136, np.float16))
    for wrapped in FUSED_OPS[fused]:
        seen = []
        had = vars(backend).get(wrapped)  # the rungs' own wrapper (the call counter), put back after
        inner = getattr(backend, wrapped)

        def spy(*args, _name=wrapped, _inner=inner):
            seen.append(_name)
            return _inner(*args)

        setattr(backend, wrapped, spy)
        try:
            resid = backend.asarray(np.zeros((T, 136), np.float32))
            out = backend.asarray(np.zeros((T, 136), np.float16))
            getattr(backend, fused)(x, qw, resid, norm_w, 1e-6, out)
            backend.synchronize()
        finally:
            if had is None:
                delattr(backend, wrapped)
            else:
                setattr(backend, wrapped, had)
        assert seen == [wrapped], f"{fused} with {wrapped} wrapped: the wrapper saw {seen}"
        assert (np.abs(backend.to_numpy(out)) > 0).all(), f"{fused} with {wrapped} wrapped left norm rows unwritten"
    assert not backend.parts_wrapped(fused)


@pytest.mark.parametrize("fused", sorted(FUSED_OPS))
def test_an_observing_wrapper_leaves_a_fused_op_fused_and_its_results_alone(backend, fused):
    """A wrapper marked `observes_only` (the ladder's call counter, on every op of the rungs' backend) does not
    make a backend call a fused op's parts (Backend.parts_wrapped), and changes no bit of its results:
    the rungs check the fused kernel itself. A prefill's 3 tokens: the CUDA backend's one kernel."""
    fmt = get_format("int4_sym_g128")
    if fmt.name not in backend.formats:
        pytest.skip(f"backend {backend.name} has no {fmt.name} kernel")
    rng = np.random.default_rng(1)
    qw, _ = quantized(backend, fmt, rng.standard_normal((136, 256)).astype(np.float32) * 0.05)
    x = backend.asarray(rng.standard_normal((3, 256)).astype(np.float16))
    norm_w = backend.asarray((1 + 0.1 * rng.standard_normal(136)).astype(np.float16))
    start = rng.standard_normal((3, 136)).astype(np.float32)

    def run():
        resid, out = backend.asarray(start.copy()), backend.asarray(np.zeros((3, 136), np.float16))
        getattr(backend, fused)(x, qw, resid, norm_w, 1e-6, out)
        return backend.to_numpy(resid).copy(), backend.to_numpy(out).copy()

    had = {part: vars(backend)[part] for part in FUSED_OPS[fused] if part in vars(backend)}
    plain = run()
    for part in FUSED_OPS[fused]:
        inner = getattr(backend, part)

        def observer(*args, _inner=inner):
            return _inner(*args)

        observer.observes_only = True
        setattr(backend, part, observer)
    try:
        assert not backend.parts_wrapped(fused)
        observed = run()
    finally:
        for part in FUSED_OPS[fused]:
            if part in had:
                setattr(backend, part, had[part])
            else:
                delattr(backend, part)
    for a, b in zip(plain, observed):
        assert a.tobytes() == b.tobytes(), f"{fused}: an observing wrapper changed its results"


def test_a_registered_third_backend_passes_unit_cases(counting):
    for check in (ops.check_argmax, ops.check_embed, ops.check_decode_advance):
        for args in check.examples:
            check(counting, **args)
    assert counting.calls["argmax"] and counting.calls["embed"] and counting.calls["decode_advance"]


def _name_comparisons(path: Path, root: Path = REPO) -> list[str]:
    """Comparisons of a backend-name literal with a backend, its name, or any `.name`."""
    found = []
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError:  # a file that does not parse fails its own tests; nothing to read here
        return found
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(isinstance(s, ast.Constant) and s.value in BACKENDS for s in sides):
            continue
        others = [s for s in sides if not isinstance(s, ast.Constant)]
        if any("backend" in ast.unparse(s) or (isinstance(s, ast.Attribute) and s.attr == "name") for s in others):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_kernels_compares_a_backend_name():
    found = [hit for pkg in SCANNED for path in sorted((REPO / pkg).rglob("*.py")) for hit in _name_comparisons(path)]
    assert not found, "ask a capability (supports_graphs, needs_device) or the registry instead:\n" + "\n".join(found)


def test_the_scan_sees_a_name_comparison(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('if model.backend.name == "cuda":\n    pass\nif backend_name != "numpy":\n    pass\n'
                 'if device.type == "cuda":\n    pass\nif be.name == "cuda":\n    pass\n')
    hits = _name_comparisons(f, root=tmp_path)
    assert [h.split(":")[1] for h in hits] == ["1", "3", "7"]

