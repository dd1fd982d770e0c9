"""The AXI4 -> CSR bridge: its transaction model against hand-computed bursts, the constructor's checks, and the
cocotb bench of the RTL against the model (tb/axi_csr/test_axi_csr.py)."""

from types import SimpleNamespace

import pytest
from amaranth.hdl import Fragment

from hdl.axi_csr import HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS, AxiToCsr
from sim.axi_csr import (DECERR, FIXED, INCR, OKAY, SLVERR, WRAP, Burst, RBeat, RegisterFile, beat_addresses,
                         beat_lanes, read_burst, write_burst)
from tb.runner import run


def reg(name, offset, access, reset=0):
    return SimpleNamespace(name=name, offset=offset, access=access, reset=reset)


# A small map: rw words at 0x00..0x0C, a read-only word at 0x10, a command word at 0x14; 0x18.. unmapped.
MAP = [reg("A", 0x00, "rw", 0x11111111), reg("B", 0x04, "rw"), reg("C", 0x08, "rw"), reg("D", 0x0C, "rw"),
       reg("S", 0x10, "ro"), reg("CMD", 0x14, "cmd")]


def regs():
    rf = RegisterFile(MAP)
    rf.set_input("S", 0x5555AAAA)
    return rf


# --- beat addresses (AXI4 A3.4.1) -----------------------------------------------------------------------

def test_beat_addresses():
    # INCR from an unaligned start: the first beat at the start, then size-aligned steps
    assert beat_addresses(Burst(0x1003, 4, 2, INCR)) == [0x1003, 0x1004, 0x1008, 0x100C]
    # WRAP: 4 x 4 bytes from 0x38 wraps at the 16-byte boundary 0x30
    assert beat_addresses(Burst(0x38, 4, 2, WRAP)) == [0x38, 0x3C, 0x30, 0x34]
    assert beat_addresses(Burst(0x70, 2, 4, WRAP)) == [0x70, 0x60]
    assert beat_addresses(Burst(0x6, 3, 1, FIXED)) == [0x6, 0x6, 0x6]
    # byte lanes on a 16-byte bus: unaligned first beat to the end of its container
    assert beat_lanes(Burst(0x1003, 4, 2, INCR), 0x1003) == (3, 3)
    assert beat_lanes(Burst(0x1003, 4, 2, INCR), 0x1004) == (4, 7)
    assert beat_lanes(Burst(0x6, 1, 4, INCR), 0x6) == (6, 15)
    assert beat_lanes(Burst(0x6, 1, 0, INCR, data_bytes=4), 0x6) == (2, 2)


def test_illegal_bursts_raise():
    with pytest.raises(ValueError, match="WRAP burst of 3 beats: AXI4 allows 2, 4, 8 or 16"):
        Burst(0, 3, 2, WRAP)
    with pytest.raises(ValueError, match=r"WRAP burst address 0x2 is not aligned to its size \(4 bytes\)"):
        Burst(2, 4, 2, WRAP)
    with pytest.raises(ValueError, match="FIXED burst of 17 beats: AXI4 allows 1..16"):
        Burst(0, 17, 2, FIXED)
    with pytest.raises(ValueError, match="INCR burst of 257 beats"):
        Burst(0, 257, 0, INCR)
    with pytest.raises(ValueError, match="crosses a 4 KB boundary"):
        Burst(0xFF0, 2, 4, INCR)
    with pytest.raises(ValueError, match="wider than the 16-byte data bus"):
        Burst(0, 1, 5, INCR)
    with pytest.raises(ValueError, match="burst type must be FIXED"):
        Burst(0, 1, 2, 3)
    with pytest.raises(ValueError, match="data bus width must be a power of two from 4 to 128 bytes"):
        Burst(0, 1, 0, INCR, data_bytes=2)
    with pytest.raises(ValueError, match="needs 2 W beats, got 1"):
        write_burst(regs(), Burst(0, 2, 4, INCR), [(0, 0xFFFF)])
    with pytest.raises(ValueError, match="share offset 0x0"):
        RegisterFile([reg("X", 0, "rw"), reg("Y", 0, "ro")])
    with pytest.raises(KeyError, match="no read-only register named 'A'"):
        regs().set_input("A", 1)


