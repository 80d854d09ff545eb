"""Self-test: the ladder's report: merging rung results, coverage findings, and the baseline diff, keyed by
(rung, backend, format, op); a red report's failures with their messages, its next commands, its chart's
absence without matplotlib, and the environment it records. The same on a real red run, end to end:
ladder/selftest/test_red_report.py."""

from __future__ import annotations

from pathlib import Path

from kernels import OPS
from ladder.run import report as ladder_report


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

    from ladder.plugin import summary

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


# ---- the format in every key, and a red report that triages itself ------------------------------


def format_result(multiples: dict[tuple[str, str], tuple[float, bool]], failures=()) -> dict:
    """A unit rung file whose op records carry their format: {(format, op): (multiple, passed)}."""
    return {"rungs": {"unit": {"passed": 1, "failed": len(failures)}}, "skips": {},
            "ops": [{"rung": "unit", "backend": "numpy", "format": fmt, "op": op, "multiple": m, "passed": ok,
                     "max_abs": m, "bound": 1.0, "floor": 1.0, "case": "c"} for (fmt, op), (m, ok) in multiples.items()],
            "calls": [{"rung": "unit", "backend": "numpy", "op": op, "n": 1} for op in OPS],
            "cases": [{"backend": "numpy", "format": fmt, "passed": 1} for fmt, _ in multiples],
            "failures": list(failures), "exit": 1 if failures else 0, "seconds": 1.0}


def test_one_formats_growth_is_flagged_for_that_format_not_hidden_behind_anothers_larger_error():
    """A format whose qkv_proj grows past the limit is a regression even while another format's qkv_proj
    stays larger than it; the formats that did not grow are not flagged."""
    g = ladder_report.BASELINE_GROWTH
    base = ladder_report.merge({"unit": format_result({("int4_sym_g128", "qkv_proj"): (1.0, True),
                                                       ("int8_sym_channel", "qkv_proj"): (g * 2, True)})}, {"model": "m"})
    now = ladder_report.merge({"unit": format_result({("int4_sym_g128", "qkv_proj"): (g * 1.01, True),
                                                      ("int8_sym_channel", "qkv_proj"): (g * 2, True)})}, {"model": "m"})
    found = ladder_report.compare_baseline(now, base)
    assert len(found) == 1 and found[0].startswith("unit/numpy/int4_sym_g128/qkv_proj: worst error grew"), found


def test_a_baseline_written_before_formats_were_recorded_still_loads_and_matches_format_none(tmp_path):
    old = report({"rmsnorm": (1.0, True)})  # its op records have no "format"
    assert all("format" not in o for o in old["ops"])
    ladder_report.write(tmp_path / "old", {**old, "meta": {**old["meta"], "result": "passed"}})
    base = ladder_report.load(tmp_path / "old")
    g = ladder_report.BASELINE_GROWTH
    now = ladder_report.merge({"unit": format_result({(None, "rmsnorm"): (g * 2, True),
                                                      ("int4_sym_g128", "qkv_proj"): (g * 2, True)})}, {"model": "m"})
    assert ladder_report.compare_baseline(now, base) == [
        f"unit/numpy/-/rmsnorm: worst error grew from 1x to {g * 2:.3g}x its noise floor (> {g}x growth)"]


def test_merging_shards_keeps_the_format_and_reads_failures_written_as_bare_node_ids():
    from ladder.run.merge import merge_rung_data

    record = {"test": "t::new[numpy-int8_sym_channel]", "rung": "unit", "backend": "numpy", "format": "int8_sym_channel",
              "when": "call", "message": ["qkv_proj: too far"], "rerun": "python -m pytest 't::new'"}
    a = format_result({("int4_sym_g128", "qkv_proj"): (1.0, True)}, failures=["t::old"])
    b = format_result({("int8_sym_channel", "qkv_proj"): (9.0, False)}, failures=[record])
    m = merge_rung_data([a, b])
    assert {(o["format"], o["op"]): o["multiple"] for o in m["ops"]} == {("int4_sym_g128", "qkv_proj"): 1.0,
                                                                        ("int8_sym_channel", "qkv_proj"): 9.0}
    assert m["failures"] == [record, "t::old"]  # in node-id order, records and bare ids alike
    rep = ladder_report.merge({"unit": {**m, "exit": 1, "seconds": 1.0}}, {"model": "m"})
    md = ladder_report.markdown({**rep, "meta": {**rep["meta"], "result": "FAILED"}})
    assert "`t::old`" in md and "rerun: python -m pytest 't::new'" in md and "format int8_sym_channel" in md


