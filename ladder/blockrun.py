"""Run one engine decoder block the way the model does: a prefill of L tokens, then decode steps.

Shared by the layer rung and the golden activations. K/V go through a paged cache with a shuffled
page table and NaN in every free page and unwritten slot, so a read past the valid length shows.
"""

from __future__ import annotations

import numpy as np

from engine.block import Workspace, decoder_block
from engine.config import Qwen2Config
from engine.kv_cache import PagedKVCache
from engine.weights import load_layer_weights
from fixtures.layer_cases import LayerCase


def run_engine_block(backend, config: Qwen2Config, quant: str, get, case: LayerCase, shuffle_seed: int = 0):
    """(output [T, H] fp32, k [T, nkv, d] fp16, v [T, nkv, d] fp16) from the engine's block."""
    w = load_layer_weights(backend, config, quant, get, case.layer)
    x = case.inputs(config.hidden_size)
    layer_config = config.replace(num_hidden_layers=1)
    cache = PagedKVCache(layer_config, backend, num_pages=-(-case.total // 16) + 5, debug_nan=True,
                         shuffle_seed=shuffle_seed)
    seq = cache.new_sequence()
    outputs = []
    chunks = [(0, case.L)] + [(t, t + 1) for t in range(case.L, case.total)]
    for lo, hi in chunks:
        T = hi - lo
        ws = Workspace(backend, config, T)
        seq.reserve(T)
        ws.residual[...] = backend.asarray(x[lo:hi])
        ws.positions[...] = backend.asarray(np.arange(lo, hi, dtype=np.int32))
        decoder_block(backend, config, w, ws, cache.k[0], cache.v[0], seq.page_table, decode=T == 1 and lo > 0)
        seq.length += T
        outputs.append(backend.to_numpy(ws.residual).copy())
    backend.synchronize()
    k, v = seq.gather(0)
    return np.concatenate(outputs), k, v
