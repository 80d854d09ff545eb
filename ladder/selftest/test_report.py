"""Self-test: the ladder's report: merging rung results, coverage findings, and the baseline diff."""

from __future__ import annotations

from kernels import OPS
from ladder import report as ladder_report


def rung_result(rung: str, ops: list[tuple[str, float, bool]], calls: dict[str, int]) -> dict:
    return {"rungs": {rung: {"passed": 3, "failed": 0, "skipped": 1}}, "skips": {rung: {"no GPU": 1}},
            "ops": [{"rung": rung, "backend": "numpy", "op": op, "multiple": m, "passed": ok, "max_abs": 0.0,
                     "case": "c"} for op, m, ok in ops],
            "calls": [{"rung": rung, "backend": "numpy", "op": op, "n": n} for op, n in calls.items()],
            "failures": [], "exit": 0, "seconds": 1.0}


def report(multiples: dict[str, tuple[float, bool]]) -> dict:
    ops = [(op, m, ok) for op, (m, ok) in multiples.items()]
    return ladder_report.merge({"unit": rung_result("unit", ops, {op: 1 for op in OPS[:-1]})}, {"model": "m"})


def test_baseline_flags_growth_past_the_limit_and_new_failures():
    base = report({"rmsnorm": (1.0, True), "qkv_proj": (1.0, True), "argmax": (0.0, True), "lm_head": (1.0, True)})
    now = report({"rmsnorm": (ladder_report.BASELINE_GROWTH * 1.01, True), "qkv_proj": (ladder_report.BASELINE_GROWTH * 0.99, True),
                  "argmax": (2.0, True), "lm_head": (9.0, False)})
    found = ladder_report.compare_baseline(now, base)
    assert any("rmsnorm" in f and "grew" in f for f in found)
    assert not any("qkv_proj" in f for f in found), "growth under the limit is not a regression"
    assert any("argmax" in f and "was exact" in f for f in found)
    assert any("lm_head" in f and "newly fails" in f for f in found)


def test_an_op_no_rung_calls_is_a_coverage_finding():
    rep = report({"rmsnorm": (1.0, True)})
    assert rep["coverage"]["numpy"][OPS[-1]] == [] and rep["coverage"]["numpy"][OPS[0]] == ["unit"]
    assert "**none: a finding**" in ladder_report.markdown({**rep, "meta": {**rep["meta"], "result": "FAILED"}})


def test_report_round_trips_through_its_folder(tmp_path):
    rep = report({"rmsnorm": (1.25, True)})
    rep["meta"]["result"] = "passed"
    ladder_report.write(tmp_path, rep)
    assert ladder_report.load(tmp_path) == rep
    md = (tmp_path / "report.md").read_text()
    assert "| unit | 0 | 3 | 0 | 1 |" in md and "1.25x" in md and "no GPU" in md


def test_the_slowest_tests_of_every_rung_are_ranked_in_the_report():
    rung_results = {
        "unit": {"rungs": {"unit": {"passed": 2}}, "exit": 0, "seconds": 4.0, "slowest": [{"seconds": 0.5, "test": "u::a"}, {"seconds": 3.0, "test": "u::b"}]},
        "graph": {"rungs": {"graph": {"passed": 1}}, "exit": 0, "seconds": 9.5, "slowest": [{"seconds": 9.0, "test": "g::c [setup]"}]},
    }
    rep = ladder_report.merge(rung_results, {"model": "default"})
    assert [(d["rung"], d["test"]) for d in rep["slowest"]] == [("graph", "g::c [setup]"), ("unit", "u::b"), ("unit", "u::a")]
    md = ladder_report.markdown({**rep, "meta": {**rep["meta"], "result": "passed"}})
    assert "## Slowest tests" in md and "| graph | 9.0 | `g::c [setup]` |" in md


def test_a_long_rung_prints_progress_with_the_rate_and_the_slowest_test(monkeypatch):
    from types import SimpleNamespace

    from ladder import summary

    s = summary.RunSummary()
    s.total = 10
    assert s.progress() is None  # nothing finished yet
    for when, dur in (("setup", 4.0), ("call", 0.5), ("teardown", 0.0)):
        s.add(SimpleNamespace(when=when, outcome="passed", failed=False, skipped=False, duration=dur,
                              nodeid="ladder/graph/t.py::x", user_properties=[]), "graph")
    monkeypatch.setattr(summary, "PROGRESS_SECONDS", 0.0)
    line = s.progress()
    assert line.startswith("[nanoqwen] 1 of 10 tests in ") and "slowest so far 4.0 s: ladder/graph/t.py::x [setup]" in line
    assert s.as_json()["slowest"][0] == {"seconds": 4.0, "test": "ladder/graph/t.py::x [setup]"}
