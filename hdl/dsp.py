"""The UltraScale+ DSP48E2 as an explicit primitive where the NPU needs its registers and accumulator.

`DspMacc` is one multiply-accumulate, ``P ← A·B + (restart ? 0 : P)``, with the A, B, M and P pipeline
registers and the restart select (OPMODE's Z multiplexer) inside the DSP slice. It elaborates two ways:

* for a Xilinx UltraScale+ target (`XilinxTarget`, passed as the ``platform`` by ``python -m hdl.build`` and
  `hdl.synth.synthesize`): one ``DSP48E2`` instance, configured as UG579 (UltraScale Architecture DSP Slice
  User Guide) documents it;
* otherwise (the Amaranth simulator, the Verilog that the Verilator benches compile): the same registers
  written out in Amaranth, cycle for cycle what the instance computes for the subset of the primitive used
  here.

Why it exists: Yosys 0.70 maps a multiply to a DSP48E2 but packs none of its registers or its post-adder
for UltraScale+ (its ``xilinx_dsp`` packer matches DSP48E1 cells), so a PE written as plain RTL
costs 77 LUT and 154 FF of fabric in the estimate (docs/systolic.md); Vivado would pack the same RTL
into the slice. The explicit instance gives both tools the same, intended mapping.

The subset used (UG579 names): ``USE_MULT="MULTIPLY"``, ``USE_SIMD="ONE48"``, ``AREG = ACASCREG = 1``
(the A2 register, also driving ``ACOUT``), ``BREG = BCASCREG = 1``, ``MREG = 1``, ``PREG = 1``,
``OPMODEREG = 1`` (reset by ``RSTCTRL``), ``INMODE = 0`` (A2 × B2), ``ALUMODE = 0`` (Z + W + X + Y + CIN),
``CARRYIN = 0``; OPMODE ``{W, Z, Y, X}`` = ``{00, 010, 01, 01}`` (P + M) or ``{00, 000, 01, 01}`` (M).
The data registers have no reset (their resets are tied low): like every register of the slice they start
at zero after configuration.

Verification: the behavioural form is what every simulation runs (the PE's exhaustive proof, the arrays,
the engine, the full chip); the instance's configuration is checked structurally (tests/test_dsp.py).
No DSP48E2 simulation model is available without Vivado (Yosys ships only a black box), so the instance
itself is simulated only where Vivado is: its unisim model against the same vectors is the first check to
run on a machine with Vivado (docs/systolic.md).
"""

from __future__ import annotations

from amaranth import ClockSignal, Const, Instance, Module, Mux, ResetSignal, Signal, signed
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .config import DSP48E2_MUL_A_BITS as MUL_A_BITS
from .config import DSP48E2_MUL_B_BITS as MUL_B_BITS
from .config import DSP48E2_P_BITS as P_BITS

from .fp import _check_width, rejecting

__all__ = ["XilinxTarget", "XILINX", "uses_xilinx_primitives", "DspMacc", "DspPairMul", "A_BITS", "MUL_A_BITS",
           "MUL_B_BITS", "P_BITS", "OPMODE_PM", "OPMODE_M", "OPMODE_PCIN_M", "INMODE_D_PLUS_A2"]

A_BITS = 30          # the A port and the A cascade; the multiplier takes its low MUL_A_BITS (27)

# OPMODE[8:0] = {W[1:0], Z[2:0], Y[1:0], X[1:0]} (UG579, table 2-7 to 2-10): X = Y = 01 selects the two
# partial products M; Z = 010 selects P (accumulate), Z = 000 selects 0 (restart); W = 00 is 0.
OPMODE_PM = 0b00_010_01_01
OPMODE_M = 0b00_000_01_01
OPMODE_PCIN_M = 0b00_001_01_01      # Z = 001: PCIN, the P cascade from the slice below
# INMODE[4:0] (UG579 table 2-4): [0] = 0 A2 (not A1), [1] = 0 A into the pre-adder (not gated), [2] = 1 D into it,
# [3] = 0 D + A (not D - A), [4] = 0 B2 (not B1)
INMODE_D_PLUS_A2 = 0b00100


