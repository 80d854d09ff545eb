"""Self-test: the launch map names the kernel code each case runs, and the readings of it err wide.

ladder/changes/launches.py must give each case the NumPy functions (or CUDA entry points) it launched, counting
a fixture's launches for every case that uses it and import-time code for every case; must turn a CUDA
function into every entry point whose call graph reaches it (through a template argument, a struct's
methods, a typedef); must turn a diff into the functions it touches, and a change outside the kernels
into "run everything"; `--launching` must keep the cases the map does not know. `nanoqwen ladder
--changed REV` is run the way a user runs it, in a git repository of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ladder.changes import launches
from ladder.run.nested import child_env, skip_inside_nested_run
from ladder.changes.sources import cuda_functions_on_lines, functions_of_tokens, cuda_tokens, python_functions_on_lines

REPO = Path(__file__).resolve().parents[2]
TREE = ("engine", "kernels", "ladder", "reference", "fixtures", "conftest.py", "pyproject.toml")


# --- recording ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, list[str]]:
    """The launch map of a small NumPy unit-rung run (rope and attention cases)."""
    out = tmp_path_factory.mktemp("launch-map") / "unit.json"
    r = subprocess.run([sys.executable, "-m", "pytest", str(REPO / "ladder" / "unit" / "test_ops.py"), "-m", "unit", "-q",
                        "-p", "ladder.plugin", "-c", "/dev/null", "--rootdir", str(REPO), "--confcutdir", str(REPO),
                        "-p", "no:cacheprovider", "-p", "no:xdist", "--backend", "numpy", "--record-launches",
                        "--ladder-json", str(out), "-k", "rope or attention_decode"],
                       cwd=REPO, capture_output=True, text=True, env=child_env("numpy"), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())["launches"]


@skip_inside_nested_run
def test_each_case_records_the_kernel_functions_it_launches(recorded):
    rope = [units for node, units in recorded.items() if "rope" in node]
    attention = [units for node, units in recorded.items() if "attention_decode" in node]
    assert rope and attention
    for units in rope:
        assert "kernels/numpy/__init__.py::rope_kv_write" in units
        assert "kernels/numpy/attention.py::paged_attention" not in units
    for units in attention:
        assert "kernels/numpy/attention.py::paged_attention" in units
        assert "kernels/numpy/__init__.py::rope_kv_write" not in units


@skip_inside_nested_run
def test_import_time_code_counts_for_every_case(recorded):
    # fp8's decode table is built when its module is imported (at collection): every case depends on it
    assert all("kernels/numpy/fp8_e4m3_channel.py::_decode_table" in units for units in recorded.values())


def _pytest_file(tmp_path: Path, body: str) -> dict:
    test = tmp_path / "test_fixture_launches.py"
    test.write_text(body)
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "pytest", str(test), "-q", "-p", "ladder.plugin", "-c", "/dev/null",
                        "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-p", "no:xdist", "--backend", "numpy",
                        "--record-launches", "--ladder-json", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, env=child_env("numpy"), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())["launches"]


@skip_inside_nested_run
def test_a_fixture_s_launches_count_for_every_case_that_uses_it(tmp_path):
    got = _pytest_file(tmp_path, '''
import numpy as np
import pytest

@pytest.fixture(scope="module")
def attended():  # set up during the first case, used by both
    from kernels.numpy.attention import paged_attention
    q = np.zeros((1, 2, 64), np.float16); kv = np.zeros((1, 1, 16, 64), np.float16)
    out = np.zeros((1, 128), np.float16)
    paged_attention(q, kv, kv, np.zeros(1, np.int32), np.zeros(1, np.int32), out)
    return out

@pytest.fixture(scope="module")
def needs_attended(attended):  # a fixture that needs the launching one launched it too
    return attended

def test_first(attended):
    assert attended.shape == (1, 128)

def test_second(needs_attended):
    assert needs_attended.shape == (1, 128)

def test_none():
    pass
''')
    unit = "kernels/numpy/attention.py::paged_attention"
    assert unit in got["test_fixture_launches.py::test_first"]
    assert unit in got["test_fixture_launches.py::test_second"]
    assert unit not in got["test_fixture_launches.py::test_none"]


@skip_inside_nested_run
def test_a_case_that_reads_a_kernel_source_is_run_for_every_mutant_of_it(tmp_path):
    # it launches nothing of rope.cu: only its mark ties it to the file
    got = _pytest_file(tmp_path, '''
import pytest

@pytest.mark.reads_source("kernels/cuda/rope.cu")
def test_reads():
    pass

def test_other():
    pass
''')
    assert got["test_fixture_launches.py::test_reads"] == ["kernels/cuda/rope.cu::<source>"]
    assert got["test_fixture_launches.py::test_other"] == []
    for function in ("rope_kv_write_f16", "<file>"):  # a mutant inside an entry point, and outside every function
        patterns = launches.patterns_for("kernels/cuda/rope.cu", function)
        assert launches.select(got, patterns) == ["test_fixture_launches.py::test_reads"], patterns
    assert launches.select(got, launches.patterns_for("kernels/cuda/rmsnorm.cu", "<file>")) == []


# --- reading the map ---------------------------------------------------------------------------------


def test_launching_keeps_the_matching_cases_and_those_the_map_does_not_know():
    items = [SimpleNamespace(nodeid=n) for n in ("a", "b", "c", "new")]
    case_map = {"a": ["kernels/numpy/x.py::f"], "b": ["kernels/numpy/x.py::g"], "c": []}
    kept, dropped = launches.split(items, ["kernels/numpy/x.py::f"], case_map)
    assert [i.nodeid for i in kept] == ["a", "new"] and [i.nodeid for i in dropped] == ["b", "c"]
    kept, _ = launches.split(items, ["kernels/numpy/*"], case_map)
    assert [i.nodeid for i in kept] == ["a", "b", "new"]
    assert launches.select(case_map, [launches.EVERYTHING]) == ["a", "b"]  # a case that launched nothing runs no kernel


def test_a_numpy_function_is_its_own_unit_and_module_code_widens_to_the_backend():
    assert launches.patterns_for("kernels/numpy/attention.py", "paged_attention") == [
        "kernels/numpy/attention.py::paged_attention", "kernels/numpy/attention.py::<source>"]
    assert launches.patterns_for("kernels/numpy/linear.py", "<module>") == ["kernels/numpy/*"]
    assert launches.patterns_for("kernels/cuda/linear.py", "anything") == ["kernels/cuda::*", "kernels/cuda/linear.py::<source>"]
    assert launches.patterns_for("kernels/base.py", "anything") == [launches.EVERYTHING]


CUDA_FILES = {
    "loader.py": (REPO / "kernels" / "cuda" / "loader.py").read_text(),
    "common.cuh": '''#pragma once
#define TWICE(x) twice(x)
__device__ __forceinline__ float twice(float v) { return 2.0f * v; }
__device__ __forceinline__ float dot(const float (&w)[4], float acc) { return acc + w[0]; }
''',
    "a.cu": '''#include "common.cuh"
template <class Bytes>
struct Decoder {
    __device__ static float decode(float v) { return Bytes::scale(v); }
};
struct Halves { __device__ static float scale(float v) { return v * 0.5f; } };
typedef Decoder<Halves> HalfDecoder;
template <class D> __device__ float body(float v) { return D::decode(v); }
extern "C" __global__ void __launch_bounds__(64) a_decode(float* y) { y[0] = body<HalfDecoder>(y[0]); }
extern "C" __global__ void a_dot(float* y) { float w[4] = {1, 2, 3, 4}; y[0] = dot(w, y[0]); }
struct alignas(16) Quad { float v[4]; };
extern "C" __global__ void a_quad(const __grid_constant__ Quad q, float* y) { y[0] = q.v[3]; }
''',
    "b.cu": '''#include "common.cuh"
extern "C" __global__ void b_twice(float* y) { y[0] = TWICE(y[0]); }
extern "C" __global__ void b_plain(float* y) { y[0] += 1.0f; }
''',
}


def test_a_cuda_function_maps_to_every_entry_point_that_reaches_it(tmp_path):
    for name, text in CUDA_FILES.items():
        (tmp_path / name).write_text(text)
    reach = lambda f, fn: launches.cuda_entries_reaching(f, fn, tmp_path)  # noqa: E731
    assert reach("a.cu", "a_decode") == {"a_decode"}
    # through a typedef, a template argument and a struct's static method
    assert reach("a.cu", "Halves") == {"a_decode"} and reach("a.cu", "Decoder") == {"a_decode"}
    # a parameter `const float (&w)[4]` does not rename the function
    assert reach("common.cuh", "dot") == {"a_dot"}
    # nor does an attribute between `struct` and the struct's name
    assert reach("a.cu", "Quad") == {"a_quad"} and reach("a.cu", "alignas") == set()
    # a function a macro names widens to the whole module that uses the macro (and holds the header)
    assert reach("common.cuh", "twice") == {"a_decode", "a_dot", "a_quad", "b_twice", "b_plain"}
    assert reach("common.cuh", "<file>") == {"a_decode", "a_dot", "a_quad", "b_twice", "b_plain"}
    assert reach("b.cu", "b_plain") == {"b_plain"}


def test_every_cuda_mutant_of_the_kernels_is_reached_by_some_entry_point():
    from ladder.tools.mutate import DEFAULT_FILES, all_mutants, kernel_files

    functions = {(m.file, m.function) for m in all_mutants(kernel_files(DEFAULT_FILES["cuda"]))}
    unreached = sorted(f for f in functions
                       if not [p for p in launches.patterns_for(*f) if not launches.is_source_unit(p)])
    assert not unreached, f"functions no entry point reaches (dead code, or a reading that is too narrow): {unreached}"


def test_changed_lines_map_to_the_functions_that_hold_them():
    py = "import numpy as np\nX = 1\n\n@staticmethod\ndef f(a):\n    def inner():\n        return a\n    return inner()\n"
    assert python_functions_on_lines(py, {2}) == {"<module>"}
    assert python_functions_on_lines(py, {4}) == {"f"} and python_functions_on_lines(py, {7}) == {"inner"}
    cu = '// a comment\n#define K 4\n__device__ float g(const float (&w)[4]) {\n    // inside\n    return w[0];\n}\n'
    assert cuda_functions_on_lines(cu, {1}) == set()  # a comment changes no code
    assert cuda_functions_on_lines(cu, {2}) == {"<file>"}  # a macro may be used anywhere
    assert cuda_functions_on_lines(cu, {4}) == set() and cuda_functions_on_lines(cu, {5}) == {"g"}
    assert "u32" not in functions_of_tokens(cuda_tokens("__device__ float h(const u32 (&x)[4]) { return 0; }"))


# --- --changed, the way a user runs it ---------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture()
def project_repo(tmp_path) -> Path:
    """A copy of the project's tree in a git repository of its own, one commit."""
    repo = tmp_path / "repo"
    for name in TREE:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis"))
        else:
            shutil.copy2(src, repo / name)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return repo


