"""GEMV engine parts in the Amaranth simulator: INT4 unpack + W4A8 products + exact segment sums
(`SegmentMac`) against `sim.numerics` unpacking and NumPy integer sums, the command decoder against the
contract's segment, group and row arithmetic, and the shared binary32 pipeline (`PartAccumulator`) against
NumPy binary32 arithmetic, the expression `sim.numerics.gemv` uses. The whole engine runs in the cocotb bench
(test_gemv_engine.py)."""

import numpy as np
import pytest
from amaranth.sim import Simulator

from hdl.config import HardwareConfig
from hdl.gemv import EXP_BITS, CommandDecoder, GemvEngine, PartAccumulator, SegmentMac, command_layout
from sim.numerics import pack_int4, segment_size, unpack_int4

TINY = HardwareConfig.preset("tiny")
KV260 = HardwareConfig.preset("kv260")


def rtl_segment_mac(cfg, steps, vectors=1, int8=False, pairs=False, rows=1):
    """Runs `steps` (dicts of packed weight bytes, int8 activations, nlanes, lvl, sel, first, last; with `int8`
    also ``int8``: the beat's bytes are INT8 weights; with `rows` > 1 also ``row``) through SegmentMac; returns
    the segment sums in output order. With `vectors` V > 1 each step's ``a`` is [V, W] and each output a tuple
    of V sums."""
    dut = SegmentMac(cfg, tag_bits=8, vectors=vectors, int8=int8, pairs=pairs, rows=rows)
    W = cfg.weights_per_beat
    got = []

    async def bench(ctx):
        for k, st in enumerate(steps + [None] * (dut.latency + 1)):
            if st is None:
                ctx.set(dut.i_valid, 0)
            else:
                ctx.set(dut.i_valid, 1)
                ctx.set(dut.i_w.as_value(), int.from_bytes(st["w"].tobytes(), "little"))
                ctx.set(dut.i_a.as_value(), int.from_bytes(st["a"].astype(np.int8).tobytes(), "little"))
                ctx.set(dut.i_nlanes, st["nl"])
                ctx.set(dut.i_lvl, st["lvl"])
                ctx.set(dut.i_sel, st["sel"])
                ctx.set(dut.i_first, st["first"])
                ctx.set(dut.i_last, st["last"])
                if int8:
                    ctx.set(dut.i_int8, int(st.get("int8", 0)))
                if rows > 1:
                    ctx.set(dut.i_row, st["row"])
                ctx.set(dut.i_tag, k & 0xFF)
            await ctx.tick()
            if ctx.get(dut.o_valid):
                sums = tuple(ctx.get(dut.o_isum[v]) for v in range(vectors))
                got.append(sums if vectors > 1 else sums[0])
        assert W == cfg.weights_per_beat

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return got


