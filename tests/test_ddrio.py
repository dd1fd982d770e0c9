"""hdl.ddrio: DdrReader cocotb + Verilator benches (tb/ddrio/) under random DDR latency, AXI channel
pauses and stream stalls, bit-exact against NumPy. One Verilator build per component configuration."""

import pytest

from hdl.config import HardwareConfig
from hdl.ddrio import DdrReader
from tb.runner import run

TINY = HardwareConfig.preset("tiny")


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_reader_random_commands(flow):
    run(DdrReader(TINY), toplevel="ddr_reader", test_module="tb.ddrio.test_reader", build_name="ddr_reader_tiny",
        testcase="random_commands_bitexact", extra_env={"NPU_HW": "tiny", "SEED": str(21 + flow), "FLOW": str(flow)})


def test_reader_errors_credit_and_rate():
    run(DdrReader(TINY), toplevel="ddr_reader", test_module="tb.ddrio.test_reader", build_name="ddr_reader_tiny",
        testcase=["error_response", "credit_rule_and_rate"], extra_env={"NPU_HW": "tiny"})


