"""Compile every CUDA module of this folder once (cupy.RawModule, sm_90a) and hand out its kernels.

Each `.cu` file is one module (MODULES: every `.cu` here, found by name). A line `#include "x.cuh"`
naming a header of this folder is replaced by the header's text, recursively and once per module (the
header's `#pragma once` is honoured by the loader itself), so CuPy's on-disk kernel cache, keyed by the
source text, sees a change to any header. Every `extern "C" __global__` function is fetched right
away, which forces compilation at backend creation, before any CUDA graph capture (compiling inside a
capture would fail). Entry-point names are global across modules: a name defined twice is an error.

Each kernel is handed out behind a thin `Entry` that reports its launch to kernels/base.py's observer
when one is set (the ladder's launch map: which case ran which kernel) and otherwise only calls it. A
captured CUDA graph replays without Python, so the wrapper costs nothing on the decode path.

Programmatic dependent launch (common.cuh says what a kernel must do for it): while `PDL["on"]` (the
backend's `pdl` setting) and the current stream is being captured into a CUDA graph (the decode step),
an entry point whose source waits for its predecessor (`pdl_wait()`, in its own body or in a function
it calls: `waits`) is launched through the driver's cuLaunchKernelEx with the programmatic-stream-
serialization attribute, which the capture records as a programmatic edge: in a replay the kernel may
start while the one before it ends. Any other launch goes through CuPy as usual (eagerly, the host's
launch cost hides the overlap anyway, and CuPy's launch path is the faster one).

Tensor maps (`tensor_map_2d`): the 128-byte CUtensorMap a TMA copy reads (mma.cuh's TmaMap), encoded by
the driver's cuTensorMapEncodeTiled and passed to the kernel by value.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from kernels import base

HERE = Path(__file__).resolve().parent
MODULES = tuple(sorted(p.stem for p in HERE.glob("*.cu")))
OPTIONS = ("-std=c++17", "--gpu-architecture=sm_90a")
_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([\w.]+\.cuh)"[ \t]*$', re.M)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#pragma[ \t]+once[ \t]*$", re.M)
# an entry point: its attributes (`__launch_bounds__(N)`, `__cluster_dims__(X, Y, Z)`), then its name
_ENTRY = re.compile(r'extern "C" __global__ void((?:\s+__\w+__\([^)]*\))*)\s+(\w+)\s*\(')

_CACHE: dict = {}  # kernel name -> Entry


PDL = {"on": True}  # launch the entry points that wait with programmatic dependent launch (CudaBackend.pdl)


class Entry:
    """A compiled kernel (cupy.RawKernel) that reports its launches to the observer, if any. `waits`: its
    source calls pdl_wait() before touching what earlier kernels wrote, so it may be launched early."""

    __slots__ = ("name", "unit", "kernel", "waits")

    def __init__(self, name: str, kernel, waits: bool = False):
        self.name, self.unit, self.kernel, self.waits = name, f"kernels/cuda::{name}", kernel, waits

    def __call__(self, grid, block, args, *, shared_mem: int = 0):
        sink = base.launch_observer()
        if sink is not None:
            sink.add(self.unit)
        if self.waits and PDL["on"] and _capturing():
            return _launch_programmatic(self.kernel, grid, block, args, shared_mem)
        return self.kernel(grid, block, args, shared_mem=shared_mem)

    def __getattr__(self, attr):  # attributes, max_threads_per_block, ...: the RawKernel's own
        return getattr(self.kernel, attr)


def _capturing() -> bool:
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


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
    return [m.group(2) for m in _ENTRY.finditer((HERE / f"{module}.cu").read_text())]


def entry_attributes(module: str) -> dict[str, str]:
    """Each entry point of `module`.cu -> the attributes written between `void` and its name ("" for none)."""
    return {m.group(2): m.group(1).strip() for m in _ENTRY.finditer((HERE / f"{module}.cu").read_text())}


def duplicate_entry_points() -> dict[str, list[str]]:
    """Entry-point name -> the modules defining it, for every name defined by more than one module."""
    where: dict[str, list[str]] = {}
    for module in MODULES:
        for name in entry_points(module):
            where.setdefault(name, []).append(module)
    return {name: mods for name, mods in where.items() if len(mods) > 1}


def compile_all() -> None:
    """Run NVRTC on every module at once, one thread each, into CuPy's on-disk kernel cache (the backend's
    warm-up, before any test worker starts). int4_sym_g128's template variants are the longest (nvcc: 9 s
    of the 30 for all of them, one after another). Measured in the nightly on a fresh H200 machine, the
    unit rung's time before pytest's clock starts (the warm-up most of it) went from 15.8 s to 12.2 s.
    Loading stays in `kernels()`, on the calling thread's device; what a thread here loads is dropped."""
    import cupy
    from concurrent.futures import ThreadPoolExecutor

    def one(module: str) -> None:
        names = entry_points(module)
        if names:  # fetching one kernel compiles the module (through the cache) and loads it
            cupy.RawModule(code=source(module), options=OPTIONS).get_function(names[0])

    with ThreadPoolExecutor(len(MODULES)) as pool:
        list(pool.map(one, MODULES))  # list(): a module NVRTC refuses raises here, naming its error


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
            waiting = waiting_entry_points(module)
            for name in entry_points(module):
                # compiles the module (once) and loads it
                found[name] = Entry(name, mod.get_function(name), waits=name in waiting)
        _CACHE.update(found)
    return _CACHE


# ---- which entry points wait for their predecessor ----------------------------------------------------

_DEVICE_FN = re.compile(r"__device__[^;{}]*?\b(\w+)\s*\([^;{}]*\)\s*(?:const\s*)?\{")
_CALL = re.compile(r"\b(\w+)\s*(?:<[^;(){}]*>)?\s*\(")


