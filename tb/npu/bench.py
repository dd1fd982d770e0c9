"""The full-chip bench's environment: clock, reset, DDR behind every AXI master, the CSR master, and the
blocking device through which the host code (`firmware.runtime.CsrBackend`) drives the simulated NPU.

DDR is a `WindowedMemory`: the windows of a memory map (`hdl.memory_map`; ``flat``: one 64 MiB window at
16 MiB; a board's map: its windows at their physical addresses, above 4 GB where the map says so, each
clipped to what a simulation needs), each an `mmap` (anonymous, or a file such as a stand-in u-dma-buf
device), shared by a cocotbext-axi RAM on every ``m_axi{p}`` port (`AxiRamRead`/`AxiRamWrite` take the
memory object as ``mem=``). Every AXI channel of every port (AW, W, B, AR, R) and every AXI-Lite channel gets
its own seeded random pause generator. An access outside every window is recorded in `NpuBench.faults` and
answered SLVERR (so a stray address cannot silently alias the image).

The NPU must be quiet when it raises its interrupt (DONE or ERROR): every burst it asked for answered, no
request pending, and no new burst until the next START, since the host may then rewrite any buffer and a
START resets the datapath. Each port's RAM model counts the bursts it takes and answers; a burst open at the
interrupt, or a burst asked for while the interrupt is up, is recorded in `NpuBench.unquiet`, which the
tests assert empty.

The host code runs in a thread (`cocotb.task.bridge`); `SimDevice` turns its blocking calls into coroutines
on the simulator (`cocotb.task.resume`). DDR reads and writes of the host are back-door accesses to the
memory (what the PS does through its own DDR port, outside the NPU's AXI traffic); CSR accesses are real
AXI4 transactions on the NPU's HPM0-side slave (through its AXI4-to-CSR bridge).
"""

from __future__ import annotations

import logging
import mmap
import random
import warnings

import cocotb
from cocotb.clock import Clock
from cocotb.task import resume
from cocotb.triggers import ClockCycles, RisingEdge, SimTimeoutError, with_timeout
from cocotbext.axi import AxiBus, AxiMaster, AxiResp
from cocotbext.axi.axi_ram import AxiRamRead, AxiRamWrite

from hdl.config import HardwareConfig
import dataclasses

from hdl.memory_map import MemoryMap, Window, memory_map
from tb.npu.monitor import PassMonitor

__all__ = ["NpuBench", "SimDevice", "WindowedMemory", "sim_memory_map", "sim_windows", "parse_window_bytes",
           "pauses", "CLOCK_NS", "FLAT_WINDOWS"]

# cocotbext-axi 0.1.28's AxiMaster reads its own deprecated event field on every response: not ours to fix.
warnings.filterwarnings("ignore", "The data field will be removed", DeprecationWarning, r"cocotbext\.axi")

CLOCK_NS = 10
GUARD = 0xA5          # the byte every DDR location outside the image holds before a run
FLAT_WINDOWS = (Window("ddr", 0x0100_0000, 64 << 20),)
SIM_WINDOW_BYTES = 64 << 20


def sim_memory_map(name: str = "flat", limit: int | tuple[int, ...] = SIM_WINDOW_BYTES) -> MemoryMap:
    """The memory map a simulation packs for: map `name` with its windows clipped to `limit` bytes (one limit for
    all, or one per window in map order). A board's windows keep their physical addresses, and `firmware.pack`
    fills them from their base, so a small model lands where it would on the board; a small first window splits
    WEIGHTS between the banks, as E4B's is on a K26."""
    mm = memory_map(name)
    if mm.name == "flat":
        return mm
    limits = (limit,) * len(mm.windows) if isinstance(limit, int) else tuple(limit)
    if len(limits) != len(mm.windows):
        raise ValueError(f"memory map {name!r} has {len(mm.windows)} windows; {len(limits)} limits given")
    return dataclasses.replace(mm, windows=tuple(Window(w.name, w.base, min(w.size, n))
                                                 for w, n in zip(mm.windows, limits)))


def sim_windows(name: str = "flat", limit: int | tuple[int, ...] = SIM_WINDOW_BYTES) -> tuple[Window, ...]:
    """The bench's DDR windows for memory map `name` (`sim_memory_map`); ``flat``: one 64 MiB window at 16 MiB
    (the host adds its base)."""
    return FLAT_WINDOWS if name == "flat" else sim_memory_map(name, limit).windows


