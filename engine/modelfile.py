"""The `.nanoqwen` file, version 1: writer and memory-mapped reader (layout in docs/FORMAT.md).

    offset 0   8 bytes   magic  b"NANOQWEN"  (4E 41 4E 4F 51 57 45 4E)
    offset 8   u32 LE    version (1)
    offset 12  u64 LE    header length N
    offset 20  N bytes   JSON header (UTF-8): config, quant, tensor table, embedded files
    ...        data      each tensor at an offset that is a multiple of 64, little-endian, C order

The reader trusts nothing: every malformed case raises its own `ModelFileError` subclass, naming the
file and the problem, before a tensor is handed out. The writer writes a temporary file named after
its process (engine/outpath.py) and renames it over `PATH`, so a crash never leaves a half-written
model under the real name, and a killed writer's leftover is removed by the next writer.

The writer produces tensors on `threads` worker threads (NumPy releases the GIL in its array work, so
the quantization of a 7B model's linears spreads over the cores) and writes them, from the calling
thread, in the file's order: the bytes are those of a one-thread write, and at most a few tensors per
worker are produced and not yet written (`ordered_map`). `worker_threads()` is the converter's count:
the cores, at most 16, or NANOQWEN_CONVERT_THREADS.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import mmap
import os
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

import engine.errors as E
from engine.outpath import signals_deferred

MAGIC = b"NANOQWEN"
VERSION = 1
PREAMBLE = struct.Struct("<8sIQ")  # magic, version, header length: 20 bytes
ALIGN = 64
# The 7B model's header is about 100 KiB (some 540 table entries): 8 MiB is 80x that, and bounds what
# parsing a hostile header can cost (json holds up to ~26 bytes per byte of `{}` soup: ~210 MB).
MAX_HEADER = 8 << 20  # a header past 8 MiB is not a header; refuse before allocating it
DTYPES = {"float16": np.float16, "float32": np.float32, "uint32": np.uint32, "int32": np.int32,
          "uint8": np.uint8, "int8": np.int8}


def checksum(buf) -> str:
    """crc32 of the bytes, as stored in the tensor table (`crc32:xxxxxxxx`, fixed width)."""
    crc = 0
    view = memoryview(buf).cast("B")
    for i in range(0, len(view), 1 << 26):  # 64 MiB at a time keeps big tensors off a second copy
        crc = zlib.crc32(view[i: i + (1 << 26)], crc)
    return f"crc32:{crc:08x}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --- worker threads -----------------------------------------------------------------------------

THREADS_VARIABLE = "NANOQWEN_CONVERT_THREADS"
MAX_THREADS = 16  # past this, a conversion waits on the disk and memory, not on the cores


class ThreadCountError(E.NanoqwenError):
    """NANOQWEN_CONVERT_THREADS set to something other than a positive integer."""


def worker_threads() -> int:
    """How many threads produce tensors: NANOQWEN_CONVERT_THREADS if set, else the cores this process may
    run on, at most 16."""
    text = os.environ.get(THREADS_VARIABLE, "").strip()
    if not text:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, min(cores or 1, MAX_THREADS))
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ThreadCountError(f"{THREADS_VARIABLE} is {E.brief(text)}; give a positive integer (the "
                               f"conversion's worker threads)")
    return n


T = TypeVar("T")
R = TypeVar("R")


@contextlib.contextmanager
def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int,
                ahead: int | None = None) -> Iterator[Iterator[R]]:
    """`with ordered_map(fn, items, threads) as results:` `fn(item)` for each item, in the items' order,
    computed on `threads` worker threads (one thread: in the caller's, as a plain loop).

    At most `ahead` items (twice the threads by default) are submitted and not yet taken, so memory
    stays near that many results however long `items` is. An exception from `fn` is raised when its
    item's turn comes (the earlier items' results were all handed out, as in a plain loop); leaving the
    block, normally or not (an error, Ctrl-C, SIGTERM made an exception), cancels the items not started
    and waits for the running ones, so no thread outlives it."""
    if threads <= 1:
        yield (fn(item) for item in items)
        return
    ahead = max(1, ahead or 2 * threads)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nanoqwen-worker")
    pending: collections.deque = collections.deque()

    # The pool's calls run with Ctrl-C and SIGTERM held back (engine/outpath.py `signals_deferred`): an
    # exception raised inside the pool's own code could leave one of its locks held, and the shutdown
    # below would then wait forever. They are raised between items instead, in this caller's code.
    def submit(item):
        with signals_deferred():
            pending.append(pool.submit(fn, item))

    def next_result():
        with signals_deferred():
            future = pending.popleft()
            return future.result()

    def results():
        for item in items:
            submit(item)
            if len(pending) >= ahead:
                yield next_result()
        while pending:
            yield next_result()

    try:
        yield results()
    finally:
        with signals_deferred():
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True, cancel_futures=True)


# --- writing ------------------------------------------------------------------------------------


@dataclass
class PendingTensor:
    """A tensor to write: its table entry is known up front, its data is produced when written.

    Consecutive tensors with the same `group` (not None) are produced by one thread, one after the
    other, in the file's order: the tensors one computation makes together (a quantized linear's
    qweight and scales) share it, so that no worker waits on another's half of the work."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]
    group: object = None

    @property
    def length(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(DTYPES[self.dtype]).itemsize


def write_model(path, config: dict, quant: str, tensors: Iterable[PendingTensor],
                files: dict[str, bytes] | None = None, progress=None, threads: int = 1) -> None:
    """Write a .nanoqwen file atomically. `progress(i, n, name)` is called after each tensor is written,
    from the calling thread.

    An output path that cannot be written is an OutputPathError before any tensor is produced. The
    data goes to a temporary file (engine/outpath.py) renamed over `path` at the end; an error, Ctrl-C
    or SIGTERM removes it, and stale ones a killed writer left in the folder are removed first.
    `threads` worker threads produce the tensors (and their checksums); the file's bytes do not depend
    on how many.
    """
    from engine.outpath import check_output_path, open_temp, remove_stale_temp_files, removing_on_termination, temp_path

    path = Path(path)
    tensors = list(tensors)
    files = dict(files or {})
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")
    for t in tensors:
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {t.name}: unsupported dtype {t.dtype}")

    def header_bytes(table, file_table, data_start):
        h = {"format": "nanoqwen", "version": VERSION, "quant": quant, "config": config,
             "data_start": data_start, "tensors": table, "files": file_table}
        return json.dumps(h, indent=1).encode()

    # Lay out the data twice: once with placeholder checksums to size the header (checksums are fixed
    # width, so the real header has the same length), then for real.
    placeholder = "crc32:00000000"
    for _ in range(2):
        hdr_len = len(header_bytes(*_layout(tensors, files, 0, placeholder)))
        data_start = _align(PREAMBLE.size + hdr_len + 64)  # a little slack for offset digits
        table, file_table, _ = _layout(tensors, files, data_start, placeholder)
        if len(header_bytes(table, file_table, data_start)) + PREAMBLE.size <= data_start:
            break
    else:  # pragma: no cover - the slack above always suffices
        raise RuntimeError("header layout did not converge")

    # Refuse an unwritable path and create the temporary file before the first tensor is produced.
    check_output_path(path)
    remove_stale_temp_files(path.parent)
    tmp = temp_path(path)

    def put(f, offset, data):
        try:
            f.seek(offset)
            f.write(data)
        except OSError as e:
            raise E.OutputPathError(path, f"cannot write {tmp.name} ({e.strerror or e})") from None

    def produce(group: list[int]):  # on a worker thread: the group's bytes and their checksums
        return group, [_produced_bytes(tensors[i]) for i in group]

    with removing_on_termination():
        try:
            with open_temp(tmp, path) as f:
                put(f, 0, b"\0" * data_start)
                written = 0
                with ordered_map(produce, _groups(tensors), threads) as produced:
                    for group, results in produced:
                        for i, (data, crc) in zip(group, results):
                            put(f, table[i]["offset"], data)
                            table[i]["checksum"] = crc
                            written += 1
                            if progress:
                                progress(written, len(tensors), tensors[i].name)
                for entry in file_table:
                    data = files[entry["name"]]
                    put(f, entry["offset"], data)
                    entry["checksum"] = checksum(data)
                hdr = header_bytes(table, file_table, data_start)
                put(f, 0, PREAMBLE.pack(MAGIC, VERSION, len(hdr)) + hdr)
                try:
                    f.truncate(max([e["offset"] + e["length"] for e in table + file_table], default=data_start))
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    raise E.OutputPathError(path, f"cannot write {tmp.name} ({e.strerror or e})") from None
            try:
                os.replace(tmp, path)
            except OSError as e:
                raise E.OutputPathError(path, f"cannot rename {tmp.name} over it ({e.strerror or e})") from None
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass


def _groups(tensors: list[PendingTensor]) -> list[list[int]]:
    """The tensors' indices, consecutive ones of one `group` together (each other tensor alone)."""
    groups: list[list[int]] = []
    for i, t in enumerate(tensors):
        if groups and t.group is not None and tensors[groups[-1][-1]].group == t.group:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _produced_bytes(t: PendingTensor):
    """(the tensor's little-endian bytes, as an array viewing them, and their checksum)."""
    arr = np.ascontiguousarray(t.produce(), dtype=DTYPES[t.dtype])
    if tuple(arr.shape) != tuple(t.shape):
        raise ValueError(f"tensor {t.name}: produced shape {arr.shape}, declared {t.shape}")
    data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)
    return data, checksum(data)