def test_a_failed_reports_message_is_kept_short_with_its_rerun_command():
    from types import SimpleNamespace

    from ladder.plugin import summary

    crash = "\n".join([f"AssertionError: op[case] line {i}" for i in range(30)] + ["rerun: python -m pytest 'a.py::t[x]'",
                                                                                    "Falsifying example: t(x=1)"])
    failed = SimpleNamespace(nodeid="a.py::t[x]@fmt-numpy", when="call",
                             longrepr=SimpleNamespace(reprcrash=SimpleNamespace(message=crash)),
                             user_properties=[("nanoqwen_case", {"backend": "numpy", "format": "fmt"})])
    rec = summary.failure_record(failed, "unit")
    assert rec["test"] == "a.py::t[x]" and (rec["backend"], rec["format"]) == ("numpy", "fmt")
    assert rec["message"][0] == "op[case] line 0" and len(rec["message"]) == summary.MESSAGE_LINES
    assert rec["rerun"] == "python -m pytest 'a.py::t[x]'"
    bare = SimpleNamespace(nodeid="b.py::u", when="setup", longrepr="fixture 'x' not found", user_properties=[])
    assert summary.failure_record(bare, "unit")["rerun"] == "python -m pytest b.py::u"  # made from the node id


def test_a_red_report_prints_descend_for_the_first_failure_and_bisect_from_the_baselines_commit(tmp_path):
    base = ladder_report.merge({"unit": format_result({("int8_sym_channel", "qkv_proj"): (1.0, True)})}, {"model": "m"})
    base["meta"].update(result="passed", commit="0123abc")
    ladder_report.write(tmp_path / "last night", base)
    record = {"test": "t::x", "rung": "unit", "backend": "numpy", "format": "int8_sym_channel", "message": ["bad"],
              "rerun": "python -m pytest t::x"}
    rep, failed = ladder_report.conclude(
        {"unit": format_result({("int8_sym_channel", "qkv_proj"): (9.0, False)}, failures=[record])},
        {"model": "/models/my model.nanoqwen"}, tmp_path / "tonight", True, ladder_report.load(tmp_path / "last night"))
    folder = str((tmp_path / "last night").resolve())
    assert failed and rep["next"] == [
        "nanoqwen descend --backend numpy --quant int8_sym_channel --model '/models/my model.nanoqwen'",
        f"nanoqwen bisect --good 0123abc --baseline '{folder}'"]
    md = (tmp_path / "tonight" / "report.md").read_text()
    assert all(cmd in md for cmd in rep["next"]) and md.index("## Next commands") < md.index("## Rungs")


def test_without_matplotlib_the_report_says_there_is_no_chart(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    rep = ladder_report.merge({"unit": format_result({("int4_sym_g128", "qkv_proj"): (1.0, True)})}, {"model": "m"})
    ladder_report.write(tmp_path, {**rep, "meta": {**rep["meta"], "result": "passed"}})
    assert "no chart: matplotlib is not installed" in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "report.png").exists()


def test_the_environment_never_fails_and_names_the_versions():
    env = ladder_report.environment(Path(__file__).resolve().parents[2])
    assert set(env) == {"commit", "dirty", "environment"}
    assert env["environment"]["python"] and env["environment"]["numpy"]
    assert ladder_report.environment(Path("/"))["commit"] is None  # not a checkout
