"""The measuring half of `nanoqwen bench` (bench/decode_bench.py runs the protocol and reports).

Seeded random weights made on the GPU in any format the cuda backend has (a hash of the tensor's name
and index, so a rerun builds the same model; each format's stored tensors filled with valid values at
about unit gain), the bytes a decode step must read, CUDA-event timing of a graph and the copy-rate
ceiling, the state of one decode step at a given context, the per-kernel table and the GEMV variant
sweep (the timing helpers, the seeded random bits and the seeded blocks of any format come from
ladder/tools/gemv_timing.py). CuPy is imported inside the functions: the module imports on a machine without it.
"""

from __future__ import annotations

import numpy as np

# The GPU timing helpers and the seeded random bits are shared with `nanoqwen quant-report`'s GEMV column,
# so they live in the ladder (bench/ is a leaf nothing imports); bench/ imports them from here.
from ladder.tools.gemv_timing import (BLOCK_ROWS, copy_rate, hash_kernel, name_seed, quantized_block,  # noqa: F401
                                time_graph)


# ---- random weights on the GPU ---------------------------------------------------------------------

def fill_uniform_f16(arr, lo, hi, name, seed):
    """fp16 values uniform in [lo, hi) from the hash."""
    import cupy as cp

    u = cp.empty(arr.size, dtype=cp.uint32)
    hash_kernel()(name_seed(name, seed), u)
    arr[...] = (lo + (hi - lo) * (u.astype(cp.float32) / np.float32(2**32))).astype(cp.float16).reshape(arr.shape)


def fill_normal_f16(arr, std, name, seed):
    """fp16 values ~ N(0, std^2) (sum of four uniforms, scaled: light tails, enough for a benchmark)."""
    import cupy as cp

    u = cp.empty((4, arr.size), dtype=cp.uint32)
    hash_kernel()(name_seed(name, seed), u)
    x = (u.astype(cp.float32) / np.float32(2**32) - 0.5).sum(axis=0) * np.float32(np.sqrt(3.0))
    arr[...] = (x * np.float32(std)).astype(cp.float16).reshape(arr.shape)


# ---- each format's stored tensors, through the format's own definition ------------------------------
#
# A linear's stored tensors are its format's own `quantize` of a seeded random block of BLOCK_ROWS rows
# (ladder/tools/gemv_timing.py quantized_block), written down the rows on the device block after block.


def fill_linear(q, name: str, seed: int) -> None:
    """Seeded random stored tensors of the quantized linear `q` (a QuantizedWeight on the cuda backend)."""
    import cupy as cp

    block = quantized_block(q.format, min(BLOCK_ROWS, q.out_features), q.in_features, name, seed)
    for key, host in block.items():
        dev, b = q[key], cp.asarray(host)
        for r0 in range(0, q.out_features, b.shape[0]):
            r1 = min(q.out_features, r0 + b.shape[0])
            dev[r0:r1] = b[: r1 - r0]


def _placeholders(quant: str) -> dict[str, object]:
    """Stored-tensor suffix -> the value every element of that tensor holds for an all-zero weight: valid
    placeholders (int4_asym_g128's scale_zero words must hold 0x6400 | z), overwritten on the device."""
    from engine.formats import get_format

    fmt = get_format(quant)
    zero = fmt.quantize(np.zeros((1, fmt.in_multiple), dtype=np.float32))
    return {"." + k: np.asarray(v).reshape(-1)[0] for k, v in zero.items()}


def build_model(config, seed: int, cache_tokens: int, quant: str = "int4_sym_g128"):
    """The engine on the cuda backend with seeded random weights in format `quant` made on the GPU (no
    checkpoint)."""
    from engine.model import Model

    fills = _placeholders(quant)

    def get(name, dtype, shape):  # placeholders, overwritten on the device below
        for suffix, value in fills.items():
            if name.endswith(suffix) and value:
                return np.full(shape, value, dtype=dtype)
        return np.zeros(shape, dtype=dtype)

    model = Model(config, quant, "cuda", get, cache_tokens=cache_tokens)
    c = config
    for w in model.layers:
        p = f"layer{w.index}."
        for key in ("qkv", "o_proj", "gate_up", "down"):
            fill_linear(getattr(w, key), p + key, seed)
        fill_normal_f16(w.qkv_bias, 0.1, p + "bias", seed)
        fill_uniform_f16(w.input_layernorm, 0.9, 1.1, p + "ln1", seed)
        fill_uniform_f16(w.post_attention_layernorm, 0.9, 1.1, p + "ln2", seed)
    fill_normal_f16(model.embed_tokens, 1.0, "embed", seed)
    fill_uniform_f16(model.norm, 0.9, 1.1, "norm", seed)
    if model.lm_head is not model.embed_tokens:
        fill_normal_f16(model.lm_head, 4.0 / np.sqrt(c.hidden_size), "lm_head", seed)
    model.backend.synchronize()
    return model


