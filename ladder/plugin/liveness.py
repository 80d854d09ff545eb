"""Signs of life of a rung's processes, and the one line of a worker that died.

Beats. When NANOQWEN_PROGRESS_DIR names a folder (`nanoqwen ladder` gives each rung a fresh one), the
process that runs a case writes `PID.case` there as the case starts and as it ends (`[gw1] started
NODE ID`), and the controller's summary writes `PID.tests` as tests finish (`37 tests finished`, at most
once a second). engine/progress.py writes each progress line as `PID.line` in the same folder. The ladder
(ladder/run/runner.py run_rung) prints the `.line` files as they change, counts a change of any file as
progress, and stops a rung whose folder stays still for its stated time, naming the cases that had
started and not ended. Beats are files of their own, not progress lines, so they are never printed.

Vital signs. Each pytest-xdist worker writes its pid, its resident memory, the host's available and total
memory and the case it is running into `gwN.vitals`, every VITALS_SECONDS from a daemon thread, in the
folder the controller hands it (ladder/plugin/groups.py; not the progress folder: a worker stuck in a case still
samples, and that is no progress).

A worker's death. The worker is a child of the controller (execnet's popen gateway). When it dies,
pytest-xdist calls `pytest_testnodedown(node, error)`; the controller then reaps the child for its exit
status (a signal: SIGKILL for the kernel's out-of-memory killer, SIGSEGV for a crash in native code) and
reads the worker's last vital signs. pytest-xdist then reports the case the worker was running as failed
(`pytest_handlecrashitem`); that report's message becomes one line, `worker gw1 died while running NODE
ID: killed by signal 9 (SIGKILL: ...; its last resident memory 12.5 GB, host memory available 0.3 GB of
24.0 GB)`, which the rung prints on stderr as it happens, pytest's FAILED line and the report carry. A
worker that died between cases fails the run at its end with the same line (ladder/plugin/summary.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PROGRESS_DIR = "NANOQWEN_PROGRESS_DIR"  # the same variable as engine/progress.py's
CASE, TESTS, LINE = "case", "tests", "line"  # file suffixes in the progress folder (LINE: engine/progress.py)
VITALS_SECONDS = 1.0  # between a worker's samples of its memory
VITALS = ".vitals"  # suffix of a worker's vital signs in the groups folder


def beat(kind: str, text: str) -> None:
    """Write `text` as this process's latest `kind` beat into the progress folder, if one is set. Never
    raises: a sign of life must not break the work it reports on."""
    folder = os.environ.get(PROGRESS_DIR)
    if not folder:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = os.path.join(folder, f"{os.getpid()}.{kind}")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(f"[{worker}] {text}" if worker else text)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


# ---- memory ---------------------------------------------------------------------------------------


def memory() -> dict:
    """This process's resident memory and the host's available and total memory, in bytes (None where
    the system does not say: /proc is Linux's)."""
    out = {"rss": None, "available": None, "total": None}
    try:
        with open("/proc/self/statm") as f:
            out["rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    out["available" if key == "MemAvailable" else "total"] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def size(n: float | None) -> str:
    """`12.5 GB`, `830 MB` (decimal units), `?` when unknown."""
    if n is None:
        return "?"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


class Vitals:
    """A worker's vital signs, written to FOLDER/WORKER.vitals every VITALS_SECONDS by a daemon thread."""

    def __init__(self, folder: str, worker: str):
        self.path = Path(folder) / f"{worker}{VITALS}"
        self.case: str | None = None
        self._thread = threading.Thread(target=self._run, name="nanoqwen-vitals", daemon=True)

    def start(self) -> "Vitals":
        self.write()
        self._thread.start()
        return self

    def write(self) -> None:
        record = {"pid": os.getpid(), "case": self.case, "time": time.time(), **memory()}
        tmp = self.path.with_name(self.path.name + ".tmp")  # not gwN.tmp: the groups file's own
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:  # the controller removed the folder: the run is ending
            pass

    def _run(self) -> None:
        while True:
            time.sleep(VITALS_SECONDS)
            self.write()


def last_vitals(folder: str | None, worker: str) -> dict:
    if not folder:
        return {}
    try:
        return json.loads((Path(folder) / f"{worker}{VITALS}").read_text())
    except (OSError, ValueError):
        return {}


# ---- a worker's death ------------------------------------------------------------------------------

SIGNAL_CAUSES = {
    "SIGSEGV": "a segmentation fault in native code: an extension, a BLAS library or the interpreter",
    "SIGBUS": "a bus error in native code, such as a read of a memory-mapped file that was truncated",
    "SIGABRT": "aborted: native code failed an assertion",
    "SIGFPE": "a floating-point exception in native code",
    "SIGILL": "an illegal instruction: native code built for another processor",
    "SIGTERM": "terminated by another process",
    "SIGINT": "interrupted",
    "SIGHUP": "its terminal hung up",
}


def exit_status(node, timeout: float = 5.0) -> int | None:
    """The dead worker's exit status (negative: the signal that killed it), reaping the child execnet
    started; None where it cannot be had (another kind of gateway, or a process still running)."""
    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)
    if popen is None:
        return None
    try:
        return popen.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return None


def cause(status: int | None, vitals: dict) -> str:
    """Why a worker died, in words: the signal or exit status, and its last memory figures."""
    mem = ""
    if vitals.get("rss") is not None:
        mem = (f"its last resident memory {size(vitals['rss'])}, host memory available {size(vitals.get('available'))}"
               + (f" of {size(vitals['total'])}" if vitals.get("total") else ""))
    if status is None:
        what = "its process is gone (exit status unknown)"
        return f"{what}; {mem}" if mem else what
    if status >= 0:
        what = f"its process exited with status {status}"
        return f"{what}; {mem}" if mem else what
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    joint = "; "
    if name == "SIGKILL":
        available, total, rss = vitals.get("available"), vitals.get("total"), vitals.get("rss")
        if available is None or not total:
            why = "the kernel's out-of-memory killer, or another process"
        elif available < 0.1 * total or (rss is not None and rss > 0.5 * total):
            why = "most likely the kernel's out-of-memory killer"
        else:
            why, joint = "another process, or the kernel's out-of-memory killer; memory was not low at the last sample", ": "
    else:
        why = SIGNAL_CAUSES.get(name, "")
    head = f"{name}: {why}" if why else name
    return f"killed by signal {-status} ({head}{joint + mem if mem else ''})"


def death_line(worker: str, case: str | None, why: str) -> str:
    where = f"while running {case}" if case else "between cases"
    return f"worker {worker} died {where}: {why}"


def rung_of(nodeid: str | None, config=None) -> str | None:
    """The rung of a case, from its path, else from the run's `-m RUNG` (a rung's pytest, `nanoqwen ladder`)."""
    from ladder.plugin.summary import RUNGS

    path = (nodeid or "").replace(os.sep, "/")
    mark = getattr(getattr(config, "option", None), "markexpr", None)
    return next((r for r in RUNGS if f"ladder/{r}/" in path), mark if mark in RUNGS else None)


def say(config, line: str, rung: str | None) -> None:
    """The line on stderr, at once, after pytest's own line of dots is ended."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        if getattr(getattr(tr, "_tw", None), "width_of_current_line", 0):
            tr.write("\n")
        getattr(tr, "flush", lambda: None)()
    print(f"nanoqwen: {f'rung {rung}: ' if rung else ''}{line}", file=sys.stderr, flush=True)
