"""The one progress line of the project: conversion, model building, the references and the bounds.

    bar = progress_bar("convert", unit="tensors")     # show(i, n, name) after each step
    p = Progress("graph references [int4_sym_g128]", total=100, unit="prompts")
    p.step(what="p017")                               # a line at most every `every` seconds, and the last

On a terminal the bar is one line redrawn in place; into a file or a pipe (CI logs, a pytest worker) it is
a plain line at most every `every` seconds (PROGRESS_EVERY, 10 by default) and at the end, never a wall of
carriage returns. Each line says what is done of how much, the time so far and an estimate of the time
left, from the rate so far: `convert: 120/452 tensors, 31.0 s, about 1 min 26 s left`.

A pytest-xdist worker's stderr is captured, so a line from inside a fixture would be seen by nobody.
When NANOQWEN_PROGRESS_DIR names a folder (`nanoqwen ladder` sets it for each rung), every line is also
written there, one file per process (`PID.line`, replaced at each line): the ladder prints the new lines
as they come, and a rung whose folder stays silent for its stated time is stopped (ladder/run/runner.py).
`heartbeat(text)` writes there alone: a sign of life without a line on stderr.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

PROGRESS_EVERY = float(os.environ.get("NANOQWEN_PROGRESS_EVERY", "10"))  # seconds between plain lines
PROGRESS_DIR = "NANOQWEN_PROGRESS_DIR"  # the environment variable naming the ladder's progress folder

_open = {"bar": False}  # whether a bar's line on stderr is still unfinished (a terminal's redraw)


def duration(seconds: float) -> str:
    """`4.2 s`, `1 min 26 s`, `1 h 02 min`: a time a person reads at a glance."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def progress_text(label: str, done: float, total: float | None, elapsed: float, unit: str = "") -> str:
    """`label: done/total unit, elapsed, about T left` (no estimate before the first step or without a total)."""
    unit = f" {unit}" if unit else ""
    if total and done <= total:  # past an estimated total, the count alone
        text = f"{label}: {_num(done)}/{_num(total)}{unit}, {duration(elapsed)}"
        if 0 < done < total and elapsed >= 1.0:  # before a second has passed, the rate says little
            text += f", about {duration(elapsed * (total - done) / done)} left"
        return text
    return f"{label}: {_num(done)}{unit}, {duration(elapsed)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def heartbeat(text: str) -> None:
    """Write `text` as this process's latest line into the ladder's progress folder, if one is set.
    Never raises: a progress line must not break the work it reports on."""
    folder = os.environ.get(PROGRESS_DIR)
    if not folder:
        return
    path = os.path.join(folder, f"{os.getpid()}.line")
    tmp = path + ".tmp"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    try:
        with open(tmp, "w") as f:
            f.write(f"[{worker}] {text}" if worker else text)
        os.replace(tmp, path)
    except OSError:
        pass


class Progress:
    """Progress of `total` steps of `unit` under `label`: `step()` after each, `finish()` at the end."""

    def __init__(self, label: str, total: float | None, unit: str = "", every: float | None = None,
                 stream=None, tty: bool | None = None):
        self.label, self.total, self.unit = label, total, unit
        self.every = PROGRESS_EVERY if every is None else every
        self.stream = stream
        self.tty = tty
        self.done = 0.0
        self.start = time.perf_counter()
        self._said = -1.0

    def _out(self):
        return self.stream if self.stream is not None else sys.stderr

    def _is_tty(self) -> bool:
        if self.tty is not None:
            return self.tty
        try:
            return self._out().isatty()
        except (AttributeError, ValueError):
            return False

    def line(self, what: str = "") -> str:
        text = progress_text(self.label, self.done, self.total, time.perf_counter() - self.start, self.unit)
        return f"{text} ({what})" if what else text

    def step(self, n: float = 1, what: str = "") -> None:
        self.update(self.done + n, what)

    def update(self, done: float, what: str = "") -> None:
        """`done` steps so far: a line when `every` seconds have passed since the last, and at the end."""
        self.done = done
        last = bool(self.total) and done >= self.total
        first = self._said < 0  # the first step always says so: a sign of life before the estimate settles
        if last or first or time.perf_counter() - self._said >= (0.1 if self._is_tty() else self.every):
            self._emit(what, last)

    @contextmanager
    def working(self, what: str = ""):
        """Around one long step: a line every `every` seconds while it runs (a 1.5B model's reference run
        on 2 cores takes 8 s a prompt, its plain forward longer), so that silence means a stall."""
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(self.every):
                self._emit(f"{what}, running" if what else "running", False)

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield self
        finally:
            stop.set()
            ticker.join()

    def finish(self, what: str = "") -> None:
        """The last line now, whatever the count (for a total that was only an estimate)."""
        self.total = self.done or self.total
        self._emit(what, True)

    def _emit(self, what: str, last: bool) -> None:
        self._said = time.perf_counter()
        text = self.line(what)
        out, tty = self._out(), self._is_tty()
        try:
            if tty:  # `label [####......] 3/10 unit, 1.2 s, about 2.8 s left  what`, redrawn in place
                done = int(30 * min(self.done / self.total, 1)) if self.total else 0
                head, _, rest = text.partition(": ")
                drawn = f"{head} [{'#' * done}{'.' * (30 - done)}] {rest}" if self.total else text
                out.write(f"\r{drawn[:150]:<150}" + ("\n" if last else ""))
                _open["bar"] = not last
            else:
                out.write(text + "\n")
            out.flush()
        except (OSError, ValueError):
            pass
        heartbeat(text)


def progress_bar(label: str, unit: str = "tensors", every: float | None = None):
    """A progress callback `show(i, n, name)` on stderr (the converter's and the model maker's); see
    `Progress`. `end_progress_line` finishes a terminal's open bar before an error message."""
    state: dict = {}

    def show(i: int, n: int, name: str) -> None:
        if "p" not in state:
            state["p"] = Progress(label, n, unit, every=every)
        p = state["p"]
        p.total = n
        p.update(i, name[-48:] if p._is_tty() else "")

    return show


def end_progress_line() -> None:
    """Start a fresh stderr line if a progress bar left one unfinished (before an error message)."""
    if _open["bar"]:
        _open["bar"] = False
        sys.stderr.write("\n")
