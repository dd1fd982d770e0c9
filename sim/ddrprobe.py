"""Model of the DDR bandwidth probe (`hdl.ddrprobe.DdrProbe`): which bursts it issues on which port, and what
its deterministic counters read after a run.

The probe reads ``total_bytes`` bytes from ``base`` in chunks of ``chunk_bytes`` (the GEMV engine's row
tiles): chunk ``j`` covers ``[base + j * chunk_bytes, min(base + (j + 1) * chunk_bytes, base + total_bytes))``
and goes to port ``j mod ports``; each port reads its chunks in order, one `hdl.axi.AxiReadDma` command per
chunk. The DMA turns a command ``(addr, nbytes)`` into INCR bursts of full beats from the beat-aligned start:
``ceil((addr mod B + nbytes) / B)`` beats, cut at ``axi_max_burst_beats`` and at every 4 KB boundary (B =
bytes per beat).

The byte counters count R beats times B, so a chunk that does not start or end on a beat boundary costs
the whole beats it touches. Latencies and the cycle count depend on the memory, so the model does not
predict them; the bench measures them on the bus.

Imports only the hardware config, so it runs without Amaranth.
"""

from __future__ import annotations

from dataclasses import dataclass

from hdl.config import HardwareConfig

__all__ = ["ProbeConfig", "chunks", "bursts", "Counts", "counts"]

AXI_4K = 4096


@dataclass(frozen=True)
class ProbeConfig:
    """One run of the probe: the CSRs BASE, TOTAL_BYTES, CHUNK_BYTES, PORTS and MAX_OUTSTANDING.

    `ports` 0 means all the ports built; `max_outstanding` 0 means the hardware's maximum (the bursts do not
    depend on it). `check(hw)` raises ValueError on what the hardware refuses (STATUS.CONFIG_ERROR) and on
    values that do not fit their registers."""

    base: int
    total_bytes: int
    chunk_bytes: int = 8192
    ports: int = 0
    max_outstanding: int = 0

    def check(self, hw: HardwareConfig) -> "ProbeConfig":
        for name, bits in (("base", 64), ("total_bytes", 64), ("chunk_bytes", 32), ("ports", 32),
                           ("max_outstanding", 32)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << bits:
                raise ValueError(f"probe {name} must be an integer in 0..2**{bits} - 1, not {v!r}")
        if self.ports > hw.axi_ports:
            raise ValueError(f"probe ports must be 1..{hw.axi_ports} (0: all), not {self.ports}")
        if self.chunk_bytes == 0 and self.total_bytes:
            raise ValueError("probe chunk_bytes must be at least 1")
        if self.base >= 1 << hw.axi_addr_bits or self.base + self.total_bytes > 1 << hw.axi_addr_bits:
            raise ValueError(f"probe range [{self.base:#x}, {self.base + self.total_bytes:#x}) exceeds the "
                             f"{hw.axi_addr_bits}-bit AXI address space")
        return self

    def ports_used(self, hw: HardwareConfig) -> int:
        return self.ports or hw.axi_ports

    def outstanding(self, hw: HardwareConfig) -> int:
        return self.max_outstanding if 0 < self.max_outstanding <= hw.axi_max_outstanding \
            else hw.axi_max_outstanding


def chunks(hw: HardwareConfig, cfg: ProbeConfig) -> list[list[tuple[int, int]]]:
    """The DMA commands ``(addr, nbytes)`` of every port, in the order the port issues them (one list per
    port built; the unused ports' lists are empty)."""
    cfg.check(hw)
    n = cfg.ports_used(hw)
    out = [[] for _ in range(hw.axi_ports)]
    j, off = 0, 0
    while off < cfg.total_bytes:
        out[j % n].append((cfg.base + off, min(cfg.chunk_bytes, cfg.total_bytes - off)))
        j, off = j + 1, off + cfg.chunk_bytes
    return out


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


def bursts(hw: HardwareConfig, cfg: ProbeConfig) -> list[list[tuple[int, int]]]:
    """The read bursts ``(address, beats)`` of every port, in order."""
    return [[b for addr, nbytes in port for b in _dma_bursts(hw, addr, nbytes)] for port in chunks(hw, cfg)]


@dataclass(frozen=True)
class Counts:
    """The counters a run determines: bursts (all ports), bytes per port built, error beats."""

    bursts: int
    bytes_per_port: tuple[int, ...]
    error_beats: int

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_port)


def counts(hw: HardwareConfig, cfg: ProbeConfig, error_beat=lambda addr: False) -> Counts:
    """The counters after a run of `cfg`; `error_beat(address)` says which beats the memory answers with an
    error (default: none)."""
    per_port = bursts(hw, cfg)
    B = hw.bytes_per_beat
    errors = sum(error_beat(a + k * B) for port in per_port for a, beats in port for k in range(beats))
    return Counts(sum(len(p) for p in per_port), tuple(B * sum(b for _, b in p) for p in per_port), errors)
