"""Self-test: a real red night, end to end, in one format only. `nanoqwen ladder` runs the unit rung's
qkv_proj check in every format with `--plant-fault nibble_swap:int8_sym_channel` (the fault reads only
int8_sym_channel weights), and the report folder must triage it alone: report.md names the format and the
op, carries the failing case's message and rerun line and the next command (`nanoqwen descend` on that
backend and format), report.json holds the other formats' qkv_proj cases as passed, and report.png is a
PNG where matplotlib is installed. One nested ladder (a few seconds) serves every assertion.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.formats import FORMATS
from ladder.checks.faults import parse
from ladder.run.nested import REPO, child_env, skip_inside_nested_run

pytestmark = skip_inside_nested_run  # the child selects by keyword, and must not start this module again

FAULT, FORMAT, OP, BACKEND = "nibble_swap", "int8_sym_channel", "qkv_proj", "numpy"
CASE = f"ladder/unit/test_ops.py::test_qkv_proj_with_bias[{BACKEND}-{FORMAT}]"


def nanoqwen_ladder(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ladder", "ladder", *args], cwd=cwd, capture_output=True, text=True,
                          env=child_env(BACKEND, str(REPO)), timeout=600)


@pytest.fixture(scope="module")
def red_night(tmp_path_factory):
    """(the command's result, report.md, report.json) of the unit rung's qkv_proj cases, every format, the
    fault planted in one."""
    cwd = tmp_path_factory.mktemp("red-night")
    r = nanoqwen_ladder(cwd, "--quant", "all", "--plant-fault", f"{FAULT}:{FORMAT}", "--rungs", "unit",
                        "--backend", BACKEND, "-n", "0", "--report", "rep", "--", "-k", "qkv_proj_with_bias")
    rep = cwd / "rep"
    md = (rep / "report.md").read_text() if (rep / "report.md").exists() else ""
    data = json.loads((rep / "report.json").read_text()) if (rep / "report.json").exists() else {}
    return r, md, data, rep


def test_a_fault_in_one_format_turns_the_run_red(red_night):
    r, _, data, _ = red_night
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    assert data["meta"]["result"] == "FAILED" and data["meta"]["backends_ran"] == [BACKEND]


def test_the_report_names_the_format_the_op_the_message_and_the_rerun_line(red_night):
    _, md, _, _ = red_night
    failures = md[md.index("## Failures"):md.index("## Rungs")]
    assert f"`{CASE}`: unit rung, backend {BACKEND}, format {FORMAT}" in failures
    assert f"{OP}[" in failures and "exceeds the bound" in failures and "noise floor" in failures
    assert f"rerun: python -m pytest '{CASE}'" in failures
    assert f"| unit | {BACKEND} | {FORMAT} | {OP} |" in md and "FAILED" in md


def test_the_report_and_the_command_print_descend_for_that_backend_and_format(red_night):
    r, md, data, _ = red_night
    descend = f"nanoqwen descend --backend {BACKEND} --quant {FORMAT}"
    assert data["next"] == [descend]  # no --baseline: no bisect
    assert descend in md and descend in r.stdout


def test_the_other_formats_cases_of_the_same_op_passed(red_night):
    _, _, data, _ = red_night
    verdicts = {o["format"]: o["passed"] for o in data["ops"] if o["op"] == OP}
    assert verdicts == {f: f != FORMAT for f in FORMATS}, verdicts
    assert [(f["backend"], f["format"]) for f in data["failures"]] == [(BACKEND, FORMAT)]
    assert data["rungs"]["unit"]["passed"] == len(FORMATS) - 1


def test_the_chart_is_a_png_beside_report_md(red_night):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the report says so instead of drawing report.png")
    _, md, _, rep = red_night
    assert (rep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![" in md and "(report.png)" in md


def test_a_format_qualifier_limits_only_the_faults_that_read_weights():
    assert parse(f"{FAULT}@1:{FORMAT}")[1:] == (1, FORMAT)
    with pytest.raises(ValueError, match="unknown format 'int3'") as unknown:
        parse(f"{FAULT}:int3")
    with pytest.raises(ValueError, match="takes no :FORMAT") as not_per_format:
        parse(f"dropped_qkv_bias:{FORMAT}")
    assert all("\n" not in str(e.value) for e in (unknown, not_per_format))


def test_a_bad_format_qualifier_stops_the_command_in_one_line(tmp_path):
    r = nanoqwen_ladder(tmp_path, "--plant-fault", f"{FAULT}:int3", "--rungs", "unit", "--backend", BACKEND,
                        "--report", "rep")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "int3" in lines[0], r.stderr
    assert not (tmp_path / "rep").exists()
