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
