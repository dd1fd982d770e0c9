"""WGEMM in the NPU: the systolic tile engine (`hdl.systolic.SystolicEngine`) fed from the row-major INT4
matrices the packer writes and from token activations quantised into its own memory (docs/systolic.md,
"In the NPU").

One command is one *token tile*: up to R = ``systolic_rows`` tokens, whose INT8 activations and block
exponents the `hdl.quant.ActQuantizer` has written (``i_act`` / ``i_exp``, token slot ``i_tok``), times one
matrix, row tile by row tile (2C = ``2 * systolic_cols`` output rows each)::

    DDR rows (row-major) ─▶ AxiReadDma per weight port ─▶ row buffers (chunk of KC columns × 2C/P rows,
                              double-buffered) ─▶ k-steps (2C/P nibbles per port, masked past cols) ─▶ i_wgt[p]
    DDR scales (row-major) ─▶ AxiReadDma (port P) ─▶ scale memory [tile bank][group] × 2C ─▶ i_scale
    activation memory [k] × R INT8 (one lane per token), exponent memory [block] × R ─▶ i_act, i_exp
    o_y (R beats of 2C binary32 per tile) ─▶ per token row: L2 row command, elements through FpAdd
                                             (accm: old + y; else -0 + y = y) ─▶ o_y (to an `ElemWriter`)

- **Weights.** The engine wants a tile's weights k-major (a k-step is the 2C weights of one column); DDR
  holds them row-major (the GEMV engine's layout; no second copy of the model). Each weight port fetches,
  per chunk of KC columns, one transfer per row of its 2C/P rows (``KC/2`` bytes, realigned by the DMA) into
  one small memory per row (a DMA beat = W consecutive columns of one row per word), and reads all its rows'
  memories at once to emit k-steps: the transposition costs no bandwidth, only one DDR transfer per row and
  chunk. Two chunk banks let the fetch of chunk c+1 overlap the k-steps of chunk c. Columns past the
  matrix are masked to 0 (exactly `sim.systolic.tile_streams`' padding); rows past the matrix are not
  fetched and their outputs are dropped.
- **Scales.** Per row tile, one transfer per row (its ``ngroups`` binary16 scales are contiguous) on port P
  = ``wgt_ports``, written scale by scale into the tile's bank of a memory whose word is one group's 2C
  scales, i.e. the engine's ``i_scale`` payload. Two tile banks.
- **Activations.** The quantiser's words (W columns of one token) are written lane by lane (one per cycle,
  the quantiser's own rate) into a memory whose word is one column's R activations, i.e. the engine's
  ``i_act`` payload; exponents likewise (``i_exp``). A command starts once every write has landed.
- **Outputs.** Token row t of the tile at output rows ``n0 ..`` goes to L2 elements
  ``dst + t * stride + n0 ..`` (``min(2C, rows - n0)`` of them): one `o_wcmd` per row (and one `o_rcmd`
  for its old values with accm), the elements through one `FpAdd` in row order. Rows of padding tokens are
  dropped.

Members
-------
i_cmd : In(stream(gemm_command_layout))
i_tok : In(range(R))                     the token slot `i_act` / `i_exp` write
i_act : In(stream(act_write_layout))     from the quantiser (ready: a word is being written lane by lane)
i_exp : In(stream(exp_write_layout))     always ready
m_axi<p> : Out(AxiReadSignature), p <= wgt_ports (the last one reads the scales)
o_wcmd, o_rcmd : Out(stream(l2.cmd_layout))   L2 row write (and, with accm, read) commands
i_old : In(stream(32))                   with accm: the old values of the rows, in order
o_y : Out(stream(32))                    the elements to write, in order
o_busy : Out(1)                          a command is accepted and not all its elements have left `o_y`
o_error : Out(1)                         sticky: a weight or scale read got an AXI error response
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .axi import AxiReadDma, AxiReadSignature
from .config import HardwareConfig, ceil_log2
from .fp import NEG_ZERO, FpAdd
from .gemv import LEN_BITS
from .l2 import cmd_layout, l2_geometry
from .quant import act_write_layout, exp_write_layout
from .systolic import EXP_BITS, EngineGeometry, SystolicEngine

__all__ = ["GemmUnit", "gemm_command_layout", "chunk_columns"]



def gemm_command_layout(hw: HardwareConfig) -> data.StructLayout:
    """One token tile of a WGEMM: the matrix (DDR byte addresses of its rows and scales, its shape), the
    tile's tokens and where their output rows go in L2 (element addresses)."""
    _, nb, _ = l2_geometry(hw)
    return data.StructLayout({
        "wbase": unsigned(hw.axi_addr_bits), "sbase": unsigned(hw.axi_addr_bits),
        "rows": unsigned(nb), "cols": range(hw.gemv_max_cols + 1),
        "ntok": range(hw.systolic_rows + 1),
        "dst": unsigned(nb), "stride": unsigned(nb + 1), "accm": 1,
    })


