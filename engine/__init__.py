"""nanoqwen's engine: a Qwen2-architecture decode engine over a Backend of kernels.

`engine.load(path, backend="numpy"|"cuda")` returns a `Model`; see engine/model.py.
"""

from engine.config import SHAPES, Qwen2Config
from engine.model import Model, load

__all__ = ["Model", "Qwen2Config", "SHAPES", "load"]
