"""The launch map: which kernel code each case of the ladder runs.

A *unit* is the smallest piece of kernel code a run can tell apart:

- numpy: a function of kernels/numpy, `kernels/numpy/attention.py::paged_attention` (the file and
  the name of the code object that ran; a nested function counts under its own name);
- cuda: an entry point, `kernels/cuda::int4_gemv_bias_f16_t128_r8` (`extern "C" __global__`; names
  are global across the modules, kernels/cuda/loader.py);
- a source file a case reads as text (`@pytest.mark.reads_source("kernels/cuda/*.cu")`: a check of what
  the text says, such as an entry point's template arguments against its name), `kernels/cuda/rope.cu::<source>`:
  every mutant of the file and every change to it runs the case.

While a rung runs with recording on (`--record-launches`), every case gets the units launched in its
setup, call and teardown, those launched while any fixture it uses was set up (a model built during one
case and used by the next counts for both), and those launched outside every case before it (the
import-time code of a module imported while collecting). The rung's JSON holds the map (node id, without
pytest-xdist's `@group` suffix, -> units, in collection order); `nanoqwen ladder` keeps it per backend
and model in the cache, `launch-maps/`.

Two commands read it. `nanoqwen mutate` runs, for each mutant, only the cases that launch the mutated
function; `nanoqwen ladder --changed REV` runs only the cases that launch a function changed since REV
(`git diff`). `patterns_for(file, function)` turns a function into the units that run it: a numpy
function is its own unit; a CUDA function is every entry point that reaches it (the call graph of
ladder/changes/sources.py over each module's source as NVRTC gets it, headers inlined); a change outside any
function (module-level code, a macro, a launcher in Python) widens to the whole backend. The reading
errs wide, never narrow: a case it adds costs time, a case it dropped would let a bug through.

Recording costs: a CUDA launch reports itself through one Python wrapper (kernels/cuda/loader.py). NumPy
functions are seen through `sys.monitoring` on Python 3.12+ (each code object reports once per case,
then is silenced until the next case: near zero cost); before 3.12 through `sys.setprofile`, which slows
the NumPy unit rung by about half. So `nanoqwen ladder` records a map on every run where that is free
(CUDA only, or Python 3.12+), and elsewhere only when asked or when `--changed` finds none.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the project's packages
NUMPY_DIR = "kernels/numpy"
CUDA_DIR = "kernels/cuda"
EVERYTHING = "*"  # the pattern every unit matches


# --- recording -----------------------------------------------------------------------------------------

_SINK: set[str] = set()
_STOP: list = []  # how to undo what start() did


def recording_is_free() -> bool:
    """Whether recording NumPy launches costs next to nothing here (sys.monitoring, Python 3.12+)."""
    return hasattr(sys, "monitoring")


def start(numpy: bool = True) -> None:
    """Record CUDA entry-point launches, and with `numpy` the kernels/numpy functions that run."""
    from kernels.base import observe_launches

    observe_launches(_SINK)  # device backends report each kernel launch (kernels/cuda/loader.py)
    _STOP.append(lambda: observe_launches(None))
    if numpy:
        _start_numpy()


def stop() -> None:
    while _STOP:
        _STOP.pop()()
    _SINK.clear()


def drain() -> set[str]:
    """The units launched since the last drain; NumPy functions report again from here on."""
    out = set(_SINK)
    _SINK.clear()
    if hasattr(sys, "monitoring") and _STOP:
        sys.monitoring.restart_events()
    return out


def _numpy_prefix() -> str:
    import kernels

    return str(Path(kernels.__file__).resolve().parent / "numpy") + "/"


def _start_numpy() -> None:
    prefix = _numpy_prefix()
    units: dict = {}  # code object -> unit, so a code object's unit is built once

    def unit(code) -> str:
        u = units.get(code)
        if u is None:
            u = units[code] = f"{NUMPY_DIR}/{code.co_filename[len(prefix):]}::{code.co_name}"
        return u

    if hasattr(sys, "monitoring"):
        mon = sys.monitoring
        tool = next(t for t in (4, 3, 5) if mon.get_tool(t) is None)
        mon.use_tool_id(tool, "nanoqwen launch map")

        def on_start(code, offset):
            if code.co_filename.startswith(prefix):
                _SINK.add(unit(code))
            return mon.DISABLE  # once per case: drain() turns it back on

        mon.register_callback(tool, mon.events.PY_START, on_start)
        mon.set_events(tool, mon.events.PY_START)

        def undo():
            mon.set_events(tool, 0)
            mon.register_callback(tool, mon.events.PY_START, None)
            mon.free_tool_id(tool)

        _STOP.append(undo)
        return
    import threading

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            _SINK.add(unit(frame.f_code))

    sys.setprofile(profile)
    threading.setprofile(profile)
    _STOP.append(lambda: (sys.setprofile(None), threading.setprofile(None)))


class CaseLaunches:
    """The pytest plugin that hands each case its units (registered by ladder/plugin/__init__.py when recording)."""

    def __init__(self):
        self.by_fixture: dict[str, set[str]] = defaultdict(set)
        self.stack: list[set[str]] = [set()]  # the case, then each fixture being set up inside it
        self.ambient: set[str] = set()  # launched outside every case: at collection (a module's import-time code)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        self.ambient |= drain()  # everything imported while collecting ran then: it counts for every case
        self.stack = [set(self.ambient)]
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        self.stack[-1] |= drain()
        self.stack.append(set())
        try:
            yield
        finally:
            mine = self.stack.pop() | drain()
            self.by_fixture[fixturedef.argname] |= mine
            self.stack[-1] |= mine  # a fixture that needs this one launched it too

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        yield
        units = self.stack[0] | drain() | read_sources(item)
        for name in getattr(item, "fixturenames", ()):
            units |= self.by_fixture.get(name, set())
        item.user_properties.append(("nanoqwen_launches", sorted(units)))  # the teardown report carries it


# --- reading the map ----------------------------------------------------------------------------------


def matches(units, patterns) -> bool:
    """Whether any unit is one of `patterns` (a pattern ending in `*` matches every unit it begins)."""
    for p in patterns:
        if p.endswith("*"):
            if any(u.startswith(p[:-1]) for u in units):
                return True
        elif p in units:
            return True
    return False


def select(case_map: dict[str, list[str]], patterns) -> list[str]:
    """The node ids of `case_map` whose units match, in the map's order."""
    return [n for n, units in case_map.items() if matches(units, patterns)]


