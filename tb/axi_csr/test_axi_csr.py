"""cocotb bench of `hdl.axi_csr.AxiToCsr` in front of `hdl.csr.CsrBlock` (`tb.axi_csr.CsrBridgeTop`).

cocotbext-axi's `AxiMaster` drives the AXI4 port with seeded random pauses on all five channels. A monitor
records every handshake on the port: the AW and AR addresses in the order the bridge took them (it serves
one burst at a time, so that is the order it performs them in), the W beats, and every B and R beat; it
also checks that B and R hold their payload while valid waits for ready. After every step the scoreboard
replays the recorded bursts through the transaction model (`sim.axi_csr`, on a `RegisterFile` of the same
map) and requires every B and R beat (ID, data on every lane, response, last) to equal the model's, the
``rw`` registers' outputs to equal the model's values and the ``cmd`` registers' one-cycle pulses to equal
the model's. On top of that, plain INCR transfers are checked at byte level against the map (what a CPU
sees), and every step has a timeout: the bridge must answer every burst.

Parameters (environment): SEED; ADDR_BITS, DATA_BITS, ID_BITS (the top's widths, default HPM0's).
"""

from __future__ import annotations

import logging
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import Event, ReadOnly, RisingEdge, with_timeout
from cocotbext.axi import AxiBus, AxiBurstType, AxiMaster, AxiResp
from cocotbext.axi.axi_master import AxiWriteRespCmd
from cocotbext.axi.constants import AxiProt

from hdl.csr_map import REGISTERS
from sim.axi_csr import Burst, RegisterFile, read_burst, write_burst
from tb.runner import bench_env

RO = [r for r in REGISTERS if r.access == "ro"]
RW = [r for r in REGISTERS if r.access == "rw"]
CMD = [r for r in REGISTERS if r.access == "cmd"]
STEP_TIMEOUT_US = 2000


def params():
    return (int(bench_env("SEED", "0")), int(bench_env("ADDR_BITS", "40")), int(bench_env("DATA_BITS", "128")),
            int(bench_env("ID_BITS", "16")))


def pauses(rng, p):
    while True:
        yield int(rng.random() < p)


class Monitor:
    """Every handshake on ``s_axi`` in order, the ``cmd`` pulses, and the hold rule on B and R."""

    def __init__(self, dut):
        self.dut = dut
        self.order = []              # ("w" | "r", Burst) in the order the bridge accepted them
        self.w, self.b, self.r = [], [], []
        self.pulses = []
        self.errors = []
        cocotb.start_soon(self._run())

    def _sig(self, name):
        return getattr(self.dut, "s_axi__" + name)

    async def _run(self):
        g = self._sig
        aw = [g(n) for n in ("awvalid", "awready", "awid", "awaddr", "awlen", "awsize", "awburst")]
        ar = [g(n) for n in ("arvalid", "arready", "arid", "araddr", "arlen", "arsize", "arburst")]
        w = [g(n) for n in ("wvalid", "wready", "wdata", "wstrb")]
        b = [g(n) for n in ("bvalid", "bready", "bid", "bresp")]
        r = [g(n) for n in ("rvalid", "rready", "rid", "rdata", "rresp", "rlast")]
        cmd = [(reg.name, getattr(self.dut, "o_" + reg.name.lower())) for reg in CMD]
        data_bytes = len(g("wdata")) // 8
        held = {"b": None, "r": None}
        while True:
            await RisingEdge(self.dut.clk)
            await ReadOnly()
            for kind, sigs in (("w", aw), ("r", ar)):
                if sigs[0].value and sigs[1].value:
                    self.order.append((kind, [int(s.value) for s in sigs[2:]], data_bytes))
            if w[0].value and w[1].value:
                self.w.append((int(w[2].value), int(w[3].value)))
            for name, sigs, out in (("b", b, self.b), ("r", r, self.r)):
                valid, ready = sigs[0].value, sigs[1].value
                payload = tuple(int(s.value) for s in sigs[2:]) if valid else None
                if held[name] is not None and payload != held[name]:
                    self.errors.append(f"{name.upper()} changed from {held[name]} to {payload} before ready")
                if valid and ready:
                    out.append(payload)
                held[name] = payload if valid and not ready else None
            for name, s in cmd:
                v = int(s.value)
                if v:
                    self.pulses.append((name, v))


