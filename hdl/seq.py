"""Small sequential arithmetic units of the controller: an unsigned divider and the correctly rounded
binary32 reciprocal of an integer.

- `SeqDivider`: ``q, r = divmod(num, den)`` for 32-bit unsigned operands, one quotient bit per cycle
  (restoring division, 32 cycles). The controller uses it for ``POS mod capacity`` (the KV ring), the
  first visible ring slot of ATTN and ``VL / HD`` (segments of RMSNORM and ROPE, with the remainder check).
- `IntRecip`: ``fp32(1 / n)`` for a 32-bit unsigned ``n >= 1``, rounded to nearest (what
  ``np.float32(1.0 / n)`` gives for every n below 2**28, where the float64 quotient cannot land on a
  binary32 rounding boundary). A power of two is exact; otherwise 25 quotient bits of ``2**(k+25) / n``
  (``2**k < n < 2**(k+1)``) are computed one per cycle and rounded up when the 25th is 1 (the remainder of
  a non-power-of-two n is never zero, so there are no ties). It gives RMSNORM's ``1/HD`` (SETHD).
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .l2 import set_bits

__all__ = ["SeqDivider", "IntRecip"]


class SeqDivider(wiring.Component):
    """Unsigned ``divmod`` of `width`-bit operands in `width` cycles.

    Members
    -------
    i_start : In(1)       pulse: divide ``i_num`` by ``i_den`` (``i_den`` = 0 gives q = all ones, r = num)
    i_num, i_den : In(width)
    o_busy : Out(1)       high while dividing; ``o_q``, ``o_r`` are valid when it falls
    o_q, o_r : Out(width)
    """

    def __init__(self, width: int = 32):
        self._width = width
        super().__init__({"i_start": In(1), "i_num": In(width), "i_den": In(width),
                          "o_busy": Out(1), "o_q": Out(width), "o_r": Out(width)})

    def elaborate(self, platform):
        m = Module()
        w = self._width
        num = Signal(w)
        den = Signal(w)
        rem = Signal(w + 1)
        count = Signal(range(w + 1))
        with m.If(self.i_start):
            m.d.sync += [num.eq(self.i_num), den.eq(self.i_den), rem.eq(0), self.o_q.eq(0),
                         count.eq(w), self.o_busy.eq(1)]
        with m.Elif(self.o_busy):
            trial = Cat(num[w - 1], rem[:w])               # rem * 2 + next numerator bit
            ge = trial >= den
            m.d.sync += rem.eq(Mux(ge, trial - den, trial))
            m.d.sync += [num.eq(num << 1), self.o_q.eq(Cat(ge, self.o_q[:w - 1])), count.eq(count - 1)]
            with m.If(count == 1):
                m.d.sync += self.o_busy.eq(0)
        m.d.comb += self.o_r.eq(rem[:w])
        return m


class IntRecip(wiring.Component):
    """``fp32(1 / n)`` (round to nearest) of an unsigned 32-bit ``n >= 1``; 3 cycles for a power of two, 28
    otherwise (n is registered, then its highest bit, then the division starts).

    Members
    -------
    i_start : In(1); i_n : In(32); o_busy : Out(1); o_y : Out(32) (valid when ``o_busy`` falls; n = 0 gives +inf)
    """

    QBITS = 25

    def __init__(self):
        super().__init__({"i_start": In(1), "i_n": In(32), "o_busy": Out(1), "o_y": Out(32)})

    def elaborate(self, platform):
        m = Module()
        n = Signal(32)
        load, classify = Signal(), Signal()   # n has just been registered; its highest bit has
        e0 = Signal(8)                        # 126 - floor(log2 n): the exponent field of 1/n (not a power of 2)
        top = Signal(32)                      # its highest set bit alone
        # per 8-bit group of n: any bit set, more than one set (n is 0 or a power of two when no group has
        # more than one and at most one group has any)
        gany, gmulti = Signal(4), Signal(4)
        rem = Signal(34)
        q = Signal(self.QBITS)
        count = Signal(range(self.QBITS + 1))
        more = Signal()                       # count != 0
        with m.If(self.i_start):
            m.d.sync += [n.eq(self.i_n), load.eq(1), self.o_busy.eq(1), q.eq(0), count.eq(0), more.eq(0)]
        with m.Elif(load):
            # one-hot: a set bit with none set above it (its index in the next cycle), the lowest set bit of
            # n bit-reversed, r & (~r + 1) (one carry chain)
            r = Cat(*(n[31 - i] for i in range(32)))
            low = Signal(32)
            m.d.comb += low.eq(r & (~r + 1))
            hb = Cat(*(low[31 - i] for i in range(32)))
            groups = [set_bits(n[8 * g:8 * g + 8]) for g in range(4)]
            m.d.sync += [load.eq(0), classify.eq(1), top.eq(hb),
                         gany.eq(Cat(*(a for a, _ in groups))), gmulti.eq(Cat(*(x for _, x in groups)))]
        with m.Elif(classify):
            zero = ~gany.any()
            pow2 = ~(gmulti.any() | set_bits(gany)[1])
            idx = Cat(*[Cat(*[top[i] for i in range(32) if (i >> b) & 1]).any() for b in range(5)])
            m.d.sync += [classify.eq(0), e0.eq(126 - idx)]
            with m.If(zero):
                m.d.sync += [self.o_y.eq(0x7F800000), self.o_busy.eq(0)]
            with m.Elif(pow2):
                m.d.sync += [self.o_y.eq((127 - idx) << 23), self.o_busy.eq(0)]
            with m.Else():
                m.d.sync += [rem.eq(top << 1), count.eq(self.QBITS), more.eq(1)]
        with m.Elif(self.o_busy):
            # one subtract: its borrow is rem < n
            diff = Signal(35)
            m.d.comb += diff.eq(rem - n)
            ge = ~diff[34]
            with m.If(more):
                m.d.sync += [rem.eq(Mux(ge, diff[:34], rem) << 1), q.eq(Cat(ge, q[:-1])),
                             count.eq(count - 1), more.eq(count != 1)]
            with m.Else():
                # q[24] is the hidden bit (the first quotient bit is 1), q[1:24] the fraction, q[0] the round
                # bit (1/n is never a tie): one increment on the packed word rounds up, a carry out of the
                # fraction walking into the exponent field
                m.d.sync += [self.o_y.eq(Cat(q[1:24], e0) + q[0]), self.o_busy.eq(0)]
        return m
