"""Self-test: the command line's edges. Every input error, whatever the subcommand, is exactly one line
on stderr, `nanoqwen: error: ...` naming the problem, and exit status 2; never a traceback.

Also: an error under a progress bar starts on a fresh line; a conversion done on the way (`generate`,
`ladder` or `descend` on a Hugging Face folder) shows its progress on stderr; `descend` says each phase
before it starts; a reader that closes the pipe early (`nanoqwen inspect F | head`) ends the command
quietly. Most cases run in-process through `engine.cli.main`; a few run the installed `nanoqwen` from a
temporary folder, as a user does (skipped, with the reason, where it is not installed).

A broken checkpoint (a NaN or an infinity in a weight, a tokenizer.json the tokenizers library refuses)
is refused by `convert` and by `ladder --model HF_DIR` alike, before anything is written: one line
naming the file and the problem, and no output or temporary file left behind. So is an fp32 value that
float16 cannot hold where the file stores float16: in a tensor kept fp16, or in a quantized weight whose
fp16 scale it would overflow.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.config import SHAPES
from engine.convert import (CheckpointError, CheckpointTokenizerError, Float16RangeError, NonFiniteWeightError,
                            SafetensorsFolder, convert)
from engine.formats import FORMAT_MODULES
from fixtures.tiny_model import build_random_model, random_model_dir, random_model_file
from engine.cli import main as cli_main
from kernels import cuda_available
from ladder.run.nested import child_env

SMALL = SHAPES["tiny"].replace(num_hidden_layers=2)
HAS_CUDA = cuda_available()[0]
EXE = shutil.which("nanoqwen")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A scratch folder with: hf/ (a seeded HF checkpoint without a tokenizer), notok.nanoqwen (its
    conversion), a_file (a plain file), far.jsonl (a prompt past its vocab)."""
    root = tmp_path_factory.mktemp("cli")
    hf = build_random_model(root / "hf", SMALL, seed=5, with_tokenizer=False)
    convert(hf, root / "notok.nanoqwen")
    (root / "a_file").write_text("not a model")
    (root / "far.jsonl").write_text('{"id": "far", "ids": [1, 2, 100000]}\n')  # past the seeded model's vocab
    return root


def one_error_line(capsys) -> str:
    """The single stderr line of a refused command (asserting there is exactly one, in the house form)."""
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, repr(err[-3000:])
    assert err.startswith("nanoqwen: error: ") and "Traceback" not in err, err
    return err


