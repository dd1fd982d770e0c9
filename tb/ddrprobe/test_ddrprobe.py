"""cocotb tests of the DDR bandwidth probe (`hdl.ddrprobe.DdrProbe`) against its model (`sim.ddrprobe`).

For every configuration (directed corners and seeded random ones): the bursts each port's memory saw, in
order, equal the model's; BURSTS, BYTES_P<p> and ERROR_BEATS equal the model's counts; LAT_SUM, LAT_MIN and
LAT_MAX equal the latencies the bench measured on the bus; CYCLES equals the cycles from the START pulse to
the cycle before the interrupt rose; no port ever has more bursts in flight than the limit (the memories
check it) and, on long runs, reaches it; STATUS and the interrupt behave (IRQ_ACK clears DONE, a START while
busy is ignored, every refused configuration sets DONE and CONFIG_ERROR without reading). The host tool
(`firmware.ddrprobe.measure`) runs in a thread on the simulated probe and must read the same numbers, and
gives up with one clear error when the interrupt does not come.

Parameters (environment): NPU_HW (the preset), SEED, LATENCY (memory read latency, cycles), PAUSE (pause
probability on every channel), RANDOM_RUNS, MEM (bytes behind every port); for the host tool's run, SHAPE
(the matrix, ``<rows>x<cols>``), PASSES and MIN_EFFICIENCY (the port efficiency it must exceed).
"""

from __future__ import annotations

import random
from dataclasses import replace
from functools import partial

import cocotb
import pytest
from cocotb.task import bridge
from cocotb.triggers import ClockCycles

from firmware.ddrprobe import ProbeError, measure, report
from hdl.config import HardwareConfig
from hdl.ddrprobe_map import (
    CTRL_IRQ_ACK,
    CTRL_START,
    GEMV_TILE_ROWS,
    LAT_MIN_NONE,
    MAX_PORTS,
    PROBE_ID,
    STATUS_BUSY,
    STATUS_CONFIG_ERROR,
    STATUS_DONE,
    STATUS_ERROR,
    by_name,
    gemv_chunk_bytes,
    version_word,
)
from sim.ddrprobe import ProbeConfig, bursts, counts
from tb.ddrprobe.bench import ProbeBench, SimDevice
from tb.runner import bench_env

MEM = int(bench_env("MEM", str(1 << 20)))       # bytes behind every port; reads past it answer SLVERR


def params():
    hw = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    return (hw, int(bench_env("SEED", "0")), int(bench_env("LATENCY", "20")), float(bench_env("PAUSE", "0.2")),
            int(bench_env("RANDOM_RUNS", "6")))


async def make_bench(dut, seed_offset=0, **kw):
    hw, seed, latency, pause, _ = params()
    kw.setdefault("latency", latency)
    kw.setdefault("pause", pause)
    bench = ProbeBench(dut, hw, seed=seed + seed_offset, mem_size=MEM, **kw)
    await bench.start()
    return bench


def off(name):
    return by_name(name).offset


async def write64(bench, name, value):
    await bench.csr_write(off(f"{name}_LO"), value & 0xFFFF_FFFF)
    await bench.csr_write(off(f"{name}_HI"), value >> 32)


async def read64(bench, name):
    return await bench.csr_read(off(f"{name}_LO")) | await bench.csr_read(off(f"{name}_HI")) << 32


async def configure(bench, cfg: ProbeConfig):
    await write64(bench, "WBASE", cfg.wbase)
    await write64(bench, "SBASE", cfg.sbase)
    for name in ("ROWS", "ROW_BYTES", "SCALE_BYTES", "TILE_ROWS", "PASSES", "PORTS", "MAX_OUTSTANDING"):
        await bench.csr_write(off(name), getattr(cfg, name.lower()))


async def read_counters(bench) -> dict:
    hw = bench.hw
    got = {name: await read64(bench, name) for name in ("CYCLES", "BURSTS", "ERROR_BEATS", "LAT_SUM")}
    got["BYTES"] = tuple([await read64(bench, f"BYTES_P{p}") for p in range(MAX_PORTS)])
    got["LAT_MIN"] = await bench.csr_read(off("LAT_MIN"))
    got["LAT_MAX"] = await bench.csr_read(off("LAT_MAX"))
    got["STATUS"] = await bench.csr_read(off("STATUS"))
    assert got["BYTES"][hw.axi_ports:] == (0,) * (MAX_PORTS - hw.axi_ports), "ports not built count bytes"
    return got


