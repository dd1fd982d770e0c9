"""`hdl.timing`: the worst paths of hand-made netlists with known answers (a LUT chain, carry chains, DSP48E2
and block RAM end points, a combinational loop, paths through a kept block's ports), a real Yosys run on
small components, the report, the build's cache key, and `firmware.perf --clock-mhz`."""

import json
import math

import pytest
from amaranth import Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl import build
from hdl.config import HardwareConfig
from hdl.synth import Utilisation, synthesize
from hdl.timing import (DELAYS as D, TARGET_MARGIN, BlockTiming, Path, analyse_module, analyse_netlist,
                        budget_ns, fmax_mhz, format_timing, group_timing)

_OUT = {"O", "Q", "CO", "P", "DOUTADOUT", "DOUTBDOUT", "DOUT_A"}


class Net:
    """A hand-made ``write_json`` module: cells by name, ports, and a fresh bit per net."""

    def __init__(self):
        self.cells, self.ports, self.bits = {}, {}, 1

    def bit(self, width=1):
        bits = list(range(self.bits + 1, self.bits + 1 + width))
        self.bits += width
        return bits

    def cell(self, name, ctype, params=None, **conns):
        conns = {p: (b if isinstance(b, list) else [b]) for p, b in conns.items()}
        self.cells[name] = {"type": ctype, "parameters": params or {}, "connections": conns,
                            "port_directions": {p: "output" if p in _OUT else "input" for p in conns}}

    def ff(self, name, d):
        q = self.bit()[0]
        self.cell(name, "FDRE", C=self.clk, CE=["1"], R=["0"], D=d, Q=q)
        return q

    def lut(self, name, *ins):
        o = self.bit()[0]
        self.cell(name, f"LUT{len(ins)}", **{f"I{i}": b for i, b in enumerate(ins)}, O=o)
        return o

    def port(self, name, direction, bits):
        self.ports[name] = {"direction": direction, "bits": bits}

    def module(self):
        names = {f"n{b}": {"hide_name": 0, "bits": [b]} for b in range(2, self.bits + 1)}
        return {"ports": self.ports, "cells": self.cells, "netnames": names}

    @property
    def clk(self):
        if "clk" not in self.ports:
            self.port("clk", "input", [1])
        return 1


def _lut_chain(n):
    net = Net()
    q = net.ff("a", net.bit())
    for i in range(n):
        q = net.lut(f"l{i}", q)
    net.ff("b", q)
    return net


@pytest.mark.parametrize("n", [0, 1, 3, 7])
def test_a_chain_of_n_luts_between_two_flip_flops_is_n_levels(n):
    t = analyse_module(_lut_chain(n).module())
    assert t.reg.levels == t.max_levels == n
    assert t.reg.delay == pytest.approx(D["ff_cko"] + n * (D["net"] + D["lut"]) + D["net"] + D["ff_setup"])
    assert "(FDRE Q)" in t.reg.start and "(FDRE D)" in t.reg.end


def test_carry_chains_count_as_vivado_counts_carry8():
    # A 32-bit adder as Yosys maps it: a LUT2, then eight CARRY4 (four CARRY8 in Vivado): five levels.
    net = Net()
    s = net.lut("p", net.ff("a", net.bit()), net.ff("b", net.bit()))
    co = None
    for i in range(8):
        out = net.bit(4)
        net.cell(f"c{i}", "CARRY4", S=[s] * 4, DI=["0"] * 4, CI=[co] if co else ["0"], CO=out, O=net.bit(4))
        co = out[3]
    net.ff("sum", co)
    t = analyse_module(net.module())
    assert t.reg.levels == 5
    assert t.reg.delay == pytest.approx(D["ff_cko"] + D["net"] + D["lut"] + D["net_local"] + D["carry4"] +
                                        7 * D["carry4_ci"] + D["net"] + D["ff_setup"])
    # Four CARRY8 are four levels.
    net = Net()
    s = net.lut("p", net.ff("a", net.bit()))
    co = None
    for i in range(4):
        out = net.bit(8)
        net.cell(f"c{i}", "CARRY8", S=[s] * 8, DI=["0"] * 8, CI=[co] if co else ["0"], CO=out, O=net.bit(8))
        co = out[7]
    net.ff("sum", co)
    assert analyse_module(net.module()).reg.levels == 5


