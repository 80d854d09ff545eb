"""`nanoqwen bisect`: the first commit that turns a ladder selection red, found in a throwaway worktree.

    nanoqwen bisect --good REV [--bad REV] [--backend B] [--repo PATH] [-m MARKEXPR] [-k EXPR] [-- PYTEST ARGS]
    nanoqwen bisect --baseline REPORT_DIR [--good REV] [--bad REV] [--backend B] [--repo PATH] [-- LADDER ARGS]

The user's checkout is never touched: the search runs in a detached `git worktree` in a temporary
folder, where `git bisect start BAD GOOD` and `git bisect run` judge each revision with

    python -m pytest SELECTION -x -q -p no:cacheprovider --rootdir WORKTREE [--backend B]

run from the worktree with the worktree first on PYTHONPATH, so every revision runs its own code.
SELECTION is what follows `--` (plus `-m`/`-k` given before it); nothing at all means `-m unit`.

pytest's exit status becomes git bisect's verdict (`verdict()`): 0 (passed) is good, 1 (tests failed)
is bad, and 5 (no tests collected), 2 (a collection error, or interrupted), 3 (internal error) and 4
(usage error) are "skip": that revision cannot be judged either way. GOOD must be green and BAD red
before the search starts; otherwise it refuses in one line. At the end it prints the first bad commit
(hash, subject, author date) and the tests that fail there (a final `pytest -rfE` run on that commit,
without -x), then ends the bisect and removes the worktree, also after an error or Ctrl-C.

With `--baseline REPORT_DIR` the judge is the ladder itself, so a regression that leaves every test
green (an op's error multiple grown past its limit) can be bisected: each revision runs

    python -m ladder ladder --baseline REPORT_DIR --report TMP [--backend B] [LADDER ARGS]

from the worktree (LADDER ARGS: what follows `--`, e.g. `--rungs unit --backend numpy --quant
int4_sym_g128`), and the ladder's exit status is the verdict: 0 (green) good, 1 (red, or regressed
against the baseline) bad, anything else (2 bad input, 3 the harness broke) skip. GOOD defaults to the
commit the baseline report records (report.json's meta.commit). The same worktree, the same steps;
only the command that judges a revision differs (`judge()`), and the first bad commit's regressions and
failures are read from the report its own step wrote, with no final run.

Exit status: 0 when the first bad commit is found; 1 when skipped revisions leave several candidates
(they are listed); 2 for an error in the request (not a git repository, an unknown revision, GOOD not an
ancestor of BAD, GOOD not green, BAD not red, a baseline that is no report or records no commit when
--good is left out), one line on stderr like the rest of the command line.

This module imports only the standard library: `git bisect run` starts a small script that imports it
from this checkout (not from the revision under test) to judge each revision.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ladder.changes import git

DEFAULT_SELECTION = ("-m", "unit")
GOOD, BAD, SKIP = 0, 1, 125  # git bisect run's exit codes
VERDICT_NAMES = {GOOD: "good", BAD: "bad", SKIP: "skip"}
PYTEST_EXIT_NAMES = {0: "passed", 1: "tests failed", 2: "interrupted or collection error", 3: "internal error",
                     4: "usage error", 5: "no tests collected"}
LADDER_EXIT_NAMES = {0: "green", 1: "red or regressed", 2: "bad input", 3: "the harness broke"}  # ladder/run/runner.py
EXIT_NAMES = {"pytest": PYTEST_EXIT_NAMES, "ladder": LADDER_EXIT_NAMES}
_MARK = "nanoqwen-bisect-step "  # prefix of the line the step script prints for each revision

# Started by `git bisect run` in the worktree. It imports this module from the user's checkout (the
# path is in the config), never from the revision under test, and turns any crash of its own into
# 255, which stops the bisect instead of passing for a verdict.
_STEP_SCRIPT = '''\
"""nanoqwen bisect: judge the revision checked out in the worktree (run by git bisect run)."""
import json, sys, traceback
try:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    sys.path.insert(0, cfg["ladder_root"])
    from ladder.tools.bisect import _step_main
    code = _step_main(cfg)
except BaseException:
    traceback.print_exc()
    code = 255
sys.exit(code)
'''


class BisectError(Exception):
    """A request `nanoqwen bisect` cannot carry out; the message is one line for stderr."""


def verdict(pytest_exit: int) -> int:
    """git bisect run's exit code for a pytest (or `nanoqwen ladder`) exit status: good, bad, or skip
    (cannot be judged). Both commands mean the same by 0 and 1; anything else is a run that judged nothing."""
    if pytest_exit == 0:
        return GOOD
    if pytest_exit == 1:
        return BAD
    return SKIP


@dataclass(frozen=True)
class Commit:
    hash: str
    subject: str
    date: str  # author date, ISO

    @property
    def short(self) -> str:
        return self.hash[:10]


@dataclass(frozen=True)
class Step:
    """One revision judged: the judging command's exit status, the verdict, its summary line; `tool` is
    the command that judged (pytest, or the ladder under --baseline)."""

    commit: Commit
    pytest_exit: int
    verdict: int
    summary: str
    tool: str = "pytest"

    @property
    def exit_name(self) -> str:
        return EXIT_NAMES[self.tool].get(self.pytest_exit, "unknown")

    def describe(self) -> str:
        return (f"{VERDICT_NAMES[self.verdict]:<4}  {self.commit.short}  {self.commit.subject[:60]}  "
                f"({self.tool} exit {self.pytest_exit}, {self.exit_name}: {self.summary})")


@dataclass
class Result:
    first_bad: Commit | None  # None when skipped revisions leave several candidates
    candidates: list[Commit] = field(default_factory=list)  # the first bad is one of these (first_bad unset)
    failing: list[str] = field(default_factory=list)  # tests that fail on first_bad
    steps: list[Step] = field(default_factory=list)  # every revision judged, in order (GOOD and BAD first)

    @property
    def skipped(self) -> list[Step]:
        return [s for s in self.steps if s.verdict == SKIP]


# --- git -----------------------------------------------------------------------------------------


def _git(cwd, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return git.run(cwd, *args, check=check, error=BisectError)


def _commit(cwd, rev: str) -> Commit:
    out = _git(cwd, "show", "-s", "--format=%H%x00%s%x00%ad", "--date=iso", rev).stdout.strip()
    h, subject, date = out.split("\x00", 2)
    return Commit(h, subject, date)


def _toplevel(repo) -> Path:
    path = Path(repo)
    if not path.is_dir():
        raise BisectError(f"{repo}: no such directory")
    r = _git(path, "rev-parse", "--show-toplevel", check=False)
    if r.returncode != 0:
        raise BisectError(f"{path.resolve()} is not inside a git repository")
    return Path(r.stdout.strip())


def _resolve(top: Path, rev: str, flag: str) -> str:
    r = _git(top, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}", check=False)
    if r.returncode != 0 or not r.stdout.strip():
        raise BisectError(f"{flag} {rev}: unknown revision (not a commit of {top})")
    return r.stdout.strip()


# --- judging one revision ------------------------------------------------------------------------


def _selection(selection) -> list[str]:
    return list(DEFAULT_SELECTION) if selection is None else list(selection)


def pytest_command(worktree, selection=None, backend: str | None = None, final: bool = False) -> list[str]:
    """The pytest command that judges a revision (final: the report run, every failure, no -x)."""
    cmd = [sys.executable, "-m", "pytest", *_selection(selection)]
    cmd += ["-q", "-rfE"] if final else ["-x", "-q"]
    cmd += ["-p", "no:cacheprovider", "--rootdir", str(worktree)]
    if backend:
        cmd += ["--backend", backend]
    return cmd


def _pytest_env(worktree, repo) -> dict:
    """The environment with the worktree first on PYTHONPATH (and the user's checkout off it), and no
    bytecode written there. The worktree's files change from revision to revision in place, and a cached
    .pyc (Python's, or pytest's rewritten test module) is reused when its source has the same size and the
    same mtime to the second: a revision checked out within a second of the last one's run, with an edit
    that keeps the size (`assert x == 1` -> `assert x == 2`), ran the revision before's code and got its
    verdict. Every revision compiles its own sources instead."""
    env = git.environment()
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    skip = {os.path.normcase(os.path.realpath(p)) for p in (worktree, repo)}
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.normcase(os.path.realpath(p)) not in skip]
    env["PYTHONPATH"] = os.pathsep.join([str(worktree), *rest])
    return env


def _summary_line(output: str) -> str:
    for line in reversed(output.splitlines()):
        line = line.strip().strip("=!").strip()
        if line:
            return line
    return "no output"


def ladder_command(report, baseline, ladder_args=None, backend: str | None = None) -> list[str]:
    """The ladder run that judges a revision under --baseline; run from the worktree, it is that
    revision's own ladder (`python -m ladder` finds the worktree's package first)."""
    cmd = [sys.executable, "-m", "ladder", "ladder", "--baseline", str(baseline), "--report", str(report)]
    if backend:
        cmd += ["--backend", backend]
    return cmd + list(ladder_args or [])


def ladder_findings(report) -> list[str]:
    """The regressions, then the failing tests, that a ladder run's report.json records ([] without one)."""
    try:
        rep = json.loads((Path(report) / "report.json").read_text())
    except (OSError, ValueError):
        return []
    found = [str(r) for r in rep.get("regressions") or []]
    for f in rep.get("failures") or []:  # a record (a dict with its test) or, in older reports, the node id
        name = str(f.get("test") if isinstance(f, dict) else f)
        if name not in found:
            found.append(name)
    return found


