"""Model config: a frozen dataclass that mirrors the keys of a Hugging Face Qwen2 `config.json`.

`Qwen2Config.from_hf_dict` accepts exactly what the engine implements and refuses the rest by name
(another architecture, `rope_scaling`, sliding windows, an activation other than SiLU). The shape
rules of a quantization format (inputs a multiple of its group) are the format's, checked with the
model's format by `engine.weights.check_linears`. `SHAPES` holds the named shapes that tests,
benchmarks and fixtures build from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from engine.errors import ConfigError, brief

MAX_INT = 2**31 - 1  # every dimension and token id fits an int32 (the kernels index with int32)
PAGE_SIZE = 16  # tokens per KV page (docs/ARCHITECTURE.md, The KV cache)


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Refuse, by key, any value of the wrong type, sign or size, and any shape the engine cannot run."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _check_int(key, getattr(self, key), 1)
        for key in ("rms_norm_eps", "rope_theta"):
            _check_positive_real(key, getattr(self, key))
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"config key 'tie_word_embeddings' must be true or false, got {brief(self.tie_word_embeddings)}")
        for key in ("bos_token_id", "eos_token_id"):
            if getattr(self, key) is not None:
                _check_int(key, getattr(self, key), 0)
        if self.hidden_act != "silu":
            raise ConfigError(f"config key 'hidden_act' is {brief(self.hidden_act)}; only 'silu' is implemented")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("config key 'hidden_size' is not a multiple of 'num_attention_heads'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("config key 'num_attention_heads' is not a multiple of 'num_key_value_heads'")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} is odd; rotary embeddings need an even head_dim")

    # --- Hugging Face config.json --------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Qwen2Config":
        """Build from a parsed `config.json`, refusing, by key, anything the engine does not implement
        and any value of the wrong type or sign (nothing is converted blindly: "12", 1.0 or [] for an
        integer, 1 for a boolean are refused)."""
        if not isinstance(d, dict):
            raise ConfigError(f"the config is not a JSON object (got {brief(d)})")
        model_type = d.get("model_type", "qwen2")
        if model_type != "qwen2":
            raise ConfigError(f"config key 'model_type' is {brief(model_type)}; only 'qwen2' is implemented")
        arch = d.get("architectures") or ["Qwen2ForCausalLM"]
        if arch != ["Qwen2ForCausalLM"]:
            raise ConfigError(f"config key 'architectures' is {brief(arch)}; only ['Qwen2ForCausalLM'] is implemented")
        if d.get("rope_scaling"):
            raise ConfigError(f"config key 'rope_scaling' is {brief(d['rope_scaling'])}; RoPE scaling is not implemented")
        rope_params = d.get("rope_parameters") or {}
        if not isinstance(rope_params, dict):
            raise ConfigError(f"config key 'rope_parameters' is {brief(rope_params)}, not an object")
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config key 'rope_parameters.rope_type' is {brief(rope_type)}; only 'default' is implemented")
        if d.get("use_sliding_window") not in (None, False):
            raise ConfigError(f"config key 'use_sliding_window' is {brief(d['use_sliding_window'])}; "
                              f"sliding-window attention is not implemented")
        layer_types = d.get("layer_types") or []
        if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
            shown = sorted({brief(t) for t in layer_types}) if isinstance(layer_types, list) else brief(layer_types)
            raise ConfigError(f"config key 'layer_types' holds {shown}; only 'full_attention' is implemented")
        if d.get("attention_bias") not in (None, True):
            raise ConfigError(f"config key 'attention_bias' is {brief(d['attention_bias'])}; Qwen2 q/k/v "
                              f"projections carry biases")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ConfigError(f"config key {missing[0]!r} is missing")
        config = cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            rms_norm_eps=_real("rms_norm_eps", d.get("rms_norm_eps", 1e-6)),
            rope_theta=_real("rope_theta", rope_params.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=_first_id("bos_token_id", d.get("bos_token_id")),
            eos_token_id=_first_id("eos_token_id", d.get("eos_token_id")),
        )
        head_dim = d.get("head_dim")
        if head_dim is not None and head_dim != config.head_dim:
            raise ConfigError(f"config key 'head_dim' = {brief(head_dim)} is not hidden_size / num_attention_heads")
        return config

    @classmethod
    def from_json_file(cls, path) -> "Qwen2Config":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot read config.json ({e})") from None
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict:
        """The config.json a Hugging Face Qwen2 model of this shape carries (both 4.x and 5.x keys)."""
        d = dataclasses.asdict(self)
        d.update(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            rope_scaling=None,
            use_sliding_window=False,
            sliding_window=None,
            attention_dropout=0.0,
            use_cache=True,
        )
        return d

    def replace(self, **changes) -> "Qwen2Config":
        return dataclasses.replace(self, **changes)


def _check_int(key: str, value, minimum: int) -> None:
    if type(value) is not int or not minimum <= value <= MAX_INT:
        what = "a positive" if minimum > 0 else "a non-negative"
        raise ConfigError(f"config key {key!r} must be {what} integer up to {MAX_INT}, got {brief(value)}")


def _check_positive_real(key: str, value) -> None:
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config key {key!r} must be a finite positive number, got {brief(value)}")


def _real(key: str, value) -> float:
    _check_positive_real(key, value)
    return float(value)


def _first_id(key: str, value):
    """A token id, or the first of a list of them (Hugging Face allows both)."""
    if isinstance(value, list):
        value = value[0] if value else None
    if value is not None:
        _check_int(key, value, 0)
    return value


SHAPES: dict[str, Qwen2Config] = {
    # The shape of the embedded default model: small enough for CI, real GQA, several pages of context.
    "tiny": Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                        max_position_embeddings=2048),
    "qwen2.5-0.5b": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                tie_word_embeddings=True, max_position_embeddings=32768),
    # Qwen2.5-Coder-7B: 7.616 B parameters, the shape every speed target refers to.
    "qwen2.5-coder-7b": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                    max_position_embeddings=32768),
}
