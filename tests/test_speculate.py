"""Speculative decoding on the host: prompt-lookup drafts, the acceptance rule and its statistics.

Drafting and greedy acceptance are checked with directed cases whose answers are written out. Sampled
acceptance is checked for the property that makes it correct, that the emitted ids have the plain-decoding
distribution, by chi-square tests on 20,000 seeded runs (the survival function is computed in closed form
here, as scipy is not a dependency). Every statistical test uses a fixed seed, so it is deterministic; the
stated significance level is the chance that a correct implementation would fail it with a random seed.
"""

import math

import numpy as np
import pytest

from firmware.sampling import Sampler, SamplingParams, next_token_distribution
from firmware.speculate import SpecStats, accept, draft

# The significance level of every chi-square test below: a correct implementation fails a given seed with
# probability 1e-3. The errors these tests exist to catch move the statistic far past that point: a correction
# drawn from p instead of the residual gives chi-square values in the thousands in every test below, and a
# penalty that ignores the accepted drafts about 150 (26 degrees of freedom) in the joint test.
ALPHA = 1e-3
N = 20_000

PLAIN = SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0)
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.15)


class FixedU:
    """A stand-in for a numpy Generator whose `random()` returns preset values, to pin down the order."""

    def __init__(self, *us):
        self.us = list(us)

    def random(self):
        return self.us.pop(0)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X chi-square with `df` degrees of freedom, in closed form.

    Even df = 2m: exp(−x/2)·Σ_{i<m} (x/2)^i/i!. Odd df = 2m+1: erfc(√(x/2)) + √(2x/π)·exp(−x/2)·Σ_{i<m}
    x^i/(1·3·…·(2i+1)).
    """
    if df % 2 == 0:
        term = total = 1.0
        for i in range(1, df // 2):
            term *= x / 2 / i
            total += term
        return math.exp(-x / 2) * total
    term, total = math.sqrt(2 * x / math.pi) * math.exp(-x / 2), math.erfc(math.sqrt(x / 2))
    for i in range(df // 2):
        total += term
        term *= x / (2 * i + 3)
    return total


def chi_square_check(counts: np.ndarray, probs: np.ndarray):
    """Assert that `counts` are a sample of `probs` (chi-square test at `ALPHA`); zero-probability cells must
    be empty, and every other cell must expect at least 5 counts for the chi-square approximation to hold."""
    counts, probs = np.asarray(counts).ravel(), np.asarray(probs).ravel()
    n = counts.sum()
    zero = probs == 0
    assert counts[zero].sum() == 0, f"ids of probability zero were emitted: {np.flatnonzero(zero & (counts > 0))}"
    expected = n * probs[~zero]
    assert expected.min() >= 5, f"test design: a cell expects only {expected.min():.1f} counts"
    stat = float(((counts[~zero] - expected) ** 2 / expected).sum())
    df = int((~zero).sum()) - 1
    assert chi2_sf(stat, df) > ALPHA, f"chi-square {stat:.1f} with {df} degrees of freedom"


def test_chi2_sf_matches_the_tables():
    # Upper 5 % and 0.1 % points of the chi-square distribution (any statistics table).
    for x, df, p in [(3.841459, 1, 0.05), (5.991465, 2, 0.05), (7.814728, 3, 0.05), (11.070498, 5, 0.05),
                     (20.515006, 5, 0.001), (49.801850, 35, 0.05), (59.703059, 30, 0.001)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=1e-5), (x, df)


# --- drafting ---------------------------------------------------------------------------------------------


def test_draft_repeated_phrase():
    # "7 8 9" occurred before, followed by "4 5"; the context ends with "7 8 9" again.
    assert draft([1, 7, 8, 9, 4, 5, 6, 7, 8, 9], 2) == [4, 5]
    assert draft([1, 7, 8, 9, 4, 5, 6, 7, 8, 9], 5) == [4, 5, 6, 7, 8]


def test_draft_prefers_the_longest_ngram():
    # The 1-gram [3] occurs most recently at index 5 (followed by 0), but the 2-gram [2, 3] at index 1
    # (followed by 4) is longer and wins.
    ctx = [1, 2, 3, 4, 9, 3, 0, 2, 3]
    assert draft(ctx, 1) == [4]
    assert draft(ctx, 1, max_ngram=1) == [0]


def test_draft_prefers_the_most_recent_match():
    # [5, 6] occurs at 0 (followed by 1) and at 3 (followed by 2): the later one wins.
    assert draft([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]


def test_draft_no_match_is_empty():
    assert draft([1, 2, 3, 4], 3) == []
    assert draft([], 3) == []
    assert draft([7], 3) == []                         # a lone id is its own suffix, never an earlier match
    assert draft([1, 2, 1, 2], 0) == []                # k = 0
    # min_ngram = 2: the unigram [2] has a match, but no 2-gram does.
    assert draft([2, 5, 3, 2], 3) == [5, 3, 2]
    assert draft([2, 5, 3, 2], 3, min_ngram=2) == []


def test_draft_k_and_the_end_of_the_context_limit_the_length():
    ctx = [4, 1, 2, 3, 4]
    assert draft(ctx, 1) == [1]
    assert draft(ctx, 3) == [1, 2, 3]
    assert draft(ctx, 10) == [1, 2, 3, 4]              # the context ends after four ids


def test_draft_may_overlap_the_suffix():
    # [2, 1, 2] matches at index 1 (index 3 is the suffix itself); what follows is [1, 2], which is part
    # of the suffix: periodic text drafts its own continuation.
    assert draft([1, 2, 1, 2, 1, 2], 4) == [1, 2]
    # A run of one id: the most recent earlier match of [5, 5, 5] starts one id before the suffix, so
    # however long the run, one id follows it.
    assert draft([5, 5, 5, 5], 3) == [5]
    assert draft([5, 5, 5, 5, 5, 5], 3) == [5]


def test_draft_takes_numpy_and_any_iterable():
    assert draft(np.array([3, 1, 3], dtype=np.int32), np.int64(2)) == [1, 3]
    assert draft(iter([3, 1, 3]), 2) == [1, 3]
    assert all(type(i) is int for i in draft(np.array([3, 1, 3]), 2))


@pytest.mark.parametrize("args, kwargs, error, message", [
    (([1, 2], -1), {}, ValueError, r"^k must be >= 0, not -1$"),
    (([1, 2], 2.0), {}, TypeError, r"^k must be an integer, not 2\.0$"),
    (([1, 2], True), {}, TypeError, r"^k must be an integer, not True$"),
    (([1, 2], 2), {"max_ngram": 0}, ValueError, r"^max_ngram must be >= 1, not 0$"),
    (([1, 2], 2), {"min_ngram": 0}, ValueError, r"^min_ngram must be >= 1, not 0$"),
    (([1, 2], 2), {"min_ngram": 1.0}, TypeError, r"^min_ngram must be an integer, not 1\.0$"),
    (([1, 2], 2), {"min_ngram": 3, "max_ngram": 2}, ValueError,
     r"^min_ngram must be <= max_ngram, not min_ngram=3, max_ngram=2$"),
    (([1, -2], 2), {}, ValueError, r"^context_ids\[1\] must be a token id >= 0, not -2$"),
    (([1, 2.0], 2), {}, TypeError, r"^context_ids\[1\] must be an integer token id, not 2\.0$"),
    (([1, False], 2), {}, TypeError, r"^context_ids\[1\] must be an integer token id, not False$"),
    (("12", 2), {}, TypeError, r"^context_ids must be a sequence of token ids, not '12'$"),
    ((5, 2), {}, TypeError, r"^context_ids must be a sequence of token ids, not 5$"),
])
def test_draft_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        draft(*args, **kwargs)


# --- acceptance, greedy -----------------------------------------------------------------------------------


def greedy_chain(rows, context, params):
    """Plain greedy decoding along the rows: id j is `Sampler`'s choice for row j after the ids before it."""
    sampler, chain = Sampler(params), []
    for row in rows:
        chain.append(sampler(row, context + chain))
    return chain


