"""Instruction fetch (hdl.fetch): cocotb + Verilator bench with DDR latency, AXI stalls and controller
backpressure, for the tiny and kv260 bus widths (one and two words per beat)."""

import pytest

from hdl.config import HardwareConfig
from hdl.fetch import Fetch
from tb.runner import run


@pytest.mark.parametrize("hw", ["tiny", "kv260"])
def test_fetch_bench(hw):
    cfg = HardwareConfig.preset(hw)
    run(Fetch(cfg), toplevel="fetch", build_name=f"fetch_{hw}", test_module="tb.fetch.test_fetch",
        extra_env={"NPU_HW": hw, "SEED": "1"})


def test_fetch_rejects_narrow_bus():
    cfg = HardwareConfig.preset("tiny").replace(axi_data_bits=32)
    with pytest.raises(ValueError, match="at least 64 bits"):
        Fetch(cfg)
