"""A bench-only DUT for `tb.ddr4.axi.Ddr4AxiMemory`'s own test: ``ports`` AXI4 ports wired straight through,
``s_axi<p>`` (driven by cocotbext-axi's `AxiMaster`) to ``m_axi<p>`` (served by the DDR4 model), plus a cycle
counter so that the Verilog has the clock and reset the benches drive."""

from __future__ import annotations

from amaranth import Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.axi import AxiSignature
from hdl.config import HardwareConfig

__all__ = ["AxiPassthrough"]


class AxiPassthrough(wiring.Component):
    """``s_axi<p>`` -> ``m_axi<p>`` for p < `ports`, the AXI4 signature of `hw` (kv260: 40-bit addresses, 128-bit
    data); ``o_cycles`` counts clock cycles since reset."""

    def __init__(self, hw: HardwareConfig, ports: int = 2):
        self._ports = ports
        sig = AxiSignature.from_config(hw)
        members = {"o_cycles": Out(32)}
        for p in range(ports):
            members[f"s_axi{p}"] = In(sig)
            members[f"m_axi{p}"] = Out(sig)
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        for p in range(self._ports):
            s, d = getattr(self, f"s_axi{p}"), getattr(self, f"m_axi{p}")
            for name, member in d.signature.members.items():
                if member.flow == Out:                 # a master output: from the bench's master to the memory
                    m.d.comb += getattr(d, name).eq(getattr(s, name))
                else:
                    m.d.comb += getattr(s, name).eq(getattr(d, name))
        count = Signal(32)
        m.d.sync += count.eq(count + 1)
        m.d.comb += self.o_cycles.eq(count)
        return m