class Scoreboard:
    """Replays the monitor's bursts through the model and compares every response beat."""

    def __init__(self, dut, monitor: Monitor, seed: int):
        self.dut, self.mon, self.seed = dut, monitor, seed
        self.regs = RegisterFile(REGISTERS)
        self.done = 0                # bursts replayed
        self.nw = self.nb = self.nr = 0
        self.npulse = 0

    def set_input(self, name, value):
        self.regs.set_input(name, value)
        getattr(self.dut, "i_" + name.lower()).value = value

    def check(self, what: str):
        mon = self.mon
        assert not mon.errors, f"seed {self.seed} {what}: {mon.errors[0]}"
        while self.done < len(mon.order):
            kind, (ax_id, addr, ax_len, size, burst_type), data_bytes = mon.order[self.done]
            b = Burst(addr, ax_len + 1, size, burst_type, ax_id, data_bytes)
            if kind == "w":
                beats = mon.w[self.nw:self.nw + b.beats]
                assert len(beats) == b.beats, f"seed {self.seed} {what}: {b} has {len(beats)} W beats"
                self.nw += b.beats
                want = write_burst(self.regs, b, beats)
                got = mon.b[self.nb] if self.nb < len(mon.b) else None
                self.nb += 1
                assert got == want, f"seed {self.seed} {what}: {b}: B (bid, bresp) = {got}, model {want}"
            else:
                for n, beat in enumerate(read_burst(self.regs, b)):
                    want = (beat.id, beat.data, beat.resp, int(beat.last))
                    got = mon.r[self.nr] if self.nr < len(mon.r) else None
                    self.nr += 1
                    assert got == want, (f"seed {self.seed} {what}: {b} beat {n}: R (rid, rdata, rresp, rlast) = "
                                         f"{_hex(got)}, model {_hex(want)}")
            self.done += 1
        assert (self.nw, self.nb, self.nr) == (len(mon.w), len(mon.b), len(mon.r)), \
            f"seed {self.seed} {what}: stray beats (W/B/R {len(mon.w)}/{len(mon.b)}/{len(mon.r)}, " \
            f"bursts account for {self.nw}/{self.nb}/{self.nr})"
        for r in RW:
            got = int(getattr(self.dut, "o_" + r.name.lower()).value)
            assert got == self.regs.values[r.name], \
                f"seed {self.seed} {what}: {r.name} = {got:#x}, model {self.regs.values[r.name]:#x}"
        assert mon.pulses == self.regs.pulses, \
            f"seed {self.seed} {what}: cmd pulses {mon.pulses[self.npulse:]}, model {self.regs.pulses[self.npulse:]}"
        self.npulse = len(mon.pulses)

    def peek_byte(self, address: int) -> int:
        """The byte a read at `address` returns now (0 for unmapped and command words)."""
        r = self.regs.register_at(address & 0xFFC)
        value = 0 if r is None or r.access == "cmd" else self.regs.values[r.name]
        return value >> 8 * (address & 3) & 0xFF


def _hex(t):
    return None if t is None else tuple(hex(x) for x in t)


