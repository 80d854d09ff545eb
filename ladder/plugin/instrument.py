"""Counting every op call a rung makes, for the coverage listing (`nanoqwen ladder --coverage`).

`record_calls(backend, counts)` replaces each op of docs/BACKEND.md's table on the Backend object with a
wrapper that counts calls into `counts[op]` and then calls the op it replaced (a fault planted
before or after still runs). Wrappers are made once per op: their identity is stable, which keeps a
captured CUDA graph valid.
"""

from __future__ import annotations

from collections import Counter

from kernels import OPS


def record_calls(backend, counts: Counter) -> None:
    for op in OPS:
        inner = getattr(backend, op)

        def counted(*args, _op=op, _inner=inner, **kwargs):
            counts[_op] += 1
            return _inner(*args, **kwargs)

        counted.__name__ = op
        counted.__wrapped__ = inner
        setattr(backend, op, counted)
