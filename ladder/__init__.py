"""The correctness ladder: the rungs that prove the engine right, and what is built on them.

The tree answers three questions (docs/ARCHITECTURE.md draws it):

- how does a rung decide? judges/: the one tolerance table, the comparison against a noise floor, the
  graph rung's token judge and its bounds, the references' results kept per machine;
- what is the pytest plugin? plugin/: options, markers, backend and format selection, fixtures, the
  run's summary, the worker groups and a dead or stalled worker's line;
- what runs `nanoqwen ladder`? run/: the rungs in order, workers sized to the model, the report,
  shards and `ladder merge`, what a run took of the machine;

and beside them checks/ (the reusable op and block checks, the planted faults), changes/ (which cases a
change reaches: the launch map, the kernel sources, git), the rungs themselves (unit/, layer/, graph/:
tests only, markers `unit`, `layer`, `graph`), tools/ (what drives the ladder: `nanoqwen bisect`,
`descend`, `mutate`, `quant-report`) and selftest/ (the tests of the ladder's own commands and judges,
marker `selftest`, with their helpers; `python -m pytest` and .ci/run run them, `nanoqwen ladder` does not).

ladder/selftest/arrows.py holds the import rules a self-test enforces: the core never imports a tool or a
self-test, a tool never a self-test, nothing imports bench/.
"""
