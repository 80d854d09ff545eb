"""`nanoqwen quant-report`: how far each quantization format moves a model from its fp16 self.

    nanoqwen quant-report [--quant a,b|all] [--models default,seeded] [--seeded-shape NAME]
                          [--windows N] [--window T] [--seed S] [--tied-head] [--report DIR]

This judges the formats' numbers, not their kernels. For each model and each format, the quantized
model is the fp16 model with every linear (q/k/v/o, gate/up/down) replaced by the format's own round
trip, `fmt.dequantize(fmt.quantize(W))` (engine/formats; the embeddings, norms, biases and lm_head stay
fp16, as in a converted file). Both it and the fp16 baseline (the stored fp16 values as float32) run
through the HF simulation (reference/hf.py, transformers' Qwen2 in float32) on the same held-out token
windows, teacher-forced, every window a fresh sequence at position 0 (fixtures/eval_tiny_coder.py's
windows). Over every position of every window:

- top-1 agreement: the fraction of positions where the quantized model's argmax is the fp16 model's;
- mean KL: KL(p_fp16 || p_quant) of the next-token distributions, in nats, averaged over positions;
- perplexity: exp of the quantized model's mean next-token loss on the held-out targets, and its change
  against the fp16 model's, absolute and in percent;
- bytes per weight: the format's stored bytes (scales and zero points included) over the model's
  linears, weighted by their sizes (`Format.bytes_per_weight`);
- GEMV at the 7B shape: on a machine where the cuda backend runs, the format's decode GEMV time over
  the four quantized ops of a Qwen2.5-Coder-7B layer and its multiple of the bandwidth floor
  (ladder/tools/gemv_timing.py, which `python -m bench.format_gemv` runs too: `gemv_times` and its `summary`,
  both kept in the JSON); elsewhere "no GPU".

The models: `default` is the trained tiny coder on its held-out files (in its own tokens); `seeded` is
the seeded random model (fixtures/tiny_model.py) at `--seeded-shape` (default the Qwen2.5-0.5B shape),
on the same held-out files in the seeded model's own tokenizer. A random model's perplexity on code
means nothing by itself; its change under quantization, the KL and the agreement do.

A shape with a tied lm_head (Qwen2.5-0.5B's) is measured with its own lm_head unless `--tied-head`: the
generator's embedding has unit scale, so as the head it gives logits of standard deviation about
sqrt(hidden) (30 at hidden 896, top-1 margins of hundreds of nats), every next-token distribution is
one-hot and no format can move it (KL at fp64 rounding, agreement 1). Untied, the generator draws the
same embedding and layers and adds a head with logits of standard deviation about 4; the quantized
linears are the shape's own either way, and the head is never quantized.

Prints one table per model (formats sorted by KL, the fp16 baseline first), writes quant_report.json
and, where matplotlib exists, quant_report.png under `--report`. Progress goes to stderr. The columns, how
to run it and the measured tables: docs/QUANT_REPORT.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MODELS = {"default": "the trained tiny coder on its held-out files",
          "seeded": "the seeded random model at --seeded-shape, on the held-out files in its own tokenizer"}
DEFAULT_SEEDED_SHAPE = "qwen2.5-0.5b"
GEMV_SHAPE = "qwen2.5-coder-7b"
DEFAULT_WINDOWS = 8
DEFAULT_WINDOW = 256
BATCH = 4  # windows of equal length run through the HF model as one batch
COLUMNS = {
    "top1_agreement": "fraction of positions where the quantized model's argmax equals the fp16 model's",
    "kl_mean": "mean over positions of KL(p_fp16 || p_quant) of the next-token distribution, nats",
    "perplexity": "exp(mean next-token loss) of the quantized model on the held-out targets",
    "ppl_change": "perplexity minus the fp16 model's perplexity",
    "ppl_change_pct": "ppl_change as a percentage of the fp16 model's perplexity",
    "bytes_per_weight": "stored bytes per weight over the model's linears, size-weighted, scales and zeros included",
    "gemv_7b": f"decode GEMV time over the four quantized ops of a {GEMV_SHAPE} layer and its multiple of the "
               f"bandwidth floor (ladder.tools.gemv_timing.summary; cuda only, else 'no GPU')",
}


# --- the metrics ----------------------------------------------------------------------------------


@dataclass
class Tally:
    """Running sums over positions of the quantized model against the fp16 model."""

    positions: int = 0
    agree: int = 0
    kl: float = 0.0
    nll_fp16: float = 0.0
    nll_quant: float = 0.0

    def add(self, ref: np.ndarray, quant: np.ndarray, targets: np.ndarray) -> "Tally":
        """Add one window: fp32 logits [T, V] of the fp16 (`ref`) and the quantized model, targets [T]."""
        from fixtures.eval_tiny_coder import log_softmax

        lp, lq = log_softmax(ref), log_softmax(quant)
        rows = np.arange(len(targets))
        self.positions += len(targets)
        self.agree += int((ref.argmax(axis=1) == quant.argmax(axis=1)).sum())
        self.kl += float((np.exp(lp) * (lp - lq)).sum())
        self.nll_fp16 -= float(lp[rows, targets].sum())
        self.nll_quant -= float(lq[rows, targets].sum())
        return self

    def figures(self) -> dict:
        n = max(self.positions, 1)
        ppl_fp16, ppl = math.exp(self.nll_fp16 / n), math.exp(self.nll_quant / n)
        return {"positions": self.positions, "top1_agreement": self.agree / n, "kl_mean": self.kl / n,
                "perplexity": ppl, "fp16_perplexity": ppl_fp16, "ppl_change": ppl - ppl_fp16,
                "ppl_change_pct": 100.0 * (ppl - ppl_fp16) / ppl_fp16}


def compare_logits(ref: np.ndarray, quant: np.ndarray, targets: np.ndarray) -> dict:
    """The figures of one window's logits [T, V] against the fp16 model's (see `Tally`)."""
    return Tally().add(ref, quant, targets).figures()


def linear_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of every quantized linear of the model."""
    from engine.weights import linear_names

    return [s for layer in range(config.num_hidden_layers) for s in linear_names(config, layer).values()]


