"""The SFU in Amaranth: every CVO function and the element-wise/reduction VEC functions of the ISA on binary32
streams, bit-identical to `sim.sfu` (and to NumPy float32 for add and multiply). Design: docs/sfu.md §4.

Pieces
------
- `Flow`: a small scheduler for pipelines built from `hdl.fp` primitives. Every value is a *node*
  ``(signal, time)``; an operation waits for its latest operand, and earlier operands are delayed with
  registers gated by the shared ``en`` (so the whole pipeline holds when ``en`` is 0). The RTL of every
  function is the model's operation sequence, scheduled.
- `SegmentPoly`: the evaluator ``((c3*t + c2)*t + c1)*t + c0`` (`sim.sfu.horner`) with the coefficient
  table of `hdl.sfu_tables.table` (shared with `sim.sfu`) in ROMs (one port per coefficient, read in the
  cycle it is used).
- `Shared` / `with_shared`: one unit (an evaluator with the concatenated tables, or a tagged adder,
  multiplier, ldexp) for builders that never run on the same element, picked per element by op; the
  requests wait (shift registers) for the latest of them, a start time learnt from dry layouts.
- Function builders (`recip_flow`, `sqrt_flow`, `exp_flow`, `tanh_flow`, `trig_flow`, `gelu_flow`):
  each lays out one `sim.sfu` function on a `Flow`; `FlowUnit` wraps one as a small component for unit
  tests, `Recip` is the reciprocal alone.
- `Sfu`: the stream SFU. A command (`command_layout`: operation `SfuOp`, length, flags, scalars) is taken
  from ``i_cmd``; then `length` elements ``{a, b}`` from ``i_data`` go through one pipeline (one element
  per cycle, every function), results leave on ``o_data``; reductions leave one scalar after draining
  `hw.sfu_reduce_lanes` lane accumulators through a pairwise tree.
"""

from __future__ import annotations

import contextlib

import numpy as np
from amaranth import Cat, Const, Module, Mux, Signal, Value, signed, unsigned
from amaranth.lib import data, enum, memory, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.isa import CvoFunc, VecFunc

from . import sfu_tables
from .dsp import DspMacc
from .fp import NEG_ZERO, QNAN, FpAdd, FpLdexp, FpMul, _lzc, _Pipe, _round_pack
from .l2 import LANES

__all__ = ["Flow", "SegmentPoly", "Shared", "with_shared",
           "Recip", "FlowUnit", "SfuOp", "SHORT_OPS", "op_of", "command_layout", "data_layout",
           "result_layout", "Sfu",
           "recip_flow", "sqrt_flow", "exp_flow", "tanh_flow", "trig_flow", "gelu_flow"]


def _f32_bits(x) -> int:
    return int(np.asarray(x, np.float32).view(np.uint32))


ONE = _f32_bits(1.0)
INF = 0x7F800000
NEG_INF = 0xFF800000


