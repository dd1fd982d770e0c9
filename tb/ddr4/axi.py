"""cocotb adapter: a DUT's AXI4 master ports served by one `tb.ddr4.model.Ddr4Channel`.

`Ddr4AxiMemory` is the shared DDR behind every ``m_axi<p>`` port of a DUT, as `tb.axi.memory.LatencyAxiReadRam`
is a private memory behind one: it accepts AR (and AW, W) handshakes, hands each burst to the channel in the
cycle of its address handshake (a write in the cycle of its last W beat), and drives R beats in order as the
channel makes them available (one per cycle per port; rready pauses hold them back), B responses likewise. It
checks the AXI rules the NPU's DMAs keep (INCR, full-width beats, no 4 KB crossing) and records every read
burst's latency (AR handshake cycle to first R beat handshake cycle, as the DDR probe counts it).

One coroutine drives all ports: each clock it drives the outputs after the rising edge, then samples the
handshakes in the read-only phase, so a port costs a few signal accesses per cycle. Random pauses: a
generator per port and channel (``ar_pause``, ``r_pause``, ...) yields 1 for a cycle the memory holds its
ready (AR, AW, W) or valid (R, B) low.
"""

from __future__ import annotations

from collections import deque

import cocotb
from cocotb.triggers import ReadOnly, RisingEdge

from .model import Ddr4Channel

__all__ = ["Ddr4AxiMemory"]


class _Port:
    def __init__(self, dut, prefix, sep, writes):
        def sig(name):
            return getattr(dut, f"{prefix}{sep}{name}")
        self.arvalid, self.arready = sig("arvalid"), sig("arready")
        self.araddr, self.arlen = sig("araddr"), sig("arlen")
        self.arsize, self.arburst, self.arid = sig("arsize"), sig("arburst"), sig("arid")
        self.rvalid, self.rready, self.rdata, self.rlast = sig("rvalid"), sig("rready"), sig("rdata"), sig("rlast")
        self.rresp, self.rid = sig("rresp"), sig("rid")
        self.lanes = len(self.rdata) // 8
        self.writes = writes
        if writes:
            self.awvalid, self.awready = sig("awvalid"), sig("awready")
            self.awaddr, self.awlen = sig("awaddr"), sig("awlen")
            self.awsize, self.awburst, self.awid = sig("awsize"), sig("awburst"), sig("awid")
            self.wvalid, self.wready, self.wdata, self.wstrb = sig("wvalid"), sig("wready"), sig("wdata"), sig("wstrb")
            self.wlast = sig("wlast")
            self.bvalid, self.bready, self.bresp, self.bid = sig("bvalid"), sig("bready"), sig("bresp"), sig("bid")
        self.reads: deque = deque()       # (burst, arid, AR cycle), in order
        self.beat = 0                     # next beat of reads[0]
        self.first_r = True
        self.r_out = None                 # (burst, beat) driven this cycle
        self.aws: deque = deque()         # (addr, beats, awid) waiting for their data
        self.wbuf = bytearray()
        self.bq: deque = deque()          # (burst, awid) waiting for their B
        self.b_out = None


