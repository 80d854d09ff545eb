"""Self-test: `nanoqwen bisect` finds the first red commit of a small throwaway repository.

Each repository is built in tmp_path (outside this checkout, so its pytest never sees our conftest):
a package `pkg` with `add()`, and a test file whose `test_add` goes red at one commit. Its tests do not
import torch or numpy; each bisect runs pytest a handful of times on a few lines of code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ladder.tools.bisect import BAD, GOOD, SKIP, BisectError, bisect, failing_tests, selection_of, verdict
from engine.cli import build_parser
from engine.cli import main as cli_main

REPO_ROOT = Path(__file__).resolve().parents[2]
_GIT_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY")

PKG = {"good": "def add(a, b):\n    return a + b\n",
       "bad": "def add(a, b):\n    return a - b\n",
       "broken": "def add(a, b)\n    return a + b\n"}  # a SyntaxError: collection fails, pytest exits 2
TESTS = ("import pytest\n\nfrom pkg import add\n\npytestmark = pytest.mark.unit\n\n\n"
         "def test_add():\n    assert add(2, 3) == 5\n\n\ndef test_other():\n    assert True\n")
CONFTEST = 'def pytest_configure(config):\n    config.addinivalue_line("markers", "unit: fast")\n'


def git(cwd, *args) -> str:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_VARS}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def new_repo(path: Path) -> None:
    """An empty repository at `path` (created), with a committer and no signing."""
    path.mkdir()
    git(path, "init", "-q")
    git(path, "config", "user.name", "Bisect Test")
    git(path, "config", "user.email", "bisect@example.com")
    git(path, "config", "commit.gpgsign", "false")


def commit_all(path: Path, message: str) -> str:
    """Commit everything in the work tree; the new commit's hash."""
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", message)
    return git(path, "rev-parse", "HEAD")


def make_repo(path: Path, states: list[str]) -> list[str]:
    """A repository with one commit per state ('good', 'bad', 'broken'); returns the commit hashes."""
    new_repo(path)
    (path / "pkg").mkdir()
    (path / "tests").mkdir()
    (path / "tests" / "test_pkg.py").write_text(TESTS)
    (path / "conftest.py").write_text(CONFTEST)
    hashes = []
    for i, state in enumerate(states):
        (path / "pkg" / "__init__.py").write_text(PKG[state])
        (path / "VERSION").write_text(f"{i}\n")
        hashes.append(commit_all(path, f"commit {i}: {state}"))
    return hashes


def snapshot(path: Path) -> dict:
    """What a bisect must leave as it found it: HEAD, branch, status, worktrees, bisect refs."""
    return {"head": git(path, "rev-parse", "HEAD"), "branch": git(path, "symbolic-ref", "-q", "HEAD"),
            "status": git(path, "status", "--porcelain", "--ignored"),
            "worktrees": git(path, "worktree", "list", "--porcelain"),
            "bisect_refs": git(path, "for-each-ref", "refs/bisect"),
            "files": sorted(str(p.relative_to(path)) for p in path.rglob("*") if ".git" not in p.parts)}


@pytest.fixture(autouse=True)
def _quick_pytest(monkeypatch):
    # The temporary repositories' tests need no plugin; skipping the autoloaded ones (hypothesis,
    # xdist) makes each of the handful of pytest runs start faster.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    # Bytecode written, as on most users' machines (some set this variable, some CI images among them):
    # these repositories' commits come within a second of each other with edits that keep a file's size,
    # where a cached .pyc of the revision before would pass for the next one's (bisect.py _pytest_env).
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)


@pytest.fixture(scope="module")
def linear(tmp_path_factory):
    """8 commits; test_add goes red at commit 5 (index 5) and stays red."""
    path = tmp_path_factory.mktemp("linear") / "repo"
    return path, make_repo(path, ["good"] * 5 + ["bad"] * 3)


def test_verdict_maps_pytest_exit_codes():
    assert verdict(0) == GOOD
    assert verdict(1) == BAD
    assert [verdict(c) for c in (2, 3, 4, 5)] == [SKIP] * 4