def chunk_columns(hw: HardwareConfig) -> int:
    """KC, the columns a weight port fetches per row and chunk: a whole number of segments and of beats, one
    burst (``axi_max_burst_beats``) per row, but at most 1/16 of the longest row so that small configurations
    keep small buffers (and see several chunks)."""
    geo = EngineGeometry(hw)
    W = hw.weights_per_beat
    unit = max(geo.seg, W)
    return max(unit, min(hw.axi_max_burst_beats * W, hw.gemv_max_cols // 16) // unit * unit)


def _pow2(name, v):
    if v < 1 or v & (v - 1):
        raise ValueError(f"the NPU's GEMM unit needs {name} to be a power of two, not {v}")


def _prefetch(m, name, width, depth=4):
    """A memory-read-to-stream stage: the caller drives the read address and `issue` (only when `room`);
    the read data (one cycle later) is written into the returned FIFO in the cycle `landing` is high."""
    q = fifo.SyncFIFOBuffered(width=width, depth=depth)
    m.submodules[name] = q
    issue, landing = Signal(name=f"{name}_issue"), Signal(name=f"{name}_landing")
    # the reads issued and not yet taken out of the FIFO (q.level + landing), and whether one more fits
    # (total < depth), both registered: the sum of the step's changes, not a sum over the FIFO's level
    total = Signal(range(depth + 1), name=f"{name}_total")
    room = Signal(init=1, name=f"{name}_room")
    total_next = total + issue - (q.r_en & q.r_rdy)
    m.d.sync += [landing.eq(issue), total.eq(total_next), room.eq(total_next < depth)]
    m.d.comb += q.w_en.eq(landing)
    return q, issue, landing, room


def _expect_fifo(m, name, layout, depth):
    q = fifo.SyncFIFOBuffered(width=data.Layout.cast(layout).size, depth=depth)
    m.submodules[name] = q
    return q, data.View(layout, q.r_data)


class _Countdown:
    """The items left after the current one (of `count`, loaded at `go`) and whether the current one is the
    last, both registered: a sequencer's end is one flag, not a compare against ``count - 1``."""

    def __init__(self, m, name, count, go):
        self._m = m
        self.left = Signal.like(count, name=f"{name}_left")
        self.last = Signal(name=f"{name}_last")
        with m.If(go):
            m.d.sync += [self.left.eq(count - 1), self.last.eq(count == 1)]

    def step(self):
        """The current item is done (call under its condition)."""
        self._m.d.sync += [self.left.eq(self.left - 1), self.last.eq(self.left == 1)]


class _Banks:
    """Two buffer banks passed from a loader (claims one, then fills it), a receiver (marks it complete) and a
    reader (empties it, which frees it). ``claimed(b)``, ``complete(b)``: the bank's state; ``take(b)``,
    ``done(b)``, ``free(b)``: the three parties' one-cycle pulses (comb statements in the current context)."""

    def __init__(self, m, name):
        self._m = m
        self._claim, self._full = Signal(2, name=f"{name}_claim"), Signal(2, name=f"{name}_full")
        self._take, self._set, self._free = (Signal(2, name=f"{name}_{k}") for k in ("take", "set", "free"))
        m.d.sync += [self._claim.eq((self._claim | self._take) & ~self._free),
                     self._full.eq((self._full | self._set) & ~self._free)]

    claimed = lambda self, b: self._claim.bit_select(b, 1)      # noqa: E731
    complete = lambda self, b: self._full.bit_select(b, 1)      # noqa: E731

    def _pulse(self, sig, b):
        self._m.d.comb += sig.eq(Mux(b, 0b10, 0b01))

    def take(self, b):
        self._pulse(self._take, b)

    def done(self, b):
        self._pulse(self._set, b)

    def free(self, b):
        self._pulse(self._free, b)


class GemmUnit(wiring.Component):
    """See the module docstring."""

    def __init__(self, hw: HardwareConfig, *, chunk_beats: int | None = None):
        try:
            geo = EngineGeometry(hw)
            for name, v in (("systolic_cols", hw.systolic_cols), ("systolic_rows", hw.systolic_rows),
                            ("weight_group", hw.weight_group), ("act_block", hw.act_block),
                            ("gemv_max_cols", hw.gemv_max_cols)):
                _pow2(name, v)
            if hw.axi_ports <= geo.wgt_ports:
                raise ValueError(f"the GEMM unit needs {geo.wgt_ports} weight ports and one scale port; the "
                                 f"config has {hw.axi_ports} AXI ports")
            W = hw.weights_per_beat
            kc = chunk_columns(hw) if chunk_beats is None else chunk_beats * W
            if kc % geo.seg or kc % W or (kc // W) & (kc // W - 1):
                raise ValueError(f"a chunk of {kc} columns must be a power-of-two number of beats ({W} columns) "
                                 f"holding whole segments ({geo.seg})")
            self._engine = SystolicEngine(hw)
        except ValueError:
            self._MustUse__silence = True
            raise
        self._hw, self._geo, self._kc = hw, geo, kc
        R = geo.rows
        members = {
            "i_cmd": In(stream.Signature(gemm_command_layout(hw))),
            "i_tok": In(range(max(2, R))),
            "i_act": In(stream.Signature(act_write_layout(hw))),
            "i_exp": In(stream.Signature(exp_write_layout(hw))),
            "o_wcmd": Out(stream.Signature(cmd_layout(hw))),
            "o_rcmd": Out(stream.Signature(cmd_layout(hw))),
            "i_old": In(stream.Signature(unsigned(32))),
            "o_y": Out(stream.Signature(unsigned(32))),
            "o_busy": Out(1), "o_error": Out(1),
        }
        for p in range(geo.wgt_ports + 1):
            members[f"m_axi{p}"] = Out(AxiReadSignature.from_config(hw))
        super().__init__(members)

    geometry = property(lambda self: self._geo)
    chunk = property(lambda self: self._kc)

    @property
    def axi_ports(self) -> int:
        return self._geo.wgt_ports + 1

    def elaborate(self, platform):
        m = Module()
        hw, g = self._hw, self._geo
        R, C2, P = g.rows, 2 * g.cols, g.wgt_ports
        W, B = hw.weights_per_beat, hw.bytes_per_beat
        KC = self._kc
        CB = KC // W                                  # beats per row and chunk
        RP = C2 // P                                  # rows per weight port
        SPB = g.steps_per_beat
        max_cols = hw.gemv_max_cols
        max_groups = max(1, max_cols // g.group)
        max_blocks = max(1, max_cols // g.block)
        lseg, lgrp, lblk = ceil_log2(g.seg), ceil_log2(g.group), ceil_log2(g.block)
        lc2, lrp, lkc = ceil_log2(C2), ceil_log2(RP), ceil_log2(KC)
        A = hw.axi_addr_bits
        m.submodules.engine = eng = self._engine

        # --- the command --------------------------------------------------------------------------------
        c = Signal(gemm_command_layout(hw))
        nseg = Signal(range(max_cols // g.seg + 2))
        kpad = Signal(range(max_cols + g.seg + 1))
        ngroups = Signal(range(max_groups + 2))
        nblocks = Signal(range(max_blocks + 2))
        ntiles = Signal(c.rows.shape().width)
        row_bytes = Signal(range(max_cols // 2 + 2))
        busy = Signal()
        go = Signal()                                 # one-cycle pulse: every sequencer starts
        setup = Signal()
        writing = Signal()                            # activation words still being written lane by lane
        m.d.comb += self.i_cmd.ready.eq(~busy & ~setup)
        m.d.sync += go.eq(0)
        with m.If(self.i_cmd.valid & self.i_cmd.ready):
            m.d.sync += [c.eq(self.i_cmd.p), setup.eq(1)]
        with m.If(setup & ~writing):
            n = c.cols
            m.d.sync += [setup.eq(0), busy.eq(1), go.eq(1),
                         nseg.eq((n + g.seg - 1) >> lseg), kpad.eq(((n + g.seg - 1) >> lseg) << lseg),
                         ngroups.eq((n + g.group - 1) >> lgrp), nblocks.eq((n + g.block - 1) >> lblk),
                         ntiles.eq((c.rows + C2 - 1) >> lc2), row_bytes.eq((n + 1) >> 1)]
        done_parts = []                               # every sequencer's "finished" flag

        def sequencer(name):
            """A flag that is high from `go` until the sequencer clears it."""
            run = Signal(name=f"{name}_run")
            with m.If(go):
                m.d.sync += run.eq(1)
            done_parts.append(~run)
            return run

        # --- activations and exponents: written by the quantiser, read per k-step / block -------------------
        m.submodules.act_mem = act_mem = Memory(shape=unsigned(R * 8), depth=max_cols, init=[])
        act_w = act_mem.write_port(granularity=8)
        act_r = act_mem.read_port()
        m.submodules.exp_mem = exp_mem = Memory(shape=unsigned(R * EXP_BITS), depth=max_blocks, init=[])
        exp_w = exp_mem.write_port(granularity=EXP_BITS)
        exp_r = exp_mem.read_port()
        lane = Signal(range(W))
        have = Signal()
        word = Signal.like(self.i_act.p)
        word_tok = Signal.like(self.i_tok)            # the slot travels with the word (i_tok may move on)
        m.d.comb += [self.i_act.ready.eq(~have), writing.eq(have | self.i_act.valid)]
        with m.If(self.i_act.valid & ~have):
            m.d.sync += [word.eq(self.i_act.p), word_tok.eq(self.i_tok), have.eq(1), lane.eq(0)]
        # the write port's lane and byte through registers (the byte's W:1 select is a path of its own): a lane
        # is written the cycle after its turn, while `word` and `word_tok` still hold it; the last lands the
        # cycle after `have` falls, before `go` (a cycle after `writing` falls) and the walkers' first read
        wr_en = Signal(R, name="act_wr_en")
        wr_lane, wr_byte = Signal.like(lane, name="act_wr_lane"), Signal(8, name="act_wr_byte")
        m.d.sync += [wr_en.eq(Mux(have, 1 << word_tok, 0)), wr_lane.eq(lane), wr_byte.eq(word.q[lane].as_unsigned())]
        m.d.comb += [act_w.addr.eq(Cat(wr_lane, word.addr) if W > 1 else word.addr),
                     act_w.data.eq(Cat(*[wr_byte] * R)), act_w.en.eq(wr_en)]
        with m.If(have):
            m.d.sync += lane.eq(lane + 1)
            with m.If(lane == W - 1):
                m.d.sync += have.eq(0)
        m.d.comb += [self.i_exp.ready.eq(1), exp_w.addr.eq(self.i_exp.p.addr),
                     exp_w.data.eq(Cat(*[self.i_exp.p.e[:EXP_BITS]] * R)),
                     exp_w.en.eq(Mux(self.i_exp.valid, 1 << self.i_tok, 0))]

        def walker(name, count, per_tile_len, rd, out):
            """Per row tile, read words 0 .. per_tile_len - 1 of `rd` into the engine stream `out`."""
            run = sequencer(name)
            q, issue, _, room = _prefetch(m, f"{name}_q", len(out.p.as_value()))
            idx = Signal(range(max_cols + g.seg + 1), name=f"{name}_idx", reset_less=True)
            # per_tile_len - 2 and whether per_tile_len is 1, registered at go; whether idx is the tile's last
            # word, registered beside idx (all loaded at go before their first use, so without a reset)
            idx_m2 = Signal.like(idx, name=f"{name}_idx_m2", reset_less=True)
            one = Signal(name=f"{name}_one", reset_less=True)
            at_last = Signal(name=f"{name}_at_last", reset_less=True)
            tiles = _Countdown(m, f"{name}_tiles", count, go)
            with m.If(go):
                m.d.sync += [idx_m2.eq(per_tile_len - 2), one.eq(per_tile_len == 1)]
            m.d.comb += [issue.eq(run & room & ~go), rd.addr.eq(idx), q.w_data.eq(rd.data),
                         out.valid.eq(q.r_rdy), out.p.eq(q.r_data), q.r_en.eq(out.ready)]
            with m.If(go | (run & room)):
                m.d.sync += [idx.eq(Mux(go | at_last, 0, idx + 1)),
                             at_last.eq(Mux(go, per_tile_len == 1, Mux(at_last, one, idx == idx_m2)))]
            with m.If(issue):
                with m.If(at_last):
                    tiles.step()
                    with m.If(tiles.last):
                        m.d.sync += run.eq(0)

        walker("act", ntiles, kpad, act_r, eng.i_act)
        walker("exp", ntiles, nblocks, exp_r, eng.i_exp)

        # tile commands: nseg per row tile
        cmd_run = sequencer("cmd")
        cmd_tiles = _Countdown(m, "cmd_tiles", ntiles, go)
        m.d.comb += [eng.i_cmd.valid.eq(cmd_run & ~go), eng.i_cmd.p.eq(nseg)]
        with m.If(eng.i_cmd.valid & eng.i_cmd.ready):
            cmd_tiles.step()
            with m.If(cmd_tiles.last):
                m.d.sync += cmd_run.eq(0)

        errors = []

        def port_dma(p):
            dma = AxiReadDma(hw, len_bits=LEN_BITS)
            m.submodules[f"dma{p}"] = dma
            wiring.connect(m, dma.axi, wiring.flipped(getattr(self, f"m_axi{p}")))
            errors.append(dma.o_error)
            return dma

        # per DMA transfer: its row, its beats (`none`: 0) and whether the row is the bank's last
        expect = data.StructLayout({"row": range(max(2, C2)), "nbeats": range(max(CB, max_groups) + 2), "none": 1,
                                    "last": 1})
        exp_depth = 2 * (hw.axi_max_outstanding + 2)

        # --- scales: per row tile, a transfer per row into the tile's bank ---------------------------------
        self._scale_port(m, port_dma(P), c, go, sequencer, ntiles, ngroups, expect, exp_depth)

        # --- weights: per port, chunks of KC columns of its RP rows, transposed into k-steps ----------------
        for p in range(P):
            self._weight_port(m, p, port_dma(p), c, go, sequencer, ntiles, kpad, row_bytes, expect, exp_depth,
                              R=R, C2=C2, RP=RP, W=W, B=B, KC=KC, CB=CB, SPB=SPB, lrp=lrp, lkc=lkc, A=A)

        # --- outputs: per token row, an L2 row command and its elements through the adder ---------------------
        drained = self._outputs(m, c, go, sequencer, ntiles)
        with m.If(busy & ~go & Cat(*done_parts).all() & drained):
            m.d.sync += busy.eq(0)
        m.d.comb += [self.o_busy.eq(busy | setup), self.o_error.eq(Cat(*errors).any())]
        return m

    def _scale_port(self, m, sdma, c, go, sequencer, ntiles, ngroups, expect, exp_depth):
        """The scales through port `sdma`: per row tile, a loader claims a bank of the scale memory and
        requests one transfer per row (`expect` entries announce them), a receiver writes each beat's B/2
        binary16 scales one per cycle into the row's lane and completes the bank after the tile's last row,
        a reader streams the complete bank to the engine group by group and frees it."""
        hw, g = self._hw, self._geo
        C2, B = 2 * g.cols, hw.bytes_per_beat
        max_groups = max(1, hw.gemv_max_cols // g.group)
        A = hw.axi_addr_bits
        eng = self._engine
        m.submodules.scale_mem = scale_mem = Memory(shape=unsigned(C2 * 16), depth=2 * max_groups, init=[])
        sc_w = scale_mem.write_port(granularity=16)
        sc_r = scale_mem.read_port()
        sbanks = _Banks(m, "s")
        # loader
        sl_run = sequencer("sload")
        sl_bank, sl_row = Signal(), Signal(range(C2 + 1))
        sl_addr = Signal(A)                           # the current row's scales
        sl_r = Signal(c.rows.shape().width)           # the current row's index in the matrix
        sl_active = Signal()                          # the current tile's bank is claimed
        sx, sx_v = _expect_fifo(m, "sexp", expect, exp_depth)
        sl_real = Signal()                            # sl_r < c.rows, registered
        sl_tiles = _Countdown(m, "sl_tiles", ntiles, go)
        with m.If(go):
            m.d.sync += [sl_row.eq(0), sl_bank.eq(0), sl_addr.eq(c.sbase), sl_r.eq(0), sl_active.eq(0),
                         sl_real.eq(c.rows != 0)]
        with m.If(sl_run & ~go & ~sl_active & ~sbanks.claimed(sl_bank)):
            sbanks.take(sl_bank)
            m.d.sync += sl_active.eq(1)
        s_nbytes = ngroups << 1
        real = sl_real
        sx_data = Signal(expect)
        m.d.comb += [sx_data.row.eq(sl_row), sx_data.nbeats.eq(Mux(real, (s_nbytes + B - 1) >> ceil_log2(B), 0)),
                     sx_data.none.eq(sx_data.nbeats == 0),
                     sx_data.last.eq(sl_row == C2 - 1), sx.w_data.eq(sx_data),
                     sdma.i_cmd.p.addr.eq(sl_addr), sdma.i_cmd.p.nbytes.eq(s_nbytes)]
        s_go = sl_active & sx.w_rdy & (~real | sdma.i_cmd.ready)
        m.d.comb += [sx.w_en.eq(s_go), sdma.i_cmd.valid.eq(sl_active & sx.w_rdy & real)]
        with m.If(s_go):
            m.d.sync += [sl_row.eq(sl_row + 1), sl_r.eq(sl_r + 1), sl_addr.eq(sl_addr + s_nbytes),
                         sl_real.eq(sl_r + 1 < c.rows)]
            with m.If(sl_row == C2 - 1):
                m.d.sync += [sl_row.eq(0), sl_active.eq(0), sl_bank.eq(~sl_bank)]
                sl_tiles.step()
                with m.If(sl_tiles.last):
                    m.d.sync += sl_run.eq(0)
        # receiver: a beat's B/2 scales, one per cycle
        sr_bank = Signal()
        sr_beat = Signal(range(max_groups + 2))
        sr_lane = Signal(range(max(2, B // 2)))
        sr_word = Signal(8 * B)
        sr_have = Signal()
        # whether every beat of the head row is in, as registers beside sr_beat (the DMA's ready, and through it
        # its command queue, wait for no compare): `sr_first` no beat in yet (the head's `none` says), `sr_full`
        # sr_beat == nbeats once a beat is in
        sr_first, sr_full = Signal(init=1), Signal()
        with m.If(go):
            m.d.sync += [sr_bank.eq(0), sr_beat.eq(0), sr_first.eq(1)]
        head_done = Signal()
        m.d.comb += head_done.eq(sx.r_rdy & Mux(sr_first, sx_v.none, sr_full) & ~sr_have)
        with m.If(head_done):                          # every beat of this row is in (or it had none)
            m.d.comb += sx.r_en.eq(1)
            m.d.sync += [sr_beat.eq(0), sr_first.eq(1)]
            with m.If(sx_v.last):
                sbanks.done(sr_bank)
                m.d.sync += sr_bank.eq(~sr_bank)
        m.d.comb += sdma.o_data.ready.eq(sx.r_rdy & ~head_done & ~sr_have)
        # the beat being written and its last lane, registered as it is taken: every beat of a row but its last
        # holds B/2 of the row's groups, the last one the rest (group ngroups - 1 is in lane (ngroups - 1) %
        # (B/2)), so every lane written is a group of the row
        sr_wbeat = Signal.like(sr_beat)
        sr_stop = Signal.like(sr_lane)
        s_got = sdma.o_data.valid & sdma.o_data.ready
        last_beat = sr_beat + 1 == sx_v.nbeats
        with m.If(s_got):
            m.d.sync += [sr_word.eq(sdma.o_data.p.data), sr_have.eq(1), sr_lane.eq(0), sr_wbeat.eq(sr_beat),
                         sr_stop.eq(Mux(last_beat, (ngroups - 1)[:ceil_log2(B // 2)], B // 2 - 1) if B > 2 else 0)]
        sr_group = Cat(sr_lane, sr_wbeat) if B > 2 else sr_wbeat
        m.d.comb += [sc_w.addr.eq(Cat(sr_group[:ceil_log2(max_groups)] if max_groups > 1 else Const(0, 0), sr_bank)),
                     sc_w.data.eq(Cat(*[sr_word.word_select(sr_lane, 16)] * C2)),
                     sc_w.en.eq(Mux(sr_have, 1 << sx_v.row, 0))]
        with m.If(s_got):
            m.d.sync += [sr_beat.eq(sr_beat + 1), sr_first.eq(0), sr_full.eq(last_beat)]
        with m.If(sr_have):
            m.d.sync += sr_lane.eq(sr_lane + 1)
            with m.If(sr_lane == sr_stop):
                m.d.sync += sr_have.eq(0)
        # reader
        srd_run = sequencer("scale")
        sq, s_issue, _, s_room = _prefetch(m, "scale_q", C2 * 16)
        srd_bank, srd_g = Signal(), Signal(range(max_groups + 1))
        srd_g_last = Signal.like(srd_g)               # ngroups - 1, registered at go
        srd_tiles = _Countdown(m, "srd_tiles", ntiles, go)
        with m.If(go):
            m.d.sync += [srd_bank.eq(0), srd_g.eq(0), srd_g_last.eq(ngroups - 1)]
        m.d.comb += [s_issue.eq(srd_run & ~go & s_room & sbanks.complete(srd_bank)),
                     sc_r.addr.eq(Cat(srd_g[:ceil_log2(max_groups)] if max_groups > 1 else Const(0, 0), srd_bank)),
                     sq.w_data.eq(sc_r.data),
                     eng.i_scale.valid.eq(sq.r_rdy), eng.i_scale.p.eq(sq.r_data), sq.r_en.eq(eng.i_scale.ready)]
        with m.If(s_issue):
            m.d.sync += srd_g.eq(srd_g + 1)
            with m.If(srd_g == srd_g_last):
                sbanks.free(srd_bank)
                m.d.sync += [srd_g.eq(0), srd_bank.eq(~srd_bank)]
                srd_tiles.step()
                with m.If(srd_tiles.last):
                    m.d.sync += srd_run.eq(0)

    def _outputs(self, m, c, go, sequencer, ntiles):
        """Per token row of the engine's output beats: an L2 row write command (and, when accumulating, a
        read command for the old row), then the row's elements through the binary32 adder (``old + y``, or
        ``-0 + y``) into the output FIFO; padding token rows are dropped. Returns the flag that nothing is
        left in flight."""
        hw, g = self._hw, self._geo
        R, C2 = g.rows, 2 * g.cols
        eng = self._engine
        out_run = sequencer("out")
        o_t = Signal(range(R + 1))
        o_j = Signal(range(C2 + 1))
        o_row = Signal.like(c.dst)                    # L2 element of (token o_t, the tile's first row n0)
        o_issuing = Signal()                          # the current beat's elements are being issued
        # registered beside the counters: the tile's row count (and its last index), whether o_t is a real
        # token, the tile's last token row
        o_len, o_last_j = Signal(range(C2 + 1)), Signal(range(C2 + 1))
        real_tok, last_t = Signal(), Signal()
        o_jlast = Signal()                            # o_j == o_last_j, registered beside o_j
        o_tiles = _Countdown(m, "o_tiles", ntiles, go)

        # the rows after the current tile (rows - n0 - C2), less one, and the next tile's first L2 element
        # (dst + n0 + C2), stepped with the tiles, so that a tile's row count is one compare and select
        o_rem, o_rem_m1 = Signal(signed(len(c.rows) + 2)), Signal(signed(len(c.rows) + 2))
        o_next_row = Signal.like(o_row)

        def tile_rows(left, left_m1):
            big = left > C2
            m.d.sync += [o_len.eq(Mux(big, C2, left)), o_last_j.eq(Mux(big, C2 - 1, left_m1))]
        m.submodules.wcmdq = wq = fifo.SyncFIFOBuffered(width=len(self.o_wcmd.p.as_value()), depth=4)
        m.d.comb += [self.o_wcmd.valid.eq(wq.r_rdy), self.o_wcmd.p.eq(wq.r_data), wq.r_en.eq(self.o_wcmd.ready)]
        m.submodules.add = add = FpAdd()
        m.submodules.outq = outq = fifo.SyncFIFOBuffered(width=32, depth=add.latency + 4)
        inflight = Signal(range(add.latency + 3))    # in the operand registers or the adder
        rcmd_pend = Signal()
        with m.If(go):
            m.d.sync += [o_t.eq(0), o_row.eq(c.dst), o_issuing.eq(0),
                         real_tok.eq(c.ntok != 0), last_t.eq(R == 1),
                         o_rem.eq(c.rows - C2), o_rem_m1.eq(c.rows - (C2 + 1)), o_next_row.eq(c.dst + C2)]
            tile_rows(c.rows, c.rows - 1)
        beat = eng.o_y
        # a beat starts: a real token row queues its write (and read) command; a padding row is dropped
        start_beat = out_run & ~go & beat.valid & ~o_issuing & wq.w_rdy & ~rcmd_pend
        with m.If(start_beat):
            with m.If(real_tok):
                m.d.comb += wq.w_en.eq(1)
                m.d.sync += [o_issuing.eq(1), o_j.eq(0), o_jlast.eq(o_last_j == 0), rcmd_pend.eq(c.accm)]
        wcmd = Signal(cmd_layout(hw))
        m.d.comb += [wcmd.addr.eq(o_row), wcmd.n.eq(o_len), wq.w_data.eq(wcmd),
                     self.o_rcmd.valid.eq(rcmd_pend), self.o_rcmd.p.eq(wcmd)]
        with m.If(self.o_rcmd.valid & self.o_rcmd.ready):
            m.d.sync += rcmd_pend.eq(0)
        # room in outq for one more result (``outq.level + inflight < outq.depth``) as a register, kept from
        # the sum's steps: a fire adds one, a result leaving outq takes one
        o_total = Signal(range(outq.depth + 1))      # outq.level + inflight
        o_room = Signal(init=1)
        fire = o_issuing & ~rcmd_pend & (~c.accm | self.i_old.valid) & o_room
        total_next = o_total + fire - (self.o_y.valid & self.o_y.ready)
        m.d.sync += [o_total.eq(total_next), o_room.eq(total_next < outq.depth)]
        # the adder's operands through registers (the engine's row select and the old value are paths of
        # their own)
        op_v, op_a, op_b = Signal(), Signal(32, name="op_a"), Signal(32, name="op_b")
        m.d.sync += [op_v.eq(fire), op_a.eq(Mux(c.accm, self.i_old.p, NEG_ZERO)),
                     op_b.eq(beat.p.y[o_j] if C2 > 1 else beat.p.y[0])]
        m.d.comb += [add.en.eq(1), add.i_valid.eq(op_v), add.i_a.eq(op_a), add.i_b.eq(op_b),
                     self.i_old.ready.eq(fire & c.accm),
                     outq.w_en.eq(add.o_valid), outq.w_data.eq(add.o_y),
                     self.o_y.valid.eq(outq.r_rdy), self.o_y.p.eq(outq.r_data), outq.r_en.eq(self.o_y.ready)]
        m.d.sync += inflight.eq(inflight + fire - add.o_valid)
        end_beat = Signal()
        with m.If(fire):
            m.d.sync += [o_j.eq(o_j + 1), o_jlast.eq(o_j + 1 == o_last_j)]
            with m.If(o_jlast):
                m.d.sync += o_issuing.eq(0)
                m.d.comb += end_beat.eq(1)
        with m.If(start_beat & ~real_tok):
            m.d.comb += end_beat.eq(1)
        m.d.comb += beat.ready.eq(end_beat)
        with m.If(end_beat):
            m.d.sync += [o_t.eq(o_t + 1), o_row.eq(o_row + c.stride), real_tok.eq(o_t + 1 < c.ntok),
                         last_t.eq(o_t + 1 == R - 1)]
            with m.If(last_t):
                m.d.sync += [o_t.eq(0), o_row.eq(o_next_row),
                             real_tok.eq(c.ntok != 0), last_t.eq(R == 1),
                             o_rem.eq(o_rem - C2), o_rem_m1.eq(o_rem_m1 - C2), o_next_row.eq(o_next_row + C2)]
                o_tiles.step()
                tile_rows(o_rem, o_rem_m1)
                with m.If(o_tiles.last):
                    m.d.sync += out_run.eq(0)
        drained = ~outq.r_rdy & (inflight == 0) & ~wq.r_rdy
        return drained

    def _weight_port(self, m, p, dma, c, go, sequencer, ntiles, kpad, row_bytes, expect, exp_depth, *,
                     R, C2, RP, W, B, KC, CB, SPB, lrp, lkc, A):
        eng = self._engine
        lcb = ceil_log2(CB)
        assert RP == 1 << lrp
        mems = []
        for i in range(RP):
            mem = Memory(shape=unsigned(4 * W), depth=2 * CB, init=[])
            m.submodules[f"w{p}_row{i}"] = mem
            mems.append((mem.write_port(), mem.read_port()))
        banks = _Banks(m, f"w{p}")
        # DMA commands: per tile, per chunk, per row
        run = sequencer(f"wload{p}")
        bank = Signal(name=f"w{p}_lbank")
        row = Signal(range(RP + 1), name=f"w{p}_row")
        row_last = Signal(init=int(RP == 1), name=f"w{p}_row_last")  # row == RP - 1, registered beside row
        rem = Signal.like(row_bytes, name=f"w{p}_rem")             # a row's bytes from this chunk on
        rem_beats = Signal.like(row_bytes, name=f"w{p}_rem_beats")  # ceil(rem / B)
        raddr = Signal(A, name=f"w{p}_raddr")                      # this row's chunk
        taddr = Signal(A, name=f"w{p}_taddr")                      # the tile's first row (of this port)
        r = Signal.like(c.rows, name=f"w{p}_r")                    # this row's index in the matrix
        r0 = Signal.like(c.rows, name=f"w{p}_r0")                  # the tile's first row of this port
        active = Signal(name=f"w{p}_active")
        x, xv = _expect_fifo(m, f"w{p}_exp", expect, exp_depth)
        first_addr = c.wbase + ((row_bytes * p) << lrp)
        tiles = _Countdown(m, f"w{p}_tiles", ntiles, go)
        real = Signal(name=f"w{p}_real")                          # r < c.rows, registered with r
        with m.If(run & ~go & ~active & ~banks.claimed(bank)):
            banks.take(bank)
            m.d.sync += active.eq(1)
        # Registered in every cycle from the registers above: the chunk's transfer size and beats, whether it is
        # the row's last, whether the first row of this tile and of the next is in the matrix, and the values
        # the next chunk starts from (its rem, rem_beats; the next tile's first address and row; the step from
        # the chunk's last row to the next chunk's first, KC/2 - (RP - 1) * row_bytes, in two steps from
        # row_bytes, which is set with `go`). Each source changes at `go` or a chunk's last transfer and is read
        # from the second cycle after (the loader first claims its next bank, a cycle with `active` low), so a
        # chunk's end is a plain load of registers.
        ch_nbytes = Signal(range(KC // 2 + 1), name=f"w{p}_ch_nbytes")
        ch_nbeats = Signal(range(CB + 1), name=f"w{p}_ch_nbeats")
        ch_zero, ch_last = Signal(name=f"w{p}_ch_zero"), Signal(name=f"w{p}_ch_last")
        real_r0, real_r0n = Signal(name=f"w{p}_real_r0"), Signal(name=f"w{p}_real_r0n")
        rows_m1 = Signal.like(c.rows, name=f"w{p}_rows_m1")                      # c.rows - 1
        row_beats = Signal.like(row_bytes, name=f"w{p}_row_beats")               # ceil(row_bytes / B)
        rem_nx, rem_beats_nx = Signal.like(rem, name=f"w{p}_rem_nx"), Signal.like(rem, name=f"w{p}_rem_beats_nx")
        taddr_nx, r0_nx = Signal(A, name=f"w{p}_taddr_nx"), Signal(len(r0) + 1, name=f"w{p}_r0_nx")
        rows_bytes = Signal(len(row_bytes) + ceil_log2(RP), name=f"w{p}_rows_bytes")   # (RP - 1) * row_bytes
        cstep = Signal(signed(len(row_bytes) + ceil_log2(RP) + 2), name=f"w{p}_cstep")
        m.d.sync += [ch_nbytes.eq(Mux(rem > KC // 2, KC // 2, rem)),
                     ch_nbeats.eq(Mux(rem_beats > CB, CB, rem_beats)), ch_zero.eq(rem_beats == 0),
                     ch_last.eq(rem <= KC // 2), real_r0.eq(r0 < c.rows), real_r0n.eq(r0_nx < c.rows),
                     rows_m1.eq(c.rows - 1), row_beats.eq((row_bytes + B - 1) >> ceil_log2(B)),
                     rem_nx.eq(rem - KC // 2), rem_beats_nx.eq(rem_beats - CB),
                     taddr_nx.eq(taddr + (row_bytes << ceil_log2(C2))), r0_nx.eq(r0 + C2),
                     rows_bytes.eq((row_bytes << ceil_log2(RP)) - row_bytes), cstep.eq(KC // 2 - rows_bytes)]
        xd = Signal(expect, name=f"w{p}_xd")
        m.d.comb += [xd.row.eq(row), xd.nbeats.eq(Mux(real, ch_nbeats, 0)), xd.none.eq(~real | ch_zero),
                     xd.last.eq(row_last), x.w_data.eq(xd),
                     dma.i_cmd.p.addr.eq(raddr), dma.i_cmd.p.nbytes.eq(ch_nbytes)]
        fire = active & x.w_rdy & (~real | dma.i_cmd.ready)
        m.d.comb += [x.w_en.eq(fire), dma.i_cmd.valid.eq(active & x.w_rdy & real)]
        cend, tend = fire & row_last, fire & row_last & ch_last      # a chunk's and a tile's last transfer
        new_tile = go | ch_last                                     # at go or cend: the next chunk starts a tile
        with m.If(go | fire):
            # r + 1 < c.rows: r < c.rows and r + 1 != c.rows
            m.d.sync += [row.eq(Mux(go | row_last, 0, row + 1)),
                         row_last.eq(Mux(go | row_last, RP == 1, row == RP - 2)),
                         r.eq(Mux(go, p * RP, Mux(row_last, Mux(ch_last, r0_nx, r0), r + 1))),
                         real.eq(Mux(go, p * RP < c.rows, Mux(row_last, Mux(ch_last, real_r0n, real_r0),
                                                                   real & (r != rows_m1)))),
                         raddr.eq(Mux(go, first_addr, Mux(row_last & ch_last, taddr_nx,
                                                          raddr + Mux(row_last, cstep, row_bytes))))]
        with m.If(go | cend):
            m.d.sync += [rem.eq(Mux(new_tile, row_bytes, rem_nx)),
                         rem_beats.eq(Mux(go, (row_bytes + B - 1) >> ceil_log2(B),
                                          Mux(ch_last, row_beats, rem_beats_nx))),
                         active.eq(0), bank.eq(~go & ~bank)]
        with m.If(go | tend):
            m.d.sync += [taddr.eq(Mux(go, first_addr, taddr_nx)), r0.eq(Mux(go, p * RP, r0_nx))]
        with m.If(tend):
            tiles.step()
            with m.If(tiles.last):
                m.d.sync += run.eq(0)
        # receiver: beats of row xv.row into its memory, bank by bank
        rbank = Signal(name=f"w{p}_rbank")
        rbeat = Signal(range(CB + 2), name=f"w{p}_rbeat")
        # whether every beat of the head row is in, as registers beside rbeat (as the scales' sr_first, sr_full)
        rfirst, rfull = Signal(init=1, name=f"w{p}_rfirst"), Signal(name=f"w{p}_rfull")
        with m.If(go):
            m.d.sync += [rbank.eq(0), rbeat.eq(0), rfirst.eq(1)]
        hdone = x.r_rdy & Mux(rfirst, xv.none, rfull)
        with m.If(hdone):
            m.d.comb += x.r_en.eq(1)
            m.d.sync += [rbeat.eq(0), rfirst.eq(1)]
            with m.If(xv.last):
                banks.done(rbank)
                m.d.sync += rbank.eq(~rbank)
        m.d.comb += dma.o_data.ready.eq(x.r_rdy & ~hdone)
        got = dma.o_data.valid & dma.o_data.ready
        with m.If(got):
            m.d.sync += [rbeat.eq(rbeat + 1), rfirst.eq(0), rfull.eq(rbeat + 1 == xv.nbeats)]
        for i, (wp, _) in enumerate(mems):
            m.d.comb += [wp.addr.eq(Cat(rbeat[:lcb] if CB > 1 else Const(0, 0), rbank)),
                         wp.data.eq(dma.o_data.p.data), wp.en.eq(got & (xv.row == i))]
        # reader: k-steps, SPB per engine beat, masked past cols
        rd_run = sequencer(f"wread{p}")
        q, issue, landing, room = _prefetch(m, f"w{p}_q", 4 * RP * SPB)
        lspb = ceil_log2(SPB)
        assert SPB == 1 << lspb
        kb = Signal(name=f"w{p}_kbank")
        k = Signal(range(self._hw.gemv_max_cols + KC + 1), name=f"w{p}_k")     # k-step within the tile
        # the tile's reads (kpad / SPB) less one, registered at go, and the reads left after the current one;
        # whether the current read is the tile's last (k == kpad - SPB) and the chunk's last (k % KC == KC - SPB),
        # registered beside k: a chunk starts at a multiple of KC, so k's low bits address the chunk's bank
        k_reads_m1 = Signal(range(self._hw.gemv_max_cols // SPB + 1), name=f"w{p}_k_reads_m1")
        k_left = Signal.like(k_reads_m1, name=f"w{p}_k_left")
        t_end, t_end0 = Signal(name=f"w{p}_t_end"), Signal(name=f"w{p}_t_end0")
        c_end = Signal(name=f"w{p}_c_end")
        ktiles = _Countdown(m, f"w{p}_ktiles", ntiles, go)
        with m.If(go):
            reads = kpad >> lspb
            m.d.sync += [kb.eq(0), k.eq(0), k_reads_m1.eq(reads - 1), k_left.eq(reads - 1), t_end.eq(reads == 1),
                         t_end0.eq(reads == 1), c_end.eq(KC == SPB)]
        m.d.comb += issue.eq(rd_run & ~go & room & banks.complete(kb))
        for _, rp in mems:
            m.d.comb += rp.addr.eq(Cat(k[ceil_log2(W):lkc] if CB > 1 else Const(0, 0), kb))
        sel = Signal(range(max(2, W // SPB)), name=f"w{p}_sel")
        kl = Signal.like(k, name=f"w{p}_kl")                                    # k of the landing read
        with m.If(issue):
            m.d.sync += [sel.eq((k >> lspb)[:max(1, ceil_log2(W // SPB))] if W > SPB else 0), kl.eq(k)]
        pieces = []
        for s in range(SPB):
            keep = kl + s < c.cols
            for i, (_, rp) in enumerate(mems):
                nib = rp.data.word_select(sel * SPB + s, 4) if W > 1 else rp.data[:4]
                pieces.append(Mux(keep, nib, 0))
        m.d.comb += [q.w_data.eq(Cat(*pieces)),
                     eng.i_wgt[p].valid.eq(q.r_rdy), eng.i_wgt[p].p.eq(q.r_data), q.r_en.eq(eng.i_wgt[p].ready)]
        with m.If(issue):
            with m.If(t_end):
                m.d.sync += [k.eq(0), k_left.eq(k_reads_m1), t_end.eq(t_end0), c_end.eq(KC == SPB)]
                ktiles.step()
                with m.If(ktiles.last):
                    m.d.sync += rd_run.eq(0)
            with m.Else():
                m.d.sync += [k.eq(k + SPB), k_left.eq(k_left - 1), t_end.eq(k_left == 1),
                             c_end.eq(k[:lkc] == KC - 2 * SPB)]
            with m.If(t_end | c_end):
                banks.free(kb)
                m.d.sync += kb.eq(~kb)
