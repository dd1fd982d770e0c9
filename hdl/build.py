"""``python -m hdl.build``: build the KV260 system around the NPU (or another top) for a hardware preset.

Tops (``--top``):

``system``     (default) `hdl.kv260.Kv260System` around the NPU (`hdl.npu.Npu`): the PS8, its clocks and
               reset, HPM0 to the CSRs, HP0..3 to the NPU's AXI masters, the interrupt, the fan. Written
               through Amaranth's own Vivado flow (`hdl.kv260.KV260Platform`): ``<out>/vivado/`` holds
               ``gemma3n_npu.v`` (and ``.il``), ``gemma3n_npu.tcl``, ``gemma3n_npu.xdc`` and
               ``build_gemma3n_npu.sh``; and the Kria app folder ``<out>/app/gemma3n-npu/`` (``.dtsi``,
               ``.dtbo``, ``shell.json``; `hdl.kria`) with ``<out>/app/reserved-memory.dtsi`` for the board's
               device tree.
``ddr-probe``  the same system around `hdl.ddrprobe.DdrProbe` (app ``gemma3n-ddrprobe``).
``npu``        the NPU core alone: ``<out>/npu_top.v`` and ``.il``, and an out-of-context Vivado script
               (``<out>/vivado/build.tcl``, ``npu_top.xdc``: utilisation and timing at the preset's clock).
``gemv``       the GEMV engine alone, the same way.

``--clock-mhz MHZ`` builds for another core clock than the preset's (for example the clock the timing
estimate supports): the system's MMCM setting, the core's XDC and the estimate's target follow it; a clock
the MMCM cannot make from pl_clk0 is bad input.

Flows of a system top (``--flow``): ``hdl`` (default) is the above; ``bd`` writes instead a Vivado
block design (``<out>/vivado_bd/<name>_bd.tcl``: ``zynq_ultra_ps_e`` on the KV260 board part with the
core as a module reference; `hdl.kv260.block_design_tcl`), which also yields ``<name>.xsa`` and
``<name>.hwh``; the app folder is the same.

Where ``vivado`` is on PATH the build runs the Vivado script; a system build then puts ``<app>.bit.bin``
in the app folder, ready to copy to ``/lib/firmware/xilinx/<app>/`` on the board. Vivado is not open
source and cannot be installed everywhere: without it the build writes everything else, says so, and
exits 0.

The Yosys utilisation estimate (``synth_xilinx -family xcup``, `hdl.synth`) is opt-in (``--synth``): on
the kv260 NPU it takes 30 to 50 minutes on two cores, while everything else here takes minutes (most of
it the Verilog of the NPU). The same Yosys run gives the timing estimate (`hdl.timing`): per unit, the logic
levels and estimated delay of the worst register-to-register path of the mapped netlist against the preset's
clock (``<out>/timing.txt`` has every block). Both are cached in ``<out>/synth/cache/``, keyed by the sha256
of the design's RTLIL, the estimate's options and the timing model's version, so repeating a build of an
unchanged design prints the same tables at once.

Output: the first lines say what the build produces and where; then one line per stage
(``[k/5] <stage> ...``, with the time since the start); the last lines list what was written.
Bad input (a top that does not exist in this tree, a core that does not fit the system, ``--synth`` with
a build directory YoWASP Yosys cannot see, a clock the MMCM cannot make) is one line on stderr and exit
status 2; a missing ``dtc`` or a failed Vivado run is one line and exit status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .config import PRESETS, HardwareConfig
from .dsp import XILINX
from .synth import ROOT, Utilisation, format_breakdown, format_table, synthesize
from .timing import LEVEL_NS, MODEL as TIMING_MODEL, TARGET_MARGIN, BlockTiming, budget_ns, fmax_mhz, \
    format_timing, group_timing

__all__ = ["top", "build", "main", "TOPS", "SYSTEM_TOPS", "CORE_TOPS", "FLOWS", "APP_NAMES", "BuildError"]

TOP_NAME = "npu_top"
SYSTEM_TOPS = ("system", "ddr-probe")
CORE_TOPS = ("npu", "gemv")
TOPS = SYSTEM_TOPS + CORE_TOPS
FLOWS = ("hdl", "bd")
APP_NAMES = {"system": "gemma3n-npu", "ddr-probe": "gemma3n-ddrprobe"}
KEEP_DEPTH = 3


class BuildError(Exception):
    """Bad input or a missing prerequisite: reported as one line, with `status` as the exit status."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def _core(cfg: HardwareConfig, which: str):
    """The core of a system top: (component, instance name)."""
    if which == "system":
        from .npu import Npu
        return Npu(cfg), "npu"
    try:
        from .ddrprobe import DdrProbe
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.ddrprobe":
            raise
        raise BuildError("--top ddr-probe needs hdl/ddrprobe.py (hdl.ddrprobe.DdrProbe), which this tree "
                         "does not have") from None
    return DdrProbe(cfg), "ddrprobe"


