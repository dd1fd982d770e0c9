"""cocotb bench of `hdl.ddrio.DdrWriter` against cocotbext-axi's `AxiRamWrite` (random pauses on AW, W, B) with
random stalls on the command and element streams.

Seeded random commands in both formats at every byte alignment, 4 KB crossings, n = 1 and odd counts;
elements are random binary32 patterns (NaN, inf, subnormal, values that round to binary16 subnormals and
overflow included). The whole memory image is compared with NumPy's (binary32 bytes, or
``np.float32(x).astype(np.float16)`` bytes with NaN as 0x7E00): every written byte, and every guard byte
untouched. Also one ``o_done`` per command (n = 0 included), SLVERR -> ``o_error``, and the rate.
"""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, gather
from cocotbext.axi import AxiWriteBus

from hdl.config import HardwareConfig
from hdl.ddrio import DdrFormat, writer_cmd_layout
from hdl.fp import QNAN16
from tb.axi.streams import StreamSource, pauses
from tb.axi.write_memory import CheckedAxiRamWrite, WriteMonitor
from tb.ddrio.common import pack, reset
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
    esrc = StreamSource(dut, "i_elem", dut.clk, rng=random.Random(seed + 5), p_idle=p)
    return hw, rng, ram, mon, src, esrc


def elements(rng: random.Random, n: int) -> np.ndarray:
    g = np.random.default_rng(rng.randrange(1 << 30))
    kind = g.integers(0, 3, n)
    bits = g.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    vals = (g.uniform(-1, 1, n) * 2.0 ** g.integers(-28, 18, n)).astype(np.float32).view(np.uint32)
    edges = np.array([0x7FC00000, 0xFF800000, 0x00000001, 0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001,
                      0x80000000, 0x387FE000], np.uint32)[g.integers(0, 9, n)]
    return np.where(kind == 0, bits, np.where(kind == 1, vals, edges)).astype(np.uint32)


def stored(x: np.ndarray, fmt: int) -> bytes:
    if fmt == DdrFormat.F32:
        return x.astype("<u4").tobytes()
    f = x.view(np.float32)
    with np.errstate(all="ignore"):
        h = f.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(f), np.uint16(QNAN16), h).astype("<u2").tobytes()


def random_commands(hw, rng, count):
    cmds = []
    for _ in range(count):
        fmt = rng.choice([DdrFormat.F32, DdrFormat.F16])
        n = rng.choice([0, 1, 2, 3, 5, rng.randrange(1, 40), rng.randrange(1, 300), rng.randrange(500, 1500)])
        size = (4 if fmt == DdrFormat.F32 else 2) * n
        if rng.random() < 0.4:
            addr = rng.randrange(1, MEM // 4096) * 4096 - rng.randrange(0, min(size, 600) + 1)
        else:
            addr = rng.randrange(MEM - size)
        addr = max(0, min(addr, MEM - size))
        cmds.append(dict(addr=addr, n=n, fmt=int(fmt)))
    return cmds


async def run_commands(dut, hw, rng, mon, src, esrc, cmds, image, timeout=200_000):
    elems = [elements(rng, c["n"]) for c in cmds]
    for c, x in zip(cmds, elems):
        data = stored(x, c["fmt"])
        image[c["addr"]:c["addr"] + len(data)] = data
    layout = writer_cmd_layout(hw)
    dones = mon.dones
    await gather(src.send([pack(layout, **c) for c in cmds]), esrc.send([int(v) for x in elems for v in x]))
    for _ in range(timeout):
        if mon.dones - dones == len(cmds) and not int(dut.o_busy.value):
            break
        await FallingEdge(dut.clk)
    for _ in range(30):
        await FallingEdge(dut.clk)
    assert mon.dones - dones == len(cmds), f"{mon.dones - dones} o_done pulses for {len(cmds)} commands"
    assert int(dut.o_busy.value) == 0


def compare(got: bytes, want: bytes, what: str):
    bad = [i for i in range(len(want)) if got[i] != want[i]]
    assert not bad, f"{what}: {len(bad)} bytes differ, first at {[hex(i) for i in bad[:8]]}"


@cocotb.test(timeout_time=10, timeout_unit="ms")
async def random_writes(dut):
    seed = int(bench_env("SEED", "1"))
    p = FLOWS[int(bench_env("FLOW", "1"))]
    hw, rng, ram, mon, src, esrc = setup(dut, seed, p)
    await reset(dut)
    cmds = random_commands(hw, rng, 40) + [dict(addr=4096 - 2, n=1, fmt=1), dict(addr=4096 - 1, n=1, fmt=0),
                                          dict(addr=2 * 4096 - 5, n=3, fmt=1), dict(addr=8, n=0, fmt=1)]
    rng.shuffle(cmds)
    image = bytearray(ram.read(0, MEM))
    await run_commands(dut, hw, rng, mon, src, esrc, cmds, image)
    compare(ram.read(0, MEM), image, f"seed {seed}")
    assert int(dut.o_error.value) == 0
    dut._log.info("DdrWriter: %d commands, %d bursts, %d beats, at most %d awaiting B",
                  len(cmds), mon.aw, mon.w, mon.max_seen)


@cocotb.test(timeout_time=5, timeout_unit="ms")
async def rate_and_errors(dut):
    """No pauses: 2000 elements of each format are taken in about 2000 cycles. Then a write running past
    the end of memory sets ``o_error`` (its ``o_done`` still pulses) and a following write is correct."""
    hw, rng, ram, mon, src, esrc = setup(dut, 9, 0.0)
    await reset(dut)
    image = bytearray(ram.read(0, MEM))
    for c in [dict(addr=4096, n=2000, fmt=0), dict(addr=20001, n=2000, fmt=1)]:
        t0 = cocotb.utils.get_sim_time("ns")
        await run_commands(dut, hw, rng, mon, src, esrc, [c], image)
        cycles = (cocotb.utils.get_sim_time("ns") - t0) / 10
        dut._log.info("DdrWriter: %s took %d cycles to done", c, cycles)
        assert cycles <= 2000 + 80, f"{c}: {cycles} cycles"
    compare(ram.read(0, MEM), image, "rate")
    await run_commands(dut, hw, rng, mon, src, esrc, [dict(addr=MEM - 10, n=5, fmt=0)], bytearray(MEM + 64))
    assert int(dut.o_error.value) == 1
    await run_commands(dut, hw, rng, mon, src, esrc, [dict(addr=333, n=77, fmt=1)], image)
    compare(ram.read(0, MEM - 64), image[:MEM - 64], "after the error")
