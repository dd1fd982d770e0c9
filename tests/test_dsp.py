"""`hdl.dsp.DspMacc`: the behavioural form against a plain Python pipeline model (random operands with
restarts, extreme operands, the A cascade), and the DSP48E2 instance form checked structurally: its
configuration, one slice per PE with the accumulator inside, and the A cascade wired slice to slice.
`hdl.dsp.DspPairMul` (two products in one slice through the pre-adder, the P cascade) likewise."""

import json
import subprocess

import numpy as np
import pytest
from amaranth import Module, signed
from amaranth.back import rtlil
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from amaranth.sim import Simulator

from hdl.dsp import (INMODE_D_PLUS_A2, OPMODE_M, OPMODE_PCIN_M, OPMODE_PM, DspMacc, DspPairMul, XilinxTarget,
                     uses_xilinx_primitives)
from hdl.synth import ROOT, _yosys_command, synthesize
from hdl.systolic import SystolicColumn, SystolicPE


def macc_model(a, b, restart):
    """The UG579 pipeline (AREG = BREG = MREG = PREG = OPMODEREG = 1) one cycle at a time: inputs of
    cycle x are multiplied in x + 2 and added in x + 3; the restart seen in cycle x + 1 picks Z = 0. P is
    48 bits two's complement: a sum past it wraps."""

    def wrap(v):
        return (v + 2 ** 47) % 2 ** 48 - 2 ** 47

    n = len(a)
    p = np.zeros(n + 4, dtype=object)
    areg = breg = mreg = opm = preg = 0
    for x in range(n + 3):
        ax, bx, rx = (int(a[x]), int(b[x]), int(restart[x])) if x < n else (0, 0, 0)
        # Registers update together at the clock edge ending cycle x.
        preg, mreg, opm, areg, breg = wrap(mreg + (0 if opm else preg)), areg * breg, rx, ax, bx
        p[x + 1] = preg
    return p


class TwoMaccs(wiring.Component):
    """Two slices, the second fed by the first's A cascade (a DSP column of two)."""

    def __init__(self, a_bits, b_bits):
        self._bits = a_bits, b_bits
        super().__init__({"a": In(signed(a_bits)), "b": In(signed(b_bits)), "restart": In(1),
                          "p0": Out(signed(48)), "p1": Out(signed(48))})

    def elaborate(self, platform):
        m = Module()
        m.submodules.top = top = DspMacc(*self._bits)
        m.submodules.below = below = DspMacc(*self._bits, cascade=True)
        m.d.comb += [top.i_a.eq(self.a), top.i_b.eq(self.b), top.i_restart.eq(self.restart),
                     below.i_acin.eq(top.o_acout), below.i_b.eq(self.b), below.i_restart.eq(self.restart),
                     self.p0.eq(top.o_p), self.p1.eq(below.o_p)]
        return m


def run_maccs(a, b, restart, a_bits, b_bits):
    dut = TwoMaccs(a_bits, b_bits)
    got0, got1 = [], []

    async def bench(ctx):
        for x in range(len(a) + 4):
            if x < len(a):
                ctx.set(dut.a, int(a[x]))
                ctx.set(dut.b, int(b[x]))
                ctx.set(dut.restart, int(restart[x]))
            else:
                ctx.set(dut.a, 0)
                ctx.set(dut.b, 0)
                ctx.set(dut.restart, 0)
            got0.append(ctx.get(dut.p0))
            got1.append(ctx.get(dut.p1))
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return np.array(got0, dtype=object), np.array(got1, dtype=object)


@pytest.mark.parametrize("a_bits,b_bits,seed", [(23, 8, 0), (27, 18, 1), (5, 3, 2)])
def test_behavioural_macc_against_the_pipeline_model(a_bits, b_bits, seed):
    rng = np.random.default_rng(seed)
    n = 300
    a = rng.integers(-2 ** (a_bits - 1), 2 ** (a_bits - 1), size=n)
    b = rng.integers(-2 ** (b_bits - 1), 2 ** (b_bits - 1), size=n)
    restart = rng.random(n) < 0.15
    # Directed: a long run of the most negative operands (the largest positive products: past 32 bits, and
    # past 48 bits, where P wraps, for 27 x 18), then restarts in consecutive cycles, then the most negative
    # products.
    a[:40], b[:40], restart[:40] = -2 ** (a_bits - 1), -2 ** (b_bits - 1), False
    restart[40:44] = True
    a[44:60], b[44:60] = 2 ** (a_bits - 1) - 1, -2 ** (b_bits - 1)
    want = macc_model(a, b, restart)
    got0, got1 = run_maccs(a, b, restart, a_bits, b_bits)
    np.testing.assert_array_equal(got0, want[:len(got0)])
    # The slice below sees A one cycle later through the cascade, B and restart in the same cycle.
    a_late = np.concatenate([[0], a[:-1]])
    want1 = macc_model(a_late, b, restart)
    np.testing.assert_array_equal(got1, want1[:len(got1)])
    if a_bits + b_bits >= 31:
        assert max(abs(int(v)) for v in want) > 2 ** 32


