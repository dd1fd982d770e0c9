"""The full-chip bench's environment: clock, reset, DDR behind every AXI master, the CSR master, and the
blocking device through which the host code (`firmware.runtime.CsrBackend`) drives the simulated NPU.

DDR is one `mmap` shared by a cocotbext-axi RAM on every ``m_axi{p}`` port (`AxiRamRead`/`AxiRamWrite` take
the memory object as ``mem=``, so the ports see one memory with no adapter). Every AXI channel of every
port (AW, W, B, AR, R) and every AXI-Lite channel gets its own seeded random pause generator. The RAMs
check that each access lies inside the DDR window the host may use; an access outside it is recorded in
`NpuBench.faults` and answered SLVERR (so a stray address cannot silently alias the image).

The host code runs in a thread (`cocotb.task.bridge`); `SimDevice` turns its blocking calls into coroutines
on the simulator (`cocotb.task.resume`). DDR reads and writes of the host are back-door accesses to the
memory (what the PS does through its own DDR port, outside the NPU's AXI traffic); CSR accesses are real
AXI-Lite transactions.
"""

from __future__ import annotations

import logging
import mmap
import random

import cocotb
from cocotb.clock import Clock
from cocotb.task import resume
from cocotb.triggers import ClockCycles, RisingEdge, with_timeout
from cocotbext.axi import AxiBus, AxiLiteBus, AxiLiteMaster, AxiResp
from cocotbext.axi.axi_ram import AxiRamRead, AxiRamWrite

from hdl.config import HardwareConfig

__all__ = ["NpuBench", "SimDevice", "pauses", "CLOCK_NS"]

CLOCK_NS = 10
GUARD = 0xA5          # the byte every DDR location outside the image holds before a run


def pauses(rng: random.Random, p: float):
    """A cocotbext-axi pause generator: pause a cycle with probability `p`."""
    while True:
        yield int(rng.random() < p)


class _WindowCheck:
    def _check(self, kind, address, length):
        lo, hi = self.window
        if not (lo <= address and address + length <= hi):
            self.faults.append((kind, address, length))
            raise IndexError(f"{kind} of {length} bytes at {address:#x} is outside the DDR window "
                             f"[{lo:#x}, {hi:#x})")


class _RamRead(_WindowCheck, AxiRamRead):
    def __init__(self, bus, clock, reset, *, mem, window, faults):
        self.window, self.faults = window, faults
        super().__init__(bus, clock, reset, mem=mem)

    async def _read(self, address, length):
        self._check("read", address, length)
        return self.read(address, length)


class _RamWrite(_WindowCheck, AxiRamWrite):
    def __init__(self, bus, clock, reset, *, mem, window, faults):
        self.window, self.faults = window, faults
        super().__init__(bus, clock, reset, mem=mem)

    async def _write(self, address, data):
        self._check("write", address, length=len(data))
        self.write(address, data)