def _ladder_summary(report, r: subprocess.CompletedProcess) -> str:
    """A ladder run in one line: its first finding, else its own last `nanoqwen:` line, else green."""
    found = ladder_findings(report)
    if found:
        return found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
    own = [line for line in r.stderr.splitlines() if line.startswith("nanoqwen:")]
    if own:
        return own[-1]
    return "green" if r.returncode == 0 else _summary_line(r.stdout or r.stderr)


def judge(worktree, repo, selection=None, backend: str | None = None, final: bool = False,
          baseline: str | None = None, reports=None):
    """Judge the revision checked out in `worktree`: (Step, the judging command's full output).

    By default pytest runs `selection`. With `baseline` (a report folder) the ladder runs instead, with
    `selection` as its arguments, and writes its report to `reports`/COMMIT, where the search reads the
    first bad commit's findings (`final` asks nothing more of it)."""
    commit = _commit(worktree, "HEAD")
    report = None
    if baseline is None:
        cmd = pytest_command(worktree, selection, backend, final)
    else:
        report = Path(reports) / commit.hash
        shutil.rmtree(report, ignore_errors=True)  # a revision judged twice: only this run's report counts
        cmd = ladder_command(report, baseline, selection, backend)
    r = subprocess.run(cmd, cwd=worktree, env=_pytest_env(worktree, repo), capture_output=True, text=True,
                       errors="replace")
    if report is None:
        step = Step(commit, r.returncode, verdict(r.returncode), _summary_line(r.stdout or r.stderr))
    else:
        step = Step(commit, r.returncode, verdict(r.returncode), _ladder_summary(report, r), "ladder")
    return step, r.stdout + r.stderr


