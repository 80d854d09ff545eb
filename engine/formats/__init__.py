"""Quantization formats, one module each, registered by name.

A format owns the definition of its numbers (docs/FORMAT.md has one section per format):

- `quantize(W)` turns a float32 weight `[out, in]` into the tensors stored in the file;
- `dequantize(tensors)` turns them back into float32 (NumPy: the definition the reference and the
  ladder rely on);
- `tensor_specs(out, in)` says which tensors, dtypes and shapes the file holds for one linear, and
  `check_linear(out, in)` the shape rule it needs (e.g. inputs a multiple of its group);
- `fuse(parts)` joins the linears that share an input (q/k/v, gate/up) into one weight;
- `swap_pair` and `shift_scale` edit stored tensors the way two classic kernel bugs misread them
  (the ladder's planted faults, ladder/checks/faults.py, go through these and nothing else).

Its kernels live in `kernels/<backend>/<name>.py` (and `kernels/cuda/<name>.cu`), found by name: a
backend without the module reports the format as unsupported (`FormatNotSupportedError`). Its
independent reading lives in `reference/formats.py`. Adding a format: docs/ADDING_A_FORMAT.md.
"""

from __future__ import annotations

import importlib

import numpy as np

from engine.errors import UnknownFormatError

# The format a model is converted to when no `--quant` / `quant=` is given.
DEFAULT_FORMAT = "int4_sym_g128"
# Every format, by module name under engine/formats/ (each registers itself on import).
FORMAT_MODULES = ("int4_sym_g128", "int8_sym_channel", "int4_asym_g128", "fp8_e4m3_channel")


class Format:
    """The base of every format: the contract above, with the defaults that row-major formats share."""

    name: str = ""
    suffixes: tuple[str, ...] = ()  # tensor-name suffixes that replace `.weight` in the file, e.g. (".qweight", ".scales")
    in_multiple: int = 1  # in_features must be a multiple of this (a group, or a kernel's load width)
    describes: str = ""  # one line for listings and the quant report

    def tensor_specs(self, out_features: int, in_features: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        raise NotImplementedError

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def dequantize(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    # The dequantized weight is within `max_error_steps` x `step(tensors)` of the original, elementwise
    # (round to nearest: half a step; ladder/unit/test_formats.py holds every format to it).
    max_error_steps: float = 0.5

    def step(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """float64 `[out, in]`: the distance between neighbouring values of each element's grid."""
        raise NotImplementedError

    def swap_pair(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors as a kernel that swaps elements 0 and 1 of every row would read them."""
        raise NotImplementedError

    def shift_scale(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors as a kernel that takes the last scale of every row from its neighbour would read them."""
        raise NotImplementedError

    def check_linear(self, out_features: int, in_features: int) -> str | None:
        """None when a `[out, in]` weight fits the format, else what is wrong, in words."""
        if in_features % self.in_multiple:
            return f"{in_features} inputs are not a multiple of {self.in_multiple}, which {self.name} needs"
        return None

    def fuse(self, parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """One weight whose rows are the parts' rows in order. Every shipped format keeps its data and its
        scales row by row, so that is a concatenation of each tensor along its first axis."""
        return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}

    def bytes_per_weight(self, out_features: int, in_features: int) -> float:
        """Stored bytes per weight element, scales and zero points included."""
        n = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
                for dtype, shape in self.tensor_specs(out_features, in_features).values())
        return n / (out_features * in_features)

    def _check_finite(self, w: np.ndarray) -> None:
        if not np.isfinite(w).all():
            raise ValueError(f"weight holds NaN or inf; {self.name} cannot quantize it")

    def _check_shape(self, w: np.ndarray) -> None:
        why = self.check_linear(*w.shape)
        if why:
            raise ValueError(why)


class RowScaledFormat(Format):
    """A format that stores one value per weight, row-major, in `qweight` (dtype `qweight_dtype`), and one
    fp16 scale per output row in `scales` (int8_sym_channel, fp8_e4m3_channel). Each row's scale maps its
    max |w| onto `qmax`; the format says only how a scaled value is encoded and decoded."""

    qweight_dtype: str = ""
    qmax: float = 0.0  # the largest magnitude a stored value holds

    def encode(self, v: np.ndarray) -> np.ndarray:
        """float32 scaled values (|v| <= qmax) -> the stored `qweight` values."""
        raise NotImplementedError

    def decode(self, qweight: np.ndarray) -> np.ndarray:
        """Stored `qweight` values -> float32 values (exact)."""
        raise NotImplementedError

    def tensor_specs(self, out_features: int, in_features: int):
        return {".qweight": (self.qweight_dtype, (out_features, in_features)), ".scales": ("float16", (out_features,))}

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        w = np.asarray(w, dtype=np.float32)
        self._check_shape(w)
        self._check_finite(w)
        v = np.abs(w)  # the one float32 temporary of the weight's size, reused for the scaled values
        with np.errstate(over="ignore"):
            scales = (v.max(axis=1) / np.float32(self.qmax)).astype(np.float16)
        if not np.isfinite(scales).all():
            q = int(self.qmax)
            raise ValueError(f"a row's max |w| / {q} overflows fp16 (|w| > {65504 * q}); {self.name} cannot hold it")
        s32 = scales.astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(w, s32, out=v)
        zero = scales == 0  # 0 where the scale is 0 (w / 0 is inf or nan there)
        if zero.any():
            v[zero] = 0.0
        return {"qweight": self.encode(v), "scales": scales}

    def dequantize(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        return self.decode(tensors["qweight"]) * np.asarray(tensors["scales"]).astype(np.float32)[:, None]

    def swap_pair(self, tensors):
        t = {k: np.array(v, copy=True) for k, v in tensors.items()}
        t["qweight"][:, [0, 1]] = t["qweight"][:, [1, 0]]
        return t

    def shift_scale(self, tensors):
        """The last row takes the scale of the row before it (one row: no change)."""
        t = {k: np.array(v, copy=True) for k, v in tensors.items()}
        if t["scales"].shape[0] > 1:
            t["scales"][-1] = t["scales"][-2]
        return t


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
        raise UnknownFormatError(f"unknown quantization format {name!r}; known: {', '.join(sorted(FORMATS))}") from None


for _module in FORMAT_MODULES:
    importlib.import_module(f"engine.formats.{_module}")
