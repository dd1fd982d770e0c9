"""The systolic tile engine with its weight ports fed by `hdl.axi.AxiReadDma` (one DMA per weight port), as
the NPU will wire it: DDR → AXI4 read DMA → ``i_wgt[p]``. Only the bench uses this wrapper."""

from amaranth import Module
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.axi import AxiReadDma, AxiReadSignature, read_command_layout
from hdl.config import HardwareConfig
from hdl.systolic import SystolicEngine

LEN_BITS = 24


class SystolicDmaTop(wiring.Component):
    """Members: ``i_wcmd__<p>`` (DMA read commands of weight port p), ``axi__<p>`` (its AXI4 read master),
    ``o_dma_error``, and the engine's ``i_cmd``, ``i_act``, ``i_exp``, ``i_scale``, ``o_y``."""

    def __init__(self, cfg: HardwareConfig):
        self._engine = SystolicEngine(cfg)
        self._dmas = [AxiReadDma(cfg, len_bits=LEN_BITS) for _ in range(self._engine.geometry.wgt_ports)]
        e = self._engine.signature.members
        ports = len(self._dmas)
        super().__init__({
            "i_wcmd": In(stream.Signature(read_command_layout(cfg.axi_addr_bits, LEN_BITS))).array(ports),
            "axi": Out(AxiReadSignature.from_config(cfg)).array(ports),
            "o_dma_error": Out(1),
            "i_cmd": e["i_cmd"], "i_act": e["i_act"], "i_exp": e["i_exp"], "i_scale": e["i_scale"],
            "o_y": e["o_y"],
        })

    @property
    def engine(self) -> SystolicEngine:
        return self._engine

    def elaborate(self, platform):
        m = Module()
        m.submodules.engine = eng = self._engine
        for name in ("i_cmd", "i_act", "i_exp", "i_scale"):
            wiring.connect(m, wiring.flipped(getattr(self, name)), getattr(eng, name))
        wiring.connect(m, eng.o_y, wiring.flipped(self.o_y))
        err = 0
        for p, dma in enumerate(self._dmas):
            m.submodules[f"dma_{p}"] = dma
            wiring.connect(m, wiring.flipped(self.i_wcmd[p]), dma.i_cmd)
            wiring.connect(m, dma.axi, wiring.flipped(self.axi[p]))
            m.d.comb += [eng.i_wgt[p].valid.eq(dma.o_data.valid), eng.i_wgt[p].payload.eq(dma.o_data.p.data),
                         dma.o_data.ready.eq(eng.i_wgt[p].ready)]
            err = err | dma.o_error
        m.d.comb += self.o_dma_error.eq(err)
        return m
