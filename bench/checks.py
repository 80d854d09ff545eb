"""The command-line checks the bench scripts share (`python -m bench.format_gemv`, `bench.prefill_gemm`):
an input error is one line on stderr, `bench.<script>: error: ...`, and exit status 2, never a traceback
from deep inside a measurement."""

from __future__ import annotations

import sys


def refuse(prog: str, message: str) -> int:
    """Print `prog: error: message` on stderr; the exit status of an input error."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def shape_problem(shape: str) -> str | None:
    """What is wrong with --shape (not a named shape of engine/config.py SHAPES), or None."""
    from engine.config import SHAPES

    return None if shape in SHAPES else f"unknown shape {shape!r}; one of {sorted(SHAPES)}"


def cuda_problem() -> str | None:
    """Why the cuda backend cannot run on this machine, or None."""
    from kernels.base import backend_available

    ok, why = backend_available("cuda")
    return None if ok else f"the cuda backend cannot run here: {why}"