def parse_window_bytes(text: str) -> tuple[int, ...]:
    """``"64M"``, ``"128K,64M"``: window sizes (bytes, or with a K or M suffix), comma separated; ValueError
    unless each is a positive multiple of 4 KiB."""
    out = []
    for part in text.split(","):
        p = part.strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(p[-1:], 1)
        try:
            n = int(p[:-1] if scale > 1 else p) * scale
        except ValueError:
            n = 0
        if n <= 0 or n % 4096:
            raise ValueError(f"window size {part!r} is not a positive multiple of 4 KiB (bytes, or with K or M)")
        out.append(n)
    return tuple(out)


class WindowedMemory:
    """Byte-addressed DDR made of windows, each backed by its own buffer (`mmap`): slicing reads and writes
    ``[lo, hi)`` of the window that holds it (IndexError outside every window). The cocotbext-axi RAMs use it as
    their ``mem``."""

    def __init__(self, windows: tuple[Window, ...], backing: dict | None = None):
        spans = sorted((w.base, w.end) for w in windows)
        for (_, end), (base, _) in zip(spans, spans[1:]):
            if base < end:
                raise ValueError(f"bench windows overlap: {windows}")
        self.windows = tuple(windows)
        self.buffers = {}
        for w in self.windows:
            buf = (backing or {}).get(w.name)
            if buf is None:
                buf = mmap.mmap(-1, w.size)
                buf[:] = bytes([GUARD]) * w.size
            elif len(buf) < w.size:
                raise ValueError(f"the backing of window {w.name!r} has {len(buf)} bytes, fewer than {w.size}")
            self.buffers[w.name] = buf

    def find(self, addr: int, n: int):
        """``(window, buffer)`` holding ``[addr, addr + n)``, or None."""
        for w in self.windows:
            if w.holds(addr, n):
                return w, self.buffers[w.name]
        return None

    def _slice(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("WindowedMemory takes [lo:hi] slices")
        hit = self.find(key.start, key.stop - key.start)
        if hit is None:
            raise IndexError(f"[{key.start:#x}, {key.stop:#x}) is not inside one window ("
                             f"{', '.join(f'{w.name} [{w.base:#x}, {w.end:#x})' for w in self.windows)})")
        w, buf = hit
        return buf, key.start - w.base, key.stop - w.base

    def __getitem__(self, key):
        buf, lo, hi = self._slice(key)
        return bytes(buf[lo:hi])

    def __setitem__(self, key, data):
        buf, lo, hi = self._slice(key)
        if len(data) != hi - lo:
            raise ValueError(f"writing {len(data)} bytes to a {hi - lo}-byte range at {key.start:#x}")
        buf[lo:hi] = bytes(data)

    def window_of(self, addr: int, nbytes: int = 1) -> Window | None:
        hit = self.find(addr, nbytes)
        return None if hit is None else hit[0]

    def __len__(self):
        return max(w.end for w in self.windows)

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.close()


def pauses(rng: random.Random, p: float):
    """A cocotbext-axi pause generator: pause a cycle with probability `p`."""
    while True:
        yield int(rng.random() < p)


class _WindowCheck:
    def _check(self, kind, address, length):
        if self.mem.find(address, length) is None:
            self.faults.append((kind, address, length))
            raise IndexError(f"{kind} of {length} bytes at {address:#x} is outside every DDR window")


def _counting(channel, attr, counter, owner, last=None, then=None):
    """Wrap `channel`'s `attr` (``recv`` or ``send``) so that each transfer it carries (with `last`: each one
    whose `last` field is set) increments ``owner.<counter>`` and calls `then` with it."""
    inner = getattr(channel, attr)

    async def wrapped(*args):
        out = await inner(*args)
        item = args[0] if args else out
        if last is None or int(getattr(item, last)):
            setattr(owner, counter, getattr(owner, counter) + 1)
            if then is not None:
                then(item)
        return out
    setattr(channel, attr, wrapped)


class _Counted:
    """A RAM side that counts the bursts it takes (AR or AW) and answers (the R beat with RLAST, or B queued)."""

    def _count(self, req, resp, on_request, last=None):
        self.taken = self.answered = 0
        self._req, self._resp = req, resp
        _counting(req, "recv", "taken", self, then=on_request)
        _counting(resp, "send", "answered", self, last=last)

    def _quiet_tail(self) -> bool:
        return self._resp.idle()

    def open_bursts(self) -> int:
        """Bursts the NPU has asked for (or started) whose answer it has not yet taken."""
        return max(self._req.count() + self.taken - self.answered, int(not self._quiet_tail()))


class _RamRead(_Counted, _WindowCheck, AxiRamRead):
    def __init__(self, bus, clock, reset, *, mem, faults, on_request=None):
        self.faults = faults
        super().__init__(bus, clock, reset, mem=mem)
        self._count(self.ar_channel, self.r_channel, on_request, last="rlast")

    async def _read(self, address, length):
        self._check("read", address, length)
        return self.read(address, length)


class _RamWrite(_Counted, _WindowCheck, AxiRamWrite):
    def __init__(self, bus, clock, reset, *, mem, faults, on_request=None):
        self.faults = faults
        super().__init__(bus, clock, reset, mem=mem)
        self._count(self.aw_channel, self.b_channel, on_request)

    def _quiet_tail(self) -> bool:                 # a write's W beats may come before its AW
        return self._resp.idle() and self.w_channel.empty()

    async def _write(self, address, data):
        self._check("write", address, length=len(data))
        self.write(address, data)


class NpuBench:
    """Clock, reset, DDR and CSR master around the `hdl.npu.Npu` top, and the pass monitor (``monitor``).

    Parameters
    ----------
    dut : the cocotb handle of the NPU top.
    hw : the `HardwareConfig` the NPU was built for.
    seed : seeds the pause generators (and nothing else).
    windows : the DDR windows (`sim_windows`); the host places the image in them.
    backing : optional buffers for some windows (window name -> writable buffer of at least its size).
    pause : probability of a pause cycle on each AXI and AXI-Lite channel.
    timeout_cycles : the longest a host wait on the interrupt may take before the test fails.
    """

    def __init__(self, dut, hw: HardwareConfig, *, seed: int, windows: tuple[Window, ...] = FLAT_WINDOWS,
                 backing: dict | None = None, pause: float = 0.2, timeout_cycles: int = 20_000_000):
        for w in windows:
            if w.end > 1 << hw.axi_addr_bits:
                raise ValueError(f"DDR window {w.name!r} [{w.base:#x}, {w.end:#x}) exceeds the "
                                 f"{hw.axi_addr_bits}-bit AXI address space")
        self.dut, self.hw = dut, hw
        self.windows = tuple(windows)
        self.timeout_cycles = timeout_cycles
        self.mem = WindowedMemory(self.windows, backing)
        self.faults: list[tuple[str, int, int]] = []
        self.interrupts = 0
        self.unquiet: list[tuple[int, list[str]]] = []     # (interrupt number, open transfers) at an interrupt
        rng = random.Random(seed)
        self.ports = []
        for p in range(hw.axi_ports):
            bus = AxiBus.from_prefix(dut, f"m_axi{p}", bus_separator="__")
            rd = _RamRead(bus.read, dut.clk, dut.rst, mem=self.mem, faults=self.faults,
                          on_request=self._after_interrupt(f"m_axi{p}", "read", "ar"))
            wr = _RamWrite(bus.write, dut.clk, dut.rst, mem=self.mem, faults=self.faults,
                           on_request=self._after_interrupt(f"m_axi{p}", "write", "aw"))
            for ch in (wr.aw_channel, wr.w_channel, wr.b_channel, rd.ar_channel, rd.r_channel):
                ch.set_pause_generator(pauses(random.Random(rng.randrange(1 << 32)), pause))
            self.ports.append((rd, wr))
        # The CSRs through the NPU's AXI4 slave (the PS's HPM0), as single-beat 32-bit transfers like a CPU's.
        self.axi = AxiMaster(AxiBus.from_prefix(dut, "s_axi", bus_separator="__"), dut.clk, dut.rst)
        for ch in (self.axi.write_if.aw_channel, self.axi.write_if.w_channel, self.axi.write_if.b_channel,
                   self.axi.read_if.ar_channel, self.axi.read_if.r_channel):
            ch.set_pause_generator(pauses(random.Random(rng.randrange(1 << 32)), pause))
        self.monitor = PassMonitor(dut, hw)      # the controller's steps (o_trace), against sim.plan
        # cocotbext-axi logs one INFO line per burst: keep warnings only
        for model in [m for port in self.ports for m in port] + [self.axi.write_if, self.axi.read_if]:
            model.log.setLevel(logging.WARNING)

    async def start(self) -> None:
        """Start the clock; hold reset for a few cycles."""
        cocotb.start_soon(Clock(self.dut.clk, CLOCK_NS, unit="ns").start())
        self.monitor.start()
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 4)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)

    # --- coroutines the host thread calls ------------------------------------------------------------------

    async def csr_read(self, offset: int) -> int:
        resp = await self.axi.read(offset, 4, size=2)       # a CPU's 32-bit load: one 4-byte beat
        if resp.resp != AxiResp.OKAY:
            raise AssertionError(f"CSR read at {offset:#x} answered {resp.resp!r}")
        return int.from_bytes(resp.data, "little")

    async def csr_write(self, offset: int, value: int) -> None:
        resp = await self.axi.write(offset, int(value).to_bytes(4, "little"), size=2)
        if resp.resp != AxiResp.OKAY:
            raise AssertionError(f"CSR write of {value:#x} at {offset:#x} answered {resp.resp!r}")

    async def wait_interrupt(self) -> None:
        """Wait for the interrupt; then check that the NPU is quiet (`unquiet`)."""
        if not int(self.dut.o_irq.value):
            try:
                await with_timeout(RisingEdge(self.dut.o_irq), self.timeout_cycles * CLOCK_NS, "ns")
            except SimTimeoutError:
                raise AssertionError(f"no interrupt in {self.timeout_cycles} cycles; "
                                     f"open: {'; '.join(self.open_transfers()) or 'nothing'}; "
                                     f"{self.monitor.where()}") from None
            await RisingEdge(self.dut.clk)         # the memory models see the edge's handshakes
        self.interrupts += 1
        busy = self.open_transfers()
        if busy:
            self.unquiet.append((self.interrupts, busy))
            self.dut._log.warning(f"interrupt {self.interrupts} with AXI transfers open: {'; '.join(busy)}")

    def _after_interrupt(self, port, kind, prefix):
        """A request callback: a burst the NPU asks for while its interrupt is up (its program has ended) is
        recorded in `unquiet`."""
        def check(req):
            if int(self.dut.o_irq.value):
                addr, n = int(getattr(req, f"{prefix}addr")), int(getattr(req, f"{prefix}len")) + 1
                what = f"{port}: a {kind} burst of {n} beats at {addr:#x} after the interrupt"
                self.unquiet.append((self.interrupts, [what]))
                self.dut._log.warning(what)
        return check

    def open_transfers(self) -> list[str]:
        """The AXI transfers now open on the NPU's ports: a burst asked for or started and not completed, or a
        request or write beat offered and not taken."""
        out = []
        for p, (rd, wr) in enumerate(self.ports):
            r, w = rd.open_bursts(), wr.open_bursts()
            valid = [c for c in ("arvalid", "awvalid", "wvalid") if int(getattr(self.dut, f"m_axi{p}__{c}").value)]
            if r or w or valid:
                out.append(f"m_axi{p}: {r} read and {w} write bursts open" + (f", {'/'.join(valid)} high" if valid else ""))
        return out

    async def cycles(self, n: int) -> None:
        await ClockCycles(self.dut.clk, n)

    # --- DDR back door -------------------------------------------------------------------------------------

    def mem_read(self, addr: int, nbytes: int) -> bytes:
        self._check(addr, nbytes)
        return self.mem[addr:addr + nbytes]

    def mem_write(self, addr: int, data) -> None:
        data = memoryview(data).cast("B")
        self._check(addr, len(data))
        self.mem[addr:addr + len(data)] = data

    def _check(self, addr, n):
        if self.mem.find(addr, n) is None:
            raise ValueError(f"host DDR access [{addr:#x}, {addr + n:#x}) is outside every window "
                             f"({', '.join(f'{w.name} [{w.base:#x}, {w.end:#x})' for w in self.windows)})")

    def window(self, name: str) -> bytes:
        """A copy of the whole DDR window `name`."""
        w = next(w for w in self.windows if w.name == name)
        return bytes(self.mem.buffers[name][:w.size])


class SimDevice:
    """`firmware.runtime.NpuDevice` over `NpuBench`, for host code running in a `cocotb.task.bridge` thread."""

    def __init__(self, bench: NpuBench):
        self.bench = bench
        self.hw = bench.hw
        self.windows = bench.windows
        self._csr_read = resume(bench.csr_read)
        self._csr_write = resume(bench.csr_write)
        self._wait_interrupt = resume(bench.wait_interrupt)
        self._cycles = resume(bench.cycles)

    def csr_read(self, offset: int) -> int:
        return self._csr_read(offset)

    def csr_write(self, offset: int, value: int) -> None:
        self._csr_write(offset, value)

    def wait_interrupt(self) -> None:
        self._wait_interrupt()

    def cycles(self, n: int) -> None:
        """Let `n` clock cycles pass."""
        self._cycles(n)

    def mem_read(self, addr: int, nbytes: int) -> bytes:
        return self.bench.mem_read(addr, nbytes)

    def mem_write(self, addr: int, data) -> None:
        self.bench.mem_write(addr, data)
