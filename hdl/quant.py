"""The activation quantiser of WGEMV: binary32 activations in, INT8 block floating point out, written
straight into the GEMV engine's activation and exponent memories (`hdl.gemv.GemvEngine.i_act` /
``i_exp``); bit-identical to `sim.numerics.quantize_activations` (docs/numerics.md).

Per block of ``act_block`` (B) elements (the last block of a command may be shorter)::

    e = the smallest integer with max|x| * 2**-e <= L        (0 for an all-zero block)
    q = rne(x * 2**-e)                                       (exact scaling, one rounding, ties to even)

with the limit L = 127 (`Q_MAX`, WGEMV) or, with the command's ``limit`` bit, L = 119 (`KV_Q_MAX`: the INT8 KV
cache, whose q is split into two INT4 nibbles; `sim.numerics.quantize_activations` with ``limit``). With the
command's ``force`` bit every block takes the command's exponent ``e`` instead (q as above; the caller keeps
``|q| <= L``): the second pass over a V row, at the row's largest block exponent (`KvPacker.o_emax`).

**Exponent.** ``max|x|`` is the largest 31-bit magnitude pattern (binary32 magnitudes order as unsigned
integers, subnormals included). Written as ``M * 2**(Eeff - 150)`` with the 24-bit integer mantissa M
(hidden bit included for normal numbers, ``Eeff = max(E, 1)``) and p = the bit length of M (24 for normal
numbers), ``e = Eeff - 150 + p - 7 + (M * 2**(7 - p) > L)``: the binary32 exponent and one mantissa compare,
``M > L << (p - 7)`` for p >= 7 and ``M > L >> (7 - p)`` below (exact: the left side's low bits are 0). For
p <= 7 the compare is never true with L = 127; with L = 119 it is for M = 15, 30..31, 60..63, 120..127 (p = 4
.. 7). For normal numbers this is the contract's ``k - 7`` / ``k - 6``; a leading-one search only matters for
an all-subnormal block. L = 127 and 119 differ in one bit (bit 3), so the limit costs one variable bit per
compare.

**Quantisation.** ``|x| * 2**-e = M * 2**-(e + 150 - Eeff)``; the shift is at least -6 (a subnormal in a
block with e = -155) and at most 17 for the block maximum, more for small elements. The mantissa is shifted
left by 7 (``M << 7``, so the shift ``t = e + 156 - Eeff`` is never negative and one guard bit stays),
then right by ``min(t, 31)``: integer part, guard bit, and a sticky bit from the bits shifted out give
round-to-nearest-even; the sign is applied after the rounding (``|q| <= 127``, so INT8 never overflows).

**Dataflow.** Four elements per cycle (`hdl.l2.LANES`: one L2 word, from `hdl.l2.ElemReader` in beat
mode). A command's beats pass two register stages (f1: the lanes, those past the command's end zeroed;
f2: also the larger of lanes 0/1 and of lanes 2/3) and are then written into a ring of two block slots
(block k of the stream fills slot k % 2; words of four binary32 lanes, lane-granular writes) while the
block's running maximum is kept (f2's two and the maximum so far compared pairwise, one compare level); a
complete block (its maximum, length and number, and its command's limit and force bits, queued in a
two-entry FIFO; a forced exponent travels in place of the maximum) is read back one ring word per cycle,
starting in the cycle after its last beat was written or right after the previous block, and its slot is
free again once its last word's read is issued. A beat waiting at f2 for its slot holds the stages
behind it. So the fill of block k + 1 overlaps the read-back of block k and the unit takes four elements
per cycle sustained, across blocks, short last blocks and back-to-back commands (a command is accepted in
the cycle its predecessor's last beat is). ``act_block`` must be a multiple of four, so a beat never spans
two blocks. Read-back pipeline::

    s0 issue: ring word read; s1 .. p3 the block exponent from the stored max (o_exp written at a block's
              first word), the words held in registers beside it
    p4 shift amount, per lane: t = e + 156 - Eeff clamped to 0 .. 31; the mantissa's trailing zeros
    p5 shift, per lane: M << 7 >> t, guard, sticky
    s2 round and sign, per lane; pack the four into the word of W = weights_per_beat lanes
    o_act register: a word leaves when its last lane group (or the command's last element) is in

Words hold lanes ``addr * W ..``; lanes past n in the last word are 0. Each word and each exponent is
written exactly once, in address order. An output that is not ready stalls the read-back pipeline (the
GEMV engine is always ready).
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, Value, signed, unsigned
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .config import KV_Q_MAX, HardwareConfig, ceil_log2
from .fp import rejecting
from .gemv import EXP_BITS
from .l2 import LANES, beat_layout

__all__ = ["ActQuantizer", "KvPacker", "act_write_layout", "exp_write_layout", "command_layout",
           "pack_command_layout", "Q_MAX", "KV_Q_MAX", "EXP_MIN"]

Q_MAX = 127          # sim.numerics.INT8_MAX: the block exponent makes every |q| <= 127
N_BITS = 16          # command column count
EXP_MIN = -(1 << (EXP_BITS - 1))     # KvPacker.o_emax after a clear: below every exponent
# The exponent formula compares a 7-bit-normalised mantissa with the limit, so any limit in [64, 127] works.
assert 64 <= KV_Q_MAX <= Q_MAX


def _check_hw(hw, why: str) -> None:
    """The hardware parameters both units need: a HardwareConfig whose activations hold INT8."""
    if not isinstance(hw, HardwareConfig):
        raise TypeError(f"hw must be a HardwareConfig, not {hw!r}")
    if hw.act_bits < 8:
        raise ValueError(f"act_bits must be at least 8 ({why}), not {hw.act_bits!r}")


def act_write_layout(hw: HardwareConfig) -> data.StructLayout:
    """One activation-memory write of `hdl.gemv.GemvEngine.i_act`: word `addr` = columns ``addr*W ..``."""
    W = hw.weights_per_beat
    return data.StructLayout({"addr": range(hw.gemv_max_cols // W), "q": data.ArrayLayout(signed(hw.act_bits), W)})


def exp_write_layout(hw: HardwareConfig) -> data.StructLayout:
    """One exponent-memory write of `hdl.gemv.GemvEngine.i_exp`: the exponent of activation block `addr`."""
    return data.StructLayout({"addr": range(max(2, hw.gemv_max_cols // hw.act_block)), "e": signed(EXP_BITS)})


def command_layout() -> data.StructLayout:
    """One quantiser command: ``n`` columns; ``limit`` 1 = block exponents for ``|q| <= KV_Q_MAX`` (else
    `Q_MAX`); ``force`` 1 = every block of the command uses exponent ``e`` (a raw ``n`` alone, fields 0, is the
    WGEMV command)."""
    return data.StructLayout({"n": unsigned(N_BITS), "limit": 1, "force": 1, "e": signed(EXP_BITS)})


class ActQuantizer(wiring.Component):
    """binary32 activations to block floating point INT8, written into the GEMV memories.

    Parameters
    ----------
    hw : HardwareConfig
        ``act_block`` (B), ``weights_per_beat`` (W), ``gemv_max_cols`` and ``act_bits`` (at least 8) are used.

    Members
    -------
    i_cmd : In(stream({n: unsigned(16), limit: 1, force: 1, e: signed(EXP_BITS)}))
        Quantise the next n (1..gemv_max_cols) elements of ``i_elem`` as columns 0..n-1. Accepted when the
        previous command's elements have all been taken (in the cycle its last one is). n = 0 is accepted
        once the unit is idle, writes nothing and pulses ``o_done``. Columns past ``gemv_max_cols`` wrap.
        ``limit``: 0 = block exponents for ``|q| <= 127``, 1 = ``|q| <= 119``. ``force``: 1 = every block of
        the command uses exponent ``e`` (written to ``o_exp`` too); the caller keeps ``|q|`` within the limit
        (an ``e`` too small for a block gives unspecified q). The options belong to their command, also
        when commands follow each other back to back.
    i_beat : In(stream(hdl.l2.beat_layout))
        The activations, raw binary32 bits, four per beat (`hdl.l2.LANES`; the command's last beat the rest:
        the unit counts them itself, the beat's ``n`` and ``last`` are not read). A beat belongs to one
        command (`hdl.l2.ElemReader` with ``beats`` sends exactly this).
    o_act : Out(stream(act_write_layout))
        Activation words, exactly `hdl.gemv.GemvEngine.i_act`.
    o_exp : Out(stream(exp_write_layout))
        Block exponents, exactly `hdl.gemv.GemvEngine.i_exp`.
    o_done : Out(1)
        One-cycle pulse after every word and exponent of a command has been accepted (one per command, in
        order).
    o_busy : Out(1)
        A command with n > 0 has been accepted and its ``o_done`` has not yet pulsed.
    o_nonfinite : Out(1)
        Set with each ``o_done``: 1 if that command had an inf or NaN input (its words and exponents are then
        unspecified); holds until the next ``o_done``.

    Latency: a beat is written into the ring two cycles after it is accepted (later while its slot is not
    free); the read-back starts a block in the cycle after its last beat is written (or right after the
    previous block) and issues one ring word (four elements) per cycle; ``o_done`` pulses `latency` cycles
    after the issue of the command's last word when the outputs are ready.
    """

    def __init__(self, hw: HardwareConfig):
        with rejecting(self):
            _check_hw(hw, f"quantised activations reach +-{Q_MAX}")
            if hw.gemv_max_cols >= 1 << N_BITS:
                raise ValueError(f"gemv_max_cols must be below {1 << N_BITS} (the command's {N_BITS}-bit column "
                                 f"count), not {hw.gemv_max_cols!r}")
            if hw.act_block % LANES:
                raise ValueError(f"act_block must be a multiple of {LANES} (the quantiser takes {LANES} elements "
                                 f"per cycle, a block a whole number of them), not {hw.act_block!r}")
        self._hw = hw
        super().__init__({
            "i_cmd": In(stream.Signature(command_layout())),
            "i_beat": In(stream.Signature(beat_layout())),
            "o_act": Out(stream.Signature(act_write_layout(hw))),
            "o_exp": Out(stream.Signature(exp_write_layout(hw))),
            "o_done": Out(1), "o_busy": Out(1), "o_nonfinite": Out(1),
        })

    hw = property(lambda self: self._hw)

    @property
    def latency(self) -> int:
        """Cycles from the read-back issue of a command's last element to its ``o_done`` pulse: s1, p2, p3,
        p4, p5, s2, the o_act register, the done pulse."""
        return 8

    @staticmethod
    def _exponent_compares(mant, quads, limit):
        """The first part of the block exponent of a magnitude pattern (see the module docstring), from its
        24-bit significand `mant` (the hidden bit included) and `quads`, the OR of each of its 4-bit groups:
        per position p = 1 .. 24, whether the leading one is at bit p - 1 (`hot`, one-hot) and whether
        ``mant[:p] > lim * 2**(p - 7)`` (`gt`; lim = 127, or 119 with `limit`), every position at once. The
        exponent is ``max(e_fld, 1) - 157 + p + gt`` at the hot position (0 for a zero magnitude). Each
        "any bit in a range" is a few group ORs and at most three bits (two logic levels)."""
        def any_of(lo, hi):                       # mant[lo:hi] has a one
            q0, q1 = -(-lo // 4), hi // 4             # whole groups q0 .. q1 - 1
            if q0 >= q1:
                return mant[lo:hi].any() if hi > lo else Const(0, 1)
            return Cat(mant[lo:4 * q0], quads[q0:q1], mant[4 * q1:hi]).any()
        hot, gts = [], []
        for p in range(1, 25):
            hot.append(mant[p - 1] & ~any_of(p, 24))
            if p >= 7:        # mant[:p] > lim * 2**(p - 7): its top 7 bits against lim, then the rest
                top, rest = mant[p - 7:p], any_of(0, p - 7)
                gt_of = [(top > lim) | ((top == lim) & rest) for lim in (Q_MAX, KV_Q_MAX)]
            else:
                gt_of = [mant[:p] > (lim >> (7 - p)) for lim in (Q_MAX, KV_Q_MAX)]
            gts.append(Mux(limit, gt_of[1], gt_of[0]))
        return Cat(*hot), Cat(*gts)

    @staticmethod
    def _exponent_pick(hot, gts):
        """The second part: the hot position p (1 .. 24) and its compare."""
        pos = Cat(*(Cat(*(hot[p - 1] for p in range(1, 25) if p >> b & 1)).any() for b in range(5)))
        return pos, (hot & gts).any()

    def _lane_round(self, m, k, p3_data, p4_data, p4_e, adv, s2_on):
        """Lane `k` of the read-back from p4 to s2: the shift amount and the trailing-zero count (into p5), the
        shift and the sticky bit (into s2), the rounding to nearest even and the sign; the lane's INT8 code."""
        hw = self._hw
        # p4: ``t = e + 156 - Eeff`` (its lane part registered from p3), clamped, and the mantissa's
        # trailing-zero count, into p5
        d3, xr = p3_data[32 * k:32 * (k + 1)], p4_data[32 * k:32 * (k + 1)]
        u = Signal(signed(9), name=f"p4_u{k}")                # 156 - Eeff: -99 .. 155
        hid = Signal(name=f"p4_hid{k}")                       # the hidden bit: exponent field != 0
        with m.If(adv):
            m.d.sync += [u.eq(156 - Mux(d3[23:31] == 0, 1, d3[23:31])), hid.eq(d3[23:31] != 0)]
        r_mant = Cat(xr[0:23], hid)
        t = Signal(signed(EXP_BITS + 2), name=f"t{k}")
        m.d.comb += t.eq(p4_e + u)
        # the bits shifted out are non-zero iff v's lowest one lies below tc: a trailing-zero count of the
        # mantissa and one compare instead of a mask as wide as v
        # The count is 4 * j + o: j the first 4-bit group with a one (6 if none: 24 for M = 0), o the lowest
        # one's place in that group, each group's place found beside the groups' ORs.
        groups = [r_mant[4 * j:4 * j + 4] for j in range(6)]
        g_any = [g.any() for g in groups]
        g_place = [Mux(g[0], 0, Mux(g[1], 1, Mux(g[2], 2, 3))) for g in groups]
        j_first, o_first = Const(6, 3), Const(0, 2)
        for j in reversed(range(6)):
            j_first, o_first = Mux(g_any[j], j, j_first), Mux(g_any[j], g_place[j], o_first)
        tz = Signal(range(25), name=f"tz{k}")
        m.d.comb += tz.eq(Cat(o_first, j_first))
        tc = Signal(5, name=f"p5_tc{k}")
        p5_tz = Signal(range(25), name=f"p5_tz{k}")
        p5_sign = Signal(name=f"p5_sign{k}")
        p5_mant = Signal(24, name=f"p5_mant{k}")
        with m.If(adv):
            m.d.sync += [tc.eq(Mux(t < 0, 0, Mux(t > 31, 31, t))),       # t < 0 only for inf/NaN blocks
                         p5_tz.eq(tz), p5_sign.eq(xr[31]), p5_mant.eq(r_mant)]
        # p5: the shift and the sticky bit, into s2
        v = Cat(Const(0, 7), p5_mant)                               # M << 7: 31 bits
        g_int = Signal(31, name=f"g_int{k}")
        m.d.comb += g_int.eq(v >> tc)                              # integer part << 1 | guard
        sticky = (p5_tz != 24) & (p5_tz + 7 < tc)
        s2_sign, s2_g, s2_st = Signal(name=f"s2_sign{k}"), Signal(name=f"s2_g{k}"), Signal(name=f"s2_st{k}")
        s2_i = Signal(8, name=f"s2_i{k}")
        with m.If(adv):
            m.d.sync += [s2_sign.eq(p5_sign), s2_i.eq(g_int[1:9]), s2_g.eq(g_int[0]), s2_st.eq(sticky)]
        # s2: round to nearest even, sign.
        qmag = Signal(9, name=f"qmag{k}")
        m.d.comb += qmag.eq(s2_i + (s2_g & (s2_st | s2_i[0])))
        q = Signal(signed(hw.act_bits), name=f"q{k}")
        m.d.comb += q.eq(Mux(s2_on[k], Mux(s2_sign, -qmag, qmag), 0))
        return q

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        W, B, C = hw.weights_per_beat, hw.act_block, hw.gemv_max_cols
        LB, LW, LC = ceil_log2(B), ceil_log2(W), ceil_log2(C)
        LL = ceil_log2(LANES)
        BW = B // LANES                       # ring words per block
        exp_addr_shape = exp_write_layout(hw)["addr"].shape

        # The ring: two block slots of B binary32 elements, as words of LANES elements (lane-granular writes).
        # Block k of the whole stream fills slot k % 2; its read-back starts once its last beat is in, and the
        # slot is free again once its last word's read is issued.
        m.submodules.buf = buf = Memory(shape=unsigned(32 * LANES), depth=2 * BW, init=[])
        wr, rd = buf.write_port(granularity=32), buf.read_port()
        slot_full = Signal(2)
        f_slot, r_slot = Signal(), Signal()

        # One entry per complete block, at most two (the two slots). The command's options travel with its
        # blocks (the fill side may be a command ahead of the read-back); a forced exponent takes the place
        # of the maximum, which is then not needed.
        meta_layout = data.StructLayout({
            "lidx": unsigned(LB),             # index of the block's last element
            "blk": exp_addr_shape,            # block number within the command
            "last": 1,                        # the command's last block
            "nf": 1,                          # an inf or NaN in the block
            "limit": 1,                       # the command's limit bit (|q| <= KV_Q_MAX)
            "force": 1,                       # the command's force bit: key.e is the block exponent
            "key": data.UnionLayout({
                "amax": unsigned(31),         # largest magnitude pattern (force = 0)
                "e": signed(EXP_BITS),        # the command's exponent (force = 1)
            }),
        })
        m.submodules.blocks = blocks = fifo.SyncFIFO(width=meta_layout.size, depth=2)
        new_blk = Signal(meta_layout)
        m.d.comb += blocks.w_data.eq(new_blk)

        pending = Signal(range(16))           # commands (n > 0) accepted and not done: at most 11 (one
                                              # waiting for its beats, one per beat or word in flight)
        done_last = Signal()                  # the last word of a command is accepted this cycle
        zero_done = Signal()
        issue = Signal()
        free_slot = Signal()                  # the read-back issues a block's last word this cycle

        # ---- Fill: i_beat -> f1 -> f2 -> ring, running max ----------------------------------------------
        # A taken beat passes two register stages before it is written: f1 holds its lanes (the magnitudes of
        # lanes past the command's end zeroed) and where it goes, f2 adds the larger of lanes 0/1 and of
        # lanes 2/3; at f2 the beat is written into the ring and the running maximum takes the two. The
        # stages advance together (`go`) unless f2's beat waits for its ring slot.
        f_busy = Signal()
        f_left = Signal(N_BITS)
        f_col = Signal(LC + 1)
        f_max = Signal(31)
        f_nf = Signal()
        f_limit, f_force = Signal(), Signal()
        f_e = Signal(signed(EXP_BITS))
        beat = self.i_beat.payload.data
        take = Signal()
        go = Signal()
        m.d.comb += [self.i_beat.ready.eq(f_busy & go), take.eq(self.i_beat.valid & self.i_beat.ready)]
        # the next beat's element count and whether it is the command's last, registered with f_left
        cnt = Signal(LL + 1)                  # elements in this beat: LANES, the command's last the rest
        last_elem = Signal()                  # f_left <= LANES
        lane_on = [cnt > k for k in range(LANES)]
        stage_layout = data.StructLayout({
            "valid": 1,
            "on": unsigned(LANES),            # lanes holding elements
            "word": unsigned(max(1, LB - LL)),  # ring word of the beat within its block
            "end": 1,                         # the block's last beat
            "lidx": unsigned(LB), "blk": exp_addr_shape, "last": 1, "limit": 1, "force": 1,   # as meta_layout
            "e": signed(EXP_BITS),
        })
        f1, f2 = Signal(stage_layout, name="f1"), Signal(stage_layout, name="f2")
        f1_data, f2_data = Signal(32 * LANES, name="f1_data"), Signal(32 * LANES, name="f2_data")
        f2_max = [Signal(31, name=f"f2_max{i}") for i in range(2)]    # max of lanes 0/1, of lanes 2/3
        f2_nf = Signal()                      # an inf or NaN in f2's beat

        def largest(cand):
            """The largest of `cand` in one compare level: every pair compared at once; the lowest-numbered
            candidate that no other beats wins."""
            ge = {(i, j): cand[i] >= cand[j] for i in range(len(cand)) for j in range(i + 1, len(cand))}
            win = []
            for i in range(len(cand)):
                wins_i = Cat(*([~ge[(j, i)] for j in range(i)] + [ge[(i, j)] for j in range(i + 1, len(cand))]))
                win.append(Mux(wins_i.all(), cand[i], 0))
            acc = win[0]
            for w_ in win[1:]:
                acc = acc | w_
            return acc

        end_blk = ((f_col[LL:LB] == BW - 1) if LB > LL else Const(1, 1)) | last_elem
        lanes1 = [f1_data[32 * k:32 * (k + 1)] for k in range(LANES)]
        with m.If(go):
            m.d.sync += [f1.valid.eq(take), f1.on.eq(Cat(*lane_on)), f1.word.eq(f_col[LL:LB]), f1.end.eq(end_blk),
                         f1.lidx.eq(f_col[:LB] + cnt - 1), f1.blk.eq(f_col[LB:]), f1.last.eq(last_elem),
                         f1.limit.eq(f_limit), f1.force.eq(f_force), f1.e.eq(f_e),
                         f1_data.eq(Cat(*(Cat(Mux(lane_on[k], beat[32 * k:32 * k + 31], 0), beat[32 * k + 31])
                                          for k in range(LANES)))),
                         f2.eq(f1), f2_data.eq(f1_data),
                         f2_nf.eq(Cat(*(lane[23:31] == 0xFF for lane in lanes1)).any())]
            m.d.sync += [f2_max[i].eq(largest([lanes1[2 * i][0:31], lanes1[2 * i + 1][0:31]])) for i in range(2)]

        # f2: the ring write and the running maximum. Every queued block holds a full slot (an entry is
        # written as its slot fills and read as the slot frees), so a free slot means room in `blocks`.
        put = Signal()
        m.d.comb += [go.eq(~(f2.valid & slot_full.bit_select(f_slot, 1))), put.eq(f2.valid & go)]
        nm = Signal(31)
        m.d.comb += nm.eq(largest([f2_max[0], f2_max[1], f_max]))
        new_nf = f_nf | f2_nf
        m.d.comb += [wr.en.eq(Mux(put, f2.on, 0)), wr.addr.eq(Cat(f2.word[:LB - LL], f_slot)), wr.data.eq(f2_data)]
        m.d.comb += [new_blk.lidx.eq(f2.lidx), new_blk.blk.eq(f2.blk), new_blk.last.eq(f2.last),
                     new_blk.nf.eq(new_nf), new_blk.limit.eq(f2.limit), new_blk.force.eq(f2.force),
                     blocks.w_en.eq(put & f2.end)]
        with m.If(f2.force):
            m.d.comb += new_blk.key.e.eq(f2.e)
        with m.Else():
            m.d.comb += new_blk.key.amax.eq(nm)
        with m.If(put):
            with m.If(f2.end):
                m.d.sync += [f_max.eq(0), f_nf.eq(0), f_slot.eq(~f_slot)]
            with m.Else():
                m.d.sync += [f_max.eq(nm), f_nf.eq(new_nf)]
        slot_lw = [Signal(max(1, LB - LL), name=f"slot_lw{k}") for k in range(2)]      # see `lastw`
        for k in range(2):
            with m.If(put & f2.end & (f_slot == k)):
                m.d.sync += [slot_full[k].eq(1), slot_lw[k].eq(f2.lidx[LL:] if LB > LL else 0)]
            with m.Elif(free_slot & (r_slot == k)):
                m.d.sync += slot_full[k].eq(0)
        with m.If(take):
            # f_left - cnt, the count and the flag taken from f_left itself: cnt = LANES unless the beat is the
            # command's last, after which f_left, cnt and last_elem are not read until the next command sets them
            m.d.sync += [f_col.eq(f_col + cnt), f_left.eq(f_left - LANES),
                         cnt.eq(Mux(f_left >= 2 * LANES, LANES, (f_left - LANES)[:LL + 1])),
                         last_elem.eq(f_left <= 2 * LANES)]
            with m.If(last_elem):
                m.d.sync += f_busy.eq(0)

        # Commands: the next one is taken as soon as the fill side is free, including the cycle in which it
        # takes the previous command's last beat; n = 0 only on an idle unit, so its o_done stays in order.
        n = self.i_cmd.p.n
        fill_free = ~f_busy | (take & last_elem)
        m.d.comb += self.i_cmd.ready.eq(fill_free & ((n != 0) | (pending == 0)))
        cmd_take = self.i_cmd.valid & self.i_cmd.ready
        with m.If(cmd_take & (n != 0)):
            m.d.sync += [f_left.eq(n), cnt.eq(Mux(n >= LANES, LANES, n[:LL + 1])), last_elem.eq(n <= LANES)]
            m.d.sync += [f_busy.eq(1), f_col.eq(0), f_limit.eq(self.i_cmd.p.limit),
                         f_force.eq(self.i_cmd.p.force), f_e.eq(self.i_cmd.p.e)]
        m.d.comb += zero_done.eq(cmd_take & (n == 0))
        m.d.sync += pending.eq(pending + (cmd_take & (n != 0)) - done_last)

        # ---- Read-back pipeline: one ring word (LANES elements) per cycle ----------------------------
        adv = Signal()
        m.d.comb += adv.eq(~(self.o_act.valid & ~self.o_act.ready) & ~(self.o_exp.valid & ~self.o_exp.ready))

        # s0: issue one ring read per cycle for the oldest complete block.
        q_w = Signal(max(1, LB - LL))         # word of the block being read back
        q_nf = Signal()                       # inf/NaN seen so far in the command being read back
        cur = data.View(meta_layout, blocks.r_data)
        m.d.comb += issue.eq(blocks.r_rdy & adv)
        first = q_w == 0
        # the head block's last word from its slot's register (`blocks`' head is slot r_slot's), not the FIFO
        lastw = (q_w == Mux(r_slot, slot_lw[1], slot_lw[0])) if LB > LL else Const(1, 1)
        nf_cur = Mux(first & (cur.blk == 0), 0, q_nf) | cur.nf
        m.d.comb += [rd.en.eq(adv), rd.addr.eq(Cat(q_w[:LB - LL], r_slot)), blocks.r_en.eq(issue & lastw),
                     free_slot.eq(issue & lastw)]
        with m.If(issue):
            m.d.sync += [q_nf.eq(nf_cur), q_w.eq(Mux(lastw, 0, q_w + 1))]
            with m.If(lastw):
                m.d.sync += r_slot.eq(~r_slot)

        # The block exponent in three stages beside the words' first three (x1: the entry's key at the block's
        # first issue; xa: every position's compare and the leading one; xb: its position and compare; then
        # the sum), so that it meets the block's first word at the shift stage. x1 holds the block until the
        # next block's first issue, so each word's exponent at its third stage is its own block's.
        x1 = Signal(data.StructLayout({"mant": unsigned(24), "quads": unsigned(6), "e_fld": unsigned(8),
                                       "limit": 1, "force": 1, "e": signed(EXP_BITS)}))
        amax = cur.key.amax
        mant = Cat(amax[0:23], amax[23:31] != 0)
        with m.If(issue & first):
            m.d.sync += [x1.mant.eq(mant), x1.quads.eq(Cat(*(mant[4 * i:4 * i + 4].any() for i in range(6)))),
                         x1.e_fld.eq(amax[23:31]), x1.limit.eq(cur.limit), x1.force.eq(cur.force),
                         x1.e.eq(cur.key.e)]
        key = data.StructLayout({"force": 1, "e": signed(EXP_BITS), "zero": 1, "base": signed(EXP_BITS)})
        xa = Signal(data.StructLayout({"key": key, "hot": unsigned(24), "gts": unsigned(24)}))
        xb = Signal(data.StructLayout({"key": key, "pos": unsigned(5), "gt": 1}))
        hot, gts = self._exponent_compares(x1.mant, x1.quads, x1.limit)
        pos, gt = self._exponent_pick(xa.hot, xa.gts)
        e_fld = x1.e_fld
        with m.If(adv):
            m.d.sync += [xa.key.force.eq(x1.force), xa.key.e.eq(x1.e), xa.key.zero.eq(x1.mant == 0),
                         xa.key.base.eq(Mux(e_fld == 0, 1, e_fld) - 157), xa.hot.eq(hot), xa.gts.eq(gts),
                         xb.key.eq(xa.key), xb.pos.eq(pos), xb.gt.eq(gt)]
        e3 = Signal(signed(EXP_BITS))
        kb = xb.key
        m.d.comb += e3.eq(Mux(kb.force, kb.e, Mux(kb.zero, 0, kb.base + xb.pos + xb.gt)))

        # The words: s1 the ring's read data, p2 .. p4 registers (the exponent joins at p4), then per lane
        # the shift amount (into p5), the shift (into s2) and the rounding.
        word_meta = data.StructLayout({
            "valid": 1, "last": 1, "nf": 1, "first": 1, "blk": exp_addr_shape,
            "col": unsigned(LC),              # column of lane 0
            "on": unsigned(LANES),            # lanes holding elements (the command's last word may be short)
        })
        s1, p2, p3, p4, p5 = (Signal(word_meta, name=n) for n in ("s1", "p2", "p3", "p4", "p5"))
        p2_data, p3_data, p4_data = (Signal(32 * LANES, name=n) for n in ("p2_data", "p3_data", "p4_data"))
        p4_e = Signal(signed(EXP_BITS))
        with m.If(adv):
            m.d.sync += [s1.valid.eq(issue), s1.col.eq(Cat(Const(0, LL), q_w[:LB - LL], cur.blk)),
                         s1.last.eq(lastw & cur.last), s1.nf.eq(nf_cur), s1.first.eq(first), s1.blk.eq(cur.blk),
                         s1.on.eq(Mux(lastw, Cat(*(cur.lidx[:LL] >= k for k in range(LANES))), (1 << LANES) - 1)),
                         p2.eq(s1), p2_data.eq(rd.data), p3.eq(p2), p3_data.eq(p2_data),
                         p4.eq(p3), p4_data.eq(p3_data), p4_e.eq(e3), p5.eq(p4)]
        with m.If(adv & p3.valid & p3.first):
            m.d.sync += [self.o_exp.valid.eq(1), self.o_exp.p.addr.eq(p3.blk), self.o_exp.p.e.eq(e3)]
        with m.Elif(self.o_exp.ready):
            m.d.sync += self.o_exp.valid.eq(0)
        s2_valid, s2_last, s2_nf = Signal(), Signal(), Signal()
        s2_col = Signal(LC)
        s2_on = Signal(LANES)
        with m.If(adv):
            m.d.sync += [s2_valid.eq(p5.valid), s2_last.eq(p5.last), s2_nf.eq(p5.nf), s2_col.eq(p5.col),
                         s2_on.eq(p5.on)]
        qs = [self._lane_round(m, k, p3_data, p4_data, p4_e, adv, s2_on) for k in range(LANES)]

        # s2: pack the LANES results into the word of W lanes at the lane group of their column.
        grp = s2_col[LL:LW]
        pack = Signal(data.ArrayLayout(signed(hw.act_bits), W))
        word = Signal(data.ArrayLayout(signed(hw.act_bits), W))
        for i in range(W):
            g, k = divmod(i, LANES)
            m.d.comb += word[i].eq(Mux(grp == g, qs[k], Mux(grp > g, pack[i], 0)))
        emit = s2_valid & ((grp == W // LANES - 1) | s2_last)
        act_last, act_nf = Signal(), Signal()
        with m.If(adv & s2_valid):
            m.d.sync += pack.eq(word)
        with m.If(adv & emit):
            m.d.sync += [self.o_act.valid.eq(1), self.o_act.p.addr.eq(s2_col[LW:]), self.o_act.p.q.eq(word),
                         act_last.eq(s2_last), act_nf.eq(s2_nf)]
        with m.Elif(self.o_act.ready):
            m.d.sync += self.o_act.valid.eq(0)

        # Done: the command's last word is accepted (its exponents left before it: an exponent waiting on
        # o_exp stalls the whole read-back pipeline).
        m.d.comb += done_last.eq(self.o_act.valid & self.o_act.ready & act_last)
        m.d.sync += self.o_done.eq(done_last | zero_done)
        with m.If(done_last):
            m.d.sync += self.o_nonfinite.eq(act_nf)
        with m.Elif(zero_done):
            m.d.sync += self.o_nonfinite.eq(0)
        m.d.comb += self.o_busy.eq(pending != 0)
        return m


# binary32 exponent fields of the KV packer's power-of-two scales: 2**e is written with its field clamped to
# [97, 255]. binary16 rounds every magnitude below 2**-25 to 0 (2**-25 itself is a tie, to the even 0), so
# 2**-30 converts exactly as any smaller 2**e would (and the field never goes negative); 255 is +inf, as
# binary32 2**e is for e >= 128.
SCALE_FIELD_MIN = 97
SCALE_FIELD_MAX = 255


def pack_command_layout() -> data.StructLayout:
    """One `KvPacker` read command: ``sel`` (0 hi plane words, 1 lo plane words, 2 hi scales, 3 lo scales,
    4 INT8 values) and ``n`` elements."""
    return data.StructLayout({"sel": 3, "n": unsigned(N_BITS)})


class KvPacker(wiring.Component):
    """The INT8 KV cache's packer (KVST): keeps one quantised K or V row, as the quantiser writes it, and
    reads it back as the KV cache stores it (`sim.numerics.quantize_kv_k` / ``quantize_kv_v``,
    docs/numerics.md "KV cache"): two INT4 planes and power-of-two scales.

    The quantiser (`ActQuantizer`, command bit ``limit`` = 1, so ``|q| <= KV_Q_MAX``) writes the row's INT8
    words and block exponents into ``i_act`` / ``i_exp``, exactly as it writes the GEMV engine's memories.
    Each value is split as ``q = 16 * hi + lo`` with ``hi = (q + 8) >> 4`` (arithmetic shift, in [-7, 7]) and
    ``lo = q - 16 * hi`` (in [-8, 7]): the 4-bit code of lo is ``q & 0xF``, that of hi is ``q[4:8] + q[3]``
    (mod 16), a 4-bit increment done on the eight lanes being read, not on every stored lane.

    A V row takes two quantiser passes: pass A (``limit``) only to learn the row's largest block exponent
    (``o_emax``, after an ``i_clear``), pass B (``limit``, ``force``, ``e = o_emax``) writes the row at one
    exponent, whose scale is ``o_vscale``.

    Storage: the words in a memory of ``max_elems / W`` words of W INT8 lanes (only the low 8 bits of each
    lane: ``|q| <= 119``), the exponents in one of ``ceil(max_elems / B)`` entries (each as its lo and hi scales'
    clamped exponent fields, made as it is written), both with a combinational read port (distributed RAM) and
    both rounded up to a power-of-two depth (at least 2). Write and read addresses wrap modulo that depth: a
    row longer than ``max_elems`` overwrites its start. A read in the cycle of a write to the same entry sees
    the old contents. A read ends in a register stage (the element's 8-column group of its word, its scale's
    exponent field), from which the plane, byte and scale logic makes the ``o_elem`` register's element.

    Parameters
    ----------
    hw : HardwareConfig
        ``weights_per_beat`` (W), ``act_block`` (B), ``act_bits`` (at least 8) and ``gemv_max_cols`` are used.
    max_elems : int
        The longest row (``hw.kv_max_head_dim`` in the NPU); a positive multiple of W and 8 (a last block
        shorter than B is a block of its own, as in the quantiser).

    Members
    -------
    i_act : In(stream(act_write_layout))
        Word ``addr`` = columns ``addr*W .. addr*W+W-1`` (`ActQuantizer.o_act`); always ready.
    i_exp : In(stream(exp_write_layout))
        Block ``addr``'s exponent (`ActQuantizer.o_exp`); always ready.
    i_clear : In(1)
        Pulse: ``o_emax`` restarts from the smallest ``signed(EXP_BITS)`` value (a write in the same cycle
        counts, as if it came after the clear).
    o_emax : Out(signed(EXP_BITS))
        The largest exponent written through ``i_exp`` since the last ``i_clear`` (or reset); registered,
        updated in the cycle after the write.
    o_vscale : Out(32)
        binary32 bits of ``2**o_emax``, exponent field clamped to [97, 255] (`SCALE_FIELD_MIN`): 2**-30 for
        anything smaller, +inf above 2**127. Combinational from ``o_emax``.
    i_cmd : In(stream(pack_command_layout))
        Read n elements k = 0 .. n-1 (e_k = block k's exponent; k past the memories wraps like the writes):

        - sel 0: hi plane words: the hi nibbles of columns 8k .. 8k+7, column 8k in bits 0..3 (the bytes of
          `sim.numerics.pack_int4` of hi as a little-endian uint32);
        - sel 1: lo plane words, the same with the lo nibbles;
        - sel 2: hi scales, binary32 ``2**(e_k + 4)``;  sel 3: lo scales, ``2**e_k`` (both clamped as
          ``o_vscale``);
        - sel 4: the INT8 value of column k, ``q & 0xFF`` in bits 0..7 (a V row's bytes, the INT8 cache with V
          as rows: `hdl.ddrwrite.DdrWriter` scatters them with a stride).

        Accepted when no command is in progress (``o_busy`` low); n = 0 produces nothing.
    o_elem : Out(stream(unsigned(32)))
        The elements, one per cycle while ready; a registered output.
    o_busy : Out(1)
        High from the cycle after a command (n > 0) is accepted until its last element has been taken.

    Latency: the first element of a command is valid `latency` cycles after the command is accepted.
    """

    def __init__(self, hw: HardwareConfig, max_elems: int = 256):
        with rejecting(self):
            _check_hw(hw, f"INT8 KV values reach +-{KV_Q_MAX}")
            unit = max(8, hw.weights_per_beat)                  # both powers of two: the larger is a multiple
            if isinstance(max_elems, bool) or not isinstance(max_elems, int) or max_elems <= 0 or max_elems % unit:
                raise ValueError(f"max_elems must be a positive multiple of {unit} (8 and a beat of INT4 "
                                 f"weights), not {max_elems!r}")
        self._hw = hw
        self._max_elems = max_elems
        super().__init__({
            "i_act": In(stream.Signature(act_write_layout(hw))),
            "i_exp": In(stream.Signature(exp_write_layout(hw))),
            "i_clear": In(1),
            "o_emax": Out(signed(EXP_BITS), init=EXP_MIN),
            "o_vscale": Out(32),
            "i_cmd": In(stream.Signature(pack_command_layout())),
            "o_elem": Out(stream.Signature(unsigned(32))),
            "o_busy": Out(1),
        })

    hw = property(lambda self: self._hw)
    max_elems = property(lambda self: self._max_elems)

    @property
    def latency(self) -> int:
        """Cycles from a command's acceptance to its first element on ``o_elem``: the count is loaded, the
        element is read into the read stage, then registered."""
        return 3

    @staticmethod
    def _field(m, e, bias, name) -> Value:
        """The binary32 exponent field of a power of two from its exponent `e` (signed) plus `bias`, clamped (the
        bounds compared with `e` itself, beside the sum)."""
        fld = Signal(8, name=name)
        m.d.comb += fld.eq(Mux(e < SCALE_FIELD_MIN - bias, SCALE_FIELD_MIN,
                               Mux(e > SCALE_FIELD_MAX - bias, SCALE_FIELD_MAX, (e + bias)[:8])))
        return fld

    @staticmethod
    def _pow2_bits(fld) -> Value:
        """binary32 bits of a power of two from its exponent field."""
        return Cat(Const(0, 23), fld, Const(0, 1))

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        W, B = hw.weights_per_beat, hw.act_block
        G = W // 8                                    # 8-column groups (one plane word each) per stored word
        LG = ceil_log2(G)
        w_depth = 1 << ceil_log2(max(2, self._max_elems // W))
        e_depth = 1 << ceil_log2(max(2, -(-self._max_elems // B)))
        lW = ceil_log2(W)
        k_bits = max(lW + ceil_log2(w_depth), ceil_log2(e_depth))     # a column's index (sel 4) or less

        # ---- Writes: the quantiser's words and exponents; the running maximum exponent ---------------------
        m.submodules.words = words = Memory(shape=data.ArrayLayout(signed(8), W), depth=w_depth, init=[])
        # a block's exponent is kept as its two scales' exponent fields (lo, hi), made as it is written
        m.submodules.exps = exps = Memory(shape=unsigned(16), depth=e_depth, init=[])
        w_wr, w_rd = words.write_port(), words.read_port(domain="comb")
        e_wr, e_rd = exps.write_port(), exps.read_port(domain="comb")
        m.d.comb += [self.i_act.ready.eq(1), self.i_exp.ready.eq(1),
                     w_wr.en.eq(self.i_act.valid), w_wr.addr.eq(self.i_act.p.addr),   # addr wraps (truncated)
                     e_wr.en.eq(self.i_exp.valid), e_wr.addr.eq(self.i_exp.p.addr),
                     e_wr.data.eq(Cat(self._field(m, self.i_exp.p.e, 127, "lo_field"),
                                      self._field(m, self.i_exp.p.e, 127 + 4, "hi_field")))]
        for i in range(W):
            m.d.comb += w_wr.data[i].eq(self.i_act.p.q[i])                           # |q| <= 119: low 8 bits

        emax = Signal(signed(EXP_BITS))
        m.d.comb += emax.eq(Mux(self.i_clear, EXP_MIN, self.o_emax))
        with m.If(self.i_exp.valid & (self.i_exp.p.e > emax)):
            m.d.sync += self.o_emax.eq(self.i_exp.p.e)
        with m.Else():
            m.d.sync += self.o_emax.eq(emax)
        m.d.comb += self.o_vscale.eq(self._pow2_bits(self._field(m, self.o_emax, 127, "vscale_field")))

        # ---- Reads: element k of the running command into the read stage, then the o_elem register -----------
        # The memories' asynchronous reads end in the read stage's registers (`s_*`: the element's 8-column
        # group of the stored word, its scale's exponent field), so the plane, byte and scale logic starts at a
        # flip-flop, not at a LUTRAM's output.
        r_left = Signal(N_BITS)
        r_k = Signal(k_bits)                          # wraps with the memories (power-of-two depths)
        r_sel = Signal(3)
        byte = Signal()                               # sel 4, a register of its own
        m.d.comb += [w_rd.addr.eq(Mux(byte, r_k[lW:], r_k[LG:])), e_rd.addr.eq(r_k)]
        # the group: columns 8k .. 8k+7 (planes) or the one holding column k (bytes)
        gidx = Mux(byte, r_k[3:lW], r_k[:LG]) if G > 1 else 0
        s_valid = Signal()
        s_grp = Signal(64)
        s_byte = Signal(3)                            # column k within the group (sel 4)
        s_field = Signal(8)                           # the scale's exponent field (sel 2, 3)

        value = Cat(s_grp.word_select(s_byte, 8), Const(0, 24))
        nibbles = []
        for i in range(8):
            q = s_grp[8 * i:8 * i + 8]
            hi = Signal(4, name=f"hi_{i}")
            m.d.comb += hi.eq(q[4:8] + q[3])          # ((q + 8) >> 4) & 0xF
            nibbles.append(Mux(r_sel[0], q[0:4], hi))
        plane = Cat(*nibbles)
        scale = self._pow2_bits(s_field)

        read, load = Signal(), Signal()
        r_more = Signal()                             # r_left != 0, registered with it
        take = ~self.o_elem.valid | self.o_elem.ready   # the o_elem register can take an element
        m.d.comb += [self.o_busy.eq(r_more | s_valid | self.o_elem.valid),
                     self.i_cmd.ready.eq(~self.o_busy),
                     load.eq(s_valid & take),
                     read.eq(r_more & (~s_valid | take))]
        with m.If(self.i_cmd.valid & self.i_cmd.ready):
            m.d.sync += [r_left.eq(self.i_cmd.p.n), r_more.eq(self.i_cmd.p.n != 0), r_k.eq(0),
                         r_sel.eq(self.i_cmd.p.sel), byte.eq(self.i_cmd.p.sel == 4)]
        with m.If(read):
            m.d.sync += [s_valid.eq(1), s_grp.eq(w_rd.data.as_value().word_select(gidx, 64) if G > 1
                                                 else w_rd.data.as_value()),
                         s_byte.eq(r_k[:3]), s_field.eq(Mux(r_sel[0], e_rd.data[:8], e_rd.data[8:])),
                         r_left.eq(r_left - 1), r_more.eq(r_left != 1), r_k.eq(r_k + 1)]
        with m.Elif(load):
            m.d.sync += s_valid.eq(0)
        with m.If(load):
            m.d.sync += [self.o_elem.valid.eq(1),
                         self.o_elem.payload.eq(Mux(byte, value, Mux(r_sel[1], scale, plane)))]
        with m.Elif(self.o_elem.ready):
            m.d.sync += self.o_elem.valid.eq(0)
        return m
