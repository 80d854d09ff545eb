"""Token comparison of the graph rung (docs/LADDER.md, "Token comparison"): engine greedy tokens against
the HF simulation's, with near-ties judged by the reference's logit margin and teacher forcing after
them, under bounds derived from the model's own noise floor.

    ref = reference_greedy(hf, prompt_ids, n_new)          # HF float32, its own KV cache, once per prompt
    bounds = derive_bounds(config, weights, runs)           # the model's floor on FLOOR_PROMPTS prompts
    logits = engine_logits(model, prompt_ids, ref.tokens)   # engine, fed the reference's tokens
    result = compare_greedy("p017", ref, logits, backend="numpy", bounds=bounds)
    assert result.passed, result.describe()
    flat = flatness([ref, ...], bounds)                      # refuse a model too flat to judge

The bounds: the floor is the max abs difference between the logits of the plain implementation of the
whole model (reference.model.ref_forward in fp32 with fp16 storage, one causal pass over the prompt
and the reference's tokens) and the HF simulation's, over the new positions of a spread of the prompts
(`spread_by_length`: the same ones in every xdist worker, so every worker derives the same bounds). The
engine may differ from the simulation by `allowed` = TOL[("graph_logits", "float32")] of that floor;
the near-tie epsilon is NEAR_TIE_EPS_PER_LOGIT_DIFF x allowed (ladder/tolerances.py says why).

Identical greedy tokens pass. At a mismatch, `margin = ref_logits[ref_token] - ref_logits[engine_token]`
decides: under the epsilon it is a near-tie (recorded), otherwise a failure (prompt id, position, both
tokens, margin). Either way the comparison goes on with the reference's token on both sides (teacher
forcing), so one run reports every diverging position. Because both sides always continue with the
reference's token, the reference never depends on the engine: it runs once per prompt and serves every
backend, and the engine's logits at each position are those of one prefill plus decode steps fed with
the reference's tokens. The engine's greedy token at a position is the argmax of its fp32 logits, lowest
index on a tie (the `argmax` op's contract). Any logit further than `allowed` from the reference fails
too: past it, a flipped token could pass as a near-tie.

Stop ids are ignored: both sides generate exactly `n_new` tokens (`new_tokens_for`, or the run's
`--new-tokens`), so every prompt crosses the page boundaries it was sized to cross.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from engine.config import PAGE_SIZE
from ladder.tolerances import FLOOR_PROMPTS, MAX_NEAR_TIE_FRACTION, NEAR_TIE_EPS_PER_LOGIT_DIFF, TOL

PAGE = PAGE_SIZE


def new_tokens_for(prompt_len: int, page: int = PAGE, beyond: int = 8) -> int:
    """How many tokens to generate so the sequence crosses the next page boundary after the prompt.

    The next boundary is the first multiple of `page` above `prompt_len`; generation continues `beyond`
    tokens past it (8 to 24 new tokens on 16-token pages), so the engine writes into a fresh page and
    then reads it back for several steps.
    """
    boundary = (prompt_len // page + 1) * page
    return boundary - prompt_len + beyond


def tokens_to_generate(prompt_len: int, override: int | None = None) -> int:
    """The new tokens of one prompt: `override` (the run's `--new-tokens`) when given, else `new_tokens_for`."""
    return int(override) if override else new_tokens_for(prompt_len)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """The top-1 minus top-2 logit of each row (float64); 0 where the maximum is tied."""
    logits = np.asarray(logits, dtype=np.float64)
    top = np.partition(logits, -2, axis=-1)[..., -2:]
    return top[..., 1] - top[..., 0]


# --- the two sides ----------------------------------------------------------------------------------


@dataclass
class Reference:
    """The reference's greedy run on one prompt: its tokens and fp32 logits at each new position."""

    prompt_len: int
    tokens: np.ndarray  # int64 [N]: the reference's greedy token at each new position
    logits: np.ndarray  # float32 [N, V]: the logits that chose it

    @property
    def margins(self) -> np.ndarray:
        return top2_margin(self.logits)


def reference_greedy(hf, prompt_ids, n_new: int) -> Reference:
    """Greedy generation with transformers (float32, its own KV cache: one prefill, then a step per token)."""
    import torch

    logits = []
    with torch.no_grad():
        out = hf(torch.tensor([list(prompt_ids)], dtype=torch.long), use_cache=True)
        cache_kw = "cache" if "cache" in out else "past_key_values"  # transformers 5.x renamed it
        for i in range(n_new):
            row = out.logits[0, -1].float().numpy().copy()
            logits.append(row)
            if i + 1 == n_new:
                break
            nxt = torch.tensor([[int(np.argmax(row))]], dtype=torch.long)
            out = hf(nxt, use_cache=True, **{cache_kw: out[cache_kw]})
    logits = np.stack(logits)
    return Reference(len(prompt_ids), np.argmax(logits, axis=-1), logits)


def engine_logits(model, prompt_ids, tokens) -> np.ndarray:
    """The engine's fp32 logits [len(tokens), V] at each new position, fed `tokens` (teacher forcing)."""
    seq = model.new_sequence()
    try:
        rows = [model.prefill(seq, list(prompt_ids))]
        for t in tokens[:-1]:
            rows.append(model.decode_step(seq, int(t)))
    finally:
        seq.free()
    return np.stack(rows)


# --- the bounds, from the model's floor ------------------------------------------------------------


def spread_by_length(prompts, k: int = FLOOR_PROMPTS) -> list:
    """Up to `k` prompts spread over the lengths (shortest, longest and between), in length order.

    Deterministic in the prompt set alone (ties broken by id), so every xdist worker picks the same ones.
    """
    ordered = sorted(prompts, key=lambda p: (len(p.ids), str(p.id)))
    if len(ordered) <= k:
        return ordered
    picks = sorted({i * (len(ordered) - 1) // (k - 1) for i in range(k)}) if k > 1 else [0]
    return [ordered[i] for i in picks]


def floor_logits(config: dict, weights: dict, prompt_ids, ref: Reference) -> np.ndarray:
    """The plain implementation's fp32 logits [N, V] at the reference's N new positions: one causal pass
    of reference.model.ref_forward (fp32, fp16 storage) over the prompt and the reference's tokens."""
    from reference.model import ref_forward

    ids = [int(t) for t in prompt_ids] + [int(t) for t in ref.tokens[:-1]]
    logits = ref_forward(config, weights, ids, dtype=np.float32, storage=np.float16)
    return logits[len(prompt_ids) - 1:]


@dataclass(frozen=True)
class GraphBounds:
    """The graph rung's bounds for one model, and the measurement they come from."""

    floor: float  # max |plain fp32/fp16-storage forward - HF simulation| logit over the floor prompts
    floor_q999: float  # the 99.9th percentile of the same differences
    ref_scale: float  # max |reference logit| over the floor prompts (the ulps term's scale)
    factor: float
    ulps: float
    max_logit_diff: float  # the engine's allowed max abs logit difference from the HF simulation
    eps: float  # the near-tie epsilon
    max_near_tie_fraction: float
    prompts: tuple[str, ...]  # the floor prompts' ids
    positions: int  # new positions the floor was measured over
    label: str = ""  # which model (its format) these bounds belong to, when a run judges several

    def describe(self) -> str:
        return (f"graph rung bounds{f' [{self.label}]' if self.label else ''}: floor {self.floor:.4g} (99.9th percentile {self.floor_q999:.4g}) = max abs "
                f"logit difference of the plain fp32 forward with fp16 storage from the HF simulation over "
                f"{self.positions} new positions of {len(self.prompts)} prompts ({', '.join(self.prompts)}); "
                f"allowed logit difference {self.factor:g} x floor + {self.ulps:g} ulp x {self.ref_scale:.3g} = "
                f"{self.max_logit_diff:.4g}; near-tie epsilon {NEAR_TIE_EPS_PER_LOGIT_DIFF:g} x allowed = "
                f"{self.eps:.4g}; near-tie limit {100 * self.max_near_tie_fraction:g}% of positions")

    def record(self) -> dict:
        d = asdict(self)
        d["prompts"] = list(self.prompts)
        return d

    @classmethod
    def from_record(cls, d: dict) -> "GraphBounds":
        return cls(**{**d, "prompts": tuple(d["prompts"])})


def bounds_from_floor(floor: float, ref_scale: float, floor_q999: float | None = None, prompts=(),
                      positions: int = 0) -> GraphBounds:
    """The bounds a measured floor implies (ladder/tolerances.py: TOL[("graph_logits", "float32")])."""
    tol = TOL[("graph_logits", "float32")]
    allowed = tol.bound(floor, ref_scale, np.float32)
    return GraphBounds(float(floor), float(floor if floor_q999 is None else floor_q999), float(ref_scale),
                       tol.factor, tol.ulps, float(allowed), float(NEAR_TIE_EPS_PER_LOGIT_DIFF * allowed),
                       MAX_NEAR_TIE_FRACTION, tuple(str(p) for p in prompts), int(positions))


def derive_bounds(config: dict, weights: dict, runs) -> GraphBounds:
    """The bounds of one model from its floor, measured on `runs`: (prompt id, prompt ids, Reference)
    triples (the floor prompts, each with the HF simulation's greedy run on it)."""
    diffs, scale, ids = [], 0.0, []
    for prompt_id, prompt_ids, ref in runs:
        fl = floor_logits(config, weights, prompt_ids, ref).astype(np.float64)
        diffs.append(np.abs(fl - ref.logits.astype(np.float64)).ravel())
        scale = max(scale, float(np.abs(ref.logits).max()))
        ids.append(prompt_id)
    if not diffs:
        raise ValueError("the graph rung's floor needs at least one prompt")
    d = np.concatenate(diffs)
    if not np.isfinite(d).all():
        raise ValueError("the plain fp32 forward with fp16 storage gives non-finite logits: the model overflows "
                         "fp16 activations, so its graph-rung floor is undefined")
    positions = sum(len(r.tokens) for _, _, r in runs)
    return bounds_from_floor(float(d.max()), scale, float(np.quantile(d, 0.999)), ids, positions)


# --- the comparison ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """A position where the engine's greedy token is not the reference's."""

    prompt_id: str
    position: int  # absolute position in the sequence (the prompt is positions 0 .. prompt_len-1)
    step: int  # index among the new tokens
    ref_token: int
    engine_token: int
    margin: float  # reference logit of its token minus its logit of the engine's token

    def __str__(self) -> str:
        return (f"prompt {self.prompt_id!r} position {self.position} (new token {self.step}): reference "
                f"token {self.ref_token}, engine token {self.engine_token}, reference margin {self.margin:.4g}")


@dataclass
class TokenResult:
    """The comparison of one prompt on one backend."""

    prompt_id: str
    backend: str
    prompt_len: int
    positions: int  # new positions compared
    exact: int  # positions where the engine's greedy token is the reference's
    eps: float  # the model's near-tie epsilon (GraphBounds.eps)
    allowed: float  # the model's allowed max abs logit difference (GraphBounds.max_logit_diff)
    near_ties: list[Divergence] = field(default_factory=list)
    failures: list[Divergence] = field(default_factory=list)
    min_margin: float = float("inf")  # smallest reference top-1/top-2 margin over the positions
    flat_positions: int = 0  # positions whose reference top-1/top-2 margin is under eps
    max_logit_diff: float = 0.0  # max |engine - reference| logit over all positions and the vocab
    nan_positions: int = 0  # positions where the engine's logits hold NaN or inf

    @property
    def logits_drifted(self) -> bool:
        """Engine logits further from the reference than the near-tie rule assumes (the allowed difference)."""
        return self.max_logit_diff > self.allowed

    @property
    def passed(self) -> bool:
        return not self.failures and not self.nan_positions and not self.logits_drifted

    def describe(self) -> str:
        head = (f"graph[{self.prompt_id}] on backend {self.backend!r}: prompt of {self.prompt_len} tokens, "
                f"{self.positions} new tokens: {self.exact} exact, {len(self.near_ties)} near-ties, "
                f"{len(self.failures)} failures; smallest reference margin {self.min_margin:.4g}, max abs "
                f"logit difference {self.max_logit_diff:.4g} (allowed {self.allowed:.4g}, near-tie epsilon "
                f"{self.eps:.4g}, both from the model's floor)")
        lines = [head]
        if self.nan_positions:
            lines.append(f"  NaN or inf in the engine's logits at {self.nan_positions} positions")
        if self.logits_drifted:
            lines.append(f"  FAIL max abs logit difference {self.max_logit_diff:.4g} > allowed {self.allowed:.4g} "
                         f"(the graph_logits factor of the model's floor: beyond it a flipped token could pass "
                         f"as a near-tie)")
        for d in self.failures[:5]:
            lines.append(f"  FAIL {d} >= near-tie epsilon {self.eps:.4g}")
        if len(self.failures) > 5:
            lines.append(f"  ... and {len(self.failures) - 5} more failing positions")
        for d in self.near_ties[:5]:
            lines.append(f"  near-tie {d} < {self.eps:.4g}; teacher-forced")
        return "\n".join(lines)

    def record(self) -> dict:
        """A plain dict for the report (pytest user_properties travel between xdist workers as such)."""
        d = asdict(self)
        d["passed"] = self.passed
        d["near_ties"] = [asdict(x) for x in self.near_ties]
        d["failures"] = [asdict(x) for x in self.failures]
        return d


def compare_greedy(prompt_id: str, ref: Reference, eng_logits, backend: str = "?", *,
                   bounds: GraphBounds) -> TokenResult:
    """Compare the engine's greedy tokens (argmax of `eng_logits` [N, V]) with the reference's, under
    the model's `bounds` (near-tie epsilon and allowed logit difference)."""
    eng_logits = np.asarray(eng_logits, dtype=np.float32)
    if eng_logits.shape != ref.logits.shape:
        raise ValueError(f"engine logits {eng_logits.shape} and reference logits {ref.logits.shape} differ in shape")
    eps = bounds.eps
    margins = ref.margins
    finite = np.isfinite(eng_logits).all(axis=-1)
    diff = np.abs(eng_logits.astype(np.float64) - ref.logits.astype(np.float64))
    res = TokenResult(prompt_id, backend, ref.prompt_len, len(ref.tokens), 0, eps, bounds.max_logit_diff,
                      min_margin=float(margins.min()) if margins.size else float("inf"),
                      flat_positions=int((margins < eps).sum()),
                      max_logit_diff=float(diff[finite].max()) if finite.any() else float("inf"),
                      nan_positions=int((~finite).sum()))
    for step, (ref_tok, row) in enumerate(zip(ref.tokens, eng_logits)):
        ref_tok = int(ref_tok)
        eng_tok = int(np.argmax(np.nan_to_num(row, nan=-np.inf)))
        if eng_tok == ref_tok:
            res.exact += 1
            continue
        margin = float(np.float64(ref.logits[step, ref_tok]) - np.float64(ref.logits[step, eng_tok]))
        d = Divergence(prompt_id, ref.prompt_len + step, step, ref_tok, eng_tok, margin)
        (res.near_ties if margin < eps else res.failures).append(d)
    return res


# --- the whole prompt set ---------------------------------------------------------------------------


@dataclass
class Flatness:
    """How many of the reference's greedy positions are too close to call; a model over the limit is refused."""

    positions: int
    flat: int
    min_margin: float
    eps: float
    max_fraction: float = MAX_NEAR_TIE_FRACTION

    @property
    def fraction(self) -> float:
        return self.flat / self.positions if self.positions else 0.0

    @property
    def refused(self) -> bool:
        return self.positions == 0 or self.fraction > self.max_fraction

    def describe(self) -> str:
        if self.positions == 0:
            return "graph rung: no reference positions to judge"
        verdict = ("the model is too flat to judge: a wrong token could hide behind a near-tie; the graph rung "
                   "refuses it (docs/LADDER.md, Token comparison)" if self.refused else "within the limit")
        return (f"graph rung: {self.flat} of {self.positions} reference positions ({100 * self.fraction:.2f}%) "
                f"have a top-1/top-2 margin under the model's near-tie epsilon {self.eps:.4g} (limit "
                f"{100 * self.max_fraction:.0f}%); smallest margin {self.min_margin:.4g}: {verdict}")


def flatness(refs, bounds: GraphBounds) -> Flatness:
    """The flat-model rule over every compared position of every prompt's reference run."""
    margins = np.concatenate([r.margins for r in refs]) if refs else np.zeros(0)
    return Flatness(int(margins.size), int((margins < bounds.eps).sum()),
                    float(margins.min()) if margins.size else float("inf"), bounds.eps,
                    bounds.max_near_tie_fraction)


@dataclass
class Summary:
    """Totals over many TokenResults (or their records), per backend."""

    backend: str
    prompts: int = 0
    failed_prompts: int = 0
    positions: int = 0
    exact: int = 0
    near_ties: int = 0
    failures: int = 0
    min_margin: float = float("inf")
    max_logit_diff: float = 0.0
    allowed: float = float("inf")  # the smallest allowed difference the prompts were judged by
    eps: float = float("inf")  # the smallest near-tie epsilon they were judged by

    def describe(self) -> str:
        return (f"graph rung on {self.backend}: {self.prompts} prompts ({self.failed_prompts} failed), "
                f"{self.positions} tokens: {self.exact} exact, {self.near_ties} near-ties, {self.failures} "
                f"failures; smallest reference margin {self.min_margin:.4g}; max abs logit difference "
                f"{self.max_logit_diff:.4g} (allowed {self.allowed:.4g}, near-tie epsilon {self.eps:.4g})")


def summarize(results) -> list[Summary]:
    """One Summary per backend from TokenResults or their `record()` dicts."""
    out: dict[str, Summary] = {}
    for r in results:
        r = r.record() if isinstance(r, TokenResult) else r
        s = out.setdefault(r["backend"], Summary(r["backend"]))
        s.prompts += 1
        s.failed_prompts += not r["passed"]
        s.positions += r["positions"]
        s.exact += r["exact"]
        s.near_ties += len(r["near_ties"])
        s.failures += len(r["failures"])
        s.min_margin = min(s.min_margin, r["min_margin"])
        s.max_logit_diff = max(s.max_logit_diff, r["max_logit_diff"])
        s.allowed = min(s.allowed, r.get("allowed", float("inf")))
        s.eps = min(s.eps, r.get("eps", float("inf")))
    return list(out.values())