def failing_tests(output: str) -> list[str]:
    """Node ids from pytest's short summary (`FAILED id - message`, `ERROR id - message`)."""
    names = []
    for line in output.splitlines():
        m = re.match(r"(FAILED|ERROR) (.+?)(?: - .*)?$", line)
        if m and m.group(2) not in names:
            names.append(m.group(2))
    return names


def _step_main(cfg: dict) -> int:
    """The step script's body: judge HEAD of the worktree, print one tagged line, return the verdict."""
    step, _ = judge(cfg["worktree"], cfg["repo"], cfg["selection"], cfg["backend"], baseline=cfg.get("baseline"),
                    reports=cfg.get("reports"))
    payload = {"commit": [step.commit.hash, step.commit.subject, step.commit.date],
               "pytest_exit": step.pytest_exit, "verdict": step.verdict, "summary": step.summary, "tool": step.tool}
    print(_MARK + json.dumps(payload), flush=True)
    return step.verdict


def _parse_step(line: str) -> Step | None:
    if not line.startswith(_MARK):
        return None
    d = json.loads(line[len(_MARK):])
    return Step(Commit(*d["commit"]), d["pytest_exit"], d["verdict"], d["summary"], d.get("tool", "pytest"))


# --- the search ----------------------------------------------------------------------------------


