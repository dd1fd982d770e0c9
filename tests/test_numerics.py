"""The number formats of the integer core (sim/numerics.py) against independent references."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.numerics import (
    dequantize_activations, dequantize_weights, gemv, pack_int4, quantize_activations, quantize_weights,
    segment_size, unpack_int4,
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
    q, s = quantize_weights(w, group=32)
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
    q, s = quantize_weights(w, group=8)
    assert s[0, 0] == 0 and np.all(q[0] == 0)
    assert np.all(q[1] == -7) and s[1, 0] == np.float16(1 / 7)
    assert q[2, 0] == 7 and np.all(q[2, 1:] == 0)


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
