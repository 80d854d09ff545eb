"""The pytest plugin of the ladder: rung markers, backend selection, faults, golden files, the summary.

Loaded by the repository's root conftest.py, or with `-p ladder.plugin` from an installed package.

- Tests under `ladder/unit`, `ladder/layer`, `ladder/graph` carry the marker of their rung; those under
  `ladder/selftest` (the tests of the ladder's own commands and judges, which `nanoqwen ladder` does not
  run) carry `selftest`.
- `--backend numpy|cuda|all` picks the engines under test (default: both, so the cuda cases run where
  a GPU and CuPy are present and show as skipped, with the reason, elsewhere); a test takes the
  `backend` fixture and runs once per backend. A backend that cannot run here is a skip with its reason,
  unless `--require-backend NAME` (or NANOQWEN_REQUIRE_GPU=1, for every backend that needs an
  accelerator: cuda) turns that skip into a failure; a required backend that cannot run on this machine
  at all refuses the run before collection (one line, exit status 2: ladder/plugin/required.py). Tests on such
  a backend also carry the `gpu` marker.
  Backends come from the registry of kernels/ (`backend_names`, `backend_available`,
  `backend_needs_device`); nothing here tests a backend's name.
- `--quant FORMAT|all` picks the quantization formats the `quant_format` fixture runs over, and the
  formats the model-bound tests (`model_path`) run in: the default model or a Hugging Face folder
  converted to each, a `.nanoqwen` file in its own. A backend without a format's kernels fails those
  tests, counted as UNSUPPORTED in the summary and the JSON.
- `--plant-fault NAME[@LAYER][:FORMAT]` wraps one op of every Backend object with a fault from ladder/checks/faults.py.
- `--update-golden` regenerates the golden activations (once per format, before the tests, on the controller).
- Hypothesis profiles `ci` (the default: quick, derandomized) and `nightly` (thorough), chosen with
  Hypothesis' own `--hypothesis-profile`.
- At the end, a table per rung (run, passed, failed, skipped with reasons) and each op's worst error
  as a multiple of its noise floor; `--ladder-json FILE` writes the same data, with the op calls each
  rung made (the coverage listing), for `nanoqwen ladder`. That summary, its progress lines and the
  graph rung's near-tie flip rule live in ladder/plugin/summary.py, whose hooks this module re-exports.

This module holds the options, the selection of backends and formats, the markers, the fixtures and
the hooks around each test (op calls, error records, unsupported formats).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kernels import backend_available, backend_class, backend_names, backend_needs_device, get_backend
from ladder.plugin import groups, required
# The summary's hooks are this plugin's: pytest registers the hooks a plugin module holds, these included.
from ladder.plugin.summary import (ROWS, attach, is_worker, pytest_collection_finish,  # noqa: F401
                            pytest_runtest_logreport, pytest_sessionfinish, pytest_terminal_summary,
                            pytest_xdist_node_collection_finished)

settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("nightly", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_LADDER_DIR = Path(__file__).resolve().parents[1]  # ladder/: the rungs' folders
# The markers live here, not in a configuration file, so that the installed package (no pyproject.toml
# beside it) and `nanoqwen ladder` started from any folder know them under --strict-markers.
MARKERS = {
    "unit": "each kernel against the float64 NumPy reference (Hypothesis-drawn shapes)",
    "layer": "one decoder block against transformers' Qwen2DecoderLayer and golden activations",
    "graph": "greedy tokens of the whole model against the HF simulation",
    "selftest": "the ladder's own commands and judges, not the engine (ladder/selftest/; not a rung of nanoqwen ladder)",
    "gpu": "needs a CUDA GPU (skipped with a reason elsewhere)",
    "same_worker": "same_worker(*params): the cases of this test that share these parameters run on one "
                   "pytest-xdist worker, one after the other (they share something costly to build)",
    "reads_source": "reads_source(*globs): the case reads these kernel sources as text and launches nothing of "
                    "them; `nanoqwen mutate` and `--changed` run it for a mutant of, or a change to, any of them",
    "long": "a case of ten seconds or more on the machine it is meant for: collected first, so that a worker "
            "starts it while the others share the short cases, instead of it ending its rung alone",
}


def pytest_addoption(parser):
    g = parser.getgroup("nanoqwen", "nanoqwen ladder")
    g.addoption("--backend", default=None, choices=[*backend_names(), "all"],
                help="engine backend under test (default: every registered one; one that cannot run here skips with its reason)")
    g.addoption("--require-backend", action="append", default=[], choices=list(backend_names()),
                help="fail, instead of skipping, when this backend cannot run here; where it cannot run at all, "
                     "the run stops before collection, one line, exit 2 (repeatable)")
    g.addoption("--quant", default="all", help="quantization format under test, or 'all' (default)")
    g.addoption("--model", default=None, metavar="FILE|HF_DIR",
                help="model under test for the layer and graph rungs: a .nanoqwen file or a Hugging Face "
                     "folder (converted once, cached); default: the embedded default model")
    g.addoption("--prompts", default=None, metavar="FILE",
                help="graph-rung prompts, JSON lines with 'id' and 'ids' (token ids) or 'text'; "
                     "default: the fixture prompt file of the default model")
    g.addoption("--plant-fault", default=None, metavar="NAME[@LAYER][:FORMAT]",
                help="wrap one backend op with a planted fault from ladder/checks/faults.py (the ladder must go red)")
    g.addoption("--update-golden", action="store_true",
                help="regenerate the golden activations of the model under test before running")
    g.addoption("--ladder-json", default=None, metavar="FILE",
                help="write the run's per-rung counts, op error multiples and op calls as JSON")
    g.addoption("--new-tokens", default=None, type=_positive_int, metavar="N",
                help="graph rung: tokens generated per prompt (default: past the next page boundary, 8 to 24)")
    g.addoption("--skip-determinism", action="store_true",
                help="graph rung: skip the three-run determinism test (slow machines)")
    g.addoption("--shard", default=None, metavar="I/N",
                help="run shard I of N of the collected tests (a stable hash of each node id: ladder/plugin/sharding.py)")
    g.addoption("--record-launches", action="store_true",
                help="record the kernel code each case launches (the launch map, ladder/changes/launches.py)")
    g.addoption("--launching", default=None, metavar="FILE",
                help="run only the cases that launch the kernel code FILE names (a case the map does not know "
                     "runs too); written by nanoqwen ladder --changed and nanoqwen mutate")


def _positive_int(text: str) -> int:
    """--new-tokens: an integer >= 1 (pytest reports an ArgumentTypeError as a usage error)."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--new-tokens must be an integer >= 1, got {text!r}")
    return n


