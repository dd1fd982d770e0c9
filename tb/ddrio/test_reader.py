"""cocotb bench of `hdl.ddrio.DdrReader` against `LatencyAxiReadRam` (random latency, jitter, AR/R pauses) with
random valid/ready stalls on the command and element streams.

Commands are seeded random: every format, every byte alignment of data and scales, 4 KB crossings, n = 1,
odd INT4 counts, group sizes 1 .. 2**31, scales that are negative, zero, subnormal, infinite or mixed.
Outputs are compared bit for bit with NumPy (`tb.ddrio.common.reader_expected`: ``astype(np.float32)`` of
the binary16 data, ``unpack_int4 * scale`` in float32; NaNs as the canonical QNAN); `last` and `err` are
checked on every element. Wide binary32 commands (``wide``) leave as beats of `wide_lanes` elements on ``o_beat``,
each beat's count, ``last`` and ``err`` checked; ``wide`` on the other formats is ignored. Further tests: SLVERR beats flag exactly their elements and the sticky
``o_error``; the credit rule (with ``o_elem`` stalled for thousands of cycles the R channel is never held);
the sustained rate of each format.
"""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge
from cocotbext.axi import AxiReadBus

from hdl.config import HardwareConfig
from hdl.ddrio import DdrFormat, reader_buffer_beats, reader_cmd_layout, wide_lanes
from tb.axi.memory import LatencyAxiReadRam
from tb.axi.streams import StreamSink, StreamSource, pauses
from tb.ddrio.common import HoldMonitor, pack, reader_expected, reset
from tb.runner import bench_env

MEM = 1 << 16
FLOWS = [(0, 0, 0.0), (12, 8, 0.3), (30, 0, 0.1)]     # (latency, jitter, stall probability)


def setup(dut, seed, *, latency, jitter, p_stall):
    hw = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    rng = random.Random(seed)
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    ram = LatencyAxiReadRam(AxiReadBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, size=MEM,
                            latency=latency, jitter=jitter, max_outstanding=hw.axi_max_outstanding, rng=rng,
                            ar_pause=pauses(random.Random(seed + 1), p_stall) if p_stall else None,
                            r_pause=pauses(random.Random(seed + 2), p_stall) if p_stall else None)
    ram.write(0, bytes(rng.randrange(256) for _ in range(MEM)))
    src = StreamSource(dut, "i_cmd", dut.clk, rng=random.Random(seed + 3), p_idle=p_stall)
    sink = StreamSink(dut, "o_elem", dut.clk, rng=random.Random(seed + 4), p_stall=p_stall)
    sink.beats = StreamSink(dut, "o_beat", dut.clk, rng=random.Random(seed + 5), p_stall=p_stall)
    return hw, rng, ram, src, sink


def f16_scales(rng: random.Random, count: int) -> bytes:
    kind = rng.choice(["normal", "negative", "zero", "subnormal", "inf", "mixed"])
    np_rng = np.random.default_rng(rng.randrange(1 << 30))
    if kind == "normal":
        s = np_rng.uniform(0.001, 4, count)
    elif kind == "negative":
        s = -np_rng.uniform(0.001, 4, count)
    elif kind == "zero":
        s = np.where(np_rng.random(count) < 0.5, 0.0, -0.0)
    elif kind == "subnormal":
        s = np_rng.integers(1, 1024, count) * 2.0 ** -24 * np_rng.choice([-1, 1], count)
    elif kind == "inf":
        s = np_rng.choice([np.inf, -np.inf, 65504.0, -65504.0], count)
    else:
        s = np_rng.choice([0.0, -0.0, 2.0 ** -24, -3 * 2.0 ** -24, 1.0, -0.5, 7.0, np.inf, 1e-5], count)
    return np.asarray(s, np.float16).tobytes()