# --- writes -----------------------------------------------------------------------------------------------

def test_full_beat_write_splits_into_words():
    rf = regs()
    data = 0x44444444_33333333_22222222_01020304
    assert write_burst(rf, Burst(0x7_0000_0000, 1, 4, INCR, id=0x1234), [(data, 0xFFFF)]) == (0x1234, OKAY)
    assert [rf.values[n] for n in "ABCD"] == [0x01020304, 0x22222222, 0x33333333, 0x44444444]
    assert [a[:4] for a in rf.accesses] == [("w", 0x0, 0x01020304, 0xF), ("w", 0x4, 0x22222222, 0xF),
                                            ("w", 0x8, 0x33333333, 0xF), ("w", 0xC, 0x44444444, 0xF)]


def test_strobes_select_words_and_bytes():
    rf = regs()
    data = 0xDDDDDDDD_CCCCCCCC_BBBBBBBB_AAAAAAAA
    # word 0 bytes 1 and 3, word 2 byte 0; words 1 and 3 untouched (no access at all)
    assert write_burst(rf, Burst(0, 1, 4, INCR), [(data, 0b0000_0001_0000_1010)]) == (0, OKAY)
    assert rf.values["A"] == 0xAA11AA11 and rf.values["B"] == 0 and rf.values["C"] == 0xCC
    assert [(a[1], a[3]) for a in rf.accesses] == [(0x0, 0b1010), (0x8, 0b0001)]
    # all-zero strobes: no access, OKAY even on the read-only and unmapped words
    rf.accesses.clear()
    assert write_burst(rf, Burst(0x10, 2, 4, INCR), [(data, 0), (data, 0)]) == (0, OKAY)
    assert rf.accesses == []


def test_write_response_is_the_worst_of_the_burst():
    rf = regs()
    # beat 1 hits rw A..D (OKAY), beat 2 hits S (ro: SLVERR), CMD (pulse), two unmapped words
    beats = [((1 << 128) - 1, 0xFFFF), (0x00000000_00000000_00000007_00000000, 0xFFFF)]
    assert write_burst(rf, Burst(0x0, 2, 4, INCR, id=3), beats) == (3, SLVERR)
    assert rf.values["S"] == 0x5555AAAA and rf.pulses == [("CMD", 7)]
    assert rf.values["D"] == 0xFFFFFFFF


def test_narrow_and_fixed_writes():
    rf = regs()
    # four 1-byte INCR beats from 0x6: lanes 6, 7, 8, 9 of a 16-byte bus
    beats = [(0x5A << 8 * (6 + k), 1 << (6 + k)) for k in range(4)]
    write_burst(rf, Burst(0x6, 4, 0, INCR), beats)
    assert rf.values["B"] == 0x5A5A0000 and rf.values["C"] == 0x00005A5A
    # FIXED: every beat at the same address; the last one wins
    write_burst(rf, Burst(0x0, 3, 2, FIXED), [(k, 0xF) for k in (7, 8, 9)])
    assert rf.values["A"] == 9
    # a narrow transfer on the bus's upper lanes at an address whose container is word 3
    write_burst(rf, Burst(0xE, 1, 1, INCR), [(0xBEEF << 112, 0b11 << 14)])
    assert rf.values["D"] == 0xBEEF0000


def test_wrap_write_order():
    rf = regs()
    # WRAP 4 x 4 bytes from 0x8: words C, D, A, B on a 32-bit bus
    b = Burst(0x8, 4, 2, WRAP, data_bytes=4)
    write_burst(rf, b, [(v, 0xF) for v in (0xC, 0xD, 0xA, 0xB)])
    assert [rf.values[n] for n in "ABCD"] == [0xA, 0xB, 0xC, 0xD]
    assert [a[1] for a in rf.accesses] == [0x8, 0xC, 0x0, 0x4]


# --- reads ------------------------------------------------------------------------------------------------

