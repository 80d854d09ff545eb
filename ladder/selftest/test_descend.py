"""Self-test: `nanoqwen descend` finds planted bugs at the layer and op where they are, and finds
nothing on the clean engine."""

from __future__ import annotations

import json

import pytest

from engine.cli import main as cli_main

pytest.importorskip("torch", reason="the descent compares with the HF simulation (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="the descent compares with the HF simulation (pip install -e '.[test]')")

PROMPT_IDS = ",".join(str(i) for i in range(100, 140))  # 40 tokens: 23 prefill + 17 decode steps


@pytest.mark.parametrize("fault,layer,op", [
    ("wrong_rope_theta@2", 2, "rope_kv_write (q)"),
    ("dropped_qkv_bias@1", 1, "qkv_proj"),
    ("stale_page_read", 0, "attention_decode"),
    ("fp16_accumulation@3", 3, "down_residual"),  # under a layer's fp16 noise: only the op check sees it
])
def test_descent_names_the_layer_and_op_of_a_planted_fault(tmp_path, capsys, fault, layer, op):
    code = cli_main(["descend", "--prompt-ids", PROMPT_IDS, "--plant-fault", fault, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "descend.json").read_text())
    assert code == 1
    assert (result["first_layer"], result["first_op"]) == (layer, op), capsys.readouterr().out
    assert f"first diverging layer {layer}" in capsys.readouterr().out


def test_descent_of_the_clean_engine_finds_nothing(tmp_path, capsys):
    assert cli_main(["descend", "--prompt-ids", PROMPT_IDS, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "descend.json").read_text())
    assert result["first_layer"] is None and len(result["layers"]) == 6
    assert not any(c["diverged"] for c in result["layers"]) and not result["ops"]
    assert "every layer and every op within its bound" in capsys.readouterr().out


def test_descent_refuses_a_one_token_prompt(tmp_path, capsys):
    assert cli_main(["descend", "--prompt-ids", "5", "--out", str(tmp_path)]) == 2
    assert "at least 2 tokens" in capsys.readouterr().err
