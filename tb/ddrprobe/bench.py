"""The DDR probe's bench environment.

Every ``m_axi<p>`` read port has its own `tb.axi.memory.LatencyAxiReadRam` (a read latency with jitter,
random AR and R pauses, the AXI rules checked, every burst recorded; beats past its end answer SLVERR);
the write channels must stay idle. The CSRs are reached by cocotbext-axi's `AxiMaster` on ``s_axi`` (the
HPM0 side, through the probe's AXI4 -> CSR bridge) with random pauses on its five channels, at the KV260's
CSR window address (the bridge decodes only the low 12 bits). A monitor records, per port, the cycle of
every AR handshake and of every burst's first R beat (the read latencies the probe must report), the
cycles of the START pulses and of the rising interrupt.

`SimDevice` is the host tool's device (`firmware.ddrprobe.ProbeDevice`) over the bench, for host code in a
`cocotb.task.bridge` thread; its interrupt timeout counts fabric time (clock cycles at ``hw.clock_hz``).
"""

from __future__ import annotations

import logging
import random
from collections import deque

import cocotb
from cocotb.clock import Clock
from cocotb.task import resume
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge, SimTimeoutError, with_timeout
from cocotbext.axi import AxiBus, AxiMaster, AxiReadBus, AxiResp

from hdl.config import HardwareConfig
from hdl.memory_map import memory_map
from tb.axi.memory import LatencyAxiReadRam

__all__ = ["ProbeBench", "SimDevice", "pauses", "CLOCK_NS", "CSR_BASE"]

CLOCK_NS = 10
CSR_BASE = memory_map("kv260").csr_base


def pauses(rng: random.Random, p: float):
    while True:
        yield int(rng.random() < p)


