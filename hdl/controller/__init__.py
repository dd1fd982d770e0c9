"""The NPU core: the controller and the datapath it drives (docs/architecture.md, "Controller").

The controller takes decoded instruction words from the fetch unit and executes each instruction as a
short sequence of **passes** (`hdl.controller.passes`: one source through the SFU or around it into one sink)
and matrix commands. Its parts talk through streams:

=======================  ===============================================================================
`Controller` (here)      fetch, dispatch, CTRL, MEMSET, SCALAR, the descriptor load, errors and HALT
`PassEngine`             sources, operand stage, SFU or bypass, sinks, completion of one pass at a time
`EngineTracker`          the GEMV engine and the GEMM unit beside the passes: the running range, hazards
`ScalarAlu`              binary32 add, multiply, int->float
`VectorSequencer`        VEC (element-wise, reductions, RMSNORM, ROPE), CVO, DMA
`AttentionSequencer`     KVST, ATTN (binary16 or INT8 cache)
`MatrixSequencer`        WGEMV, WGEMM, GATHER
=======================  ===============================================================================

The pass decomposition of every instruction is `sim.plan`'s; every composition is the one `sim.iss` runs
(docs/numerics.md, the composition table), so the results are bit-identical to the ISS's hardware
arithmetic.

Instructions issue in order; only one sequencer runs at a time, so their streams into the shared units are
merged without arbitration. A WGEMV's matrix runs beside later instructions (``async_``); a pass whose L2
ranges meet the rows still to be written waits for them (`PassEngine`), the next WGEMV waits for the engine,
FENCE, HALT, SETTOK and SETPOS wait for it. The results are therefore those of sequential execution (the ISS)
for any program. An async WGEMV that fails (a bus error on its weights) is reported at the next instruction
boundary, FENCE, HALT, SETTOK or SETPOS, with ERROR_PC = the WGEMV's index; instructions issued after it may
have run.

TOKEN and POS are registers of the controller: START loads them from ``i_token`` and ``i_pos`` (the TOKEN_ID
and POSITION CSRs) and SETTOK and SETPOS write them once a running async WGEMV or WGEMM has finished (every
other instruction has completed when it retires; the matrix reads neither). GATHER's row, the SFU's RoPE phase,
KVST's and ATTN's positions and LDPOS read them.
"""

from __future__ import annotations

from amaranth import Array, Cat, Module, Mux, Signal, Value
from amaranth.lib import data, memory, stream, wiring
from amaranth.lib.wiring import In, Out, connect

from ..config import HardwareConfig
from ..fetch import PC_BITS, insn_layout
from ..isa import (DESC_BYTES, DESC_WORDS, FMAP_ENTRY, SCALAR_REGS, SHAPE_SLOTS, CtrlFunc, DdrRegion, ErrorCode,
                   Opcode, ScalarFunc, ShapeCache, layout)
from ..l2 import L2
from ..quant import KvPacker
from ..seq import IntRecip, SeqDivider
from ..sfu import SfuOp, _is_nan
from .alu import AluFn, ScalarAlu, alu_command
from .attention import AttentionSequencer
from .engines import EngineTracker, gemm_job_layout, gemv_job_layout
from .matrix import MatrixSequencer
from .passes import BSrc, PassEngine, QDst, Sink, Src, pass_layout
from .sequencer import REGIONS, Steps, context_layout, recode
from .vector import VectorSequencer

__all__ = ["Controller", "trace_layout", "Src", "BSrc", "Sink", "REGIONS", "PassEngine", "EngineTracker", "ScalarAlu",
           "VectorSequencer", "AttentionSequencer", "MatrixSequencer"]


def trace_layout(hw: HardwareConfig) -> data.StructLayout:
    """One cycle of `Controller.o_trace`: the pass the pass engine takes, the matrix the tracker takes, an ALU
    operation, an instruction retiring (in that cycle's order: a matrix and a pass taken in the same cycle
    started in that order, `sim.plan`)."""
    return data.StructLayout({"pass_valid": 1, "pass_": pass_layout(hw), "gemv_valid": 1, "gemv": gemv_job_layout(hw),
                              "gemm_valid": 1, "gemm": gemm_job_layout(hw), "alu_valid": 1, "retire": 1})


