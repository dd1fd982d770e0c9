"""AXI4-Lite slave serving the CSR map of `hdl.csr_map`.

`AxiLiteSignature` is the AXI4-Lite interface from the manager's side (the PS's HPM0); the NPU takes it
flipped (``In(AxiLiteSignature(...))``), so its Verilog ports are ``<name>__awaddr`` etc., which
cocotbext-axi's ``AxiLiteBus.from_prefix(dut, "<name>", bus_separator="__")`` finds.

`CsrBlock` has one port per register, named after it in lower case: ``o_<reg>`` for ``rw`` registers (the
stored value) and ``cmd`` registers (one-cycle pulses of the written bits), ``i_<reg>`` for ``ro``
registers (sampled when read). Protocol rules it keeps:

- a write completes when both its address and data have arrived, in any order; each byte lane is written
  only when its ``wstrb`` bit is set; one response per write;
- writes to a read-only register or to an unmapped offset are answered ``SLVERR`` and change nothing;
  reads of unmapped offsets return 0 with ``SLVERR``; ``cmd`` registers read as 0;
- ``bvalid``/``rvalid`` stay up until the manager takes the response; no channel waits for another
  channel's ready before raising its own valid (AXI rule).
"""

from __future__ import annotations

from amaranth import Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .csr_map import ADDR_BITS, REGISTERS

__all__ = ["AxiLiteSignature", "CsrBlock", "RESP_OKAY", "RESP_SLVERR"]

RESP_OKAY, RESP_SLVERR = 0b00, 0b10


class AxiLiteSignature(wiring.Signature):
    """AXI4-Lite, manager's view."""

    def __init__(self, addr_bits: int = ADDR_BITS, data_bits: int = 32):
        if data_bits not in (32, 64):
            raise ValueError(f"AXI4-Lite data width must be 32 or 64, not {data_bits!r}")
        self._addr_bits, self._data_bits = addr_bits, data_bits
        super().__init__({
            "awvalid": Out(1), "awready": In(1), "awaddr": Out(addr_bits), "awprot": Out(3),
            "wvalid": Out(1), "wready": In(1), "wdata": Out(data_bits), "wstrb": Out(data_bits // 8),
            "bvalid": In(1), "bready": Out(1), "bresp": In(2),
            "arvalid": Out(1), "arready": In(1), "araddr": Out(addr_bits), "arprot": Out(3),
            "rvalid": In(1), "rready": Out(1), "rdata": In(data_bits), "rresp": In(2),
        })

    @property
    def addr_bits(self):
        return self._addr_bits

    @property
    def data_bits(self):
        return self._data_bits

    def __eq__(self, other):
        return (isinstance(other, AxiLiteSignature) and other.addr_bits == self.addr_bits
                and other.data_bits == self.data_bits)

    def __repr__(self):
        return f"AxiLiteSignature({self.addr_bits}, {self.data_bits})"


def port_name(reg) -> str:
    return ("i_" if reg.access == "ro" else "o_") + reg.name.lower()


class CsrBlock(wiring.Component):
    """The register file behind the AXI4-Lite slave port ``axil``."""

    def __init__(self, registers=REGISTERS):
        self._registers = tuple(registers)
        ports = {"axil": In(AxiLiteSignature())}
        for r in self._registers:
            ports[port_name(r)] = In(32) if r.access == "ro" else Out(32, init=r.reset)
        super().__init__(ports)

    @property
    def registers(self):
        return self._registers

    def elaborate(self, platform):
        m = Module()
        bus = self.axil

        # --- write channel: hold address and data until both are here -----------------------------
        aw_full, w_full = Signal(), Signal()
        aw_addr = Signal(ADDR_BITS)
        w_data, w_strb = Signal(32), Signal(4)
        m.d.comb += [bus.awready.eq(~aw_full & ~bus.bvalid), bus.wready.eq(~w_full & ~bus.bvalid)]
        with m.If(bus.awvalid & bus.awready):
            m.d.sync += [aw_full.eq(1), aw_addr.eq(bus.awaddr)]
        with m.If(bus.wvalid & bus.wready):
            m.d.sync += [w_full.eq(1), w_data.eq(bus.wdata), w_strb.eq(bus.wstrb)]
        with m.If(bus.bvalid & bus.bready):
            m.d.sync += bus.bvalid.eq(0)

        for r in self._registers:
            if r.access == "cmd":
                m.d.sync += getattr(self, port_name(r)).eq(0)      # pulses last one cycle

        do_write = Signal()
        m.d.comb += do_write.eq(aw_full & w_full & ~bus.bvalid)
        with m.If(do_write):
            m.d.sync += [aw_full.eq(0), w_full.eq(0), bus.bvalid.eq(1), bus.bresp.eq(RESP_SLVERR)]
            with m.Switch(aw_addr[2:ADDR_BITS]):
                for r in self._registers:
                    if r.access == "ro":
                        continue
                    with m.Case(r.offset >> 2):
                        m.d.sync += bus.bresp.eq(RESP_OKAY)
                        port = getattr(self, port_name(r))
                        for lane in range(4):
                            byte = w_data[8 * lane:8 * lane + 8]
                            with m.If(w_strb[lane]):
                                m.d.sync += port[8 * lane:8 * lane + 8].eq(byte)

        # --- read channel ---------------------------------------------------------------------------
        m.d.comb += bus.arready.eq(~bus.rvalid)
        with m.If(bus.rvalid & bus.rready):
            m.d.sync += bus.rvalid.eq(0)
        with m.If(bus.arvalid & bus.arready):
            m.d.sync += [bus.rvalid.eq(1), bus.rdata.eq(0), bus.rresp.eq(RESP_SLVERR)]
            with m.Switch(bus.araddr[2:ADDR_BITS]):
                for r in self._registers:
                    with m.Case(r.offset >> 2):
                        m.d.sync += bus.rresp.eq(RESP_OKAY)
                        if r.access != "cmd":
                            m.d.sync += bus.rdata.eq(getattr(self, port_name(r)))
        return m
