"""Run the CUDA backend's ops under compute-sanitizer (memcheck, racecheck, initcheck), after proving it
can see.

    python3 -m bench.sanitize [--tools memcheck,racecheck,initcheck]     (from the repository root)

First the planted kernels must be flagged, or the script fails (a blind sanitizer cannot pass):
  - `planted_oob`: each thread writes one element past the end of its array (memcheck);
  - `planted_divergent_barrier`: a __syncthreads inside a warp-divergent branch, and a shared-memory
    read of a value another warp wrote with no barrier between them (racecheck);
  - `planted_uninit`: a read of device memory nothing wrote (initcheck).
Then every op of the backend at small shapes (`run_ops`: the quantized linears' GEMV and prefill paths in
every format the backend has a launcher for, each GEMV in its default variant and then every variant at
its tail shape, where its loop wraps and its last block holds one row; the INT4 formats' wgmma prefill
kernel, one block a tile and spread over fewer blocks; split-K attention with
NaN-filled free pages, RoPE page writes, embed, rmsnorm, lm_head (also at its tail: a partial last
warp, a wrapped loop, three tokens), argmax, decode_advance), through the
unit rung's op checks (ladder/checks/ops.py, against reference/) on explicit inputs, must run with no
error and pass under each tool. Neither pytest nor Hypothesis is needed.

CuPy's memory pool is turned off in the checked process (`cupy.cuda.set_allocator(None)`): with the pool
on, an out-of-bounds write lands inside a larger pooled block and memcheck does not see it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.checks import refuse
from ladder.tools.sanitizer import ERROR_EXIT, command, find_sanitizer


PLANTED_SRC = r"""
extern "C" __global__ void planted_oob(float* a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i + n] = 1.0f;  // planted: writes a[n .. 2n), past the end of a[n]
}

extern "C" __global__ void planted_divergent_barrier(float* out) {
    __shared__ float s[64];
    const int t = threadIdx.x;  // launched with 64 threads: two warps
    s[t] = (float)t;
    if (t < 16) __syncthreads();  // planted: a barrier inside a warp-divergent branch
    out[t] = s[63 - t];           // reads what the other warp wrote, with no barrier between
}

