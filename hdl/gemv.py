"""The GEMV engine: INT4 weights streamed from DDR on N AXI4 read ports, W4A8 MACs, exact integer segment
sums, binary16 group scales and in-order binary32 accumulation, bit-identical to `sim.numerics.gemv`.

Dataflow (docs/gemv.md has the full design and the measurements)::

    i_cmd ─▶ CommandDecoder ─▶ per port p (N = axi_ports copies of EnginePort: one AxiReadDma, activation
             and exponent memories and one PartAccumulator (IntScaleMul .. FpAdd), used by GemvPort or
             SparsePort by mode); GemvPort (dense):
                 tile sequencer ─▶ AxiReadDma ─▶ front end: scale beats ─▶ scale bank
                                              weight beats ─▶ SegmentMac ─▶ isum bank [t, s]
                 back end: isum bank, scale bank, exponents (s-major, t-minor order)
                     ─▶ IntScaleMul ─▶ FpLdexp ─▶ FpAdd (y[t] += part) ─▶ result FIFO
           ─▶ merge in row order ─▶ FpAdd (accm: old + y; else -0 + y) ─▶ o_y

- **Rows over ports.** Rows are cut into tiles of `tile_rows` (T) consecutive rows; tile j goes to port
  ``j mod N``. A port fetches, per tile, its T rows' scales (one contiguous transfer, ``T * groups * 2``
  bytes, since scales are row-major) and then the rows in chunks of one burst (16 beats), round-robin
  over the tile's rows: chunk 0 of rows 0..T-1, chunk 1 of rows 0..T-1, ... The DMA realigns every
  transfer, so each row starts at lane 0 whatever its DDR alignment.
- **Integer side.** One beat (``W = weights_per_beat`` INT4 weights) per port per cycle is multiplied
  with the W INT8 activations of the same columns (a per-port copy of the activation memory), masked past
  the row's end, and summed exactly; a segment (``min(group, act_block)`` columns) is ``seg / W`` beats
  (its sums are accumulated) or, when narrower than a beat, one of ``W / seg`` sub-sums (the beat is then
  presented ``W / seg`` times). Each segment sum is written to the tile's isum bank at ``[t, s]``. With
  ``gemv_interleave`` a round reorder memory a port turns each chunk round around: its beats reach the MACs
  beat-major (beat k of every row of the tile, then beat k + 1), one activation word for consecutive cycles.
- **Binary32 side.** The contract adds the parts of a row strictly in segment order, and an adder has
  a latency of several cycles, so the back end walks a complete tile *segment-major*: ``(s, t)`` for t in
  0..T-1, so that consecutive additions into the same row are T cycles apart (T > FpAdd latency + 1). It starts
  on a tile as soon as the first chunk round is in and follows the rounds, so a tile ends one round
  (T * 16 beats) after its last beat arrives. Banks are double-buffered: the front end fills tile k+1 while
  the back end drains tile k. The back end issues one
  part per cycle; the front end produces ``T * ceil(cols / seg)`` parts in ``T * ceil(cols / W)`` cycles, so
  the binary32 side is never the bottleneck when ``seg >= W``.
- **INT8 weights** (an engine with ``gemv_int8``, the command's `int8`): the same dense datapath with a beat
  of B = W/2 signed bytes, half an activation word (the lane mask takes the half), rows `pitch` bytes apart;
  each lane's multiplier takes an 8-bit weight operand (`SegmentMac`).
- **accm** is one more binary32 addition at the output, ``fp32(old + y)`` with the old values streamed in
  through `i_acc` in row order (without accm the same adder computes ``-0 + y``, which is ``y`` exactly).

- **Sparse mode** (``sparse``: column-major matrices, group-major scales; `SparsePort`, one per AXI port,
  which takes the port's DMA and activation/exponent memories while a sparse command runs): rows are split over the ports in whole
  beats; each port scans the activations, fetches only the columns whose INT8 activation is non-zero (one
  contiguous transfer per column and port) and accumulates ``w[r, k] * a[k]`` into per-row segment sums; every
  segment, empty or not, is then added to the per-row binary32 sums in segment order, so the result is
  bit-identical to `sim.numerics.gemv` including the signs of zero results. Rows per segment bound it: one
  part per binary32 pipeline and cycle, `gemv_parts` pipelines a port (each takes every P-th row).
"""

from __future__ import annotations

from types import SimpleNamespace

from amaranth import Array, Cat, Const, Module, Mux, Signal, Value, signed, unsigned
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from . import config
from .axi import AxiReadDma, AxiReadSignature, read_command_layout, read_data_layout
from .config import HardwareConfig, ceil_log2, segment_sum_bits
from .dsp import DspMacc, DspPairMul
from .fp import INT_SCALE_MAX_BITS, NEG_ZERO, FpAdd, FpLdexp, IntScaleMul, check_int_scale_bits, rejecting
from .l2 import one_hot_mux
from .rowmask import MASK_LANES, RowGather, mask_layout

__all__ = ["EXP_BITS", "command_layout", "gemv_parts", "SegmentMac", "CommandDecoder", "PartAccumulator",
           "GemvPort", "SparsePort", "EnginePort", "GemvEngine"]

EXP_BITS = 10          # activation block exponents: binary32 inputs give -155..122
LEN_BITS = 24          # DMA command byte counts



