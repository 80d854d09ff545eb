"""Self-test of the graph rung's judge: ladder/judges/tokens.py on synthetic logits, and the prompt files.

A comparison that cannot fail is worse than none: a real mismatch must fail and say where, a near-tie
must be recorded and teacher-forced, NaN must fail, an engine that flips near-ties more often than the
plain forward must fail, and a model no check can judge must be refused. The
judge's bounds here are those a floor of FLOOR implies (ladder/judges/tokens.py `bounds_from_floor`); how a
real model's floor is measured is ladder/selftest/test_graph_bounds.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fixtures.prompts import PromptFileError, default_prompts_path, load_prompts, read_prompt_ids
from ladder.judges.tokens import (PAGE, Reference, Summary, bounds_from_floor, compare_greedy, engine_logits,
                           fisher_greater, judge_flips, new_tokens_for, summarize, tokens_to_generate, top2_margin)
from ladder.judges.tolerances import FLIP_TEST_ALPHA, MAX_ALLOWED_PER_SPREAD

V, N, PROMPT_LEN = 32, 12, 5
FLOOR = 0.01  # a model whose plain fp32 forward with fp16 storage is this far from the simulation
BOUNDS = bounds_from_floor(FLOOR, ref_scale=4.0)
NEAR_TIE_EPS = BOUNDS.eps


def clear_reference(seed: int = 0) -> Reference:
    """Reference logits whose top token leads the runner-up by a wide margin (many epsilons)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((N, V)).astype(np.float32)
    tokens = rng.integers(0, V, N)
    logits[np.arange(N), tokens] = logits.max(axis=1) + 40 * NEAR_TIE_EPS
    return Reference(PROMPT_LEN, np.argmax(logits, axis=1), logits)


def runner_up(ref: Reference, step: int) -> int:
    return int(np.argsort(ref.logits[step])[-2])


def test_identical_tokens_pass_exactly():
    ref = clear_reference()
    eng = ref.logits + np.float32(NEAR_TIE_EPS / 4)
    res = compare_greedy("p", ref, eng, backend="numpy", bounds=BOUNDS)
    assert res.passed and res.exact == N and not res.near_ties and not res.failures
    assert res.max_logit_diff == np.abs(eng.astype(np.float64) - ref.logits).max()
    assert res.min_margin == pytest.approx(float(top2_margin(ref.logits).min()))


def test_a_real_mismatch_fails_with_prompt_position_tokens_and_margin():
    ref = clear_reference()
    eng = ref.logits.copy()
    step = 7
    wrong = runner_up(ref, step)
    eng[step, wrong] = eng[step].max() + 1
    res = compare_greedy("p042", ref, eng, backend="numpy", bounds=BOUNDS)
    assert not res.passed and res.exact == N - 1 and not res.near_ties
    (d,) = res.failures
    margin = float(ref.logits[step, ref.tokens[step]]) - float(ref.logits[step, wrong])
    assert (d.prompt_id, d.position, d.step, d.ref_token, d.engine_token) == \
        ("p042", PROMPT_LEN + step, step, int(ref.tokens[step]), wrong)
    assert d.margin == pytest.approx(margin) and d.margin >= NEAR_TIE_EPS
    text = res.describe()
    for part in ("p042", f"position {PROMPT_LEN + step}", f"reference token {ref.tokens[step]}",
                 f"engine token {wrong}", f"margin {d.margin:.4g}", "FAIL"):
        assert part in text


def near_tie_reference(step: int) -> Reference:
    ref = clear_reference(1)
    other = runner_up(ref, step)
    ref.logits[step, other] = ref.logits[step, ref.tokens[step]] - NEAR_TIE_EPS / 8
    return ref


def test_a_near_tie_is_recorded_and_the_comparison_goes_on():
    step = 3
    ref = near_tie_reference(step)
    eng = ref.logits.copy()
    other = runner_up(ref, step)
    eng[step, other] = eng[step].max() + NEAR_TIE_EPS / 16  # the engine picks the runner-up
    eng[step + 2, runner_up(ref, step + 2)] = eng[step + 2].max() + 1  # and later really diverges
    res = compare_greedy("p7", ref, eng, backend="numpy", bounds=BOUNDS)
    (tie,) = res.near_ties
    assert (tie.position, tie.ref_token, tie.engine_token) == (PROMPT_LEN + step, int(ref.tokens[step]), other)
    assert tie.margin == float(ref.logits[step, tie.ref_token]) - float(ref.logits[step, other]) < NEAR_TIE_EPS
    # the positions after the near-tie are still compared: the later real divergence is found
    assert [f.step for f in res.failures] == [step + 2] and res.exact == N - 2 and not res.passed


