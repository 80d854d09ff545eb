"""Self-test: `nanoqwen ladder --shard I/N` and `nanoqwen ladder merge` (ladder/plugin/sharding.py, ladder/run/merge.py).

The end-to-end test runs the NumPy ladder (a small selection of every rung, so CI pays about two
minutes) once whole and once as three shards, merges the shards, and requires the merged report to say
what the single run says: per-rung counts and skip reasons, each op's worst error, the coverage table,
the graph rung's totals and bounds, and one JUnit file per rung with every test case. The rest checks
the split itself (stable, a partition) and that a bad --shard or a bad set of report folders is one
line and exit 2, on hand-made report folders.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ladder.run.nested import child_env, skip_inside_nested_run
from ladder.plugin.sharding import ShardError, parse_shard, shard_of
from ladder.run.merge import merge_rung_data

REPO = Path(__file__).resolve().parents[2]
EXE = shutil.which("nanoqwen")
# unit + layer + graph cases, small: the layer rung's golden cases read no HF block (a layer process that
# imports transformers costs 5 s of a CI core, and the test starts four of them at once); not the unit
# rung's nvcc builds of the CUDA sources (rmsnorm.cu, embed_lmhead_argmax.cu) nor its case that computes a
# user's golden activations (4 s), which match the words too
SELECTION = ("(rmsnorm or embed or matches_golden or heldout-000 or heldout-001 or heldout-002 or heldout-003 or flat) "
             "and not compiles")


def nanoqwen(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """The installed command from `cwd` (else `python -m ladder` from the checkout, as on a GPU machine)."""
    cmd = [EXE, *args] if EXE else [sys.executable, "-m", "ladder", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=child_env(backend=None, pythonpath=None if EXE else str(REPO)))


# ---- the split ----------------------------------------------------------------------------------


def test_a_test_belongs_to_one_shard_and_always_the_same_one():
    ids = [f"ladder/graph/test_graph.py::test_greedy_tokens_match_the_hf_simulation[heldout-{i:03d}-numpy-int4_sym_g128]"
           for i in range(100)]
    for n in (1, 2, 3, 8):
        shards = [shard_of(i, n) for i in ids]
        assert all(1 <= s <= n for s in shards)
        assert shards == [shard_of(i, n) for i in ids]  # a pure function of the id
        assert len(set(shards)) == n  # 100 ids reach every shard of up to 8
    # fixed across machines and Python versions: crc32 of the id, not hash()
    assert shard_of("ladder/unit/test_ops.py::test_embed_copies_rows_exactly", 4) == \
        __import__("zlib").crc32(b"ladder/unit/test_ops.py::test_embed_copies_rows_exactly") % 4 + 1
    assert shard_of("a\\b.py::t", 5) == shard_of("a/b.py::t", 5)  # a Windows separator hashes the same


@pytest.mark.parametrize("spec, want", [("1/1", (1, 1)), ("3/4", (3, 4)), (" 2 / 8 ", (2, 8))])
def test_shard_spec_reads_index_and_count(spec, want):
    assert parse_shard(spec) == want


@pytest.mark.parametrize("spec", ["0/3", "4/3", "1/0", "x", "1-3", "", "2/"])
def test_a_bad_shard_spec_is_refused_with_its_value(spec):
    with pytest.raises(ShardError, match="--shard"):
        parse_shard(spec)


def test_merging_rung_files_sums_counts_and_keeps_the_worst_error():
    a = {"rungs": {"unit": {"passed": 2, "skipped": 1}}, "skips": {"unit": {"no gpu": 1}},
         "ops": [{"rung": "unit", "backend": "numpy", "op": "rmsnorm", "multiple": 1.0, "case": "a"}],
         "calls": [{"rung": "unit", "backend": "numpy", "op": "rmsnorm", "n": 3}],
         "graph": [{"backend": "numpy", "prompts": 2, "failed_prompts": 0, "positions": 40, "exact": 40, "near_ties": 0,
                    "failures": 0, "min_margin": 0.5, "max_logit_diff": 0.01, "allowed": 0.03, "eps": 0.06, "close": 4,
                    "prompt_ids": ["p1", "p0"], "floor_flips": 1, "floor_close": 9}],
         "graph_bounds": [{"floor": 1.0}], "failures": [], "unsupported": []}
    b = {"rungs": {"unit": {"passed": 1, "failed": 1}}, "skips": {"unit": {"no gpu": 2}},
         "ops": [{"rung": "unit", "backend": "numpy", "op": "rmsnorm", "multiple": 3.0, "case": "b"},
                 {"rung": "unit", "backend": "numpy", "op": "embed", "multiple": 0.0, "case": "c"}],
         "calls": [{"rung": "unit", "backend": "numpy", "op": "rmsnorm", "n": 1},
                   {"rung": "unit", "backend": "numpy", "op": "embed", "n": 1}],
         "graph": [{"backend": "numpy", "prompts": 3, "failed_prompts": 1, "positions": 60, "exact": 58, "near_ties": 1,
                    "failures": 1, "min_margin": 0.2, "max_logit_diff": 0.02, "allowed": 0.03, "eps": 0.06, "close": 6,
                    "prompt_ids": ["p2"], "floor_flips": 1, "floor_close": 9}],
         "graph_bounds": [{"floor": 1.0}], "failures": ["t::x"],
         "unsupported": [{"backend": "numpy", "format": "int3", "tests": 2}]}
    m = merge_rung_data([a, b])
    assert m["rungs"] == {"unit": {"passed": 3, "skipped": 1, "failed": 1}}
    assert m["skips"] == {"unit": {"no gpu": 3}}
    assert {o["op"]: (o["multiple"], o["case"]) for o in m["ops"]} == {"rmsnorm": (3.0, "b"), "embed": (0.0, "c")}
    assert {c["op"]: c["n"] for c in m["calls"]} == {"rmsnorm": 4, "embed": 1}
    g = m["graph"][0]
    assert (g["prompts"], g["failed_prompts"], g["positions"], g["exact"], g["near_ties"], g["failures"]) == (5, 1, 100, 98, 1, 1)
    assert (g["max_logit_diff"], g["min_margin"]) == (0.02, 0.2)
    # the flip rule is judged again on the sums: close positions add up, the floor's counts are the bounds'
    assert (g["close"], g["floor_flips"], g["floor_close"], g["prompt_ids"]) == (10, 1, 9, ["p0", "p1", "p2"])
    assert m["graph_bounds"] == [{"floor": 1.0}]  # once
    assert m["failures"] == ["t::x"] and m["unsupported"] == [{"backend": "numpy", "format": "int3", "tests": 2}]
    assert ["numpy", "rmsnorm"] not in [list(x) for x in m["ops_never_called"]]


# ---- merge refuses what is not one run's shards --------------------------------------------------


def _fake_report(folder: Path, shard: str | None, **meta) -> Path:
    folder.mkdir(parents=True)
    rep = {"meta": {"model": "default", "backends": ["numpy"], "formats": ["int4_sym_g128"], "plant_fault": None,
                    "shard": shard, "started": "2026-12-01T00:00:00", **meta},
           "rungs": {"unit": {"exit": 0, "seconds": 1.0, "passed": 1}}}
    (folder / "report.json").write_text(json.dumps(rep))
    (folder / "unit.json").write_text(json.dumps({"rungs": {"unit": {"passed": 1}}, "calls": [], "ops": []}))
    return folder


@skip_inside_nested_run
@pytest.mark.parametrize("case, message", [
    ("missing", "shard(s) [3] of 3 missing"),
    ("twice", "given more than once"),
    ("other split", "shards of different splits"),
    ("other model", "not shards of one run"),
    ("not a shard", "is not a shard"),
    ("not a report", "no report.json"),
    ("run option", "--model"),
])
def test_merge_refuses_what_is_not_the_shards_of_one_run_in_one_line(tmp_path, case, message):
    r = [_fake_report(tmp_path / "s1", "1/3"), _fake_report(tmp_path / "s2", "2/3")]
    extra = []
    if case == "missing":
        pass
    elif case == "twice":
        r.append(_fake_report(tmp_path / "s2b", "2/3"))
    elif case == "other split":
        r.append(_fake_report(tmp_path / "s3", "3/4"))
    elif case == "other model":
        r.append(_fake_report(tmp_path / "s3", "3/3", model="/elsewhere/m.nanoqwen"))
    elif case == "not a shard":
        r.append(_fake_report(tmp_path / "whole", None))
    elif case == "not a report":
        (tmp_path / "empty").mkdir()
        r.append(tmp_path / "empty")
    elif case == "run option":
        r.append(_fake_report(tmp_path / "s3", "3/3"))
        extra = ["--model", str(tmp_path / "s1" / "report.json")]
    proc = nanoqwen("ladder", "merge", *map(str, r), "--report", str(tmp_path / "out"), *extra, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoqwen: error: ") and message in lines[0], proc.stderr
    assert not (tmp_path / "out" / "report.json").exists()


@skip_inside_nested_run
def test_a_bad_shard_is_refused_before_any_rung_runs(tmp_path):
    proc = nanoqwen("ladder", "--shard", "4/3", "--report", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2 and "--shard 4/3" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


# ---- three shards of the NumPy ladder are the same ladder as one run ------------------------------


def _ladder(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    proc = nanoqwen("ladder", "--backend", "numpy", "--quant", "int4_sym_g128", "-n", "0", "--report", str(out),
                    *extra, "--", "-k", SELECTION, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _content(rep: dict) -> dict:
    """What a report says, without what depends on where and when it ran (times, paths, example cases)."""
    return {
        "rungs": {r: {k: v.get(k, 0) for k in ("passed", "failed", "skipped", "exit")} for r, v in rep["rungs"].items()},
        "skips": rep["skips"],
        "ops": sorted((o["rung"], str(o["backend"]), str(o.get("format")), o["op"], o["multiple"], o.get("passed", True))
                      for o in rep["ops"]),
        "coverage": rep["coverage"],
        "graph": sorted((g["backend"], g["prompts"], g["failed_prompts"], g["positions"], g["exact"], g["near_ties"],
                         g["failures"], g["max_logit_diff"]) for g in rep["graph"]["backends"]),
        "bounds": rep["graph"]["bounds"],
        "failures": sorted(json.dumps(f, sort_keys=True) for f in rep["failures"]),  # records: test, backend, format, ...
    }


def _junit_cases(folder: Path, rung: str) -> list[str]:
    root = ET.parse(folder / f"junit-{rung}.xml").getroot()
    return sorted(f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase"))


@skip_inside_nested_run
@pytest.mark.long  # 9 to 30 s on CI's 2 cores: started first, not left to end the suite alone
def test_three_shards_merge_to_the_report_of_one_run(tmp_path):
    # The whole run and the three shards at once, as the machines of a sharded nightly would run them
    # (each is a few pytest processes that mostly wait on their start-up).
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(_ladder, tmp_path, "whole")]
        runs += [pool.submit(_ladder, tmp_path, f"shard{i}", "--shard", f"{i}/3") for i in (1, 2, 3)]
        whole, *shards = [r.result() for r in runs]
    ran = [{r: v.get("passed", 0) + v.get("failed", 0) + v.get("skipped", 0) for r, v in s["rungs"].items()} for s in shards]
    assert all(sum(r.values()) > 0 for r in ran), f"a shard ran nothing: {ran}"  # the split spread the tests
    proc = nanoqwen("ladder", "merge", *(str(tmp_path / f"shard{i}") for i in (3, 1, 2)),  # any order
                    "--report", str(tmp_path / "merged"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    merged = json.loads((tmp_path / "merged" / "report.json").read_text())
    assert _content(merged) == _content(whole)
    assert merged["meta"]["shards"] == 3 and merged["meta"]["result"] == "passed"
    for rung in ("unit", "layer", "graph"):
        assert _junit_cases(tmp_path / "merged", rung) == _junit_cases(tmp_path / "whole", rung)
    assert "| graph |" in (tmp_path / "merged" / "report.md").read_text()
