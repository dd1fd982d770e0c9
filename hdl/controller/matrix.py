"""The matrix sequencer: WGEMV, WGEMM and GATHER, after the controller has loaded their descriptor.

A WGEMV runs in two parts: the quantiser pass (unless ``reuse``: the engine still holds the same activations),
then the GEMV engine takes its command (`EngineTracker`) and streams the weights, writing its rows into L2
beside the passes. With ``async_`` (and without ``findemax``) it retires as soon as the engine has its
command; without, when the last row is in L2 (then, with ``findemax``, a REDUCE_MAX pass into EMAX).

WGEMM runs per token tile of ``systolic_rows`` tokens: a quantiser pass per token into the GEMM unit's slot
for it, then the tile takes the engine's place (its output rows are the running range); the last tile may
retire at once with ``async_``, the others are waited for. On an NPU whose GEMV engine takes V =
``gemv_vectors`` > 1 activation vectors (and has no GEMM unit) a tile is V tokens, each quantised into the
engine's memories of one vector, and runs as one GEMV command of that many vectors; the engine then holds no
reusable activations (ACT_N 0).

GATHER reads one INT4 row (TOKEN_ID's, or row 0 with ``remap`` past the table: the host staged it there)
through the DDR reader, dequantised, into L2.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal
from amaranth.lib import data, stream
from amaranth.lib.wiring import In, Out

from ..config import HardwareConfig
from ..isa import DdrRegion, DescKind, ErrorCode, Opcode, layout
from ..sfu import SfuOp
from .engines import gemm_job_layout, gemv_job_layout
from .passes import QDst, Sink, Src
from .sequencer import (EndSites, Sequencer, Steps, context_flags, elem, engine_state_layout, geometry, in_l2,
                        l2_elements, product, PRODUCT_LATENCY, recode)

__all__ = ["MatrixSequencer"]


class MatrixSequencer(Sequencer):
    """WGEMV, WGEMM, GATHER. Beyond `Sequencer`'s ports: the tracker's command streams (``o_gemv``,
    ``o_gemm``, ``o_act_n``) and state (``i_engine``), and EMAX's write (``o_emax``: a findemax result)."""

    def __init__(self, hw: HardwareConfig):
        super().__init__(hw, {
            "o_gemv": Out(stream.Signature(gemv_job_layout(hw))),
            "o_gemm": Out(stream.Signature(gemm_job_layout(hw))),
            "o_act_n": Out(stream.Signature(range(hw.gemv_max_cols + 1), always_ready=True)),
            "i_engine": In(engine_state_layout(hw)),
            "o_emax": Out(stream.Signature(32, always_ready=True)),
        })

    def elaborate(self, platform):
        m = Module()
        end = EndSites(m, self.o_end)
        st = Steps(m, self.o_pass, self.i_done, end, by_site=True, bus_error_state="BUS_ERROR")
        op = self.i_ctx.word[60:64]
        with m.FSM(name="matrix") as fsm:
            with m.State("IDLE"):
                with m.If(self.i_start):
                    with m.Switch(op):
                        with m.Case(Opcode.WGEMV):
                            m.next = "WG"
                        with m.Case(Opcode.WGEMM):
                            m.next = "WM"
                        with m.Case(Opcode.GATHER):
                            m.next = "GA"
            st.wait_pass("RETIRE_PASS", st.retire)
            st.bus_error()
            self._wgemv(m, st)
            self._wgemm(m, st)
            self._gather(m, st)
        recode(fsm, "one-hot")          # a state's test one flip-flop (the checks' choices are wide enough)
        st.finish()
        end.finish()
        return m

    def _weights(self, offset):
        ctx = self.i_ctx
        return (ctx.base[DdrRegion.WEIGHTS.value] + offset)[:self.hw.axi_addr_bits]

    def _wgemv(self, m, st):
        hw, ctx, eng = self.hw, self.i_ctx, self.i_engine
        d = ctx.desc
        wg = data.View(layout(Opcode.WGEMV), ctx.word)
        ws, wd = elem(wg.src), elem(wg.dst)

        # the engine command: one value, gated by its valid (its payload is 0 while not valid: `merge`)
        job = Signal.like(self.o_gemv.payload)
        m.d.comb += [job.cmd.wbase.eq(self._weights(d.weight_offset)), job.cmd.sbase.eq(self._weights(d.scale_offset)),
                     job.cmd.rows.eq(d.rows), job.cmd.cols.eq(d.cols), job.cmd.log2_group.eq(d.log2_group),
                     job.cmd.accm.eq(wg.accm), job.cmd.sparse.eq(wg.sparse),
                     *([job.cmd.mask.eq(wg.mask)] if hw.gemv_row_mask else []),
                     job.lo.eq(wd), job.n.eq(d.rows), job.pc.eq(ctx.pc),
                     self.o_gemv.payload.eq(Mux(self.o_gemv.valid, job, 0))]

        def run():
            """The engine has its activations (a quantiser pass, or `reuse`): hand it the matrix; an async WGEMV
            retires now, the others when the engine is done."""
            m.d.comb += self.o_gemv.valid.eq(1)
            with m.If(wg.async_ & ~wg.findemax):
                st.retire()
            with m.Else():
                m.next = "WG_G"

        def quantise():
            m.d.comb += [self.o_act_n.valid.eq(1), self.o_act_n.payload.eq(d.cols)]
            st.launch("WG_Q", bypass=1, n=d.cols, a=Src.L2, a_addr=ws, sink=Sink.QUANT, qdst=QDst.GEMV)

        # WGEMV `mask` (an engine with a row mask only; with reuse, on a dense matrix): src names the mask, d.rows
        # elements, which a MASK pass sends to the engine before its command
        mask = wg.mask if hw.gemv_row_mask else 0
        n_src = Mux(wg.mask, d.rows, d.cols)
        st.checks_early("WG", "wg_flags", [
            (d.kind != DescKind.INT4, lambda: st.fail(ErrorCode.BAD_DESCRIPTOR)),
            (wg.mask & (wg.sparse | ~wg.reuse) if hw.gemv_row_mask else wg.mask,
             lambda: st.fail(ErrorCode.BAD_FUNCTION)),
            (n_src == 0, lambda: st.fail(ErrorCode.BAD_LENGTH)),
            (~in_l2(hw, ws, n_src), lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
            (wg.sparse != (d.layout == 1), lambda: st.fail(ErrorCode.BAD_DESCRIPTOR)),
            ((d.cols > hw.gemv_max_cols) | (wg.sparse & ((d.rows > hw.gemv_sparse_max_rows) | d.rows[0])) |
             (wg.mask & (d.rows > hw.gemv_max_cols)), lambda: st.fail(ErrorCode.BAD_LENGTH)),
            (d.rows == 0, lambda: st.fail(ErrorCode.BAD_LENGTH)),
            (~in_l2(hw, wd, d.rows), lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
            (wg.reuse & (d.cols != eng.act_n), lambda: st.fail(ErrorCode.BAD_LENGTH)),
            (mask, lambda: st.launch("WG_M", bypass=1, n=d.rows, a=Src.L2, a_addr=ws, sink=Sink.MASK)),
            (wg.reuse, run),
        ], quantise)
        st.wait_pass("WG_M", run)
        with m.State("WG_Q"):
            with m.If(st.done()):
                with m.If(self.i_done.payload.nonfinite):
                    st.fail(ErrorCode.NON_FINITE)
                with m.Else():
                    run()
        with m.State("WG_G"):
            with m.If(~eng.active):
                st.checks([
                    (eng.failed, lambda: st.fail(eng.code)),
                    (wg.findemax, lambda: st.launch("WG_E", op=SfuOp.REDUCE_MAX, n=d.rows, a=Src.L2, a_addr=wd,
                                                    sink=Sink.REG)),
                ], st.retire)

        def emax():
            m.d.comb += [self.o_emax.valid.eq(1), self.o_emax.payload.eq(st.result)]
            st.retire()
        st.wait_pass("WG_E", emax)

    def _wgemm(self, m, st):
        hw, ctx, eng = self.hw, self.i_ctx, self.i_engine
        _, nb, _, _ = geometry(hw)
        d = ctx.desc
        wm = data.View(layout(Opcode.WGEMM), ctx.word)
        on_gemv = hw.gemv_vectors > 1                         # the GEMV engine runs it, V tokens a tile
        R = hw.gemm_tile
        L2E = l2_elements(hw)
        in_stride, out_stride = Signal(nb + 2), Signal(34)   # elements between tokens (16-byte rows)
        last_tok = Signal.like(wm.tokens)                     # the last token's index
        # the output span's stride, saturated at SAT > L2 (rows >= SAT fail the output range either way), so
        # that each span is one DSP48E2's product
        SAT = 1 << (len(in_stride) - 1)
        assert SAT > L2E
        span_stride = Signal.like(in_stride)
        left = Signal(9)                                      # tokens not yet in a tile
        tok = Signal(range(R + 1))                            # the token being quantised, in its tile
        tile = Signal(range(R + 1))                           # tokens in this tile
        src, dst = Signal(nb + 1), Signal(nb + 1)             # the next token's input and output row
        last_tile = Signal()                                  # this tile holds the last tokens (left <= R)
        more = Signal()                                       # a token of this tile follows the one quantised
        # the checks on the context registered a cycle ahead (`context_flags`): WM's, and WM_3's rows
        early = context_flags(m, "wm_flags", [
            (d.kind != DescKind.INT4) | (d.layout != 0) | (d.log2_group != (hw.weight_group.bit_length() - 1)),
            (wm.tokens == 0) | (d.cols > hw.gemv_max_cols) | (d.cols == 0), d.rows == 0])
        with m.State("WM"):
            with m.If(early[0]):
                st.fail(ErrorCode.BAD_DESCRIPTOR)
            with m.Elif(early[1]):
                st.fail(ErrorCode.BAD_LENGTH)
            with m.Else():
                m.d.sync += [in_stride.eq((d.cols + 3) & ~3), out_stride.eq((d.rows + 3) & ~3),
                             span_stride.eq(Mux(d.rows >= SAT, SAT, (d.rows + 3) & ~3)), last_tok.eq(wm.tokens - 1)]
                m.next = "WM_1"
        # the last token's input and output ends: the products (`product`, of the operands registered in WM:
        # from WM_1 on, four cycles), then the sums, a cycle
        in_span = product(m, last_tok, in_stride, len(last_tok) + len(in_stride), "in_span")
        out_span = product(m, last_tok, span_stride, len(last_tok) + len(span_stride), "out_span")
        in_end = Signal(max(len(in_span), len(d.cols)) + 2)     # 3 terms
        out_end = Signal(max(len(out_span), len(d.cols)) + 2)
        # whether they pass L2's end, registered every cycle (from WM_2's sums in WM_2B, for WM_3)
        in_over, out_over = Signal(), Signal()
        m.d.sync += [in_over.eq(in_end > L2E), out_over.eq(out_end > L2E)]
        st.pause("WM_1", PRODUCT_LATENCY, "WM_2")
        with m.State("WM_2"):
            m.d.sync += [in_end.eq(elem(wm.src) + in_span + d.cols), out_end.eq(elem(wm.dst) + out_span + d.rows)]
            m.next = "WM_2B"
        with m.State("WM_2B"):
            m.next = "WM_3"
        with m.State("WM_3"):
            with m.If(in_over):
                st.fail(ErrorCode.ADDRESS_RANGE)
            with m.Elif(early[2]):
                st.fail(ErrorCode.BAD_LENGTH)
            with m.Elif(out_over):
                st.fail(ErrorCode.ADDRESS_RANGE)
            with m.Else():
                m.d.sync += [src.eq(elem(wm.src)), dst.eq(elem(wm.dst)), left.eq(wm.tokens)]
                m.next = "WM_T"
        with m.State("WM_T"):                             # a tile starts
            m.d.sync += [tok.eq(0), tile.eq(Mux(left > R, R, left)), last_tile.eq(left <= R),
                         more.eq((left > 1) if R > 1 else 0)]
            m.next = "WM_Q"
        with m.State("WM_Q"):
            st.launch("WM_QW", bypass=1, n=d.cols, a=Src.L2, a_addr=src, sink=Sink.QUANT,
                      qdst=QDst.GEMV if on_gemv else QDst.GEMM, qtok=tok)
        with m.State("WM_QW"):
            with m.If(st.done()):
                with m.If(self.i_done.payload.nonfinite):
                    st.fail(ErrorCode.NON_FINITE)
                with m.Elif(more):
                    m.d.sync += [tok.eq(tok + 1), src.eq(src + in_stride), more.eq(tok + 2 != tile)]
                    m.next = "WM_Q"
                with m.Else():
                    if on_gemv:
                        # the tile's tokens as the vectors of one GEMV command; its rows go to L2 as the GEMM
                        # unit's would, and the engine holds no reusable activations after it. Every field is
                        # driven here: the WGEMV's driver above reads sparse and mask from the WGEMV format's
                        # bits, which are WGEMM `tokens` bits (its bit 3 would read as mask, its bit 5 as sparse)
                        job = self.o_gemv.payload
                        m.d.comb += [self.o_gemv.valid.eq(1), job.cmd.log2_group.eq(d.log2_group),
                                     job.cmd.vecs.eq(tile - 1), job.stride.eq(out_stride), job.cmd.sparse.eq(0),
                                     *([job.cmd.mask.eq(0)] if hw.gemv_row_mask else []),
                                     self.o_act_n.valid.eq(1), self.o_act_n.payload.eq(0)]
                    else:
                        job = self.o_gemm.payload
                        m.d.comb += [self.o_gemm.valid.eq(1), job.cmd.ntok.eq(tile), job.cmd.dst.eq(dst),
                                     job.cmd.stride.eq(out_stride)]
                    m.d.comb += [job.cmd.wbase.eq(self._weights(d.weight_offset)),
                                 job.cmd.sbase.eq(self._weights(d.scale_offset)),
                                 job.cmd.rows.eq(d.rows), job.cmd.cols.eq(d.cols), job.cmd.accm.eq(wm.accm),
                                 job.lo.eq(dst), job.n.eq((tile - 1) * out_stride + d.rows), job.pc.eq(ctx.pc)]
                    m.d.sync += [src.eq(src + in_stride), dst.eq(dst + out_stride * R), left.eq(left - tile)]
                    with m.If(last_tile & wm.async_):
                        st.retire()
                    with m.Else():
                        m.next = "WM_G"
        with m.State("WM_G"):                             # wait for the tile; then the next one, or retire
            with m.If(eng.idle):
                st.checks([(eng.failed, lambda: st.fail(eng.code)), (left == 0, st.retire)], st.go("WM_T"))

    def _gather(self, m, st):
        hw, ctx = self.hw, self.i_ctx
        d = ctx.desc
        ga = data.View(layout(Opcode.GATHER), ctx.word)
        gd = elem(ga.dst)
        row = Signal(32)
        row_bytes, row_scales = Signal(32), Signal(32)    # the row's offset in the weights, in the scales
        def start():
            m.d.sync += row.eq(Mux(ctx.token >= d.rows, 0, ctx.token))
            m.next = "GA_1"
        early = context_flags(m, "ga_flags", [
            (d.kind != DescKind.INT4) | (d.layout != 0), (ctx.token >= d.rows) & ~ga.remap, d.cols == 0,
            ~in_l2(hw, gd, d.cols)])
        # ceil(cols / 2**log2_group): one group from 2**32 columns on (cols < 2**32), so the shifts are 5 bits;
        # cols rounded up to the group, registered in GA (the shifter is a path of its own)
        g = d.log2_group[:5]
        cols_up = Signal(33, name="cols_up")
        with m.State("GA"):
            m.d.sync += cols_up.eq(d.cols + ((1 << g) - 1))
            st.checks([
                (early[0], lambda: st.fail(ErrorCode.BAD_DESCRIPTOR)),
                (early[1], lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
                (early[2], lambda: st.fail(ErrorCode.BAD_LENGTH)),
                (early[3], lambda: st.fail(ErrorCode.ADDRESS_RANGE)),
            ], start)
        # the products' other operands, registered a cycle ahead; cols fits L2 here, so they have its element
        # address's width
        ea = geometry(hw)[0]
        groups, half_cols = Signal(ea), Signal(ea)
        with m.State("GA_1"):
            m.d.sync += [groups.eq(Mux(d.log2_group >= 32, 1, cols_up >> g)), half_cols.eq((d.cols + 1) >> 1)]
            m.next = "GA_2"
        # the products by halves of the row (one DSP48E2 each, `product`: of the operands registered in GA_1,
        # from GA_2 on, four cycles), summed a cycle later
        parts = [product(m, r, op, len(groups) + 16, f"ga_{k}") for k, r, op in
                 (("b_lo", row[:16], half_cols), ("b_hi", row[16:], half_cols), ("s_lo", row[:16], groups),
                  ("s_hi", row[16:], groups))]
        st.pause("GA_2", PRODUCT_LATENCY, "GA_2S")
        with m.State("GA_2S"):
            m.d.sync += [row_bytes.eq(parts[0] + (parts[1] << 16)), row_scales.eq(parts[2] + (parts[3] << 16))]
            m.next = "GA_3"
        with m.State("GA_3"):
            st.launch("RETIRE_PASS", bypass=1, n=d.cols, a=Src.DDR, ddr_fmt=2,
                      ddr_addr=self._weights(d.weight_offset + row_bytes),
                      ddr_saddr=self._weights(d.scale_offset + (row_scales << 1)),
                      ddr_log2g=d.log2_group, sink=Sink.L2, dst=gd)
