"""The number formats of the integer core (sim/numerics.py) against independent references."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.numerics
from sim.numerics import (
    SEARCH_FRACTIONS, dequantize_activations, dequantize_weights, gemv, pack_int4, quantize_activations,
    quantize_weights, segment_size, unpack_int4,
)


def spec_unpack(byte: int) -> tuple[int, int]:
    # The spec's dequantisation formula, written out for one byte.
    w0 = byte & 0x0F
    if w0 > 7:
        w0 -= 16
    w1 = byte >> 4
    if w1 > 7:
        w1 -= 16
    return w0, w1


def test_unpack_matches_spec_formula_for_every_byte():
    got = unpack_int4(np.arange(256, dtype=np.uint8)[None, :]).reshape(256, 2)
    assert [tuple(map(int, r)) for r in got] == [spec_unpack(b) for b in range(256)]


def test_pack_known_answers():
    # Low nibble first: [1, -1] -> 0xF1; [-8, 7] -> 0x78; all -8 -> 0x88.
    assert pack_int4(np.array([1, -1, -8, 7, -8, -8])).tolist() == [0xF1, 0x78, 0x88]


@given(st.lists(st.integers(-8, 7), min_size=0, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_pack_unpack_round_trip(values):
    q = np.array(values, dtype=np.int8)
    np.testing.assert_array_equal(unpack_int4(pack_int4(q)), q)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match=r"INT4 values must be in \[-8, 7\], got \[-9, 0\]"):
        pack_int4(np.array([-9, 0]))
    with pytest.raises(ValueError, match="even number of values"):
        pack_int4(np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="needs integers"):
        pack_int4(np.array([1.0, 2.0]))


def test_weight_quantisation_error_bound():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 100)) * rng.uniform(0.01, 2.0, size=(16, 1))
    q, s = quantize_weights(w, group=32, method="rtn")
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == (16, 4)
    assert q.min() >= -8 and q.max() <= 7
    # Round to nearest: within half a step of the (fp16-rounded) scale, except where the fp16 rounding of
    # the scale pushed max|w| / scale past 7 and the value was clipped (then within one step).
    err = np.abs(dequantize_weights(q, s, 32) - w)
    step = np.repeat(s.astype(np.float64), 32, axis=1)[:, :100]
    assert np.all(err <= step * 0.5 + step * 1e-3 * (np.abs(q) == 7))


def test_weight_quantisation_corner_cases():
    w = np.zeros((3, 8))
    w[1, :] = -1.0            # all equal negatives -> all -7
    w[2, 0] = 5.0             # one value, rest zero
    q, s = quantize_weights(w, group=8, method="rtn")
    assert s[0, 0] == 0 and np.all(q[0] == 0)
    assert np.all(q[1] == -7) and s[1, 0] == np.float16(1 / 7)
    assert q[2, 0] == 7 and np.all(q[2, 1:] == 0)


# --- the scale search (the packer's default) ------------------------------------------------------------------

def _group_errors(w, q, s, group):
    """Squared error of each (row, group) of the dequantised weights, [rows, groups]."""
    e = np.square(dequantize_weights(q, s, group) - w)
    ng = -(-w.shape[1] // group)
    return np.pad(e, ((0, 0), (0, ng * group - w.shape[1]))).reshape(w.shape[0], ng, group).sum(axis=2)


def _brute_force_scale(x):
    """The search written out for one group: every candidate scale fp16(c * max|x| / 7) in the documented order,
    its codes and error computed from the binary16 value, the first of the least errors."""
    amax = float(np.max(np.abs(x)))
    if amax == 0:
        return np.float16(0)
    best = None
    for c in SEARCH_FRACTIONS:
        scale = np.float16(c * amax / 7)
        q = np.clip(np.rint(x / float(scale)), -8, 7)
        err = float(np.sum(np.square(x - q * float(scale))))
        if best is None or err < best[0]:
            best = (err, scale)
    return best[1]


def test_search_candidates():
    # 1.00 down to 0.60 in steps of 0.01 and 7/8 (max|w| / 8), largest first: round-to-nearest's scale wins ties
    assert SEARCH_FRACTIONS[:3] == (1.0, 0.99, 0.98) and SEARCH_FRACTIONS[-1] == 0.6 and 0.875 in SEARCH_FRACTIONS
    assert list(SEARCH_FRACTIONS) == sorted(SEARCH_FRACTIONS, reverse=True) and len(SEARCH_FRACTIONS) == 42


def test_search_known_answers():
    w = np.zeros((5, 8))
    w[0, :] = -1.0                                   # all equal negatives: max|w| / 8 = 0.125 makes them -8, exactly
    w[1, :] = 1.0                                    # all equal positives: 7 is the largest code, so max|w| / 7
    w[2, :4] = [-7.0, 0.875, 1.75, 2.625]            # (-8, 1, 2, 3) x 0.875: exact with -8; rtn's scale 1 is not
    w[3, 0] = 5.0                                    # one value: round-to-nearest's scale, the only one giving 7
    q, s = quantize_weights(w, group=8)              # row 4: all zero
    assert s[0, 0] == 0.125 and np.all(q[0] == -8)
    assert s[1, 0] == np.float16(1 / 7) and np.all(q[1] == 7)
    assert s[2, 0] == 0.875 and q[2].tolist() == [-8, 1, 2, 3, 0, 0, 0, 0]
    assert s[3, 0] == np.float16(5 / 7) and q[3].tolist() == [7, 0, 0, 0, 0, 0, 0, 0]
    assert s[4, 0] == 0 and np.all(q[4] == 0)
    np.testing.assert_array_equal(dequantize_weights(q[[0, 2]], s[[0, 2]], 8), w[[0, 2]])   # no error at all
    # round-to-nearest on the same groups: -7 and the scale 1 leave an error the search does not
    q_rtn, s_rtn = quantize_weights(w, group=8, method="rtn")
    assert s_rtn[2, 0] == 1.0 and q_rtn[2].tolist() == [-7, 1, 2, 3, 0, 0, 0, 0]
    assert np.all(_group_errors(w, q, s, 8) <= _group_errors(w, q_rtn, s_rtn, 8))


def test_search_clips_the_largest_weight_when_that_pays():
    # one outlier over 15 ones: clipping the outlier to 7 lets the ones be 2 steps of a finer scale
    x = np.array([4.375] + [1.0] * 15)
    q, s = quantize_weights(x[None, :], group=16)
    assert s[0, 0] == _brute_force_scale(x) and s[0, 0] < np.float16(4.375 / 7)
    assert q[0, 0] == 7 and np.all(q[0, 1:] == 2)
    q_rtn, s_rtn = quantize_weights(x[None, :], group=16, method="rtn")
    assert _group_errors(x[None, :], q, s, 16)[0, 0] < 0.6 * _group_errors(x[None, :], q_rtn, s_rtn, 16)[0, 0]


@pytest.mark.parametrize("seed, kind, group", [
    (0, "normal", 32), (1, "t5", 128), (2, "t3", 64), (3, "outliers", 128), (4, "t5", 32), (5, "normal", 7),
])
def test_search_is_never_worse_than_round_to_nearest(seed, kind, group):
    """On every group of seeded random and heavy-tailed matrices (rows of very different magnitudes, a ragged last
    group): the search's squared error is at most round-to-nearest's, the scale is the brute-force one, and the
    codes are the stored scale's round-to-nearest (clipped)."""
    rng = np.random.default_rng(seed)
    rows, cols = 40, 300
    w = {"normal": lambda: rng.normal(size=(rows, cols)),
         "t5": lambda: rng.standard_t(5, size=(rows, cols)),
         "t3": lambda: rng.standard_t(3, size=(rows, cols)),
         "outliers": lambda: rng.normal(size=(rows, cols)) * np.where(rng.random(cols) < 0.02, 30.0, 1.0)}[kind]()
    w *= 10.0 ** rng.uniform(-4, 1, size=(rows, 1))
    q, s = quantize_weights(w, group)
    q_rtn, s_rtn = quantize_weights(w, group, method="rtn")
    err, err_rtn = _group_errors(w, q, s, group), _group_errors(w, q_rtn, s_rtn, group)
    assert np.all(err <= err_rtn), f"seed {seed}"
    assert err.sum() < 0.95 * err_rtn.sum(), f"seed {seed}"          # and it gains on the whole matrix
    assert q.dtype == np.int8 and s.dtype == np.float16 and q.min() >= -8 and q.max() <= 7
    scale = np.repeat(s.astype(np.float64), group, axis=1)[:, :cols]
    np.testing.assert_array_equal(q, np.clip(np.rint(w / scale), -8, 7))
    for r, g in [(0, 0), (7, 2), (rows - 1, s.shape[1] - 1)]:
        assert s[r, g] == _brute_force_scale(w[r, g * group:(g + 1) * group]), f"seed {seed}, row {r}, group {g}"
    # -8 is used: groups whose largest magnitude is negative take it where it lowers the error
    assert np.any(q == -8) and not np.any(q_rtn == -8)


