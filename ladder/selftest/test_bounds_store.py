"""Self-test: the graph rung's bounds are measured once per model and kept (ladder/bounds_store.py).

A second run reads what the first measured; a different key measures again; a lock left by a process
that is gone (a killed run) is taken over at once instead of being waited on; and two processes asking
at the same time measure once between them.
"""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest

from ladder import bounds_store
from ladder.tokens import bounds_from_floor

BOUNDS = bounds_from_floor(0.01, 4.0, 0.008, ("p1", "p2"), 32, floor_close=5, floor_flips=1, spread=3.0)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    return tmp_path / "graph-bounds"


def test_bounds_are_measured_once_and_read_back(store):
    calls = []

    def derive():
        calls.append(1)
        return BOUNDS

    assert bounds_store.load_or_derive("k1", derive) == BOUNDS
    assert bounds_store.load_or_derive("k1", derive) == BOUNDS and len(calls) == 1
    assert bounds_store.load_or_derive("k2", derive) == BOUNDS and len(calls) == 2, "another key measures again"
    assert sorted(p.name for p in store.iterdir()) == ["k1.json", "k2.json"], "no lock or temporary file is left"


def test_a_failed_measurement_leaves_no_lock(store):
    def broken():
        raise ValueError("the floor is undefined")

    with pytest.raises(ValueError, match="undefined"):
        bounds_store.load_or_derive("k", broken)
    assert list(store.iterdir()) == []
    assert bounds_store.load_or_derive("k", lambda: BOUNDS) == BOUNDS


def test_a_lock_left_by_a_dead_process_is_taken_over(store):
    store.mkdir(parents=True)
    proc = multiprocessing.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join()  # a process id that has just ended
    (store / "k.lock").write_text(f"{proc.pid} {socket.gethostname()}")
    assert bounds_store.load_or_derive("k", lambda: BOUNDS, poll=0.01) == BOUNDS
    assert not (store / "k.lock").exists()


def test_a_lock_held_by_a_live_process_is_waited_on(store, monkeypatch):
    store.mkdir(parents=True)
    (store / "k.lock").write_text(f"{os.getpid()} {socket.gethostname()}")  # this very process: alive
    assert not bounds_store._abandoned(store / "k.lock")
    (store / "k.lock").write_text(f"{os.getpid()} another-host")  # another host's fresh lock: not stale yet
    assert not bounds_store._abandoned(store / "k.lock")
    monkeypatch.setattr(bounds_store, "STALE_LOCK_SECONDS", -1.0)
    assert bounds_store._abandoned(store / "k.lock"), "another host's lock past the age limit is stale"


def _measure_in_child(cache: str, key: str, out: str) -> None:
    os.environ["NANOQWEN_CACHE"] = cache
    import time

    def derive():
        with open(out, "a") as f:
            f.write("measured\n")
        time.sleep(0.5)  # long enough for the other process to find the lock
        return BOUNDS

    bounds_store.load_or_derive(key, derive, poll=0.05)


def test_two_processes_asking_at_once_measure_once(tmp_path):
    out = tmp_path / "measured.txt"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_measure_in_child, args=(str(tmp_path), "k", str(out))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert out.read_text().count("measured") == 1
