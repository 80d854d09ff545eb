"""Self-test: the op sweep (ladder/tools/opsweep.py), which the CUDA sanitizer script and `nanoqwen mutate`'s
second look run under compute-sanitizer, reaches every op of the backend interface.

A kernel the sweep never launches is one the nightly's sanitizers never look at, and a survivor in it gets
no quick second look: an op added to kernels/base.py `OPS` (or a fused op to `FUSED_OPS`) must get its
line in `run_ops`. The sweep runs
here on the NumPy backend behind a proxy that notes each attribute the sweep asks of it; the CUDA backend
goes through the same code, so the ops it reaches are the same (its variants are the sweep's own loops).
"""

from __future__ import annotations

from collections import Counter

from kernels import FUSED_OPS, OPS, get_backend
from ladder.tools.opsweep import run_ops


class Noting:
    """A backend behind a proxy: every attribute read is counted, then served by the backend."""

    def __init__(self, inner):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "asked", Counter())

    def __getattr__(self, name):
        self.asked[name] += 1
        return getattr(self.inner, name)

    def __setattr__(self, name, value):  # the sweep sets knobs (variants) and puts them back
        setattr(self.inner, name, value)


def unreached() -> list[str]:
    """The ops and fused ops of the interface that one run of the sweep never asks the backend for."""
    be = Noting(get_backend("numpy"))
    run_ops(be, say=lambda line: None)
    return [op for op in (*OPS, *FUSED_OPS) if not be.asked[op]]


def test_the_op_sweep_reaches_every_op_and_every_fused_op_of_the_interface():
    missing = unreached()
    assert not missing, f"the op sweep (ladder/tools/opsweep.py run_ops) never runs {missing}: add their checks there"


def test_an_op_whose_check_the_sweep_no_longer_runs_is_named(monkeypatch):
    from ladder.checks import ops

    def skipped(backend, **args):  # as if run_ops had lost its line for RoPE's page writes
        pass

    skipped.examples = ops.check_rope_kv_write.examples
    monkeypatch.setattr(ops, "check_rope_kv_write", skipped)
    assert unreached() == ["rope_kv_write"]
