"""python -m firmware.ddrprobe: measure the DDR bandwidth the HP ports get on the board, with the DDR probe.

The performance model (`firmware.perf`) assumes the memory controller delivers ``ddr_efficiency`` (0.90) of
the DDR4-2400 x64 peak to the weight stream. Load the DDR probe's bitstream (`hdl.ddrprobe.DdrProbe`, the
NPU's outside shape, so the same system top, overlay and ``/dev/uioN`` named ``npu``), run this, and feed
the printed ``--ddr-efficiency`` back to `python -m firmware.perf`.

`measure(device, hw, config)` runs one measurement through any device with the blocking protocol of
`firmware.runtime.NpuDevice`'s CSR side: ``csr_read(offset)``, ``csr_write(offset, value)`` and
``wait_interrupt()`` (the board device; the bench's simulated device, tb/ddrprobe). The command line opens the
probe's UIO device (its CSR window, map 0, and its interrupt) by name under ``/sys/class/uio``; on a machine
without it, it stops with one line naming what is missing (exit status 2).

The probe reads ``--total`` bytes from ``--base`` (default: the start of the first DDR window the NPU
reserves, `hdl.memory_map`) in chunks of ``--chunk`` bytes, chunk j on port j mod ``--ports``, as the GEMV
engine streams a matrix tile by tile (8 KiB: a row tile of E4B's 2,048-column matrices, 8 rows of 1,024
bytes). Reading changes nothing in memory.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hdl.config import HardwareConfig
from hdl.csr_map import NPU_ID
from hdl.ddrprobe_map import (CTRL_IRQ_ACK, CTRL_START, MAX_PORTS, PROBE_ID, STATUS_BUSY, STATUS_CONFIG_ERROR,
                              STATUS_DONE, by_name, version_word)
from hdl.memory_map import memory_map
from sim.ddrprobe import ProbeConfig

from .perf import DDR_PEAK_BYTES_PER_S

__all__ = ["ProbeDevice", "ProbeError", "Measurement", "measure", "report", "find_uio", "UioDevice", "main",
           "DEFAULT_CHUNK", "DEFAULT_TOTAL"]

DEFAULT_CHUNK = 8192
DEFAULT_TOTAL = 256 << 20
UIO_ROOT = Path("/sys/class/uio")


class ProbeDevice(Protocol):
    def csr_read(self, offset: int) -> int: ...

    def csr_write(self, offset: int, value: int) -> None: ...

    def wait_interrupt(self) -> None: ...


class ProbeError(RuntimeError):
    """The probe is absent, built for other hardware, or refused the run."""


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


def _write64(dev, name, value):
    dev.csr_write(by_name(f"{name}_LO").offset, value & 0xFFFF_FFFF)
    dev.csr_write(by_name(f"{name}_HI").offset, value >> 32)


def _read64(dev, name):
    return dev.csr_read(by_name(f"{name}_LO").offset) | dev.csr_read(by_name(f"{name}_HI").offset) << 32


def measure(device: ProbeDevice, hw: HardwareConfig, config: ProbeConfig) -> Measurement:
    """Run the probe once with `config` and return its counters. Raises ValueError for a configuration the
    probe would refuse, `ProbeError` if the device is not a probe built for `hw` or is busy."""
    config.check(hw)

    def reg(name):
        return by_name(name).offset

    ident = device.csr_read(reg("ID"))
    if ident != PROBE_ID:
        what = " (the NPU: load the DDR probe's bitstream)" if ident == NPU_ID else ""
        raise ProbeError(f"no DDR probe answers: ID reads {ident:#010x}{what}, expected {PROBE_ID:#010x}")
    version, want = device.csr_read(reg("VERSION")), version_word(hw.to_dict())
    if version != want:
        raise ProbeError(f"the probe's VERSION is {version:#010x}; a probe built for {hw.name!r} has {want:#010x}")
    if device.csr_read(reg("STATUS")) & STATUS_BUSY:
        raise ProbeError("the probe is busy with another run")
    _write64(device, "BASE", config.base)
    _write64(device, "TOTAL_BYTES", config.total_bytes)
    device.csr_write(reg("CHUNK_BYTES"), config.chunk_bytes)
    device.csr_write(reg("PORTS"), config.ports)
    device.csr_write(reg("MAX_OUTSTANDING"), config.max_outstanding)
    device.csr_write(reg("CTRL"), CTRL_START)
    device.wait_interrupt()
    status = device.csr_read(reg("STATUS"))
    if status & STATUS_CONFIG_ERROR:
        raise ProbeError(f"the probe refused the configuration {config} (STATUS {status:#x})")
    if not status & STATUS_DONE:
        raise ProbeError(f"interrupt without STATUS.DONE (STATUS {status:#x})")
    result = Measurement(
        hw=hw, config=config, cycles=_read64(device, "CYCLES"),
        bytes_per_port=tuple(_read64(device, f"BYTES_P{p}") for p in range(hw.axi_ports)),
        bursts=_read64(device, "BURSTS"), error_beats=_read64(device, "ERROR_BEATS"),
        lat_sum=_read64(device, "LAT_SUM"), lat_min=device.csr_read(reg("LAT_MIN")),
        lat_max=device.csr_read(reg("LAT_MAX")))
    device.csr_write(reg("CTRL"), CTRL_IRQ_ACK)
    return result


def report(m: Measurement) -> str:
    """The measurement as printed by the command line; the last line is the one to feed back."""
    hw, cfg = m.hw, m.config
    ns = 1e9 / hw.clock_hz
    ports = cfg.ports_used(hw)
    port_peak = hw.axi_ports * hw.bytes_per_beat * hw.clock_hz
    lines = [
        f"DDR probe on {hw.name}: {cfg.total_bytes:,} bytes from {cfg.base:#x} in chunks of {cfg.chunk_bytes:,} "
        f"on {ports} of {hw.axi_ports} ports, up to {cfg.outstanding(hw)} bursts of {hw.axi_max_burst_beats} "
        f"beats in flight per port",
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

def find_uio(name: str, root: Path = UIO_ROOT) -> Path | None:
    """``/dev/uioN`` of the UIO device called `name` (``/sys/class/uio/uioN/name``), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    for d in sorted(root.iterdir()):
        try:
            if (d / "name").read_text().strip() == name:
                return Path("/dev") / d.name
        except OSError:
            continue
    return None


