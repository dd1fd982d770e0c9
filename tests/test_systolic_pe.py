"""The systolic array's integer core in the Amaranth simulator: the DSP-packed PE proved exhaustively, and
small arrays bit-exact against `sim.systolic.array_segment_sums` under random bubbles."""

import numpy as np
import pytest
from amaranth import Module, signed
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out
from amaranth.sim import Simulator

from hdl.systolic import SystolicArray, extract_pair, step_layout
from sim.systolic import array_segment_sums, field_bits


class ExtractedArray(wiring.Component):
    """The array with the lanes' sign correction on every column output (what the scale stage sees)."""

    def __init__(self, rows, cols, field, *, naive=False):
        self._args = (rows, cols, field, naive)
        super().__init__({
            "i_step": In(step_layout(rows, cols)),
            "o_valid": Out(cols),
            "o_lo": Out(data.ArrayLayout(signed(field), cols)),
            "o_hi": Out(data.ArrayLayout(signed(field), cols)),
        })

    def elaborate(self, platform):
        rows, cols, field, naive = self._args
        m = Module()
        m.submodules.array = array = SystolicArray(rows, cols, field, naive=naive)
        m.d.comb += array.i_step.eq(self.i_step)
        for c in range(cols):
            lo, hi = extract_pair(array.o_res[c].p, field)
            m.d.comb += [self.o_valid[c].eq(array.o_res[c].valid), self.o_lo[c].eq(lo), self.o_hi[c].eq(hi)]
        return m


def rtl_segment_sums(q_w, q_a, seg, rows, cols, *, bubbles=0.0, seed=0, naive=False):
    """Run (R tokens, 2C output rows, K = nseg·seg) through the array in pysim, one k-step per cycle unless
    a bubble is inserted (probability `bubbles`); return int64 [R, 2C, nseg] collected from the column
    drains (row t of a segment leaves column c 2t + c cycles after row 0 of column 0)."""
    rng = np.random.default_rng(seed)
    field = field_bits(seg)
    kp = q_w.shape[1]
    nseg = kp // seg
    dut = ExtractedArray(rows, cols, field, naive=naive)
    layout = step_layout(rows, cols)
    got = [[[] for _ in range(cols)] for _ in range(2)]

    async def bench(ctx):
        k = 0
        idle = 0
        while True:
            if k < kp and rng.random() >= bubbles:
                step = {"valid": 1, "a": [int(v) for v in q_a[:, k]], "w": [int(v) for v in q_w[:, k]],
                        "last": int(k % seg == seg - 1), "tag": {}}
                k += 1
            else:
                step = {"valid": 0, "a": [0] * rows, "w": [0] * (2 * cols), "last": 0, "tag": {}}
                idle += k >= kp
            ctx.set(dut.i_step, layout.const(step))
            await ctx.tick()
            valid = ctx.get(dut.o_valid)
            if valid:
                lo, hi = ctx.get(dut.o_lo), ctx.get(dut.o_hi)
                for c in range(cols):
                    if valid >> c & 1:
                        got[0][c].append(lo[c])
                        got[1][c].append(hi[c])
            if idle > 2 * rows + cols + 8:
                break

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    out = np.zeros((rows, 2 * cols, nseg), dtype=np.int64)
    for c in range(cols):
        for f in range(2):
            seq = got[f][c]
            assert len(seq) == rows * nseg, f"column {c} drained {len(seq)} sums, expected {rows * nseg}"
            out[:, 2 * c + f, :] = np.array(seq).reshape(nseg, rows).T
    return out


def test_pe_exhaustive_all_int4_int4_int8_triples():
    # All 16 x 16 x 256 (w0, w1, a) triples: column c holds w0 = c - 8 for every step, the steps sweep
    # (w1, a), and every step is its own segment, so each drained P is one packed product. Both extracted
    # fields must equal the plain integer products, for the kv260 field spacing (F = 18).
    seg_kv260 = 64
    field = field_bits(seg_kv260)
    assert field == 18
    w1, a = np.meshgrid(np.arange(-8, 8), np.arange(-128, 128), indexing="ij")
    w1, a = w1.reshape(-1), a.reshape(-1)                       # 4096 steps
    n = w1.size
    q_w = np.zeros((32, n), dtype=np.int64)
    q_w[0::2] = np.arange(-8, 8)[:, None]
    q_w[1::2] = w1[None, :]
    q_a = a[None, :]
    dut = ExtractedArray(1, 16, field)
    layout = step_layout(1, 16)
    lo_got = np.full((16, n), 99999, dtype=np.int64)
    hi_got = np.full((16, n), 99999, dtype=np.int64)

    async def bench(ctx):
        count = [0] * 16
        for k in range(n + 40):
            if k < n:
                step = {"valid": 1, "a": [int(a[k])], "w": [int(v) for v in q_w[:, k]], "last": 1, "tag": {}}
            else:
                step = {"valid": 0, "a": [0], "w": [0] * 32, "last": 0, "tag": {}}
            ctx.set(dut.i_step, layout.const(step))
            await ctx.tick()
            valid = ctx.get(dut.o_valid)
            if valid:
                lo, hi = ctx.get(dut.o_lo), ctx.get(dut.o_hi)
                for c in range(16):
                    if valid >> c & 1:
                        lo_got[c, count[c]], hi_got[c, count[c]] = lo[c], hi[c]
                        count[c] += 1

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    w0 = np.arange(-8, 8)[:, None]
    np.testing.assert_array_equal(lo_got, w0 * a[None, :])
    np.testing.assert_array_equal(hi_got, np.broadcast_to(w1 * a, (16, n)))


