"""The graph rung's bounds, measured once per model and kept (ladder/tokens.py derive_bounds).

Measuring a model's floor costs a reference run and a plain forward on each floor prompt: seconds on the
default model, minutes at the 0.5B shape on a CPU, and every pytest-xdist worker of the graph rung
needs the same bounds. So the first worker to need them measures them while holding a lock file (its
process id and host inside); the others wait for its result, and later runs read it. A lock whose
process is gone (a killed run) is taken over at once. The key is everything the bounds depend on: the
model's fingerprint (its format, config and tensor checksums), the floor prompts' token ids, the number
of new tokens, the sources that measure and judge (ladder/tokens.py, ladder/tolerances.py, reference/),
and the versions of numpy, torch and transformers. A changed input is a new key, never a stale file.

Kept under the nanoqwen cache folder (`graph-bounds/KEY.json`, written atomically).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from ladder.tokens import GraphBounds

STALE_LOCK_SECONDS = 3600.0  # a lock from another host older than this belongs to a worker that died
_HERE = Path(__file__).resolve().parent
SOURCES = (_HERE / "tokens.py", _HERE / "tolerances.py", *sorted((_HERE.parent / "reference").glob("*.py")))


def bounds_key(model_path, floor_prompts, new_tokens) -> str:
    import numpy
    import torch
    import transformers

    from fixtures.golden import model_fingerprint

    h = hashlib.sha256()
    for f in SOURCES:
        h.update(f.name.encode() + f.read_bytes())
    h.update(json.dumps([model_fingerprint(model_path), [(p.id, list(p.ids)) for p in floor_prompts], new_tokens,
                         numpy.__version__, torch.__version__, transformers.__version__]).encode())
    return h.hexdigest()[:24]


def store_root() -> Path:
    from engine.resolve import cache_root

    return cache_root() / "graph-bounds"


def _abandoned(lock: Path) -> bool:
    """A lock whose measuring process is gone (killed, say): its process id on this host no longer runs,
    or, for a lock from another host sharing the cache folder, it is older than STALE_LOCK_SECONDS."""
    try:
        pid, _, host = lock.read_text().partition(" ")
        age = time.time() - lock.stat().st_mtime
    except (FileNotFoundError, ValueError):
        return False
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return age > STALE_LOCK_SECONDS


def load_or_derive(key: str, derive: Callable[[], GraphBounds], poll: float = 0.5) -> GraphBounds:
    """The kept bounds of `key`, else derive them (one process at a time: the others wait) and keep them."""
    root = store_root()
    root.mkdir(parents=True, exist_ok=True)
    path, lock = root / f"{key}.json", root / f"{key}.lock"
    while True:
        if path.exists():
            return GraphBounds.from_record(json.loads(path.read_text()))
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _abandoned(lock):
                lock.unlink(missing_ok=True)
            else:
                time.sleep(poll)
            continue
        try:
            os.write(fd, f"{os.getpid()} {socket.gethostname()}".encode())
            os.close(fd)
            if path.exists():  # kept by a process that held the lock between our look and our lock
                return GraphBounds.from_record(json.loads(path.read_text()))
            bounds = derive()
            tmp = root / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(bounds.record()))
            os.replace(tmp, path)
            return bounds
        finally:
            lock.unlink(missing_ok=True)
