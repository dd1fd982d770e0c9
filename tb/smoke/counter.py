"""A trivial component used to check the bench and synthesis plumbing itself (tests/test_tb_runner.py)."""

from amaranth import Module, unsigned
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out


class Accumulator(wiring.Component):
    """Adds ``i_data`` to ``o_sum`` on every cycle that ``i_en`` is high (16-bit wrap-around)."""

    i_en: In(1)
    i_data: In(unsigned(8))
    o_sum: Out(unsigned(16))

    def elaborate(self, platform):
        m = Module()
        with m.If(self.i_en):
            m.d.sync += self.o_sum.eq(self.o_sum + self.i_data)
        return m