# ---- bytes --------------------------------------------------------------------------------------

def op_bytes(model, ctx: int) -> dict[str, float]:
    """Bytes one decode step's op reads and writes, per call (per layer for the block ops)."""
    c = model.config
    H, I, V, d, nq, nkv = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    w = model.layers[0]

    def qb(q):  # every stored tensor of the format: codes, scales, zero points
        return sum(a.nbytes for a in q.tensors.values())

    return {
        "embed": H * 2 + H * 4,
        "rmsnorm": H * 4 + H * 2 + H * 2,
        "qkv_proj": qb(w.qkv) + w.qkv_bias.nbytes + H * 2 + c.qkv_size * 2,
        "rope_kv_write": c.qkv_size * 2 * 2,
        "attention_decode": 2 * ctx * nkv * d * 2 + 2 * nq * d * 2,
        "o_proj_residual": qb(w.o_proj) + c.q_size * 2 + 2 * H * 4,
        "gate_up_silu": qb(w.gate_up) + H * 2 + I * 2,
        "down_residual": qb(w.down) + I * 2 + 2 * H * 4,
        "final rmsnorm": H * 4 + H * 2 + H * 2,
        "lm_head": V * H * 2 + H * 2 + V * 4,
        "argmax": V * 4,
    }


def step_bytes(model, ctx: int) -> float:
    b = op_bytes(model, ctx)
    L = model.config.num_hidden_layers
    per_layer = 2 * b["rmsnorm"] + sum(b[k] for k in ("qkv_proj", "rope_kv_write", "attention_decode",
                                                       "o_proj_residual", "gate_up_silu", "down_residual"))
    return b["embed"] + L * per_layer + b["final rmsnorm"] + b["lm_head"] + b["argmax"]


# ---- state for one decode step at a given context ---------------------------------------------------

def prefilled(model, prompt):
    seq = model.new_sequence()
    logits = model.prefill(seq, prompt)
    return seq, int(np.argmax(logits))


def block_op_calls(model, seq):
    """name -> fn(layer) calling that backend op for one layer with the decode workspace."""
    be, c, ws = model.backend, model.config, model._decode_ws
    cache = model.cache
    pt = seq.page_table
    return {
        "rmsnorm": lambda i: be.rmsnorm(ws.residual, model.layers[i].input_layernorm, c.rms_norm_eps, ws.h),
        "qkv_proj": lambda i: be.qkv_proj(ws.h, model.layers[i].qkv, model.layers[i].qkv_bias, ws.qkv),
        "rope_kv_write": lambda i: be.rope_kv_write(ws.qkv, ws.positions, cache.k[i], cache.v[i], pt, c.rope_theta, ws.q),
        "attention_decode": lambda i: be.attention_decode(ws.q, cache.k[i], cache.v[i], pt, ws.positions, ws.attn),
        "o_proj_residual": lambda i: be.o_proj_residual(ws.attn, model.layers[i].o_proj, ws.residual),
        "gate_up_silu": lambda i: be.gate_up_silu(ws.h, model.layers[i].gate_up, ws.act),
        "down_residual": lambda i: be.down_residual(ws.act, model.layers[i].down, ws.residual),
    }


def set_decode_inputs(model, seq, token: int):
    """The decode workspace at position seq.length with `token` (what one decode step reads)."""
    ws = model._decode_ws
    seq.reserve(1)
    ws.ids[...] = model.backend.asarray(np.array([token], np.int32))
    ws.positions[...] = model.backend.asarray(np.array([seq.length], np.int32))


