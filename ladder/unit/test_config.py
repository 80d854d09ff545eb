"""Unit rung: the model config accepts what the engine implements and refuses the rest by key."""

from __future__ import annotations

import json

import pytest

from engine.config import SHAPES, Qwen2Config
from engine.errors import ConfigError
from engine.formats import DEFAULT_FORMAT, FORMATS, get_format
from engine.weights import check_linears

BASE = SHAPES["tiny"].to_hf_dict()


def test_named_shapes_include_the_exact_7b():
    c = SHAPES["qwen2.5-coder-7b"]
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (28, 3584, 18944)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (28, 4, 128, 152064)
    assert c.rope_theta == 1e6 and not c.tie_word_embeddings
    per_layer = c.hidden_size * c.qkv_size + c.qkv_size + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    total = c.num_hidden_layers * per_layer + 2 * c.vocab_size * c.hidden_size + c.hidden_size
    assert round(total / 1e9, 3) == 7.616  # 7.616 B parameters


def test_config_is_frozen():
    with pytest.raises(Exception):
        SHAPES["tiny"].hidden_size = 512


def test_round_trips_through_hf_dict():
    for shape in SHAPES.values():
        assert Qwen2Config.from_hf_dict(shape.to_hf_dict()) == shape


def test_reads_transformers_5_rope_parameters():
    d = {k: v for k, v in BASE.items() if k != "rope_theta"}
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    d["layer_types"] = ["full_attention"] * 4
    assert Qwen2Config.from_hf_dict(d).rope_theta == 1e6


def test_tied_embeddings_are_supported():
    assert Qwen2Config.from_hf_dict({**BASE, "tie_word_embeddings": True}).tie_word_embeddings


@pytest.mark.parametrize("key,value", [
    ("model_type", "llama"),
    ("architectures", ["LlamaForCausalLM"]),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}),
    ("use_sliding_window", True),
    ("hidden_act", "gelu"),
    ("layer_types", ["sliding_attention"] * 4),
    ("attention_bias", False),
    ("num_key_value_heads", 3),
])
def test_unimplemented_features_are_refused_by_key(key, value):
    with pytest.raises(ConfigError, match=key.split("_")[0]):
        Qwen2Config.from_hf_dict({**BASE, key: value})


@pytest.mark.parametrize("key,value", [("hidden_size", 200), ("intermediate_size", 1000), ("intermediate_size", 1040)])
@pytest.mark.parametrize("quant", sorted(FORMATS))
def test_each_format_refuses_the_linear_shapes_it_cannot_hold_by_key(key, value, quant):
    """A format's shape rule (engine/formats: `check_linear`) is checked with the model's format and
    named by config key: 200 (4 heads of 50) and 1000 fit no shipped format, 1040 the 16-wide ones."""
    config = Qwen2Config.from_hf_dict({**BASE, key: value})
    if value % get_format(quant).in_multiple == 0:
        check_linears(config, quant)
    else:
        with pytest.raises(ConfigError, match=f"{key}.*{quant}"):
            check_linears(config, quant)


def test_the_default_format_needs_inputs_in_whole_groups_of_128():
    with pytest.raises(ConfigError, match="intermediate_size.*multiple of 128"):
        check_linears(Qwen2Config.from_hf_dict({**BASE, "intermediate_size": 1040}), DEFAULT_FORMAT)


def test_missing_key_is_named():
    d = dict(BASE)
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        Qwen2Config.from_hf_dict(d)


def test_unreadable_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json"):
        Qwen2Config.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert Qwen2Config.from_json_file(tmp_path / "config.json") == SHAPES["tiny"]
