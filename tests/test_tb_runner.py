"""The bench and synthesis plumbing: a cocotb/Verilator run passes when the bench passes, fails (naming the
test) when it fails, and Yosys synthesis maps a small design to UltraScale+ primitives."""

import pytest

from hdl.synth import Utilisation, format_table, synthesize
from tb.runner import run
from tb.smoke.counter import Accumulator


def test_cocotb_bench_passes():
    run(Accumulator(), toplevel="smoke_acc", test_module="tb.smoke.test_counter", testcase="running_sum",
        extra_env={"SEED": "3"})


def test_cocotb_failure_is_reported_by_name():
    with pytest.raises(AssertionError, match="must_fail"):
        run(Accumulator(), toplevel="smoke_acc", test_module="tb.smoke.test_counter", testcase="must_fail",
            extra_env={"EXPECT_FAILURE": "1"})


def test_synthesis_counts_primitives():
    util = synthesize(Accumulator(), "smoke_acc")
    assert util.ff == 16                     # the 16-bit register, nothing else is stateful
    assert 0 < util.lut <= 40 and util.dsp == 0 and util.bram36 == 0 and util.uram == 0
    assert "FF" in format_table(util)


def test_utilisation_mapping():
    u = Utilisation.from_cells("x", {"LUT6": 3, "LUT2": 1, "SRLC32E": 2, "FDRE": 5, "FDSE": 1,
                                     "RAMB18E2": 3, "RAMB36E2": 1, "DSP48E2": 7, "URAM288": 2})
    assert (u.lut, u.ff, u.dsp, u.bram36, u.uram) == (6, 6, 7, 2.5, 2)