def test_greedy_accepts_the_argmax_chain_and_adds_the_bonus():
    gen = np.random.default_rng(1)
    for _ in range(20):
        rows = gen.normal(size=(5, 50))
        context = gen.integers(0, 50, 20).tolist()
        chain = greedy_chain(rows, context, GREEDY)
        assert accept(rows, context, chain[:4], GREEDY, rng=None) == chain


def test_greedy_stops_at_the_first_wrong_draft_with_the_greedy_id():
    gen = np.random.default_rng(2)
    for _ in range(10):
        rows = gen.normal(size=(5, 50))
        context = gen.integers(0, 50, 20).tolist()
        chain = greedy_chain(rows, context, GREEDY)
        for j in range(4):
            drafts = chain[:4]
            drafts[j] = (chain[j] + 1) % 50
            assert accept(rows, context, drafts, GREEDY, rng=None) == chain[:j] + [chain[j]], j


def test_greedy_penalty_counts_the_accepted_drafts():
    # Row 0 picks id 1 whatever the context. Row 1's raw argmax is id 1 (2.0 > 1.9), but after id 1 is
    # accepted it is in the context and penalised to 2/1.15 = 1.739 < 1.9: the greedy id is 2, as plain
    # decoding would give.
    rows = [[0.0, 5.0, 0.0], [0.0, 2.0, 1.9], [3.0, 0.0, 0.0]]
    assert accept(rows, [0], [1, 1], GREEDY, rng=None) == [1, 2]
    assert accept(rows, [0], [1, 2], GREEDY, rng=None) == [1, 2, 0]
    # Without the penalty the raw argmax is the greedy id.
    no_penalty = SamplingParams(temperature=0.0, repetition_penalty=1.0)
    assert accept(rows, [0], [1, 1], no_penalty, rng=None) == [1, 1, 0]
    # The context given at the call is penalised too: row 0 = [0, 2, 1.9] after id 1 picks id 2.
    assert accept(rows[1:], [1], [1], GREEDY, rng=None) == [2]