def check_run(bench, cfg: ProbeConfig, got: dict, what: str):
    """The counters of a finished run against the model and the bench's own measurements."""
    hw = bench.hw
    assert not bench.errors, f"{what}: {bench.errors[0]}"
    want_bursts = bursts(hw, cfg)
    for p, ram in enumerate(bench.rams):
        assert ram.bursts == want_bursts[p], \
            f"{what}: port {p} bursts {ram.bursts[:6]}... ({len(ram.bursts)}), model {want_bursts[p][:6]}... " \
            f"({len(want_bursts[p])})"
    want = counts(hw, cfg, error_beat=lambda a: a + hw.bytes_per_beat > MEM)
    assert got["BURSTS"] == want.bursts, f"{what}: BURSTS {got['BURSTS']}, model {want.bursts}"
    assert got["BYTES"][:hw.axi_ports] == want.bytes_per_port, \
        f"{what}: BYTES {got['BYTES']}, model {want.bytes_per_port}"
    assert got["ERROR_BEATS"] == want.error_beats, f"{what}: ERROR_BEATS {got['ERROR_BEATS']}, model {want.error_beats}"
    lats = [x for port in bench.latencies for x in port]
    assert len(lats) == want.bursts, f"{what}: the bench saw {len(lats)} first beats for {want.bursts} bursts"
    assert got["LAT_SUM"] == sum(lats), f"{what}: LAT_SUM {got['LAT_SUM']}, measured {sum(lats)}"
    assert got["LAT_MIN"] == (min(lats) if lats else LAT_MIN_NONE), f"{what}: LAT_MIN {got['LAT_MIN']}"
    assert got["LAT_MAX"] == (max(lats) if lats else 0), f"{what}: LAT_MAX {got['LAT_MAX']}"
    assert len(bench.start_cycles) == 1 and len(bench.irq_cycles) == 1, \
        f"{what}: {len(bench.start_cycles)} START pulses, {len(bench.irq_cycles)} interrupts"
    cycles = bench.irq_cycles[0] - 1 - bench.start_cycles[0]
    assert got["CYCLES"] == cycles, f"{what}: CYCLES {got['CYCLES']}, START to DONE took {cycles}"
    error = STATUS_ERROR if want.error_beats else 0
    assert got["STATUS"] == STATUS_DONE | error, f"{what}: STATUS {got['STATUS']:#x}"
    limit = cfg.outstanding(hw)
    for p, ram in enumerate(bench.rams):
        assert ram.max_in_flight <= limit
        # bursts are served one beat per cycle and addresses go out faster, so a port with many long bursts
        # fills its window
        beats = [b for _, b in want_bursts[p]]
        if len(beats) >= 4 * limit and sum(beats) >= len(beats) * hw.axi_max_burst_beats // 2:
            assert ram.max_in_flight == limit, f"{what}: port {p} never had {limit} bursts in flight " \
                                               f"({ram.max_in_flight})"


async def run_once(bench, cfg: ProbeConfig, what: str):
    bench.reset_records()
    for ram in bench.rams:
        ram.max_outstanding = cfg.outstanding(bench.hw)
    await configure(bench, cfg)
    await bench.csr_write(off("CTRL"), CTRL_START)
    await bench.wait_interrupt()
    got = await read_counters(bench)
    check_run(bench, cfg, got, what)
    await bench.csr_write(off("CTRL"), CTRL_IRQ_ACK)
    await ClockCycles(bench.dut.clk, 3)
    assert not int(bench.dut.o_irq.value), f"{what}: IRQ_ACK did not clear the interrupt"
    assert await bench.csr_read(off("STATUS")) & (STATUS_DONE | STATUS_BUSY) == 0
    return got


