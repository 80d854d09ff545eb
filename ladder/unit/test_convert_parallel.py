"""Unit rung: the converter's worker threads change how fast a model is written, never what is written.

For every format, a conversion on four threads writes the same bytes as one on a single thread (the
plain loop); the ordered map under both passes hands results out in order, holds at most `ahead` of
them, and raises an item's error at its turn; Ctrl-C while it waits ends it with no thread left (the
signal held back while inside the pool's code); a failure on a worker leaves no file behind; and
NANOQWEN_CONVERT_THREADS is a positive integer or a one-line error.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from engine.config import SHAPES
from engine.convert import CheckpointError, SafetensorsFolder, convert
from engine.formats import FORMATS
from engine.modelfile import MAX_THREADS, ThreadCountError, ordered_map, worker_threads
from engine.outpath import removing_on_termination, signals_deferred
from fixtures.tiny_model import build_random_model

SMALL = SHAPES["tiny"].replace(num_hidden_layers=2)


@pytest.fixture(scope="module", params=[np.float16, np.float32], ids=["fp16", "fp32"])
def checkpoint(request, tmp_path_factory):
    """A two-layer seeded checkpoint (fp16, and fp32 so that the scan and the reads see other bits)."""
    folder = tmp_path_factory.mktemp(f"hf_{request.param.__name__}")
    return build_random_model(folder, SMALL, seed=11, dtype=request.param)


@pytest.mark.parametrize("quant", sorted(FORMATS))
def test_four_threads_write_the_bytes_one_thread_writes(checkpoint, tmp_path, quant):
    one, four = tmp_path / "one.nanoqwen", tmp_path / "four.nanoqwen"
    convert(checkpoint, one, quant, threads=1)
    steps = []
    convert(checkpoint, four, quant, threads=4, progress=lambda i, n, name: steps.append((i, n)))
    assert one.read_bytes() == four.read_bytes(), f"{quant}: the parallel conversion wrote other bytes"
    assert [i for i, _ in steps] == list(range(1, len(steps) + 1)) and steps[-1][0] == steps[-1][1]


def test_ordered_map_keeps_the_order_and_at_most_ahead_items_in_flight():
    live, most, lock = [0], [0], threading.Lock()

    def work(i):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.002 * (i % 3))  # later items often finish first
        return i

    with ordered_map(work, range(40), threads=4, ahead=5) as results:
        out = []
        for r in results:
            with lock:
                live[0] -= 1
            out.append(r)
    assert out == list(range(40)) and most[0] <= 5


@pytest.mark.parametrize("threads", [1, 3])
def test_ordered_map_raises_the_first_failing_item_in_order(threads):
    def work(i):
        if i in (4, 2):
            time.sleep(0.01 if i == 2 else 0)  # item 4 fails first in time, item 2 first in order
            raise ValueError(f"item {i}")
        return i

    got = []
    with pytest.raises(ValueError, match="item 2"):
        with ordered_map(work, range(10), threads) as results:
            got.extend(results)
    assert got == [0, 1]
    assert not [t for t in threading.enumerate() if t.name.startswith("nanoqwen-worker")]


@pytest.fixture
def ctrl_c():
    """Ctrl-C as at a terminal (Python's KeyboardInterrupt handler) for the case: a test run started in
    the background by a non-interactive shell (a CI runner, say) inherits SIGINT ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_signal_inside_a_deferred_section_is_raised_as_it_leaves(ctrl_c):
    """Ctrl-C and a SIGTERM under removing_on_termination wait for the section's end, then raise there,
    with the handlers put back."""
    for sig, expected in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)):
        reached = False
        with removing_on_termination():
            handler = signal.getsignal(sig)
            with pytest.raises(expected) as raised:
                with signals_deferred():
                    os.kill(os.getpid(), sig)
                    time.sleep(0.05)  # the handler has run by now: recorded, not raised
                    reached = True
            assert reached, f"{sig.name} was raised inside the section"
            assert signal.getsignal(sig) is handler, f"{sig.name}'s handler was not put back"
        if expected is SystemExit:
            assert raised.value.code == 128 + signal.SIGTERM


def test_ctrl_c_while_the_map_waits_on_a_worker_ends_it_and_every_thread(ctrl_c):
    """A SIGINT that lands while the caller waits on a worker's result (inside the pool's own code, where
    an exception could leave one of its locks held) is a KeyboardInterrupt from the map, soon after, and
    no worker thread outlives it."""
    def work(i):
        if i == 2:
            os.kill(os.getpid(), signal.SIGINT)  # the caller is waiting on item 0's result
        time.sleep(0.02)
        return i

    got = []
    with pytest.raises(KeyboardInterrupt):
        with ordered_map(work, range(100), threads=2, ahead=4) as results:
            got.extend(results)
    assert len(got) < 100
    assert not [t for t in threading.enumerate() if t.name.startswith("nanoqwen-worker")]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failure_on_a_worker_thread_leaves_no_file(checkpoint, tmp_path, monkeypatch):
    read = SafetensorsFolder.read

    def fails_on_a_late_tensor(self, name, **kw):
        if name == "model.layers.1.mlp.up_proj.weight":
            raise CheckpointError(f"{self.folder}: tensor {name} could not be read (planted)")
        return read(self, name, **kw)

    monkeypatch.setattr(SafetensorsFolder, "read", fails_on_a_late_tensor)
    with pytest.raises(CheckpointError, match="planted"):
        convert(checkpoint, tmp_path / "m.nanoqwen", threads=4)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value,expect", [("3", 3), (" 1 ", 1), ("40", 40)])
def test_the_thread_count_comes_from_the_environment(monkeypatch, value, expect):
    monkeypatch.setenv("NANOQWEN_CONVERT_THREADS", value)
    assert worker_threads() == expect


def test_the_thread_count_is_the_cores_at_most_sixteen(monkeypatch):
    monkeypatch.delenv("NANOQWEN_CONVERT_THREADS", raising=False)
    assert 1 <= worker_threads() <= MAX_THREADS == 16


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_thread_count_that_is_not_a_positive_integer_is_one_line(monkeypatch, value):
    monkeypatch.setenv("NANOQWEN_CONVERT_THREADS", value)
    with pytest.raises(ThreadCountError, match="NANOQWEN_CONVERT_THREADS is .*positive integer"):
        worker_threads()


@pytest.mark.parametrize("quiet_s,scanned", [(0.0, True), (60.0, False)], ids=["slow-scan", "quick-scan"])
def test_a_scan_slower_than_its_quiet_time_is_counted_in_the_progress(checkpoint, tmp_path, monkeypatch, quiet_s,
                                                                      scanned):
    """A long scan (a 7B checkpoint's) shows its progress; a quick one says nothing, so a checkpoint it
    refuses is one line, the error."""
    monkeypatch.setattr("engine.convert.SCAN_QUIET_S", quiet_s)
    steps = []
    convert(checkpoint, tmp_path / "m.nanoqwen", threads=2, progress=lambda i, n, name: steps.append((i, n, name)))
    checks = [s for s in steps if s[2].startswith("check ")]
    assert bool(checks) == scanned and steps[:len(checks)] == checks
    assert [i for i, _, _ in steps] == list(range(1, len(steps) + 1)) and {n for _, n, _ in steps} == {len(steps)}