def bytes_per_weight(fmt, config) -> float:
    """The format's stored bytes per weight over the model's linears, weighted by their sizes."""
    shapes = linear_shapes(config)
    return sum(fmt.bytes_per_weight(o, i) * o * i for o, i in shapes) / sum(o * i for o, i in shapes)


# --- the models -----------------------------------------------------------------------------------


@dataclass
class Subject:
    """One model under test: its config, its fp16 weights (as float32) and its held-out windows."""

    key: str
    label: str
    cfg_dict: dict
    config: object
    weights: dict
    windows: list = field(default_factory=list)


def default_subject(window: int, max_windows: int) -> Subject:
    from fixtures import tiny_coder
    from fixtures.eval_tiny_coder import fp16_weights, windows

    folder = tiny_coder.trained_model_dir()
    return Subject("default", "default model (the trained tiny coder)", json.loads((folder / "config.json").read_text()),
                   tiny_coder.config(), fp16_weights(folder), windows(window, max_windows))


def seeded_subject(shape: str, seed: int, window: int, max_windows: int, tied_head: bool = False) -> Subject:
    from tokenizers import Tokenizer

    from engine.config import SHAPES, Qwen2Config
    from fixtures.eval_tiny_coder import fp16_weights, heldout_stream, windows
    from fixtures.tiny_model import random_model_dir

    config = SHAPES[shape]
    untie = config.tie_word_embeddings and not tied_head
    folder = random_model_dir(seed, config.replace(tie_word_embeddings=False) if untie else config)
    cfg_dict = json.loads((folder / "config.json").read_text())
    stream = heldout_stream(Tokenizer.from_file(str(folder / "tokenizer.json")), cfg_dict["eos_token_id"])
    label = f"seeded model (shape {shape}{', its own lm_head' if untie else ''}, seed {seed})"
    return Subject("seeded", label, cfg_dict,
                   Qwen2Config.from_hf_dict(cfg_dict), fp16_weights(folder), windows(window, max_windows, stream))


def window_logits(model, ws):
    """Yield (index, fp32 logits [T, V]) of each window, windows of equal length batched."""
    import torch

    i = 0
    while i < len(ws):
        j = i + 1
        while j < len(ws) and j - i < BATCH and len(ws[j][0]) == len(ws[i][0]):
            j += 1
        with torch.no_grad():
            ids = torch.from_numpy(np.stack([x for x, _ in ws[i:j]]))
            out = model(ids, use_cache=False).logits.float().numpy()
        for k in range(j - i):
            yield i + k, out[k]
        i = j


