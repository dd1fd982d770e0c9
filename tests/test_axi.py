"""AXI4 signatures and the read DMA: signature shapes and errors (pysim-free), and the cocotb bench of the
DMA on Verilator under random latency and stalls (tb/axi/test_dma.py)."""

import pytest
from amaranth import Shape
from amaranth.lib import wiring

from hdl.axi import AxiReadArbiter, AxiReadDma, AxiReadSignature, AxiSignature, AxiWriteSignature
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


@pytest.mark.parametrize("flow", [0, 2])
def test_dma_with_registered_read_address_channel(flow):
    """`ar_registered` (the GEMV ports' DMAs): the same random transfers under AR/R stalls, and a burst per cycle
    with every outstanding burst in flight (the register takes the next burst while handing one on)."""
    run(AxiReadDma(TINY, ar_registered=True), toplevel="axi_dma", test_module="tb.axi.test_dma",
        build_name="axi_dma_tiny_ar_reg", testcase=["random_transfers", "full_rate_and_outstanding", "error_response"],
        extra_env={"NPU_HW": "tiny", "SEED": str(23 + flow), "FLOW": str(flow)})


def test_write_signature_members():
    sig = AxiWriteSignature.from_config(TINY)
    members = dict(sig.members.items())
    assert set(members) == {"awid", "awaddr", "awlen", "awsize", "awburst", "awlock", "awcache", "awprot", "awqos",
                            "awvalid", "awready", "wdata", "wstrb", "wlast", "wvalid", "wready", "bid", "bresp",
                            "bvalid", "bready"}
    for name in ("awaddr", "awvalid", "wdata", "wstrb", "wlast", "wvalid", "bready"):
        assert members[name].flow == wiring.Out
    for name in ("awready", "wready", "bid", "bresp", "bvalid"):
        assert members[name].flow == wiring.In
    assert Shape.cast(members["wstrb"].shape).width == TINY.bytes_per_beat
    full = dict(AxiSignature.from_config(TINY).members.items())
    read = dict(AxiReadSignature.from_config(TINY).members.items())
    assert set(full) == set(members) | set(read) and len(full) == len(members) + len(read)
    assert repr(sig) == "AxiWriteSignature(40, 64, 4)" and sig != AxiReadSignature.from_config(TINY)


def test_arbiter_errors():
    with pytest.raises(ValueError, match="17 masters need 5 ID bits, more than axi_id_bits = 4"):
        AxiReadArbiter(TINY, 17)
    with pytest.raises(TypeError, match="n must be a positive integer, not 0"):
        AxiReadArbiter(TINY, 0)


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_arbiter_three_masters(flow):
    from tb.axi.arbiter_top import ArbiterBench
    run(ArbiterBench(TINY), toplevel="axi_arbiter", test_module="tb.axi.test_arbiter", build_name="axi_arbiter_tiny",
        testcase="three_masters", extra_env={"NPU_HW": "tiny", "SEED": str(31 + flow), "FLOW": str(flow)})