def write_selection(path: Path, patterns, case_map: dict[str, list[str]]) -> None:
    """The file `--launching` reads: the patterns and the map they are read against."""
    path.write_text(json.dumps({"patterns": sorted(patterns), "map": case_map}))


def read_selection(path: str) -> tuple[list[str], dict[str, list[str]]]:
    try:
        data = json.loads(Path(path).read_text())
        return list(data["patterns"]), dict(data["map"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise pytest.UsageError(f"--launching {path}: not a selection file ({e})") from None


def split(items, patterns, case_map) -> tuple[list, list]:
    """(kept, dropped): a case is kept when the map does not know it or when it launches a unit of `patterns`."""
    kept, dropped = [], []
    for item in items:
        units = case_map.get(item.nodeid)
        (kept if units is None or matches(units, patterns) else dropped).append(item)
    return kept, dropped


def patterns_for(rel: str, function: str, root: Path = ROOT) -> list[str]:
    """The units that run `function` of kernel source `rel` (relative to `root`), and the unit of the cases
    that read `rel` as text (`source_unit`); [] where none does."""
    if rel.startswith(NUMPY_DIR + "/") and rel.endswith(".py"):
        return [f"{NUMPY_DIR}/*"] if function == "<module>" else [f"{rel}::{function}", source_unit(rel)]
    if rel.startswith(CUDA_DIR + "/") and rel.endswith((".cu", ".cuh")):
        entries = sorted(cuda_entries_reaching(Path(rel).name, function, root / CUDA_DIR))
        return [f"{CUDA_DIR}::{e}" for e in entries] + [source_unit(rel)]
    if rel.startswith(CUDA_DIR + "/"):
        return [f"{CUDA_DIR}::*", source_unit(rel)]  # a launcher in Python: anything of the backend may go through it
    return [EVERYTHING]


def source_unit(rel: str) -> str:
    """The unit of a case marked `reads_source(GLOB...)` for each kernel file its globs name: it launches
    nothing of the file, it reads its text (an entry point's template arguments against its name), so a
    mutant or a change anywhere in the file must run it."""
    return f"{rel}::<source>"


def is_source_unit(unit: str) -> bool:
    return unit.endswith("::<source>")


def read_sources(item, root: Path = ROOT) -> set[str]:
    """The source units of a case's `reads_source` marks (globs relative to the project root)."""
    units = set()
    for mark in item.iter_markers("reads_source"):
        for pattern in mark.args:
            units.update(source_unit(p.relative_to(root).as_posix()) for p in root.glob(pattern) if p.is_file())
    return units


def cuda_entries_reaching(filename: str, function: str, folder: Path) -> set[str]:
    """Entry points whose call graph reaches `function` of `filename`, over every module that holds it.

    A module holds a header when the loader inlines it. A function a macro names, or code outside any
    function ("<file>"), widens to every entry point of the modules that hold the file."""
    found = set()
    modules = _cuda_modules(str(folder), _stamp(folder))
    for module in cuda_modules_holding(filename, folder):
        _, entries, calls, macros = modules[module]
        if function == "<file>" or function in macros:
            found.update(entries)
            continue
        for entry in entries:
            seen, todo = {entry}, [entry]
            while todo:
                for name in calls.get(todo.pop(), ()):
                    if name in calls and name not in seen:
                        seen.add(name)
                        todo.append(name)
            if function in seen:
                found.add(entry)
    return found


def cuda_modules_holding(filename: str, folder: Path) -> list[str]:
    """The modules of `folder` (a kernels/cuda) whose source, as NVRTC gets it, holds `filename`: a `.cu` its
    own module, a header every module the loader inlines it into."""
    return [module for module, (text, *_) in _cuda_modules(str(folder), _stamp(folder)).items()
            if filename == f"{module}.cu" or f"---- {filename} (inlined" in text]


def _stamp(folder: Path) -> tuple:
    return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in folder.glob("*.cu*")))


