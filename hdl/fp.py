"""Pipelined IEEE 754 binary32 primitives, bit-identical to NumPy float32 for every non-NaN result.

Every primitive is a `wiring.Component` with the same handshake-free pipeline ports:

- ``en: In(1)``: pipeline advance. When 0 every stage (data and valid) holds its value.
- ``i_valid: In(1)``, ``i_a: In(32)``, ``i_b: In(32)`` (where there is a second operand).
- ``o_valid: Out(1)``, ``o_y: Out(32)``: ``o_y`` is a register; a result is consumed on a cycle where
  ``en`` and ``o_valid`` are both 1.

and a ``latency`` property: the number of ``en`` cycles from an input to its output.

Components
----------
`FpAdd` (a + b), `FpMul` (a * b), `IntToFp(width)` (signed integer -> binary32), `F16ToF32` (binary16 ->
binary32, exact), `F32ToF16` (binary32 -> binary16, RNE), `FpLdexp(exp_width)` (a * 2**k, exactly
``np.ldexp`` on float32), `IntScaleMul(int_bits)` (integer times binary16 scale, the fused and bit-identical
form of ``FpMul(IntToFp(x), F16ToF32(s))`` for integers of at most 25 bits).

Arithmetic: round to nearest, ties to even; subnormal inputs and outputs are fully supported (no flush to
zero); overflow rounds to ±inf; x + (-x) = +0; (-0) + (-0) = -0. Every NaN result is the canonical quiet
NaN `QNAN` (0x7FC00000), whatever the input NaN payloads (NumPy propagates payloads; tests compare only
NaN-ness for NaN results).

Structure
---------
`F16ToF32` (and `hdl.sfu`'s integer-to-float step) ends in the generic normalise-and-round back end
(`_Pipe.normalize_round`): a leading-zero count (balanced tree), a left shift clamped at the exponent,
then one RNE increment on the packed ``(exponent - 1) << 23 | significand`` word, so the carry of a
rounding overflow walks into the exponent (and into +inf) without extra logic. The other primitives have
their own, narrower back ends ending in the same kind of packed increment:

- `FpAdd`: the 28-bit sum's left shift by its leading-zero count clamped at the exponent (which is what
  makes a subnormal sum), in two stages: whole 4-bit groups (the clamped group count is the trailing ones
  of a 7-bit vector of registered group flags), then within the top group; it keeps only the 24-bit
  significand and the rounding increment (from the round bit, the bits below it and the LSB). The
  alignment distance is that of the exponent fields (a subnormal's significand enters the aligner shifted
  left by one instead), so no zero-field detect precedes its subtract. The add and subtract are one adder
  (``a + (b ^ sub) + sub``).
- `FpMul`: at most one operand is normalised (two subnormals give a signed zero: their exact product is
  below ``2**-252``), before the product, so the product's MSB is at bit 47 or 46: no leading-zero count
  after the multiply, and one 26-bit right shift by ``P[47]`` (normal result) or by the denormalising
  count ``1 - E`` (clamped at 26) with the sticky bit as a masked OR of the shifted-out product bits, taken
  from the partial products in the stage of their sum.
- `FpLdexp`: one 25-bit shift of the significand: right (with a masked-OR sticky bit) when the result is
  below the normal range, else left by ``min(lz, E - 1)`` (only a subnormal input has leading zeros), the
  left shift being the bit-reversed right shift of the bit-reversed significand.
- `IntToFp`: the magnitude's leading-zero count and a left shift keeping the significand, the round bit
  and a sticky bit, the exponent field ``127 + width - 1 - lz`` packed above the fraction.

Special results travel as two flags (NaN, inf) and are selected in the last stage (`FpLdexp`: in the
stage before, into the packed word whose increment is then 0).

Timing (estimate, not sign-off: there is no open-source UltraScale+ timing analyser): every stage
holds at most one of: an 8-10 bit exponent add/compare, a 31-bit magnitude compare, a 28-bit add, a
6-level barrel shift, a leading-zero-count tree, or a 32-bit increment, with at most a 2:1 select or a
small (<= 6-bit) compare beside it. On UltraScale+ -2 each of these is 3-5 LUT levels or one CARRY8 chain,
which is the usual budget for 300 MHz. `FpMul`'s 24x24 significand product is written as two plain
multiplies, 24x17 and 24x7 bits (one DSP48E2, 27x18, each), each followed by a register, and their sum
(a 31-bit add) in the next stage, so no fabric adder follows a multiplier in the same stage. (Yosys's
estimate maps the DSP48E2 without their registers: the partial-product registers, the 48-bit product
register and the sum stay in the fabric.) Latencies: FpAdd 6, FpMul 6, IntToFp 4, F16ToF32 4, F32ToF16 3,
FpLdexp 4, IntScaleMul 6 (see each class).
"""

from __future__ import annotations

import contextlib

from amaranth import Cat, Const, Module, Mux, Signal, Value, signed
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

__all__ = ["QNAN", "QNAN16", "NEG_ZERO", "FpAdd", "FpMul", "IntToFp", "F16ToF32", "F32ToF16", "FpLdexp",
           "IntScaleMul", "INT_SCALE_MAX_BITS", "check_int_scale_bits", "rejecting"]

QNAN = 0x7FC00000
"""The canonical quiet NaN every primitive returns for a NaN result."""

NEG_ZERO = 0x80000000
"""-0.0: ``x + -0.0 == x`` exactly for every x (RNE), an adder's identity."""

QNAN16 = 0x7E00
"""The canonical binary16 quiet NaN `F32ToF16` returns for a NaN input."""

_EXP_ALL = 0xFF
_INF = 0x7F800000


def _lzc(v: Value):
    """Leading-zero count of `v` (from its MSB) as a balanced tree; returns (count, all_zero).

    For an all-zero `v` the count is at least ``len(v)`` (callers use ``all_zero``)."""
    n = len(v)
    size = 1
    while size < n:
        size *= 2
    if size != n:                        # pad on the LSB side: leading zeros of a non-zero value are unchanged
        v = Cat(Const(0, size - n), v)

    def tree(x):
        if len(x) == 1:
            return ~x[0], ~x[0]
        half = len(x) // 2
        ch, zh = tree(x[half:])
        cl, zl = tree(x[:half])
        return Mux(zh, cl + half, ch), zh & zl

    return tree(v)


