"""The scalar ALU: one binary32 add, multiply or int->float conversion at a time, with a fixed wait.

A command ``{a, b, fn}`` on ``i_cmd`` is taken while the ALU is idle or in the cycle its result leaves; ``o_y`` carries its result (always
taken) `WAIT` + 1 cycles later. The units are the `hdl.fp` ones (round to nearest even, as `sim.iss` computes
in binary32), enabled every cycle; the wait covers the longest of their latencies.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.wiring import In, Out

from ..fp import FpAdd, FpMul, IntToFp

__all__ = ["AluFn", "ScalarAlu", "WAIT", "alu_command", "alu_result"]

WAIT = 8              # cycles counted after the command before the result is taken


class AluFn(enum.Enum, shape=2):
    ADD = 0
    MUL = 1
    ITOF = 2          # a (an unsigned integer) as binary32


def alu_command() -> stream.Signature:
    return stream.Signature(data.StructLayout({"a": 32, "b": 32, "fn": AluFn}))


def alu_result() -> stream.Signature:
    return stream.Signature(32, always_ready=True)


class ScalarAlu(wiring.Component):
    """i_cmd : In(alu_command); o_y : Out(alu_result)."""

    def __init__(self):
        super().__init__({"i_cmd": In(alu_command()), "o_y": Out(alu_result())})

    def elaborate(self, platform):
        m = Module()
        m.submodules.add = add = FpAdd()
        m.submodules.mul = mul = FpMul()
        m.submodules.itof = itof = IntToFp(32)
        fn = Signal(AluFn)
        busy = Signal()
        count = Signal(range(WAIT + 1))
        for u in (add, mul, itof):
            m.d.comb += [u.en.eq(1), u.i_valid.eq(1)]
        finishing = Signal()            # busy & (count == 0), registered: no compare of the count ahead of ready
        with m.If(busy):
            m.d.sync += [count.eq(count - 1), finishing.eq(count == 1)]
            with m.If(finishing):
                m.d.sync += [busy.eq(0), finishing.eq(0)]
        m.d.comb += [self.o_y.valid.eq(finishing), self.i_cmd.ready.eq(~busy | finishing)]
        with m.If(self.i_cmd.valid & self.i_cmd.ready):      # a chained operation starts as the last one ends
            c = self.i_cmd.payload
            m.d.sync += [add.i_a.eq(c.a), add.i_b.eq(c.b), mul.i_a.eq(c.a), mul.i_b.eq(c.b), itof.i_a.eq(c.a),
                         fn.eq(c.fn), count.eq(WAIT), busy.eq(1), finishing.eq(0)]
        m.d.comb += self.o_y.payload.eq(Mux(fn == AluFn.ADD, add.o_y, Mux(fn == AluFn.MUL, mul.o_y, itof.o_y)))
        return m
