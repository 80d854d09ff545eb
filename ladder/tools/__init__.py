"""The tools that drive the ladder: bisect, descend, mutate, quant-report.

`nanoqwen bisect` (bisect.py), `nanoqwen descend` (descend.py), `nanoqwen mutate` (mutate.py, its
mutants from mutants.py, its warm workers from forkserver.py, its report from mutate_report.py, and the
reviewed equivalent_mutants.json) and `nanoqwen quant-report`
(quant_report.py, its GEMV column from gemv_timing.py, which bench/ imports too). They use the ladder
(ladder/: the plugin, tolerances, comparisons, faults, report); the ladder never imports them.
"""
