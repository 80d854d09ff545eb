"""Merging the shards' reports back into one.

    nanoqwen ladder --shard I/N ...          each of N machines runs shard I (1-based) of every rung
    nanoqwen ladder merge R1 R2 ... RN [--report OUT] [--baseline DIR] [--coverage]

Which shard a case belongs to is the plugin's (ladder/plugin/sharding.py). `merge` folds the shards' rung files (RUNG.json, junit-RUNG.xml) into one report folder, as if one
machine had run everything: counts and skip reasons summed (per rung, and per backend and format), each
op's worst error the worst over the shards (per rung, backend, format and op), op calls summed (so the
coverage table is the union), graph-rung totals summed with the largest logit difference kept, bounds
once each (the near-tie flip rule is judged again on the sums), failures (with their messages and rerun
commands; a shard written before failures carried them lists bare node ids, kept as they are) and
near-ties listed, one JUnit file per rung with every shard's test cases; the meta keeps the first
shard's commit and environment. It refuses (one line, exit 2) folders that are not ladder reports,
shards of different runs (model, formats, backends, rungs), a shard given twice or missing, and a mix of
sharded and unsharded reports.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from ladder.plugin.sharding import ShardError, parse_shard
from ladder.run import report as ladder_report


# ---- merging rung files -------------------------------------------------------------------------

_SUMMED_GRAPH = ("prompts", "failed_prompts", "positions", "exact", "near_ties", "failures", "close")


def _unique(records: list) -> list:
    out = []
    for r in records:
        if r not in out:
            out.append(r)
    return out


def merge_rung_data(parts: list[dict]) -> dict:
    """One rung JSON (ladder/plugin/__init__.py `--ladder-json`) from the same rung's JSON of several shards."""
    rungs: dict[str, Counter] = {}
    skips: dict[str, Counter] = {}
    worst: dict[tuple, dict] = {}
    calls: Counter = Counter()
    graph: dict[tuple, dict] = {}
    unsupported: Counter = Counter()
    cases: Counter = Counter()
    out = {"graph_bounds": [], "near_ties": [], "failures": []}
    for part in parts:
        for rung, counts in part.get("rungs", {}).items():
            rungs.setdefault(rung, Counter()).update(counts)
        for rung, reasons in part.get("skips", {}).items():
            skips.setdefault(rung, Counter()).update(reasons)
        for o in part.get("ops", []):
            key = ladder_report.op_key(o)
            if key not in worst or o["multiple"] > worst[key]["multiple"]:
                worst[key] = o
        for c in part.get("calls", []):
            calls[(c["rung"], c["backend"], c["op"])] += c["n"]
        for g in part.get("graph", []):
            key = (g["backend"], g.get("label"))
            if key not in graph:
                graph[key] = dict(g)
                continue
            m = graph[key]
            for k in _SUMMED_GRAPH:
                m[k] = m.get(k, 0) + g.get(k, 0)
            m["prompt_ids"] = sorted(m.get("prompt_ids", []) + g.get("prompt_ids", []))
            m["max_logit_diff"] = max(m.get("max_logit_diff", 0.0), g.get("max_logit_diff", 0.0))
            for k in ("min_margin", "allowed", "eps"):
                m[k] = min(m.get(k, float("inf")), g.get(k, float("inf")))
        for u in part.get("unsupported", []):
            unsupported[(u["backend"], u["format"])] += u["tests"]
        for c in part.get("cases", []):
            for outcome, n in c.items():
                if outcome not in ("backend", "format"):
                    cases[(c.get("backend"), c.get("format"), outcome)] += n
        out["graph_bounds"] += part.get("graph_bounds", [])
        out["near_ties"] += part.get("near_ties", [])
        out["failures"] += part.get("failures", [])
        out.setdefault("slowest", []).extend(part.get("slowest", []))
    called = {(b, op) for (_, b, op) in calls}
    backends = {b for (_, b, _) in calls}
    from kernels import OPS

    return {
        "rungs": {r: dict(c) for r, c in rungs.items()},
        "skips": {r: dict(c) for r, c in skips.items()},
        "ops": [worst[k] for k in sorted(worst, key=lambda k: tuple(str(x) for x in k))],
        "calls": [{"rung": r, "backend": b, "op": op, "n": n}
                  for (r, b, op), n in sorted(calls.items(), key=lambda kv: tuple(str(x) for x in kv[0]))],
        "ops_never_called": sorted({(b, op) for b in backends for op in OPS} - called),
        "graph": [graph[k] for k in sorted(graph, key=lambda k: tuple(str(x) for x in k))],
        "graph_bounds": _unique(out["graph_bounds"]),
        "near_ties": sorted(out["near_ties"], key=lambda d: (str(d.get("backend")), str(d.get("prompt_id")), d.get("position", 0))),
        "failures": sorted(out["failures"], key=_failure_order),
        **({"cases": ladder_report.cases_json(cases)} if cases else {}),
        "unsupported": [{"backend": b, "format": f, "tests": n} for (b, f), n in sorted(unsupported.items())],
        "slowest": sorted(out.get("slowest", []), key=lambda d: -d["seconds"])[:ladder_report.SLOWEST],
    }


