"""Self-test: the product commands load only the product. `nanoqwen generate`, `convert` and `inspect`
run in a fresh interpreter, and afterwards no module of ladder/, bench/ or reference/ is loaded, nor of
fixtures/ anything past the default model's lookup (and that only when no --model is named), nor torch,
transformers or pytest. The other commands are found by name (engine/cli.py's COMMANDS) and imported
only when chosen.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import COMMANDS
from fixtures.default_model import default_model_file
from fixtures.tiny_coder import trained_model_dir

REPO = Path(__file__).resolve().parents[2]
TEST_PARTS = ("ladder", "bench", "reference", "fixtures")
# `generate` without --model: fixtures.default_model and what it needs to build and find the cached file
DEFAULT_MODEL_LOOKUP = {"fixtures", "fixtures.default_model", "fixtures.tiny_coder", "fixtures.tiny_model"}
HEAVY = ("torch", "transformers", "pytest", "hypothesis")

RUN = """
import json, sys
from engine.cli import main
code = main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.write("\\nMODULES " + json.dumps([code, sorted(sys.modules)]) + "\\n")
"""


def modules_after(*argv: str) -> set[str]:
    """Run `nanoqwen ARGV` through engine.cli.main in a fresh interpreter; the modules it left loaded."""
    res = subprocess.run([sys.executable, "-c", RUN, *argv], cwd=REPO, capture_output=True, text=True, timeout=600)
    line = [s for s in res.stderr.splitlines() if s.startswith("MODULES ")]
    assert line, f"nanoqwen {' '.join(argv)} did not finish:\n{res.stderr[-2000:]}"
    code, modules = json.loads(line[-1].removeprefix("MODULES "))
    assert code == 0, f"nanoqwen {' '.join(argv)} exited {code}:\n{res.stderr[-2000:]}"
    return set(modules)


def of_parts(modules: set[str], parts) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in parts)


@pytest.fixture(scope="module")
def model_file() -> Path:
    return default_model_file()


def test_generate_on_the_default_model_loads_only_its_lookup():
    modules = modules_after("generate", "--prompt-ids", "1,2", "--new-tokens", "1")
    assert of_parts(modules, ("ladder", "bench", "reference")) == []
    assert set(of_parts(modules, ("fixtures",))) <= DEFAULT_MODEL_LOOKUP
    assert "fixtures.default_model" in modules  # the lookup itself ran
    assert of_parts(modules, HEAVY) == []


def test_generate_on_a_named_model_loads_no_test_part(model_file):
    modules = modules_after("generate", "--model", str(model_file), "--prompt-ids", "1,2", "--new-tokens", "1")
    assert of_parts(modules, TEST_PARTS + HEAVY) == []


def test_convert_loads_no_test_part(tmp_path):
    modules = modules_after("convert", str(trained_model_dir()), str(tmp_path / "out.nanoqwen"))
    assert (tmp_path / "out.nanoqwen").stat().st_size > 0
    assert of_parts(modules, TEST_PARTS + HEAVY) == []


def test_inspect_loads_no_test_part(model_file):
    modules = modules_after("inspect", str(model_file))
    assert of_parts(modules, TEST_PARTS + HEAVY) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_another_command_imports_its_own_module_only(command):
    code = ("import json, sys\nfrom engine.cli import build_parser\n"
            f"build_parser({command!r})\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ladder', 'bench'))))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = set(json.loads(res.stdout.strip().splitlines()[-1]))
    own = COMMANDS[command].partition(":")[0]
    others = {module.partition(":")[0] for name, module in COMMANDS.items() if name != command} - {own}
    assert own in loaded
    assert not loaded & others, f"choosing {command} imported {sorted(loaded & others)}"


def test_help_and_an_unknown_command_build_every_command():
    from engine.cli import build_parser

    for command in (None, "no-such-command"):
        choices = build_parser(command)._subparsers._group_actions[0].choices
        assert set(choices) == {"generate", "convert", "inspect"} | set(COMMANDS)