def baseline_report(baseline) -> tuple[str, dict]:
    """The --baseline folder, absolute (each revision's ladder runs from the worktree), and its report."""
    from ladder.run.report import load  # the ladder's own reading of a report folder, as `ladder --baseline` uses

    folder = Path(baseline).expanduser().resolve()
    try:
        rep = load(folder)
    except (OSError, ValueError) as e:
        raise BisectError(f"--baseline {baseline}: {e}") from None
    if not isinstance(rep, dict):
        raise BisectError(f"--baseline {baseline}: report.json is not a ladder report")
    return str(folder), rep


def bisect(repo, good: str | None, bad: str = "HEAD", selection=None, backend: str | None = None, log=print,
           baseline: str | None = None) -> Result:
    """Find the first commit between `good` (green) and `bad` (red) where `selection` turns red.

    With `baseline` (a ladder report folder) the ladder judges each revision against it, `selection`
    being the ladder's arguments; `good` then defaults to the commit that report records.
    Runs in a temporary detached worktree of `repo`, removed before returning (also on error or
    Ctrl-C). `log` receives the progress lines. Raises BisectError for a request it cannot carry out.
    """
    top = _toplevel(repo)
    if baseline is not None:
        taken = [a for a in selection or [] if a.split("=", 1)[0] in ("--report", "--baseline")]
        if taken:
            raise BisectError(f"{taken[0]} after '--': with --baseline, bisect gives each revision's ladder its "
                              f"own --report and the --baseline folder")
        baseline, report = baseline_report(baseline)
        if good is None:
            good = (report.get("meta") or {}).get("commit")
            if not good:
                raise BisectError(f"--baseline {baseline}: its report records no commit; give --good REV")
    elif good is None:
        raise BisectError("give --good REV (or --baseline REPORT_DIR, whose report records its commit)")
    good_hash, bad_hash = _resolve(top, good, "--good"), _resolve(top, bad, "--bad")
    if good_hash == bad_hash:
        raise BisectError(f"--good {good} and --bad {bad} are the same commit ({good_hash[:10]})")
    if _git(top, "merge-base", "--is-ancestor", good_hash, bad_hash, check=False).returncode != 0:
        raise BisectError(f"--good {good} ({good_hash[:10]}) is not an ancestor of --bad {bad} ({bad_hash[:10]})")
    count = int(_git(top, "rev-list", "--count", f"{good_hash}..{bad_hash}").stdout.strip())

    tmp = Path(tempfile.mkdtemp(prefix="nanoqwen-bisect-"))
    wt = tmp / "worktree"
    reports = tmp / "reports"  # under --baseline: each revision's ladder report, reports/COMMIT
    ladder_args = list(selection or []) if baseline else None
    proc = None
    started = added = False
    try:
        _git(top, "worktree", "add", "--quiet", "--detach", str(wt), bad_hash)
        added = True
        shown = " ".join((ladder_command("TMP", baseline, ladder_args, backend) if baseline
                          else pytest_command("WORKTREE", selection, backend))[1:])
        log(f"nanoqwen bisect: {count} commit(s) after good {good_hash[:10]} up to bad {bad_hash[:10]}; "
            f"each revision runs: python {shown}")
        result = Result(first_bad=None)

        def check(rev_hash: str, flag: str, rev: str, want: int) -> None:
            _git(wt, "checkout", "--quiet", "--detach", rev_hash)
            step, _ = judge(wt, top, ladder_args if baseline else selection, backend, baseline=baseline, reports=reports)
            result.steps.append(step)
            log(f"  {flag:<6} {step.describe()}")
            if step.verdict == want:
                return
            what = f"{flag} {rev} ({rev_hash[:10]})"
            why = f"{step.tool} exits {step.pytest_exit} ({step.exit_name}: {step.summary})"
            if step.verdict == SKIP:
                raise BisectError(f"{what} cannot be judged: {why}")
            raise BisectError(f"{what} is {'green' if want == BAD else 'red'}, {why}; "
                              f"{flag} must be {'red' if want == BAD else 'green'}")

        check(good_hash, "--good", good, GOOD)
        check(bad_hash, "--bad", bad, BAD)

        cfg = {"worktree": str(wt), "repo": str(top), "backend": backend, "baseline": baseline, "reports": str(reports),
               "selection": ladder_args if baseline else _selection(selection),
               "ladder_root": str(Path(__file__).resolve().parents[2])}
        (tmp / "step.json").write_text(json.dumps(cfg))
        (tmp / "step.py").write_text(_STEP_SCRIPT)
        _git(wt, "bisect", "start", bad_hash, good_hash, "--")
        started = True
        proc = subprocess.Popen(["git", "bisect", "run", sys.executable, str(tmp / "step.py"), str(tmp / "step.json")],
                                cwd=wt, env=git.environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=(os.name == "posix"))
        lines = []
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            step = _parse_step(line)
            if step is not None:
                result.steps.append(step)
                log(f"  [{len(result.steps) - 2}]    {step.describe()}")
            elif line.startswith("Bisecting:"):
                log(f"  {line}")
        code = proc.wait()
        proc = None
        text = "\n".join(lines)
        if "is the first bad commit" in text:
            first = _git(wt, "rev-parse", "--verify", "refs/bisect/bad").stdout.strip()
            result.first_bad = _commit(wt, first)
        elif "could be any of" in text:
            after = text.split("could be any of:", 1)[1].splitlines()
            hashes = [s.strip() for s in after if re.fullmatch(r"[0-9a-f]{40}", s.strip())]
            result.candidates = [_commit(wt, h) for h in hashes]
        else:
            tail = "; ".join(s for s in lines[-3:] if s.strip()) or f"exit {code}"
            raise BisectError(f"git bisect run stopped without an answer: {tail}")
        _git(wt, "bisect", "reset", "--quiet", check=False)
        started = False

        if result.first_bad is not None and baseline:  # its step's own report says what regressed there
            result.failing = ladder_findings(reports / result.first_bad.hash)
        elif result.first_bad is not None:
            _git(wt, "checkout", "--quiet", "--detach", result.first_bad.hash)
            _, output = judge(wt, top, selection, backend, final=True)
            result.failing = failing_tests(output)
        _report(result, log)
        return result
    finally:
        if proc is not None:  # interrupted: stop git bisect run and the pytest it started
            try:
                if os.name == "posix":
                    os.killpg(proc.pid, signal.SIGTERM)
                else:
                    proc.terminate()
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                if os.name == "posix":
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait()
        if started:
            _git(wt, "bisect", "reset", "--quiet", check=False)
        removed = added and _git(top, "worktree", "remove", "--force", str(wt), check=False).returncode == 0
        shutil.rmtree(tmp, ignore_errors=True)
        if added and not removed:  # the folder is gone now; drop git's record of it
            _git(top, "worktree", "prune", check=False)


