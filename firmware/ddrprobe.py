"""python -m firmware.ddrprobe: measure the DDR bandwidth the HP ports get on the board, with the DDR probe.

The performance model (`firmware.perf`) assumes the memory controller delivers ``ddr_efficiency`` (0.90) of
the DDR4-2400 x64 peak to the weight stream. Load the DDR probe's app (`hdl.ddrprobe.DdrProbe`, the NPU's
outside shape: the same system top, the same CSR window and a UIO device named ``npu``), run this, and feed
the printed ``--ddr-efficiency`` back to `python -m firmware.perf`.

The probe reads a weight matrix as a token's GEMV does (`sim.ddrprobe`): ``--rows`` x ``--cols`` INT4
weights at ``--base`` (default: the start of the first DDR window the NPU reserves, `hdl.memory_map`), with
their binary16 scales (``--group`` columns per scale) right after them, tiles of the GEMV engine's 8 rows
dealt round robin to the ports, each tile's scales then its rows in burst-sized chunks, round robin over the
tile's rows; ``--passes`` times. The default, E4B's FFN gate/up projection (16,384 x 2,048, group 128) read 16
times, is 264 MiB: about 15 ms at the ports' peak. Reading changes nothing in memory.

`measure(device, hw, config)` runs one measurement through any device with the blocking protocol of
`firmware.runtime.NpuDevice`'s CSR side: ``csr_read(offset)``, ``csr_write(offset, value)`` and
``wait_interrupt(timeout_s)`` (`firmware.board.UioCsr` on the board; the bench's simulated device,
tb/ddrprobe). The command line opens the probe's UIO device with `firmware.board.UioCsr` (under ``--root``)
and checks that the probe answers; on a machine without it, or with another design loaded, it stops with
one line naming what is missing (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Protocol

from hdl.config import HardwareConfig
from hdl.csr_map import NPU_ID
from hdl.ddrprobe_map import (
    CTRL_IRQ_ACK,
    CTRL_START,
    MAX_PORTS,
    PROBE_ID,
    PROBE_VERSION,
    STATUS_BUSY,
    STATUS_CONFIG_ERROR,
    STATUS_DONE,
    by_name,
    version_word,
)
from hdl.memory_map import memory_map
from sim.ddrprobe import ProbeConfig

from .board import BoardUnavailable, UioCsr
from .perf import DDR_PEAK_BYTES_PER_S

__all__ = ["ProbeDevice", "ProbeError", "Measurement", "measure", "report", "check_probe", "open_probe",
           "default_timeout", "main", "PROBE_APP", "LOAD_PROBE_APP", "DEFAULT_ROWS", "DEFAULT_COLS",
           "DEFAULT_PASSES"]

PROBE_APP = "gemma3n-ddrprobe"
LOAD_PROBE_APP = f"load the probe's app: sudo xmutil loadapp {PROBE_APP}"
REBUILD_PROBE = "rebuild it (python -m hdl.build --top ddr-probe; docs/kv260.md)"
DEFAULT_ROWS, DEFAULT_COLS, DEFAULT_PASSES = 16384, 2048, 16     # E4B's FFN gate/up projection, 16 times
MIN_TIMEOUT_S = 1.0
TIMEOUT_EFFICIENCY = 0.05       # the default timeout allows the run down to 5 % of the ports' peak


class ProbeDevice(Protocol):
    def csr_read(self, offset: int) -> int: ...

    def csr_write(self, offset: int, value: int) -> None: ...

    def wait_interrupt(self, timeout_s: float | None = None) -> object: ...


class ProbeError(RuntimeError):
    """The probe is absent, built for other hardware, refused the run or did not finish it in time."""


@dataclass(frozen=True)
class Measurement:
    """The counters of one run, and what they mean against the peaks.

    Attributes
    ----------
    hw, config : what ran.
    cycles : fabric cycles from START to the last beat.
    bytes_per_port : bytes read on each port built (R beats x bytes per beat).
    bursts, error_beats : read bursts issued; R beats answered SLVERR or DECERR.
    lat_sum, lat_min, lat_max : read latency (AR handshake to first R beat) in cycles.
    """

    hw: HardwareConfig
    config: ProbeConfig
    cycles: int
    bytes_per_port: tuple[int, ...]
    bursts: int
    error_beats: int
    lat_sum: int
    lat_min: int
    lat_max: int

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_port)

    @property
    def seconds(self) -> float:
        return self.cycles / self.hw.clock_hz

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.cycles else 0.0

    @property
    def port_efficiency(self) -> float:
        """Against the ports' peak: every port built moving one beat per cycle."""
        return self.bytes / (self.cycles * self.hw.axi_ports * self.hw.bytes_per_beat) if self.cycles else 0.0

    @property
    def ddr_efficiency(self) -> float:
        """Against the DDR4-2400 x64 peak (19.2 GB/s): `firmware.perf`'s ``ddr_efficiency``."""
        return self.bytes_per_second / DDR_PEAK_BYTES_PER_S

    @property
    def lat_mean(self) -> float:
        return self.lat_sum / self.bursts if self.bursts else 0.0


