"""Self-test: the seeded models too large to hold in memory (fixtures/tiny_model.py, presets 1.5b and 7b).

They are drawn a block at a time and streamed into bf16 safetensors shards laid out as `save_pretrained`
lays out a real checkpoint. Checked here on a small shape, with a shard size small enough to cut it into
many files: the index and the shards hold every tensor the config implies, with its shape and dtype;
the converter converts the folder; the values are what the generator draws, the same bytes for the same
seed; the command writes such a model straight into its folder, or leaves nothing. The real 1.5b and 7b
are never built here (minutes and gigabytes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import engine
import fixtures.tiny_model as tm
from engine.config import SHAPES
from engine.convert import SafetensorsFolder, convert
from engine.weights import linear_names, plain_tensor_specs

SMALL = SHAPES["tiny"].replace(num_hidden_layers=2)
SHARD = 300_000  # bytes: the small model (3.7 MB in bf16) in a dozen shards


def expected_tensors(config) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the converter will ask for, with its shape (engine/weights.py's reading)."""
    want = {name: shape for name, (_, shape) in plain_tensor_specs(config).items()}
    for layer in range(config.num_hidden_layers):
        want.update({base + ".weight": shape for base, shape in linear_names(config, layer).items()})
    return want


def headers(folder: Path) -> dict[str, dict]:
    """{file name: its safetensors header}, read by hand (length, JSON)."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        assert n % 8 == 0, f"{path.name}: header of {n} bytes is not padded to 8"
        out[path.name] = json.loads(raw[8: 8 + n])
        ends = [m["data_offsets"][1] for k, m in out[path.name].items() if k != "__metadata__"]
        assert len(raw) == 8 + n + max(ends, default=0), f"{path.name}: data after the last tensor"
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streamed") / "hf"
    return tm.build_streamed_model(folder, SMALL, seed=5, logit_scale=6.0, generator="numpy", shard_bytes=SHARD,
                                   threads=3)


def test_the_shards_and_index_hold_every_tensor_the_config_implies(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = headers(sharded)
    n = len(files)
    assert n > 2 and sorted(files) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (sharded / "model.safetensors").exists()
    entries = {k: (f, m) for f, h in files.items() for k, m in h.items() if k != "__metadata__"}
    want = expected_tensors(SMALL)
    assert set(entries) == set(want) == set(index["weight_map"])
    for name, shape in want.items():
        shard, meta = entries[name]
        assert (meta["dtype"], tuple(meta["shape"]), index["weight_map"][name]) == ("BF16", shape, shard), name
    assert index["metadata"]["total_size"] == sum(2 * int(np.prod(s)) for s in want.values())
    assert all(max(m["data_offsets"][1] for k, m in h.items() if k != "__metadata__") <= SHARD
               for h in files.values() if len(h) > 2), "a shard of several tensors is over the shard size"
    note = json.loads((sharded / tm.NOTE).read_text())
    assert (note["seed"], note["generator"], note["dtype"]) == (5, "numpy", "bfloat16")
    assert json.loads((sharded / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_the_values_are_the_generators_and_the_same_seed_writes_the_same_bytes(sharded, tmp_path):
    st = SafetensorsFolder(sharded)
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight",
                 "lm_head.weight"):
        drawn = tm.streamed_tensor(SMALL, name, seed=5, logit_scale=6.0, generator="numpy")
        assert np.array_equal(st.read(name), (drawn.astype(np.uint32) << 16).view(np.float32)), name
    lm = st.read("lm_head.weight")
    assert abs(float(lm.std()) * np.sqrt(SMALL.hidden_size) / 6.0 - 1) < 0.02  # the logit scale's spread
    norm = st.read("model.norm.weight")
    assert abs(float(norm.mean()) - 1) < 0.03 and 0.07 < float(norm.std()) < 0.13
    again = tm.build_streamed_model(tmp_path / "again", SMALL, seed=5, logit_scale=6.0, generator="numpy",
                                    shard_bytes=SHARD, threads=1)
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in sharded.iterdir())
    for path in sharded.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), f"{path.name} differs between two builds"
    other = tm.streamed_tensor(SMALL, "model.norm.weight", seed=6, logit_scale=6.0, generator="numpy")
    assert not np.array_equal(other, tm.streamed_tensor(SMALL, "model.norm.weight", seed=5, logit_scale=6.0))


def test_the_converter_converts_the_sharded_folder(sharded, tmp_path):
    out = tmp_path / "m.nanoqwen"
    convert(sharded, out)
    assert len(engine.load(out).generate([1, 2, 3], 2)) == 2


def test_a_tensor_larger_than_a_shard_takes_a_shard_alone():
    t = [tm.StreamTensor(name, "BF16", (n,), ()) for name, n in (("a", 10), ("b", 10), ("c", 100), ("d", 10))]
    assert [[x.name for x in shard] for shard in tm.shard_layout(t, 45)] == [["a", "b"], ["c"], ["d"]]
    assert [[x.name for x in shard] for shard in tm.shard_layout(t, 10**9)] == [["a", "b", "c", "d"]]


def test_numpys_bfloat16_rounding_is_torchs():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal(100_000, dtype=np.float32)
    ties = (np.arange(1, 2001, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # halfway: to even
    for values in (x, ties, -ties, np.float32([0.0, -0.0, 1e-40, 3e38])):
        want = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(tm._bf16_bits(values.copy()), want)


def test_the_large_presets_are_streamed_and_the_small_ones_made_in_memory():
    assert tm.TRAINED_LIKE["7b"].config == SHAPES["qwen2.5-coder-7b"].replace(tie_word_embeddings=False,
                                                                               max_position_embeddings=4096)
    c = tm.TRAINED_LIKE["1.5b"].config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size, c.tie_word_embeddings) == (28, 1536, 8960, 12, 2, 151936, False)
    assert 7.6e9 < tm.parameter_count(tm.TRAINED_LIKE["7b"].config) < 7.7e9
    assert [p for p in tm.TRAINED_LIKE if tm.is_streamed(tm.TRAINED_LIKE[p].config)] == ["1.5b", "7b"]


def test_the_cache_key_names_the_generator():
    keys = {tm._generator_key(0, SMALL, 4.0, g) for g in (None, "numpy", "torch-cuda")}
    assert len(keys) == 3


@pytest.fixture
def streamed_preset(monkeypatch):
    """A preset of the small shape that the command treats as a large one (streamed)."""
    monkeypatch.setattr(tm, "STREAM_PARAMETERS", 0)
    monkeypatch.setitem(tm.TRAINED_LIKE, "test", tm.TrainedLike(SMALL, 6.0))
    return "test"


def test_the_command_writes_a_streamed_model_straight_into_its_folder(streamed_preset, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert tm.main(["--trained-like", streamed_preset, "--seed", "5", "--generator", "numpy", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing in the cache, no temporary sibling
    assert {"config.json", "tokenizer.json", "model.safetensors", tm.NOTE} == {p.name for p in out.iterdir()}
    drawn = tm.streamed_tensor(SMALL, "lm_head.weight", seed=5, logit_scale=6.0)
    assert np.array_equal(SafetensorsFolder(out).read("lm_head.weight").view(np.uint32) >> 16, drawn)
    assert out.stat().st_mode & 0o755 == 0o755


def test_the_command_refuses_an_existing_folder(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as e:
        tm.main(["--trained-like", "7b", str(tmp_path / "out")])
    assert e.value.code == 2 and "exists" in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("stop", [RuntimeError("planted"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_build_that_fails_leaves_no_folder(streamed_preset, tmp_path, monkeypatch, stop):
    draw = tm._draw_block

    def fails_late(spec, index, block, seed, generator):
        if spec.name == "model.layers.1.mlp.up_proj.weight":
            raise stop
        return draw(spec, index, block, seed, generator)

    monkeypatch.setattr(tm, "_draw_block", fails_late)
    with pytest.raises(type(stop)):
        tm.main(["--trained-like", streamed_preset, "--generator", "numpy", str(tmp_path / "out")])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(tm.default_generator() != "torch-cuda", reason="torch sees no CUDA GPU")
def test_the_gpu_generator_draws_the_same_bytes_twice():
    a = tm.streamed_tensor(SMALL, "model.layers.0.self_attn.q_proj.weight", seed=5, generator="torch-cuda")
    b = tm.streamed_tensor(SMALL, "model.layers.0.self_attn.q_proj.weight", seed=5, generator="torch-cuda")
    assert np.array_equal(a, b) and a.shape == (SMALL.q_size, SMALL.hidden_size)
    numpy = tm.streamed_tensor(SMALL, "model.layers.0.self_attn.q_proj.weight", seed=5, generator="numpy")
    assert not np.array_equal(a, numpy)
    spread = (a.astype(np.uint32) << 16).view(np.float32).std() * np.sqrt(SMALL.hidden_size)
    assert abs(spread / 1.5 - 1) < 0.05


def test_a_given_generator_streams_a_model_of_any_size_and_none_keeps_the_small_one_in_one_stream():
    """The unit rung's GPU-references case draws its 0.5B-shape model on the GPU (`generator="torch-cuda"`);
    without a generator a model under a billion parameters is made by `random_weights`, a larger one is
    streamed by the machine's default generator."""
    assert not tm.is_streamed(SMALL)
    assert tm._generator_of(SMALL, None) is None
    assert tm._generator_of(SMALL, "numpy") == "numpy"
    assert tm._generator_of(tm.TRAINED_LIKE["7b"].config, None) == tm.default_generator()
    with pytest.raises(ValueError, match="unknown generator"):
        tm._generator_of(SMALL, "dice")


def test_the_command_streams_a_small_preset_when_given_a_generator(tmp_path, capsys):
    assert tm.main([str(tmp_path / "m"), "--generator", "numpy"]) == 0
    assert "generator numpy" in capsys.readouterr().out
    note = json.loads((tmp_path / "m" / tm.NOTE).read_text())
    assert note["generator"] == "numpy" and list((tmp_path / "m").glob("*.safetensors"))
    convert(tmp_path / "m", tmp_path / "m.nanoqwen", "int4_sym_g128")
    assert (tmp_path / "m.nanoqwen").stat().st_size > 0


def test_the_command_refuses_the_gpu_generator_where_there_is_no_gpu_and_leaves_nothing(tmp_path, capsys):
    if tm.default_generator() == "torch-cuda":
        pytest.skip("torch sees a CUDA GPU here: the GPU generator is available")
    with pytest.raises(SystemExit) as e:
        tm.main([str(tmp_path / "m"), "--generator", "torch-cuda"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--generator: generator torch-cuda needs torch with a CUDA GPU" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary sibling
