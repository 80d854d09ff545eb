"""Self-test: the references' results are computed once per machine and kept (ladder/judges/reference_store.py).

Bounds: a second run reads what the first measured; a different key measures again; a lock left by a
process that is gone (a killed run) is taken over at once instead of being waited on; and two processes
asking at the same time measure once between them. Reference runs: read back equal, bit for bit; a new
prompt, token count or model runs again; a broken file is run again and replaced; many asked at once are
computed together, only the missing ones, by one worker while another asking for them waits and reads
them; a full forward is kept by its tokens and first position; NANOQWEN_FRESH_REFERENCES
runs everything again; the oldest models' runs go past the size budget, and a read counts as a use.
Block outputs: kept by their weights and input, a large block never; a seeded synthetic block (the 7B
shape's) kept with its quantized tensors by its recipe, checked again without drawing it, and a red one
still names its op. And a graph or layer rung whose
references are kept imports neither torch nor transformers.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fixtures.prompts import default_prompts_path
from ladder.judges import reference_store
from ladder.judges.tokens import Reference, bounds_from_floor

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

    assert reference_store.load_or_derive("k1", derive) == BOUNDS
    assert reference_store.load_or_derive("k1", derive) == BOUNDS and len(calls) == 1
    assert reference_store.load_or_derive("k2", derive) == BOUNDS and len(calls) == 2, "another key measures again"
    assert sorted(p.name for p in store.iterdir()) == ["k1.json", "k2.json"], "no lock or temporary file is left"


def test_a_failed_measurement_leaves_no_lock(store):
    def broken():
        raise ValueError("the floor is undefined")

    with pytest.raises(ValueError, match="undefined"):
        reference_store.load_or_derive("k", broken)
    assert list(store.iterdir()) == []
    assert reference_store.load_or_derive("k", lambda: BOUNDS) == BOUNDS


def test_a_lock_left_by_a_dead_process_is_taken_over(store):
    store.mkdir(parents=True)
    proc = multiprocessing.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join()  # a process id that has just ended
    (store / "k.lock").write_text(f"{proc.pid} {socket.gethostname()}")
    assert reference_store.load_or_derive("k", lambda: BOUNDS, poll=0.01) == BOUNDS
    assert not (store / "k.lock").exists()


def test_a_lock_held_by_a_live_process_is_waited_on(store, monkeypatch):
    store.mkdir(parents=True)
    (store / "k.lock").write_text(f"{os.getpid()} {socket.gethostname()}")  # this very process: alive
    assert not reference_store._abandoned(store / "k.lock")
    (store / "k.lock").write_text(f"{os.getpid()} another-host")  # another host's fresh lock: not stale yet
    assert not reference_store._abandoned(store / "k.lock")
    monkeypatch.setattr(reference_store, "STALE_LOCK_SECONDS", -1.0)
    assert reference_store._abandoned(store / "k.lock"), "another host's lock past the age limit is stale"


def _measure_in_child(cache: str, key: str, out: str) -> None:
    os.environ["NANOQWEN_CACHE"] = cache
    import time

    def derive():
        with open(out, "a") as f:
            f.write("measured\n")
        time.sleep(0.5)  # long enough for the other process to find the lock
        return BOUNDS

    reference_store.load_or_derive(key, derive, poll=0.05)


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


# ---- reference runs ------------------------------------------------------------------------------


def _run(seed: int, calls: list):
    def run() -> Reference:
        calls.append(seed)
        rng = np.random.default_rng(seed)
        logits = rng.standard_normal((3, 50)).astype(np.float32)
        return Reference(7, np.argmax(logits, axis=-1), logits)
    return run


@pytest.fixture(scope="module")
def tiny_model_path():
    """The default model's file, from the real cache (built there on first use), before `store` moves it."""
    from engine.resolve import resolve_model

    return resolve_model(None, progress=False)


@pytest.fixture(scope="module")
def other_model_path():
    from engine.resolve import resolve_model

    return resolve_model(None, quant="int8_sym_channel", progress=False)


@pytest.fixture
def kept(store, tiny_model_path):
    return reference_store.KeptReferences(tiny_model_path)


def test_a_kept_run_is_read_back_bit_for_bit_and_not_run_again(kept):
    calls = []
    first = kept.get([1, 2, 3], 3, _run(0, calls))
    again = kept.get([1, 2, 3], 3, _run(1, calls))
    assert calls == [0], "the kept run was run again"
    assert again.prompt_len == first.prompt_len == 7
    assert np.array_equal(again.tokens, first.tokens) and again.tokens.dtype == np.int64
    assert again.logits.dtype == np.float32 and np.array_equal(again.logits, first.logits)


