"""Compile every CUDA module of this folder once (cupy.RawModule, sm_90) and hand out its kernels.

Each `.cu` file is one module (MODULES: every `.cu` here, found by name). A line `#include "x.cuh"`
naming a header of this folder is replaced by the header's text, recursively and once per module (the
header's `#pragma once` is honoured by the loader itself), so CuPy's on-disk kernel cache, keyed by the
source text, sees a change to any header. Every `extern "C" __global__` function is fetched right
away, which forces compilation at backend creation, before any CUDA graph capture (compiling inside a
capture would fail). Entry-point names are global across modules: a name defined twice is an error.

Each kernel is handed out behind a thin `Entry` that reports its launch to kernels/base.py's observer
when one is set (the ladder's launch map: which case ran which kernel) and otherwise only calls it. A
captured CUDA graph replays without Python, so the wrapper costs nothing on the decode path.
"""

from __future__ import annotations

import re
from pathlib import Path

from kernels import base

HERE = Path(__file__).resolve().parent
MODULES = tuple(sorted(p.stem for p in HERE.glob("*.cu")))
OPTIONS = ("-std=c++17", "--gpu-architecture=sm_90")
_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([\w.]+\.cuh)"[ \t]*$', re.M)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#pragma[ \t]+once[ \t]*$", re.M)
_ENTRY = re.compile(r'extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+(\w+)\s*\(')

_CACHE: dict = {}  # kernel name -> Entry


class Entry:
    """A compiled kernel (cupy.RawKernel) that reports its launches to the observer, if any."""

    __slots__ = ("name", "unit", "kernel")

    def __init__(self, name: str, kernel):
        self.name, self.unit, self.kernel = name, f"kernels/cuda::{name}", kernel

    def __call__(self, *args, **kwargs):
        sink = base.launch_observer()
        if sink is not None:
            sink.add(self.unit)
        return self.kernel(*args, **kwargs)

    def __getattr__(self, attr):  # attributes, max_threads_per_block, ...: the RawKernel's own
        return getattr(self.kernel, attr)


def _inline(text: str, where: str, seen: set[str]) -> str:
    def paste(m: re.Match) -> str:
        name = m.group(1)
        path = HERE / name
        if not path.is_file():
            raise RuntimeError(f"{where} includes {name!r}, which is not a header of kernels/cuda")
        if name in seen:
            return f"// {name}: already included above"
        seen.add(name)
        body = _PRAGMA_ONCE.sub("", path.read_text())
        return f"// ---- {name} (inlined by kernels/cuda/loader.py) ----\n" + _inline(body, name, seen)

    return _INCLUDE.sub(paste, text)


def source(module: str) -> str:
    """The module's source as NVRTC gets it: every `#include "x.cuh"` of this folder inlined, once."""
    text = (HERE / f"{module}.cu").read_text()
    if not _INCLUDE.search(text):
        raise RuntimeError(f"{module}.cu includes no header of kernels/cuda (common.cuh at least)")
    return _inline(text, f"{module}.cu", set())


def entry_points(module: str) -> list[str]:
    return _ENTRY.findall((HERE / f"{module}.cu").read_text())


def duplicate_entry_points() -> dict[str, list[str]]:
    """Entry-point name -> the modules defining it, for every name defined by more than one module."""
    where: dict[str, list[str]] = {}
    for module in MODULES:
        for name in entry_points(module):
            where.setdefault(name, []).append(module)
    return {name: mods for name, mods in where.items() if len(mods) > 1}


def kernels() -> dict:
    """name -> cupy.RawKernel for every entry point of every module, compiled on the first call only."""
    import cupy  # here, not at the top: the CPU-side compile test reads this file without CuPy

    if not _CACHE:
        dup = duplicate_entry_points()
        if dup:
            raise RuntimeError(f"kernels/cuda: entry points defined in more than one module: {dup}")
        found = {}
        for module in MODULES:
            mod = cupy.RawModule(code=source(module), options=OPTIONS)
            for name in entry_points(module):
                found[name] = Entry(name, mod.get_function(name))  # compiles the module (once) and loads it
        _CACHE.update(found)
    return _CACHE
