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
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from engine import errors as E

MAGIC = b"NANOQWEN"
VERSION = 1
PREAMBLE = struct.Struct("<8sIQ")  # magic, version, header length: 20 bytes
ALIGN = 64
MAX_HEADER = 64 << 20  # a header past 64 MiB is not a header; refuse before allocating it
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


# --- writing ------------------------------------------------------------------------------------


@dataclass
class PendingTensor:
    """A tensor to write: its table entry is known up front, its data is produced when written."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def length(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(DTYPES[self.dtype]).itemsize


def write_model(path, config: dict, quant: str, tensors: Iterable[PendingTensor],
                files: dict[str, bytes] | None = None, progress=None) -> None:
    """Write a .nanoqwen file atomically. `progress(i, n, name)` is called after each tensor.

    An output path that cannot be written is an OutputPathError before any tensor is produced. The
    data goes to a temporary file (engine/outpath.py) renamed over `path` at the end; an error, Ctrl-C
    or SIGTERM removes it, and stale ones a killed writer left in the folder are removed first.
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

    with removing_on_termination():
        try:
            with open_temp(tmp, path) as f:
                put(f, 0, b"\0" * data_start)
                for i, (t, entry) in enumerate(zip(tensors, table)):
                    arr = np.ascontiguousarray(t.produce(), dtype=DTYPES[t.dtype])
                    if tuple(arr.shape) != tuple(t.shape):
                        raise ValueError(f"tensor {t.name}: produced shape {arr.shape}, declared {t.shape}")
                    data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
                    put(f, entry["offset"], data)
                    entry["checksum"] = checksum(data)
                    if progress:
                        progress(i + 1, len(tensors), t.name)
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


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    checksum: str


class ModelFile:
    """A validated, memory-mapped .nanoqwen file. `tensor(name)` returns a read-only view of the map."""

    def __init__(self, path, verify_checksums: bool = True):
        self.path = Path(path)
        p = self.path
        try:
            size = p.stat().st_size
            fh = open(p, "rb")
        except OSError as e:
            raise E.ModelFileError(p, f"cannot open ({e.strerror or e})") from None
        with fh:
            pre = fh.read(PREAMBLE.size)
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
            raw = fh.read(hdr_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise E.HeaderError(p, f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise E.HeaderError(p, "header is not a JSON object")
        for key, kind in (("config", dict), ("quant", str), ("tensors", list)):
            if not isinstance(header.get(key), kind):
                raise E.HeaderError(p, f"header field {key!r} is missing or not a {kind.__name__}")
        self.header = header
        self.quant: str = header["quant"]
        self.config_dict: dict = header["config"]
        self.size = size
        data_floor = PREAMBLE.size + hdr_len
        self.tensors = {e.name: e for e in (self._entry(d, data_floor, typed=True) for d in header["tensors"])}
        if len(self.tensors) != len(header["tensors"]):
            raise E.HeaderError(p, "tensor table names a tensor twice")
        self.files = {e.name: e for e in (self._entry(d, data_floor, typed=False) for d in header.get("files", []))}
        spans = sorted((e.offset, e.offset + e.length, e.name) for e in [*self.tensors.values(), *self.files.values()])
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise E.TensorBoundsError(p, f"tensors {an!r} and {bn!r} overlap")
        self._map = mmap.mmap(os.open(p, os.O_RDONLY), 0, access=mmap.ACCESS_READ) if size else None
        if verify_checksums:
            for e in [*self.tensors.values(), *self.files.values()]:
                got = checksum(self._map[e.offset: e.offset + e.length]) if e.length else checksum(b"")
                if got != e.checksum:
                    raise E.ChecksumMismatchError(p, f"tensor {e.name!r}: checksum {got} does not match the header's {e.checksum}")

    def _entry(self, d, data_floor: int, typed: bool) -> TensorEntry:
        p = self.path
        try:
            name = str(d["name"])
            offset, length = int(d["offset"]), int(d["length"])
            dtype = str(d["dtype"]) if typed else "uint8"
            shape = tuple(int(s) for s in d["shape"]) if typed else (length,)
            check = str(d["checksum"])
        except (KeyError, TypeError, ValueError) as e:
            raise E.HeaderError(p, f"malformed tensor-table entry {d!r} ({type(e).__name__}: {e})") from None
        if dtype not in DTYPES:
            raise E.DTypeMismatchError(p, f"tensor {name!r}: unknown dtype {dtype!r}")
        if any(s < 0 for s in shape) or offset < 0 or length < 0:
            raise E.ShapeMismatchError(p, f"tensor {name!r}: negative shape, offset or length")
        expect = int(np.prod(shape, dtype=object)) * np.dtype(DTYPES[dtype]).itemsize
        if expect != length:
            raise E.ShapeMismatchError(p, f"tensor {name!r}: shape {list(shape)} of {dtype} is {expect} bytes, table says {length}")
        if offset < data_floor:
            raise E.TensorBoundsError(p, f"tensor {name!r}: offset {offset} lies inside the header (data starts at {data_floor})")
        if offset % ALIGN:
            raise E.TensorBoundsError(p, f"tensor {name!r}: offset {offset} is not {ALIGN}-byte aligned")
        if offset + length > self.size:
            raise E.TruncatedFileError(p, f"tensor {name!r} ends at byte {offset + length}, past the end of the "
                                          f"{self.size}-byte file (truncated?)")
        return TensorEntry(name, dtype, shape, offset, length, check)

    def tensor(self, name: str) -> np.ndarray:
        try:
            e = self.tensors[name]
        except KeyError:
            raise E.MissingTensorError(self.path, f"tensor {name!r} is not in the file") from None
        dt = np.dtype(DTYPES[e.dtype]).newbyteorder("<")
        return np.frombuffer(self._map, dtype=dt, count=int(np.prod(e.shape)), offset=e.offset).reshape(e.shape)

    def expect(self, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor, after checking it has the dtype and shape the config requires."""
        if name not in self.tensors:
            raise E.MissingTensorError(self.path, f"tensor {name!r} is required by the config but not in the file")
        e = self.tensors[name]
        if e.dtype != dtype:
            raise E.DTypeMismatchError(self.path, f"tensor {name!r} is {e.dtype}, expected {dtype}")
        if tuple(e.shape) != tuple(shape):
            raise E.ShapeMismatchError(self.path, f"tensor {name!r} has shape {list(e.shape)}, expected {list(shape)}")
        return self.tensor(name)

    def file(self, name: str) -> bytes | None:
        e = self.files.get(name)
        return None if e is None else bytes(self._map[e.offset: e.offset + e.length])