def test_greedy_consumes_no_random_numbers_and_ignores_rows_after_a_rejection():
    rng = np.random.default_rng(3)
    # Row 1 is not finite: it would be rejected if it were used, but draft 0 is rejected first.
    assert accept([[0.0, 1.0], [math.nan, 0.0]], [], [0], GREEDY, rng) == [1]
    assert rng.random() == np.random.default_rng(3).random()


def test_greedy_speculative_decoding_equals_plain_greedy_decoding():
    # A bigram "model" (logits depend on the last id only) whose greedy text falls into loops, which
    # prompt lookup then drafts. Speculative decoding must emit exactly plain greedy decoding's ids.
    table = np.random.default_rng(4).normal(size=(12, 12))
    prompt, n = [0, 5, 3], 60
    plain = list(prompt)
    sampler = Sampler(GREEDY)
    while len(plain) < len(prompt) + n:
        plain.append(sampler(table[plain[-1]], plain))
    spec, stats = list(prompt), SpecStats()
    while len(spec) < len(prompt) + n:
        drafts = draft(spec, 4)
        rows = table[(spec[-1:] + drafts)]           # row j: after spec + drafts[:j]
        out = accept(rows, spec, drafts, GREEDY, rng=None)
        stats.add(len(drafts), len(out))
        spec += out
    assert spec[:len(plain)] == plain
    assert stats.accepted > 0 and stats.passes < n    # the drafts saved verify passes


# --- acceptance, sampling ---------------------------------------------------------------------------------


def test_random_numbers_are_consumed_in_the_documented_order():
    # p0 = [0.5, 0.3, 0.2], p1 = [0.1, 0.6, 0.3], p2 = [0.2, 0.2, 0.6]; drafts [0, 1].
    rows = np.log([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    # u0 = 0.4 < 0.5 accepts id 0; u1 = 0.7 >= 0.6 rejects id 1; the residual [0.1, 0, 0.3] (cumulative
    # 0.1, 0.1, 0.4) at u2·0.4 = 0.2 gives id 2.
    u = FixedU(0.4, 0.7, 0.5)
    assert accept(rows, [], [0, 1], PLAIN, u) == [0, 2] and u.us == []
    # u1 = 0.59 < 0.6 accepts id 1 too; the bonus from p2 (cumulative 0.2, 0.4, 1.0) at 0.5 is id 2.
    u = FixedU(0.4, 0.59, 0.5)
    assert accept(rows, [], [0, 1], PLAIN, u) == [0, 1, 2] and u.us == []
    # Acceptance is strict: equal logits make p0 = 0.25 exactly, and u0 = 0.25 rejects id 0. The residual
    # [0, .25, .25, .25] (cumulative 0, .25, .5, .75) at 0.5·0.75 = 0.375 gives id 2.
    u = FixedU(0.25, 0.5)
    assert accept(np.zeros((2, 4)), [], [0], PLAIN, u) == [2] and u.us == []


def test_point_mass_distribution_accepts_without_dividing_by_zero():
    # top_p = 1e-9 keeps only the most likely id (id 1), so p0[1] == 1 and the residual would be empty.
    params = SamplingParams(temperature=1.0, top_p=1e-9, repetition_penalty=1.0)
    rows = [[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]]
    u = FixedU(1 - 2**-53, 0.5)                       # the largest uniform a Generator returns
    assert accept(rows, [], [1], params, u) == [1, 1] and u.us == []
    # A draft of probability zero is always rejected, and the residual is p itself.
    u = FixedU(0.0, 0.9)
    assert accept(rows, [], [0], params, u) == [1] and u.us == []


def test_k0_is_one_plain_decoding_step():
    # Same seed, same logits and context: accept with no drafts and Sampler give the same ids, step after
    # step, so they consume the generator identically.
    gen = np.random.default_rng(5)
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.3),
                   PLAIN, GREEDY):
        rng, sampler, context = np.random.default_rng(6), Sampler(params, seed=6), [1, 2, 3]
        for _ in range(30):
            row = gen.normal(size=16) * 2
            out = accept([row], context, [], params, rng)
            assert out == [sampler(row, context)]
            context += out


