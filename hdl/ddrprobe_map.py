"""The DDR bandwidth probe's register map (`hdl.ddrprobe.DdrProbe`), shared by the RTL, the host tool
(`firmware.ddrprobe`), the model (`sim.ddrprobe`) and the bench. Written like the NPU's (`hdl.csr_map`: the
same `Register`/`Field` classes, 32-bit registers at byte offsets, 64-bit quantities as ``_LO``/``_HI``
pairs, low word first) and pure Python, so a board-side tool can import it alone.

The probe reads a weight matrix the way the GEMV engine's dense mode does (`hdl.gemv.GemvPort`): ROWS rows
of ROW_BYTES bytes from WBASE, each row's SCALE_BYTES bytes of binary16 scales from SBASE, tiles of
TILE_ROWS rows dealt round robin to PORTS ports, PASSES times. Writing CTRL.START while idle latches the
configuration, zeroes the counters and runs; STATUS.DONE (and the interrupt) follows when the last beat
of the last pass is in.
"""

from __future__ import annotations

from .csr_map import Field, Register, RegisterMap, counter_registers, hardware_hash

__all__ = ["REGISTERS", "by_name", "PROBE_ID", "PROBE_VERSION", "MAX_PORTS", "version_word", "markdown_table",
           "CTRL_START", "CTRL_IRQ_ACK", "STATUS_BUSY", "STATUS_DONE", "STATUS_ERROR", "STATUS_CONFIG_ERROR",
           "COUNTERS", "LAT_MIN_NONE", "GEMV_TILE_ROWS", "MAX_TILE_ROWS", "ROW_BYTES_BITS", "SCALE_BYTES_BITS",
           "gemv_chunk_bytes"]

PROBE_ID = 0x4444_5250          # "DDRP" (the NPU answers 0x47334E31, "G3N1", at the same offset)
PROBE_VERSION = 2               # 2: the GEMV engine's tiles and scales (1: address-order chunks)
MAX_PORTS = 4                   # BYTES_P0 .. BYTES_P3: the KV260's HP0..HP3
LAT_MIN_NONE = 0xFFFF_FFFF      # LAT_MIN after a run without bursts

# The GEMV engine's tile (`hdl.gemv.GemvEngine`'s default tile_rows: the smallest power of two above the
# binary32 adder's latency of 6) and the ranges the probe accepts.
GEMV_TILE_ROWS = 8
MAX_TILE_ROWS = 1024            # TILE_ROWS: a power of two 1 .. 1024
ROW_BYTES_BITS = 24             # ROW_BYTES below 2**24 (the engine's rows: at most 32 KiB)
SCALE_BYTES_BITS = 20           # SCALE_BYTES below 2**20 (the engine's: at most 2 x 65,535 groups)



def gemv_chunk_bytes(hw) -> int:
    """Bytes of one of the GEMV engine's row chunks for the `hdl.config.HardwareConfig` `hw` (`hdl.gemv.GemvPort`:
    ``max(axi_max_burst_beats, act_block / weights_per_beat)`` beats, at least one full burst and whole
    activation blocks; kv260: 16 beats, 256 bytes)."""
    return max(hw.axi_max_burst_beats, hw.act_block // hw.weights_per_beat, 1) * hw.bytes_per_beat


# CTRL and STATUS bits (START and IRQ_ACK at the NPU's positions).
CTRL_START, CTRL_IRQ_ACK = 1 << 0, 1 << 2
STATUS_BUSY, STATUS_DONE, STATUS_ERROR, STATUS_CONFIG_ERROR = 1 << 0, 1 << 1, 1 << 2, 1 << 3

# The 64-bit counters, zeroed at START.
COUNTERS = (
    ("CYCLES", "cycles from START to DONE"),
    ("BURSTS", "read bursts issued (AR handshakes), all ports"),
    ("ERROR_BEATS", "R beats answered SLVERR or DECERR, all ports"),
    ("LAT_SUM", "sum over bursts of the read latency: cycles from the AR handshake to the first R beat"),
) + tuple((f"BYTES_P{p}", f"bytes read on port {p} (R beats x bytes per beat)") for p in range(MAX_PORTS))


def version_word(hardware: dict) -> int:
    """The VERSION register of a probe built for `hardware` (`HardwareConfig.to_dict()`): probe version
    (7:0), the hardware hash of `hdl.csr_map.hardware_hash` (31:8)."""
    return PROBE_VERSION | hardware_hash(hardware) << 8


def _build() -> RegisterMap:
    regs = [
        Register("ID", 0x000, "ro", "constant 0x44445250 (\"DDRP\"): the DDR probe is present", reset=PROBE_ID),
        Register("VERSION", 0x004, "ro", "probe version (bits 7:0); hardware preset hash (bits 31:8)"),
        Register("CTRL", 0x008, "cmd", "commands", fields=(
            Field("START", 0, 1, "latch the configuration, zero the counters and run (ignored while busy)"),
            Field("IRQ_ACK", 2, 1, "clear DONE (the interrupt line)"))),
        Register("STATUS", 0x00C, "ro", "state of the probe", fields=(
            Field("BUSY", 0, 1, "a run is in progress"),
            Field("DONE", 1, 1, "the last run finished (the interrupt line; IRQ_ACK or START clear it)"),
            Field("ERROR", 2, 1, "the last run had R beats with an error response (ERROR_BEATS)"),
            Field("CONFIG_ERROR", 3, 1, "the last START was refused: PORTS above the ports built, TILE_ROWS "
                                        "not a power of two up to 1024, ROW_BYTES or SCALE_BYTES too large, or "
                                        "ROW_BYTES 0 with ROWS not 0 (DONE is set, nothing read)"))),
        Register("PORTS", 0x010, "rw", "ports used, 1 .. the ports built (0: all of them); tile j goes to port "
                 "j mod PORTS"),
        Register("MAX_OUTSTANDING", 0x014, "rw", "read bursts in flight per port (0, or more than the "
                 "hardware's axi_max_outstanding: that maximum)"),
        Register("ROWS", 0x018, "rw", "rows of the matrix"),
        Register("ROW_BYTES", 0x01C, "rw", "bytes per row (INT4: ceil(cols / 2)), below 2**24"),
        Register("WBASE_LO", 0x020, "rw", "DDR byte address of row 0"),
        Register("WBASE_HI", 0x024, "rw", "high word of WBASE"),
        Register("SBASE_LO", 0x028, "rw", "DDR byte address of row 0's scales (row-major, SCALE_BYTES per row)"),
        Register("SBASE_HI", 0x02C, "rw", "high word of SBASE"),
        Register("SCALE_BYTES", 0x030, "rw", "scale bytes per row (2 x groups; 0: no scale transfers), below "
                 "2**20"),
        Register("TILE_ROWS", 0x034, "rw", "rows per tile, a power of two 1 .. 1024 (the GEMV engine's: 8)",
                 reset=GEMV_TILE_ROWS),
        Register("PASSES", 0x038, "rw", "passes over the matrix, each after the previous one has ended on "
                 "every port (0: 1)", reset=1),
        Register("LAT_MIN", 0x040, "ro", "smallest read latency of the last run (0xFFFFFFFF: no burst)"),
        Register("LAT_MAX", 0x044, "ro", "largest read latency of the last run"),
    ]
    return RegisterMap("DDR probe CSR", regs + counter_registers(COUNTERS, 0x100))


MAP = _build()
REGISTERS: tuple[Register, ...] = MAP.registers
by_name = MAP.by_name
markdown_table = MAP.markdown_table
