"""Graph rung: the engine is deterministic. Three independent loads of the model generate the same
greedy tokens, bit for bit, for a spread of prompts; on CUDA through the captured decode graph (no
atomics whose order could change a sum)."""

from __future__ import annotations

import pytest

import engine
from fixtures.prompts import default_prompts_path, load_prompts
from ladder.tokens import new_tokens_for

RUNS = 3
PROMPTS = 6  # spread over the prompt lengths: short, on a page edge, long


def test_three_runs_generate_identical_tokens(backend, model_path, request):
    prompts = sorted(load_prompts(request.config.getoption("--prompts") or default_prompts_path(), model_path),
                     key=lambda p: len(p.ids))
    chosen = [prompts[i * (len(prompts) - 1) // (PROMPTS - 1)] for i in range(PROMPTS)]
    runs = []
    for _ in range(RUNS):
        model = engine.load(model_path, backend=backend)
        if backend.name == "cuda":
            model.enable_cuda_graph(True)
        runs.append([model.generate(p.ids, new_tokens_for(len(p.ids))) for p in chosen])
    for p, *tokens in zip(chosen, *runs):
        if any(t != tokens[0] for t in tokens[1:]):
            pytest.fail(f"prompt {p.id!r} ({len(p.ids)} tokens): {RUNS} runs on {backend.name} disagree: {tokens}")
