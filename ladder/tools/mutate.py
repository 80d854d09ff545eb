"""`nanoqwen mutate`: how many broken kernels does the ladder let through?

    nanoqwen mutate [--backend numpy|cuda] [--files PATTERN,...] [--sample N] [--seed S]
                    [--rungs unit,layer,graph] [-n WORKERS] [--timeout SECONDS] [--report DIR]
                    [--baseline DIR] [--rerun DIR] [--resume DIR] [--list] [-- PYTEST ARGS]
    nanoqwen mutate --backend cuda --same-build [--files PATTERN,...] [--sample N] [--seed S] [-n WORKERS]

First each rung runs once on the unmutated tree (it must be green) and records the launch map
(ladder/changes/launches.py): which kernel code each case launches. Then each mutant (ladder/tools/mutants.py: one
small edit to one kernel source) is written into a worker's private copy of the checkout, and the rungs
run against it on the chosen backend, cheapest first, each with `-x` and only the cases that launch the
mutated function: the first rung that goes red kills the mutant, and the rest are not run. A mutant
every rung passes survived: the ladder cannot tell that kernel from a broken one. Each worker keeps a
warm process (ladder/tools/forkserver.py) with the heavy libraries imported, which forks a child per
rung run; on CUDA the children share one kernel cache, so a mutant costs the compile of its own module.
Outcomes:

- `killed` (a rung failed, or could not collect: an import that breaks is noticed too),
- `survived`, `timed_out` (counted as detected, as a hang would be): a case ran past its own limit, 20 s
  plus three times its clean-run time, and the fork server's watchdog killed the child and named the case
  (`hung` in the record); or the rung ran past --timeout, by default 60 s plus the sum of its cases'
  limits, which only a hang outside any case reaches (with --timeout, the watchdog is off),
- `did_not_compile` (a Python mutant that no longer parses, a CUDA mutant NVRTC refuses): not scored,
- `not_launched`: no case of the rungs run launches the mutated function; not run, not scored, listed,
- `not_run`: left when the --budget of wall time was spent, or cut at its hard stop (max(60 s, budget/2)
  later; with --within W, no mutant starts after 2/3 of W and the cut comes 15 s before W, both counted
  from the command's start); not scored, counted,
- `equivalent`: on the reviewed list of ladder/tools/equivalent_mutants.json (a signature and the reason
  it cannot change any output); not run, not scored, shown in the report.

The score is (killed + timed_out) / (killed + timed_out + survived). The copies' tests run with the
nested-run mark (ladder/run/nested.py), so tests that start ladders of their own skip instead of recursing. The report
folder gets `mutate.json` and `mutate.md`: per file and per kernel function, the counts and the score;
every survivor with file:line and its edit; with `--baseline DIR`, the score change per file and the
mutants killed there that survive here, and the command exits 1 when the run is weaker than its
baseline (a mutant it detected is lost, or the score over the mutants both scored is lower): the
nightly and weekly jobs' gate. `--rerun DIR` runs only the survivors of an earlier report:
the check that a strengthened rung now kills them. `--resume DIR` runs the mutants an earlier report did
not run (cut by its --within or --budget) on the same sources, with its files, rungs, seed and sample, and
writes one report holding both runs' results: a sample larger than one job's time limit, in two jobs.
`--same-build` (nvcc, no GPU) runs no rung: it builds each chosen mutant of a .cu or .cuh source and prints
those whose every module compiles to the original's cubin byte for byte (ladder/tools/same_build.py), the
same machine code, for a person to review into the equivalents list.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.errors import NanoqwenError
from ladder.changes.launches import is_source_unit, patterns_for, select
from ladder.tools.mutate_report import _pct, compare, markdown, regressions, summarize, trend, trend_line
from ladder.tools.mutants import Mutant, compiles, mutants_of

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the project's packages
RUNGS = ("unit", "layer", "graph")
DEFAULT_RUNGS = ",".join(RUNGS)
EQUIVALENT_FILE = Path(__file__).resolve().parent / "equivalent_mutants.json"
CUDA_SOURCES = (".cu", ".cuh")  # what --same-build compiles
# What a worker's copy needs: the packages, the root conftest and the project file.
TREE = ("engine", "kernels", "ladder", "reference", "fixtures", "bench", "conftest.py", "pyproject.toml")
DEFAULT_FILES = {"numpy": ("kernels/numpy/*.py",), "cuda": ("kernels/cuda/*.cu", "kernels/cuda/*.cuh")}
START_ALLOWANCE, HANG_FACTOR = 60.0, 3.0  # the automatic timeout: 60 s + the cases' own limits (below)
CASE_ALLOWANCE = 20.0  # the watchdog: a case hangs past 20 s + 3x its clean time (the first one compiles the mutant)
# The second look at a survivor of a device backend, each part in a fresh process (the fork server's children
# share its CUDA state): first the backend's op sweep under each tool, then its unit-rung cases under each,
# with a limit of SANITIZER_FACTOR x the automatic timeout (memcheck slows a kernel 10 to 100 times).
SECOND_LOOK = ("memcheck", "racecheck")
SANITIZER_FACTOR = 4.0
# The sweep: ladder/tools/opsweep.py (the nightly's sanitizer script runs it too), every op of the backend
# once at its edges (GEMV tails, the lm_head's partial warp, attention over NaN-filled free pages) on
# explicit inputs, each its own allocation.
# Seconds under memcheck (2 to 18 s on an H200), where a survivor's unit cases can take minutes: on tree
# 476c9d6 it flagged the lm_head row clamp `V - 1 -> V - 0` (a survivor of a nightly's rotating sample whose
# cases ran out of the sample's time) and the GEMV group clamp `groups - 1 -> groups - 0` in 5 and 18 s.
SWEEP = ("-m", "ladder.tools.opsweep", "--backend")  # and the backend's name
SWEEP_LIMIT = 180.0
# seconds of --within kept for what its clock does not see or comes after the cut: the interpreter's start
# and imports, stopping the workers, writing the report (on an H200 the nightly's samples, with 5 s kept,
# ended 8 s past their --within)
WITHIN_MARGIN = 15.0


class MutateArgumentError(NanoqwenError):
    """A `nanoqwen mutate` argument that names nothing usable (one line, exit 2)."""


def kernel_files(patterns) -> list[str]:
    """The kernel sources (relative to the repository root) the patterns match."""
    found = set()
    for pattern in patterns:
        hits = [p for p in ROOT.glob(pattern) if p.is_file() and p.suffix in (".py", ".cu", ".cuh")]
        if not hits:
            raise MutateArgumentError(f"--files {pattern}: matches no Python or CUDA source of the project "
                                      f"(patterns are relative to its root, e.g. kernels/numpy/*.py)")
        found.update(str(p.relative_to(ROOT)) for p in hits)
    return sorted(found)


def load_equivalents(path: Path = EQUIVALENT_FILE) -> dict[str, str]:
    """signature -> the reviewed reason it cannot change any output."""
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())
    return {e["signature"]: e["reason"] for e in entries}


def all_mutants(files) -> list[Mutant]:
    return [m for rel in files for m in mutants_of(ROOT, rel)]


def sample(mutants: list[Mutant], n: int | None, seed: int) -> list[Mutant]:
    """`n` mutants drawn with `seed` (all of them for None), in file order."""
    if n is None or n >= len(mutants):
        return list(mutants)
    picked = random.Random(seed).sample(range(len(mutants)), n)
    return [mutants[i] for i in sorted(picked)]


# --- running one mutant ------------------------------------------------------------------------------


class MutateError(NanoqwenError):
    """The run cannot judge mutants: the rungs are red on the unmutated tree (one line, exit 2)."""


@contextlib.contextmanager
def _written(path: Path, text: str, after: str):
    """`path` holds `text` inside the block and `after` again when it ends."""
    path.write_text(text)
    try:
        yield
    finally:
        path.write_text(after)


def _rung_args(rung: str, root: Path, backend: str, extra: list[str]) -> list[str]:
    # As `nanoqwen ladder` runs a rung (ladder/run/runner.py): no configuration file, the plugin named.
    return ["-m", rung, "-q", "-c", os.devnull, "--rootdir", str(root), "--confcutdir", str(root), "-p", "ladder.plugin",
            "--strict-markers", "-p", "no:cacheprovider", "--backend", backend, *extra]


def clean_run(backend: str, rungs, jobs: int, extra: list[str], env: dict, folder: Path, log=print) -> tuple[dict, dict]:
    """Each rung once on the unmutated tree, recording the launch map (ladder/changes/launches.py). Returns (maps,
    seconds): rung -> node id -> the kernel units the case launches, and -> the seconds it took. A rung that
    is red here makes every verdict meaningless: MutateError."""
    maps, seconds = {}, {}
    for rung in rungs:
        out = folder / f"clean-{rung}.json"
        cmd = [sys.executable, "-m", "pytest", str(ROOT / "ladder" / rung), *_rung_args(rung, ROOT, backend, extra),
               "--record-launches", "--ladder-json", str(out)] + (["-n", str(jobs)] if jobs > 1 else ["-p", "no:xdist"])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode not in (0, 5):
            from ladder.run.runner import pytest_error_line

            lines = (r.stdout + r.stderr).strip().splitlines()
            # pytest's own reason where it gave one (a usage error's `unrecognized arguments: -n`, not the
            # usage line before it), else the first failed case, else the last line
            first = pytest_error_line(r.stderr) or next((ln for ln in lines if ln.startswith(("FAILED", "ERROR"))),
                                                        (lines or ["no output"])[-1])
            raise MutateError(f"the {rung} rung is red on the unmutated tree (exit {r.returncode}: {first.strip()}); "
                              f"a mutant's verdict would mean nothing")
        data = json.loads(out.read_text()) if out.exists() else {}
        maps[rung] = data.get("launches", {})
        seconds[rung] = data.get("case_seconds", {})
        log(f"clean {rung} rung: {len(maps[rung])} cases, {time.perf_counter() - t0:.0f} s (the launch map)")
    return maps, seconds


def map_from_report(folder: str, backend: str, rungs) -> tuple[dict, dict]:
    """(maps, seconds) as `clean_run` gives them, read from a green `nanoqwen ladder` report on this backend
    (the nightly's own, run a moment before on the same tree): its rung files hold the launch map and each
    case's seconds. A report that cannot stand in for a clean run is refused, one line (exit 2): red, a
    shard (a part of the cases), a planted fault, a --changed selection, another backend or model, or a
    rung that did not run or kept no map."""
    path = Path(folder).expanduser().resolve()
    try:
        meta = json.loads((path / "report.json").read_text())["meta"]
    except (OSError, ValueError, KeyError) as e:
        raise MutateArgumentError(f"--launches {folder}: not a ladder report folder ({e})") from None
    why = ("its ladder is red" if meta.get("result") != "passed" else
           f"it is shard {meta['shard']}, which maps part of the cases" if meta.get("shard") else
           "it ran with a planted fault" if meta.get("plant_fault") else
           "it ran a --changed selection" if meta.get("changed") else
           f"it ran on {', '.join(meta.get('backends') or ['?'])}, not {backend}" if backend not in (meta.get("backends") or []) else
           f"it ran on the model {meta.get('model')}, not the default" if meta.get("model") != "default" else None)
    maps, seconds = {}, {}
    for rung in rungs if why is None else ():
        try:
            data = json.loads((path / f"{rung}.json").read_text())
        except (OSError, ValueError):
            why = f"it has no {rung} rung"
            break
        if not data.get("launches"):
            why = f"its {rung} rung kept no launch map (run it with --record-launches)"
            break
        maps[rung], seconds[rung] = data["launches"], data.get("case_seconds", {})
    if why:
        raise MutateArgumentError(f"--launches {folder}: cannot stand in for the clean run: {why}")
    return maps, seconds


def copy_tree(dest: Path) -> None:
    """A private copy of the project's TREE under `dest` (no bytecode), to edit a source in."""
    for name in TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


class Worker:
    """A private copy of the tree and a warm fork server (ladder/tools/forkserver.py) started in it. A mutant is
    written into the copy, each rung runs only the cases of the launch map that launch the mutated function,
    and the file is restored."""

    def __init__(self, base: Path, index: int, backend: str, rungs, timeout: float, extra: list[str],
                 maps: dict[str, dict], seconds: dict[str, dict], env: dict, files: list[str]):
        self.dir = base / f"w{index}"
        self.files = sorted(files)  # the sources the mutants edit: the fork server must not import them
        copy_tree(self.dir)
        self.backend, self.rungs, self.timeout, self.extra, self.maps = backend, rungs, timeout, extra, maps
        self.seconds = seconds  # rung -> node id -> its seconds in the clean run (the automatic timeout)
        # NANOQWEN_NAME_CULPRIT=0: a red block is a killed mutant at its first failing assertion; the
        # search that names the op inside it (float64 op references: minutes at the 7B shape) would only
        # make a kill look like a hang to the watchdog (ladder/checks/block.py).
        self.env = {**env, "PYTHONPATH": str(self.dir), "PYTHONDONTWRITEBYTECODE": "1",
                    "HYPOTHESIS_STORAGE_DIRECTORY": str(self.dir / ".hypothesis"), "NANOQWEN_NAME_CULPRIT": "0"}
        self.log = self.dir / "rung.log"
        self.server = None
        self.stop_at = None  # perf_counter time of the run's hard stop (--budget), if any
        self.sanitizer = None  # compute-sanitizer, for the second look at a survivor (device backends)
        from kernels import backend_needs_device

        # the op sweep the second look starts with (python arguments): a device backend's
        self.sweep = (*SWEEP, backend) if backend_needs_device(backend) else None
        self._unmutated_looks: dict[tuple, bool] = {}  # (tool, argv) -> it fails under the tool unmutated too

    def _start(self):
        self.server = subprocess.Popen([sys.executable, "-m", "ladder.tools.forkserver",
                                        f"--rungs={','.join(self.rungs)}", *self.files], cwd=self.dir,
                                       env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       start_new_session=True)
        ready = self.server.stdout.readline()
        if not ready.startswith('{"ready"'):
            raise MutateError(f"the fork server of worker {self.dir.name} did not start (exit {self.server.poll()})")
        # The canary: a case of the unmutated tree must pass in a forked child, or every mutant would be
        # "killed" by the fork itself (a CUDA context made before the fork, a library that cannot fork).
        canary = next(((rung, list(self.maps[rung])[:1]) for rung in self.rungs if self.maps.get(rung)), None)
        if canary and self._ask(*canary)[0] != "passed":
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise MutateError(f"worker {self.dir.name}: {canary[1][0]} fails in a forked child of the unmutated tree "
                              f"({tail[0]})")

    def close(self):
        if self.server is not None:
            self.server.stdin.close()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
            self.server = None

    def plan(self, m: Mutant) -> list[tuple[str, list[str]]]:
        """(rung, node ids) of the cases that launch the mutated function, per rung, cheapest rung first, and
        in each test file the cheapest cases first (by their clean-run time): with `-x`, a kill comes as
        soon as any case fails, and a survivor runs them all anyway. Files keep their order, so a module's
        fixtures are set up once."""
        patterns = patterns_for(m.file, m.function, ROOT)  # the copy, unmutated between mutants, reads the same
        plan = []
        for rung in self.rungs:
            clean = self.seconds.get(rung, {})
            ids = select(self.maps.get(rung, {}), patterns)
            files = {n.split("::")[0]: i for i, n in reversed(list(enumerate(ids)))}  # a file's first place
            plan.append((rung, sorted(ids, key=lambda n: (files[n.split("::")[0]], clean.get(n, 1.0)))))
        return plan

    def run(self, m: Mutant) -> dict:
        path = self.dir / m.file
        original = path.read_text()
        mutated = m.apply(original)
        if not compiles(m.file, mutated):
            return {"outcome": "did_not_compile", "rung": None, "seconds": 0.0, "cases": 0}
        plan = self.plan(m)
        cases = sum(len(ids) for _, ids in plan)
        if not cases:  # no case of the selected rungs runs this code: nothing could see the mutant
            return {"outcome": "not_launched", "rung": None, "seconds": 0.0, "cases": 0}
        # Cases that read the file as text (`reads_source`) run for every mutant of it: one of them failing
        # kills the mutant; when they alone reach it and pass, no case ran the code: not launched, as before.
        runs_code = [p for p in patterns_for(m.file, m.function, ROOT) if not is_source_unit(p)]
        launched = any(select(self.maps.get(rung, {}), runs_code) for rung in self.rungs)
        if self.server is None or self.server.poll() is not None:
            self._start()  # before the mutant is written: the canary runs on the unmutated copy
        path.write_text(mutated)
        t0 = time.perf_counter()
        try:
            for rung, ids in plan:
                if not ids:
                    continue
                outcome, hung = self._ask(rung, ids)
                if outcome != "passed":
                    rec = {"outcome": outcome, "rung": rung, "seconds": round(time.perf_counter() - t0, 2), "cases": cases}
                    return {**rec, "hung": hung} if hung else rec
            if not launched:
                return {"outcome": "not_launched", "rung": None, "seconds": round(time.perf_counter() - t0, 2), "cases": cases}
            look = self.second_look(dict(plan).get("unit", []), unmutated=lambda: _written(path, original, mutated))
            rec = {"outcome": "survived", "rung": None, "cases": cases, **look}
            if look.get("caught_by"):
                rec.update(outcome="killed", rung="unit")
            return {**rec, "seconds": round(time.perf_counter() - t0, 2)}
        finally:
            path.write_text(original)

    def second_look(self, ids: list[str], unmutated=None) -> dict:
        """A survivor again under compute-sanitizer, in fresh processes with CuPy's memory pool off
        (ladder/tools/sanitizer.py): first a device backend's op sweep (SWEEP) under each tool of SECOND_LOOK,
        then its unit-rung cases under each: the cheap parts first. A write past an output, a read past a
        weight's last row or a missing barrier changes no value the checks compare, but the tools see it.
        {"caught_by": tool} when a tool reports an error, or a case or the sweep fails under it (an over-read
        that met real garbage instead of pooled zeros); {"second_look": what ran} otherwise; {} when there is
        no sanitizer (a host backend) or nothing to run.

        `unmutated`: a context manager factory under which the tree holds the original source. A tool's
        verdict against the mutant counts only where the same run passes under it unmutated: a case that
        cannot pass under the tool at all (one that measures CuPy's pool, which the look turns off) would
        otherwise call every survivor whose cases include it caught. Asked once per tool and run."""
        if not self.sanitizer:
            return {}
        parts = []  # (tool, "sweep" | "cases", python arguments, seconds allowed)
        if self.sweep:
            parts += [(tool, "sweep", list(self.sweep), SWEEP_LIMIT) for tool in SECOND_LOOK]
        if ids:
            argv = ["-m", "pytest", *ids,
                    *_rung_args("unit", self.dir, self.backend, ["-x", "-p", "no:xdist", *self.extra])]
            parts += [(tool, "cases", argv, SANITIZER_FACTOR * self.timeout_for("unit", ids)) for tool in SECOND_LOOK]
        looked = []
        for tool, what, argv, limit in parts:
            if self.stop_at is not None:
                limit = min(limit, self.stop_at - time.perf_counter())
                if limit <= 0:
                    break
            name = f"{tool} {what}" if self.sweep else tool  # "memcheck sweep", "memcheck cases"
            verdict = self._look(tool, argv, limit)
            if verdict is None:
                looked.append(f"{name} past {limit:.0f} s (no verdict)")
                continue
            if verdict == "clean":
                looked.append(f"{name} clean")
                continue
            if unmutated is not None and self._fails_unmutated(tool, argv, limit, unmutated):
                looked.append(f"{name}: {'it fails' if what == 'sweep' else 'the cases fail'} under it unmutated too "
                              f"(no verdict)")
                continue
            if verdict == "error":
                return {"caught_by": f"{tool}, in the op sweep" if what == "sweep" else tool}
            return {"caught_by": f"{tool} ({'the op sweep' if what == 'sweep' else 'a case'} failed under it)"}
        return {"second_look": ", ".join(looked)} if looked else {}

    def _look(self, tool: str, argv: list[str], limit: float) -> str | None:
        """`python argv` under `tool`, the pool off: "clean", "error" (the tool reported one), "failed" (a case
        or a check failed under it), or None (past `limit`)."""
        from ladder.tools.sanitizer import ERROR_EXIT, POOL_VARIABLE, command

        with open(self.log, "w") as out:
            proc = subprocess.Popen(command(self.sanitizer, tool, sys.executable, *argv, print_limit=5), cwd=self.dir,
                                    env={**self.env, POOL_VARIABLE: "0"}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return None
        if code == ERROR_EXIT:
            return "error"
        return "clean" if code in (0, 5) else "failed"

    def _fails_unmutated(self, tool: str, argv: list[str], limit: float, unmutated) -> bool:
        """Whether `python argv` also fails (or reports) under `tool` with the original source; past `limit`,
        taken as passing (the mutant's verdict stands)."""
        key = (tool, tuple(argv))
        if key not in self._unmutated_looks:
            with unmutated():
                self._unmutated_looks[key] = self._look(tool, argv, limit) not in ("clean", None)
        return self._unmutated_looks[key]

    def timeout_for(self, rung: str, ids: list[str]) -> float:
        """--timeout where given; else a start-up allowance (imports, collection) plus every case's own
        watchdog limit: only a run that hangs outside any case reaches it, and a mutant that merely slows
        its cases (a smaller cache budget, say) runs on to its verdict instead of being called a hang."""
        if self.timeout is not None:
            return self.timeout
        return START_ALLOWANCE + sum(self.case_limits(rung, ids).values())

    def case_limits(self, rung: str, ids: list[str]) -> dict[str, float] | None:
        """The watchdog's limit per case (ladder/tools/forkserver.py); none under a fixed --timeout."""
        if self.timeout is not None:
            return None
        clean = self.seconds.get(rung, {})
        return {n: CASE_ALLOWANCE + HANG_FACTOR * clean.get(n, 1.0) for n in ids}

    def _ask(self, rung: str, ids: list[str]) -> tuple[str, dict | None]:
        """(outcome of the rung run, the case the watchdog killed and after how long, if it did)."""
        args = [*ids, *_rung_args(rung, self.dir, self.backend, ["-x", "-p", "no:xdist", *self.extra])]
        timeout = self.timeout_for(rung, ids)
        if self.stop_at is not None:  # the run's hard stop (--budget): what is cut there was not run
            left = self.stop_at - time.perf_counter()
            if left <= 0:
                return "not_run", None
            timeout = min(timeout, left)
        self.server.stdin.write(json.dumps({"args": args, "timeout": timeout, "log": str(self.log),
                                            "cases": self.case_limits(rung, ids)}) + "\n")
        self.server.stdin.flush()
        answer = self.server.stdout.readline()
        if not answer:  # the server itself died (a mutant cannot reach it: it runs in the child)
            self.server = None
            raise MutateError(f"the fork server of worker {self.dir.name} died running {rung}")
        res = json.loads(answer)
        if res.get("timed_out"):
            if not res.get("hung") and self.stop_at is not None and time.perf_counter() >= self.stop_at - 0.5:
                return "not_run", None  # stopped by the hard stop, not by its own timeout
            return "timed_out", ({"case": res["hung"], "after": res["after"]} if res.get("hung") else None)
        if res["exit"] in (0, 5):  # 5: nothing selected (every case deselected by the user's own -k)
            return "passed", None
        out = self.log.read_text(errors="replace")
        if "CompileException" in out or "NVRTC_ERROR" in out:
            return "did_not_compile", None
        return "killed", None


# --- the run -----------------------------------------------------------------------------------------


def _user_kernel_cache() -> Path:
    """CuPy's on-disk kernel cache of this user (CUPY_CACHE_DIR, else CuPy's default)."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def limits(budget: float | None, within: float | None, started: float, t0: float) -> tuple[float, float] | None:
    """(start no mutant after, cut a running one at), perf_counter times, or None for no limit. --budget B
    counts from the first mutant (t0): starts until B, the cut max(60 s, B/2) later. --within W counts from
    the command's start (`started`), so the set-up is inside it: starts until 2/3 of W, the cut at W less
    WITHIN_MARGIN for the report. With both, the earlier of each."""
    found = []
    if budget is not None:
        found.append((t0 + budget, t0 + budget + max(60.0, budget / 2)))
    if within is not None:
        found.append((started + 2 * within / 3, started + within - WITHIN_MARGIN))
    if not found:
        return None
    return min(f[0] for f in found), min(f[1] for f in found)


def run(mutants: list[Mutant], backend: str, rungs, jobs: int, timeout: float, extra: list[str], log=print,
        launches: tuple[dict, dict] | None = None, budget: float | None = None, within: float | None = None,
        started: float | None = None) -> list[dict]:
    """Each mutant's record (its fields, outcome, the rung that killed it, seconds, cases run). `launches`:
    the (maps, seconds) of a green report (map_from_report) instead of the clean run. `budget` and `within`
    (seconds from `started`, the command's perf_counter start): see `limits`. A mutant left when no more may
    start gets the outcome `not_run` (not scored), and so does one still running at the cut."""
    started = time.perf_counter() if started is None else started
    results: list[dict] = []
    if not mutants:
        return results
    from kernels import backend_needs_device
    from ladder.run.nested import child_env

    with tempfile.TemporaryDirectory(prefix="nanoqwen-mutate-") as tmp:
        # One CuPy kernel cache for the clean run and every worker: the clean run compiles each module once,
        # and a worker's child then compiles only the module its mutant changed.
        env = child_env(backend, pythonpath=str(ROOT), CUPY_CACHE_DIR=str(Path(tmp) / "cupy-cache"),
                        HYPOTHESIS_STORAGE_DIRECTORY=str(Path(tmp) / "hypothesis-clean"))
        if launches and backend_needs_device(backend) and _user_kernel_cache().is_dir():
            # No clean run compiles the modules into the run's cache: start it from the user's, which the
            # ladder run that made the report filled (else every worker's canary compiles every module).
            shutil.copytree(_user_kernel_cache(), Path(tmp) / "cupy-cache")
        maps, seconds = launches or clean_run(backend, rungs, jobs, extra, env, Path(tmp), log)
        files = sorted({m.file for m in mutants})
        workers = [Worker(Path(tmp), i, backend, rungs, timeout, extra, maps, seconds, env, files)
                   for i in range(max(1, min(jobs, len(mutants))))]
        if backend_needs_device(backend) and "unit" in rungs:
            from ladder.tools.sanitizer import find_sanitizer

            sanitizer = find_sanitizer()
            if sanitizer is None:
                log("no compute-sanitizer here: survivors get no second look under memcheck and racecheck")
            for w in workers:
                w.sanitizer = sanitizer
        free = list(workers)
        t0 = time.perf_counter()
        bounds = limits(budget, within, started, t0)
        if bounds is not None:  # a mutant still running when starts end gets a grace, then is cut and not run
            for w in workers:
                w.stop_at = bounds[1]
        try:
            with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
                pending = {}
                queue = list(mutants)
                while queue or pending:
                    if bounds is not None and queue and time.perf_counter() > bounds[0]:
                        spent = f"--budget of {budget:.0f} s" if budget is not None else f"2/3 of --within {within:.0f} s"
                        log(f"the {spent} is spent: {len(queue)} mutants not run")
                        results += [{**m.record(), "outcome": "not_run", "rung": None, "seconds": 0.0, "cases": 0}
                                    for m in queue]
                        queue = []
                        if not pending:
                            break
                    while queue and free:
                        w, m = free.pop(), queue.pop(0)
                        pending[pool.submit(w.run, m)] = (w, m)
                    done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                    for fut in done:
                        w, m = pending.pop(fut)
                        free.append(w)
                        rec = {**m.record(), **fut.result()}
                        results.append(rec)
                        log(f"[{len(results)}/{len(mutants)}] {rec['outcome']:<15} {m.describe()}"
                            + (f" (rung {rec['rung']})" if rec["rung"] else "")
                            + (f" caught by {rec['caught_by']}" if rec.get("caught_by") else "")
                            + (f" (second look: {rec['second_look']})" if rec.get("second_look") else "")
                            + (f" hung in {rec['hung']['case']}" if rec.get("hung") else "")
                            + f"  {rec['cases']} cases  {time.perf_counter() - t0:.0f}s")
        finally:
            for w in workers:
                w.close()
        wall = time.perf_counter() - t0
        log(f"{len(results)} mutants in {wall:.0f} s of wall time with {len(workers)} workers: "
            f"{wall / max(1, len(results)):.2f} s per mutant")
    results.sort(key=lambda r: (r["file"], r["start"], r["replacement"]))
    return results


# --- the subcommand ----------------------------------------------------------------------------------


def _run(args) -> int:
    started = time.perf_counter()  # --within counts from here: the set-up and the workers' copies are inside it
    from kernels import backend_available

    try:
        resume = _earlier_report("--resume", args.resume) if args.resume else None
        if resume is not None:
            _take_resumed_options(args, resume)
        if args.seed is None:
            args.seed = 0
        rungs = [r for r in (args.rungs or DEFAULT_RUNGS).split(",") if r]
        bad = [r for r in rungs if r not in RUNGS]
        if bad or not rungs:
            raise MutateArgumentError(f"--rungs {args.rungs}: each must be one of {', '.join(RUNGS)}")
        files = kernel_files(args.files.split(",") if args.files else DEFAULT_FILES.get(args.backend, ()))
        baseline = _earlier_report("--baseline", args.baseline) if args.baseline else None
        rerun = _earlier_report("--rerun", args.rerun) if args.rerun else None
        if resume is not None and resume["meta"].get("sources") not in (None, sources_digest(files)):
            raise MutateArgumentError(f"--resume {args.resume}: the mutated sources changed since that run; "
                                      f"a resumed sample runs on the same sources")
        launches = map_from_report(args.launches, args.backend, rungs) if args.launches else None
        if args.same_build and not any(f.endswith(CUDA_SOURCES) for f in files):
            raise MutateArgumentError("--same-build compiles CUDA sources (.cu, .cuh) with nvcc, and the files chosen "
                                      "hold none (--backend cuda, or --files kernels/cuda/...)")
        nvcc = shutil.which("nvcc") if args.same_build else None
        if args.same_build and nvcc is None:
            raise MutateArgumentError("--same-build compiles each mutant with nvcc, which is not on PATH")
        ok, why = backend_available(args.backend)
        if not ok and not (args.list or args.same_build):
            raise MutateArgumentError(f"--backend {args.backend}: cannot run here ({why})")
        from engine.outpath import check_output_folder

        out = Path(args.report or f"reports/mutate-{datetime.datetime.now():%Y%m%d-%H%M%S}").expanduser().resolve()
        if not (args.list or args.same_build):
            check_output_folder(out)
    except NanoqwenError as e:
        print(f"nanoqwen: error: {e}", file=sys.stderr)
        return 2
    reviewed = load_equivalents()
    candidates = all_mutants(files)
    equivalents = {m.signature: {**m.record(), "reason": reviewed[m.signature]} for m in candidates if m.signature in reviewed}
    runnable = [m for m in candidates if m.signature not in reviewed]
    if rerun is not None:
        survivors = {r["signature"] for r in rerun.get("mutants", []) if r["outcome"] == "survived"}
        runnable = [m for m in runnable if m.signature in survivors]
    kept: list[dict] = []  # --resume: the earlier run's results, carried into this report
    if resume is not None:
        left = {r["signature"] for r in resume.get("mutants", []) if r["outcome"] == "not_run"}
        chosen = [m for m in runnable if m.signature in left]
        kept = [r for r in resume.get("mutants", []) if r["outcome"] != "not_run" and r["signature"] not in reviewed]
        if not chosen and not args.list:
            print(f"nanoqwen mutate: --resume {args.resume}: every mutant of that run has run; nothing to resume")
            return 0
        print(f"nanoqwen mutate: resuming {args.resume}: {len(chosen)} mutants it did not run, "
              f"{len(kept)} results kept", flush=True)
    else:
        chosen = sample(runnable, args.sample, args.seed)
    if args.same_build:
        return _same_build([m for m in chosen if m.file.endswith(CUDA_SOURCES)], len(files), args.workers, nvcc)
    if args.list:
        for m in chosen:
            print(m.describe())
        seed = f", seed {args.seed}" if args.sample else ""
        print(f"{len(chosen)} of {len(candidates)} mutants ({len(equivalents)} reviewed equivalents left out){seed}")
        return 0
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    drawn = f", seed {args.seed} (--seed {args.seed} draws them again)" if args.sample else ""
    print(f"nanoqwen mutate: {len(chosen)} of {len(runnable)} mutants of {len(files)} files on backend {args.backend}, "
          f"rungs {','.join(rungs)}, {args.workers} workers{drawn}", flush=True)
    t0 = time.perf_counter()
    try:
        results = run(chosen, args.backend, rungs, args.workers, args.timeout, extra, log=lambda s: print(s, flush=True),
                      launches=launches, budget=args.budget, within=args.within, started=started)
    except NanoqwenError as e:
        print(f"nanoqwen: error: {e}", file=sys.stderr)
        return 2
    results = sorted(kept + results, key=lambda r: (r["file"], r["start"], r["replacement"]))
    report = {"meta": {"backend": args.backend, "rungs": rungs, "files": files, "seed": args.seed, "sample": args.sample,
                       "candidates": len(candidates), "run": len(results), "pytest_args": extra,
                       "sources": sources_digest(files),
                       "resumed": str(Path(args.resume).resolve()) if args.resume else None,
                       "launches": str(Path(args.launches).resolve()) if args.launches else None,
                       "seconds": time.perf_counter() - t0, "started": datetime.datetime.now().isoformat(timespec="seconds")},
              "summary": summarize(results, equivalents), "mutants": results, "equivalents": equivalents}
    if baseline is not None:
        report["baseline"] = compare(report, baseline)
    report["trend"] = trend(report, baseline)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutate.json").write_text(json.dumps(report, indent=1))
    (out / "mutate.md").write_text(markdown(report))
    t = report["summary"]["total"]
    run_s = [r["seconds"] for r in results if r["outcome"] not in ("did_not_compile", "not_launched")]
    caught = sum(1 for r in results if r.get("caught_by"))
    print(f"score {_pct(t['score'])}: {t['killed']} killed ({caught} by the sanitizers' second look), "
          f"{t['timed_out']} timed out, {t['survived']} survived, "
          f"{t['did_not_compile']} did not compile, {t['not_launched']} not launched, {t['not_run']} not run, "
          f"{t['equivalent']} reviewed "
          f"equivalents; {sum(run_s) / max(1, len(results)):.1f} s of worker time per mutant; report in {out}")
    if len(report["trend"]) > 1:
        print(trend_line(report["trend"]))
    worse = regressions(report)
    for line in worse[:20]:
        print(f"REGRESSION {line}", file=sys.stderr)
    if worse:
        print(f"nanoqwen mutate: weaker than the baseline {args.baseline} ({len(worse)} regression(s))", file=sys.stderr)
        return 1
    return 0


def sources_digest(files) -> str:
    """A digest of the mutated sources' text: a resumed sample must run on the same sources."""
    from ladder.changes.sources import files_digest

    return files_digest(ROOT, files)[:16]


def _take_resumed_options(args, resume: dict) -> None:
    """--resume: the earlier run's files, rungs, seed and sample; giving them again, or another backend,
    is an error (one line)."""
    meta = resume.get("meta") or {}
    if "seed" not in meta or "files" not in meta:
        raise MutateArgumentError(f"--resume {args.resume}: not a `nanoqwen mutate` report (no meta with its seed and files)")
    given = [o for o, v in (("--files", args.files), ("--sample", args.sample), ("--seed", args.seed),
                            ("--rungs", args.rungs), ("--rerun", args.rerun)) if v is not None]
    if given:
        raise MutateArgumentError(f"--resume {args.resume}: takes that run's files, rungs, seed and sample; "
                                  f"drop {', '.join(given)}")
    if meta.get("backend") != args.backend:
        raise MutateArgumentError(f"--resume {args.resume}: that run mutated the {meta.get('backend')} backend; "
                                  f"pass --backend {meta.get('backend')}")
    args.files, args.rungs = ",".join(meta["files"]), ",".join(meta["rungs"])
    args.seed, args.sample = meta["seed"], meta["sample"]


def _same_build(chosen: list, n_files: int, workers: int, nvcc: str) -> int:
    """--same-build: print the chosen mutants whose every module builds the original's cubin (ladder/tools/same_build.py)."""
    from ladder.tools.same_build import COMPILE_TIMEOUT, same_build

    print(f"nanoqwen mutate --same-build: {len(chosen)} mutants of {n_files} files, each module they touch built "
          f"with {nvcc}, {workers} workers", flush=True)
    t0 = time.perf_counter()
    try:
        results = same_build(chosen, ROOT, workers, nvcc, log=lambda s: print(s, flush=True))
    except RuntimeError as e:
        print(f"nanoqwen: error: {e}", file=sys.stderr)
        return 2
    counts = {v: sum(r["verdict"] == v for r in results) for v in ("same", "different", "did_not_compile", "slow")}
    for r in results:
        if r["verdict"] == "same":
            print(f"same  {r['file']}:{r['line']} in {r['function']}: {r['original']!r} -> {r['replacement']!r}  "
                  f"{r['signature']}")
    print(f"{counts['same']} of {len(results)} build the original's cubins byte for byte ({counts['different']} differ, "
          f"{counts['did_not_compile']} did not compile, {counts['slow']} past {COMPILE_TIMEOUT:.0f} s a module) in "
          f"{time.perf_counter() - t0:.0f} s; write why for each before listing it in {EQUIVALENT_FILE.relative_to(ROOT)}")
    return 0


def _earlier_report(option: str, folder: str) -> dict:
    path = Path(folder) / "mutate.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MutateArgumentError(f"{option} {folder}: cannot read {path.name} ({e})") from None


def register(subparsers) -> None:
    """Add the `mutate` subcommand to the `nanoqwen` parser's subparsers."""
    from engine.cli import renamed
    from kernels import backend_names

    m = subparsers.add_parser(
        "mutate", help="mutation testing: how many one-token kernel bugs the ladder's rungs let through",
        description="Write each mutant of the kernel sources into a private copy of the tree and run the rungs "
                    "against it; report killed, survived, timed out and did-not-compile per file and function.")
    m.add_argument("--backend", default="numpy", choices=backend_names(), help="the backend whose kernels are mutated (default numpy)")
    m.add_argument("--files", metavar="PATTERN,...", help="sources to mutate, globs relative to the repository "
                   "(default: kernels/numpy/*.py for numpy, kernels/cuda/*.cu and *.cuh for cuda)")
    m.add_argument("--sample", type=_positive, metavar="N", help="run N mutants drawn with --seed (default: all)")
    m.add_argument("--seed", type=_seed, default=None, metavar="SEED|random|date",
                   help="the sample's seed: an integer; `random`, a fresh one drawn and printed; `date`, today's "
                        "(YYYYMMDD, a nightly's rotating sample) (default 0)")
    m.add_argument("--rungs", default=None, help=f"rungs to run, cheapest first (default {DEFAULT_RUNGS})")
    m.add_argument("-n", "--workers", type=_positive, default=max(1, (os.cpu_count() or 2) // 2), metavar="N",
                   help="parallel workers, each with its own copy of the tree (default: half the cores)")
    renamed(m, "-j", "--jobs", new="--workers", type=_positive)
    m.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="per rung and mutant, and no watchdog (default: each case hangs past 20 s plus 3x its clean-run "
                        "time, and a rung run past 60 s plus the sum of those)")
    m.add_argument("--report", metavar="DIR", help="report folder (default reports/mutate-TIMESTAMP)")
    m.add_argument("--baseline", metavar="DIR", help="an earlier report folder to compare with; exit 1 when a mutant "
                   "it detected is lost here, or the score over the mutants both scored is lower")
    m.add_argument("--rerun", metavar="DIR", help="run only the mutants that survived in an earlier report (after "
                   "strengthening the rungs); with --baseline DIR too, the report shows which are now killed")
    m.add_argument("--resume", metavar="DIR", help="run the mutants an earlier report did not run (cut by its --within "
                   "or --budget), with its files, rungs, seed and sample, on the same sources; the report holds both "
                   "runs' results")
    m.add_argument("--launches", metavar="REPORT", help="a green `nanoqwen ladder` report folder of this backend and "
                   "tree whose launch map and case times replace the clean run (the nightly passes its own)")
    m.add_argument("--budget", type=float, metavar="SECONDS", help="start no mutant after this many seconds of "
                   "mutants, and cut one still running max(60, SECONDS/2) later; those are reported as not run "
                   "and not scored (a nightly that must end on time)")
    m.add_argument("--within", type=_seconds, metavar="SECONDS", help="the whole command ends within this many "
                   "seconds of its start: no mutant starts after 2/3 of them, one still running is cut at the end; "
                   "those are reported as not run and not scored (the nightly gives each sample the time it has left)")
    m.add_argument("--list", action="store_true", help="list the chosen mutants and stop")
    m.add_argument("--same-build", action="store_true", help="compile each chosen mutant of a CUDA source (with "
                   "--backend cuda, or --files kernels/cuda/...) with nvcc, no GPU needed, and print those whose "
                   "every module builds the original's cubin byte for byte, the same machine code, candidates for "
                   "the reviewed equivalents; run no rung")
    m.add_argument("pytest_args", nargs="*", metavar="-- PYTEST ARGS", help="passed to every rung's pytest")
    m.set_defaults(func=_run)


def _seed(text: str) -> int:
    """--seed: a non-negative integer, `random` (drawn from the OS: a sample nobody chose) or `date`
    (today's YYYYMMDD: every run of a day draws the same sample, each night another)."""
    if text == "random":
        return int.from_bytes(os.urandom(4), "little") >> 1
    if text == "date":
        return int(datetime.date.today().strftime("%Y%m%d"))
    from engine.cli import int_at_least

    return int_at_least(0, "a non-negative integer, 'random' or 'date'")(text)


def _seconds(text: str) -> float:
    """--within: a number of seconds, at least 3 x WITHIN_MARGIN (less leaves no time for a mutant)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 3 * WITHIN_MARGIN:
        raise argparse.ArgumentTypeError(f"expected a number of seconds of at least {3 * WITHIN_MARGIN:.0f}, got {text!r}")
    return value


def _positive(text: str) -> int:
    from engine.cli import int_at_least

    return int_at_least(1, "a positive integer")(text)

