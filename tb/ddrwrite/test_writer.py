"""cocotb bench of `hdl.ddrwrite.DdrWriter` against cocotbext-axi's `AxiRamWrite` with random pauses on AW, W
and B and random stalls on the command and element streams.

Seeded random commands (both formats, every element alignment within a beat, 4 KB crossings, n = 0 and 1,
runs of thousands of elements; scattering commands with strides of 1 byte to beyond 4 KB, multiples of a beat
and not, from every lane) are written into a memory pre-filled with random guard bytes; afterwards the
WHOLE memory is compared with a NumPy image: the written bytes are ``np.uint32`` raw words (F32) or
``x.astype(np.float16)`` (F16; NaN -> the canonical 0x7E00 of `hdl.fp.F32ToF16`), or each element's low byte at
``addr + k * stride``, every other byte keeps its guard value. A bus monitor checks the AXI rules on every handshake (INCR, full-size beats, burst length
within ``axi_max_burst_beats``, awcache 0011, W never ahead of its AW, at most ``axi_max_outstanding``
bursts awaiting B) and that each ``o_done`` pulse comes after the last B of its command. Other tests:
SLVERR (writes past the RAM's end) sets the sticky ``o_error``; the sustained rate in cycles per element.
"""

from __future__ import annotations

import logging
import random

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly
from cocotbext.axi import AxiRamWrite, AxiWriteBus

from hdl.config import HardwareConfig
from hdl.ddrio import DdrFormat, writer_cmd_layout
from hdl.ddrwrite import ELEM_BYTES
from hdl.fp import QNAN16
from tb.axi.streams import StreamSource, pauses
from tb.runner import bench_env

MEM = 1 << 16
FLOWS = [0.0, 0.2, 0.5]          # pause / stall probability per cycle on every channel and stream


class BoundedAxiRamWrite(AxiRamWrite):
    """`AxiRamWrite` that answers SLVERR to a burst writing past ``size`` (the stock model wraps around)."""

    async def _write(self, address, data):
        if address + len(data) > self.size:
            raise IndexError(f"write of {len(data)} bytes at {address:#x} past the end ({self.size:#x})")
        self.write(address, data)


def f16_expected(x: np.ndarray) -> bytes:
    """binary16 bytes of float32 values as the hardware writes them: NumPy RNE, NaN -> 0x7E00."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(x), np.uint16(QNAN16), h).astype("<u2").tobytes()


def f16_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 values that exercise binary16 conversion: normal range, subnormals, overflow, ties, specials."""
    kind = rng.integers(0, 6, n)
    mag = np.where(kind == 0, rng.uniform(-70000, 70000, n),               # including overflow
          np.where(kind == 1, rng.uniform(-1, 1, n) * 2.0 ** -14,           # binary16 subnormal range
          np.where(kind == 2, rng.uniform(-8, 8, n), 0.0)))
    x = mag.astype(np.float32)
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)  # any pattern
    x = np.where(kind == 3, bits, x)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, -65519.99, 2.0 ** -24,
                        2.0 ** -25, -(2.0 ** -25) * 1.0000001, 3 * 2.0 ** -26, 1.0 + 2.0 ** -11,
                        1.0 + 3 * 2.0 ** -11, 1e-45, 6.1035156e-05], np.float32)
    x = np.where(kind == 4, special[rng.integers(0, len(special), n)], x)
    # kind 5: ties exactly halfway between binary16 neighbours (RNE)
    h = rng.integers(0, 0x7C00, n).astype(np.uint16).view(np.float16).astype(np.float32)
    tie = (h.view(np.uint32) + np.uint32(1 << 12)).view(np.float32)
    return np.where(kind == 5, tie, x).astype(np.float32)


