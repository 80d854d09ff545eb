"""The unit rung's op checks: each runs one Backend op on inputs made from its arguments (shapes and a
seed, or a PagedCase) and raises AssertionError naming the op where the result leaves its `ref_*`.

Each reads the same way: inputs rounded to their storage dtype, `ref = ref_op(...)` in float64, `plain =
ref_op(..., dtype=float32)` rounded to the output dtype (the noise floor), `out = backend.op(...)` into a
sentinel-filled buffer, `assert_close(op, out, ref, plain)` with TOL. `decode_advance` (an integer copy
and an increment) is checked exactly against its definition.

A check draws nothing. The unit rung (ladder/unit/test_ops.py) draws its arguments with Hypothesis; the
planted faults' proof (ladder/unit/test_planted_faults.py) and the op sweep run under compute-sanitizer
(ladder/tools/opsweep.py) give explicit ones. A check's `examples` (set by `@examples`) are its explicit
cases: the rung runs them on every run, before its draws, and each planted fault must fail them. Nothing
here imports pytest or Hypothesis.
"""

from __future__ import annotations

import numpy as np

from fixtures.cases import PAGE_BOUNDARY_LENGTHS, PagedCase, fp16, make_page_table, quantizable_weight, rng_for
from ladder.checks.harness import by_row_blocks, dev, guarded, host, quantized, sentinel
from ladder.judges.compare import assert_close, assert_equal
from reference import ops as ref_ops
from reference.formats import REF_DEQUANT

F16, F32 = np.float16, np.float32


def examples(*cases: dict):
    """Give a check its explicit examples: keyword arguments, without the backend and the format."""
    def attach(check):
        check.examples = cases
        return check
    return attach


def _round(a, dtype):
    return np.asarray(a).astype(dtype)


def quantized_and_read(backend, fmt, w, by_rows: bool = False):
    """(the backend's weight, the float64 reference weight) for a float32 weight in format `fmt`; `by_rows`:
    both made by row blocks side by side (ladder/checks/harness.py by_row_blocks; for the 7B-shape weights)."""
    if fmt.name not in REF_DEQUANT:
        raise AssertionError(f"format {fmt.name!r} has no reference reading in reference/formats.py REF_DEQUANT")
    qw, tensors = quantized(backend, fmt, w, by_rows)
    reading = REF_DEQUANT[fmt.name]
    return qw, np.concatenate(by_row_blocks(reading, tensors)) if by_rows else reading(tensors)


# --- embed ---------------------------------------------------------------------------------------


@examples(dict(T=1, V=128, H=128, seed=0))
def check_embed(backend, T, V, H, seed):
    rng = rng_for(seed)
    table = fp16(rng, (V, H))
    ids = rng.integers(0, V, size=T).astype(np.int32)
    ids[0] = V - 1  # the last row: an off-by-one in the row stride reads past the table
    ref = ref_ops.ref_embed(ids, table)
    out = sentinel(backend, (T, H), F32)
    backend.embed(dev(backend, ids), dev(backend, table), out)
    assert_close("embed", host(backend, out, "embed"), ref, backend=backend.name, case=f"T={T},V={V},H={H}", seed=seed)


# --- rmsnorm -------------------------------------------------------------------------------------


@examples(dict(T=1, H=3584, eps=1e-6, kind="normal", seed=0),
          dict(T=3, H=128, eps=1e-6, kind="constant_rows", seed=1))
def check_rmsnorm(backend, T, H, eps, kind, seed):
    """`kind`: "normal", "constant_rows" (every element of a row equal), "large" (x 3e3), "tiny" (x 1e-3)."""
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
    assert_close("rmsnorm", host(backend, out, "rmsnorm"), ref, plain, backend=backend.name, case=f"T={T},H={H},{kind}", seed=seed)


def check_rmsnorm_rows(backend, T, first, H=3584):
    """rmsnorm of rows first..first+T of a [T + 4, H] buffer: the engine normalizes a row slice of its
    residual buffer (the final norm reads row 0 of [T, H])."""
    rng = rng_for(first)
    x = (rng.standard_normal((T + 4, H)) * 3).astype(F32)
    w = fp16(rng, (H,), 0.5) + F16(1.0)
    rows = x[first:first + T]
    ref = ref_ops.ref_rmsnorm(rows, w, 1e-6)
    plain = _round(ref_ops.ref_rmsnorm(rows, w, 1e-6, dtype=F32), F16)
    out = sentinel(backend, (T, H), F16)
    backend.rmsnorm(dev(backend, x)[first:first + T], dev(backend, w), 1e-6, out)
    assert_close("rmsnorm", host(backend, out, "rmsnorm"), ref, plain, backend=backend.name,
                 case=f"T={T},H={H},rows {first}..{first + T} of {T + 4}", seed=first)


