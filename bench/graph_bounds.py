"""How sharp are the graph rung's bounds? The smallest errors the rung still catches, for the floor
taken as its maximum (the rung's rule) or as its 99.9th percentile.

    python -m bench.graph_bounds                                # the default model, 10 judged prompts
    python -m bench.graph_bounds --model trained-like-0.5b --prompts 10
    python -m bench.graph_bounds --model FILE|HF_DIR --faults   # also every fault of the catalogue

For each model it runs the rung's own pieces (ladder/judges/tokens.py): the HF simulation's greedy runs on the
floor prompts (FLOOR_PROMPTS of the prompt set, spread over the lengths) and on the judged prompts (the
first N of the set, as `-k heldout-00` selects), the floor, and the correct NumPy engine's logits. Then,
for each floor statistic:

- **allowed**: the allowed logit difference it derives, and whether the correct engine stays green
  under it (a statistic that turns a correct engine red is too sharp to use);
- **smallest uniform perturbation**: the smallest delta such that the correct engine's logits plus
  delta x U(-1, 1) (seeded, every logit) turn the rung red, found by bisection on the kept logits;
- **weakest scale fault**: the smallest s such that the down projection's contribution to the
  residual stream, scaled by (1 + s) in every layer, turns the rung red: the engine runs with the fault at
  two strengths, the threshold is interpolated (the logit error grows linearly in s) and then checked by
  a run on either side of it;
- with `--faults`, each fault of ladder/checks/faults.py: its max logit difference as a multiple of allowed, its
  token failures, and its verdict.

"Red" is the graph rung's verdict on the judged prompts: any logit past the allowed difference, any
flip at a margin over the epsilon, NaN, or near-tie flips more often than the plain forward's
(`judge_flips`). The table ends the output; docs/LADDER.md quotes it.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _say(msg: str) -> None:
    print(f"[graph-bounds] {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, path, n_prompts: int):
        import torch

        from fixtures.dequantized import dequantized_weights
        from fixtures.prompts import prompts_for_model
        from ladder.judges.tokens import measure_floor, reference_greedy, spread_by_length, tokens_to_generate
        from reference.hf import hf_model

        self.path = path
        prompts = prompts_for_model(path)
        self.judged = prompts[:n_prompts]
        floor_prompts = spread_by_length(prompts)
        config, weights = dequantized_weights(path)
        hf = hf_model(config, weights)
        torch.set_num_threads(1 if sum(w.size for w in weights.values()) < 100_000_000 else torch.get_num_threads())
        t = time.monotonic()
        self.refs = {p.id: reference_greedy(hf, p.ids, tokens_to_generate(len(p.ids)))
                     for p in {p.id: p for p in floor_prompts + self.judged}.values()}
        _say(f"HF simulation on {len(self.refs)} prompts: {time.monotonic() - t:.1f} s")
        t = time.monotonic()
        self.floor = measure_floor(config, weights, [(p.id, p.ids, self.refs[p.id]) for p in floor_prompts])
        _say(f"floor on {len(floor_prompts)} prompts: {time.monotonic() - t:.1f} s")
        del hf, weights
        self.correct = self.engine_logits(None)

    def engine_logits(self, plant) -> dict[str, np.ndarray]:
        import engine
        from kernels import get_backend
        from ladder.judges.tokens import engine_logits

        backend = get_backend("numpy")
        if plant is not None:
            plant(backend)
        model = engine.load(self.path, backend=backend)
        t = time.monotonic()
        out = {p.id: engine_logits(model, p.ids, self.refs[p.id].tokens) for p in self.judged}
        _say(f"engine on {len(self.judged)} prompts: {time.monotonic() - t:.1f} s")
        return out

    def verdict(self, bounds, logits) -> tuple[bool, float]:
        """(red, max logit difference / allowed) of the graph rung on the judged prompts."""
        from ladder.judges.tokens import compare_greedy, judge_flips, summarize

        results = [compare_greedy(p.id, self.refs[p.id], logits[p.id], "numpy", bounds=bounds) for p in self.judged]
        (summary,) = summarize(results)
        red = not all(r.passed for r in results) or not judge_flips(summary).passed
        return red, summary.max_logit_diff / bounds.max_logit_diff


def smallest_uniform_perturbation(bench: Bench, bounds, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    noise = {k: rng.uniform(-1, 1, v.shape).astype(np.float32) for k, v in bench.correct.items()}
    lo, hi = 0.0, 4 * bounds.max_logit_diff
    if not bench.verdict(bounds, {k: v + np.float32(hi) * noise[k] for k, v in bench.correct.items()})[0]:
        return float("inf")
    for _ in range(30):
        mid = (lo + hi) / 2
        red, _ = bench.verdict(bounds, {k: v + np.float32(mid) * noise[k] for k, v in bench.correct.items()})
        lo, hi = (lo, mid) if red else (mid, hi)
    return hi


def down_scale_fault(s: float):
    """A planted fault of strength s: the down projection's contribution to the residual times (1 + s)."""
    def plant(backend):
        original = backend.down_residual

        def op(x, w, residual):
            before = np.array(backend.to_numpy(residual), copy=True)
            original(x, w, residual)
            after = np.array(backend.to_numpy(residual), copy=True)
            residual[...] = backend.asarray((before + np.float32(1 + s) * (after - before)).astype(np.float32))
        backend.down_residual = op
    return plant