def _reg(name: str) -> int:
    return by_name(name).offset


def _write64(dev, name, value):
    dev.csr_write(_reg(f"{name}_LO"), value & 0xFFFF_FFFF)
    dev.csr_write(_reg(f"{name}_HI"), value >> 32)


def _read64(dev, name):
    return dev.csr_read(_reg(f"{name}_LO")) | dev.csr_read(_reg(f"{name}_HI")) << 32


def check_probe(device: ProbeDevice, hw: HardwareConfig, where: str = "") -> None:
    """Raise `ProbeError` unless `device` is a DDR probe built for `hw` (ID "DDRP", VERSION of `hw`).
    `where` names the register window in the messages (`firmware.board.UioCsr.where`)."""
    at = f"CSR 0x000 at {where}" if where else "CSR 0x000"
    ident = device.csr_read(_reg("ID"))
    if ident == NPU_ID:
        raise ProbeError(f"the DDR probe's ID register ({at}) reads {ident:#010x} (\"G3N1\"): the NPU is loaded, "
                         f"not the probe; {LOAD_PROBE_APP}")
    if ident != PROBE_ID:
        raise ProbeError(f"the DDR probe's ID register ({at}) reads {ident:#010x}, expected {PROBE_ID:#010x} "
                         f"(\"DDRP\"): the programmable logic does not hold the probe; {LOAD_PROBE_APP}")
    version, want = device.csr_read(_reg("VERSION")), version_word(hw.to_dict())
    if version & 0xFF != PROBE_VERSION:
        raise ProbeError(f"the DDR probe is version {version & 0xFF} (VERSION reads {version:#010x}), this tool "
                         f"drives version {PROBE_VERSION}: {REBUILD_PROBE}")
    if version != want:
        raise ProbeError(f"the DDR probe's VERSION reads {version:#010x}; a probe built for {hw.name!r} reads "
                         f"{want:#010x}: pass the --hw it was built for or {REBUILD_PROBE}")


def default_timeout(hw: HardwareConfig, config: ProbeConfig) -> float:
    """Seconds `measure` waits by default: the run at `TIMEOUT_EFFICIENCY` of the ports' peak, and at least
    `MIN_TIMEOUT_S`."""
    nbytes = config.matrix_bytes * config.pass_count
    return max(MIN_TIMEOUT_S, nbytes / (TIMEOUT_EFFICIENCY * hw.peak_weight_bytes_per_second))


