"""sim.sfu against float64 NumPy: every function within the error bound docs/sfu.md states, over dense
sweeps and edge values (0, ±subnormals, ±inf, NaN, huge and tiny magnitudes, large RoPE phases).

ulp is the binary32 spacing at the exact result (2**-149 in the subnormal range). Results whose exact value
overflows binary32 must be inf. The references are independent float64 formulas (the turn functions fold
the integer turn exactly first, so float64 keeps relative accuracy near the zeros)."""

import math

import numpy as np
import pytest

from hdl.config import PRESETS
from sim import sfu

F32 = np.float32
MAX32 = 2.0 ** 128 * (1 - 2.0 ** -25)       # the smallest magnitude that rounds to inf


def ulp(y):
    a = np.abs(np.asarray(y, np.float64))
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -126)))
    return 2.0 ** (e - 23)


def assert_within(name, got, ref, ulps, abs_floor=0.0):
    """|got - ref| <= ulps * max(ulp(ref), abs_floor); overflowing references need ±inf; NaN refs need NaN."""
    got = np.asarray(got)
    assert got.dtype == np.float32, f"{name} returned {got.dtype}"
    ref = np.asarray(ref, np.float64)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{name}: NaN-ness")
    over = ~nan & (np.abs(ref) >= MAX32)
    np.testing.assert_array_equal(got[over], np.where(ref[over] > 0, np.inf, -np.inf).astype(np.float32),
                                  err_msg=f"{name}: overflow must give inf")
    m = ~nan & ~over
    err = np.abs(got[m].astype(np.float64) - ref[m]) / np.maximum(ulp(ref[m]), abs_floor)
    worst = int(np.argmax(err)) if err.size else 0
    assert err.size == 0 or err[worst] <= ulps, \
        f"{name}: {err[worst]:.3f} ulp > {ulps} at input index {np.flatnonzero(m)[worst]} " \
        f"(got {got[m][worst]!r}, want {ref[m][worst]!r})"


EDGE = np.array([0.0, -0.0, 2.0 ** -149, -(2.0 ** -149), 2.0 ** -126 * (1 - 2.0 ** -23), 2.0 ** -126, -(2.0 ** -126),
                 1e-30, -1e-30, 1e-7, 1.0, -1.0, 2.0, 0.5, 3.0, 1e30, -1e30, 3.4028234663852886e38,
                 -3.4028234663852886e38, np.inf, -np.inf, np.nan], dtype=np.float32)


def sweep(rng, n=200_000):
    """Positive magnitudes over every binade plus a dense linear range."""
    return np.concatenate([2.0 ** rng.uniform(-149, 128, n), rng.uniform(0, 4, n)]).astype(np.float32)


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(2024)


@pytest.mark.parametrize("name", ["recip", "rsqrt", "sqrt"])
def test_recip_and_roots(name, rng):
    x = np.concatenate([sweep(rng), -sweep(rng)[:1000], EDGE])
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        ref = {"recip": 1 / x64, "rsqrt": 1 / np.sqrt(x64), "sqrt": np.sqrt(x64)}[name]
    got = getattr(sfu, name)(x)
    assert_within(name, got, ref, 1.5)
    zeros = x == 0
    np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(ref[zeros].astype(np.float32)),
                                  err_msg=f"{name}: sign of the ±0 / ±inf results")


def test_recip_exact_powers_of_two():
    k = np.arange(-126, 128)
    x = np.ldexp(F32(1), k).astype(np.float32)
    np.testing.assert_array_equal(sfu.recip(x), np.ldexp(F32(1), -k).astype(np.float32))