def _lzc_groups(v: Value, group: int = 8):
    """The first half of a leading-zero count in two registered steps: `v` (padded on the LSB side) in groups of
    `group` bits (a power of two), from the MSB, each as (its own leading-zero count, non-zero); `_lzc_join`
    makes the count from them. Each part is a function of one group's bits alone."""
    n = len(v)
    ng = -(-n // group)
    if ng * group != n:
        v = Cat(Const(0, ng * group - n), v)
    lg = ceil_log2(group)
    parts = [v[(ng - 1 - g) * group:(ng - g) * group] for g in range(ng)]
    return Cat(*[Cat(_lzc(x)[0][:lg], x.any()) for x in parts])


def _lzc_join(groups: Value, group: int = 8):
    """The leading-zero count of a non-zero value from its `_lzc_groups`: the first non-zero group's count
    beside that group's index (``index * group + count`` as a concatenation)."""
    lg = ceil_log2(group)
    ng = len(groups) // (lg + 1)
    part = [groups[g * (lg + 1):(g + 1) * (lg + 1)] for g in range(ng)]
    count, index = part[ng - 1][:lg], Const(ng - 1, max(1, ceil_log2(ng)))
    for g in reversed(range(ng - 1)):
        count = Mux(part[g][lg], part[g][:lg], count)
        index = Mux(part[g][lg], g, index)
    return Cat(count, index)


def _lzc_carry(m: Module, v: Value, name: str):
    """Leading-zero count of a non-zero `v` (from its MSB) by the carry chain: the highest set bit of `v` is the
    lowest of `v` reversed, ``r & -r`` (one carry chain and an AND), and each bit of the count an OR of that
    one-hot word's bits (an all-zero `v` gives 0)."""
    n = len(v)
    r = Signal(n, name=f"{name}_rev")
    m.d.comb += r.eq(v[::-1])
    low = Signal(n, name=f"{name}_low")
    m.d.comb += low.eq(r & (~r + 1))
    return Cat(*[Cat(*[low[i] for i in range(n) if (i >> k) & 1]).any()
                 for k in range(max(1, (n - 1).bit_length()))])


def _at_least(v: Value, c: int):
    """``v >= c`` for the constant `c` as ANDs and ORs of `v`'s bits from its MSB (no carry chain: Yosys maps a
    compare to one, a LUT and a CARRY8 a level where the logic takes one or two LUTs)."""
    if c <= 0:
        return Const(1, 1)
    if c >= 1 << len(v):
        return Const(0, 1)
    b = len(v) - 1
    rest = _at_least(v[:b], c & ((1 << b) - 1)) if b else Const(1, 1)
    return v[b] & rest if (c >> b) & 1 else v[b] | rest


def _unpack(bits: Value):
    """Fields of a binary32 word: sign, biased exponent field, fraction, effective exponent (>= 1),
    24-bit significand with the hidden bit, and the zero/inf/nan flags."""
    sign = bits[31]
    e = bits[23:31]
    f = bits[0:23]
    normal = e != 0
    return dict(sign=sign, e=e, f=f, eff=Mux(normal, e, 1), mant=Cat(f, normal),
                zero=(e == 0) & (f == 0), inf=(e == _EXP_ALL) & (f == 0), nan=(e == _EXP_ALL) & (f != 0))


class _Pipe:
    """Registers a group of values per stage (all gated by `en`) and counts the stages."""

    def __init__(self, m: Module, en: Value, valid: Value):
        self.m, self.en = m, en
        self.valid = valid
        self.stages = 0

    def stage(self, **values):
        """Register `values` (and the valid bit) for one stage; returns them as a dict of signals."""
        self.stages += 1
        out = {}
        for name, v in values.items():
            v = Value.cast(v)
            r = Signal(v.shape(), name=f"s{self.stages}_{name}")
            with self.m.If(self.en):
                self.m.d.sync += r.eq(v)
            out[name] = r
        valid = Signal(name=f"s{self.stages}_valid")
        with self.m.If(self.en):
            self.m.d.sync += valid.eq(self.valid)
        self.valid = valid
        return out

    def normalize_round(self, sign, exp, mant, nan, inf):
        """Round ``(-1)**sign * mant * 2**(exp - 127 - (len(mant) - 1))`` to binary32 (RNE), for results that
        cannot fall below the normal range but by a left shift (`F16ToF32`, `hdl.sfu`'s integer-to-float
        step): `mant` is unsigned; a 1 in its MSB has weight ``2**(exp - 127)`` (``exp`` is the biased
        exponent the result would have if `mant` were normalised, at least 1). `nan` / `inf` select the
        canonical NaN / ±inf. Three stages, the last `_round_pack`."""
        m = self.m
        w = max(len(mant), 26)
        if len(mant) < w:
            mant = Cat(Const(0, w - len(mant)), mant)
        exp_s = Signal(signed(12))
        m.d.comb += exp_s.eq(exp)
        exp = exp_s
        # Stage A: leading zeros, the left shift clamped so the exponent stays >= 1.
        lz, zero = _lzc(mant)
        d = Signal(signed(len(exp) + 1))
        m.d.comb += d.eq(exp - 1)
        lz_w = Signal(range(w + 1))
        m.d.comb += lz_w.eq(Mux(zero, w, lz))
        left = Signal(range(w + 1))
        m.d.comb += left.eq(Mux(d < 0, 0, Mux(lz_w < d, lz_w, d)))
        # the trailing zeros, for the sticky bit: a set bit stays below the round bit after the left shift
        # when it lies below w - 25 - left (a zero `mant` has none: its count is then w or more)
        tz = _lzc(mant[::-1])[0]
        s = self.stage(sign=sign, exp=exp, mant=mant, zero=zero, left=left, nan=nan, inf=inf, tz=tz)
        # Stage B: the shift. The result exponent is exp - left (>= 1); subnormal results end with exponent 1
        # and a 0 in the hidden-bit position, which packs as exponent field 0.
        shifted = Signal(w)
        be = Signal(signed(len(exp) + 1))
        m.d.comb += [shifted.eq((s["mant"] << s["left"])[:w]), be.eq(s["exp"] - s["left"])]
        s = self.stage(sign=s["sign"], sig=shifted[w - 24:], rnd=shifted[w - 25],
                       sticky=~s["zero"] & (s["tz"] + s["left"] < w - 25),
                       bem1=(be - 1)[:8], big=be > 254, zero=s["zero"], nan=s["nan"], inf=s["inf"])
        # Stage C: round to nearest even and pack.
        return self.stage(y=_round_pack(m, s, big=s["big"]))["y"]


class _Primitive(wiring.Component):
    """Common to every primitive: `latency` is the class's fixed LATENCY; `_check_width` rejects a bad
    width parameter (and silences the "created but never used" warning of the rejected instance)."""

    LATENCY: int

    @property
    def latency(self) -> int:
        return self.LATENCY

    def _check_width(self, what: str, v, hi: int = 32, why: str = "") -> int:
        with rejecting(self):
            return _check_width(type(self).__name__, what, v, hi, why)


@contextlib.contextmanager
def rejecting(component):
    """Around a constructor's parameter checks: a ValueError or TypeError marks `component` as never to be
    elaborated (a rejected component is not an unused one: no "created but never used" warning), and
    propagates."""
    try:
        yield
    except (TypeError, ValueError):
        component._MustUse__silence = True
        raise


def _check_width(owner: str, what: str, v, hi: int, why: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= hi:
        raise ValueError(f"{owner} {what} must be an integer 2..{hi}{why}, not {v!r}")
    return v


class _Unary(_Primitive):
    def __init__(self):
        super().__init__({"en": In(1), "i_valid": In(1), "i_a": In(32), "o_valid": Out(1), "o_y": Out(32)})


class _Binary(_Primitive):
    def __init__(self):
        super().__init__({"en": In(1), "i_valid": In(1), "i_a": In(32), "i_b": In(32),
                          "o_valid": Out(1), "o_y": Out(32)})


def _finish(m, self, pipe, y):
    m.d.comb += [self.o_y.eq(y), self.o_valid.eq(pipe.valid)]
    assert pipe.stages == self.latency, (type(self).__name__, pipe.stages, self.latency)


def _round_pack(m, s, big=None):
    """The last stage of FpAdd and FpMul (combinational): round to nearest even and pack. `s` holds
    ``sign``, ``sig`` (24 bits, the hidden-bit position first), ``rnd`` (the round bit) and ``sticky``
    (non-zero bits below it) or instead ``inc`` (the RNE increment, precomputed), ``bem1`` (the biased
    exponent minus one: the hidden bit's carry into the packed word completes it, a subnormal result has
    bem1 = 0 and sig[23] = 0) and the ``zero``, ``nan`` and ``inf`` flags; `big` (optional) forces overflow.
    A rounding carry walks into the exponent, and into +inf (or bit 31, for a bem1 of 254) without extra
    logic."""
    inc = s["inc"] if "inc" in s else s["rnd"] & (s["sticky"] | s["sig"][0])
    packed = Signal(32)
    m.d.comb += packed.eq(Cat(Const(0, 23), s["bem1"]) + s["sig"] + inc)
    overflow = packed[31] | (packed[23:31] == _EXP_ALL)
    if big is not None:
        overflow = overflow | big
    y = Signal(32)
    with m.If(s["nan"]):
        m.d.comb += y.eq(QNAN)
    with m.Elif(s["inf"]):
        m.d.comb += y.eq(Cat(Const(_INF, 31), s["sign"]))
    with m.Elif(s["zero"]):
        m.d.comb += y.eq(Cat(Const(0, 31), s["sign"]))
    with m.Elif(overflow):
        m.d.comb += y.eq(Cat(Const(_INF, 31), s["sign"]))
    with m.Else():
        m.d.comb += y.eq(Cat(packed[:31], s["sign"]))
    return y


class FpAdd(_Binary):
    """binary32 ``a + b`` (RNE), bit-identical to NumPy float32. Latency 6.

    Stages: (1) unpack, order by magnitude and, beside the compare, the alignment distance (the exponent
    fields' ``|ea - eb|``); (2) align the smaller operand (27-bit shift, the sticky bit a masked OR beside
    it, as four registered group ORs); (3) the 28-bit add or subtract (one adder, the sticky ORed into its
    LSB), behind it each 4-bit group's zero flag, and beside it the shift cap ``min(exp, 31)`` in 4-bit
    groups; (4) the normalising left shift in whole 4-bit groups (the count from the registered flags,
    already clamped) and beside it the sum's zero test and the result's sign; (5) the shift within the top
    group (clamped), keeping the significand, the RNE increment bit, and the exponent; (6) the increment on
    the packed word and the special-case select."""

    LATENCY = 6

    def elaborate(self, platform):
        m = Module()
        p = _Pipe(m, self.en, self.i_valid)
        a, b = self.i_a, self.i_b
        ua, ub = _unpack(a), _unpack(b)
        nan = ua["nan"] | ub["nan"] | (ua["inf"] & ub["inf"] & (ua["sign"] != ub["sign"]))
        inf = ua["inf"] | ub["inf"]
        swap = b[:31] > a[:31]
        # The larger magnitude has the larger (or equal) exponent, so the alignment distance is |ea - eb|,
        # beside the magnitude compare rather than behind it; saturated at 31 (27 and more leave only the
        # sticky bit). It is the distance of the exponent fields, not of the effective exponents (no
        # zero-field detect before the subtract): a subnormal operand added to a normal one is the smaller,
        # its effective exponent is its field + 1, and its significand (bit 23 clear) enters the aligner
        # shifted left by one instead. Two subnormals have the same distance either way (0).
        ea, eb = a[23:31], b[23:31]
        dab, dba = Signal(signed(9)), Signal(signed(9))
        m.d.comb += [dab.eq(ea - eb), dba.eq(eb - ea)]
        diff = Mux(dab[-1], dba[:8], dab[:8])
        za, zb = ea == 0, eb == 0
        ma = Mux(za & ~zb, Cat(Const(0, 1), a[:23]), ua["mant"])
        mb = Mux(zb & ~za, Cat(Const(0, 1), b[:23]), ub["mant"])
        s = p.stage(sign=Mux(swap, ub["sign"], ua["sign"]), sub=ua["sign"] != ub["sign"],
                    exp=Mux(swap, ub["eff"], ua["eff"]), shift=Mux(diff[5:].any(), 31, diff[:5]),
                    mbig=Mux(swap, ub["mant"], ua["mant"]), msmall=Mux(swap, ma, mb),
                    zsign=ua["sign"] & ub["sign"],
                    nan=nan, inf=inf)
        # Align: 24-bit significands plus guard, round and sticky positions (27 bits). The sticky bit is a
        # masked OR beside the shifter (significand bit i falls below the window when shift > i + 3), kept as
        # four registered ORs of six bits each and ORed into the aligned operand's LSB at the adder's input.
        shift, msmall = s["shift"], s["msmall"]
        ext, by8 = Signal(27), Signal(27)          # the shift in two steps: whole bytes, then the bits
        m.d.comb += [by8.eq(Cat(Const(0, 3), msmall) >> Cat(Const(0, 3), shift[3:])), ext.eq(by8 >> shift[:3])]
        sticky = Cat(*(Cat(*(msmall[i] & (shift > i + 3) for i in range(6 * g, 6 * g + 6))).any()
                       for g in range(4)))
        s = p.stage(sign=s["sign"], sub=s["sub"], exp=s["exp"], mbig=Cat(Const(0, 3), s["mbig"]),
                    msmall=ext, sticky=sticky, zsign=s["zsign"], nan=s["nan"], inf=s["inf"])
        # One adder: a - b = a + ~b + 1 (28 bits; a >= b, so the difference never wraps).
        aligned = Cat(s["msmall"][0] | s["sticky"].any(), s["msmall"][1:], Const(0, 1))
        total = (s["mbig"] + (aligned ^ s["sub"].replicate(28)) + s["sub"])[:28]
        # Beside it, the clamp of the normalising shift, cap = min(exp, 31) (the count is at most 27), split
        # as the shift in whole 4-bit groups (stage 4) and within a group (stage 5): ge[k - 1] = cap >= 4k,
        # k = 1..7, and cap's low two bits. Behind the adder, u[j] = (group 6 - j of the sum is zero) &
        # (cap >= 4j + 4), stage 4's group flags (one LUT each).
        exp = s["exp"]
        ge = Cat(*(exp >= 4 * k for k in range(1, 8)))
        u = Cat(*((total[24 - 4 * j:28 - 4 * j] == 0) & ge[j] for j in range(7)))
        s = p.stage(sign=s["sign"], exp=exp, total=total, ge=ge, u=u, capf=Mux(exp[5:].any(), 3, exp[:2]),
                    zsign=s["zsign"], nan=s["nan"], inf=s["inf"])
        # Stages 4 and 5 normalise: left = min(lz, cap), lz the sum's leading-zero count. The MSB of `total`
        # (bit 27) has weight 2**(exp + 1 - 127); the clamp keeps the exponent >= 1 (a subnormal result keeps
        # exponent 1 and packs as field 0), and exp - left is the packed exponent - 1. With lz = 4g + f (g
        # leading all-zero groups of total's seven 4-bit groups) and cap = 4c + r: left = 4·min(g, c) + f'
        # where f' = f when g < c, else min(f, r) (f = 4 when the group that lands on top is all zero).
        # Stage 4: the group shift by k = min(g, c) groups, k the number of trailing ones of u: the
        # thermometer t[j] = (k >= j) = u[0] & .. & u[j - 1] and the one-hot sel[j] = t[j] & ~u[j] (sel[7] =
        # t[7]); k in binary drives a shifter by 16, 8 and 4.
        total, ge, u = s["total"], s["ge"], s["u"]
        t = [Const(1, 1)] + [u[:j].all() for j in range(1, 8)]
        sel = Cat(*(t[j] & ~u[j] for j in range(7)), t[7])
        groups = Signal(3)
        m.d.comb += groups.eq(Cat(t[1] & ~t[2] | t[3] & ~t[4] | t[5] & ~t[6] | t[7], t[2] & ~t[4] | t[6],
                                  t[4]))
        coarse = Signal(28)
        m.d.comb += coarse.eq(total << Cat(Const(0, 2), groups))
        # The group shift stops at c (k = c) when cap < 4k + 4: f' = min(f, r) then.
        at_cap = Cat(*(sel[k] & ~ge[k] for k in range(7)), sel[7]).any()
        # Beside the shift, the result's sign: the group shift keeps a non-zero sum non-zero, so the zero test
        # is on the sum itself. An exact zero sum is +0 unless both operands were -0 (RNE); an infinity keeps
        # the larger's sign.
        zero = total == 0
        s = p.stage(sign=Mux(zero & ~s["inf"], s["zsign"], s["sign"]), exp=s["exp"], coarse=coarse,
                    groups=groups, fcap=Mux(at_cap, s["capf"], 3), zero=zero, nan=s["nan"], inf=s["inf"])
        # Stage 5: the shift within a group, f' = min(leading zeros of the top group, fcap), keeping the
        # 24-bit significand (bits 4..27 of coarse << f') and the RNE increment: the round bit (bit 3) and
        # the LSB or a non-zero bit below the round bit, for each f' from coarse's low five bits alone and
        # selected by f'.
        coarse = s["coarse"]
        top = coarse[24:28]
        lz4 = Mux(top[3], 0, Mux(top[2], 1, Mux(top[1], 2, Mux(top[0], 3, 4))))
        fine = Signal(2)
        m.d.comb += fine.eq(Mux(lz4 < s["fcap"], lz4, s["fcap"]))
        shifted = Signal(28)
        bem1 = Signal(8)
        m.d.comb += [shifted.eq(coarse << fine), bem1.eq(s["exp"] - Cat(fine, s["groups"]))]
        incs = [coarse[3 - f] & (coarse[4 - f] | coarse[:3 - f].any()) for f in range(3)]
        incs.append(coarse[0] & coarse[1])
        inc = Mux(fine[1], Mux(fine[0], incs[3], incs[2]), Mux(fine[0], incs[1], incs[0]))
        s = p.stage(sign=s["sign"], sig=shifted[4:28], inc=inc, bem1=bem1, zero=s["zero"], nan=s["nan"],
                    inf=s["inf"])
        # Stage 6: round to nearest even and pack; bem1 <= 254, a rounding carry may reach 2**31.
        y = p.stage(y=_round_pack(m, s))["y"]
        _finish(m, self, p, y)
        return m


class FpMul(_Binary):
    """binary32 ``a * b`` (RNE), bit-identical to NumPy float32. Latency 6.

    At most one operand needs normalising: if both are subnormal the exact product is below ``2**-252``,
    far under half the smallest subnormal, so the result is a signed zero. The significands are normalised
    before the product (hidden bit at 23; a subnormal's biased exponent ``1 - lz`` may fall below 1), so the
    48-bit product has its MSB at bit 47 or 46 and the back end needs no leading-zero count.

    Stages: (1) unpack, special cases, the exponent sum, the leading-zero count of the chosen operand's
    significand were it subnormal, as three 8-bit groups' counts and flags (`_lzc_groups`);
    (2) the subnormal significand, if any, is routed to the first multiplier input
    and shifted left by its count (one 24-bit shifter) into a fabric register before two DSP48E2s (whose A
    and B registers are left out), and the biased
    exponent ``E`` of a product in [1, 2); (3) the 24x17 and 24x7 partial products (the slices' M
    registers, `hdl.dsp.DspMacc`), beside them the denormalising shift count ``r = 1 - E`` (clamped), its
    mask and the exponent flags; (4) their sum ``P`` and, beside it, the sticky bit as flags taken from the
    partial products alone (``P[:k] != 0`` iff one of them, aligned, has a set bit below ``k``), each one LUT
    after the slices: the product bits below bit 22 and, below the normal range, the ``r`` bits above them
    that the shift loses (a masked OR); (5) one right shift of the product's top 26 bits by ``P[47]`` (normal
    result) or ``r`` (below the normal range), as a shift by ``r - 1`` (0 for a normal result) and one bit
    more (always below the normal range, when ``P[47]`` for a normal result), keeping 24 bits, and the RNE
    increment from the three bits around that last step and the flags' OR (one LUT after the shift); (6) the
    increment added to the packed ``(exponent - 1) << 23 | significand`` word (a rounding carry walks into
    the exponent and into +inf) and the special-case select."""

    LATENCY = 6

    def elaborate(self, platform):
        m = Module()
        p = _Pipe(m, self.en, self.i_valid)
        ua, ub = _unpack(self.i_a), _unpack(self.i_b)
        sign = ua["sign"] ^ ub["sign"]
        nan = ua["nan"] | ub["nan"] | (ua["inf"] & ub["zero"]) | (ub["inf"] & ua["zero"])
        inf = ua["inf"] | ub["inf"]
        # A zero operand, or two subnormal ones: a signed zero.
        zero = ua["zero"] | ub["zero"] | ((ua["e"] == 0) & (ub["e"] == 0))
        base = Signal(signed(11))
        m.d.comb += base.eq(ua["eff"] + ub["eff"] - 127)
        # Only a subnormal significand has leading zeros and at most one is subnormal here (else `zero`), so
        # the one shift is the subnormal operand's count, applied to the first multiplier input (b's
        # significand when b is the subnormal one): the inputs are chosen here, shifted in stage 2. The count is
        # that of the chosen operand's significand were it subnormal (a 0 above the fraction: the fraction bits
        # alone, no exponent test ahead of the count), registered as its three 8-bit groups' counts and flags
        # (`_lzc_groups`); stage 2 joins them and takes the count where an operand is subnormal.
        subb = ub["e"] == 0
        sub = (ua["e"] == 0) | subb
        lzg = Mux(subb, _lzc_groups(Cat(ub["f"], Const(0, 1))), _lzc_groups(Cat(ua["f"], Const(0, 1))))
        s = p.stage(sign=sign, base=base, ma=Mux(subb, ub["mant"], ua["mant"]),
                    mb=Mux(subb, ua["mant"], ub["mant"]), lzg=lzg, sub=sub, zero=zero, nan=nan, inf=inf)
        # Stage 2: normalise. E: the biased exponent of a product in [1, 2).
        ma, mb = Signal(24), Signal(24)
        e = Signal(signed(11))
        lz = Mux(s["sub"], _lzc_join(s["lzg"])[:5], 0)
        m.d.comb += [ma.eq(s["ma"] << lz), mb.eq(s["mb"]), e.eq(s["base"] - lz)]
        # Stages 2, 3 of the significands: the 24x17 and 24x7 partial products, each one DSP48E2
        # (`hdl.dsp.DspMacc` without its P register, its clock enables the pipeline's): the normalised
        # significands in fabric registers (stage 2; the slices' own A and B registers are left out, so that
        # the count's join and the shift end at a flip-flop's setup, not at the slice's input), the product
        # in M (stage 3).
        from .dsp import DspMacc
        m.submodules.mul_lo = mul_lo = DspMacc(25, 18, ce=True, preg=False, ireg=False)
        m.submodules.mul_hi = mul_hi = DspMacc(25, 8, ce=True, preg=False, ireg=False)
        s = p.stage(sign=s["sign"], e=e, ma=ma, mb=mb, zero=s["zero"], nan=s["nan"], inf=s["inf"])
        for mul, b in ((mul_lo, s["mb"][:17]), (mul_hi, s["mb"][17:])):
            m.d.comb += [mul.i_a.eq(s["ma"]), mul.i_b.eq(b), mul.i_restart.eq(1), mul.i_ce.eq(self.en)]
        # Stages 3, 4: the product in [2**46, 2**48): the partial products (M), then their sum (P). Beside
        # them: the denormalising shift r = 1 - E (a result below the normal range; 26 and more leave only
        # sticky bits) and the exponent flags.
        plo, phi = mul_lo.o_p[:41], mul_hi.o_p[:31]
        e = s["e"]
        r = Signal(5)
        m.d.comb += r.eq(Mux(e < -24, 26, (1 - e)[:5]))
        # keep[j] = (r > j) = (E <= -j): E = 0, or E negative with ~E = -E - 1 >= j - 1 (a LUT on ~E's low
        # five bits beside an OR of its others, not an 11-bit compare).
        ne = ~e[:10]
        keep = Signal(26)
        m.d.comb += keep.eq(Cat((e == 0) | e[10], *(e[10] & (ne[5:].any() | (ne[:5] >= j - 1))
                                                   for j in range(1, 26))))
        s = p.stage(sign=s["sign"], normal=e >= 1, r=r, keep=keep, big0=e >= 255, big1=e >= 254,
                    em1=(e - 1)[:8], e0=e[:8], zero=s["zero"], nan=s["nan"], inf=s["inf"])
        # Stage 4: the product P = x + y (x = plo, y = phi << 17) and, beside its adder, the flags `lost` whose
        # OR is the sticky bit but for P[22]: P[:22 + r] != 0 below the normal range (keep[j] = r > j masks
        # P[22:]), P[:22] != 0 for a normal result (its `keep` is all zeros). They need no sum: P[:k] != 0 iff
        # (x | y)[:k] != 0, since P = ma * mb has as many trailing zeros as x when mb[:17] != 0 (tz(ma) +
        # tz(mb), fewer than y's, which are at least tz(ma) + 17) and is y when mb[:17] = 0 (then x = 0). Each
        # flag is a function of at most six slice outputs, or of one bit of x | y and a `keep` bit: one LUT
        # after the slices. Also d, stage 5's shift before its last one-bit step: r - 1 below the normal range,
        # else 0.
        x, y = Cat(plo, Const(0, 7)), Cat(Const(0, 17), phi)
        prod, v = Signal(48), Signal(48)
        m.d.comb += [prod.eq(x + y), v.eq(x | y)]
        lost = Cat(plo[:6].any(), plo[6:12].any(), plo[12:17].any(), v[17:19].any(), v[19:21].any(), v[21],
                   v[22:] & s["keep"])
        d = Signal(5)
        m.d.comb += d.eq(Mux(s["normal"], 0, s["r"] - 1))
        s = p.stage(sign=s["sign"], prod=prod, lost=lost, normal=s["normal"], d=d, big0=s["big0"],
                    big1=s["big1"], em1=s["em1"], e0=s["e0"], zero=s["zero"], nan=s["nan"], inf=s["inf"])
        # Stage 5: the significand window. Bit 0 of `win` is the round bit of a normal result whose product
        # MSB is at 46. Every result shifts by d, then by one bit more when `step`: a normal result by P[47], a
        # subnormal one by d + 1 = r. The packed exponent field minus 1: E - 1 + P[47], or 0 below the normal
        # range (the hidden bit then decides).
        pr = s["prod"]
        top = pr[47]
        win = pr[22:48]
        by8, u = Signal(26), Signal(26)  # the shift by d in two steps: whole bytes, then the bits
        m.d.comb += [by8.eq(win >> Cat(Const(0, 3), s["d"][3:])), u.eq(by8 >> s["d"][:3])]
        step = ~s["normal"] | top
        # The RNE increment: round bit u[step], LSB u[step + 1], sticky bit the OR of `lost` and, when stepping,
        # u[0] (P[22] of a normal result; below the normal range one of the bits `lost` covers). Written from
        # u[:3], `step` and `lost` (one LUT after the shift), not from the stepped bits.
        lost_any = s["lost"].any()
        inc = Mux(step, u[1] & (lost_any | u[0] | u[2]), u[0] & (lost_any | u[1]))
        bem1 = Mux(s["normal"], Mux(top, s["e0"], s["em1"]), 0)
        big = s["normal"] & Mux(top, s["big1"], s["big0"])
        s = p.stage(sign=s["sign"], sig=Mux(step, u[2:26], u[1:25]), inc=inc, bem1=bem1, big=big,
                    zero=s["zero"], nan=s["nan"], inf=s["inf"])
        # Stage 6: round to nearest even and pack (bem1 <= 253, so the sum stays below 2**31).
        y = _round_pack(m, s, big=s["big"])
        y = p.stage(y=y)["y"]
        _finish(m, self, p, y)
        return m


class IntToFp(_Unary):
    """Signed two's complement integer of `width` bits (``i_a[:width]``) to binary32, RNE. Latency 4.

    Stages: (1) the magnitude (one carry chain); (2) its leading-zero count (another: `_lzc_carry`); (3) the
    normalising left shift keeping the 24-bit significand, the round bit and a sticky bit (OR of the bits
    below), and the exponent field ``127 + width - 1 - lz`` (0 for a zero input) packed above the 23 fraction
    bits; (4) the RNE increment on that packed word (a rounding carry walks into the exponent; |x| <= 2**31
    never overflows).
    For ``width <= 24`` every value is exact and the increment is omitted.

    Parameters
    ----------
    width : integer width, 2..32."""

    def __init__(self, width: int):
        self._width = self._check_width("width", width)
        super().__init__()

    @property
    def width(self) -> int:
        return self._width

    LATENCY = 4

    def elaborate(self, platform):
        m = Module()
        p = _Pipe(m, self.en, self.i_valid)
        n = self.width
        x = self.i_a[:n].as_signed()
        mag = Signal(n)                 # |x| = (x ^ s) + s, s the sign: one carry chain (|-2**(n-1)| fits)
        m.d.comb += mag.eq((x[:n] ^ x[n - 1].replicate(n)) + x[n - 1])
        s = p.stage(sign=x < 0, mag=mag)
        # the count by the carry chain (`_lzc_carry`; 0 for a zero magnitude, which `zero` covers)
        lzr = Signal(range(n))
        zero = s["mag"] == 0
        m.d.comb += lzr.eq(_lzc_carry(m, s["mag"], "lz"))
        s = p.stage(sign=s["sign"], mag=s["mag"], lz=lzr, zero=zero)
        # Stage 3: the hidden bit to bit n - 1 (its weight before the shift: 2**(n - 1 - lz)).
        norm = Signal(n)
        m.d.comb += norm.eq(s["mag"] << s["lz"])
        field = Mux(s["zero"], 0, 127 + n - 1 - s["lz"])
        if n >= 25:
            frac, rnd, sticky = norm[n - 24:n - 1], norm[n - 25], norm[:n - 25].any()
        else:
            frac, rnd, sticky = Cat(Const(0, 24 - n), norm[:n - 1]), Const(0, 1), Const(0, 1)
        word = Signal(31)
        m.d.comb += word.eq(Cat(frac, field[:8]))
        s = p.stage(sign=s["sign"], word=word, rnd=rnd, sticky=sticky)
        # Stage 4: round to nearest even and pack.
        word = s["word"]
        if n >= 25:
            packed = Signal(31)
            m.d.comb += packed.eq(word + (s["rnd"] & (s["sticky"] | word[0])))
            word = packed
        y = p.stage(y=Cat(word, s["sign"]))["y"]
        _finish(m, self, p, y)
        return m


class F16ToF32(_Unary):
    """IEEE binary16 (``i_a[:16]``) to binary32, exact (subnormals included). Latency 4."""

    LATENCY = 4

    def elaborate(self, platform):
        m = Module()
        p = _Pipe(m, self.en, self.i_valid)
        h = self.i_a[:16]
        sign, e, f = h[15], h[10:15], h[:10]
        nan = (e == 31) & (f != 0)
        inf = (e == 31) & (f == 0)
        eff = Mux(e == 0, 1, e)
        s = p.stage(sign=sign, exp=eff + (127 - 15), mant=Cat(f, e != 0), nan=nan, inf=inf)
        y = p.normalize_round(s["sign"], s["exp"], s["mant"], s["nan"], s["inf"])
        _finish(m, self, p, y)
        return m


class FpLdexp(_Binary):
    """binary32 ``a * 2**k`` with `k` the signed `exp_width`-bit integer ``i_b[:exp_width]``: exactly
    ``np.ldexp`` on float32 (exact unless the result leaves the normal range; then RNE, or ±inf). Latency 4.

    With ``E = eff(a) + k`` (the biased exponent the result has when `a`'s 24-bit significand ``M`` keeps its
    place; ``eff`` is 1 for a subnormal `a`) the result is ``M * 2**(E - 150)``. One significand shift
    covers every case, and no case needs two:

    - ``E <= 0``: the result is below the normal range: ``M`` shifts right by ``1 - E`` (clamped at 25:
      everything is then below the round bit) and rounds (RNE), packed with exponent field 0 (a rounding
      carry walks into field 1).
    - ``E >= 1``: exact. ``M`` shifts left by ``min(lz, E - 1)``, ``lz`` its leading-zero count (0 unless
      `a` is subnormal): to a normal result with field ``E - lz`` (±inf from 255 up), or, when
      ``E <= lz``, to a subnormal one with field 0.

    The two directions share one 25-bit right shifter: a left shift is the bit-reversed right shift of the
    bit-reversed significand (a 2:1 select at the shifter's input and output).

    Stages: (1) unpack, ``E`` (one 11-bit add; a wider `k` is first saturated to 10 bits, beyond which
    every non-zero finite result is ±inf or ±0), beside it the 24-bit leading-zero count and the direction
    (only a subnormal `a` with ``k >= 0`` shifts left; a normal `a` with ``E >= 1`` shifts right by 0)
    with the shifter's input, ``M`` or ``M`` reversed; (2) the shift count (``1 - E`` clamped, 0, or
    ``min(lz, E - 1)`` from a 5-bit compare), beside it the exponent field ``E - lz`` (an 11-bit
    subtract) and the sticky bit's parts (the significand bits below the round bit: the shifter's input bits
    below the shift count, masked by ``E`` itself, not by the count, as four ORs of six bits); (3) the shift
    with the round bit, the sticky bit an OR of stage 2's four, the packed word
    ``field << 23 | fraction`` with the NaN and ±inf words selected
    in (and their round bit cleared); (4) the RNE increment of the fraction (its carry ORed into the
    exponent field, which is 0 whenever there is a round bit).

    With `int_scale` the input `a` is always an `IntScaleMul` result: a normal number, a signed zero, ±inf or
    `QNAN` (never a subnormal number, nor another NaN). Then ``lz`` is 0, every shift is to the right, and the
    flags need no 23-bit zero test: zero is a zero exponent field, NaN and ±inf an all-ones field with or
    without the fraction's MSB (`_scaled`).

    Parameters
    ----------
    exp_width : width of the signed shift count, 2..32.
    int_scale : bool, optional
        `a` is an `IntScaleMul` result (default False: any binary32 value)."""

    def __init__(self, exp_width: int, int_scale: bool = False):
        self._exp_width = self._check_width("exp_width", exp_width)
        self._int_scale = bool(int_scale)
        super().__init__()

    @property
    def exp_width(self) -> int:
        return self._exp_width

    @property
    def int_scale(self) -> bool:
        return self._int_scale

    LATENCY = 4

    def elaborate(self, platform):
        m = Module()
        p = _Pipe(m, self.en, self.i_valid)
        ua = _unpack(self.i_a)
        n = self.exp_width
        k = self.i_b[:n].as_signed()
        if n > 10:
            # Saturate k to -512..511: |k| >= 278 already takes every non-zero finite value to ±inf or ±0.
            fits = (k[9:] == 0) | (k[9:] == (1 << (n - 9)) - 1)
            k = Mux(fits, k[:10], Mux(k[n - 1], 0x200, 0x1FF)).as_signed()
        if self._int_scale:
            return self._scaled(m, p, k)
        # Stage 1: E in [-511, 765], beside it the three 8-bit groups of the leading-zero count a subnormal
        # significand Cat(f, 0) has (1 to 23 unless it is zero; from the fraction alone, not the exponent
        # field's zero test; stage 2 joins them). Only a subnormal `a` with k >= 0 (E >= 1) shifts left; every
        # other case shifts right (a normal `a` with E >= 1 by 0). The shifter's input: Cat(0, M) to shift
        # right, M bit-reversed to shift left (reverse, shift right, reverse back).
        e = Signal(signed(11))
        m.d.comb += e.eq(ua["eff"] + k)
        right = (ua["e"] != 0) | k[-1]
        x = Mux(right, Cat(Const(0, 1), ua["mant"]), Cat(ua["mant"][::-1], Const(0, 1)))
        s = p.stage(sign=ua["sign"], e=e, x=x, right=right, lzg=_lzc_groups(Cat(ua["f"], Const(0, 1))),
                    zero=ua["zero"], nan=ua["nan"], inf=ua["inf"])
        # Stage 2: right by 1 - E (E <= 0; clamped at 25) or by 0, or left by min(lz, E - 1): the result is
        # normal when E > lz (E >= 24, or E in 1..23 and a 5-bit compare); the field E - lz is used only then.
        # Where `a` shifts right its leading zeros are 0 (a normal `a`) or do not matter (a subnormal one with
        # k < 0 has E <= 0): there the result is normal when E >= 1, with field E.
        e, lz, right = s["e"], _lzc_join(s["lzg"])[:5], s["right"]
        normal = (e >= 24) | ((e > 0) & (right | (e[:5] > lz)))
        amt = Mux(right, Mux(e < -23, 25, Mux(e < 1, (1 - e)[:5], 0)), Mux(normal, lz, (e - 1)[:5]))
        field = Signal(signed(12))
        m.d.comb += field.eq(e - Mux(right, 0, lz))
        # Beside it the sticky bit of the right shift, the OR of x = Cat(0, M)'s bits below amt, from E and x
        # (not from amt): bit i >= 1 is below amt exactly when E <= -i (for E < -23, amt = 25 drops all of
        # them; a left shift has E >= 1 and drops none). For E <= -1, E <= -i is ~E >= i - 1 (~E = -E - 1,
        # the register's bits inverted; a compare with a constant as ANDs and ORs of its bits). The OR is
        # registered in four groups of six bits: stage 3 takes it from four flip-flops, not from amt.
        x, ne = s["x"], ~e[:10]
        lost = Cat(*(x[i] & _at_least(ne, i - 1) for i in range(1, 25)))
        sticky = Cat(*(e[10] & lost[j:j + 6].any() for j in range(0, 24, 6)))
        s = p.stage(sign=s["sign"] & ~s["nan"], x=x, right=right, amt=amt, normal=normal & ~s["zero"],
                    field=field, nan=s["nan"], inf=s["inf"], sticky=sticky)
        # Stage 3: the shift. Right: Cat(0, M) >> amt, bit 0 the round bit, bits 1..24 the significand, the
        # sticky bit (the OR of Cat(0, M)'s bits below amt, M's below amt - 1) the OR of stage 2's groups.
        x, amt, right = s["x"], s["amt"], s["right"]
        y = Signal(25)
        m.d.comb += y.eq(x >> amt)
        sig = Mux(right, y[1:25], y[:24][::-1])
        below = s["sticky"].any()
        ovf = s["inf"] | (s["normal"] & (s["field"] >= 255))
        word = Signal(31)
        with m.If(s["nan"]):
            m.d.comb += word.eq(QNAN)
        with m.Elif(ovf):
            m.d.comb += word.eq(_INF)
        with m.Else():
            m.d.comb += word.eq(Cat(sig[:23], Mux(s["normal"], s["field"][:8], 0)))
        s = p.stage(sign=s["sign"], word=word, rnd=right & y[0] & ~s["nan"] & ~s["inf"], sticky=right & below)
        # Stage 4: RNE. A round bit only comes with field 0 (and then the fraction's carry makes field 1).
        word = s["word"]
        inc = s["rnd"] & (s["sticky"] | word[0])
        frac = Signal(24)
        m.d.comb += frac.eq(word[:23] + inc)
        y = p.stage(y=Cat(frac[:23], word[23:31] | frac[23], s["sign"]))["y"]
        _finish(m, self, p, y)
        return m

    def _scaled(self, m, p, k):
        """The stages for an `IntScaleMul` result `a` (`int_scale`): a right shift by ``1 - E`` (E <= 0) or
        none, in whole bytes (stage 2) then bits (stage 3), each with the sticky bit of the bits it drops, the
        overflow flag in stage 2, the NaN and ±inf words selected after the rounding increment (stage 4)."""
        a = self.i_a
        ef = a[23:31]
        top = ef == _EXP_ALL
        # Stage 1: E = field + k (a zero `a`, field 0, keeps a zero significand and is never normal below).
        e = Signal(signed(11))
        m.d.comb += e.eq(ef + k)
        s = p.stage(sign=a[31], e=e, x=Cat(Const(0, 1), a[:23], ef != 0), zero=ef == 0, nan=top & a[22],
                    inf=top & ~a[22])
        # Stage 2: x = Cat(0, M) shifts right by 1 - E for E <= 0 (else by 0). For E <= -1 that is 2 + ~E
        # (~E = -E - 1 >= 0, the register's bits inverted: no subtract): here x >> 2 by the whole bytes of ~E
        # (none left from ~E >= 32), the shift by ~E's low three bits in stage 3. Beside it the sticky bit of
        # that shift, the OR of x's bits it drops (x[0] is 0): x[1], then x's bytes from bit 2 by ~E's bytes
        # (a shift that drops x[18:25] too leaves no round bit: the sticky bit is then not looked at); normal
        # (E >= 1) and the overflow flag, the compares as flat ORs and ANDs.
        e, x = s["e"], s["x"]
        neg, ez = e[10], ~e.any()
        ne = ~e[:10]
        pos = ~neg & ~ez
        gone = neg & ne[5:].any()
        wide = Cat(x[2:], Const(0, 24))
        coarse = Mux(ne[4], Mux(ne[3], wide[24:49], wide[16:41]), Mux(ne[3], wide[8:33], wide[:25]))
        xs = Signal(25)
        m.d.comb += xs.eq(Mux(pos, x, Mux(ez, x >> 1, Mux(gone, 0, coarse))))
        drop = x[1] | (x[2:10].any() & (ne[3] | ne[4])) | (x[10:18].any() & ne[4])
        big = ~neg & (e[8] | e[9] | e[:8].all())          # E >= 255 (so E >= 1)
        s = p.stage(sign=s["sign"] & ~s["nan"], xs=xs, fine=Mux(neg, ne[:3], 0), drop=neg & drop,
                    normal=pos & ~s["zero"], field=e[:8], ovf=s["inf"] | (~s["zero"] & big), nan=s["nan"])
        # Stage 3: the shift's last three bits, bit 0 the round bit, bits 1..24 the significand; the sticky
        # bit: the bits stage 2 dropped, or xs's bits below the shift.
        xs, fine = s["xs"], s["fine"]
        y = Signal(25)
        m.d.comb += y.eq(xs >> fine)
        below = Cat(*(xs[i] & (fine > i) for i in range(7))).any()
        word = Signal(31)
        m.d.comb += word.eq(Cat(y[1:24], Mux(s["normal"], s["field"], 0)))
        s = p.stage(sign=s["sign"], word=word, rnd=y[0], sticky=s["drop"] | below, ovf=s["ovf"], nan=s["nan"])
        # Stage 4: RNE (a round bit only comes with field 0, the fraction's carry then makes field 1), then
        # the NaN and ±inf words.
        word = s["word"]
        inc = s["rnd"] & (s["sticky"] | word[0])
        frac = Signal(24)
        m.d.comb += frac.eq(word[:23] + inc)
        out = Signal(31)
        with m.If(s["nan"]):
            m.d.comb += out.eq(QNAN)
        with m.Elif(s["ovf"]):
            m.d.comb += out.eq(_INF)
        with m.Else():
            m.d.comb += out.eq(Cat(frac[:23], word[23:31] | frac[23]))
        y = p.stage(y=Cat(out, s["sign"]))["y"]
        _finish(m, self, p, y)
        return m


class F32ToF16(_Unary):
    """binary32 (``i_a``) to IEEE binary16 (``o_y[:16]``, upper bits 0), RNE: bit-identical to
    ``np.float32(x).astype(np.float16)`` for every non-NaN input (overflow to ±inf, subnormal results
    rounded correctly, signed zeros; every binary32 subnormal rounds to ±0). NaN gives the canonical
    binary16 quiet NaN `QNAN16` (0x7E00). Latency 3.

    Stages: unpack, the binary16 exponent and the denormalising shift count, each a function of the exponent
    field alone (no adder); the right shift of the 24-bit significand keeping 11 bits and a round bit, the
    sticky bit (the significand's bits below the round bit's, masked by the shift count) and the NaN flag (a
    special exponent with a nonzero fraction); RNE increment on the packed ``(exponent - 1) << 10 | significand``
    word (a rounding carry walks into the exponent and into inf) and the special-case select."""

    LATENCY = 3

    def elaborate(self, platform):
        m = Module()
        p = _Pipe(m, self.en, self.i_valid)
        ua = _unpack(self.i_a)
        e = ua["e"]
        # The binary16 biased exponent if normal is e16 = eff - 112 (below 1: subnormal), eff = max(e, 1). The
        # extra right shift for results below the normal range is 1 - e16 = 113 - e, clamped: 25 and more leave
        # only sticky bits (e = 0 is below 88 too).
        r = Signal(range(26))
        m.d.comb += r.eq(Mux(e >= 113, 0, Mux(e <= 88, 25, (113 - e)[:5])))
        # be = max(e16, 1) mod 32: e - 112 = e + 16 (mod 32) flips bit 4 alone
        s = p.stage(sign=ua["sign"], big=e >= 143, be=Mux(e >= 113, Cat(e[:4], ~e[4]), 1), r=r, mant=ua["mant"],
                    special=e == _EXP_ALL)
        # The 24-bit significand (hidden bit at 23) keeps its top 11 bits after the extra shift `r`; the
        # sticky bit is any significand bit below the round bit's, 12 + r: bits 0 .. 11 + r (every bit past 23).
        ext = Signal(24 + 26)
        m.d.comb += ext.eq(Cat(Const(0, 26), s["mant"]) >> s["r"])
        sig = ext[26 + 13:]                 # 11 bits
        rnd = ext[26 + 12]
        below = Cat(Const((1 << 12) - 1, 12), *(s["r"] >= k - 11 for k in range(12, 24)))
        sticky = (s["mant"] & below).any()
        nan = s["special"] & s["mant"][:23].any()
        s = p.stage(sign=s["sign"], big=s["big"], be=s["be"], sig=sig, rnd=rnd, sticky=sticky,
                    special=s["special"], nan=nan)
        inc = s["rnd"] & (s["sticky"] | s["sig"][0])
        be_m1 = Signal(5)
        m.d.comb += be_m1.eq(s["be"] - 1)
        packed = Signal(16)
        m.d.comb += packed.eq(Cat(Const(0, 10), be_m1) + s["sig"] + inc)
        y = Signal(16)
        with m.If(s["special"]):
            m.d.comb += y.eq(Mux(s["nan"], QNAN16, Cat(Const(0x7C00, 15), s["sign"])))
        with m.Elif(s["big"] | (packed[:15] >= 0x7C00)):
            m.d.comb += y.eq(Cat(Const(0x7C00, 15), s["sign"]))
        with m.Else():
            m.d.comb += y.eq(Cat(packed[:15], s["sign"]))
        y = p.stage(y=y)["y"]
        _finish(m, self, p, y)
        return m


INT_SCALE_MAX_BITS = 25
"""The widest integer `IntScaleMul` takes: every 25-bit signed integer (magnitude at most 2**24) is exact in
binary32, which is what makes the fused product equal to ``FpMul(IntToFp(x), F16ToF32(s))``."""


def check_int_scale_bits(owner: str, name: str, bits, limit: int = INT_SCALE_MAX_BITS) -> int:
    """`bits` if it is an integer 2..`limit` (at most `INT_SCALE_MAX_BITS`: every such signed integer is exact
    in binary32, so `IntScaleMul` equals ``FpMul(IntToFp, F16ToF32)``); else ValueError naming `owner`.`name`."""
    return _check_width(owner, name, bits, min(limit, INT_SCALE_MAX_BITS), " (integers exact in binary32)")


class IntScaleMul(_Binary):
    """``fp32(x) * fp32(s)`` for a signed `int_bits`-bit integer ``x = i_a[:int_bits]`` and a binary16 scale
    ``s = i_b[:16]``, RNE: bit-identical to ``FpMul(IntToFp(int_bits)(x), F16ToF32(s))`` (and to NumPy
    ``np.float32(x) * np.float32(np.float16(s))``; NaN results are `QNAN`), in one multiply. Latency 6.

    Why one rounding is enough: for ``int_bits <= 25`` the conversion ``fp32(x)`` is exact (|x| <= 2**24)
    and ``fp32(s)`` is always exact, so the binary32 product is the exact integer product
    ``|x| * significand(s)`` (at most ``int_bits - 1 + 11`` bits) rounded once. Its value is at least
    ``2**-24`` (the smallest binary16 subnormal) and below ``2**24 * 2**16``, so it is always a normal
    binary32 number: no subnormal result, no overflow. Specials follow FpMul: a NaN scale or ``0 * inf``
    gives `QNAN`; ``x * inf`` is ±inf; a zero product is a signed zero, ``sign(x) ^ sign(s)`` with
    ``fp32(0) = +0`` (so ``0 * -1.0 = -0.0``).

    Stages: (1) |x| (one carry chain), binary16 decode and the special cases; (2, 3) the unsigned
    ``(int_bits) x 11``-bit product in one DSP48E2 (`hdl.dsp.DspMacc`: |x| and the significand in its A and
    B registers, the product in M), then in a fabric register with its 4-bit groups' zero flags and leading
    zeros; (4) leading-zero count of the product from those; (5) the normalising left shift and the binary32
    exponent (an 8-bit add), in parallel; (6) the RNE increment on the packed ``exponent << 23 | fraction`` word
    (a carry out of the fraction walks into the exponent) and the special-case select. Products of at most 24
    bits (``int_bits <= 14``) are exact: stage 6 then has no adder.

    Parameters
    ----------
    int_bits : width of the signed integer, 2..25 (`INT_SCALE_MAX_BITS`). A wider integer could round in
        ``fp32(x)``, and a fused product would then differ from the two-rounding composition.
    """

    LATENCY = 6

    def __init__(self, int_bits: int):
        with rejecting(self):
            self._int_bits = check_int_scale_bits("IntScaleMul", "int_bits", int_bits)
        super().__init__()

    @property
    def int_bits(self) -> int:
        return self._int_bits

    @property
    def product_bits(self) -> int:
        """Width of the exact integer product |x| * significand: |x| <= 2**(int_bits-1), significand < 2**11."""
        return self._int_bits + 10

    def elaborate(self, platform):
        m = Module()
        p = _Pipe(m, self.en, self.i_valid)
        n, pw = self._int_bits, self.product_bits
        # Stage 1: magnitude and sign of x (|-2**(n-1)| = 2**(n-1) still fits n unsigned bits); binary16
        # fields; special cases.
        x = self.i_a[:n].as_signed()
        mag = Signal(n)
        m.d.comb += mag.eq(Mux(x < 0, -x, x))
        h = self.i_b[:16]
        e, f = h[10:15], h[:10]
        inf_s = (e == 31) & (f == 0)
        nan = ((e == 31) & (f != 0)) | (inf_s & (x == 0))
        # Stages 1 and 2 of the product: one DSP48E2 (`hdl.dsp.DspMacc` without its P register, its clock
        # enables the pipeline's): |x| and the significand in its A and B registers, the exact product in M;
        # stage 3 registers it in the fabric, and beside it, for each 4-bit group of the product from its MSB
        # (padded with zeros at the LSB to whole groups), the group's zero flag and its own leading zeros.
        from .dsp import DspMacc
        m.submodules.mul = mul = DspMacc(n + 1, 12, ce=True, preg=False)
        m.d.comb += [mul.i_a.eq(mag), mul.i_b.eq(Cat(f, e != 0)), mul.i_restart.eq(1), mul.i_ce.eq(self.en)]
        s = p.stage(sign=(x < 0) ^ h[15], eff=Mux(e == 0, 1, e), special=e == 31, nan=nan)
        s = p.stage(**s)
        ng = -(-pw // 4)
        padded = Cat(Const(0, 4 * ng - pw), mul.o_p[:pw])
        nibs = [padded[4 * (ng - 1 - i):4 * (ng - i)] for i in range(ng)]
        s = p.stage(prod=mul.o_p[:pw], gz=Cat(*(q == 0 for q in nibs)),
                    glz=Cat(*(Mux(q[3], 0, Mux(q[2], 1, Mux(q[1], 2, 3))) for q in nibs)), **s)
        # Stage 4: leading zeros, 4 x the leading zero groups + the first non-zero group's own (a one-hot
        # select of the flags, no adder), and the zero test. The product's value is prod * 2**(eff - 25).
        gz, glz = s["gz"], s["glz"]
        first = [~gz[i] & (gz[:i].all() if i else 1) for i in range(ng)]
        lz_hi = Cat(*(Cat(*(first[i] for i in range(ng) if (i >> b) & 1)).any()
                      for b in range(max(1, (ng - 1).bit_length()))))
        lz_lo = Cat(*(Cat(*(first[i] & glz[2 * i + b] for i in range(ng))).any() for b in range(2)))
        lzr = Signal(range(pw))
        m.d.comb += lzr.eq(Cat(lz_lo, lz_hi))
        s = p.stage(sign=s["sign"], prod=s["prod"], lz=lzr, zero=gz.all(), eff=s["eff"],
                    special=s["special"], nan=s["nan"])
        # Stage 5: normalise (hidden bit to the MSB) and the biased exponent of that MSB:
        # 127 + (pw - 1 - lz) + (eff - 25), which lies in [103, 167] for a non-zero product.
        norm = Signal(pw)
        exp = Signal(8)
        m.d.comb += [norm.eq(s["prod"] << s["lz"]), exp.eq(s["eff"] + (pw + 101) - s["lz"])]
        s = p.stage(sign=s["sign"], norm=norm, exp=exp, zero=s["zero"], special=s["special"], nan=s["nan"])
        # Stage 6: round to nearest even and pack. The 23 fraction bits sit below the hidden bit.
        norm = s["norm"]
        if pw <= 24:
            frac = Cat(Const(0, 24 - pw), norm[:pw - 1])
            packed = Cat(frac, s["exp"])
        else:
            frac = norm[pw - 24:pw - 1]
            rnd = norm[pw - 25]
            rest = norm[:pw - 25].any() if pw > 25 else Const(0, 1)
            inc = rnd & (rest | frac[0])
            packed = Signal(31)
            m.d.comb += packed.eq(Cat(frac, s["exp"]) + inc)
        y = Signal(32)
        with m.If(s["special"]):
            m.d.comb += y.eq(Mux(s["nan"], QNAN, Cat(Const(_INF, 31), s["sign"])))
        with m.Elif(s["zero"]):
            m.d.comb += y.eq(Cat(Const(0, 31), s["sign"]))
        with m.Else():
            m.d.comb += y.eq(Cat(packed, s["sign"]))
        y = p.stage(y=y)["y"]
        _finish(m, self, p, y)
        return m