def ref_segment_mac(cfg, steps):
    """Independent reference: unpack with sim.numerics (an ``int8`` step: lane i takes the beat's signed byte
    i mod B), mask the lanes, sum exactly in int64; a step's ``row`` (default 0) picks its own running sum."""
    out, acc = [], {}
    W, B = cfg.weights_per_beat, cfg.bytes_per_beat
    for st in steps:
        if st.get("int8"):
            w = np.tile(np.asarray(st["w"], np.uint8).view(np.int8).astype(np.int64), W // B)
        else:
            w = unpack_int4(st["w"]).astype(np.int64)
        a = st["a"].astype(np.int64)
        lo, hi = st["sel"] << st["lvl"], (st["sel"] + 1) << st["lvl"]
        lanes = np.arange(len(w))
        take = (lanes < st["nl"]) & (lanes >= lo) & (lanes < hi)
        s = int(np.sum(w * a * take))
        r = st.get("row", 0)
        acc[r] = s if st["first"] else acc.get(r, 0) + s
        if st["last"]:
            out.append(acc[r])
    return out


def random_steps(cfg, rng, n, *, w_const=None, a_const=None):
    W = cfg.weights_per_beat
    lw = W.bit_length() - 1
    steps, pos, seg_len = [], 0, 1
    for _ in range(n):
        if pos == 0:
            seg_len = int(rng.integers(1, 5))
        q = rng.integers(-8, 8, W) if w_const is None else np.full(W, w_const)
        a = rng.integers(-127, 128, W) if a_const is None else np.full(W, a_const)
        lvl = lw if rng.random() < 0.7 else int(rng.integers(0, lw + 1))
        steps.append(dict(w=pack_int4(q), a=a, nl=int(rng.integers(0, W + 1)) if rng.random() < 0.3 else W,
                          lvl=lvl, sel=int(rng.integers(0, W >> lvl)), first=pos == 0, last=pos == seg_len - 1))
        pos = (pos + 1) % seg_len
    steps[-1]["last"] = True
    return steps


@pytest.mark.parametrize("cfg", [TINY, KV260], ids=["tiny", "kv260"])
def test_segment_mac_random(cfg):
    rng = np.random.default_rng(5)
    steps = random_steps(cfg, rng, 300)
    assert rtl_segment_mac(cfg, steps) == ref_segment_mac(cfg, steps)


def test_segment_mac_vectors():
    """V = 3 activation vectors against the same beats: each vector's segment sums are those of the reference
    run on that vector alone."""
    rng = np.random.default_rng(8)
    steps = random_steps(TINY, rng, 200)
    W, V = TINY.weights_per_beat, 3
    av = [rng.integers(-128, 128, W) for _ in steps for _ in range(V)]
    av[0][:] = -128                                 # one beat at the activations' extreme
    multi = [dict(st, a=np.stack(av[k * V:(k + 1) * V])) for k, st in enumerate(steps)]
    want = [ref_segment_mac(TINY, [dict(st, a=av[k * V + v]) for k, st in enumerate(steps)]) for v in range(V)]
    assert rtl_segment_mac(TINY, multi, vectors=V) == list(zip(*want))


def test_segment_mac_extremes():
    """All -8 weights against saturating activations: the largest magnitudes a segment can reach."""
    rng = np.random.default_rng(6)
    for a in (127, -127, -128):
        steps = random_steps(KV260, rng, 40, w_const=-8, a_const=a)
        got = rtl_segment_mac(KV260, steps)
        assert got == ref_segment_mac(KV260, steps)
    long = [dict(w=pack_int4(np.full(32, -8)), a=np.full(32, -128), nl=32, lvl=5, sel=0, first=k == 0,
                 last=k == 3) for k in range(4)]
    assert rtl_segment_mac(KV260, long) == [4 * 32 * 1024]   # 128 columns of (-8)(-128)


def int8_steps(cfg, rng, n):
    """Random beats of INT8 weights (B signed bytes) in segments of 1 to 4 beats, each beat one half of the
    activation word (``sel``'s high bit at ``lvl = log2 B``) or a narrower sub-sum of it, some rows ending inside
    it; every fourth segment INT4 (the mode changes between commands, the weight select per beat)."""
    W, B = cfg.weights_per_beat, cfg.bytes_per_beat
    lB = B.bit_length() - 1
    steps, pos, seg_len, mode = [], 0, 1, 1
    for k in range(n):
        if pos == 0:
            seg_len, mode = int(rng.integers(1, 5)), int(rng.random() >= 0.25)
        a = rng.integers(-128, 128, W)
        if mode:
            w = rng.integers(-128, 128, B).astype(np.int8).view(np.uint8)
            lvl = lB if rng.random() < 0.7 else int(rng.integers(0, lB + 1))
        else:
            w = pack_int4(rng.integers(-8, 8, W))
            lvl = int(rng.integers(0, lB + 2))
        steps.append(dict(w=w, a=a, nl=int(rng.integers(0, W + 1)) if rng.random() < 0.3 else W, lvl=lvl,
                          sel=int(rng.integers(0, W >> lvl)), first=pos == 0, last=pos == seg_len - 1, int8=mode))
        pos = (pos + 1) % seg_len
    steps[-1]["last"] = True
    return steps


@pytest.mark.parametrize("base", [TINY, KV260], ids=["tiny", "kv260"])
def test_segment_mac_int8(base):
    """Built with INT8 weights (``gemv_int8``, V rows): random INT8 beats (and INT4 ones between them) against
    the reference, and the extremes: all -128 weights times -128 and 127 activations over a kv260 segment
    (64 columns, 2**20), two vectors on the same beats."""
    cfg = base.replace(kv_v_layout="rows")
    rng = np.random.default_rng(21)
    steps = int8_steps(cfg, rng, 300)
    assert rtl_segment_mac(cfg, steps, int8=True) == ref_segment_mac(cfg, steps)
    W, B = cfg.weights_per_beat, cfg.bytes_per_beat
    lB = B.bit_length() - 1
    for a in (-128, 127):
        n = 2 * cfg.act_block // W                  # the segment's beats: each half of act_block / W words
        long = [dict(w=np.full(B, 0x80, np.uint8), a=np.full(W, a), nl=W, lvl=lB, sel=k & 1, first=k == 0,
                     last=k == n - 1, int8=1) for k in range(n)]
        assert rtl_segment_mac(cfg, long, int8=True) == [-128 * a * cfg.act_block]
    av = [rng.integers(-128, 128, W) for _ in steps for _ in range(2)]
    multi = [dict(st, a=np.stack(av[2 * k:2 * k + 2])) for k, st in enumerate(steps)]
    want = [ref_segment_mac(cfg, [dict(st, a=av[2 * k + v]) for k, st in enumerate(steps)]) for v in range(2)]
    assert rtl_segment_mac(cfg, multi, vectors=2, int8=True) == list(zip(*want))


@pytest.mark.parametrize("base, vectors", [(TINY, 2), (KV260, 4)], ids=["tiny-2", "kv260-4"])
def test_segment_mac_vector_pairs(base, vectors):
    """``pairs``: two vectors a DSP48E2 (their fields 19 bits apart in one product) and an adder tree a pair,
    lane pairs summed through the P cascade. Every vector's segment sums are the reference's for that vector
    alone: random INT4 and INT8 beats with random masks and activations over the quantiser's range [-127,
    127], then the extremes, where a beat's field reaches its largest magnitudes: INT8 -128 times -127 and
    127 on B lanes (B·128·127 either sign) in the two vectors of a pair, both ways round and alike; INT4 -8
    on every lane."""
    cfg = base.replace(kv_v_layout="rows")
    W, B = cfg.weights_per_beat, cfg.bytes_per_beat
    lB = B.bit_length() - 1
    rng = np.random.default_rng(31 + vectors)
    steps = int8_steps(cfg, rng, 240)
    extremes = []
    for lo_a, hi_a in ((-127, 127), (127, -127), (-127, -127), (127, 127)):
        for k in range(4):
            extremes.append(dict(w=np.full(B, 0x80, np.uint8), a=np.stack([np.full(W, lo_a), np.full(W, hi_a)]),
                                 nl=W, lvl=lB, sel=k & 1, first=k == 0, last=k == 3, int8=1))
        for k in range(2):
            extremes.append(dict(w=pack_int4(np.full(W, -8)), a=np.stack([np.full(W, lo_a), np.full(W, hi_a)]),
                                 nl=W, lvl=lB + 1, sel=0, first=k == 0, last=k == 1, int8=0))
    av = [rng.integers(-127, 128, W) for _ in steps for _ in range(vectors)]
    multi = [dict(st, a=np.stack(av[vectors * k:vectors * (k + 1)])) for k, st in enumerate(steps)]
    multi += [dict(st, a=np.concatenate([st["a"]] * (vectors // 2))) for st in extremes]
    want = [ref_segment_mac(cfg, [dict(st, a=st["a"][v]) for st in multi]) for v in range(vectors)]
    got = rtl_segment_mac(cfg, multi, vectors=vectors, int8=True, pairs=True)
    assert got == list(zip(*want))
    most = 4 * B * 128 * 127                        # four beats of B INT8 products at the extreme
    assert {most, -most} <= set(want[0]) & set(want[1])
    with pytest.raises(ValueError, match="SegmentMac pairs need an even number of vectors"):
        SegmentMac(cfg, vectors=3, pairs=True)


def interleave_rows(rng, streams):
    """The steps of every row's stream (each in its own order) merged in a random order, each tagged with its
    row: runs of one row (the same row in consecutive cycles) and changes of row every cycle."""
    left = [list(s) for s in streams]
    out = []
    while any(left):
        r = int(rng.choice([k for k, s in enumerate(left) if s]))
        for _ in range(int(rng.integers(1, 4)) if rng.random() < 0.3 else 1):
            if left[r]:
                out.append(dict(left[r].pop(0), row=r))
    return out


@pytest.mark.parametrize("base, vectors, pairs", [(TINY, 1, False), (TINY, 3, False), (KV260, 4, True)],
                         ids=["tiny", "tiny-3", "kv260-pairs"])
def test_segment_mac_rows(base, vectors, pairs):
    """``rows`` R = 8 (the interleaved dense datapath): the segments of eight rows' beats interleaved at random
    (INT4 and INT8 beats, sub-sums, masks), each row's sums its own; the sums leave in the order of the beats
    that end them, each the reference's for that row alone, bit for bit; and a segment of each row at the
    extremes (all -8 x -128, or -127 with pairs), interleaved row by row."""
    cfg = base.replace(kv_v_layout="rows")
    W, R = cfg.weights_per_beat, 8
    rng = np.random.default_rng(41 + vectors)
    steps = interleave_rows(rng, [int8_steps(cfg, rng, int(rng.integers(10, 40))) for _ in range(R)])
    amax = 127 if pairs else 128
    av = [rng.integers(-amax + (not pairs), amax, W) for _ in steps for _ in range(vectors)]
    multi = [dict(st, a=np.stack(av[vectors * k:vectors * (k + 1)]) if vectors > 1 else av[k])
             for k, st in enumerate(steps)]
    n = 4
    multi += [dict(w=pack_int4(np.full(W, -8)), a=np.full((vectors, W), -amax) if vectors > 1 else np.full(W, -amax),
                   nl=W, lvl=W.bit_length() - 1, sel=0, first=k == 0, last=k == n - 1, int8=0, row=r)
              for k in range(n) for r in range(R)]
    if vectors > 1:
        want = list(zip(*[ref_segment_mac(cfg, [dict(st, a=st["a"][v]) for st in multi]) for v in range(vectors)]))
    else:
        want = ref_segment_mac(cfg, multi)
    assert rtl_segment_mac(cfg, multi, vectors=vectors, int8=True, pairs=pairs, rows=R) == want
    assert (want[-1][0] if vectors > 1 else want[-1]) == n * W * 8 * amax
    with pytest.raises(ValueError, match="SegmentMac rows must be a positive integer, not 0"):
        SegmentMac(cfg, rows=0)


def test_unpack_order_is_low_nibble_first():
    """Lane 0 of a beat is the low nibble of byte 0: one non-zero weight per lane position."""
    W = TINY.weights_per_beat
    for lane in (0, 1, 2, W - 1):
        q = np.zeros(W, dtype=np.int8)
        q[lane] = -3
        a = np.arange(1, W + 1)
        st = dict(w=pack_int4(q), a=a, nl=W, lvl=4, sel=0, first=True, last=True)
        assert rtl_segment_mac(TINY, [st]) == [-3 * (lane + 1)]


def engine_params(cfg, **kw):
    eng = GemvEngine(cfg, **kw)
    eng._MustUse__silence = True          # only its parameters are used here
    return eng


def rtl_decode(cfg, cmd, max_cols, max_segments):
    dut = CommandDecoder(cfg, max_cols, max_segments)
    out = {}

    async def bench(ctx):
        ctx.set(dut.i_cmd, command_layout(cfg).const(cmd))
        ctx.set(dut.i_load, 1)
        await ctx.tick()
        ctx.set(dut.i_load, 0)
        out["good"] = ctx.get(dut.o_good)               # the second step's check, before its registers
        await ctx.tick()                                # the decoder's second step
        for name in ("lseg", "lvl", "subs", "lspb", "nseg", "groups", "gshift", "eshift", "rowbytes", "nwb", "prow",
                     "bad") + (("rstride",) if cfg.gemv_int8 else ()):
            out[name] = ctx.get(getattr(dut, f"o_{name}"))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return out


@pytest.mark.parametrize("cfg", [TINY, KV260], ids=["tiny", "kv260"])
@pytest.mark.parametrize("cols,group", [(2048, 128), (16384, 128), (64, 64), (8, 8), (37, 32), (1, 1), (100, 16),
                                        (2049, 128)])
def test_command_decode(cfg, cols, group):
    eng = engine_params(cfg)
    W, B = cfg.weights_per_beat, cfg.bytes_per_beat
    d = rtl_decode(cfg, dict(wbase=0, sbase=0, rows=5, cols=cols, log2_group=group.bit_length() - 1, accm=0,
                             sparse=0), eng.max_cols, eng.max_segments)
    seg = segment_size(group, cfg.act_block)
    nseg = -(-cols // seg)
    assert d["bad"] == int(cols > eng.max_cols or nseg > eng.max_segments)
    assert d["good"] == 1 - d["bad"]
    if d["bad"]:
        return
    assert d["lseg"] == seg.bit_length() - 1
    assert d["nseg"] == nseg or d["bad"]
    assert d["groups"] == -(-cols // group) or d["bad"]
    assert d["rowbytes"] == (cols + cols % 2) // 2          # firmware.pack: pcols / 2 bytes per row
    assert d["nwb"] == -(-d["rowbytes"] // B)
    assert 1 << d["lvl"] == min(seg, W) and d["subs"] == W // min(seg, W)
    assert 1 << d["lspb"] == max(1, seg // W)
    assert 1 << d["gshift"] == group // seg and 1 << d["eshift"] == cfg.act_block // seg


def test_command_decode_rejects():
    eng = engine_params(TINY)
    base = dict(wbase=0, sbase=0, rows=4, cols=64, log2_group=5, accm=0, sparse=0)
    assert rtl_decode(TINY, base, eng.max_cols, eng.max_segments)["bad"] == 0
    for change in (dict(rows=0), dict(cols=0), dict(cols=eng.max_cols + 2), dict(sparse=1, rows=5),
                   dict(sparse=1, rows=TINY.gemv_sparse_max_rows + 2)):
        assert rtl_decode(TINY, {**base, **change}, eng.max_cols, eng.max_segments)["bad"] == 1, change
    # Sparse commands with an even number of rows up to gemv_sparse_max_rows run.
    for rows in (2, 4, TINY.gemv_sparse_max_rows):
        assert rtl_decode(TINY, {**base, "sparse": 1, "rows": rows}, eng.max_cols, eng.max_segments)["bad"] == 0


@pytest.mark.parametrize("cfg", [TINY, KV260], ids=["tiny", "kv260"])
@pytest.mark.parametrize("rows", [2, 30, 32, 34, 64, 126, 128, 2048])
def test_command_decode_sparse_rows_per_port(cfg, rows):
    """The sparse mode's row split: each port takes whole beats of rows (W per beat), the ports as even as
    whole beats allow, and together exactly the rows."""
    eng = engine_params(cfg)
    W, N = cfg.weights_per_beat, cfg.axi_ports
    prow = rtl_decode(cfg, dict(wbase=0, sbase=0, rows=rows, cols=64, log2_group=5, accm=0, sparse=1),
                      eng.max_cols, eng.max_segments)["prow"]
    assert prow % W == 0 and prow * N >= rows and (prow - W) * N < rows
    shares = [max(0, min(prow, rows - p * prow)) for p in range(N)]
    assert sum(shares) == rows


def test_int8_commands_decode():
    """A V-rows config (``gemv_int8``) has the `int8` and `pitch` fields and 23-bit segment sums on kv260 (INT8 x
    INT8); its INT4 commands decode as on the config without them. An int8 command runs (alone or with several
    vectors): a row of `cols` bytes, beats of B weights (the sub-sums and beats per segment against B), rows
    `pitch` bytes apart; it is rejected with `sparse` or `mask`, or with rows or cols 0, or cols above
    `max_cols`."""
    import dataclasses

    from hdl.config import PRESETS

    planes = dataclasses.replace(KV260, kv_v_layout="planes")
    assert not planes.gemv_int8 and "int8" not in command_layout(planes).members
    assert KV260.kv_v_layout == "rows" and KV260.segment_sum_bits == 23 and planes.segment_sum_bits == 19
    for base in (PRESETS["tiny_v4"], TINY, planes):
        cfg = dataclasses.replace(base, kv_v_layout="rows")
        assert cfg.gemv_int8 and {"int8", "pitch"} <= set(command_layout(cfg).members)
        eng = engine_params(cfg)
        W, B = cfg.weights_per_beat, cfg.bytes_per_beat

        def dec(**kw):
            return rtl_decode(cfg, {**cmd, **kw}, eng.max_cols, eng.max_segments)

        cmd = dict(wbase=3, sbase=0, rows=5, cols=37, log2_group=16, accm=0, sparse=0, mask=0, int8=0, pitch=40)
        want = rtl_decode(dataclasses.replace(base, kv_v_layout="planes"), {k: v for k, v in cmd.items() if k not in ("int8", "pitch")}, eng.max_cols,
                          eng.max_segments)
        got = dec()
        assert {k: v for k, v in got.items() if k != "rstride"} == want and not want["bad"]
        assert got["rstride"] == got["rowbytes"] == 19                # INT4: the row's bytes
        for cols, lg, pitch in ((37, 16, 40), (1, 3, 1), (eng.max_cols, 7, (1 << 24) - 1), (3 * B + 1, 0, 5000),
                                (100, 2, 100)):
            d = dec(int8=1, cols=cols, log2_group=lg, pitch=pitch,
                    **({"vecs": cfg.gemv_vectors - 1} if cfg.gemv_vectors > 1 else {}))
            seg = segment_size(1 << lg, cfg.act_block)
            assert not d["bad"], (cols, lg)
            assert (d["rowbytes"], d["rstride"], d["nwb"]) == (cols, pitch, -(-cols // B))
            assert 1 << d["lvl"] == min(seg, B) and d["subs"] == B // min(seg, B)
            assert 1 << d["lspb"] == max(1, seg // B)
            assert d["nseg"] == -(-cols // seg) and d["groups"] == -(-cols // (1 << lg))
        for change in (dict(sparse=1, rows=4), dict(mask=1), dict(rows=0), dict(cols=0), dict(cols=eng.max_cols + 1)):
            assert dec(int8=1, **change)["bad"] == 1, change


def test_config_gemv_fields():
    assert (TINY.gemv_max_cols, TINY.gemv_sparse_max_rows) == (1024, 128)
    assert (KV260.gemv_max_cols, KV260.gemv_sparse_max_rows) == (16384, 2048)      # E4B FFN width, hidden size
    assert engine_params(TINY).max_cols == TINY.gemv_max_cols
    with pytest.raises(ValueError, match="gemv_max_cols must be a power of two"):
        TINY.replace(gemv_max_cols=1000)
    with pytest.raises(ValueError, match="gemv_sparse_max_rows must be a power of two of at least"):
        TINY.replace(gemv_sparse_max_rows=16)
    with pytest.raises(ValueError, match="axi_ports must be a power of two"):
        engine_params(TINY.replace(axi_ports=3))


def test_engine_parameter_errors():
    with pytest.raises(ValueError, match="max_cols must be a power of two"):
        engine_params(TINY, max_cols=1000)
    with pytest.raises(ValueError, match="tile_rows must be a power of two above the FpAdd latency"):
        engine_params(TINY, tile_rows=4)


def rtl_part_accumulator(cfg, isum, scale, exp, y, valid, isum_bits=None):
    """Feeds one part per cycle (`valid` gaps included) through PartAccumulator (``isum_bits`` wide, default
    its own), each addend `part_latency` cycles after its part; returns the sums as float32 and the cycles
    at which they left."""
    dut = PartAccumulator(cfg) if isum_bits is None else PartAccumulator(cfg, isum_bits)
    n = len(isum)
    got, when = [], []

    async def bench(ctx):
        for k in range(n + dut.latency + 2):
            if k < n:
                ctx.set(dut.i_valid, int(valid[k]))
                ctx.set(dut.i_isum, int(isum[k]))
                ctx.set(dut.i_scale, int(scale[k:k + 1].view(np.uint16)[0]))
                ctx.set(dut.i_exp, int(exp[k]))
            else:
                ctx.set(dut.i_valid, 0)
            j = k - dut.part_latency
            ctx.set(dut.i_y, int(y[j:j + 1].view(np.uint32)[0]) if 0 <= j < n else 0)
            await ctx.tick()
            if ctx.get(dut.o_valid):
                got.append(ctx.get(dut.o_sum))
                when.append(k + 1)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return np.array(got, dtype=np.uint32).view(np.float32), when


def test_part_accumulator_random():
    """y + ldexp(fp32(isum) * fp32(scale), e) in binary32, bit for bit: isums up to 2**24 - 1, any finite
    binary16 scale (subnormal, zero, negative), exponents down to subnormal and zero results, signed-zero
    addends; results `latency` cycles after their inputs."""
    cfg = KV260
    rng = np.random.default_rng(12)
    n = 400
    isum = rng.integers(-(1 << 24) + 1, 1 << 24, n) >> rng.integers(0, 24, n)
    isum[rng.random(n) < 0.05] = 0
    scale = (rng.standard_normal(n) * np.exp2(rng.integers(-24, 15, n))).astype(np.float16)
    scale[~np.isfinite(scale)] = 1.0
    scale[rng.random(n) < 0.05] = np.float16(-0.0)
    exp = rng.integers(-160, 60, n)
    exp[rng.random(n) < 0.05] = -(1 << (EXP_BITS - 1))
    y = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 60, n))).astype(np.float32)
    y[rng.random(n) < 0.1] = np.float32(-0.0)
    y[rng.random(n) < 0.1] = np.float32(0.0)
    valid = rng.random(n) < 0.8
    got, when = rtl_part_accumulator(cfg, isum, scale, exp, y, valid)
    with np.errstate(over="ignore"):
        want = y + np.ldexp(isum.astype(np.float32) * scale.astype(np.float32), exp.astype(np.int32))
    assert want.dtype == np.float32 and np.all(np.isfinite(want))
    np.testing.assert_array_equal(got.view(np.uint32), want[valid].view(np.uint32))
    assert when == [k + PartAccumulator.LATENCY for k in np.flatnonzero(valid)]


@pytest.mark.parametrize("layout, wmax, width", [("planes", 8, 19), ("rows", 128, 23)])
def test_part_accumulator_at_the_engine_width(layout, wmax, width):
    """The width the engine builds it with (`HardwareConfig.segment_sum_bits`: 19 on kv260 with V planes, 23 with
    V rows, whose INT8 weights reach −128) takes every segment sum the engine can make: the extremes
    ±act_block·wmax·128 (all −wmax weights times all ∓128 activations), one less, and random sums in range, bit
    for bit against NumPy binary32."""
    cfg = KV260.replace(kv_v_layout=layout)
    bits = cfg.segment_sum_bits
    worst = cfg.act_block * wmax * 2 ** (cfg.act_bits - 1)
    assert bits == worst.bit_length() + 1 == width
    rng = np.random.default_rng(13)
    edge = np.array([worst, -worst, worst - 1, -worst + 1, 0, 1, -1])
    isum = np.concatenate([edge, rng.integers(-worst, worst + 1, 200)])
    n = len(isum)
    scale = (rng.standard_normal(n) * np.exp2(rng.integers(-24, 15, n))).astype(np.float16)
    scale[~np.isfinite(scale)] = np.float16(65504.0)
    scale[:len(edge)] = np.float16(65504.0)             # the largest products
    exp = rng.integers(-160, 60, n)
    y = (rng.standard_normal(n) * np.exp2(rng.integers(-100, 40, n))).astype(np.float32)
    valid = rng.random(n) < 0.9
    got, _ = rtl_part_accumulator(cfg, isum, scale, exp, y, valid, isum_bits=bits)
    with np.errstate(over="ignore"):
        want = y + np.ldexp(isum.astype(np.float32) * scale.astype(np.float32), exp.astype(np.int32))
    np.testing.assert_array_equal(got.view(np.uint32), want[valid].view(np.uint32))
    with pytest.raises(ValueError, match="GEMV segment sums reach"):
        GemvEngine(cfg.replace(act_block=1024, weight_group=1024, act_bits=16, gemv_pairs=False))
