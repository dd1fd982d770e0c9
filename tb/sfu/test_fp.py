"""cocotb side of the FpAdd/FpMul bench: ~100k seeded vectors (random bit patterns, random normal values
over a wide exponent range, near-cancelling pairs, subnormal products) against NumPy float32, bit for bit;
NaN results must be the canonical QNAN."""

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, RisingEdge

from hdl.fp import QNAN
from tb.runner import bench_env


def vectors(n, seed):
    rng = np.random.default_rng(seed)
    q = n // 4
    rand_a = rng.integers(0, 2**32, q, dtype=np.uint64).astype(np.uint32)
    rand_b = rng.integers(0, 2**32, q, dtype=np.uint64).astype(np.uint32)
    wide = lambda k: (rng.standard_normal(k) * 2.0 ** rng.integers(-140, 120, k)).astype(np.float32)
    wa, wb = wide(q), wide(q)
    near_a = rng.standard_normal(q).astype(np.float32)
    near_b = (-near_a * (1 + rng.integers(-64, 64, q) * 2.0 ** -23)).astype(np.float32)
    tiny_a = (rng.uniform(1, 2, n - 3 * q) * 2.0 ** rng.integers(-90, -40, n - 3 * q)).astype(np.float32)
    tiny_b = (rng.uniform(-2, 2, n - 3 * q) * 2.0 ** rng.integers(-110, -50, n - 3 * q)).astype(np.float32)
    a = np.concatenate([rand_a, wa.view(np.uint32), near_a.view(np.uint32), tiny_a.view(np.uint32)])
    b = np.concatenate([rand_b, wb.view(np.uint32), near_b.view(np.uint32), tiny_b.view(np.uint32)])
    return a, b


def compare(name, got, want):
    want_bits = want.view(np.uint32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got.view(np.float32)), nan, err_msg=f"{name}: NaN-ness differs")
    np.testing.assert_array_equal(got[nan], np.full(nan.sum(), QNAN, np.uint32), err_msg=f"{name}: NaN bits")
    bad = np.flatnonzero(got[~nan] != want_bits[~nan])
    assert bad.size == 0, f"{name}: {bad.size} mismatches, first at {bad[:5]}"


@cocotb.test()
async def add_mul_random(dut):
    n = int(bench_env("VECTORS", "100000"))
    a, b = vectors(n, int(bench_env("SEED", "0")))
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value = 1
    dut.en.value = 1
    dut.i_valid.value = 0
    await RisingEdge(dut.clk)
    await FallingEdge(dut.clk)
    dut.rst.value = 0
    sums, prods = [], []
    i = 0
    while len(sums) < n:
        if i < n:
            dut.i_valid.value, dut.i_a.value, dut.i_b.value = 1, int(a[i]), int(b[i])
            i += 1
        else:
            dut.i_valid.value = 0
        await RisingEdge(dut.clk)
        await FallingEdge(dut.clk)
        if dut.o_valid.value:
            sums.append(int(dut.o_sum.value))
            prods.append(int(dut.o_prod.value))
    fa, fb = a.view(np.float32), b.view(np.float32)
    with np.errstate(all="ignore"):
        compare("add", np.array(sums, np.uint32), fa + fb)
        compare("mul", np.array(prods, np.uint32), fa * fb)
