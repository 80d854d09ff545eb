"""Which tensors a Qwen2 model holds, and how one layer's weights are put on a backend.

Names are Hugging Face's. The seven linears of a layer are quantized (their tensors are the format's,
e.g. `.qweight` and `.scales`); everything else is fp16. At load, q/k/v and gate/up are fused into one
weight each, rows [q; k; v] and [gate; up], by the format's `fuse` (a concatenation for row-major formats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from engine.config import Qwen2Config
from engine.errors import ConfigError
from engine.formats import get_format


def linear_names(config: Qwen2Config, layer: int) -> dict[str, tuple[int, int]]:
    """HF name (without `.weight`) -> (out_features, in_features) of each quantized linear in a layer."""
    c, p = config, f"model.layers.{layer}."
    return {
        p + "self_attn.q_proj": (c.q_size, c.hidden_size),
        p + "self_attn.k_proj": (c.kv_size, c.hidden_size),
        p + "self_attn.v_proj": (c.kv_size, c.hidden_size),
        p + "self_attn.o_proj": (c.hidden_size, c.q_size),
        p + "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
        p + "mlp.up_proj": (c.intermediate_size, c.hidden_size),
        p + "mlp.down_proj": (c.hidden_size, c.intermediate_size),
    }


# config keys that set each linear's input width, for the messages of check_linears
_IN_KEYS = {"q_proj": "hidden_size", "k_proj": "hidden_size", "v_proj": "hidden_size", "gate_proj": "hidden_size",
            "up_proj": "hidden_size", "o_proj": "num_attention_heads * head_dim", "down_proj": "intermediate_size"}


def check_linears(config: Qwen2Config, quant: str) -> None:
    """ConfigError, naming the config key, when a linear's shape breaks the format's rule (e.g. inputs
    that are not a multiple of its group). Every layer has the same shapes: layer 0 speaks for all."""
    fmt = get_format(quant)
    for name, (out_f, in_f) in linear_names(config, 0).items():
        why = fmt.check_linear(out_f, in_f)
        if why:
            key = _IN_KEYS[name.rsplit(".", 1)[1]]
            raise ConfigError(f"config key {key!r} = {in_f} does not fit {quant}: {why}")


def plain_tensor_specs(config: Qwen2Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every fp16 tensor (embeddings, norms, biases, lm_head) the model file must hold."""
    c = config
    specs = dict(_model_plain_specs(c))
    for i in range(c.num_hidden_layers):
        specs.update(_layer_plain_specs(c, i))
    return specs


def _model_plain_specs(c: Qwen2Config):
    yield "model.embed_tokens.weight", ("float16", (c.vocab_size, c.hidden_size))
    yield "model.norm.weight", ("float16", (c.hidden_size,))
    if not c.tie_word_embeddings:
        yield "lm_head.weight", ("float16", (c.vocab_size, c.hidden_size))


def _layer_plain_specs(c: Qwen2Config, i: int):
    p = f"model.layers.{i}."
    yield p + "input_layernorm.weight", ("float16", (c.hidden_size,))
    yield p + "post_attention_layernorm.weight", ("float16", (c.hidden_size,))
    yield p + "self_attn.q_proj.bias", ("float16", (c.q_size,))
    yield p + "self_attn.k_proj.bias", ("float16", (c.kv_size,))
    yield p + "self_attn.v_proj.bias", ("float16", (c.kv_size,))


def iter_tensor_specs(config: Qwen2Config, quant: str):
    """Every tensor the model file must hold, as (name, (dtype, shape)), lazily: the model-wide ones,
    then layer by layer. Nothing is built up front, so a caller checking them against a file's table
    stops at the first one missing, in time bounded by the table, whatever num_hidden_layers says."""
    fmt = get_format(quant)
    yield from _model_plain_specs(config)
    for i in range(config.num_hidden_layers):
        yield from _layer_plain_specs(config, i)
        for name, (out_f, in_f) in linear_names(config, i).items():
            for suffix, spec in fmt.tensor_specs(out_f, in_f).items():
                yield name + suffix, spec


def quantized_tensor_specs(config: Qwen2Config, quant: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    fmt = get_format(quant)
    specs = {}
    for i in range(config.num_hidden_layers):
        for name, (out_f, in_f) in linear_names(config, i).items():
            for suffix, spec in fmt.tensor_specs(out_f, in_f).items():
                specs[name + suffix] = spec
    return specs


@dataclass
class LayerWeights:
    """One layer as a backend holds it. q/k/v and gate/up are fused at load (rows [q; k; v], [gate; up])."""

    input_layernorm: Any  # fp16 [H]
    qkv: Any  # QuantizedWeight [(nq + 2 nkv) d, H]
    qkv_bias: Any  # fp16 [(nq + 2 nkv) d]
    o_proj: Any  # QuantizedWeight [H, nq d]
    post_attention_layernorm: Any  # fp16 [H]
    gate_up: Any  # QuantizedWeight [2 I, H]
    down: Any  # QuantizedWeight [H, I]
    index: int = -1  # which layer of the model these are


def load_layer_weights(backend, config: Qwen2Config, quant: str, get: Callable[[str, str, tuple], np.ndarray],
                       layer: int) -> LayerWeights:
    """Layer `layer` on `backend`; `get(name, dtype, shape)` returns a checked host tensor."""
    be, c, fmt = backend, config, get_format(quant)
    names = linear_names(c, layer)
    specs = plain_tensor_specs(c)

    def linear(bases: list[str], in_f: int):
        parts = [{suffix.lstrip("."): get(base + suffix, dtype, shape)
                  for suffix, (dtype, shape) in fmt.tensor_specs(names[base][0], in_f).items()} for base in bases]
        tensors = fmt.fuse(parts) if len(parts) > 1 else parts[0]
        return be.prepare_linear(quant, tensors, sum(names[b][0] for b in bases), in_f)

    def plain(name):
        return be.asarray(get(name, *specs[name]))

    p = f"model.layers.{layer}."
    a = p + "self_attn."
    return LayerWeights(
        input_layernorm=plain(p + "input_layernorm.weight"),
        qkv=linear([a + "q_proj", a + "k_proj", a + "v_proj"], c.hidden_size),
        qkv_bias=be.asarray(np.concatenate([get(a + f"{x}_proj.bias", *specs[a + f"{x}_proj.bias"]) for x in "qkv"])),
        o_proj=linear([a + "o_proj"], c.q_size),
        post_attention_layernorm=plain(p + "post_attention_layernorm.weight"),
        gate_up=linear([p + "mlp.gate_proj", p + "mlp.up_proj"], c.hidden_size),
        down=linear([p + "mlp.down_proj"], c.intermediate_size),
        index=layer,
    )
