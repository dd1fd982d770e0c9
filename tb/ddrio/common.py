"""Shared pieces of the DDR stream benches: payload packing, reset, the NumPy references of `DdrReader`."""

from __future__ import annotations

import numpy as np
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge

from hdl.fp import QNAN
from sim.numerics import unpack_int4


def pack(layout, **fields) -> int:
    """The integer of a stream payload with `layout` (an Amaranth StructLayout), from field values."""
    return layout.const(fields).as_bits()


async def reset(dut, cycles: int = 3):
    dut.rst.value = 1
    for _ in range(cycles):
        await FallingEdge(dut.clk)
    dut.rst.value = 0


def canon(bits: np.ndarray) -> np.ndarray:
    """binary32 bits with every NaN replaced by the canonical QNAN the hardware produces."""
    bits = np.asarray(bits, np.uint32)
    return np.where(np.isnan(bits.view(np.float32)), np.uint32(QNAN), bits).astype(np.uint32)


def reader_expected(mem: bytes, addr: int, n: int, fmt: int, saddr: int = 0, log2_group: int = 0, wide: int = 0) \
        -> np.ndarray:
    """What `DdrReader` must produce for a command, from the memory image (NaNs canonical; `wide` changes how,
    not what)."""
    if fmt == 0:
        return np.frombuffer(mem[addr:addr + 4 * n], "<u4").copy()
    if fmt == 1:
        return canon(np.frombuffer(mem[addr:addr + 2 * n], "<f2").astype(np.float32).view(np.uint32))
    q = unpack_int4(np.frombuffer(mem[addr:addr + (n + 1) // 2], np.uint8))[:n]
    groups = -(-n // (1 << log2_group))
    scales = np.frombuffer(mem[saddr:saddr + 2 * groups], "<f2")[np.arange(n) >> log2_group]
    with np.errstate(all="ignore"):
        return canon((q.astype(np.float32) * scales.astype(np.float32)).view(np.uint32))


class HoldMonitor:
    """Counts, on an AXI channel, the longest run of cycles with ``valid`` high and ``ready`` low."""

    def __init__(self, clock, valid, ready):
        self.clock, self.valid, self.ready = clock, valid, ready
        self.longest = 0

    async def run(self):
        run = 0
        while True:
            await RisingEdge(self.clock)
            await ReadOnly()
            if int(self.valid.value) and not int(self.ready.value):
                run += 1
                self.longest = max(self.longest, run)
            else:
                run = 0
