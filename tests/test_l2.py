"""L2 scratchpad and element movers (hdl.l2) in Amaranth pysim, against a NumPy word-array model.

The reference is the memory itself: a ``(words, 4)`` uint32 array updated by masked writes. A monitor samples
every L2 port at every clock edge: a read transferred in a cycle is answered from the array *before* that
cycle's write (the read-old-data rule), then the write is applied lane by lane under its mask; every response
must equal, bit for bit, the word the model held at the read's grant. On top of that:

- `ElemReader` output must equal the elements ``addr .. addr + n - 1`` of those words (and, when nothing
  writes concurrently, of the flat model), ``last`` on the n-th, word requests exactly
  ``addr // 4 .. (addr + n - 1) // 4``;
- `ElemWriter` must emit exactly the masked write sequence a pure-Python packer (`pack_reference`) derives
  from ``(addr, elements)``: one word per touched word, lanes outside ``[addr, addr + n)`` masked off; and
  pulse ``o_done`` once per command; in beat mode the same, whatever the beats' counts (1..4 each, the lanes
  past a beat's count random);
- after the traffic, every word of the exercised region is read back and compared with the array.

Commands are seeded random at every lane alignment with lengths 0, 1, 2, 3, 4, 5, ... (partial first and last
words), issued back to back or with gaps, with random valid stalls on every source and random ready on every
sink, several readers and writers contending on one L2. Full-rate checks count cycles in the simulation.
"""

import random
from collections import deque

import numpy as np
import pytest
from amaranth import Elaboratable, Fragment, Module, Value
from amaranth.lib import wiring
from amaranth.sim import Simulator

from hdl.config import HardwareConfig
from hdl.l2 import L2, LANES, ElemReader, ElemWriter, l2_geometry

TINY = HardwareConfig.preset("tiny")
KV260 = HardwareConfig.preset("kv260")
MASK32 = (1 << 32) - 1


# --- reference ------------------------------------------------------------------------------------------

def lanes(word: int) -> np.ndarray:
    return np.array([(word >> (32 * i)) & MASK32 for i in range(LANES)], dtype=np.uint32)


def word_int(lanes_: np.ndarray) -> int:
    return sum(int(v) << (32 * i) for i, v in enumerate(lanes_))


class WordModel:
    """The L2 contents: a (words, 4) uint32 array; masked writes update only their lanes."""

    def __init__(self, depth: int):
        self.mem = np.zeros((depth, LANES), dtype=np.uint32)

    def read(self, addr: int) -> int:
        return word_int(self.mem[addr])

    def write(self, addr: int, data: int, mask: int):
        sel = np.array([(mask >> i) & 1 for i in range(LANES)], dtype=bool)
        self.mem[addr, sel] = lanes(data)[sel]

    def elements(self, addr: int, n: int) -> np.ndarray:
        return self.mem.reshape(-1)[addr:addr + n].copy()


