"""Performance model of one decode token on the NPU RTL: where the cycles go, and tokens per second.

The model runs the compiled token program through the ISS's ``count`` arithmetic (no weights needed, so it
runs for E4B), which counts what the RTL controller does (`hdl.controller`, its plan `sim.plan`, docs/architecture.md): the
instructions, the bytes each DDR region moves, and the steps of the controller's plan of each instruction
(`sim.plan`): its **passes** by kind (`sim.iss.Counters` ``passes`` / ``pass_elements``) and scalar-ALU
operations. Cycles follow from per-kind costs (`Rates`):

- ``weights``: WGEMV weight + scale bytes at the GEMV engine's streaming rate (ports x beat x
  ``gemv_efficiency``, capped by the DDR at ``ddr_efficiency``) plus ``gemv_fixed`` per WGEMV (quantiser
  hand-off, first-beat latency, the engine's tail);
- passes: each pass costs its fixed overhead (``sfu_pass``, ``vec_pass``, ``reduce_pass``, ``copy_pass``,
  ``quant_pass``, ``ddr_read_pass``, ``ddr_write_pass``: pipeline fill and drain, DDR latency) plus its
  elements at ``elements_per_cycle`` (the quantiser and short-path passes at four times that, `PASS_LANES`; a DDR
  copy, DMA into L2, at the DDR reader's wide beats, `pass_lanes`, with ``ddr_read_pass`` as its fixed cost);
- ``alu_op`` per scalar-ALU operation and ``issue`` per instruction (fetch, decode, dispatch);
- WGEMM (`wgemm_cost`, unit ``gemm``): per token tile of R = ``systolic_rows`` tokens (where the GEMV engine runs
  WGEMM, ``gemv_vectors`` > 1: V tokens, its quantiser passes then one GEMV of V vectors), a quantiser pass per
  token (``cols`` elements + ``gemm_quant``), then the GEMM unit: ``gemm_tile`` + the first weight chunk's
  fetch, per row tile of 2C = ``2 * systolic_cols`` rows the slowest of its padded-K k-steps, its chunk
  fetches and the previous row tile's output (one element per cycle + ``gemm_row`` per token row), then the
  last output. The ISS counts a WGEMM's instruction and bytes, not its shape, so the shapes (`Wgemm`) are
  passed beside the counters (`schedule` takes them from the descriptors).

The controller issues in order and runs its passes one at a time; only the GEMV engine's weight stream of an
async WGEMV runs beside them (docs/architecture.md, "Overlap"). `schedule` replays the program instruction by
instruction (the ISS's ``trace``) on that machine: an async WGEMV occupies the engine for its stream, a later
instruction whose L2 ranges meet the rows still being written waits for them (the RTL waits per pass, so
this is slightly pessimistic), the next WGEMV, FENCE and HALT wait for the engine. `fit_rates` calibrates
the costs from RTL measurements (``(counters, cycles)`` pairs: micro-programs that isolate each kind and
whole tokens, from the full-chip bench, `tb/npu`); the defaults are the values fitted from the tiny NPU
(docs/architecture.md, "Performance"; the WGEMM costs from the WGEMMs of docs/systolic.md's table). ``python -m
firmware.perf --model e4b --hw kv260 --positions 128 1024 4096 --prefill 32 128 512`` prints the breakdown per
unit and per instruction class, then `prefill`: a prompt's time in the compiled prefill programs
(`firmware.compiler.compile_tokens`, priced like the decode program), beside an estimate with every projection a
WGEMM over full token tiles of the systolic array.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

import numpy as np

from hdl.config import V_PLANE_LOG2_GROUP, HardwareConfig
from hdl.l2 import LANES
from sim.config import ModelConfig
from sim.numerics import segment_size
from sim.plan import ATTN_RECIP, DESC_LOAD, PASS_KINDS, Gemm, wgemm_steps

from .cli import NON_NEGATIVE, POSITIVE, arg_type

__all__ = ["Rates", "TokenEstimate", "Schedule", "estimate", "cycles_of", "schedule", "features", "fit_rates",
           "main", "PASS_KINDS", "PASS_LANES", "PASS_FIXED", "pass_lanes", "FITTED", "Wgemm", "GemmGeometry", "wgemm_cost", "wgemm_bounds",
           "PrefillEstimate", "prefill", "to_json", "BatchEstimate", "batched", "SpecEstimate", "speculative",
           "expected_tokens"]

DDR_PEAK_BYTES_PER_S = 19.2e9          # KV260: DDR4-2400, 64 bit (DS987; docs/requirements.md)
# Elements per cycle of a pass kind beyond `Rates.elements_per_cycle`: the quantiser passes and the SFU's short
# path (element-wise and reductions, from L2) take L2 words (four elements) per cycle (`hdl.l2.ElemReader` beats
# into `hdl.quant.ActQuantizer` or the four lanes of `hdl.sfu.Sfu`, `hdl.l2.ElemWriter` beats back into L2).
# A scattering DDR write takes an element every other cycle (an AW each, `hdl.ddrwrite.AxiWriteDma`;
# tests/test_ddrwrite.py's rate bench: at most 2 cycles a byte).
PASS_LANES = {"quant": LANES, "vec": LANES, "reduce": LANES, "ddr_scatter": 0.5}
# The fixed cost of a pass kind where it is another kind's: a DDR copy's is the DDR reader's (`hdl.ddrio.DdrReader`,
# the same latency whether it delivers elements or L2 words), a scattering write's the DDR writer's.
PASS_FIXED = {"ddr_copy": "ddr_read_pass", "ddr_scatter": "ddr_write_pass"}


def _fixed(kind: str) -> str:
    """The `Rates` field of a pass kind's fixed cost."""
    return PASS_FIXED.get(kind, f"{kind}_pass")


def pass_lanes(kind: str, hw: HardwareConfig) -> int:
    """Elements a pass of `kind` moves per element cycle: `PASS_LANES`, a DDR copy the `DdrReader`'s wide beats
    (`hdl.ddrio.wide_lanes`: four on kv260's 128-bit ports, two on tiny's 64-bit), every other kind one."""
    if kind == "ddr_copy":
        from hdl.ddrio import wide_lanes
        return wide_lanes(hw)
    return PASS_LANES.get(kind, 1)


def _element_cycles(kind: str, elements, rates: Rates, hw: HardwareConfig | None = None) -> float:
    """The cycles of `elements` elements of passes of `kind` (`sim.plan.PASS_KINDS`) beyond their fixed costs
    (`hw`: needed for a DDR copy)."""
    return elements / (PASS_LANES.get(kind, 1) if hw is None else pass_lanes(kind, hw)) / rates.elements_per_cycle


def _pass_cycles(kind: str, passes, elements, rates: Rates, hw: HardwareConfig | None = None) -> float:
    """`passes` passes of `kind` moving `elements` elements in all: each pass's fixed cost, then the elements."""
    return passes * getattr(rates, _fixed(kind)) + _element_cycles(kind, elements, rates, hw)


def _step_cycles(step, rates: Rates) -> float:
    """One pass (`sim.plan.Pass`)."""
    return _pass_cycles(step.kind, 1, step.n, rates)


def _desc_cycles(rates: Rates) -> float:
    """One descriptor load (`sim.plan.DESC_LOAD`)."""
    return _step_cycles(DESC_LOAD, rates)


