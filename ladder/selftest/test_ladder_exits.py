"""Self-test: `nanoqwen ladder`'s exit status tells a regression from a broken run.

0 green, 1 a rung is red (a killed rung too), 2 bad input refused before any rung, 3 the harness broke: a
rung's pytest ended in a usage error, an internal error, a collection error or interruption, or collected no
test. A broken
harness is one line on stderr naming the rung and pytest's reason, stops the ladder even under
--keep-going, and is never a traceback. `ladder merge` follows the same codes. Each ladder case is one
short subprocess whose unit rung stops before a test runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.cli import main as cli_main
from ladder.run.nested import child_env, skip_inside_nested_run

REPO = Path(__file__).resolve().parents[2]


def ladder(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m ladder ladder` on the unit rung only, NumPy, no workers, its report in tmp_path."""
    cmd = [sys.executable, "-m", "ladder", "ladder", "--rungs", "unit", "--backend", "numpy", "-n", "0",
           "--report", str(tmp_path / "report"), *args]
    return subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)


def harness_line(proc: subprocess.CompletedProcess) -> str:
    """The run's one line of its own on stderr (pytest's own stderr passes through above it)."""
    ours = [line for line in proc.stderr.splitlines() if line.startswith("nanoqwen:")]
    assert len(ours) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "is red" not in proc.stderr, proc.stderr[-3000:]
    assert "the harness broke, not a kernel; nothing was judged" in ours[0]
    return ours[0]


@skip_inside_nested_run
def test_a_pytest_usage_error_exits_3_naming_the_rung_and_pytests_reason(tmp_path):
    proc = ladder(tmp_path, "--", "--no-such-flag")
    line = harness_line(proc)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert line.startswith("nanoqwen: rung unit: pytest usage error (pytest exit 4): ")
    assert line.endswith("; pytest: unrecognized arguments: --no-such-flag")


@skip_inside_nested_run
def test_a_path_that_does_not_exist_is_a_usage_error_exit_3(tmp_path):
    proc = ladder(tmp_path, "--", str(tmp_path / "no_such_tests.py"))
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = harness_line(proc)
    assert "pytest usage error (pytest exit 4)" in line and "file or directory not found" in line


@skip_inside_nested_run
def test_a_collection_error_exits_3_with_the_error_from_the_junit_file(tmp_path):
    broken = tmp_path / "test_broken.py"
    broken.write_text("def test_x(:\n    pass\n")  # a SyntaxError: pytest stops at collection, exit 2
    proc = ladder(tmp_path, "--", str(broken))
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = harness_line(proc)
    assert "rung unit: pytest collection error or interruption (pytest exit 2)" in line and "SyntaxError" in line
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["rungs"]["unit"]["exit"] == 2  # the report keeps pytest's own status
    assert report["meta"]["result"] == "FAILED"  # and never reads as passed


@skip_inside_nested_run
def test_a_broken_harness_stops_the_ladder_even_under_keep_going(tmp_path):
    cmd = [sys.executable, "-m", "ladder", "ladder", "--rungs", "unit,layer", "--keep-going", "--backend", "numpy",
           "-n", "0", "--report", str(tmp_path / "report"), "--", "--no-such-flag"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3 and "[2/2] rung layer" not in proc.stdout, proc.stdout[-2000:]
    assert harness_line(proc).startswith("nanoqwen: rung unit: ")
    assert list(json.loads((tmp_path / "report" / "report.json").read_text())["rungs"]) == ["unit"]


@skip_inside_nested_run
def test_a_rung_whose_pytest_is_killed_is_red_exit_1_with_the_signal_in_one_line(tmp_path):
    """A kill is red, never a broken harness (exit 3): the kernel's out-of-memory killer ends a rung whose
    model did not fit. Without workers the case's own process is the rung's pytest. (A dead worker, and a
    rung that makes no progress: ladder/selftest/test_dead_worker.py.)"""
    test = tmp_path / "ladder" / "unit" / "test_throwaway.py"  # node ids as a rung's, with --rootdir below
    test.parent.mkdir(parents=True)
    test.write_text("import os, signal, pytest\n\npytestmark = pytest.mark.unit\n\n"
                    "def test_killed():\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = ladder(tmp_path, "--", "--rootdir", str(tmp_path), str(test), "-k", "throwaway")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    killed = [line for line in proc.stderr.splitlines() if "killed by signal" in line]
    assert killed == ["nanoqwen: rung unit: its pytest process was killed by signal 9 (SIGKILL: the kernel's "
                      "out-of-memory killer, or another process)"], proc.stderr[-3000:]
    assert "the harness broke" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


# ---- ladder merge --------------------------------------------------------------------------------


def shard_report(folder: Path, shard: str, exit_status: int, counts: dict) -> Path:
    """A hand-made report folder of one shard whose unit rung ended with `exit_status`."""
    folder.mkdir(parents=True)
    rep = {"meta": {"model": "default", "backends": ["numpy"], "formats": ["int4_sym_g128"], "plant_fault": None,
                    "shard": shard, "started": "2026-12-01T00:00:00"},
           "rungs": {"unit": {"exit": exit_status, "seconds": 1.0, **counts}}}
    (folder / "report.json").write_text(json.dumps(rep))
    (folder / "unit.json").write_text(json.dumps({"rungs": {"unit": counts}, "calls": [], "ops": []}))
    return folder


def test_merge_of_a_shard_whose_rung_broke_exits_3(tmp_path, capsys):
    a = shard_report(tmp_path / "s1", "1/2", 0, {"passed": 3})
    b = shard_report(tmp_path / "s2", "2/2", 4, {})  # its pytest refused its arguments
    assert cli_main(["ladder", "merge", str(a), str(b), "--report", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nanoqwen: ladder merge: {b}: rung unit: pytest usage error "
                                                   "(pytest exit 4): the harness broke, not a kernel"), err


def test_merge_of_a_rung_empty_in_every_shard_exits_3(tmp_path, capsys):
    shards = [shard_report(tmp_path / f"s{i}", f"{i}/2", 0, {}) for i in (1, 2)]  # each shard took its none for green
    assert cli_main(["ladder", "merge", *map(str, shards), "--report", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nanoqwen: ladder merge: rung unit: collected no test in any shard" in err, err


def test_merge_of_green_shards_exits_0_and_of_a_red_one_1(tmp_path, capsys):
    green = [shard_report(tmp_path / f"g{i}", f"{i}/2", 0, {"passed": 2}) for i in (1, 2)]
    assert cli_main(["ladder", "merge", *map(str, green), "--report", str(tmp_path / "out-green")]) == 0
    red = [green[0], shard_report(tmp_path / "r2", "2/2", 1, {"passed": 1, "failed": 1})]
    assert cli_main(["ladder", "merge", *map(str, red), "--report", str(tmp_path / "out-red")]) == 1
    assert "nanoqwen:" not in capsys.readouterr().err
