"""`nanoqwen bisect`: the first commit that turns a ladder selection red, found in a throwaway worktree.

    nanoqwen bisect --good REV [--bad REV] [--backend B] [--repo PATH] [-m MARKEXPR] [-k EXPR] [-- PYTEST ARGS]

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

Exit status: 0 when the first bad commit is found; 1 when skipped revisions leave several candidates
(they are listed); 2 for an error in the request (not a git repository, an unknown revision, GOOD not an
ancestor of BAD, GOOD not green, BAD not red), one line on stderr like the rest of the command line.

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

from ladder import git

DEFAULT_SELECTION = ("-m", "unit")
GOOD, BAD, SKIP = 0, 1, 125  # git bisect run's exit codes
VERDICT_NAMES = {GOOD: "good", BAD: "bad", SKIP: "skip"}
PYTEST_EXIT_NAMES = {0: "passed", 1: "tests failed", 2: "interrupted or collection error", 3: "internal error",
                     4: "usage error", 5: "no tests collected"}
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
    """git bisect run's exit code for a pytest exit status: good, bad, or skip (cannot be judged)."""
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
    """One revision judged: pytest's exit status, the verdict, pytest's last summary line."""

    commit: Commit
    pytest_exit: int
    verdict: int
    summary: str

    def describe(self) -> str:
        name = PYTEST_EXIT_NAMES.get(self.pytest_exit, "unknown")
        return (f"{VERDICT_NAMES[self.verdict]:<4}  {self.commit.short}  {self.commit.subject[:60]}  "
                f"(pytest exit {self.pytest_exit}, {name}: {self.summary})")


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
    """The environment with the worktree first on PYTHONPATH (and the user's checkout off it)."""
    env = git.environment()
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


def judge(worktree, repo, selection=None, backend: str | None = None, final: bool = False):
    """Run the selection on the revision checked out in `worktree`: (Step, pytest's full output)."""
    r = subprocess.run(pytest_command(worktree, selection, backend, final), cwd=worktree,
                       env=_pytest_env(worktree, repo), capture_output=True, text=True, errors="replace")
    output = r.stdout + r.stderr
    step = Step(_commit(worktree, "HEAD"), r.returncode, verdict(r.returncode), _summary_line(r.stdout or r.stderr))
    return step, output


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
    step, _ = judge(cfg["worktree"], cfg["repo"], cfg["selection"], cfg["backend"])
    payload = {"commit": [step.commit.hash, step.commit.subject, step.commit.date],
               "pytest_exit": step.pytest_exit, "verdict": step.verdict, "summary": step.summary}
    print(_MARK + json.dumps(payload), flush=True)
    return step.verdict


def _parse_step(line: str) -> Step | None:
    if not line.startswith(_MARK):
        return None
    d = json.loads(line[len(_MARK):])
    return Step(Commit(*d["commit"]), d["pytest_exit"], d["verdict"], d["summary"])


# --- the search ----------------------------------------------------------------------------------


def bisect(repo, good: str, bad: str = "HEAD", selection=None, backend: str | None = None, log=print) -> Result:
    """Find the first commit between `good` (green) and `bad` (red) where `selection` turns red.

    Runs in a temporary detached worktree of `repo`, removed before returning (also on error or
    Ctrl-C). `log` receives the progress lines. Raises BisectError for a request it cannot carry out.
    """
    top = _toplevel(repo)
    good_hash, bad_hash = _resolve(top, good, "--good"), _resolve(top, bad, "--bad")
    if good_hash == bad_hash:
        raise BisectError(f"--good {good} and --bad {bad} are the same commit ({good_hash[:10]})")
    if _git(top, "merge-base", "--is-ancestor", good_hash, bad_hash, check=False).returncode != 0:
        raise BisectError(f"--good {good} ({good_hash[:10]}) is not an ancestor of --bad {bad} ({bad_hash[:10]})")
    count = int(_git(top, "rev-list", "--count", f"{good_hash}..{bad_hash}").stdout.strip())

    tmp = Path(tempfile.mkdtemp(prefix="nanoqwen-bisect-"))
    wt = tmp / "worktree"
    proc = None
    started = added = False
    try:
        _git(top, "worktree", "add", "--quiet", "--detach", str(wt), bad_hash)
        added = True
        shown = " ".join(pytest_command("WORKTREE", selection, backend)[1:])
        log(f"nanoqwen bisect: {count} commit(s) after good {good_hash[:10]} up to bad {bad_hash[:10]}; "
            f"each revision runs: python {shown}")
        result = Result(first_bad=None)

        def check(rev_hash: str, flag: str, rev: str, want: int) -> None:
            _git(wt, "checkout", "--quiet", "--detach", rev_hash)
            step, _ = judge(wt, top, selection, backend)
            result.steps.append(step)
            log(f"  {flag:<6} {step.describe()}")
            if step.verdict == want:
                return
            what = f"{flag} {rev} ({rev_hash[:10]})"
            why = f"pytest exits {step.pytest_exit} ({PYTEST_EXIT_NAMES.get(step.pytest_exit, 'unknown')}: {step.summary})"
            if step.verdict == SKIP:
                raise BisectError(f"{what} cannot be judged: {why}")
            raise BisectError(f"{what} is {'green' if want == BAD else 'red'}, {why}; "
                              f"{flag} must be {'red' if want == BAD else 'green'}")

        check(good_hash, "--good", good, GOOD)
        check(bad_hash, "--bad", bad, BAD)

        cfg = {"worktree": str(wt), "repo": str(top), "selection": _selection(selection), "backend": backend,
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

        if result.first_bad is not None:
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
        if result.failing:
            log(f"failing there ({len(result.failing)}):")
            for name in result.failing:
                log(f"  {name}")
        else:
            log("failing there: none in the final run (a flaky test?)")
    else:
        log("skipped revisions leave several candidates; the first bad commit is one of:")
        for c in result.candidates:
            log(f"  {c.hash}  {c.subject}  ({c.date})")
    for s in result.skipped:
        log(f"skipped (cannot be judged): {s.commit.short} {s.commit.subject[:60]}: pytest exit {s.pytest_exit} "
            f"({s.summary})")


# --- the subcommand ------------------------------------------------------------------------------


def selection_of(args) -> list[str] | None:
    """The pytest selection of the command line: -m/-k, then what follows '--'; None (-m unit) if empty."""
    sel = [*(["-m", args.markexpr] if args.markexpr else []), *(["-k", args.keyword] if args.keyword else []),
           *args.pytest_args]
    return sel or None


def _run(args) -> int:
    try:
        result = bisect(args.repo, args.good, args.bad, selection_of(args), args.backend,
                        log=lambda s: print(s, flush=True))
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
                    "nanoqwen bisect --good v0.1 --bad HEAD -- -m unit -k attention")
    b.add_argument("--good", required=True, metavar="REV", help="a revision where the selection passes")
    b.add_argument("--bad", default="HEAD", metavar="REV", help="a revision where it fails (default: HEAD)")
    b.add_argument("--backend", choices=[*backend_names(), "all"], help="passed to pytest on every revision")
    b.add_argument("--repo", default=".", metavar="PATH", help="the repository (default: the current directory)")
    b.add_argument("-m", dest="markexpr", metavar="MARKEXPR", help="pytest -m (same as after '--')")
    b.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k (same as after '--')")
    b.add_argument("pytest_args", nargs="*", metavar="-- PYTEST ARGS",
                   help="the pytest selection, after '--' (default: -m unit)")
    b.set_defaults(func=_run)
