"""Hugging Face checkpoint folder -> .nanoqwen: a shape-checking copy that quantizes the linears.

Reads `config.json` and `model.safetensors` (or the shards a `model.safetensors.index.json` lists, as
`save_pretrained` writes them) in bf16, fp16 or fp32, a tensor at a time on each worker thread, so
memory stays near a few tensors' size per thread. The seven linears of each layer go through the
chosen format's `quantize`; embeddings, norms, biases and lm_head are stored fp16. `tokenizer.json`,
when the folder has one, travels inside the file. Writing goes through a temporary file and a rename
(engine/modelfile.py, engine/outpath.py).

Everything that can be checked is checked before the first tensor is read: the output path, the
config's values (type and sign, by key), every safetensors header entry (dtype, shape, data offsets
that match the shape and lie inside the file), the index's `weight_map` and its shards, and the
name, dtype and shape of every tensor the config needs. Each problem is one `CheckpointError` (or
`ConfigError`, `OutputPathError`) naming the file and the key.

Two checks read data, and both come before the output's temporary file is created: `tokenizer.json`
must be one the tokenizers library accepts (`CheckpointTokenizerError`, with the library's reason), and
every tensor the model takes must be finite (`NonFiniteWeightError`, naming the file, the tensor, the
first NaN or infinity's index and value) and within float16's range where float16 holds it
(`Float16RangeError`, naming the same): a bf16 or fp32 value that rounds past 65504, float16's largest
finite value, in a tensor kept as float16, or one that makes a quantized weight's float16 scale
overflow. The scan reads each tensor's raw bits once, a chunk at a time, before the conversion reads it
again to quantize or copy it; only a quantized tensor holding a value over 65504 is read again, and
quantized, to find out (every shipped format's scale is at most max |W| / 7, so smaller values
cannot overflow one).

Both passes run on worker threads (NumPy releases the GIL in its array work): the scan checks several
tensors at once, and the writer (engine/modelfile.py) reads and quantizes several while it writes,
in the file's order, the ones already made; the file's bytes are those of a one-thread conversion,
and at most two tensors per thread wait to be written. The threads are the cores, at most 16;
NANOQWEN_CONVERT_THREADS=N sets them (1: the plain sequential loop). `progress(i, n, name)` counts
the tensors written; when the scan runs longer than a second (a large checkpoint), its tensors count
too, from its start, so a long scan shows its progress and a broken small checkpoint stays one line.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import threading
import time
from pathlib import Path

import numpy as np

from engine.config import Qwen2Config
from engine.errors import ConfigError, NanoqwenError, OutputPathError, one_line
from engine.formats import DEFAULT_FORMAT, get_format
from engine.modelfile import PendingTensor, ordered_map, worker_threads, write_model
from engine.outpath import check_output_path
from engine.weights import check_linears, linear_names, plain_tensor_specs


class CheckpointError(NanoqwenError):
    """A Hugging Face checkpoint folder that cannot be converted; the message names the file."""


class NonFiniteWeightError(CheckpointError):
    """A checkpoint tensor holding a NaN or an infinity: no format can quantize it, and kept as fp16 it
    would poison every logit. Names the file, the tensor, the first bad index and its value."""

    def __init__(self, path, tensor: str, index: tuple[int, ...], value: str, count: int, quant: str | None):
        self.path, self.tensor, self.index, self.value, self.count, self.quant = (
            str(path), tensor, index, value, count, quant)
        more = f" (the first of {count} non-finite values)" if count > 1 else ""
        why = (f"{quant} cannot quantize a NaN or an infinity" if quant else
               "a NaN or an infinity in a tensor kept as float16 poisons every logit")
        super().__init__(f"{path}: tensor {tensor} holds {value} at index {index}{more}; {why} "
                         f"(the checkpoint is broken)")


class Float16RangeError(CheckpointError):
    """A finite checkpoint value that float16 cannot hold where the file stores float16: in a tensor kept
    as float16 (embeddings, norms, biases, lm_head) it would silently become an infinity, and in a
    quantized linear its group's or row's float16 scale would (`reason`: the format's own words). Names
    the file, the tensor, the (first such) value's index and the value."""

    def __init__(self, path, tensor: str, index: tuple[int, ...], value: str, count: int, quant: str | None,
                 reason: str = ""):
        self.path, self.tensor, self.index, self.value, self.count, self.quant = (
            str(path), tensor, index, value, count, quant)
        more = f" (the first of {count} values out of float16's range)" if count > 1 else ""
        if quant is None:
            why = (f"the tensor is stored as float16, whose largest finite value is {FLOAT16_MAX:g}, so it "
                   f"would become {'-inf' if value.startswith('-') else 'inf'}")
        else:
            why = f"{quant} stores its scales as float16, whose largest finite value is {FLOAT16_MAX:g}: {reason}"
        super().__init__(f"{path}: tensor {tensor} holds {value} at index {index}{more}; {why}")


class CheckpointTokenizerError(CheckpointError):
    """A checkpoint's tokenizer.json that is not UTF-8 or that the tokenizers library refuses."""


_ST_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}  # the dtypes read
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
_ST_MAX_HEADER = 100 << 20  # the safetensors format's own limit on a header
# dtype -> (bits' dtype, exponent mask, mantissa mask): a value is NaN or infinite when its exponent is all ones
_ST_NONFINITE = {"BF16": ("<u2", 0x7F80, 0x007F), "F16": ("<u2", 0x7C00, 0x03FF),
                 "F32": ("<u4", 0x7F800000, 0x007FFFFF)}