def directed(hw: HardwareConfig) -> list[tuple[str, ProbeConfig]]:
    N, T, C = hw.axi_ports, GEMV_TILE_ROWS, gemv_chunk_bytes(hw)
    burst = hw.axi_max_burst_beats * hw.bytes_per_beat
    gemv = partial(ProbeConfig.gemv, hw)
    return [
        ("a matrix of 4-chunk rows on every port, partial last tile", gemv(3 * N * T + 5, 8 * C, base=0x1000)),
        ("rows over 4 KB, unaligned base and row length, tiles of 4, one port",
         gemv(11, 2 * 4096 + 37, base=0x1003, sbase=0x9_0011, tile_rows=4, ports=1)),
        ("rows only (no scales), tiles of one row", ProbeConfig(0x40, 0, 7, 100, 0, tile_rows=1)),
        ("fewer rows than a tile", gemv(5, 300, base=0x2345)),
        ("a tile of 64 rows: its scales span bursts and a 4 KB boundary",
         gemv(100, 256, group=8, base=0x4_0000, sbase=0x4_FF00, tile_rows=64)),
        ("one burst in flight", gemv(2 * N * T, 2 * C, base=0x0, max_outstanding=1)),
        ("two bursts in flight, three passes", gemv(N * T + 3, 3 * C + 10, base=0x800, max_outstanding=2, passes=3)),
        ("limit above the maximum: the maximum",
         ProbeConfig(0x0, 0x8_0000, 4 * N * T, 4 * burst, 0, max_outstanding=hw.axi_max_outstanding + 5)),
        ("nothing to read, two passes", ProbeConfig(0x100, 0x200, 0, 1000, 32, passes=2)),
        ("past the memory's end: error beats", gemv(6, 1000, base=MEM - 3000, sbase=0x1000)),
    ]


