"""`nanoqwen mutate --same-build`: the CUDA mutants whose build is the original's, byte for byte.

A mutant whose every module compiles to the same cubin bytes as the original's is the same machine code:
no input can tell it from the original, so running the rungs against it can only make it survive. Found
with nvcc alone (no GPU), before a sample spends GPU time on them. A person still writes why the compiler
folds the edit away (an integer division landing on the same count, a write past a thread-local array)
before listing one in ladder/tools/equivalent_mutants.json: the same bytes come from this nvcc, and another
toolkit may build them apart.

How: kernels/cuda is copied once as it is and once per mutant with the mutant written in; each copy's
modules are inlined by its own copy of the loader (kernels/cuda/loader.py, the text NVRTC gets) and
compiled with the loader's options to a cubin. A `.cu` mutant touches its own module, a `.cuh` mutant every
module that inlines the header. Verdicts: `same` (every touched module's cubin identical), `different`,
`did_not_compile`, `slow` (past COMPILE_TIMEOUT: a loop bound mutated to unroll thousands of times).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ladder.changes.launches import cuda_modules_holding
from ladder.changes.sources import cuda_module
from ladder.tools.mutants import Mutant

COMPILE_TIMEOUT = 120.0  # seconds for one module of one mutant
_COPIED = shutil.ignore_patterns("__pycache__", "*.pyc")


def _cubin_digest(folder: Path, module: str, loader, nvcc: str) -> str:
    """md5 of `module`'s cubin built from `folder`, or "did_not_compile" / "slow"."""
    cu, cubin = folder / f"_{module}.inlined.cu", folder / f"_{module}.cubin"
    cu.write_text(loader.source(module))
    # its own session: on a timeout the whole nvcc -> cicc -> ptxas chain is killed, not nvcc alone
    proc = subprocess.Popen([nvcc, "-cubin", *loader.OPTIONS, str(cu), "-o", str(cubin)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        rc = proc.wait(timeout=COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "slow"
    if rc != 0:
        return "did_not_compile"
    return hashlib.md5(cubin.read_bytes()).hexdigest()


def _build(folder: Path, modules: list[str], nvcc: str) -> dict[str, str]:
    loader = cuda_module("loader", folder)
    return {m: _cubin_digest(folder, m, loader, nvcc) for m in modules}


def same_build(mutants: list[Mutant], root: Path, workers: int, nvcc: str, log=print) -> list[dict]:
    """Each mutant's record (Mutant.record()) with `modules` (what it touches) and `verdict`."""
    source = Path(root) / "kernels" / "cuda"
    if not mutants:
        return []
    with tempfile.TemporaryDirectory(prefix="nanoqwen-same-build-") as tmp:
        original = Path(tmp) / "original"
        shutil.copytree(source, original, ignore=_COPIED)
        touched = {rel: cuda_modules_holding(Path(rel).name, original) for rel in sorted({m.file for m in mutants})}
        needed = sorted({mod for mods in touched.values() for mod in mods})
        with ThreadPoolExecutor(workers) as pool:  # the original's modules side by side
            base = dict(zip(needed, pool.map(lambda mod: _build(original, [mod], nvcc)[mod], needed)))
        broken = [mod for mod, d in base.items() if d in ("did_not_compile", "slow")]
        if broken:
            raise RuntimeError(f"the original {', '.join(broken)} does not build with {nvcc}: nothing to compare with")
        texts = {rel: (Path(root) / rel).read_text() for rel in touched}
        started, done = time.monotonic(), [0]

        def one(item: tuple[int, Mutant]) -> dict:
            i, m = item
            folder = Path(tmp) / f"m{i}"
            shutil.copytree(original, folder, ignore=shutil.ignore_patterns("_*.inlined.cu", "_*.cubin"))
            (folder / Path(m.file).name).write_text(m.apply(texts[m.file]))
            got = _build(folder, touched[m.file], nvcc)
            shutil.rmtree(folder, ignore_errors=True)
            failed = [d for d in got.values() if d in ("did_not_compile", "slow")]
            verdict = failed[0] if failed else ("same" if all(got[k] == base[k] for k in got) else "different")
            done[0] += 1
            if done[0] % 25 == 0:
                log(f"  {done[0]} of {len(mutants)} built ({time.monotonic() - started:.0f} s)")
            return {**m.record(), "modules": touched[m.file], "verdict": verdict}

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, enumerate(mutants)))