def top(cfg: HardwareConfig, which: str = "system", *, core=None):
    """The design `hdl.build` builds: the KV260 system around the NPU (``"system"``) or the DDR probe
    (``"ddr-probe"``), the NPU alone (``"npu"``: CSRs, fetch, controller, L2, SFU, GEMV engine, DDR movers,
    AXI ports), or the GEMV engine and its AXI4 read masters alone (``"gemv"``). A system top takes
    another `core` (a component of the shape `hdl.kv260.check_core` describes) when one is given."""
    if which in SYSTEM_TOPS:
        from .kv260 import Kv260System
        core, name = _core(cfg, which) if core is None else (core, "core")
        try:
            return Kv260System(cfg, core, core_name=name)
        except (TypeError, ValueError) as e:
            raise BuildError(f"{type(core).__name__} does not fit the KV260 system: {e}") from None
    if which == "npu":
        from .npu import Npu
        return Npu(cfg)
    if which == "gemv":
        from .gemv import GemvEngine
        return GemvEngine(cfg)
    raise BuildError(f"unknown top {which!r}; choose one of: {', '.join(TOPS)}")


# --- the core alone: out-of-context Vivado ---------------------------------------------------------
def _xdc(cfg: HardwareConfig) -> str:
    base = (ROOT / "constraints" / f"{cfg.name}.xdc")
    if base.exists() and cfg.clock_hz == HardwareConfig.preset(cfg.name).clock_hz:
        return base.read_text()
    period = 1e9 / cfg.clock_hz
    return (f"# {cfg.name}: the NPU's single clock ({cfg.clock_hz / 1e6:g} MHz)\n"
            f"create_clock -name clk -period {period:.3f} [get_ports clk]\n")


def _ooc_tcl(cfg: HardwareConfig) -> str:
    part = cfg.device.name
    return f"""# Out-of-context synthesis and implementation of {TOP_NAME} ({cfg.name}) on {part}.
# Generated by python -m hdl.build; run from this directory: vivado -mode batch -source build.tcl
set_part {part}
read_verilog ../{TOP_NAME}.v
read_xdc -mode out_of_context {TOP_NAME}.xdc
synth_design -top {TOP_NAME} -part {part} -mode out_of_context -flatten_hierarchy rebuilt
report_utilization -file synth_utilization.rpt
opt_design
place_design
phys_opt_design
route_design
report_utilization -file utilization.rpt
report_utilization -hierarchical -file utilization_hierarchical.rpt
report_timing_summary -file timing.rpt
write_checkpoint -force {TOP_NAME}_routed.dcp
"""


# --- the Yosys estimate, cached ----------------------------------------------------------------------
def _util_to_json(util: Utilisation) -> dict:
    return asdict(util)             # the blocks, Utilisations themselves, become dicts too


def _util_from_json(d: dict) -> Utilisation:
    blocks = {k: Utilisation(**b) for k, b in d.pop("blocks").items()}
    timing = {k: BlockTiming.from_dict(t) for k, t in d.pop("timing").items()}
    util = Utilisation(**d)
    util.blocks, util.timing = blocks, timing
    return util


def _cache_key(il_text: str, name: str, keep_depth: int) -> str:
    """The sha256 of the design, the estimate's options and the version of the timing model (`hdl.timing`):
    a cached result without the timing, or with other delays, is not reused."""
    return hashlib.sha256(il_text.encode() + f"\0top={name}\0keep_depth={keep_depth}\0uram=1\0"
                          f"timing={TIMING_MODEL}".encode()).hexdigest()