class Flow:
    """Schedules operations on ``(value, time)`` nodes inside module `m`; every register is gated by `en`.

    With ``dry=True`` the graph is only laid out (to learn its latency): the units it creates are
    silenced, because that module is never elaborated."""

    def __init__(self, m: Module, en: Value, prefix: str = "f", dry: bool = False):
        self.m, self.en, self.prefix, self.dry = m, en, prefix, dry
        self._n = 0
        self._delays = {}
        self._serving = None

    def _name(self, what):
        self._n += 1
        return f"{self.prefix}{self._n}_{what}"

    def sub(self, what, elaboratable):
        if self.dry:
            elaboratable._MustUse__silence = True
        self.m.submodules[self._name(what)] = elaboratable
        return elaboratable

    #: A data delay of at least RING_STAGES enabled cycles and RING_BITS bits goes into a block-RAM ring
    #: (`_ring`) instead of a register chain (which synthesis maps to SRLC32E shift registers, one LUT per
    #: 32 stages of one bit): kv260's SFU has 25 such delays of 6 to 32 bits over 49 to 206 cycles.
    RING_STAGES = 48
    RING_BITS = 6
    RING_DEPTH = 512                 # one RAMB18E2 (512 x 36); longer than any SFU delay

    def delay(self, node, t: int, *, valid: bool = False, flop: bool = True):
        """`node` delayed until time `t` (gated by en; shared between users: each delay starts from the
        longest tap of the same value already built below `t`).

        Data delay lines are reset-less, so synthesis maps them to shift registers (SRL16E/SRLC32E hold
        no reset), or, when long and wide enough, to a block-RAM ring; a ``valid=True`` line (a flag that
        reset must clear) keeps its reset and stays in registers. A delayed data value is read from a
        register of its own beside the line (``flop``; one with a reset, which synthesis cannot fold into
        the shift register), so that the logic reading it starts from a flip-flop, not from an SRL's or a
        ring's slow output; ``flop=False`` (operands that go straight into registers) reads the line."""
        v, t0 = node
        if isinstance(v, Const):
            return v
        if t < t0:
            raise ValueError(f"cannot move a value from time {t0} back to {t}")
        d = t - t0
        if valid or not flop or d == 0:
            return self._line(v, t0, d, valid)
        flops = self._delays.setdefault((id(v), t0, "flop"), {})
        if d not in flops:
            line = self._line(v, t0, d - 1, False)
            r = Signal(Value.cast(v).shape(), name=self._name("q"))
            with self.m.If(self.en):
                self.m.d.sync += r.eq(line)
            flops[d] = r
        return flops[d]

    def _line(self, v, t0: int, d: int, valid: bool):
        """The tap `d` of `v`'s delay line (`delay`)."""
        taps = self._delays.setdefault((id(v), t0, valid), {0: v})
        if d in taps:
            return taps[d]
        j = max(k for k in taps if k < d)
        shape = Value.cast(v).shape()
        if not valid and d - j >= self.RING_STAGES and shape.width >= self.RING_BITS:
            taps[d] = self._ring(taps[j], d - j, shape)
            return taps[d]
        for k in range(j + 1, d + 1):
            r = Signal(shape, name=self._name("v" if valid else "d"), reset_less=not valid)
            with self.m.If(self.en):
                self.m.d.sync += r.eq(taps[k - 1])
            taps[k] = r
        return taps[d]

    def _ring(self, x, stages: int, shape):
        """`x` delayed by `stages` enabled cycles in a block-RAM ring: written at the Flow's write pointer
        every enabled cycle, read `stages - 1` entries behind it into the read port's register."""
        assert 2 <= stages <= self.RING_DEPTH
        m = self.m
        if getattr(self, "_wp", None) is None:
            self._wp = Signal(range(self.RING_DEPTH), name=f"{self.prefix}_ring_wp")
            with m.If(self.en):
                m.d.sync += self._wp.eq(self._wp + 1)
        mem = self.sub("ring", memory.Memory(shape=shape.width, depth=self.RING_DEPTH, init=[],
                                             attrs={"ram_style": "block"}))
        wr, rd = mem.write_port(), mem.read_port(domain="sync", transparent_for=())
        lag = (self._wp - (stages - 1))[:len(self._wp)]
        m.d.comb += [wr.en.eq(self.en), wr.addr.eq(self._wp), wr.data.eq(x),
                     rd.en.eq(self.en), rd.addr.eq(lag)]
        y = Signal(shape, name=self._name("ring"))
        m.d.comb += y.eq(rd.data)
        return y

    def align(self, *nodes, flop: bool = True):
        t = max(n[1] for n in nodes)
        return [self.delay(n, t, flop=flop) for n in nodes], t

    def comb(self, fn, *nodes, register=True):
        """Apply the combinational function `fn` to the aligned operands (then one register). The register
        keeps a reset, so that synthesis cannot fold it into a delay line behind it: the step ends at a
        flip-flop (and a product's register stays beside its DSP48E2, not in an SRL)."""
        vals, t = self.align(*nodes)
        v = Value.cast(fn(*vals))
        if not register:
            return v, t
        r = Signal(v.shape(), name=self._name("c"))
        with self.m.If(self.en):
            self.m.d.sync += r.eq(v)
        return r, t + 1

    #: cycles an arithmetic unit's operands wait in registers of their own before the unit
    OPERAND_STAGE = 1

    @classmethod
    def unit_latency(cls, unit) -> int:
        """Cycles from a `_unit`'s aligned operands to its result: the operand registers, then `unit`'s
        ``LATENCY`` (FpAdd, FpMul, FpLdexp)."""
        return cls.OPERAND_STAGE + unit.LATENCY

    def _unit(self, unit, a, b):
        """`unit` (FpAdd, FpMul, FpLdexp) on the aligned operands, through one register each. The operand
        registers keep a reset so that synthesis cannot fold them into a delay line's shift register: the
        unit's first stage then starts from a flip-flop, not from an SRL's slow output or an operand select."""
        m = self.m
        self.sub(type(unit).__name__.lower(), unit)
        (va, vb), t = self.align(a, b, flop=False)
        ra = Signal.like(va, name=self._name("opa"), reset_less=False)
        rb = Signal.like(vb, name=self._name("opb"), reset_less=False)
        with m.If(self.en):
            m.d.sync += [ra.eq(va), rb.eq(vb)]
        m.d.comb += [unit.en.eq(self.en), unit.i_valid.eq(1), unit.i_a.eq(ra), unit.i_b.eq(rb)]
        self.operands = (ra, rb)             # the last unit's operand registers (`_short_tail` reads A1's)
        return unit.o_y, t + self.unit_latency(unit)

    def _shared(self, kind, share, a, b):
        """Inside `Shared.serving`: the request of a `share`-tagged operation (None outside)."""
        if share is None or self._serving is None:
            return None
        shared, when = self._serving
        return shared.unit(kind, share).request([a, b], when)

    def add(self, a, b, share=None):
        """a + b; `share`: a tag for `Shared` (outside `Shared.serving` it changes nothing)."""
        return self._shared("add", share, a, b) or self._unit(FpAdd(), a, b)

    def sub_(self, a, b, share=None):
        """a - b as a + (-b) (IEEE subtraction)."""
        return self.add(a, self.comb(_neg, b, register=False), share)

    def mul(self, a, b, share=None):
        return self._shared("mul", share, a, b) or self._unit(FpMul(), a, b)

    def ldexp(self, a, k, share=None):
        """a * 2**k (`FpLdexp(10)`)."""
        return self._shared("ldexp", share, a, k) or self._unit(FpLdexp(10), a, k)

    def rom(self, words, width, addr, *, registered: bool = True):
        """``words[addr]`` from a ROM: address at time T, data at T + 1; ``registered=False``: an asynchronous
        read (a LUT ROM), data at T, for a register behind it that is not the Flow's (a DSP48E2's B)."""
        rom = self.sub("rom", memory.Memory(shape=width, depth=len(words), init=[int(w) for w in words]))
        v, t = addr
        if not registered:
            port = rom.read_port(domain="comb")
            self.m.d.comb += port.addr.eq(v)
            return port.data, t
        port = rom.read_port(domain="sync")
        self.m.d.comb += [port.en.eq(self.en), port.addr.eq(v)]
        return port.data, t + 1

    def dsp_mul(self, a, b):
        """The unsigned product ``a * b`` (at most 26 x 17 bits) in one DSP48E2 with its input, M and P registers
        (`hdl.dsp.DspMacc`, restarting every product; its clock enables are `en`): the operands at time T go
        straight into the slice's A/B registers, the product is at T + ``DspMacc.LATENCY``. Yosys maps a
        product written as RTL to a DSP48E2 without packing the registers around it: the slice would then be
        combinational (2.4 ns) between fabric registers."""
        (va, vb), t = self.align(a, b, flop=False)
        wa, wb = len(Value.cast(va)), len(Value.cast(vb))
        dsp = self.sub("dsp", DspMacc(wa + 1, wb + 1, ce=True))
        self.m.d.comb += [dsp.i_a.eq(va), dsp.i_b.eq(vb), dsp.i_ce.eq(self.en), dsp.i_restart.eq(1)]
        return dsp.o_p[:wa + wb], t + DspMacc.LATENCY

    def poly(self, table, index, t):
        """`SegmentPoly` on ``table[index]`` at ``t`` (inside `Shared.serving`: the shared evaluator)."""
        if self._serving is not None:
            shared, when = self._serving
            return shared.unit("poly").request([index, t], when, np.asarray(table))
        poly = self.sub("poly", SegmentPoly(table))
        (vi, vt), t0 = self.align(index, t)
        self.m.d.comb += [poly.en.eq(self.en), poly.i_valid.eq(1), poly.i_index.eq(vi), poly.i_t.eq(vt)]
        return poly.o_y, t0 + poly.latency

    def to_fp(self, mag, msb_exp: int):
        """Unsigned integer `mag` to binary32 (RNE) where its MSB has weight ``2**msb_exp``; 5 stages:
        `_Pipe.normalize_round`'s with its leading- and trailing-zero counts in two (each 8-bit group's
        counts and zero flag, then the group's), so that no stage holds a whole 64-bit count, and its
        normalising shift in two (by whole bytes, then by the rest)."""
        (v,), t = self.align(mag)
        m = self.m
        p = _Pipe(m, self.en, Const(1))
        w = max(len(v), 26)
        mant = Cat(Const(0, w - len(v)), v) if len(v) < w else v
        groups = -(-w // 8)
        assert groups <= 8, "a group index of 3 bits"
        wide = Cat(mant, Const(0, 8 * groups - w))            # zeros above the MSB: the trailing count is kept
        lead_pad = Cat(Const(0, 8 * groups - w), mant)        # zeros below the LSB: the leading count is kept
        g_lz = [_lzc(lead_pad[8 * g:8 * (g + 1)])[0][:3] for g in range(groups)]
        g_tz = [_lzc(wide[8 * g:8 * (g + 1)][::-1])[0][:3] for g in range(groups)]
        s = p.stage(mant=mant, nz_l=Cat(*[lead_pad[8 * g:8 * (g + 1)].any() for g in range(groups)]),
                    nz_t=Cat(*[wide[8 * g:8 * (g + 1)].any() for g in range(groups)]),
                    lz=Cat(*g_lz), tz=Cat(*g_tz))
        # the counts: the highest (lowest) non-zero group's index and its own count
        lz, tz = Signal(range(8 * groups + 1)), Signal(range(8 * groups + 1))
        lz_v, tz_v = Const(8 * groups, len(lz)), Const(8 * groups, len(tz))
        for g in range(groups):                             # the last assignment (the highest group) wins
            lz_v = Mux(s["nz_l"][g], Cat(s["lz"][3 * g:3 * g + 3], Const(groups - 1 - g, 3)), lz_v)
        for g in reversed(range(groups)):                   # the lowest group wins
            tz_v = Mux(s["nz_t"][g], Cat(s["tz"][3 * g:3 * g + 3], Const(g, 3)), tz_v)
        zero = ~s["nz_l"].any()
        m.d.comb += [lz.eq(lz_v), tz.eq(tz_v)]
        # as `_Pipe.normalize_round` from here: the left shift clamped so the exponent stays >= 1
        exp = 127 + msb_exp
        d = exp - 1
        lz_w = Mux(zero, w, lz)
        left = Signal(range(w + 1))
        m.d.comb += left.eq(0 if d < 0 else Mux(lz_w < d, lz_w, d))
        s = p.stage(mant=s["mant"], zero=zero, left=left, tz=tz)
        # the shift in two stages: by the multiple of 8, then by the rest (with the exponent and the sticky bit)
        coarse = Signal(w)
        be = Signal(signed(14))
        m.d.comb += [coarse.eq((s["mant"] << Cat(Const(0, 3), s["left"][3:]))[:w]), be.eq(exp - s["left"])]
        s = p.stage(coarse=coarse, fine=s["left"][:3], sticky=~s["zero"] & (s["tz"] + s["left"] < w - 25),
                    bem1=(be - 1)[:8], big=be > 254, zero=s["zero"])
        shifted = Signal(w)
        m.d.comb += shifted.eq((s["coarse"] << s["fine"])[:w])
        s = p.stage(sign=Const(0, 1), sig=shifted[w - 24:], rnd=shifted[w - 25], sticky=s["sticky"],
                    bem1=s["bem1"], big=s["big"], zero=s["zero"], nan=Const(0, 1), inf=Const(0, 1))
        y = p.stage(y=_round_pack(m, s, big=s["big"]))["y"]
        return y, t + p.stages

    @staticmethod
    def const(value, width=32):
        return Const(int(value), width), 0


def _neg(v):
    return Cat(v[:31], ~v[31])


def _gt(a, b):
    """a > b for non-NaN binary32 (±0 equal), from the sign bits and one magnitude comparison each way
    (no two's-complement order keys: those cost two 31-bit negations more)."""
    ma, mb, sa = a[:31], b[:31], a[31]
    return Mux(sa == b[31], Mux(sa, mb > ma, ma > mb), ~sa & (ma | mb).any())


def _is_nan(v):
    return v[:31] > INF


def _fmax(a, b):
    """``np.maximum`` on binary32: NaN if either is NaN; on equality (±0 too) `b`."""
    return Mux(_is_nan(a) | _is_nan(b), QNAN, Mux(_gt(a, b), a, b))


def _fmin(a, b):
    """``np.minimum`` (the `b` operand on equality)."""
    return Mux(_is_nan(a) | _is_nan(b), QNAN, Mux(_gt(b, a), a, b))


def _relu(v):
    """``np.maximum(v, +0)`` (`_fmax` against zero): NaN -> QNAN, anything with the sign bit set (-0 too)
    -> +0, else v."""
    return Mux(_is_nan(v), QNAN, Mux(v[31], 0, v))


class SegmentPoly(wiring.Component):
    """``((c3*t + c2)*t + c1)*t + c0`` with ``c = table[i_index]`` (binary32 RNE, `sim.sfu.horner`).

    Parameters
    ----------
    table : float32 array (segments, 4) from `hdl.sfu_tables.table`.

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

    # the ROM read, then three multiply-adds (each unit behind its operand registers: `Flow.unit_latency`)
    LATENCY = 1 + 3 * (Flow.unit_latency(FpMul) + Flow.unit_latency(FpAdd))

    @property
    def latency(self) -> int:
        return self.LATENCY

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
        m.d.comb += [self.o_y.eq(h[0]), self.o_valid.eq(f.delay((self.i_valid, 0), h[1], valid=True))]
        return m


class _Shared:
    """One unit serving several requests that never run on the same element. Every request's operands wait
    until the common start time (the latest request's), every request gets the same output node at
    ``start + latency``, and the unit's operands are picked per element by the requests' 1-bit `when`
    nodes (the first request is the default: its `when` is not read).

    ``start=None`` (a learning layout): each request is answered as if it had the unit to itself; in a dry
    layout a request later than `start` is answered the same way. `learnt` is the latest request time;
    `with_shared` repeats dry layouts until the starts settle."""

    def __init__(self, f: Flow, start: int | None, latency: int, build):
        self.f, self._start, self.latency, self._build = f, start, latency, build
        self._requests = []            # (operand nodes, when node, table or None)
        self._out = None

    @property
    def learnt(self) -> int:
        return max(max(n[1] for n in r[0]) for r in self._requests)

    def request(self, nodes, when, table=None):
        self._requests.append((nodes, when, table))
        t_in = max(n[1] for n in nodes)
        if self._start is None or self.f.dry and t_in > self._start:
            return Signal(32, name=self.f._name("sh")), t_in + self.latency
        if t_in > self._start:
            raise ValueError(f"shared unit: a request at time {t_in} comes after the start {self._start} "
                             f"learnt from the dry layouts")
        if self._out is None:
            self._out = Signal(32, name=self.f._name("sh"))
        return self._out, self._start + self.latency

    def pick(self, operand_nodes, flop=True):
        """The per-element choice among the requests' `operand_nodes` (one node per request), at `start`
        (`flop`: as `Flow.delay`'s)."""
        whens = [r[1] for r in self._requests[1:]]

        def choose(*vals):
            ws, vs = vals[:len(whens)], vals[len(whens):]
            y = vs[0]
            for w, v in zip(ws, vs[1:]):
                y = Mux(w, v, y)
            return y

        v = self.f.comb(choose, *whens, *operand_nodes, register=False)
        return self.f.delay(v, self._start, flop=flop), self._start

    def finish(self):
        y, t = self._build(self)
        assert t == self._start + self.latency
        if self._out is not None:
            self.f.m.d.comb += self._out.eq(y)


def _build_poly(u):
    """`SegmentPoly` on the concatenated tables, each request's index offset by its table's base row."""
    f = u.f
    table = np.concatenate([r[2] for r in u._requests])
    bits = max(1, (len(table) - 1).bit_length())
    bases = np.cumsum([0] + [len(r[2]) for r in u._requests])[:-1]
    index = u.pick([f.comb(lambda i, b=int(b): (i + b)[:bits], r[0][0], register=False)
                    for b, r in zip(bases, u._requests)])
    return f.poly(table, index, u.pick([r[0][1] for r in u._requests]))


def _build_binary(kind):
    return lambda u: getattr(u.f, kind)(u.pick([r[0][0] for r in u._requests], flop=False),
                                        u.pick([r[0][1] for r in u._requests], flop=False))


class Shared:
    """The shared units of one graph, made on first request: one `SegmentPoly` (``"poly"``; its requests'
    tables are concatenated into one ROM, each at its own base row) and one `FpAdd`/`FpMul`/`FpLdexp` per
    tag. Inside ``with shared.serving(when):`` every `Flow.poly` call, and every ``Flow.add/sub_/mul/ldexp``
    call given a ``share`` tag, is a request selected by the 1-bit node `when` (None: the default);
    ``shared.binary(kind, tag, a, b, when)`` requests an ``"add"``/``"mul"``/``"ldexp"`` unit directly."""

    _LATENCY = {"poly": SegmentPoly.LATENCY, "add": Flow.unit_latency(FpAdd), "mul": Flow.unit_latency(FpMul),
                "ldexp": Flow.unit_latency(FpLdexp)}

    def __init__(self, f: Flow, starts: dict | None = None):
        self.f, self._starts, self.units = f, starts or {}, {}

    def unit(self, kind, tag=""):
        key = (kind, tag)
        if key not in self.units:
            build = _build_poly if kind == "poly" else _build_binary(kind)
            self.units[key] = _Shared(self.f, self._starts.get(key), self._LATENCY[kind], build)
        return self.units[key]

    @contextlib.contextmanager
    def serving(self, when):
        self.f._serving = (self, when)
        try:
            yield
        finally:
            self.f._serving = None

    def binary(self, kind, tag, a, b, when=None):
        return self.unit(kind, tag).request([a, b], when)

    @property
    def learnt(self) -> dict:
        return {k: u.learnt for k, u in self.units.items()}

    def finish(self):
        for u in self.units.values():
            u.finish()


def with_shared(f: Flow, graph):
    """``graph(f, shared) -> result`` laid out on `f` with one `Shared` set of units. Dry layouts first
    learn each unit's start (the latest request's time; a request may depend on another shared unit's
    output, so they repeat until the starts settle), then the graph is laid out for real."""
    starts = None
    for _ in range(16):
        m = Module()
        m._MustUse__silence = True
        probe = Shared(Flow(m, Const(1), dry=True), starts)
        graph(probe.f, probe)
        learnt = {k: max(v, (starts or {}).get(k, v)) for k, v in probe.learnt.items()}
        if learnt == starts:
            break
        starts = learnt
    else:
        raise RuntimeError("shared unit start times did not settle")
    shared = Shared(f, starts)
    y = graph(f, shared)
    shared.finish()
    return y


# --- function builders (each is the sim.sfu function of the same name, scheduled) ------------------------

def _logseg(f, z, e_lo: int, j_bits: int, binades: int, share=None):
    """`sim.sfu.logseg_index` of a positive binary32 node `z`: (index, exact t = z - segment start)."""
    low = 23 - j_bits
    eb = max(1, (binades - 1).bit_length())
    # registered (at no latency: the index waits for t): its subtraction does not run into a delay line
    index = f.comb(lambda v: Cat(v[low:23], (v[23:31] - (127 + e_lo))[:eb]), z)
    start = f.comb(lambda v: Cat(Const(0, low), v[low:31], Const(1, 1)), z, register=False)   # -start
    return index, f.add(z, start, share)


def _normalise(f, mag):
    """|x| (31-bit node) as m * 2**e: returns (a2 = |x| with subnormals scaled by 2**24, e signed). `e` is
    registered (a cycle after `a2`; its users need it after the evaluator): its subtraction does not run from
    the ldexp's output into a delay line."""
    sub = f.comb(lambda v: v[23:31] == 0, mag, register=False)
    a2 = f.ldexp(f.comb(lambda v: v[:31], mag, register=False), f.comb(lambda s: Mux(s, 24, 0), sub, register=False))
    e = f.comb(lambda b, s: Cat(b[23:31], Const(0, 2)).as_signed() - 127 - Mux(s, 24, 0), a2, sub)
    return a2, e


def recip_flow(f, x):
    """`sim.sfu.recip`."""
    e_lo, _, j_bits = sfu_tables.RECIP_GEOM
    a2, e = _normalise(f, x)
    mant = f.comb(lambda b: Cat(b[:23], Const(127, 8)), a2, register=False)
    index, t = _logseg(f, mant, e_lo, j_bits, 1)
    p = f.poly(sfu_tables.table("recip"), index, t)
    y = f.ldexp(p, f.comb(lambda v: -v, e, register=False))
    # the special cases' compares registered at the input (they wait for the result in the delay line)
    flags = f.comb(lambda v: Cat(v[23:31] == 0xFF, v[:23] != 0, v[:31] == 0), x)

    def special(v, fl, yy):
        return Mux(fl[0], Mux(fl[1], QNAN, Cat(Const(0, 31), v[31])),
                   Mux(fl[2], Cat(Const(INF, 31), v[31]), Cat(yy[:31], v[31])))

    return f.comb(special, x, flags, y)


def sqrt_flow(f, x, rs):
    """`sim.sfu.sqrt` (``rs`` = 0) or `sim.sfu.rsqrt` (``rs`` = 1): one evaluator, both tables."""
    e_lo, binades, j_bits = sfu_tables.SQRT_GEOM
    a2, e = _normalise(f, x)
    # m * 2**(e&1), with e's parity from a2 alone (the bias 127 and the subnormal scale 24: e is odd where a2's
    # exponent field is even)
    z = f.comb(lambda b: Cat(b[:23], Mux(b[23], 127, 128)), a2, register=False)
    index, t = _logseg(f, z, e_lo, j_bits, binades, "t")
    rows = len(sfu_tables.table("sqrt"))
    table = np.concatenate([sfu_tables.table("sqrt"), sfu_tables.table("rsqrt")])
    index2 = f.comb(lambda i, r: Cat(i, r), index, rs, register=False)
    assert rows == 1 << len(index[0])
    p = f.poly(table, index2, t)
    y = f.ldexp(p, f.comb(lambda ee, r: Mux(r, -(ee >> 1), ee >> 1), e, rs, register=False), "scale")

    # the special cases' compares registered at the input (they wait for the result in the delay line)
    flags = f.comb(lambda v: Cat(v[:31] == 0, _is_nan(v) | (v[31] & (v[:31] != 0)), v == INF), x)

    def special(v, fl, yy, r):
        zero, nan, pinf = fl[0], fl[1], fl[2]
        sq = Mux(zero | pinf, v, yy)
        rsq = Mux(zero, Cat(Const(INF, 31), v[31]), Mux(pinf, 0, yy))
        return Mux(nan, QNAN, Mux(r, rsq, sq))

    return f.comb(special, x, flags, y, rs)


def exp_flow(f, x):
    """`sim.sfu.exp` (Cody-Waite)."""
    lo, hi = (_f32_bits(v) for v in sfu_tables.EXP_CLAMP)
    xc = f.comb(lambda v: Mux(_gt(Const(lo, 32), v), lo, Mux(_gt(v, Const(hi, 32)), hi, v)), x)
    magic = _f32_bits(sfu_tables.EXP_MAGIC)
    tm = f.add(f.mul(xc, f.const(_f32_bits(sfu_tables.EXP_INV)), "m"), f.const(magic))
    n = f.comb(lambda v: (v.as_signed() - magic)[:16].as_signed(), tm, register=False)
    nf = f.add(tm, f.const(_f32_bits(-sfu_tables.EXP_MAGIC)))
    r1 = f.sub_(xc, f.mul(nf, f.const(_f32_bits(sfu_tables.EXP_L_HI))))
    r = f.sub_(r1, f.mul(nf, f.const(_f32_bits(sfu_tables.EXP_L_LO))), "t")
    index = f.comb(lambda v: v[:5], n, register=False)
    p = f.poly(sfu_tables.table("exp"), index, r)
    y = f.ldexp(p, f.comb(lambda v: v >> 5, n, register=False), "scale")
    return f.comb(lambda v, yy: Mux(_is_nan(v), QNAN, yy), x, y)


def tanh_flow(f, x):
    """`sim.sfu.tanh`."""
    e_lo, binades, j_bits = sfu_tables.TANH_GEOM
    lo, hi = _f32_bits(sfu_tables.TANH_LO), _f32_bits(sfu_tables.TANH_HI)
    a = f.comb(lambda v: v[:31], x, register=False)
    inside = f.comb(lambda v: (v >= lo) & (v < hi), a, register=False)
    z = f.comb(lambda v, i: Mux(i, v, lo), a, inside)
    index, t = _logseg(f, z, e_lo, j_bits, binades, "t")
    p = f.poly(sfu_tables.table("tanh"), index, t)

    def out(v, i, pp):
        pm = _fmin(pp, Const(ONE, 32))
        y = Mux(v[:31] < lo, v[:31], Mux(i, pm, ONE))
        return Mux(_is_nan(v), QNAN, Cat(y[:31], v[31]))

    return f.comb(out, x, inside, p)


def sin_turns_flow(f, turn):
    """`sim.sfu.sin_turns` of a u0.64 turn node."""
    e_lo, binades, j_bits = sfu_tables.SIN_GEOM
    lo = _f32_bits(sfu_tables.SIN_LO)
    g = f.comb(lambda t: Mux(t[62], (1 << 62) - t[:62], t[:62])[:63], turn)
    z = f.to_fp(g, 0)
    inside = f.comb(lambda v: (v >= lo) & (v < ONE), z, register=False)
    zz = f.comb(lambda v, i: Mux(i, v, lo), z, inside)
    index, t = _logseg(f, zz, e_lo, j_bits, binades, "t")
    p = f.poly(sfu_tables.table("sin"), index, t)
    small = f.mul(z, f.const(_f32_bits(sfu_tables.HALF_PI)), "m")
    q1 = f.comb(lambda t: t[63], turn, register=False)

    def out(v, i, pp, sm, neg):
        y = Mux(v >= ONE, ONE, Mux(i, pp, sm))
        return Cat(y[:31], y[31] ^ neg)

    return f.comb(out, z, inside, p, small, q1)


def _payne_hanek(f, a):
    """u0.64 turns of a positive finite binary32 node `a` (`sim.sfu._turns_of`)."""
    windows = [sfu_tables.payne_hanek_window(max(e, 1) - 150) for e in range(256)]
    # the window read asynchronously (a LUT ROM) into the DSP48E2s' B registers, which stand for the ROM's
    # read register
    w = f.rom(windows, sfu_tables.PH_WINDOW, f.comb(lambda v: v[23:31], a, register=False), registered=False)
    mant = f.comb(lambda v: Cat(v[:23], v[23:31] != 0), a, register=False)
    # 24 x 12-bit products (`Flow.dsp_mul`: one DSP48E2 each with its A/B, M and P registers), then each
    # 24-bit window's product as the sum of its two halves
    halves = [f.dsp_mul(mant, f.comb(lambda ww, k=k: ww[12 * k:12 * (k + 1)], w, register=False))
              for k in range(8)]
    parts = [f.comb(lambda h0, h1: h0 + (h1 << 12), halves[2 * k], halves[2 * k + 1]) for k in range(4)]
    lo = f.comb(lambda p0, p1: p0 + (p1 << 24), parts[0], parts[1])
    hi = f.comb(lambda p2, p3: p2 + (p3 << 24), parts[2], parts[3])
    shift = 24 + sfu_tables.PH_GUARD
    return f.comb(lambda l, h: (l + (h << 48))[shift:shift + 64], lo, hi)


def _rope_turns(f, hi, lo, pos):
    """``((hi << 32 | lo) * pos) mod 2**64`` (`sim.sfu.rope_turns`): the 16 x 16-bit products of the
    frequency's and the position's 16-bit chunks below 2**64 (`Flow.dsp_mul`: one DSP48E2 each with its A/B,
    M and P registers), then summed in two stages: the low and high 32-bit halves' terms, then the two."""
    def chunk(v, i):
        return v[16 * i:16 * (i + 1)]

    q = {(i, j): f.dsp_mul(f.comb(lambda a, i=i: chunk(a, i % 2), lo if i < 2 else hi, register=False),
                           f.comb(lambda b, j=j: chunk(b, j), pos, register=False))
         for i in range(4) for j in range(2) if i + j <= 3}
    low = f.comb(lambda p00, p01, p10: p00 + (p01 << 16) + (p10 << 16), q[0, 0], q[0, 1], q[1, 0])
    high = f.comb(lambda p11, p20, p21, p30: (p11 + p20 + (p21 << 16) + (p30 << 16))[:32],
                  q[1, 1], q[2, 0], q[2, 1], q[3, 0])
    return f.comb(lambda l, h: (l + Cat(Const(0, 32), h))[:64], low, high)


def trig_flow(f, x, hi, lo, pos, rope, cosine):
    """`sim.sfu.sin`/`cos` of binary32 radians `x` (``rope`` = 0), or `rope_sin`/`rope_cos` of the u0.64
    frequency ``hi:lo`` at position `pos` (``rope`` = 1); ``cosine`` picks cos."""
    small_lo = _f32_bits(sfu_tables.SINCOS_LO)
    big = f.comb(lambda v: (v[:31] < INF) & (v[:31] >= small_lo), x, register=False)
    aa = f.comb(lambda v, b: Mux(b, v[:31], ONE), x, big)
    ph = _payne_hanek(f, aa)
    rt = _rope_turns(f, hi, lo, pos)

    def turn(p, r, v, rp, c):
        t = Mux(rp, r, Mux(v[31] & ~c, (-p)[:64], p))
        return (t + Mux(c, 1 << 62, 0))[:64]

    t = f.comb(turn, ph, rt, x, rope, cosine)
    y = sin_turns_flow(f, t)

    def out(v, yy, rp, c):
        small = Mux(c, ONE, v)
        r = Mux(v[:31] < small_lo, small, yy)
        return Mux(rp, yy, Mux(v[:31] >= INF, QNAN, r))

    return f.comb(out, x, y, rope, cosine)


GELU_K0, GELU_K1 = _f32_bits(sfu_tables.GELU_K0), _f32_bits(sfu_tables.GELU_K1)


def gelu_flow(f, x, xx=None):
    """`sim.sfu.gelu_tanh` (`xx`: an already computed x*x node, shared with the caller's multiplier)."""
    xx = f.mul(x, x) if xx is None else xx
    v = f.mul(f.add(f.mul(f.const(GELU_K1), xx), f.const(GELU_K0)), x)
    return _gelu_tail(f, x, f.add(exp_flow(f, v), f.const(ONE)), recip_flow)


def _gelu_tail(f, x, e1, recip):
    y = f.mul(x, recip(f, e1))
    return f.comb(lambda v, yy: Mux(_is_nan(v), QNAN, Mux(v == NEG_INF, NEG_ZERO, yy)), x, y)


class FlowUnit(wiring.Component):
    """One builder as a pipeline for unit tests: ``build(flow, a_node, b_node) -> node``; ports ``en``,
    ``i_valid``, ``i_a``, ``i_b``, ``o_valid``, ``o_y``; `latency` from a dry layout."""

    def __init__(self, build):
        self._build = build
        super().__init__({"en": In(1), "i_valid": In(1), "i_a": In(32), "i_b": In(32),
                          "o_valid": Out(1), "o_y": Out(32)})
        m = Module()
        m._MustUse__silence = True
        self._latency = build(Flow(m, Const(1), dry=True), (Signal(32), 0), (Signal(32), 0))[1]

    @property
    def latency(self) -> int:
        return self._latency

    def elaborate(self, platform):
        m = Module()
        f = Flow(m, self.en, "u")
        y = self._build(f, (self.i_a, 0), (self.i_b, 0))
        assert y[1] == self.latency
        m.d.comb += [self.o_y.eq(y[0]), self.o_valid.eq(f.delay((self.i_valid, 0), y[1], valid=True))]
        return m


class Recip(FlowUnit):
    """``sim.sfu.recip`` as a pipeline: ``en``, ``i_valid``, ``i_a`` -> ``o_valid``, ``o_y``."""

    def __init__(self):
        super().__init__(lambda f, a, b: recip_flow(f, a))


# --- the stream SFU -----------------------------------------------------------------------------------------

_VEC_BASE = 16
# VEC functions the controller sequences from SFU operations instead of running them in one pass
_SEQUENCED = ("ROPE", "RMSNORM", "RMSNORM_NG")

# SFU operations, derived from the ISA so they cannot drift from it: CVO functions keep their `CvoFunc`
# value, the VEC functions the SFU runs in one pass are 16 + their `VecFunc` value (`op_of`); the values
# stay below 64, so the shape is unsigned(6).
SfuOp = enum.Enum("SfuOp", {**{f.name: f.value for f in CvoFunc},
                            **{f.name: _VEC_BASE + f.value for f in VecFunc if f.name not in _SEQUENCED},
                            "MULS_MUL": 48})
SfuOp.__doc__ = ("SFU operations: CvoFunc values, and 16 + VecFunc value for the one-pass VEC functions "
                 "(the segmented VEC ROPE/RMSNORM and ATTN are sequenced by the controller from these); "
                 "MULS_MUL = (a * s) * b, two roundings, the controller's RMSNORM scale-and-gain pass.")
REDUCE_OPS = (SfuOp.REDUCE_SUM, SfuOp.REDUCE_MAX, SfuOp.SUMSQ, SfuOp.SUM, SfuOp.MAX, SfuOp.DOT)
MAX_OPS = (SfuOp.REDUCE_MAX, SfuOp.MAX)
# CVO functions whose input may have the running max subtracted (sub_emax) and the result accumulated (accm)
# Operations on the short path (M1, A1, a select: `Sfu.short_latency` stages instead of `Sfu.latency`)
SHORT_OPS = (SfuOp.ADD, SfuOp.SUB, SfuOp.MUL, SfuOp.MULS, SfuOp.ADDS, SfuOp.FMAS, SfuOp.COPY, SfuOp.RELU_SUBS,
             SfuOp.MULS_MUL) + REDUCE_OPS
CVO_ELEMENTWISE = tuple(op for op in SfuOp if op.value < _VEC_BASE and op not in REDUCE_OPS
                        and op not in (SfuOp.ROPE_COS, SfuOp.ROPE_SIN))


def op_of(func) -> SfuOp:
    """The `SfuOp` of an ISA `CvoFunc` or `VecFunc` (not VEC ROPE/RMSNORM/RMSNORM_NG: the controller
    sequences those)."""
    if isinstance(func, CvoFunc):
        return SfuOp(func.value)
    if isinstance(func, VecFunc):
        try:
            return SfuOp(_VEC_BASE + func.value)
        except ValueError:
            pass
    raise ValueError(f"{func!r} is not an SFU operation; expected a CvoFunc or one of the VecFuncs "
                     f"{', '.join(op.name for op in SfuOp if op.value >= _VEC_BASE)}")


def command_layout(hw) -> data.StructLayout:
    """One SFU command: `op`, `length` (elements; >= 1), the flags, and the scalars: `s` (MULS/ADDS/FMAS/
    RELU_SUBS/SCALE scalar, the SOFTCAP cap c), `s_inv` (= ``sim.sfu.recip(s)``, for SCALE with
    `recip_scale` and SOFTCAP), `emax` (subtracted with `sub_emax`), `pos` (RoPE position)."""
    return data.StructLayout({
        "op": SfuOp, "length": unsigned((hw.l2_bytes // 4).bit_length()),
        "sub_emax": 1, "recip_scale": 1, "accm": 1,
        "s": 32, "s_inv": 32, "emax": 32, "pos": 32})


def data_layout() -> data.StructLayout:
    """An input beat: ``{a, b}`` operands in `LANES` lanes, ``n`` (1..4) of them used."""
    return data.StructLayout({"a": data.ArrayLayout(32, LANES), "b": data.ArrayLayout(32, LANES), "n": 3})


def result_layout() -> data.StructLayout:
    """An output beat: results ``y`` in `LANES` lanes, ``n`` (1..4) of them used."""
    return data.StructLayout({"y": data.ArrayLayout(32, LANES), "n": 3})


def _is(op, *ops):
    return Cat(*[op == o.value for o in ops]).any()


def _datapath(f, *nodes, port=None):
    """The element-wise graph of every operation; returns (result node of the long path, result node of
    the short path: `SHORT_OPS` take that one); `port`: lane 0's `_RedPort`."""
    return with_shared(f, lambda f, shared: _datapath_graph(f, shared, *nodes, port=port))


def _datapath_graph(f, shared, a, b, op, s, s_inv, emax, pos, sub_emax, recip_scale, accm, port=None):
    """`_datapath` with the exp, tanh, sqrt/rsqrt and sin-turns builders served by `shared` (no op uses two
    of them): one evaluator for their four tables, one adder for their evaluator argument ``t`` (the
    segment offset; exp's ``r``), one ldexp for exp's and sqrt's final scaling, one multiplier for exp's
    ``x/ln2`` and sin's small-argument ``z·π/2``; one multiplier for GELU_MUL's ``·b`` and SOFTCAP's
    ``·c``; one adder for GELU's ``1 + e``. GELU's reciprocal keeps its own evaluator, so its exp -> recip chain
    runs at full rate. The short path's adder A1 (ADD/SUB/ADDS/FMAS/RELU_SUBS) is its own: the shared units
    start late, on the GELU path."""
    O = SfuOp
    family = lambda *ops: f.comb(lambda o: _is(o, *ops), op, register=False)
    sube = f.comb(lambda o, e: e & _is(o, *CVO_ELEMENTWISE), op, sub_emax, register=False)
    x = f.comb(lambda e, d, v: Mux(e, d, v), sube, f.sub_(a, emax), a)

    def m1b(o, r, vb, vs, vsi, vx):
        return Mux(_is(o, O.MUL, O.DOT), vb, Mux(_is(o, O.SUMSQ, O.GELU, O.GELU_MUL), vx,
                   Mux(_is(o, O.SOFTCAP) | (_is(o, O.SCALE) & r), vsi, vs)))

    m1 = f.mul(x, f.comb(m1b, op, recip_scale, b, s, s_inv, x, register=False))
    short = _short_tail(f, op, x, a, b, s, m1, port)
    gelu_op = f.comb(lambda o: _is(o, O.GELU, O.GELU_MUL), op, register=False)
    v = f.mul(f.add(f.mul(f.const(GELU_K1), m1), f.const(GELU_K0)), x)
    with shared.serving(None):                       # the default: EXP, GELU, GELU_MUL
        e = exp_flow(f, f.comb(lambda g, vv, xx: Mux(g, vv, xx), gelu_op, v, x))
    e1 = shared.binary("add", "e1", e, f.const(ONE), gelu_op)
    r = recip_flow(f, f.comb(lambda g, ee, xx: Mux(g, ee, xx), gelu_op, e1, x))
    g = f.mul(x, r)
    g = f.comb(lambda xx, yy: Mux(_is_nan(xx), QNAN, Mux(xx == NEG_INF, NEG_ZERO, yy)), x, g)
    gm = shared.binary("mul", "out", g, b)          # GELU_MUL's product, the default of the shared mul
    with shared.serving(family(O.TANH, O.SOFTCAP)):
        # the input select registered: tanh's range compares start from a flip-flop
        t = tanh_flow(f, f.comb(lambda o, p, xx: Mux(o == O.SOFTCAP.value, p, xx), op, m1, x))
    tc = shared.binary("mul", "out", t, s, family(O.SOFTCAP))
    with shared.serving(family(O.SQRT, O.RSQRT)):
        q = sqrt_flow(f, x, f.comb(lambda o: o == O.RSQRT.value, op, register=False))
    with shared.serving(family(O.SIN, O.COS, O.ROPE_SIN, O.ROPE_COS)):
        tr = trig_flow(f, x, a, b, pos, family(O.ROPE_COS, O.ROPE_SIN), family(O.COS, O.ROPE_COS))
    long = [((O.SCALE,), m1), ((O.EXP,), e), ((O.SQRT, O.RSQRT), q), ((O.RECIP,), r), ((O.TANH,), t),
            ((O.SOFTCAP,), tc), ((O.GELU,), g), ((O.GELU_MUL,), gm), ((O.SIN, O.COS, O.ROPE_SIN, O.ROPE_COS), tr)]
    y = _select(f, op, long)
    acc = f.comb(lambda c, o: c & _is(o, *CVO_ELEMENTWISE), accm, op, register=False)
    y = f.comb(lambda c, ya, yy: Mux(c, ya, yy), acc, f.add(y, b), y)
    return y, short


def _select(f, op, choices):
    """The node of the first ``(ops, node)`` choice whose ops contain `op` (0 if none), registered."""
    def pick(o, *vals):
        y = Const(0, 32)
        for (ops, _), val in zip(choices, vals):
            y = Mux(_is(o, *ops), val, y)
        return y
    return f.comb(pick, op, *[c[1] for c in choices])


class _RedPort:
    """A lane's way into its adder A1 for the reductions (`Sfu._reductions` drives it): while ``sel`` is
    high A1 adds ``la + lb`` instead of the short path's operands. `_short_tail` records ``rv`` (the lane's
    reduction operand at A1's input: ``a``, or M1's product for SUMSQ/DOT), ``t`` (the time of A1's
    input), ``ra`` and ``rb`` (A1's operand registers: ``la`` and ``lb`` an enabled cycle after ``sel``) and
    ``y`` (A1's sum, ``Flow.unit_latency(FpAdd)`` enabled cycles after its operands)."""

    def __init__(self, j: int):
        self.la = Signal(32, name=f"red_la{j}")
        self.lb = Signal(32, name=f"red_lb{j}")
        self.sel = Signal(name=f"red_sel{j}")
        self.rv = self.y = self.t = self.ra = self.rb = None


def _short_tail(f, op, x, a, b, s, m1, port=None):
    """The short path (`SHORT_OPS`) behind the multiplier M1 (`m1`): its own adder A1 (ADD/SUB/ADDS/FMAS/
    RELU_SUBS, and the reductions' accumulation through `port`, a `_RedPort`) and multiplier M2
    (MULS_MUL's M1 * b), a result select; returns the result node. `x` is the operand (`a`, or
    ``a - emax`` on the long path, which no short op uses)."""
    O = SfuOp
    # A1's first operand: M1 for FMAS and the reductions SUMSQ/DOT (a*a, a*b), else x (= a for the reductions
    # SUM/MAX: sub_emax only acts on CVO_ELEMENTWISE), so that aligned it is the reduction's operand too
    a1a = f.comb(lambda o, p, v: Mux(_is(o, O.FMAS, O.SUMSQ, O.DOT), p, v), op, m1, x, register=False)
    a1b = f.comb(lambda o, vb, vs: Mux(_is(o, O.ADD, O.FMAS), vb, Mux(o == O.SUB.value, _neg(vb),
                                       Mux(o == O.ADDS.value, vs, _neg(vs)))), op, b, s, register=False)
    if port is not None:
        (va, vb), t = f.align(a1a, a1b)
        port.rv = va
        port.t = t
        a1a, a1b = (Mux(port.sel, port.la, va), t), (Mux(port.sel, port.lb, vb), t)
    a1 = f.add(a1a, a1b)
    if port is not None:
        port.y = a1[0]
        port.ra, port.rb = f.operands
    relu = f.comb(_relu, a1)
    m2 = f.mul(m1, b)
    short = [((O.ADD, O.SUB, O.ADDS, O.FMAS), a1), ((O.RELU_SUBS,), relu), ((O.MUL, O.MULS), m1),
             ((O.MULS_MUL,), m2), ((O.COPY,), a)]
    return _select(f, op, short)


def _short_lane(f, a, b, op, s, port=None):
    """Lanes 1..3 of the four-lane short path: `SHORT_OPS` only (M1 takes b for MUL/DOT, a for SUMSQ, else the
    scalar s), then `_short_tail`; lane 0 is `_datapath`'s, so every lane computes the same function."""
    O = SfuOp
    m1b = f.comb(lambda o, vb, vs, va: Mux(_is(o, O.MUL, O.DOT), vb, Mux(o == O.SUMSQ.value, va, vs)),
                 op, b, s, a, register=False)
    return _short_tail(f, op, a, a, b, s, f.mul(a, m1b), port)


class Sfu(wiring.Component):
    """The stream SFU: every `SfuOp` on binary32 streams, bit-identical to `sim.sfu`.

    Elements travel in beats of up to `LANES` (four, one L2 word). The functions (every op but `SHORT_OPS`)
    take one element per beat, in lane 0, at one beat per cycle; `SHORT_OPS` (the element-wise arithmetic,
    COPY and the reductions) take up to four elements per beat, every lane with its own M1, A1 and M2. Two
    exits: `SHORT_OPS` leave the pipeline `short_latency` stages in, the functions at `latency`. A short
    command is taken only when no element of a long one is still in flight, so results leave in command order
    and never meet at the output.

    Reductions: ``P = hw.sfu_reduce_lanes`` lane accumulators in `LANES` banks, bank j accumulated by lane
    j's own adder A1 (idle in a reduction; max: a comparator beside it); element ``i`` goes to lane
    ``i mod P``, i.e. bank ``i mod 4``, slot ``(i // 4) mod (P / 4)``. The drain is `sim.sfu`'s pairwise tree over the lanes in index order:
    its first two levels combine the banks slot by slot (lanes 4s + 0..3), the rest is a tree over bank 0's
    slots. A reduction's beats must therefore be full (four elements) except its last, which the
    controller's readers guarantee (`hdl.l2.ElemReader` beats).

    Parameters
    ----------
    hw : HardwareConfig (``sfu_reduce_lanes``: at least four slots of more than the adder's latency per bank,
        so 32 or 64; ``l2_bytes`` for the length field).

    Members
    -------
    i_cmd : In(stream.Signature(command_layout(hw)))
        A command is taken when the previous one has taken all its elements (a reduction: when its result
        has left; a `SHORT_OPS` command: when no long element is in flight either). Elements of
        consecutive commands follow each other in the pipeline without a gap.
    i_data : In(stream.Signature(data_layout()))
        Beats ``{a, b, n}``: ``n`` (1..4; 1 for the functions) elements in lanes ``0 .. n-1``, binary32
        operands ``a[i]``, ``b[i]`` (RoPE: ``a`` = high, ``b`` = low word of the u0.64 frequency; CVO with
        ``accm``: ``b`` = the value added to the result). The beats' counts add up to the command's
        length.
    o_data : Out(stream.Signature(result_layout()))
        ``{y, n}``: one result per element, in the lanes of its beat; a reduction's result alone (n = 1).
    """

    def __init__(self, hw):
        lanes = hw.sfu_reduce_lanes
        a1 = Flow.unit_latency(FpAdd)
        if lanes % LANES or lanes // LANES <= a1:
            self._MustUse__silence = True
            raise ValueError(f"Sfu needs sfu_reduce_lanes / {LANES} (slots per bank) > FpAdd latency with its "
                             f"operand registers ({a1}) so a slot's add is done before its next element; got {lanes}")
        self._hw = hw
        self._cmd_layout = command_layout(hw)
        super().__init__({"i_cmd": In(stream.Signature(self._cmd_layout)),
                          "i_data": In(stream.Signature(data_layout())),
                          "o_data": Out(stream.Signature(result_layout()))})
        m = Module()
        m._MustUse__silence = True
        f = Flow(m, Const(1), dry=True)
        nodes = [(Signal(32), 0)] * 2 + [(Signal(6), 0)] + [(Signal(32), 0)] * 4 + [(Signal(1), 0)] * 3
        y, ys = _datapath(f, *nodes)
        self._latency, self._short_latency = y[1], ys[1]

    @property
    def latency(self) -> int:
        """Cycles from an element's input transfer to its result at ``o_data`` (no stalls), every op but
        `SHORT_OPS`."""
        return self._latency

    @property
    def short_latency(self) -> int:
        """The same for the element-wise `SHORT_OPS` (a reduction's elements reach its lanes then)."""
        return self._short_latency

    @property
    def lanes(self) -> int:
        return self._hw.sfu_reduce_lanes

    def elaborate(self, platform):
        m = Module()
        en = Signal()
        m.d.comb += en.eq(~self.o_data.valid | self.o_data.ready)
        f = Flow(m, en, "s")
        cmd = Signal(self._cmd_layout)
        op = Value.cast(cmd.op)
        busy = Signal()
        remaining = Signal.like(cmd.length)
        is_red = _is(op, *REDUCE_OPS)

        # elements of long commands in flight: a short command waits for them to leave. The count takes its
        # entries and exits a cycle late (`inc_r`, `dec_r`: registered, off the output's ready path); an entry
        # not yet counted holds a short command too, an exit not yet counted holds it one cycle longer.
        long_n = Signal(range(self.latency + 3))
        long_nz = Signal()                          # long_n != 0, a register of its own (no compare before ready)
        inc_r, dec_r = Signal(), Signal()
        m.d.comb += self.i_cmd.ready.eq(~busy & ~(_is(Value.cast(self.i_cmd.payload.op), *SHORT_OPS)
                                                  & (long_nz | inc_r)))
        p = self.i_data.payload
        take = Signal()
        last = Signal()                              # the beat holds the command's last elements
        rem_nz = Signal()                            # remaining != 0, a register of its own (off en's path)
        m.d.comb += [self.i_data.ready.eq(busy & en & rem_nz),
                     take.eq(self.i_data.valid & self.i_data.ready),
                     last.eq(remaining <= p.n)]
        with m.If(self.i_cmd.valid & self.i_cmd.ready):
            m.d.sync += [cmd.eq(self.i_cmd.payload), remaining.eq(self.i_cmd.payload.length),
                         busy.eq(self.i_cmd.payload.length != 0), rem_nz.eq(self.i_cmd.payload.length != 0)]
        with m.If(take):
            m.d.sync += [remaining.eq(Mux(last, 0, remaining - p.n)), rem_nz.eq(~last)]
            with m.If(last & ~is_red):
                m.d.sync += busy.eq(0)

        n0 = lambda v: (v, 0)
        ports = [_RedPort(j) for j in range(LANES)]
        y, ys0 = _datapath(f, n0(p.a[0]), n0(p.b[0]), n0(op), n0(cmd.s), n0(cmd.s_inv), n0(cmd.emax),
                           n0(cmd.pos), n0(cmd.sub_emax), n0(cmd.recip_scale), n0(cmd.accm), port=ports[0])
        yss = [ys0] + [_short_lane(f, n0(p.a[j]), n0(p.b[j]), n0(op), n0(cmd.s), ports[j])
                       for j in range(1, LANES)]
        assert (y[1], ys0[1]) == (self.latency, self.short_latency)
        is_short = _is(op, *SHORT_OPS)
        # t_n is read only together with a valid: a data line; the valids keep their reset.
        aligned, t_short = f.align(*yss, n0(p.n))
        assert t_short == self.short_latency
        ysv, t_n = aligned[:LANES], aligned[LANES]
        # a short result that leaves at t_short (not a reduction's element: its valid is the drain's)
        ts_in, l_in = take & is_short & ~is_red, take & ~is_short
        ts_valid = f.delay(n0(ts_in), t_short, valid=True)
        (yv,), t_out = f.align(y)
        l_valid = f.delay(n0(l_in), t_out, valid=True)
        m.d.sync += [inc_r.eq(take & ~is_short), dec_r.eq(l_valid & en)]
        with m.If(inc_r & ~dec_r):
            m.d.sync += [long_n.eq(long_n + 1), long_nz.eq(1)]
        with m.Elif(dec_r & ~inc_r):
            m.d.sync += [long_n.eq(long_n - 1), long_nz.eq(long_n != 1)]

        # the reductions feed at each lane's A1 input (lanes 1..3 reach it before lane 0, whose M1 takes x)
        feeds = [(f.delay(n0(take & is_red), pt.t, valid=True), f.delay(n0(p.n), pt.t)) for pt in ports]
        assert all(1 <= pt.t <= ports[0].t for pt in ports)   # no feed the cycle after the command (`_reductions`)
        # a short result still on its way out goes before the reduction's (none can be: the drain outlasts
        # the tail behind A1)
        hold = ts_valid
        out_red, result, done_next = self._reductions(m, en, feeds, f.delay(n0(last), ports[0].t), ports, hold)
        with m.If(out_red & self.o_data.ready):
            m.d.sync += busy.eq(0)
        o = self.o_data.payload
        # o_data.valid = ts_valid | l_valid | out_red, as a register (so that en, and the input's ready behind it,
        # start from a flip-flop): its next value from the valid lines' taps before their ends (they move on
        # en) and the drain's next state (out_red = done & ~ts_valid)
        o_valid = Signal()
        ts_next = Mux(en, f.delay(n0(ts_in), t_short - 1, valid=True), ts_valid)
        l_next = Mux(en, f.delay(n0(l_in), t_out - 1, valid=True), l_valid)
        m.d.sync += o_valid.eq(ts_next | l_next | done_next)
        m.d.comb += [self.o_data.valid.eq(o_valid), o.n.eq(Mux(ts_valid, t_n, 1))]
        m.d.comb += o.y[0].eq(Mux(out_red, result, Mux(ts_valid, ysv[0], yv)))
        m.d.comb += [o.y[j].eq(ysv[j]) for j in range(1, LANES)]
        return m

    def _reductions(self, m, en, feeds, feed_last, ports, hold):
        """The reduction lanes (`LANES` banks of ``P / LANES`` slots) and their drain, accumulated by the
        lanes' own adders A1 through `ports` (`_RedPort`: A1 is idle in a reduction); ``feeds[j]`` =
        (valid, n): a reduction beat of n elements is at lane j's A1 input this cycle (operand
        ``ports[j].rv``); `feed_last`: lane 0's is the command's last (lane 0 is the latest); `hold`:
        another result has the output. Returns (result valid, result, the next cycle's "result ready" state
        before `hold`): `result` holds until it has left."""
        per = self.lanes // LANES
        sbits = max(1, (per - 1).bit_length())
        bank = [[Signal(32, name=f"lane{j + LANES * s}") for s in range(per)] for j in range(LANES)]
        latency = Flow.unit_latency(FpAdd)                    # A1 behind its operand registers
        # the command's max flag, registered as the command is taken (as `cmd` is); the banks' start values and
        # the slot counters' reset the cycle after (`started`: no feed reaches a lane before then)
        red_max, started = Signal(name="red_max"), Signal(name="red_started")
        take_cmd = self.i_cmd.valid & self.i_cmd.ready
        m.d.sync += started.eq(take_cmd)
        with m.If(take_cmd):
            m.d.sync += red_max.eq(_is(Value.cast(self.i_cmd.payload.op), *MAX_OPS))

        def pick(regs, idx):
            v = Signal(32)
            with m.Switch(idx):
                for i, r in enumerate(regs):
                    with m.Case(i):
                        m.d.comb += v.eq(r)
            return v

        # per bank: operands la/lb (into A1 while sel), valid lv, destination slot ld. A sum is written back
        # when A1 has it (latency cycles on), a max two cycles on: A1's operand registers hold la and lb a cycle
        # on, their compares are registered the next (`_fmax` on registered compares, the choice at the write);
        # a command is one or the other
        assert latency >= 2
        lvs, lds = [], []
        for j, pt in enumerate(ports):
            lv, ld = Signal(name=f"red_lv{j}"), Signal(sbits, name=f"red_ld{j}")
            valid = [Signal(name=f"red_v{j}_{i}") for i in range(latency)]
            # read only with the valid: reset-less (shift registers)
            dst = [Signal(sbits, name=f"dst{j}_{i}", reset_less=True) for i in range(latency)]
            ma, mb = Signal(32, name=f"max_a{j}", reset_less=True), Signal(32, name=f"max_b{j}", reset_less=True)
            mc = Signal(data.StructLayout({"nan": 1, "ab": 1, "ba": 1, "nz": 1}), name=f"max_c{j}", reset_less=True)
            with m.If(en):
                m.d.sync += [valid[0].eq(lv), dst[0].eq(ld)]
                m.d.sync += [r[i].eq(r[i - 1]) for r in (valid, dst) for i in range(1, latency)]
                m.d.sync += [ma.eq(pt.ra), mb.eq(pt.rb), mc.nan.eq(_is_nan(pt.ra) | _is_nan(pt.rb)),
                             mc.ab.eq(pt.ra[:31] > pt.rb[:31]), mc.ba.eq(pt.rb[:31] > pt.ra[:31]),
                             mc.nz.eq((pt.ra[:31] | pt.rb[:31]).any())]
            # `_fmax(la, lb)`: `_gt` from the registered compares
            gt = Mux(ma[31] == mb[31], Mux(ma[31], mc.ba, mc.ab), ~ma[31] & mc.nz)
            mx = Mux(mc.nan, QNAN, Mux(gt, ma, mb))
            # the write back is not gated by en: while the pipeline holds, its valid, slot and value hold too, and
            # writing the same value again changes nothing (no slot is read again before its sum is back)
            with m.If(Mux(red_max, valid[1], valid[-1])):
                with m.Switch(Mux(red_max, dst[1], dst[-1])):
                    for s in range(per):
                        with m.Case(s):
                            m.d.sync += bank[j][s].eq(Mux(red_max, mx, pt.y))
            m.d.comb += pt.sel.eq(lv)
            lvs.append(lv)
            lds.append(ld)

        ctr = Signal(sbits)                         # the slot of lane 0's next beat
        # lanes 1..3 reach their A1 earlier: each counts its own beats
        ctrs = [ctr] + [Signal(sbits, name=f"red_ctr{j}") for j in range(1, LANES)]
        for j in range(1, LANES):
            with m.If(en & feeds[j][0]):
                m.d.sync += ctrs[j].eq(ctrs[j] + 1)
        k = Signal(sbits + 1)                       # the drain's slot
        cn = Signal(sbits)                          # slots issued in a cross-bank level
        xs = Signal(range(LANES + 1))               # bank stride of a cross-bank level (1, 2, ..)
        stride = Signal(range(2 * per + 1))         # slot stride of the tree over bank 0
        wait = Signal(range(latency + 1))
        # wait == 0 and stride >= per as registers of their own, set where `wait` and `stride` are, so that the
        # Wait state's exits start from flip-flops
        wait_zero, stride_done = Signal(name="red_wait_zero"), Signal(name="red_stride_done")
        # the ends of a cross-bank level's last slot (cn = per - 1 and 2 xs >= LANES) and of a tree level (k +
        # 2 stride >= per), each a register of its own set from the next counts, so that the state's and the
        # wait counter's enables start from flip-flops
        cross_end, tree_end = Signal(name="red_cross_end"), Signal(name="red_tree_end")
        result_valid = Signal()
        # in state Done, as a register of its own (`done_next`: its next value, for the output's valid register)
        done, done_next = Signal(name="red_done"), Signal(name="red_done_next")
        m.d.comb += [done_next.eq(done), result_valid.eq(done & ~hold)]
        m.d.sync += done.eq(done_next)
        with m.If(started):
            m.d.sync += [r.eq(Mux(red_max, NEG_INF, NEG_ZERO)) for regs in bank for r in regs] + [c.eq(0) for c in ctrs]
        with m.FSM(name="reduce"):
            with m.State("Feed"):
                for j, (pt, (fv, fn)) in enumerate(zip(ports, feeds)):
                    m.d.comb += [pt.la.eq(pick(bank[j], ctrs[j])), pt.lb.eq(pt.rv), lds[j].eq(ctrs[j]),
                                 lvs[j].eq(fv & (fn > j))]
                with m.If(en & feeds[0][0]):
                    m.d.sync += ctr.eq(ctr + 1)
                    with m.If(feed_last):
                        # the cross-bank levels start at the slot fed longest ago: slot ctr + 1 + i is issued i + 1
                        # cycles after the last beat and was last fed at most per - 1 - i beats before it, so its
                        # sum is back (per > latency); level 2 repeats the order per cycles later
                        m.d.sync += [xs.eq(1), k.eq(ctr + 1), cn.eq(0), cross_end.eq(int(per == 1 and 2 >= LANES))]
                        m.next = "Cross"
            with m.State("Cross"):
                # level xs: bank j (j a multiple of 2 xs) slot k += bank j + xs slot k, for every slot
                for j, pt in enumerate(ports):
                    m.d.comb += [pt.la.eq(pick(bank[j], k[:sbits])), lds[j].eq(k[:sbits])]
                    cases = [x for x in (1 << i for i in range(LANES.bit_length())) if x < LANES and j % (2 * x) == 0]
                    with m.Switch(xs):
                        for x in cases:
                            with m.Case(x):
                                m.d.comb += [pt.lb.eq(pick(bank[j + x], k[:sbits])), lvs[j].eq(1)]
                with m.If(en):
                    level_end = cn == per - 1
                    next_xs = Mux(level_end, 2 * xs, xs)
                    m.d.sync += [k.eq(k[:sbits] + 1), cn.eq(cn + 1),
                                 cross_end.eq(((cn + 1)[:sbits] == per - 1) & (2 * next_xs >= LANES))]
                    with m.If(level_end):
                        m.d.sync += xs.eq(2 * xs)
                    with m.If(cross_end):
                        m.d.sync += [stride.eq(1), stride_done.eq(1 >= per), wait.eq(latency),
                                     wait_zero.eq(latency == 0)]
                        m.next = "Wait"
            with m.State("Wait"):
                with m.If(en):
                    m.d.sync += [wait.eq(wait - 1), wait_zero.eq(wait == 1), k.eq(0), tree_end.eq(2 * stride >= per)]
                    with m.If(wait_zero):
                        m.next = "Tree"
                        with m.If(stride_done):
                            m.next = "Done"
                            m.d.comb += done_next.eq(1)
            with m.State("Tree"):
                pt = ports[0]
                m.d.comb += [pt.la.eq(pick(bank[0], k[:sbits])), pt.lb.eq(pick(bank[0], (k + stride)[:sbits])),
                             lds[0].eq(k[:sbits]), lvs[0].eq(1)]
                with m.If(en):
                    m.d.sync += [k.eq(k + 2 * stride), tree_end.eq(k + 4 * stride >= per)]
                    with m.If(tree_end):
                        m.d.sync += [stride.eq(2 * stride), stride_done.eq(2 * stride >= per), wait.eq(latency),
                                     wait_zero.eq(latency == 0)]
                        m.next = "Wait"
            with m.State("Done"):
                with m.If(self.o_data.ready & ~hold):
                    m.next = "Feed"
                    m.d.comb += done_next.eq(0)
        return result_valid, bank[0][0], done_next