class XilinxTarget:
    """The ``platform`` that selects vendor primitives in elaboration (`DspMacc`): an UltraScale+ device.
    It is not an Amaranth build platform; nothing else reads it."""

    xilinx_primitives = "ultrascale_plus"

    def __repr__(self):
        return "XilinxTarget()"


XILINX = XilinxTarget()


def uses_xilinx_primitives(platform) -> bool:
    """True when `platform` asks for UltraScale+ primitives (a `XilinxTarget`)."""
    return getattr(platform, "xilinx_primitives", None) == "ultrascale_plus"


class DspMacc(wiring.Component):
    """``P ← A·B + (restart ? 0 : P)`` in one DSP48E2.

    Parameters
    ----------
    a_bits : width of the A operand (2 .. 27: the multiplier's A input).
    b_bits : width of the B operand (2 .. 18).
    cascade : A comes from the slice above (``i_acin``, its ``o_acout``) instead of ``i_a``: the dedicated
        A cascade of a DSP column, which must be wired straight from one slice's ``o_acout`` to the next
        one's ``i_acin``.
    ce : the registers (A, B, M, P, OPMODE) load only in cycles with ``i_ce`` high (the slice's clock
        enables), for a pipeline that stalls; without it they load every cycle.
    preg : the P register and the accumulation (default); without it ``o_p`` is the M register's product
        (``PREG = 0``, OPMODE M: no accumulation, ``i_restart`` unused), for a product registered in the
        fabric after the slice.
    ireg : the A and B input registers (default); without them (``AREG = BREG = 0``, not with ``cascade``)
        the operands go straight into the multiplier and every stage comes a cycle sooner, for operands
        registered in the fabric: a path from the caller's logic then ends at a fabric register's setup, not
        at the slice's input with the larger one behind a register's worth of logic levels.

    Members
    -------
    i_a : In(signed(a_bits))        A operand (unused with ``cascade``)
    i_acin : In(signed(30))         A cascade input (used with ``cascade``)
    o_acout : Out(signed(30))       the A register: A one cycle later, sign-extended to 30 bits
    i_b : In(signed(b_bits))        B operand
    i_restart : In(1)               the product that reaches P next cycle starts a new sum
    i_ce : In(1)                    (with ``ce``) the clock enable of every register
    o_p : Out(signed(48))           the P register

    Timing: A and B at the inputs in cycle x are in the A/B registers in x + 1 (``o_acout``), their product
    is in M in x + 2 and added into P in x + 3. ``i_restart`` in cycle x + 1 (registered into OPMODE)
    decides whether that product starts a new sum: P(x + 3) = M + (restart ? 0 : P(x + 2)). Without ``ireg``
    each of these comes a cycle sooner (M in x + 1, P in x + 2, ``i_restart`` with the operands).
    """

    LATENCY = 3

    def __init__(self, a_bits: int, b_bits: int, *, cascade: bool = False, ce: bool = False, preg: bool = True,
                 ireg: bool = True):
        with rejecting(self):
            _check_width("DspMacc", "a_bits", a_bits, MUL_A_BITS, " (the DSP48E2 multiplier's A input)")
            _check_width("DspMacc", "b_bits", b_bits, MUL_B_BITS, " (the DSP48E2 multiplier's B input)")
            if cascade and not ireg:
                raise ValueError("DspMacc: cascade needs ireg (the A cascade leaves from the A register)")
        self._a_bits, self._b_bits, self._cascade, self._ce = a_bits, b_bits, bool(cascade), bool(ce)
        self._preg, self._ireg = bool(preg), bool(ireg)
        ports = {
            "i_a": In(signed(a_bits)), "i_acin": In(signed(A_BITS)), "o_acout": Out(signed(A_BITS)),
            "i_b": In(signed(b_bits)), "i_restart": In(1), "o_p": Out(signed(P_BITS)),
        }
        if self._ce:
            ports["i_ce"] = In(1)
        super().__init__(ports)

    @property
    def cascade(self) -> bool:
        return self._cascade

    def elaborate(self, platform):
        m = Module()
        a_in = self.i_acin if self._cascade else self.i_a.as_signed()
        ce = self.i_ce if self._ce else Const(1, 1)
        if uses_xilinx_primitives(platform):
            zero = Const(0, 1)
            opmode = Signal(9)                                   # the port's full width
            m.d.comb += opmode.eq(Mux(self.i_restart, OPMODE_M, OPMODE_PM) if self._preg else OPMODE_M)
            m.submodules.dsp = Instance(
                "DSP48E2",
                p_A_INPUT="CASCADE" if self._cascade else "DIRECT", p_B_INPUT="DIRECT",
                p_AMULTSEL="A", p_BMULTSEL="B", p_PREADDINSEL="A", p_USE_MULT="MULTIPLY",
                p_USE_SIMD="ONE48", p_USE_PATTERN_DETECT="NO_PATDET", p_AUTORESET_PATDET="NO_RESET",
                p_AREG=int(self._ireg), p_ACASCREG=int(self._ireg), p_BREG=int(self._ireg),
                p_BCASCREG=int(self._ireg), p_MREG=1, p_PREG=int(self._preg),
                p_OPMODEREG=int(self._preg),
                p_ADREG=0, p_DREG=0, p_CREG=0, p_INMODEREG=0, p_ALUMODEREG=0, p_CARRYINREG=0,
                p_CARRYINSELREG=0,
                i_CLK=ClockSignal(),
                i_A=Const(0, A_BITS) if self._cascade else _sext(m, self.i_a, A_BITS, "a_port"),
                i_ACIN=self.i_acin if self._cascade else Const(0, A_BITS),
                o_ACOUT=self.o_acout,
                i_B=_sext(m, self.i_b, MUL_B_BITS, "b_port"), i_BCIN=Const(0, MUL_B_BITS),
                i_C=Const(0, P_BITS), i_D=Const(0, 27), i_PCIN=Const(0, P_BITS),
                i_CARRYIN=zero, i_CARRYCASCIN=zero, i_MULTSIGNIN=zero, i_CARRYINSEL=Const(0, 3),
                i_INMODE=Const(0, 5), i_ALUMODE=Const(0, 4),
                i_OPMODE=opmode,
                i_CEA1=zero, i_CEA2=ce if self._ireg else zero, i_CEB1=zero, i_CEB2=ce if self._ireg else zero,
                i_CEM=ce,
                i_CEP=ce if self._preg else zero, i_CECTRL=ce if self._preg else zero, i_CEAD=zero, i_CED=zero,
                i_CEC=zero,
                i_CEINMODE=zero, i_CEALUMODE=zero, i_CECARRYIN=zero,
                i_RSTA=zero, i_RSTB=zero, i_RSTM=zero, i_RSTP=zero, i_RSTCTRL=ResetSignal(), i_RSTD=zero,
                i_RSTC=zero, i_RSTINMODE=zero, i_RSTALUMODE=zero, i_RSTALLCARRYIN=zero,
                o_P=self.o_p,
            )
            return m
        # Behavioural: the same registers.
        a2 = Signal(signed(A_BITS), reset_less=True)
        b2 = Signal(signed(self._b_bits), reset_less=True)
        mreg = Signal(signed(MUL_A_BITS + MUL_B_BITS), reset_less=True)
        restart = Signal()                                        # the OPMODE register (RSTCTRL)
        preg = Signal(signed(P_BITS), reset_less=True)
        if self._ireg:
            with m.If(ce):
                m.d.sync += [a2.eq(a_in), b2.eq(self.i_b)]
        else:
            m.d.comb += [a2.eq(a_in), b2.eq(self.i_b)]
        with m.If(ce):
            m.d.sync += [mreg.eq(a2[:MUL_A_BITS].as_signed() * b2),
                         restart.eq(self.i_restart), preg.eq(mreg + Mux(restart, 0, preg))]
        m.d.comb += [self.o_acout.eq(a2), self.o_p.eq(preg if self._preg else mreg)]
        return m


