"""The engine: load a .nanoqwen model onto a backend, prefill, decode step, greedy generate.

    model = engine.load("model.nanoqwen", backend="numpy")
    new_ids = model.generate([1, 2, 3], max_new_tokens=32, stop_ids={model.config.eos_token_id})

A step-by-step API serves the ladder (teacher forcing, activation capture):

    seq = model.new_sequence()
    logits = model.prefill(seq, prompt_ids)       # fp32 [V], the last prompt position's logits
    logits = model.decode_step(seq, token_id)     # one token, fixed buffers (capturable)
    seq.free()

Tensor names are Hugging Face's; q/k/v and gate/up are fused here, at load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine.block import LayerWeights, Workspace, decoder_block
from engine.config import PAGE_SIZE, Qwen2Config
from engine.errors import ConfigError, HeaderError, PromptTooLongError, TokenIdError, UnknownFormatError
from engine.formats import get_format
from engine.kv_cache import PagedKVCache, Sequence

DEFAULT_CACHE_TOKENS = 4096


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


def plain_tensor_specs(config: Qwen2Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every fp16 tensor (embeddings, norms, biases, lm_head) the model file must hold."""
    c = config
    specs = {"model.embed_tokens.weight": ("float16", (c.vocab_size, c.hidden_size)),
             "model.norm.weight": ("float16", (c.hidden_size,))}
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = ("float16", (c.vocab_size, c.hidden_size))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = ("float16", (c.hidden_size,))
        specs[p + "post_attention_layernorm.weight"] = ("float16", (c.hidden_size,))
        specs[p + "self_attn.q_proj.bias"] = ("float16", (c.q_size,))
        specs[p + "self_attn.k_proj.bias"] = ("float16", (c.kv_size,))
        specs[p + "self_attn.v_proj.bias"] = ("float16", (c.kv_size,))
    return specs


def quantized_tensor_specs(config: Qwen2Config, quant: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    fmt = get_format(quant)
    specs = {}
    for i in range(config.num_hidden_layers):
        for name, (out_f, in_f) in linear_names(config, i).items():
            for suffix, spec in fmt.tensor_specs(out_f, in_f).items():
                specs[name + suffix] = spec
    return specs


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)