def _estimate(il_text: str, name: str, out: Path, keep_depth: int, log) -> tuple[Utilisation, bool]:
    """The Yosys estimate of the RTLIL `il_text` (top module `name`), from the cache in ``<out>/synth/cache``
    when an identical design was estimated with the same options; returns (utilisation, from cache)."""
    synth_dir = out / "synth"
    try:
        synth_dir.resolve().relative_to(ROOT)
    except ValueError:
        raise BuildError(f"--synth needs the build directory inside the repository ({ROOT}): YoWASP Yosys "
                         f"only sees that tree; {out} is outside it") from None
    cache = synth_dir / "cache" / f"{_cache_key(il_text, name, keep_depth)}.json"
    if cache.exists():
        return _util_from_json(json.loads(cache.read_text())), True
    util = synthesize(None, name, build_dir=synth_dir, rtlil_text=il_text, keep_depth=keep_depth,
                      log=lambda msg: log(f"      {msg}"))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(_util_to_json(util)) + "\n")
    return util, False


def _report(util: Utilisation, cfg: HardwareConfig, unit_depth: int) -> tuple[str, str]:
    """(the table printed, the text saved): totals, per unit, and (saved only) per block."""
    report = format_table(util, cfg.device)
    if util.blocks:
        report += "\n\nby unit\n" + format_breakdown(util, cfg.device, depth=unit_depth)
    saved = report
    if util.blocks:
        saved += "\n\nby block\n" + format_breakdown(util, cfg.device)
    return report, saved


def _timing_report(util: Utilisation, cfg: HardwareConfig, unit_depth: int) -> tuple[str, str]:
    """(the table printed, the text saved): the timing estimate per unit, and (saved only) per block, with
    the clock the slowest unit reaches where one misses the preset's clock."""
    mhz = cfg.clock_hz / 1e6
    head = (f"timing estimate on {cfg.device.name} (hdl.timing: logic levels and estimated delay of the worst "
            f"path of the mapped netlist, cut at the kept blocks' ports; target {mhz:g} MHz: a path of at most "
            f"{budget_ns(mhz):.2f} ns, {100 * (1 - TARGET_MARGIN):.0f} % of the {1e3 / mhz:.2f} ns period, about "
            f"{int((budget_ns(mhz) - 0.15) // LEVEL_NS)} LUT levels)")
    units = group_timing(util.timing, unit_depth) if util.blocks else util.timing
    report = head + "\n" + format_timing(units, mhz)
    delays = {n: t.worst[1].delay for n, t in units.items() if t.worst[1]}
    worst = max(delays.values(), default=0.0)
    if worst > budget_ns(mhz):
        over = [n for n, d in delays.items() if d > budget_ns(mhz)]
        reach = math.floor(fmax_mhz(worst))
        report += (f"\n{len(over)} unit(s) over {mhz:g} MHz ({', '.join(sorted(over))}); the slowest reaches "
                   f"{reach} MHz: its tok/s is `python -m firmware.perf --clock-mhz {reach}`, a build for it "
                   f"`python -m hdl.build --clock-mhz {reach}`")
    else:
        report += f"\nevery unit's estimated worst path meets {mhz:g} MHz"
    saved = report
    if util.blocks:
        saved += "\n\nby block\n" + format_timing(util.timing, mhz, title="block")
    return report, saved


def _synth_stage(il_text: str, name: str, out: Path, keep_depth: int, cfg: HardwareConfig, unit_depth: int,
                 stage, log, result: dict, skipped: str) -> None:
    """Stage 4: the Yosys estimate (`_estimate`) printed per unit and saved per block in ``<out>/utilisation.txt``
    and ``<out>/timing.txt`` (into ``result["utilisation"]``, its timing in ``.timing``), or the line saying it
    was skipped."""
    if skipped is not None:
        stage(4, "yosys", skipped)
        return
    util, cached = _estimate(il_text, name, out, keep_depth, log)
    result["utilisation"] = util
    stage(4, "yosys", "cached estimate of this exact design" if cached else
          f"done; log in {_rel(out / 'synth' / 'synth.log')}")
    report, saved = _report(util, cfg, unit_depth)
    log(report)
    (out / "utilisation.txt").write_text(saved + "\n")
    log(f"      every block: {_rel(out / 'utilisation.txt')}")
    report, saved = _timing_report(util, cfg, unit_depth)
    log("\n" + report)
    (out / "timing.txt").write_text(saved + "\n")
    log(f"      every block: {_rel(out / 'timing.txt')}")


