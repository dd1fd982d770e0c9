"""The pass engine: one pass streams `n` binary32 elements from a source through the SFU (or around it) into a
sink (docs/architecture.md, "Controller").

===========  ================================================================================================
sources      ``L2`` (an `ElemReader`), ``PAIRS`` (two L2 elements per item: the u0.64 RoPE frequencies),
             ``DDR`` (a `DdrReader`: binary32, binary16 or scaled INT4 rows), ``REG`` (one scalar), ``PACK`` (the
             KV packer's plane words and scales: INT8 KVST)
b operand    none, or ``L2`` (a second `ElemReader`)
sinks        ``L2`` (an `ElemWriter`), ``REG`` (the last element: scalar results), ``DDR`` (a `DdrWriter`:
             binary32, binary16, or with ``wr_stride`` each element's low byte on its own: INT8 V rows),
             ``DESC`` (the words of a descriptor), ``QUANT`` (the activation quantiser,
             whose words go to ``qdst``: the GEMV engine (its vector ``qtok`` when it takes several), token slot
             ``qtok`` of the GEMM unit, or the KV packer;
             always from ``L2`` around the SFU, four elements per cycle: the reader's beats), ``MASK`` (the GEMV
             engine's row mask: per element a live bit, set unless it is ±0; from ``L2`` as ``QUANT``)
===========  ================================================================================================

A sequencer sends a pass as one `pass_layout` command on ``i_cmd``; the engine takes it while it is idle or in
the cycle its running pass completes (a sequencer launches only then, so its command is taken at once), holds
it, and starts it at once while no rows are held, else as soon as its L2 ranges do not meet the rows the GEMV
engine or the GEMM unit has yet to write (``i_hold``, checked a cycle before: `hazard`). ``o_done`` carries the
completion (always taken): the last scalar result, a bus error seen during the pass, and the quantiser's
non-finite flag.
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal, Value, unsigned
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.wiring import In, Out, connect

from ..config import HardwareConfig, ceil_log2
from ..ddrio import N_BITS, DdrFormat, DdrReader
from ..ddrwrite import DdrWriter
from ..isa import DESC_WORDS, DESCRIPTOR
from ..l2 import LANES, WORD_BITS, ElemReader, ElemWriter, l2_geometry, write_layout
from ..quant import ActQuantizer, command_layout as quant_command_layout, pack_command_layout
from ..rowmask import mask_layout
from ..sfu import REDUCE_OPS, SHORT_OPS, Sfu, SfuOp

__all__ = ["Src", "BSrc", "Sink", "QDst", "pass_layout", "done_layout", "hold_layout", "L2ReadPort", "PassEngine"]


class Src(enum.Enum, shape=3):
    L2 = 0
    PAIRS = 1
    DDR = 2
    REG = 3
    PACK = 4          # the KV packer's plane words and scales (INT8 KV cache: KVST)


class BSrc(enum.Enum, shape=1):
    NONE = 0
    L2 = 1


class Sink(enum.Enum, shape=3):
    L2 = 0
    REG = 1
    DDR = 2
    DESC = 3
    QUANT = 4
    MASK = 5          # the GEMV engine's row mask (WGEMV `mask`): a live bit per element that is not ±0


class QDst(enum.Enum, shape=2):
    """Where a QUANT pass's words go."""
    GEMV = 0          # the GEMV engine's activation memories (WGEMV, INT8 ATTN)
    GEMM = 1          # token slot ``qtok`` of the GEMM unit (WGEMM)
    PACK = 2          # the KV packer (INT8 KVST)