def test_search_scales_are_binary16_candidates():
    # each stored scale is one candidate after its rounding to binary16, not the unrounded c * max|w| / 7
    rng = np.random.default_rng(6)
    w = rng.standard_t(4, size=(64, 256))
    _, s = quantize_weights(w, 64)
    amax = np.abs(w).reshape(64, 4, 64).max(axis=2)
    candidates = np.stack([(c * amax / 7).astype(np.float16) for c in SEARCH_FRACTIONS])
    assert np.all(np.any(candidates == s[None], axis=0))
    assert len(np.unique(np.argmax(candidates == s[None], axis=0))) > 5     # many candidates win somewhere


def test_search_in_chunks_is_the_same(monkeypatch):
    # the search runs over row chunks to bound its memory (E4B's 262,144 x 2,048 embedding); chunking changes nothing
    rng = np.random.default_rng(7)
    w = rng.standard_t(5, size=(37, 200))
    whole = quantize_weights(w, 32)
    monkeypatch.setattr(sim.numerics, "_SEARCH_CHUNK", 3 * 224)     # three rows of 7 padded groups at a time
    chunked = quantize_weights(w, 32)
    np.testing.assert_array_equal(whole[0], chunked[0])
    np.testing.assert_array_equal(whole[1], chunked[1])


