"""Token comparison of the graph rung (DESIGN.md, "Token comparison"): engine greedy tokens against the
HF simulation's, with near-ties judged by the reference's logit margin and teacher forcing after them.

    ref = reference_greedy(hf, prompt_ids, n_new)          # HF float32, its own KV cache, once per prompt
    logits = engine_logits(model, prompt_ids, ref.tokens)   # engine, fed the reference's tokens
    result = compare_greedy("p017", ref, logits, backend="numpy")
    assert result.passed, result.describe()
    flat = flatness([ref, ...])                              # refuse a model too flat to judge

Identical greedy tokens pass. At a mismatch, `margin = ref_logits[ref_token] - ref_logits[engine_token]`
decides: under NEAR_TIE_EPS it is a near-tie (recorded), otherwise a failure (prompt id, position, both
tokens, margin). Either way the comparison goes on with the reference's token on both sides (teacher
forcing), so one run reports every diverging position. Because both sides always continue with the
reference's token, the reference never depends on the engine: it runs once per prompt and serves every
backend, and the engine's logits at each position are those of one prefill plus decode steps fed with
the reference's tokens. The engine's greedy token at a position is the argmax of its fp32 logits, lowest
index on a tie (the `argmax` op's contract).

Stop ids are ignored: both sides generate exactly `n_new` tokens, so every prompt crosses the page
boundaries it was sized to cross.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from engine.config import PAGE_SIZE
from ladder.tolerances import MAX_LOGIT_DIFF, MAX_NEAR_TIE_FRACTION, NEAR_TIE_EPS

PAGE = PAGE_SIZE


def new_tokens_for(prompt_len: int, page: int = PAGE, beyond: int = 8) -> int:
    """How many tokens to generate so the sequence crosses the next page boundary after the prompt.

    The next boundary is the first multiple of `page` above `prompt_len`; generation continues `beyond`
    tokens past it (8 to 24 new tokens on 16-token pages), so the engine writes into a fresh page and
    then reads it back for several steps.
    """
    boundary = (prompt_len // page + 1) * page
    return boundary - prompt_len + beyond


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
    near_ties: list[Divergence] = field(default_factory=list)
    failures: list[Divergence] = field(default_factory=list)
    min_margin: float = float("inf")  # smallest reference top-1/top-2 margin over the positions
    flat_positions: int = 0  # positions whose reference top-1/top-2 margin is under eps
    max_logit_diff: float = 0.0  # max |engine - reference| logit over all positions and the vocab
    nan_positions: int = 0  # positions where the engine's logits hold NaN or inf
    eps: float = NEAR_TIE_EPS

    @property
    def logits_drifted(self) -> bool:
        """Engine logits further from the reference than the near-tie rule assumes (MAX_LOGIT_DIFF)."""
        return self.max_logit_diff > MAX_LOGIT_DIFF

    @property
    def passed(self) -> bool:
        return not self.failures and not self.nan_positions and not self.logits_drifted

    def describe(self) -> str:
        head = (f"graph[{self.prompt_id}] on backend {self.backend!r}: prompt of {self.prompt_len} tokens, "
                f"{self.positions} new tokens: {self.exact} exact, {len(self.near_ties)} near-ties, "
                f"{len(self.failures)} failures; smallest reference margin {self.min_margin:.4g}, max abs "
                f"logit difference {self.max_logit_diff:.4g}")
        lines = [head]
        if self.nan_positions:
            lines.append(f"  NaN or inf in the engine's logits at {self.nan_positions} positions")
        if self.logits_drifted:
            lines.append(f"  FAIL max abs logit difference {self.max_logit_diff:.4g} > MAX_LOGIT_DIFF {MAX_LOGIT_DIFF} "
                         f"(half the near-tie epsilon: beyond it a flipped token could pass as a near-tie)")
        for d in self.failures[:5]:
            lines.append(f"  FAIL {d} >= near-tie epsilon {self.eps}")
        if len(self.failures) > 5:
            lines.append(f"  ... and {len(self.failures) - 5} more failing positions")
        for d in self.near_ties[:5]:
            lines.append(f"  near-tie {d} < {self.eps}; teacher-forced")
        return "\n".join(lines)

    def record(self) -> dict:
        """A plain dict for the report (pytest user_properties travel between xdist workers as such)."""
        d = asdict(self)
        d["passed"] = self.passed
        d["near_ties"] = [asdict(x) for x in self.near_ties]
        d["failures"] = [asdict(x) for x in self.failures]
        return d


def compare_greedy(prompt_id: str, ref: Reference, eng_logits, backend: str = "?",
                   eps: float = NEAR_TIE_EPS) -> TokenResult:
    """Compare the engine's greedy tokens (argmax of `eng_logits` [N, V]) with the reference's."""
    eng_logits = np.asarray(eng_logits, dtype=np.float32)
    if eng_logits.shape != ref.logits.shape:
        raise ValueError(f"engine logits {eng_logits.shape} and reference logits {ref.logits.shape} differ in shape")
    margins = ref.margins
    finite = np.isfinite(eng_logits).all(axis=-1)
    diff = np.abs(eng_logits.astype(np.float64) - ref.logits.astype(np.float64))
    res = TokenResult(prompt_id, backend, ref.prompt_len, len(ref.tokens), 0,
                      min_margin=float(margins.min()) if margins.size else float("inf"),
                      flat_positions=int((margins < eps).sum()),
                      max_logit_diff=float(diff[finite].max()) if finite.any() else float("inf"),
                      nan_positions=int((~finite).sum()), eps=eps)
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
    eps: float = NEAR_TIE_EPS
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
                   "refuses it (DESIGN.md, Token comparison)" if self.refused else "within the limit")
        return (f"graph rung: {self.flat} of {self.positions} reference positions ({100 * self.fraction:.2f}%) "
                f"have a top-1/top-2 margin under the near-tie epsilon {self.eps} (limit "
                f"{100 * self.max_fraction:.0f}%); smallest margin {self.min_margin:.4g}: {verdict}")


def flatness(refs, eps: float = NEAR_TIE_EPS, max_fraction: float = MAX_NEAR_TIE_FRACTION) -> Flatness:
    """The flat-model rule over every compared position of every prompt's reference run."""
    margins = np.concatenate([r.margins for r in refs]) if refs else np.zeros(0)
    return Flatness(int(margins.size), int((margins < eps).sum()),
                    float(margins.min()) if margins.size else float("inf"), eps, max_fraction)


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

    def describe(self) -> str:
        return (f"graph rung on {self.backend}: {self.prompts} prompts ({self.failed_prompts} failed), "
                f"{self.positions} tokens: {self.exact} exact, {self.near_ties} near-ties, {self.failures} "
                f"failures; smallest reference margin {self.min_margin:.4g}; max abs logit difference "
                f"{self.max_logit_diff:.4g}")


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
    return list(out.values())
