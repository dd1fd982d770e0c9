"""The attention sequencer: KVST and ATTN, after the controller has loaded the KV slot's descriptor.

binary16 cache (``kv_format`` "fp16"), ATTN per KV group: per visible position (oldest first) the K row
(binary16 -> binary32) into the scratch and one DOT per head into the scores; per head MAX, EXP(s - max), SUM,
RECIP, MULS; per position the V row and, per head, MULS (first position) or FMAS into dst. KVST: the K and V
rows out to the ring slot POSITION mod capacity.

INT8 cache ("int8", the presets; `sim.numerics.KvInt8Layout`), ATTN per head: the query into the quantiser,
two GEMV engine commands over the slot's K planes (lo, then hi with accm) into the scratch, MAX, EXP(s - max),
SUM, MUL by the V row scales (from DDR), then per chunk of ``gemv_max_cols`` positions the weights into the
quantiser and two sparse engine commands over the V planes (accm after the first) into dst, with RECIP(sum)
beside the first chunk's (it uses only the SFU and registers), then MULS by the reciprocal. KVST per head: K
into the quantiser (limit 119) and the `KvPacker`, its two plane rows and scale rows out to DDR; V into the
quantiser twice (its row exponent, then the values at that exponent), its two plane columns and its row
scale out.

V as rows (``kv_v_layout`` "rows", `sim.plan` ``_attn_v_rows``): KVST sends the V row's INT8 values (packer
stream 4) to the DDR writer, which scatters them a byte into each of the head's head_dim rows, a capacity apart.
ATTN per group of query heads (`sim.plan.attn_k_group`): the queries into the quantiser and the K GEMVs as
above, then per head MAX, EXP, SUM, MUL by the V row scales and RECIP(sum) (kept per head); per chunk of
positions each head's weights into the quantiser (the engine's vector i for the group's head i) and ONE GEMV
of INT8 weights over the V rows for the whole group, its outputs a head_dim apart from the group's dst (accm
after the first chunk); then per head MULS by its reciprocal.
"""

from __future__ import annotations

from types import SimpleNamespace

from amaranth import Array, Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import data, stream
from amaranth.lib.wiring import In, Out

from ..config import V_PLANE_LOG2_GROUP, HardwareConfig, ceil_log2
from ..isa import DdrRegion, DescKind, ErrorCode, Opcode, layout
from ..l2 import LANES
from ..quant import EXP_BITS
from ..sfu import SfuOp
from .engines import gemv_job_layout
from .passes import BSrc, QDst, Sink, Src
from .sequencer import (DividerPort, Sequencer, Steps, elem, end_to, engine_state_layout, geometry, in_l2,
                        product, recode)

__all__ = ["AttentionSequencer"]


def _early(m, cond):
    """`cond`, a condition on the context, registered every cycle: the instruction's from the cycle after the
    start on, when the first state registers it again as a check (`Steps.checks_registered`)."""
    flag = Signal(name="early")
    m.d.sync += flag.eq(cond)
    return flag


