"""Hugging Face checkpoint folder -> .nanoqwen: a shape-checking copy that quantizes the linears.

Reads `config.json` and `model.safetensors` (or the shards a `model.safetensors.index.json` lists, as
`save_pretrained` writes them) in bf16, fp16 or fp32, one tensor at a time, so memory stays near one
tensor's size. The seven linears of each layer go through the chosen format's `quantize`; embeddings,
norms, biases and lm_head are stored fp16. `tokenizer.json`, when the folder has one, travels inside
the file. Writing goes through a temporary file and a rename (engine/modelfile.py).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from engine.config import Qwen2Config
from engine.errors import NanoqwenError
from engine.formats import get_format
from engine.weights import linear_names, plain_tensor_specs
from engine.modelfile import PendingTensor, write_model


class CheckpointError(NanoqwenError):
    """A Hugging Face checkpoint folder that cannot be converted; the message names the file."""


_ST_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}


class SafetensorsFolder:
    """Lazy reader of a folder's safetensors files (bf16 turned into fp32 by a 16-bit shift)."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = folder / name
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: truncated safetensors file")
                (n,) = struct.unpack("<Q", head)
                if n > path.stat().st_size - 8:
                    raise CheckpointError(f"{path}: safetensors header length {n} runs past the end of the file")
                try:
                    header = json.loads(f.read(n))
                except ValueError as e:
                    raise CheckpointError(f"{path}: safetensors header is not JSON ({e})") from None
            for key, meta in header.items():
                if key != "__metadata__":
                    self.entries[key] = (path, meta, 8 + n)

    def names(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32."""
        path, meta, base = self.entries[name]
        dtype = meta["dtype"]
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}; only BF16, F16 and F32 are read")
        start, end = (base + o for o in meta["data_offsets"])
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if end > len(m):
                raise CheckpointError(f"{path}: tensor {name} runs past the end of the file")
            raw = np.frombuffer(m[start:end], dtype=np.uint8)
        shape = meta["shape"]
        if dtype == "BF16":
            return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return raw.view("<f2" if dtype == "F16" else "<f4").astype(np.float32).reshape(shape)


def convert(hf_dir, out_path, quant: str = "int4_sym_g128", progress=None) -> Qwen2Config:
    """Convert a Hugging Face Qwen2 folder; returns its config. `progress(i, n, name)` per tensor."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").exists():
        raise CheckpointError(f"{hf_dir}: no config.json (is this a Hugging Face model folder?)")
    config = Qwen2Config.from_json_file(hf_dir / "config.json")
    fmt = get_format(quant)
    st = SafetensorsFolder(hf_dir)

    def source(name: str, shape: tuple[int, ...]) -> None:
        if name not in st.entries:
            raise CheckpointError(f"{hf_dir}: tensor {name} is missing from the checkpoint")
        if st.shape(name) != tuple(shape):
            raise CheckpointError(f"{hf_dir}: tensor {name} has shape {list(st.shape(name))}, "
                                  f"the config implies {list(shape)}")

    pending: list[PendingTensor] = []
    for name, (dtype, shape) in plain_tensor_specs(config).items():
        source(name, shape)
        pending.append(PendingTensor(name, dtype, shape, lambda n=name: st.read(n).astype(np.float16)))

    for layer in range(config.num_hidden_layers):
        for base, (out_f, in_f) in linear_names(config, layer).items():
            source(base + ".weight", (out_f, in_f))
            cache: dict = {}

            def produce(suffix, base=base, cache=cache):
                # One quantize per linear serves both of its tensors; drop it once both are written.
                if base not in cache:
                    cache[base] = fmt.quantize(st.read(base + ".weight"))
                t = cache[base].pop(suffix.lstrip("."))
                if not cache[base]:
                    del cache[base]
                return t

            for suffix, (dtype, shape) in fmt.tensor_specs(out_f, in_f).items():
                pending.append(PendingTensor(base + suffix, dtype, shape, lambda s=suffix, p=produce: p(s)))

    files = {}
    tok = hf_dir / "tokenizer.json"
    if tok.exists():
        files["tokenizer.json"] = tok.read_bytes()
    write_model(out_path, config.to_hf_dict(), quant, pending, files=files, progress=progress)
    return config
