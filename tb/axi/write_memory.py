"""cocotbext-axi's `AxiRamWrite` with SLVERR past its end, and a monitor of the write channels.

`AxiRamWrite` wraps addresses modulo its size; `CheckedAxiRamWrite` instead fails the writes that fall past
``size`` (the model then answers SLVERR), so benches can check error reporting. `WriteMonitor` watches the
AW/W/B handshakes of a master: bursts awaiting B never exceed the limit, AW payloads obey INCR, full-width,
beat-aligned and no 4 KB crossing, and it counts ``o_done`` pulses.
"""

from __future__ import annotations

from cocotb.triggers import ReadOnly, RisingEdge
from cocotbext.axi import AxiRamWrite


class CheckedAxiRamWrite(AxiRamWrite):
    async def _write(self, address, data):
        if address + len(data) > self.size:
            raise ValueError(f"write at {address:#x} past the end of memory")
        self.write(address, data)


class WriteMonitor:
    def __init__(self, dut, prefix: str, *, max_outstanding: int, done=None):
        self.dut, self.max_outstanding = dut, max_outstanding
        self.s = lambda name: getattr(dut, f"{prefix}__{name}")
        self.done = done
        self.outstanding = self.max_seen = self.dones = self.aw = self.w = 0

    async def run(self):
        s = self.s
        lanes = len(s("wstrb"))
        while True:
            await RisingEdge(self.dut.clk)
            await ReadOnly()
            if int(s("awvalid").value) and int(s("awready").value):
                addr, beats = int(s("awaddr").value), int(s("awlen").value) + 1
                assert int(s("awburst").value) == 1 and 1 << int(s("awsize").value) == lanes
                assert addr % lanes == 0, f"AW {addr:#x} not beat-aligned"
                assert (addr & 0xFFF) + beats * lanes <= 0x1000, f"AW {addr:#x} x {beats} crosses 4 KB"
                self.outstanding += 1
                self.aw += 1
            if int(s("wvalid").value) and int(s("wready").value):
                self.w += 1
            if int(s("bvalid").value) and int(s("bready").value):
                self.outstanding -= 1
            assert self.outstanding <= self.max_outstanding, f"{self.outstanding} bursts awaiting B"
            self.max_seen = max(self.max_seen, self.outstanding)
            if self.done is not None and int(self.done.value):
                self.dones += 1
