"""The warm process behind each `nanoqwen mutate` worker: heavy imports once, one forked child per rung run.

    python -m ladder.tools.forkserver FILE...   (started by ladder/tools/mutate.py, in a copy of the tree,
                                                 with the sources its mutants edit)

A fresh pytest process per mutant and rung spends most of its time before the first test: about 7 s
importing torch, transformers, Hypothesis and pytest on 2 cores, and on a GPU compiling every CUDA
module again. This process imports those libraries once, then answers requests on stdin, one JSON
line each: `{"args": [pytest arguments], "timeout": seconds, "log": file}`. For each it forks a child
that runs `pytest.main(args)` with its output in `log`, and answers one JSON line on stdout:
`{"exit": code}`, or `{"exit": null, "timed_out": true}` when the child ran past the timeout and was
killed with its whole process group.

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


def run_child(args: list[str], timeout: float, log: str) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: its own process group, so a timeout kills everything it started
        code = 3
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import pytest

            code = int(pytest.main(args))
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
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"exit": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
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
        res = run_child(req["args"], float(req["timeout"]), req["log"])
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
