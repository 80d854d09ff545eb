"""How many pytest-xdist workers a model-bound rung can hold: workers sized to the model.

A worker of the graph rung holds, for the format it runs, the engine's model (its stored tensors, plus
the KV cache and scratch) and the HF simulation's one float32 copy of the weights (4 bytes a parameter),
on the GPU where the references run there (reference/hf.py `model_device`), on the host otherwise; a
NumPy engine adds its float32 repack (kernels/numpy, at most its budget). A layer-rung worker holds the
three blocks its cases check, dequantized. Every worker also costs its Python, torch and CUDA context.

At the 7B shape one graph worker needs about 37 GB of GPU memory, so four workers (the CUDA backend's
choice for a large model, one per format) would not fit one H200; on the 2-core, 24 GB machine two
workers each holding a Qwen2.5-1.5B-shape simulation and a NumPy engine would not fit its host. So
`nanoqwen ladder` takes, for the layer and graph rungs, the smallest of: the backend's choice, the
workers that fit the GPU's memory, and those that fit the host's available memory; and says what it
chose and why, in one line. A user's explicit `-n` is an upper bound: fewer when more would not fit,
and the line says so.

A small model is cheap to build (a 0.5B-shape model's float32 copy is dequantized onto the GPU in 0.6 s):
below 2 B parameters, with more workers than formats (a host backend on many cores), the layer and graph
rungs' cases of every format spread over every worker (ladder/plugin/groups.py `by_format`,
`small_model`). A device backend keeps its own choice whatever the size (kernels/cuda test_workers:
sixteen workers on one H200 ran a 0.5B-shape model's rungs no faster than four).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ladder.plugin.groups import params_of

GB = 1 << 30
BASE_HOST = 1.5 * GB  # a worker's Python, NumPy, torch and transformers, before any model
BASE_GPU = 1.0 * GB  # a worker's CUDA contexts (CuPy's and torch's) and scratch, before any model
KV_AND_SCRATCH = 1.0 * GB  # the engine's KV cache pages and activations for the graph rung's prompts
USABLE = 0.85  # of a GPU's total memory, or of the host's available memory, that the workers may fill
NUMPY_REPACK = 4 * GB  # kernels/numpy DEFAULT_REPACK_MB: the float32 copies a NumPy engine keeps at most
@dataclass(frozen=True)
class ModelSize:
    params: int  # parameters of the model (its unquantized shapes)
    stored: int  # bytes of the largest of its files' tensors (the engine's copy of one format)
    layer_params: int  # parameters of one decoder layer

    @classmethod
    def of(cls, paths) -> "ModelSize":
        from engine.modelfile import ModelFile

        stored, config = 0, None
        for path in paths:
            with ModelFile(path, verify_checksums=False) as mf:
                stored = max(stored, sum(e.length for e in mf.tensors.values()))
                config = mf.config_dict
        params, layer = params_of(config)
        return cls(params, int(stored), layer)


def host_available() -> int | None:
    """The host's available memory in bytes (/proc/meminfo MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_total(backend: str) -> int | None:
    """The smallest total memory of the backend's devices in bytes (None: not a device backend here).
    Read from the device's properties, which needs no CUDA context in this process. (The one device
    backend, CUDA, is the only one that can say: CuPy asks its devices.)"""
    from kernels import backend_needs_device

    if not backend_needs_device(backend):
        return None
    try:
        import cupy as cp

        n = cp.cuda.runtime.getDeviceCount()
        return min(int(cp.cuda.runtime.getDeviceProperties(i)["totalGlobalMem"]) for i in range(n)) if n else None
    except Exception:  # noqa: BLE001 - no CuPy, no driver: nothing to size against
        return None


