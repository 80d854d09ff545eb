"""Each quantization format's decode GEMV time at a real model's shapes, against the bandwidth floor,
on the cuda backend: the measurement that `nanoqwen quant-report` (its GEMV column, ladder/tools/quant_report.py)
and `python -m bench.format_gemv` (its table and its --all-variants sweep) both run, with the GPU timing
helpers it needs, which `nanoqwen bench` (bench/measure.py) uses too. It lives in ladder/ because the
ladder's quant-report needs it and bench/ is a leaf nothing imports (ladder/selftest/arrows.py).

Helpers: `hash_kernel`/`name_seed`/`fill_u32` (reproducible random bits on the device, from a hash of a
tensor's name and the seed), `quantized_block` (a seeded random block of BLOCK_ROWS rows in any format,
through the format's own `quantize`), `time_graph` (median CUDA-event time of a captured CUDA graph's
replays) and `copy_rate` (the device-to-device copy rate, the floor's bandwidth).

`gemv_times`: for each format (default: every format the cuda backend has a launcher for) and each of
the four quantized linears of the shape (Qwen2.5-Coder-7B: qkv [4608, 3584], o [3584, 3584], gate_up
[37888, 3584], down [3584, 18944]), at T = 1 with the op's epilogue fused, in the backend's configured
GEMV variant (`all_variants`: every variant the format ships):

- the weight: a block of 64 random rows quantized by the format's own `quantize` (engine/formats),
  tiled to the full row count (values do not matter for timing), prepared by the backend; then as many
  copies on the device as it takes to exceed 4x the GPU's L2 (two at least), so that every launch reads
  its weight from HBM, as a decode step does;
- correctness first: one launch against reference/ops.py on the block's rows (the output repeats with
  the block) with the ladder's tolerance table (TOL); a wrong kernel reports "WRONG" and no time;
- the time: the op on every copy in turn, captured as one CUDA graph (`time_graph`), replayed `repeats`
  times; the median replay (CUDA events) over the copies is the time per launch.

Each row: time (us), bytes read (every stored tensor of the weight: codes, scales, zero points), GB/s,
the floor (bytes / the measured copy rate, as `nanoqwen bench` defines it, `copy_rate`) and the nominal
floor (bytes / 4.8 TB/s, the H200's HBM3e), each as a ratio, and the time per byte relative to
int4_sym_g128's on the same op. Per format (`summary`): the sums over the four ops and the time per byte
relative to int4_sym_g128 over all four, the figure the acceptance bound (1.3x) is about. CuPy is
imported inside the functions: the module imports on a machine without it.
"""

from __future__ import annotations

import sys
import time

import numpy as np


# ---- random bits on the GPU ------------------------------------------------------------------------

_HASH = None


def hash_kernel():
    """The seeded hash (CuPy elementwise kernel) that fills device arrays with reproducible random bits."""
    global _HASH
    if _HASH is None:
        import cupy as cp

        _HASH = cp.ElementwiseKernel(
            "uint64 seed", "uint32 out",
            """
            unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ull;
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            out = (unsigned int)(z ^ (z >> 31));
            """, "nanoqwen_bench_hash")
    return _HASH


def name_seed(name: str, seed: int) -> np.uint64:
    """The hash's seed for tensor `name` in a run seeded `seed` (a rerun gets the same values)."""
    import zlib

    return np.uint64((zlib.crc32(name.encode()) << 20) ^ (seed * 0x9E3779B1) ^ 0x5DEECE66D)


def fill_u32(arr, name, seed):
    """Random bits into a C-contiguous array of any dtype whose size in bytes is a multiple of 4."""
    import cupy as cp

    if arr.nbytes % 4 or not arr.flags.c_contiguous:
        raise TypeError("fill_u32 wants a C-contiguous array of whole 4-byte words")
    hash_kernel()(name_seed(name, seed), arr.reshape(-1).view(cp.uint8).view(cp.uint32))


# ---- each format's stored tensors, through the format's own definition ------------------------------
#
# A linear's stored tensors are its format's own `quantize` (engine/formats) of a seeded random block of
# BLOCK_ROWS rows, normal with std 1/sqrt(in) (about unit gain: outputs the size of the inputs). Every
# value is one the format holds, for any format, with no code per format; a GEMV's time does not depend
# on the values.
BLOCK_ROWS = 64


def quantized_block(quant: str, rows: int, in_features: int, name: str, seed: int) -> dict[str, np.ndarray]:
    """The stored tensors (host) of a seeded random [rows, in_features] weight in format `quant`."""
    from engine.formats import get_format

    rng = np.random.default_rng(int(name_seed(name, seed)))
    w = (rng.standard_normal((rows, in_features)) / np.sqrt(in_features)).astype(np.float32)
    return get_format(quant).quantize(w)


# ---- timing -------------------------------------------------------------------------------------

def time_graph(fn, reps: int = 10, warm: int = 2) -> float:
    """Capture fn() once as a CUDA graph (engine/cuda_graph.capture); median ms of `reps` replays (CUDA events)."""
    import cupy as cp

    from engine.cuda_graph import capture

    s = cp.cuda.Stream(non_blocking=True)
    g = capture(fn, s, what="the timed ops")  # the engine's capture helper: eager once, then captured
    for _ in range(warm):
        g.launch()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        g.launch()
        b.record(s)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def copy_rate(nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Device-to-device copy, read + write counted, TB/s (median)."""
    import cupy as cp

    src = cp.empty(nbytes // 4, dtype=cp.uint32)
    fill_u32(src, "copy", 1)
    dst = cp.empty_like(src)
    times = []
    for i in range(reps + 2):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        dst[...] = src
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(cp.cuda.get_elapsed_time(a, b))
    ms = float(np.median(times))
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / (ms * 1e-3) / 1e12


# ---- the GEMV of each format at a model's shapes ---------------------------------------------------

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

    from engine.formats import get_format
    from kernels import QuantizedWeight
    from ladder.judges.compare import measure

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
