"""Run the CUDA backend's ops under compute-sanitizer (memcheck, racecheck, initcheck), after proving it
can see.

    python3 -m bench.sanitize [--tools memcheck,racecheck,initcheck]     (from the repository root)

First the planted kernels must be flagged, or the script fails (a blind sanitizer cannot pass):
  - `planted_oob`: each thread writes one element past the end of its array (memcheck);
  - `planted_divergent_barrier`: a __syncthreads inside a warp-divergent branch, and a shared-memory
    read of a value another warp wrote with no barrier between them (racecheck);
  - `planted_uninit`: a read of device memory nothing wrote (initcheck).
Then the op sweep (ladder/tools/opsweep.py: every op of the backend once at its edges, through the unit
rung's op checks against reference/ on explicit inputs; `nanoqwen mutate`'s second look runs it too) must
run with no error and pass under each tool. Neither pytest nor Hypothesis is needed.

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

    from ladder.tools.opsweep import main as op_sweep

    sys.exit(op_sweep(["--backend", "cuda"]))  # the pool off again there, the ops, SANITIZE-CHILD-DONE


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