def references_on_gpu() -> bool:
    """Whether the HF simulation will run on the GPU (reference/hf.py model_device), decided without
    importing torch: torch is installed, the cuda backend runs here, and nothing forces the host."""
    forced = os.environ.get("NANOQWEN_REFERENCE_DEVICE", "").strip().lower()
    if forced:
        return forced == "cuda"
    if importlib.util.find_spec("torch") is None:
        return False
    from kernels import backend_available

    from kernels import backend_names, backend_needs_device

    return any(backend_needs_device(b) and backend_available(b)[0] for b in backend_names())


@dataclass(frozen=True)
class Need:
    gpu: float  # bytes of GPU memory one worker holds
    host: float  # bytes of host memory one worker holds


def worker_need(size: ModelSize, rung: str, backend: str, refs_on_gpu: bool) -> Need:
    """What one worker of `rung` holds, on the GPU and on the host, for a model of `size`."""
    from kernels import backend_needs_device

    device = backend_needs_device(backend)
    if rung == "graph":
        reference = 4.0 * size.params
        engine = size.stored * 1.05 + KV_AND_SCRATCH
        gpu = (BASE_GPU + engine if device else 0) + (reference if refs_on_gpu else 0)
        host = BASE_HOST + (0 if refs_on_gpu else reference) + (0 if device else min(NUMPY_REPACK, 4.0 * size.params))
        return Need(gpu, host)
    # layer: three blocks dequantized for the reference and their HF decoder layer (a float32 copy each)
    blocks = 3 * 2 * 4.0 * size.layer_params
    return Need(BASE_GPU + 2 * 4.0 * size.layer_params if device else 0, BASE_HOST + blocks)


