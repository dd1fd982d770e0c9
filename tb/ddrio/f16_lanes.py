"""Bench top for `hdl.fp.F32ToF16`: `LANES` converters side by side on one valid, so a Verilator run checks
several vectors per cycle (tb/ddrio/test_f32_to_f16.py)."""

from amaranth import Cat, Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.fp import F32ToF16


class F32ToF16Lanes(wiring.Component):
    """``o_y`` lane i (16 bits) = F32ToF16(``i_a`` lane i (32 bits)); all lanes share ``en``/valid."""

    def __init__(self, lanes: int = 4):
        self._lanes = lanes
        self.units = [F32ToF16() for _ in range(lanes)]
        super().__init__({"en": In(1), "i_valid": In(1), "i_a": In(32 * lanes), "o_valid": Out(1),
                          "o_y": Out(16 * lanes)})

    lanes = property(lambda self: self._lanes)
    latency = property(lambda self: self.units[0].latency)

    def elaborate(self, platform):
        m = Module()
        for i, u in enumerate(self.units):
            m.submodules[f"cvt{i}"] = u
            m.d.comb += [u.en.eq(self.en), u.i_valid.eq(self.i_valid), u.i_a.eq(self.i_a[32 * i:32 * i + 32])]
        m.d.comb += [self.o_valid.eq(self.units[0].o_valid), self.o_y.eq(Cat(u.o_y[:16] for u in self.units))]
        return m