class Ddr4AxiMemory:
    """The DDR behind `prefixes` (e.g. ``["m_axi0", ...]``, port p of the channel = prefixes[p]).

    Parameters
    ----------
    dut, clock : the cocotb handles.
    channel : the `Ddr4Channel` (its ``fabric_hz`` is the clock's frequency; its ports >= len(prefixes)). A
        bench may put another in `channel` while no burst is in flight (its ``start`` past `cycle`).
    writes : serve the write channels too (False: the DUT must keep them idle; their readies stay 0).
    pauses : {channel name: [generator per port]} for "ar", "r", "aw", "w", "b"; missing: no pauses.
    bus_separator : between prefix and signal name (Amaranth's "__").
    """

    def __init__(self, dut, clock, prefixes: list[str], channel: Ddr4Channel, *, writes: bool = False,
                 pauses: dict | None = None, bus_separator: str = "__"):
        if channel.ports < len(prefixes):
            raise ValueError(f"the channel has {channel.ports} ports for {len(prefixes)} AXI ports")
        self.clock, self.channel = clock, channel
        self.ports = [_Port(dut, pre, bus_separator, writes) for pre in prefixes]
        self.pauses = {k: list(v) for k, v in (pauses or {}).items()}
        self.cycle = 0
        self.latencies: list[list[int]] = [[] for _ in prefixes]
        self.bursts: list[list[tuple[int, int]]] = [[] for _ in prefixes]   # (address, beats) per port
        self.errors: list[str] = []
        for port in self.ports:
            port.arready.value = 0
            port.rvalid.value = 0
            if writes:
                port.awready.value = port.wready.value = port.bvalid.value = 0
        self._task = cocotb.start_soon(self._run())

    def _paused(self, kind: str, p: int) -> bool:
        gens = self.pauses.get(kind)
        return bool(gens and gens[p] is not None and next(gens[p]))

    def reset_records(self) -> None:
        for lst in self.latencies + self.bursts:
            lst.clear()

    async def _run(self):
        while True:
            await RisingEdge(self.clock)
            self.cycle += 1
            n = self.cycle
            self.channel.advance(n)                 # the DRAM clocks before this cycle
            for p, port in enumerate(self.ports):
                port.arready.value = 0 if self._paused("ar", p) else 1
                self._drive_r(p, port, n)
                if port.writes:
                    port.awready.value = 0 if self._paused("aw", p) else 1
                    port.wready.value = 0 if (self._paused("w", p) or not port.aws) else 1
                    self._drive_b(p, port, n)
            await ReadOnly()
            for p, port in enumerate(self.ports):
                if port.arvalid.value and port.arready.value:
                    self._ar(p, port, n)
                if port.r_out is not None and port.rready.value:
                    self._r_done(p, port, n)
                if port.writes:
                    if port.awvalid.value and port.awready.value:
                        self._aw(p, port)
                    if port.wvalid.value and port.wready.value:
                        self._w(p, port, n)
                    if port.b_out is not None and port.bready.value:
                        port.bq.popleft()
                        port.b_out = None

    def _check(self, p, addr, beats, size, burst, lanes):
        if burst != 1:
            self.errors.append(f"port {p}: burst type {burst} is not INCR")
        if 1 << size != lanes:
            self.errors.append(f"port {p}: size {size} is not the full {lanes}-byte beat")
        if addr % lanes or (addr & 0xFFF) + beats * lanes > 0x1000:
            self.errors.append(f"port {p}: a burst of {beats} beats at {addr:#x} is unaligned or crosses 4 KB")

    def _ar(self, p, port, n):
        addr, beats = int(port.araddr.value), int(port.arlen.value) + 1
        self._check(p, addr, beats, int(port.arsize.value), int(port.arburst.value), port.lanes)
        self.bursts[p].append((addr, beats))
        b = self.channel.read(p, addr, beats * port.lanes, n)
        port.reads.append((b, int(port.arid.value), n))

    def _drive_r(self, p, port, n):
        port.r_out = None
        if port.reads and not self._paused("r", p):
            b, arid, _ = port.reads[0]
            if port.beat < len(b.ready) and b.ready[port.beat] <= n:
                k = port.beat
                lanes = port.lanes
                port.rdata.value = int.from_bytes(b.read_data[k * lanes:(k + 1) * lanes], "little") \
                    if b.read_data is not None else 0
                port.rlast.value = int(k == b.beats - 1)
                port.rid.value = arid
                port.rresp.value = 0
                port.rvalid.value = 1
                port.r_out = (b, k)
                return
        port.rvalid.value = 0

    def _r_done(self, p, port, n):
        b, _, ar_cycle = port.reads[0]
        if port.beat == 0:
            self.latencies[p].append(n - ar_cycle)
        port.beat += 1
        if port.beat == b.beats:
            port.reads.popleft()
            port.beat = 0
        port.r_out = None

    def _aw(self, p, port):
        addr, beats = int(port.awaddr.value), int(port.awlen.value) + 1
        self._check(p, addr, beats, int(port.awsize.value), int(port.awburst.value), port.lanes)
        port.aws.append((addr, beats, int(port.awid.value)))

    def _w(self, p, port, n):
        addr, beats, awid = port.aws[0]
        data = int(port.wdata.value).to_bytes(port.lanes, "little")
        strb = int(port.wstrb.value)
        if strb != (1 << port.lanes) - 1:
            self.errors.append(f"port {p}: a write beat with strobes {strb:#x} (the model writes whole beats)")
        port.wbuf += data
        last = len(port.wbuf) == beats * port.lanes
        if bool(port.wlast.value) != last:
            self.errors.append(f"port {p}: WLAST {int(port.wlast.value)} on beat {len(port.wbuf) // port.lanes} "
                               f"of {beats}")
        if last:
            port.aws.popleft()
            port.bq.append((self.channel.write(p, addr, bytes(port.wbuf), n), awid))
            port.wbuf = bytearray()

    def _drive_b(self, p, port, n):
        port.b_out = None
        if port.bq and not self._paused("b", p):
            b, awid = port.bq[0]
            if b.done is not None and b.done <= n:
                port.bid.value = awid
                port.bresp.value = 0
                port.bvalid.value = 1
                port.b_out = b
                return
        port.bvalid.value = 0