def _f32_gt_registered(m, a, b, name):
    """a > b for binary32 (False if either is NaN; ±0 equal: Python's ``max(b, a)`` picks a exactly then), with
    its compares registered every cycle (the NaN tests, the magnitude compares both ways, the signs): the value
    returned combines them, one LUT behind the registers. Read it a cycle after `a` and `b`."""
    ma, mb = a[:31], b[:31]
    parts = Signal(data.StructLayout({"nan": 1, "sa": 1, "sb": 1, "ab": 1, "ba": 1, "nz": 1}), name=name)
    m.d.sync += [parts.nan.eq(_is_nan(a) | _is_nan(b)), parts.sa.eq(a[31]), parts.sb.eq(b[31]),
                 parts.ab.eq(ma > mb), parts.ba.eq(mb > ma), parts.nz.eq((ma | mb).any())]
    # `hdl.sfu._gt` on the registered parts
    return ~parts.nan & Mux(parts.sa == parts.sb, Mux(parts.sa, parts.ba, parts.ab), ~parts.sa & parts.nz)


def _early(m, cond, name):
    """`cond`, a condition on the instruction word (and the settings), registered every cycle: the word is the
    instruction's from DISPATCH on, so the flag is from the state after DISPATCH on (MEMSET, SCALAR, DESC)."""
    flag = Signal(name=name)
    m.d.sync += flag.eq(cond)
    return flag


def merge(m, out, ins):
    """Drive stream `out` from the streams `ins`, at most one of which is valid in a cycle and each of which
    drives its payload to 0 while it is not valid (every command here is a ``comb`` payload assigned only
    where its valid is; `tests/test_controller.py` checks it): the payload is the OR of theirs, one LUT per bit
    where a chain of selects by valid would take two."""
    m.d.comb += out.valid.eq(Cat(*[s.valid for s in ins]).any())
    payload = Value.cast(ins[0].payload)
    for s in ins[1:]:
        payload = payload | Value.cast(s.payload)
    m.d.comb += Value.cast(out.payload).eq(payload)
    if not out.signature.always_ready:
        m.d.comb += [s.ready.eq(out.ready) for s in ins]


def broadcast(m, src, dsts):
    """Copy stream `src` (always ready) to every stream of `dsts`."""
    for d in dsts:
        m.d.comb += [d.valid.eq(src.valid), Value.cast(d.payload).eq(Value.cast(src.payload))]