def test_quantised_weights_quantise_to_themselves():
    # what firmware.accuracy.int4_exact relies on: the dequantised values pack again to the same values, for
    # either method (a group's largest value is 7 or 8 times its scale)
    rng = np.random.default_rng(8)
    w = rng.standard_t(3, size=(50, 256)) * 10.0 ** rng.uniform(-3, 1, size=(50, 1))
    w[3, 64:128] = 0.0
    for method in ("search", "rtn"):
        exact = dequantize_weights(*quantize_weights(w, 64, method), 64)
        np.testing.assert_array_equal(dequantize_weights(*quantize_weights(exact, 64, method), 64), exact)


def test_quantiser_arguments():
    with pytest.raises(ValueError, match=r"^method must be one of 'search', 'rtn', not 'gptq'$"):
        quantize_weights(np.zeros((2, 8)), 8, method="gptq")
    with pytest.raises(ValueError, match=r"^group must be a positive integer, not 0$"):
        quantize_weights(np.zeros((2, 8)), 0)
    with pytest.raises(ValueError, match=r"^a weight group's scale overflows binary16"):
        quantize_weights(np.full((1, 8), 1e6), 8)


@given(st.floats(min_value=1e-30, max_value=1e30, allow_subnormal=False))
def test_block_exponent_is_minimal(amax):
    # e is the smallest exponent with amax * 2**-e <= 127 (so the block uses 7 bits of magnitude).
    x = np.array([np.float32(amax)], dtype=np.float32)
    q, e = quantize_activations(x, block=1)
    a = float(x[0])
    assert math.ldexp(a, -int(e[0])) <= 127
    assert math.ldexp(a, -(int(e[0]) - 1)) > 127
    assert 64 <= abs(int(q[0])) <= 127


def test_activation_quantisation_is_exact_scaling_plus_rne():
    x = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -3.5, 0.0, 0.25], dtype=np.float32)
    q, e = quantize_activations(x, block=8)
    assert e.tolist() == [0]
    assert q.tolist() == [127, 0, 2, 2, 0, -4, 0, 0]  # ties to even
    x = np.array([300.0, 1.0], dtype=np.float32)      # 300 / 4 = 75 <= 127, 300 / 2 = 150 > 127
    q, e = quantize_activations(x, block=2)
    assert e.tolist() == [2] and q.tolist() == [75, 0]
    np.testing.assert_array_equal(dequantize_activations(q, e, 2), [300.0, 0.0])


def test_activation_errors():
    with pytest.raises(TypeError, match="activations are binary32"):
        quantize_activations(np.zeros(4), 4)
    with pytest.raises(ValueError, match="must be finite"):
        quantize_activations(np.array([np.inf], dtype=np.float32), 1)


