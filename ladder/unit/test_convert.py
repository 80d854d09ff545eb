"""Unit rung: Hugging Face checkpoints convert, inspect and generate; bad folders are refused clearly."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import engine
from engine.config import SHAPES
from engine.convert import CheckpointError, convert
from engine.errors import ConfigError
from engine.formats import get_format
from engine.modelfile import ModelFile
from fixtures.tiny_model import build_random_model, random_model_dir
from ladder.cli import main as cli_main

SMALL = SHAPES["tiny"].replace(num_hidden_layers=2)


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    """A Qwen2ForCausalLM saved by transformers itself in bf16, sharded into several files."""
    torch = pytest.importorskip("torch", reason="the test extra (torch) is needed to save an HF model")
    transformers = pytest.importorskip("transformers", reason="the test extra (transformers) is needed")
    from reference.hf import hf_config

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_config(SMALL.to_hf_dict())).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("hf_bf16")
    model.save_pretrained(folder, max_shard_size="400KB")
    shutil.copy(random_model_dir() / "tokenizer.json", folder / "tokenizer.json")
    return folder, {k: v.float().numpy() for k, v in model.state_dict().items()}


def test_transformers_bf16_sharded_checkpoint_converts_exactly(saved_by_transformers, tmp_path, capsys):
    folder, state = saved_by_transformers
    assert (folder / "model.safetensors.index.json").exists(), "the fixture must be sharded"
    out = tmp_path / "m.nanoqwen"
    assert cli_main(["convert", str(folder), str(out)]) == 0
    mf = ModelFile(out)
    fmt = get_format("int4_sym_g128")
    name = "model.layers.1.mlp.down_proj"
    expect = fmt.quantize(state[name + ".weight"])
    assert np.array_equal(mf.tensor(name + ".qweight"), expect["qweight"])
    assert np.array_equal(mf.tensor(name + ".scales"), expect["scales"])
    assert np.array_equal(mf.tensor("model.norm.weight"), state["model.norm.weight"].astype(np.float16))
    assert mf.file("tokenizer.json") == (folder / "tokenizer.json").read_bytes()
    assert cli_main(["inspect", str(out)]) == 0
    assert "model.layers.1.mlp.down_proj.qweight" in capsys.readouterr().out
    assert cli_main(["generate", "--model", str(out), "--prompt", "def f(x):", "--max-new-tokens", "3"]) == 0
    assert "new ids" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fp16_and_fp32_checkpoints_convert_to_the_same_file(tmp_path, dtype):
    src = build_random_model(tmp_path / "hf", SMALL, seed=2, dtype=dtype, with_tokenizer=False)
    convert(src, tmp_path / "m.nanoqwen")
    ref = build_random_model(tmp_path / "hf16", SMALL, seed=2, dtype=np.float16, with_tokenizer=False)
    convert(ref, tmp_path / "r.nanoqwen")
    a, b = ModelFile(tmp_path / "m.nanoqwen"), ModelFile(tmp_path / "r.nanoqwen")
    if dtype == np.float16:
        assert (tmp_path / "m.nanoqwen").read_bytes() == (tmp_path / "r.nanoqwen").read_bytes()
    assert a.tensors.keys() == b.tensors.keys()
    engine.load(tmp_path / "m.nanoqwen").generate([1, 2], 2)


def test_folder_without_config_is_refused(tmp_path, capsys):
    assert cli_main(["convert", str(tmp_path), str(tmp_path / "o.nanoqwen")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "o.nanoqwen").exists()


def test_unsupported_architecture_is_refused_by_key(tmp_path):
    src = build_random_model(tmp_path / "hf", SMALL, seed=0, with_tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_scaling"):
        convert(src, tmp_path / "o.nanoqwen")


def test_tensor_of_the_wrong_shape_is_refused(tmp_path):
    src = build_random_model(tmp_path / "hf", SMALL, seed=0, with_tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 1024
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gate_proj.weight has shape"):
        convert(src, tmp_path / "o.nanoqwen")
    assert not (tmp_path / "o.nanoqwen").exists()


def test_generate_command_on_the_default_model(capsys):
    assert cli_main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "new ids" in out and "ms/token" in out


def test_seeded_model_logits_are_not_flat():
    """The seeded model must make greedy choices clear: median top-1 margin well above the near-tie epsilon."""
    from fixtures.tiny_model import random_model_file
    from ladder.tolerances import NEAR_TIE_EPS

    m = engine.load(random_model_file())
    margins = []
    for seed in range(4):
        ids = np.random.default_rng(seed).integers(0, m.config.vocab_size, 24)
        seq = m.new_sequence()
        for t in ids:
            top2 = np.sort(m.decode_step(seq, int(t)) if seq.length else m.prefill(seq, [int(t)]))[-2:]
            margins.append(top2[1] - top2[0])
        seq.free()
    assert np.median(margins) > 10 * NEAR_TIE_EPS, f"median top-1 margin {np.median(margins):.3f}"
