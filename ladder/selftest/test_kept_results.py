"""Self-test: a green unit rung is shown again, not rerun, on the same inputs; anything else runs it.

Each case is `nanoqwen ladder` as a user runs it (`python -m ladder ladder --rungs unit`, NumPy, no
workers) on a throwaway test under tmp_path (`-- FILE -k throwaway`, `--rootdir` its folder, as
test_dead_worker.py does), with its own NANOQWEN_CACHE and kept results switched on. The throwaway case
appends a line to a file each time it runs, so the file says how often the rung really ran
(ladder/run/kept.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ladder.run import kept
from ladder.run.nested import REPO, child_env, skip_inside_nested_run

PASSING = "def test_throwaway_counts_its_runs():\n    open({ran!r}, 'a').write('ran\\n')\n"
FAILING = PASSING + "    assert False, 'red on purpose'\n"


def _ladder(tmp_path: Path, name: str, source: str, *flags: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    test = tmp_path / "ladder" / "unit" / "test_throwaway.py"
    test.parent.mkdir(parents=True, exist_ok=True)
    body = source.format(ran=str(tmp_path / "ran.txt"))
    if not test.exists() or test.read_text()[len("import pytest\npytestmark = pytest.mark.unit\n\n"):] != body:
        test.write_text("import pytest\npytestmark = pytest.mark.unit\n\n" + body)
    cmd = [sys.executable, "-m", "ladder", "ladder", "--rungs", "unit", "--backend", "numpy", "-n", "0",
           "--report", str(tmp_path / name), *flags, "--", "--rootdir", str(tmp_path), str(test), "-k", "throwaway"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=child_env("numpy", **{"NANOQWEN_CACHE": str(tmp_path / "cache"),
                                                          "NANOQWEN_KEPT_RESULTS": "on", **env}))
    report = tmp_path / name / "report.json"
    return proc, json.loads(report.read_text()) if report.exists() else {}


def _runs(tmp_path: Path) -> int:
    ran = tmp_path / "ran.txt"
    return len(ran.read_text().splitlines()) if ran.exists() else 0


@skip_inside_nested_run
def test_a_green_unit_rung_is_shown_again_not_rerun_and_the_report_says_so(tmp_path):
    first, rep1 = _ladder(tmp_path, "r1", PASSING)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert _runs(tmp_path) == 1 and "kept" not in rep1["rungs"]["unit"]
    second, rep2 = _ladder(tmp_path, "r2", PASSING)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert _runs(tmp_path) == 1, "the kept rung ran again"
    lines = [line for line in second.stdout.splitlines() if line.startswith("nanoqwen: rung unit: kept: ")]
    assert len(lines) == 1 and "1 passed" in lines[0] and "--fresh" in lines[0], second.stdout
    unit = rep2["rungs"]["unit"]
    assert unit["passed"] == rep1["rungs"]["unit"]["passed"] == 1 and unit["exit"] == 0 and unit["kept"]["key"]
    assert (tmp_path / "r2" / "junit-unit.xml").read_text() == (tmp_path / "r1" / "junit-unit.xml").read_text()
    assert "Kept results:" in (tmp_path / "r2" / "report.md").read_text()
    assert not list((tmp_path / "cache" / "kept-results").glob(".*")), "a temporary folder was left behind"
    third, rep3 = _ladder(tmp_path, "r3", PASSING, "--fresh")
    assert third.returncode == 0 and _runs(tmp_path) == 2 and "kept" not in rep3["rungs"]["unit"]


@skip_inside_nested_run
def test_a_red_rung_is_never_kept(tmp_path):
    proc, rep = _ladder(tmp_path, "r1", FAILING)
    assert proc.returncode == 1 and rep["rungs"]["unit"]["failed"] == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert _runs(tmp_path) == 1
    assert not (tmp_path / "cache" / "kept-results").exists(), "a red rung was kept"


def test_the_sources_digest_follows_every_package_file_and_nothing_else(tmp_path):
    for pkg in kept.SOURCE_PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "a.py").write_text(f"# {pkg}\n")
    (tmp_path / "conftest.py").write_text("")
    base = kept.sources_digest(tmp_path)
    (tmp_path / "fixtures" / "__pycache__").mkdir()
    (tmp_path / "fixtures" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "README.md").write_text("not a package file\n")
    assert kept.sources_digest(tmp_path) == base
    for edit in ("kernels/a.py", "conftest.py", "fixtures/model.bin"):
        path = tmp_path / edit
        old = path.read_bytes() if path.exists() else None
        path.write_bytes((old or b"") + b"x")
        assert kept.sources_digest(tmp_path) != base, edit
        path.write_bytes(old) if old is not None else path.unlink()
    assert kept.sources_digest(tmp_path) == base


def _args(**kw) -> argparse.Namespace:
    base = dict(backend="numpy", require_backend=None, quant="all", model_files=[], prompts=None, new_tokens=None,
                launch_flags=[], plant_fault=None, shard=None, changed=None, hypothesis_profile=None, fresh=False)
    return argparse.Namespace(**{**base, **kw})


def test_the_key_follows_options_variables_and_named_files_not_where_files_go(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOQWEN_NUMPY_THREADS", raising=False)
    named = tmp_path / "test_mine.py"
    named.write_text("def test_a(): pass\n")

    def digest(**kw):
        return kept.key(_args(**kw), "unit", [str(named), "-k", "a"], REPO, {"numpy": "2"})["digest"]

    base = digest()
    assert digest() == base
    assert digest(backend="cuda") != base and digest(quant="int4_sym_g128") != base
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "elsewhere"))  # where files go: the same result
    monkeypatch.setenv("NANOQWEN_STALL_SECONDS", "5")
    assert digest() == base
    monkeypatch.setenv("NANOQWEN_NUMPY_THREADS", "1")  # read by the kernels: another key
    assert digest() != base
    monkeypatch.delenv("NANOQWEN_NUMPY_THREADS")
    named.write_text("def test_a(): assert True\n")
    assert digest() != base


def test_only_a_plain_ci_run_of_the_unit_rung_is_kept(monkeypatch):
    monkeypatch.setenv(kept.SWITCH, "on")  # the plugin turns it off for the runs the self-tests start
    assert kept.keepable(_args(), "unit")
    assert not any(kept.keepable(_args(), rung) for rung in ("layer", "graph"))
    for kw in (dict(fresh=True), dict(plant_fault="nibble_swap"), dict(shard="1/3"), dict(changed="HEAD~1"),
               dict(hypothesis_profile="nightly")):
        assert not kept.keepable(_args(**kw), "unit"), kw
    monkeypatch.setenv(kept.SWITCH, "off")
    assert not kept.keepable(_args(), "unit")