def pass_layout(hw: HardwareConfig) -> data.StructLayout:
    """One pass command: what `PassEngine` runs (every field a sequencer leaves out is 0)."""
    ea, nb, _ = l2_geometry(hw)
    a = hw.axi_addr_bits
    return data.StructLayout({
        "op": SfuOp, "bypass": 1, "n": nb,
        "a": Src, "a_addr": ea, "a_val": 32,
        "b": BSrc, "b_addr": ea,
        "s": 32, "s_inv": 32, "emax": 32, "sub_emax": 1, "recip_scale": 1, "accm": 1,
        "sink": Sink, "dst": ea,
        "ddr_addr": a,                                  # the DDR source's or the DDR sink's (no pass has both)
        "ddr_fmt": 2, "ddr_saddr": a, "ddr_log2g": 5,   # DDR source (hdl.ddrio formats)
        "wr_fmt": 1,                                    # DDR sink: binary32 / binary16
        "qlimit": 1, "qforce": 1, "qe": quant_command_layout().members["e"],   # quantiser options
        "qdst": QDst, "qtok": range(max(hw.systolic_rows, hw.gemv_vectors)),
        "psel": pack_command_layout().members["sel"],                      # PACK: which packer stream
        # DDR sink, V rows (``kv_v_layout`` "rows"): each element's low byte on its own, `wr_stride` bytes apart
        **({"wr_stride": unsigned(N_BITS)} if hw.kv_format == "int8" and hw.kv_v_layout == "rows" else {}),
    })


def done_layout() -> data.StructLayout:
    """A pass's completion: the last element into a REG sink, a bus error, the quantiser's non-finite flag."""
    return data.StructLayout({"result": 32, "err": 1, "nonfinite": 1})


def hold_layout(hw: HardwareConfig) -> data.StructLayout:
    """The L2 rows the GEMV engine or the GEMM unit has yet to write: [lo, lo + n) while ``active``; ``hi`` is
    lo + n (registered with them)."""
    ea, nb, _ = l2_geometry(hw)
    return data.StructLayout({"active": 1, "lo": ea, "n": nb, "hi": max(ea, nb) + 1})


def L2ReadPort(hw: HardwareConfig) -> wiring.Signature:
    """An L2 read port as its user sees it: word addresses out, words back."""
    _, _, wa = l2_geometry(hw)
    return wiring.Signature({"req": Out(stream.Signature(unsigned(wa))), "resp": In(stream.Signature(unsigned(WORD_BITS)))})


def meets(hold, lo, hi):
    """The element range [lo, hi) meets `hold`'s rows [lo, hi) (whether or not it is ``active``)."""
    return (lo < hold.hi) & (hold.lo < hi)


