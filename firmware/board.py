"""The NPU on the KV260, driven from Linux user space: CSRs and interrupt through UIO, DDR windows through
u-dma-buf.

`Kv260Device` is the device (`firmware.runtime.NpuDevice`) that the host runtime drives on the board:

>>> with Kv260Device() as dev:
...     backend = CsrBackend(dev)

`UioCsr` is its CSR and interrupt half alone (UIO discovery, the CSR page, the interrupt protocol), which
other designs with the NPU's outside shape use as well (the DDR probe's host tool, `firmware.ddrprobe`).

What it opens (the app's overlay and the board's reserved memory: docs/kv260.md):

- The CSR window and the interrupt: the overlay's ``generic-uio`` node, bound to ``uio_pdrv_genirq``.
  ``/sys/class/uio/uioN/name`` is the node's name (``npu``). ``maps/map0/{addr,size,offset}`` (hex) is its
  ``reg``, which must be the memory map's CSR window. An mmap of ``/dev/uioN`` at file offset 0 maps map 0
  (offset N * pagesize would select map N). Each register access is a single native 32-bit load or store on
  that mapping (`struct` ``"@I"``: one aligned ``memcpy`` of 4 bytes), so the HPM0 port sees one 32-bit
  AXI-Lite transfer; nothing is cached in Python. The interrupt is level-triggered. The driver disables it
  in its handler, writing the 4-byte word 1 to ``/dev/uioN`` enables it again, and a 4-byte ``read()``
  blocks until the next interrupt and returns the interrupt count.
- DDR: one u-dma-buf per window of the memory map, named after the window. ``/dev/<name>`` is mmapped;
  ``/sys/class/u-dma-buf/<name>/phys_addr`` (hex) and ``size`` (decimal) say where the buffer is.
  `windows` holds these actual ranges. The runtime places the image by them, so a buffer that the kernel
  put elsewhere than the map's window is relocated rather than refused. A buffer must be at least as large
  as the map's window.

Cache maintenance. The buffers are opened without ``O_SYNC``, so they are mapped cached and a 2.3 GB image
is written at memory speed. The HP ports do not snoop the CPU caches. After every host write the written
range is cleaned with ``sync_for_device`` (direction DMA_TO_DEVICE); before every host read the range is
invalidated with ``sync_for_cpu`` (DMA_FROM_DEVICE). Each sync is one write of u-dma-buf's packed command
word, ``offset << 32 | size | direction << 2 | 1``. Its size field is bits 31:4, so a range is synced from
its start rounded down to 16 bytes to its end rounded up to 16 bytes. Offsets are 32 bits wide, so a synced
buffer can be at most 4 GiB. There is no sync when ``dma_coherent`` reads 1 or the buffers were opened with
``o_sync=True``, because then the mapping is already coherent or uncached.

Large writes are copied in chunks of `CHUNK_BYTES`, each synced as soon as it is written. The source is
never copied as a whole. bytes, bytearray, memoryview and NumPy uint8 arrays, including `numpy.memmap` of
the image file, are read through one `memoryview`.

Every "nothing here" condition raises `BoardUnavailable`, with one line that names what is missing and how
to fix it. Command-line tools turn it into an exit-2 message. A missing UIO device, a UIO device at another
address, a missing or too small u-dma-buf, a wrong ID and a VERSION this firmware has no preset for all
raise it.
"""

from __future__ import annotations

import mmap
import os
import re
import select
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hdl import csr_map
from hdl.config import PRESETS, HardwareConfig
from hdl.memory_map import MemoryMap, Window
from hdl.memory_map import memory_map as resolve_memory_map

__all__ = ["Kv260Device", "UioCsr", "BoardUnavailable", "APP_NAME", "LOAD_APP", "CHUNK_BYTES", "SYNC_ALIGN",
           "SYNC_TO_DEVICE", "SYNC_FROM_DEVICE", "sync_command"]

APP_NAME = "gemma3n-npu"
LOAD_APP = f"load the app: sudo xmutil loadapp {APP_NAME}"
SETUP_DOC = "docs/kv260.md"
REBUILD = (f"rebuild the bitstream for this firmware version (python -m hdl.build --hw kv260; {SETUP_DOC}) "
           f"or run the firmware it was built with")

CHUNK_BYTES = 16 << 20          # bytes copied (and synced) per step of a large host write
SYNC_ALIGN = 16                 # u-dma-buf's sync command carries the size in bits 31:4
SYNC_TO_DEVICE, SYNC_FROM_DEVICE = 1, 2     # u-dma-buf sync directions (DMA_TO_DEVICE, DMA_FROM_DEVICE)

