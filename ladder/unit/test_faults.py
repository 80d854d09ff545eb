"""Unit rung: proof that the ladder catches bugs. Each planted fault of ladder/faults.py runs a real
rung in a subprocess, on the backend under test; the run must exit non-zero and its failure must name
the op. A rung that stays green under its fault is a bug in the rung.

The subprocess selects exactly one backend and gets that backend's environment (ladder/nested.py): the
nightly GPU job's NANOQWEN_REQUIRE_GPU=1 is kept for the cuda runs and dropped for the numpy runs
(otherwise each would be a usage error, exit 4, and not a test of the fault)."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from ladder.faults import FAULTS, parse
from ladder.nested import run_pytest, skip_inside_nested_run

pytestmark = skip_inside_nested_run  # the rungs below select by keyword, and would select these tests


def run_rung(args: list[str], backend: str = "numpy") -> subprocess.CompletedProcess:
    """`pytest -x ARGS` on one backend, in a subprocess of its own (ladder/nested.py)."""
    return run_pytest(["-x", *args], backend)


def _cases():
    """(fault, format): a fault that reads quantized weights once per format (each format's kernels must
    catch it), the others once, in the default format."""
    from engine.formats import DEFAULT_FORMAT, FORMATS

    return [(name, quant) for name in sorted(FAULTS)
            for quant in (sorted(FORMATS) if FAULTS[name].per_format else [DEFAULT_FORMAT])]


@pytest.mark.parametrize("name,quant", _cases())
def test_planted_fault_turns_its_rung_red_and_names_the_op(backend, name, quant):
    fault = FAULTS[name]
    r = run_rung([*shlex.split(fault.rung), "--quant", quant, "--plant-fault", name], backend.name)
    out = r.stdout + r.stderr
    assert r.returncode == 1, f"--plant-fault {name} ({fault.describes}) left `pytest {fault.rung} --quant {quant}` green:\n{out[-3000:]}"
    failure = out[out.find("FAILURES"):] if "FAILURES" in out else out
    assert any(n in failure for n in fault.names), f"the failure does not name {fault.names}:\n{failure[-3000:]}"
    assert f"PLANTED FAULT {name}" in out


def test_layer_scoped_fault_fails_only_its_layer(backend):
    r = run_rung(["-m", "layer", "-k", "golden", "--plant-fault", "wrong_rope_theta@1", "--no-header", "-rA"],
                 backend.name)
    out = r.stdout
    assert r.returncode == 1, out[-3000:]
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    passed = [line for line in out.splitlines() if line.startswith("PASSED")]
    assert failed and all("layer1-" in line for line in failed), out[-3000:]
    assert any("layer0-" in line for line in passed), "layer 0 must stay green under a fault in layer 1"


def test_unknown_fault_is_a_usage_error():
    r = run_rung(["-m", "unit", "-k", "embed", "--plant-fault", "cosmic_ray"])
    assert r.returncode == 4 and "cosmic_ray" in r.stderr, r.stderr[-2000:]
    with pytest.raises(ValueError, match="layer number"):
        parse("nibble_swap@x")


def test_a_numpy_subprocess_runs_under_the_nightly_gpu_requirement(monkeypatch):
    """The nightly job's NANOQWEN_REQUIRE_GPU=1 must not turn a numpy-only subprocess into a usage error."""
    monkeypatch.setenv("NANOQWEN_REQUIRE_GPU", "1")
    r = run_rung(["-m", "unit", "-k", "test_embed"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