def test_another_prompt_token_count_or_model_runs_again(kept, other_model_path):
    calls = []
    kept.get([1, 2, 3], 3, _run(0, calls))
    kept.get([1, 2, 4], 3, _run(1, calls))
    kept.get([1, 2, 3], 4, _run(2, calls))
    assert calls == [0, 1, 2]
    other = reference_store.KeptReferences(other_model_path)  # the same model in another format
    assert other.folder != kept.folder
    other.get([1, 2, 3], 3, _run(3, calls))
    assert calls == [0, 1, 2, 3]


def test_a_broken_kept_file_is_run_again_and_replaced(kept):
    calls = []
    kept.get([5, 6], 3, _run(0, calls))
    (path,) = kept.folder.glob("*.npz")
    path.write_bytes(path.read_bytes()[:40])  # a torn file
    ref = kept.get([5, 6], 3, _run(0, calls))
    assert calls == [0, 0] and ref.logits.shape == (3, 50)
    assert kept.get([5, 6], 3, _run(9, calls)).logits.shape == (3, 50) and calls == [0, 0]
    assert not list(kept.folder.glob(".*")), "a temporary file was left behind"


def test_fresh_references_runs_again(kept, monkeypatch):
    calls = []
    kept.get([1], 3, _run(0, calls))
    monkeypatch.setenv("NANOQWEN_FRESH_REFERENCES", "1")
    kept.get([1], 3, _run(0, calls))
    assert calls == [0, 0]


def _full(seed: int, calls: list):
    def run() -> np.ndarray:
        calls.append(seed)
        return np.random.default_rng(seed).standard_normal((4, 50)).astype(np.float32)
    return run


def test_a_kept_full_forward_is_read_back_bit_for_bit_and_other_tokens_or_start_run_again(kept, monkeypatch):
    calls = []
    first = kept.full_forward([1, 2, 3, 4], 1, _full(0, calls))
    again = kept.full_forward([1, 2, 3, 4], 1, _full(1, calls))
    assert calls == [0], "the kept full forward was run again"
    assert again.dtype == np.float32 and np.array_equal(again, first)
    kept.full_forward([1, 2, 3, 5], 1, _full(2, calls))
    kept.full_forward([1, 2, 3, 4], 2, _full(3, calls))
    assert calls == [0, 2, 3]
    assert kept.get([1, 2, 3, 4], 1, _run(4, calls)).logits.shape == (3, 50) and calls[-1] == 4  # not the same item
    monkeypatch.setenv("NANOQWEN_FRESH_REFERENCES", "1")
    kept.full_forward([1, 2, 3, 4], 1, _full(5, calls))
    assert calls[-1] == 5
    assert not list(kept.folder.glob(".*")), "a temporary file was left behind"


def _batch(calls: list):
    """A stand-in for the batched simulation: each item's run seeded by its first token id; the items asked for recorded."""
    def run(items):
        calls.append([list(ids) for ids, _ in items])
        return [_run(int(ids[0]), [])() for ids, _ in items]
    return run


def test_many_runs_are_computed_together_and_only_the_missing_ones(kept):
    calls = []
    kept.get([2], 3, _run(2, []))  # one kept already
    refs = kept.get_many([([1], 3), ([2], 3), ([3], 3)], _batch(calls))
    assert calls == [[[1], [3]]], "one batch, of the prompts not kept"
    assert np.array_equal(refs[0].logits, _run(1, [])().logits) and np.array_equal(refs[2].logits, _run(3, [])().logits)
    again = kept.get_many([([3], 3), ([1], 3)], _batch(calls))
    assert len(calls) == 1 and np.array_equal(again[1].logits, refs[0].logits), "kept ones are read, in the order asked"
    assert not [p.name for p in kept.folder.parent.iterdir() if p.name.endswith(".lock")], "the lock is let go"


