"""Unit rung: the .nanoqwen file. Good files round-trip; every malformed case raises its own
ModelFileError subclass before a tensor is used, and the command line turns it into one line on
stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import engine
from engine import errors as E
from engine.modelfile import MAGIC, ModelFile, PendingTensor, write_model
from fixtures.corrupt import CASES
from fixtures.tiny_model import random_model_file
from ladder.cli import main as cli_main

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
        else:
            ModelFile(bad)  # the container itself is sound ...
            engine.load(bad)  # ... the config and tensor table are not
    assert isinstance(info.value, E.ModelFileError)
    assert str(bad) in str(info.value), "the message must name the file"


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_reports_a_malformed_file_in_one_line(tmp_path, good_file, case, capsys):
    make, error, stage = CASES[case]
    bad = tmp_path / f"{case}.nanoqwen"
    make(good_file, bad)
    command = ["inspect", str(bad)] if stage == "open" else ["generate", "--model", str(bad), "--prompt-ids", "1"]
    assert cli_main(command) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("nanoqwen: error:") and str(bad) in err, err


@pytest.mark.parametrize("case", ["bad_magic", "truncated_in_data"])
def test_cli_subprocess_exits_nonzero_without_traceback(tmp_path, good_file, case):
    make, _, _ = CASES[case]
    bad = tmp_path / "bad.nanoqwen"
    make(good_file, bad)
    r = subprocess.run([sys.executable, "-m", "ladder", "inspect", str(bad)], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_missing_file_is_a_model_file_error(tmp_path):
    with pytest.raises(E.ModelFileError, match="cannot open"):
        ModelFile(tmp_path / "nope.nanoqwen")
