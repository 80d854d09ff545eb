"""The self-tests: the tests of the ladder's own commands and judges, not of the engine.

The command line's edges, the converter, the `.nanoqwen` reader and its fuzzer, shards and merge,
`nanoqwen bisect`, `descend`, `mutate` and `quant-report`, the graph rung's judge and its bounds, the
planted faults, the report, the docs' links, the import arrows and the installed command's paths. Each
test here carries the `selftest` marker (ladder/plugin/__init__.py gives it by folder, as it gives the rungs
theirs). They run with `python -m pytest` (the whole suite) and `.ci/run`, or alone with
`python -m pytest -m selftest`; `nanoqwen ladder` runs the rungs (unit/, layer/, graph/) and not these.
"""