def random_config(rng: random.Random, hw: HardwareConfig) -> ProbeConfig:
    """A configuration of at most ~60 KB per pass with any row length, scale length, tile and port count."""
    row_bytes = rng.choice([rng.randrange(1, 64), rng.randrange(1, 1200), gemv_chunk_bytes(hw) * rng.randrange(1, 5)])
    rows = rng.randrange(0, min(60, (48 << 10) // row_bytes) + 1)
    scale_bytes = rng.choice([0, 2, 32, rng.randrange(0, 200)])
    return ProbeConfig(wbase=rng.randrange(0, MEM // 2), sbase=rng.randrange(MEM // 2, MEM - (64 << 10)), rows=rows,
                       row_bytes=row_bytes, scale_bytes=scale_bytes, tile_rows=rng.choice([1, 2, 8, 8, 16, 64]),
                       passes=rng.choice([0, 1, 1, 2]), ports=rng.randrange(0, hw.axi_ports + 1),
                       max_outstanding=rng.randrange(0, hw.axi_max_outstanding + 2))


@cocotb.test()
async def configurations(dut):
    """Directed corners, then seeded random configurations, back to back on one probe."""
    hw, seed, _, _, runs = params()
    bench = await make_bench(dut)
    assert await bench.csr_read(off("ID")) == PROBE_ID
    assert await bench.csr_read(off("VERSION")) == version_word(hw.to_dict())
    for what, cfg in directed(hw):
        await run_once(bench, cfg, f"seed {seed}: {what} ({cfg})")
    rng = random.Random(seed)
    for k in range(runs):
        cfg = random_config(rng, hw)
        await run_once(bench, cfg, f"seed {seed} random run {k} ({cfg})")


@cocotb.test()
async def status_and_commands(dut):
    """Refused configurations, a START while busy, IRQ_ACK; the counters of the one run."""
    hw, seed, _, _, _ = params()
    bench = await make_bench(dut, seed_offset=1)
    good = ProbeConfig.gemv(hw, 20, 300, base=0)
    # each refused START: DONE and CONFIG_ERROR at once, nothing read, counters zero
    refused = [("PORTS above the ports built", "PORTS", hw.axi_ports + 1), ("TILE_ROWS 0", "TILE_ROWS", 0),
               ("TILE_ROWS not a power of two", "TILE_ROWS", 12), ("TILE_ROWS above 1024", "TILE_ROWS", 2048),
               ("ROW_BYTES 0 with rows", "ROW_BYTES", 0), ("ROW_BYTES of 2**24", "ROW_BYTES", 1 << 24),
               ("SCALE_BYTES of 2**20", "SCALE_BYTES", 1 << 20)]
    for what, name, value in refused:
        bench.reset_records()
        await configure(bench, good)
        await bench.csr_write(off(name), value)
        with pytest.raises(ValueError):
            replace(good, **{name.lower(): value}).check(hw)     # the host's check refuses it too
        await bench.csr_write(off("CTRL"), CTRL_START)
        await bench.wait_interrupt()
        status = await bench.csr_read(off("STATUS"))
        assert status == STATUS_DONE | STATUS_CONFIG_ERROR, f"refused START ({what}): STATUS {status:#x}"
        assert all(not ram.bursts for ram in bench.rams) and await read64(bench, "CYCLES") == 0, what
        await bench.csr_write(off("CTRL"), CTRL_IRQ_ACK)
        await ClockCycles(dut.clk, 2)
        assert await bench.csr_read(off("STATUS")) == STATUS_CONFIG_ERROR, what
    # START again while running: ignored; the one run's counters are the model's
    cfg = ProbeConfig.gemv(hw, 40, 600, base=0x800, passes=2)
    bench.reset_records()
    await configure(bench, cfg)
    await bench.csr_write(off("CTRL"), CTRL_START)
    assert await bench.csr_read(off("STATUS")) & STATUS_BUSY, "not busy after START"
    await bench.csr_write(off("ROW_BYTES"), 64)            # a new configuration does not disturb the run
    await bench.csr_write(off("CTRL"), CTRL_START)
    await bench.wait_interrupt()
    got = await read_counters(bench)
    bench.start_cycles[1:] = []                            # the ignored second pulse
    check_run(bench, cfg, got, f"seed {seed}: START while busy")


@cocotb.test()
async def host_tool(dut):
    """`firmware.ddrprobe.measure` in a host thread on the simulated probe, reading a GEMV matrix of the shape
    SHAPE (rows x cols) PASSES times: the same numbers as the model and the bus; its report names the
    efficiency and the line for firmware.perf."""
    hw, seed, _, _, _ = params()
    bench = await make_bench(dut, seed_offset=2, pause=0.0, jitter=0)
    device = SimDevice(bench)
    rows, cols = (int(x) for x in bench_env("SHAPE", "96x512").split("x"))
    cfg = ProbeConfig.gemv(hw, rows, cols, base=0, passes=int(bench_env("PASSES", "2")))
    bench.reset_records()
    m = await bridge(measure)(device, hw, cfg)
    want = counts(hw, cfg)
    assert (m.bursts, m.bytes_per_port, m.error_beats) == (want.bursts, want.bytes_per_port, 0)
    assert [ram.bursts for ram in bench.rams] == bursts(hw, cfg)
    lats = [x for port in bench.latencies for x in port]
    assert (m.lat_sum, m.lat_min, m.lat_max) == (sum(lats), min(lats), max(lats))
    assert m.cycles == bench.irq_cycles[0] - 1 - bench.start_cycles[0]
    assert not int(dut.o_irq.value), "measure() left the interrupt up"
    text = report(m)
    dut._log.info("\n" + text)
    assert text.splitlines()[-1] == f"python -m firmware.perf --hw {hw.name} --ddr-efficiency {m.ddr_efficiency:.3f}"
    floor = float(bench_env("MIN_EFFICIENCY", "0.5"))
    assert floor < m.port_efficiency <= 1.0, f"port efficiency {m.port_efficiency:.3f} with a " \
                                             f"{bench.rams[0].latency}-cycle memory and no pauses"


@cocotb.test()
async def timeout(dut):
    """measure() on a probe whose memory never answers: no interrupt within the timeout, one clear error."""
    hw, _, _, _, _ = params()
    bench = await make_bench(dut, seed_offset=3, pause=0.0, latency=10**9)
    cfg = ProbeConfig.gemv(hw, 8, 64, base=0)
    with pytest.raises(ProbeError, match=r"no interrupt from the DDR probe within 2e-05 s \(STATUS 0x1: busy\)"):
        await bridge(measure)(SimDevice(bench), hw, cfg, timeout_s=2e-5)
