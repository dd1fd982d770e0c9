"""The NPU core: the controller and the datapath it drives (docs/architecture.md, "Controller").

The controller takes decoded instruction words from the fetch unit and executes each instruction as a
short sequence of **passes**. A pass streams `n` binary32 elements from one source through the SFU (or
around it, for raw copies) into one sink:

===========  ================================================================================================
sources      ``L2`` (an `ElemReader`), ``PAIRS`` (two L2 elements per item: the u0.64 RoPE frequencies),
             ``DDR`` (a `DdrReader`: binary32, binary16 or scaled INT4 rows), ``REG`` (one scalar)
b operand    none, ``L2`` (a second `ElemReader`), ``REG`` (a scalar, for every element)
sinks        ``L2`` (an `ElemWriter`), ``REG`` (the last element: scalar results), ``DDR`` (a `DdrWriter`:
             binary32 or binary16), ``DESC`` (the 8 words of a descriptor), ``QUANT`` (the WGEMV activation
             quantiser, which fills the GEMV engine's activation memories; always from ``L2`` around the SFU,
             four elements per cycle: the reader's beats, through one register stage)
===========  ================================================================================================

WGEMV adds one special pass: the GEMV engine streams its rows (with `accm`, the old values come from the
second reader) into the `ElemWriter`. Every composition is the one `sim.iss` runs (docs/numerics.md, the
composition table), so the results are bit-identical to the ISS's hardware arithmetic:

- RMSNORM / RMSNORM_NG per HD segment: SUMSQ -> s; s * fp32(1/HD) and + S[s] in the scalar ALU; RSQRT;
  MULS into dst; (RMSNORM) MUL by the gain.
- ROPE per head: four MULs into the scratch, then SUB and ADD into dst.
- ATTN per KV group, binary16 cache (``kv_format`` "fp16"): per visible position (oldest first) the K row
  (binary16 -> binary32) into the scratch and one DOT per head into the scores; per head MAX, EXP(s - max),
  SUM, RECIP, MULS; per position the V row and, per head, MULS (first position) or FMAS into dst.
- ATTN per KV group, INT8 cache ("int8", the presets): per head, the query into the quantiser, two GEMV
  engine commands over the slot's K planes (lo, then hi with accm) into the scratch, MAX, EXP(s - max), SUM,
  MUL by the V row scales (from DDR), then per chunk of ``gemv_max_cols`` positions the weights into the
  quantiser and two sparse engine commands over the V planes (accm after the first) into dst, with RECIP(sum)
  beside the first chunk's (it uses only the SFU and registers), then MULS by the reciprocal. KVST per head:
  K into the quantiser (limit 119) and the `KvPacker`, its two plane rows and scale rows out to DDR; V into
  the quantiser twice (its row exponent, then the values at that exponent), its two plane columns and its
  row scale out. The slot layout is `sim.numerics.KvInt8Layout`.
- CVO SCALE with recip_scale and SOFTCAP first take RECIP(S0); REDUCE/ROPE functions with accm add the
  staged result to dst afterwards (the SFU's accm covers the element-wise functions).

Instructions issue in order. A WGEMV runs in two parts: the quantiser pass (a pass like any other), then the
GEMV engine streams the weights and writes its rows into L2 beside the passes, through its own L2 ports. A
WGEMV with ``async_`` (and without ``findemax``) retires as soon as the engine has its command; without it, it
retires when the last row is in L2. Hazards are tracked per pass: a pass whose L2 ranges (a, b or dst) meet
the rows the engine has yet to write waits until they are written; the next WGEMV waits for the engine; FENCE
and HALT wait for it. The results are therefore those of sequential execution (the ISS) for any program. An
async WGEMV that fails (a bus error on its weights) is reported at the next instruction boundary, FENCE or
HALT, with ERROR_PC = the WGEMV's index; instructions issued after it may have run.

WGEMM runs per token tile of ``systolic_rows`` tokens: a quantiser pass per token into the GEMM unit
(`hdl.gemm`), then the tile takes the engine's place above (its output rows are the running range); the
last tile may retire at once with ``async_``, the others are waited for.
"""

from __future__ import annotations

from amaranth import Array, Cat, Const, Module, Mux, Signal, Value
from amaranth.lib import data, enum, memory, stream, wiring
from amaranth.lib.wiring import In, Out, connect

from .config import V_PLANE_LOG2_GROUP, HardwareConfig, ceil_log2
from .ddrio import DdrReader
from .ddrwrite import DdrWriter
from .fetch import PC_BITS, insn_layout
from .fp import FpAdd, FpMul, IntToFp
from .gemm import GemmUnit, gemm_command_layout
from .gemv import GemvEngine
from .isa import (DESC_BYTES, DESC_WORDS, DESCRIPTOR, VEC_REDUCTIONS, CtrlFunc, CvoFunc, DdrRegion, DescKind, DmaDir,
                  ErrorCode, Opcode, ScalarFunc, ShapeCache, VecFunc, layout)
from .l2 import LANES, L2, ElemReader, ElemWriter
from .quant import ActQuantizer, KvPacker
from .seq import IntRecip, SeqDivider
from .sfu import REDUCE_OPS, SHORT_OPS, Sfu, SfuOp, _gt, _is_nan

__all__ = ["Controller", "Src", "BSrc", "Sink", "REGIONS"]

L2_BANKS = 2          # word-interleaved L2 banks: two operand streams of a wide pass at one word per cycle each

REGIONS = tuple(DdrRegion)


class Src(enum.Enum, shape=3):
    L2 = 0
    PAIRS = 1
    DDR = 2
    REG = 3
    PACK = 4          # the KV packer's plane words and scales (INT8 KV cache: KVST)


class BSrc(enum.Enum, shape=2):
    NONE = 0
    L2 = 1
    REG = 2


class Sink(enum.Enum, shape=3):
    L2 = 0
    REG = 1
    DDR = 2
    DESC = 3
    QUANT = 4


def _share_axi(m, out, a, b, sel_b):
    """AXI read master `out` driven by `a`, or by `b` while `sel_b`; the idle one sees no handshake."""
    for name, member in out.signature.members.items():
        mine, x, y = getattr(out, name), getattr(a, name), getattr(b, name)
        if member.flow == Out:
            m.d.comb += mine.eq(Mux(sel_b, y, x))
        elif name in ("arready", "rvalid"):
            m.d.comb += [x.eq(mine & ~sel_b), y.eq(mine & sel_b)]
        else:
            m.d.comb += [x.eq(mine), y.eq(mine)]


def _f32_gt(a, b):
    """a > b for binary32 (False if either is NaN; ±0 equal): Python's ``max(b, a)`` picks a exactly then."""
    return ~_is_nan(a) & ~_is_nan(b) & _gt(a, b)