def _report(result: Result, log) -> None:
    log("")
    if result.first_bad is not None:
        c = result.first_bad
        log(f"first bad commit: {c.hash}")
        log(f"  subject: {c.subject}")
        log(f"  date:    {c.date}")
        what = "regressed or failing there" if result.steps and result.steps[0].tool == "ladder" else "failing there"
        if result.failing:
            log(f"{what} ({len(result.failing)}):")
            for name in result.failing:
                log(f"  {name}")
        else:
            log(f"{what}: none in the final run (a flaky test?)")
    else:
        log("skipped revisions leave several candidates; the first bad commit is one of:")
        for c in result.candidates:
            log(f"  {c.hash}  {c.subject}  ({c.date})")
    for s in result.skipped:
        log(f"skipped (cannot be judged): {s.commit.short} {s.commit.subject[:60]}: {s.tool} exit {s.pytest_exit} "
            f"({s.exit_name}: {s.summary})")


# --- the subcommand ------------------------------------------------------------------------------


def selection_of(args) -> list[str] | None:
    """The pytest selection of the command line: -m/-k, then what follows '--'; None (-m unit) if empty."""
    sel = [*(["-m", args.markexpr] if args.markexpr else []), *(["-k", args.keyword] if args.keyword else []),
           *args.pytest_args]
    return sel or None


