"""Self-test: under `pytest -n 2 --dist loadgroup` the plugin's groups decide which worker runs a case.

A format's model-bound cases (the layer and graph rungs') must run on one worker, which builds the model
and its HF simulation once, where the model is large or the workers no more than the formats; a small
model's spread over every worker when there are more workers than formats (`by_format`), as the unit
rung's other cases always must; a test marked
`same_worker(...)` keeps the cases that share those parameters on one worker (the 7B-shape linears'
decode and prefill cases share one weight). What is read is the worker that ran each case, written by a
small plugin inside the workers, not a name: pytest 9.2 dropped the `@group` suffix pytest-xdist used to
give node ids, and a check of the names kept passing on a run whose groups did nothing (ladder/plugin/groups.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from ladder.run.nested import REPO, child_env, skip_inside_nested_run

# Loaded in every worker with `-p`: one line per case, "node id<TAB>worker id", appended as it starts.
WORKER_LOG = '''
import os

def pytest_runtest_logstart(nodeid, location):
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # the controller hears of each case too: not logged
    if worker:
        with open(os.environ["NANOQWEN_WORKER_LOG"], "a") as f:
            f.write(f"{nodeid}\\t{worker}\\n")
'''


# Loaded in every worker with `-p`: the worker that starts the case NANOQWEN_KILL names dies at once, as a
# worker the kernel kills for memory does.
KILLER = '''
import os

def pytest_runtest_call(item):
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ["NANOQWEN_KILL"] in item.nodeid:
        os.kill(os.getpid(), 9)
'''


def _two_workers(tmp_path: Path, plugin: str, source: str, *args: str, timeout: int = 600,
                 **env: str) -> subprocess.CompletedProcess:
    """`pytest ARGS -n 2 --dist loadgroup` from the checkout, with `source` loaded in it as `-p plugin`."""
    (tmp_path / f"{plugin}.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "ladder.plugin", "-p", plugin,
                           "-c", "/dev/null", "--rootdir", str(REPO), "--confcutdir", str(REPO), "-p", "no:cacheprovider",
                           "-n", "2", "--dist", "loadgroup", "-q", "-rf"], cwd=REPO, capture_output=True, text=True,
                          env=child_env("numpy", pythonpath=os.pathsep.join((str(REPO), str(tmp_path))), **env),
                          timeout=timeout)


def _workers(tmp_path: Path, *args: str) -> dict[str, str]:
    """test name (the part after `::`) -> the pytest-xdist worker that ran it, from a two-worker run."""
    log = tmp_path / "workers.tsv"
    r = _two_workers(tmp_path, "worker_log", WORKER_LOG, *args, NANOQWEN_WORKER_LOG=str(log))
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
def test_a_format_keeps_its_model_bound_cases_on_one_worker_and_unit_cases_spread(tmp_path):
    got = _workers(tmp_path, str(REPO / "ladder" / "layer" / "test_layer.py") + "::test_block_matches_golden_activations",
                   *(str(REPO / "ladder" / "unit" / f) for f in ("test_format_int4.py", "test_kv_cache.py")),
                   "--backend", "numpy")  # two workers, four formats: every format keeps to one worker
    layer = {n: w for n, w in got.items() if "golden" in n}  # ...[numpy-FORMAT-layerN-...]
    fmt = lambda n: n.split("[numpy-")[1].split("-layer")[0]  # noqa: E731
    cases = Counter(fmt(n) for n in layer)
    assert len(cases) == 4 and min(cases.values()) >= 2, cases  # four formats, two cases or more each
    per_format = _by(layer, fmt)
    assert all(len(workers) == 1 for workers in per_format.values()), per_format
    unit = {n: w for n, w in got.items() if n not in layer}
    # free cases go to whichever worker is idle: with seventeen of them, both workers take some
    assert len(unit) >= 15 and len(set(unit.values())) == 2, unit


class _Config:
    """What `by_format` reads of a pytest config: --model and --quant."""

    def __init__(self, model=None):
        self.options = {"--model": model, "--quant": "all"}

    def getoption(self, name):
        return self.options[name]


@pytest.mark.parametrize("workers, model, spread_below, grouped", [
    ("2", None, None, True),  # no more workers than the four formats: each has one to itself
    ("16", None, None, False),  # a small model (the default), workers to spare: its cases spread
    ("16", "qwen2.5-coder-7b", None, True),  # a large model: one worker builds each format once
    ("16", None, "0", True),  # every model counts as large
    ("1", None, None, True),
])
def test_a_small_model_s_formats_spread_only_over_workers_to_spare(monkeypatch, tmp_path, workers, model,
                                                                  spread_below, grouped):
    import json

    from engine.config import SHAPES
    from ladder.plugin.groups import by_format

    if model is not None:  # a Hugging Face folder of that shape: its config is all that is read
        (tmp_path / "config.json").write_text(json.dumps(SHAPES[model].to_hf_dict()))
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    if spread_below is not None:
        monkeypatch.setenv("NANOQWEN_SPREAD_BELOW", spread_below)
    assert by_format(_Config(None if model is None else str(tmp_path))) is grouped


@skip_inside_nested_run
def test_same_worker_keeps_a_weight_s_decode_and_prefill_cases_on_one_worker(tmp_path):
    got = _workers(tmp_path, str(REPO / "ladder" / "unit" / "test_cuda_variants.py"), "--backend", "cuda",
                   "-k", "full_size")  # collected and skipped without a GPU: the worker of each case is what is read
    assert len(got) == 32
    pairs = _by(got, lambda n: n.rsplit("-", 1)[0])  # ...[cuda-FORMAT-OP-T] -> ...[cuda-FORMAT-OP
    assert len(pairs) == 16 and all(len(workers) == 1 for workers in pairs.values()), pairs  # four formats x four ops
    assert len(set(got.values())) == 2, got  # and the sixteen pairs spread over both workers


def _started(tmp_path: Path, *args: str) -> list[tuple[str, str]]:
    """(test name, worker) in the order the cases started, from a two-worker run."""
    log = tmp_path / "workers.tsv"
    r = _two_workers(tmp_path, "worker_log", WORKER_LOG, *args, NANOQWEN_WORKER_LOG=str(log))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [(nodeid.split("::", 1)[1], worker) for nodeid, worker in (line.split("\t") for line in log.read_text().splitlines())]


@skip_inside_nested_run
def test_a_long_case_starts_with_the_rung_not_at_its_end(tmp_path):
    # test_gpu_references.py's two cases are marked long (here they skip at once: no GPU is needed to see
    # where the scheduler puts them); collected in file order they would start after test_kv_cache.py's
    started = _started(tmp_path, str(REPO / "ladder" / "unit" / "test_kv_cache.py"),
                       str(REPO / "ladder" / "unit" / "test_gpu_references.py"), "--backend", "numpy")
    names = [name.split("[")[0] for name, _ in started]
    long_case = "test_the_gpu_references_agree_with_the_host_references_within_the_floor"
    assert names.count(long_case) == 2 and len(names) >= 7, names
    assert names[:2] == [long_case, long_case], names  # the two workers' first cases


@skip_inside_nested_run
def test_a_worker_killed_inside_a_group_fails_its_case_and_the_run_ends(tmp_path):
    """pytest-xdist 3.8 requeued a dead worker's finished groups and its crashing case, and the run hung
    with every process idle (seen on a 0.5B-shape graph rung: a worker killed for memory). The case it died
    on fails once; the rest of its group runs on the replacement; the run ends."""
    crashed = "test_block_matches_golden_activations[numpy-int8_sym_channel-layer1-L1-s33]"  # inside its group
    try:
        r = _two_workers(tmp_path, "killer", KILLER, str(REPO / "ladder" / "layer" / "test_layer.py"),
                         "--backend", "numpy", "-k", "golden", timeout=180,  # about 5 s when it ends
                         NANOQWEN_KILL="int8_sym_channel-layer1")
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung after its worker was killed")
    assert r.returncode == 1 and "node down" in r.stdout, r.stdout[-3000:]
    failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 1 and crashed in failed[0], failed
    assert "1 failed, 15 passed" in r.stdout, r.stdout[-2000:]  # the other three cases of its group ran too


def test_a_grouped_case_s_rerun_hint_names_the_case_pytest_can_find(monkeypatch):
    from ladder.judges.compare import rerun_command

    case = "ladder/graph/test_graph.py::test_greedy_tokens_match_the_hf_simulation[heldout-000-numpy-int4_sym_g128]"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{case}@int4_sym_g128-numpy (call)")
    assert rerun_command() == f"python -m pytest '{case}'"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "ladder/unit/test_ops.py::test_x[a@b] (call)")  # an @ inside the id stays
    assert rerun_command() == "python -m pytest 'ladder/unit/test_ops.py::test_x[a@b]'"


class _Node:
    """A pytest-xdist worker as the scheduler sees it; `dead`: its process is gone, its death not yet handled."""

    def __init__(self, name: str, dead: bool = False):
        self.gateway = type("Gateway", (), {"id": name})()
        self.dead, self.shutting_down, self.sent = dead, False, []

    def send_runtest_some(self, indices):
        if self.dead:
            raise OSError("cannot send (already closed?)")  # what execnet raises for a worker that is gone
        self.sent += indices

    def shutdown(self):
        self.shutting_down = True


def test_two_workers_killed_at_once_end_the_run_without_an_internal_error():
    """Both dying cases sent at the start, both workers killed: handling the first death sent work to the
    second worker, already dead, and the send's OSError ended the run in an INTERNALERROR (pytest exit 3, a
    broken harness) once in about a dozen runs of ladder/selftest/test_dead_worker.py under load. The unit
    goes back to the queue, and the second death finds only what its worker really held."""
    from types import SimpleNamespace

    from xdist.remote import Producer

    from ladder.plugin.groups import pytest_xdist_make_scheduler

    option = SimpleNamespace(dist="loadgroup", tx=["2*popen"], loadscopereorder=False)
    config = SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))
    sched = pytest_xdist_make_scheduler(config, Producer("sched", enabled=False))
    first, second = _Node("gw0"), _Node("gw1")
    ids = ["t.py::test_dies[0]", "t.py::test_dies[1]", *(f"t.py::test_x[{i}]" for i in range(4))]
    for node in (first, second):
        sched.add_node(node)
        sched.add_node_collection(node, ids)
    sched.schedule()  # two free cases each, in turn: each worker starts on a dying case
    assert (first.sent, second.sent) == ([0, 2], [1, 3])
    second.dead = True
    assert sched.remove_node(first) == ids[0]  # no OSError from the send to gw1
    assert second.sent == [1, 3]
    assert sched.remove_node(second) == ids[1]  # gw1's own case, not the unit whose send failed
    assert list(sched.workqueue) == [ids[4], ids[5], ids[2], ids[3]]  # nothing lost, the dying cases not again