def measure(device: ProbeDevice, hw: HardwareConfig, config: ProbeConfig, *,
            timeout_s: float | None = None) -> Measurement:
    """Run the probe once with `config` and return its counters. Raises ValueError for a configuration the
    probe would refuse, `ProbeError` if the device is not a probe built for `hw`, is busy, or does not
    interrupt within `timeout_s` seconds (default: `default_timeout`)."""
    config.check(hw)
    timeout_s = default_timeout(hw, config) if timeout_s is None else timeout_s
    check_probe(device, hw)
    if device.csr_read(_reg("STATUS")) & STATUS_BUSY:
        raise ProbeError("the probe is busy with another run")
    _write64(device, "WBASE", config.wbase)
    _write64(device, "SBASE", config.sbase)
    for name in ("ROWS", "ROW_BYTES", "SCALE_BYTES", "TILE_ROWS", "PASSES", "PORTS", "MAX_OUTSTANDING"):
        device.csr_write(_reg(name), getattr(config, name.lower()))
    device.csr_write(_reg("CTRL"), CTRL_START)
    try:
        device.wait_interrupt(timeout_s)
    except TimeoutError:
        status = device.csr_read(_reg("STATUS"))
        state = ": busy" if status & STATUS_BUSY else ""
        raise ProbeError(f"no interrupt from the DDR probe within {timeout_s:g} s (STATUS {status:#x}{state}): its "
                         f"reads did not complete; check --base against the DDR ranges, or allow longer with "
                         f"--timeout") from None
    status = device.csr_read(_reg("STATUS"))
    if status & STATUS_CONFIG_ERROR:
        raise ProbeError(f"the probe refused the configuration {config} (STATUS {status:#x})")
    if not status & STATUS_DONE:
        raise ProbeError(f"interrupt without STATUS.DONE (STATUS {status:#x})")
    result = Measurement(
        hw=hw, config=config, cycles=_read64(device, "CYCLES"),
        bytes_per_port=tuple(_read64(device, f"BYTES_P{p}") for p in range(hw.axi_ports)),
        bursts=_read64(device, "BURSTS"), error_beats=_read64(device, "ERROR_BEATS"),
        lat_sum=_read64(device, "LAT_SUM"), lat_min=device.csr_read(_reg("LAT_MIN")),
        lat_max=device.csr_read(_reg("LAT_MAX")))
    device.csr_write(_reg("CTRL"), CTRL_IRQ_ACK)
    return result


def report(m: Measurement) -> str:
    """The measurement as printed by the command line; the last line is the one to feed back."""
    hw, cfg = m.hw, m.config
    ns = 1e9 / hw.clock_hz
    ports = cfg.ports_used(hw)
    port_peak = hw.axi_ports * hw.bytes_per_beat * hw.clock_hz
    lines = [
        f"DDR probe on {hw.name}: {cfg.rows:,} rows of {cfg.row_bytes:,} bytes from {cfg.wbase:#x} and "
        f"{cfg.scale_bytes:,} scale bytes per row from {cfg.sbase:#x}, {cfg.pass_count} pass"
        f"{'es' if cfg.pass_count > 1 else ''}; tiles of {cfg.tile_rows} rows on {ports} of {hw.axi_ports} "
        f"ports, up to {cfg.outstanding(hw)} bursts of {hw.axi_max_burst_beats} beats in flight per port",
        f"  read {m.bytes:,} bytes ({', '.join(f'{b:,}' for b in m.bytes_per_port)} per port) in "
        f"{m.bursts:,} bursts, {m.cycles:,} cycles at {hw.clock_hz / 1e6:g} MHz = {m.seconds * 1e3:.3f} ms",
        f"  {m.bytes_per_second / 1e9:.3f} GB/s: {100 * m.port_efficiency:.1f} % of the ports' peak "
        f"({hw.axi_ports} x {hw.bytes_per_beat} B x {hw.clock_hz / 1e6:g} MHz = {port_peak / 1e9:.2f} GB/s), "
        f"{100 * m.ddr_efficiency:.1f} % of the DDR4-2400 x64 peak ({DDR_PEAK_BYTES_PER_S / 1e9:.1f} GB/s)",
    ]
    if m.bursts:
        lines.append(f"  read latency (AR to first R beat): mean {m.lat_mean:.1f} cycles ({m.lat_mean * ns:.0f} ns), "
                     f"min {m.lat_min} ({m.lat_min * ns:.0f} ns), max {m.lat_max} ({m.lat_max * ns:.0f} ns)")
    if m.error_beats:
        lines.append(f"  WARNING: {m.error_beats:,} beats were answered with an error: the range is not all DDR")
    if ports < hw.axi_ports:
        lines.append(f"  (only {ports} of {hw.axi_ports} ports: the NPU streams on all of them)")
    lines.append(f"python -m firmware.perf --hw {hw.name} --ddr-efficiency {m.ddr_efficiency:.3f}")
    return "\n".join(lines)


# --- the board ----------------------------------------------------------------------------------------------