def test_operand_widths_are_checked():
    with pytest.raises(ValueError, match=r"DspMacc a_bits must be an integer 2..27 \(the DSP48E2"):
        DspMacc(28, 8)
    with pytest.raises(ValueError, match="DspMacc b_bits must be an integer 2..18"):
        DspMacc(20, 19)
    with pytest.raises(ValueError, match="too wide"):
        SystolicPE(23)


def test_opmode_encodings():
    # OPMODE = {W[8:7], Z[6:4], Y[3:2], X[1:0]}; UG579: X = Y = 01 is the multiplier, Z = 010 is P.
    assert (OPMODE_PM & 0b11, OPMODE_PM >> 2 & 0b11, OPMODE_PM >> 4 & 0b111, OPMODE_PM >> 7) == (1, 1, 2, 0)
    assert (OPMODE_M & 0b11, OPMODE_M >> 2 & 0b11, OPMODE_M >> 4 & 0b111, OPMODE_M >> 7) == (1, 1, 0, 0)
    assert uses_xilinx_primitives(XilinxTarget()) and not uses_xilinx_primitives(None)


def _netlist(component, name):
    """Yosys JSON of `component` elaborated for the UltraScale+ target, flattened."""
    out = ROOT / "build" / "test_dsp"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.il").write_text(rtlil.convert(component, name=name, emit_src=False, platform=XilinxTarget()))
    rel = out.relative_to(ROOT)
    script = (f"read_rtlil {rel}/{name}.il; hierarchy -top {name}; proc; flatten; opt -full; "
              f"write_json {rel}/{name}.json")
    subprocess.run(_yosys_command() + ["-q", "-p", script], cwd=ROOT, check=True)
    return json.loads((out / f"{name}.json").read_text())["modules"][name]


def test_instance_configuration_and_the_a_cascade():
    rows, field = 4, 18
    mod = _netlist(SystolicColumn(rows, field), "dsp_column")
    dsps = [c for c in mod["cells"].values() if c["type"] == "DSP48E2"]
    assert len(dsps) == rows
    for c in dsps:
        p = {k: (int(v, 2) if set(v) <= {"0", "1"} and len(v) >= 32 else v) for k, v in c["parameters"].items()}
        assert (p["AREG"], p["ACASCREG"], p["BREG"], p["BCASCREG"], p["MREG"], p["PREG"], p["OPMODEREG"]) == \
            (1, 1, 1, 1, 1, 1, 1)
        assert (p["USE_MULT"], p["USE_SIMD"], p["AMULTSEL"], p["BMULTSEL"]) == \
            ("MULTIPLY", "ONE48", "A", "B")
        assert (p["INMODEREG"], p["ALUMODEREG"], p["CREG"], p["DREG"], p["ADREG"]) == (0, 0, 0, 0, 0)
        conn = c["connections"]
        for port in ("INMODE", "ALUMODE", "CARRYIN", "CARRYINSEL", "C"):
            assert set(conn[port]) == {"0"}, port
        assert set(conn["CEM"]) == set(conn["CEP"]) == set(conn["CEA2"]) == set(conn["CEB2"]) == {"1"}
        # OPMODE: X, Y and W constant; Z[0], Z[2] zero; Z[1] the restart select (a net, not a constant).
        op = conn["OPMODE"]
        assert op[0:4] == ["1", "0", "1", "0"] and op[4] == "0" and op[6] == "0" and op[7:9] == ["0", "0"]
        assert isinstance(op[5], int)
    # Exactly one slice takes A from the fabric; each of the others takes the A cascade straight from
    # another slice's ACOUT, all 30 bits, with nothing in between: one chain through the column.
    direct = [c for c in dsps if c["parameters"]["A_INPUT"] == "DIRECT"]
    cascaded = [c for c in dsps if c["parameters"]["A_INPUT"] == "CASCADE"]
    assert len(direct) == 1 and len(cascaded) == rows - 1
    acouts = {tuple(c["connections"]["ACOUT"]): c for c in dsps}
    for c in cascaded:
        assert len(c["connections"]["ACIN"]) == 30
        assert tuple(c["connections"]["ACIN"]) in acouts
    fed = {id(acouts[tuple(c["connections"]["ACIN"])]) for c in cascaded}
    assert len(fed) == rows - 1


