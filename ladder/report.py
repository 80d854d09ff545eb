"""The ladder's report folder: report.json, report.md and one JUnit XML per rung, and the baseline diff.

`nanoqwen ladder` runs each rung as its own pytest process with `--ladder-json RUNG.json` and
`--junitxml junit-RUNG.xml`; this module folds the rung files into one report, renders it as
Markdown, and compares it with an earlier report (`--baseline DIR`): an op whose worst error grew by
more than BASELINE_GROWTH times its noise-floor multiple, or that newly fails, is a regression. The
graph rung's token summary (per backend: prompts, tokens, exact, near-ties, failures, the max logit
difference) travels with the bounds it was judged by and their derivation from the model's floor.
"""

from __future__ import annotations

import json
from pathlib import Path

from kernels import OPS
from ladder.tolerances import MAX_ALLOWED_PER_SPREAD

BASELINE_GROWTH = 1.5  # an op's worst multiple of its noise floor may grow this much before it is flagged
SLOWEST = 15  # the slowest tests over all rungs, in report.json and report.md


def merge(rung_results: dict[str, dict], meta: dict) -> dict:
    ops, calls, failures, rungs, skips, unsupported, slowest = [], [], [], {}, {}, [], []
    for rung, data in rung_results.items():
        slowest += [{**d, "rung": rung} for d in data.get("slowest", [])]
        unsupported += [{**u, "rung": rung} for u in data.get("unsupported", [])]
        rungs[rung] = {**data.get("rungs", {}).get(rung, {}), "exit": data.get("exit"), "seconds": data.get("seconds")}
        skips[rung] = data.get("skips", {}).get(rung, {})
        ops += [o for o in data.get("ops", []) if o["rung"] == rung]
        calls += [c for c in data.get("calls", []) if c["rung"] == rung]
        failures += data.get("failures", [])
    return {"meta": meta, "rungs": rungs, "skips": skips, "ops": ops, "calls": calls, "failures": failures,
            "unsupported": unsupported, "coverage": coverage(calls), "graph": graph_section(rung_results),
            "slowest": sorted(slowest, key=lambda d: -d["seconds"])[:SLOWEST]}


def conclude(rung_results: dict[str, dict], meta: dict, out: Path, failed: bool, baseline: dict | None = None,
             require_coverage: bool = False) -> tuple[dict, bool]:
    """Fold the rung results into the report, judge it and write it to `out`: a run that is `failed`
    already (a red rung) stays failed; a regression against `baseline`, or an op no rung called when
    `require_coverage`, fails it. Returns (report, failed). `nanoqwen ladder` and `ladder merge` both end here."""
    rep = merge(rung_results, meta)
    flips = [f for f in rep["graph"]["flips"] if not f["passed"]]
    if flips:
        failed = True
        rep["failures"] += [f"graph rung, near-tie flips on {f['backend']}: p = {f['p_value']:.3g}" for f in flips]
    if baseline is not None:
        rep["regressions"] = compare_baseline(rep, baseline)
        failed = failed or bool(rep["regressions"])
    uncovered = [f"{b}/{op}" for b, ops in rep["coverage"].items() for op, r in ops.items() if not r]
    if require_coverage and uncovered:
        failed = True
    rep["meta"]["result"] = "FAILED" if failed else "passed"
    write(out, rep)
    return rep, failed


def graph_section(rung_results: dict[str, dict]) -> dict:
    """The graph rung's token summary from the rung files (the plugin's `graph*` and `near_ties` keys):
    per backend totals, the bounds (each distinct one once), the near-tie flip rule judged on the totals
    (so a merge of shards judges all the shards' prompts together) and the near-ties."""
    from ladder.tokens import Summary, judge_flips

    out = {"backends": [], "bounds": [], "flips": [], "near_ties": []}
    for data in rung_results.values():
        out["backends"] += data.get("graph", [])
        out["bounds"] += [b for b in data.get("graph_bounds", []) if b not in out["bounds"]]
        out["near_ties"] += data.get("near_ties", [])
    fields = set(Summary.__dataclass_fields__)
    out["flips"] = [judge_flips(Summary(**{k: v for k, v in s.items() if k in fields})).record()
                    for s in out["backends"]]
    return out


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
    lines += _graph_markdown(report.get("graph") or {})
    if report["coverage"]:
        lines += ["", "## Coverage: rungs that called each op", "", "| backend | op | rungs |", "| --- | --- | --- |"]
        for b, ops in report["coverage"].items():
            for op, rungs in ops.items():
                lines.append(f"| {b} | {op} | {', '.join(rungs) if rungs else '**none: a finding**'} |")
    if report.get("regressions"):
        lines += ["", "## Regressions against the baseline", "", *[f"- {r}" for r in report["regressions"]]]
    if report.get("unsupported"):
        lines += ["", "## Unsupported formats (failed, never passed)", "",
                  *[f"- {u['rung']}: backend `{u['backend']}` has no kernel for format `{u['format']}` ({u['tests']} tests)"
                    for u in report["unsupported"]]]
    if report["failures"]:
        lines += ["", "## Failures", "", *[f"- `{f}`" for f in report["failures"]]]
    if report.get("slowest"):
        lines += ["", "## Slowest tests", "", "| rung | seconds | test |", "| --- | --- | --- |",
                  *[f"| {d['rung']} | {d['seconds']:.1f} | `{d['test']}` |" for d in report["slowest"]]]
    return "\n".join(lines) + "\n"


