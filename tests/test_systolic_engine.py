"""The tile engine (hdl.systolic.SystolicEngine, tiny preset) in the Amaranth simulator: bit-exact against
`sim.systolic.gemm` with random stalls on every stream, its stated latency, throughput of one k-step per
cycle, and its parameter checks. (The Verilator bench behind the AXI DMA is tests/test_systolic_tb.py.)"""

import numpy as np
import pytest
from amaranth.sim import Simulator

from hdl.config import PRESETS
from hdl.systolic import SystolicEngine
from sim.numerics import quantize_activations, quantize_weights
from sim.systolic import TileGeometry, gemm, tile_streams, untile_output


def operands(rng, geo, rows, cols, tokens):
    q_w, s_w = quantize_weights(rng.standard_t(5, size=(rows, cols)), geo.group)
    x = (rng.normal(size=(tokens, cols)) * rng.uniform(1e-2, 10.0, size=(tokens, 1))).astype(np.float32)
    qa, ea = zip(*(quantize_activations(v, geo.block) for v in x))
    return q_w, s_w, np.array(qa), np.array(ea)


def rtl_gemm(cfg, q_w, s_w, q_a, e_a, *, stall=0.0, seed=0):
    """Run a GEMM through the engine in pysim; returns (binary32 result, o_y transfer cycles, cycles of
    the i_act transfers)."""
    geo = TileGeometry.from_config(cfg)
    st = tile_streams(geo, q_w, s_w, q_a, e_a)
    dut = SystolicEngine(cfg)
    rng = np.random.default_rng(seed)
    out, out_cycles, act_cycles = [], [], []
    n_out = len(st["tiles"]) * geo.rows
    cycle = [0]

    def source(stream, items, conv, log=None):
        async def bench(ctx):
            for item in items:
                while rng.random() < stall:
                    ctx.set(stream.valid, 0)
                    await ctx.tick()
                ctx.set(stream.payload, conv(item))
                ctx.set(stream.valid, 1)
                await ctx.tick().until(stream.ready)
                if log is not None:
                    log.append(cycle[0])
            ctx.set(stream.valid, 0)
        return bench

    async def sink(ctx):
        while len(out) < n_out:
            ctx.set(dut.o_y.ready, int(rng.random() >= stall))
            await ctx.tick()
            assert cycle[0] < 50_000, "timeout"

    async def monitor(ctx):
        async for _, _, valid, ready, payload in ctx.tick().sample(dut.o_y.valid, dut.o_y.ready, dut.o_y.payload):
            cycle[0] += 1
            if valid and ready:
                out.append([int(v) for v in payload.y])
                out_cycles.append(cycle[0])

    shape = lambda port: port.payload.shape()    # noqa: E731
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(source(dut.i_cmd, st["cmd"], int))
    for p in range(geo.wgt_ports):
        sim.add_testbench(source(dut.i_wgt[p], st["wgt"][p], int))
    sim.add_testbench(source(dut.i_act, st["act"], lambda v: shape(dut.i_act).const(v), act_cycles))
    sim.add_testbench(source(dut.i_exp, st["exp"], lambda v: shape(dut.i_exp).const(v)))
    sim.add_testbench(source(dut.i_scale, st["scale"], lambda v: shape(dut.i_scale).const(v)))
    sim.add_testbench(sink)
    sim.add_process(monitor)
    sim.run()
    return untile_output(geo, out, q_a.shape[0], q_w.shape[0]), out_cycles, act_cycles, dut


@pytest.mark.parametrize("rows, cols, tokens, stall, seed", [(9, 50, 5, 0.3, 1), (20, 70, 9, 0.5, 2),
                                                             (1, 7, 1, 0.2, 3)])
def test_engine_random_with_stalls(rows, cols, tokens, stall, seed):
    cfg = PRESETS["tiny"]
    geo = TileGeometry.from_config(cfg)
    ops = operands(np.random.default_rng(seed), geo, rows, cols, tokens)
    y, _, _, _ = rtl_gemm(cfg, *ops, stall=stall, seed=seed)
    ref = gemm(*ops, group=geo.group, block=geo.block)
    np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), err_msg=f"seed {seed}")


def test_engine_two_weight_ports_with_stalls():
    # A k-step wider than a beat: 2C = 16 weights = 64 bits over two 32-bit weight ports (as kv260's 256-bit
    # steps over two 128-bit ports), each port stalling independently.
    cfg = PRESETS["tiny"].replace(systolic_rows=2, systolic_cols=8, axi_data_bits=32)
    geo = TileGeometry.from_config(cfg)
    assert (geo.wgt_ports, geo.steps_per_beat) == (2, 1)
    ops = operands(np.random.default_rng(6), geo, 21, 40, 3)
    y, _, _, _ = rtl_gemm(cfg, *ops, stall=0.3, seed=6)
    np.testing.assert_array_equal(y.view(np.uint32), gemm(*ops, group=geo.group, block=geo.block).view(np.uint32))


def test_engine_latency_and_full_rate():
    # Without stalls the engine takes one k-step per cycle, back to back across tiles (3 tiles here; a tile
    # longer than latency + R steps, so that a y bank is read out before the tile after next needs it),
    # and the first output row of a tile is valid `latency` cycles after its last k-step was accepted.
    cfg = PRESETS["tiny"]
    geo = TileGeometry.from_config(cfg)
    ops = operands(np.random.default_rng(4), geo, 3 * 2 * geo.cols, 4 * geo.seg, geo.rows)
    y, out_cycles, act_cycles, dut = rtl_gemm(cfg, *ops)
    np.testing.assert_array_equal(y, gemm(*ops, group=geo.group, block=geo.block))
    kp = 4 * geo.seg
    assert kp >= dut.latency + geo.rows
    assert act_cycles == list(range(act_cycles[0], act_cycles[0] + 3 * kp)), "one k-step per cycle"
    last_step = act_cycles[kp - 1]
    assert out_cycles[0] - last_step == dut.latency
    assert out_cycles[:geo.rows] == list(range(out_cycles[0], out_cycles[0] + geo.rows))


def test_engine_parameter_checks():
    kv = PRESETS["kv260"]
    with pytest.raises(ValueError, match="shorter than the 2 x 32 cycles"):
        SystolicEngine(kv.replace(act_block=32))
    with pytest.raises(ValueError, match="weight_group > 0"):
        SystolicEngine(kv.replace(weight_group=0))
    with pytest.raises(ValueError, match="needs 4 weight ports; the config has 2"):
        SystolicEngine(PRESETS["tiny"].replace(systolic_cols=16, axi_data_bits=32))
