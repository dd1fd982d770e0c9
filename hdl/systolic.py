"""The systolic GEMM engine: an output-stationary R×C array of DSP48E2 PEs, two INT4×INT8 products per DSP.

Bit-exact model: `sim.systolic` (``gemm``, ``gemm_tile``, ``tile_streams``); prose: docs/systolic.md.

Built bottom-up from small components:

* `SystolicPE`: one DSP48E2. The packed weight pair ``wp = w0 + w1·2**F`` (27-bit port) times one INT8
  activation (18-bit port), accumulated over a segment in the 48-bit P register (``P ← M`` on the first
  product of a segment, ``P ← P + M`` after). At a segment's end P is captured into the PE's capture
  register (a clock enable, no select logic). The slice is `hdl.dsp.DspMacc`: a DSP48E2 instance when
  elaborated for the device, its registers in simulation.
* `SystolicColumn`: R PEs sharing a column's weight pair (packed once at the top, passed down the DSP
  column's A cascade), and the column's drain: one R:1 select over the PEs' capture registers that reads
  row t's sum 2t cycles after row 0's (row t captures t cycles after row 0, so each is read after it is
  written and long before the next segment overwrites it) — one packed pair every other cycle, exactly one
  INT per cycle once split into its two fields — provided a segment lasts at least 2R steps.
* `Skew`: the input skew (element i delayed i cycles), for the rows' activations and the columns' weights.
* `SystolicArray`: skews + C columns. Activations flow right along token rows, weights flow down columns;
  every PE(t, c) accumulates output rows 2c and 2c+1 of token t.
* `ScaleLane`: one per column, the binary32 back end of the numerics contract: sign-correct the two
  fields, ``part = ldexp(fp32(isum) × fp32(scale), e)`` (the product in one `IntScaleMul`: a field is at
  most 22 bits, so exact in binary32), ``y ← y + part`` in segment order (the first segment adds to -0.0,
  which is exact), into a two-bank y memory. Uses `hdl.fp`.
* `SystolicEngine`: the tile engine. Streams in: tile commands, weight beats (``wgt_ports`` streams of
  ``axi_data_bits``), activations (one INT8 per token row per k-step), block exponents, binary16 scales;
  streams out: one beat per token row of 2C binary32 (the y banks are the output deskew). Ready/valid on
  every stream; inside, the array never stalls — an entrance step that cannot fire becomes a bubble.
"""

from __future__ import annotations

from amaranth import Array, Cat, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .config import HardwareConfig, segment_sum_bits
from .dsp import A_BITS, MUL_A_BITS, MUL_B_BITS, P_BITS, DspMacc
from .fp import NEG_ZERO, FpAdd, FpLdexp, IntScaleMul, check_int_scale_bits, rejecting

__all__ = ["tag_layout", "row_layout", "res_layout", "step_layout", "pack_pair", "extract_pair", "SystolicPE",
           "NaivePE", "SystolicColumn", "Skew", "SystolicArray", "NaiveArray", "ScaleLane", "SystolicEngine",
           "EngineGeometry", "EXP_BITS", "P_BITS"]

EXP_BITS = 9         # activation block exponents: [-155, 122] (sim.systolic.EXP_BITS)

# What travels with the last k-step of a segment (through the rows, into the drain, into the lanes):
# which hold bank has this segment's exponents and scales, whether the segment starts/ends its tile, and
# which y bank the tile accumulates into.
tag_layout = data.StructLayout({"seg_bank": 1, "tile_first": 1, "tile_last": 1, "tile_bank": 1})


def row_layout(act_bits: int = 8) -> data.StructLayout:
    """What moves right along a token row: the activation, and the end-of-segment flag with its tag."""
    return data.StructLayout({"a": signed(act_bits), "last": 1, "tag": tag_layout})


def res_layout(field: int) -> data.StructLayout:
    """A captured segment sum leaving a column: the low 2F bits of P hold both fields exactly."""
    return data.StructLayout({"valid": 1, "p": signed(2 * field), "tag": tag_layout})


def step_layout(rows: int, cols: int, act_bits: int = 8) -> data.StructLayout:
    """One k-step at the array's entrance: R activations, 2C weights (row 2c low nibble first)."""
    return data.StructLayout({"valid": 1, "a": data.ArrayLayout(signed(act_bits), rows),
                              "w": data.ArrayLayout(signed(4), 2 * cols), "last": 1, "tag": tag_layout})


def pack_pair(w0, w1, field: int):
    """The multiplier operand ``w0 + w1·2**field``: signed F + 5 bits (``w1·2**F`` alone reaches ``-2**(F+3)``
    and a negative ``w0`` goes one step further), a small add done once per column, at its top."""
    return (w1.as_signed() << field) + w0.as_signed()


