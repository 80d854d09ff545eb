"""Running one Backend op the way the unit rung does: host arrays in, sentinel-filled outputs, host out.

Outputs start filled with a sentinel (NaN for floats, a negative value for ints): an element the op
never writes stays NaN, and `assert_close` fails on NaN anywhere.

Outputs sit between guard bands (`sentinel`, `guarded`): each is a view into the middle of a larger
buffer, with GUARD_BYTES of a canary byte pattern on either side, and `host` checks the canaries when it
reads the output back. A write one past an output's last row, or one before its first, changes no value a
check compares; it changes the canary, and the case fails naming the op, the side and the distance. The
band is a multiple of 256 bytes, so the output keeps the alignment a fresh allocation has (the GEMV
kernels' 16-byte loads and stores, cupy's 256-byte pool blocks). `guarding` does the same for every
buffer an engine block allocates (the layer rung).

Inputs (`dev`) sit at the front of a buffer followed by GUARD_BYTES of NaN (the int sentinel for ints):
a read past an input's end brings NaN, or an impossible index, into the output.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

INT_SENTINEL = -7777


POOL_VARIABLE = "NANOQWEN_CUPY_POOL"  # "0": no CuPy memory pool (a run under compute-sanitizer memcheck)


def under_memcheck() -> bool:
    """This process runs under compute-sanitizer's memory checks: POOL_VARIABLE is "0" (mutate's second
    look at a CUDA survivor sets it)."""
    return os.environ.get(POOL_VARIABLE) == "0"


def honour_pool_variable() -> None:
    """With POOL_VARIABLE set to "0", turn CuPy's memory pool off in this process: with the pool on, a write
    past an array's end lands inside a larger pooled block, which memcheck sees as valid memory (the
    ladder's plugin calls this at start; `nanoqwen mutate`'s second look at a CUDA survivor sets it)."""
    if under_memcheck():
        try:
            import cupy
        except ImportError:
            return
        cupy.cuda.set_allocator(None)


GUARD_BYTES = 512
CANARY = 0xA5  # each guard byte; as fp16 -0.0227, fp32 -2.9e-16, int32 -1515870811: no op's likely output
_GUARDED: dict[int, tuple] = {}  # id(output view) -> (the view, its whole buffer, the band in elements)
_MAX_GUARDED = 64  # outputs whose bands are not yet checked (a check that never reads one back leaks none)


def _fill_value(dtype: np.dtype):
    """The sentinel of a dtype: NaN for floats, INT_SENTINEL for signed ints, the largest unsigned value."""
    return np.nan if dtype.kind == "f" else INT_SENTINEL if dtype.kind == "i" else np.iinfo(dtype).max


def _filled(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    return np.full(shape, _fill_value(dtype), dtype)


def sentinel(backend, shape, dtype):
    """An output filled with the sentinel, between guard bands."""
    return guarded(backend, _filled(shape, dtype))


def guarded(backend, a: np.ndarray):
    """The backend's copy of host array `a` (an output, or a buffer an op updates in place) between guard
    bands, checked by `host` when it is read back."""
    entry = _banded(backend, a)
    if len(_GUARDED) >= _MAX_GUARDED:
        _GUARDED.pop(next(iter(_GUARDED)))
    _GUARDED[id(entry[0])] = entry
    return entry[0]


def _banded(backend, a: np.ndarray) -> tuple:
    """(view, its whole buffer, the band in elements): the backend's copy of `a` between canary bands."""
    a = np.ascontiguousarray(a)
    band = GUARD_BYTES // a.itemsize
    buf = np.frombuffer(bytes([CANARY]) * ((a.size + 2 * band) * a.itemsize), dtype=a.dtype).copy()
    buf[band:band + a.size] = a.reshape(-1)
    whole = backend.asarray(buf)
    return whole[band:band + a.size].reshape(a.shape), whole, band


def check_guards(backend, a, op: str | None = None) -> None:
    """Fail if an op (`op`, named in the message) wrote into the guard bands around output `a` (a no-op for
    an unguarded array)."""
    entry = _GUARDED.get(id(a))
    if entry is None or entry[0] is not a:
        return
    _check_bands(backend, entry, f"{op or 'an op'} wrote outside its output")


def _check_bands(backend, entry, what: str) -> None:
    view, whole, band = entry
    width = band * whole.dtype.itemsize
    before = np.array(backend.to_numpy(whole[:band]), copy=True).view(np.uint8)  # the bands alone come back
    after = np.array(backend.to_numpy(whole[whole.size - band:]), copy=True).view(np.uint8)
    for side, part in (("before its first element", before[::-1]), ("past its last element", after)):
        changed = np.flatnonzero(part != CANARY)
        if changed.size:
            raise AssertionError(
                f"{what}: {changed.size} of the {width} guard bytes {side} changed, the "
                f"nearest {changed[0]} bytes away (element {changed[0] // whole.dtype.itemsize}; output "
                f"{tuple(view.shape)} {whole.dtype}): an out-of-bounds write, which the values compared do not show")


@contextlib.contextmanager
def guarding(backend, what: str):
    """Inside, every array the backend's `empty` and `full` allocate (an engine block's workspace and its KV
    cache pages: what the layer rung's ops write) is a view between guard bands, `empty`'s filled with the
    sentinel; on leaving without an error, every band is checked, and the first changed one fails naming
    `what` and the buffer. Leaves the backend as it was."""
    made = []  # their own list: the outputs' table (`host`) neither keeps nor evicts for them

    def keep(a):
        made.append(_banded(backend, a))
        return made[-1][0]

    backend.empty = lambda shape, dtype: keep(_filled(shape, dtype))
    backend.full = lambda shape, value, dtype: keep(np.full(shape, value, np.dtype(dtype)))
    try:
        yield
    finally:
        del backend.empty, backend.full  # the class's own again
    backend.synchronize()
    for entry in made:
        _check_bands(backend, entry, f"{what} wrote outside a buffer")


def dev(backend, *arrays):
    """Host arrays -> the backend's arrays (one or a tuple): the inputs an op reads. Each sits at the front
    of a buffer whose next GUARD_BYTES hold NaN (floats) or the int sentinel, so a kernel that reads past
    an input's end (a tail block's last chunk, a loop bound one too far) reads a value the checks do not
    let through, where a bare allocation's slack would hold zeros or a stale number that could pass."""
    out = tuple(_trailed(backend, a) for a in arrays)
    return out[0] if len(out) == 1 else out


def _trailed(backend, a):
    a = np.ascontiguousarray(a)
    if a.dtype.kind not in "fiu" or a.size == 0 or under_memcheck():
        # Under memcheck (CuPy's pool off) an input is its own allocation, ending where the array ends: a
        # read past it is an access memcheck reports, where the NaN band shows it only when the value
        # reaches an output (an over-read into a slot that is overwritten before use passes the bands).
        return backend.asarray(a)
    buf = _filled(a.size + GUARD_BYTES // a.itemsize, a.dtype)
    buf[:a.size] = a.reshape(-1)
    return backend.asarray(buf)[:a.size].reshape(a.shape)


def host(backend, a, op: str | None = None) -> np.ndarray:
    """Array `a` on the host, after its guard bands are checked (`guarded`); `op` wrote it (for the message)."""
    backend.synchronize()
    check_guards(backend, a, op)
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
