"""`python -m hdl.build` for the tiny preset: every stage runs, the outputs exist, the utilisation table is
printed against the XCK26 budget, and without Vivado the build stops cleanly (exit 0) after writing the
Vivado inputs."""

import shutil
import subprocess
import sys

from hdl.build import TOP_NAME
from hdl.synth import ROOT


def test_build_tiny():
    """All five stages with Yosys on the GEMV engine (the whole NPU's synthesis is `test_build_npu_tiny`)."""
    out = ROOT / "build" / "test_build_tiny"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "hdl.build", "--hw", "tiny", "--top", "gemv", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for k, stage in enumerate(("elaborate", "verilog", "rtlil", "yosys", "vivado"), 1):
        assert f"[{k}/5] {stage}" in text, text
    for resource in ("LUT", "FF", "DSP48E2", "BRAM36", "URAM288"):
        assert resource in text
    assert "xck26" in text
    assert (out / f"{TOP_NAME}.v").read_text().lstrip().startswith(("/*", "module", "(*"))
    assert f"module {TOP_NAME}" in (out / f"{TOP_NAME}.v").read_text()
    assert (out / f"{TOP_NAME}.il").stat().st_size > 0
    tcl = (out / "vivado" / "build.tcl").read_text()
    assert "synth_design" in tcl and "xck26-sfvc784-2LV-c" in tcl
    assert "create_clock" in (out / "vivado" / f"{TOP_NAME}.xdc").read_text()
    if shutil.which("vivado") is None:
        assert "Vivado not found on PATH: bitstream not built; inputs are in" in text
    # The LUT count in the table is a positive number: the design was really synthesised.
    lut = next(line for line in text.splitlines() if line.startswith("LUT"))
    assert int(lut.split()[1]) > 1000
    # The per-block breakdown (the engine's ports kept as blocks) ends in the same total, and is saved.
    total = next(line for line in text.splitlines() if line.startswith("total "))
    assert total.split()[1] == lut.split()[1]
    assert any(line.startswith("port0 ") for line in text.splitlines()), text
    assert total in (out / "utilisation.txt").read_text()


def test_build_npu_tiny_no_synth():
    """The default top is the whole NPU: it elaborates and its Verilog and Vivado inputs are written."""
    out = ROOT / "build" / "test_build_npu_tiny"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "hdl.build", "--hw", "tiny", "--no-synth", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Npu for tiny" in proc.stdout
    text = (out / f"{TOP_NAME}.v").read_text()
    for port in ("s_axil__awaddr", "m_axi0__araddr", "m_axi0__awaddr", "m_axi1__araddr", "o_irq"):
        assert port in text, port
    assert "[4/5] yosys     skipped" in proc.stdout
