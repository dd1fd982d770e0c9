"""cocotb side of the plumbing check: drives random data and compares with a Python running sum."""

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, RisingEdge

from tb.runner import bench_env


@cocotb.test()
async def running_sum(dut):
    rng = random.Random(int(bench_env("SEED", "0")))
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value = 1
    dut.i_en.value = 0
    dut.i_data.value = 0
    await RisingEdge(dut.clk)
    await FallingEdge(dut.clk)
    dut.rst.value = 0
    expect = 0
    for _ in range(200):
        en, data = rng.random() < 0.7, rng.randrange(256)
        dut.i_en.value, dut.i_data.value = int(en), data
        await FallingEdge(dut.clk)
        if en:
            expect = (expect + data) & 0xFFFF
        assert int(dut.o_sum.value) == expect


@cocotb.test()
async def must_fail(dut):
    """Used by the plumbing test to prove that a failing cocotb test fails the pytest test."""
    if bench_env("EXPECT_FAILURE", "0") == "1":
        assert False, "deliberate failure"
