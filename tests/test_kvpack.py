"""The INT8 KV cache's packer (hdl.quant.KvPacker) in the Amaranth simulator, bit for bit against
`sim.numerics`: the quantiser (limit / force commands) writes a K or V row into the packer, which reads it
back as the KV cache stores it (a V row also as its INT8 values, the bytes of the V rows layout). K rows (one quantiser pass at limit 119): the hi / lo plane words must be
`pack_int4` of `quantize_kv_k`'s planes and the scales, converted binary32 -> binary16, its scale_hi /
scale_lo. V rows, as the controller runs KVST: pass A (limit) only for ``o_emax``, pass B (limit, force, e =
o_emax) for the planes; the planes and ``o_vscale`` against `quantize_kv_v`. Seeded random rows of 16 and 256
elements on tiny and kv260, directed corners, random stalls on ``o_elem``; and the packer alone, fed
directly, for the exponent clamp over every exponent, ``i_clear``, address wrap and back-to-back reads."""

import random

import numpy as np
import pytest
from amaranth import Elaboratable, Module
from amaranth.lib import wiring
from amaranth.sim import Simulator

from hdl.config import HardwareConfig, ceil_log2
from hdl.gemv import EXP_BITS
from hdl.quant import EXP_MIN, ActQuantizer, KvPacker
from sim.numerics import (KV_Q_MAX, pack_int4, pow2_binary16, quantize_activations, quantize_kv_k,
                          quantize_kv_v)
from tb.quant.vectors import F32_MAX, beats, send_words, spread_vector

TINY = HardwareConfig.preset("tiny")
KV260 = HardwareConfig.preset("kv260")
NARROW = TINY.replace(name="narrow", act_block=4, gemv_max_cols=256)      # blocks narrower than a plane word

SEL_HI, SEL_LO, SEL_SHI, SEL_SLO, SEL_BYTES = range(5)


class QuantPack(Elaboratable):
    """The quantiser's o_act / o_exp wired to a KV packer, as in the controller's KVST."""

    def __init__(self, hw, max_elems=256):
        self.quant = ActQuantizer(hw)
        self.packer = KvPacker(hw, max_elems)

    def elaborate(self, platform):
        m = Module()
        m.submodules.quant = self.quant
        m.submodules.packer = self.packer
        wiring.connect(m, self.quant.o_act, self.packer.i_act)
        wiring.connect(m, self.quant.o_exp, self.packer.i_exp)
        return m


# ---- models --------------------------------------------------------------------------------------------------

def plane_words(nibbles) -> np.ndarray:
    """A plane as the packer reads it: the bytes of pack_int4, as little-endian uint32 (8 columns each)."""
    return pack_int4(np.asarray(nibbles)).view("<u4")


def to_binary16(bits) -> np.ndarray:
    """binary32 bit patterns -> binary16 (RNE) bit patterns, to compare with the model's binary16 exactly
    (signed zeros included)."""
    with np.errstate(over="ignore"):
        return np.asarray(bits, np.uint32).view(np.float32).astype(np.float16).view(np.uint16)


def b16(x) -> np.ndarray:
    return np.asarray(x, np.float16).view(np.uint16)


def pow2_binary32_clamped(e) -> np.ndarray:
    """The packer's scale encoding: binary32 2**e with the exponent field clamped to [97, 255]."""
    return (np.clip(np.asarray(e, np.int64) + 127, 97, 255) << 23).astype(np.uint32)


# ---- testbench steps -----------------------------------------------------------------------------------------

async def quantise(ctx, quant, x, *, limit=1, force=0, e=0, rng=None, p_idle=0.0):
    """One quantiser command over `x` (binary32), elements with random bubbles; returns once the quantiser
    is idle again (every word and exponent written into the packer)."""
    ctx.set(quant.i_cmd.p.n, len(x))
    ctx.set(quant.i_cmd.p.limit, limit)
    ctx.set(quant.i_cmd.p.force, force)
    ctx.set(quant.i_cmd.p.e, e)
    ctx.set(quant.i_cmd.valid, 1)
    await ctx.tick().until(quant.i_cmd.ready)
    ctx.set(quant.i_cmd.valid, 0)
    await send_words(ctx, quant.i_beat, beats(np.asarray(x, np.float32).view(np.uint32)), rng=rng, p_idle=p_idle)
    await ctx.tick().until(~quant.o_busy)


