"""hdl.ddrwrite: DdrWriter cocotb + Verilator bench (tb/ddrwrite/) against cocotbext-axi's AxiRamWrite with
random AW/W/B pauses and stream stalls; every byte of memory checked against NumPy. One Verilator build per
preset (tiny by default, kv260 slow)."""

import gc
import warnings

import pytest
from amaranth import Shape, unsigned
from amaranth.hdl import UnusedElaboratable
from amaranth.lib.wiring import Out

from hdl.axi import AxiWriteSignature
from hdl.config import HardwareConfig
from hdl.ddrio import writer_cmd_layout
from hdl.ddrwrite import AxiWriteDma, DdrWriter
from tb.runner import run


def _run(preset, testcase, **env):
    hw = HardwareConfig.preset(preset)
    run(DdrWriter(hw), toplevel="ddrwrite", test_module="tb.ddrwrite.test_writer",
        build_name=f"ddrwrite_{preset}", testcase=testcase, extra_env={"NPU_HW": preset, **env})


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_writer_random_commands(flow):
    _run("tiny", "random_commands_bitexact", SEED=str(31 + flow), FLOW=str(flow))


def test_writer_error_outstanding_and_rate():
    _run("tiny", ["error_response", "outstanding_limit", "rate"])


@pytest.mark.parametrize("preset", ["tiny", "kv260"])
def test_writer_signature(preset):
    """The ports the controller wires: exactly the shared layouts and AXI write signature."""
    hw = HardwareConfig.preset(preset)
    w = DdrWriter(hw)
    w._MustUse__silence = True            # only its signature is used here
    assert w.signature.members["axi"].signature == AxiWriteSignature.from_config(hw)
    assert w.signature.members["i_cmd"].signature.members["payload"].shape == writer_cmd_layout(hw)
    assert Shape.cast(w.signature.members["i_elem"].signature.members["payload"].shape) == unsigned(32)
    for name in ("o_done", "o_busy", "o_error"):
        assert w.signature.members[name].flow == Out and Shape.cast(w.signature.members[name].shape) == unsigned(1)


@pytest.mark.parametrize("bad", [0, 33, True, 2.0])
def test_dma_len_bits_checked(bad):
    with pytest.raises(ValueError, match=r"len_bits must be an integer in 1\.\.32, not"):
        AxiWriteDma(HardwareConfig.preset("tiny"), len_bits=bad)
    with warnings.catch_warnings():           # the half-built component is never elaborated, by design
        warnings.simplefilter("ignore", UnusedElaboratable)
        gc.collect()


@pytest.mark.slow
def test_writer_kv260():
    _run("kv260", ["random_commands_bitexact", "error_response", "outstanding_limit", "rate"], SEED="5", FLOW="1")
