"""The parts of the project and the arrows between them: the one table that docs/ARCHITECTURE.md
("The parts") draws and ladder/unit/test_imports.py enforces on every import in the tree.

`ARROWS[part]` is the set of other top-level packages `part`'s modules may import. `NARROW_ARROWS` are
the few arrows allowed to one module only, from one module: (importing module, imported module) -> why.
`LEAVES` are the parts no other part imports at all: no arrow, wide or narrow, points into them.
"""

from __future__ import annotations

ARROWS: dict[str, frozenset[str]] = {
    # the engine runs on its kernels; it owns the product command line (engine/cli.py)
    "engine": frozenset({"kernels"}),
    # a kernel implements its format's layout itself: it never reads engine/
    "kernels": frozenset(),
    # the independent reading: plain float weights in, never engine/ or kernels/
    "reference": frozenset(),
    # models, prompts and golden files are built with the engine's writer and the reference
    "fixtures": frozenset({"engine", "kernels", "reference"}),
    # the rungs compare the engine and its kernels with the reference, on fixtures
    "ladder": frozenset({"engine", "kernels", "reference", "fixtures"}),
    # a leaf: measures everything, imported by nothing (the command line finds `bench` by name)
    "bench": frozenset({"engine", "kernels", "reference", "fixtures", "ladder"}),
}

NARROW_ARROWS: dict[tuple[str, str], str] = {
    ("engine.resolve", "fixtures.default_model"):
        "`nanoqwen generate` without --model runs the embedded default model, which fixtures/ builds",
}

# Leaves: parts nothing else imports, not even through a narrow arrow (bench/ measures everything; a
# piece of it that another part needs moves out of it: ladder/gemv_timing.py, quant-report's GEMV column).
LEAVES = frozenset({"bench"})


def allowed(importer: str, imported: str) -> bool:
    """Whether module `importer` (dotted name) may import module `imported`."""
    src, dst = importer.split(".")[0], imported.split(".")[0]
    if src == dst:
        return True
    if dst in LEAVES:
        return False
    return dst in ARROWS.get(src, ()) or (importer, imported) in NARROW_ARROWS
