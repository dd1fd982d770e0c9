"""The DDR write end of the controller's passes: `DdrWriter` (binary32 elements -> DDR, as binary32 or
binary16) and the AXI4 write engine under it, `AxiWriteDma`.

`DdrWriter` takes one command ``{addr, n, fmt}`` at a time and ``n`` binary32 elements on ``i_elem`` (one
per cycle sustained). Each element goes through an input register and a `hdl.fp.F32ToF16`-deep pipeline
(binary16 results for `DdrFormat.F16`, the raw bits delayed alongside for `DdrFormat.F32`) into a packer that
places it at its **DDR byte lane**: element ``k`` lands at byte ``(addr + k * size) mod B`` of its beat (``B`` =
bytes per beat), so no realignment shifter is needed. A beat leaves when it is full or when it holds the command's
last element. `AxiWriteDma` writes those DDR-aligned beats as INCR bursts and makes the byte strobes from
the command, so no byte outside ``[addr, addr + n * size)`` is written whatever the packer left in the
unused lanes.

`AxiWriteDma` splits a command ``{addr, nbytes}`` (any byte alignment) into bursts at every 4 KB boundary
and at ``axi_max_burst_beats``; an address is issued only while fewer than ``axi_max_outstanding`` bursts
await their B response, and a burst's W beats are sent only after its AW handshake (the burst length is
queued on AW acceptance), so AW always precedes its W beats. All bursts use ID 0 (B responses in order).
``o_done`` pulses when the command's last B response has arrived; a B response other than OKAY (SLVERR,
DECERR) sets the sticky ``o_error``.

A command with a **stride** (``i_stride`` != 0 on `AxiWriteDma`, ``stride`` on `DdrWriter`) scatters bytes
instead: byte k of ``nbytes`` goes to ``addr + k·stride``, each in a burst of one beat whose only strobe is its
lane, the bursts pipelined like any others (INT8 ATTN's V rows, `sim.numerics.KvInt8Layout`: a position's byte
in each of the head's rows).
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from .axi import AXI_4K, AxiBurst, AxiWriteSignature, DmaComponent
from .config import HardwareConfig, ceil_log2
from .ddrio import N_BITS, DdrFormat, writer_cmd_layout
from .fp import F32ToF16

__all__ = ["AxiWriteDma", "DdrWriter", "ELEM_BYTES"]

ELEM_BYTES = {DdrFormat.F32: 4, DdrFormat.F16: 2}
"""Bytes per element in DDR for each `DdrWriter` format (also the required address alignment)."""




class AxiWriteDma(DmaComponent):
    """AXI4 write DMA: one byte-addressed command at a time, DDR-aligned data beats in.

    Parameters
    ----------
    cfg : HardwareConfig
        Bus widths, ``axi_max_burst_beats``, ``axi_max_outstanding``.
    len_bits : int
        Width of a command's byte count.

    Members
    -------
    i_cmd : In(stream.Signature(hdl.axi.read_command_layout))
        Accepted only when the DMA is idle (``o_busy`` low).
    i_stride : In(unsigned(len_bits))
        Sampled with the command: 0 for contiguous bytes; else the command scatters ``nbytes`` single bytes,
        byte k at ``addr + k * i_stride``.
    i_data : In(stream.Signature(unsigned(axi_data_bits)))
        Exactly ``ceil(((addr mod B) + nbytes) / B)`` beats per command (none for ``nbytes = 0``), **aligned to
        DDR**: beat ``k`` holds the bytes of the beat-aligned address ``(addr - addr mod B) + k * B``. Lanes
        outside ``[addr, addr + nbytes)`` are ignored (their strobes are 0). With a stride, ``nbytes`` beats:
        beat k holds byte k at lane ``(addr + k * i_stride) mod B`` (the other lanes are ignored).
    axi : Out(AxiWriteSignature)
    o_done : Out(1)
        One-cycle pulse when every B response of the command has arrived (the cycle after acceptance for
        ``nbytes = 0``); ``o_busy`` falls in the same cycle.
    o_busy : Out(1)
        From the command's acceptance to its ``o_done``.
    o_error : Out(1)
        Sticky: some B response was SLVERR or DECERR since reset.

    Notes
    -----
    One AW every other cycle (each burst is sized in the cycle before its address) and one W beat per cycle;
    the W side has no bubble between bursts once the next burst's address has been accepted.
    ``i_data.ready`` depends combinationally on ``wready``.
    """

    def __init__(self, cfg: HardwareConfig, *, len_bits: int = 24):
        self._check_len_bits(len_bits)           # before the members that take its width
        super().__init__(cfg, len_bits, {
            "i_stride": In(unsigned(len_bits)),
            "i_data": In(stream.Signature(unsigned(cfg.axi_data_bits))),
            "axi": Out(AxiWriteSignature.from_config(cfg)),
            "o_done": Out(1),
            "o_busy": Out(1),
            "o_error": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        cfg = self._cfg
        B = cfg.bytes_per_beat
        lb = ceil_log2(B)
        beats_bits = self._len_bits - lb + 2       # ceil((offset + nbytes) / B) fits
        axi = self.axi
        full = (1 << B) - 1

        # --- command --------------------------------------------------------------------------------
        busy = Signal()
        cmd = self.i_cmd.p
        off = cmd.addr[:lb] if lb else Const(0, 1)
        end = Signal(lb + 1)                       # bytes used in the last beat: (off + nbytes - 1) mod B + 1
        m.d.comb += end.eq((off + cmd.nbytes - 1)[:lb] + 1)
        nbeats = Signal(beats_bits)
        m.d.comb += nbeats.eq((cmd.nbytes + off + (B - 1)) >> lb)
        first_strb = Signal(B)                     # strobes of the command's first and last beats
        last_strb = Signal(B)
        wleft = Signal(beats_bits)                 # W beats of the command not yet sent
        w_first, w_last = Signal(), Signal()       # the next W beat is the command's first / last
        m.d.comb += self.i_cmd.ready.eq(~busy)
        cur = Signal(cfg.axi_addr_bits)            # next burst's beat-aligned address
        rem = Signal(beats_bits)                   # beats left to address
        active = Signal()                          # bursts left to address
        outstanding = Signal(range(cfg.axi_max_outstanding + 1))   # AW accepted, B not yet received
        to_4k = Signal(range(AXI_4K // B + 1))     # beats from `cur` to the next 4 KB boundary
        # a scattering command: its next byte's address (`saddr`), stepped by `stride` at each AW
        scatter = Signal()
        stride = Signal(self._len_bits)
        saddr = Signal(cfg.axi_addr_bits)
        with m.If(self.i_cmd.valid & self.i_cmd.ready):
            n_beats = Mux(self.i_stride != 0, cmd.nbytes, nbeats)
            m.d.sync += [busy.eq(1), cur.eq(cmd.addr & ~(B - 1)), rem.eq(n_beats), wleft.eq(n_beats),
                         scatter.eq(self.i_stride != 0), stride.eq(self.i_stride), saddr.eq(cmd.addr),
                         w_first.eq(1), w_last.eq(nbeats == 1), active.eq(cmd.nbytes != 0),
                         to_4k.eq((AXI_4K - (cmd.addr[:12] & ~(B - 1))) >> lb),
                         first_strb.eq((Const(full, B) << off)[:B]),
                         last_strb.eq(((Const(1, B + 1) << end) - 1)[:B])]

        # --- AW: min(remaining, max burst, beats to the next 4 KB boundary) ---------------------------
        # The next burst is sized in a cycle of its own (`sized` low), from registers into registers: a
        # command's first burst one cycle after its acceptance, each further burst one cycle after the
        # address before it.
        Mx = cfg.axi_max_burst_beats
        sized = Signal()                           # `burst`, `page_end` and `final` describe the next burst
        burst = Signal(range(Mx + 1))
        page_end = Signal()                        # the burst ends at a 4 KB boundary
        final = Signal()                           # the command's last burst
        with m.If(active & ~sized):
            m.d.sync += sized.eq(1)
            with m.If(scatter):                    # a beat a burst, never across 4 KB
                m.d.sync += [burst.eq(1), page_end.eq(0), final.eq(rem == 1)]
            with m.Elif((rem <= Mx) & (rem <= to_4k)):
                m.d.sync += [burst.eq(rem), page_end.eq(rem == to_4k), final.eq(1)]
            with m.Elif(to_4k < Mx):
                m.d.sync += [burst.eq(to_4k), page_end.eq(1), final.eq(0)]
            with m.Else():
                m.d.sync += [burst.eq(Mx), page_end.eq(to_4k == Mx), final.eq(0)]

        # Burst lengths (awlen, and awlen == 0) travel from AW to W, with a scattered byte's lane; an entry
        # exists only after its AW handshake.
        lw = max(lb, 1)
        m.submodules.lens = lens = fifo.SyncFIFO(width=9 + lw, depth=cfg.axi_max_outstanding)
        m.d.comb += [
            axi.awid.eq(0), axi.awaddr.eq(Mux(scatter, saddr & ~(B - 1), cur)), axi.awlen.eq(burst - 1),
            axi.awsize.eq(lb),
            axi.awburst.eq(AxiBurst.INCR), axi.awlock.eq(0),
            axi.awcache.eq(0b0011),                # normal non-cacheable bufferable, as the read side
            axi.awprot.eq(0), axi.awqos.eq(0),
            axi.awvalid.eq(active & sized & (outstanding < cfg.axi_max_outstanding) & lens.w_rdy),
            lens.w_data.eq(Cat(axi.awlen, burst == 1, saddr[:lw] if lb else Const(0, 1))),
        ]
        aw_fire = axi.awvalid & axi.awready
        m.d.comb += lens.w_en.eq(aw_fire)
        with m.If(aw_fire):
            m.d.sync += [cur.eq(cur + (burst << lb)), rem.eq(rem - burst), sized.eq(0), saddr.eq(saddr + stride),
                         to_4k.eq(Mux(page_end, AXI_4K // B, to_4k - burst))]
            with m.If(final):
                m.d.sync += active.eq(0)

        # --- W: DDR-aligned beats, strobes from the command ------------------------------------------
        # A burst's awlen leaves `lens` with its first W beat; its other beats count against a copy, and
        # whether the next beat ends the burst is registered (`b_last`), so the FIFO's read reaches only
        # `wlast` and those registers.
        b_first = Signal(init=1)                   # the next W beat starts a burst (its awlen: `lens`' head)
        b_last = Signal()                          # the next W beat ends its burst (when not `b_first`)
        b_left = Signal(8)                         # beats of the current burst after the next one
        head_len, head_one, head_lane = lens.r_data[:8], lens.r_data[8], lens.r_data[9:]
        strb = Signal(B)
        m.d.comb += strb.eq(Mux(scatter, (Const(1, B) << head_lane)[:B],
                                Mux(w_first, first_strb, full) & Mux(w_last, last_strb, full)))
        w_can = Signal()
        m.d.comb += w_can.eq(lens.r_rdy | ~b_first)
        m.d.comb += [
            axi.wdata.eq(self.i_data.p), axi.wstrb.eq(strb), axi.wlast.eq(Mux(b_first, head_one, b_last)),
            axi.wvalid.eq(self.i_data.valid & w_can),
            self.i_data.ready.eq(axi.wready & w_can),
        ]
        w_fire = axi.wvalid & axi.wready
        m.d.comb += lens.r_en.eq(w_fire & b_first)
        with m.If(w_fire):
            m.d.sync += [wleft.eq(wleft - 1), w_first.eq(0), w_last.eq(wleft == 2), b_first.eq(axi.wlast)]
            with m.If(b_first):
                m.d.sync += [b_left.eq(head_len - 1), b_last.eq(head_len == 1)]
            with m.Else():
                m.d.sync += [b_left.eq(b_left - 1), b_last.eq(b_left == 1)]

        # --- B ----------------------------------------------------------------------------------------
        m.d.comb += axi.bready.eq(1)
        b_fire = axi.bvalid & axi.bready
        m.d.sync += outstanding.eq(outstanding + aw_fire - b_fire)
        with m.If(b_fire & axi.bresp[1]):          # SLVERR and DECERR both have bit 1 set
            m.d.sync += self.o_error.eq(1)

        done = Signal()
        m.d.comb += done.eq(busy & ~active & (outstanding == 0))
        with m.If(done):
            m.d.sync += busy.eq(0)
        m.d.comb += [self.o_done.eq(done), self.o_busy.eq(busy)]
        return m


class DdrWriter(wiring.Component):
    """binary32 element stream -> DDR, as binary32 (raw bits) or binary16 (`hdl.fp.F32ToF16`, RNE).

    Parameters
    ----------
    hw : HardwareConfig
        Bus widths, burst and outstanding limits (of the `AxiWriteDma` inside).

    Members
    -------
    i_cmd : In(stream.Signature(writer_cmd_layout(hw)))
        ``addr`` (byte address in DDR; 4-byte aligned for F32, 2-byte aligned for F16: the address bits
        below the element size are ignored), ``n`` (elements, 0 .. 2**24 - 1; 0 is accepted and only pulses
        ``o_done``), ``fmt`` (`DdrFormat.F32` or `DdrFormat.F16`), ``stride`` (0; else each element's low
        byte goes on its own to ``addr + k * stride``, any byte address, and ``fmt`` is not used). Accepted
        when idle (``o_busy`` low).
    i_elem : In(stream.Signature(unsigned(32)))
        The command's ``n`` binary32 elements, in order. Taken only while a command is active.
    axi : Out(AxiWriteSignature)
    o_done : Out(1)
        One-cycle pulse after the command's last B response.
    o_busy : Out(1)
        From command acceptance to ``o_done``.
    o_error : Out(1)
        Sticky: some B response was SLVERR or DECERR since reset.

    Throughput: one element per cycle sustained for both formats while AXI keeps up (a beat holds
    ``B / 4`` or ``B / 2`` elements); with a stride, a byte every other cycle (an AW each) while fewer than
    ``axi_max_outstanding`` bursts await their B. An element reaches the packer `latency` cycles after
    ``i_elem``.
    """

    def __init__(self, hw: HardwareConfig):
        self._hw = hw
        super().__init__({
            "i_cmd": In(stream.Signature(writer_cmd_layout(hw))),
            "i_elem": In(stream.Signature(unsigned(32))),
            "axi": Out(AxiWriteSignature.from_config(hw)),
            "o_done": Out(1),
            "o_busy": Out(1),
            "o_error": Out(1),
        })

    hw = property(lambda self: self._hw)

    @property
    def latency(self) -> int:
        """Cycles from an element's ``i_elem`` transfer to the packer (the input register and the `F32ToF16`
        depth, both formats)."""
        return 1 + F32ToF16.LATENCY

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        B = hw.bytes_per_beat
        lb = ceil_log2(B)
        W = hw.axi_data_bits
        len_bits = N_BITS + 2                      # 4 * (2**24 - 1) bytes

        m.submodules.dma = dma = AxiWriteDma(hw, len_bits=len_bits)
        wiring.connect(m, wiring.flipped(self.axi), dma.axi)
        # Beats wait here for W: decouples the element pipeline from wready (no combinational path
        # from the AXI port to i_elem.ready); four entries keep one element per cycle through a full-rate
        # handshake.
        m.submodules.beats = beats = fifo.SyncFIFOBuffered(width=W, depth=4)
        m.d.comb += [dma.i_data.valid.eq(beats.r_rdy), dma.i_data.p.eq(beats.r_data), beats.r_en.eq(dma.i_data.ready)]

        # --- command --------------------------------------------------------------------------------
        cmd = self.i_cmd.p
        f16 = Signal()
        scatter = Signal()                         # a command with a stride: a byte a beat
        step = Signal(max(lb, 1))                  # the stride's lanes (stride mod B)
        left = Signal(N_BITS)                      # elements not yet taken from i_elem
        more = Signal()                            # left != 0, registered with it
        pos = Signal(lb)                           # byte lane of the next element to pack
        to_pack = Signal(N_BITS)                   # elements not yet packed
        caddr = Signal(hw.axi_addr_bits)
        strided = cmd.stride != 0
        m.d.comb += caddr.eq(Mux(strided, cmd.addr, Mux(cmd.fmt == DdrFormat.F16, cmd.addr & ~1, cmd.addr & ~3)))
        # The DMA's command is registered (`dma_cmd`, `dma_stride`, valid `dma_pend`): it reaches the DMA the
        # cycle after the acceptance, so that the stride's test and the address and byte count it selects are
        # not on the way into the DMA's burst arithmetic. A command is taken while that register is empty and the
        # DMA idle.
        dma_pend = Signal()
        dma_cmd = Signal.like(dma.i_cmd.p)
        dma_stride = Signal.like(dma.i_stride)
        m.d.comb += [
            dma.i_cmd.valid.eq(dma_pend), dma.i_cmd.p.eq(dma_cmd), dma.i_stride.eq(dma_stride),
            self.i_cmd.ready.eq(~dma_pend & dma.i_cmd.ready),
        ]
        with m.If(dma.i_cmd.valid & dma.i_cmd.ready):
            m.d.sync += dma_pend.eq(0)
        with m.If(self.i_cmd.valid & self.i_cmd.ready):
            m.d.sync += [dma_pend.eq(1), dma_cmd.addr.eq(caddr), dma_stride.eq(cmd.stride),
                         dma_cmd.nbytes.eq(Mux(strided, cmd.n,
                                               Mux(cmd.fmt == DdrFormat.F16, cmd.n << 1, cmd.n << 2)))]
            m.d.sync += [f16.eq(~strided & (cmd.fmt == DdrFormat.F16)), left.eq(cmd.n), more.eq(cmd.n != 0),
                         to_pack.eq(cmd.n), pos.eq(caddr[:lb]), scatter.eq(strided),
                         step.eq(cmd.stride[:lb] if lb else 0)]

        # --- element pipeline: an input register, F32ToF16, raw bits alongside ------------------------
        # The element is registered before the conversion (`e0`, `e0_v`): its source's select (the pass
        # engine's stage and sink) and F32ToF16's first stage would be one path otherwise.
        m.submodules.cvt = cvt = F32ToF16()
        en = Signal()
        take = Signal()
        e0, e0_v = Signal(32), Signal()
        m.d.comb += [
            self.i_elem.ready.eq(en & more),
            take.eq(self.i_elem.valid & self.i_elem.ready),
            cvt.en.eq(en), cvt.i_valid.eq(e0_v), cvt.i_a.eq(e0),
        ]
        with m.If(en):
            m.d.sync += [e0.eq(self.i_elem.p), e0_v.eq(take)]
        with m.If(take):
            m.d.sync += [left.eq(left - 1), more.eq(left != 1)]
        raw = e0
        for i in range(cvt.latency):
            r = Signal(32, name=f"raw{i + 1}")
            with m.If(en):
                m.d.sync += r.eq(raw)
            raw = r
        # The packer takes the pipeline's output whenever the beat FIFO has room (even if this element
        # does not complete a beat: simpler, and the FIFO drains one beat per cycle).
        m.d.comb += en.eq(~cvt.o_valid | beats.w_rdy)

        # --- packer: DDR byte lanes -------------------------------------------------------------------
        acc = Signal(W)                            # the beat being filled
        merged = Signal(W)
        m.d.comb += merged.eq(acc)
        with m.If(scatter):
            m.d.comb += merged.word_select(pos, 8).eq(raw[:8])
        with m.Elif(f16):
            m.d.comb += merged.word_select(pos[1:], 16).eq(cvt.o_y[:16])
        with m.Else():
            m.d.comb += (merged.word_select(pos[2:], 32) if lb > 2 else merged).eq(raw)
        size = Mux(f16, 2, 4)
        nxt = Signal(lb + 1)
        m.d.comb += nxt.eq(Mux(scatter, pos + step, pos + size))
        pack = Signal()
        m.d.comb += pack.eq(cvt.o_valid & en)
        last = to_pack == 1
        # a scattered byte is a beat of its own
        m.d.comb += [beats.w_data.eq(merged), beats.w_en.eq(pack & (scatter | nxt[lb] | last))]
        with m.If(pack):
            m.d.sync += [acc.eq(merged), pos.eq(nxt[:lb]), to_pack.eq(to_pack - 1)]

        m.d.comb += [self.o_done.eq(dma.o_done), self.o_busy.eq(dma_pend | dma.o_busy), self.o_error.eq(dma.o_error)]
        return m
