"""The memory maps (`hdl.memory_map`) against the K26's facts, and where the packer places E4B in them."""

import dataclasses

import numpy as np
import pytest

from firmware.pack import REGION_ORDER, pack, region_map
from hdl.config import HardwareConfig
from hdl.isa import DESC_BYTES, DescKind
from hdl.memory_map import BANK_BYTES, MEMORY_MAPS, MemoryMap, Window, memory_map
from sim.config import ModelConfig

# linux-xlnx zynqmp-sm-k26-revA.dts: two 2 GiB banks; the PMU firmware's reserved MiB at 0x7FF0_0000.
K26_BANKS = ((0x0, 0x8000_0000), (0x8_0000_0000, 0x8_8000_0000))
PMU = (0x7FF0_0000, 0x8000_0000)


def test_kv260_map_fits_the_k26_with_linux():
    mm = MEMORY_MAPS["kv260"]
    for w in mm.windows:
        assert any(lo <= w.base and w.end <= hi for lo, hi in K26_BANKS), f"{w.name} leaves its bank"
        assert w.end <= PMU[0] or w.base >= PMU[1], f"{w.name} overlaps the PMU's reserved memory"
        assert w.size <= BANK_BYTES
    assert {w.base >> 35 for w in mm.windows} == {0, 1}, "one window in each bank"
    assert mm.total <= 2.5e9, "the NPU takes at most 2.5 GB"
    assert 4 * 2**30 - mm.total >= 1.5e9, "Linux keeps at least 1.5 GB"
    assert (mm.csr_base, mm.csr_size, mm.irq_spi) == (0xA000_0000, 0x1000, 89)     # HPM0 window, pl_ps_irq0[0]
    assert mm.ple_staged


def test_map_validation():
    with pytest.raises(ValueError, match=r"window 'w': base must be a non-negative multiple of 4 KiB, not 4097"):
        Window("w", 4097, 4096)
    with pytest.raises(ValueError, match="window 'w' is empty"):
        Window("w", 0, 0)
    with pytest.raises(ValueError, match="windows 'a' and 'b' overlap"):
        MemoryMap("m", (Window("a", 0, 8192), Window("b", 4096, 4096)))
    with pytest.raises(ValueError, match="window names repeat"):
        MemoryMap("m", (Window("a", 0, 4096), Window("a", 8192, 4096)))
    with pytest.raises(ValueError, match="unknown memory map 'zcu104'; choose one of: flat, kv260"):
        memory_map("zcu104")
    assert memory_map("kv260") is MEMORY_MAPS["kv260"]


@pytest.fixture(scope="module")
def e4b_kv260():
    cfg = ModelConfig.preset("e4b")
    return cfg, pack(cfg, None, HardwareConfig.preset("kv260"), max_positions=4096, fill=False,
                     memory_map="kv260")


def test_e4b_with_4096_positions_fits_the_kv260_map(e4b_kv260):
    cfg, image = e4b_kv260
    mm = MEMORY_MAPS["kv260"]
    assert image.ddr.size <= 2.5e9                       # measured: 2,236.8 MiB = 2.345 GB
    for name in REGION_ORDER:
        for addr, n in image.pieces[name]:
            w = mm.window_of(addr, n)
            assert w is not None, f"{name} piece at {addr:#x} ({n} bytes) lies in no single window"
    assert len({mm.window_of(a).name for a, _ in image.pieces["WEIGHTS"]}) == 2, "WEIGHTS uses both banks"
    assert image.region("WEIGHTS")[0] == min(a for a, _ in image.pieces["WEIGHTS"])
    # The PLE table stays on the host: a staged row per token of a prefill program (a WGEMM token tile: the
    # GEMV engine's four vectors) in DDR, each slot its own one-row descriptor, the table's shape kept.
    ple = image.tensors["embed_tokens_per_layer.weight"]
    rows, cols = cfg.vocab_size_per_layer_input, cfg.num_hidden_layers * cfg.hidden_size_per_layer_input
    slots = HardwareConfig.preset("kv260").gemm_tile
    assert ple.staged and ple.shape == (rows, cols) and ple.nbytes == slots * cols // 2
    assert image.host_tables["embed_tokens_per_layer.weight"].data.shape == (rows, cols // 2 + cols // 128 * 2)
    descs = [d for d in image.descriptors if d.tensor == "embed_tokens_per_layer.weight"]
    assert [(d.row_start, d.rows) for d in descs] == [(t, 1) for t in range(slots)] and image.staging_slots == 4
    assert [d.weight_offset - descs[0].weight_offset for d in descs] == [t * cols // 2 for t in range(slots)]
    text = region_map(image)
    assert "npu_hi" in text and "npu_lo" in text and "NPU-side total: 2,236.8 MiB" in text


def test_descriptors_address_their_tensors_in_every_window(e4b_kv260):
    """WEIGHTS_BASE + a descriptor's offsets is where the packer put the tensor's bytes and scales, in the window
    that holds them, for every INT4 descriptor (row chunks included) and the KV slots' V-plane scales."""
    _, image = e4b_kv260
    mm = MEMORY_MAPS["kv260"]
    wbase = image.region("WEIGHTS")[0]
    table = image.view("DESC", 0, len(image.descriptors) * DESC_BYTES).view("<u8").reshape(-1, 4)
    for d in image.descriptors:
        assert table[d.index, 0] == d.weight_offset and table[d.index, 1] == d.scale_offset
        if d.kind != DescKind.INT4:
            continue
        e = image.tensors[d.tensor]
        pcols, groups = d.cols + d.cols % 2, -(-d.cols // d.group)
        at = wbase + d.weight_offset
        assert mm.window_of(at, d.rows * pcols // 2) is not None
        assert at == wbase + e.offset + d.row_start * pcols // 2
        assert mm.window_of(wbase + d.scale_offset, d.rows * groups * 2) is not None


def test_a_map_too_small_is_one_clear_error():
    small = dataclasses.replace(MEMORY_MAPS["kv260"], windows=(Window("npu_hi", 0x8_0000_0000, 1 << 30),
                                                               Window("npu_lo", 0x6000_0000, 256 << 20)))
    with pytest.raises(ValueError, match=r"memory map 'kv260': a WEIGHTS tensor \([\d,]+ bytes\) "
                                         r"fits in no window \(bytes left: npu_hi [\d,]+, npu_lo [\d,]+\)"):
        pack(ModelConfig.preset("e4b"), None, HardwareConfig.preset("kv260"), max_positions=4096, fill=False,
             memory_map=small)


def test_flat_map_keeps_one_contiguous_image():
    image = pack(ModelConfig.preset("tiny"), None, HardwareConfig.preset("tiny"), fill=False)
    assert [(p.window, p.base, p.ddr_offset) for p in image.windows] == [("ddr", 0, 0)]
    bases = [image.region(r) for r in REGION_ORDER]
    assert bases[0][0] == 0 and all(b + s == nb for (b, s), (nb, _) in zip(bases, bases[1:]))
    assert not image.host_tables and np.all(image.ddr[image.region("WEIGHTS")[0]:][:16] == 0)
