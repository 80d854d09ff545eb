"""Token comparison of the graph rung (docs/LADDER.md, "Token comparison"): engine greedy tokens against
the HF simulation's, with near-ties judged by the reference's logit margin and teacher forcing after
them, under bounds derived from the model's own noise floor.

    ref = reference_greedy(hf, prompt_ids, n_new)          # HF float32, its own KV cache, once per prompt
    refs = reference_greedy_batch(hf, prompts, n_new)       # the same runs, many prompts batched
    bounds = derive_bounds(config, weights, runs)           # the model's floor on FLOOR_PROMPTS prompts
    logits = engine_logits(model, prompt_ids, ref.tokens)   # engine, fed the reference's tokens
    result = compare_greedy("p017", ref, logits, backend="numpy", bounds=bounds)
    assert result.passed, result.describe()
    verdict = judge_flips(summary)                           # near-tie flips against the plain forward's
    bounds.judgeable                                         # refuse a model no check can judge

The bounds: the floor is the max abs difference between the logits of the plain implementation of the
whole model (reference.model.ref_forward in fp32 with fp16 storage, one causal pass over the prompt
and the reference's tokens) and the HF simulation's, over the new positions of a spread of the prompts
(`spread_by_length`: the same ones in every xdist worker, so every worker derives the same bounds). The
engine may differ from the simulation by `allowed` = TOL[("graph_logits", "float32")] of that floor;
the near-tie epsilon is NEAR_TIE_EPS_PER_LOGIT_DIFF x allowed (ladder/judges/tolerances.py says why).

Identical greedy tokens pass. At a mismatch, `margin = ref_logits[ref_token] - ref_logits[engine_token]`
decides: under the epsilon it is a near-tie (recorded), otherwise a failure (prompt id, position, both
tokens, margin). Either way the comparison goes on with the reference's token on both sides (teacher
forcing), so one run reports every diverging position. Because both sides always continue with the
reference's token, the reference never depends on the engine: it runs once per prompt and serves every
backend, and the engine's logits at each position are those of one prefill plus decode steps fed with
the reference's tokens. The engine's greedy token at a position is the argmax of its fp32 logits, lowest
index on a tie (the `argmax` op's contract). Any logit further than `allowed` from the reference fails
too: past it, a flipped token could pass as a near-tie.

Near-ties are weak evidence one at a time, so they are judged together: over every compared position
whose reference margin is under the epsilon (a close position), the engine may not flip the greedy token
more often than the plain forward does at the floor prompts' close positions (`judge_flips`: Fisher's
exact test, one-sided, at FLIP_TEST_ALPHA). A model is refused only when no check can tell right from
wrong: its allowed difference is comparable to the spread of its logits (`GraphBounds.judgeable`).

Stop ids are ignored: both sides generate exactly `n_new` tokens (`new_tokens_for`, or the run's
`--new-tokens`), so every prompt crosses the page boundaries it was sized to cross.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from engine.config import PAGE_SIZE
from ladder.judges.tolerances import (FLIP_TEST_ALPHA, FLOOR_PROMPTS, MAX_ALLOWED_PER_SPREAD, NEAR_TIE_EPS_PER_LOGIT_DIFF,
                               TOL)

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
    """The top-1 minus top-2 logit of each row (float64, exact for float32 logits); 0 where the maximum is
    tied; NaN in a row with NaN. The maximum, then the maximum of a copy with that one entry at -inf: a
    third of the time of a partition over float64 copies (once a prompt, on 152k-wide rows)."""
    logits = np.asarray(logits)
    if logits.dtype not in (np.float32, np.float64):
        logits = logits.astype(np.float64)
    at = np.argmax(logits, axis=-1)[..., None]  # a NaN's index where the row has one: the margin is NaN
    rest = logits.copy()
    np.put_along_axis(rest, at, -np.inf, axis=-1)
    top = np.take_along_axis(logits, at, axis=-1)[..., 0]
    with np.errstate(invalid="ignore"):  # a row of -inf alone: -inf - -inf, no margin (NaN)
        return top.astype(np.float64) - rest.max(axis=-1).astype(np.float64)


# --- the two sides ----------------------------------------------------------------------------------


@dataclass
class Reference:
    """The reference's greedy run on one prompt: its tokens and fp32 logits at each new position."""

    prompt_len: int
    tokens: np.ndarray  # int64 [N]: the reference's greedy token at each new position
    logits: np.ndarray  # float32 [N, V]: the logits that chose it

    @functools.cached_property
    def margins(self) -> np.ndarray:  # computed once: the eager and the captured runs are judged by the same
        return top2_margin(self.logits)