def test_changed_reads_functions_from_the_diff_and_runs_everything_outside_the_kernels(project_repo, monkeypatch, tmp_path):
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "elsewhere"))  # as a git hook would leave it: not followed
    assert launches.changed_patterns("HEAD", project_repo) == ([], [])
    att = project_repo / "kernels" / "numpy" / "attention.py"
    att.write_text(att.read_text().replace("    T, nq, d = q.shape", "    T, nq, d = q.shape  # shape\n    _ = 0", 1))
    patterns, what = launches.changed_patterns("HEAD", project_repo)
    assert patterns == ["kernels/numpy/attention.py::<source>", "kernels/numpy/attention.py::paged_attention"], patterns
    assert what == ["kernels/numpy/attention.py::paged_attention"]
    (project_repo / "docs").mkdir()
    (project_repo / "docs" / "notes.txt").write_text("a note\n")  # documentation changes no case
    assert launches.changed_patterns("HEAD", project_repo)[0] == patterns
    cached = project_repo / "engine" / "__pycache__" / "block.cpython-311.pyc"  # a run's bytecode, in a tree
    cached.parent.mkdir()  # without a .gitignore (this copy has none): untracked, and no change
    cached.write_bytes(b"\x00" * 16)
    assert launches.changed_patterns("HEAD", project_repo)[0] == patterns
    engine = project_repo / "engine" / "block.py"
    engine.write_text(engine.read_text() + "\n")
    assert launches.changed_patterns("HEAD", project_repo) == (None, ["engine/block.py"])
    with pytest.raises(launches.ChangeError):
        launches.changed_patterns("no-such-revision", project_repo)


