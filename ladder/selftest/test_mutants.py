"""Self-test: the mutants of `nanoqwen mutate` are one-site edits of code, and the run judges them right.

ladder/tools/mutants.py must never edit a comment, a docstring, a string (inline PTX) or a preprocessor line,
must leave template brackets, casts, pointer declarators and signs alone, and must give every mutant a
signature that names it alone. ladder/tools/mutate.py must call a mutant the unit rung catches "killed" and
one it cannot see "survived", and refuse bad arguments in one line. The reviewed equivalent list must
name mutants that exist, each with its reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ladder.tools.mutants import Mutant, compiles, cuda_mutants, mutants_of, python_mutants
from ladder.tools.mutate import DEFAULT_FILES, EQUIVALENT_FILE, ROOT, all_mutants, kernel_files, run, sample
from ladder.run.nested import REPO, child_env, skip_inside_nested_run

KERNEL_FILES = kernel_files(DEFAULT_FILES["numpy"] + DEFAULT_FILES["cuda"])

PY_SAMPLE = '''"""A docstring with 1 + 2 < 3 in it."""
import numpy as np

LIMIT = 4  # a comment: a < b


def f(x, n):
    """x + 1"""
    s = "a - b"
    if n <= 2 and x is not None:
        return x.astype(np.float32) * 2.5 - n
    return -x
'''

CU_SAMPLE = '''// a comment: a < b + 1
#define TILE 64
#include "common.cuh"

template <int R, int T>
__device__ __forceinline__ float body(const float* __restrict__ x, int n) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n; i += T) acc += x[i] * 2.0f;  /* a block comment - 1 */
    __syncthreads();
    acc += __shfl_xor_sync(0xffffffffu, acc, 16);
    asm("add.f32 %0, %1, %2;" : "=f"(acc) : "f"(acc), "f"(-acc));
    return -acc;
}

extern "C" __global__ void k(const float* x, float* y, int n) {
    y[0] = body<4, 128>(reinterpret_cast<const float*>(x), n);
}
'''


def _edits(source: str, mutants: list[Mutant]) -> list[tuple[str, str]]:
    out = []
    for m in mutants:
        mutated = m.apply(source)
        assert mutated[:m.start] == source[:m.start]
        assert mutated[m.start + len(m.replacement):] == source[m.start + len(m.original):], m.describe()
        out.append((m.original, m.replacement))
    return out


def test_python_mutants_leave_docstrings_comments_and_strings_alone(tmp_path):
    path = tmp_path / "k.py"
    path.write_text(PY_SAMPLE)
    mutants = python_mutants(path, "k.py")
    edits = _edits(PY_SAMPLE, mutants)
    assert ("<=", "<") in edits and ("and", "or") in edits and ("float32", "float16") in edits
    assert ("*", "/") in edits and ("-", "+") in edits and ("2.5", "5.0") in edits and ("4", "5") in edits
    docstring_end = PY_SAMPLE.index('"""', 3) + 3
    for m in mutants:
        assert m.start >= docstring_end
        line = PY_SAMPLE.splitlines()[m.line - 1]
        assert "#" not in line[:line.find(m.original)] and '"' not in line.split("=")[0], m.describe()
    assert {m.function for m in mutants} == {"<module>", "f"}
    assert not any(m.line == 9 for m in mutants), "a string literal was mutated"
    assert all(compiles("k.py", m.apply(PY_SAMPLE)) for m in mutants)


def test_cuda_mutants_skip_comments_preprocessor_strings_templates_and_declarators(tmp_path):
    path = tmp_path / "k.cu"
    path.write_text(CU_SAMPLE)
    mutants = cuda_mutants(path, "k.cu")
    edits = _edits(CU_SAMPLE, mutants)
    lines = CU_SAMPLE.splitlines()
    assert not any(m.line in (1, 2, 3, 5, 11) for m in mutants), [m.describe() for m in mutants if m.line in (1, 2, 3, 5, 11)]
    assert ("<", "<=") in edits and ("+=", "+=") not in edits and ("*", "/") in edits
    assert ("__syncthreads();", ";") in edits and ("16", "(16) >> 1") in edits
    assert ("2.0f", "4.0f") in edits
    for m in mutants:
        if m.line == 16:  # body<4, 128>(reinterpret_cast<const float*>(x), n): no comparison, no product
            assert m.kind == "literal", m.describe()
        assert not (m.line == 6), f"a signature was mutated: {m.describe()}"
    assert {m.function for m in mutants} == {"body", "k"}
    return_line = next(i for i, text in enumerate(lines, 1) if "return -acc" in text)
    assert not any(m.line == return_line for m in mutants), "a unary minus is not a binary operator"


def test_every_kernel_mutant_is_one_site_with_a_unique_signature():
    for rel in KERNEL_FILES:
        source = (ROOT / rel).read_text()
        mutants = mutants_of(ROOT, rel)
        assert mutants, f"{rel}: no mutation site found"
        _edits(source, mutants)
        signatures = [m.signature for m in mutants]
        assert len(set(signatures)) == len(signatures), f"{rel}: two mutants share a signature"
        if rel.endswith(".py"):
            assert all(compiles(rel, m.apply(source)) for m in mutants), rel


