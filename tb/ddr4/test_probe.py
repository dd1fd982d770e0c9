"""cocotb: the DDR probe (`hdl.ddrprobe.DdrProbe`, the GEMV engine's dense read pattern) behind the DDR4 model.

Every ``m_axi<p>`` port is served by one shared `tb.ddr4.model.Ddr4Channel` through `tb.ddr4.axi.Ddr4AxiMemory`;
the CSRs by cocotbext-axi's `AxiMaster` on ``s_axi``. For each fabric clock in FABRIC_MHZ (the DRAM clock stays
1,200 MHz) the probe reads a ROWS x COLS INT4 matrix with its binary16 scales (group 128) PASSES times, and the
test checks its counters against the model (`sim.ddrprobe.counts`) and the bursts the memory saw, that its
latency counters equal the latencies measured on the bus, and that the channel's command log keeps every
timing rule (`check_timing`). The figures (cycles, bytes, efficiencies, latency mean, percentiles and maximum)
go as one JSON object per clock to the file OUT, if given.

Parameters (environment): NPU_HW, FABRIC_MHZ (comma-separated), ROWS, COLS, PASSES, MAX_OUTSTANDING (0: the
preset's), PIPELINE_CK (the model's request and response pipeline, DRAM clocks each way; default
`Ddr4Params`'), MAP (`Ddr4Params.address_map`), OUT.
"""

from __future__ import annotations

import json
import logging

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge, with_timeout
from cocotbext.axi import AxiBus, AxiMaster, AxiResp

from hdl.config import HardwareConfig
from hdl.ddrprobe_map import CTRL_IRQ_ACK, CTRL_START, STATUS_DONE, by_name
from hdl.memory_map import memory_map
from sim.ddrprobe import ProbeConfig, bursts, counts
from tb.runner import bench_env

from .axi import Ddr4AxiMemory
from .model import Ddr4Channel, Ddr4Params, check_timing

CSR_BASE = memory_map("kv260").csr_base
BASE = 0x1000_0000          # the matrix's DDR address (any: the model's memory holds no data here)


def off(name):
    return by_name(name).offset


class Bench:
    def __init__(self, dut, hw):
        self.dut, self.hw = dut, hw
        self.master = AxiMaster(AxiBus.from_prefix(dut, "s_axi", bus_separator="__"), dut.clk, dut.rst)
        self.master.write_if.log.setLevel(logging.WARNING)
        self.master.read_if.log.setLevel(logging.WARNING)

    async def csr_read(self, offset):
        resp = await self.master.read(CSR_BASE + offset, 4, size=2)
        assert resp.resp == AxiResp.OKAY, f"CSR read at {offset:#x}: {resp.resp!r}"
        return int.from_bytes(resp.data, "little")

    async def csr_write(self, offset, value):
        resp = await self.master.write(CSR_BASE + offset, int(value).to_bytes(4, "little"), size=2)
        assert resp.resp == AxiResp.OKAY, f"CSR write at {offset:#x}: {resp.resp!r}"

    async def read64(self, name):
        return await self.csr_read(off(f"{name}_LO")) | await self.csr_read(off(f"{name}_HI")) << 32


def percentile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0


