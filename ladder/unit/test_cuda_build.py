"""CPU-side guards for the CUDA backend: every `.cu` compiles for sm_90a, every entry point that declares
no `__launch_bounds__` uses few enough registers for any block (ptxas's report), every launcher's
kernels exist, and the CPU path never imports CuPy.

The compile test feeds nvcc exactly the text the loader gives NVRTC (the folder's headers inlined by
kernels/cuda/loader.py), so a kernel that does not compile fails here, on a machine without a GPU,
before it can land. It skips, with the reason, where nvcc is absent. The launcher tests read each
format's launcher (kernels/cuda/<format>.py) through kernels/cuda/catalog.py, from its source: every
GEMV variant it ships names an entry point of its `.cu` for every op, and every format has a launcher.
The launch tests hold the loader's reading of which kernels wait for their predecessor (programmatic
dependent launch, kernels/cuda/common.cuh): every kernel of a decode step does, and a kernel that does
not wait is never taken for one that does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ladder.changes.sources import cuda_module

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "kernels" / "cuda"


LOADER = cuda_module("loader")  # by file path: importing kernels.cuda would import CuPy
CATALOG = cuda_module("catalog")


def test_every_cu_file_is_a_loaded_module():
    on_disk = sorted(p.stem for p in CUDA_DIR.glob("*.cu"))
    assert on_disk == sorted(LOADER.MODULES), "kernels/cuda/loader.py MODULES must list every .cu file"


def test_entry_point_names_are_unique_across_modules():
    assert not LOADER.duplicate_entry_points(), "the loader hands out kernels by name: one name, one module"


def test_every_header_a_module_includes_is_inlined_once():
    for module in LOADER.MODULES:
        src = LOADER.source(module)
        left = re.findall(r'^[ \t]*#include[ \t]+"[^"]+"', src, flags=re.M)
        assert not left, f"{module}.cu: {left} left for NVRTC to find (only this folder's headers are inlined)"
        for header in CUDA_DIR.glob("*.cuh"):
            assert src.count(f"// ---- {header.name} (inlined") <= 1, f"{module}.cu: {header.name} inlined twice"


def test_every_format_has_a_cuda_launcher():
    from engine.formats import FORMAT_MODULES

    assert sorted(CATALOG.launchers()) == sorted(FORMAT_MODULES), \
        "every format of engine/formats needs kernels/cuda/<format>.py with LINEAR (and nothing else assigns LINEAR)"


@pytest.mark.reads_source("kernels/cuda/*.cu", "kernels/cuda/*.py")
@pytest.mark.parametrize("fmt", sorted(CATALOG.launchers()))
def test_every_shipped_gemv_variant_is_an_entry_point_of_its_format(fmt):
    info = CATALOG.launchers()[fmt]
    assert (CUDA_DIR / f"{fmt}.cu").is_file(), f"the launcher kernels/cuda/{fmt}.py has no {fmt}.cu"
    names = set(LOADER.entry_points(fmt))
    missing = [CATALOG.gemv_kernel_name(info["gemv_kernel"], op, v)
               for v in info["variants"] for op in CATALOG.LINEAR_OPS
               if CATALOG.gemv_kernel_name(info["gemv_kernel"], op, v) not in names]
    assert not missing, f"{fmt}.cu lacks the GEMV entry points its launcher names: {missing}"


# An entry point: `extern "C" __global__ void [__launch_bounds__(N)] NAME(params) { TEMPLATE<ARGS>(...`.
_ENTRY = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\((\d+)\)\s+)?(\w+)\s*\([^)]*\)\s*\{\s*'
                    r'(\w+)<([^>]*)>\s*\(', re.S)


def _entry_points(module: str) -> dict[str, tuple[int | None, str, list[str]]]:
    """name -> (launch bounds or None, the template it calls, that call's template arguments)."""
    text = (CUDA_DIR / f"{module}.cu").read_text()
    return {m[2]: (int(m[1]) if m[1] else None, m[3], [a.strip() for a in m[4].split(",")])
            for m in _ENTRY.finditer(text)}


def _promised(variant: str) -> tuple[int, tuple[int, int]]:
    """What a variant's name promises, read here on its own: (threads per block, the two numbers of the
    name as the kernel template takes them): t<threads>_r<R> and f<threads>_r<R> -> (threads, (threads, R));
    tc_w<warps>_u<U> -> (32 x warps, (warps, U))."""
    m = re.fullmatch(r"(?:[tf](\d+)_r(\d+)|tc_w(\d+)_u(\d+))", variant)
    assert m, f"variant {variant!r} is not t<threads>_r<R>, f<threads>_r<R> or tc_w<warps>_u<U>"
    if m[1]:
        return int(m[1]), (int(m[1]), int(m[2]))
    return 32 * int(m[3]), (int(m[3]), int(m[4]))


@pytest.mark.reads_source("kernels/cuda/*.cu", "kernels/cuda/*.py")
@pytest.mark.parametrize("fmt", sorted(CATALOG.launchers()))
def test_each_gemv_entry_point_is_built_as_its_name_promises(fmt):
    """Threads and rows per block come from a variant's name, at launch (catalog.variant_geometry) and in
    the entry point's `__launch_bounds__` and template arguments: all three must agree. A block launched
    with more threads than its bounds fails to launch; a template with other threads or rows than the
    launch computes rows the grid does not cover, or covers some twice, and only some shapes show it."""
    info = CATALOG.launchers()[fmt]
    entries = _entry_points(fmt)
    for variant in info["variants"]:
        threads, numbers = _promised(variant)
        for op in CATALOG.LINEAR_OPS:
            name = CATALOG.gemv_kernel_name(info["gemv_kernel"], op, variant)
            assert name in entries, f"{fmt}.cu: no entry point {name} calling a template (the parse found {sorted(entries)[:4]}...)"
            bounds, template, args = entries[name]
            assert CATALOG.variant_geometry(variant, op == "gate_up_silu")[0] == threads, (
                f"kernels/cuda/catalog.py variant_geometry launches {variant} with other than {threads} threads")
            assert bounds == threads, f"{fmt}.cu {name}: __launch_bounds__({bounds}), its name promises {threads} threads"
            epi = "EPI_" + CATALOG.EPILOGUE[op].upper()
            assert epi in args, f"{fmt}.cu {name}: {template}<{', '.join(args)}> has not the epilogue {epi} its name says"
            after = args[args.index(epi) + 1:]
            assert [int(a) for a in after] == list(numbers), (
                f"{fmt}.cu {name}: {template}<{', '.join(args)}> takes {', '.join(after)} after the epilogue, "
                f"its name promises {numbers[0]}, {numbers[1]}")


def test_the_entry_point_parse_reads_every_bounded_entry_point():
    """The parse above must not quietly find nothing: every `__launch_bounds__` entry point of the GEMV
    modules calls one template, and the parse reads each of them."""
    for fmt in CATALOG.launchers():
        text = (CUDA_DIR / f"{fmt}.cu").read_text()
        bounded = re.findall(r'extern "C" __global__ void\s+__launch_bounds__\(\d+\)\s+(\w+)', text)
        parsed = _entry_points(fmt)
        assert bounded and all(name in parsed for name in bounded), sorted(set(bounded) - set(parsed))


@pytest.mark.parametrize("module", LOADER.MODULES)
def test_cu_compiles_for_sm90(module, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: cannot compile the CUDA kernels on this machine")
    assert LOADER.entry_points(module), f"{module}.cu has no extern \"C\" __global__ entry point"
    src = tmp_path / f"{module}.cu"
    src.write_text(LOADER.source(module))
    arch = next(o for o in LOADER.OPTIONS if o.startswith("--gpu-architecture=")).split("=", 1)[1]
    std = next(o for o in LOADER.OPTIONS if o.startswith("-std="))
    cmd = [nvcc, f"-arch={arch}", std, "--ptx", "-Werror", "all-warnings", str(src), "-o", str(tmp_path / f"{module}.ptx")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"nvcc failed on {module}.cu ({' '.join(cmd)}):\n{res.stderr}"
    ptx = (tmp_path / f"{module}.ptx").read_text()
    for name in LOADER.entry_points(module):
        assert f".entry {name}(" in ptx, f"entry point {name} missing from the PTX of {module}.cu"
    _every_unbounded_entry_point_fits_any_block(module, tmp_path / f"{module}.ptx", arch)


REGISTER_FILE = 65536  # 32-bit registers an SM (and a block) has on sm_90
MAX_BLOCK = 1024


def _every_unbounded_entry_point_fits_any_block(module: str, ptx: Path, arch: str) -> None:
    """An entry point without `__launch_bounds__` may be launched with up to MAX_BLOCK threads; ptxas
    does not know the block, so past REGISTER_FILE / MAX_BLOCK registers a thread such a launch fails on
    the GPU alone ("too many resources requested for launch"). A kernel that needs more declares its
    bounds, which ptxas then keeps. Read from ptxas's own report of the module's PTX."""
    ptxas = shutil.which("ptxas") or str(Path(shutil.which("nvcc")).with_name("ptxas"))
    res = subprocess.run([ptxas, f"-arch={arch}", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"ptxas failed on {module}.cu:\n{res.stderr}"
    used, entry = {}, None
    for line in res.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            entry = m.group(1)
        elif (m := re.search(r"Used (\d+) registers", line)) and entry:
            used[entry], entry = int(m.group(1)), None
    # each entry point's attributes (`__launch_bounds__(N)`, `__cluster_dims__(X, Y, Z)`) as the loader reads them
    for name, attributes in LOADER.entry_attributes(module).items():
        assert name in used, f"ptxas reported no registers for {name} ({module}.cu)"
        if "__launch_bounds__" not in attributes:
            assert used[name] * MAX_BLOCK <= REGISTER_FILE, (
                f"{module}.cu: {name} uses {used[name]} registers a thread and declares no __launch_bounds__: "
                f"a block of {MAX_BLOCK} threads would not launch; declare the block it is launched with")


def test_cpu_path_does_not_import_cupy():
    code = (
        "import sys, importlib\n"
        "for m in ('engine', 'engine.model', 'engine.block', 'engine.kv_cache', 'kernels', 'kernels.numpy'):\n"
        "    importlib.import_module(m)\n"
        "for m in ('engine.cli', 'engine.cuda_graph'):\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name != m: raise\n"
        "import kernels\n"
        "kernels.get_backend('numpy')\n"
        "bad = sorted(m for m in sys.modules if m == 'cupy' or m.startswith('cupy.') or m == 'kernels.cuda')\n"
        "assert not bad, f'imported on the CPU path: {bad}'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# every kernel a decode step launches, besides the GEMVs (kernels/cuda/__init__.py, engine/cuda_graph.py)
DECODE_STEP_KERNELS = ("embed_f16_f32", "rmsnorm_f32_f16", "rope_kv_write_f16", "paged_attention_f16",
                       "paged_attention_warp_d64", "paged_attention_warp_d128", "paged_attention_tc_d64",
                       "paged_attention_tc_d128", "paged_attention_tc_cluster_d64", "paged_attention_tc_cluster_d128",
                       "attention_combine_f16", "lm_head_f16_f32", "argmax_partial_f32", "argmax_f32_i32",
                       "decode_advance_i32")


def test_every_kernel_of_a_decode_step_waits_for_its_predecessor():
    """The loader overlaps a kernel with its predecessor only when the kernel waits for it: each kernel
    of a decode step (every GEMV variant of every format, and the others) must, or it loses the overlap."""
    waiting = set().union(*(LOADER.waiting_entry_points(m) for m in LOADER.MODULES))
    gemvs = {CATALOG.gemv_kernel_name(info["gemv_kernel"], op, variant)
             for info in CATALOG.launchers().values() for variant in info["variants"] for op in CATALOG.LINEAR_OPS}
    missing = sorted((gemvs | set(DECODE_STEP_KERNELS)) - waiting)
    assert not missing, f"decode-step kernels that never call pdl_wait(): {missing}"


def test_only_a_kernel_that_calls_pdl_wait_is_launched_early():
    """Through a chain of device functions it counts; in a comment, or in a function the kernel does not
    call, it does not. An entry point's name is read past its attributes (bounds, cluster dimensions)."""
    src = """
    __device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
    template <int N> __device__ __forceinline__ void inner(float* y) { pdl_wait(); y[0] = N; }
    __device__ __forceinline__ void outer(float* y) { inner<3>(y); }
    __device__ __forceinline__ void plain(float* y) { y[0] = 1.0f; }
    extern "C" __global__ void through_a_chain(float* y) { outer(y); }
    extern "C" __global__ void __launch_bounds__(64) directly(float* y) { if (y) { pdl_wait(); } y[1] = 0; }
    extern "C" __global__ void only_a_comment(float* y) {  // pdl_wait() here would be too late
        plain(y);
    }
    extern "C" __global__ void never(float* y) { plain(y); }
    extern "C" __global__ void __launch_bounds__(64) __cluster_dims__(1, 1, 2) clustered(float* y) { outer(y); }
    """
    assert LOADER.waiting_in(src) == {"through_a_chain", "directly", "clustered"}