_SCAN_CHUNK = 64 << 20  # bytes per read of the finiteness scan (a multiple of every item size)
SCAN_QUIET_S = 1.0  # a scan shorter than this shows no progress (a refused checkpoint: one line, the error)
FLOAT16_MAX = 65504.0
# dtype -> how far its bits sit below float32's (the same sign, exponent and top mantissa bits): the
# dtypes whose finite values can exceed float16's range (an F16 checkpoint's cannot)
_ST_FP32_SHIFT = {"BF16": 16, "F32": 0}
_F32_ROUNDS_TO_INF = 0x477FF000  # |bits| of 65520.0: from here up, float32 -> float16 rounds to inf (ties to even)
_F32_OVER_FP16_MAX = 0x477FE001  # |bits| of the first float32 above 65504
INDEX = "model.safetensors.index.json"


def _brief(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _read_json(path: Path, what: str):
    try:
        text = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: {what} is not JSON ({str(e)[:120]})") from None


# --- config.json --------------------------------------------------------------------------------

_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
_OPTIONAL = {"head_dim": "positive integer", "rms_norm_eps": "positive number", "rope_theta": "positive number",
             "tie_word_embeddings": "boolean", "use_sliding_window": "boolean", "attention_bias": "boolean",
             "hidden_act": "string", "model_type": "string", "rope_parameters": "object",
             "rope_scaling": "object", "architectures": "list of strings", "layer_types": "list of strings"}
_KINDS = {
    "positive integer": lambda v: _is_int(v) and v > 0,
    "positive number": lambda v: _is_number(v) and v > 0,
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "list of strings": lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
}


def check_config_values(d, path: Path) -> None:
    """Refuse, by key, a config.json value of the wrong type or sign (before Qwen2Config reads it)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: config.json is a JSON {type(d).__name__}, not an object")

    def bad(key, want, value):
        raise CheckpointError(f"{path}: config key {key!r} must be a {want}, got {_brief(value)}")

    for key in _POSITIVE_INTS:
        if key in d and not _KINDS["positive integer"](d[key]):
            bad(key, "positive integer", d[key])
    for key, want in _OPTIONAL.items():
        if d.get(key) is not None and not _KINDS[want](d[key]):
            bad(key, want, d[key])
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_theta") is not None and not _KINDS["positive number"](rope["rope_theta"]):
        bad("rope_parameters.rope_theta", "positive number", rope["rope_theta"])
    for key in ("rope_type", "type"):
        if rope.get(key) is not None and not isinstance(rope[key], str):
            bad(f"rope_parameters.{key}", "string", rope[key])
    vocab = d.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id"):
        value = d.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is None or (isinstance(value, list) and not value):
            continue
        if not all(_is_int(i) and i >= 0 for i in ids):
            bad(key, "non-negative integer or a list of them", value)
        if _is_int(vocab) and any(i >= vocab for i in ids):
            raise CheckpointError(f"{path}: config key {key!r} = {_brief(value)} is outside the vocabulary "
                                  f"(vocab_size {vocab})")


def read_config(hf_dir: Path) -> Qwen2Config:
    """The folder's config.json as a Qwen2Config; a CheckpointError or ConfigError naming the key."""
    if not hf_dir.exists():
        raise CheckpointError(f"{hf_dir}: no such folder")
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir}: not a folder (convert reads a Hugging Face model folder)")
    path = hf_dir / "config.json"
    if not path.exists():
        raise CheckpointError(f"{hf_dir}: no config.json (is this a Hugging Face model folder?)")
    d = _read_json(path, "config.json")
    check_config_values(d, path)
    try:
        return Qwen2Config.from_hf_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except NanoqwenError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a value the checks above did not foresee
        raise CheckpointError(f"{path}: unusable config value ({e})") from None


