"""Self-test: faults planted in a CUDA kernel's source, where only the kernel's edges reach them, turn the
ladder red and the report names the op or the kernel.

The guard bands around every output (ladder/checks/harness.py), the shapes drawn from each variant's own
tiling constants (ladder/checks/edges.py, fixtures/strategies.py `edge_strata`) and the sanitizers exist
for bugs that a shape inside the tiles never meets or that change no value the checks compare. Each
fault is a one-line edit of the CUDA-core INT4 GEMV (`int4_gemv` in kernels/cuda/int4_sym_g128.cu, the
kernel of the `t<THREADS>_r<R>` variants), written into a private copy of the tree, and must be caught
by what it names:

- `tail_write_past_end`: the tail block stores one row past the output (`r >= rows` -> `r > rows`): the
  guard band past the output, on the unit rung (every value compared is right);
- `tail_read_past_end`: the tail block loads the weight rows past the last one, unclamped, and never stores
  them (no value changes): compute-sanitizer memcheck, CuPy's pool off;
- `missing_barrier`: the barrier between the warps' partial sums and their reduction removed: racecheck;
- `wrong_stride`: the thread loop strides half its block (`c += THREADS / 2`), so the chunks past one
  full stride are summed twice: the unit rung, at the edge shapes past one stride.

Without a GPU (CI): each edit applies to exactly one place and the edited module compiles for sm_90a. With
one (marker `gpu`, the nightly's GPU self-tests): each edited tree is red where its fault says, the four
side by side.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ladder.run.nested import child_env, skip_inside_nested_run

SOURCE = "kernels/cuda/int4_sym_g128.cu"
VARIANT = "int4_sym_g128-t128_r4"  # int4_gemv<EPI, 128, 4>: a CUDA-core variant
EDGES = f"test_gemv_variant_matches_reference_at_every_tile_edge and {VARIANT}"
LINEAR_OPS = ("qkv_proj", "o_proj_residual", "gate_up_silu", "down_residual")


@dataclass(frozen=True)
class KernelFault:
    name: str
    old: str  # the text edited: exactly one place in SOURCE
    new: str
    caught_by: str  # "unit" (the rung's checks), or a compute-sanitizer tool
    says: str  # a regular expression the catching run's output must match

    def __str__(self) -> str:
        return self.name


FAULTS = (
    KernelFault("tail_write_past_end", "if (r >= rows) return;", "if (r > rows) return;", "unit",
                r"({}) wrote outside its output".format("|".join(LINEAR_OPS))),
    KernelFault("tail_read_past_end", "int r = imin(row0 + (a % RB), rows - 1);", "int r = row0 + (a % RB);", "memcheck",
                r"Invalid __global__ read[\s\S]*int4_gemv_\w+_t128_r4"),
    KernelFault("missing_barrier",
                "        if (lane == 0) red[warp][a] = v;\n    }\n    __syncthreads();  // every warp's partials are in shared memory\n",
                "        if (lane == 0) red[warp][a] = v;\n    }\n", "racecheck", r"int4_gemv_\w+_t128_r4"),
    KernelFault("wrong_stride", "for (int c = tid; c < chunks; c += THREADS) {",
                "for (int c = tid; c < chunks; c += THREADS / 2) {", "unit", r"FAILED \S+\[{}-cuda-({})\]".format(
                    re.escape(VARIANT), "|".join(LINEAR_OPS))),
)


def _edited(fault: KernelFault, root: Path) -> str:
    text = (root / SOURCE).read_text()
    assert text.count(fault.old) == 1, f"{fault}: the edited text is in {SOURCE} {text.count(fault.old)} times, not once"
    return text.replace(fault.old, fault.new)


@pytest.mark.parametrize("fault", FAULTS, ids=str)
def test_each_planted_fault_is_one_edit_that_compiles(fault, tmp_path):
    from ladder.changes.sources import cuda_module
    from ladder.tools.mutate import ROOT

    loader = cuda_module("loader")  # by file path: importing kernels.cuda would import CuPy

    edited = _edited(fault, ROOT)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the edited kernel cannot be compiled here")
    module = Path(SOURCE).stem
    # The loader's own reading of the module (headers inlined), with the edit in it.
    src = loader.source(module).replace(fault.old, fault.new)
    assert src != loader.source(module) and fault.new in edited
    (tmp_path / f"{module}.cu").write_text(src)
    arch = next(o for o in loader.OPTIONS if o.startswith("--gpu-architecture=")).split("=", 1)[1]
    std = next(o for o in loader.OPTIONS if o.startswith("-std="))
    # To PTX with NVVM's optimizer off (-Xcicc -O0): the front end and code generation take the edit or
    # refuse it as they would optimized, in a third of the time (int4_sym_g128.cu: 1.0 s against 2.8 s);
    # the module's optimized build, and ptxas on it, is the unit rung's test_cuda_build.
    res = subprocess.run([nvcc, f"-arch={arch}", std, "--ptx", "-Xcicc", "-O0", str(tmp_path / f"{module}.cu"), "-o",
                          str(tmp_path / f"{module}.ptx")], capture_output=True, text=True)
    assert res.returncode == 0, f"{fault}: the edited {module}.cu does not compile:\n{res.stderr[-2000:]}"


def _caught(fault: KernelFault, base: Path) -> tuple[KernelFault, int, str]:
    """(fault, exit status, output) of the run that must catch `fault`, in a copy of the tree holding it."""
    from ladder.tools.mutate import copy_tree
    from ladder.tools.sanitizer import POOL_VARIABLE, command, find_sanitizer

    root = base / fault.name
    copy_tree(root)
    (root / SOURCE).write_text(_edited(fault, root))
    select = EDGES if fault.caught_by == "unit" else f"{EDGES}-cuda-qkv_proj"  # one op under a sanitizer
    argv = [sys.executable, "-m", "pytest", str(root / "ladder" / "unit" / "test_cuda_variants.py"), "-m", "unit",
            "-k", select, "-x", "-q", "-p", "ladder.plugin", "-c", "/dev/null", "--rootdir", str(root),
            "--confcutdir", str(root), "-p", "no:cacheprovider", "-p", "no:xdist", "--backend", "cuda",
            "--require-backend", "cuda"]
    env = child_env("cuda", pythonpath=str(root))
    if fault.caught_by != "unit":
        argv = command(find_sanitizer(), fault.caught_by, *argv, print_limit=3)
        env[POOL_VARIABLE] = "0"
    res = subprocess.run(argv, cwd=root, capture_output=True, text=True, env=env, timeout=540)
    return fault, res.returncode, res.stdout + res.stderr


@skip_inside_nested_run
def test_each_planted_kernel_fault_is_caught_where_it_says_naming_the_op(backend, tmp_path):
    if not backend.needs_device:
        pytest.skip("the planted faults are in a device kernel (kernels/cuda)")
    from ladder.tools.sanitizer import ERROR_EXIT, find_sanitizer

    if find_sanitizer() is None:
        pytest.fail("compute-sanitizer not found: two of the planted faults are the sanitizers' to catch")
    with ThreadPoolExecutor(len(FAULTS)) as pool:
        runs = list(pool.map(lambda f: _caught(f, tmp_path), FAULTS))
    missed = []
    for fault, code, out in runs:
        expected = 1 if fault.caught_by == "unit" else ERROR_EXIT
        if code != expected or not re.search(fault.says, out):
            missed.append(f"{fault} (for {fault.caught_by}): exit {code}, expected {expected} and /{fault.says}/;"
                          f" its output ends:\n{out[-1500:]}")
    assert not missed, "\n\n".join(missed)