class Bench:
    def __init__(self, dut, seed: int, p: float):
        self.dut = dut
        self.hw = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
        self.ram = BoundedAxiRamWrite(AxiWriteBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, dut.rst,
                                      size=MEM)
        self.ram.log.setLevel(logging.WARNING)
        if p:
            self.ram.aw_channel.set_pause_generator(pauses(random.Random(seed + 1), p))
            self.ram.w_channel.set_pause_generator(pauses(random.Random(seed + 2), p))
            self.ram.b_channel.set_pause_generator(pauses(random.Random(seed + 3), p))
        self.image = bytearray(self.rng.randrange(256) for _ in range(MEM))
        self.ram.write(0, bytes(self.image))
        self.cmd = StreamSource(dut, "i_cmd", dut.clk, rng=random.Random(seed + 4), p_idle=p)
        self.elem = StreamSource(dut, "i_elem", dut.clk, rng=random.Random(seed + 5), p_idle=p)
        self.layout = writer_cmd_layout(self.hw)
        self.dones = 0
        self.aw = self.w_bursts = self.b = 0
        self.elems = 0
        self.max_outstanding = 0
        self.done_cycles: list[int] = []
        self.elem_cycles: list[int] = []
        self.cycle = 0

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(3):
            await FallingEdge(self.dut.clk)
        self.dut.rst.value = 0
        cocotb.start_soon(self.monitor())

    async def monitor(self):
        d, hw = self.dut, self.hw
        lb = (hw.bytes_per_beat - 1).bit_length()
        while True:
            # Mid-cycle, after the stream drivers (falling edge) and the AXI model (rising edge) have
            # driven: these are the values the next rising edge samples.
            await FallingEdge(d.clk)
            await ReadOnly()
            self.cycle += 1
            aw = int(d.axi__awvalid.value) and int(d.axi__awready.value)
            w = int(d.axi__wvalid.value) and int(d.axi__wready.value)
            b = int(d.axi__bvalid.value) and int(d.axi__bready.value)
            if aw:
                assert int(d.axi__awburst.value) == 1, "awburst is not INCR"
                assert int(d.axi__awsize.value) == lb, "awsize is not the full beat"
                assert int(d.axi__awlen.value) + 1 <= hw.axi_max_burst_beats, "burst longer than axi_max_burst_beats"
                assert int(d.axi__awcache.value) == 0b0011, "awcache is not 0011"
                assert int(d.axi__awid.value) == 0
            if w:
                # A burst's W beats come after its AW handshake (strictly earlier cycle).
                assert self.w_bursts < self.aw, f"W beat of burst {self.w_bursts} before its AW"
                self.w_bursts += int(d.axi__wlast.value)
            self.aw += aw
            self.b += b
            assert self.b <= self.w_bursts, "B before its burst's last W beat"
            self.max_outstanding = max(self.max_outstanding, self.aw - self.b)
            assert self.aw - self.b <= hw.axi_max_outstanding, f"{self.aw - self.b} bursts awaiting B"
            if int(d.i_elem__valid.value) and int(d.i_elem__ready.value):
                self.elems += 1
                self.elem_cycles.append(self.cycle)
            if int(d.o_done.value):
                assert self.aw == self.b, f"o_done with {self.aw - self.b} B responses missing"
                self.dones += 1
                self.done_cycles.append(self.cycle)

    def command(self, addr: int, n: int, fmt: int, stride: int = 0):
        """Elements of a random command (as uint32 words) and the memory image update. The address bits
        below the element size are ignored by the hardware, so the image is written at the aligned address;
        a scattering command writes each element's low byte at ``addr + k * stride``."""
        if stride:
            x = self.np_rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
            for k in range(n):
                self.image[addr + k * stride] = int(x[k]) & 0xFF
            return [int(v) for v in x]
        addr &= ~(ELEM_BYTES[DdrFormat(fmt)] - 1)
        if fmt == DdrFormat.F32:
            x = self.np_rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
            data = x.astype("<u4").tobytes()
        else:
            f = f16_values(self.np_rng, n)
            x = f.view(np.uint32)
            data = f16_expected(f)
        end = min(addr + len(data), MEM)          # the RAM writes the in-range beats of an SLVERR burst
        self.image[addr:end] = data[:end - addr]
        return [int(v) for v in x]

    async def run(self, cmds, timeout: int = 400_000):
        """Send `cmds` (dicts with addr, n, fmt) and their elements; wait for every ``o_done``."""
        words = []
        for c in cmds:
            words += self.command(**c)
        start = self.dones
        cocotb.start_soon(self.elem.send(words))
        await self.cmd.send([self.layout.const(c).as_bits() for c in cmds])
        for _ in range(timeout):
            if self.dones - start >= len(cmds):
                break
            await FallingEdge(self.dut.clk)
        else:
            raise AssertionError(f"timeout: {self.dones - start} of {len(cmds)} commands done")
        for _ in range(30):                      # nothing more happens
            await FallingEdge(self.dut.clk)
        assert self.dones - start == len(cmds), "extra o_done pulses"
        assert int(self.dut.o_busy.value) == 0

    def check_memory(self, what: str):
        got = np.frombuffer(self.ram.read(0, MEM), np.uint8)
        want = np.frombuffer(bytes(self.image), np.uint8)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"{what}: {bad.size} bytes differ, first at {bad[0]:#x} "
                               f"(got {got[bad[0]]:#04x}, want {want[bad[0]]:#04x})") if bad.size else ""


