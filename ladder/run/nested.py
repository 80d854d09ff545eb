"""Running the ladder inside a test: a pytest or `nanoqwen` subprocess started by a test of the ladder.

Two things go wrong with such runs, and both were seen: the child inherits the parent's environment
(the nightly GPU job's NANOQWEN_REQUIRE_GPU=1 turns a child that selects only numpy into a usage error,
exit 4), and a child that selects by keyword (`-k attention`) selects the very test that started it,
which starts another child, and so on. `child_env` gives the child the environment of the one backend
it runs and the NESTED mark; a test that starts children carries `skip_inside_nested_run`, so inside a
child it skips instead of recursing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import backend_names, backend_needs_device

REPO = Path(__file__).resolve().parents[2]
NESTED = "NANOQWEN_NESTED_RUN"
_PARENT_ONLY = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS", "PYTHONPATH")

skip_inside_nested_run = pytest.mark.skipif(os.environ.get(NESTED) == "1",
                                            reason="inside a run that a ladder test started (no recursion)")


def child_env(backend: str | None = "numpy", pythonpath: str | None = str(REPO), **extra: str) -> dict:
    """The environment of a child run on `backend` (None: it selects no backend of its own)."""
    env = {k: v for k, v in os.environ.items() if k not in _PARENT_ONLY}
    if not (backend in backend_names() and backend_needs_device(backend)):
        env.pop("NANOQWEN_REQUIRE_GPU", None)  # a requirement for a GPU is a usage error in a CPU-only run
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env[NESTED] = "1"
    env.update(extra)
    return env


def run_pytest(args: list[str], backend: str = "numpy", timeout: int = 600) -> subprocess.CompletedProcess:
    """`pytest --backend BACKEND ARGS` from the checkout, without xdist or a cache folder."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--backend", backend, *args], cwd=REPO, capture_output=True, text=True,
                          env=child_env(backend), timeout=timeout)
