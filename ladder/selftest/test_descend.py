"""Self-test: `nanoqwen descend` finds planted bugs at the layer and op where they are, and finds
nothing on the clean engine; it descends on the backend and in the format it is given, so the ladder's
`nanoqwen descend --backend B --quant F` checks what went red.

The descents run on NumPy (`--backend numpy`); without `--backend` it checks every backend this machine
can run, which on a GPU machine would add a CUDA descent to each case."""

from __future__ import annotations

import importlib.util
import json

import pytest

from engine.cli import main as cli_main
from engine.formats import DEFAULT_FORMAT
from kernels import backend_available, backend_names
from ladder.tools.descend import backends_to_check

# The descents compare with the HF simulation; the choice of backends and the refusals need neither.
needs_hf = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
                              reason="the descent compares with the HF simulation (pip install -e '.[test]')")

PROMPT_IDS = ",".join(str(i) for i in range(100, 140))  # 40 tokens: 23 prefill + 17 decode steps


@needs_hf
@pytest.mark.parametrize("fault,layer,op", [
    ("wrong_rope_theta@2", 2, "rope_kv_write (q)"),
    ("dropped_qkv_bias@1", 1, "qkv_proj"),
    ("stale_page_read", 0, "attention_decode"),
    ("fp16_accumulation@3", 3, "down_residual"),  # under a layer's fp16 noise: only the op check sees it
])
def test_descent_names_the_layer_and_op_of_a_planted_fault(tmp_path, capsys, fault, layer, op):
    code = cli_main(["descend", "--backend", "numpy", "--prompt-ids", PROMPT_IDS, "--plant-fault", fault,
                     "--report", str(tmp_path)])
    summary = json.loads((tmp_path / "descend.json").read_text())
    result = summary["backends"]["numpy"]
    assert code == 1 and summary["diverged"] == ["numpy"]
    assert (result["first_layer"], result["first_op"]) == (layer, op), capsys.readouterr().out
    assert f"first diverging layer {layer}" in capsys.readouterr().out


@needs_hf
def test_descent_of_the_clean_engine_finds_nothing(tmp_path, capsys):
    assert cli_main(["descend", "--backend", "numpy", "--prompt-ids", PROMPT_IDS, "--report", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "descend.json").read_text())
    result = summary["backends"]["numpy"]
    assert summary["quant"] == DEFAULT_FORMAT and summary["diverged"] == []
    assert result["first_layer"] is None and len(result["layers"]) == 6
    assert not any(c["diverged"] for c in result["layers"]) and not result["ops"]
    assert "every layer and every op within its bound" in capsys.readouterr().out


def test_descent_refuses_a_one_token_prompt(tmp_path, capsys):
    assert cli_main(["descend", "--prompt-ids", "5", "--report", str(tmp_path)]) == 2
    assert "at least 2 tokens" in capsys.readouterr().err


@needs_hf
def test_descent_runs_the_default_model_in_the_format_given(tmp_path, capsys):
    assert cli_main(["descend", "--backend", "numpy", "--quant", "int8_sym_channel", "--prompt-ids", PROMPT_IDS,
                     "--report", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "descend.json").read_text())
    assert summary["quant"] == summary["backends"]["numpy"]["quant"] == "int8_sym_channel"
    assert "checking backend numpy in format int8_sym_channel" in capsys.readouterr().out


def test_without_backend_it_checks_every_backend_this_machine_can_run():
    runs = [b for b in backend_names() if backend_available(b)[0]]
    checked, left_out = backends_to_check(None)
    assert checked == runs and "numpy" in checked
    assert [s.split(" ")[0] for s in left_out] == [b for b in backend_names() if b not in runs]
    assert backends_to_check("numpy") == (["numpy"], [])


@pytest.mark.skipif(backend_available("cuda")[0], reason="this machine has a GPU: cuda runs")
def test_a_backend_this_machine_cannot_run_is_one_line_before_anything_is_written(tmp_path, capsys):
    assert cli_main(["descend", "--backend", "cuda", "--report", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoqwen: error: --backend cuda cannot run on this machine: ")
    assert not (tmp_path / "d").exists()