def random_commands(hw, rng: random.Random, count: int):
    B = hw.bytes_per_beat
    cmds = []
    for _ in range(count):
        fmt = rng.choice([DdrFormat.F32, DdrFormat.F16])
        size = ELEM_BYTES[fmt]
        n = rng.choice([1, 1, 2, 3, 5, rng.randrange(1, 4 * B), rng.randrange(1, 300), rng.randrange(500, 3000)])
        if rng.random() < 0.4:                   # straddling a 4 KB boundary at any lane
            addr = rng.randrange(1, MEM // 4096) * 4096 - rng.randrange(0, min(n * size, 3 * B * 16) + 1)
        else:
            addr = rng.randrange(MEM - n * size)
        addr = max(0, min(addr, MEM - n * size)) & ~(size - 1)
        cmds.append(dict(addr=addr, n=n, fmt=int(fmt)))
    # every element alignment within a beat, for both formats, n = 1 and a short run
    for fmt in (DdrFormat.F32, DdrFormat.F16):
        size = ELEM_BYTES[fmt]
        for lane in range(0, B, size):
            cmds.append(dict(addr=rng.randrange(1, MEM // B - 64) * B + lane, n=1, fmt=int(fmt)))
            cmds.append(dict(addr=rng.randrange(1, MEM // B - 64) * B + lane, n=rng.randrange(2, 3 * B), fmt=int(fmt)))
    # address bits below the element size are ignored
    cmds += [dict(addr=rng.randrange(MEM // 2) * 2 + 1, n=rng.randrange(1, 20), fmt=int(fmt)) for fmt in (0, 1)]
    cmds += [dict(addr=rng.randrange(MEM // 4) * 4 + 2, n=rng.randrange(1, 20), fmt=0)]
    cmds += [dict(addr=4096 - 4, n=2, fmt=0), dict(addr=64, n=0, fmt=0), dict(addr=2 * 4096 - 2, n=2, fmt=1),
             dict(addr=0, n=1, fmt=1), dict(addr=MEM - 2, n=1, fmt=1), dict(addr=100, n=0, fmt=1)]
    cmds += scatter_commands(hw, rng)
    rng.shuffle(cmds)
    return cmds


def scatter_commands(hw, rng: random.Random):
    """Commands with a stride: from every lane, strides of one byte, a beat, a beat and one, an odd count, a
    ring of 515 rows (E4B's sliding V rows) and beyond 4 KB; n = 0, 1 and runs of hundreds."""
    B = hw.bytes_per_beat
    cmds = []
    for stride in (1, B, B + 1, 2 * B - 1, 7, 515, 4099, rng.randrange(2, 600)):
        for n in (1, rng.randrange(2, 40), rng.choice([0, rng.randrange(100, 300)])):
            span = max(n - 1, 0) * stride + 1
            if span > MEM:
                continue
            cmds.append(dict(addr=rng.randrange(MEM - span + 1), n=n, fmt=rng.randrange(2), stride=stride))
    for lane in range(B):
        cmds.append(dict(addr=rng.randrange(1, MEM // B - 300) * B + lane, n=rng.randrange(1, 20), fmt=0,
                         stride=rng.choice([B, 3 * B + 5, 256])))
    return cmds


@cocotb.test(timeout_time=20, timeout_unit="ms")
async def random_commands_bitexact(dut):
    seed = int(bench_env("SEED", "1"))
    p = FLOWS[int(bench_env("FLOW", "1"))]
    tb = Bench(dut, seed, p)
    await tb.reset()
    cmds = random_commands(tb.hw, tb.rng, int(bench_env("COMMANDS", "30")))
    await tb.run(cmds)
    tb.check_memory(f"seed {seed} flow {p}")
    assert int(dut.o_error.value) == 0
    dut._log.info("%d commands, %d elements, %d bursts, at most %d awaiting B, %d cycles",
                  len(cmds), tb.elems, tb.aw, tb.max_outstanding, tb.cycle)
    assert tb.elems == sum(c["n"] for c in cmds)


@cocotb.test(timeout_time=5, timeout_unit="ms")
async def error_response(dut):
    """A command whose bytes run past the RAM's end gets SLVERR on its last bursts: ``o_error`` rises and
    stays set; the command still completes (``o_done``), its in-range bytes are written, later commands work."""
    tb = Bench(dut, 7, 0.2)
    await tb.reset()
    B = tb.hw.bytes_per_beat
    await tb.run([dict(addr=40, n=17, fmt=1)])
    assert int(dut.o_error.value) == 0
    tb.check_memory("before the error")
    await tb.run([dict(addr=MEM - 2 * B, n=B, fmt=0)])     # 4 * B bytes, half past the end
    assert int(dut.o_error.value) == 1, "o_error not set by SLVERR"
    await tb.run([dict(addr=1000, n=9, fmt=0), dict(addr=3, n=0, fmt=0)])
    tb.check_memory("after the error")
    assert int(dut.o_error.value) == 1, "o_error is not sticky"


@cocotb.test(timeout_time=5, timeout_unit="ms")
async def outstanding_limit(dut):
    """With B responses held back for 2000 cycles behind a slave that would accept any number of bursts, the
    writer stops issuing addresses at exactly ``axi_max_outstanding`` bursts awaiting B; once B flows again
    the command completes and memory is right."""
    tb = Bench(dut, 11, 0.0)
    for ch in (tb.ram.aw_channel, tb.ram.w_channel, tb.ram.b_channel):
        ch.queue_occupancy_limit = 1024
    hold = [True] * 2000

    def b_pause():
        while True:
            yield hold.pop() if hold else False

    tb.ram.b_channel.set_pause_generator(b_pause())
    await tb.reset()
    hw = tb.hw
    n = (hw.axi_max_outstanding + 3) * hw.axi_max_burst_beats * hw.bytes_per_beat // 4
    task = cocotb.start_soon(tb.run([dict(addr=4096, n=n, fmt=0)]))
    for _ in range(1500):
        await FallingEdge(dut.clk)
    assert tb.b == 0
    assert tb.aw == hw.axi_max_outstanding, f"{tb.aw} bursts issued while no B came back"
    assert int(dut.axi__awvalid.value) == 0
    await task
    assert tb.max_outstanding == hw.axi_max_outstanding
    tb.check_memory("outstanding limit")


@cocotb.test(timeout_time=5, timeout_unit="ms")
async def rate(dut):
    """Sustained rate with no pause and no stall: cycles between the first and the n-th element accepted on
    ``i_elem``, for both formats, beat-aligned and not; and the command's total time to ``o_done``."""
    tb = Bench(dut, 9, 0.0)
    await tb.reset()
    n = 2000
    B = tb.hw.bytes_per_beat
    results = {}
    for fmt in (DdrFormat.F32, DdrFormat.F16):
        for addr in (4096 * 2, 4096 * 3 + B - ELEM_BYTES[fmt]):
            tb.elem_cycles.clear()
            t0 = tb.cycle
            await tb.run([dict(addr=addr, n=n, fmt=int(fmt))])
            span = tb.elem_cycles[-1] - tb.elem_cycles[0] + 1
            results[(fmt.name, addr % B)] = (span, tb.done_cycles[-1] - t0)
    tb.check_memory("rate")
    dut._log.info("DdrWriter on %s: (fmt, lane) -> (cycles for %d elements on i_elem, cycles from "
                  "sending the command to o_done): %s", tb.hw.name, n, results)
    for key, (span, _) in results.items():
        assert span <= n + 2, f"{key}: {span} cycles for {n} elements"
    # scattered bytes: one AW every other cycle, so 2 cycles a byte while the bursts awaiting B stay below
    # the limit (the RAM model answers within a few cycles)
    ns = 120
    tb.elem_cycles.clear()
    await tb.run([dict(addr=1000 + 3, n=ns, fmt=0, stride=515)])
    span = tb.elem_cycles[-1] - tb.elem_cycles[0] + 1
    tb.check_memory("scatter rate")
    dut._log.info("DdrWriter on %s: %d scattered bytes take %d cycles on i_elem", tb.hw.name, ns, span)
    assert span <= 2 * ns + 8, f"{span} cycles for {ns} scattered bytes"
