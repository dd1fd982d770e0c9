"""hdl.fp in the Amaranth simulator against NumPy float32, bit for bit.

Every primitive gets seeded random bit patterns, random normal values and directed corner cases (zeros,
subnormal and normal extremes, infinities, NaN, rounding ties, cancellation, overflow, underflow). Vectors
are pushed one per cycle; one run per primitive also toggles ``en`` randomly to check that every stage
holds. NaN results are compared by NaN-ness (the RTL returns the canonical QNAN), everything else by bits.
"""

import numpy as np
import pytest
from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from amaranth.sim import Simulator

from hdl.fp import QNAN, QNAN16, F16ToF32, F32ToF16, FpAdd, FpLdexp, FpMul, IntScaleMul, IntToFp

CORNERS = np.array([
    0x00000000, 0x80000000,                 # ±0
    0x00000001, 0x80000001, 0x00000002,     # smallest subnormals
    0x007FFFFF, 0x807FFFFF, 0x00400000,     # largest subnormal, half
    0x00800000, 0x80800000, 0x00800001,     # smallest normals
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7FFFFE,     # largest normals
    0x7F800000, 0xFF800000,                 # ±inf
    0x7FC00000, 0xFFC00001, 0x7F800001,     # NaNs (quiet, negative, signalling)
    0x3F800000, 0xBF800000, 0x3F800001, 0x3FFFFFFF, 0x3F7FFFFF, 0x34000000, 0x33800000, 0x33800001,
    0x4B000000, 0x4B000001, 0x4AFFFFFF, 0x3F000000, 0x40000000, 0xC0400000, 0x1F800000, 0x5F800000,
], dtype=np.uint32)


