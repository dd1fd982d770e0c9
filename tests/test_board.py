"""The on-board device layer (`firmware.board.Kv260Device` and its UIO half, `firmware.board.UioCsr`) on
stand-in trees (`tb.board.make_standin`): discovery and its error messages, address translation across the
KV260's windows, cache syncs, the UIO interrupt through a pty, chunked writes, and the CSR paths (register
file, simulation link, mmap).

The CSRs are a `tb.board.RegisterFile` (the CSR map's access semantics). Its read-only registers hold values
the tests set from independent constants (`csr_map.NPU_ID`, `csr_map.version_word` of a preset), so the
device's logic is under test and not the NPU's.
"""

import asyncio
import os
import re
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest

from firmware.board import BoardUnavailable, Kv260Device, UioCsr, sync_command
from hdl import csr_map
from hdl.config import PRESETS, HardwareConfig
from hdl.memory_map import MEMORY_MAPS, MemoryMap, Window
from tb.board import CsrLink, RegisterFile, decode_sync, make_standin

KV260 = MEMORY_MAPS["kv260"]
HI, LO = KV260.window("npu_hi"), KV260.window("npu_lo")
ID, VERSION = csr_map.by_name("ID").offset, csr_map.by_name("VERSION").offset


def registers(preset: str = "tiny", ident: int = csr_map.NPU_ID, version: int | None = None) -> RegisterFile:
    regs = RegisterFile()
    regs.set("ID", ident)
    regs.set("VERSION", csr_map.version_word(HardwareConfig.preset(preset).to_dict()) if version is None
             else version)
    return regs


@pytest.fixture
def board(tmp_path):
    with make_standin(tmp_path) as b:
        yield b


@pytest.fixture
def device(board):
    with Kv260Device(root=board.root, csr=registers()) as dev:
        yield dev


