"""`python -m hdl.build` for the cores alone (``--top gemv``, ``--top npu``) on the tiny preset: every stage
runs, the outputs exist, the utilisation table is printed against the XCK26 budget (``--synth``) and a
repeat reads it from the cache, and without Vivado the build stops cleanly (exit 0) after writing the
Vivado inputs. The system top (the default) is tested in tests/test_kv260.py."""

import shutil
import subprocess
import sys

import pytest

from hdl.build import TOP_NAME
from hdl.config import XCK26
from hdl.synth import ROOT


def _build(*args):
    return subprocess.run([sys.executable, "-m", "hdl.build", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_build_gemv_tiny_synth_and_cache():
    """All five stages with Yosys on the GEMV engine; the same build again takes the estimate from the cache."""
    out = ROOT / "build" / "test_build_tiny"
    shutil.rmtree(out, ignore_errors=True)
    proc = _build("--hw", "tiny", "--top", "gemv", "--synth", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert text.splitlines()[0].startswith("hdl.build: the GEMV engine core alone for tiny")
    for k, stage in enumerate(("elaborate", "verilog", "rtlil", "yosys", "vivado"), 1):
        assert f"[{k}/5] {stage}" in text, text
    for resource in ("LUT", "FF", "DSP48E2", "BRAM36", "URAM288"):
        assert resource in text
    assert XCK26.name in text
    assert (out / f"{TOP_NAME}.v").read_text().lstrip().startswith(("/*", "module", "(*"))
    assert f"module {TOP_NAME}" in (out / f"{TOP_NAME}.v").read_text()
    assert (out / f"{TOP_NAME}.il").stat().st_size > 0
    tcl = (out / "vivado" / "build.tcl").read_text()
    assert "synth_design" in tcl and f"set_part {XCK26.name}" in tcl and "-mode out_of_context" in tcl
    assert "create_clock" in (out / "vivado" / f"{TOP_NAME}.xdc").read_text()
    if shutil.which("vivado") is None:
        assert "Vivado not found on PATH: out-of-context run not done; inputs are in" in text
    # The LUT count in the table is a positive number: the design was really synthesised.
    lut = next(line for line in text.splitlines() if line.startswith("LUT"))
    assert int(lut.split()[1]) > 1000
    # The per-block breakdown (the engine's ports kept as blocks) ends in the same total, and is saved.
    total = next(line for line in text.splitlines() if line.startswith("total "))
    assert total.split()[1] == lut.split()[1]
    assert any(line.startswith("port0 ") for line in text.splitlines()), text
    assert total in (out / "utilisation.txt").read_text()
    # Again: the same RTLIL, so the estimate comes from the cache, with the same table.
    again = _build("--hw", "tiny", "--top", "gemv", "--synth", "--out", str(out))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[4/5] yosys     cached estimate of this exact design" in again.stdout
    assert lut in again.stdout and total in again.stdout
    assert len(list((out / "synth" / "cache").glob("*.json"))) == 1


@pytest.mark.slow
def test_build_npu_tiny_core():
    """``--top npu``: the NPU core alone; its Verilog and out-of-context Vivado inputs, no Yosys by default."""
    out = ROOT / "build" / "test_build_npu_tiny"
    shutil.rmtree(out, ignore_errors=True)
    proc = _build("--hw", "tiny", "--top", "npu", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Npu for tiny" in proc.stdout
    text = (out / f"{TOP_NAME}.v").read_text()
    for port in ("m_axi0__araddr", "m_axi0__awaddr", "m_axi1__araddr", "o_irq"):
        assert port in text, port
    assert "[4/5] yosys     skipped" in proc.stdout
    assert not (out / "app").exists()


def test_build_bad_input_is_one_line():
    proc = _build("--hw", "nonesuch")
    assert proc.returncode == 2 and "invalid choice: 'nonesuch'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_build_bad_out_and_flat_without_synth(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for args, msg in (((f"--out={afile}",), f"--out '{afile}' exists and is not a directory"),
                      (("--flat",), "--flat applies to the --synth estimate")):
        proc = _build("--hw", "tiny", *args)
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_build_at_another_clock(tmp_path):
    """``--clock-mhz``: the core's XDC constrains the clock given (150 MHz: 6.667 ns; the tiny preset's is
    100), and the build says which; a clock the MMCM cannot make from pl_clk0 (above 725 MHz on the -2LV part),
    a non-number and a non-positive one are one line and exit status 2."""
    out = tmp_path / "gemv150"
    proc = _build("--hw", "tiny", "--top", "gemv", "--clock-mhz", "150", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "150 MHz" in proc.stdout
    assert "create_clock -name clk -period 6.667 [get_ports clk]" in (out / "vivado" / f"{TOP_NAME}.xdc").read_text()
    for value, msg in (("900", "--clock-mhz 900: clock 900 MHz is unreachable: an MMCM output of a -2LV part is "
                                "6.25-725 MHz"),
                       ("abc", "argument --clock-mhz: invalid float value: 'abc'"),
                       ("-5", "--clock-mhz must be a positive number of MHz, not -5.0")):
        proc = _build("--hw", "tiny", "--top", "gemv", "--clock-mhz", value, "--out", str(tmp_path / "bad"))
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        if value != "abc":      # argparse's own message follows its usage lines
            assert proc.stderr.strip() == f"error: {msg}", proc.stderr