def f32(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def simulate(dut, a, b=None, *, en_prob=1.0, seed=0):
    """Push `a` (and `b`) through `dut`, one vector per enabled cycle; return the outputs in order."""
    def ints(v):        # lists pass through (wide words of several lanes are Python ints)
        return [int(w) for w in (v if isinstance(v, list) else np.asarray(v, dtype=np.uint64))]
    wide = isinstance(a, list)
    a = ints(a)
    b = None if b is None else ints(b)
    rng = np.random.default_rng(seed)
    out = []
    first = []

    async def bench(ctx):
        i, cycle = 0, 0
        while len(out) < len(a):
            en = 1 if en_prob >= 1 else int(rng.random() < en_prob)
            ctx.set(dut.en, en)
            if i < len(a):
                ctx.set(dut.i_valid, 1)
                ctx.set(dut.i_a, a[i])
                if b is not None:
                    ctx.set(dut.i_b, b[i])
            else:
                ctx.set(dut.i_valid, 0)
            if en and ctx.get(dut.o_valid):
                out.append(ctx.get(dut.o_y))
                if not first:
                    first.append(cycle)
            if en and i < len(a):
                i += 1
            await ctx.tick()
            cycle += 1
            assert cycle < 4 * len(a) / max(en_prob, 0.1) + 100, "pipeline stalled"

    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(bench)
    sim.run()
    if en_prob >= 1:
        assert first == [dut.latency], f"first result after {first} cycles, latency says {dut.latency}"
    return out if wide else np.array(out, dtype=np.uint32)


def check(got, want):
    got, want = np.asarray(got, np.uint32), bits(want)
    want_nan = np.isnan(f32(want))
    np.testing.assert_array_equal(np.isnan(f32(got)), want_nan, err_msg="NaN-ness differs")
    np.testing.assert_array_equal(got[want_nan], np.full(want_nan.sum(), QNAN, np.uint32),
                                  err_msg="NaN results must be the canonical QNAN")
    np.testing.assert_array_equal(got[~want_nan], want[~want_nan])


def binary_vectors(seed, n_random=1200):
    rng = np.random.default_rng(seed)
    ca, cb = np.meshgrid(CORNERS, CORNERS)
    rand_a = rng.integers(0, 2**32, n_random, dtype=np.uint64).astype(np.uint32)
    rand_b = rng.integers(0, 2**32, n_random, dtype=np.uint64).astype(np.uint32)
    norm_a = bits(rng.standard_normal(n_random).astype(np.float32))
    norm_b = bits(rng.standard_normal(n_random).astype(np.float32) * np.float32(2.0) ** rng.integers(-8, 8, n_random))
    return np.concatenate([ca.ravel(), rand_a, norm_a]), np.concatenate([cb.ravel(), rand_b, norm_b])


def add_directed():
    """Ties, cancellation, subnormal sums and overflow for a + b."""
    a = [0x3F800000, 0x3F800000, 0x3F800001, 0x4B000001, 0x3F800000, 0x3F800001, 0x00000001, 0x00400000,
         0x00800000, 0x7F7FFFFF, 0x7F7FFFFF, 0x7F7FFFFF, 0x3F800000, 0x3FC00000, 0x4B7FFFFF, 0x80000000]
    b = [0x33800000, 0x33800001, 0x33800000, 0x3F000000, 0xBF7FFFFF, 0xBF800000, 0x80000001, 0x00400000,
         0x80000001, 0x73000000, 0x73800000, 0x7F7FFFFF, 0xB3800000, 0xBFBFFFFF, 0x3F000000, 0x00000000]
    return np.array(a, np.uint32), np.array(b, np.uint32)


@pytest.mark.parametrize("op", ["add", "mul"])
def test_binary_ops_match_numpy(op):
    a, b = binary_vectors(seed={"add": 1, "mul": 2}[op])
    if op == "add":
        da, db = add_directed()
        a, b = np.concatenate([a, da, db]), np.concatenate([b, db, da])
    else:
        # Products that land in the subnormal range, ties to even there, and overflow.
        rng = np.random.default_rng(5)
        x = bits(rng.uniform(1, 2, 400).astype(np.float32) * np.float32(2.0) ** rng.integers(-80, -40, 400))
        y = bits(rng.uniform(1, 2, 400).astype(np.float32) * np.float32(2.0) ** rng.integers(-100, -60, 400))
        a = np.concatenate([a, x, x])
        b = np.concatenate([b, y, bits(f32(y) * np.float32(2.0 ** 100))])
    dut = FpAdd() if op == "add" else FpMul()
    got = simulate(dut, a, b)
    with np.errstate(all="ignore"):
        want = f32(a) + f32(b) if op == "add" else f32(a) * f32(b)
    check(got, want)


@pytest.mark.parametrize("op", ["add", "mul", "ldexp"])
def test_enable_holds_every_stage(op):
    rng = np.random.default_rng(9)
    a = bits(rng.standard_normal(300).astype(np.float32))
    if op == "ldexp":
        k = rng.integers(-140, 140, 300)
        dut = FpLdexp(9)
        got = simulate(dut, a, k.astype(np.int64) & 0x1FF, en_prob=0.6, seed=3)
        with np.errstate(all="ignore"):
            want = np.ldexp(f32(a), k.astype(np.int32))
    else:
        b = bits(rng.standard_normal(300).astype(np.float32))
        dut = FpAdd() if op == "add" else FpMul()
        got = simulate(dut, a, b, en_prob=0.6, seed=3)
        want = f32(a) + f32(b) if op == "add" else f32(a) * f32(b)
    check(got, want)


# --- Subnormal-heavy products and sums -------------------------------------------------------------------
# FpMul pre-normalises the (at most one) subnormal operand and denormalises the product with a short right
# shift whose sticky bit is a masked OR of product bits; FpAdd's back end clamps its left shift at the
# exponent and keeps only the round bit and a 3-bit OR below it. These vectors aim at those seams.


def _rand_sub(rng, n):
    """Subnormal bit patterns with a uniformly random bit length 1..23 (every leading-zero count)."""
    nb = rng.integers(1, 24, n)
    frac = rng.integers(0, 1 << 23, n, dtype=np.int64) & ((1 << nb) - 1) | (1 << (nb - 1))
    return frac.astype(np.uint32)


def _signs(rng, v):
    return (np.asarray(v, np.uint32) | (rng.integers(0, 2, len(v)).astype(np.uint32) << 31)).astype(np.uint32)


def _near_products(rng, targets, n):
    """Pairs (a, b) whose exact product lies within a few ulps of `targets` (bit patterns): a random b (any
    significand, normal or subnormal), a = the float32 nearest target / b and its neighbours."""
    t = f32(rng.choice(np.asarray(targets, np.uint32), n)).astype(np.float64)
    kind = rng.integers(0, 3, n)
    # b: normal near 1 (so a is near the target: subnormal a), or large (a normal and small), or subnormal.
    b_norm = rng.uniform(1, 2, n) * 2.0 ** rng.integers(-3, 4, n)
    b_big = rng.uniform(1, 2, n) * 2.0 ** rng.integers(20, 127, n)
    b_sub = f32(_rand_sub(rng, n)).astype(np.float64)
    b = np.where(kind == 0, b_norm, np.where(kind == 1, b_big, b_sub)).astype(np.float32)
    with np.errstate(all="ignore"):
        a = (t / b.astype(np.float64)).astype(np.float32)
    ab = bits(a).astype(np.int64) + rng.integers(-2, 3, n)
    ok = np.isfinite(a) & (a != 0) & (ab > 0) & (ab < 0x7F800000)
    return _signs(rng, ab[ok].astype(np.uint32)), _signs(rng, bits(b[ok]))


def mul_subnormal_vectors(seed, n=2000):
    """Products for FpMul's risky cases: subnormal x normal landing normal, subnormal and exactly on the
    boundary (rounding up to 0x00800000, to the largest subnormal 0x007FFFFF, to the smallest subnormal and
    to zero); ties at the subnormal rounding point; both operands subnormal (a signed zero); 0 and inf times
    subnormals; products rounding up to inf at the top."""
    rng = np.random.default_rng(seed)
    parts = []
    # Subnormal x normal over the whole output range (normal, boundary, subnormal, underflow).
    sa = _rand_sub(rng, n)
    nb = rng.integers(0, 1 << 23, n, dtype=np.int64).astype(np.uint32) | \
        (rng.integers(1, 255, n).astype(np.uint32) << 23)
    parts.append((_signs(rng, sa), _signs(rng, nb)))
    parts.append((_signs(rng, nb), _signs(rng, sa)))
    # Near the subnormal/normal boundary, the largest and smallest subnormals, half the smallest.
    targets = [0x00800000, 0x007FFFFF, 0x00800001, 0x007FFFFE, 0x00000001, 0x00000002, 0x00000003,
               0x00400000, 0x00000000 + 1, 0x7F7FFFFF, 0x7F7FFFFE, 0x3F800000]
    parts.append(_near_products(rng, targets, 3 * n))
    # Exact ties: a = m * 2**-149 (m subnormal or small normal significand) times b = c * 2**-j (c odd):
    # the product m * c / 2**j (units of 2**-149) is halfway between neighbours when m * c = 2**(j-1)
    # mod 2**j; about one in two for j = 1, the rest are near-ties and exact products.
    m = rng.integers(1, 1 << 24, n, dtype=np.int64)
    c = rng.integers(0, 1 << 12, n, dtype=np.int64) * 2 + 1
    j = rng.integers(1, 4, n)
    fa = (m.astype(np.float64) * 2.0 ** -149).astype(np.float32)
    fb = (c.astype(np.float64) * 2.0 ** -j.astype(np.float64) / 2.0 ** rng.integers(0, 12, n)).astype(np.float32)
    parts.append((_signs(rng, bits(fa)), _signs(rng, bits(fb))))
    # Normal x normal into the subnormal range with few significant bits (ties and exact results).
    pa = (rng.integers(1, 1 << 8, n) * 2 + 1).astype(np.float64) * 2.0 ** rng.integers(-80, -60, n)
    pb = (rng.integers(1, 1 << 8, n) * 2 + 1).astype(np.float64) * 2.0 ** rng.integers(-90, -65, n)
    parts.append((_signs(rng, bits(pa.astype(np.float32))), _signs(rng, bits(pb.astype(np.float32)))))
    # Both subnormal: always a signed zero.
    parts.append((_signs(rng, _rand_sub(rng, n // 4)), _signs(rng, _rand_sub(rng, n // 4))))
    # Zeros, infinities and NaN against subnormals, both orders.
    sp = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000], np.uint32)
    sub = _signs(rng, _rand_sub(rng, 40))
    ga, gb = np.meshgrid(sp, sub)
    parts.append((np.concatenate([ga.ravel(), gb.ravel()]), np.concatenate([gb.ravel(), ga.ravel()])))
    # Large products around the overflow threshold (and subnormal x huge).
    big_a = rng.integers(0x5F000000, 0x7F800000, n, dtype=np.int64).astype(np.uint32)
    with np.errstate(all="ignore"):
        big_b = bits((np.float64(3.4028234663852886e38) / f32(big_a).astype(np.float64)).astype(np.float32))
    big_b = (big_b.astype(np.int64) + rng.integers(-2, 3, n)).astype(np.uint32)
    parts.append((_signs(rng, big_a), _signs(rng, big_b)))
    a = np.concatenate([p[0] for p in parts])
    b = np.concatenate([p[1] for p in parts])
    return a, b


def add_subnormal_vectors(seed, n=2000):
    """Sums for FpAdd: every alignment shift 0..30 with and without bits shifted out (the sticky bit),
    both operand orders and signs; cancellation to a subnormal and to zero (x + -x = +0, -0 + -0 = -0);
    subnormal + subnormal and subnormal + normal around the boundary."""
    rng = np.random.default_rng(seed)
    parts = []
    d = np.tile(np.arange(31), n // 31 + 1)[:n]
    ea = rng.integers(1, 255, n)
    eb = ea - d
    fa = rng.integers(0, 1 << 23, n, dtype=np.int64)
    # b's significand with k trailing zeros: bits shifted out are all zero when k >= the shift.
    k = rng.integers(0, 24, n)
    fb = rng.integers(0, 1 << 23, n, dtype=np.int64) >> k << k
    ok = eb >= 1
    a = (ea[ok] << 23 | fa[ok]).astype(np.uint32)
    b = (eb[ok] << 23 | fb[ok]).astype(np.uint32)
    parts += [(_signs(rng, a), _signs(rng, b)), (_signs(rng, b), _signs(rng, a))]
    # The same with b subnormal (a near the bottom of the normal range).
    fbs = _rand_sub(rng, n)
    eas = rng.integers(1, 32, n)
    aas = (eas << 23 | rng.integers(0, 1 << 23, n)).astype(np.uint32)
    parts += [(_signs(rng, aas), _signs(rng, fbs)), (_signs(rng, fbs), _signs(rng, aas))]
    # Cancellation: x + -(x +- a few ulps), x small (results subnormal) or anywhere; x + -x; -0 + -0.
    x = rng.integers(0x00800000, 0x08000000, n, dtype=np.int64)
    x = np.concatenate([x, rng.integers(1, 0x7F800000, n, dtype=np.int64)])
    y = np.clip(x + rng.integers(-40, 41, len(x)), 1, 0x7F7FFFFF)
    s = rng.integers(0, 2, len(x)).astype(np.uint32) << 31
    parts.append(((x.astype(np.uint32) | s), (y.astype(np.uint32) | (s ^ np.uint32(0x80000000)))))
    parts.append(((x.astype(np.uint32) | s), (x.astype(np.uint32) | (s ^ np.uint32(0x80000000)))))
    parts.append((np.array([0x80000000, 0x00000000, 0x80000000, 0x00000001], np.uint32),
                  np.array([0x80000000, 0x80000000, 0x00000000, 0x80000001], np.uint32)))
    # Subnormal + subnormal (carry into the normal range) and subnormal + smallest normals.
    sa, sb = _rand_sub(rng, n), _rand_sub(rng, n)
    parts.append((_signs(rng, sa), _signs(rng, sb)))
    parts.append((_signs(rng, sa), _signs(rng, rng.integers(0x00800000, 0x01000000, n).astype(np.uint32))))
    a = np.concatenate([p[0] for p in parts])
    b = np.concatenate([p[1] for p in parts])
    return a, b


def test_mul_subnormal_and_boundary_products():
    a, b = mul_subnormal_vectors(31)
    with np.errstate(all="ignore"):
        want = f32(a) * f32(b)
    # The vectors reach what they aim at: boundary results, ties, zeros from two subnormals, overflow.
    w = bits(want) & 0x7FFFFFFF
    for v in (0x00800000, 0x007FFFFF, 0x00000001, 0x7F800000):
        assert (w == v).sum() >= 5, hex(v)
    assert ((w > 0) & (w < 0x00800000)).sum() > 2000 and (w == 0).sum() > 700
    check(simulate(FpMul(), a, b), want)


def test_add_alignment_sticky_and_cancellation():
    a, b = add_subnormal_vectors(32)
    with np.errstate(all="ignore"):
        want = f32(a) + f32(b)
    w = bits(want) & 0x7FFFFFFF
    assert ((w > 0) & (w < 0x00800000)).sum() > 1000 and (w == 0).sum() > 1000
    check(simulate(FpAdd(), a, b), want)


def add_normalise_vectors(seed, per=3):
    """Cancelling sums for FpAdd's normalisation: for the larger operand's exponent field e = 1..40 (the
    left-shift cap min(e, 31) at every value, and beyond) and every bit length 1..25 of the exact
    difference (every leading-zero count of the 28-bit sum), `per` random pairs with equal exponents and
    `per` with exponents one apart (bits below the guard position then take part); both orders and signs."""
    rng = np.random.default_rng(seed)
    e = np.repeat(np.arange(1, 41), 25 * per)
    nb = np.tile(np.repeat(np.arange(1, 26), per), 40)
    # Equal exponents: significands A > B in [2**23, 2**24), A - B of bit length nb (<= 23 here).
    n1 = np.minimum(nb, 23)
    dlt = (1 << (n1 - 1)) | rng.integers(0, 1 << 22, len(e), dtype=np.int64) & ((1 << (n1 - 1)) - 1)
    big = rng.integers(0, 1 << 23, len(e), dtype=np.int64) % ((1 << 23) - dlt) + (1 << 23) + dlt
    a = (e << 23 | (big - (1 << 23))).astype(np.uint32)
    b = (e << 23 | (big - dlt - (1 << 23))).astype(np.uint32)
    # Exponents one apart: 2A - B = D (units of B's ulp) with D of bit length nb, B in [2**23, 2**24).
    e2 = np.maximum(e, 2)
    d2 = (1 << (nb - 1)) | rng.integers(0, 1 << 24, len(e), dtype=np.int64) & ((1 << (nb - 1)) - 1)
    bb = rng.integers(1 << 23, 1 << 24, len(e), dtype=np.int64)
    bb = bb - ((bb + d2) & 1)                           # 2A = B + D is even
    ok = (bb + d2 >= 1 << 24) & (bb + d2 < 1 << 25)
    a2 = (e2[ok] << 23 | ((bb + d2)[ok] // 2 - (1 << 23))).astype(np.uint32)
    b2 = ((e2[ok] - 1) << 23 | (bb[ok] - (1 << 23))).astype(np.uint32)
    xa, xb = np.concatenate([a, a2]), np.concatenate([b, b2])
    sa = rng.integers(0, 2, len(xa)).astype(np.uint32) << 31
    xa, xb = xa | sa, xb | (sa ^ np.uint32(0x80000000))
    return np.concatenate([xa, xb]), np.concatenate([xb, xa])


def test_add_normalise_every_count_and_clamp():
    a, b = add_normalise_vectors(33)
    want = f32(a) + f32(b)
    w = bits(want) & 0x7FFFFFFF
    assert ((w > 0) & (w < 0x00800000)).sum() > 1000 and (w >= 0x00800000).sum() > 1000
    check(rtl_lanes(FpAdd, a, b), want)


class _BinaryLanes(wiring.Component):
    """`lanes` FpAdd or FpMul units side by side on shared en/valid (pysim's cost is mostly per cycle)."""

    def __init__(self, cls, lanes):
        self.cls, self.lanes = cls, lanes
        self.latency = cls.LATENCY
        super().__init__({"en": In(1), "i_valid": In(1), "i_a": In(32 * lanes), "i_b": In(32 * lanes),
                          "o_valid": Out(1), "o_y": Out(32 * lanes)})

    def elaborate(self, platform):
        m = Module()
        for i in range(self.lanes):
            u = m.submodules[f"u{i}"] = self.cls()
            m.d.comb += [u.en.eq(self.en), u.i_valid.eq(self.i_valid), u.i_a.eq(self.i_a[32 * i:32 * i + 32]),
                         u.i_b.eq(self.i_b[32 * i:32 * i + 32]), self.o_y[32 * i:32 * i + 32].eq(u.o_y)]
        m.d.comb += self.o_valid.eq(m.submodules["u0"].o_valid)
        return m


def rtl_lanes(cls, a, b, *, lanes=16, en_prob=1.0, seed=0):
    n = len(a)
    pad = -n % lanes
    a = np.concatenate([np.asarray(a, np.uint32), np.zeros(pad, np.uint32)])
    b = np.concatenate([np.asarray(b, np.uint32), np.zeros(pad, np.uint32)])
    words = simulate(_BinaryLanes(cls, lanes), _pack_lanes(a, lanes, 32), _pack_lanes(b, lanes, 32),
                     en_prob=en_prob, seed=seed)
    return np.array([(w >> (32 * i)) & 0xFFFFFFFF for w in map(int, words) for i in range(lanes)],
                    np.uint32)[:n]


@pytest.mark.parametrize("op", ["add", "mul"])
def test_subnormal_heavy_random_lanes(op):
    """A larger seeded subnormal-heavy run (both generators, several seeds, ~50k vectors per op) with
    random `en` toggling, 16 units in parallel."""
    gen = mul_subnormal_vectors if op == "mul" else add_subnormal_vectors
    vs = [gen(1000 + k, 1500) for k in range(4)]
    a = np.concatenate([v[0] for v in vs])
    b = np.concatenate([v[1] for v in vs])
    got = rtl_lanes(FpMul if op == "mul" else FpAdd, a, b, en_prob=0.8, seed=6)
    with np.errstate(all="ignore"):
        want = f32(a) * f32(b) if op == "mul" else f32(a) + f32(b)
    check(got, want)


@pytest.mark.parametrize("width", [8, 24, 32])
def test_int_to_fp(width):
    rng = np.random.default_rng(width)
    lo, hi = -(1 << (width - 1)), (1 << (width - 1))
    ints = np.concatenate([
        np.array([0, 1, -1, lo, hi - 1, lo + 1, 2, -2], np.int64),
        rng.integers(lo, hi, 1200, dtype=np.int64),
        # values beyond 2**24 with halfway cases (ties to even) when the width allows them
        np.array([(1 << 24) + 1, (1 << 24) + 3, -(1 << 24) - 1, (1 << 25) + 2, (1 << 25) + 6, (1 << 31) - 64,
                  (1 << 31) - 65, (1 << 30) + 64, (1 << 30) + 192], np.int64)[: (9 if width == 32 else 0)],
    ])
    dut = IntToFp(width)
    got = simulate(dut, ints & ((1 << width) - 1))
    check(got, ints.astype(np.float32))


def test_bad_widths_are_rejected():
    with pytest.raises(ValueError, match="IntToFp width must be an integer 2..32, not 33"):
        IntToFp(33)
    with pytest.raises(ValueError, match="FpLdexp exp_width must be an integer 2..32, not 1"):
        FpLdexp(1)


def test_f16_to_f32_every_pattern():
    h = np.arange(1 << 16, dtype=np.uint32)
    got = simulate(F16ToF32(), h)
    check(got, h.astype(np.uint16).view(np.float16).astype(np.float32))


def test_ldexp():
    rng = np.random.default_rng(11)
    ca, ck = np.meshgrid(CORNERS, np.array([0, 1, -1, 2, -2, 23, -23, 24, -24, 126, -126, 127, -127, 149, -149,
                                           150, -150, 151, -151, 254, -254, 255, -255, 277, -277, 300, -300]))
    # Halfway results in the subnormal range: odd significands shifted down until one bit falls off.
    halves = bits(np.float32(1.0) + np.float32(2.0 ** -23) * rng.integers(0, 1 << 23, 400).astype(np.float32))
    hk = -rng.integers(120, 155, 400)
    rand = rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
    rk = rng.integers(-300, 300, 1000)
    a = np.concatenate([ca.ravel(), halves, rand])
    k = np.concatenate([ck.ravel(), hk, rk]).astype(np.int64)
    dut = FpLdexp(10)
    got = simulate(dut, a, k & 0x3FF)
    with np.errstate(all="ignore"):
        want = np.ldexp(f32(a), k.astype(np.int32))
    check(got, want)


def test_ldexp_saturates_wide_shift_counts():
    a = np.array([0x3F800000, 0x00000001, 0xBF800000, 0x7F7FFFFF, 0x3F800000], np.uint32)
    k = np.array([2**20, 2**20, -2**20, -(2**31), 2**31 - 1], np.int64)
    got = simulate(FpLdexp(32), a, k & 0xFFFFFFFF)
    check(got, np.array([np.inf, np.inf, -0.0, 0.0, np.inf], np.float32))


def ldexp_want(a, k):
    with np.errstate(all="ignore"):
        return np.ldexp(f32(a), np.asarray(k, np.int64).astype(np.int32))


def ldexp_run(exp_width, a, k, **kw):
    """FpLdexp(exp_width) on (a, k), compared bit for bit with ``np.ldexp`` on float32."""
    a = np.asarray(a, np.uint32)
    k = np.asarray(k, np.int64)
    got = simulate(FpLdexp(exp_width), a, k & ((1 << exp_width) - 1), **kw)
    check(got, ldexp_want(a, k))


def with_signs(a, k):
    a = np.asarray(a, np.uint32)
    return np.concatenate([a, a | 0x80000000]), np.concatenate([k, k])


def test_ldexp_subnormal_inputs_to_the_normal_boundary():
    """A subnormal `a` whose significand has lz leading zeros (1..23) scaled by k around lz (k = lz - 1 is
    the largest subnormal range, k = lz exactly the smallest normal exponent), around the overflow edge
    (k = 253 + lz .. 256 + lz) and by k <= 0 (right shifts of a subnormal)."""
    rng = np.random.default_rng(21)
    a, k = [], []
    for top in range(23):                       # the fraction's MSB; lz = 23 - top
        lz = 23 - top
        low = (1 << top) - 1
        for f in {1 << top, (2 << top) - 1, (1 << top) | (int(rng.integers(0, 1 << 23)) & low),
                  (1 << top) | 1 if top else 1}:
            for kk in [*range(lz - 3, lz + 4), *range(253 + lz, 257 + lz), 0, -1, -2, 1, 2, 23, 24]:
                a.append(f)
                k.append(kk)
    a, k = with_signs(a, np.array(k))
    ldexp_run(10, a, k)


def test_ldexp_subnormal_results_round_to_nearest_even():
    """Results below the normal range with the bits shifted out exactly a tie, one below and one above
    it, none and all, for every right shift 1..26: from normal inputs (several exponents) and from
    subnormal inputs with k < 0, odd and even kept bits."""
    rng = np.random.default_rng(22)
    a, k = [], []
    for r in range(1, 27):
        for _ in range(3):
            keep = int(rng.integers(0, 1 << 24)) | (1 << 23)
            for odd in (0, 1):
                for lowbits in ("tie", "tie-1", "tie+1", "zero", "ones"):
                    mant = keep
                    if r <= 24:
                        mant = ((keep >> r) & ~1 | odd) << r
                        half = 1 << (r - 1)
                        mant |= {"tie": half, "tie-1": half - 1, "tie+1": half + 1, "zero": 0,
                                 "ones": (1 << r) - 1}[lowbits]
                        mant |= 1 << 23
                        mant &= (1 << 24) - 1
                    e_a = int(rng.integers(1, 255))
                    a.append((e_a << 23) | (mant & 0x7FFFFF))
                    k.append(1 - r - e_a)            # E = e_a + k = 1 - r: a right shift by r
                    if r <= 23:                      # the same bits from a subnormal input, k = -r
                        a.append(mant & 0x7FFFFF)
                        k.append(-r)
    a, k = with_signs(a, np.array(k))
    ldexp_run(10, a, k)


def test_ldexp_underflow_and_overflow_edges():
    """Results at and around half the smallest subnormal (2**-150: a tie, rounds to ±0; just above: the
    smallest subnormal), the largest subnormal rounding up into the normal range, and overflow to ±inf."""
    pairs = [
        (0x3F800000, -150), (0x3F800001, -150), (0x3F7FFFFF, -150), (0x3FFFFFFF, -151), (0x3FFFFFFF, -150),
        (0x3FC00000, -150), (0x3F7FFFFF, -149), (0x3F800000, -149), (0x3F800000, -151), (0x3FC00000, -149),
        (0x40400000, -151), (0x7F7FFFFF, -277), (0x7F7FFFFF, -278), (0x7F7FFFFF, -276), (0x00000001, -1),
        (0x00000003, -1), (0x00000002, -1), (0x00000003, -2), (0x00400000, -23), (0x00400001, -23),
        (0x00C00000, -24), (0x00FFFFFF, -1), (0x00FFFFFF, -2), (0x007FFFFF, -1), (0x3F7FFFFF, -126),
        (0x3F7FFFFF, -127), (0x3F7FFFFE, -126), (0x3F800000, -126), (0x3F800000, -127),
        (0x3F800000, 127), (0x3F800000, 128), (0x3FFFFFFF, 127), (0x3FFFFFFF, 128), (0x7F7FFFFF, 1),
        (0x7F7FFFFF, 0), (0x7F000000, 1), (0x00000001, 277), (0x00000001, 276), (0x00000001, 278),
        (0x007FFFFF, 254), (0x007FFFFF, 255), (0x00400000, 255), (0x00400000, 256), (0x00800000, 253),
        (0x00800000, 254), (0x00800000, -1), (0x00800001, -1), (0x00800003, -1), (0x00800003, -2),
    ]
    a, k = with_signs([p[0] for p in pairs], np.array([p[1] for p in pairs]))
    ldexp_run(10, a, k)


@pytest.mark.parametrize("exp_width", [2, 3, 10])
def test_ldexp_every_shift_count(exp_width):
    """Every k of the exp_width range (for 10: -512..511, saturation included) on the corner values (zeros,
    subnormal and normal extremes, infinities, NaNs) and a few more."""
    extra = np.array([0x00000003, 0x00012345, 0x3FC00001, 0x3F7FFFFF, 0xC0490FDB], np.uint32)
    vals = np.concatenate([CORNERS, extra])
    ks = np.arange(-(1 << (exp_width - 1)), 1 << (exp_width - 1))
    a, k = np.meshgrid(vals, ks)
    ldexp_run(exp_width, a.ravel(), k.ravel())


@pytest.mark.parametrize("exp_width", [11, 12, 32])
def test_ldexp_saturation_limits(exp_width):
    """k around every limit that matters (±277/278, ±400, the 10-bit saturation at ±511/512) and at the
    ends of wider shift counts, on every corner value."""
    ks = [277, 278, 399, 400, 401, 510, 511, 512, 513, 1000, 1023]
    if exp_width > 11:
        ks += [1024, 1025, 2047]
    if exp_width == 32:
        ks += [2**20, 2**20 + 3, 2**31 - 1, 2**30]
    ks = np.array(ks + [-x for x in ks] + [-(1 << (exp_width - 1))], np.int64)
    a, k = np.meshgrid(CORNERS, ks)
    ldexp_run(exp_width, a.ravel(), k.ravel())


class _Ldexp10(FpLdexp):
    def __init__(self):
        super().__init__(10)


class _Ldexp10IntScale(FpLdexp):
    def __init__(self):
        super().__init__(10, int_scale=True)


def test_ldexp_of_int_scale_results():
    """`FpLdexp(int_scale=True)`, the GEMV engine's, on what `IntScaleMul` gives it (normal numbers, signed
    zeros, infinities, the quiet NaN; never a subnormal): every k of the 10-bit range on corner values, and
    ~40k seeded vectors whose result lands around the subnormal range (right shifts 1..30, ties and sticky
    bits) or the overflow edge, with random `en`; bit for bit against ``np.ldexp`` on float32."""
    corners = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, QNAN, 0x00800000, 0x80800000,
                        0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0x3FC00000, 0x3F7FFFFF, 0xC0490FDB, 0x4B7FFFFF],
                       np.uint32)
    ks = np.arange(-512, 512)
    a, k = np.meshgrid(corners, ks)
    a, k = a.ravel(), k.ravel()
    got = simulate(FpLdexp(10, int_scale=True), a, k & 0x3FF)
    check(got, ldexp_want(a, k))
    rng = np.random.default_rng(27)
    n = 40000
    e_a = rng.integers(1, 255, n)
    frac = rng.integers(0, 1 << 23, n)
    sparse = rng.random(n) < 0.4                  # short runs of ones: exact ties and zero sticky bits
    frac = np.where(sparse, frac & ~((1 << rng.integers(0, 23, n)) - 1), frac)
    a = ((rng.integers(0, 2, n) << 31) | (e_a << 23) | frac).astype(np.uint32)
    target = np.where(rng.random(n) < 0.85, rng.integers(-30, 3, n), rng.integers(250, 258, n))
    k = target - e_a
    got = rtl_lanes(_Ldexp10IntScale, a, (k & 0x3FF).astype(np.uint32), en_prob=0.8, seed=9)
    check(got, ldexp_want(a, k))


def test_ldexp_boundary_heavy_random_lanes():
    """~48k seeded vectors concentrated where the result leaves the normal range (E = exponent(a) + k in
    -30..30 or 240..260), half of them from subnormal inputs, with random `en` toggling, 16 units."""
    rng = np.random.default_rng(23)
    n = 48000
    sub = rng.random(n) < 0.5
    e_a = np.where(sub, 0, rng.integers(1, 255, n))
    frac = rng.integers(0, 1 << 23, n)
    # Sparse significands too: short runs of ones make ties and exact cases frequent.
    sparse = rng.random(n) < 0.3
    frac = np.where(sparse, frac & ~((1 << rng.integers(0, 23, n)) - 1), frac)
    frac = np.where(sub & (frac == 0), 1, frac)
    a = ((rng.integers(0, 2, n) << 31) | (e_a << 23) | frac).astype(np.uint32)
    target = np.where(rng.random(n) < 0.8, rng.integers(-30, 31, n), rng.integers(240, 261, n))
    k = target - np.maximum(e_a, 1)
    got = rtl_lanes(_Ldexp10, a, (k & 0x3FF).astype(np.uint32), en_prob=0.8, seed=8)
    check(got, ldexp_want(a, k))


@pytest.mark.parametrize("width", [2, 25, 31, 32])
def test_int_to_fp_ties_and_enable(width):
    """Powers of two and their neighbours, rounding ties (odd and even kept bits, one above and below) at
    every shift the width allows, random values; `en` toggles randomly."""
    rng = np.random.default_rng(30 + width)
    lo, hi = -(1 << (width - 1)), (1 << (width - 1)) - 1
    v = [0, 1, -1, lo, hi, lo + 1, hi - 1]
    for p in range(width - 1):
        v += [(1 << p) + d for d in (-1, 0, 1)]
    for r in range(1, max(width - 24, 0) + 1):          # r bits below the 24-bit significand
        for _ in range(4):
            keep = int(rng.integers(1 << 23, 1 << 24))
            for low in ((1 << (r - 1)), (1 << (r - 1)) - 1, (1 << (r - 1)) + 1):
                v.append((keep << r) | (low & ((1 << r) - 1)))
    v = np.array(v, np.int64)
    v = np.concatenate([v, -v, rng.integers(lo, hi + 1, 1500, dtype=np.int64)])
    v = v[(v >= lo) & (v <= hi)]
    got = simulate(IntToFp(width), v & ((1 << width) - 1), en_prob=0.6, seed=5)
    check(got, v.astype(np.float32))


def test_add_mul_100k_vectors_verilator():
    """FpAdd and FpMul on ~100k seeded vectors in Verilator (pysim cannot run that many quickly)."""
    from tb.runner import run
    from tb.sfu.fp_pair import FpPair
    run(FpPair(), toplevel="fp_pair", test_module="tb.sfu.test_fp", extra_env={"VECTORS": "100000", "SEED": "7"})


# binary32 inputs at binary16's edges: largest finite 65504, the overflow threshold 65520 and its
# neighbours, the smallest subnormal 2**-24, the underflow tie 2**-25 and its neighbours, 3 * 2**-26
# (a tie that rounds up to 2 * 2**-24), the normal/subnormal edge 2**-14 and the largest subnormal.
F16_EDGES = np.array([
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x477FFFFF, 0x47800000,
    0x33800000, 0x33000000, 0x33000001, 0x32FFFFFF, 0x33400000, 0x33C00000, 0x33A00000,
    0x38800000, 0x387FC000, 0x387FE000, 0x387FF000, 0x387FDFFF, 0x3F801000, 0x3F803000, 0x3F801001,
], dtype=np.uint32)


def f16_want(x):
    f = f32(x)
    with np.errstate(all="ignore"):
        want = f.astype(np.float16).view(np.uint16).astype(np.uint32)
    return np.where(np.isnan(f), QNAN16, want).astype(np.uint32)


def test_f32_to_f16_specials_and_random():
    """Every special binary32 value (both signs), binary16's edges, random bit patterns and random values in
    and around the binary16 range, bit for bit (NaN -> 0x7E00); the pipeline has its stated latency."""
    rng = np.random.default_rng(16)
    edges = np.concatenate([CORNERS, F16_EDGES, F16_EDGES | 0x80000000])
    rand = rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32)
    vals = bits((rng.uniform(-1, 1, 2000) * 2.0 ** rng.integers(-28, 18, 2000)).astype(np.float32))
    x = np.concatenate([edges, rand, vals])
    got = simulate(F32ToF16(), x)
    np.testing.assert_array_equal(got, f16_want(x))


def test_f32_to_f16_enable_holds_every_stage():
    rng = np.random.default_rng(17)
    x = bits((rng.standard_normal(400) * 2.0 ** rng.integers(-26, 17, 400)).astype(np.float32))
    got = simulate(F32ToF16(), x, en_prob=0.6, seed=4)
    np.testing.assert_array_equal(got, f16_want(x))


def test_f32_to_f16_every_boundary_verilator():
    """Every binary16 value, every midpoint between neighbours and one binary32 ulp either side (both
    signs, ~260k vectors) plus 100k random ones, in Verilator (tb/ddrio/test_f32_to_f16.py)."""
    from tb.ddrio.f16_lanes import F32ToF16Lanes
    from tb.runner import run
    run(F32ToF16Lanes(4), toplevel="f32_to_f16", test_module="tb.ddrio.test_f32_to_f16",
        extra_env={"VECTORS": "100000", "SEED": "5"})



# --- IntScaleMul: integer x binary16 scale, fused --------------------------------------------------------
# Golden: the composition the unit replaces, FpMul(IntToFp(x), F16ToF32(s)), whose bit-exact model is NumPy
# float32 (the tests above): np.float32(x) * np.float32(np.float16(s)), NaN results the canonical QNAN.
# Integer widths the users instantiate: 4 (hdl.ddrio INT4), 16 (tiny: systolic field, GEMV segment sums) and
# 18 (kv260: both); 25 is the widest allowed.


class _IntScaleLanes(wiring.Component):
    """`lanes` IntScaleMul units side by side on shared en/valid: pysim's cost is mostly per cycle, so
    many vectors per cycle make the exhaustive scale sweeps affordable."""

    def __init__(self, int_bits, lanes):
        self.int_bits, self.lanes = int_bits, lanes
        self.latency = IntScaleMul.LATENCY
        super().__init__({"en": In(1), "i_valid": In(1), "i_a": In(32 * lanes), "i_b": In(16 * lanes),
                          "o_valid": Out(1), "o_y": Out(32 * lanes)})

    def elaborate(self, platform):
        m = Module()
        for i in range(self.lanes):
            u = m.submodules[f"u{i}"] = IntScaleMul(self.int_bits)
            m.d.comb += [u.en.eq(self.en), u.i_valid.eq(self.i_valid), u.i_a.eq(self.i_a[32 * i:32 * i + 32]),
                         u.i_b.eq(self.i_b[16 * i:16 * i + 16]), self.o_y[32 * i:32 * i + 32].eq(u.o_y)]
        m.d.comb += self.o_valid.eq(m.submodules["u0"].o_valid)
        return m


def _pack_lanes(v, lanes, width):
    return [sum(int(w) << (width * i) for i, w in enumerate(row)) for row in np.asarray(v).reshape(-1, lanes)]


def rtl_int_scale(int_bits, x, h, *, lanes=16, en_prob=1.0, seed=0):
    """IntScaleMul(int_bits) on integers `x` and binary16 bit patterns `h`, `lanes` units in parallel."""
    x, h = np.asarray(x, np.int64), np.asarray(h, np.int64)
    n = len(x)
    pad = -n % lanes
    xs = np.concatenate([x, np.zeros(pad, np.int64)]) & ((1 << int_bits) - 1)
    hs = np.concatenate([h, np.zeros(pad, np.int64)]) & 0xFFFF
    words = simulate(_IntScaleLanes(int_bits, lanes), _pack_lanes(xs, lanes, 32), _pack_lanes(hs, lanes, 16),
                     en_prob=en_prob, seed=seed)
    return np.array([(w >> (32 * i)) & 0xFFFFFFFF for w in map(int, words) for i in range(lanes)],
                    np.uint32)[:n]


def int_scale_want(x, h):
    with np.errstate(all="ignore"):
        return np.asarray(x, np.int64).astype(np.float32) * \
            (np.asarray(h, np.int64) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)


def int_scale_directed(int_bits):
    """0, ±1, ±2, both extremes, ±2**k and ±(2**k - 1) for every k that fits."""
    lo, hi = -(1 << (int_bits - 1)), (1 << (int_bits - 1)) - 1
    v = {0, 1, -1, 2, -2, lo, hi, lo + 1, hi - 1}
    for k in range(1, int_bits):
        v |= {1 << k, -(1 << k), (1 << k) - 1, -((1 << k) - 1), (1 << k) + 1, -((1 << k) + 1)}
    return np.array(sorted(x for x in v if lo <= x <= hi), np.int64)


def int_scale_ties(int_bits, rng, n):
    """Integer magnitudes and odd normal binary16 significands whose exact product lies exactly halfway
    between two binary32 neighbours. The product ``k * sig`` (both odd) has exactly 25 bits, so its kept 24
    bits are followed by a lone 1; ``(k << j) * sig`` is then a tie too. Random k give both parities of the
    kept LSB (ties to even rounds half of them up). Needs int_bits >= 16 (k has 14 or 15 bits)."""
    sig = rng.integers(1024, 2048, n, dtype=np.int64) | 1
    k = rng.integers(-(-(1 << 24) // sig), ((1 << 25) - 1) // sig + 1, dtype=np.int64) | 1
    k = np.where(k * sig >= 1 << 25, k - 2, k)
    kb = np.array([int(v).bit_length() for v in k])
    ok = kb <= int_bits - 1
    sig, k, kb = sig[ok], k[ok], kb[ok]
    j = np.array([rng.integers(0, int_bits - b) for b in kb], np.int64)
    mag = k << j
    mag = np.where(mag > 1 << (int_bits - 1), k, mag)
    for mg, sg in zip(mag.tolist(), sig.tolist()):            # the construction, checked exactly
        p = mg * sg
        tail = p.bit_length() - 24
        assert tail >= 1 and p & ((1 << tail) - 1) == 1 << (tail - 1), (mg, sg)
    return mag, sig


def int_scale_pairs_to_bits(mag, sig, rng):
    """Random signs on the integers; binary16 patterns with significand `sig` (normal), random sign and
    exponent."""
    x = np.where(rng.random(len(mag)) < 0.5, -mag, mag)
    h = (rng.integers(0, 2, len(sig)) << 15) | (rng.integers(1, 31, len(sig)) << 10) | (sig - 1024)
    return x, h


@pytest.mark.parametrize("int_bits", [4, 16, 18])
def test_int_scale_mul_every_scale(int_bits):
    """Every one of the 65,536 binary16 patterns (zeros, subnormals, normals, infinities, every NaN) times
    two integers of the directed set each (in rotation, so each directed integer meets ~65536 * 2 / len
    scales), plus the special and subnormal-edge scales times the whole directed set."""
    d = int_scale_directed(int_bits)
    h_all = np.arange(1 << 16, dtype=np.int64)
    idx = np.arange(1 << 16)
    x_rot = np.concatenate([d[idx % len(d)], d[(idx * 7 + len(d) // 2) % len(d)]])
    h_rot = np.concatenate([h_all, h_all])
    edges = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x8400, 0x3C00, 0xBC00, 0x7BFF,
                      0xFBFF, 0x7C00, 0xFC00, 0x7C01, 0xFE00, 0x7E00, 0x7FFF], np.int64)
    xe, he = np.meshgrid(d, edges)
    x = np.concatenate([x_rot, xe.ravel()])
    h = np.concatenate([h_rot, he.ravel()])
    check(rtl_int_scale(int_bits, x, h), int_scale_want(x, h))


@pytest.mark.parametrize("int_bits", [16, 18, 25])
def test_int_scale_mul_ties_and_random(int_bits):
    """Round-to-even ties at the 24-bit boundary, their neighbours one unit either side, seeded random
    integer x binary16 pairs (all bit patterns) and random integers times every significand (normal and
    subnormal, random exponents)."""
    rng = np.random.default_rng(100 + int_bits)
    mag, sig = int_scale_ties(int_bits, rng, 1500)
    assert len(mag) > 1000
    mag = np.concatenate([mag, mag - 1, mag + 1])
    sig = np.concatenate([sig, sig, sig])
    xt, ht = int_scale_pairs_to_bits(mag, sig, rng)
    lo, hi = -(1 << (int_bits - 1)), 1 << (int_bits - 1)
    xr = rng.integers(lo, hi, 4000, dtype=np.int64)
    hr = rng.integers(0, 1 << 16, 4000, dtype=np.int64)
    sig_all = np.arange(2048, dtype=np.int64)                 # hidden bit + fraction, 0..1023 subnormal
    hs = (rng.integers(0, 2, 2048) << 15) | np.where(sig_all >= 1024, rng.integers(1, 31, 2048) << 10, 0) | \
        (sig_all & 0x3FF)
    xs = rng.integers(lo, hi, 2048, dtype=np.int64)
    x = np.concatenate([xt, xr, xs])
    h = np.concatenate([ht, hr, hs])
    check(rtl_int_scale(int_bits, x, h), int_scale_want(x, h))


def test_int_scale_mul_enable_holds_every_stage():
    rng = np.random.default_rng(23)
    x = rng.integers(-(1 << 17), 1 << 17, 1600, dtype=np.int64)
    h = rng.integers(0, 1 << 16, 1600, dtype=np.int64)
    check(rtl_int_scale(18, x, h, lanes=4, en_prob=0.6, seed=5), int_scale_want(x, h))


def test_int_scale_mul_single_unit_latency():
    """One unit on its own (the plain `simulate` harness checks the first result's cycle against LATENCY)."""
    x = np.array([0, 1, -1, 5, -(1 << 24), (1 << 24) - 1, 3, 0], np.int64)
    h = np.array([0xBC00, 0x8000, 0x0001, 0x7C00, 0x3C01, 0x7BFF, 0x7E01, 0xFC00], np.int64)
    got = simulate(IntScaleMul(25), x & ((1 << 25) - 1), h)
    check(got, int_scale_want(x, h))
    # A few results spelled out: 0 * -1.0 = -0.0, 1 * -0.0 = -0.0, 0 * -inf = NaN.
    assert got[0] == 0x80000000 and got[1] == 0x80000000 and got[-1] == QNAN


def test_int_scale_mul_rejects_inexact_widths():
    for bad in (1, 26, 32, True, 8.0):
        with pytest.raises(ValueError, match=f"IntScaleMul int_bits must be an integer 2..25 .*not {bad!r}"):
            IntScaleMul(bad)


def test_int_scale_users_prove_exact_sums():
    """The users' integer widths come from proven bounds, and configs past binary32's exact range are refused:
    GEMV segment sums are at most act_block * 8 * 128 in magnitude (kv260 with V planes 2**17: 19 signed bits;
    tiny 2**14: 16), act_block * 128 * 128 with V rows' INT8 weights (kv260 2**21: 23), the systolic field is at
    most 22 bits (two per DSP48E2) and the lane refuses more than 25."""
    from hdl.config import PRESETS
    from hdl.gemv import GemvEngine, PartAccumulator
    from hdl.systolic import EngineGeometry, ScaleLane
    kv, tiny = PRESETS["kv260"].replace(kv_v_layout="planes"), PRESETS["tiny"]
    assert kv.segment_sum_bits == 19 and tiny.segment_sum_bits == 16 and PRESETS["kv260"].segment_sum_bits == 23
    assert EngineGeometry(kv).field == 19 and EngineGeometry(tiny).field == 16
    wide = kv.replace(act_block=16384, weight_group=16384)      # sums up to 16384 * 1024 = 2**24: 26 bits
    with pytest.raises(ValueError, match="GEMV segment sums reach 16777216 .*26 signed bits"):
        GemvEngine(wide)
    with pytest.raises(ValueError, match="PartAccumulator isum_bits must be an integer 2..25 .*not 26"):
        PartAccumulator(kv, 26)
    with pytest.raises(ValueError, match="ScaleLane field must be an integer 2..25 .*not 26"):
        ScaleLane(4, 26)