@pytest.mark.parametrize("rows, cols, seg, bubbles, seed", [
    (2, 2, 16, 0.0, 1),
    (4, 3, 16, 0.3, 2),
    (3, 2, 64, 0.5, 3),
])
def test_array_random_vs_model(rows, cols, seg, bubbles, seed):
    rng = np.random.default_rng(seed)
    nseg = 3
    q_w = rng.integers(-8, 8, size=(2 * cols, nseg * seg))
    q_a = rng.integers(-127, 128, size=(rows, nseg * seg))
    got = rtl_segment_sums(q_w, q_a, seg, rows, cols, bubbles=bubbles, seed=seed)
    np.testing.assert_array_equal(got, array_segment_sums(q_w, q_a, seg), err_msg=f"seed {seed}")


@pytest.mark.parametrize("w0, w1, a", [(-8, -8, -128), (-8, -8, 127), (7, 7, -128), (-8, 7, 127), (7, -8, -128),
                                       (0, -8, -128), (-8, 0, 127)])
def test_array_worst_case_segments(w0, w1, a):
    # The largest segment sums the field spacing must hold: 64 equal products of extreme values
    # (|sum| up to 64 * 8 * 128 = 2**16), in both fields, with opposite signs in the two fields.
    seg, rows, cols = 64, 2, 2
    q_w = np.empty((4, 2 * seg), dtype=np.int64)
    q_w[0::2], q_w[1::2] = w0, w1
    q_a = np.full((rows, 2 * seg), a, dtype=np.int64)
    q_a[1, seg:] = -a if a != -128 else 127          # second row, second segment: the other sign
    got = rtl_segment_sums(q_w, q_a, seg, rows, cols)
    expect = np.einsum("nsk,tsk->tns", q_w.reshape(4, 2, seg), q_a.reshape(rows, 2, seg))
    np.testing.assert_array_equal(got, expect)


def test_array_zero_rows_and_columns():
    # Zero weight rows and zero activation rows give exact zeros; the others are unaffected.
    rng = np.random.default_rng(7)
    seg, rows, cols = 16, 3, 2
    q_w = rng.integers(-8, 8, size=(4, 2 * seg))
    q_w[1] = 0
    q_a = rng.integers(-127, 128, size=(rows, 2 * seg))
    q_a[2] = 0
    got = rtl_segment_sums(q_w, q_a, seg, rows, cols, bubbles=0.2, seed=7)
    assert np.all(got[:, 1] == 0) and np.all(got[2] == 0)
    np.testing.assert_array_equal(got, array_segment_sums(q_w, q_a, seg))


def test_naive_array_same_results():
    # The DSP-count reference computes the same sums (so the comparison in docs/systolic.md is like for like).
    rng = np.random.default_rng(8)
    seg, rows, cols = 16, 2, 2
    q_w = rng.integers(-8, 8, size=(4, 2 * seg))
    q_a = rng.integers(-128, 128, size=(rows, 2 * seg))
    got = rtl_segment_sums(q_w, q_a, seg, rows, cols, naive=True)
    np.testing.assert_array_equal(got, array_segment_sums(q_w, q_a, seg))


def test_pe_maps_to_one_dsp48e2():
    # Yosys synth_xilinx -family xcup: the packed PE is one DSP48E2, the naive one (two multiplies) is two.
    # (The 8x8 array comparison and the kv260-size synthesis are in benchmarks/systolic.py.)
    from hdl.synth import synthesize
    from hdl.systolic import NaivePE, SystolicPE
    field = field_bits(64)
    assert synthesize(SystolicPE(field), "systolic_pe").dsp == 1
    assert synthesize(NaivePE(field), "systolic_naive_pe").dsp == 2
