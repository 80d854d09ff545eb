"""Unit rung: proof that the ladder catches bugs. Each planted fault of ladder/faults.py runs a real
rung in a subprocess, on the backend under test; the run must exit non-zero and its failure must name
the op. A rung that stays green under its fault is a bug in the rung.

The subprocess selects exactly one backend, so it must not inherit a requirement for another one: the
nightly GPU job exports NANOQWEN_REQUIRE_GPU=1, which is kept for the cuda runs and dropped for the
numpy runs (otherwise each would be a usage error, exit 4, and not a test of the fault)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ladder.faults import FAULTS, parse

REPO = Path(__file__).resolve().parents[2]
# The rung a fault runs in selects by keyword (`-k attention`), which would select these tests too and
# start rungs of their own: the variable marks the inner run, where this file skips.
NESTED = "NANOQWEN_FAULT_SELFTEST"
pytestmark = pytest.mark.skipif(os.environ.get(NESTED) == "1", reason="inside a planted-fault run of this file")


def run_rung(args: list[str], backend: str = "numpy") -> subprocess.CompletedProcess:
    """`pytest ARGS` on one backend, in a subprocess of its own (no xdist, no cache folder)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), NESTED: "1"}
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS"):
        env.pop(var, None)
    if backend != "cuda":
        env.pop("NANOQWEN_REQUIRE_GPU", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--backend", backend, *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_planted_fault_turns_its_rung_red_and_names_the_op(backend, name):
    fault = FAULTS[name]
    r = run_rung([*shlex.split(fault.rung), "--plant-fault", name], backend.name)
    out = r.stdout + r.stderr
    assert r.returncode == 1, f"--plant-fault {name} ({fault.describes}) left `pytest {fault.rung}` green:\n{out[-3000:]}"
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