class Model:
    def __init__(self, config: Qwen2Config, quant: str, backend, get: Callable[[str, str, tuple], np.ndarray],
                 tokenizer_json: bytes | None = None, cache_tokens: int = DEFAULT_CACHE_TOKENS):
        """`get(name, dtype, shape)` returns a checked host tensor (a ModelFile's `expect`, or a dict's)."""
        if isinstance(backend, str):
            from kernels import get_backend

            backend = get_backend(backend)
        self.config, self.quant, self.backend = config, quant, backend
        self.tokenizer_json = tokenizer_json
        be, c, fmt = backend, config, get_format(quant)

        def linear(names: list[str], in_f: int):
            # Fuse by stacking rows: [q; k; v] or [gate; up]. Row-major storage makes this a concat.
            parts, out_total = {}, 0
            for name in names:
                out_f = linear_names(c, int(name.split(".")[2]))[name][0]
                out_total += out_f
                for suffix, (dtype, shape) in fmt.tensor_specs(out_f, in_f).items():
                    parts.setdefault(suffix.lstrip("."), []).append(get(name + suffix, dtype, shape))
            tensors = {k: np.concatenate(v, axis=0) for k, v in parts.items()}
            return be.prepare_linear(quant, tensors, out_total, in_f)

        def plain(name):
            dtype, shape = plain_tensor_specs(c)[name]
            return be.asarray(get(name, dtype, shape))

        self.layers: list[LayerWeights] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(LayerWeights(
                input_layernorm=plain(p + "input_layernorm.weight"),
                qkv=linear([a + "q_proj", a + "k_proj", a + "v_proj"], c.hidden_size),
                qkv_bias=be.asarray(np.concatenate([get(a + f"{x}_proj.bias", *plain_tensor_specs(c)[a + f"{x}_proj.bias"])
                                                    for x in "qkv"])),
                o_proj=linear([a + "o_proj"], c.q_size),
                post_attention_layernorm=plain(p + "post_attention_layernorm.weight"),
                gate_up=linear([p + "mlp.gate_proj", p + "mlp.up_proj"], c.hidden_size),
                down=linear([p + "mlp.down_proj"], c.intermediate_size),
            ))
        self.embed_tokens = plain("model.embed_tokens.weight")
        self.norm = plain("model.norm.weight")
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else plain("lm_head.weight")

        n_pages = -(-min(cache_tokens, c.max_position_embeddings) // PAGE_SIZE)
        self.cache = PagedKVCache(c, be, num_pages=n_pages)
        self._decode_ws = Workspace(be, c, 1)
        self._final_h = be.empty((1, c.hidden_size), np.float16)
        self._logits = be.empty((c.vocab_size,), np.float32)
        self._next = be.empty((1,), np.int32)

    # --- the forward pass ----------------------------------------------------------------------

    def new_sequence(self) -> Sequence:
        return self.cache.new_sequence()

    def use_cache(self, cache: PagedKVCache) -> None:
        """Run on another cache (tests use shuffled, NaN-filled ones)."""
        self.cache = cache

    def check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0:
            raise TokenIdError(f"expected a non-empty 1-D list of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TokenIdError(f"token ids must be integers, got {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.config.vocab_size))
        if bad.size:
            raise TokenIdError(f"token id {int(ids[bad[0]])} at index {int(bad[0])} is out of range "
                               f"[0, {self.config.vocab_size})")
        return ids.astype(np.int32)

    def _run(self, seq: Sequence, ids: np.ndarray, ws: Workspace):
        be, c = self.backend, self.config
        T = len(ids)
        seq.reserve(T)
        ws.ids[...] = be.asarray(ids)
        ws.positions[...] = be.asarray(np.arange(seq.length, seq.length + T, dtype=np.int32))
        be.embed(ws.ids, self.embed_tokens, ws.residual)
        for i, w in enumerate(self.layers):
            decoder_block(be, c, w, ws, self.cache.k[i], self.cache.v[i], seq.page_table, decode=T == 1)
        seq.length += T
        be.rmsnorm(ws.residual[T - 1: T], self.norm, c.rms_norm_eps, self._final_h)
        be.lm_head(self._final_h, self.lm_head, self._logits)
        return self._logits

    def prefill(self, seq: Sequence, ids) -> np.ndarray:
        """Run the prompt through the model; returns the last position's fp32 logits (host copy)."""
        ids = self.check_ids(ids)
        if seq.length + len(ids) > min(self.cache.capacity, self.config.max_position_embeddings):
            raise PromptTooLongError(f"prompt of {len(ids)} tokens (after {seq.length}) is longer than the "
                                     f"cache's {min(self.cache.capacity, self.config.max_position_embeddings)} tokens")
        return self.backend.to_numpy(self._run(seq, ids, Workspace(self.backend, self.config, len(ids)))).copy()

    def decode_step(self, seq: Sequence, token_id: int) -> np.ndarray:
        """One token through the model at position seq.length; returns fp32 logits (host copy)."""
        ids = self.check_ids([token_id])
        return self.backend.to_numpy(self._run(seq, ids, self._decode_ws)).copy()

    def generate(self, prompt_ids, max_new_tokens: int, stop_ids=(), timings: Timings | None = None) -> list[int]:
        """Greedy decoding: the new token ids (stopping after a stop id, which is included)."""
        ids = self.check_ids(prompt_ids)
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        limit = min(self.cache.capacity, self.config.max_position_embeddings)
        if len(ids) + max_new_tokens > limit:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens plus {max_new_tokens} new ones is longer "
                                     f"than the cache's {limit} tokens")
        stop = {int(s) for s in stop_ids if s is not None}
        seq = self.new_sequence()
        out: list[int] = []
        try:
            t0 = time.perf_counter()
            logits = self.prefill(seq, ids)
            if timings is not None:
                timings.prefill_s = time.perf_counter() - t0
            while len(out) < max_new_tokens:
                token = self._argmax()
                out.append(token)
                if token in stop or len(out) == max_new_tokens:
                    break
                t0 = time.perf_counter()
                logits = self.decode_step(seq, token)
                if timings is not None:
                    timings.decode_s.append(time.perf_counter() - t0)
        finally:
            seq.free()
        return out

    def _argmax(self) -> int:
        """Greedy pick on the device, from the logits of the last prefill or decode step."""
        self.backend.argmax(self._logits, self._next)
        return int(self.backend.to_numpy(self._next)[0])


def load(path, backend="numpy", verify_checksums: bool = True, cache_tokens: int = DEFAULT_CACHE_TOKENS) -> Model:
    """Open a .nanoqwen file (validating everything first) and put its weights on `backend`."""
    from engine.modelfile import ModelFile

    mf = ModelFile(path, verify_checksums=verify_checksums)

    try:
        config = Qwen2Config.from_hf_dict(mf.config_dict)
        get_format(mf.quant)
    except (ConfigError, UnknownFormatError) as e:
        raise HeaderError(mf.path, str(e)) from None
    return Model(config, mf.quant, backend, mf.expect, tokenizer_json=mf.file("tokenizer.json"),
                 cache_tokens=cache_tokens)
