"""How many threads NumPy's BLAS may use inside the NumPy backend's matmuls.

A decode step's GEMVs are small (a 0.5 B model's q/k/v weight is 4 MB in fp32) and OpenBLAS threads
busy-wait for each other: with more BLAS threads than free cores (pytest-xdist workers, a torch
reference in the same process, or anyone else on the machine) one such GEMV measured 50x slower than on
one thread (bench/NOTES.md). So the backend sets the count around each of its matmuls and restores it
after, leaving every other NumPy user of the process as it was.

`blas_threads(n)` is that context manager. It finds OpenBLAS among the libraries the process has mapped
(NumPy's wheels bundle it, under a `scipy_` prefix and a `64_` suffix in the ILP64 build) and calls
its `*_set_num_threads*`; with another BLAS (MKL, Accelerate) it does nothing, and `available()` says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

_API: tuple | None = None  # (get, set) once looked up; () where no OpenBLAS was found


def _lookup() -> tuple:
    global _API
    if _API is not None:
        return _API
    _API = ()
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return _API
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", "_64_", ""):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and set_ is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    set_.restype, set_.argtypes = None, [ctypes.c_int]
                    _API = (get, set_)
                    return _API
    return _API


def available() -> bool:
    """Whether NumPy's BLAS is an OpenBLAS whose thread count this module can set (NumPy, imported by
    the package, has mapped its BLAS by now)."""
    return bool(_lookup())


def current() -> int | None:
    """OpenBLAS's thread count now, or None where it cannot be read."""
    api = _lookup()
    return int(api[0]()) if api else None


def default_threads() -> int:
    """NANOQWEN_NUMPY_THREADS if set, else this process's share of the CPUs it may run on: all of them,
    divided among pytest-xdist's workers when it runs as one."""
    env = os.environ.get("NANOQWEN_NUMPY_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"NANOQWEN_NUMPY_THREADS={env!r} is not a whole number of threads") from None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, cpus // max(1, workers))


@contextlib.contextmanager
def blas_threads(n: int | None):
    """Run the block with OpenBLAS on `n` threads (None, or no OpenBLAS: leave it as it is)."""
    api = _lookup() if n else ()
    if not api:
        yield
        return
    get, set_ = api
    before = get()
    if before == n:
        yield
        return
    set_(n)
    try:
        yield
    finally:
        set_(before)