def _layout(tensors, files, start, placeholder):
    table, file_table, off = [], [], start
    for t in tensors:
        table.append({"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": off,
                      "length": t.length, "checksum": placeholder})
        off = _align(off + t.length)
    for name, data in files.items():
        file_table.append({"name": name, "offset": off, "length": len(data), "checksum": placeholder})
        off = _align(off + len(data))
    return table, file_table, off


# --- reading ------------------------------------------------------------------------------------

MAX_DEPTH = 32  # JSON nesting a header may have (the writer's is 4)
MAX_RANK = 8  # dimensions of a tensor
MAX_INT = 2**63 - 1  # offsets, lengths and dimensions are u64-safe integers
_CHECKSUM = re.compile(r"crc32:[0-9a-f]{8}")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def parse_header(raw: bytes):
    """The header's JSON value: ValueError if it is not UTF-8 JSON, RecursionError if it nests deeper
    than MAX_DEPTH.

    json.loads stops a deep header with RecursionError after about a thousand levels, so 100,000
    levels cost next to nothing. A header that parses, and whose bracket nesting (counted linearly,
    strings included) passes MAX_DEPTH, is measured exactly and iteratively: nothing nested deeper than
    MAX_DEPTH reaches code that recurses over it (printing, comparing)."""
    value = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    if _bracket_depth(raw) > MAX_DEPTH:
        stack = [(value, 1)]
        while stack:
            v, depth = stack.pop()
            if isinstance(v, (dict, list)):
                if depth > MAX_DEPTH:
                    raise RecursionError(f"JSON nested deeper than {MAX_DEPTH} levels")
                stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return value


