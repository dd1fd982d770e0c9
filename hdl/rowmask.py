"""The GEMV engine's row mask (WGEMV `mask`, docs/isa.md): which rows of a dense command are fetched.

A masked command's mask arrives before it, one element per row, as words of `MASK_LANES` live bits (an element
that is not ±0 keeps its row). Each port keeps a copy and, when the command starts, gathers the live rows of
its share of the rows (``[lo, hi)``, the sparse mode's row split) into an index memory, in row order, and
counts them; the port then fetches the gathered rows as tiles, each row at its own address (`RowGather`).
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .config import ceil_log2
from .l2 import LANES

__all__ = ["MASK_LANES", "mask_layout", "RowGather"]

MASK_LANES = LANES      # live bits per mask word: one L2 word of binary32 mask elements (the MASK pass's beat)


def mask_layout(max_rows: int) -> data.StructLayout:
    """A word of the row mask: rows ``addr * MASK_LANES ..``, bit i set when row ``addr * MASK_LANES + i`` is
    live."""
    return data.StructLayout({"addr": range(max_rows // MASK_LANES), "bits": MASK_LANES})


class RowGather(wiring.Component):
    """A port's copy of the row mask and its gather.

    Parameters
    ----------
    max_rows : the most rows of a masked command (a multiple of `MASK_LANES`)
    max_share : the most rows of one port's share (the index memory's depth)

    Members
    -------
    i_mask_en, i_mask_addr, i_mask_bits : In: mask word writes (rows ``addr * MASK_LANES ..``, bit i = row
        ``addr * MASK_LANES + i`` is live)
    i_start : In(1): gather the live rows of ``[i_lo, i_hi)`` (stable until `o_done`)
    o_busy : Out(1); o_count : Out: the live rows found (valid when not busy)
    i_idx_addr : In; o_idx : Out: the index memory's read port (the row of the addr-th live row, a cycle later)

    Timing: two cycles per mask word of the share, and one more per live row beyond a word's first.
    """

    def __init__(self, max_rows: int, max_share: int):
        if max_rows % MASK_LANES or max_rows <= 0:
            self._MustUse__silence = True    # never built: no "created but never used" warning
            raise ValueError(f"max_rows must be a positive multiple of {MASK_LANES}, not {max_rows!r}")
        self._max_rows, self._max_share = max_rows, max_share
        super().__init__({
            "i_mask_en": In(1), "i_mask_addr": In(range(max_rows // MASK_LANES)), "i_mask_bits": In(MASK_LANES),
            "i_start": In(1), "i_lo": In(range(max_rows + 1)), "i_hi": In(range(max_rows + 1)),
            "o_busy": Out(1), "o_count": Out(range(max_share + 1)),
            "i_idx_addr": In(range(max_share)), "o_idx": Out(range(max_rows)),
        })

    def elaborate(self, platform):
        m = Module()
        L = MASK_LANES
        lL = ceil_log2(L)
        m.submodules.mask_mem = mask_mem = Memory(shape=L, depth=self._max_rows // L, init=[])
        mw, mr = mask_mem.write_port(), mask_mem.read_port()
        m.d.comb += [mw.en.eq(self.i_mask_en), mw.addr.eq(self.i_mask_addr), mw.data.eq(self.i_mask_bits)]
        m.submodules.idx_mem = idx_mem = Memory(shape=range(self._max_rows), depth=self._max_share, init=[])
        iw, ir = idx_mem.write_port(), idx_mem.read_port()
        m.d.comb += [ir.addr.eq(self.i_idx_addr), self.o_idx.eq(ir.data)]

        word = Signal(range(self._max_rows // L + 1))        # the word being read or scanned
        last = Signal.like(word)                             # the share's last word
        lo, hi = Signal.like(self.i_lo), Signal.like(self.i_hi)
        bits = Signal(L)                                     # the scanned word's live rows not yet gathered
        count = Signal.like(self.o_count)
        next_word = Signal()                                 # the scan moves to the next word (read it now)
        m.d.comb += [mr.addr.eq(Mux(next_word, word + 1, word)), self.o_count.eq(count)]
        # the scanned word's rows inside [lo, hi)
        rows_in = Signal(L)
        m.d.comb += rows_in.eq(Cat(*[(Cat(Const(i, lL), word) >= lo) & (Cat(Const(i, lL), word) < hi) for i in range(L)]))
        low = Signal(range(L))                               # the lowest live row left in `bits`
        for i in reversed(range(L)):
            with m.If(bits[i]):
                m.d.comb += low.eq(i)
        with m.FSM(name="gather"):
            with m.State("IDLE"):
                m.d.comb += self.o_busy.eq(self.i_start)
                with m.If(self.i_start):
                    m.d.sync += [word.eq(self.i_lo >> lL), last.eq((self.i_hi - 1) >> lL), lo.eq(self.i_lo),
                                 hi.eq(self.i_hi), count.eq(0)]
                    with m.If(self.i_hi > self.i_lo):
                        m.next = "READ"
            with m.State("READ"):                            # the first word's data arrives next cycle
                m.d.comb += self.o_busy.eq(1)
                m.next = "LOAD"
            with m.State("LOAD"):
                m.d.comb += self.o_busy.eq(1)
                m.d.sync += bits.eq(mr.data & rows_in)
                m.next = "SCAN"
            with m.State("SCAN"):
                m.d.comb += self.o_busy.eq(1)
                with m.If(bits != 0):
                    m.d.comb += [iw.en.eq(1), iw.addr.eq(count), iw.data.eq(Cat(low, word))]
                    m.d.sync += [count.eq(count + 1), bits.eq(bits & ~(1 << low))]
                with m.If((bits & ~(1 << low)) == 0):
                    with m.If(word == last):
                        m.next = "IDLE"
                    with m.Else():
                        m.d.comb += next_word.eq(1)
                        m.d.sync += word.eq(word + 1)
                        m.next = "LOAD"
        return m
