"""SFU building blocks in Amaranth, bit-identical to `sim.sfu` (status: partial, see docs/sfu.md).

What exists:

- `Flow`: a small scheduler for pipelines built from `hdl.fp` primitives. Every value is a *node*
  ``(signal, time)``; an operation waits for its latest operand, and earlier operands are delayed with
  registers gated by the shared ``en`` (so the whole pipeline holds when ``en`` is 0). This is how every
  SFU function is laid out: the RTL is the model's operation sequence, scheduled.
- `SegmentPoly`: the shared evaluator ``((c3*t + c2)*t + c1)*t + c0`` (`sim.sfu.horner`) with the
  coefficient table of `sim.sfu.table` in a ROM. Only the 9-bit index is delayed: each coefficient is
  read from its own ROM port in the cycle it is used.
- `Recip`: the whole ``sim.sfu.recip`` (normalise, log-segment index, exact ``t``, cubic, ``ldexp``,
  special cases) as one pipeline, one element per cycle.

The full stream SFU (every CVO and VEC function behind one `lib.stream` command/data interface) is
designed in docs/sfu.md and not yet built.
"""


import numpy as np
from amaranth import Cat, Const, Module, Mux, Signal, Value
from amaranth.lib import memory, wiring
from amaranth.lib.wiring import In, Out

from sim import sfu as model

from .fp import QNAN, FpAdd, FpLdexp, FpMul

__all__ = ["Flow", "SegmentPoly", "Recip"]


class Flow:
    """Schedules operations on ``(value, time)`` nodes inside module `m`; every register is gated by `en`."""

    def __init__(self, m: Module, en: Value, prefix: str = "f"):
        self.m, self.en, self.prefix = m, en, prefix
        self._n = 0
        self._delays = {}

    def _name(self, what):
        self._n += 1
        return f"{self.prefix}{self._n}_{what}"

    def delay(self, node, t: int):
        """`node` delayed until time `t` (registers gated by en; shared between users)."""
        v, t0 = node
        if t < t0:
            raise ValueError(f"cannot move a value from time {t0} back to {t}")
        key = (id(v), t0)
        chain = self._delays.setdefault(key, [v])
        while len(chain) <= t - t0:
            r = Signal(Value.cast(v).shape(), name=self._name("d"))
            with self.m.If(self.en):
                self.m.d.sync += r.eq(chain[-1])
            chain.append(r)
        return chain[t - t0]

    def align(self, *nodes):
        t = max(n[1] for n in nodes)
        return [self.delay(n, t) for n in nodes], t

    def comb(self, fn, *nodes, register=True):
        """Apply the combinational function `fn` to the aligned operands (then one register)."""
        vals, t = self.align(*nodes)
        v = Value.cast(fn(*vals))
        if not register:
            return v, t
        r = Signal(v.shape(), name=self._name("c"))
        with self.m.If(self.en):
            self.m.d.sync += r.eq(v)
        return r, t + 1

    def _unit(self, unit, a, b):
        m = self.m
        m.submodules[self._name(type(unit).__name__.lower())] = unit
        (va, vb), t = self.align(a, b)
        m.d.comb += [unit.en.eq(self.en), unit.i_valid.eq(1), unit.i_a.eq(va), unit.i_b.eq(vb)]
        return unit.o_y, t + unit.latency

    def add(self, a, b):
        return self._unit(FpAdd(), a, b)

    def mul(self, a, b):
        return self._unit(FpMul(), a, b)

    def ldexp(self, a, k, exp_width=10):
        return self._unit(FpLdexp(exp_width), a, k)

    @staticmethod
    def const(value, width=32):
        return Const(int(value), width), 0


def _f32_bits(x) -> int:
    return int(np.asarray(x, np.float32).view(np.uint32))


