"""Model of the DDR bandwidth probe (`hdl.ddrprobe.DdrProbe`): which bursts it issues on which port, and what
its deterministic counters read after a run.

The probe reads a weight matrix with the dense GEMV engine's access pattern (`hdl.gemv.GemvPort`, laid out
as `firmware.pack` lays it out: INT4 rows of ``row_bytes`` bytes from ``wbase``, row-major binary16 scales of
``scale_bytes`` bytes per row from ``sbase``). With ``T = tile_rows``, ``n = ports`` and
``C = hdl.ddrprobe_map.gemv_chunk_bytes(hw)`` (the engine's chunk: one full burst, or more when an
activation block is longer):

- tile ``j`` (rows ``jT .. min(jT + T, rows) - 1``) belongs to port ``j mod n``, and a port takes its
  tiles in order;
- per tile, a port issues one DMA command for the tile's scales, ``(sbase + jT * scale_bytes, trows *
  scale_bytes)`` (none when ``scale_bytes`` is 0), then the rows in chunks of C bytes, round robin over the
  tile's rows: chunk 0 of rows 0 .. trows - 1, chunk 1 of those rows, ..., the command of row t, chunk c
  being ``(wbase + (jT + t) * row_bytes + cC, min(C, row_bytes - cC))``;
- the whole sequence runs ``passes`` times; a pass starts once every port has finished the previous one
  (the engine takes its next command when it is idle).

Every port's `hdl.axi.AxiReadDma` turns a command ``(addr, nbytes)`` into INCR bursts of full beats from the
beat-aligned start: ``ceil((addr mod B + nbytes) / B)`` beats, cut at ``axi_max_burst_beats`` and at every
4 KB boundary (B = bytes per beat). The byte counters count R beats times B, so a command that does not
start or end on a beat boundary costs the whole beats it touches. Latencies and the cycle count depend on
the memory, so the model does not predict them; the bench measures them on the bus.

Imports the hardware config and the probe's register map (its limits, the engine's tile and chunk sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

from hdl.config import HardwareConfig
from hdl.ddrprobe_map import GEMV_TILE_ROWS, MAX_TILE_ROWS, ROW_BYTES_BITS, SCALE_BYTES_BITS, gemv_chunk_bytes

__all__ = ["ProbeConfig", "commands", "bursts", "Counts", "counts", "SCALE_ALIGN"]

AXI_4K = 4096
SCALE_ALIGN = 64                # `firmware.pack` places a matrix's scales after its INT4 bytes, 64-byte aligned


@dataclass(frozen=True)
class ProbeConfig:
    """One run of the probe: the CSRs WBASE, SBASE, ROWS, ROW_BYTES, SCALE_BYTES, TILE_ROWS, PASSES, PORTS and
    MAX_OUTSTANDING.

    `ports` 0 means all the ports built; `max_outstanding` 0 means the hardware's maximum (the bursts do not
    depend on it); `passes` 0 means 1. `check(hw)` raises ValueError on what the hardware refuses
    (STATUS.CONFIG_ERROR) and on values that do not fit their registers. `gemv` builds the configuration of a
    matrix shape as the engine and `firmware.pack` see it."""

    wbase: int
    sbase: int
    rows: int
    row_bytes: int
    scale_bytes: int = 0
    tile_rows: int = GEMV_TILE_ROWS
    passes: int = 1
    ports: int = 0
    max_outstanding: int = 0

    @classmethod
    def gemv(cls, hw: HardwareConfig, rows: int, cols: int, *, base: int, group: int | None = None,
             sbase: int | None = None, **kw) -> ProbeConfig:
        """The probe reading the INT4 matrix ``[rows, cols]`` at `base` as a GEMV command does: rows of
        ``ceil(cols / 2)`` bytes, ``ceil(cols / group)`` binary16 scales per row (`group`: default the
        hardware's ``weight_group``, or one group per row) at `sbase` (default: right after the INT4 bytes,
        `SCALE_ALIGN`-aligned, as `firmware.pack` places them). Other fields by keyword."""
        for name, v in (("rows", rows), ("cols", cols)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"matrix {name} must be a positive integer, not {v!r}")
        group = group or hw.weight_group or 1 << (cols - 1).bit_length()
        if isinstance(group, bool) or not isinstance(group, int) or group & (group - 1):
            raise ValueError(f"group must be a power of two, not {group!r}")
        row_bytes = (cols + 1) // 2
        if sbase is None:
            sbase = -(-(base + rows * row_bytes) // SCALE_ALIGN) * SCALE_ALIGN
        return cls(base, sbase, rows, row_bytes, 2 * -(-cols // group), **kw)

    def check(self, hw: HardwareConfig) -> ProbeConfig:
        for name, bits in (("wbase", 64), ("sbase", 64), ("rows", 32), ("row_bytes", ROW_BYTES_BITS),
                           ("scale_bytes", SCALE_BYTES_BITS), ("tile_rows", 32), ("passes", 32), ("ports", 32),
                           ("max_outstanding", 32)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << bits:
                raise ValueError(f"probe {name} must be an integer in 0..2**{bits} - 1, not {v!r}")
        if self.ports > hw.axi_ports:
            raise ValueError(f"probe ports must be 1..{hw.axi_ports} (0: all), not {self.ports}")
        if not 1 <= self.tile_rows <= MAX_TILE_ROWS or self.tile_rows & (self.tile_rows - 1):
            raise ValueError(f"probe tile_rows must be a power of two from 1 to {MAX_TILE_ROWS}, not "
                             f"{self.tile_rows}")
        if self.rows and not self.row_bytes:
            raise ValueError("probe row_bytes must be at least 1")
        for what, base, size in (("rows", self.wbase, self.row_bytes), ("scales", self.sbase, self.scale_bytes)):
            end = base + self.rows * size
            if size and self.rows and end > 1 << hw.axi_addr_bits:
                raise ValueError(f"probe {what} [{base:#x}, {end:#x}) exceed the {hw.axi_addr_bits}-bit AXI "
                                 f"address space")
        return self

    def ports_used(self, hw: HardwareConfig) -> int:
        return self.ports or hw.axi_ports

    def outstanding(self, hw: HardwareConfig) -> int:
        return self.max_outstanding if 0 < self.max_outstanding <= hw.axi_max_outstanding \
            else hw.axi_max_outstanding

    @property
    def pass_count(self) -> int:
        return self.passes or 1

    @property
    def matrix_bytes(self) -> int:
        """Bytes of one pass: the rows and their scales."""
        return self.rows * (self.row_bytes + self.scale_bytes)


def _pass_commands(hw: HardwareConfig, cfg: ProbeConfig) -> list[list[tuple[int, int]]]:
    cfg.check(hw)
    n, T, C = cfg.ports_used(hw), cfg.tile_rows, gemv_chunk_bytes(hw)
    out = [[] for _ in range(hw.axi_ports)]
    for j, first in enumerate(range(0, cfg.rows, T)):
        cmds = out[j % n]
        trows = min(T, cfg.rows - first)
        if cfg.scale_bytes:
            cmds.append((cfg.sbase + first * cfg.scale_bytes, trows * cfg.scale_bytes))
        tile = cfg.wbase + first * cfg.row_bytes
        for off in range(0, cfg.row_bytes, C):
            for t in range(trows):
                cmds.append((tile + t * cfg.row_bytes + off, min(C, cfg.row_bytes - off)))
    return out


def commands(hw: HardwareConfig, cfg: ProbeConfig) -> list[list[tuple[int, int]]]:
    """The DMA commands ``(addr, nbytes)`` of every port, in the order the port issues them, all passes (one
    list per port built; the unused ports' lists are empty)."""
    return [port * cfg.pass_count for port in _pass_commands(hw, cfg)]


def _dma_bursts(hw: HardwareConfig, addr: int, nbytes: int) -> list[tuple[int, int]]:
    B = hw.bytes_per_beat
    cur = addr - addr % B
    rem = (addr % B + nbytes + B - 1) // B
    out = []
    while rem:
        beats = min(rem, hw.axi_max_burst_beats, (AXI_4K - cur % AXI_4K) // B)
        out.append((cur, beats))
        cur, rem = cur + beats * B, rem - beats
    return out


def _pass_bursts(hw: HardwareConfig, cfg: ProbeConfig) -> list[list[tuple[int, int]]]:
    return [[b for addr, nbytes in port for b in _dma_bursts(hw, addr, nbytes)] for port in _pass_commands(hw, cfg)]


def bursts(hw: HardwareConfig, cfg: ProbeConfig) -> list[list[tuple[int, int]]]:
    """The read bursts ``(address, beats)`` of every port, in order, all passes."""
    return [port * cfg.pass_count for port in _pass_bursts(hw, cfg)]


@dataclass(frozen=True)
class Counts:
    """The counters a run determines: bursts (all ports), bytes per port built, error beats."""

    bursts: int
    bytes_per_port: tuple[int, ...]
    error_beats: int

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_port)


def counts(hw: HardwareConfig, cfg: ProbeConfig, error_beat=None) -> Counts:
    """The counters after a run of `cfg`; `error_beat(address)` says which beats the memory answers with an
    error (None: none)."""
    per_port, k = _pass_bursts(hw, cfg), cfg.pass_count
    B = hw.bytes_per_beat
    errors = 0 if error_beat is None else \
        sum(error_beat(a + i * B) for port in per_port for a, beats in port for i in range(beats))
    return Counts(k * sum(len(p) for p in per_port), tuple(k * B * sum(b for _, b in p) for p in per_port),
                  k * errors)