def test_sampling_is_seeded_and_keeps_file_order():
    mutants = all_mutants(KERNEL_FILES)
    a, b = sample(mutants, 25, seed=3), sample(mutants, 25, seed=3)
    assert a == b and len(a) == 25 and a != sample(mutants, 25, seed=4)
    assert a == sorted(a, key=mutants.index)
    assert sample(mutants, None, 0) == mutants


def test_reviewed_equivalents_name_existing_mutants_with_a_reason():
    entries = json.loads(EQUIVALENT_FILE.read_text())
    known = {m.signature for m in all_mutants(KERNEL_FILES)}
    for e in entries:
        assert e["signature"] in known, f"equivalent mutant {e['signature']} no longer exists: review the list"
        assert len(e["reason"]) > 20, f"{e['signature']}: the reason must say why no output can change"
    assert len({e["signature"] for e in entries}) == len(entries)


def _mutant(rel: str, function: str, original: str, replacement: str) -> Mutant:
    return next(m for m in mutants_of(ROOT, rel) if (m.function, m.original, m.replacement) == (function, original, replacement))


@skip_inside_nested_run
@pytest.mark.long  # 9 to 30 s on CI's 2 cores: started first, not left to end the suite alone
def test_a_caught_mutant_is_killed_and_a_harmless_one_survives():
    killed = _mutant("kernels/numpy/__init__.py", "rotate", "*", "+")  # RoPE's rotation: the unit rung sees it
    harmless = _mutant("kernels/numpy/linear.py", "<module>", "18", "17")  # a block size: the same sums
    results = {r["signature"]: r for r in run([killed, harmless], "numpy", ["unit"], jobs=2, timeout=600,
                                              extra=["-k", "test_ops and rope"], log=lambda s: None)}
    assert results[killed.signature]["outcome"] == "killed" and results[killed.signature]["rung"] == "unit"
    assert results[harmless.signature]["outcome"] == "survived"
    assert (ROOT / "kernels/numpy/__init__.py").read_text().count("def rotate") == 1  # the checkout is untouched


@skip_inside_nested_run
def test_a_mutant_in_code_no_case_launches_is_not_run_and_not_scored():
    from ladder.tools.mutate_report import summarize

    idle = next(m for m in mutants_of(ROOT, "kernels/numpy/attention.py") if m.function == "paged_attention")
    results = run([idle], "numpy", ["unit"], jobs=1, timeout=600, extra=["-k", "test_ops and rope"], log=lambda s: None)
    assert results[0]["outcome"] == "not_launched" and results[0]["cases"] == 0
    total = summarize(results, {})["total"]
    assert total["not_launched"] == 1 and total["score"] is None


@skip_inside_nested_run
def test_mutants_left_when_the_budget_is_spent_are_not_run_and_not_scored():
    from ladder.tools.mutate_report import markdown, summarize

    chosen = [_mutant("kernels/numpy/__init__.py", "rotate", "*", "+"),
              _mutant("kernels/numpy/linear.py", "<module>", "18", "17")]
    results = run(chosen, "numpy", ["unit"], jobs=1, timeout=600, extra=["-k", "test_ops and rope"], log=lambda s: None,
                  launches=({"unit": {}}, {"unit": {}}), budget=0.0)
    assert [r["outcome"] for r in results] == ["not_run", "not_run"]
    summary = summarize(results, {})
    assert summary["total"]["not_run"] == 2 and summary["total"]["score"] is None
    report = {"meta": {"backend": "numpy", "rungs": ["unit"], "run": 2, "candidates": 2, "seed": 0, "seconds": 0.0},
              "summary": summary, "mutants": results, "equivalents": {}}
    assert "2 mutants were not run: the time given (--budget, --within) was spent" in markdown(report)


def test_within_counts_from_the_command_start_and_budget_from_the_first_mutant():
    from ladder.tools.mutate import WITHIN_MARGIN, limits

    assert limits(None, None, started=100.0, t0=110.0) is None
    assert limits(120.0, None, started=100.0, t0=110.0) == (230.0, 290.0)  # the cut max(60 s, B/2) later
    assert limits(300.0, None, started=100.0, t0=110.0) == (410.0, 560.0)
    starts, cut = limits(None, 150.0, started=100.0, t0=110.0)  # the set-up's 10 s are inside the 150
    assert (starts, cut) == (200.0, 250.0 - WITHIN_MARGIN)
    assert limits(120.0, 150.0, started=100.0, t0=110.0) == (200.0, 250.0 - WITHIN_MARGIN)  # the earlier of each


@skip_inside_nested_run
def test_rungs_red_on_the_unmutated_tree_refuse_the_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--sample", "1", "--rungs", "unit", "-n", "1",
                        "--report", str(tmp_path / "m"), "--", "-k", "test_ops and attention_decode",
                        "--plant-fault", "stale_page_read"],
                       cwd=tmp_path, capture_output=True, text=True, env=child_env("numpy"), timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "red on the unmutated tree" in r.stderr, r.stderr
    assert not (tmp_path / "m").exists()


