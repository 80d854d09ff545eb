"""Self-test: the HF simulation run on many prompts at once gives each prompt the greedy run of its own.

The graph rung computes a format's reference runs together (ladder/judges/tokens.py
`reference_greedy_batch`): prompts left-padded into batches, one prefill and a step per token for the
whole batch. That is only a faster way to the same runs: each prompt's tokens must be the greedy tokens
of a full forward over that prompt alone, and its logits that forward's within float32 rounding. The
full forward (`hf_logits`, no cache, no padding, one prompt) is the independent reading here. The
batches are made small so that several form, each with rows of unequal length, and each prompt asks for
its own number of new tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="the HF simulation needs torch")
pytest.importorskip("transformers", reason="the HF simulation needs transformers")

from engine.resolve import resolve_model
from fixtures.dequantized import dequantized_weights
from fixtures.prompts import prompts_for_model
from ladder.judges import tokens
from ladder.judges.tokens import reference_greedy, reference_greedy_batch, spread_by_length
from reference.hf import hf_logits, hf_model

FLOAT32_ROUNDING = 1e-4  # another order of float32 sums, on logits of order 10


@pytest.fixture(scope="module")
def simulation():
    import torch

    path = resolve_model(None, "int4_sym_g128", progress=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # this worker's other cases get their threads back below
    yield hf_model(*dequantized_weights(path)), prompts_for_model(path)
    torch.set_num_threads(before)


def _full_forward(hf, ids, generated) -> np.ndarray:
    """The logits at each new position of one forward over the prompt and the tokens before it."""
    return hf_logits(hf, list(ids) + [int(t) for t in generated[:-1]])[len(ids) - 1:]


def test_each_prompt_of_a_batched_run_gets_its_own_greedy_run(simulation, monkeypatch):
    hf, prompts = simulation
    chosen = spread_by_length(prompts, k=6)  # from a one-token prompt to the longest
    n_new = [3 + 2 * i for i in range(len(chosen))]
    monkeypatch.setattr(tokens, "BATCH_TOKENS", 2 * (len(chosen[-1].ids) + max(n_new)))  # rows of unequal length, several batches
    batches = []
    refs = reference_greedy_batch(hf, [p.ids for p in chosen], n_new, done=batches.append)
    assert len(batches) >= 2 and sum(batches) == len(chosen) and max(batches) >= 2, batches
    assert len({len(p.ids) for p in chosen}) == len(chosen), "the rows must need padding"
    for p, n, ref in zip(chosen, n_new, refs):
        full = _full_forward(hf, p.ids, ref.tokens)
        assert ref.prompt_len == len(p.ids) and ref.logits.shape == (n, full.shape[1]) and ref.logits.dtype == np.float32
        assert np.array_equal(ref.tokens, np.argmax(ref.logits, axis=-1))
        assert np.array_equal(ref.tokens, np.argmax(full, axis=-1)), f"{p.id}: another greedy run than its own"
        worst = float(np.abs(ref.logits.astype(np.float64) - full).max())
        assert worst <= FLOAT32_ROUNDING, f"{p.id}: the batched logits differ from its own forward's by {worst:.3g}"


def test_a_prompt_alone_is_a_batch_of_one(simulation):
    hf, prompts = simulation
    p = spread_by_length(prompts, k=2)[-1]
    alone, = reference_greedy_batch(hf, [p.ids], [4])
    ref = reference_greedy(hf, p.ids, 4)
    assert np.array_equal(ref.tokens, alone.tokens) and np.array_equal(ref.logits, alone.logits)


def test_prompts_and_token_counts_must_pair_up(simulation):
    hf, prompts = simulation
    with pytest.raises(ValueError, match="2 prompts, 1 new-token counts"):
        reference_greedy_batch(hf, [prompts[0].ids, prompts[1].ids], [3])
