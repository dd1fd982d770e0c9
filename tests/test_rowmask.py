"""The GEMV engine's row-mask gather (`hdl.rowmask.RowGather`) in the Amaranth simulator: the live rows of a
share, in row order, against NumPy's ``flatnonzero`` of the same mask, and its cycle count."""

import numpy as np
import pytest
from amaranth.sim import Simulator

from hdl.rowmask import MASK_LANES, RowGather


def gather(mask: np.ndarray, shares: list[tuple[int, int]], max_share: int):
    """Writes `mask` (bools) into a RowGather, gathers each ``(lo, hi)`` in turn; returns per share the rows read
    back from the index memory and the cycles from start to not busy."""
    dut = RowGather(len(mask), max_share)
    out = []

    async def bench(ctx):
        words = mask.reshape(-1, MASK_LANES)
        for a, w in enumerate(words):
            ctx.set(dut.i_mask_en, 1)
            ctx.set(dut.i_mask_addr, a)
            ctx.set(dut.i_mask_bits, int(sum(int(b) << i for i, b in enumerate(w))))
            await ctx.tick()
        ctx.set(dut.i_mask_en, 0)
        for lo, hi in shares:
            ctx.set(dut.i_lo, lo)
            ctx.set(dut.i_hi, hi)
            ctx.set(dut.i_start, 1)
            assert ctx.get(dut.o_busy) == 1
            await ctx.tick()
            ctx.set(dut.i_start, 0)
            cycles = 1
            while ctx.get(dut.o_busy):
                await ctx.tick()
                cycles += 1
            n = ctx.get(dut.o_count)
            rows = []
            for k in range(n):
                ctx.set(dut.i_idx_addr, k)
                await ctx.tick()
                rows.append(ctx.get(dut.o_idx))
            out.append((rows, cycles))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return out


@pytest.mark.parametrize("seed,density", [(0, 0.05), (1, 0.5), (2, 1.0), (3, 0.0)])
def test_gather_finds_the_live_rows_of_each_share_in_order(seed, density):
    rng = np.random.default_rng(seed)
    rows = 256
    mask = rng.random(rows) < density
    shares = [(0, 64), (64, 128), (128, 192), (192, 256), (3, 201), (250, 251), (40, 40), (0, 256)]
    for (lo, hi), (got, cycles) in zip(shares, gather(mask, shares, rows)):
        want = (np.flatnonzero(mask[lo:hi]) + lo).tolist()
        assert got == want, (lo, hi)
        if hi > lo:
            words = (hi - 1) // MASK_LANES - lo // MASK_LANES + 1
            per_word = [int(np.count_nonzero(mask[max(lo, w * MASK_LANES):min(hi, (w + 1) * MASK_LANES)]))
                        for w in range(lo // MASK_LANES, lo // MASK_LANES + words)]
            assert cycles == 2 + sum(1 + max(1, k) for k in per_word), (lo, hi)


def test_gather_rejects_a_size_that_is_not_whole_words():
    with pytest.raises(ValueError, match="multiple of 4"):
        RowGather(30, 16)
