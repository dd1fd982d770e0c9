"""Performance model of one decode token on the NPU RTL: where the cycles go, and tokens per second.

The model runs the compiled token program through the ISS's ``count`` arithmetic (no weights needed, so it
runs for E4B), which counts what the RTL controller does (`hdl/controller.py`, docs/architecture.md): the
instructions, the bytes each DDR region moves, and the controller's **passes** by kind (`sim.iss.Counters`
``passes`` / ``pass_elements``) and scalar-ALU operations. Cycles follow from per-kind costs (`Rates`):

- ``weights``: WGEMV weight + scale bytes at the GEMV engine's streaming rate (ports x beat x
  ``gemv_efficiency``, capped by the DDR at ``ddr_efficiency``) plus ``gemv_fixed`` per WGEMV (quantiser
  hand-off, first-beat latency, the engine's tail);
- passes: each pass costs its fixed overhead (``sfu_pass``, ``reduce_pass``, ``copy_pass``,
  ``ddr_read_pass``, ``ddr_write_pass``: pipeline fill and drain, DDR latency) plus its elements at
  ``elements_per_cycle``;
- ``alu_op`` per scalar-ALU operation and ``issue`` per instruction (fetch, decode, dispatch).

The controller issues in order and runs its passes one at a time; only the GEMV engine's weight stream of an
async WGEMV runs beside them (docs/architecture.md, "Overlap"). `schedule` replays the program instruction by
instruction (the ISS's ``trace``) on that machine: an async WGEMV occupies the engine for its stream, a later
instruction whose L2 ranges meet the rows still being written waits for them (the RTL waits per pass, so
this is slightly pessimistic), the next WGEMV, FENCE and HALT wait for the engine. `fit_rates` calibrates
the costs from RTL measurements (``(counters, cycles)`` pairs: micro-programs that isolate each kind and
whole tokens, from the full-chip bench, `tb/npu`); the defaults are the values fitted from the tiny NPU
(docs/architecture.md, "Performance"). ``python -m firmware.perf --model e4b --hw kv260 --positions 128 1024
4096`` prints the breakdown per unit and per instruction class.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import Counter
from dataclasses import dataclass, field, fields, replace

import numpy as np

from hdl.config import HardwareConfig
from sim.config import ModelConfig

__all__ = ["Rates", "TokenEstimate", "Schedule", "estimate", "cycles_of", "schedule", "features", "fit_rates",
           "main", "PASS_KINDS"]

DDR_PEAK_BYTES_PER_S = 19.2e9          # KV260: DDR4-2400, 64 bit (shared/reference/perf-anchors.md)
PASS_KINDS = ("sfu", "reduce", "copy", "ddr_read", "ddr_write")


@dataclass(frozen=True)
class Rates:
    """Per-kind costs (the things RTL measurements calibrate; `fit_rates`)."""
    gemv_efficiency: float = 0.95      # fraction of ports x beat per cycle the GEMV engine sustains (benchmarks.gemv)
    ddr_efficiency: float = 0.90       # fraction of the DDR peak the memory controller delivers
    elements_per_cycle: float = 1.0    # elements per cycle of a pass (the SFU and the L2 movers take one)
    # fitted by `python -m benchmarks.npu` on the tiny NPU (docs/architecture.md, "Performance")
    issue: float = 3.7                 # cycles per instruction: fetch, decode, dispatch, retire
    sfu_pass: float = 198.4            # fixed cycles of a pass through the SFU (its latency, start, end)
    reduce_pass: float = 233.7         # ... of a reduction (plus the lane tree)
    copy_pass: float = 6.7             # ... of an L2 copy (to L2 or a scalar)
    ddr_read_pass: float = 20.0        # ... of a DDR read (latency of the memory model)
    ddr_write_pass: float = 14.7       # ... of a DDR write (until the last response)
    alu_op: float = 8.7                # a scalar-ALU add or multiply
    gemv_fixed: float = 88.4           # per WGEMV beyond its bytes


@dataclass
class TokenEstimate:
    position: int
    cycles: dict = field(default_factory=dict)      # unit -> cycles of work (serial)
    by_opcode: dict = field(default_factory=dict)   # opcode -> cycles of work
    bytes_total: int = 0
    clock_hz: float = 0.0
    roofline_tok_s: float = 0.0
    hidden: float = 0.0                             # weight-stream cycles under other work (async WGEMV)

    @property
    def total_cycles(self) -> float:
        return sum(self.cycles.values()) - self.hidden

    @property
    def tok_s(self) -> float:
        return self.clock_hz / self.total_cycles

    @property
    def roofline_fraction(self) -> float:
        return self.tok_s / self.roofline_tok_s


def _stream_rate(hw: HardwareConfig, rates: Rates) -> float:
    beat_rate = hw.axi_ports * hw.bytes_per_beat
    ddr_rate = DDR_PEAK_BYTES_PER_S * rates.ddr_efficiency / hw.clock_hz
    return min(beat_rate * rates.gemv_efficiency, ddr_rate)


def cycles_of(counters, hw: HardwareConfig, rates: Rates) -> tuple[dict, dict]:
    """(cycles per unit, cycles per opcode) of one run whose `counters` the ISS recorded."""
    ins = counters.instructions
    n_wgemv = sum(v for k, v in ins.items() if k == "WGEMV")
    per_kind = {k: getattr(rates, f"{k}_pass") for k in PASS_KINDS}
    by_op: Counter = Counter()
    units: Counter = Counter()
    for (op, kind), n in counters.passes.items():
        c = n * per_kind[kind] + counters.pass_elements[(op, kind)] / rates.elements_per_cycle
        units[kind] += c
        by_op[op] += c
    weights = counters.gemv_bytes / _stream_rate(hw, rates) + n_wgemv * rates.gemv_fixed
    units["weights"] += weights
    by_op["WGEMV"] += weights
    # the DDR movers share port 0 with the fetch: their bytes take at least the DDR time
    other = counters.total_read() + sum(counters.bytes_written.values()) - counters.gemv_bytes
    ddr_rate = min(hw.bytes_per_beat, DDR_PEAK_BYTES_PER_S * rates.ddr_efficiency / hw.clock_hz)
    moved = units["ddr_read"] + units["ddr_write"]
    if moved < other / ddr_rate:
        units["ddr_read"] += other / ddr_rate - moved
    units["scalar_alu"] += counters.alu_ops * rates.alu_op
    n_ins = sum(ins.values())
    units["issue"] += n_ins * rates.issue
    for name, v in ins.items():
        by_op[name.split(".")[0]] += v * rates.issue
    by_op["SCALAR"] += counters.alu_ops * rates.alu_op       # RMSNORM's two ALU steps are counted here too
    return dict(units), dict(by_op)


def _minus(a, b):
    """The counts of `a` beyond `b` (Counters of the same run, later and earlier)."""
    return type(a)(**{f.name: getattr(a, f.name) - getattr(b, f.name) for f in fields(a)})


def _copy(c):
    return type(c)(**{f.name: copy.copy(getattr(c, f.name)) for f in fields(c)})


@dataclass
class Schedule:
    """One program run replayed on the controller + GEMV engine (`schedule`)."""
    cycles: float = 0.0           # START to DONE
    serial: float = 0.0           # the same work one instruction at a time
    units: Counter = field(default_factory=Counter)
    by_opcode: Counter = field(default_factory=Counter)

    @property
    def hidden(self) -> float:
        return self.serial - self.cycles


def schedule(machine, words, hw: HardwareConfig, rates: Rates, *, token: int, pos: int) -> Schedule:
    """Run `words` on the ISS `machine` (its counters keep counting) and replay the run on the NPU's
    timing: per instruction, the controller's time (issue, passes, ALU) and the engine's weight stream."""
    from hdl.isa import CtrlFunc, Opcode
    out = Schedule()
    state = {"prev": _copy(machine.counters), "t": 0.0, "g_end": 0.0, "g": (0, 0)}

    def trace(pc, insn, m):
        cur = m.counters
        units, by_op = cycles_of(_minus(cur, state["prev"]), hw, rates)
        state["prev"] = _copy(cur)
        out.units.update(units)
        out.by_opcode.update(by_op)
        stream = units.get("weights", 0.0)
        front = sum(units.values()) - stream
        out.serial += front + stream
        t, g_end = state["t"], state["g_end"]
        if insn.op is Opcode.WGEMV:
            t = max(t, g_end) + front
            if insn.async_ and not insn.findemax:
                lo = insn.dst * 4
                state["g"] = (lo, lo + m.image.descriptors[insn.desc].rows)
                g_end = t + stream
            else:
                t += stream
        elif insn.op is Opcode.CTRL and insn.func in (CtrlFunc.FENCE, CtrlFunc.HALT):
            t = max(t, g_end) + front
        else:
            g_lo, g_hi = state["g"]
            if t < g_end and any(lo < g_hi and g_lo < hi for lo, hi in m.touched):
                t = g_end
            t += front
        state["t"], state["g_end"] = t, g_end

    machine.run(words, token=token, pos=pos, trace=trace)
    out.cycles = max(state["t"], state["g_end"])
    return out


def features(counters, hw: HardwareConfig, rates: Rates) -> dict:
    """The coefficients of each fitted cost in a run's cycle count (`fit_rates`): cycles = sum(f * cost)."""
    f = {"issue": sum(counters.instructions.values()), "alu_op": counters.alu_ops,
         "gemv_fixed": counters.instructions.get("WGEMV", 0)}
    for k in PASS_KINDS:
        f[f"{k}_pass"] = sum(n for (op, kind), n in counters.passes.items() if kind == k)
    elements = sum(counters.pass_elements.values())
    streaming = counters.gemv_bytes / _stream_rate(hw, rates)
    return f | {"_elements": elements, "_streaming": streaming}


