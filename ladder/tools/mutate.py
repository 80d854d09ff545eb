"""`nanoqwen mutate`: how many broken kernels does the ladder let through?

    nanoqwen mutate [--backend numpy|cuda] [--files PATTERN,...] [--sample N] [--seed S]
                    [--rungs unit,layer,graph] [-j WORKERS] [--timeout SECONDS] [--report DIR]
                    [--baseline DIR] [--rerun DIR] [--list] [-- PYTEST ARGS]

Each mutant (ladder/tools/mutants.py: one small edit to one kernel source) is written into a private copy
of the checkout, and the rungs run against it on the chosen backend, cheapest first, each with `-x`:
the first rung that goes red kills the mutant, and the rest are not run. A mutant every rung passes
survived: the ladder cannot tell that kernel from a broken one. Outcomes:

- `killed` (a rung failed, or could not collect: an import that breaks is noticed too),
- `survived`, `timed_out` (past --timeout: counted as detected, as a hang would be),
- `did_not_compile` (a Python mutant that no longer parses, a CUDA mutant NVRTC refuses): not scored,
- `equivalent`: on the reviewed list of ladder/tools/equivalent_mutants.json (a signature and the reason
  it cannot change any output); not run, not scored, shown in the report.

The score is (killed + timed_out) / (killed + timed_out + survived). Workers (`-j`) each own a copy of
the tree and, on a GPU, their own CuPy kernel cache; the copy's tests run with the nested-run mark
(ladder/nested.py), so tests that start ladders of their own skip instead of recursing. The report
folder gets `mutate.json` and `mutate.md`: per file and per kernel function, the counts and the score;
every survivor with file:line and its edit; with `--baseline DIR`, the score change per file and the
mutants killed there that survive here. `--rerun DIR` runs only the survivors of an earlier report:
the check that a strengthened rung now kills them.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from engine.errors import NanoqwenError
from ladder.tools.mutants import Mutant, compiles, mutants_of

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the project's packages
RUNGS = ("unit", "layer", "graph")
EQUIVALENT_FILE = Path(__file__).resolve().parent / "equivalent_mutants.json"
# What a worker's copy needs: the packages, the root conftest and the project file.
TREE = ("engine", "kernels", "ladder", "reference", "fixtures", "bench", "conftest.py", "pyproject.toml")
DEFAULT_FILES = {"numpy": ("kernels/numpy/*.py",), "cuda": ("kernels/cuda/*.cu", "kernels/cuda/*.cuh")}
DETECTED = ("killed", "timed_out")


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


class Worker:
    """A private copy of the tree; mutants are written into it one at a time and restored after."""

    def __init__(self, base: Path, index: int, backend: str, rungs, timeout: float, extra: list[str]):
        self.dir = base / f"w{index}"
        for name in TREE:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, self.dir / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif src.exists():
                self.dir.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, self.dir / name)
        self.backend, self.rungs, self.timeout, self.extra = backend, rungs, timeout, extra
        from ladder.nested import child_env

        self.env = child_env(backend, pythonpath=str(self.dir), CUPY_CACHE_DIR=str(self.dir / ".cupy-cache"),
                             HYPOTHESIS_STORAGE_DIRECTORY=str(self.dir / ".hypothesis"))

    def run(self, m: Mutant) -> dict:
        path = self.dir / m.file
        original = path.read_text()
        mutated = m.apply(original)
        if not compiles(m.file, mutated):
            return {"outcome": "did_not_compile", "rung": None, "seconds": 0.0}
        path.write_text(mutated)
        t0 = time.perf_counter()
        try:
            for rung in self.rungs:
                outcome = self._rung(rung)
                if outcome != "passed":
                    return {"outcome": outcome, "rung": rung, "seconds": round(time.perf_counter() - t0, 2)}
            return {"outcome": "survived", "rung": None, "seconds": round(time.perf_counter() - t0, 2)}
        finally:
            path.write_text(original)

    def _rung(self, rung: str) -> str:
        # As `nanoqwen ladder` runs a rung (ladder/runner.py): no configuration file, the plugin named.
        cmd = [sys.executable, "-m", "pytest", str(self.dir / "ladder" / rung), "-m", rung, "-x", "-q",
               "-c", os.devnull, "--rootdir", str(self.dir), "--confcutdir", str(self.dir), "-p", "ladder.plugin",
               "--strict-markers", "-p", "no:cacheprovider", "-p", "no:xdist", "--backend", self.backend, *self.extra]
        try:
            r = subprocess.run(cmd, cwd=self.dir, env=self.env, capture_output=True, text=True, timeout=self.timeout,
                               start_new_session=True)
        except subprocess.TimeoutExpired:
            return "timed_out"
        if r.returncode == 0 or r.returncode == 5:  # 5: this rung selected nothing for the mutant's backend
            return "passed"
        out = r.stdout + r.stderr
        if "CompileException" in out or "NVRTC_ERROR" in out:
            return "did_not_compile"
        return "killed"


# --- the run -----------------------------------------------------------------------------------------


def run(mutants: list[Mutant], backend: str, rungs, jobs: int, timeout: float, extra: list[str], log=print) -> list[dict]:
    """Each mutant's record (its fields, outcome, the rung that killed it, seconds)."""
    results: list[dict] = []
    if not mutants:
        return results
    with tempfile.TemporaryDirectory(prefix="nanoqwen-mutate-") as tmp:
        workers = [Worker(Path(tmp), i, backend, rungs, timeout, extra) for i in range(max(1, min(jobs, len(mutants))))]
        free = list(workers)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
            pending = {}
            queue = list(mutants)
            while queue or pending:
                while queue and free:
                    w, m = free.pop(), queue.pop(0)
                    pending[pool.submit(w.run, m)] = (w, m)
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    w, m = pending.pop(fut)
                    free.append(w)
                    rec = {**m.record(), **fut.result()}
                    results.append(rec)
                    n = len(results)
                    log(f"[{n}/{len(mutants)}] {rec['outcome']:<15} {m.describe()}"
                        + (f" (rung {rec['rung']})" if rec["rung"] else "") + f"  {time.perf_counter() - t0:.0f}s")
    results.sort(key=lambda r: (r["file"], r["start"], r["replacement"]))
    return results


