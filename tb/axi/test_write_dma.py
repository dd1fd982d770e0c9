"""cocotb bench of `hdl.axi.AxiWriteDma` against cocotbext-axi's `AxiRamWrite` (random pauses on AW, W and B)
with random stalls on the command and data streams.

Seeded random commands at every alignment and length (4 KB crossings, 1 byte, bursts of the maximum
length and beyond); the input beats carry junk past each command's end. The whole memory image is then
compared with the expected one: every written byte, and every byte outside the written ranges untouched
(memory is pre-filled with random guard bytes). Also: one ``o_done`` per command (zero-length included),
the outstanding-burst limit and AXI burst rules (`WriteMonitor`), and SLVERR from writes past the end
setting the sticky ``o_error``.
"""

from __future__ import annotations

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, gather
from cocotbext.axi import AxiWriteBus

from hdl.config import HardwareConfig
from tb.axi.streams import StreamSink, StreamSource, pauses
from tb.axi.write_memory import CheckedAxiRamWrite, WriteMonitor
from tb.ddrio.common import reset
from tb.runner import bench_env

MEM = 1 << 16
FLOWS = [0.0, 0.3, 0.1]


def setup(dut, seed, p):
    hw = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    rng = random.Random(seed)
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    ram = CheckedAxiRamWrite(AxiWriteBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, dut.rst, size=MEM)
    if p:
        ram.aw_channel.set_pause_generator(pauses(random.Random(seed + 1), p))
        ram.w_channel.set_pause_generator(pauses(random.Random(seed + 2), p))
        ram.b_channel.set_pause_generator(pauses(random.Random(seed + 3), p))
    ram.write(0, bytes(rng.randrange(256) for _ in range(MEM)))
    mon = WriteMonitor(dut, "axi", max_outstanding=hw.axi_max_outstanding, done=dut.o_done)
    cocotb.start_soon(mon.run())
    src = StreamSource(dut, "i_cmd", dut.clk, rng=random.Random(seed + 4), p_idle=p)
    dsrc = StreamSource(dut, "i_data", dut.clk, rng=random.Random(seed + 5), p_idle=p)
    return hw, rng, ram, mon, src, dsrc


def random_commands(hw, rng, count):
    B, maxb = hw.bytes_per_beat, hw.axi_max_burst_beats
    cmds = []
    for _ in range(count):
        n = rng.choice([0, 1, 2, B - 1, B, B + 1, rng.randrange(1, 4 * B * maxb + 1),
                        3 * B * maxb + rng.randrange(-9, 9)])
        if rng.random() < 0.4:
            addr = rng.randrange(1, MEM // 4096) * 4096 + rng.randrange(-3 * B * maxb, 2 * B)
        else:
            addr = rng.randrange(MEM - n)
        addr = max(0, min(addr, MEM - n))
        cmds.append((addr, n))
    return cmds


def beats_of(hw, rng, payload: bytes):
    """Start-aligned input beats of `payload` (junk past its end), as stream payload integers."""
    B = hw.bytes_per_beat
    out = []
    nb = -(-len(payload) // B)
    for k in range(nb):
        chunk = payload[k * B:(k + 1) * B]
        chunk += bytes(rng.randrange(256) for _ in range(B - len(chunk)))
        out.append(int.from_bytes(chunk, "little") | (k == nb - 1) << hw.axi_data_bits)
    return out


async def run_commands(dut, hw, rng, ram, mon, src, dsrc, cmds, image):
    payloads = [bytes(rng.randrange(256) for _ in range(n)) for _, n in cmds]
    for (addr, n), data in zip(cmds, payloads):
        image[addr:addr + n] = data
    beats = [b for data in payloads for b in beats_of(hw, rng, data)]
    layout_shift = hw.axi_addr_bits
    dones = mon.dones
    await gather(src.send([a | n << layout_shift for a, n in cmds]), dsrc.send(beats))
    for _ in range(100_000):
        if mon.dones - dones == len(cmds) and not int(dut.o_busy.value):
            break
        await FallingEdge(dut.clk)
    for _ in range(30):
        await FallingEdge(dut.clk)
    assert mon.dones - dones == len(cmds), f"{mon.dones - dones} o_done pulses for {len(cmds)} commands"
    assert int(dut.o_busy.value) == 0


@cocotb.test(timeout_time=10, timeout_unit="ms")
async def random_writes(dut):
    seed = int(bench_env("SEED", "1"))
    p = FLOWS[int(bench_env("FLOW", "1"))]
    hw, rng, ram, mon, src, dsrc = setup(dut, seed, p)
    await reset(dut)
    B = hw.bytes_per_beat
    cmds = random_commands(hw, rng, 60) + [(4096 - 1, 1), (4096 - 2, 2), (8192 - B, 0), (8192 - 3, 2 * 4096 + 5),
                                          (3 * 4096 - B + 1, B), (5 * 4096 + 1, B - 1)]
    rng.shuffle(cmds)
    image = bytearray(ram.read(0, MEM))
    await run_commands(dut, hw, rng, ram, mon, src, dsrc, cmds, image)
    got = ram.read(0, MEM)
    bad = [i for i in range(MEM) if got[i] != image[i]]
    assert not bad, f"seed {seed}: {len(bad)} bytes differ, first at {[hex(i) for i in bad[:8]]}"
    assert int(dut.o_error.value) == 0
    dut._log.info("write DMA: %d bursts, %d beats, at most %d awaiting B", mon.aw, mon.w, mon.max_seen)


@cocotb.test(timeout_time=5, timeout_unit="ms")
async def full_rate_and_errors(dut):
    """A long aligned write with no pauses takes one W beat per cycle; then a write running past the end of
    memory gets SLVERR (``o_error`` set, its ``o_done`` still pulses) and a following write is correct."""
    hw, rng, ram, mon, src, dsrc = setup(dut, 7, 0.0)
    await reset(dut)
    B = hw.bytes_per_beat
    image = bytearray(ram.read(0, MEM))
    n = 256 * B
    await run_commands(dut, hw, rng, ram, mon, src, dsrc, [(4096, n)], image)
    w0 = mon.w
    assert ram.read(0, MEM) == image
    assert int(dut.o_error.value) == 0
    # Rate: W beats per cycle while streaming, measured on a second long write.
    sent = cocotb.start_soon(run_commands(dut, hw, rng, ram, mon, src, dsrc, [(8192, n)], image))
    while mon.w == w0:
        await FallingEdge(dut.clk)
    t1 = cocotb.utils.get_sim_time("ns")
    while mon.w < w0 + 256:
        await FallingEdge(dut.clk)
    cycles = (cocotb.utils.get_sim_time("ns") - t1) / 10
    await sent
    dut._log.info("write DMA: 256 beats in %d cycles (AxiRamWrite, no pauses)", cycles)
    assert cycles <= 256 + 2, f"256 W beats took {cycles} cycles"
    assert ram.read(0, MEM) == image
    await run_commands(dut, hw, rng, ram, mon, src, dsrc, [(MEM - 3 * B + 1, 4 * B)], bytearray(MEM + 4 * B))
    assert int(dut.o_error.value) == 1
    await run_commands(dut, hw, rng, ram, mon, src, dsrc, [(100, 3 * B + 5)], image)
    got = ram.read(0, MEM - 4 * B)
    assert got == bytes(image[:MEM - 4 * B])
