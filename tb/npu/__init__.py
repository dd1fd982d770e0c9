"""Full-chip cocotb bench of the NPU (`hdl.npu.Npu`): `bench` (DDR, CSR master, the simulated device), `host`
(the host code it runs), `test_npu` (the cocotb tests) and ``python -m tb.npu`` (the command line).

`simulate` is the one entry point that builds and runs it (pytest wrappers and the command line): the Npu's
Verilog is converted once per process and hardware preset (about 40 s for ``tiny``) and built by Verilator
once per preset in ``build/sim/npu_<preset>``.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["simulate", "npu_verilog"]

_VERILOG: dict[str, tuple] = {}


def npu_verilog(hw) -> str:
    """The Verilog of ``Npu(hw)`` (top ``npu``), converted once per process."""
    if hw.name not in _VERILOG or _VERILOG[hw.name][0] != hw:
        from hdl.npu import Npu
        from tb.runner import verilog_of
        _VERILOG[hw.name] = (hw, verilog_of(Npu(hw), "npu"))
    return _VERILOG[hw.name][1]


def simulate(hw, testcase: str, *, seed: int = 0, env: Mapping[str, str] | None = None):
    """Run cocotb test(s) `testcase` of `tb.npu.test_npu` on ``Npu(hw)``; returns the results file."""
    from tb.runner import run
    return run(None, toplevel="npu", test_module="tb.npu.test_npu", build_name=f"npu_{hw.name}",
               testcase=testcase, seed=seed, verilog=npu_verilog(hw),
               extra_env={"NPU_HW": hw.name, "SEED": str(seed), **(env or {})})
