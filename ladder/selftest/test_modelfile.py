"""Self-test: the .nanoqwen file. Good files round-trip; every malformed case of the catalogue
(fixtures/corrupt.py) raises its own ModelFileError subclass before a tensor is used, and the command
line turns it into one line on stderr and exit status 2, never a traceback. A config the table cannot
hold is refused before anything is built; loading thousands of times leaks no descriptor or map.
(ladder/selftest/test_fuzz_modelfile.py mutates files at random.)"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import engine
from engine import errors as E
from engine.modelfile import MAGIC, ModelFile, PendingTensor, write_model
from engine.tokenizer import embedded_tokenizer
from fixtures.corrupt import CASES, _config
from fixtures.fuzz import seed_file
from fixtures.tiny_model import random_model_file
from engine.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good_file() -> Path:
    return random_model_file()


def test_file_starts_with_magic_version_and_header_length(good_file):
    head = good_file.read_bytes()[:20]
    assert head[:8] == MAGIC == bytes([0x4E, 0x41, 0x4E, 0x4F, 0x51, 0x57, 0x45, 0x4E])
    assert int.from_bytes(head[8:12], "little") == 1
    mf = ModelFile(good_file)
    assert 20 + int.from_bytes(head[12:20], "little") <= min(e.offset for e in mf.tensors.values())


def test_tensors_are_aligned_and_keep_hf_names(good_file):
    mf = ModelFile(good_file)
    assert all(e.offset % 64 == 0 for e in mf.tensors.values())
    assert "model.layers.3.self_attn.q_proj.qweight" in mf.tensors
    assert "model.layers.3.self_attn.q_proj.scales" in mf.tensors
    assert "model.layers.3.self_attn.q_proj.bias" in mf.tensors
    assert mf.file("tokenizer.json")


def test_write_then_read_round_trips_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float16), "b": rng.integers(0, 2**32, (4, 2), dtype=np.uint32),
              "c": np.arange(7, dtype=np.int32), "d": rng.standard_normal(9).astype(np.float32), "e": np.zeros((0, 4), np.float16)}
    write_model(tmp_path / "m.nanoqwen", {"k": 1}, "int4_sym_g128",
                [PendingTensor(n, a.dtype.name, a.shape, lambda a=a: a) for n, a in arrays.items()], files={"x.txt": b"hello"})
    mf = ModelFile(tmp_path / "m.nanoqwen")
    for n, a in arrays.items():
        assert mf.tensor(n).dtype == a.dtype and np.array_equal(mf.tensor(n), a)
    assert mf.file("x.txt") == b"hello" and mf.config_dict == {"k": 1}


def test_a_crash_while_writing_leaves_no_file(tmp_path):
    def boom():
        raise RuntimeError("disk on fire")

    target = tmp_path / "m.nanoqwen"
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_model(target, {}, "int4_sym_g128", [PendingTensor("a", "float16", (2,), lambda: np.zeros(2, np.float16)),
                                                   PendingTensor("b", "float16", (2,), boom)])
    assert list(tmp_path.iterdir()) == []


def test_rewriting_an_existing_model_replaces_it_whole(tmp_path, good_file):
    target = tmp_path / "m.nanoqwen"
    target.write_bytes(good_file.read_bytes())
    write_model(target, {"k": 2}, "int4_sym_g128", [PendingTensor("a", "float16", (2,), lambda: np.ones(2, np.float16))])
    assert ModelFile(target).config_dict == {"k": 2}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_raises_its_own_error(tmp_path, good_file, case):
    make, error, stage = CASES[case]
    bad = tmp_path / f"{case}.nanoqwen"
    make(good_file, bad)
    with pytest.raises(error) as info:
        if stage == "open":
            ModelFile(bad)
        elif stage == "load":
            ModelFile(bad).close()  # the container itself is sound ...
            engine.load(bad)  # ... the config and tensor table are not
        else:
            engine.load(bad)  # the model is sound ...
            embedded_tokenizer(bad)  # ... its tokenizer.json is not
    assert isinstance(info.value, E.ModelFileError)
    assert str(bad) in str(info.value), "the message must name the file"
    assert "\n" not in str(info.value), "the message must be one line"


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_reports_a_malformed_file_in_one_line(tmp_path, good_file, case, capsys):
    make, error, stage = CASES[case]
    bad = tmp_path / f"{case}.nanoqwen"
    make(good_file, bad)
    command = {"open": ["inspect", str(bad)], "load": ["generate", "--model", str(bad), "--prompt-ids", "1"],
               "tokenizer": ["generate", "--model", str(bad), "--prompt", "def f"]}[stage]
    assert cli_main(command) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("nanoqwen: error:") and str(bad) in err, err


@pytest.mark.parametrize("case", ["bad_magic", "truncated_in_data", "header_nested_deep", "config_layers_2_31",
                                  "tokenizer_not_utf8"])
def test_cli_subprocess_exits_2_with_one_line_and_no_traceback(tmp_path, good_file, case):
    make, _, stage = CASES[case]
    bad = tmp_path / "bad.nanoqwen"
    make(good_file, bad)
    command = {"open": ["inspect", str(bad)], "load": ["generate", "--model", str(bad), "--prompt-ids", "1"],
               "tokenizer": ["generate", "--model", str(bad), "--prompt", "def f"]}[stage]
    r = subprocess.run([sys.executable, "-m", "ladder", *command], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("nanoqwen: error:") and str(bad) in r.stderr, r.stderr


def test_missing_file_is_a_model_file_error(tmp_path):
    with pytest.raises(E.ModelFileError, match="cannot open"):
        ModelFile(tmp_path / "nope.nanoqwen")


def test_a_config_the_table_cannot_hold_is_refused_before_anything_is_built(tmp_path, good_file):
    # 2**31 - 1 layers once built per-layer tables for minutes; the table has 4, so the 5th is missing.
    bad = tmp_path / "layers.nanoqwen"
    CASES["config_layers_2_31"][0](good_file, bad)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(E.MissingTensorError, match="num_hidden_layers = 2147483647"):
            engine.load(bad)
        seconds, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 2.0 and peak < 4 << 20, (seconds, peak)


def test_load_refuses_a_kv_cache_past_the_file_size_plus_the_allowance(tmp_path, good_file):
    long = tmp_path / "long.nanoqwen"
    _config("max_position_embeddings", 2**31 - 1)(good_file, long)
    assert engine.load(long).cache.capacity == engine.model.DEFAULT_CACHE_TOKENS  # the default cache fits
    with pytest.raises(E.AllocationTooLargeError, match="KV cache of 2147483647 tokens"):
        engine.load(long, cache_tokens=2**31 - 1)


def test_a_closed_file_hands_out_nothing_but_its_arrays_stay_valid(good_file):
    with ModelFile(good_file) as mf:
        norm = mf.tensor("model.norm.weight")
        expected = norm.copy()
    assert np.array_equal(norm, expected)  # the map outlives close() while an array views it
    with pytest.raises(ValueError, match="closed"):
        mf.tensor("model.norm.weight")


def _open_fds(at_most: int | None = None) -> int:
    """This process's open file descriptors. With `at_most`, read again (up to 2 s) while the count is
    above it: the worker's own threads (the vital signs written each second) hold one for a moment, and a
    leak stays where a moment's file goes."""
    n = len(os.listdir("/proc/self/fd"))
    for _ in range(20 if at_most is not None else 0):
        if n <= at_most:
            break
        time.sleep(0.1)
        n = len(os.listdir("/proc/self/fd"))
    return n


