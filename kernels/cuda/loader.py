"""Compile every CUDA module of this folder once (cupy.RawModule, sm_90) and hand out its kernels.

Each `.cu` file is one module; `common.cuh` is pasted in place of its `#include "common.cuh"` line, so
CuPy's on-disk kernel cache (keyed by the source text) sees a change to the header too. Every
`extern "C" __global__` function is fetched right away, which forces compilation at backend creation,
before any CUDA graph capture (compiling inside a capture would fail).
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = ("int4_gemv", "rmsnorm", "rope", "paged_attention", "embed_lmhead_argmax")
OPTIONS = ("-std=c++17", "--gpu-architecture=sm_90")
_INCLUDE = '#include "common.cuh"'
_ENTRY = re.compile(r'extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+(\w+)\s*\(')

_CACHE: dict = {}  # kernel name -> cupy.RawKernel


def source(module: str) -> str:
    """The module's source as NVRTC gets it: common.cuh inlined."""
    text = (HERE / f"{module}.cu").read_text()
    common = (HERE / "common.cuh").read_text().replace("#pragma once", "")
    if _INCLUDE not in text:
        raise RuntimeError(f"{module}.cu does not include common.cuh")
    return text.replace(_INCLUDE, common, 1)


def entry_points(module: str) -> list[str]:
    return _ENTRY.findall((HERE / f"{module}.cu").read_text())


def kernels() -> dict:
    """name -> cupy.RawKernel for every entry point of every module, compiled on the first call only."""
    import cupy  # here, not at the top: the CPU-side compile test reads this file without CuPy

    if not _CACHE:
        found = {}
        for module in MODULES:
            mod = cupy.RawModule(code=source(module), options=OPTIONS)
            for name in entry_points(module):
                found[name] = mod.get_function(name)  # compiles the module (once) and loads it
        _CACHE.update(found)
    return _CACHE
