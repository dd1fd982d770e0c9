"""`hdl.synth.synthesize` with blocks kept (``keep_depth``): the per-block rows add up to the totals, the
blocks are the ones asked for, and the totals bound the flat synthesis of the same design from above
(flat, Yosys also removes what a block drives but nobody reads, e.g. the last column's activation copies)."""

from hdl.synth import block_modules, format_breakdown, group_blocks, synthesize
from hdl.systolic import SystolicArray


def test_blocks_add_up_and_match_the_flat_estimate():
    array = SystolicArray(2, 2, 16)
    hier = synthesize(array, "synth_blocks", keep_depth=2)
    assert set(hier.blocks) == {"(top)", "row_skew", "col_skew", "col_0", "col_1", "col_0.pe_0", "col_0.pe_1",
                                "col_1.pe_0", "col_1.pe_1"}
    for res in ("lut", "ff", "dsp", "bram36", "uram"):
        assert sum(getattr(b, res) for b in hier.blocks.values()) == getattr(hier, res), res
    # A PE: its activation copy, three flag registers (last + 4-bit tag) and its 2F-bit capture register. Only
    # row 0's tags are read (the column drain takes the segment's tag there), so a lower row keeps fewer.
    top_pe, low_pe = hier.blocks["col_0.pe_0"], hier.blocks["col_1.pe_1"]
    assert top_pe.dsp == low_pe.dsp == 1
    assert top_pe.ff == 8 + 3 * 5 + 2 * 16
    assert 8 + 3 + 2 * 16 <= low_pe.ff < top_pe.ff
    flat = synthesize(SystolicArray(2, 2, 16), "synth_flat")
    assert flat.dsp == hier.dsp
    assert flat.ff <= hier.ff and flat.lut <= hier.lut
    # The last column's PEs drive nobody to their right: 2 x (8 + 5) activation and flag bits.
    assert hier.ff - flat.ff >= 2 * (8 + 5)
    table = format_breakdown(hier)
    assert table.splitlines()[-1].split()[:3] == ["total", str(hier.lut), str(hier.ff)]
    by_column = group_blocks(hier, 1)
    assert set(by_column) == {"(top)", "row_skew", "col_skew", "col_0", "col_1"}
    assert by_column["col_0"].dsp == 2
    assert sum(g.lut for g in by_column.values()) == hier.lut


def test_block_modules_by_depth():
    il = "\n".join(f"module \\{n}" for n in ("top", "top.a", "top.a.b", "top.a.b.c", "top.d", "other.x"))
    assert block_modules(il, "top", 1) == ["top.a", "top.d"]
    assert block_modules(il, "top", 2) == ["top.a", "top.a.b", "top.d"]
