"""cocotb tests of the DDR bandwidth probe (`hdl.ddrprobe.DdrProbe`) against its model (`sim.ddrprobe`).

For every configuration (directed corners and seeded random ones): the bursts each port's memory saw, in
order, equal the model's; BURSTS, BYTES_P<p> and ERROR_BEATS equal the model's counts; LAT_SUM, LAT_MIN and
LAT_MAX equal the latencies the bench measured on the bus; CYCLES equals the cycles from the START pulse to
the cycle before the interrupt rose; no port ever has more bursts in flight than the limit (the memories
check it) and, on long runs, reaches it; STATUS and the interrupt behave (IRQ_ACK clears DONE, a START while
busy is ignored, a refused configuration sets DONE and CONFIG_ERROR without reading). The host tool
(`firmware.ddrprobe.measure`) runs in a thread on the simulated probe and must read the same numbers.

Parameters (environment): NPU_HW (the preset), SEED, LATENCY (memory read latency, cycles), PAUSE (pause
probability on every channel), RANDOM_RUNS.
"""

from __future__ import annotations

import random

import cocotb
from cocotb.task import bridge
from cocotb.triggers import ClockCycles

from firmware.ddrprobe import measure, report
from hdl.config import HardwareConfig
from hdl.ddrprobe_map import (CTRL_IRQ_ACK, CTRL_START, LAT_MIN_NONE, MAX_PORTS, PROBE_ID, STATUS_BUSY,
                              STATUS_CONFIG_ERROR, STATUS_DONE, STATUS_ERROR, by_name, version_word)
from sim.ddrprobe import ProbeConfig, bursts, counts
from tb.ddrprobe.bench import ProbeBench, SimDevice
from tb.runner import bench_env

MEM = 1 << 20


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
    await write64(bench, "BASE", cfg.base)
    await write64(bench, "TOTAL_BYTES", cfg.total_bytes)
    await bench.csr_write(off("CHUNK_BYTES"), cfg.chunk_bytes)
    await bench.csr_write(off("PORTS"), cfg.ports)
    await bench.csr_write(off("MAX_OUTSTANDING"), cfg.max_outstanding)


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
    B, N = hw.bytes_per_beat, hw.axi_ports
    burst = hw.axi_max_burst_beats * B
    return [
        ("row tiles on every port", ProbeConfig(0x1000, 64 << 10, 8192)),
        ("unaligned base, chunk not a beat multiple, one port", ProbeConfig(0x1003, 10_000, 1000, ports=1)),
        ("chunks crossing 4 KB", ProbeConfig(0x3F0, 3 * 5000 + 17, 5000)),
        ("chunk of one burst, one burst in flight", ProbeConfig(0x40, 40 * burst, burst, max_outstanding=1)),
        ("two bursts in flight", ProbeConfig(0x0, 32 * burst, 4 * burst, max_outstanding=2)),
        ("limit above the maximum: the maximum", ProbeConfig(0x0, 32 * burst, 3 * burst,
                                                             max_outstanding=hw.axi_max_outstanding + 5)),
        ("total below one chunk", ProbeConfig(0x2345, 300, 8192)),
        ("one byte", ProbeConfig(0x7, 1, 16)),
        ("nothing to read", ProbeConfig(0x100, 0, 8192)),
        ("past the memory's end: error beats", ProbeConfig(MEM - 3000, 6000, 1024, ports=N)),
    ]


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
        chunk = rng.choice([rng.randrange(1, 600), rng.randrange(1, 64) * hw.bytes_per_beat, 4096, 8192,
                            rng.randrange(1000, 20000)])
        cfg = ProbeConfig(base=rng.randrange(0, MEM // 2), total_bytes=rng.randrange(0, 48 << 10), chunk_bytes=chunk,
                          ports=rng.randrange(0, hw.axi_ports + 1),
                          max_outstanding=rng.randrange(0, hw.axi_max_outstanding + 2))
        await run_once(bench, cfg, f"seed {seed} random run {k} ({cfg})")


@cocotb.test()
async def status_and_commands(dut):
    """A refused configuration, a START while busy, IRQ_ACK; the counters of the one run."""
    hw, seed, _, _, _ = params()
    bench = await make_bench(dut, seed_offset=1)
    # PORTS above the ports built: DONE and CONFIG_ERROR at once, nothing read, counters zero
    for bad in (ProbeConfig(0, 4096, 512, ports=0), ProbeConfig(0, 4096, 0)):
        bench.reset_records()
        await configure(bench, bad)
        if bad.chunk_bytes:
            await bench.csr_write(off("PORTS"), hw.axi_ports + 1)
        await bench.csr_write(off("CTRL"), CTRL_START)
        await bench.wait_interrupt()
        status = await bench.csr_read(off("STATUS"))
        assert status == STATUS_DONE | STATUS_CONFIG_ERROR, f"refused START: STATUS {status:#x}"
        assert all(not ram.bursts for ram in bench.rams) and await read64(bench, "CYCLES") == 0
        await bench.csr_write(off("CTRL"), CTRL_IRQ_ACK)
        await ClockCycles(dut.clk, 2)
        assert await bench.csr_read(off("STATUS")) == STATUS_CONFIG_ERROR
    # START again while running: ignored; the one run's counters are the model's
    cfg = ProbeConfig(0x800, 24 << 10, 2048)
    bench.reset_records()
    await configure(bench, cfg)
    await bench.csr_write(off("CTRL"), CTRL_START)
    assert await bench.csr_read(off("STATUS")) & STATUS_BUSY, "not busy after START"
    await bench.csr_write(off("CHUNK_BYTES"), 64)          # a new configuration does not disturb the run
    await bench.csr_write(off("CTRL"), CTRL_START)
    await bench.wait_interrupt()
    got = await read_counters(bench)
    bench.start_cycles[1:] = []                            # the ignored second pulse
    check_run(bench, cfg, got, f"seed {seed}: START while busy")


@cocotb.test()
async def host_tool(dut):
    """`firmware.ddrprobe.measure` in a host thread on the simulated probe: the same numbers as the model and
    the bus; its report names the efficiency and the line for firmware.perf."""
    hw, seed, _, _, _ = params()
    bench = await make_bench(dut, seed_offset=2, pause=0.0, jitter=0)
    device = SimDevice(bench)
    cfg = ProbeConfig(0x0, 96 << 10, 8192)
    bench.reset_records()
    m = await bridge(measure)(device, hw, cfg)
    want = counts(hw, cfg)
    assert (m.bursts, m.bytes_per_port, m.error_beats) == (want.bursts, want.bytes_per_port, 0)
    lats = [x for port in bench.latencies for x in port]
    assert (m.lat_sum, m.lat_min, m.lat_max) == (sum(lats), min(lats), max(lats))
    assert m.cycles == bench.irq_cycles[0] - 1 - bench.start_cycles[0]
    assert not int(dut.o_irq.value), "measure() left the interrupt up"
    text = report(m)
    dut._log.info("\n" + text)
    assert text.splitlines()[-1] == f"python -m firmware.perf --hw {hw.name} --ddr-efficiency {m.ddr_efficiency:.3f}"
    assert 0.5 < m.port_efficiency <= 1.0, f"port efficiency {m.port_efficiency:.3f} with a {bench.rams[0].latency}-" \
                                           f"cycle memory and no pauses"