@skip_inside_nested_run
def test_a_clean_run_pytest_refuses_names_pytests_reason_not_its_usage_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--sample", "1", "--rungs", "unit", "-n", "1",
                        "--report", str(tmp_path / "m"), "--", "--no-such-option"],
                       cwd=tmp_path, capture_output=True, text=True, env=child_env("numpy"), timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "(exit 4: unrecognized arguments: --no-such-option)" in r.stderr, r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: the build screen compiles with it")
def test_same_build_tells_the_originals_machine_code_from_a_change_and_a_broken_build():
    """rmsnorm.cu (0.4 s a build): `j < RMS_HELD` -> `j <= RMS_HELD` in load_held_weight writes w[RMS_HELD],
    past the thread-local array, and nvcc drops the pass (the same cubin); `+` -> `-` in its index changes
    the loads; a pointer times an integer does not compile."""
    from ladder.tools.same_build import same_build

    same = _mutant("kernels/cuda/rmsnorm.cu", "load_held_weight", "<", "<=")
    changed = _mutant("kernels/cuda/rmsnorm.cu", "load_held_weight", "+", "-")
    broken = _mutant("kernels/cuda/rmsnorm.cu", "rmsnorm_f32_f16", "+", "*")
    got = {r["signature"]: (r["verdict"], r["modules"]) for r in same_build([same, changed, broken], ROOT, 2,
                                                                         shutil.which("nvcc"), log=lambda s: None)}
    assert got == {same.signature: ("same", ["rmsnorm"]), changed.signature: ("different", ["rmsnorm"]),
                   broken.signature: ("did_not_compile", ["rmsnorm"])}


def test_a_header_mutant_touches_every_module_that_inlines_the_header():
    from ladder.changes.launches import cuda_modules_holding
    from ladder.changes.sources import cuda_module

    loader, folder = cuda_module("loader"), ROOT / "kernels" / "cuda"
    assert cuda_modules_holding("rmsnorm.cu", folder) == ["rmsnorm"]
    mma = cuda_modules_holding("mma.cuh", folder)
    assert {"paged_attention", "int4_sym_g128", "int4_asym_g128"} <= set(mma) and "rmsnorm" not in mma
    assert set(cuda_modules_holding("common.cuh", folder)) == set(loader.MODULES)