# --- the build -------------------------------------------------------------------------------------
def _rel(p: Path) -> str:
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def build(hw: str = "kv260", out: str | Path | None = None, *, synth: bool = False, which: str = "system",
          flow: str = "hdl", keep_depth: int = KEEP_DEPTH, core=None, clock_mhz: float | None = None,
          log=print) -> dict:
    """Run the build; returns the files written by role, the utilisation (None without `synth`) and whether
    Vivado ran. Raises `BuildError` for bad input and missing prerequisites.

    `keep_depth`: the Yosys estimate keeps the core's blocks down to this depth below the core (3: the NPU's
    units such as ``ctl.gemv`` and their parts such as ``ctl.gemv.port0``) and reports each
    (`hdl.synth.synthesize`); 0 flattens the whole design (more than two hours for the kv260 NPU).
    `core`: for a system top, the core to build it around instead of the top's own (`top`). `flow`: for a
    system top, ``"hdl"`` (the HDL top in Amaranth's Vivado flow) or ``"bd"`` (the block design)."""
    if which not in TOPS:
        raise BuildError(f"unknown top {which!r}; choose one of: {', '.join(TOPS)}")
    if flow not in FLOWS:
        raise BuildError(f"unknown flow {flow!r}; choose one of: {', '.join(FLOWS)}")
    if flow == "bd" and which not in SYSTEM_TOPS:
        raise BuildError(f"--flow bd builds a system (--top {' or '.join(SYSTEM_TOPS)}), not --top {which}")
    cfg = HardwareConfig.preset(hw)
    if clock_mhz is not None:
        cfg = cfg.replace(clock_hz=_clock_hz(clock_mhz))
    out = Path(out or ROOT / "build" / hw).resolve()
    if which in SYSTEM_TOPS:
        if flow == "bd":
            return _build_block_design(cfg, out, which, synth=synth, keep_depth=keep_depth, core=core, log=log)
        return _build_system(cfg, out, which, synth=synth, keep_depth=keep_depth, core=core, log=log)
    return _build_core(cfg, out, which, synth=synth, keep_depth=keep_depth, log=log)


def _clock_hz(mhz: float) -> int:
    """The core clock of ``--clock-mhz``: one the MMCM makes from pl_clk0 (the system's clock source)."""
    from .kv260 import PL_CLK0_HZ, mmcm_config

    hz = round(mhz * 1e6) if isinstance(mhz, (int, float)) and not isinstance(mhz, bool) and math.isfinite(mhz) \
        else None
    if hz is None or hz <= 0:
        raise BuildError(f"--clock-mhz must be a positive number of MHz, not {mhz!r}")
    try:
        mmcm_config(PL_CLK0_HZ, hz)
    except ValueError as e:
        raise BuildError(f"--clock-mhz {mhz:g}: {e}") from None
    return hz


def _stager(log, total=5):
    t0 = time.monotonic()

    def stage(k, name, msg):
        log(f"[{k}/{total}] {name:<9} {msg} ({time.monotonic() - t0:.1f} s)")
    return stage


