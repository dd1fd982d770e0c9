"""A pre-placement timing estimate of a mapped UltraScale+ netlist: the worst register-to-register path of each
block, its logic levels and an estimated delay, against a clock target.

`analyse_netlist(json_text_or_dict, top)` reads the ``write_json`` netlist that `hdl.synth.synthesize` writes
after ``synth_xilinx -family xcup`` (in the same Yosys run as the utilisation) and returns a `BlockTiming`
for each module of the design (each kept block, or the flat top). Within a module:

- **start points**: flip-flops (``FD*``, latches ``LD*``), block RAM (``RAMB18E2``/``RAMB36E2``), URAM288,
  DSP48E2 outputs, LUTRAM and SRL outputs, and the module's input ports;
- **end points**: the inputs of those cells (clock pins excluded) and the module's output ports;
- **boundaries**: a cell the analysis does not know (a kept block below, a hard block such as the PS8) is
  treated like the module's ports: its outputs are input ports, its inputs output ports;
- **logic levels**, as Vivado counts them: each LUT1..LUT6 (and INV), MUXF7/MUXF8/MUXF9 and CARRY8 is one
  level; so is a DSP48E2 with no register between A/B and P, which is a combinational cell here. Yosys
  maps carry chains to CARRY4 (Vivado retargets two CARRY4 to one CARRY8), so a CARRY4 entered by its
  carry input counts half a level and the count is rounded down;
- **the delay** of a path: the start point's clock-to-out, each cell's delay and each net's, and the end
  point's setup, from `DELAYS` (an estimate for the -2 speed grade at VCCINT 0.72 V; docs/architecture.md
  "Timing estimate" says where each figure comes from).

A path that crosses a module's boundary is cut at the port: the port is its start or end point with no delay.
`BlockTiming` therefore has, besides the register-to-register worst path, the worst input-port-to-register
and register-to-output-port paths: a path through a boundary is at most the driving block's ``out`` plus the
receiving block's ``in``. A combinational loop is reported (`BlockTiming.loop_cells`) and left out.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field

__all__ = ["DELAYS", "MODEL", "TARGET_MARGIN", "Path", "BlockTiming", "analyse_netlist", "analyse_module", "budget_ns",
           "fmax_mhz", "group_timing", "format_timing", "LEVEL_NS"]

# Estimated delays in ns for XCK26 -2LV (VCCINT 0.72 V). docs/architecture.md "Timing estimate" cites them.
DELAYS = {
    "net": 0.30,            # an average routed net between slices
    "net_local": 0.05,      # a LUT into the CARRY next to it
    "lut": 0.12,            # LUT1..LUT6, INV
    "muxf": 0.10,           # MUXF7/8/9 from I0/I1 (dedicated from the LUTs or the MUXF below; no net)
    "muxf_sel": 0.15,       # MUXF7/8/9 from S
    "carry8": 0.25,         # CARRY8 entered by S/DI/AX
    "carry8_ci": 0.05,      # CARRY8 entered by CI (dedicated from the CARRY8 below; no net)
    "carry4": 0.20,         # CARRY4 entered by S/DI/CYINIT
    "carry4_ci": 0.03,      # CARRY4 entered by CI: half a CARRY8
    "ff_cko": 0.10,         # FD* clock to Q
    "ff_setup": 0.05,       # FD* D
    "ff_setup_ce": 0.10,    # FD* CE
    "ff_setup_sr": 0.15,    # FD* R/S/CLR/PRE
    "bram_cko": 1.20,       # RAMB clock to DOUT, no output register (DOA_REG/DOB_REG = 0)
    "bram_cko_reg": 0.40,   # RAMB clock to DOUT with the output register
    "bram_setup": 0.45,     # RAMB address, data, enable
    "uram_cko": 1.60,       # URAM288 clock to DOUT, no output register (OREG = FALSE)
    "uram_cko_reg": 0.50,   # URAM288 with OREG
    "uram_setup": 0.50,
    "lutram_cko": 0.90,     # LUTRAM/SRL: write clock to the read output
    "lutram_setup": 0.30,
    # DSP48E2, from DS925's DSP48 FMAX at 0.72 V, -2: 644 MHz with every register (1.55 ns a stage),
    # 440 MHz without MREG (2.27 ns), 323 MHz without MREG and ADREG (3.10 ns)
    "dsp_setup_reg": 0.30,      # into A/B/C/D with their input register
    "dsp_setup_mreg": 1.70,     # A/B without input register into MREG (through the multiplier)
    "dsp_setup_preg": 2.60,     # A/B without input register and MREG into PREG
    "dsp_setup_c_preg": 1.00,   # C without CREG into PREG (the ALU)
    "dsp_setup_ctrl": 0.40,     # OPMODE, ALUMODE, INMODE, CARRYIN, PCIN, clock enables, resets
    "dsp_cko_preg": 0.40,       # clock to P with PREG
    "dsp_cko_mreg": 1.40,       # clock (MREG) to P without PREG
    "dsp_cko_areg": 2.30,       # clock (A/B registers) to P without MREG and PREG
    "dsp_cko_comb": 2.60,       # no internal register on the way to P
    "dsp_cko_cascade": 0.30,    # ACOUT/BCOUT
    "dsp_comb": 2.40,           # A/B to P with no internal register: 3.10 ns less an input register's setup
                                # and PREG's clock-to-out
}

# The version of the model above: part of `hdl.build`'s cache key, so an estimate made with other delays is
# not reused. Change it with any figure.
MODEL = 1

# Reserved for clock skew and uncertainty and for routes longer than the average net: a path meets the clock
# when its estimated delay is at most (1 - TARGET_MARGIN) of the period.
TARGET_MARGIN = 0.15
# One LUT level with its net: the unit of the level budget.
LEVEL_NS = DELAYS["lut"] + DELAYS["net"]

_LUT = {"LUT1", "LUT2", "LUT3", "LUT4", "LUT5", "LUT6", "INV"}
_MUXF = {"MUXF7", "MUXF8", "MUXF9"}
_CARRY = {"CARRY4", "CARRY8"}
_COMB = _LUT | _MUXF | _CARRY | {"BUF"}
_FF = {"FDRE", "FDSE", "FDCE", "FDPE", "LDCE", "LDPE"}
_BRAM = {"RAMB18E2", "RAMB36E2"}
_URAM = {"URAM288", "URAM288_BASE"}
_CLOCK_PINS = {"C", "G", "CLK", "CLKARDCLK", "CLKBWRCLK", "WCLK", "RDCLK", "WRCLK"}


def budget_ns(clock_mhz: float) -> float:
    """The estimated path delay that meets `clock_mhz`: the period less `TARGET_MARGIN`."""
    return (1 - TARGET_MARGIN) * 1e3 / clock_mhz


def fmax_mhz(delay_ns: float) -> float:
    """The clock a path of `delay_ns` meets with the same margin (inf for an empty path)."""
    return math.inf if delay_ns <= 0 else (1 - TARGET_MARGIN) * 1e3 / delay_ns


@dataclass
class Path:
    delay: float        # ns, start point's clock-to-out to end point's setup
    levels: int
    start: str
    end: str

    @classmethod
    def from_dict(cls, d: dict | None) -> "Path | None":
        return None if d is None else cls(**d)


@dataclass
class BlockTiming:
    name: str
    reg: Path | None = None     # the worst register-to-register path (by delay)
    inp: Path | None = None     # the worst input port -> register path
    out: Path | None = None     # the worst register -> output port path
    thru: Path | None = None    # the worst input port -> output port path (combinational through the block)
    max_levels: int = 0         # the most logic levels of any path
    loop_cells: int = 0         # cells on combinational loops (left out of the analysis)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "BlockTiming":
        d = dict(d)
        for k in ("reg", "inp", "out", "thru"):
            d[k] = Path.from_dict(d.get(k))
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def worst(self) -> tuple[str, Path | None]:
        """The slowest path of any kind, with its kind: ``reg->reg``, ``in->reg``, ``reg->out`` or
        ``in->out`` (a port's side of a path through the boundary counted as a register)."""
        kinds = (("reg->reg", self.reg), ("in->reg", self.inp), ("reg->out", self.out), ("in->out", self.thru))
        return max(((k, p) for k, p in kinds if p is not None), key=lambda kp: kp[1].delay, default=("", None))


def _param_int(params: dict, name: str, default: int = 0) -> int:
    v = params.get(name)
    if v is None:
        return default
    if isinstance(v, int):
        return v
    s = str(v).strip().strip('"')
    if s.upper() == "TRUE":
        return 1
    if s.upper() == "FALSE":
        return 0
    try:
        return int(s, 2) if set(s) <= {"0", "1"} else int(s)
    except ValueError:
        return default


def _seq_timing(ctype: str, params: dict, port: str, direction: str) -> float | None:
    """Clock-to-out (output `port`) or setup (input `port`) of a sequential cell; None for a clock pin."""
    if port in _CLOCK_PINS:
        return None
    d = DELAYS
    if ctype in _FF:
        if direction == "output":
            return d["ff_cko"]
        return {"D": d["ff_setup"], "CE": d["ff_setup_ce"]}.get(port, d["ff_setup_sr"])
    if ctype in _BRAM:
        if direction == "input":
            return d["bram_setup"]
        reg = _param_int(params, "DOB_REG" if port in ("DOUTBDOUT", "DOUTPBDOUTP", "CASDOUTB", "CASDOUTPB")
                         else "DOA_REG")
        return d["bram_cko_reg"] if reg else d["bram_cko"]
    if ctype in _URAM:
        if direction == "input":
            return d["uram_setup"]
        reg = _param_int(params, "OREG_B" if port.endswith("_B") else "OREG_A")
        return d["uram_cko_reg"] if reg else d["uram_cko"]
    if ctype == "DSP48E2":
        areg = _param_int(params, "AREG", 1) and _param_int(params, "BREG", 1)
        mreg, preg = _param_int(params, "MREG", 1), _param_int(params, "PREG", 1)
        if direction == "output":
            if port in ("ACOUT", "BCOUT"):
                return d["dsp_cko_cascade"]
            if preg:
                return d["dsp_cko_preg"]
            return d["dsp_cko_mreg"] if mreg else d["dsp_cko_areg"] if areg else d["dsp_cko_comb"]
        if port in ("A", "B", "ACIN", "BCIN", "D"):
            reg = _param_int(params, "DREG", 1) if port == "D" else areg
            return (d["dsp_setup_reg"] if reg else d["dsp_setup_mreg"] if mreg else d["dsp_setup_preg"] if preg
                    else d["dsp_setup_preg"])
        if port == "C":
            return d["dsp_setup_reg"] if _param_int(params, "CREG", 1) else d["dsp_setup_c_preg"]
        return d["dsp_setup_ctrl"]
    if ctype.startswith(("RAM", "SRL")):            # LUTRAM and shift registers
        return d["lutram_cko"] if direction == "output" else d["lutram_setup"]
    return 0.0                                      # a kept block below, a hard block: its port


def _sequential(ctype: str) -> bool:
    """A cell whose pins are a path's start and end points; any other non-combinational cell (a kept block
    below, a hard block) is a boundary, like the module's ports."""
    return ctype in _FF or ctype in _BRAM or ctype in _URAM or ctype == "DSP48E2" or ctype.startswith(("RAM", "SRL"))


def _dsp_comb(cell: dict) -> bool:
    """A DSP48E2 without any register from A/B to P: a combinational cell."""
    p = cell.get("parameters", {})
    return cell["type"] == "DSP48E2" and not any(_param_int(p, r, 1) for r in ("AREG", "BREG", "MREG", "PREG"))


def _comb_delay(ctype: str, port: str) -> tuple[float, float]:
    """(delay, levels) through a combinational cell from its input `port`."""
    d = DELAYS
    if ctype == "DSP48E2":
        return d["dsp_comb"], 1
    if ctype in _LUT:
        return d["lut"], 1
    if ctype in _MUXF:
        return (d["muxf_sel"] if port == "S" else d["muxf"]), 1
    if ctype == "CARRY8":
        return (d["carry8_ci"] if port == "CI" else d["carry8"]), 1
    if ctype == "CARRY4":
        return (d["carry4_ci"], 0.5) if port == "CI" else (d["carry4"], 1)
    return 0.0, 0                                   # BUF


def _net_delay(driver_type: str | None, driver_port: str | None, sink_type: str, sink_port: str) -> float:
    """The net from a driver's output to a sink's input: none on the slice's dedicated paths."""
    if sink_type in _CARRY and sink_port == "CI" and driver_type in _CARRY:
        return 0.0
    if sink_type in _MUXF and sink_port in ("I0", "I1"):
        if (sink_type == "MUXF7" and driver_type in _LUT) or (sink_type == "MUXF8" and driver_type == "MUXF7") \
                or (sink_type == "MUXF9" and driver_type == "MUXF8"):
            return 0.0
    if sink_type in _CARRY and sink_port in ("S", "DI") and driver_type in _LUT:
        return DELAYS["net_local"]
    return DELAYS["net"]


def _bit_names(module: dict) -> dict:
    """A readable name per net bit: a named net (not one Yosys made up) where there is one."""
    names: dict = {}
    for name, net in sorted(module.get("netnames", {}).items(), key=lambda kv: (kv[1].get("hide_name", 0), kv[0])):
        bits = net["bits"]
        for i, b in enumerate(bits):
            if isinstance(b, int) and b not in names:
                names[b] = name if len(bits) == 1 else f"{name}[{i}]"
    return names


def analyse_module(module: dict, name: str = "", submodules: frozenset = frozenset()) -> BlockTiming:
    """The worst paths of one module of a ``write_json`` netlist (see the module's docstring)."""
    cells = module.get("cells", {})
    bit_name = _bit_names(module)
    driver: dict = {}                           # bit -> (cell name or None for a port, port name)
    for pname, port in module.get("ports", {}).items():
        if port["direction"] in ("input", "inout"):
            for b in port["bits"]:
                if isinstance(b, int):
                    driver[b] = (None, pname)
    comb, seq = [], []
    for cname, cell in cells.items():
        dirs = cell.get("port_directions", {})
        for p, bits in cell["connections"].items():
            if dirs.get(p) == "output":
                for b in bits:
                    if isinstance(b, int):
                        driver[b] = (cname, p)
        is_comb = (cell["type"] in _COMB and cell["type"] not in submodules) or _dsp_comb(cell)
        (comb if is_comb else seq).append(cname)

    def ctype(c):
        return None if c is None else cells[c]["type"]

    # Combinational cells in topological order (Kahn); what is left lies on a loop.
    comb_set = set(comb)
    succ = defaultdict(set)
    indeg = {c: 0 for c in comb}
    for c in comb:
        cell = cells[c]
        preds = set()
        for p, bits in cell["connections"].items():
            if cell.get("port_directions", {}).get(p) != "input":
                continue
            for b in bits:
                drv = driver.get(b) if isinstance(b, int) else None
                if drv and drv[0] in comb_set:
                    preds.add(drv[0])
        for pc in preds:
            succ[pc].add(c)
        indeg[c] = len(preds)
    order, queue = [], deque(c for c in comb if indeg[c] == 0)
    while queue:
        c = queue.popleft()
        order.append(c)
        for s in succ[c]:
            indeg[s] -= 1
            if indeg[s] == 0:
                queue.append(s)
    looped = comb_set - set(order)

    def start_label(cell_name, port, b):
        net = bit_name.get(b, f"bit {b}")
        if cell_name is None:
            return f"port {net}"
        return f"{net} ({cells[cell_name]['type']} {port})"

    def source(b):
        """(delay, levels, max levels, start) of a start point driving bit `b`, or None."""
        drv = driver.get(b)
        if drv is None:
            return None
        c, p = drv
        if c is None:
            return ("in", 0.0, 0.0, 0.0, start_label(None, p, b))
        if c in comb_set:
            return None
        cell = cells[c]
        t = _seq_timing(cell["type"], cell.get("parameters", {}), p, "output")
        return ("reg" if _sequential(cell["type"]) else "in", t or 0.0, 0.0, 0.0, start_label(c, p, b))

    # Arrival per bit and kind of start ("reg" or "in"): (delay, levels, max levels, start).
    arrival: dict = {}

    def arrivals(b, sink_type, sink_port):
        """The arrivals at a sink input from bit `b`, the net included: {kind: (delay, levels, maxlev, start)}."""
        if not isinstance(b, int):
            return {}
        drv = driver.get(b)
        if drv is None:
            return {}
        c, p = drv
        net = _net_delay(ctype(c), p, sink_type, sink_port)
        if c is not None and c in comb_set:
            return {k: (v[0] + net, v[1], v[2], v[3]) for k, v in arrival.get(b, {}).items()}
        src = source(b)
        return {src[0]: (src[1] + net, src[2], src[3], src[4])}

    for c in order:
        cell = cells[c]
        t = cell["type"]
        dirs = cell.get("port_directions", {})
        best: dict = {}
        for p, bits in cell["connections"].items():
            if dirs.get(p) != "input":
                continue
            dly, lev = _comb_delay(t, p)
            for b in bits:
                for kind, (a, l, ml, st) in arrivals(b, t, p).items():
                    cand = (a + dly, l + lev, ml + lev, st)
                    old = best.get(kind)
                    if old is None:
                        best[kind] = cand
                    else:
                        top = cand if cand[0] > old[0] else old
                        best[kind] = (top[0], top[1], max(old[2], cand[2]), top[3])
        for p, bits in cell["connections"].items():
            if dirs.get(p) == "output":
                for b in bits:
                    if isinstance(b, int):
                        arrival[b] = best

    result = BlockTiming(name=name, loop_cells=len(looped))
    worst: dict = {}
    maxlev = 0

    def consider(kind_end, kind_start, a, levels, ml, st, end):
        nonlocal maxlev
        key = {("reg", "reg"): "reg", ("in", "reg"): "inp", ("reg", "out"): "out", ("in", "out"): "thru"}[
            (kind_start, kind_end)]
        maxlev = max(maxlev, int(math.floor(ml + 1e-9)))
        old = worst.get(key)
        if old is None or a > old.delay:
            worst[key] = Path(round(a, 3), int(math.floor(levels + 1e-9)), st, end)

    for c in seq:
        cell = cells[c]
        dirs = cell.get("port_directions", {})
        q = next((bit_name.get(b) for p, bits in cell["connections"].items() if dirs.get(p) == "output"
                  for b in bits if isinstance(b, int)), None)
        for p, bits in cell["connections"].items():
            if dirs.get(p) != "input":
                continue
            setup = _seq_timing(cell["type"], cell.get("parameters", {}), p, "input")
            if setup is None:
                continue
            for b in bits:
                d_name = bit_name.get(b, f"bit {b}") if isinstance(b, int) else "const"
                end = f"{q} ({cell['type']} {p})" if cell["type"] in _FF and q else \
                      f"{d_name} -> {cell['type']} {p}"
                for kind, (a, l, ml, st) in arrivals(b, cell["type"], p).items():
                    consider("reg" if _sequential(cell["type"]) else "out", kind, a + setup, l, ml, st, end)
    for pname, port in module.get("ports", {}).items():
        if port["direction"] != "output":
            continue
        for i, b in enumerate(port["bits"]):
            end = f"port {pname}" + (f"[{i}]" if len(port["bits"]) > 1 else "")
            for kind, (a, l, ml, st) in arrivals(b, "", "").items():
                # No net into a port: the receiving block counts it.
                drv = driver.get(b)
                net = _net_delay(ctype(drv[0]), drv[1], "", "") if drv else 0.0
                consider("out", kind, a - net, l, ml, st, end)
    result.reg, result.inp, result.out, result.thru = (worst.get(k) for k in ("reg", "inp", "out", "thru"))
    result.max_levels = maxlev
    return result


def analyse_netlist(netlist, top: str) -> dict[str, BlockTiming]:
    """`BlockTiming` per module of a ``write_json`` netlist (text, path-free dict), keyed as `hdl.synth` keys
    blocks: the part of the module's name below `top` (``"(top)"`` for the top itself)."""
    data = json.loads(netlist) if isinstance(netlist, (str, bytes)) else netlist
    modules = {n.lstrip("\\"): m for n, m in data["modules"].items()
               if not _param_int(m.get("attributes", {}), "blackbox") and
               not _param_int(m.get("attributes", {}), "whitebox")}
    subs = frozenset(modules)
    out = {}
    for name, m in modules.items():
        if name != top and not name.startswith(top + "."):
            continue
        label = "(top)" if name == top else name[len(top) + 1:]
        out[label] = analyse_module(m, label, subs)
    return out


def _worse(a: Path | None, b: Path | None) -> Path | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a.delay >= b.delay else b


def group_timing(blocks: dict[str, BlockTiming], depth: int) -> dict[str, BlockTiming]:
    """The worst of `blocks` grouped as `hdl.synth.group_blocks` groups them (``ctl.gemv.port0`` into
    ``ctl.gemv`` at depth 2); each path's end names its block."""
    parents = {".".join(n.split(".")[:i]) for n in blocks for i in range(1, n.count(".") + 1)}
    groups: dict[str, BlockTiming] = {}
    for name, b in blocks.items():
        parts = name.split(".")
        key = ".".join(parts[:depth]) if len(parts) >= depth else f"{name} (own)" if name in parents else name
        g = groups.setdefault(key, BlockTiming(name=key))

        def tag(p):
            return None if p is None else Path(p.delay, p.levels, p.start, f"{p.end} in {name}")
        g.reg, g.inp, g.out, g.thru = (_worse(g.reg, tag(b.reg)), _worse(g.inp, tag(b.inp)),
                                       _worse(g.out, tag(b.out)), _worse(g.thru, tag(b.thru)))
        g.max_levels = max(g.max_levels, b.max_levels)
        g.loop_cells += b.loop_cells
    return groups


def format_timing(blocks: dict[str, BlockTiming], clock_mhz: float, *, title: str = "unit") -> str:
    """One row per block, slowest first: the worst path's logic levels, estimated delay, the clock it meets and
    whether that is `clock_mhz`; the most levels of any path; the worst delay of each kind (register to
    register, input port to register, register to output port: a path through a block's port is at most the
    one block's ``reg->out`` plus the other's ``in->reg``); where the worst path starts and ends."""
    budget = budget_ns(clock_mhz)
    lines = [f"{title:<28} {'levels':>6} {'ns':>6} {'fmax':>6} {f'{clock_mhz:g} MHz':>8} {'max lv':>6} "
             f"{'reg->reg':>8} {'in->reg':>7} {'reg->out':>8}  worst path"]

    def ns(p):
        return f"{p.delay:.2f}" if p else "-"
    order = sorted(blocks.items(), key=lambda kv: -(kv[1].worst[1].delay if kv[1].worst[1] else 0))
    for name, b in order:
        kind, w = b.worst
        if w is None:
            lines.append(f"{name:<28} {'-':>6} {'-':>6} {'-':>6} {'-':>8} {'-':>6} {'-':>8} {'-':>7} {'-':>8}  "
                         f"no path")
            continue
        verdict = "ok" if w.delay <= budget else "OVER"
        loop = f" [combinational loop: {b.loop_cells} cells left out]" if b.loop_cells else ""
        lines.append(f"{name:<28} {w.levels:>6} {w.delay:>6.2f} {fmax_mhz(w.delay):>6.0f} {verdict:>8} "
                     f"{b.max_levels:>6} {ns(b.reg):>8} {ns(b.inp):>7} {ns(b.out):>8}  "
                     f"{kind}: {w.start} -> {w.end}{loop}")
    return "\n".join(lines)


# --- the units alone: ``python -m hdl.timing UNIT`` ----------------------------------------------------------
def _unit(name: str, hw):
    """(component, keep_depth) of a unit that `main` synthesises alone."""
    if name == "fpadd":
        from .fp import FpAdd
        return FpAdd(), 0
    if name == "fpmul":
        from .fp import FpMul
        return FpMul(), 0
    if name == "fpldexp":
        from .fp import FpLdexp
        return FpLdexp(10), 0
    if name == "divider":
        from .seq import SeqDivider
        return SeqDivider(), 0
    if name == "decoder":
        from .decoder import Decoder
        return Decoder(hw.l2_bytes // 16), 0
    if name == "csr-bridge":
        from .axi_csr import AxiToCsr
        return AxiToCsr(), 0
    if name == "quantiser":
        from .quant import ActQuantizer
        return ActQuantizer(hw), 1
    if name == "l2":
        from .l2 import L2
        return L2(hw, read_ports=3, write_ports=2, banks=hw.l2_banks), 1
    if name == "gemv-port":
        from .gemv import EnginePort, GemvEngine
        engine = GemvEngine(hw)                 # for its port parameters only
        engine._MustUse__silence = True         # not built: no "created but never used" warning
        return EnginePort(hw, 0, max_cols=engine.max_cols, max_segments=engine.max_segments,
                          tile_rows=engine._T), 1
    if name == "gemv":
        from .gemv import GemvEngine
        return GemvEngine(hw), 1
    if name == "gemm":
        from .gemm import GemmUnit
        return GemmUnit(hw), 1
    if name == "sfu":
        from .sfu import Sfu
        return Sfu(hw), 1
    if name == "ctl":
        from .controller import Controller
        return Controller(hw), 1
    raise ValueError(name)


UNITS = ("fpadd", "fpmul", "fpldexp", "divider", "decoder", "csr-bridge", "quantiser", "l2", "gemv-port", "gemv", "gemm",
         "sfu", "ctl")

# The parts of a unit synthesised as black boxes (`blackbox_modules`): the controller's large units, each with a
# unit of its own above (`l2`, `gemv`, `sfu`, `quantiser`), so that `ctl` is its own logic and its sequencers.
BLACK_BOXES = {"ctl": ("l2", "engine", "tracker", "packer")}


def blackbox_modules(rtlil_text: str, top: str, names) -> str:
    """`rtlil_text` with the modules ``top.<name>`` of `names` reduced to their ports and marked
    ``(* blackbox *)``: Yosys keeps their instances as cells it does not synthesise, and `analyse_netlist`
    treats them as boundaries (a path into or out of one is cut at its port)."""
    out, keep, box = [], True, False
    boxed = {f"{top}.{n}" for n in names}
    for line in rtlil_text.splitlines(keepends=True):
        if line.startswith("module "):
            box = line[len("module "):].strip().lstrip("\\") in boxed
            if box:
                out.append("attribute \\blackbox 1\n")
            out.append(line)
            continue
        if box:
            if line.startswith("end"):
                box = False
                out.append(line)
            elif line.startswith("  wire ") and (" input " in line or " output " in line):
                out.append(line)
            continue
        out.append(line)
    return "".join(out)


def unit_config(preset: str, kv_v_layout: str | None = None):
    """The `HardwareConfig` `main` builds a unit for: the preset, with its ``kv_v_layout`` replaced when given
    (``rows`` on an INT8-cache preset: the GEMV engine with INT8 weights, ``gemv_int8``). An invalid combination
    raises ValueError."""
    from .config import HardwareConfig
    hw = HardwareConfig.preset(preset)
    return hw if kv_v_layout is None else hw.replace(kv_v_layout=kv_v_layout)


def main(argv=None) -> int:
    """``python -m hdl.timing UNIT [--hw PRESET] [--kv-v-layout LAYOUT] [--no-gemv-pairs] [--act-block N]
    [--interleave]``: synthesise one unit alone as the NPU builds it (Yosys ``synth_xilinx -family xcup``, its parts
    kept as blocks) and print its utilisation and timing estimate against the preset's clock. Bad input: one line on
    stderr, exit status 2."""
    import argparse
    import sys

    from .config import KV_V_LAYOUTS, PRESETS
    from .synth import synthesize

    p = argparse.ArgumentParser(prog="python -m hdl.timing", description=main.__doc__.split("\n\n")[0]
                                .replace("``", ""))
    p.add_argument("unit", choices=UNITS, help="the unit to synthesise alone")
    p.add_argument("--hw", default="kv260", choices=sorted(PRESETS), help="hardware preset (default kv260)")
    p.add_argument("--kv-v-layout", choices=KV_V_LAYOUTS, default=None,
                   help="the preset's kv_v_layout replaced (rows: the GEMV engine with INT8 weights)")
    p.add_argument("--no-gemv-pairs", action="store_true",
                   help="the preset without gemv_pairs (a DSP48E2 and an adder tree for every vector)")
    p.add_argument("--act-block", type=int, default=None, metavar="N",
                   help="the preset's act_block replaced (activations sharing one scale; the GEMV engine's segments)")
    p.add_argument("--interleave", action="store_true",
                   help="the preset with gemv_interleave (the dense GEMV datapath's rows interleaved per beat)")
    args = p.parse_args(argv)
    try:
        hw = unit_config(args.hw, args.kv_v_layout)
    except ValueError as e:
        p.error(f"--kv-v-layout: {e}")
    if args.no_gemv_pairs:
        hw = hw.replace(gemv_pairs=False)
    if args.act_block is not None:
        try:
            hw = hw.replace(act_block=args.act_block)
        except ValueError as e:
            p.error(f"argument --act-block: {e}")
    if args.interleave:
        hw = hw.replace(gemv_interleave=True)
    component, depth = _unit(args.unit, hw)
    name = f"timing_{args.unit.replace('-', '_')}"
    text = None
    if args.unit in BLACK_BOXES:
        from amaranth.back import rtlil

        from .dsp import XILINX
        print(f"[synth] {name}: writing RTLIL ({', '.join(BLACK_BOXES[args.unit])} as black boxes)", file=sys.stderr)
        text = blackbox_modules(rtlil.convert(component, name=name, emit_src=False, platform=XILINX), name,
                                BLACK_BOXES[args.unit])
    util = synthesize(component, name, keep_depth=depth, rtlil_text=text, log=lambda msg: print(msg, file=sys.stderr))
    mhz = hw.clock_hz / 1e6
    label = args.hw + (f", kv_v_layout {args.kv_v_layout}" if args.kv_v_layout else "") + \
        (", no gemv_pairs" if args.no_gemv_pairs else "") + \
        (f", act_block {args.act_block}" if args.act_block is not None else "") + \
        (", gemv_interleave" if args.interleave else "")
    print(f"{args.unit} ({type(component).__name__}, {label}): {util.lut} LUT, {util.ff} FF, {util.dsp} DSP48E2, "
          f"{util.bram36:g} BRAM36, {util.uram} URAM288; target {mhz:g} MHz: a path of at most "
          f"{budget_ns(mhz):.2f} ns")
    print(format_timing(util.timing, mhz, title="block"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