class AttentionSequencer(Sequencer):
    """KVST and ATTN. Beyond `Sequencer`'s ports: the divider (``div``: ring slots), and for the INT8 cache the
    tracker (``o_gemv``, ``o_act_n``, ``i_engine``) and the KV packer (``o_pack_clear``, ``i_pack``)."""

    def __init__(self, hw: HardwareConfig):
        super().__init__(hw, {
            "div": Out(DividerPort),
            "o_gemv": Out(stream.Signature(gemv_job_layout(hw))),
            "o_act_n": Out(stream.Signature(range(hw.gemv_max_cols + 1), always_ready=True)),
            "i_engine": In(engine_state_layout(hw)),
            "o_pack_clear": Out(1),
            "i_pack": In(data.StructLayout({"emax": signed(EXP_BITS), "vscale": 32})),
        })

    def elaborate(self, platform):
        m = Module()
        hw = self.hw
        self._st = st = Steps(m, self.o_pass, self.i_done, end_to(m, self.o_end), by_site=True, registered=True,
                              one_hot=True, bus_error_state="BUS_ERROR")
        ctx = self.i_ctx
        op = ctx.word[60:64]
        self._kv_ = data.View(layout(Opcode.KVST), ctx.word)
        self._at = data.View(layout(Opcode.ATTN), ctx.word)
        # ATTN's shape and window (from the FMAP entry), visible positions, ring slot and position index, head
        self.heads, self.hd, self.win = Signal(16, name="heads"), Signal(16, name="hd"), Signal(16, name="win")
        _, nb, _, _ = geometry(hw)
        self.n, self.t, self.h = Signal(nb, name="n"), Signal(nb, name="t"), Signal(16, name="h")
        self.cap, self.slot = Signal(32, name="cap"), Signal(32, name="slot")
        if hw.kv_format == "int8":
            self._int8_state(m)
        with m.FSM(name="attention") as fsm:
            with st.state("IDLE"):
                with m.If(self.i_start):
                    with m.If(op == Opcode.KVST):
                        m.next = "KV"
                    with m.Else():
                        m.next = "AT"
            st.wait_pass("RETIRE_PASS", st.retire)
            st.bus_error()
            if hw.kv_format == "int8":
                self._int8(m, st)
            else:
                self._kvst_fp16(m, st)
                self._attn_fp16(m, st)
        recode(fsm, "one-hot")
        st.finish()
        return m

    def _divide(self, m, num, den, nxt):
        m.d.comb += [self.div.start.eq(1), self.div.num.eq(num), self.div.den.eq(den)]
        m.next = nxt

    def _kv_base(self):
        return self.i_ctx.base[DdrRegion.KV.value] + self.i_ctx.desc.weight_offset

    def _kvst_checks(self, m, st, fmt, bad_length):
        """KVST's first states (the checks registered): the slot (its format), its lengths and the L2 ranges;
        then the ring slot POSITION mod capacity in the divider."""
        hw, ctx, d, kv = self.hw, self.i_ctx, self.i_ctx.desc, self._kv_
        st.checks_registered("KV", [
            (_early(m, (d.kind != DescKind.KV) | (d.layout != fmt)), lambda: st.fail(ErrorCode.BAD_DESCRIPTOR)),
            (_early(m, bad_length | (d.cols == 0) | (d.rows == 0)), lambda: st.fail(ErrorCode.BAD_LENGTH)),
            (_early(m, ~in_l2(hw, elem(kv.k), d.cols) | ~in_l2(hw, elem(kv.v), d.cols)),
             lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
        ], lambda: self._divide(m, ctx.pos, d.rows, "KV_1"))

    def _attn_checks(self, m, st, fmt, bad_length, narrow_ring, uses_engine):
        """ATTN's first states (the checks registered): the slot (its format), the head shape against the FMAP
        entry, the window (beyond the ring: ADDRESS_RANGE; narrower than the ring with `narrow_ring`:
        BAD_LENGTH); the shape and the positions seen into `heads`, `hd`, `win`, `cap` and `n`. With
        `uses_engine` it first waits for an async WGEMV to finish."""
        ctx, d, f, at, eng = self.i_ctx, self.i_ctx.desc, self.i_ctx.fmap, self._at, self.i_engine
        checks = [(eng.active, None), (eng.failed, lambda: st.fail(eng.code, at_engine=1))] if uses_engine else []
        checks += [
            (_early(m, (d.kind != DescKind.KV) | (d.layout != fmt)), lambda: st.fail(ErrorCode.BAD_DESCRIPTOR)),
            (_early(m, bad_length | (f.head_dim != d.head_dim) | (at.kv_head >= d.heads) | (f.heads == 0)),
             lambda: st.fail(ErrorCode.BAD_LENGTH)),
            (_early(m, ((f.window == 0) | (f.window > d.rows)) & (ctx.pos >= d.rows)),
             lambda: st.fail(ErrorCode.ADDRESS_RANGE))]
        if narrow_ring:
            checks.append((_early(m, (f.window != 0) & (f.window < d.rows)), lambda: st.fail(ErrorCode.BAD_LENGTH)))

        def start():
            seen = Mux((f.window == 0) | (ctx.pos < f.window), ctx.pos + 1, f.window)      # pos + 1 <= window
            m.d.sync += [self.n.eq(seen), self.heads.eq(f.heads), self.hd.eq(f.head_dim), self.win.eq(f.window),
                         self.cap.eq(d.rows)]
            if uses_engine:     # its GEMVs quantise into the engine: nothing to reuse after it
                m.d.comb += [self.o_act_n.valid.eq(1), self.o_act_n.payload.eq(0)]
            m.next = "AT_1"
        st.checks_registered("AT", checks, start)

    # --- binary16 cache ------------------------------------------------------------------------------------

    def _kvst_fp16(self, m, st):
        hw, d, kv = self.hw, self.i_ctx.desc, self._kv_
        # elements from the slot's start: the K row, the V row
        k_off, v_off = Signal(32, name="k_off"), Signal(32, name="v_off")
        self._kvst_checks(m, st, 0, 0)
        with st.state("KV_1"):
            with m.If(~self.div.busy):
                m.d.sync += [k_off.eq(self.div.r * d.cols), v_off.eq((d.rows + self.div.r) * d.cols)]
                m.next = "KV_2"
        A = hw.axi_addr_bits
        with st.state("KV_2"):
            st.launch("KV_3", bypass=1, n=d.cols, a=Src.L2, a_addr=elem(kv.k), sink=Sink.DDR,
                      ddr_addr=(self._kv_base() + (k_off << 1))[:A], wr_fmt=1)
        st.wait_pass("KV_3", lambda: st.launch("RETIRE_PASS", bypass=1, n=d.cols, a=Src.L2, a_addr=elem(kv.v),
                                               sink=Sink.DDR, ddr_addr=(self._kv_base() + (v_off << 1))[:A], wr_fmt=1))

    @staticmethod
    def _products(m, a, b):
        """State AT_1: register the products `a` and `b` (the Q and output span, the scores' span), then AT_1P;
        a product and the checks on it are then never in one cycle."""
        pa, pb = Signal(32, name="span"), Signal(32, name="scored")
        with m.State("AT_1"):
            m.d.sync += [pa.eq(a), pb.eq(b)]
            m.next = "AT_1P"
        return pa, pb

    def _attn_fp16(self, m, st):
        hw, ctx, d, at = self.hw, self.i_ctx, self.i_ctx.desc, self._at
        _, _, SB, SCR = geometry(hw)
        A = hw.axi_addr_bits
        heads, hd, n, t, h, cap, slot = self.heads, self.hd, self.n, self.t, self.h, self.cap, self.slot
        aq, ad = elem(at.q), elem(at.dst)
        row_off = Signal(32)          # elements from the slot's start to the oldest position's K row
        k_row = Signal(A)             # DDR address of the current position's K row (V: + capacity rows)
        first_row = Signal(A)         # the oldest position's K row: the V phase starts there again
        row_bytes = d.cols << 1
        scores = SB + hd              # [heads][n] after the K/V row
        self._attn_checks(m, st, 0, 0, 0, uses_engine=False)
        span, scored = self._products(m, heads * hd, heads * n)       # then AT_1P: the checks on them
        st.checks_registered("AT_1P", [
            (scored + hd > SCR, lambda: st.fail(ErrorCode.BAD_LENGTH)),
            (~in_l2(hw, aq, span) | ~in_l2(hw, ad, span), lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
        ], lambda: self._divide(m, ctx.pos + 1 - n, cap, "AT_2"))
        with st.state("AT_2"):
            with m.If(~self.div.busy):
                m.d.sync += [slot.eq(self.div.r), t.eq(0), row_off.eq(self.div.r * d.cols)]
                m.next = "AT_3"
        with st.state("AT_3"):
            row = (self._kv_base() + (row_off << 1) + ((at.kv_head * hd) << 1))[:A]
            m.d.sync += [k_row.eq(row), first_row.eq(row)]
            m.next = "AT_K"

        def next_position(state):
            """The next visible position: ring slot + 1 (wrapping to slot 0), its K row."""
            with m.If(slot + 1 == cap):
                m.d.sync += [slot.eq(0), k_row.eq((self._kv_base() + ((at.kv_head * hd) << 1))[:A])]
            with m.Else():
                m.d.sync += [slot.eq(slot + 1), k_row.eq(k_row + row_bytes)]
            m.d.sync += t.eq(t + 1)
            m.next = state

        def next_head(state):
            m.d.sync += h.eq(h + 1)
            m.next = state

        # phase 1: per position, the K row, then a DOT per head into scores[h][t]
        with st.state("AT_K"):
            m.d.sync += h.eq(0)
            with m.If(t == n):
                m.next = "AT_SM"
            with m.Else():
                st.launch("AT_KD", bypass=1, n=hd, a=Src.DDR, ddr_addr=k_row, ddr_fmt=1, sink=Sink.L2, dst=SB)
        st.wait_pass("AT_KD", st.go("AT_DOT"))
        with st.state("AT_DOT"):
            with m.If(h == heads):
                next_position("AT_K")
            with m.Else():
                st.launch("AT_DOTW", op=SfuOp.DOT, n=hd, a=Src.L2, a_addr=aq + h * hd, b=BSrc.L2, b_addr=SB,
                          sink=Sink.L2, dst=scores + h * n + t)
        st.wait_pass("AT_DOTW", lambda: next_head("AT_DOT"))
        # phase 2: softmax per head
        srow = scores + h * n
        with st.state("AT_SM"):
            with m.If(h == heads):
                m.d.sync += [t.eq(0), k_row.eq(first_row)]
                self._divide(m, ctx.pos + 1 - n, cap, "AT_V0")
            with m.Else():
                st.launch("AT_SM1", op=SfuOp.MAX, n=n, a=Src.L2, a_addr=srow, sink=Sink.REG)
        st.wait_pass("AT_SM1", lambda: st.launch("AT_SM2", op=SfuOp.EXP, n=n, a=Src.L2, a_addr=srow, emax=st.result,
                                                 sub_emax=1, sink=Sink.L2, dst=srow))
        st.wait_pass("AT_SM2", lambda: st.launch("AT_SM3", op=SfuOp.SUM, n=n, a=Src.L2, a_addr=srow, sink=Sink.REG))
        st.wait_pass("AT_SM3", lambda: st.launch("AT_SM4", op=SfuOp.RECIP, n=1, a=Src.REG, a_val=st.result,
                                                 sink=Sink.REG))
        st.wait_pass("AT_SM4", lambda: st.launch("AT_SM5", op=SfuOp.MULS, n=n, a=Src.L2, a_addr=srow, s=st.result,
                                                 sink=Sink.L2, dst=srow))
        st.wait_pass("AT_SM5", lambda: next_head("AT_SM"))
        # phase 3: per position, the V row, then per head dst += p * V
        with st.state("AT_V0"):
            with m.If(~self.div.busy):
                m.d.sync += slot.eq(self.div.r)
                m.next = "AT_V"
        with st.state("AT_V"):
            with m.If(t == n):
                st.retire()
            with m.Else():
                m.d.sync += h.eq(0)
                st.launch("AT_VD", bypass=1, n=hd, a=Src.DDR, ddr_addr=(k_row + cap * row_bytes)[:A], ddr_fmt=1,
                          sink=Sink.L2, dst=SB)
        st.wait_pass("AT_VD", st.go("AT_P"))
        with st.state("AT_P"):
            with m.If(h == heads):
                next_position("AT_V")
            with m.Else():
                st.launch("AT_PW", bypass=1, n=1, a=Src.L2, a_addr=scores + h * n + t, sink=Sink.REG)
        with st.state("AT_PW"):
            with m.If(st.done()):
                dst = ad + h * hd
                with m.If(t == 0):
                    st.launch("AT_PV", op=SfuOp.MULS, n=hd, a=Src.L2, a_addr=SB, s=st.result, sink=Sink.L2, dst=dst)
                with m.Else():
                    st.launch("AT_PV", op=SfuOp.FMAS, n=hd, a=Src.L2, a_addr=SB, s=st.result, b=BSrc.L2, b_addr=dst,
                              sink=Sink.L2, dst=dst)
        st.wait_pass("AT_PV", lambda: next_head("AT_P"))

    # --- INT8 cache (docs/numerics.md "KV cache", sim.numerics.KvInt8Layout) ----------------------------------

    def _int8_state(self, m):
        """The slot's sizes and addresses. Slot layout: per head j, the planes K_hi, K_lo, V_hi, V_lo of C·D/2
        bytes, then per head the K scales hi/lo of C·nb binary16, then per head the V scales of C binary16."""
        hw, d = self.hw, self.i_ctx.desc
        A = hw.axi_addr_bits
        # The slot's sizes, from the descriptor (stable from KVST's and ATTN's first state on, cycle 0: the
        # start), one product each for both instructions (`product`, 4 cycles): C·D/2 bytes per head (from cycle
        # 4 on) and C·nb·2 (nb registered first: from 5 on), then times the heads (from 8 and 9 on).
        self.blocks = Signal(16, name="blocks")           # the head's activation blocks (from cycle 1 on)
        m.d.sync += self.blocks.eq((d.head_dim + hw.act_block - 1) >> ceil_log2(hw.act_block))
        self.plane = product(m, d.rows, d.head_dim, 33, "plane_x2")[1:]
        self.kscales = Cat(Const(0, 1), product(m, d.rows, self.blocks, 31, "kscales_2"))
        self.planes = product(m, d.heads, self.plane, 32, "planes")
        self.all_kscales = product(m, d.heads, self.kscales, 32, "all_kscales")
        self.slot_base = Signal(A, name="slot_base")     # from cycle 1 on
        m.d.sync += self.slot_base.eq(self._kv_base())
        # a head's planes, K scales, V scales
        self.kb, self.ksb, self.vsb = Signal(A, name="kb"), Signal(A, name="ksb"), Signal(A, name="vsb")
        # the slot's K scale and V scale regions (from cycles 9 and 10 on; both instructions read them no
        # earlier)
        self.ks_region, self.vs_region = Signal(A, name="ks_region"), Signal(A, name="vs_region")
        m.d.sync += [self.ks_region.eq(self.slot_base + (self.planes << 2)),
                     self.vs_region.eq(self.slot_base + (self.planes << 2) + (self.all_kscales << 1))]
        # ATTN: the head's query and output rows (q + h·head_dim, dst + h·head_dim, stepped head by head); a
        # head's sum, then recip(sum): the RECIP pass runs beside the first chunk's V GEMVs (`recip_pending`)
        self.q_at, self.dst = Signal(geometry(hw)[0], name="q_at"), Signal(geometry(hw)[0], name="dst")
        self.rz, self.recip_pending = Signal(32, name="rz"), Signal(name="recip_pending")
        with m.If(self.recip_pending & self.i_done.valid):
            m.d.sync += [self.rz.eq(self.i_done.payload.result), self.recip_pending.eq(0)]

    def _int8(self, m, st):
        d = self.i_ctx.desc
        bad_hd = (d.head_dim[0:3] != 0) | (d.head_dim == 0) | (d.head_dim > self.hw.kv_max_head_dim)
        self._kvst_int8(m, st, bad_hd)
        self._attn_int8(m, st, bad_hd, ceil_log2(self.hw.act_block))

    def _kvst_int8(self, m, st, bad_hd):
        """Per head: K (one quantiser pass), V (its row exponent, then the values)."""
        hw, d, kv = self.hw, self.i_ctx.desc, self._kv_
        A = hw.axi_addr_bits
        vsb, plane, ks = self.vsb, self.plane, self.kscales
        # the ring slot's row in a plane / K scales: products of the divider's remainder, which holds from the
        # cycle it is done (KV_1) on, so they are the slot's from 4 cycles later on (KV_3)
        row_off = product(m, self.div.r, d.head_dim, 33, "row_off_x2")[1:]
        srow = Cat(Const(0, 1), product(m, self.div.r, self.blocks, 31, "srow_2"))
        ring = Signal(32, name="ring")
        j = Signal(8)                                     # head
        j_end = Signal()                                  # j == heads, registered with j
        last_j = Signal(9, name="last_j")                 # heads - 1 (mod 2**9): j + 1 == heads is j == last_j
        m.d.sync += last_j.eq(d.heads - 1)
        hb = Signal(16)                                   # element offset of head j in k and v
        self._kvst_checks(m, st, hw.kv_layout_code, bad_hd | (d.heads == 0))
        with st.state("KV_1"):
            with m.If(~self.div.busy):
                m.d.sync += ring.eq(self.div.r)
                m.next = "KV_2"
        st.pause("KV_2", 3, "KV_3")
        # the rows KVST writes, head after head, each address stepped from the last one: `plane_row` through
        # K_hi, K_lo, V_hi, V_lo of head 0, then of head 1 ... (a plane apart), `scale_row` through the K scales
        # hi and lo of head 0, 1 ... (a scale plane apart), `vsb` through the V scales (a row of C apart)
        plane_row, scale_row = Signal(A, name="plane_row"), Signal(A, name="scale_row")
        v_at = Signal(A, name="v_at")                     # V rows: from plane_row at V_hi to the slot's byte in row 0
        with st.state("KV_3"):
            sb = self.slot_base
            m.d.sync += [plane_row.eq(sb + row_off), scale_row.eq(self.ks_region + srow), v_at.eq(ring - row_off),
                         vsb.eq(self.vs_region + (ring << 1)), j.eq(0), j_end.eq(d.heads == 0), hb.eq(0)]
            m.next = "KV_K"

        def quantise(state, **kw):
            st.launch(state, bypass=1, n=d.head_dim, sink=Sink.QUANT, qlimit=1, qdst=QDst.PACK, **kw)

        def out(state, sel, n, addr, fmt):
            st.launch(state, bypass=1, n=n, a=Src.PACK, psel=sel, sink=Sink.DDR, ddr_addr=addr[:A], wr_fmt=fmt)

        def plane_out(state, sel):
            out(state, sel, words, plane_row, 0)
            m.d.sync += plane_row.eq(plane_row + plane)

        def scale_out(state, sel):
            out(state, sel, self.blocks, scale_row, 1)
            m.d.sync += scale_row.eq(scale_row + ks)
        k, v = elem(kv.k), elem(kv.v)
        words = d.head_dim >> 3
        with st.state("KV_K"):
            with m.If(j_end):
                st.retire()
            with m.Else():
                m.d.comb += self.o_pack_clear.eq(1)
                quantise("KV_KQ", a=Src.L2, a_addr=k + hb)
        # the checks on a quantiser pass's completion and the packer's exponent, registered at the completion
        # (`bad`, with the exponent `qe`) and taken the cycle after (KV_KC, KV_VC)
        bad, qe = Signal(name="kv_bad"), Signal.like(self.i_pack.emax, name="kv_qe")
        with st.state("KV_KQ"):
            with m.If(st.done()):
                m.d.sync += bad.eq(self.i_done.payload.nonfinite | (self.i_pack.emax > 11))  # 2**(e+4) beyond
                m.next = "KV_KC"                                                           # binary16
        with st.state("KV_KC"):
            with m.If(bad):
                st.fail(ErrorCode.NON_FINITE)
            with m.Else():
                plane_out("KV_K1", 0)
        st.wait_pass("KV_K1", lambda: plane_out("KV_K2", 1))
        st.wait_pass("KV_K2", lambda: scale_out("KV_K3", 2))
        st.wait_pass("KV_K3", lambda: scale_out("KV_K4", 3))

        def v_row():
            m.d.comb += self.o_pack_clear.eq(1)
            quantise("KV_VA", a=Src.L2, a_addr=v + hb)
        st.wait_pass("KV_K4", v_row)
        with st.state("KV_VA"):
            with m.If(st.done()):
                m.d.sync += [bad.eq(self.i_done.payload.nonfinite | (self.i_pack.emax > 15)),   # 2**e beyond
                             qe.eq(self.i_pack.emax)]                                          # binary16
                m.next = "KV_VC"
        with st.state("KV_VC"):
            with m.If(bad):
                st.fail(ErrorCode.NON_FINITE)
            with m.Else():
                quantise("KV_VB", a=Src.L2, a_addr=v + hb, qforce=1, qe=qe)
        if hw.kv_v_layout == "rows":
            def v_rows():   # the row's INT8 values, a byte into each of the head's V rows (a capacity apart)
                st.launch("KV_V2", bypass=1, n=d.head_dim, a=Src.PACK, psel=4, sink=Sink.DDR,
                          ddr_addr=(plane_row + v_at)[:A], wr_stride=d.rows)
                m.d.sync += plane_row.eq(plane_row + (plane << 1))
            st.wait_pass("KV_VB", v_rows)
        else:
            st.wait_pass("KV_VB", lambda: plane_out("KV_V1", 0))
            st.wait_pass("KV_V1", lambda: plane_out("KV_V2", 1))
        st.wait_pass("KV_V2", lambda: st.launch("KV_V3", bypass=1, n=1, a=Src.REG, a_val=self.i_pack.vscale,
                                                sink=Sink.DDR, ddr_addr=vsb, wr_fmt=1))

        def next_head():
            m.d.sync += [j.eq(j + 1), j_end.eq(j == last_j), hb.eq(hb + d.head_dim),
                         vsb.eq(vsb + (d.rows << 1))]
            m.next = "KV_K"
        st.wait_pass("KV_V3", next_head)

    def _ring_pieces(self, m, n, hd, MAXC, nb, A):
        """INT8 ATTN's pieces of the ring: the first visible slot s0, the pieces' sizes and flags, the K and V
        piece flags, and the registered addresses of the first piece's K plane rows, K scales, V scales and V
        columns (`_attn_int8`)."""
        # The visible slots (`sim.plan.attn_pieces`): all C of a full ring in slot order, else the n from slot s0 =
        # (POS + 1 - n) mod C on, wrapping at C: a first piece of n1 slots from s0 and a second of n2 = n - n1
        # from slot 0 (`wrap`). The K GEMVs, the V row scales and the V chunks run piece by piece (`kp`, `vp`: the
        # second piece's), the scores contiguous in the scratch. The offsets of s0 in a plane (s0·D/2 bytes), in the
        # K scales (s0·nb·2) and in the V scales (2·s0), and the pieces' sizes are registered from s0 (AT_2) on.
        s0 = Signal(32, name="s0")
        s0_row = product(m, s0, hd, 33, "s0_row_x2")[1:]
        s0_ks = Cat(Const(0, 1), product(m, s0, self.blocks, 31, "s0_ks_2"))
        n1, n2 = Signal(nb, name="n1"), Signal(nb, name="n2")
        wrap, n2_more = Signal(name="wrap"), Signal(name="n2_more")
        kp, vp = Signal(name="k_piece"), Signal(name="v_piece")
        cap, kb, ksb, vsb, plane = self.cap, self.kb, self.ksb, self.vsb, self.plane
        s0_end = Signal(33, name="s0_end")
        m.d.sync += [s0_end.eq(s0 + n), n1.eq(Mux(s0_end > cap, cap - s0, n)), n2.eq(n - n1), wrap.eq(n2 != 0),
                     n2_more.eq(n2 > MAXC)]
        kb0, ksb0, vsb0 = Signal(A, name="kb0"), Signal(A, name="ksb0"), Signal(A, name="vsb0")
        vcol0, vrow0 = Signal(A, name="vcol0"), Signal(A, name="vrow0")
        m.d.sync += [kb0.eq(kb + s0_row), ksb0.eq(ksb + s0_ks), vsb0.eq(vsb + (s0 << 1)), vcol0.eq(kb + (plane << 1)),
                     vrow0.eq(vcol0 + s0_row)]
        return s0, n1, n2, wrap, n2_more, kp, vp, kb0, ksb0, vsb0, vcol0, vrow0

    def _attn_int8(self, m, st, bad_hd, LB):
        """Per head: scores = two GEMVs over the K planes, softmax on the SFU, the V row scales folded into the
        weights, out = two sparse GEMVs over the V planes per chunk, times recip(sum)."""
        hw, ctx, d, at, eng = self.hw, self.i_ctx, self.i_ctx.desc, self._at, self.i_engine
        _, nb, SB, SCR = geometry(hw)
        A = hw.axi_addr_bits
        MAXC = hw.gemv_max_cols
        heads, hd, n, h = self.heads, self.hd, self.n, self.h
        kb, ksb, vsb, plane, ks = self.kb, self.ksb, self.vsb, self.plane, self.kscales
        aq, ad = elem(at.q), elem(at.dst)
        # the chunk's first score (SB + its first position), its positions, the positions from it on; each
        # check on them a flag registered with them: the first chunk, none left, more than MAXC left
        s_at, chunk_n, left = Signal(geometry(hw)[0], name="s_at"), Signal(nb, name="chunk_n"), Signal(nb, name="left")
        first, none_left, more = Signal(name="first"), Signal(name="none_left"), Signal(name="more")
        take = Mux(more, MAXC, left)                  # the chunk's positions
        h_end = Signal(name="h_end")                  # h == heads, registered with h
        last_h = Signal(16, name="last_h")            # heads - 1 (mod 2**16): h + 1 == heads is h == last_h
        no_heads = Signal(name="no_heads")            # heads == 0
        m.d.sync += [last_h.eq(heads - 1), no_heads.eq(heads == 0)]
        vrow = Signal(A)                              # the chunk's first V_hi column (V_lo: a plane on)
        vtab = Signal(A)                              # the V planes' scale table (lo: 2·head_dim bytes on)
        s0, n1, n2, wrap, n2_more, kp, vp, kb0, ksb0, vsb0, vcol0, vrow0 = self._ring_pieces(m, n, hd, MAXC, nb, A)
        dst, rz, recip_pending = self.dst, self.rz, self.recip_pending
        # On a GEMV engine of V > 1 vectors the K GEMVs serve a group of up to V heads at once
        # (`sim.plan.attn_k_group`): the group's queries go into the engine's vectors 0, 1 ..., and each K plane is
        # read once for all of them, the head's scores `stride` elements after the one before it (n rounded up to
        # a whole L2 word) in the scratch; then per head of the group the softmax and the V GEMVs as alone.
        V = hw.gemv_vectors
        grouped = V > 1
        rows = hw.kv_v_layout == "rows"
        if grouped:
            stride = Signal(nb, name="score_stride")          # from n (cycle 1 on): stable from AT_3 on
            fits = Signal(name="group_fits")                  # V rows of scores fit the scratch
            m.d.sync += [stride.eq((n + LANES - 1) & ~(LANES - 1)), fits.eq(stride * V <= SCR)]
            g_n = Signal(range(V + 1), name="group_heads")    # heads in this group
            qi = Signal(range(V), name="group_q")             # the query quantised last; then heads left
            q_more = Signal(name="group_q_more")              # a query of the group follows the one quantised
            qg = Signal.like(self.q_at, name="group_q_at")    # the next query of the group
            kspan = Signal(nb, name="group_span")             # (g_n - 1) * stride: the K GEMVs' rows beyond a head's
            sc = Signal.like(self.q_at, name="scores_at")     # the head's scores
            heads_left = Signal(16, name="heads_left")        # heads - h, set with h
            vspan = Signal(nb, name="group_vspan")            # (g_n - 1) * head_dim: the V GEMV's outputs beyond one
        else:
            sc = SB
        # Every engine command's addresses are one base plus, for the lo plane, one offset: K from the head's
        # planes and K scales, V from the chunk's columns and the scale table. Which ones, `on_v` and `on_lo`,
        # registered: V from the first chunk to the next head, lo from the quantiser pass before the lo plane's
        # command to that command (`engine`); the states' conditions choose the command's valid only.
        on_v, on_lo = Signal(name="on_v"), Signal(name="on_lo")
        wbase = (Mux(on_v, vrow, Mux(kp, kb, kb0)) + Mux(on_lo, plane, 0))[:A]
        sbase = (Mux(on_v, vtab, Mux(kp, ksb, ksb0)) + Mux(on_lo, Mux(on_v, hd << 1, ks), 0))[:A]

        # K: n rows of head_dim columns into the scratch; V: head_dim rows of the chunk's columns into dst. The
        # command is sent from a register, the cycle after `engine` (the payload 0 while not valid): no path
        # runs from the state through the choice of its operands into the tracker; a state after `engine` sees
        # the engine active from the cycle after the one that sends it (`sent`).
        job = Signal.like(self.o_gemv.payload)
        send, sent = Signal(name="gemv_launch"), Signal(name="gemv_valid")
        held = Signal.like(self.o_gemv.payload, name="gemv_payload")
        k_rows = Mux(kp, n2, n1)
        # V rows: one dense GEMV of INT8 weights per chunk for the group's heads (vectors 0 .. g_n - 1, their
        # outputs a head_dim apart from dst), rows `cap` bytes apart; V planes: two sparse GEMVs per head and chunk
        v_span = (vspan + hd) if rows and grouped else hd
        m.d.comb += [job.cmd.wbase.eq(wbase), job.cmd.sbase.eq(sbase),
                     job.cmd.rows.eq(Mux(on_v, hd, k_rows)), job.cmd.cols.eq(Mux(on_v, chunk_n, hd)),
                     job.cmd.log2_group.eq(Mux(on_v, V_PLANE_LOG2_GROUP, LB)), job.cmd.sparse.eq(on_v & ~rows),
                     job.cmd.accm.eq(Mux(on_v, ~first, ~on_lo) if rows else ~on_lo | (on_v & ~first)),
                     job.lo.eq(Mux(on_v, dst, Mux(kp, SB + n1, SB))),
                     job.n.eq(Mux(on_v, v_span, (kspan + k_rows) if grouped else k_rows)), job.pc.eq(ctx.pc),
                     self.o_gemv.valid.eq(sent), self.o_gemv.payload.eq(Mux(sent, held, 0))]
        if rows:
            m.d.comb += [job.cmd.int8.eq(on_v), job.cmd.pitch.eq(self.cap)]
        if grouped:
            m.d.comb += [job.cmd.vecs.eq(Mux(on_v, g_n - 1 if rows else 0, qi)),
                         job.stride.eq(Mux(on_v, hd, stride) if rows else stride)]
        m.d.sync += [sent.eq(send), held.eq(job)]

        def engine(nxt):
            m.d.comb += send.eq(1)
            m.d.sync += on_lo.eq(0)
            m.next = nxt

        def after_engine(state, then):
            with st.state(state):
                with m.If(~eng.active & ~sent):
                    with m.If(eng.failed):
                        m.next = "AT_ENGINE_ERROR"
                    with m.Else():
                        then()

        # the engine runs its GEMVs: an async WGEMV must finish first
        self._attn_checks(m, st, hw.kv_layout_code, bad_hd, 0, uses_engine=True)
        # the Q and output span, from the FMAP entry (from cycle 4 on: AT_1P, the checks on it)
        span = product(m, ctx.fmap.heads, ctx.fmap.head_dim, 32, "span")
        with st.state("AT_1"):
            m.next = "AT_1P"
        st.checks_registered("AT_1P", [
            (n > SCR, lambda: st.fail(ErrorCode.BAD_LENGTH)),
            (~in_l2(hw, aq, span) | ~in_l2(hw, ad, span), lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
        ], lambda: self._divide(m, ctx.pos + 1 - n, self.cap, "AT_2"))
        # the head's planes, K scales and V scales from the slot's start (from cycles 8, 9 and 4 on); AT_3, from
        # cycle 10 on (the V scale region), adds them to the regions; s0 from the divider (AT_2), its products
        # and the pieces from 4 and 6 cycles later on (AT_3 and after)
        head_plane = product(m, at.kv_head, plane, 32, "head_plane")
        head_ks = product(m, at.kv_head, ks, 32, "head_ks")
        head_rows = product(m, at.kv_head, d.rows, 32, "head_rows")
        # the V planes' scale table; V rows take its lo half (scale 1 per row)
        m.d.sync += vtab.eq(ctx.base[DdrRegion.WEIGHTS.value] + d.scale_offset + ((d.head_dim << 1) if rows else 0))
        full_ring = Signal(name="full_ring")          # n == C: the ring in slot order from slot 0
        m.d.sync += full_ring.eq(n == self.cap)
        with st.state("AT_2"):
            with m.If(~self.div.busy):
                m.d.sync += s0.eq(Mux(full_ring, 0, self.div.r))
                m.next = "AT_2P"
        st.pause("AT_2P", 6, "AT_3")
        with st.state("AT_3"):
            m.d.sync += [kb.eq(self.slot_base + (head_plane << 2)), ksb.eq(self.ks_region + (head_ks << 1)),
                         vsb.eq(self.vs_region + (head_rows << 1)), h.eq(0), h_end.eq(no_heads),
                         self.q_at.eq(aq), dst.eq(ad), on_v.eq(0), kp.eq(0)]
            if grouped:
                m.d.sync += heads_left.eq(heads)
            m.next = "AT_H"
        if grouped:
            with st.state("AT_H"):
                with m.If(h_end):
                    st.retire()
                with m.Else():
                    m.d.sync += g_n.eq(Mux(fits & (heads_left > 1), Mux(heads_left < V, heads_left, V), 1))
                    m.next = "AT_HQ"
            with st.state("AT_HQ"):
                st.launch("AT_Q", bypass=1, n=hd, a=Src.L2, a_addr=self.q_at, sink=Sink.QUANT, qdst=QDst.GEMV)
                m.d.sync += [on_lo.eq(1), qi.eq(0), q_more.eq(g_n > 1), qg.eq(self.q_at + hd), kspan.eq(0),
                             sc.eq(SB), vspan.eq(0)]
        else:
            with st.state("AT_H"):
                with m.If(h_end):
                    st.retire()
                with m.Else():
                    st.launch("AT_Q", bypass=1, n=hd, a=Src.L2, a_addr=self.q_at, sink=Sink.QUANT, qdst=QDst.GEMV)
                    m.d.sync += on_lo.eq(1)
        # the failures of the engine (its code holds until the next START) and of the quantiser passes, ended
        # from states of their own (the cycle after): the end and the return to IDLE see those states only
        with st.state("AT_ENGINE_ERROR"):
            st.fail(eng.code)
        with st.state("AT_NON_FINITE"):
            st.fail(ErrorCode.NON_FINITE)
        with st.state("AT_Q"):
            with m.If(st.done()):
                with m.If(self.i_done.payload.nonfinite):
                    m.next = "AT_NON_FINITE"
                if grouped:         # the group's next query into the engine's next vector
                    with m.Elif(q_more):
                        st.launch("AT_Q", bypass=1, n=hd, a=Src.L2, a_addr=qg, sink=Sink.QUANT, qdst=QDst.GEMV,
                                  qtok=qi + 1)
                        m.d.sync += [qi.eq(qi + 1), q_more.eq(qi + 2 != g_n), qg.eq(qg + hd),
                                     kspan.eq(kspan + stride), vspan.eq(vspan + hd)]
                with m.Else():
                    engine("AT_K1")
        after_engine("AT_K1", lambda: engine("AT_K2"))

        def scores():
            with m.If(wrap & ~kp):      # the second piece's K GEMVs (lo, then hi)
                m.d.sync += [kp.eq(1), on_lo.eq(1)]
                m.next = "AT_K0"
            with m.Else():
                m.d.sync += kp.eq(0)
                st.launch("AT_S1", op=SfuOp.MAX, n=n, a=Src.L2, a_addr=sc, sink=Sink.REG)
        after_engine("AT_K2", scores)
        with st.state("AT_K0"):
            engine("AT_K1")
        if grouped:         # the group's next head: its softmax (its scores are in the scratch already)
            with st.state("AT_S0"):
                st.launch("AT_S1", op=SfuOp.MAX, n=n, a=Src.L2, a_addr=sc, sink=Sink.REG)
        st.wait_pass("AT_S1", lambda: st.launch("AT_S2", op=SfuOp.EXP, n=n, a=Src.L2, a_addr=sc, emax=st.result,
                                                sub_emax=1, sink=Sink.L2, dst=sc))
        st.wait_pass("AT_S2", lambda: st.launch("AT_S3", op=SfuOp.SUM, n=n, a=Src.L2, a_addr=sc, sink=Sink.REG))

        def scale_by_v():
            m.d.sync += rz.eq(st.result)
            st.launch("AT_S5", op=SfuOp.MUL, n=n1, a=Src.DDR, ddr_addr=vsb0, ddr_fmt=1, b=BSrc.L2, b_addr=sc,
                      sink=Sink.L2, dst=sc)
        st.wait_pass("AT_S3", scale_by_v)

        def scale_piece():
            with m.If(wrap):
                st.launch("AT_S6", op=SfuOp.MUL, n=n2, a=Src.DDR, ddr_addr=vsb, ddr_fmt=1, b=BSrc.L2, b_addr=sc + n1,
                          sink=Sink.L2, dst=sc + n1)
            with m.Else():
                chunks()

        a = SimpleNamespace(
            hd=hd, n1=n1, n2=n2, wrap=wrap, n2_more=n2_more, vp=vp, vcol0=vcol0, vrow0=vrow0, vrow=vrow, s_at=s_at,
            chunk_n=chunk_n, left=left, first=first, none_left=none_left, more=more, take=take, on_v=on_v,
            on_lo=on_lo, sc=sc, engine=engine, after_engine=after_engine, MAXC=MAXC, h_end=h_end, last_h=last_h,
            grouped=grouped, SB=SB, A=A, s0=s0)
        if grouped:
            a.__dict__.update(qi=qi, stride=stride, heads_left=heads_left, g_n=g_n)
        chunks = (self._attn_v_rows if rows else self._attn_v_planes)(m, st, a)
        st.wait_pass("AT_S5", scale_piece)
        st.wait_pass("AT_S6", chunks)

    @staticmethod
    def _next_chunk(m, a, step):
        """After a V chunk (it took min(left, MAXC) positions): the next one `step` bytes on in its piece, or after
        the first piece's last chunk the second piece from its first slot (`vcol0`); then AT_V."""
        m.d.sync += [a.s_at.eq(a.s_at + a.chunk_n), a.first.eq(0)]
        with m.If(~a.more & a.wrap & ~a.vp):
            m.d.sync += [a.left.eq(a.n2), a.none_left.eq(0), a.more.eq(a.n2_more), a.vrow.eq(a.vcol0), a.vp.eq(1)]
        with m.Else():
            m.d.sync += [a.left.eq(Mux(a.more, a.left - a.MAXC, 0)), a.none_left.eq(~a.more),
                         a.more.eq(a.left > 2 * a.MAXC), a.vrow.eq(a.vrow + step)]
        m.next = "AT_V"

    def _attn_v_planes(self, m, st, a):
        """INT8 ATTN's V phase over the V planes, per head: per chunk the weights into the quantiser and two sparse
        GEMVs (lo, hi; accm after the first), RECIP(sum) beside the first chunk's; then times recip(sum). Returns
        the step that starts it (after the head's softmax)."""
        h, hd, MAXC, dst, rz, recip_pending = self.h, a.hd, a.MAXC, self.dst, self.rz, self.recip_pending
        s_at, chunk_n, left, first, none_left, more, take = (a.s_at, a.chunk_n, a.left, a.first, a.none_left,
                                                              a.more, a.take)
        n1, vp, vrow0, vrow = a.n1, a.vp, a.vrow0, a.vrow
        on_v, on_lo, sc, engine, after_engine, h_end, last_h = (a.on_v, a.on_lo, a.sc, a.engine, a.after_engine,
                                                                a.h_end, a.last_h)
        grouped = a.grouped
        if grouped:
            qi, stride, heads_left = a.qi, a.stride, a.heads_left

        def chunks():
            m.d.sync += [s_at.eq(sc), left.eq(n1), first.eq(1), none_left.eq(n1 == 0), more.eq(n1 > MAXC),
                         vrow.eq(vrow0), on_v.eq(1), vp.eq(0)]
            m.next = "AT_V"
        with st.state("AT_V"):
            with m.If(recip_pending):
                pass                         # the RECIP pass is still running
            with m.Elif(none_left):
                m.next = "AT_VO"
            with m.Else():
                m.d.sync += chunk_n.eq(take)
                st.launch("AT_VQ", bypass=1, n=take, a=Src.L2, a_addr=s_at, sink=Sink.QUANT, qdst=QDst.GEMV)
                m.d.sync += on_lo.eq(1)
        with st.state("AT_VO"):                 # a launch of its own: each state's launch selected by the state
            st.launch("AT_O", op=SfuOp.MULS, n=hd, a=Src.L2, a_addr=dst, s=rz, sink=Sink.L2, dst=dst)
        with st.state("AT_VQ"):
            with m.If(st.done()):
                with m.If(self.i_done.payload.nonfinite):
                    m.next = "AT_NON_FINITE"
                with m.Else():
                    with m.If(first):        # RECIP(sum), sent with the first chunk's V GEMV
                        st.launch("AT_V1", op=SfuOp.RECIP, n=1, a=Src.REG, a_val=rz, sink=Sink.REG)
                        m.d.sync += recip_pending.eq(1)
                    engine("AT_V1")
        after_engine("AT_V1", lambda: engine("AT_V2"))

        # every chunk but the last of a piece is MAXC positions of head_dim/2 bytes per plane column
        after_engine("AT_V2", lambda: self._next_chunk(m, a, hd << (ceil_log2(MAXC) - 1)))

        def next_head():
            m.d.sync += [h.eq(h + 1), h_end.eq(h == last_h), self.q_at.eq(self.q_at + hd), dst.eq(dst + hd),
                         on_v.eq(0)]
            if grouped:
                m.d.sync += heads_left.eq(heads_left - 1)
                with m.If(qi != 0):      # heads of the group left: the next one's scores
                    m.d.sync += [qi.eq(qi - 1), sc.eq(sc + stride)]
                    m.next = "AT_S0"
                with m.Else():
                    m.next = "AT_H"
            else:
                m.next = "AT_H"
        st.wait_pass("AT_O", next_head)
        return chunks

    def _attn_v_rows(self, m, st, a):
        """INT8 ATTN's V phase over the V rows (``kv_v_layout`` "rows", `sim.plan` ``_attn_v_rows``), per group of
        heads: each head's RECIP(sum) after its softmax, kept head by head (`recips`); then per chunk each head's
        weights into the quantiser (the engine's vector i for the group's head i) and one GEMV of INT8 weights
        over the chunk's V rows for the whole group (rows a ring's capacity apart, accm after the first chunk),
        its outputs a head_dim apart from the group's dst; then per head times its recip(sum). Returns the step
        that follows a head's softmax."""
        hw = self.hw
        h, hd, MAXC, dst, rz = self.h, a.hd, a.MAXC, self.dst, self.rz
        s_at, chunk_n, left, first, none_left, more, take = (a.s_at, a.chunk_n, a.left, a.first, a.none_left,
                                                              a.more, a.take)
        n1, vp, vrow = a.n1, a.vp, a.vrow
        on_v, sc, engine, after_engine, h_end, last_h = a.on_v, a.sc, a.engine, a.after_engine, a.h_end, a.last_h
        V, grouped = hw.gemv_vectors, a.grouped
        recips = Array(Signal(32, name=f"recip_{i}") for i in range(V))    # the group's recip(sum), head 0 first
        ri = Signal(range(V + 1), name="recips_kept")
        m.d.sync += ri.eq(Mux(self.i_start, 0, ri))     # (in IDLE; the states below set it otherwise)
        vr0 = Signal(a.A, name="v_rows_at")           # the first piece's first slot in each V row
        m.d.sync += vr0.eq(a.vcol0 + a.s0)
        if grouped:
            qi, stride, heads_left, g_n = a.qi, a.stride, a.heads_left, a.g_n
            vi = Signal(range(V), name="v_vector")    # the vector quantised last
            vq = Signal.like(self.q_at, name="v_weights_at")     # the next head's weights of the chunk
            vmore = Signal(name="v_vector_more")      # a head of the group follows the one quantised
            mleft = Signal(range(V), name="v_heads_left")        # heads of the group left to scale

        def chunks():
            m.d.sync += [s_at.eq(a.SB), left.eq(n1), first.eq(1), none_left.eq(n1 == 0), more.eq(n1 > MAXC),
                         vrow.eq(vr0), on_v.eq(1), vp.eq(0), ri.eq(0)]
            m.next = "AT_V"

        def kept():
            m.d.sync += [recips[ri].eq(st.result), ri.eq(ri + 1)]
            if grouped:             # the group's next head: its softmax; after the last, the V chunks
                with m.If(qi != 0):
                    m.d.sync += [qi.eq(qi - 1), sc.eq(sc + stride)]
                    m.next = "AT_S0"
                with m.Else():
                    chunks()
            else:
                chunks()
        st.wait_pass("AT_R", kept)

        def quantise(state, n, addr, **kw):
            st.launch(state, bypass=1, n=n, a=Src.L2, a_addr=addr, sink=Sink.QUANT, qdst=QDst.GEMV, **kw)
        with st.state("AT_V"):
            with m.If(none_left):
                if grouped:
                    m.d.sync += mleft.eq(g_n - 1)
                m.next = "AT_VO"
            with m.Else():
                m.d.sync += chunk_n.eq(take)
                if grouped:
                    m.d.sync += [vi.eq(0), vq.eq(s_at + stride), vmore.eq(g_n > 1)]
                quantise("AT_VQ", take, s_at)
        with st.state("AT_VQ"):
            with m.If(st.done()):
                with m.If(self.i_done.payload.nonfinite):
                    m.next = "AT_NON_FINITE"
                if grouped:         # the group's next head's weights into the engine's next vector
                    with m.Elif(vmore):
                        quantise("AT_VQ", chunk_n, vq, qtok=vi + 1)
                        m.d.sync += [vi.eq(vi + 1), vmore.eq(vi + 2 != g_n), vq.eq(vq + stride)]
                with m.Else():
                    engine("AT_V1")

        # a chunk of the V rows is its positions' bytes in each row: the next one MAXC bytes on
        after_engine("AT_V1", lambda: self._next_chunk(m, a, MAXC))
        with st.state("AT_VO"):
            st.launch("AT_O", op=SfuOp.MULS, n=hd, a=Src.L2, a_addr=dst, s=recips[0], sink=Sink.L2, dst=dst)

        def next_head():
            m.d.sync += [h.eq(h + 1), h_end.eq(h == last_h), self.q_at.eq(self.q_at + hd), dst.eq(dst + hd)]
            m.d.sync += [recips[i].eq(recips[i + 1]) for i in range(V - 1)]
            if grouped:
                m.d.sync += [heads_left.eq(heads_left - 1), mleft.eq(mleft - 1)]
                with m.If(mleft != 0):
                    m.next = "AT_VO"
                with m.Else():
                    m.d.sync += on_v.eq(0)
                    m.next = "AT_H"
            else:
                m.d.sync += on_v.eq(0)
                m.next = "AT_H"
        st.wait_pass("AT_O", next_head)
        return lambda: st.launch("AT_R", op=SfuOp.RECIP, n=1, a=Src.REG, a_val=rz, sink=Sink.REG)
