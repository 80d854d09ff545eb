"""Graph rung: the end-of-run totals (exact tokens, near-ties, smallest margin, max logit difference).

Each graph test attaches its ladder/tokens.py result as the `nanoqwen_graph` user property; the totals
are computed from the test reports, so they add up across pytest-xdist workers.
"""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter):
    from ladder.tokens import summarize

    records, flat = [], []
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) != "call":
                continue
            for key, value in getattr(rep, "user_properties", ()):
                if key == "nanoqwen_graph":
                    records.append(value)
                elif key == "nanoqwen_graph_flatness":
                    flat.append(value)
    if not records and not flat:
        return
    terminalreporter.section("nanoqwen graph rung")
    for s in summarize(records):
        terminalreporter.write_line(s.describe())
        near = [d for r in records if r["backend"] == s.backend for d in r["near_ties"]]
        for d in near[:10]:
            terminalreporter.write_line(f"  near-tie: prompt {d['prompt_id']!r} position {d['position']}: "
                                        f"reference {d['ref_token']}, engine {d['engine_token']}, "
                                        f"margin {d['margin']:.4g}")
    for f in flat:
        terminalreporter.write_line(f"reference: {f['flat']} of {f['positions']} positions "
                                    f"({100 * f['fraction']:.2f}%) under the near-tie epsilon; smallest "
                                    f"top-1/top-2 margin {f['min_margin']:.4g}")
