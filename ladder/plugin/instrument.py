"""Counting every op call a rung makes, for the coverage listing (`nanoqwen ladder --coverage`).

`record_calls(backend, counts)` replaces each op of docs/BACKEND.md's table, and each fused op
(kernels.FUSED_OPS), on the Backend object with a wrapper that counts calls into `counts[op]` and then
calls the op it replaced (a fault planted before or after still runs). Wrappers are made once per op:
their identity is stable, which keeps a captured CUDA graph valid. Each is marked `observes_only`, so a
backend that runs a fused op as one kernel keeps doing so under it (Backend.parts_wrapped): the rungs
check the fused kernel, and the counts say which ran, the fused op or its parts.
"""

from __future__ import annotations

from collections import Counter

from kernels import FUSED_OPS, OPS


def record_calls(backend, counts: Counter) -> None:
    for op in (*OPS, *FUSED_OPS):
        inner = getattr(backend, op)

        def counted(*args, _op=op, _inner=inner, **kwargs):
            counts[_op] += 1
            return _inner(*args, **kwargs)

        counted.__name__ = op
        counted.__wrapped__ = inner
        counted.observes_only = True  # calls `inner` with the same arguments: a fused op stays fused
        setattr(backend, op, counted)