async def read(ctx, packer, cmds, *, rng, p_stall=0.0):
    """Runs the read commands `cmds` ((sel, n) each) on the packer, the next one offered as soon as the
    previous is accepted (so they go back to back), with o_elem.ready low with probability `p_stall`.
    Returns per command its elements (uint32 arrays). Checks that nothing more comes and o_busy falls."""
    total = sum(n for _, n in cmds)
    got, ci, cycles = [], 0, 0
    limit = 20 * total + 50
    while ci < len(cmds) or len(got) < total:
        if ci < len(cmds):
            ctx.set(packer.i_cmd.p.sel, cmds[ci][0])
            ctx.set(packer.i_cmd.p.n, cmds[ci][1])
        ctx.set(packer.i_cmd.valid, int(ci < len(cmds)))
        ctx.set(packer.o_elem.ready, int(not (p_stall and rng.random() < p_stall)))
        _, _, cv, cr, ev, er, ep, busy = await ctx.tick().sample(
            packer.i_cmd.valid, packer.i_cmd.ready, packer.o_elem.valid, packer.o_elem.ready,
            packer.o_elem.payload, packer.o_busy)
        if cv and cr:
            assert not busy, "a read command was accepted while the packer was busy"
            ci += 1
        if ev and er:
            assert busy, "an element left while o_busy was low"
            got.append(ep)
        cycles += 1
        assert cycles < limit, f"read timeout: {len(got)} of {total} elements after {cycles} cycles"
    ctx.set(packer.i_cmd.valid, 0)
    ctx.set(packer.o_elem.ready, 1)
    for _ in range(3):
        _, _, ev, busy = await ctx.tick().sample(packer.o_elem.valid, packer.o_busy)
        assert not ev and not busy, "the packer produced more elements than commanded"
    out, k = [], 0
    for _, n in cmds:
        out.append(np.array(got[k:k + n], np.uint32))
        k += n
    return out


async def clear(ctx, packer):
    ctx.set(packer.i_clear, 1)
    await ctx.tick()
    ctx.set(packer.i_clear, 0)


def run_sim(dut, bench):
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()