# --- quantized linears ---------------------------------------------------------------------------
# `fmt` is the weight's format (engine/formats); `weights`: (backend weight, float64 reference weight)
# made once for several cases (the 7B shapes, ladder/unit/test_cuda_variants.py).


@examples(dict(T=1, in_f=128, out_f=8, seed=0))
def check_qkv_proj(backend, fmt, T, in_f, out_f, seed, case="", weights=None):
    """qkv_proj on [T, in_f] x [out_f, in_f] against ref_linear with the bias."""
    rng = rng_for(seed)
    x = fp16(rng, (T, in_f))
    qw, wref = weights or quantized_and_read(backend, fmt, quantizable_weight(rng, out_f, in_f))
    bias = fp16(rng, (out_f,), 0.5)
    ref = ref_ops.ref_linear(x, wref, bias)
    plain = _round(ref_ops.ref_linear(x, wref, bias, dtype=F32), F16)
    out = sentinel(backend, (T, out_f), F16)
    backend.qkv_proj(dev(backend, x), qw, dev(backend, bias), out)
    assert_close("qkv_proj", host(backend, out, "qkv_proj"), ref, plain, backend=backend.name,
                 case=f"T={T},in={in_f},out={out_f}{case}", seed=seed)


def check_linear_residual(backend, fmt, op, T, in_f, out_f, seed, case="", weights=None):
    """o_proj_residual / down_residual (`op`): residual += x W^T against the reference sum."""
    rng = rng_for(seed)
    x = fp16(rng, (T, in_f))
    qw, wref = weights or quantized_and_read(backend, fmt, quantizable_weight(rng, out_f, in_f))
    resid = (rng.standard_normal((T, out_f)) * 4).astype(F32)
    ref = resid + ref_ops.ref_linear(x, wref)
    plain = resid + ref_ops.ref_linear(x, wref, dtype=F32)
    out = guarded(backend, resid)
    getattr(backend, op)(dev(backend, x), qw, out)
    assert_close(op, host(backend, out, op), ref, plain, backend=backend.name,
                 case=f"T={T},in={in_f},out={out_f}{case}", seed=seed)


RESIDUAL_EXAMPLES = (dict(T=1, in_f=512, out_f=128, seed=0),)  # four groups: a scale fault in the last shows


@examples(*RESIDUAL_EXAMPLES)
def check_o_proj_residual(backend, fmt, T, in_f, out_f, seed, case="", weights=None):
    check_linear_residual(backend, fmt, "o_proj_residual", T, in_f, out_f, seed, case, weights)


@examples(*RESIDUAL_EXAMPLES)
def check_down_residual(backend, fmt, T, in_f, out_f, seed, case="", weights=None):
    check_linear_residual(backend, fmt, "down_residual", T, in_f, out_f, seed, case, weights)


# The fused ops (kernels/base.py FUSED_OPS): a residual op and the rmsnorm after it. T = 1 is the decode
# step's call (the two ops on the CUDA backend), T = 3 a prefill's (one epilogue kernel there); 136 rows:
# past 128, so GEMV blocks of 8 and 16 rows leave a partial last block.
FUSED_EXAMPLES = (dict(T=1, in_f=512, out_f=136, seed=0), dict(T=3, in_f=256, out_f=128, seed=1))


def check_linear_residual_rmsnorm(backend, fmt, op, T, in_f, out_f, seed, case="", weights=None):
    """o_proj_residual_rmsnorm / down_residual_rmsnorm (`op`): the residual against the reference sum, as
    its residual op's check, and the norm's output against rmsnorm's reference on the residual the op
    left (each part with its own tolerance). Called twice: the second call's norm must read the second
    call's residual (a fused kernel's state carried between launches shows there)."""
    rng = rng_for(seed)
    qw, wref = weights or quantized_and_read(backend, fmt, quantizable_weight(rng, out_f, in_f))
    resid = (rng.standard_normal((T, out_f)) * 4).astype(F32)
    norm_w = fp16(rng, (out_f,), 0.5) + F16(1.0)
    out = guarded(backend, resid)
    part = op[:-len("_rmsnorm")]
    for call in (1, 2):
        x = fp16(rng, (T, in_f))
        before = host(backend, out, part)
        ref = before + ref_ops.ref_linear(x, wref)
        plain = before + ref_ops.ref_linear(x, wref, dtype=F32)
        normed = sentinel(backend, (T, out_f), F16)
        getattr(backend, op)(dev(backend, x), qw, out, dev(backend, norm_w), 1e-6, normed)
        where = f"T={T},in={in_f},out={out_f},call {call}{case}"
        after = host(backend, out, part)
        assert_close(part, after, ref, plain, backend=backend.name, case=where, seed=seed)
        assert_close("rmsnorm", host(backend, normed, "rmsnorm"), ref_ops.ref_rmsnorm(after, norm_w, 1e-6),
                     _round(ref_ops.ref_rmsnorm(after, norm_w, 1e-6, dtype=F32), F16), backend=backend.name,
                     case=f"{op}: {where}", seed=seed)


