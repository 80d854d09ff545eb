"""The op sweep: every op of a backend once at its edges, on explicit inputs, through the unit rung's op
checks (ladder/checks/ops.py, against reference/ with the ladder's tolerance table). The same every time,
and small: a run under compute-sanitizer is many times slower than the rungs' own.

    python -m ladder.tools.opsweep [--backend cuda]     (from the repository root)

What it covers (`run_ops`): embed, rmsnorm, the quantized linears' GEMV and prefill paths in every format the
backend has a launcher for (each GEMV in its default variant, then every variant at its tail shape, where
its loop wraps and its last block holds one row), the INT4 formats' wgmma prefill kernel (one block a
tile, and spread over fewer blocks), RoPE page writes, every decode-attention kernel with NaN-filled free
pages and split-K, lm_head (also at its tail: a partial last warp, a wrapped loop, three tokens), argmax
and decode_advance. Neither pytest nor Hypothesis is needed. An op added to the backend interface must get
its line here: ladder/selftest/test_opsweep.py names every op and fused op the sweep never reaches.

Two callers run it under each compute-sanitizer tool, CuPy's memory pool off (with the pool on, a read
or write past an array's end lands inside a larger pooled block, which memcheck sees as valid memory):
the nightly's sanitizer script (bench/sanitize.py, its `ops` child) and `nanoqwen mutate`'s second look
at a CUDA survivor (ladder/tools/mutate.py), where it sees an over-read that no value shows in seconds.
It lives in ladder/ because the ladder's mutate needs it and bench/ is a leaf nothing imports.

The process prints a line "SANITIZE-CHILD <part>" as it reaches each part (the last one names where a
crash happened), "SANITIZE-CHILD-DONE" at the end, and exits 3 on a wrong result.
"""

from __future__ import annotations

import argparse
import os
import sys


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ladder.tools.opsweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda", help="the backend whose ops run (default cuda)")
    args = ap.parse_args(argv)
    from kernels import get_backend
    from ladder.checks.harness import POOL_VARIABLE, honour_pool_variable

    os.environ[POOL_VARIABLE] = "0"  # the sweep is run to be checked: each array its own allocation
    honour_pool_variable()  # before the backend allocates anything
    be = get_backend(args.backend)
    try:
        run_ops(be)
    except AssertionError as e:
        print(f"SANITIZE-CHILD-WRONG-RESULTS {e}", flush=True)
        return 3
    be.synchronize()
    print("SANITIZE-CHILD-DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
