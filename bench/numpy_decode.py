"""The NumPy backend at a real model shape: prefill and decode ms/token, the graph rung's per-prompt costs,
peak RSS of each. A CPU benchmark, run by hand; nothing imports it.

    python -m bench.numpy_decode --shape qwen2.5-0.5b                  # every part, one table
    python -m bench.numpy_decode --shape qwen2.5-0.5b --parts engine   # one part
    python -m bench.numpy_decode --model FILE.nanoqwen                 # a model file instead of a shape

The model is the seeded random model of the shape (fixtures/tiny_model.py, cached under NANOQWEN_CACHE;
a first build of qwen2.5-0.5b took 18 s and 1.4 GB of disk here: the fp16 folder and the .nanoqwen
file). Each part runs in its own child process, so its peak RSS (getrusage ru_maxrss) is its own:

- `engine`: engine.load on the numpy backend, then --repeats times a prefill of --prompt-len tokens and
  --new-tokens decode steps (ms/token: the median step; the first prefill is shown apart, it widens
  the lm_head table), and the time per op of the last prefill and decode steps;
- `hf`: the HF simulation as the graph rung builds it (fixtures/dequantized.py + reference/hf.py);
- `graph`: both, as one graph-rung worker holds them, then --graph-prompts prompts of --graph-prompt-len
  random ids inside the vocab, --graph-new-tokens each: `reference_greedy` (HF) and `engine_logits`
  (engine) timed per prompt (ladder/judges/tokens.py), with how many greedy tokens agree and the largest
  logit difference (the rung's own verdict needs its per-model bounds, which this does not derive).

`--repack-mb N` sets the NumPy backend's fp32 repack budget (kernels/numpy: 0 keeps every linear as
int8 values dequantized per call), `--threads N` its BLAS threads, `--torch-threads N` the HF side's.
Times are wall clock on whatever else the machine is running: the minimum of the timed steps is printed
beside the median, and the load average before and after each part.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("engine", "hf", "graph")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kilobytes


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model_path(args) -> Path:
    if args.model:
        return Path(args.model)
    from engine.config import SHAPES
    from fixtures.tiny_model import random_model_file

    return random_model_file(args.seed, SHAPES[args.shape])


def _backend(args):
    from kernels import get_backend

    options = {}
    if args.repack_mb is not None:
        options["repack_bytes"] = int(args.repack_mb * 2**20)
    if args.threads:
        options["threads"] = args.threads
    return get_backend("numpy", **options)


def _timed_ops(backend, totals: dict):
    """Wrap every op of this Backend object (instance attributes shadow the class's) to add up its time."""
    from kernels import OPS

    for op in OPS:
        original = getattr(backend, op)

        def timed(*a, _op=op, _f=original):
            t0 = time.perf_counter()
            try:
                return _f(*a)
            finally:
                totals[_op] = totals.get(_op, 0.0) + time.perf_counter() - t0
        setattr(backend, op, timed)


def part_engine(args) -> dict:
    import engine

    path = _model_path(args)
    t0 = time.perf_counter()
    be = _backend(args)
    model = engine.load(path, backend=be)
    load_s = time.perf_counter() - t0
    rss_loaded = _rss_mb()
    V = model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, V, size=args.prompt_len).tolist()
    prefill, decode = [], []
    ops: dict[str, float] = {}
    prefill_ops: dict[str, float] = {}
    for r in range(args.repeats):
        seq = model.new_sequence()
        try:
            if r == args.repeats - 1:
                _timed_ops(model.backend, ops)
            t0 = time.perf_counter()
            logits = model.prefill(seq, prompt)
            prefill.append(time.perf_counter() - t0)
            prefill_ops = dict(ops)  # the ops are timed in the last repeat only
            ops.clear()
            for _ in range(args.new_tokens):
                t0 = time.perf_counter()
                logits = model.decode_step(seq, int(np.argmax(logits)))
                decode.append(time.perf_counter() - t0)
        finally:
            seq.free()
    return {"load_s": load_s, "rss_after_load_mb": rss_loaded, "prefill_s": prefill, "decode_s": decode,
            "ops_ms_per_step": {k: 1e3 * v / args.new_tokens for k, v in ops.items()},
            "prefill_ops_ms": {k: 1e3 * v for k, v in prefill_ops.items()},
            "peak_rss_mb": _peak_mb(), "model": str(path)}


def _hf_side(path):
    from fixtures.dequantized import dequantized_weights
    from reference.hf import hf_model

    config, weights = dequantized_weights(path)
    return config, hf_model(config, weights)


def part_hf(args) -> dict:
    path = _model_path(args)
    t0 = time.perf_counter()
    config, hf = _hf_side(path)
    build_s = time.perf_counter() - t0
    n = sum(p.numel() for p in hf.parameters())
    return {"build_s": build_s, "params": n, "rss_after_build_mb": _rss_mb(), "peak_rss_mb": _peak_mb()}