CASES = [
    (["generate", "--prompt-ids", "1,2", "--new-tokens", "-1"], "--new-tokens"),
    (["generate", "--prompt-ids", "1,2", "--new-tokens", "many"], "--new-tokens"),
    (["generate", "--prompt-ids", "-1,2"], "token id -1"),
    (["generate", "--prompt-ids", "-1"], "token id -1"),
    (["generate", "--prompt-ids", "1,99999999999999999999"], "token id 99999999999999999999 is out of range"),
    (["generate", "--prompt-ids", "1,abc"], "'abc' is not an integer"),
    (["generate", "--prompt-ids", ""], "got none"),
    (["generate", "--prompt-ids", "1,,2"], "an empty item"),
    (["generate", "--prompt-ids", "1,100000"], "token id 100000"),  # past the vocab: the engine's TokenIdError
    (["generate", "--prompt-ids", "1", "--new-tokens", "100000"], "longer than the cache"),
    (["generate", "--prompt-ids", "1", "--model", "{root}/missing.nanoqwen"], "missing.nanoqwen"),
    (["generate", "--prompt", "def f", "--model", "{root}/notok.nanoqwen"], "carries no tokenizer.json"),
    (["generate"], "--prompt"),
    (["inspect", "{root}/missing.nanoqwen"], "missing.nanoqwen"),
    (["inspect", "{root}/hf"], "hf"),
    (["convert", "{root}/hf", "{root}"], "is a folder"),
    (["convert", "{root}/hf", "{root}/nowhere/m.nanoqwen"], "does not exist"),
    (["convert", "{root}/hf", "{root}/a_file/m.nanoqwen"], "is not a folder"),
    (["convert", "{root}/missing", "{root}/m.nanoqwen"], "no such folder"),
    (["convert", "{root}/a_file", "{root}/m.nanoqwen"], "not a folder"),
    (["convert", "{root}/hf", "{root}/m.nanoqwen", "--quant", "int3"], "int3"),
    (["descend", "--decode-steps", "-1"], "--decode-steps"),
    (["descend", "--prompt-ids", "-3,4"], "token id -3"),
    (["descend", "--prompt-ids", "5", "--report", "{root}/descend"], "at least 2 tokens"),
    (["descend", "--report", "{root}/a_file/descend"], "is not a folder"),
    (["descend", "--quant", "int3", "--report", "{root}/descend"], "--quant int3: unknown format; known: fp8_e4m3_channel, "),
    (["descend", "--model", "{root}/notok.nanoqwen", "--quant", "int8_sym_channel", "--report", "{root}/descend"],
     "is quantized as int4_sym_g128, not int8_sym_channel"),
    (["ladder", "--rungs", "nope"], "nope"),
    (["ladder", "--model", "{root}/missing.nanoqwen"], "no such file or folder"),
    (["ladder", "--model", "{root}/a_file"], "bad magic"),
    (["ladder", "--prompts", "{root}/missing.jsonl"], "no such file or folder"),
    (["ladder", "--prompts", "{root}/a_file", "--rungs", "graph"], "not JSON"),
    (["ladder", "--model", "{root}/notok.nanoqwen", "--prompts", "{root}/far.jsonl", "--rungs", "graph"],
     "outside the vocab"),
    (["ladder", "--baseline", "{root}/hf"], "no report.json"),
    (["ladder", "--report", "{root}/a_file/rep"], "is not a folder"),
    (["ladder", "--plant-fault", "cosmic_ray"], "unknown fault"),
    (["ladder", "--new-tokens", "0"], "--new-tokens"),
    (["bench", "--quant", "int4_sym_g128,int3"], "--quant: unknown quantization format 'int3'; known: fp8_e4m3_channel, "),
    (["frobnicate"], "invalid choice"),
    ([], "command"),
]


@pytest.mark.parametrize("argv,names", CASES, ids=[" ".join(a) or "(none)" for a, _ in CASES])
def test_an_input_error_is_one_line_and_exit_status_2(paths, capsys, argv, names):
    code = cli_main([a.format(root=paths) for a in argv])
    err = one_error_line(capsys)
    assert code == 2 and names in err


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU: cuda runs")
@pytest.mark.parametrize("argv,names", [
    (["bench"], "bench needs the cuda backend"),
    (["generate", "--prompt-ids", "1,2", "--backend", "cuda"], "cuda"),
])
def test_the_cuda_backend_on_a_machine_without_it_is_one_line(capsys, argv, names):
    assert cli_main(argv) == 2
    assert names in one_error_line(capsys)


def test_help_is_exit_status_0(capsys):
    assert cli_main(["generate", "--help"]) == 0
    assert "usage: nanoqwen generate" in capsys.readouterr().out


