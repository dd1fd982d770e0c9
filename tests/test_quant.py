"""The activation quantiser (hdl.quant.ActQuantizer) in the Amaranth simulator, bit for bit against
`sim.numerics.quantize_activations`: the activation and exponent memories it writes (as the GEMV engine's
i_act / i_exp would store them) are compared as integer arrays with the model's q and e, for seeded random
vectors spread over the whole binary32 range, directed corners, random stalls on every stream and
back-to-back commands; plus the inf/NaN flag, command ordering and a cycle-exact throughput check. The
INT8 KV cache's command options too: ``limit`` (``|q| <= KV_Q_MAX``, `quantize_activations` with that
limit) and ``force`` (one given exponent for every block: `quantize_forced`), mixed back to back."""

import random

import numpy as np
import pytest
from amaranth import Module, unsigned
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.sim import Simulator

from hdl.axi import AxiReadSignature
from hdl.config import HardwareConfig
from hdl.l2 import beat_layout
from hdl.gemv import EXP_BITS, GemvEngine
from hdl.gemv import command_layout as gemv_command_layout
from hdl.quant import KV_Q_MAX, Q_MAX, ActQuantizer, act_write_layout, exp_write_layout
from hdl.quant import command_layout as quant_command_layout
from sim.numerics import INT8_MAX, quantize_activations
from sim.numerics import KV_Q_MAX as SIM_KV_Q_MAX
from tb.quant.vectors import F32_MAX, LANES, beats, send_words, spread_vector
from tb.runner import run

TINY = HardwareConfig.preset("tiny")
KV260 = HardwareConfig.preset("kv260")
# Activation blocks narrower than a beat (a word spans several blocks) and wider than one.
NARROW = TINY.replace(name="narrow", act_block=4, gemv_max_cols=256)
WIDE = TINY.replace(name="wide", act_block=64, gemv_max_cols=256)

TINIEST = np.float32(2.0 ** -149)


def _sext(v: int, bits: int) -> int:
    return v - (1 << bits) if v >> (bits - 1) else v


NO_OPTS = (0, 0, 0)                 # (limit, force, e): the WGEMV command


def quantize_forced(x, e: int) -> np.ndarray:
    """The ``force`` option's model: q = rne(x * 2**-e) per element (exact scaling in float64, one RNE)."""
    return np.rint(np.ldexp(np.asarray(x, np.float32).astype(np.float64), -e)).astype(np.int64)


def forced_exponent(x, block: int, limit: int = KV_Q_MAX) -> int:
    """The exponent ATTN/KVST force for a V row: the largest block exponent at `limit` (all |q| <= limit)."""
    return int(np.max(quantize_activations(np.asarray(x, np.float32), block, limit)[1]))


