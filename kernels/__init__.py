"""Kernels: one Backend object per device, whose attributes are the ops of docs/BACKEND.md's table.

`get_backend("numpy")` is the CPU backend (kernels/numpy/), `get_backend("cuda")` the GPU one
(kernels/cuda/, CuPy). Every backend subclasses `kernels.base.Backend` (every op of `OPS`, the memory
helpers, the capabilities) and is registered here by name, its module imported only when asked for.
Exact op signatures are in docs/BACKEND.md. Nothing here imports `engine/`: a kernel implements its
format's byte layout itself (an independent reading of docs/FORMAT.md).
"""

from __future__ import annotations

from kernels.base import (FUSED_OPS, HELPERS, OPS, Backend, BackendUnavailableError, FormatNotSupportedError,
                          QuantizedWeight, backend_available, backend_class, backend_names, backend_needs_device,
                          get_backend, register_backend, unregister_backend)

# The registry: one line per backend (name, "module:Class", whether it needs an accelerator).
register_backend("numpy", "kernels.numpy:NumpyBackend")
register_backend("cuda", "kernels.cuda:CudaBackend", needs_device=True)

BACKENDS = backend_names()  # the backends registered at import (a test may register more later)

__all__ = ["FUSED_OPS", "HELPERS", "OPS", "BACKENDS", "Backend", "BackendUnavailableError",
           "FormatNotSupportedError", "QuantizedWeight", "backend_available", "backend_class", "backend_names",
           "backend_needs_device", "cuda_available", "get_backend", "register_backend", "unregister_backend"]


def cuda_available() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a GPU, else (False, the reason)."""
    return backend_available("cuda")
