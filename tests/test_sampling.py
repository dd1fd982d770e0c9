"""Host-side sampling (spec section 6) against hand-computed distributions.

Every expected number here is written out by hand (penalised logits, softmax with `math.exp`, the
nucleus with its cumulative masses in a comment); nothing is compared with the code under test run a
second way.
"""

import math

import numpy as np
import pytest

from firmware.sampling import Sampler, SamplingParams, apply_repetition_penalty, draw, next_token_distribution

RHO = 1.15


def softmax_by_hand(values, temperature):
    scaled = [v / temperature for v in values]
    m = max(scaled)
    e = [math.exp(s - m) for s in scaled]
    total = sum(e)
    return [x / total for x in e]


def renormalised(probs, keep):
    mass = sum(probs[i] for i in keep)
    return [probs[i] / mass if i in keep else 0.0 for i in range(len(probs))]


class FixedU:
    """A stand-in for a numpy Generator whose `random()` returns preset values, to pin down `draw`."""

    def __init__(self, *us):
        self._us = list(us)

    def random(self):
        return self._us.pop(0)


# --- repetition penalty -----------------------------------------------------------------------------

LOGITS = [2.0, 1.0, 0.5, -1.0, -3.0]
CONTEXT = [0, 3]
# Only ids 0 and 3 occur in the context: the positive logit 2.0 is divided, the negative -1.0 multiplied.
PENALISED = [2.0 / 1.15, 1.0, 0.5, -1.15, -3.0]


def test_penalty_touches_only_context_ids():
    out = apply_repetition_penalty(np.array(LOGITS), CONTEXT, RHO)
    np.testing.assert_allclose(out, PENALISED, rtol=1e-12)
    assert out.dtype == np.float64


def test_penalty_returns_a_new_array():
    logits = np.array(LOGITS)
    out = apply_repetition_penalty(logits, CONTEXT, RHO)
    assert out is not logits
    np.testing.assert_array_equal(logits, LOGITS)  # the caller's logits are untouched


def test_penalty_applies_once_per_distinct_id():
    # Hugging Face gathers the logits of the context ids and scatters them back once: a token that
    # occurred three times is penalised by ρ, not ρ³.
    out = apply_repetition_penalty([3.0, -2.0, 1.0], [0, 0, 0, 1, 1], RHO)
    np.testing.assert_allclose(out, [3.0 / 1.15, -2.0 * 1.15, 1.0], rtol=1e-12)


def test_penalty_sign_rule():
    # Negative logits are multiplied (pushed further down), a zero logit is divided and stays zero.
    out = apply_repetition_penalty([-0.5, 0.0, 0.5], [0, 1, 2], 2.0)
    np.testing.assert_array_equal(out, [-1.0, 0.0, 0.25])


def test_penalty_accepts_numpy_context_and_float32_logits():
    out = apply_repetition_penalty(np.array([2.0, -1.0], dtype=np.float32), np.array([1], dtype=np.int32), 2.0)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [2.0, -2.0])


def test_empty_context_and_penalty_one_change_nothing():
    np.testing.assert_array_equal(apply_repetition_penalty(LOGITS, [], RHO), LOGITS)
    np.testing.assert_array_equal(apply_repetition_penalty(LOGITS, [0, 1, 2, 3, 4], 1.0), LOGITS)


# --- greedy -----------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0)
    # ids 1 and 2 tie at 3.0; the lower one wins.
    np.testing.assert_array_equal(next_token_distribution([1.0, 3.0, 3.0, 2.0], [], params), [0, 1, 0, 0])
    assert Sampler(params)([1.0, 3.0, 3.0, 2.0], []) == 1


def test_greedy_penalty_changes_the_argmax():
    params = SamplingParams(temperature=0.0, repetition_penalty=RHO)
    # Without context id 0 wins (2.0 > 1.9); with 0 in the context it becomes 2/1.15 = 1.739 < 1.9.
    assert Sampler(params)([2.0, 1.9, 0.0], []) == 0
    assert Sampler(params)([2.0, 1.9, 0.0], [0]) == 1
    np.testing.assert_array_equal(next_token_distribution([2.0, 1.9, 0.0], [0], params), [0, 1, 0])


def test_greedy_consumes_no_random_numbers():
    # A greedy step must not shift the random stream of a later sampled step.
    greedy = Sampler(SamplingParams(temperature=0.0), seed=3)
    for _ in range(5):
        greedy([0.0, 1.0], [])
    assert greedy._rng.random() == np.random.default_rng(3).random()


# --- temperature and top-p --------------------------------------------------------------------------


def test_distribution_t1_top_p_09():
    probs = softmax_by_hand(PENALISED, 1.0)
    # probs ≈ [0.5460, 0.2607, 0.1581, 0.0304, 0.0048], already in descending order. Mass strictly
    # before each: 0, 0.5460, 0.8067, 0.9649, 0.9952 — below 0.9 for ids 0, 1, 2 only.
    keep = {0, 1, 2}
    out = next_token_distribution(LOGITS, CONTEXT, SamplingParams(temperature=1.0, top_p=0.9))
    np.testing.assert_allclose(out, renormalised(probs, keep), rtol=1e-12)
    assert out.dtype == np.float64


