"""Self-test: a worker that dies, or a rung that makes no progress, ends its rung red in one line, never a hang.

Seen on the 2-core, 24 GB machine: a graph-rung worker grew to 12.5 GB, the kernel killed it, and the run
hung. Each case here is `nanoqwen ladder` as a user runs it (`python -m ladder ladder`, the unit rung, two
workers) on a throwaway test file under tmp_path, picked with `-- FILE -k throwaway`; `--rootdir` the
throwaway's folder gives its cases the node ids of a rung's (`ladder/unit/test_throwaway.py::...`). A case
kills its own worker with SIGKILL, as the out-of-memory killer does; or sleeps with no sign of life past a
tiny NANOQWEN_STALL_SECONDS; or reports progress through engine/progress.py past it. What is read is the
command's exit status, its stderr and its report (ladder/plugin/liveness.py, ladder/plugin/groups.py, ladder/run/runner.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ladder.run.nested import REPO, child_env, skip_inside_nested_run

pytestmark = skip_inside_nested_run

CASE = "ladder/unit/test_throwaway.py::"


def ladder(tmp_path: Path, source: str, timeout: float = 90, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """`nanoqwen ladder` on the throwaway cases of `source` alone: (its result, its seconds). A run that has
    not ended after `timeout` seconds gets SIGTERM (the ladder stops its rung's process group on its way
    out), and the test fails: it hung."""
    test = tmp_path / "ladder" / "unit" / "test_throwaway.py"
    test.parent.mkdir(parents=True)
    test.write_text("import os, signal, time\nimport pytest\n\npytestmark = pytest.mark.unit\n\n" + source)
    cmd = [sys.executable, "-m", "ladder", "ladder", "--rungs", "unit", "--backend", "numpy", "-n", "2",
           "--report", str(tmp_path / "report"), "--", "--rootdir", str(tmp_path), str(test), "-k", "throwaway"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env("numpy", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the ladder hung for {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - start


def ours(err: str, word: str) -> list[str]:
    """The command's own lines on stderr that hold `word`."""
    return [line for line in err.splitlines() if line.startswith("nanoqwen: ") and word in line]


def gone(pid: int, wait: float = 10.0) -> bool:
    """Whether process `pid` has ended: no such process, or a zombie its (killed) parent left for init to
    reap, which on a loaded machine takes a moment; polled for up to `wait` seconds."""
    end = time.monotonic() + wait
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.2)


def report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "report" / "report.json").read_text())


def test_a_worker_killed_in_a_case_ends_its_rung_red_with_one_line(tmp_path):
    r, seconds = ladder(tmp_path, """
@pytest.mark.parametrize("i", range(3))
def test_fine(i):
    pass

def test_dies():
    os.kill(os.getpid(), signal.SIGKILL)
""")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    lines = ours(r.stderr, " died ")
    assert len(lines) == 1, r.stderr[-3000:]
    line = lines[0]
    assert re.fullmatch(rf"nanoqwen: rung unit: worker gw\d+ died while running {re.escape(CASE)}test_dies: "
                        r"killed by signal 9 \(SIGKILL: .*[;:] its last resident memory \d+ [MG]B, host memory "
                        r"available [\d.]+ [MG]B of [\d.]+ GB\)", line), line
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    rep = report(tmp_path)
    assert [(f["test"], f["message"]) for f in rep["failures"]] == [(CASE + "test_dies", [line.removeprefix("nanoqwen: rung unit: ")])]
    assert rep["rungs"]["unit"]["passed"] == 3  # the other cases ran, one on the replacement worker if need be
    failed = [x for x in r.stdout.splitlines() if x.startswith(f"FAILED {CASE}test_dies")]  # the command's own list
    assert any("killed by signal 9 (SIGKILL" in x for x in failed), r.stdout[-3000:]
    print(f"dead worker: {seconds:.1f} s")


def test_a_second_dead_worker_stops_the_rung_and_says_what_did_not_run(tmp_path):
    """One replacement worker is allowed (ladder/plugin/groups.py WORKER_RESTARTS): a second death stops the run."""
    r, seconds = ladder(tmp_path, """
@pytest.mark.parametrize("i", range(2))
def test_dies(i):
    os.kill(os.getpid(), signal.SIGKILL)

@pytest.mark.parametrize("i", range(20))
def test_slow(i):
    time.sleep(0.5)
""")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    died = ours(r.stderr, " died while running ")
    assert sorted(re.sub(r".*::(test_dies\[\d\]).*", r"\1", line) for line in died) == ["test_dies[0]", "test_dies[1]"], died
    assert all("killed by signal 9 (SIGKILL" in line for line in died), died
    stopped = ours(r.stderr, "the run stopped")
    assert len(stopped) == 1 and re.fullmatch(r"nanoqwen: rung unit: 2 workers died and the run stopped: \d+ of 22 "
                                              r"tests did not run", stopped[0]), r.stderr[-3000:]
    assert seconds < 60, seconds  # twenty cases of 0.5 s did not all run
    print(f"two dead workers: {seconds:.1f} s")


def test_a_rung_with_no_progress_is_stopped_red_with_one_line(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    r, seconds = ladder(tmp_path, f"""
@pytest.mark.parametrize("i", range(2))
def test_fine(i):
    pass

def test_sleeps():
    open({str(pid_file)!r}, "w").write(str(os.getpid()))
    time.sleep(60)  # no line, no heartbeat: stalled
""", NANOQWEN_STALL_SECONDS="3")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]  # red, as a dead worker: not 3, a broken harness
    lines = ours(r.stderr, "no progress")
    assert len(lines) == 1, r.stderr[-3000:]
    assert re.fullmatch(rf"nanoqwen: rung unit: no progress for 3 s \(last: .*{re.escape(CASE)}test_sleeps.*\); stopped",
                        lines[0]), lines[0]
    assert seconds < 40, seconds  # stopped 3 s after its last sign of life, not after its 60 s sleep
    stalled = [f for f in report(tmp_path)["failures"] if f["when"] == "stalled"]
    assert [f["test"] for f in stalled] == [CASE + "test_sleeps"], report(tmp_path)["failures"]
    assert gone(int(pid_file.read_text())), "the worker that slept outlived its rung"
    print(f"stalled rung: {seconds:.1f} s")


def test_progress_lines_keep_a_slow_rung_alive_and_reach_the_user(tmp_path):
    r, seconds = ladder(tmp_path, """
from engine.progress import Progress

def test_builds_slowly():
    p = Progress("building the index", total=6, unit="steps", every=0.5)
    for i in range(6):  # 6 s, twice the stall time, with a line every second
        time.sleep(1)
        p.step(what=f"part {i}")
""", NANOQWEN_STALL_SECONDS="3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not ours(r.stderr, "no progress"), r.stderr[-3000:]
    # the worker's lines, which pytest captures, come through the progress folder to the command's stderr
    shown = re.findall(r"^\[gw\d+\] building the index: (\d)/6 steps", r.stderr, re.MULTILINE)
    assert len(shown) >= 5 and shown[-1] == "6", r.stderr[-3000:]
    print(f"slow rung with progress: {seconds:.1f} s")
