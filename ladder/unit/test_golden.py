"""Unit rung: golden activations are refused when stale or missing, with the command that fixes it."""

from __future__ import annotations

import json
import shutil

import pytest

from fixtures import golden
from fixtures.layer_cases import MODEL_CASES
from fixtures.default_model import default_model_file


@pytest.fixture
def golden_copy(tmp_path, monkeypatch):
    path = default_model_file()
    src = golden.golden_dir(path)
    if not (src / "manifest.json").exists():
        pytest.fail(f"the default model ships golden activations; missing in {src}: run {golden.UPDATE_COMMAND}")
    monkeypatch.setattr(golden, "GOLDEN_ROOT", tmp_path)
    shutil.copytree(src, tmp_path / src.name)
    return path, tmp_path / src.name


def test_current_golden_loads(golden_copy):
    path, _ = golden_copy
    case = MODEL_CASES[0]
    assert set(golden.load_golden(path, case)) == {"x", "out", "k", "v"}


@pytest.mark.parametrize("part", ["reference", "cases", "model"])
def test_stale_golden_names_what_changed_and_the_command(golden_copy, part):
    path, folder = golden_copy
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["key"][part] = "0" * 16
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(golden.GoldenError, match=f"stale \\({part} changed.*--update-golden"):
        golden.load_golden(path, MODEL_CASES[0])


def test_missing_golden_says_how_to_create_it(golden_copy):
    path, folder = golden_copy
    shutil.rmtree(folder)
    with pytest.raises(golden.GoldenError, match="no golden activations.*--update-golden"):
        golden.load_golden(path, MODEL_CASES[0])
