"""The engine tracker (`hdl.controller.EngineTracker`: the GEMV engine, the GEMM unit, their L2 reader and
writer) in Amaranth's simulator: the running range it reports (``o_hold``) against what its units do, for
matrices handed over back to back in every order (a WGEMM tile after a WGEMM tile, after a GEMV, and the
other way round), with random AXI latency and pauses on every weight port and random L2 stalls.

The pass engine delays every pass whose L2 ranges meet ``o_hold`` and FENCE / HALT wait for it to drop, so
the contract is: from the cycle after a matrix is taken until its last row is in L2, ``o_hold`` is active
with that matrix's rows; no unit is busy, no weight read is open and no row is written while it is not.
Values are the units' own benches' business (tests/test_gemm_unit.py, tests/test_gemv_engine.py)."""

import numpy as np
import pytest
from amaranth.sim import Simulator

from hdl.config import HardwareConfig
from hdl.controller import EngineTracker
from hdl.l2 import LANES
from tests.test_gemm_unit import add_read_slaves

HW = HardwareConfig.preset("tiny")


def _jobs(order, rng):
    """(kind, job fields) for each letter of `order` ("M": a WGEMM tile, "V": a GEMV) at random L2 places."""
    out = []
    for i, kind in enumerate(order):
        rows, cols = int(rng.integers(3, 20)), int(rng.integers(2, 40))
        lo = 64 * i + int(rng.integers(0, 16))
        cmd = {"wbase": 0x100 + int(rng.integers(0, 64)), "sbase": 0x800 + int(rng.integers(0, 64)),
               "rows": rows, "cols": cols}
        if kind == "M":
            ntok = int(rng.integers(1, HW.systolic_rows + 1))
            stride = 4 * -(-rows // 4)
            cmd.update(ntok=ntok, dst=lo, stride=stride, accm=0)
            out.append(("M", {"cmd": cmd, "lo": lo, "n": (ntok - 1) * stride + rows, "pc": i}))
        else:
            cmd.update(log2_group=HW.weight_group.bit_length() - 1, accm=0, sparse=0)
            out.append(("V", {"cmd": cmd, "lo": lo, "n": rows, "pc": i}))
    return out


@pytest.mark.parametrize("order,seed", [("MM", 1), ("MMM", 2), ("VM", 3), ("MV", 4), ("MVMM", 5), ("VMVM", 6)])
def test_the_running_range_covers_every_matrix_until_its_last_row(order, seed):
    rng = np.random.default_rng(seed)
    _check_running_range(HW, _jobs(order, rng), rng)


@pytest.mark.parametrize("seed", [7, 8])
def test_the_running_range_with_a_gemv_engine_of_several_vectors(seed):
    """tiny_v4 (WGEMM on the GEMV engine, no GEMM unit): GEMV jobs of 1 to 4 vectors, their rows at a stride
    (a WGEMM tile's tokens), some with accm; every row of every vector written once, inside the running range."""
    hw = HardwareConfig.preset("tiny_v4")
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(5):
        rows, cols = int(rng.integers(3, 40)), int(rng.integers(2, 40))
        nvec = int(rng.integers(1, hw.gemv_vectors + 1))
        stride = 4 * -(-rows // 4) + 4 * int(rng.integers(0, 3))
        lo = 256 * i + 4 * int(rng.integers(0, 4))
        cmd = {"wbase": 0x100 + int(rng.integers(0, 64)), "sbase": 0x800 + int(rng.integers(0, 64)), "rows": rows,
               "cols": cols, "log2_group": hw.weight_group.bit_length() - 1, "accm": int(rng.random() < 0.4),
               "sparse": 0, "vecs": nvec - 1}
        jobs.append(("V", {"cmd": cmd, "lo": lo, "n": (nvec - 1) * stride + rows, "pc": i, "stride": stride}))
    _check_running_range(hw, jobs, rng)


def _check_running_range(hw, jobs, rng):
    """Runs `jobs` through an `EngineTracker(hw)` and checks the running range's contract every cycle, and that
    the rows written are exactly the jobs' (a GEMV job of several vectors: vector v's rows from ``lo + v *
    stride``), each once."""
    HW = hw
    dut = EngineTracker(HW)
    mem = bytearray(rng.integers(0, 256, size=1 << 13, dtype=np.uint8).tobytes())
    B = HW.bytes_per_beat
    log = {"taken": [], "rows": [], "violations": [], "done": False}

    async def feed(ctx):
        for kind, job in jobs:
            port = dut.i_gemm if kind == "M" else dut.i_gemv
            ctx.set(port.payload, job)
            ctx.set(port.valid, 1)
            await ctx.tick().until(port.ready)
            ctx.set(port.valid, 0)
            log["taken"].append(job["pc"])
            await ctx.tick()
            for _ in range(int(rng.integers(0, 3))):
                await ctx.tick()
            await ctx.tick().until(~dut.o_hold.active)       # what DISPATCH waits for before the next matrix
        for _ in range(50):
            await ctx.tick()
        log["done"] = True

    async def l2(ctx):
        """The L2 side: writes taken with random stalls, reads answered a cycle later; the contract checked
        every cycle."""
        pending = []
        cycle = 0
        while not log["done"]:
            ctx.set(dut.l2_w.ready, int(rng.random() >= 0.3))
            ctx.set(dut.l2_r.req.ready, 1)
            ctx.set(dut.l2_r.resp.valid, int(bool(pending)))
            ctx.set(dut.l2_r.resp.payload, pending[0] if pending else 0)
            _, _, wv, wr, w, qv, qr, rv, rr, hold, gemm_busy, gemv_busy = await ctx.tick().sample(
                dut.l2_w.valid, dut.l2_w.ready, dut.l2_w.payload, dut.l2_r.req.valid, dut.l2_r.req.ready,
                dut.l2_r.resp.valid, dut.l2_r.resp.ready, dut.o_hold, dut.o_gemm_busy, dut.o_gemv_busy)
            cycle += 1
            if rv and rr:
                pending.pop(0)
            if qv and qr:
                pending.append(int(rng.integers(0, 1 << 32)))
            units = [name for name, busy in (("the GEMM unit", gemm_busy), ("the GEMV engine", gemv_busy)) if busy]
            if units and not hold.active:
                log["violations"].append(f"cycle {cycle}: {' and '.join(units)} busy with no running range")
            if wv and wr:
                for lane in range(LANES):
                    if w.mask >> lane & 1:
                        e = int(w.addr) * LANES + lane
                        log["rows"].append(e)
                        if not (hold.active and hold.lo <= e < hold.lo + hold.n):
                            log["violations"].append(f"cycle {cycle}: element {e} written outside the running "
                                                     f"range (active {hold.active}, [{hold.lo}, +{hold.n}))")
            assert cycle < 100_000, "timeout"

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    add_read_slaves(sim, [getattr(dut, f"m_gemv{p}") for p in range(HW.axi_ports)], mem, rng, 0.3, B)
    sim.add_testbench(feed)
    sim.add_testbench(l2)
    sim.run()
    assert log["taken"] == [job["pc"] for _, job in jobs]
    assert not log["violations"], "\n".join(log["violations"][:5])
    want = sorted(e for kind, job in jobs for e in (
        [job["lo"] + v * job.get("stride", 0) + r for v in range(job["cmd"].get("vecs", 0) + 1)
         for r in range(job["cmd"]["rows"])] if kind == "V" else
        [job["lo"] + t * job["cmd"]["stride"] + r for t in range(job["cmd"]["ntok"]) for r in range(job["cmd"]["rows"])]))
    assert sorted(log["rows"]) == want
