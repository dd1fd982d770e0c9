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
    assert dut.latency == 37
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
