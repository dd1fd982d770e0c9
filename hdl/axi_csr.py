"""AXI4 -> AXI4-Lite bridge in front of a `hdl.csr.CsrBlock`: the CSRs as the PS's HPM0 port sees them.

The Zynq UltraScale+ PS reaches the fabric through M_AXI_HPM0_FPD, a full AXI4 master: on the PS8 primitive
(the ``PS8`` cell Vivado's ``zynq_ultra_ps_e`` wraps) its ports are ``MAXIGP0AWADDR[39:0]``,
``MAXIGP0WDATA[127:0]`` and ``MAXIGP0AWID[15:0]`` (UG1085, the Zynq UltraScale+ TRM, "PS-PL AXI Interfaces":
40-bit addresses, a 32/64/128-bit data width configured in the PS, 16-bit IDs). A CPU's ``ldr``/``str``
to the window become single-beat narrow transfers; ``memcpy``, the caches' line fills and the DMA make
bursts. `AxiToCsr` takes whatever an AXI4 master may send and turns it into 32-bit AXI4-Lite accesses.

Contract (`sim.axi_csr` is its model; the AXI4 rules are those of ARM IHI 0022, A3.4.1):

- INCR, FIXED and WRAP bursts of any length (1..256 beats), any ``AxSIZE`` up to the bus width (wider sizes
  are taken as the bus width), unaligned start addresses, any ``WSTRB``; ``AxLOCK``, ``AxCACHE``,
  ``AxPROT`` and ``AxQOS`` are ignored (an exclusive access is answered OKAY: not supported). The reserved
  burst type 3 is taken as INCR.
- One burst at a time: an idle bridge accepts the next AW or AR (alternating when both wait), runs it to
  its response, then takes the next. Any number of transactions with any IDs may be outstanding at the
  master; ``BID``/``RID`` repeat the burst's ``AxID`` and ``RLAST`` marks the last beat (the bridge counts
  beats; ``WLAST`` is not needed).
- Beat ``n`` covers ``Address_n``; only its low 12 bits select a register (the PS decodes the window).
  A W beat writes the 32-bit words that have any strobe set, lowest first, each with its four strobes (a
  beat without strobes writes nothing). An R beat reads the words its byte lanes cover (from ``Address_n``
  to the end of its ``2**AxSIZE``-byte container) and returns each on its lanes, zero on all other lanes.
- Responses: an R beat carries the worst of its words' responses, the B the worst over the whole burst
  (``max``: OKAY < EXOKAY < SLVERR < DECERR); every burst is answered, whatever its words answer.
- No valid waits for a ready, and every payload is held while its valid is up: B and R come from
  registers; the AXI4-Lite write data is a word of the W beat, which stays on the bus (held by the master)
  until the bridge raises WREADY after the beat's last word, so the beat needs no register.

Cost: one AXI4-Lite access per word (three to four cycles each with an idle `CsrBlock`), plus a cycle or
two per beat; CSR traffic is control traffic, so the bridge is built for size, not speed: at the HPM0
widths Yosys (`hdl.synth`) estimates 194 LUT and 206 flip-flops.
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from .axi import AxiBurst, AxiSignature
from .config import ceil_log2
from .csr import AxiLiteSignature
from .csr_map import ADDR_BITS

__all__ = ["HPM0_ADDR_BITS", "HPM0_DATA_BITS", "HPM0_ID_BITS", "AxiToCsr"]

# M_AXI_HPM0_FPD on the PS8 primitive (UG1085 "PS-PL AXI Interfaces"; MAXIGP0AWADDR[39:0], MAXIGP0WDATA[127:0],
# MAXIGP0AWID[15:0]): the widths the NPU's CSR slave port is built for.
HPM0_ADDR_BITS = 40
HPM0_DATA_BITS = 128
HPM0_ID_BITS = 16


class AxiToCsr(wiring.Component):
    """AXI4 slave to AXI4-Lite master (32-bit, 12-bit addresses), one word access at a time.

    Parameters
    ----------
    addr_bits : int
        Address width of the AXI4 port, 12..64 (only the low 12 bits are decoded).
    data_bits : int
        Data width of the AXI4 port: a power of two from 32 to 1024.
    id_bits : int
        ID width of the AXI4 port, 1..32.

    Members
    -------
    s_axi : In(AxiSignature(addr_bits, data_bits, id_bits))
        The AXI4 slave port (toward the PS's HPM0).
    m_axil : Out(AxiLiteSignature())
        Toward the ``axil`` port of a `hdl.csr.CsrBlock`.
    """

    def __init__(self, addr_bits: int = HPM0_ADDR_BITS, data_bits: int = HPM0_DATA_BITS,
                 id_bits: int = HPM0_ID_BITS):
        self._MustUse__silence = True           # until the checks pass: a rejected bridge is not "unused"
        for name, v, lo, hi in (("addr_bits", addr_bits, ADDR_BITS, 64), ("data_bits", data_bits, 32, 1024),
                                ("id_bits", id_bits, 1, 32)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"AxiToCsr {name} must be an integer, not {v!r}")
            if not lo <= v <= hi:
                raise ValueError(f"AxiToCsr {name} must be {lo}..{hi}, not {v!r}")
        if data_bits & (data_bits - 1):
            raise ValueError(f"AxiToCsr data_bits must be a power of two from 32 to 1024, not {data_bits!r}")
        self._MustUse__silence = False
        self._addr_bits, self._data_bits, self._id_bits = addr_bits, data_bits, id_bits
        super().__init__({"s_axi": In(AxiSignature(addr_bits, data_bits, id_bits)),
                          "m_axil": Out(AxiLiteSignature())})

    addr_bits = property(lambda self: self._addr_bits)
    data_bits = property(lambda self: self._data_bits)
    id_bits = property(lambda self: self._id_bits)

    def elaborate(self, platform):
        m = Module()
        s, lite = self.s_axi, self.m_axil
        DBB = self._data_bits // 8                 # bytes per beat
        lDBB = ceil_log2(DBB)
        NW = DBB // 4                              # 32-bit words per beat

        # --- the burst being served -----------------------------------------------------------------------
        bid = Signal(self._id_bits)                # the IDs, one register each (no select between them)
        rid = Signal(self._id_bits)
        addr = Signal(ADDR_BITS)                   # Address_n, low 12 bits
        alen = Signal(8)
        asize = Signal(range(lDBB + 1))            # AxSIZE, capped at the bus width
        aburst = Signal(2)
        left = Signal(8)                           # beats of the burst after the current one
        resp = Signal(2)                           # worst response so far (of the burst / of the R beat)
        last_beat = Signal()                       # left == 0, registered with it

        def take(ax_addr, ax_len, ax_size, ax_burst, one):
            return [addr.eq(ax_addr[:ADDR_BITS]), alen.eq(ax_len),
                    asize.eq(Mux(ax_size > lDBB, lDBB, ax_size)), aburst.eq(ax_burst), left.eq(ax_len),
                    last_beat.eq(one), resp.eq(0)]

        # Address_(n+1): INCR (and the reserved type 3) steps from the size-aligned address; WRAP keeps the
        # bits above the wrap mask ((AxLEN << AxSIZE) | (size - 1) = bytes of the burst - 1 for the legal
        # 2/4/8/16 beats); FIXED stays.
        nbytes = Signal(range(DBB + 1))
        size_mask = Signal(ADDR_BITS)
        m.d.comb += [nbytes.eq(Const(1, lDBB + 2) << asize), size_mask.eq(nbytes - 1)]
        incr_next = Signal(ADDR_BITS)
        m.d.comb += incr_next.eq((addr & ~size_mask) + nbytes)
        wrap_mask = Signal(ADDR_BITS)
        m.d.comb += wrap_mask.eq((alen << asize) | size_mask)
        next_addr = Signal(ADDR_BITS)
        with m.Switch(aburst):
            with m.Case(AxiBurst.FIXED):
                m.d.comb += next_addr.eq(addr)
            with m.Case(AxiBurst.WRAP):
                m.d.comb += next_addr.eq((addr & ~wrap_mask) | (incr_next & wrap_mask))
            with m.Default():
                m.d.comb += next_addr.eq(incr_next)

        # --- the words of the current beat still to access, lowest first ------------------------------------
        pending = Signal(NW)
        if NW > 1:
            pick = Signal(range(NW))
            for w in reversed(range(NW)):
                with m.If(pending[w]):
                    m.d.comb += pick.eq(w)
        else:
            pick = Const(0, 1)                     # a 32-bit bus: the beat is the word
        word_addr = Signal(ADDR_BITS)
        m.d.comb += word_addr.eq(Cat(Const(0, 2), pick, addr[lDBB:]) if NW > 1 else Cat(Const(0, 2), addr[2:]))

        # Read beat lanes: from Address_n to the end of its container.
        lower = Signal(lDBB)
        upper = Signal(lDBB)
        m.d.comb += [lower.eq(addr[:lDBB]), upper.eq((addr & ~size_mask)[:lDBB] + size_mask[:lDBB])]
        read_words = Signal(NW)
        for w in range(NW):
            m.d.comb += read_words[w].eq((lower[2:] <= w) & (upper[2:] >= w) if NW > 1 else 1)

        # The W beat stays on the bus (WREADY rises once its words are written), so it needs no register.
        wdata = data.ArrayLayout(32, NW)(s.wdata)
        wstrb = data.ArrayLayout(4, NW)(s.wstrb)
        rdata = Signal(data.ArrayLayout(32, NW))
        aw_done, w_done = Signal(), Signal()

        def worst(r):
            return resp.eq(Mux(r > resp, r, resp))

        # The R beat: word w is cleared when a beat starts and loaded when its read returns (a flop's
        # synchronous reset and enable: no select in front of the register).
        beat_start, word_back = Signal(), Signal()
        for w in range(NW):
            with m.If(beat_start):
                m.d.sync += rdata[w].eq(0)
            with m.Elif(word_back & (pick == w)):
                m.d.sync += rdata[w].eq(lite.rdata)

        prefer_read = Signal()                     # both AW and AR wait: alternate

        m.d.comb += [lite.awprot.eq(0), lite.arprot.eq(0), lite.awaddr.eq(word_addr), lite.araddr.eq(word_addr),
                     lite.wdata.eq(wdata[pick]), lite.wstrb.eq(wstrb[pick]),
                     s.bid.eq(bid), s.bresp.eq(resp), s.rid.eq(rid), s.rdata.eq(rdata), s.rresp.eq(resp),
                     s.rlast.eq(last_beat)]

        step = Signal()                            # on to the burst's next beat (Write-Word, Read-Data)
        with m.If(step):
            m.d.sync += [addr.eq(next_addr), left.eq(left - 1), last_beat.eq(left == 1)]

        # The bridge's states, one flop each (one-hot: a decision reads its own state's flop, no decoder).
        names = ("idle", "write_data", "write_word", "write_lite_resp", "write_resp",
                 "read_beat", "read_word", "read_lite_data", "read_data")
        st = {n: Signal(name=f"st_{n}", init=n == "idle") for n in names}

        def goto(here, there):
            return [st[here].eq(0), st[there].eq(1)]

        with m.If(st["idle"]):
            # the burst registers follow AW or AR every idle cycle (unused until a burst is taken), so their
            # enables do not wait on the valids
            take_w = Signal()
            m.d.comb += [take_w.eq(s.awvalid & ~(s.arvalid & prefer_read)),
                         s.awready.eq(take_w), s.arready.eq(s.arvalid & ~take_w)]
            m.d.sync += [bid.eq(s.awid), rid.eq(s.arid),
                         *take(Mux(take_w, s.awaddr, s.araddr), Mux(take_w, s.awlen, s.arlen),
                               Mux(take_w, s.awsize, s.arsize), Mux(take_w, s.awburst, s.arburst),
                               Mux(take_w, s.awlen == 0, s.arlen == 0))]
            with m.If(take_w):
                m.d.sync += [prefer_read.eq(1), *goto("idle", "write_data")]
            with m.Elif(s.arvalid):
                m.d.sync += [prefer_read.eq(0), *goto("idle", "read_beat")]

        # --- write: per W beat, its words, then WREADY; after the last beat the B response ------------
        with m.If(st["write_data"] & s.wvalid):
            m.d.sync += [aw_done.eq(0), w_done.eq(0), pending.eq(Cat(wstrb[w].any() for w in range(NW))),
                         *goto("write_data", "write_word")]
        with m.If(st["write_word"]):
            with m.If(pending == 0):
                m.d.comb += [s.wready.eq(1), step.eq(~last_beat)]
                m.d.sync += [st["write_word"].eq(0), st["write_resp"].eq(last_beat), st["write_data"].eq(~last_beat)]
            with m.Else():
                m.d.comb += [lite.awvalid.eq(~aw_done), lite.wvalid.eq(~w_done)]
                aw_ok = aw_done | lite.awready
                w_ok = w_done | lite.wready
                m.d.sync += [aw_done.eq(aw_ok), w_done.eq(w_ok)]
                with m.If(aw_ok & w_ok):
                    m.d.sync += goto("write_word", "write_lite_resp")
        with m.If(st["write_lite_resp"]):
            m.d.comb += lite.bready.eq(1)
            with m.If(lite.bvalid):
                m.d.sync += [worst(lite.bresp), pending.bit_select(pick, 1).eq(0), aw_done.eq(0), w_done.eq(0),
                             *goto("write_lite_resp", "write_word")]
        with m.If(st["write_resp"]):
            m.d.comb += s.bvalid.eq(1)
            with m.If(s.bready):
                m.d.sync += goto("write_resp", "idle")

        # --- read: per beat, its words, then the R beat ------------------------------------------------------
        with m.If(st["read_beat"]):
            m.d.comb += beat_start.eq(1)
            m.d.sync += [pending.eq(read_words), resp.eq(0), *goto("read_beat", "read_word")]
        with m.If(st["read_word"]):
            with m.If(pending == 0):
                m.d.sync += goto("read_word", "read_data")
            with m.Else():
                m.d.comb += lite.arvalid.eq(1)
                with m.If(lite.arready):
                    m.d.sync += goto("read_word", "read_lite_data")
        with m.If(st["read_lite_data"]):
            m.d.comb += lite.rready.eq(1)
            with m.If(lite.rvalid):
                m.d.comb += word_back.eq(1)
                m.d.sync += [worst(lite.rresp), pending.bit_select(pick, 1).eq(0),
                             *goto("read_lite_data", "read_word")]
        with m.If(st["read_data"]):
            m.d.comb += s.rvalid.eq(1)
            with m.If(s.rready):
                m.d.comb += step.eq(~last_beat)
                m.d.sync += [st["read_data"].eq(0), st["idle"].eq(last_beat), st["read_beat"].eq(~last_beat)]
        return m