def _maps_of(path: Path) -> int:
    return sum(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors through /proc/self/fd (Linux)")
def test_3000_loads_leak_no_file_descriptor_or_map():
    path = seed_file()  # a 250 KB model: a load is about a millisecond
    engine.load(path, cache_tokens=16)
    gc.collect()
    fds, maps = _open_fds(), _maps_of(path)
    for _ in range(3000):
        model = engine.load(path, cache_tokens=16)
    for _ in range(1000):
        ModelFile(path, verify_checksums=False)  # never closed by hand: the map goes with the object
        with ModelFile(path, verify_checksums=False):
            pass
    assert model.config.num_hidden_layers == 2
    del model
    gc.collect()
    assert _open_fds(at_most=fds) <= fds and _maps_of(path) <= maps, (fds, _open_fds(), maps, _maps_of(path))


@pytest.mark.parametrize("case", ["bad_magic", "config_layers_2_31"])
def test_ladder_refuses_a_malformed_model_in_one_line_before_any_rung(tmp_path, good_file, case, capsys):
    bad = tmp_path / f"{case}.nanoqwen"
    CASES[case][0](good_file, bad)
    assert cli_main(["ladder", "--model", str(bad), "--rungs", "unit", "--report", str(tmp_path / "report")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith("nanoqwen: error:") and str(bad) in err, err
    assert "rung" not in captured.out, "no rung may start on a malformed model"