def test_same_build_without_nvcc_is_one_line_and_exit_2(tmp_path):
    env = {**child_env("cuda"), "PATH": str(Path(sys.executable).parent)}  # the interpreter, no nvcc
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--backend", "cuda", "--same-build"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nvcc" in r.stderr, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--rungs", "unit,typo"], "--rungs"),
    (["--files", "kernels/nowhere/*.py"], "--files"),
    (["--baseline", "no-such-folder"], "--baseline"),
    (["--rerun", "no-such-folder"], "--rerun"),
    (["--resume", "no-such-folder"], "--resume"),
    (["--sample", "0"], "--sample"),
    (["--sample", "3", "--seed", "tomorrow"], "--seed"),
    (["--within", "10"], "--within"),
    (["--within", "soon"], "--within"),
    (["--same-build"], "--same-build"),  # on the numpy backend: nothing to compile
])
def test_bad_mutate_arguments_are_one_line_and_exit_2(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", *args], cwd=tmp_path, capture_output=True, text=True,
                       env=child_env("numpy"), timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_fork_server_refuses_to_hold_a_module_a_mutant_edits():
    from ladder.tools.forkserver import preimport

    assert "numpy" in preimport(["kernels/numpy/no_such_module.py"])  # imported by no library: fine
    unit_only = preimport(["kernels/numpy/no_such_module.py"], rungs=["unit"])
    assert "pytest" in unit_only and "transformers" not in unit_only, "a unit-only server imports the HF reference"
    with pytest.raises(RuntimeError, match="which mutants edit"):
        preimport(["numpy/__init__.py"])  # imported by the server itself: a child would see the old one


def test_a_run_past_its_timeout_is_killed_with_its_process_group(tmp_path):
    from ladder.tools.forkserver import run_child

    test = tmp_path / "test_hang.py"
    test.write_text("import subprocess, time\n\ndef test_hangs():\n"
                    "    subprocess.Popen(['sleep', '300'])  # a grandchild: killed with the group\n    time.sleep(300)\n")
    t0 = time.monotonic()
    res = run_child([str(test), "-q", "-p", "no:cacheprovider", "-c", "/dev/null"], 2.0, str(tmp_path / "log"))
    assert res == {"exit": None, "timed_out": True} and time.monotonic() - t0 < 30
    assert run_child([str(test), "-q", "-p", "no:cacheprovider", "-c", "/dev/null", "--collect-only"], 60.0,
                     str(tmp_path / "log")) == {"exit": 0}


def test_the_watchdog_kills_a_case_past_its_own_limit_and_names_it(tmp_path, monkeypatch):
    """A hung kernel blocks its child in a device wait: the server kills the child once one case has run
    past its own limit, long before the run's timeout, and names that case. Cases within their limits,
    however many, pass."""
    from ladder.tools.forkserver import run_child

    test = tmp_path / "test_watch.py"
    test.write_text("import time\n\n"
                    + "".join(f"def test_quick_{i}():\n    time.sleep(0.05)\n\n" for i in range(20))
                    + "def test_hangs():\n    time.sleep(300)\n")
    ids = [f"test_watch.py::test_quick_{i}" for i in range(20)] + ["test_watch.py::test_hangs"]
    args = [str(test), "-q", "-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", str(tmp_path)]
    t0 = time.monotonic()
    # the quick cases' limits leave room for a loaded machine (a 0.05 s case once took past 0.3 s on 2 busy cores)
    res = run_child(args, 600.0, str(tmp_path / "log"), {i: 0.5 if "hangs" in i else 5.0 for i in ids})
    assert res["timed_out"] and res["hung"] == "test_watch.py::test_hangs" and 0.5 <= res["after"] < 10
    assert time.monotonic() - t0 < 60, "the watchdog waited for the run's timeout"
    quick = [str(test) + "::" + i.split("::")[1] for i in ids[:20]]
    (tmp_path / "slow_end.py").write_text("import time\n\ndef pytest_sessionfinish(session):\n    time.sleep(1.5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the forked child imports the plugin from here
    res = run_child([*quick, *args[1:], "-p", "slow_end"], 600.0, str(tmp_path / "log"), {i: 1.0 for i in ids})
    assert res == {"exit": 0}, ("cases within their limits were killed (20 cases of 0.05 s against 1 s limits each, "
                                "then 1.5 s at the session's end, which is no case's)")


def test_a_hung_mutant_is_timed_out_with_its_case_named():
    from ladder.tools.mutate import CASE_ALLOWANCE, HANG_FACTOR, Worker

    w = Worker.__new__(Worker)
    w.timeout, w.seconds = None, {"unit": {"a": 2.0}}
    assert w.case_limits("unit", ["a", "b"]) == {"a": CASE_ALLOWANCE + HANG_FACTOR * 2.0, "b": CASE_ALLOWANCE + HANG_FACTOR}
    w.timeout = 7.0
    assert w.case_limits("unit", ["a"]) is None, "a fixed --timeout is the only limit"


def test_the_automatic_timeout_is_the_cases_own_limits_plus_a_start_up_allowance():
    """Only a hang outside any case reaches it: a mutant that merely slows each case within its limit
    (a smaller cache budget) runs on to a verdict."""
    from ladder.tools.mutate import CASE_ALLOWANCE, HANG_FACTOR, START_ALLOWANCE, Worker

    w = Worker.__new__(Worker)  # no copy of the tree: only the timeout rule
    w.timeout, w.seconds = None, {"graph": {"a": 2.0, "b": 3.0}}
    assert w.timeout_for("graph", ["a", "b"]) == START_ALLOWANCE + 2 * CASE_ALLOWANCE + HANG_FACTOR * 5.0
    assert w.timeout_for("graph", ["a", "unknown"]) == START_ALLOWANCE + 2 * CASE_ALLOWANCE + HANG_FACTOR * 3.0  # unknown: 1 s
    w.timeout = 7.0
    assert w.timeout_for("graph", ["a", "b"]) == 7.0


def _report(outcomes: dict[str, str]) -> dict:
    return {"mutants": [{"signature": sig, "outcome": o} for sig, o in outcomes.items()], "summary": {"files": {}}}


def test_a_run_weaker_than_its_baseline_is_a_regression_and_a_stronger_one_is_not():
    from ladder.tools.mutate_report import compare, regressions

    base = _report({"a": "killed", "b": "survived", "c": "timed_out", "d": "killed"})
    for outcomes, lost in [({"a": "killed", "b": "killed", "c": "timed_out", "d": "killed"}, []),  # stronger
                           ({"a": "survived", "b": "killed", "c": "timed_out", "d": "killed"}, ["a"]),
                           ({"a": "killed", "b": "survived", "c": "not_launched", "d": "killed"}, ["c"])]:
        run = _report(outcomes)
        run["baseline"] = compare(run, base)
        assert run["baseline"]["newly_surviving"] == lost
        assert bool(regressions(run)) == bool(lost), regressions(run)
    run = _report({"a": "survived", "b": "survived", "c": "timed_out", "d": "killed"})
    run["baseline"] = compare(run, base)
    assert any("score over the 4 mutants" in line for line in regressions(run))  # 2 of 4 against 3 of 4


def test_seed_random_draws_a_sample_that_its_printed_seed_draws_again(tmp_path):
    def listed(seed: str) -> list[str]:
        r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--sample", "5", "--seed", seed, "--list"],
                           cwd=tmp_path, capture_output=True, text=True, env=child_env("numpy"), timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    drawn = listed("random")
    seed = drawn[-1].rsplit("seed ", 1)[1]
    assert seed.isdigit() and listed(seed) == drawn and len(drawn) == 6  # five mutants and the summary line
    assert listed("date")[-1].endswith(f"seed {time.strftime('%Y%m%d')}")


def test_a_report_s_trend_carries_its_baseline_s_runs_and_keeps_the_last_thirty():
    from ladder.tools.mutate_report import TREND_NIGHTS, markdown, trend, trend_line

    def report(outcomes: dict[str, str], seed: int, started: str) -> dict:
        from ladder.tools.mutate_report import summarize

        results = [{"signature": sig, "outcome": o, "file": "kernels/numpy/f.py", "function": "g", "line": 1,
                    "original": "+", "replacement": "-", "kind": "operator", "rung": "unit"} for sig, o in outcomes.items()]
        meta = {"backend": "numpy", "rungs": ["unit"], "run": len(results), "candidates": 9, "seed": seed,
                "seconds": 1.0, "started": started}
        return {"meta": meta, "summary": summarize(results, {}), "mutants": results, "equivalents": {}}

    night = report({"a": "killed", "b": "survived", "c": "timed_out"}, 20261202, "2026-12-02T03:00:00")
    night["trend"] = trend(night, None)
    assert [e["seed"] for e in night["trend"]] == [20261202] and night["trend"][0]["score"] == pytest.approx(2 / 3)
    tonight = report({"d": "killed", "e": "killed"}, 20261203, "2026-12-03T03:00:00")
    tonight["trend"] = trend(tonight, night)
    assert [e["seed"] for e in tonight["trend"]] == [20261202, 20261203]
    line = trend_line(tonight["trend"])
    assert "this run 100.0%" in line and "the last 2 run(s) together 80.0% (4 detected, 1 survived)" in line, line
    assert "## Trend" in markdown(tonight) and "| 2026-12-02T03:00:00 | 20261202 | 3 | 2 | 1 |" in markdown(tonight)
    long_ago = {**tonight, "trend": tonight["trend"] * 20}
    assert len(trend(tonight, long_ago)) == TREND_NIGHTS and trend(tonight, long_ago)[-1]["seed"] == 20261203


# A stand-in for compute-sanitizer: `--tool T --error-exitcode N --print-limit K ARGV...`; it reports an
# error (exit N) under the tools FLAGGED names, else runs ARGV and exits with its status.
FAKE_SANITIZER = """#!/bin/sh
tool=$2; code=$4; shift 6
case " $FLAGGED " in *" $tool "*) echo "========= Invalid __global__ write of size 4 bytes"; exit $code;; esac
echo "pool=$NANOQWEN_CUPY_POOL"
exec "$@"
"""


def test_a_survivor_s_second_look_kills_it_under_the_tool_that_reports_and_says_which(tmp_path):
    from ladder.tools.mutate import Worker

    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    w = Worker(tmp_path / "copy", 0, "numpy", ["unit"], None, [], {}, {}, child_env("numpy", pythonpath=str(ROOT)), [])
    w.sanitizer = str(fake)
    ids = ["ladder/unit/test_format_int4.py::test_weights_the_format_cannot_hold_are_refused"]
    w.env["FLAGGED"] = "racecheck"
    assert w.second_look(ids) == {"caught_by": "racecheck"}
    assert "NANOQWEN_CUPY_POOL" not in w.env  # the pool is turned off in the checked process only
    w.env["FLAGGED"] = ""
    assert w.second_look(ids) == {"second_look": "memcheck clean, racecheck clean"}, w.log.read_text()[-2000:]
    assert w.log.read_text().startswith("pool=0") and " passed" in w.log.read_text()  # the cases ran, pool off
    w.sanitizer = None  # a host backend: no sanitizer, no second look
    assert w.second_look(ids) == {}


# A stand-in that reports an error under the tools FLAGGED only for the op sweep (a run whose arguments hold
# $SWEEP_MARK); it logs each run it lets through to $RUNS and runs the sweep, not the cases (the first test
# above runs those: here only the order and the verdicts matter).
SWEEP_SANITIZER = """#!/bin/sh
tool=$2; code=$4; shift 6
case "$*" in *"$SWEEP_MARK"*) case " $FLAGGED " in *" $tool "*) echo "========= Invalid __global__ read"; exit $code;; esac;; esac
echo "$tool $*" >> "$RUNS"
case "$*" in *"$SWEEP_MARK"*) exec "$@";; esac
echo "1 passed"
"""


def test_a_second_look_starts_with_the_op_sweep_and_a_sweep_report_kills_before_any_case_runs(tmp_path):
    """The sweep (ladder/tools/opsweep.py: every op at its edges, seconds under a tool) goes first, under
    each tool, then the survivor's unit cases: an over-read that only an edge shape reaches is reported
    without waiting on minutes of cases under memcheck."""
    from ladder.tools.mutate import Worker
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(SWEEP_SANITIZER)
    fake.chmod(0o755)
    runs = tmp_path / "runs"
    w = Worker(tmp_path / "copy", 0, "numpy", ["unit"], None, [], {}, {}, child_env("numpy", pythonpath=str(ROOT)), [])
    assert w.sweep is None  # a host backend has none: its second look is the cases alone (tests above)
    on_device = Worker(tmp_path / "copy2", 1, "cuda", ["unit"], None, [], {}, {}, {}, [])
    assert on_device.sweep == ("-m", "ladder.tools.opsweep", "--backend", "cuda")
    w.sanitizer = str(fake)
    w.sweep = ("-c", "print('op-sweep')")  # stands in for a device backend's `-m ladder.tools.opsweep --backend NAME`
    w.env.update(SWEEP_MARK="op-sweep", RUNS=str(runs), FLAGGED="memcheck")
    ids = ["ladder/unit/test_format_int4.py::test_weights_the_format_cannot_hold_are_refused"]
    assert w.second_look(ids) == {"caught_by": "memcheck, in the op sweep"}
    assert not runs.exists()  # caught at the first part: no case ran
    w.env["FLAGGED"] = ""
    assert w.second_look(ids) == {"second_look": "memcheck sweep clean, racecheck sweep clean, "
                                                 "memcheck cases clean, racecheck cases clean"}
    order = [(line.split()[0], "op-sweep" in line) for line in runs.read_text().splitlines()]
    assert order == [("memcheck", True), ("racecheck", True), ("memcheck", False), ("racecheck", False)]
    assert w.second_look([]) == {"second_look": "memcheck sweep clean, racecheck sweep clean"}  # no unit case: the sweep


# A stand-in whose verdict depends on the tree: under the tools FLAGGED it reports an error (exit N) while
# the file $MARK exists (the mutant is written), and under the tools FAILING a case fails (exit 1) whatever
# the tree holds (a case that cannot pass under the tool, like one measuring CuPy's pool); else the cases
# pass (not run: the test above runs them, this one the verdicts).
TREE_SANITIZER = """#!/bin/sh
tool=$2; code=$4; shift 6
case " $FAILING " in *" $tool "*) echo "1 failed"; exit 1;; esac
if [ -e "$MARK" ]; then case " $FLAGGED " in *" $tool "*) echo "========= Invalid __global__ read"; exit $code;; esac; fi
echo "1 passed"
"""


def test_a_second_look_verdict_counts_only_where_the_unmutated_tree_passes_under_the_tool(tmp_path):
    import contextlib

    from ladder.tools.mutate import Worker

    fake = tmp_path / "compute-sanitizer"
    fake.write_text(TREE_SANITIZER)
    fake.chmod(0o755)
    mark = tmp_path / "mutated"
    w = Worker(tmp_path / "copy", 0, "numpy", ["unit"], None, [], {}, {}, child_env("numpy", pythonpath=str(ROOT)), [])
    w.sanitizer = str(fake)
    w.env.update(MARK=str(mark), FLAGGED="racecheck", FAILING="")
    ids = ["ladder/unit/test_format_int4.py::test_weights_the_format_cannot_hold_are_refused"]
    swaps = []

    @contextlib.contextmanager
    def unmutated(reverts: bool):
        swaps.append(reverts)
        if reverts:
            mark.unlink()
        try:
            yield
        finally:
            mark.touch()

    mark.touch()
    # the mutant alone makes racecheck report: caught, after one look at the unmutated tree
    assert w.second_look(ids, unmutated=lambda: unmutated(True)) == {"caught_by": "racecheck"}
    assert swaps == [True] and mark.exists()
    # racecheck reports on the unmutated tree too: no verdict, and that tree is asked once per tool and cases
    w._unmutated_looks.clear()
    for _ in range(2):
        look = w.second_look(ids, unmutated=lambda: unmutated(False))
        assert look == {"second_look": "memcheck clean, racecheck: the cases fail under it unmutated too (no verdict)"}
    assert swaps == [True, False]
    # a case that fails under memcheck whatever the tree holds kills nothing
    w.env.update(FLAGGED="", FAILING="memcheck")
    assert w.second_look(ids, unmutated=lambda: unmutated(True)) == {
        "second_look": "memcheck: the cases fail under it unmutated too (no verdict), racecheck clean"}
    # without the unmutated tree to ask (a caller that has none), a failing case still counts
    assert w.second_look(ids) == {"caught_by": "memcheck (a case failed under it)"}


@skip_inside_nested_run
def test_mutate_exits_1_when_weaker_than_its_baseline(tmp_path):
    # an attention mutant, where only rope cases run: no case launches it, and the claimed baseline killed it
    lost = next(m for m in mutants_of(ROOT, "kernels/numpy/attention.py") if m.function == "paged_attention")
    for name, outcome in (("earlier", "survived"), ("claimed", "killed")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mutate.json").write_text(json.dumps(_report({lost.signature: outcome})))
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--files", "kernels/numpy/attention.py", "--rungs", "unit",
                        "-n", "1", "--rerun", str(tmp_path / "earlier"), "--baseline", str(tmp_path / "claimed"),
                        "--report", str(tmp_path / "now"), "--", "-k", "test_ops and rope"],
                       cwd=tmp_path, capture_output=True, text=True, env=child_env("numpy"), timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"REGRESSION killed in the baseline, no longer launched here: {lost.signature}" in r.stderr
    assert json.loads((tmp_path / "now" / "mutate.json").read_text())["baseline"]["newly_surviving"] == [lost.signature]


def test_python_mutants_leave_annotations_alone(tmp_path):
    src = tmp_path / "k.py"
    src.write_text("def f(x: int | None = 1, *a: float | int) -> int | None:\n    y: int | None = x\n    return y | 2\n")
    found = {(m.line, m.original, m.replacement) for m in python_mutants(src, "k.py")}
    assert {o for _, o, _ in found} == {"1", "|", "2"}  # the default, the body's `|` and its literal
    assert all(line != 2 or o != "|" for line, o, _ in found) and (3, "|", "&") in found


ROPE_CASE = "ladder/unit/test_ops.py::test_rope_kv_write_rotates_and_writes_only_its_slots[numpy]"


def _ladder_report(folder, **meta) -> None:
    """A ladder report folder with a unit rung whose map says one rope case launches `rotate`."""
    folder.mkdir()
    base = {"model": "default", "backends": ["numpy"], "result": "passed", "shard": None, "plant_fault": None,
            "changed": None}
    (folder / "report.json").write_text(json.dumps({"meta": {**base, **meta}}))
    (folder / "unit.json").write_text(json.dumps({"launches": {ROPE_CASE:
                                                               ["kernels/numpy/__init__.py::rotate"]},
                                                  "case_seconds": {}}))


@skip_inside_nested_run
def test_a_green_ladder_report_stands_in_for_the_clean_run(tmp_path):
    """--launches: the nightly's own report gives the map; no clean run, and the mutants run against it.
    (That a ladder run writes such a report: ladder/selftest/test_launches.py.)"""
    killed = _mutant("kernels/numpy/__init__.py", "rotate", "*", "+")
    _ladder_report(tmp_path / "night")  # what a green `nanoqwen ladder --record-launches` report holds
    (tmp_path / "earlier").mkdir()  # --rerun of an earlier report that holds this one mutant as a survivor
    (tmp_path / "earlier" / "mutate.json").write_text(json.dumps(_report({killed.signature: "survived"})))
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--files", "kernels/numpy/__init__.py", "--rungs", "unit",
                        "-n", "1", "--rerun", str(tmp_path / "earlier"), "--launches", str(tmp_path / "night"),
                        "--report", str(tmp_path / "m")], cwd=tmp_path, capture_output=True, text=True,
                       env=child_env("numpy"), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "clean unit rung" not in r.stdout, "a clean run ran although the report gave the map"
    rep = json.loads((tmp_path / "m" / "mutate.json").read_text())
    assert [(m["signature"], m["outcome"]) for m in rep["mutants"]] == [(killed.signature, "killed")]
    assert rep["meta"]["launches"] == str(tmp_path / "night")


def _cut_report(folder, outcomes: dict, **meta) -> None:
    """A mutate report of the unit rung on kernels/numpy/__init__.py whose run was cut: `outcomes` maps a
    mutant to its outcome there (`not_run` for one the cut left)."""
    from ladder.tools.mutate import sources_digest

    folder.mkdir()
    files = ["kernels/numpy/__init__.py"]
    base = {"backend": "numpy", "rungs": ["unit"], "files": files, "seed": 7, "sample": 2, "sources": sources_digest(files)}
    mutants = [{**m.record(), "outcome": o, "rung": "unit" if o == "killed" else None, "seconds": 1.0, "cases": 1}
               for m, o in outcomes.items()]
    (folder / "mutate.json").write_text(json.dumps({"meta": {**base, **meta}, "mutants": mutants}))


@skip_inside_nested_run
def test_a_resumed_sample_runs_what_the_cut_left_and_reports_both_runs(tmp_path):
    """--resume: the mutants an earlier run did not run are run now, with its seed and rungs; its results
    are carried, so one report holds the whole sample (a sample larger than one job's time limit)."""
    left = _mutant("kernels/numpy/__init__.py", "rotate", "*", "+")  # the cut left it; the unit rung kills it
    done = _mutant("kernels/numpy/__init__.py", "rotate", "+", "-")  # killed in the earlier run
    _cut_report(tmp_path / "earlier", {done: "killed", left: "not_run"})
    _ladder_report(tmp_path / "night")
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--resume", str(tmp_path / "earlier"), "-n", "1",
                        "--launches", str(tmp_path / "night"), "--report", str(tmp_path / "m")], cwd=tmp_path,
                       capture_output=True, text=True, env=child_env("numpy"), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "1 mutants it did not run, 1 results kept" in r.stdout, r.stdout
    rep = json.loads((tmp_path / "m" / "mutate.json").read_text())
    assert {m["signature"]: m["outcome"] for m in rep["mutants"]} == {done.signature: "killed", left.signature: "killed"}
    assert rep["summary"]["total"]["killed"] == 2 and rep["summary"]["total"]["not_run"] == 0
    assert (rep["meta"]["seed"], rep["meta"]["rungs"], rep["meta"]["resumed"]) == (7, ["unit"], str(tmp_path / "earlier"))


