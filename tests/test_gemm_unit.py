"""The NPU's WGEMM unit (hdl.gemm.GemmUnit: the systolic engine fed from row-major DDR matrices) in the
Amaranth simulator: bit-exact against `sim.systolic.gemm` (itself proven equal to `sim.numerics.gemv` token by
token), with random AXI latency and pauses on every read port and random stalls on the L2 side; ragged rows,
columns and token counts, several chunks and row tiles, accm. The full-chip bench (tests/test_npu.py "gemm")
runs the same unit inside the NPU against the ISS."""

import numpy as np
import pytest
from amaranth.sim import Simulator

from hdl.config import HardwareConfig
from hdl.gemm import GemmUnit, chunk_columns
from sim.numerics import pack_int4, quantize_activations, quantize_weights
from hdl.systolic import EngineGeometry
from sim.systolic import gemm

HW = HardwareConfig.preset("tiny")


def _image(rng, rows, cols, group):
    """Row-major INT4 rows and row-major binary16 scales at random DDR offsets (any byte alignment)."""
    q_w, s_w = quantize_weights(rng.standard_t(5, size=(rows, cols)), group)
    pcols = cols + cols % 2
    qp = np.zeros((rows, pcols), np.int8)
    qp[:, :cols] = q_w
    wbytes = pack_int4(qp).reshape(-1)
    sbytes = np.asarray(s_w, np.float16).view(np.uint8).reshape(-1)
    mem = bytearray(rng.integers(0, 256, size=1 << 16, dtype=np.uint8).tobytes())   # garbage elsewhere
    wbase = int(rng.integers(0, 64)) + 0x1000
    sbase = wbase + len(wbytes) + int(rng.integers(1, 64))
    mem[wbase:wbase + len(wbytes)] = wbytes.tobytes()
    mem[sbase:sbase + len(sbytes)] = sbytes.tobytes()
    return q_w, s_w, mem, wbase, sbase


async def axi_read_slave(ctx, axi, mem, rng, stall, B, slverr_at=None):
    """In-order AXI4 read slave of `mem` (B bytes per beat): random arready, random R pauses, a FIFO of
    accepted bursts; SLVERR on the beat holding byte `slverr_at`."""
    pending = []
    while True:
        ctx.set(axi.arready, int(rng.random() >= stall))
        if pending and rng.random() >= stall:
            addr, left = pending[0]
            ctx.set(axi.rdata, int.from_bytes(bytes(mem[addr:addr + B]), "little"))
            ctx.set(axi.rresp, 2 if slverr_at is not None and addr <= slverr_at < addr + B else 0)
            ctx.set(axi.rlast, int(left == 1))
            ctx.set(axi.rvalid, 1)
        else:
            ctx.set(axi.rvalid, 0)
        _, _, arv, arr, araddr, arlen, rv, rr = await ctx.tick().sample(
            axi.arvalid, axi.arready, axi.araddr, axi.arlen, axi.rvalid, axi.rready)
        if rv and rr:
            addr, left = pending[0]
            pending[0] = (addr + B, left - 1)
            if left == 1:
                pending.pop(0)
        if arv and arr:
            assert araddr % B == 0
            pending.append((araddr, arlen + 1))


def add_read_slaves(sim, ports, mem, rng, stall, B, slverr_at=None):
    """An `axi_read_slave` process on each AXI read port of `ports`."""
    def slave(axi):
        async def bench(ctx):
            await axi_read_slave(ctx, axi, mem, rng, stall, B, slverr_at)
        return bench
    for axi in ports:
        sim.add_process(slave(axi))