def test_dsp_and_block_ram_are_start_and_end_points_with_their_own_delays():
    net = Net()
    a = net.lut("pre", net.ff("x", net.bit()))
    p = net.bit(48)
    # No input register, MREG only: A's setup runs through the multiplier; P comes from MREG.
    net.cell("mul", "DSP48E2", {"AREG": 0, "BREG": 0, "MREG": 1, "PREG": 0}, CLK=[1], A=[a] * 30, B=["0"] * 18, P=p)
    net.ff("y", net.lut("post", p[0]))
    t = analyse_module(net.module())
    into = D["ff_cko"] + D["net"] + D["lut"] + D["net"] + D["dsp_setup_mreg"]
    out = D["dsp_cko_mreg"] + D["net"] + D["lut"] + D["net"] + D["ff_setup"]
    assert t.reg.delay == pytest.approx(max(into, out)) and t.reg.levels == 1
    assert "DSP48E2" in (t.reg.start if out > into else t.reg.end)
    # A DSP48E2 with no register is a combinational cell on the path.
    net = Net()
    p = net.bit(48)
    net.cell("mul", "DSP48E2", {"AREG": 0, "BREG": 0, "MREG": 0, "PREG": 0}, CLK=[1], A=[net.ff("x", net.bit())],
             B=["0"] * 18, P=p)
    net.ff("y", p[0])
    t = analyse_module(net.module())
    assert t.reg.levels == 1 and t.reg.delay == pytest.approx(D["ff_cko"] + D["net"] + D["dsp_comb"] + D["net"] +
                                                              D["ff_setup"])
    # A block RAM without output register starts a path late; with it, early.
    for reg, cko in ((0, D["bram_cko"]), (1, D["bram_cko_reg"])):
        net = Net()
        do = net.bit(32)
        net.cell("ram", "RAMB36E2", {"DOA_REG": reg}, CLKARDCLK=[1], ADDRARDADDR=[net.ff("ad", net.bit())] * 15,
                 DOUTADOUT=do)
        net.ff("r", net.lut("l", do[0]))
        t = analyse_module(net.module())
        assert t.reg.delay == pytest.approx(cko + D["net"] + D["lut"] + D["net"] + D["ff_setup"])
        assert "RAMB36E2 DOUTADOUT" in t.reg.start


def test_a_combinational_loop_is_reported_and_the_rest_analysed():
    net = Net()
    a, b = net.bit()[0], net.bit()[0]
    net.cell("x", "LUT2", I0=net.ff("f", net.bit()), I1=b, O=a)
    net.cell("y", "LUT1", I0=a, O=b)
    net.ff("g", b)
    q = net.ff("h", net.bit())
    net.ff("k", net.lut("m", net.lut("n", q)))
    t = analyse_module(net.module())
    assert t.loop_cells == 2
    assert t.reg.levels == 2 and t.reg.end.startswith("n")


def test_paths_through_a_kept_blocks_ports_are_cut_there():
    # top: input port -> LUT -> sub's input; sub's output -> LUT -> FF -> output port. sub: input -> 2 LUTs -> FF.
    top = Net()
    i = top.bit()
    top.port("i", "input", i)
    x = top.lut("t0", i[0])
    y = top.bit()[0]
    top.cells["u"] = {"type": "top.sub", "parameters": {}, "connections": {"a": [x], "z": [y]},
                      "port_directions": {"a": "input", "z": "output"}}
    q = top.ff("r", top.lut("t1", y))
    top.port("o", "output", [q])
    sub = Net()
    a = sub.bit()
    sub.port("a", "input", a)
    z = sub.ff("s", sub.lut("s1", sub.lut("s0", a[0])))
    sub.port("z", "output", [z])
    blocks = analyse_netlist({"modules": {"top": top.module(), "top.sub": sub.module(),
                                          "LUT1": {"attributes": {"blackbox": 1}, "ports": {}, "cells": {}}}}, "top")
    assert set(blocks) == {"(top)", "sub"}
    t, s = blocks["(top)"], blocks["sub"]
    # In top, the instance's output is an input port (no delay), its input an output port.
    assert t.reg is None
    assert t.inp.levels == 1 and t.inp.start.endswith("(top.sub z)") and t.inp.delay == pytest.approx(
        D["net"] + D["lut"] + D["net"] + D["ff_setup"])
    assert t.thru.levels == 1 and t.thru.start.startswith("port ") and "top.sub a" in t.thru.end
    assert t.out.delay == pytest.approx(D["ff_cko"]) and t.out.end == "port o"
    assert s.reg is None and s.inp.levels == 2 and s.out.delay == pytest.approx(D["ff_cko"])
    # The unit is the worst of its blocks; each path says in which block it is.
    g = group_timing(blocks, 1)
    assert g["sub"].inp.end.endswith("in sub")