def _body(text: str, open_brace: int) -> str:
    """The text between the brace at `open_brace` and its match."""
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1:i]
    raise RuntimeError("kernels/cuda: unbalanced braces")


def waiting_entry_points(module: str) -> set[str]:
    """The entry points of `module` whose body calls pdl_wait(), directly or through the device functions
    it calls (transitively), as the loader gives the module to NVRTC (headers inlined)."""
    return waiting_in(source(module))


def waiting_in(cuda_source: str) -> set[str]:
    """`waiting_entry_points` of a CUDA source text."""
    text = re.sub(r"//[^\n]*", "", cuda_source)  # comments name functions too
    bodies = {m.group(1): _body(text, m.end() - 1) for m in _DEVICE_FN.finditer(text)}
    waits = {"pdl_wait"}
    changed = True
    while changed:  # a function waits when it calls one that waits
        changed = False
        for name, body in bodies.items():
            if name not in waits and any(c in waits for c in _CALL.findall(body)):
                waits.add(name)
                changed = True
    found = set()
    for m in _ENTRY.finditer(text):
        body = _body(text, text.index("{", m.end()))
        if any(c in waits for c in _CALL.findall(body)):
            found.add(m.group(2))
    return found


# ---- the launch with the programmatic-serialization attribute ------------------------------------------

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_DRIVER: list = []


def _driver():
    if not _DRIVER:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                                               u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        _DRIVER.append(lib)
    return _DRIVER[0]


def _error_name(err: int) -> str:
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(err, ctypes.byref(name))
    return (name.value or b"?").decode()


# ---- tensor maps (TMA) ------------------------------------------------------------------------------

# cuda.h's enums: CU_TENSOR_MAP_DATA_TYPE_FLOAT16, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
# CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE (out-of-bounds elements read as zeros)
_TMA_F16, _TMA_NO_INTERLEAVE, _TMA_SWIZZLE_128B, _TMA_L2_256B, _TMA_OOB_ZERO = 6, 0, 3, 3, 0
_TMA_MAPS: dict = {}  # (address, rows, cols, box) -> the encoded map; an address is a scratch buffer, reused


def tensor_map_2d(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int):
    """The tensor map of a row-major fp16 [rows, cols] array at device address `ptr`, read in boxes of
    box_rows x box_cols with the 128-byte swizzle (box_cols * 2 = 128 bytes: one swizzle atom a box row),
    as a one-element NumPy array of CUtensorMap's 128 bytes: CuPy passes it by value (a `const
    __grid_constant__ TmaMap` parameter). Encoded once per (address, shape, box); the driver checks the
    alignments (address and row pitch multiples of 16 bytes) and sizes, and a refusal is a RuntimeError
    naming its error."""
    import numpy as np

    key = (int(ptr), int(rows), int(cols), int(box_rows), int(box_cols))
    found = _TMA_MAPS.get(key)
    if found is not None:
        return found
    raw = np.zeros(32, np.uint64)  # the driver writes the map at a 128-byte aligned address inside it
    at = (-raw.ctypes.data % 128) // 8
    u64s, u32s = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    err = _driver().cuTensorMapEncodeTiled(
        raw.ctypes.data + 8 * at, _TMA_F16, 2, ctypes.c_void_p(key[0]), u64s(cols, rows), u64s(2 * cols, 0),
        u32s(box_cols, box_rows), u32s(1, 1), _TMA_NO_INTERLEAVE, _TMA_SWIZZLE_128B, _TMA_L2_256B, _TMA_OOB_ZERO)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled of fp16 [{rows}, {cols}] in {box_rows} x {box_cols} boxes "
                           f"failed: {_error_name(err)} ({err})")
    found = raw[at:at + 16].copy().view(np.dtype({"names": ["opaque"], "formats": [(np.uint64, (16,))]}))
    if len(_TMA_MAPS) >= 256:  # prefill shapes vary with the prompt's length
        _TMA_MAPS.clear()
    _TMA_MAPS[key] = found
    return found


def _dims(d) -> tuple[int, int, int]:
    d = tuple(d) if isinstance(d, (tuple, list)) else (d,)
    return (tuple(int(v) for v in d) + (1, 1, 1))[:3]


def _argument(a):
    """One kernel argument as the driver reads it: a device pointer for an array, the bytes of a NumPy
    scalar (np.int32, np.float32, np.uint64, ...) as they are."""
    import cupy
    import numpy as np

    if isinstance(a, cupy.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.generic) or (isinstance(a, np.ndarray) and a.dtype.names and a.size == 1):
        return (ctypes.c_char * a.nbytes).from_buffer_copy(a.tobytes())  # a scalar, or a struct (tensor_map_2d)
    raise TypeError(f"kernel argument {a!r}: pass a CuPy array, a NumPy scalar (its width is the kernel's) "
                    f"or a one-element structured NumPy array")


def _launch_programmatic(kernel, grid, block, args, shared_mem: int) -> None:
    """kernel<<<grid, block, shared_mem, current stream>>>(args) with programmatic stream serialization."""
    import cupy

    fn = getattr(kernel, "kernel", kernel)  # RawKernel -> its loaded cupy.cuda.Function
    values = [_argument(a) for a in args]
    params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    (gx, gy, gz), (bx, by, bz) = _dims(grid), _dims(block)
    cfg = _LaunchConfig(gx, gy, gz, bx, by, bz, int(shared_mem), cupy.cuda.get_current_stream().ptr,
                        ctypes.pointer(attr), 1)
    err = _driver().cuLaunchKernelEx(ctypes.byref(cfg), fn.ptr, params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx of {getattr(fn, 'name', kernel)!r} failed: {_error_name(err)} ({err})")
