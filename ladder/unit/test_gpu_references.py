"""Unit rung: the references on the GPU compute what they compute on the host.

Where torch sees a GPU, the graph rung's references run there (reference/hf.py `model_device`): the HF
simulation, and the plain fp32 forward with fp16 storage whose distance from it is the rung's floor
(reference/torch_model.py, the torch reading of reference/model.py's `ref_forward`). Both are float32 with
TF32 off; the GPU only sums in another order. This case holds each GPU reference to its host twin on the
default model and on a seeded model of the Qwen2.5-0.5B shape, within the model's floor measured on the
same prompts: the GPU's simulation is the host's within the floor (in fact within float32 rounding), the
GPU's plain forward is the host's within two floors (each is within a floor of the simulation), and the
floor the GPU measures, so the bounds derived from it, is the host's within a factor of two.

The two simulations differ by float32 rounding alone (about 1e-5 on the default model's logits). The two
plain forwards differ by more: each rounds its activations to fp16, and a float32 difference that moves
a value across an fp16 rounding boundary moves it by an fp16 step, so two correct plain implementations
differ by the floor's own order (0.0056 against a floor of 0.0085 on the default model, torch against
NumPy on the same host; 0.082 against 0.075 on a seeded 0.5B-shape model drawn by NumPy, GPU against
host). That is the floor's meaning, and the reason the rung allows a multiple of it.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

# The case is the unit rung's longest on a GPU machine (the seeded 0.5B model's host simulation and plain
# forward, 24 layers each): 35 s on one thread, where the rung's 16 workers each get cores / 16 threads of
# BLAS and torch (ladder/plugin _share_cores). It is collected first (`long`) and runs while the other
# workers share out the short cases, so its host parts take cores / HOST_SHARE threads (4 on 16 cores): a
# few threads more than the cores for a while, against a critical path of one thread (28.6 s on one H200,
# the rungs side by side).
HOST_SHARE = 4


@contextlib.contextmanager
def _host_threads(n: int):
    """torch's intra-op threads and NumPy's OpenBLAS (reference/model.py's matmuls) at `n`, restored after."""
    from kernels.numpy.blas import blas_threads
    from ladder.graph.references import torch_threads

    before = torch_threads(n)
    try:
        with blas_threads(n):
            yield
    finally:
        torch_threads(before)


def _gpu():
    torch = pytest.importorskip("torch", reason="the references need torch")
    pytest.importorskip("transformers", reason="the HF simulation needs transformers")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU: the references run on the host, and there is nothing to compare")
    return torch


def _model(name: str):
    if name == "default":
        from fixtures.default_model import default_model_file

        return default_model_file()
    from fixtures.tiny_model import trained_like_model_file

    # drawn on the GPU and streamed to bf16 shards (the NumPy-made preset: 15 s to draw on 2 host cores); the
    # case took 46.0 s of the nightly's unit rung before, 39.5 s after
    return trained_like_model_file("0.5b", generator="torch-cuda")


@pytest.mark.long
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default", "seeded-0.5b"])
def test_the_gpu_references_agree_with_the_host_references_within_the_floor(name):
    _gpu()
    with _host_threads(max(1, (os.cpu_count() or 1) // HOST_SHARE)):
        _agree_within_the_floor(name)


def _agree_within_the_floor(name: str) -> None:
    from fixtures.dequantized import dequantized_weights
    from fixtures.prompts import prompts_for_model
    from ladder.judges.tokens import floor_logits, reference_greedy, spread_by_length, tokens_to_generate
    from reference.hf import hf_logits, hf_model, model_device

    assert model_device() == "cuda"
    path = _model(name)
    prompts = spread_by_length(prompts_for_model(path), k=3)
    config, host = dequantized_weights(path)
    _, gpu = dequantized_weights(path, device="cuda")
    hf_host, hf_gpu = hf_model(config, host), hf_model(config, gpu)
    worst = {"hf": 0.0, "plain": 0.0, "floor": 0.0, "host floor": 0.0}
    for p in prompts:
        ref = reference_greedy(hf_gpu, p.ids, tokens_to_generate(len(p.ids)))  # the run the rung keeps
        ids = list(p.ids) + [int(t) for t in ref.tokens[:-1]]
        on_host = hf_logits(hf_host, ids)[len(p.ids) - 1:]  # the host's simulation, fed the same tokens
        plain_gpu, plain_host = floor_logits(config, gpu, p.ids, ref), floor_logits(config, host, p.ids, ref)
        worst["floor"] = max(worst["floor"], float(np.abs(plain_gpu.astype(np.float64) - ref.logits).max()))
        worst["host floor"] = max(worst["host floor"], float(np.abs(plain_host.astype(np.float64) - on_host).max()))
        worst["hf"] = max(worst["hf"], float(np.abs(on_host.astype(np.float64) - ref.logits).max()))
        worst["plain"] = max(worst["plain"], float(np.abs(plain_gpu.astype(np.float64) - plain_host).max()))
    assert worst["floor"] > 0, "the plain forward equals the simulation: the floor measures nothing"
    assert worst["hf"] <= worst["floor"], (
        f"{name}: the HF simulation on the GPU differs from the host's by {worst['hf']:.4g}, more than the "
        f"model's floor {worst['floor']:.4g}")
    assert worst["plain"] <= 2 * worst["floor"], (
        f"{name}: the plain forward on the GPU (torch) differs from the host's (NumPy) by {worst['plain']:.4g}, "
        f"more than twice the model's floor {worst['floor']:.4g}: they are not two readings of one contract")
    assert 0.5 <= worst["floor"] / worst["host floor"] <= 2, (
        f"{name}: the floor measured on the GPU, {worst['floor']:.4g}, is not the host's {worst['host floor']:.4g} "
        f"within a factor of two")
    print(f"{name}: GPU vs host: HF simulation {worst['hf']:.3g}, plain forward {worst['plain']:.3g}; "
          f"floor {worst['floor']:.3g} (host {worst['host floor']:.3g})")