class DspPairMul(wiring.Component):
    """``P ← (lo + hi·2**shift)·B`` (``+ PCIN``): one B operand times two A operands in one DSP48E2.

    The pre-adder packs the pair (``D = lo``, ``A = hi·2**shift``, ``AD = D + A``), so the product holds
    ``lo·B + hi·B·2**shift`` exactly: the two products, and sums of such words, are fields of one integer that
    the caller separates once, after adding as many words as its fields have room for. With ``pcin`` the slice
    adds the P register of the slice below (``i_pcin``, that slice's ``o_pcout``, wired straight), whose operands
    came a cycle earlier: the first level of an adder tree inside the slices. ``i_keep`` low zeroes the product
    (RSTM, the M register's synchronous reset): a masked lane.

    The pre-adder is 27 bits: the caller keeps ``lo + hi·2**shift`` within them (with ``a_bits + shift = 27``,
    hi above its most negative value).

    Parameters
    ----------
    a_bits : width of lo and hi (2 .. 27 - shift).
    b_bits : width of the B operand (2 .. 18).
    shift : where hi's field starts (1 .. 25).
    pcin : add ``i_pcin`` (OPMODE Z = PCIN).

    Members
    -------
    i_lo, i_hi : In(signed(a_bits))    the two A operands
    i_b : In(signed(b_bits))           B
    i_keep : In(1)                     the product counts (given two cycles after the operands)
    i_pcin : In(signed(48))            (with ``pcin``) the slice below's ``o_pcout``
    o_p, o_pcout : Out(signed(48))     the P register

    Timing: operands in cycle x are in the D, A and first B registers in x + 1, AD and the second B register
    in x + 2, M in x + 3 (zero unless ``i_keep`` in cycle x + 2), P = M (+ ``i_pcin`` of cycle x + 3) in
    x + 4. Configuration (UG579 names): ``AMULTSEL="AD"``, ``PREADDINSEL="A"``, ``INMODE = 00100`` (D + A2,
    B2), ``DREG = ADREG = AREG = 1``, ``BREG = 2``, ``MREG = PREG = 1``, OPMODE M or PCIN + M, no C.
    """

    LATENCY = 4

    def __init__(self, a_bits: int, b_bits: int, *, shift: int, pcin: bool = False):
        with rejecting(self):
            if isinstance(shift, bool) or not isinstance(shift, int) or not 1 <= shift <= MUL_A_BITS - 2:
                raise ValueError(f"DspPairMul shift must be an integer 1..{MUL_A_BITS - 2}, not {shift!r}")
            _check_width("DspPairMul", "a_bits", a_bits, MUL_A_BITS - shift,
                         f" (hi·2**{shift} in the pre-adder's {MUL_A_BITS} bits)")
            _check_width("DspPairMul", "b_bits", b_bits, MUL_B_BITS, " (the DSP48E2 multiplier's B input)")
        self._a_bits, self._b_bits, self._shift, self._pcin = a_bits, b_bits, shift, bool(pcin)
        ports = {"i_lo": In(signed(a_bits)), "i_hi": In(signed(a_bits)), "i_b": In(signed(b_bits)), "i_keep": In(1),
                 "o_p": Out(signed(P_BITS)), "o_pcout": Out(signed(P_BITS))}
        if self._pcin:
            ports["i_pcin"] = In(signed(P_BITS))
        super().__init__(ports)

    def elaborate(self, platform):
        m = Module()
        hi_shifted = Signal(signed(MUL_A_BITS), name="hi_shifted")
        m.d.comb += hi_shifted.eq(self.i_hi.as_signed() << self._shift)
        if uses_xilinx_primitives(platform):
            zero, one = Const(0, 1), Const(1, 1)
            m.submodules.dsp = Instance(
                "DSP48E2",
                p_A_INPUT="DIRECT", p_B_INPUT="DIRECT",
                p_AMULTSEL="AD", p_BMULTSEL="B", p_PREADDINSEL="A", p_USE_MULT="MULTIPLY",
                p_USE_SIMD="ONE48", p_USE_PATTERN_DETECT="NO_PATDET", p_AUTORESET_PATDET="NO_RESET",
                p_AREG=1, p_ACASCREG=1, p_BREG=2, p_BCASCREG=2, p_DREG=1, p_ADREG=1, p_MREG=1, p_PREG=1,
                p_CREG=0, p_OPMODEREG=0, p_INMODEREG=0, p_ALUMODEREG=0, p_CARRYINREG=0, p_CARRYINSELREG=0,
                i_CLK=ClockSignal(),
                i_A=_sext(m, hi_shifted, A_BITS, "a_port"), i_ACIN=Const(0, A_BITS),
                i_B=_sext(m, self.i_b, MUL_B_BITS, "b_port"), i_BCIN=Const(0, MUL_B_BITS),
                i_D=_sext(m, self.i_lo, MUL_A_BITS, "d_port"), i_C=Const(0, P_BITS),
                i_PCIN=self.i_pcin if self._pcin else Const(0, P_BITS), o_PCOUT=self.o_pcout,
                i_CARRYIN=zero, i_CARRYCASCIN=zero, i_MULTSIGNIN=zero, i_CARRYINSEL=Const(0, 3),
                i_INMODE=Const(INMODE_D_PLUS_A2, 5), i_ALUMODE=Const(0, 4),
                i_OPMODE=Const(OPMODE_PCIN_M if self._pcin else OPMODE_M, 9),
                i_CEA1=zero, i_CEA2=one, i_CEB1=one, i_CEB2=one, i_CED=one, i_CEAD=one, i_CEM=one, i_CEP=one,
                i_CEC=zero, i_CECTRL=zero, i_CEINMODE=zero, i_CEALUMODE=zero, i_CECARRYIN=zero,
                i_RSTA=zero, i_RSTB=zero, i_RSTD=zero, i_RSTM=~self.i_keep, i_RSTP=zero, i_RSTCTRL=zero,
                i_RSTC=zero, i_RSTINMODE=zero, i_RSTALUMODE=zero, i_RSTALLCARRYIN=zero,
                o_P=self.o_p,
            )
            return m
        # Behavioural: the same registers.
        dreg = Signal(signed(MUL_A_BITS), reset_less=True)
        areg = Signal(signed(MUL_A_BITS), reset_less=True)
        b1 = Signal(signed(self._b_bits), reset_less=True)
        b2 = Signal(signed(self._b_bits), reset_less=True)
        adreg = Signal(signed(MUL_A_BITS), reset_less=True)
        mreg = Signal(signed(MUL_A_BITS + MUL_B_BITS), reset_less=True)
        preg = Signal(signed(P_BITS), reset_less=True)
        m.d.sync += [dreg.eq(self.i_lo), areg.eq(hi_shifted), b1.eq(self.i_b), b2.eq(b1),
                     adreg.eq((dreg + areg)[:MUL_A_BITS].as_signed()),
                     mreg.eq(Mux(self.i_keep, adreg * b2, 0)),
                     preg.eq(mreg + (self.i_pcin if self._pcin else 0))]
        m.d.comb += [self.o_p.eq(preg), self.o_pcout.eq(preg)]
        return m


def _sext(m: Module, v, width: int, name: str) -> Signal:
    """`v` sign-extended to a primitive port's full width (the instance's ports are connected whole)."""
    wide = Signal(signed(width), name=name)
    m.d.comb += wide.eq(v.as_signed())
    return wide
