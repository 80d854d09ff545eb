"""The ladder's report folder: report.json, report.md, report.png and one JUnit XML per rung, and the
baseline diff.

`nanoqwen ladder` runs each rung as its own pytest process with `--ladder-json RUNG.json` and
`--junitxml junit-RUNG.xml`; this module folds the rung files into one report, renders it as
Markdown, and compares it with an earlier report (`--baseline DIR`): an op whose worst error grew by
more than BASELINE_GROWTH times its noise-floor multiple, or that newly fails, is a regression. Every op
record is keyed by (rung, backend, format, op), so one format's op that grows cannot hide behind another
format's larger error. The graph rung's token summary (per backend: prompts, tokens, exact, near-ties,
failures, the max logit difference) travels with the bounds it was judged by and their derivation.

A red report is meant to be triaged from the folder alone: report.md opens with what ran (model,
formats, the backends that ran tests, the commit and library versions), then each failure with the first
lines of its message and its rerun command, and the next commands to run (`nanoqwen descend` for the
first failing case's backend and format; `nanoqwen bisect` from the baseline's commit); report.png
draws each op's error over its bound, per format and backend, beside the baseline's.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

from kernels import OPS
from ladder.judges.tolerances import MAX_ALLOWED_PER_SPREAD
from ladder.plugin.summary import SLOWEST, cases_json  # noqa: F401  (made by the plugin's summary; merge reads them here)

BASELINE_GROWTH = 1.5  # an op's worst multiple of its noise floor may grow this much before it is flagged
FAILURES_SHOWN = 20  # failures with their messages in report.md (report.json keeps every one)
NO_FORMAT = "-"  # how a record of a case that runs in no format (rmsnorm, embed) shows its format
CHART = "report.png"


class LoadedReport(dict):
    """A report read from its folder: the dict, and `.folder`, where it was read (the next commands name
    a baseline by its folder). Equal to the plain dict it holds."""

    folder: Path | None = None


def environment(root: Path) -> dict:
    """What a run ran on, for report.json's meta: the commit of `root` where it is a git checkout (else
    None) and whether its tree is dirty, the Python and library versions (None where absent; read from
    the installed distributions, so torch is not imported for it), and the GPU and driver where CuPy and a
    GPU are present. Nothing here may fail a run or hold it up: every probe is guarded."""
    from importlib import metadata, util

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    commit, dirty = _commit(Path(root))
    env = {"python": sys.version.split()[0], "numpy": version("numpy"), "torch": version("torch"),
           "transformers": version("transformers"), "pytest": version("pytest"), "pytest-xdist": version("pytest-xdist"),
           "hypothesis": version("hypothesis"), "cupy": None, "gpu": None, "driver": None}
    if util.find_spec("cupy") is not None:  # without CuPy nothing below is imported or asked
        # CuPy ships as one of several wheels (cupy-cuda12x, ...): the distribution that provides `cupy`
        env["cupy"] = version("cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x") or \
            next(iter(version(d) for d in metadata.packages_distributions().get("cupy", [])), None)
        env["gpu"], env["driver"] = _gpu()
    return {"commit": commit, "dirty": dirty, "environment": env}


def _commit(root: Path) -> tuple[str | None, bool | None]:
    """(HEAD, tree dirty) of `root` when it is the top of a git checkout; (None, None) otherwise (an
    installed package, which may sit inside some other repository)."""
    from ladder.changes import git

    try:
        top = git.run(root, "rev-parse", "--show-toplevel", check=False)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
            return None, None
        head = git.run(root, "rev-parse", "HEAD", check=False)
        status = git.run(root, "status", "--porcelain", "--untracked-files=no", check=False)
    except (RuntimeError, OSError):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def _gpu() -> tuple[str | None, str | None]:
    """(name of GPU 0, driver version) through CuPy; (None, None) where there is no GPU or CuPy fails."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, None
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        v = cupy.cuda.runtime.driverGetVersion()  # e.g. 13000: CUDA 13.0, what the driver supports
        cuda = f"CUDA {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001: a GPU probe must never fail a run
        return None, None
    release = _driver_release()
    return name, (f"{release} ({cuda})" if release else cuda)


