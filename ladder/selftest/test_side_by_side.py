"""Self-test: rungs run side by side are judged and reported as one after another.

`nanoqwen ladder` starts the rungs at once where a device backend runs a small model (ladder/run/workers.py
`side_by_side`; NANOQWEN_SIDE_BY_SIDE=on forces it, here on NumPy). What must not change: the rungs'
output in ladder order, each under its header; the report's rungs in ladder order; a red rung stopping
the rungs after it (their processes too) unless --keep-going, and their results left out; nothing left
in the report folder. Each case runs throwaway tests of each rung, which meet through files, so a case
proves the rungs ran at the same time without timing anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ladder.run.nested import child_env, skip_inside_nested_run

REPO = Path(__file__).resolve().parents[2]
HEADER = "import os, time\nfrom pathlib import Path\nimport pytest\n\nMEET = Path({meet!r})\n\n"


def meet_source(rung: str, body: str) -> str:
    return f"@pytest.mark.{rung}\ndef test_throwaway_{rung}():\n" + "".join(f"    {line}\n" for line in body.strip().splitlines())


def wait_for(name: str, seconds: float = 60) -> str:
    """Body lines: wait up to `seconds` for MEET/name (written by a rung beside this one)."""
    return (f"end = time.monotonic() + {seconds}\n"
            f"while not (MEET / {name!r}).exists():\n"
            f"    assert time.monotonic() < end, 'no {name} after {seconds} s: the rungs did not run side by side'\n"
            f"    time.sleep(0.1)\n")


def ladder(tmp_path: Path, bodies: dict[str, str], *args: str, extra: tuple = (), timeout: float = 120, **env: str):
    """`nanoqwen ladder` on NumPy, its rungs side by side, on one throwaway test per rung (`bodies`)."""
    meet = tmp_path / "meet"
    meet.mkdir()
    tests = []
    for rung, body in bodies.items():  # each in its rung's folder: the rungs' tables go by folder
        tests.append(tmp_path / "ladder" / rung / f"test_throwaway_{rung}.py")
        tests[-1].parent.mkdir(parents=True)
        tests[-1].write_text(HEADER.format(meet=str(meet)) + meet_source(rung, body))
    cmd = [sys.executable, "-m", "ladder", "ladder", "--rungs", ",".join(bodies), "--backend", "numpy", "-n", "0",
           "--report", str(tmp_path / "report"), *args, "--", "--rootdir", str(tmp_path), *map(str, tests),
           "-k", "throwaway", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env("numpy", **{"NANOQWEN_SIDE_BY_SIDE": "on", **env}),
                          capture_output=True, text=True, timeout=timeout)
    rep = tmp_path / "report" / "report.json"
    return proc, json.loads(rep.read_text()) if rep.exists() else None


def leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "report").iterdir() if p.name.startswith("."))


@skip_inside_nested_run
@pytest.mark.long  # 9 to 30 s on CI's 2 cores: started first, not left to end the suite alone
def test_rungs_side_by_side_are_reported_in_ladder_order(tmp_path):
    # unit and graph each wait for the other: green only if they ran at the same time
    proc, rep = ladder(tmp_path, {
        "unit": "(MEET / 'unit').touch()\n" + wait_for("graph") + "print('UNIT OUTPUT')",
        "layer": "print('LAYER OUTPUT')",
        "graph": "(MEET / 'graph').touch()\n" + wait_for("unit") + "print('GRAPH OUTPUT')",
    }, extra=("-s",), NANOQWEN_PROGRESS_SECONDS="0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # a later rung's stdout is printed when its turn comes; its progress lines reach the user as they come
    assert "rung graph: [nanoqwen] 1 of 1 tests in " in proc.stderr, proc.stderr[-3000:]
    assert "rung unit: [nanoqwen]" not in proc.stderr  # the first rung's own stdout is live
    out = proc.stdout
    assert out.startswith("nanoqwen: rungs side by side (unit, layer and graph each in one process; "
                          "NANOQWEN_SIDE_BY_SIDE=on)"), out[:500]
    marks = ["[1/3] rung unit\n", "UNIT OUTPUT", "[2/3] rung layer (ran beside the rungs before it)", "LAYER OUTPUT",
             "[3/3] rung graph (ran beside the rungs before it)", "GRAPH OUTPUT", "rungs: side by side in ",
             "\nladder: "]  # the whole run's wall time, last but one
    where = [out.find(m) for m in marks]
    assert all(w >= 0 for w in where) and where == sorted(where), (where, out[-3000:])
    assert list(rep["rungs"]) == ["unit", "layer", "graph"] and all(r["exit"] == 0 for r in rep["rungs"].values())
    assert rep["meta"]["side_by_side"]["rungs"] == ["unit", "layer", "graph"]
    assert rep["meta"]["seconds"] >= rep["meta"]["side_by_side"]["seconds"]
    assert f"ladder: {rep['meta']['seconds']:.1f} s of wall time, from the start to the report\n" in out
    assert leftovers(tmp_path) == [], leftovers(tmp_path)


@skip_inside_nested_run
def test_a_red_rung_stops_the_rungs_beside_it_and_leaves_them_out(tmp_path):
    # the graph rung would wait two minutes for a file nobody writes: the run ends long before, or it hung
    proc, rep = ladder(tmp_path, {
        "unit": wait_for("graph") + "assert False, 'planted red'",
        "layer": "(MEET / 'layer').touch()",
        "graph": "(MEET / 'graph').touch()\n" + wait_for("never", 120),
    }, timeout=100)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nanoqwen: rung unit is red; stopping (--keep-going runs the rest)" in proc.stderr
    assert "[2/3] rung layer" not in proc.stdout and "[3/3] rung graph" not in proc.stdout, proc.stdout[-3000:]
    assert list(rep["rungs"]) == ["unit"] and rep["meta"]["result"] == "FAILED"
    assert leftovers(tmp_path) == [], leftovers(tmp_path)


@skip_inside_nested_run
@pytest.mark.long  # 9 to 30 s on CI's 2 cores: started first, not left to end the suite alone
def test_keep_going_side_by_side_reports_every_rung(tmp_path):
    proc, rep = ladder(tmp_path, {
        "unit": wait_for("graph") + "assert False, 'planted red'",
        "graph": "(MEET / 'graph').touch()",
    }, "--keep-going")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(rep["rungs"]) == ["unit", "graph"]
    assert rep["rungs"]["unit"]["exit"] == 1 and rep["rungs"]["graph"]["exit"] == 0
    assert "[2/2] rung graph (ran beside the rungs before it)" in proc.stdout


@skip_inside_nested_run
def test_a_bad_side_by_side_setting_is_one_line_and_exit_2(tmp_path):
    proc, rep = ladder(tmp_path, {"unit": "pass", "graph": "pass"}, NANOQWEN_SIDE_BY_SIDE="sometimes")
    assert proc.returncode == 2 and rep is None, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "NANOQWEN_SIDE_BY_SIDE='sometimes': expected on or off" in lines[0], proc.stderr


@pytest.mark.parametrize("rungs", [["unit"], ["graph"]])
def test_a_single_rung_is_never_side_by_side(rungs, monkeypatch):
    from ladder.run.workers import side_by_side

    monkeypatch.setenv("NANOQWEN_SIDE_BY_SIDE", "on")
    assert side_by_side(rungs, {"graph": 4}, None, ["cuda"], 16) == (None, None)
