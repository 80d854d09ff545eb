"""Running git for the ladder's commands (`nanoqwen ladder --changed`, `nanoqwen bisect`).

A git hook, or a command started from one, sets GIT_DIR, GIT_WORK_TREE and their kin, which would point
git at another repository than the one a command names: they are dropped. A git that cannot start, or a
command that fails when `check` is set, is the caller's error class, with git's last line of stderr.
"""

from __future__ import annotations

import os
import subprocess

LOCATION_VARIABLES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY",
                      "GIT_PREFIX")  # set by a hook, these would point git at another repository


def environment() -> dict:
    """This process's environment without the variables that would send git elsewhere."""
    return {k: v for k, v in os.environ.items() if k not in LOCATION_VARIABLES}


def run(cwd, *args: str, check: bool = True, error: type[Exception] = RuntimeError) -> subprocess.CompletedProcess:
    """`git ARGS` in `cwd`, its output as text; `error` raised when git cannot run or (with `check`) fails."""
    try:
        r = subprocess.run(["git", *args], cwd=cwd, env=environment(), capture_output=True, text=True, errors="replace")
    except FileNotFoundError:
        raise error("git is not installed (or not on PATH)") from None
    if check and r.returncode != 0:
        msg = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise error(f"git {' '.join(args)} failed: {msg}")
    return r