def test_resuming_a_run_that_left_nothing_says_so_and_runs_nothing(tmp_path):
    _cut_report(tmp_path / "earlier", {_mutant("kernels/numpy/__init__.py", "rotate", "*", "+"): "killed"})
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--resume", str(tmp_path / "earlier"),
                        "--report", str(tmp_path / "m")], cwd=tmp_path, capture_output=True, text=True,
                       env=child_env("numpy"), timeout=300)
    assert r.returncode == 0 and "nothing to resume" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("meta, args, why", [
    ({}, ["--seed", "3"], "drop --seed"),
    ({}, ["--rungs", "unit"], "drop --rungs"),
    ({"backend": "cuda"}, [], "pass --backend cuda"),
    ({"sources": "0123456789abcdef"}, [], "sources changed"),
])
def test_a_resume_that_cannot_continue_its_run_is_refused_in_one_line(tmp_path, meta, args, why):
    _cut_report(tmp_path / "earlier", {_mutant("kernels/numpy/__init__.py", "rotate", "*", "+"): "not_run"}, **meta)
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--resume", str(tmp_path / "earlier"), *args,
                        "--report", str(tmp_path / "m")], cwd=tmp_path, capture_output=True, text=True,
                       env=child_env("numpy"), timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    assert "--resume" in r.stderr and not (tmp_path / "m").exists()