def per_kernel_table(model, seq, token, copy_tbs):
    import cupy as cp

    be, c, ws = model.backend, model.config, model._decode_ws
    L = c.num_hidden_layers
    set_decode_inputs(model, seq, token)
    ctx = seq.length + 1
    nbytes = op_bytes(model, ctx)
    saved = ws.residual.copy()
    calls = block_op_calls(model, seq)
    rows = []
    for name, fn in calls.items():
        ms = time_graph(lambda: [fn(i) for i in range(L)]) / L
        count = 2 * L if name == "rmsnorm" else L
        rows.append((name, count, ms, nbytes[name]))
        ws.residual[...] = saved
    h1 = ws.h[:1]
    ends = {
        "embed": (lambda: be.embed(ws.ids, model.embed_tokens, ws.residual), nbytes["embed"]),
        "final rmsnorm": (lambda: be.rmsnorm(ws.residual[:1], model.norm, c.rms_norm_eps, model._final_h), nbytes["final rmsnorm"]),
        "lm_head": (lambda: be.lm_head(h1, model.lm_head, model._logits), nbytes["lm_head"]),
        "argmax": (lambda: be.argmax(model._logits, model._next), nbytes["argmax"]),
    }
    for name, (fn, nb) in ends.items():
        ms = time_graph(lambda: [fn() for _ in range(4)]) / 4
        rows.append((name, 1, ms, nb))
    ws.residual[...] = saved
    table = []
    for name, count, ms, nb in rows:
        table.append({"op": name, "calls": count, "ms_per_call": ms, "ms_per_step": ms * count,
                      "bytes_per_call": nb, "tbs": nb / (ms * 1e-3) / 1e12,
                      "pct_copy_rate": 100 * nb / (ms * 1e-3) / 1e12 / copy_tbs})
    cp.cuda.Stream.null.synchronize()
    return table


def _gemv_reference(model, op, residual):
    """(float64 reference, fp32 noise-floor run, TOL key) of layer 0's `op` on the decode workspace's
    current input, from reference/ops.py (`residual`: the host residual the op adds into)."""
    from reference import ops as ref_ops
    from reference.formats import REF_DEQUANT

    be, ws, layer = model.backend, model._decode_ws, model.layers[0]
    x, w = {"qkv_proj": (ws.h, layer.qkv), "o_proj_residual": (ws.attn, layer.o_proj),
            "gate_up_silu": (ws.h, layer.gate_up), "down_residual": (ws.act, layer.down)}[op]
    x = be.to_numpy(x)
    tensors = {k: be.to_numpy(a) for k, a in w.tensors.items()}
    runs = []
    for dtype in (np.float64, np.float32):
        wd = REF_DEQUANT[w.format](tensors, dtype)
        if op == "qkv_proj":
            y = ref_ops.ref_linear(x, wd, be.to_numpy(layer.qkv_bias), dtype=dtype)
        elif op == "gate_up_silu":
            half = wd.shape[0] // 2
            y = ref_ops.ref_gate_up_silu(x, wd[:half], wd[half:], dtype=dtype)
        else:
            y = residual + ref_ops.ref_linear(x, wd, dtype=dtype)
        runs.append(y)
    fp16_out = op in ("qkv_proj", "gate_up_silu")
    plain = runs[1].astype(np.float16) if fp16_out else runs[1]
    return runs[0], plain, (op, "float16" if fp16_out else "float32")


def sweep_gemv(model, seq, token):
    """Time every GEMV variant of the model's format per op (cold weights), check each against
    reference/ops.py with the ladder's tolerance table (TOL), keep the fastest that passes."""
    from ladder.judges.compare import measure

    be, L = model.backend, model.config.num_hidden_layers
    ws = model._decode_ws
    fmt = model.layers[0].qkv.format
    config, variants = be.gemv_config[fmt], be.linears[fmt].variants
    set_decode_inputs(model, seq, token)
    calls = block_op_calls(model, seq)
    be.embed(ws.ids, model.embed_tokens, ws.residual)  # the residual a decode step starts from
    saved = ws.residual.copy()
    for name in ("rmsnorm", "qkv_proj", "rope_kv_write", "attention_decode", "gate_up_silu"):
        calls[name](0)  # every op's input now holds layer 0's values at this position
    outs = {"qkv_proj": ws.qkv, "o_proj_residual": ws.residual, "gate_up_silu": ws.act, "down_residual": ws.residual}
    result = {}
    for op, out in outs.items():
        default = config[op]
        ref, plain, key = _gemv_reference(model, op, be.to_numpy(saved))
        timings = {}
        for var in variants:
            config[op] = var
            ws.residual[...] = saved
            calls[op](0)
            check = measure(be.to_numpy(out), ref, plain, key)
            ms = time_graph(lambda: [calls[op](i) for i in range(L)]) / L
            timings[var] = {"ms": ms, "max_abs_err": check["max_abs"], "bound": check["bound"], "ok": check["passed"]}
        best = min((v for v in variants if timings[v]["ok"]), key=lambda v: timings[v]["ms"], default=default)
        config[op] = best
        result[op] = {"format": fmt, "default": default, "chosen": best, "variants": timings}
    ws.residual[...] = saved
    return result


