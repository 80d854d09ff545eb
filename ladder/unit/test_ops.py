"""Unit rung: every Backend op against its float64 `ref_*`, shapes and values drawn by Hypothesis.

Each test draws the arguments of one check of ladder/checks/ops.py (inputs rounded to their storage
dtype, the float64 reference, the fp32 noise floor, the op into a sentinel-filled buffer, `assert_close`
with TOL) and calls it. A check's explicit examples (`examples`, in the check's own module) run first on
every run, here as the test's `@example`s: the planted faults are proven on the same ones
(ladder/unit/test_planted_faults.py).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fixtures.cases import PAGE_BOUNDARY_LENGTHS
from fixtures.strategies import linear_shapes, paged_cases, seeds
from ladder.checks import ops


def explicit(*checks, drawn=lambda **kw: kw):
    """The checks' explicit examples as the test's `@example`s (each once); `drawn` turns a check's
    arguments into the test's, where the test draws them in another shape."""
    cases = []
    for check in checks:
        cases += [kw for kw in check.examples if not any(kw is seen for seen in cases)]

    def decorate(test):
        for kw in reversed(cases):  # last to first, as stacked `@example` lines: the first runs first
            test = example(**drawn(**kw))(test)
        return test
    return decorate


def as_linear_shape(T, in_f, out_f, seed):
    """A linear check's example as `linear_shapes()` draws it: (T, in, out, an unused seed), and the seed."""
    return dict(shape=(T, in_f, out_f, 0), seed=seed)


# --- embed ---------------------------------------------------------------------------------------


@given(T=st.integers(1, 40), V=st.sampled_from((128, 512, 1000)), H=st.sampled_from((128, 256)), seed=seeds)
@explicit(ops.check_embed)
def test_embed_copies_rows_exactly(backend, T, V, H, seed):
    ops.check_embed(backend, T, V, H, seed)


# --- rmsnorm -------------------------------------------------------------------------------------


@given(T=st.integers(1, 20), H=st.sampled_from((128, 256, 896, 3584)), eps=st.sampled_from((1e-6, 1e-5)),
       kind=st.sampled_from(("normal", "constant_rows", "large", "tiny")), seed=seeds)
@explicit(ops.check_rmsnorm)
def test_rmsnorm_matches_reference_within_noise_floor(backend, T, H, eps, kind, seed):
    ops.check_rmsnorm(backend, T, H, eps, kind, seed)


@pytest.mark.parametrize("T,first", [(1, 0), (1, 3), (4, 1)])
def test_rmsnorm_reads_rows_of_a_larger_buffer(backend, T, first):
    # The engine normalizes a row slice of its residual buffer (the final norm reads row 0 of [T, H]).
    ops.check_rmsnorm_rows(backend, T, first)


# --- quantized linears ---------------------------------------------------------------------------

RESIDUAL_CHECKS = {"o_proj_residual": ops.check_o_proj_residual, "down_residual": ops.check_down_residual}


@given(shape=linear_shapes(), seed=seeds)
@explicit(ops.check_qkv_proj, drawn=as_linear_shape)
def test_qkv_proj_with_bias(backend, quant_format, shape, seed):
    T, in_f, out_f, _ = shape
    ops.check_qkv_proj(backend, quant_format, T, in_f, out_f, seed)


@pytest.mark.parametrize("op", list(RESIDUAL_CHECKS))
@given(shape=linear_shapes(), seed=seeds)
@explicit(*RESIDUAL_CHECKS.values(), drawn=as_linear_shape)
def test_linear_residual_adds_into_fp32_stream(backend, quant_format, op, shape, seed):
    T, in_f, out_f, _ = shape
    RESIDUAL_CHECKS[op](backend, quant_format, T, in_f, out_f, seed)


FUSED_CHECKS = {"o_proj_residual_rmsnorm": ops.check_o_proj_residual_rmsnorm,
                "down_residual_rmsnorm": ops.check_down_residual_rmsnorm}


@pytest.mark.parametrize("op", list(FUSED_CHECKS))
@given(shape=linear_shapes(), seed=seeds)
@explicit(*FUSED_CHECKS.values(), drawn=as_linear_shape)
def test_linear_residual_then_rmsnorm_fused_matches_both_parts(backend, quant_format, op, shape, seed):
    T, in_f, out_f, _ = shape
    FUSED_CHECKS[op](backend, quant_format, T, in_f, out_f, seed)


@given(T=st.integers(1, 6), H=st.sampled_from((128, 256, 384)), inter=st.sampled_from((128, 256, 768)), seed=seeds)
@explicit(ops.check_gate_up_silu)
def test_gate_up_silu_fused(backend, quant_format, T, H, inter, seed):
    ops.check_gate_up_silu(backend, quant_format, T, H, inter, seed)