def extract_pair(p, field: int):
    """Sign correction: ``(lo, hi)`` from ``P = lo + hi·2**field``; lo is P's low field as two's complement,
    hi the field above plus the borrow bit ``P[field-1]``. Both are F-bit signed values."""
    lo = p[:field].as_signed()
    hi = (p[field:2 * field].as_signed() + p[field - 1])[:field].as_signed()
    return lo, hi


def _check_int(name, v, minimum=1):
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, not {v!r}")


def _pe_members(act_bits: int, field: int, w_shape) -> dict:
    return {"i_a": In(row_layout(act_bits)), "o_a": Out(row_layout(act_bits)),
            "i_w": In(w_shape), "o_w": Out(w_shape),
            "o_sum": Out(signed(2 * field)), "o_done": Out(1), "o_tag": Out(tag_layout)}


class SystolicPE(wiring.Component):
    """One processing element: two INT4×INT8 multiply-accumulates in one DSP48E2 (`hdl.dsp.DspMacc`).

    Parameters
    ----------
    field : spacing F of the packed weight pair (`sim.systolic.field_bits`); F + 5 <= 27.
    act_bits : activation width (8).
    cascade : the weight pair comes from the PE above through the DSP column's A cascade (every PE of a
        column but the top one).

    Members
    -------
    i_a : In(row_layout)            activation and segment flags from the left
    o_a : Out(row_layout)           the same, one cycle later, to the right
    i_w : In(signed(30))            packed weight pair (F + 5 significant bits) from above
    o_w : Out(signed(30))           the same, one cycle later, downwards (the DSP's A register, ``ACOUT``)
    o_sum : Out(signed(2F))         capture register: the last finished segment's sum (low 2F bits of P)
    o_done : Out(1)                 ``o_sum`` takes a new sum at the end of this cycle
    o_tag : Out(tag_layout)         that sum's tag (valid with ``o_done``)

    Latency: a product whose inputs are at ``i_a``/``i_w`` in cycle x is in P at x + 3; a segment's sum is
    in ``o_sum`` at x + 4 after its last step (``o_done`` in x + 3).

    In the DSP: A/B/M/P registers, the accumulator P and its restart (OPMODE). In fabric: the activation's
    copy for the right neighbour, the segment flags and the capture register (2F flip-flops with a clock
    enable, no logic in front of them).
    """

    latency = DspMacc.LATENCY + 1

    def __init__(self, field: int, act_bits: int = 8, *, cascade: bool = False):
        with rejecting(self):
            _check_int("field", field, 2)
            if field + 5 > MUL_A_BITS:
                raise ValueError(f"field {field} is too wide: the packed pair (F + 5 = {field + 5} bits) must "
                                 f"fit the DSP48E2 multiplier's {MUL_A_BITS}-bit A input")
        self._field, self._act_bits, self._cascade = field, act_bits, bool(cascade)
        super().__init__(_pe_members(act_bits, field, signed(A_BITS)))

    def elaborate(self, platform):
        m = Module()
        f = self._field
        m.submodules.mac = mac = DspMacc(f + 5, self._act_bits, cascade=self._cascade)
        m.d.comb += [(mac.i_acin if self._cascade else mac.i_a).eq(self.i_w), self.o_w.eq(mac.o_acout),
                     mac.i_b.eq(self.i_a.a)]
        fl_m, fl_p = _pe_flags(m, self)
        # Restart after a segment's last product: the product entering P next cycle follows the one whose
        # flags are in fl_m now.
        m.d.comb += mac.i_restart.eq(fl_m.last)
        _capture(m, self, fl_p, mac.o_p[:2 * f])
        return m


def _pe_flags(m: Module, pe):
    """The activation's copy for the right neighbour, and the flags that travel with the product: returns
    the flags in step with M (``fl_m``) and with P (``fl_p``)."""
    a_r = Signal(signed(pe._act_bits), reset_less=True)
    fl_r = Signal(data.StructLayout({"last": 1, "tag": tag_layout}))
    fl_m, fl_p = Signal.like(fl_r), Signal.like(fl_r)
    m.d.sync += [a_r.eq(pe.i_a.a), fl_r.last.eq(pe.i_a.last), fl_r.tag.eq(pe.i_a.tag),
                 fl_m.eq(fl_r), fl_p.eq(fl_m)]
    m.d.comb += [pe.o_a.a.eq(a_r), pe.o_a.last.eq(fl_r.last), pe.o_a.tag.eq(fl_r.tag)]
    return fl_m, fl_p


def _capture(m: Module, pe, fl_p, value):
    """The capture register: `value` (the finished segment's sum) when P holds a segment's last product."""
    with m.If(fl_p.last):
        m.d.sync += pe.o_sum.eq(value)
    m.d.comb += [pe.o_done.eq(fl_p.last), pe.o_tag.eq(fl_p.tag)]