def test_workers_asking_for_the_same_runs_compute_them_once(kept):
    import threading

    calls, slow = [], _batch([])

    def run(items):
        calls.append(len(items))
        time.sleep(0.3)  # the second asker arrives while the first computes
        return slow(items)

    items = [([4], 3), ([5], 3)]
    results = []
    threads = [threading.Thread(target=lambda: results.append(kept.get_many(items, run))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert calls == [2], "the second asker waited for the first and read what it kept"
    assert len(results) == 2 and all(np.array_equal(a.logits, b.logits) for a, b in zip(*results))


def test_a_failed_batch_leaves_no_lock_and_keeps_nothing(kept):
    def broken(items):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        kept.get_many([([6], 3)], broken)
    assert not list(kept.folder.parent.glob(".*.lock"))
    assert kept.get_many([([6], 3)], _batch([]))[0].logits.shape == (3, 50)


def test_reading_a_kept_run_marks_its_model_used(kept, tiny_model_path):
    kept.get([1, 2], 3, _run(0, []))
    os.utime(kept.folder, (1_000_000, 1_000_000))  # as if last used long ago
    calls = []
    reference_store.KeptReferences(tiny_model_path).get([1, 2], 3, _run(0, calls))  # a later run reads it
    assert calls == [] and time.time() - kept.folder.stat().st_mtime < 600, "a model in use would be pruned first"


def test_the_least_recently_used_models_go_past_the_size_budget(store, tmp_path):
    root = tmp_path / "runs"
    for i, name in enumerate(("oldest", "older", "newest")):
        (root / name).mkdir(parents=True)
        (root / name / "r.npz").write_bytes(b"x" * 100)
        os.utime(root / name, (time.time() - 100 + i, time.time() - 100 + i))
    reference_store._prune(root, 250)
    assert sorted(p.name for p in root.iterdir()) == ["newest", "older"]
    reference_store._prune(root, 10)
    assert [p.name for p in root.iterdir()] == ["newest"], "the newest model is kept whatever its size"


def test_rungs_whose_references_are_kept_import_neither_torch_nor_transformers(tmp_path, tiny_model_path):
    """Two graph cases and a layer case twice in fresh processes: the first with NANOQWEN_FRESH_REFERENCES
    computes the references (torch and transformers imported), the second reads what the first kept
    (graph: the run, the full forward and the bounds; layer: the HF block's outputs) and imports neither. A plugin of the
    test's own prints which were imported at the end. (The user's cache folder: its models are built.)"""
    one = tmp_path / "one-prompt.jsonl"  # one prompt: the first run's bounds measure one floor prompt
    one.write_text(default_prompts_path().read_text().splitlines()[0] + "\n")
    (tmp_path / "heavycheck.py").write_text(
        "import sys\n"
        "def pytest_sessionfinish(session):\n"
        "    print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    repo = Path(reference_store.__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", str(repo / "ladder" / "graph" / "test_graph.py"),
           str(repo / "ladder" / "layer" / "test_layer.py"), "-k", "greedy or full_recompute or (hf_decoder_layer and layer0-L29)",
           "--prompts", str(one), "-p", "ladder.plugin", "-p", "heavycheck", "-c", os.devnull, "--rootdir", str(repo),
           "-p", "no:cacheprovider", "-q", "-s", "--backend", "numpy", "--model", str(tiny_model_path)]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{tmp_path}"}
    for name in [k for k in env if k.startswith("PYTEST_") or k == "NANOQWEN_FRESH_REFERENCES"]:
        env.pop(name)
    runs = [subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**env, "NANOQWEN_FRESH_REFERENCES": fresh}) for fresh in ("1", "0")]
    for r in runs:
        assert r.returncode == 0 and "3 passed" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "HEAVY ['torch', 'transformers']" in runs[0].stdout, runs[0].stdout[-2000:]
    assert "HEAVY []" in runs[1].stdout, runs[1].stdout[-2000:]


def test_a_kept_block_is_read_back_and_another_input_or_weight_computes_again(store):
    rng = np.random.default_rng(0)
    weights = {"model.layers.0.w": rng.standard_normal((4, 4)).astype(np.float32),
               "model.layers.1.w": rng.standard_normal((4, 4)).astype(np.float32)}
    x = rng.standard_normal((3, 4)).astype(np.float32)
    calls = []

    def compute():
        calls.append(1)
        return rng.standard_normal((3, 4)), rng.standard_normal((3, 1, 4)), rng.standard_normal((3, 1, 4))

    first = reference_store.kept_block({"h": 4}, weights, 0, x, compute)
    again = reference_store.kept_block({"h": 4}, weights, 0, x, compute)
    assert len(calls) == 1 and all(np.array_equal(a, b) for a, b in zip(first, again))
    reference_store.kept_block({"h": 4}, weights, 0, x + 1, compute)  # another input
    weights["model.layers.0.w"][0, 0] += 1  # another weight of this layer
    reference_store.kept_block({"h": 4}, weights, 0, x, compute)
    weights["model.layers.1.w"][0, 0] += 1  # another layer's weight: the same block
    reference_store.kept_block({"h": 4}, weights, 0, x, compute)
    assert len(calls) == 3