ATT_BLOCKS_PER_SM = (2, 4, 8)  # decode attention's block budget (backend.att_blocks) the sweep tries, per SM


def sweep_attention(model, seq, token):
    """Time every decode-attention kernel of the backend (ATTENTION_VARIANTS) over all layers at this
    context, check each against reference/ops.py with the ladder's tolerance (TOL["attention"]), keep
    the fastest that passes. Then, with that kernel, the block budget of its split (`att_blocks`: the
    splits spread the used pages over about that many blocks) at ATT_BLOCKS_PER_SM blocks an SM, each
    checked the same way; the fastest that passes is kept. Returns {"chosen", "variants": {name: {ms,
    max_abs_err, bound, ok, kernel}}, "att_blocks": {blocks: {ms, max_abs_err, bound, ok}},
    "chosen_att_blocks"}."""
    from kernels.cuda import ATTENTION_VARIANTS
    from ladder.judges.compare import measure
    from reference import ops as ref_ops

    be, c, L = model.backend, model.config, model.config.num_hidden_layers
    ws = model._decode_ws
    set_decode_inputs(model, seq, token)
    calls = block_op_calls(model, seq)
    be.embed(ws.ids, model.embed_tokens, ws.residual)
    saved = ws.residual.copy()
    for name in ("rmsnorm", "qkv_proj", "rope_kv_write"):
        calls[name](0)  # layer 0's q and this position's K/V are in place
    host = [be.to_numpy(a) for a in (ws.q, model.cache.k[0], model.cache.v[0], seq.page_table, ws.positions)]
    ref = ref_ops.ref_paged_attention(*host)
    plain = ref_ops.ref_paged_attention(*host, dtype=np.float32).astype(np.float16)

    def timed() -> dict:  # the kernel as the backend now picks it, layer 0 checked, all layers timed
        calls["attention_decode"](0)
        out = be.to_numpy(ws.attn).reshape(ref.shape)
        check = measure(out, ref, plain, ("attention", "float16"))
        ms = time_graph(lambda: [calls["attention_decode"](i) for i in range(L)]) / L
        return {"ms": ms, "max_abs_err": check["max_abs"], "bound": check["bound"], "ok": check["passed"]}

    default, result = be.attention_variant, {}
    for var in ATTENTION_VARIANTS:
        be.attention_variant = var
        plan = be.attention_plan(1, c.num_attention_heads, c.num_key_value_heads, c.head_dim, seq.page_table.shape[0], True)
        result[var] = {**timed(), "kernel": plan.kernel + (" + attention_combine_f16" if plan.combines else "")}
    best = min((v for v in ATTENTION_VARIANTS if result[v]["ok"]), key=lambda v: result[v]["ms"], default=default)
    be.attention_variant = best
    shipped, budgets = be.att_blocks, {}
    for per_sm in ATT_BLOCKS_PER_SM:
        be.att_blocks = per_sm * be.sms
        try:
            budgets[be.att_blocks] = timed()
        except ValueError as e:  # the launcher refuses a split count past the combine kernel's
            budgets[be.att_blocks] = {"ms": float("nan"), "max_abs_err": None, "bound": None, "ok": False, "error": str(e)}
    fits = [b for b, r in budgets.items() if r["ok"]]
    be.att_blocks = min(fits, key=lambda b: budgets[b]["ms"], default=shipped)
    ws.residual[...] = saved
    return {"chosen": best, "variants": result, "att_blocks": budgets, "chosen_att_blocks": be.att_blocks}


