"""Self-test: `nanoqwen ladder --plant-fault` turns a real run red, end to end, and the fault options
behave. That each fault of ladder/checks/faults.py fails the rung's own checks and names its op is proven in
process, on every backend and format, by the unit rung itself (ladder/unit/test_planted_faults.py);
here one fault goes through the whole command: option parsing, the rung subprocess, the exit status, the
banner and the report.

The subprocess selects exactly one backend and gets that backend's environment (ladder/run/nested.py): the
nightly GPU job's NANOQWEN_REQUIRE_GPU=1 is kept for the cuda runs and dropped for the numpy runs
(otherwise each would be a usage error, exit 4, and not a test of the fault)."""

from __future__ import annotations

import subprocess

import pytest

from ladder.checks.faults import FAULTS, parse
from ladder.run.nested import run_pytest, skip_inside_nested_run

pytestmark = skip_inside_nested_run  # the rungs below select by keyword, and would select these tests


def run_rung(args: list[str], backend: str = "numpy") -> subprocess.CompletedProcess:
    """`pytest -x ARGS` on one backend, in a subprocess of its own (ladder/run/nested.py)."""
    return run_pytest(["-x", *args], backend)


def test_nanoqwen_ladder_with_a_planted_fault_is_red_and_names_the_op(backend, tmp_path):
    """The command as a user runs it, from a foreign folder: exit 1, the banner, the op, a FAILED report."""
    import json
    import sys

    from ladder.run.nested import REPO, child_env

    fault = FAULTS["nibble_swap"]
    r = subprocess.run([sys.executable, "-m", "ladder", "ladder", "--backend", backend.name, "--rungs", "unit",
                        "--quant", "int4_sym_g128", "--plant-fault", fault.name, "-n", "0", "--report", "rep",
                        "--", "-k", "qkv_proj_with_bias"],
                       cwd=tmp_path, capture_output=True, text=True, env=child_env(backend.name, str(REPO)),
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 1, f"--plant-fault {fault.name} left `nanoqwen ladder` green:\n{out[-3000:]}"
    assert f"PLANTED FAULT {fault.name}" in out
    failure = out[out.find("FAILURES"):] if "FAILURES" in out else out
    assert any(n in failure for n in fault.names), f"the failure does not name {fault.names}:\n{failure[-3000:]}"
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["meta"]["result"] == "FAILED" and report["rungs"]["unit"]["failed"] >= 1


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