@dataclass(frozen=True)
class Rates:
    """Per-kind costs (the things RTL measurements calibrate; `fit_rates`)."""
    # The weight stream's rates, measured on the kv260 GEMV engine behind the DDR4 channel model on E4B's
    # shapes, weighted by a token's bytes (`python -m benchmarks.gemv --ddr4`, docs/gemv.md "Behind the DDR4
    # model"): where the ports bind (below about 280 MHz), the fraction of ports x beat per cycle the engine
    # sustains (0.993 at 163 and 155 MHz, 0.990 at 250); where the DDR binds, the fraction of its peak (0.938 at
    # 300 MHz). The model has no other master on the DDR (the APU, the display): the board's DDR probe
    # (docs/kv260.md) measures what they leave.
    gemv_efficiency: float = 0.993
    ddr_efficiency: float = 0.938
    elements_per_cycle: float = 1.0    # elements per cycle of a pass (the SFU and the L2 movers take one)
    # fitted by `python -m benchmarks.npu` on the tiny NPU (docs/architecture.md, "Performance")
    issue: float = 3.8                 # cycles per instruction: fetch, decode, dispatch, retire
    sfu_pass: float = 230.0            # fixed cycles of a pass through the SFU's functions (its latency, start, end)
    vec_pass: float = 36.1             # ... of an element-wise pass on the SFU's short path (hdl.sfu.SHORT_OPS)
    reduce_pass: float = 78.6          # ... of a reduction (the short path to A1, plus the lane tree)
    copy_pass: float = 6.7             # ... of an L2 copy (to L2 or a scalar)
    quant_pass: float = 22.0           # ... of a quantiser pass (L2 -> quantiser at four elements per cycle)
    ddr_read_pass: float = 19.7        # ... of a DDR read (latency of the memory model)
    ddr_write_pass: float = 14.6       # ... of a DDR write (until the last response)
    alu_op: float = 8.7                # a scalar-ALU add or multiply
    gemv_fixed: float = 116.1          # per WGEMV beyond its bytes
    # WGEMM (`wgemm_cost`), fitted to the RTL cycles of the six WGEMMs of `python -m benchmarks.npu --gemm` (tiny
    # NPU, tb.npu.calibrate NPU_CALIBRATE=gemm; tests/test_perf.py RTL_WGEMM_FIT)
    gemm_quant: float = 12.8           # per token's quantiser pass beyond its elements (start, block latency, lanes)
    gemm_tile: float = 74.8            # per token tile: unit start, first DDR latency, engine latency, hand-off
    gemm_row: float = 8.7              # per token row of a row tile beyond its elements: the L2 row command
    # WGEMM on the GEMV engine of several vectors (`_wgemm_terms_gemv`), fitted to the four WGEMMs of 4 and 8
    # tokens of `python -m benchmarks.npu --gemm --hw tiny_v4` (tests/test_perf.py RTL_WGEMM_GEMV)
    gemv_round: float = 19.8           # per tile round of a port whose parts take vectors in turn: their drain

    def __post_init__(self):
        # every cost is a finite number; the fractions and the element rate are checked here, the sign of the
        # fitted costs where they are used (`check_costs`: a fit may pass through a negative cost)
        for f in fields(self):
            v = getattr(self, f.name)
            requirement, ok = _RATE_RULES.get(f.name, ("a finite number", math.isfinite))
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not ok(v):
                raise ValueError(f"Rates.{f.name} must be {requirement}, not {v!r}")

    def check_costs(self) -> Rates:
        """`self` if no cost is negative (a model of negative cycles is no model); ValueError naming the cost."""
        for f in fields(self):
            v = getattr(self, f.name)
            requirement, ok = _RATE_RULES.get(f.name, _COST_RULE)
            if not ok(v):
                raise ValueError(f"Rates.{f.name} must be {requirement}, not {v!r}")
        return self


# what each rate must be (`Rates.__post_init__`, `Rates.check_costs` and the command line's options); every other
# field is a fixed cost in cycles (`_COST_RULE`: zero is a valid "free" cost for a bound)
_RATE_RULES = {
    "gemv_efficiency": ("a number in (0, 1]", lambda v: 0 < v <= 1),
    "ddr_efficiency": ("a number in (0, 1]", lambda v: 0 < v <= 1),
    "elements_per_cycle": ("a finite number > 0", lambda v: math.isfinite(v) and v > 0),
}
_COST_RULE = ("a finite number >= 0", lambda v: math.isfinite(v) and v >= 0)


def _check_counts(name: str, values, least: int) -> list[int]:
    """`values` (positions, prompt lengths) as a list of integers >= `least`; ValueError/TypeError naming
    `name`."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of integers, not {values!r}")
    values = list(values)
    if not values:
        raise ValueError(f"{name} must name at least one value, not []")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be integers, not {v!r}")
        if v < least:
            raise ValueError(f"{name} must be {'positive integers' if least == 1 else f'integers >= {least}'}, "
                             f"not {v!r}")
    return [int(v) for v in values]


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


# --- WGEMM ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Wgemm:
    """One WGEMM instruction: `tokens` token vectors through a `rows` x `cols` row-major weight matrix."""
    rows: int
    cols: int
    tokens: int

    def __post_init__(self):
        for name in ("rows", "cols", "tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Wgemm.{name} must be a positive integer, not {v!r}")


@dataclass(frozen=True)
class GemmGeometry:
    """The sizes of the GEMM unit that its cycles depend on, from `HardwareConfig` (hdl/gemm.py, hdl/systolic.py)."""
    R: int          # token rows of the array (systolic_rows): tokens per tile
    C2: int         # output rows per row tile (2 x systolic_cols)
    seg: int        # k-steps of a segment (the reduction is padded to whole segments)
    ports: int      # weight ports (the scales use one more)
    rp: int         # rows per weight port in a row tile
    kc: int         # columns per row and chunk (one DMA transfer per row and chunk)
    beat: int       # bytes per AXI beat
    max_tokens: int  # tokens one WGEMM instruction carries (its `tokens` field)

    @classmethod
    @lru_cache(maxsize=None)
    def of(cls, hw: HardwareConfig) -> "GemmGeometry":
        from hdl.gemm import chunk_columns
        from hdl.isa import FORMATS, Opcode
        from hdl.systolic import EngineGeometry
        g = EngineGeometry(hw)
        width = next(f.width for f in FORMATS[Opcode.WGEMM] if f.name == "tokens")
        return cls(R=g.rows, C2=2 * g.cols, seg=g.seg, ports=g.wgt_ports, rp=2 * g.cols // g.wgt_ports,
                   kc=chunk_columns(hw), beat=hw.bytes_per_beat, max_tokens=(1 << width) - 1)


def _wgemm_bytes(g: Wgemm, hw: HardwareConfig) -> int:
    """Weight + scale bytes of one pass over the matrix (what `sim.iss` counts per token tile)."""
    return g.rows * (g.cols + g.cols % 2) // 2 + g.rows * -(-g.cols // hw.weight_group) * 2


def _wgemm_terms(g: Wgemm, hw: HardwareConfig, rates: Rates):
    """One WGEMM's cycles as ``known + sum(coef[k] * rates.k)`` (the form `fit_rates` needs), and the cycles of
    its last token tile (what an async WGEMM leaves running). Each `max` below is resolved at `rates`.

    Per instruction: its descriptor load (`sim.plan.DESC_LOAD`; `issue` comes from the instruction count). Per
    token tile of n <= R tokens (`sim.plan.wgemm_steps`, one tile after another): its n quantiser passes
    (``cols`` elements each at one per cycle + `gemm_quant`), then the GEMM unit
    (hdl/gemm.py): `gemm_tile` + the first chunk's fetch (not overlapped), then per row tile j of 2C rows
    ``max(kpad, fetch_j, out_{j-1})`` (the array's k-steps; the weight port's beats of the tile's chunks, the
    scale port's, the tile's bytes at the DDR rate; the previous row tile's output, which drains while this
    one computes), then the last row tile's output. The output of a row tile of ``nr`` rows is
    ``n * (nr + gemm_row) + (R - n)`` cycles: one element per cycle and a row command per token row, one
    cycle per padding row.

    Where the GEMV engine runs WGEMM (`HardwareConfig.gemv_vectors` V > 1, `_wgemm_terms_gemv`) a tile is V
    tokens: their quantiser passes, then one GEMV command of that many vectors."""
    if hw.gemv_vectors > 1:
        return _wgemm_terms_gemv(g, hw, rates)
    geo = GemmGeometry.of(hw)
    if g.cols > hw.gemv_max_cols:
        raise ValueError(f"a WGEMM of {g.cols} columns exceeds the GEMM unit's activation memory "
                         f"({hw.gemv_max_cols} columns)")
    port = rates.gemv_efficiency                                   # beats per cycle a read DMA sustains
    ddr = DDR_PEAK_BYTES_PER_S * rates.ddr_efficiency / hw.clock_hz
    kpad = -(-g.cols // geo.seg) * geo.seg
    row_bytes = (g.cols + 1) // 2
    half = geo.kc // 2
    chunks = [min(half, row_bytes - off) for off in range(0, row_bytes, half)]
    beats_row = sum(-(-b // geo.beat) for b in chunks)              # one transfer per row and chunk
    scale_beats_row = -(-(-(-g.cols // hw.weight_group) * 2) // geo.beat)
    rt = -(-g.rows // geo.C2)

    def tile(n, quant):
        tk, tc = float(sum(p.n for p in quant)), Counter({"gemm_quant": len(quant), "gemm_tile": 1})
        tk += min(geo.rp, g.rows) * -(-chunks[0] // geo.beat) / port
        prev_out = None
        for j in range(rt):
            nr = min(geo.C2, g.rows - j * geo.C2)
            fetch = max(min(geo.rp, nr) * beats_row, nr * scale_beats_row) / port
            fetch = max(fetch, (nr * (row_bytes + 2 * -(-g.cols // hw.weight_group))) / ddr)
            out = (n * (nr + rates.gemm_row) + (geo.R - n), n * nr + (geo.R - n), n)   # (cycles, known, rows)
            stage = max(kpad, fetch)
            if prev_out is not None and prev_out[0] > stage:
                tk, tc["gemm_row"] = tk + prev_out[1], tc["gemm_row"] + prev_out[2]
            else:
                tk += stage
            prev_out = out
        tk, tc["gemm_row"] = tk + prev_out[1], tc["gemm_row"] + prev_out[2]
        return tk, tc

    tiles: Counter = Counter()          # (tokens, its quantiser passes) -> token tiles, in the order they run
    quant = []
    for step in wgemm_steps(g.rows, g.cols, g.tokens, False, hw):
        if isinstance(step, Gemm):
            tiles[(step.tokens, tuple(quant))] += 1
            quant = []
        else:
            quant.append(step)
    coef: Counter = Counter({_fixed(DESC_LOAD.kind): 1})        # the descriptor (its elements: wgemm_cost)
    known = 0.0
    for (n, quant), count in tiles.items():
        tk, tc = tile(n, quant)
        known += count * tk
        coef.update({k: count * v for k, v in tc.items()})
        last = tk + sum(v * getattr(rates, k) for k, v in tc.items())
    return known, coef, last


def _wgemm_terms_gemv(g: Wgemm, hw: HardwareConfig, rates: Rates):
    """`_wgemm_terms` where the GEMV engine runs WGEMM (V = `gemv_vectors` > 1, hdl/controller/matrix.py): per
    tile of n <= V tokens, n quantiser passes into the engine's vector memories (``quant_pass`` each, the
    elements at the quantiser's rate, as a WGEMV's), then one GEMV command of n vectors: ``gemv_fixed`` + the
    longer of its bytes at the weight stream's rate (`_stream_rate`) and its back end (hdl/gemv.py: P =
    `gemv_parts` binary32 parts per port and cycle, ceil(n / P) cycles per row and segment, over the tiles of
    `tile_rows` rows a port takes; where a part takes more than one vector in turn, each tile round ends in its
    parts' drain, ``gemv_round``, which the RTL overlaps with the next round for one vector a part)."""
    if g.cols > hw.gemv_max_cols:
        raise ValueError(f"a WGEMM of {g.cols} columns exceeds the GEMV engine's activation memory "
                         f"({hw.gemv_max_cols} columns)")
    stream = _wgemm_bytes(g, hw) / _stream_rate(hw, rates)
    coef: Counter = Counter({_fixed(DESC_LOAD.kind): 1})
    known, last = 0.0, 0.0
    for t0 in range(0, g.tokens, hw.gemm_tile):
        n = min(hw.gemm_tile, g.tokens - t0)
        back = gemv_back_end(g.rows, g.cols, hw.weight_group or hw.act_block, n, hw, rates)
        tk = n * _element_cycles("quant", g.cols, rates) + max(stream, back)
        known += tk
        coef.update({"quant_pass": n, "gemv_fixed": 1})
        last = tk + n * rates.quant_pass + rates.gemv_fixed
    return known, coef, last


