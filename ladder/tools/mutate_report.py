"""The report of `nanoqwen mutate` (ladder/tools/mutate.py): counts per file and per kernel function, the
score, the comparison with a baseline report and the gate on it, and `mutate.md`.

The score is (killed + timed_out) / (killed + timed_out + survived); mutants that do not compile, that no
case launches, and reviewed equivalents are counted apart and not scored.
"""

from __future__ import annotations

from collections import Counter, defaultdict

DETECTED = ("killed", "timed_out")


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
    row = lambda c: {**{k: c[k] for k in ("killed", "timed_out", "survived", "did_not_compile", "not_launched", "not_run",  # noqa: E731
                                          "equivalent")},
                     "score": score(c)}
    return {"total": row(total),
            "files": {f: row(c) for f, c in sorted(by_file.items())},
            "functions": [{"file": f, "function": fn, **row(c)} for (f, fn), c in sorted(by_function.items())]}


TREND_NIGHTS = 30  # the runs a report's trend keeps, newest last


def trend(report: dict, baseline: dict | None) -> list[dict]:
    """The baseline's trend with this run appended (the last TREND_NIGHTS): one entry a run, its date,
    seed, counts and score. A nightly's rotating sample (`--seed date`) draws other mutants every night,
    so no two nights compare mutant by mutant; their trend is the score of samples nobody tuned to."""
    meta, t = report["meta"], report["summary"]["total"]
    entry = {"started": meta["started"], "seed": meta["seed"], "run": meta["run"],
             **{k: t[k] for k in (*DETECTED, "survived", "did_not_compile", "not_run")}, "score": t["score"]}
    return [*(baseline or {}).get("trend", []), entry][-TREND_NIGHTS:]


def trend_line(entries: list[dict]) -> str:
    """One line: this run's score and the pooled score of the runs the trend keeps."""
    pooled = Counter()
    for e in entries:
        pooled.update({k: e[k] for k in (*DETECTED, "survived")})
    last = entries[-1]
    return (f"trend: this run {_pct(last['score'])} (seed {last['seed']}); the last {len(entries)} run(s) together "
            f"{_pct(score(pooled))} ({sum(pooled[k] for k in DETECTED)} detected, {pooled['survived']} survived)")


def compare(current: dict, baseline: dict) -> dict:
    """Per file, the score here and in the baseline; the mutants the baseline killed that survive here,
    and those it let survive that are killed here."""
    old = {r["signature"]: r["outcome"] for r in baseline.get("mutants", [])}
    # A mutant the baseline detected that survives here, or that no case launches any more (its cases
    # stopped running that code): the rungs lost it.
    regressed = [r for r in current["mutants"] if r["outcome"] in ("survived", "not_launched")
                 and old.get(r["signature"]) in DETECTED]
    fixed = [r for r in current["mutants"] if r["outcome"] in DETECTED and old.get(r["signature"]) == "survived"]
    files = {}
    for f, row in current["summary"]["files"].items():
        before = baseline.get("summary", {}).get("files", {}).get(f, {}).get("score")
        files[f] = {"score": row["score"], "baseline": before}
    # The score over the mutants both runs scored: the same seed draws the same sample while the sources
    # keep their signatures, so this compares like with like (a whole-run score would not, across samples).
    both = [(old[r["signature"]], r["outcome"]) for r in current["mutants"]
            if old.get(r["signature"]) in (*DETECTED, "survived") and r["outcome"] in (*DETECTED, "survived", "not_launched")]
    share = lambda i: sum(pair[i] in DETECTED for pair in both) / len(both) if both else None  # noqa: E731
    return {"files": files, "newly_surviving": [r["signature"] for r in regressed],
            "newly_killed": [r["signature"] for r in fixed],
            "common": {"mutants": len(both), "baseline_score": share(0), "score": share(1)}}


def regressions(report: dict) -> list[str]:
    """Why the run is worse than its baseline: each mutant the baseline detected that is lost here, and a
    lower score over the mutants both scored. Empty: as strong as the baseline, or stronger."""
    b = report.get("baseline")
    if not b:
        return []
    lines = [f"killed in the baseline, {'survives' if _outcome(report, sig) == 'survived' else 'no longer launched'} "
             f"here: {sig}" for sig in b["newly_surviving"]]
    c = b.get("common", {})
    if c.get("score") is not None and c["score"] < c["baseline_score"]:
        lines.append(f"score over the {c['mutants']} mutants both runs scored: {_pct(c['score'])}, "
                     f"baseline {_pct(c['baseline_score'])}")
    return lines