class NpuBench:
    """Clock, reset, DDR and CSR master around the `hdl.npu.Npu` top.

    Parameters
    ----------
    dut : the cocotb handle of the NPU top.
    hw : the `HardwareConfig` the NPU was built for.
    seed : seeds the pause generators (and nothing else).
    ddr_base, ddr_size : the DDR window the host may use (the image goes at `ddr_base`).
    pause : probability of a pause cycle on each AXI and AXI-Lite channel.
    timeout_cycles : the longest a host wait on the interrupt may take before the test fails.
    """

    def __init__(self, dut, hw: HardwareConfig, *, seed: int, ddr_base: int = 0x0100_0000,
                 ddr_size: int = 64 << 20, pause: float = 0.2, timeout_cycles: int = 20_000_000):
        if ddr_base % 4096:
            raise ValueError(f"ddr_base must be 4 KiB aligned, not {ddr_base:#x}")
        if ddr_base + ddr_size > 1 << hw.axi_addr_bits:
            raise ValueError(f"the DDR window [{ddr_base:#x}, {ddr_base + ddr_size:#x}) exceeds the "
                             f"{hw.axi_addr_bits}-bit AXI address space")
        self.dut, self.hw = dut, hw
        self.ddr_base, self.ddr_size = ddr_base, ddr_size
        self.timeout_cycles = timeout_cycles
        self.mem = mmap.mmap(-1, ddr_base + ddr_size)
        self.mem[ddr_base:ddr_base + ddr_size] = bytes([GUARD]) * ddr_size
        self.faults: list[tuple[str, int, int]] = []
        rng = random.Random(seed)
        window = (ddr_base, ddr_base + ddr_size)
        self.ports = []
        for p in range(hw.axi_ports):
            bus = AxiBus.from_prefix(dut, f"m_axi{p}", bus_separator="__")
            rd = _RamRead(bus.read, dut.clk, dut.rst, mem=self.mem, window=window, faults=self.faults)
            wr = _RamWrite(bus.write, dut.clk, dut.rst, mem=self.mem, window=window, faults=self.faults)
            for ch in (wr.aw_channel, wr.w_channel, wr.b_channel, rd.ar_channel, rd.r_channel):
                ch.set_pause_generator(pauses(random.Random(rng.randrange(1 << 32)), pause))
            self.ports.append((rd, wr))
        self.axil = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "s_axil", bus_separator="__"), dut.clk, dut.rst)
        for ch in (self.axil.write_if.aw_channel, self.axil.write_if.w_channel, self.axil.write_if.b_channel,
                   self.axil.read_if.ar_channel, self.axil.read_if.r_channel):
            ch.set_pause_generator(pauses(random.Random(rng.randrange(1 << 32)), pause))
        # cocotbext-axi logs one INFO line per burst: keep warnings only
        for model in [m for port in self.ports for m in port] + [self.axil.write_if, self.axil.read_if]:
            model.log.setLevel(logging.WARNING)

    async def start(self) -> None:
        """Start the clock; hold reset for a few cycles."""
        cocotb.start_soon(Clock(self.dut.clk, CLOCK_NS, unit="ns").start())
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 4)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)

    # --- coroutines the host thread calls ------------------------------------------------------------------

    async def csr_read(self, offset: int) -> int:
        resp = await self.axil.read(offset, 4)
        if resp.resp != AxiResp.OKAY:
            raise AssertionError(f"CSR read at {offset:#x} answered {resp.resp!r}")
        return int.from_bytes(resp.data, "little")

    async def csr_write(self, offset: int, value: int) -> None:
        resp = await self.axil.write(offset, int(value).to_bytes(4, "little"))
        if resp.resp != AxiResp.OKAY:
            raise AssertionError(f"CSR write of {value:#x} at {offset:#x} answered {resp.resp!r}")

    async def wait_interrupt(self) -> None:
        if not int(self.dut.o_irq.value):
            await with_timeout(RisingEdge(self.dut.o_irq), self.timeout_cycles * CLOCK_NS, "ns")

    async def cycles(self, n: int) -> None:
        await ClockCycles(self.dut.clk, n)

    # --- DDR back door -------------------------------------------------------------------------------------

    def mem_read(self, addr: int, nbytes: int) -> bytes:
        self._check(addr, nbytes)
        return bytes(self.mem[addr:addr + nbytes])

    def mem_write(self, addr: int, data: bytes) -> None:
        self._check(addr, len(data))
        self.mem[addr:addr + len(data)] = bytes(data)

    def _check(self, addr, n):
        if not (self.ddr_base <= addr and addr + n <= self.ddr_base + self.ddr_size):
            raise ValueError(f"host DDR access [{addr:#x}, {addr + n:#x}) is outside the window "
                             f"[{self.ddr_base:#x}, {self.ddr_base + self.ddr_size:#x})")

    def window(self) -> bytes:
        """A copy of the whole DDR window."""
        return bytes(self.mem[self.ddr_base:self.ddr_base + self.ddr_size])


class SimDevice:
    """`firmware.runtime.NpuDevice` over `NpuBench`, for host code running in a `cocotb.task.bridge` thread."""

    def __init__(self, bench: NpuBench):
        self.bench = bench
        self.hw = bench.hw
        self.ddr_base, self.ddr_size = bench.ddr_base, bench.ddr_size
        self._csr_read = resume(bench.csr_read)
        self._csr_write = resume(bench.csr_write)
        self._wait_interrupt = resume(bench.wait_interrupt)
        self._cycles = resume(bench.cycles)

    def csr_read(self, offset: int) -> int:
        return self._csr_read(offset)

    def csr_write(self, offset: int, value: int) -> None:
        self._csr_write(offset, value)

    def wait_interrupt(self) -> None:
        self._wait_interrupt()

    def cycles(self, n: int) -> None:
        """Let `n` clock cycles pass."""
        self._cycles(n)

    def mem_read(self, addr: int, nbytes: int) -> bytes:
        return self.bench.mem_read(addr, nbytes)

    def mem_write(self, addr: int, data: bytes) -> None:
        self.bench.mem_write(addr, data)