def reference_greedy(hf, prompt_ids, n_new: int) -> Reference:
    """Greedy generation with transformers (float32, its own KV cache: one prefill, then a step per token),
    on the device the model was built on."""
    return reference_greedy_batch(hf, [prompt_ids], [n_new])[0]


BATCH_TOKENS = 4096  # prompts run together while rows x (longest prompt + new tokens) stays under this


def reference_greedy_batch(hf, prompts, n_new, done=None) -> list[Reference]:
    """`reference_greedy` of each prompt in `prompts` (token id lists; `n_new[i]` new tokens for the i-th),
    run together: prompts of similar length in one batch, left-padded, one prefill and a step per token
    for the whole batch. A small model spends a run in the per-step overhead of transformers and torch,
    and a GPU in kernels far too small for it: the default model's 100 prompts take 8.7 s of one CPU thread
    batched, 27 to 31 s a prompt at a time.

    Left padding changes no real row's values beyond float32 summation order: each row's padding is
    masked out of its attention (`attention_mask`), and its positions start at 0 at its first real token
    (`position_ids`), as in a run of its own. Rows that have their tokens go on with the batch, and only
    their first n_new[i] logits are kept. Only the last position's logits are computed (the lm_head of the
    final hidden state, as Qwen2ForCausalLM does for it), so a long prompt never holds [T, vocab] floats.
    `done(n)`, if given, is called after each batch with its number of prompts (progress)."""
    if len(prompts) != len(n_new):
        raise ValueError(f"{len(prompts)} prompts, {len(n_new)} new-token counts")
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    batches, batch, steps = [], [], 0
    for i in order:  # in length order: a batch's rows waste little on padding, and the newest row is the longest
        steps = max(steps, n_new[i])
        if batch and (len(batch) + 1) * (len(prompts[i]) + steps) > BATCH_TOKENS:
            batches.append(batch)
            batch, steps = [], n_new[i]
        batch.append(i)
    if batch:
        batches.append(batch)
    out: list[Reference | None] = [None] * len(prompts)
    for batch in batches:
        rows = _greedy_rows(hf, [[int(t) for t in prompts[i]] for i in batch], max(n_new[i] for i in batch))
        for i, logits in zip(batch, rows):
            logits = logits[:n_new[i]]
            out[i] = Reference(len(prompts[i]), np.argmax(logits, axis=-1), logits)
        if done is not None:
            done(len(batch))
    return out


def _greedy_rows(hf, rows: list[list[int]], steps: int) -> list[np.ndarray]:
    """float32 logits [steps, V] of each row's greedy run, the rows left-padded into one batch."""
    import torch

    device = hf.model.embed_tokens.weight.device
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        if r:
            ids[b, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[b, width - len(r):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    found = None  # [rows, steps, V], filled a step at a time: the rows' logits are views of it, never copied
    cache = None
    with torch.no_grad():
        for step in range(steps):
            kw = {} if cache is None else {cache[0]: cache[1]}
            out = hf.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kw)
            cache_kw = "cache" if "cache" in out else "past_key_values"  # transformers 5.x renamed it
            cache = (cache_kw, out[cache_kw])
            logits = hf.lm_head(out.last_hidden_state[:, -1]).float().cpu().numpy()
            if found is None:
                found = np.empty((len(rows), steps, logits.shape[-1]), dtype=np.float32)
            found[:, step] = logits
            if step + 1 == steps:
                break
            ids = torch.from_numpy(np.argmax(logits, axis=-1)[:, None]).to(device)  # lowest index on a tie
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(ids)], dim=-1)
    return [found[b] for b in range(len(rows))]


