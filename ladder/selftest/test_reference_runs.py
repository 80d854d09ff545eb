"""Self-tests of the graph rung's HF simulation when it cannot be built (ladder/graph/references.py
ReferenceRuns): the first failure is kept and fails the format's later cases at once with one line, and
the half-made float32 copy is gone before the failure propagates (a 7B graph worker out of GPU memory
once spent 8 minutes failing 65 cases one by one, each dequantizing 30 GB again)."""

from __future__ import annotations

import sys

import pytest

from fixtures import dequantized as dequantized_module
from fixtures.dequantized import dequantized_weights
from fixtures.tiny_model import random_model_file
from ladder.graph import references as graph


@pytest.fixture(scope="module")
def path():
    return random_model_file()


def test_a_dequantization_that_fails_half_way_leaves_no_tensor_in_its_traceback(path):
    """The traceback pytest keeps for a failed case holds the frame of dequantized_weights: the dict
    it was filling must be empty by then, or the copy made so far lives on with the traceback."""
    def stop_at_the_third(i, n, name):
        if i == 3:
            raise MemoryError("out of memory at the third tensor")

    with pytest.raises(MemoryError) as failed:
        dequantized_weights(path, progress=stop_at_the_third)
    frames = [tb.tb_frame for tb in _walk(failed.value.__traceback__)]
    filling = [f.f_locals["weights"] for f in frames if f.f_code is dequantized_module.dequantized_weights.__code__]
    assert filling == [{}], "the tensors dequantized before the failure are still held"


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def test_a_simulation_that_cannot_be_built_fails_the_formats_later_cases_at_once(path, monkeypatch):
    calls = []

    def out_of_memory(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.03 GiB. GPU 0 has a total capacity of 139.80 GiB\n"
                           "of which 18.81 MiB is free.")

    monkeypatch.setattr(graph, "dequantized_weights", out_of_memory)
    refs = graph.ReferenceRuns(path)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        refs.dequantized()
    for ask in (refs.dequantized, refs.model):  # the next cases: the kept line, nothing built again
        with pytest.raises(graph.ReferenceUnavailableError) as kept:
            ask()
        line = str(kept.value)
        assert "\n" not in line
        assert f"HF simulation [{refs.label}] could not be built on this worker (dequantizing its weights)" in line
        assert "RuntimeError: CUDA out of memory. Tried to allocate 2.03 GiB" in line
        assert "fewer of them with -n" in line
    assert len(calls) == 1
    assert refs.weights is None and refs._hf is None

    monkeypatch.setattr(graph, "dequantized_weights", dequantized_weights)
    refs.release()  # the fixture's teardown when the worker moves to another format: a new try later
    config, weights = refs.dequantized()
    assert weights and config["vocab_size"]


def test_a_failure_that_is_not_memory_is_kept_without_the_memory_hint(path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("weights do not fit the HF module: no value for ['model.norm.weight']")

    refs = graph.ReferenceRuns(path)
    monkeypatch.setattr(graph, "dequantized_weights", dequantized_weights)
    refs.dequantized()
    monkeypatch.setitem(sys.modules["reference.hf"].__dict__, "hf_model", broken)
    with pytest.raises(ValueError):
        refs.model()
    with pytest.raises(graph.ReferenceUnavailableError, match=r"\(building the module\): ValueError: weights do not") as kept:
        refs.model()
    assert "-n" not in str(kept.value) and refs.weights is None


def test_an_environment_whose_transformers_would_import_our_kernels_package_is_refused_in_one_line(monkeypatch):
    """transformers 5.25 imports the Hugging Face `kernels` distribution as `kernels`, the name of this
    project's kernel package: the reference refuses such an environment before transformers fails deep
    inside a model's construction, and says what to install."""
    import importlib.metadata

    from reference import hf

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.19.1" if d == "kernels" else real(d))
    with pytest.raises(hf.ShadowedKernelsError) as refused:
        hf.hf_config({"vocab_size": 8})
    line = str(refused.value)
    assert "\n" not in line and "'kernels' distribution 0.19.1" in line and "transformers<5.25" in line
    monkeypatch.setattr(importlib.metadata, "version", real)
    hf.check_transformers()  # this environment (the pyproject's bounds) has no such distribution