class Controller(wiring.Component):
    """Controller + datapath of the NPU (everything but the CSRs, the fetch and the AXI port arbitration).

    Members
    -------
    i_insn : In(stream(insn_layout))     decoded words come in raw; the controller decodes them
    i_start : In(1)                      pulse: a program starts (the fetch is started by the top)
    i_ack : In(1)                        pulse: clear o_done and o_error (IRQ_ACK)
    i_prog_len : In(PC_BITS)             program length in words: running past it is BAD_LENGTH (no HALT)
    i_token, i_pos, i_desc_count : In(32)
    i_base_<region> : In(64)             DDR byte address of every region
    o_stop : Out(1)                      pulse: the program ended (HALT or error): stop the fetch
    o_busy, o_done, o_error : Out(1)     o_done / o_error stay until the next start
    o_error_code : Out(ErrorCode); o_error_pc : Out(PC_BITS)
    o_retire : Out(1)                    pulse per executed instruction
    o_unit_busy : Out(StructLayout)      gemv, gemm, sfu, attn, dma, issue_wait: per-cycle activity for counters
    m_gemv<p> : Out(AxiReadSignature)    the weight readers: the GEMV engine's, or the GEMM unit's on the
                                         first ``wgt_ports + 1`` while a WGEMM tile runs
    m_rd : Out(AxiReadSignature)         the DdrReader (descriptors, DMA, GATHER, K/V rows)
    m_wr : Out(AxiWriteSignature)        the DdrWriter (DMA to DDR, KVST)
    """

    def __init__(self, hw: HardwareConfig):
        from .axi import AxiReadSignature, AxiWriteSignature
        self._hw = hw
        members = {
            "i_insn": In(stream.Signature(insn_layout())),
            "i_start": In(1), "i_ack": In(1), "i_prog_len": In(PC_BITS),
            "i_token": In(32), "i_pos": In(32), "i_desc_count": In(32),
            "o_stop": Out(1), "o_busy": Out(1), "o_done": Out(1), "o_error": Out(1),
            "o_error_code": Out(ErrorCode), "o_error_pc": Out(PC_BITS), "o_retire": Out(1),
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
        hw = self._hw
        L2E = hw.l2_bytes // 4                       # L2 elements
        EA = (L2E - 1).bit_length()
        NB = EA + 1
        SB = (hw.l2_bytes - hw.l2_scratch_bytes) // 4   # first scratch element
        SCR = hw.l2_scratch_bytes // 4
        A = hw.axi_addr_bits

        # --- units ------------------------------------------------------------------------------------
        # ports 0/1 read and port 0 writes for the passes; read port 2 (accm) and write port 1 (the rows) for the
        # GEMV engine, which runs beside the passes (async WGEMV). Two banks (even and odd words): a wide pass's
        # two operand streams get a word per cycle each (they fall out of phase after at most one collision).
        m.submodules.l2 = l2 = L2(hw, read_ports=3, write_ports=2, banks=L2_BANKS)
        # beats: four elements per cycle into the quantiser and the SFU's short path, and out of it into L2
        m.submodules.rd_a = rd_a = ElemReader(hw, beats=True)
        m.submodules.rd_b = rd_b = ElemReader(hw, beats=True)
        m.submodules.rd_g = rd_g = ElemReader(hw)
        m.submodules.wr = wr = ElemWriter(hw, beats=True)
        m.submodules.wr_g = wr_g = ElemWriter(hw)
        for i, rd in enumerate((rd_a, rd_b, rd_g)):
            connect(m, rd.o_req, getattr(l2, f"rd{i}_req"))
            connect(m, getattr(l2, f"rd{i}_resp"), rd.i_resp)
        connect(m, wr.o_wr, l2.wr0)
        connect(m, wr_g.o_wr, l2.wr1)
        m.submodules.sfu = sfu = Sfu(hw)
        m.submodules.ddr_rd = ddr_rd = DdrReader(hw)
        m.submodules.ddr_wr = ddr_wr = DdrWriter(hw)
        wiring.connect(m, ddr_rd.axi, wiring.flipped(self.m_rd))
        wiring.connect(m, ddr_wr.axi, wiring.flipped(self.m_wr))
        m.submodules.quant = quant = ActQuantizer(hw)
        m.submodules.gemv = gemv = GemvEngine(hw)
        m.submodules.gemm = gemm = GemmUnit(hw)
        int8_kv = hw.kv_format == "int8"
        if int8_kv:
            m.submodules.packer = packer = KvPacker(hw, hw.kv_max_head_dim)
        # The quantiser fills the GEMV engine's activation memories, or (WGEMM) token slot q_tok of the GEMM
        # unit's, or (INT8 KVST, p_qpack) the KV packer; the weight ports belong to whichever of the GEMV engine
        # and the GEMM unit has the running matrix (g_is_gemm).
        q_gemm, q_tok = Signal(), Signal.like(gemm.i_tok)
        p_qpack = Signal()
        g_is_gemm = Signal()
        for src, dsts in ((quant.o_act, (gemv.i_act, gemm.i_act) + ((packer.i_act,) if int8_kv else ())),
                          (quant.o_exp, (gemv.i_exp, gemm.i_exp) + ((packer.i_exp,) if int8_kv else ()))):
            sel = [~q_gemm & ~p_qpack, q_gemm & ~p_qpack, p_qpack]
            for k, dst in enumerate(dsts):
                m.d.comb += [dst.valid.eq(src.valid & sel[k]), dst.p.eq(src.p)]
            m.d.comb += src.ready.eq(Mux(p_qpack, dsts[-1].ready if int8_kv else 1,
                                         Mux(q_gemm, dsts[1].ready, dsts[0].ready)))
        m.d.comb += gemm.i_tok.eq(q_tok)
        for p in range(hw.axi_ports):
            out = getattr(self, f"m_gemv{p}")
            if p < gemm.axi_ports:
                _share_axi(m, out, getattr(gemv, f"m_axi{p}"), getattr(gemm, f"m_axi{p}"), g_is_gemm)
            else:
                wiring.connect(m, getattr(gemv, f"m_axi{p}"), wiring.flipped(out))
        m.submodules.div = div = SeqDivider()
        m.submodules.irecip = irecip = IntRecip()
        m.submodules.alu_add = alu_add = FpAdd()
        m.submodules.alu_mul = alu_mul = FpMul()
        m.submodules.alu_itof = alu_itof = IntToFp(32)
        for u in (alu_add, alu_mul, alu_itof):
            m.d.comb += u.en.eq(1)

        # --- architectural state ----------------------------------------------------------------------
        sregs = Array([Signal(32, name=f"s{i}") for i in range(8)])
        vl = Signal(32)
        hd = Signal(32)
        inv_hd = Signal(32)
        emax = Signal(32)
        act_n = Signal(range(hw.gemv_max_cols + 1))     # activations the GEMV engine holds (WGEMV reuse)
        m.submodules.fmap = fmap = memory.Memory(shape=48, depth=64, init=[])
        fmap_w = fmap.write_port()
        fmap_r = fmap.read_port(domain="comb")

        # --- the pass engine --------------------------------------------------------------------------
        p_op = Signal(SfuOp)
        p_bypass = Signal()
        p_n = Signal(NB)
        p_a = Signal(Src)
        p_a_addr = Signal(EA)
        p_a_val = Signal(32)
        p_b = Signal(BSrc)
        p_b_addr = Signal(EA)
        p_b_val = Signal(32)
        p_s, p_s_inv, p_emax = Signal(32), Signal(32), Signal(32)
        p_sub_emax, p_recip_scale, p_accm = Signal(), Signal(), Signal()
        p_sink = Signal(Sink)
        p_dst = Signal(EA)
        p_ddr_addr = Signal(A)
        p_ddr_fmt = Signal(2)
        p_ddr_saddr = Signal(A)
        p_ddr_log2g = Signal(5)
        p_wr_addr = Signal(A)
        p_wr_fmt = Signal()
        p_qlimit, p_qforce = Signal(), Signal()         # quantiser options (INT8 KV: limit 119, a forced exponent)
        p_qe = Signal.like(quant.i_cmd.payload.e)
        p_psel = Signal(2)                              # Src.PACK: which packer stream
        p_result = Signal(32)
        p_err = Signal()             # a bus error seen during the pass

        is_reduce = Signal()
        m.d.comb += is_reduce.eq(~p_bypass & Cat(*[p_op == op for op in REDUCE_OPS]).any())
        # a wide pass: a SHORT_OPS pass from L2 into L2 or a register, four elements per cycle (the readers' beats,
        # the SFU's four lanes, the writer's beats); every other pass moves one element per cycle
        wide = Signal()
        m.d.comb += wide.eq(~p_bypass & Cat(*[p_op == op for op in SHORT_OPS]).any() & (p_a == Src.L2)
                            & ((p_sink == Sink.L2) | (p_sink == Sink.REG)))
        n_out = Signal(NB)
        m.d.comb += n_out.eq(Mux(is_reduce, 1, p_n))

        pstart = Signal()             # one-cycle pulse from the sequencer
        pdone = Signal()              # one-cycle pulse: the pass has completed
        pending = Signal(data.StructLayout({"rd_a": 1, "rd_b": 1, "ddr_rd": 1, "ddr_wr": 1, "wr": 1, "sfu": 1,
                                            "quant": 1, "pack": 1}))
        active = Signal()
        a_sent = Signal()             # REG source: the element has been sent
        sunk = Signal(NB)             # elements taken by REG/DESC sinks
        desc = Signal(data.ArrayLayout(32, DESC_WORDS))

        a_in_l2 = (p_a == Src.L2) | (p_a == Src.PAIRS)
        with m.If(pstart):
            m.d.sync += [active.eq(1), a_sent.eq(0), sunk.eq(0), p_err.eq(0),
                         pending.rd_a.eq(a_in_l2),
                         pending.rd_b.eq(p_b == BSrc.L2),
                         pending.ddr_rd.eq(p_a == Src.DDR),
                         pending.ddr_wr.eq(p_sink == Sink.DDR),
                         pending.wr.eq(p_sink == Sink.L2),
                         pending.sfu.eq(~p_bypass),
                         pending.quant.eq(p_sink == Sink.QUANT),
                         pending.pack.eq(p_a == Src.PACK)]

        # commands
        m.d.comb += [
            rd_a.i_cmd.valid.eq(pending.rd_a), rd_a.i_cmd.payload.addr.eq(p_a_addr),
            rd_a.i_beats.eq((p_sink == Sink.QUANT) | wide),
            rd_a.i_cmd.payload.n.eq(Mux(p_a == Src.PAIRS, p_n << 1, p_n)),
            rd_b.i_cmd.valid.eq(pending.rd_b), rd_b.i_cmd.payload.addr.eq(p_b_addr),
            rd_b.i_cmd.payload.n.eq(p_n), rd_b.i_beats.eq(wide),
            ddr_rd.i_cmd.valid.eq(pending.ddr_rd), ddr_rd.i_cmd.payload.addr.eq(p_ddr_addr),
            ddr_rd.i_cmd.payload.n.eq(p_n), ddr_rd.i_cmd.payload.fmt.eq(p_ddr_fmt),
            ddr_rd.i_cmd.payload.saddr.eq(p_ddr_saddr), ddr_rd.i_cmd.payload.log2_group.eq(p_ddr_log2g),
            ddr_wr.i_cmd.valid.eq(pending.ddr_wr), ddr_wr.i_cmd.payload.addr.eq(p_wr_addr),
            ddr_wr.i_cmd.payload.n.eq(n_out), ddr_wr.i_cmd.payload.fmt.eq(p_wr_fmt),
            wr.i_cmd.valid.eq(pending.wr), wr.i_cmd.payload.addr.eq(p_dst), wr.i_cmd.payload.n.eq(n_out),
            sfu.i_cmd.valid.eq(pending.sfu),
            sfu.i_cmd.payload.op.eq(p_op), sfu.i_cmd.payload.length.eq(p_n),
            sfu.i_cmd.payload.sub_emax.eq(p_sub_emax), sfu.i_cmd.payload.recip_scale.eq(p_recip_scale),
            sfu.i_cmd.payload.accm.eq(p_accm), sfu.i_cmd.payload.s.eq(p_s), sfu.i_cmd.payload.s_inv.eq(p_s_inv),
            sfu.i_cmd.payload.emax.eq(p_emax), sfu.i_cmd.payload.pos.eq(self.i_pos),
            quant.i_cmd.valid.eq(pending.quant), quant.i_cmd.payload.n.eq(p_n),
            quant.i_cmd.payload.limit.eq(p_qlimit), quant.i_cmd.payload.force.eq(p_qforce),
            quant.i_cmd.payload.e.eq(p_qe),
        ]
        units = [("rd_a", rd_a), ("rd_b", rd_b), ("ddr_rd", ddr_rd), ("ddr_wr", ddr_wr), ("wr", wr), ("sfu", sfu),
                 ("quant", quant)]
        if int8_kv:
            m.d.comb += [packer.i_cmd.valid.eq(pending.pack), packer.i_cmd.payload.sel.eq(p_psel),
                         packer.i_cmd.payload.n.eq(p_n)]
            units.append(("pack", packer))
        for name, unit in units:
            with m.If(unit.i_cmd.valid & unit.i_cmd.ready):
                m.d.sync += getattr(pending, name).eq(0)

        # a operand
        a_valid, a_data, a_ready = Signal(), Signal(32), Signal()
        pair_lo_valid, pair_hi = Signal(), Signal(32)
        b_valid, b_data, b_ready = Signal(), Signal(32), Signal()
        have_hi = Signal()
        with m.Switch(p_a):
            with m.Case(Src.L2):
                m.d.comb += [a_valid.eq(rd_a.o_elem.valid), a_data.eq(rd_a.o_elem.payload.data),
                             rd_a.o_elem.ready.eq(a_ready)]
            with m.Case(Src.PAIRS):
                # element 2j (high word) is held, element 2j+1 (low word) completes the item
                m.d.comb += [a_valid.eq(rd_a.o_elem.valid & have_hi), a_data.eq(pair_hi),
                             pair_lo_valid.eq(1),
                             rd_a.o_elem.ready.eq(~have_hi | a_ready)]
                with m.If(rd_a.o_elem.valid & ~have_hi):
                    m.d.sync += [pair_hi.eq(rd_a.o_elem.payload.data), have_hi.eq(1)]
                with m.If(rd_a.o_elem.valid & have_hi & a_ready):
                    m.d.sync += have_hi.eq(0)
            with m.Case(Src.DDR):
                m.d.comb += [a_valid.eq(ddr_rd.o_elem.valid), a_data.eq(ddr_rd.o_elem.payload.data),
                             ddr_rd.o_elem.ready.eq(a_ready)]
                with m.If(ddr_rd.o_elem.valid & a_ready & ddr_rd.o_elem.payload.err):
                    m.d.sync += p_err.eq(1)
            with m.Case(Src.REG):
                m.d.comb += [a_valid.eq(active & ~a_sent), a_data.eq(p_a_val)]
                with m.If(a_valid & a_ready):
                    m.d.sync += a_sent.eq(1)
            if int8_kv:
                with m.Case(Src.PACK):
                    m.d.comb += [a_valid.eq(packer.o_elem.valid), a_data.eq(packer.o_elem.payload),
                                 packer.o_elem.ready.eq(a_ready)]
        with m.If(pstart):
            m.d.sync += have_hi.eq(0)
        with m.Switch(p_b):
            with m.Case(BSrc.NONE):
                m.d.comb += [b_valid.eq(1), b_data.eq(Mux(p_a == Src.PAIRS, rd_a.o_elem.payload.data, 0))]
            with m.Case(BSrc.L2):
                m.d.comb += [b_valid.eq(rd_b.o_elem.valid), b_data.eq(rd_b.o_elem.payload.data),
                             rd_b.o_elem.ready.eq(b_ready)]
            with m.Case(BSrc.REG):
                m.d.comb += [b_valid.eq(1), b_data.eq(p_b_val)]

        # The stage: one register between the operands and the SFU or the quantiser. A beat is either the readers'
        # (four elements: the quantiser's passes and the wide passes; b from the second reader or a scalar in every
        # lane) or one element from the sources above in lane 0. The stage cuts the path from the L2 response
        # buffers through the readers' lane selects into the quantiser's maximum and the SFU's first stages; it is
        # empty again when a pass ends (its consumer takes every element before the pass's sink is done).
        st = Signal(sfu.i_data.payload.shape())
        st_v = Signal()
        st_ready, st_in_v = Signal(), Signal()
        st_in = Signal.like(st)
        m.d.comb += [st_ready.eq(~st_v | Mux(p_sink == Sink.QUANT, quant.i_beat.ready, sfu.i_data.ready)),
                     quant.i_beat.valid.eq(st_v), quant.i_beat.payload.data.eq(st.a.as_value()),
                     quant.i_beat.payload.n.eq(st.n),
                     sfu.i_data.valid.eq(st_v & (p_sink != Sink.QUANT)), sfu.i_data.payload.eq(st)]
        with m.If(st_ready):
            m.d.sync += [st_v.eq(st_in_v & active), st.eq(st_in)]
        a_beat, b_beat = rd_a.o_beat, rd_b.o_beat
        b_wide = Signal()
        m.d.comb += b_wide.eq(p_b == BSrc.L2)
        with m.If(wide | (p_sink == Sink.QUANT)):
            both = a_beat.valid & (~b_wide | b_beat.valid)
            m.d.comb += [st_in_v.eq(both), st_in.a.eq(a_beat.payload.data), st_in.n.eq(a_beat.payload.n),
                         a_beat.ready.eq(st_ready & (~b_wide | b_beat.valid)),
                         b_beat.ready.eq(st_ready & a_beat.valid & b_wide)]
            with m.Switch(p_b):
                with m.Case(BSrc.L2):
                    m.d.comb += st_in.b.eq(b_beat.payload.data)
                with m.Case(BSrc.REG):
                    m.d.comb += [st_in.b[j].eq(p_b_val) for j in range(LANES)]
        with m.Elif(~p_bypass):
            both = a_valid & b_valid
            m.d.comb += [st_in_v.eq(both), st_in.a[0].eq(a_data), st_in.b[0].eq(b_data), st_in.n.eq(1),
                         a_ready.eq(st_ready & b_valid), b_ready.eq(st_ready & a_valid)]

        # SFU or bypass: s_y lanes 0 .. s_n - 1
        s_valid, s_y, s_n, s_ready = Signal(), Signal(data.ArrayLayout(32, LANES)), Signal(3), Signal()
        s_data = Signal(32)                        # the last element of the beat (scalar results)
        with m.If(p_bypass):
            m.d.comb += [s_valid.eq(a_valid), s_y[0].eq(a_data), s_n.eq(1), a_ready.eq(s_ready)]
        with m.Else():
            m.d.comb += [s_valid.eq(sfu.o_data.valid), s_y.eq(sfu.o_data.payload.y), s_n.eq(sfu.o_data.payload.n),
                         sfu.o_data.ready.eq(s_ready)]
        with m.Switch(s_n):
            for j in range(LANES):
                with m.Case(j + 1):
                    m.d.comb += s_data.eq(s_y[j])

        # sinks
        take = Signal()
        m.d.comb += take.eq(s_valid & s_ready)
        with m.Switch(p_sink):
            with m.Case(Sink.L2):
                m.d.comb += [wr.i_beat.valid.eq(s_valid), wr.i_beat.payload.data.eq(s_y.as_value()),
                             wr.i_beat.payload.n.eq(s_n), s_ready.eq(wr.i_beat.ready)]
            with m.Case(Sink.DDR):
                # one element per cycle: no wide pass ends in DDR
                m.d.comb += [ddr_wr.i_elem.valid.eq(s_valid), ddr_wr.i_elem.payload.eq(s_y[0]),
                             s_ready.eq(ddr_wr.i_elem.ready)]
            with m.Case(Sink.REG, Sink.DESC):
                m.d.comb += s_ready.eq(active)
                with m.If(take):
                    m.d.sync += [p_result.eq(s_data), sunk.eq(sunk + s_n)]
                    with m.If(p_sink == Sink.DESC):          # a scalar result must not touch the descriptor
                        with m.Switch(sunk[:ceil_log2(DESC_WORDS)]):
                            for i in range(DESC_WORDS):
                                with m.Case(i):
                                    m.d.sync += desc[i].eq(s_y[0])

        # completion
        wr_done_seen, ddr_done_seen, quant_done_seen = Signal(), Signal(), Signal()
        with m.If(pstart):
            m.d.sync += [wr_done_seen.eq(0), ddr_done_seen.eq(0), quant_done_seen.eq(0)]
        with m.Else():
            with m.If(wr.o_done):
                m.d.sync += wr_done_seen.eq(1)
            with m.If(ddr_wr.o_done):
                m.d.sync += ddr_done_seen.eq(1)
            with m.If(quant.o_done):
                m.d.sync += quant_done_seen.eq(1)
        finished = Signal()
        with m.Switch(p_sink):
            with m.Case(Sink.L2):
                m.d.comb += finished.eq(wr_done_seen)
            with m.Case(Sink.DDR):
                m.d.comb += finished.eq(ddr_done_seen)
            with m.Case(Sink.QUANT):
                m.d.comb += finished.eq(quant_done_seen)
            with m.Case(Sink.REG, Sink.DESC):
                m.d.comb += finished.eq(sunk == n_out)
        with m.If(active & ~pstart & finished & (pending.as_value() == 0)):
            m.d.sync += active.eq(0)
            m.d.comb += pdone.eq(1)
        with m.If(active & ddr_wr.o_error):
            m.d.sync += p_err.eq(1)

        # --- the GEMV engine beside the passes (WGEMV) ----------------------------------------------------------
        # After the quantiser pass the sequencer hands the engine its command (`g_cmd`); the rows go from the
        # engine through `wr_g` into [g_lo, g_lo + g_n) (with accm, the old values come through `rd_g`). An async
        # WGEMV retires there; every later pass whose L2 ranges meet [g_lo, g_lo + g_n) waits until the last row
        # is written (`hazard`), a later WGEMV waits for the engine, FENCE and HALT wait for it too.
        g_cmd = Signal.like(gemv.i_cmd.payload)
        g_active = Signal()           # from the command until the last row is in L2
        g_lo, g_n = Signal(EA), Signal(NB)
        g_pc = Signal(PC_BITS)
        g_pend = Signal(data.StructLayout({"gemv": 1, "rd": 1, "wr": 1, "gemm": 1}))
        gm_cmd = Signal(gemm_command_layout(hw))
        m.d.comb += [gemv.i_cmd.valid.eq(g_pend.gemv), gemv.i_cmd.payload.eq(g_cmd),
                     gemm.i_cmd.valid.eq(g_pend.gemm), gemm.i_cmd.payload.eq(gm_cmd)]
        # the engine's L2 reader and writer: one command per matrix (GEMV) or per token row (GEMM)
        with m.If(g_is_gemm):
            connect(m, gemm.o_wcmd, wr_g.i_cmd)
            connect(m, gemm.o_rcmd, rd_g.i_cmd)
            connect(m, gemm.o_y, wr_g.i_elem)
            m.d.comb += [gemm.i_old.valid.eq(rd_g.o_elem.valid), gemm.i_old.payload.eq(rd_g.o_elem.payload.data),
                         rd_g.o_elem.ready.eq(gemm.i_old.ready)]
        with m.Else():
            m.d.comb += [
                wr_g.i_cmd.valid.eq(g_pend.wr), wr_g.i_cmd.payload.addr.eq(g_lo), wr_g.i_cmd.payload.n.eq(g_n),
                rd_g.i_cmd.valid.eq(g_pend.rd), rd_g.i_cmd.payload.addr.eq(g_lo), rd_g.i_cmd.payload.n.eq(g_n),
            ]
            connect(m, gemv.o_y, wr_g.i_elem)
            m.d.comb += [gemv.i_acc.valid.eq(rd_g.o_elem.valid), gemv.i_acc.payload.eq(rd_g.o_elem.payload.data),
                         rd_g.o_elem.ready.eq(gemv.i_acc.ready)]
        for name, unit in (("gemv", gemv), ("gemm", gemm)):
            with m.If(unit.i_cmd.valid & unit.i_cmd.ready):
                m.d.sync += getattr(g_pend, name).eq(0)
        for name, unit in (("rd", rd_g), ("wr", wr_g)):
            with m.If(~g_is_gemm & unit.i_cmd.valid & unit.i_cmd.ready):
                m.d.sync += getattr(g_pend, name).eq(0)
        # GEMV: its one row command is written (a rejected command sends no rows: the program ends in error and
        # START resets the datapath); GEMM: the unit has sent its last element and the writer has written it
        with m.If(Mux(g_is_gemm, ~g_pend.gemm & ~gemm.o_busy & ~wr_g.o_busy,
                      wr_g.o_done | (gemv.o_bad_cmd & ~g_pend.gemv))):
            m.d.sync += g_active.eq(0)
        g_failed = Signal()           # the engine has finished with an error (its flags are sticky)
        g_code = Signal(ErrorCode)
        m.d.comb += [g_failed.eq(~g_active & (gemv.o_bad_cmd | gemv.o_error | gemm.o_error)),
                     g_code.eq(Mux(gemv.o_bad_cmd, ErrorCode.BAD_LENGTH, ErrorCode.BUS_ERROR))]

        def meets_gemv(lo, n):
            """The element range [lo, lo + n) meets the rows the engine has yet to write."""
            return g_active & (lo < g_lo + g_n) & (g_lo < lo + n)

        hazard = Signal()
        m.d.comb += hazard.eq((a_in_l2 &
                               meets_gemv(p_a_addr, Mux(p_a == Src.PAIRS, p_n << 1, p_n))) |
                              ((p_b == BSrc.L2) & meets_gemv(p_b_addr, p_n)) |
                              ((p_sink == Sink.L2) & meets_gemv(p_dst, n_out)))

        # --- descriptor fields --------------------------------------------------------------------------
        dv = data.View(DESCRIPTOR, desc.as_value())          # the words loaded, as `hdl.isa.DESCRIPTOR`
        d_woff, d_soff, d_rows, d_cols = dv.weight_offset, dv.scale_offset, dv.rows, dv.cols
        d_kind, d_layout, d_log2g, d_heads, d_head_dim = dv.kind, dv.layout, dv.log2_group, dv.heads, dv.head_dim

        # --- the sequencer ----------------------------------------------------------------------------
        word = Signal(64)
        pc = Signal(PC_BITS)
        next_pc = Signal(PC_BITS + 1)
        op = word[60:64]
        v = {o: data.View(layout(o), word) for o in Opcode}
        err_code = Signal(ErrorCode)
        busy = Signal()
        m.d.comb += [self.o_busy.eq(busy), self.o_error_code.eq(err_code)]

        # loop registers shared by the sequences
        cnt = Signal(32)          # segments / positions left
        h = Signal(16)            # head
        ptr_a, ptr_d = Signal(EA + 1), Signal(EA + 1)
        tmp = Signal(32)
        tmp2 = Signal(32)
        addr1 = Signal(A)
        alu_cnt = Signal(4)
        alu_sel = Signal(2)       # 0 add, 1 mul, 2 itof

        # ATTN state
        a_heads, a_hd, a_win = Signal(16), Signal(16), Signal(16)
        a_n = Signal(NB)
        a_r = Signal(32)          # ring slot of the current position
        a_t = Signal(NB)          # position index 0..n-1
        a_cap = Signal(32)

        def elem(word_addr):
            """The element address of an L2 word address (4 binary32 elements per 16-byte word)."""
            return Cat(Const(0, 2), word_addr)

        # range checks: an element range [e, e + n) inside L2, n > 0
        def in_l2(e, n):
            return (e + n) <= L2E

        from .decoder import Decoder
        m.submodules.decoder = decoder = Decoder(hw.l2_bytes // 16)
        m.d.comb += decoder.i_word.eq(self.i_insn.payload.word)

        def fail(code):
            m.d.sync += err_code.eq(code)
            m.next = "ERROR"

        def fail_async():
            """The engine's error, reported at the failed WGEMV's index."""
            m.d.sync += self.o_error_pc.eq(g_pc)
            fail(g_code)

        def retire():
            m.d.comb += self.o_retire.eq(1)
            m.next = "FETCH"

        def launch(nxt, **kw):
            """Set the pass fields (defaults for the rest) and go to `nxt` after the pass."""
            defaults = dict(op=SfuOp.COPY, bypass=0, a=Src.L2, b=BSrc.NONE, sink=Sink.L2, sub_emax=0,
                            recip_scale=0, accm=0, qlimit=0, qforce=0, qpack=0)
            defaults.update(kw)
            sigs = dict(op=p_op, bypass=p_bypass, n=p_n, a=p_a, a_addr=p_a_addr, a_val=p_a_val, b=p_b,
                        b_addr=p_b_addr, b_val=p_b_val, s=p_s, s_inv=p_s_inv, emax=p_emax, sub_emax=p_sub_emax,
                        recip_scale=p_recip_scale, accm=p_accm, sink=p_sink, dst=p_dst, ddr_addr=p_ddr_addr,
                        ddr_fmt=p_ddr_fmt, ddr_saddr=p_ddr_saddr, ddr_log2g=p_ddr_log2g, wr_addr=p_wr_addr,
                        wr_fmt=p_wr_fmt, qlimit=p_qlimit, qforce=p_qforce, qe=p_qe, qpack=p_qpack, psel=p_psel)
            for key, val in defaults.items():
                m.d.sync += Value.cast(sigs[key]).eq(Value.cast(val) if isinstance(val, enum.Enum) else val)
            m.d.sync += pstart_r.eq(1)
            m.next = nxt

        r_pend = Signal()             # ATTN's RECIP pass runs beside its V GEMVs (cleared when it is done)
        a_rz = Signal(32)             # ATTN: a head's sum, then recip(sum)
        with m.If(r_pend & pdone):
            m.d.sync += [a_rz.eq(p_result), r_pend.eq(0)]
        pstart_r = Signal()           # a launched pass starts once it has no hazard with the GEMV engine's rows
        with m.If(pstart):
            m.d.sync += pstart_r.eq(0)
        m.d.comb += pstart.eq(pstart_r & ~hazard)

        def sync(*stmts):
            m.d.sync += list(stmts)

        def wait_pass(state, nxt_fn):
            with m.State(state):
                with m.If(pdone):
                    with m.If(p_err):
                        fail(ErrorCode.BUS_ERROR)
                    with m.Else():
                        nxt_fn()

        def go(name):
            def f():
                m.next = name
            return f

        # ALU: one binary32 add or multiply (or int->float) with a fixed wait
        def alu(a_val, b_val, sel, nxt):
            m.d.sync += [alu_add.i_a.eq(a_val), alu_add.i_b.eq(b_val), alu_mul.i_a.eq(a_val),
                         alu_mul.i_b.eq(b_val), alu_itof.i_a.eq(a_val), alu_sel.eq(sel), alu_cnt.eq(8)]
            m.next = nxt

        alu_y = Signal(32)
        m.d.comb += alu_y.eq(Mux(alu_sel == 0, alu_add.o_y, Mux(alu_sel == 1, alu_mul.o_y, alu_itof.o_y)))
        m.d.comb += [alu_add.i_valid.eq(1), alu_mul.i_valid.eq(1), alu_itof.i_valid.eq(1)]

        base = {r: getattr(self, f"i_base_{r.name.lower()}") for r in REGIONS}

        start_while_busy = Signal()
        with m.If(self.i_ack):
            m.d.sync += [self.o_done.eq(0), self.o_error.eq(0)]
        with m.If(self.i_start & ~busy):
            m.d.sync += [busy.eq(1), self.o_done.eq(0), self.o_error.eq(0), err_code.eq(ErrorCode.NONE),
                         start_while_busy.eq(0)]
        with m.If(self.i_start & busy):
            m.d.sync += start_while_busy.eq(1)

        vec_op = Signal(SfuOp)
        with m.Switch(v[Opcode.VEC].func):
            for f in VecFunc:
                if f.name in ("ROPE", "RMSNORM", "RMSNORM_NG"):
                    continue
                with m.Case(f):
                    m.d.comb += vec_op.eq(SfuOp[f.name])
        d_index = Signal(16)
        with m.Switch(op):
            with m.Case(Opcode.WGEMV):
                m.d.comb += d_index.eq(v[Opcode.WGEMV].desc)
            with m.Case(Opcode.WGEMM):
                m.d.comb += d_index.eq(v[Opcode.WGEMM].desc)
            with m.Case(Opcode.GATHER):
                m.d.comb += d_index.eq(v[Opcode.GATHER].desc)
            with m.Case(Opcode.KVST):
                m.d.comb += d_index.eq(v[Opcode.KVST].slot)
            with m.Case(Opcode.ATTN):
                m.d.comb += d_index.eq(v[Opcode.ATTN].slot)
        m.d.comb += fmap_r.addr.eq(v[Opcode.ATTN].shape_ptr)

        with m.FSM(name="ctl"):
            with m.State("IDLE"):
                m.d.sync += next_pc.eq(0)
                with m.If(self.i_start):
                    m.next = "FETCH"

            with m.State("FETCH"):
                with m.If(next_pc >= self.i_prog_len):           # the program ended without HALT
                    m.d.sync += self.o_error_pc.eq(next_pc)
                    fail(ErrorCode.BAD_LENGTH)
                m.d.comb += [self.i_insn.ready.eq(1), self.o_unit_busy.issue_wait.eq(~self.i_insn.valid)]
                with m.If(self.i_insn.valid & (next_pc < self.i_prog_len)):
                    m.d.sync += next_pc.eq(self.i_insn.payload.pc + 1)
                    m.d.sync += [word.eq(self.i_insn.payload.word), pc.eq(self.i_insn.payload.pc),
                                 self.o_error_pc.eq(self.i_insn.payload.pc)]
                    with m.If(self.i_insn.payload.err):
                        fail(ErrorCode.BUS_ERROR)
                    with m.Elif(decoder.o_error != ErrorCode.NONE):
                        fail(decoder.o_error)
                    with m.Else():
                        m.next = "DISPATCH"
                with m.If(g_failed):                 # an async WGEMV failed: its error, at its pc
                    fail_async()

            with m.State("ERROR"):
                with m.If(~g_active & ~r_pend):  # an async WGEMV (or ATTN's RECIP pass) still running completes first
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
                        fail(ErrorCode.BAD_FUNCTION)
                    for o in (Opcode.CTRL, Opcode.MEMSET, Opcode.SCALAR, Opcode.VEC, Opcode.CVO, Opcode.DMA):
                        with m.Case(o):
                            m.next = o.name
                    with m.Case(Opcode.WGEMV, Opcode.WGEMM):
                        with m.If(~g_active):        # one matrix at a time (the engines share the weight ports)
                            with m.If(g_failed):     # the previous one failed: its error, at its pc
                                fail_async()
                            with m.Else():
                                m.next = "DESC"
                    with m.Case(Opcode.GATHER, Opcode.KVST, Opcode.ATTN):
                        m.next = "DESC"

            # ---- CTRL ------------------------------------------------------------------------------------
            c = v[Opcode.CTRL]
            with m.State("CTRL"):
                with m.Switch(c.func):
                    with m.Case(CtrlFunc.SETVL):
                        m.d.sync += vl.eq(c.imm)
                        retire()
                    with m.Case(CtrlFunc.SETHD):
                        m.d.sync += hd.eq(c.imm)
                        m.d.comb += [irecip.i_start.eq(1), irecip.i_n.eq(c.imm)]
                        m.next = "SETHD_W"
                    with m.Case(CtrlFunc.HALT, CtrlFunc.FENCE):
                        m.next = "DRAIN"
                    with m.Default():          # NOP
                        retire()
            with m.State("DRAIN"):             # FENCE, HALT: wait for an async WGEMV
                with m.If(~g_active):
                    with m.If(g_failed):
                        fail_async()
                    with m.Elif(c.func == CtrlFunc.HALT):
                        m.next = "HALT"
                    with m.Else():
                        retire()
            with m.State("SETHD_W"):
                with m.If(~irecip.o_busy):
                    m.d.sync += inv_hd.eq(irecip.o_y)
                    retire()

            # ---- MEMSET ----------------------------------------------------------------------------------
            ms = v[Opcode.MEMSET]
            with m.State("MEMSET"):
                with m.If(ms.cache == ShapeCache.SCALAR):
                    with m.If((ms.slot >= 8) | (ms.c != 0)):
                        fail(ErrorCode.BAD_FUNCTION)
                    with m.Else():
                        m.d.sync += sregs[ms.slot[:3]].eq(Cat(ms.b, ms.a))
                        retire()
                with m.Else():
                    with m.If(ms.cache == ShapeCache.FMAP):
                        m.d.comb += [fmap_w.en.eq(1), fmap_w.addr.eq(ms.slot), fmap_w.data.eq(Cat(ms.a, ms.b, ms.c))]
                    retire()

            # ---- SCALAR ----------------------------------------------------------------------------------
            sc = v[Opcode.SCALAR]
            sa, sb_ = sregs[sc.a], sregs[sc.b]
            with m.State("SCALAR"):
                with m.Switch(sc.func):
                    with m.Case(ScalarFunc.LI):
                        m.d.sync += sregs[sc.d].eq(sc.imm)
                        retire()
                    with m.Case(ScalarFunc.ADD):
                        alu(sa, sb_, 0, "SC_ALU")
                    with m.Case(ScalarFunc.SUB):
                        alu(sa, sb_ ^ 0x80000000, 0, "SC_ALU")
                    with m.Case(ScalarFunc.MUL):
                        alu(sa, sb_, 1, "SC_ALU")
                    with m.Case(ScalarFunc.MULI):
                        alu(sa, sc.imm, 1, "SC_ALU")
                    with m.Case(ScalarFunc.ADDI):
                        alu(sa, sc.imm, 0, "SC_ALU")
                    with m.Case(ScalarFunc.LDPOS):
                        alu(self.i_pos, 0, 2, "SC_ALU")
                    with m.Case(ScalarFunc.MAX):
                        m.d.sync += sregs[sc.d].eq(Mux(_f32_gt(sb_, sa), sb_, sa))
                        retire()
                    with m.Case(ScalarFunc.MAXI):
                        m.d.sync += sregs[sc.d].eq(Mux(_f32_gt(sc.imm, sa), sc.imm, sa))
                        retire()
                    for f in (ScalarFunc.RSQRT, ScalarFunc.SQRT, ScalarFunc.RECIP, ScalarFunc.TANH):
                        with m.Case(f):                # one element through the SFU
                            launch("SC_SFU", op=SfuOp[f.name], n=1, a=Src.REG, a_val=sa, sink=Sink.REG)
                    with m.Case(ScalarFunc.LD):
                        with m.If(sc.imm >= L2E):
                            fail(ErrorCode.ADDRESS_RANGE)
                        with m.Else():
                            launch("SC_SFU", bypass=1, n=1, a=Src.L2, a_addr=sc.imm, sink=Sink.REG)
                    with m.Case(ScalarFunc.ST):
                        with m.If(sc.imm >= L2E):
                            fail(ErrorCode.ADDRESS_RANGE)
                        with m.Else():
                            launch("SC_ST", bypass=1, n=1, a=Src.REG, a_val=sa, sink=Sink.L2, dst=sc.imm)
            with m.State("SC_ALU"):
                m.d.sync += alu_cnt.eq(alu_cnt - 1)
                with m.If(alu_cnt == 0):
                    m.d.sync += sregs[sc.d].eq(alu_y)
                    retire()
            wait_pass("SC_SFU", lambda: (sync(sregs[sc.d].eq(p_result)), retire()))
            wait_pass("SC_ST", retire)

            # ---- DMA -------------------------------------------------------------------------------------
            dm = v[Opcode.DMA]
            l2e = elem(dm.l2)
            with m.State("DMA"):
                region_base = Signal(64)
                with m.Switch(dm.region):
                    for r in REGIONS:
                        with m.Case(r):
                            m.d.comb += region_base.eq(base[r])
                ddr = (region_base + (dm.offset << 4))[:A]
                with m.If(dm.dir == DmaDir.L2_TO_L2):
                    fail(ErrorCode.BAD_FUNCTION)
                with m.Elif(vl == 0):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(~in_l2(l2e, vl)):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif(dm.dir == DmaDir.DDR_TO_L2):
                    with m.If((dm.region != DdrRegion.CONST) & (dm.region != DdrRegion.SCRATCH)):
                        fail(ErrorCode.BAD_FUNCTION)
                    with m.Else():
                        launch("RETIRE_PASS", bypass=1, n=vl, a=Src.DDR, ddr_addr=ddr, ddr_fmt=0, sink=Sink.L2,
                               dst=l2e)
                with m.Else():
                    with m.If((dm.region != DdrRegion.LOGITS) & (dm.region != DdrRegion.SCRATCH)):
                        fail(ErrorCode.BAD_FUNCTION)
                    with m.Else():
                        launch("RETIRE_PASS", bypass=1, n=vl, a=Src.L2, a_addr=l2e, sink=Sink.DDR, wr_addr=ddr,
                               wr_fmt=0)
            wait_pass("RETIRE_PASS", retire)

            # ---- VEC -------------------------------------------------------------------------------------
            ve = v[Opcode.VEC]
            va, vb, vd = elem(ve.a), elem(ve.b), elem(ve.dst)
            two_operand = Cat(*[ve.func == f for f in (VecFunc.ADD, VecFunc.SUB, VecFunc.MUL, VecFunc.FMAS,
                                                       VecFunc.GELU_MUL, VecFunc.DOT)]).any()
            to_scalar = Cat(*[ve.func == f for f in VEC_REDUCTIONS]).any()
            segmented = Cat(*[ve.func == f for f in (VecFunc.RMSNORM, VecFunc.RMSNORM_NG, VecFunc.ROPE)]).any()
            with m.State("VEC"):
                with m.If(vl == 0):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(~in_l2(va, vl)):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif(two_operand & ~in_l2(vb, vl)):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif(segmented):
                    m.d.comb += [div.i_start.eq(1), div.i_num.eq(vl), div.i_den.eq(hd)]
                    m.next = "VSEG_DIV"
                with m.Elif(to_scalar):
                    launch("VEC_SCALAR", op=vec_op, n=vl, a=Src.L2, a_addr=va, b=Mux(two_operand, BSrc.L2, BSrc.NONE),
                           b_addr=vb, s=sregs[ve.s], sink=Sink.REG)
                with m.Elif(~in_l2(vd, vl)):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Else():
                    launch("RETIRE_PASS", op=vec_op, n=vl, a=Src.L2, a_addr=va,
                           b=Mux(two_operand, BSrc.L2, BSrc.NONE), b_addr=vb, s=sregs[ve.s], sink=Sink.L2, dst=vd)
            wait_pass("VEC_SCALAR", lambda: (sync(sregs[ve.s].eq(p_result)), retire()))

            half = hd[1:]
            with m.State("VSEG_DIV"):
                with m.If(~div.o_busy):
                    with m.If((hd == 0) | (div.o_r != 0)):
                        fail(ErrorCode.BAD_LENGTH)
                    with m.Elif((ve.func == VecFunc.ROPE) & (hd[0] | ((hd << 1) > SCR))):
                        fail(ErrorCode.BAD_LENGTH)
                    with m.Elif((ve.func != VecFunc.RMSNORM_NG) & ~in_l2(vb, hd)):
                        fail(ErrorCode.ADDRESS_RANGE)
                    with m.Elif(~in_l2(vd, vl)):
                        fail(ErrorCode.ADDRESS_RANGE)
                    with m.Else():
                        m.d.sync += [cnt.eq(div.o_q), ptr_a.eq(va), ptr_d.eq(vd)]
                        with m.If(ve.func == VecFunc.ROPE):
                            m.next = "ROPE_0"
                        with m.Else():
                            m.next = "RMS_0"

            # RMSNORM per segment
            with m.State("RMS_0"):
                with m.If(cnt == 0):
                    retire()
                with m.Else():
                    launch("RMS_1", op=SfuOp.SUMSQ, n=hd, a=Src.L2, a_addr=ptr_a, sink=Sink.REG)
            wait_pass("RMS_1", lambda: alu(p_result, inv_hd, 1, "RMS_2"))
            with m.State("RMS_2"):
                m.d.sync += alu_cnt.eq(alu_cnt - 1)
                with m.If(alu_cnt == 0):
                    alu(alu_y, sregs[ve.s], 0, "RMS_3")
            with m.State("RMS_3"):
                m.d.sync += alu_cnt.eq(alu_cnt - 1)
                with m.If(alu_cnt == 0):
                    launch("RMS_4", op=SfuOp.RSQRT, n=1, a=Src.REG, a_val=alu_y, sink=Sink.REG)
            # x * rsqrt, and with the gain (x * rsqrt) * g: one pass on the SFU's short path
            gained = ve.func == VecFunc.RMSNORM
            wait_pass("RMS_4", lambda: launch("RMS_5", op=Mux(gained, SfuOp.MULS_MUL, SfuOp.MULS), n=hd, a=Src.L2,
                                              a_addr=ptr_a, b=Mux(gained, BSrc.L2, BSrc.NONE), b_addr=vb,
                                              s=p_result, sink=Sink.L2, dst=ptr_d))
            wait_pass("RMS_5", lambda: (sync([cnt.eq(cnt - 1), ptr_a.eq(ptr_a + hd),
                                                            ptr_d.eq(ptr_d + hd)]), go("RMS_0")()))

            # ROPE per head: t0 = x1*cos, t1 = x2*sin, t2 = x2*cos, t3 = x1*sin; d1 = t0 - t1; d2 = t2 + t3
            x1, x2 = ptr_a, ptr_a + half
            cos_, sin_ = vb, vb + half
            t = [SB + 0, SB + half, SB + 2 * half, SB + 3 * half]
            steps = [("ROPE_1", SfuOp.MUL, x1, cos_, t[0]), ("ROPE_2", SfuOp.MUL, x2, sin_, t[1]),
                     ("ROPE_3", SfuOp.MUL, x2, cos_, t[2]), ("ROPE_4", SfuOp.MUL, x1, sin_, t[3]),
                     ("ROPE_5", SfuOp.SUB, t[0], t[1], ptr_d), ("ROPE_6", SfuOp.ADD, t[2], t[3], ptr_d + half)]
            with m.State("ROPE_0"):
                with m.If(cnt == 0):
                    retire()
                with m.Else():
                    _, o, a_, b_, d_ = steps[0]
                    launch("ROPE_1", op=o, n=half, a=Src.L2, a_addr=a_, b=BSrc.L2, b_addr=b_, sink=Sink.L2, dst=d_)
            for i, (state, *_rest) in enumerate(steps):
                if i + 1 < len(steps):
                    _, o, a_, b_, d_ = steps[i + 1]
                    wait_pass(state, lambda o=o, a_=a_, b_=b_, d_=d_, nxt=steps[i + 1][0]: launch(
                        nxt, op=o, n=half, a=Src.L2, a_addr=a_, b=BSrc.L2, b_addr=b_, sink=Sink.L2, dst=d_))
                else:
                    wait_pass(state, lambda: (sync([cnt.eq(cnt - 1), ptr_a.eq(ptr_a + hd),
                                                                 ptr_d.eq(ptr_d + hd)]), go("ROPE_0")()))

            # ---- CVO -------------------------------------------------------------------------------------
            cv = v[Opcode.CVO]
            cs, cd = elem(cv.src), elem(cv.dst)
            rope_f = (cv.func == CvoFunc.ROPE_COS) | (cv.func == CvoFunc.ROPE_SIN)
            red_f = (cv.func == CvoFunc.REDUCE_SUM) | (cv.func == CvoFunc.REDUCE_MAX)
            staged = cv.accm & (rope_f | red_f)
            cvo_n = cv.length
            need_recip = (cv.func == CvoFunc.SOFTCAP) | ((cv.func == CvoFunc.SCALE) & cv.recip_scale)
            with m.State("CVO"):
                with m.If(staged & (cvo_n > SCR)):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(cvo_n == 0):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(~in_l2(cs, Mux(rope_f, cvo_n << 1, cvo_n))):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif(~in_l2(cd, Mux(red_f, 1, cvo_n))):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif(need_recip):
                    launch("CVO_R", op=SfuOp.RECIP, n=1, a=Src.REG, a_val=sregs[0], sink=Sink.REG)
                with m.Else():
                    m.next = "CVO_MAIN"
            wait_pass("CVO_R", go("CVO_MAIN"))
            with m.State("CVO_MAIN"):
                elementwise_accm = cv.accm & ~staged
                launch("CVO_ACC", op=cv.func.as_value(), n=cvo_n, a=Mux(rope_f, Src.PAIRS, Src.L2), a_addr=cs,
                       b=Mux(elementwise_accm, BSrc.L2, BSrc.NONE), b_addr=cd, s=sregs[0], s_inv=p_result,
                       emax=emax, sub_emax=cv.sub_emax, recip_scale=cv.recip_scale, accm=elementwise_accm,
                       sink=Sink.L2, dst=Mux(staged, SB, cd))
            wait_pass("CVO_ACC", lambda: self._cvo_acc(m, staged, launch, retire, red_f, cvo_n, cd, SB))

            # ---- descriptor load (WGEMV, GATHER, KVST, ATTN) -----------------------------------------
            with m.State("DESC"):
                with m.If(d_index >= self.i_desc_count):
                    fail(ErrorCode.BAD_DESCRIPTOR)
                with m.Else():
                    launch("DESC_W", bypass=1, n=DESC_WORDS, a=Src.DDR,
                           ddr_addr=(base[DdrRegion.DESC] + d_index * DESC_BYTES)[:A],
                           ddr_fmt=0, sink=Sink.DESC)

            def after_desc():
                with m.Switch(op):
                    with m.Case(Opcode.WGEMV):
                        m.next = "WG"
                    with m.Case(Opcode.WGEMM):
                        m.next = "WM"
                    with m.Case(Opcode.GATHER):
                        m.next = "GA"
                    with m.Case(Opcode.KVST):
                        m.next = "KV"
                    with m.Default():
                        m.next = "AT"
            wait_pass("DESC_W", after_desc)

            # ---- WGEMV -----------------------------------------------------------------------------------
            def gemv_start(wbase, sbase, rows, cols, log2g, accm, sparse, lo, n):
                """Hand the GEMV engine its command (the quantiser holds the activations): `rows` x `cols` from
                DDR `wbase`/`sbase` into L2 elements [lo, lo + n), accumulating with `accm`."""
                m.d.sync += [g_cmd.wbase.eq(wbase), g_cmd.sbase.eq(sbase), g_cmd.rows.eq(rows), g_cmd.cols.eq(cols),
                             g_cmd.log2_group.eq(log2g), g_cmd.accm.eq(accm), g_cmd.sparse.eq(sparse),
                             g_active.eq(1), g_is_gemm.eq(0), g_lo.eq(lo), g_n.eq(n), g_pc.eq(pc),
                             g_pend.gemv.eq(1), g_pend.wr.eq(1), g_pend.rd.eq(accm)]

            wg = v[Opcode.WGEMV]
            ws, wd = elem(wg.src), elem(wg.dst)

            def wg_run():
                """The engine has its activations (a quantiser pass, or `reuse`): start it; an async WGEMV
                retires now, the others when the engine is done."""
                wb = base[DdrRegion.WEIGHTS]
                gemv_start((wb + d_woff)[:A], (wb + d_soff)[:A], d_rows, d_cols, d_log2g, wg.accm, wg.sparse, wd,
                           d_rows)
                with m.If(wg.async_ & ~wg.findemax):
                    retire()
                with m.Else():
                    m.next = "WG_G"

            with m.State("WG"):
                with m.If(d_kind != DescKind.INT4):
                    fail(ErrorCode.BAD_DESCRIPTOR)
                with m.Elif(d_cols == 0):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(~in_l2(ws, d_cols)):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif(wg.sparse != (d_layout == 1)):
                    fail(ErrorCode.BAD_DESCRIPTOR)
                with m.Elif((d_cols > hw.gemv_max_cols) | (wg.sparse & ((d_rows > hw.gemv_sparse_max_rows) |
                                                                        d_rows[0]))):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(d_rows == 0):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(~in_l2(wd, d_rows)):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif(wg.reuse & (d_cols != act_n)):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(wg.reuse):
                    wg_run()
                with m.Else():
                    m.d.sync += [q_gemm.eq(0), act_n.eq(d_cols)]
                    launch("WG_Q", bypass=1, n=d_cols, a=Src.L2, a_addr=ws, sink=Sink.QUANT)

            with m.State("WG_Q"):
                with m.If(pdone):
                    with m.If(quant.o_nonfinite):
                        fail(ErrorCode.NON_FINITE)
                    with m.Else():
                        wg_run()
            with m.State("WG_G"):
                with m.If(~g_active):
                    with m.If(g_failed):
                        fail(g_code)
                    with m.Elif(wg.findemax):
                        launch("WG_E", op=SfuOp.REDUCE_MAX, n=d_rows, a=Src.L2, a_addr=wd, sink=Sink.REG)
                    with m.Else():
                        retire()
            wait_pass("WG_E", lambda: (sync(emax.eq(p_result)), retire()))

            # ---- WGEMM: token tiles of R tokens, one after another ----------------------------------------
            # Per tile: a quantiser pass per token into the GEMM unit's slot t, then the unit's command (the
            # engine slot of "Overlap", like a WGEMV's); the next tile waits for it. The last tile retires at
            # once with async_, else when its last row is in L2.
            wm = v[Opcode.WGEMM]
            R = hw.systolic_rows
            in_str, out_str = Signal(NB + 2), Signal(34)      # elements between tokens (16-byte rows)
            wm_left = Signal(9)                               # tokens not yet in a tile
            wm_t = Signal(range(R + 1))                       # the token being quantised, in its tile
            wm_n = Signal(range(R + 1))                       # tokens in this tile
            with m.State("WM"):
                with m.If((d_kind != DescKind.INT4) | (d_layout != 0) | (d_log2g != (hw.weight_group.bit_length() - 1))):
                    fail(ErrorCode.BAD_DESCRIPTOR)
                with m.Elif((wm.tokens == 0) | (d_cols > hw.gemv_max_cols) | (d_cols == 0)):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Else():
                    m.d.sync += [in_str.eq((d_cols + 3) & ~3), out_str.eq((d_rows + 3) & ~3)]
                    m.next = "WM_1"
            with m.State("WM_1"):
                with m.If(elem(wm.src) + (wm.tokens - 1) * in_str + d_cols > L2E):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif(d_rows == 0):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(elem(wm.dst) + (wm.tokens - 1) * out_str + d_rows > L2E):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Else():
                    m.d.sync += [q_gemm.eq(1), ptr_a.eq(elem(wm.src)), ptr_d.eq(elem(wm.dst)), wm_left.eq(wm.tokens)]
                    m.next = "WM_T"
            with m.State("WM_T"):                             # a tile starts
                m.d.sync += [wm_t.eq(0), q_tok.eq(0), wm_n.eq(Mux(wm_left > R, R, wm_left))]
                m.next = "WM_Q"
            with m.State("WM_Q"):
                launch("WM_QW", bypass=1, n=d_cols, a=Src.L2, a_addr=ptr_a, sink=Sink.QUANT)
            with m.State("WM_QW"):
                with m.If(pdone):
                    with m.If(quant.o_nonfinite):
                        fail(ErrorCode.NON_FINITE)
                    with m.Elif(wm_t + 1 != wm_n):
                        m.d.sync += [wm_t.eq(wm_t + 1), q_tok.eq(wm_t + 1), ptr_a.eq(ptr_a + in_str)]
                        m.next = "WM_Q"
                    with m.Else():
                        wb = base[DdrRegion.WEIGHTS]
                        m.d.sync += [gm_cmd.wbase.eq((wb + d_woff)[:A]), gm_cmd.sbase.eq((wb + d_soff)[:A]),
                                     gm_cmd.rows.eq(d_rows), gm_cmd.cols.eq(d_cols), gm_cmd.ntok.eq(wm_n),
                                     gm_cmd.dst.eq(ptr_d), gm_cmd.stride.eq(out_str), gm_cmd.accm.eq(wm.accm),
                                     g_active.eq(1), g_is_gemm.eq(1), g_lo.eq(ptr_d),
                                     g_n.eq((wm_n - 1) * out_str + d_rows), g_pc.eq(pc), g_pend.gemm.eq(1),
                                     ptr_a.eq(ptr_a + in_str), ptr_d.eq(ptr_d + out_str * R),
                                     wm_left.eq(wm_left - wm_n)]
                        with m.If(wm_left == wm_n):
                            with m.If(wm.async_):
                                retire()
                            with m.Else():
                                m.next = "WM_G"
                        with m.Else():
                            m.next = "WM_G"
            with m.State("WM_G"):                             # wait for the tile; then the next one, or retire
                with m.If(~g_active & ~g_pend.gemm):
                    with m.If(g_failed):
                        fail(g_code)
                    with m.Elif(wm_left == 0):
                        retire()
                    with m.Else():
                        m.next = "WM_T"

            # ---- GATHER ----------------------------------------------------------------------------------
            ga = v[Opcode.GATHER]
            gd = elem(ga.dst)
            row = Signal(32)
            with m.State("GA"):
                with m.If((d_kind != DescKind.INT4) | (d_layout != 0)):
                    fail(ErrorCode.BAD_DESCRIPTOR)
                with m.Elif((self.i_token >= d_rows) & ~ga.remap):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Elif((d_cols == 0)):
                    fail(ErrorCode.BAD_LENGTH)
                with m.Elif(~in_l2(gd, d_cols)):
                    fail(ErrorCode.ADDRESS_RANGE)
                with m.Else():
                    m.d.sync += row.eq(Mux(self.i_token >= d_rows, 0, self.i_token))
                    m.next = "GA_1"
            with m.State("GA_1"):
                ngroups = (d_cols + (1 << d_log2g) - 1) >> d_log2g
                m.d.sync += [tmp.eq(row * ((d_cols + 1) >> 1)), tmp2.eq(row * ngroups)]
                m.next = "GA_2"
            with m.State("GA_2"):
                wb = base[DdrRegion.WEIGHTS]
                launch("RETIRE_PASS", bypass=1, n=d_cols, a=Src.DDR, ddr_fmt=2,
                       ddr_addr=(wb + d_woff + tmp)[:A], ddr_saddr=(wb + d_soff + (tmp2 << 1))[:A],
                       ddr_log2g=d_log2g, sink=Sink.L2, dst=gd)

            kv = v[Opcode.KVST]
            kk, kvv = elem(kv.k), elem(kv.v)

            def kvst_checks(fmt, bad_length):
                """KVST's first state: the slot (its format), its lengths and the L2 ranges; then the ring slot
                POS mod capacity in the divider."""
                with m.State("KV"):
                    with m.If((d_kind != DescKind.KV) | (d_layout != fmt)):
                        fail(ErrorCode.BAD_DESCRIPTOR)
                    with m.Elif(bad_length | (d_cols == 0) | (d_rows == 0)):
                        fail(ErrorCode.BAD_LENGTH)
                    with m.Elif(~in_l2(kk, d_cols) | ~in_l2(kvv, d_cols)):
                        fail(ErrorCode.ADDRESS_RANGE)
                    with m.Else():
                        m.d.comb += [div.i_start.eq(1), div.i_num.eq(self.i_pos), div.i_den.eq(d_rows)]
                        m.next = "KV_1"

            at = v[Opcode.ATTN]
            aq, ad = elem(at.q), elem(at.dst)
            f_heads, f_hd, f_win = fmap_r.data[0:16], fmap_r.data[16:32], fmap_r.data[32:48]

            def attn_checks(fmt, bad_length, narrow_ring, uses_engine):
                """ATTN's first state: the slot (its format), the head shape against the FMAP entry, the window
                (beyond the ring: ADDRESS_RANGE; narrower than the ring with `narrow_ring`: BAD_LENGTH); the
                positions seen into `a_n`. With `uses_engine` it first waits for an async WGEMV to finish."""
                checks = [(g_active, lambda: None), (g_failed, fail_async)] if uses_engine else []
                checks += [
                    ((d_kind != DescKind.KV) | (d_layout != fmt), lambda: fail(ErrorCode.BAD_DESCRIPTOR)),
                    (bad_length | (f_hd != d_head_dim) | (at.kv_head >= d_heads) | (f_heads == 0),
                     lambda: fail(ErrorCode.BAD_LENGTH)),
                    (((f_win == 0) | (f_win > d_rows)) & (self.i_pos >= d_rows), lambda: fail(ErrorCode.ADDRESS_RANGE))]
                if narrow_ring:
                    checks.append(((f_win != 0) & (f_win < d_rows), lambda: fail(ErrorCode.BAD_LENGTH)))
                with m.State("AT"):
                    m.d.sync += [a_heads.eq(f_heads), a_hd.eq(f_hd), a_win.eq(f_win), a_cap.eq(d_rows)]
                    for k, (cond, act) in enumerate(checks):
                        with (m.Elif if k else m.If)(cond):
                            act()
                    with m.Else():
                        seen = Mux((f_win == 0) | (self.i_pos + 1 <= f_win), self.i_pos + 1, f_win)
                        m.d.sync += a_n.eq(seen)
                        if uses_engine:
                            m.d.sync += act_n.eq(0)      # its GEMVs quantise into the engine (WGEMV reuse)
                        m.next = "AT_1"

            if not int8_kv:
                # ---- KVST ------------------------------------------------------------------------------------
                kvst_checks(0, 0)
                with m.State("KV_1"):
                    with m.If(~div.o_busy):
                        m.d.sync += [tmp.eq(div.o_r * d_cols), tmp2.eq((d_rows + div.o_r) * d_cols)]
                        m.next = "KV_2"
                kvb = base[DdrRegion.KV] + d_woff
                with m.State("KV_2"):
                    launch("KV_3", bypass=1, n=d_cols, a=Src.L2, a_addr=kk, sink=Sink.DDR,
                           wr_addr=(kvb + (tmp << 1))[:A], wr_fmt=1)
                wait_pass("KV_3", lambda: launch("RETIRE_PASS", bypass=1, n=d_cols, a=Src.L2, a_addr=kvv, sink=Sink.DDR,
                                                 wr_addr=(kvb + (tmp2 << 1))[:A], wr_fmt=1))

                # ---- ATTN ------------------------------------------------------------------------------------
                attn_checks(0, 0, 0, uses_engine=False)
                with m.State("AT_1"):
                    with m.If(a_heads * a_n + a_hd > SCR):
                        fail(ErrorCode.BAD_LENGTH)
                    with m.Elif(~in_l2(aq, a_heads * a_hd) | ~in_l2(ad, a_heads * a_hd)):
                        fail(ErrorCode.ADDRESS_RANGE)
                    with m.Else():
                        m.d.comb += [div.i_start.eq(1), div.i_num.eq(self.i_pos + 1 - a_n), div.i_den.eq(a_cap)]
                        m.next = "AT_2"
                kv_row = Signal(A)        # DDR address of the current position's K row (V: + capacity rows)
                row_bytes = d_cols << 1
                with m.State("AT_2"):
                    with m.If(~div.o_busy):
                        m.d.sync += [a_r.eq(div.o_r), a_t.eq(0), tmp.eq(div.o_r * d_cols)]
                        m.next = "AT_3"
                with m.State("AT_3"):
                    first_row = (base[DdrRegion.KV] + d_woff + (tmp << 1) + ((at.kv_head * a_hd) << 1))[:A]
                    m.d.sync += [kv_row.eq(first_row), addr1.eq(first_row)]   # addr1: phase 3 starts there again
                    m.next = "AT_K"

                sc_base = SB + a_hd                     # scores: [heads][n] after the K/V row
                # phase 1: per position, the K row, then a DOT per head into scores[h][t]
                with m.State("AT_K"):
                    with m.If(a_t == a_n):
                        m.d.sync += h.eq(0)
                        m.next = "AT_SM"
                    with m.Else():
                        m.d.sync += h.eq(0)
                        launch("AT_KD", bypass=1, n=a_hd, a=Src.DDR, ddr_addr=kv_row, ddr_fmt=1, sink=Sink.L2, dst=SB)
                wait_pass("AT_KD", go("AT_DOT"))
                def next_position(state):
                    """Advance to the next visible position: ring slot + 1 (wrapping to slot 0), its K row."""
                    with m.If(a_r + 1 == a_cap):
                        kv_head_row = base[DdrRegion.KV] + d_woff + ((at.kv_head * a_hd) << 1)
                        m.d.sync += [a_r.eq(0), kv_row.eq(kv_head_row[:A])]
                    with m.Else():
                        m.d.sync += [a_r.eq(a_r + 1), kv_row.eq(kv_row + row_bytes)]
                    m.d.sync += a_t.eq(a_t + 1)
                    m.next = state

                with m.State("AT_DOT"):
                    with m.If(h == a_heads):
                        next_position("AT_K")
                    with m.Else():
                        launch("AT_DOTW", op=SfuOp.DOT, n=a_hd, a=Src.L2, a_addr=aq + h * a_hd, b=BSrc.L2, b_addr=SB,
                               sink=Sink.L2, dst=sc_base + h * a_n + a_t)
                wait_pass("AT_DOTW", lambda: (sync(h.eq(h + 1)), go("AT_DOT")()))
                # phase 2: softmax per head
                srow = sc_base + h * a_n
                with m.State("AT_SM"):
                    with m.If(h == a_heads):
                        m.d.sync += [a_t.eq(0), kv_row.eq(addr1)]
                        m.d.comb += [div.i_start.eq(1), div.i_num.eq(self.i_pos + 1 - a_n), div.i_den.eq(a_cap)]
                        m.next = "AT_V0"
                    with m.Else():
                        launch("AT_SM1", op=SfuOp.MAX, n=a_n, a=Src.L2, a_addr=srow, sink=Sink.REG)
                wait_pass("AT_SM1", lambda: launch("AT_SM2", op=SfuOp.EXP, n=a_n, a=Src.L2, a_addr=srow, emax=p_result,
                                                   sub_emax=1, sink=Sink.L2, dst=srow))
                wait_pass("AT_SM2", lambda: launch("AT_SM3", op=SfuOp.SUM, n=a_n, a=Src.L2, a_addr=srow, sink=Sink.REG))
                wait_pass("AT_SM3", lambda: launch("AT_SM4", op=SfuOp.RECIP, n=1, a=Src.REG, a_val=p_result,
                                                   sink=Sink.REG))
                wait_pass("AT_SM4", lambda: launch("AT_SM5", op=SfuOp.MULS, n=a_n, a=Src.L2, a_addr=srow, s=p_result,
                                                   sink=Sink.L2, dst=srow))
                wait_pass("AT_SM5", lambda: (sync(h.eq(h + 1)), go("AT_SM")()))
                # phase 3: per position, the V row, then per head dst += p * V
                with m.State("AT_V0"):
                    with m.If(~div.o_busy):
                        m.d.sync += a_r.eq(div.o_r)
                        m.next = "AT_V"
                with m.State("AT_V"):
                    with m.If(a_t == a_n):
                        retire()
                    with m.Else():
                        m.d.sync += h.eq(0)
                        v_row = (kv_row + a_cap * row_bytes)[:A]
                        launch("AT_VD", bypass=1, n=a_hd, a=Src.DDR, ddr_addr=v_row, ddr_fmt=1,
                               sink=Sink.L2, dst=SB)
                wait_pass("AT_VD", go("AT_P"))
                with m.State("AT_P"):
                    with m.If(h == a_heads):
                        next_position("AT_V")
                    with m.Else():
                        launch("AT_PW", bypass=1, n=1, a=Src.L2, a_addr=sc_base + h * a_n + a_t, sink=Sink.REG)
                with m.State("AT_PW"):
                    with m.If(pdone):
                        dsth = ad + h * a_hd
                        with m.If(a_t == 0):
                            launch("AT_PV", op=SfuOp.MULS, n=a_hd, a=Src.L2, a_addr=SB, s=p_result, sink=Sink.L2,
                                   dst=dsth)
                        with m.Else():
                            launch("AT_PV", op=SfuOp.FMAS, n=a_hd, a=Src.L2, a_addr=SB, s=p_result, b=BSrc.L2,
                                   b_addr=dsth, sink=Sink.L2, dst=dsth)
                wait_pass("AT_PV", lambda: (sync(h.eq(h + 1)), go("AT_P")()))
            else:
                # ---- INT8 KV cache (docs/numerics.md "KV cache", sim.numerics.KvInt8Layout) ----------------
                # Slot layout: per head j, the planes K_hi, K_lo, V_hi, V_lo of C·D/2 bytes (kb), then per head
                # the K scales hi/lo of C·nb binary16 (ksb), then per head the V scales of C binary16 (vsb).
                MAXHD = hw.kv_max_head_dim
                LB = ceil_log2(hw.act_block)
                MAXC = hw.gemv_max_cols
                # The slot's sizes, from the descriptor (stable from KVST's and ATTN's first state on), one product
                # each for both instructions: C·D/2 and C·nb·2 bytes per head, then times the heads (two cycles
                # later; both instructions read them no earlier).
                kv8_plane, kv8_ks, kv8_planes, kv8_kss = Signal(32), Signal(32), Signal(32), Signal(32)
                kb, ksb, vsb = Signal(A), Signal(A), Signal(A)
                rowoff, srow = Signal(32), Signal(32)          # KVST: the ring slot's row in a plane / K scales
                j8 = Signal(8)                                  # KVST: head
                hb = Signal(16)                                 # KVST: element offset of head j in k and v
                nb = (d_head_dim + hw.act_block - 1) >> LB
                slot_base = (base[DdrRegion.KV] + d_woff)[:A]
                bad_hd = (d_head_dim[0:3] != 0) | (d_head_dim == 0) | (d_head_dim > MAXHD)
                m.d.sync += [kv8_plane.eq((d_rows * d_head_dim) >> 1), kv8_ks.eq((d_rows * nb) << 1),
                             kv8_planes.eq(d_heads * kv8_plane), kv8_kss.eq(d_heads * kv8_ks)]

                # ---- KVST: per head, K (one quantiser pass), V (its row exponent, then the values) ----------
                kvst_checks(1, bad_hd | (d_heads == 0))
                with m.State("KV_1"):
                    with m.If(~div.o_busy):
                        m.d.sync += [rowoff.eq((div.o_r * d_head_dim) >> 1), srow.eq((div.o_r * nb) << 1),
                                     tmp2.eq(div.o_r)]
                        m.next = "KV_2"
                with m.State("KV_2"):
                    m.d.sync += [tmp.eq(kv8_planes), addr1.eq(kv8_kss)]
                    m.next = "KV_3"
                with m.State("KV_3"):
                    m.d.sync += [kb.eq(slot_base), ksb.eq(slot_base + (tmp << 2)),
                                 vsb.eq(slot_base + (tmp << 2) + (addr1 << 1) + (tmp2 << 1)), j8.eq(0), hb.eq(0)]
                    m.next = "KV_K"
                with m.State("KV_K"):
                    with m.If(j8 == d_heads):
                        retire()
                    with m.Else():
                        m.d.comb += packer.i_clear.eq(1)
                        launch("KV_KQ", bypass=1, n=d_head_dim, a=Src.L2, a_addr=kk + hb, sink=Sink.QUANT,
                               qlimit=1, qpack=1)
                with m.State("KV_KQ"):
                    with m.If(pdone):
                        with m.If(quant.o_nonfinite | (packer.o_emax > 11)):     # 2**(e+4) beyond binary16
                            fail(ErrorCode.NON_FINITE)
                        with m.Else():
                            launch("KV_K1", bypass=1, n=d_head_dim >> 3, a=Src.PACK, psel=0, sink=Sink.DDR,
                                   wr_addr=(kb + rowoff)[:A], wr_fmt=0)
                wait_pass("KV_K1", lambda: launch("KV_K2", bypass=1, n=d_head_dim >> 3, a=Src.PACK, psel=1,
                                                  sink=Sink.DDR, wr_addr=(kb + kv8_plane + rowoff)[:A], wr_fmt=0))
                wait_pass("KV_K2", lambda: launch("KV_K3", bypass=1, n=nb, a=Src.PACK, psel=2, sink=Sink.DDR,
                                                  wr_addr=(ksb + srow)[:A], wr_fmt=1))
                wait_pass("KV_K3", lambda: launch("KV_K4", bypass=1, n=nb, a=Src.PACK, psel=3, sink=Sink.DDR,
                                                  wr_addr=(ksb + kv8_ks + srow)[:A], wr_fmt=1))
                with m.State("KV_K4"):
                    with m.If(pdone):
                        with m.If(p_err):
                            fail(ErrorCode.BUS_ERROR)
                        with m.Else():
                            m.d.comb += packer.i_clear.eq(1)
                            launch("KV_VA", bypass=1, n=d_head_dim, a=Src.L2, a_addr=kvv + hb, sink=Sink.QUANT,
                                   qlimit=1, qpack=1)
                with m.State("KV_VA"):
                    with m.If(pdone):
                        with m.If(quant.o_nonfinite | (packer.o_emax > 15)):     # 2**e beyond binary16
                            fail(ErrorCode.NON_FINITE)
                        with m.Else():
                            launch("KV_VB", bypass=1, n=d_head_dim, a=Src.L2, a_addr=kvv + hb, sink=Sink.QUANT,
                                   qlimit=1, qforce=1, qe=packer.o_emax, qpack=1)
                wait_pass("KV_VB", lambda: launch("KV_V1", bypass=1, n=d_head_dim >> 3, a=Src.PACK, psel=0,
                                                  sink=Sink.DDR, wr_addr=(kb + (kv8_plane << 1) + rowoff)[:A],
                                                  wr_fmt=0))
                wait_pass("KV_V1", lambda: launch("KV_V2", bypass=1, n=d_head_dim >> 3, a=Src.PACK, psel=1,
                                                  sink=Sink.DDR,
                                                  wr_addr=(kb + (kv8_plane << 1) + kv8_plane + rowoff)[:A],
                                                  wr_fmt=0))
                wait_pass("KV_V2", lambda: launch("KV_V3", bypass=1, n=1, a=Src.REG, a_val=packer.o_vscale,
                                                  sink=Sink.DDR, wr_addr=vsb, wr_fmt=1))
                wait_pass("KV_V3", lambda: (sync(j8.eq(j8 + 1), hb.eq(hb + d_head_dim), kb.eq(kb + (kv8_plane << 2)),
                                                 ksb.eq(ksb + (kv8_ks << 1)), vsb.eq(vsb + (d_rows << 1))),
                                            go("KV_K")()))

                # ---- ATTN: per head, scores = two GEMVs over the K planes, softmax on the SFU, the V row scales
                # folded into the weights, out = two sparse GEMVs over the V planes per chunk, times recip(sum)
                c0, clen = Signal(NB), Signal(NB)
                vtab = (base[DdrRegion.WEIGHTS] + d_soff)[:A]
                dsth = Signal(EA)
                m.d.comb += dsth.eq(ad + h * a_hd)
                # the engine runs its GEMVs: an async WGEMV must finish first; a sliding ring is the window
                attn_checks(1, bad_hd, 1, uses_engine=True)
                with m.State("AT_1"):
                    with m.If(a_n > SCR):
                        fail(ErrorCode.BAD_LENGTH)
                    with m.Elif(~in_l2(aq, a_heads * a_hd) | ~in_l2(ad, a_heads * a_hd)):
                        fail(ErrorCode.ADDRESS_RANGE)
                    with m.Else():
                        m.next = "AT_2"
                with m.State("AT_2"):
                    m.d.sync += [tmp.eq(at.kv_head * kv8_plane), tmp2.eq(kv8_planes), addr1.eq(at.kv_head * kv8_ks)]
                    m.next = "AT_3"
                with m.State("AT_3"):
                    m.d.sync += [kb.eq(slot_base + (tmp << 2)), ksb.eq(slot_base + (tmp2 << 2) + (addr1 << 1)),
                                 tmp.eq(kv8_kss), rowoff.eq((at.kv_head * d_rows) << 1)]
                    m.next = "AT_4"
                with m.State("AT_4"):
                    m.d.sync += [vsb.eq(slot_base + (tmp2 << 2) + (tmp << 1) + rowoff), h.eq(0)]
                    m.next = "AT_H"

                def engine(nxt, *args):
                    gemv_start(*args)
                    m.next = nxt

                def after_engine(state, nxt_fn):
                    with m.State(state):
                        with m.If(~g_active):
                            with m.If(g_failed):
                                fail(g_code)
                            with m.Else():
                                nxt_fn()

                with m.State("AT_H"):
                    with m.If(h == a_heads):
                        retire()
                    with m.Else():
                        m.d.sync += q_gemm.eq(0)
                        launch("AT_Q", bypass=1, n=a_hd, a=Src.L2, a_addr=aq + h * a_hd, sink=Sink.QUANT)
                with m.State("AT_Q"):
                    with m.If(pdone):
                        with m.If(quant.o_nonfinite):
                            fail(ErrorCode.NON_FINITE)
                        with m.Else():
                            engine("AT_K1", (kb + kv8_plane)[:A], (ksb + kv8_ks)[:A], a_n, a_hd, LB, 0, 0, SB, a_n)
                after_engine("AT_K1", lambda: engine("AT_K2", kb, ksb, a_n, a_hd, LB, 1, 0, SB, a_n))
                after_engine("AT_K2", lambda: launch("AT_S1", op=SfuOp.MAX, n=a_n, a=Src.L2, a_addr=SB, sink=Sink.REG))
                wait_pass("AT_S1", lambda: launch("AT_S2", op=SfuOp.EXP, n=a_n, a=Src.L2, a_addr=SB, emax=p_result,
                                                  sub_emax=1, sink=Sink.L2, dst=SB))
                wait_pass("AT_S2", lambda: launch("AT_S3", op=SfuOp.SUM, n=a_n, a=Src.L2, a_addr=SB, sink=Sink.REG))
                # a_rz holds the sum until the RECIP pass, which runs beside the first chunk's V GEMVs (it only
                # uses the SFU and registers), replaces it with recip(sum)
                wait_pass("AT_S3", lambda: (sync(a_rz.eq(p_result)),
                                            launch("AT_S5", op=SfuOp.MUL, n=a_n, a=Src.DDR, ddr_addr=vsb, ddr_fmt=1,
                                                   b=BSrc.L2, b_addr=SB, sink=Sink.L2, dst=SB)))
                wait_pass("AT_S5", lambda: (sync(c0.eq(0)), go("AT_V")()))
                with m.State("AT_V"):
                    with m.If(r_pend):
                        pass                         # the RECIP pass is still running
                    with m.Elif(c0 == a_n):
                        launch("AT_O", op=SfuOp.MULS, n=a_hd, a=Src.L2, a_addr=dsth, s=a_rz, sink=Sink.L2, dst=dsth)
                    with m.Else():
                        left = a_n - c0
                        m.d.sync += clen.eq(Mux(left > MAXC, MAXC, left))
                        launch("AT_VQ", bypass=1, n=Mux(left > MAXC, MAXC, left), a=Src.L2, a_addr=SB + c0,
                               sink=Sink.QUANT)
                voff = (c0 * a_hd) >> 1
                with m.State("AT_VQ"):
                    with m.If(pdone):
                        with m.If(quant.o_nonfinite):
                            fail(ErrorCode.NON_FINITE)
                        with m.Else():
                            engine("AT_V1", (kb + (kv8_plane << 1) + kv8_plane + voff)[:A], (vtab + (a_hd << 1))[:A],
                                   a_hd, clen, V_PLANE_LOG2_GROUP, c0 != 0, 1, dsth, a_hd)
                            with m.If(c0 == 0):
                                launch("AT_V1", op=SfuOp.RECIP, n=1, a=Src.REG, a_val=a_rz, sink=Sink.REG)
                                m.d.sync += r_pend.eq(1)
                after_engine("AT_V1", lambda: engine("AT_V2", (kb + (kv8_plane << 1) + voff)[:A], vtab, a_hd, clen,
                                                     V_PLANE_LOG2_GROUP, 1, 1, dsth, a_hd))
                after_engine("AT_V2", lambda: (sync(c0.eq(c0 + clen)), go("AT_V")()))
                wait_pass("AT_O", lambda: (sync(h.eq(h + 1)), go("AT_H")()))

        # --- activity for the counters ----------------------------------------------------------------
        m.d.comb += [
            self.o_unit_busy.gemv.eq(gemv.o_busy),
            self.o_unit_busy.gemm.eq(gemm.o_busy),
            self.o_unit_busy.sfu.eq(active & ~p_bypass),
            self.o_unit_busy.dma.eq(ddr_rd.o_busy | ddr_wr.o_busy),
            self.o_unit_busy.attn.eq(busy & (op == Opcode.ATTN)),
        ]
        return m

    @staticmethod
    def _cvo_acc(m, staged, launch, retire, red_f, n, cd, SB):
        with m.If(staged):
            launch("RETIRE_PASS", op=SfuOp.ADD, n=Mux(red_f, 1, n), a=Src.L2, a_addr=cd, b=BSrc.L2, b_addr=SB,
                   sink=Sink.L2, dst=cd)
        with m.Else():
            retire()