@cocotb.test()
async def measure(dut):
    hw = HardwareConfig.preset(bench_env("NPU_HW", "kv260"))
    clocks = [float(x) for x in bench_env("FABRIC_MHZ", "300").split(",")]
    rows, cols = int(bench_env("ROWS", "1024")), int(bench_env("COLS", "2048"))
    passes, limit = int(bench_env("PASSES", "1")), int(bench_env("MAX_OUTSTANDING", "0"))
    out = bench_env("OUT", "")
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value = 1
    await ClockCycles(dut.clk, 4)
    dut.rst.value = 0
    bench = Bench(dut, hw)
    pipeline = bench_env("PIPELINE_CK", "")
    extra = {"request_ck": int(pipeline), "response_ck": int(pipeline)} if pipeline else {}
    params = Ddr4Params(address_map=bench_env("MAP", Ddr4Params.address_map), **extra)
    prefixes = [f"m_axi{p}" for p in range(hw.axi_ports)]
    for p in range(hw.axi_ports):
        for name in ("awready", "wready", "bvalid"):
            getattr(dut, f"m_axi{p}__{name}").value = 0
    mem = None
    cfg = ProbeConfig.gemv(hw, rows, cols, base=BASE, passes=passes, max_outstanding=limit).check(hw)
    results = []
    for mhz in clocks:
        # a fresh channel per clock, its DRAM clock (and its first refresh interval) starting in two cycles
        channel = Ddr4Channel(params, fabric_hz=mhz * 1e6, ports=hw.axi_ports, port_bytes=hw.bytes_per_beat,
                              start=(mem.cycle if mem else 0) + 2)
        if mem is None:
            mem = Ddr4AxiMemory(dut, dut.clk, prefixes, channel)
        else:
            assert not any(port.reads for port in mem.ports)
            mem.reset_records()
            mem.channel = channel
        for name, value in (("WBASE", cfg.wbase), ("SBASE", cfg.sbase)):
            await bench.csr_write(off(f"{name}_LO"), value & 0xFFFF_FFFF)
            await bench.csr_write(off(f"{name}_HI"), value >> 32)
        for name in ("ROWS", "ROW_BYTES", "SCALE_BYTES", "TILE_ROWS", "PASSES", "PORTS", "MAX_OUTSTANDING"):
            await bench.csr_write(off(name), getattr(cfg, name.lower()))
        await bench.csr_write(off("CTRL"), CTRL_START)
        if not int(dut.o_irq.value):
            await with_timeout(RisingEdge(dut.o_irq), 50_000_000, "ns")
        status = await bench.csr_read(off("STATUS"))
        assert status == STATUS_DONE, f"STATUS {status:#x}"
        got = {n: await bench.read64(n) for n in ("CYCLES", "BURSTS", "LAT_SUM")}
        got["BYTES"] = [await bench.read64(f"BYTES_P{p}") for p in range(hw.axi_ports)]
        got["LAT_MIN"], got["LAT_MAX"] = await bench.csr_read(off("LAT_MIN")), await bench.csr_read(off("LAT_MAX"))
        await bench.csr_write(off("CTRL"), CTRL_IRQ_ACK)
        assert not mem.errors, mem.errors[0]
        want = counts(hw, cfg)
        assert got["BURSTS"] == want.bursts and tuple(got["BYTES"]) == want.bytes_per_port, \
            f"{mhz} MHz: counters {got}, model {want}"
        assert [list(b) for b in mem.bursts] == [list(b) for b in bursts(hw, cfg)], f"{mhz} MHz: bursts differ"
        lats = [x for port in mem.latencies for x in port]
        assert len(lats) == want.bursts and sum(lats) == got["LAT_SUM"] and min(lats) == got["LAT_MIN"] and \
            max(lats) == got["LAT_MAX"], f"{mhz} MHz: the probe's latency counters {got} and the bus's differ"
        check_timing(channel.log, params, channel.start_ck)
        cycles, nbytes = got["CYCLES"], sum(got["BYTES"])
        seconds = cycles / (mhz * 1e6)
        ns = 1e3 / mhz
        r = {
            "fabric_mhz": mhz, "rows": rows, "cols": cols, "passes": passes, "outstanding": cfg.outstanding(hw),
            "pipeline_ck": params.request_ck, "address_map": params.address_map, "cycles": cycles, "bytes": nbytes,
            "bursts": got["BURSTS"], "gb_s": nbytes / seconds / 1e9,
            "ddr_efficiency": nbytes / seconds / params.peak_bytes_per_s,
            "port_efficiency": nbytes / (cycles * hw.axi_ports * hw.bytes_per_beat),
            "port_peak_gb_s": hw.axi_ports * hw.bytes_per_beat * mhz * 1e6 / 1e9,
            "lat_mean_ns": got["LAT_SUM"] / got["BURSTS"] * ns, "lat_min_ns": got["LAT_MIN"] * ns,
            "lat_p50_ns": percentile(lats, 0.5) * ns, "lat_p90_ns": percentile(lats, 0.9) * ns,
            "lat_p99_ns": percentile(lats, 0.99) * ns, "lat_max_ns": got["LAT_MAX"] * ns,
            "lat_mean_cycles": got["LAT_SUM"] / got["BURSTS"], "lat_max_cycles": got["LAT_MAX"],
            "refreshes": sum(c.kind == "REF" for c in channel.log),
            "activates": sum(c.kind == "ACT" for c in channel.log),
            "reads": sum(c.kind == "RD" for c in channel.log),
        }
        dut._log.info(json.dumps(r))
        results.append(r)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
