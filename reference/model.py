"""A whole Qwen2 forward pass from the `ref_*` ops, float64, no cache: the torch-free reference.

`ref_forward(config, weights, ids)` returns logits `[T, V]` for a full recompute of `ids`. `weights` is
a dict of Hugging Face names to float arrays (quantized linears already dequantized by the caller);
`config` a config.json dict. Slow and simple on purpose; for small models and short prompts.
"""

from __future__ import annotations

import numpy as np

from reference.ops import ref_attention, ref_embed, ref_gate_up_silu, ref_linear, ref_rmsnorm, ref_rope


def ref_block(config: dict, w: dict, layer: int, x: np.ndarray, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decoder layer on x [T, H] float64; returns (output, k [T, nkv, d] roped, v [T, nkv, d])."""
    c, p = config, f"model.layers.{layer}."
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c["hidden_size"] // nq
    theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    eps = c.get("rms_norm_eps", 1e-6)
    T = x.shape[0]
    h = ref_rmsnorm(x, w[p + "input_layernorm.weight"], eps)
    q = ref_linear(h, w[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.bias"]).reshape(T, nq, d)
    k = ref_linear(h, w[p + "self_attn.k_proj.weight"], w[p + "self_attn.k_proj.bias"]).reshape(T, nkv, d)
    v = ref_linear(h, w[p + "self_attn.v_proj.weight"], w[p + "self_attn.v_proj.bias"]).reshape(T, nkv, d)
    q, k = ref_rope(q, positions, theta), ref_rope(k, positions, theta)
    a = ref_attention(q, k, v, positions)
    x = x + ref_linear(a, w[p + "self_attn.o_proj.weight"])
    h = ref_rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
    x = x + ref_linear(ref_gate_up_silu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]),
                       w[p + "mlp.down_proj.weight"])
    return x, k, v


def ref_forward(config: dict, weights: dict, ids) -> np.ndarray:
    """float64 logits [T, V] of a full forward pass over `ids` (positions 0 .. T-1)."""
    positions = np.arange(len(ids))
    x = ref_embed(ids, weights["model.embed_tokens.weight"])
    for layer in range(config["num_hidden_layers"]):
        x, _, _ = ref_block(config, weights, layer, x, positions)
    x = ref_rmsnorm(x, weights["model.norm.weight"], config.get("rms_norm_eps", 1e-6))
    head = weights["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else weights["lm_head.weight"]
    return ref_linear(x, head)
