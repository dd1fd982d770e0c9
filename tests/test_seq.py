"""`hdl.seq`: the controller's divider and integer reciprocal against Python integers and NumPy."""

import numpy as np
import pytest
from amaranth.sim import Simulator

from hdl.seq import IntRecip, SeqDivider


def _run(dut, bench):
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()


def test_divider_random_and_corners():
    rng = np.random.default_rng(1)
    cases = [(0, 1), (1, 1), (5, 5), (4, 5), (2**32 - 1, 1), (2**32 - 1, 2**32 - 1), (1234567, 512), (7, 3),
             (2**31, 3)] + [(int(rng.integers(0, 2**32)), int(rng.integers(1, 2**rng.integers(1, 33))))
                            for _ in range(60)]
    dut = SeqDivider()

    async def bench(ctx):
        for num, den in cases:
            ctx.set(dut.i_num, num)
            ctx.set(dut.i_den, den)
            ctx.set(dut.i_start, 1)
            await ctx.tick()
            ctx.set(dut.i_start, 0)
            cycles = 0
            while ctx.get(dut.o_busy):
                await ctx.tick()
                cycles += 1
            assert (ctx.get(dut.o_q), ctx.get(dut.o_r)) == divmod(num, den), (num, den)
            assert cycles == 32

    _run(dut, bench)


@pytest.mark.parametrize("seed", [0])
def test_int_recip_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    ns = list(range(0, 300)) + [2048, 2047, 2049, 8960, 16384, 262144, 3 * 2**20, 2**27 + 1, 2**28 - 1] + \
        [int(v) for v in rng.integers(1, 2**28, 40)]
    dut = IntRecip()

    async def bench(ctx):
        for n in ns:
            ctx.set(dut.i_n, n)
            ctx.set(dut.i_start, 1)
            await ctx.tick()
            ctx.set(dut.i_start, 0)
            while ctx.get(dut.o_busy):
                await ctx.tick()
            want = 0x7F800000 if n == 0 else int(np.array([1.0 / n], np.float32).view(np.uint32)[0])   # 1/0: +inf
            assert ctx.get(dut.o_y) == want, (n, hex(ctx.get(dut.o_y)), hex(want))

    _run(dut, bench)
