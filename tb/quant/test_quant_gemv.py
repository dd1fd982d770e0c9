"""cocotb bench of the WGEMV path: binary32 activations -> `hdl.quant.ActQuantizer` -> the activation and
exponent memories of `hdl.gemv.GemvEngine` -> y, on a wrapper (tests/test_quant.py `QuantGemv`) whose
quantiser's o_act / o_exp are wired to the engine's i_act / i_exp. Every result is compared bit for bit with
``sim.numerics.gemv(q_w, scale, *quantize_activations(x, act_block))``, under random DDR latency, AR/R
stalls, bubbles on the activation and i_acc streams and o_y backpressure.

Wrapper ports: ``i_qcmd`` ({n}), ``i_beat`` (four binary32 per beat, `hdl.l2.beat_layout`), ``o_qdone``,
``o_qbusy``, ``o_nonfinite`` (the quantiser); ``i_cmd``, ``i_acc``, ``o_y``, ``m_axi<p>``, ``o_busy``, ``o_error``, ``o_bad_cmd`` (the engine).
"""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge
from cocotbext.axi import AxiReadBus

from hdl.config import HardwareConfig
from hdl.gemv import command_layout
from sim.numerics import gemv, quantize_activations
from tb.axi.memory import LatencyAxiReadRam
from tb.axi.streams import StreamSink, StreamSource, pauses
from tb.gemv.bench import pack_fields, random_case
from tb.quant.vectors import LANES, beats, spread_vector
from tb.runner import bench_env

MEM = 1 << 18
FLOWS = [(0, 0, 0.0), (20, 10, 0.25), (60, 0, 0.05)]     # (DDR latency, jitter, stall probability)


class QuantGemvBench:
    def __init__(self, dut, cfg: HardwareConfig, *, seed: int, latency: int = 0, jitter: int = 0, p: float = 0.0):
        self.dut, self.cfg = dut, cfg
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
        self.rams = []
        for k in range(cfg.axi_ports):
            r = random.Random(seed * 100 + k)
            self.rams.append(LatencyAxiReadRam(
                AxiReadBus.from_prefix(dut, f"m_axi{k}", bus_separator="__"), dut.clk, size=MEM, latency=latency,
                jitter=jitter, max_outstanding=cfg.axi_max_outstanding, rng=r,
                ar_pause=pauses(random.Random(r.random()), p) if p else None,
                r_pause=pauses(random.Random(r.random()), p) if p else None))
        self.qcmd = StreamSource(dut, "i_qcmd", dut.clk, rng=random.Random(seed + 1), p_idle=p)
        self.elem = StreamSource(dut, "i_beat", dut.clk, rng=random.Random(seed + 2), p_idle=p)
        self.cmd = StreamSource(dut, "i_cmd", dut.clk)
        self.acc = StreamSource(dut, "i_acc", dut.clk, rng=random.Random(seed + 3), p_idle=p)
        self.out = StreamSink(dut, "o_y", dut.clk, rng=random.Random(seed + 4), p_stall=p)
        self.cycle = 0
        self.qdone: list[tuple[int, int]] = []         # (cycle, o_nonfinite) of every o_qdone pulse
        cocotb.start_soon(self._monitor())
        cocotb.start_soon(self.out.run())

    async def _monitor(self):
        while True:
            await RisingEdge(self.dut.clk)
            self.cycle += 1
            await ReadOnly()
            if int(self.dut.o_qdone.value):
                self.qdone.append((self.cycle, int(self.dut.o_nonfinite.value)))

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(3):
            await FallingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await FallingEdge(self.dut.clk)

    async def quantize(self, vectors, timeout: int = 200_000):
        """Quantises `vectors` as back-to-back commands; returns (o_nonfinite per command, cycles from the first
        command's issue to the last o_qdone)."""
        n0 = len(self.qdone)
        t0 = self.cycle
        words = [w for x in vectors for w in beats(np.asarray(x, np.float32).view(np.uint32))]
        elems = cocotb.start_soon(self.elem.send(words))
        await self.qcmd.send([len(x) for x in vectors])
        for _ in range(timeout):
            if len(self.qdone) >= n0 + len(vectors):
                break
            await FallingEdge(self.dut.clk)
        else:
            raise AssertionError(f"timeout: {len(self.qdone) - n0} of {len(vectors)} quantiser commands done")
        await elems
        done = self.qdone[n0:]
        return [nf for _, nf in done], done[-1][0] - t0

    async def gemv(self, case, base: int = 0, timeout: int = 2_000_000):
        """Runs the engine on the activations the quantiser wrote; returns y (float32 [rows])."""
        wb = case.weight_bytes()
        waddr = base + case.w_offset
        saddr = -(-(waddr + len(wb)) // 64) * 64 + case.s_offset
        assert saddr + len(case.scale_bytes()) <= MEM, "case does not fit the bench memory"
        for ram in self.rams:
            ram.write(waddr, wb)
            ram.write(saddr, case.scale_bytes())
        n0 = len(self.out.items)
        word = pack_fields(command_layout(self.cfg), wbase=waddr, sbase=saddr, rows=case.rows, cols=case.cols,
                           log2_group=case.group.bit_length() - 1, accm=case.acc is not None)
        if case.acc is not None:
            cocotb.start_soon(self.acc.send([int(v) for v in case.acc.astype(np.float32).view(np.uint32)]))
        await self.cmd.send([word])
        items = await self.out.wait_for(n0 + case.rows, timeout_cycles=timeout)
        return np.array(items[n0:n0 + case.rows], dtype=np.uint32).view(np.float32)


def wgemv_case(cfg, rng, rows, x, **kw):
    """A random INT4 matrix for activations `x`, whose q / e come from the model quantiser."""
    case = random_case(cfg, rng, rows, len(x), **kw)
    case.q_a, case.e_a = quantize_activations(x, cfg.act_block)
    return case


def check(cfg, case, x, y, what):
    # The path's contract, spelled out: the GEMV model on the model's quantisation of x.
    q, e = quantize_activations(x, cfg.act_block)
    want = gemv(case.q_w, case.scale, q, e, group=case.group, block=cfg.act_block, acc=case.acc)
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32),
                                  err_msg=f"{what}: {case.rows}x{case.cols} group {case.group}")


