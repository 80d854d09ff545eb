"""Running one Backend op the way the unit rung does: host arrays in, sentinel-filled outputs, host out.

Outputs start filled with a sentinel (NaN for floats, a negative value for ints): an element the op
never writes stays NaN, and `assert_close` fails on NaN anywhere.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

INT_SENTINEL = -7777


def sentinel(backend, shape, dtype):
    dtype = np.dtype(dtype)
    return backend.full(shape, np.nan if dtype.kind == "f" else INT_SENTINEL, dtype)


def dev(backend, *arrays):
    """Host arrays -> the backend's arrays (one or a tuple)."""
    out = tuple(backend.asarray(a) for a in arrays)
    return out[0] if len(out) == 1 else out


def host(backend, a) -> np.ndarray:
    backend.synchronize()
    return np.array(backend.to_numpy(a), copy=True)


def quantized(backend, fmt, w: np.ndarray, by_rows: bool = False):
    """(QuantizedWeight on the backend, stored tensors on the host) for a float32 weight; `by_rows`: its row
    blocks quantized side by side (by_row_blocks), the same tensors in a fraction of the time at 7B shapes."""
    tensors = fmt.fuse(by_row_blocks(lambda part: fmt.quantize(part["w"]), {"w": w})) if by_rows else fmt.quantize(w)
    return backend.prepare_linear(fmt.name, tensors, w.shape[0], w.shape[1]), tensors


def by_row_blocks(fn, tensors: dict[str, np.ndarray], blocks: int | None = None) -> list:
    """`fn` of each block of rows of `tensors` (every array cut along its first axis at the same rows),
    side by side in threads; NumPy releases the GIL in its array work. For the 7B-shape weights, whose
    quantizing and float64 reading take seconds each. Every shipped format keeps its data and its scales
    row by row (Format.fuse), so the blocks' results joined are the whole weight's."""
    rows = next(iter(tensors.values())).shape[0]
    blocks = blocks or host_threads()
    cuts = [rows * i // blocks for i in range(blocks + 1)]
    parts = [{k: v[a:b] for k, v in tensors.items()} for a, b in zip(cuts, cuts[1:]) if b > a]
    with ThreadPoolExecutor(len(parts)) as pool:
        return list(pool.map(fn, parts))


def host_threads() -> int:
    """Threads for the host-side preparation of the 7B-shape cases (quantizing, reading): the cores, at most 8."""
    return min(8, os.cpu_count() or 1)