@examples(*FUSED_EXAMPLES)
def check_o_proj_residual_rmsnorm(backend, fmt, T, in_f, out_f, seed, case="", weights=None):
    check_linear_residual_rmsnorm(backend, fmt, "o_proj_residual_rmsnorm", T, in_f, out_f, seed, case, weights)


@examples(*FUSED_EXAMPLES)
def check_down_residual_rmsnorm(backend, fmt, T, in_f, out_f, seed, case="", weights=None):
    check_linear_residual_rmsnorm(backend, fmt, "down_residual_rmsnorm", T, in_f, out_f, seed, case, weights)


@examples(dict(T=1, H=128, inter=128, seed=0))
def check_gate_up_silu(backend, fmt, T, H, inter, seed, case="", weights=None):
    """gate_up_silu on rows [gate; up] of [2 inter, H] against ref_gate_up_silu."""
    rng = rng_for(seed)
    x = fp16(rng, (T, H))
    qw, wref = weights or quantized_and_read(backend, fmt, quantizable_weight(rng, 2 * inter, H, scale=0.1))  # rows [gate; up]
    ref = ref_ops.ref_gate_up_silu(x, wref[:inter], wref[inter:])
    plain = _round(ref_ops.ref_gate_up_silu(x, wref[:inter], wref[inter:], dtype=F32), F16)
    out = sentinel(backend, (T, inter), F16)
    backend.gate_up_silu(dev(backend, x), qw, out)
    assert_close("gate_up_silu", host(backend, out, "gate_up_silu"), ref, plain, backend=backend.name,
                 case=f"T={T},H={H},I={inter}{case}", seed=seed)


def check_linear(backend, fmt, op, T, in_f, rows, seed, case="", weights=None):
    """One quantized linear `op` at [T, in_f] -> `rows` outputs (gate_up_silu: `rows` = I), by its check."""
    if op == "qkv_proj":
        check_qkv_proj(backend, fmt, T, in_f, rows, seed, case, weights)
    elif op == "gate_up_silu":
        check_gate_up_silu(backend, fmt, T, in_f, rows, seed, case, weights)
    elif op.endswith("_rmsnorm"):
        check_linear_residual_rmsnorm(backend, fmt, op, T, in_f, rows, seed, case, weights)
    else:
        check_linear_residual(backend, fmt, op, T, in_f, rows, seed, case, weights)


# --- RoPE and the KV page write ------------------------------------------------------------------


@examples(dict(T=1, start=0, nkv=1, ratio=1, d=64, theta=1e4, layout="contiguous", seed=0),
          dict(T=3, start=15, nkv=4, ratio=7, d=128, theta=1e6, layout="shuffled", seed=1),
          dict(T=2, start=4095, nkv=2, ratio=7, d=128, theta=1e6, layout="sparse", seed=2))
def check_rope_kv_write(backend, T, start, nkv, ratio, d, theta, layout, seed):
    """Q rotated into q_out, K rotated and V copied into their page slots (positions start..start+T), and
    nothing written outside those slots."""
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
    kp, vp = host(backend, k_pages, "rope_kv_write"), host(backend, v_pages, "rope_kv_write")
    case = f"T={T},start={start},nq={nq},nkv={nkv},d={d},theta={theta:g},{layout}"
    assert_close("rope_q", host(backend, q_out, "rope_kv_write"), ref_q, plain_q, backend=backend.name, case=case, seed=seed, tol_op="rope_kv_write")
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