def rtl_quantize(hw, vectors, *, opts=None, seed=0, p_idle=0.0, p_stall=0.0, cmd_gap=0, max_cycles=None):
    """Runs `vectors` (binary32 arrays, or raw uint32 bit patterns) through ActQuantizer as back-to-back
    commands, with the command options `opts` (one ``(limit, force, e)`` per vector; default all 0).
    Returns a dict: ``act`` / ``exp``: every accepted write in order as (cycle, addr, value) with
    value a tuple of W lane integers / an exponent; ``done``: (cycle, o_nonfinite) per o_done pulse;
    ``take``: the cycles in which a beat (four elements) was accepted; ``cmd``: the command acceptance
    cycles."""
    dut = ActQuantizer(hw)
    opts = list(opts) if opts is not None else [NO_OPTS] * len(vectors)
    assert len(opts) == len(vectors)
    W, A = hw.weights_per_beat, hw.act_bits
    act_l, exp_l = act_write_layout(hw), exp_write_layout(hw)
    rng = random.Random(seed)
    bits = [np.asarray(v).view(np.uint32) if np.asarray(v).dtype == np.float32 else np.asarray(v, np.uint32)
            for v in vectors]
    out = {"act": [], "exp": [], "done": [], "take": [], "cmd": []}
    total_words = sum(-(-len(b) // W) for b in bits)
    cycle = [0]

    async def commands(ctx):
        for b, (limit, force, e) in zip(bits, opts):
            for _ in range(cmd_gap):
                await ctx.tick()
            while p_idle and rng.random() < p_idle:
                await ctx.tick()
            ctx.set(dut.i_cmd.valid, 1)
            ctx.set(dut.i_cmd.p.n, len(b))
            ctx.set(dut.i_cmd.p.limit, limit)
            ctx.set(dut.i_cmd.p.force, force)
            ctx.set(dut.i_cmd.p.e, e)
            await ctx.tick().until(dut.i_cmd.ready)
            ctx.set(dut.i_cmd.valid, 0)

    async def elements(ctx):
        await send_words(ctx, dut.i_beat, [w for b in bits for w in beats(b)], rng=rng, p_idle=p_idle)

    async def sinks(ctx):
        limit = max_cycles or 50 * sum(len(b) for b in bits) + 200
        while len(out["done"]) < len(bits) or len(out["act"]) < total_words:
            ctx.set(dut.o_act.ready, int(not (p_stall and rng.random() < p_stall)))
            ctx.set(dut.o_exp.ready, int(not (p_stall and rng.random() < p_stall)))
            _, _, av, ar, ap, ev, er, ep, done, nf, ev_take, cv, cr = await ctx.tick().sample(
                dut.o_act.valid, dut.o_act.ready, dut.o_act.payload.as_value(),
                dut.o_exp.valid, dut.o_exp.ready, dut.o_exp.payload.as_value(), dut.o_done, dut.o_nonfinite,
                dut.i_beat.valid & dut.i_beat.ready, dut.i_cmd.valid, dut.i_cmd.ready)
            c = cycle[0]
            if av and ar:
                addr = ap & ((1 << act_l["addr"].width) - 1)
                qbits = ap >> act_l["q"].offset
                out["act"].append((c, addr, tuple(_sext((qbits >> (A * i)) & ((1 << A) - 1), A) for i in range(W))))
            if ev and er:
                abits = exp_l["addr"].width
                out["exp"].append((c, ep & ((1 << abits) - 1), _sext(ep >> exp_l["e"].offset, EXP_BITS)))
            if done:
                out["done"].append((c, nf))
            if ev_take:
                out["take"].append(c)
            if cv and cr:
                out["cmd"].append(c)
            cycle[0] += 1
            assert cycle[0] < limit, f"timeout after {limit} cycles: {len(out['done'])} of {len(bits)} commands done"
        for _ in range(8):                           # nothing more may appear
            _, _, av, ev, done = await ctx.tick().sample(dut.o_act.valid, dut.o_exp.valid, dut.o_done)
            assert not (av or ev or done), "the quantiser produced output after its last command was done"

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(commands)
    sim.add_testbench(elements)
    sim.add_testbench(sinks)
    sim.run()
    return out


def memories(hw, vectors, res):
    """Splits the write streams per command (each command writes its words and exponents once each, in
    address order: checked) and returns per command the memory images ``(act int [words, W], exp int
    [blocks])``."""
    W, B = hw.weights_per_beat, hw.act_block
    acts, exps = list(res["act"]), list(res["exp"])
    images = []
    for k, v in enumerate(vectors):
        nw, nb = -(-len(v) // W), -(-len(v) // B)
        a, acts = acts[:nw], acts[nw:]
        e, exps = exps[:nb], exps[nb:]
        assert [w[1] for w in a] == list(range(nw)), f"command {k}: word addresses {[w[1] for w in a]}"
        assert [x[1] for x in e] == list(range(nb)), f"command {k}: exponent addresses {[x[1] for x in e]}"
        images.append((np.array([w[2] for w in a], dtype=np.int64).reshape(nw, W),
                       np.array([x[2] for x in e], dtype=np.int64)))
    assert not acts and not exps, "writes beyond the commands' words and exponents"
    return images


def expected(hw, x, opt=NO_OPTS):
    """The model's memory images: q padded with zeros to whole words, one exponent per block. `opt` is the
    command's ``(limit, force, e)``: limit 1 is `quantize_activations` at KV_Q_MAX, force 1 is
    `quantize_forced` with e in every block (the caller's guarantee |q| <= the limit is asserted)."""
    W, B = hw.weights_per_beat, hw.act_block
    limit, force, e_forced = opt
    x = np.asarray(x, dtype=np.float32)
    lim = KV_Q_MAX if limit else INT8_MAX
    if force:
        q, e = quantize_forced(x, e_forced), np.full(-(-len(x) // B), e_forced)
        assert np.all(np.abs(q) <= lim), f"forced exponent {e_forced} breaks the caller's guarantee |q| <= {lim}"
    else:
        q, e = quantize_activations(x, B, lim)
    q = np.pad(q.astype(np.int64), (0, -len(q) % W)).reshape(-1, W)
    return q, e.astype(np.int64)


def check(hw, vectors, res, what, opts=None):
    assert len(res["done"]) == len(vectors), f"{what}: {len(res['done'])} o_done pulses for {len(vectors)} commands"
    opts = list(opts) if opts is not None else [NO_OPTS] * len(vectors)
    for k, (v, opt, (act, exp)) in enumerate(zip(vectors, opts, memories(hw, vectors, res))):
        q, e = expected(hw, v, opt)
        np.testing.assert_array_equal(exp, e, err_msg=f"{what}: command {k} (n={len(v)}, options {opt}) exponents")
        np.testing.assert_array_equal(act, q, err_msg=f"{what}: command {k} (n={len(v)}, options {opt}) activations")
        assert res["done"][k][1] == 0, f"{what}: command {k}: o_nonfinite on finite input"
    # o_done of command k follows its last word's write.
    W = hw.weights_per_beat
    ends = np.cumsum([-(-len(v) // W) for v in vectors]) - 1
    for k, end in enumerate(ends):
        assert res["done"][k][0] == res["act"][end][0] + 1, f"{what}: command {k}: o_done not right after its last word"


def random_lengths(hw, rng):
    W, B = hw.weights_per_beat, hw.act_block
    fixed = sorted({1, max(1, W - 1), W, W + 1, max(1, B - 1), B, B + 1, 3 * B + 5})
    return fixed + [int(rng.integers(1, 200))]


@pytest.mark.parametrize("hw", [TINY, KV260, NARROW, WIDE], ids=lambda h: h.name)
def test_random_vectors_with_stalls(hw):
    """Seeded random vectors of the lengths at the block edges (1, W-1, W, act_block +- 1, ...) over the whole
    binary32 range, back to back, with random bubbles on i_cmd / i_beat and random ready on o_act / o_exp."""
    rng = np.random.default_rng(11)
    vectors = [spread_vector(rng, n, hw.act_block) for n in random_lengths(hw, rng)]
    res = rtl_quantize(hw, vectors, seed=3, p_idle=0.3, p_stall=0.3)
    check(hw, vectors, res, f"{hw.name} random, stalls")


def test_full_length_and_no_stalls():
    """gemv_max_cols columns on tiny (the engine's whole activation memory), no stalls, then short
    commands back to back."""
    rng = np.random.default_rng(12)
    vectors = [spread_vector(rng, TINY.gemv_max_cols, TINY.act_block)] + \
        [spread_vector(rng, n, TINY.act_block) for n in (1, 2, 17, 1, 16)]
    res = rtl_quantize(TINY, vectors)
    check(TINY, vectors, res, "tiny full length")


def corner_vectors(block: int) -> list[np.ndarray]:
    f = np.float32
    vs = []
    vs.append(np.zeros(block + 3, f))                                          # all zero: e = 0, q = 0
    z = np.zeros(block, f)
    z[1::2] = -0.0
    vs.append(z)                                                               # +-0 mixed
    v = np.full(block, 1e-3, f)
    v[3] = F32_MAX                                                             # one huge value: e = 121
    vs.append(v)
    vs.append(np.array([-F32_MAX] + [F32_MAX] * (block - 1), f))
    # Ties after scaling: max 127 gives e = 0, then k + 0.5 rounds to even.
    ties = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 125.5, 3.5, 0.25, 0.75, -0.75,
                     63.5, 64.5], f)
    vs.append(np.resize(ties, block) if block >= 2 else ties[:1])
    for k in (-150, -140, -20, 0, 10, 120):                                    # the same ties at 2**k
        vs.append((np.resize(ties, max(block, 2)).astype(np.float64) * 2.0 ** k).astype(np.float32))
    # max |x| exactly 127 * 2**k (e = k, q = +-127) and just above (e = k + 1, q = 64).
    for k in (-155, -149, -130, -126, -7, 0, 3, 121):
        top = np.float32(127 * 2.0 ** k)
        above = np.nextafter(top, np.float32(np.inf))
        below = np.nextafter(top, np.float32(0))
        vs.append(np.array([top, -top / 2, below] + [top / 3] * (block - 3), f)[:max(block, 3)])
        vs.append(np.array([-above, top, below] + [above / 5] * (block - 3), f)[:max(block, 3)])
    # 127.5 * 2**k - ulp and friends: m just below / at / above 127/128.
    for mant in (0x7E0000, 0x7E0001, 0x7DFFFF, 0x7FFFFF, 0x000000):
        for ef in (1, 2, 127, 254):
            vs.append(np.array([((ef << 23) | mant)] + [((ef << 23) | mant) - 1] * 2, np.uint32).view(f))
    # Subnormal blocks: the smallest (e = -155, q = 64), the largest, a mix with normals.
    vs.append(np.array([TINIEST, -TINIEST, 0, TINIEST * 3], f))
    sub = np.arange(1, 24, dtype=np.uint32)
    vs.append(np.concatenate([(1 << sub) - 1, (1 << sub)]).astype(np.uint32).view(f))   # every leading-one position
    vs.append(np.array([0x007FFFFF, 0x00000001, 0x80400000, 0x00000081], np.uint32).view(f))
    vs.append(np.array([0x00800000, 0x007FFFFF, 0x00000001, 0x80000003], np.uint32).view(f))
    return vs


@pytest.mark.parametrize("hw", [TINY, NARROW], ids=lambda h: h.name)
def test_corners(hw):
    """All-zero blocks, signed zeros, one huge value, exact ties at .5, max |x| exactly 127 * 2**k and the
    next binary32 above, mantissas at the 127/128 compare, subnormal blocks (every leading-one position)."""
    vectors = corner_vectors(hw.act_block)
    # Spot-check the model on the corners of the docstring, independently of the RTL.
    q, e = quantize_activations(np.array([127, 0.5, 1.5, 2.5, -2.5], np.float32), 64)
    assert e.tolist() == [0] and q.tolist() == [127, 0, 2, 2, -2]
    q, e = quantize_activations(np.array([TINIEST], np.float32), 64)
    assert e.tolist() == [-155] and q.tolist() == [64]
    res = rtl_quantize(hw, vectors, seed=5, p_idle=0.2, p_stall=0.2)
    check(hw, vectors, res, f"{hw.name} corners")


def test_nonfinite_flag():
    """o_nonfinite is set with the o_done of a command holding an inf or NaN (anywhere, in any block) and
    cleared by the next clean command's; the clean commands around it stay bit-exact."""
    hw = TINY
    rng = np.random.default_rng(13)
    B = hw.act_block
    clean = [spread_vector(rng, n, B) for n in (40, 3, 33)]
    bad = []
    for pos, val in ((0, np.inf), (B + 2, -np.inf), (2 * B - 1, np.nan), (5, np.float32(-np.nan))):
        v = spread_vector(rng, 2 * B + 1, B)
        v[pos] = val
        bad.append(v)
    vectors = [clean[0], bad[0], clean[1], bad[1], bad[2], clean[2], bad[3]]
    flags = [0, 1, 0, 1, 1, 0, 1]
    res = rtl_quantize(hw, vectors, seed=7, p_idle=0.2, p_stall=0.2)
    assert [nf for _, nf in res["done"]] == flags
    images = memories(hw, vectors, res)
    for k in (0, 2, 5):
        q, e = expected(hw, vectors[k])
        np.testing.assert_array_equal(images[k][0], q)
        np.testing.assert_array_equal(images[k][1], e)


def test_zero_length_command():
    """n = 0: accepted once the unit is idle, nothing written, o_done pulses (in order with the others)."""
    rng = np.random.default_rng(14)
    vectors = [spread_vector(rng, 20, TINY.act_block), np.zeros(0, np.float32), spread_vector(rng, 5, 16),
               np.zeros(0, np.float32)]
    res = rtl_quantize(TINY, vectors, seed=8, p_idle=0.2, p_stall=0.2)
    assert len(res["done"]) == 4
    images = memories(TINY, vectors, res)
    for k in (0, 2):
        q, e = expected(TINY, vectors[k])
        np.testing.assert_array_equal(images[k][0], q)
        np.testing.assert_array_equal(images[k][1], e)
    # The empty command's o_done comes after command 0's (it waits for an idle unit).
    assert res["done"][0][0] < res["done"][1][0] < res["done"][2][0] < res["done"][3][0]


def fill_schedule(hw, lengths, t0: int, latency: int) -> tuple[list[int], list[int]]:
    """The quantiser's timing contract with always-valid input and always-ready outputs, from the first beat's
    cycle `t0`: per block (act_block elements, a command's last one the rest) of ``b`` beats, a beat is taken
    in every cycle in which the fill's two stages advance, and it is written into the ring (leaves f2) in the
    second such cycle after its take; the stages advance unless f2 holds the first beat of a block whose ring
    slot (block k uses slot k % 2) is not free, i.e. before the cycle after the read-back issued the last word
    of block k - 2. The read-back issues a word per cycle from the cycle after the block's last beat is
    written, or after the previous block's last word. Returns (the beat cycles, the o_done cycle per command:
    `latency` after its last word's issue)."""
    B = hw.act_block
    beats, sizes, cmd_last = [], [], []    # beats: (block, first beat of its block, last beat of its block)
    for n in lengths:
        for start in range(0, n, B):
            b = -(-min(B, n - start) // LANES)
            beats += [(len(sizes), i == 0, i == b - 1) for i in range(b)]
            sizes.append(b)
        cmd_last.append(len(sizes) - 1)
    go, read_end, read_next = [t0], [], 0  # go: the cycles in which the stages advance
    for g in range(1, len(beats) + 2):
        c = go[-1] + 1                     # f2 holds beat g - 2
        if g >= 2:
            k, first, last = beats[g - 2]
            if first and k >= 2:
                c = max(c, read_end[k - 2] + 1)
            if last:
                r0 = max(c + 1, read_next)
                read_next = r0 + sizes[k]
                read_end.append(r0 + sizes[k] - 1)
        go.append(c)
    return go[:len(beats)], [read_end[k] + latency for k in cmd_last]


@pytest.mark.parametrize("hw", [TINY, KV260, NARROW], ids=lambda h: h.name)
def test_throughput_four_elements_per_cycle(hw):
    """Always-valid input and always-ready outputs: the beats (four elements each) are accepted exactly as
    `fill_schedule` says: one per cycle sustained through a long command (so four elements per cycle), a
    short block's slot turning over as soon as it is read; each o_done comes `latency` cycles after the
    read-back of the command's last word."""
    rng = np.random.default_rng(15)
    B = hw.act_block
    lengths = [4 * B + 3, 2 * B, 1, B + 1, 3 * hw.weights_per_beat, 7, 2, B - 1]
    vectors = [spread_vector(rng, n, B) for n in lengths]
    res = rtl_quantize(hw, vectors)
    check(hw, vectors, res, f"{hw.name} throughput")
    dut = ActQuantizer(hw)
    dut._MustUse__silence = True
    takes, dones = fill_schedule(hw, lengths, res["take"][0], dut.latency)
    assert res["take"] == takes
    assert [d for d, _ in res["done"]] == dones
    # a long command alone: one beat per cycle, start to end
    n = 16 * B + 5
    res = rtl_quantize(hw, [spread_vector(rng, n, B)])
    assert res["take"][-1] - res["take"][0] == -(-n // LANES) - 1, "not four elements per cycle"

# ---- The INT8 KV cache's options: limit (|q| <= 119) and a forced exponent ------------------------------------

def test_kv_q_max_is_the_models():
    """hdl.quant's limits are sim.numerics' (hdl never imports sim, so the test ties them)."""
    assert (Q_MAX, KV_Q_MAX) == (INT8_MAX, SIM_KV_Q_MAX)


def kv_limit_corners() -> list[np.ndarray]:
    """Blocks whose maximum sits on the 119 boundary: exactly 119 * 2**k (e = k, q = +-119) and the next
    binary32 above (e = k + 1), for normal and subnormal k, and subnormal maxima at every leading-one position
    where L = 119 and 127 differ (M = 15, 30, 60, 120 round up; 14, 29, 59, 119 do not), plus mantissas just
    below / above 119/128 of a binary32 exponent."""
    f = np.float32
    vs = []
    for k in (-149, -140, -126, -7, 0, 5, 120):
        top = f(119 * 2.0 ** k)
        above = np.nextafter(top, f(np.inf))
        vs.append(np.array([top, -top, -top / 2, np.nextafter(top, f(0))], f))
        vs.append(np.array([-above, top, above / 3, f(0.5 * 2.0 ** k)], f))
    for m in (14, 15, 29, 30, 59, 60, 119, 120, 127, 7, 8):            # subnormal maxima m * 2**-149
        vs.append(np.array([m, 0x80000000 | (m // 2), 1, m - 1], np.uint32).view(f))
    for mant in (0x6E0000, 0x6E0001, 0x6DFFFF, 0x7FFFFF, 0x000000):     # 119/128 = 0.9296875 = 1.859375 / 2
        for ef in (1, 2, 127, 254):
            vs.append(np.array([((ef << 23) | mant), ((ef << 23) | mant) - 1, 1 << 23], np.uint32).view(f))
    return vs


@pytest.mark.parametrize("hw", [TINY, KV260, NARROW, WIDE], ids=lambda h: h.name)
def test_limit_random_vectors_with_stalls(hw):
    """limit = 1 on seeded random vectors over the whole binary32 range (the lengths of the WGEMV test), with
    random bubbles and stalls: bit-exact against quantize_activations(x, block, 119)."""
    rng = np.random.default_rng(21)
    vectors = [spread_vector(rng, n, hw.act_block) for n in random_lengths(hw, rng)]
    opts = [(1, 0, 0)] * len(vectors)
    res = rtl_quantize(hw, vectors, opts=opts, seed=23, p_idle=0.3, p_stall=0.3)
    check(hw, vectors, res, f"{hw.name} limit 119 random, stalls (seed 21/23)", opts)


@pytest.mark.parametrize("hw", [TINY, NARROW], ids=lambda h: h.name)
def test_limit_corners(hw):
    """limit = 1 on the WGEMV corners (zeros, huge, ties, subnormal blocks) and on the 119 boundary; every
    |q| <= 119 and q = +-119 is reached."""
    vectors = corner_vectors(hw.act_block) + kv_limit_corners()
    q, e = quantize_activations(np.array([119, -119, 119.5], np.float32), 64, SIM_KV_Q_MAX)
    assert e.tolist() == [1] and q.tolist() == [60, -60, 60]
    q, e = quantize_activations(np.array([119, -119, 59.5], np.float32), 64, SIM_KV_Q_MAX)
    assert e.tolist() == [0] and q.tolist() == [119, -119, 60]
    opts = [(1, 0, 0)] * len(vectors)
    res = rtl_quantize(hw, vectors, opts=opts, seed=25, p_idle=0.2, p_stall=0.2)
    check(hw, vectors, res, f"{hw.name} limit 119 corners", opts)


def forced_cases(hw, rng) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
    """V rows as ATTN/KVST force them: e = the largest block exponent at limit 119 (so every |q| <= 119), also
    larger exponents (+1, +30: small elements shift out past the 31-bit window and round to 0), rows with
    very different block scales, subnormal rows, and exact ties at the forced exponent."""
    B = hw.act_block
    vectors, opts = [], []
    for n in (B, 3 * B + 5, 2 * B, 1, 40):
        v = spread_vector(rng, n, B)
        for extra in (0, 1, 30):
            vectors.append(v)
            opts.append((1, 1, forced_exponent(v, B) + extra))
        w = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20))).astype(np.float32)
        vectors.append(w)
        opts.append((1, 1, forced_exponent(w, B)))
    ties = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 118.5, -118.5, 117.5, 3.5, 119, -119, 0.25, -0.75], np.float64)
    for k in (-148, -140, -20, 0, 10, 100):                # -148: 118.5 * 2**k is still exact
        v = (ties * 2.0 ** k).astype(np.float32)
        vectors.append(v)
        opts.append((1, 1, k))
    sub = np.array([1, 2, 3, 0x7FFFFF, 0x400000, 0x80000005], np.uint32).view(np.float32)
    vectors.append(sub)
    opts.append((1, 1, forced_exponent(sub, B)))
    vectors.append(np.zeros(B + 3, np.float32))
    opts.append((1, 1, 0))
    return vectors, opts


@pytest.mark.parametrize("hw", [TINY, KV260, NARROW], ids=lambda h: h.name)
def test_forced_exponent(hw):
    """force = 1: every block of the command takes e (o_exp carries it), q = rne(x * 2**-e) per element
    (`quantize_forced`); random bubbles and stalls."""
    rng = np.random.default_rng(31)
    vectors, opts = forced_cases(hw, rng)
    res = rtl_quantize(hw, vectors, opts=opts, seed=33, p_idle=0.2, p_stall=0.3)
    check(hw, vectors, res, f"{hw.name} forced exponents (seed 31/33)", opts)


@pytest.mark.parametrize("hw", [TINY, KV260, NARROW, WIDE], ids=lambda h: h.name)
@pytest.mark.parametrize("flow", ["no stalls", "stalls"])
def test_options_back_to_back(hw, flow):
    """Commands with different options (WGEMV, limit, limit + force, force alone) back to back, always valid
    input: the fill side takes the next command's elements while the previous one's blocks are read back, so
    each block must use its own command's options (carried in the block FIFO)."""
    rng = np.random.default_rng(41)
    B = hw.act_block
    vectors, opts = [], []
    for _ in range(14):
        n = int(rng.integers(1, 3 * B + 2))
        v = spread_vector(rng, n, B) if rng.random() < 0.5 else \
            (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30))).astype(np.float32)
        kind = int(rng.integers(0, 4))
        limit, force = (0, 0) if kind == 0 else (1, 0) if kind == 1 else (1, 1) if kind == 2 else (0, 1)
        e = forced_exponent(v, B, KV_Q_MAX if limit else Q_MAX) if force else int(rng.integers(-512, 512))
        vectors.append(v)
        opts.append((limit, force, e))               # e is ignored without force: random there
    stall = 0.3 if flow == "stalls" else 0.0
    res = rtl_quantize(hw, vectors, opts=opts, seed=43, p_stall=stall)
    check(hw, vectors, res, f"{hw.name} mixed options back to back, {flow} (seed 41/43)", opts)
    if flow == "no stalls":
        dut = ActQuantizer(hw)
        dut._MustUse__silence = True
        takes, _ = fill_schedule(hw, [len(v) for v in vectors], res["take"][0], dut.latency)
        assert res["take"] == takes, "options cost throughput: the beats are not taken as fill_schedule says"


def test_parameter_errors():
    with pytest.raises(ValueError, match="act_bits must be at least 8"):
        ActQuantizer(TINY.replace(act_bits=6))
    with pytest.raises(TypeError, match="hw must be a HardwareConfig"):
        ActQuantizer("tiny")
    with pytest.raises(ValueError, match="gemv_max_cols must be below 65536"):
        ActQuantizer(TINY.replace(gemv_max_cols=1 << 16))
    with pytest.raises(ValueError, match="act_block must be a multiple of 4"):
        ActQuantizer(TINY.replace(act_block=2))


@pytest.mark.parametrize("hw", [TINY, HardwareConfig.preset("kv260_gemm"), KV260], ids=lambda h: h.name)
def test_plugs_into_gemv_engine(hw):
    """o_act / o_exp have exactly the signatures of GemvEngine.i_act / i_exp (wiring.connect checks them); an
    engine of several vectors (kv260) takes the same words with the vector they go to (`vec`, which the
    controller sets from the pass's token)."""
    quant, gemv, m = ActQuantizer(hw), GemvEngine(hw), Module()
    quant._MustUse__silence = gemv._MustUse__silence = m._MustUse__silence = True   # never elaborated
    if hw.gemv_vectors == 1:
        wiring.connect(m, quant.o_act, gemv.i_act)
        wiring.connect(m, quant.o_exp, gemv.i_exp)
        return
    for out, into in ((quant.o_act, gemv.i_act), (quant.o_exp, gemv.i_exp)):
        q = out.p.shape().members
        e = dict(into.p.shape().members)
        assert e.pop("vec") == range(hw.gemv_vectors)
        assert dict(q) == e


# ---- The WGEMV path in cocotb + Verilator: quantiser -> GEMV engine memories -> y ---------------------------

class QuantGemv(wiring.Component):
    """The quantiser's o_act / o_exp wired to a GEMV engine's i_act / i_exp, as in the NPU's WGEMV; the other
    ports of both are brought out (tb/quant/test_quant_gemv.py lists them)."""

    def __init__(self, hw):
        self._hw = hw
        members = {
            "i_qcmd": In(stream.Signature(quant_command_layout())), "i_beat": In(stream.Signature(beat_layout())),
            "o_qdone": Out(1), "o_qbusy": Out(1), "o_nonfinite": Out(1),
            "i_cmd": In(stream.Signature(gemv_command_layout(hw))), "i_acc": In(stream.Signature(unsigned(32))),
            "o_y": Out(stream.Signature(unsigned(32))), "o_busy": Out(1), "o_error": Out(1), "o_bad_cmd": Out(1),
        }
        for p in range(hw.axi_ports):
            members[f"m_axi{p}"] = Out(AxiReadSignature.from_config(hw))
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        m.submodules.quant = quant = ActQuantizer(hw)
        m.submodules.gemv = gemv = GemvEngine(hw)
        wiring.connect(m, quant.o_act, gemv.i_act)
        wiring.connect(m, quant.o_exp, gemv.i_exp)
        wiring.connect(m, wiring.flipped(self.i_qcmd), quant.i_cmd)
        wiring.connect(m, wiring.flipped(self.i_beat), quant.i_beat)
        wiring.connect(m, wiring.flipped(self.i_cmd), gemv.i_cmd)
        wiring.connect(m, wiring.flipped(self.i_acc), gemv.i_acc)
        wiring.connect(m, gemv.o_y, wiring.flipped(self.o_y))
        for p in range(hw.axi_ports):
            wiring.connect(m, getattr(gemv, f"m_axi{p}"), wiring.flipped(getattr(self, f"m_axi{p}")))
        m.d.comb += [self.o_qdone.eq(quant.o_done), self.o_qbusy.eq(quant.o_busy),
                     self.o_nonfinite.eq(quant.o_nonfinite), self.o_busy.eq(gemv.o_busy),
                     self.o_error.eq(gemv.o_error), self.o_bad_cmd.eq(gemv.o_bad_cmd)]
        return m


def _run_wgemv(testcase, **env):
    run(QuantGemv(TINY), toplevel="quant_gemv", test_module="tb.quant.test_quant_gemv", build_name="quant_gemv_tiny",
        testcase=testcase, extra_env={"NPU_HW": "tiny", **{k: str(v) for k, v in env.items()}})


def test_wgemv_path():
    """binary32 x -> ActQuantizer -> GemvEngine (tiny) -> y, bit-exact against
    sim.numerics.gemv(..., *quantize_activations(x)): random cases under DDR latency 20 +- 10 and 25 % stalls,
    then the directed corners, the inf/NaN flag and the quantiser's rate (one Verilator build, about 70 s)."""
    _run_wgemv(["wgemv_random", "wgemv_corners_and_rate"], SEED=52, FLOW=1)


@pytest.mark.slow
@pytest.mark.parametrize("flow", [0, 2])
def test_wgemv_path_other_flows(flow):
    """The random cases with no stalls (flow 0) and with a long fixed latency and rare stalls (flow 2)."""
    _run_wgemv("wgemv_random", SEED=51 + flow, FLOW=flow)
