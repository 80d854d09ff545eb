"""Unit rung: every Backend op against its float64 `ref_*`, shapes and values drawn by Hypothesis.

Each test reads the same way: draw inputs (rounded to their storage dtype), `ref = ref_op(...)` in
float64, `plain = ref_op(..., dtype=float32)` rounded to the output dtype (the noise floor), `out =
backend.op(...)` into a sentinel-filled buffer, `assert_close(op, out, ref, plain)` with TOL.
`decode_advance` (an integer copy and an increment) is checked exactly against its definition.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fixtures.strategies import (PAGE_BOUNDARY_LENGTHS, PagedCase, fp16, linear_shapes, make_page_table,
                                 paged_cases, quantizable_weight, rng_for, seeds)
from ladder.compare import assert_close, assert_equal
from ladder.harness import by_row_blocks, dev, host, quantized, sentinel
from reference import ops as ref_ops
from reference.formats import REF_DEQUANT

F16, F32 = np.float16, np.float32


def _round(a, dtype):
    return np.asarray(a).astype(dtype)


def _quantized(backend, fmt, w, by_rows: bool = False):
    """(the backend's weight, the float64 reference weight) for a float32 weight in format `fmt`; `by_rows`:
    both made by row blocks side by side (ladder/harness.py by_row_blocks; for the 7B-shape weights)."""
    if fmt.name not in REF_DEQUANT:
        pytest.fail(f"format {fmt.name!r} has no reference reading in reference/formats.py REF_DEQUANT")
    qw, tensors = quantized(backend, fmt, w, by_rows)
    reading = REF_DEQUANT[fmt.name]
    return qw, np.concatenate(by_row_blocks(reading, tensors)) if by_rows else reading(tensors)


# --- embed ---------------------------------------------------------------------------------------


@given(T=st.integers(1, 40), V=st.sampled_from((128, 512, 1000)), H=st.sampled_from((128, 256)), seed=seeds)
@example(T=1, V=128, H=128, seed=0)
def test_embed_copies_rows_exactly(backend, T, V, H, seed):
    rng = rng_for(seed)
    table = fp16(rng, (V, H))
    ids = rng.integers(0, V, size=T).astype(np.int32)
    ids[0] = V - 1  # the last row: an off-by-one in the row stride reads past the table
    ref = ref_ops.ref_embed(ids, table)
    out = sentinel(backend, (T, H), F32)
    backend.embed(dev(backend, ids), dev(backend, table), out)
    assert_close("embed", host(backend, out), ref, backend=backend.name, case=f"T={T},V={V},H={H}", seed=seed)


# --- rmsnorm -------------------------------------------------------------------------------------


@given(T=st.integers(1, 20), H=st.sampled_from((128, 256, 896, 3584)), eps=st.sampled_from((1e-6, 1e-5)),
       kind=st.sampled_from(("normal", "constant_rows", "large", "tiny")), seed=seeds)
@example(T=1, H=3584, eps=1e-6, kind="normal", seed=0)
@example(T=3, H=128, eps=1e-6, kind="constant_rows", seed=1)
def test_rmsnorm_matches_reference_within_noise_floor(backend, T, H, eps, kind, seed):
    rng = rng_for(seed)
    scale = {"normal": 1.0, "constant_rows": 1.0, "large": 3e3, "tiny": 1e-3}[kind]
    x = (rng.standard_normal((T, H)) * scale).astype(F32)
    if kind == "constant_rows":
        x[:] = x[:, :1]  # every element equal: the output is weight * sign(x) up to eps
    w = fp16(rng, (H,), 0.5) + F16(1.0)
    ref = ref_ops.ref_rmsnorm(x, w, eps)
    plain = _round(ref_ops.ref_rmsnorm(x, w, eps, dtype=F32), F16)
    out = sentinel(backend, (T, H), F16)
    backend.rmsnorm(dev(backend, x), dev(backend, w), eps, out)
    assert_close("rmsnorm", host(backend, out), ref, plain, backend=backend.name, case=f"T={T},H={H},{kind}", seed=seed)


@pytest.mark.parametrize("T,first", [(1, 0), (1, 3), (4, 1)])
def test_rmsnorm_reads_rows_of_a_larger_buffer(backend, T, first):
    # The engine normalizes a row slice of its residual buffer (the final norm reads row 0 of [T, H]).
    rng = rng_for(first)
    H = 3584
    x = (rng.standard_normal((T + 4, H)) * 3).astype(F32)
    w = fp16(rng, (H,), 0.5) + F16(1.0)
    rows = x[first:first + T]
    ref = ref_ops.ref_rmsnorm(rows, w, 1e-6)
    plain = _round(ref_ops.ref_rmsnorm(rows, w, 1e-6, dtype=F32), F16)
    out = sentinel(backend, (T, H), F16)
    backend.rmsnorm(dev(backend, x)[first:first + T], dev(backend, w), 1e-6, out)
    assert_close("rmsnorm", host(backend, out), ref, plain, backend=backend.name,
                 case=f"T={T},H={H},rows {first}..{first + T} of {T + 4}", seed=first)


# --- quantized linears ---------------------------------------------------------------------------


def check_qkv_proj(backend, fmt, T, in_f, out_f, seed, case="", weights=None):
    """qkv_proj on [T, in_f] x [out_f, in_f] against ref_linear with the bias; also used by test_cuda_variants.
    `weights`: (backend weight, float64 reference weight) made once for several cases (the 7B shapes)."""
    rng = rng_for(seed)
    x = fp16(rng, (T, in_f))
    qw, wref = weights or _quantized(backend, fmt, quantizable_weight(rng, out_f, in_f))
    bias = fp16(rng, (out_f,), 0.5)
    ref = ref_ops.ref_linear(x, wref, bias)
    plain = _round(ref_ops.ref_linear(x, wref, bias, dtype=F32), F16)
    out = sentinel(backend, (T, out_f), F16)
    backend.qkv_proj(dev(backend, x), qw, dev(backend, bias), out)
    assert_close("qkv_proj", host(backend, out), ref, plain, backend=backend.name,
                 case=f"T={T},in={in_f},out={out_f}{case}", seed=seed)


def check_linear_residual(backend, fmt, op, T, in_f, out_f, seed, case="", weights=None):
    """o_proj_residual / down_residual: residual += x W^T against the reference sum."""
    rng = rng_for(seed)
    x = fp16(rng, (T, in_f))
    qw, wref = weights or _quantized(backend, fmt, quantizable_weight(rng, out_f, in_f))
    resid = (rng.standard_normal((T, out_f)) * 4).astype(F32)
    ref = resid + ref_ops.ref_linear(x, wref)
    plain = resid + ref_ops.ref_linear(x, wref, dtype=F32)
    out = dev(backend, resid.copy())
    getattr(backend, op)(dev(backend, x), qw, out)
    assert_close(op, host(backend, out), ref, plain, backend=backend.name,
                 case=f"T={T},in={in_f},out={out_f}{case}", seed=seed)


def check_gate_up_silu(backend, fmt, T, H, inter, seed, case="", weights=None):
    """gate_up_silu on rows [gate; up] of [2 inter, H] against ref_gate_up_silu."""
    rng = rng_for(seed)
    x = fp16(rng, (T, H))
    qw, wref = weights or _quantized(backend, fmt, quantizable_weight(rng, 2 * inter, H, scale=0.1))  # rows [gate; up]
    ref = ref_ops.ref_gate_up_silu(x, wref[:inter], wref[inter:])
    plain = _round(ref_ops.ref_gate_up_silu(x, wref[:inter], wref[inter:], dtype=F32), F16)
    out = sentinel(backend, (T, inter), F16)
    backend.gate_up_silu(dev(backend, x), qw, out)
    assert_close("gate_up_silu", host(backend, out), ref, plain, backend=backend.name,
                 case=f"T={T},H={H},I={inter}{case}", seed=seed)


@given(shape=linear_shapes(), seed=seeds)
@example(shape=(1, 128, 8, 0), seed=0)
def test_qkv_proj_with_bias(backend, quant_format, shape, seed):
    T, in_f, out_f, _ = shape
    check_qkv_proj(backend, quant_format, T, in_f, out_f, seed)


@pytest.mark.parametrize("op", ["o_proj_residual", "down_residual"])
@given(shape=linear_shapes(), seed=seeds)
@example(shape=(1, 512, 128, 0), seed=0)
def test_linear_residual_adds_into_fp32_stream(backend, quant_format, op, shape, seed):
    T, in_f, out_f, _ = shape
    check_linear_residual(backend, quant_format, op, T, in_f, out_f, seed)


@given(T=st.integers(1, 6), H=st.sampled_from((128, 256, 384)), inter=st.sampled_from((128, 256, 768)), seed=seeds)
@example(T=1, H=128, inter=128, seed=0)
def test_gate_up_silu_fused(backend, quant_format, T, H, inter, seed):
    check_gate_up_silu(backend, quant_format, T, H, inter, seed)


# --- RoPE and the KV page write ------------------------------------------------------------------


# Positions past 2048 and 4096: an angle pos * inv_freq computed in fp16 (ulp 2 at 2048, 4 at 4096)
# instead of fp32 is off by radians there, and nowhere near the start of a sequence.
@given(T=st.integers(1, 20), start=st.one_of(st.just(0), st.sampled_from((15, 16, 31, 2047, 4095, 8190)), st.integers(0, 9000)),
       nkv=st.sampled_from((1, 2, 4)), ratio=st.sampled_from((1, 2, 7)), d=st.sampled_from((64, 128)),
       theta=st.sampled_from((1e4, 1e6)), layout=st.sampled_from(("contiguous", "shuffled", "sparse")), seed=seeds)
@example(T=1, start=0, nkv=1, ratio=1, d=64, theta=1e4, layout="contiguous", seed=0)
@example(T=3, start=15, nkv=4, ratio=7, d=128, theta=1e6, layout="shuffled", seed=1)
@example(T=2, start=4095, nkv=2, ratio=7, d=128, theta=1e6, layout="sparse", seed=2)
def test_rope_kv_write_rotates_and_writes_only_its_slots(backend, T, start, nkv, ratio, d, theta, layout, seed):
    rng = rng_for(seed)
    nq = nkv * ratio
    qkv = fp16(rng, (T, (nq + 2 * nkv) * d), 2.0)
    positions = np.arange(start, start + T, dtype=np.int32)
    table, num_pages = make_page_table(rng, -(-(start + T) // 16), layout)
    pages_shape = (num_pages, nkv, 16, d)
    q_in = qkv[:, : nq * d].reshape(T, nq, d)
    k_in = qkv[:, nq * d: (nq + nkv) * d].reshape(T, nkv, d)
    v_in = qkv[:, (nq + nkv) * d:].reshape(T, nkv, d)
    ref_q, ref_k = ref_ops.ref_rope(q_in, positions, theta), ref_ops.ref_rope(k_in, positions, theta)
    plain_q = _round(ref_ops.ref_rope(q_in, positions, theta, dtype=F32), F16)
    plain_k = _round(ref_ops.ref_rope(k_in, positions, theta, dtype=F32), F16)

    k_pages, v_pages = sentinel(backend, pages_shape, F16), sentinel(backend, pages_shape, F16)
    q_out = sentinel(backend, (T, nq, d), F16)
    backend.rope_kv_write(dev(backend, qkv), dev(backend, positions), k_pages, v_pages, dev(backend, table), theta, q_out)
    kp, vp = host(backend, k_pages), host(backend, v_pages)
    case = f"T={T},start={start},nq={nq},nkv={nkv},d={d},theta={theta:g},{layout}"
    assert_close("rope_q", host(backend, q_out), ref_q, plain_q, backend=backend.name, case=case, seed=seed, tol_op="rope_kv_write")
    slots = (table[positions // 16], positions % 16)
    k_written = np.stack([kp[p, :, s] for p, s in zip(*slots)])
    v_written = np.stack([vp[p, :, s] for p, s in zip(*slots)])
    assert_close("rope_k", k_written, ref_k, plain_k, backend=backend.name, case=case, seed=seed, tol_op="rope_kv_write")
    assert_equal("kv_write_v", v_written, v_in, backend=backend.name, case=case, seed=seed)
    written = np.zeros(kp.shape[:1] + kp.shape[2:3], dtype=bool)  # [page, slot]
    written[slots] = True
    assert np.isnan(kp.transpose(0, 2, 1, 3)[~written]).all(), f"rope_kv_write[{case}] wrote K outside its {T} slots"
    assert np.isnan(vp.transpose(0, 2, 1, 3)[~written]).all(), f"rope_kv_write[{case}] wrote V outside its {T} slots"


# --- paged attention -----------------------------------------------------------------------------


def _check_attention(backend, op: str, c: PagedCase):
    ref = ref_ops.ref_paged_attention(c.q, c.k_pages, c.v_pages, c.page_table, c.positions)
    plain = _round(ref_ops.ref_paged_attention(c.q, c.k_pages, c.v_pages, c.page_table, c.positions, dtype=F32), F16)
    out = sentinel(backend, (c.T, c.nq * c.d), F16)
    getattr(backend, op)(*dev(backend, c.q, c.k_pages, c.v_pages, c.page_table, c.positions), out)
    assert_close(op, host(backend, out), ref, plain, backend=backend.name, case=str(c), seed=c.seed, tol_op="attention")


@given(c=paged_cases(decode=True))
@example(c=PagedCase.build(seed=0, L=1, T=1, nq=1, nkv=1, d=64, layout="contiguous"))  # position 0: one key
@example(c=PagedCase.build(seed=1, L=16, T=1, nq=28, nkv=4, d=128, layout="shuffled"))  # a full page, the 7B head layout
@example(c=PagedCase.build(seed=2, L=17, T=1, nq=8, nkv=2, d=64, layout="sparse"))  # one slot into a second page
@example(c=PagedCase.build(seed=3, L=33, T=1, nq=6, nkv=1, d=128, layout="shuffled"))
@example(c=PagedCase.build(seed=4, L=32, T=1, nq=7, nkv=1, d=64, layout="shuffled", scale=4.0))  # large scores
@example(c=PagedCase.build(seed=5, L=300, T=1, nq=28, nkv=4, d=128, layout="shuffled", scale=8.0))  # scores of std 64
def test_attention_decode_reads_exactly_the_valid_keys(backend, c):
    _check_attention(backend, "attention_decode", c)


@given(c=paged_cases(decode=False))
@example(c=PagedCase.build(seed=0, L=1, T=1, nq=2, nkv=1, d=64, layout="contiguous"))
@example(c=PagedCase.build(seed=1, L=17, T=17, nq=4, nkv=2, d=64, layout="shuffled"))  # whole prompt, crossing a page
@example(c=PagedCase.build(seed=2, L=33, T=3, nq=14, nkv=2, d=64, layout="sparse"))  # a chunk after a cached prefix
@example(c=PagedCase.build(seed=3, L=48, T=32, nq=28, nkv=4, d=128, layout="shuffled"))
@example(c=PagedCase.build(seed=4, L=200, T=24, nq=28, nkv=4, d=128, layout="sparse", scale=8.0))  # scores of std 64
def test_attention_prefill_is_causal_over_pages(backend, c):
    _check_attention(backend, "attention_prefill", c)


@pytest.mark.parametrize("L", PAGE_BOUNDARY_LENGTHS)
def test_attention_decode_at_every_page_edge(backend, L):
    for nkv, ratio, d in ((2, 2, 64), (4, 7, 128)):
        case = PagedCase.build(seed=L, L=L, T=1, nq=nkv * ratio, nkv=nkv, d=d, layout="shuffled")
        _check_attention(backend, "attention_decode", case)


# --- lm_head and argmax --------------------------------------------------------------------------


@given(V=st.sampled_from((128, 512, 1000, 4096)), H=st.sampled_from((128, 256)), seed=seeds)
@example(V=128, H=128, seed=0)
def test_lm_head_fp16_weight_fp32_logits(backend, V, H, seed):
    rng = rng_for(seed)
    x = fp16(rng, (1, H))
    w = fp16(rng, (V, H), 0.2)
    ref = ref_ops.ref_lm_head(x, w)
    plain = ref_ops.ref_lm_head(x, w, dtype=F32)
    out = sentinel(backend, (1, V), F32)
    backend.lm_head(dev(backend, x), dev(backend, w), out)
    assert_close("lm_head", host(backend, out), ref, plain, backend=backend.name, case=f"V={V},H={H}", seed=seed)


@given(V=st.sampled_from((1, 2, 128, 1000, 152064)), ties=st.integers(0, 5), seed=seeds)
@example(V=152064, ties=3, seed=0)
@example(V=1000, ties=0, seed=1)
def test_argmax_lowest_index_wins_a_tie(backend, V, ties, seed):
    rng = rng_for(seed)
    logits = rng.standard_normal(V).astype(F32)
    if ties and V > 1:
        at = rng.choice(V, size=min(ties + 1, V), replace=False)
        logits[at] = logits.max() + 1.0  # several equal maxima
    ref = ref_ops.ref_argmax(logits)
    out = sentinel(backend, (1,), np.int32)
    backend.argmax(dev(backend, logits), out)
    assert_equal("argmax", host(backend, out), np.array([ref], dtype=np.int32), backend=backend.name,
                 case=f"V={V},ties={ties}", seed=seed)


# --- decode_advance ------------------------------------------------------------------------------


@given(next_id=st.integers(0, 2**31 - 1), old_id=st.integers(0, 2**31 - 1), start=st.integers(0, 2**31 - 100),
       steps=st.integers(1, 5), seed=seeds)
@example(next_id=0, old_id=151643, start=0, steps=1, seed=0)
@example(next_id=151935, old_id=7, start=15, steps=2, seed=1)  # crosses the page edge at 16
def test_decode_advance_feeds_the_picked_token_back_and_moves_one_position(backend, next_id, old_id, start, steps, seed):
    # The spec is the op itself (docs/BACKEND.md): ids[0] = next_id[0]; positions[0] += 1, on the device.
    rng = rng_for(seed)
    picks = [next_id, *rng.integers(0, 2**31 - 1, size=steps - 1)]
    ids = dev(backend, np.array([old_id], dtype=np.int32))
    positions = dev(backend, np.array([start], dtype=np.int32))
    for k, pick in enumerate(picks, 1):
        nxt = dev(backend, np.array([pick], dtype=np.int32))
        backend.decode_advance(nxt, ids, positions)
        case = f"next_id={pick},start={start},step={k}"
        assert_equal("decode_advance", host(backend, ids), np.array([pick], dtype=np.int32),
                     backend=backend.name, case=case, seed=seed)
        assert_equal("decode_advance", host(backend, positions), np.array([start + k], dtype=np.int32),
                     backend=backend.name, case=case, seed=seed)
        assert_equal("decode_advance", host(backend, nxt), np.array([pick], dtype=np.int32),
                     backend=backend.name, case=case + " (next_id is read, never written)", seed=seed)