def pack_reference(addr: int, elems) -> list[tuple[int, list, int]]:
    """The masked word writes that store `elems` at element `addr`: (word, lanes (None = masked), mask)."""
    out = []
    n = len(elems)
    if n == 0:
        return out
    for w in range(addr // LANES, (addr + n - 1) // LANES + 1):
        vals, mask = [], 0
        for k in range(LANES):
            e = w * LANES + k
            if addr <= e < addr + n:
                vals.append(int(elems[e - addr]))
                mask |= 1 << k
            else:
                vals.append(None)
        out.append((w, vals, mask))
    return out


def words_touched(addr: int, n: int) -> list[int]:
    return list(range(addr // LANES, (addr + n - 1) // LANES + 1)) if n else []


# --- harness ----------------------------------------------------------------------------------------------

class Harness(Elaboratable):
    """`readers` ElemReaders on L2 read ports 0.., `writers` ElemWriters on write ports 0.., and `raw_rd` /
    `raw_wr` further ports driven directly by the testbench (preload, read-back, raw traffic). `beats`: the
    readers and writers are built with ``beats=True``."""

    def __init__(self, hw, readers=0, writers=0, raw_rd=1, raw_wr=1, beats=False, **l2_kw):
        self.hw = hw
        self.l2 = L2(hw, read_ports=readers + raw_rd, write_ports=writers + raw_wr, **l2_kw)
        self.readers = [ElemReader(hw, beats=beats) for _ in range(readers)]
        self.writers = [ElemWriter(hw, beats=beats) for _ in range(writers)]
        self.raw_rd = [(getattr(self.l2, f"rd{readers + i}_req"), getattr(self.l2, f"rd{readers + i}_resp"))
                       for i in range(raw_rd)]
        self.raw_wr = [getattr(self.l2, f"wr{writers + j}") for j in range(raw_wr)]

    def elaborate(self, platform):
        m = Module()
        m.submodules.l2 = self.l2
        for i, r in enumerate(self.readers):
            m.submodules[f"reader{i}"] = r
            wiring.connect(m, r.o_req, getattr(self.l2, f"rd{i}_req"))
            wiring.connect(m, getattr(self.l2, f"rd{i}_resp"), r.i_resp)
        for j, w in enumerate(self.writers):
            m.submodules[f"writer{j}"] = w
            wiring.connect(m, w.o_wr, getattr(self.l2, f"wr{j}"))
        return m


class Monitor:
    """Samples every L2 port at every clock edge and checks it against the `WordModel`.

    Records, per port, the read addresses, the response words and the write transfers, with their cycle.
    """

    def __init__(self, l2: L2, model: WordModel, done_signals=(), watch=None):
        self.l2, self.model = l2, model
        self.watch = dict(watch or {})                 # name -> stream: log (cycle, payload) of transfers
        self.watch_log = {k: [] for k in self.watch}
        R, W = l2.read_ports, l2.write_ports
        self.req = [getattr(l2, f"rd{i}_req") for i in range(R)]
        self.resp = [getattr(l2, f"rd{i}_resp") for i in range(R)]
        self.wr = [getattr(l2, f"wr{j}") for j in range(W)]
        self.done_signals = list(done_signals)
        self.expect = [deque() for _ in range(R)]
        self.req_log = [[] for _ in range(R)]          # (cycle, word address)
        self.resp_log = [[] for _ in range(R)]         # (cycle, word)
        self.wr_log = [[] for _ in range(W)]           # (cycle, addr, data, mask)
        self.done_log = [[] for _ in self.done_signals]
        self.cycle = 0
        self.collisions = 0                            # cycles with a read and a write of the same word
        self.errors = []

    def signals(self):
        sigs = []
        for q, p in zip(self.req, self.resp):
            sigs += [q.valid, q.ready, q.payload, p.valid, p.ready, p.payload]
        for w in self.wr:
            sigs += [w.valid, w.ready, w.payload.addr, w.payload.data, w.payload.mask]
        for st in self.watch.values():
            sigs += [st.valid, st.ready, Value.cast(st.payload)]
        return sigs + self.done_signals

    async def run(self, ctx):
        R, W = len(self.req), len(self.wr)
        async for _, _, *v in ctx.tick().sample(*self.signals()):
            reads = writes = 0
            read_addrs = set()
            for i in range(R):
                qv, qr, qa, pv, pr, pd = v[6 * i:6 * i + 6]
                if qv and qr:
                    reads += 1
                    self.expect[i].append(self.model.read(qa))      # before this cycle's write: OLD data
                    self.req_log[i].append((self.cycle, qa))
                    read_addrs.add(qa)
                if pv and pr:
                    if not self.expect[i]:
                        self.errors.append(f"cycle {self.cycle}: rd{i}_resp transfer without a request")
                    else:
                        want = self.expect[i].popleft()
                        if pd != want:
                            self.errors.append(f"cycle {self.cycle}: rd{i}_resp {pd:#x}, model {want:#x}")
                    self.resp_log[i].append((self.cycle, pd))
            base = 6 * R
            for j in range(W):
                wv, wr_, wa, wd, wm = v[base + 5 * j:base + 5 * j + 5]
                if wv and wr_:
                    writes += 1
                    self.collisions += wa in read_addrs
                    self.model.write(wa, wd, wm)
                    self.wr_log[j].append((self.cycle, wa, wd, wm))
            base += 5 * W
            for k, name in enumerate(self.watch):
                sv, sr, sp = v[base + 3 * k:base + 3 * k + 3]
                if sv and sr:
                    self.watch_log[name].append((self.cycle, sp))
            for k, d in enumerate(v[base + 3 * len(self.watch):]):
                if d:
                    self.done_log[k].append(self.cycle)
            if reads > 1 or writes > 1:          # at most one read and one write per bank and cycle
                rd_banks = [v[6 * i + 2] % self.l2.banks for i in range(R) if v[6 * i] and v[6 * i + 1]]
                wr_banks = [v[6 * R + 5 * j + 2] % self.l2.banks for j in range(W)
                            if v[6 * R + 5 * j] and v[6 * R + 5 * j + 1]]
                if len(set(rd_banks)) < len(rd_banks) or len(set(wr_banks)) < len(wr_banks):
                    self.errors.append(f"cycle {self.cycle}: {reads} reads and {writes} writes granted "
                                       f"(banks {rd_banks}, {wr_banks})")
            self.cycle += 1


async def send(ctx, s, items, rng=None, idle=0.0):
    """Drive `items` on stream `s`; before each, idle cycles with probability `idle` each."""
    for p in items:
        while rng is not None and rng.random() < idle:
            await ctx.tick()
        ctx.set(s.valid, 1)
        ctx.set(s.payload, p)
        await ctx.tick().until(s.ready)
        ctx.set(s.valid, 0)


async def recv(ctx, s, count, out, rng=None, p_ready=1.0, fields=None):
    """Take `count` transfers from stream `s` into `out`, ready with probability `p_ready` each cycle."""
    values = [getattr(s.payload, f) for f in fields] if fields else [s.payload]
    while len(out) < count:
        r = rng is None or rng.random() < p_ready
        ctx.set(s.ready, r)
        _, _, valid, *vals = await ctx.tick().sample(s.valid, *values)
        if valid and r:
            out.append(tuple(vals) if fields else vals[0])
    ctx.set(s.ready, 0)


def random_cmds(rng, base, span, count, max_n=23):
    """Commands inside elements [base, base + span): every alignment, lengths 0..max_n (0 to 5 often)."""
    cmds = []
    for _ in range(count):
        n = rng.choice([0, 1, 2, 3, 4, 5]) if rng.random() < 0.4 else rng.randint(0, max_n)
        addr = base + rng.randrange(span - n + 1)
        cmds.append((addr, n))
    return cmds


def simulate(dut, benches, monitor, *, max_cycles=20000):
    """Run `benches` (and the monitor) until they all return; fail if that takes more than `max_cycles`."""
    finished = []

    def tracked(b):
        async def bench(ctx):
            await b(ctx)
            finished.append(b)
        return bench

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(monitor.run, background=True)
    for b in benches:
        sim.add_testbench(tracked(b), background=True)

    async def watchdog(ctx):
        for _ in range(max_cycles):
            if len(finished) == len(benches):
                return
            await ctx.tick()
        raise AssertionError(f"testbenches did not finish in {max_cycles} cycles (a hang)")

    sim.add_testbench(watchdog)
    sim.run()
    assert not monitor.errors, monitor.errors[:5]
    return monitor.cycle


def check_reader(cmds, elems, mon_port_req, mon_port_resp, seed):
    """The reader's elements equal the words it was given, sliced by its commands; its word requests are
    exactly the touched words. Returns the expected elements (uint32)."""
    got_addrs = [a for _, a in mon_port_req]
    want_addrs = [w for a, n in cmds for w in words_touched(a, n)]
    assert got_addrs == want_addrs, f"seed {seed}: word requests differ"
    words = [w for _, w in mon_port_resp]
    expected, last = [], []
    k = 0
    for a, n in cmds:
        t = len(words_touched(a, n))
        flat = np.concatenate([lanes(w) for w in words[k:k + t]]) if t else np.zeros(0, np.uint32)
        k += t
        expected += list(flat[a % LANES:a % LANES + n])
        last += [0] * (n - 1) + [1] if n else []
    got = np.array([d for d, _ in elems], dtype=np.uint32)
    np.testing.assert_array_equal(got, np.array(expected, dtype=np.uint32), err_msg=f"seed {seed}")
    np.testing.assert_array_equal([lst for _, lst in elems], last, err_msg=f"seed {seed}: last flags")
    return np.array(expected, dtype=np.uint32)


def check_writer(cmds, data, wr_log, seed):
    """The writer's L2 writes are exactly `pack_reference` of each command, in order."""
    want, k = [], 0
    for a, n in cmds:
        want += pack_reference(a, data[k:k + n])
        k += n
    got = [(a, d, msk) for _, a, d, msk in wr_log]
    assert len(got) == len(want), f"seed {seed}: {len(got)} writes, expected {len(want)}"
    for i, ((ga, gd, gm), (wa, wv, wm)) in enumerate(zip(got, want)):
        assert (ga, gm) == (wa, wm), f"seed {seed}: write {i} at word {ga} mask {gm:#x}, expected {wa} {wm:#x}"
        gl = lanes(gd)
        for lane, v in enumerate(wv):
            if v is not None:
                assert gl[lane] == v, f"seed {seed}: write {i} lane {lane}: {gl[lane]:#x}, expected {v:#x}"


async def preload(ctx, port, model_words: np.ndarray, base_word: int):
    await send(ctx, port, [{"addr": base_word + i, "data": word_int(w), "mask": (1 << LANES) - 1}
                           for i, w in enumerate(model_words)])


async def readback(ctx, req, resp, first, count):
    """Read words first .. first + count - 1 (requests and responses interleaved in one coroutine)."""
    out = []
    ctx.set(resp.ready, 1)
    pending = deque(range(first, first + count))
    while len(out) < count:
        ctx.set(req.valid, bool(pending))
        if pending:
            ctx.set(req.payload, pending[0])
        _, _, qv, qr, pv, pd = await ctx.tick().sample(req.valid, req.ready, resp.valid, resp.payload)
        if qv and qr:
            pending.popleft()
        if pv:
            out.append(pd)
    ctx.set(req.valid, 0)
    ctx.set(resp.ready, 0)
    return out


# --- L2 alone ---------------------------------------------------------------------------------------------

def test_l2_ports_and_geometry():
    assert l2_geometry(TINY) == (14, 15, 12)
    assert l2_geometry(KV260) == (18, 19, 16)
    l2 = L2(TINY, read_ports=3, write_ports=2)
    members = dict(l2.signature.members.items())
    assert {"rd0_req", "rd2_resp", "wr1"} <= set(members) and "rd3_req" not in members and "wr2" not in members
    assert l2.depth == 4096 and l2.latency == 3 and l2.resp_depth == 4
    big = L2(KV260, read_ports=1, write_ports=1)
    assert big.depth == 65536
    for c in (l2, big):
        Fragment.get(c, None)            # elaborates


def test_l2_rejects_bad_arguments():
    with pytest.raises(ValueError, match="read_ports must be an integer of at least 1, not 0"):
        L2(TINY, read_ports=0, write_ports=1)
    with pytest.raises(ValueError, match="write_ports must be an integer of at least 1, not 1.5"):
        L2(TINY, read_ports=1, write_ports=1.5)
    with pytest.raises(ValueError, match="read_regs must be an integer of at least 0, not -1"):
        L2(TINY, read_ports=1, write_ports=1, read_regs=-1)
    with pytest.raises(TypeError, match="hw must be a HardwareConfig"):
        ElemReader("tiny")


def test_l2_read_returns_old_data_on_same_cycle_write():
    """A read and a write of one word in the same cycle: the read sees the old word; a read granted in the
    next cycle sees the new one. Masked writes keep the other lanes."""
    dut = L2(TINY, read_ports=1, write_ports=1)
    got = []

    async def bench(ctx):
        wr, req, resp = dut.wr0, dut.rd0_req, dut.rd0_resp
        ctx.set(resp.ready, 1)
        old, new = 0x0123_4567_89AB_CDEF_0011_2233_4455_6677, 0xFFEE_DDCC_BBAA_9988_7766_5544_3322_1100
        await send(ctx, wr, [{"addr": 5, "data": old, "mask": 0xF}])
        # same cycle: write `new` to lanes 1 and 3 of word 5, read word 5
        ctx.set(wr.valid, 1)
        ctx.set(wr.payload, {"addr": 5, "data": new, "mask": 0b1010})
        ctx.set(req.valid, 1)
        ctx.set(req.payload, 5)
        _, _, wready, rready = await ctx.tick().sample(wr.ready, req.ready)
        assert wready and rready
        ctx.set(wr.valid, 0)                      # next cycle: read it again
        await ctx.tick()
        ctx.set(req.valid, 0)
        for _ in range(8):
            _, _, v, d = await ctx.tick().sample(resp.valid, resp.payload)
            if v:
                got.append(d)
        merged = word_int(np.where([False, True, False, True], lanes(new), lanes(old)))
        assert got == [old, merged], [hex(g) for g in got]

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()


@pytest.mark.parametrize("read_ports,write_ports,read_regs,banks,seed", [
    (1, 1, 1, 1, 1), (3, 2, 1, 1, 2), (2, 3, 0, 1, 3), (2, 1, 2, 1, 4), (4, 4, 1, 1, 5),
    (3, 2, 1, 2, 6), (2, 3, 0, 2, 7), (4, 4, 1, 4, 8)])
def test_l2_random_contention(read_ports, write_ports, read_regs, banks, seed):
    """Several clients on one L2, random valid stalls and random ready, reads and writes of a small shared
    region (so that same-word collisions happen); every response against the model, then a read-back. With
    banks, several reads and writes are granted per cycle (one per bank)."""
    rng = random.Random(seed)
    dut = L2(TINY, read_ports=read_ports, write_ports=write_ports, read_regs=read_regs, banks=banks)
    model = WordModel(dut.depth)
    mon = Monitor(dut, model)
    region = 10                    # small: many same-word collisions
    n_ops = 300
    rd_addrs = [[rng.randrange(region) for _ in range(n_ops)] for _ in range(read_ports)]
    wr_items = [[{"addr": rng.randrange(region), "data": rng.getrandbits(128), "mask": rng.randrange(16)}
                 for _ in range(n_ops)] for _ in range(write_ports)]
    got = [[] for _ in range(read_ports)]
    final = []

    finished = [0]

    def reader(i):
        async def bench(ctx):
            await send(ctx, getattr(dut, f"rd{i}_req"), rd_addrs[i], random.Random(seed * 100 + i), idle=0.3)
        return bench

    def taker(i):
        async def bench(ctx):
            await recv(ctx, getattr(dut, f"rd{i}_resp"), n_ops, got[i], random.Random(seed * 200 + i),
                       p_ready=0.3 + 0.2 * i)
            finished[0] += 1
        return bench

    def writer(j):
        async def bench(ctx):
            await send(ctx, getattr(dut, f"wr{j}"), wr_items[j], random.Random(seed * 300 + j), idle=0.4)
            finished[0] += 1
        return bench

    benches = [reader(i) for i in range(read_ports)] + [taker(i) for i in range(read_ports)] + \
              [writer(j) for j in range(write_ports)]

    async def tail(ctx):           # after all traffic: read the whole region back through port 0
        while finished[0] < read_ports + write_ports:
            await ctx.tick()
        final.extend(await readback(ctx, dut.rd0_req, dut.rd0_resp, 0, region))

    simulate(dut, benches + [tail], mon)
    for i in range(read_ports):
        assert [a for _, a in mon.req_log[i]][:n_ops] == rd_addrs[i]
        assert got[i] == [w for _, w in mon.resp_log[i]][:n_ops]
    np.testing.assert_array_equal(np.array([lanes(w) for w in final]), model.mem[:region],
                                  err_msg=f"seed {seed}")
    assert sum(len(lg) for lg in mon.wr_log) == write_ports * n_ops
    assert mon.collisions > 0, "no same-cycle read and write of one word happened"


def cmd_drivers(units, cmds, seed, ready):
    """Testbenches sending ``cmds[r]`` (``(addr, n)`` pairs) to ``units[r].i_cmd`` once ``ready[0]`` (unit 0
    back to back, the others with random gaps)."""
    def driver(r):
        async def bench(ctx):
            while not ready[0]:
                await ctx.tick()
            await send(ctx, units[r].i_cmd, [{"addr": a, "n": n} for a, n in cmds[r]],
                       random.Random(seed * 10 + r), idle=0.3 if r else 0.0)
        return bench
    return [driver(r) for r in range(len(cmds))]


def writer_benches(dut, mon, cmds, items, port, seed, idle, ready, final, region_words):
    """Testbenches for the two writers of `dut`: their commands (once ``ready[0]``), their `items` on stream
    `port` (``i_elem`` or ``i_beat``; writer r idles with probability ``idle(r)``), and a tail that reads the
    region back into `final` when both have signalled every command's o_done."""
    def item_driver(r):
        async def bench(ctx):
            await send(ctx, getattr(dut.writers[r], port), items[r], random.Random(seed * 20 + r), idle=idle(r))
        return bench

    async def tail(ctx):
        while not ready[0]:
            await ctx.tick()
        while len(mon.done_log[0]) < len(cmds[0]) or len(mon.done_log[1]) < len(cmds[1]):
            await ctx.tick()
        final.extend(await readback(ctx, *dut.raw_rd[0], 0, region_words))

    return [*cmd_drivers(dut.writers, cmds, seed, ready), item_driver(0), item_driver(1), tail]


# --- L2 throughput and arbitration ---------------------------------------------------------------------------

def run_saturated(read_ports, n, take=None, read_regs=1, banks=1, starts=None):
    """Every read port requests every cycle (addresses starts[i] + 0..n-1); port i takes responses iff
    take[i]."""
    dut = L2(TINY, read_ports=read_ports, write_ports=1, read_regs=read_regs, banks=banks)
    starts = starts or [0] * read_ports
    model = WordModel(dut.depth)
    mon = Monitor(dut, model)
    take = take or [True] * read_ports

    def bench_for(i):
        async def bench(ctx):            # valid held for a fixed number of cycles (a blocked port never ends)
            req = getattr(dut, f"rd{i}_req")
            ctx.set(getattr(dut, f"rd{i}_resp").ready, take[i])
            sent = 0
            for _ in range(n * read_ports + 20):
                ctx.set(req.valid, sent < n)
                ctx.set(req.payload, starts[i] + sent % n)
                _, _, ok = await ctx.tick().sample(req.valid & req.ready)
                sent += ok
            ctx.set(req.valid, 0)
        return bench

    simulate(dut, [bench_for(i) for i in range(read_ports)], mon)
    return dut, mon


def test_l2_full_rate_single_reader_and_writer():
    """One client alone: a read granted every cycle, a response every cycle `latency` cycles later; a write
    accepted every cycle."""
    n = 64
    for read_regs in (0, 1, 2):
        dut, mon = run_saturated(1, n, read_regs=read_regs)
        req_cycles = [c for c, _ in mon.req_log[0]]
        resp_cycles = [c for c, _ in mon.resp_log[0]]
        assert req_cycles == list(range(req_cycles[0], req_cycles[0] + n))
        assert resp_cycles == [c + dut.latency for c in req_cycles]

    dut = L2(TINY, read_ports=1, write_ports=1)
    mon = Monitor(dut, WordModel(dut.depth))

    async def writes(ctx):
        await send(ctx, dut.wr0, [{"addr": i, "data": i * 0x1_0000_0001, "mask": 0xF} for i in range(n)])

    simulate(dut, [writes], mon)
    cycles = [c for c, *_ in mon.wr_log[0]]
    assert cycles == list(range(cycles[0], cycles[0] + n))


def test_l2_round_robin_and_blocked_client():
    """Two saturating readers alternate grant by grant (one word per cycle in total); a client that never
    takes its responses gets exactly `resp_depth` grants and then blocks only itself."""
    n = 40
    dut, mon = run_saturated(2, n)
    grants = sorted([(c, 0) for c, _ in mon.req_log[0]] + [(c, 1) for c, _ in mon.req_log[1]])
    assert [c for c, _ in grants] == list(range(grants[0][0], grants[0][0] + 2 * n))
    assert [p for _, p in grants] == [grants[0][1], 1 - grants[0][1]] * n

    dut, mon = run_saturated(2, n, take=[False, True])
    assert len(mon.req_log[0]) == dut.resp_depth and len(mon.resp_log[0]) == 0
    c1 = [c for c, _ in mon.req_log[1]]
    assert len(c1) == n
    tail = c1[dut.resp_depth:]            # once port 0 is out of credits, port 1 is granted every cycle
    assert tail == list(range(tail[0], tail[0] + len(tail)))
    assert [c for c, _ in mon.resp_log[1]] == [c + dut.latency for c in c1]


def test_l2_two_banks_serve_two_streams_per_cycle():
    """Two banks (even and odd words): two ports streaming consecutive words each get one word per cycle
    once they are out of phase (at most one cycle of collision at the start, whatever the start parities),
    and every response is the word asked for, in order, `latency` cycles after its grant."""
    n = 40
    for starts in ([0, 0], [0, 1], [5, 9], [6, 3]):
        dut, mon = run_saturated(2, n, banks=2, starts=starts)
        for i in range(2):
            cycles = [c for c, _ in mon.req_log[i]]
            assert [a for _, a in mon.req_log[i]] == [starts[i] + k for k in range(n)], starts
            assert cycles == list(range(cycles[0], cycles[0] + n)), (starts, i)
            assert [c for c, _ in mon.resp_log[i]] == [c + dut.latency for c in cycles]
        first = [mon.req_log[i][0][0] for i in range(2)]
        assert abs(first[0] - first[1]) <= 1, starts


def test_l2_rejects_bad_banks():
    for banks in (0, 3, 6, True, 1.0):
        with pytest.raises(ValueError, match="banks"):
            L2(TINY, read_ports=1, write_ports=1, banks=banks)


# --- element movers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [7, 8])
def test_elem_reader_random_commands(seed):
    """Two readers contending on one L2 (plus raw reads), random commands at every alignment and length
    incl. 0, back to back and with gaps, random stalls; against the flat model of preloaded words."""
    rng = random.Random(seed)
    hw = TINY
    dut = Harness(hw, readers=2, writers=0)
    model = WordModel(dut.l2.depth)
    region_words = 48
    init = np.array([[rng.getrandbits(32) for _ in range(LANES)] for _ in range(region_words)], np.uint32)
    base_word = dut.l2.depth - region_words          # the top of L2: the highest addresses
    mon = Monitor(dut.l2, model)
    cmds = [random_cmds(random.Random(seed + r), base_word * LANES, region_words * LANES, 200)
            for r in range(2)]
    cmds[0] = [(base_word * LANES + a, n) for a in range(LANES) for n in (0, 1, 2, 3, 4, 5, 8, 9)] + cmds[0]
    cmds[1][-3:] = [(dut.l2.depth * LANES - 1, 1), (dut.l2.depth * LANES - 7, 7), (base_word * LANES, 0)]
    elems = [[], []]
    ready = [False]

    async def load(ctx):
        await preload(ctx, dut.raw_wr[0], init, base_word)
        ready[0] = True

    def elem_taker(r):
        async def bench(ctx):
            total = sum(n for _, n in cmds[r])
            await recv(ctx, dut.readers[r].o_elem, total, elems[r], random.Random(seed * 20 + r),
                       p_ready=0.5 + 0.4 * r, fields=("data", "last"))
        return bench

    async def raw_reads(ctx):            # a third client with random traffic
        rr = random.Random(seed * 30)
        req, resp = dut.raw_rd[0]
        ctx.set(resp.ready, 1)
        await send(ctx, req, [base_word + rr.randrange(region_words) for _ in range(60)], rr, idle=0.5)

    simulate(dut, [load, *cmd_drivers(dut.readers, cmds, seed, ready), elem_taker(0), elem_taker(1), raw_reads],
             mon)
    flat = np.concatenate([init.reshape(-1)])
    for r in range(2):
        exp = check_reader(cmds[r], elems[r], mon.req_log[r], mon.resp_log[r], seed)
        want = np.concatenate([flat[a - base_word * LANES:a - base_word * LANES + n] for a, n in cmds[r]])
        np.testing.assert_array_equal(exp, want, err_msg=f"seed {seed}: reader {r} against the flat model")


def _beat_mode_run(seed, cmds, *, idle, p_ready, rng_seed):
    """One beats-capable reader on TINY's L2 over a preloaded random region, running `cmds` ((addr, n, beats)
    each: beats 1 = the elements leave on o_beat), with command gaps `idle` and consumer readiness
    `p_ready`. Returns (the region's elements, per command the elements received in order, per command the
    beats' (n, last) pairs, the monitor)."""
    hw = TINY
    dut = Harness(hw, readers=1, writers=0, beats=True)
    model = WordModel(dut.l2.depth)
    region_words = 40
    rng = random.Random(seed)
    init = np.array([[rng.getrandbits(32) for _ in range(LANES)] for _ in range(region_words)], np.uint32)
    base_word = dut.l2.depth - region_words
    mon = Monitor(dut.l2, model, watch={"beat": dut.readers[0].o_beat})
    rd = dut.readers[0]
    got = [[] for _ in cmds]
    shapes = [[] for _ in cmds]
    ready = [False]

    async def load(ctx):
        await preload(ctx, dut.raw_wr[0], init, base_word)
        ready[0] = True

    async def driver(ctx):
        r = random.Random(rng_seed)
        while not ready[0]:
            await ctx.tick()
        for a, n, b in cmds:
            while r.random() < idle:
                await ctx.tick()
            ctx.set(rd.i_cmd.valid, 1)
            ctx.set(rd.i_cmd.payload, {"addr": base_word * LANES + a, "n": n})
            ctx.set(rd.i_beats, b)
            await ctx.tick().until(rd.i_cmd.ready)
            ctx.set(rd.i_cmd.valid, 0)
            ctx.set(rd.i_beats, 0)

    async def taker(ctx):
        r = random.Random(rng_seed + 1)
        for k, (_, n, b) in enumerate(cmds):
            while len(got[k]) < n:
                on = r.random() < p_ready
                ctx.set(rd.o_beat.ready, on and b)
                ctx.set(rd.o_elem.ready, on and not b)
                _, _, bv, bd, bn, bl, ev, ed, el = await ctx.tick().sample(
                    rd.o_beat.valid, rd.o_beat.payload.data, rd.o_beat.payload.n, rd.o_beat.payload.last,
                    rd.o_elem.valid, rd.o_elem.payload.data, rd.o_elem.payload.last)
                assert not (bv and not b), f"seed {seed}: command {k} (elements) made a beat"
                assert not (ev and b), f"seed {seed}: command {k} (beats) made an element"
                if b and bv and on:
                    got[k] += [(bd >> (32 * i)) & MASK32 for i in range(bn)]
                    shapes[k].append((bn, bl))
                elif not b and ev and on:
                    got[k].append(ed)
        ctx.set(rd.o_beat.ready, 0)
        ctx.set(rd.o_elem.ready, 0)

    simulate(dut, [load, driver, taker], mon)
    return init.reshape(-1), got, shapes, mon


@pytest.mark.parametrize("seed", [21, 22])
def test_elem_reader_beats_random_commands(seed):
    """Beat mode (the quantiser's input): commands at every alignment and length (0..23, all four start lanes
    x lengths 1..9 first), mixed with element-mode commands on the same reader, command gaps and random
    consumer stalls: the beats carry exactly the elements addr .. addr+n-1 in order, four per beat (the last
    the rest, ``last`` on it); the element commands in between are unaffected."""
    rng = random.Random(seed)
    span = 40 * LANES
    cmds = [(a, n, 1) for a in range(LANES) for n in range(1, 10)]
    for a, n in random_cmds(rng, 0, span, 150):
        cmds.append((a, n, int(rng.random() < 0.7)))
    flat, got, shapes, _ = _beat_mode_run(seed, cmds, idle=0.3, p_ready=0.6, rng_seed=seed * 7)
    for k, (a, n, b) in enumerate(cmds):
        np.testing.assert_array_equal(np.array(got[k], np.uint32), flat[a:a + n],
                                      err_msg=f"seed {seed}: command {k} (addr {a}, n {n}, beats {b})")
        if b:
            want = [(min(LANES, n - i), int(i + LANES >= n)) for i in range(0, n, LANES)]
            assert shapes[k] == want, f"seed {seed}: command {k} (addr {a}, n {n}): beats {shapes[k]}"


def test_elem_reader_beats_full_rate():
    """Beat mode with an always-ready consumer: one beat (four elements) per cycle from every start lane,
    back to back (the unaligned beats take the next word's lanes straight from the L2 response)."""
    cmds = [(a, 37, 1) for a in range(LANES)]
    flat, got, _, mon = _beat_mode_run(5, cmds, idle=0.0, p_ready=1.0, rng_seed=5)
    for k, (a, n, _) in enumerate(cmds):
        np.testing.assert_array_equal(np.array(got[k], np.uint32), flat[a:a + n])
    cycles = [c for c, _ in mon.watch_log["beat"]]
    per = -(-37 // LANES)
    for k in range(len(cmds)):
        c = cycles[k * per:(k + 1) * per]
        assert c == list(range(c[0], c[0] + per)), f"start lane {k}: beats not one per cycle: {c}"


@pytest.mark.parametrize("seed", [11, 12])
def test_elem_writer_random_commands(seed):
    """Two writers on one L2, random commands at every alignment and length incl. 0 (disjoint halves of
    a preloaded region, so the final contents are defined), random stalls; exact write sequences, o_done
    per command, elements outside every command untouched."""
    rng = random.Random(seed)
    hw = TINY
    dut = Harness(hw, readers=0, writers=2)
    model = WordModel(dut.l2.depth)
    region_words = 32
    init = np.array([[rng.getrandbits(32) for _ in range(LANES)] for _ in range(region_words)], np.uint32)
    mon = Monitor(dut.l2, model, done_signals=[w.o_done for w in dut.writers])
    half = region_words * LANES // 2
    cmds = [random_cmds(random.Random(seed + r), r * half, half, 150) for r in range(2)]
    cmds[0] = [(a, n) for a in range(LANES) for n in (0, 1, 2, 3, 4, 5, 8)] + cmds[0]
    data = [[rng.getrandbits(32) for _ in range(sum(n for _, n in c))] for c in cmds]
    ref = init.reshape(-1).copy()
    for r in range(2):
        k = 0
        for a, n in cmds[r]:
            ref[a:a + n] = data[r][k:k + n]
            k += n
    ready = [False]
    final = []

    async def load(ctx):
        await preload(ctx, dut.raw_wr[0], init, 0)
        ready[0] = True

    simulate(dut, [load, *writer_benches(dut, mon, cmds, data, "i_elem", seed, lambda r: 0.2 + 0.4 * r, ready,
                                         final, region_words)], mon)
    for r in range(2):
        check_writer(cmds[r], data[r], mon.wr_log[r], seed)
        assert len(mon.done_log[r]) == len(cmds[r])
    np.testing.assert_array_equal(model.mem[:region_words].reshape(-1), ref, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.array([lanes(w) for w in final]).reshape(-1), ref, err_msg=f"seed {seed}")


@pytest.mark.parametrize("seed,banks", [(23, 1), (24, 1), (25, 2)])
def test_movers_read_and_write_same_region(seed, banks):
    """A writer and two readers over ONE small region at the same time, with a raw writer too: every
    response is the word at its grant (old data on a same-cycle write), readers slice those words exactly,
    the writer's sequence is exact, and the final region equals the model."""
    rng = random.Random(seed)
    dut = Harness(TINY, readers=2, writers=1, banks=banks)
    model = WordModel(dut.l2.depth)
    mon = Monitor(dut.l2, model, done_signals=[dut.writers[0].o_done])
    span = 12 * LANES
    rcmds = [random_cmds(random.Random(seed + r), 0, span, 150) for r in range(2)]
    wcmds = random_cmds(random.Random(seed + 5), 0, span, 150)
    wdata = [rng.getrandbits(32) for _ in range(sum(n for _, n in wcmds))]
    raw = [{"addr": rng.randrange(12), "data": rng.getrandbits(128), "mask": rng.randrange(16)} for _ in range(100)]
    elems = [[], []]
    final = []
    finished = [0]

    def rd_cmd(r):
        async def bench(ctx):
            await send(ctx, dut.readers[r].i_cmd, [{"addr": a, "n": n} for a, n in rcmds[r]],
                       random.Random(seed * 10 + r), idle=0.2)
        return bench

    def rd_take(r):
        async def bench(ctx):
            await recv(ctx, dut.readers[r].o_elem, sum(n for _, n in rcmds[r]), elems[r],
                       random.Random(seed * 20 + r), p_ready=0.6, fields=("data", "last"))
            finished[0] += 1
        return bench

    async def wr_cmd(ctx):
        await send(ctx, dut.writers[0].i_cmd, [{"addr": a, "n": n} for a, n in wcmds], rng, idle=0.1)

    async def wr_elem(ctx):
        await send(ctx, dut.writers[0].i_elem, wdata, random.Random(seed * 30), idle=0.3)

    async def raw_wr(ctx):
        await send(ctx, dut.raw_wr[0], raw, random.Random(seed * 40), idle=0.8)

    async def tail(ctx):
        while finished[0] < 2 or len(mon.done_log[0]) < len(wcmds) or len(mon.wr_log[1]) < len(raw):
            await ctx.tick()
        final.extend(await readback(ctx, *dut.raw_rd[0], 0, 12))

    simulate(dut, [rd_cmd(0), rd_cmd(1), rd_take(0), rd_take(1), wr_cmd, wr_elem, raw_wr, tail], mon)
    for r in range(2):
        check_reader(rcmds[r], elems[r], mon.req_log[r], mon.resp_log[r], seed)
    check_writer(wcmds, wdata, mon.wr_log[0], seed)
    # the traffic really overlapped: some reader grant fell between the writer's first and last write
    w_cycles = [c for c, *_ in mon.wr_log[0]]
    assert any(w_cycles[0] < c < w_cycles[-1] for c, _ in mon.req_log[0] + mon.req_log[1])
    assert mon.collisions > 0, "no same-cycle read and write of one word happened"
    np.testing.assert_array_equal(np.array([lanes(w) for w in final]), model.mem[:12], err_msg=f"seed {seed}")


def test_movers_full_rate():
    """ElemWriter: n elements accepted on n consecutive cycles (source always valid), o_done the cycle after
    the last word. ElemReader: n elements on n consecutive cycles (consumer always ready), unaligned start."""
    n = 203
    dut = Harness(TINY, readers=1, writers=1)
    model = WordModel(dut.l2.depth)
    w, r = dut.writers[0], dut.readers[0]
    mon = Monitor(dut.l2, model, done_signals=[w.o_done],
                  watch={"wcmd": w.i_cmd, "welem": w.i_elem, "rcmd": r.i_cmd, "relem": r.o_elem})
    data = [(0x3F80_0000 + i) & MASK32 for i in range(n)]
    addr_w, addr_r = 6, 5

    async def bench(ctx):
        await send(ctx, w.i_cmd, [{"addr": addr_w, "n": n}])
        await send(ctx, w.i_elem, data)
        while not mon.done_log[0]:
            await ctx.tick()
        await send(ctx, r.i_cmd, [{"addr": addr_r, "n": n}])
        ctx.set(r.o_elem.ready, 1)
        await ctx.tick().repeat(n + 10)

    simulate(dut, [bench], mon)
    log = mon.watch_log
    we = [c for c, _ in log["welem"]]
    assert we == list(range(we[0], we[0] + n)), "writer did not take one element per cycle"
    assert we[0] == log["wcmd"][0][0] + 1
    check_writer([(addr_w, n)], data, mon.wr_log[0], 0)
    assert mon.done_log[0] == [mon.wr_log[0][-1][0] + 1]          # o_done the cycle after the last word
    re = [c for c, _ in log["relem"]]
    assert re == list(range(re[0], re[0] + n)), "reader did not produce one element per cycle"
    elems = [(p & MASK32, p >> 32) for _, p in log["relem"]]
    np.testing.assert_array_equal([d for d, _ in elems], model.mem.reshape(-1)[addr_r:addr_r + n])
    np.testing.assert_array_equal(model.mem.reshape(-1)[addr_w:addr_w + n], data)
    assert [lst for _, lst in elems] == [0] * (n - 1) + [1]
    # start-up: command transfer -> word request (next cycle) -> L2 latency -> word register -> element
    assert re[0] - log["rcmd"][0][0] == 1 + dut.l2.latency + 1



# --- ElemWriter beat mode ----------------------------------------------------------------------------------

def split_beats(rng, elems, shape):
    """`elems` as ElemWriter beats ({data, n, last}): `shape` "ones" (n = 1 each), "full" (four each, the last
    the rest) or "mix" (random counts 1..4). Lanes past a beat's count hold random bits."""
    out, i = [], 0
    while i < len(elems):
        k = {"ones": 1, "full": LANES, "mix": rng.randint(1, LANES)}[shape]
        k = min(k, len(elems) - i)
        lanes_ = list(elems[i:i + k]) + [rng.getrandbits(32) for _ in range(LANES - k)]
        i += k
        out.append({"data": word_int(lanes_), "n": k, "last": int(i == len(elems))})
    return out


@pytest.mark.parametrize("seed", [31, 32])
def test_elem_writer_beats_random_commands(seed):
    """Two beat-mode writers on one L2 plus a raw writer's random traffic (random L2 ready for both),
    commands at every alignment and length 0..23 (all four start lanes x lengths 0..9 x beat shapes first)
    and some of 40..90, each sent as beats of one element, full beats with a short last, or a random mix,
    with random producer gaps: exact masked write sequences (`pack_reference`), o_done per command,
    everything outside the commands untouched."""
    rng = random.Random(seed)
    dut = Harness(TINY, writers=2, beats=True)
    model = WordModel(dut.l2.depth)
    region_words = 48
    init = np.array([[rng.getrandbits(32) for _ in range(LANES)] for _ in range(region_words)], np.uint32)
    mon = Monitor(dut.l2, model, done_signals=[w.o_done for w in dut.writers])
    half = region_words * LANES // 2
    shapes = ("ones", "full", "mix")
    cmds = [random_cmds(random.Random(seed + r), r * half, half, 150) for r in range(2)]
    for r in range(2):
        cmds[r] += [(r * half + rng.randrange(half - n + 1), n) for n in (rng.randint(40, 90) for _ in range(4))]
        rng.shuffle(cmds[r])
    cmds[0] = [(a, n) for a in range(LANES) for n in range(10) for _ in shapes] + cmds[0]
    cmd_shapes = [[shapes[i % 3] if r == 0 and i < LANES * 10 * 3 else rng.choice(shapes)
                   for i in range(len(cmds[r]))] for r in range(2)]
    data = [[rng.getrandbits(32) for _ in range(sum(n for _, n in c))] for c in cmds]
    beats = [[], []]
    ref = init.reshape(-1).copy()
    for r in range(2):
        k = 0
        for (a, n), shape in zip(cmds[r], cmd_shapes[r]):
            ref[a:a + n] = data[r][k:k + n]
            beats[r] += split_beats(rng, data[r][k:k + n], shape)
            k += n
    assert {b["n"] for b in beats[0] + beats[1]} == {1, 2, 3, 4}
    outside = [{"addr": region_words + rng.randrange(8), "data": rng.getrandbits(128), "mask": rng.randrange(16)}
               for _ in range(600)]
    ready = [False]
    final = []

    async def load(ctx):            # preload, then random traffic next to the region: random ready for both
        await preload(ctx, dut.raw_wr[0], init, 0)
        ready[0] = True
        await send(ctx, dut.raw_wr[0], outside, random.Random(seed * 40), idle=0.5)


    async def stalls(ctx):          # cycles a writer's word waits for L2, and a beat waits for the writer
        w0, w1 = dut.writers
        async for _, _, *v in ctx.tick().sample(w0.o_wr.valid & ~w0.o_wr.ready, w1.o_wr.valid & ~w1.o_wr.ready,
                                               w0.i_beat.valid & ~w0.i_beat.ready,
                                               w1.i_beat.valid & ~w1.i_beat.ready):
            stalled[:] = [a + b for a, b in zip(stalled, v)]
            if final:
                return

    stalled = [0, 0, 0, 0]
    simulate(dut, [load, *writer_benches(dut, mon, cmds, beats, "i_beat", seed, lambda r: 0.1 + 0.4 * r, ready,
                                         final, region_words), stalls], mon, max_cycles=30000)
    assert min(stalled) > 0, f"seed {seed}: no L2 stall or no beat backpressure: {stalled}"
    for r in range(2):
        check_writer(cmds[r], data[r], mon.wr_log[r], seed)
        assert len(mon.done_log[r]) == len(cmds[r])
    assert len(mon.wr_log[2]) == region_words + len(outside)
    np.testing.assert_array_equal(model.mem[:region_words].reshape(-1), ref, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.array([lanes(w) for w in final]).reshape(-1), ref, err_msg=f"seed {seed}")


def test_elem_writer_beats_full_rate():
    """Beat mode, the source always valid. Full beats (the last one short) from every start lane, L2 accepting
    every cycle: one beat per cycle, the first the cycle after the command; L2 takes the W touched words on W
    consecutive cycles from the cycle after the first beat, so o_done comes W + 1 cycles after the first beat
    (W = beats, or beats + 1 when the last beat spills into a final partial word). Beats of one element: one
    per cycle, o_done n + 1 cycles after the first; still one per cycle while two raw writers contend for L2
    every cycle, so that words wait: only a beat that completes a word waits for the previous word (so only
    the last beat may wait, when the final word holds that one element alone, as from start lane 3)."""
    n = 38                                          # 10 beats, 10 or 11 words depending on the start lane
    runs = [(a, "full", False) for a in range(LANES)] + [(a, "ones", c) for a in (0, 3) for c in (False, True)]
    dut = Harness(TINY, writers=1, raw_wr=2, beats=True)
    w = dut.writers[0]
    model = WordModel(dut.l2.depth)
    mon = Monitor(dut.l2, model, done_signals=[w.o_done], watch={"cmd": w.i_cmd, "beat": w.i_beat})
    rng = random.Random(3)
    data = [[rng.getrandbits(32) for _ in range(n)] for _ in runs]
    base = [16 * k * LANES + a for k, (a, _, _) in enumerate(runs)]
    contend = [False]
    waited = [0]                    # cycles a word of the writer waited for L2

    async def bench(ctx):
        for k, (_, shape, c) in enumerate(runs):
            contend[0] = c
            await send(ctx, w.i_cmd, [{"addr": base[k], "n": n}])
            await send(ctx, w.i_beat, split_beats(rng, data[k], shape))
            while len(mon.done_log[0]) <= k:
                await ctx.tick()
        contend[0] = None

    async def contender(ctx):       # raw writers valid every cycle of the contended runs, far from the data
        while contend[0] is not None:
            for raw in dut.raw_wr:
                ctx.set(raw.valid, contend[0])
                ctx.set(raw.payload, {"addr": 1000, "data": rng.getrandbits(128), "mask": 0xF})
            _, _, wait = await ctx.tick().sample(w.o_wr.valid & ~w.o_wr.ready)
            waited[0] += wait
        for raw in dut.raw_wr:
            ctx.set(raw.valid, 0)

    simulate(dut, [bench, contender], mon)
    beat_log, wr_log = mon.watch_log["beat"], mon.wr_log[0]
    words_in = [len(words_touched(b, n)) for b in base]
    assert sorted(set(words_in)) == [10, 11]        # both the exact and the spilling case are covered
    for k, (a, shape, c) in enumerate(runs):
        what = f"start lane {a}, {shape}{', contended' if c else ''}"
        n_beats = -(-n // LANES) if shape == "full" else n
        bc = [cy for cy, _ in beat_log[:n_beats]]
        beat_log = beat_log[n_beats:]
        words = words_in[k]
        wc = [cy for cy, *_ in wr_log[:words]]
        check_writer([(base[k], n)], data[k], wr_log[:words], k)
        wr_log = wr_log[words:]
        steady = bc[:-1] if c else bc
        assert steady == list(range(bc[0], bc[0] + len(steady))), f"{what}: beats not one per cycle"
        assert bc[0] == mon.watch_log["cmd"][k][0] + 1, what
        if shape == "full":
            assert wc == list(range(bc[0] + 1, bc[0] + 1 + words)), f"{what}: words not one per cycle"
            assert mon.done_log[0][k] - bc[0] == words + 1, f"{what}: {mon.done_log[0][k] - bc[0]}"
        elif not c:
            assert mon.done_log[0][k] - bc[0] == n + 1, what
        assert mon.done_log[0][k] == wc[-1] + 1, what
    assert not beat_log and not wr_log
    assert waited[0] > 4, waited                    # the contended runs really made words wait
    np.testing.assert_array_equal(np.concatenate([model.elements(b, n) for b in base]), np.concatenate(data))


class CopyHarness(Harness):
    """A beat-mode Harness with one reader and one writer, the reader's beats straight into the writer."""

    def __init__(self, hw, **kw):
        super().__init__(hw, readers=1, writers=1, beats=True, **kw)

    def elaborate(self, platform):
        m = super().elaborate(platform)
        wiring.connect(m, self.readers[0].o_beat, self.writers[0].i_beat)
        return m


@pytest.mark.parametrize("seed,banks", [(41, 1), (42, 2)])
def test_movers_beats_copy(seed, banks):
    """L2 -> L2 copies through a beat-mode ElemReader wired straight into a beat-mode ElemWriter, every
    src % 4 x dst % 4 combination at several lengths (0..23, and longer), with raw reads and writes beside
    them (random L2 readiness on both sides), command gaps: the region equals a NumPy copy applied in order,
    the writer's sequence is `pack_reference` of the copied elements."""
    rng = random.Random(seed)
    dut = CopyHarness(TINY, raw_rd=2, banks=banks)  # raw_rd[0] random reads, raw_rd[1] the final read-back
    rd, wr = dut.readers[0], dut.writers[0]
    model = WordModel(dut.l2.depth)
    mon = Monitor(dut.l2, model, done_signals=[wr.o_done])
    src_words, dst_words = 24, 24                   # source region [0, 24), destination [24, 48) (words)
    init = np.array([[rng.getrandbits(32) for _ in range(LANES)] for _ in range(src_words + dst_words)], np.uint32)
    src0, dst0 = 0, src_words * LANES
    span = src_words * LANES
    copies = []
    for a in range(LANES):
        for b in range(LANES):
            for n in (rng.randint(1, 12), rng.randint(13, 23), rng.randint(30, 60)):
                s, d = rng.randrange(0, span - n - LANES + 1, LANES), rng.randrange(0, span - n - LANES + 1, LANES)
                copies.append((src0 + s + a, dst0 + d + b, n))
    copies += [(src0 + 5, dst0 + 2, 0), (src0, dst0, span)]
    rng.shuffle(copies)
    ref = init.reshape(-1).copy()
    for s, d, n in copies:
        ref[d:d + n] = ref[s:s + n]
    region = src_words + dst_words
    raw_w = [{"addr": region + rng.randrange(8), "data": rng.getrandbits(128), "mask": rng.randrange(16)}
             for _ in range(300)]
    raw_r = [rng.randrange(region + 8) for _ in range(300)]
    ready = [False]
    final = []

    async def load(ctx):
        await preload(ctx, dut.raw_wr[0], init, 0)
        ready[0] = True
        await send(ctx, dut.raw_wr[0], raw_w, random.Random(seed * 40), idle=0.6)

    async def raw_reads(ctx):
        while not ready[0]:
            await ctx.tick()
        req, resp = dut.raw_rd[0]
        ctx.set(resp.ready, 1)
        await send(ctx, req, raw_r, random.Random(seed * 30), idle=0.6)

    async def rd_cmd(ctx):          # the reader runs ahead of the writer: its next copy's beats wait
        while not ready[0]:
            await ctx.tick()
        ctx.set(rd.i_beats, 1)
        await send(ctx, rd.i_cmd, [{"addr": s, "n": n} for s, _, n in copies], random.Random(seed * 10), idle=0.3)

    async def wr_cmd(ctx):
        while not ready[0]:
            await ctx.tick()
        await send(ctx, wr.i_cmd, [{"addr": d, "n": n} for _, d, n in copies], random.Random(seed * 20), idle=0.3)

    async def tail(ctx):
        while len(mon.done_log[0]) < len(copies) or len(mon.wr_log[1]) < region + len(raw_w):
            await ctx.tick()
        final.extend(await readback(ctx, *dut.raw_rd[1], 0, region))

    simulate(dut, [load, raw_reads, rd_cmd, wr_cmd, tail], mon, max_cycles=20000)
    moved = np.concatenate([init.reshape(-1)[s:s + n] for s, _, n in copies])   # the source is never written
    check_writer([(d, n) for _, d, n in copies], [int(v) for v in moved], mon.wr_log[0], seed)
    np.testing.assert_array_equal(model.mem[:region].reshape(-1), ref, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.array([lanes(w) for w in final]).reshape(-1), ref, err_msg=f"seed {seed}")


@pytest.mark.slow
def test_l2_kv260_maps_to_uram():
    """Yosys (synth_xilinx -family xcup -uram) puts the 1 MiB kv260 L2 in URAM288, not in LUTs or BRAM.

    Measured (3 read + 2 write ports): 29 URAM288 (Yosys packs the 8 Mibit into 72-bit-wide URAMs; Vivado's
    16 deep x 2 wide gives 32), 0 BRAM, 1,367 LUTs (the read-out multiplexer Yosys builds from LUTs where
    Vivado uses the URAM cascade, the port multiplexers, the LUTRAM response buffers) and 171 FFs (the output
    register goes into the URAMs); about 75 s. Checked with the controller's banks (`L2_BANKS`, two memories
    of half the depth each): 30 URAM288, 0 BRAM, 1,904 LUTs (two sets of port multiplexers), 310 FFs."""
    L2_BANKS = KV260.l2_banks
    from hdl.synth import format_table, synthesize
    util = synthesize(L2(KV260, read_ports=3, write_ports=2, banks=L2_BANKS), "l2_kv260")
    print(format_table(util))
    bits = KV260.l2_bytes * 8
    assert util.uram * 4096 * 72 >= bits, format_table(util)
    assert util.bram36 == 0 and util.lut < 4000, format_table(util)


@pytest.mark.parametrize("width", [1, 5, 8, 32])
def test_set_bits_and_below_set_against_integer_arithmetic(width):
    """`set_bits` (any bit set, two or more) and the GEMV scan's `_below_set` (``x & _below_set(x)`` is x
    without its lowest set bit, ``x & (x - 1)``; ``x & ~_below_set(x)`` its lowest set bit, ``x & -x``):
    every value up to 8 bits, 2,000 seeded ones and the corners at 32."""
    from amaranth import Signal
    from hdl.gemv import _below_set
    from hdl.l2 import set_bits
    x, any_, two, rest, low = Signal(width), Signal(), Signal(), Signal(width), Signal(width)
    m = Module()
    a, t = set_bits(x)
    below = _below_set(x)
    m.d.comb += [any_.eq(a), two.eq(t), rest.eq(x & below), low.eq(x & ~below)]
    rng = random.Random(width)
    values = range(1 << width) if width <= 8 else \
        [0, 1, (1 << width) - 1, 1 << (width - 1), 3 << (width - 2)] + [rng.getrandbits(width) for _ in range(2000)]
    sim = Simulator(m)

    async def bench(ctx):
        for v in values:
            ctx.set(x, v)
            got = (ctx.get(any_), ctx.get(two), ctx.get(rest), ctx.get(low))
            assert got == (int(v != 0), int(bin(v).count("1") >= 2), v & (v - 1) if v else 0, v & -v), (width, v)
    sim.add_testbench(bench)
    sim.run()
