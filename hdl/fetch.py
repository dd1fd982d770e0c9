"""Instruction fetch: streams a token program's 64-bit words from DDR to the controller.

The program lies at a 16-byte-aligned DDR address (CSR ``PROGRAM_BASE``) and is ``PROGRAM_LEN`` words long.
`Fetch` reads it in bursts through an `hdl.axi.AxiReadDma` into a beat FIFO and hands out one word per
cycle with its index (``pc``).

**Credit rule (no bus hang).** The fetch shares an HP port with other readers, so it must never leave read
data stuck on the R channel while the controller waits (for instance on a long WGEMV that needs the same
port): a burst is requested only when the FIFO has room for it and for every beat already in flight. Read
data is therefore always accepted at full rate, whatever the controller does.

**Stop.** ``i_stop`` (HALT, an error, or a new start) abandons the program: no new bursts, buffered words are
dropped, and the unit stays ``o_busy`` until every burst in flight has returned, so a following start never
sees stale beats. A beat that came back with SLVERR/DECERR is delivered with ``err`` set, in order; the
controller turns it into `ErrorCode.BUS_ERROR`. The fetch never reads past the program's end.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal, unsigned
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from .axi import AxiReadDma, AxiReadSignature
from .config import HardwareConfig

__all__ = ["Fetch", "insn_layout", "PC_BITS"]

PC_BITS = 24               # programs of up to 16 Mi words (E4B's token program: 5.9 k words)
WORD_BYTES = 8


def insn_layout() -> data.StructLayout:
    return data.StructLayout({"word": unsigned(64), "pc": unsigned(PC_BITS), "err": 1})


class Fetch(wiring.Component):
    """Program fetch with a credit-checked prefetch FIFO.

    Parameters
    ----------
    cfg : HardwareConfig
    fifo_beats : FIFO depth in AXI beats (at least two bursts).

    Members
    -------
    i_start : In(1)        pulse: fetch ``i_len`` words from ``i_base`` (ignored while busy)
    i_base : In(addr)      byte address, 8-byte aligned
    i_len : In(PC_BITS)    words
    i_stop : In(1)         pulse: abandon the program (drain in-flight bursts)
    o_insn : Out(stream)   ``word``, ``pc``, ``err``
    o_busy : Out(1)
    axi : Out(AxiReadSignature)
    """

    def __init__(self, cfg: HardwareConfig, *, fifo_beats: int | None = None):
        if cfg.axi_data_bits < 64:
            self._MustUse__silence = True     # rejected: no "created but never used" warning on top
            raise ValueError(f"instruction fetch needs AXI data of at least 64 bits, not {cfg.axi_data_bits}")
        burst = cfg.axi_max_burst_beats
        fifo_beats = 2 * burst if fifo_beats is None else fifo_beats
        if not isinstance(fifo_beats, int) or fifo_beats < burst:
            self._MustUse__silence = True
            raise ValueError(f"fifo_beats must be at least one burst ({burst} beats), not {fifo_beats!r}")
        self._cfg, self._fifo_beats = cfg, fifo_beats
        super().__init__({
            "i_start": In(1), "i_base": In(cfg.axi_addr_bits), "i_len": In(PC_BITS), "i_stop": In(1),
            "o_insn": Out(stream.Signature(insn_layout())),
            "o_busy": Out(1),
            "axi": Out(AxiReadSignature.from_config(cfg)),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self._cfg
        B = cfg.bytes_per_beat
        wpb = B // WORD_BYTES                       # words per beat
        burst = cfg.axi_max_burst_beats
        depth = self._fifo_beats
        cnt_bits = (depth + burst).bit_length() + 1

        m.submodules.dma = dma = AxiReadDma(cfg)
        wiring.connect(m, wiring.flipped(self.axi), dma.axi)
        m.submodules.beats = beats = fifo.SyncFIFOBuffered(width=cfg.axi_data_bits + 1, depth=depth)

        active = Signal()            # fetching a program
        draining = Signal()          # stopped, waiting for bursts in flight
        next_addr = Signal(cfg.axi_addr_bits)
        words_left = Signal(PC_BITS + 1)            # words not yet requested
        in_flight = Signal(cnt_bits)                # beats requested, not yet in the FIFO
        pc = Signal(PC_BITS)
        words_out_left = Signal(PC_BITS + 1)        # words not yet delivered
        sub = Signal(range(max(wpb, 2)))            # word index inside the head beat

        # --- requests: one burst-sized command when the FIFO can hold it and everything in flight ----
        # The command's size is registered from `words_left` every cycle; `req_fresh` is low the cycle after
        # `words_left` changes (a start, a command, a stop), while it is the old value's, and no command
        # leaves then: a cycle between commands (each is a burst of many beats) and one after the start.
        chunk_words = burst * wpb
        req_words = Signal(PC_BITS + 1)             # min(words_left, chunk_words)
        req_beats = Signal(cnt_bits)                # its beats
        req_limit = Signal(cnt_bits)                # depth - req_beats: room for it while level + in_flight <= this
        req_any = Signal()                          # words_left != 0
        req_fresh = Signal()
        beats_of_left = Mux(words_left > chunk_words, burst, (words_left + wpb - 1) // wpb if wpb > 1 else words_left)
        m.d.sync += [req_words.eq(Mux(words_left > chunk_words, chunk_words, words_left)),
                     req_beats.eq(beats_of_left), req_limit.eq(depth - beats_of_left),
                     req_any.eq(words_left != 0), req_fresh.eq(1)]
        room = Signal()
        m.d.comb += room.eq(beats.level + in_flight <= req_limit)
        m.d.comb += [
            dma.i_cmd.payload.addr.eq(next_addr),
            dma.i_cmd.payload.nbytes.eq(req_words * WORD_BYTES),
            dma.i_cmd.valid.eq(active & req_fresh & req_any & room & ~self.i_stop),
        ]
        arrived = Signal()
        m.d.comb += arrived.eq(dma.o_data.valid & dma.o_data.ready)
        with m.If(dma.i_cmd.valid & dma.i_cmd.ready):
            m.d.sync += [next_addr.eq(next_addr + req_words * WORD_BYTES), words_left.eq(words_left - req_words),
                         req_fresh.eq(0)]
            m.d.sync += in_flight.eq(in_flight + req_beats - arrived)
        with m.Else():
            m.d.sync += in_flight.eq(in_flight - arrived)

        # --- data: every beat goes into the FIFO (room was reserved), or is dropped while stopping ---
        m.d.comb += [
            dma.o_data.ready.eq(1),
            beats.w_data.eq(dma.o_data.payload.data | (dma.o_data.payload.err << cfg.axi_data_bits)),
            beats.w_en.eq(dma.o_data.valid & active),
        ]

        # --- words out ------------------------------------------------------------------------------
        head = beats.r_data
        word = Signal(64)
        m.d.comb += word.eq(head.word_select(sub, 64) if wpb > 1 else head[0:64])
        # words_out_left != 0 and == 1, registered with it
        out_any, out_last = Signal(), Signal()
        m.d.comb += [
            self.o_insn.payload.word.eq(word),
            self.o_insn.payload.pc.eq(pc),
            self.o_insn.payload.err.eq(head[cfg.axi_data_bits]),
            self.o_insn.valid.eq(active & beats.r_rdy & out_any),
        ]
        last_of_beat = Signal()
        m.d.comb += last_of_beat.eq((sub == wpb - 1) | out_last)
        with m.If(self.o_insn.valid & self.o_insn.ready):
            m.d.sync += [pc.eq(pc + 1), words_out_left.eq(words_out_left - 1), out_any.eq(~out_last),
                         out_last.eq(words_out_left == 2)]
            if wpb > 1:
                m.d.sync += sub.eq(sub + 1)
            with m.If(last_of_beat):
                m.d.comb += beats.r_en.eq(1)
                m.d.sync += sub.eq(0)

        # --- start / stop ---------------------------------------------------------------------------
        m.d.comb += self.o_busy.eq(active | draining | (in_flight != 0) | dma.o_busy)
        with m.If(self.i_stop & (active | draining)):
            m.d.sync += [active.eq(0), draining.eq(1), words_left.eq(0), words_out_left.eq(0), out_any.eq(0),
                         out_last.eq(0), req_fresh.eq(0)]
        with m.If(draining):
            m.d.comb += beats.r_en.eq(1)                 # empty the FIFO
            with m.If((in_flight == 0) & ~dma.o_busy & ~beats.r_rdy & ~self.i_stop):
                m.d.sync += draining.eq(0)
        # idle (neither active nor draining) implies nothing in flight (draining ends only when the last
        # burst is back), so a start is taken on those two registers alone
        with m.If(self.i_start & ~active & ~draining):
            m.d.sync += [active.eq(1), next_addr.eq(self.i_base), words_left.eq(self.i_len), req_fresh.eq(0),
                         words_out_left.eq(self.i_len), out_any.eq(self.i_len != 0), out_last.eq(self.i_len == 1),
                         pc.eq(0), sub.eq(0)]
        return m