# --- RoPE and the KV page write ------------------------------------------------------------------


# Positions past 2048 and 4096: an angle pos * inv_freq computed in fp16 (ulp 2 at 2048, 4 at 4096)
# instead of fp32 is off by radians there, and nowhere near the start of a sequence.
@given(T=st.integers(1, 20), start=st.one_of(st.just(0), st.sampled_from((15, 16, 31, 2047, 4095, 8190)), st.integers(0, 9000)),
       nkv=st.sampled_from((1, 2, 4)), ratio=st.sampled_from((1, 2, 7)), d=st.sampled_from((64, 128)),
       theta=st.sampled_from((1e4, 1e6)), layout=st.sampled_from(("contiguous", "shuffled", "sparse")), seed=seeds)
@explicit(ops.check_rope_kv_write)
def test_rope_kv_write_rotates_and_writes_only_its_slots(backend, T, start, nkv, ratio, d, theta, layout, seed):
    ops.check_rope_kv_write(backend, T, start, nkv, ratio, d, theta, layout, seed)


# --- paged attention -----------------------------------------------------------------------------


@given(case=paged_cases(decode=True))
@explicit(ops.check_attention_decode)  # position 0, a full page in the 7B head layout, one slot past a page, scores of std 64
def test_attention_decode_reads_exactly_the_valid_keys(backend, case):
    ops.check_attention_decode(backend, case)


@given(case=paged_cases(decode=False))
@explicit(ops.check_attention_prefill)  # a whole prompt crossing a page, a chunk after a cached prefix, scores of std 64
def test_attention_prefill_is_causal_over_pages(backend, case):
    ops.check_attention_prefill(backend, case)


@pytest.mark.parametrize("kw", ops.check_attention_keeps_fp32_probabilities.examples,
                         ids=lambda kw: f"{kw['op'].split('_')[1]}-L{kw['L']}-T{kw['T']}-d{kw['d']}")
def test_attention_carries_probabilities_to_fp32_into_p_times_v(backend, kw):
    ops.check_attention_keeps_fp32_probabilities(backend, **kw)


@pytest.mark.parametrize("L", PAGE_BOUNDARY_LENGTHS)
def test_attention_decode_at_every_page_edge(backend, L):
    ops.check_attention_decode_at_page_edge(backend, L)


# --- lm_head and argmax --------------------------------------------------------------------------


@given(V=st.sampled_from((128, 512, 1000, 4096)), H=st.sampled_from((128, 256)), seed=seeds)
@explicit(ops.check_lm_head)
def test_lm_head_fp16_weight_fp32_logits(backend, V, H, seed):
    ops.check_lm_head(backend, V, H, seed)


def test_lm_head_at_every_tile_edge(backend):
    """Vocab and hidden sizes on either side of the CUDA kernel's rows per warp and per block and of its
    loop's stride (kernels/cuda/catalog.py `lm_head_tiling`, read from the kernel's own #defines), at one
    token and at three: a partial last block while T >= 2 writes rows of the next token's logits."""
    from ladder.changes.sources import cuda_module
    from ladder.checks.edges import lm_head_edges

    for V, H in lm_head_edges(*cuda_module("catalog").lm_head_tiling()):
        for T in (1, 3):
            ops.check_lm_head(backend, V, H, seed=V * 7 + H + T, T=T)


@given(V=st.sampled_from((1, 2, 128, 1000, 152064)), ties=st.integers(0, 5), seed=seeds)
@explicit(ops.check_argmax)
def test_argmax_lowest_index_wins_a_tie(backend, V, ties, seed):
    ops.check_argmax(backend, V, ties, seed)


@pytest.mark.parametrize("value", [float("-inf"), 3.0], ids=["minus_inf", "finite"])
@pytest.mark.parametrize("V", [1, 7, 1000, 152064])  # one element, fewer than a block's threads, the 7B vocab
def test_argmax_of_a_constant_row_is_index_0_even_when_every_logit_is_minus_inf(backend, V, value):
    ops.check_argmax_of_a_constant_row(backend, V, value)


# --- decode_advance ------------------------------------------------------------------------------


@given(next_id=st.integers(0, 2**31 - 1), old_id=st.integers(0, 2**31 - 1), start=st.integers(0, 2**31 - 100),
       steps=st.integers(1, 5), seed=seeds)
@explicit(ops.check_decode_advance)
def test_decode_advance_feeds_the_picked_token_back_and_moves_one_position(backend, next_id, old_id, start, steps, seed):
    ops.check_decode_advance(backend, next_id, old_id, start, steps, seed)
