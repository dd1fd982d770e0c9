"""hdl.ddrwrite: DdrWriter cocotb + Verilator bench (tb/ddrwrite/) against cocotbext-axi's AxiRamWrite with
random AW/W/B pauses and stream stalls; every byte of memory checked against NumPy. One Verilator build per
preset (tiny by default, kv260 slow)."""

import pytest

from hdl.config import HardwareConfig
from hdl.ddrwrite import DdrWriter
from tb.runner import run


def _run(preset, testcase, **env):
    hw = HardwareConfig.preset(preset)
    run(DdrWriter(hw), toplevel="ddr_writer", test_module="tb.ddrwrite.test_writer",
        build_name=f"ddr_writer_{preset}", testcase=testcase, extra_env={"NPU_HW": preset, **env})


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_writer_random_commands(flow):
    _run("tiny", "random_commands_bitexact", SEED=str(31 + flow), FLOW=str(flow))


def test_writer_error_and_rate():
    _run("tiny", ["error_response", "rate"])


@pytest.mark.slow
def test_writer_kv260():
    _run("kv260", ["random_commands_bitexact", "error_response", "rate"], SEED="5", FLOW="1")