class Controller(wiring.Component):
    """Controller + datapath of the NPU (everything but the CSRs, the fetch and the AXI port arbitration).

    Members
    -------
    i_insn : In(stream(insn_layout))     decoded words come in raw; the controller decodes them
    i_start : In(1)                      pulse: a program starts (the fetch is started by the top)
    i_ack : In(1)                        pulse: clear o_done and o_error (IRQ_ACK)
    i_prog_len : In(PC_BITS)             program length in words: running past it is BAD_LENGTH (no HALT)
    i_token, i_pos, i_desc_count : In(32)   TOKEN and POS as a program starts (CTRL SETTOK / SETPOS change them)
    i_base_<region> : In(64)             DDR byte address of every region
    o_stop : Out(1)                      pulse: the program ended (HALT or error): stop the fetch
    o_busy, o_done, o_error : Out(1)     o_done / o_error stay until the next start
    o_error_code : Out(ErrorCode); o_error_pc : Out(PC_BITS)
    o_retire : Out(1)                    pulse per executed instruction
    o_trace : Out(trace_layout)          what the controller starts, cycle by cycle (a trace for benches: the
                                         pass monitor of `tb.npu`; nothing in the NPU reads it)
    o_unit_busy : Out(StructLayout)      gemv, gemm, sfu, attn, dma, issue_wait: per-cycle activity for counters
    m_gemv<p> : Out(AxiReadSignature)    the weight readers: the GEMV engine's, or the GEMM unit's on the
                                         first ``wgt_ports + 1`` while a WGEMM tile runs
    m_rd : Out(AxiReadSignature)         the DdrReader (descriptors, DMA, GATHER, K/V rows)
    m_wr : Out(AxiWriteSignature)        the DdrWriter (DMA to DDR, KVST)
    """

    def __init__(self, hw: HardwareConfig):
        from ..axi import AxiReadSignature, AxiWriteSignature
        self._hw = hw
        members = {
            "i_insn": In(stream.Signature(insn_layout())),
            "i_start": In(1), "i_ack": In(1), "i_prog_len": In(PC_BITS),
            "i_token": In(32), "i_pos": In(32), "i_desc_count": In(32),
            "o_stop": Out(1), "o_busy": Out(1), "o_done": Out(1), "o_error": Out(1),
            "o_error_code": Out(ErrorCode), "o_error_pc": Out(PC_BITS), "o_retire": Out(1),
            "o_trace": Out(trace_layout(hw)),
            "o_unit_busy": Out(data.StructLayout({"gemv": 1, "gemm": 1, "sfu": 1, "attn": 1, "dma": 1,
                                                  "issue_wait": 1})),
            "m_rd": Out(AxiReadSignature.from_config(hw)),
            "m_wr": Out(AxiWriteSignature.from_config(hw)),
        }
        for r in REGIONS:
            members[f"i_base_{r.name.lower()}"] = In(64)
        for p in range(hw.axi_ports):
            members[f"m_gemv{p}"] = Out(AxiReadSignature.from_config(hw))
        super().__init__(members)

    @property
    def hw(self):
        return self._hw

    def elaborate(self, platform):
        m = Module()
        self._units(m)
        self._context(m)
        self._wire(m)
        self._fsm(m)
        u = self._u
        m.d.comb += [
            self.o_unit_busy.gemv.eq(u.tracker.o_gemv_busy),
            self.o_unit_busy.gemm.eq(u.tracker.o_gemm_busy),
            self.o_unit_busy.sfu.eq(u.engine.o_sfu),
            self.o_unit_busy.dma.eq(u.engine.o_dma),
            self.o_unit_busy.attn.eq(self.o_busy & (self._word[60:64] == Opcode.ATTN)),
        ]
        return m

    def _units(self, m):
        hw = self._hw

        class Units:
            pass
        u = self._u = Units()
        # read ports 0/1 and write port 0 for the passes, read port 2 (accm) and write port 1 (the rows) for the
        # matrix beside them; word-interleaved banks give a wide pass's two operand streams a word per cycle each
        m.submodules.l2 = u.l2 = L2(hw, read_ports=3, write_ports=2, banks=hw.l2_banks)
        m.submodules.engine = u.engine = PassEngine(hw)
        m.submodules.tracker = u.tracker = EngineTracker(hw)
        m.submodules.alu = u.alu = ScalarAlu()
        m.submodules.div = u.div = SeqDivider()
        m.submodules.irecip = u.irecip = IntRecip()
        m.submodules.vector = u.vector = VectorSequencer(hw)
        m.submodules.attention = u.attention = AttentionSequencer(hw)
        m.submodules.matrix = u.matrix = MatrixSequencer(hw)
        u.packer = None
        if hw.kv_format == "int8":
            m.submodules.packer = u.packer = KvPacker(hw, hw.kv_max_head_dim)
        m.submodules.fmap = u.fmap = memory.Memory(shape=FMAP_ENTRY, depth=SHAPE_SLOTS, init=[])
        u.seqs = (u.vector, u.attention, u.matrix)

    def _context(self, m):
        """The architectural state, and the context every sequencer reads."""
        hw, u = self._hw, self._u
        # TOKEN and POS: loaded at START (`_fsm`), written by SETTOK and SETPOS (`_ctrl`)
        self._token, self._pos = Signal(32, name="token"), Signal(32, name="pos")
        self._sregs = Array([Signal(32, name=f"s{i}") for i in range(SCALAR_REGS)])
        # the scalar registers' one write port: whoever writes drives it (comb) in that cycle, and the register
        # written the cycle after (`held`). Every write ends its instruction (a retire), and the next instruction
        # reads the registers from its DISPATCH on, two cycles later at the earliest (FETCH between).
        self._sreg_w = w = Signal(data.StructLayout({"en": 1, "idx": range(SCALAR_REGS), "value": 32}))
        held = Signal.like(w, name="sreg_write")
        m.d.sync += held.eq(w)
        for i, r in enumerate(self._sregs):
            with m.If(held.en & (held.idx == i)):
                m.d.sync += r.eq(held.value)
        self._vl, self._hd, self._inv_hd, self._emax = (Signal(32, name=n) for n in ("vl", "hd", "inv_hd", "emax"))
        self._word, self._pc = Signal(64), Signal(PC_BITS)
        self._fmap_w = u.fmap.write_port()
        fmap_r = u.fmap.read_port(domain="comb")
        m.d.comb += fmap_r.addr.eq(data.View(layout(Opcode.ATTN), self._word).shape_ptr)
        ctx = self._ctx = Signal(context_layout(hw))
        m.d.comb += [ctx.word.eq(self._word), ctx.pc.eq(self._pc), ctx.vl.eq(self._vl), ctx.hd.eq(self._hd),
                     ctx.inv_hd.eq(self._inv_hd), ctx.pos.eq(self._pos), ctx.token.eq(self._token),
                     ctx.emax.eq(self._emax), Value.cast(ctx.desc).eq(u.engine.o_desc.as_value()),
                     Value.cast(ctx.fmap).eq(Value.cast(fmap_r.data))]
        m.d.comb += [ctx.s[i].eq(self._sregs[i]) for i in range(SCALAR_REGS)]
        for r in REGIONS:
            m.d.comb += ctx.base[r.value].eq(getattr(self, f"i_base_{r.name.lower()}"))
        for s in u.seqs:
            m.d.comb += s.i_ctx.eq(ctx)

    def _wire(self, m):
        """The streams between the parts; the sequencers' (and the controller's) commands merged."""
        hw, u = self._hw, self._u
        eng, tr = u.engine, u.tracker
        l2 = u.l2
        for port, i in ((eng.l2_a, 0), (eng.l2_b, 1), (tr.l2_r, 2)):
            connect(m, port.req, getattr(l2, f"rd{i}_req"))
            connect(m, getattr(l2, f"rd{i}_resp"), port.resp)
        connect(m, eng.l2_w, l2.wr0)
        connect(m, tr.l2_w, l2.wr1)
        connect(m, eng.m_rd, wiring.flipped(self.m_rd))
        connect(m, eng.m_wr, wiring.flipped(self.m_wr))
        for p in range(hw.axi_ports):
            connect(m, getattr(tr, f"m_gemv{p}"), wiring.flipped(getattr(self, f"m_gemv{p}")))
        m.d.comb += [eng.i_hold.eq(tr.o_hold), eng.i_pos.eq(self._pos)]

        # the quantiser's words go where the running pass says
        qdst = eng.o_qdst
        routes = [(tr.i_gemv_act, tr.i_gemv_exp, QDst.GEMV)]
        if hw.gemv_vectors == 1:
            routes.append((tr.i_gemm_act, tr.i_gemm_exp, QDst.GEMM))
        if u.packer is not None:
            routes.append((u.packer.i_act, u.packer.i_exp, QDst.PACK))
        for src, k in ((eng.o_act, 0), (eng.o_exp, 1)):
            ready = 0
            for route in routes:
                dst, sel = route[k], qdst == route[2]
                m.d.comb += [dst.valid.eq(src.valid & sel), dst.p.eq(src.p)]
                ready = Mux(sel, dst.ready, ready)
            m.d.comb += src.ready.eq(ready if u.packer is not None else Mux(qdst == QDst.PACK, 1, ready))
        if hw.gemv_vectors == 1:
            m.d.comb += tr.i_gemm_tok.eq(eng.o_qtok)
        else:                                           # the GEMV engine's vector (a WGEMM tile's token)
            m.d.comb += [tr.i_gemv_act.p.vec.eq(eng.o_qtok), tr.i_gemv_exp.p.vec.eq(eng.o_qtok)]
        if hw.gemv_row_mask:
            connect(m, eng.o_mask, tr.i_gemv_mask)
        else:
            m.d.comb += eng.o_mask.ready.eq(1)          # no MASK pass runs (the WGEMV stops with BAD_FUNCTION)
        if u.packer is not None:
            connect(m, eng.o_pack, u.packer.i_cmd)
            connect(m, u.packer.o_elem, eng.i_pack)
            m.d.comb += [u.packer.i_clear.eq(u.attention.o_pack_clear),
                         u.attention.i_pack.emax.eq(u.packer.o_emax), u.attention.i_pack.vscale.eq(u.packer.o_vscale)]

        # commands into the shared units, from whoever runs
        self._pass = stream.Signature(pass_layout(hw)).create()
        self._alu_cmd = alu_command().create()
        merge(m, eng.i_cmd, [self._pass] + [s.o_pass for s in u.seqs])
        merge(m, u.alu.i_cmd, [self._alu_cmd, u.vector.o_alu])
        merge(m, tr.i_gemv, [u.matrix.o_gemv, u.attention.o_gemv])
        merge(m, tr.i_gemm, [u.matrix.o_gemm])
        merge(m, tr.i_act_n, [u.matrix.o_act_n, u.attention.o_act_n])
        t = self.o_trace
        m.d.comb += [t.pass_valid.eq(eng.i_cmd.valid & eng.i_cmd.ready), t.pass_.eq(eng.i_cmd.payload),
                     t.gemv_valid.eq(tr.i_gemv.valid & tr.i_gemv.ready), t.gemv.eq(tr.i_gemv.payload),
                     t.gemm_valid.eq(tr.i_gemm.valid & tr.i_gemm.ready), t.gemm.eq(tr.i_gemm.payload),
                     t.alu_valid.eq(u.alu.i_cmd.valid & u.alu.i_cmd.ready), t.retire.eq(self.o_retire)]
        # completions and state back
        self._done = stream.Signature(eng.o_done.payload.shape(), always_ready=True).flip().create()
        broadcast(m, eng.o_done, [self._done] + [s.i_done for s in u.seqs])
        broadcast(m, u.alu.o_y, [u.vector.i_alu])
        div = u.div
        for s in (u.vector, u.attention):
            m.d.comb += [s.div.busy.eq(div.o_busy), s.div.q.eq(div.o_q), s.div.r.eq(div.o_r)]
        m.d.comb += [div.i_start.eq(u.vector.div.start | u.attention.div.start),
                     div.i_num.eq(Mux(u.vector.div.start, u.vector.div.num, u.attention.div.num)),
                     div.i_den.eq(Mux(u.vector.div.start, u.vector.div.den, u.attention.div.den))]
        for s in (u.matrix, u.attention):
            m.d.comb += [s.i_engine.active.eq(tr.o_hold.active), s.i_engine.idle.eq(tr.o_idle),
                         s.i_engine.failed.eq(tr.o_failed), s.i_engine.code.eq(tr.o_code),
                         s.i_engine.act_n.eq(tr.o_act_n)]
        with m.If(u.vector.o_sreg.valid):
            self._write_sreg(m, u.vector.o_sreg.payload.idx, u.vector.o_sreg.payload.value)
        with m.If(u.matrix.o_emax.valid):
            m.d.sync += self._emax.eq(u.matrix.o_emax.payload)

    def _write_sreg(self, m, idx, value):
        w = self._sreg_w
        m.d.comb += [w.en.eq(1), w.idx.eq(idx), w.value.eq(value)]

    def _fsm(self, m):
        """Fetch, dispatch, the instructions the controller runs itself, and the end of a program."""
        hw, u = self._hw, self._u
        tr = u.tracker
        word, pc = self._word, self._pc
        next_pc = Signal(PC_BITS + 1)
        op = word[60:64]
        err_code = Signal(ErrorCode)
        busy = self.o_busy
        m.d.comb += self.o_error_code.eq(err_code)
        # an instruction's error code has one write port, like the scalar registers: the site that fails drives it
        # (comb, 0 elsewhere: no hold of err_code in every state's choice), and err_code takes it the cycle
        # after (`err_held`). The failing site goes to ERROR, which raises o_error a cycle later at the earliest:
        # o_error and its code are seen together, as before.
        err_w = Signal(data.StructLayout({"en": 1, "code": ErrorCode}), name="err_write")
        err_held = Signal.like(err_w, name="err_held")
        m.d.sync += err_held.eq(err_w)
        with m.If(err_held.en):
            m.d.sync += err_code.eq(err_held.code)
        from ..decoder import Decoder
        m.submodules.decoder = decoder = Decoder(hw.l2_bytes // 16)
        m.d.comb += decoder.i_word.eq(self.i_insn.payload.word)

        def end(code, at_engine):
            if code is ErrorCode.NONE:
                m.d.comb += self.o_retire.eq(1)
            else:
                m.d.comb += [err_w.en.eq(1), err_w.code.eq(code)]
                if at_engine:
                    m.d.sync += self.o_error_pc.eq(tr.o_pc)
        st = Steps(m, self._pass, self._done, end, idle="FETCH", error="ERROR")

        def fail_async():
            """The engine's error, reported at the failed WGEMV's index."""
            st.fail(tr.o_code, at_engine=1)

        start_while_busy = Signal()
        with m.If(self.i_ack):
            m.d.sync += [self.o_done.eq(0), self.o_error.eq(0)]
        with m.If(self.i_start & ~busy):
            m.d.sync += [busy.eq(1), self.o_done.eq(0), self.o_error.eq(0), err_code.eq(ErrorCode.NONE),
                         start_while_busy.eq(0), self._token.eq(self.i_token), self._pos.eq(self.i_pos)]
        with m.If(self.i_start & busy):
            m.d.sync += start_while_busy.eq(1)

        self._desc_index = index = Signal(16)            # the descriptor the instruction names
        with m.Switch(op):
            for o, field in ((Opcode.WGEMV, "desc"), (Opcode.WGEMM, "desc"), (Opcode.GATHER, "desc"),
                             (Opcode.KVST, "slot"), (Opcode.ATTN, "slot")):
                with m.Case(o):
                    m.d.comb += index.eq(getattr(data.View(layout(o), word), field))

        seq_end = stream.Signature(u.vector.o_end.payload.shape(), always_ready=True).flip().create()
        merge(m, seq_end, [s.o_end for s in u.seqs])
        # CTRL's and SCALAR's func (both word[56:60]) decoded and registered every cycle, one flag a value: their
        # states (after DISPATCH) test a flip-flop per function, not a decode of the field in every condition
        func = word[56:60]
        self._func = [_early(m, func == v, f"func_{v}") for v in range(1 << len(func))]

        with m.FSM(name="ctl") as fsm:
            with m.State("IDLE"):
                m.d.sync += next_pc.eq(0)
                with m.If(self.i_start):
                    m.next = "FETCH"

            with m.State("FETCH"):
                with m.If(next_pc >= self.i_prog_len):           # the program ended without HALT
                    m.d.sync += self.o_error_pc.eq(next_pc)
                    st.fail(ErrorCode.BAD_LENGTH)
                m.d.comb += [self.i_insn.ready.eq(1), self.o_unit_busy.issue_wait.eq(~self.i_insn.valid)]
                with m.If(self.i_insn.valid & (next_pc < self.i_prog_len)):
                    m.d.sync += [next_pc.eq(self.i_insn.payload.pc + 1), word.eq(self.i_insn.payload.word),
                                 pc.eq(self.i_insn.payload.pc), self.o_error_pc.eq(self.i_insn.payload.pc)]
                    with m.If(self.i_insn.payload.err):
                        st.fail(ErrorCode.BUS_ERROR)
                    with m.Elif(decoder.o_error != ErrorCode.NONE):
                        st.fail(decoder.o_error)
                    with m.Else():
                        m.next = "DISPATCH"
                with m.If(tr.o_failed):                 # an async WGEMV failed: its error, at its pc
                    fail_async()

            with m.State("ERROR"):
                # an async WGEMV (or ATTN's RECIP pass beside its V GEMVs) still running completes first
                with m.If(~tr.o_hold.active & ~u.engine.o_active):
                    m.d.comb += self.o_stop.eq(1)
                    m.d.sync += [busy.eq(0), self.o_error.eq(1)]
                    m.next = "IDLE"

            with m.State("HALT"):
                # A START written while this program ran was ignored: the program still completes (DONE), and
                # ERROR with START_WHILE_BUSY tells the host that its START had no effect.
                m.d.comb += [self.o_stop.eq(1), self.o_retire.eq(1)]
                m.d.sync += [busy.eq(0), self.o_done.eq(1)]
                with m.If(start_while_busy | (self.i_start & busy)):
                    m.d.sync += [self.o_error.eq(1), err_code.eq(ErrorCode.START_WHILE_BUSY)]
                m.next = "IDLE"

            with m.State("DISPATCH"):
                with m.Switch(op):
                    with m.Case(Opcode.GEMV, Opcode.GEMM, Opcode.MEMCPY):
                        st.fail(ErrorCode.BAD_FUNCTION)
                    for o in (Opcode.CTRL, Opcode.MEMSET, Opcode.SCALAR):
                        with m.Case(o):
                            m.next = o.name
                    with m.Case(Opcode.VEC, Opcode.CVO, Opcode.DMA):
                        m.d.comb += u.vector.i_start.eq(1)
                        m.next = "RUN"
                    with m.Case(Opcode.WGEMV, Opcode.WGEMM):
                        with m.If(~tr.o_hold.active):    # one matrix at a time (they share the weight ports)
                            with m.If(tr.o_failed):     # the previous one failed: its error, at its pc
                                fail_async()
                            with m.Else():
                                m.next = "DESC"
                    with m.Case(Opcode.GATHER, Opcode.KVST, Opcode.ATTN):
                        m.next = "DESC"

            with m.State("RUN"):                # a sequencer runs the instruction
                with m.If(seq_end.valid):
                    with m.If(seq_end.payload.code == ErrorCode.NONE):
                        m.d.comb += self.o_retire.eq(1)
                        m.next = "FETCH"
                    with m.Else():
                        m.d.comb += [err_w.en.eq(1), err_w.code.eq(seq_end.payload.code)]
                        with m.If(seq_end.payload.at_engine):
                            m.d.sync += self.o_error_pc.eq(tr.o_pc)
                        m.next = "ERROR"

            self._ctrl(m, st, fail_async)
            self._memset(m, st)
            self._scalar(m, st)
            self._descriptor(m, st)
        recode(fsm, "one-hot")          # a state's test one flip-flop, not a decode of a 5-bit number

    def _ctrl(self, m, st, fail_async):
        u, tr = self._u, self._u.tracker
        c = data.View(layout(Opcode.CTRL), self._word)
        fn = self._func_is
        drain = (CtrlFunc.HALT, CtrlFunc.FENCE, CtrlFunc.SETTOK, CtrlFunc.SETPOS)
        with m.State("CTRL"):              # one If per function (their flags are one-hot), as a Switch on func
            with m.If(fn(CtrlFunc.SETVL)):
                m.d.sync += self._vl.eq(c.imm)
                st.retire()
            with m.If(fn(CtrlFunc.SETHD)):
                m.d.sync += self._hd.eq(c.imm)
                m.d.comb += [u.irecip.i_start.eq(1), u.irecip.i_n.eq(c.imm)]
                m.next = "SETHD_W"
            with m.If(fn(*drain)):
                m.next = "DRAIN"
            with m.If(~fn(CtrlFunc.SETVL, CtrlFunc.SETHD, *drain)):      # NOP
                st.retire()
        with m.State("DRAIN"):             # FENCE, HALT, SETTOK, SETPOS: wait for an async WGEMV or WGEMM
            with m.If(~tr.o_hold.active):
                with m.If(tr.o_failed):
                    fail_async()
                with m.Elif(fn(CtrlFunc.HALT)):
                    m.next = "HALT"
                with m.Else():
                    with m.If(fn(CtrlFunc.SETTOK)):
                        m.d.sync += self._token.eq(c.imm)
                    with m.If(fn(CtrlFunc.SETPOS)):
                        m.d.sync += self._pos.eq(c.imm)
                    st.retire()
        with m.State("SETHD_W"):
            with m.If(~u.irecip.o_busy):
                m.d.sync += self._inv_hd.eq(u.irecip.o_y)
                st.retire()

    def _func_is(self, *funcs):
        """The word's func is one of `funcs` (CtrlFunc or ScalarFunc members), from the registered flags."""
        return Cat(*[self._func[f.value] for f in funcs]).any()

    def _memset(self, m, st):
        ms = data.View(layout(Opcode.MEMSET), self._word)
        w = self._fmap_w
        # slot >= SCALAR_REGS as an OR of its high bits: no carry chain on the word's bits for synthesis to share
        bad = _early(m, ms.slot[(SCALAR_REGS - 1).bit_length():].any() | (ms.c != 0), "ms_bad")
        with m.State("MEMSET"):
            with m.If(ms.cache == ShapeCache.SCALAR):
                with m.If(bad):
                    st.fail(ErrorCode.BAD_FUNCTION)
                with m.Else():
                    self._write_sreg(m, ms.slot[:3], Cat(ms.b, ms.a))
                    st.retire()
            with m.Else():
                with m.If(ms.cache == ShapeCache.FMAP):
                    m.d.comb += [w.en.eq(1), w.addr.eq(ms.slot), w.data.heads.eq(ms.a), w.data.head_dim.eq(ms.b),
                                 w.data.window.eq(ms.c)]
                st.retire()

    def _scalar(self, m, st):
        hw, u = self._hw, self._u
        L2E = hw.l2_bytes // 4
        sc = data.View(layout(Opcode.SCALAR), self._word)
        sregs = self._sregs
        # the operands S[a] and S[b], registered every cycle: SCALAR follows DISPATCH, in which the word is
        # already the instruction's and no instruction writes a scalar register; MAX's and MAXI's comparisons
        # of them, registered every cycle too (from SCALAR on: SC_MAX takes them)
        sa, sb = Signal(32, name="sc_a"), Signal(32, name="sc_b")
        m.d.sync += [sa.eq(sregs[sc.a]), sb.eq(sregs[sc.b])]
        b_gt, imm_gt = _f32_gt_registered(m, sb, sa, "sc_b_gt"), _f32_gt_registered(m, sc.imm, sa, "sc_imm_gt")
        beyond = _early(m, sc.imm >= L2E, "sc_beyond")          # LD, ST: the address is outside L2
        # the SFU function of RSQRT, SQRT, RECIP and TANH, registered every cycle too: no choice on func (which
        # synthesis makes a table indexed by func - 5, a subtraction) between the word and the pass command
        sfu_funcs = (ScalarFunc.RSQRT, ScalarFunc.SQRT, ScalarFunc.RECIP, ScalarFunc.TANH)
        sfu_op = Signal(SfuOp, name="sc_sfu_op")
        op_of = SfuOp.COPY
        for f in sfu_funcs:
            op_of = Mux(sc.func == f, SfuOp[f.name], op_of)
        m.d.sync += sfu_op.eq(op_of)

        def alu(a, b, fn):
            c = self._alu_cmd
            m.d.comb += [c.valid.eq(1), c.payload.a.eq(a), c.payload.b.eq(b), c.payload.fn.eq(fn)]
            m.next = "SC_ALU"

        def write(value):
            self._write_sreg(m, sc.d, value)
            st.retire()
        fn = self._func_is
        with m.State("SCALAR"):            # one If per function (their flags are one-hot), as a Switch on func
            with m.If(fn(ScalarFunc.LI)):
                write(sc.imm)
            for f, a, b, alu_fn in ((ScalarFunc.ADD, sa, sb, AluFn.ADD), (ScalarFunc.SUB, sa, sb ^ 0x80000000, AluFn.ADD),
                                    (ScalarFunc.MUL, sa, sb, AluFn.MUL), (ScalarFunc.MULI, sa, sc.imm, AluFn.MUL),
                                    (ScalarFunc.ADDI, sa, sc.imm, AluFn.ADD), (ScalarFunc.LDPOS, self._pos, 0, AluFn.ITOF)):
                with m.If(fn(f)):
                    alu(a, b, alu_fn)
            with m.If(fn(ScalarFunc.MAX, ScalarFunc.MAXI)):
                m.next = "SC_MAX"
            with m.If(fn(*sfu_funcs)):     # one element through the SFU
                st.launch("SC_SFU", op=sfu_op, n=1, a=Src.REG, a_val=sa, sink=Sink.REG)
            with m.If(fn(ScalarFunc.LD)):
                with m.If(beyond):
                    st.fail(ErrorCode.ADDRESS_RANGE)
                with m.Else():
                    st.launch("SC_SFU", bypass=1, n=1, a=Src.L2, a_addr=sc.imm, sink=Sink.REG)
            with m.If(fn(ScalarFunc.ST)):
                with m.If(beyond):
                    st.fail(ErrorCode.ADDRESS_RANGE)
                with m.Else():
                    st.launch("SC_ST", bypass=1, n=1, a=Src.REG, a_val=sa, sink=Sink.L2, dst=sc.imm)
        with m.State("SC_MAX"):
            write(Mux(fn(ScalarFunc.MAX), Mux(b_gt, sb, sa), Mux(imm_gt, sc.imm, sa)))
        with m.State("SC_ALU"):
            with m.If(u.alu.o_y.valid):
                write(u.alu.o_y.payload)
        st.wait_pass("SC_SFU", lambda: write(st.result))
        st.wait_pass("SC_ST", st.retire)

    def _descriptor(self, m, st):
        """WGEMV, WGEMM, GATHER, KVST, ATTN: the descriptor into the pass engine's words, then their sequencer."""
        hw, u = self._hw, self._u
        op = self._word[60:64]
        index = self._desc_index
        beyond = _early(m, index >= self.i_desc_count, "desc_beyond")
        # the descriptor's DDR address, registered every cycle too (DESC follows DISPATCH): no sum between the
        # word and the pass command
        addr = Signal(hw.axi_addr_bits, name="desc_addr")
        m.d.sync += addr.eq((self._ctx.base[DdrRegion.DESC.value] + index * DESC_BYTES)[:hw.axi_addr_bits])
        with m.State("DESC"):
            with m.If(beyond):
                st.fail(ErrorCode.BAD_DESCRIPTOR)
            with m.Else():
                st.launch("DESC_W", bypass=1, n=DESC_WORDS, a=Src.DDR, ddr_addr=addr, ddr_fmt=0, sink=Sink.DESC)

        def start():
            with m.If((op == Opcode.KVST) | (op == Opcode.ATTN)):
                m.d.comb += u.attention.i_start.eq(1)
            with m.Else():
                m.d.comb += u.matrix.i_start.eq(1)
            m.next = "RUN"
        st.wait_pass("DESC_W", start)
