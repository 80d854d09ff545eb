"""Unit rung: golden activations are refused when stale or missing, with the command that fixes it; a
user's model gets its own, computed once by the reference and kept."""

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


@pytest.mark.long
def test_a_users_model_gets_golden_activations_computed_once_and_kept(tmp_path, monkeypatch):
    """No skip for a model the repository has no golden files of: the reference computes them, keeps them
    under the cache folder, and the next load reads them; a stale kept folder is computed again."""
    pytest.importorskip("transformers")
    from fixtures.tiny_model import random_model_file

    from engine.modelfile import ModelFile

    path = random_model_file(seed=3)
    layers = ModelFile(path).config_dict["num_hidden_layers"]
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    monkeypatch.setattr(golden, "GOLDEN_ROOT", tmp_path / "repo-golden")  # the repository holds none of it
    writes = []
    write = golden.write_golden
    monkeypatch.setattr(golden, "write_golden", lambda *a, **k: writes.append(1) or write(*a, **k))
    with pytest.raises(golden.GoldenError, match="no golden activations"):
        golden.load_golden(path, MODEL_CASES[0])  # without keep: the default model's rule
    first = golden.load_golden(path, MODEL_CASES[0], keep=True)
    assert writes == [1] and golden.kept_golden_dir(path).is_relative_to(tmp_path)
    again = golden.load_golden(path, MODEL_CASES[1].resolve(layers), keep=True)
    assert writes == [1] and set(first) == set(again) == {"x", "out", "k", "v"}
    manifest = golden.kept_golden_dir(path) / "manifest.json"
    stale = json.loads(manifest.read_text())
    stale["key"]["reference"] = "0" * 16
    manifest.write_text(json.dumps(stale))
    golden.load_golden(path, MODEL_CASES[0], keep=True)
    assert writes == [1, 1]
