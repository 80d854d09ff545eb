"""The pytest plugin of the ladder: rung markers, backend selection, Hypothesis profiles, the summary.

Loaded by the repository's root conftest.py, or with `-p ladder.plugin` from an installed package.

- Tests under `ladder/unit`, `ladder/layer`, `ladder/graph` carry the marker of their rung.
- `--backend numpy|cuda|all` picks the engines under test (default: numpy, plus cuda where a GPU and
  CuPy are present); a test takes the `backend` fixture and runs once per backend. A backend that cannot
  run here is a skip with its reason, unless `--require-backend NAME` (or NANOQWEN_REQUIRE_GPU=1 for
  cuda) turns that skip into a failure. Tests on `cuda` also carry the `gpu` marker.
- Hypothesis profiles `ci` (the default: quick, derandomized) and `nightly` (thorough), chosen with
  Hypothesis' own `--hypothesis-profile`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kernels import BACKENDS, cuda_available, get_backend

settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("nightly", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

RUNGS = ("unit", "layer", "graph")
_LADDER_DIR = Path(__file__).resolve().parent


def pytest_addoption(parser):
    g = parser.getgroup("nanoqwen", "nanoqwen ladder")
    g.addoption("--backend", default=None, choices=[*BACKENDS, "all"],
                help="engine backend under test (default: numpy, plus cuda when a GPU is present)")
    g.addoption("--require-backend", action="append", default=[], choices=list(BACKENDS),
                help="fail, instead of skipping, when this backend cannot run here (repeatable)")
    g.addoption("--model", default=None, metavar="FILE|HF_DIR",
                help="model under test for the layer and graph rungs: a .nanoqwen file or a Hugging Face "
                     "folder (converted once, cached); default: the embedded default model")
    g.addoption("--prompts", default=None, metavar="FILE",
                help="graph-rung prompts, JSON lines with 'id' and 'ids' (token ids) or 'text'; "
                     "default: the fixture prompt file of the default model")


def selected_backends(config) -> list[str]:
    choice = config.getoption("--backend")
    if choice == "all":
        return list(BACKENDS)
    if choice:
        return [choice]
    return ["numpy", "cuda"] if cuda_available()[0] else ["numpy"]


def required_backends(config) -> set[str]:
    req = set(config.getoption("--require-backend") or [])
    if os.environ.get("NANOQWEN_REQUIRE_GPU") == "1":
        req.add("cuda")
    return req


def pytest_configure(config):
    for b in required_backends(config):
        if b not in selected_backends(config):
            raise pytest.UsageError(f"--require-backend {b} but --backend selects {selected_backends(config)}")


def pytest_generate_tests(metafunc):
    if "backend_name" in metafunc.fixturenames:
        names = selected_backends(metafunc.config)
        metafunc.parametrize("backend_name", names, ids=names, scope="session")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        try:
            rel = path.relative_to(_LADDER_DIR)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] in RUNGS:
            item.add_marker(getattr(pytest.mark, rel.parts[0]))
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend_name") == "cuda":
            item.add_marker(pytest.mark.gpu)


_BACKENDS: dict[str, object] = {}


@pytest.fixture(scope="session")
def backend(request, backend_name):
    """The Backend object under test; skipped (or failed, if required) where it cannot run."""
    if backend_name not in _BACKENDS:
        if backend_name == "cuda":
            ok, why = cuda_available()
            if not ok:
                msg = f"backend cuda unavailable: {why}"
                if "cuda" in required_backends(request.config):
                    pytest.fail(msg + " (required by --require-backend cuda / NANOQWEN_REQUIRE_GPU=1)")
                pytest.skip(msg)
        _BACKENDS[backend_name] = get_backend(backend_name)
    return _BACKENDS[backend_name]


@pytest.fixture(scope="session")
def model_path(request, tmp_path_factory) -> Path:
    """The .nanoqwen file under test (--model, else the embedded default model)."""
    from ladder.models import resolve_model

    return resolve_model(request.config.getoption("--model"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    from ladder import compare

    start = len(compare.RECORDS)
    yield
    for rec in compare.RECORDS[start:]:
        item.user_properties.append(("nanoqwen_check", rec))
    del compare.RECORDS[start:]