def test_distribution_t2_top_p_09():
    probs = softmax_by_hand(PENALISED, 2.0)
    # A hotter softmax: probs ≈ [0.3908, 0.2701, 0.2103, 0.0922, 0.0366]; mass before each:
    # 0, 0.3908, 0.6609, 0.8713, 0.9634, so id 3 joins the nucleus and id 4 stays out.
    keep = {0, 1, 2, 3}
    out = next_token_distribution(LOGITS, CONTEXT, SamplingParams(temperature=2.0, top_p=0.9))
    np.testing.assert_allclose(out, renormalised(probs, keep), rtol=1e-12)


def test_nucleus_follows_probability_order_not_id_order():
    logits = [0.0, 3.0, 1.0, 2.0]
    probs = softmax_by_hand(logits, 1.0)
    # probs ≈ [0.0321, 0.6439, 0.0871, 0.2369]; sorted ids 1, 3, 2, 0 with mass before each
    # 0, 0.6439, 0.8808, 0.9679: ids 1, 3, 2 are kept, id 0 (the lowest id) is not.
    keep = {1, 3, 2}
    out = next_token_distribution(logits, [], SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.0))
    np.testing.assert_allclose(out, renormalised(probs, keep), rtol=1e-12)


def test_top_p_one_keeps_everything():
    probs = softmax_by_hand(PENALISED, 1.0)
    out = next_token_distribution(LOGITS, CONTEXT, SamplingParams(temperature=1.0, top_p=1.0))
    np.testing.assert_allclose(out, probs, rtol=1e-12)
    assert np.all(out > 0)


def test_tiny_top_p_keeps_exactly_the_most_likely_token():
    out = next_token_distribution(LOGITS, CONTEXT, SamplingParams(temperature=1.0, top_p=1e-9))
    np.testing.assert_array_equal(out, [1.0, 0.0, 0.0, 0.0, 0.0])


def test_mass_before_token_equal_to_p_excludes_it():
    # Equal logits give exactly 0.25 each (exp(0) = 1, 1/4 is exact), so the masses before ids 0..3
    # are exactly 0, 0.25, 0.5, 0.75. With p = 0.5, id 2's prefix mass equals p: it is excluded, and
    # the tie order (lower id first) decides that the nucleus is {0, 1}.
    params = SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.0)
    np.testing.assert_array_equal(next_token_distribution([0.0] * 4, [], params), [0.5, 0.5, 0.0, 0.0])
    # Just above 0.5, id 2 is in.
    params = SamplingParams(temperature=1.0, top_p=0.5000001, repetition_penalty=1.0)
    np.testing.assert_allclose(next_token_distribution([0.0] * 4, [], params), [1 / 3, 1 / 3, 1 / 3, 0.0],
                               rtol=1e-12)


def test_large_logits_do_not_overflow():
    # The max is subtracted before exp: logits of 1000 would overflow exp() otherwise.
    params = SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0)
    out = next_token_distribution([1000.0, 1000.0], [], params)
    np.testing.assert_array_equal(out, [0.5, 0.5])


# --- drawing ----------------------------------------------------------------------------------------


def test_draw_takes_first_cumulative_above_u_times_total():
    # Unnormalised [1, 1, 2]: cumulative [1, 2, 4], total 4.
    assert draw([1.0, 1.0, 2.0], FixedU(0.0)) == 0    # 0 < 1
    assert draw([1.0, 1.0, 2.0], FixedU(0.49)) == 1   # 1.96: first cumulative above it is 2
    assert draw([1.0, 1.0, 2.0], FixedU(0.5)) == 2    # 2.0 is not above 2 (strictly greater), so id 2
    assert draw([1.0, 1.0, 2.0], FixedU(0.999)) == 2


def test_draw_never_returns_a_zero_probability_id():
    assert draw([0.0, 1.0, 0.0, 1.0], FixedU(0.0)) == 1
    assert draw([0.0, 1.0, 0.0, 1.0], FixedU(0.5)) == 3
    assert draw([0.0, 1.0, 0.0, 0.0], FixedU(0.9999999)) == 1


def test_sampler_uses_one_uniform_per_token():
    # The documented draw, with the generator's first uniform: probs for T=1, p=0.9 from the first test.
    probs = renormalised(softmax_by_hand(PENALISED, 1.0), {0, 1, 2})
    u = np.random.default_rng(7).random()
    cumulative = [sum(probs[:i + 1]) for i in range(len(probs))]
    expected = next(i for i, c in enumerate(cumulative) if c > u)
    assert Sampler(SamplingParams(), seed=7)(LOGITS, CONTEXT) == expected


