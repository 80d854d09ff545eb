"""Decode GEMV time of each quantization format at a real model's shapes, against the bandwidth floor.

    python -m bench.format_gemv [--formats a,b] [--shape qwen2.5-coder-7b] [--repeats N] [--all-variants]
                                [--json OUT]

On the cuda backend, for each format (default: every format it has a launcher for) and each of the
four quantized linears of the shape (Qwen2.5-Coder-7B: qkv [4608, 3584], o [3584, 3584], gate_up
[37888, 3584], down [3584, 18944]), at T = 1 with the op's epilogue fused, in the backend's configured
GEMV variant (`--all-variants`: every variant the format ships):

- the weight: a block of 64 random rows quantized by the format's own `quantize` (engine/formats),
  tiled to the full row count (values do not matter for timing), prepared by the backend; then as many
  copies on the device as it takes to exceed 4x the GPU's L2 (two at least), so that every launch reads
  its weight from HBM, as a decode step does;
- correctness first: one launch against reference/ops.py on the block's rows (the output repeats with
  the block) with the ladder's tolerance table (TOL); a wrong kernel reports "WRONG" and no time;
- the time: the op on every copy in turn, captured as one CUDA graph (bench/measure.py time_graph),
  replayed `repeats` times; the median replay (CUDA events) over the copies is the time per launch.

Each row: time (us), bytes read (every stored tensor of the weight: codes, scales, zero points), GB/s,
the floor (bytes / the measured copy rate, as `nanoqwen bench` defines it, bench/measure.py copy_rate)
and the nominal floor (bytes / 4.8 TB/s, the H200's HBM3e), each as a ratio, and the time per byte
relative to int4_sym_g128's on the same op. Per format (`summary`): the sums over the four ops and the
time per byte relative to int4_sym_g128 over all four, the figure the acceptance bound (1.3x) is about.
Prints a table (with `--all-variants`, also the fastest correct variant per op: a gemv_config to try);
progress lines go to stderr; `--json` writes {"rows", "summary", "fastest", "device", ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.measure import BLOCK_ROWS, quantized_block

NOMINAL_BANDWIDTH = 4.8e12  # B/s: the H200's HBM3e, its datasheet figure
ACCEPT_RATIO = 1.3  # a format's time per byte read may be at most this multiple of int4_sym_g128's
BASELINE = "int4_sym_g128"
OPS = ("qkv_proj", "o_proj_residual", "gate_up_silu", "down_residual")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def op_shapes(config) -> dict[str, tuple[int, int]]:
    """op -> (out_features, in_features) of the fused weight at a model shape (gate_up: [gate; up] rows)."""
    c = config
    H, I = c.hidden_size, c.intermediate_size
    return {"qkv_proj": (c.qkv_size, H), "o_proj_residual": (H, c.q_size), "gate_up_silu": (2 * I, H),
            "down_residual": (H, I)}


def tiled_tensors(fmt, out_features: int, in_features: int, seed: int) -> tuple[dict, dict]:
    """(stored tensors of a [out, in] weight, those of its 64-row block): the block quantized by the
    format, its rows repeated to `out_features` (every stored tensor keeps its rows on axis 0)."""
    block = quantized_block(fmt.name, BLOCK_ROWS, in_features, f"gemv[{out_features}, {in_features}]", seed)
    reps = -(-out_features // BLOCK_ROWS)
    full = {k: np.ascontiguousarray(np.tile(v, (reps,) + (1,) * (v.ndim - 1))[:out_features]) for k, v in block.items()}
    return full, block


def _reference(name: str, op: str, block: dict, x, bias_block, out_features: int):
    """(float64 reference, fp32 noise-floor run, TOL key) of `op` on the tiled weight with a zero residual:
    computed on the block's rows and repeated, since output row r is block row r mod 64's."""
    from reference import ops as ref_ops
    from reference.formats import REF_DEQUANT

    runs = []
    for dtype in (np.float64, np.float32):
        wb = REF_DEQUANT[name](block, dtype)
        if op == "gate_up_silu":
            inter = out_features // 2
            up = wb[(inter + np.arange(BLOCK_ROWS)) % BLOCK_ROWS]  # up row r is block row (I + r) mod 64
            yb = ref_ops.ref_gate_up_silu(x, wb, up, dtype=dtype)
            n = inter
        else:
            yb = ref_ops.ref_linear(x, wb, bias_block if op == "qkv_proj" else None, dtype=dtype)
            n = out_features
        runs.append(yb[:, np.arange(n) % BLOCK_ROWS])
    fp16_out = op in ("qkv_proj", "gate_up_silu")
    plain = runs[1].astype(np.float16) if fp16_out else runs[1]
    return runs[0], plain, (op, "float16" if fp16_out else "float32")


def _time_op(be, name: str, op: str, out_features: int, in_features: int, variants, repeats: int, l2_bytes: int,
             seed: int, say) -> list[dict]:
    """One row per variant of (format, op)."""
    import cupy as cp

    from bench.measure import time_graph
    from engine.formats import get_format
    from kernels import QuantizedWeight
    from ladder.compare import measure

    fmt = get_format(name)
    host, block = tiled_tensors(fmt, out_features, in_features, seed)
    first = be.prepare_linear(name, host, out_features, in_features)
    del host
    nbytes = sum(int(a.nbytes) for a in first.tensors.values())
    copies = max(2, -(-4 * l2_bytes // nbytes))
    weights = [first] + [QuantizedWeight(name, out_features, in_features, {k: a.copy() for k, a in first.tensors.items()})
                         for _ in range(copies - 1)]
    rng = np.random.default_rng(seed + 1)
    x_host = rng.standard_normal((1, in_features)).astype(np.float16)
    bias_block = (rng.standard_normal(BLOCK_ROWS) * 0.1).astype(np.float16)
    x = be.asarray(x_host)
    rows = out_features // 2 if op == "gate_up_silu" else out_features
    bias = be.asarray(bias_block[np.arange(out_features) % BLOCK_ROWS])
    out16 = be.empty((1, rows), np.float16)
    resid = be.full((1, rows), 0.0, np.float32)
    call = {"qkv_proj": lambda w: be.qkv_proj(x, w, bias, out16),
            "o_proj_residual": lambda w: be.o_proj_residual(x, w, resid),
            "gate_up_silu": lambda w: be.gate_up_silu(x, w, out16),
            "down_residual": lambda w: be.down_residual(x, w, resid)}[op]
    out = resid if op in ("o_proj_residual", "down_residual") else out16
    ref, plain, key = _reference(name, op, block, x_host, bias_block, out_features)
    config = be.gemv_config[name]
    saved = config[op]
    found = []
    try:
        for variant in variants:
            config[op] = variant
            resid[...] = 0.0
            call(first)
            check = measure(be.to_numpy(out), ref, plain, key)
            row = {"format": name, "op": op, "variant": variant, "default": variant == saved,
                   "out_features": out_features, "in_features": in_features, "bytes": nbytes, "copies": copies,
                   "max_abs_err": check["max_abs"], "bound": check["bound"], "ok": check["passed"]}
            if check["passed"]:
                ms = time_graph(lambda: [call(w) for w in weights], reps=repeats) / copies
                row["time_us"] = ms * 1e3
                row["gb_s"] = nbytes / (ms * 1e-3) / 1e9
            found.append(row)
            say(f"  {name} {op} {variant}: " + (f"{row['time_us']:.1f} us, {row['gb_s']:.0f} GB/s" if row["ok"]
                                                else f"WRONG (max error {check['max_abs']:.3g} > bound {check['bound']:.3g})"))
    finally:
        config[op] = saved
        del weights, first
        cp.get_default_memory_pool().free_all_blocks()
    return found


def gemv_times(formats=None, repeats: int = 50, shape: str = "qwen2.5-coder-7b", all_variants: bool = False,
               copy_tbs: float | None = None, seed: int = 0, progress=None) -> list[dict]:
    """One row per (format, op) (per variant too with `all_variants`), on the cuda backend.

    Keys: format, op, variant, default (the backend's configured variant), out_features, in_features,
    bytes, copies, max_abs_err, bound, ok; where ok: time_us, gb_s, floor_us (bytes / copy rate),
    x_floor, nominal_floor_us (bytes / 4.8 TB/s), x_nominal, and time_per_byte_vs_int4 (this row's time
    per byte over int4_sym_g128's default-variant row of the same op, when that format was timed).
    `copy_tbs`: the copy rate in TB/s (measured here when None)."""
    from bench.measure import copy_rate
    from engine.config import SHAPES
    from kernels import get_backend

    say = progress or _say
    be = get_backend("cuda")
    names = list(formats) if formats else list(be.formats)
    missing = [n for n in names if n not in be.formats]
    if missing:
        raise ValueError(f"the cuda backend has no kernels for {missing}; it has {list(be.formats)}")
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    l2 = int(props.get("l2CacheSize", 50 << 20))
    if copy_tbs is None:
        copy_tbs = copy_rate()
        say(f"format_gemv: copy rate {copy_tbs:.3f} TB/s (the floor's bandwidth); L2 {l2 >> 20} MiB")
    shapes = op_shapes(SHAPES[shape])
    rows: list[dict] = []
    for name in names:
        variants_of = be.linears[name].variants
        for op in OPS:
            out_f, in_f = shapes[op]
            variants = variants_of if all_variants else (be.gemv_config[name][op],)
            t0 = time.perf_counter()
            say(f"format_gemv: {name} {op} [{out_f}, {in_f}] ...")
            rows += _time_op(be, name, op, out_f, in_f, variants, repeats, l2, seed, say)
            say(f"format_gemv: {name} {op} done ({time.perf_counter() - t0:.1f} s)")
    base = {r["op"]: r for r in rows if r["format"] == BASELINE and r["default"] and r["ok"]}
    for r in rows:
        if not r["ok"]:
            continue
        r["floor_us"] = r["bytes"] / (copy_tbs * 1e12) * 1e6
        r["x_floor"] = r["time_us"] / r["floor_us"]
        r["nominal_floor_us"] = r["bytes"] / NOMINAL_BANDWIDTH * 1e6
        r["x_nominal"] = r["time_us"] / r["nominal_floor_us"]
        b = base.get(r["op"])
        r["time_per_byte_vs_int4"] = (r["time_us"] / r["bytes"]) / (b["time_us"] / b["bytes"]) if b else None
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per format, over its default-variant rows of the four ops: summed time, bytes and floors, GB/s, and
    the time per byte relative to int4_sym_g128's (None without a timed int4_sym_g128), with the verdict
    against ACCEPT_RATIO."""
    per: dict[str, list[dict]] = {}
    for r in rows:
        if r["default"]:
            per.setdefault(r["format"], []).append(r)
    out = []
    for name, rs in per.items():
        ok = all(r["ok"] for r in rs) and len(rs) == len(OPS)
        s = {"format": name, "ops": len(rs), "ok": ok}
        if ok:
            t, b = sum(r["time_us"] for r in rs), sum(r["bytes"] for r in rs)
            s.update(time_us=t, bytes=b, gb_s=b / (t * 1e-6) / 1e9, floor_us=sum(r["floor_us"] for r in rs),
                     nominal_floor_us=sum(r["nominal_floor_us"] for r in rs))
            s["x_floor"], s["x_nominal"] = t / s["floor_us"], t / s["nominal_floor_us"]
        out.append(s)
    base = next((s for s in out if s["format"] == BASELINE and s["ok"]), None)
    for s in out:
        ratio = (s["time_us"] / s["bytes"]) / (base["time_us"] / base["bytes"]) if base and s["ok"] else None
        s["time_per_byte_vs_int4"] = ratio
        s["within_accept"] = None if ratio is None else bool(ratio <= ACCEPT_RATIO)
    return out


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
    p.add_argument("--formats", default=None, help="comma list of formats (default: every format the cuda backend has)")
    p.add_argument("--shape", default="qwen2.5-coder-7b", help="a named shape of engine/config.py SHAPES")
    p.add_argument("--repeats", type=int, default=50, help="graph replays per timing (the median is kept)")
    p.add_argument("--all-variants", action="store_true", help="time every GEMV variant each format ships")
    p.add_argument("--json", default=None, metavar="OUT", help="write the rows and the summary here")
    args = p.parse_args(argv)

    from engine.config import SHAPES
    from engine.formats import FORMATS
    from kernels.base import backend_available

    if args.shape not in SHAPES:
        print(f"bench.format_gemv: error: unknown shape {args.shape!r}; one of {sorted(SHAPES)}", file=sys.stderr)
        return 2
    formats = [f for f in args.formats.split(",") if f] if args.formats else None
    unknown = [f for f in formats or () if f not in FORMATS]
    if unknown:
        print(f"bench.format_gemv: error: unknown formats {unknown}; known: {', '.join(sorted(FORMATS))}", file=sys.stderr)
        return 2
    ok, why = backend_available("cuda")
    if not ok:
        print(f"bench.format_gemv: error: the cuda backend cannot run here: {why}", file=sys.stderr)
        return 2
    import cupy as cp

    try:
        rows = gemv_times(formats, repeats=args.repeats, shape=args.shape, all_variants=args.all_variants)
    except ValueError as e:
        print(f"bench.format_gemv: error: {e}", file=sys.stderr)
        return 2
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
