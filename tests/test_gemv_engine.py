"""The whole GEMV engine (tiny preset) in cocotb + Verilator: bit-exact against sim.numerics.gemv under
random AXI latency and stalls (tb/gemv/test_gemv.py)."""

import pytest

from hdl.config import HardwareConfig
from hdl.gemv import GemvEngine
from tb.runner import run

TINY = HardwareConfig.preset("tiny")


def _run(testcase, **env):
    run(GemvEngine(TINY), toplevel="gemv", test_module="tb.gemv.test_gemv", build_name="gemv_tiny",
        testcase=testcase, extra_env={"NPU_HW": "tiny", **{k: str(v) for k, v in env.items()}})


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_engine_random(flow):
    _run("random_gemvs", SEED=21 + flow, FLOW=flow)


def test_engine_corners_errors_throughput():
    _run(["corner_cases", "bad_command_and_read_error", "throughput"])


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_engine_sparse_random(flow):
    """Sparse mode: densities 0 / 5 / 30 / 100 %, bit-exact, only non-zero columns' beats read."""
    _run("sparse_random", SEED=31 + flow, FLOW=flow)


def test_engine_sparse_corners():
    _run("sparse_corners")


@pytest.mark.slow
@pytest.mark.parametrize("flow", [1, 2])
def test_engine_random_kv260(flow):
    """The kv260 engine (4 x 128-bit ports, 128 lanes) on the same random cases; about 2 minutes of Verilator
    build. benchmarks/gemv.py also checks every E4B-shaped result of this engine bit for bit."""
    cfg = HardwareConfig.preset("kv260")
    run(GemvEngine(cfg), toplevel="gemv", test_module="tb.gemv.test_gemv", build_name="gemv_kv260",
        testcase="random_gemvs", extra_env={"NPU_HW": "kv260", "SEED": str(41 + flow), "FLOW": str(flow)})
