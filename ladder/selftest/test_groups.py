"""Self-test: under `pytest -n 2 --dist loadgroup` the plugin's groups decide which worker runs a case.

A format's model-bound cases (the layer and graph rungs') must run on one worker, which builds the model
and its HF simulation once; the unit rung's other cases must spread over every worker; a test marked
`same_worker(...)` keeps the cases that share those parameters on one worker (the 7B-shape linears'
decode and prefill cases share one weight). What is read is the worker that ran each case, written by a
small plugin inside the workers, not a name: pytest 9.2 dropped the `@group` suffix pytest-xdist used to
give node ids, and a check of the names kept passing on a run whose groups did nothing (ladder/groups.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

from ladder.nested import REPO, child_env, skip_inside_nested_run

# Loaded in every worker with `-p`: one line per case, "node id<TAB>worker id", appended as it starts.
WORKER_LOG = '''
import os

def pytest_runtest_logstart(nodeid, location):
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # the controller hears of each case too: not logged
    if worker:
        with open(os.environ["NANOQWEN_WORKER_LOG"], "a") as f:
            f.write(f"{nodeid}\\t{worker}\\n")
'''


def _workers(tmp_path: Path, *args: str) -> dict[str, str]:
    """test name (the part after `::`) -> the pytest-xdist worker that ran it, from a two-worker run."""
    (tmp_path / "worker_log.py").write_text(WORKER_LOG)
    log = tmp_path / "workers.tsv"
    r = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "ladder.plugin", "-p", "worker_log",
                        "-c", "/dev/null", "--rootdir", str(REPO), "--confcutdir", str(REPO), "-p", "no:cacheprovider",
                        "-n", "2", "--dist", "loadgroup", "-q"], cwd=REPO, capture_output=True, text=True,
                       env=child_env("numpy", pythonpath=os.pathsep.join((str(REPO), str(tmp_path))), NANOQWEN_WORKER_LOG=str(log)),
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    return {nodeid.split("::", 1)[1]: worker for nodeid, worker in lines}


def _by(got: dict[str, str], key) -> dict[str, set[str]]:
    """key(test name) -> the workers that ran those tests."""
    out = defaultdict(set)
    for name, worker in got.items():
        out[key(name)].add(worker)
    return dict(out)


@skip_inside_nested_run
def test_a_format_s_model_bound_cases_run_on_one_worker_and_unit_cases_spread(tmp_path):
    got = _workers(tmp_path, str(REPO / "ladder" / "layer" / "test_layer.py"), str(REPO / "ladder" / "unit" / "test_ops.py"),
                   "--backend", "numpy", "-k", "golden or rmsnorm")
    layer = {n: w for n, w in got.items() if "golden" in n}  # ...[numpy-FORMAT-layerN-...]
    fmt = lambda n: n.split("[numpy-")[1].split("-layer")[0]  # noqa: E731
    cases = Counter(fmt(n) for n in layer)
    assert len(cases) == 4 and min(cases.values()) >= 2, cases  # four formats, two cases or more each
    per_format = _by(layer, fmt)
    assert all(len(workers) == 1 for workers in per_format.values()), per_format
    unit = {n: w for n, w in got.items() if "rmsnorm" in n}
    assert len(set(unit.values())) == 2, unit  # free cases go wherever a worker is idle: both of them


@skip_inside_nested_run
def test_same_worker_keeps_a_weight_s_decode_and_prefill_cases_on_one_worker(tmp_path):
    got = _workers(tmp_path, str(REPO / "ladder" / "unit" / "test_cuda_variants.py"), "--backend", "cuda",
                   "-k", "full_size")  # collected and skipped without a GPU: the worker of each case is what is read
    assert len(got) == 32
    pairs = _by(got, lambda n: n.rsplit("-", 1)[0])  # ...[cuda-FORMAT-OP-T] -> ...[cuda-FORMAT-OP
    assert len(pairs) == 16 and all(len(workers) == 1 for workers in pairs.values()), pairs  # four formats x four ops
    assert len(set(got.values())) == 2, got  # and the sixteen pairs spread over both workers


def test_a_grouped_case_s_rerun_hint_names_the_case_pytest_can_find(monkeypatch):
    from ladder.compare import rerun_command

    case = "ladder/graph/test_graph.py::test_greedy_tokens_match_the_hf_simulation[heldout-000-numpy-int4_sym_g128]"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{case}@int4_sym_g128-numpy (call)")
    assert rerun_command() == f"python -m pytest '{case}'"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "ladder/unit/test_ops.py::test_x[a@b] (call)")  # an @ inside the id stays
    assert rerun_command() == "python -m pytest 'ladder/unit/test_ops.py::test_x[a@b]'"
