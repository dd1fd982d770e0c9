"""The CSR map and its AXI4-Lite slave."""

import pytest

from hdl.csr import CsrBlock
from hdl.csr_map import REGISTERS, Register, by_name, markdown_table
from tb.runner import run


def test_map_is_consistent():
    offsets = [r.offset for r in REGISTERS]
    assert len(set(offsets)) == len(offsets)
    assert by_name("POSITION").access == "rw" and by_name("STATUS").access == "ro"
    assert by_name("ID").reset == 0x47334E31
    assert "| 0x018 | TOKEN_ID | rw |" in markdown_table()
    with pytest.raises(KeyError, match="no CSR named 'NOPE'"):
        by_name("NOPE")
    with pytest.raises(ValueError, match="access must be rw, ro or cmd"):
        Register("X", 0, "wo", "")
    with pytest.raises(ValueError, match="not a word in the window"):
        Register("X", 0x1002, "rw", "")


@pytest.mark.parametrize("seed", [0, 1])
def test_axi_lite_csr_bench(seed):
    run(CsrBlock(), toplevel="csr_block", test_module="tb.csr.test_csr", extra_env={"SEED": str(seed)})


def test_architecture_doc_has_the_current_map():
    import re
    from pathlib import Path
    doc = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    m = re.search(r"<!-- csr-table -->\n(.*?)\n<!-- /csr-table -->", doc, re.S)
    assert m and m.group(1) == markdown_table(), "docs/architecture.md's CSR table is out of date"


def test_version_word_leaves_out_the_clock():
    """VERSION bits 31:8 name the hardware parameters but the core clock (`hdl.build --clock-mhz` keeps the
    preset's word, so the runtime and the DDR probe tool accept such a build), and change with any other
    parameter; bits 7:0 are the ISA version."""
    import hashlib

    from hdl.config import HardwareConfig
    from hdl.csr_map import ISA_VERSION, version_word

    kv260 = HardwareConfig.preset("kv260")
    fields = {k: v for k, v in kv260.to_dict().items() if k != "clock_hz"}
    expect = int.from_bytes(hashlib.sha256(repr(sorted(fields.items())).encode()).digest()[:3], "little")
    assert version_word(kv260.to_dict()) == ISA_VERSION | expect << 8
    assert version_word(kv260.replace(clock_hz=251_000_000).to_dict()) == version_word(kv260.to_dict())
    assert version_word(kv260.replace(axi_ports=3).to_dict()) != version_word(kv260.to_dict())