def weakest_scale_fault(bench: Bench, bounds_by_stat: dict) -> dict[str, tuple[float, bool, bool]]:
    """stat -> (threshold s, red just above it, green just below it)."""
    base = max(np.abs(bench.correct[k].astype(np.float64) - bench.refs[k].logits).max() for k in bench.correct)
    probes = {}
    for s in (1e-3, 4e-3):
        logits = bench.engine_logits(down_scale_fault(s))
        probes[s] = (logits, max(np.abs(logits[k].astype(np.float64) - bench.refs[k].logits).max() for k in logits))
    (s0, (_, d0)), (s1, (_, d1)) = sorted(probes.items())
    slope = (d1 - d0) / (s1 - s0)
    out = {}
    for stat, bounds in bounds_by_stat.items():
        s = max((bounds.max_logit_diff - d0) / slope + s0, 0.0) if slope > 0 else float("inf")
        above = bench.verdict(bounds, bench.engine_logits(down_scale_fault(1.1 * s)))[0]
        below = not bench.verdict(bounds, bench.engine_logits(down_scale_fault(0.9 * s)))[0]
        out[stat] = (s, above, below)
        _say(f"{stat}: threshold s = {s:.3g} (base difference {base:.4g}, slope {slope:.4g} per unit s)")
    return out


def resolve_model(name: str):
    if name == "default":
        from fixtures.default_model import default_model_file

        return default_model_file()
    if name in TEST_MODELS:
        from fixtures.tiny_model import trained_like_model_file

        return trained_like_model_file(TEST_MODELS[name])
    from engine.resolve import resolve_model as resolve

    return resolve(name)


TEST_MODELS = {"trained-like-0.5b": "0.5b", "trained-like-small": "small"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.graph_bounds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default",
                    help="default, trained-like-0.5b, trained-like-small, or a .nanoqwen file / HF folder")
    ap.add_argument("--prompts", type=int, default=10, help="judged prompts: the first N of the prompt set")
    ap.add_argument("--faults", action="store_true", help="also run every fault of the catalogue")
    args = ap.parse_args(argv)
    from ladder.checks.faults import FAULTS, plant
    from ladder.judges.tokens import bounds_from_measurement

    bench = Bench(resolve_model(args.model), args.prompts)
    stats = {stat: bounds_from_measurement(bench.floor, stat) for stat in ("max", "q999")}
    rows = []
    scale = weakest_scale_fault(bench, stats)
    faults = {}
    if args.faults:
        for name in FAULTS:
            faults[name] = bench.engine_logits(lambda b, name=name: plant(b, name))
    for stat, b in stats.items():
        red, mult = bench.verdict(b, bench.correct)
        delta = smallest_uniform_perturbation(bench, b)
        rows.append((stat, b, red, mult, delta, scale[stat]))
    print(f"\nmodel {args.model}: {len(bench.judged)} judged prompts; floor prompts {', '.join(bench.floor.prompts)}; "
          f"close positions (judged) {sum(int((bench.refs[p.id].margins < stats['max'].eps).sum()) for p in bench.judged)}; "
          f"plain-forward flips {stats['max'].floor_flips} of {stats['max'].floor_close}")
    print("| floor statistic | floor | allowed | eps | correct engine (x allowed) | correct verdict | smallest uniform "
          "perturbation (x allowed) | weakest down-scale fault s | red above / green below |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for stat, b, red, mult, delta, (s, above, below) in rows:
        print(f"| {stat} | {b.floor:.4g} | {b.max_logit_diff:.4g} | {b.eps:.4g} | {mult:.2f} | "
              f"{'RED' if red else 'green'} | {delta:.4g} ({delta / b.max_logit_diff:.2f}) | {s:.3g} | "
              f"{'yes' if above else 'NO'} / {'yes' if below else 'NO'} |")
    if faults:
        print("\n| fault | " + " | ".join(f"{stat}: x allowed, verdict" for stat in stats) + " |")
        print("| --- | " + " | ".join("---" for _ in stats) + " |")
        for name, logits in faults.items():
            cells = []
            for stat, b in stats.items():
                red, mult = bench.verdict(b, logits)
                cells.append(f"{mult:.3g}, {'red' if red else 'GREEN'}")
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