@pytest.mark.parametrize("meta, why", [
    ({"result": "failed"}, "its ladder is red"),
    ({"shard": "1/3"}, "shard 1/3"),
    ({"plant_fault": "nibble_swap"}, "planted fault"),
    ({"changed": "HEAD~1"}, "--changed"),
    ({"backends": ["cuda"]}, "not numpy"),
    ({"model": "/models/mine.nanoqwen"}, "not the default"),
    (None, "not a ladder report folder"),
])
def test_a_report_that_cannot_stand_in_for_the_clean_run_is_refused_in_one_line(tmp_path, meta, why):
    if meta is not None:
        _ladder_report(tmp_path / "night", **meta)
    r = subprocess.run([sys.executable, "-m", "ladder", "mutate", "--rungs", "unit", "--sample", "1", "--launches",
                        str(tmp_path / "night"), "--report", str(tmp_path / "m")], cwd=tmp_path, capture_output=True,
                       text=True, env=child_env("numpy"), timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    assert "--launches" in r.stderr and not (tmp_path / "m").exists()


def test_a_rung_without_its_map_is_refused(tmp_path):
    from ladder.tools.mutate import MutateArgumentError, map_from_report

    _ladder_report(tmp_path / "night")
    with pytest.raises(MutateArgumentError, match="no layer rung"):
        map_from_report(str(tmp_path / "night"), "numpy", ["unit", "layer"])
    maps, seconds = map_from_report(str(tmp_path / "night"), "numpy", ["unit"])
    assert list(maps["unit"].values()) == [["kernels/numpy/__init__.py::rotate"]] and seconds == {"unit": {}}


def test_a_mutant_runs_each_files_cheapest_cases_first_and_the_files_in_their_order(monkeypatch):
    from ladder.tools import mutate

    w = mutate.Worker.__new__(mutate.Worker)
    w.rungs = ["unit"]
    w.maps = {"unit": {"b.py::slow": ["u"], "a.py::x": ["u"], "b.py::quick": ["u"], "a.py::y": ["u"], "c.py::z": ["v"]}}
    w.seconds = {"unit": {"b.py::slow": 9.0, "b.py::quick": 0.1, "a.py::x": 5.0, "a.py::y": 2.0}}
    monkeypatch.setattr(mutate, "patterns_for", lambda *a: ["u"])
    assert w.plan(_mutant("kernels/numpy/__init__.py", "rotate", "*", "+")) == [
        ("unit", ["b.py::quick", "b.py::slow", "a.py::y", "a.py::x"])]


def test_a_rung_run_past_the_hard_stop_is_not_run_and_never_reaches_the_server():
    from ladder.tools.mutate import Worker

    w = Worker.__new__(Worker)
    w.dir, w.backend, w.extra, w.timeout, w.seconds = ROOT, "numpy", [], None, {}
    w.server = None  # asking it would fail: the hard stop answers first
    w.stop_at = time.perf_counter() - 1.0
    assert w._ask("unit", ["ladder/unit/test_ops.py::x"]) == ("not_run", None)


@skip_inside_nested_run
def test_under_mutate_a_red_block_fails_at_its_first_assertion_without_the_culprit_search():
    """mutate's children run with NANOQWEN_NAME_CULPRIT=0: a red block is the kill, and the float64 search for
    the op inside it (minutes at the 7B shape, where the watchdog would call it a hang) does not run."""
    base = [sys.executable, "-m", "pytest", str(REPO / "ladder" / "layer" / "test_layer.py"), "-q", "-p", "ladder.plugin",
            "-c", "/dev/null", "--rootdir", str(REPO), "--confcutdir", str(REPO), "-p", "no:cacheprovider",
            "-p", "no:xdist", "--backend", "numpy", "--quant", "int4_sym_g128", "--plant-fault", "nibble_swap",
            "-k", "other_head_layouts and mha-d64"]
    named = subprocess.run(base, cwd=REPO, capture_output=True, text=True, env=child_env("numpy"), timeout=600)
    quiet = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=600,
                           env=child_env("numpy", NANOQWEN_NAME_CULPRIT="0"))
    assert named.returncode == 1 and quiet.returncode == 1, named.stdout[-1500:] + quiet.stdout[-1500:]
    assert "the first op over its bound inside the block is qkv_proj" in named.stdout, named.stdout[-2000:]
    assert "first op over its bound" not in quiet.stdout and "NANOQWEN_NAME_CULPRIT=0" in quiet.stdout, quiet.stdout[-2000:]