def measure_model(subject: Subject, formats: list, progress) -> dict:
    """The figures of every format on one model (and the fp16 baseline's perplexity)."""
    from fixtures.eval_tiny_coder import fake_quantized
    from reference.hf import hf_model

    ws = subject.windows
    tokens = int(sum(len(y) for _, y in ws))
    t0 = time.perf_counter()
    progress(f"{subject.key}: fp16 baseline on {len(ws)} windows ({tokens} positions)")
    ref = [logits for _, logits in window_logits(hf_model(subject.cfg_dict, subject.weights), ws)]
    base = Tally()
    for (_, y), r in zip(ws, ref):
        base.add(r, r, y)
    rows = {}
    for fmt in formats:
        t1 = time.perf_counter()
        progress(f"{subject.key}: {fmt.name}: quantizing {len(linear_shapes(subject.config))} linears, then the windows")
        model = hf_model(subject.cfg_dict, fake_quantized(subject.weights, subject.config, fmt))
        tally = Tally()
        for i, logits in window_logits(model, ws):
            tally.add(ref[i], logits, ws[i][1])
        del model
        rows[fmt.name] = {"describes": fmt.describes, **tally.figures(),
                          "bytes_per_weight": bytes_per_weight(fmt, subject.config)}
        r = rows[fmt.name]
        progress(f"{subject.key}: {fmt.name}: KL {r['kl_mean']:.3g}, top-1 {r['top1_agreement']:.4f}, "
                 f"ppl {r['perplexity']:.4g} ({r['ppl_change_pct']:+.2f}%) [{time.perf_counter() - t1:.0f}s]")
    c = subject.config
    return {"label": subject.label, "shape": {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                                              "num_hidden_layers": c.num_hidden_layers, "vocab_size": c.vocab_size},
            "windows": len(ws), "window": max((len(x) for x, _ in ws), default=0), "positions": tokens,
            "fp16": {"perplexity": base.figures()["fp16_perplexity"], "bytes_per_weight": 2.0},
            "formats": rows, "seconds": round(time.perf_counter() - t0, 1)}


# --- the GPU column -------------------------------------------------------------------------------


def gemv_column(names: list[str], progress=None) -> dict:
    """On a machine where the cuda backend runs: ladder/tools/gemv_timing.py's rows for `names` at the 7B shape
    (one per format and op) and its per-format summary over the four ops; elsewhere the reason."""
    from kernels.base import backend_available

    ok, why = backend_available("cuda")
    if not ok:
        return {"available": False, "why": why, "shape": GEMV_SHAPE, "rows": [], "summary": {}}
    from ladder.tools.gemv_timing import gemv_times, summary

    rows = gemv_times(formats=list(names), shape=GEMV_SHAPE, progress=progress)
    return {"available": True, "why": why, "shape": GEMV_SHAPE, "rows": rows,
            "summary": {s["format"]: s for s in summary(rows)}}


def gemv_cell(gemv: dict, name: str) -> str:
    """The table's GEMV cell: 'no GPU' off a GPU; on one, the format's time over the four ops of a 7B
    layer and its multiple of the bandwidth floor (ladder/tools/gemv_timing.py's summary), or WRONG where a kernel
    failed its reference check before timing."""
    if not gemv["available"]:
        return "no GPU"
    s = gemv["summary"].get(name)
    if s is None:
        return "not measured"
    if not s["ok"]:
        return "WRONG (see JSON)"
    return f"{s['time_us']:.1f} us, {s['x_floor']:.2f}x floor"


# --- the report -----------------------------------------------------------------------------------


def quant_report(formats: list[str], models: list[str], seeded_shape: str = DEFAULT_SEEDED_SHAPE, seed: int = 0,
                 max_windows: int = DEFAULT_WINDOWS, window: int = DEFAULT_WINDOW, tied_head: bool = False,
                 progress=None) -> dict:
    """Every figure of the report, as the JSON holds it."""
    import torch

    from engine.formats import get_format

    progress = progress or _say
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    fmts = [get_format(n) for n in formats]
    gemv = gemv_column(formats, progress)
    result = {"formats": {f.name: f.describes for f in fmts}, "columns": COLUMNS, "models": {},
              "window": window, "max_windows": max_windows, "seeded_shape": seeded_shape, "seed": seed,
              "tied_head": tied_head,
              "torch_threads": torch.get_num_threads(), "gemv": gemv}
    for key in models:
        progress(f"{key}: loading {MODELS[key]}")
        subject = (default_subject(window, max_windows) if key == "default"
                   else seeded_subject(seeded_shape, seed, window, max_windows, tied_head))
        m = measure_model(subject, fmts, progress)
        for name, row in m["formats"].items():
            row["gemv_7b"] = gemv["summary"].get(name) if gemv["available"] else "no GPU"
        result["models"][key] = m
        del subject
    return result


def _say(message: str) -> None:
    print(f"quant-report: {message}", file=sys.stderr, flush=True)


def _num(x: float, sign: str = "") -> str:
    """Four decimals, or six significant digits from a thousand up (a random model's perplexity)."""
    return f"{x:{sign}.4f}" if abs(x) < 1e3 else f"{x:{sign}.6g}"


