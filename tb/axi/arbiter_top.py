"""Bench top for `hdl.axi.AxiReadArbiter`: two `AxiReadDma` and one `hdl.ddrio.DdrReader` share one read port
through a 3-master arbiter, the way port 0 of the NPU is shared (tb/axi/test_arbiter.py)."""

from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from hdl.axi import AxiReadArbiter, AxiReadDma, AxiReadSignature
from hdl.config import HardwareConfig
from hdl.ddrio import DdrReader


class ArbiterBench(wiring.Component):
    """``a_*`` / ``b_*``: the two DMAs' command and data streams; ``r_*``: the DdrReader's; ``axi``: the
    shared port."""

    def __init__(self, hw: HardwareConfig):
        self.dma_a, self.dma_b, self.reader = AxiReadDma(hw), AxiReadDma(hw), DdrReader(hw)
        self.arbiter = AxiReadArbiter(hw, 3)
        a, b, r = self.dma_a.signature.members, self.dma_b.signature.members, self.reader.signature.members
        super().__init__({
            "a_cmd": a["i_cmd"], "a_data": a["o_data"], "b_cmd": b["i_cmd"], "b_data": b["o_data"],
            "r_cmd": r["i_cmd"], "r_elem": r["o_elem"],
            "axi": Out(AxiReadSignature.from_config(hw)),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.dma_a, m.submodules.dma_b = self.dma_a, self.dma_b
        m.submodules.reader, m.submodules.arbiter = self.reader, self.arbiter
        arb = self.arbiter
        wiring.connect(m, self.dma_a.axi, arb.s0)
        wiring.connect(m, self.dma_b.axi, arb.s1)
        wiring.connect(m, self.reader.axi, arb.s2)
        wiring.connect(m, arb.m, wiring.flipped(self.axi))
        wiring.connect(m, wiring.flipped(self.a_cmd), self.dma_a.i_cmd)
        wiring.connect(m, self.dma_a.o_data, wiring.flipped(self.a_data))
        wiring.connect(m, wiring.flipped(self.b_cmd), self.dma_b.i_cmd)
        wiring.connect(m, self.dma_b.o_data, wiring.flipped(self.b_data))
        wiring.connect(m, wiring.flipped(self.r_cmd), self.reader.i_cmd)
        wiring.connect(m, self.reader.o_elem, wiring.flipped(self.r_elem))
        return m
