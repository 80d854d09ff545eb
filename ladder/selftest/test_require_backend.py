"""Self-test: a run that requires a backend this machine cannot run is refused before it starts.

`--require-backend cuda` (or NANOQWEN_REQUIRE_GPU=1) where the cuda backend cannot run once ran the
whole suite, failing every CUDA test one by one, for over 25 minutes. Now pytest (with and without
pytest-xdist workers), `nanoqwen ladder` and so `.ci/nightly-gpu` stop at once: exit status 2 and one
line on stderr, `nanoqwen: error: ...`, naming the backend, what required it and why it cannot run
(ladder/required.py). Nothing is collected, no worker starts, no rung runs, no JUnit or ladder JSON is
written. Each case runs the command in a subprocess; on a machine where the cuda backend runs, they skip.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kernels import backend_available
from ladder.nested import REPO, child_env, skip_inside_nested_run
from ladder.required import ENV

CUDA_OK, CUDA_WHY = backend_available("cuda")

pytestmark = [skip_inside_nested_run,
              pytest.mark.skipif(CUDA_OK, reason=f"the cuda backend runs here ({CUDA_WHY}): nothing to refuse")]

TARGET = str(REPO / "ladder" / "unit" / "test_kv_cache.py")  # what the child would run, were it not refused


def run(cmd: list[str], cwd, require_gpu: bool = False) -> subprocess.CompletedProcess:
    """`cmd` in folder `cwd`, in the environment of a child run (ladder/nested.py), with or without
    NANOQWEN_REQUIRE_GPU=1 (the parent's own setting never leaks in)."""
    env = child_env(backend=None, **({ENV: "1"} if require_gpu else {}))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def assert_refused(proc: subprocess.CompletedProcess, source: str) -> None:
    """Exit 2 and exactly one line on stderr naming the backend, what required it and the reason."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, repr(proc.stderr[-2000:])
    line = proc.stderr.rstrip("\n")
    assert line == (f"nanoqwen: error: {source}, but the cuda backend is not available on this machine: "
                    f"{CUDA_WHY}"), line
    for word in ("passed", "failed", "error", "rung ", "workers", "collected"):
        assert word not in proc.stdout.lower(), proc.stdout[-2000:]


def pytest_cmd(tmp_path, *args: str) -> list[str]:
    """pytest from the checkout on the cuda backend, its JUnit file and ladder JSON under `tmp_path`."""
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", TARGET, "-m", "unit", "--backend", "cuda",
            "--junitxml", str(tmp_path / "junit.xml"), "--ladder-json", str(tmp_path / "unit.json"), *args]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["no-workers", "two-workers"])
def test_pytest_refuses_a_required_backend_that_cannot_run(tmp_path, workers):
    proc = run(pytest_cmd(tmp_path, "--require-backend", "cuda", *workers), REPO)
    assert_refused(proc, "--require-backend cuda")
    assert proc.stdout == ""  # no header, no collection, no worker started
    assert not (tmp_path / "junit.xml").exists() and not (tmp_path / "unit.json").exists()


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["no-workers", "two-workers"])
def test_pytest_refuses_the_nightly_gpu_requirement_without_a_gpu(tmp_path, workers):
    proc = run(pytest_cmd(tmp_path, *workers), REPO, require_gpu=True)
    assert_refused(proc, f"{ENV}=1")
    assert proc.stdout == ""
    assert not (tmp_path / "junit.xml").exists() and not (tmp_path / "unit.json").exists()


@pytest.mark.parametrize("require_gpu, args, source", [
    (False, ["--require-backend", "cuda"], "--require-backend cuda"),
    (True, ["--backend", "cuda"], f"{ENV}=1"),
], ids=["option", "environment"])
def test_nanoqwen_ladder_refuses_before_any_rung(tmp_path, require_gpu, args, source):
    """Started from a foreign folder, as a user does (the command finds the checkout on PYTHONPATH)."""
    report = tmp_path / "report"
    proc = run([sys.executable, "-m", "ladder", "ladder", *args, "--rungs", "unit", "--report", str(report),
                "--", TARGET], tmp_path, require_gpu=require_gpu)
    assert_refused(proc, source)
    assert proc.stdout == ""  # not even "[1/1] rung unit"
    assert not report.exists()
