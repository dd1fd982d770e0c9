"""cocotb bench of `hdl.axi.AxiReadDma` against `LatencyAxiReadRam` (random latency and AR/R stalls).

Every command reads random bytes; the bench checks the output bytes against memory, the beat count and
`last` flags, that only the beat-aligned range of each command was requested (no guard byte outside it is
fetched), the AXI rules (in the memory model), and that errors from reads past the memory's end are
flagged on exactly the affected beats and in the sticky ``o_error``.
"""

from __future__ import annotations

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge
from cocotbext.axi import AxiReadBus

from hdl.config import HardwareConfig
from tb.axi.memory import LatencyAxiReadRam
from tb.axi.streams import StreamSink, StreamSource, pauses
from tb.runner import bench_env

MEM = 1 << 16


def setup(dut, seed, *, latency, jitter, p_stall):
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    rng = random.Random(seed)
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    ram = LatencyAxiReadRam(AxiReadBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, size=MEM,
                            latency=latency, jitter=jitter, max_outstanding=cfg.axi_max_outstanding, rng=rng,
                            ar_pause=pauses(random.Random(seed + 1), p_stall) if p_stall else None,
                            r_pause=pauses(random.Random(seed + 2), p_stall) if p_stall else None)
    ram.write(0, bytes(rng.randrange(256) for _ in range(MEM)))
    src = StreamSource(dut, "i_cmd", dut.clk, rng=random.Random(seed + 3), p_idle=p_stall)
    sink = StreamSink(dut, "o_data", dut.clk, rng=random.Random(seed + 4), p_stall=p_stall)
    return cfg, rng, ram, src, sink


async def reset(dut):
    dut.rst.value = 1
    for _ in range(3):
        await FallingEdge(dut.clk)
    dut.rst.value = 0


def cmd_word(cfg, addr, nbytes):
    return addr | nbytes << cfg.axi_addr_bits


def split(cfg, items, cmds):
    """Cut the received beats into commands; returns [(bytes, errs)] after checking counts and `last`."""
    B, db = cfg.bytes_per_beat, cfg.axi_data_bits
    out, k = [], 0
    for addr, n in cmds:
        if n == 0:
            continue
        beats = -(-n // B)
        chunk = items[k:k + beats]
        k += beats
        assert len(chunk) == beats, f"command ({addr:#x}, {n}): {len(chunk)} of {beats} beats"
        lasts = [(w >> db) & 1 for w in chunk]
        assert lasts == [0] * (beats - 1) + [1], f"command ({addr:#x}, {n}): last flags {lasts}"
        data = b"".join((w & ((1 << db) - 1)).to_bytes(B, "little") for w in chunk)[:n]
        out.append((data, [(w >> (db + 1)) & 1 for w in chunk]))
    assert k == len(items), f"{len(items) - k} beats more than the commands asked for"
    return out


def random_commands(cfg, rng, count):
    B, maxb = cfg.bytes_per_beat, cfg.axi_max_burst_beats
    cmds = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.4:        # straddling a 4 KB boundary, any alignment
            addr = rng.randrange(1, MEM // 4096) * 4096 + rng.randrange(-3 * B * maxb, 2 * B)
        else:
            addr = rng.randrange(MEM - 8 * B * maxb)
        n = rng.choice([1, 2, B - 1, B, B + 1, rng.randrange(1, 4 * B * maxb + 1), 3 * B * maxb + rng.randrange(-9, 9)])
        n = max(1, min(n, MEM - addr))
        cmds.append((addr, n))
    return cmds


async def run_commands(dut, cfg, ram, src, sink, cmds, mem):
    cocotb.start_soon(sink.run())
    await src.send([cmd_word(cfg, a, n) for a, n in cmds])
    B = cfg.bytes_per_beat
    await sink.wait_for(sum(-(-n // B) for _, n in cmds), timeout_cycles=200_000)
    for _ in range(50):                        # nothing more may arrive
        await FallingEdge(dut.clk)
    got = split(cfg, sink.items, cmds)
    for (addr, n), (data, errs) in zip([c for c in cmds if c[1]], got):
        assert data == mem[addr:addr + n], f"command ({addr:#x}, {n}): data differs"
        assert not any(errs), f"command ({addr:#x}, {n}): unexpected error flag"
    # Guard: the bursts request exactly the beat-aligned span of each command, in order.
    want = []
    for addr, n in cmds:
        if n:
            a0, a1 = addr // B * B, -(-(addr + n) // B) * B
            want += range(a0, a1, B)
    fetched = [a + i * B for a, beats in ram.bursts for i in range(beats)]
    assert fetched == want, "the DMA fetched bytes outside the commands' beat-aligned spans"
    assert int(dut.o_error.value) == 0
    assert max(beats for _, beats in ram.bursts) <= cfg.axi_max_burst_beats


@cocotb.test()
async def random_transfers(dut):
    seed = int(bench_env("SEED", "1"))

    lat, jit, p = [(0, 0, 0.0), (12, 8, 0.3), (30, 0, 0.1)][int(bench_env("FLOW", "1"))]
    cfg, rng, ram, src, sink = setup(dut, seed, latency=lat, jitter=jit, p_stall=p)
    await reset(dut)
    cmds = random_commands(cfg, rng, 60) + [(4096 - 1, 1), (4096 - 2, 2), (8192 - cfg.bytes_per_beat, 0),
                                            (8192 - 3, 2 * 4096 + 5)]
    rng.shuffle(cmds)
    await run_commands(dut, cfg, ram, src, sink, cmds, ram.read(0, MEM))


@cocotb.test()
async def full_rate_and_outstanding(dut):
    """A long aligned read at latency 40 and no stalls: the outstanding bursts hide the latency, so the
    data side streams one beat per cycle once the first beat arrives."""
    cfg, rng, ram, src, sink = setup(dut, 7, latency=40, jitter=0, p_stall=0.0)
    await reset(dut)
    B = cfg.bytes_per_beat
    n = 512 * B
    cocotb.start_soon(sink.run())
    await src.send([cmd_word(cfg, 4096, n)])
    t0 = ram.cycle
    await sink.wait_for(1)
    t1 = ram.cycle
    await sink.wait_for(512)
    t2 = ram.cycle
    assert t2 - t1 <= 512 + 2, f"512 beats took {t2 - t1} cycles after the first"
    assert ram.max_in_flight == cfg.axi_max_outstanding
    assert t1 - t0 <= 40 + 6
    data = split(cfg, sink.items, [(4096, n)])[0][0]
    assert data == ram.read(4096, n)


@cocotb.test()
async def error_response(dut):
    """Reads past the end of memory return SLVERR: the beats built from them carry `err`, the others do not,
    and o_error stays set."""
    cfg, rng, ram, src, sink = setup(dut, 3, latency=5, jitter=3, p_stall=0.2)
    await reset(dut)
    B = cfg.bytes_per_beat
    cmds = [(MEM - 5 * B + 3, 5 * B), (100, 3 * B)]    # the first runs 3 bytes past the end
    cocotb.start_soon(sink.run())
    await src.send([cmd_word(cfg, a, n) for a, n in cmds])
    await sink.wait_for(5 + 3)
    got = split(cfg, sink.items, cmds)
    assert got[0][1] == [0, 0, 0, 0, 1], f"error flags {got[0][1]}"
    assert got[0][0][:5 * B - 3 - B] == ram.read(MEM - 5 * B + 3, 4 * B - 3)
    assert got[1][1] == [0, 0, 0] and got[1][0] == ram.read(100, 3 * B)
    assert int(dut.o_error.value) == 1