_WORD = struct.Struct("@I")     # native and aligned: one 32-bit load or store, never four byte accesses
_IRQ_WORD = struct.Struct("@i")  # what /dev/uioN reads and writes: a native s32


class BoardUnavailable(RuntimeError):
    """No usable NPU here: no board, the app is not loaded, the reserved memory is missing, or the bitstream
    does not match this firmware. The message is one line that says what to do."""


def sync_command(offset: int, nbytes: int, direction: int) -> tuple[int, int, int]:
    """The u-dma-buf packed sync command that covers ``[offset, offset + nbytes)`` of a buffer. Returns
    ``(word, start, size)``: the word to write to ``sync_for_cpu`` or ``sync_for_device``, and the range it
    syncs (`SYNC_ALIGN`-rounded)."""
    start = offset - offset % SYNC_ALIGN
    size = -(-(offset + nbytes) // SYNC_ALIGN) * SYNC_ALIGN - start
    if not 0 <= start < 1 << 32 or not 0 < size <= 0xFFFF_FFF0:
        raise ValueError(f"a u-dma-buf sync covers a 32-bit offset and 16 B to 4 GiB - 16 B, not "
                         f"{nbytes} bytes at offset {offset:#x}")
    return start << 32 | size | direction << 2 | 1, start, size


@dataclass
class _Buffer:
    """One u-dma-buf, mapped."""

    window: Window              # its actual physical range
    device: Path                # /dev/<name>
    sysfs: Path                 # /sys/class/u-dma-buf/<name>
    mm: mmap.mmap
    sync_fds: dict[str, int]    # "sync_for_device" / "sync_for_cpu" -> fd; empty: no sync needed


def _read_attr(path: Path) -> str:
    return path.read_text().strip()


def _parse(path: Path, base: int) -> int:
    text = _read_attr(path)
    try:
        return int(text, base)
    except ValueError:
        raise BoardUnavailable(f"{path} reads {text!r}, expected a {'hexadecimal' if base == 16 else 'decimal'} "
                               f"number") from None


def _uio_sort_key(path: Path):
    m = re.fullmatch(r"uio(\d+)", path.name)
    return (0, int(m.group(1))) if m else (1, path.name)


def _span(lo: int, n: int) -> str:
    return f"[{lo:#x}, {lo + n:#x})"


class UioCsr:
    """A register window and its interrupt through UIO (`uio_pdrv_genirq`): the device named `uio_name`
    under ``<root>/sys/class/uio``, whose map 0 must be the memory map's CSR window.

    Parameters
    ----------
    memory_map : the `hdl.memory_map.MemoryMap` (or its name) whose CSR window the device must map.
    root : the file-system root under which ``sys/class/uio`` and ``dev`` are looked up (``/`` on the board,
        a stand-in tree in tests: `tb.board.make_standin`).
    uio_name : the UIO device's name (the device-tree node name).
    csr : None on the board (the CSR page of ``/dev/uioN`` is mmapped). Otherwise an object with
        ``read32(offset) -> int`` and ``write32(offset, value)`` that performs the accesses. A simulation
        passes its CSR bus here, because a store to a mapped page cannot become a bus transaction.
    irq : None on the board (``/dev/uioN`` is opened). Otherwise an open file descriptor that speaks the UIO
        interrupt protocol (4-byte enable words in, 4-byte counts out), used instead of ``/dev/uioN`` and not
        closed by this object.
    load_hint : what the messages of a missing or foreign device tell the user to do (`LOAD_APP`: load the
        NPU's app).
    what : the design, as messages name it (``"the NPU"``).

    Attributes
    ----------
    memory_map : the `MemoryMap` it was opened with.
    path : the UIO device's node (``<root>/dev/uioN``).
    where : ``"<CSR base> via <path>"``, for messages about register contents.
    """

    def __init__(self, memory_map: str | MemoryMap = "kv260", *, root: str | os.PathLike = "/",
                 uio_name: str = "npu", csr=None, irq: int | None = None, load_hint: str = LOAD_APP,
                 what: str = "the NPU"):
        self.memory_map = resolve_memory_map(memory_map)
        self._root = Path(root)
        self._hint, self._what = load_hint, what
        self._csr = csr
        self._csr_mm: mmap.mmap | None = None
        self._csr_offset = 0
        self._irq_fd: int | None = None
        self._own_irq_fd = False
        self._closed = False
        self.path: Path | None = None
        try:
            self._open(uio_name, irq)
        except BaseException:
            self.close()
            raise

    @property
    def where(self) -> str:
        return f"{self.memory_map.csr_base:#x} via {self.path}"

    def _open(self, uio_name: str, irq: int | None) -> None:
        mm, hint = self.memory_map, self._hint
        cls = self._root / "sys/class/uio"
        found = []
        entry = None
        if cls.is_dir():
            for d in sorted(cls.iterdir(), key=_uio_sort_key):
                try:
                    name = _read_attr(d / "name")
                except OSError:
                    continue
                found.append(f"{d.name} {name!r}")
                if name == uio_name and entry is None:
                    entry = d
        if entry is None:
            have = f"it has {', '.join(found)}" if found else "there is none"
            raise BoardUnavailable(f"no UIO device named {uio_name!r} in {cls} ({have}): {hint}")
        map0 = entry / "maps/map0"
        if not (map0 / "addr").is_file() or not (map0 / "size").is_file():
            raise BoardUnavailable(f"UIO device {entry.name} ({uio_name!r}) has no register window ({map0}): the "
                                   f"overlay's {uio_name} node needs reg = <{mm.csr_base:#x} {mm.csr_size:#x}>; "
                                   f"{hint}")
        addr, size = _parse(map0 / "addr", 16), _parse(map0 / "size", 16)
        offset = _parse(map0 / "offset", 16) if (map0 / "offset").is_file() else 0
        if (addr, size) != (mm.csr_base, mm.csr_size):
            raise BoardUnavailable(f"UIO device {entry.name} ({uio_name!r}) maps {size:#x} bytes at {addr:#x} "
                                   f"({map0}), the memory map {mm.name!r} has the CSR window at {mm.csr_base:#x} "
                                   f"({mm.csr_size:#x} bytes): the loaded overlay is not this firmware's; "
                                   f"{hint}")
        self.path = self._root / "dev" / entry.name
        if irq is not None:
            self._irq_fd = irq
            if self._csr is not None:
                return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:
            raise BoardUnavailable(f"{self.path} does not exist although {entry} does: udev did not create the "
                                   f"device node; {hint}") from None
        except PermissionError:
            raise BoardUnavailable(f"cannot open {self.path}: permission denied; run as root (sudo) or give "
                                   f"the user access with a udev rule ({SETUP_DOC})") from None
        if irq is None:
            self._irq_fd, self._own_irq_fd = fd, True
        if self._csr is None:
            try:
                length = -(-(offset + size) // mmap.PAGESIZE) * mmap.PAGESIZE
                self._csr_mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
                self._csr_offset = offset
            except (OSError, ValueError) as e:
                raise BoardUnavailable(f"cannot map the CSR window of {self.path} ({size:#x} bytes): {e}; "
                                       f"{hint}") from None
            finally:
                if irq is not None:
                    os.close(fd)

    # --- CSRs --------------------------------------------------------------------------------------------

    def _csr_index(self, offset: int) -> int:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset % 4 \
                or not 0 <= offset < self.memory_map.csr_size:
            raise ValueError(f"CSR offset {offset!r} is not a 32-bit word of the {self.memory_map.csr_size:#x}-byte "
                             f"CSR window")
        return self._csr_offset + offset

    def csr_read(self, offset: int) -> int:
        """The 32-bit register at byte `offset` of the CSR window."""
        self._check_open()
        at = self._csr_index(offset)
        if self._csr is not None:
            return int(self._csr.read32(offset))
        return _WORD.unpack_from(self._csr_mm, at)[0]

    def csr_write(self, offset: int, value: int) -> None:
        """Write the 32-bit register at byte `offset` of the CSR window."""
        self._check_open()
        at = self._csr_index(offset)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= 0xFFFF_FFFF:
            raise ValueError(f"CSR value must be a 32-bit unsigned integer, not {value!r} (offset {offset:#x})")
        if self._csr is not None:
            self._csr.write32(offset, int(value))
            return
        _WORD.pack_into(self._csr_mm, at, int(value))

    # --- interrupt ---------------------------------------------------------------------------------------

    def wait_interrupt(self, timeout_s: float | None = None) -> int:
        """Re-enable the interrupt and block until it arrives. Returns the interrupt count (UIO counts every
        interrupt since boot). Raises TimeoutError if none arrives within `timeout_s` seconds."""
        self._check_open()
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"timeout_s must be None or a non-negative number of seconds, not {timeout_s!r}")
        fd = self._irq_fd
        os.write(fd, _IRQ_WORD.pack(1))
        if timeout_s is not None:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                raise TimeoutError(f"no interrupt from {self._what} ({self.path}) within {timeout_s} s")
        word = b""
        while len(word) < 4:
            part = os.read(fd, 4 - len(word))
            if not part:
                raise OSError(f"{self.path} closed while waiting for {self._what}'s interrupt")
            word += part
        return _IRQ_WORD.unpack(word)[0]

    # --- lifetime ----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self._what} device ({self.path or self._root}) is closed")

    def close(self) -> None:
        """Unmap the CSR page and close ``/dev/uioN`` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._csr_mm is not None:
            self._csr_mm.close()
            self._csr_mm = None
        if self._own_irq_fd:
            os.close(self._irq_fd)
        self._irq_fd = None

    def __enter__(self) -> UioCsr:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<UioCsr {'closed' if self._closed else self.where}>"


class Kv260Device:
    """The NPU on the KV260 (`firmware.runtime.NpuDevice`): CSRs and interrupt through UIO (a `UioCsr`), DDR
    through one u-dma-buf per window of the memory map.

    Parameters
    ----------
    memory_map : the `hdl.memory_map.MemoryMap` (or its name) the bitstream and the reserved memory were
        built for: its CSR window, and its windows by name (each one a u-dma-buf ``/dev/<name>``).
    root : the file-system root under which ``sys/class/...`` and ``dev/...`` are looked up (``/`` on the
        board, a stand-in tree in tests: `tb.board.make_standin`).
    uio_name : the UIO device's name (the device-tree node name of the NPU).
    csr : None on the board (the CSR page of ``/dev/uioN`` is mmapped). Otherwise an object with
        ``read32(offset) -> int`` and ``write32(offset, value)`` that performs the accesses. A simulation
        passes its CSR bus here, because a store to a mapped page cannot become a bus transaction.
    irq : None on the board (``/dev/uioN`` is opened). Otherwise an open file descriptor that speaks the UIO
        interrupt protocol (4-byte enable words in, 4-byte counts out), used instead of ``/dev/uioN`` and not
        closed by the device.
    o_sync : open the u-dma-bufs with ``O_SYNC``, so the mapping follows u-dma-buf's ``sync_mode`` (uncached
        by default) and no cache maintenance is done.

    Attributes
    ----------
    hw : the `HardwareConfig` preset whose VERSION word the NPU reports.
    windows : the DDR windows the host may use: each u-dma-buf's actual ``phys_addr`` and ``size``, named and
        ordered as in the memory map.
    memory_map : the `MemoryMap` it was opened with.
    uio : the UIO device's node (``<root>/dev/uioN``).
    coherent : True when no cache maintenance is needed (``dma_coherent``, or ``o_sync``).
    chunk_bytes : bytes copied and synced per step of a large write (`CHUNK_BYTES`).
    """

    chunk_bytes = CHUNK_BYTES

    def __init__(self, memory_map: str | MemoryMap = "kv260", *, root: str | os.PathLike = "/",
                 uio_name: str = "npu", csr=None, irq: int | None = None, o_sync: bool = False):
        self.memory_map = resolve_memory_map(memory_map)
        self._root = Path(root)
        self._uio: UioCsr | None = None
        self._buffers: list[_Buffer] = []
        self._closed = False
        try:
            self._uio = UioCsr(self.memory_map, root=root, uio_name=uio_name, csr=csr, irq=irq)
            self.uio = self._uio.path
            self._open_buffers(o_sync)
            self.hw = self._identify()
        except BaseException:
            self.close()
            raise
        self.windows: tuple[Window, ...] = tuple(b.window for b in self._buffers)
        self.coherent = all(not b.sync_fds for b in self._buffers)

    # --- discovery ---------------------------------------------------------------------------------------

    def _open_buffers(self, o_sync: bool) -> None:
        mm = self.memory_map
        cls = self._root / "sys/class/u-dma-buf"
        missing = []
        for w in mm.windows:
            device, sysfs = self._root / "dev" / w.name, cls / w.name
            lacking = [str(p) for p in (device, sysfs / "phys_addr", sysfs / "size") if not p.exists()]
            if lacking:
                missing.append(f"{w.name} ({', '.join(lacking)})")
        if missing:
            raise BoardUnavailable(f"no u-dma-buf for the NPU's DDR window{'s' if len(missing) > 1 else ''} "
                                   f"{'; '.join(missing)}: install the u-dma-buf module and the reserved memory "
                                   f"({SETUP_DOC})")
        for w in mm.windows:
            device, sysfs = self._root / "dev" / w.name, cls / w.name
            phys, size = _parse(sysfs / "phys_addr", 16), _parse(sysfs / "size", 10)
            if size < w.size:
                raise BoardUnavailable(f"u-dma-buf {w.name} holds {size} bytes ({sysfs / 'size'}), the memory map "
                                       f"{mm.name!r} needs {w.size} ({w.size >> 20} MiB): enlarge its reserved "
                                       f"memory and size ({SETUP_DOC})")
            try:
                actual = Window(w.name, phys, size)
            except ValueError as e:
                raise BoardUnavailable(f"u-dma-buf {w.name} ({sysfs}): {e}") from None
            coherent = o_sync or ((sysfs / "dma_coherent").is_file() and _parse(sysfs / "dma_coherent", 10) == 1)
            if not coherent and size > 1 << 32:
                raise BoardUnavailable(f"u-dma-buf {w.name} holds {size} bytes ({sysfs / 'size'}): its sync "
                                       f"command reaches 4 GiB; split the window ({SETUP_DOC})")
            buf = _Buffer(actual, device, sysfs, None, {})
            self._buffers.append(buf)
            if not coherent:
                for name in ("sync_for_device", "sync_for_cpu"):
                    try:
                        buf.sync_fds[name] = os.open(sysfs / name, os.O_WRONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        raise BoardUnavailable(f"u-dma-buf {w.name} has no {sysfs / name}: install a u-dma-buf "
                                               f"that has it (v4 or later; {SETUP_DOC})") from None
                    except PermissionError:
                        raise BoardUnavailable(f"cannot open {sysfs / name}: permission denied; run as root (sudo) "
                                               f"or give the user access with a udev rule ({SETUP_DOC})") from None
            try:
                fd = os.open(device, os.O_RDWR | os.O_CLOEXEC | (os.O_SYNC if o_sync else 0))
            except PermissionError:
                raise BoardUnavailable(f"cannot open {device}: permission denied; run as root (sudo) or give the "
                                       f"user access with a udev rule ({SETUP_DOC})") from None
            try:
                buf.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as e:
                raise BoardUnavailable(f"cannot map {device} ({size} bytes): {e}; check the u-dma-buf module "
                                       f"({SETUP_DOC})") from None
            finally:
                os.close(fd)

    def _identify(self) -> HardwareConfig:
        where = self._uio.where
        ident = self.csr_read(csr_map.by_name("ID").offset)
        if ident != csr_map.NPU_ID:
            raise BoardUnavailable(f"the NPU's ID register (CSR 0x000 at {where}) reads {ident:#010x}, expected "
                                   f"{csr_map.NPU_ID:#010x} (\"G3N1\"): the programmable logic does not hold the "
                                   f"NPU; {LOAD_APP}")
        version = self.csr_read(csr_map.by_name("VERSION").offset)
        if version & 0xFF != csr_map.ISA_VERSION:
            raise BoardUnavailable(f"the NPU implements ISA version {version & 0xFF} (VERSION reads {version:#010x}), "
                                   f"this firmware ISA version {csr_map.ISA_VERSION}: {REBUILD}")
        words = {name: csr_map.version_word(p.to_dict()) for name, p in PRESETS.items()}
        for name, word in words.items():
            if word == version:
                return PRESETS[name]
        known = ", ".join(f"{name} {word:#010x}" for name, word in words.items())
        raise BoardUnavailable(f"the NPU's VERSION reads {version:#010x}, which no hardware preset of this firmware "
                               f"has ({known}): {REBUILD}")

    # --- CSRs and interrupt (`UioCsr`) -------------------------------------------------------------------

    def csr_read(self, offset: int) -> int:
        """The 32-bit register at byte `offset` of the CSR window (`hdl.csr_map`)."""
        self._check_open()
        return self._uio.csr_read(offset)

    def csr_write(self, offset: int, value: int) -> None:
        """Write the 32-bit register at byte `offset` of the CSR window."""
        self._check_open()
        self._uio.csr_write(offset, value)

    def wait_interrupt(self, timeout_s: float | None = None) -> int:
        """Re-enable the NPU's interrupt and block until it arrives. Returns the interrupt count (UIO counts
        every interrupt since boot). Raises TimeoutError if none arrives within `timeout_s` seconds."""
        self._check_open()
        return self._uio.wait_interrupt(timeout_s)

    # --- DDR ---------------------------------------------------------------------------------------------

    def _buffer(self, addr: int, nbytes: int) -> _Buffer:
        self._check_open()
        if isinstance(addr, bool) or not isinstance(addr, (int, np.integer)) or addr < 0:
            raise ValueError(f"DDR address must be a non-negative integer, not {addr!r}")
        addr = int(addr)
        for b in self._buffers:
            if b.window.holds(addr, nbytes):
                return b
        windows = ", ".join(f"{b.window.name} {_span(b.window.base, b.window.size)}" for b in self._buffers)
        touched = [w.name for w in sorted((b.window for b in self._buffers), key=lambda w: w.base)
                   if addr < w.end and w.base < addr + nbytes]
        what = f"spans windows {' and '.join(touched)}" if len(touched) > 1 else \
            f"runs past the edge of window {touched[0]}" if touched else "is outside every window"
        raise ValueError(f"DDR access {_span(addr, nbytes)} ({nbytes} bytes) {what}; the NPU's windows are "
                         f"{windows}")

    def _sync(self, buf: _Buffer, which: str, offset: int, nbytes: int) -> None:
        fd = buf.sync_fds.get(which)
        if fd is None or nbytes == 0:
            return
        word, _, _ = sync_command(offset, nbytes, SYNC_TO_DEVICE if which == "sync_for_device" else SYNC_FROM_DEVICE)
        try:
            os.write(fd, f"{word:#018x}\n".encode())
        except OSError as e:
            raise OSError(e.errno, f"{buf.sysfs / which}: syncing {nbytes} bytes at offset {offset:#x} failed: "
                                   f"{e.strerror}") from None

    def mem_write(self, addr: int, data) -> None:
        """Write `data` (bytes, bytearray, memoryview, or a C-contiguous NumPy uint8 array, memmaps included) at
        physical byte address `addr`, in chunks of `chunk_bytes`, each followed by ``sync_for_device``."""
        if isinstance(data, np.ndarray) and data.dtype != np.uint8:
            raise TypeError(f"mem_write takes a NumPy uint8 array, not {data.dtype} (pass array.view(np.uint8))")
        try:
            src = memoryview(data)
        except TypeError:
            raise TypeError(f"mem_write takes bytes, bytearray, memoryview or a NumPy uint8 array, not "
                            f"{type(data).__name__}") from None
        if not src.c_contiguous:
            raise ValueError(f"mem_write needs contiguous data; this {type(data).__name__} is strided "
                             f"(pass a contiguous copy of it)")
        src = src.cast("B") if src.ndim != 1 or src.format != "B" else src
        n = src.nbytes
        buf = self._buffer(addr, n)
        base = int(addr) - buf.window.base
        step = max(1, int(self.chunk_bytes))
        for start in range(0, n, step):
            k = min(step, n - start)
            buf.mm[base + start:base + start + k] = src[start:start + k]
            self._sync(buf, "sync_for_device", base + start, k)

    def mem_read(self, addr: int, nbytes: int) -> bytes:
        """`nbytes` bytes at physical byte address `addr`, after ``sync_for_cpu`` over them."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ValueError(f"mem_read needs a non-negative byte count, not {nbytes!r}")
        nbytes = int(nbytes)
        buf = self._buffer(addr, nbytes)
        base = int(addr) - buf.window.base
        step = max(1, int(self.chunk_bytes))
        for start in range(0, nbytes, step):
            self._sync(buf, "sync_for_cpu", base + start, min(step, nbytes - start))
        return buf.mm[base:base + nbytes]

    # --- lifetime ----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the NPU device ({getattr(self, 'uio', self._root)}) is closed")

    def close(self) -> None:
        """Unmap and close everything (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for b in self._buffers:
            if b.mm is not None:
                b.mm.close()
            for fd in b.sync_fds.values():
                os.close(fd)
        self._buffers = []
        if self._uio is not None:
            self._uio.close()

    def __enter__(self) -> Kv260Device:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "<Kv260Device closed>"
        windows = ", ".join(f"{w.name} {_span(w.base, w.size)}" for w in self.windows)
        return f"<Kv260Device {self.hw.name} at {self.uio}, windows {windows}>"