def open_probe(hw: HardwareConfig, memory_map_name: str = "kv260", *, root: str | os.PathLike = "/",
               uio_name: str = "npu", csr=None, irq: int | None = None) -> UioCsr:
    """The probe's UIO device (`firmware.board.UioCsr`: discovery, the CSR window, the interrupt), checked to
    hold a probe built for `hw`. Raises `firmware.board.BoardUnavailable` when it is missing or another
    design answers. `csr` and `irq` as for `UioCsr` (tests, simulations)."""
    device = UioCsr(memory_map_name, root=root, uio_name=uio_name, csr=csr, irq=irq, load_hint=LOAD_PROBE_APP,
                    what="the DDR probe")
    try:
        check_probe(device, hw, device.where)
    except ProbeError as e:
        device.close()
        raise BoardUnavailable(str(e)) from None
    return device


def _int(text: str) -> int:
    return int(text, 0)


def main(argv=None, *, csr=None) -> int:
    """The command line. `csr`: the register accesses of `firmware.board.UioCsr`'s ``csr=`` (a simulation or a
    register model in tests; None on the board, where the CSR page is mapped)."""
    p = argparse.ArgumentParser(prog="python -m firmware.ddrprobe", description=__doc__.splitlines()[0])
    p.add_argument("--hw", default="kv260", help="the hardware preset the probe was built for")
    p.add_argument("--memory-map", default="kv260",
                   help="the memory map: the CSR window, and where --base defaults to (hdl.memory_map)")
    p.add_argument("--base", type=_int, help="DDR byte address of the matrix (default: the first NPU window)")
    p.add_argument("--rows", type=_int, default=DEFAULT_ROWS, help="matrix rows (GEMV outputs)")
    p.add_argument("--cols", type=_int, default=DEFAULT_COLS, help="matrix columns (GEMV inputs)")
    p.add_argument("--group", type=_int, default=0, help="columns per binary16 scale (0: the preset's group)")
    p.add_argument("--passes", type=_int, default=DEFAULT_PASSES, help="times the matrix is read")
    p.add_argument("--tile-rows", type=_int, help="rows per tile (default: the GEMV engine's)")
    p.add_argument("--ports", type=int, default=0, help="ports to use (0: all)")
    p.add_argument("--max-outstanding", type=int, default=0, help="bursts in flight per port (0: the maximum)")
    p.add_argument("--timeout", type=float, help="seconds to wait for the run (default: the run at 5 %% of the "
                                                 "ports' peak, at least 1 s)")
    p.add_argument("--clock-mhz", type=float, help="the core clock the probe was built for (`python -m hdl.build "
                                                   "--clock-mhz`; default: the preset's)")
    p.add_argument("--uio-name", default="npu", help="name of the probe's UIO device")
    p.add_argument("--root", default="/", help="file-system root of sys/class/uio and dev (a stand-in board)")
    args = p.parse_args(argv)
    try:
        hw = HardwareConfig.preset(args.hw)
        if args.clock_mhz is not None:
            if not 0 < args.clock_mhz <= 1000:
                raise ValueError(f"--clock-mhz must be a number of MHz in (0, 1000], not {args.clock_mhz!r}")
            hw = hw.replace(clock_hz=round(args.clock_mhz * 1e6))
        if hw.axi_ports > MAX_PORTS:
            raise ValueError(f"the probe has at most {MAX_PORTS} ports, {hw.name!r} has {hw.axi_ports}")
        base = memory_map(args.memory_map).windows[0].base if args.base is None else args.base
        extra = {} if args.tile_rows is None else {"tile_rows": args.tile_rows}
        config = ProbeConfig.gemv(hw, args.rows, args.cols, base=base, group=args.group or None,
                                  passes=args.passes, ports=args.ports, max_outstanding=args.max_outstanding,
                                  **extra).check(hw)
        if args.timeout is not None and not args.timeout > 0:
            raise ValueError(f"--timeout must be a positive number of seconds, not {args.timeout!r}")
    except ValueError as e:
        print(f"firmware.ddrprobe: {e}", file=sys.stderr)
        return 2
    try:
        device = open_probe(hw, args.memory_map, root=args.root, uio_name=args.uio_name, csr=csr)
    except BoardUnavailable as e:
        print(f"firmware.ddrprobe: {e}", file=sys.stderr)
        return 2
    try:
        print(report(measure(device, hw, config, timeout_s=args.timeout)))
    except ProbeError as e:
        print(f"firmware.ddrprobe: {e}", file=sys.stderr)
        return 2
    finally:
        device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
