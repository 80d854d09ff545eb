"""The correctness ladder: the rungs that prove the engine right, and what is built on them.

- the ladder itself (this folder's modules): the pytest plugin (plugin.py, summary.py, required.py, groups.py),
  tolerances, comparisons, planted faults, the graph rung's judge (tokens.py), the report, shards and
  `nanoqwen ladder` (runner.py), and the rungs: unit/, layer/, graph/ (markers `unit`, `layer`, `graph`);
- tools/: the tools that drive the ladder: `nanoqwen bisect`, `descend`, `mutate`, `quant-report`;
- selftest/: the tests of the ladder's own commands and judges, not of the engine (marker `selftest`:
  `python -m pytest` and .ci/run run them, `nanoqwen ladder` does not).

ladder/arrows.py keeps the layers apart: the ladder never imports a tool or a self-test.
"""