class ProbeBench:
    """Clock, reset, memories, CSR master and monitor around a `DdrProbe` top.

    Parameters
    ----------
    dut : the cocotb handle of the probe.
    hw : the HardwareConfig it was built for.
    seed : seeds the pauses and the latency jitter.
    mem_size : bytes of every port's memory (reads past it answer SLVERR).
    latency, jitter : read latency of the memories, cycles (+ uniform 0..jitter).
    pause : probability of a pause cycle on every AXI channel (CSR and memory ports).
    """

    def __init__(self, dut, hw: HardwareConfig, *, seed: int, mem_size: int = 1 << 20, latency: int = 20,
                 jitter: int = 8, pause: float = 0.2):
        self.dut, self.hw = dut, hw
        rng = random.Random(seed)

        def gen():
            return pauses(random.Random(rng.randrange(1 << 32)), pause) if pause else None

        self.master = AxiMaster(AxiBus.from_prefix(dut, "s_axi", bus_separator="__"), dut.clk, dut.rst)
        for ch in (self.master.write_if.aw_channel, self.master.write_if.w_channel, self.master.write_if.b_channel,
                   self.master.read_if.ar_channel, self.master.read_if.r_channel):
            ch.set_pause_generator(gen())
        self.master.write_if.log.setLevel(logging.WARNING)
        self.master.read_if.log.setLevel(logging.WARNING)
        self.rams = [LatencyAxiReadRam(AxiReadBus.from_prefix(dut, f"m_axi{p}", bus_separator="__"), dut.clk,
                                       size=mem_size, latency=latency, jitter=jitter,
                                       rng=random.Random(rng.randrange(1 << 32)), ar_pause=gen(), r_pause=gen())
                     for p in range(hw.axi_ports)]
        for p in range(hw.axi_ports):
            for name in ("awready", "wready", "bvalid"):
                getattr(dut, f"m_axi{p}__{name}").value = 0
        self.cycle = 0
        self.ar_cycles = [[] for _ in range(hw.axi_ports)]
        self.latencies = [[] for _ in range(hw.axi_ports)]
        self.start_cycles: list[int] = []
        self.irq_cycles: list[int] = []
        self.errors: list[str] = []

    async def start(self) -> None:
        cocotb.start_soon(Clock(self.dut.clk, CLOCK_NS, unit="ns").start())
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 4)
        self.dut.rst.value = 0
        cocotb.start_soon(self._monitor())
        await RisingEdge(self.dut.clk)

    async def _monitor(self):
        dut, n = self.dut, self.hw.axi_ports
        sig = [{k: getattr(dut, f"m_axi{p}__{k}") for k in ("arvalid", "arready", "rvalid", "rready", "rlast",
                                                              "awvalid", "wvalid")} for p in range(n)]
        ctrl, irq = dut.csr.o_ctrl, dut.o_irq
        pending = [deque() for _ in range(n)]
        first = [True] * n
        irq_was = 0
        while True:
            await RisingEdge(dut.clk)
            await ReadOnly()
            self.cycle += 1
            for p, s in enumerate(sig):
                if s["arvalid"].value and s["arready"].value:
                    pending[p].append(self.cycle)
                    self.ar_cycles[p].append(self.cycle)
                if s["rvalid"].value and s["rready"].value:
                    if first[p]:
                        if not pending[p]:
                            self.errors.append(f"port {p}: an R beat without a burst")
                        else:
                            self.latencies[p].append(self.cycle - pending[p].popleft())
                    first[p] = bool(s["rlast"].value)
                if s["awvalid"].value or s["wvalid"].value:
                    self.errors.append(f"port {p}: a write channel is not idle")
            if int(ctrl.value) & 1:
                self.start_cycles.append(self.cycle)
            v = int(irq.value)
            if v and not irq_was:
                self.irq_cycles.append(self.cycle)
            irq_was = v

    # --- CSR access, as the host's loads and stores: 32-bit narrow transfers on the 128-bit port ----------

    async def csr_read(self, offset: int) -> int:
        resp = await self.master.read(CSR_BASE + offset, 4, size=2)
        if resp.resp != AxiResp.OKAY:
            raise AssertionError(f"CSR read at {offset:#x} answered {resp.resp!r}")
        return int.from_bytes(resp.data, "little")

    async def csr_write(self, offset: int, value: int) -> None:
        resp = await self.master.write(CSR_BASE + offset, int(value).to_bytes(4, "little"), size=2)
        if resp.resp != AxiResp.OKAY:
            raise AssertionError(f"CSR write of {value:#x} at {offset:#x} answered {resp.resp!r}")

    async def wait_interrupt(self, timeout_cycles: int = 2_000_000) -> None:
        if not int(self.dut.o_irq.value):
            await with_timeout(RisingEdge(self.dut.o_irq), timeout_cycles * CLOCK_NS, "ns")

    def reset_records(self) -> None:
        for ram in self.rams:
            ram.bursts.clear()
            ram.max_in_flight = 0
        for lst in self.ar_cycles + self.latencies:
            lst.clear()
        self.start_cycles.clear()
        self.irq_cycles.clear()


class SimDevice:
    """`firmware.ddrprobe.ProbeDevice` over `ProbeBench`, for host code running in a `cocotb.task.bridge` thread."""

    def __init__(self, bench: ProbeBench):
        self.hw = bench.hw
        self._bench = bench
        self.csr_read = resume(bench.csr_read)
        self.csr_write = resume(bench.csr_write)
        self._wait = resume(self._wait_interrupt)

    async def _wait_interrupt(self, timeout_s: float | None) -> None:
        if timeout_s is None:
            await self._bench.wait_interrupt()
            return
        cycles = max(1, round(timeout_s * self.hw.clock_hz))
        try:
            await self._bench.wait_interrupt(cycles)
        except SimTimeoutError:
            raise TimeoutError(f"no interrupt from the simulated probe within {cycles} cycles") from None

    def wait_interrupt(self, timeout_s: float | None = None) -> None:
        """Block until the probe's interrupt line is high; TimeoutError after `timeout_s` seconds of fabric
        time."""
        self._wait(timeout_s)