# --- selection -----------------------------------------------------------------------------------


def selected_backends(config) -> list[str]:
    choice = config.getoption("--backend")
    if choice and choice != "all":
        return [choice]
    # All registered: a backend's cases run where it can and skip, with the reason, elsewhere.
    return list(backend_names())


def required_backends(config) -> set[str]:
    """The backends this run requires: --require-backend, and NANOQWEN_REQUIRE_GPU=1 (ladder/plugin/required.py)."""
    return set(required.required_backends(config.getoption("--require-backend") or []))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A required backend that cannot run on this machine refuses the run here, in the controller, before
    pytest_configure: nothing is collected and no pytest-xdist worker starts (ladder/plugin/required.py). One
    line on stderr, `nanoqwen: error: ...`, and exit status 2 (pytest's own would be 4, a usage error,
    or 2 with an `Exit:` banner and a `!!!` line)."""
    if is_worker(config) or config.option.help or config.option.version:
        return None
    why = required.refusal(required.required_backends(config.getoption("--require-backend") or []),
                           selected_backends(config))
    if why is None:
        return None
    sys.stdout.flush()
    print(f"nanoqwen: error: {why}", file=sys.stderr, flush=True)
    return 2


def selected_formats(config) -> list[str]:
    from engine.formats import FORMATS

    choice = config.getoption("--quant")
    if choice == "all":
        return sorted(FORMATS)
    if choice not in FORMATS:
        raise pytest.UsageError(f"--quant {choice}: unknown format; known: {', '.join(sorted(FORMATS))}")
    return [choice]


def model_formats(config) -> list[str]:
    """The formats the model-bound tests (layer, graph, the engine's) run in: every selected one for the
    default model or a Hugging Face folder (converted once per format); a .nanoqwen file's own (its
    header read once per session, not once per test function)."""
    names = selected_formats(config)
    spec = config.getoption("--model")
    if spec is None or Path(spec).is_dir():
        return names
    if not hasattr(config, "_nanoqwen_model_quant"):
        from engine.errors import NanoqwenError
        from engine.modelfile import ModelFile

        try:
            with ModelFile(spec, verify_checksums=False) as mf:
                config._nanoqwen_model_quant = mf.quant
        except (NanoqwenError, OSError) as e:
            raise pytest.UsageError(f"--model {spec}: {e}") from None
    quant = config._nanoqwen_model_quant
    if config.getoption("--quant") not in ("all", quant):
        raise pytest.UsageError(f"--model {spec} is quantized as {quant}; to test it as "
                                f"{config.getoption('--quant')}, give its Hugging Face folder")
    return [quant]


def pytest_configure(config):
    from ladder.checks.harness import honour_pool_variable

    honour_pool_variable()  # NANOQWEN_CUPY_POOL=0: no CuPy pool, for a run under compute-sanitizer memcheck
    # A `nanoqwen ladder` that a test starts (it inherits this environment) runs its rungs, and keeps nothing
    # in the user's cache (ladder/run/kept.py); a test of the kept results turns them on for its own run.
    os.environ["NANOQWEN_KEPT_RESULTS"] = "off"
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    # A complex value silently cast to real would hide a kernel bug: make it an error in every run.
    config.addinivalue_line("filterwarnings", "error::numpy.exceptions.ComplexWarning")
    for b in required_backends(config):
        if b not in selected_backends(config):
            raise pytest.UsageError(f"--require-backend {b} but --backend selects {selected_backends(config)}")
    spec = config.getoption("--plant-fault")
    if spec:
        from ladder.checks.faults import parse

        try:
            parse(spec)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    selected_formats(config)
    attach(config)
    config.pluginmanager.register(groups, "nanoqwen-groups")  # the scheduler of --dist loadgroup
    if config.getoption("--record-launches"):
        from ladder.changes.launches import CaseLaunches, recording_is_free, start

        # NumPy functions are watched only where a backend runs them on the host (before Python 3.12
        # watching costs every Python call, which a CUDA-only run need not pay)
        start(numpy=recording_is_free() or not all(backend_needs_device(b) for b in selected_backends(config)))
        config.pluginmanager.register(CaseLaunches(), "nanoqwen-launches")
    if not is_worker(config):
        _share_cores(config)
        _warm_up_backends(config)


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _share_cores(config) -> None:
    """With N pytest-xdist workers, each worker's BLAS (the float64 references) gets cores / N threads,
    set here in the controller before the workers start (they inherit its environment): 16 workers each
    running 16 BLAS threads on 16 cores spent most of a GPU nightly's unit rung switching threads. A value
    the user set is kept."""
    workers = getattr(config.option, "numprocesses", None)
    if isinstance(workers, int) and workers > 1:
        per = str(max(1, (os.cpu_count() or 1) // workers))
        for var in THREAD_VARIABLES:
            os.environ.setdefault(var, per)


def _warm_up_backends(config) -> None:
    """Once-per-machine costs (CUDA: the NVRTC compile of every module) paid here, in the controller,
    before any pytest-xdist worker starts; the workers then share the result (kernels/base.py warm_up)."""
    for name in selected_backends(config):
        if backend_needs_device(name) and backend_available(name)[0]:
            try:
                backend_class(name).warm_up()
            except Exception as e:  # the tests will fail with the whole story; say it once here
                config.get_terminal_writer().line(f"nanoqwen: warming up backend {name} failed: {e}", red=True)


def pytest_sessionstart(session):
    config = session.config
    if config.getoption("--update-golden") and not is_worker(config):
        from fixtures.golden import write_golden
        from engine.resolve import resolve_model

        for quant in model_formats(config):
            path = resolve_model(config.getoption("--model"), quant)
            folder = write_golden(path)
            config.get_terminal_writer().line(f"nanoqwen: golden activations of {quant} written to {folder}")


def pytest_report_header(config):
    lines = [f"nanoqwen: backends {selected_backends(config)}, formats {selected_formats(config)}"]
    if config.getoption("--plant-fault"):
        lines.append(f"nanoqwen: PLANTED FAULT {config.getoption('--plant-fault')} (this run must fail)")
    return lines


def pytest_generate_tests(metafunc):
    if "backend_name" in metafunc.fixturenames:
        names = selected_backends(metafunc.config)
        metafunc.parametrize("backend_name", names, ids=names, scope="session")
    if "quant_name" in metafunc.fixturenames:
        model_bound = "model_path" in metafunc.fixturenames
        names = model_formats(metafunc.config) if model_bound else selected_formats(metafunc.config)
        metafunc.parametrize("quant_name", names, ids=names, scope="session")


def _rung_of(item) -> str | None:
    """The marker of the folder of ladder/ the test lives in: its rung, or `selftest`."""
    try:
        rel = Path(str(item.fspath)).resolve().relative_to(_LADDER_DIR)
    except ValueError:
        return None
    return rel.parts[0] if rel.parts and rel.parts[0] in ROWS else None


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection, which reads the rung markers added here
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec:  # every worker (and a run without workers) keeps the same shard: a hash of the node id
        from ladder.plugin.sharding import ShardError, parse_shard, select

        try:
            index, count = parse_shard(spec)
        except ShardError as e:
            raise pytest.UsageError(str(e)) from None
        kept, dropped = select(items, index, count)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if config.getoption("--launching"):
        from ladder.changes.launches import read_selection, split

        kept, dropped = split(items, *read_selection(config.getoption("--launching")))
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    # The long cases first (a stable sort: the others keep their order). pytest-xdist hands out the cases in
    # collection order, so each long one starts on a worker at the rung's start, and the rung's wall time
    # is its longest case or its share of the rest, whichever is more, not the two summed at its end.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    for item in items:
        rung = _rung_of(item)
        if rung:
            item.add_marker(getattr(pytest.mark, rung))
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("backend_name") if callspec is not None else None
        if name is not None and backend_needs_device(name):
            item.add_marker(pytest.mark.gpu)
    # With `--dist loadgroup` (nanoqwen ladder passes it) a large model's format's model-bound cases stay on
    # one worker, which builds its model and reference once; the unit rung's cases, and a small model's,
    # spread over every worker (ladder/plugin/groups.py).
    groups.write_groups(config, items)


# --- fixtures ------------------------------------------------------------------------------------

_BACKENDS: dict[str, object] = {}
_CALLS: Counter = Counter()  # op calls of the running test, moved onto its report


@pytest.fixture(scope="session")
def backend(request, backend_name):
    """The Backend object under test; skipped (or failed, if required) where it cannot run.

    Its ops are wrapped once to count calls (coverage) and, with --plant-fault, to plant the fault.
    """
    if backend_name not in _BACKENDS:
        ok, why = backend_available(backend_name)
        if not ok:
            msg = f"backend {backend_name} unavailable: {why}"
            if backend_name in required_backends(request.config):
                pytest.fail(msg + f" (required by --require-backend {backend_name} / NANOQWEN_REQUIRE_GPU=1)")
            pytest.skip(msg)
        options = _device_options(backend_name)
        be = get_backend(backend_name, **options)
        if "device" in options:
            _bind_torch(options["device"])
        spec = request.config.getoption("--plant-fault")
        if spec:
            from ladder.checks.faults import plant

            plant(be, spec)
        from ladder.plugin.instrument import record_calls

        record_calls(be, _CALLS)
        _BACKENDS[backend_name] = be
    return _BACKENDS[backend_name]


def _device_options(backend_name: str) -> dict:
    """With pytest-xdist, worker gwN asks the backend for its options (cuda: GPU N modulo the GPU count)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return {}
    return backend_class(backend_name).worker_options(int(worker[2:]))


