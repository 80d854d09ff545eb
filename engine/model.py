"""The engine: load a .nanoqwen model onto a backend, prefill, decode step, greedy generate.

    model = engine.load("model.nanoqwen", backend="numpy")
    new_ids = model.generate([1, 2, 3], max_new_tokens=32, stop_ids={model.config.eos_token_id})

A step-by-step API serves the ladder (teacher forcing, activation capture):

    seq = model.new_sequence()
    logits = model.prefill(seq, prompt_ids)       # fp32 [V], the last prompt position's logits
    logits = model.decode_step(seq, token_id)     # one token, fixed buffers (capturable)
    seq.free()
    rows = model.forced_logits(prompt_ids, tokens) # fp32 [len(tokens), V]: prompt, then tokens[:-1] fed

One decode step, two layers: `forward_step(ws, page_table, T)` is the device work (embed, blocks,
final norm, lm_head), the function the eager path runs and engine/cuda_graph.py captures; `step(seq,
token)` runs one token (eagerly or as the captured graph) and leaves the logits on the device;
`decode_step` is `step` plus the host copy, for callers that read the logits; `forced_logits` runs a
prompt and then given tokens (teacher forcing) and reads every step's logits back once. `generate` is one loop
over a token source: eager steps with an on-device argmax, or the graph's on-device loop
(`DecodeGraph.tokens`); logits never reach the host there.

Tensor names are Hugging Face's; q/k/v and gate/up are fused here, at load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine.block import Workspace, decoder_block
from engine.config import PAGE_SIZE, Qwen2Config
from engine.errors import (AllocationTooLargeError, ConfigError, HeaderError, MissingTensorError, ModelClosedError,
                           PromptTooLongError, TokenIdError, UnexpectedTensorError, UnknownFormatError)
from engine.kv_cache import PagedKVCache, Sequence
from engine.weights import LayerWeights, check_linears, iter_tensor_specs, load_layer_weights, plain_tensor_specs

DEFAULT_CACHE_TOKENS = 4096


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
        be, c = backend, config

        def plain(name):
            dtype, shape = plain_tensor_specs(c)[name]
            return be.asarray(get(name, dtype, shape))

        self.layers: list[LayerWeights] = [load_layer_weights(be, c, quant, get, i) for i in range(c.num_hidden_layers)]
        self.embed_tokens = plain("model.embed_tokens.weight")
        self.norm = plain("model.norm.weight")
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else plain("lm_head.weight")

        n_pages = -(-min(cache_tokens, c.max_position_embeddings) // PAGE_SIZE)
        self.cache = PagedKVCache(c, be, num_pages=n_pages)
        self._decode_ws = Workspace(be, c, 1)
        self._final_h = be.empty((1, c.hidden_size), np.float16)
        self._logits = be.empty((c.vocab_size,), np.float32)
        self._next = be.empty((1,), np.int32)
        self._graph = None  # engine/cuda_graph.DecodeGraph while enable_cuda_graph() is on
        self._kept_graph = None  # the DecodeGraph, kept while the graph is off
        self._closed = False

    # --- the forward pass ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError("the model was closed (Model.close): load it again to run it")

    @property
    def token_limit(self) -> int:
        """The most tokens one sequence may hold: the KV cache's capacity or the model's positions, the fewer."""
        return min(self.cache.capacity, self.config.max_position_embeddings)

    def new_sequence(self) -> Sequence:
        self._check_open()
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
        be = self.backend
        T = len(ids)
        seq.reserve(T)
        ws.ids[...] = be.asarray(ids)
        ws.positions[...] = be.asarray(np.arange(seq.length, seq.length + T, dtype=np.int32))
        self.forward_step(ws, seq.page_table, T)
        seq.length += T
        return self._logits

    def forward_step(self, ws: Workspace, page_table, T: int) -> None:
        """Device work only (embed, blocks, final norm, lm_head) for the T tokens in `ws`, the logits of
        the last into self._logits: the eager step, the prefill, and what engine/cuda_graph.py captures."""
        be, c = self.backend, self.config
        be.embed(ws.ids, self.embed_tokens, ws.residual)
        # Each block's down_residual and the rmsnorm after it are one fused op (decoder_block's next_norm):
        # the next block's input norm, and after the last block the final norm, except in a prefill,
        # whose final norm reads the last row alone.
        last = len(self.layers) - 1
        for i, w in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i < last else (self.norm if T == 1 else None)
            decoder_block(be, c, w, ws, self.cache.k[i], self.cache.v[i], page_table, decode=T == 1,
                          normed=i > 0, next_norm=next_norm)
        if T == 1:
            be.lm_head(ws.h, self.lm_head, self._logits)  # ws.h: the final norm, from the last block
            return
        be.rmsnorm(ws.residual[T - 1: T], self.norm, c.rms_norm_eps, self._final_h)
        be.lm_head(self._final_h, self.lm_head, self._logits)

    def _prefill(self, seq: Sequence, ids):
        """Run the prompt through the model; the last position's fp32 logits stay on the device."""
        self._check_open()
        ids = self.check_ids(ids)
        if seq.length + len(ids) > self.token_limit:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens (after {seq.length}) is longer than the "
                                     f"cache's {self.token_limit} tokens")
        return self._run(seq, ids, Workspace(self.backend, self.config, len(ids)))

    def prefill(self, seq: Sequence, ids) -> np.ndarray:
        """Run the prompt through the model; returns the last position's fp32 logits (host copy)."""
        return self.backend.to_numpy(self._prefill(seq, ids)).copy()

    def step(self, seq: Sequence, token_id: int):
        """One token through the model at position seq.length (the captured graph once
        enable_cuda_graph() is on, else eagerly); returns the fp32 logits [V] on the device, no copy."""
        self._check_open()
        ids = self.check_ids([token_id])
        if self._graph is not None:
            return self._graph.step(seq, ids)
        return self._run(seq, ids, self._decode_ws)

    def decode_step(self, seq: Sequence, token_id: int) -> np.ndarray:
        """One token through the model at position seq.length; returns fp32 logits (host copy)."""
        return self.backend.to_numpy(self.step(seq, token_id)).copy()

    def forced_logits(self, prompt_ids, tokens) -> np.ndarray:
        """Teacher forcing: the fp32 logits [len(tokens), V] at each new position, after the prompt and after
        each of tokens[:-1] fed in turn (whatever the model would have picked), on a sequence of its own.

        The same device work as `prefill` and then `decode_step` per token (eager, or the captured graph
        once enable_cuda_graph() is on), and the same logits bit for bit; what differs is the traffic. Each
        step's inputs move on the device (the tokens go up once; `decode_advance` feeds the next one and
        moves the position) and its logits are copied into a device buffer that is read back once, so the
        host never waits for a step: it queues the next while the device runs the last. A judge of the
        engine (the ladder's graph rung) feeds a reference's tokens this way."""
        self._check_open()
        ids = self.check_ids(prompt_ids)
        fed = self.check_ids(tokens)[:-1]
        limit = self.token_limit
        if len(ids) + len(fed) > limit:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens plus {len(fed)} fed ones is longer than the "
                                     f"cache's {limit} tokens")
        be = self.backend
        out = be.empty((len(fed) + 1, self.config.vocab_size), np.float32)
        seq = self.new_sequence()
        try:
            out[0] = self._prefill(seq, ids)  # a device copy: the steps below overwrite _logits after it
            if len(fed):
                seq.reserve(len(fed))  # every page up front: the page table stays as it is during the steps
                if self._graph is not None:
                    self._graph.forced(seq, fed, out)
                else:
                    self._eager_forced(seq, fed, out)
            return be.to_numpy(out)
        finally:
            seq.free()

    def _eager_forced(self, seq: Sequence, fed: np.ndarray, out) -> None:
        """forced_logits' eager steps: out[1 + i] <- the logits after fed[i], at position seq.length + i."""
        be, ws = self.backend, self._decode_ws
        fed_dev = be.asarray(fed)
        # decode_advance adds one before each step: the first runs at seq.length
        ws.positions[...] = be.asarray(np.array([seq.length - 1], dtype=np.int32))
        for i in range(len(fed)):
            be.decode_advance(fed_dev[i:i + 1], ws.ids, ws.positions)
            self.forward_step(ws, seq.page_table, 1)
            out[i + 1] = self._logits
        seq.length += len(fed)

    def close(self) -> None:
        """Drop the weights, the KV cache, the workspaces and the captured graph, and hand the memory the
        backend keeps cached for reuse back to the device (`Backend.release_memory`). A process that loads
        several models one after another, or shares the device with another library, holds one model's
        memory, not every model's: CuPy's pool keeps a freed array's memory for CuPy, so torch in the same
        process could not use it (a 7B graph-rung worker of the ladder held 16 GB of two dropped engines
        beside its HF simulation). The model cannot run afterwards; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self._graph = self._kept_graph = None
        self.layers = []
        self.embed_tokens = self.norm = self.lm_head = None
        self.cache = self._decode_ws = self._final_h = self._logits = self._next = None
        self.backend.release_memory()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def enable_cuda_graph(self, enabled: bool = True) -> None:
        """Run step/decode_step, and generate's decode loop, as one captured graph per token (a backend with
        supports_graphs; engine/cuda_graph.py)."""
        if not enabled:
            self._graph = None  # eager from here; the captured graph stays in _kept_graph for the next enable
            return
        self._check_open()
        if self._kept_graph is None:
            from engine.cuda_graph import DecodeGraph

            self._kept_graph = DecodeGraph(self)
        # The same graph again: turning it off and on (the graph rung does per prompt, eager then graph)
        # costs no capture. Its key (DecodeGraph._bindings) captures again whatever changed meanwhile.
        self._graph = self._kept_graph

    def generate(self, prompt_ids, max_new_tokens: int, stop_ids=(), timings: Timings | None = None) -> list[int]:
        """Greedy decoding: the new token ids (stopping after a stop id, which is included)."""
        self._check_open()
        ids = self.check_ids(prompt_ids)
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        limit = self.token_limit
        if len(ids) + max_new_tokens > limit:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens plus {max_new_tokens} new ones is longer "
                                     f"than the cache's {limit} tokens")
        stop = {int(s) for s in stop_ids if s is not None}
        seq = self.new_sequence()
        out: list[int] = []
        tokens = None
        try:
            t0 = time.perf_counter()
            self._prefill(seq, ids)
            if timings is not None:
                timings.prefill_s = time.perf_counter() - t0
            if max_new_tokens == 0:
                return out
            first = self._argmax()
            tokens = self._token_source(seq, first, max_new_tokens - 1)
            token, t0 = first, time.perf_counter()
            while True:  # the one decode loop: the token source is the eager step or the graph's
                out.append(token)
                if token in stop or len(out) == max_new_tokens:
                    break
                token = next(tokens)
                if timings is not None:
                    t1 = time.perf_counter()
                    timings.decode_s.append(t1 - t0)
                    t0 = t1
        finally:
            if tokens is not None:
                tokens.close()  # the graph's source waits for its queued step and sets seq.length
            seq.free()
        return out

    def _token_source(self, seq: Sequence, first: int, n: int):
        """The next n greedy tokens after `first`, one per decode step, as generate's loop asks for them:
        the captured graph's on-device loop (engine/cuda_graph.py), or eager steps and an on-device argmax."""
        if self._graph is not None:
            return self._graph.tokens(seq, first, n)
        return self._eager_tokens(seq, first, n)

    def _eager_tokens(self, seq: Sequence, token: int, n: int):
        """Eager token source: one step, then the argmax on the device; only the token id is read back."""
        for _ in range(n):
            self.step(seq, token)  # logits stay on the device: the argmax reads them there
            token = self._argmax()
            yield token

    def _argmax(self) -> int:
        """Greedy pick on the device, from the logits of the last prefill or decode step."""
        self.backend.argmax(self._logits, self._next)
        return int(self.backend.to_numpy(self._next)[0])