class NaivePE(wiring.Component):
    """The reference point for the DSP count: the same two MACs as `SystolicPE` written as two separate
    INT4×INT8 multiplies and two accumulators (Yosys gives each multiply its own DSP48E2). Same ports as
    `SystolicPE` except ``i_w``/``o_w`` carry the two raw INT4 weights."""

    latency = SystolicPE.latency

    def __init__(self, field: int, act_bits: int = 8):
        self._field, self._act_bits = field, act_bits
        super().__init__(_pe_members(act_bits, field, data.ArrayLayout(signed(4), 2)))

    def elaborate(self, platform):
        m = Module()
        f = self._field
        # Two separate weight registers: a multiply on a slice of one wide register trips an assertion in
        # Yosys 0.70's ABC9 reintegration.
        w_r = [Signal(signed(4), reset_less=True) for i in range(2)]
        m.d.sync += [w_r[0].eq(self.i_w[0]), w_r[1].eq(self.i_w[1])]
        m.d.comb += [self.o_w[0].eq(w_r[0]), self.o_w[1].eq(w_r[1])]
        fl_m, fl_p = _pe_flags(m, self)
        a_r = self.o_a.a
        acc = []
        for i in range(2):
            mul = Signal(signed(4 + self._act_bits), reset_less=True)
            p = Signal(signed(P_BITS), reset_less=True)
            m.d.sync += [mul.eq(a_r * w_r[i]), p.eq(mul + Mux(fl_p.last, 0, p))]
            acc.append(p)
        # Same capture word as the packed PE: lo + hi·2**F.
        _capture(m, self, fl_p, Cat(acc[0][:f], (acc[1] - acc[0][f - 1])[:f]))
        return m


class SystolicColumn(wiring.Component):
    """R PEs of one array column: output rows 2c and 2c+1 for the R token rows, and the column's drain.

    The drain reads the PEs' capture registers through one R:1 select into the output register: row 0's
    capture starts a walk that reads row t in the cycle 2t after it (row t captured t cycles after row 0,
    so it is read after it is written and, with segments of at least 2R steps, before the next segment's
    sum replaces it). The segment's tag is row 0's. Per PE this costs 2F flip-flops with a clock enable;
    the select is about 2F·R/3 LUTs per column where a capture-or-shift chain costs 2F·R.

    Members
    -------
    i_a : In(ArrayLayout(row_layout, R))   the rows' activations from the left
    o_a : Out(ArrayLayout(row_layout, R))  to the next column
    i_w : In(ArrayLayout(signed(4), 2))    the column's weight pair (packed here, once)
    o_res : Out(res_layout)                drain output: row t's sum 2t cycles after row 0's
    """

    latency = SystolicPE.latency + 1     # the step's last product into the PE to row 0 at ``o_res``

    def __init__(self, rows: int, field: int, act_bits: int = 8, *, naive: bool = False):
        _check_int("rows", rows)
        self._rows, self._field, self._act_bits, self._naive = rows, field, act_bits, naive
        super().__init__({
            "i_a": In(data.ArrayLayout(row_layout(act_bits), rows)),
            "o_a": Out(data.ArrayLayout(row_layout(act_bits), rows)),
            "i_w": In(data.ArrayLayout(signed(4), 2)),
            "o_res": Out(res_layout(self._field)),
        })

    def elaborate(self, platform):
        m = Module()
        R = self._rows
        pes = []
        for t in range(R):
            pe = (NaivePE(self._field, self._act_bits) if self._naive else
                  SystolicPE(self._field, self._act_bits, cascade=t > 0))
            m.submodules[f"pe_{t}"] = pe
            pes.append(pe)
            m.d.comb += [pe.i_a.eq(self.i_a[t]), self.o_a[t].eq(pe.o_a)]
        if self._naive:
            m.d.comb += pes[0].i_w.eq(self.i_w)
        else:
            m.d.comb += pes[0].i_w.eq(pack_pair(self.i_w[0], self.i_w[1], self._field))
        for t in range(1, R):
            m.d.comb += pes[t].i_w.eq(pes[t - 1].o_w)

        # The drain walk: `row` is the next row to read, on the cycles with `turn` set.
        walking = Signal()
        turn = Signal()
        row = Signal(range(R))
        tag = Signal(tag_layout)
        with m.If(walking & turn):
            m.d.sync += [self.o_res.p.eq(Array(pe.o_sum for pe in pes)[row]), self.o_res.tag.eq(tag),
                         row.eq(row + 1), turn.eq(0)]
            with m.If(row == R - 1):
                m.d.sync += [walking.eq(0), row.eq(0)]
        with m.Else():
            m.d.sync += turn.eq(1)
        m.d.sync += self.o_res.valid.eq(walking & turn)
        # Row 0 capturing a new sum (re)starts the walk; the next cycle reads row 0.
        with m.If(pes[0].o_done):
            m.d.sync += [walking.eq(1), turn.eq(1), row.eq(0), tag.eq(pes[0].o_tag)]
        return m


