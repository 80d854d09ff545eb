"""Self-test: the paths a user takes, run the way a user runs them.

Every test here starts the installed `nanoqwen` command in a subprocess, from a temporary folder that is
not the checkout, and most of them on a model that is not the default: a seeded Qwen2 in Hugging Face
layout with its tokenizer.json, and the same model without one. A wheel built from the checkout and
installed into a temporary folder (no editable install, no checkout on the path) runs the ladder too.
Each test keeps its selection small (`-- -k ...`) so the whole file costs CI about a minute.

Skipped, with the reason, where `nanoqwen` is not installed (a GPU machine without a package index runs
the project from its checkout as `python -m ladder`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import COMMANDS
from ladder.run.nested import child_env, skip_inside_nested_run

REPO = Path(__file__).resolve().parents[2]
EXE = shutil.which("nanoqwen")
pytestmark = [
    pytest.mark.skipif(EXE is None, reason="nanoqwen is not installed here (pip install -e '.[test]'); the "
                                           "checkout runs python -m ladder"),
    skip_inside_nested_run,  # a run started from inside a ladder run never starts more (ladder/run/nested.py)
]


def nanoqwen(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """The installed command, as a user starts it: from `cwd`, nothing of the checkout on sys.path."""
    return subprocess.run([EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=child_env(backend=None, pythonpath=None))


def report_of(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def checkout_untouched(before: set[str]) -> None:
    after = set(os.listdir(REPO))
    assert after <= before, f"the run wrote into the checkout: {sorted(after - before)}"


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    """Two Hugging Face folders of a model that is not the default: with a tokenizer.json and without."""
    from engine.config import SHAPES
    from fixtures.tiny_model import random_model_dir

    src = random_model_dir(seed=5, config=SHAPES["tiny"])
    root = tmp_path_factory.mktemp("user-models")
    with_tok, without_tok = root / "qwen-with-tokenizer", root / "qwen-without-tokenizer"
    shutil.copytree(src, with_tok)
    shutil.copytree(src, without_tok)
    (without_tok / "tokenizer.json").unlink()
    return with_tok, without_tok


@pytest.mark.parametrize("command", ["generate", "convert", "inspect", *COMMANDS])
def test_installed_command_line_knows_every_subcommand(tmp_path, command):
    r = nanoqwen(command, "--help", cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "usage: nanoqwen" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("rung, selection", [("unit", "rmsnorm and numpy"), ("layer", "golden and layer0"),
                                             ("graph", "heldout-000 or heldout-041")], ids=["unit", "layer", "graph"])
def test_ladder_rung_from_a_foreign_folder_writes_its_report_there(tmp_path, rung, selection):
    before = set(os.listdir(REPO))
    r = nanoqwen("ladder", "--rungs", rung, "-n", "0", "--backend", "numpy", "--report", "rep", "--skip-determinism",
                 "--", "-k", selection, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rep = report_of(tmp_path / "rep")
    assert rep["meta"]["result"] == "passed"
    assert rep["rungs"][rung].get("passed", 0) > 0 and not rep["rungs"][rung].get("failed"), rep["rungs"]
    assert (tmp_path / "rep" / f"junit-{rung}.xml").exists()
    assert "PytestUnknownMarkWarning" not in out and "Unknown pytest.mark" not in out
    checkout_untouched(before)


@pytest.mark.parametrize("which, quant", [("with-tokenizer", "int4_sym_g128"), ("without-tokenizer", "int8_sym_channel")])
def test_ladder_on_the_users_hf_folder_is_green(tmp_path, user_models, which, quant):
    """A user's own Qwen2 folder: its tokenizer re-tokenizes the prompts' text; without one, the prompts
    are drawn inside its vocab. Layer and graph rungs both run on it, in one format each (the folder's
    conversion and prompts are what is under test here; the rungs check every format on the default
    model, and each format's first graph run on a new model measures its bounds: 20 s of a CI core)."""
    model = user_models[0] if which == "with-tokenizer" else user_models[1]
    r = nanoqwen("ladder", "--model", str(model), "--quant", quant, "--rungs", "layer,graph", "-n", "0",
                 "--backend", "numpy", "--report", "rep", "--skip-determinism", "--",
                 "-k", "hf_decoder_layer or heldout-000 or heldout-041 or heldout-077", cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rep = report_of(tmp_path / "rep")
    assert rep["rungs"]["layer"].get("passed", 0) > 0 and rep["rungs"]["graph"].get("passed", 0) >= 3, rep["rungs"]
    assert "outside the model's vocab" not in out


def test_ladder_with_a_model_path_relative_to_the_users_folder(tmp_path, user_models):
    r = nanoqwen("convert", str(user_models[0]), "mine.nanoqwen", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = nanoqwen("ladder", "--model", "mine.nanoqwen", "--rungs", "graph", "-n", "0", "--backend", "numpy",
                 "--report", "rep", "--skip-determinism", "--", "-k", "heldout-000", cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert report_of(tmp_path / "rep")["meta"]["model"] == str(tmp_path / "mine.nanoqwen")


def test_convert_inspect_generate_descend_on_the_users_model(tmp_path, user_models):
    with_tok, without_tok = user_models
    r = nanoqwen("convert", str(with_tok), "user.nanoqwen", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote user.nanoqwen" in r.stdout

    r = nanoqwen("inspect", "user.nanoqwen", cwd=tmp_path)
    assert r.returncode == 0 and "model.layers.0.self_attn.q_proj.qweight" in r.stdout, r.stderr[-3000:]

    r = nanoqwen("generate", "--model", "user.nanoqwen", "--prompt", "def f(x):", "--new-tokens", "5",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "text:" in r.stdout and "def f(x):" in r.stdout

    r = nanoqwen("generate", "--model", str(without_tok), "--prompt-ids", "1,2,3", "--new-tokens", "5",
                 "--no-stop", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    new = json.loads(r.stdout.split("new ids:", 1)[1].splitlines()[0])
    assert len(new) == 5 and all(0 <= t < 512 for t in new)

    r = nanoqwen("descend", "--model", "user.nanoqwen", "--prompt", "def f(x):\n    return", "--report", "desc",
                 cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert (tmp_path / "desc" / "descend.json").exists()


def _copy_source(repo: Path, dst: Path) -> None:
    """The files a clean clone builds from: tracked, and new ones git does not ignore (a module not yet
    added). Not the ignored rest: CI's virtual environment sits inside its clone (1.3 GB, most of this
    test's time when it was copied too), and so do caches and reports."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, timeout=120)
    if listed.returncode != 0:  # not a git checkout (an unpacked sdist): everything but the usual clutter
        shutil.copytree(repo, dst, ignore=shutil.ignore_patterns(".git", ".venv", "venv", "build", "*.egg-info",
                                                                 "__pycache__", "reports", ".tox", ".hypothesis",
                                                                 ".pytest_cache"))
        return
    for rel in filter(None, listed.stdout.decode().split("\0")):
        if (repo / rel).is_file():  # a tracked file deleted in the working tree is not built
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / rel, dst / rel)


@pytest.mark.long  # 9 to 30 s on CI's 2 cores: started first, not left to end the suite alone
def test_a_wheel_installed_elsewhere_runs_the_ladder(tmp_path):
    """Built and installed as a wheel (not editable) into a folder of its own: the package data (CUDA
    sources, the default model, prompts, golden files) travel, and a rung runs from that folder alone."""
    wheels, site, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
    # Built from a copy: setuptools builds in the source tree, and the checkout stays as it was.
    _copy_source(REPO, src)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("nanoqwen-*.whl")
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-3000:]
    assert list((site / "kernels" / "cuda").glob("*.cu")) and (site / "fixtures" / "data" / "prompts.jsonl").exists()
    work = tmp_path / "work"
    work.mkdir()
    env = child_env(backend=None, pythonpath=str(site))
    r = subprocess.run([sys.executable, "-m", "ladder", "ladder", "--rungs", "unit,layer", "-n", "0",
                        "--backend", "numpy", "--report", "rep", "--", "-k", "argmax or (golden and layer0)"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    where = subprocess.run([sys.executable, "-c", "import engine, ladder; print(ladder.__file__, engine.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120).stdout.split()
    assert where and all(Path(w).is_relative_to(site) for w in where), f"imported from {where}, not {site}"
    rep = report_of(work / "rep")
    assert rep["rungs"]["unit"]["passed"] > 0 and rep["rungs"]["layer"]["passed"] > 0, rep["rungs"]
    assert "Unknown pytest.mark" not in out