def gemv_back_end(rows: int, cols: int, group: int, vectors: int, hw: HardwareConfig, rates: Rates = Rates()) \
        -> float:
    """Cycles of the GEMV engine's binary32 back end for a dense command of `vectors` vectors over `rows` x
    `cols` weights in groups of `group` (hdl/gemv.py): P = `gemv_parts` parts per port and cycle, ceil(vectors /
    P) cycles per row and segment, over the tiles of `tile_rows` rows a port takes; where a part takes more than
    one vector in turn, each tile round ends in its parts' drain, ``gemv_round``."""
    from hdl.gemv import GemvEngine, gemv_parts
    T = GemvEngine.default_tile_rows()
    nseg = -(-cols // segment_size(group, hw.act_block))
    port_tiles = -(-(-(-rows // T)) // hw.axi_ports)
    turns = -(-vectors // gemv_parts(hw))            # vectors a part takes in turn
    return port_tiles * (T * turns * nseg + (rates.gemv_round if turns > 1 else 0))


def _dense_extra(commands, hw: HardwareConfig, rates: Rates) -> float:
    """The cycles beyond their bytes (counted with the rest) of dense engine commands of several vectors,
    `commands` ((rows, cols, group, vectors, weight bytes per column), count): the larger of their weight and
    scale bytes at the stream's rate and the back end (`gemv_back_end`)."""
    rate = _stream_rate(hw, rates)
    extra = 0.0
    for (rows, cols, group, vectors, per_col), n in commands:
        stream = (rows * cols * per_col + rows * -(-cols // group) * 2) / rate
        extra += n * max(0.0, gemv_back_end(rows, cols, group, vectors, hw, rates) - stream)
    return extra


def _group_extra(shapes, hw: HardwareConfig, rates: Rates) -> float:
    """`_dense_extra` of INT8 ATTN's K GEMVs of several heads, `shapes` ((rows, cols, group, vectors) -> count,
    `sim.iss.Counters.attn_group_gemvs`): INT4 K planes, half a byte a weight."""
    return _dense_extra((((*shape, 0.5), n) for shape, n in shapes.items()), hw, rates)


def _v_rows_extra(shapes, hw: HardwareConfig, rates: Rates) -> float:
    """`_dense_extra` of INT8 ATTN's V GEMVs over the V rows (``kv_v_layout`` "rows"), `shapes` ((rows,
    positions, vectors) -> count, `sim.iss.Counters.attn_v_gemvs`): a byte a weight, one scale group a row
    (`V_PLANE_LOG2_GROUP`), a segment of ``act_block`` positions."""
    return _dense_extra((((rows, cols, 1 << V_PLANE_LOG2_GROUP, vectors, 1), n)
                         for (rows, cols, vectors), n in shapes.items()), hw, rates)


def wgemm_cost(g: Wgemm, hw: HardwareConfig, rates: Rates = Rates()) -> float:
    """Cycles of one WGEMM on the NPU, without its `issue` (`_wgemm_terms`)."""
    known, coef, _ = _wgemm_terms(g, hw, rates)
    # coef counts the descriptor's fixed cost (the form fit_rates needs): add only its elements here
    return known + _element_cycles(DESC_LOAD.kind, DESC_LOAD.n, rates) + \
        sum(v * getattr(rates, k) for k, v in coef.items())


def wgemm_bounds(g: Wgemm, hw: HardwareConfig, rates: Rates = Rates()) -> tuple[float, float]:
    """(array bound, weight-stream bound) in cycles: one k-step per cycle over token tiles x row tiles x padded
    K; the matrix's bytes once per token tile at the DDR's rate (peak x ``ddr_efficiency``). Where the GEMV
    engine runs WGEMM (`gemv_vectors` > 1) the first is its products: ``rows x cols x tokens`` at its lanes
    (`gemv_lanes` x V a cycle)."""
    if hw.gemv_vectors > 1:
        tiles = -(-g.tokens // hw.gemm_tile)
        array = g.rows * g.cols * g.tokens / (hw.gemv_lanes * hw.gemv_vectors)
        stream = tiles * _wgemm_bytes(g, hw) / (DDR_PEAK_BYTES_PER_S * rates.ddr_efficiency / hw.clock_hz)
        return float(array), stream
    geo = GemmGeometry.of(hw)
    tiles = -(-g.tokens // geo.R)
    array = tiles * -(-g.rows // geo.C2) * -(-g.cols // geo.seg) * geo.seg
    stream = tiles * _wgemm_bytes(g, hw) / (DDR_PEAK_BYTES_PER_S * rates.ddr_efficiency / hw.clock_hz)
    return float(array), stream


def sparse_gemv_cycles(rows: int, cols: int, group: int, nonzero: int, hw: HardwareConfig) -> int:
    """Engine cycles of a sparse WGEMV beyond which its bytes do not matter (`hdl.gemv.SparsePort`, per
    port, the ports in parallel): the back end adds one binary32 part per row of the port and segment on each of
    the port's P = `gemv_parts` pipelines (row 2q + k on pipeline k), every segment (at least
    `SparsePort.MIN_WALK` per walk), and the front end takes `CYCLES_PER_BEAT` cycles per weight beat of each
    non-zero column; the two overlap (banked isum memories). The results' drain through the merge is left out:
    the E4B W_down measures 3.8 % above this bound on kv260 (P = 1, segments of 128; docs/gemv.md "Throughput")."""
    from hdl.gemv import SparsePort, gemv_parts
    W = hw.weights_per_beat
    prow = -(-rows // (hw.axi_ports * W)) * W                   # the rows of port 0, the largest share
    nseg = -(-cols // min(group, hw.act_block))
    back = nseg * max(-(-prow // gemv_parts(hw)), SparsePort.MIN_WALK)
    scales = -(-cols // group) * (prow * 2 // hw.bytes_per_beat)   # scale beats, one per cycle
    front = nonzero * (prow // W) * SparsePort.CYCLES_PER_BEAT + scales
    return max(back, front)


def _sparse_gemv_time(shape, hw: HardwareConfig, rates: Rates) -> tuple[float, float]:
    """(engine cycles beyond ``gemv_fixed``, cycles of its bytes) of one sparse GEMV of `shape` (rows, cols,
    group, nonzero): the longer of its bytes at the stream rate and its binary32 parts."""
    rows, cols, group, nz = shape
    stream = (nz * rows // 2 + rows * -(-cols // group) * 2) / _stream_rate(hw, rates)
    return max(stream, sparse_gemv_cycles(rows, cols, group, nz, hw)), stream


def masked_gemv_cycles(rows: int, cols: int, group: int, live: int, hw: HardwareConfig, stream: float) -> float:
    """Engine cycles of a masked WGEMV (`hdl.gemv`, WGEMV `mask`) beyond ``gemv_fixed`` whose bytes take
    `stream` cycles: each port first gathers the live rows of its share (`hdl.rowmask.RowGather`: two cycles
    per word of four rows, and a cycle per live row, the largest share's), then the rows stream while the merge
    issues every row, live or not, one a cycle."""
    from hdl.rowmask import MASK_LANES
    W, N = hw.weights_per_beat, hw.axi_ports
    prow = -(-rows // (N * W)) * W
    gather = 4 + 2 * -(-prow // MASK_LANES) + -(-live // N)
    return gather + max(stream, rows)


def _masked_extra(shapes, hw: HardwareConfig, rates: Rates) -> float:
    """The cycles beyond their bytes (counted with the rest) of the masked GEMVs `shapes` (shape -> count)."""
    total = 0.0
    for (rows, cols, group, live), n in shapes.items():
        stream = live * ((cols + cols % 2) // 2 + -(-cols // group) * 2) / _stream_rate(hw, rates)
        total += n * (masked_gemv_cycles(rows, cols, group, live, hw, stream) - stream)
    return total


def _sparse_extra(shapes, hw: HardwareConfig, rates: Rates) -> float:
    """The cycles beyond their bytes (counted with the rest) of the sparse GEMVs `shapes` (shape -> count)."""
    return sum(n * (t - b) for n, (t, b) in ((n, _sparse_gemv_time(sh, hw, rates)) for sh, n in shapes.items()))


def _recip_beside(shape, hw: HardwareConfig, rates: Rates) -> float:
    """What INT8 ATTN's RECIP pass (`sim.plan.ATTN_RECIP`) outlasts the two V GEMVs of `shape` it runs beside
    by (negative: it is hidden)."""
    v_gemvs = 2 * (rates.gemv_fixed + _sparse_gemv_time(shape, hw, rates)[0])
    return _step_cycles(ATTN_RECIP, rates) - v_gemvs


def cycles_of(counters, hw: HardwareConfig, rates: Rates, gemms=()) -> tuple[dict, dict]:
    """(cycles per unit, cycles per opcode) of one run whose `counters` the ISS recorded; `gemms` are the run's
    WGEMMs (`Wgemm`: the ISS counts their instructions and bytes, not their shapes): unit ``gemm`` (the
    quantiser passes and the GEMM unit), their descriptor loads in ``ddr_read``."""
    ins = counters.instructions
    n_wgemv = sum(v for k, v in ins.items() if k == "WGEMV")
    by_op: Counter = Counter()
    units: Counter = Counter()
    for (op, kind), n in counters.passes.items():
        c = _pass_cycles(kind, n, counters.pass_elements[(op, kind)], rates, hw)
        units[kind] += c
        by_op[op] += c
    rate = _stream_rate(hw, rates)

    recips = sum(n * max(0.0, _recip_beside(shape, hw, rates)) for shape, n in counters.attn_recips.items())
    if recips:
        units["sfu"] += recips
        by_op["ATTN"] += recips

    weights = (counters.gemv_bytes / rate + n_wgemv * rates.gemv_fixed + _sparse_extra(counters.sparse_gemvs, hw, rates)
               + _masked_extra(counters.masked_gemvs, hw, rates))
    units["weights"] += weights
    by_op["WGEMV"] += weights
    # INT8 ATTN's GEMVs over the KV planes: the same engine costs, but inside ATTN (not a weight stream that
    # an async WGEMV could hide)
    kv = (counters.attn_gemv_bytes / rate + counters.attn_gemvs * rates.gemv_fixed
          + _sparse_extra(counters.attn_sparse_gemvs, hw, rates) + _group_extra(counters.attn_group_gemvs, hw, rates)
          + _v_rows_extra(counters.attn_v_gemvs, hw, rates))
    if kv:
        units["kv_stream"] += kv
        by_op["ATTN"] += kv
    gemm_bytes = 0
    for g in gemms:
        desc = _desc_cycles(rates)
        cost = wgemm_cost(g, hw, rates)
        units["ddr_read"] += desc
        units["gemm"] += cost - desc
        by_op["WGEMM"] += cost
        gemm_bytes += -(-g.tokens // hw.gemm_tile) * _wgemm_bytes(g, hw)
    # the DDR movers share port 0 with the fetch: their bytes take at least the DDR time
    other = (counters.total_read() + sum(counters.bytes_written.values()) - counters.gemv_bytes - gemm_bytes
             - counters.attn_gemv_bytes)
    ddr_rate = min(hw.bytes_per_beat, DDR_PEAK_BYTES_PER_S * rates.ddr_efficiency / hw.clock_hz)
    moved = units["ddr_read"] + units["ddr_copy"] + units["ddr_write"]
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
        gemms = []
        if insn.op is Opcode.WGEMM:
            d = m.image.descriptors[insn.desc]
            gemms = [Wgemm(d.rows, d.cols, insn.tokens)]
        units, by_op = cycles_of(_minus(cur, state["prev"]), hw, rates, gemms)
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
        elif insn.op is Opcode.WGEMM:
            # token tiles one after another; with async_ the last one runs on beside later instructions
            t = max(t, g_end)
            last = _wgemm_terms(gemms[0], hw, rates)[2] if insn.async_ else 0.0
            t += front - last
            if insn.async_:
                d = gemms[0]
                stride = -(-d.rows // LANES) * LANES                    # token rows start on L2 words
                n_last = getattr(m.steps[-1], "tokens", getattr(m.steps[-1], "vectors", 1))   # the last tile's (sim.plan)
                lo = insn.dst * LANES + (d.tokens - n_last) * stride
                state["g"] = (lo, lo + (n_last - 1) * stride + d.rows)
                g_end = t + last
        elif (insn.op is Opcode.CTRL and insn.func in (CtrlFunc.FENCE, CtrlFunc.HALT)) or \
                (insn.op is Opcode.ATTN and hw.kv_format == "int8"):
            # FENCE and HALT wait for the engine; so does an INT8 ATTN, which runs its GEMVs on it
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


def features(counters, hw: HardwareConfig, rates: Rates, gemms=()) -> dict:
    """The coefficients of each fitted cost in a run's cycle count (`fit_rates`): cycles = sum(f * cost), plus
    the cycles at known rates (``_elements``, ``_streaming``, ``_known``: WGEMMs, sparse and masked GEMVs
    beyond their bytes). A WGEMM's coefficients depend on which term of each of its `max`es wins, resolved at `rates`
    (`_wgemm_terms`); so does an INT8 ATTN's RECIP pass (`_recip_beside`)."""
    f = Counter({"issue": sum(counters.instructions.values()), "alu_op": counters.alu_ops,
                 "gemv_fixed": counters.instructions.get("WGEMV", 0) + counters.attn_gemvs})
    for k in PASS_KINDS:
        f[_fixed(k)] += sum(n for (op, kind), n in counters.passes.items() if kind == k)
    elements = sum(n / pass_lanes(kind, hw) for (_, kind), n in counters.pass_elements.items())
    streaming = (counters.gemv_bytes + counters.attn_gemv_bytes) / _stream_rate(hw, rates)
    known = (_sparse_extra(counters.sparse_gemvs, hw, rates) + _sparse_extra(counters.attn_sparse_gemvs, hw, rates)
             + _masked_extra(counters.masked_gemvs, hw, rates) + _group_extra(counters.attn_group_gemvs, hw, rates)
             + _v_rows_extra(counters.attn_v_gemvs, hw, rates))
    for shape, n in counters.attn_recips.items():     # a RECIP pass that outlasts its V GEMVs: the difference
        if _recip_beside(shape, hw, rates) > 0:
            f[_fixed(ATTN_RECIP.kind)] += n
            f["gemv_fixed"] -= 2 * n
            elements += n * ATTN_RECIP.n / pass_lanes(ATTN_RECIP.kind, hw)
            known -= 2 * n * _sparse_gemv_time(shape, hw, rates)[0]
    for g in gemms:
        k, coef, _ = _wgemm_terms(g, hw, rates)
        known += k
        elements += DESC_LOAD.n / pass_lanes(DESC_LOAD.kind, hw)
        f.update(coef)
    return dict(f) | {"_elements": elements, "_streaming": streaming, "_known": known}


FITTED = ("issue", "sfu_pass", "vec_pass", "reduce_pass", "copy_pass", "quant_pass", "ddr_read_pass", "ddr_write_pass",
          "alu_op", "gemv_fixed", "gemm_quant", "gemm_tile", "gemm_row")


def fit_rates(samples, hw: HardwareConfig, base: Rates = Rates(), fit=FITTED, iterations: int = 20) -> Rates:
    """Least-squares costs from RTL runs: `samples` = [(counters, measured_cycles)] or [(counters,
    measured_cycles, wgemms)]; elements move at `base.elements_per_cycle` and weights at `base`'s streaming
    rate (both measured separately); costs not in `fit` count at their `base` value. Costs that no sample
    exercises keep their `base` value. A WGEMM's
    features depend on the costs (which term of a `max` wins), so the fit is repeated with its own result until
    the features stop changing."""
    rates = base
    for _ in range(iterations):
        rows, rhs = [], []
        for sample in samples:
            counters, cycles, gemms = sample if len(sample) == 3 else (*sample, ())
            f = features(counters, hw, rates, gemms)
            rows.append([f.get(k, 0) for k in fit])
            fixed = sum(v * getattr(base, k) for k, v in f.items() if not k.startswith("_") and k not in fit)
            rhs.append(cycles - f["_elements"] / base.elements_per_cycle - f["_streaming"] - f["_known"] - fixed)
        a, b = np.array(rows, float), np.array(rhs, float)
        used = np.any(a != 0, axis=0)
        sol = np.linalg.lstsq(a[:, used], b, rcond=None)[0]
        values = dict(zip([k for k, u in zip(fit, used) if u], sol))
        new = replace(base, **{k: float(v) for k, v in values.items()})
        if new == rates:
            break
        rates = new
    return rates


def estimate(cfg: ModelConfig, hw: HardwareConfig, positions: list[int], rates: Rates = Rates()) \
        -> list[TokenEstimate]:
    """One `TokenEstimate` per position (integers >= 0: the token at position 0 is the first of a sequence);
    ValueError for a negative position or cost."""
    positions = _check_counts("positions", positions, 0)
    rates.check_costs()
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


# --- prefill: the compiled programs, and an estimate over full token tiles ---------------------------------------

@dataclass
class PrefillEstimate:
    """T prompt tokens. `compiled`: the compiled prefill programs as `Runtime.prefill` runs them, priced like the
    decode program. `cycles` (`gemm` + `rest` + `head`): an estimate with the decode program's projections as
    WGEMMs over full token tiles, everything else of each token as the decode model costs it at that token's
    position, the output section once (the last token's logits)."""
    tokens: int
    clock_hz: float
    gemm: float = 0.0             # cycles of the projection WGEMMs (all layers, all tokens)
    rest: float = 0.0             # the other per-token work of the T tokens (attention, norms, SFU, sparse WGEMV)
    head: float = 0.0             # the output section once: AltUp unembed, final norm, LM head, soft-cap
    array_bound: float = 0.0      # the projections at one k-step per cycle (token tiles x row tiles x padded K)
    stream_bound: float = 0.0     # the projections' bytes once per token tile at the DDR rate
    decode: float = 0.0           # the same T tokens decoded one by one (the decode model at each position)
    projections: int = 0          # projection matrices per token (WGEMMs of T tokens each)
    compiled: float = 0.0         # the compiled prefill programs, as `Runtime.prefill` runs the prompt
    program_tokens: int = 1       # tokens per compiled prefill program (`firmware.compiler.program_tokens`)
    program_gemm: bool = False    # their projections as WGEMMs (`firmware.compiler.gemm_pays`)
    # the prompt's middle program (without logits), per token: its position, cycles, and the cycles of its
    # instructions one at a time by opcode (as the decode token's ``by instruction``)
    mid_position: int = 0
    mid_cycles: float = 0.0
    mid_by_opcode: dict = field(default_factory=dict)

    @property
    def compiled_seconds(self) -> float:
        return self.compiled / self.clock_hz

    @property
    def cycles(self) -> float:
        return self.gemm + self.rest + self.head

    @property
    def seconds(self) -> float:
        return self.cycles / self.clock_hz

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _over_positions(cost, tokens: int, breaks) -> float:
    """sum(cost(p) for p in range(tokens)) for a cost that is affine between the positions in `breaks` (a
    sliding window of w keys: n = min(p + 1, w) bends at p = w - 1) from a few evaluations."""
    cuts = sorted({b for b in breaks if 0 <= b < tokens - 1})
    total, a = 0.0, 0
    for b in cuts + [tokens - 1]:
        total += (b - a + 1) * (cost(a) + cost(b)) / 2 if b > a else cost(a)
        a = b + 1
    return total


def _runs_cost(runs, cost, breaks) -> float:
    """sum(cost(pos, k) for (pos, k) in runs), where a run's cost is affine in its position between the
    `breaks` for runs of the same length: evaluated at the first and last run of each such stretch and
    interpolated in between."""
    total, k0 = 0.0, 0
    while k0 < len(runs):
        k1 = k0
        while (k1 + 1 < len(runs) and runs[k1 + 1][1] == runs[k0][1]
               and not any(runs[k1][0] <= b < runs[k1 + 1][0] + runs[k1 + 1][1] for b in breaks)):
            k1 += 1
        (p0, n0), (p1, n1) = runs[k0], runs[k1]
        c0 = cost(p0, n0)
        c1 = cost(p1, n1) if k1 > k0 else c0
        total += (k1 - k0 + 1) * (c0 + c1) / 2
        k0 = k1 + 1
    return total


def prefill(cfg: ModelConfig, hw: HardwareConfig, tokens: list[int], rates: Rates = Rates()) \
        -> list[PrefillEstimate]:
    """Prefill estimates for prompts of each length in `tokens` (`PrefillEstimate`): the compiled prefill programs
    (`firmware.compiler.prefill_runs` of `program_tokens` a program, each run in the ISS's counting mode and
    priced by `schedule`; runs of one length between the window's bend interpolated), and the full-tile
    estimate. Its projections are the
    decode program's dense row-major WGEMVs before its output section (firmware/compiler.py: PLE and AltUp
    projections, q/k/v/o, LAuReL, gate/up/down of dense layers, the router, the per-layer gate and projection);
    the column-major W_down of sparse layers (which WGEMM cannot read) stays a per-token sparse WGEMV.
    ValueError for a prompt length below 1 or a negative cost."""
    tokens = _check_counts("tokens", tokens, 1)
    rates.check_costs()
    from hdl.isa import CtrlFunc, Opcode, decode, encode
    from sim.iss import COUNT, Machine
    from .compiler import compile_token, compile_tokens, gemm_pays, prefill_runs, program_tokens, sliding_ring
    from .pack import pack

    image = pack(cfg, None, hw, max_positions=max(tokens) + 1, fill=False)
    program = compile_token(cfg, image, hw)
    nop, halt = encode(Opcode.CTRL, func=CtrlFunc.NOP, imm=0), encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    body, headless, shapes = [], [], []        # the token without its output section (5): with and without
    whole = image.matrices()                   # the projections; a matrix the decode program runs in row pieces
    piece_rows: Counter = Counter()            # (the FFN's gate and up) is one WGEMM of the whole matrix
    nops = 0
    for w, step in zip(program.words, program.steps):
        if step.startswith("5 ") or step == "end":
            continue
        headless.append(w)
        i = decode(w)
        if i.op is Opcode.WGEMV and not i.sparse and image.descriptors[i.desc].layout == 0:
            d = image.descriptors[i.desc]
            full = whole[d.tensor]
            if d.rows == full.rows:
                shapes.append((d.rows, d.cols))
            else:
                piece_rows[d.tensor] += d.rows
                if piece_rows[d.tensor] == full.rows:     # the last piece completes the matrix
                    shapes.append((full.rows, full.cols))
                    piece_rows[d.tensor] = 0
            w = nop
            nops += 1
        body.append(w)
    assert not any(piece_rows.values()), f"row pieces that do not make whole matrices: {dict(piece_rows)}"
    body.append(halt)
    headless.append(halt)

    def sched(words, pos):
        return schedule(Machine(image, hw, COUNT), words, hw, rates, token=2, pos=pos)

    def run(words, pos):
        return sched(words, pos).cycles

    def rest(pos):
        return run(body, pos) - nops * rates.issue                 # the NOPs in the projections' places

    def token(pos):
        return run(program.words, pos)

    breaks = (cfg.sliding_window - 1,) if cfg.sliding_window else ()
    geo = GemmGeometry.of(hw)
    per_insn = geo.max_tokens // geo.R * geo.R                      # whole tiles per WGEMM instruction
    per_program = program_tokens(cfg, image, hw)
    gemm = gemm_pays(hw, per_program)
    programs = {}

    def run_words(pos, k, logits="none"):
        if (k, logits) not in programs:
            programs[k, logits] = compile_tokens(cfg, image, hw, k, logits=logits)
        return programs[k, logits].bind([2] * k, range(pos, pos + k))

    def run_cost(pos, k, logits="none"):
        return run(run_words(pos, k, logits), pos)

    out = []
    for t in tokens:
        e = PrefillEstimate(tokens=t, clock_hz=hw.clock_hz, projections=len(shapes), program_tokens=per_program,
                            program_gemm=gemm)
        # the programs without logits, then the last one's output section (`Runtime.prefill`)
        runs = prefill_runs(cfg, t, 0, per_program, sliding_ring(cfg, image))
        e.compiled = _runs_cost(runs, run_cost, breaks) + run_cost(*runs[-1], "last") - run_cost(*runs[-1])
        e.mid_position, k = next((p, k) for p, k in runs if p + k > t // 2)
        mid = sched(run_words(e.mid_position, k), e.mid_position)
        e.mid_cycles, e.mid_by_opcode = mid.cycles / k, {op: c / k for op, c in mid.by_opcode.items()}
        for rows, cols in shapes:
            for t0 in range(0, t, per_insn):
                g = Wgemm(rows, cols, min(per_insn, t - t0))
                e.gemm += wgemm_cost(g, hw, rates) + rates.issue
            array, stream = wgemm_bounds(Wgemm(rows, cols, t), hw, rates)
            e.array_bound += array
            e.stream_bound += stream
        e.rest = _over_positions(rest, t, breaks)
        e.head = token(t - 1) - run(headless, t - 1)
        e.decode = _over_positions(token, t, breaks)
        out.append(e)
    return out


# --- several tokens per weight stream: batched decode, speculative verify passes ------------------------------------

@dataclass
class BatchEstimate:
    """B streams one token each at `position` (`firmware.runtime.Runtime.step_many`: batched programs of up to
    `program_tokens` streams). `cycles`: the whole step; `decode`: one token of one stream alone."""
    streams: int
    position: int
    clock_hz: float
    cycles: float = 0.0
    decode: float = 0.0
    program_tokens: int = 1
    program_gemm: bool = False

    @property
    def tok_s(self) -> float:
        """Aggregate tokens per second of the B streams."""
        return self.streams * self.clock_hz / self.cycles

    @property
    def per_stream_tok_s(self) -> float:
        return self.clock_hz / self.cycles

    @property
    def speedup(self) -> float:
        """Aggregate tok/s over one stream decoding alone."""
        return self.tok_s * self.decode / self.clock_hz


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify pass of k drafts emits when each draft is accepted with probability `alpha`, given
    the ones before it (the accepted prefix, then the correction or bonus id): (1 - alpha**(k+1)) / (1 - alpha)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class SpecEstimate:
    """Speculative decoding at `position`: `verify[n]` the cycles of a verify pass of n ids (n - 1 drafts),
    `decode` one plain decode step."""
    position: int
    clock_hz: float
    decode: float
    verify: dict[int, float] = field(default_factory=dict)

    def speedup(self, alpha: float, k: int) -> float:
        """Tokens per second over plain decoding with k drafts a pass at acceptance rate `alpha`."""
        return expected_tokens(alpha, k) * self.decode / self.verify[k + 1]

    def best(self, alpha: float) -> tuple[int, float]:
        """(k, speed-up) of the best number of drafts at `alpha`."""
        return max(((n - 1, self.speedup(alpha, n - 1)) for n in self.verify), key=lambda kv: kv[1])


def _program_cycles(cfg, hw, image, rates, tokens, streams, logits, pos):
    from sim.iss import COUNT, Machine
    from .compiler import compile_tokens
    prog = compile_tokens(cfg, image, hw, tokens, streams=streams, logits=logits)
    words = prog.bind([2] * tokens, [pos + (0 if streams and len(set(streams)) == tokens else t)
                                     for t in range(tokens)])
    return schedule(Machine(image, hw, COUNT), words, hw, rates, token=2, pos=pos).cycles


def batched(cfg: ModelConfig, hw: HardwareConfig, streams: list[int], positions: list[int],
            rates: Rates = Rates()) -> list[BatchEstimate]:
    """Batched decode steps of each stream count at each position (every stream there), priced from the
    compiled batched programs (`firmware.compiler.compile_tokens` with one stream per token and every token's
    logits) in the ISS's counting mode, as `Runtime.step_many` runs them."""
    streams = _check_counts("streams", streams, 1)
    positions = _check_counts("positions", positions, 0)
    rates.check_costs()
    from .compiler import gemm_pays, program_tokens
    from .pack import pack
    top = max(streams)
    image = pack(cfg, None, hw, max_positions=max(positions) + 1, fill=False, streams=top, logit_rows=top)
    per = min(program_tokens(cfg, image, hw), image.logit_rows)
    out = []
    for pos in positions:
        decode = _program_cycles(cfg, hw, image, rates, 1, None, "last", pos)
        for b in streams:
            e = BatchEstimate(streams=b, position=pos, clock_hz=hw.clock_hz, decode=decode,
                              program_tokens=min(per, b), program_gemm=gemm_pays(hw, min(per, b)))
            for s0 in range(0, b, per):
                n = min(per, b - s0)
                e.cycles += decode if n == 1 else _program_cycles(cfg, hw, image, rates, n,
                                                                  tuple(range(s0, s0 + n)), "all", pos)
            out.append(e)
    return out


def speculative(cfg: ModelConfig, hw: HardwareConfig, positions: list[int], drafts: int,
                rates: Rates = Rates()) -> list[SpecEstimate]:
    """Verify passes of 1 .. `drafts` + 1 ids at each position (`Runtime.verify`: one program, every token's
    logits), priced like the decode program; a pass longer than one program may run (`program_tokens`,
    `multi_token_limit`) is left out."""
    positions = _check_counts("positions", positions, 0)
    drafts = _check_counts("drafts", [drafts], 0)[0]
    rates.check_costs()
    from .compiler import multi_token_limit, program_tokens, sliding_ring
    from .pack import pack
    image = pack(cfg, None, hw, max_positions=max(positions) + drafts + 2, fill=False, logit_rows=drafts + 1)
    per = program_tokens(cfg, image, hw)
    out = []
    for pos in positions:
        e = SpecEstimate(position=pos, clock_hz=hw.clock_hz,
                         decode=_program_cycles(cfg, hw, image, rates, 1, None, "last", pos))
        e.verify[1] = e.decode
        limit = multi_token_limit(cfg, pos, sliding_ring(cfg, image))
        for n in range(2, min(drafts + 1, per, image.logit_rows, limit) + 1):
            e.verify[n] = _program_cycles(cfg, hw, image, rates, n, None, "all", pos)
        out.append(e)
    return out


POSITION = NON_NEGATIVE


def main(argv=None) -> int:
    """``python -m firmware.perf``: see ``--help``. Bad input: one line on stderr naming the option, exit
    status 2."""
    from hdl.config import PRESETS as HW_PRESETS
    from sim.config import PRESETS as MODEL_PRESETS
    from sim.iss import ExecutionError

    p = argparse.ArgumentParser(prog="python -m firmware.perf", description=__doc__.splitlines()[0],
                                usage="%(prog)s [--model M] [--hw HW] [--positions POS ...] [--prefill [TOKENS ...]] "
                                      "[--streams B ...] [--speculate K] [--kv-format F] [--clock-mhz MHZ] [--axi-ports N] [--no-row-mask] "
                                      "[--gemv-vectors V] [--json] "
                                      "[--<cost> X ...]")
    p.add_argument("--model", default="e4b", choices=sorted(MODEL_PRESETS), help="model preset (default e4b)")
    p.add_argument("--hw", default="kv260", choices=sorted(HW_PRESETS), help="hardware preset (default kv260)")
    p.add_argument("--positions", type=POSITION, nargs="+", default=[128, 1024, 4096], metavar="POS",
                   help="positions of the decode token (integers >= 0; default 128 1024 4096)")
    p.add_argument("--prefill", type=POSITIVE, nargs="*", default=[32, 128, 512], metavar="TOKENS",
                   help="prompt lengths of the prefill estimate (positive; none: skip it)")
    p.add_argument("--streams", type=POSITIVE, nargs="*", default=[], metavar="B",
                   help="batched decode: price a step of B streams at each position (e.g. 1 2 4 8; default none)")
    p.add_argument("--speculate", type=NON_NEGATIVE, default=None, metavar="K",
                   help="speculative decoding: price verify passes of up to K drafts at each position and the "
                        "speed-up at acceptance rates 0.5 0.6 0.7 0.8 0.9 (default: skip)")
    p.add_argument("--kv-format", choices=("fp16", "int8"), help="KV cache format (default: the preset's)")
    p.add_argument("--kv-v-layout", choices=("planes", "rows"),
                   help="INT8 cache: V as two INT4 planes of columns (sparse V GEMVs per query head) or as INT8 "
                        "rows (a dense V GEMV per KV head); default: the preset's")
    p.add_argument("--json", action="store_true",
                   help="print the figures as one JSON object (tok/s, cycles and bytes per position, the clock and "
                        "the rates used) instead of the tables")
    p.add_argument("--clock-mhz", type=arg_type("a number of MHz in [1, 1000]", float,
                                                 lambda v: math.isfinite(v) and 1 <= v <= 1000),
                   metavar="MHZ", help="fabric clock, e.g. the one hdl.build's timing estimate supports "
                                       "(default: the preset's)")
    p.add_argument("--axi-ports", type=arg_type("an integer from 1 to 8", int, lambda v: 1 <= v <= 8),
                   metavar="N", help="weight-streaming AXI ports of 128 bits (what if the NPU had N; the KV260's "
                                     "PS takes up to six: HP0..3, HPC0..1) (default: the preset's)")
    p.add_argument("--no-row-mask", action="store_true",
                   help="the NPU without the GEMV engine's row mask (HardwareConfig.gemv_row_mask): the sparse "
                        "layers' up projection fetches every row, not only those of the gate units the top-k keeps")
    p.add_argument("--gemv-vectors", type=arg_type("an integer from 1 to 4", int, lambda v: 1 <= v <= 4),
                   metavar="V", help="activation vectors of the GEMV engine (HardwareConfig.gemv_vectors): with V > 1 "
                                     "WGEMM runs on it, V tokens a weight stream, and there is no GEMM unit "
                                     "(default: the preset's)")
    for f in fields(Rates):
        requirement, ok = _RATE_RULES.get(f.name, _COST_RULE)
        p.add_argument("--" + f.name.replace("_", "-"), type=arg_type(requirement, float, ok), default=f.default,
                       metavar="X", help=f"{requirement} (default {f.default})")
    args = p.parse_args(argv)
    rates = Rates(**{f.name: getattr(args, f.name) for f in fields(Rates)})
    cfg, hw = ModelConfig.preset(args.model), HardwareConfig.preset(args.hw)
    kv = {"kv_format": args.kv_format, "kv_v_layout": args.kv_v_layout}
    if args.kv_format == "fp16" and not args.kv_v_layout:
        kv["kv_v_layout"] = "planes"                   # the binary16 cache has one layout
    try:
        hw = hw.replace(**{k: v for k, v in kv.items() if v})
    except ValueError as e:
        p.error(f"argument {'--kv-v-layout' if args.kv_v_layout else '--kv-format'}: {e}")
    if args.clock_mhz:
        hw = hw.replace(clock_hz=round(args.clock_mhz * 1e6))
    if args.axi_ports:
        try:
            hw = hw.replace(axi_ports=args.axi_ports)
        except ValueError as e:
            p.error(f"argument --axi-ports: {args.hw} cannot have {args.axi_ports} ports: {e}")
    if args.no_row_mask:
        hw = hw.replace(gemv_row_mask=False)
    if args.gemv_vectors:
        hw = hw.replace(gemv_vectors=args.gemv_vectors, gemv_pairs=hw.gemv_pairs and args.gemv_vectors % 2 == 0)
    try:
        estimates = estimate(cfg, hw, args.positions, rates)
    except (ExecutionError, ValueError) as e:
        p.error(f"argument --positions: {args.model} on {args.hw} cannot run position {max(args.positions)}: {e}")
    prefills = None
    if args.prefill:
        try:
            prefills = prefill(cfg, hw, args.prefill, rates)
        except (ExecutionError, ValueError) as e:
            p.error(f"argument --prefill: {args.model} on {args.hw} cannot run a prompt of {max(args.prefill)} "
                    f"tokens: {e}")
    batches = specs = None
    try:
        if args.streams:
            batches = batched(cfg, hw, args.streams, args.positions, rates)
        if args.speculate is not None:
            specs = speculative(cfg, hw, args.positions, args.speculate, rates)
    except (ExecutionError, ValueError) as e:
        p.error(f"argument --streams/--speculate: {args.model} on {args.hw} cannot run them: {e}")
    if args.json:
        out = to_json(args.model, hw, rates, estimates, prefills)
        out["batched"] = [{"streams": e.streams, "position": e.position, "tok_s": e.tok_s, "cycles": e.cycles,
                           "per_stream_tok_s": e.per_stream_tok_s, "speedup": e.speedup,
                           "program_tokens": e.program_tokens, "program_gemm": e.program_gemm}
                          for e in (batches or [])]
        out["speculative"] = [{"position": e.position, "decode_cycles": e.decode,
                               "verify_cycles": {str(n): c for n, c in e.verify.items()},
                               "best": {str(a): list(e.best(a)) for a in SPEC_ALPHAS}} for e in (specs or [])]
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.model} on {args.hw} (KV cache {hw.kv_format}"
          f"{', V rows' if hw.kv_v_layout == 'rows' else ''}, {hw.axi_ports} weight ports"
          f"{'' if hw.gemv_row_mask else ', no row mask'}"
          f"{f', GEMV engine of {hw.gemv_vectors} vectors' if hw.gemv_vectors > 1 else ''}) at "
          f"{hw.clock_hz / 1e6:.0f} MHz; {rates}")
    units = ("weights", "kv_stream") + PASS_KINDS + ("scalar_alu", "issue")
    print(f"{'position':>8} " + " ".join(f"{u:>10}" for u in units) + f" {'hidden':>10} {'total Mcyc':>10} {'tok/s':>6} "
          f"{'roofline':>8} {'fraction':>8}")
    for e in estimates:
        print(f"{e.position:>8} " + " ".join(f"{e.cycles.get(u, 0) / 1e6:>10.2f}" for u in units) +
              f" {-e.hidden / 1e6:>10.2f} {e.total_cycles / 1e6:>10.2f} {e.tok_s:>6.2f} {e.roofline_tok_s:>8.2f}"
              f" {100 * e.roofline_fraction:>7.1f}%")
        top = sorted(e.by_opcode.items(), key=lambda kv: -kv[1])
        print(" " * 9 + "by instruction: " + ", ".join(f"{k} {100 * v / e.total_cycles:.1f}%" for k, v in top[:6]))
    if prefills:
        _print_prefill(prefills, hw)
    if batches:
        print("\nbatched decode (Runtime.step_many): a step of B streams in programs of up to 'program' streams "
              "(what L2 and the logits rows hold), their projections as WGEMMs where gemm_pays, else WGEMVs per token")
        print(f"{'position':>8} {'streams':>7} {'Mcyc':>8} {'tok/s':>7} {'per stream':>10} {'speed-up':>8} "
              f"{'program':>7} {'WGEMM':>5}")
        for e in batches:
            print(f"{e.position:>8} {e.streams:>7} {e.cycles / 1e6:>8.2f} {e.tok_s:>7.2f} {e.per_stream_tok_s:>10.2f} "
                  f"{e.speedup:>8.2f} {e.program_tokens:>7} {'yes' if e.program_gemm else 'no':>5}")
    if specs:
        print(f"\nspeculative decoding (Runtime.verify): a verify pass of n ids (n - 1 drafts) against one decode "
              f"step; speed-up = expected tokens a pass (1 - a**n) / (1 - a) x decode / verify(n), best n per "
              f"acceptance rate a (passes longer than a program may run are left out)")
        print(f"{'position':>8} {'verify Mcyc by n':<40} " + " ".join(f"{'a=' + str(a):>11}" for a in SPEC_ALPHAS))
        for e in specs:
            v = ", ".join(f"{n}: {c / 1e6:.2f}" for n, c in e.verify.items())
            best = " ".join(f"{'k=' + str(k) + ' ' + format(x, '.2f'):>11}" for k, x in (e.best(a) for a in SPEC_ALPHAS))
            print(f"{e.position:>8} {v:<40} {best}")
    return 0


SPEC_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)


def to_json(model: str, hw: HardwareConfig, rates: Rates, estimates: list[TokenEstimate],
            prefills: list[PrefillEstimate] | None = None) -> dict:
    """The figures of ``python -m firmware.perf --json``: the model, the hardware, the clock and the DDR peak
    and efficiency used, every rate, and per position the tok/s, the cycles per unit and the bytes per token
    (and, if given, the prefill estimates)."""
    return {
        "model": model, "hw": hw.name, "kv_format": hw.kv_format, "kv_v_layout": hw.kv_v_layout,
        "clock_hz": hw.clock_hz, "axi_ports": hw.axi_ports,
        "gemv_row_mask": hw.gemv_row_mask, "gemv_vectors": hw.gemv_vectors,
        "ddr_peak_bytes_per_s": DDR_PEAK_BYTES_PER_S, "ddr_efficiency": rates.ddr_efficiency,
        "port_peak_bytes_per_s": hw.peak_weight_bytes_per_second,
        "stream_bytes_per_s": _stream_rate(hw, rates) * hw.clock_hz,
        "rates": {f.name: getattr(rates, f.name) for f in fields(Rates)},
        "positions": [{
            "position": e.position, "tok_s": e.tok_s, "total_cycles": e.total_cycles, "bytes_per_token": e.bytes_total,
            "roofline_tok_s": e.roofline_tok_s, "roofline_fraction": e.roofline_fraction, "hidden_cycles": e.hidden,
            "cycles": dict(e.cycles), "by_opcode": dict(e.by_opcode)} for e in estimates],
        "prefill": [{
            "tokens": e.tokens, "seconds": e.seconds, "tok_s": e.tok_s, "cycles": e.cycles, "gemm_cycles": e.gemm,
            "rest_cycles": e.rest, "head_cycles": e.head, "array_bound_cycles": e.array_bound,
            "stream_bound_cycles": e.stream_bound, "decode_seconds": e.decode / e.clock_hz,
            "compiled_seconds": e.compiled_seconds, "compiled_cycles": e.compiled,
            "program_tokens": e.program_tokens, "program_gemm": e.program_gemm,
            "mid_position": e.mid_position, "mid_cycles_per_token": e.mid_cycles,
            "mid_by_opcode_per_token": dict(e.mid_by_opcode)}
            for e in (prefills or [])],
    }


def _print_prefill(estimates: list[PrefillEstimate], hw: HardwareConfig) -> None:
    n = estimates[0].projections
    e0 = estimates[0]
    R = hw.gemm_tile
    unit = (f"the GEMV engine of {R} vectors" if hw.gemv_vectors > 1 else
            f"the {R} x {GemmGeometry.of(hw).C2 // 2} array")
    print(f"\nprefill: the compiled prefill programs (firmware.compiler.compile_tokens, as Runtime.prefill runs a "
          f"prompt from position 0, the last program alone computing logits): {e0.program_tokens} token(s) a program "
          f"(what L2 and the staging slots hold), "
          f"projections as {'WGEMMs' if e0.program_gemm else 'WGEMVs per token (a WGEMM of so few tokens is slower)'}"
          f"; 'full tiles' is the estimate with every projection a WGEMM over token tiles of {R} on {unit} (the "
          f"{n} projection matrices of a token; the rest of each token as the decode model costs it), which a "
          f"program of {R} tokens would reach where L2 held them.")
    print(f"{'tokens':>6} {'compiled s':>10} {'tok/s':>7} {'decode s':>9} {'speed-up':>8} | {'full tiles':>10} "
          f"{'WGEMM Mcyc':>10} {'array bnd':>10} {'stream bnd':>10} {'rest Mcyc':>10} {'head Mcyc':>9} {'speed-up':>8}")
    for e in estimates:
        print(f"{e.tokens:>6} {e.compiled_seconds:>10.2f} {e.tokens / e.compiled_seconds:>7.1f} "
              f"{e.decode / e.clock_hz:>9.2f} {e.decode / e.compiled:>8.2f} | {e.seconds:>10.2f} "
              f"{e.gemm / 1e6:>10.1f} {e.array_bound / 1e6:>10.1f} {e.stream_bound / 1e6:>10.1f} "
              f"{e.rest / 1e6:>10.1f} {e.head / 1e6:>9.1f} {e.decode / e.cycles:>8.2f}")
    for e in estimates:
        top = sorted(e.mid_by_opcode.items(), key=lambda kv: -kv[1])
        serial = sum(e.mid_by_opcode.values())
        print(f"  prompt of {e.tokens}: the program at position {e.mid_position}, {e.mid_cycles / 1e6:.2f} Mcycles a "
              f"token ({(serial - e.mid_cycles) / 1e6:.2f} hidden); by instruction: "
              + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in top[:6]) + " Mcycles a token")
    print("  compiled s: the prefill programs' cycles in the decode model's costs; decode s: the same tokens "
          "decoded one by one; array bnd: " + ("the products at the engine's lanes x vectors a cycle"
                                                 if hw.gemv_vectors > 1 else
                                                 "one k-step per cycle (token tiles x row tiles x padded K)") +
          "; stream bnd: the projections' weights once per token tile at the DDR rate")


if __name__ == "__main__":
    sys.exit(main())