def test_exp(rng):
    x = np.concatenate([rng.uniform(-110, 95, 400_000), rng.uniform(-30, 0, 200_000),     # softmax range
                        rng.uniform(-1e-3, 1e-3, 10_000), 2.0 ** rng.uniform(-149, -10, 10_000)]).astype(np.float32)
    x = np.concatenate([x, EDGE, np.float32([88.72283, 88.72284, -87.33654, -103.0, -103.98, -104.0, 1e10, -1e10])])
    with np.errstate(all="ignore"):
        ref = np.exp(x.astype(np.float64))
    got = sfu.exp(x)
    normal = (ref >= 2.0 ** -126) | np.isnan(ref) | (ref >= MAX32)
    assert_within("exp (normal results)", got[normal], ref[normal], 1.5)
    # Subnormal results round twice (the binary32 polynomial, then ldexp): within 1 subnormal ulp.
    assert_within("exp (subnormal results)", got[~normal], ref[~normal], 1.0)
    assert sfu.exp(F32(0)) == 1 and sfu.exp(F32(-0.0)) == 1
    assert sfu.exp(F32(-np.inf)) == 0 and sfu.exp(F32(np.inf)) == np.inf


def test_exp_softmax_row_sums_to_one(rng):
    s = rng.standard_normal(4096).astype(np.float32) * F32(8)
    e = sfu.exp(s - s.max())
    assert e.max() == 1 and np.all(e >= 0)
    ref = np.exp((s - s.max()).astype(np.float64))      # the binary32 difference is the input
    np.testing.assert_allclose(e / e.sum(dtype=np.float64), ref / ref.sum(), rtol=3e-7, atol=0)


def test_tanh(rng):
    x = np.concatenate([rng.uniform(-20, 20, 300_000), rng.uniform(-1, 1, 200_000) * 2.0 ** rng.uniform(-30, 0, 200_000),
                        EDGE, np.float32([9.0, 9.01, 9.02, 15.999999, 16.0, 2.0 ** -12, 2.0 ** -12 * (1 - 2.0 ** -24)])])
    x = x.astype(np.float32)
    got = sfu.tanh(x)
    assert_within("tanh", got, np.tanh(x.astype(np.float64)), 1.5)
    assert np.all(np.abs(got[~np.isnan(got)]) <= 1)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(x))


def gelu64(x):
    x = np.asarray(x, np.float64)
    v = -2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    with np.errstate(all="ignore"):
        return x / (1 + np.exp(v)), v          # = 0.5 x (1 + tanh(-v/2)), without float64 cancellation


def test_gelu_tanh(rng):
    x = np.concatenate([rng.uniform(-14, 14, 400_000), rng.standard_normal(100_000) * 2.0 ** rng.uniform(-30, 3, 100_000),
                        EDGE]).astype(np.float32)
    got = sfu.gelu_tanh(x)
    ref, v = gelu64(x)
    fin = np.isfinite(x)
    big = fin & (np.abs(ref) >= 1e-30)
    rel = np.abs(got[big].astype(np.float64) - ref[big]) / np.abs(ref[big])
    bound = (6 + 4 * np.abs(v[big])) * 2.0 ** -24     # v itself carries ~4 roundings
    worst = int(np.argmax(rel / bound))
    assert rel[worst] <= bound[worst], f"gelu: relative {rel[worst]:.3g} > {bound[worst]:.3g} at x = {x[big][worst]}"
    small = fin & ~big
    assert np.all(np.abs(got[small].astype(np.float64) - ref[small]) <= 1e-30)
    assert sfu.gelu_tanh(F32(np.inf)) == np.inf and sfu.gelu_tanh(F32(-np.inf)) == 0 and np.isnan(sfu.gelu_tanh(F32(np.nan)))
    # The ISS's binary32 formula agrees to a few ulp where it does not cancel (x > -2).
    xs = np.linspace(-2, 8, 10001, dtype=np.float32)
    iss = F32(0.5) * xs * (F32(1) + np.tanh(F32(math.sqrt(2 / math.pi)) * (xs + F32(0.044715) * xs * xs * xs)))
    np.testing.assert_allclose(sfu.gelu_tanh(xs), iss, rtol=1e-5, atol=1e-7)


