"""Run one engine decoder block the way the model does: a prefill of L tokens, then decode steps.

Used by the layer rung and by `nanoqwen descend`. K/V go through a paged cache with a shuffled page table and NaN in every free
page and unwritten slot, so a read past the valid length shows.
"""

from __future__ import annotations

import numpy as np

from engine.block import Workspace, decoder_block
from engine.config import Qwen2Config
from engine.kv_cache import PagedKVCache
from engine.weights import load_layer_weights
from fixtures.layer_cases import LayerCase
from ladder.checks.harness import guarding


def run_engine_block(backend, config: Qwen2Config, quant: str, get, case: LayerCase, shuffle_seed: int = 0,
                     captured: bool = False, x: np.ndarray | None = None):
    """(output [T, H] fp32, k [T, nkv, d] fp16, v [T, nkv, d] fp16) from the engine's block.

    The block's input is `x` [T, H] (default: the case's seeded inputs). With `captured` (cuda backend),
    the decode steps replay one captured CUDA graph of the block: the step's input row and position go
    into fixed device buffers before each replay.
    """
    w = load_layer_weights(backend, config, quant, get, case.layer)
    x = case.inputs(config.hidden_size) if x is None else np.asarray(x, dtype=np.float32)
    # Every buffer the block writes (its workspaces, its KV cache pages) sits between guard bands, checked
    # when the block is done (ladder/checks/harness.py `guarding`).
    with guarding(backend, f"the block (layer {case.layer}, {case})"):
        return _run_block(backend, config, w, x, case, shuffle_seed, captured)


def _run_block(backend, config: Qwen2Config, w, x: np.ndarray, case: LayerCase, shuffle_seed: int, captured: bool):
    layer_config = config.replace(num_hidden_layers=1)
    cache = PagedKVCache(layer_config, backend, num_pages=-(-case.total // 16) + 5, debug_nan=True,
                         shuffle_seed=shuffle_seed)
    seq = cache.new_sequence()

    def block(ws: Workspace, decode: bool):
        decoder_block(backend, config, w, ws, cache.k[0], cache.v[0], seq.page_table, decode=decode)

    # The prefill, always eager.
    ws = Workspace(backend, config, case.L)
    seq.reserve(case.L)
    ws.residual[...] = backend.asarray(x[: case.L])
    ws.positions[...] = backend.asarray(np.arange(case.L, dtype=np.int32))
    block(ws, decode=False)
    seq.length = case.L
    outputs = [backend.to_numpy(ws.residual).copy()]

    step = Workspace(backend, config, 1)
    x_in = backend.empty((1, config.hidden_size), np.float32)  # the step's input row, fixed for the graph

    def body():
        step.residual[...] = x_in  # the block adds into the residual: start each replay from the input
        block(step, decode=True)

    replay = _captured(body) if captured else body
    for t in range(case.L, case.total):
        seq.reserve(1)  # updates the page table in place: the captured graph reads the new entry
        x_in[...] = backend.asarray(x[t: t + 1])
        step.positions[...] = backend.asarray(np.array([t], dtype=np.int32))
        replay()
        seq.length += 1
        outputs.append(backend.to_numpy(step.residual).copy())
    backend.synchronize()
    k, v = seq.gather(0)
    return np.concatenate(outputs), k, v


def _captured(body):
    """`body` captured once as a CUDA graph by engine/cuda_graph.capture (the engine's capture helper,
    after its eager warm-up run); returns the replay: one launch on the graph's stream, then a wait."""
    import cupy

    from engine.cuda_graph import capture

    stream = cupy.cuda.Stream(non_blocking=True)
    graph = None

    def replay():
        nonlocal graph
        with stream:
            stream.wait_event(cupy.cuda.Stream.null.record())
        if graph is None:
            graph = capture(body, stream, what="the decoder block's decode step")
        graph.launch()
        stream.synchronize()

    return replay
