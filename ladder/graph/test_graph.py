"""Graph rung: greedy tokens of the whole engine against the HF simulation, one test per prompt.

The HF simulation is transformers' `Qwen2ForCausalLM` in float32 on the engine's own dequantized weights
(reference/hf.py), so a red test points at the engine's kernels, not at quantization. Each prompt
generates past the next 16-token page boundary (ladder/judges/tokens.py `new_tokens_for`; `--new-tokens N`
sets the count), and the comparison follows docs/LADDER.md's "Token comparison": exact tokens pass, a
mismatch under the near-tie epsilon is a recorded near-tie (teacher-forced), any other mismatch fails
with prompt id, position, both tokens and the reference's margin, and so does any logit further from
the reference than the allowed difference. Near-ties are judged together, after the last prompt: the
engine may not flip them more often than the plain forward does at the floor prompts (ladder/judges/tokens.py
`judge_flips`, decided by the plugin over every prompt the run compared). `test_the_model_is_not_too_flat_to_judge`
refuses a model whose allowed difference is comparable to the spread of its logits.

The epsilon and the allowed difference are the model's own: the `bounds` fixture derives them once per
model (one worker measures, the others and later runs read them: ladder/judges/reference_store.py) from the model's noise floor (the plain fp32 forward with fp16 storage against the HF simulation)
on a spread of FLOOR_PROMPTS prompts, the same in every worker (ladder/judges/tokens.py `derive_bounds`).

The reference runs once per prompt on a machine (with its own KV cache) and serves every backend: its
runs are kept under the cache folder with the bounds (ladder/judges/reference_store.py), keyed by the model, the
reference's sources and the library versions, so a later run, shard, bisect step or mutant reads them
and imports neither torch nor transformers unless a run is missing. On CUDA
the decode step runs both eager and as the captured graph. Honours `--model`, `--prompts` and
`--new-tokens`; each test attaches its result (`nanoqwen_graph`) and the bounds it was judged by
(`nanoqwen_graph_bounds`) as user properties, which the plugin totals at the end of the run and writes
to the ladder JSON.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ladder.judges.reference_store import missing_library

# The reference needs torch and transformers, but a run whose reference runs and bounds are kept on this
# machine (ladder/judges/reference_store.py) never imports them: only their presence is checked here.
if missing_library():
    pytest.skip(f"the graph rung's reference (the HF simulation) needs {missing_library()}: "
                "pip install -e '.[test]'", allow_module_level=True)

import engine
from engine.progress import Progress
from fixtures.prompts import default_prompts_path, prompts_for_model, read_prompt_ids
from ladder.graph.references import ReferenceRuns
from ladder.judges.compare import rerun_command
from ladder.judges.reference_store import bounds_key, load_or_derive
from ladder.judges.tokens import GraphBounds, compare_greedy, derive_bounds, engine_logits, spread_by_length


def prompts_file(config):
    return config.getoption("--prompts") or default_prompts_path()


def pytest_generate_tests(metafunc):
    if "prompt_id" in metafunc.fixturenames:
        ids = read_prompt_ids(prompts_file(metafunc.config))
        metafunc.parametrize("prompt_id", ids, ids=ids)


@pytest.fixture(scope="session")
def prompts(request, model_path):
    """Prompt id -> Prompt, every id inside the model's vocab (fixtures/prompts.py `prompts_for_model`)."""
    return {p.id: p for p in prompts_for_model(model_path, request.config.getoption("--prompts"))}


# A worker that runs several formats' tests (pytest-xdist hands them out in chunks) switches the
# session fixtures' parameter back and forth, and pytest rebuilds a parametrized session fixture at each
# switch. The runs and bounds of each model are kept here, by model path, across those rebuilds: without
# this, every switch recomputed the floor prompts and the floor (a nightly's graph rung over four formats
# ran for half an hour). The HF simulation itself is dropped at a switch (a large model's fp32 weights).
_REFERENCES: dict[tuple, ReferenceRuns] = {}
_BOUNDS: dict[tuple, GraphBounds] = {}


def _planned(session, quant: str, prompts: dict, floor) -> list:
    """The prompts this process will run the simulation on in format `quant`: the floor prompts and the
    run's selected prompts of the format. All of them also where a format's cases are spread over several
    workers: the first worker to ask computes them in one batch and keeps them, the others wait and read
    (ladder/judges/reference_store.py `get_many`), which costs less than each computing its share."""
    ids = {item.callspec.params["prompt_id"] for item in session.items
           if getattr(item, "callspec", None) is not None and "prompt_id" in item.callspec.params
           and item.callspec.params.get("quant_name") == quant}
    chosen = {p.id for p in floor}
    return [*floor, *(p for pid, p in prompts.items() if pid in ids and pid not in chosen)]


@pytest.fixture(scope="session")
def references(request, model_path, quant_name, prompts):
    key = (str(model_path), request.config.getoption("--new-tokens"))
    if key not in _REFERENCES:
        floor = spread_by_length(prompts.values())
        _REFERENCES[key] = ReferenceRuns(model_path, request.config.getoption("--new-tokens"),
                                         planned=_planned(request.session, quant_name, prompts, floor))
    yield _REFERENCES[key]
    _REFERENCES[key].release()


