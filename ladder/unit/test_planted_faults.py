"""Unit rung: proof, in this process, that the rung's own checks catch every planted fault.

For each fault of ladder/checks/faults.py, a fresh Backend object of the backend under test gets the fault
planted (its ops wrapped, exactly as `--plant-fault` does), and the checks the fault's catalogue entry
names (`checks`: functions of ladder/checks/ops.py) run against it on their explicit examples, the ones
the unit rung runs first on every run. At least one check must fail and its failure must name the op; a
rung that stays green under its fault is a bug in the rung. No child process is started, so a fault
costs the seconds its checks take, on every backend the rung runs.

The weight faults read quantized weights through their format's own edits, so they run once per
format; the others once, in the default format. That `nanoqwen ladder --plant-fault` turns a whole run
red end to end is a command test (ladder/selftest/test_faults.py).
"""

from __future__ import annotations

import inspect

import pytest

from engine.formats import DEFAULT_FORMAT, get_format
from kernels import get_backend
from ladder.judges import compare
from ladder import plugin
from ladder.checks import ops
from ladder.checks.faults import FAULTS, plant

WEIGHT_FAULTS = sorted(name for name, f in FAULTS.items() if f.per_format)
OTHER_FAULTS = sorted(name for name, f in FAULTS.items() if not f.per_format)


def examples_of(check) -> tuple[dict, ...]:
    """A check's explicit examples; a check without any proves nothing, which is this test's error."""
    found = getattr(check, "examples", ())
    if not found:
        raise AssertionError(f"{check.__name__} has no explicit examples (ladder/checks/ops.py `@examples`) to run under a fault")
    return found


def failures_under(fault_name: str, backend_name: str, fmt) -> list[str]:
    """Run the fault's checks against a backend with the fault planted; the failure messages they raise."""
    fault = FAULTS[fault_name]
    backend = get_backend(backend_name, **plugin._device_options(backend_name))
    plant(backend, fault_name)
    messages, start = [], len(compare.RECORDS)
    try:
        for check in fault.checks:
            in_format = {"fmt": fmt} if "fmt" in inspect.signature(check).parameters else {}
            for args in examples_of(check):
                try:
                    check(backend, **in_format, **args)
                except AssertionError as e:  # anything else (a TypeError from a wrong call) is this test's error
                    messages.append(str(e))  # the check's own words (not this loop's): they must name the op
    finally:  # the planted backend's errors are this test's evidence, not the rung's per-op figures
        del compare.RECORDS[start:]
    return messages


def check_fault(fault_name: str, backend_name: str, fmt) -> None:
    fault = FAULTS[fault_name]
    messages = failures_under(fault_name, backend_name, fmt)
    checks = ", ".join(check.__name__ for check in fault.checks)
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
    """The proof can fail: a 'fault' that changes nothing leaves its checks green, and that is an error;
    so is a check with no examples to run."""
    from ladder.checks.faults import Fault

    harmless = Fault("harmless", ("embed",), "changes nothing", lambda backend, active: None,
                     (ops.check_embed,), ("embed",))
    monkeypatch.setitem(FAULTS, "harmless", harmless)
    with pytest.raises(AssertionError, match="left the unit rung's checks green"):
        check_fault("harmless", backend.name, get_format(DEFAULT_FORMAT))
    monkeypatch.setitem(FAULTS, "harmless", Fault("harmless", ("embed",), "changes nothing", lambda backend, active: None,
                                                  (ops.check_linear_residual,), ("embed",)))
    with pytest.raises(AssertionError, match="check_linear_residual has no explicit examples"):
        check_fault("harmless", backend.name, get_format(DEFAULT_FORMAT))
