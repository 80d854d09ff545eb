"""Self-test: a run that requires a backend this machine cannot run is refused before it starts.

`--require-backend cuda` (or NANOQWEN_REQUIRE_GPU=1) where the cuda backend cannot run once ran the
whole suite, failing every CUDA test one by one, for over 25 minutes. Now pytest (with and without
pytest-xdist workers), `nanoqwen ladder` and so `.ci/nightly-gpu` stop at once: exit status 2 and one
line on stderr, `nanoqwen: error: ...`, naming the backend, what required it and why it cannot run
(ladder/plugin/required.py). Nothing is collected, no worker starts, no rung runs, no JUnit or ladder JSON is
written. Each case runs the command in a subprocess; on a machine where the cuda backend runs, they skip.

A GPU the kernels cannot run on counts as no GPU: the kernels are compiled for sm_90a only, so a machine
whose GPUs are not all of compute capability 9.0 has no cuda backend, and says why in one line naming
the GPU, its capability and the architecture the kernels are built for (kernels/cuda/__init__.py,
`is_available`), instead of failing deep inside a kernel launch. Those cases run anywhere: a stand-in
`cupy` module (`FAKE_CUPY`, which reports the GPUs it is told of and runs nothing) takes CuPy's place.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kernels
from kernels import backend_available
from ladder.run.nested import REPO, child_env, skip_inside_nested_run
from ladder.plugin.required import ENV

CUDA_OK, CUDA_WHY = backend_available("cuda")

pytestmark = [skip_inside_nested_run]
# the cases that need this machine's own cuda backend to be unavailable
needs_no_cuda = pytest.mark.skipif(CUDA_OK, reason=f"the cuda backend runs here ({CUDA_WHY}): nothing to refuse")

TARGET = str(REPO / "ladder" / "unit" / "test_kv_cache.py")  # what the child would run, were it not refused


def run(cmd: list[str], cwd, require_gpu: bool = False) -> subprocess.CompletedProcess:
    """`cmd` in folder `cwd`, in the environment of a child run (ladder/run/nested.py), with or without
    NANOQWEN_REQUIRE_GPU=1 (the parent's own setting never leaks in)."""
    env = child_env(backend=None, **({ENV: "1"} if require_gpu else {}))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def assert_refused(proc: subprocess.CompletedProcess, source: str, why: str = CUDA_WHY) -> None:
    """Exit 2 and exactly one line on stderr naming the backend, what required it and the reason."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, repr(proc.stderr[-2000:])
    line = proc.stderr.rstrip("\n")
    assert line == (f"nanoqwen: error: {source}, but the cuda backend is not available on this machine: "
                    f"{why}"), line
    for word in ("passed", "failed", "error", "rung ", "workers", "collected"):
        assert word not in proc.stdout.lower(), proc.stdout[-2000:]


def pytest_cmd(tmp_path, *args: str) -> list[str]:
    """pytest from the checkout on the cuda backend, its JUnit file and ladder JSON under `tmp_path`."""
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", TARGET, "-m", "unit", "--backend", "cuda",
            "--junitxml", str(tmp_path / "junit.xml"), "--ladder-json", str(tmp_path / "unit.json"), *args]


@needs_no_cuda
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["no-workers", "two-workers"])
def test_pytest_refuses_a_required_backend_that_cannot_run(tmp_path, workers):
    proc = run(pytest_cmd(tmp_path, "--require-backend", "cuda", *workers), REPO)
    assert_refused(proc, "--require-backend cuda")
    assert proc.stdout == ""  # no header, no collection, no worker started
    assert not (tmp_path / "junit.xml").exists() and not (tmp_path / "unit.json").exists()


@needs_no_cuda
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["no-workers", "two-workers"])
def test_pytest_refuses_the_nightly_gpu_requirement_without_a_gpu(tmp_path, workers):
    proc = run(pytest_cmd(tmp_path, *workers), REPO, require_gpu=True)
    assert_refused(proc, f"{ENV}=1")
    assert proc.stdout == ""
    assert not (tmp_path / "junit.xml").exists() and not (tmp_path / "unit.json").exists()


@needs_no_cuda
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


# --- a GPU the kernels cannot run on -----------------------------------------------------------------

FAKE_CUPY = '''"""A stand-in for CuPy: the GPUs of FAKE_CUPY_GPUS ("name=capability;...", the capability as CuPy
spells it, "80" for 8.0), answered to the device queries the cuda backend makes; nothing runs."""
import os

_GPUS = [g.split("=") for g in os.environ.get("FAKE_CUPY_GPUS", "").split(";") if g]


class ndarray:
    pass


class _Runtime:
    class CUDARuntimeError(RuntimeError):
        pass

    @staticmethod
    def getDeviceCount():
        return len(_GPUS)

    @staticmethod
    def getDeviceProperties(i):
        return {"name": _GPUS[i][0].encode(), "multiProcessorCount": 132}


class Device:
    def __init__(self, i=0):
        self.id = i
        if not 0 <= i < len(_GPUS):
            raise _Runtime.CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self.compute_capability = _GPUS[i][1]

    def use(self):
        pass


class cuda:
    runtime = _Runtime
    Device = Device
'''

A100 = "NVIDIA A100-SXM4-80GB=80"
H200 = "NVIDIA H200=90"
B200 = "NVIDIA B200=100"
A100_WHY = "GPU 0 (NVIDIA A100-SXM4-80GB) is compute capability 8.0; the CUDA kernels are built for sm_90a (Hopper) only"


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    """`fake_gpus(*"name=capability")`: from then on, in this process (and in children run with
    `fake_gpus.pythonpath`), CuPy is FAKE_CUPY reporting those GPUs and `kernels.cuda` is imported afresh
    on it. This process's own CuPy and `kernels.cuda`, if any, come back afterwards."""
    folder = tmp_path / "fake_cupy"
    (folder / "cupy").mkdir(parents=True)
    (folder / "cupy" / "__init__.py").write_text(FAKE_CUPY)
    ours = [m for m in sys.modules if m.split(".")[0] == "cupy" or m.startswith("kernels.cuda")]
    for m in ours:
        monkeypatch.delitem(sys.modules, m)  # put back when the test ends
    # a `from kernels import cuda` looks at the package's attribute before sys.modules
    monkeypatch.delattr(kernels, "cuda", raising=False)
    monkeypatch.syspath_prepend(str(folder))

    def use(*gpus: str) -> None:
        monkeypatch.setenv("FAKE_CUPY_GPUS", ";".join(gpus))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    use.pythonpath = f"{folder}{os.pathsep}{REPO}"
    yield use
    for m in [m for m in sys.modules if m.split(".")[0] == "cupy" or m.startswith("kernels.cuda")]:
        del sys.modules[m]  # imported on the fake: gone before the real ones come back
    kernels.__dict__.pop("cuda", None)  # likewise the package's attribute (monkeypatch restores a real one)


def test_a_compute_capability_8_gpu_makes_the_cuda_backend_unavailable_naming_it(fake_gpus):
    fake_gpus(A100)
    assert backend_available("cuda") == (False, A100_WHY)


def test_a_compute_capability_9_gpu_makes_the_cuda_backend_available(fake_gpus):
    fake_gpus(H200, H200)
    assert backend_available("cuda") == (True, "NVIDIA H200")


def test_a_newer_gpu_than_the_kernels_are_built_for_is_refused_too(fake_gpus):
    """An sm_90a cubin does not run on Blackwell (compute capability 10.0): binary compatibility stops at
    the major version."""
    fake_gpus(B200)
    ok, why = backend_available("cuda")
    assert not ok and why.startswith("GPU 0 (NVIDIA B200) is compute capability 10.0; the CUDA kernels are built "
                                     "for sm_90a (Hopper) only"), why


@pytest.mark.parametrize("visible, keeps", [(None, "0,2"), ("5,3,7", "5,7")], ids=["all-visible", "already-narrowed"])
def test_one_gpu_the_kernels_cannot_run_on_among_several_makes_the_backend_unavailable(fake_gpus, monkeypatch,
                                                                                         visible, keeps):
    """Test workers take GPU N modulo the count, so every visible GPU must run the kernels; the reason
    names the first that cannot and the CUDA_VISIBLE_DEVICES (in its own numbering) that keeps the others."""
    fake_gpus(H200, A100, H200)
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    ok, why = backend_available("cuda")
    assert not ok
    assert why == (f"GPU 1 (NVIDIA A100-SXM4-80GB) is compute capability 8.0; the CUDA kernels are built for sm_90a "
                   f"(Hopper) only, and every visible GPU must run them (CUDA_VISIBLE_DEVICES={keeps} keeps those "
                   f"that can)")


def test_the_cuda_backend_refuses_to_start_on_a_gpu_it_cannot_run_on(fake_gpus):
    """Before it compiles anything (the stand-in cannot compile: getting that far would fail otherwise)."""
    fake_gpus(H200, A100)
    from kernels import BackendUnavailableError, get_backend

    with pytest.raises(BackendUnavailableError) as e:
        get_backend("cuda", device=1)
    assert str(e.value) == ("backend 'cuda' cannot run here: GPU 1 (NVIDIA A100-SXM4-80GB) is compute capability "
                            "8.0; the CUDA kernels are built for sm_90a (Hopper) only")


def test_generate_on_a_gpu_the_kernels_cannot_run_on_is_one_line(fake_gpus, capsys):
    from engine.cli import main as cli_main

    fake_gpus(A100)
    assert cli_main(["generate", "--prompt-ids", "1,2", "--new-tokens", "1", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == f"nanoqwen: error: backend 'cuda' cannot run here: {A100_WHY}\n", err


def test_pytest_refuses_a_required_cuda_backend_on_a_compute_capability_8_gpu(fake_gpus, tmp_path):
    """Exit 2 before collection, one line naming the GPU's capability (the child imports the stand-in)."""
    fake_gpus(A100)
    env = child_env(backend=None, pythonpath=fake_gpus.pythonpath, FAKE_CUPY_GPUS=A100)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(pytest_cmd(tmp_path, "--require-backend", "cuda"), cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=300)
    assert_refused(proc, "--require-backend cuda", A100_WHY)
    assert "compute capability 8.0" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "junit.xml").exists() and not (tmp_path / "unit.json").exists()
