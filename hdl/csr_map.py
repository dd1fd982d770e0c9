"""The NPU's control/status register map: one description shared by the RTL (`hdl.csr`), the host runtime,
the benches and the docs (docs/architecture.md's CSR table is generated from it by `markdown_table`).

Pure Python (no Amaranth), so a board-side runtime can import it alone. Registers are 32 bits wide at byte
offsets on the AXI-Lite slave (HPM0); 64-bit quantities are a ``_LO``/``_HI`` pair (low word first).

Access kinds:

- ``rw``: written by the host, read back; drives the core (`o_<name>` on `hdl.csr.CsrBlock`).
- ``ro``: driven by the core (`i_<name>`), read by the host; writes are answered with SLVERR.
- ``cmd``: write-only command bits: writing 1 to a bit pulses `o_<name>` bit for one cycle; reads
  return 0.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .isa import DdrRegion

__all__ = ["Register", "Field", "RegisterMap", "MAP", "REGISTERS", "by_name", "counter_registers", "ADDR_BITS", "NPU_ID", "ISA_VERSION", "hardware_hash",
           "version_word", "markdown_table",
           "CTRL_START", "CTRL_CLEAR_COUNTERS", "CTRL_IRQ_ACK", "STATUS_BUSY", "STATUS_DONE", "STATUS_ERROR",
           "COUNTERS", "COUNTER_NAMES"]

ADDR_BITS = 12                  # a 4 KiB register window
NPU_ID = 0x4733_4E31            # "G3N1"
ISA_VERSION = 3                 # 2: WGEMV `reuse`; 3: CTRL SETTOK, SETPOS (docs/isa.md)


def hardware_hash(hardware: dict) -> int:
    """24 bits identifying a build's hardware parameters (`HardwareConfig.to_dict()`; VERSION bits 31:8). The
    core clock (``clock_hz``) is left out: it changes no register, program or memory layout, so a build for
    another clock (`python -m hdl.build --clock-mhz`) answers as its preset."""
    items = sorted((k, v) for k, v in hardware.items() if k != "clock_hz")
    return int.from_bytes(hashlib.sha256(repr(items).encode()).digest()[:3], "little")


def version_word(hardware: dict) -> int:
    """The VERSION register of an NPU built for `hardware`: ISA version (7:0), hardware hash (31:8)."""
    return ISA_VERSION | hardware_hash(hardware) << 8


@dataclass(frozen=True)
class Field:
    name: str
    lsb: int
    width: int
    doc: str


@dataclass(frozen=True)
class Register:
    name: str
    offset: int
    access: str                 # "rw" | "ro" | "cmd"
    doc: str
    reset: int = 0
    fields: tuple[Field, ...] = ()

    def __post_init__(self):
        if self.access not in ("rw", "ro", "cmd"):
            raise ValueError(f"register {self.name}: access must be rw, ro or cmd, not {self.access!r}")
        if self.offset % 4 or not 0 <= self.offset < 1 << ADDR_BITS:
            raise ValueError(f"register {self.name}: offset {self.offset:#x} is not a word in the window")


# Command bits of CTRL and bits of STATUS.
CTRL_START, CTRL_CLEAR_COUNTERS, CTRL_IRQ_ACK = 1 << 0, 1 << 1, 1 << 2
STATUS_BUSY, STATUS_DONE, STATUS_ERROR = 1 << 0, 1 << 1, 1 << 2

# Per-unit performance counters (64-bit, cleared by CTRL.CLEAR_COUNTERS and at START).
COUNTERS = (
    ("CYCLES", "cycles from START to DONE (or ERROR)"),
    ("INSNS", "instructions retired"),
    ("GEMV_BUSY", "cycles the GEMV engine computed (WGEMV)"),
    ("GEMV_STALL", "cycles the GEMV engine had work but waited for weight beats"),
    ("SFU_BUSY", "cycles the SFU/vector unit computed"),
    ("ATTN_BUSY", "cycles the attention unit computed"),
    ("DMA_BUSY", "cycles a DMA/KV/gather transfer was in flight"),
    ("ISSUE_STALL", "cycles the issue stage waited on a hazard or a busy unit"),
    ("BYTES_READ", "bytes read from DDR, all ports"),
    ("BYTES_WRITTEN", "bytes written to DDR, all ports"),
    ("GEMM_BUSY", "cycles the GEMM unit (systolic array) held a WGEMM token tile"),
)
COUNTER_NAMES = tuple(name for name, _ in COUNTERS)


def _build() -> "RegisterMap":
    regs = [
        Register("ID", 0x000, "ro", "constant 0x47334E31 (\"G3N1\"): the NPU is present", reset=NPU_ID),
        Register("VERSION", 0x004, "ro", "ISA version (bits 7:0); hardware preset hash (bits 31:8)"),
        Register("CTRL", 0x008, "cmd", "commands", fields=(
            Field("START", 0, 1, "run the program at PROGRAM_BASE for TOKEN_ID at POSITION"),
            Field("CLEAR_COUNTERS", 1, 1, "zero every performance counter"),
            Field("IRQ_ACK", 2, 1, "clear DONE and ERROR (the interrupt line)"))),
        Register("STATUS", 0x00C, "ro", "state of the NPU", fields=(
            Field("BUSY", 0, 1, "a program is running"),
            Field("DONE", 1, 1, "the last program reached HALT"),
            Field("ERROR", 2, 1, "the last program stopped on an error (see ERROR_CODE, ERROR_PC)"))),
        Register("ERROR_CODE", 0x010, "ro", "hdl.isa.ErrorCode of the last error (0: none)"),
        Register("ERROR_PC", 0x014, "ro", "index of the instruction that caused the last error"),
        Register("TOKEN_ID", 0x018, "rw", "token id the program starts with (GATHER; CTRL SETTOK replaces it for later "
                                          "instructions)"),
        Register("POSITION", 0x01C, "rw", "position the program starts at (RoPE, KV slot, window; CTRL SETPOS replaces "
                                          "it)"),
        Register("PROGRAM_BASE_LO", 0x020, "rw", "DDR byte address of the token program (16-byte aligned)"),
        Register("PROGRAM_BASE_HI", 0x024, "rw", "high word of PROGRAM_BASE"),
        Register("PROGRAM_LEN", 0x028, "rw", "program length in 64-bit words (bound on fetch)"),
        Register("DESC_COUNT", 0x02C, "rw", "descriptors in the DESC region (a larger index is BAD_DESCRIPTOR)"),
    ]
    for region in DdrRegion:
        off = 0x040 + 8 * region.value
        regs.append(Register(f"{region.name}_BASE_LO", off, "rw", f"DDR byte address of the {region.name} region"))
        regs.append(Register(f"{region.name}_BASE_HI", off + 4, "rw", f"high word of {region.name}_BASE"))
    return RegisterMap("CSR", regs + counter_registers(COUNTERS, 0x100))


def counter_registers(counters, base: int) -> list[Register]:
    """The read-only ``<name>_LO``/``<name>_HI`` pairs of the 64-bit counters ``(name, doc)``, at ``base + 8 i``."""
    regs = []
    for i, (name, doc) in enumerate(counters):
        regs.append(Register(f"{name}_LO", base + 8 * i, "ro", doc))
        regs.append(Register(f"{name}_HI", base + 8 * i + 4, "ro", f"high word of {name}"))
    return regs


class RegisterMap:
    """A register window's registers (checked for overlaps), found by name, and its documentation table.
    `what` names the window in errors ("no CSR named 'X'")."""

    def __init__(self, what: str, registers):
        self.what = what
        self.registers: tuple[Register, ...] = tuple(registers)
        offsets = [r.offset for r in self.registers]
        if len(set(offsets)) != len(offsets):
            raise ValueError(f"{what} map: registers overlap")
        self._by_name = {r.name: r for r in self.registers}

    def by_name(self, name: str) -> Register:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no {self.what} named {name!r}") from None

    def markdown_table(self) -> str:
        rows = ["| offset | name | access | meaning |", "|---|---|---|---|"]
        for r in self.registers:
            doc = r.doc + "".join(f"; bit {f.lsb} {f.name}: {f.doc}" for f in r.fields)
            rows.append(f"| {r.offset:#05x} | {r.name} | {r.access} | {doc} |")
        return "\n".join(rows)


MAP = _build()
REGISTERS: tuple[Register, ...] = MAP.registers
by_name = MAP.by_name


def markdown_table() -> str:
    """The CSR map as the Markdown table of docs/architecture.md."""
    return MAP.markdown_table()
