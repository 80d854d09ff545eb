"""Decode GEMV time of each quantization format at a real model's shapes, against the bandwidth floor.

    python -m bench.format_gemv [--quant a,b] [--shape qwen2.5-coder-7b] [--repeats N] [--all-variants]
                                [--json OUT]

The command line of the measurement in ladder/tools/gemv_timing.py (`gemv_times`, `summary`), which
`nanoqwen quant-report`'s GEMV column runs too; what it times and how is said there. On the cuda
backend, for each format (default: every format it has a launcher for) and each of the four quantized
linears of the shape, at T = 1 with the op's epilogue fused, in the backend's configured GEMV variant
(`--all-variants`: every variant the format ships).

Each row: time (us), bytes read, GB/s, the floor (bytes / the measured copy rate, as `nanoqwen bench`
defines it) and the nominal floor (bytes / 4.8 TB/s, the H200's HBM3e), each as a ratio, and the time per
byte relative to int4_sym_g128's on the same op. Per format: the sums over the four ops and the time per
byte relative to int4_sym_g128 over all four, the figure the acceptance bound (1.3x) is about.
Prints a table (with `--all-variants`, also the fastest correct variant per op: a gemv_config to try);
progress lines go to stderr; `--json` writes {"rows", "summary", "fastest", "device", ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.checks import cuda_problem, refuse, shape_problem
from ladder.tools.gemv_timing import ACCEPT_RATIO, NOMINAL_BANDWIDTH, gemv_times, summary


def fastest(rows: list[dict]) -> dict[str, dict[str, str]]:
    """format -> op -> its fastest correct variant among the rows (with --all-variants: a config to try)."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        k = (r["format"], r["op"])
        if r["ok"] and (k not in best or r["time_us"] < best[k]["time_us"]):
            best[k] = r
    out: dict[str, dict[str, str]] = {}
    for (fmt, op), r in best.items():
        out.setdefault(fmt, {})[op] = r["variant"]
    return out


def print_table(rows: list[dict], summ: list[dict]) -> None:
    print(f"\n{'format':18s} {'op':16s} {'variant':9s} {'us':>8s} {'MB':>8s} {'GB/s':>7s} {'x floor':>8s} "
          f"{'x 4.8TB/s':>9s} {'t/B vs int4':>11s}")
    for r in rows:
        mark = "" if r["default"] else " (alt)"
        if not r["ok"]:
            print(f"{r['format']:18s} {r['op']:16s} {r['variant']:9s} WRONG: max error {r['max_abs_err']:.3g} "
                  f"> bound {r['bound']:.3g}{mark}")
            continue
        ratio = r["time_per_byte_vs_int4"]
        print(f"{r['format']:18s} {r['op']:16s} {r['variant']:9s} {r['time_us']:8.1f} {r['bytes'] / 1e6:8.2f} "
              f"{r['gb_s']:7.0f} {r['x_floor']:8.2f} {r['x_nominal']:9.2f} "
              f"{'' if ratio is None else f'{ratio:.2f}':>11s}{mark}")
    print(f"\n{'format (4 ops)':18s} {'us':>8s} {'MB':>8s} {'GB/s':>7s} {'x floor':>8s} {'x 4.8TB/s':>9s} "
          f"{'t/B vs int4':>11s}  within {ACCEPT_RATIO}x")
    for s in summ:
        if not s["ok"]:
            print(f"{s['format']:18s} not measured: a kernel was wrong or an op is missing")
            continue
        ratio = s["time_per_byte_vs_int4"]
        verdict = {None: "-", True: "yes", False: "NO"}[s["within_accept"]]
        print(f"{s['format']:18s} {s['time_us']:8.1f} {s['bytes'] / 1e6:8.2f} {s['gb_s']:7.0f} {s['x_floor']:8.2f} "
              f"{s['x_nominal']:9.2f} {'' if ratio is None else f'{ratio:.2f}':>11s}  {verdict}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.format_gemv", description=__doc__.splitlines()[0])
    p.add_argument("--quant", default=None, metavar="FORMAT[,FORMAT...]",
                   help="comma list of formats (default: every format the cuda backend has)")
    from engine.cli import renamed

    renamed(p, "--formats", new="--quant")
    p.add_argument("--shape", default="qwen2.5-coder-7b", help="a named shape of engine/config.py SHAPES")
    p.add_argument("--repeats", type=int, default=50, help="graph replays per timing (the median is kept)")
    p.add_argument("--all-variants", action="store_true", help="time every GEMV variant each format ships")
    p.add_argument("--json", default=None, metavar="OUT", help="write the rows and the summary here")
    args = p.parse_args(argv)

    from engine.formats import FORMATS

    formats = [f for f in args.quant.split(",") if f] if args.quant else None
    unknown = [f for f in formats or () if f not in FORMATS]
    problem = (shape_problem(args.shape)
               or (f"unknown formats {unknown}; known: {', '.join(sorted(FORMATS))}" if unknown else None)
               or cuda_problem())
    if problem:
        return refuse("bench.format_gemv", problem)
    import cupy as cp

    try:
        rows = gemv_times(formats, repeats=args.repeats, shape=args.shape, all_variants=args.all_variants)
    except ValueError as e:
        return refuse("bench.format_gemv", str(e))
    summ = summary(rows)
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    device = name.decode() if isinstance(name, bytes) else str(name)
    print(f"== decode GEMV per format, {args.shape} shapes, T = 1, on {device}")
    print_table(rows, summ)
    best = fastest(rows)
    if args.all_variants:
        print("\nfastest correct variant per op (a gemv_config to try):")
        for fmt, config in best.items():
            print(f"  {fmt}: {config}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": device, "shape": args.shape, "repeats": args.repeats,
                                   "nominal_bandwidth": NOMINAL_BANDWIDTH, "rows": rows, "summary": summ,
                                   "fastest": best}, indent=1))
        print(f"JSON: {out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