def prefill_table(model, prompt):
    """Where a prefill's time goes: each op of the forward pass over `prompt` timed for all layers
    together with CUDA events (eager: at T = len(prompt) an op is long next to its launch), in the
    order the block runs them, plus embed, the last position's norm and lm_head. Rows as
    per_kernel_table's (no bytes: a prefill is compute-bound), ms per prefill."""
    import cupy as cp

    from engine.block import Workspace

    be, c = model.backend, model.config
    L, T = c.num_hidden_layers, len(prompt)
    seq = model.new_sequence()
    seq.reserve(T)
    ws = Workspace(be, c, T)
    ws.ids[...] = be.asarray(np.asarray(prompt, np.int32))
    ws.positions[...] = be.asarray(np.arange(T, dtype=np.int32))
    k, v, pt = model.cache.k, model.cache.v, seq.page_table
    lw = model.layers
    eps = c.rms_norm_eps
    # the ops as Model.forward_step calls them for a prompt: each residual op fused with the rmsnorm after
    # it (kernels/base.py FUSED_OPS), but the last block's down_residual, after which the final norm reads
    # the last row alone
    ops = [
        ("embed", 1, lambda i: be.embed(ws.ids, model.embed_tokens, ws.residual)),
        ("rmsnorm", 1, lambda i: be.rmsnorm(ws.residual, lw[0].input_layernorm, eps, ws.h)),
        ("qkv_proj", L, lambda i: be.qkv_proj(ws.h, lw[i].qkv, lw[i].qkv_bias, ws.qkv)),
        ("rope_kv_write", L, lambda i: be.rope_kv_write(ws.qkv, ws.positions, k[i], v[i], pt, c.rope_theta, ws.q)),
        ("attention_prefill", L, lambda i: be.attention_prefill(ws.q, k[i], v[i], pt, ws.positions, ws.attn)),
        ("o_proj_residual_rmsnorm", L, lambda i: be.o_proj_residual_rmsnorm(ws.attn, lw[i].o_proj, ws.residual,
                                                                            lw[i].post_attention_layernorm, eps, ws.h)),
        ("gate_up_silu", L, lambda i: be.gate_up_silu(ws.h, lw[i].gate_up, ws.act)),
        ("down_residual_rmsnorm", L - 1, lambda i: be.down_residual_rmsnorm(ws.act, lw[i].down, ws.residual,
                                                                            lw[i + 1].input_layernorm, eps, ws.h)),
        ("down_residual", 1, lambda i: be.down_residual(ws.act, lw[-1].down, ws.residual)),
        ("final rmsnorm", 1, lambda i: be.rmsnorm(ws.residual[T - 1:T], model.norm, eps, model._final_h)),
        ("lm_head", 1, lambda i: be.lm_head(model._final_h, model.lm_head, model._logits)),
    ]
    for _, n, fn in ops:  # warm-up: scratch buffers, module loads
        for i in range(n):
            fn(i)
    be.synchronize()

    def timed(n, fn):
        times = []
        for _ in range(3):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            for i in range(n):
                fn(i)
            b.record()
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b))
        return float(np.median(times))

    rows = []
    for name, n, fn in ops:
        ms = timed(n, fn)
        rows.append({"op": name, "calls": n, "ms_per_call": ms / n, "ms_per_step": ms})
    # every prefill kernel of the model's format, op by op (the table above used the backend's choice)
    fmt = lw[0].qkv.format
    chosen = getattr(be, "prefill_variant", {})
    if fmt in chosen:
        import importlib

        variants = importlib.import_module(f"kernels.cuda.{fmt}").PREFILL_VARIANTS
        saved = chosen[fmt]
        for row in rows:
            if row["op"] in ("qkv_proj", "o_proj_residual_rmsnorm", "gate_up_silu", "down_residual_rmsnorm"):
                fn = next(f for name, _, f in ops if name == row["op"])
                row["variants"] = {}
                for var in variants:
                    chosen[fmt] = var
                    fn(0)
                    row["variants"][var] = timed(row["calls"], fn)
                chosen[fmt] = saved
    if hasattr(be, "attention_prefill_variant"):  # every prefill attention kernel
        from kernels.cuda import ATTENTION_PREFILL_VARIANTS

        row = next(r for r in rows if r["op"] == "attention_prefill")
        fn = next(f for name, _, f in ops if name == "attention_prefill")
        saved, row["variants"] = be.attention_prefill_variant, {}
        for var in ATTENTION_PREFILL_VARIANTS:
            be.attention_prefill_variant = var
            row["variants"][var] = timed(L, fn)
        be.attention_prefill_variant = saved
    seq.free()
    return rows
