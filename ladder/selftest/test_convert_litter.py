"""Self-test: an interrupted conversion leaves no litter.

A conversion stopped by SIGTERM or Ctrl-C removes its temporary file; one killed by SIGKILL leaves it
until the next conversion into the folder, which sweeps the temporary files of dead writers on this
host and nothing else. (The rest of the converter's behaviour: test_convert.py.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from engine.config import SHAPES
from engine.convert import convert
from engine.modelfile import ModelFile
from fixtures.tiny_model import build_random_model

SMALL = SHAPES["tiny"].replace(num_hidden_layers=2)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """The two-layer seeded checkpoint (fp16, no tokenizer), built once for this module."""
    return build_random_model(tmp_path_factory.mktemp("hf_small"), SMALL, seed=3, with_tokenizer=False)


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".nanoqwen-tmp-" in p.name or ".tmp-" in p.name)


# --- no litter: interrupted and killed conversions ------------------------------------------------

# A conversion in a fresh interpreter, each tensor read slowed by 50 ms so that a signal sent once the
# temporary file exists lands in the middle of the write on any machine.
# A job started in the background by a non-interactive shell (a CI runner, the nightly job) inherits
# SIGINT ignored; the child restores Python's own handler so Ctrl-C reaches it as it would at a terminal.
SLOW_MAIN = ("import signal, sys, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "import engine.convert as c; read = c.SafetensorsFolder.read; "
             "c.SafetensorsFolder.read = lambda self, n, **kw: (time.sleep(0.05), read(self, n, **kw))[1]; "
             "from engine.cli import main; sys.exit(main(sys.argv[1:]))")


def start_slow(args: list[str], env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", SLOW_MAIN, *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for_temp_file(proc: subprocess.Popen, folder: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if folder.is_dir() and temp_files(folder):
            return temp_files(folder)[0]
        assert proc.poll() is None, f"the conversion ended before writing: {proc.stderr.read().decode()}"
        time.sleep(0.005)
    proc.kill()
    raise AssertionError("no temporary file appeared")


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_a_terminated_conversion_removes_its_temporary_file(small_dir, tmp_path, sig, status):
    proc = start_slow(["convert", str(small_dir), str(tmp_path / "m.nanoqwen")])
    wait_for_temp_file(proc, tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == status, proc.stderr.read().decode()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_conversions_temporary_file_is_removed_by_the_next_conversion(small_dir, tmp_path):
    proc = start_slow(["convert", str(small_dir), str(tmp_path / "m.nanoqwen")])
    left = wait_for_temp_file(proc, tmp_path)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert temp_files(tmp_path) == [left]  # SIGKILL cannot be caught: the file stays, for now
    assert cli_main(["convert", str(small_dir), str(tmp_path / "other.nanoqwen")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.nanoqwen"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_generate_stopped_while_converting_leaves_nothing_in_the_cache(small_dir, tmp_path, monkeypatch, sig):
    from engine.resolve import resolve_model

    cache = tmp_path / "cache"
    proc = start_slow(["generate", "--model", str(small_dir), "--prompt-ids", "1,2"], {"NANOQWEN_CACHE": str(cache)})
    wait_for_temp_file(proc, cache / "converted")
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == (128 + sig if sig == signal.SIGTERM else -sig)
    monkeypatch.setenv("NANOQWEN_CACHE", str(cache))
    out = resolve_model(str(small_dir), progress=False)  # the cache's next use
    assert [p.name for p in (cache / "converted").iterdir()] == [out.name]
    ModelFile(out)


# --- the temporary-file rules themselves ----------------------------------------------------------


def test_only_temporary_files_of_dead_writers_on_this_host_are_swept(tmp_path):
    from engine.outpath import remove_stale_temp_files, temp_path

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, host = int(dead.stdout), socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {f".a.nanoqwen.nanoqwen-tmp-{dead_pid}@{host}": False,  # a killed writer here: swept
                 f"b.nanoqwen.tmp-{dead_pid}": False,                     # an earlier writer's name: swept
                 f".c.nanoqwen.nanoqwen-tmp-{live.pid}@{host}": True,    # a live writer: kept
                 f".d.nanoqwen.nanoqwen-tmp-{dead_pid}@elsewhere": True,  # another host's writer: kept
                 temp_path(tmp_path / "e.nanoqwen").name: True,           # this process: kept
                 f"notes.tmp-{dead_pid}": True, "f.nanoqwen": True}       # not ours: kept
        for name in names:
            (tmp_path / name).write_bytes(b"x")
        remove_stale_temp_files(tmp_path)
        assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept}
    finally:
        live.kill()
        live.wait()


def test_sigterm_raises_only_while_writing_and_its_handler_is_restored(small_dir, tmp_path):
    seen = []
    convert(small_dir, tmp_path / "m.nanoqwen", progress=lambda i, n, name: seen.append(signal.getsignal(signal.SIGTERM)))
    assert seen and all(h not in (signal.SIG_DFL, None) for h in seen)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
