"""DDR element streams in: `DdrReader` (DDR -> binary32 elements); the way out is `hdl.ddrwrite.DdrWriter`.

The DDR ends of the controller's passes (docs/architecture.md, "The NPU in RTL"): one element per cycle on a
`lib.stream`, one AXI4 read port on the other side. The command layouts of both directions live here.

`DdrReader` reads ``n`` elements stored as binary32 (`DdrFormat.F32`, raw bits), binary16
(`DdrFormat.F16`, converted exactly as ``1 * fp32(h)``) or scaled INT4 (`DdrFormat.INT4`: two values per
byte, low nibble first as `sim.numerics.unpack_int4`; value ``i`` is multiplied by the binary16 scale
``i >> log2_group`` of the scale array at ``saddr``: ``fp32(q) * fp32(scale)``, exact (a 4-bit integer
times an 11-bit significand has at most 14 bits), so ``0 * negative scale = -0.0`` exactly as NumPy
float32). Both are one `hdl.fp.IntScaleMul(4)`, bit-identical to ``FpMul(IntToFp(q), F16ToF32(s))``
(every 4-bit integer, and 1, is exact in binary32). It reads the
data (and the scales) through one `hdl.axi.AxiReadDma` in commands of at most one burst
(``axi_max_burst_beats`` beats), each a multiple of the beat size except the last, so the start-aligned
beats of consecutive commands form one continuous start-aligned byte stream. Data and scale commands are
interleaved on the DMA; a small tag FIFO routes the DMA's output beats to a data beat buffer or a scale
beat buffer.

**Wide commands.** A binary32 command with ``wide`` set leaves on ``o_beat`` instead of ``o_elem``: beats of up to
`wide_lanes` elements (an L2 word's four where the AXI beat holds them) a cycle, in lanes ``0 .. n-1`` of an L2
word, ``last`` on the command's final beat (the controller's DMA into L2, `hdl.controller.passes`). ``wide`` is
ignored for the other formats.

**Credit rule (as `hdl.fetch`).** A command is sent to the DMA only when its buffer has room for its
beats plus every beat of that buffer already in flight, so the DMA's output (and the shared R channel
behind it) is always accepted at once, whatever ``o_elem``'s consumer does. No alignment is required:
the DMA realigns any byte address (F32/F16 data at an odd address, odd ``saddr``, all work).
"""

from __future__ import annotations

import enum

from amaranth import Cat, Const, Elaboratable, Module, Mux, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .axi import AxiReadDma, AxiReadSignature
from .config import HardwareConfig, ceil_log2
from .fp import IntScaleMul
from .l2 import LANES, beat_layout

__all__ = ["DdrFormat", "N_BITS", "DdrReader", "reader_cmd_layout", "writer_cmd_layout",
           "elem_layout", "wide_beat_layout", "wide_lanes", "reader_buffer_beats"]

N_BITS = 24                        # element count width of a command


class DdrFormat(enum.IntEnum):
    """Element formats in DDR (the ``fmt`` field of the commands; `hdl.ddrwrite.DdrWriter` takes F32 and F16)."""
    F32 = 0
    F16 = 1
    INT4 = 2


def reader_cmd_layout(hw: HardwareConfig) -> data.StructLayout:
    return data.StructLayout({"addr": unsigned(hw.axi_addr_bits), "n": unsigned(N_BITS), "fmt": unsigned(2),
                              "saddr": unsigned(hw.axi_addr_bits), "log2_group": unsigned(5), "wide": 1})


def writer_cmd_layout(hw: HardwareConfig) -> data.StructLayout:
    """A `hdl.ddrwrite.DdrWriter` command: ``n`` elements from ``addr`` in format ``fmt``, contiguous; or, with
    ``stride`` != 0, each element's low byte on its own at ``addr + k·stride`` (INT8 ATTN's V rows)."""
    return data.StructLayout({"addr": unsigned(hw.axi_addr_bits), "n": unsigned(N_BITS), "fmt": unsigned(1),
                              "stride": unsigned(N_BITS)})


def elem_layout() -> data.StructLayout:
    """A `DdrReader` output element: binary32 bits, ``last`` on a command's n-th, ``err`` if built from a
    non-OKAY read (data or scale)."""
    return data.StructLayout({"data": unsigned(32), "last": 1, "err": 1})


