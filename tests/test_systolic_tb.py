"""cocotb + Verilator bench of the systolic GEMM engine behind the AXI read DMA (tb/systolic), tiny preset:
random shapes with random stalls on every stream and AXI channel, and the corner cases; bit-exact against
`sim.systolic.gemm`."""

from hdl.config import PRESETS
from tb.runner import run
from tb.systolic.top import SystolicDmaTop


def test_engine_random_and_corner_cases():
    cfg = PRESETS["tiny"]
    run(SystolicDmaTop(cfg), toplevel="systolic_top", test_module="tb.systolic.test_engine",
        build_name="systolic_tiny", testcase=["random_gemms", "corner_cases"],
        extra_env={"NPU_HW": cfg.name, "SEED": "5", "NUM_GEMMS": "5", "P_STALL": "0.3"})