def fitting(chosen: int, need: Need, gpu: int | None, host: int | None) -> tuple[int, str]:
    """(workers, why): at most `chosen`, as many as fit both memories (at least one)."""
    limits, said = [chosen], []
    if gpu and need.gpu:
        fit = int(USABLE * gpu // need.gpu)
        limits.append(fit)
        said.append(f"{need.gpu / GB:.1f} GB of GPU memory each, of {gpu / GB:.0f} GB")
    if host and need.host:
        fit = int(USABLE * host // need.host)
        limits.append(fit)
        said.append(f"{need.host / GB:.1f} GB of host memory each, of {host / GB:.0f} GB available")
    return max(1, min(limits)), "; ".join(said)


def size_workers(rung: str, chosen: int, model_files, backends, explicit: bool = False) -> tuple[int, str | None]:
    """(workers, the line that says so, or None when there is nothing to say) for a model-bound rung."""
    if rung not in ("layer", "graph") or not model_files:
        return chosen, None
    from kernels import backend_needs_device

    size = ModelSize.of(model_files)
    refs_gpu = references_on_gpu()
    host = host_available()
    best, why = chosen, ""
    for backend in backends:
        need = worker_need(size, rung, backend, refs_gpu and backend_needs_device(backend))
        n, said = fitting(chosen, need, gpu_total(backend), host)
        if n <= best:
            best, why = n, said
    model = f"a model of {size.params / 1e9:.2f} B parameters"
    if explicit:  # the user's -n is an upper bound: a worker killed for memory helps nobody
        if best < chosen:
            return best, (f"nanoqwen: rung {rung}: {best} worker{'s' if best != 1 else ''}, not the {chosen} of -n: "
                          f"more would not fit {model} ({why})")
        return chosen, None
    return best, f"nanoqwen: rung {rung}: {best} worker{'s' if best != 1 else ''} for {model} ({why})"


# --- the rungs side by side ------------------------------------------------------------------------
#
# One after another, each rung's wall time is its longest case and its workers' start, while most of the
# machine waits: on one H200 a 0.5B-shape model's first run took 199 s (unit 67, layer 47, graph 73) with
# 16 cores mostly idle. The three rungs started at once as three ladders (unit on 8 workers, layer and
# graph on 4 each) took 95.5 s together on the same model (bench/NOTES.md, v5). So on a machine with a
# device backend, for a small model whose rungs fit the GPU's and the host's memory together, `nanoqwen
# ladder` runs the rungs side by side; their verdicts and report are what they would be one after another
# (ladder/run/runner.py run_side_by_side). On a host backend the rungs' workers already fill the cores,
# and side by side would only share them.

SIDE_BY_SIDE = "NANOQWEN_SIDE_BY_SIDE"  # on: side by side wherever they fit; off: one after another; unset: auto
SIDE_BY_SIDE_BELOW = 2_000_000_000  # parameters: a larger model's rungs run one after another
UNIT_WORKER = Need(gpu=3.0 * GB, host=3.0 * GB)  # about 2.3 GB of GPU a worker, from the 0.5B first run's peaks by phase
MIN_UNIT_WORKERS = 2


@dataclass(frozen=True)
class SideBySide:
    workers: dict  # rung -> its pytest-xdist workers (a string, as `-n` takes it)
    line: str  # what was chosen and why, for the user


def side_by_side(rungs: list[str], workers: dict, size: "ModelSize | None", backends, cores: int,
                 user_workers: str = "auto") -> tuple[SideBySide | None, str | None]:
    """(the plan, None) when `rungs` (two or more, to run now) go side by side; else (None, why not, or
    None where nothing needs saying). `workers`: the layer and graph rungs' counts as chosen for them
    alone (worker_count); the unit rung takes the cores they leave, at least MIN_UNIT_WORKERS."""
    from kernels import backend_needs_device

    switch = os.environ.get(SIDE_BY_SIDE, "").strip().lower()
    if switch not in ("", "on", "off", "1", "0"):
        raise ValueError(f"{SIDE_BY_SIDE}={switch!r}: expected on or off (unset: where a device backend runs and "
                         "the rungs fit)")
    if len(rungs) < 2 or switch in ("off", "0"):
        return None, None
    forced = switch in ("on", "1")
    device = [b for b in backends if backend_needs_device(b)]
    if not forced and not device:
        return None, None  # a host backend's workers already fill the cores
    plan = {r: str(workers[r]) for r in rungs if r != "unit"}
    if "unit" in rungs:
        others = sum(int(w) for w in plan.values() if w.isdigit())
        plan["unit"] = user_workers if user_workers != "auto" else str(max(MIN_UNIT_WORKERS, cores - others))
    model = "the default model" if size is None else f"a model of {size.params / 1e9:.2f} B parameters"
    if not forced:
        if size is not None and size.params >= SIDE_BY_SIDE_BELOW:
            return None, None
        gpu_need, host_need, refs_gpu = 0.0, 0.0, references_on_gpu()
        for rung, n in plan.items():
            n = int(n) if n.isdigit() else cores
            need = UNIT_WORKER if rung == "unit" or size is None else worker_need(size, rung, device[0], refs_gpu)
            gpu_need, host_need = gpu_need + n * need.gpu, host_need + n * need.host
        gpu, host = gpu_total(device[0]), host_available()
        short = [f"{what}: {need / GB:.0f} GB of {have / GB:.0f}" for what, need, have in
                 (("GPU", gpu_need, gpu), ("host", host_need, host)) if have and need > USABLE * have]
        if short:
            return None, (f"nanoqwen: rungs {', '.join(rungs)} one after another: side by side they would not fit "
                          f"{model} ({'; '.join(short)})")
    if all(plan[r] == "0" for r in rungs):
        order = f"{', '.join(rungs[:-1])} and {rungs[-1]} each in one process"
    else:
        order = ", ".join(f"{r} on {plan[r]} worker{'s' if plan[r] != '1' else ''}" for r in rungs)
    why = f"{SIDE_BY_SIDE}=on" if forced else f"{model} on {device[0]}: they fit the GPU's and the host's memory together"
    return SideBySide(plan, f"nanoqwen: rungs side by side ({order}; {why}); each is judged as one after another, and "
                            f"{SIDE_BY_SIDE}=off runs them so"), None