def run_unit(rows, cols, ntok, *, accm=False, seed=0, stall=0.3, chunk_beats=None, hw=HW, slverr_at=None,
             before=None):
    """One command of `rows` x `cols` for `ntok` tokens, checked bit for bit; with `before` = (rows, cols), a
    command of that shape (one token, its own weights and L2 rows) runs first on the same unit."""
    rng = np.random.default_rng(seed)
    dut = GemmUnit(hw, chunk_beats=chunk_beats)
    q_w, s_w, mem, wbase, sbase = _image(rng, rows, cols, hw.weight_group)
    first = None
    if before is not None:                       # its weights and scales in the upper half of the memory
        r0, c0 = before
        _, _, mem0, w0, s0 = _image(rng, r0, c0, hw.weight_group)
        mem[0x8000 + w0:0x8000 + s0 + 2 * r0 * -(-c0 // hw.weight_group)] = \
            mem0[w0:s0 + 2 * r0 * -(-c0 // hw.weight_group)]
        first = {"wbase": 0x8000 + w0, "sbase": 0x8000 + s0, "rows": r0, "cols": c0, "ntok": 1}
    x = (rng.normal(size=(ntok, cols)) * rng.uniform(1e-2, 10.0, size=(ntok, 1))).astype(np.float32)
    x[0, : min(cols, 3)] = 0.0
    qa, ea = zip(*(quantize_activations(v, hw.act_block) for v in x))
    stride = 4 * -(-rows // 4)
    dst = 4 * int(rng.integers(0, 8))
    spare = dst + ntok * stride + 8                 # L2 elements from here on: the first command's rows
    l2 = rng.normal(size=spare + (before[0] if before else 0) + 8).astype(np.float32)
    l2_before = l2.copy()
    W, B = hw.weights_per_beat, hw.bytes_per_beat
    done = {"cycles": 0}

    async def command(ctx, fields):
        ctx.set(dut.i_cmd.payload, fields)
        ctx.set(dut.i_cmd.valid, 1)
        await ctx.tick().until(dut.i_cmd.ready)
        ctx.set(dut.i_cmd.valid, 0)
        done["sent"], done["started"] = done.get("sent", 0) + 1, False     # this command's busy not seen yet

    async def feed(ctx):
        if first is not None:
            await command(ctx, {**first, "dst": spare, "stride": 4 * -(-first["rows"] // 4), "accm": 0})
            await ctx.tick().until(~dut.o_busy)
        for t in range(ntok):
            ctx.set(dut.i_tok, t)
            for b, e in enumerate(ea[t]):
                ctx.set(dut.i_exp.payload.addr, b)
                ctx.set(dut.i_exp.payload.e, int(e))
                ctx.set(dut.i_exp.valid, 1)
                await ctx.tick()
            ctx.set(dut.i_exp.valid, 0)
            q = np.zeros(-(-cols // W) * W, np.int64)
            q[:cols] = qa[t]
            for a in range(len(q) // W):
                ctx.set(dut.i_act.payload.addr, a)
                ctx.set(dut.i_act.payload.q, [int(v) for v in q[a * W:(a + 1) * W]])
                ctx.set(dut.i_act.valid, 1)
                await ctx.tick().until(dut.i_act.ready)
            ctx.set(dut.i_act.valid, 0)
        # wait for the last word to be written lane by lane before the token slot changes
        for _ in range(W + 2):
            await ctx.tick()
        await command(ctx, {"wbase": wbase, "sbase": sbase, "rows": rows, "cols": cols, "ntok": ntok, "dst": dst,
                            "stride": stride, "accm": int(accm)})

    async def l2_side(ctx):
        """The L2 row writer and reader: commands, old values, elements; random stalls."""
        wcmds, rcmds, old = [], [], []
        cur = None
        while True:
            ctx.set(dut.o_wcmd.ready, int(cur is None and rng.random() >= stall))
            ctx.set(dut.o_rcmd.ready, int(not old and rng.random() >= stall))
            ctx.set(dut.o_y.ready, int(cur is not None and rng.random() >= stall))
            if old and rng.random() >= stall:
                ctx.set(dut.i_old.payload, int(np.float32(old[0]).view(np.uint32)))
                ctx.set(dut.i_old.valid, 1)
            else:
                ctx.set(dut.i_old.valid, 0)
            s = await ctx.tick().sample(dut.o_wcmd.valid, dut.o_wcmd.ready, dut.o_wcmd.payload,
                                        dut.o_rcmd.valid, dut.o_rcmd.ready, dut.o_rcmd.payload,
                                        dut.o_y.valid, dut.o_y.ready, dut.o_y.payload,
                                        dut.i_old.valid, dut.i_old.ready, dut.o_busy, dut.o_error)
            _, _, wv, wr, wp, rv, rr, rp, yv, yr, yp, ov, orr, busy, error = s
            done["error"] = error
            if ov and orr:
                old.pop(0)
            if yv and yr:
                addr, n = cur
                l2[addr] = np.uint32(yp).view(np.float32)
                cur = (addr + 1, n - 1) if n > 1 else None
            if wv and wr:
                wcmds.append((int(wp.addr), int(wp.n)))
                cur = (int(wp.addr), int(wp.n))
            if rv and rr:
                rcmds.append((int(rp.addr), int(rp.n)))
                old.extend(l2[int(rp.addr):int(rp.addr) + int(rp.n)])
            done["cycles"] += 1
            if (done["cycles"] > 20 and not busy and cur is None and done.get("started")
                    and done.get("sent", 0) == 1 + (first is not None)):
                done["wcmds"], done["rcmds"] = wcmds, rcmds
                return
            if busy:
                done["started"] = True
            assert done["cycles"] < 200_000, "timeout"

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    add_read_slaves(sim, [getattr(dut, f"m_axi{p}") for p in range(dut.axi_ports)], mem, rng, stall, B, slverr_at)
    sim.add_testbench(feed)
    sim.add_testbench(l2_side)
    sim.run()
    if slverr_at is not None:          # the results are unspecified; the unit must finish and flag it
        return done

    acc = l2_before[dst:dst + ntok * stride].reshape(ntok, stride)[:, :rows] if accm else None
    want = gemm(q_w, s_w, np.array(qa), np.array(ea), group=hw.weight_group, block=hw.act_block, acc=acc,
                tile=(hw.systolic_rows, 2 * hw.systolic_cols))
    got = l2[dst:dst + ntok * stride].reshape(ntok, stride)[:, :rows]
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))
    # nothing else in L2 was written
    mask = np.ones(l2.size, bool)
    mask[spare:] = False
    for t in range(ntok):
        mask[dst + t * stride:dst + t * stride + rows] = False
    np.testing.assert_array_equal(l2[mask].view(np.uint32), l2_before[mask].view(np.uint32))
    wcmds = [w for w in done["wcmds"] if w[0] < spare]
    assert wcmds == [(dst + t * stride + n0, min(2 * hw.systolic_cols, rows - n0))
                     for n0 in range(0, rows, 2 * hw.systolic_cols) for t in range(ntok)]
    assert done["rcmds"] == (wcmds if accm else [])
    return done["cycles"]


def test_chunk_columns():
    assert chunk_columns(HW) == 64 and chunk_columns(HardwareConfig.preset("kv260")) == 512


@pytest.mark.parametrize("rows,cols,ntok,accm,chunk_beats", [
    (8, 16, 4, False, None),          # one tile, one segment, one chunk
    (13, 70, 3, False, None),         # ragged rows, odd-ish columns, padding tokens, two chunks
    (21, 128, 1, True, 1),            # accm, three row tiles, 8 chunks of one beat
    (16, 200, 4, True, None),         # four chunks, last one partial
])
def test_unit_random(rows, cols, ntok, accm, chunk_beats):
    run_unit(rows, cols, ntok, accm=accm, chunk_beats=chunk_beats, seed=rows * 1000 + cols)


def test_unit_after_a_command_of_one_row_tile():
    """A command of one row tile (its scale loader ends on the other bank) and then one of eight: the FFN down
    projection after an up projection piece of a prefill program. Every party starts the next command on
    bank 0."""
    run_unit(64, 128, 4, seed=9, before=(4, 64))


# two weight ports (a k-step is two 64-bit beats), one k-step per beat, a scale port of its own
TWO_PORTS = HW.replace(systolic_cols=16, systolic_rows=4, axi_ports=4, act_block=32, weight_group=32)


@pytest.mark.parametrize("rows,cols,ntok,accm", [(40, 96, 4, True), (32, 32, 2, False)])
def test_unit_two_weight_ports(rows, cols, ntok, accm):
    assert EngineGeometry(TWO_PORTS).wgt_ports == 2
    run_unit(rows, cols, ntok, accm=accm, hw=TWO_PORTS, seed=cols)


@pytest.mark.parametrize("where", ["weights", "scales"])
def test_unit_bus_error_finishes_and_flags(where):
    rng = np.random.default_rng(5)
    _, _, _, wbase, sbase = _image(rng, 13, 70, HW.weight_group)     # the same draws as run_unit's seed 5
    done = run_unit(13, 70, 3, seed=5, slverr_at=(wbase + 40) if where == "weights" else (sbase + 3))
    assert done["error"] == 1


def test_unit_errors():
    with pytest.raises(ValueError, match="power-of-two number of beats"):
        GemmUnit(HW, chunk_beats=3)
    with pytest.raises(ValueError, match="scale port"):
        GemmUnit(HW.replace(axi_ports=1))