@skip_inside_nested_run
@pytest.mark.long  # 9 to 30 s on CI's 2 cores: started first, not left to end the suite alone
def test_ladder_changed_runs_only_the_cases_that_launch_the_changed_function(project_repo, tmp_path):
    cache = tmp_path / "cache"
    env = child_env("numpy", pythonpath=str(project_repo), NANOQWEN_CACHE=str(cache))
    ladder = lambda report, *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "ladder", "ladder", "--backend", "numpy", "--rungs", "unit", "-n", "0", "--report",
         str(tmp_path / report), *extra, "--", "-k", "test_ops and (rope or attention_decode)"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    att = project_repo / "kernels" / "numpy" / "attention.py"
    att.write_text(att.read_text().replace("    T, nq, d = q.shape", "    T, nq, d = q.shape\n    _ = 0", 1))
    first = ladder("r1", "--changed", "HEAD")  # no map yet: every case runs, and the map is recorded
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "no launch map" in first.stdout
    ran_all = json.loads((tmp_path / "r1" / "report.json").read_text())["rungs"]["unit"]["passed"]
    second = ladder("r2", "--changed", "HEAD")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "1 kernel function(s) changed (kernels/numpy/attention.py::paged_attention)" in second.stdout
    ran = json.loads((tmp_path / "r2" / "report.json").read_text())["rungs"]["unit"]["passed"]
    assert 0 < ran < ran_all  # the attention cases, not the rope ones
    att.write_text(att.read_text().replace("    _ = 0\n", "", 1))
    rope_only = ladder("r3", "--changed", "HEAD")  # nothing changed: no case runs, and the rung is green
    assert rope_only.returncode == 0 and "no case of it launches the code changed since HEAD" in rope_only.stdout
    bad = ladder("r4", "--changed", "no-such-revision")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--changed no-such-revision" in bad.stderr
