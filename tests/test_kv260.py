"""The KV260 system: the platform's Vivado files, the system top's netlist, the Kria app, the build.

The netlist checks read the Verilog the platform wrote back through Yosys (``write_json``: every
connection as bits), so what is checked is what Vivado would read; the device-tree checks compile the
overlay and the reserved-memory fragment with dtc, decompile them and apply the overlay to a base tree with
the Kria labels (``fdtoverlay``). Expected values come from `hdl.memory_map`, `hdl.csr_map`, `hdl.config`
and the AXI bindings, not from the code under test.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from amaranth import Cat, Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl import csr_map
from hdl.axi import AxiSignature
from hdl.build import BuildError, build, main
from hdl.config import PRESETS, XCK26
from hdl.kv260 import KV260Platform, Kv260System, check_core, mmcm_config
from hdl.memory_map import MEMORY_MAPS
from hdl.synth import ROOT, _yosys_command

KV260_MAP = MEMORY_MAPS["kv260"]
HP_PRIMITIVE = ("SAXIGP2", "SAXIGP3", "SAXIGP4", "SAXIGP5")          # S_AXI_HP0..3_FPD on the PS8
# xlnx,afi-fpga binding: AFIFM read/write control values per fabric width.
AFI_WIDTH = {128: 0, 64: 1, 32: 2}


class ProbeCore(wiring.Component):
    """A core of the system's shape: every output a register, every input folded into one, so each port
    stays a port of the core's own module in the netlist."""

    def __init__(self, hw, *, ports=None, csr=None, irq=1):
        members = {"s_axi": In(csr or AxiSignature(40, 128, 16)), "o_irq": Out(irq)}
        for p in range(hw.axi_ports if ports is None else ports):
            members[f"m_axi{p}"] = Out(AxiSignature.from_config(hw))
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        ins, outs = [], []
        for _path, member, value in self.signature.flatten(self):
            (ins if member.flow == In else outs).append(value)
        acc = Signal(32)
        bits = Cat(*ins)
        fold = acc
        for k in range(0, len(bits), 32):
            fold = fold ^ bits[k:k + 32]
        m.d.sync += acc.eq(fold)
        for k, out in enumerate(outs):
            m.d.sync += out.eq(Cat(*[acc] * (len(out) // 32 + 1))[:len(out)] ^ k)
        return m


def _emit(hw_name, tmp_path, core=None, name="sys"):
    hw = PRESETS[hw_name]
    system = Kv260System(hw, core or ProbeCore(hw))
    KV260Platform().build(system, name=name, do_build=False, emit_src=False).extract(tmp_path)
    return system


def _netlist(verilog: Path, top: str) -> dict:
    """The top module of `verilog` as Yosys reads it (the vendor cells from its own cells_xtra.v)."""
    out = verilog.with_suffix(".json")
    proc = subprocess.run(_yosys_command() + ["-q", "-p", f"read_verilog -lib +/xilinx/cells_xtra.v; "
                                              f"read_verilog {verilog.name}; hierarchy -top {top}; proc; "
                                              f"opt_clean; write_json {out.name}"],
                          cwd=verilog.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["modules"][top]


def _cell(top, kind):
    cells = [c for c in top["cells"].values() if c["type"] == kind or c["type"].endswith("." + kind)]
    assert len(cells) == 1, (kind, [c["type"] for c in top["cells"].values()])
    return cells[0]


# --- the platform ------------------------------------------------------------------------------------
def test_platform_part_and_hooks(tmp_path):
    _emit("kv260", tmp_path)
    tcl = (tmp_path / "sys.tcl").read_text()
    xdc = (tmp_path / "sys.xdc").read_text()
    # The part: the device whose budget hdl.config keeps.
    assert f"-part {XCK26.name}" in tcl
    assert "xck26-sfvc784-2LV-c" in tcl
    # DONT_TOUCH on the PS8 cell once there is a netlist, with a check that the cell is there.
    synth, dont_touch = tcl.index("synth_design -top sys"), tcl.index("set_property DONT_TOUCH true [get_cells PS8_i]")
    assert synth < dont_touch < tcl.index("opt_design")
    assert "error \"no PS8 cell PS8_i" in tcl
    # The .bit.bin after the bitstream: bootgen's processed bitstream, else Vivado's -bin_file output.
    write = tcl.index("write_bitstream -force -bin_file sys.bit")
    bootgen = tcl.index("bootgen -w -arch zynqmp -process_bitstream bin -image sys.bif")
    assert write < bootgen < tcl.index("\nquit")
    assert "file copy -force sys.bin sys.bit.bin" in tcl
    # pl_clk0 (the overlay's 100 MHz) on the PS8's PLCLK[0] pin; the bitstream compressed; the fan pin.
    assert re.search(r"create_clock -name pl_clk0 -period 10\.000 \[get_pins \{PS8_i/PLCLK\[0\]\}\]", xdc)
    assert "set_property BITSTREAM.GENERAL.COMPRESS TRUE [current_design]" in xdc
    assert 'set_property LOC A12 [get_ports "fan_0__io"]' in xdc
    assert 'set_property IOSTANDARD "LVCMOS33" [get_ports "fan_0__io"]' in xdc
    script = (tmp_path / "build_sys.sh").read_text()
    assert "-source sys.tcl" in script and "VIVADO" in script


# --- the system top's netlist ------------------------------------------------------------------------
@pytest.mark.parametrize("hw_name", ["kv260", "tiny"])
def test_system_netlist(tmp_path, hw_name):
    hw = PRESETS[hw_name]
    _emit(hw_name, tmp_path)
    top = _netlist(tmp_path / "sys.v", "sys")
    ps, core = _cell(top, "PS8"), _cell(top, "core")
    bufg_ps, mmcm, bufg = _cell(top, "BUFG_PS"), _cell(top, "MMCME4_ADV"), _cell(top, "BUFG")
    pc, cc = ps["connections"], core["connections"]
    assert ps["attributes"].get("DONT_TOUCH") == "TRUE"

    # Clocks: PLCLK[0] -> BUFG_PS -> MMCM -> BUFG -> the core's clock and every PS port clock it uses.
    assert bufg_ps["connections"]["I"] == pc["PLCLK"][:1]
    assert mmcm["connections"]["CLKIN1"] == bufg_ps["connections"]["O"]
    assert mmcm["connections"]["CLKFBIN"] == mmcm["connections"]["CLKFBOUT"]
    assert bufg["connections"]["I"] == mmcm["connections"]["CLKOUT0"]
    clk = bufg["connections"]["O"]
    assert cc["clk"] == clk and pc["MAXIGP0ACLK"] == clk
    # The MMCM's setting, read from the netlist, makes hw.clock_hz from 100 MHz within 0.1 %, the VCO
    # inside 800-1600 MHz (DS925).
    p = mmcm["parameters"]
    f_in = 1e3 / float(p["CLKIN1_PERIOD"])                                   # MHz
    d, mult, o = int(p["DIVCLK_DIVIDE"], 2), float(p["CLKFBOUT_MULT_F"]), float(p["CLKOUT0_DIVIDE_F"])
    assert f_in == 100.0
    assert 800 <= f_in * mult / d <= 1600
    assert abs(f_in * mult / (d * o) * 1e6 - hw.clock_hz) <= 1e-3 * hw.clock_hz
    assert mmcm["connections"]["LOCKED"] != ["0"]

    # HPM0 (PS master) to the CSR port: everything the PS drives goes to the core, and back.
    sig = AxiSignature(40, 128, 16)
    for name in sig.members:
        port = "MAXIGP0" + name.upper()
        assert pc[port][:len(cc[f"s_axi__{name}"])] == cc[f"s_axi__{name}"], port

    # HP0..3 = SAXIGP2..5: the core's masters, addresses and IDs zero-extended to 49 and 6 bits, data on
    # the low lanes of the 128-bit primitive port; unused ports idle with their clocks tied.
    sig = AxiSignature.from_config(hw)
    for k, prefix in enumerate(HP_PRIMITIVE):
        if k < hw.axi_ports:
            assert pc[f"{prefix}RCLK"] == clk and pc[f"{prefix}WCLK"] == clk
            for name, member in sig.members.items():
                port, mine = pc[prefix + name.upper()], cc[f"m_axi{k}__{name}"]
                assert port[:len(mine)] == mine, (prefix, name)
                if member.flow == Out:          # the core drives: the PS port's upper bits are zero
                    assert set(port[len(mine):]) <= {"0"}, (prefix, name)
            assert len(pc[prefix + "ARADDR"]) == 49 and len(pc[prefix + "WDATA"]) == 128
        else:
            assert pc[f"{prefix}ARVALID"] == ["0"] and pc[f"{prefix}AWVALID"] == ["0"]
            assert pc[f"{prefix}RCLK"] == ["0"]

    # The interrupt on pl_ps_irq0[0], the rest of the byte low; the wrappers' tie-highs; PL reset 0.
    assert pc["PLPSIRQ0"] == cc["o_irq"] + ["0"] * 7
    for port in ("NFIQ0LPDRPU", "NFIQ1LPDRPU", "NIRQ0LPDRPU", "NIRQ1LPDRPU"):
        assert pc[port] == ["1"], port
    reset_sync = _cell(top, "reset_sync")
    assert mmcm["connections"]["RST"] == reset_sync["connections"]["pl_reset"]
    assert reset_sync["connections"]["locked"] == mmcm["connections"]["LOCKED"]
    assert cc["rst"] == reset_sync["connections"]["rst"]


def test_system_drives_the_fan_on(tmp_path):
    """fan_en_b is active low: the system drives the pad low, its output always enabled."""
    _emit("tiny", tmp_path)
    out = tmp_path / "flat.json"
    proc = subprocess.run(_yosys_command() + ["-q", "-p", "read_verilog -lib +/xilinx/cells_xtra.v; "
                                              "read_verilog sys.v; "
                                              "hierarchy -top sys; proc; flatten; opt; write_json flat.json"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    top = json.loads(out.read_text())["modules"]["sys"]
    obuf = _cell(top, "OBUFT")["connections"]
    assert obuf["O"] == top["ports"]["fan_0__io"]["bits"]
    assert obuf["I"] == ["0"] and obuf["T"] == ["0"]


# --- the clock ---------------------------------------------------------------------------------------
def test_mmcm_config_values_and_limits():
    for hz in (300e6, 100e6, 250e6, 333.333e6, 187.5e6):
        c = mmcm_config(100e6, hz)
        vco = 100e6 * float(c.mult) / c.divclk
        assert 800e6 <= vco <= 1600e6 and 10e6 <= 100e6 / c.divclk <= 450e6
        assert abs(vco / float(c.divide) - hz) <= 1e-3 * hz
        assert (float(c.mult) * 8).is_integer() and (float(c.divide) * 8).is_integer()
    # 300 MHz: the highest VCO with integer ratios (1500 MHz: M = 15, D = 1, O = 5).
    c = mmcm_config(100e6, 300e6)
    assert (c.divclk, c.mult, c.divide) == (1, 15, 5)
    with pytest.raises(ValueError, match="unreachable"):
        mmcm_config(100e6, 800e6)
    with pytest.raises(ValueError, match="unreachable"):
        mmcm_config(100e6, 1e6)
    with pytest.raises(ValueError, match="positive number of Hz"):
        mmcm_config(100e6, -5)


def test_system_rejects_unreachable_clock():
    hw = PRESETS["tiny"].replace(name="fast", clock_hz=900_000_000)
    with pytest.raises(ValueError, match="900 MHz is unreachable"):
        Kv260System(hw, ProbeCore(hw))


def test_check_core_messages():
    hw = PRESETS["kv260"]

    class CsrLite(wiring.Component):
        def __init__(self):
            super().__init__({"s_axil": In(AxiSignature(12, 32, 1)), "o_irq": Out(1),
                              "m_axi0": Out(AxiSignature.from_config(hw))})

        def elaborate(self, platform):
            return Module()

    with pytest.raises(TypeError, match=r"CsrLite has no port 's_axi' .*its ports are: s_axil, o_irq, m_axi0"):
        Kv260System(hw, CsrLite())
    with pytest.raises(ValueError, match="has 5 AXI masters"):
        check_core(ProbeCore(hw, ports=5))
    with pytest.raises(ValueError, match="has 0 AXI masters"):
        check_core(ProbeCore(hw, ports=0))
    with pytest.raises(ValueError, match="HP port has 49 address and 6 ID bits"):
        check_core(ProbeCore(hw.replace(axi_id_bits=8)))
    with pytest.raises(ValueError, match="HPM0 has 40 address and 16 ID bits"):
        check_core(ProbeCore(hw, csr=AxiSignature(41, 128, 16)))
    with pytest.raises(ValueError, match=r"m_axi0 is AxiSignature\(40, 256, 6\): an HP port carries 32, 64 or 128"):
        check_core(ProbeCore(hw.replace(axi_data_bits=256, axi_max_burst_beats=8, gemv_pairs=False)))
    with pytest.raises(TypeError, match=r"o_irq must be Out\(1\)"):
        check_core(ProbeCore(hw, irq=2))
    with pytest.raises(TypeError, match="must be an amaranth.lib.wiring.Component"):
        check_core(object())


# --- the Kria app ------------------------------------------------------------------------------------
def _dts(path: Path) -> dict:
    """Decompile a .dtb/.dtbo with dtc and parse it: {"props": {name: value}, "nodes": {name: node}};
    a value is a list of ints (cells), a str, or True (an empty property)."""
    text = subprocess.run(["dtc", "-I", "dtb", "-O", "dts", str(path)], capture_output=True, text=True,
                          check=True).stdout
    root = {"props": {}, "nodes": {}}
    stack = [root]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("/dts-v1/"):
            continue
        if line.endswith("{"):
            node = {"props": {}, "nodes": {}}
            stack[-1]["nodes"][line[:-1].strip().split(":")[-1].strip()] = node
            stack.append(node)
        elif line == "};":
            stack.pop()
        else:
            name, _, value = line.rstrip(";").partition(" = ")
            if not value:
                stack[-1]["props"][name] = True
            elif value.startswith("<"):
                stack[-1]["props"][name] = [int(v, 0) for v in re.findall(r"0x[0-9a-f]+|\d+", value)]
            else:
                stack[-1]["props"][name] = "\0".join(re.findall(r'"((?:[^"\\]|\\.)*)"', value))
    return root["nodes"]["/"]


def _fragments(tree: dict) -> dict:
    """The overlay's fragments by target: the fixup label (``&amba``) or the target path (``/``)."""
    fixups = tree["nodes"]["__fixups__"]["props"]
    targets = {}
    for label, where in fixups.items():
        for ref in where.split("\\0"):
            m = re.fullmatch(r"/(fragment@\d+):target:0", ref)
            if m:
                targets[m.group(1)] = label
    out = {}
    for name, frag in tree["nodes"].items():
        if name.startswith("fragment@"):
            out[targets.get(name) or frag["props"]["target-path"]] = frag["nodes"]["__overlay__"]
    return out


@pytest.mark.parametrize("hw_name", ["kv260", "tiny"])
def test_app_overlay(tmp_path, hw_name):
    hw = PRESETS[hw_name]
    r = build(hw_name, tmp_path, core=ProbeCore(hw), log=lambda msg: None)
    app = tmp_path / "app" / "gemma3n-npu"
    assert sorted(p.name for p in app.iterdir()) == ["gemma3n-npu.dtbo", "gemma3n-npu.dtsi", "shell.json"]
    assert json.loads((app / "shell.json").read_text()) == {"shell_type": "XRT_FLAT", "num_slots": "1"}
    tree = _dts(r["app_dtbo"])
    frags = _fragments(tree)
    assert set(frags) == {"fpga_full", "amba", "/"}
    fixups = tree["nodes"]["__fixups__"]["props"]

    full = frags["fpga_full"]["props"]
    assert full["firmware-name"] == "gemma3n-npu.bit.bin"
    # resets = <&zynqmp_reset 116>, ... 119 (phandle cells are fixed up at load time).
    assert full["resets"][1::2] == [116, 117, 118, 119]
    assert fixups["zynqmp_reset"].count(":resets:") == 4

    amba = frags["amba"]["nodes"]
    clk = amba["clocking0"]["props"]
    assert clk["compatible"] == "xlnx,fclk"
    assert clk["clocks"][1] == 71 and clk["assigned-clocks"][1] == 71
    assert clk["assigned-clock-rates"] == [100_000_000]
    afi = amba["afi0"]["props"]
    assert afi["compatible"] == "xlnx,afi-fpga"
    pairs = dict(zip(afi["config-afi"][::2], afi["config-afi"][1::2], strict=True))
    for k in range(4):                       # HP0..3: regids 4 + 2k (read), 5 + 2k (write)
        want = AFI_WIDTH[hw.axi_data_bits] if k < hw.axi_ports else 0
        assert pairs[4 + 2 * k] == pairs[5 + 2 * k] == want, k
    assert (pairs[14] >> 8) & 3 == 2         # HPM0: 128 bit (AFIFS dw_ss0_sel)

    npu = amba[f"npu@{KV260_MAP.csr_base:x}"]["props"]
    assert npu["compatible"] == "generic-uio"
    base, size = npu["reg"][0] << 32 | npu["reg"][1], npu["reg"][2] << 32 | npu["reg"][3]
    assert base == KV260_MAP.csr_base == 0xA000_0000
    assert size == KV260_MAP.csr_size == 1 << csr_map.ADDR_BITS
    assert npu["interrupts"] == [0, KV260_MAP.irq_spi, 4] == [0, 89, 4]
    assert "npu@a0000000:interrupt-parent:0" in fixups["gic"]

    bufs = {n["props"]["device-name"]: n["props"] for n in frags["/"]["nodes"].values()}
    assert set(bufs) == {w.name for w in KV260_MAP.windows}
    for w in KV260_MAP.windows:
        b = bufs[w.name]
        assert b["compatible"] == "ikwzm,u-dma-buf"
        assert b["size"][0] << 32 | b["size"][1] == w.size
        assert b["dma-mask"] == [40]
        assert f"udmabuf-{w.name}:memory-region:0" in fixups[f"{w.name}_reserved"]


def test_reserved_memory_and_overlay_apply(tmp_path):
    """The fragment compiles into a tree; the overlay applies on top of it (every reference resolves), and
    each u-dma-buf then points at its window's reserved-memory node."""
    build("tiny", tmp_path, core=ProbeCore(PRESETS["tiny"]), log=lambda msg: None)
    fragment = (tmp_path / "app" / "reserved-memory.dtsi").read_text()
    base = tmp_path / "base.dts"
    base.write_text("/dts-v1/;\n/ {\n\t#address-cells = <2>;\n\t#size-cells = <2>;\n"
                    "\tgic: interrupt-controller@f9010000 { #interrupt-cells = <3>; interrupt-controller; "
                    "reg = <0x0 0xf9010000 0x0 0x10000>; };\n"
                    "\tfirmware { zynqmp_firmware: zynqmp-firmware {\n"
                    "\t\tzynqmp_reset: reset-controller { #reset-cells = <1>; };\n"
                    "\t\tzynqmp_clk: clock-controller { #clock-cells = <1>; }; }; };\n"
                    "\tfpga_full: fpga-full { compatible = \"fpga-region\"; #address-cells = <2>; "
                    "#size-cells = <2>; ranges; };\n"
                    "\tamba: axi { compatible = \"simple-bus\"; #address-cells = <2>; #size-cells = <2>; ranges; };\n"
                    "};\n" + fragment)
    subprocess.run(["dtc", "-@", "-I", "dts", "-O", "dtb", "-o", str(tmp_path / "base.dtb"), str(base)],
                   check=True, capture_output=True)
    tree = _dts(tmp_path / "base.dtb")
    reserved = tree["nodes"]["reserved-memory"]
    assert set(reserved["nodes"]) == {f"{w.name}@{w.base:x}" for w in KV260_MAP.windows}
    for w in KV260_MAP.windows:
        node = reserved["nodes"][f"{w.name}@{w.base:x}"]["props"]
        assert node["compatible"] == "shared-dma-pool" and node["reusable"] is True
        reg = node["reg"]
        assert (reg[0] << 32 | reg[1], reg[2] << 32 | reg[3]) == (w.base, w.size)
        assert tree["nodes"]["__symbols__"]["props"][f"{w.name}_reserved"] == f"/reserved-memory/{w.name}@{w.base:x}"

    merged = tmp_path / "merged.dtb"
    proc = subprocess.run(["fdtoverlay", "-i", str(tmp_path / "base.dtb"), "-o", str(merged),
                           str(tmp_path / "app" / "gemma3n-npu" / "gemma3n-npu.dtbo")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    tree = _dts(merged)
    phandles = {n["props"]["phandle"][0]: name for name, n in tree["nodes"]["reserved-memory"]["nodes"].items()}
    for w in KV260_MAP.windows:
        buf = tree["nodes"][f"udmabuf-{w.name}"]["props"]
        assert phandles[buf["memory-region"][0]] == f"{w.name}@{w.base:x}"
    assert tree["nodes"]["fpga-full"]["props"]["firmware-name"] == "gemma3n-npu.bit.bin"
    npu = tree["nodes"]["axi"]["nodes"]["npu@a0000000"]["props"]
    assert npu["interrupt-parent"] == tree["nodes"]["interrupt-controller@f9010000"]["props"]["phandle"]


# --- the build -------------------------------------------------------------------------------------
def test_build_without_dtc(tmp_path, monkeypatch, capsys):
    """No dtc: everything else is written, the .dtbo is not, and the build ends with one clear line."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setattr("hdl.build._core", lambda cfg, which: (ProbeCore(cfg), "core"))
    status = main(["--hw", "tiny", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert status == 1
    assert err.strip().splitlines() == ["error: dtc (the device tree compiler) is not on PATH: install the Debian "
                                        "package device-tree-compiler (`bash scripts/setup.sh` does)"]
    app = tmp_path / "out" / "app" / "gemma3n-npu"
    assert (app / "gemma3n-npu.dtsi").exists() and not (app / "gemma3n-npu.dtbo").exists()
    assert (tmp_path / "out" / "vivado" / "gemma3n_npu.tcl").exists()
    assert "Vivado not found on PATH" in out


def test_build_rejects_a_core_that_does_not_fit(tmp_path, monkeypatch, capsys):
    class NoIrq(wiring.Component):
        def __init__(self, cfg):
            super().__init__({"s_axi": In(AxiSignature(40, 128, 16)), "m_axi0": Out(AxiSignature.from_config(cfg))})

        def elaborate(self, platform):
            return Module()

    monkeypatch.setattr("hdl.build._core", lambda cfg, which: (NoIrq(cfg), "core"))
    assert main(["--hw", "tiny", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: NoIrq does not fit the KV260 system: NoIrq has no port 'o_irq'")
    assert len(err.strip().splitlines()) == 1 and not out


def test_build_synth_outside_the_repository(tmp_path):
    with pytest.raises(BuildError, match="inside the repository"):
        build("tiny", tmp_path, core=ProbeCore(PRESETS["tiny"]), synth=True, log=lambda msg: None)


def test_yosys_accepts_the_system_and_the_estimate_is_cached():
    """synth_xilinx -family xcup on the system (PS8, BUFG_PS, MMCME4_ADV from its cells_xtra); a second
    build of the same design reads the estimate from the cache."""
    out = ROOT / "build" / "test_kv260_synth"
    shutil.rmtree(out, ignore_errors=True)
    hw = PRESETS["kv260"]
    lines = []
    first = build("kv260", out, core=ProbeCore(hw), synth=True, log=lines.append)["utilisation"]
    assert any(line.startswith("[4/5] yosys     done") for line in lines), lines
    assert first.cells.get("PS8") == 1 and first.cells.get("MMCME4_ADV") == 1 and first.cells.get("BUFG_PS") == 1
    assert first.ff >= 32 + 2          # the core's register and the reset synchroniser
    lines.clear()
    again = build("kv260", out, core=ProbeCore(hw), synth=True, log=lines.append)["utilisation"]
    assert any(line.startswith("[4/5] yosys     cached estimate") for line in lines), lines
    assert (again.lut, again.ff, again.cells) == (first.lut, first.ff, first.cells)
    assert set(again.blocks) == set(first.blocks)


def test_build_main_system_tiny(tmp_path, monkeypatch, capsys):
    """The command line's system build around a core of the NPU's shape: what it says first, each stage,
    and without Vivado the line that says so, exit status 0."""
    monkeypatch.setattr("hdl.build._core", lambda cfg, which: (ProbeCore(cfg), "core"))
    assert main(["--hw", "tiny", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert not err
    assert lines[0] == "hdl.build: the KV260 system around ProbeCore for tiny (100 MHz); it writes"
    assert lines[1].startswith("  Vivado project (Amaranth's flow): ") and "gemma3n_npu.tcl" in lines[1]
    assert lines[2].startswith("  Kria app: ") and "gemma3n-npu.dtbo" in lines[2]
    assert lines[3].startswith("  board device-tree fragment: ") and "reserved-memory.dtsi" in lines[3]
    for k, stage in enumerate(("elaborate", "vivado", "app", "yosys", "vivado"), 1):
        assert any(line.startswith(f"[{k}/5] {stage}") for line in lines), (k, stage)
    assert "MMCM 100 MHz x 16 / (1 x 16) = 100 MHz" in out
    if shutil.which("vivado") is None:
        assert any(line.startswith("[5/5] vivado    Vivado not found on PATH: bitstream not built") for line in lines)
    assert lines[-1].startswith("done: Kria app in ")


def test_build_ddr_probe(tmp_path):
    """``--top ddr-probe``: the same system around the DDR probe, app gemma3n-ddrprobe."""
    r = build("tiny", tmp_path, which="ddr-probe", log=lambda msg: None)
    assert r["app_dtbo"].name == "gemma3n-ddrprobe.dtbo" and r["app_dtbo"].exists()
    assert "firmware-name = \"gemma3n-ddrprobe.bit.bin\";" in r["app_dtsi"].read_text()
    assert "PS8 PS8_i" in r["verilog"].read_text()


@pytest.mark.parametrize("hw_name", ["kv260", "tiny"])
def test_block_design_flow(tmp_path, hw_name):
    """``--flow bd``: the module reference's ports carry the AXI interface attributes Vivado infers the buses
    from and reach the core's own ports; the Tcl builds the PS with the ports the core uses, at the widths
    it has, the CSR window where the memory map puts it."""
    hw = PRESETS[hw_name]
    r = build(hw_name, tmp_path, core=ProbeCore(hw), flow="bd", log=lambda msg: None)
    bdir = tmp_path / "vivado_bd"
    out = bdir / "ref.json"
    proc = subprocess.run(_yosys_command() + ["-q", "-p", "read_verilog gemma3n_npu_core_inner.v; "
                                              "read_verilog gemma3n_npu_core.v; hierarchy -top gemma3n_npu_core; "
                                              "proc; opt_clean; write_json ref.json"],
                          cwd=bdir, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    top = json.loads(out.read_text())["modules"]["gemma3n_npu_core"]
    inner = _cell(top, "gemma3n_npu_core_inner")["connections"]
    nets = top["netnames"]
    buses = {"s_axi": AxiSignature(40, 128, 16), **{f"m_axi{p}": AxiSignature.from_config(hw)
                                                    for p in range(hw.axi_ports)}}
    for bus, sig in buses.items():
        for name, member in sig.members.items():
            port = f"{bus}_{name}"
            assert nets[port]["attributes"]["X_INTERFACE_INFO"] == \
                f"xilinx.com:interface:aximm:1.0 {bus} {name.upper()}"
            assert inner[f"{bus}__{name}"] == top["ports"][port]["bits"], port
            slave_in = (member.flow == Out) == (bus == "s_axi")
            assert top["ports"][port]["direction"] == ("input" if slave_in else "output"), port
        first = nets[f"{bus}_awid"]["attributes"]["X_INTERFACE_PARAMETER"]
        assert f"DATA_WIDTH {sig.data_bits}, ADDR_WIDTH {sig.addr_bits}, ID_WIDTH {sig.id_bits}" in first
    assert inner["clk"] == top["ports"]["aclk"]["bits"]
    assert inner["o_irq"] == top["ports"]["irq"]["bits"]
    assert "ASSOCIATED_BUSIF s_axi:" + ":".join(f"m_axi{p}" for p in range(hw.axi_ports)) + "," in \
        nets["aclk"]["attributes"]["X_INTERFACE_PARAMETER"]

    tcl = r["tcl"].read_text()
    assert f"-part {XCK26.name}" in tcl and "board_part xilinx.com:kv260_som:part0:1.4" in tcl
    assert "create_bd_cell -type module -reference gemma3n_npu_core core" in tcl
    assert "CONFIG.PSU__USE__M_AXI_GP0 {1}" in tcl and "CONFIG.PSU__MAXIGP0__DATA_WIDTH {128}" in tcl
    for p in range(4):                        # S_AXI_HP<p>_FPD is S_AXI_GP<p + 2> in the PS's settings
        if p < hw.axi_ports:
            assert f"CONFIG.PSU__USE__S_AXI_GP{p + 2} {{1}}" in tcl
            assert f"CONFIG.PSU__SAXIGP{p + 2}__DATA_WIDTH {{{hw.axi_data_bits}}}" in tcl
            assert f"[get_bd_intf_pins core/m_axi{p}] [get_bd_intf_pins ps/S_AXI_HP{p}_FPD]" in tcl
        else:
            assert f"CONFIG.PSU__USE__S_AXI_GP{p + 2} {{0}}" in tcl
    assert f"CONFIG.CLKOUT1_REQUESTED_OUT_FREQ {{{hw.clock_hz / 1e6:g}}}" in tcl
    assert (f"-offset 0x{KV260_MAP.csr_base:08X} -range 0x{KV260_MAP.csr_size:X}" in tcl
            and KV260_MAP.csr_size == 1 << csr_map.ADDR_BITS)
    assert "connect_bd_net [get_bd_pins core/irq] [get_bd_pins ps/pl_ps_irq0]" in tcl
    assert "write_hw_platform -fixed -include_bit -force -file ${name}.xsa" in tcl
    assert tcl.index("wait_on_run impl_1") < tcl.index("bootgen -w -arch zynqmp -process_bitstream bin")
    xdc = r["xdc"].read_text()
    assert "set_property PACKAGE_PIN A12 [get_ports fan_en_b]" in xdc
    assert r["app_dtbo"].exists()


def test_build_cli_system_tiny(tmp_path):
    """The default build of the tiny preset: the system around the NPU, the app, no Vivado here."""
    proc = subprocess.run([sys.executable, "-m", "hdl.build", "--hw", "tiny", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("hdl.build: the KV260 system around Npu for tiny")
    assert "gemma3n-npu.dtbo" in lines[2]
    if shutil.which("vivado") is None:
        assert any(line.startswith("[5/5] vivado    Vivado not found on PATH: bitstream not built") for line in lines)
    assert (tmp_path / "app" / "gemma3n-npu" / "gemma3n-npu.dtbo").exists()
    assert "module gemma3n_npu" in (tmp_path / "vivado" / "gemma3n_npu.v").read_text()


@pytest.mark.slow
def test_yosys_accepts_the_npu_system():
    """The whole kv260 NPU in the system through synth_xilinx (30-50 minutes on two cores)."""
    out = ROOT / "build" / "test_kv260_npu_system"
    util = build("kv260", out, synth=True, log=lambda msg: None)["utilisation"]
    assert util.cells.get("PS8") == 1 and util.dsp > 0 and util.uram > 0