LOAD_ALLOWANCE = 256 << 20  # bytes load() may allocate beyond the file's size: KV cache, workspaces, logits


def checked_config(mf) -> Qwen2Config:
    """The config of an open ModelFile, after checking every tensor it requires against the table
    (name, dtype, shape), lazily, so a config the table cannot hold (2**31 layers, a vocab or hidden
    size it does not have) is refused in time bounded by the table, before anything is allocated; and
    a table holding a tensor the config does not use is refused too (config and table disagree)."""
    try:
        config = Qwen2Config.from_hf_dict(mf.config_dict)
        check_linears(config, mf.quant)
    except (ConfigError, UnknownFormatError) as e:
        raise HeaderError(mf.path, str(e)) from None
    used = set()
    for name, (dtype, shape) in iter_tensor_specs(config, mf.quant):
        try:
            mf.check(name, dtype, shape)
        except MissingTensorError as e:
            if not name.startswith("model.layers."):
                raise
            raise MissingTensorError(mf.path, f"{e.problem} (the config says num_hidden_layers = "
                                              f"{config.num_hidden_layers})") from None
        used.add(name)
    extra = sorted(set(mf.tensors) - used)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise UnexpectedTensorError(mf.path, f"tensor {extra[0]!r}{more} is in the file but not used by the config "
                                             f"(num_hidden_layers = {config.num_hidden_layers}, tie_word_embeddings = "
                                             f"{config.tie_word_embeddings})")
    return config


