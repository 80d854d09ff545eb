"""Self-test: the repository is self-contained. Every document a file points to is in the repository,
every relative link in the Markdown resolves, and nothing cites a design note outside it.

Users get the repository alone: a docstring that says "see X.md" must name a file they have.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("engine", "kernels", "ladder", "reference", "fixtures", "bench", "docs", ".ci", ".github")
           for p in sorted((REPO / d).rglob("*")) if p.is_file() and p.suffix in (".py", ".md", ".cu", ".cuh", ".yml", "")
           and "__pycache__" not in p.parts and "data" not in p.relative_to(REPO).parts[:2]]
SOURCES += [REPO / "README.md", REPO / "pyproject.toml", REPO / "tox.ini", REPO / "conftest.py"]
SOURCES.remove(Path(__file__).resolve())  # this file names what must not appear elsewhere
MD_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
DOC_MENTION = re.compile(r"\b((?:docs/)?[A-Z][A-Z_]+\.md)\b")


def _text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def test_sources_to_check_were_found():
    assert len(SOURCES) > 50 and (REPO / "docs" / "ARCHITECTURE.md") in SOURCES


@pytest.mark.parametrize("path", [p for p in SOURCES if p.suffix == ".md"], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_markdown_link_resolves(path):
    for target, _ in MD_LINK.findall(_text(path)):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).resolve().exists(), f"{path.relative_to(REPO)} links to {target}, which is missing"


def test_every_document_a_file_names_is_in_the_repository():
    docs = {p.name for p in (REPO / "docs").glob("*.md")} | {"README.md", "NOTES.md"}
    missing = []
    for path in SOURCES:
        for name in DOC_MENTION.findall(_text(path)):
            if Path(name).name not in docs:
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, "files name documents the repository does not have:\n" + "\n".join(missing)


def test_nothing_points_outside_the_repository():
    outside = [f"{p.relative_to(REPO)}" for p in SOURCES if "../shared" in _text(p) or "DESIGN.md" in _text(p)]
    assert not outside, f"these cite files outside the repository: {outside}"
