"""Self-test: Hugging Face checkpoints convert, inspect and generate; bad folders are refused clearly.

Refused before any work: an output path that cannot be written, an input that cannot be read, and a
checkpoint whose config values or safetensors entries or index have the wrong type (a typed error
naming the file and the key, and no tensor read). Refused before anything is written: a NaN or an
infinity in a tensor, a value float16 cannot hold where the file stores float16, and a tokenizer.json
the tokenizers library refuses (the commands' view of all three: test_cli_errors.py). Interrupted
conversions: test_convert_litter.py.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.config import SHAPES
from engine.convert import CheckpointError, Float16RangeError, SafetensorsFolder, convert
from engine.errors import ConfigError, NanoqwenError, OutputPathError
from engine.formats import get_format
from engine.modelfile import ModelFile
from fixtures.tiny_model import build_random_model, random_model_dir
from engine.cli import main as cli_main

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
    assert cli_main(["generate", "--model", str(out), "--prompt", "def f(x):", "--new-tokens", "3"]) == 0
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
    assert cli_main(["generate", "--prompt", "def f(x):", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "new ids" in out and "ms/token" in out


def test_seeded_model_logits_are_not_flat():
    """The seeded model must make greedy choices clear: median top-1 margin well above the near-tie epsilon."""
    from fixtures.tiny_model import random_model_file
    from ladder.judges.tolerances import NEAR_TIE_EPS

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


# --- refused before any work: output paths and inputs ---------------------------------------------


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """The two-layer seeded checkpoint (fp16, no tokenizer), built once for this module."""
    return build_random_model(tmp_path_factory.mktemp("hf_small"), SMALL, seed=3, with_tokenizer=False)


@pytest.fixture
def checkpoint(small_dir, tmp_path):
    """A private copy of the small checkpoint, free to corrupt."""
    return Path(shutil.copytree(small_dir, tmp_path / "hf"))


@pytest.fixture
def reads(monkeypatch):
    """The names of the tensors the converter reads (so a test can say: none)."""
    seen = []
    read = SafetensorsFolder.read

    def counted(self, name, **kw):
        seen.append(name)
        return read(self, name, **kw)

    monkeypatch.setattr(SafetensorsFolder, "read", counted)
    return seen


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".nanoqwen-tmp-" in p.name or ".tmp-" in p.name)


@pytest.mark.parametrize("out,problem", [
    ("{tmp}", "is a folder"),
    ("{tmp}/missing/m.nanoqwen", "does not exist"),
    ("{tmp}/a_file/m.nanoqwen", "is not a folder"),
])
def test_an_unwritable_output_path_is_refused_before_any_tensor_is_read(small_dir, tmp_path, reads, out, problem):
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(OutputPathError, match=problem):
        convert(small_dir, out.format(tmp=tmp_path))
    assert reads == [] and temp_files(tmp_path) == []


def test_a_read_only_folder_is_refused_before_any_tensor_is_read(small_dir, tmp_path, reads):
    if os.geteuid() == 0:
        pytest.skip("running as root: permission bits do not stop root, so a read-only folder cannot be made")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(OutputPathError, match="not writable"):
            convert(small_dir, ro / "m.nanoqwen")
    finally:
        ro.chmod(0o755)
    assert reads == [] and list(ro.iterdir()) == []


def test_a_folder_that_refuses_new_files_is_refused_before_any_tensor_is_read(small_dir, reads):
    """/proc passes the permission check (even for root) but creates no file: the temporary file,
    created before the first tensor is read, is the probe."""
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux /proc, a folder in which no file can be created")
    with pytest.raises(OutputPathError, match="cannot create a file"):
        convert(small_dir, "/proc/m.nanoqwen")
    assert reads == []


@pytest.mark.parametrize("make,problem", [
    (lambda d: shutil.rmtree(d), "no such folder"),
    (lambda d: (shutil.rmtree(d), d.write_text("x")), "not a folder"),
    (lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()), "config.json: cannot read"),
    (lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir()), "model.safetensors: cannot read"),
    (lambda d: (d / "tokenizer.json").mkdir(), "tokenizer.json: cannot read"),
])
def test_an_unreadable_input_is_refused_before_any_tensor_is_read(checkpoint, tmp_path, reads, make, problem):
    """(As root, permission bits cannot make a file unreadable; a folder where a file belongs can.)"""
    make(checkpoint)
    with pytest.raises(CheckpointError, match=problem):
        convert(checkpoint, tmp_path / "m.nanoqwen")
    assert reads == [] and not (tmp_path / "m.nanoqwen").exists() and temp_files(tmp_path) == []


def test_convert_command_refuses_an_output_folder_in_one_line(small_dir, tmp_path, capsys):
    assert cli_main(["convert", str(small_dir), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoqwen: error:") and "is a folder" in err


def test_an_output_path_onto_the_checkpoints_own_file_is_refused(checkpoint, reads):
    before = (checkpoint / "model.safetensors").read_bytes()
    with pytest.raises(OutputPathError, match="checkpoint's own files"):
        convert(checkpoint, checkpoint / "model.safetensors")
    assert reads == [] and (checkpoint / "model.safetensors").read_bytes() == before


# --- checkpoints with values of the wrong type: typed errors naming the file and the key ---------


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("key,value", [
    ("max_position_embeddings", "abc"), ("max_position_embeddings", -5), ("max_position_embeddings", 1.5),
    ("max_position_embeddings", None), ("max_position_embeddings", True),
    ("rope_parameters", "default"), ("rope_parameters", [10000.0]), ("rope_parameters", {"rope_theta": "1e4"}),
    ("rope_parameters", {"rope_theta": 10000.0, "rope_type": 3}),
    ("eos_token_id", "2"), ("eos_token_id", ["a", "b"]), ("eos_token_id", [1, "b"]), ("eos_token_id", -1),
    ("eos_token_id", 10**9), ("bos_token_id", 1.0),
    ("hidden_size", "256"), ("vocab_size", 0), ("num_hidden_layers", 2.0), ("num_key_value_heads", -2),
    ("rms_norm_eps", "1e-6"), ("rms_norm_eps", -1e-6), ("rope_theta", "1e4"), ("rope_theta", 0),
    ("tie_word_embeddings", "false"), ("head_dim", "64"), ("architectures", "Qwen2ForCausalLM"),
    ("hidden_act", 7), ("layer_types", "full_attention"),
])
def test_a_config_value_of_the_wrong_type_or_sign_is_refused_by_key(checkpoint, tmp_path, reads, key, value):
    edit_config(checkpoint, **{key: value})
    with pytest.raises(NanoqwenError) as e:
        convert(checkpoint, tmp_path / "m.nanoqwen")
    assert isinstance(e.value, (CheckpointError, ConfigError))
    assert "config.json" in str(e.value) and key in str(e.value) and "\n" not in str(e.value)
    assert reads == [] and not (tmp_path / "m.nanoqwen").exists()


@pytest.mark.parametrize("text,problem", [("[1, 2]", "not an object"), ("{", "not JSON"), ("{}", "is missing")])
def test_a_config_json_that_is_not_a_config_is_refused(checkpoint, tmp_path, text, problem):
    (checkpoint / "config.json").write_text(text)
    with pytest.raises(NanoqwenError, match=problem):
        convert(checkpoint, tmp_path / "m.nanoqwen")


def rewrite_header(path: Path, mutate) -> None:
    """Replace a safetensors file's JSON header by `mutate(header)`'s edit of it; the data stays."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + n])
    replaced = mutate(header)  # an edit in place, or (returned) a whole new header
    header = header if replaced is None else replaced
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"