def _bracket_depth(text: bytes) -> int:
    steps = np.frombuffer(text.translate(None, _NOT_BRACKET).translate(_BRACKET_STEP), dtype=np.int8)
    depth, deepest = 0, 0
    for i in range(0, len(steps), 1 << 16):  # 256 KiB of int32 at a time
        run = np.cumsum(steps[i: i + (1 << 16)], dtype=np.int32)
        run += depth
        deepest = max(deepest, int(run.max()))
        depth = int(run[-1])
    return deepest


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number a header may hold")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    checksum: str


def _is_int(v) -> bool:
    return type(v) is int  # not bool, not float


class ModelFile:
    """A validated, memory-mapped .nanoqwen file. `tensor(name)` returns a read-only view of the map.

    Every field of the header is checked for type and range before use. The descriptor opened to
    read the file is closed once the map is made (the map holds its own until it goes). `close()`
    (or a `with` block) unmaps the file when no array still views it; otherwise the map goes with
    the last such array."""

    def __init__(self, path, verify_checksums: bool = True):
        self.path = Path(path)
        self._map = None
        p = self.path
        try:
            fh = open(p, "rb")
        except OSError as e:
            raise E.ModelFileError(p, f"cannot open ({e.strerror or e})") from None
        with fh:
            try:
                size = os.fstat(fh.fileno()).st_size
                pre = fh.read(PREAMBLE.size)
            except OSError as e:
                raise E.ModelFileError(p, f"cannot read ({e.strerror or e})") from None
            if len(pre) < len(MAGIC) and MAGIC.startswith(pre):
                raise E.TruncatedFileError(p, f"file is {size} bytes, shorter than the 8-byte magic")
            if pre[:8] != MAGIC:
                raise E.BadMagicError(p, f"bad magic {pre[:8]!r}: not a .nanoqwen file (expected {MAGIC!r})")
            if len(pre) < PREAMBLE.size:
                raise E.TruncatedFileError(p, f"file is {size} bytes, shorter than the {PREAMBLE.size}-byte preamble")
            _, version, hdr_len = PREAMBLE.unpack(pre)
            if version != VERSION:
                raise E.UnsupportedVersionError(p, f"format version {version}; this reader knows version {VERSION}")
            if hdr_len > MAX_HEADER:
                raise E.HeaderTooLargeError(p, f"header length field is {hdr_len} bytes, over the {MAX_HEADER}-byte limit")
            if PREAMBLE.size + hdr_len > size:
                raise E.TruncatedFileError(p, f"header claims {hdr_len} bytes but only {size - PREAMBLE.size} follow the preamble")
            try:
                raw = fh.read(hdr_len)
                # The map keeps the file reachable after the descriptor is closed (leaving `with`).
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise E.ModelFileError(p, f"cannot read or map ({getattr(e, 'strerror', None) or e})") from None
        if len(raw) != hdr_len or len(self._map) != size:
            self.close()
            raise E.TruncatedFileError(p, "file changed size while being read")
        try:
            self._read_header(raw, size, hdr_len, verify_checksums)
        except BaseException:
            self.close()
            raise

    def _read_header(self, raw: bytes, size: int, hdr_len: int, verify_checksums: bool) -> None:
        p = self.path
        try:
            header = parse_header(raw)
        except RecursionError:
            raise E.HeaderError(p, f"header nests JSON deeper than {MAX_DEPTH} levels") from None
        except ValueError as e:  # UnicodeDecodeError is one
            raise E.HeaderError(p, f"header is not valid JSON ({E.one_line(e, 120)})") from None
        if not isinstance(header, dict):
            raise E.HeaderError(p, f"header is not a JSON object (it is a {type(header).__name__})")
        for key, kind, what in (("config", dict, "JSON object"), ("quant", str, "string"), ("tensors", list, "list"),
                                ("files", list, "list")):
            value = header.get(key, [] if key == "files" else None)  # a model may embed no file
            if not isinstance(value, kind):
                raise E.HeaderError(p, f"header field {key!r} is missing or not a {what} (got {E.brief(value)})")
        if not _is_int(header.get("version")) or header["version"] != VERSION:
            raise E.HeaderError(p, f"header field 'version' is {E.brief(header.get('version'))}; expected {VERSION}")
        if header.get("format", "nanoqwen") != "nanoqwen":
            raise E.HeaderError(p, f"header field 'format' is {E.brief(header['format'])}; expected 'nanoqwen'")
        data_floor = PREAMBLE.size + hdr_len
        start = header.get("data_start", data_floor)
        if not _is_int(start) or not data_floor <= start <= size:
            raise E.HeaderError(p, f"header field 'data_start' is {E.brief(start)}; expected an integer in "
                                   f"[{data_floor}, {size}]")
        self.header = header
        self.quant: str = header["quant"]
        self.config_dict: dict = header["config"]
        self.size = size
        self.tensors = self._table(header["tensors"], "tensors", data_floor, typed=True)
        self.files = self._table(header.get("files", []), "files", data_floor, typed=False)
        spans = sorted((e.offset, e.offset + e.length, e.name) for e in [*self.tensors.values(), *self.files.values()])
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise E.TensorBoundsError(p, f"tensors {an!r} and {bn!r} overlap")
        if verify_checksums:
            with memoryview(self._map) as view:
                for e in [*self.tensors.values(), *self.files.values()]:
                    got = checksum(view[e.offset: e.offset + e.length])
                    if got != e.checksum:
                        raise E.ChecksumMismatchError(p, f"tensor {e.name!r}: checksum {got} does not match the "
                                                         f"header's {e.checksum}")

    def _table(self, entries: list, key: str, data_floor: int, typed: bool) -> dict[str, TensorEntry]:
        table: dict[str, TensorEntry] = {}
        for i, d in enumerate(entries):
            e = self._entry(d, f"{key}[{i}]", data_floor, typed)
            if e.name in table:
                raise E.HeaderError(self.path, f"header field {key!r} names {e.name!r} twice")
            table[e.name] = e
        return table

    def _entry(self, d, where: str, data_floor: int, typed: bool) -> TensorEntry:
        p = self.path
        if not isinstance(d, dict):
            raise E.HeaderError(p, f"{where} is not a JSON object (got {E.brief(d)})")
        keys = ("name", "dtype", "shape", "offset", "length", "checksum") if typed else ("name", "offset", "length", "checksum")
        missing = [k for k in keys if k not in d]
        if missing:
            raise E.HeaderError(p, f"{where} lacks {', '.join(map(repr, missing))} ({E.brief(d)})")
        name = d["name"]
        if not isinstance(name, str) or not name:
            raise E.HeaderError(p, f"{where}: 'name' is {E.brief(name)}, not a non-empty string")
        for key in ("offset", "length"):
            if not _is_int(d[key]):
                raise E.HeaderError(p, f"tensor {name!r}: {key!r} is {E.brief(d[key])}, not an integer")
            if not 0 <= d[key] <= MAX_INT:
                raise E.TensorBoundsError(p, f"tensor {name!r}: {key} {d[key]} is outside [0, 2**63)")
        offset, length = d["offset"], d["length"]
        if not isinstance(d["checksum"], str) or not _CHECKSUM.fullmatch(d["checksum"]):
            raise E.HeaderError(p, f"tensor {name!r}: 'checksum' is {E.brief(d['checksum'])}, not 'crc32:' "
                                   f"and 8 lowercase hex digits")
        dtype, shape = "uint8", (length,)
        if typed:
            dtype, shape = d["dtype"], d["shape"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise E.DTypeMismatchError(p, f"tensor {name!r}: unknown dtype {E.brief(dtype)}")
            if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_int(s) for s in shape):
                raise E.HeaderError(p, f"tensor {name!r}: 'shape' is {E.brief(shape)}, not a list of at most "
                                       f"{MAX_RANK} integers")
            if any(not 0 <= s <= MAX_INT for s in shape):
                raise E.ShapeMismatchError(p, f"tensor {name!r}: shape {E.brief(shape)} has a dimension outside [0, 2**63)")
            shape = tuple(shape)
            expect = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
            if expect != length:
                raise E.ShapeMismatchError(p, f"tensor {name!r}: shape {E.brief(list(shape))} of {dtype} is "
                                              f"{E.brief(expect)} bytes, table says {length}")
        if offset < data_floor:
            raise E.TensorBoundsError(p, f"tensor {name!r}: offset {offset} lies inside the header (data starts at {data_floor})")
        if offset % ALIGN:
            raise E.TensorBoundsError(p, f"tensor {name!r}: offset {offset} is not {ALIGN}-byte aligned")
        if offset + length > self.size:
            raise E.TruncatedFileError(p, f"tensor {name!r} ends at byte {offset + length}, past the end of the "
                                          f"{self.size}-byte file (truncated?)")
        return TensorEntry(name, dtype, shape, offset, length, d["checksum"])

    # --- use ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the file, unless arrays still view it (then it is unmapped with the last of them)."""
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass

    def __enter__(self) -> "ModelFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _mapped(self):
        if self._map is None:
            raise ValueError(f"{self.path}: the model file is closed")
        return self._map

    def tensor(self, name: str) -> np.ndarray:
        try:
            e = self.tensors[name]
        except KeyError:
            raise E.MissingTensorError(self.path, f"tensor {name!r} is not in the file") from None
        dt = np.dtype(DTYPES[e.dtype]).newbyteorder("<")
        return np.frombuffer(self._mapped(), dtype=dt, count=e.length // dt.itemsize, offset=e.offset).reshape(e.shape)

    def check(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        """Refuse unless the table holds `name` with this dtype and shape (nothing is read)."""
        e = self.tensors.get(name)
        if e is None:
            raise E.MissingTensorError(self.path, f"tensor {name!r} is required by the config but not in the file")
        if e.dtype != dtype:
            raise E.DTypeMismatchError(self.path, f"tensor {name!r} is {e.dtype}, expected {dtype}")
        if tuple(e.shape) != tuple(shape):
            raise E.ShapeMismatchError(self.path, f"tensor {name!r} has shape {list(e.shape)}, expected {list(shape)}")

    def expect(self, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor, after checking it has the dtype and shape the config requires."""
        self.check(name, dtype, shape)
        return self.tensor(name)

    def file(self, name: str) -> bytes | None:
        e = self.files.get(name)
        return None if e is None else bytes(self._mapped()[e.offset: e.offset + e.length])

