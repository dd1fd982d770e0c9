"""cocotb bench of the systolic GEMM engine fed through the AXI4 read DMA (`tb.systolic.top.SystolicDmaTop`).

Every GEMM is cut into tiles and streams by `sim.systolic.tile_streams` (the layout contract); weights are
placed in a DDR model per weight port (`tb.axi.memory.LatencyAxiReadRam`, cocotbext-axi channels, DDR-like
latency with jitter and random AR/R stalls) and fetched by the DMA one command per tile; the command,
activation, exponent and scale streams get random idle cycles and ``o_y`` random back-pressure. The
results are compared bit for bit (`assert_array_equal` on the binary32 bit patterns) with
`sim.systolic.gemm`, which is itself bit-identical to `sim.numerics.gemv` token by token.

Bench parameters (`tb.runner.bench_env`): ``NPU_HW`` preset, ``SEED``, ``NUM_GEMMS``, ``P_STALL``; the
``cycles`` test also reads ``SHAPES`` ("rows,cols,tokens;...") and writes cycle counts to ``CYCLES_OUT``.
"""

from __future__ import annotations

import json
import random

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge
from cocotbext.axi import AxiReadBus

from hdl.config import HardwareConfig
from sim.numerics import quantize_activations, quantize_weights
from sim.systolic import EXP_BITS, TileGeometry, gemm, tile_streams, untile_output
from tb.axi.memory import LatencyAxiReadRam
from tb.axi.streams import StreamSink, StreamSource, pauses
from tb.runner import bench_env

MEM = 1 << 22


def pack(values, width):
    """Little-endian bit concatenation of signed/unsigned integers (element 0 in the low bits)."""
    out, mask = 0, (1 << width) - 1
    for i, v in enumerate(values):
        out |= (int(v) & mask) << (i * width)
    return out


def unpack_y(word, n):
    return [word >> (32 * i) & 0xFFFFFFFF for i in range(n)]


def random_operands(rng: np.random.Generator, geo, rows, cols, tokens):
    w = rng.standard_t(5, size=(rows, cols)) * rng.uniform(0.01, 2.0, size=(rows, 1))
    q_w, s_w = quantize_weights(w, geo.group)
    x = (rng.normal(size=(tokens, cols)) * rng.uniform(1e-3, 100.0, size=(tokens, 1))).astype(np.float32)
    qa, ea = zip(*(quantize_activations(v, geo.block) for v in x))
    return q_w, s_w, np.array(qa), np.array(ea)


class Bench:
    def __init__(self, dut, seed: int, *, p_stall: float, latency: int = 24, jitter: int = 8):
        self.dut = dut
        self.cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
        self.geo = TileGeometry.from_config(self.cfg)
        self.seed, self.p_stall = seed, p_stall
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
        self.rams = []
        for p in range(self.geo.wgt_ports):
            bus = AxiReadBus.from_prefix(dut, f"axi__{p}", bus_separator="__")
            self.rams.append(LatencyAxiReadRam(
                bus, dut.clk, size=MEM, latency=latency, jitter=jitter, max_outstanding=self.cfg.axi_max_outstanding,
                rng=random.Random(seed * 10 + p),
                ar_pause=pauses(random.Random(seed * 10 + p + 1), p_stall) if p_stall else None,
                r_pause=pauses(random.Random(seed * 10 + p + 2), p_stall) if p_stall else None))
        r = lambda k: random.Random(seed * 100 + k)       # noqa: E731  one generator per stream
        self.src = {name: StreamSource(dut, name, dut.clk, rng=r(i), p_idle=p_stall)
                    for i, name in enumerate(["i_cmd", "i_act", "i_exp", "i_scale"])}
        self.wcmd = [StreamSource(dut, f"i_wcmd__{p}", dut.clk, rng=r(10 + p), p_idle=p_stall)
                     for p in range(self.geo.wgt_ports)]
        self.sink = StreamSink(dut, "o_y", dut.clk, rng=r(20), p_stall=p_stall)

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(3):
            await FallingEdge(self.dut.clk)
        self.dut.rst.value = 0
        cocotb.start_soon(self.sink.run())

    async def run_gemm(self, q_w, s_w, q_a, e_a) -> tuple[np.ndarray, int]:
        """Stream one GEMM through the engine; returns (binary32 result, cycles from the first input to the
        last output row)."""
        geo, cfg = self.geo, self.cfg
        st = tile_streams(geo, q_w, s_w, q_a, e_a)
        R, N = geo.rows, 2 * geo.cols
        beat_bytes = cfg.bytes_per_beat
        wcmds = [[] for _ in range(geo.wgt_ports)]
        for p in range(geo.wgt_ports):
            image = b"".join(b.to_bytes(beat_bytes, "little") for b in st["wgt"][p])
            assert len(image) <= MEM
            self.rams[p].write(0, image)
            addr = 0
            for nseg in st["cmd"]:
                nbytes = nseg * geo.seg // geo.steps_per_beat * beat_bytes
                wcmds[p].append(addr | nbytes << cfg.axi_addr_bits)
                addr += nbytes
        first = len(self.sink.items)
        n_out = len(st["tiles"]) * R
        start = cocotb.utils.get_sim_time("ns")
        tasks = [cocotb.start_soon(self.src["i_cmd"].send(st["cmd"])),
                 cocotb.start_soon(self.src["i_act"].send([pack(a, cfg.act_bits) for a in st["act"]])),
                 cocotb.start_soon(self.src["i_exp"].send([pack(e, EXP_BITS) for e in st["exp"]])),
                 cocotb.start_soon(self.src["i_scale"].send([pack(s, 16) for s in st["scale"]]))]
        tasks += [cocotb.start_soon(self.wcmd[p].send(wcmds[p])) for p in range(geo.wgt_ports)]
        items = await self.sink.wait_for(first + n_out, timeout_cycles=200 * (len(st["act"]) + 100))
        cycles = round((cocotb.utils.get_sim_time("ns") - start) / 10)
        for t in tasks:
            await t
        beats = items[first:first + n_out]
        lasts = [b >> (32 * N) & 1 for b in beats]
        assert lasts == [int(i % R == R - 1) for i in range(n_out)], "o_y.last must mark row R-1 of every tile"
        y = untile_output(geo, [unpack_y(b, N) for b in beats], q_a.shape[0], q_w.shape[0])
        assert not int(self.dut.o_dma_error.value), "the DMA reported an AXI error"
        return y, cycles

    def check(self, y, q_w, s_w, q_a, e_a, what):
        ref = gemm(q_w, s_w, q_a, e_a, group=self.geo.group, block=self.geo.block)
        np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), err_msg=what)