extern "C" __global__ void planted_uninit(const float* never_written, float* out) {
    out[threadIdx.x] = never_written[threadIdx.x];  // planted: the input was allocated, never written
}
"""
PLANTED = {"memcheck": "planted_oob", "racecheck": "planted_divergent_barrier", "initcheck": "planted_uninit"}
TOOLS = tuple(PLANTED)


# ---- the checked process ----------------------------------------------------------------------

def child(what: str) -> None:
    import cupy as cp
    import numpy as np

    cp.cuda.set_allocator(None)
    cp.cuda.set_pinned_memory_allocator(None)
    if what in PLANTED.values():
        mod = cp.RawModule(code=PLANTED_SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
        if what == "planted_oob":
            a = cp.zeros(256, dtype=cp.float32)
            mod.get_function("planted_oob")((1,), (256,), (a, np.int32(256)))
        elif what == "planted_uninit":
            out = cp.zeros(64, dtype=cp.float32)
            mod.get_function("planted_uninit")((1,), (64,), (cp.empty(64, dtype=cp.float32), out))
        else:
            out = cp.zeros(64, dtype=cp.float32)
            mod.get_function("planted_divergent_barrier")((1,), (64,), (out,))
        cp.cuda.Device().synchronize()
        print("SANITIZE-CHILD-DONE", flush=True)
        return

    from kernels import get_backend

    try:
        run_ops(get_backend("cuda"))
    except AssertionError as e:
        print(f"SANITIZE-CHILD-WRONG-RESULTS {e}", flush=True)
        sys.exit(3)
    cp.cuda.Device().synchronize()
    print("SANITIZE-CHILD-DONE", flush=True)


def run_ops(be, say=lambda line: print(line, flush=True)) -> None:
    """Every op of backend `be` through the unit rung's op checks (against reference/ops.py with the
    ladder's tolerance table), on explicit small inputs: each check's own examples and a few more that
    reach the kernels' other paths (the drawn shapes of the unit rung's tests, fixed here: a run under a
    sanitizer is many times slower, and the same every time). A wrong result is an AssertionError."""
    from engine.formats import get_format
    from fixtures.cases import PagedCase
    from ladder.checks import ops

    def on_examples(check, *more: dict):
        for args in (*check.examples, *more):
            check(be, **args)

    on_examples(ops.check_embed, dict(T=40, V=1000, H=256, seed=1))  # many rows, the largest table
    on_examples(ops.check_rmsnorm, dict(T=20, H=896, eps=1e-5, kind="large", seed=2))
    ops.check_rmsnorm_rows(be, 2, 1)
    for fmt in map(get_format, be.formats):  # every format with a launcher
        say(f"SANITIZE-CHILD linears of {fmt.name}")
        for T in (1, 3):  # the GEMV path, then the prefill path
            ops.check_qkv_proj(be, fmt, T, 256, 72, seed=1)
            ops.check_linear_residual(be, fmt, "o_proj_residual", T, 256, 128, seed=1)
            ops.check_gate_up_silu(be, fmt, T, 128, 40, seed=1)
            ops.check_linear_residual(be, fmt, "down_residual", T, 256, 136, seed=1)
            # the fused residual + rmsnorm ops: the parts at T = 1, one epilogue kernel on the prefill path
            ops.check_linear_residual_rmsnorm(be, fmt, "o_proj_residual_rmsnorm", T, 256, 136, seed=1)
            ops.check_linear_residual_rmsnorm(be, fmt, "down_residual_rmsnorm", T, 384, 40, seed=1)
        run_gemv_tails(be, fmt, say)
        run_wgmma(be, fmt, say)
    on_examples(ops.check_rope_kv_write, dict(T=20, start=8190, nkv=4, ratio=2, d=64, theta=1e4, layout="sparse", seed=3))
    # every decode-attention kernel the backend ships (ATTENTION_VARIANTS of its module); the knobs as shipped after
    knobs = ("attention_variant", "pages_per_split")
    shipped = {k: getattr(be, k) for k in knobs if hasattr(be, k)}
    settings = [{"attention_variant": v} for v in getattr(sys.modules[type(be).__module__], "ATTENTION_VARIANTS", ())]
    for setting in settings or [{}]:
        for k, v in {**shipped, **setting}.items():
            setattr(be, k, v)
        say(f"SANITIZE-CHILD attention {setting or ''}")
        for nq, nkv, d in ((2, 2, 64), (14, 2, 128)):
            for L, T in ((17, 1), (17, 17)):
                ops.check_attention(be, "attention_decode" if T == 1 else "attention_prefill",
                                    PagedCase.build(seed=L, L=L, T=T, nq=nq, nkv=nkv, d=d, layout="shuffled"))
        if hasattr(be, "pages_per_split"):
            be.pages_per_split = 1  # split-K with empty splits and the combine
        ops.check_attention_decode(be, PagedCase.build(seed=33, L=33, T=1, nq=14, nkv=2, d=128, layout="sparse"))
    for k, v in shipped.items():
        setattr(be, k, v)
    on_examples(ops.check_lm_head, dict(V=4096, H=256, seed=1))
    from ladder.changes.sources import cuda_module  # the catalog by file path: no CuPy on the NumPy backend
    from ladder.checks.edges import lm_head_tail

    V, H = lm_head_tail(*cuda_module("catalog").lm_head_tiling())  # a partial warp, a wrapped loop, T = 3
    ops.check_lm_head(be, V=V, H=H, seed=4, T=3)
    on_examples(ops.check_argmax, dict(V=1, ties=0, seed=2), dict(V=2, ties=5, seed=3))
    on_examples(ops.check_decode_advance)


def run_wgmma(be, fmt, say) -> None:
    """The format's wgmma prefill kernel, where it has one (the prefill cases above, 3 tokens, are below the
    16 from which "auto" takes it): one block a tile, and spread over 3 blocks (8 partial tiles of 3 groups:
    tiles cut between blocks, their totals carried through global memory behind a flag)."""
    from ladder.checks import ops

    if not _has_wgmma(be, fmt):
        return
    saved = be.prefill_variant.get(fmt.name), be.wgmma_spread_blocks
    be.prefill_variant[fmt.name] = "wgmma"
    try:
        for blocks in (0, 3):
            say(f"SANITIZE-CHILD wgmma prefill of {fmt.name}, spread over {blocks or 'no'} blocks")
            be.wgmma_spread_blocks = blocks
            ops.check_linear_residual(be, fmt, "o_proj_residual", 129, 384, 449, seed=5)
    finally:
        be.prefill_variant[fmt.name], be.wgmma_spread_blocks = saved


def _has_wgmma(be, fmt) -> bool:
    from ladder.changes.sources import cuda_module  # the catalog by file path: no CuPy on the NumPy backend

    return hasattr(be, "wgmma_spread_blocks") and "wgmma" in (
        cuda_module("catalog").launchers().get(fmt.name, {}).get("prefill_variants") or ())


def run_gemv_tails(be, fmt, say) -> None:
    """Every GEMV variant of `fmt`, not only the default, at its tail shape (ladder/checks/edges.py
    gemv_tail, from the variant's loop stride and rows per block in kernels/cuda/catalog.py): its loop
    wraps and its last block holds one row, where a read past a weight's last row or a write past an
    output's is possible. One epilogue of each kind (bias, residual, SiLU x up)."""
    config = getattr(be, "gemv_config", {}).get(fmt.name)
    if config is None:  # a backend with one GEMV per op: nothing to choose
        return
    from kernels.cuda import catalog
    from ladder.checks import ops
    from ladder.checks.edges import gemv_tail

    info = catalog.launchers()[fmt.name]
    saved = dict(config)
    try:
        for variant in info["variants"]:
            say(f"SANITIZE-CHILD {fmt.name} GEMV {variant} at its tail")
            stride = catalog.loop_stride(variant, info["chunk_inputs"])
            for op in ("qkv_proj", "down_residual", "gate_up_silu"):
                config[op] = variant
                in_f, rows = gemv_tail(stride, catalog.variant_geometry(variant, op == "gate_up_silu")[1], fmt.in_multiple)
                ops.check_linear(be, fmt, op, 1, in_f, rows, seed=2)
    finally:
        config.clear()
        config.update(saved)


# ---- the driver --------------------------------------------------------------------------------

def run_under(sanitizer: str, tool: str, what: str) -> tuple[int, str]:
    cmd = command(sanitizer, tool, sys.executable, "-m", "bench.sanitize", "--child", what)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], env=env)
    return res.returncode, res.stdout + res.stderr