def test_budget_fmax_and_the_report():
    assert budget_ns(300) == pytest.approx((1 - TARGET_MARGIN) * 1e3 / 300)
    assert fmax_mhz(budget_ns(300)) == pytest.approx(300)
    assert math.isinf(fmax_mhz(0))
    slow = BlockTiming("slow", reg=Path(4.0, 9, "a (FDRE Q)", "b (FDRE D)"), max_levels=9)
    fast = BlockTiming("fast", reg=Path(1.0, 2, "c (FDRE Q)", "d (FDRE D)"), max_levels=2,
                       inp=Path(0.5, 1, "port i", "e (FDRE D)"), loop_cells=3)
    lines = format_timing({"fast": fast, "slow": slow, "none": BlockTiming("none")}, 300).splitlines()
    assert lines[0].split()[:4] == ["unit", "levels", "ns", "fmax"]
    assert lines[1].split()[:10] == ["slow", "9", "4.00", f"{fmax_mhz(4.0):.0f}", "OVER", "9", "4.00", "-", "-",
                                     "reg->reg:"]
    assert lines[2].split()[:9] == ["fast", "2", "1.00", f"{fmax_mhz(1.0):.0f}", "ok", "2", "1.00", "0.50", "-"]
    assert "combinational loop: 3 cells" in lines[2] and lines[3].split()[0] == "none" and "no path" in lines[3]
    # A block whose worst path ends at its port: that path is its worst.
    port = BlockTiming("p", reg=Path(1.0, 2, "a", "b"), out=Path(3.5, 8, "c (FDRE Q)", "port o"))
    assert port.worst == ("reg->out", port.out)
    assert "reg->out: c (FDRE Q) -> port o" in format_timing({"p": port}, 300)
    hw = HardwareConfig.preset("kv260")
    util = Utilisation("x", 0, 0, 0, 0, 0, blocks={"slow": None, "fast": None}, timing={"slow": slow, "fast": fast})
    printed, saved = build._timing_report(util, hw, 1)
    assert "1 unit(s) over 300 MHz (slow)" in printed
    reach = math.floor(fmax_mhz(4.0))          # 212.5 MHz: the clock a build for it takes, rounded down
    assert f"`python -m firmware.perf --clock-mhz {reach}`" in printed and "by block" in saved
    assert f"`python -m hdl.build --clock-mhz {reach}`" in printed


def test_cache_key_and_the_cached_timing():
    key = build._cache_key("design", "top", 3)
    assert key != build._cache_key("design", "top", 2)
    old = __import__("hashlib").sha256(b"design" + b"\0top=top\0keep_depth=3\0uram=1").hexdigest()
    assert key != old               # a cached estimate without the timing is not reused
    model = build.TIMING_MODEL
    try:
        build.TIMING_MODEL = model + 1
        assert build._cache_key("design", "top", 3) != key
    finally:
        build.TIMING_MODEL = model
    util = Utilisation.from_cells("x", {"LUT6": 3})
    util.timing = {"(top)": BlockTiming("(top)", reg=Path(1.5, 3, "a", "b"), max_levels=4)}
    again = build._util_from_json(json.loads(json.dumps(build._util_to_json(util))))
    assert again.timing == util.timing and again.lut == 3


class _Adder(wiring.Component):
    a: In(32)
    b: In(32)
    o: Out(32)

    def elaborate(self, platform):
        m = Module()
        ra, rb = Signal(32), Signal(32)
        m.d.sync += [ra.eq(self.a), rb.eq(self.b), self.o.eq(ra + rb)]
        return m


class _Mux(wiring.Component):
    sel: In(8)
    data: In(256)
    o: Out(1)

    def elaborate(self, platform):
        m = Module()
        rs, rd = Signal(8), Signal(256)
        m.d.sync += [rs.eq(self.sel), rd.eq(self.data), self.o.eq(rd.bit_select(rs, 1))]
        return m


