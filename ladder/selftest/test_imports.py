"""Self-test: the arrows between the parts point one way. A scan of every import in every top-level
package (bench/ included) against the one table of ladder/selftest/arrows.py, which docs/ARCHITECTURE.md draws,
and, inside ladder/, its layers: the ladder itself, the tools that drive it, the self-tests. And no module
imports a test module (`test_*.py`): pytest collects those; what another module needs from one moves
into a library (the op checks: ladder/checks/).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ladder.selftest.arrows import ARROWS, LEAVES, NARROW_ARROWS, allowed

REPO = Path(__file__).resolve().parents[2]


def top_level_packages() -> set[str]:
    return {p.parent.name for p in REPO.glob("*/__init__.py")}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for each absolute import of a project package in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return sorted((line, m) for line, m in found if m.split(".")[0] in ARROWS)


def test_the_table_names_every_top_level_package():
    assert set(ARROWS) == top_level_packages()
    for targets in ARROWS.values():
        assert targets <= set(ARROWS)


def test_the_architecture_page_draws_the_same_table():
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| `(\w+)` +\| (.*?) *\|$", doc, flags=re.M)
    assert {part: frozenset(re.findall(r"`(\w+)`", targets)) for part, targets in rows} == ARROWS


def test_nothing_imports_bench():
    # bench/ consumes the other parts and provides nothing to them: no arrow, wide or narrow, points into it
    assert LEAVES == {"bench"}
    assert not any("bench" in targets for part, targets in ARROWS.items() if part != "bench")
    assert not [arrow for arrow in NARROW_ARROWS if arrow[1].split(".")[0] in LEAVES]
    for part in sorted(set(ARROWS) - LEAVES):
        assert not allowed(f"{part}.anything", "bench"), part
        assert not allowed(f"{part}.anything", "bench.measure"), part


def test_a_narrow_arrow_into_bench_is_still_refused(monkeypatch):
    # how ladder.tools.quant_report once reached bench.format_gemv: the leaf rule wins over the table
    monkeypatch.setitem(NARROW_ARROWS, ("ladder.tools.quant_report", "bench.format_gemv"), "a hole in the table")
    assert not allowed("ladder.tools.quant_report", "bench.format_gemv")
    monkeypatch.setitem(ARROWS, "ladder", ARROWS["ladder"] | {"bench"})
    assert not allowed("ladder.tools.quant_report", "bench.format_gemv")
    assert allowed("bench.format_gemv", "ladder.tools.gemv_timing") and allowed("bench.cli", "bench.measure")


@pytest.mark.parametrize("package", sorted(ARROWS))
def test_imports_point_the_right_way(package):
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        importer = module_name(path)
        for line, imported in imports_of(path):
            if not allowed(importer, imported):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert not bad, f"{package}/ may import only {sorted(ARROWS[package])} (ladder/selftest/arrows.py):\n" + "\n".join(bad)


def test_every_narrow_arrow_is_still_there():
    # a one-module exception nobody uses any more is a stale hole in the table
    for importer, imported in NARROW_ARROWS:
        path = REPO / (importer.replace(".", "/") + ".py")
        assert imported in [m for _, m in imports_of(path)], f"{importer} no longer imports {imported}"


def test_the_scan_sees_a_wrong_arrow(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import numpy\nfrom engine.formats import get_format\nif True:\n    import kernels.numpy\n"
                 "from . import sibling\n")
    assert imports_of(f) == [(2, "engine.formats"), (4, "kernels.numpy")]
    assert not allowed("kernels.numpy", "engine.formats")
    assert not allowed("engine.model", "fixtures.default_model")
    assert not allowed("engine.resolve", "fixtures.tiny_model")
    assert allowed("engine.resolve", "fixtures.default_model")
    assert not allowed("ladder.run.runner", "bench.cli")
    assert not allowed("ladder.tools.quant_report", "bench.format_gemv")
    assert not allowed("fixtures.tiny_model", "bench.measure")
    # inside ladder/: the ladder itself never imports a tool or a self-test, a tool never a self-test
    assert not allowed("ladder.run.runner", "ladder.tools.mutate") and not allowed("ladder.plugin", "ladder.selftest")
    assert not allowed("ladder.unit.test_ops", "ladder.tools.descend")
    assert not allowed("ladder.tools.bisect", "ladder.selftest.test_bisect")
    assert allowed("ladder.tools.mutate", "ladder.run.nested") and allowed("ladder.tools.mutate", "ladder.tools.mutants")
    assert allowed("ladder.selftest.test_mutants", "ladder.tools.mutate") and allowed("bench.measure", "ladder.tools.gemv_timing")
    # inside the core: the judges, checks and change reading never reach up into the plugin or the runner
    assert not allowed("ladder.judges.compare", "ladder.plugin.summary")
    assert not allowed("ladder.checks.ops", "ladder.run.runner") and not allowed("ladder.changes.git", "ladder.judges.tokens")
    assert allowed("ladder.checks.ops", "ladder.judges.compare") and allowed("ladder.plugin.summary", "ladder.judges.compare")
    assert allowed("ladder.run.runner", "ladder.plugin.required") and allowed("ladder.judges.tokens", "ladder.judges.tolerances")
    assert not allowed("ladder.plugin.summary", "ladder.run.report") and allowed("ladder.run.report", "ladder.plugin.summary")


def _is_test_module(dotted: str) -> bool:
    return dotted.split(".")[-1].startswith("test_")


def imports_of_test_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each import of a test module in `path`: `import a.test_x`, `from a.test_x import
    y`, `from a import test_x` (relative ones too), and importlib's or `__import__`'s with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if any(map(_is_test_module, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if any(_is_test_module(part) for part in (node.module or "").split(".")):
                found.append((node.lineno, base))
            sep = "" if base.endswith(".") else "."
            found += [(node.lineno, f"{base}{sep}{a.name}") for a in node.names if _is_test_module(a.name)]
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and any(map(_is_test_module, node.args[0].value.split(".")))):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def test_no_module_imports_a_test_module():
    # a test module is pytest's to collect: a check, a helper or a case another module needs lives in a library
    paths = [p for pkg in sorted(ARROWS) for p in sorted((REPO / pkg).rglob("*.py"))] + [REPO / "conftest.py"]
    found = [(str(path.relative_to(REPO)), line, name) for path in paths for line, name in imports_of_test_modules(path)]
    bad = [f"{rel}:{line} imports {name}" for rel, line, name in found]
    assert not bad, ("move what these need out of the test module (ladder/checks/ holds the op and block "
                     "checks):\n" + "\n".join(bad))


def test_the_scan_sees_a_test_module_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from ladder.unit import test_ops\nimport ladder.unit.test_ops as t\n"
                 "from ladder.unit.test_ops import check_x\nfrom .test_near import y\nfrom . import test_rel\n"
                 "import importlib\nimportlib.import_module('ladder.selftest.test_bisect')\n"
                 "from ladder.checks import ops\nfrom fixtures.tests_data import x\nimport pytest\n")
    assert imports_of_test_modules(f) == [(1, "ladder.unit.test_ops"), (2, "ladder.unit.test_ops"),
                                          (3, "ladder.unit.test_ops"), (4, ".test_near"), (5, ".test_rel"),
                                          (7, "ladder.selftest.test_bisect")]


def engine_import_graph() -> dict[str, set[str]]:
    """engine's modules -> the engine modules each imports (anywhere in the file: a function-level
    import closes a circle as surely as a top-level one)."""
    graph = {}
    for path in sorted((REPO / "engine").rglob("*.py")):
        graph[module_name(path)] = {m for _, m in imports_of(path) if m.split(".")[0] == "engine"}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of `graph`, each once (from its smallest module)."""
    found, seen = [], set()

    def walk(start, node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [start])
            elif nxt not in path and nxt in graph and nxt > start:
                walk(start, nxt, path + [nxt])

    for m in sorted(graph):
        walk(m, m, [m])
    return found


def test_no_import_circle_among_the_engines_modules():
    """The engine's modules import one way (the CLI's progress bar once came back to it through resolve:
    engine/progress.py is the one progress line now)."""
    assert circles(engine_import_graph()) == []


def test_the_circle_scan_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