@cocotb.test()
async def wgemv_random(dut):
    """Seeded random WGEMVs: x of many lengths (1 .. gemv_max_cols) and magnitudes (results stay finite:
    block scales 2**-160 .. 2**60), random INT4 matrices and group sizes, with and without accm; some x are
    quantised back to back with a decoy in front (the engine must see only the last one)."""
    seed = int(bench_env("SEED", "1"))
    lat, jit, p = FLOWS[int(bench_env("FLOW", "1"))]
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    tb = QuantGemvBench(dut, cfg, seed=seed, latency=lat, jitter=jit, p=p)
    await tb.reset()
    rng = np.random.default_rng(seed)
    W, B, C = cfg.weights_per_beat, cfg.act_block, cfg.gemv_max_cols
    for k in range(int(bench_env("CASES", "8"))):
        cols = int(rng.choice([1, W - 1, W, B + 1, 2 * cfg.weight_group + 3, C, int(rng.integers(1, 300))]))
        rows = int(rng.choice([1, 5, int(rng.integers(1, 40))])) if cols < C else 8
        x = spread_vector(rng, cols, B, scales=(-160, 60))
        vectors = [x]
        if rng.random() < 0.4:               # a decoy quantised just before, overwritten by x
            vectors.insert(0, spread_vector(rng, int(rng.integers(cols, C + 1)), B, scales=(-160, 60)))
        flags, _ = await tb.quantize(vectors)
        assert flags == [0] * len(vectors), f"case {k}: o_nonfinite on finite activations"
        group = int(rng.choice([0, 0, 8, 16, 64])) or None
        case = wgemv_case(cfg, rng, rows, x, group=group, accm=rng.random() < 0.4, misalign=rng.random() < 0.3)
        y = await tb.gemv(case, base=int(rng.integers(0, 8)) * 4096)
        check(cfg, case, x, y, f"case {k} (seed {seed}, flow {lat}/{jit}/{p})")
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0


@cocotb.test()
async def wgemv_corners_and_rate(dut):
    """Directed activations through the whole path (all zero, one huge value, subnormal blocks, exact ties,
    max |x| = 127 * 2**k and just above), the inf/NaN flag, and the quantiser's rate in front of the engine:
    gemv_max_cols elements with no stalls in at most gemv_max_cols / 4 + act_block / 4 + 12 cycles (four
    elements per cycle)."""
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    tb = QuantGemvBench(dut, cfg, seed=9, latency=7, jitter=5, p=0.1)
    await tb.reset()
    rng = np.random.default_rng(9)
    B, C, f = cfg.act_block, cfg.gemv_max_cols, np.float32
    tiniest = f(2.0 ** -149)
    top = f(127 * 2.0 ** -3)
    corners = [
        np.zeros(2 * B + 3, f),
        np.concatenate([np.full(B - 1, 1e-3, f), [f(2.0 ** 40)], np.full(5, -7.0, f)]),
        np.array([tiniest, -tiniest, 3 * tiniest, 0x007FFFFF * tiniest, 0.0] * 4, f),
        np.resize(np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5], f), 3 * B),
        np.array([top, np.nextafter(top, f(1)), -top / 3] + [top / 7] * (B - 2) +
                 [-np.nextafter(top, f(np.inf))] + [top] * 3, f),
    ]
    for k, x in enumerate(corners):
        flags, _ = await tb.quantize([x])
        assert flags == [0]
        case = wgemv_case(cfg, rng, 9, x, accm=k % 2 == 1)
        y = await tb.gemv(case)
        check(cfg, case, x, y, f"corner {k}")
    bad = spread_vector(rng, 3 * B, B, scales=(-20, 20))
    bad[B + 1] = np.nan
    worse = bad.copy()
    worse[0] = -np.inf
    flags, _ = await tb.quantize([bad, corners[1], worse])
    assert flags == [1, 0, 1], f"o_nonfinite per command: {flags}"

    # Rate: a fresh bench phase without stalls on the quantiser's input.
    tb.elem.p_idle = tb.qcmd.p_idle = 0.0
    x = spread_vector(rng, C, B, scales=(-30, 30))
    _, cycles = await tb.quantize([x])
    dut._log.info(f"quantiser: {C} elements in {cycles} cycles (command to o_done)")
    assert cycles <= C // LANES + B // LANES + 12, f"{C} elements took {cycles} cycles"
    case = wgemv_case(cfg, rng, 16, x)
    y = await tb.gemv(case)
    check(cfg, case, x, y, "full-length case")