def test_pe_fabric_with_the_instance():
    # In the DSP: A/B/M/P registers and the accumulator. In fabric (Yosys synth_xilinx -family xcup): the
    # activation copy (8), three flag registers (3 x 5) and the capture register (2F, a clock enable and
    # no select logic: the column's drain reads it).
    field = 18
    u = synthesize(SystolicPE(field), "systolic_pe_dsp")
    assert u.dsp == 1
    assert u.ff == 8 + 3 * 5 + 2 * field
    assert u.lut == 0
    u_rtl = synthesize(SystolicPE(field), "systolic_pe_rtl", platform=None)
    assert u_rtl.dsp == 1 and u_rtl.ff > u.ff + 60


def _run_products(dut, a, b, ce):
    """`dut` (a `DspMacc` with ``ce`` and no P register) fed operand pairs and clock enables a cycle at a time
    (restart held high); ``o_p`` in each cycle before its edge."""
    got = []

    async def bench(ctx):
        for x in range(len(a)):
            ctx.set(dut.i_a, int(a[x]))
            ctx.set(dut.i_b, int(b[x]))
            ctx.set(dut.i_ce, int(ce[x]))
            ctx.set(dut.i_restart, 1)
            got.append(ctx.get(dut.o_p))
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return got


def test_behavioural_product_with_clock_enables_and_no_p_register():
    """`DspMacc(ce=True, preg=False)` (IntScaleMul's product): A and B into their registers in cycles with
    ``i_ce``, the product into M in the next such cycle, ``o_p`` the M register: an independent model of
    enable-gated registers, 30 % of the cycles stalled."""
    rng = np.random.default_rng(5)
    n = 200
    a = rng.integers(-2 ** 25, 2 ** 25, size=n)
    b = rng.integers(-2 ** 11, 2 ** 11, size=n)
    ce = rng.random(n) >= 0.3
    got = _run_products(DspMacc(26, 12, ce=True, preg=False), a, b, ce)
    a2 = b2 = mreg = 0
    want = []
    for x in range(n):
        want.append(mreg)
        if ce[x]:
            a2, b2, mreg = int(a[x]), int(b[x]), a2 * b2
    assert got == want and any(v != 0 for v in want)


def test_product_without_input_registers():
    """`DspMacc(ce=True, preg=False, ireg=False)` (FpMul's partial products, fed from fabric registers): the
    operands of a cycle with ``i_ce`` go straight into the multiplier and their product is in M the next
    cycle (an independent model, 30 % of the cycles stalled); the instance has no A or B register and keeps
    M; a cascade, which leaves from the A register, is refused."""
    rng = np.random.default_rng(6)
    n = 200
    a = rng.integers(-2 ** 24, 2 ** 24, size=n)
    b = rng.integers(-2 ** 17, 2 ** 17, size=n)
    a[:5], b[:5] = -2 ** 24, -2 ** 17
    ce = rng.random(n) >= 0.3
    got = _run_products(DspMacc(25, 18, ce=True, preg=False, ireg=False), a, b, ce)
    mreg, want = 0, []
    for x in range(n):
        want.append(mreg)
        if ce[x]:
            mreg = int(a[x]) * int(b[x])
    assert got == want and 2 ** 41 in want

    mod = _netlist(DspMacc(25, 18, ce=True, preg=False, ireg=False), "dsp_noireg")
    (c,) = [c for c in mod["cells"].values() if c["type"] == "DSP48E2"]
    p = {k: (int(v, 2) if set(v) <= {"0", "1"} and len(v) >= 32 else v) for k, v in c["parameters"].items()}
    assert (p["AREG"], p["ACASCREG"], p["BREG"], p["BCASCREG"], p["MREG"], p["PREG"]) == (0, 0, 0, 0, 1, 0)
    assert set(c["connections"]["CEA2"]) == set(c["connections"]["CEB2"]) == {"0"}
    assert isinstance(c["connections"]["CEM"][0], int)
    with pytest.raises(ValueError, match="cascade needs ireg"):
        DspMacc(25, 18, cascade=True, ireg=False)


class PairOfPairs(wiring.Component):
    """Two `DspPairMul`, the upper one adding the lower one's P through the P cascade (a lane pair of
    `hdl.gemv.SegmentMac` with ``pairs``)."""

    def __init__(self, a_bits, b_bits, shift):
        self._args = a_bits, b_bits, shift
        ops = {f"{n}{k}": In(signed(a_bits if n != "b" else b_bits)) for n in ("lo", "hi", "b") for k in (0, 1)}
        super().__init__({**ops, "keep0": In(1), "keep1": In(1), "p0": Out(signed(48)), "p1": Out(signed(48))})

    def elaborate(self, platform):
        m = Module()
        a_bits, b_bits, shift = self._args
        m.submodules.low = low = DspPairMul(a_bits, b_bits, shift=shift)
        m.submodules.up = up = DspPairMul(a_bits, b_bits, shift=shift, pcin=True)
        for k, d in enumerate((low, up)):
            m.d.comb += [d.i_lo.eq(getattr(self, f"lo{k}")), d.i_hi.eq(getattr(self, f"hi{k}")),
                         d.i_b.eq(getattr(self, f"b{k}")), d.i_keep.eq(getattr(self, f"keep{k}"))]
        m.d.comb += [up.i_pcin.eq(low.o_pcout), self.p0.eq(low.o_p), self.p1.eq(up.o_p)]
        return m


