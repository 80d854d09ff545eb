"""Self-tests of the command-line vocabulary (docs/LADDER.md, "Command-line vocabulary"): one spelling per
idea across the commands, old spellings as hidden aliases with a notice, every default shown, and the
flags and `NANOQWEN_*` variables the documentation names all exist in the code."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from engine.cli import RENAMED, build_parser
from engine.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Flags of other tools that the documentation quotes: pytest and its plugins, pip, git, python, CUDA's.
OTHERS = {"--dist", "--collect-only", "--junitxml", "--hypothesis-profile", "--index-url", "--extra-index-url",
          "--force-reinstall", "--no-deps", "--upgrade", "--user", "--editable", "--device", "--tool", "--tools",
          "--leak-check", "--maxfail", "--lf", "--durations", "--co", "--tb", "--no-header", "--strict-markers",
          "--rootdir", "--confcutdir", "--help", "--version", "--ff", "--sw", "--basetemp", "--max-worker-restart",
          "--reruns", "--pdb", "--trace", "--benchmark-disable", "--cov", "--first-parent", "--porcelain",
          "--show-toplevel", "--oneline", "--reverse", "--no-verify", "--no-cache-dir", "--pre", "--target",
          "--print-gpu-trace", "--set", "--section", "--kernel-name", "--launch-count", "--racecheck-report",
          "--check-api-memory-access", "--save", "--fix",
          "--no-such-flag"}  # the last: the documentation's example of a usage error


def _parsers(parser: argparse.ArgumentParser, seen=None):
    seen = seen if seen is not None else set()
    if id(parser) in seen:
        return
    seen.add(id(parser))
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub, seen)


def _visible_flags(parser) -> set[str]:
    return {f for a in parser._actions if a.help != argparse.SUPPRESS for f in a.option_strings}


def _flags_in_code() -> set[str]:
    """Every option string a parser or the pytest plugin in the repository defines (read from the sources:
    add_argument / addoption / renamed calls), plus the commands' parsers as built."""
    found = set()
    for path in REPO.rglob("*.py"):
        if any(part in (".venv", "build", ".tox") or part.startswith(".") for part in path.relative_to(REPO).parts):
            continue
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "add_argument", "addoption", "renamed"):
                found |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                          and a.value.startswith("-")}
    for p in _parsers(build_parser()):
        found |= {f for a in p._actions for f in a.option_strings}
    return found


def test_one_spelling_per_idea_across_every_command():
    """No command shows an old spelling; each old spelling names the one that replaced it."""
    parsers = list(_parsers(build_parser()))  # building them registers the old spellings
    assert RENAMED == {"--max-new-tokens": "--new-tokens", "-j": "--workers", "--jobs": "--workers",
                       "--out": "--report", "--formats": "--quant"}
    for p in parsers:
        shown = _visible_flags(p)
        assert not shown & set(RENAMED), f"{p.prog} shows an old spelling: {sorted(shown & set(RENAMED))}"


@pytest.mark.parametrize("argv, old, new", [
    (["generate", "--prompt-ids", "1,2", "--max-new-tokens", "1"], "--max-new-tokens", "--new-tokens"),
])
def test_an_old_spelling_still_works_and_says_what_it_is_now(capsys, argv, old, new):
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert f"nanoqwen: note: {old} is now {new}" in err


def test_every_option_shows_its_default():
    for p in _parsers(build_parser()):
        for a in p._actions:
            if (a.option_strings and a.help != argparse.SUPPRESS and a.default not in (None, False, "", argparse.SUPPRESS)
                    and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))):
                assert "default" in (a.help or ""), f"{p.prog} {a.option_strings[0]}: its help does not show its default"


def test_version_and_ladder_merge_are_commands(capsys):
    assert cli_main(["--version"]) == 0
    assert re.fullmatch(r"nanoqwen \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
    assert cli_main(["ladder", "merge", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: nanoqwen ladder merge") and "REPORT" in out and "--shard" not in out.split("options")[-1]
    assert cli_main(["--help"]) == 0
    assert "ladder merge" in capsys.readouterr().out
    assert cli_main(["ladder", "merge", "r1", "--model", "m"]) == 2  # a run's option is not a merge's
    assert "unrecognized arguments: --model m" in capsys.readouterr().err


def test_every_flag_and_variable_the_documentation_names_exists():
    flags_in_code = _flags_in_code()
    code = "\n".join(p.read_text() for p in REPO.rglob("*.py") if ".venv" not in p.parts) + "\n".join(
        p.read_text() for p in (REPO / ".ci").iterdir() if p.is_file())
    missing_flags, missing_vars = set(), set()
    for doc in DOCS:
        text = doc.read_text()
        for flag in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", text)):
            if flag not in flags_in_code and flag not in OTHERS:
                missing_flags.add(f"{doc.name}: {flag}")
        for var in set(re.findall(r"\bNANOQWEN_[A-Z_]*[A-Z]\b", text)):
            if var not in code:
                missing_vars.add(f"{doc.name}: {var}")
    assert not missing_flags, f"flags the documentation names that no parser defines: {sorted(missing_flags)}"
    assert not missing_vars, f"variables the documentation names that the code never reads: {sorted(missing_vars)}"