def _set(name, field, value):
    def mutate(h):
        h[name][field] = value
    return mutate


def _drop(name, field):
    def mutate(h):
        del h[name][field]
    return mutate


@pytest.mark.parametrize("mutate,problem", [
    (_drop(EMBED, "dtype"), "has no 'dtype'"),
    (_drop(EMBED, "shape"), "has no 'shape'"),
    (_drop(EMBED, "data_offsets"), "has no 'data_offsets'"),
    (_set(EMBED, "dtype", 16), "'dtype' is 16"),
    (_set(EMBED, "shape", "512,256"), "'shape' is"),
    (_set(EMBED, "shape", [-512, -256]), "'shape' is"),
    (_set(EMBED, "shape", [512.0, 256]), "'shape' is"),
    (_set(EMBED, "data_offsets", [0]), "'data_offsets' is"),
    (_set(EMBED, "data_offsets", ["0", "10"]), "'data_offsets' is"),
    (_set(EMBED, "data_offsets", [10, 2]), "'data_offsets' is"),
    (_set(EMBED, "data_offsets", [0, 10**12]), "run past the end"),
    (_set(EMBED, "shape", [512, 255]), "needs"),
    (_set(EMBED, "dtype", "F32"), "needs"),
    (_set(NORM, "dtype", "I16"), "has dtype I16"),
    (_set(NORM, "dtype", "Q4"), "has dtype Q4"),
    (lambda h: h.__setitem__(NORM, [1, 2]), "not an object"),
    (lambda h: h.__setitem__("model.norm.weight.renamed", h.pop(NORM)), "model.norm.weight is missing"),
    (lambda h: [1, 2], "not an object"),
])
def test_a_safetensors_entry_of_the_wrong_type_is_refused_naming_file_and_key(checkpoint, tmp_path, reads, mutate,
                                                                           problem):
    rewrite_header(checkpoint / "model.safetensors", mutate)
    with pytest.raises(CheckpointError, match=problem) as e:
        convert(checkpoint, tmp_path / "m.nanoqwen")
    assert "model.safetensors" in str(e.value) or "missing" in problem
    assert reads == [] and not (tmp_path / "m.nanoqwen").exists() and temp_files(tmp_path) == []