def random_commands(hw, rng, ram, count):
    """Random commands; writes each INT4 command's scales into `ram` (before the memory is snapshot)."""
    B = hw.bytes_per_beat
    cmds = []
    for _ in range(count):
        fmt = rng.choice([DdrFormat.F32, DdrFormat.F16, DdrFormat.INT4, DdrFormat.INT4])
        n = rng.choice([1, 2, 3, 5, rng.randrange(1, 40), rng.randrange(1, 400), rng.randrange(600, 2000)])
        size = {DdrFormat.F32: 4 * n, DdrFormat.F16: 2 * n, DdrFormat.INT4: (n + 1) // 2}[fmt]
        if rng.random() < 0.4:              # straddling a 4 KB boundary, any alignment
            addr = rng.randrange(1, MEM // 4096 - 1) * 4096 - rng.randrange(0, min(size, 3 * B * 16) + 1)
        else:
            addr = rng.randrange(MEM - size)
        addr = max(0, min(addr, MEM - size))
        saddr, lg = 0, 0
        if fmt == DdrFormat.INT4:
            lg = rng.choice([0, 1, 2, 3, 4, 5, 7, rng.randrange(24), 24, 31])
            groups = -(-n // (1 << lg))
            saddr = rng.randrange(MEM - 2 * groups)
            ram.write(saddr, f16_scales(rng, groups))
        cmds.append(dict(addr=addr, n=n, fmt=int(fmt), saddr=saddr, log2_group=lg, wide=int(rng.random() < 0.5)))
    return cmds


def is_wide(c) -> bool:
    return bool(c.get("wide")) and c["fmt"] == DdrFormat.F32


def beat_elements(hw, beats, cmds, what=""):
    """The elements of the wide commands `cmds` from their `o_beat` beats, as `o_elem` items (data, last, err):
    each command's beats carry `wide_lanes` elements but the last, which has the rest; ``last`` only on it."""
    E = wide_lanes(hw)
    items, k = [], 0
    for i, c in enumerate(cmds):
        count = -(-c["n"] // E)
        chunk = beats[k:k + count]
        k += count
        assert len(chunk) == count, f"{what}wide command {i} {c}: {len(chunk)} of {count} beats"
        for j, b in enumerate(chunk):
            n, last, err = (b >> 128) & 7, (b >> 131) & 1, (b >> 132) & 1
            want_n = E if j < count - 1 else c["n"] - E * (count - 1)
            assert n == want_n and last == (j == count - 1), \
                f"{what}wide command {i} {c}: beat {j} has n = {n}, last = {last}; want {want_n}, {int(j == count - 1)}"
            items += [(b >> 32 * lane) & 0xFFFFFFFF | (last and lane == n - 1) << 32 | err << 33 for lane in range(n)]
    assert k == len(beats), f"{what}{len(beats) - k} beats more than the wide commands asked for"
    return items


def check(hw, items, cmds, mem, *, errs=None, what=""):
    """Cut `items` into commands and compare with NumPy; `errs[i]` is the expected err flags of command i
    (default all 0)."""
    k = 0
    for i, c in enumerate(cmds):
        n = c["n"]
        chunk = items[k:k + n]
        k += n
        assert len(chunk) == n, f"{what}command {i} {c}: {len(chunk)} of {n} elements"
        got = np.array([w & 0xFFFFFFFF for w in chunk], np.uint32)
        last = [(w >> 32) & 1 for w in chunk]
        err = [(w >> 33) & 1 for w in chunk]
        assert last == [0] * (n - 1) + [1] * (n > 0), f"{what}command {i} {c}: last flags wrong"
        want_err = [0] * n if errs is None else errs[i]
        assert err == list(want_err), f"{what}command {i} {c}: err flags {err}, want {list(want_err)}"
        want = reader_expected(mem, **c)
        ok = ~np.array(want_err, bool)
        np.testing.assert_array_equal(got[ok], want[ok], err_msg=f"{what}command {i} {c}")
    assert k == len(items), f"{what}{len(items) - k} elements more than the commands asked for"


async def run_commands(dut, hw, src, sink, cmds, timeout=400_000):
    layout = reader_cmd_layout(hw)
    cocotb.start_soon(sink.run())
    cocotb.start_soon(sink.beats.run())
    await src.send([pack(layout, **c) for c in cmds])
    await sink.wait_for(sum(c["n"] for c in cmds if not is_wide(c)), timeout_cycles=timeout)
    await sink.beats.wait_for(sum(-(-c["n"] // wide_lanes(hw)) for c in cmds if is_wide(c)), timeout_cycles=timeout)
    for _ in range(40):                      # nothing more may arrive
        await FallingEdge(dut.clk)
    assert int(dut.o_busy.value) == 0


@cocotb.test(timeout_time=5, timeout_unit="ms")
async def random_commands_bitexact(dut):
    seed = int(bench_env("SEED", "1"))
    lat, jit, p = FLOWS[int(bench_env("FLOW", "1"))]
    hw, rng, ram, src, sink = setup(dut, seed, latency=lat, jitter=jit, p_stall=p)
    await reset(dut)
    cmds = random_commands(hw, rng, ram, int(bench_env("COMMANDS", "40")))
    cmds += [dict(addr=4096 - 1, n=1, fmt=2, saddr=8191, log2_group=0), dict(addr=8, n=0, fmt=0, saddr=0, log2_group=0),
             dict(addr=3 * 4096 - 3, n=7, fmt=2, saddr=4 * 4096 - 1, log2_group=1),
             dict(addr=4096 - 2, n=1, fmt=1, saddr=0, log2_group=0), dict(addr=0, n=1, fmt=0, saddr=0, log2_group=0)]
    E = wide_lanes(hw)
    cmds += [dict(addr=a, n=n, fmt=0, saddr=0, log2_group=0, wide=1)      # wide: every count about a beat's, any
             for a, n in ((0, 1), (4096 - 5, E), (16, E + 1), (8195, 2 * E - 1), (64, 4 * E), (7, 3))]   # alignment
    cmds += [dict(addr=100, n=0, fmt=0, saddr=0, log2_group=0, wide=1), dict(addr=4096 - 3, n=9, fmt=1, saddr=0,
                                                                            log2_group=0, wide=1)]
    rng.shuffle(cmds)
    mem = ram.read(0, MEM)
    await run_commands(dut, hw, src, sink, cmds)
    done = [c for c in cmds if c["n"]]
    check(hw, sink.items, [c for c in done if not is_wide(c)], mem, what=f"seed {seed}: ")
    wide = [c for c in done if is_wide(c)]
    check(hw, beat_elements(hw, sink.beats.items, wide, what=f"seed {seed}: "), wide, mem, what=f"seed {seed}, wide: ")
    assert int(dut.o_error.value) == 0


@cocotb.test(timeout_time=5, timeout_unit="ms")
async def error_response(dut):
    """Reads past the end of memory return SLVERR: exactly the elements built from those beats carry `err`
    (data or scale), the next command is clean, and ``o_error`` stays set."""
    hw, rng, ram, src, sink = setup(dut, 3, latency=5, jitter=3, p_stall=0.2)
    await reset(dut)
    B = hw.bytes_per_beat
    per = B // 4
    cmds = [dict(addr=MEM - 4 * B, n=8 * per, fmt=0, saddr=0, log2_group=0),          # beats 4..7 fail
            dict(addr=100, n=2 * B + 5, fmt=2, saddr=MEM - B, log2_group=2),             # scale beat 1 fails
            dict(addr=MEM - 32, n=16, fmt=2, saddr=200, log2_group=3),                   # data fine
            dict(addr=1000, n=5, fmt=1, saddr=0, log2_group=0)]
    wide = [dict(addr=MEM - 4 * B, n=8 * per, fmt=0, saddr=0, log2_group=0, wide=1),   # beats 4..7 fail
            dict(addr=MEM - 4 * (2 * per + 2), n=2 * per + 3, fmt=0, saddr=0, log2_group=0, wide=1)]   # the last one
    ram.write(200, np.array([1.5, -2.0], np.float16).tobytes())
    mem = ram.read(0, MEM) + bytes(4096)        # past the end: values are unchecked (err)
    await run_commands(dut, hw, src, sink, cmds[:2] + wide[:1] + cmds[2:] + wide[1:])
    errs = [[0] * 4 * per + [1] * 4 * per, [0] * 2 * B + [1] * 5, [0] * 16, [0] * 5]
    check(hw, sink.items, cmds, mem, errs=errs)
    check(hw, beat_elements(hw, sink.beats.items, wide), wide, mem,
          errs=[[0] * 4 * per + [1] * 4 * per, [0] * (2 * per + 2) + [1]], what="wide: ")
    assert int(dut.o_error.value) == 1


@cocotb.test(timeout_time=5, timeout_unit="ms")
async def credit_rule_and_rate(dut):
    """(1) With ``o_elem`` not ready for 3000 cycles during a long read, the R channel is never held (the
    reader requests only what its buffers take). (2) Sustained rate with no stalls at latency 30: each
    format delivers n elements in n + a few cycles once the first arrives; a wide command from an aligned address
    in n / `wide_lanes` + a few."""
    hw, rng, ram, src, sink = setup(dut, 5, latency=30, jitter=0, p_stall=0.0)
    hold = HoldMonitor(dut.clk, dut.axi__rvalid, dut.axi__rready)
    cocotb.start_soon(hold.run())
    await reset(dut)
    layout = reader_cmd_layout(hw)
    ram.write(8192, np.full(64, 0.25, np.float16).tobytes())
    cmds = [dict(addr=4096 + 3, n=1500, fmt=0, saddr=0, log2_group=0)]
    mem = ram.read(0, MEM)
    await src.send([pack(layout, **c) for c in cmds])
    for _ in range(3000):
        await FallingEdge(dut.clk)
    assert hold.longest <= 1, f"R channel held {hold.longest} cycles while o_elem stalled"
    beats_before = ram.beats
    depth = reader_buffer_beats(hw)
    # An unaligned command of one burst's bytes spans one more AXI beat than it delivers.
    assert beats_before <= depth // hw.axi_max_burst_beats * (hw.axi_max_burst_beats + 1), \
        f"{beats_before} beats read into a {depth}-beat buffer"
    cocotb.start_soon(sink.run())
    await sink.wait_for(1500)
    check(hw, sink.items, cmds, mem)
    rates = {}
    for c in [dict(addr=0, n=2000, fmt=0, saddr=0, log2_group=0), dict(addr=12345, n=2000, fmt=0, saddr=0, log2_group=0),
              dict(addr=2, n=2000, fmt=1, saddr=0, log2_group=0), dict(addr=7, n=2000, fmt=2, saddr=8192, log2_group=5)]:
        sink.items.clear()
        await src.send([pack(layout, **c)])
        await sink.wait_for(1)
        t0 = ram.cycle
        await sink.wait_for(c["n"])
        rates[(c["fmt"], c["addr"])] = ram.cycle - t0
        check(hw, sink.items, [c], mem)
    dut._log.info("DdrReader cycles from first to last of 2000 elements (fmt, addr): %s", rates)
    for key, cycles in rates.items():
        assert cycles <= 2000 + 4, f"{key}: {cycles} cycles for 2000 elements"
    # wide: wide_lanes elements a cycle from a beat-aligned address; from any other, each burst-sized command
    # is a burst and a one-beat burst, so the bursts in flight (axi_max_outstanding) bind: no slower than o_elem
    E = wide_lanes(hw)
    cocotb.start_soon(sink.beats.run())
    for addr in (0, 12345):
        c = dict(addr=addr, n=2000, fmt=0, saddr=0, log2_group=0, wide=1)
        sink.beats.items.clear()
        await src.send([pack(layout, **c)])
        await sink.beats.wait_for(1)
        t0 = ram.cycle
        await sink.beats.wait_for(-(-2000 // E))
        cycles = ram.cycle - t0
        check(hw, beat_elements(hw, sink.beats.items, [c]), [c], mem, what="wide: ")
        bound = 2000 // E + 4 if addr % hw.bytes_per_beat == 0 else 2000 + 4
        dut._log.info("wide, address %d: %d cycles for 2000 elements (bound %.0f)", addr, cycles, bound)
        assert cycles <= bound, f"wide at address {addr}: {cycles} cycles for 2000 elements, more than {bound:.0f}"
    assert hold.longest <= 1
