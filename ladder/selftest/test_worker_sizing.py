"""Self-tests of ladder/run/workers.py: the layer and graph rungs' workers are sized to the model."""

from __future__ import annotations

import pytest

from engine.config import SHAPES
from ladder.plugin import groups
from ladder.run import workers
from ladder.run.workers import GB, ModelSize, fitting, worker_need


def size_of(shape: str, bytes_per_weight: float = 0.53) -> ModelSize:
    """The size of a model of `shape` with an untied head, its linears stored at `bytes_per_weight`."""
    c = SHAPES[shape].replace(tie_word_embeddings=False)
    d = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    layer = H * (q + 2 * kv) + (q + 2 * kv) + q * H + 3 * H * I + 2 * H
    return ModelSize(2 * V * H + c.num_hidden_layers * layer + H, int(c.num_hidden_layers * layer * bytes_per_weight
                                                                       + 2 * V * H * 2), layer)


def test_a_7b_graph_rung_takes_the_workers_one_h200_holds():
    """Four workers (one per format, the CUDA backend's choice) would need 144 GB; three fit 143 GB."""
    need = worker_need(size_of("qwen2.5-coder-7b"), "graph", "cuda", refs_on_gpu=True)
    assert 30 * GB < need.gpu < 40 * GB and need.host < 3 * GB
    n, why = fitting(4, need, gpu=143 * GB, host=120 * GB)
    assert n == 3 and "GPU memory" in why


def test_a_1_5b_model_on_a_24_gb_host_runs_one_numpy_graph_worker():
    """The case that was killed for memory: two workers each holding the float32 simulation and a NumPy engine."""
    size = ModelSize(1_777_088_000, 1_300_000_000, 46_800_000)
    need = worker_need(size, "graph", "numpy", refs_on_gpu=False)
    assert fitting(2, need, gpu=None, host=23 * GB)[0] == 1


def test_a_small_model_keeps_the_backends_choice():
    need = worker_need(size_of("tiny", 2.0), "graph", "cuda", refs_on_gpu=True)
    assert fitting(4, need, gpu=143 * GB, host=120 * GB)[0] == 4


def test_at_least_one_worker_even_when_none_fits():
    assert fitting(4, workers.Need(200 * GB, 1 * GB), gpu=143 * GB, host=None)[0] == 1


@pytest.mark.parametrize("explicit", [False, True])
def test_the_line_says_what_was_chosen_and_a_users_n_is_an_upper_bound(monkeypatch, explicit):
    from fixtures.tiny_model import random_model_file

    monkeypatch.setattr(workers, "host_available", lambda: 8 * GB)
    monkeypatch.setattr(workers, "references_on_gpu", lambda: False)
    monkeypatch.setattr(workers, "worker_need", lambda *a: workers.Need(0, 3 * GB))
    n, line = workers.size_workers("graph", 4, [str(random_model_file())], ["numpy"], explicit=explicit)
    assert n == 2  # 0.85 x 8 GB holds two workers of 3 GB
    assert line.startswith("nanoqwen: rung graph: 2 workers") and "3.0 GB of host memory each, of 8 GB available" in line
    assert ("not the 4 of -n" in line) == explicit
    assert workers.size_workers("unit", 4, [str(random_model_file())], ["numpy"]) == (4, None)


QWEN_1_5B = SHAPES["qwen2.5-0.5b"].replace(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                          num_attention_heads=12)  # Qwen2.5-1.5B: 1.54 B parameters


@pytest.mark.parametrize("config, small", [(SHAPES["qwen2.5-0.5b"], True), (QWEN_1_5B, True),
                                           (SHAPES["qwen2.5-coder-7b"], False)], ids=["0.5b", "1.5b", "7b"])
