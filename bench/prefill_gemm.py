"""Prefill GEMM time of each quantization format's kernels at a real model's shapes, by prompt length.

    python -m bench.prefill_gemm [--formats a,b] [--tokens 16,64,...] [--shape qwen2.5-coder-7b] [--json OUT]

For each format (default: every format the cuda backend has a launcher for), each of the four quantized
linears of the shape with its epilogue (bias, residual add, SiLU * up), each prompt length T and each
prefill kernel the format's launcher ships (its PREFILL_VARIANTS, backend.prefill_variant picks; "auto"
is left out, it is one of the others by T): the op's time (median of 5 CUDA-event timings after a
warm-up) and its rate, 2 T out in / time. The weights are ladder/tools/gemv_timing.py's: a 64-row block
quantized by the format, tiled to the full row count, so the op's output repeats with the block.

Correctness first: every (format, op, kernel) once at T = 130 (past the 128-token tiles) against
reference/ops.py on the block's rows, with the ladder's tolerance table; a wrong kernel prints WRONG
and is not timed.

Prints, last, per format and T, the four ops' sum for each kernel and the fastest: what "auto" and
WGMMA_FROM_TOKENS (kernels/cuda/int4_sym_g128.py, int4_asym_g128.py) should pick. Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
from pathlib import Path

import numpy as np

from bench.checks import cuda_problem, refuse, shape_problem

OPS = ("qkv_proj", "o_proj_residual", "gate_up_silu", "down_residual")
CHECK_T = 130


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _timed(fn, reps: int = 5) -> float:
    import cupy as cp

    fn()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def prefill_times(formats, tokens, shape: str = "qwen2.5-coder-7b", seed: int = 0) -> list[dict]:
    """One row per (format, op, kernel, T): ms, TFLOP/s (or ok False with the error against its bound)."""
    import cupy as cp

    from engine.config import SHAPES
    from engine.formats import get_format
    from kernels.base import get_backend
    from ladder.judges.compare import measure
    from ladder.tools.gemv_timing import (
        BLOCK_ROWS,
        _reference,
        op_shapes,
        tiled_tensors,
    )

    be = get_backend("cuda")
    be.gemv_max_tokens = 1
    shapes = op_shapes(SHAPES[shape])
    rows_out = []
    for name in formats:
        fmt = get_format(name)
        launcher = importlib.import_module(f"kernels.cuda.{name}")
        kernels = [v for v in getattr(launcher, "PREFILL_VARIANTS", ("default",)) if v != "auto"]
        for op in OPS:
            out_f, in_f = shapes[op]
            host, block = tiled_tensors(fmt, out_f, in_f, seed)
            w = be.prepare_linear(name, host, out_f, in_f)
            del host
            rng = np.random.default_rng(seed + 1)
            bias_block = (rng.standard_normal(BLOCK_ROWS) * 0.1).astype(np.float16)
            bias = be.asarray(bias_block[np.arange(out_f) % BLOCK_ROWS])
            n_out = out_f // 2 if op == "gate_up_silu" else out_f
            for kernel in kernels:
                if kernel != "default":
                    be.prefill_variant[name] = kernel
                for T in (CHECK_T, *tokens):
                    x_host = rng.standard_normal((T, in_f)).astype(np.float16)
                    x = be.asarray(x_host)
                    out16 = be.empty((T, n_out), np.float16)
                    resid = be.full((T, n_out), 0.0, np.float32)
                    outputs = {"qkv_proj": (bias, out16), "gate_up_silu": (out16,)}.get(op, (resid,))
                    call = functools.partial(getattr(be, op), x, w, *outputs)  # the op with its epilogue
                    if T == CHECK_T:
                        call()
                        ref, plain, key = _reference(name, op, block, x_host, bias_block, out_f)
                        out = resid if op in ("o_proj_residual", "down_residual") else out16
                        check = measure(be.to_numpy(out), ref, plain, key)
                        ok = bool(check["passed"])
                        if not ok:
                            rows_out.append({"format": name, "op": op, "kernel": kernel, "T": T, "ok": False,
                                             "max_abs_err": check["max_abs"], "bound": check["bound"]})
                            _say(f"  {name} {op} {kernel}: WRONG (max error {check['max_abs']:.3g} > bound {check['bound']:.3g})")
                            break
                        continue
                    ms = _timed(call)
                    tflops = 2.0 * T * out_f * in_f / (ms * 1e-3) / 1e12
                    rows_out.append({"format": name, "op": op, "kernel": kernel, "T": T, "ok": True, "ms": ms,
                                     "tflops": tflops, "out_features": out_f, "in_features": in_f})
                    _say(f"  {name} {op} {kernel} T={T}: {ms:.3f} ms, {tflops:.0f} TFLOP/s")
            if name in be.prefill_variant:
                be.prefill_variant[name] = launcher.DEFAULT_PREFILL
            w = x = out16 = resid = None  # the next op's weight and buffers replace these
            cp.get_default_memory_pool().free_all_blocks()
    return rows_out


def per_layer(rows: list[dict]) -> list[dict]:
    """(format, T, kernel) -> the four ops' sum of time and its rate (TFLOP/s), the fastest kernel marked."""
    sums: dict[tuple, dict] = {}
    for r in rows:
        if not r["ok"]:
            continue
        k = (r["format"], r["T"], r["kernel"])
        s = sums.setdefault(k, {"format": r["format"], "T": r["T"], "kernel": r["kernel"], "ms": 0.0, "flop": 0.0,
                                "ops": 0})
        s["ms"] += r["ms"]
        s["flop"] += 2.0 * r["T"] * r["out_features"] * r["in_features"]
        s["ops"] += 1
    out = [s for s in sums.values() if s["ops"] == len(OPS)]
    for s in out:
        peers = [o["ms"] for o in out if o["format"] == s["format"] and o["T"] == s["T"]]
        s["fastest"] = s["ms"] == min(peers)
        s["tflops"] = s["flop"] / (s["ms"] * 1e-3) / 1e12
    return sorted(out, key=lambda s: (s["format"], s["T"], s["ms"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_gemm", description=__doc__.splitlines()[0])
    p.add_argument("--quant", default=None, metavar="FORMAT[,FORMAT...]",
                   help="comma list of formats (default: every format the cuda backend has)")
    from engine.cli import renamed

    renamed(p, "--formats", new="--quant")
    p.add_argument("--tokens", default="16,64,128,256,512,2048", help="comma list of prompt lengths T")
    p.add_argument("--shape", default="qwen2.5-coder-7b", help="a named shape of engine/config.py SHAPES")
    p.add_argument("--json", default=None, metavar="OUT", help="write the rows and the per-layer sums here")
    args = p.parse_args(argv)

    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        tokens = None
    problem = (shape_problem(args.shape)
               or (f"--tokens must be a comma list of integers, got {args.tokens!r}" if tokens is None else None)
               or ("--tokens needs lengths of 2 or more (T = 1 is the GEMV path)" if not tokens or min(tokens) < 2
                   else None)
               or cuda_problem())
    if problem:
        return refuse("bench.prefill_gemm", problem)
    from kernels.cuda import LINEARS

    formats = [f for f in args.quant.split(",") if f] if args.quant else sorted(LINEARS)
    unknown = [f for f in formats if f not in LINEARS]
    if unknown:
        return refuse("bench.prefill_gemm", f"no cuda launcher for {unknown}; known: {', '.join(sorted(LINEARS))}")
    rows = prefill_times(formats, tokens, shape=args.shape)
    layers = per_layer(rows)
    print(f"\n== prefill GEMMs (4 ops with epilogues, one layer), {args.shape} shapes")
    print(f"{'format':18s} {'T':>6s} {'kernel':8s} {'ms/layer':>9s} {'TFLOP/s':>8s}")
    for s in layers:
        print(f"{s['format']:18s} {s['T']:6d} {s['kernel']:8s} {s['ms']:9.3f} {s['tflops']:8.0f}"
              f"{'  <- fastest' if s['fastest'] else ''}")
    wrong = [r for r in rows if not r["ok"]]
    for r in wrong:
        print(f"WRONG: {r['format']} {r['op']} {r['kernel']}: max error {r['max_abs_err']:.3g} > bound {r['bound']:.3g}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"shape": args.shape, "rows": rows, "per_layer": layers}, indent=1))
        print(f"JSON: {out}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