def score(counts: Counter) -> float | None:
    scored = sum(counts[o] for o in DETECTED) + counts["survived"]
    return None if scored == 0 else sum(counts[o] for o in DETECTED) / scored


def summarize(results: list[dict], equivalents: dict[str, dict]) -> dict:
    by_file, by_function = defaultdict(Counter), defaultdict(Counter)
    for r in results:
        by_file[r["file"]][r["outcome"]] += 1
        by_function[(r["file"], r["function"])][r["outcome"]] += 1
    for e in equivalents.values():
        by_file[e["file"]]["equivalent"] += 1
        by_function[(e["file"], e["function"])]["equivalent"] += 1
    total = sum((c for c in by_file.values()), Counter())
    row = lambda c: {**{k: c[k] for k in ("killed", "timed_out", "survived", "did_not_compile", "equivalent")},  # noqa: E731
                     "score": score(c)}
    return {"total": row(total),
            "files": {f: row(c) for f, c in sorted(by_file.items())},
            "functions": [{"file": f, "function": fn, **row(c)} for (f, fn), c in sorted(by_function.items())]}


def compare(current: dict, baseline: dict) -> dict:
    """Per file, the score here and in the baseline; the mutants the baseline killed that survive here,
    and those it let survive that are killed here."""
    old = {r["signature"]: r["outcome"] for r in baseline.get("mutants", [])}
    regressed = [r for r in current["mutants"] if r["outcome"] == "survived" and old.get(r["signature"]) in DETECTED]
    fixed = [r for r in current["mutants"] if r["outcome"] in DETECTED and old.get(r["signature"]) == "survived"]
    files = {}
    for f, row in current["summary"]["files"].items():
        before = baseline.get("summary", {}).get("files", {}).get(f, {}).get("score")
        files[f] = {"score": row["score"], "baseline": before}
    return {"files": files, "newly_surviving": [r["signature"] for r in regressed],
            "newly_killed": [r["signature"] for r in fixed]}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(report: dict) -> str:
    s, meta = report["summary"], report["meta"]
    lines = ["# Mutation report", "",
             f"Backend `{meta['backend']}`, rungs {', '.join(meta['rungs'])}, {meta['run']} of {meta['candidates']} "
             f"mutants run (seed {meta['seed']}), {meta['seconds']:.0f} s. Score = detected / (detected + survived); "
             "mutants that do not compile and reviewed equivalents are not scored.", "",
             "| file | killed | timed out | survived | did not compile | equivalent | score |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for f, r in [*s["files"].items(), ("**total**", s["total"])]:
        lines.append(f"| {f} | {r['killed']} | {r['timed_out']} | {r['survived']} | {r['did_not_compile']} | "
                     f"{r['equivalent']} | {_pct(r['score'])} |")
    lines += ["", "## Per kernel function", "", "| file | function | detected | survived | score |", "| --- | --- | --- | --- | --- |"]
    for r in s["functions"]:
        lines.append(f"| {r['file']} | {r['function']} | {r['killed'] + r['timed_out']} | {r['survived']} | {_pct(r['score'])} |")
    survivors = [r for r in report["mutants"] if r["outcome"] == "survived"]
    lines += ["", f"## Survivors ({len(survivors)})", ""]
    lines += [f"- `{r['file']}:{r['line']}` in `{r['function']}`: `{r['original']}` -> `{r['replacement']}` "
              f"({r['kind']}; signature `{r['signature']}`)" for r in survivors] or ["none"]
    eq = report["equivalents"]
    lines += ["", f"## Reviewed equivalent mutants ({len(eq)}, not run, not scored)", ""]
    lines += [f"- `{e['file']}:{e['line']}`: `{e['original']}` -> `{e['replacement']}`: {e['reason']}" for e in eq.values()] or ["none"]
    if "baseline" in report:
        b = report["baseline"]
        lines += ["", "## Against the baseline", "", "| file | score | baseline |", "| --- | --- | --- |"]
        lines += [f"| {f} | {_pct(r['score'])} | {_pct(r['baseline'])} |" for f, r in b["files"].items()]
        lines += ["", f"Killed in the baseline, surviving here: {len(b['newly_surviving'])}", ""]
        lines += [f"- `{sig}`" for sig in b["newly_surviving"]]
        lines += ["", f"Surviving in the baseline, killed here: {len(b['newly_killed'])}", ""]
        lines += [f"- `{sig}`" for sig in b["newly_killed"]]
    return "\n".join(lines) + "\n"


# --- the subcommand ----------------------------------------------------------------------------------


def _run(args) -> int:
    from kernels import backend_available

    try:
        rungs = [r for r in args.rungs.split(",") if r]
        bad = [r for r in rungs if r not in RUNGS]
        if bad or not rungs:
            raise MutateArgumentError(f"--rungs {args.rungs}: each must be one of {', '.join(RUNGS)}")
        files = kernel_files(args.files.split(",") if args.files else DEFAULT_FILES.get(args.backend, ()))
        baseline = _earlier_report("--baseline", args.baseline) if args.baseline else None
        rerun = _earlier_report("--rerun", args.rerun) if args.rerun else None
        ok, why = backend_available(args.backend)
        if not ok and not args.list:
            raise MutateArgumentError(f"--backend {args.backend}: cannot run here ({why})")
        from engine.outpath import check_output_folder

        out = Path(args.report or f"reports/mutate-{datetime.datetime.now():%Y%m%d-%H%M%S}").expanduser().resolve()
        if not args.list:
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
    chosen = sample(runnable, args.sample, args.seed)
    if args.list:
        for m in chosen:
            print(m.describe())
        print(f"{len(chosen)} of {len(candidates)} mutants ({len(equivalents)} reviewed equivalents left out)")
        return 0
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    print(f"nanoqwen mutate: {len(chosen)} of {len(runnable)} mutants of {len(files)} files on backend {args.backend}, "
          f"rungs {','.join(rungs)}, {args.jobs} workers", flush=True)
    t0 = time.perf_counter()
    results = run(chosen, args.backend, rungs, args.jobs, args.timeout, extra, log=lambda s: print(s, flush=True))
    report = {"meta": {"backend": args.backend, "rungs": rungs, "files": files, "seed": args.seed, "sample": args.sample,
                       "candidates": len(candidates), "run": len(chosen), "pytest_args": extra,
                       "seconds": time.perf_counter() - t0, "started": datetime.datetime.now().isoformat(timespec="seconds")},
              "summary": summarize(results, equivalents), "mutants": results, "equivalents": equivalents}
    if baseline is not None:
        report["baseline"] = compare(report, baseline)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutate.json").write_text(json.dumps(report, indent=1))
    (out / "mutate.md").write_text(markdown(report))
    t = report["summary"]["total"]
    print(f"score {_pct(t['score'])}: {t['killed']} killed, {t['timed_out']} timed out, {t['survived']} survived, "
          f"{t['did_not_compile']} did not compile, {t['equivalent']} reviewed equivalents; report in {out}")
    return 0


def _earlier_report(option: str, folder: str) -> dict:
    path = Path(folder) / "mutate.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MutateArgumentError(f"{option} {folder}: cannot read {path.name} ({e})") from None


def register(subparsers) -> None:
    """Add the `mutate` subcommand to the `nanoqwen` parser's subparsers."""
    from kernels import backend_names

    m = subparsers.add_parser(
        "mutate", help="mutation testing: how many one-token kernel bugs the ladder's rungs let through",
        description="Write each mutant of the kernel sources into a private copy of the tree and run the rungs "
                    "against it; report killed, survived, timed out and did-not-compile per file and function.")
    m.add_argument("--backend", default="numpy", choices=backend_names(), help="the backend whose kernels are mutated (default numpy)")
    m.add_argument("--files", metavar="PATTERN,...", help="sources to mutate, globs relative to the repository "
                   "(default: kernels/numpy/*.py for numpy, kernels/cuda/*.cu and *.cuh for cuda)")
    m.add_argument("--sample", type=_positive, metavar="N", help="run N mutants drawn with --seed (default: all)")
    m.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    m.add_argument("--rungs", default="unit,layer,graph", help="rungs to run, cheapest first (default unit,layer,graph)")
    m.add_argument("-j", "--jobs", type=_positive, default=max(1, (os.cpu_count() or 2) // 2), metavar="N",
                   help="parallel workers, each with its own copy of the tree (default: half the cores)")
    m.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS", help="per rung and mutant (default 900)")
    m.add_argument("--report", metavar="DIR", help="report folder (default reports/mutate-TIMESTAMP)")
    m.add_argument("--baseline", metavar="DIR", help="an earlier report folder to compare with")
    m.add_argument("--rerun", metavar="DIR", help="run only the mutants that survived in an earlier report (after "
                   "strengthening the rungs); with --baseline DIR too, the report shows which are now killed")
    m.add_argument("--list", action="store_true", help="list the chosen mutants and stop")
    m.add_argument("pytest_args", nargs="*", metavar="-- PYTEST ARGS", help="passed to every rung's pytest")
    m.set_defaults(func=_run)


def _positive(text: str) -> int:
    from engine.cli import int_at_least

    return int_at_least(1, "a positive integer")(text)

