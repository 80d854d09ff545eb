"""Unit rung: proof that the ladder catches bugs. Each planted fault of ladder/faults.py runs a real
rung in a subprocess; the run must exit non-zero and its failure must name the op. A rung that stays
green under its fault is a bug in the rung."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ladder.faults import FAULTS, parse

REPO = Path(__file__).resolve().parents[2]


def run_rung(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--backend", "numpy", *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_planted_fault_turns_its_rung_red_and_names_the_op(name):
    fault = FAULTS[name]
    r = run_rung([*shlex.split(fault.rung), "--plant-fault", name])
    out = r.stdout + r.stderr
    assert r.returncode == 1, f"--plant-fault {name} ({fault.describes}) left `pytest {fault.rung}` green:\n{out[-3000:]}"
    failure = out[out.find("FAILURES"):] if "FAILURES" in out else out
    assert any(n in failure for n in fault.names), f"the failure does not name {fault.names}:\n{failure[-3000:]}"
    assert f"PLANTED FAULT {name}" in out


def test_layer_scoped_fault_fails_only_its_layer():
    r = run_rung(["-m", "layer", "-k", "golden", "--plant-fault", "wrong_rope_theta@1", "--no-header", "-rA"])
    out = r.stdout
    assert r.returncode == 1, out[-3000:]
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    passed = [line for line in out.splitlines() if line.startswith("PASSED")]
    assert failed and all("layer1-" in line for line in failed), out[-3000:]
    assert any("layer0-" in line for line in passed), "layer 0 must stay green under a fault in layer 1"


def test_unknown_fault_is_a_usage_error():
    r = run_rung(["-m", "unit", "-k", "embed", "--plant-fault", "cosmic_ray"])
    assert r.returncode == 4 and "cosmic_ray" in r.stderr
    with pytest.raises(ValueError, match="layer number"):
        parse("nibble_swap@x")
