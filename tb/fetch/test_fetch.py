"""cocotb bench of `hdl.fetch.Fetch` against `tb.axi.memory.LatencyAxiReadRam` (DDR latency, jitter, AR/R
stalls) with random backpressure from the controller side.

Checks: every word of the program arrives once, in order, with its pc; nothing beyond the program's end is
read from memory; read data is never refused (the credit rule: the R channel's ready stays high even while
the controller stalls for long stretches); a stop in mid-program drains every burst in flight before the
unit reports idle, and a following start fetches a different program cleanly; a program that runs past the
end of memory delivers the failing words with ``err``.
"""

from __future__ import annotations

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly
from cocotbext.axi import AxiReadBus

from hdl.config import HardwareConfig
from hdl.fetch import PC_BITS
from tb.axi.memory import LatencyAxiReadRam
from tb.axi.streams import StreamSink, pauses
from tb.runner import bench_env

MEM = 1 << 16


def unpack(item):
    word = item & ((1 << 64) - 1)
    pc = (item >> 64) & ((1 << PC_BITS) - 1)
    err = item >> (64 + PC_BITS) & 1
    return word, pc, err


async def start(dut, base, n):
    await FallingEdge(dut.clk)
    dut.i_base.value, dut.i_len.value, dut.i_start.value = base, n, 1
    await FallingEdge(dut.clk)
    dut.i_start.value = 0


async def stop(dut):
    await FallingEdge(dut.clk)
    dut.i_stop.value = 1
    await FallingEdge(dut.clk)
    dut.i_stop.value = 0


async def wait_idle(dut, limit=200_000):
    for _ in range(limit):
        await FallingEdge(dut.clk)
        if not int(dut.o_busy.value):
            return
    raise AssertionError("fetch stayed busy")


async def watch_rready(dut, log):
    while True:
        await FallingEdge(dut.clk)
        await ReadOnly()
        if int(dut.axi__rvalid.value) and not int(dut.axi__rready.value):
            log.append(1)


@cocotb.test()
async def programs_under_stalls(dut):
    seed = int(bench_env("SEED", "0"))
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    rng = random.Random(seed)
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    ram = LatencyAxiReadRam(AxiReadBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, size=MEM,
                            latency=40, jitter=20, max_outstanding=cfg.axi_max_outstanding, rng=rng,
                            ar_pause=pauses(random.Random(seed + 1), 0.3), r_pause=pauses(random.Random(seed + 2), 0.3))
    ram.write(0, bytes(rng.randrange(256) for _ in range(MEM)))
    refused = []
    cocotb.start_soon(watch_rready(dut, refused))
    dut.i_start.value = dut.i_stop.value = 0
    dut.rst.value = 1
    for _ in range(3):
        await FallingEdge(dut.clk)
    dut.rst.value = 0

    # the long program under heavy controller backpressure is what fills the FIFO: without the credit rule
    # read data would then be refused on the R channel
    plan = [(0.0, rng.choice([1, 2, 3])), (0.5, 17), (0.95, 301), (0.3, rng.choice([64, 65, 300]))]
    for trial, (p_stall, n) in enumerate(plan):
        sink = StreamSink(dut, "o_insn", dut.clk, rng=random.Random(seed + 10 + trial), p_stall=p_stall)
        task = cocotb.start_soon(sink.run())
        base = 16 * rng.randrange(0, 1024)
        ram.bursts.clear()
        await start(dut, base, n)
        await sink.wait_for(n)
        for _ in range(50):
            await FallingEdge(dut.clk)
        task.cancel()
        got = [unpack(x) for x in sink.items]
        assert len(got) == n, f"seed {seed} trial {trial}: {len(got)} words for a {n}-word program"
        for k, (word, pc, err) in enumerate(got):
            expect = int.from_bytes(ram.read(base + 8 * k, 8), "little")
            assert (word, pc, err) == (expect, k, 0), f"seed {seed} trial {trial} word {k}: {(hex(word), pc, err)}"
        end = max(a + b * cfg.bytes_per_beat for a, b in ram.bursts)
        assert end <= base + 8 * n + cfg.bytes_per_beat - 1, f"read up to {end:#x}, past the program end"
        await stop(dut)
        await wait_idle(dut)
    assert not refused, f"seed {seed}: read data was refused on {len(refused)} cycles"


@cocotb.test()
async def stop_mid_program_then_restart(dut):
    seed = int(bench_env("SEED", "0")) + 100
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    rng = random.Random(seed)
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    ram = LatencyAxiReadRam(AxiReadBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, size=MEM,
                            latency=60, jitter=30, max_outstanding=cfg.axi_max_outstanding, rng=rng)
    ram.write(0, bytes(rng.randrange(256) for _ in range(MEM)))
    dut.i_start.value = dut.i_stop.value = 0
    dut.rst.value = 1
    for _ in range(3):
        await FallingEdge(dut.clk)
    dut.rst.value = 0
    for trial in range(6):
        sink = StreamSink(dut, "o_insn", dut.clk, rng=random.Random(seed + trial), p_stall=0.2)
        task = cocotb.start_soon(sink.run())
        await start(dut, 0x1000, 4000)
        await sink.wait_for(rng.randrange(1, 40))
        await stop(dut)                                     # bursts are in flight now
        task.cancel()
        await wait_idle(dut)
        assert ram.in_flight == 0, "idle reported with bursts still in flight"
        # a fresh, short program right after: exactly its words, none of the abandoned one's
        sink = StreamSink(dut, "o_insn", dut.clk, rng=random.Random(seed + 50 + trial), p_stall=0.2)
        task = cocotb.start_soon(sink.run())
        base, n = 0x8000 + 16 * trial, 9
        await start(dut, base, n)
        await sink.wait_for(n)
        for _ in range(100):
            await FallingEdge(dut.clk)
        task.cancel()
        got = [unpack(x) for x in sink.items]
        assert [w for w, _, _ in got] == [int.from_bytes(ram.read(base + 8 * k, 8), "little") for k in range(n)]
        assert [pc for _, pc, _ in got] == list(range(n))
        await stop(dut)
        await wait_idle(dut)


@cocotb.test()
async def bus_error_is_flagged(dut):
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    ram = LatencyAxiReadRam(AxiReadBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, size=MEM, latency=5)
    dut.i_start.value = dut.i_stop.value = 0
    dut.rst.value = 1
    for _ in range(3):
        await FallingEdge(dut.clk)
    dut.rst.value = 0
    sink = StreamSink(dut, "o_insn", dut.clk)
    cocotb.start_soon(sink.run())
    n = 8
    base = MEM - 4 * 8                                      # the last 4 words exist, the next 4 do not
    await start(dut, base, n)
    await sink.wait_for(n)
    errs = [unpack(x)[2] for x in sink.items[:n]]
    assert errs == [0, 0, 0, 0, 1, 1, 1, 1], f"error flags {errs}"
    await stop(dut)
    await wait_idle(dut)
    del cfg
