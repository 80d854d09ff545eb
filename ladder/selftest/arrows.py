"""The parts of the project and the arrows between them: the one table that docs/ARCHITECTURE.md
("The parts") draws and ladder/selftest/test_imports.py enforces on every import in the tree.

`ARROWS[part]` is the set of other top-level packages `part`'s modules may import. `NARROW_ARROWS` are
the few arrows allowed to one module only, from one module: (importing module, imported module) -> why.
`LEAVES` are the parts no other part imports at all: no arrow, wide or narrow, points into them.
Inside ladder/, `LADDER_LAYERS` keep the ladder itself apart from what is built on it: the tools that drive
it (ladder/tools/) and the self-tests (ladder/selftest/); an arrow points into a layer only from above.
Inside the ladder itself, `CORE_GROUPS` keep the judges, the checks and the change reading below the
plugin and the runner.
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
# piece of it that another part needs moves out of it: ladder/tools/gemv_timing.py, quant-report's GEMV column).
LEAVES = frozenset({"bench"})

# ladder/'s own layers, highest first; the rest of ladder/ (the plugin, tolerances, comparisons, faults,
# report, the rungs) is the ladder itself, below them all. A module of ladder/ imports its own layer or
# one below: the ladder never imports a tool or a self-test, a tool never a self-test.
LADDER_LAYERS = ("ladder.selftest", "ladder.tools")


# Inside the ladder's core, one direction: what each group may import of the other core groups (run/ and
# the rungs, the top of the core, may import any). judges/ decides with nothing but its own table;
# checks/ run an op or a block and judge it; changes/ reads sources and git; plugin/ is what pytest loads,
# and run/ (the command that starts pytest with it, and reads what it wrote) sits above it.
CORE_GROUPS: dict[str, frozenset[str]] = {
    "ladder.judges": frozenset(),
    "ladder.changes": frozenset(),
    "ladder.checks": frozenset({"ladder.judges"}),
    "ladder.plugin": frozenset({"ladder.judges", "ladder.checks", "ladder.changes"}),
}


def core_group(module: str) -> str | None:
    """The core group of ladder/ that `module` belongs to ("ladder.judges", ...), or None."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] == "ladder" else None


def ladder_layer(module: str) -> int:
    """0 for the ladder itself, higher for each layer of `LADDER_LAYERS` above it."""
    for i, prefix in enumerate(LADDER_LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return len(LADDER_LAYERS) - i
    return 0


def allowed(importer: str, imported: str) -> bool:
    """Whether module `importer` (dotted name) may import module `imported`."""
    src, dst = importer.split(".")[0], imported.split(".")[0]
    if src == dst:
        if src != "ladder":
            return True
        if ladder_layer(importer) < ladder_layer(imported):
            return False
        group, target = core_group(importer), core_group(imported)
        if group in CORE_GROUPS and target != group and target is not None and target != "ladder":
            return target in CORE_GROUPS[group]
        return True
    if dst in LEAVES:
        return False
    return dst in ARROWS.get(src, ()) or (importer, imported) in NARROW_ARROWS