def reference_gemv(q_w, s_w, q_a, e_a, group, block):
    """Scalar re-statement of the contract with Python floats: exact integer segment sums, then the
    binary32 operations done one by one with np.float32 scalars."""
    rows, cols = q_w.shape
    seg = min(group, block)
    out = []
    for r in range(rows):
        y = None
        for start in range(0, cols, seg):
            isum = sum(int(q_w[r, k]) * int(q_a[k]) for k in range(start, min(cols, start + seg)))
            part = np.float32(np.float32(isum) * np.float32(s_w[r, start // group]))
            part = np.float32(math.ldexp(float(part), int(e_a[start // block])))
            y = part if y is None else np.float32(y + part)
        out.append(y)
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("seed, rows, cols, group, block", [
    (0, 5, 64, 32, 32), (1, 3, 70, 32, 16), (2, 4, 48, 16, 32), (3, 2, 7, 8, 8), (4, 6, 128, 128, 64),
])
def test_gemv_is_the_contract(seed, rows, cols, group, block):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(rows, cols))
    x = (rng.normal(size=cols) * 10).astype(np.float32)
    x[rng.random(cols) < 0.3] = 0
    q_w, s_w = quantize_weights(w, group)
    q_a, e_a = quantize_activations(x, block)
    got = gemv(q_w, s_w, q_a, e_a, group=group, block=block)
    np.testing.assert_array_equal(got, reference_gemv(q_w, s_w, q_a, e_a, group, block))
    # And it approximates the exact product of the dequantised operands to a few binary32 roundings.
    exact = dequantize_weights(q_w, s_w, group) @ dequantize_activations(q_a, e_a, block)
    nseg = -(-cols // min(group, block))
    bound = 2 * nseg * np.finfo(np.float32).eps * (np.abs(dequantize_weights(q_w, s_w, group))
                                                   @ np.abs(dequantize_activations(q_a, e_a, block)))
    assert np.all(np.abs(got - exact) <= bound + 1e-30)


def test_gemv_corner_cases():
    # All -8 weights against saturated activations: the largest segment sums, still exact.
    q_w = np.full((2, 64), -8, dtype=np.int8)
    s_w = np.ones((2, 2), dtype=np.float16)
    q_a = np.full(64, 127, dtype=np.int8)
    q_a[32:] = -127
    e_a = np.array([0, 3], dtype=np.int32)
    y = gemv(q_w, s_w, q_a, e_a, group=32, block=32)
    assert y.tolist() == [-8 * 127 * 32 + 8 * 127 * 32 * 8] * 2
    # Zero rows and zero activations give exact zeros; accm adds to the existing values at the end.
    acc = np.array([1.5, -2.0], dtype=np.float32)
    z = gemv(np.zeros((2, 64), np.int8), s_w, q_a, e_a, group=32, block=32, acc=acc)
    np.testing.assert_array_equal(z, acc)


def test_sparse_skip_is_bit_identical():
    # Dropping the columns of zero activations (the sparse FFN layers) changes nothing.
    rng = np.random.default_rng(5)
    q_w, s_w = quantize_weights(rng.normal(size=(8, 256)), 64)
    x = np.zeros(256, dtype=np.float32)
    nz = rng.choice(256, 13, replace=False)
    x[nz] = rng.normal(size=13).astype(np.float32)
    q_a, e_a = quantize_activations(x, 64)
    keep = np.zeros(256, bool)
    keep[nz] = True
    q_w_sparse = np.where(keep[None, :], q_w, 0).astype(np.int8)
    np.testing.assert_array_equal(gemv(q_w, s_w, q_a, e_a, group=64, block=64),
                                  gemv(q_w_sparse, s_w, q_a, e_a, group=64, block=64))


def test_segment_size():
    assert segment_size(128, 64) == 64 and segment_size(32, 32) == 32
    with pytest.raises(ValueError, match=r"weight group \(48\) and activation block \(32\) must divide one another"):
        segment_size(48, 32)


@settings(max_examples=30)
@given(st.integers(0, 2**32 - 1))
def test_gemv_random_shapes_match_reference(seed):
    rng = np.random.default_rng(seed)
    group, block = (int(2 ** rng.integers(0, 5)) for _ in range(2))  # powers of two divide one another
    rows, cols = int(rng.integers(1, 5)), int(rng.integers(1, 40))
    q_w, s_w = quantize_weights(rng.normal(size=(rows, cols)), group)
    q_a, e_a = quantize_activations((rng.normal(size=cols) * 100).astype(np.float32), block)
    np.testing.assert_array_equal(gemv(q_w, s_w, q_a, e_a, group=group, block=block),
                                  reference_gemv(q_w, s_w, q_a, e_a, group, block))
