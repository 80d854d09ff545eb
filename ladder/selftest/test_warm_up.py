"""Self-test: `nanoqwen ladder` warms the device backends up beside the model's conversion.

ladder/run/runner.py `start_warm_up` starts, in a process of its own, the warm-up of each selected backend
that needs a device and can run (CUDA: NVRTC on every module, into CuPy's on-disk kernel cache), and
`end_warm_up` waits for it before the rungs start, so their controllers find the cache full. On a machine
with no such backend nothing is started; a run that stops early ends the process rather than leave it.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import kernels
from ladder.run.runner import end_warm_up, start_warm_up


def test_no_device_backend_starts_nothing(monkeypatch):
    monkeypatch.setattr(kernels, "backend_available", lambda name: (name == "numpy", "here" if name == "numpy" else "no GPU"))
    assert start_warm_up(SimpleNamespace(backend="numpy")) is None
    assert start_warm_up(SimpleNamespace(backend=None)) is None  # every backend: cuda cannot run here


def test_each_runnable_device_backend_is_warmed_up_and_waited_for(monkeypatch):
    monkeypatch.setattr(kernels, "backend_available", lambda name: (True, "pretend"))
    proc = start_warm_up(SimpleNamespace(backend=None))
    assert proc is not None
    code = proc.args[-1]
    assert "backend_class('cuda').warm_up()" in code and "'numpy'" not in code  # the host backend needs none
    end_warm_up(proc)
    assert proc.returncode is not None, "the rungs must not start before the warm-up has ended"


def test_a_run_that_stops_early_ends_the_warm_up():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    end_warm_up(proc, stop=True)
    assert proc.returncode is not None and proc.returncode != 0
    end_warm_up(None)  # nothing started: nothing to do
