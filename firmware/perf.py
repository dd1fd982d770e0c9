"""Performance model of one decode token on the NPU: where the cycles go, and tokens per second.

The model counts the work of the compiled token program with the ISS's ``count`` arithmetic (bytes per DDR
region, elements per instruction class; no weights needed, so it runs for E4B) and turns it into cycles per
unit with per-unit rates:

- **weight streaming** (WGEMV, GATHER): bytes / (ports x bytes-per-beat) / ``gemv_efficiency``, the port
  efficiency the GEMV benchmark measures in RTL (docs/gemv.md), capped by the DDR: bytes / (DDR peak x
  ``ddr_efficiency``) at the fabric clock;
- **vector work** (VEC, CVO, SCALAR): elements / ``vec_lanes`` plus ``issue_overhead`` cycles per
  instruction (pipeline fill and drain, the issue stage);
- **DMA** between L2 and DDR (constants, logits, spills): the larger of elements / ``vec_lanes`` and its
  bytes at the port rate;
- **attention** (ATTN): the larger of its MACs / ``attn_lanes`` (scores and the V sum) and its KV bytes at
  the port rate;
- **KV stores** (KVST): bytes at the port rate.

Dependent work serialises: a token is a chain of GEMVs whose inputs come from vector work, so the total
is the sum of all units (no overlap is assumed until the RTL shows how much the controller achieves).
Every rate is a parameter so RTL cycle counts can calibrate it; the defaults are the design targets.

``python -m firmware.perf --model e4b --hw kv260 --positions 128 1024 4096`` prints the breakdown.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, replace

from hdl.config import HardwareConfig
from sim.config import ModelConfig

__all__ = ["Rates", "TokenEstimate", "estimate", "main"]

DDR_PEAK_BYTES_PER_S = 19.2e9          # KV260: DDR4-2400, 64 bit (shared/reference/perf-anchors.md)


@dataclass(frozen=True)
class Rates:
    """Per-unit rates (the things RTL measurements calibrate)."""
    gemv_efficiency: float = 0.95      # fraction of ports x beat per cycle the GEMV engine sustains
    ddr_efficiency: float = 0.90       # fraction of the DDR peak the memory controller delivers
    vec_lanes: int = 4                 # binary32 elements per cycle of the vector unit (one L2 word)
    attn_lanes: int = 32               # MACs per cycle of the attention unit
    issue_overhead: int = 24           # cycles per instruction beyond its elements (latency, issue)


@dataclass
class TokenEstimate:
    position: int
    cycles: dict = field(default_factory=dict)      # unit -> cycles
    bytes_total: int = 0
    clock_hz: float = 0.0
    roofline_tok_s: float = 0.0

    @property
    def total_cycles(self) -> float:
        return sum(self.cycles.values())

    @property
    def tok_s(self) -> float:
        return self.clock_hz / self.total_cycles

    @property
    def roofline_fraction(self) -> float:
        return self.tok_s / self.roofline_tok_s


def _unit_cycles(counters, hw: HardwareConfig, rates: Rates) -> dict[str, float]:
    beat_rate = hw.axi_ports * hw.bytes_per_beat                       # bytes per cycle, all ports
    ddr_rate = DDR_PEAK_BYTES_PER_S * rates.ddr_efficiency / hw.clock_hz
    stream_rate = min(beat_rate * rates.gemv_efficiency, ddr_rate)
    ins, el = counters.instructions, counters.elements
    n_ins = lambda prefix: sum(v for k, v in ins.items() if k.startswith(prefix))   # noqa: E731
    n_el = lambda prefix: sum(v for k, v in el.items() if k.startswith(prefix))     # noqa: E731
    weights = counters.bytes_read["WEIGHTS"] + counters.bytes_read["DESC"]
    kv_read, kv_write = counters.bytes_read["KV"], counters.bytes_written["KV"]
    other = counters.total_read() + sum(counters.bytes_written.values()) - weights - kv_read - kv_write
    cycles = {
        "weights": weights / stream_rate + rates.issue_overhead * (n_ins("WGEMV") + n_ins("GATHER")),
        "vector": (n_el("VEC") + n_el("CVO")) / rates.vec_lanes
        + rates.issue_overhead * (n_ins("VEC") + n_ins("CVO") + n_ins("SCALAR") + n_ins("CTRL") + n_ins("MEMSET")),
        "dma": max(n_el("DMA") / rates.vec_lanes, other / min(beat_rate, ddr_rate))
        + rates.issue_overhead * n_ins("DMA"),
        "attention": max(2 * n_el("ATTN") / rates.attn_lanes, kv_read / stream_rate)
        + rates.issue_overhead * n_ins("ATTN"),
        "kv_store": kv_write / min(beat_rate, ddr_rate) + rates.issue_overhead * n_ins("KVST"),
    }
    return cycles


def estimate(cfg: ModelConfig, hw: HardwareConfig, positions: list[int], rates: Rates = Rates()) \
        -> list[TokenEstimate]:
    from .traffic import token_traffic

    out = []
    for pos, c in token_traffic(cfg, hw, positions).items():
        total_bytes = c.total_read() + sum(c.bytes_written.values())
        est = TokenEstimate(position=pos, cycles=_unit_cycles(c, hw, rates), bytes_total=total_bytes,
                            clock_hz=hw.clock_hz, roofline_tok_s=DDR_PEAK_BYTES_PER_S / total_bytes)
        out.append(est)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m firmware.perf", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="e4b")
    p.add_argument("--hw", default="kv260")
    p.add_argument("--positions", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--vec-lanes", type=int, default=Rates.vec_lanes)
    p.add_argument("--attn-lanes", type=int, default=Rates.attn_lanes)
    p.add_argument("--gemv-efficiency", type=float, default=Rates.gemv_efficiency)
    p.add_argument("--ddr-efficiency", type=float, default=Rates.ddr_efficiency)
    p.add_argument("--issue-overhead", type=int, default=Rates.issue_overhead)
    args = p.parse_args(argv)
    rates = replace(Rates(), vec_lanes=args.vec_lanes, attn_lanes=args.attn_lanes,
                    gemv_efficiency=args.gemv_efficiency, ddr_efficiency=args.ddr_efficiency,
                    issue_overhead=args.issue_overhead)
    cfg, hw = ModelConfig.preset(args.model), HardwareConfig.preset(args.hw)
    print(f"{args.model} on {args.hw} at {hw.clock_hz / 1e6:.0f} MHz; {rates}")
    print(f"{'position':>8} {'weights':>10} {'vector':>10} {'dma':>8} {'attention':>10} {'kv_store':>9} {'total Mcyc':>10} "
          f"{'tok/s':>6} {'roofline':>8} {'fraction':>8}")
    for e in estimate(cfg, hw, args.positions, rates):
        c = e.cycles
        print(f"{e.position:>8} {c['weights'] / 1e6:>10.2f} {c['vector'] / 1e6:>10.2f} {c['dma'] / 1e6:>8.2f} "
              f"{c['attention'] / 1e6:>10.2f} "
              f"{c['kv_store'] / 1e6:>9.2f} {e.total_cycles / 1e6:>10.2f} {e.tok_s:>6.2f} {e.roofline_tok_s:>8.2f} "
              f"{100 * e.roofline_fraction:>7.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