def _activation_memories(m, port, cfg: HardwareConfig, max_cols: int):
    """A port's copies of the INT8 activations (one beat's lanes per word) and of their block exponents, one
    pair per activation vector (``gemv_vectors``), written through the port's ``i_act_*`` / ``i_exp_*`` inputs
    (``i_act_vec`` / ``i_exp_vec``: which vector); returns their read ports, a list of V each."""
    W, V = cfg.weights_per_beat, cfg.gemv_vectors
    act_rs, exp_rs = [], []
    for v in range(V):
        vn = f"_{v}" if V > 1 else ""
        act_mem = Memory(shape=data.ArrayLayout(signed(cfg.act_bits), W), depth=max_cols // W, init=[])
        exp_mem = Memory(shape=signed(EXP_BITS), depth=_exp_depth(cfg, max_cols), init=[])
        m.submodules[f"act_mem{vn}"], m.submodules[f"exp_mem{vn}"] = act_mem, exp_mem
        act_w, exp_w = act_mem.write_port(), exp_mem.write_port()
        act_on = port.i_act_en & (port.i_act_vec == v) if V > 1 else port.i_act_en
        exp_on = port.i_exp_en & (port.i_exp_vec == v) if V > 1 else port.i_exp_en
        m.d.comb += [act_w.en.eq(act_on), act_w.addr.eq(port.i_act_addr), act_w.data.eq(port.i_act_q),
                     exp_w.en.eq(exp_on), exp_w.addr.eq(port.i_exp_addr), exp_w.data.eq(port.i_exp_e)]
        act_rs.append(act_mem.read_port())
        exp_rs.append(exp_mem.read_port())
    return act_rs, exp_rs


def _times(x: Value, c: int) -> Value:
    """``x * c`` for a constant ``c >= 0`` as a sum of shifted copies of `x` (one adder for a port index of
    3): Yosys maps a product by a constant that is not a power of two to a DSP48E2 without registers."""
    terms = [x << i for i in range(c.bit_length()) if (c >> i) & 1]
    if not terms:
        return Const(0, 1)
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def _two_entry_buffer(m, width: int, name: str):
    """A two-entry FIFO (`fifo.SyncFIFO` of depth 2, cycle for cycle) whose ``w_rdy`` and ``r_rdy`` are
    registers: the head (``r_data``) and a second entry behind it, written only while the head is held."""
    b = type("Buffer", (), {})()
    b.w_en, b.w_data, b.r_en = Signal(name=f"{name}_w_en"), Signal(width, name=f"{name}_w_data"), \
        Signal(name=f"{name}_r_en")
    b.r_rdy, b.r_data = Signal(name=f"{name}_r_rdy"), Signal(width, name=f"{name}_r_data")
    t_valid, t_data = Signal(name=f"{name}_t_valid"), Signal(width, name=f"{name}_t_data")
    b.w_rdy = ~t_valid
    do_w, do_r = b.w_en & ~t_valid, b.r_en & b.r_rdy
    # the data registers take their input whenever they may (an empty entry's data is not looked at), so that
    # only the flags depend on the handshakes
    with m.If(~t_valid):
        m.d.sync += t_data.eq(b.w_data)
    with m.If(do_r | ~b.r_rdy):
        m.d.sync += b.r_data.eq(Mux(t_valid, t_data, b.w_data))
    with m.If(do_r):
        m.d.sync += [b.r_rdy.eq(t_valid | do_w), t_valid.eq(0)]
    with m.Elif(do_w):
        with m.If(b.r_rdy):
            m.d.sync += t_valid.eq(1)
        with m.Else():
            m.d.sync += b.r_rdy.eq(1)
    return b


#: Scale banks (groups in flight) and isum banks (segments in flight) of the sparse datapath (`SparsePort`): the
#: front end runs up to three segments (groups) ahead of the back end, so that a segment's random count of
#: non-zero columns stays off the back end where the two take about as long a segment (kv260: about 474 against
#: 512 cycles at 5 % density, a group being a segment).
SPARSE_BANKS = 4


def _dense_scale_words(cfg: HardwareConfig, max_segments: int, tile_rows: int) -> int:
    """Words of one scale bank (beat-wide words of binary16 scales) of the dense datapath: T rows of
    ``ceil(S / hpw)`` words. Both datapaths address one memory (`EnginePort`, `_scale_memory_words`): bank b of a
    datapath of ``n`` words a bank starts at word ``b * n``, ``n`` a power of two."""
    return max(1, tile_rows * -(-max_segments // (cfg.bytes_per_beat // 2)))


def _sparse_scale_words(cfg: HardwareConfig) -> int:
    """Words of one scale bank of the sparse datapath: a word per ``hpw`` rows of the port's share."""
    return max(1, cfg.gemv_sparse_max_rows // cfg.axi_ports // (cfg.bytes_per_beat // 2))


def _scale_memory_words(cfg: HardwareConfig, max_segments: int, tile_rows: int) -> int:
    """Words of a port's scale memory: the dense datapath's two banks or the sparse one's `SPARSE_BANKS`,
    whichever is larger (kv260: 256 x 128 bits either way)."""
    return max(2 * _dense_scale_words(cfg, max_segments, tile_rows), SPARSE_BANKS * _sparse_scale_words(cfg))


def _exp_depth(cfg: HardwareConfig, max_cols: int) -> int:
    """Words of the exponent memory: one per activation block."""
    return max(1, max_cols // cfg.act_block)


def gemv_parts(cfg: HardwareConfig) -> int:
    """Binary32 pipelines (`PartAccumulator`s) per port: as many as keep every vector of a command to the weight
    stream's rate, a pipeline taking one part a cycle and a segment (``min(weight_group, act_block)`` columns)
    taking ``seg / W`` beats, so ``ceil(V / (seg / W))``; at most one per two vectors (tiny's segment is one
    beat: two pipelines for four vectors, half the rate). kv260 (segments of four beats): one for four vectors."""
    W, V = cfg.weights_per_beat, cfg.gemv_vectors
    seg_beats = max(1, min(cfg.weight_group or cfg.act_block, cfg.act_block) // W)
    return -(-V // max(2, seg_beats))


def command_layout(cfg: HardwareConfig) -> data.StructLayout:
    """One GEMV: ``y[rows] = W[rows, cols] x`` with W's INT4 bytes at `wbase` (row-major, rows of
    ``ceil(cols/2)`` bytes) and its binary16 scales at `sbase` (row-major ``[rows, ceil(cols/group)]``),
    ``group = 2**log2_group``. `accm` adds the result to the values streamed in on ``i_acc``. `sparse`: W is
    column-major (column k = ``rows/2`` bytes at ``wbase + k*rows/2``, rows 2i / 2i+1 in the low / high nibble;
    rows even, at most ``gemv_sparse_max_rows``), its scales group-major ``[ceil(cols/group), rows]`` at
    `sbase`, and the columns of zero activations are never fetched. `mask` (an engine with ``gemv_row_mask``):
    only the rows the row mask written before the command marks live are fetched; the others read +0. `vecs`
    (an engine with ``gemv_vectors`` V > 1): the command multiplies W with ``vecs + 1`` activation vectors,
    reading W once; its results (and accm's old values) come tile by tile (``tile_rows`` rows, the ports' unit),
    each tile's rows for vector 0, then for vector 1, ... Neither sparse nor masked commands take more than one
    vector. `int8` (an engine with ``gemv_int8``): W holds INT8 weights, ``W[r, k]`` the signed byte at
    ``wbase + r*pitch + k`` (`pitch`: bytes from one row's start to the next, any byte address), scales as in
    dense mode, any number of vectors; it runs on the dense datapath at one beat (B INT8 weights) a port a cycle,
    and is rejected (`CommandDecoder`'s `o_bad`) when also sparse or masked."""
    fields = {
        "wbase": unsigned(cfg.axi_addr_bits), "sbase": unsigned(cfg.axi_addr_bits),
        "rows": unsigned(20), "cols": unsigned(16), "log2_group": unsigned(5), "accm": 1, "sparse": 1,
    }
    if cfg.gemv_row_mask:
        fields["mask"] = 1
    if cfg.gemv_vectors > 1:
        fields["vecs"] = range(cfg.gemv_vectors)
    if cfg.gemv_int8:
        fields["int8"] = 1
        fields["pitch"] = unsigned(24)
    return data.StructLayout(fields)


class SegmentMac(wiring.Component):
    """W INT4 x INT8 products of one beat with each of V activation vectors, masked, summed exactly and
    accumulated over a segment; built with `int8`, each lane's weight is INT4 or INT8 by ``i_int8``.

    Each input cycle presents one beat: ``i_w`` (W INT4 weights, lane 0 = bits [3:0], the packing order of
    `sim.numerics.pack_int4`), ``i_a[v]`` (vector v's W activations), and which lanes count: lane i contributes
    when ``i < i_nlanes`` and ``i_sel * 2**i_lvl <= i < (i_sel + 1) * 2**i_lvl`` (a sub-sum narrower than a
    beat). The sums start a new segment on ``i_first`` and the segment's exact sums (``o_isum[v]``, one per
    vector) leave on ``o_valid`` when the input had ``i_last``; ``i_tag`` travels along with them. No
    backpressure: a free-running pipeline. Every vector has its own multipliers (a DSP48E2 per lane; but see
    ``pairs``) and adder tree; the lane mask and the control are shared.

    INT8 weights (``i_int8``, an engine with ``gemv_int8``): the beat's B = W/2 bytes are B signed INT8 weights,
    and lane i takes byte ``i mod B`` (a 2:1 select in front of the multiplier's weight register, shared by the
    vectors), so the beat meets either half of the activation word: the half the lane mask selects (``i_sel``
    and ``i_lvl`` as above, ``i_lvl <= log2 B``). Products reach 2**14 and the adder tree is 4 bits wider.

    Vector pairs (``pairs``, V even): vectors 2p and 2p + 1 share a DSP48E2 per lane (`DspPairMul`: the lane's
    weight times ``a[2p] + a[2p + 1]·2**PAIR_SHIFT``), and lane 2j + 1's slice adds lane 2j's product through
    the P cascade (its operands a cycle later), so one adder tree of W/2 packed words sums the pair's beat.
    The activations are the quantiser's, in [-127, 127] (`sim.numerics.quantize_activations`; -128 would
    overflow the pre-adder), so both fields stay exact: a beat's sum of one vector's products is below 2**18 in
    magnitude (32 INT4 products at most 32·8·127; at most B = 16 INT8 ones, since ``i_lvl <= log2 B``, at most
    16·128·127), which the low 19 bits hold; the high field is the rest of the word plus the low field's
    borrow (its sign bit). Half the DSP48E2s and half the adder trees, two cycles more (`latency`).

    Rows (``rows`` R > 1, the dense datapath with ``gemv_interleave``): the beats of R rows' segments arrive
    interleaved, and each vector keeps R segment sums, one per row: ``i_row`` picks the sum a beat adds to,
    ``i_first`` restarts that row's sum and ``i_last`` sends it out. A beat's row may change every cycle, and
    the same row may come back in the next cycle (the sums are registers, read and written in one cycle).

    Parameters
    ----------
    cfg : HardwareConfig
    tag_bits : int
    vectors : int, optional
        V, the activation vectors (default 1).
    int8 : bool, optional
        Build the INT8 weight operand and ``i_int8`` (default False).
    pairs : bool, optional
        Two vectors a DSP48E2 and an adder tree a pair of vectors (V even; default False).
    rows : int, optional
        R, the rows whose segment sums are kept apart (default 1).

    Members
    -------
    i_valid, i_first, i_last : In(1)
    i_w : In(ArrayLayout(signed(4), W)); i_a : In(ArrayLayout(ArrayLayout(signed(act_bits), W), V))
    i_nlanes : In(range(W + 1)); i_lvl : In(range(log2 W + 1)); i_sel : In(range(W))
    i_tag : In(tag_bits)
    i_int8 : In(1) (with `int8`): the beat is W/2 INT8 weights
    i_row : In(range(R)) (with R > 1): the row whose segment sum the beat adds to
    o_valid : Out(1); o_isum : Out(ArrayLayout(signed(acc_bits), V)); o_tag : Out(tag_bits)
    """

    PAIR_SHIFT = config.GEMV_PAIR_SHIFT     # where the odd vector's field starts in a pair's word

    def __init__(self, cfg: HardwareConfig, tag_bits: int = 1, vectors: int = 1, int8: bool = False,
                 pairs: bool = False, rows: int = 1):
        with rejecting(self):
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
                raise ValueError(f"SegmentMac rows must be a positive integer, not {rows!r}")
            if pairs:
                problem = "an even number of vectors" if vectors % 2 else config.gemv_pair_problem(cfg, int8)
                if problem:
                    raise ValueError(f"SegmentMac pairs need {problem}: {vectors} vectors of {cfg.act_bits} bits, "
                                     f"{cfg.weights_per_beat} lanes")
        self._cfg, self._V, self._int8, self._pairs, self._rows = cfg, vectors, int8, bool(pairs), rows
        W = cfg.weights_per_beat
        self._W = W
        super().__init__({
            "i_valid": In(1), "i_first": In(1), "i_last": In(1),
            "i_w": In(data.ArrayLayout(signed(cfg.WEIGHT_BITS), W)),
            "i_a": In(data.ArrayLayout(data.ArrayLayout(signed(cfg.act_bits), W), vectors)),
            "i_nlanes": In(range(W + 1)), "i_lvl": In(range(ceil_log2(W) + 1)), "i_sel": In(range(W)),
            "i_tag": In(tag_bits),
            **({"i_int8": In(1)} if int8 else {}),
            **({"i_row": In(range(rows))} if rows > 1 else {}),
            "o_valid": Out(1), "o_isum": Out(data.ArrayLayout(signed(cfg.acc_bits), vectors)),
            "o_tag": Out(tag_bits),
        })

    @property
    def tree_stages(self) -> int:
        """Register stages of the adder tree: one after every two levels, and after the last (one leaf: one).
        Its leaves are the W products, or with ``pairs`` the W/2 packed lane pairs."""
        return max(1, (ceil_log2(self._W // 2 if self._pairs else self._W) + 1) // 2)

    @property
    def latency(self) -> int:
        """Cycles from an input with ``i_last`` to its ``o_valid``: the products (3; with ``pairs`` the lane
        pairs' sums, `DspPairMul.LATENCY` + 1, and the fields' separation, 1), the tree, the segment's sum."""
        return (DspPairMul.LATENCY + 2 if self._pairs else 3) + self.tree_stages + 1

    def elaborate(self, platform):
        m = Module()
        cfg, W, V = self._cfg, self._W, self._V
        wbits = 8 if self._int8 else cfg.WEIGHT_BITS
        pbits = wbits + cfg.act_bits
        # Stage 0: the beat and the activations (a memory's unregistered output upstream) in the A and B
        # registers of a DSP48E2 per lane and vector (`DspMacc` without P), and the lane mask's two conditions
        # registered: lane i counts when i < i_nlanes and i >> i_lvl == i_sel (the sub-sum i_sel of width
        # 2**i_lvl). Stage 1: the products in the M registers; the lane mask. Stage 2: the masked products (the
        # mask resets the product register).
        below0 = Signal(W, name="below_0")
        sub0 = Signal(W, name="sub_0")
        take1 = Signal(W, name="take_1")
        sub = Signal(W)                             # the lanes of sub-sum i_sel
        with m.Switch(self.i_lvl):
            for lvl in range(ceil_log2(W) + 1):
                with m.Case(lvl):
                    m.d.comb += sub.eq(Cat(self.i_sel == (i >> lvl) for i in range(W)))
        m.d.sync += [below0.eq(Cat(i < self.i_nlanes for i in range(W))), sub0.eq(sub), take1.eq(below0 & sub0)]
        ctrl = Cat(self.i_valid, self.i_first, self.i_last, self.i_tag)
        if self._rows > 1:
            ctrl = Cat(ctrl, self.i_row)
        c = _delay(m, ctrl, DspPairMul.LATENCY + 2 if self._pairs else 3, "ctrl")
        totals = []
        if self._int8:
            # lane i's weight: nibble i sign-extended, or byte i mod B of the beat
            wv, B = self.i_w.as_value(), W // 2
            weights = []
            for i in range(W):
                wi = Signal(signed(8), name=f"weight_{i}")
                m.d.comb += wi.eq(Mux(self.i_int8, wv[8 * (i % B):8 * (i % B) + 8].as_signed(), self.i_w[i]))
                weights.append(wi)
        else:
            weights = [self.i_w[i] for i in range(W)]
        if self._pairs:
            for p in range(V // 2):
                totals += self._pair(m, p, weights, wbits, take1)
        for v in range(0 if self._pairs else V):
            vn = f"v{v}_" if V > 1 else ""
            prods = []
            for i in range(W):
                m.submodules[f"{vn}mul{i}"] = mul = DspMacc(cfg.act_bits, wbits, preg=False)
                m.d.comb += [mul.i_a.eq(self.i_a[v][i]), mul.i_b.eq(weights[i]), mul.i_restart.eq(0)]
                p = Signal(signed(pbits), name=f"{vn}prod_{i}")
                m.d.sync += p.eq(Mux(take1[i], mul.o_p[:pbits], 0))
                prods.append(p)
            totals.append(self._tree(m, prods, pbits, vn))
        c = _delay(m, c, self.tree_stages, "ctrl_t")
        R = self._rows
        valid, first, last, tag = c[0], c[1], c[2], c[3:3 + len(self.i_tag)]
        row = c[3 + len(self.i_tag):] if R > 1 else None
        # Segment accumulation, per vector (and per row: R sums, the beat's row read and written).
        for v, total in enumerate(totals):
            vn = f"v{v}_" if V > 1 else ""
            accs = [Signal(signed(cfg.acc_bits), name=f"{vn}acc_{r}" if R > 1 else f"{vn}acc") for r in range(R)]
            nxt = Signal(signed(cfg.acc_bits), name=f"{vn}acc_next")
            m.d.comb += nxt.eq(Mux(first, 0, Array(accs)[row] if R > 1 else accs[0]) + total)
            for r, acc in enumerate(accs):
                with m.If(valid & (row == r) if R > 1 else valid):
                    m.d.sync += acc.eq(nxt)
            m.d.sync += self.o_isum[v].eq(nxt)
        m.d.sync += [self.o_valid.eq(valid & last), self.o_tag.eq(tag)]
        return m

    def _pair(self, m, p, weights, wbits, take1):
        """Vectors 2p and 2p + 1: a `DspPairMul` per lane, lane 2j + 1's adding lane 2j's through the P cascade
        (its operands and mask a cycle later), the tree over the W/2 pair words, then the two fields apart,
        registered: (sum of vector 2p, sum of vector 2p + 1), each `latency` - 1 cycles after the beat."""
        cfg, W, S = self._cfg, self._W, self.PAIR_SHIFT
        pbits = wbits + cfg.act_bits
        pn = f"p{p}_"
        take2 = Signal(W, name=f"{pn}take_2")
        m.d.sync += take2.eq(take1)
        leaves = []
        for j in range(W // 2):
            lo_in, hi_in, w_in = self.i_a[2 * p][2 * j + 1], self.i_a[2 * p + 1][2 * j + 1], weights[2 * j + 1]
            late = [Signal(signed(len(x)), name=f"{pn}late_{j}_{k}") for k, x in enumerate((lo_in, hi_in, w_in))]
            m.d.sync += [r.eq(x) for r, x in zip(late, (lo_in, hi_in, w_in))]
            m.submodules[f"{pn}mul{2 * j}"] = low = DspPairMul(cfg.act_bits, wbits, shift=S)
            m.submodules[f"{pn}mul{2 * j + 1}"] = up = DspPairMul(cfg.act_bits, wbits, shift=S, pcin=True)
            m.d.comb += [low.i_lo.eq(self.i_a[2 * p][2 * j]), low.i_hi.eq(self.i_a[2 * p + 1][2 * j]),
                         low.i_b.eq(weights[2 * j]), low.i_keep.eq(take1[2 * j]),
                         up.i_lo.eq(late[0]), up.i_hi.eq(late[1]), up.i_b.eq(late[2]),
                         up.i_keep.eq(take2[2 * j + 1]), up.i_pcin.eq(low.o_pcout)]
            leaves.append(up.o_p[:S + pbits + 1].as_signed())     # both fields below 2**pbits
        total = self._tree(m, leaves, S + pbits + 1, pn)
        # the low field: its 19 bits, signed; when negative, the high field lent it one
        lo, hi = Signal(signed(cfg.acc_bits), name=f"{pn}sum_lo"), Signal(signed(cfg.acc_bits), name=f"{pn}sum_hi")
        m.d.sync += [lo.eq(total[:S].as_signed()), hi.eq(total[S:].as_signed() + total[S - 1])]
        return [lo, hi]

    def _tree(self, m, level, width, vn):
        """The exact sum of `level` (signed, `width` bits): a pipelined adder tree with a register after every
        two levels and after the last (`tree_stages` registers)."""
        depth = 0
        while len(level) > 1:
            width += 1
            nxt = []
            for k in range(0, len(level), 2):
                s = Signal(signed(width), name=f"{vn}sum_{depth}_{k // 2}")
                pair = level[k:k + 2]
                expr = pair[0] + pair[1] if len(pair) == 2 else pair[0]
                if depth % 2:
                    m.d.sync += s.eq(expr)
                else:
                    m.d.comb += s.eq(expr)
                nxt.append(s)
            level = nxt
            depth += 1
        total = level[0]
        if depth % 2 or depth == 0:                 # an odd number of levels (or none): register the last
            t2 = Signal(signed(width), name=f"{vn}sum_out")
            m.d.sync += t2.eq(total)
            total = t2
        return total


def max_row_beats(cfg: HardwareConfig, max_cols: int) -> int:
    """The most beats of one row: ``max_cols`` INT4 weights, or INT8 ones (B a beat) with ``gemv_int8``."""
    return max_cols // (cfg.bytes_per_beat if cfg.gemv_int8 else cfg.weights_per_beat)


def decoded_shapes(cfg: HardwareConfig, max_cols: int, max_segments: int) -> dict:
    """The decoded command: every quantity the ports derive from it (`CommandDecoder`'s outputs). With
    ``gemv_int8``, `rstride` is the bytes from one row's start to the next (the int8 command's `pitch`, else
    `rowbytes`)."""
    W = cfg.weights_per_beat
    return {
        "cmd": command_layout(cfg),
        "lseg": range(32),                 # log2 segment
        "lvl": range(ceil_log2(W) + 1),        # log2 of the sub-sum width: min(lseg, log2 W)
        "subs": range(W + 1),              # sub-sums per beat (W >> lvl)
        "lspb": range(32),                 # log2 beats per segment: max(lseg - log2 W, 0)
        "nseg": range(max_segments + 1),   # segments per row
        "groups": range(max_segments + 1), # scale groups per row
        "gshift": range(32),               # segment index -> group index shift
        "eshift": range(32),               # segment index -> activation block shift
        "rowbytes": unsigned(16),
        **({"rstride": unsigned(24)} if cfg.gemv_int8 else {}),
        "nwb": range(max_row_beats(cfg, max_cols) + 2),   # beats per row
        "prow": unsigned(21),              # sparse: rows per port, a multiple of W
        "nvec": range(1, cfg.gemv_vectors + 1),    # activation vectors (vecs + 1)
        "outs": unsigned(23),              # results: rows x nvec
        "bad": 1,
    }


class CommandDecoder(wiring.Component):
    """Derives, in two registered steps, every quantity the ports need from a command, and validates it. The
    first registers the command (`o_cmd`), its segment size, the rounded-up sums the segment and group counts
    divide and the checks that need no count (a flag for each group of them); the second the rest.

    Members
    -------
    i_cmd : In(command_layout) (a plain value, sampled when `i_load` is high)
    i_load : In(1)
    o_* : the decoded fields, all valid from the second cycle after `i_load` (`o_cmd` from the first);
        `o_bad` when the command cannot run: rows or cols 0, cols above `max_cols`, more segments or groups
        per row than `max_segments`, a `sparse` command with an odd number of rows or more than `max_rows`
        (``gemv_sparse_max_rows``), a `sparse` or `mask` command with more than one vector, or an `int8`
        command (with ``gemv_int8``) that is `sparse` or `mask` (INT8 weights run on the dense datapath only).
    o_good : Out(1)
        Combinational, in the cycle after `i_load` (the second step): the command is good (`o_bad` low from
        the next cycle on), for a start pulse registered beside `o_bad`.

    An `int8` command's row is `cols` bytes (`o_rowbytes`), its beats hold B = W/2 weights (`o_nwb`, and
    `o_lvl`, `o_subs`, `o_lspb` against B instead of W) and its rows are `pitch` bytes apart (`o_rstride`).
    """

    def __init__(self, cfg: HardwareConfig, max_cols: int, max_segments: int, max_rows: int | None = None):
        self._cfg, self._max_cols, self._max_segments = cfg, max_cols, max_segments
        self._max_rows = cfg.gemv_sparse_max_rows if max_rows is None else max_rows
        super().__init__({"i_cmd": In(command_layout(cfg)), "i_load": In(1),
                          **{f"o_{k}": Out(v) for k, v in decoded_shapes(cfg, max_cols, max_segments).items()},
                          "o_good": Out(1)})

    def elaborate(self, platform):
        m = Module()
        cfg = self._cfg
        W, B = cfg.weights_per_beat, cfg.bytes_per_beat
        lW, lblk = ceil_log2(W), ceil_log2(cfg.act_block)
        # Step 1: the command, its segment size, the sums the counts divide (cols + segment - 1, at most
        # 2**16 - 2 + act_block; cols + group - 1, in -1..2**17 - 2: -1 for cols 0 with a group beyond 16
        # bits) and the checks that need no count. Sparse (column-major) matrices: an even number of rows (a
        # column is rows/2 whole bytes), at most the rows the ports' per-row memories hold.
        i = self.i_cmd
        i_lseg = Mux(i.log2_group < lblk, i.log2_group, lblk)
        c = self.o_cmd
        lseg = Signal(range(32))
        nsum, gsum = Signal(range((1 << 16) + (1 << lblk))), Signal(signed(18))
        bad1 = Signal(5)                             # the checks that need no count, a flag each group
        # the segment bound: nseg = nsum >> lseg exceeds max_segments when nsum >= (max_segments + 1) << lseg
        seg_lim = Signal(range(((self._max_segments + 1) << lblk) + 1))
        load2 = Signal()
        m.d.sync += load2.eq(self.i_load)
        outs1 = Signal(22)
        if cfg.gemv_vectors > 1:
            with m.If(self.i_load):
                m.d.sync += outs1.eq(i.rows + Mux(i.vecs[0], i.rows, 0))
        with m.If(self.i_load):
            m.d.sync += [
                c.eq(i), lseg.eq(i_lseg), seg_lim.eq(Const(self._max_segments + 1) << i_lseg),
                nsum.eq(i.cols + (Const(1, 17) << i_lseg) - 1),
                gsum.eq(i.cols + (Const(1, 32) << i.log2_group)[:17] - 1),
                bad1.eq(Cat(
                    (i.rows == 0) | (i.cols == 0) | (i.log2_group > 16),
                    i.cols > self._max_cols,
                    i.sparse & (i.rows[0] | (i.rows > self._max_rows)),
                    (i.mask & (i.sparse | (i.rows > cfg.gemv_max_cols))) if cfg.gemv_row_mask else 0,
                    (((i.vecs != 0) & (i.sparse | (i.mask if cfg.gemv_row_mask else 0)))
                     if cfg.gemv_vectors > 1 else 0) |
                    ((i.int8 & (i.sparse | (i.mask if cfg.gemv_row_mask else 0))) if cfg.gemv_int8 else 0))),
            ]
        # Step 2: the counts and the fields derived from the registered command.
        lg = c.log2_group
        nseg = Signal(17)
        groups = Signal(17)
        rowbytes = Signal(16)
        m.d.comb += [
            nseg.eq(nsum >> lseg),
            groups.eq(gsum >> lg),
            rowbytes.eq(Mux(c.int8, c.cols, (c.cols + 1) >> 1) if cfg.gemv_int8 else (c.cols + 1) >> 1),
        ]
        bad = bad1.any() | (nsum >= seg_lim)
        m.d.comb += self.o_good.eq(~bad)
        nvec = c.vecs + 1 if cfg.gemv_vectors > 1 else Const(1)
        # rows x nvec (vecs < 4) as two shifted adds, the first in step 1 (`outs1`: rows + (vecs[0] ? rows : 0)),
        # the second here (+ (vecs[1] ? 2 rows : 0)): no multiplier on either step's path
        outs2 = Mux(c.vecs[1], c.rows << 1, 0) if cfg.gemv_vectors > 2 else 0
        lNW = ceil_log2(cfg.axi_ports * W)
        lvl = Mux(lseg < lW, lseg, lW)
        subs, lspb = W >> Mux(lseg < lW, lseg, lW), Mux(lseg > lW, lseg - lW, 0)
        if cfg.gemv_int8:
            # INT8 weights: a beat is B = W/2 of them, so the sub-sums and beats per segment count against B
            lB = lW - 1
            lvl = Mux(c.int8, Mux(lseg < lB, lseg, lB), lvl)
            subs, lspb = Mux(c.int8, B >> lvl, W >> lvl), Mux(c.int8, Mux(lseg > lB, lseg - lB, 0), lspb)
            with m.If(load2):
                m.d.sync += self.o_rstride.eq(Mux(c.int8, c.pitch, rowbytes))
        with m.If(load2):
            m.d.sync += [
                self.o_lseg.eq(lseg),
                self.o_lvl.eq(lvl), self.o_subs.eq(subs), self.o_lspb.eq(lspb),
                self.o_nseg.eq(nseg), self.o_groups.eq(groups),
                self.o_gshift.eq(lg - lseg), self.o_eshift.eq(lblk - lseg),
                self.o_rowbytes.eq(rowbytes), self.o_nwb.eq((rowbytes + B - 1) >> ceil_log2(B)),
                self.o_prow.eq(((c.rows + (1 << lNW) - 1) >> lNW) << lW),
                self.o_nvec.eq(nvec), self.o_outs.eq(outs1 + outs2),
                self.o_bad.eq(bad),
            ]
        return m


def _delay(m, value, n, name):
    """`value` delayed by `n` register stages."""
    for k in range(n):
        r = Signal(len(value), name=f"{name}_d{k}")
        m.d.sync += r.eq(value)
        value = r
    return value


def _check_segment_sums(cfg: HardwareConfig) -> None:
    """Prove that ``fp32(isum)`` is exact for every segment sum the engine forms (`cfg.segment_sum_bits` wide).

    A segment is ``min(group, act_block)`` columns (`CommandDecoder`: ``lseg = min(log2_group,
    log2(act_block))``; the sparse back end cuts its per-row sums at the same ``lseg`` boundaries), so at
    most ``act_block`` products, each at most ``8 * 2**(act_bits - 1)`` in magnitude (INT4 -8 times INT8
    -128): ``|isum| <= act_block * 2**(act_bits + 2)`` (kv260: 128 * 1024 = 2**17, 19 bits; tiny: 2**14, 16
    bits; as the systolic field); with ``gemv_int8`` INT8 x INT8 products, ``act_block * 2**(act_bits + 6)``
    (kv260: 23 bits). `IntScaleMul` needs every value of that width exact in binary32 (at most 25
    bits); a config beyond that raises ValueError."""
    bits = cfg.segment_sum_bits
    wb = cfg.segment_sum_weight_bits
    bound = config.segment_sum_bound(cfg.act_block, cfg.act_bits, wb)
    if bits > INT_SCALE_MAX_BITS or bits > cfg.acc_bits:
        raise ValueError(f"GEMV segment sums reach {bound} (act_block {cfg.act_block} x INT{wb} x INT{cfg.act_bits}), "
                         f"{bits} signed bits: they must fit {min(INT_SCALE_MAX_BITS, cfg.acc_bits)} bits (exact in "
                         f"binary32 and in acc_bits) for the fused scale product")


class PartAccumulator(wiring.Component):
    """The binary32 side of one port, shared by its dense and sparse back ends: ``part = ldexp(fp32(isum) *
    fp32(scale), e)`` (`IntScaleMul`, `FpLdexp`: the contract's single rounding in the product, one exact
    integer multiply, since ``|isum|`` is bounded by `HardwareConfig.segment_sum_bits`; the ldexp exact but for
    subnormal results) and ``sum = y + part`` (`FpAdd`). A free-running pipeline (no backpressure, always
    enabled).

    Parameters
    ----------
    cfg : HardwareConfig
    isum_bits : int, optional
        Signed width of the isums it takes (the low bits of ``i_isum``, which keeps the ``acc_bits`` width):
        by default 25, every ``|isum| <= 2**24`` (the numerics contract's exact range); `EnginePort` passes
        `HardwareConfig.segment_sum_bits` (kv260: 23), which bounds every sum its back ends produce and narrows
        the multiplier, the leading-zero count and the shifter.

    Members
    -------
    i_valid : In(1); i_isum : In(signed(acc_bits)); i_scale : In(16) (binary16); i_exp : In(signed(EXP_BITS))
        One part's inputs.
    i_y : In(32)
        The binary32 addend of that part, presented `part_latency` cycles after its inputs (so that a sum
        leaving `o_sum` can be added to again `FpAdd.LATENCY` cycles later).
    o_valid : Out(1); o_sum : Out(32)
        ``y + part``, `latency` cycles after the inputs.
    """

    PART_LATENCY = 1 + IntScaleMul.LATENCY + FpLdexp.LATENCY
    LATENCY = PART_LATENCY + FpAdd.LATENCY

    def __init__(self, cfg: HardwareConfig, isum_bits: int = INT_SCALE_MAX_BITS):
        with rejecting(self):
            check_int_scale_bits("PartAccumulator", "isum_bits", isum_bits, cfg.acc_bits)
        self._cfg, self._isum_bits = cfg, isum_bits
        super().__init__({"i_valid": In(1), "i_isum": In(signed(cfg.acc_bits)), "i_scale": In(16),
                          "i_exp": In(signed(EXP_BITS)), "i_y": In(32), "o_valid": Out(1), "o_sum": Out(32)})

    @property
    def part_latency(self) -> int:
        """Cycles from the inputs to the addition (``i_y``)."""
        return self.PART_LATENCY

    @property
    def latency(self) -> int:
        """Cycles from the inputs to ``o_sum``."""
        return self.LATENCY

    def elaborate(self, platform):
        m = Module()
        fadd, fmul, ldx = FpAdd(), IntScaleMul(self._isum_bits), FpLdexp(EXP_BITS, int_scale=True)
        m.submodules += [fadd, fmul, ldx]
        # The inputs are registered (they come from the back ends' block RAM outputs).
        valid0, isum0 = Signal(name="valid_in"), Signal(self._isum_bits, name="isum_in")
        scale0, exp0 = Signal(16, name="scale_in"), Signal(EXP_BITS, name="exp_in")
        m.d.sync += [valid0.eq(self.i_valid), isum0.eq(self.i_isum[:self._isum_bits]), scale0.eq(self.i_scale),
                     exp0.eq(self.i_exp)]
        m.d.comb += [fmul.en.eq(1), ldx.en.eq(1), fadd.en.eq(1),
                     fmul.i_valid.eq(valid0), fmul.i_a.eq(isum0), fmul.i_b.eq(scale0)]
        e_at_ldx = _delay(m, exp0, fmul.latency, "exp")
        v_ldx = _delay(m, valid0, fmul.latency, "valid_mul")
        m.d.comb += [ldx.i_valid.eq(v_ldx), ldx.i_a.eq(fmul.o_y), ldx.i_b.eq(e_at_ldx)]
        v_add = _delay(m, v_ldx, ldx.latency, "valid_ldx")
        m.d.comb += [fadd.i_valid.eq(v_add), fadd.i_a.eq(self.i_y), fadd.i_b.eq(ldx.o_y),
                     self.o_valid.eq(fadd.o_valid), self.o_sum.eq(fadd.o_y)]
        assert 1 + fmul.latency + ldx.latency == self.PART_LATENCY
        return m


def _part_signature(cfg: HardwareConfig) -> wiring.Signature:
    """A back end's side of the port's `PartAccumulator` (the exponent comes from the shared memory)."""
    return wiring.Signature({"valid": Out(1), "isum": Out(signed(cfg.acc_bits)), "scale": Out(16), "y": Out(32),
                             "sum": In(32)})


def _decoded_signature(cfg: HardwareConfig, max_cols: int, max_segments: int) -> wiring.Signature:
    """The decoded command as the ports see it (`CommandDecoder`'s outputs without the ``o_`` prefix)."""
    return wiring.Signature({k: Out(v) for k, v in decoded_shapes(cfg, max_cols, max_segments).items()})


def _port_members(cfg: HardwareConfig, max_cols: int, max_segments: int) -> dict:
    """The members of `EnginePort`: AXI master, start, the decoded command, the activation/exponent memory
    writes, the results and status."""
    W = cfg.weights_per_beat
    return {
        "axi": Out(AxiReadSignature.from_config(cfg)),
        "i_start": In(1),
        "dec": In(_decoded_signature(cfg, max_cols, max_segments)),
        "i_act_en": In(1), "i_act_addr": In(range(max_cols // W)),
        "i_act_q": In(data.ArrayLayout(signed(cfg.act_bits), W)),
        "i_exp_en": In(1), "i_exp_addr": In(range(_exp_depth(cfg, max_cols))),
        "i_exp_e": In(signed(EXP_BITS)),
        **({"i_act_vec": In(range(cfg.gemv_vectors)), "i_exp_vec": In(range(cfg.gemv_vectors))}
           if cfg.gemv_vectors > 1 else {}),
        "o_res": Out(stream.Signature(unsigned(32))),
        "o_idle": Out(1), "o_error": Out(1),
        **({"i_mask_en": In(1), "i_mask_addr": In(range(cfg.gemv_max_cols // MASK_LANES)),
            "i_mask_bits": In(MASK_LANES), "i_gather": In(1), "o_gather_busy": Out(1)}
           if cfg.gemv_row_mask else {}),
    }


def _mask_share(cfg: HardwareConfig) -> int:
    """The most rows of one port's share of a masked command (the sparse mode's row split of
    ``gemv_max_cols`` rows)."""
    W, N = cfg.weights_per_beat, cfg.axi_ports
    return -(-cfg.gemv_max_cols // (N * W)) * W


def _datapath_members(cfg: HardwareConfig, max_cols: int, max_segments: int, scale_words: int) -> dict:
    """The members shared by `GemvPort` and `SparsePort`: start, the decoded command, the port's DMA (command
    and data streams, busy), the read port of its activation memory and the address of its exponent memory
    (synchronous: the data is the word addressed in the previous cycle), the port's scale memory of
    `scale_words` words (``o_scale_wen`` / ``o_scale_waddr``: the DMA beat of the cycle written there;
    ``o_scale_raddr`` / ``i_scale_rdata``: a synchronous read port), its `PartAccumulator` (``fp``: a
    part's isum and scale in the cycle after the exponent's address, the addend ``y`` `part_latency` - 1 cycles
    later (the `EnginePort` registers it after its mode's select), the ``sum`` `FpAdd.LATENCY` + 1 cycles after
    that), the results and idle."""
    W = cfg.weights_per_beat
    return {
        "i_start": In(1),
        "dec": In(_decoded_signature(cfg, max_cols, max_segments)),
        "dma_cmd": Out(stream.Signature(read_command_layout(cfg.axi_addr_bits, LEN_BITS))),
        "dma_data": In(stream.Signature(read_data_layout(cfg.axi_data_bits))),
        "i_dma_busy": In(1),
        "o_act_addr": Out(range(max_cols // W)), "i_act_data": In(data.ArrayLayout(signed(cfg.act_bits), W)),
        "o_exp_addr": Out(range(_exp_depth(cfg, max_cols))),
        "o_scale_wen": Out(1), "o_scale_waddr": Out(range(scale_words)), "o_scale_raddr": Out(range(scale_words)),
        "i_scale_rdata": In(8 * cfg.bytes_per_beat),
        "fp": Out(_part_signature(cfg)),
        "o_res": Out(stream.Signature(unsigned(32))),
        "o_idle": Out(1),
    }


class GemvPort(wiring.Component):
    """The dense datapath of one weight port: tile sequencer, front end (scales, MACs), double-buffered
    isum and scale banks, binary32 back end (its walk, the y registers; the arithmetic is the port's
    `PartAccumulator`) and a result FIFO. Port `index` of `ports` takes tiles ``index, index + ports, ...``.
    The DMA, the activation and exponent memories and the `PartAccumulator` belong to the `EnginePort`
    (shared with the sparse datapath).

    Members
    -------
    i_start : In(1)  (one cycle; the decoded command is stable until the port is idle)
    dec : In(the decoder's outputs)
    dma_cmd : Out(stream(read_command_layout)); dma_data : In(stream(read_data_layout)); i_dma_busy : In(1)
    o_act_addr : Out; i_act_data : In; o_exp_addr : Out: the memories' read ports
    fp : Out(part signature): the port's `PartAccumulator` (isum, scale, addend y; the sum back)
    o_res : Out(stream(32)): this port's row results, in its row order
    o_idle : Out(1)
    i_rows : In(20): the rows the port works out its tiles from (the command's; masked: its gathered rows as
        if they were its tiles of a command, `EnginePort`)
    o_idx_addr : Out; i_idx : In (``gemv_row_mask``): the gathered rows' index memory (`RowGather`)
    i_act_more : In (``gemv_vectors`` V > 1): the activation words of vectors 1 .. V-1 (``i_act_data`` is
        vector 0's), read at ``o_act_addr`` like it
    o_exp_group : Out (V > 1): the vector group of the parts whose exponents are read at ``o_exp_addr``:
        pipeline k takes vector ``P * group + k``
    fp_more : Out (P = `gemv_parts` > 1): the port's other `PartAccumulator`s, pipeline 1 .. P-1

    With `nvec` > 1 (``dec.cmd.vecs``) every row of a tile is ``nvec`` rows of the back end, ``(v, t)`` for the
    vectors v, each with its own isum (the isum bank keeps a word of V per row and segment), y register and
    result. P = `gemv_parts` binary32 pipelines take P vectors at a time (pipeline k vector ``P * g + k`` of
    group g): the walk is ``(s, g, t)``, so the back end takes ``ceil(nvec / P)`` cycles per row and segment,
    and a tile's results leave vector by vector (its rows for vector 0, then for vector 1, ...).

    With `mask` (``dec.cmd.mask``) its tiles are its gathered rows, T at a time: a scale transfer per row and
    each row's chunks at the row's own address (`_masked_sequencer`); the bank's scales then keep a whole
    number of beats per row.

    With ``gemv_interleave`` the front end writes each chunk round's weight beats, as they arrive row after row,
    into a round reorder memory of `ROUND_SLOTS` rounds, and its reader presents a complete round beat-major, beat
    k of each of the round's rows before beat k + 1 (`_round_reader`), so that one activation word serves as many
    consecutive cycles as the round has rows; the MAC keeps a segment sum per tile row (`SegmentMac` ``rows``).
    The isum bank's ``[t, s]``, the rounds counted per bank and the back end are the same in either order.
    """

    def __init__(self, cfg: HardwareConfig, index: int, *, max_cols: int, max_segments: int, tile_rows: int,
                 scale_words: int):
        self._cfg, self._index = cfg, index
        self._max_cols, self._max_segments, self._T = max_cols, max_segments, tile_rows
        W = cfg.weights_per_beat
        # A chunk holds whole activation blocks (so whole segments) and is at least one full burst; with
        # ``gemv_int8`` also in INT8 weights (B = W/2 a beat).
        self._chunk_beats = max(cfg.axi_max_burst_beats, cfg.act_block // (W // 2 if cfg.gemv_int8 else W), 1)
        self._max_beats = max_row_beats(cfg, max_cols)
        self._interleave = cfg.gemv_interleave
        members = _datapath_members(cfg, max_cols, max_segments, scale_words)
        members["i_rows"] = In(20)
        if cfg.gemv_row_mask:
            members["o_idx_addr"] = Out(range(_mask_share(cfg)))
            members["i_idx"] = In(range(cfg.gemv_max_cols))
        self._parts = gemv_parts(cfg)
        if cfg.gemv_vectors > 1:
            members["i_act_more"] = In(data.ArrayLayout(data.ArrayLayout(signed(cfg.act_bits), W),
                                                        cfg.gemv_vectors - 1))
            members["o_exp_group"] = Out(range(-(-cfg.gemv_vectors // self._parts)))
        if self._parts > 1:
            members["fp_more"] = Out(_part_signature(cfg)).array(self._parts - 1)
        super().__init__(members)

    # Bank states: FREE -> FILLING (front end) -> FULL (last isum written) -> FREE (back end done).
    FREE, FILLING, FULL = 0, 1, 2

    #: Chunk rounds the round reorder memory holds (``gemv_interleave``, `_round_reader`): with two, the writer
    #: waits a cycle for the round the reader frees and the reader a cycle for the writer's next round, once a
    #: round at the stream rate; four keep the writer a round ahead, in the same block RAMs on both presets.
    ROUND_SLOTS = 4

    def elaborate(self, platform):
        m = Module()
        cfg, T = self._cfg, self._T
        W, B = cfg.weights_per_beat, cfg.bytes_per_beat
        S = self._max_segments
        d = self.dec

        # --- memories ----------------------------------------------------------------------------------
        # isum banks: [bank, t, s], a word of one sum per vector; scale banks: [bank, halfword t * groups + g] in
        # beat-wide words. A segment sum fits `cfg.segment_sum_bits` (kv260: 23 with INT8 weights), so the banks
        # keep that width, not acc_bits. With several vectors the words are V sums wide (kv260: 92 bits x 2,048)
        # and go to UltraRAM (two URAM288 a port against 5.5 BRAM36, which bind the KV260 system first).
        m.submodules.isum_mem = isum_mem = Memory(
            shape=data.ArrayLayout(signed(cfg.segment_sum_bits), cfg.gemv_vectors), depth=2 * T * S, init=[],
            attrs={"ram_style": "ultra"} if cfg.gemv_vectors > 1 else {})
        isum_w, isum_r = isum_mem.write_port(), isum_mem.read_port()
        hpw = B // 2                                # binary16 scales per beat
        swords = _dense_scale_words(cfg, S, T)      # masked: a whole number of beats per row
        # the scale banks are the port's scale memory (shared with the sparse datapath, `EnginePort`)
        scale_w = SimpleNamespace(en=self.o_scale_wen, addr=self.o_scale_waddr)
        scale_r = SimpleNamespace(addr=self.o_scale_raddr, data=self.i_scale_rdata)

        # Per bank: its state, its tile's rows and the chunk rounds of that tile whose segment sums are all
        # written.
        bank_state = [Signal(2, name=f"bank{b}_state") for b in range(2)]
        bank_rows = [Signal(range(T + 1), name=f"bank{b}_rows") for b in range(2)]
        bank_rounds = [Signal(range(self._max_beats // self._chunk_beats + 2), name=f"bank{b}_rounds")
                       for b in range(2)]
        banks = bank_state, bank_rows, bank_rounds

        # Shared by the sequencer and the front end: scale bytes per row, chunks per row.
        g2 = Signal(17 + 1)
        m.d.comb += g2.eq(d.groups << 1)
        # Chunks per row less one and beats per row less one, registered from the decoder's (valid from the
        # cycle after `i_start`; their first use is cycles later).
        nch_m1 = Signal(range(self._max_beats // self._chunk_beats + 2))
        nwb_m1 = Signal.like(d.nwb)
        m.d.sync += [nch_m1.eq(((d.nwb + self._chunk_beats - 1) >> ceil_log2(self._chunk_beats)) - 1),
                     nwb_m1.eq(d.nwb - 1)]

        seq_cmd = stream.Signature(read_command_layout(cfg.axi_addr_bits, LEN_BITS)).create()
        seq_active = self._tile_sequencer(m, g2, nch_m1, seq_cmd)
        if cfg.gemv_row_mask:
            msk_cmd = stream.Signature(read_command_layout(cfg.axi_addr_bits, LEN_BITS)).create()
            msk_active = self._masked_sequencer(m, g2, nch_m1, msk_cmd)
            masked = d.cmd.mask
            # Both sequencers see the ready: the one the command does not run stays idle (its valid low).
            m.d.comb += [self.dma_cmd.valid.eq(Mux(masked, msk_cmd.valid, seq_cmd.valid)),
                         self.dma_cmd.p.eq(Mux(masked, msk_cmd.p, seq_cmd.p)),
                         seq_cmd.ready.eq(self.dma_cmd.ready), msk_cmd.ready.eq(self.dma_cmd.ready)]
            seq_active = seq_active | msk_active
        else:
            m.d.comb += [self.dma_cmd.valid.eq(seq_cmd.valid), self.dma_cmd.p.eq(seq_cmd.p),
                         seq_cmd.ready.eq(self.dma_cmd.ready)]
        fe_active = self._front_end(m, g2, nch_m1, nwb_m1, banks, isum_w, scale_w, swords)
        be_active, reserved = self._back_end(m, banks, isum_r, scale_r, hpw, swords)
        m.d.comb += self.o_idle.eq(~seq_active & ~fe_active & ~be_active & ~reserved &
                                   (bank_state[0] == self.FREE) & (bank_state[1] == self.FREE) & ~self.i_dma_busy)
        return m

    def _tile_sequencer(self, m, g2, nch_m1, cmd):
        """The DMA commands. Per tile: the scales (one transfer), then the rows in chunks of `chunk_beats`,
        round-robin over the tile's rows (chunk 0 of rows 0..T-1, chunk 1 of rows 0..T-1, ...), so that the
        back end can start on a tile's first segments while its last chunks are still arriving. Every field
        of a command is a register: a chunk's address and bytes are stepped with the chunks (the round's rows
        and the tile's rounds counted down), the scale transfer's bytes follow the rows left through three
        registers (the tile's rows, the product in a DSP48E2's M register, a fabric register), and the port's
        first tile is its offset added to the bases in the cycle after `i_start`. Returns the sequencer's active
        flag."""
        cfg, T, N = self._cfg, self._T, self._cfg.axi_ports
        B = cfg.bytes_per_beat
        d = self.dec
        ab = cfg.axi_addr_bits
        p = self._index
        CB = self._chunk_beats
        CBB = CB * B                                 # bytes per chunk
        rows = self.i_rows
        seq_active = Signal()
        seq_left = Signal(signed(22))                # rows left from this tile on
        seq_scale = Signal()                         # the scale transfer comes next
        seq_trem = Signal(range(T))                  # the round's chunk transfers after the next one
        seq_crem = Signal.like(nch_m1)               # the tile's chunk rounds after this one
        seq_tzero, seq_czero = Signal(), Signal()    # seq_trem == 0, seq_crem == 0, registered with them
        seq_tile = Signal(ab)                        # the tile's first row
        seq_rbase = Signal(ab)                       # the round's first chunk: seq_tile + c * CBB
        seq_caddr = Signal(ab)                       # the next chunk: seq_rbase + t * stride
        seq_rem = Signal(16)                         # the row's bytes from the round's chunk on
        seq_full = Signal()                          # seq_rem > CBB: the chunk is a whole one
        seq_saddr = Signal(ab)
        # Registered from seq_left: the tile's rows (`seq_trows`), the scale transfer's bytes (`seq_snb`),
        # the port's last tile (`seq_last`); the scale transfer waits until they have settled (`seq_settle`
        # cycles after seq_left changes).
        seq_trows = Signal(range(T + 1))
        seq_snb = Signal(len(seq_trows) + len(g2))
        seq_last = Signal()
        seq_settle = Signal(2)
        # seq_snb = seq_trows * g2: a DSP48E2 (`DspMacc` without P) whose B register is a copy of seq_trows,
        # its M register, then a fabric register (three cycles after seq_left)
        seq_trows_next = Mux(seq_left < T, seq_left, T)
        m.submodules.seq_mul = seq_mul = DspMacc(len(g2) + 1, len(seq_trows) + 1, preg=False)
        m.d.comb += [seq_mul.i_a.eq(g2), seq_mul.i_b.eq(seq_trows_next), seq_mul.i_restart.eq(0)]
        m.d.sync += [seq_trows.eq(seq_trows_next), seq_snb.eq(seq_mul.o_p[:len(seq_snb)]),
                     seq_last.eq(seq_left <= N * T)]
        # The port's first tile: its offsets from the weight and scale bases, registered from the decoder's
        # fields, added to the bases in the cycle after `i_start` (`seq_load`).
        # (rows `stride` bytes apart: an int8 command's pitch, else the row's bytes)
        stride = d.rstride if cfg.gemv_int8 else d.rowbytes
        seq_toff, seq_soff = Signal((stride * (p * T)).shape()), Signal((g2 * (p * T)).shape())
        seq_load = Signal()
        m.d.sync += [seq_toff.eq(_times(stride, p * T)), seq_soff.eq(_times(g2, p * T)), seq_load.eq(self.i_start)]
        with m.If(seq_settle != 0):
            m.d.sync += seq_settle.eq(seq_settle - 1)
        m.d.comb += cmd.valid.eq(seq_active & (~seq_scale | (seq_settle == 0)))
        with m.If(seq_scale):
            m.d.comb += [cmd.p.addr.eq(seq_saddr), cmd.p.nbytes.eq(seq_snb)]
        with m.Else():
            m.d.comb += [cmd.p.addr.eq(seq_caddr), cmd.p.nbytes.eq(Mux(seq_full, CBB, seq_rem))]
        with m.If(self.i_start):
            left = rows.as_signed() - p * T
            # left > 0 as one compare of the rows with a constant
            run = (rows > p * T) & ~d.cmd.mask if cfg.gemv_row_mask else rows > p * T  # masked: `_masked_sequencer`
            m.d.sync += [seq_left.eq(left), seq_active.eq(run), seq_scale.eq(1), seq_settle.eq(3),
                         seq_tile.eq(d.cmd.wbase), seq_saddr.eq(d.cmd.sbase)]
        with m.Elif(seq_load):
            m.d.sync += [seq_tile.eq(seq_tile + seq_toff), seq_saddr.eq(seq_saddr + seq_soff)]
        with m.Elif(cmd.valid & cmd.ready):
            with m.If(seq_scale):
                m.d.sync += [seq_scale.eq(0), seq_trem.eq(seq_trows - 1), seq_crem.eq(nch_m1),
                             seq_tzero.eq(seq_trows == 1), seq_czero.eq(nch_m1 == 0),
                             seq_rbase.eq(seq_tile), seq_caddr.eq(seq_tile), seq_rem.eq(d.rowbytes),
                             seq_full.eq(d.rowbytes > CBB)]
            with m.Elif(seq_tzero):
                m.d.sync += [seq_trem.eq(seq_trows - 1), seq_crem.eq(seq_crem - 1), seq_rbase.eq(seq_rbase + CBB),
                             seq_tzero.eq(seq_trows == 1), seq_czero.eq(seq_crem == 1),
                             seq_caddr.eq(seq_rbase + CBB), seq_rem.eq(seq_rem - CBB),
                             seq_full.eq(seq_rem > 2 * CBB)]
                with m.If(seq_czero):
                    m.d.sync += [seq_scale.eq(1), seq_settle.eq(3), seq_left.eq(seq_left - N * T),
                                 seq_tile.eq(seq_tile + stride * (N * T)),
                                 seq_saddr.eq(seq_saddr + g2 * (N * T))]
                    with m.If(seq_last):
                        m.d.sync += seq_active.eq(0)
            with m.Else():
                m.d.sync += [seq_trem.eq(seq_trem - 1), seq_tzero.eq(seq_trem == 1),
                             seq_caddr.eq(seq_caddr + stride)]
        return seq_active

    def _masked_sequencer(self, m, g2, nch_m1, cmd):
        """The DMA commands of a masked command: the port's gathered rows (`i_idx`, in row order), T a tile.
        Per tile the rows' indices are read (and registered) into a table of their weight and scale offsets
        (``idx * rowbytes``, ``idx * g2``, each product a DSP48E2 with its input and M registers, `DspMacc`),
        then come a scale transfer per row (`g2` bytes) and the rows' chunks, round-robin over the tile's rows as
        `_tile_sequencer` sends them, each at its row's address, through an output register. The gathered rows
        are ``i_rows``'s tiles (`EnginePort`). Returns the sequencer's active flag."""
        cfg, T = self._cfg, self._T
        B = cfg.bytes_per_beat
        d = self.dec
        ab = cfg.axi_addr_bits
        CBB = self._chunk_beats * B
        lT, lNT = ceil_log2(T), ceil_log2(T * cfg.axi_ports)
        share = _mask_share(cfg)
        # the gathered rows: i_rows is their tiles as a command's (q whole tiles of this port, then r rows)
        count = Cat(self.i_rows[:lT], self.i_rows[lNT:])
        # offsets from the bases: a row's bytes are at most 2**15, its scales' 2**(log2 max_segments + 1)
        ob = ceil_log2(cfg.gemv_max_cols) + 15
        sb = ceil_log2(cfg.gemv_max_cols) + ceil_log2(self._max_segments) + 1
        roff = Array(Signal(ob, name=f"mk_roff{t}") for t in range(T))
        soff = Array(Signal(sb, name=f"mk_soff{t}") for t in range(T))
        left = Signal(range(share + 1))              # gathered rows from this tile on
        base = Signal(range(share + T))              # the tile's first gathered row
        trows = Signal(range(T + 1))
        trows_m1 = Signal(range(T))                  # trows - 1, registered with it
        f = Signal(range(T + 2))                     # the table's fill: the next index read
        f_more = Signal()                            # f < trows, registered with f
        st1, st1r, st2 = Signal(), Signal(), Signal()    # an index (registered, then its products) on its way
        t1, t1r, t2 = Signal(range(T)), Signal(range(T)), Signal(range(T))     # to the table
        # the index in the A/B registers, its products in the M registers (`pr`, `ps`)
        m.submodules.mk_rmul = rmul = DspMacc(len(d.rowbytes) + 1, len(self.i_idx) + 1, preg=False)
        m.submodules.mk_smul = smul = DspMacc(len(g2) + 1, len(self.i_idx) + 1, preg=False)
        m.d.comb += [rmul.i_a.eq(d.rowbytes), rmul.i_b.eq(self.i_idx), rmul.i_restart.eq(0),
                     smul.i_a.eq(g2), smul.i_b.eq(self.i_idx), smul.i_restart.eq(0)]
        pr, ps = rmul.o_p[:ob], smul.o_p[:sb]
        t = Signal(range(T))
        c = Signal.like(nch_m1)                      # the tile's chunk rounds after this one
        c_zero = Signal()                            # c == 0, registered with it
        rb = Signal(ab)                              # the round's chunk base: wbase + c * CBB
        rem = Signal(16)                             # the row's bytes from the round's chunk on
        full = Signal()
        m.d.comb += self.o_idx_addr.eq(base + f)
        m.d.sync += [st1.eq(0), st1r.eq(st1), t1r.eq(t1), st2.eq(st1r), t2.eq(t1r)]
        with m.If(st2):
            m.d.sync += [roff[t2].eq(pr), soff[t2].eq(ps)]
        # The gathered rows are registered in the cycle before `i_start` (`EnginePort`); none (`left` 0 in
        # TILE) ends the command there, so that the start's path to the state has no compare of the count.
        # Each command goes through an output register (`mo_*`), taken while it is empty or handing one on.
        mo_valid, mo_addr, mo_nbytes = Signal(), Signal(ab), Signal.like(cmd.p.nbytes)
        mo_free = ~mo_valid | cmd.ready
        m.d.comb += [cmd.valid.eq(mo_valid), cmd.p.addr.eq(mo_addr), cmd.p.nbytes.eq(mo_nbytes)]
        with m.If(cmd.ready):
            m.d.sync += mo_valid.eq(0)
        active = Signal()
        last_tile = Signal()                         # left <= T (so left == trows), registered with trows
        t_last = Signal()                            # t == trows_m1, set with t
        with m.FSM(name="masked_seq"):
            with m.State("IDLE"):
                with m.If(self.i_start):
                    m.d.sync += [left.eq(count), base.eq(0)]
                    with m.If(d.cmd.mask):
                        m.next = "TILE"
            with m.State("TILE"):
                m.d.comb += active.eq(1)
                m.d.sync += [trows.eq(Mux(left < T, left, T)), trows_m1.eq(Mux(left < T, left, T) - 1), f.eq(0),
                             f_more.eq(left != 0), last_tile.eq(left <= T)]
                m.next = "FILL"
                with m.If(left == 0):
                    m.next = "IDLE"
            with m.State("FILL"):
                m.d.comb += active.eq(1)
                with m.If(f_more):
                    m.d.sync += [f.eq(f + 1), f_more.eq(f + 1 < trows), st1.eq(1), t1.eq(f)]
                with m.Elif(~st1 & ~st1r & ~st2):
                    m.d.sync += [t.eq(0), t_last.eq(trows_m1 == 0)]
                    m.next = "SCALES"
            with m.State("SCALES"):
                m.d.comb += active.eq(1)
                with m.If(mo_free):
                    m.d.sync += [mo_valid.eq(1), mo_addr.eq(d.cmd.sbase + soff[t]), mo_nbytes.eq(g2), t.eq(t + 1),
                                 t_last.eq(t + 1 == trows_m1)]
                    with m.If(t_last):
                        m.d.sync += [t.eq(0), t_last.eq(trows_m1 == 0), c.eq(nch_m1), c_zero.eq(nch_m1 == 0),
                                     rb.eq(d.cmd.wbase), rem.eq(d.rowbytes), full.eq(d.rowbytes > CBB)]
                        m.next = "CHUNKS"
            with m.State("CHUNKS"):
                m.d.comb += active.eq(1)
                with m.If(mo_free):
                    m.d.sync += [mo_valid.eq(1), mo_addr.eq(rb + roff[t]), mo_nbytes.eq(Mux(full, CBB, rem)),
                                 t.eq(t + 1), t_last.eq(t + 1 == trows_m1)]
                    with m.If(t_last):
                        m.d.sync += [t.eq(0), t_last.eq(trows_m1 == 0), c.eq(c - 1), c_zero.eq(c == 1),
                                     rb.eq(rb + CBB), rem.eq(rem - CBB), full.eq(rem > 2 * CBB)]
                        with m.If(c_zero):
                            m.d.sync += [left.eq(left - trows), base.eq(base + T)]
                            m.next = "TILE"
                            with m.If(last_tile):           # left == trows
                                m.next = "IDLE"
        return active | mo_valid

    def _front_end(self, m, g2, nch_m1, nwb_m1, banks, isum_w, scale_w, swords):
        """Takes the DMA data: a tile's scale beats into its bank, then its weight beats through the
        `SegmentMac` (against the activation words, `_mac_stage`), whose segment sums go to the tile's isum bank;
        with ``gemv_interleave`` the weight beats go into the round reorder memory, and its reader presents them
        beat-major (`_round_reader`). Claims a free bank per tile (FILLING), counts the finished chunk rounds and
        marks the bank FULL after the last. Returns the front end's active flag (with the reader's)."""
        cfg, T, N = self._cfg, self._T, self._cfg.axi_ports
        W, B = cfg.weights_per_beat, cfg.bytes_per_beat
        S = self._max_segments
        d = self.dec
        p = self._index
        CB = self._chunk_beats
        lCB = ceil_log2(CB)
        rows = self.i_rows
        bank_state, bank_rows, bank_rounds = banks
        fe_active = Signal()
        fe_left = Signal(signed(22))
        fe_bank = Signal()
        fe_scale = Signal()                          # in the scale phase of a tile
        fe_wait = Signal()                           # waiting for the bank to be free
        fe_sw = Signal(range(T * S + 2))             # scale word
        fe_sw1 = Signal.like(fe_sw)                  # fe_sw + 1, registered with it
        fe_c = Signal.like(nch_m1)                   # chunk
        fe_k = Signal(range(CB))                     # beat within the chunk
        fe_beat = Signal(range(self._max_beats + 2))   # beat within the row
        m.d.comb += fe_beat.eq((fe_c << lCB) | fe_k)
        fe_t = Signal(range(T))
        fe_sel = Signal(range(W))
        # Registered from fe_left: the tile's rows (`fe_trows`), less one (`fe_tlast`), the port's last tile
        # (`fe_final`).
        fe_trows, fe_tlast, fe_final = Signal(range(T + 1)), Signal(range(T)), Signal()
        trows = Mux(fe_left < T, fe_left, T)
        m.d.sync += [fe_trows.eq(trows), fe_tlast.eq(trows - 1), fe_final.eq(fe_left <= N * T)]
        # Scale beats of this tile less one: ceil(rows of the tile x g2 / B) - 1, through four registers (the
        # rows and g2 in a DSP48E2's B and A registers, their product in its M register, `DspMacc` without P,
        # and in a fabric register; the quotient); the tile waits for its bank until they have settled
        # (`fe_settle` cycles after fe_left changes).
        nsb_m1 = Signal(range(T * S + 2))
        # masked: each row's scales are a transfer of their own, so a whole number of beats (g2 rounded up)
        g2eff = Mux(d.cmd.mask, ((g2 + B - 1) >> ceil_log2(B)) << ceil_log2(B), g2) if cfg.gemv_row_mask else g2
        m.submodules.fe_mul = fe_mul = DspMacc(len(g2) + 1, len(fe_trows) + 1, preg=False)
        m.d.comb += [fe_mul.i_a.eq(g2eff), fe_mul.i_b.eq(trows), fe_mul.i_restart.eq(0)]
        prod = Signal(len(fe_trows) + len(g2))
        m.d.sync += [prod.eq(fe_mul.o_p[:len(prod)]), nsb_m1.eq(((prod + B - 1) >> ceil_log2(B)) - 1)]
        fe_settle = Signal(3)
        fe_settled = Signal()                        # fe_settle == 0, registered with it
        with m.If(fe_settle != 0):
            m.d.sync += fe_settle.eq(fe_settle - 1)
        m.d.sync += fe_settled.eq(fe_settle <= 1)
        beat = self.dma_data
        row_phase = fe_active & ~fe_wait & ~fe_scale
        subs_m1 = Signal.like(d.subs)                # registered from the decoder's, like nwb_m1
        subs_m2 = Signal(signed(len(d.subs) + 1))   # likewise, -1 for subs 1
        m.d.sync += [subs_m1.eq(d.subs - 1), subs_m2.eq(d.subs - 2)]
        last_sel = Signal()                          # fe_sel == subs_m1, registered with fe_sel
        last_beat = Signal()                         # fe_beat == nwb_m1, registered with fe_c and fe_k
        c_end, k_end = nwb_m1 >> lCB, nwb_m1[:lCB]
        # fe_k == CB - 1, fe_t == fe_tlast, fe_c == nch_m1 as registers: each compared every cycle from the
        # counters (fe_tlast and nch_m1 change only while the front end waits for its tile's bank) and set
        # with the counter where it steps.
        k_last, t_last, c_last = Signal(), Signal(), Signal()
        m.d.sync += [k_last.eq(fe_k == CB - 1), t_last.eq(fe_t == fe_tlast), c_last.eq(fe_c == nch_m1)]
        last_k = k_last | last_beat
        last_row = t_last
        with m.If(self.i_start):
            left = rows.as_signed() - p * T
            m.d.sync += [fe_left.eq(left), fe_active.eq(rows > p * T), fe_bank.eq(0), fe_wait.eq(1),
                         fe_scale.eq(1), fe_sw.eq(0), fe_sw1.eq(1), fe_c.eq(0), fe_k.eq(0), fe_t.eq(0), fe_sel.eq(0),
                         last_sel.eq(d.subs == 1), last_beat.eq(d.nwb == 1), fe_settle.eq(4), fe_settled.eq(0)]
        with m.If(fe_active & fe_wait & fe_settled &
                  (Mux(fe_bank, bank_state[1], bank_state[0]) == self.FREE)):
            m.d.sync += fe_wait.eq(0)
            for b in range(2):
                with m.If(fe_bank == b):
                    m.d.sync += [bank_state[b].eq(self.FILLING), bank_rows[b].eq(fe_trows), bank_rounds[b].eq(0)]
        # Scale beats straight into the bank. The scale words after this one (`sw_rem`) and whether it is the
        # tile's last (`sw_last`) follow nsb_m1 while the tile waits for its bank (nsb_m1 settles then) and
        # step down with the words: the flag's input compares a register with a constant.
        sw_last = Signal()
        sw_rem = Signal.like(nsb_m1)
        with m.If(fe_wait):
            m.d.sync += [sw_rem.eq(nsb_m1), sw_last.eq(nsb_m1 == 0)]
        with m.If(fe_active & ~fe_wait & fe_scale):
            m.d.comb += [beat.ready.eq(1), scale_w.addr.eq(Cat(fe_sw[:ceil_log2(swords)], fe_bank)),
                         scale_w.en.eq(beat.valid)]
            with m.If(beat.valid):
                m.d.sync += [fe_sw.eq(fe_sw1), fe_sw1.eq(fe_sw1 + 1), sw_rem.eq(sw_rem - 1), sw_last.eq(sw_rem == 1)]
                with m.If(sw_last):
                    m.d.sync += [fe_scale.eq(0), fe_sw.eq(0), fe_sw1.eq(1)]
        # Weight beats: the beat is presented `subs` times (once when a segment spans whole beats). With
        # `gemv_interleave` it is taken once, into the slot of the round reorder memory that the round's beats are
        # written to (`w_slot`) while that slot is free (`w_free`, a register: `_round_reader`), and the round
        # reader presents it.
        mac_valid = Signal()
        if self._interleave:
            w_slot, w_free = Signal(range(self.ROUND_SLOTS)), Signal(init=1)
            with m.If(row_phase):
                m.d.comb += [beat.ready.eq(w_free), mac_valid.eq(beat.valid & w_free)]
        else:
            with m.If(row_phase):
                m.d.comb += [beat.ready.eq(last_sel), mac_valid.eq(beat.valid)]
        # the activation word of the beat: an INT8 beat is half of word fe_beat >> 1 (`half_sel` selects it)
        int8 = d.cmd.int8 if cfg.gemv_int8 else Const(0)
        if not self._interleave:
            abeat = Mux(int8, fe_beat >> 1, fe_beat) if cfg.gemv_int8 else fe_beat
            m.d.comb += self.o_act_addr.eq(abeat)
        tile_end = Signal()
        round_end = Signal()
        # the tile's last chunk round is in: on to the next tile
        next_tile = [fe_c.eq(0), fe_bank.eq(~fe_bank), fe_wait.eq(1), fe_scale.eq(1), fe_left.eq(fe_left - N * T),
                     fe_settle.eq(4), fe_settled.eq(0)]
        if self._interleave:
            # The writer, a beat a cycle: each row's chunk is a DMA transfer of its own, so its last beat is the
            # transfer's (`last`).
            with m.If(mac_valid):
                m.d.sync += fe_k.eq(fe_k + 1)
                with m.If(beat.p.last):
                    m.d.sync += [fe_k.eq(0), fe_t.eq(fe_t + 1), t_last.eq(fe_t + 1 == fe_tlast)]
                    with m.If(last_row):
                        m.d.comb += round_end.eq(1)
                        m.d.sync += [fe_t.eq(0), fe_c.eq(fe_c + 1), t_last.eq(fe_tlast == 0),
                                     c_last.eq(fe_c + 1 == nch_m1)]
                        with m.If(c_last):
                            m.d.comb += tile_end.eq(1)
                            m.d.sync += [*next_tile, c_last.eq(nch_m1 == 0)]
                            with m.If(fe_final):
                                m.d.sync += fe_active.eq(0)
        else:
            with m.If(mac_valid):
                m.d.sync += [fe_sel.eq(fe_sel + 1), last_sel.eq(fe_sel == subs_m2)]
                with m.If(last_sel):
                    m.d.sync += [fe_sel.eq(0), last_sel.eq(subs_m1 == 0), fe_k.eq(fe_k + 1),
                                 last_beat.eq((fe_c == c_end) & (fe_k + 1 == k_end)), k_last.eq(fe_k + 1 == CB - 1)]
                    with m.If(last_k):
                        m.d.sync += [fe_k.eq(0), fe_t.eq(fe_t + 1), last_beat.eq((fe_c == c_end) & (k_end == 0)),
                                     k_last.eq(CB == 1), t_last.eq(fe_t + 1 == fe_tlast)]
                        with m.If(last_row):
                            m.d.comb += round_end.eq(1)
                            m.d.sync += [fe_t.eq(0), fe_c.eq(fe_c + 1),
                                         last_beat.eq((fe_c + 1 == c_end) & (k_end == 0)),
                                         t_last.eq(fe_tlast == 0), c_last.eq(fe_c + 1 == nch_m1)]
                            with m.If(c_last):
                                m.d.comb += tile_end.eq(1)
                                m.d.sync += [*next_tile, last_beat.eq(nwb_m1 == 0), c_last.eq(nch_m1 == 0)]
                                with m.If(fe_final):
                                    m.d.sync += fe_active.eq(0)
        if self._interleave:
            x, busy = self._round_reader(m, SimpleNamespace(
                take=mac_valid, data=beat.p.data, k=fe_k, t=fe_t, c=fe_c, tlast=fe_tlast, bank=fe_bank, c_last=c_last,
                round_end=round_end, slot=w_slot, free=w_free, subs_m1=subs_m1, subs_m2=subs_m2), int8)
        else:
            x = SimpleNamespace(valid=mac_valid, w=beat.p.data, beat=fe_beat, sel=fe_sel, last_beat=last_beat, t=fe_t,
                                bank=fe_bank, abeat=abeat, round_end=round_end, tile_end=tile_end)
        self._mac_stage(m, x, int8, banks, isum_w)
        return fe_active | busy if self._interleave else fe_active

    def _round_reader(self, m, w, int8):
        """The round reorder memory of the interleaved dense datapath (``gemv_interleave``) and its reader.

        The front end writes a chunk round's weight beats as they arrive, row after row (`w`: ``take``, ``data``,
        beat ``k`` of the chunk, tile row ``t``), at ``t * CB + k`` of slot ``slot`` (`ROUND_SLOTS` slots, a
        round each, taken in turn, each while it is ``free``); after the round's last beat (``round_end``) the
        slot is full and holds what the reader needs of the round: its chunk ``c``, its rows less one
        (``tlast``), its beats less one (the last beat's ``k``), whether it is the row's last chunk (``c_last``)
        and its bank. The reader takes the full slots in turn and reads each round beat-major, ``(k, t, sel)``:
        beat k of each of the round's rows (each presented ``subs`` times, as the front end presents it without
        the reorder), then beat k + 1, so that the activation word ``c * CB + k`` (an INT8 beat: half of word
        ``(c * CB + k) >> 1``) serves ``trows * subs`` consecutive presentations; it goes on with the next slot
        in the cycle after a round's last read if that slot is full, and the slot it leaves is free a cycle
        later. Its counters address the memory; the presentation's control is registered beside the memory's
        output (stage r1) and goes on to `_mac_stage`, the row's beat index addressing the activation words from
        that register. The round's last presentation carries ``round_end`` (and ``tile_end`` for the tile's last
        round), so the bank's rounds count as the front end counts them without the reorder. Returns the
        presentations and the reader's busy flag."""
        cfg, T = self._cfg, self._T
        W, B = cfg.weights_per_beat, cfg.bytes_per_beat
        CB = self._chunk_beats
        lCB = ceil_log2(CB)
        R = self.ROUND_SLOTS
        assert R >= 3 and R & (R - 1) == 0, R       # (`w.free` below: the slot set full is never the writer's next)
        m.submodules.round_mem = mem = Memory(shape=unsigned(8 * B), depth=R * T * CB, init=[])
        wp, rp = mem.write_port(), mem.read_port()
        m.d.comb += [wp.en.eq(w.take), wp.addr.eq(Cat(w.k, w.t, w.slot)), wp.data.eq(w.data)]
        # The slots holding a complete round (`full`), set in the cycle after the round's last beat and cleared in
        # the cycle after the reader's last read of it, each from a register (`w_done`, `r_done` and their slots).
        full = Signal(R)
        # The rounds the slots hold: the writer's fields written into its slot in every cycle it is free, so that
        # they are the round's last beat's once the writer moves on (its beats less one: that beat's k).
        h_c = [Signal.like(w.c, name=f"slot{h}_c") for h in range(R)]
        h_tl = [Signal(range(T), name=f"slot{h}_tlast") for h in range(R)]
        h_klm1 = [Signal(range(CB), name=f"slot{h}_klast") for h in range(R)]
        h_bank = [Signal(name=f"slot{h}_bank") for h in range(R)]
        h_clast = [Signal(name=f"slot{h}_clast") for h in range(R)]
        for h in range(R):
            with m.If(w.free & (w.slot == h)):
                m.d.sync += [h_c[h].eq(w.c), h_tl[h].eq(w.tlast), h_bank[h].eq(w.bank), h_klm1[h].eq(w.k),
                             h_clast[h].eq(w.c_last)]
        w_slot1 = Signal.like(w.slot)
        m.d.comb += w_slot1.eq(w.slot + 1)
        with m.If(w.round_end):
            m.d.sync += w.slot.eq(w_slot1)
        # `w.free`: the slot the writer is at in the next cycle is not full in this one (never free when full; a
        # cycle late when the reader frees it, which four slots hide).
        m.d.sync += w.free.eq(~Mux(w.round_end, full.bit_select(w_slot1, 1), full.bit_select(w.slot, 1)))
        w_done, w_done_slot = Signal(), Signal.like(w.slot)
        m.d.sync += [w_done.eq(w.round_end), w_done_slot.eq(w.slot)]
        # The reader: its slot, its round's fields and counters, and the counters' end flags as registers
        # (sel == subs - 1, t == tlast, k == klast), set where the counters step.
        r_busy, r_slot = Signal(), Signal(range(R))
        r_c, r_tl, r_klm1 = Signal.like(w.c), Signal(range(T)), Signal(range(CB))
        r_bank, r_clast = Signal(), Signal()
        r_k, r_t, r_sel = Signal(range(CB)), Signal(range(T)), Signal(range(W))
        sel_last, t_last, k_last = Signal(), Signal(), Signal()
        r_end = Signal()                             # the round's last presentation
        m.d.comb += r_end.eq(r_busy & sel_last & t_last & k_last)
        with m.If(r_busy):
            m.d.sync += [r_sel.eq(r_sel + 1), sel_last.eq(r_sel == w.subs_m2)]
            with m.If(sel_last):
                m.d.sync += [r_sel.eq(0), sel_last.eq(w.subs_m1 == 0), r_t.eq(r_t + 1), t_last.eq(r_t + 1 == r_tl)]
                with m.If(t_last):
                    m.d.sync += [r_t.eq(0), t_last.eq(r_tl == 0), r_k.eq(r_k + 1), k_last.eq(r_k + 1 == r_klm1)]
                    with m.If(k_last):
                        m.d.sync += [r_busy.eq(0), r_slot.eq(r_slot + 1)]
        r_done, r_done_slot = Signal(), Signal.like(r_slot)
        m.d.sync += [r_done.eq(r_end), r_done_slot.eq(r_slot)]
        for h in range(R):
            with m.If(w_done & (w_done_slot == h)):
                m.d.sync += full[h].eq(1)
            with m.If(r_done & (r_done_slot == h)):
                m.d.sync += full[h].eq(0)
        # The next round: the next slot once this round ends, this slot while idle.
        nh = Signal.like(r_slot)
        m.d.comb += nh.eq(r_slot + r_busy)
        with m.If((~r_busy | r_end) & full.bit_select(nh, 1)):
            tl, klm1 = Array(h_tl)[nh], Array(h_klm1)[nh]
            m.d.sync += [r_busy.eq(1), r_c.eq(Array(h_c)[nh]), r_tl.eq(tl), r_klm1.eq(klm1),
                         r_bank.eq(Array(h_bank)[nh]), r_clast.eq(Array(h_clast)[nh]),
                         r_k.eq(0), r_t.eq(0), r_sel.eq(0),
                         sel_last.eq(w.subs_m1 == 0), t_last.eq(tl == 0), k_last.eq(klm1 == 0)]
        with m.If(self.i_start):
            m.d.sync += [r_busy.eq(0), r_slot.eq(0), w.slot.eq(0), w.free.eq(1), full.eq(0), w_done.eq(0),
                         r_done.eq(0)]
        # Stage r1: the presentation's control beside the memory's output.
        r1 = Signal(data.StructLayout({
            "valid": 1, "beat": range(self._max_beats + 2), "sel": range(W), "last_beat": 1, "t": range(T),
            "bank": 1, "round_end": 1, "tile_end": 1}))
        m.d.comb += rp.addr.eq(Cat(r_k, r_t, r_slot))
        m.d.sync += [r1.valid.eq(r_busy), r1.beat.eq((r_c << lCB) | r_k), r1.sel.eq(r_sel),
                     r1.last_beat.eq(r_clast & k_last), r1.t.eq(r_t), r1.bank.eq(r_bank),
                     r1.round_end.eq(r_end), r1.tile_end.eq(r_end & r_clast)]
        abeat = Mux(int8, r1.beat >> 1, r1.beat) if cfg.gemv_int8 else r1.beat
        m.d.comb += self.o_act_addr.eq(abeat)
        x = SimpleNamespace(valid=r1.valid, w=rp.data, beat=r1.beat, sel=r1.sel, last_beat=r1.last_beat, t=r1.t,
                            bank=r1.bank, abeat=abeat, round_end=r1.round_end, tile_end=r1.tile_end)
        return x, r_busy | full.any() | w_done | r1.valid

    def _mac_stage(self, m, x, int8, banks, isum_w):
        """The beats' way through the `SegmentMac` into the isum bank: each presentation ``x`` (``valid``, the
        beat's data ``w``, its index in the row ``beat`` and sub-sum ``sel``, ``last_beat``, its tile row ``t``
        and ``bank``, its activation word ``abeat``, whose address the caller drives) gets its lane mask and
        segment flags, is registered (stage f1) while the activation word is read, and enters the MAC; the
        segment sums are written to the isum bank at ``[t, s]``. ``round_end`` / ``tile_end`` (with the round's
        last presentation) count the bank's rounds and mark it FULL once their sums have left the MAC."""
        cfg, T = self._cfg, self._T
        W, B = cfg.weights_per_beat, cfg.bytes_per_beat
        lS, lT = ceil_log2(self._max_segments), ceil_log2(T)
        d = self.dec
        bank_state, _, bank_rounds = banks
        fe_beat, fe_sel, last_beat, abeat = x.beat, x.sel, x.last_beat, x.abeat
        # Segment bookkeeping of this beat/pass.
        spb_mask = Signal(range(self._max_cols + 1))    # registered from the decoder's, like nwb_m1
        m.d.sync += spb_mask.eq((Const(1, 16) << d.lspb) - 1)
        sub_shift = Signal(range(ceil_log2(W) + 1))  # registered from the decoder's, like nwb_m1
        sub_seg = Signal()                           # segments narrower than a beat, likewise
        if cfg.gemv_int8:
            lX = Mux(int8, ceil_log2(W) - 1, ceil_log2(W))   # log2 of the weights a beat
            half_sel = Signal(range(W))                  # the INT8 beat's half of the word, as a sub-sum index
            m.d.sync += [sub_shift.eq(lX - d.lvl), sub_seg.eq(d.lvl < lX),
                         half_sel.eq(Mux(int8, d.subs, 0))]      # (B >> lvl sub-sums a half)
        else:
            m.d.sync += [sub_shift.eq(ceil_log2(W) - d.lvl), sub_seg.eq(d.lvl < ceil_log2(W))]
        # The segment index in two steps on its way to the MAC (which registers its tag again): f1 holds a
        # sub-segment's (fe_beat * subs + fe_sel; fe_sel is below subs = 2**sub_shift, so an OR) and the beat
        # shifted right by lspb's whole fours; the MAC's tag takes one, the second shifted by lspb's low two bits.
        seg_sub = ((fe_beat << sub_shift) | fe_sel)[:lS]
        beat_hi = (fe_beat >> Cat(Const(0, 2), d.lspb[2:]))[:lS + 3]
        nl = Signal(range(self._max_cols + W + 1))
        m.d.comb += nl.eq(d.cmd.cols - (abeat << ceil_log2(W)))
        nlanes = Mux(nl > W, W, nl)
        if cfg.gemv_int8:
            # the lanes that count: on the row's last beat the columns of its word (`rem_w`, registered from the
            # command), else W. The last beat is in the last word in either mode; an INT8 beat before it in the
            # same word is its first half, whose lanes lie below rem_w (> B) anyway. A register picks it, with no
            # subtraction or compare of the beat in series.
            rem_w = Signal(range(W + 1))
            m.d.sync += rem_w.eq((d.cmd.cols - 1)[:ceil_log2(W)] + 1)
            nlanes = Mux(last_beat, rem_w, W)
        seg_first = (fe_beat & spb_mask) == 0
        seg_last = ((fe_beat & spb_mask) == spb_mask) | last_beat
        # A sub-segment that starts before the row's end: every one of a beat before the row's last (a row has
        # ceil(cols / X) beats of X weights), and on the last beat those at or below the sub-segment of the row's
        # last column, ((cols - 1) mod X) >> lvl, registered in two steps from the command: a compare of two
        # registers beside last_beat, no shift or column arithmetic of the beat in series.
        lw = ceil_log2(W)
        last_col = Signal(lw)                        # (cols - 1) mod X
        cols_m1 = d.cmd.cols - 1
        m.d.sync += last_col.eq(Mux(int8, cols_m1[:lw - 1], cols_m1[:lw]) if cfg.gemv_int8 else cols_m1[:lw])
        sel_max = Signal(lw)
        m.d.sync += sel_max.eq(last_col >> d.lvl)
        sub_live = ~last_beat | (fe_sel <= sel_max)
        sel = fe_sel
        if cfg.gemv_int8:
            sel = fe_sel | Mux(fe_beat[0], half_sel, 0)

        # Stage f1: the beat and control, registered while the activation word is read.
        m.submodules.mac = mac = SegmentMac(cfg, tag_bits=1 + lT + lS, vectors=cfg.gemv_vectors, int8=cfg.gemv_int8,
                                            pairs=cfg.gemv_pairs, rows=T if self._interleave else 1)
        f1 = Signal(data.StructLayout({
            "valid": 1, "w": 8 * B, "nl": range(W + 1), "sel": range(W), "first": 1, "last": 1,
            "seg_sub": lS, "beat_hi": lS + 3, "tb": 1 + lT}))
        m.d.sync += [
            f1.valid.eq(x.valid & sub_live), f1.w.eq(x.w),
            f1.nl.eq(nlanes), f1.sel.eq(sel),
            f1.first.eq(seg_first | sub_seg), f1.last.eq(seg_last | sub_seg),
            f1.seg_sub.eq(seg_sub), f1.beat_hi.eq(beat_hi), f1.tb.eq(Cat(x.t, x.bank)),
        ]
        seg_idx = Mux(sub_seg, f1.seg_sub, (f1.beat_hi >> d.lspb[:2])[:lS])
        m.d.comb += [
            mac.i_valid.eq(f1.valid), mac.i_first.eq(f1.first), mac.i_last.eq(f1.last),
            mac.i_w.eq(f1.w), mac.i_a[0].eq(self.i_act_data), mac.i_nlanes.eq(f1.nl), mac.i_lvl.eq(d.lvl),
            mac.i_sel.eq(f1.sel), mac.i_tag.eq(Cat(seg_idx, f1.tb)),
        ]
        if cfg.gemv_int8:
            m.d.comb += mac.i_int8.eq(int8)
        if self._interleave:
            m.d.comb += mac.i_row.eq(f1.tb[:lT])
        for v in range(1, cfg.gemv_vectors):
            m.d.comb += mac.i_a[v].eq(self.i_act_more[v - 1])
        m.d.comb += [isum_w.en.eq(mac.o_valid), isum_w.addr.eq(mac.o_tag)]
        for v in range(cfg.gemv_vectors):
            m.d.comb += isum_w.data[v].eq(mac.o_isum[v])
        # A chunk round is complete once its last segment sum has left the MAC pipeline; the tile's bank is
        # full after its last round.
        end_d = _delay(m, Cat(x.round_end, x.tile_end, x.bank), 1 + mac.latency, "round_end")
        for b in range(2):
            with m.If(end_d[0] & (end_d[2] == b)):
                m.d.sync += bank_rounds[b].eq(bank_rounds[b] + 1)
                with m.If(end_d[1]):
                    m.d.sync += bank_state[b].eq(self.FULL)

    def _back_end(self, m, banks, isum_r, scale_r, hpw, swords):
        """Walks a FILLING or FULL bank segment by segment (each over the tile's rows) as far as its sums are
        written, feeds isum, scale and exponent to the port's `PartAccumulator` (P of them with several
        vectors, one per vector of a group), keeps the rows' binary32 sums in the y registers and queues each
        row's last sum in a result FIFO (space for a tile is reserved before it starts); frees the bank after
        its last segment. With P > 1 pipeline k's results go to FIFO k and leave in the engine's order (a
        tile's rows for vector 0, then vector 1, ...). Returns the back end's active flag and whether results
        are reserved."""
        cfg, T, N = self._cfg, self._T, self._cfg.axi_ports
        W, V, P = cfg.weights_per_beat, cfg.gemv_vectors, self._parts
        G = -(-V // P)                               # vector groups: P vectors a walk step
        S = self._max_segments
        lS, lT, lV, lP, lG = ceil_log2(S), ceil_log2(T), ceil_log2(V), ceil_log2(P), ceil_log2(G)
        assert P & (P - 1) == 0 and lP + lG == lV, (V, P)
        d = self.dec
        lCB = ceil_log2(self._chunk_beats)
        bank_state, bank_rows, bank_rounds = banks
        assert T > FpAdd.LATENCY + 1, f"tile_rows ({T}) must exceed the FpAdd latency plus one"
        depth = 2 * T * G
        # the command's vectors: each row of a tile is nvec rows of the walk, (v, t); its vector groups and
        # how many of the vectors each pipeline takes (k, k + P, ...), registered from the decoder's
        nvec = d.nvec if V > 1 else Const(1)
        ngrp = Signal(range(G + 1)) if G > 1 else Const(1)
        counts = [Signal(range(G + 1), name=f"vectors_{k}") for k in range(P)] if P > 1 else [nvec]
        if G > 1:
            m.d.sync += ngrp.eq((nvec + P - 1) >> lP)
        if P > 1:
            m.d.sync += [c.eq(Mux(nvec > k, (nvec - k + P - 1) >> lP, 0)) for k, c in enumerate(counts)]
        res = []
        for k in range(P):
            f = fifo.SyncFIFOBuffered(width=32, depth=depth)
            m.submodules["res" if P == 1 else f"res{k}"] = f
            res.append(f)
        reserved = [Signal(range(depth + 1), name="reserved" if P == 1 else f"reserved_{k}") for k in range(P)]
        be_active = Signal()
        be_bank = Signal()
        be_s = Signal(range(S + 1))
        be_t = Signal(range(T))
        be_vg = Signal(range(G)) if G > 1 else None  # the vector group (P vectors: P x be_vg .. + P - 1)
        last_vg = Signal() if G > 1 else Const(1)    # be_vg == ngrp - 1, registered with be_vg
        be_trows = Signal(range(T + 1))
        be_gbase = Signal(range(T * (S + hpw) + 1))  # t * groups (masked: t * the groups' whole beats)
        be_g = Signal.like(be_s)                     # be_s >> gshift: the segment's group
        be_s1 = Signal(range(S + 2))                 # be_s + 1, registered with be_s
        full = Mux(be_bank, bank_state[1], bank_state[0]) != self.FREE     # filling or full: may start
        rounds = Mux(be_bank, bank_rounds[1], bank_rounds[0])
        # Segments of the tile whose sums are all written, registered: a cycle late, so never more than are
        # written (the count only grows while the back end walks the bank, and it starts a bank a cycle
        # after it leaves the last).
        seg_ready = Signal(range(S + 1))
        # Registered from the decoder's fields (valid from the cycle after `i_start`, before any bank fills):
        # segments per chunk round (log2) and segments per row less one.
        spc = Signal(range(32))
        be_nseg_m1 = Signal.like(d.nseg)
        # (an INT8 chunk holds half the columns of an INT4 one)
        spc_full = lCB + ceil_log2(W) - d.cmd.int8 - d.lseg if cfg.gemv_int8 else lCB + ceil_log2(W) - d.lseg
        m.d.sync += [spc.eq(spc_full), be_nseg_m1.eq(d.nseg - 1)]
        # a row's scale halfwords in the bank: the row's groups; masked, its whole beats of them
        gstride = Signal.like(d.groups)
        m.d.sync += gstride.eq(Mux(d.cmd.mask, ((d.groups + hpw - 1) >> ceil_log2(hpw)) << ceil_log2(hpw), d.groups)
                               if cfg.gemv_row_mask else d.groups)
        with m.If(Mux(be_bank, bank_state[1], bank_state[0]) == self.FULL):
            m.d.sync += seg_ready.eq(d.nseg)
        with m.Else():
            m.d.sync += seg_ready.eq(rounds << spc)
        # Room for a tile's results in every FIFO, registered: a cycle late, so never more than there is
        # (reads only add room, and a tile starts at most every T cycles).
        be_room = Signal()
        touts = [Signal(range(T * G + 1), name="touts" if P == 1 else f"touts_{k}") for k in range(P)]
        m.d.sync += [t.eq(c << lT) for t, c in zip(touts, counts)]
        m.d.sync += be_room.eq(Cat(*[f.level + r + t <= depth for f, r, t in zip(res, reserved, touts)]).all())
        be_start = Signal()
        m.d.comb += be_start.eq(~be_active & full & be_room)
        # be_s == be_nseg_m1 (`last`, set where be_s steps from `last1`, be_s1 == be_nseg_m1, and `last0`,
        # be_nseg_m1 == 0), the segment ends its group (`g_end`, used only at the segment's end, T cycles or
        # more after be_s steps), be_t == T - 1 (`t_end`, set with be_t) as registers.
        last, last1, last0, g_end, t_end = Signal(), Signal(), Signal(), Signal(), Signal()
        gmask = Signal.like(be_s)
        m.d.sync += [last1.eq(be_s1 == be_nseg_m1), last0.eq(be_nseg_m1 == 0), g_end.eq((be_s & gmask) == gmask),
                     gmask.eq((Const(1, len(be_s) + 1) << d.gshift) - 1)]
        with m.If(self.i_start):
            m.d.sync += [be_bank.eq(0), be_active.eq(0)]
        with m.Elif(be_start):
            m.d.sync += [be_active.eq(1), be_s.eq(0), be_s1.eq(1), be_g.eq(0), be_t.eq(0), be_gbase.eq(0),
                         be_trows.eq(Mux(be_bank, bank_rows[1], bank_rows[0])),
                         last.eq(last0), t_end.eq(T == 1)]
            if G > 1:
                m.d.sync += [be_vg.eq(0), last_vg.eq(ngrp == 1)]
        # Issue stage: read isum, scale, exponent.
        sidx = Signal(range(2 * T * (S + hpw) + 1))
        m.d.comb += [
            sidx.eq(be_gbase + be_g),
            isum_r.addr.eq(Cat(be_s[:lS], be_t, be_bank)),
            scale_r.addr.eq(Cat((sidx >> ceil_log2(hpw))[:ceil_log2(swords)], be_bank)),
            self.o_exp_addr.eq(be_s >> d.eshift),
        ]
        issue = Signal()
        m.d.comb += issue.eq(be_active & (be_s < seg_ready))
        first = be_s == 0
        with m.If(issue):
            m.d.sync += [be_t.eq(be_t + 1), be_gbase.eq(be_gbase + gstride), t_end.eq(be_t + 1 == T - 1)]
            with m.If(t_end):
                m.d.sync += t_end.eq(T == 1)
                m.d.sync += [be_t.eq(0), be_gbase.eq(0)]
                if G > 1:
                    m.d.sync += [be_vg.eq(be_vg + 1), last_vg.eq(be_vg + 2 == ngrp)]
                with m.If(last_vg):
                    if G > 1:
                        m.d.sync += [be_vg.eq(0), last_vg.eq(ngrp == 1)]
                    m.d.sync += [be_s.eq(be_s1), be_s1.eq(be_s1 + 1), be_g.eq(be_g + g_end), last.eq(last1)]
                    with m.If(last):
                        m.d.sync += [be_active.eq(0), be_bank.eq(~be_bank)]
                        for b in range(2):
                            with m.If(be_bank == b):
                                m.d.sync += bank_state[b].eq(self.FREE)
        with m.If(self.i_start):
            for b in range(2):
                m.d.sync += bank_state[b].eq(self.FREE)
        # the walk step's row, vector group and which of its P vectors the command has (pipeline 0's always)
        live = Cat(*[Cat(Const(k, lP), be_vg) < nvec for k in range(1, P)]) if P > 1 else Const(0, 0)
        tag = Cat(issue & (be_t < be_trows), first, last, be_t, *([be_vg[:lG]] if G > 1 else []), live)
        at_t, at_g, at_live = 3, 3 + lT, 3 + lT + lG
        # b1: memory data arrives.
        tag1, half1 = Signal(len(tag)), Signal(range(hpw))
        m.d.sync += [tag1.eq(tag), half1.eq(sidx[:ceil_log2(hpw)] if hpw > 1 else 0)]
        scale_half = scale_r.data.word_select(half1, 16) if hpw > 1 else scale_r.data[:16]
        fps = [self.fp] + ([self.fp_more[k] for k in range(P - 1)] if P > 1 else [])
        g1 = tag1[at_g:at_g + lG]
        for k, fp in enumerate(fps):
            vk = Cat(Const(k, lP), g1) if V > 1 else Const(0)
            m.d.comb += [fp.valid.eq(tag1[0] & (tag1[at_live + k - 1] if k else 1)),
                         fp.isum.eq(isum_r.data[vk] if V > 1 else isum_r.data[0]), fp.scale.eq(scale_half)]
        if V > 1:
            m.d.comb += self.o_exp_group.eq(g1)
        tag3 = _delay(m, tag1, PartAccumulator.PART_LATENCY - 1, "tag_part")
        tag4 = _delay(m, tag3, 1, "tag_y")
        tag5 = _delay(m, tag4, FpAdd.LATENCY, "tag_add")
        # In-order accumulation: y[v, t] = (first ? -0 : y[v, t]) + part, the addend selected from the y
        # registers a cycle before the addition and registered by the `EnginePort` (the row's last sum is written
        # LATENCY cycles after its addition and the row's next addition comes T > LATENCY + 1 cycles after it).
        # Register t * 2**lV + v; pipeline k takes vector P * group + k.
        y = [Signal(32, name=f"y_{t}") for t in range(T << lV)]

        def yidx(tg, k):
            return Cat(Const(k, lP), tg[at_g:at_g + lG], tg[at_t:at_t + lT]) if V > 1 else tg[at_t:at_t + lT]

        for k, fp in enumerate(fps):
            m.d.comb += fp.y.eq(Mux(tag3[1], NEG_ZERO, Cat(*y).word_select(yidx(tag3, k), 32)))
            valid5 = tag5[0] & (tag5[at_live + k - 1] if k else 1)
            with m.If(valid5):
                for i in range(T << lV):
                    if V == 1 or i % P == k:
                        with m.If(yidx(tag5, k) == i):
                            m.d.sync += y[i].eq(fp.sum)
            push = valid5 & tag5[2]
            m.d.comb += [res[k].w_en.eq(push), res[k].w_data.eq(fp.sum)]
            # a tile's reservation is added a cycle after its start (through `rsv_add`): the room is checked
            # again only after the walk
            rsv_add = Signal.like(reserved[k], name="rsv_add" if P == 1 else f"rsv_add_{k}")
            m.d.sync += rsv_add.eq(Mux(be_start, Mux(be_bank, bank_rows[1], bank_rows[0]) * counts[k], 0))
            with m.If(self.i_start):
                m.d.sync += [reserved[k].eq(0), rsv_add.eq(0)]
            with m.Else():
                m.d.sync += reserved[k].eq(reserved[k] + rsv_add - push)
        if P == 1:
            m.d.comb += [self.o_res.valid.eq(res[0].r_rdy), self.o_res.p.eq(res[0].r_data),
                         res[0].r_en.eq(self.o_res.ready)]
        else:
            self._result_order(m, res, nvec)
        return be_active, Cat(*[r != 0 for r in reserved]).any()

    def _result_order(self, m, res, nvec):
        """The results of P FIFOs (FIFO k: vectors k, k + P, ...) in the engine's order: per tile of the port,
        its rows for vector 0, then vector 1, ..., each a run of the tile's rows from the vector's FIFO."""
        cfg, T, N, V, P = self._cfg, self._T, self._cfg.axi_ports, self._cfg.gemv_vectors, self._parts
        lP = ceil_log2(P)
        left = Signal(signed(22))                    # the port's rows from this tile on
        pv = Signal(range(V))                        # the vector whose run leaves
        pn = Signal(range(T))                        # results of the run already out
        # Every decision from registers: the tile's rows (`rows`), the next tile's (`rows_nxt`, from `left` two
        # cycles after it changes: a tile before the port's last one is T x nvec results, so it is ready when
        # it is needed), the run's last result (`last_n`: pn + 1 == rows) and the tile's last vector (`last_v`:
        # pv + 1 == nvec), each set with the counters; `init`: the cycle after i_start.
        rows, rows_nxt = Signal(range(T + 1)), Signal(range(T + 1))
        last_n, last_v, init = Signal(), Signal(), Signal()
        left_nxt = Signal.like(left)                 # left - N * T, registered (rows_nxt a register further)
        m.d.sync += [left_nxt.eq(left - N * T), rows_nxt.eq(Mux(left_nxt < T, Mux(left_nxt < 0, 0, left_nxt), T)),
                     init.eq(self.i_start)]
        with m.If(self.i_start):
            m.d.sync += [left.eq(self.i_rows.as_signed() - self._index * T), pv.eq(0), pn.eq(0)]
        with m.If(init):
            first = Mux(left < T, Mux(left < 0, 0, left), T)
            m.d.sync += [rows.eq(first), last_n.eq(first == 1), last_v.eq(nvec == 1)]
        k = pv[:lP]
        m.d.comb += [self.o_res.valid.eq(Array(f.r_rdy for f in res)[k]),
                     self.o_res.p.eq(Array(f.r_data for f in res)[k])]
        for j, f in enumerate(res):
            m.d.comb += f.r_en.eq(self.o_res.ready & (k == j))
        with m.If(self.o_res.valid & self.o_res.ready):
            m.d.sync += [pn.eq(pn + 1), last_n.eq(pn + 2 == rows)]
            with m.If(last_n):
                m.d.sync += [pn.eq(0), pv.eq(pv + 1), last_n.eq(rows == 1), last_v.eq(pv + 2 == nvec)]
                with m.If(last_v):
                    m.d.sync += [pv.eq(0), left.eq(left_nxt), rows.eq(rows_nxt), last_n.eq(rows_nxt == 1),
                                 last_v.eq(nvec == 1)]


def _below_set(bits: Value) -> Value:
    """Bit i: a bit of `bits` below i is set (a prefix OR as a tree of halves, no carry chain); ``bits &
    _below_set(bits)`` is `bits` without its lowest set bit."""
    if len(bits) == 1:
        return Const(0, 1)
    h = len(bits) // 2
    return Cat(_below_set(bits[:h]), _below_set(bits[h:]) | Mux(bits[:h].any(), (1 << (len(bits) - h)) - 1, 0))


class SparsePort(wiring.Component):
    """One weight port of the sparse mode: a column-major GEMV that never fetches the weight columns of
    zero activations (docs/gemv.md, "Sparse mode").

    The port owns rows ``[index * prow, index * prow + rows_p)`` (``prow`` = ``dec.prow``, a multiple of W;
    ``rows_p`` = what is left of the matrix, possibly 0). Column k of the matrix is ``rows / 2`` bytes at
    ``wbase + k * rows / 2`` (INT4, rows 2i / 2i+1 in the low / high nibble), so the port's share of a
    column is one contiguous transfer of ``rows_p / 2`` bytes whose beat j holds rows ``jW .. jW + W - 1``;
    the binary16 scales are group-major (``[groups, rows]``): group g's scales of the port's rows are one
    contiguous transfer of ``rows_p * 2`` bytes.

    - **Sequencer.** Walks the segments in order; at the first segment of a group it fetches the group's
      scales, then scans the segment's activation words (the port's activation memory, shared with `GemvPort`) and issues
      one transfer per non-zero activation, lowest column first; a segment ends with an END item. Every
      transfer (and END) is announced to the front end through an item FIFO, in order.
    - **Front end.** Scale beats go to the scale bank of the group (double-buffered); the beats of a column
      update the segment's isum bank (double-buffered, `update_lanes` = W / CYCLES_PER_BEAT sums per word)
      with ``isum[r] += w[r, k] * a[k]``, W / CYCLES_PER_BEAT rows per cycle (a read-modify-write: a column
      walks CYCLES_PER_BEAT >= 2 words a beat, so a word is read again at least a cycle after its write; at a
      whole beat per cycle the read is transparent to the write); the first column of a segment overwrites.
    - **Back end.** For every segment, *including the segments without any non-zero activation* (their sums
      are 0 and their parts ±0 are added as in `sim.numerics.gemv`: they decide the sign of zero results),
      walks the port's rows: ``part = ldexp(fp32(isum) * fp32(scale), e)``, ``y[r] = y[r] + part`` with y in a
      memory (the first segment adds ``-0 + part``), at least ``FpAdd.LATENCY + 3`` issue cycles per walk so a
      row's next addition reads the previous one's result; the last segment's sums go to the result FIFO.
      One part per pipeline and cycle: P = `gemv_parts` binary32 pipelines take the P adjacent rows
      ``P * q + k`` of row group q (row ``P * q + k`` always on pipeline k), which share an isum word, a scale
      word and the segment's exponent; the binary32 side bounds the sparse mode (rows_p / P cycles per
      segment). With P > 1 the isum banks are four instead of two, so the front end's variance from segment
      to segment does not reach the back end.

    Members
    -------
    i_start, dec, dma_cmd, dma_data, i_dma_busy, o_act_addr, i_act_data, o_exp_addr, fp : as `GemvPort`
    fp_more : Out (P = `gemv_parts` > 1): the port's other `PartAccumulator`s, pipeline 1 .. P-1
    o_res : Out(stream(32)): the port's row results, in row order
    o_idle : Out(1)
    """

    #: Cycles the front end spends on one weight beat: it updates W / CYCLES_PER_BEAT rows per cycle.
    CYCLES_PER_BEAT = 4

    def __init__(self, cfg: HardwareConfig, index: int, *, max_cols: int, max_segments: int, scale_words: int):
        self._cfg, self._index = cfg, index
        self._max_cols, self._max_segments = max_cols, max_segments
        self._prow_max = cfg.gemv_sparse_max_rows // cfg.axi_ports
        P = self._parts = gemv_parts(cfg)
        members = _datapath_members(cfg, max_cols, max_segments, scale_words)
        if P > 1:
            # rows_p (even) is a whole number of row groups; adjacent rows share an isum word and a scale word
            L, hpw = self.update_lanes, cfg.bytes_per_beat // 2
            assert P == 2 and L % P == 0 and hpw % P == 0 and self._prow_max % P == 0
            members["fp_more"] = Out(_part_signature(cfg)).array(P - 1)
        super().__init__(members)

    @property
    def update_lanes(self) -> int:
        """Rows of isum the front end updates per cycle (kv260: 8 of a beat's 32)."""
        return max(1, self._cfg.weights_per_beat // self.CYCLES_PER_BEAT)

    #: Issue cycles of the shortest row walk: a row's y is read two cycles before its addition and written
    #: FpAdd.LATENCY cycles after it.
    MIN_WALK = FpAdd.LATENCY + 3

    @property
    def min_walk(self) -> int:
        return self.MIN_WALK

    #: Item kinds in the FIFO from the sequencer to the front end.
    SCALE, COL, END = 0, 1, 2

    @staticmethod
    def _item_head(m, items, item_layout):
        """The front end takes the items from a two-entry buffer behind the FIFO, so that its pop (from the item's
        kind and the beat's handshake) reaches only the buffer's flags, not the FIFO's level: (buffer, item)."""
        head = _two_entry_buffer(m, item_layout.size, "item")
        m.d.comb += [head.w_en.eq(items.r_rdy), head.w_data.eq(items.r_data),
                     items.r_en.eq(items.r_rdy & head.w_rdy)]
        item = Signal(item_layout)
        m.d.comb += item.eq(head.r_data)
        return head, item

    def _item_layout(self):
        return data.StructLayout({"kind": 2, "first": 1, "a": signed(self._cfg.act_bits)})

    def _sequencer(self, m, items, room, rows_p, half_rows, nseg_m1, gmask, pofs, started, go):
        """The DMA commands (a group's scales, a transfer per non-zero activation's column) and their items,
        in order, segment by segment; returns its FSM."""
        cfg = self._cfg
        W = cfg.weights_per_beat
        lW = ceil_log2(W)
        S = self._max_segments
        d = self.dec
        ab = cfg.axi_addr_bits
        SCALE, COL, END = self.SCALE, self.COL, self.END
        item_layout = self._item_layout()
        sq_s = Signal(range(S + 1))
        sq_gfirst = Signal()                         # the segment is its group's first, registered with sq_s
        sq_j = Signal(range(self._max_cols // W + 1))
        sq_jlast = Signal.like(sq_j)
        sq_mask = Signal(W)
        sq_q = Signal(data.ArrayLayout(signed(cfg.act_bits), W))
        sq_qnz = Signal(W)                           # sq_q[i] != 0, registered with sq_q
        sq_any = Signal()
        sq_saddr = Signal(ab)                        # this group's scales of this port
        # The segment's columns [seg_lo, seg_hi): stepped segment by segment (seg_end unclamped); its first
        # and last word and the lanes of the word being scanned that lie in it (`in_seg`, registered at
        # the word's Load).
        cw = ceil_log2(2 * self._max_cols + 1)
        seg_lo, seg_end, seg_size = Signal(cw), Signal(cw), Signal(cw)
        # The segment's last column, registered ahead (`hi_first`: the first segment's, from the decoder's
        # fields; `hi_next`: the next segment's, from seg_end + seg_size two registers on, where seg_end steps
        # at most every five cycles) and taken where the segment starts.
        seg_nxt, hi_next, hi_first = Signal(cw), Signal(cw), Signal(cw)
        first_end = Const(1, cw) << d.lseg
        m.d.sync += [seg_nxt.eq(seg_end + seg_size), hi_next.eq(Mux(seg_nxt > d.cmd.cols, d.cmd.cols, seg_nxt) - 1),
                     hi_first.eq(Mux(first_end > d.cmd.cols, d.cmd.cols, first_end) - 1)]
        sq_jfirst, sq_hlast = Signal.like(sq_j), Signal(range(W))
        in_seg = Signal(W)
        at_first, at_last = Signal(), Signal()       # the word is the segment's first, last (from Load on)
        # The mask in groups of G lanes, each with a "not empty" flag registered with it (`sq_gnz`).
        G = min(W, 8)
        NG = W // G
        sq_gnz = Signal(NG)
        sq_nz = sq_gnz.any()                         # sq_mask != 0

        def group_flags(mask):
            return Cat(*[mask[g * G:(g + 1) * G].any() for g in range(NG)])
        # A column's transfer starts at its activation word's address (`word_addr`: stepped with the word, a
        # word's W columns apart) plus the lane's offset, lane * rows / 2, from a table the port writes at
        # the command's start, one lane a cycle (W cycles, while the first scales are on their way).
        off_bits = len(half_rows) + lW
        word_addr = Signal(ab)
        m.submodules.lane_off = lane_mem = Memory(shape=unsigned(off_bits), depth=W, init=[])
        lane_w, lane_r = lane_mem.write_port(), lane_mem.read_port(domain="comb")
        fill = Signal(range(W + 1), init=W)         # lanes of the table written
        fill_off = Signal(off_bits)
        filled = Signal(init=1)                     # fill == W, as a register
        with m.If(started):
            m.d.sync += [fill.eq(0), fill_off.eq(0), filled.eq(0)]
        with m.Elif(fill != W):
            m.d.comb += [lane_w.en.eq(1), lane_w.addr.eq(fill), lane_w.data.eq(fill_off)]
            m.d.sync += [fill.eq(fill + 1), fill_off.eq(fill_off + half_rows), filled.eq(fill == W - 1)]
        # The mask's lowest non-zero lane, one-hot (`pick`), and the mask without it (`rest`), group by group:
        # the lowest non-empty group (`low_g`, from the registered flags) loses its lowest lane (the borrow of
        # its G lanes less one), the others keep theirs, with no carry through the word. The groups' flags of
        # `rest` are registered a cycle later (state Flags), from the mask register alone.
        low_g = sq_gnz & ~_below_set(sq_gnz)
        rest_g, pick_g = [], []
        for g in range(NG):
            mg = sq_mask[g * G:(g + 1) * G]
            rg = mg & (mg - 1)[:G]                   # the borrow of mg - 1: a carry chain of G bits
            rest_g.append(Mux(low_g[g], rg, mg))
            pick_g.append(Mux(low_g[g], mg & ~rg, 0))
        rest, pick = Cat(*rest_g), Cat(*pick_g)
        # Two registered stages from the mask to the DMA: the lane picked (`pk_*`: one-hot, with a copy of the
        # word's activations), then its transfer (`tx_*`, the DMA's command and the front end's item, written
        # together), so that the pick, then the lane's index, the lane table, the address adder and the
        # lane's activation take a cycle each and the DMA sees a register. A lane moves on only into an empty
        # transfer stage, so every decision is a register's: a transfer every other cycle at most, where the
        # front end takes at least `CYCLES_PER_BEAT` cycles for each (a transfer is at least a beat).
        pk_valid, pk_lane, pk_first = Signal(), Signal(W), Signal()
        pk_q, pk_word = Signal.like(sq_q), Signal(ab)
        pk_low = Signal(range(W))                   # pk_lane's index
        for k in range(lW):
            m.d.comb += pk_low[k].eq(Cat(*[pk_lane[i] for i in range(W) if (i >> k) & 1]).any())
        tx_valid, tx_first, tx_a, tx_addr = Signal(), Signal(), Signal(signed(cfg.act_bits)), Signal(ab)
        cmd = self.dma_cmd
        item_in = Signal(item_layout)
        m.d.comb += items.w_data.eq(item_in)
        tx_fire = tx_valid & cmd.ready & room
        pk_move = pk_valid & ~tx_valid & filled
        pk_free = ~pk_valid | pk_move
        m.d.comb += lane_r.addr.eq(pk_low)
        with m.If(pk_move):
            m.d.sync += [tx_valid.eq(1), tx_first.eq(pk_first), tx_a.eq(one_hot_mux(pk_lane, list(pk_q))),
                         tx_addr.eq(pk_word + lane_r.data), pk_valid.eq(0)]
        with m.Elif(tx_fire):
            m.d.sync += tx_valid.eq(0)
        # The command's and the item's fields from registers alone: a transfer's while `tx_valid`, else the
        # group's scales' (state Scale) or the segment's END (state End, `sq_at_end`); both wait for `tx_valid`
        # to clear, and a field matters only where its write is enabled.
        sq_at_end = Signal()
        m.d.comb += [cmd.p.addr.eq(Mux(tx_valid, tx_addr, sq_saddr)),
                     cmd.p.nbytes.eq(Mux(tx_valid, rows_p >> 1, rows_p << 1)),
                     item_in.kind.eq(Mux(tx_valid, COL, Mux(sq_at_end, END, SCALE))),
                     item_in.first.eq(Mux(tx_valid, tx_first, ~sq_any)), item_in.a.eq(tx_a)]
        with m.If(tx_valid):
            # the item goes in with its command (both only while `room`)
            m.d.comb += [cmd.valid.eq(room), items.w_en.eq(cmd.ready & room)]
        drained = ~pk_valid & ~tx_valid
        with m.FSM(name="seq") as seq_fsm:
            with m.State("Idle"):
                with m.If(go):
                    # pofs = p * prow, an even number (prow is a multiple of W)
                    m.d.sync += [sq_s.eq(0), sq_gfirst.eq(1), sq_any.eq(0), sq_saddr.eq(d.cmd.sbase + pofs * 2),
                                 sq_j.eq(0), word_addr.eq(d.cmd.wbase + (pofs >> 1)),
                                 seg_lo.eq(0), seg_end.eq(first_end), seg_size.eq(first_end),
                                 sq_jlast.eq(hi_first >> lW), sq_hlast.eq(hi_first[:lW])]
                    m.next = "Scale"
            with m.State("Scale"):
                # The group's scales, at its first segment.
                with m.If(sq_gfirst):
                    m.d.comb += [cmd.valid.eq(room), items.w_en.eq(cmd.ready & room)]
                    with m.If(cmd.ready & room):
                        m.d.sync += sq_saddr.eq(sq_saddr + (d.cmd.rows << 1))
                        m.next = "Load"
                with m.Else():
                    m.next = "Load"
                # the segment's first word is the last one's, or the next (the segments are contiguous)
                first_j = seg_lo >> lW
                m.d.sync += [sq_j.eq(first_j), sq_jfirst.eq(first_j)]
                with m.If(first_j != sq_j):
                    m.d.sync += word_addr.eq(word_addr + (half_rows << lW))
            # A word: its read (Load), its activations registered (Fetch), its mask (Mask), a lane per cycle
            # (Emit); every decision from a register.
            with m.State("Load"):
                m.d.comb += self.o_act_addr.eq(sq_j)
                m.d.sync += [at_first.eq(sq_j == sq_jfirst), at_last.eq(sq_j == sq_jlast)]
                m.next = "Fetch"
            with m.State("Fetch"):
                in_lo = Mux(at_first, seg_lo[:lW], 0)
                in_hi = Mux(at_last, sq_hlast, W - 1)
                m.d.sync += [in_seg.eq(Cat(*[(in_lo <= i) & (in_hi >= i) for i in range(W)])),
                             sq_q.eq(self.i_act_data), sq_qnz.eq(Cat(*[q != 0 for q in self.i_act_data]))]
                m.next = "Mask"
            with m.State("Mask"):
                mask = sq_qnz & in_seg
                m.d.sync += [sq_mask.eq(mask), sq_gnz.eq(group_flags(mask))]
                m.next = "Emit"
            with m.State("Emit"):
                with m.If(sq_nz):
                    with m.If(pk_free):
                        m.d.sync += [pk_valid.eq(1), pk_lane.eq(pick), pk_q.eq(sq_q), pk_first.eq(~sq_any),
                                     pk_word.eq(word_addr), sq_mask.eq(rest), sq_any.eq(1)]
                        m.next = "Flags"
                with m.Elif(at_last):
                    m.d.sync += sq_at_end.eq(1)
                    m.next = "End"
                with m.Else():
                    m.d.sync += [sq_j.eq(sq_j + 1), word_addr.eq(word_addr + (half_rows << lW))]
                    m.next = "Load"
            with m.State("Flags"):
                # A lane every other cycle, the pick stage's own rate (a lane moves on only into an empty
                # transfer stage, which a transfer leaves a cycle after it enters at the earliest).
                m.d.sync += sq_gnz.eq(group_flags(sq_mask))
                m.next = "Emit"
            with m.State("End"):
                with m.If(drained):                  # the segment's transfers are announced first
                    m.d.comb += items.w_en.eq(room)
                    with m.If(room):
                        m.d.sync += [sq_at_end.eq(0), sq_s.eq(sq_s + 1), sq_gfirst.eq((sq_s & gmask) == gmask),
                                     sq_any.eq(0),
                                     seg_lo.eq(seg_end),
                                     seg_end.eq(seg_nxt), sq_jlast.eq(hi_next >> lW), sq_hlast.eq(hi_next[:lW])]
                        with m.If(sq_s == nseg_m1):
                            m.next = "Idle"
                        with m.Else():
                            m.next = "Scale"
        return seq_fsm

    def _memory_data(self, m, tag, tag1, be_r, be_s, bank_empty, isum_rb, scale_r, L, hpw, P, NB):
        """The back end's stage b1: the walk's tag into `tag1`, and each pipeline's isum (0 for an empty bank's
        segment), scale and valid from the isum and scale words read for it (row P·q + k on pipeline k, lane and
        scale half k of the group's P in the word). Returns the pipelines' part ports."""
        cfg, fp = self._cfg, self.fp
        lL, lhpw, lP, lNB = ceil_log2(L), ceil_log2(hpw), ceil_log2(P), ceil_log2(NB)
        fps = [fp]
        if P > 1:
            # row P * q + k on pipeline k: lane (and scale half) k of the group's P in the word
            lane1 = Signal(max(1, lL - lP))
            half1 = Signal(max(1, lhpw - lP))
            empty1 = Signal()
            m.d.sync += [tag1.eq(tag), lane1.eq(be_r[:lL - lP] if L > P else 0),
                         half1.eq(be_r[:lhpw - lP] if hpw > P else 0),
                         empty1.eq(bank_empty.bit_select(be_s[:lNB], 1))]
            fps = [fp] + [self.fp_more[k] for k in range(P - 1)]
            for k, f in enumerate(fps):
                isum_k = Signal(signed(cfg.acc_bits), name=f"isum1_{k}")
                lane_k = Cat(Const(k, lP), lane1[:lL - lP])
                half_k = Cat(Const(k, lP), half1[:lhpw - lP])
                m.d.comb += [isum_k.eq(Mux(empty1, 0, isum_rb.data[lane_k])), f.valid.eq(tag1.valid),
                             f.isum.eq(isum_k), f.scale.eq(scale_r.data.word_select(half_k, 16))]
        else:
            lane1 = Signal(range(L))
            half1 = Signal(range(hpw))
            empty1 = Signal()
            m.d.sync += [tag1.eq(tag), lane1.eq(be_r[:lL] if L > 1 else 0), half1.eq(be_r[:lhpw] if hpw > 1 else 0),
                         empty1.eq(bank_empty.bit_select(be_s[:lNB], 1))]
            isum1 = Signal(signed(cfg.acc_bits))
            m.d.comb += isum1.eq(Mux(empty1, 0, isum_rb.data[lane1]))
            scale_half = scale_r.data.word_select(half1, 16) if hpw > 1 else scale_r.data[:16]
            m.d.comb += [fp.valid.eq(tag1.valid), fp.isum.eq(isum1), fp.scale.eq(scale_half)]
        return fps

    def elaborate(self, platform):
        m = Module()
        cfg, p = self._cfg, self._index
        W, B = cfg.weights_per_beat, cfg.bytes_per_beat
        lW = ceil_log2(W)
        hpw = B // 2                                 # binary16 scales per beat
        PR = self._prow_max                          # most rows per port
        S = self._max_segments
        d = self.dec
        ab = cfg.axi_addr_bits

        L = self.update_lanes                        # isum rows updated per cycle, per memory word
        lL, Q = ceil_log2(L), W // L                 # Q cycles per weight beat
        P = self._parts                              # binary32 pipelines: rows per back-end issue (a row group)
        lP = ceil_log2(P)
        NB = SPARSE_BANKS                            # isum banks (and scale banks)
        lNB = ceil_log2(NB)
        # --- memories ------------------------------------------------------------------------------------
        # Partial sums bounded as a segment's INT4 x INT8 ones (sparse: INT4 weights on any engine; kv260: 19 bits).
        isum_layout = data.ArrayLayout(signed(segment_sum_bits(cfg.act_block, cfg.act_bits)), L)
        # In block RAM whatever its depth (a shallow bank of wide words would otherwise go to LUTRAM).
        m.submodules.isum_mem = isum_mem = Memory(shape=isum_layout, depth=NB * (PR // L), init=[],
                                                  attrs={"ram_style": "block"})
        isum_w = isum_mem.write_port()
        # The front end's read-modify-write reads a word the cycle before it writes it back. With Q >= 2 words
        # per beat a column walks at least two words, so a word's next read comes at least a cycle after its
        # write: no transparency (which Yosys builds in the fabric, a register of the written word and a bypass
        # per bit). With Q = 1 a port of at most W rows updates one word every cycle, through a transparent read.
        isum_ra = isum_mem.read_port(transparent_for=(isum_w,) if Q == 1 else ())
        isum_rb = isum_mem.read_port()                               # back end
        swords = _sparse_scale_words(cfg)
        # the scale banks are the port's scale memory (shared with the dense datapath, `EnginePort`)
        scale_w = SimpleNamespace(en=self.o_scale_wen, addr=self.o_scale_waddr)
        scale_r = SimpleNamespace(addr=self.o_scale_raddr, data=self.i_scale_rdata)
        # y of a row group: P binary32 sums per word
        y_shape = data.ArrayLayout(unsigned(32), P) if P > 1 else unsigned(32)
        m.submodules.y_mem = y_mem = Memory(shape=y_shape, depth=PR // P, init=[])
        y_w, y_r = y_mem.write_port(), y_mem.read_port()

        # --- the command, per port -------------------------------------------------------------------------
        rows_p = Signal(range(PR + 1))               # this port's rows
        half_rows = Signal(20)                       # column stride in bytes
        nseg_m1 = Signal(range(S + 1))
        gmask = Signal(range(S + 1))                 # segments per group - 1
        pofs = Signal((p * d.prow).shape())          # the port's first row
        left = Signal(signed(len(d.cmd.rows) + 1))   # the matrix's rows from this port's first on
        setup, setup2 = Signal(), Signal()
        with m.If(self.i_start):
            m.d.sync += [pofs.eq(_times(d.prow, p)),
                         half_rows.eq(d.cmd.rows >> 1), nseg_m1.eq(d.nseg - 1),
                         gmask.eq((Const(1, 17) << d.gshift) - 1)]
        with m.If(setup):
            m.d.sync += left.eq(d.cmd.rows.as_signed() - pofs)
        with m.If(setup2):
            m.d.sync += rows_p.eq(Mux(left <= 0, 0, Mux(left > d.prow, d.prow, left)))
        started = Signal()                           # rows_p is valid from the third cycle after i_start
        rows_nz = Signal()                           # rows_p != 0, registered with it
        m.d.sync += [setup.eq(self.i_start), setup2.eq(setup), started.eq(setup2)]
        with m.If(setup2):
            m.d.sync += rows_nz.eq(left > 0)
        go = started & rows_nz

        # --- sequencer: DMA commands and the item FIFO -----------------------------------------------------
        SCALE, COL, END = self.SCALE, self.COL, self.END
        item_layout = self._item_layout()
        # The sequencer's writes reach the FIFO through a register (`item_wr`), so that no path runs from its
        # state into the FIFO's level. It writes while `room`, a register: the FIFO held at most depth - 3
        # items a cycle before, and the writes of that cycle, the one before (in the register) and this one are
        # not in that count, so a write while `room` always fits (19 items at most, at least the 16 an
        # unregistered `w_rdy` at depth 16 would allow).
        m.submodules.items = items = fifo.SyncFIFOBuffered(width=item_layout.size, depth=19)
        item_wr = Signal(data.StructLayout({"en": 1, "data": item_layout}))
        seq_items = wiring.Signature({"w_en": Out(1), "w_data": Out(item_layout)}).create()
        m.d.sync += [item_wr.en.eq(seq_items.w_en), item_wr.data.eq(seq_items.w_data)]
        m.d.comb += [items.w_en.eq(item_wr.en), items.w_data.eq(item_wr.data)]
        room = Signal()
        m.d.sync += room.eq(items.level <= items.depth - 3)
        seq_fsm = self._sequencer(m, seq_items, room, rows_p, half_rows, nseg_m1, gmask, pofs, started, go)

        # --- front end -------------------------------------------------------------------------------------
        # Segments whose sums are written (fe_s) / walked by the back end (be_sdone); scale groups loaded
        # (fe_g) / finished by the back end (be_gdone). A bank may be refilled once the back end is done with
        # the segment (group) NB before.
        fe_s = Signal(range(S + 2))
        fe_g = Signal(range(S + 2))
        be_sdone = Signal(range(S + 2))
        be_gdone = Signal(range(S + 2))
        fe_sw = Signal(range(swords + 1))
        fe_j = Signal(range(PR // L + 1))           # isum word: beat j of the column is words jQ .. jQ + Q - 1
        head, item = self._item_head(m, items, item_layout)
        beat = self.dma_data
        bank_empty = Signal(NB)                      # the segment in the bank had no non-zero activation
        # Registered, from this cycle's counts and whether the front end's count steps (`s_step`, `g_step`):
        # the back end's count is a cycle old, which only delays a bank's release by a cycle.
        s_free, g_free = Signal(), Signal()
        s_step, g_step = Signal(), Signal()
        m.d.sync += [s_free.eq(Mux(s_step, fe_s + 1 < be_sdone + NB, fe_s < be_sdone + NB)),
                     g_free.eq(Mux(g_step, fe_g + 1 < be_gdone + NB, fe_g < be_gdone + NB))]
        f_valid = Signal()
        f_first = Signal()
        f_addr = Signal(range(NB * (PR // L)))
        f_prod = Signal(data.ArrayLayout(signed(cfg.WEIGHT_BITS + cfg.act_bits), L))
        # This cycle's L weights: part fe_j mod Q of the beat (held on the stream until its last part).
        wq = Signal(data.ArrayLayout(signed(cfg.WEIGHT_BITS), L))
        part = fe_j[:ceil_log2(Q)] if Q > 1 else 0
        m.d.comb += wq.eq(beat.p.data.word_select(part, cfg.WEIGHT_BITS * L) if Q > 1 else beat.p.data)
        beat_done = Signal(init=int(Q == 1))              # part == Q - 1, registered with fe_j
        col_beat = Signal()
        with m.If(head.r_rdy):
            with m.Switch(item.kind):
                with m.Case(SCALE):
                    with m.If(g_free):
                        m.d.comb += [beat.ready.eq(1), scale_w.en.eq(beat.valid),
                                     scale_w.addr.eq(Cat(fe_sw[:ceil_log2(swords)], fe_g[:lNB]))]
                        with m.If(beat.valid):
                            m.d.sync += fe_sw.eq(fe_sw + 1)
                            with m.If(beat.p.last):
                                m.d.comb += [head.r_en.eq(1), g_step.eq(1)]
                                m.d.sync += [fe_sw.eq(0), fe_g.eq(fe_g + 1)]
                with m.Case(COL):
                    with m.If(s_free):
                        m.d.comb += [beat.ready.eq(beat_done), col_beat.eq(beat.valid)]
                        with m.If(beat.valid):
                            m.d.sync += [fe_j.eq(fe_j + 1), beat_done.eq((part == Q - 2) if Q > 1 else 1)]
                            with m.If(beat.p.last & beat_done):
                                m.d.comb += head.r_en.eq(1)
                                m.d.sync += [fe_j.eq(0), beat_done.eq(int(Q == 1))]
                with m.Case(END):
                    with m.If(s_free):
                        m.d.comb += [head.r_en.eq(1), s_step.eq(1)]
                        m.d.sync += fe_s.eq(fe_s + 1)
                        for b in range(NB):
                            with m.If(fe_s[:lNB] == b):
                                m.d.sync += bank_empty[b].eq(item.first)
        # The L products: each a DSP48E2 with its A/B and M registers (`DspMacc` without P), then a fabric
        # register (`f_prod`), three cycles from the weights. The word's address, valid and first flag follow
        # through two registers: the isum word is read in the cycle before its products reach `f_prod` and
        # written back with their sum in the next (read-modify-write).
        pw = ceil_log2(PR // L)
        pipe = _delay(m, Cat(col_beat, item.first, fe_j[:pw], fe_s[:lNB]), 2, "prod")
        m.d.comb += isum_ra.addr.eq(pipe[2:])
        m.d.sync += [f_valid.eq(pipe[0]), f_first.eq(pipe[1]), f_addr.eq(isum_ra.addr)]
        for i in range(L):
            m.submodules[f"prod{i}"] = mul = DspMacc(cfg.act_bits, cfg.WEIGHT_BITS, preg=False)
            m.d.comb += [mul.i_a.eq(item.a), mul.i_b.eq(wq[i]), mul.i_restart.eq(0)]
            m.d.sync += f_prod[i].eq(mul.o_p[:cfg.WEIGHT_BITS + cfg.act_bits])
        m.d.comb += [isum_w.en.eq(f_valid), isum_w.addr.eq(f_addr)]
        # The first column of a segment adds to 0: a gate in front of the adder's input, in the adder's LUTs.
        for i in range(L):
            m.d.comb += isum_w.data[i].eq(Mux(f_first, 0, isum_ra.data[i]) + f_prod[i])
        # A segment's bank is complete four cycles after its END (the last write has landed).
        end_d = _delay(m, head.r_en & (item.kind == END), 4, "end")
        fe_full = Signal(range(S + 2))
        with m.If(end_d):
            m.d.sync += fe_full.eq(fe_full + 1)

        # --- back end --------------------------------------------------------------------------------------
        # The walk counts row groups (P rows, one per pipeline); the result FIFO takes a row group per entry.
        depth = 32 // P
        m.submodules.res = res = fifo.SyncFIFOBuffered(width=32 * P, depth=depth)
        pend = Signal(range(depth + 1))              # last-segment results issued, not yet in the FIFO
        be_active = Signal()
        be_s = Signal(range(S + 1))
        be_s1 = Signal(range(S + 2))                 # be_s + 1, registered with be_s
        be_r = Signal(range(max(PR // P, self.min_walk) + 1))
        walk_m1 = Signal.like(be_r)                  # registered: rows_p is stable from `started` on
        rows_m1 = Signal.like(rows_p)                # likewise (the last row group)
        groups_p = rows_p >> lP if P > 1 else rows_p # the port's row groups
        m.d.sync += [walk_m1.eq(Mux(groups_p < self.min_walk, self.min_walk, groups_p) - 1),
                     rows_m1.eq(groups_p - 1)]
        # The walk's conditions, registered along with the counters they compare: the segment is the last
        # (`be_last`), the row is one of the port's (`row_ok`), the segment's sums are written (`be_avail`,
        # from a count a cycle old: never more than are written) and the result FIFO has room (`be_room`,
        # from a level a cycle old: reads only add room).
        be_last, row_ok, be_avail, be_room = Signal(), Signal(), Signal(), Signal()
        issue = Signal()
        res_used = res.level + pend
        last_issue = issue & row_ok & be_last
        m.d.sync += [be_avail.eq(fe_full > be_s), be_room.eq(Mux(last_issue, res_used + 1 < depth, res_used < depth))]
        m.d.comb += issue.eq(be_active & be_avail & (~be_last | ~row_ok | be_room))
        # be_r == walk_m1 (`r_last`, set with be_r from be_r1 = be_r + 1) and the group's end (`g_last`; be_s
        # steps at most every `min_walk` cycles) as registers.
        r_last, g_last, be_r1 = Signal(name="r_last"), Signal(name="g_last"), Signal.like(be_r, name="be_r1")
        m.d.sync += [r_last.eq(be_r == walk_m1), g_last.eq((be_s & gmask) == gmask)]
        with m.If(issue):
            # row_ok is be_r < groups_p (be_r counts up from 0 by one): be_r + 1 < groups_p
            m.d.sync += [be_r.eq(be_r1), be_r1.eq(be_r1 + 1), row_ok.eq(row_ok & (be_r != rows_m1)),
                         r_last.eq(be_r1 == walk_m1)]
            with m.If(r_last):
                m.d.sync += [be_r.eq(0), be_r1.eq(1), r_last.eq(0), row_ok.eq(1), be_s.eq(be_s1), be_s1.eq(be_s1 + 1),
                             be_sdone.eq(be_sdone + 1), be_last.eq(be_s1 == nseg_m1), be_avail.eq(fe_full > be_s1)]
                with m.If(g_last | be_last):
                    m.d.sync += be_gdone.eq(be_gdone + 1)
                with m.If(be_last):
                    m.d.sync += be_active.eq(0)
        with m.If(go):
            m.d.sync += [be_active.eq(1), be_s.eq(0), be_s1.eq(1), be_r.eq(0), be_r1.eq(1), be_sdone.eq(0),
                         be_gdone.eq(0), fe_s.eq(0), fe_g.eq(0), fe_sw.eq(0), fe_j.eq(0), fe_full.eq(0),
                         be_last.eq(nseg_m1 == 0), row_ok.eq(1), be_avail.eq(0), s_free.eq(1), g_free.eq(1),
                         beat_done.eq(int(Q == 1))]
        lhpw = ceil_log2(hpw)
        m.d.comb += [
            isum_rb.addr.eq(Cat((be_r >> (lL - lP))[:ceil_log2(PR // L)], be_s[:lNB])),
            scale_r.addr.eq(Cat((be_r >> (lhpw - lP))[:ceil_log2(swords)], (be_s >> d.gshift)[:lNB])),
            self.o_exp_addr.eq(be_s >> d.eshift),
        ]
        tag_layout = data.StructLayout({"valid": 1, "first": 1, "last": 1, "r": range(PR // P)})
        tag = Signal(tag_layout)
        m.d.comb += [tag.valid.eq(issue & row_ok), tag.first.eq(be_s == 0), tag.last.eq(be_last),
                     tag.r.eq(be_r)]
        # b1: memory data.
        tag1 = Signal(tag_layout)
        fp = self.fp
        fps = self._memory_data(m, tag, tag1, be_r, be_s, bank_empty, isum_rb, scale_r, L, hpw, P, NB)
        assert PartAccumulator.PART_LATENCY >= 2
        tag4r = data.View(tag_layout, _delay(m, tag1.as_value(), PartAccumulator.PART_LATENCY - 2, "tag_part"))
        tag4p = data.View(tag_layout, _delay(m, tag4r.as_value(), 1, "tag_read"))
        tag4 = data.View(tag_layout, _delay(m, tag4p.as_value(), 1, "tag_add"))
        # y[r] is read two cycles before the addition and registered by the `EnginePort` (-0 for the first
        # segment).
        if P > 1:
            # the row group's P sums in one y word and one result entry, pipeline k's in lane k
            tag5 = data.View(tag_layout, _delay(m, tag4.as_value(), FpAdd.LATENCY, "tag_sum"))
            push = tag5.valid & tag5.last
            sums = Cat(*[f.sum for f in fps])
            for k, f in enumerate(fps):
                m.d.comb += f.y.eq(Mux(tag4p.first, NEG_ZERO, y_r.data[k]))
            m.d.comb += [y_r.addr.eq(tag4r.r), y_w.en.eq(tag5.valid & ~tag5.last), y_w.addr.eq(tag5.r),
                         y_w.data.eq(sums), res.w_en.eq(push), res.w_data.eq(sums)]
            # The port's stream, a row at a time: lane osel of the head entry, popped with its last lane.
            osel = Signal(lP)
            m.d.comb += [self.o_res.valid.eq(res.r_rdy), self.o_res.p.eq(res.r_data.word_select(osel, 32)),
                         res.r_en.eq(self.o_res.ready & (osel == P - 1))]
            with m.If(go):
                m.d.sync += osel.eq(0)
            with m.Elif(self.o_res.valid & self.o_res.ready):
                m.d.sync += osel.eq(osel + 1)
            m.d.sync += pend.eq(pend + last_issue - push)
        else:
            m.d.comb += [y_r.addr.eq(tag4r.r), fp.y.eq(Mux(tag4p.first, NEG_ZERO, y_r.data))]
            tag5 = data.View(tag_layout, _delay(m, tag4.as_value(), FpAdd.LATENCY, "tag_sum"))
            m.d.comb += [y_w.en.eq(tag5.valid & ~tag5.last), y_w.addr.eq(tag5.r), y_w.data.eq(fp.sum)]
            push = tag5.valid & tag5.last
            m.d.comb += [res.w_en.eq(push), res.w_data.eq(fp.sum)]
            m.d.sync += pend.eq(pend + last_issue - push)
            m.d.comb += [self.o_res.valid.eq(res.r_rdy), self.o_res.p.eq(res.r_data), res.r_en.eq(self.o_res.ready)]
        m.d.comb += self.o_idle.eq(seq_fsm.ongoing("Idle") & ~be_active & ~item_wr.en & ~items.r_rdy & ~head.r_rdy &
                                   (pend == 0) & ~self.i_dma_busy & ~setup2 & ~started)
        return m


class EnginePort(wiring.Component):
    """One AXI port of the engine: its read DMA, its activation and exponent memories and its binary32
    pipeline (`PartAccumulator`), shared by the dense (`GemvPort`) and the sparse (`SparsePort`) datapath.
    Only one mode runs at a time, the one the decoded command selects (``dec.cmd.sparse``, stable while the
    engine is busy): that datapath gets the start pulse, drives the DMA's commands, the memories' read
    addresses and the pipeline's inputs, takes the DMA's data beats and gives the results; the other one never
    sees a handshake, and its pipeline inputs are ignored.

    Members
    -------
    axi : Out(AxiReadSignature)
    i_start : In(1)  (one cycle; the decoded command is stable until the port is idle)
    dec : In(the decoder's outputs)
    i_act_en, i_act_addr, i_act_q / i_exp_en, i_exp_addr, i_exp_e : In: activation and exponent memory writes
        (``i_act_vec`` / ``i_exp_vec`` with ``gemv_vectors`` > 1: the vector's memories)
    o_res : Out(stream(32)): the port's row results, in its row order (the running mode's)
    o_idle, o_error (the DMA's sticky read error) : Out(1)
    """

    def __init__(self, cfg: HardwareConfig, index: int, *, max_cols: int, max_segments: int, tile_rows: int):
        self._cfg, self._index = cfg, index
        self._max_cols, self._max_segments, self._T = max_cols, max_segments, tile_rows
        super().__init__(_port_members(cfg, max_cols, max_segments))

    def elaborate(self, platform):
        m = Module()
        cfg, p = self._cfg, self._index
        m.submodules.dma = dma = AxiReadDma(cfg, len_bits=LEN_BITS, ar_registered=True)
        wiring.connect(m, wiring.flipped(self.axi), dma.axi)
        m.d.comb += self.o_error.eq(dma.o_error)
        act_rs, exp_rs = _activation_memories(m, self, cfg, self._max_cols)
        act_r, V = act_rs[0], cfg.gemv_vectors

        # One scale memory for both datapaths (the larger one's banks): the running datapath writes
        # the DMA's scale beats into it and reads them back.
        scale_words = _scale_memory_words(cfg, self._max_segments, self._T)
        m.submodules.dense = dense = GemvPort(cfg, p, max_cols=self._max_cols, max_segments=self._max_segments,
                                              tile_rows=self._T, scale_words=scale_words)
        m.submodules.sparse = sparse = SparsePort(cfg, p, max_cols=self._max_cols, max_segments=self._max_segments,
                                                  scale_words=scale_words)
        wiring.connect(m, wiring.flipped(self.dec), dense.dec, sparse.dec)
        sp = self.dec.cmd.sparse
        m.submodules.part = part = PartAccumulator(cfg, cfg.segment_sum_bits)
        P = gemv_parts(cfg)
        # the exponent of each pipeline's vector, P x group + k (dense; sparse commands have one vector)
        grp = Mux(sp, 0, dense.o_exp_group) if V > 1 else 0
        m.d.comb += part.i_exp.eq(Array(r.data for r in exp_rs)[grp << ceil_log2(P)] if V > 1 else exp_rs[0].data)
        for v in range(1, V):
            m.d.comb += [dense.i_act_more[v - 1].eq(act_rs[v].data), act_rs[v].addr.eq(dense.o_act_addr)]
        for k in range(1, P):                        # the other pipelines, by mode as pipeline 0
            more = PartAccumulator(cfg, cfg.segment_sum_bits)
            m.submodules[f"part{k}"] = more
            fp, sfp = dense.fp_more[k - 1], sparse.fp_more[k - 1]
            y_k = Signal(32, name=f"part{k}_y")
            m.d.sync += y_k.eq(Mux(sp, sfp.y, fp.y))
            # dense: vector P x group + k; sparse (one vector): vector 0 on every pipeline
            exp_k = Array(r.data for r in exp_rs)[Mux(sp, 0, Cat(Const(k, ceil_log2(P)), dense.o_exp_group))]
            m.d.comb += [more.i_valid.eq(Mux(sp, sfp.valid, fp.valid)), more.i_isum.eq(Mux(sp, sfp.isum, fp.isum)),
                         more.i_scale.eq(Mux(sp, sfp.scale, fp.scale)), more.i_exp.eq(exp_k),
                         more.i_y.eq(y_k), fp.sum.eq(more.o_sum), sfp.sum.eq(more.o_sum)]
        # The addend of the running datapath, registered after the select (the datapaths' y is a cycle early).
        part_y = Signal(32)
        m.d.sync += part_y.eq(Mux(sp, sparse.fp.y, dense.fp.y))
        m.d.comb += part.i_y.eq(part_y)
        # The running datapath's DMA commands pass through a two-entry FIFO, so that their ready is a register's
        # (the DMA's command queue is a cycle further).
        cmd_layout = read_command_layout(cfg.axi_addr_bits, LEN_BITS)
        cmd_buf = _two_entry_buffer(m, cmd_layout.size, "cmd_buf")
        # The DMA's data beats pass a two-entry buffer on their way to the running datapath (a cycle more per
        # command), so that the DMA's ready and the datapath's beat are registers: the datapath's ready only
        # enables the buffer's registers.
        beat_layout = read_data_layout(cfg.axi_data_bits)
        beat_buf = _two_entry_buffer(m, beat_layout.size, "beat_buf")
        beat_p = data.View(beat_layout, beat_buf.r_data)
        m.submodules.scale_mem = scale_mem = Memory(shape=unsigned(8 * cfg.bytes_per_beat), depth=scale_words,
                                                    init=[])
        scale_w, scale_r = scale_mem.write_port(), scale_mem.read_port()
        m.d.comb += [scale_w.en.eq(Mux(sp, sparse.o_scale_wen, dense.o_scale_wen)),
                     scale_w.addr.eq(Mux(sp, sparse.o_scale_waddr, dense.o_scale_waddr)),
                     scale_w.data.eq(beat_p.data),
                     scale_r.addr.eq(Mux(sp, sparse.o_scale_raddr, dense.o_scale_raddr)),
                     dense.i_scale_rdata.eq(scale_r.data), sparse.i_scale_rdata.eq(scale_r.data)]
        m.d.comb += [dma.o_data.ready.eq(beat_buf.w_rdy), beat_buf.w_en.eq(dma.o_data.valid),
                     beat_buf.w_data.eq(dma.o_data.p),
                     beat_buf.r_en.eq(Mux(sp, sparse.dma_data.ready, dense.dma_data.ready))]
        for dp in (dense, sparse):
            m.d.comb += [dp.i_dma_busy.eq(dma.o_busy | cmd_buf.r_rdy | beat_buf.r_rdy),
                         dp.i_act_data.eq(act_r.data), dp.dma_data.p.eq(beat_p), dp.fp.sum.eq(part.o_sum)]
        if cfg.gemv_row_mask:
            self._row_mask(m, dense)
        else:
            m.d.comb += dense.i_rows.eq(self.dec.cmd.rows)
        m.d.comb += [
            dense.i_start.eq(self.i_start & ~sp), sparse.i_start.eq(self.i_start & sp),
            # DMA commands and memory reads from the running datapath.
            cmd_buf.w_en.eq(Mux(sp, sparse.dma_cmd.valid, dense.dma_cmd.valid)),
            cmd_buf.w_data.eq(Mux(sp, sparse.dma_cmd.p, dense.dma_cmd.p)),
            # (the dense datapath's ready ungated: it is idle, its valid low, while a sparse command runs)
            dense.dma_cmd.ready.eq(cmd_buf.w_rdy), sparse.dma_cmd.ready.eq(cmd_buf.w_rdy & sp),
            dma.i_cmd.valid.eq(cmd_buf.r_rdy), dma.i_cmd.p.eq(cmd_buf.r_data), cmd_buf.r_en.eq(dma.i_cmd.ready),
            act_r.addr.eq(Mux(sp, sparse.o_act_addr, dense.o_act_addr)),
            *[r.addr.eq(Mux(sp, sparse.o_exp_addr, dense.o_exp_addr)) for r in exp_rs],
            part.i_valid.eq(Mux(sp, sparse.fp.valid, dense.fp.valid)),
            part.i_isum.eq(Mux(sp, sparse.fp.isum, dense.fp.isum)),
            part.i_scale.eq(Mux(sp, sparse.fp.scale, dense.fp.scale)),
            # DMA data beats to it.
            dense.dma_data.valid.eq(beat_buf.r_rdy & ~sp), sparse.dma_data.valid.eq(beat_buf.r_rdy & sp),
            # Its results (both readies ungated: the idle datapath's result FIFOs are empty, its valid low).
            self.o_res.valid.eq(Mux(sp, sparse.o_res.valid, dense.o_res.valid)),
            self.o_res.p.eq(Mux(sp, sparse.o_res.p, dense.o_res.p)),
            dense.o_res.ready.eq(self.o_res.ready), sparse.o_res.ready.eq(self.o_res.ready),
            self.o_idle.eq(dense.o_idle & sparse.o_idle),
        ]
        return m

    def _row_mask(self, m, dense):
        """The port's copy of the row mask and its gather (`RowGather`) of the live rows of its share, rows
        ``p * prow ..`` (``i_gather``); the dense datapath then runs them as its tiles: ``q`` whole tiles and
        ``r`` rows of ``count = q * T + r`` read as the rows ``q * N * T + p * T + r`` of a command."""
        cfg, p, T, N = self._cfg, self._index, self._T, self._cfg.axi_ports
        d = self.dec
        m.submodules.gather = g = RowGather(cfg.gemv_max_cols, _mask_share(cfg))
        # the share's bounds from the decoded command in two registered steps, the products then the clamps
        # (i_gather comes two cycles after the start)
        # (the products as shifted sums, their compares with the rows beside them)
        lo0, end0, lo, hi = Signal(23), Signal(23), Signal(21), Signal(21)
        lo_lt, end_lt = Signal(), Signal()
        lo_p, end_p = _times(d.prow, p), _times(d.prow, p + 1)
        m.d.sync += [lo0.eq(lo_p), end0.eq(end_p), lo_lt.eq(lo_p < d.cmd.rows), end_lt.eq(end_p < d.cmd.rows),
                     lo.eq(Mux(lo_lt, lo0, d.cmd.rows)), hi.eq(Mux(end_lt, end0, d.cmd.rows))]
        m.d.comb += [g.i_mask_en.eq(self.i_mask_en), g.i_mask_addr.eq(self.i_mask_addr),
                     g.i_mask_bits.eq(self.i_mask_bits), g.i_start.eq(self.i_gather),
                     g.i_lo.eq(lo), g.i_hi.eq(hi),
                     self.o_gather_busy.eq(g.o_busy),
                     g.i_idx_addr.eq(dense.o_idx_addr), dense.i_idx.eq(g.o_idx)]
        count, lT = g.o_count, ceil_log2(T)
        rows = Cat(count[:lT], Const(p, ceil_log2(N)), count[lT:])
        # registered: valid at the start (the command's rows from the decoder's first step, the gathered
        # rows from the cycle the gather is seen done)
        rows_r = Signal(20)
        m.d.sync += rows_r.eq(Mux(d.cmd.mask, rows, d.cmd.rows))
        m.d.comb += dense.i_rows.eq(rows_r)


class GemvEngine(wiring.Component):
    """The GEMV engine with its N AXI4 read masters (docs/gemv.md).

    Parameters
    ----------
    cfg : HardwareConfig
    max_cols : int, optional
        Activation memory size (default ``cfg.gemv_max_cols``).
    tile_rows : int, optional
        Rows per tile (T): a power of two above the FpAdd latency plus one (default: the smallest such).

    Members
    -------
    i_cmd : In(stream(command_layout)): accepted when the engine is idle.
    i_act : In(stream({addr, q[, vec]})): activation words (W INT8 values, columns ``addr*W ..``; of vector
        `vec` with ``gemv_vectors`` > 1); always ready.
    i_exp : In(stream({addr, e[, vec]})): the exponent of activation block `addr` (of vector `vec`); always ready.
    i_acc : In(stream(32)): with accm, the old binary32 values, in the results' order.
    o_y : Out(stream(32)): the binary32 results, in row order (with `vecs`: tile by tile, vector by vector in a
        tile, as `command_layout` says).
    m_axi<p> : Out(AxiReadSignature) for each port p.
    o_busy, o_error (a DMA read error, sticky), o_bad_cmd (a rejected command, sticky) : Out(1)

    The activation words and exponents must be written before the command and not while it runs.
    """

    def __init__(self, cfg: HardwareConfig, *, max_cols: int | None = None, tile_rows: int | None = None):
        try:
            max_cols, tile_rows = self._check(cfg, max_cols, tile_rows)
        except (TypeError, ValueError):
            self._MustUse__silence = True    # never built: no "created but never used" warning
            raise
        W = cfg.weights_per_beat
        seg_min = min(cfg.act_block, cfg.weight_group or cfg.act_block)
        self._cfg, self._max_cols, self._T = cfg, max_cols, tile_rows
        self._max_segments = max(1, max_cols // seg_min)
        vec = {"vec": range(cfg.gemv_vectors)} if cfg.gemv_vectors > 1 else {}
        members = {
            "i_cmd": In(stream.Signature(command_layout(cfg))),
            "i_act": In(stream.Signature(data.StructLayout({
                "addr": range(max_cols // W), "q": data.ArrayLayout(signed(cfg.act_bits), W), **vec}))),
            "i_exp": In(stream.Signature(data.StructLayout({
                "addr": range(max(2, max_cols // cfg.act_block)), "e": signed(EXP_BITS), **vec}))),
            "i_acc": In(stream.Signature(unsigned(32))),
            "o_y": Out(stream.Signature(unsigned(32))),
            "o_busy": Out(1), "o_error": Out(1), "o_bad_cmd": Out(1),
        }
        if cfg.gemv_row_mask:
            members["i_mask"] = In(stream.Signature(mask_layout(cfg.gemv_max_cols)))
        for p in range(cfg.axi_ports):
            members[f"m_axi{p}"] = Out(AxiReadSignature.from_config(cfg))
        super().__init__(members)

    @staticmethod
    def default_tile_rows() -> int:
        """Rows per tile unless given: the smallest power of two above the FpAdd latency plus one."""
        return 1 << (FpAdd.LATENCY + 1).bit_length()

    @staticmethod
    def _check(cfg, max_cols, tile_rows):
        W = cfg.weights_per_beat
        max_cols = cfg.gemv_max_cols if max_cols is None else max_cols
        if isinstance(max_cols, bool) or not isinstance(max_cols, int) or max_cols < W or max_cols & (max_cols - 1):
            raise ValueError(f"max_cols must be a power of two of at least {W}, not {max_cols!r}")
        if cfg.axi_ports & (cfg.axi_ports - 1):
            raise ValueError(f"axi_ports must be a power of two (the sparse mode splits rows over the ports), "
                             f"not {cfg.axi_ports!r}")
        lat = FpAdd.LATENCY
        if tile_rows is None:
            tile_rows = GemvEngine.default_tile_rows()
        if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows <= lat + 1 or \
                tile_rows & (tile_rows - 1):
            raise ValueError(f"tile_rows must be a power of two above the FpAdd latency plus one ({lat + 1}), "
                             f"not {tile_rows!r}")
        if cfg.act_block > max_cols:
            raise ValueError(f"act_block ({cfg.act_block}) exceeds max_cols ({max_cols})")
        _check_segment_sums(cfg)             # the ports' PartAccumulator needs exact segment sums
        return max_cols, tile_rows

    cfg = property(lambda self: self._cfg)
    max_cols = property(lambda self: self._max_cols)
    tile_rows = property(lambda self: self._T)
    max_segments = property(lambda self: self._max_segments)

    def elaborate(self, platform):
        m = Module()
        cfg, T, N = self._cfg, self._T, self._cfg.axi_ports
        m.submodules.dec = dec = CommandDecoder(cfg, self._max_cols, self._max_segments)
        sparse = dec.o_cmd.sparse                   # the running command's mode (stable while busy)
        ports = []
        for p in range(N):
            port = EnginePort(cfg, p, max_cols=self._max_cols, max_segments=self._max_segments, tile_rows=T)
            m.submodules[f"port{p}"] = port
            ports.append(port)
            wiring.connect(m, wiring.flipped(getattr(self, f"m_axi{p}")), port.axi)
            for name in port.dec.signature.members:
                m.d.comb += getattr(port.dec, name).eq(getattr(dec, f"o_{name}"))
            m.d.comb += [
                port.i_act_en.eq(self.i_act.valid), port.i_act_addr.eq(self.i_act.p.addr),
                port.i_act_q.eq(self.i_act.p.q),
                port.i_exp_en.eq(self.i_exp.valid), port.i_exp_addr.eq(self.i_exp.p.addr),
                port.i_exp_e.eq(self.i_exp.p.e),
            ]
            if cfg.gemv_vectors > 1:
                m.d.comb += [port.i_act_vec.eq(self.i_act.p.vec), port.i_exp_vec.eq(self.i_exp.p.vec)]
            if cfg.gemv_row_mask:
                m.d.comb += [port.i_mask_en.eq(self.i_mask.valid), port.i_mask_addr.eq(self.i_mask.p.addr),
                             port.i_mask_bits.eq(self.i_mask.p.bits)]
        m.d.comb += [self.i_act.ready.eq(1), self.i_exp.ready.eq(1)]
        m.d.comb += self.o_error.eq(Cat(*[p.o_error for p in ports]).any())

        # Command: accept when idle into a register (the decoder's checks start at flip-flops, not behind the
        # issuer's logic), decode (two cycles), then start the ports unless it is bad. The start pulse is a
        # register, set in the decoder's second step from its check (`o_good`): the ports' enables start at a
        # flip-flop, not behind the check.
        busy = Signal()
        cmd_q, accepted = Signal.like(self.i_cmd.p), Signal()   # the accepted command; its first cycle there
        decoding, checking = Signal(), Signal()      # the decoder's first and second step
        with m.If(self.i_cmd.valid & ~busy):
            m.d.sync += cmd_q.eq(self.i_cmd.p)
        m.d.sync += accepted.eq(self.i_cmd.valid & ~busy)
        m.d.comb += [self.i_cmd.ready.eq(~busy), dec.i_cmd.eq(cmd_q), dec.i_load.eq(accepted)]
        start = Signal()                             # checking & ~dec.o_bad
        m.d.sync += [decoding.eq(accepted), checking.eq(decoding), start.eq(decoding & dec.o_good)]
        with m.If(self.i_cmd.valid & ~busy):
            m.d.sync += busy.eq(1)
        with m.If(checking & dec.o_bad):
            m.d.sync += [self.o_bad_cmd.eq(1), busy.eq(0)]
        # masked: the ports gather their live rows first, then start
        masked = dec.o_cmd.mask if cfg.gemv_row_mask else 0
        gathering = Signal()
        if cfg.gemv_row_mask:
            m.d.comb += self.i_mask.ready.eq(1)
            # the gathers start two cycles after the command (their shares' bounds registered from it)
            go0, go = Signal(), Signal()
            m.d.sync += [go0.eq(start & masked), go.eq(go0)]
            # the ports start a cycle after their gathers are seen done (a registered pulse)
            gathered, gathered_next = Signal(), Signal()
            m.d.comb += gathered_next.eq(gathering & ~go0 & ~go & ~gathered &
                                         ~Cat(*[p.o_gather_busy for p in ports]).any())
            m.d.sync += gathered.eq(gathered_next)
            with m.If(start & masked):
                m.d.sync += gathering.eq(1)
            with m.If(gathered):
                m.d.sync += gathering.eq(0)
            # the ports' start, Mux(masked, gathered, start), as a register of its own (`masked` is the decoder's
            # first step, stable from the cycle before `start`)
            port_go = Signal()
            m.d.sync += port_go.eq(Mux(masked, gathered_next, decoding & dec.o_good))
            for port in ports:
                m.d.comb += [port.i_gather.eq(go), port.i_start.eq(port_go)]
        else:
            for port in ports:
                m.d.comb += port.i_start.eq(start)

        # Merge in row order: dense, tile j comes from port j mod N (T rows); sparse and masked, port p holds
        # rows p * prow .. (p + 1) * prow - 1 (masked: the live ones; a row the mask skips reads +0).
        out_left = Signal(23)         # results (rows x vectors) not yet issued to the output adder
        out_any = Signal()            # out_left != 0, registered with it
        V = cfg.gemv_vectors
        mt_cnt = Signal(range(max(T * V, cfg.gemv_sparse_max_rows // N,
                                  _mask_share(cfg) if cfg.gemv_row_mask else 1)))
        mt_len_m1 = Signal(21)
        # from the decoded command, before any row: a dense tile is T rows of nvec results each
        tile_len = dec.o_nvec << ceil_log2(T) if V > 1 else T
        m.d.sync += mt_len_m1.eq(Mux(sparse | masked, dec.o_prow, tile_len) - 1)
        merged = Signal()             # a row leaves the merge
        live, mask_ok = self._merge_mask(m, start, merged, masked) if cfg.gemv_row_mask else (Const(1), Const(1))
        fadd = FpAdd()
        m.submodules.accm_add = fadd
        # The adder's operands are registered in front of it (`add_*`): a cycle more for each row.
        add_valid, add_a, add_b = Signal(), Signal(32), Signal(32)
        lat = fadd.latency + 1
        m.submodules.out = out = fifo.SyncFIFOBuffered(width=32, depth=lat + 4)
        inflight = Signal(range(lat + 2))
        head_valid = Signal()
        head_data = Signal(32)
        # The port the merge reads, one-hot (`mt_sel`): a port's pop is its buffer's valid and select and the
        # merge's registered conditions, with no select among the ports in front of it.
        mt_sel = Signal(N, init=1)
        # each port's results through a two-entry buffer: the merge's pop reaches the buffer's flags and data
        # enable, not the port's FIFO level
        results = []
        for k, port in enumerate(ports):
            b = _two_entry_buffer(m, 32, f"result{k}")
            m.d.comb += [b.w_en.eq(port.o_res.valid), b.w_data.eq(port.o_res.p), port.o_res.ready.eq(b.w_rdy)]
            results.append(b)
        m.d.comb += [head_valid.eq(Cat(*[s & b.r_rdy for s, b in zip(mt_sel, results)]).any()),
                     head_data.eq(one_hot_mux(mt_sel, [b.r_data for b in results]))]
        accm = dec.o_cmd.accm
        # Room in the output FIFO for the rows in flight, registered: from a level a cycle old (reads only
        # add room) and this cycle's issue. A row the mask skips takes no port result and adds +0.
        room = Signal()
        used = out.level + inflight
        rest = out_any & mask_ok & (~accm | self.i_acc.valid) & room
        can = rest & (head_valid | ~live)
        m.d.sync += room.eq(Mux(can, used + 1 < out.depth, used < out.depth))
        for k, b in enumerate(results):
            m.d.comb += b.r_en.eq(rest & live & mt_sel[k] & b.r_rdy)
        m.d.sync += [add_valid.eq(can), add_a.eq(Mux(accm, self.i_acc.p, NEG_ZERO)),
                     add_b.eq(Mux(live, head_data, 0))]
        m.d.comb += [self.i_acc.ready.eq(can & accm), fadd.en.eq(1), fadd.i_valid.eq(add_valid),
                     fadd.i_a.eq(add_a), fadd.i_b.eq(add_b),
                     out.w_en.eq(fadd.o_valid), out.w_data.eq(fadd.o_y)]
        m.d.sync += inflight.eq(inflight + can - fadd.o_valid)
        m.d.comb += merged.eq(can)
        with m.If(start):
            outs = dec.o_outs if V > 1 else dec.o_cmd.rows
            m.d.sync += [out_left.eq(outs), out_any.eq(outs != 0), mt_cnt.eq(0), mt_sel.eq(1)]
        with m.Elif(can):
            m.d.sync += [out_left.eq(out_left - 1), out_any.eq(out_left != 1), mt_cnt.eq(mt_cnt + 1)]
            with m.If(mt_cnt == mt_len_m1):
                m.d.sync += [mt_cnt.eq(0), mt_sel.eq(mt_sel.rotate_left(1))]
        # The ports' idle flags registered twice (each port's, then their AND): two cycles old, and not yet
        # cleared in the two cycles after a port starts (`kicked`, `kicked2`).
        port_idle = Signal(len(ports))
        idle, kicked, kicked2 = Signal(), Signal(), Signal()
        m.d.sync += [port_idle.eq(Cat(*[p.o_idle for p in ports])), idle.eq(port_idle.all()),
                     kicked.eq(Cat(*[p.i_start for p in ports]).any()), kicked2.eq(kicked)]
        # (`start` is high only with `checking`; `out_any` is out_left != 0)
        done = ~out_any & (inflight == 0) & ~accepted & ~decoding & ~checking & ~gathering & ~kicked & ~kicked2 & idle
        with m.If(busy & ~decoding & done):
            m.d.sync += busy.eq(0)
        m.d.comb += [self.o_y.valid.eq(out.r_rdy), self.o_y.p.eq(out.r_data), out.r_en.eq(self.o_y.ready)]
        m.d.comb += self.o_busy.eq(busy)
        return m

    def _merge_mask(self, m, start, merged, masked):
        """The merge's copy of the row mask, read a word ahead of the row it is at (`merged`: the row leaves):
        returns (the row is live, the mask is ready), both 1 for a command without `mask`. The first word is
        read in the two cycles after `start`; every later one from the cycle the merge enters the word before
        it, at least four rows (cycles) before it is needed."""
        cfg = self._cfg
        L, lL = MASK_LANES, ceil_log2(MASK_LANES)
        m.submodules.merge_mask = mem = Memory(shape=L, depth=cfg.gemv_max_cols // L, init=[])
        mw, mr = mem.write_port(), mem.read_port()
        m.d.comb += [mw.en.eq(self.i_mask.valid), mw.addr.eq(self.i_mask.p.addr), mw.data.eq(self.i_mask.p.bits)]
        row = Signal(range(cfg.gemv_max_cols + 1))   # the merge's row (masked commands)
        bits = Signal(L)                             # its word's live bits from the row on: the row's is bits[0]
        load = Signal(2)                             # the first word: 2 after start, 1 when its data is in
        loaded = Signal(init=1)                      # load == 0, as a register
        m.d.comb += mr.addr.eq(Mux(load != 0, 0, (row >> lL) + 1))
        with m.If(start):
            m.d.sync += [row.eq(0), load.eq(2), loaded.eq(0)]
        with m.Elif(load != 0):
            m.d.sync += load.eq(load - 1)
            with m.If(load == 1):
                m.d.sync += [bits.eq(mr.data), loaded.eq(1)]
        with m.Elif(merged):
            m.d.sync += [row.eq(row + 1), bits.eq(bits >> 1)]
            with m.If(row[:lL] == L - 1):
                m.d.sync += bits.eq(mr.data)
        live = ~masked | bits[0]
        ok = ~masked | loaded
        return live, ok
