"""Transaction-level model of the AXI4 -> CSR bridge (`hdl.axi_csr.AxiToCsr` in front of `hdl.csr.CsrBlock`).

Given a register file and one AXI4 burst (its address-channel fields and, for a write, its W beats), the
model gives what the bridge answers on the bus (the B response, or every R beat) and performs the register
accesses the bridge makes, in the bridge's order. It is written from the AXI4 specification (ARM IHI 0022,
A3.4.1 "Address structure": the beat addresses of FIXED, INCR and WRAP bursts and their byte lanes), not from
the RTL, so a bench can predict the RTL with it.

Semantics (the bridge's contract):

- Beat ``n`` of a burst has the address ``Address_n`` of A3.4.1; only its low 12 bits select a register
  (the PS decodes the 4 KiB window).
- A W beat writes the 32-bit words of the data bus that have any strobe set, in ascending order, each
  with its four strobe bits, at ``(Address_n & ~(data_bytes - 1)) + 4 * word``; a beat with no strobe set
  writes nothing. One B per burst: the worst (numerically largest: OKAY < EXOKAY < SLVERR < DECERR) of all
  its word responses, OKAY when it wrote no word.
- An R beat reads the words its byte lanes cover: from ``Address_n`` to the end of its ``2**size``-byte
  container (the whole container on every beat but an unaligned first one, or every beat of an
  unaligned FIXED burst); each word's register value is returned on its four lanes, every other lane is
  zero; the beat's response is the worst of its words'. ``rlast`` marks the last beat.
- Responses carry the burst's ID.

`RegisterFile` is the register file of `hdl.csr.CsrBlock`, word by word: ``rw`` registers store the written
bytes, ``ro`` registers read a value the bench sets and answer writes SLVERR, ``cmd`` registers read 0 and
record the written bytes as a one-cycle pulse, unmapped words answer SLVERR (reads return 0). It takes any
sequence of register descriptions with ``name``, ``offset``, ``access`` and ``reset`` (`hdl.csr_map.REGISTERS`
or a probe's map), so this module needs neither Amaranth nor ``hdl``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OKAY", "EXOKAY", "SLVERR", "DECERR", "FIXED", "INCR", "WRAP", "WINDOW_BYTES", "RegisterFile",
           "Burst", "RBeat", "beat_addresses", "beat_lanes", "write_burst", "read_burst", "check_data_bytes"]

OKAY, EXOKAY, SLVERR, DECERR = 0, 1, 2, 3
FIXED, INCR, WRAP = 0, 1, 2
WINDOW_BYTES = 4096                 # the CSR window: the low 12 address bits select a register
_BURST_NAMES = {FIXED: "FIXED", INCR: "INCR", WRAP: "WRAP"}


def check_data_bytes(data_bytes: int) -> int:
    if isinstance(data_bytes, bool) or not isinstance(data_bytes, int) or data_bytes < 4 or \
            data_bytes > 128 or data_bytes & (data_bytes - 1):
        raise ValueError(f"data bus width must be a power of two from 4 to 128 bytes, not {data_bytes!r}")
    return data_bytes


class RegisterFile:
    """The word-level behaviour of `hdl.csr.CsrBlock` for a register map.

    Parameters
    ----------
    registers : iterable of objects with ``name``, ``offset`` (byte, word aligned, below 4096), ``access``
        (``"rw"``, ``"ro"`` or ``"cmd"``) and ``reset``.

    Attributes
    ----------
    values : dict name -> int
        The stored value of every ``rw`` register and the input value of every ``ro`` register.
    pulses : list of (name, value)
        Every write to a ``cmd`` register whose strobed bytes are not all zero, in order: the value its
        port pulses for one cycle (the written bytes under the strobes, zero elsewhere).
    accesses : list of tuples
        Every word access in order: ``("w", offset, data, strb, resp)`` and ``("r", offset, data, resp)``.
    """

    def __init__(self, registers):
        self._by_offset = {}
        self.values = {}
        for r in registers:
            if r.access not in ("rw", "ro", "cmd"):
                raise ValueError(f"register {r.name}: access must be rw, ro or cmd, not {r.access!r}")
            if r.offset % 4 or not 0 <= r.offset < WINDOW_BYTES:
                raise ValueError(f"register {r.name}: offset {r.offset:#x} is not a word in the 4 KiB window")
            if r.offset in self._by_offset:
                raise ValueError(f"registers {self._by_offset[r.offset].name} and {r.name} share offset "
                                 f"{r.offset:#x}")
            self._by_offset[r.offset] = r
            if r.access != "cmd":
                self.values[r.name] = r.reset if r.access == "rw" else 0
        self.pulses: list[tuple[str, int]] = []
        self.accesses: list[tuple] = []

    def register_at(self, offset: int):
        """The register at word offset `offset` (None if unmapped)."""
        return self._by_offset.get(offset)

    def set_input(self, name: str, value: int) -> None:
        """Drive the ``ro`` register `name` (what the core presents on its ``i_`` port)."""
        regs = [r for r in self._by_offset.values() if r.name == name]
        if not regs or regs[0].access != "ro":
            raise KeyError(f"no read-only register named {name!r}")
        if not 0 <= value < 1 << 32:
            raise ValueError(f"register {name}: value {value!r} is not a 32-bit word")
        self.values[name] = value

    def write_word(self, offset: int, data: int, strb: int) -> int:
        """One AXI4-Lite write of `data` under the byte strobes `strb` at `offset`; returns the response."""
        _check_word(offset, data, strb)
        r = self._by_offset.get(offset)
        resp = SLVERR if r is None or r.access == "ro" else OKAY
        if resp == OKAY:
            mask = sum(0xFF << 8 * i for i in range(4) if strb >> i & 1)
            if r.access == "rw":
                self.values[r.name] = self.values[r.name] & ~mask | data & mask
            elif data & mask:
                self.pulses.append((r.name, data & mask))
        self.accesses.append(("w", offset, data, strb, resp))
        return resp

    def read_word(self, offset: int) -> tuple[int, int]:
        """One AXI4-Lite read at `offset`; returns ``(data, resp)``."""
        _check_word(offset, 0, 0)
        r = self._by_offset.get(offset)
        if r is None:
            data, resp = 0, SLVERR
        else:
            data, resp = (0 if r.access == "cmd" else self.values[r.name]), OKAY
        self.accesses.append(("r", offset, data, resp))
        return data, resp


def _check_word(offset, data, strb):
    if offset % 4 or not 0 <= offset < WINDOW_BYTES:
        raise ValueError(f"word offset {offset!r} is not a word in the 4 KiB window")
    if not 0 <= data < 1 << 32 or not 0 <= strb < 16:
        raise ValueError(f"word data {data!r} / strobes {strb!r} out of range")


@dataclass(frozen=True)
class Burst:
    """The address-channel fields of one AXI4 burst: ``AxADDR``, ``AxLEN + 1`` (`beats`), ``AxSIZE``,
    ``AxBURST`` and ``AxID``. Construction checks the AXI4 rules for the burst type on a bus of
    `data_bytes` bytes (A3.4.1): sizes up to the bus width; INCR 1..256 beats within one 4 KB page; FIXED
    1..16 beats; WRAP 2, 4, 8 or 16 beats from an address aligned to the size."""

    addr: int
    beats: int
    size: int
    burst: int
    id: int = 0
    data_bytes: int = 16

    def __post_init__(self):
        check_data_bytes(self.data_bytes)
        for name in ("addr", "beats", "size", "burst", "id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"burst {name} must be a non-negative integer, not {v!r}")
        if self.burst not in _BURST_NAMES:
            raise ValueError(f"burst type must be FIXED (0), INCR (1) or WRAP (2), not {self.burst!r}")
        if 1 << self.size > self.data_bytes:
            raise ValueError(f"size {self.size} ({1 << self.size} bytes) is wider than the "
                             f"{self.data_bytes}-byte data bus")
        nb = 1 << self.size
        kind = _BURST_NAMES[self.burst]
        if self.burst == INCR:
            if not 1 <= self.beats <= 256:
                raise ValueError(f"INCR burst of {self.beats} beats: AXI4 allows 1..256")
            aligned = self.addr - self.addr % nb
            if aligned // 4096 != (aligned + nb * self.beats - 1) // 4096:
                raise ValueError(f"INCR burst at {self.addr:#x} of {self.beats} x {nb} bytes crosses a 4 KB "
                                 f"boundary")
        elif self.burst == FIXED:
            if not 1 <= self.beats <= 16:
                raise ValueError(f"{kind} burst of {self.beats} beats: AXI4 allows 1..16")
        else:
            if self.beats not in (2, 4, 8, 16):
                raise ValueError(f"{kind} burst of {self.beats} beats: AXI4 allows 2, 4, 8 or 16")
            if self.addr % nb:
                raise ValueError(f"{kind} burst address {self.addr:#x} is not aligned to its size ({nb} bytes)")

    @property
    def name(self) -> str:
        return _BURST_NAMES[self.burst]


@dataclass(frozen=True)
class RBeat:
    """One R beat: ``rid``, ``rdata``, ``rresp``, ``rlast``."""

    id: int
    data: int
    resp: int
    last: bool


def beat_addresses(b: Burst) -> list[int]:
    """``Address_n`` of every beat (AXI4 A3.4.1), full width."""
    nb = 1 << b.size
    aligned = b.addr // nb * nb
    if b.burst == FIXED:
        return [b.addr] * b.beats
    if b.burst == INCR:
        return [b.addr] + [aligned + n * nb for n in range(1, b.beats)]
    span = nb * b.beats
    boundary = b.addr // span * span
    return [b.addr] + [boundary + (aligned - boundary + n * nb) % span for n in range(1, b.beats)]


def beat_lanes(b: Burst, address: int) -> tuple[int, int]:
    """``(Lower_Byte_Lane, Upper_Byte_Lane)`` of a beat at `address`: from the address to the end of its
    ``2**size``-byte container (A3.4.1; this is the first beat's formula, and the same as the later beats'
    for their aligned addresses)."""
    nb = 1 << b.size
    lower = address % b.data_bytes
    return lower, address // nb * nb % b.data_bytes + nb - 1


def _word_base(b: Burst, address: int) -> int:
    """The 4 KiB-window offset of word 0 of the data bus at beat address `address`."""
    return address % WINDOW_BYTES // b.data_bytes * b.data_bytes


def write_burst(regs: RegisterFile, b: Burst, beats) -> tuple[int, int]:
    """Perform the write burst `b` with its W beats `beats` (``(wdata, wstrb)`` pairs) on `regs`; returns the
    bridge's B: ``(bid, bresp)``."""
    beats = list(beats)
    if len(beats) != b.beats:
        raise ValueError(f"a {b.beats}-beat write burst needs {b.beats} W beats, got {len(beats)}")
    words = b.data_bytes // 4
    resp = OKAY
    for address, (wdata, wstrb) in zip(beat_addresses(b), beats):
        if not 0 <= wdata < 1 << 8 * b.data_bytes or not 0 <= wstrb < 1 << b.data_bytes:
            raise ValueError(f"W beat ({wdata:#x}, {wstrb:#x}) does not fit a {b.data_bytes}-byte bus")
        base = _word_base(b, address)
        for w in range(words):
            strb = wstrb >> 4 * w & 0xF
            if strb:
                resp = max(resp, regs.write_word(base + 4 * w, wdata >> 32 * w & 0xFFFF_FFFF, strb))
    return b.id, resp


def read_burst(regs: RegisterFile, b: Burst) -> list[RBeat]:
    """Perform the read burst `b` on `regs`; returns the bridge's R beats."""
    out = []
    for n, address in enumerate(beat_addresses(b)):
        lower, upper = beat_lanes(b, address)
        base = _word_base(b, address)
        data, resp = 0, OKAY
        for w in range(lower // 4, upper // 4 + 1):
            d, r = regs.read_word(base + 4 * w)
            data |= d << 32 * w
            resp = max(resp, r)
        out.append(RBeat(b.id, data, resp, n == b.beats - 1))
    return out