def _build_system(cfg, out, which, *, synth, keep_depth, core, log) -> dict:
    from .kv260 import PL_CLK0_HZ, KV260Platform

    app = APP_NAMES[which]
    name = app.replace("-", "_")
    vdir, app_dir = out / "vivado", out / "app" / app
    design = top(cfg, which, core=core)
    mm = design.mmcm
    log(f"hdl.build: the KV260 system around {type(design.core).__name__} for {cfg.name} "
        f"({cfg.clock_hz / 1e6:g} MHz); it writes")
    log(f"  Vivado project (Amaranth's flow): {_rel(vdir)}/ {name}.v, {name}.tcl, {name}.xdc, build_{name}.sh")
    log(f"  Kria app:                         {_rel(app_dir)}/ {app}.dtsi, {app}.dtbo, shell.json"
        f" (+ {app}.bit.bin where Vivado runs)")
    log(f"  board device-tree fragment:       {_rel(out / 'app' / 'reserved-memory.dtsi')}")
    stage = _stager(log)
    stage(1, "elaborate", f"Kv260System({type(design.core).__name__}) for {cfg.name}: {len(design._hp_sigs)} x "
                          f"{cfg.axi_data_bits}-bit HP ports, MMCM {PL_CLK0_HZ / 1e6:g} MHz x {float(mm.mult):g} / "
                          f"({mm.divclk} x {float(mm.divide):g}) = {mm.f_out_hz / 1e6:g} MHz")
    # One Amaranth conversion (minutes for the whole NPU); the platform writes its Verilog and the Tcl.
    plan = KV260Platform().build(design, name=name, do_build=False, emit_src=False)
    vdir.mkdir(parents=True, exist_ok=True)
    plan.extract(vdir)
    stage(2, "vivado", f"{_rel(vdir)}/{{{name}.v, {name}.tcl, {name}.xdc, build_{name}.sh}}")

    result = {"verilog": vdir / f"{name}.v", "rtlil": vdir / f"{name}.il", "tcl": vdir / f"{name}.tcl",
              "xdc": vdir / f"{name}.xdc", "script": vdir / f"build_{name}.sh", "vivado_dir": vdir,
              "app_dir": app_dir, "utilisation": None, "vivado_ran": False}
    dtc_error = _write_app(out, app, design.core, stage, result)

    # Blocks are named from the system's top (``npu.ctl.gemv``): the units are one level deeper.
    _synth_stage(plan.files[f"{name}.il"], name, out, keep_depth + 1 if keep_depth else 0, cfg, 3, stage, log,
                 result, None if synth else "skipped (--synth estimates the utilisation: 30-50 min for kv260, "
                                            "then cached)")

    vivado = shutil.which("vivado")
    if vivado is None:
        stage(5, "vivado", f"Vivado not found on PATH: bitstream not built; run {_rel(vdir)}/build_{name}.sh "
                           f"where Vivado is, then copy {name}.bit.bin to {_rel(app_dir)}/{app}.bit.bin")
    else:
        stage(5, "vivado", f"running build_{name}.sh in {_rel(vdir)} (log: {name}.log)")
        proc = subprocess.run(["bash", f"build_{name}.sh"], cwd=vdir)
        if proc.returncode:
            raise BuildError(f"Vivado failed (exit status {proc.returncode}); see {vdir / (name + '.log')}", 1)
        shutil.copyfile(vdir / f"{name}.bit.bin", app_dir / f"{app}.bit.bin")
        result["vivado_ran"] = True
        log(f"      bitstream: {_rel(app_dir / (app + '.bit.bin'))}; reports: {_rel(vdir)}/{name}_*.rpt")
    log(f"done: Kria app in {_rel(app_dir)} (copy it to /lib/firmware/xilinx/{app}/ on the board), "
        f"Vivado project in {_rel(vdir)}")
    if dtc_error:
        raise BuildError(dtc_error, 1)
    return result


def _write_app(out, app, core, stage, result):
    """Stage 3 of a system build: the Kria app folder; returns the dtc error, if dtc is missing."""
    from .kria import DtcNotFound, write_app
    from .kv260 import PL_CLK0_HZ, afi_config

    app_dir = out / "app" / app
    try:
        files = write_app(app_dir, app, "kv260", afi_config(core), pl_clk0_hz=PL_CLK0_HZ)
    except DtcNotFound as e:
        stage(3, "app", f"{_rel(app_dir)}/{{{app}.dtsi, shell.json}} written, {app}.dtbo NOT compiled: {e}")
        return str(e)
    result.update({f"app_{k}": v for k, v in files.items()})
    stage(3, "app", f"{_rel(app_dir)}/{{{app}.dtsi, {app}.dtbo, shell.json}}, "
                    f"{_rel(out / 'app')}/reserved-memory.dtsi")
    return None


