"""Unit rung: the installed `nanoqwen` command works away from the repository (no checkout on sys.path)."""

from __future__ import annotations

import shutil
import subprocess

import pytest


@pytest.mark.parametrize("command", ["ladder", "generate", "convert", "inspect", "bench", "descend", "bisect"])
def test_installed_command_line_knows_every_subcommand(tmp_path, command):
    exe = shutil.which("nanoqwen")
    if exe is None:
        pytest.skip("nanoqwen is not installed here (pip install -e '.[test]'); the checkout runs python -m ladder")
    r = subprocess.run([exe, command, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: nanoqwen" in r.stdout, r.stderr[-2000:]
