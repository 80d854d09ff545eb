"""Unit rung, whole engine on the small fixture model: cache consistency and bad requests.

Decode through the paged cache must give the logits of a full prefill recompute, within the noise
floor set by the prefill's own error against the float64 reference model, at every page edge, with a
shuffled page table and NaN in every free page and unwritten slot.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine
from engine.errors import ModelClosedError, PromptTooLongError, TokenIdError
from engine.kv_cache import PagedKVCache
from fixtures.tiny_model import random_model_file
from ladder.checks.harness import under_memcheck
from ladder.judges.compare import assert_close
from fixtures.dequantized import dequantized_weights
from reference.model import ref_forward

LENGTHS = (1, 15, 16, 17, 31, 32, 33)


@pytest.fixture(scope="module")
def model_path():
    return random_model_file()


@pytest.fixture(scope="module")
def reference(model_path):
    return dequantized_weights(model_path)


@pytest.fixture
def model(model_path, backend):
    return engine.load(model_path, backend=backend)


def check_decode_equals_prefill(model, reference, ids, case: str, shuffle_seed: int = 0):
    """Prefill ids[:1], decode the rest through a shuffled NaN-filled cache; compare with a full prefill."""
    ref = ref_forward(*reference, ids)[-1]
    model.use_cache(PagedKVCache(model.config, model.backend, num_pages=8, debug_nan=True, shuffle_seed=shuffle_seed))
    seq = model.new_sequence()
    full = model.prefill(seq, ids)
    seq.free()
    seq = model.new_sequence()
    logits = model.prefill(seq, ids[:1])
    for t in ids[1:]:
        logits = model.decode_step(seq, int(t))
    assert seq.length == len(ids) and len(seq.pages) == -(-len(ids) // 16)
    seq.free()
    assert_close("decode_logits", logits, ref, full, backend=model.backend.name, case=case)


@pytest.mark.parametrize("L", LENGTHS, ids=lambda L: f"L={L}")
def test_decode_with_cache_equals_full_prefill(model, reference, L):
    ids = np.random.default_rng(L).integers(0, model.config.vocab_size, L)
    check_decode_equals_prefill(model, reference, ids, f"L={L}", shuffle_seed=L)


def test_chunked_prefill_equals_one_prefill(model, reference):
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, 40)
    ref = ref_forward(*reference, ids)[-1]
    seq = model.new_sequence()
    full = model.prefill(seq, ids)
    seq.free()
    seq = model.new_sequence()
    model.prefill(seq, ids[:17])
    chunked = model.prefill(seq, ids[17:])
    seq.free()
    assert_close("decode_logits", chunked, ref, full, backend=model.backend.name, case="chunks 17+23")


def test_generate_is_greedy_and_stops(model):
    prompt = [5, 6, 7]
    out = model.generate(prompt, 12)
    assert len(out) == 12
    seq = model.new_sequence()
    logits = model.prefill(seq, prompt)
    for tok in out:
        assert tok == int(np.argmax(logits))
        logits = model.decode_step(seq, tok)
    seq.free()
    stop = out[3]
    assert model.generate(prompt, 12, stop_ids=[stop])[-1] == stop
    assert model.cache.allocator.num_free == model.cache.num_pages, "generate must free its pages"


def _step_by_step(model, prompt, tokens) -> np.ndarray:
    seq = model.new_sequence()
    rows = [model.prefill(seq, prompt)]
    rows += [model.decode_step(seq, int(t)) for t in tokens[:-1]]
    seq.free()
    return np.stack(rows)


@pytest.mark.parametrize("prompt_len,n", [(1, 1), (14, 6), (16, 17), (31, 3)], ids=lambda v: str(v))
def test_forced_logits_are_the_step_by_step_logits(model, prompt_len, n):
    """Model.forced_logits (teacher forcing, inputs advanced on the device, logits read back once) computes
    what prefill and then decode_step per fed token compute, bit for bit, at the page edges (a prompt of
    14 with 5 fed tokens crosses position 16, 16 with 16 fed fills the second page, 31 with 2 fed crosses
    32; one token feeds none), with tokens the model would not pick, eagerly and, where the backend
    captures graphs, through the captured decode step; it frees its pages."""
    rng = np.random.default_rng(prompt_len * 100 + n)
    prompt = rng.integers(0, model.config.vocab_size, prompt_len).tolist()
    tokens = rng.integers(0, model.config.vocab_size, n)
    for graph in ([False, True] if model.backend.supports_graphs else [False]):
        if model.backend.supports_graphs:
            model.enable_cuda_graph(graph)
        want = _step_by_step(model, prompt, tokens)
        got = model.forced_logits(prompt, tokens)
        assert got.shape == (n, model.config.vocab_size) and got.dtype == np.float32
        assert np.array_equal(got, want, equal_nan=True), (
            f"graph={graph}: forced logits differ from the step-by-step ones at (step, token) "
            f"{np.argwhere(got != want)[0].tolist()}")
        assert model.cache.allocator.num_free == model.cache.num_pages, "forced_logits must free its pages"


def test_forced_logits_refuse_what_a_step_would(model_path, backend):
    model = engine.load(model_path, backend=backend, cache_tokens=64)
    with pytest.raises(TokenIdError):
        model.forced_logits([5, 6], [])
    with pytest.raises(TokenIdError, match="out of range"):
        model.forced_logits([5, 6], [7, model.config.vocab_size, 8])
    with pytest.raises(PromptTooLongError, match="64 tokens"):
        model.forced_logits(list(range(60)), list(range(6)))
    assert model.cache.allocator.num_free == model.cache.num_pages
    assert model.forced_logits(list(range(60)), list(range(5))).shape == (5, model.config.vocab_size)  # full
    model.close()
    with pytest.raises(ModelClosedError):
        model.forced_logits([5, 6], [7])


@pytest.mark.parametrize("ids", [[0, 512], [-1], [3, 10**9]], ids=lambda ids: ",".join(map(str, ids)))
def test_token_id_out_of_range_is_refused(model, ids):
    with pytest.raises(TokenIdError, match="out of range"):
        model.generate(ids, 1)


def test_empty_or_non_integer_prompt_is_refused(model):
    with pytest.raises(TokenIdError):
        model.generate([], 1)
    with pytest.raises(TokenIdError):
        model.generate([1.5], 1)


def test_prompt_longer_than_the_cache_is_refused(model_path, backend):
    model = engine.load(model_path, backend=backend, cache_tokens=64)
    with pytest.raises(PromptTooLongError, match="64 tokens"):
        model.generate(list(range(60)), 5)
    with pytest.raises(PromptTooLongError):
        model.prefill(model.new_sequence(), list(range(65)))
    assert model.generate(list(range(60)), 4)  # exactly full is fine


def _device_pool():
    """CuPy's memory pool on the current device (the CUDA backend's allocations)."""
    import cupy

    return cupy.get_default_memory_pool()


def test_a_closed_model_hands_its_memory_back_and_refuses_to_run(model_path, backend):
    """Model.close drops the weights, cache and workspaces and calls the backend's release_memory: on a
    device backend the pool's used bytes return to what they were before the load and the pool holds no
    more memory than it did then (the freed blocks went back to the device, where torch in the same
    process can allocate them); on the host the arrays are gone. With CuPy's pool off (POOL_VARIABLE "0": a
    run under memcheck, `nanoqwen mutate`'s second look) there is no pool to measure, and the case skips:
    failing there, it would count every surviving mutant whose cases include it as caught."""
    if backend.needs_device and under_memcheck():
        pytest.skip("CuPy's memory pool is off (a run under memcheck): this case measures the pool")
    import gc
    import weakref

    def run(m):
        m.generate([5, 6, 7], 3)  # a prefill and decode steps: workspaces, cache pages, the backend's scratch
        if m.backend.supports_graphs:
            m.enable_cuda_graph(True)
            m.generate([5, 6, 7], 3)

    with engine.load(model_path, backend=backend) as first:
        run(first)  # the scratch buffers a run makes stay with the backend: made here, before the measure
    pool = _device_pool() if backend.needs_device else None
    # Earlier cases' models with a captured graph are reference cycles (model <-> graph) that only the
    # collector frees: collected now, and the collector held off, so none of them lands inside the measure.
    gc.collect()
    gc.disable()
    try:
        # CuPy frees only whole allocations: a chunk split between a live block (a backend scratch buffer)
        # and a freed one stays with the pool, so its free part is compared with what was there before.
        before = (pool.used_bytes(), pool.total_bytes()) if pool else None
        model = engine.load(model_path, backend=backend)
        run(model)
        weights = sum(a.nbytes for a in (model.embed_tokens, model.lm_head))
        if pool:
            assert pool.used_bytes() - before[0] >= weights
        else:
            held = weakref.ref(model.embed_tokens)
        model.close()
        if pool:
            used, total = pool.used_bytes(), pool.total_bytes()
            assert used == before[0], f"closed model's memory still in use: {used - before[0]} bytes"
            assert total <= before[1], f"closed model's memory kept in the pool: {total - before[1]} bytes more"
        else:
            assert held() is None, "the closed model still holds its embedding table"
    finally:
        gc.enable()
    with pytest.raises(ModelClosedError, match="closed"):
        model.generate([5, 6, 7], 1)
    model.close()  # twice is harmless


def test_tied_embeddings_model_runs(tmp_path):
    from engine.config import SHAPES
    from engine.convert import convert
    from fixtures.tiny_model import build_random_model

    cfg = SHAPES["tiny"].replace(tie_word_embeddings=True, num_hidden_layers=1)
    convert(build_random_model(tmp_path / "hf", cfg, seed=1, with_tokenizer=False), tmp_path / "m.nanoqwen")
    m = engine.load(tmp_path / "m.nanoqwen")
    assert m.lm_head is m.embed_tokens
    config, weights = dequantized_weights(tmp_path / "m.nanoqwen")
    assert "lm_head.weight" not in weights
    check_decode_equals_prefill(m, (config, weights), np.arange(1, 20), "tied L=19")
