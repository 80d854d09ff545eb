"""Self-test: `nanoqwen quant-report` measures what it says. Its metrics are sane on a tiny seeded model
(KL >= 0, agreement in [0, 1], a perplexity change that is the difference of two perplexities), exact on
an identity (the same logits twice, or a format that stores the weight as it is: KL 0, agreement 1, no
change), its JSON holds every format and every column, it draws its chart where matplotlib is
installed, the installed command runs it end to end from a foreign folder, and bad input is one line
and exit status 2.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import subprocess

import numpy as np
import pytest

from engine.cli import main as cli_main
from engine.config import SHAPES
from engine.formats import FORMATS, Format
from kernels import cuda_available
from ladder.run.nested import child_env
from ladder.tools.quant_report import (COLUMNS, Subject, Tally, compare_logits, gemv_cell, measure_model,
                                 seeded_subject)

TINY = "tiny"  # the seeded shape the tests run: 4 layers, hidden 256, vocab 512
SMALL_RUN = ["--models", "seeded", "--seeded-shape", TINY, "--windows", "2", "--window", "24"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_CUDA = cuda_available()[0]
EXE = shutil.which("nanoqwen")


class StoredAsIs(Format):
    """A format-like identity: the weight itself is the stored tensor (fp32 values, 2 bytes a weight
    counted as if fp16), so its round trip changes nothing."""

    name = "stored_as_is"

    def tensor_specs(self, out_features, in_features):
        return {".weight": ("float16", (out_features, in_features))}

    def quantize(self, w):
        return {"weight": np.array(w, dtype=np.float32, copy=True)}

    def dequantize(self, tensors):
        return np.array(tensors["weight"], dtype=np.float32, copy=True)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """One in-process `nanoqwen quant-report` on the tiny seeded model: (exit code, stdout, out folder)."""
    out = tmp_path_factory.mktemp("quant") / "report"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli_main(["quant-report", *SMALL_RUN, "--report", str(out)])
    return code, stdout.getvalue(), out


def test_the_same_logits_twice_give_zero_kl_full_agreement_and_no_change():
    rng = np.random.default_rng(3)
    logits = (4 * rng.standard_normal((40, 97))).astype(np.float32)
    targets = rng.integers(0, 97, size=40)
    f = compare_logits(logits, logits, targets)
    assert f["kl_mean"] == 0.0 and f["top1_agreement"] == 1.0
    assert f["ppl_change"] == 0.0 and f["ppl_change_pct"] == 0.0 and f["perplexity"] == f["fp16_perplexity"]


def test_other_logits_give_positive_kl_and_agreement_in_range():
    rng = np.random.default_rng(4)
    ref = (4 * rng.standard_normal((64, 50))).astype(np.float32)
    quant = ref + rng.standard_normal(ref.shape).astype(np.float32)
    targets = rng.integers(0, 50, size=64)
    f = compare_logits(ref, quant, targets)
    assert f["kl_mean"] > 0.0 and 0.0 <= f["top1_agreement"] <= 1.0
    whole = Tally().add(ref[:30], quant[:30], targets[:30]).add(ref[30:], quant[30:], targets[30:]).figures()
    assert whole["positions"] == 64 and whole["top1_agreement"] == f["top1_agreement"]


def test_a_format_that_stores_the_weight_as_it_is_changes_nothing():
    """Through the whole path (round trip, HF simulation, windows): the quantized model is the fp16 one."""
    subject = seeded_subject(TINY, seed=0, window=24, max_windows=2)
    row = measure_model(subject, [StoredAsIs()], progress=lambda message: None)["formats"]["stored_as_is"]
    assert row["kl_mean"] == 0.0 and row["top1_agreement"] == 1.0 and row["ppl_change"] == 0.0
    assert row["bytes_per_weight"] == 2.0 and row["positions"] == 48


def test_a_tied_shape_gets_its_own_lm_head_unless_asked_to_keep_it_tied(monkeypatch):
    """The seeded embedding as a head makes one-hot distributions (docs/QUANT_REPORT.md): untied by default."""
    monkeypatch.setitem(SHAPES, "tiny-tied", SHAPES[TINY].replace(tie_word_embeddings=True))
    untied = seeded_subject("tiny-tied", seed=0, window=24, max_windows=1)
    tied = seeded_subject("tiny-tied", seed=0, window=24, max_windows=1, tied_head=True)
    assert not untied.config.tie_word_embeddings and "lm_head.weight" in untied.weights
    assert tied.config.tie_word_embeddings and "lm_head.weight" not in tied.weights
    assert "its own lm_head" in untied.label and "its own lm_head" not in tied.label
    for name in ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight"):  # the same draws otherwise
        assert np.array_equal(untied.weights[name], tied.weights[name])


def test_every_format_on_the_tiny_seeded_model_has_sane_figures(tiny_report):
    code, _, out = tiny_report
    assert code == 0
    m = json.loads((out / "quant_report.json").read_text())["models"]["seeded"]
    assert m["positions"] == 48 and m["fp16"]["perplexity"] > 0
    for name, r in m["formats"].items():
        assert r["kl_mean"] >= 0.0 and 0.0 <= r["top1_agreement"] <= 1.0, name
        assert r["ppl_change"] == pytest.approx(r["perplexity"] - m["fp16"]["perplexity"], rel=1e-12), name
        assert 0.0 < r["bytes_per_weight"] < 2.0, name  # every shipped format is smaller than fp16


def test_the_json_holds_every_format_and_every_column(tiny_report):
    _, stdout, out = tiny_report
    report = json.loads((out / "quant_report.json").read_text())
    rows = report["models"]["seeded"]["formats"]
    assert set(rows) == set(FORMATS) and set(report["columns"]) == set(COLUMNS)
    for name, r in rows.items():
        assert set(COLUMNS) <= set(r), f"{name} lacks {sorted(set(COLUMNS) - set(r))}"
        assert name in stdout
    kls = [rows[name]["kl_mean"] for name in [line.split()[0] for line in stdout.splitlines() if line.split()
                                               and line.split()[0] in rows]]
    assert kls == sorted(kls)  # the table lists the formats by KL
    if not HAS_CUDA:
        assert all(r["gemv_7b"] == "no GPU" for r in rows.values()) and "no GPU" in stdout


def test_the_chart_is_drawn_where_matplotlib_is_installed(tiny_report):
    _, stdout, out = tiny_report
    if HAS_MATPLOTLIB:
        assert (out / "quant_report.png").stat().st_size > 0
    else:
        assert "no chart" in stdout and not (out / "quant_report.png").exists()


def test_the_gemv_cell_says_no_gpu_off_a_gpu_and_the_time_against_the_floor_on_one():
    assert gemv_cell({"available": False, "summary": {}}, "int8_sym_channel") == "no GPU"
    on_gpu = {"available": True, "summary": {"a": {"format": "a", "ok": True, "time_us": 40.0, "x_floor": 1.6},
                                             "b": {"format": "b", "ok": False}}}
    assert gemv_cell(on_gpu, "a") == "40.0 us, 1.60x floor"
    assert gemv_cell(on_gpu, "b") == "WRONG (see JSON)" and gemv_cell(on_gpu, "c") == "not measured"


@pytest.mark.skipif(EXE is None, reason="nanoqwen is not installed here (pip install -e '.[test]')")
def test_the_installed_command_writes_its_report_under_the_folder_it_runs_from(tmp_path):
    r = subprocess.run([EXE, "quant-report", *SMALL_RUN, "--windows", "1", "--quant", "int8_sym_channel,int4_sym_g128"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=child_env(backend=None, pythonpath=None))
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "reports" / "quant" / "quant_report.json").read_text())
    assert set(report["models"]["seeded"]["formats"]) == {"int8_sym_channel", "int4_sym_g128"}
    assert "quant-report: seeded:" in r.stderr and "int4_sym_g128" in r.stdout


BAD = [
    (["--quant", "int3"], "unknown quantization format 'int3'"),
    (["--quant", ""], "got none"),
    (["--quant", "int8_sym_channel,,int4_sym_g128"], "an empty item"),
    (["--models", "seeded,huge"], "unknown model 'huge'"),
    (["--seeded-shape", "qwen9-900b"], "invalid choice: 'qwen9-900b'"),
    (["--windows", "-1"], "--windows"),
    (["--window", "0"], "--window"),
    (["--report", "{root}/a_file/report"], "is not a folder"),
]


@pytest.mark.parametrize("argv,names", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, argv, names):
    (tmp_path / "a_file").write_text("not a folder")
    code = cli_main(["quant-report", *SMALL_RUN, *(a.format(root=tmp_path) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("nanoqwen: error: ") and names in err, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # refused before any work