def test_a_large_block_is_computed_every_time(store, monkeypatch):
    monkeypatch.setattr(reference_store, "BLOCK_KEPT_BELOW", 10)
    calls = []
    w = {"model.layers.0.w": np.zeros((4, 4), np.float32)}
    for _ in range(2):
        reference_store.kept_block({}, w, 0, np.zeros((1, 4), np.float32), lambda: calls.append(1) or (1, 2, 3))
    assert len(calls) == 2 and not reference_store.kept_root(reference_store.BLOCKS).exists()


def _plain64(config, weights, layer, x):  # a stand-in for the HF decoder layer: the float64 reference
    from reference.model import ref_block

    return ref_block(config, weights, layer, x, np.arange(len(x)))


SYNTHETIC_CASE = dict(layer=0, L=15, steps=20, seed=5)  # decode crosses 16 and 32


def test_a_kept_synthetic_block_is_checked_again_without_drawing_it(store, monkeypatch):
    """The 7B-shape case's path on a small shape: the first check draws, quantizes and keeps; the second
    reads the engine's tensors and both references' outputs back, bit for bit, and draws nothing."""
    from engine.config import SHAPES
    from fixtures.layer_cases import LayerCase
    from kernels import get_backend
    from ladder.checks import block as block_check

    config, case, backend = SHAPES["tiny"], LayerCase(**SYNTHETIC_CASE), get_backend("numpy")
    drawn, references = [], []
    real = block_check.BlockUnderTest.synthetic.__func__
    monkeypatch.setattr(block_check.BlockUnderTest, "synthetic",
                        classmethod(lambda cls, *a, **k: drawn.append(1) or real(cls, *a, **k)))
    hf = lambda *a: references.append(1) or _plain64(*a)  # noqa: E731
    block_check.check_synthetic_block(backend, config, 3, "int4_sym_g128", case, hf, against="float64 ref_block")
    assert drawn == [1] and references == [1]
    block_check.check_synthetic_block(backend, config, 3, "int4_sym_g128", case, hf, against="float64 ref_block")
    assert drawn == [1] and references == [1], "the second check drew the block or ran a reference again"
    kept_file, = reference_store.kept_root(reference_store.BLOCKS).glob("*.npz")
    with np.load(kept_file) as kept:
        fresh = real(block_check.BlockUnderTest, config, 3, "int4_sym_g128").stored
        assert sorted(kept.files) == sorted(["tensor/" + k for k in fresh] + [f"{w}/{n}" for w in ("ref", "plain")
                                                                             for n in "okv"])
        assert all(np.array_equal(kept["tensor/" + k], v) and kept["tensor/" + k].dtype == v.dtype
                   for k, v in fresh.items())
    block_check.check_synthetic_block(backend, config, 4, "int4_sym_g128", case, hf, against="float64 ref_block")
    block_check.check_synthetic_block(backend, config, 3, "int8_sym_channel", case, hf, against="float64 ref_block")
    assert drawn == [1, 1, 1], "another seed or format is another block"


def test_a_red_kept_synthetic_block_draws_its_weights_to_name_the_op(store):
    """A kept block whose check fails still names the op inside it: the reference's weights, not kept,
    are drawn again for the search (here the kept o_proj scales are doubled, as a broken conversion would)."""
    from engine.config import SHAPES
    from fixtures.layer_cases import LayerCase
    from kernels import get_backend
    from ladder.checks.block import check_synthetic_block

    config, case, backend = SHAPES["tiny"], LayerCase(**SYNTHETIC_CASE), get_backend("numpy")
    check_synthetic_block(backend, config, 3, "int4_sym_g128", case, _plain64, against="float64 ref_block")
    kept_file, = reference_store.kept_root(reference_store.BLOCKS).glob("*.npz")
    with np.load(kept_file) as z:
        arrays = {n: z[n] for n in z.files}
    arrays["tensor/model.layers.0.self_attn.o_proj.scales"] *= np.float16(2)  # the engine reads a wrong o_proj
    np.savez(kept_file, **arrays)
    with pytest.raises(AssertionError, match="block_output") as err:
        check_synthetic_block(backend, config, 3, "int4_sym_g128", case, _plain64, against="float64 ref_block")
    assert "the first op over its bound inside the block is o_proj" in str(err.value), str(err.value)[-600:]
