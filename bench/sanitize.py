"""Run the CUDA backend's ops under compute-sanitizer (memcheck, racecheck, initcheck), after proving it
can see.

    python3 -m bench.sanitize [--tools memcheck,racecheck,initcheck]     (from the repository root)

First two planted kernels must be flagged, or the script fails (a blind sanitizer cannot pass):
  - `planted_oob`: each thread writes one element past the end of its array (memcheck);
  - `planted_divergent_barrier`: a __syncthreads inside a warp-divergent branch, and a shared-memory
    read of a value another warp wrote with no barrier between them (racecheck);
  - `planted_uninit`: a read of device memory nothing wrote (initcheck).
Then every op of the backend at small shapes (the quantized linears' GEMV and prefill paths in every
format the backend has a launcher for, each GEMV in its default variant; split-K attention with
NaN-filled free pages, RoPE page writes, lm_head, argmax), through the unit rung's checks
(ladder/unit/test_ops.py, against reference/), must run with no error and pass under both tools.

CuPy's memory pool is turned off in the checked process (`cupy.cuda.set_allocator(None)`): with the pool
on, an out-of-bounds write lands inside a larger pooled block and memcheck does not see it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ERROR_EXIT = 86  # compute-sanitizer's exit status when it reports an error

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


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        for cand in (Path(root) / "bin" / "compute-sanitizer", Path(root) / "compute-sanitizer" / "compute-sanitizer"):
            if cand.exists():
                return str(cand)
    return None


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

    from hypothesis import settings

    # The @given checks called below run their explicit examples plus a few drawn ones, with no deadline:
    # under a sanitizer every launch is many times slower, and a deadline would fail the run for that.
    # Loaded before test_ops is imported: @given binds the default settings when it decorates a test.
    settings.register_profile("nanoqwen-sanitize", max_examples=5, deadline=None, derandomize=True)
    settings.load_profile("nanoqwen-sanitize")

    from engine.formats import get_format
    from fixtures.strategies import PagedCase
    from kernels import get_backend
    from ladder.unit import test_ops as unit

    # The unit rung's own checks (against reference/ops.py with the ladder's tolerance table), at small shapes.
    be = get_backend("cuda")
    try:
        unit.test_embed_copies_rows_exactly(backend=be)
        unit.test_rmsnorm_reads_rows_of_a_larger_buffer(be, 2, 1)
        for fmt in map(get_format, be.formats):  # every format with a launcher
            print(f"SANITIZE-CHILD linears of {fmt.name}", flush=True)
            for T in (1, 3):  # the GEMV path, then the prefill path
                unit.check_qkv_proj(be, fmt, T, 256, 72, seed=1)
                unit.check_linear_residual(be, fmt, "o_proj_residual", T, 256, 128, seed=1)
                unit.check_gate_up_silu(be, fmt, T, 128, 40, seed=1)
                unit.check_linear_residual(be, fmt, "down_residual", T, 256, 136, seed=1)
        unit.test_rope_kv_write_rotates_and_writes_only_its_slots(backend=be)
        for nq, nkv, d in ((2, 2, 64), (14, 2, 128)):
            for L, T in ((17, 1), (17, 17)):
                unit._check_attention(be, "attention_decode" if T == 1 else "attention_prefill",
                                      PagedCase.build(seed=L, L=L, T=T, nq=nq, nkv=nkv, d=d, layout="shuffled"))
        be.pages_per_split = 1  # split-K with empty splits and the combine
        unit._check_attention(be, "attention_decode", PagedCase.build(seed=33, L=33, T=1, nq=14, nkv=2, d=128, layout="sparse"))
        unit.test_lm_head_fp16_weight_fp32_logits(backend=be)
        unit.test_argmax_lowest_index_wins_a_tie(backend=be)
    except AssertionError as e:
        print(f"SANITIZE-CHILD-WRONG-RESULTS {e}", flush=True)
        sys.exit(3)
    cp.cuda.Device().synchronize()
    print("SANITIZE-CHILD-DONE", flush=True)


# ---- the driver --------------------------------------------------------------------------------

def run_under(sanitizer: str, tool: str, what: str) -> tuple[int, str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", str(ERROR_EXIT), "--print-limit", "10",
           sys.executable, "-m", "bench.sanitize", "--child", what]
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


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    tools = TOOLS
    if len(sys.argv) == 3 and sys.argv[1] == "--tools":
        tools = tuple(t for t in sys.argv[2].split(",") if t)
        unknown = [t for t in tools if t not in PLANTED]
        if unknown:
            print(f"FAIL: unknown tool(s) {', '.join(unknown)}; known: {', '.join(TOOLS)}")
            return 2
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