# A six-id vocabulary with moderate probabilities (every cell of the tests expects well over 5 counts).
P0 = np.array([0.10, 0.25, 0.05, 0.30, 0.12, 0.18])


def first_ids(rows, context, drafts, params, seed, n=N):
    """The first id `accept` emits, and whether draft 0 was accepted, over `n` runs from one generator."""
    rng = np.random.default_rng(seed)
    first, accepted = np.empty(n, dtype=np.int64), np.empty(n, dtype=bool)
    for t in range(n):
        out = accept(rows, context, drafts, params, rng)
        first[t], accepted[t] = out[0], len(out) > 1
    return first, accepted


@pytest.fixture(scope="module", params=[3, 2], ids=["likely-draft", "unlikely-draft"])
def plain_runs(request):
    d = request.param
    rows = np.log([P0, P0[::-1]])
    return d, first_ids(rows, [], [d], PLAIN, seed=10 + d)


def test_first_id_has_the_target_distribution(plain_runs):
    """T = 1, top-p 1, no penalty: softmax(log P0) = P0. The first emitted id is the draft with probability
    P0[d] and a residual draw otherwise; together they must be P0 (chi-square, 5 degrees of freedom, at ALPHA),
    for a likely (0.30) and an unlikely (0.05) draft."""
    _, (first, _) = plain_runs
    chi_square_check(np.bincount(first, minlength=6), P0)


def test_acceptance_rate_is_the_draft_probability(plain_runs):
    """A point-mass draft d is accepted with probability p[d]. Over N runs the count is binomial: within 5
    standard deviations, sqrt(N·p·(1−p)) (≈ 324 of 20,000 for p = 0.30, ≈ 154 for 0.05)."""
    d, (_, accepted) = plain_runs
    assert abs(accepted.sum() - N * P0[d]) <= 5 * math.sqrt(N * P0[d] * (1 - P0[d]))