def turn_sin_ref(t, cosine=False):
    """sin/cos(2 pi t / 2**64) with the turn folded exactly in integers before float64."""
    out = np.empty(len(t))
    for i, v in enumerate(int(u) for u in t):
        if cosine:
            v = (v + (1 << 62)) % (1 << 64)
        s = 1.0
        if v >= 1 << 63:                       # sin(-a) = -sin(a)
            v, s = (1 << 64) - v, -1.0
        if v > 1 << 62:                        # sin(pi - a) = sin(a)
            v = (1 << 63) - v
        out[i] = s * math.sin(2 * math.pi * (v / 2.0 ** 64)) if v <= 1 << 61 else \
            s * math.cos(2 * math.pi * (((1 << 62) - v) / 2.0 ** 64))
    return out


def test_sin_cos_turns(rng):
    t = rng.integers(0, 2 ** 64, 100_000, dtype=np.uint64)
    k = rng.integers(0, 4, 4000).astype(np.uint64) << np.uint64(62)
    near = rng.integers(-(2 ** 40), 2 ** 40, 4000).astype(np.int64).astype(np.uint64)    # around the axes
    tiny = (np.uint64(1) << rng.integers(0, 62, 2000).astype(np.uint64))
    t = np.concatenate([t, k + near, tiny, np.uint64([0, 1, 1 << 62, 1 << 63, 3 << 62, 2 ** 64 - 1])])
    for name, fn, cosine in [("sin_turns", sfu.sin_turns, False), ("cos_turns", sfu.cos_turns, True)]:
        assert_within(name, fn(t), turn_sin_ref(t, cosine), 2.0)
    assert sfu.sin_turns(np.uint64(1 << 62)) == 1 and sfu.cos_turns(np.uint64(0)) == 1


def test_sin_cos_radians(rng):
    x = np.concatenate([rng.uniform(-10, 10, 100_000), rng.uniform(-1, 1, 20_000) * 2.0 ** rng.uniform(-30, 127, 20_000),
                        np.arange(-64, 64) * np.pi / 4, EDGE]).astype(np.float32)
    x = np.concatenate([x, np.float32([2.0 ** -12, -(2.0 ** -12), 2.0 ** -12 * 0.99, 3.4028234663852886e38,
                                       1.0e22, 6381956970095103.0 * 2.0 ** 797 / 2.0 ** 797])])
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        assert_within("sin", sfu.sin(x), np.sin(x64), 2.0)
        assert_within("cos", sfu.cos(x), np.cos(x64), 2.0)


