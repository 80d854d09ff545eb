"""Unit rung: every shipped kernel variant and tile edge of the quantized linears, against reference/.

- Every GEMV variant (`GEMV_VARIANTS` of kernels/cuda) for each of the four quantized ops, at T = 1
  (the GEMV path), on row counts below, on and one past each variant's rows per block, and on inputs of
  1, 2, 5 and 37 128-groups (one group, a partial load batch, several batches). A backend without a
  `gemv_config` (one GEMV per op, nothing to pick) skips these cases with that reason.
- The prefill path (T above `gemv_max_tokens`) at its tile edges: T and rows on, below and past the
  64 x 128 tensor-core tile.
- The Qwen2.5-Coder-7B shapes of the four ops (decode and a 64-token prefill), the decode attention
  with fixed split sizes (one page per split: splits past the length are empty), rmsnorm reading rows
  of a larger buffer, and the captured decode graph following a wrapped op and its unwrapping.

The comparisons are test_ops.py's: `check_*` against `reference.ops` with TOL.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import engine
from fixtures.strategies import PagedCase
from ladder.unit.test_ops import _check_attention, check_gate_up_silu, check_linear_residual, check_qkv_proj

ROOT = Path(__file__).resolve().parents[2]


def _gemv_variants() -> tuple[str, ...]:
    """kernels/cuda's GEMV_VARIANTS, read from its source: the module imports CuPy, and the cases are
    collected (and skip with a reason) where CuPy is missing."""
    tree = ast.parse((ROOT / "kernels" / "cuda" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GEMV_VARIANTS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError("kernels/cuda/__init__.py has no GEMV_VARIANTS")


GEMV_VARIANTS = _gemv_variants()
LINEAR_OPS = ("qkv_proj", "o_proj_residual", "gate_up_silu", "down_residual")
GROUPS = (1, 2, 5, 37)  # input features in 128-groups: one, two, a partial batch, several batches
ROWS = (5, 8, 13, 16, 17, 72, 136)  # output rows: under, on and past 4, 8 and 16 rows per block
SILU_ROWS = (3, 4, 5, 8, 9, 17, 40)  # gate/up blocks own half as many output rows


def _check_linear(backend, fmt, op, T, in_f, rows, seed, case=""):
    """One quantized linear op at [T, in_f] -> `rows` outputs (gate_up_silu: `rows` = I)."""
    if op == "qkv_proj":
        check_qkv_proj(backend, fmt, T, in_f, rows, seed, case)
    elif op == "gate_up_silu":
        check_gate_up_silu(backend, fmt, T, in_f, rows, seed, case)
    else:
        check_linear_residual(backend, fmt, op, T, in_f, rows, seed, case)


@pytest.mark.parametrize("variant", GEMV_VARIANTS)
@pytest.mark.parametrize("op", LINEAR_OPS)
def test_gemv_variant_matches_reference_at_every_tile_edge(backend, quant_format, op, variant):
    if not hasattr(backend, "gemv_config"):
        pytest.skip("the backend has no gemv_config: GEMV variants belong to a backend that picks one per op")
    assert backend.gemv_max_tokens >= 1, "T = 1 must take the GEMV path"
    saved = backend.gemv_config[op]
    backend.gemv_config[op] = variant
    try:
        for groups in GROUPS:
            for rows in SILU_ROWS if op == "gate_up_silu" else ROWS:
                _check_linear(backend, quant_format, op, 1, 128 * groups, rows, seed=groups * 1000 + rows,
                              case=f",variant={variant}")
    finally:
        backend.gemv_config[op] = saved


@pytest.mark.parametrize("op", LINEAR_OPS)
def test_prefill_path_matches_reference_at_every_tile_edge(backend, quant_format, op):
    gemv_max = getattr(backend, "gemv_max_tokens", 1)
    for T in (2, 63, 64, 65, 130):
        if T <= gemv_max:
            continue
        for groups in (1, 3):
            for rows in ((7, 64, 65, 129) if op == "gate_up_silu" else (8, 127, 128, 129, 257)):
                _check_linear(backend, quant_format, op, T, 128 * groups, rows, seed=T * 1000 + rows, case=",prefill")


@pytest.mark.parametrize("T", (1, 64))
@pytest.mark.parametrize("op", LINEAR_OPS)
def test_full_size_linears_match_reference(backend, quant_format, op, T):
    if not hasattr(backend, "gemv_config"):
        pytest.skip("full-size (7B) shapes run where GEMV variants are tuned; a float64 reference of them is slow on CPU")
    H, I, qkv = 3584, 18944, (28 + 2 * 4) * 128
    in_f, rows = {"qkv_proj": (H, qkv), "o_proj_residual": (28 * 128, H), "gate_up_silu": (H, I), "down_residual": (I, H)}[op]
    _check_linear(backend, quant_format, op, T, in_f, rows, seed=T, case=",7B")


@pytest.mark.parametrize("pages_per_split", (1, 8))
def test_attention_decode_with_fixed_split_sizes(backend, pages_per_split):
    if not hasattr(backend, "pages_per_split"):
        pytest.skip("the backend has no pages_per_split: its decode attention does not split the pages")
    saved = backend.pages_per_split
    backend.pages_per_split = pages_per_split
    try:
        for L, nkv, ratio, d in ((33, 2, 1, 64), (33, 2, 7, 128), (600, 4, 7, 128)):
            case = PagedCase.build(seed=L, L=L, T=1, nq=nkv * ratio, nkv=nkv, d=d, layout="shuffled")
            _check_attention(backend, "attention_decode", case)
    finally:
        backend.pages_per_split = saved


def test_captured_decode_follows_a_wrapped_op_and_its_unwrapping(backend, request):
    if not backend.supports_graphs:
        pytest.skip("the backend does not capture graphs")
    model = engine.load(request.getfixturevalue("model_path"), backend=backend)
    model.enable_cuda_graph(True)
    prompt = list(range(3, 16))

    def step():
        seq = model.new_sequence()
        model.prefill(seq, prompt)
        logits = model.decode_step(seq, 7)
        seq.free()
        return logits

    base = step()
    original = backend.rmsnorm  # the bound op, or the ladder's recording wrapper around it

    def doubled_rmsnorm(x, weight, eps, out):
        original(x, weight, eps, out)
        out *= 2  # a planted fault the replay must show

    captures = model._graph.captures
    backend.rmsnorm = doubled_rmsnorm
    try:
        faulty = step()
    finally:
        backend.rmsnorm = original
    again = step()
    assert model._graph.captures > captures, "wrapping an op did not capture the decode step again"
    assert not np.array_equal(faulty, base), "the replay ignored the wrapped rmsnorm"
    assert np.array_equal(again.view(np.uint32), base.view(np.uint32)), "unwrapping did not restore the logits bit for bit"
