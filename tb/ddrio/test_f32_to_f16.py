"""cocotb side of the F32ToF16 sweep: every binary16 value and, around every boundary between two adjacent
binary16 values (the exact midpoint, one binary32 ulp either side, for both signs, up to the overflow
threshold 65520), plus seeded random bit patterns and random values over the binary16 range; compared bit
for bit with ``np.float32(x).astype(np.float16)`` (NaN inputs must give 0x7E00)."""

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, RisingEdge

from hdl.fp import QNAN16
from tb.runner import bench_env


def boundary_vectors():
    """binary32 patterns: every binary16 value, every midpoint between neighbours and the ulps around it."""
    h = np.arange(0x7C00, dtype=np.uint16)                  # +0 .. 65504
    lo = h.view(np.float16).astype(np.float64)
    hi = np.append(lo[1:], 65536.0)                       # the next value (65536 = where overflow starts)
    mid = ((lo + hi) / 2).astype(np.float32)              # exact: 12 significant bits
    assert np.all(mid.astype(np.float64) == (lo + hi) / 2)
    mb = mid.view(np.uint32)
    pos = np.concatenate([lo.astype(np.float32).view(np.uint32), mb, mb - 1, mb + 1])
    pos = pos[pos < 0x7F800000]
    return np.concatenate([pos, pos | 0x80000000]).astype(np.uint32)


def random_vectors(n, seed):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n // 2, dtype=np.uint64).astype(np.uint32)
    vals = (rng.uniform(-1, 1, n - n // 2) * 2.0 ** rng.integers(-30, 18, n - n // 2)).astype(np.float32)
    return np.concatenate([bits, vals.view(np.uint32)])


@cocotb.test()
async def f32_to_f16_sweep(dut):
    lanes = len(dut.i_a) // 32
    x = np.concatenate([boundary_vectors(), random_vectors(int(bench_env("VECTORS", "100000")),
                                                           int(bench_env("SEED", "0")))])
    x = np.concatenate([x, np.zeros(-len(x) % lanes, np.uint32)])
    words = [int.from_bytes(x[i:i + lanes].tobytes(), "little") for i in range(0, len(x), lanes)]
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value, dut.en.value, dut.i_valid.value = 1, 1, 0
    await RisingEdge(dut.clk)
    await FallingEdge(dut.clk)
    dut.rst.value = 0
    out = []
    i = 0
    while len(out) < len(words):
        if i < len(words):
            dut.i_valid.value, dut.i_a.value = 1, words[i]
            i += 1
        else:
            dut.i_valid.value = 0
        await RisingEdge(dut.clk)
        await FallingEdge(dut.clk)
        if dut.o_valid.value:
            out.append(int(dut.o_y.value))
    got = np.frombuffer(b"".join(w.to_bytes(2 * lanes, "little") for w in out), np.uint16)
    f = x.view(np.float32)
    with np.errstate(all="ignore"):
        want = f.astype(np.float16).view(np.uint16)
    nan = np.isnan(f)
    want = np.where(nan, np.uint16(QNAN16), want)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} of {len(x)} mismatches; first inputs {[hex(v) for v in x[bad[:5]]]} -> "
                           f"{[hex(v) for v in got[bad[:5]]]}, want {[hex(v) for v in want[bad[:5]]]}")
    dut._log.info("F32ToF16: %d vectors bit-exact (%d boundary)", len(x), len(boundary_vectors()))
