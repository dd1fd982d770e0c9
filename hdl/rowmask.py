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

        words = self._max_rows // L + 2
        word, word_p1, word_p2 = Signal(range(words)), Signal(range(words)), Signal(range(words))  # word + 0, 1, 2
        lo_low = Signal(lL)                                  # the share's first row within its word
        hi = Signal.like(self.i_hi)
        first_bits, last_bits = Signal(L), Signal(L)         # the first and the last word's rows in [lo, hi)
        at_first, at_last = Signal(), Signal()               # the scanned word is the share's first, last
        bits = Signal(L)                                     # the scanned word's live rows not yet gathered
        count = Signal.like(self.o_count)
        next_word = Signal()                                 # the scan moves to the next word (read it now)
        m.d.comb += [mr.addr.eq(Mux(next_word, word_p1, word)), self.o_count.eq(count)]
        # the scanned word's rows inside [lo, hi): all but in the share's first and last words
        rows_in = Mux(at_first, first_bits, (1 << L) - 1) & Mux(at_last, last_bits, (1 << L) - 1)
        low = Signal(range(L))                               # the lowest live row left in `bits`
        for i in reversed(range(L)):
            with m.If(bits[i]):
                m.d.comb += low.eq(i)
        with m.FSM(name="gather"):
            with m.State("IDLE"):
                m.d.comb += self.o_busy.eq(self.i_start)
                with m.If(self.i_start):
                    first = self.i_lo >> lL
                    m.d.sync += [word.eq(first), word_p1.eq(first + 1), word_p2.eq(first + 2),
                                 lo_low.eq(self.i_lo[:lL]), hi.eq(self.i_hi), count.eq(0), at_first.eq(1)]
                    with m.If(self.i_hi > self.i_lo):
                        m.next = "READ"
            with m.State("READ"):                            # the first word's data arrives next cycle
                m.d.comb += self.o_busy.eq(1)
                hi_m1_low = (hi[:lL] - 1)[:lL]               # the last row's place in its word
                m.d.sync += [at_last.eq(hi <= (word_p1 << lL)),
                             first_bits.eq(Cat(*[lo_low <= i for i in range(L)])),
                             last_bits.eq(Cat(*[hi_m1_low >= i for i in range(L)]))]
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
                with m.If((bits & (bits - 1)) == 0):         # at most one live row left: this word is done
                    with m.If(at_last):
                        m.next = "IDLE"
                    with m.Else():
                        m.d.comb += next_word.eq(1)
                        m.d.sync += [word.eq(word_p1), word_p1.eq(word_p2), word_p2.eq(word_p2 + 1),
                                     at_first.eq(0), at_last.eq(hi <= (word_p2 << lL))]
                        m.next = "LOAD"
        return m
