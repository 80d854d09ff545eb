"""A whole Qwen2 forward pass from the `ref_*` ops, float64, no cache: the torch-free reference.

`ref_forward(config, weights, ids)` returns logits `[T, V]` for a full recompute of `ids`. `weights` is
a dict of Hugging Face names to float arrays (quantized linears already dequantized by the caller);
`config` a config.json dict. Slow and simple on purpose; for small models and short prompts. With
`dtype=np.float32, storage=np.float16` it is the plain implementation of the whole model, whose logit
error is the graph rung's noise floor.
"""

from __future__ import annotations

import numpy as np

from reference.ops import ref_attention, ref_embed, ref_gate_up_silu, ref_linear, ref_rmsnorm, ref_rope


def ref_block(config: dict, w: dict, layer: int, x: np.ndarray, positions, dtype=np.float64,
              storage=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decoder layer over x [T, H] (all T positions, causal); returns (output, k roped, v), k and v
    as [T, nkv, d].

    With `dtype=np.float32, storage=np.float16` it is the *plain implementation* of the precision
    contract: fp32 arithmetic, every activation between ops (and K/V) rounded to fp16, the residual
    kept in fp32. Its error against a float reference is the block's noise floor.
    """
    c, p = config, f"model.layers.{layer}."
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c["hidden_size"] // nq
    theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    eps = c.get("rms_norm_eps", 1e-6)
    T = x.shape[0]

    def st(a):  # store an activation in its storage dtype (a no-op for the float64 reference)
        return a.astype(storage).astype(dtype) if storage is not None else a

    def lin(a, name, bias=True):
        b = w[p + name + ".bias"] if bias else None
        return ref_linear(a, w[p + name + ".weight"], b, dtype=dtype)

    x = np.asarray(x, dtype=dtype)
    h = st(ref_rmsnorm(x, w[p + "input_layernorm.weight"], eps, dtype=dtype))
    q = st(lin(h, "self_attn.q_proj")).reshape(T, nq, d)
    k = st(lin(h, "self_attn.k_proj")).reshape(T, nkv, d)
    v = st(lin(h, "self_attn.v_proj")).reshape(T, nkv, d)
    q, k = st(ref_rope(q, positions, theta, dtype=dtype)), st(ref_rope(k, positions, theta, dtype=dtype))
    a = st(ref_attention(q, k, v, positions, dtype=dtype))
    x = x + lin(a, "self_attn.o_proj", bias=False)
    h = st(ref_rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps, dtype=dtype))
    act = st(ref_gate_up_silu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], dtype=dtype))
    x = x + lin(act, "mlp.down_proj", bias=False)
    return x, k, v


def ref_forward(config: dict, weights: dict, ids, dtype=np.float64, storage=None) -> np.ndarray:
    """Logits [T, V] (in `dtype`) of a full causal forward pass over `ids` (positions 0 .. T-1).

    float64 by default. With `dtype=np.float32, storage=np.float16` it follows the precision contract
    op for op: the fp16 embedding row copied into an fp32 residual, each block as `ref_block` in that
    mode, the final norm's output stored as fp16, the lm_head in fp32 (fp32 logits).
    """
    positions = np.arange(len(ids))
    x = ref_embed(ids, weights["model.embed_tokens.weight"], dtype=dtype)
    for layer in range(config["num_hidden_layers"]):
        x, _, _ = ref_block(config, weights, layer, x, positions, dtype=dtype, storage=storage)
    x = ref_rmsnorm(x, weights["model.norm.weight"], config.get("rms_norm_eps", 1e-6), dtype=dtype)
    if storage is not None:
        x = x.astype(storage).astype(dtype)
    head = weights["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else weights["lm_head.weight"]
    return ref_linear(x, head, dtype=dtype)
