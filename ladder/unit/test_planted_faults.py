"""Unit rung: proof, in this process, that the rung's own checks catch every planted fault.

For each fault of ladder/faults.py, a fresh Backend object of the backend under test gets the fault
planted (its ops wrapped, exactly as `--plant-fault` does), and the unit rung's own checks that the
fault's catalogue entry selects (its `rung`, e.g. `-m unit -k attention`: the tests of
ladder/unit/test_ops.py whose names match) run against it here: every parametrization, their explicit
examples first, then the Hypothesis draws of the profile in force. At least one check must fail and its
failure must name the op; a rung that stays green under its fault is a bug in the rung. No child
process is started, so a fault costs the seconds its checks take, on every backend the rung runs.

The weight faults read quantized weights through their format's own edits, so they run once per
format; the others once, in the default format. That `nanoqwen ladder --plant-fault` turns a whole run
red end to end is a command test (ladder/selftest/test_faults.py).
"""

from __future__ import annotations

import itertools
import shlex
import sys

import pytest

from engine.formats import DEFAULT_FORMAT, get_format
from kernels import get_backend
from ladder import compare, plugin
from ladder.faults import FAULTS, plant
from ladder.unit import test_ops

# What a failing check raises: an assertion, pytest.fail, or Hypothesis's group of several (Python 3.11+).
# Anything else (a TypeError from a wrong call) is an error of this test, and propagates.
CHECK_FAILED = (AssertionError, pytest.fail.Exception) + ((BaseExceptionGroup,) if sys.version_info >= (3, 11) else ())
WEIGHT_FAULTS = sorted(name for name, f in FAULTS.items() if f.per_format)
OTHER_FAULTS = sorted(name for name, f in FAULTS.items() if not f.per_format)


def selected_checks(fault) -> list:
    """The test functions of test_ops.py that the fault's `-k` expression (words joined by `or`) selects."""
    args = shlex.split(fault.rung)
    words = [w.strip() for w in args[args.index("-k") + 1].split(" or ")]
    found = [fn for name, fn in vars(test_ops).items()
             if name.startswith("test_") and callable(fn) and any(w in name for w in words)]
    if not found:
        raise AssertionError(f"fault {fault.name}: `{fault.rung}` selects no check of ladder/unit/test_ops.py")
    return found


def parametrizations(fn) -> list[dict]:
    """Every combination of the function's `pytest.mark.parametrize` values, as keyword arguments."""
    axes = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
        values = [v.values if hasattr(v, "values") else v for v in mark.args[1]]
        axes.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in values])
    return [dict(kv for d in combo for kv in d.items()) for combo in itertools.product(*axes)] or [{}]


def failures_under(fault_name: str, backend_name: str, fmt) -> list[str]:
    """Run the fault's checks against a backend with the fault planted; the failure messages they raise."""
    fault = FAULTS[fault_name]
    backend = get_backend(backend_name, **plugin._device_options(backend_name))
    plant(backend, fault_name)
    messages, start = [], len(compare.RECORDS)
    try:
        _run_checks(fault, backend, fmt, messages)
    finally:  # the planted backend's errors are this test's evidence, not the rung's per-op figures
        del compare.RECORDS[start:]
    return messages


def _run_checks(fault, backend, fmt, messages: list[str]) -> None:
    for fn in selected_checks(fault):
        wanted = fn.hypothesis.inner_test.__code__.co_varnames if hasattr(fn, "hypothesis") else fn.__code__.co_varnames
        fixtures = {k: v for k, v in (("backend", backend), ("quant_format", fmt)) if k in wanted}
        for params in parametrizations(fn):
            try:
                fn(**fixtures, **params)
            except CHECK_FAILED as e:
                messages.append(str(e))  # the check's own words (not this loop's): they must name the op


def check_fault(fault_name: str, backend_name: str, fmt) -> None:
    fault = FAULTS[fault_name]
    messages = failures_under(fault_name, backend_name, fmt)
    checks = ", ".join(fn.__name__ for fn in selected_checks(fault))
    assert messages, (f"planted fault {fault_name} ({fault.describes}) left the unit rung's checks green on "
                      f"{backend_name} [{fmt.name}]: {checks}")
    named = [m for m in messages if any(n in m for n in fault.names)]
    assert named, f"planted fault {fault_name}: no failure names {fault.names}:\n" + "\n".join(m[:400] for m in messages)


@pytest.mark.parametrize("fault_name", WEIGHT_FAULTS)
def test_a_planted_weight_fault_fails_the_rungs_checks_in_every_format(backend, quant_format, fault_name):
    check_fault(fault_name, backend.name, quant_format)


@pytest.mark.parametrize("fault_name", OTHER_FAULTS)
def test_a_planted_fault_fails_the_rungs_checks(backend, fault_name):
    check_fault(fault_name, backend.name, get_format(DEFAULT_FORMAT))


def test_a_fault_the_checks_miss_is_reported(backend, monkeypatch):
    """The proof can fail: a 'fault' that changes nothing leaves its checks green, and that is an error."""
    from ladder.faults import Fault

    harmless = Fault("harmless", ("embed",), "changes nothing", lambda backend, active: None,
                     "-m unit -k embed_copies", ("embed",))
    monkeypatch.setitem(FAULTS, "harmless", harmless)
    with pytest.raises(AssertionError, match="left the unit rung's checks green"):
        check_fault("harmless", backend.name, get_format(DEFAULT_FORMAT))
