"""A stand-in KV260 in a directory: the sysfs files and ``/dev`` entries `firmware.board.Kv260Device` reads
(`make_standin`), and the DDR behind them as one physical address space (`StandinBoard.memory`)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hdl.memory_map import MemoryMap, Window, memory_map as resolve_memory_map

from .csr import CsrLink
from .interrupt import PtyInterrupt

__all__ = ["make_standin", "StandinBoard", "SyncRecord", "decode_sync", "SYNC_FILES"]

SYNC_FILES = ("sync_for_device", "sync_for_cpu")


@dataclass(frozen=True)
class SyncRecord:
    """One u-dma-buf sync command: the buffer range ``[offset, offset + size)`` and its direction (0:
    bidirectional, 1: to device, 2: from device)."""

    offset: int
    size: int
    direction: int

    @property
    def end(self) -> int:
        return self.offset + self.size


def decode_sync(text: str) -> SyncRecord:
    """Decode a value written to ``sync_for_cpu``/``sync_for_device`` (the ikwzm/u-dma-buf README's packed
    form: ``offset`` in bits 63:32, ``size`` in bits 31:4, ``direction`` in bits 3:2, bit 0 set)."""
    word = int(text, 0)
    if not word & 1 or not word >> 1:
        raise ValueError(f"{text!r} is not a packed u-dma-buf sync command (bit 0 set and a range)")
    return SyncRecord(word >> 32, word & 0xFFFF_FFF0, word >> 2 & 3)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


class StandinBoard:
    """What `make_standin` built.

    Attributes
    ----------
    root : pass as ``Kv260Device(root=...)``.
    memory_map : the map the tree was built for.
    windows : the u-dma-bufs' physical windows (after ``phys_addrs`` and ``sizes``), by name.
    uio : ``<root>/dev/uio<N>``, a symbolic link to the interrupt's pty slave (None: no UIO device).
    interrupt : the `PtyInterrupt` behind ``uio`` (None without a UIO device).
    csr : a `CsrLink` to pass as ``Kv260Device(csr=...)`` when a simulation serves the CSRs.
    """

    def __init__(self, root: Path, memory_map: MemoryMap, windows: dict[str, Window], uio: Path | None,
                 interrupt: PtyInterrupt | None):
        self.root, self.memory_map, self.windows = root, memory_map, windows
        self.uio, self.interrupt = uio, interrupt
        self.csr = CsrLink()

    def device_file(self, name: str) -> Path:
        """``<root>/dev/<name>``: the DDR behind window `name` (a sparse file of the window's size)."""
        return self.root / "dev" / name

    def sysfs(self, name: str) -> Path:
        """``<root>/sys/class/u-dma-buf/<name>``."""
        return self.root / "sys/class/u-dma-buf" / name

    def syncs(self, name: str, which: str) -> list[SyncRecord]:
        """Every sync command written to window `name`'s `which` file (``sync_for_device`` or
        ``sync_for_cpu``), in order."""
        if which not in SYNC_FILES:
            raise ValueError(f"which must be one of {', '.join(SYNC_FILES)}, not {which!r}")
        text = (self.sysfs(name) / which).read_text()
        return [decode_sync(line) for line in text.split()]

    def memory(self):
        """The DDR as the NPU sees it: a `tb.npu.bench.WindowedMemory` with every ``dev/<name>`` mapped at its
        window's physical base (the bench's ``mem=``; `buffers` for `tb.npu.bench.NpuBench`'s ``backing=``)."""
        from tb.npu.bench import WindowedMemory
        return WindowedMemory(tuple(self.windows.values()), self.buffers())

    def buffers(self) -> dict:
        """Window name -> a shared mapping of ``dev/<name>`` (what the host's writes land in)."""
        out = {}
        for name, w in self.windows.items():
            with open(self.device_file(name), "r+b") as f:
                out[name] = mmap.mmap(f.fileno(), w.size)
        return out

    def close(self) -> None:
        self.csr.close()
        if self.interrupt is not None:
            self.interrupt.close()

    def __enter__(self) -> StandinBoard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_standin(root: str | os.PathLike, memory_map: str | MemoryMap = "kv260", *,
                 csr_map_base: int | None = None, csr_map_size: int | None = None, uio_name: str = "npu",
                 uio_index: int = 0, uio: bool = True, udmabufs: Iterable[str] | None = None,
                 phys_addrs: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None,
                 dma_coherent: bool = False) -> StandinBoard:
    """Build under `root` the files `firmware.board.Kv260Device` reads on a KV260 with the app loaded.

    - ``sys/class/uio/uio<N>/name`` (`uio_name`), ``version``, ``event`` and ``maps/map0/{name,addr,size,
      offset}``: the CSR window at `csr_map_base`/`csr_map_size` (default: the memory map's), in the formats
      of ``drivers/uio/uio.c``. ``dev/uio<N>`` is a symbolic link to a `PtyInterrupt`'s slave end.
    - for every window in `udmabufs` (default: all of the map's), ``sys/class/u-dma-buf/<name>/`` with
      ``phys_addr`` (hex, as ``%pad``), ``size`` (decimal), ``dma_coherent``, ``sync_mode``,
      ``sync_offset``, ``sync_size``, ``sync_direction`` and ``sync_owner`` as the driver initialises them.
      ``sync_for_device`` and ``sync_for_cpu`` are empty regular files that collect what the device writes
      (`StandinBoard.syncs`). ``dev/<name>`` is a sparse regular file of the buffer's size: the DDR. A
      simulated NPU maps the same files (`StandinBoard.memory`), so what the host writes is what it reads.

    `phys_addrs` and `sizes` override a window's physical base and size (by name). `uio` False leaves the
    UIO device out.
    """
    mm = resolve_memory_map(memory_map)
    root = Path(root)
    phys_addrs, sizes = dict(phys_addrs or {}), dict(sizes or {})
    names = [w.name for w in mm.windows] if udmabufs is None else list(udmabufs)
    for name in [*names, *phys_addrs, *sizes]:
        mm.window(name)         # raises KeyError naming the map's windows
    (root / "dev").mkdir(parents=True, exist_ok=True)
    (root / "sys/class/u-dma-buf").mkdir(parents=True, exist_ok=True)

    uio_path = interrupt = None
    if uio:
        base = mm.csr_base if csr_map_base is None else csr_map_base
        size = mm.csr_size if csr_map_size is None else csr_map_size
        d = root / f"sys/class/uio/uio{uio_index}"
        _write(d / "name", f"{uio_name}\n")
        _write(d / "version", "devicetree\n")
        _write(d / "event", "0\n")
        _write(d / "maps/map0/name", f"{uio_name}@{base:x}\n")
        _write(d / "maps/map0/addr", f"0x{base:016x}\n")
        _write(d / "maps/map0/size", f"0x{size:016x}\n")
        _write(d / "maps/map0/offset", "0x0\n")
        interrupt = PtyInterrupt()
        uio_path = root / f"dev/uio{uio_index}"
        uio_path.symlink_to(interrupt.slave_path)

    windows = {}
    for name in names:
        w = mm.window(name)
        w = Window(name, phys_addrs.get(name, w.base), sizes.get(name, w.size))
        d = root / "sys/class/u-dma-buf" / name
        _write(d / "phys_addr", f"0x{w.base:016x}\n")
        _write(d / "size", f"{w.size}\n")
        _write(d / "dma_coherent", f"{int(dma_coherent)}\n")
        _write(d / "sync_mode", "1\n")
        _write(d / "sync_offset", "0x0\n")
        _write(d / "sync_size", "0\n")
        _write(d / "sync_direction", "0\n")
        _write(d / "sync_owner", "0\n")
        for which in SYNC_FILES:
            _write(d / which, "")
        with open(root / "dev" / name, "wb") as f:
            f.truncate(w.size)
        windows[name] = w
    return StandinBoard(root, mm, windows, uio_path, interrupt)
