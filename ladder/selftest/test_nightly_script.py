"""`.ci/nightly-gpu` keeps to its night: the mutant samples get the time the ladder leaves.

The nightly's steps are commands of their own (the ladder, the GPU self-tests, two `nanoqwen mutate`
samples, the sanitizers); the script's own logic is the order, the exit status and the time each sample
gets. Here a stand-in `python3` on PATH records each command it is asked to run and succeeds (or fails,
for the step a case names), so the script runs anywhere in a second and the cases read what it asked for:
the fixed sample gets three quarters of NIGHT_SECONDS less the ladder's time and the sanitizers' reserve,
the rotating one what is then left; with under a minute left no sample runs and the log says why; a red
ladder runs no sample; the sanitizers always run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ladder.run.nested import REPO

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the nightly is a bash script")

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$NIGHTLY_CALLS"
case "$*" in *"$NIGHTLY_FAIL"*) [ -z "$NIGHTLY_FAIL" ] || exit 1 ;; esac
case "$*" in *"-m ladder mutate"*) echo "score 95.0%: stand-in" ;; esac
exit 0
"""


def _night(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STAND_IN)
    (bin_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls"
    report = tmp_path / "report"
    report.mkdir()
    run_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NIGHTLY_CALLS": str(calls),
               "NIGHTLY_FAIL": "", **env}
    r = subprocess.run(["bash", str(REPO / ".ci" / "nightly-gpu"), str(report)], capture_output=True, text=True,
                       env=run_env, timeout=60)
    return r, calls.read_text().splitlines() if calls.exists() else []


def _within(call: str) -> int:
    words = call.split()
    return int(words[words.index("--within") + 1])


def _spent(r) -> int:
    """The seconds the script says the ladder and the self-tests took (bash counts whole seconds, so a
    stand-in night that takes none can still read 1)."""
    line = next(l for l in r.stdout.splitlines() if "of the night's" in l and "spent" in l)
    spent = int(line.split("nightly-gpu: ")[1].split(" s ")[0])
    assert spent <= 1, f"the stand-ins took {spent} s: {line}"
    return spent


def test_the_samples_share_what_the_night_leaves_three_quarters_to_the_fixed_one(tmp_path):
    r, calls = _night(tmp_path, NIGHT_SECONDS="400")
    assert r.returncode == 0, r.stderr
    mutate = [c for c in calls if "-m ladder mutate" in c]
    assert len(mutate) == 2 and "--seed 0" in mutate[0] and "--seed date" in mutate[1], calls
    # the stand-ins take no time: 400 - 40 (the sanitizers' reserve) = 360, of which 3/4 to the fixed sample
    assert _within(mutate[0]) == (400 - _spent(r) - 40) * 3 // 4
    assert 355 <= _within(mutate[1]) <= 360, "the rotating sample gets what the fixed one left"
    assert calls[-1].endswith("-m bench.sanitize"), "the sanitizers run last"


def test_under_a_minute_left_no_sample_runs_and_the_log_says_why(tmp_path):
    r, calls = _night(tmp_path, NIGHT_SECONDS="90")
    assert r.returncode == 0, r.stderr
    assert not [c for c in calls if "-m ladder mutate" in c], calls
    assert "no mutant sample" in r.stderr and "NIGHT_SECONDS" in r.stderr, r.stderr
    assert calls[-1].endswith("-m bench.sanitize")


def test_a_red_ladder_runs_no_sample_and_the_night_is_red(tmp_path):
    r, calls = _night(tmp_path, NIGHT_SECONDS="400", NIGHTLY_FAIL="-m ladder ladder")
    assert r.returncode == 1
    assert not [c for c in calls if "-m ladder mutate" in c], calls
    assert "a mutant's verdict against a red ladder means nothing" in r.stderr
    assert calls[-1].endswith("-m bench.sanitize"), "the sanitizers run on a red night too"


def test_without_a_rotating_sample_the_fixed_one_gets_it_all(tmp_path):
    r, calls = _night(tmp_path, NIGHT_SECONDS="400", ROTATING="0")
    assert r.returncode == 0, r.stderr
    mutate = [c for c in calls if "-m ladder mutate" in c]
    assert len(mutate) == 1 and _within(mutate[0]) == 400 - _spent(r) - 40, calls