@functools.lru_cache(maxsize=8)
def _cuda_modules(folder: str, stamp: tuple) -> dict:
    """module -> (its source as NVRTC gets it, its entry points, its call graph, the names its macros use);
    read once per state of the folder (`stamp`)."""
    from ladder.changes.sources import cuda_calls, cuda_macro_names, cuda_module

    loader = cuda_module("loader", Path(folder))
    out = {}
    for module in loader.MODULES:
        text = loader.source(module)
        out[module] = (text, loader.entry_points(module), cuda_calls(text), cuda_macro_names(text))
    return out


# --- what changed since a revision --------------------------------------------------------------------

# Paths a change to which cannot change what a rung checks (`--changed` looks past them).
NOT_CHECKED = ("docs/", "bench/", ".ci/", ".github/")


class ChangeError(Exception):
    """`git` could not say what changed (no checkout, an unknown revision)."""


def changed_patterns(rev: str, root: Path = ROOT) -> tuple[list[str] | None, list[str]]:
    """(patterns, what changed) for the working tree against `rev`. patterns is None when a change lies
    outside the kernels (engine/, reference/, a test...): no case can be left out then."""
    names = _git(root, "diff", "--name-only", rev, "--", ".").split()
    names += _git(root, "ls-files", "--others", "--exclude-standard").split()
    patterns: set[str] = set()
    described = []
    for rel in sorted(set(names)):
        if rel.startswith(NOT_CHECKED) or rel.endswith(".md"):
            continue
        if "__pycache__/" in rel or rel.endswith((".pyc", ".pyo")):  # bytecode a run left, in a tree that
            continue  # does not ignore it: never a change of its own (its source's diff says what changed)
        if not rel.startswith("kernels/"):
            return None, [rel]
        path = root / rel
        if not path.exists():  # removed: whatever launched it changes
            return None, [f"{rel} (removed)"]
        lines = _changed_lines(root, rev, rel)
        text = path.read_text()
        if rel.endswith(".py") and rel.startswith(NUMPY_DIR + "/"):
            from ladder.changes.sources import python_functions_on_lines

            functions = python_functions_on_lines(text, lines) if lines is not None else {"<module>"}
        elif rel.endswith((".cu", ".cuh")):
            from ladder.changes.sources import cuda_functions_on_lines

            functions = cuda_functions_on_lines(text, lines) if lines is not None else {"<file>"}
        else:
            functions = {"<module>"}
        for fn in sorted(functions):
            patterns.update(patterns_for(rel, fn, root))
            described.append(f"{rel}::{fn}")
    return sorted(patterns), described


def _changed_lines(root: Path, rev: str, rel: str) -> set[int] | None:
    """Lines of the working tree's `rel` that differ from `rev` (None: the file is new)."""
    if not _git(root, "ls-files", "--", rel).strip() or not _git(root, "cat-file", "-t", f"{rev}:{rel}", check=False).strip():
        return None
    lines = set()
    for hunk in _git(root, "diff", "--unified=0", rev, "--", rel).splitlines():
        if hunk.startswith("@@"):
            new = hunk.split()[2]  # +start[,count]
            start, _, count = new[1:].partition(",")
            start, count = int(start), int(count or 1)
            # a pure deletion (count 0) sits between two lines: both are where the code changed
            lines.update(range(start, start + count) if count else (start, start + 1))
    return lines


def _git(root: Path, *args, check=True) -> str:
    from ladder.changes import git

    return git.run(root, *args, check=check, error=ChangeError).stdout


# --- the kept map --------------------------------------------------------------------------------------


def map_file(backend: str, run: str) -> Path:
    """The kept launch map of one backend (or "all") and one kind of run: `run` names what else decides
    the cases (nanoqwen ladder gives its --model, --prompts and --quant)."""
    import hashlib

    from engine.resolve import cache_root

    key = hashlib.sha256(run.encode()).hexdigest()[:12]
    return cache_root() / "launch-maps" / f"{backend}-{key}.json"


def load_map(path: Path) -> dict[str, list[str]] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def keep_map(path: Path, cases: dict[str, list[str]]) -> None:
    """Merge `cases` into the map at `path` (a case run again replaces its entry), written atomically."""
    import os
    import tempfile

    merged = {**(load_map(path) or {}), **cases}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
