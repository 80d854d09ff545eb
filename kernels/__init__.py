"""Kernels: one Backend object per device, whose attributes are the ops of docs/BACKEND.md's table.

`get_backend("numpy")` is the CPU backend (kernels/numpy/), `get_backend("cuda")` the GPU one
(kernels/cuda/, CuPy). Exact op signatures are in docs/BACKEND.md. Nothing here imports `engine/`:
a kernel implements its format's byte layout itself (an independent reading of docs/FORMAT.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

BACKENDS = ("numpy", "cuda")
# The op set of docs/BACKEND.md: what every backend implements and the ladder checks.
OPS = ("embed", "rmsnorm", "qkv_proj", "rope_kv_write", "attention_prefill", "attention_decode",
       "o_proj_residual", "gate_up_silu", "down_residual", "lm_head", "argmax")


class BackendUnavailableError(RuntimeError):
    """A backend asked for on a machine that cannot run it (e.g. `cuda` without CuPy or a GPU)."""


class FormatNotSupportedError(NotImplementedError):
    """A backend has no kernel for a quantization format."""


@dataclasses.dataclass
class QuantizedWeight:
    """One linear layer's quantized weight `W[out_features, in_features]` as a backend holds it.

    `tensors` maps the format's stored tensor names (`qweight`, `scales`, ...) to backend arrays; a
    backend may hold a repacked layout, as long as its ops read what its `prepare_linear` made.
    """

    format: str
    out_features: int
    in_features: int
    tensors: dict[str, Any]

    def __getitem__(self, key):
        return self.tensors[key]


def get_backend(name: str, **options):
    """The Backend object for `name`; raises BackendUnavailableError where it cannot run."""
    if name == "numpy":
        from kernels.numpy import NumpyBackend

        return NumpyBackend(**options)
    if name == "cuda":
        try:
            from kernels.cuda import CudaBackend
        except ImportError as e:
            raise BackendUnavailableError(f"backend 'cuda' needs CuPy and a CUDA GPU: {e}") from None
        return CudaBackend(**options)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


def cuda_available() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a GPU, else (False, the reason)."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        return False, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"CuPy sees no CUDA device ({type(e).__name__}: {e})"
    if n == 0:
        return False, "CuPy sees no CUDA device"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return True, props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
