"""cocotb bench of `hdl.axi.AxiReadArbiter` with three masters (two `AxiReadDma`, one `DdrReader`; top in
tb/axi/arbiter_top.py) on one port of a `ReorderingAxiReadRam` (IDs complete out of order, their beats
interleave, random latency and AR/R pauses), with random stalls on every command and data stream. All
three run seeded random commands at once; each must receive exactly its own data (DMA beats compared with
memory, DdrReader elements with NumPy), and the port must have seen all three IDs."""

from __future__ import annotations

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge, gather
from cocotbext.axi import AxiReadBus

from hdl.config import HardwareConfig
from hdl.ddrio import reader_cmd_layout
from tb.axi.reorder_memory import ReorderingAxiReadRam
from tb.axi.streams import StreamSink, StreamSource, pauses
from tb.axi.test_dma import cmd_word, random_commands, split
from tb.ddrio.common import pack, reset
from tb.ddrio.test_reader import check as check_reader
from tb.ddrio.test_reader import random_commands as reader_commands
from tb.runner import bench_env

MEM = 1 << 16
FLOWS = [(0, 0, 0.0), (10, 30, 0.3), (40, 10, 0.1)]     # (latency, jitter, stall probability)


class ArStability:
    """AXI rule on the shared port: once ``arvalid`` is up without ``arready``, it stays up with the same
    ``arid``/``araddr``/``arlen`` until accepted (the arbiter must not re-arbitrate a presented address)."""

    def __init__(self, dut):
        self.dut, self.held, self.checked = dut, None, 0

    async def run(self):
        d = self.dut
        while True:
            await RisingEdge(d.clk)
            await ReadOnly()
            now = (int(d.axi__arid.value), int(d.axi__araddr.value), int(d.axi__arlen.value))
            valid, ready = int(d.axi__arvalid.value), int(d.axi__arready.value)
            if self.held is not None:
                assert valid and now == self.held, f"AR changed before acceptance: {self.held} -> {now}, valid {valid}"
                self.checked += 1
            self.held = now if valid and not ready else None


@cocotb.test(timeout_time=10, timeout_unit="ms")
async def three_masters(dut):
    seed = int(bench_env("SEED", "1"))
    lat, jit, p = FLOWS[int(bench_env("FLOW", "1"))]
    hw = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    rng = random.Random(seed)
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    ram = ReorderingAxiReadRam(AxiReadBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, size=MEM,
                               latency=lat, jitter=jit, rng=random.Random(seed + 9),
                               max_outstanding_per_id=hw.axi_max_outstanding,
                               ar_pause=pauses(random.Random(seed + 1), p) if p else None,
                               r_pause=pauses(random.Random(seed + 2), p) if p else None)
    ram.write(0, bytes(rng.randrange(256) for _ in range(MEM)))
    a_cmds, b_cmds = random_commands(hw, rng, 25), random_commands(hw, rng, 25)
    r_cmds = [dict(c, wide=0) for c in reader_commands(hw, rng, ram, 20)]   # the top hands on o_elem alone
    mem = ram.read(0, MEM)
    srcs, sinks = [], []
    for k, (cmd, out) in enumerate([("a_cmd", "a_data"), ("b_cmd", "b_data"), ("r_cmd", "r_elem")]):
        srcs.append(StreamSource(dut, cmd, dut.clk, rng=random.Random(seed + 10 + k), p_idle=p))
        sinks.append(StreamSink(dut, out, dut.clk, rng=random.Random(seed + 20 + k), p_stall=p))
    stability = ArStability(dut)
    await reset(dut)
    cocotb.start_soon(stability.run())
    for s in sinks:
        cocotb.start_soon(s.run())
    layout = reader_cmd_layout(hw)
    await gather(srcs[0].send([cmd_word(hw, a, n) for a, n in a_cmds]),
                 srcs[1].send([cmd_word(hw, a, n) for a, n in b_cmds]),
                 srcs[2].send([pack(layout, **c) for c in r_cmds]))
    B = hw.bytes_per_beat
    for sink, cmds in [(sinks[0], a_cmds), (sinks[1], b_cmds)]:
        await sink.wait_for(sum(-(-n // B) for _, n in cmds), timeout_cycles=300_000)
    await sinks[2].wait_for(sum(c["n"] for c in r_cmds), timeout_cycles=300_000)
    for _ in range(60):                        # nothing more may arrive
        await FallingEdge(dut.clk)
    for name, sink, cmds in [("a", sinks[0], a_cmds), ("b", sinks[1], b_cmds)]:
        for (addr, n), (data, errs) in zip(cmds, split(hw, sink.items, cmds)):
            assert data == mem[addr:addr + n], f"master {name}, command ({addr:#x}, {n}): data differs"
            assert not any(errs), f"master {name}, command ({addr:#x}, {n}): err flag"
    check_reader(hw, sinks[2].items, r_cmds, mem, what="reader: ")
    assert ram.ids_seen == {0, 1, 2}, f"IDs on the port: {sorted(ram.ids_seen)}"
    dut._log.info("arbiter: %d bursts, %d beats, %d beats interleaved with another burst, %d held AR cycles",
                  len(ram.bursts), ram.beats, ram.interleaved, stability.checked)