def check_attention(backend, op: str, case: PagedCase):
    """attention_decode or attention_prefill (`op`) on a paged case against ref_paged_attention; returns
    (out, ref, plain) for a check that looks closer."""
    c = case
    ref = ref_ops.ref_paged_attention(c.q, c.k_pages, c.v_pages, c.page_table, c.positions)
    plain = _round(ref_ops.ref_paged_attention(c.q, c.k_pages, c.v_pages, c.page_table, c.positions, dtype=F32), F16)
    out = sentinel(backend, (c.T, c.nq * c.d), F16)
    getattr(backend, op)(*dev(backend, c.q, c.k_pages, c.v_pages, c.page_table, c.positions), out)
    out = host(backend, out, op)
    assert_close(op, out, ref, plain, backend=backend.name, case=str(c), seed=c.seed, tol_op="attention")
    return out, ref, plain


@examples(dict(case=PagedCase.build(seed=0, L=1, T=1, nq=1, nkv=1, d=64, layout="contiguous")),  # position 0: one key
          dict(case=PagedCase.build(seed=1, L=16, T=1, nq=28, nkv=4, d=128, layout="shuffled")),  # a full page, the 7B head layout
          dict(case=PagedCase.build(seed=2, L=17, T=1, nq=8, nkv=2, d=64, layout="sparse")),  # one slot into a second page
          dict(case=PagedCase.build(seed=3, L=33, T=1, nq=6, nkv=1, d=128, layout="shuffled")),
          dict(case=PagedCase.build(seed=4, L=32, T=1, nq=7, nkv=1, d=64, layout="shuffled", scale=4.0)),  # large scores
          dict(case=PagedCase.build(seed=5, L=300, T=1, nq=28, nkv=4, d=128, layout="shuffled", scale=8.0)))  # scores of std 64
def check_attention_decode(backend, case: PagedCase):
    check_attention(backend, "attention_decode", case)


@examples(dict(case=PagedCase.build(seed=0, L=1, T=1, nq=2, nkv=1, d=64, layout="contiguous")),
          dict(case=PagedCase.build(seed=1, L=17, T=17, nq=4, nkv=2, d=64, layout="shuffled")),  # whole prompt, crossing a page
          dict(case=PagedCase.build(seed=2, L=33, T=3, nq=14, nkv=2, d=64, layout="sparse")),  # a chunk after a cached prefix
          dict(case=PagedCase.build(seed=3, L=48, T=32, nq=28, nkv=4, d=128, layout="shuffled")),
          dict(case=PagedCase.build(seed=4, L=200, T=24, nq=28, nkv=4, d=128, layout="sparse", scale=8.0)))  # scores of std 64
def check_attention_prefill(backend, case: PagedCase):
    check_attention(backend, "attention_prefill", case)


@examples(dict(op="attention_decode", L=48, T=1, nq=28, nkv=4, d=128, layout="shuffled", seed=0),  # warp kernel, 7B heads
          dict(op="attention_decode", L=32, T=1, nq=2, nkv=1, d=96, layout="sparse", seed=1),  # block kernel
          dict(op="attention_decode", L=1000, T=1, nq=28, nkv=4, d=128, layout="sparse", seed=2),  # 63 pages: splits, combine
          dict(op="attention_prefill", L=48, T=48, nq=28, nkv=4, d=128, layout="shuffled", seed=3),  # tensor cores, d 128
          dict(op="attention_prefill", L=40, T=24, nq=4, nkv=2, d=64, layout="contiguous", seed=4),  # tensor cores, d 64, a chunk
          dict(op="attention_prefill", L=34, T=6, nq=2, nkv=1, d=96, layout="shuffled", seed=5))  # a decode kernel per token
def check_attention_keeps_fp32_probabilities(backend, op, L, T, nq, nkv, d, layout, seed):
    """P.V with probabilities good to fp32, on `PagedCase.cancelling`: keys in pairs whose V rows (about
    1000) cancel. The whole output is checked as usual; then the rows at odd positions, which hold whole
    pairs and come out near 0, are checked alone, so their bound is a few fp16 ulps of 1. A probability
    rounded to fp16 anywhere in P.V (the tensor-core prefill's P_lo part dropped or added into another
    column tile) moves such a row by about 2^-12 x 1000 / 1.5, 0.15: 70 times that bound in a NumPy
    simulation of the tensor-core kernel (a correct one: 6.6e-5, 30 times under it)."""
    case = PagedCase.cancelling(seed=seed, L=L, T=T, nq=nq, nkv=nkv, d=d, layout=layout)
    out, ref, plain = check_attention(backend, op, case)
    odd = case.positions % 2 == 1
    assert odd.any(), f"{case}: no query at an odd position"
    assert_close(op, out[odd], ref[odd], plain[odd], backend=backend.name, case=f"{case}, rows at odd positions",
                 seed=seed, tol_op="attention")