class Skew(wiring.Component):
    """Input skew: element i of the output is element i of the input delayed by ``i`` cycles.

    Members
    -------
    i_data : In(ArrayLayout(shape, n))
    o_data : Out(ArrayLayout(shape, n))
    """

    def __init__(self, shape, n: int):
        _check_int("n", n)
        self._shape, self._n = shape, n
        super().__init__({"i_data": In(data.ArrayLayout(shape, n)), "o_data": Out(data.ArrayLayout(shape, n))})

    def elaborate(self, platform):
        m = Module()
        for i in range(self._n):
            x = self.i_data[i]
            for d in range(i):
                r = Signal(self._shape, name=f"skew_{i}_{d}")
                m.d.sync += r.eq(x)
                x = r
            m.d.comb += self.o_data[i].eq(x)
        return m


class SystolicArray(wiring.Component):
    """R token rows × C columns of PEs with input skew; output-stationary.

    A step at ``i_step`` in cycle x meets PE(t, c) at x + 1 + t + c; a segment whose last step entered in
    cycle x leaves column c's drain for token row t in cycle ``x + latency + 2t + c``. A step with
    ``valid`` = 0 is a bubble: its activations are zeroed, so it adds nothing.

    Members
    -------
    i_step : In(step_layout(R, C))
    o_res : Out(ArrayLayout(res_layout, C))   per column, the drain output (valid every other cycle)
    """

    latency = SystolicColumn.latency

    def __init__(self, rows: int, cols: int, field: int, act_bits: int = 8, *, naive: bool = False):
        _check_int("rows", rows)
        _check_int("cols", cols)
        self._rows, self._cols, self._field, self._act_bits, self._naive = rows, cols, field, act_bits, naive
        super().__init__({
            "i_step": In(step_layout(rows, cols, act_bits)),
            "o_res": Out(data.ArrayLayout(res_layout(field), cols)),
        })

    def elaborate(self, platform):
        m = Module()
        R, C = self._rows, self._cols
        rl = row_layout(self._act_bits)
        m.submodules.row_skew = row_skew = Skew(rl, R)
        m.submodules.col_skew = col_skew = Skew(data.ArrayLayout(signed(4), 2), C)
        st = self.i_step
        for t in range(R):
            m.d.comb += [row_skew.i_data[t].a.eq(Mux(st.valid, st.a[t], 0)),
                         row_skew.i_data[t].last.eq(st.valid & st.last), row_skew.i_data[t].tag.eq(st.tag)]
        for c in range(C):
            m.d.comb += [col_skew.i_data[c][0].eq(st.w[2 * c]), col_skew.i_data[c][1].eq(st.w[2 * c + 1])]
        prev = row_skew.o_data
        for c in range(C):
            col = SystolicColumn(R, self._field, self._act_bits, naive=self._naive)
            m.submodules[f"col_{c}"] = col
            m.d.comb += [col.i_a.eq(prev), col.i_w.eq(col_skew.o_data[c]), self.o_res[c].eq(col.o_res)]
            prev = col.o_a
        return m


def NaiveArray(rows: int, cols: int, field: int, act_bits: int = 8) -> SystolicArray:
    """The same array built from `NaivePE` (one DSP per product): the DSP-count reference."""
    return SystolicArray(rows, cols, field, act_bits, naive=True)


def _delay(m: Module, sig, n: int, name: str):
    """`sig` delayed by n cycles (a chain of reset-less registers)."""
    for i in range(n):
        r = Signal.like(sig, name=f"{name}_d{i + 1}", reset_less=True)
        m.d.sync += r.eq(sig)
        sig = r
    return sig


