"""hdl.sfu building blocks in the Amaranth simulator, bit for bit against sim.sfu."""

import numpy as np
import pytest

from hdl.sfu import Recip, SegmentPoly
from sim import sfu as model
from tests.test_fp import CORNERS, check, f32, simulate


def test_segment_poly_matches_horner():
    table = model.table("tanh")
    rng = np.random.default_rng(4)
    n = 1500
    idx = rng.integers(0, len(table), n)
    t = np.concatenate([rng.uniform(0, 2.0 ** -8, n - 6), [0, -0.0, 1e-40, 1.0, np.inf, np.nan]]).astype(np.float32)
    dut = SegmentPoly(table)
    assert dut.latency == 43
    # Pack index and t into one vector per cycle: `simulate` drives i_a; i_index rides in i_b's place.
    got = simulate_poly(dut, idx, t)
    with np.errstate(all="ignore"):
        check(got, model.horner(table[idx], t))


def simulate_poly(dut, idx, t):
    from amaranth.sim import Simulator
    out = []

    async def bench(ctx):
        i = 0
        ctx.set(dut.en, 1)
        while len(out) < len(t):
            ctx.set(dut.i_valid, int(i < len(t)))
            if i < len(t):
                ctx.set(dut.i_index, int(idx[i]))
                ctx.set(dut.i_t, int(t.view(np.uint32)[i]))
                i += 1
            if ctx.get(dut.o_valid):
                out.append(ctx.get(dut.o_y))
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(bench)
    sim.run()
    return np.array(out, np.uint32)


@pytest.mark.parametrize("en_prob", [1.0, 0.7])
def test_recip_matches_model(en_prob):
    rng = np.random.default_rng(8)
    x = np.concatenate([CORNERS, rng.integers(0, 2 ** 32, 1200, dtype=np.uint64).astype(np.uint32),
                        rng.standard_normal(800).astype(np.float32).view(np.uint32)])
    got = simulate(Recip(), x, en_prob=en_prob, seed=1)
    check(got, model.recip(f32(x)))


# --- every function builder on its own (pysim), bit for bit against sim.sfu -----------------------------

from amaranth import Const  # noqa: E402

from hdl.sfu import FlowUnit, exp_flow, gelu_flow, sqrt_flow, tanh_flow, trig_flow  # noqa: E402


def unary_vectors(seed, n=300, scale=None):
    rng = np.random.default_rng(seed)
    parts = [CORNERS, rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32),
             (rng.standard_normal(n) * (scale or 1)).astype(np.float32).view(np.uint32)]
    return np.concatenate(parts)


def _const_node(v, w=1):
    return Const(v, w), 0


@pytest.mark.parametrize("name, build, fn, scale", [
    ("sqrt", lambda f, a, b: sqrt_flow(f, a, _const_node(0)), model.sqrt, 100),
    ("rsqrt", lambda f, a, b: sqrt_flow(f, a, _const_node(1)), model.rsqrt, 100),
    ("exp", lambda f, a, b: exp_flow(f, a), model.exp, 30),
    ("tanh", lambda f, a, b: tanh_flow(f, a), model.tanh, 4),
    ("gelu", lambda f, a, b: gelu_flow(f, a), model.gelu_tanh, 4),
    ("sin", lambda f, a, b: trig_flow(f, a, a, b, _const_node(0, 32), _const_node(0), _const_node(0)), model.sin, 1e4),
    ("cos", lambda f, a, b: trig_flow(f, a, a, b, _const_node(0, 32), _const_node(0), _const_node(1)), model.cos, 1e4),
])
def test_function_matches_model(name, build, fn, scale):
    x = unary_vectors(len(name), scale=scale)
    got = simulate(FlowUnit(build), x, x, en_prob=0.8 if name in ("exp", "sin") else 1.0, seed=3)
    with np.errstate(all="ignore"):
        check(got, fn(f32(x)))