def _run(args) -> int:
    try:
        if args.baseline and (args.markexpr or args.keyword):
            raise BisectError("-m/-k select pytest tests; with --baseline the arguments after '--' go to the "
                              "ladder (e.g. -- --rungs unit -- -k attention)")
        result = bisect(args.repo, args.good, args.bad, selection_of(args), args.backend,
                        log=lambda s: print(s, flush=True), baseline=args.baseline)
    except BisectError as e:
        print(f"nanoqwen: error: {e}", file=sys.stderr)
        return 2
    return 0 if result.first_bad is not None else 1


def register(subparsers) -> None:
    """Add the `bisect` subcommand to the `nanoqwen` parser's subparsers."""
    from kernels import backend_names  # the registry: a new backend needs no edit here

    b = subparsers.add_parser(
        "bisect", help="find the first commit that turns a ladder selection red (in a temporary worktree)",
        description="Find the first commit between --good and --bad where a pytest selection turns red. "
                    "Runs git bisect in a temporary worktree; the checkout is not touched. "
                    "pytest arguments go after '--' (default: -m unit), e.g. "
                    "nanoqwen bisect --good v0.1 --bad HEAD -- -m unit -k attention. "
                    "With --baseline REPORT_DIR each revision's ladder judges it against that report "
                    "(bad: it exits 1, red or regressed; good: 0; skipped: anything else), the arguments "
                    "after '--' are the ladder's, and --good defaults to the report's commit, e.g. "
                    "nanoqwen bisect --baseline reports/last-night -- --rungs unit --backend numpy")
    b.add_argument("--good", metavar="REV", help="a revision where the selection passes (with --baseline, "
                                                 "default: the commit its report records)")
    b.add_argument("--bad", default="HEAD", metavar="REV", help="a revision where it fails (default: HEAD)")
    b.add_argument("--backend", choices=[*backend_names(), "all"], help="passed to pytest on every revision")
    b.add_argument("--repo", default=".", metavar="PATH", help="the repository (default: the current directory)")
    b.add_argument("--baseline", metavar="REPORT_DIR",
                   help="judge each revision by `nanoqwen ladder --baseline REPORT_DIR` (its exit status) instead "
                        "of a pytest selection: bisects a regression against that report")
    b.add_argument("-m", dest="markexpr", metavar="MARKEXPR", help="pytest -m (same as after '--')")
    b.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k (same as after '--')")
    b.add_argument("pytest_args", nargs="*", metavar="-- PYTEST ARGS",
                   help="the pytest selection, after '--' (default: -m unit); with --baseline, the ladder's "
                        "arguments")
    b.set_defaults(func=_run)