def _label(record: dict) -> str:
    """" [int8_sym_channel]" for a record of one format's model, "" for an unlabelled one."""
    return f" [{record['label']}]" if record.get("label") else ""


def _graph_markdown(g: dict) -> list[str]:
    if not (g.get("backends") or g.get("bounds")):
        return []
    lines = ["", "## Graph rung: greedy tokens against the HF simulation", "",
             "| backend | prompts | failed prompts | tokens | exact | near-ties | failures | max logit diff | allowed | near-tie eps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in g.get("backends", []):
        lines.append(f"| {s['backend']} | {s['prompts']} | {s['failed_prompts']} | {s['positions']} | {s['exact']} | "
                     f"{s['near_ties']} | {s['failures']} | {s['max_logit_diff']:.4g} | {s.get('allowed', float('nan')):.4g} | "
                     f"{s.get('eps', float('nan')):.4g} |")
    for b in g.get("bounds", []):
        lines += ["", f"Bounds{_label(b)}, derived from the model's noise floor (docs/LADDER.md, Token comparison):", "",
                  f"- floor {b['floor']:.4g} (99.9th percentile {b['floor_q999']:.4g}): the max abs logit difference "
                  f"of the plain fp32 forward with fp16 storage from the HF simulation, over {b['positions']} new "
                  f"positions of {len(b['prompts'])} prompts: {', '.join(b['prompts'])}",
                  f"- allowed logit difference: {b['factor']:g} x floor + {b['ulps']:g} ulp x {b['ref_scale']:.3g} "
                  f"(the largest reference logit) = {b['max_logit_diff']:.4g}",
                  f"- near-tie epsilon: {b['eps'] / b['max_logit_diff'] if b['max_logit_diff'] else 0:g} x allowed = "
                  f"{b['eps']:.4g}",
                  f"- at the floor prompts' {b.get('floor_close', 0)} close positions (reference margin under the "
                  f"epsilon) the plain forward flips {b.get('floor_flips', 0)}",
                  f"- allowed difference / spread of the logits {b['max_logit_diff'] / b['spread'] if b.get('spread') else 0:.3g} "
                  f"(a model over {MAX_ALLOWED_PER_SPREAD:g} is refused: no check could judge it)"]
    for s in g.get("backends", []):
        if s.get("prompt_ids"):
            lines += ["", f"Prompts compared on {s['backend']} ({len(s['prompt_ids'])}): "
                          + ", ".join(sorted(s["prompt_ids"]))]
    for f in g.get("flips", []):
        lines += ["", f"Near-tie flips on {f['backend']}: engine {f['flips']} of {f['close']} close positions, the plain "
                      f"forward {f['floor_flips']} of {f['floor_close']}; Fisher's exact test, one-sided, p = "
                      f"{f['p_value']:.3g}: **{'within the rule' if f['passed'] else 'FAILED'}**"]
    ties = g.get("near_ties", [])
    if ties:
        lines += ["", f"Near-ties ({len(ties)}, teacher-forced):", ""]
        lines += [f"- {d.get('backend', '?')}: prompt `{d['prompt_id']}` position {d['position']}: reference token {d['ref_token']}, engine "
                  f"token {d['engine_token']}, margin {d['margin']:.4g}" for d in ties[:20]]
        if len(ties) > 20:
            lines.append(f"- ... and {len(ties) - 20} more")
    return lines


def write(folder: Path, report: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (folder / "report.md").write_text(markdown(report))


def load(folder: Path) -> dict:
    path = Path(folder) / "report.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder}: no report.json (is it a `nanoqwen ladder` report folder?)")
    return json.loads(path.read_text())