def table(result: dict) -> str:
    """The report's tables, one per model, formats sorted by mean KL (the fp16 baseline first)."""
    lines = []
    head = (f"{'format':<18} {'top-1 agree':>11} {'mean KL':>10} {'perplexity':>11} {'ppl change':>11} "
            f"{'change %':>9} {'bytes/w':>8}  GEMV {result['gemv']['shape']}")
    for key, m in result["models"].items():
        lines += ["", f"{m['label']}: {m['windows']} windows of up to {m['window']} tokens, {m['positions']} positions",
                  head, "-" * len(head),
                  f"{'fp16':<18} {1.0:>11.4f} {0.0:>10.3g} {_num(m['fp16']['perplexity']):>11} {0.0:>+11.4f} "
                  f"{0.0:>+8.2f}% {m['fp16']['bytes_per_weight']:>8.4f}  -"]
        for name, r in sorted(m["formats"].items(), key=lambda kv: kv[1]["kl_mean"]):
            lines.append(f"{name:<18} {r['top1_agreement']:>11.4f} {r['kl_mean']:>10.3g} {_num(r['perplexity']):>11} "
                         f"{_num(r['ppl_change'], '+'):>11} {r['ppl_change_pct']:>+8.2f}% {r['bytes_per_weight']:>8.4f}  "
                         f"{gemv_cell(result['gemv'], name)}")
    return "\n".join(lines[1:])


def plot(result: dict, path: Path) -> bool:
    """Mean KL and perplexity change against bytes per weight, a point per format and model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (key, m), marker in zip(result["models"].items(), "os^D"):
        rows = m["formats"]
        x = [r["bytes_per_weight"] for r in rows.values()]
        for ax, col in zip(axes, ("kl_mean", "ppl_change_pct")):
            y = [r[col] for r in rows.values()]
            ax.scatter(x, y, marker=marker, label=m["label"])
            for name, xi, yi in zip(rows, x, y):
                ax.annotate(name, (xi, yi), fontsize=7, xytext=(4, 2), textcoords="offset points")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("mean KL(fp16 || quantized), nats")
    axes[1].set_ylabel("perplexity change vs fp16, %")
    for ax in axes:
        ax.set_xlabel("bytes per weight (linears)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("quant-report: each format against the fp16 model (HF simulation, held-out windows)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def cmd_quant_report(args) -> int:
    from engine.outpath import check_output_folder

    out = check_output_folder(args.report)  # refused before the work, not after it
    out.mkdir(parents=True, exist_ok=True)
    result = quant_report(list(args.quant), list(args.models), args.seeded_shape, args.seed, args.windows, args.window,
                          args.tied_head)
    print(table(result))
    (out / "quant_report.json").write_text(json.dumps(result, indent=1) + "\n")
    drawn = plot(result, out / "quant_report.png")
    print(f"wrote {out / 'quant_report.json'}" + (f" and {out / 'quant_report.png'}" if drawn else " (no matplotlib: no chart)"))
    return 0


# --- the command line -----------------------------------------------------------------------------


def models_arg(text: str) -> list[str]:
    """argparse type for `--models default,seeded`."""
    import argparse

    from engine.cli import comma_names

    names = comma_names(text, "models")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    return names


def register(subparsers) -> None:
    """Add the `quant-report` subcommand to the `nanoqwen` parser's subparsers."""
    from engine.cli import formats_arg, int_at_least, non_negative_int, renamed
    from engine.config import SHAPES
    from fixtures.tiny_model import DEFAULT_SEED

    q = subparsers.add_parser("quant-report", help="each quantization format against the fp16 model: top-1 "
                                                   "agreement, KL, perplexity, bytes per weight")
    q.add_argument("--quant", type=formats_arg, default="all", metavar="FORMAT[,FORMAT...]|all",
                   help="quantization formats, comma-separated, or all (default)")
    renamed(q, "--formats", new="--quant", type=formats_arg)
    q.add_argument("--models", type=models_arg, default="default,seeded",
                   help="default (the trained tiny coder), seeded (the seeded model at --seeded-shape), or both")
    q.add_argument("--seeded-shape", default=DEFAULT_SEEDED_SHAPE, choices=sorted(SHAPES),
                   help=f"named shape of the seeded model (default {DEFAULT_SEEDED_SHAPE})")
    q.add_argument("--windows", type=non_negative_int, default=DEFAULT_WINDOWS,
                   help=f"held-out windows, evenly spread (default {DEFAULT_WINDOWS}; 0: all)")
    q.add_argument("--window", type=int_at_least(1, "a positive integer"), default=DEFAULT_WINDOW,
                   help=f"tokens per window (default {DEFAULT_WINDOW})")
    q.add_argument("--seed", type=non_negative_int, default=DEFAULT_SEED, help="seed of the seeded model")
    q.add_argument("--tied-head", action="store_true",
                   help="keep a tied shape's lm_head tied to the seeded embedding (its next-token distributions "
                        "are then one-hot: see docs/QUANT_REPORT.md)")
    q.add_argument("--report", default="reports/quant", metavar="DIR",
                   help="folder for quant_report.json and quant_report.png")
    renamed(q, "--out", new="--report")
    q.set_defaults(func=cmd_quant_report)