@pytest.mark.parametrize("corrupt,problem", [
    (lambda raw: raw[:4], "truncated"),
    (lambda raw: struct.pack("<Q", len(raw)) + raw[8:], "runs past the end"),
    (lambda raw: raw[:8] + b"!" + raw[9:], "not JSON"),
    (lambda raw: raw[: len(raw) - 100], "run past the end"),
])
def test_a_damaged_safetensors_file_is_refused(checkpoint, tmp_path, reads, corrupt, problem):
    path = checkpoint / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(CheckpointError, match=problem):
        convert(checkpoint, tmp_path / "m.nanoqwen")
    assert reads == []


def shard(folder: Path) -> dict:
    """Split the folder's model.safetensors into two shards and an index; returns the index."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


@pytest.mark.parametrize("edit,problem", [
    (lambda idx, d: idx.pop("weight_map"), "no 'weight_map'"),
    (lambda idx, d: idx.__setitem__("weight_map", ["a.safetensors"]), "no 'weight_map'"),
    (lambda idx, d: idx["weight_map"].__setitem__(NORM, "model-00003-of-00002.safetensors"), "not in the folder"),
    (lambda idx, d: idx["weight_map"].__setitem__(NORM, "../model.safetensors"), "not a file name"),
    (lambda idx, d: idx["weight_map"].__setitem__(NORM, 1), "not a file name"),
    (lambda idx, d: idx["weight_map"].__setitem__(NORM, "model-00001-of-00002.safetensors"
                                                  if idx["weight_map"][NORM].startswith("model-00002")
                                                  else "model-00002-of-00002.safetensors"), "holds no such tensor"),
    (lambda idx, d: (d / "model-00001-of-00002.safetensors").unlink(), "not in the folder"),
])
def test_a_sharded_checkpoint_with_a_bad_index_is_refused(checkpoint, tmp_path, reads, edit, problem):
    index = shard(checkpoint)
    convert(checkpoint, tmp_path / "ok.nanoqwen")  # the sharded copy itself converts
    reads.clear()
    edit(index, checkpoint)
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=problem) as e:
        convert(checkpoint, tmp_path / "m.nanoqwen")
    assert "model.safetensors.index.json" in str(e.value) and reads == []


def test_a_tensor_in_two_shards_is_refused(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    index = shard(checkpoint)
    first = checkpoint / "model-00001-of-00002.safetensors"
    other = index["weight_map"][NORM]
    extra = load_file(str(first))
    extra[NORM] = load_file(str(checkpoint / other))[NORM]
    if other != first.name:
        save_file(extra, str(first))
    else:  # the norm lives in the first shard: put a copy in the second
        second = checkpoint / "model-00002-of-00002.safetensors"
        save_file({**load_file(str(second)), NORM: extra[NORM]}, str(second))
    with pytest.raises(CheckpointError, match="is also in"):
        convert(checkpoint, tmp_path / "m.nanoqwen")


@pytest.mark.parametrize("dtype,bits,value", [
    ("BF16", 0x7FC0, "nan"), ("BF16", 0xFF80, "-inf"), ("F16", 0x7C00, "inf"), ("F16", 0xFE01, "nan"),
    ("F32", 0x7F800000, "inf"), ("F32", 0xFFC00001, "nan"),
])
@pytest.mark.parametrize("chunk", [64 << 20, 8], ids=["one-read", "8-byte-reads"])
def test_the_finiteness_scan_finds_nan_and_inf_by_their_bits(tmp_path, monkeypatch, dtype, bits, value, chunk):
    """Every dtype read: the first NaN or infinity's index and value, and how many; the largest finite
    values and negative zero are finite. (The commands' view: test_cli_errors.py.)"""
    monkeypatch.setattr("engine.convert._SCAN_CHUNK", chunk)
    code = "<u4" if dtype == "F32" else "<u2"
    w = np.full((3, 5), {"BF16": 0x7F7F, "F16": 0x7BFF, "F32": 0x7F7FFFFF}[dtype], dtype=code)  # the largest finite
    w[0, 1] = 1 << (8 * w.itemsize - 1)  # -0.0
    clean = w.copy()
    w[2, 3] = w[1, 4] = bits
    data = w.tobytes() + clean.tobytes()
    header = json.dumps({"bad": {"dtype": dtype, "shape": [3, 5], "data_offsets": [0, w.nbytes]},
                         "clean": {"dtype": dtype, "shape": [3, 5], "data_offsets": [w.nbytes, len(data)]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    st = SafetensorsFolder(tmp_path)
    assert st.first_non_finite("bad") == ((1, 4), value, 2) and st.first_non_finite("clean") is None


def one_tensor_file(folder: Path, dtype: str, w: np.ndarray) -> SafetensorsFolder:
    """A folder whose model.safetensors holds `w`'s raw bits as tensor "w" of safetensors dtype `dtype`."""
    header = json.dumps({"w": {"dtype": dtype, "shape": list(w.shape), "data_offsets": [0, w.nbytes]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + w.tobytes())
    return SafetensorsFolder(folder)


@pytest.mark.parametrize("dtype,bits,value", [
    ("F32", 0x477FF000, "65520.0"), ("F32", 0xC7800000, "-65536.0"), ("F32", 0x7F7FFFFF, "3.4028235e+38"),
    ("BF16", 0x4780, "65536.0"), ("BF16", 0xFF7F, "-3.3895314e+38"),
])
@pytest.mark.parametrize("chunk", [64 << 20, 8], ids=["one-read", "8-byte-reads"])
def test_the_float16_range_scan_finds_the_values_float16_rounds_to_infinity(tmp_path, monkeypatch, dtype, bits,
                                                                            value, chunk):
    """The largest values that round to 65504 (65519.996 in fp32, 65280 in bf16) and the non-finite
    ones are not counted; the first value from 65520 up is, with its index, value and how many."""
    monkeypatch.setattr("engine.convert._SCAN_CHUNK", chunk)
    code = "<u4" if dtype == "F32" else "<u2"
    below = {"F32": 0xC77FEFFF, "BF16": 0x477F}[dtype]  # -65519.996 / 65280: float16 rounds them to 65504
    w = np.full((3, 5), below, dtype=code)
    w[0, 1] = {"F32": 0x7F800000, "BF16": 0xFF80}[dtype]  # an infinity: the finiteness scan's, not this one's
    assert one_tensor_file(tmp_path, dtype, w).first_over_float16("w") is None
    w[2, 3] = w[1, 4] = bits
    assert one_tensor_file(tmp_path, dtype, w).first_over_float16("w") == ((1, 4), value, 2)


def test_a_float16_tensor_is_never_past_float16s_range(tmp_path):
    w = np.full((2, 3), 0x7BFF, dtype="<u2")  # 65504
    assert one_tensor_file(tmp_path, "F16", w).first_over_float16("w") is None


def test_a_quantized_group_whose_range_overflows_its_scale_is_refused_naming_its_largest_value(tmp_path):
    """int4_asym_g128's scale is (max - min) / 15: two values that each fit alone overflow it together,
    and the error names the larger of the group that overflows (not merely the tensor's largest)."""
    w = np.zeros((4, 256), dtype=np.float32)
    w[1, 10] = 600_000.0  # group 0 of row 1: (600000 - 0) / 15 = 40000 fits
    w[2, 130], w[2, 140] = 500_000.0, -520_000.0  # group 1 of row 2: 1020000 / 15 = 68000 does not
    st = one_tensor_file(tmp_path, "F32", w)
    with pytest.raises(Float16RangeError) as e:
        st.check_values("w", "int4_asym_g128")
    assert (e.value.index, e.value.value, e.value.quant) == ((2, 140), "-520000.0", "int4_asym_g128")
    assert "a group's (max - min) / 15 overflows fp16" in str(e.value)


def test_random_damage_to_a_safetensors_header_converts_or_is_a_typed_error(small_dir, tmp_path):
    """Forty seeded mutants (bytes of the header flipped, dropped or duplicated): each one converts,
    or is refused with a one-line NanoqwenError, and leaves no temporary file."""
    raw = (small_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    outcomes = []
    for case in range(40):
        rng = np.random.default_rng(case)
        header = bytearray(raw[8: 8 + n])
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, len(header)))
            kind = int(rng.integers(0, 3))
            if kind == 0:
                header[i] = int(rng.choice(list(b'0123456789"{}[],:-.eE ')))
            elif kind == 1:
                del header[i: i + int(rng.integers(1, 8))]
            else:
                header[i:i] = header[i: i + int(rng.integers(1, 8))]
        folder = tmp_path / f"case{case}"
        shutil.copytree(small_dir, folder)
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + bytes(header) + raw[8 + n:])
        try:
            convert(folder, tmp_path / f"case{case}.nanoqwen")
            outcomes.append("converted")
        except NanoqwenError as e:
            assert "\n" not in str(e), f"case {case}: {e}"
            outcomes.append(type(e).__name__)
        assert temp_files(tmp_path) == [], f"case {case}"
    assert outcomes.count("CheckpointError") >= 30, outcomes  # the mutants mostly break the header
