"""AXI4 signatures and the read DMA: signature shapes and errors (pysim-free), and the cocotb bench of the
DMA on Verilator under random latency and stalls (tb/axi/test_dma.py)."""

import pytest
from amaranth import Shape
from amaranth.lib import wiring

from hdl.axi import AxiReadDma, AxiReadSignature, AxiSignature
from hdl.config import HardwareConfig
from tb.runner import run

TINY = HardwareConfig.preset("tiny")


def test_read_signature_members():
    sig = AxiReadSignature.from_config(TINY)
    members = dict(sig.members.items())
    for name in ("arid", "araddr", "arlen", "arsize", "arburst", "arvalid", "rready"):
        assert members[name].flow == wiring.Out
    for name in ("arready", "rid", "rdata", "rresp", "rlast", "rvalid"):
        assert members[name].flow == wiring.In
    assert Shape.cast(members["rdata"].shape).width == TINY.axi_data_bits
    assert Shape.cast(members["arid"].shape).width == TINY.axi_id_bits
    assert sig == AxiReadSignature(TINY.axi_addr_bits, TINY.axi_data_bits, TINY.axi_id_bits)
    full = AxiSignature(32, 128, 6)
    assert {"awid", "wdata", "wstrb", "bid", "arid", "rdata"} <= set(dict(full.members.items()))
    assert Shape.cast(dict(full.members.items())["wstrb"].shape).width == 16 == 16


def test_signature_errors():
    with pytest.raises(ValueError, match="data_bits must be a power of two"):
        AxiReadSignature(32, 96, 4)
    with pytest.raises(TypeError, match="id_bits must be a positive integer"):
        AxiReadSignature(32, 64, 0)
    with pytest.raises(ValueError, match="len_bits must be an integer"):
        AxiReadDma(TINY, len_bits=0)


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_dma_random_transfers(flow):
    run(AxiReadDma(TINY), toplevel="axi_dma", test_module="tb.axi.test_dma", build_name="axi_dma_tiny",
        testcase="random_transfers", extra_env={"NPU_HW": "tiny", "SEED": str(11 + flow), "FLOW": str(flow)})


def test_dma_full_rate_and_errors():
    run(AxiReadDma(TINY), toplevel="axi_dma", test_module="tb.axi.test_dma", build_name="axi_dma_tiny",
        testcase=["full_rate_and_outstanding", "error_response"], extra_env={"NPU_HW": "tiny"})