class ScaleLane(wiring.Component):
    """The binary32 back end of one array column (the numerics contract's scale stage).

    Each drain item (a captured P) is split into its two fields over two cycles (row 2c, then 2c+1);
    for each: ``part = ldexp(fp32(isum) × fp32(scale), e)``, ``y ← (first segment ? -0.0 : y) + part``,
    written to the field's y memory at (tile bank, token row). The lane counts token rows itself: a
    segment drains rows 0..R-1 in order.

    Members
    -------
    i_res : In(res_layout)                                 the column's drain output
    i_scale : In(ArrayLayout(ArrayLayout(unsigned(16), 2), 2))   [seg bank][field] binary16 scales
    i_exp : In(ArrayLayout(ArrayLayout(signed(9), R), 2))        [seg bank][row] block exponents
    i_rd_en, i_rd_addr : In                                 readout port (address = bank·R + row)
    o_rd_data : Out(ArrayLayout(unsigned(32), 2))           both fields of that row, one cycle later
    o_done : Out(1)                                         pulse: the last y of a tile was written

    ``SCALE_READ`` / ``EXP_READ`` are the cycles after an item's arrival at which the hold registers are
    read (the engine checks that its hold banks outlive them); ``latency`` is arrival to the y write.
    """

    # Pipeline timing from the hdl.fp primitives' latencies (cycles after an item's arrival).
    MUL_LATENCY = IntScaleMul.LATENCY                     # fp32(isum) × fp32(scale), fused
    SCALE_READ = 1                                        # the high field's scale: the cycle after arrival
    EXP_READ = 2 + MUL_LATENCY                            # the high field's exponent, at the FpLdexp input
    LATENCY = EXP_READ + FpLdexp.LATENCY + FpAdd.LATENCY  # arrival to the y write
    READ_AHEAD = 2                                        # the old y's read, cycles before the add

    def __init__(self, rows: int, field: int):
        _check_int("rows", rows)
        # fp32(isum) is exact, so that the fused product is bit-identical to FpMul(IntToFp, F16ToF32), when
        # every signed `field`-bit value is: field <= 25 (EngineGeometry's DSP packing keeps it <= 22).
        with rejecting(self):
            check_int_scale_bits("ScaleLane", "field", field)
        self._rows, self._field = rows, field
        super().__init__({
            "i_res": In(res_layout(field)),
            "i_scale": In(data.ArrayLayout(data.ArrayLayout(unsigned(16), 2), 2)),
            "i_exp": In(data.ArrayLayout(data.ArrayLayout(signed(EXP_BITS), rows), 2)),
            "i_rd_en": In(1), "i_rd_addr": In(range(2 * rows)),
            "o_rd_data": Out(data.ArrayLayout(unsigned(32), 2)),
            "o_done": Out(1),
        })

    @property
    def latency(self) -> int:
        return self.LATENCY

    def elaborate(self, platform):
        m = Module()
        R, f = self._rows, self._field
        m.submodules.mul = mul = IntScaleMul(f)
        m.submodules.ldexp = ldexp = FpLdexp(EXP_BITS)
        m.submodules.add = add = FpAdd()
        for u in (mul, ldexp, add):
            m.d.comb += u.en.eq(1)

        # Serialise: an item arrives every other cycle at most; its low field goes in the cycle after it
        # arrives, its high field the cycle after that.
        hold = Signal(res_layout(f))
        phase = Signal()          # 1: the cycle of the high field
        row = Signal(range(R))
        m.d.sync += hold.eq(Mux(self.i_res.valid, self.i_res, hold))
        m.d.sync += phase.eq(self.i_res.valid)
        _, hi = extract_pair(hold.p, f)
        # Stage s1 registers: one field per cycle.
        meta_layout = data.StructLayout({"valid": 1, "field": 1, "row": range(R), "tag": tag_layout})
        s1 = Signal(meta_layout)
        v1 = Signal(signed(f))
        s1_scale = Signal(16)
        lo_now, _ = extract_pair(self.i_res.p, f)
        with m.If(self.i_res.valid):
            m.d.sync += [s1.valid.eq(1), s1.field.eq(0), s1.row.eq(row), s1.tag.eq(self.i_res.tag),
                         v1.eq(lo_now), s1_scale.eq(self.i_scale[self.i_res.tag.seg_bank][0])]
        with m.Elif(phase):
            m.d.sync += [s1.valid.eq(1), s1.field.eq(1), s1.row.eq(row), s1.tag.eq(hold.tag),
                         v1.eq(hi), s1_scale.eq(self.i_scale[hold.tag.seg_bank][1])]
            m.d.sync += row.eq(Mux(row == R - 1, 0, row + 1))
        with m.Else():
            m.d.sync += s1.valid.eq(0)

        # fp32(isum) × fp32(scale): one exact integer product, rounded once.
        m.d.comb += [mul.i_valid.eq(s1.valid), mul.i_a.eq(v1), mul.i_b.eq(s1_scale)]
        # the row's block exponent is selected a cycle ahead (from the exponent bank, written segments before),
        # its bank and row from a flip-flop with a reset beside the delay line (synthesis maps the reset-less
        # line to shift registers, whose output is slow; a reset keeps this stage out of them)
        s3_line = _delay(m, s1, self.MUL_LATENCY - 2, "meta_mul")
        s3_pre = Signal.like(s1, name="meta_mul_flop")
        m.d.sync += s3_pre.eq(s3_line)
        s3 = _delay(m, s3_pre, 1, "meta_mul_last")
        e3 = Signal(signed(EXP_BITS), reset_less=True)
        m.d.sync += e3.eq(self.i_exp[s3_pre.tag.seg_bank][s3_pre.row])
        m.d.comb += [ldexp.i_valid.eq(s3.valid), ldexp.i_a.eq(mul.o_y), ldexp.i_b.eq(e3)]
        s4 = _delay(m, s3, ldexp.latency, "meta_ldexp")

        # y memories, one per field: two tile banks of R rows. Read-modify-write: the old y is read two
        # cycles before the add and taken into the adder's operand register (no path from the block RAM's
        # output into the adder's first stage); a row/field is written once per segment, at least `seg`
        # cycles apart.
        mems = []
        for fld in range(2):
            mem = Memory(shape=unsigned(32), depth=2 * R, init=[], attrs={"ram_style": "block"})
            m.submodules[f"y{fld}"] = mem
            mems.append(mem)
        s4_rd = _delay(m, s3, ldexp.latency - self.READ_AHEAD, "meta_rd")     # s4 two cycles early: address
        s4_pre = _delay(m, s4_rd, 1, "meta_pre")                                 # the read data
        old = []
        for fld, mem in enumerate(mems):
            rp = mem.read_port(domain="sync", transparent_for=())
            m.d.comb += [rp.en.eq(1), rp.addr.eq(s4_rd.tag.tile_bank * R + s4_rd.row)]
            old.append(rp.data)
        a_op = Signal(32, name="a_op")
        m.d.sync += a_op.eq(Mux(s4_pre.tag.tile_first, NEG_ZERO, Mux(s4_pre.field, old[1], old[0])))
        m.d.comb += [add.i_valid.eq(s4.valid), add.i_a.eq(a_op), add.i_b.eq(ldexp.o_y)]
        s5 = _delay(m, s4, add.latency, "meta_add")
        for fld, mem in enumerate(mems):
            wp = mem.write_port()
            m.d.comb += [wp.en.eq(s5.valid & (s5.field == fld)), wp.addr.eq(s5.tag.tile_bank * R + s5.row),
                         wp.data.eq(add.o_y)]
            rd = mem.read_port(domain="sync", transparent_for=())
            m.d.comb += [rd.en.eq(self.i_rd_en), rd.addr.eq(self.i_rd_addr), self.o_rd_data[fld].eq(rd.data)]
        m.d.sync += self.o_done.eq(s5.valid & s5.field & (s5.row == R - 1) & s5.tag.tile_last)
        return m