def _driver_release() -> str | None:
    """The driver's own release (e.g. 580.95.05), which CUDA does not give: nvidia-smi's, where it answers."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    try:
        r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, timeout=10) if smi else None
    except (OSError, subprocess.SubprocessError):
        return None
    lines = r.stdout.split() if r is not None and r.returncode == 0 else []
    return lines[0] if lines else None


def failure_view(f) -> dict:
    """A failure as report.md shows it: a record of ladder/plugin/summary.py, or the bare node id (or sentence)
    that rung files written before the records held."""
    if isinstance(f, dict):
        return {"test": None, "rung": None, "backend": None, "format": None, "message": [], "rerun": None, **f}
    return {"test": str(f), "rung": None, "backend": None, "format": None, "message": [], "rerun": None}


def op_key(o: dict) -> tuple:
    """(rung, backend, format, op) of an op record; a record from before formats were recorded has None."""
    return (o["rung"], str(o["backend"]), o.get("format"), o["op"])


def _key_text(key: tuple) -> str:
    return "/".join(NO_FORMAT if k is None else str(k) for k in key)


def ran(rung_results: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(backends, formats) that ran at least one test (passed or failed, not only skipped), from the rung
    files' per-case counts; rung files without them give the backends of their op calls and records."""
    backends, formats = set(), set()
    for data in rung_results.values():
        for c in data.get("cases", []):
            if c.get("passed", 0) + c.get("failed", 0) > 0:
                backends.add(c.get("backend"))
                formats.add(c.get("format"))
        if "cases" not in data:
            backends |= {c.get("backend") for c in data.get("calls", [])} | {o.get("backend") for o in data.get("ops", [])}
            formats |= {o.get("format") for o in data.get("ops", [])}
    return sorted(str(b) for b in backends if b is not None), sorted(str(f) for f in formats if f is not None)


def merge(rung_results: dict[str, dict], meta: dict) -> dict:
    ops, calls, failures, rungs, skips, unsupported, slowest = [], [], [], {}, {}, [], []
    backends_ran, formats_ran = ran(rung_results)
    meta = {**meta, "backends_ran": backends_ran, "formats_ran": formats_ran}
    for rung, data in rung_results.items():
        slowest += [{**d, "rung": rung} for d in data.get("slowest", [])]
        unsupported += [{**u, "rung": rung} for u in data.get("unsupported", [])]
        rungs[rung] = {**data.get("rungs", {}).get(rung, {}), "exit": data.get("exit"), "seconds": data.get("seconds"),
                       **({"kept": data["kept"]} if data.get("kept") else {})}
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
        known = {failure_view(f)["test"] for f in rep["failures"]}
        rep["failures"] += [{"test": f"graph rung, near-tie flips on {f['backend']}", "rung": "graph", "backend": f["backend"],
                             "format": None, "message": [f"near-tie flips on {f['backend']}: p = {f['p_value']:.3g}"],
                             "rerun": None} for f in flips if f"graph rung, near-tie flips on {f['backend']}" not in known]
    regressed = []
    if baseline is not None:
        regressed = regressions(rep, baseline)
        rep["regressions"] = [text for _, text in regressed]
        folder = getattr(baseline, "folder", None) or meta.get("baseline")
        rep["baseline"] = {"folder": None if folder is None else str(folder),
                           "commit": (baseline.get("meta") or {}).get("commit"),
                           "started": (baseline.get("meta") or {}).get("started")}
        failed = failed or bool(regressed)
    uncovered = [f"{b}/{op}" for b, ops in rep["coverage"].items() for op, r in ops.items() if not r]
    if require_coverage and uncovered:
        failed = True
    rep["meta"]["result"] = "FAILED" if failed else "passed"
    rep["next"] = next_commands(rep, [key for key, _ in regressed]) if failed else []
    write(out, rep, baseline)
    return rep, failed


