"""Unit rung: the arrows of docs/ARCHITECTURE.md point one way. A scan of every import in the tree.

    ladder -> engine, kernels, reference, fixtures;  engine -> kernels;  fixtures -> engine, reference
    reference imports neither engine nor kernels; kernels never imports engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kernels", "ladder", "reference", "fixtures")
ALLOWED = {
    "engine": {"engine", "kernels"},
    "kernels": {"kernels"},
    "reference": {"reference"},
    "fixtures": {"fixtures", "engine", "reference", "kernels"},
    "ladder": set(PACKAGES),
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_the_right_way(package):
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for target in imports_of(path) - ALLOWED[package]:
            bad.append(f"{path.relative_to(REPO)} imports {target}")
    assert not bad, f"{package}/ may import only {sorted(ALLOWED[package])}:\n" + "\n".join(bad)


def test_the_scan_sees_a_wrong_arrow(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import numpy\nfrom engine.formats import get_format\nif True:\n    import kernels.numpy\n")
    assert imports_of(f) == {"engine", "kernels"}