def summary_lines(text: str) -> str:
    """The sanitizer's own findings and summary (its lines start with '========='), then the child's verdict."""
    lines = text.splitlines()
    found = [ln for ln in lines if ln.startswith("=========")
             and re.search(r"Invalid|Race reported|ERROR SUMMARY|RACECHECK SUMMARY", ln)]
    if len(found) > 4:
        found = found[:3] + found[-1:]
    own = [ln for ln in lines if "SANITIZE-CHILD" in ln]
    return "\n".join("    " + ln for ln in found + own[-1:])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.sanitize", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog="Exit status: 0 every tool flagged its planted bug and found the ops clean, "
                                        "1 otherwise, 2 no compute-sanitizer or a bad option.")
    ap.add_argument("--tools", default=",".join(TOOLS), metavar="TOOL[,TOOL...]",
                    help="comma list of the compute-sanitizer tools to run, each after its planted bug")
    # the process each tool runs: a planted kernel or the backend's ops (`run_ops`)
    ap.add_argument("--child", choices=(*PLANTED.values(), "ops"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    tools = tuple(t for t in args.tools.split(",") if t)
    unknown = [t for t in tools if t not in PLANTED]
    if unknown:
        return refuse("bench.sanitize", f"unknown tool(s) {', '.join(unknown)}; known: {', '.join(TOOLS)}")
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("FAIL: compute-sanitizer not found (looked on PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda, beside nvcc)")
        return 2
    print(f"compute-sanitizer: {sanitizer}")
    ok = True
    for tool, what in ((t, PLANTED[t]) for t in tools):
        rc, out = run_under(sanitizer, tool, what)
        # compute-sanitizer exits with ERROR_EXIT when it reported something; the summary line says so too
        m = re.search(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: (\d+) hazard)", out)
        counted = bool(m) and int(m.group(1) or m.group(2) or 0) > 0
        flagged = rc == ERROR_EXIT or counted
        ok &= flagged
        print(f"[{'ok' if flagged else 'FAIL'}] planted {what} under {tool}: "
              f"{'flagged' if flagged else 'NOT flagged'} (exit {rc})\n{summary_lines(out)}")
    if not ok:
        print("FAIL: the sanitizer missed a planted bug; its verdict on the real kernels would mean nothing")
        return 1
    for tool in tools:
        rc, out = run_under(sanitizer, tool, "ops")
        clean = rc == 0 and "SANITIZE-CHILD-DONE" in out
        ok &= clean
        print(f"[{'ok' if clean else 'FAIL'}] backend ops under {tool}: {'no errors' if clean else 'ERRORS'} (exit {rc})\n"
              f"{summary_lines(out)}")
        if not clean:
            print(out[-6000:])
    print("sanitize: PASS" if ok else "sanitize: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