@examples(*(dict(L=L) for L in PAGE_BOUNDARY_LENGTHS))
def check_attention_decode_at_page_edge(backend, L):
    """Decode at the L-th position (L around a page edge), in two head layouts: 2 x 2 of 64, 4 x 7 of 128."""
    for nkv, ratio, d in ((2, 2, 64), (4, 7, 128)):
        check_attention_decode(backend, PagedCase.build(seed=L, L=L, T=1, nq=nkv * ratio, nkv=nkv, d=d, layout="shuffled"))


# --- lm_head and argmax --------------------------------------------------------------------------


@examples(dict(V=128, H=128, seed=0))
def check_lm_head(backend, V, H, seed, T=1):
    rng = rng_for(seed)
    x = fp16(rng, (T, H))
    w = fp16(rng, (V, H), 0.2)
    ref = ref_ops.ref_lm_head(x, w)
    plain = ref_ops.ref_lm_head(x, w, dtype=F32)
    out = sentinel(backend, (T, V), F32)
    backend.lm_head(dev(backend, x), dev(backend, w), out)
    assert_close("lm_head", host(backend, out, "lm_head"), ref, plain, backend=backend.name,
                 case=f"T={T},V={V},H={H}", seed=seed)


@examples(dict(V=152064, ties=3, seed=0), dict(V=1000, ties=0, seed=1))
def check_argmax(backend, V, ties, seed):
    """The lowest index wins a tie among `ties` + 1 equal maxima."""
    rng = rng_for(seed)
    logits = rng.standard_normal(V).astype(F32)
    if ties and V > 1:
        at = rng.choice(V, size=min(ties + 1, V), replace=False)
        logits[at] = logits.max() + 1.0  # several equal maxima
    ref = ref_ops.ref_argmax(logits)
    out = sentinel(backend, (1,), np.int32)
    backend.argmax(dev(backend, logits), out)
    assert_equal("argmax", host(backend, out, "argmax"), np.array([ref], dtype=np.int32), backend=backend.name,
                 case=f"V={V},ties={ties}", seed=seed)


def check_argmax_of_a_constant_row(backend, V, value):
    """Every logit `value`: index 0 wins. With -inf (every token masked) no logit beats a thread's empty
    start (-inf), so the result is decided by the start's index alone: a kernel whose idle threads start
    from an index below every real one (a negative sentinel) returns it."""
    logits = np.full(V, value, dtype=F32)
    out = sentinel(backend, (1,), np.int32)
    backend.argmax(dev(backend, logits), out)
    assert_equal("argmax", host(backend, out, "argmax"), np.array([ref_ops.ref_argmax(logits)], dtype=np.int32),
                 backend=backend.name, case=f"V={V},every logit {value}", seed=0)


# --- decode_advance ------------------------------------------------------------------------------


@examples(dict(next_id=0, old_id=151643, start=0, steps=1, seed=0),
          dict(next_id=151935, old_id=7, start=15, steps=2, seed=1))  # crosses the page edge at 16
def check_decode_advance(backend, next_id, old_id, start, steps, seed):
    """The spec is the op itself (docs/BACKEND.md): ids[0] = next_id[0]; positions[0] += 1, on the device."""
    rng = rng_for(seed)
    picks = [next_id, *rng.integers(0, 2**31 - 1, size=steps - 1)]
    ids = guarded(backend, np.array([old_id], dtype=np.int32))
    positions = guarded(backend, np.array([start], dtype=np.int32))
    for k, pick in enumerate(picks, 1):
        nxt = dev(backend, np.array([pick], dtype=np.int32))
        backend.decode_advance(nxt, ids, positions)
        case = f"next_id={pick},start={start},step={k}"
        assert_equal("decode_advance", host(backend, ids, "decode_advance"), np.array([pick], dtype=np.int32),
                     backend=backend.name, case=case, seed=seed)
        assert_equal("decode_advance", host(backend, positions, "decode_advance"), np.array([start + k], dtype=np.int32),
                     backend=backend.name, case=case, seed=seed)
        assert_equal("decode_advance", host(backend, nxt, "decode_advance"), np.array([pick], dtype=np.int32),
                     backend=backend.name, case=case + " (next_id is read, never written)", seed=seed)