@pytest.mark.parametrize("cosine", [0, 1])
def test_rope_matches_model(cosine):
    rng = np.random.default_rng(11 + cosine)
    pos = 32767 + 12345 * cosine
    f = np.concatenate([np.array([0, 1, 2 ** 62, 2 ** 63, 2 ** 64 - 1], np.uint64),
                        rng.integers(0, 2 ** 64, 300, dtype=np.uint64)])
    hi, lo = (f >> np.uint64(32)).astype(np.uint32), (f & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    unit = FlowUnit(lambda fl, a, b: trig_flow(fl, a, a, b, _const_node(pos, 32), _const_node(1), _const_node(cosine)))
    got = simulate(unit, hi, lo)
    check(got, (model.rope_cos if cosine else model.rope_sin)(f, pos))


# --- the shared evaluator: a different function on every element -----------------------------------------

from amaranth import Cat, Mux  # noqa: E402

from hdl.config import PRESETS  # noqa: E402
from hdl.sfu import Sfu, with_shared  # noqa: E402

# family code in b[0:3] -> the sim.sfu function that element must get
MIXED = [model.exp, model.tanh, model.sqrt, model.rsqrt, model.sin, model.cos]


def _mixed(f, a, b):
    """exp, tanh, sqrt/rsqrt and sin/cos on one `Shared` set (one evaluator, one argument adder, one
    scaling ldexp, one multiplier: the builders' tagged operations), the function picked per element by
    b[0:3]."""
    def graph(f, shared):
        fam = lambda *k: f.comb(lambda v: Cat(*[v[:3] == i for i in k]).any(), b, register=False)
        with shared.serving(None):
            e = exp_flow(f, a)
        with shared.serving(fam(1)):
            t = tanh_flow(f, a)
        with shared.serving(fam(2, 3)):
            q = sqrt_flow(f, a, fam(3))
        with shared.serving(fam(4, 5)):
            s = trig_flow(f, a, a, b, _const_node(0, 32), _const_node(0), fam(5))
        return f.comb(lambda v, ye, yt, yq, ys: Mux(v[:3] == 1, yt, Mux((v[:3] == 2) | (v[:3] == 3), yq,
                                                       Mux(v[:3] >= 4, ys, ye))), b, e, t, q, s)
    return with_shared(f, graph)


@pytest.mark.parametrize("en_prob", [1.0, 0.8])
def test_shared_poly_switches_function_every_element(en_prob):
    # sin/cos next to multiples of pi/2 take the small-argument branch (z*pi/2 on the shared multiplier)
    near = (np.pi / 2 * np.arange(1, 9)).astype(np.float32).view(np.uint32)
    x = np.concatenate([unary_vectors(21, scale=6), near, near])
    rng = np.random.default_rng(22)
    fam = rng.integers(0, len(MIXED), len(x)).astype(np.uint32)
    fam[: 2 * len(MIXED)] = np.tile(np.arange(len(MIXED)), 2)      # every switch, from the first element
    fam[-2 * len(near):] = np.repeat([4, 5], len(near))
    unit = FlowUnit(_mixed)
    got = simulate(unit, x, fam, en_prob=en_prob, seed=5)
    with np.errstate(all="ignore"):
        want = np.choose(fam, [fn(f32(x)).astype(np.float32).view(np.uint32) for fn in MIXED])
    check(got, want.view(np.float32))


def test_sfu_latency_unchanged():
    """The firmware perf model (firmware.perf sfu_pass and vec_pass) is calibrated on these latencies; the
    shared evaluator waits for the latest of its users (exp), which is not on the longest (GELU) path's tail."""
    for preset in ("kv260", "tiny"):
        dut = Sfu(PRESETS[preset])
        dut._MustUse__silence = True                     # only its latency is read; it is not simulated
        assert dut.latency == 222, preset
        assert dut.short_latency == 24, preset          # SHORT_OPS: M1 (after x), A1 (each behind its operand registers), the select


def test_sfu_rejects_too_few_reduction_lanes():
    """Four banks of sfu_reduce_lanes / 4 slots, one adder each: a bank needs more slots than the adder's
    latency, so 32 is the least (the model takes any power of two)."""
    import dataclasses
    for lanes in (4, 8, 16):
        hw = dataclasses.replace(PRESETS["tiny"], sfu_reduce_lanes=lanes)
        with pytest.raises(ValueError, match=rf"sfu_reduce_lanes / 4 \(slots per bank\) > FpAdd latency .*got {lanes}"):
            Sfu(hw)
    Sfu(dataclasses.replace(PRESETS["tiny"], sfu_reduce_lanes=64))._MustUse__silence = True


def test_compare_selects_match_numpy():
    """`_gt` (sign bits and magnitude comparisons), `_fmax`, `_fmin` and `_relu` against NumPy's ``>``,
    ``np.maximum``, ``np.minimum`` and ``np.maximum(v, +0)``: every pair of corner values (±0, subnormals,
    ±inf, NaNs), equal pairs and random pairs, bit for bit (±0 ties pick the second operand)."""
    from amaranth import Module, Signal
    from amaranth.sim import Simulator
    from hdl.sfu import _fmax, _fmin, _gt, _relu

    rng = np.random.default_rng(21)
    rand = np.concatenate([rng.integers(0, 2 ** 32, 600, dtype=np.uint64).astype(np.uint32),
                           rng.standard_normal(600).astype(np.float32).view(np.uint32)])
    a = np.concatenate([np.repeat(CORNERS, len(CORNERS)), rand, rand, rand[:300]]).astype(np.uint32)
    b = np.concatenate([np.tile(CORNERS, len(CORNERS)), rng.permutation(rand), rand,
                        rand[:300] ^ np.uint32(0x80000000)]).astype(np.uint32)
    m = Module()
    sa, sb = Signal(32), Signal(32)
    outs = [Signal(32), Signal(32), Signal(32), Signal()]
    m.d.comb += [outs[0].eq(_fmax(sa, sb)), outs[1].eq(_fmin(sa, sb)), outs[2].eq(_relu(sa)), outs[3].eq(_gt(sa, sb))]
    got = np.zeros((4, len(a)), np.uint32)

    async def bench(ctx):
        for i in range(len(a)):
            ctx.set(sa, int(a[i]))
            ctx.set(sb, int(b[i]))
            for k, o in enumerate(outs):
                got[k, i] = ctx.get(o)

    sim = Simulator(m)
    sim.add_testbench(bench)
    sim.run()
    fa, fb = f32(a), f32(b)
    with np.errstate(all="ignore"):
        check(got[0], np.maximum(fa, fb))
        check(got[1], np.minimum(fa, fb))
        check(got[2], np.maximum(fa, np.float32(0)))
        ok = ~np.isnan(fa) & ~np.isnan(fb)
        np.testing.assert_array_equal(got[3][ok].astype(bool), (fa > fb)[ok])