def wide_beat_layout() -> data.StructLayout:
    """A `DdrReader` output beat of a wide command: ``n`` (1 .. `wide_lanes`) binary32 elements in lanes
    ``0 .. n-1`` of ``data`` (an L2 word, `hdl.l2.beat_layout`), ``last`` on the command's final beat, ``err`` if
    built from a non-OKAY read."""
    return data.StructLayout({**dict(beat_layout().members), "err": 1})


def wide_lanes(hw: HardwareConfig) -> int:
    """Elements a wide command delivers per cycle: an L2 word's `LANES`, or an AXI beat's binary32 words where a
    beat holds fewer."""
    return min(LANES, hw.bytes_per_beat // 4)


def reader_buffer_beats(hw: HardwareConfig) -> int:
    """Depth of `DdrReader`'s data beat buffer: four bursts, so that with one burst-sized command per free
    burst of room the buffer covers ~4 bursts of DDR latency (binary32 at one element per cycle on tiny:
    128 cycles)."""
    return 4 * hw.axi_max_burst_beats



class _BeatBuffer(Elaboratable):
    """A FIFO of `depth` (a power of two) entries of `width` bits behind a registered output, timed as
    `amaranth.lib.fifo.SyncFIFOBuffered` (an entry written in cycle t is on ``r_data`` with ``r_rdy`` in t + 2 at
    the earliest), with no ``w_rdy``: the reader's credit rule keeps it from overflowing. The memory's fill is
    two pointers, each only counting up, so ``r_en`` reaches a pointer's enable and the output register's,
    never an up/down count."""

    def __init__(self, width: int, depth: int):
        self._width, self._depth = width, depth
        self.w_en, self.w_data = Signal(name="w_en"), Signal(width, name="w_data")
        self.r_en, self.r_rdy, self.r_data = Signal(name="r_en"), Signal(name="r_rdy"), Signal(width, name="r_data")

    def elaborate(self, platform):
        m = Module()
        ab = ceil_log2(self._depth)
        m.submodules.mem = mem = Memory(shape=unsigned(self._width), depth=self._depth, init=[])
        wr, rd = mem.write_port(), mem.read_port(domain="sync")
        wp, rp = Signal(ab + 1), Signal(ab + 1)   # entries written into / read from the memory
        filled, pull = Signal(), Signal()         # the memory holds an entry; it moves to the output register
        m.d.comb += [filled.eq(wp != rp), pull.eq(filled & (~self.r_rdy | self.r_en)),
                     wr.en.eq(self.w_en), wr.addr.eq(wp[:ab]), wr.data.eq(self.w_data),
                     rd.en.eq(pull), rd.addr.eq(rp[:ab]), self.r_data.eq(rd.data)]
        with m.If(self.w_en):
            m.d.sync += wp.eq(wp + 1)
        with m.If(pull):
            m.d.sync += rp.eq(rp + 1)
        m.d.sync += self.r_rdy.eq(filled | (self.r_rdy & ~self.r_en))
        return m


class DdrReader(wiring.Component):
    """DDR -> binary32 element stream (F32 raw, F16 exact, scaled INT4).

    Parameters
    ----------
    hw : HardwareConfig
        Bus widths and ``axi_max_burst_beats`` (the DMA command size; the data buffer holds
        `reader_buffer_beats` beats, the scale buffer two bursts).

    Members
    -------
    i_cmd : In(stream.Signature(reader_cmd_layout(hw)))
        ``addr`` (byte address of the data), ``n`` (elements; 0 is accepted and produces nothing),
        ``fmt`` (`DdrFormat`), ``saddr`` (byte address of the binary16 scales, INT4 only), ``log2_group``
        (values per scale = 2**log2_group, INT4 only). Accepted when the previous command has sent every
        element into the conversion pipeline (its last elements may still be in the pipeline).
    o_elem : Out(stream.Signature(elem_layout()))
    o_beat : Out(stream.Signature(wide_beat_layout()))
        A wide binary32 command's elements (``wide``: `wide_lanes` a cycle, the last beat with the rest).
    axi : Out(AxiReadSignature)
    o_busy : Out(1)
        A command is accepted and not all its elements have left ``o_elem``.
    o_error : Out(1)
        Sticky: some read returned SLVERR/DECERR since reset.

    Throughput: one element per cycle while the DDR keeps up, `wide_lanes` for a wide command (a burst-sized
    command costs one extra beat when the address is not beat-aligned). Latency from a buffered beat to ``o_elem``
    or ``o_beat``: `latency` cycles.
    """

    def __init__(self, hw: HardwareConfig):
        self._hw = hw
        self._chunk_beats = hw.axi_max_burst_beats
        super().__init__({
            "i_cmd": In(stream.Signature(reader_cmd_layout(hw))),
            "o_elem": Out(stream.Signature(elem_layout())),
            "o_beat": Out(stream.Signature(wide_beat_layout())),
            "axi": Out(AxiReadSignature.from_config(hw)),
            "o_busy": Out(1),
            "o_error": Out(1),
        })

    hw = property(lambda self: self._hw)

    @property
    def latency(self) -> int:
        """Conversion pipeline depth: an element leaves ``o_elem`` this many cycles after its beat is
        consumed (a register for the element's fields, then one IntScaleMul)."""
        return 1 + IntScaleMul.LATENCY

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        B = hw.bytes_per_beat
        lb = ceil_log2(B)
        W = hw.axi_data_bits
        CB = self._chunk_beats                 # beats per DMA command
        C = CB * B                             # bytes per DMA command
        depth = reader_buffer_beats(hw)        # data beat buffer depth
        sdepth = 2 * CB                        # scale beat buffer depth
        nbyte_bits = N_BITS + 3                # 4 * n bytes

        m.submodules.dma = dma = AxiReadDma(hw, len_bits=C.bit_length(), cmd_ready_registered=True)
        wiring.connect(m, wiring.flipped(self.axi), dma.axi)
        m.submodules.dbuf = dbuf = _BeatBuffer(W + 1, depth)
        m.submodules.sbuf = sbuf = _BeatBuffer(W + 1, sdepth)
        T = hw.axi_max_outstanding + 2         # tags: commands issued and not yet delivered, at most
        m.submodules.tags = tags = _BeatBuffer(1, 1 << ceil_log2(T))

        # --- command ----------------------------------------------------------------------------------
        fmt = Signal(2)
        int4 = Signal(name="int4")             # fmt == INT4, registered with it
        E = wide_lanes(hw)
        wide = Signal(name="wide")             # a wide binary32 command: E elements a take
        left = Signal(N_BITS)                  # elements not yet sent into the pipeline
        last = Signal()                        # left <= (E if wide else 1): the next take is the last, with left
        more = Signal()                        # left != 0, registered with left
        lmask = Signal(N_BITS)                 # values per group - 1 (saturated to N_BITS bits)
        d_addr, s_addr = Signal(hw.axi_addr_bits), Signal(hw.axi_addr_bits)
        d_rem, s_rem = Signal(nbyte_bits, name="d_rem"), Signal(nbyte_bits, name="s_rem")   # not yet requested

        # a command is taken into registers; the cycle after (`setup`) its data bytes and its group count's
        # shifted count and rounding flag, the cycle after that (`setup2`) its scale bytes, so the shifter, the
        # rounding add and the requests' arithmetic are paths of their own
        cmd = Signal.like(self.i_cmd.p)
        setup = Signal()
        c_mask = Signal(N_BITS)                # values per group - 1, registered with the command
        g_whole = Signal(N_BITS, name="g_whole")     # n >> log2_group
        g_part = Signal(name="g_part")               # a partial group at the end
        c_dbytes = Signal(nbyte_bits)
        with m.Switch(cmd.fmt):
            with m.Case(DdrFormat.F32):
                m.d.comb += c_dbytes.eq(cmd.n << 2)
            with m.Case(DdrFormat.F16):
                m.d.comb += c_dbytes.eq(cmd.n << 1)
            with m.Default():
                m.d.comb += c_dbytes.eq((cmd.n + 1) >> 1)
        setup2 = Signal()                      # the cycle after: the requests' counts
        m.d.comb += self.i_cmd.ready.eq(~more & ~setup & ~setup2)
        with m.If(self.i_cmd.valid & self.i_cmd.ready):
            new = self.i_cmd.p
            new_wide = new.wide & (new.fmt == DdrFormat.F32)
            m.d.sync += [cmd.eq(new), setup.eq(1), left.eq(new.n), more.eq(new.n != 0), wide.eq(new_wide),
                         last.eq(Mux(new_wide, new.n <= E, new.n == 1)),
                         c_mask.eq(((Const(1, 1) << new.log2_group) - 1)[:N_BITS])]

        # --- requests: burst-sized DMA commands, each only when its buffer has room -------------------
        # Per stream: the bytes and beats of its next request (registered beside the bytes left, so the
        # credit check is one sum and one compare), and `used`, the beats its buffer holds plus those in flight
        # (a beat arriving moves from one to the other: only a request and a read change the sum).
        def next_request(rem):
            nb = Mux(rem > C, C, rem)
            return nb, (nb + B - 1) >> lb
        d_nb, s_nb = Signal(range(C + 1), name="d_nb"), Signal(range(C + 1), name="s_nb")
        d_beats, s_beats = Signal(range(CB + 1), name="d_beats"), Signal(range(CB + 1), name="s_beats")
        d_any, s_any = Signal(name="d_any"), Signal(name="s_any")          # a request of that size is due
        d_calc, s_calc = Signal(name="d_calc"), Signal(name="s_calc")      # `nb`/`beats`/`any` made from `rem`
        d_used = Signal(range(depth + CB + 1), name="d_used")
        s_used = Signal(range(sdepth + CB + 1), name="s_used")
        # `fit`: used + beats <= the buffer's depth, registered: made from the cycle's `used` and `beats` (a read
        # in that cycle counts the cycle after). While `beats` is being made (`calc`) it counts CB beats, the
        # most a request has (a smaller request may wait a cycle for it); a stream never requests in that cycle
        # or the next.
        d_fit, s_fit = Signal(name="d_fit"), Signal(name="s_fit")
        d_ok, s_ok = Signal(), Signal()
        m.d.comb += [d_ok.eq(d_any & d_fit), s_ok.eq(s_any & s_fit)]
        tag_room = Signal(init=1, name="tag_room")    # fewer than T tags
        prefer_s = Signal()                    # alternate between data and scales when both can go
        pick_s = Signal()
        m.d.comb += pick_s.eq(s_ok & (~d_ok | prefer_s))
        m.d.comb += [
            dma.i_cmd.valid.eq((d_ok | s_ok) & tag_room),
            dma.i_cmd.p.addr.eq(Mux(pick_s, s_addr, d_addr)),
            dma.i_cmd.p.nbytes.eq(Mux(pick_s, s_nb, d_nb)),
            tags.w_data.eq(pick_s),
        ]
        issue = Signal()
        m.d.comb += [issue.eq(dma.i_cmd.valid & dma.i_cmd.ready), tags.w_en.eq(issue)]
        # the tags' count and whether it is below T, registered (the two cases of a request made beside it)
        n_tags = Signal(range(T + 1), name="n_tags")
        left_tags = Signal(range(T + 1), name="left_tags")
        m.d.comb += left_tags.eq(n_tags - tags.r_en)
        m.d.sync += [n_tags.eq(left_tags + issue),
                     tag_room.eq((left_tags < T - 1) | (~issue & (left_tags == T - 1)))]

        # A request takes its bytes off `rem` and holds the stream for a cycle (`calc`), in which the next
        # request's size is made from the registered `rem`: a stream requests at most every other cycle, which
        # a burst-sized request at one beat per cycle leaves unnoticed.
        def calc(rem, nb, beats, any_, flag):
            with m.If(flag):
                v_nb, v_beats = next_request(rem)
                m.d.sync += [nb.eq(v_nb), beats.eq(v_beats), any_.eq(rem != 0), flag.eq(0)]
        calc(d_rem, d_nb, d_beats, d_any, d_calc)
        calc(s_rem, s_nb, s_beats, s_any, s_calc)
        with m.If(issue):
            m.d.sync += prefer_s.eq(~pick_s)
            with m.If(pick_s):
                m.d.sync += [s_addr.eq(s_addr + s_nb), s_rem.eq(s_rem - s_nb), s_any.eq(0), s_calc.eq(1)]
            with m.Else():
                m.d.sync += [d_addr.eq(d_addr + d_nb), d_rem.eq(d_rem - d_nb), d_any.eq(0), d_calc.eq(1)]
        # the data bytes the cycle after a command is taken, the scale bytes the cycle after that (no request
        # runs then: both streams are done)
        with m.If(setup):
            m.d.sync += [setup.eq(0), setup2.eq(1), fmt.eq(cmd.fmt), int4.eq(cmd.fmt == DdrFormat.INT4),
                         lmask.eq(c_mask), d_addr.eq(cmd.addr),
                         s_addr.eq(cmd.saddr), d_rem.eq(c_dbytes), d_calc.eq(1),
                         g_whole.eq(cmd.n >> cmd.log2_group), g_part.eq((cmd.n & c_mask) != 0)]
        with m.If(setup2):
            m.d.sync += [setup2.eq(0), s_rem.eq(Mux(int4, (g_whole + g_part) << 1, 0)),
                         s_calc.eq(1)]

        # --- DMA output: routed by the tag of its command; always accepted (credits) -------------------
        beat = dma.o_data
        m.d.comb += [
            beat.ready.eq(1),
            dbuf.w_data.eq(Cat(beat.p.data, beat.p.err)), sbuf.w_data.eq(Cat(beat.p.data, beat.p.err)),
            dbuf.w_en.eq(beat.valid & ~tags.r_data), sbuf.w_en.eq(beat.valid & tags.r_data),
            tags.r_en.eq(beat.valid & beat.p.last),
        ]

        # `used` + a request's beats - a read, with the sums made before the late request and read bits choose
        def credit(fit, used, beats, lim, issued, r_en, calcing):
            total = Signal(range(lim + CB + 1), name=fit.name + "_sum")
            m.d.comb += total.eq(used + beats)
            m.d.sync += used.eq(Mux(r_en, Mux(issued, total - 1, used - 1), Mux(issued, total, used)))
            need = Mux(calcing, used + CB, total)
            m.d.sync += fit.eq(need <= lim)
        credit(d_fit, d_used, d_beats, depth, issue & ~pick_s, dbuf.r_en, d_calc)
        credit(s_fit, s_used, s_beats, sdepth, issue & pick_s, sbuf.r_en, s_calc)

        # --- element extraction ----------------------------------------------------------------------
        en = Signal()                          # conversion pipeline advance
        nib = Signal(lb + 1)                   # nibble position of the next element in the head data beat
        sidx = Signal(max(lb - 1, 1))          # binary16 position of the current scale in the head scale beat
        grp_left = Signal(N_BITS)              # elements of the current group after the next one
        group_end = Signal()                   # the next element ends its group (grp_left == 0, registered)
        can = Signal()
        m.d.comb += can.eq(more & dbuf.r_rdy & (~int4 | sbuf.r_rdy))
        take = Signal()
        m.d.comb += take.eq(can & en)
        step = Signal(range(8 * E + 1))       # nibbles a take moves
        m.d.comb += step.eq(Mux(fmt == DdrFormat.F32, Mux(wide, 8 * E, 8), Mux(fmt == DdrFormat.F16, 4, 1)))
        nib_next = Signal(lb + 2)
        m.d.comb += nib_next.eq(nib + step)
        # the next element ends the head data beat (nib + step reaches the beat's end), registered with nib: nib
        # is a multiple of step, so it is (nib + 2 * step) mod 2**(lb + 1) == 0 after a take
        beat_end = Signal()
        scale_beat_end = Signal()              # sidx == B/2 - 1 (the head scale beat's last scale), registered
        if B <= 2:
            m.d.comb += scale_beat_end.eq(1)
        # the buffers' reads: what the head beats would do, from registers, then the pipeline's advance alone
        d_pop, s_pop = Signal(name="d_pop", attrs={"keep": 1}), Signal(name="s_pop", attrs={"keep": 1})
        m.d.comb += [d_pop.eq(can & (beat_end | last)),
                     s_pop.eq(can & int4 & ((group_end & scale_beat_end) | last)),
                     dbuf.r_en.eq(d_pop & en), sbuf.r_en.eq(s_pop & en)]
        with m.If(take):
            m.d.sync += [left.eq(left - Mux(wide, E, 1)), last.eq(Mux(wide, left <= 2 * E, left == 2)), more.eq(~last),
                         nib.eq(nib_next[:lb + 1]), beat_end.eq((nib + 2 * step)[:lb + 1] == 0)]
            with m.If(group_end):
                m.d.sync += [sidx.eq(sidx + 1), grp_left.eq(lmask), group_end.eq(lmask == 0)]
                if B > 2:
                    m.d.sync += scale_beat_end.eq(sidx == B // 2 - 2)
            with m.Else():
                m.d.sync += [grp_left.eq(grp_left - 1), group_end.eq(grp_left == 1)]
            with m.If(last):
                m.d.sync += [nib.eq(0), sidx.eq(0)]
                if B > 2:
                    m.d.sync += scale_beat_end.eq(0)
        with m.If(setup):                      # a command's first group; its first element at nibble 0
            c_step = Mux(cmd.fmt == DdrFormat.F32, Mux(wide, 8 * E, 8), Mux(cmd.fmt == DdrFormat.F16, 4, 1))
            m.d.sync += [grp_left.eq(c_mask), group_end.eq(c_mask == 0), beat_end.eq(c_step == 1 << (lb + 1))]

        head, shead = dbuf.r_data, sbuf.r_data
        w32 = head[:32] if B == 4 else head[:W].word_select(nib[3:], 32)
        lgE = ceil_log2(E)
        wE = head[:32 * E] if B == 4 * E else head[:W].word_select(nib[3 + lgE:], 32 * E)    # a wide take's
        h16 = head[:W].word_select(nib[2:], 16)
        q4 = head[:W].word_select(nib, 4)
        scale = shead[:W].word_select(sidx, 16) if B > 2 else shead[:16]
        err = head[W] | (int4 & shead[W])

        # --- conversion: the element's fields into registers (x), then q * fp32(scale) (INT4) or 1 * fp32(h)
        # (F16, exact) in one IntScaleMul; F32 bits bypass in a delay line of the same depth -----------------
        x_valid, x_a, x_b = Signal(name="x_valid"), Signal(4, name="x_a"), Signal(16, name="x_b")
        side = data.StructLayout({"fmt": 2, "raw": 32 * E, "last": 1, "err": 1, "wide": 1, "n": 3})
        stages = [Signal(side, name="side0")]
        with m.If(en):
            m.d.sync += [x_valid.eq(take), x_a.eq(Mux(int4, q4, 1)), x_b.eq(Mux(int4, scale, h16)),
                         stages[0].fmt.eq(fmt), stages[0].raw.eq(Mux(wide, wE, w32)), stages[0].last.eq(last),
                         stages[0].err.eq(err), stages[0].wide.eq(wide), stages[0].n.eq(Mux(last, left, E))]
        m.submodules.mul = mul = IntScaleMul(4)
        m.d.comb += [mul.en.eq(en), mul.i_valid.eq(x_valid), mul.i_a.eq(x_a), mul.i_b.eq(x_b)]
        for i in range(mul.latency):
            s = Signal(side, name=f"side{i + 1}")
            with m.If(en):
                m.d.sync += s.eq(stages[-1])
            stages.append(s)
        assert 1 + mul.latency == self.latency
        out = stages[-1]
        o, ob = self.o_elem, self.o_beat
        m.d.comb += [
            o.valid.eq(mul.o_valid & ~out.wide),
            o.p.data.eq(Mux(out.fmt == DdrFormat.F32, out.raw[:32], mul.o_y)),
            o.p.last.eq(out.last), o.p.err.eq(out.err),
            ob.valid.eq(mul.o_valid & out.wide),
            ob.p.data.eq(out.raw), ob.p.n.eq(out.n), ob.p.last.eq(out.last), ob.p.err.eq(out.err),
            en.eq(~mul.o_valid | Mux(out.wide, ob.ready, o.ready)),
        ]

        in_pipe = Signal(range(self.latency + 2))
        m.d.sync += in_pipe.eq(in_pipe + take - (mul.o_valid & en))
        m.d.comb += [self.o_busy.eq(more | (in_pipe != 0)), self.o_error.eq(dma.o_error)]
        return m
