"""Worker groups under `pytest -n N --dist loadgroup`: the cases that share something costly run on one worker.

Two kinds of groups (`group_of`):
- a format's model-bound cases (those that take `model_path`: the layer and graph rungs') share one worker,
  which builds that format's model and its HF simulation once instead of at every switch between formats,
  where the model is large (2 B parameters or more, `small_model`) or the workers are no more than the
  formats (`by_format`); a small model's cases with workers to spare are free, as are the other cases
  (the unit rung's): they spread over every worker;
- a test marked `same_worker(*params)` keeps its cases that share those parameters together (the 7B-shape
  linears' decode and prefill cases share one weight).

How a group reaches the scheduler. pytest-xdist's own loadgroup reads `xdist_group` markers in the worker
and appends `@group` to each item's node id; pytest 9.2 keeps the node id in a new field, the renaming was
lost, and every group came back empty without a word. So nothing here renames a node id, adds a marker for
another plugin to read, or depends on the order of hooks: the controller hands each worker a folder
(`pytest_configure_node`, through `workerinput`), each worker writes the groups it computed while
collecting (`write_groups`: node id -> group), and the scheduler that `--dist loadgroup` gets from this
plugin (`pytest_xdist_make_scheduler`) reads a node id's scope from those files. Workers send their
collections after writing them, and xdist schedules only when every collection has arrived, so the files
are complete when they are read. A node id the files do not name keeps pytest-xdist's own rule.
ladder/selftest/test_groups.py proves it with the worker that ran each case.

The same folder carries each worker's vital signs (its pid, memory and running case, every second), and
the hooks here that say why a worker died, in one line, and that stop a run at its second dead worker
(ladder/plugin/liveness.py; ladder/selftest/test_dead_worker.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from engine.errors import NanoqwenError
from ladder.plugin import liveness

KEY = "nanoqwen_groups"  # the workerinput entry that names the groups folder (and the workers' vital signs)
# Replacement workers: pytest-xdist starts one for each that dies, up to four per worker. One is allowed, so
# that a single crash (a segfault in one case) still lets the rest of the run be judged (the rest of the dead
# worker's group runs on the replacement); the second death stops the run (the workers finish what they
# hold), red, instead of starting worker after worker: a worker killed for memory is most often replaced by
# one that builds the same model and is killed again, each time after minutes. `--max-worker-restart N`
# given on the command line is kept.
WORKER_RESTARTS = 1


SPREAD_BELOW = 2_000_000_000  # parameters: below, a model is small (its formats' cases may spread over the workers)
SPREAD_VARIABLE = "NANOQWEN_SPREAD_BELOW"  # sets it (0: every model counts as large, the grouping of before)


def params_of(c: dict) -> tuple[int, int]:
    """(parameters of the model, of one decoder layer) from its config (HF names), unquantized shapes."""
    H, I, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = H * (q + 2 * kv) + (q + 2 * kv) + q * H + 3 * H * I + 2 * H
    return int(V * H * (1 if c.get("tie_word_embeddings") else 2) + L * layer + H), int(layer)


class SpreadError(NanoqwenError):
    """NANOQWEN_SPREAD_BELOW set to something other than a count of parameters."""


def spread_below() -> int:
    """SPREAD_BELOW, or NANOQWEN_SPREAD_BELOW (a count of parameters, `2e9` accepted) where set."""
    text = os.environ.get(SPREAD_VARIABLE, "").strip()
    if not text:
        return SPREAD_BELOW
    try:
        n = float(text)
    except ValueError:
        n = -1.0
    if not (0 <= n < float("inf")):
        raise SpreadError(f"{SPREAD_VARIABLE} is {text[:40]!r}; give a count of parameters (0: every model "
                          f"keeps a format's cases on one worker)")
    return int(n)


def small_model(spec) -> bool:
    """Whether the model `--model` names (None: the embedded default model, 6.8 M parameters; a Hugging
    Face folder; a .nanoqwen file) is below spread_below() parameters. One that cannot be read counts as
    large (its cases keep to one worker per format, the cautious choice); the run says what is wrong with it."""
    limit = spread_below()
    if spec is None:
        return 6_800_000 < limit
    try:
        path = Path(spec)
        if path.is_dir():
            config = json.loads((path / "config.json").read_text())
        else:
            from engine.modelfile import ModelFile

            with ModelFile(path, verify_checksums=False) as mf:
                config = mf.config_dict
        return params_of(config)[0] < limit
    except Exception:  # noqa: BLE001 - unreadable: the cautious choice, and the run reports the model's fault
        return False


def by_format(config) -> bool:
    """Whether a format's model-bound cases keep to one worker: several formats, of a large model or on no
    more workers than formats. With one format there is one model. A small one (a 0.5B-shape model's
    float32 copy is built in 0.6 s) is cheaper to build again at a switch than to leave cores idle, so
    with more workers than formats (a host backend on a many-core machine, or `-n 16`) its cases spread
    over every worker, each building what its cases need; with no more (CI's 2 workers, four formats,
    or a GPU's four workers: kernels/cuda test_workers) every worker already
    has a format to itself, and switching only costs (the default model's graph rung on 2 CPU workers:
    64 s grouped, 70 s spread). Decided once per session."""
    if not hasattr(config, "_nanoqwen_by_format"):
        from ladder.plugin import model_formats

        formats = len(model_formats(config))
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        config._nanoqwen_by_format = formats > 1 and (workers <= formats or not small_model(config.getoption("--model")))
    return config._nanoqwen_by_format


def group_of(item, grouped: bool) -> str | None:
    """The group of one collected item (`grouped`: `by_format`), or None for a free case."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    quant = callspec.params.get("quant_name")
    if quant is not None and grouped and "model_path" in item.fixturenames:
        return f"{quant}-{callspec.params.get('backend_name')}"
    pair = item.get_closest_marker("same_worker")
    if pair is not None:
        return f"{item.originalname}-" + "-".join(str(callspec.params.get(p)) for p in pair.args)
    return None


def write_groups(config, items) -> None:
    """In a worker: write node id -> group for the collected items where the controller asked for it."""
    folder = getattr(config, "workerinput", {}).get(KEY)
    if not folder:
        return
    grouped = by_format(config)
    groups = {item.nodeid: g for item in items if (g := group_of(item, grouped)) is not None}
    path = Path(folder) / f"{config.workerinput['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)  # the scheduler never reads half a file


def _wanted(config) -> bool:
    return config.getvalue("dist") == "loadgroup"


def pytest_configure(config):
    """The replacement workers allowed (WORKER_RESTARTS). The plugin registers this module from its own
    pytest_configure, which pytest replays here at once: before pytest-xdist's (trylast) reads the option.
    A bad NANOQWEN_SPREAD_BELOW is a usage error here, before any worker starts."""
    try:
        spread_below()
    except SpreadError as e:
        raise pytest.UsageError(str(e)) from None
    if getattr(config.option, "maxworkerrestart", "") is None and getattr(config.option, "numprocesses", None):
        config.option.maxworkerrestart = str(WORKER_RESTARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """In the controller, before a worker starts: the folder it writes its groups and vital signs to."""
    config = node.config
    if getattr(config, "_nanoqwen_groups", None) is None:
        config._nanoqwen_groups = tempfile.mkdtemp(prefix="nanoqwen-groups-")
    node.workerinput[KEY] = config._nanoqwen_groups
    liveness.beat(liveness.TESTS, f"starting worker {node.gateway.id}")


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # firstresult: pytest-xdist's own answer would win otherwise
def pytest_xdist_make_scheduler(config, log):
    if not _wanted(config):
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):
        """pytest-xdist's loadgroup, the groups read from the workers' files instead of the node ids, and a
        worker's crash (a kill for memory, a segfault) that ends the run instead of hanging it."""

        groups: dict[str, str] | None = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.unreachable: set = set()  # workers a send to failed: dead, their death not handled yet

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = read_groups(getattr(config, "_nanoqwen_groups", None))
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

        def remove_node(self, node):
            """A worker is gone. pytest-xdist 3.8 puts its whole workload back on the queue: its finished
            groups too, which a replacement then gets as empty units that never complete, and the test it
            crashed on, which would crash the replacement as well (xdist has already reported it failed).
            The run hung, every process idle, after "node down: Not properly terminated". Here only the
            unfinished rest of each group goes back."""
            workload = self.assigned_work.pop(node)
            unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
            if not unfinished:
                return None
            # the worker runs its items in the order they were sent: the first unfinished one was running
            crashed = next(nodeid for unit in unfinished.values() for nodeid, done in unit.items() if not done)
            for scope, unit in unfinished.items():
                if crashed in unit:
                    unit[crashed] = True  # done: xdist reported it failed; not to be run again
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

        def _reschedule(self, node) -> None:
            """A worker runs an item only once it knows the next one or that none will come; at the start
            xdist sends each two units for that reason, but a replacement worker got one, and a group of one
            case then waited forever. Never leave a worker holding fewer than two items."""
            if node not in self.registered_collections or node in self.unreachable:
                return  # a replacement still collecting: schedule() gives it work once its collection is in
            super()._reschedule(node)
            while not node.shutting_down and self._pending_of(self.assigned_work.get(node, {})) < 2:
                if not self.workqueue:
                    node.shutdown()
                    break
                if node in self.unreachable:
                    break
                self._assign_work_unit(node)

        def _assign_work_unit(self, node) -> None:
            """Two workers killed at once (both dying cases sent at the start): the first death's rescheduling
            sent work to the second, already dead, whose own death was still queued, and the send's OSError
            ended the run in an internal error. Such a unit goes back to the head of the queue, and the
            worker gets nothing more: its death, when it is handled, finds only what it really held."""
            scope = next(iter(self.workqueue))
            try:
                super()._assign_work_unit(node)
            except OSError:
                self.workqueue[scope] = self.assigned_work[node].pop(scope)
                self.workqueue.move_to_end(scope, last=False)
                self.unreachable.add(node)

    return GroupScheduling(config, log)


# ---- a worker's signs of life and its death (ladder/plugin/liveness.py) ------------------------------------


def pytest_sessionstart(session):
    """In a worker: its vital signs start (every second, into the controller's folder)."""
    config = session.config
    folder = getattr(config, "workerinput", {}).get(KEY)
    if folder:
        config._nanoqwen_vitals = liveness.Vitals(folder, config.workerinput["workerid"]).start()
        liveness.beat(liveness.CASE, "collecting")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In the process that runs the case (a worker, or a run without workers): a beat as it starts and as
    it ends, so that a rung stopped for want of progress names the case that had started."""
    vitals = getattr(item.config, "_nanoqwen_vitals", None)
    if vitals is not None:
        vitals.case = item.nodeid
    liveness.beat(liveness.CASE, f"started {item.nodeid}")
    yield
    liveness.beat(liveness.CASE, f"finished {item.nodeid}")
    if vitals is not None:
        vitals.case = None


def deaths(config) -> list[dict]:
    """The workers that died in this run: worker, cause, the case it died on (None: between cases)."""
    if not hasattr(config, "_nanoqwen_deaths"):
        config._nanoqwen_deaths = []
    return config._nanoqwen_deaths


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """In the controller, as pytest-xdist learns that a worker is gone (before it reports the case the worker
    was running): why, from its exit status and its last vital signs."""
    if error is None or error == "keyboard-interrupt":  # a worker that ended its session, or Ctrl-C
        return
    worker = node.gateway.id
    why = liveness.cause(liveness.exit_status(node), liveness.last_vitals(getattr(node.config, "_nanoqwen_groups", None), worker))
    deaths(node.config).append({"worker": worker, "cause": why, "case": None})


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """The case a dead worker was running fails with one line instead of pytest-xdist's own message: the
    case, the worker and the cause. The line is printed at once; pytest's FAILED line and the report's
    failure carry it as the message."""
    node = getattr(report, "node", None)
    if node is None:
        return
    worker = node.gateway.id
    known = deaths(node.config)
    death = next((d for d in reversed(known) if d["worker"] == worker and d["case"] is None), None)
    if death is None:
        death = {"worker": worker, "cause": liveness.cause(liveness.exit_status(node), {}), "case": None}
        known.append(death)
    death["case"] = crashitem
    line = liveness.death_line(worker, crashitem, death["cause"])
    report.longrepr = line
    liveness.say(node.config, line, liveness.rung_of(crashitem, node.config))


def read_groups(folder: str | None) -> dict[str, str]:
    groups: dict[str, str] = {}
    for path in sorted(Path(folder).glob("*.json")) if folder else ():
        groups.update(json.loads(path.read_text()))
    return groups


def pytest_unconfigure(config):
    folder = getattr(config, "_nanoqwen_groups", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
