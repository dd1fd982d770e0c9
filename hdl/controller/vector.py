"""The vector sequencer: VEC (element-wise, reductions, RMSNORM, ROPE), CVO and DMA.

Every composition is the one `sim.iss` runs (docs/numerics.md, the composition table):

- RMSNORM / RMSNORM_NG per HD segment: SUMSQ -> s; s * fp32(1/HD) and + S[s] in the scalar ALU; RSQRT;
  MULS into dst; (RMSNORM) MUL by the gain, in one MULS_MUL pass.
- ROPE per head: four MULs into the scratch, then SUB and ADD into dst.
- CVO SCALE with recip_scale and SOFTCAP first take RECIP(S0); REDUCE/ROPE functions with accm add the
  staged result to dst afterwards (the SFU's accm covers the element-wise functions).
- DMA: one pass between DDR and L2 (CONST or SCRATCH into L2; L2 into LOGITS or SCRATCH).
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal
from amaranth.lib import data, stream
from amaranth.lib.wiring import In, Out

from ..config import HardwareConfig
from ..isa import (SCALAR_REGS, VEC_REDUCTIONS, CvoFunc, DdrRegion, DmaDir, ErrorCode, Opcode, VecFunc, layout)
from ..sfu import SfuOp
from .alu import AluFn, alu_command, alu_result
from .passes import BSrc, Sink, Src
from .sequencer import DividerPort, Sequencer, Steps, context_flags, elem, end_to, geometry, in_l2, recode

__all__ = ["VectorSequencer", "sreg_write_layout"]

TWO_OPERAND = (VecFunc.ADD, VecFunc.SUB, VecFunc.MUL, VecFunc.FMAS, VecFunc.GELU_MUL, VecFunc.DOT)
SEGMENTED = (VecFunc.RMSNORM, VecFunc.RMSNORM_NG, VecFunc.ROPE)


def sreg_write_layout() -> data.StructLayout:
    return data.StructLayout({"idx": range(SCALAR_REGS), "value": 32})


def _any(x, values):
    return Cat(*[x == v for v in values]).any()


class VectorSequencer(Sequencer):
    """VEC, CVO, DMA. Beyond `Sequencer`'s ports: the scalar ALU (``o_alu``, ``i_alu``), the divider
    (``div``) and a scalar-register write (``o_sreg``: a reduction's result)."""

    def __init__(self, hw: HardwareConfig):
        super().__init__(hw, {
            "o_alu": Out(alu_command()), "i_alu": In(alu_result()),
            "div": Out(DividerPort),
            "o_sreg": Out(stream.Signature(sreg_write_layout(), always_ready=True)),
        })

    def elaborate(self, platform):
        m = Module()
        st = Steps(m, self.o_pass, self.i_done, end_to(m, self.o_end), by_site=True, one_hot=True)
        op = self.i_ctx.word[60:64]
        self._vec_op = vec_op = Signal(SfuOp)        # the SFU function of an element-wise VEC or a reduction
        with m.Switch(data.View(layout(Opcode.VEC), self.i_ctx.word).func):
            for f in VecFunc:
                if f not in SEGMENTED:
                    with m.Case(f):
                        m.d.comb += vec_op.eq(SfuOp[f.name])
        with m.FSM(name="vector") as fsm:
            with m.State("IDLE"):
                with m.If(self.i_start):
                    with m.Switch(op):
                        for o in (Opcode.VEC, Opcode.CVO, Opcode.DMA):
                            with m.Case(o):
                                m.next = o.name
            st.wait_pass("RETIRE_PASS", st.retire)
            self._vec(m, st)
            self._cvo(m, st)
            self._dma(m, st)
        st.finish()
        recode(fsm)
        return m

    def alu(self, m, a, b, fn, nxt):
        m.d.comb += [self.o_alu.valid.eq(1), self.o_alu.payload.a.eq(a), self.o_alu.payload.b.eq(b),
                     self.o_alu.payload.fn.eq(fn)]
        m.next = nxt

    def _vec(self, m, st):
        hw, ctx = self.hw, self.i_ctx
        _, _, SB, SCR = geometry(hw)
        ve = data.View(layout(Opcode.VEC), ctx.word)
        va, vb, vd = elem(ve.a), elem(ve.b), elem(ve.dst)
        vl, hd = ctx.vl, ctx.hd
        two_operand = _any(ve.func, TWO_OPERAND)
        vec_op = self._vec_op
        # the checks on the context, the first that holds registered a cycle ahead (`context_flags`): VEC is
        # the first state
        early = context_flags(m, "vec_flags", [
            vl == 0, ~in_l2(hw, va, vl), two_operand & ~in_l2(hw, vb, vl), _any(ve.func, SEGMENTED),
            _any(ve.func, VEC_REDUCTIONS), ~in_l2(hw, vd, vl)], first=True)
        with m.State("VEC"):
            st.choose(early, [
                lambda: st.fail(ErrorCode.BAD_LENGTH),
                lambda: st.fail(ErrorCode.ADDRESS_RANGE),
                lambda: st.fail(ErrorCode.ADDRESS_RANGE),
                lambda: self._divide(m, vl, hd, "VSEG_DIV"),
                lambda: st.launch(
                    "VEC_SCALAR", op=vec_op, n=vl, a=Src.L2, a_addr=va, b=Mux(two_operand, BSrc.L2, BSrc.NONE),
                    b_addr=vb, s=ctx.s[ve.s], sink=Sink.REG),
                lambda: st.fail(ErrorCode.ADDRESS_RANGE),
                lambda: st.launch("RETIRE_PASS", op=vec_op, n=vl, a=Src.L2, a_addr=va,
                                 b=Mux(two_operand, BSrc.L2, BSrc.NONE), b_addr=vb, s=ctx.s[ve.s], sink=Sink.L2,
                                 dst=vd)])

        def write_sreg():
            m.d.comb += [self.o_sreg.valid.eq(1), self.o_sreg.payload.idx.eq(ve.s),
                         self.o_sreg.payload.value.eq(st.result)]
            st.retire()
        st.wait_pass("VEC_SCALAR", write_sreg)

        # the segments: `left` of them, `src` and `dst` the current one's first element
        ea, _, _, _ = geometry(hw)
        left = Signal(32)
        src, dst = Signal(ea + 1), Signal(ea + 1)
        half = hd[1:]
        # ROPE's operand addresses, registered at the start (and stepped with src and dst): the second halves
        # of x and of the output, sin's table
        src2, dst2, sin_ = Signal(ea + 1, name="src2"), Signal(ea + 1, name="dst2"), Signal(ea + 1, name="sin")
        done_all = Signal()                   # left == 0, registered with left
        # the scratch rows t0 .. t3, from HD alone: k · half registered every cycle, then SB + that (the
        # instruction's from its third cycle on; ROPE reads them from ROPE_1 on)
        t, t_off = ([Signal(ea + 1, name=f"{nm}{k}") for k in range(4)] for nm in ("t", "t_off"))
        m.d.sync += [t_off[1].eq(half), t_off[2].eq(half << 1), t_off[3].eq(half + (half << 1))]   # adds, no DSP
        m.d.sync += [t[k].eq(SB + t_off[k]) for k in range(4)]
        seg = context_flags(m, "seg_flags", [
            hd == 0, (ve.func == VecFunc.ROPE) & (hd[0] | ((hd << 1) > SCR)),
            (ve.func != VecFunc.RMSNORM_NG) & ~in_l2(hw, vb, hd), ~in_l2(hw, vd, vl)])
        rem_nz = Signal()                     # vl mod hd != 0, registered when the divider is done
        with m.State("VSEG_DIV"):
            with m.If(~self.div.busy):
                m.d.sync += rem_nz.eq(self.div.r != 0)
                m.next = "VSEG_CHK"
        with m.State("VSEG_CHK"):
            def start():
                m.d.sync += [left.eq(self.div.q), done_all.eq(self.div.q == 0), src.eq(va), dst.eq(vd),
                             src2.eq(va + half), dst2.eq(vd + half), sin_.eq(vb + half)]
                with m.If(ve.func == VecFunc.ROPE):
                    m.next = "ROPE_0"
                with m.Else():
                    m.next = "RMS_0"
            st.checks([
                (seg[0] | rem_nz, lambda: st.fail(ErrorCode.BAD_LENGTH)),
                (seg[1], lambda: st.fail(ErrorCode.BAD_LENGTH)),
                (seg[2], lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
                (seg[3], lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
            ], start)

        def next_segment(state):
            m.d.sync += [left.eq(left - 1), done_all.eq(left == 1), src.eq(src + hd), dst.eq(dst + hd),
                         src2.eq(src2 + hd), dst2.eq(dst2 + hd)]
            m.next = state

        # RMSNORM per segment
        with m.State("RMS_0"):
            with m.If(done_all):
                st.retire()
            with m.Else():
                st.launch("RMS_1", op=SfuOp.SUMSQ, n=hd, a=Src.L2, a_addr=src, sink=Sink.REG)
        st.wait_pass("RMS_1", lambda: self.alu(m, st.result, ctx.inv_hd, AluFn.MUL, "RMS_2"))
        with m.State("RMS_2"):
            with m.If(self.i_alu.valid):
                self.alu(m, self.i_alu.payload, ctx.s[ve.s], AluFn.ADD, "RMS_3")
        with m.State("RMS_3"):
            with m.If(self.i_alu.valid):
                st.launch("RMS_4", op=SfuOp.RSQRT, n=1, a=Src.REG, a_val=self.i_alu.payload, sink=Sink.REG)
        # x * rsqrt, and with the gain (x * rsqrt) * g: one pass on the SFU's short path
        gained = ve.func == VecFunc.RMSNORM
        st.wait_pass("RMS_4", lambda: st.launch("RMS_5", op=Mux(gained, SfuOp.MULS_MUL, SfuOp.MULS), n=hd, a=Src.L2,
                                                a_addr=src, b=Mux(gained, BSrc.L2, BSrc.NONE), b_addr=vb,
                                                s=st.result, sink=Sink.L2, dst=dst))
        st.wait_pass("RMS_5", lambda: next_segment("RMS_0"))

        # ROPE per head: t0 = x1*cos, t1 = x2*sin, t2 = x2*cos, t3 = x1*sin; d1 = t0 - t1; d2 = t2 + t3
        x1, x2, cos_ = src, src2, vb
        steps = [(SfuOp.MUL, x1, cos_, t[0]), (SfuOp.MUL, x2, sin_, t[1]), (SfuOp.MUL, x2, cos_, t[2]),
                 (SfuOp.MUL, x1, sin_, t[3]), (SfuOp.SUB, t[0], t[1], dst), (SfuOp.ADD, t[2], t[3], dst2)]

        def rope_step(i):
            o, a_, b_, d_ = steps[i]
            st.launch(f"ROPE_{i + 1}", op=o, n=half, a=Src.L2, a_addr=a_, b=BSrc.L2, b_addr=b_, sink=Sink.L2, dst=d_)
        with m.State("ROPE_0"):
            with m.If(done_all):
                st.retire()
            with m.Else():
                rope_step(0)
        for i in range(len(steps)):
            st.wait_pass(f"ROPE_{i + 1}", (lambda i=i: rope_step(i + 1)) if i + 1 < len(steps)
                         else (lambda: next_segment("ROPE_0")))

    def _divide(self, m, num, den, nxt):
        m.d.comb += [self.div.start.eq(1), self.div.num.eq(num), self.div.den.eq(den)]
        m.next = nxt

    def _cvo(self, m, st):
        hw, ctx = self.hw, self.i_ctx
        _, _, SB, SCR = geometry(hw)
        cv = data.View(layout(Opcode.CVO), ctx.word)
        cs, cd = elem(cv.src), elem(cv.dst)
        rope_f = (cv.func == CvoFunc.ROPE_COS) | (cv.func == CvoFunc.ROPE_SIN)
        red_f = (cv.func == CvoFunc.REDUCE_SUM) | (cv.func == CvoFunc.REDUCE_MAX)
        staged = cv.accm & (rope_f | red_f)      # the result goes to the scratch, then is added to dst
        n = cv.length
        need_recip = (cv.func == CvoFunc.SOFTCAP) | ((cv.func == CvoFunc.SCALE) & cv.recip_scale)
        recip = Signal(32)                       # RECIP(S0)
        early = context_flags(m, "cvo_flags", [
            (staged & (n > SCR)) | (n == 0),
            Mux(rope_f, ~in_l2(hw, cs, n << 1), ~in_l2(hw, cs, n)) | Mux(red_f, ~in_l2(hw, cd, 1), ~in_l2(hw, cd, n)),
            need_recip], first=True)
        with m.State("CVO"):
            st.choose(early, [
                lambda: st.fail(ErrorCode.BAD_LENGTH),
                lambda: st.fail(ErrorCode.ADDRESS_RANGE),
                lambda: st.launch("CVO_R", op=SfuOp.RECIP, n=1, a=Src.REG, a_val=ctx.s[0], sink=Sink.REG),
                st.go("CVO_MAIN")])

        def got_recip():
            m.d.sync += recip.eq(st.result)
            m.next = "CVO_MAIN"
        st.wait_pass("CVO_R", got_recip)
        with m.State("CVO_MAIN"):
            elementwise_accm = cv.accm & ~staged
            st.launch("CVO_ACC", op=cv.func.as_value(), n=n, a=Mux(rope_f, Src.PAIRS, Src.L2), a_addr=cs,
                      b=Mux(elementwise_accm, BSrc.L2, BSrc.NONE), b_addr=cd, s=ctx.s[0], s_inv=recip,
                      emax=ctx.emax, sub_emax=cv.sub_emax, recip_scale=cv.recip_scale, accm=elementwise_accm,
                      sink=Sink.L2, dst=Mux(staged, SB, cd))

        def after():
            with m.If(staged):
                st.launch("RETIRE_PASS", op=SfuOp.ADD, n=Mux(red_f, 1, n), a=Src.L2, a_addr=cd, b=BSrc.L2,
                          b_addr=SB, sink=Sink.L2, dst=cd)
            with m.Else():
                st.retire()
        st.wait_pass("CVO_ACC", after)

    def _dma(self, m, st):
        hw, ctx = self.hw, self.i_ctx
        dm = data.View(layout(Opcode.DMA), ctx.word)
        l2e = elem(dm.l2)
        ddr = (ctx.base[dm.region.as_value()] + (dm.offset << 4))[:hw.axi_addr_bits]
        region = dm.region
        early = context_flags(m, "dma_flags", [
            dm.dir == DmaDir.L2_TO_L2, ctx.vl == 0, ~in_l2(hw, l2e, ctx.vl),
            (dm.dir == DmaDir.DDR_TO_L2) & (region != DdrRegion.CONST) & (region != DdrRegion.SCRATCH),
            dm.dir == DmaDir.DDR_TO_L2, (region != DdrRegion.LOGITS) & (region != DdrRegion.SCRATCH)], first=True)
        with m.State("DMA"):
            st.choose(early, [
                lambda: st.fail(ErrorCode.BAD_FUNCTION),
                lambda: st.fail(ErrorCode.BAD_LENGTH),
                lambda: st.fail(ErrorCode.ADDRESS_RANGE),
                lambda: st.fail(ErrorCode.BAD_FUNCTION),
                lambda: st.launch(
                    "RETIRE_PASS", bypass=1, n=ctx.vl, a=Src.DDR, ddr_addr=ddr, ddr_fmt=0, sink=Sink.L2, dst=l2e),
                lambda: st.fail(ErrorCode.BAD_FUNCTION),
                lambda: st.launch("RETIRE_PASS", bypass=1, n=ctx.vl, a=Src.L2, a_addr=l2e, sink=Sink.DDR,
                                  ddr_addr=ddr, wr_fmt=0)])
