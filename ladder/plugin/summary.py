"""The run summary of the ladder's pytest plugin (ladder/plugin/__init__.py, which re-exports the hooks below).

- `RunSummary`: what a pytest process saw, fed by every test report (`pytest_runtest_logreport`): tests
  run, passed, failed and skipped (with the reasons) per rung and per backend and format, each op's worst
  error per (rung, backend, format, op) as a multiple of its noise floor, the op calls each rung made (the
  coverage listing), the graph rung's token records and bounds, unsupported formats, the slowest phases,
  and each failure with its backend, format, the first lines of its message and its rerun command (read
  from the failed report, so a red report says why without the log). With pytest-xdist the controller's
  summary gets every worker's reports (the properties the tests attached travel with them).
- progress lines: every PROGRESS_SECONDS (env NANOQWEN_PROGRESS_SECONDS, default 60) a line with the tests
  finished, of how many (the collection's count, or the first worker's with workers), the rate and the
  slowest phase so far.
- signs of life: as tests finish, the controller writes a beat (`37 tests finished`, at most once a second)
  into the rung's progress folder, so that `nanoqwen ladder` can tell a slow rung from a stalled one
  (ladder/plugin/liveness.py, ladder/run/runner.py).
- `pytest_sessionfinish`: the graph rung's near-tie flip rule, judged over every prompt of the run, fails
  the run when a backend flips more often than the plain forward (ladder/judges/tokens.py judge_flips). A worker
  that died between cases fails the run too, in one line, and a run stopped by its dead workers says how
  many cases it never ran (ladder/plugin/groups.py, ladder/plugin/liveness.py).
- `pytest_terminal_summary`: the table per rung and the op error table at the end, and `--ladder-json
  FILE` (the same data as JSON, for `nanoqwen ladder` and ladder/run/report.py).

`attach(config)` (from the plugin's pytest_configure) gives the session its summary.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from kernels import OPS
from ladder.judges.compare import case_id  # noqa: F401  (the launch map's and the report's case ids)
from ladder.plugin.liveness import LINE, TESTS, beat

SLOWEST = 15  # the slowest tests over all rungs, in report.json and report.md
RUNGS = ("unit", "layer", "graph")  # the ladder's rungs: `nanoqwen ladder` runs these (ladder/run/runner.py)
SELFTEST = "selftest"  # ladder/selftest/: the tests of the ladder's own commands and judges, not a rung
ROWS = (*RUNGS, SELFTEST)  # the summary's rows, each the folder of ladder/ its tests live in (else "other")
MESSAGE_LINES = 8  # of a failure's message kept in the JSON and report.md: the error, bound, floor, worst pairs
LINE_CHARS = 300  # of each such line: a row of worst pairs, or a Hypothesis example, can run on for pages
RERUN_IN_TRACEBACK = re.compile(r"^(?:E\s+)?rerun: (.+)$", re.MULTILINE)  # pytest marks exception lines "E   "


def cases_json(cases) -> list[dict]:
    """[{backend, format, passed, failed, skipped}]: the tests per backend and format, by outcome."""
    rows: dict[tuple, dict] = {}
    for (b, f, outcome), n in cases.items():
        row = rows.setdefault((b, f), {})
        row[outcome] = row.get(outcome, 0) + n
    return [{"backend": b, "format": f, **c} for (b, f), c in sorted(rows.items(), key=lambda kv: tuple(str(x) for x in kv[0]))]


def is_worker(config) -> bool:
    """True in a pytest-xdist worker (the controller sums the workers' reports and writes the summary)."""
    return hasattr(config, "workerinput")


def attach(config) -> None:
    """A fresh summary for this session (config._nanoqwen), known to the hooks that are not handed the config."""
    config._nanoqwen = RunSummary()
    config._nanoqwen.shard = config.getoption("--shard")
    _CONFIG["config"] = config


class RunSummary:
    """What one pytest process saw: counts and skip reasons per rung, each op's worst error, op calls, the
    graph rung's records, failures, durations; with workers, the controller's holds every worker's reports."""

    def __init__(self):
        self.counts = defaultdict(Counter)  # rung -> outcome -> n
        self.skips = defaultdict(Counter)  # rung -> reason -> n
        self.worst: dict[tuple, dict] = {}  # (rung, backend, format, op) -> worst record
        self.calls = defaultdict(Counter)  # (rung, backend) -> op -> n
        self.graph: list[dict] = []  # graph rung: one ladder/judges/tokens.py record per prompt and backend
        self.graph_bounds: list[dict] = []  # the bounds each worker derived (the same, recorded once)
        self.failures: list[dict] = []  # failure_record() of each failed phase, in the order they came
        self.cases = Counter()  # (backend, format, outcome) -> tests: what actually ran, beside what was asked
        self.unsupported = Counter()  # (backend, format) -> tests that failed for want of a kernel
        self.shard: str | None = None  # --shard I/N of this run
        self.durations: list[tuple[float, str]] = []  # (seconds of a setup or call phase, node id)
        self.total: int | None = None  # tests to run, where the collection says (progress lines)
        self.order: list[str] = []  # node ids in collection order (the launch map keeps it)
        self.launches: dict[str, list[str]] = {}  # node id -> kernel units it launched (--record-launches)
        self.case_seconds: Counter = Counter()  # node id -> seconds of its setup and call
        self.finished = 0
        self.started = time.monotonic()
        self.last_progress = self.started
        self.last_beat = 0.0  # when the controller last wrote its sign of life (ladder/plugin/liveness.py)

    def add(self, report, rung: str):
        if report.when in ("setup", "call"):  # a slow setup is a fixture (a model load, the graph rung's bounds)
            seconds = float(getattr(report, "duration", 0.0) or 0.0)
            self.durations.append((seconds, report.nodeid + (" [setup]" if report.when == "setup" else "")))
            self.case_seconds[case_id(report.nodeid)] += seconds
        if report.when == "call" or (report.when != "call" and report.failed) or (report.when == "setup" and report.skipped):
            outcome = report.outcome
            self.counts[rung][outcome] += 1
            self.finished += 1
            params = report_params(report)
            self.cases[(params["backend"], params["format"], outcome)] += 1
            if report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.skips[rung][reason.removeprefix("Skipped: ")] += 1
            if report.failed:
                self.failures.append(failure_record(report, rung))
        if report.when != "teardown":  # every phase's report carries the item's properties: read them once
            return
        for key, value in report.user_properties:
            if key == "nanoqwen_check":
                k = (rung, value["backend"], value.get("format"), value["op"])
                if k not in self.worst or value["multiple"] > self.worst[k]["multiple"]:
                    self.worst[k] = value
            elif key == "nanoqwen_calls":
                self.calls[(rung, value["backend"])].update(value["calls"])
            elif key == "nanoqwen_graph":
                self.graph.append(value)
            elif key == "nanoqwen_unsupported":
                self.unsupported[(value["backend"], value["format"])] += 1
            elif key == "nanoqwen_graph_bounds" and value not in self.graph_bounds:
                self.graph_bounds.append(value)
            elif key == "nanoqwen_launches":
                self.launches[case_id(report.nodeid)] = value

    def progress(self) -> str | None:
        """A progress line every PROGRESS_SECONDS (long rungs: the graph rung on a GPU runs for many
        minutes with nothing but dots): tests finished, of how many, the rate, the slowest so far."""
        now = time.monotonic()
        if now - self.last_progress < PROGRESS_SECONDS or not self.finished:
            return None
        self.last_progress = now
        minutes = (now - self.started) / 60
        of = f" of {self.total}" if self.total else ""
        slow = max(self.durations, default=None)
        return (f"[nanoqwen] {self.finished}{of} tests in {minutes:.1f} min ({self.finished / max(minutes, 1e-9):.1f}/min)"
                + (f"; slowest so far {slow[0]:.1f} s: {slow[1]}" if slow else ""))

    def as_json(self) -> dict:
        return {
            # the rungs always (a report reads each); the self-tests where this run had any
            "rungs": {r: dict(self.counts[r]) for r in ROWS if r in RUNGS or self.counts[r]},
            "skips": {r: dict(self.skips[r]) for r in ROWS if r in RUNGS or self.counts[r]},
            "ops": [{"rung": r, "backend": b, "format": f, "op": o, **{k: v for k, v in rec.items() if k in
                     ("multiple", "max_abs", "rel_l2", "floor", "bound", "case", "seed", "passed")}}
                    for (r, b, f, o), rec in sorted(self.worst.items(), key=lambda kv: tuple(str(x) for x in kv[0]))],
            "calls": [{"rung": r, "backend": b, "op": op, "n": n}
                      for (r, b), c in sorted(self.calls.items(), key=lambda kv: tuple(str(x) for x in kv[0]))
                      for op, n in sorted(c.items())],
            "ops_never_called": sorted({(b, op) for (_, b) in self.calls for op in OPS}
                                       - {(b, op) for (_, b), c in self.calls.items() for op in c}),
            "graph": [vars(x) for x in self.graph_summaries()],
            "graph_flips": [v.record() for v in self.flip_verdicts()],
            "graph_bounds": self.graph_bounds,
            "near_ties": [{**d, "backend": r["backend"]} for r in self.graph for d in r["near_ties"]],
            "failures": self.failures,
            "cases": cases_json(self.cases),
            "unsupported": [{"backend": b, "format": f, "tests": n} for (b, f), n in sorted(self.unsupported.items())],
            "shard": self.shard,
            "slowest": [{"seconds": d, "test": n} for d, n in sorted(self.durations, reverse=True)[:SLOWEST]],
            **({"launches": self.launch_map(),
                "case_seconds": {n: round(self.case_seconds[n], 3) for n in self.launches}} if self.launches else {}),
        }

    def launch_map(self) -> dict[str, list[str]]:
        """node id -> the units it launched, in collection order (ladder/changes/launches.py)."""
        rank = {n: i for i, n in enumerate(self.order)}
        return {n: self.launches[n] for n in sorted(self.launches, key=lambda n: rank.get(n, len(rank)))}

    def graph_summaries(self):
        from ladder.judges.tokens import summarize

        return summarize(self.graph)

    def flip_verdicts(self):
        """The near-tie flip rule per backend, over every prompt this run compared (ladder/judges/tokens.py)."""
        from ladder.judges.tokens import judge_flips

        return [judge_flips(g) for g in self.graph_summaries()]


def case_params(item) -> dict:
    """The backend and format a case runs on, from its parametrization (None where it takes none)."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    return {"backend": params.get("backend_name"), "format": params.get("quant_name")}


def report_params(report) -> dict:
    """case_params() as the plugin attached them to every report of the case (`nanoqwen_case`)."""
    for key, value in getattr(report, "user_properties", ()):
        if key == "nanoqwen_case":
            return value
    return {"backend": None, "format": None}


def failure_message(report) -> tuple[list[str], str]:
    """(the first MESSAGE_LINES lines of a failed report's message, its rerun command). The message is the
    exception's own text (pytest's `reprcrash`, which crosses from an xdist worker with the report), not
    the traceback; a message without a `rerun:` line (a failure outside ladder/judges/compare.py) gets one made
    from the node id."""
    longrepr = report.longrepr
    crash = getattr(getattr(longrepr, "reprcrash", None), "message", None)
    text = crash if crash else ("" if longrepr is None else str(longrepr))
    lines, rerun = [], None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("rerun: "):
            rerun = rerun or line.removeprefix("rerun: ")
        elif line and len(lines) < MESSAGE_LINES and rerun is None:
            lines.append(line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 3] + "...")
    if lines:
        lines[0] = lines[0].removeprefix("AssertionError: ")
    if rerun is None:  # the traceback may hold it where the crash line does not (a wrapped exception)
        found = RERUN_IN_TRACEBACK.search(str(longrepr or ""))
        rerun = found.group(1).strip() if found else f"python -m pytest {shlex.quote(case_id(report.nodeid))}"
    return lines, rerun


def failure_record(report, rung: str) -> dict:
    """A failed phase as report.json and report.md list it: the test, where it ran, why, how to rerun it."""
    lines, rerun = failure_message(report)
    return {"test": case_id(report.nodeid), "rung": rung, **report_params(report), "when": report.when,
            "message": lines, "rerun": rerun}


_CONFIG: dict = {}  # the session's config, for hooks that are not handed it
BEAT_SECONDS = 1.0  # at most one sign of life a second from the controller (ladder/plugin/liveness.py)
PROGRESS_SECONDS = float(os.environ.get("NANOQWEN_PROGRESS_SECONDS", "60"))  # between progress lines
# "kept": `nanoqwen ladder` keeps this rung's stdout to print it later (a rung run beside the one before it:
# ladder/run/runner.py run_side_by_side), so the progress line also goes to the ladder's progress folder,
# which the ladder prints on stderr as it comes
RUNG_OUTPUT = "NANOQWEN_RUNG_OUTPUT"


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is None:
        return
    rung = next((r for r in ROWS if f"ladder/{r}/" in report.nodeid.replace(os.sep, "/")), "other")
    config._nanoqwen.add(report, rung)
    if not is_worker(config):
        s = config._nanoqwen
        if time.monotonic() - s.last_beat >= BEAT_SECONDS:  # a finished test is progress: say so, cheaply
            s.last_beat = time.monotonic()
            beat(TESTS, f"{s.finished}{f' of {s.total}' if s.total else ''} tests finished")
        line = config._nanoqwen.progress()
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if line and tr is not None:
            tr.write_line("")
            tr.write_line(line)
        if line and os.environ.get(RUNG_OUTPUT) == "kept":  # nobody sees this rung's stdout until it ends
            beat(LINE, f"rung {rung}: {line}")


def pytest_collection_finish(session):
    if not is_worker(session.config):  # without workers, this process collected everything
        session.config._nanoqwen.total = len(session.items)
        session.config._nanoqwen.order = [case_id(item.nodeid) for item in session.items]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """With workers, the controller learns the test count from the first worker's collection."""
    config = _CONFIG.get("config")
    beat(TESTS, f"worker {node.gateway.id} collected {len(ids)} tests")
    if config is not None and config._nanoqwen.total is None:
        config._nanoqwen.total = len(ids)
        config._nanoqwen.order = [case_id(n) for n in ids]


def pytest_sessionfinish(session, exitstatus):
    """The graph rung's near-tie flip rule judges all the prompts together, so it decides here, where
    every worker's results have arrived: a backend that flips more often than the plain forward fails
    the run (ladder/judges/tokens.py judge_flips)."""
    config = session.config
    if is_worker(config) or not hasattr(config, "_nanoqwen"):
        return
    bad = [v for v in config._nanoqwen.flip_verdicts() if not v.passed]
    for v in bad:
        config._nanoqwen.failures.append({"test": f"graph rung, near-tie flips on {v.backend}", "rung": "graph",
                                          "backend": v.backend, "format": None, "when": "sessionfinish",
                                          "message": v.describe().splitlines()[:MESSAGE_LINES], "rerun": None})
    dead = dead_workers(config)
    if (bad or dead) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def dead_workers(config) -> list[dict]:
    """The workers that died in this run, as failures where their death is not one already: a worker that
    died between cases (the case a worker died in failed with its line already, ladder/plugin/groups.py), and the
    cases a run stopped by its dead workers never ran."""
    from ladder.plugin.liveness import death_line, rung_of, say

    s: RunSummary = config._nanoqwen
    deaths = getattr(config, "_nanoqwen_deaths", [])
    rung = next((r for r in RUNGS if s.counts[r]), None) or rung_of(None, config)
    lines = [death_line(d["worker"], None, d["cause"]) for d in deaths if d["case"] is None]
    if deaths and s.total and s.finished < s.total:
        lines.append(f"{len(deaths)} {'worker' if len(deaths) == 1 else 'workers'} died and the run stopped: "
                     f"{s.total - s.finished} of {s.total} tests did not run")
    for line in lines:
        say(config, line, rung)
        s.failures.append({"test": "pytest-xdist workers", "rung": rung or "other", "backend": None, "format": None,
                           "when": "sessionfinish", "message": [line], "rerun": None})
    return deaths


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if is_worker(config):
        return
    s: RunSummary = config._nanoqwen
    out = config.getoption("--ladder-json")
    if out:  # written even when nothing ran (a shard may hold none of a rung's tests)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(s.as_json(), indent=1, default=str))
    tr = terminalreporter
    rungs = [r for r in (*ROWS, "other") if s.counts[r]]
    if not rungs:
        return
    tr.section("nanoqwen ladder")
    if config.getoption("--plant-fault"):
        tr.line(f"PLANTED FAULT {config.getoption('--plant-fault')}: this run is meant to fail", red=True)
    tr.line(f"{'rung':<8}{'run':>6}{'passed':>8}{'failed':>8}{'skipped':>9}")
    for r in rungs:
        c = s.counts[r]
        tr.line(f"{r:<8}{sum(c.values()):>6}{c['passed']:>8}{c['failed']:>8}{c['skipped']:>9}")
        for reason, n in s.skips[r].most_common():
            tr.line(f"          skipped {n}x: {reason}")
    if s.worst:
        tr.line("")
        tr.line(f"{'rung':<8}{'backend':<11}{'format':<18}{'op':<22}{'worst err / noise floor':>24}  case")
        for (r, b, f, o), rec in sorted(s.worst.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
            mult = rec["multiple"]
            shown = "exact" if mult == 0 else f"{mult:.2f}x"
            flag = "" if rec["passed"] else "  FAILED"
            tr.line(f"{r:<8}{str(b):<11}{f or '-':<18}{o:<22}{shown:>24}  {rec['case']}{flag}")
    for g in s.graph_summaries():
        tr.line("")
        tr.line(g.describe())
        for d in [d for r in s.graph if r["backend"] == g.backend for d in r["near_ties"]][:10]:
            tr.line(f"  near-tie: prompt {d['prompt_id']!r} position {d['position']}: reference {d['ref_token']}, "
                    f"engine {d['engine_token']}, margin {d['margin']:.4g}")
    for b in s.graph_bounds:
        from ladder.judges.tokens import GraphBounds

        tr.line(GraphBounds.from_record(b).describe())
    for (b, f), n in sorted(s.unsupported.items()):
        tr.line(f"UNSUPPORTED: backend {b} has no kernel for format {f}: {n} tests failed for it", red=True)
    for v in s.flip_verdicts():
        tr.line(v.describe(), red=not v.passed)