def _build_block_design(cfg, out, which, *, synth, keep_depth, core, log) -> dict:
    from amaranth.back import rtlil, verilog

    from .kv260 import PL_CLK0_HZ, block_design_tcl, block_design_xdc, check_core, mmcm_config, module_reference_verilog
    from .memory_map import MEMORY_MAPS

    app = APP_NAMES[which]
    name = app.replace("-", "_")
    module = f"{name}_core"
    bdir, app_dir = out / "vivado_bd", out / "app" / app
    if core is None:
        core, _ = _core(cfg, which)
    try:
        csr, hps = check_core(core)
        mmcm_config(PL_CLK0_HZ, cfg.clock_hz)       # a clock the Clocking Wizard can make, as in the HDL flow
    except (TypeError, ValueError) as e:
        raise BuildError(f"{type(core).__name__} does not fit the KV260 system: {e}") from None
    log(f"hdl.build: the KV260 system around {type(core).__name__} for {cfg.name} ({cfg.clock_hz / 1e6:g} MHz) "
        f"as a Vivado block design; it writes")
    log(f"  Vivado block design: {_rel(bdir)}/ {name}_bd.tcl, {name}_bd.xdc, {module}.v, {module}_inner.v "
        f"(-> {name}.bit, {name}.xsa, {name}.hwh)")
    log(f"  Kria app:            {_rel(app_dir)}/ {app}.dtsi, {app}.dtbo, shell.json"
        f" (+ {app}.bit.bin where Vivado runs)")
    log(f"  board device-tree fragment: {_rel(out / 'app' / 'reserved-memory.dtsi')}")
    stage = _stager(log)
    mm = MEMORY_MAPS["kv260"]
    stage(1, "elaborate", f"{module}: {type(core).__name__} as a module reference, {len(hps)} HP ports")
    # The core's own module (one Amaranth conversion), and the module reference around it.
    inner = f"{module}_inner"
    il_text = rtlil.convert(core, name=inner, emit_src=False, platform=XILINX)
    inner_v = verilog._convert_rtlil_text(il_text)
    header = re.search(rf"^module {inner}\((.*?)\);", inner_v, flags=re.M | re.S)
    inner_ports = [p.strip().lstrip("\\") for p in header.group(1).split(",")]
    bdir.mkdir(parents=True, exist_ok=True)
    (bdir / f"{inner}.v").write_text(inner_v)
    (bdir / f"{module}.v").write_text(module_reference_verilog(module, cfg, core, inner, inner_ports))
    (bdir / f"{name}_bd.tcl").write_text(block_design_tcl(
        name, cfg, module, [s.data_bits for s in hps], csr.data_bits, csr_base=mm.csr_base, csr_size=mm.csr_size))
    (bdir / f"{name}_bd.xdc").write_text(block_design_xdc())
    stage(2, "vivado", f"{_rel(bdir)}/{{{name}_bd.tcl, {name}_bd.xdc, {module}.v, {inner}.v}}")
    result = {"verilog": bdir / f"{module}.v", "inner_verilog": bdir / f"{inner}.v", "tcl": bdir / f"{name}_bd.tcl",
              "xdc": bdir / f"{name}_bd.xdc", "vivado_dir": bdir, "app_dir": app_dir, "utilisation": None,
              "vivado_ran": False}
    dtc_error = _write_app(out, app, core, stage, result)
    _synth_stage(il_text, inner, out, keep_depth, cfg, 2, stage, log, result,
                 None if synth else "skipped (--synth estimates the core's utilisation, then caches it)")
    vivado = shutil.which("vivado")
    if vivado is None:
        stage(5, "vivado", f"Vivado not found on PATH: bitstream not built; run vivado -mode batch -source "
                           f"{name}_bd.tcl in {_rel(bdir)} where Vivado is, then copy {name}.bit.bin to "
                           f"{_rel(app_dir)}/{app}.bit.bin")
    else:
        stage(5, "vivado", f"running {vivado} -mode batch -source {name}_bd.tcl in {_rel(bdir)}")
        proc = subprocess.run([vivado, "-mode", "batch", "-source", f"{name}_bd.tcl"], cwd=bdir)
        if proc.returncode:
            raise BuildError(f"Vivado failed (exit status {proc.returncode}); see {bdir / 'vivado.log'}", 1)
        shutil.copyfile(bdir / f"{name}.bit.bin", app_dir / f"{app}.bit.bin")
        result["vivado_ran"] = True
        log(f"      bitstream: {_rel(app_dir / (app + '.bit.bin'))}; platform: {_rel(bdir / (name + '.xsa'))}")
    log(f"done: Kria app in {_rel(app_dir)} (copy it to /lib/firmware/xilinx/{app}/ on the board), "
        f"block design in {_rel(bdir)}")
    if dtc_error:
        raise BuildError(dtc_error, 1)
    return result


