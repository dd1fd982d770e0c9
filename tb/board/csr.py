"""CSR back ends for `firmware.board.Kv260Device`'s ``csr=``: `CsrLink` carries the host thread's accesses
to a simulation, and `RegisterFile` is the CSR map's access semantics in Python."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from hdl import csr_map

__all__ = ["CsrLink", "CsrRequest", "RegisterFile"]


@dataclass
class CsrRequest:
    """One CSR access waiting for the simulation: ``kind`` is "read" or "write"; ``value`` is what a write
    writes. The simulation answers with `complete` (a read's value) or `fail`."""

    kind: str
    offset: int
    value: int | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _result: int | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    def complete(self, value: int | None = None) -> None:
        if self.kind == "read" and value is None:
            raise ValueError(f"CSR read at {self.offset:#x} completed without a value")
        self._result = value
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()


class CsrLink:
    """CSR accesses made in the host's thread and performed by the simulation.

    The host's device (``Kv260Device(csr=link)``) calls `read32`/`write32`. Each call queues a `CsrRequest`
    and blocks until the simulation answers it. The simulation calls `serve` from its own loop (a cocotb
    coroutine; nothing here imports cocotb), which performs every pending request with its bus coroutines.
    An exception raised by the bus goes back to the host's call. `close` fails pending and later requests,
    so a host thread cannot hang on a simulation that has ended.

    Parameters
    ----------
    timeout_s : the longest a host access waits for the simulation (None: no limit).
    """

    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[CsrRequest] = queue.SimpleQueue()
        self._closed: str | None = None

    # --- host side -----------------------------------------------------------------------------------------

    def _call(self, request: CsrRequest) -> int | None:
        if self._closed is not None:
            raise RuntimeError(f"CSR {request.kind} at {request.offset:#x}: {self._closed}")
        self._queue.put(request)
        if not request._done.wait(self.timeout_s):
            raise TimeoutError(f"CSR {request.kind} at {request.offset:#x}: the simulation did not answer within "
                               f"{self.timeout_s} s")
        if request._error is not None:
            raise request._error
        return request._result

    def read32(self, offset: int) -> int:
        return self._call(CsrRequest("read", offset))

    def write32(self, offset: int, value: int) -> None:
        self._call(CsrRequest("write", offset, value))

    # --- simulation side -----------------------------------------------------------------------------------

    def poll(self) -> CsrRequest | None:
        """The next pending request, or None (never blocks)."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    async def serve(self, csr_read, csr_write) -> int:
        """Perform every pending request: ``await csr_read(offset) -> int`` and ``await csr_write(offset,
        value)`` are the simulation's bus coroutines (the full-chip bench's `NpuBench.csr_read`/`csr_write`).
        Returns the number of requests served."""
        served = 0
        while (request := self.poll()) is not None:
            try:
                if request.kind == "read":
                    request.complete(int(await csr_read(request.offset)))
                else:
                    await csr_write(request.offset, request.value)
                    request.complete()
            except Exception as e:      # handed to the host's call, which raises it
                request.fail(e)
            served += 1
        return served

    def close(self, reason: str = "the simulation has ended") -> None:
        """Fail every pending and later request with `reason`."""
        self._closed = reason
        while (request := self.poll()) is not None:
            request.fail(RuntimeError(f"CSR {request.kind} at {request.offset:#x}: {reason}"))


class RegisterFile:
    """The access semantics of `hdl.csr_map.REGISTERS` in Python, for testing host code that needs registers
    but not the NPU.

    Every register starts at its ``reset`` value. ``rw`` registers store what is written. ``ro`` registers
    return what the test `set`s. ``cmd`` registers read 0, and each write is appended to `commands` as
    ``(name, value)``. The accesses the RTL (`hdl.csr`) answers with SLVERR change nothing and are appended
    to `errors` as ``(kind, offset, value)``: a write to an ``ro`` register, and any access to an unmapped
    offset (a read returns 0). `accesses` records every access as ``(kind, offset, value)``.
    """

    def __init__(self):
        self._by_offset = {r.offset: r for r in csr_map.REGISTERS}
        self._values = {r.offset: r.reset for r in csr_map.REGISTERS}
        self.commands: list[tuple[str, int]] = []
        self.errors: list[tuple[str, int, int | None]] = []
        self.accesses: list[tuple[str, int, int]] = []

    def set(self, name: str, value: int) -> None:
        """Drive the read-only register `name` (what the core would)."""
        reg = csr_map.by_name(name)
        if reg.access != "ro":
            raise ValueError(f"register {name} is {reg.access}, not ro: the host writes it")
        if not 0 <= value <= 0xFFFF_FFFF:
            raise ValueError(f"register {name}: {value!r} is not a 32-bit value")
        self._values[reg.offset] = value

    def get(self, name: str) -> int:
        """The value register `name` holds (a cmd register: 0)."""
        reg = csr_map.by_name(name)
        return 0 if reg.access == "cmd" else self._values[reg.offset]

    def read32(self, offset: int) -> int:
        reg = self._by_offset.get(offset)
        value = 0 if reg is None or reg.access == "cmd" else self._values[offset]
        if reg is None:
            self.errors.append(("read", offset, None))
        self.accesses.append(("read", offset, value))
        return value

    def write32(self, offset: int, value: int) -> None:
        self.accesses.append(("write", offset, value))
        reg = self._by_offset.get(offset)
        if reg is None or reg.access == "ro":
            self.errors.append(("write", offset, value))
        elif reg.access == "cmd":
            self.commands.append((reg.name, value))
        else:
            self._values[offset] = value & 0xFFFF_FFFF
