"""Plain float weights for the references, made from a model file by its format's `dequantize`.

This is the one bridge from engine/ to reference/: the reference never reads the file format or the
quantized layout itself; it gets HF-named float32 tensors (the "fake-quantized" weights).
"""

from __future__ import annotations

import numpy as np

from engine.formats import get_format
from engine.modelfile import ModelFile


def dequantized_weights(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json dict, HF name -> float32 array) with every quantized linear dequantized."""
    mf = ModelFile(path)
    fmt = get_format(mf.quant)
    suffixes = fmt.suffixes
    weights: dict[str, np.ndarray] = {}
    for name in mf.tensors:
        base = next((name[: -len(s)] for s in suffixes if name.endswith(s)), None)
        if base is None:
            weights[name] = mf.tensor(name).astype(np.float32)
        elif base + ".weight" not in weights:
            weights[base + ".weight"] = fmt.dequantize({s.lstrip("."): mf.tensor(base + s) for s in suffixes})
    return mf.config_dict, weights