# --- safetensors --------------------------------------------------------------------------------


class SafetensorsFolder:
    """Lazy reader of a folder's safetensors files (bf16 turned into fp32 by a 16-bit shift). Every
    header entry is checked when the folder is opened; tensor data is read only by `read`."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / INDEX
        weight_map = {}
        if index.exists():
            weight_map = self._weight_map(index)
            files = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or {INDEX}")
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = folder / name
            base, header = self._header(path)
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if key in self.entries:
                    raise CheckpointError(f"{path}: tensor {key!r} is also in {self.entries[key][0].name}")
                self.entries[key] = (path, meta, base)
        for key, shard in weight_map.items():
            if key not in self.entries or self.entries[key][0].name != shard:
                raise CheckpointError(f"{index}: weight_map puts {key!r} in {shard}, which holds no such tensor")

    def _weight_map(self, index: Path) -> dict[str, str]:
        d = _read_json(index, "the index")
        weight_map = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        for key, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
                raise CheckpointError(f"{index}: weight_map[{key!r}] is {_brief(shard)}, not a file name in the folder")
        for shard in sorted(set(weight_map.values())):
            if not (self.folder / shard).is_file():
                raise CheckpointError(f"{index}: weight_map names shard {shard!r}, which is not in the folder")
        return weight_map

    @staticmethod
    def _header(path: Path) -> tuple[int, dict]:
        """(data base offset, header) of one safetensors file, every tensor entry checked."""
        try:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                f.seek(0)
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: truncated safetensors file")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise CheckpointError(f"{path}: safetensors header length {n} runs past the end of the file")
                if n > _ST_MAX_HEADER:
                    raise CheckpointError(f"{path}: safetensors header length {n} is over the format's 100 MiB limit")
                raw = f.read(n)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: safetensors header is not JSON ({str(e)[:120]})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object")
        base = 8 + n
        for key, meta in header.items():
            if key != "__metadata__":
                _check_entry(path, key, meta, size - base)
        return base, header

    def names(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def dtype(self, name: str) -> str:
        return self.entries[name][1]["dtype"]

    def read(self, name: str, as_fp16: bool = False) -> np.ndarray:
        """The tensor as float32; with `as_fp16`, as float16 (an F16 tensor copied as it is, where the way
        through float32 and back gives the same bits for every finite value and costs two passes)."""
        path, meta, base = self.entries[name]
        dtype = meta["dtype"]
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}; only BF16, F16 and F32 are read")
        start, end = (base + o for o in meta["data_offsets"])
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if end > len(m):
                    raise CheckpointError(f"{path}: tensor {name} runs past the end of the file")
                # Converted straight from the map, no copy of the raw bytes first (a 7B model reads 15 GB).
                raw = np.frombuffer(m, dtype=np.uint8, count=end - start, offset=start)
                try:
                    if as_fp16 and dtype == "F16":
                        out = raw.view("<f2").astype(np.float16)  # a copy: the map closes below
                    elif dtype == "BF16":  # a float32's top half: shifted into place in one pass
                        out = np.left_shift(raw.view("<u2"), 16, dtype=np.uint32).view(np.float32)
                    else:
                        out = raw.view("<f2" if dtype == "F16" else "<f4").astype(np.float32)
                finally:
                    del raw  # the map closes only once no array views it
        except (OSError, ValueError) as e:  # the file vanished, or shrank to nothing, since it was opened
            raise CheckpointError(f"{path}: cannot read tensor {name} ({e})") from None
        out = out.reshape(meta["shape"])
        return out.astype(np.float16, copy=False) if as_fp16 else out

    def _scan(self, name: str, tests) -> list[tuple[int, int, int] | None]:
        """For each test (raw bits -> bool mask), (flat index, bits, how many) of the first element of the
        tensor it picks, or None. Reads the raw bits once, a chunk at a time into one buffer (no float32
        copy, memory bounded by the chunk).

        Every test picks only magnitudes at or above its `floor` (the bits without the sign): a chunk
        whose largest magnitude is below every floor, as nearly every chunk of a sound checkpoint is, is
        passed after one mask and one maximum instead of each test's several passes."""
        path, meta, base = self.entries[name]
        bits_dtype = _ST_NONFINITE[meta["dtype"]][0]
        magnitude = (1 << (8 * np.dtype(bits_dtype).itemsize - 1)) - 1
        floor = min(test.floor for test in tests)
        start, end = (base + o for o in meta["data_offsets"])
        first: list = [None] * len(tests)
        count, seen = [0] * len(tests), 0
        buffer, scratch = _scan_buffers(min(_SCAN_CHUNK, end - start))
        try:
            with open(path, "rb") as f:
                f.seek(start)
                for pos in range(start, end, _SCAN_CHUNK):
                    want = min(_SCAN_CHUNK, end - pos)
                    raw = buffer[:want]
                    if f.readinto(raw) != want:  # the file shrank since it was opened
                        raise CheckpointError(f"{path}: tensor {name} runs past the end of the file")
                    bits = raw.view(bits_dtype)
                    mags = np.bitwise_and(bits, magnitude, out=scratch[:want].view(bits_dtype))
                    if bits.size and int(mags.max()) < floor:
                        seen += bits.size
                        continue
                    for t, test in enumerate(tests):
                        hit = test(bits)
                        n = int(np.count_nonzero(hit))
                        if n and first[t] is None:
                            i = int(np.argmax(hit))
                            first[t] = (seen + i, int(bits[i]))
                        count[t] += n
                    seen += bits.size
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read tensor {name} ({e.strerror or e})") from None
        return [None if f is None else (f[0], f[1], n) for f, n in zip(first, count)]

    def _index(self, name: str, flat: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(flat, self.entries[name][1]["shape"]))

    def _non_finite_test(self, name: str):
        _, exponent, _ = _ST_NONFINITE[self.dtype(name)]

        def test(bits):
            return (bits & exponent) == exponent  # NaN or infinite: the exponent is all ones

        test.floor = exponent  # the exponent all ones: a magnitude at least the mask
        return test

    def _magnitude_test(self, name: str, fp32_bits: int):
        """The test picking the finite values whose magnitude's float32 bits are at least `fp32_bits`
        (a BF16 value is a float32's top half: compared with the threshold's top half, rounded up)."""
        shift = _ST_FP32_SHIFT[self.dtype(name)]
        exponent = _ST_NONFINITE[self.dtype(name)][1]
        magnitude = (1 << (31 - shift)) - 1  # every bit but the sign
        at_least = -(-fp32_bits >> shift)

        def test(bits):
            mag = bits & magnitude
            return (mag >= at_least) & (mag < exponent)  # below the all-ones exponent: finite

        test.floor = at_least
        return test

    def _value(self, name: str, bits: int) -> str:
        """A float's shortest text from its raw bits (as float32 holds it: BF16 exactly)."""
        shift = _ST_FP32_SHIFT[self.dtype(name)]
        v = np.array([bits << shift], dtype=np.uint32).view(np.float32)[0]
        return repr(float(str(v)))

    def first_non_finite(self, name: str) -> tuple[tuple[int, ...], str, int] | None:
        """(index, "nan" / "inf" / "-inf", how many) of the tensor's first NaN or infinity, or None."""
        (found,) = self._scan(name, [self._non_finite_test(name)])
        return None if found is None else self._non_finite(name, found)

    def _non_finite(self, name: str, found: tuple[int, int, int]) -> tuple[tuple[int, ...], str, int]:
        flat, b, count = found
        bits_dtype, _, mantissa = _ST_NONFINITE[self.dtype(name)]
        sign = b >> (8 * np.dtype(bits_dtype).itemsize - 1)
        value = "nan" if b & mantissa else ("-inf" if sign else "inf")
        return self._index(name, flat), value, count

    def first_over_float16(self, name: str) -> tuple[tuple[int, ...], str, int] | None:
        """(index, value, how many) of the tensor's first finite value that float16 rounds to an infinity
        (|v| >= 65520: the tie at 65520 goes to the even neighbour, which is infinity), or None."""
        if self.dtype(name) not in _ST_FP32_SHIFT:
            return None
        (found,) = self._scan(name, [self._magnitude_test(name, _F32_ROUNDS_TO_INF)])
        return None if found is None else (self._index(name, found[0]), self._value(name, found[1]), found[2])

    def check_values(self, name: str, quant: str | None) -> None:
        """Refuse a tensor that its conversion cannot hold (`quant`: the format it is quantized to, None for
        a tensor kept as fp16): NonFiniteWeightError for a NaN or an infinity; Float16RangeError for a value
        that would become an infinity as float16, or make a quantized weight's float16 scale one."""
        tests = [self._non_finite_test(name)]
        if self.dtype(name) in _ST_FP32_SHIFT:
            tests.append(self._magnitude_test(name, _F32_OVER_FP16_MAX if quant else _F32_ROUNDS_TO_INF))
        found = self._scan(name, tests)
        path = self.entries[name][0]
        if found[0]:
            raise NonFiniteWeightError(path, name, *self._non_finite(name, found[0]), quant)
        if len(found) < 2 or found[1] is None:
            return
        if quant is None:
            flat, b, count = found[1]
            raise Float16RangeError(path, name, self._index(name, flat), self._value(name, b), count, None)
        self._check_quantizable(name, quant)

    def _check_quantizable(self, name: str, quant: str) -> None:
        """Float16RangeError when the format cannot quantize the tensor (its float16 scale would overflow),
        naming the largest magnitude of the first row, and of the first group in it, whose scale does.

        Every shipped format scales row by row (groups within a row, or the whole row), so a row, and a
        group of `group_size` inputs in it, quantize on their own as they do inside the tensor."""
        fmt = get_format(quant)
        w = self.read(name)
        try:
            fmt.quantize(w)
            return
        except ValueError as e:
            reason = str(e)
        mags = np.abs(w)
        row_max = mags.max(axis=1)
        row = next((int(r) for r in np.flatnonzero(row_max > FLOAT16_MAX) if _refuses(fmt, w[r:r + 1])),
                   int(np.argmax(row_max)))
        size = getattr(fmt, "group_size", None) or w.shape[1]
        start = next((g for g in range(0, w.shape[1], size) if _refuses(fmt, w[row:row + 1, g:g + size])), None)
        if start is None:  # no group alone overflows: name the row's largest magnitude
            start, size = 0, w.shape[1]
        col = start + int(np.argmax(mags[row, start:start + size]))
        raise Float16RangeError(self.entries[name][0], name, (row, col), repr(float(str(w[row, col]))), 1, quant,
                                reason)