def test_seeded_reproducibility():
    logits = np.linspace(-1.0, 1.0, 16)
    params = SamplingParams(temperature=1.5, top_p=0.95, repetition_penalty=1.0)

    def run(seed):
        sampler = Sampler(params, seed=seed)
        return [sampler(logits, []) for _ in range(50)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_empirical_frequencies_match_hand_computed_probabilities():
    # softmax(log p) = p, so these logits give exactly the distribution [0.1, 0.2, 0.3, 0.4] at T = 1.
    logits = [math.log(0.1), math.log(0.2), math.log(0.3), math.log(0.4)]
    n = 20_000

    def counts(params, seed):
        sampler = Sampler(params, seed=seed)
        return np.bincount([sampler(logits, []) for _ in range(n)], minlength=4)

    def check(observed, expected):
        for i, (c, p) in enumerate(zip(observed, expected, strict=True)):
            # Binomial count: mean n·p, standard deviation sqrt(n·p·(1−p)); 5 sigma.
            assert abs(c - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (i, c, n * p)

    check(counts(SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0), 11), [0.1, 0.2, 0.3, 0.4])
    # With p = 0.6: sorted ids 3, 2, 1, 0 have mass before 0, 0.4, 0.7, 0.9, so only ids 3 and 2 stay,
    # renormalised to 0.4/0.7 = 4/7 and 0.3/0.7 = 3/7; ids 0 and 1 must never appear.
    observed = counts(SamplingParams(temperature=1.0, top_p=0.6, repetition_penalty=1.0), 12)
    assert observed[0] == observed[1] == 0
    check(observed, [0.0, 0.0, 3 / 7, 4 / 7])


# --- parameter validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, r"^temperature must be a finite number >= 0, not -0\.1$"),
    ({"temperature": math.inf}, r"^temperature must be a finite number >= 0, not inf$"),
    ({"temperature": math.nan}, r"^temperature must be a finite number >= 0, not nan$"),
    ({"top_p": 0.0}, r"^top_p must be in \(0, 1\], not 0\.0$"),
    ({"top_p": 1.5}, r"^top_p must be in \(0, 1\], not 1\.5$"),
    ({"repetition_penalty": 0.0}, r"^repetition_penalty must be a finite number > 0, not 0\.0$"),
    ({"repetition_penalty": -1.15}, r"^repetition_penalty must be a finite number > 0, not -1\.15$"),
])
def test_params_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": "1.0"}, r"^temperature must be a real number, not '1\.0'$"),
    ({"top_p": True}, r"^top_p must be a real number, not True$"),
    ({"repetition_penalty": None}, r"^repetition_penalty must be a real number, not None$"),
])
def test_params_type_errors(kwargs, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)


def test_params_defaults_are_the_spec():
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.15)


@pytest.mark.parametrize("logits, message", [
    (np.zeros((2, 3)), r"^logits must be a 1-D array over the vocabulary, not shape \(2, 3\)$"),
    (np.zeros(()), r"^logits must be a 1-D array over the vocabulary, not shape \(\)$"),
    (np.zeros(0), r"^logits must not be empty$"),
    (np.array([0.0, np.nan]), r"^logits must be finite, but logits\[1\] is nan$"),
    (np.array([-np.inf, 0.0]), r"^logits must be finite, but logits\[0\] is -inf$"),
])
def test_logits_value_errors(logits, message):
    with pytest.raises(ValueError, match=message):
        apply_repetition_penalty(logits, [], RHO)
    with pytest.raises(ValueError, match=message):
        Sampler()(logits, [])


def test_logits_type_error():
    with pytest.raises(TypeError, match=r"^logits must be an array of real numbers, not dtype complex128$"):
        Sampler()(np.zeros(3, dtype=complex), [])


@pytest.mark.parametrize("context, message", [
    ([0, 5], r"^context id 5 is outside the vocabulary \[0, 5\)$"),
    ([-1], r"^context id -1 is outside the vocabulary \[0, 5\)$"),
])
def test_context_value_errors(context, message):
    with pytest.raises(ValueError, match=message):
        apply_repetition_penalty(LOGITS, context, RHO)
    with pytest.raises(ValueError, match=message):
        Sampler(SamplingParams(temperature=0.0))(LOGITS, context)


def test_context_type_error():
    with pytest.raises(TypeError, match=r"^context ids must be integers, not 1\.0$"):
        apply_repetition_penalty(LOGITS, [1.0], RHO)


def test_penalty_argument_errors():
    with pytest.raises(ValueError, match=r"^repetition_penalty must be a finite number > 0, not 0$"):
        apply_repetition_penalty(LOGITS, [], 0)


def test_draw_errors():
    with pytest.raises(ValueError, match=r"^probs must have a positive finite sum, not 0\.0$"):
        draw([0.0, 0.0], FixedU(0.5))


def test_sampler_argument_errors():
    with pytest.raises(TypeError, match=r"^params must be a SamplingParams, not 0\.9$"):
        Sampler(0.9)
    with pytest.raises(TypeError, match=r"^seed must be an integer, not 1\.5$"):
        Sampler(seed=1.5)
    with pytest.raises(ValueError, match=r"^seed must be >= 0, not -1$"):
        Sampler(seed=-1)
