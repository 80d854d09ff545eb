"""The warm process behind each `nanoqwen mutate` worker: heavy imports once, one forked child per rung run.

    python -m ladder.tools.forkserver FILE...   (started by ladder/tools/mutate.py, in a copy of the tree,
                                                 with the sources its mutants edit)

A fresh pytest process per mutant and rung spends most of its time before the first test: about 7 s
importing torch, transformers, Hypothesis and pytest on 2 cores, and on a GPU compiling every CUDA
module again. This process imports those libraries once, then answers requests on stdin, one JSON
line each: `{"args": [pytest arguments], "timeout": seconds, "log": file, "cases": {node id: seconds}}`.
For each it forks a child that runs `pytest.main(args)` with its output in `log`, and answers one JSON
line on stdout: `{"exit": code}`, or `{"exit": null, "timed_out": true, ...}` when the child was killed
with its whole process group.

The watchdog: a mutant that hangs a kernel (a loop whose bound it broke) blocks its child inside a
device wait, where nothing in the child can interrupt it. So the child writes the node id of each case
into a progress file as it starts, and clears it as the case ends (the session's end is no case's).
The server, polling every 20 ms, kills the child as soon as one case has run past its own limit
(`cases`, from the clean run's time for that case), answering `"hung": node id, "after": seconds`. The
whole run's `timeout` stays as the backstop (collection, or a case without a limit).

What must hold for a child to see the mutant:
- No module a mutant edits is imported here (checked after the imports): each child imports it from
  the copy of the tree, after the mutant was written into it. (A library may import a package of the
  project by name: where Hugging Face's `kernels` distribution is installed, transformers imports
  `kernels` and finds this project's package first on the path, which brings in kernels/__init__.py
  and kernels/base.py; seen on the GPU machine. Those are not mutated.) Bytecode is not written
  (PYTHONDONTWRITEBYTECODE, set by mutate.py), so a stale .pyc can never stand in for the mutated source.
- The device is never touched here: a CUDA context does not survive a fork. Each child creates its
  own; CuPy's on-disk kernel cache, which the workers share, hands it every module already compiled
  (keyed by the source text), so a child runs NVRTC on the mutated module only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

HEAVY = ("numpy", "torch", "transformers", "transformers.models.qwen2.modeling_qwen2", "safetensors.numpy",
         "tokenizers", "hypothesis", "hypothesis.extra.numpy", "pytest", "_pytest.python", "_pytest.fixtures",
         "cupy")  # importing CuPy creates no CUDA context
REFERENCE_ONLY = ("transformers", "transformers.models.qwen2.modeling_qwen2", "tokenizers")  # the layer and graph
# rungs' HF reference: 3.6 s of a CI core to import, which a unit-only run never needs


def preimport(mutated: list[str], rungs: list[str] | None = None) -> list[str]:
    """Import the heavy libraries (those not installed are left to the child); returns the ones imported.
    `mutated`: the sources (relative to the tree) the mutants edit; none of them may be imported here.
    `rungs`: the rungs the children run (None: any); a unit-only server leaves the HF reference out."""
    done = []
    skip = REFERENCE_ONLY if rungs is not None and not {"layer", "graph"} & set(rungs) else ()
    for name in (n for n in HEAVY if n not in skip):
        try:
            __import__(name)
            done.append(name)
        except Exception:  # noqa: BLE001 - a library the rungs do not need here; the child will say so if it does
            pass
    modules = {rel[:-len(".py")].replace("/", ".").removesuffix(".__init__") for rel in mutated if rel.endswith(".py")}
    loaded = sorted(modules & set(sys.modules))
    if loaded:
        raise RuntimeError(f"the fork server imported {loaded[:5]}, which mutants edit: children would not see them")
    return done


class _Progress:
    """The child's plugin: a count and the node id of each case, written to `path` as it starts, and an empty
    id as it finishes (the watchdog reads it; the count tells two writes of one id apart)."""

    def __init__(self, path: str):
        self.path, self.started = path, 0

    def pytest_runtest_logstart(self, nodeid, location):
        self._write(nodeid)

    def pytest_runtest_logfinish(self, nodeid, location):
        self._write("")  # between cases and after the last one (the session's end) no case limit applies

    def _write(self, nodeid: str) -> None:
        self.started += 1
        with open(self.path, "w") as f:
            f.write(f"{self.started}\t{nodeid}")


def _current_case(path: str, seen: tuple) -> tuple:
    """(node id, when it started by this clock, the file's line) of the case the child runs: a new one when
    the progress file's line changed since `seen`, else `seen` (a line half written reads as no change)."""
    try:
        with open(path) as f:
            line = f.read()
    except FileNotFoundError:
        return seen
    count, tab, nodeid = line.partition("\t")
    if not tab or not count.isdigit() or (seen and seen[2] == line):
        return seen
    return (nodeid, time.monotonic(), line)


def run_child(args: list[str], timeout: float, log: str, cases: dict[str, float] | None = None) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    progress = f"{log}.progress"
    if os.path.exists(progress):
        os.unlink(progress)
    pid = os.fork()
    if pid == 0:  # the child: its own process group, so a timeout kills everything it started
        code = 3
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import pytest

            code = int(pytest.main(args, plugins=[_Progress(progress)]))
        except BaseException as e:  # noqa: BLE001 - whatever happens, the server gets an exit code
            try:
                os.write(2, f"fork server child: {type(e).__name__}: {e}\n".encode())
            except OSError:
                pass
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + timeout
    current = ()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"exit": os.waitstatus_to_exitcode(status)}
        now = time.monotonic()
        current = _current_case(progress, current) if cases else ()
        hung = bool(current) and current[0] in cases and now - current[1] > cases[current[0]]
        if hung or now > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            if hung:
                return {"exit": None, "timed_out": True, "hung": current[0], "after": round(now - current[1], 1)}
            return {"exit": None, "timed_out": True}
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    """argv: [--rungs=unit,layer,...] then the mutated sources."""
    rungs = None
    if argv and argv[0].startswith("--rungs="):
        rungs, argv = argv[0].partition("=")[2].split(","), argv[1:]
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the imports print must not reach the protocol stream
    preimport(argv, rungs)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        res = run_child(req["args"], float(req["timeout"]), req["log"], req.get("cases"))
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