def _outcome(report: dict, signature: str) -> str | None:
    return next((r["outcome"] for r in report["mutants"] if r["signature"] == signature), None)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(report: dict) -> str:
    s, meta = report["summary"], report["meta"]
    lines = ["# Mutation report", "",
             f"Backend `{meta['backend']}`, rungs {', '.join(meta['rungs'])}, {meta['run']} of {meta['candidates']} "
             f"mutants run (seed {meta['seed']}), {meta['seconds']:.0f} s. Score = detected / (detected + survived); "
             "mutants that do not compile, that sit in code no case launches, and reviewed equivalents are not scored."
             + (f" {s['total']['not_run']} mutants were not run: the time given (--budget, --within) was spent."
                if s["total"].get("not_run") else ""), "",
             "| file | killed | timed out | survived | did not compile | not launched | equivalent | score |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f, r in [*s["files"].items(), ("**total**", s["total"])]:
        lines.append(f"| {f} | {r['killed']} | {r['timed_out']} | {r['survived']} | {r['did_not_compile']} | "
                     f"{r.get('not_launched', 0)} | {r['equivalent']} | {_pct(r['score'])} |")
    lines += ["", "## Per kernel function", "", "| file | function | detected | survived | score |", "| --- | --- | --- | --- | --- |"]
    for r in s["functions"]:
        lines.append(f"| {r['file']} | {r['function']} | {r['killed'] + r['timed_out']} | {r['survived']} | {_pct(r['score'])} |")
    survivors = [r for r in report["mutants"] if r["outcome"] == "survived"]
    lines += ["", f"## Survivors ({len(survivors)})", ""]
    lines += [f"- `{r['file']}:{r['line']}` in `{r['function']}`: `{r['original']}` -> `{r['replacement']}` "
              f"({r['kind']}; signature `{r['signature']}`)" for r in survivors] or ["none"]
    caught = [r for r in report["mutants"] if r.get("caught_by")]
    if caught or any(r.get("second_look") for r in survivors):
        lines += ["", f"## Caught by the second look ({len(caught)}, counted as killed)", "",
                  "Each survivor ran again under compute-sanitizer memcheck and racecheck, CuPy's memory pool off: "
                  "first the backend's op sweep (every op at its edges, each input its own allocation), then the "
                  "survivor's unit-rung cases: a memory error or a race no value check could see.", ""]
        lines += [f"- `{r['file']}:{r['line']}` in `{r['function']}`: `{r['original']}` -> `{r['replacement']}`: "
                  f"caught by {r['caught_by']}" for r in caught] or ["none"]
        looked = [r for r in survivors if r.get("second_look")]
        lines += [f"- survivor `{r['file']}:{r['line']}` `{r['original']}` -> `{r['replacement']}`: {r['second_look']}"
                  for r in looked]
    hung = [r for r in report["mutants"] if r["outcome"] == "timed_out"]
    lines += ["", f"## Timed out ({len(hung)}, counted as detected)", "",
              "A mutant whose case ran past its own limit (20 s + 3x its clean time) was killed by the watchdog, "
              "which names the case: a hang the rungs caught. One without a case ran past the whole run's timeout.", ""]
    lines += [f"- `{r['file']}:{r['line']}` in `{r['function']}`: `{r['original']}` -> `{r['replacement']}`: "
              + (f"hung in `{r['hung']['case']}` (killed after {r['hung']['after']} s)" if r.get("hung")
                 else f"past the run's timeout in the {r['rung']} rung") for r in hung] or ["none"]
    idle = [r for r in report["mutants"] if r["outcome"] == "not_launched"]
    lines += ["", f"## Not launched by any case of the rungs run ({len(idle)}, not scored)", ""]
    lines += [f"- `{r['file']}:{r['line']}` in `{r['function']}`: `{r['original']}` -> `{r['replacement']}`" for r in idle[:200]] or ["none"]
    eq = report["equivalents"]
    lines += ["", f"## Reviewed equivalent mutants ({len(eq)}, not run, not scored)", ""]
    lines += [f"- `{e['file']}:{e['line']}`: `{e['original']}` -> `{e['replacement']}`: {e['reason']}" for e in eq.values()] or ["none"]
    if len(report.get("trend", [])) > 1:
        lines += ["", "## Trend (this run last)", "", trend_line(report["trend"]), "",
                  "| started | seed | run | detected | survived | score |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {e['started']} | {e['seed']} | {e['run']} | {sum(e[k] for k in DETECTED)} | {e['survived']} | "
                  f"{_pct(e['score'])} |" for e in report["trend"]]
    if "baseline" in report:
        b = report["baseline"]
        lines += ["", "## Against the baseline", "", "| file | score | baseline |", "| --- | --- | --- |"]
        lines += [f"| {f} | {_pct(r['score'])} | {_pct(r['baseline'])} |" for f, r in b["files"].items()]
        c = b.get("common", {})
        if c.get("mutants"):
            lines += ["", f"Over the {c['mutants']} mutants both runs scored: {_pct(c['score'])} here, "
                          f"{_pct(c['baseline_score'])} in the baseline."]
        lines += ["", f"Detected in the baseline, lost here (surviving, or no longer launched): {len(b['newly_surviving'])}", ""]
        lines += [f"- `{sig}`" for sig in b["newly_surviving"]]
        lines += ["", f"Surviving in the baseline, killed here: {len(b['newly_killed'])}", ""]
        lines += [f"- `{sig}`" for sig in b["newly_killed"]]
    return "\n".join(lines) + "\n"