def planned_bytes(config: Qwen2Config, cache_tokens: int) -> int:
    """What Model() allocates besides the weights: the KV cache, the decode workspace, the logits."""
    c = config
    pages = -(-min(cache_tokens, c.max_position_embeddings) // PAGE_SIZE)
    kv = 2 * c.num_hidden_layers * pages * c.num_key_value_heads * PAGE_SIZE * c.head_dim * 2
    workspace = 6 * c.hidden_size + 2 * c.qkv_size + 4 * c.q_size + 2 * c.intermediate_size + 8
    return kv + workspace + 4 * c.vocab_size + 2 * c.hidden_size + 4 * pages


def load(path, backend="numpy", verify_checksums: bool = True, cache_tokens: int = DEFAULT_CACHE_TOKENS) -> Model:
    """Open a .nanoqwen file, check its config against its tensor table and plan the allocations
    (refusing a plan past the file's size plus LOAD_ALLOWANCE), then put its weights on `backend`."""
    from engine.modelfile import ModelFile

    with ModelFile(path, verify_checksums=verify_checksums) as mf:
        config = checked_config(mf)
        planned = planned_bytes(config, cache_tokens)
        if planned > mf.size + LOAD_ALLOWANCE:
            raise AllocationTooLargeError(mf.path, f"loading would allocate {planned} bytes (KV cache of "
                                                   f"{min(cache_tokens, config.max_position_embeddings)} tokens, "
                                                   f"workspaces), more than the file's {mf.size} bytes plus "
                                                   f"{LOAD_ALLOWANCE}")
        # The numpy backend's arrays view the map; it stays open until the model lets go of them.
        return Model(config, mf.quant, backend, mf.expect, tokenizer_json=mf.file("tokenizer.json"),
                     cache_tokens=cache_tokens)