def rope_f(theta, d):
    """u0.64 turns per position of RoPE frequency j: theta**(-2j/d) / 2pi (float64, then fixed point)."""
    j = np.arange(d // 2)
    w = theta ** (-2.0 * j / d) / (2 * math.pi)
    return np.array([int(round(v * 2.0 ** 64)) % (1 << 64) for v in w], dtype=np.uint64), theta ** (-2.0 * j / d)


@pytest.mark.parametrize("pos", [0, 1, 7, 1000, 32767, 32768, 2 ** 20, 2 ** 20 + 12345])
def test_rope_phases_stay_accurate_at_large_positions(pos):
    f, omega = rope_f(10000.0, 256)
    ang = pos * omega                     # float64: absolute error <= 2**-53 * 2**21, far below the bound
    # Phase error of the u0.64 table: |f - w| <= 2**-65 turns per position -> <= pos * 2**-65 * 2pi rad.
    tol = 2.0 ** -23 + pos * 2.0 ** -65 * 2 * math.pi + 1e-9
    for name, fn, ref in [("rope_cos", sfu.rope_cos, np.cos(ang)), ("rope_sin", sfu.rope_sin, np.sin(ang))]:
        got = fn(f, pos)
        assert got.dtype == np.float32
        err = np.abs(got - ref).max()
        assert err <= tol, f"{name} at pos {pos}: max abs error {err:.3g} > {tol:.3g}"
    # Exactly the turn functions of the exact integer phase.
    np.testing.assert_array_equal(sfu.rope_sin(f, pos), sfu.sin_turns(np.array([(int(v) * pos) % 2 ** 64 for v in f],
                                                                                  dtype=np.uint64)))


def test_rope_rejects_bad_position():
    with pytest.raises(ValueError, match="RoPE position must be a non-negative integer, not -1"):
        sfu.rope_cos(np.uint64([1]), -1)


def test_reduce_sum_order_and_accuracy(rng):
    hw = PRESETS["kv260"]
    P = hw.sfu_reduce_lanes
    for n in [1, 2, P - 1, P, P + 1, 3 * P + 5, 1000, 32768]:
        x = (rng.standard_normal(n) * 10).astype(np.float32)
        got = sfu.reduce_sum(x, hw)
        # The documented order, spelled out independently: lanes by index mod P, then a pairwise tree.
        lanes = [F32(-0.0)] * P
        for i, v in enumerate(x):
            lanes[i % P] = F32(lanes[i % P] + v)
        while len(lanes) > 1:
            lanes = [F32(lanes[k] + lanes[k + 1]) for k in range(0, len(lanes), 2)]
        assert got.view(np.uint32) == lanes[0].view(np.uint32), n
        # Error bound of the order: (n/P + log2 P) roundings of at most 2**-24 of the partial magnitudes.
        bound = (n / P + math.log2(P) + 1) * 2.0 ** -24 * np.abs(x.astype(np.float64)).sum()
        assert abs(float(got) - x.astype(np.float64).sum()) <= bound
    assert sfu.reduce_sum(np.float32([-0.0, -0.0]), hw).view(np.uint32) == 0x80000000
    assert np.isnan(sfu.reduce_sum(np.float32([1, np.inf, -np.inf]), hw))
    with pytest.raises(ValueError, match="at least one element"):
        sfu.reduce_sum(np.float32([]), hw)


def test_reduce_max(rng):
    hw = PRESETS["tiny"]
    for n in [1, 5, 8, 9, 100, 4099]:
        x = rng.standard_normal(n).astype(np.float32)
        assert sfu.reduce_max(x, hw) == x.max()
    assert np.isnan(sfu.reduce_max(np.float32([1, np.nan, 3]), hw))
    assert sfu.reduce_max(np.float32([-np.inf]), hw) == -np.inf
    assert sfu.reduce_max(np.float32([-3, -0.0, -1]), hw) == 0


def test_scale_and_softcap(rng):
    x = (rng.standard_normal(100_000) * 40).astype(np.float32)
    c = F32(30.0)
    got = sfu.softcap(x, c)
    ref = 30.0 * np.tanh(x.astype(np.float64) / 30.0)
    # recip(c) (<= 1 ulp), the product x * recip(c) (0.5 ulp) and tanh's slope <= 1, tanh (1 ulp), the product.
    assert_within("softcap", got, ref, 3.5)
    assert np.all(np.abs(got) <= c)
    np.testing.assert_array_equal(sfu.scale(x, F32(0.125)), x * F32(0.125))
    assert_within("scale recip", sfu.scale(x, F32(3.0), recip_scale=True), x.astype(np.float64) / 3.0, 2.0)


def test_tables_are_reproducible_and_named():
    for name in sfu.TABLES:
        t = sfu.table(name)
        assert t.dtype == np.float32 and t.shape[1] == 4 and np.all(np.isfinite(t))
    assert sfu.table("recip").shape[0] == 64 and sfu.table("tanh").shape[0] == 512
    with pytest.raises(ValueError, match="unknown SFU table 'log'"):
        sfu.table("log")
    # The Payne-Hanek windows are slices of 1/2pi: for x = 1 (significand 2**23, weight 2**-23) the turn is
    # floor(2**64 / 2pi), which float64 knows to 2**-52 relative; for x = 2**40 it is 2**104/2pi mod 2**64.
    w = sfu.payne_hanek_window(-23)
    turn = (1 << 23) * w >> (24 + sfu.PH_GUARD)
    assert abs(turn / (2.0 ** 64 / (2 * math.pi)) - 1) < 2.0 ** -50
