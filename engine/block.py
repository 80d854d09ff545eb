"""One Qwen2 decoder block as a sequence of Backend ops, and the weights it reads.

The model runs this for every layer; the layer rung runs it alone against Hugging Face's
`Qwen2DecoderLayer`. Every op is looked up on the backend at call time, so the ladder can wrap one
(to capture activations or plant a fault) without the engine knowing.
"""

from __future__ import annotations

import contextvars

import numpy as np

from engine.config import Qwen2Config
from engine.weights import LayerWeights


# The layer whose block is running (None outside a block). Tools that wrap backend ops (activation
# capture, planted faults) read it to act on one layer; the engine itself never does.
CURRENT_LAYER: contextvars.ContextVar[int | None] = contextvars.ContextVar("nanoqwen_current_layer", default=None)


class Workspace:
    """Activation buffers for T tokens at a time (fixed buffers make the decode step capturable)."""

    def __init__(self, backend, config: Qwen2Config, T: int):
        c = config
        self.T = T
        self.residual = backend.empty((T, c.hidden_size), np.float32)
        self.h = backend.empty((T, c.hidden_size), np.float16)
        self.qkv = backend.empty((T, c.qkv_size), np.float16)
        self.q = backend.empty((T, c.num_attention_heads, c.head_dim), np.float16)
        self.attn = backend.empty((T, c.q_size), np.float16)
        self.act = backend.empty((T, c.intermediate_size), np.float16)
        self.positions = backend.empty((T,), np.int32)
        self.ids = backend.empty((T,), np.int32)


def decoder_block(backend, config: Qwen2Config, w: LayerWeights, ws: Workspace, k_pages, v_pages,
                  page_table, decode: bool, normed: bool = False, next_norm=None) -> None:
    """ws.residual [T, H] fp32 <- the block applied to it, at positions ws.positions (K/V into pages).

    The model hands each block the rmsnorm after it, so that the block's last op (down_residual) and that
    norm run as one fused op (kernels/base.py FUSED_OPS; one kernel where the backend has it):
    `next_norm` (an fp16 [H] weight) also leaves ws.h = rmsnorm(ws.residual, next_norm), and `normed`
    says ws.h already holds this block's input norm (the block before left it). Alone (the layer rung)
    a block takes neither and is exactly Hugging Face's decoder layer."""
    token = CURRENT_LAYER.set(w.index)
    try:
        _block_ops(backend, config, w, ws, k_pages, v_pages, page_table, decode, normed, next_norm)
    finally:
        CURRENT_LAYER.reset(token)


def _block_ops(be, c: Qwen2Config, w: LayerWeights, ws: Workspace, k_pages, v_pages, page_table, decode: bool,
               normed: bool, next_norm):
    eps = c.rms_norm_eps
    if not normed:
        be.rmsnorm(ws.residual, w.input_layernorm, eps, ws.h)
    be.qkv_proj(ws.h, w.qkv, w.qkv_bias, ws.qkv)
    be.rope_kv_write(ws.qkv, ws.positions, k_pages, v_pages, page_table, c.rope_theta, ws.q)
    attention = be.attention_decode if decode else be.attention_prefill
    attention(ws.q, k_pages, v_pages, page_table, ws.positions, ws.attn)
    be.o_proj_residual_rmsnorm(ws.attn, w.o_proj, ws.residual, w.post_attention_layernorm, eps, ws.h)
    be.gate_up_silu(ws.h, w.gate_up, ws.act)
    if next_norm is None:
        be.down_residual(ws.act, w.down, ws.residual)
    else:
        be.down_residual_rmsnorm(ws.act, w.down, ws.residual, next_norm, eps, ws.h)