def rtl_kv_rows(hw, rows, *, seed, p_idle=0.0, p_stall=0.0, max_elems=256):
    """Each row of `rows` ((kind, x), kind "k" or "v") through quantiser + packer. K: one limit pass, then
    the four streams. V: i_clear, pass A (limit), o_emax, pass B (limit, force, e = o_emax), the two planes,
    the lo scales (every block carries the forced exponent) and o_vscale. Returns a dict per row."""
    dut = QuantPack(hw, max_elems)
    B = hw.act_block
    rng = random.Random(seed)
    results = []

    async def bench(ctx):
        q, pk = dut.quant, dut.packer
        for kind, x in rows:
            n, nb = len(x), -(-len(x) // B)
            r = {}
            if kind == "k":
                await quantise(ctx, q, x, limit=1, rng=rng, p_idle=p_idle)
                r["hi"], r["lo"], r["shi"], r["slo"] = await read(
                    ctx, pk, [(SEL_HI, n // 8), (SEL_LO, n // 8), (SEL_SHI, nb), (SEL_SLO, nb)],
                    rng=rng, p_stall=p_stall)
            else:
                await clear(ctx, pk)
                assert ctx.get(pk.o_emax) == EXP_MIN, "o_emax after i_clear"
                await quantise(ctx, q, x, limit=1, rng=rng, p_idle=p_idle)
                r["emax"] = ctx.get(pk.o_emax)
                await quantise(ctx, q, x, limit=1, force=1, e=r["emax"], rng=rng, p_idle=p_idle)
                r["vscale"] = ctx.get(pk.o_vscale)
                r["emax_b"] = ctx.get(pk.o_emax)
                r["hi"], r["lo"], r["slo"], r["bytes"] = await read(
                    ctx, pk, [(SEL_HI, n // 8), (SEL_LO, n // 8), (SEL_SLO, nb), (SEL_BYTES, n)], rng=rng,
                    p_stall=p_stall)
            results.append(r)

    run_sim(dut, bench)
    return results


def check_rows(hw, rows, results, what):
    B = hw.act_block
    for i, ((kind, x), r) in enumerate(zip(rows, results)):
        msg = f"{what}: row {i} ({kind}, n={len(x)})"
        if kind == "k":
            hi, lo, shi, slo = quantize_kv_k(x, B)
            np.testing.assert_array_equal(r["hi"], plane_words(hi), err_msg=f"{msg}: hi plane")
            np.testing.assert_array_equal(r["lo"], plane_words(lo), err_msg=f"{msg}: lo plane")
            np.testing.assert_array_equal(to_binary16(r["shi"]), b16(shi), err_msg=f"{msg}: hi scales")
            np.testing.assert_array_equal(to_binary16(r["slo"]), b16(slo), err_msg=f"{msg}: lo scales")
        else:
            hi, lo, s = quantize_kv_v(x)
            e_row = int(quantize_activations(np.asarray(x, np.float32), len(x), KV_Q_MAX)[1][0])
            assert r["emax"] == e_row, f"{msg}: o_emax {r['emax']} after pass A, the row's exponent is {e_row}"
            assert r["emax_b"] == e_row, f"{msg}: pass B (forced) moved o_emax to {r['emax_b']}"
            np.testing.assert_array_equal(r["hi"], plane_words(hi), err_msg=f"{msg}: hi plane")
            np.testing.assert_array_equal(r["lo"], plane_words(lo), err_msg=f"{msg}: lo plane")
            q = (16 * hi.astype(np.int16) + lo).astype(np.int8).view(np.uint8)
            np.testing.assert_array_equal(r["bytes"], q, err_msg=f"{msg}: INT8 values (the V rows' bytes)")
            assert to_binary16([r["vscale"]])[0] == b16(s), f"{msg}: o_vscale {r['vscale']:#010x} vs {s!r}"
            nb = -(-len(x) // B)
            np.testing.assert_array_equal(r["slo"], pow2_binary32_clamped(np.full(nb, e_row)),
                                          err_msg=f"{msg}: pass B's block exponents are not the forced one")


# ---- quantiser + packer: K and V rows ---------------------------------------------------------------------------

def random_row(rng, n, block):
    """Either a K/V-like row (normal values at a random scale, a few outliers) or one spread over the whole
    binary32 range (blocks from subnormal to huge)."""
    if rng.random() < 0.5:
        x = rng.standard_normal(n) * np.exp2(float(rng.integers(-12, 12)))
        x[rng.integers(0, n, 2)] *= 30
        return x.astype(np.float32)
    return spread_vector(rng, n, block)


@pytest.mark.parametrize("hw, lengths", [(TINY, (16, 16, 256, 16, 256, 16)), (KV260, (16, 256, 16, 256))],
                         ids=["tiny", "kv260"])
def test_random_rows_with_stalls(hw, lengths):
    """Seeded random K and V rows of 16 and 256 elements, bubbles on the quantiser's i_beat and random o_elem.ready."""
    rng = np.random.default_rng(61)
    rows = [(kind, random_row(rng, n, hw.act_block)) for n in lengths for kind in ("k", "v")]
    res = rtl_kv_rows(hw, rows, seed=63, p_idle=0.2, p_stall=0.4)
    check_rows(hw, rows, res, f"{hw.name} random rows (seed 61/63)")


def test_random_rows_no_stalls_narrow_blocks():
    """Blocks of 4 (two scales per plane word), no stalls: one element per cycle."""
    rng = np.random.default_rng(65)
    rows = [(kind, random_row(rng, n, NARROW.act_block)) for n in (16, 64, 8) for kind in ("k", "v")]
    res = rtl_kv_rows(NARROW, rows, seed=67)
    check_rows(NARROW, rows, res, "narrow random rows (seed 65/67)")


def corner_rows(n: int) -> list[np.ndarray]:
    """All zeros; one huge value (F32_MAX: e = 122, scales +inf in binary16) among small ones; all-subnormal
    rows (e down to -155: the scale field clamps at 2**-30, binary16 0); values giving q = +-119 exactly
    (hi = +-7, lo = +-7) and just above 119 * 2**k (e = k + 1); every q in [-119, 119]; 2**-24 (the smallest
    binary16 scale) and 2**15 (the largest) at the scale's edges."""
    f = np.float32
    rows = [np.zeros(n, f)]
    v = np.full(n, 1e-3, f)
    v[n // 2] = F32_MAX
    rows.append(v)
    rows.append(np.where(np.arange(n) % 3 == 0, -F32_MAX, F32_MAX).astype(f))
    rows.append((np.arange(n, dtype=np.uint32) % 120 + 1).view(f))                        # subnormal, e <= -155
    rows.append((np.arange(n, dtype=np.uint32) * 0x9E3779B1 % 0x800000).view(f))          # subnormal, anywhere
    for k in (-140, -30, -24, 0, 9):
        t = (np.resize([119.0, -119.0, 3.0, -0.5, 118.5], n) * 2.0 ** k).astype(f)
        rows.append(t)
        above = t.copy()
        above[1] = -np.nextafter(f(119 * 2.0 ** k), f(np.inf))
        rows.append(above)
    rows.append(np.resize(np.arange(-119, 120), n).astype(f))                             # every q, e = 0
    for k in (-28, -24, 11, 12):                                                          # scale edges
        rows.append((np.resize([119.0, 1.0, -60.0], n) * 2.0 ** k).astype(f))
    return rows


@pytest.mark.parametrize("hw, n", [(TINY, 16), (KV260, 256)], ids=["tiny", "kv260"])
def test_corner_rows(hw, n):
    """The directed corners as K and V rows, with random o_elem stalls; also checks that they reach what they
    are for (q = +-119, an infinite and a zero binary16 scale)."""
    rows = corner_rows(n)
    B = hw.act_block
    qs = np.concatenate([quantize_activations(x, B, KV_Q_MAX)[0] for x in rows])
    assert qs.min() == -KV_Q_MAX and qs.max() == KV_Q_MAX
    scales = np.concatenate([np.concatenate(quantize_kv_k(x, B)[2:]) for x in rows])
    assert np.isinf(scales).any() and (scales == 0).any() and (scales == np.float16(2.0 ** -24)).any()
    kv_rows = [(kind, x) for x in rows for kind in ("k", "v")]
    res = rtl_kv_rows(hw, kv_rows, seed=71, p_stall=0.3)
    check_rows(hw, kv_rows, res, f"{hw.name} corner rows")


# ---- the packer alone, fed directly -----------------------------------------------------------------------------

def rtl_packer_direct(hw, max_elems, script, *, seed):
    """Drives a KvPacker's i_act / i_exp / i_clear directly. `script` is a list of steps:
    ``("act", addr, lanes)``, ``("exp", addr, e)``, ``("both", act_addr, lanes, exp_addr, e, clear)``,
    ``("clear",)``, ``("read", cmds, p_stall)``. Returns o_emax / o_vscale after every write step and the
    elements of every read step."""
    dut = KvPacker(hw, max_elems)
    rng = random.Random(seed)
    out = []

    def set_act(ctx, addr, lanes):
        word = 0
        for i, v in enumerate(lanes):
            word |= (int(v) & ((1 << hw.act_bits) - 1)) << (hw.act_bits * i)
        ctx.set(dut.i_act.p.addr, addr)
        ctx.set(dut.i_act.p.q.as_value(), word)
        ctx.set(dut.i_act.valid, 1)

    async def bench(ctx):
        for step in script:
            if step[0] == "read":
                out.append(("read", await read(ctx, dut, step[1], rng=rng, p_stall=step[2])))
                continue
            if step[0] == "act":
                set_act(ctx, step[1], step[2])
            elif step[0] == "exp":
                ctx.set(dut.i_exp.p.addr, step[1])
                ctx.set(dut.i_exp.p.e, step[2])
                ctx.set(dut.i_exp.valid, 1)
            elif step[0] == "both":
                set_act(ctx, step[1], step[2])
                ctx.set(dut.i_exp.p.addr, step[3])
                ctx.set(dut.i_exp.p.e, step[4])
                ctx.set(dut.i_exp.valid, 1)
                ctx.set(dut.i_clear, step[5])
            elif step[0] == "clear":
                ctx.set(dut.i_clear, 1)
            _, _, ar, er = await ctx.tick().sample(dut.i_act.ready, dut.i_exp.ready)
            assert ar and er, "i_act / i_exp must always be ready"
            for sig in (dut.i_act.valid, dut.i_exp.valid, dut.i_clear):
                ctx.set(sig, 0)
            out.append(("state", ctx.get(dut.o_emax), ctx.get(dut.o_vscale)))

    run_sim(dut, bench)
    return out


class PackerModel:
    """The packer's documented behaviour: memories of power-of-two depths (max_elems / W words and
    max_elems / B exponents rounded up, at least 2) with wrapping addresses, the running maximum exponent."""

    def __init__(self, hw, max_elems):
        self.W, self.B = hw.weights_per_beat, hw.act_block
        self.wd = 1 << ceil_log2(max(2, max_elems // self.W))
        self.ed = 1 << ceil_log2(max(2, max_elems // self.B))
        self.words = np.zeros((self.wd, self.W), np.int64)
        self.exps = np.zeros(self.ed, np.int64)
        self.emax = EXP_MIN

    def step(self, kind, *a):
        if kind in ("act", "both"):
            self.words[a[0] % self.wd] = a[1]
        if kind == "exp":
            self.exps[a[0] % self.ed] = a[1]
            self.emax = max(self.emax, a[1])
        if kind == "both":
            self.exps[a[2] % self.ed] = a[3]
            self.emax = max(EXP_MIN if a[4] else self.emax, a[3])
        if kind == "clear":
            self.emax = EXP_MIN
        return self.emax, int(pow2_binary32_clamped(self.emax))

    def read(self, sel, n):
        k = np.arange(n)
        if sel >= 2:
            return pow2_binary32_clamped(self.exps[k % self.ed] + (4 if sel == 2 else 0))
        cols = self.words.reshape(-1)
        q = cols[(8 * k[:, None] + np.arange(8)) % cols.size]
        hi = (q + 8) >> 4
        nib = (hi if sel == 0 else q - 16 * hi) & 0xF
        return (nib << (4 * np.arange(8))).sum(axis=1).astype(np.uint32)


@pytest.mark.parametrize("hw, max_elems", [(TINY, 32), (TINY, 48), (KV260, 256), (NARROW, 32)],
                         ids=["tiny-32", "tiny-48", "kv260-256", "narrow-32"])
def test_packer_direct(hw, max_elems):
    """Random words (every q in [-119, 119]) and exponents over the whole signed(EXP_BITS) range written
    straight into the packer, addresses past the memories (they wrap), i_clear alone and together with a
    write (the write counts); o_emax / o_vscale after every step, then reads of all four kinds back to back,
    longer than the memories, with random stalls."""
    rng = np.random.default_rng(81)
    model = PackerModel(hw, max_elems)
    W = hw.weights_per_beat
    n_words, n_exps = hw.gemv_max_cols // W, max(2, hw.gemv_max_cols // hw.act_block)
    script = []
    for _ in range(3):
        for _ in range(12):
            r = rng.random()
            lanes = rng.integers(-KV_Q_MAX, KV_Q_MAX + 1, W)
            if r < 0.4:
                script.append(("act", int(rng.integers(0, n_words)), lanes))
            elif r < 0.8:
                script.append(("exp", int(rng.integers(0, n_exps)), int(rng.integers(EXP_MIN, -EXP_MIN))))
            elif r < 0.9:
                script.append(("both", int(rng.integers(0, n_words)), lanes, int(rng.integers(0, n_exps)),
                               int(rng.integers(-200, 200)), int(rng.integers(0, 2))))
            else:
                script.append(("clear",))
        # every exponent slot once more, in order, so that the reads see fresh values
        for a in range(model.ed):
            script.append(("exp", a, int(rng.integers(EXP_MIN, -EXP_MIN))))
        for a in range(model.wd):
            script.append(("act", a, rng.integers(-KV_Q_MAX, KV_Q_MAX + 1, W)))
        cmds = [(int(rng.integers(0, 4)), int(rng.integers(1, 2 * max_elems // 8 + 3))) for _ in range(5)]
        cmds.insert(2, (SEL_HI, 0))                                          # n = 0: nothing, not busy
        script.append(("read", cmds, 0.3))
    res = rtl_packer_direct(hw, max_elems, script, seed=83)
    for i, (step, r) in enumerate(zip(script, res)):
        if step[0] == "read":
            for (sel, n), got in zip(step[1], r[1]):
                np.testing.assert_array_equal(got, model.read(sel, n),
                                              err_msg=f"step {i}: read sel {sel}, n {n} (seed 81/83)")
        else:
            want = model.step(*step)
            assert (r[1], r[2]) == want, f"step {i} {step[0]}: o_emax/o_vscale {r[1:]} vs {want} (seed 81/83)"


def test_scale_clamp_matches_binary16_for_every_exponent():
    """The clamped binary32 2**e converts to exactly the model's binary16 2**e for every e signed(EXP_BITS)
    holds (0 below 2**-25, +inf above 2**15), so the controller may convert the packer's scales as they are."""
    e = np.arange(EXP_MIN, -EXP_MIN)
    assert len(e) == 1 << EXP_BITS
    np.testing.assert_array_equal(to_binary16(pow2_binary32_clamped(e)), b16(pow2_binary16(e)))


def test_parameter_errors():
    with pytest.raises(TypeError, match="hw must be a HardwareConfig"):
        KvPacker("tiny")
    with pytest.raises(ValueError, match="act_bits must be at least 8"):
        KvPacker(TINY.replace(act_bits=6))
    for bad in (0, 24, 40, 8, 16.0, True):
        with pytest.raises(ValueError, match=r"max_elems must be a positive multiple of 32 \(8 and a beat of INT4 "
                                             r"weights\), not "):
            KvPacker(KV260, bad)
    KvPacker(KV260, 192)._MustUse__silence = True                           # not a power of two: allowed
    KvPacker(KV260, 32)._MustUse__silence = True                            # shorter than one act_block: allowed


@pytest.mark.parametrize("hw", [TINY, KV260], ids=lambda h: h.name)
def test_plugs_into_quantiser(hw):
    """i_act / i_exp have exactly the signatures of ActQuantizer.o_act / o_exp (wiring.connect checks them)."""
    quant, packer, m = ActQuantizer(hw), KvPacker(hw, 256), Module()
    quant._MustUse__silence = packer._MustUse__silence = m._MustUse__silence = True   # never elaborated
    wiring.connect(m, quant.o_act, packer.i_act)
    wiring.connect(m, quant.o_exp, packer.i_exp)


def test_latency_and_rate():
    """Always-ready o_elem: a command's first element is valid `latency` cycles after the command is accepted,
    then one per cycle; the next command is accepted in the cycle after the last element is taken."""
    hw = TINY
    dut = KvPacker(hw, 64)
    cmds = [(SEL_HI, 5), (SEL_SLO, 3), (SEL_LO, 1)]
    log = {"cmd": [], "elem": []}

    async def bench(ctx):
        ctx.set(dut.o_elem.ready, 1)
        cycle, ci = 0, 0
        while len(log["elem"]) < sum(n for _, n in cmds):
            if ci < len(cmds):
                ctx.set(dut.i_cmd.p.sel, cmds[ci][0])
                ctx.set(dut.i_cmd.p.n, cmds[ci][1])
            ctx.set(dut.i_cmd.valid, int(ci < len(cmds)))
            _, _, cv, cr, ev = await ctx.tick().sample(dut.i_cmd.valid, dut.i_cmd.ready, dut.o_elem.valid)
            if cv and cr:
                log["cmd"].append(cycle)
                ci += 1
            if ev:
                log["elem"].append(cycle)
            cycle += 1
            assert cycle < 100

    run_sim(dut, bench)
    want_elem, start = [], 0
    for (_, n), c in zip(cmds, log["cmd"]):
        first = c + dut.latency
        want_elem += list(range(first, first + n))
        assert c == start, f"command accepted in cycle {c}, expected {start} (right after the previous one)"
        start = first + n
    assert log["elem"] == want_elem