def test_below_two_billion_parameters_a_model_is_small(tmp_path, config, small):
    """A small model's formats' cases spread over every worker; a large one's keep to one worker per format."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    assert groups.small_model(str(tmp_path)) is small
    assert groups.small_model(None)  # the embedded default model


def test_nanoqwen_spread_below_moves_the_line_and_a_bad_value_names_itself(monkeypatch):
    monkeypatch.setenv("NANOQWEN_SPREAD_BELOW", "0")
    assert not groups.small_model(None)  # every model counts as large: the grouping of before
    monkeypatch.setenv("NANOQWEN_SPREAD_BELOW", "2e9")
    assert groups.spread_below() == 2_000_000_000
    for bad in ("many", "-1", "inf"):
        monkeypatch.setenv("NANOQWEN_SPREAD_BELOW", bad)
        with pytest.raises(groups.SpreadError, match="NANOQWEN_SPREAD_BELOW is"):
            groups.small_model(None)


def test_a_bad_nanoqwen_spread_below_is_one_line_and_exit_2_before_any_rung(tmp_path):
    import subprocess
    import sys

    from ladder.run.nested import child_env

    r = subprocess.run([sys.executable, "-m", "ladder", "ladder", "--backend", "numpy", "--rungs", "unit",
                        "--report", str(tmp_path / "r")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=child_env("numpy", NANOQWEN_SPREAD_BELOW="lots"))
    assert r.returncode == 2 and "[1/1] rung" not in r.stdout, r.stdout[-1500:] + r.stderr[-1500:]
    assert r.stderr.strip().count("\n") == 0 and "NANOQWEN_SPREAD_BELOW is 'lots'" in r.stderr, r.stderr


# --- the rungs side by side (workers.side_by_side) ---


@pytest.fixture
def h200(monkeypatch):
    """One H200 and its host, as the sizing reads them."""
    monkeypatch.delenv("NANOQWEN_SIDE_BY_SIDE", raising=False)
    monkeypatch.setattr(workers, "gpu_total", lambda backend: 143 * GB)
    monkeypatch.setattr(workers, "host_available", lambda: 120 * GB)
    monkeypatch.setattr(workers, "references_on_gpu", lambda: True)


def test_a_small_model_on_a_gpu_runs_its_rungs_side_by_side_and_unit_takes_the_cores_left(h200):
    plan, why = workers.side_by_side(["unit", "layer", "graph"], {"layer": "4", "graph": "4"},
                                     size_of("qwen2.5-0.5b"), ["numpy", "cuda"], cores=16)
    assert why is None and plan.workers == {"unit": "8", "layer": "4", "graph": "4"}
    assert plan.line.startswith("nanoqwen: rungs side by side (unit on 8 workers, layer on 4 workers, graph on 4 workers; "
                                "a model of 0.")


def test_a_7b_model_runs_its_rungs_one_after_another(h200):
    """Its graph rung alone fills the GPU (three workers of 37 GB)."""
    assert workers.side_by_side(["unit", "layer", "graph"], {"layer": "4", "graph": "3"}, size_of("qwen2.5-coder-7b"),
                                ["cuda"], cores=16) == (None, None)


def test_rungs_that_would_not_fit_together_run_one_after_another_and_say_so(h200, monkeypatch):
    monkeypatch.setattr(workers, "gpu_total", lambda backend: 16 * GB)
    plan, why = workers.side_by_side(["layer", "graph"], {"layer": "4", "graph": "4"}, size_of("qwen2.5-0.5b"),
                                     ["cuda"], cores=16)
    assert plan is None and why.startswith("nanoqwen: rungs layer, graph one after another: side by side they would "
                                           "not fit a model of 0.") and "GPU: " in why and "of 16" in why


def test_a_host_backend_runs_its_rungs_one_after_another_unless_told(h200, monkeypatch):
    """On the host, the rungs' workers already fill the cores."""
    args = (["unit", "graph"], {"graph": "2"}, None, ["numpy"], 2)
    assert workers.side_by_side(*args) == (None, None)
    monkeypatch.setenv("NANOQWEN_SIDE_BY_SIDE", "on")
    assert workers.side_by_side(*args)[0].workers == {"unit": "2", "graph": "2"}
    monkeypatch.setenv("NANOQWEN_SIDE_BY_SIDE", "off")
    assert workers.side_by_side(["unit", "graph"], {"graph": "4"}, None, ["cuda"], 16) == (None, None)