def fit_rates(samples, hw: HardwareConfig, base: Rates = Rates(),
              fit=("issue", "sfu_pass", "reduce_pass", "copy_pass", "ddr_read_pass", "ddr_write_pass", "alu_op",
                   "gemv_fixed")) -> Rates:
    """Least-squares costs from RTL runs: `samples` = [(counters, measured_cycles)]; elements move at
    `base.elements_per_cycle` and weights at `base`'s streaming rate (both measured separately). Costs that no
    sample exercises keep their `base` value."""
    rows, rhs = [], []
    for counters, cycles in samples:
        f = features(counters, hw, base)
        rows.append([f[k] for k in fit])
        rhs.append(cycles - f["_elements"] / base.elements_per_cycle - f["_streaming"])
    a, b = np.array(rows, float), np.array(rhs, float)
    used = np.any(a != 0, axis=0)
    sol = np.linalg.lstsq(a[:, used], b, rcond=None)[0]
    values = dict(zip([k for k, u in zip(fit, used) if u], sol))
    return replace(base, **{k: float(v) for k, v in values.items()})


def estimate(cfg: ModelConfig, hw: HardwareConfig, positions: list[int], rates: Rates = Rates()) \
        -> list[TokenEstimate]:
    from sim.iss import COUNT, Machine
    from .compiler import compile_token
    from .pack import pack

    image = pack(cfg, None, hw, max_positions=max(positions) + 1, fill=False)
    program = compile_token(cfg, image, hw)
    out = []
    for pos in positions:
        m = Machine(image, hw, COUNT)
        s = schedule(m, program.words, hw, rates, token=2, pos=pos)
        c = m.counters
        total_bytes = c.total_read() + sum(c.bytes_written.values())
        out.append(TokenEstimate(position=pos, cycles=dict(s.units), by_opcode=dict(s.by_opcode),
                                 bytes_total=total_bytes, clock_hz=hw.clock_hz,
                                 roofline_tok_s=DDR_PEAK_BYTES_PER_S / total_bytes, hidden=s.hidden))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m firmware.perf", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="e4b")
    p.add_argument("--hw", default="kv260")
    p.add_argument("--positions", type=int, nargs="+", default=[128, 1024, 4096])
    for f in fields(Rates):
        p.add_argument("--" + f.name.replace("_", "-"), type=float, default=f.default)
    args = p.parse_args(argv)
    rates = Rates(**{f.name: getattr(args, f.name) for f in fields(Rates)})
    cfg, hw = ModelConfig.preset(args.model), HardwareConfig.preset(args.hw)
    print(f"{args.model} on {args.hw} at {hw.clock_hz / 1e6:.0f} MHz; {rates}")
    units = ("weights",) + PASS_KINDS + ("scalar_alu", "issue")
    print(f"{'position':>8} " + " ".join(f"{u:>10}" for u in units) + f" {'hidden':>10} {'total Mcyc':>10} {'tok/s':>6} "
          f"{'roofline':>8} {'fraction':>8}")
    for e in estimate(cfg, hw, args.positions, rates):
        print(f"{e.position:>8} " + " ".join(f"{e.cycles.get(u, 0) / 1e6:>10.2f}" for u in units) +
              f" {-e.hidden / 1e6:>10.2f} {e.total_cycles / 1e6:>10.2f} {e.tok_s:>6.2f} {e.roofline_tok_s:>8.2f}"
              f" {100 * e.roofline_fraction:>7.1f}%")
        top = sorted(e.by_opcode.items(), key=lambda kv: -kv[1])
        print(" " * 9 + "by instruction: " + ", ".join(f"{k} {100 * v / e.total_cycles:.1f}%" for k, v in top[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
