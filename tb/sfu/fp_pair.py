"""Bench top for the binary32 primitives: one `FpAdd` and one `FpMul` fed the same operands, so a single
Verilator model checks both (tb/sfu/test_fp.py)."""

from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.fp import FpAdd, FpMul


class FpPair(wiring.Component):
    """``o_sum = a + b`` and ``o_prod = a * b``, both with the same latency and a shared valid."""

    en: In(1)
    i_valid: In(1)
    i_a: In(32)
    i_b: In(32)
    o_valid: Out(1)
    o_sum: Out(32)
    o_prod: Out(32)

    def __init__(self):
        super().__init__()
        self.add, self.mul = FpAdd(), FpMul()
        assert self.add.latency == self.mul.latency

    @property
    def latency(self) -> int:
        return self.add.latency

    def elaborate(self, platform):
        m = Module()
        m.submodules.add, m.submodules.mul = self.add, self.mul
        for u in (self.add, self.mul):
            m.d.comb += [u.en.eq(self.en), u.i_valid.eq(self.i_valid), u.i_a.eq(self.i_a), u.i_b.eq(self.i_b)]
        m.d.comb += [self.o_valid.eq(self.add.o_valid), self.o_sum.eq(self.add.o_y), self.o_prod.eq(self.mul.o_y)]
        return m