class Bench:
    def __init__(self, dut, rng: random.Random, pause: float):
        self.seed, self.addr_bits, self.data_bits, self.id_bits = params()
        self.dut, self.rng = dut, rng
        self.data_bytes = self.data_bits // 8
        self.max_size = (self.data_bytes - 1).bit_length()
        self.master = AxiMaster(AxiBus.from_prefix(dut, "s_axi", bus_separator="__"), dut.clk, dut.rst)
        self.master.write_if.log.setLevel(logging.WARNING)
        self.master.read_if.log.setLevel(logging.WARNING)
        self.set_pause(pause)
        self.mon = Monitor(dut)
        self.sb = Scoreboard(dut, self.mon, self.seed)

    def set_pause(self, p):
        m = self.master
        for ch in (m.write_if.aw_channel, m.write_if.w_channel, m.write_if.b_channel, m.read_if.ar_channel,
                   m.read_if.r_channel):
            ch.set_pause_generator(pauses(random.Random(self.rng.randrange(1 << 32)), p) if p else None)

    async def start(self):
        cocotb.start_soon(Clock(self.dut.clk, 10, unit="ns").start())
        for r in RO:
            self.sb.set_input(r.name, self.rng.randrange(1 << 32))
        self.dut.rst.value = 1
        for _ in range(3):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)

    def high(self) -> int:
        """Random address bits above the 4 KiB window (the PS decodes them; the bridge ignores them)."""
        return self.rng.randrange(1 << (self.addr_bits - 12)) << 12

    def any_id(self) -> int:
        return self.rng.randrange(1 << self.id_bits)

    async def step(self, what: str, coro):
        """Run one step to completion (or fail on timeout), let the last pulses show, then check."""
        result = await with_timeout(coro, STEP_TIMEOUT_US, "us")
        for _ in range(4):
            await RisingEdge(self.dut.clk)
        self.sb.check(what)
        return result

    # --- transfers ---------------------------------------------------------------------------------------

    async def write_incr(self, addr, data, size=None, awid=None):
        """An INCR write (cocotbext-axi splits it into bursts); byte-level check of the rw registers it hit."""
        resp = await self.step(f"write {len(data)} B at {addr:#x} size {size}",
                               self.master.write(addr, data, awid=awid, size=size))
        for i, byte in enumerate(data):
            r = self.sb.regs.register_at((addr + i) & 0xFFC)
            if r is not None and r.access == "rw":
                assert self.sb.peek_byte(addr + i) == byte, f"seed {self.seed}: byte {addr + i:#x} not written"
        bad = any((r := self.sb.regs.register_at((addr + i) & 0xFFC)) is None or r.access == "ro"
                  for i in range(len(data)))
        assert resp.resp == (AxiResp.SLVERR if bad else AxiResp.OKAY), \
            f"seed {self.seed}: write {len(data)} B at {addr:#x} answered {resp.resp}"
        return resp

    async def read_incr(self, addr, length, size=None, arid=None):
        """An INCR read; the bytes must be the map's (read before the transfer: nothing else runs)."""
        want = bytes(self.sb.peek_byte(addr + i) for i in range(length))
        resp = await self.step(f"read {length} B at {addr:#x} size {size}",
                               self.master.read(addr, length, arid=arid, size=size))
        assert resp.data == want, f"seed {self.seed}: read {length} B at {addr:#x} size {size}: " \
                                  f"{resp.data.hex()}, map {want.hex()}"
        # the beats cover the bytes asked for and the rest of the last beat's 2**size container
        nb = 1 << (self.max_size if size is None else size)
        end = -(-(addr + length) // nb) * nb
        bad = any(self.sb.regs.register_at(a & 0xFFC) is None for a in range(addr, end))
        assert resp.resp == (AxiResp.SLVERR if bad else AxiResp.OKAY), \
            f"seed {self.seed}: read {length} B at {addr:#x} answered {resp.resp}"
        return resp

    async def raw_write(self, awid, addr, size, burst, beats):
        """A write burst with W beats of our choosing (any strobes, none at all too), sent on the master's own
        AW/W channels; its B is collected by the master's response path. Only while no other write runs."""
        wi = self.master.write_if
        await wi.wait()
        event = _Response()
        wi.in_flight_operations += 1
        wi._idle.clear()
        wi.active_id[awid] += 1
        wi.tag_context_manager.start_cmd(awid, AxiWriteRespCmd(addr, 0, size, len(beats), AxiProt.NONSECURE,
                                                               [len(beats)], event))
        aw = wi.aw_channel._transaction_obj()
        aw.awid, aw.awaddr, aw.awlen, aw.awsize, aw.awburst = awid, addr, len(beats) - 1, size, burst
        aw.awlock, aw.awcache, aw.awprot, aw.awqos, aw.awregion, aw.awuser = 0, 0b0011, 0, 0, 0, 0
        await wi.aw_channel.send(aw)
        for k, (data, strb) in enumerate(beats):
            w = wi.w_channel._transaction_obj()
            w.wdata, w.wstrb, w.wlast, w.wuser = data, strb, k == len(beats) - 1, 0
            await wi.w_channel.send(w)
        return await event.wait()

    def random_beats(self, n, p_zero=0.2):
        lanes = self.data_bytes
        return [(self.rng.getrandbits(8 * lanes),
                 0 if self.rng.random() < p_zero else self.rng.getrandbits(lanes)) for _ in range(n)]


class _Response:
    """What cocotbext-axi's response path sets when a write completes (its `AxiWriteResp`)."""

    def __init__(self):
        self._event, self._value = Event(), None

    def set(self, value):
        self._value = value
        self._event.set()

    async def wait(self):
        await self._event.wait()
        return self._value


def _legal_window(rng, nbytes):
    """A 4 KiB-window offset from which `nbytes` bytes do not cross the window's end."""
    return rng.randrange(0, 4096 - nbytes + 1)


# --- tests -----------------------------------------------------------------------------------------------

@cocotb.test()
async def narrow_and_unaligned(dut):
    """Every size at every byte offset of a beat: a write then a read back, over the rw registers."""
    seed = params()[0]
    rng = random.Random(seed)
    t = Bench(dut, rng, 0.3)
    await t.start()
    base = 0x040                                     # the region bases: a run of rw words
    for size in range(t.max_size + 1):
        for off in range(t.data_bytes):
            n = rng.randrange(1, 3 * t.data_bytes)
            data = bytes(rng.randrange(256) for _ in range(n))
            await t.write_incr(t.high() | base + off, data, size=size)
            await t.read_incr(t.high() | base + off, n, size=size)


@cocotb.test()
async def strobes(dut):
    """Raw W beats: random strobe patterns, beats without strobes (no write: OKAY even on read-only words),
    bursts with only empty beats."""
    seed = params()[0]
    rng = random.Random(seed + 1)
    t = Bench(dut, rng, 0.3)
    await t.start()
    for k in range(40):
        beats = t.random_beats(rng.randrange(1, 9), p_zero=0.3 if k % 4 else 1.0)
        size, burst = t.max_size, rng.choice([AxiBurstType.INCR, AxiBurstType.FIXED])
        addr = t.high() | rng.randrange(0, 0x180 // t.data_bytes) * t.data_bytes
        resp = await t.step(f"raw write {len(beats)} beats at {addr:#x}",
                            t.raw_write(t.any_id(), addr, size, burst, beats))
        if all(strb == 0 for _, strb in beats):
            assert resp.resp == AxiResp.OKAY, f"seed {seed}: a burst without strobes answered {resp.resp}"


@cocotb.test()
async def bursts(dut):
    """FIXED and WRAP bursts of every legal length and size; INCR bursts up to 256 beats; whole-window bursts
    (every word SLVERR in the unmapped half)."""
    seed = params()[0]
    rng = random.Random(seed + 2)
    t = Bench(dut, rng, 0.25)
    await t.start()
    for burst in (AxiBurstType.WRAP, AxiBurstType.FIXED):
        for beats in ((2, 4, 8, 16) if burst == AxiBurstType.WRAP else (1, 2, 5, 16)):
            for size in range(t.max_size + 1):
                nb = 1 << size
                addr = _legal_window(rng, beats * nb) // nb * nb
                data = bytes(rng.randrange(256) for _ in range(beats * nb))
                await t.step(f"{burst.name} write {beats} x {nb}",
                             t.master.write(t.high() | addr, data, awid=t.any_id(), burst=burst, size=size))
                await t.step(f"{burst.name} read {beats} x {nb}",
                             t.master.read(t.high() | addr, beats * nb, arid=t.any_id(), burst=burst, size=size))
    # INCR: the longest bursts, full width and narrow, over the whole window and the unmapped top half
    for size, nbytes, at in ((t.max_size, 4096, 0), (2, 1024, 0x400), (0, 256, 0x100), (t.max_size, 2048, 0x800)):
        data = bytes(rng.randrange(256) for _ in range(nbytes))
        await t.write_incr(t.high() | at, data, size=size)
        await t.read_incr(t.high() | at, nbytes, size=size)


@cocotb.test()
async def concurrent(dut):
    """Several writes and reads in flight at once with different (and equal) IDs, reads and writes
    interleaved; the bridge serialises them, every response has its ID and the model replays them in the
    order the bridge took them."""
    seed = params()[0]
    rng = random.Random(seed + 3)
    t = Bench(dut, rng, 0.3)
    await t.start()
    for round_ in range(12):
        ops = []
        ids = [t.any_id() for _ in range(3)]
        for _ in range(rng.randrange(2, 9)):
            size = rng.randrange(t.max_size + 1)
            n = rng.randrange(1, 200)
            addr = t.high() | _legal_window(rng, n)
            if rng.random() < 0.5:
                data = bytes(rng.randrange(256) for _ in range(n))
                ops.append(cocotb.start_soon(t.master.write(addr, data, awid=rng.choice(ids), size=size)))
            else:
                ops.append(cocotb.start_soon(t.master.read(addr, n, arid=rng.choice(ids), size=size)))

        async def all_done():
            for op in ops:
                await op
        await t.step(f"round {round_}", all_done())


@cocotb.test()
async def random_traffic(dut):
    """A seeded mix of everything, under three pause rates, with the read-only inputs changing between steps."""
    seed = params()[0]
    rng = random.Random(seed + 4)
    t = Bench(dut, rng, 0.0)
    await t.start()
    for pause in (0.0, 0.3, 0.7):
        t.set_pause(pause)
        for k in range(60):
            x = rng.random()
            addr = t.high() | _legal_window(rng, 64)
            if x < 0.1:
                r = rng.choice(RO)
                t.sb.set_input(r.name, rng.randrange(1 << 32))
            elif x < 0.4:
                n = rng.randrange(1, 64)
                await t.write_incr(addr, bytes(rng.randrange(256) for _ in range(n)),
                                   size=rng.randrange(t.max_size + 1), awid=t.any_id())
            elif x < 0.7:
                await t.read_incr(addr, rng.randrange(1, 64), size=rng.randrange(t.max_size + 1), arid=t.any_id())
            elif x < 0.8:
                beats = t.random_beats(rng.randrange(1, 5))
                await t.step("raw write", t.raw_write(t.any_id(), addr & ~(t.data_bytes - 1), t.max_size,
                                                      AxiBurstType.INCR, beats))
            else:
                cmd = CMD[0]
                await t.write_incr(t.high() | cmd.offset, rng.randrange(1, 256).to_bytes(4, "little"), size=2)
