"""cocotb bench of `hdl.axi_csr.AxiToCsr`: the bridge in front of a `hdl.csr.CsrBlock` (`CsrBridgeTop`), driven
by cocotbext-axi's `AxiMaster` with random pauses on all five channels and checked beat by beat against the
transaction model `sim.axi_csr` (tb/axi_csr/test_axi_csr.py)."""

from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In

from hdl.axi import AxiSignature
from hdl.axi_csr import HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS, AxiToCsr
from hdl.csr import CsrBlock, port_name
from hdl.csr_map import REGISTERS

__all__ = ["CsrBridgeTop"]


class CsrBridgeTop(wiring.Component):
    """`AxiToCsr` + `CsrBlock`: the AXI4 port ``s_axi`` and the register file's ports (``i_<reg>`` for the
    read-only registers, driven by the bench; ``o_<reg>`` for the others), named as on `CsrBlock`."""

    def __init__(self, registers=REGISTERS, addr_bits: int = HPM0_ADDR_BITS, data_bits: int = HPM0_DATA_BITS,
                 id_bits: int = HPM0_ID_BITS):
        self.bridge = AxiToCsr(addr_bits, data_bits, id_bits)
        self.csr = CsrBlock(registers)
        members = {"s_axi": In(AxiSignature(addr_bits, data_bits, id_bits))}
        for r in self.csr.registers:
            members[port_name(r)] = self.csr.signature.members[port_name(r)]
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        m.submodules.bridge, m.submodules.csr = self.bridge, self.csr
        wiring.connect(m, wiring.flipped(self.s_axi), self.bridge.s_axi)
        wiring.connect(m, self.bridge.m_axil, self.csr.axil)
        for r in self.csr.registers:
            name = port_name(r)
            if r.access == "ro":
                m.d.comb += getattr(self.csr, name).eq(getattr(self, name))
            else:
                m.d.comb += getattr(self, name).eq(getattr(self.csr, name))
        return m