def test_yosys_a_32_bit_adder_and_a_256_to_1_mux_between_registers():
    add = synthesize(_Adder(), "timing_adder")
    t = add.timing["(top)"]
    assert 4 <= t.reg.levels <= 6, t            # a LUT and four CARRY8 in Vivado
    assert t.reg.delay < budget_ns(300)
    mux = synthesize(_Mux(), "timing_mux")
    t = mux.timing["(top)"]
    assert 3 <= t.reg.levels <= 7, t            # LUT6 + MUXF7 + MUXF8 per 16:1, twice
    assert t.reg.end.startswith("o ") and "(FDRE Q)" in t.reg.start


def test_perf_takes_the_clock(capsys):
    from firmware import perf
    with pytest.raises(SystemExit) as e:
        perf.main(["--clock-mhz", "0"])
    assert e.value.code == 2 and "argument --clock-mhz: must be a number of MHz in [1, 1000], not '0'" in \
        capsys.readouterr().err
    rates = {}
    for mhz in ("100", "50"):
        perf.main(["--model", "tiny", "--hw", "tiny", "--positions", "0", "--prefill", "--clock-mhz", mhz])
        out = capsys.readouterr().out
        assert f"at {mhz} MHz" in out.splitlines()[0]
        row = next(line for line in out.splitlines() if line.split()[:1] == ["0"])
        rates[mhz] = float(row.split()[-3])
    assert rates["50"] < rates["100"]


def test_the_unit_command_line_rejects_bad_input_in_one_line():
    import subprocess
    import sys
    from hdl.synth import ROOT
    proc = subprocess.run([sys.executable, "-m", "hdl.timing", "nonesuch"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'nonesuch'" in proc.stderr and "Traceback" not in proc.stderr
    # an act_block the preset cannot take: refused before anything is built
    proc = subprocess.run([sys.executable, "-m", "hdl.timing", "gemv", "--act-block", "48"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == ("python -m hdl.timing: error: argument --act-block: act_block must be a "
                                            "power of two, not 48")


def test_the_unit_command_line_takes_the_v_layout(capsys):
    """``--kv-v-layout`` builds the unit on the preset with that V layout (rows: the GEMV engine with INT8 weights); on a
    preset whose KV cache is binary16 it is one line on stderr and exit status 2, before anything is built."""
    from hdl.gemv import command_layout
    from hdl.timing import main, unit_config
    hw = unit_config("kv260", "rows")
    assert hw.gemv_int8 and "int8" in command_layout(hw).members and unit_config("kv260").gemv_int8
    assert not unit_config("kv260", "planes").gemv_int8
    with pytest.raises(SystemExit) as e:
        main(["gemv", "--hw", "tiny_fp16", "--kv-v-layout", "rows"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert e.value.code == 2 and len(lines) == 1 and "--kv-v-layout" in lines[0] and "Traceback" not in err


class _Boxed(wiring.Component):
    a: In(32)
    o: Out(32)

    def elaborate(self, platform):
        m = Module()
        m.d.sync += self.o.eq(self.a * self.a)
        return m


class _AroundBox(wiring.Component):
    a: In(32)
    o: Out(32)

    def elaborate(self, platform):
        m = Module()
        m.submodules.inner = inner = _Boxed()
        r = Signal(32)
        m.d.sync += [r.eq(self.a), self.o.eq(inner.o + 1)]
        m.d.comb += inner.a.eq(r)
        return m


def test_a_black_box_is_a_boundary_of_its_unit():
    """`blackbox_modules` (the `ctl` unit's large parts): the module keeps its ports only, Yosys keeps its
    instance as a cell of a module it does not synthesise, and the paths around it end and start at its ports."""
    from amaranth.back import rtlil

    from hdl.timing import BLACK_BOXES, UNITS, blackbox_modules
    assert "ctl" in UNITS and set(BLACK_BOXES) <= set(UNITS)
    dut = _AroundBox()
    text = blackbox_modules(rtlil.convert(dut, name="timing_bbox", emit_src=False), "timing_bbox", ["inner"])
    boxed = text[text.index("module \\timing_bbox.inner\n"):]
    boxed = boxed[:boxed.index("\nend\n")].splitlines()[1:]
    assert "attribute \\blackbox 1\nmodule \\timing_bbox.inner\n" in text
    assert len(boxed) == 4 and all(line.startswith("  wire ") for line in boxed), boxed     # clk, rst, a, o
    util = synthesize(dut, "timing_bbox", keep_depth=1, rtlil_text=text)
    assert "inner" not in util.blocks and util.dsp == 0         # the multiplier is not synthesised
    t = util.timing["(top)"]
    assert "timing_bbox.inner" in t.out.end and "timing_bbox.inner" in t.inp.start, t
