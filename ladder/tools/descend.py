"""`nanoqwen descend`: walk down the ladder to the first diverging layer, then to the diverging op.

1. The HF simulation runs the prompt once; hooks catch every decoder layer's input and output.
2. Layer by layer, the engine's block runs on the *simulation's* input to that layer (a prefill, then
   the last tokens as decode steps across a page edge), so an error cannot be inherited from the layer
   before. Its output is compared with the simulation's, against the floor of the plain
   implementation (`reference.model.ref_block`, fp32 with fp16 storage) on the same input:
   TOL[("layer", "float32")] decides. The first layer over its bound is where the engine diverges.
3. In every layer, every op call is recorded (inputs before, outputs after) and checked on its own
   real activations against its `ref_*` in float64, with the unit rung's tolerance. The first layer
   whose output or one of whose ops is over its bound is reported, with its ops: the first op over
   its bound is the kernel to look at (an op can be wrong by less than a layer's fp16 noise, as fp16
   accumulation is, and still be found here).

It checks every backend this machine can run, in turn (`--backend B` picks one): a red CUDA night must
not be descended on NumPy alone, where a CUDA-only bug cannot show. The model is the default model or a
Hugging Face folder converted to `--quant FORMAT` (default int4_sym_g128), or a .nanoqwen file in its
own format (another `--quant` is refused: one line, exit 2), so the ladder's
`nanoqwen descend --backend B --quant F [--model M]` descends exactly what went red.

Prints a table per layer and per op for each backend, writes descend.json (each backend's descent, and
the backends that diverge) and, where matplotlib exists, descend-BACKEND.png (error per layer as a
multiple of its floor). Exit status 0 when nothing diverges on any backend checked, 1 when something
does, 2 for bad input. `--plant-fault` shows it at work on a known bug.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.config import PAGE_SIZE
from engine.errors import NanoqwenError, one_line
from engine.model import checked_config
from engine.modelfile import ModelFile
from fixtures.dequantized import dequantized_weights
from fixtures.layer_cases import LayerCase
from ladder.checks.blockrun import run_engine_block
from ladder.checks.opcheck import Check, Recorder, check, first_op_over_its_bound, op_checks  # noqa: F401 (Check: the API)
from reference.model import ref_block

F16, F32 = np.float16, np.float32
PAGE = PAGE_SIZE


# --- the walk -----------------------------------------------------------------------------------


def descend(model_path, ids, backend_name: str = "numpy", decode_steps: int | None = None,
            plant_fault: str | None = None, progress=None) -> dict:
    from kernels import get_backend
    from reference.hf import hf_layer_states, hf_model

    progress = progress or _say
    progress(f"descend: reading {model_path} and dequantizing its weights")
    mf = ModelFile(model_path)
    config = checked_config(mf)  # the config against the tensor table: a bad file is a typed error here
    hf_cfg, weights = dequantized_weights(model_path)
    ids = [int(t) for t in ids]
    T = len(ids)
    steps = min(PAGE + 1, T - 1) if decode_steps is None else min(decode_steps, T - 1)
    backend = get_backend(backend_name)
    if plant_fault:
        from ladder.checks.faults import plant

        plant(backend, plant_fault)
    recorder = Recorder(backend)

    progress(f"descend: {Path(model_path).name} ({mf.quant}), prompt of {T} tokens (prefill {T - steps}, then {steps} "
             f"decode steps), backend {backend_name}" + (f", planted fault {plant_fault}" if plant_fault else ""))
    progress("descend: running the HF simulation (transformers, float32) to record every layer's input and output")
    states = hf_layer_states(hf_model(hf_cfg, weights), ids)
    progress(f"descend: {len(states)} layers, each on the simulation's input to it")
    layers, ops_by_layer, first = [], [], None
    for layer, (x_in, ref_out) in enumerate(states):
        case = LayerCase(layer=layer, L=T - steps, steps=steps, seed=0)
        recorder.calls, recorder.on = [], True
        try:
            out, _, _ = run_engine_block(backend, config, mf.quant, mf.expect, case, shuffle_seed=layer, x=x_in)
        finally:
            recorder.on = False
        plain, _, _ = ref_block(hf_cfg, weights, layer, x_in, np.arange(T), dtype=F32, storage=F16)
        c = check(f"layer {layer}", out, ref_out, plain, ("layer", "float32"))
        ops = op_checks(recorder.calls, config, weights, layer)
        bad_ops = sorted({o.name for o in ops if o.diverged})
        layers.append(c)
        ops_by_layer.append(ops)
        progress(f"  layer {layer:>3}: max abs error {c.max_abs:.3g}, floor {c.floor:.3g}, {c.multiple:.3g}x"
                 + ("  <- diverges" if c.diverged else "")
                 + (f"  (ops over their own bound: {', '.join(bad_ops)})" if bad_ops else ""))
        if first is None and (c.diverged or bad_ops):
            first = layer
    ops = ops_by_layer[first] if first is not None else []
    first_op = first_op_over_its_bound(ops)
    return {"model": str(model_path), "quant": mf.quant, "backend": backend_name, "prompt_len": T, "decode_steps": steps,
            "plant_fault": plant_fault, "layers": [c.as_dict() for c in layers], "first_layer": first,
            "layer_diverged": bool(first is not None and layers[first].diverged),
            "ops": [c.as_dict() for c in ops], "first_op": first_op.name if first_op else None}


def _say(message: str) -> None:
    print(message, flush=True)  # each phase as it starts, also when stdout is a pipe or a file


def print_report(result: dict) -> None:
    if result["first_layer"] is None:
        print("verdict: every layer and every op within its bound; the engine follows the HF simulation")
        return
    print(f"\nops of layer {result['first_layer']} (each call on its own recorded inputs):")
    worst: dict[str, dict] = {}
    first_bad: dict[str, int] = {}
    for c in result["ops"]:
        if c["name"] not in worst or c["multiple"] > worst[c["name"]]["multiple"]:
            worst[c["name"]] = c
        if c["diverged"]:
            first_bad.setdefault(c["name"], c["call"])
    for name, c in worst.items():
        flag = f"  <- diverges (first at call {first_bad[name]})" if name in first_bad else ""
        print(f"  {name:<36} worst {c['multiple']:.3g}x its floor{flag}")
    how = "" if result["layer_diverged"] else " (the layer's output stays within its bound; an op does not)"
    print(f"verdict: first diverging layer {result['first_layer']}{how}, first diverging op "
          f"{result['first_op'] or '(none alone: the layer diverges only as a whole)'}")


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    mult = [min(c["multiple"], 1e6) for c in result["layers"]]
    bounds = [c["bound"] / c["floor"] if c["floor"] else float("nan") for c in result["layers"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.semilogy(range(len(mult)), mult, "o-", label="engine error / noise floor")
    ax.semilogy(range(len(bounds)), bounds, "--", label="bound / noise floor")
    if result["first_layer"] is not None:
        ax.axvline(result["first_layer"], color="red", alpha=0.3, label=f"first diverging layer {result['first_layer']}")
    ax.set_xlabel("layer")
    ax.set_ylabel("multiple of the floor")
    ax.set_title(f"descend: {Path(result['model']).name} ({result['quant']}) on {result['backend']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


class DescendArgumentError(NanoqwenError):
    """A `nanoqwen descend` argument that names nothing usable (one line, exit 2)."""


def model_for(spec: str | None, quant: str | None) -> tuple[Path, str]:
    """(the .nanoqwen file to descend, its format): the default model or an HF folder converted to `quant`
    (None: the default format), or a .nanoqwen file as it is, which must then be in `quant` when one is given."""
    from engine.formats import DEFAULT_FORMAT, FORMATS
    from engine.resolve import resolve_model

    if quant is not None and quant not in FORMATS:
        raise DescendArgumentError(f"--quant {quant}: unknown format; known: {', '.join(sorted(FORMATS))}")
    if spec is not None and not Path(spec).is_dir():
        with ModelFile(spec) as mf:  # a missing or malformed file is its own typed error here
            own = mf.quant
        if quant not in (None, own):  # a file's weights are already rounded: it cannot become another format
            raise DescendArgumentError(f"--model {spec} is quantized as {own}, not {quant}; give its Hugging Face "
                                       f"folder to descend in {quant}, or leave --quant out to descend in {own}")
        return Path(spec), own
    return resolve_model(spec, quant or DEFAULT_FORMAT), quant or DEFAULT_FORMAT


def backends_to_check(chosen: str | None) -> tuple[list[str], list[str]]:
    """The backends to descend on, in turn: `chosen`, else every one this machine can run; and those left
    out, each with the reason it cannot run here."""
    from kernels import backend_available, backend_names

    if chosen:
        ok, why = backend_available(chosen)
        if not ok:
            raise DescendArgumentError(f"--backend {chosen} cannot run on this machine: {one_line(why)}")
        return [chosen], []
    run, left_out = [], []
    for name in backend_names():
        ok, why = backend_available(name)
        if ok:
            run.append(name)
        else:
            left_out.append(f"{name} ({one_line(why, 120)})")
    return run, left_out


def cmd_descend(args) -> int:
    from engine.outpath import check_output_folder
    from engine.resolve import prompt_ids

    out = check_output_folder(args.report)  # refused before the descent, not after it
    path, quant = model_for(args.model, args.quant)
    backends, left_out = backends_to_check(args.backend)
    ids, _ = prompt_ids(path, None if args.prompt_ids else args.prompt, args.prompt_ids)
    if len(ids) < 2:
        raise SystemExit("nanoqwen: error: descend needs a prompt of at least 2 tokens (a prefill and a decode step)")
    out.mkdir(parents=True, exist_ok=True)
    print(f"descend: checking backend{'s' if len(backends) > 1 else ''} {', '.join(backends)} in format {quant}"
          + (f"; not {'; '.join(left_out)}: cannot run here" if left_out else ""), flush=True)
    results, charts = {}, []
    for i, name in enumerate(backends, 1):
        print(f"\ndescend: backend {name} ({i} of {len(backends)})", flush=True)
        result = descend(path, ids, name, args.decode_steps, args.plant_fault)
        print_report(result)
        results[name] = result
        if plot(result, out / f"descend-{name}.png"):
            charts.append(out / f"descend-{name}.png")
    diverged = [name for name, r in results.items() if r["first_layer"] is not None]
    summary = {"model": str(path), "quant": quant, "checked": backends, "not_checked": left_out,
               "diverged": diverged, "backends": results}
    (out / "descend.json").write_text(json.dumps(summary, indent=1, default=str))
    if len(backends) > 1:
        print(f"\nverdict over {len(backends)} backends: " + (f"diverges on {', '.join(diverged)}" if diverged
                                                               else "none diverges"))
    print(f"wrote {out / 'descend.json'}" + (f" and {', '.join(map(str, charts))}" if charts else
                                               " (no matplotlib: no chart)"))
    return 1 if diverged else 0


DEFAULT_PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    a, b = 0, 1\n    for _ in range(n):\n"
                  "        a, b = b, a + b\n    return a\n")


def register(subparsers) -> None:
    from kernels import backend_names  # the registry: a new backend needs no edit here

    from engine.cli import non_negative_int, renamed, token_ids_arg
    from engine.formats import DEFAULT_FORMAT

    d = subparsers.add_parser("descend", help="walk down to the first layer, then the first op, where the engine "
                                              "leaves the HF simulation")
    d.add_argument("--model", help=".nanoqwen file or Hugging Face folder (default: the embedded default model)")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: a short Python function)")
    src.add_argument("--prompt-ids", type=token_ids_arg, help="comma-separated token ids")
    d.add_argument("--backend", choices=backend_names(),
                   help="the backend to descend on (default: every backend this machine can run, in turn)")
    d.add_argument("--quant", metavar="FORMAT",
                   help=f"weight format: the default model or an HF folder is converted to it (default "
                        f"{DEFAULT_FORMAT}); a .nanoqwen file runs in its own, and another FORMAT is refused")
    d.add_argument("--decode-steps", type=non_negative_int,
                   help="how many of the last prompt tokens run as decode steps (default 17: across a page edge)")
    d.add_argument("--plant-fault", help="plant a fault from ladder/checks/faults.py first (to see the descent find it)")
    d.add_argument("--report", default="reports/descend", metavar="DIR", help="folder for descend.json and descend-BACKEND.png")
    renamed(d, "--out", new="--report")
    d.set_defaults(func=cmd_descend)
