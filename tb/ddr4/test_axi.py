"""cocotb: `tb.ddr4.axi.Ddr4AxiMemory` serving reads and writes (tb.ddr4.passthrough.AxiPassthrough: cocotbext-axi's
`AxiMaster` on ``s_axi<p>``, the DDR4 model on ``m_axi<p>``), with random pauses on all five channels on both
sides. Each port writes random bursts into its own region and reads them back, and reads bytes nobody wrote,
concurrently; every read must return the bytes written before it (or the initial ones), every command of the
channel must keep the DRAM timing rules, and the memory must check no AXI rule broken.

Parameters (environment): SEED, PAUSE (pause probability per channel and cycle), OPS (operations per port),
FABRIC_MHZ.
"""

from __future__ import annotations

import logging
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, Combine
from cocotbext.axi import AxiBus, AxiMaster

from tb.runner import bench_env

from .axi import Ddr4AxiMemory
from .model import Ddr4Channel, Ddr4Params, check_timing

PORTS = 2
REGION = 1 << 16          # each port's own bytes
SIZE = 1 << 18            # the memory


def pauses(rng, p):
    while True:
        yield int(rng.random() < p)


@cocotb.test()
async def reads_and_writes(dut):
    seed, pause = int(bench_env("SEED", "0")), float(bench_env("PAUSE", "0.3"))
    ops, mhz = int(bench_env("OPS", "40")), float(bench_env("FABRIC_MHZ", "300"))
    rng = random.Random(seed)
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value = 1
    await ClockCycles(dut.clk, 4)
    dut.rst.value = 0
    initial = rng.randbytes(SIZE)
    params = Ddr4Params(tREFI=2000) if rng.random() < 0.5 else Ddr4Params()     # refreshes within a short run
    channel = Ddr4Channel(params, fabric_hz=mhz * 1e6, ports=PORTS, memory=bytearray(initial))

    def gens():
        return [pauses(random.Random(rng.randrange(1 << 32)), pause) if pause else None for _ in range(PORTS)]

    mem = Ddr4AxiMemory(dut, dut.clk, [f"m_axi{p}" for p in range(PORTS)], channel, writes=True,
                        pauses={k: gens() for k in ("ar", "r", "aw", "w", "b")})
    masters = []
    for p in range(PORTS):
        m = AxiMaster(AxiBus.from_prefix(dut, f"s_axi{p}", bus_separator="__"), dut.clk, dut.rst)
        for ch in (m.write_if.aw_channel, m.write_if.w_channel, m.write_if.b_channel, m.read_if.ar_channel,
                   m.read_if.r_channel):
            ch.set_pause_generator(pauses(random.Random(rng.randrange(1 << 32)), pause) if pause else None)
        m.write_if.log.setLevel(logging.WARNING)
        m.read_if.log.setLevel(logging.WARNING)
        masters.append(m)

    async def port_ops(p, prng):
        mine = bytearray(initial[p * REGION:(p + 1) * REGION])
        for k in range(ops):
            nbytes = 16 * prng.randrange(1, 40)
            off = 16 * prng.randrange(0, (REGION - nbytes) // 16)
            what = prng.random()
            if what < 0.4:
                data = prng.randbytes(nbytes)
                await masters[p].write(p * REGION + off, data)
                mine[off:off + nbytes] = data
            elif what < 0.8:
                got = (await masters[p].read(p * REGION + off, nbytes)).data
                assert got == mine[off:off + nbytes], f"seed {seed} port {p} op {k}: read {nbytes} at {off:#x}"
            else:                                     # bytes nobody writes
                a = PORTS * REGION + 16 * prng.randrange(0, (SIZE - PORTS * REGION - nbytes) // 16)
                got = (await masters[p].read(a, nbytes)).data
                assert got == initial[a:a + nbytes], f"seed {seed} port {p} op {k}: untouched read at {a:#x}"

    await Combine(*[cocotb.start_soon(port_ops(p, random.Random(rng.randrange(1 << 32)))) for p in range(PORTS)])
    assert not mem.errors, mem.errors[0]
    check_timing(channel.log, params, channel.start_ck)
    kinds = {c.kind for c in channel.log}
    assert {"ACT", "RD", "WR"} <= kinds, kinds
    assert all(len(lat) > 0 for lat in mem.latencies)
