"""An AXI4 read slave with a configurable read latency, built from cocotbext-axi's channel models.

cocotbext-axi's `AxiRamRead` serves one burst at a time with a fixed, short latency. DDR behind the Zynq
HP ports has a long latency and many bursts in flight, and that is what the DMA's outstanding bursts must
hide, so this model accepts addresses at full rate, holds each burst for ``latency`` (+ random jitter)
cycles, then returns its beats back to back (in order; all IDs are echoed). It also checks the AXI rules the
DMA must keep (INCR, full-width beats, no 4 KB crossing, at most `max_outstanding` bursts in flight) and
records every burst, so benches can check which bytes were read. Reads beyond `size` return SLVERR.
"""

from __future__ import annotations

import random
from collections import deque

import cocotb
from cocotb.triggers import RisingEdge
from cocotbext.axi.axi_channels import AxiARSink, AxiRSource
from cocotbext.axi.constants import AxiResp
from cocotbext.axi.memory import Memory


class LatencyAxiReadRam(Memory):
    def __init__(self, bus, clock, *, size: int, latency: int = 0, jitter: int = 0, max_outstanding: int | None = None,
                 rng: random.Random | None = None, ar_pause=None, r_pause=None):
        super().__init__(size)
        self.clock = clock
        self.latency, self.jitter = latency, jitter
        self.max_outstanding = max_outstanding
        self.rng = rng or random.Random(0)
        self.ar = AxiARSink(bus.ar, clock)
        self.r = AxiRSource(bus.r, clock)
        self.r.queue_occupancy_limit = 2
        self.byte_lanes = len(self.r.bus.rdata) // 8
        if ar_pause is not None:
            self.ar.set_pause_generator(ar_pause)
        if r_pause is not None:
            self.r.set_pause_generator(r_pause)
        self.cycle = 0
        self.bursts: list[tuple[int, int]] = []      # (address, beats) of every burst, in order
        self.in_flight = 0
        self.max_in_flight = 0
        self.beats = 0
        self._pending: deque = deque()
        cocotb.start_soon(self._count())
        cocotb.start_soon(self._recv())
        cocotb.start_soon(self._send())

    async def _count(self):
        while True:
            await RisingEdge(self.clock)
            self.cycle += 1

    async def _recv(self):
        while True:
            ar = await self.ar.recv()
            addr, beats = int(ar.araddr), int(ar.arlen) + 1
            size, burst = int(ar.arsize), int(ar.arburst)
            assert burst == 1, f"burst type {burst} is not INCR"
            assert 1 << size == self.byte_lanes, f"arsize {size} is not the full {self.byte_lanes}-byte beat"
            assert addr % self.byte_lanes == 0, f"burst address {addr:#x} is not beat-aligned"
            assert (addr & 0xFFF) + beats * self.byte_lanes <= 0x1000, \
                f"burst at {addr:#x} of {beats} beats crosses a 4 KB boundary"
            self.bursts.append((addr, beats))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if self.max_outstanding is not None:
                assert self.in_flight <= self.max_outstanding, \
                    f"{self.in_flight} bursts in flight, more than {self.max_outstanding}"
            due = self.cycle + self.latency + (self.rng.randrange(self.jitter + 1) if self.jitter else 0)
            due = max(due, self._pending[-1][0] if self._pending else 0)    # in-order responses
            self._pending.append((due, int(ar.arid), addr, beats))

    async def _send(self):
        while True:
            while not self._pending or self._pending[0][0] > self.cycle:
                await RisingEdge(self.clock)
            _, arid, addr, beats = self._pending.popleft()
            for n in range(beats):
                a = addr + n * self.byte_lanes
                r = self.r._transaction_obj()
                r.rid, r.rlast = arid, n == beats - 1
                if a + self.byte_lanes <= self.size:
                    r.rdata, r.rresp = int.from_bytes(self.read(a, self.byte_lanes), "little"), AxiResp.OKAY
                else:
                    r.rdata, r.rresp = 0, AxiResp.SLVERR
                await self.r.send(r)
                self.beats += 1
            self.in_flight -= 1
