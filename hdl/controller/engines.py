"""The engine tracker: the GEMV engine and the GEMM unit beside the passes (docs/architecture.md, "Overlap").

A sequencer hands over a matrix as one command: a GEMV (``i_gemv``: the engine's command, the L2 rows
[lo, lo + n) it writes and the pc of the instruction) or a WGEMM token tile (``i_gemm``: the unit's command).
The quantiser has already filled the engine's (or the unit's) activation memories. The rows go through the
tracker's own L2 reader and writer (``l2_r``, ``l2_w``; with accm the old values come back through the
reader); the tracker holds the running range (``o_hold``) until the last row is in L2, so the pass engine
delays every pass whose L2 ranges meet it. ``o_failed`` / ``o_code`` / ``o_pc``: the engine finished with an
error (its flags are sticky until START). ``act_n``: the activations the GEMV engine holds (WGEMV reuse).

An NPU whose GEMV engine takes several activation vectors (``gemv_vectors`` V > 1) runs WGEMM on it and has no
GEMM unit: a GEMV job then carries its vectors (``cmd.vecs``) and the L2 elements between their output rows
(``stride``), and the tracker writes (and with accm reads) the engine's results as runs of a tile's rows for
one vector (`GemvEngine`'s order), each run a writer (reader) command at ``lo + v * stride + tile * T``.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out, connect

from ..config import HardwareConfig
from ..fetch import PC_BITS
from ..gemm import GemmUnit, gemm_command_layout
from ..gemv import GemvEngine, command_layout as gemv_command_layout
from ..isa import ErrorCode
from ..l2 import ElemReader, ElemWriter, l2_geometry, write_layout
from .passes import L2ReadPort, hold_layout

__all__ = ["EngineTracker", "gemv_job_layout", "gemm_job_layout", "share_axi"]


def gemv_job_layout(hw: HardwareConfig) -> data.StructLayout:
    ea, nb, _ = l2_geometry(hw)
    extra = {"stride": nb} if hw.gemv_vectors > 1 else {}
    return data.StructLayout({"cmd": gemv_command_layout(hw), "lo": ea, "n": nb, "pc": PC_BITS, **extra})


def gemm_job_layout(hw: HardwareConfig) -> data.StructLayout:
    ea, nb, _ = l2_geometry(hw)
    return data.StructLayout({"cmd": gemm_command_layout(hw), "lo": ea, "n": nb, "pc": PC_BITS})


def share_axi(m, out, a, b, sel_b):
    """AXI read master `out` driven by `a`, or by `b` while `sel_b`; the idle one sees no handshake."""
    for name, member in out.signature.members.items():
        mine, x, y = getattr(out, name), getattr(a, name), getattr(b, name)
        if member.flow == Out:
            m.d.comb += mine.eq(Mux(sel_b, y, x))
        elif name in ("arready", "rvalid"):
            m.d.comb += [x.eq(mine & ~sel_b), y.eq(mine & sel_b)]
        else:
            m.d.comb += [x.eq(mine), y.eq(mine)]


class EngineTracker(wiring.Component):
    """The GEMV engine, the GEMM unit, their L2 ports and weight masters, and the running matrix.

    Members
    -------
    i_gemv : In(stream(gemv_job_layout))   always taken when ``o_hold.active`` is low (sequencers wait for it)
    i_gemm : In(stream(gemm_job_layout))
    i_act_n : In(stream(cols))             the engine now holds `cols` activations (0: none reusable)
    i_gemv_act, i_gemv_exp, i_gemm_act, i_gemm_exp : In(stream)   the quantiser's words, routed by the top
        (the GEMM unit's only with V = 1; the GEMV engine's with V > 1 carry the vector they fill)
    i_gemm_tok : In(range(systolic_rows))  the GEMM unit's token slot they fill (V = 1)
    i_gemv_mask : In(stream)               the MASK pass's words (with ``gemv_row_mask``)
    o_hold : Out(hold_layout)              the rows not yet in L2
    o_idle : Out(1)                        no matrix runs and none is waiting to be taken by its unit
    o_failed : Out(1); o_code : Out(ErrorCode); o_pc : Out(PC_BITS)   an error of the last matrix, at its pc
    o_act_n : Out(range(gemv_max_cols + 1))
    o_gemv_busy, o_gemm_busy : Out(1)
    l2_r : Out(L2ReadPort); l2_w : Out(stream(write_layout))
    m_gemv<p> : Out(AxiReadSignature)      the GEMV engine's, or the GEMM unit's on its first ports while a tile runs
    """

    def __init__(self, hw: HardwareConfig):
        from ..axi import AxiReadSignature
        self._hw = hw
        self._gemv = GemvEngine(hw)
        self._gemm = GemmUnit(hw) if hw.gemv_vectors == 1 else None
        members = {
            "i_gemv": In(stream.Signature(gemv_job_layout(hw))),
            "i_gemm": In(stream.Signature(gemm_job_layout(hw))),
            "i_act_n": In(stream.Signature(range(hw.gemv_max_cols + 1), always_ready=True)),
            "o_hold": Out(hold_layout(hw)), "o_idle": Out(1),
            "o_failed": Out(1), "o_code": Out(ErrorCode), "o_pc": Out(PC_BITS),
            "o_act_n": Out(range(hw.gemv_max_cols + 1)),
            "o_gemv_busy": Out(1), "o_gemm_busy": Out(1),
            "l2_r": Out(L2ReadPort(hw)), "l2_w": Out(stream.Signature(write_layout(hw))),
        }
        members["i_gemv_act"] = In(self._gemv.signature.members["i_act"].signature.flip())
        members["i_gemv_exp"] = In(self._gemv.signature.members["i_exp"].signature.flip())
        if self._gemm is not None:
            members["i_gemm_act"] = In(self._gemm.signature.members["i_act"].signature.flip())
            members["i_gemm_exp"] = In(self._gemm.signature.members["i_exp"].signature.flip())
            members["i_gemm_tok"] = In(self._gemm.signature.members["i_tok"].shape)
        if hw.gemv_row_mask:
            members["i_gemv_mask"] = In(self._gemv.signature.members["i_mask"].signature.flip())
        for p in range(hw.axi_ports):
            members[f"m_gemv{p}"] = Out(AxiReadSignature.from_config(hw))
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        m.submodules.gemv = gemv = self._gemv
        m.submodules.rd = rd = ElemReader(hw)
        m.submodules.wr = wr = ElemWriter(hw)
        connect(m, rd.o_req, wiring.flipped(self.l2_r.req))
        connect(m, wiring.flipped(self.l2_r.resp), rd.i_resp)
        connect(m, wr.o_wr, wiring.flipped(self.l2_w))
        connect(m, wiring.flipped(self.i_gemv_act), gemv.i_act)
        connect(m, wiring.flipped(self.i_gemv_exp), gemv.i_exp)
        if hw.gemv_row_mask:
            connect(m, wiring.flipped(self.i_gemv_mask), gemv.i_mask)
        with m.If(self.i_act_n.valid):
            m.d.sync += self.o_act_n.eq(self.i_act_n.payload)
        if self._gemm is None:
            self._vectors(m, gemv, rd, wr)
            return m
        m.submodules.gemm = gemm = self._gemm
        connect(m, wiring.flipped(self.i_gemm_act), gemm.i_act)
        connect(m, wiring.flipped(self.i_gemm_exp), gemm.i_exp)
        m.d.comb += gemm.i_tok.eq(self.i_gemm_tok)

        is_gemm = Signal()            # the running matrix is a WGEMM tile (it has the weight ports)
        for p in range(hw.axi_ports):
            out = getattr(self, f"m_gemv{p}")
            if p < gemm.axi_ports:
                share_axi(m, out, getattr(gemv, f"m_axi{p}"), getattr(gemm, f"m_axi{p}"), is_gemm)
            else:
                connect(m, getattr(gemv, f"m_axi{p}"), wiring.flipped(out))

        hold = self.o_hold
        cmd = Signal(gemv_command_layout(hw))
        gm_cmd = Signal(gemm_command_layout(hw))
        pend = Signal(data.StructLayout({"gemv": 1, "rd": 1, "wr": 1, "gemm": 1}))
        m.d.comb += [self.i_gemv.ready.eq(~hold.active), self.i_gemm.ready.eq(~hold.active)]
        with m.If(self.i_gemv.valid & self.i_gemv.ready):
            job = self.i_gemv.payload
            m.d.sync += [cmd.eq(job.cmd), hold.active.eq(1), is_gemm.eq(0), hold.lo.eq(job.lo), hold.n.eq(job.n),
                         self.o_pc.eq(job.pc), pend.gemv.eq(1), pend.wr.eq(1), pend.rd.eq(job.cmd.accm)]
        with m.If(self.i_gemm.valid & self.i_gemm.ready):
            job = self.i_gemm.payload
            m.d.sync += [gm_cmd.eq(job.cmd), hold.active.eq(1), is_gemm.eq(1), hold.lo.eq(job.lo),
                         hold.n.eq(job.n), self.o_pc.eq(job.pc), pend.gemm.eq(1)]
        # the running range's end, of the matrix taken (the GEMM tile's when both are): one sum
        gemm_in = self.i_gemm.valid & self.i_gemm.ready
        with m.If((self.i_gemv.valid & self.i_gemv.ready) | gemm_in):
            m.d.sync += hold.hi.eq(Mux(gemm_in, self.i_gemm.payload.lo, self.i_gemv.payload.lo) +
                                   Mux(gemm_in, self.i_gemm.payload.n, self.i_gemv.payload.n))
        m.d.comb += [gemv.i_cmd.valid.eq(pend.gemv), gemv.i_cmd.payload.eq(cmd),
                     gemm.i_cmd.valid.eq(pend.gemm), gemm.i_cmd.payload.eq(gm_cmd)]
        # the L2 reader and writer: one command per matrix (GEMV) or per token row (GEMM)
        with m.If(is_gemm):
            connect(m, gemm.o_wcmd, wr.i_cmd)
            connect(m, gemm.o_rcmd, rd.i_cmd)
            connect(m, gemm.o_y, wr.i_elem)
            m.d.comb += [gemm.i_old.valid.eq(rd.o_elem.valid), gemm.i_old.payload.eq(rd.o_elem.payload.data),
                         rd.o_elem.ready.eq(gemm.i_old.ready)]
        with m.Else():
            m.d.comb += [wr.i_cmd.valid.eq(pend.wr), wr.i_cmd.payload.addr.eq(hold.lo), wr.i_cmd.payload.n.eq(hold.n),
                         rd.i_cmd.valid.eq(pend.rd), rd.i_cmd.payload.addr.eq(hold.lo), rd.i_cmd.payload.n.eq(hold.n)]
            connect(m, gemv.o_y, wr.i_elem)
            m.d.comb += [gemv.i_acc.valid.eq(rd.o_elem.valid), gemv.i_acc.payload.eq(rd.o_elem.payload.data),
                         rd.o_elem.ready.eq(gemv.i_acc.ready)]
        for name, unit in (("gemv", gemv), ("gemm", gemm)):
            with m.If(unit.i_cmd.valid & unit.i_cmd.ready):
                m.d.sync += getattr(pend, name).eq(0)
        for name, unit in (("rd", rd), ("wr", wr)):
            with m.If(~is_gemm & unit.i_cmd.valid & unit.i_cmd.ready):
                m.d.sync += getattr(pend, name).eq(0)
        # GEMV: its one row command is written (a rejected command sends no rows: the program ends in error and
        # START resets the datapath); GEMM: the unit has sent its last element and the writer has written it
        # (only while a matrix holds: the check reads the previous matrix's state in the cycle a new one is taken)
        with m.If(hold.active & Mux(is_gemm, ~pend.gemm & ~gemm.o_busy & ~wr.o_busy,
                                    wr.o_done | (gemv.o_bad_cmd & ~pend.gemv))):
            m.d.sync += hold.active.eq(0)
        m.d.comb += [self.o_idle.eq(~hold.active & ~pend.gemm),
                     self.o_failed.eq(~hold.active & (gemv.o_bad_cmd | gemv.o_error | gemm.o_error)),
                     self.o_code.eq(Mux(gemv.o_bad_cmd, ErrorCode.BAD_LENGTH, ErrorCode.BUS_ERROR)),
                     self.o_gemv_busy.eq(gemv.o_busy), self.o_gemm_busy.eq(gemm.o_busy)]
        return m

    def _vectors(self, m, gemv, rd, wr):
        """The GEMV engine alone (V > 1, no GEMM unit): a job's results go to L2 as runs, one writer command
        per tile and vector (and, with accm, one reader command each for the old values), in the engine's order;
        the running range is held until the last run is written."""
        hw = self._hw
        T = gemv.tile_rows
        _, nb, _ = l2_geometry(hw)
        for p in range(hw.axi_ports):
            connect(m, getattr(gemv, f"m_axi{p}"), wiring.flipped(getattr(self, f"m_gemv{p}")))
        hold = self.o_hold
        cmd = Signal(gemv_command_layout(hw))
        stride = Signal(nb)
        pend = Signal()                               # the engine has not taken the command yet
        take = self.i_gemv.valid & self.i_gemv.ready
        m.d.comb += [self.i_gemv.ready.eq(~hold.active), self.i_gemm.ready.eq(0)]
        job = self.i_gemv.payload
        with m.If(take):
            m.d.sync += [cmd.eq(job.cmd), stride.eq(job.stride), hold.active.eq(1), hold.lo.eq(job.lo),
                         hold.n.eq(job.n), hold.hi.eq(job.lo + job.n), self.o_pc.eq(job.pc), pend.eq(1)]
        m.d.comb += [gemv.i_cmd.valid.eq(pend), gemv.i_cmd.payload.eq(cmd)]
        with m.If(gemv.i_cmd.valid & gemv.i_cmd.ready):
            m.d.sync += pend.eq(0)

        def runs(unit, name, on):
            """The commands of `unit` (the writer, or the reader with accm): a tile's rows for one vector at a time;
            a single-vector job is one command of all its rows. Returns the generator's active flag."""
            active = Signal(name=f"{name}_active")
            left = Signal(21, name=f"{name}_left")        # rows from this tile on
            tbase = Signal(nb, name=f"{name}_tbase")      # the tile's first row, vector 0
            addr = Signal(nb, name=f"{name}_addr")        # the run's first element
            v = Signal(range(hw.gemv_vectors), name=f"{name}_v")
            single = cmd.vecs == 0
            with m.If(take):
                m.d.sync += [active.eq(on), left.eq(job.cmd.rows), tbase.eq(job.lo), addr.eq(job.lo), v.eq(0)]
            m.d.comb += [unit.i_cmd.valid.eq(active), unit.i_cmd.payload.addr.eq(addr),
                         unit.i_cmd.payload.n.eq(Mux(single | (left < T), left, T))]
            with m.If(unit.i_cmd.valid & unit.i_cmd.ready):
                m.d.sync += [v.eq(v + 1), addr.eq(addr + stride)]
                with m.If(v == cmd.vecs):
                    m.d.sync += [v.eq(0), tbase.eq(tbase + T), addr.eq(tbase + T), left.eq(left - T)]
                    with m.If(single | (left <= T)):
                        m.d.sync += active.eq(0)
            return active

        wr_active = runs(wr, "wr", 1)
        runs(rd, "rd", job.cmd.accm)
        connect(m, gemv.o_y, wr.i_elem)
        m.d.comb += [gemv.i_acc.valid.eq(rd.o_elem.valid), gemv.i_acc.payload.eq(rd.o_elem.payload.data),
                     rd.o_elem.ready.eq(gemv.i_acc.ready)]
        # the last run is written (a rejected command sends no rows: the program ends in error and START resets)
        with m.If(hold.active & ((wr.o_done & ~wr_active) | (gemv.o_bad_cmd & ~pend))):
            m.d.sync += hold.active.eq(0)
        m.d.comb += [self.o_idle.eq(~hold.active),
                     self.o_failed.eq(~hold.active & (gemv.o_bad_cmd | gemv.o_error)),
                     self.o_code.eq(Mux(gemv.o_bad_cmd, ErrorCode.BAD_LENGTH, ErrorCode.BUS_ERROR)),
                     self.o_gemv_busy.eq(gemv.o_busy), self.o_gemm_busy.eq(0)]
