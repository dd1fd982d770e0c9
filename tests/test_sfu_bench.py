"""The whole stream SFU (`hdl.sfu.Sfu`, tiny preset) in cocotb + Verilator: every operation with random
stalls on all three streams, bit-exact against sim.sfu; the latency property and full rate.

All marked slow: the Verilator build of the whole SFU takes ~8 min on 2 shared cores (the Verilator front end
alone takes minutes), far over the default-suite budget; a built model runs both default-size cases in ~40 s."""

import pytest

from hdl.config import PRESETS
from hdl.sfu import Sfu
from tb.runner import run


def _run(testcase, **env):
    hw = PRESETS["tiny"]
    dut = Sfu(hw)
    env = {"NPU_HW": hw.name, "LATENCY": str(dut.latency), "SHORT_LATENCY": str(dut.short_latency), **env}
    run(dut, toplevel="sfu", test_module="tb.sfu.test_sfu", build_name="sfu_tiny", testcase=testcase,
        extra_env=env)


@pytest.mark.slow
def test_sfu_every_op_random_stalls():
    _run("every_op_random_stalls", SEED="1", ROUNDS="4", STALL="1")


@pytest.mark.slow
def test_sfu_every_op_back_to_back():
    # no stalls: commands follow each other as soon as the SFU takes them, so short commands meet long
    # elements still in flight (the in-order exit rule)
    _run("every_op_random_stalls", SEED="5", ROUNDS="4", STALL="0")


@pytest.mark.slow
def test_sfu_latency_and_full_rate():
    _run("latency_and_full_rate")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_sfu_long_sweep(seed):
    _run("every_op_random_stalls", SEED=str(seed), ROUNDS="40", STALL=str(seed % 2))
