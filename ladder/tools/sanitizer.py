"""Where compute-sanitizer is, and what its exit status means: shared by `nanoqwen mutate`'s second look at
CUDA survivors (ladder/tools/mutate.py) and the nightly's sanitizer script (bench/sanitize.py).

CuPy's memory pool must be off in a process checked for memory errors: with the pool on, a write past
the end of an array lands inside a larger pooled block, which memcheck sees as valid memory. A pytest run
turns it off when POOL_VARIABLE is "0" (ladder/checks/harness.py `honour_pool_variable`, called by the
ladder's plugin).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ladder.checks.harness import POOL_VARIABLE  # noqa: F401 - "0": CuPy allocates each array from the driver

ERROR_EXIT = 86  # the exit status compute-sanitizer is told to use when it reports an error (--error-exitcode)


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else under CUDA_HOME, CUDA_PATH, /usr/local/cuda or beside nvcc."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        for cand in (Path(root) / "bin" / "compute-sanitizer", Path(root) / "compute-sanitizer" / "compute-sanitizer"):
            if cand.exists():
                return str(cand)
    return None


def command(sanitizer: str, tool: str, *argv: str, print_limit: int = 10) -> list[str]:
    """`argv` run under `tool`, exiting ERROR_EXIT when the tool reports an error."""
    return [sanitizer, "--tool", tool, "--error-exitcode", str(ERROR_EXIT), "--print-limit", str(print_limit), *argv]