def test_read_beats_lanes_and_responses():
    rf = regs()
    rf.values.update(A=0xA0A0A0A0, B=0xB0B0B0B0, C=0xC0C0C0C0, D=0xD0D0D0D0)
    # full beats: 0x00 (A..D), 0x10 (S, CMD reads 0, two unmapped: SLVERR, lanes zero); the window wraps at 4 KiB
    got = read_burst(rf, Burst(0xABC_0000_0000, 2, 4, INCR, id=9))
    assert got == [RBeat(9, 0xD0D0D0D0_C0C0C0C0_B0B0B0B0_A0A0A0A0, OKAY, False),
                   RBeat(9, 0x5555AAAA, SLVERR, True)]
    # an unaligned full-size read covers its start to the end of the beat: words 1..3 only
    rf.accesses.clear()
    assert read_burst(rf, Burst(0x6, 1, 4, INCR)) == [RBeat(0, 0xD0D0D0D0_C0C0C0C0_B0B0B0B0_00000000, OKAY, True)]
    assert [a[1] for a in rf.accesses] == [0x4, 0x8, 0xC]
    # a 2-byte read at 0xA: one word (C) on its lanes 8..11
    assert read_burst(rf, Burst(0xA, 1, 1, INCR)) == [RBeat(0, 0xC0C0C0C0 << 64, OKAY, True)]
    # FIXED narrow reads repeat the same word
    assert [b.data for b in read_burst(rf, Burst(0x4, 3, 2, FIXED, data_bytes=4))] == [0xB0B0B0B0] * 3
    # the worst response: DECERR beats SLVERR (not produced by CsrBlock, but the order is the AXI one)
    assert max(OKAY, SLVERR, DECERR) == DECERR


def test_cmd_words_pulse_and_read_zero():
    rf = regs()
    write_burst(rf, Burst(0x14, 1, 2, INCR, data_bytes=4), [(0x0000FF05, 0b0001)])
    write_burst(rf, Burst(0x14, 1, 2, INCR, data_bytes=4), [(0x00000000, 0b1111)])   # zero data: no pulse
    assert rf.pulses == [("CMD", 0x05)]
    assert read_burst(rf, Burst(0x14, 1, 2, INCR, data_bytes=4)) == [RBeat(0, 0, OKAY, True)]


# --- the RTL --------------------------------------------------------------------------------------------

def test_constructor_checks():
    assert (HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS) == (40, 128, 16)
    bridge = AxiToCsr()
    assert (bridge.addr_bits, bridge.data_bits, bridge.id_bits) == (40, 128, 16)
    Fragment.get(bridge, None)                # elaborates
    with pytest.raises(ValueError, match=r"AxiToCsr data_bits must be a power of two from 32 to 1024, not 96"):
        AxiToCsr(data_bits=96)
    with pytest.raises(ValueError, match=r"AxiToCsr data_bits must be 32..1024, not 16"):
        AxiToCsr(data_bits=16)
    with pytest.raises(ValueError, match=r"AxiToCsr addr_bits must be 12..64, not 11"):
        AxiToCsr(addr_bits=11)
    with pytest.raises(ValueError, match=r"AxiToCsr id_bits must be 1..32, not 0"):
        AxiToCsr(id_bits=0)
    with pytest.raises(TypeError, match=r"AxiToCsr id_bits must be an integer, not True"):
        AxiToCsr(id_bits=True)


def _bench(seed, addr_bits=HPM0_ADDR_BITS, data_bits=HPM0_DATA_BITS, id_bits=HPM0_ID_BITS):
    from tb.axi_csr import CsrBridgeTop
    run(CsrBridgeTop(addr_bits=addr_bits, data_bits=data_bits, id_bits=id_bits), toplevel="csr_bridge",
        build_name=f"csr_bridge_a{addr_bits}_d{data_bits}_i{id_bits}", test_module="tb.axi_csr.test_axi_csr",
        extra_env={"SEED": str(seed), "ADDR_BITS": str(addr_bits), "DATA_BITS": str(data_bits),
                   "ID_BITS": str(id_bits)})


@pytest.mark.parametrize("seed", [0, 1])
def test_bridge_bench_hpm0(seed):
    _bench(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_bridge_bench_hpm0_more_seeds(seed):
    _bench(seed)


@pytest.mark.slow
@pytest.mark.parametrize("widths", [(32, 32, 4), (40, 64, 1), (49, 256, 12)])
def test_bridge_bench_other_widths(widths):
    _bench(5, *widths)