def _bind_torch(device: int) -> None:
    """torch's current CUDA device follows the backend's, so a reference or helper that puts a tensor on
    "cuda" puts it on this worker's GPU, not on GPU 0 (torch is imported only where it is installed)."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available() and device < torch.cuda.device_count():
        torch.cuda.set_device(device)


def worker_device(backend_name: str) -> int | None:
    """The device this test process's backend was given (None: not a device backend, or no workers)."""
    return _device_options(backend_name).get("device") if backend_needs_device(backend_name) else None


@pytest.fixture(scope="session")
def quant_format(quant_name):
    """The quantization format under test (engine/formats), one per --quant selection."""
    from engine.formats import get_format

    return get_format(quant_name)


@pytest.fixture(scope="session")
def model_path(request, quant_name) -> Path:
    """The .nanoqwen file under test, in format `quant_name` (--model, else the embedded default model)."""
    from engine.resolve import resolve_model

    return resolve_model(request.config.getoption("--model"), quant_name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A format without a kernel on the backend under test fails its tests (never passes, never skips)
    and is counted as unsupported, by backend and format, in the summary and the ladder JSON.

    Every report of a case carries its backend and format (`nanoqwen_case`, added before the setup
    report is made): the summary names them beside a failure, and counts what ran, from the item's own
    parameters rather than from its node id's text."""
    from ladder.plugin.summary import case_params

    if call.when == "setup":
        item.user_properties.append(("nanoqwen_case", case_params(item)))
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed:
        from kernels.base import FormatNotSupportedError

        if call.excinfo.errisinstance(FormatNotSupportedError):
            params = case_params(item)
            backend = params["backend"] or "?"
            fmt = params["format"] or "?"
            item.user_properties.append(("nanoqwen_unsupported", {"backend": backend, "format": fmt}))  # the teardown report carries it
            report.longrepr = f"UNSUPPORTED: {call.excinfo.value} (a format without a kernel fails; docs/ADDING_A_FORMAT.md)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    from ladder.judges import compare
    from ladder.plugin.summary import case_params

    start = len(compare.RECORDS)
    _CALLS.clear()
    yield
    fmt = case_params(item)["format"]  # a check does not know its weights' format; its case does
    for rec in compare.RECORDS[start:]:
        item.user_properties.append(("nanoqwen_check", {**rec, "format": rec.get("format") or fmt}))
    del compare.RECORDS[start:]
    if _CALLS:
        backend = getattr(item, "callspec", None) and item.callspec.params.get("backend_name")
        item.user_properties.append(("nanoqwen_calls", {"backend": backend, "calls": dict(_CALLS)}))
    _CALLS.clear()