def next_commands(report: dict, regressed: list[tuple] = ()) -> list[str]:
    """What to run after a red report: `nanoqwen descend` on the first failing case's backend and format
    (else the first regressed op's), with the run's --model; and, given a baseline whose report holds its
    commit, `nanoqwen bisect` from that commit."""
    m = report["meta"]
    cases = [failure_view(f) for f in report.get("failures", [])]
    first = next((c for c in cases if c["backend"] not in (None, "?")), None)
    backend, fmt = (first["backend"], first["format"]) if first else \
        next(((k[1], k[2]) for k in regressed), (None, None))
    cmd = ["nanoqwen", "descend"]
    if backend not in (None, "?"):
        cmd += ["--backend", str(backend)]
    if fmt not in (None, "?"):
        cmd += ["--quant", str(fmt)]
    if m.get("model") not in (None, "default"):
        cmd += ["--model", str(m["model"])]
    out = [shlex.join(cmd)]
    base = report.get("baseline") or {}
    if base.get("folder") and base.get("commit"):
        out.append(shlex.join(["nanoqwen", "bisect", "--good", str(base["commit"]), "--baseline", base["folder"]]))
    return out


def graph_section(rung_results: dict[str, dict]) -> dict:
    """The graph rung's token summary from the rung files (the plugin's `graph*` and `near_ties` keys):
    per backend totals, the bounds (each distinct one once), the near-tie flip rule judged on the totals
    (so a merge of shards judges all the shards' prompts together) and the near-ties."""
    from ladder.judges.tokens import Summary, judge_flips

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
    """Regressions of `report` against `baseline`: ops newly failing or grown past BASELINE_GROWTH, each
    compared with the same (rung, backend, format, op) of the baseline. A baseline written before formats
    were recorded has format None in every key: its records match tonight's records of no format."""
    return [text for _, text in regressions(report, baseline)]


def regressions(report: dict, baseline: dict) -> list[tuple[tuple, str]]:
    """compare_baseline's findings with the key each is about."""
    old = {op_key(o): o for o in baseline.get("ops", [])}
    found = []
    for o in report["ops"]:
        key = op_key(o)
        before = old.get(key)
        if before is None:
            continue
        name = _key_text(key)
        if before.get("passed", True) and not o.get("passed", True):
            found.append((key, f"{name}: newly fails ({o['multiple']:.3g}x its noise floor)"))
        elif before["multiple"] > 0 and o["multiple"] > BASELINE_GROWTH * before["multiple"]:
            found.append((key, f"{name}: worst error grew from {before['multiple']:.3g}x to "
                               f"{o['multiple']:.3g}x its noise floor (> {BASELINE_GROWTH}x growth)"))
        elif before["multiple"] == 0 and o["multiple"] > 0:
            found.append((key, f"{name}: was exact, now {o['multiple']:.3g}x its noise floor"))
    return found


def _multiple(m: float) -> str:
    return "exact" if m == 0 else ("inf" if m == float("inf") else f"{m:.2f}x")


def _names(values) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def _header(report: dict) -> list[str]:
    """What ran, on what, and the verdict: the lines a red night is triaged from first."""
    m = report["meta"]
    env = m.get("environment") or {}
    lines = ["# nanoqwen ladder report", "", f"- result: **{m.get('result')}**",
             f"- model: `{m.get('model')}`" + (f" (files: {', '.join(f'`{f}`' for f in m['model_files'])})"
                                               if m.get("model_files") else ""),
             f"- formats: {_names(m.get('formats'))}" + (f" (ran tests: {_names(m['formats_ran'])})"
                                                          if "formats_ran" in m else ""),
             f"- backends that ran tests: {_names(m.get('backends_ran'))} (asked: {_names(m.get('backends'))})",
             f"- commit: {'`' + m['commit'] + '`' if m.get('commit') else 'not a git checkout'}"
             + (" (tree dirty: uncommitted changes)" if m.get("dirty") else ""),
             "- environment: " + (", ".join(f"{k} {v if v is not None else '-'}" for k, v in env.items()
                                            if k not in ("gpu", "driver")) or "not recorded"),
             f"- GPU: {env['gpu']} (driver: {env.get('driver') or '-'})" if env.get("gpu") else "- GPU: none",
             f"- started: {m.get('started')}"]
    if m.get("resources"):
        from ladder.run.resources import describe

        lines.append(f"- machine: {describe(m['resources'])}")
    if m.get("seconds") is not None:
        lines.append(f"- wall time: {m['seconds']} s from the start to the report")
    if m.get("model_seconds") is not None:
        lines.append(f"- model resolved in {m['model_seconds']} s (conversions included, where not cached)")
    if m.get("side_by_side"):
        sbs = m["side_by_side"]
        each = ", ".join(f"{r} ({sbs['workers'].get(r)} workers)" for r in sbs["rungs"])
        lines.append(f"- rungs side by side: {each}; {sbs['seconds']} s of wall time together (each rung's seconds "
                     "are its own)")
    if m.get("shard"):
        lines.append(f"- shard: {m['shard']}")
    if m.get("shards"):
        lines.append(f"- merged from {m['shards']} shard report(s)")
    lines.append("")
    if m.get("plant_fault"):
        lines += [f"- planted fault: `{m['plant_fault']}` (this run is meant to fail)", ""]
    if report.get("next"):
        lines += ["## Next commands", "", "```", *report["next"], "```", ""]
    return lines


