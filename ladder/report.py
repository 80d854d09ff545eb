"""The ladder's report folder: report.json, report.md and one JUnit XML per rung, and the baseline diff.

`nanoqwen ladder` runs each rung as its own pytest process with `--ladder-json RUNG.json` and
`--junitxml junit-RUNG.xml`; this module folds the rung files into one report, renders it as
Markdown, and compares it with an earlier report (`--baseline DIR`): an op whose worst error grew by
more than BASELINE_GROWTH times its noise-floor multiple, or that newly fails, is a regression.
"""

from __future__ import annotations

import json
from pathlib import Path

from kernels import OPS

BASELINE_GROWTH = 1.5  # an op's worst multiple of its noise floor may grow this much before it is flagged


def merge(rung_results: dict[str, dict], meta: dict) -> dict:
    ops, calls, failures, rungs, skips = [], [], [], {}, {}
    for rung, data in rung_results.items():
        rungs[rung] = {**data.get("rungs", {}).get(rung, {}), "exit": data.get("exit"), "seconds": data.get("seconds")}
        skips[rung] = data.get("skips", {}).get(rung, {})
        ops += [o for o in data.get("ops", []) if o["rung"] == rung]
        calls += [c for c in data.get("calls", []) if c["rung"] == rung]
        failures += data.get("failures", [])
    return {"meta": meta, "rungs": rungs, "skips": skips, "ops": ops, "calls": calls, "failures": failures,
            "coverage": coverage(calls)}


def coverage(calls: list[dict]) -> dict:
    """backend -> op -> sorted rungs that called it (an op with [] was called by no rung: a finding)."""
    table: dict[str, dict[str, set]] = {}
    for c in calls:
        table.setdefault(str(c["backend"]), {op: set() for op in OPS}).setdefault(c["op"], set()).add(c["rung"])
    return {b: {op: sorted(r) for op, r in ops.items()} for b, ops in table.items()}


def compare_baseline(report: dict, baseline: dict) -> list[str]:
    """Regressions of `report` against `baseline`: ops newly failing or grown past BASELINE_GROWTH."""
    old = {(o["rung"], str(o["backend"]), o["op"]): o for o in baseline.get("ops", [])}
    found = []
    for o in report["ops"]:
        key = (o["rung"], str(o["backend"]), o["op"])
        before = old.get(key)
        if before is None:
            continue
        if before.get("passed", True) and not o.get("passed", True):
            found.append(f"{'/'.join(key)}: newly fails ({o['multiple']:.3g}x its noise floor)")
        elif before["multiple"] > 0 and o["multiple"] > BASELINE_GROWTH * before["multiple"]:
            found.append(f"{'/'.join(key)}: worst error grew from {before['multiple']:.3g}x to "
                         f"{o['multiple']:.3g}x its noise floor (> {BASELINE_GROWTH}x growth)")
        elif before["multiple"] == 0 and o["multiple"] > 0:
            found.append(f"{'/'.join(key)}: was exact, now {o['multiple']:.3g}x its noise floor")
    return found


def _multiple(m: float) -> str:
    return "exact" if m == 0 else ("inf" if m == float("inf") else f"{m:.2f}x")


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = ["# nanoqwen ladder report", "",
             f"- model: `{m.get('model')}`", f"- backends: {', '.join(m.get('backends', []))}",
             f"- started: {m.get('started')}", f"- result: **{m.get('result')}**", ""]
    if m.get("plant_fault"):
        lines += [f"- planted fault: `{m['plant_fault']}` (this run is meant to fail)", ""]
    lines += ["## Rungs", "", "| rung | exit | passed | failed | skipped | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for rung, r in report["rungs"].items():
        lines.append(f"| {rung} | {r.get('exit')} | {r.get('passed', 0)} | {r.get('failed', 0)} | {r.get('skipped', 0)} | "
                     f"{r.get('seconds', 0):.1f} |")
    skip_lines = [f"- {rung}: {n}x {reason}" for rung, s in report["skips"].items() for reason, n in s.items()]
    if skip_lines:
        lines += ["", "Skipped, with reasons:", "", *skip_lines]
    lines += ["", "## Worst error per op, as a multiple of its noise floor", "",
              "| rung | backend | op | worst | max abs | case |", "| --- | --- | --- | --- | --- | --- |"]
    for o in report["ops"]:
        flag = "" if o.get("passed", True) else " FAILED"
        lines.append(f"| {o['rung']} | {o['backend']} | {o['op']} | {_multiple(o['multiple'])}{flag} | "
                     f"{o.get('max_abs', 0):.3g} | {o.get('case', '')} |")
    if report["coverage"]:
        lines += ["", "## Coverage: rungs that called each op", "", "| backend | op | rungs |", "| --- | --- | --- |"]
        for b, ops in report["coverage"].items():
            for op, rungs in ops.items():
                lines.append(f"| {b} | {op} | {', '.join(rungs) if rungs else '**none: a finding**'} |")
    if report.get("regressions"):
        lines += ["", "## Regressions against the baseline", "", *[f"- {r}" for r in report["regressions"]]]
    if report["failures"]:
        lines += ["", "## Failures", "", *[f"- `{f}`" for f in report["failures"]]]
    return "\n".join(lines) + "\n"


def write(folder: Path, report: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (folder / "report.md").write_text(markdown(report))


def load(folder: Path) -> dict:
    path = Path(folder) / "report.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder}: no report.json (is it a `nanoqwen ladder` report folder?)")
    return json.loads(path.read_text())