def _build_core(cfg, out, which, *, synth, keep_depth, log) -> dict:
    from amaranth.back import rtlil, verilog

    vdir = out / "vivado"
    log(f"hdl.build: the {'NPU' if which == 'npu' else 'GEMV engine'} core alone for {cfg.name} "
        f"(out of context, no board); writes")
    log(f"  {_rel(out)}/{TOP_NAME}.v, {TOP_NAME}.il; {_rel(vdir)}/build.tcl, {TOP_NAME}.xdc")
    out.mkdir(parents=True, exist_ok=True)
    stage = _stager(log)
    design = top(cfg, which)
    stage(1, "elaborate", f"{type(design).__name__} for {cfg.name}: {cfg.axi_ports} x {cfg.axi_data_bits}-bit "
                          f"AXI4 ports, {cfg.gemv_lanes} GEMV lanes, {cfg.clock_hz / 1e6:g} MHz")
    # One Amaranth conversion (minutes for the whole NPU): RTLIL, from which Yosys writes the Verilog.
    # Elaborated for the device: vendor primitives (`hdl.dsp`) where the RTL has them.
    il_text = rtlil.convert(design, name=TOP_NAME, emit_src=False, platform=XILINX)
    vfile = out / f"{TOP_NAME}.v"
    vfile.write_text(verilog._convert_rtlil_text(il_text))
    stage(2, "verilog", _rel(vfile))
    ilfile = out / f"{TOP_NAME}.il"
    ilfile.write_text(il_text)
    stage(3, "rtlil", _rel(ilfile))
    result = {"verilog": vfile, "rtlil": ilfile, "vivado_dir": vdir, "utilisation": None, "vivado_ran": False}
    _synth_stage(il_text, TOP_NAME, out, keep_depth, cfg, 2, stage, log, result,
                 None if synth else "skipped (--synth estimates the utilisation, then caches it)")
    vdir.mkdir(exist_ok=True)
    (vdir / f"{TOP_NAME}.xdc").write_text(_xdc(cfg))
    (vdir / "build.tcl").write_text(_ooc_tcl(cfg))
    vivado = shutil.which("vivado")
    if vivado is None:
        stage(5, "vivado", f"Vivado not found on PATH: out-of-context run not done; inputs are in {_rel(vdir)}")
        return result
    stage(5, "vivado", f"running {vivado} -mode batch -source build.tcl in {_rel(vdir)}")
    proc = subprocess.run([vivado, "-mode", "batch", "-source", "build.tcl"], cwd=vdir)
    if proc.returncode:
        raise BuildError(f"Vivado failed (exit status {proc.returncode}); see {vdir / 'vivado.log'}", 1)
    result["vivado_ran"] = True
    log(f"      reports: {_rel(vdir / 'utilization.rpt')}, {_rel(vdir / 'timing.rpt')}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hdl.build",
                                     description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--hw", default="kv260", choices=sorted(PRESETS), help="hardware preset (default kv260)")
    parser.add_argument("--out", help="build directory (default build/<hw>)")
    parser.add_argument("--top", default="system", choices=TOPS,
                        help="what to build (default: the KV260 system around the NPU)")
    parser.add_argument("--flow", default="hdl", choices=FLOWS,
                        help="system tops: hdl (default: the PS8 from HDL, Amaranth's Vivado flow) or bd (a Vivado "
                             "block design with zynq_ultra_ps_e, for an .xsa/.hwh)")
    parser.add_argument("--synth", action="store_true",
                        help="estimate the utilisation and the timing with Yosys (30-50 min for the kv260 NPU; "
                             "cached by the design's sha256 in <out>/synth/cache)")
    parser.add_argument("--flat", action="store_true",
                        help=f"with --synth: estimate the flattened design (default: the core's units kept as "
                             f"blocks, {KEEP_DEPTH} levels deep, with a per-block breakdown)")
    parser.add_argument("--clock-mhz", type=float, metavar="MHZ",
                        help="build for this core clock instead of the preset's (for example the clock the "
                             "--synth timing estimate supports): the MMCM's setting, the XDC and the estimate's "
                             "target follow it")
    args = parser.parse_args(argv)
    if args.flat and not args.synth:
        parser.error("--flat applies to the --synth estimate")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out!r} exists and is not a directory")
    try:
        build(args.hw, args.out, synth=args.synth, which=args.top, flow=args.flow,
              keep_depth=0 if args.flat else KEEP_DEPTH, clock_mhz=args.clock_mhz)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    except OSError as e:
        print(f"python -m hdl.build: cannot write the build: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