def test_first_id_with_top_p_and_penalty():
    """T = 0.8, top-p 0.8, penalty 1.3, a context holding ids 1 and 3: the first id must follow
    `next_token_distribution` of row 0 for that context (some ids are outside the nucleus and must never
    appear), for a draft inside the nucleus and one outside it (never accepted); 5,000 runs each."""
    params = SamplingParams(temperature=0.8, top_p=0.8, repetition_penalty=1.3)
    context = [1, 3, 3]
    rows = np.log([P0, P0[::-1]])
    p = next_token_distribution(rows[0], context, params)
    assert 0 < np.count_nonzero(p) < 6                # the nucleus cuts some ids: the test covers top-p
    inside, outside = int(np.argmax(p)), int(np.argmin(p))
    for d, seed in ((inside, 20), (outside, 21)):
        first, accepted = first_ids(rows, context, [d], params, seed, n=N // 4)
        chi_square_check(np.bincount(first, minlength=6), p)
        if p[d] == 0:
            assert not accepted.any()


def test_first_two_ids_have_the_plain_decoding_joint_distribution():
    """Two ids emitted by speculative decoding of a bigram "model" (the logits of a position depend on the
    id before it only), with drafts [d0, d1] = [3, 1], T = 0.9, top-p 0.9, penalty 1.3 and a context
    ending in id 0: the pair (x1, x2) must have the distribution of plain decoding,
    P(x1, x2) = p(x1 | context) · p(x2 | context + [x1]), chi-square over the non-zero cells at ALPHA.

    The second id comes from row 1 of the first verify pass only when x1 == d0 (row 1 is the position
    after d0); when d0 is rejected the pass emits x1 alone, and x2 comes from a second pass whose row 0
    is the position after x1, as a decoder would run it. The penalty of x2 sees x1 either way. 10,000 runs."""
    table = np.log(np.random.default_rng(7).dirichlet(np.full(6, 8.0), size=6))
    params = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3)
    context, drafts = [2, 0], [3, 1]

    def rows(ctx, ds):
        return table[(ctx[-1:] + ds)]

    expected = np.zeros((6, 6))
    p1 = next_token_distribution(table[context[-1]], context, params)
    for x1 in range(6):
        expected[x1] = p1[x1] * next_token_distribution(table[x1], context + [x1], params)
    rng = np.random.default_rng(30)
    counts = np.zeros((6, 6), dtype=np.int64)
    for _ in range(N // 2):
        out = accept(rows(context, drafts), context, drafts, params, rng)
        if len(out) == 1:
            ctx = context + out
            out += accept(rows(ctx, drafts[1:]), ctx, drafts[1:], params, rng)
        counts[out[0], out[1]] += 1
    chi_square_check(counts, expected)


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, error, message", [
    ((np.zeros((2, 6)), [], [1, 2], PLAIN), ValueError, r"^logits_rows must have len\(drafts\) \+ 1 = 3 rows, not 2$"),
    (([np.zeros(6), np.zeros(5)], [], [1], PLAIN), ValueError,
     r"^logits_rows must be 1-D rows of one vocabulary size, not shapes \[\(6,\), \(5,\)\]$"),
    ((np.zeros(6), [], [], PLAIN), ValueError, r"^logits_rows must be one 1-D row per position, not shape \(6,\)$"),
    ((np.zeros((3, 6)), [], [1, 6], PLAIN), ValueError, r"^drafts\[1\] = 6 is outside the vocabulary \[0, 6\)$"),
    ((np.zeros((2, 6)), [], [-1], PLAIN), ValueError, r"^drafts\[0\] must be a token id >= 0, not -1$"),
    ((np.zeros((2, 6)), [], [1.0], PLAIN), TypeError, r"^drafts\[0\] must be an integer token id, not 1\.0$"),
    ((np.zeros((2, 6)), [], 1, PLAIN), TypeError, r"^drafts must be a sequence of token ids, not 1$"),
    ((np.zeros((2, 6)), [-1], [1], PLAIN), ValueError, r"^context_ids\[0\] must be a token id >= 0, not -1$"),
    ((np.zeros((2, 6)), [6], [1], PLAIN), ValueError, r"^context id 6 is outside the vocabulary \[0, 6\)$"),
    ((np.zeros((2, 6)), [], [1], 0.9), TypeError, r"^params must be a SamplingParams, not 0\.9$"),
    ((None, [], [1], PLAIN), TypeError, r"^logits_rows must be a sequence of logits rows, not None$"),
])
def test_accept_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        accept(*args, rng=np.random.default_rng(0))


def test_accept_needs_a_generator_when_sampling():
    with pytest.raises(TypeError, match=r"^rng must be a numpy\.random\.Generator, not 7$"):
        accept(np.zeros((1, 6)), [], [], PLAIN, 7)


# --- statistics -------------------------------------------------------------------------------------------


def test_spec_stats_counts_and_summary():
    stats = SpecStats()
    assert (stats.acceptance_rate, stats.tokens_per_pass) == (0.0, 0.0)
    stats.add(3, 2)     # one of three drafts accepted, plus the correction
    stats.add(0, 1)     # nothing drafted: a plain step
    stats.add(4, 5)     # all four accepted, plus the bonus
    assert stats == SpecStats(drafted=7, accepted=5, passes=3, emitted=8)
    assert stats.acceptance_rate == 5 / 7
    assert stats.tokens_per_pass == 8 / 3
    assert stats.summary() == "8 tokens in 3 verify passes (2.67 tokens/pass); 5/7 drafts accepted (71.4%)"


@pytest.mark.parametrize("drafted, emitted, error, message", [
    (2, 4, ValueError, r"^emitted must be <= drafted \+ 1 = 3, not 4$"),
    (2, 0, ValueError, r"^emitted must be >= 1, not 0$"),
    (-1, 1, ValueError, r"^drafted must be >= 0, not -1$"),
    (1.0, 1, TypeError, r"^drafted must be an integer, not 1\.0$"),
])
def test_spec_stats_bad_input(drafted, emitted, error, message):
    with pytest.raises(error, match=message):
        SpecStats().add(drafted, emitted)