class SegmentPoly(wiring.Component):
    """``((c3*t + c2)*t + c1)*t + c0`` with ``c = table[i_index]`` (binary32 RNE, `sim.sfu.horner`).

    Parameters
    ----------
    table : float32 array (segments, 4) from `sim.sfu.table`.

    Ports: ``en``, ``i_valid``, ``i_index``, ``i_t`` (binary32), ``o_valid``, ``o_y``; latency `latency`."""

    def __init__(self, table: np.ndarray):
        table = np.asarray(table)
        if table.ndim != 2 or table.shape[1] != 4 or table.dtype != np.float32:
            self._MustUse__silence = True
            raise ValueError(f"SegmentPoly needs a float32 table of shape (segments, 4), not {table.dtype} "
                             f"{table.shape}")
        self._table = table
        self._index_bits = max(1, (len(table) - 1).bit_length())
        super().__init__({"en": In(1), "i_valid": In(1), "i_index": In(self._index_bits), "i_t": In(32),
                          "o_valid": Out(1), "o_y": Out(32)})

    @property
    def latency(self) -> int:
        return 1 + 3 * (FpMul.LATENCY + FpAdd.LATENCY)

    def elaborate(self, platform):
        m = Module()
        f = Flow(m, self.en, "p")
        words = self._table.view(np.uint32)
        index, t = (self.i_index, 0), (self.i_t, 0)

        def coeff(k, node):
            """Coefficient k read from its own ROM port: index at time T -> data at T + 1."""
            rom = memory.Memory(shape=32, depth=len(words), init=[int(w) for w in words[:, k]])
            m.submodules[f"rom_c{k}"] = rom
            port = rom.read_port(domain="sync")
            m.d.comb += [port.en.eq(self.en), port.addr.eq(f.delay(index, node[1] - 1))]
            return port.data, node[1]

        start = (self.i_index, 1)          # the first coefficient is read at time 0, used at time 1
        c3 = coeff(3, start)
        h = f.mul(c3, t)
        h = f.add(h, coeff(2, h))
        h = f.mul(h, t)
        h = f.add(h, coeff(1, h))
        h = f.mul(h, t)
        h = f.add(h, coeff(0, h))
        assert h[1] == self.latency, h
        m.d.comb += [self.o_y.eq(h[0]), self.o_valid.eq(f.delay((self.i_valid, 0), h[1]))]
        return m


class Recip(wiring.Component):
    """``sim.sfu.recip`` as a pipeline: ``en``, ``i_valid``, ``i_a`` -> ``o_valid``, ``o_y``."""

    en: In(1)
    i_valid: In(1)
    i_a: In(32)
    o_valid: Out(1)
    o_y: Out(32)

    def __init__(self):
        super().__init__()

    @property
    def latency(self) -> int:
        # normalise (ldexp) + t (add) + cubic + ldexp + special-case register
        return 2 * FpLdexp.LATENCY + FpAdd.LATENCY + 1 + 3 * (FpMul.LATENCY + FpAdd.LATENCY) + 1

    def elaborate(self, platform):
        m = Module()
        f = Flow(m, self.en, "r")
        x = (self.i_a, 0)
        e_lo, _, j_bits = model.RECIP_GEOM
        low = 23 - j_bits
        # |x| with subnormals scaled by 2**24 (exact); e = exponent - 127 (- 24 for subnormals).
        a = f.comb(lambda v: v[:31], x, register=False)
        sub = f.comb(lambda v: v[23:31] == 0, x, register=False)
        a2 = f.ldexp(a, f.comb(lambda s: Mux(s, 24, 0), sub, register=False))
        e = f.comb(lambda b, s: b[23:31] - 127 - Mux(s, 24, 0), a2, sub, register=False)
        mant = f.comb(lambda b: Cat(b[:23], Const(127, 8)), a2, register=False)
        start = f.comb(lambda b: Cat(Const(0, low), b[low:23], Const(127, 8)), a2, register=False)
        index = f.comb(lambda b: b[low:23], a2, register=False)
        neg_start = f.comb(lambda s: Cat(s[:31], Const(1, 1)), start, register=False)
        t = f.add(mant, neg_start)
        poly = SegmentPoly(model.table("recip"))
        m.submodules.poly = poly
        (vi, vt), t0 = f.align(index, t)
        m.d.comb += [poly.en.eq(self.en), poly.i_valid.eq(1), poly.i_index.eq(vi), poly.i_t.eq(vt)]
        p = (poly.o_y, t0 + poly.latency)
        y = f.ldexp(p, f.comb(lambda v: -v, e, register=False))

        def special(v, yy):
            mag = v[:31]
            out = Signal(32)
            m.d.comb += out.eq(Cat(yy[:31], v[31]))
            with m.If(v[23:31] == 0xFF):
                m.d.comb += out.eq(Mux(v[:23] != 0, QNAN, Cat(Const(0, 31), v[31])))
            with m.Elif(mag == 0):
                m.d.comb += out.eq(Cat(Const(0x7F800000, 31), v[31]))
            return out

        r = f.comb(special, x, y)
        assert r[1] == self.latency, (r[1], self.latency)
        m.d.comb += [self.o_y.eq(r[0]), self.o_valid.eq(f.delay((self.i_valid, 0), r[1]))]
        return m