def test_only_a_near_tie_passes():
    step = 3
    ref = near_tie_reference(step)
    eng = ref.logits.copy()
    eng[step, runner_up(ref, step)] = eng[step].max() + NEAR_TIE_EPS / 16
    res = compare_greedy("p7", ref, eng, bounds=BOUNDS)
    assert res.passed and len(res.near_ties) == 1 and res.exact == N - 1


def test_top2_margin_is_the_gap_between_the_two_largest_logits():
    """The margin every near-tie is judged by, against a partition of float64 copies, on rows with ties
    for the maximum (0), -inf, NaN (NaN), 1-D and 2-D, float32 (the difference exact in float64) and float64."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((6, 1000)).astype(np.float32)
    rows[1, [5, 700]] = rows[1].max() + 1  # the maximum tied
    rows[2, :] = -np.inf
    rows[2, 9] = 1.0  # one finite value: its margin is infinite
    rows[3, 17] = np.nan
    rows[4, :] = 2.5  # every value tied
    rows[5, 0] = np.float32(1e30)

    def partitioned(a):
        top = np.partition(np.asarray(a, dtype=np.float64), -2, axis=-1)[..., -2:]
        with np.errstate(invalid="ignore"):  # rows[2, :2] is -inf alone
            return top[..., 1] - top[..., 0]

    for a in (rows, rows.astype(np.float64), rows[0], rows[:, :2]):
        got = top2_margin(a)
        assert got.dtype == np.float64 and got.shape == a.shape[:-1]
        np.testing.assert_array_equal(got, partitioned(a))
    assert top2_margin(rows)[1] == 0 and top2_margin(rows)[4] == 0 and np.isnan(top2_margin(rows)[3])
    assert top2_margin(rows)[2] == np.inf


class FakeModel:
    """Records the tokens the engine side is fed; its logits prefer token (fed + 1) % V. The engine's own
    teacher forcing (Model.forced_logits against its step-by-step run) is the unit rung's
    test_forced_logits_are_the_step_by_step_logits."""

    def __init__(self):
        self.fed: list[int] = []

    def _logits(self, tok):
        row = np.zeros(V, np.float32)
        row[(tok + 1) % V] = 1
        return row

    def forced_logits(self, prompt_ids, tokens):
        self.fed += list(prompt_ids) + list(tokens[:-1])
        return np.stack([self._logits(t) for t in [prompt_ids[-1], *tokens[:-1]]])


def test_the_engine_is_teacher_forced_with_the_reference_tokens():
    ref_tokens = np.array([9, 4, 4, 20, 1])  # the engine would have said 10, 5, 5, 21, ... instead
    m = FakeModel()
    logits = engine_logits(m, [3, 8], ref_tokens)
    assert m.fed == [3, 8, 9, 4, 4, 20], "the engine must continue with the reference's tokens"
    assert logits.shape == (5, V) and list(np.argmax(logits, axis=1)) == [9, 10, 5, 5, 21]


def test_nan_in_the_engine_logits_fails():
    ref = clear_reference()
    eng = ref.logits.copy()
    eng[4, 0] = np.nan
    res = compare_greedy("p", ref, eng, bounds=BOUNDS)
    assert not res.passed and res.nan_positions == 1 and "NaN" in res.describe()


def _row_by_row(ref: Reference, eng: np.ndarray) -> tuple:
    """The judgement's definition, one row at a time: each row's token is its argmax with NaN the lowest
    logit (the first of equal maxima), and the largest difference is over the rows without NaN or inf."""
    finite = [bool(np.isfinite(row).all()) for row in eng]
    diffs = [float(np.abs(row.astype(np.float64) - r.astype(np.float64)).max())
             for row, r, ok in zip(eng, ref.logits, finite) if ok]
    tokens = [int(np.argmax(np.where(np.isnan(row), -np.inf, row))) for row in eng]
    return max(diffs) if diffs else float("inf"), tokens, finite.count(False)


@pytest.mark.parametrize("case", ["finite", "ties", "nan row", "inf", "all nan"])
def test_the_judgement_is_its_row_by_row_definition(case):
    """compare_greedy works on whole arrays (a 152k vocabulary's rows are 22 MB of float64 a prompt); its
    tokens, largest difference and NaN count are those of the row-by-row reading, bit for bit."""
    rng = np.random.default_rng(7)
    ref = clear_reference(3)
    eng = ref.logits + rng.standard_normal(ref.logits.shape).astype(np.float32) * np.float32(FLOOR)
    if case == "ties":  # equal maxima: the first index wins on both sides
        eng[2, :] = 1.0
        eng[5, [3, 9]] = eng[5].max() + 1
    elif case == "nan row":
        eng[4, 7] = np.nan
        eng[4, 8] = 1e3  # the row's token is read past its NaN
    elif case == "inf":
        eng[6, 1] = np.inf
        eng[7, 2] = -np.inf
    elif case == "all nan":
        eng[...] = np.nan
    res = compare_greedy("p", ref, eng, bounds=BOUNDS)
    max_diff, tokens, bad = _row_by_row(ref, eng)
    assert res.max_logit_diff == max_diff and res.nan_positions == bad
    flipped = {d.step: d.engine_token for d in res.near_ties + res.failures}
    assert [flipped.get(i, int(t)) for i, t in enumerate(ref.tokens)] == tokens
    assert res.exact == sum(int(t) == e for t, e in zip(ref.tokens, tokens))


def test_fishers_exact_test_matches_the_tea_tasting_table():
    # Fisher's lady tasting tea: 3 of 4 cups right against 1 of 4; one-sided p = (16 + 1) / 70
    assert fisher_greater(3, 4, 1, 4) == pytest.approx(17 / 70, rel=1e-12)
    assert fisher_greater(4, 4, 0, 4) == pytest.approx(1 / 70, rel=1e-12)
    assert fisher_greater(0, 50, 9, 40) == 1.0 and fisher_greater(3, 0 + 3, 0, 0) == 1.0
    # the same rates pass, the probability falls as the engine's rate pulls away from the floor's
    ps = [fisher_greater(k, 400, 10, 100) for k in (40, 80, 120, 160)]
    assert ps[0] > 0.4 and all(a > b for a, b in zip(ps, ps[1:])) and ps[-1] < 1e-6
    with pytest.raises(ValueError, match="out of range"):
        fisher_greater(5, 4, 0, 4)


def flips_reference(seed: int, close: int, flipped: int, bounds=BOUNDS):
    """A reference with `close` positions whose runner-up is under the epsilon, and engine logits that flip
    `flipped` of them (each by less than the allowed difference, as a correct engine may)."""
    ref = clear_reference(seed)
    eng = ref.logits.copy()
    for step in range(close):
        other = runner_up(ref, step)
        ref.logits[step, other] = ref.logits[step, ref.tokens[step]] - bounds.eps / 8
        eng[step] = ref.logits[step]
        if step < flipped:
            eng[step, other] = ref.logits[step, ref.tokens[step]] + bounds.eps / 16
    return ref, eng


@pytest.mark.parametrize("engine_flips, passes", [(0, True), (3, True), (20, False)])
def test_near_tie_flips_are_judged_against_the_plain_forwards_rate(engine_flips, passes):
    """The plain forward flipped 1 of its 20 close positions; 20 prompts of 2 close positions each."""
    floor = bounds_from_floor(FLOOR, 4.0, floor_close=20, floor_flips=1)
    records = []
    for i in range(20):
        ref, eng = flips_reference(i, close=2, flipped=min(2, max(0, engine_flips - 2 * i)), bounds=floor)
        res = compare_greedy(f"p{i}", ref, eng, "numpy", bounds=floor)
        assert res.passed, res.describe()  # a near-tie on its own passes its prompt's test
        records.append(res.record())
    (s,) = summarize(records)
    assert (s.close, s.floor_close, s.floor_flips) == (40, 20, 1) and s.near_ties == engine_flips
    verdict = judge_flips(s)
    assert verdict.passed == passes, verdict.describe()
    assert verdict.p_value == pytest.approx(fisher_greater(engine_flips, 40, 1, 20))
    text = verdict.describe()
    assert f"engine {engine_flips} of 40" in text and "1 of 20" in text
    assert ("FAIL" in text) != passes and f"{FLIP_TEST_ALPHA:g}" in text


def test_with_no_close_positions_there_is_nothing_to_flip():
    assert judge_flips(Summary("numpy", positions=30)).passed


@pytest.mark.parametrize("spread, judgeable", [(100 * FLOOR, True), (2 * FLOOR, False), (0.0, False)])
def test_a_model_whose_allowed_difference_rivals_its_logit_spread_is_refused(spread, judgeable):
    b = bounds_from_floor(FLOOR, ref_scale=4.0, spread=spread)  # allowed = 4 x floor + 8 ulp x 4
    assert b.judgeable == judgeable and b.judgeable == (b.max_logit_diff / spread <= MAX_ALLOWED_PER_SPREAD
                                                         if spread else False)
    if not judgeable:
        text = b.refusal()
        assert f"{b.max_logit_diff:.4g}" in text and "no check can tell them apart" in text
    assert bounds_from_floor(FLOOR, 4.0).judgeable, "bounds without a measured spread judge as before"


def test_summary_adds_up_per_backend():
    ref = clear_reference()
    eng = ref.logits.copy()
    eng[2, runner_up(ref, 2)] = eng[2].max() + 1
    results = [compare_greedy("a", ref, ref.logits, "numpy", bounds=BOUNDS),
               compare_greedy("b", ref, eng, "numpy", bounds=BOUNDS).record(),
               compare_greedy("a", ref, ref.logits, "cuda", bounds=BOUNDS)]
    by = {s.backend: s for s in summarize(results)}
    assert (by["numpy"].prompts, by["numpy"].failed_prompts, by["numpy"].exact, by["numpy"].failures) == (2, 1, 2 * N - 1, 1)
    assert by["cuda"].exact == N and by["cuda"].min_margin == pytest.approx(float(ref.margins.min()))
    assert (by["numpy"].allowed, by["numpy"].eps) == (BOUNDS.max_logit_diff, BOUNDS.eps)


@pytest.mark.parametrize("L", range(1, 3 * PAGE + 2))
def test_generation_crosses_the_next_page_boundary(L):
    n = new_tokens_for(L)
    boundary = (L // PAGE + 1) * PAGE
    assert L + n > boundary and 8 <= n <= PAGE + 8


# --- prompt files ---------------------------------------------------------------------------------


def test_the_default_prompt_set_has_what_the_rung_needs():
    from fixtures.tiny_coder import config

    prompts = load_prompts(default_prompts_path())
    lengths = [len(p.ids) for p in prompts]
    assert len(prompts) == 100 and min(lengths) == 1 and max(lengths) >= 256
    assert sum(L % PAGE in (PAGE - 1, 0, 1) and L >= PAGE - 1 for L in lengths) >= 20
    assert all(0 <= t < config().vocab_size for p in prompts for t in p.ids)
    assert read_prompt_ids(default_prompts_path()) == [p.id for p in prompts]


def test_text_prompts_are_tokenized_with_the_models_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    from engine.modelfile import ModelFile
    from fixtures.tiny_model import random_model_file

    path = random_model_file()
    tok = Tokenizer.from_str(ModelFile(path).file("tokenizer.json").decode())
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": 1, "text": "def f(x):\n"}) + "\n\n" + json.dumps({"id": "b", "ids": [4, 5]}) + "\n")
    a, b = load_prompts(f, path)
    assert (a.id, a.ids) == ("1", tuple(tok.encode("def f(x):\n").ids)) and (b.id, b.ids) == ("b", (4, 5))
    with pytest.raises(PromptFileError, match="needs the model"):
        load_prompts(f)


@pytest.mark.parametrize("lines, message", [
    ([{"id": "a", "ids": [1]}, {"id": "a", "ids": [2]}], "duplicate prompt id"),
    ([{"id": "a"}], "neither 'ids' nor 'text'"),
    ([{"ids": [1]}], "needs an 'id'"),
    ([{"id": "a", "ids": []}], "non-empty list"),
    ([{"id": "a", "ids": [1, -2]}], "non-negative"),
    (["{not json"], "not JSON"),
    ([], "no prompts"),
])
def test_bad_prompt_files_are_refused_by_line(tmp_path, lines, message):
    f = tmp_path / "bad.jsonl"
    f.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(PromptFileError, match=message):
        load_prompts(f)


def test_logits_drifting_past_the_allowed_difference_fail_even_with_equal_tokens():
    ref = clear_reference(1)
    eng = ref.logits.copy()
    eng[2, runner_up(ref, 2)] += np.float32(2 * BOUNDS.max_logit_diff)  # same greedy token, a drifted logit
    res = compare_greedy("p9", ref, eng, bounds=BOUNDS)
    assert res.exact == N and not res.failures and not res.passed
    assert f"> allowed {BOUNDS.max_logit_diff:.4g}" in res.describe()
    within = ref.logits.copy()
    within[2, runner_up(ref, 2)] += np.float32(0.9 * BOUNDS.max_logit_diff)
    assert compare_greedy("p9", ref, within, bounds=BOUNDS).passed


def test_the_epsilon_is_twice_the_allowed_difference_and_never_zero():
    assert BOUNDS.eps == 2 * BOUNDS.max_logit_diff and BOUNDS.max_logit_diff >= 4 * FLOOR
    exact = bounds_from_floor(0.0, ref_scale=30.0)  # a floor of 0 still leaves a few ulps of the logits
    assert 0 < exact.max_logit_diff == pytest.approx(exact.ulps * np.finfo(np.float32).eps * 30.0)
    assert bounds_from_floor(2 * FLOOR, 4.0).eps > BOUNDS.eps


@pytest.mark.parametrize("override", [None, 1, 40])
def test_new_tokens_override_the_page_rule(override):
    for L in (1, 15, 16, 100):
        assert tokens_to_generate(L, override) == (override or new_tokens_for(L))
