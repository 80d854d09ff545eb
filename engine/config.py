"""Model config: a frozen dataclass that mirrors the keys of a Hugging Face Qwen2 `config.json`.

`Qwen2Config.from_hf_dict` accepts exactly what the engine implements and refuses the rest by name
(another architecture, `rope_scaling`, sliding windows, an activation other than SiLU, dimensions
that are not multiples of the quantization group). `SHAPES` holds the named shapes that tests,
benchmarks and fixtures build from.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine.errors import ConfigError

GROUP_SIZE = 128  # quantization group along the input dimension; every quantized dim is a multiple
PAGE_SIZE = 16  # tokens per KV page (DESIGN.md, KV cache)


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
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads")
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config key {key!r} must be a positive integer, got {value!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config key 'hidden_act' is {self.hidden_act!r}; only 'silu' is implemented")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("config key 'hidden_size' is not a multiple of 'num_attention_heads'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("config key 'num_attention_heads' is not a multiple of 'num_key_value_heads'")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} is odd; rotary embeddings need an even head_dim")
        for key in ("hidden_size", "intermediate_size"):
            if getattr(self, key) % GROUP_SIZE:
                raise ConfigError(f"config key {key!r} = {getattr(self, key)} is not a multiple of the "
                                  f"quantization group size {GROUP_SIZE}")
        if self.q_size % GROUP_SIZE:
            raise ConfigError(f"num_attention_heads * head_dim = {self.q_size} is not a multiple of the "
                              f"quantization group size {GROUP_SIZE} (o_proj input)")
        if not self.rope_theta > 0:
            raise ConfigError(f"config key 'rope_theta' must be positive, got {self.rope_theta!r}")

    # --- Hugging Face config.json --------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Qwen2Config":
        """Build from a parsed `config.json`, refusing, by key, anything the engine does not implement."""
        arch = d.get("architectures") or ["Qwen2ForCausalLM"]
        if d.get("model_type", "qwen2") != "qwen2":
            raise ConfigError(f"config key 'model_type' is {d.get('model_type')!r}; only 'qwen2' is implemented")
        if list(arch) != ["Qwen2ForCausalLM"]:
            raise ConfigError(f"config key 'architectures' is {arch!r}; only ['Qwen2ForCausalLM'] is implemented")
        if d.get("rope_scaling"):
            raise ConfigError(f"config key 'rope_scaling' is {d['rope_scaling']!r}; RoPE scaling is not implemented")
        rope_params = d.get("rope_parameters") or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config key 'rope_parameters.rope_type' is {rope_type!r}; only 'default' is implemented")
        if d.get("use_sliding_window"):
            raise ConfigError("config key 'use_sliding_window' is true; sliding-window attention is not implemented")
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"config key 'layer_types' holds {sorted(set(layer_types))}; only 'full_attention' is implemented")
        if d.get("attention_bias") is False:
            raise ConfigError("config key 'attention_bias' is false; Qwen2 q/k/v projections carry biases")
        if "head_dim" in d and d["head_dim"] is not None and d["head_dim"] * d["num_attention_heads"] != d["hidden_size"]:
            raise ConfigError(f"config key 'head_dim' = {d['head_dim']} is not hidden_size / num_attention_heads")
        theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                hidden_act=d.get("hidden_act", "silu"),
                bos_token_id=_first_id(d.get("bos_token_id")),
                eos_token_id=_first_id(d.get("eos_token_id")),
            )
        except KeyError as e:
            raise ConfigError(f"config key {e.args[0]!r} is missing") from None

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


def _first_id(value):
    if isinstance(value, list):
        return value[0] if value else None
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