def test_an_error_under_a_progress_bar_starts_on_a_fresh_line(paths, tmp_path, monkeypatch, capsys):
    read = SafetensorsFolder.read
    calls = []

    def fails_on_the_fifth(self, name, **kw):
        calls.append(name)
        if len(calls) == 5:
            raise CheckpointError(f"{self.folder}: tensor {name} could not be read (planted)")
        return read(self, name, **kw)

    monkeypatch.setattr(SafetensorsFolder, "read", fails_on_the_fifth)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # a bar is drawn on a terminal
    assert cli_main(["convert", str(paths / "hf"), str(tmp_path / "m.nanoqwen")]) == 2
    lines = capsys.readouterr().err.split("\n")
    assert lines[-1] == "" and lines[-2].startswith("nanoqwen: error: ") and "planted" in lines[-2]
    assert lines[-3].startswith("\rconvert [")  # the bar's own line, ended before the message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_a_conversion_on_the_way_to_generate_shows_its_progress(paths, tmp_path, monkeypatch, capsys, terminal):
    """On a terminal a bar redrawn in place; into a pipe or a log a line per quarter, no carriage returns."""
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal, raising=False)
    assert cli_main(["generate", "--model", str(paths / "hf"), "--prompt-ids", "1,2", "--new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert f"converting {paths / 'hf'}" in err
    if terminal:
        assert "convert [" + "#" * 30 + "]" in err
    else:
        lines = [line for line in err.splitlines() if line.startswith("convert:")]
        assert "\r" not in err and 2 <= len(lines) <= 5 and "left" not in lines[-1] and lines[-1].split()[1].split("/")[0] == lines[-1].split()[1].split("/")[1]
    assert [p.suffix for p in (tmp_path / "converted").iterdir()] == [".nanoqwen"]


def test_descend_says_each_phase_before_it_starts():
    """The slow phases (reading and dequantizing, the HF simulation) are announced before they run."""
    from ladder.tools.descend import descend

    said = []

    class Stop(Exception):
        pass

    def progress(message):
        said.append(message)
        if "HF simulation" in message:
            raise Stop

    with pytest.raises(Stop):
        descend(random_model_file(), list(range(1, 20)), progress=progress)
    assert "reading" in said[0] and "prompt of 19 tokens" in said[1] and "HF simulation" in said[2]


# --- the installed command, run from a temporary folder --------------------------------------------

needs_installed = pytest.mark.skipif(EXE is None, reason="nanoqwen is not installed here (pip install -e '.[test]')")


def installed(*args, cwd):
    """The installed command from `cwd`, nothing of the checkout on its path (ladder/run/nested.py)."""
    return subprocess.Popen([EXE, *args], cwd=cwd, env=child_env(backend=None, pythonpath=None),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# --- broken checkpoints: refused before anything is written ---------------------------------------

LAST_LINEAR = "model.layers.1.mlp.down_proj.weight"  # the last tensor written: one line means nothing was
F16_BITS = {"nan": 0x7E00, "inf": 0x7C00, "-inf": 0xFC00}


def overwrite(folder: Path, tensor: str, index: tuple[int, ...], dtype: str, element: bytes) -> None:
    """Overwrite one element of a `dtype` tensor in the folder's model.safetensors with `element`'s bytes."""
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8: 8 + n])[tensor]
    assert meta["dtype"] == dtype
    at = 8 + n + meta["data_offsets"][0] + len(element) * int(np.ravel_multi_index(index, meta["shape"]))
    raw[at: at + len(element)] = element
    path.write_bytes(bytes(raw))


def plant(folder: Path, tensor: str, index: tuple[int, ...], value: str) -> None:
    """Overwrite one element of an fp16 tensor in the folder's model.safetensors with NaN or an infinity."""
    overwrite(folder, tensor, index, "F16", struct.pack("<H", F16_BITS[value]))


def refuse(argv: list[str], folder: Path, capsys, monkeypatch) -> str:
    """Run a command that must refuse `folder`; its one error line, after checking that it left nothing:
    no output, no temporary file, nothing in the (private) cache, nothing new in the checkpoint folder."""
    cache = folder.parent / "cache"
    monkeypatch.setenv("NANOQWEN_CACHE", str(cache))  # `ladder --model` converts into the cache
    before = sorted(p.name for p in folder.iterdir())
    assert cli_main(argv) == 2
    err = one_error_line(capsys)
    left = [p for p in folder.parent.rglob("*") if p.is_file() and folder not in p.parents]
    assert left == [] and sorted(p.name for p in folder.iterdir()) == before, left
    return err


def commands(folder: Path, quant: str) -> dict[str, list[str]]:
    out = folder.parent / "m.nanoqwen"
    return {"convert": ["convert", str(folder), str(out), "--quant", quant],
            "ladder": ["ladder", "--model", str(folder), "--quant", quant]}


@pytest.fixture
def broken(paths, tmp_path):
    """A private copy of the seeded checkpoint, free to break."""
    return Path(shutil.copytree(paths / "hf", tmp_path / "hf"))


@pytest.mark.parametrize("command", ["convert", "ladder"])
@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("quant", FORMAT_MODULES)
def test_a_non_finite_weight_is_one_line_naming_file_tensor_index_and_value(broken, capsys, monkeypatch, command,
                                                                             value, quant):
    plant(broken, LAST_LINEAR, (200, 700), value)
    err = refuse(commands(broken, quant)[command], broken, capsys, monkeypatch)
    assert f"{broken / 'model.safetensors'}: tensor {LAST_LINEAR} holds {value} at index (200, 700)" in err
    assert f"{quant} cannot quantize" in err


@pytest.mark.parametrize("command", ["convert", "ladder"])
@pytest.mark.parametrize("tensor,index,value", [
    ("model.embed_tokens.weight", (511, 3), "nan"),
    ("model.norm.weight", (5,), "-inf"),
    ("model.layers.1.self_attn.v_proj.bias", (0,), "inf"),
])
def test_a_non_finite_value_in_a_tensor_kept_fp16_is_refused_too(broken, capsys, monkeypatch, command, tensor, index,
                                                                 value):
    plant(broken, tensor, index, value)
    err = refuse(commands(broken, "int4_sym_g128")[command], broken, capsys, monkeypatch)
    assert f"model.safetensors: tensor {tensor} holds {value} at index {index}" in err and "kept as float16" in err


def test_a_non_finite_weight_error_carries_its_parts(broken, tmp_path):
    plant(broken, LAST_LINEAR, (3, 17), "nan")
    plant(broken, LAST_LINEAR, (9, 0), "-inf")
    with pytest.raises(NonFiniteWeightError) as e:
        convert(broken, tmp_path / "m.nanoqwen", "int8_sym_channel")
    assert isinstance(e.value, CheckpointError) and "the first of 2 non-finite values" in str(e.value)
    assert (e.value.tensor, e.value.index, e.value.value, e.value.count, e.value.quant) == (
        LAST_LINEAR, (3, 17), "nan", 2, "int8_sym_channel")


def library_refusal(blob: bytes) -> str:
    """The first line of the tokenizers library's own reason for refusing `blob`."""
    from tokenizers import Tokenizer

    with pytest.raises(Exception) as e:
        Tokenizer.from_str(blob.decode())
    return str(e.value).splitlines()[0]


@pytest.mark.parametrize("command", ["convert", "ladder"])
@pytest.mark.parametrize("blob", [b'{"not": "a tokenizer"}', b'{"version": "1.0", "model": {"type": "BPE", "vo',
                                  b"[1, 2]", b""], ids=["not-a-tokenizer", "truncated", "a-list", "empty"])
def test_a_tokenizer_the_library_refuses_is_one_line_at_convert_time(broken, capsys, monkeypatch, command, blob):
    (broken / "tokenizer.json").write_bytes(blob)
    err = refuse(commands(broken, "int4_sym_g128")[command], broken, capsys, monkeypatch)
    assert f"{broken / 'tokenizer.json'}: the tokenizers library refuses it ({library_refusal(blob)})" in err


def test_a_tokenizer_that_is_not_utf8_is_refused_at_convert_time(broken, tmp_path):
    (broken / "tokenizer.json").write_bytes(b'{"version": "\xff"}')
    with pytest.raises(CheckpointTokenizerError, match="tokenizer.json: not UTF-8"):
        convert(broken, tmp_path / "m.nanoqwen")
    assert not (tmp_path / "m.nanoqwen").exists()


@needs_installed
@pytest.mark.parametrize("command", ["convert", "ladder"])
def test_the_installed_command_refuses_a_broken_checkpoint_in_one_line(paths, tmp_path, command):
    """As a user runs it, from a folder outside the checkout: no traceback, exit 2, nothing left behind."""
    folder = Path(shutil.copytree(paths / "hf", tmp_path / "hf"))
    plant(folder, "model.layers.0.mlp.down_proj.weight", (3, 17), "nan")
    argv = {"convert": ["convert", "hf", "out.nanoqwen"], "ladder": ["ladder", "--model", "hf"]}[command]
    proc = subprocess.Popen([EXE, *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=child_env(backend=None, pythonpath=None, NANOQWEN_CACHE=str(tmp_path / "cache")))
    out, err = (s.decode() for s in proc.communicate(timeout=300))
    assert proc.returncode == 2 and err.count("\n") == 1 and err.startswith("nanoqwen: error: "), err[-3000:]
    assert "tensor model.layers.0.mlp.down_proj.weight holds nan at index (3, 17)" in err
    assert [p for p in tmp_path.rglob("*") if p.is_file() and "hf" not in p.parts] == []


@needs_installed
@pytest.mark.parametrize("argv,names", [
    (["generate", "--prompt-ids", "1,2", "--new-tokens", "-1"], "--new-tokens"),
    (["generate", "--prompt-ids", "-1,2"], "token id -1"),
    (["convert", "{hf}", "."], "is a folder"),
    (["inspect", "missing.nanoqwen"], "missing.nanoqwen"),
] + ([] if HAS_CUDA else [(["bench"], "bench needs the cuda backend")]))
def test_the_installed_command_refuses_in_one_line(tmp_path, argv, names):
    proc = installed(*(a.format(hf=random_model_dir()) for a in argv), cwd=tmp_path)
    out, err = (s.decode() for s in proc.communicate(timeout=300))
    assert proc.returncode == 2, err[-3000:]
    assert err.count("\n") == 1 and err.startswith("nanoqwen: error: ") and names in err, err[-3000:]
    assert list(tmp_path.iterdir()) == []


@needs_installed
def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    """`nanoqwen inspect F | head -0`: the reader is gone before the first line; no traceback."""
    proc = installed("inspect", str(random_model_file()), cwd=tmp_path)
    proc.stdout.close()  # the reader leaves at once
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == "", err[-3000:]


@needs_installed
def test_inspect_into_head_prints_its_first_line_and_no_traceback(tmp_path):
    inspect = installed("inspect", str(random_model_file()), cwd=tmp_path)
    head = subprocess.run(["head", "-1"], stdin=inspect.stdout, capture_output=True, text=True, timeout=300)
    inspect.stdout.close()
    err = inspect.stderr.read().decode()
    assert inspect.wait(timeout=300) in (0, 141) and err == "", err[-3000:]
    assert head.stdout.startswith("file:") and head.stdout.count("\n") == 1


@pytest.mark.parametrize("argv,names", [
    (["--tokens", "1"], "lengths of 2 or more"),
    (["--tokens", "16,x"], "comma list of integers"),
    (["--shape", "qwen-nope"], "unknown shape 'qwen-nope'"),
])
def test_the_prefill_gemm_bench_refuses_bad_input_in_one_line(argv, names):
    """`python -m bench.prefill_gemm` (bench/ is a leaf: run, not imported): one line, exit status 2."""
    res = subprocess.run([sys.executable, "-m", "bench.prefill_gemm", *argv], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr[-1000:])
    assert lines[0].startswith("bench.prefill_gemm: error:") and names in lines[0]


# --- fp32 values past float16's range, where the file stores float16 -------------------------------


@pytest.fixture(scope="module")
def fp32_hf(paths):
    """The seeded checkpoint saved in fp32, whose values may lie past float16's range."""
    return build_random_model(paths / "hf32", SMALL, seed=5, dtype=np.float32, with_tokenizer=False)


@pytest.fixture
def broken32(fp32_hf, tmp_path):
    """A private copy of the fp32 checkpoint, free to break."""
    return Path(shutil.copytree(fp32_hf, tmp_path / "hf"))


def plant_f32(folder: Path, tensor: str, index: tuple[int, ...], value: float) -> None:
    """Overwrite one element of an fp32 tensor in the folder's model.safetensors with `value`."""
    overwrite(folder, tensor, index, "F32", struct.pack("<f", value))


@pytest.mark.parametrize("command", ["convert", "ladder"])
@pytest.mark.parametrize("tensor,index,value,shown,becomes", [
    ("model.embed_tokens.weight", (511, 3), 70000.0, "70000.0", "inf"),
    ("model.norm.weight", (5,), -65520.0, "-65520.0", "-inf"),  # the first value float16 rounds to -inf
    ("model.layers.1.self_attn.v_proj.bias", (0,), 1e30, "1e+30", "inf"),
    ("lm_head.weight", (7, 255), 3e38, "3e+38", "inf"),
])
def test_an_fp32_value_past_float16s_range_in_a_tensor_kept_fp16_is_one_line_naming_it(broken32, capsys, monkeypatch,
                                                                                     command, tensor, index, value,
                                                                                     shown, becomes):
    plant_f32(broken32, tensor, index, value)
    err = refuse(commands(broken32, "int4_sym_g128")[command], broken32, capsys, monkeypatch)
    assert (f"{broken32 / 'model.safetensors'}: tensor {tensor} holds {shown} at index {index}; the tensor is stored "
            f"as float16, whose largest finite value is 65504, so it would become {becomes}\n") in err


@pytest.mark.parametrize("quant,value,shown,why", [
    ("int4_sym_g128", 1e6, "1000000.0", "a group's max |w| / 7 overflows fp16"),
    ("int4_asym_g128", 1e6, "1000000.0", "a group's (max - min) / 15 overflows fp16"),
    ("int8_sym_channel", 1e7, "10000000.0", "a row's max |w| / 127 overflows fp16"),
    ("fp8_e4m3_channel", 1e8, "100000000.0", "a row's max |w| / 448 overflows fp16"),
])
def test_an_fp32_weight_whose_fp16_scale_would_overflow_is_one_line_naming_it(broken32, capsys, monkeypatch, quant,
                                                                             value, shown, why):
    """Large weights only make a large scale, until the scale itself is past float16's range."""
    plant_f32(broken32, LAST_LINEAR, (200, 700), value)
    err = refuse(commands(broken32, quant)["convert"], broken32, capsys, monkeypatch)
    assert (f"{broken32 / 'model.safetensors'}: tensor {LAST_LINEAR} holds {shown} at index (200, 700); {quant} "
            f"stores its scales as float16, whose largest finite value is 65504: {why}") in err


def test_fp32_values_up_to_float16s_largest_convert(broken32, tmp_path):
    """65504 is float16's largest finite value: kept as it is; below 65520 float16 rounds to it, not to
    inf; a quantized weight as large as its format's fp16 scale allows converts too."""
    from engine.modelfile import ModelFile

    plant_f32(broken32, "model.embed_tokens.weight", (511, 3), 65504.0)
    plant_f32(broken32, "model.norm.weight", (5,), -65504.0)
    plant_f32(broken32, "lm_head.weight", (7, 255), 65519.0)
    plant_f32(broken32, LAST_LINEAR, (200, 700), 65504.0 * 7)  # int4_sym_g128's scale: exactly 65504
    convert(broken32, tmp_path / "m.nanoqwen")
    mf = ModelFile(tmp_path / "m.nanoqwen")
    assert mf.tensor("model.embed_tokens.weight")[511, 3] == 65504
    assert mf.tensor("model.norm.weight")[5] == -65504
    assert mf.tensor("lm_head.weight")[7, 255] == 65504
    assert mf.tensor(LAST_LINEAR.replace(".weight", ".scales"))[200, 700 // 128] == 65504


def test_a_float16_range_error_carries_its_parts(broken32, tmp_path):
    plant_f32(broken32, "model.norm.weight", (9,), 1e5)
    plant_f32(broken32, "model.norm.weight", (20,), -1e9)
    with pytest.raises(Float16RangeError) as e:
        convert(broken32, tmp_path / "m.nanoqwen", "int8_sym_channel")
    assert isinstance(e.value, CheckpointError) and "the first of 2 values out of float16's range" in str(e.value)
    assert (e.value.tensor, e.value.index, e.value.value, e.value.count, e.value.quant) == (
        "model.norm.weight", (9,), "100000.0", 2, None)
    assert not (tmp_path / "m.nanoqwen").exists() and list(tmp_path.glob(".*")) == []
