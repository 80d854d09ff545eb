"""Quantization formats, one module each, registered by name.

A format owns the definition of its numbers: `quantize(W)` turns a float32 weight `[out, in]` into the
tensors stored in the file, `dequantize(tensors)` turns them back into float32 (NumPy, the definition
the reference and the ladder rely on), and `tensor_specs(out, in)` says which tensors, dtypes and
shapes the file must hold for one linear layer. Its kernels live in `kernels/<backend>/`, registered
under the same name. Adding a format is one module here plus its kernels, and `docs/FORMAT.md`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.errors import UnknownFormatError

# The format a model is converted to when no `--quant` / `quant=` is given.
DEFAULT_FORMAT = "int4_sym_g128"


class Format(Protocol):
    name: str
    suffixes: tuple[str, ...]  # tensor-name suffixes that replace `.weight` in the file, e.g. (".qweight", ".scales")

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]: ...
    def dequantize(self, tensors: dict[str, np.ndarray]) -> np.ndarray: ...
    def tensor_specs(self, out_features: int, in_features: int) -> dict[str, tuple[str, tuple[int, ...]]]: ...


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    if fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownFormatError(f"unknown quantization format {name!r}; known: {sorted(FORMATS)}") from None


from engine.formats import int4_sym_g128  # noqa: E402,F401  (registers itself)