class PassEngine(wiring.Component):
    """Sources, the operand stage, the SFU or the bypass, sinks and completion of one pass at a time.

    Members
    -------
    i_cmd : In(stream(pass_layout))        a pass (taken while idle or completing; see the module)
    o_done : Out(stream(done_layout))      always ready: one per pass
    i_hold : In(hold_layout)               the engine's rows not yet in L2 (hazards)
    i_pos : In(32)                         POSITION (the SFU's RoPE functions)
    l2_a, l2_b : Out(L2ReadPort)           the two operand readers' L2 ports
    l2_w : Out(stream(write_layout))       the writer's L2 port
    m_rd : Out(AxiReadSignature)           the DdrReader (descriptors, DMA, GATHER, K/V rows)
    m_wr : Out(AxiWriteSignature)          the DdrWriter (DMA to DDR, KVST)
    o_act, o_exp : Out(stream)             the quantiser's words and exponents, for ``o_qdst`` / ``o_qtok``
    o_pack : Out(stream(pack_command_layout)); i_pack : In(stream(32))   the KV packer's reads (Src.PACK)
    o_mask : Out(stream(mask_layout))      a MASK pass's live bits, a word of four elements per beat from 0 on
    o_desc : Out(DESCRIPTOR)               the words of the last DESC pass
    o_active, o_sfu, o_dma : Out(1)        a pass is held or runs / runs through the SFU / the DDR movers are busy
    """

    def __init__(self, hw: HardwareConfig):
        from ..axi import AxiReadSignature, AxiWriteSignature
        self._hw = hw
        self._quant = ActQuantizer(hw)
        super().__init__({
            "i_cmd": In(stream.Signature(pass_layout(hw))),
            "o_done": Out(stream.Signature(done_layout(), always_ready=True)),
            "i_hold": In(hold_layout(hw)),
            "i_pos": In(32),
            "l2_a": Out(L2ReadPort(hw)), "l2_b": Out(L2ReadPort(hw)),
            "l2_w": Out(stream.Signature(write_layout(hw))),
            "m_rd": Out(AxiReadSignature.from_config(hw)),
            "m_wr": Out(AxiWriteSignature.from_config(hw)),
            "o_act": Out(self._quant.signature.members["o_act"].signature),
            "o_exp": Out(self._quant.signature.members["o_exp"].signature),
            "o_qdst": Out(QDst), "o_qtok": Out(range(max(hw.systolic_rows, hw.gemv_vectors))),
            "o_pack": Out(stream.Signature(pack_command_layout())),
            "o_mask": Out(stream.Signature(mask_layout(hw.gemv_max_cols))),
            "i_pack": In(stream.Signature(unsigned(32))),
            "o_desc": Out(DESCRIPTOR),
            "o_active": Out(1), "o_sfu": Out(1), "o_dma": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        m.submodules.rd_a = rd_a = ElemReader(hw, beats=True)
        m.submodules.rd_b = rd_b = ElemReader(hw, beats=True)
        m.submodules.wr = wr = ElemWriter(hw, beats=True)
        for rd, port in ((rd_a, self.l2_a), (rd_b, self.l2_b)):
            connect(m, rd.o_req, wiring.flipped(port.req))
            connect(m, wiring.flipped(port.resp), rd.i_resp)
        connect(m, wr.o_wr, wiring.flipped(self.l2_w))
        m.submodules.sfu = sfu = Sfu(hw)
        m.submodules.ddr_rd = ddr_rd = DdrReader(hw)
        m.submodules.ddr_wr = ddr_wr = DdrWriter(hw)
        connect(m, ddr_rd.axi, wiring.flipped(self.m_rd))
        connect(m, ddr_wr.axi, wiring.flipped(self.m_wr))
        m.submodules.quant = quant = self._quant
        connect(m, quant.o_act, wiring.flipped(self.o_act))
        connect(m, quant.o_exp, wiring.flipped(self.o_exp))
        units = dict(rd_a=rd_a, rd_b=rd_b, ddr_rd=ddr_rd, ddr_wr=ddr_wr, wr=wr, sfu=sfu, quant=quant)

        c = Signal(pass_layout(hw))           # the pass: taken from i_cmd, held until the next one
        queued = Signal()                     # taken, not yet started (it waits for its hazard to clear)
        active = Signal()
        start = Signal()
        done = Signal()
        m.d.comb += [self.o_qdst.eq(c.qdst), self.o_qtok.eq(c.qtok), self.o_active.eq(active | queued)]
        m.d.comb += self.i_cmd.ready.eq(~queued & (~active | done))

        # a reduction (one element out), a wide pass (a SHORT_OPS pass from L2 into L2 or a register, four
        # elements per cycle: the readers' beats, the SFU's four lanes, the writer's beats; every other pass moves
        # one element per cycle), a DDR copy (binary32 from DDR around the SFU into L2: the DdrReader's wide beats,
        # as many elements a cycle as an AXI beat holds, up to four), the ends of its L2 ranges and a MASK pass's
        # words: each registered with the pass, so that no decode of its op and no sum is on the way from the pass
        # or the hold to its start or its completion. A REG or DESC sink's elements: where they come from (the
        # SFU, or around it from source `a`: `take_<from>`, one-hot, all 0 for the other sinks) and whether they
        # are a descriptor's words, so that the sink's take and the descriptor words' enables are flip-flops
        # ANDed with the source's valid, with no decode of the pass's source, bypass and sink on the way
        def derived(p):
            is_reduce = ~p.bypass & Cat(*[p.op == op for op in REDUCE_OPS]).any()
            a_n, n_out = Mux(p.a == Src.PAIRS, p.n << 1, p.n), Mux(is_reduce, 1, p.n)
            mask_words = (n_out + LANES - 1) >> ceil_log2(LANES)    # (mask_last: minus 1, never a beat for 0)
            to_reg = (p.sink == Sink.REG) | (p.sink == Sink.DESC)
            return {**{f"take_{src.name.lower()}": to_reg & p.bypass & (p.a == src) for src in Src},
                    "take_sfu": to_reg & ~p.bypass, "desc": p.sink == Sink.DESC,
                    "is_reduce": is_reduce,
                    "wide": ~p.bypass & Cat(*[p.op == op for op in SHORT_OPS]).any() & (p.a == Src.L2)
                    & ((p.sink == Sink.L2) | (p.sink == Sink.REG)),
                    "ddr_wide": p.bypass & (p.a == Src.DDR) & (p.sink == Sink.L2) & (p.ddr_fmt == DdrFormat.F32),
                    "a_n": a_n, "a_hi": p.a_addr + a_n, "b_hi": p.b_addr + p.n, "dst_hi": p.dst + n_out,
                    "mask_words": mask_words, "mask_last": (mask_words + (1 << (len(mask_words) + 1)) - 1)
                    [:len(mask_words) + 1]}
        new = derived(self.i_cmd.payload)
        cd = {k: Signal.like(v, name=f"c_{k}") for k, v in new.items()}
        with m.If(self.i_cmd.valid & self.i_cmd.ready):
            m.d.sync += [c.eq(self.i_cmd.payload), queued.eq(1), *[cd[k].eq(v) for k, v in new.items()]]
        with m.If(start):
            m.d.sync += queued.eq(0)

        a_in_l2 = (c.a == Src.L2) | (c.a == Src.PAIRS)
        is_reduce, wide, a_n = cd["is_reduce"], cd["wide"], cd["a_n"]
        n_out = Signal.like(c.n)
        m.d.comb += n_out.eq(Mux(is_reduce, 1, c.n))
        # The hazard check is registered (`hazard`: the pass's ranges against the rows held a cycle before, its
        # `active` aside), so that no compare of the pass's and the hold's ends is on the way into the start. A
        # pass starts while nothing is held, or once it has been checked (`checked`: queued a cycle before,
        # so `hazard` is of its own ranges) against a hold that was already there a cycle before (`held`) and
        # does not meet it: the decision the check of the hold a cycle before would make.
        hold = self.i_hold
        hazard, checked, held = Signal(), Signal(), Signal()
        m.d.sync += [
            hazard.eq((a_in_l2 & meets(hold, c.a_addr, cd["a_hi"]))
                      | ((c.b == BSrc.L2) & meets(hold, c.b_addr, cd["b_hi"]))
                      | ((c.sink == Sink.L2) & meets(hold, c.dst, cd["dst_hi"]))),
            checked.eq(queued), held.eq(hold.active),
        ]
        m.d.comb += start.eq(queued & ~active & (~hold.active | (checked & held & ~hazard)))

        pending = Signal(data.StructLayout({name: 1 for name in (*units, "pack")}))
        err = Signal()                # a bus error seen during the pass
        with m.If(start):
            m.d.sync += [active.eq(1), err.eq(0),
                         pending.rd_a.eq(a_in_l2), pending.rd_b.eq(c.b == BSrc.L2),
                         pending.ddr_rd.eq(c.a == Src.DDR), pending.ddr_wr.eq(c.sink == Sink.DDR),
                         pending.wr.eq(c.sink == Sink.L2), pending.sfu.eq(~c.bypass),
                         pending.quant.eq(c.sink == Sink.QUANT), pending.pack.eq(c.a == Src.PACK)]
        self._commands(m, c, pending, units, wide, cd["ddr_wide"], n_out, a_n)
        operands, src_valid = self._operands(m, c, active, start, err, rd_a, rd_b, ddr_rd, cd["ddr_wide"])
        # a REG or DESC sink takes an element (it is always ready while the pass runs; no wide pass or DDR copy
        # ends in DESC: a DESC element is a beat of one)
        sunk_take = Signal()
        m.d.comb += sunk_take.eq(active & Cat(*([cd[f"take_{src.name.lower()}"] & src_valid[src] for src in Src]
                                                + [cd["take_sfu"] & sfu.o_data.valid])).any())
        # MASK: the beats sent (their words' address), and whether they are all of the pass's words
        mask_beats = Signal(range(hw.gemv_max_cols // LANES + 1))
        mask_all = Signal(init=1)
        stage = self._stage(m, c, active, wide, operands, rd_a, rd_b, quant, sfu, mask_beats, mask_all,
                            cd["mask_words"], cd["mask_last"], ddr_rd.o_beat, cd["ddr_wide"])
        # a bus error is seen where the reader offers its element or beat (the pass takes every one before it
        # completes), not where it is taken: no path from the sink's ready into `err`
        with m.If(cd["ddr_wide"] & ddr_rd.o_beat.valid & ddr_rd.o_beat.p.err):
            m.d.sync += err.eq(1)
        self._sinks_and_completion(m, c, active, start, done, pending, err, n_out, stage, wr, ddr_wr, quant,
                                   mask_all, sunk_take, cd["desc"])
        m.d.comb += [self.o_sfu.eq(active & ~c.bypass), self.o_dma.eq(ddr_rd.o_busy | ddr_wr.o_busy)]
        return m

    def _commands(self, m, c, pending, units, wide, ddr_wide, n_out, a_n):
        rd_a, rd_b, ddr_rd, ddr_wr, wr, sfu, quant = (units[k] for k in ("rd_a", "rd_b", "ddr_rd", "ddr_wr", "wr",
                                                                       "sfu", "quant"))
        m.d.comb += [
            rd_a.i_cmd.valid.eq(pending.rd_a), rd_a.i_cmd.payload.addr.eq(c.a_addr),
            rd_a.i_beats.eq((c.sink == Sink.QUANT) | (c.sink == Sink.MASK) | wide), rd_a.i_cmd.payload.n.eq(a_n),
            rd_b.i_cmd.valid.eq(pending.rd_b), rd_b.i_cmd.payload.addr.eq(c.b_addr),
            rd_b.i_cmd.payload.n.eq(c.n), rd_b.i_beats.eq(wide),
            ddr_rd.i_cmd.valid.eq(pending.ddr_rd), ddr_rd.i_cmd.payload.addr.eq(c.ddr_addr),
            ddr_rd.i_cmd.payload.n.eq(c.n), ddr_rd.i_cmd.payload.fmt.eq(c.ddr_fmt),
            ddr_rd.i_cmd.payload.saddr.eq(c.ddr_saddr), ddr_rd.i_cmd.payload.log2_group.eq(c.ddr_log2g),
            ddr_rd.i_cmd.payload.wide.eq(ddr_wide),
            ddr_wr.i_cmd.valid.eq(pending.ddr_wr), ddr_wr.i_cmd.payload.addr.eq(c.ddr_addr),
            ddr_wr.i_cmd.payload.n.eq(n_out), ddr_wr.i_cmd.payload.fmt.eq(c.wr_fmt),
            ddr_wr.i_cmd.payload.stride.eq(c.wr_stride if "wr_stride" in pass_layout(self._hw).members else 0),
            wr.i_cmd.valid.eq(pending.wr), wr.i_cmd.payload.addr.eq(c.dst), wr.i_cmd.payload.n.eq(n_out),
            sfu.i_cmd.valid.eq(pending.sfu),
            sfu.i_cmd.payload.op.eq(c.op), sfu.i_cmd.payload.length.eq(c.n),
            sfu.i_cmd.payload.sub_emax.eq(c.sub_emax), sfu.i_cmd.payload.recip_scale.eq(c.recip_scale),
            sfu.i_cmd.payload.accm.eq(c.accm), sfu.i_cmd.payload.s.eq(c.s), sfu.i_cmd.payload.s_inv.eq(c.s_inv),
            sfu.i_cmd.payload.emax.eq(c.emax), sfu.i_cmd.payload.pos.eq(self.i_pos),
            quant.i_cmd.valid.eq(pending.quant), quant.i_cmd.payload.n.eq(c.n),
            quant.i_cmd.payload.limit.eq(c.qlimit), quant.i_cmd.payload.force.eq(c.qforce),
            quant.i_cmd.payload.e.eq(c.qe),
            self.o_pack.valid.eq(pending.pack), self.o_pack.payload.sel.eq(c.psel), self.o_pack.payload.n.eq(c.n),
        ]
        for name, cmd in [(k, u.i_cmd) for k, u in units.items()] + [("pack", self.o_pack)]:
            with m.If(cmd.valid & cmd.ready):
                m.d.sync += getattr(pending, name).eq(0)

    def _operands(self, m, c, active, start, err, rd_a, rd_b, ddr_rd, ddr_wide):
        """The a and b operands, one element at a time (the stage takes the readers' beats itself), and each
        source's valid (`Src` to its element's valid)."""
        a_valid, a_data, a_ready = Signal(), Signal(32), Signal()
        b_valid, b_data, b_ready = Signal(), Signal(32), Signal()
        pair_hi, have_hi = Signal(32), Signal()
        a_sent = Signal()             # REG source: the element has been sent
        with m.If(start):
            m.d.sync += [have_hi.eq(0), a_sent.eq(0)]
        src_valid = {Src.L2: rd_a.o_elem.valid, Src.PAIRS: rd_a.o_elem.valid & have_hi, Src.DDR: ddr_rd.o_elem.valid,
                     Src.REG: active & ~a_sent, Src.PACK: self.i_pack.valid}
        with m.Switch(c.a):
            with m.Case(Src.L2):
                m.d.comb += [a_valid.eq(src_valid[Src.L2]), a_data.eq(rd_a.o_elem.payload.data),
                             rd_a.o_elem.ready.eq(a_ready)]
            with m.Case(Src.PAIRS):
                # element 2j (high word) is held, element 2j+1 (low word) completes the item
                m.d.comb += [a_valid.eq(src_valid[Src.PAIRS]), a_data.eq(pair_hi),
                             rd_a.o_elem.ready.eq(~have_hi | a_ready)]
                with m.If(rd_a.o_elem.valid & ~have_hi):
                    m.d.sync += [pair_hi.eq(rd_a.o_elem.payload.data), have_hi.eq(1)]
                with m.If(rd_a.o_elem.valid & have_hi & a_ready):
                    m.d.sync += have_hi.eq(0)
            with m.Case(Src.DDR):
                m.d.comb += [a_valid.eq(src_valid[Src.DDR]), a_data.eq(ddr_rd.o_elem.payload.data),
                             ddr_rd.o_elem.ready.eq(a_ready)]
                with m.If(ddr_rd.o_elem.valid & ~ddr_wide & ddr_rd.o_elem.payload.err):
                    m.d.sync += err.eq(1)
            with m.Case(Src.REG):
                m.d.comb += [a_valid.eq(src_valid[Src.REG]), a_data.eq(c.a_val)]
                with m.If(a_valid & a_ready):
                    m.d.sync += a_sent.eq(1)
            with m.Case(Src.PACK):
                m.d.comb += [a_valid.eq(src_valid[Src.PACK]), a_data.eq(self.i_pack.payload),
                             self.i_pack.ready.eq(a_ready)]
        with m.Switch(c.b):
            with m.Case(BSrc.NONE):
                m.d.comb += [b_valid.eq(1), b_data.eq(Mux(c.a == Src.PAIRS, rd_a.o_elem.payload.data, 0))]
            with m.Case(BSrc.L2):
                m.d.comb += [b_valid.eq(rd_b.o_elem.valid), b_data.eq(rd_b.o_elem.payload.data),
                             rd_b.o_elem.ready.eq(b_ready)]
        return (a_valid, a_data, a_ready, b_valid, b_data, b_ready), src_valid

    def _stage(self, m, c, active, wide, operands, rd_a, rd_b, quant, sfu, mask_beats, mask_all, mask_words,
               mask_last, ddr_beat, ddr_wide):
        """One register between the operands and the SFU or the quantiser; then the SFU or the bypass.

        A beat is either the readers' (four elements: the quantiser's passes and the wide passes; b from the
        second reader) or one element from the sources in lane 0; a DDR copy's beats (`ddr_beat`) pass around it
        into the writer, as the bypass's elements do. The stage cuts the
        path from the L2 response buffers through the readers' lane selects into the quantiser's maximum and
        the SFU's first stages; it is empty again when a pass ends (its consumer takes every element before the
        pass's sink is done). Returns the output beat (valid, lanes y, count n, ready)."""
        a_valid, a_data, a_ready, b_valid, b_data, b_ready = operands
        st = Signal(sfu.i_data.payload.shape())
        st_v = Signal()
        st_ready, st_in_v = Signal(), Signal()
        st_in = Signal.like(st)
        to_mask = c.sink == Sink.MASK
        m.d.comb += [st_ready.eq(~st_v | Mux(c.sink == Sink.QUANT, quant.i_beat.ready,
                                             Mux(to_mask, self.o_mask.ready, sfu.i_data.ready))),
                     quant.i_beat.valid.eq(st_v), quant.i_beat.payload.data.eq(st.a.as_value()),
                     quant.i_beat.payload.n.eq(st.n),
                     sfu.i_data.valid.eq(st_v & (c.sink != Sink.QUANT) & ~to_mask), sfu.i_data.payload.eq(st)]
        # MASK: the beat's live bits (an element that is not ±0; the lanes past the beat's count are not live),
        # addressed by the beats sent since the pass started
        maddr = mask_beats
        m.d.comb += [self.o_mask.valid.eq(st_v & to_mask), self.o_mask.payload.addr.eq(maddr),
                     self.o_mask.payload.bits.eq(Cat(*[(st.n > j) & st.a[j][:31].any() for j in range(LANES)]))]
        with m.If(~active):
            m.d.sync += [maddr.eq(0), mask_all.eq(mask_words == 0)]
        with m.Elif(self.o_mask.valid & self.o_mask.ready):
            m.d.sync += [maddr.eq(maddr + 1), mask_all.eq(maddr == mask_last)]
        with m.If(st_ready):
            m.d.sync += [st_v.eq(st_in_v & active), st.eq(st_in)]
        a_beat, b_beat = rd_a.o_beat, rd_b.o_beat
        b_wide = c.b == BSrc.L2
        with m.If(wide | (c.sink == Sink.QUANT) | to_mask):
            m.d.comb += [st_in_v.eq(a_beat.valid & (~b_wide | b_beat.valid)), st_in.a.eq(a_beat.payload.data),
                         st_in.n.eq(a_beat.payload.n),
                         a_beat.ready.eq(st_ready & (~b_wide | b_beat.valid)),
                         b_beat.ready.eq(st_ready & a_beat.valid & b_wide)]
            with m.If(b_wide):
                m.d.comb += st_in.b.eq(b_beat.payload.data)
        with m.Elif(~c.bypass):
            m.d.comb += [st_in_v.eq(a_valid & b_valid), st_in.a[0].eq(a_data), st_in.b[0].eq(b_data),
                         st_in.n.eq(1), a_ready.eq(st_ready & b_valid), b_ready.eq(st_ready & a_valid)]

        # SFU or bypass: s_y lanes 0 .. s_n - 1
        s_valid, s_y, s_n, s_ready = Signal(), Signal(data.ArrayLayout(32, LANES)), Signal(3), Signal()
        with m.If(ddr_wide):
            m.d.comb += [s_valid.eq(ddr_beat.valid), s_y.as_value().eq(ddr_beat.p.data), s_n.eq(ddr_beat.p.n),
                         ddr_beat.ready.eq(s_ready)]
        with m.Elif(c.bypass):
            m.d.comb += [s_valid.eq(a_valid), s_y[0].eq(a_data), s_n.eq(1), a_ready.eq(s_ready)]
        with m.Else():
            m.d.comb += [s_valid.eq(sfu.o_data.valid), s_y.eq(sfu.o_data.payload.y), s_n.eq(sfu.o_data.payload.n),
                         sfu.o_data.ready.eq(s_ready)]
        return s_valid, s_y, s_n, s_ready

    def _sinks_and_completion(self, m, c, active, start, done, pending, err, n_out, stage, wr, ddr_wr, quant,
                              mask_all, sunk_take, desc):
        s_valid, s_y, s_n, s_ready = stage
        s_last = Signal(32)                        # the last element of the beat (scalar results)
        with m.Switch(s_n):
            for j in range(LANES):
                with m.Case(j + 1):
                    m.d.comb += s_last.eq(s_y[j])
        result = Signal(32)
        # the descriptor's words: one flat register (a port of an ArrayLayout would give Yosys's ABC9 wire names
        # that collide with the element names Amaranth emits for it)
        words = Signal(DESCRIPTOR.size)
        m.d.comb += Value.cast(self.o_desc).eq(words)
        sunk = Signal.like(c.n)                    # elements taken by REG/DESC sinks (`sunk_take`)
        sunk_all = Signal(init=1)                  # sunk == n_out, registered with sunk
        # the descriptor word the next element loads, one-hot: word sunk mod DESC_WORDS of a DESC pass, none for
        # any other sink (a scalar result must not touch the descriptor)
        word_sel = Signal(DESC_WORDS)
        with m.If(start):
            m.d.sync += [sunk.eq(0), sunk_all.eq(n_out == 0), word_sel.eq(desc)]
        with m.Switch(c.sink):
            with m.Case(Sink.L2):
                m.d.comb += [wr.i_beat.valid.eq(s_valid), wr.i_beat.payload.data.eq(s_y.as_value()),
                             wr.i_beat.payload.n.eq(s_n), s_ready.eq(wr.i_beat.ready)]
            with m.Case(Sink.DDR):
                # one element per cycle: no wide pass ends in DDR
                m.d.comb += [ddr_wr.i_elem.valid.eq(s_valid), ddr_wr.i_elem.payload.eq(s_y[0]),
                             s_ready.eq(ddr_wr.i_elem.ready)]
            with m.Case(Sink.REG, Sink.DESC):
                m.d.comb += s_ready.eq(active)
        with m.If(sunk_take):
            m.d.sync += [result.eq(s_last), sunk.eq(sunk + s_n), sunk_all.eq((sunk + s_n)[:len(sunk)] == n_out),
                         word_sel.eq(word_sel.rotate_left(1))]
            for i in range(DESC_WORDS):
                with m.If(word_sel[i]):
                    m.d.sync += words[32 * i:32 * (i + 1)].eq(s_y[0])

        # completion: the sink has everything and every unit has taken its command. The units' done pulses seen
        # are cleared as the pass completes (no unit of it pulses after that, none of the next before its
        # start), not at the start: no path from the hazard check into them
        seen = Signal(data.StructLayout({"wr": 1, "ddr": 1, "quant": 1}))
        with m.If(done):
            m.d.sync += seen.eq(0)
        with m.Else():
            for name, pulse in (("wr", wr.o_done), ("ddr", ddr_wr.o_done), ("quant", quant.o_done)):
                with m.If(pulse):
                    m.d.sync += getattr(seen, name).eq(1)
        finished = Signal()
        with m.Switch(c.sink):
            with m.Case(Sink.L2):
                m.d.comb += finished.eq(seen.wr)
            with m.Case(Sink.DDR):
                m.d.comb += finished.eq(seen.ddr)
            with m.Case(Sink.QUANT):
                m.d.comb += finished.eq(seen.quant)
            with m.Case(Sink.REG, Sink.DESC):
                m.d.comb += finished.eq(sunk_all)
            with m.Case(Sink.MASK):
                m.d.comb += finished.eq(mask_all)
        with m.If(active & finished & (pending.as_value() == 0)):          # (start needs ~active)
            m.d.sync += active.eq(0)
            m.d.comb += done.eq(1)
        with m.If(active & ddr_wr.o_error):
            m.d.sync += err.eq(1)
        m.d.comb += [self.o_done.valid.eq(done), self.o_done.payload.result.eq(result),
                     self.o_done.payload.err.eq(err), self.o_done.payload.nonfinite.eq(quant.o_nonfinite)]
