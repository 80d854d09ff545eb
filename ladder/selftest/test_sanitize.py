"""Self-test: `python -m bench.sanitize`, the CUDA sanitizer script, on a machine without a GPU.

Its run needs compute-sanitizer and a GPU; what runs anywhere is checked here. `--help` prints the
options with their defaults and starts nothing; a bad tool is one line and exit 2 before anything
starts; a sanitizer that flags nothing fails the run (a blind sanitizer cannot pass). The op sweep it
runs under each tool (ladder/tools/opsweep.py: the unit rung's op checks on explicit inputs) passes on the
NumPy backend in a process where pytest and Hypothesis cannot be imported: the script needs neither.
bench/ is a leaf, so it is run, never imported, here.
"""

from __future__ import annotations

import subprocess
import sys

from ladder.run.nested import REPO, child_env

FAKE = """#!/bin/sh
echo "$@" >> "{log}"
"""  # a compute-sanitizer that runs nothing and reports nothing, and notes each call


def sanitize(args: list[str], tmp_path, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -m bench.sanitize ARGS` with a fake compute-sanitizer first on PATH (calls noted in calls.log)."""
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(FAKE.format(log=tmp_path / "calls.log"))
    fake.chmod(0o755)
    env = child_env(None, PATH=f"{fake.parent}:{child_env(None)['PATH']}")
    return subprocess.run([sys.executable, "-m", "bench.sanitize", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_shows_the_options_and_their_defaults_and_starts_nothing(tmp_path):
    r = sanitize(["--help"], tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    words = " ".join(r.stdout.split())  # argparse wraps the help to the terminal
    assert "--tools" in words and "(default: memcheck,racecheck,initcheck)" in words, r.stdout
    assert "compute-sanitizer:" not in r.stdout  # the run's first line
    assert not (tmp_path / "calls.log").exists(), "--help started the sanitizer"


def test_an_unknown_tool_is_one_line_and_exit_2_before_anything_starts(tmp_path):
    r = sanitize(["--tools", "memcheck,cosmiccheck"], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "bench.sanitize: error: unknown tool(s) cosmiccheck; known: memcheck, racecheck, initcheck"], r.stderr
    assert not (tmp_path / "calls.log").exists()


def test_a_sanitizer_that_flags_nothing_fails_the_run(tmp_path):
    r = sanitize(["--tools", "memcheck"], tmp_path)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "planted planted_oob under memcheck: NOT flagged" in r.stdout
    assert "the sanitizer missed a planted bug" in r.stdout and "sanitize: PASS" not in r.stdout
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 1 and "--tool memcheck" in calls[0] and "--child planted_oob" in calls[0], calls


BLOCKED = """
import sys
sys.modules["pytest"] = sys.modules["hypothesis"] = None  # any import of either fails
from ladder.tools.opsweep import main
sys.exit(main(["--backend", "numpy"]))
"""


def test_its_op_sweep_passes_on_numpy_without_pytest_or_hypothesis():
    """The sweep it runs under each tool (ladder/tools/opsweep.py, also `nanoqwen mutate`'s second look)."""
    r = subprocess.run([sys.executable, "-c", BLOCKED], cwd=REPO, env=child_env("numpy"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.splitlines()[-1:] == ["SANITIZE-CHILD-DONE"], (r.stdout + r.stderr)[-3000:]
