"""Graph rung: the engine is deterministic. Three independent loads of the model generate the same
greedy tokens, bit for bit, for a spread of prompts; on CUDA through the captured decode graph (no
atomics whose order could change a sum). `--new-tokens N` sets the tokens per prompt;
`--skip-determinism` skips the test (three full generations are slow on a slow machine)."""

from __future__ import annotations

import pytest

import engine
from fixtures.prompts import prompts_for_model
from ladder.judges.tokens import spread_by_length, tokens_to_generate

RUNS = 3
PROMPTS = 6  # spread over the prompt lengths: short, on a page edge, long


def test_three_runs_generate_identical_tokens(backend, model_path, request):
    if request.config.getoption("--skip-determinism"):
        pytest.skip("skipped by --skip-determinism")
    n_new = request.config.getoption("--new-tokens")
    chosen = spread_by_length(prompts_for_model(model_path, request.config.getoption("--prompts")), PROMPTS)
    runs = []
    for run in range(RUNS):  # one load at a time: each closed before the next, so one model's memory is held
        # Checksums unverified: the prompt cases' own load verifies the file (test_graph.py `model`, once a
        # worker and format); here a whole read more (0.8 s at 0.5B, seconds at 7B) would check nothing new.
        with engine.load(model_path, backend=backend, verify_checksums=False) as model:
            if backend.supports_graphs:
                model.enable_cuda_graph(True)
            runs.append([model.generate(p.ids, tokens_to_generate(len(p.ids), n_new)) for p in chosen])
    for p, *tokens in zip(chosen, *runs):
        if any(t != tokens[0] for t in tokens[1:]):
            pytest.fail(f"prompt {p.id!r} ({len(p.ids)} tokens): {RUNS} runs on {backend.name} disagree: {tokens}")