def _failures_markdown(report: dict) -> list[str]:
    cases = [failure_view(f) for f in report.get("failures", [])]
    if not cases:
        return []
    lines = [f"## Failures ({len(cases)})", ""]
    for i, c in enumerate(cases[:FAILURES_SHOWN], 1):
        where = ", ".join(x for x in (f"{c['rung']} rung" if c["rung"] else None,
                                      f"backend {c['backend']}" if c["backend"] else None,
                                      f"format {c['format'] or NO_FORMAT}" if c["rung"] else None) if x)
        lines += [f"{i}. `{c['test']}`" + (f": {where}" if where else "")]
        body = [*c["message"], *([f"rerun: {c['rerun']}"] if c["rerun"] else [])]
        if body:
            lines += ["", "   ```", *[f"   {ln}" for ln in body], "   ```", ""]
    if len(cases) > FAILURES_SHOWN:
        lines.append(f"- ... and {len(cases) - FAILURES_SHOWN} more (report.json lists every one)")
    return lines  # the header ends with its blank line


def markdown(report: dict, chart: str | None = None) -> str:
    """report.md. `chart`: the chart's file name, or the sentence saying why there is none."""
    lines = _header(report)
    lines += _failures_markdown(report)
    if report.get("regressions"):
        base = report.get("baseline") or {}
        lines += ["", "## Regressions against the baseline", "",
                  *([f"Baseline: `{base['folder']}` (commit {base.get('commit') or 'not recorded'})", ""]
                    if base.get("folder") else []),
                  *[f"- {r}" for r in report["regressions"]]]
    lines += ["", "## Rungs", "", "| rung | exit | passed | failed | skipped | seconds |",
              "| --- | --- | --- | --- | --- | --- |"]
    for rung, r in report["rungs"].items():
        lines.append(f"| {rung} | {r.get('exit')} | {r.get('passed', 0)} | {r.get('failed', 0)} | {r.get('skipped', 0)} | "
                     f"{r.get('seconds', 0) or 0:.1f} |")
    kept = [f"- {rung}: not run again: the result of its green run at {r['kept']['at']} ({r['kept']['seconds']} s), "
            f"kept under the same sources, versions, device, model and options (key {r['kept']['key']}; "
            f"`--fresh` runs it)" for rung, r in report["rungs"].items() if r.get("kept")]
    if kept:
        lines += ["", "Kept results:", "", *kept]
    skip_lines = [f"- {rung}: {n}x {reason}" for rung, s in report["skips"].items() for reason, n in s.items()]
    if skip_lines:
        lines += ["", "Skipped, with reasons:", "", *skip_lines]
    lines += ["", "## Error over bound per op", ""]
    if chart and chart.endswith(".png"):
        lines += [f"![each op's worst error over its bound, per format and backend]({chart})", "",
                  "One mark per format and backend, at the op's worst error divided by its bound (log scale; over "
                  "1.0 fails); hollow marks beside them are the baseline's. Exact ops (bound and error 0) sit on "
                  "the bottom edge, an infinite ratio (NaN, or an exact op that differs) on the top edge."]
    elif chart:
        lines.append(chart)
    lines += ["", "## Worst error per op, as a multiple of its noise floor", "",
              "| rung | backend | format | op | worst | max abs | bound | case |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for o in report["ops"]:
        flag = "" if o.get("passed", True) else " FAILED"
        bound = o.get("bound")
        lines.append(f"| {o['rung']} | {o['backend']} | {o.get('format') or NO_FORMAT} | {o['op']} | "
                     f"{_multiple(o['multiple'])}{flag} | {o.get('max_abs', 0):.3g} | "
                     f"{'-' if bound is None else f'{bound:.3g}'} | {o.get('case', '')} |")
    lines += _graph_markdown(report.get("graph") or {})
    if report["coverage"]:
        lines += ["", "## Coverage: rungs that called each op", "", "| backend | op | rungs |", "| --- | --- | --- |"]
        for b, ops in report["coverage"].items():
            for op, rungs in ops.items():
                lines.append(f"| {b} | {op} | {', '.join(rungs) if rungs else '**none: a finding**'} |")
    if report.get("unsupported"):
        lines += ["", "## Unsupported formats (failed, never passed)", "",
                  *[f"- {u['rung']}: backend `{u['backend']}` has no kernel for format `{u['format']}` ({u['tests']} tests)"
                    for u in report["unsupported"]]]
    if report.get("slowest"):
        lines += ["", "## Slowest tests", "", "| rung | seconds | test |", "| --- | --- | --- |",
                  *[f"| {d['rung']} | {d['seconds']:.1f} | `{d['test']}` |" for d in report["slowest"]]]
    return "\n".join(lines) + "\n"


# ---- the chart: error over bound, per op, per format and backend ---------------------------------


def over_bound(o: dict) -> float | None:
    """An op record's worst error divided by its bound: 0.0 for an exact op (bound and error 0), inf for
    NaN or an exact op that differs, None for a record without its bound (written before bounds were kept)."""
    err, bound = o.get("max_abs"), o.get("bound")
    if err is None or bound is None:
        return None
    if isinstance(err, str) or isinstance(bound, str):  # json of a NaN or inf written with default=str
        err, bound = float(err), float(bound)
    if math.isnan(err):
        return math.inf
    if bound > 0:
        return err / bound
    return 0.0 if err == 0 else math.inf


def _series(ops: list[dict]) -> dict[tuple, dict[str, float]]:
    """(format, backend) -> op -> the largest error over bound over the rungs that checked it."""
    out: dict[tuple, dict[str, float]] = {}
    for o in ops:
        r = over_bound(o)
        if r is None:
            continue
        row = out.setdefault((o.get("format"), str(o["backend"])), {})
        row[o["op"]] = max(row.get(o["op"], 0.0), r)
    return out


def chart(report: dict, path: Path, baseline: dict | None = None) -> str:
    """Draw report.png; returns its file name, or the sentence report.md shows instead of it."""
    try:
        import matplotlib
    except ImportError:
        return "no chart: matplotlib is not installed"
    matplotlib.use("Agg")  # a file, never a window: reports are written on headless machines
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    now = _series(report["ops"])
    before = _series(baseline.get("ops", [])) if baseline else {}
    if not now:
        return "no chart: no op recorded an error and a bound"
    order = {op: i for i, op in enumerate(OPS)}
    ops = sorted({op for row in (*now.values(), *before.values()) for op in row}, key=lambda op: (order.get(op, len(order)), op))
    x_of = {op: i for i, op in enumerate(ops)}
    keys = sorted(now, key=lambda k: (k[0] is None, str(k[0]), k[1]))
    formats = sorted({k[0] for k in keys} | {k[0] for k in before}, key=lambda f: (f is None, str(f)))
    backends = sorted({k[1] for k in keys} | {k[1] for k in before})
    colours = {f: ("0.45" if f is None else plt.cm.tab10(i % 10)) for i, f in enumerate(formats)}
    marks = {b: "osD^v<>p"[i % 8] for i, b in enumerate(backends)}
    finite = [r for row in (*now.values(), *before.values()) for r in row.values() if 0 < r < math.inf]
    bottom = min(min(finite, default=1.0), 1.0) / 4
    top = max(max(finite, default=1.0), 1.0) * 4

    def y(r: float) -> float:  # exact ops on the bottom edge, infinite ratios on the top edge
        return bottom if r == 0 else (top if r == math.inf else r)

    fig, ax = plt.subplots(figsize=(max(8.0, 0.75 * len(ops) + 3.0), 5.0))
    ax.axhspan(1.0, top * 1.5, color="red", alpha=0.06, zorder=0)
    ax.axhline(1.0, color="red", linewidth=1.2, zorder=1)
    ax.text(len(ops) - 0.5, 1.0, " bound", color="red", va="bottom", ha="right", fontsize=8)
    for op in ops:  # the series that checked this op share its slot, centred on its tick
        present = [k for k in keys if op in now[k] or op in before.get(k, {})]
        slot = min(0.8 / max(len(present), 1), 0.25)
        exact = False
        for j, key in enumerate(present):
            x = x_of[op] + (j - (len(present) - 1) / 2) * slot
            style = {"color": colours[key[0]], "marker": marks[key[1]], "linestyle": "none", "markersize": 7}
            if op in now[key]:
                ax.plot([x], [y(now[key][op])], zorder=3, **style)
                exact |= now[key][op] == 0
            if op in before.get(key, {}):  # the baseline's mark, hollow, a little to the right of tonight's
                ax.plot([x + slot * 0.4], [y(before[key][op])], zorder=2, markerfacecolor="none", alpha=0.7, **style)
        if exact:
            ax.text(x_of[op], bottom * 1.35, "exact", ha="center", va="bottom", fontsize=7, color="0.35")
    ax.set_yscale("log")
    # Plain tick labels (0.1, 1, 10): the default's 10^k is mathtext, whose parsing was a third of the chart's
    # time (0.52 -> 0.37 s a report; the self-tests write dozens).
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom / 1.5, top * 1.5)
    ax.set_xlim(-0.6, len(ops) - 0.4)
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels(ops, rotation=35, ha="right", fontsize=8)
    for i in range(len(ops) - 1):
        ax.axvline(i + 0.5, color="0.9", linewidth=0.8, zorder=0)
    ax.set_ylabel("worst error / bound (log)")
    m = report["meta"]
    ax.set_title(f"error over bound per op: model {Path(str(m.get('model'))).name}, {m.get('result')}"
                 + (f", commit {str(m['commit'])[:10]}" if m.get("commit") else ""), fontsize=10)
    handles = [Line2D([], [], color=colours[f], marker=marks[b], linestyle="none", label=f"{f or NO_FORMAT} / {b}")
               for f, b in keys]
    if before:
        handles.append(Line2D([], [], color="0.3", marker="o", markerfacecolor="none", linestyle="none",
                              label="hollow: the baseline"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="format / backend",
              title_fontsize=7)
    fig.text(0.01, 0.01, "bottom edge: exact (bound 0, error 0); top edge: infinite (NaN, or an exact op that "
                         "differs); above the red line: fails", fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


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


def write(folder: Path, report: dict, baseline: dict | None = None) -> None:
    """report.json, report.png (with the baseline's marks when there is one) and report.md."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (folder / CHART).unlink(missing_ok=True)  # a chart of an earlier run in the same folder must not stay
    try:
        drawn = chart(report, folder / CHART, baseline)
    except Exception as e:  # noqa: BLE001: a chart that cannot be drawn must not cost the report
        drawn = f"no chart: {type(e).__name__}: {e}"
    (folder / "report.md").write_text(markdown(report, drawn))


def load(folder: Path) -> LoadedReport:
    path = Path(folder) / "report.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder}: no report.json (is it a `nanoqwen ladder` report folder?)")
    rep = LoadedReport(json.loads(path.read_text()))
    rep.folder = Path(folder).resolve()
    return rep