def part_graph(args) -> dict:
    import torch

    import engine
    from ladder.judges.tokens import engine_logits, reference_greedy

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    path = _model_path(args)
    t0 = time.perf_counter()
    model = engine.load(path, backend=_backend(args))
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    config, hf = _hf_side(path)
    hf_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed + 1)
    prompts = []
    for i in range(args.graph_prompts):
        ids = rng.integers(0, config["vocab_size"], size=args.graph_prompt_len).tolist()
        t0 = time.perf_counter()
        ref = reference_greedy(hf, ids, args.graph_new_tokens)
        ref_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = engine_logits(model, ids, ref.tokens)
        eng_s = time.perf_counter() - t0
        prompts.append({"reference_s": ref_s, "engine_s": eng_s, "positions": len(ref.tokens),
                         "exact": int((np.argmax(logits, axis=-1) == ref.tokens).sum()),
                         "max_logit_diff": float(np.abs(logits.astype(np.float64) - ref.logits).max())})
    return {"engine_load_s": load_s, "hf_build_s": hf_s, "torch_threads": torch.get_num_threads(),
            "prompts": prompts, "peak_rss_mb": _peak_mb()}


def _run_part(part: str, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.numpy_decode", "--child", part, *argv]
    before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "load": [before, os.getloadavg()[0]]}


def _load(r: dict) -> str:
    return f"(load average {r['load'][0]:.1f} before, {r['load'][1]:.1f} after)"


def _ms(xs) -> str:
    return f"{1e3 * float(np.median(xs)):8.1f} {1e3 * float(np.min(xs)):8.1f}"


def print_table(args, results: dict) -> None:
    budget = "default" if args.repack_mb is None else f"{args.repack_mb:g} MB"
    threads = "default" if not args.threads else args.threads
    print(f"== NumPy backend, {args.model or args.shape} (seed {args.seed}), repack budget {budget}, "
          f"BLAS threads {threads}, {os.cpu_count()} CPUs")
    e = results.get("engine")
    if e:
        if "error" in e:
            print(f"engine: {e['error']}")
        else:
            p = args.prompt_len
            print(f"\n{'engine ' + _load(e):34s}\n{'':34s} {'median':>8s} {'min':>8s}")
            print(f"{'load (s)':34s} {e['load_s']:8.1f}")
            print(f"{'first prefill (ms)':34s} {1e3 * e['prefill_s'][0]:8.1f}   (lm_head widens its table once)")
            print(f"{f'prefill {p} tokens (ms)':34s} {_ms(e['prefill_s'][1:] or e['prefill_s'])}")
            print(f"{'prefill per prompt token (ms)':34s} {_ms(np.array(e['prefill_s'][1:] or e['prefill_s']) / p)}")
            steps = len(e["decode_s"])
            print(f"{f'decode (ms/token, {steps} steps)':34s} {_ms(e['decode_s'])}")
            print(f"{'RSS after load / peak (MiB)':34s} {e['rss_after_load_mb']:8.0f} {e['peak_rss_mb']:8.0f}")
            for what, key in (("last prefill by op (ms)", "prefill_ops_ms"), ("decode step by op (ms)", "ops_ms_per_step")):
                ops = sorted(e[key].items(), key=lambda kv: -kv[1])
                print(f"{what}: " + ", ".join(f"{k} {v:.1f}" for k, v in ops))
    h = results.get("hf")
    if h:
        if "error" in h:
            print(f"\nhf: {h['error']}")
        else:
            print(f"\nHF simulation: {h['params'] / 1e6:.0f} M parameters, built in {h['build_s']:.1f} s; "
                  f"RSS after build {h['rss_after_build_mb']:.0f} MiB, peak {h['peak_rss_mb']:.0f} MiB {_load(h)}")
    g = results.get("graph")
    if g:
        if "error" in g:
            print(f"\ngraph: {g['error']}")
        else:
            print(f"\ngraph-rung worker: engine load {g['engine_load_s']:.1f} s, HF build {g['hf_build_s']:.1f} s, "
                  f"torch threads {g['torch_threads']}, peak RSS {g['peak_rss_mb']:.0f} MiB {_load(g)}")
            print(f"{'prompt':8s} {'reference s':>12s} {'engine s':>10s}  same greedy token  max |logit diff|")
            for i, q in enumerate(g["prompts"]):
                print(f"{i:<8d} {q['reference_s']:12.2f} {q['engine_s']:10.2f}  {q['exact']:>7d} of {q['positions']:<7d}"
                      f"  {q['max_logit_diff']:.4g}")
            ref = np.mean([q["reference_s"] for q in g["prompts"]])
            eng = np.mean([q["engine_s"] for q in g["prompts"]])
            print(f"{'mean':8s} {ref:12.2f} {eng:10.2f}   -> {ref + eng:.1f} s per prompt, both sides "
                  f"({args.graph_prompt_len} prompt + {args.graph_new_tokens} new tokens)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", help="a named shape of engine/config.py SHAPES")
    p.add_argument("--model", help="a .nanoqwen file instead of the seeded model of --shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="prefill + decode runs (the first one warms up)")
    p.add_argument("--graph-prompts", type=int, default=3)
    p.add_argument("--graph-prompt-len", type=int, default=40)
    p.add_argument("--graph-new-tokens", type=int, default=20)
    p.add_argument("--repack-mb", type=float, default=None, help="the backend's fp32 repack budget (MB)")
    p.add_argument("--threads", type=int, default=None, help="the backend's BLAS threads (default: its own)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads of the HF side (graph part)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps({"engine": part_engine, "hf": part_hf, "graph": part_graph}[args.child](args)))
        return 0
    argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    if not args.model:
        _model_path(args)  # build the seeded model once, before the children share it
    results = {}
    for part in [x.strip() for x in args.parts.split(",") if x.strip()]:
        if part not in PARTS:
            p.error(f"unknown part {part!r}; known: {', '.join(PARTS)}")
        results[part] = _run_part(part, argv)
    print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