def _failure_order(f) -> tuple:
    """Failures in node-id order, whether records (ladder/plugin/summary.py) or the bare node ids of older shards."""
    v = ladder_report.failure_view(f)
    return str(v["test"]), str(v.get("when"))


def merge_junit(paths: list[Path], out: Path) -> None:
    """One JUnit XML (xunit2) with every test case of `paths`, the suite counters summed."""
    merged = ET.Element("testsuites")
    suite = ET.SubElement(merged, "testsuite", name="pytest")
    totals = Counter()
    for path in paths:
        root = ET.parse(path).getroot()
        for s in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
            for k in ("tests", "failures", "errors", "skipped"):
                totals[k] += int(s.get(k, 0) or 0)
            totals["time"] += float(s.get("time", 0) or 0)
            for case in s.findall("testcase"):
                suite.append(case)
    for k in ("tests", "failures", "errors", "skipped"):
        suite.set(k, str(totals[k]))
    suite.set("time", f"{totals['time']:.3f}")
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)


# ---- merging report folders ---------------------------------------------------------------------

_SAME_RUN = ("model", "backends", "formats", "plant_fault")
# kept from the first shard: the machines of one run check out one commit; their libraries may differ
_FIRST_SHARDS = ("model_files", "commit", "dirty", "environment")


def _load(folder: Path) -> dict:
    try:
        return ladder_report.load(folder)
    except (OSError, ValueError) as e:
        raise ShardError(f"{folder}: {e}") from None


def merge_reports(folders: list[str], out: Path, baseline: dict | None = None, coverage: bool = False) -> tuple[dict, bool]:
    """Merge the shard report folders into `out`; returns (report, failed)."""
    if len(folders) < 1:
        raise ShardError("ladder merge: give the shards' report folders (at least one)")
    paths = [Path(f).expanduser().resolve() for f in folders]
    if len(set(paths)) != len(paths):
        raise ShardError("ladder merge: a report folder is given twice")
    if out in paths:
        raise ShardError(f"ladder merge: --report {out} is one of the inputs")
    reports = [_load(p) for p in paths]
    shards = [r["meta"].get("shard") for r in reports]
    if any(s is None for s in shards):
        if len(reports) > 1:
            raise ShardError(f"ladder merge: {paths[shards.index(None)]} is not a shard (run with --shard I/N)")
    else:
        parsed = [parse_shard(s) for s in shards]
        counts = {n for _, n in parsed}
        if len(counts) != 1:
            raise ShardError(f"ladder merge: the reports are shards of different splits: {sorted(shards)}")
        n = counts.pop()
        have = Counter(i for i, _ in parsed)
        twice = sorted(i for i, c in have.items() if c > 1)
        missing = sorted(set(range(1, n + 1)) - set(have))
        if twice:
            raise ShardError(f"ladder merge: shard(s) {twice} of {n} given more than once")
        if missing:
            raise ShardError(f"ladder merge: shard(s) {missing} of {n} missing")
    first = reports[0]["meta"]
    for p, r in zip(paths[1:], reports[1:]):
        for key in _SAME_RUN:
            if r["meta"].get(key) != first.get(key):
                raise ShardError(f"ladder merge: {p} ran {key} {r['meta'].get(key)!r}, {paths[0]} ran {first.get(key)!r}: "
                                 "not shards of one run")
        if list(r["rungs"]) != list(reports[0]["rungs"]):
            raise ShardError(f"ladder merge: {p} ran rungs {list(r['rungs'])}, {paths[0]} ran {list(reports[0]['rungs'])}")

    out.mkdir(parents=True, exist_ok=True)
    results, failed = {}, False
    for rung in reports[0]["rungs"]:
        parts = []
        for p in paths:
            f = p / f"{rung}.json"
            if not f.exists():
                raise ShardError(f"ladder merge: {p} has no {f.name} (its rung {rung} wrote no result)")
            parts.append(json.loads(f.read_text()))
        data = merge_rung_data(parts)
        (out / f"{rung}.json").write_text(json.dumps(data, indent=1, default=str))
        junits = [p / f"junit-{rung}.xml" for p in paths if (p / f"junit-{rung}.xml").exists()]
        if junits:
            merge_junit(junits, out / f"junit-{rung}.xml")
        exits = [r["rungs"][rung].get("exit") for r in reports]
        ran = sum(data["rungs"].get(rung, {}).values())
        code = next((c for c in exits if c not in (0, None)), 0)
        if ran == 0:  # empty in every shard: the rung did not run at all
            code = code or 5
        seconds = [r["rungs"][rung].get("seconds") or 0.0 for r in reports]
        results[rung] = {**data, "exit": code, "seconds": max(seconds)}
        failed |= code != 0
    meta = {**{k: first.get(k) for k in _SAME_RUN}, **{k: first.get(k) for k in _FIRST_SHARDS},
            "started": min(str(r["meta"].get("started")) for r in reports),
            "merged_from": [str(p) for p in paths], "shards": len(paths),
            "machine_seconds": sum(r["rungs"][g].get("seconds") or 0.0 for r in reports for g in r["rungs"])}
    return ladder_report.conclude(results, meta, out, failed, baseline, require_coverage=coverage)
