"""Where the NPU's memory lives on a board: the reserved DDR windows, the CSR window and the interrupt.

Pure Python (no Amaranth), shared by the packer (`firmware.pack` places every region in a window), the
runtimes (`firmware.runtime`, the board device), the full-chip bench (its DDR model has exactly these
windows) and the build (`hdl.kria` writes the reserved memory and the overlay from it).

A `MemoryMap` is a tuple of `Window`s: physical byte ranges the host reserves for the NPU (on the KV260:
``reserved-memory`` nodes in the board's device tree, each shared with user space through a u-dma-buf). No
region of the image may span two windows, except WEIGHTS, which the packer splits at tensor boundaries:
the descriptors address it by 64-bit offsets from WEIGHTS_BASE, so its pieces may lie in any window above
the first one. Addresses are the HP ports' 40-bit physical addresses.

Maps:

``flat``   one window at 0 as large as the address space: the simulation benches' layout, where the
           image is one contiguous array (the host adds its DDR base).
``kv260``  the K26 SOM with Linux running (docs/kv260.md): its 4 GiB of DDR are two 2 GiB banks,
           ``0x0_0000_0000`` and ``0x8_0000_0000`` (linux-xlnx ``zynqmp-sm-k26-revA.dts``); the PMU
           firmware owns ``0x7FF0_0000`` (1 MiB). The NPU takes 1,856 MiB of the high bank and 496 MiB at
           the top of the low bank (2,352 MiB, 2.466 GB), Linux keeps 1,744 MiB (1.83 GB), the low 1.5 GiB
           of which holds the kernel and Kria Ubuntu's 1,000 MiB CMA pool. E4B with ``max_positions``
           4,096 needs 2,238 MiB of it with its PLE table staged (``python -m firmware.pack --plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Window", "MemoryMap", "MEMORY_MAPS", "memory_map", "BANK_BYTES"]

BANK_BYTES = 2 << 30            # one K26 DDR bank: the most contiguous memory any window can be


@dataclass(frozen=True)
class Window:
    """A physical byte range reserved for the NPU.

    Parameters
    ----------
    name : the window's name (the u-dma-buf device name on the board: ``/dev/<name>``).
    base : physical byte address (4 KiB aligned).
    size : bytes (a multiple of 4 KiB).
    """

    name: str
    base: int
    size: int

    def __post_init__(self):
        for field in ("base", "size"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v % 4096:
                raise ValueError(f"window {self.name!r}: {field} must be a non-negative multiple of 4 KiB, "
                                 f"not {v!r}")
        if self.size == 0:
            raise ValueError(f"window {self.name!r} is empty")

    @property
    def end(self) -> int:
        return self.base + self.size

    def holds(self, addr: int, nbytes: int = 1) -> bool:
        return self.base <= addr and addr + nbytes <= self.end


@dataclass(frozen=True)
class MemoryMap:
    """The NPU's place in a system's address space.

    Parameters
    ----------
    name : the map's name (``--memory-map``).
    windows : the DDR windows, in the order the packer fills them.
    csr_base, csr_size : the CSR window on the PS's HPM0 port (`hdl.csr_map`).
    irq_spi : the GIC shared peripheral interrupt of the NPU's interrupt line (pl_ps_irq0[0] is SPI 89).
    ple_staged : the per-layer embedding table stays on the host (a file on the board's storage); the host
        stages the token's row in DDR before every START (`firmware.pack`, "PLE staging").
    """

    name: str
    windows: tuple[Window, ...]
    csr_base: int = 0
    csr_size: int = 4096
    irq_spi: int = 89
    ple_staged: bool = False

    def __post_init__(self):
        if not self.windows:
            raise ValueError(f"memory map {self.name!r} has no window")
        names = [w.name for w in self.windows]
        if len(set(names)) != len(names):
            raise ValueError(f"memory map {self.name!r}: window names repeat: {names}")
        spans = sorted((w.base, w.end, w.name) for w in self.windows)
        for (_, end, a), (base, _, b) in zip(spans, spans[1:]):
            if base < end:
                raise ValueError(f"memory map {self.name!r}: windows {a!r} and {b!r} overlap")

    def window(self, name: str) -> Window:
        for w in self.windows:
            if w.name == name:
                return w
        raise KeyError(f"memory map {self.name!r} has no window {name!r} (it has "
                       f"{', '.join(w.name for w in self.windows)})")

    def window_of(self, addr: int, nbytes: int = 1) -> Window | None:
        """The window holding ``[addr, addr + nbytes)``, or None."""
        return next((w for w in self.windows if w.holds(addr, nbytes)), None)

    @property
    def total(self) -> int:
        return sum(w.size for w in self.windows)


MEMORY_MAPS: dict[str, MemoryMap] = {
    "flat": MemoryMap("flat", (Window("ddr", 0, 1 << 40),)),
    "kv260": MemoryMap("kv260", (Window("npu_hi", 0x8_0000_0000, 0x7400_0000),
                                 Window("npu_lo", 0x0_6000_0000, 0x1F00_0000)),
                       csr_base=0xA000_0000, csr_size=0x1000, irq_spi=89, ple_staged=True),
}


def memory_map(name: str | MemoryMap) -> MemoryMap:
    """The map called `name` (a `MemoryMap` passes through)."""
    if isinstance(name, MemoryMap):
        return name
    try:
        return MEMORY_MAPS[name]
    except KeyError:
        raise ValueError(f"unknown memory map {name!r}; choose one of: {', '.join(MEMORY_MAPS)}") from None
