"""An AXI4 read slave that returns different IDs out of order and interleaves their beats.

`LatencyAxiReadRam` answers every burst in arrival order. A real interconnect only keeps the order of
one ID: bursts of different IDs may complete in any order and AXI4 lets their R beats interleave. This
model does both, so a read arbiter must route every beat by ``rid``: each burst gets a random due cycle
(``latency`` + jitter, never before an earlier burst of its ID), and each cycle one beat is sent from a
randomly chosen burst among those due that head their ID's queue. It keeps the base model's AXI checks
(INCR, full-width beats, no 4 KB crossing) and its records (`bursts`, `beats`), and also checks at most
`max_outstanding_per_id` bursts per ID.
"""

from __future__ import annotations

from collections import defaultdict, deque

from cocotb.triggers import RisingEdge
from cocotbext.axi.constants import AxiResp

from tb.axi.memory import LatencyAxiReadRam


class ReorderingAxiReadRam(LatencyAxiReadRam):
    def __init__(self, bus, clock, *, max_outstanding_per_id: int | None = None, **kwargs):
        self.max_outstanding_per_id = max_outstanding_per_id
        self._per_id: dict[int, deque] = defaultdict(deque)
        self.ids_seen: set[int] = set()
        self.interleaved = 0                 # beats sent while another burst was part-way through
        super().__init__(bus, clock, **kwargs)

    async def _recv(self):
        while True:
            ar = await self.ar.recv()
            addr, beats, arid = int(ar.araddr), int(ar.arlen) + 1, int(ar.arid)
            assert int(ar.arburst) == 1, f"burst type {int(ar.arburst)} is not INCR"
            assert 1 << int(ar.arsize) == self.byte_lanes, f"arsize {int(ar.arsize)} is not a full beat"
            assert addr % self.byte_lanes == 0, f"burst address {addr:#x} is not beat-aligned"
            assert (addr & 0xFFF) + beats * self.byte_lanes <= 0x1000, f"burst at {addr:#x} crosses 4 KB"
            self.bursts.append((addr, beats))
            self.ids_seen.add(arid)
            q = self._per_id[arid]
            if self.max_outstanding_per_id is not None:
                assert len(q) < self.max_outstanding_per_id, f"ID {arid}: more than {self.max_outstanding_per_id} in flight"
            due = self.cycle + self.latency + (self.rng.randrange(self.jitter + 1) if self.jitter else 0)
            if q:
                due = max(due, q[-1]["due"])
            q.append(dict(due=due, addr=addr, beats=beats, sent=0))

    async def _send(self):
        while True:
            ready = [i for i, q in self._per_id.items() if q and q[0]["due"] <= self.cycle]
            if not ready:
                await RisingEdge(self.clock)
                continue
            arid = self.rng.choice(ready)
            burst = self._per_id[arid][0]
            if any(q and q[0]["sent"] for i, q in self._per_id.items() if i != arid):
                self.interleaved += 1
            a = burst["addr"] + burst["sent"] * self.byte_lanes
            r = self.r._transaction_obj()
            r.rid, r.rlast = arid, burst["sent"] == burst["beats"] - 1
            if a + self.byte_lanes <= self.size:
                r.rdata, r.rresp = int.from_bytes(self.read(a, self.byte_lanes), "little"), AxiResp.OKAY
            else:
                r.rdata, r.rresp = 0, AxiResp.SLVERR
            burst["sent"] += 1
            if burst["sent"] == burst["beats"]:
                self._per_id[arid].popleft()
            await self.r.send(r)
            self.beats += 1