class EngineGeometry:
    """Derived sizes of the tile engine, from a `HardwareConfig` (mirrors `sim.systolic.TileGeometry`)."""

    def __init__(self, cfg: HardwareConfig):
        if not cfg.weight_group:
            raise ValueError("the systolic engine needs weight_group > 0 (per-row scales: a group as long as "
                             "the row)")
        self.rows, self.cols = cfg.systolic_rows, cfg.systolic_cols
        self.group, self.block = cfg.weight_group, cfg.act_block
        self.beat_bits, self.act_bits = cfg.axi_data_bits, cfg.act_bits
        self.seg = min(self.group, self.block)
        self.field = segment_sum_bits(self.seg, self.act_bits)      # as sim.systolic.field_bits
        if self.field + 5 > MUL_A_BITS or 2 * self.field > P_BITS or self.act_bits > MUL_B_BITS:
            raise ValueError(f"segments of {self.seg} products do not fit two per DSP48E2")
        self.step_bits = 2 * self.cols * 4
        if self.step_bits % self.beat_bits and self.beat_bits % self.step_bits:
            raise ValueError(f"a k-step of {self.step_bits} weight bits and a {self.beat_bits}-bit beat must "
                             f"divide one another")
        self.wgt_ports = max(1, self.step_bits // self.beat_bits)
        if self.wgt_ports > cfg.axi_ports:
            raise ValueError(f"a k-step needs {self.wgt_ports} weight ports; the config has {cfg.axi_ports}")
        self.port_step_bits = self.step_bits // self.wgt_ports
        self.steps_per_beat = self.beat_bits // self.port_step_bits
        if self.seg < 2 * self.rows:
            raise ValueError(f"segments of {self.seg} k-steps are shorter than the 2 x {self.rows} cycles a "
                             f"column needs to drain one; use fewer rows or a longer segment")
        if self.seg % self.steps_per_beat:
            raise ValueError(f"segments ({self.seg}) must hold whole beats ({self.steps_per_beat} steps)")


class SystolicEngine(wiring.Component):
    """The GEMM tile engine: one tile = R token rows × 2C output rows × ``nseg`` segments of k-steps.

    Parameters
    ----------
    cfg : HardwareConfig
        ``systolic_rows/cols`` (R, C), ``weight_group``/``act_block`` (segment), ``axi_data_bits``.

    Members
    -------
    i_cmd : In(stream.Signature(unsigned(16)))    segments in the next tile (>= 1)
    i_wgt : In(stream.Signature(unsigned(axi_data_bits))).array(wgt_ports)
        weight beats; port p carries output rows p·2C/P .. of every k-step, k-major, low nibble first;
        a beat holds ``steps_per_beat`` consecutive k-steps (`sim.systolic.tile_streams`)
    i_act : In(stream.Signature(ArrayLayout(signed(8), R)))        one k-step's activations, row t = token t
    i_exp : In(stream.Signature(ArrayLayout(signed(9), R)))        one activation block's exponents
    i_scale : In(stream.Signature(ArrayLayout(unsigned(16), 2C)))  one weight group's binary16 scales
    o_y : Out(stream.Signature(StructLayout{y: ArrayLayout(unsigned(32), 2C), last: 1}))
        one token row of the tile's results (binary32 bits); ``last`` on row R-1

    Throughput: one k-step per cycle while every input is valid, back to back across tiles (the y memories
    are double-buffered; a tile's rows are read out while the next one computes).
    """

    def __init__(self, cfg: HardwareConfig):
        with rejecting(self):           # never elaborated: not an unused-component mistake
            geo = EngineGeometry(cfg)
            R, C = geo.rows, geo.cols
            # The hold banks for exponents and scales (one per segment parity) are rewritten two segments
            # later; the last lane must have read them by then.
            last_read = self.array_latency + 2 * (R - 1) + (C - 1) + ScaleLane.EXP_READ
            if 2 * geo.seg <= last_read:
                raise ValueError(f"two segments ({2 * geo.seg} steps) do not outlast the array's drain and scale "
                                 f"pipeline ({last_read} cycles); use longer segments or a smaller array")
            # A y entry is read again one segment after it was read for the add (READ_AHEAD cycles before the
            # add); the add must be done by then.
            if geo.seg <= ScaleLane.LATENCY - ScaleLane.EXP_READ + ScaleLane.READ_AHEAD - 1:
                raise ValueError(f"segments of {geo.seg} steps are shorter than the scale lane's add loop")
        self._cfg, self._geo = cfg, geo
        self._lanes = [ScaleLane(geo.rows, geo.field) for _ in range(geo.cols)]
        super().__init__({
            "i_cmd": In(stream.Signature(unsigned(16))),
            "i_wgt": In(stream.Signature(unsigned(geo.beat_bits))).array(geo.wgt_ports),
            "i_act": In(stream.Signature(data.ArrayLayout(signed(geo.act_bits), R))),
            "i_exp": In(stream.Signature(data.ArrayLayout(signed(EXP_BITS), R))),
            "i_scale": In(stream.Signature(data.ArrayLayout(unsigned(16), 2 * C))),
            "o_y": Out(stream.Signature(data.StructLayout({"y": data.ArrayLayout(unsigned(32), 2 * C),
                                                           "last": 1}))),
        })

    @property
    def geometry(self) -> EngineGeometry:
        return self._geo

    @property
    def array_latency(self) -> int:
        return 1 + SystolicArray.latency     # the entrance's step register, then the array

    @property
    def latency(self) -> int:
        """Cycles from a tile's last k-step firing to its first output row being valid (consumer ready)."""
        g = self._geo
        # drain of the last lane, the lane, its done flag, the full flag, the first readout row
        return self.array_latency + 2 * (g.rows - 1) + (g.cols - 1) + ScaleLane.LATENCY + 3

    def elaborate(self, platform):
        m = Module()
        g = self._geo
        R, C, seg = g.rows, g.cols, g.seg
        m.submodules.array = array = SystolicArray(R, C, g.field, g.act_bits)

        # --- entrance -------------------------------------------------------------------------------
        k = Signal(range(seg))
        s = Signal(16)
        seg_bank = Signal()
        tile_bank = Signal()
        busy = Signal(2)              # y bank in use: set by a tile's first step, cleared by its readout
        full = Signal(2)              # y bank complete: set by the last lane, cleared by the readout
        # Which k-step of its current beat each weight port is on (always 0 with one step per beat).
        chunk = [Signal(range(max(2, g.steps_per_beat)), name=f"chunk_{p}") for p in range(g.wgt_ports)]
        # The step's flags as registers, stepped with k and s: last_k (k == seg - 1), first (k == 0 and s == 0)
        # and s + 1, so that the tile's last segment is one equality with the command.
        last_k = Signal(init=int(seg == 1))
        first = Signal(init=1)
        s_p1 = Signal(len(s) + 1, init=1)
        last_seg = s_p1 == self.i_cmd.payload
        seg_per_block, seg_per_group = g.block // seg, g.group // seg
        end_block = last_seg | ((s & (seg_per_block - 1)) == seg_per_block - 1)
        end_group = last_seg | ((s & (seg_per_group - 1)) == seg_per_group - 1)
        wgt_valid = Cat(*(w.valid for w in self.i_wgt)).all()
        fire = Signal()
        m.d.comb += fire.eq(self.i_cmd.valid & self.i_act.valid & wgt_valid &
                            (~last_k | (self.i_exp.valid & self.i_scale.valid)) &
                            (~first | ~busy.bit_select(tile_bank, 1)))
        m.d.comb += [self.i_act.ready.eq(fire),
                     self.i_cmd.ready.eq(fire & last_k & last_seg),
                     self.i_exp.ready.eq(fire & last_k & end_block),
                     self.i_scale.ready.eq(fire & last_k & end_group)]
        w_now = Signal(g.step_bits)
        for p, w in enumerate(self.i_wgt):
            m.d.comb += w.ready.eq(fire & (chunk[p] == g.steps_per_beat - 1))
            piece = w.payload if g.steps_per_beat == 1 else w.payload.word_select(chunk[p], g.port_step_bits)
            m.d.comb += w_now[p * g.port_step_bits:(p + 1) * g.port_step_bits].eq(piece)
            with m.If(fire):
                m.d.sync += chunk[p].eq(Mux(chunk[p] == g.steps_per_beat - 1, 0, chunk[p] + 1))

        step = Signal(step_layout(R, C, g.act_bits))
        exp_hold = Signal(data.ArrayLayout(data.ArrayLayout(signed(EXP_BITS), R), 2))
        scale_hold = Signal(data.ArrayLayout(data.ArrayLayout(unsigned(16), 2 * C), 2))
        m.d.sync += step.valid.eq(fire)
        with m.If(fire):
            m.d.sync += [step.a.eq(self.i_act.payload), step.w.eq(w_now), step.last.eq(last_k),
                         step.tag.seg_bank.eq(seg_bank), step.tag.tile_first.eq(s == 0),
                         step.tag.tile_last.eq(last_seg), step.tag.tile_bank.eq(tile_bank)]
            m.d.sync += [k.eq(Mux(last_k, 0, k + 1)), last_k.eq(Mux(last_k, seg == 1, k == seg - 2)),
                         first.eq(last_k & last_seg)]
            with m.If(last_k):
                m.d.sync += [exp_hold[seg_bank].eq(self.i_exp.payload),
                             scale_hold[seg_bank].eq(self.i_scale.payload), seg_bank.eq(~seg_bank)]
                m.d.sync += [s.eq(Mux(last_seg, 0, s + 1)), s_p1.eq(Mux(last_seg, 1, s_p1 + 1))]
                with m.If(last_seg):
                    m.d.sync += tile_bank.eq(~tile_bank)
        with m.Else():
            m.d.sync += step.last.eq(0)
        m.d.comb += array.i_step.eq(step)

        # --- scale lanes ------------------------------------------------------------------------------
        rd_en = Signal()
        rd_t = Signal(range(R + 1))
        rd_bank = Signal()
        lanes = []
        for c in range(C):
            lane = self._lanes[c]
            m.submodules[f"lane_{c}"] = lane
            lanes.append(lane)
            m.d.comb += [lane.i_res.eq(array.o_res[c]),
                         lane.i_rd_en.eq(rd_en), lane.i_rd_addr.eq(rd_bank * R + rd_t[:max(1, (R - 1).bit_length())])]
            for b in range(2):
                m.d.comb += lane.i_exp[b].eq(exp_hold[b])
                for fld in range(2):
                    m.d.comb += lane.i_scale[b][fld].eq(scale_hold[b][2 * c + fld])
            for fld in range(2):
                m.d.comb += self.o_y.payload.y[2 * c + fld].eq(lane.o_rd_data[fld])
        # The last lane finishes a tile last (lanes are skewed by one cycle each, same pipeline). Which bank
        # it finished is the readout's bank: tiles complete in order.
        fin_bank = Signal()
        with m.If(lanes[-1].o_done):
            m.d.sync += fin_bank.eq(~fin_bank)

        # --- readout (the output deskew) -------------------------------------------------------------
        advance = ~self.o_y.valid | self.o_y.ready
        issue = full.bit_select(rd_bank, 1) & (rd_t != R)
        m.d.comb += rd_en.eq(advance)
        with m.If(advance):
            m.d.sync += self.o_y.valid.eq(issue)
            with m.If(issue):
                m.d.sync += [rd_t.eq(rd_t + 1), self.o_y.payload.last.eq(rd_t == R - 1)]
        done_read = self.o_y.valid & self.o_y.ready & self.o_y.payload.last
        full_set = Mux(lanes[-1].o_done, Mux(fin_bank, 0b10, 0b01), 0)
        with m.If(done_read):
            m.d.sync += [rd_t.eq(0), rd_bank.eq(~rd_bank)]
        clear = Mux(done_read, Mux(rd_bank, 0b10, 0b01), 0)
        busy_set = Mux(fire & first, Mux(tile_bank, 0b10, 0b01), 0)
        m.d.sync += full.eq((full | full_set)[:2] & ~clear)
        m.d.sync += busy.eq((busy | busy_set)[:2] & ~clear)
        return m
