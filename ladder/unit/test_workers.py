"""Unit rung: with several GPUs, each pytest-xdist worker works on its own GPU and nothing lands on
GPU 0 by accident (docs/LADDER.md, "Several GPUs and several machines").

Worker gwN asks the backend for its options (`worker_options(N)`: CUDA gives GPU N modulo the GPU
count); the backend makes that device current for CuPy, and the plugin makes it torch's current CUDA
device too. This test looks at where the arrays of a real workload live: the backend's own buffers,
a loaded model's weights, its KV cache and the logits of a decode step. On one GPU every worker is
told GPU 0 and the check is the same; on a machine with several it tells them apart. A backend
without a device (NumPy) skips with that reason.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine
from ladder.plugin import worker_device


def _device_of(a) -> int | None:
    dev = getattr(a, "device", None)
    return getattr(dev, "id", None)


@pytest.mark.long
def test_each_worker_keeps_its_arrays_on_its_own_gpu(backend, model_path):
    if not getattr(backend, "needs_device", False):
        pytest.skip(f"backend {backend.name} keeps arrays in host memory: there is no device to pick")
    want = worker_device(backend.name)
    want = 0 if want is None else want  # no workers: the process's default device
    model = engine.load(model_path, backend=backend)
    seq = model.new_sequence()
    logits = model.step(seq, 1)  # one decode step: the workspace, the cache pages, the logits
    arrays = {"empty": backend.empty((4,), np.float32), "asarray": backend.asarray(np.ones(3, np.float32)),
              "full": backend.full((2,), 1.0, np.float16), "scratch": backend.scratch("worker-check", (8,), np.float32),
              "embed_tokens": model.embed_tokens, "layer0 qkv": next(iter(model.layers[0].qkv.tensors.values())),
              "k cache": model.cache.k[0], "logits": logits}
    where = {name: _device_of(a) for name, a in arrays.items() if a is not None}
    assert where and all(d == want for d in where.values()), f"worker device {want}, arrays on {where}"
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        assert torch.cuda.current_device() == want, f"torch's current device {torch.cuda.current_device()}, worker's {want}"
        assert torch.zeros(1, device="cuda").device.index == want