@cocotb.test()
async def random_gemms(dut):
    """Random shapes (rows, cols, tokens not multiples of the array or of a segment), stalls everywhere."""
    seed = int(bench_env("SEED", "1"))
    tb = Bench(dut, seed, p_stall=float(bench_env("P_STALL", "0.3")))
    await tb.reset()
    rng = np.random.default_rng(seed)
    geo = tb.geo
    for i in range(int(bench_env("NUM_GEMMS", "4"))):
        rows = int(rng.integers(1, 3 * 2 * geo.cols + 1))
        cols = int(rng.integers(1, 4 * geo.seg + 1))
        tokens = int(rng.integers(1, 2 * geo.rows + 2))
        ops = random_operands(rng, geo, rows, cols, tokens)
        y, _ = await tb.run_gemm(*ops)
        tb.check(y, *ops, f"seed {seed} gemm {i}: rows {rows} cols {cols} tokens {tokens}")


@cocotb.test()
async def corner_cases(dut):
    """All -8 weights, ±127 activations, zero weight rows and activation columns, zero scales (-0 parts),
    subnormal and large parts; with stalls."""
    tb = Bench(dut, 7, p_stall=0.2)
    await tb.reset()
    geo = tb.geo
    rows, cols, tokens = 2 * geo.cols + 1, 2 * geo.seg + 3, geo.rows + 1
    groups, blocks = -(-cols // geo.group), -(-cols // geo.block)
    q_w = np.full((rows, cols), -8, dtype=np.int8)
    q_w[1] = 0                                   # a zero weight row
    q_w[3, ::3] = 7
    q_a = np.full((tokens, cols), 127, dtype=np.int8)
    q_a[1] = -127
    q_a[2, ::2] = -127
    q_a[:, 5] = 0                                # a zero activation column
    q_a[3] = 0                                   # a zero token
    s_w = np.full((rows, groups), 0.5, dtype=np.float16)
    s_w[2] = 0.0                                 # zero scale: negative sums give -0 parts
    s_w[4] = np.float16(6e-8)                    # binary16 subnormal scale
    s_w[5] = np.float16(65504.0)
    e_a = np.zeros((tokens, blocks), dtype=np.int32)
    e_a[0] = -140                                # subnormal binary32 parts
    e_a[1] = 90                                  # large parts, still finite
    e_a[-1] = np.arange(blocks) * 7 - 20
    y, _ = await tb.run_gemm(q_w, s_w, q_a, e_a)
    tb.check(y, q_w, s_w, q_a, e_a, "corner cases")
    assert np.all(y[3] == 0) and np.all(y[:, 1] == 0)
    assert np.any(np.signbit(y[:, 2]) & (y[:, 2] == 0)), "zero scale with a negative sum must give -0"


@cocotb.test()
async def cycles(dut):
    """Full rate (no stalls, memory latency only): cycle counts of the GEMMs in SHAPES, checked bit for bit,
    written as JSON to CYCLES_OUT for the benchmark."""
    tb = Bench(dut, 3, p_stall=0.0, latency=int(bench_env("MEM_LATENCY", "24")), jitter=0)
    await tb.reset()
    rng = np.random.default_rng(3)
    shapes = [tuple(int(v) for v in s.split(",")) for s in bench_env("SHAPES", "8,64,4").split(";")]
    out = []
    for rows, cols, tokens in shapes:
        ops = random_operands(rng, tb.geo, rows, cols, tokens)
        y, n = await tb.run_gemm(*ops)
        tb.check(y, *ops, f"cycles {rows}x{cols}x{tokens}")
        out.append({"rows": rows, "cols": cols, "tokens": tokens, "cycles": n})
        await RisingEdge(dut.clk)
    await ReadOnly()
    path = bench_env("CYCLES_OUT", "")
    if path:
        with open(path, "w") as f:
            json.dump(out, f)