def engine_logits(model, prompt_ids, tokens) -> np.ndarray:
    """The engine's fp32 logits [len(tokens), V] at each new position, fed `tokens` (teacher forcing):
    `Model.forced_logits`, the engine's prefill and decode steps with the logits read back once."""
    return model.forced_logits(list(prompt_ids), [int(t) for t in tokens])


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
    over the prompt and the reference's tokens of reference.model.ref_forward (fp32, fp16 storage), or
    of its torch reading reference.torch_model.plain_forward where the weights are torch tensors (on the
    GPU the HF simulation runs on: fixtures/dequantized.py)."""
    ids = [int(t) for t in prompt_ids] + [int(t) for t in ref.tokens[:-1]]
    if isinstance(weights["model.embed_tokens.weight"], np.ndarray):
        from reference.model import ref_forward

        logits = ref_forward(config, weights, ids, dtype=np.float32, storage=np.float16)
    else:
        from reference.torch_model import plain_forward

        logits = plain_forward(config, weights, ids)
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
    prompts: tuple[str, ...]  # the floor prompts' ids
    positions: int  # new positions the floor was measured over
    floor_close: int = 0  # floor positions whose reference top-1/top-2 margin is under eps
    floor_flips: int = 0  # of those, where the plain forward's greedy token is not the reference's
    spread: float = float("inf")  # median over floor positions of the std of the reference logits
    label: str = ""  # which model (its format) these bounds belong to, when a run judges several

    @property
    def allowed_per_spread(self) -> float:
        return self.max_logit_diff / self.spread if self.spread > 0 else float("inf")

    @property
    def judgeable(self) -> bool:
        """False when the allowed difference is comparable to the spread of the logits: a wrong engine
        could move them no further than a right one is allowed to (MAX_ALLOWED_PER_SPREAD)."""
        return self.allowed_per_spread <= MAX_ALLOWED_PER_SPREAD

    def refusal(self) -> str:
        return (f"graph rung: the allowed logit difference {self.max_logit_diff:.4g} is {self.allowed_per_spread:.3g} "
                f"of the spread of the model's logits {self.spread:.4g} (the median over the floor positions of their "
                f"standard deviation across the vocab; limit {MAX_ALLOWED_PER_SPREAD:g}): a wrong engine moves the logits "
                f"no further than the noise a right one is allowed, so no check can tell them apart; the graph rung "
                f"refuses the model (docs/LADDER.md, Token comparison)")

    def describe(self) -> str:
        return (f"graph rung bounds{f' [{self.label}]' if self.label else ''}: floor {self.floor:.4g} (99.9th percentile {self.floor_q999:.4g}) = max abs "
                f"logit difference of the plain fp32 forward with fp16 storage from the HF simulation over "
                f"{self.positions} new positions of {len(self.prompts)} prompts ({', '.join(self.prompts)}); "
                f"allowed logit difference {self.factor:g} x floor + {self.ulps:g} ulp x {self.ref_scale:.3g} = "
                f"{self.max_logit_diff:.4g}; near-tie epsilon {NEAR_TIE_EPS_PER_LOGIT_DIFF:g} x allowed = "
                f"{self.eps:.4g}; at the floor's {self.floor_close} close positions (margin under epsilon) the plain "
                f"forward flips {self.floor_flips}; allowed / logit spread {self.allowed_per_spread:.3g} (refused over "
                f"{MAX_ALLOWED_PER_SPREAD:g})")

    def record(self) -> dict:
        d = asdict(self)
        d["prompts"] = list(self.prompts)
        return d

    @classmethod
    def from_record(cls, d: dict) -> "GraphBounds":
        return cls(**{**d, "prompts": tuple(d["prompts"])})


def bounds_from_floor(floor: float, ref_scale: float, floor_q999: float | None = None, prompts=(),
                      positions: int = 0, floor_close: int = 0, floor_flips: int = 0,
                      spread: float = float("inf")) -> GraphBounds:
    """The bounds a measured floor implies (ladder/judges/tolerances.py: TOL[("graph_logits", "float32")])."""
    tol = TOL[("graph_logits", "float32")]
    allowed = tol.bound(floor, ref_scale, np.float32)
    return GraphBounds(float(floor), float(floor if floor_q999 is None else floor_q999), float(ref_scale),
                       tol.factor, tol.ulps, float(allowed), float(NEAR_TIE_EPS_PER_LOGIT_DIFF * allowed),
                       tuple(str(p) for p in prompts), int(positions), int(floor_close), int(floor_flips),
                       float(spread))


def derive_bounds(config: dict, weights: dict, runs, progress=None) -> GraphBounds:
    """The bounds of one model from its floor, measured on `runs`: (prompt id, prompt ids, Reference)
    triples (the floor prompts, each with the HF simulation's greedy run on it). `progress(i, n, id)`
    after each floor prompt."""
    return bounds_from_measurement(measure_floor(config, weights, runs, progress))


@dataclass
class FloorMeasurement:
    """The plain forward against the HF simulation at the floor prompts: what the bounds are made of."""

    diffs: np.ndarray  # |plain - simulation| logit, every floor position and vocab entry (float64)
    ref_scale: float
    prompts: tuple[str, ...]
    margins: np.ndarray  # the reference's top-1/top-2 margin at each floor position
    plain_flipped: np.ndarray  # bool: the plain forward's greedy token is not the reference's there
    spread: float  # median over positions of the std of the reference logits


def measure_floor(config: dict, weights: dict, runs, progress=None) -> FloorMeasurement:
    diffs, scale, ids, margins, flipped, stds = [], 0.0, [], [], [], []
    runs = list(runs)
    for i, (prompt_id, prompt_ids, ref) in enumerate(runs):
        fl = floor_logits(config, weights, prompt_ids, ref).astype(np.float64)
        diffs.append(np.abs(fl - ref.logits.astype(np.float64)).ravel())
        scale = max(scale, float(np.abs(ref.logits).max()))
        ids.append(prompt_id)
        margins.append(ref.margins)
        flipped.append(np.argmax(fl, axis=-1) != ref.tokens)
        stds.append(ref.logits.astype(np.float64).std(axis=-1))
        if progress:
            progress(i + 1, len(runs), str(prompt_id))
    if not diffs:
        raise ValueError("the graph rung's floor needs at least one prompt")
    d = np.concatenate(diffs)
    if not np.isfinite(d).all():
        raise ValueError("the plain fp32 forward with fp16 storage gives non-finite logits: the model overflows "
                         "fp16 activations, so its graph-rung floor is undefined")
    return FloorMeasurement(d, scale, tuple(ids), np.concatenate(margins), np.concatenate(flipped),
                            float(np.median(np.concatenate(stds))))


def bounds_from_measurement(m: FloorMeasurement, statistic: str = "max") -> GraphBounds:
    """The bounds a floor measurement implies. `statistic` picks the floor: "max" (the rung's rule) or
    "q999" (the 99.9th percentile; bench/graph_bounds.py shows what the choice does to the smallest
    error the rung catches)."""
    if statistic not in ("max", "q999"):
        raise ValueError(f"floor statistic {statistic!r}: expected 'max' or 'q999'")
    q999 = float(np.quantile(m.diffs, 0.999))
    floor = float(m.diffs.max()) if statistic == "max" else q999
    b = bounds_from_floor(floor, m.ref_scale, q999, m.prompts, len(m.margins), spread=m.spread)
    close = m.margins < b.eps  # under the epsilon the floor itself derives
    return replace(b, floor_close=int(close.sum()), floor_flips=int((close & m.plain_flipped).sum()))


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
    flat_positions: int = 0  # close positions: the reference's top-1/top-2 margin is under eps
    max_logit_diff: float = 0.0  # max |engine - reference| logit over all positions and the vocab
    nan_positions: int = 0  # positions where the engine's logits hold NaN or inf
    floor_close: int = 0  # the bounds' count of close positions at the floor prompts (for the flip rule)
    floor_flips: int = 0  # and the plain forward's flips among them

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
    # the differences in float64 (exact for two float32 values), computed in the ufunc's own buffers: a
    # 152k vocabulary's rows are 22 MB of float64 a prompt, and every temporary of them costs milliseconds
    diff = np.subtract(eng_logits, ref.logits, dtype=np.float64)
    np.abs(diff, out=diff)
    if finite.size and finite.all():
        max_diff, chosen = float(diff.max()), np.argmax(eng_logits, axis=-1)
    else:  # a row with NaN or inf: its finite rows' differences, its tokens with NaN as the lowest logit
        max_diff = float(diff[finite].max()) if finite.any() else float("inf")
        chosen = [np.argmax(np.nan_to_num(row, nan=-np.inf)) for row in eng_logits]
    res = TokenResult(prompt_id, backend, ref.prompt_len, len(ref.tokens), 0, eps, bounds.max_logit_diff,
                      min_margin=float(margins.min()) if margins.size else float("inf"),
                      flat_positions=int((margins < eps).sum()),
                      max_logit_diff=max_diff,
                      nan_positions=int((~finite).sum()), floor_close=bounds.floor_close,
                      floor_flips=bounds.floor_flips)
    for step, (ref_tok, eng_tok) in enumerate(zip(ref.tokens, chosen)):
        ref_tok, eng_tok = int(ref_tok), int(eng_tok)
        if eng_tok == ref_tok:
            res.exact += 1
            continue
        margin = float(np.float64(ref.logits[step, ref_tok]) - np.float64(ref.logits[step, eng_tok]))
        d = Divergence(prompt_id, ref.prompt_len + step, step, ref_tok, eng_tok, margin)
        (res.near_ties if margin < eps else res.failures).append(d)
    return res


# --- the whole prompt set ---------------------------------------------------------------------------


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_greater(k1: int, n1: int, k2: int, n2: int) -> float:
    """One-sided p-value of Fisher's exact test that group 1's rate (k1 of n1) exceeds group 2's (k2 of n2):
    P(X >= k1) for X hypergeometric, drawing n1 of n1 + n2 items of which k1 + k2 are marked."""
    if not (0 <= k1 <= n1 and 0 <= k2 <= n2):
        raise ValueError(f"counts out of range: {k1} of {n1}, {k2} of {n2}")
    n, k = n1 + n2, k1 + k2
    if n1 == 0 or k1 == 0:
        return 1.0
    total = _log_comb(n, n1)
    terms = [_log_comb(k, x) + _log_comb(n - k, n1 - x) - total for x in range(k1, min(k, n1) + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


@dataclass(frozen=True)
class FlipVerdict:
    """The engine's near-tie flips over its close positions against the plain forward's at the floor prompts."""

    backend: str
    flips: int  # engine near-ties: greedy token flipped where the reference margin is under eps
    close: int  # compared positions whose reference margin is under eps
    floor_flips: int
    floor_close: int
    p_value: float  # Fisher's exact test, one-sided: the engine flips more often than the plain forward
    alpha: float = FLIP_TEST_ALPHA

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha

    def record(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def describe(self) -> str:
        def rate(k, n):
            return f"{k} of {n} ({100 * k / n:.1f}%)" if n else f"{k} of 0"
        verdict = ("within it" if self.passed else
                   "FAIL: the engine flips near-ties more often than a correct implementation does")
        return (f"near-tie flips on {self.backend}: engine {rate(self.flips, self.close)} close positions, the plain "
                f"fp32 forward with fp16 storage {rate(self.floor_flips, self.floor_close)} at the floor prompts; "
                f"Fisher's exact test, one-sided, p = {self.p_value:.3g} (fails under {self.alpha:g}): {verdict}")


def judge_flips(summary: "Summary") -> FlipVerdict:
    """The flip rule over one backend's totals (a Summary, which sums each prompt's record)."""
    return FlipVerdict(summary.backend, summary.near_ties, summary.close, summary.floor_flips, summary.floor_close,
                       fisher_greater(summary.near_ties, summary.close, summary.floor_flips, summary.floor_close))


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
    close: int = 0  # positions whose reference margin is under the epsilon
    prompt_ids: list = field(default_factory=list)  # the prompts compared (a -k or --prompts selection)
    floor_flips: int = 0  # the plain forward's flips at the floor prompts' close positions (the bounds')
    floor_close: int = 0

    def describe(self) -> str:
        return (f"graph rung on {self.backend}: {self.prompts} prompts ({self.failed_prompts} failed), "
                f"{self.positions} tokens ({self.close} close): {self.exact} exact, {self.near_ties} near-ties, {self.failures} "
                f"failures; smallest reference margin {self.min_margin:.4g}; max abs logit difference "
                f"{self.max_logit_diff:.4g} (allowed {self.allowed:.4g}, near-tie epsilon {self.eps:.4g})")


def summarize(results) -> list[Summary]:
    """One Summary per backend from TokenResults or their `record()` dicts."""
    out: dict[str, Summary] = {}
    for r in results:
        r = r.record() if isinstance(r, TokenResult) else r
        s = out.setdefault(r["backend"], Summary(r["backend"]))
        s.prompts += 1
        s.prompt_ids.append(r["prompt_id"])
        s.failed_prompts += not r["passed"]
        s.positions += r["positions"]
        s.exact += r["exact"]
        s.near_ties += len(r["near_ties"])
        s.failures += len(r["failures"])
        s.min_margin = min(s.min_margin, r["min_margin"])
        s.max_logit_diff = max(s.max_logit_diff, r["max_logit_diff"])
        s.allowed = min(s.allowed, r.get("allowed", float("inf")))
        s.eps = min(s.eps, r.get("eps", float("inf")))
        s.close += r.get("flat_positions", 0)
        s.floor_flips, s.floor_close = r.get("floor_flips", 0), r.get("floor_close", 0)
    return list(out.values())