_scan_local = threading.local()  # each thread's read buffer and scratch, kept from one tensor to the next


def _scan_buffers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two byte buffers of at least `size` bytes (reused: a 7B scan reads 15 GB, and fresh
    buffers would cost a page fault per 4 KiB of it)."""
    held = getattr(_scan_local, "buffers", None)
    if held is None or held[0].size < size:
        held = _scan_local.buffers = (np.empty(size, np.uint8), np.empty(size, np.uint8))
    return held


def _refuses(fmt, part: np.ndarray) -> bool:
    """Whether the format refuses to quantize `part` (a row, or a group of one) on its own."""
    try:
        fmt.quantize(np.ascontiguousarray(part))
    except ValueError:
        return True
    return False


def _check_entry(path: Path, key: str, meta, data_size: int) -> None:
    """One header entry: {"dtype": str, "shape": [ints >= 0], "data_offsets": [begin, end]} inside the
    data, its length the shape's element count times the dtype's size (for the dtypes safetensors knows)."""
    where = f"{path}: tensor {key!r}"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: header entry is {_brief(meta)}, not an object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in meta:
            raise CheckpointError(f"{where}: header entry has no {field!r}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: 'dtype' is {_brief(dtype)}, not a string")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(f"{where}: 'shape' is {_brief(shape)}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: 'data_offsets' is {_brief(offsets)}, not [begin, end] with 0 <= begin <= end")
    if offsets[1] > data_size:
        raise CheckpointError(f"{where}: data_offsets {offsets} run past the end of the file "
                              f"({data_size} bytes of data)")
    if dtype in _ST_ITEMSIZE:
        expect = math.prod(shape) * _ST_ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != expect:
            raise CheckpointError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes; "
                                  f"shape {shape} of {dtype} needs {expect}")


# --- the conversion -----------------------------------------------------------------------------


def convert(hf_dir, out_path, quant: str = DEFAULT_FORMAT, progress=None, threads: int | None = None) -> Qwen2Config:
    """Convert a Hugging Face Qwen2 folder; returns its config. `progress(i, n, name)` per tensor (and
    per tensor scanned, once the scan is slow); `threads` workers (None: `worker_threads()`)."""
    hf_dir = Path(hf_dir)
    out_path = check_output_path(out_path)
    threads = worker_threads() if threads is None else max(1, int(threads))
    fmt = get_format(quant)
    config = read_config(hf_dir)
    try:
        check_linears(config, quant)
    except ConfigError as e:
        raise ConfigError(f"{hf_dir / 'config.json'}: {e}") from None
    st = SafetensorsFolder(hf_dir)

    def source(name: str, shape: tuple[int, ...]) -> None:
        if name not in st.entries:
            raise CheckpointError(f"{hf_dir}: tensor {name} is missing from the checkpoint")
        if st.dtype(name) not in _ST_DTYPES:
            raise CheckpointError(f"{st.entries[name][0]}: tensor {name} has dtype {st.dtype(name)}; "
                                  f"only BF16, F16 and F32 are read")
        if st.shape(name) != tuple(shape):
            raise CheckpointError(f"{hf_dir}: tensor {name} has shape {list(st.shape(name))}, "
                                  f"the config implies {list(shape)}")

    pending: list[PendingTensor] = []
    scan: list[tuple[str, str | None]] = []  # (tensor, the format it is quantized to, or None for fp16)
    for name, (dtype, shape) in plain_tensor_specs(config).items():
        source(name, shape)
        scan.append((name, None))
        pending.append(PendingTensor(name, dtype, shape, lambda n=name: st.read(n, as_fp16=True)))

    for layer in range(config.num_hidden_layers):
        for base, (out_f, in_f) in linear_names(config, layer).items():
            source(base + ".weight", (out_f, in_f))
            scan.append((base + ".weight", quant))
            cache: dict = {}

            def produce(suffix, base=base, cache=cache, lock=threading.Lock()):
                # One quantize per linear serves both of its tensors; drop it once both are written. The
                # writer produces a linear's tensors on one thread (their shared `group`); the lock keeps
                # the quantize single whichever threads ask.
                with lock:
                    if base not in cache:
                        try:
                            cache[base] = fmt.quantize(st.read(base + ".weight"))
                        except ValueError as e:  # check_values refused what it foresaw; anything else, typed
                            raise CheckpointError(
                                f"{st.entries[base + '.weight'][0]}: tensor {base}.weight: {e}") from None
                    t = cache[base].pop(suffix.lstrip("."))
                    if not cache[base]:
                        del cache[base]
                    return t

            for suffix, (dtype, shape) in fmt.tensor_specs(out_f, in_f).items():
                pending.append(PendingTensor(base + suffix, dtype, shape, lambda s=suffix, p=produce: p(s), group=base))

    tok = hf_dir / "tokenizer.json"
    inputs = {hf_dir / "config.json", hf_dir / INDEX, tok, *(p for p, _, _ in st.entries.values())}
    if any(out_path.resolve() == p.resolve() for p in inputs if p.exists()):
        raise OutputPathError(out_path, "is one of the checkpoint's own files; write the model elsewhere")
    files = {"tokenizer.json": read_tokenizer(tok)} if tok.exists() else {}
    # Before the temporary file: a broken checkpoint leaves nothing behind.
    scanned = check_all_values(st, scan, threads, progress, len(pending))
    write = None if progress is None else (lambda i, n, name: progress(scanned + i, scanned + n, name))
    write_model(out_path, config.to_hf_dict(), quant, pending, files=files, progress=write, threads=threads)
    return config


def check_all_values(st: SafetensorsFolder, scan: list[tuple[str, str | None]], threads: int, progress=None,
                     then: int = 0) -> int:
    """`st.check_values` of every (tensor, format) in `scan`, on `threads` threads; raises the error of
    the first refused tensor in `scan`'s order, as a plain loop would. Once the scan has run
    SCAN_QUIET_S, `progress(i, len(scan) + then, "check " + tensor)` counts it (`then`: the steps that
    follow it); returns how many steps it counted (0 when it said nothing)."""
    start, said = time.perf_counter(), False
    try:
        with ordered_map(lambda item: st.check_values(*item), scan, threads, ahead=len(scan)) as checked:
            for i, _ in enumerate(checked):
                said = said or (progress is not None and time.perf_counter() - start >= SCAN_QUIET_S)
                if said:
                    progress(i + 1, len(scan) + then, "check " + scan[i][0])
    finally:
        _scan_local.__dict__.pop("buffers", None)  # this thread's (the workers' go with them)
    return len(scan) if said else 0


def read_tokenizer(path: Path) -> bytes:
    """The bytes of a checkpoint's tokenizer.json, refused now (CheckpointTokenizerError, with the
    library's reason) unless the tokenizers library accepts them, not at the first `generate --prompt`."""
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointTokenizerError(f"{path}: not UTF-8 (byte {e.start}: {e.reason}); the tokenizers "
                                       f"library cannot read it") from None
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - the library's Rust panics derive from BaseException
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise CheckpointTokenizerError(f"{path}: the tokenizers library refuses it ({one_line(reason, 200)})") from None
    return blob