class UioDevice:
    """The probe's CSR window (UIO map 0) and interrupt through ``/dev/uioN`` (`uio_pdrv_genirq`)."""

    def __init__(self, path: str | os.PathLike, size: int = 4096):
        self._fd = os.open(path, os.O_RDWR | os.O_SYNC)
        self._csr = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)

    def csr_read(self, offset: int) -> int:
        return struct.unpack_from("<I", self._csr, offset)[0]

    def csr_write(self, offset: int, value: int) -> None:
        struct.pack_into("<I", self._csr, offset, value & 0xFFFF_FFFF)

    def wait_interrupt(self) -> None:
        # re-enable the (level) interrupt, then block until it fires; if DONE is already up it fires at once
        os.write(self._fd, struct.pack("<I", 1))
        os.read(self._fd, 4)

    def close(self) -> None:
        self._csr.close()
        os.close(self._fd)


def _int(text: str) -> int:
    return int(text, 0)


def main(argv=None, *, uio_root: Path = UIO_ROOT) -> int:
    p = argparse.ArgumentParser(prog="python -m firmware.ddrprobe", description=__doc__.splitlines()[0])
    p.add_argument("--hw", default="kv260", help="the hardware preset the probe was built for")
    p.add_argument("--memory-map", default="kv260", help="where --base defaults to (hdl.memory_map)")
    p.add_argument("--base", type=_int, help="DDR byte address to read from (default: the first NPU window)")
    p.add_argument("--total", type=_int, default=DEFAULT_TOTAL, help="bytes to read")
    p.add_argument("--chunk", type=_int, default=DEFAULT_CHUNK, help="bytes per chunk (a row tile)")
    p.add_argument("--ports", type=int, default=0, help="ports to use (0: all)")
    p.add_argument("--max-outstanding", type=int, default=0, help="bursts in flight per port (0: the maximum)")
    p.add_argument("--uio-name", default="npu", help="name of the probe's UIO device")
    args = p.parse_args(argv)
    try:
        hw = HardwareConfig.preset(args.hw)
        if hw.axi_ports > MAX_PORTS:
            raise ValueError(f"the probe has at most {MAX_PORTS} ports, {hw.name!r} has {hw.axi_ports}")
        base = memory_map(args.memory_map).windows[0].base if args.base is None else args.base
        config = ProbeConfig(base, args.total, args.chunk, args.ports, args.max_outstanding).check(hw)
    except ValueError as e:
        print(f"firmware.ddrprobe: {e}", file=sys.stderr)
        return 2
    path = find_uio(args.uio_name, uio_root)
    if path is None:
        print(f"firmware.ddrprobe: no UIO device named {args.uio_name!r} under {uio_root}: run this on the KV260 "
              f"with the DDR probe's bitstream and overlay loaded", file=sys.stderr)
        return 2
    try:
        device = UioDevice(path)
    except OSError as e:
        print(f"firmware.ddrprobe: cannot open {path}: {e.strerror}", file=sys.stderr)
        return 2
    try:
        print(report(measure(device, hw, config)))
    except ProbeError as e:
        print(f"firmware.ddrprobe: {e}", file=sys.stderr)
        return 2
    finally:
        device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