def test_pair_products_through_the_pre_adder_and_the_p_cascade():
    """`DspPairMul`: P(x + 4) = keep(x + 2) ? (lo + hi·2**shift)·b : 0, of the operands of cycle x, and the
    upper slice adds the lower one's P of the cycle before (an independent cycle model: inputs, pipeline
    delays, the sum). Random operands over the quantiser's range with random masks, and the extremes of the
    27-bit pre-adder (hi at ±127 with shift 19)."""
    rng = np.random.default_rng(9)
    n, shift = 300, 19
    ops = {f"{k}{j}": rng.integers(-127, 128, n) for k in ("lo", "hi") for j in (0, 1)}
    ops.update({f"b{j}": rng.integers(-128, 128, n) for j in (0, 1)})
    ops.update({f"keep{j}": (rng.random(n) >= 0.2).astype(int) for j in (0, 1)})
    for j in (0, 1):
        ops[f"lo{j}"][:8], ops[f"hi{j}"][:8], ops[f"b{j}"][:8] = -127, 127, -128
        ops[f"lo{j}"][8:16], ops[f"hi{j}"][8:16], ops[f"b{j}"][8:16] = 127, -127, -128
    dut = PairOfPairs(8, 8, shift)
    got = []

    async def bench(ctx):
        for x in range(n + 6):
            for name, v in ops.items():
                ctx.set(getattr(dut, name), int(v[x]) if x < n else 0)
            got.append((ctx.get(dut.p0), ctx.get(dut.p1)))
            await ctx.tick()

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()

    def prod(j, x):          # the product of operands of cycle x, masked by keep of cycle x + 2
        if not 0 <= x < n or (x + 2 < n and not ops[f"keep{j}"][x + 2]) or x + 2 >= n:
            return 0
        return (int(ops[f"lo{j}"][x]) + int(ops[f"hi{j}"][x]) * 2 ** shift) * int(ops[f"b{j}"][x])

    for x in range(n + 6):   # p0 before the edge ending cycle x: the product of cycle x - 4
        assert got[x][0] == prod(0, x - 4), x
        assert got[x][1] == prod(1, x - 4) + prod(0, x - 5), x
    assert max(abs(p) for p, _ in got) >= 127 * 2 ** shift * 128 - 127 * 128

    mod = _netlist(PairOfPairs(8, 8, shift), "dsp_pairs")
    dsps = [c for c in mod["cells"].values() if c["type"] == "DSP48E2"]
    assert len(dsps) == 2
    for c in dsps:
        p = {k: (int(v, 2) if set(v) <= {"0", "1"} and len(v) >= 32 else v) for k, v in c["parameters"].items()}
        assert (p["AMULTSEL"], p["PREADDINSEL"], p["BMULTSEL"], p["USE_MULT"]) == ("AD", "A", "B", "MULTIPLY")
        assert (p["AREG"], p["BREG"], p["DREG"], p["ADREG"], p["MREG"], p["PREG"], p["CREG"]) == (1, 2, 1, 1, 1, 1, 0)
        conn = c["connections"]
        assert conn["INMODE"] == [str(INMODE_D_PLUS_A2 >> i & 1) for i in range(5)]
        assert isinstance(conn["RSTM"][0], int)                      # the mask, a net
    ops_ = sorted(int("".join(reversed(c["connections"]["OPMODE"])), 2) for c in dsps)
    assert ops_ == sorted([OPMODE_M, OPMODE_PCIN_M])
    (low,) = [c for c in dsps if int("".join(reversed(c["connections"]["OPMODE"])), 2) == OPMODE_M]
    (up,) = [c for c in dsps if c is not low]
    assert up["connections"]["PCIN"] == low["connections"]["PCOUT"]   # the cascade, straight


def test_pair_product_widths_are_checked():
    with pytest.raises(ValueError, match=r"DspPairMul a_bits must be an integer 2..8"):
        DspPairMul(9, 8, shift=19)
    with pytest.raises(ValueError, match="DspPairMul shift must be an integer 1..25"):
        DspPairMul(2, 8, shift=26)