def test_failing_tests_reads_the_short_summary():
    out = ("FAILED tests/test_pkg.py::test_add - assert -1 == 5\nERROR tests/test_x.py::test_y[a b]\n"
           "FAILED tests/test_pkg.py::test_add - again\n1 failed in 0.1s\n")
    assert failing_tests(out) == ["tests/test_pkg.py::test_add", "tests/test_x.py::test_y[a b]"]


def test_command_line_selection():
    parse = build_parser().parse_args
    assert selection_of(parse(["bisect", "--good", "v0.1"])) is None  # the default, -m unit
    assert selection_of(parse(["bisect", "--good", "v0.1", "-m", "unit"])) == ["-m", "unit"]
    args = parse(["bisect", "--good", "v0.1", "--bad", "HEAD", "--", "-m", "unit", "-k", "attention"])
    assert selection_of(args) == ["-m", "unit", "-k", "attention"] and args.bad == "HEAD"


def test_bisect_names_the_first_bad_commit_and_its_failing_test(linear, tmp_path, monkeypatch):
    path, hashes = linear
    before = snapshot(path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the worktree goes
    lines = []
    result = bisect(path, hashes[0], "HEAD", log=lines.append)
    assert list(tmp_path.iterdir()) == []
    assert result.first_bad is not None and result.first_bad.hash == hashes[5]
    assert result.first_bad.subject == "commit 5: bad"
    assert result.failing == ["tests/test_pkg.py::test_add"]
    assert not result.skipped
    text = "\n".join(lines)
    assert f"first bad commit: {hashes[5]}" in text and "tests/test_pkg.py::test_add" in text
    assert snapshot(path) == before


def test_selection_is_passed_to_pytest(linear):
    path, hashes = linear
    # Only test_other runs: it never fails, so the bad end is green and the bisect refuses.
    with pytest.raises(BisectError, match=r"--bad HEAD \(\w+\) is green"):
        bisect(path, hashes[0], "HEAD", ["-k", "test_other"], log=lambda s: None)
    # An explicit empty selection runs everything (no -m unit).
    result = bisect(path, hashes[3], hashes[6], [], log=lambda s: None)
    assert result.first_bad.hash == hashes[5]


def test_a_revision_that_cannot_be_collected_is_skipped(tmp_path):
    # good, five commits whose package does not even import, good again, then red: the midpoint is
    # among the broken ones, so the bisect must skip some and still name the last commit.
    path = tmp_path / "repo"
    hashes = make_repo(path, ["good"] + ["broken"] * 5 + ["good", "bad"])
    lines = []
    result = bisect(path, hashes[0], hashes[-1], log=lines.append)
    assert result.first_bad.hash == hashes[-1]
    assert result.skipped and {s.pytest_exit for s in result.skipped} == {2}
    assert {s.commit.hash for s in result.skipped} <= set(hashes[1:6])
    assert any(line.lstrip().startswith("[") and "skip" in line for line in lines)
    assert not git(path, "worktree", "list", "--porcelain").count("worktree ") > 1


def test_an_interrupted_bisect_cleans_up(linear, tmp_path, monkeypatch):
    path, hashes = linear
    before = snapshot(path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def log(line):  # Ctrl-C while git bisect run is going, after its first verdict
        if line.lstrip().startswith("[1]"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bisect(path, hashes[0], "HEAD", log=log)
    assert list(tmp_path.iterdir()) == []
    assert snapshot(path) == before


def test_good_must_be_green(linear):
    path, hashes = linear
    before = snapshot(path)
    with pytest.raises(BisectError, match=r"^--good \S+ \(\w+\) is red, pytest exits 1 \(tests failed"):
        bisect(path, hashes[6], hashes[7], log=lambda s: None)
    assert snapshot(path) == before


def test_bad_must_be_red(linear):
    path, hashes = linear
    before = snapshot(path)
    with pytest.raises(BisectError, match=r"^--bad \S+ \(\w+\) is green, pytest exits 0"):
        bisect(path, hashes[0], hashes[3], log=lambda s: None)
    assert snapshot(path) == before


def test_a_revision_pytest_cannot_run_is_refused(linear):
    path, hashes = linear
    # This repository's pytest knows no --backend: a usage error, so the good end cannot be judged.
    with pytest.raises(BisectError, match=r"--good \S+ \(\w+\) cannot be judged: pytest exits 4 \(usage error"):
        bisect(path, hashes[0], "HEAD", backend="numpy", log=lambda s: None)


@pytest.mark.parametrize("case", ["not_a_repo", "unknown_rev", "not_ancestor", "same"])
def test_bad_requests_are_one_line_errors(linear, tmp_path, case):
    path, hashes = linear
    repo, good, bad, message = {
        "not_a_repo": (tmp_path, "HEAD~1", "HEAD", "is not inside a git repository"),
        "unknown_rev": (path, "no-such-tag", "HEAD", "--good no-such-tag: unknown revision"),
        "not_ancestor": (path, hashes[6], hashes[2], "is not an ancestor of --bad"),
        "same": (path, hashes[3], hashes[3], "are the same commit"),
    }[case]
    with pytest.raises(BisectError, match=message) as e:
        bisect(repo, good, bad, log=lambda s: None)
    assert "\n" not in str(e.value)


def test_command_line(linear):
    path, hashes = linear
    before = snapshot(path)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "ladder", "bisect", "--repo", str(path), "--good", hashes[1], "--bad", "HEAD"]
    r = subprocess.run([*cmd, "--", "-m", "unit", "-k", "add"], cwd=REPO_ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"first bad commit: {hashes[5]}" in r.stdout
    assert "subject: commit 5: bad" in r.stdout and "tests/test_pkg.py::test_add" in r.stdout
    r = subprocess.run([*cmd[:-1], hashes[2]], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("nanoqwen: error: --bad") and r.stderr.count("\n") == 1
    assert snapshot(path) == before


# --- --baseline: the ladder judges each revision against a report ----------------------------------

# A stand-in for a revision's `python -m ladder ladder`: its verdict is the revision's STATE file. It checks
# what bisect must give it (the absolute baseline folder, a --report, the arguments after `--`) and
# writes a report.json with the regression, as the real ladder does.
FAKE_LADDER = '''\
"""A stand-in for `python -m ladder ladder --baseline B --report R ...`: the revision's STATE decides."""
import json, os, sys

args = sys.argv[1:]
baseline, report = args[args.index("--baseline") + 1], args[args.index("--report") + 1]
if args[0] != "ladder" or "--rungs" not in args or not os.path.isfile(os.path.join(baseline, "report.json")):
    print(f"nanoqwen: error: not what bisect should run: {args}", file=sys.stderr)
    sys.exit(2)
state = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "STATE")).read().strip()
if state == "broken":
    print("nanoqwen: rung unit: pytest usage error (pytest exit 4): the harness broke, not a kernel", file=sys.stderr)
    sys.exit(3)
os.makedirs(report, exist_ok=True)
found = [REGRESSION] if state == "regressed" else []
with open(os.path.join(report, "report.json"), "w") as f:
    json.dump({"meta": {}, "regressions": found, "failures": []}, f)
sys.exit(1 if found else 0)
'''
REGRESSION = "unit/numpy/int4_sym_g128/rmsnorm: worst error grew from 1.2x to 9x its noise floor (> 1.5x growth)"


def make_ladder_repo(path: Path, states: list[str]) -> list[str]:
    """A repository whose `python -m ladder` is FAKE_LADDER, one commit per state ('green', 'regressed'
    (every test green, an op's error grown: exit 1), 'broken' (the harness broke: exit 3))."""
    new_repo(path)
    (path / "ladder").mkdir()
    (path / "ladder" / "__init__.py").write_text("")
    (path / "ladder" / "__main__.py").write_text(FAKE_LADDER.replace("REGRESSION", repr(REGRESSION)))
    hashes = []
    for i, state in enumerate(states):
        (path / "STATE").write_text(f"{state}\n")
        (path / "VERSION").write_text(f"{i}\n")
        hashes.append(commit_all(path, f"commit {i}: {state}"))
    return hashes


def baseline_folder(path: Path, commit: str | None) -> Path:
    """A ladder report folder whose report.json records `commit` (None: a report from before the key)."""
    path.mkdir()
    (path / "report.json").write_text(json.dumps({"meta": {"commit": commit} if commit else {}, "ops": []}))
    return path


@pytest.fixture(scope="module")
def regressing(tmp_path_factory):
    """7 commits, every test green; the op's error grows past its limit at commit 4; a baseline of commit 0."""
    root = tmp_path_factory.mktemp("regressing")
    hashes = make_ladder_repo(root / "repo", ["green"] * 4 + ["regressed"] * 3)
    return root / "repo", hashes, baseline_folder(root / "baseline", hashes[0])


def test_baseline_bisect_names_the_commit_that_regressed_against_the_report(regressing, tmp_path, monkeypatch):
    path, hashes, baseline = regressing
    before = snapshot(path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lines = []
    # no --good: the baseline report's commit is the good end
    result = bisect(path, None, "HEAD", ["--rungs", "unit"], baseline=str(baseline), log=lines.append)
    assert result.first_bad.hash == hashes[4] and result.failing == [REGRESSION]
    assert {s.tool for s in result.steps} == {"ladder"} and result.steps[0].commit.hash == hashes[0]
    text = "\n".join(lines)
    assert f"ladder --baseline {baseline} --report TMP --rungs unit" in text
    assert f"regressed or failing there (1):\n  {REGRESSION}" in text
    assert list(tmp_path.iterdir()) == [] and snapshot(path) == before


def test_baseline_bisect_skips_a_revision_whose_harness_broke(tmp_path):
    path = tmp_path / "repo"
    hashes = make_ladder_repo(path, ["green"] + ["broken"] * 4 + ["green", "regressed"])
    baseline = baseline_folder(tmp_path / "baseline", None)
    result = bisect(path, hashes[0], hashes[-1], ["--rungs", "unit"], baseline=str(baseline), log=lambda s: None)
    assert result.first_bad.hash == hashes[-1]
    assert result.skipped and {(s.tool, s.pytest_exit) for s in result.skipped} == {("ladder", 3)}
    assert all("the harness broke" in s.summary for s in result.skipped)


def test_baseline_bisect_refuses_a_good_end_that_regressed(regressing):
    path, hashes, baseline = regressing
    with pytest.raises(BisectError, match=r"^--good \S+ \(\w+\) is red, ladder exits 1 \(red or regressed: unit/numpy"):
        bisect(path, hashes[5], "HEAD", ["--rungs", "unit"], baseline=str(baseline), log=lambda s: None)


@pytest.mark.parametrize("case", ["no commit", "not a report", "-m", "--report after --"])
def test_baseline_requests_it_cannot_carry_out_are_one_line_exit_2(regressing, tmp_path, capsys, case):
    path, hashes, baseline = regressing
    argv, message = {
        "no commit": ([], "its report records no commit; give --good REV"),
        "not a report": ([], "no report.json"),
        "-m": (["-m", "unit"], "-m/-k select pytest tests"),
        "--report after --": (["--", "--report", "x"], "--report after '--'"),
    }[case]
    folder = {"no commit": baseline_folder(tmp_path / "old", None), "not a report": tmp_path}.get(case, baseline)
    assert cli_main(["bisect", "--repo", str(path), "--baseline", str(folder), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoqwen: error: ") and message in err, err
    if case == "no commit":
        assert err == f"nanoqwen: error: --baseline {folder}: its report records no commit; give --good REV\n"


def test_baseline_command_line(regressing):
    path, hashes, baseline = regressing
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "ladder", "bisect", "--repo", str(path), "--baseline", str(baseline), "--", "--rungs",
           "unit", "--backend", "numpy"]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"first bad commit: {hashes[4]}" in r.stdout and REGRESSION in r.stdout
