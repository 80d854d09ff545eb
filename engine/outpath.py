"""Output files that never leave litter: checked before any work, written through a temporary file.

`check_output_path(path)` refuses, with one `OutputPathError` line, a path that cannot become a file:
a folder, a missing parent, a parent that is a file, a parent this process may not write into.
Writers call it before reading their first input tensor. `check_output_folder` does the same for a
report folder that may not exist yet.

`temp_path(path)` is the writer's temporary file in the same folder, `.NAME.nanoqwen-tmp-PID@HOST`:
hidden, unmistakably ours, and naming its writer. Inside `removing_on_termination()` a SIGTERM or
SIGHUP (whose default action kills the process on the spot) raises `SystemExit(128 + signal)`
instead, so the writer's `finally` removes the file; Ctrl-C is already a `KeyboardInterrupt`.
SIGKILL cannot be caught: `remove_stale_temp_files(folder)`, which every writer runs first, removes
the temporary files in the folder whose writer (on this host) is no longer alive, and leaves a live
writer's file alone.

`signals_deferred()` holds those exceptions back while the main thread is inside a thread pool's own
code (engine/modelfile.py `ordered_map`), and raises them as soon as it leaves.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
from pathlib import Path

from engine.errors import OutputPathError

_TEMP = re.compile(r"^\.(?P<target>.+)\.nanoqwen-tmp-(?P<pid>\d+)@(?P<host>.+)$")
_LEGACY_TEMP = re.compile(r"^(?P<target>.+\.nanoqwen)\.tmp-(?P<pid>\d+)$")  # earlier writers: NAME.tmp-PID


def check_output_path(path) -> Path:
    """`path` as a Path, after refusing what cannot be written there (before any work is done)."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise OutputPathError(path, "is a folder; give the output file's name (e.g. model.nanoqwen)")
    if not parent.exists():
        raise OutputPathError(path, f"folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputPathError(path, f"{parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(path, f"folder {parent} is not writable")
    return path


def check_output_folder(folder) -> Path:
    """`folder` as a Path, after refusing one that cannot be created or written (nothing is created)."""
    folder = Path(folder)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(folder, f"{existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(folder, f"folder {existing} is not writable")
    return folder


def temp_path(path) -> Path:
    """This process's temporary file for `path`, in the same folder (so the rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.nanoqwen-tmp-{os.getpid()}@{socket.gethostname()}")


def open_temp(tmp, path):
    """Open the temporary file `tmp` for writing `path`; an OutputPathError if it cannot be created."""
    try:
        return open(tmp, "wb")
    except OSError as e:
        raise OutputPathError(path, f"cannot create a file in folder {Path(tmp).parent} ({e.strerror or e})") from None


def _writer_alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # on Windows os.kill(pid, 0) would end the process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists, owned by someone else (or we cannot tell): leave its file alone
    return True


def remove_stale_temp_files(folder) -> list[Path]:
    """Remove the temporary files in `folder` whose writer on this host is gone; returns them."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    host = socket.gethostname()
    for name in names:
        m = _TEMP.match(name)
        if m and m["host"] != host:
            continue  # another machine's writer (a shared folder): its pids are not ours to judge
        m = m or _LEGACY_TEMP.match(name)
        if not m or _writer_alive(int(m["pid"])):
            continue
        p = Path(folder) / name
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                p.unlink()
                removed.append(p)
    return removed


class _Terminated(SystemExit):
    """SIGTERM/SIGHUP during a write: leave through every `finally`, exit status 128 + signal."""


def _raise_terminated(signum, frame):
    raise _Terminated(128 + signum)


@contextlib.contextmanager
def removing_on_termination():
    """While inside: a SIGTERM or SIGHUP whose action is still the default raises SystemExit (so the
    temporary file is removed on the way out) instead of killing the process; handlers installed by
    someone else are left as they are. Outside the main thread (no signals there) this does nothing."""
    installed = {}
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
                installed[sig] = signal.signal(sig, _raise_terminated)
    try:
        yield
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)


_DEFERRED = ("SIGINT", "SIGTERM", "SIGHUP")


@contextlib.contextmanager
def signals_deferred():
    """While inside (the main thread): a SIGINT, SIGTERM or SIGHUP whose handler is Python code (Ctrl-C's
    KeyboardInterrupt, `removing_on_termination`'s exit) is recorded, not acted on; on the way out the
    handlers are put back and the first signal recorded goes to its own, which raises here, where no lock
    is held. A handler raises at whatever bytecode the main thread is at, and one raised inside
    concurrent.futures' code (a `with lock:` between its acquire and its try, a Condition's wait) can
    leave a lock held that a worker thread or the pool's shutdown then waits on forever. Handlers that
    are not Python code (the default action, ignored) are left alone; outside the main thread this does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    previous: dict = {}
    try:
        for name in _DEFERRED:
            sig = getattr(signal, name, None)
            if sig is not None and callable(handler := signal.getsignal(sig)):
                previous[sig] = handler
                signal.signal(sig, lambda signum, frame: caught.append((signum, frame)))
        yield
    finally:
        # Held off while the handlers go back, so that none lands between two of them (one put back, the
        # next still recording into a list nobody reads); one that came meanwhile is delivered after.
        held = set(previous) if hasattr(signal, "pthread_sigmask") else set()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, held) if held else None
        try:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        finally:
            if held:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
        if caught:
            signum, frame = caught[0]
            previous[signum](signum, frame)