@pytest.fixture(scope="session")
def bounds(request, model_path, prompts, references):
    """The model's near-tie epsilon and allowed logit difference, from its floor on the floor prompts."""
    new_tokens = request.config.getoption("--new-tokens")
    key = (str(model_path), new_tokens, request.config.getoption("--prompts"))
    if key not in _BOUNDS:
        chosen = spread_by_length(prompts.values())

        def derive():
            runs = [(p.id, p.ids, references.get(p)) for p in chosen]
            floor = Progress(f"graph bounds [{references.label}]: the floor", len(runs), "floor prompts")
            with floor.working("the plain forward"):
                return derive_bounds(*references.dequantized(), runs, progress=lambda i, n, name: floor.update(i))

        # measured once per model by one worker, kept for the others and for later runs (ladder/judges/reference_store.py)
        _BOUNDS[key] = load_or_derive(bounds_key(model_path, chosen, new_tokens), derive)
    return _BOUNDS[key]


@pytest.fixture(scope="module")
def model(model_path, backend):
    """The engine on this format's model; closed when the worker moves on (another format, another
    module), so its device memory goes back to the device for the next format's HF simulation."""
    with engine.load(model_path, backend=backend) as m:
        yield m


def decode_modes(model):
    """Eager everywhere; on a backend that supports graphs (CUDA) also the captured decode graph (docs/LADDER.md)."""
    if model.backend.supports_graphs and hasattr(model, "enable_cuda_graph"):
        return ["eager", "graph"]
    return ["eager"]


def test_greedy_tokens_match_the_hf_simulation(request, model, prompts, references, prompt_id, record_property):
    prompt = prompts[prompt_id]
    ref = references.get(prompt)
    logits_by_mode = {}
    for mode in decode_modes(model):
        if mode == "graph":
            model.enable_cuda_graph(True)
        try:
            logits_by_mode[mode] = engine_logits(model, prompt.ids, ref.tokens)
        finally:
            if mode == "graph":
                model.enable_cuda_graph(False)
    # The bounds last: on a first run one worker measures the format's floor while the others wait for it
    # (ladder/judges/reference_store.py load_or_derive); asked for here, a waiting worker has already run its
    # prompt's simulation and the engine instead of idling before them.
    bounds = request.getfixturevalue("bounds")
    record_property("nanoqwen_graph_bounds", {**bounds.record(), "label": model.quant})
    reports = []
    for mode, logits in logits_by_mode.items():
        name = model.backend.name + ("" if mode == "eager" else "+graph") + f"[{model.quant}]"
        if mode == "graph" and np.array_equal(logits, logits_by_mode["eager"], equal_nan=True):
            # the same bits judge the same: the eager verdict under the graph's name, not a second pass over
            # the logits (a 152k vocabulary's are 11 MB a prompt on the 0.5B-size model)
            result = dataclasses.replace(reports[0], backend=name)
        else:
            result = compare_greedy(prompt.id, ref, logits, backend=name, bounds=bounds)
        record_property("nanoqwen_graph", result.record())
        reports.append(result)
    bad = [r for r in reports if not r.passed]
    if bad:
        pytest.fail("\n".join(r.describe() for r in bad) + f"\nrerun: {rerun_command()}", pytrace=False)
    if "graph" in logits_by_mode:  # the captured replay computes exactly what eager computes
        eager, graph = logits_by_mode["eager"], logits_by_mode["graph"]
        if not np.array_equal(eager, graph, equal_nan=True):
            where = np.argwhere(eager != graph)[0].tolist()
            pytest.fail(f"graph[{prompt.id}]: captured decode logits differ from eager at (step, token) {where}",
                        pytrace=False)


@pytest.mark.long  # on a first run its setup measures the format's floor: started first, every format's at once
def test_the_model_is_not_too_flat_to_judge(bounds, quant_name, record_property):
    """A model whose allowed logit difference is comparable to the spread of its logits is refused: no
    check could tell a wrong engine from a right one on it (ladder/judges/tokens.py GraphBounds.judgeable). It
    reads the floor prompts only, whatever -k or --prompts selects."""
    record_property("nanoqwen_graph_bounds", {**bounds.record(), "label": quant_name})
    if not bounds.judgeable:
        pytest.fail(bounds.refusal(), pytrace=False)


@pytest.mark.long  # three full forwards of the HF simulation (48 s at the 7B shape), kept like its runs
def test_the_reference_kv_cache_run_is_a_full_recompute(prompts, references, bounds):
    """The reference's incremental run (HF KV cache) against HF's full forward over the same tokens.

    Judged by the graph rung's own rule: the cache must not change a greedy token beyond a near-tie.
    Both are references, kept per machine; the judging runs every time.
    """
    chosen = sorted(prompts.values(), key=lambda p: len(p.ids))
    for prompt in (chosen[0], chosen[len(chosen) // 2], chosen[-1]):
        ref = references.get(prompt)
        full = references.full_logits(list(prompt.ids) + [int(t) for t in ref.tokens[:-1]], start=len(prompt.ids) - 1)
        result = compare_greedy(prompt.id, ref, full, backend="hf-full-recompute", bounds=bounds)
        if not result.passed:
            pytest.fail(result.describe(), pytrace=False)