def backing(board, name: str, offset: int, nbytes: int) -> bytes:
    """Bytes of window `name`'s DDR file, read without the device."""
    with open(board.device_file(name), "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- discovery ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_discovery_identifies_the_preset(board, preset):
    regs = registers(preset)
    with Kv260Device("kv260", root=board.root, csr=regs) as dev:
        assert dev.hw is PRESETS[preset]
        assert dev.windows == KV260.windows
        assert dev.uio == board.root / "dev/uio0"
        assert not dev.coherent
    # ID before VERSION, nothing else, and no access the RTL would refuse
    assert regs.accesses == [("read", ID, csr_map.NPU_ID),
                             ("read", VERSION, csr_map.version_word(PRESETS[preset].to_dict()))]
    assert regs.errors == []


def test_relocated_buffers_are_recorded(tmp_path):
    # The kernel may place a u-dma-buf elsewhere than the map's window, or make it larger: not an error,
    # the runtime relocates by `windows`.
    with make_standin(tmp_path, phys_addrs={"npu_lo": 0x5000_0000}, sizes={"npu_hi": HI.size + (1 << 20)}) as b, \
            Kv260Device(root=b.root, csr=registers()) as dev:
        assert dev.windows == (Window("npu_hi", HI.base, HI.size + (1 << 20)), Window("npu_lo", 0x5000_0000, LO.size))
        dev.mem_write(0x5000_0000 + 64, b"relocated")
        assert backing(b, "npu_lo", 64, 9) == b"relocated"


def test_discovery_picks_the_named_uio_device(tmp_path):
    # Other UIO devices (the Kria's axi-pmon, ...) come first; the NPU is the one named npu.
    b = make_standin(tmp_path, uio_index=3)
    for i, name in ((0, "axi-pmon"), (1, "zynqmp-sysmon")):
        (tmp_path / f"sys/class/uio/uio{i}").mkdir(parents=True)
        (tmp_path / f"sys/class/uio/uio{i}/name").write_text(f"{name}\n")
    with b, Kv260Device(root=tmp_path, csr=registers()) as dev:
        assert dev.uio == tmp_path / "dev/uio3"


LOAD = re.escape("load the app: sudo xmutil loadapp gemma3n-npu")
INSTALL = re.escape("install the u-dma-buf module and the reserved memory (docs/kv260.md)")
REBUILD = re.escape("rebuild the bitstream for this firmware version")


def other_preset_word() -> int:
    return csr_map.version_word(PRESETS["tiny"].replace(name="tiny", l2_bytes=PRESETS["tiny"].l2_bytes * 2).to_dict())


@pytest.mark.parametrize("standin, regs, message", [
    (dict(uio=False), {}, rf"no UIO device named 'npu' in \S+/sys/class/uio \(there is none\): {LOAD}$"),
    (dict(uio_name="axi-pmon"), {},
     rf"no UIO device named 'npu' in \S+ \(it has uio0 'axi-pmon'\): {LOAD}$"),
    (dict(csr_map_base=0xA001_0000), {},
     rf"UIO device uio0 \('npu'\) maps 0x1000 bytes at 0xa0010000 \(\S+/maps/map0\), the memory map 'kv260' "
     rf"has the CSR window at 0xa0000000 \(0x1000 bytes\): the loaded overlay is not this firmware's; {LOAD}$"),
    (dict(csr_map_size=0x10000), {}, r"maps 0x10000 bytes at 0xa0000000 .*0x1000 bytes"),
    (dict(udmabufs=("npu_hi",)), {},
     rf"no u-dma-buf for the NPU's DDR window npu_lo \(\S+/dev/npu_lo, \S+/phys_addr, \S+/size\): {INSTALL}$"),
    (dict(udmabufs=()), {}, rf"DDR windows npu_hi \(.*\); npu_lo \(.*\): {INSTALL}$"),
    (dict(sizes={"npu_lo": 256 << 20}), {},
     r"u-dma-buf npu_lo holds 268435456 bytes \(\S+/size\), the memory map 'kv260' needs 520093696 \(496 MiB\): "
     r"enlarge its reserved memory and size \(docs/kv260.md\)$"),
    ({}, dict(ident=0xDEAD_BEEF),
     rf"the NPU's ID register \(CSR 0x000 at 0xa0000000 via \S+/dev/uio0\) reads 0xdeadbeef, expected 0x47334e31 "
     rf"\(\"G3N1\"\): the programmable logic does not hold the NPU; {LOAD}$"),
    ({}, dict(version=csr_map.version_word(PRESETS["tiny"].to_dict()) & ~0xFF | csr_map.ISA_VERSION + 1),
     rf"the NPU implements ISA version {csr_map.ISA_VERSION + 1} \(VERSION reads 0x[0-9a-f]{{8}}\), this firmware "
     rf"ISA version {csr_map.ISA_VERSION}: {REBUILD}"),
    ({}, dict(version=other_preset_word()),
     rf"the NPU's VERSION reads {other_preset_word():#010x}, which no hardware preset of this firmware has "
     rf"\(kv260 {csr_map.version_word(PRESETS['kv260'].to_dict()):#010x}, .*\): {REBUILD}"),
], ids=["no-uio", "wrong-name", "map0-elsewhere", "map0-size", "no-udmabuf", "no-udmabufs", "too-small",
        "id-mismatch", "isa-version", "other-preset"])
def test_discovery_errors(tmp_path, standin, regs, message):
    with make_standin(tmp_path, **standin):
        before = open_fds()
        with pytest.raises(BoardUnavailable, match=message) as err:
            Kv260Device(root=tmp_path, csr=registers(**regs))
        assert "\n" not in str(err.value)
        assert open_fds() == before, "a failed construction left descriptors open"


def test_discovery_missing_device_node(board):
    board.uio.unlink()
    with pytest.raises(BoardUnavailable, match=rf"\S+/dev/uio0 does not exist although \S+/uio0 does: .*{LOAD}$"):
        Kv260Device(root=board.root, csr=registers())


def test_discovery_on_a_root_without_any_board(tmp_path):
    # What a laptop sees with root="/": BoardUnavailable, which command-line tools turn into exit 2.
    with pytest.raises(BoardUnavailable, match="no UIO device named 'npu'"):
        Kv260Device(root=tmp_path)


# --- address translation -----------------------------------------------------------------------------------

def test_translation_across_both_windows(board, device):
    rng = np.random.default_rng(7)
    cases = [(HI.base, 4096), (HI.end - 100, 100), (HI.base + 0x1234_5678, 3000), (LO.base, 17), (LO.end - 1, 1)]
    for addr, n in cases:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        device.mem_write(addr, data)
        w = KV260.window_of(addr, n)
        assert backing(board, w.name, addr - w.base, n) == data, hex(addr)
        assert device.mem_read(addr, n) == data
    assert device.mem_read(LO.end, 0) == b""


@pytest.mark.parametrize("addr, n, what", [
    (LO.base - 16, 16, "is outside every window"),
    (LO.end, 1, "is outside every window"),
    (HI.end, 4, "is outside every window"),
    (LO.end - 8, 16, "runs past the edge of window npu_lo"),
    (HI.base - 4, 8, "runs past the edge of window npu_hi"),
    (LO.end - 8, HI.base - LO.end + 16, "spans windows npu_lo and npu_hi"),
])
def test_translation_errors(device, addr, n, what):
    windows = re.escape(f"npu_hi [{HI.base:#x}, {HI.end:#x}), npu_lo [{LO.base:#x}, {LO.end:#x})")
    span = re.escape(f"[{addr:#x}, {addr + n:#x}) ({n} bytes)")
    accesses = [lambda: device.mem_read(addr, n)]
    if n <= 1 << 20:
        accesses.append(lambda: device.mem_write(addr, bytes(n)))
    for access in accesses:
        with pytest.raises(ValueError, match=rf"^DDR access {span} {what}; the NPU's windows are {windows}$"):
            access()


def test_bad_arguments(device):
    with pytest.raises(TypeError, match="not list"):
        device.mem_write(LO.base, [1, 2, 3])
    with pytest.raises(TypeError, match=r"uint8 array, not float32 \(pass array.view\(np.uint8\)\)"):
        device.mem_write(LO.base, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        device.mem_write(LO.base, np.zeros(16, np.uint8)[::2])
    with pytest.raises(ValueError, match="non-negative byte count, not -1"):
        device.mem_read(LO.base, -1)
    with pytest.raises(ValueError, match="not a 32-bit word of the 0x1000-byte CSR window"):
        device.csr_read(0x1000)
    with pytest.raises(ValueError, match="not a 32-bit word"):
        device.csr_write(2, 0)
    with pytest.raises(ValueError, match=r"32-bit unsigned integer, not 4294967296 \(offset 0x18\)"):
        device.csr_write(0x18, 1 << 32)


def test_mem_write_takes_every_buffer_kind(board, device):
    data = bytes(range(256)) * 4
    for i, src in enumerate([data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8),
                             np.frombuffer(data, np.uint8).reshape(32, 32)]):
        device.mem_write(HI.base + i * 4096, src)
        assert backing(board, "npu_hi", i * 4096, len(data)) == data, type(src).__name__


# --- cache maintenance -------------------------------------------------------------------------------------

def test_sync_covers_exactly_the_accessed_range(board, device):
    # u-dma-buf's command holds the size in bits 31:4: the range is widened to 16-byte boundaries, no more.
    device.mem_write(HI.base + 0x1005, bytes(30))
    device.mem_write(LO.base + 0x40, bytes(64))
    device.mem_read(LO.base + 0x7F, 2)
    assert [(r.offset, r.size, r.direction) for r in board.syncs("npu_hi", "sync_for_device")] == [(0x1000, 48, 1)]
    assert [(r.offset, r.size, r.direction) for r in board.syncs("npu_lo", "sync_for_device")] == [(0x40, 64, 1)]
    assert [(r.offset, r.size, r.direction) for r in board.syncs("npu_lo", "sync_for_cpu")] == [(0x70, 32, 2)]
    assert board.syncs("npu_hi", "sync_for_cpu") == []


def test_sync_command_format():
    # The README's example: offset 0, size 0x10000, direction 0, sync bit -> "0x0000000000010001".
    assert sync_command(0, 0x10000, 0)[0] == 0x0000_0000_0001_0001
    assert sync_command(0x7000_0001, 1, 2) == (0x7000_0000 << 32 | 16 | 2 << 2 | 1, 0x7000_0000, 16)
    assert decode_sync(f"{sync_command(0x1234_5678, 100, 1)[0]:#018x}") == decode_sync("0x1234567000000075")


@pytest.mark.parametrize("how", ["dma_coherent", "o_sync"])
def test_no_sync_when_coherent(tmp_path, how):
    with make_standin(tmp_path, dma_coherent=how == "dma_coherent") as b, \
            Kv260Device(root=tmp_path, csr=registers(), o_sync=how == "o_sync") as dev:
        assert dev.coherent
        dev.mem_write(LO.base, b"x" * 100)
        assert dev.mem_read(LO.base, 100) == b"x" * 100
        assert all(b.syncs(n, s) == [] for n in ("npu_hi", "npu_lo") for s in ("sync_for_device", "sync_for_cpu"))


def test_chunked_write_of_a_memmap(board, device, tmp_path):
    # A file-backed image goes in chunks: each chunk is copied and synced, and nothing near the image's size
    # is allocated (the E4B image is 2.3 GB).
    n = 5 * (1 << 20) + 123
    image = np.memmap(tmp_path / "image.bin", dtype=np.uint8, mode="w+", shape=(n,))
    image[:] = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    image.flush()
    image = np.memmap(tmp_path / "image.bin", dtype=np.uint8, mode="r")
    device.chunk_bytes = 1 << 20
    tracemalloc.start()
    try:
        device.mem_write(HI.base + 0x10_0008, image)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, f"mem_write allocated {peak} bytes for a {n}-byte memmap"
    assert backing(board, "npu_hi", 0x10_0008, n) == image.tobytes()
    syncs = board.syncs("npu_hi", "sync_for_device")
    assert len(syncs) == 6
    assert [s.offset for s in syncs] == [0x10_0000 + i * (1 << 20) for i in range(6)]
    assert all(a.end == b.offset + 16 for a, b in zip(syncs, syncs[1:]))  # 16-byte covers of adjacent chunks
    assert syncs[-1].end == -(-(0x10_0008 + n) // 16) * 16


# --- interrupt ---------------------------------------------------------------------------------------------

def test_wait_interrupt_through_the_pty(board, device):
    irq = board.interrupt
    delivered = []

    def source():
        # the NPU's line goes high 0.2 s after the host has re-enabled the interrupt
        assert irq.wait_enabled(5.0)
        time.sleep(0.2)
        delivered.append(irq.update(True))

    t = threading.Thread(target=source)
    t.start()
    t0 = time.monotonic()
    count = device.wait_interrupt(timeout_s=5.0)
    waited = time.monotonic() - t0
    t.join()
    assert (count, delivered, irq.words) == (1, [True], [1])
    assert waited >= 0.15, f"wait_interrupt returned after {waited:.3f} s, before the interrupt"
    # delivered once per enable: the line staying high does nothing until the host enables it again
    assert not irq.update(True)

    t = threading.Thread(target=lambda: (irq.wait_enabled(5.0), irq.update(True)))
    t.start()
    assert device.wait_interrupt() == 2       # no timeout: blocks until the count arrives
    t.join()
    assert irq.words == [1, 1]


def test_wait_interrupt_times_out(board, device):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^no interrupt from the NPU \(\S+/dev/uio0\) within 0.2 s$"):
        device.wait_interrupt(timeout_s=0.2)
    assert 0.15 <= time.monotonic() - t0 < 2.0
    # the enable reached the source; a later interrupt is still delivered
    assert board.interrupt.poll() and board.interrupt.words == [1]
    assert board.interrupt.update(True)
    assert device.wait_interrupt(timeout_s=2.0) == 1
    with pytest.raises(ValueError, match="timeout_s must be None or a non-negative number"):
        device.wait_interrupt(timeout_s=-1)


# --- CSR paths ---------------------------------------------------------------------------------------------

def test_csr_accesses_reach_the_registers(board):
    regs = registers()
    with Kv260Device(root=board.root, csr=regs) as dev:
        pos = csr_map.by_name("POSITION").offset
        dev.csr_write(pos, 0x1234_5678)
        assert dev.csr_read(pos) == 0x1234_5678 == regs.get("POSITION")
        regs.set("STATUS", csr_map.STATUS_DONE)
        assert dev.csr_read(csr_map.by_name("STATUS").offset) == csr_map.STATUS_DONE
        dev.csr_write(csr_map.by_name("CTRL").offset, csr_map.CTRL_START)
        assert regs.commands == [("CTRL", csr_map.CTRL_START)]
        assert regs.errors == []


def test_csr_link_to_a_simulation_thread(board):
    # The simulation side serves the host's accesses with its own bus coroutines (here: over the register
    # file, in an asyncio loop in another thread).
    regs, link, stop = registers(), CsrLink(timeout_s=5.0), threading.Event()

    async def bus_read(offset):
        await asyncio.sleep(0)
        if offset == 0xFFC:
            raise AssertionError("CSR read at 0xffc answered SLVERR")
        return regs.read32(offset)

    async def bus_write(offset, value):
        await asyncio.sleep(0)
        regs.write32(offset, value)

    async def simulation():
        while not stop.is_set():
            await link.serve(bus_read, bus_write)
            await asyncio.sleep(0.001)

    sim = threading.Thread(target=asyncio.run, args=(simulation(),))
    sim.start()
    try:
        with Kv260Device(root=board.root, csr=link) as dev:
            assert dev.hw is PRESETS["tiny"]
            dev.csr_write(csr_map.by_name("TOKEN_ID").offset, 42)
            assert dev.csr_read(csr_map.by_name("TOKEN_ID").offset) == 42
            with pytest.raises(AssertionError, match="SLVERR"):
                dev.csr_read(0xFFC)
    finally:
        stop.set()
        sim.join()
    link.close()
    with pytest.raises(RuntimeError, match="CSR read at 0x0: the simulation has ended"):
        link.read32(0)


def test_csr_through_the_mapped_page(board):
    # On the board the CSR page of /dev/uioN is mmapped. A regular file stands in for the page here (its bytes
    # are what the registers would read), the pty serves the interrupt through irq=.
    board.uio.unlink()
    page = bytearray(4096)
    struct.pack_into("<II", page, 0, csr_map.NPU_ID, csr_map.version_word(PRESETS["kv260"].to_dict()))
    board.uio.write_bytes(page)
    with Kv260Device(root=board.root, irq=board.interrupt.slave_fd) as dev:
        assert dev.hw is PRESETS["kv260"]
        dev.csr_write(csr_map.by_name("PROGRAM_LEN").offset, 0xA1B2_C3D4)
        assert board.uio.read_bytes()[0x28:0x2C] == (0xA1B2_C3D4).to_bytes(4, "little")
        assert dev.csr_read(0x28) == 0xA1B2_C3D4
        board.interrupt.update(True)
        assert dev.wait_interrupt(timeout_s=2.0) == 1
    os.fstat(board.interrupt.slave_fd)      # irq= is the caller's: still open


def test_csr_page_of_a_pty_cannot_be_mapped(board):
    with pytest.raises(BoardUnavailable, match=r"cannot map the CSR window of \S+/dev/uio0 \(0x1000 bytes\)"):
        Kv260Device(root=board.root)


# --- the UIO half alone ------------------------------------------------------------------------------------

def test_uio_csr_alone(board):
    # UioCsr is what Kv260Device opens for its CSRs and interrupt; other designs with the NPU's outside shape
    # (the DDR probe) use it without the DDR windows. Nothing is read at opening.
    regs = registers()
    with UioCsr("kv260", root=board.root, csr=regs) as uio:
        assert uio.path == board.root / "dev/uio0" and uio.memory_map is KV260
        assert uio.where == f"0xa0000000 via {board.root / 'dev/uio0'}"
        assert regs.accesses == []
        pos = csr_map.by_name("POSITION").offset
        uio.csr_write(pos, 7)
        assert uio.csr_read(pos) == 7 == regs.get("POSITION")
        with pytest.raises(ValueError, match="not a 32-bit word of the 0x1000-byte CSR window"):
            uio.csr_read(0x1002)
        t = threading.Thread(target=lambda: (board.interrupt.wait_enabled(5.0), board.interrupt.update(True)))
        t.start()
        assert uio.wait_interrupt(timeout_s=5.0) == 1
        t.join()
        with pytest.raises(TimeoutError, match=r"^no interrupt from the NPU \(\S+/dev/uio0\) within 0.1 s$"):
            uio.wait_interrupt(timeout_s=0.1)
    with pytest.raises(ValueError, match=r"^the NPU device \(\S+/dev/uio0\) is closed$"):
        uio.csr_read(0)
    assert repr(uio) == "<UioCsr closed>"


def test_uio_csr_messages_name_the_design(tmp_path):
    hint = "load the probe's app: sudo xmutil loadapp gemma3n-ddrprobe"
    with pytest.raises(BoardUnavailable,
                       match=rf"no UIO device named 'npu' in \S+ \(there is none\): {re.escape(hint)}$"):
        UioCsr(root=tmp_path, load_hint=hint, what="the DDR probe")
    with make_standin(tmp_path, csr_map_base=0xA001_0000):
        before = open_fds()
        with pytest.raises(BoardUnavailable, match=rf"the loaded overlay is not this firmware's; {re.escape(hint)}$"):
            UioCsr(root=tmp_path, load_hint=hint)
        assert open_fds() == before
    with make_standin(tmp_path / "b") as b, UioCsr(root=b.root, csr=registers(), what="the DDR probe") as uio:
        with pytest.raises(TimeoutError, match=r"^no interrupt from the DDR probe \(\S+\) within 0.05 s$"):
            uio.wait_interrupt(timeout_s=0.05)


# --- lifetime and the simulation's view of DDR -------------------------------------------------------------

def test_close(board):
    dev = Kv260Device(root=board.root, csr=registers())
    before = open_fds()
    dev.close()
    dev.close()
    assert open_fds() < before
    with pytest.raises(ValueError, match="is closed"):
        dev.mem_read(LO.base, 4)
    with pytest.raises(ValueError, match="is closed"):
        dev.csr_read(0)
    assert repr(dev) == "<Kv260Device closed>"


def test_the_simulated_npu_sees_the_host_writes(tmp_path):
    # The bench's DDR model maps the same dev/<name> files at the windows' physical addresses.
    small = MemoryMap("small", (Window("ddr_a", 0x0100_0000, 1 << 20), Window("ddr_b", 0x0400_0000, 1 << 20)),
                      csr_base=0xA000_0000)
    with make_standin(tmp_path, small) as b, Kv260Device(small, root=tmp_path, csr=registers()) as dev:
        ddr = b.memory()
        try:
            assert len(ddr) == 0x0410_0000
            dev.mem_write(0x0400_0010, b"from the host")
            assert ddr[0x0400_0010:0x0400_001D] == b"from the host"
            ddr[0x0100_0100:0x0100_0104] = b"NPU!"
            assert dev.mem_read(0x0100_0100, 4) == b"NPU!"
            with pytest.raises(IndexError, match=r"\[0xfffffe, 0x1000002\) is not inside one window"):
                ddr[0x0100_0000 - 2:0x0100_0000 + 2]
        finally:
            ddr.close()
