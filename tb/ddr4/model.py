"""A cycle model of the K26 SOM's DDR4 channel behind the Zynq UltraScale+ DDR controller (pure Python).

One shared DDR4-2400 x64 channel (four 8 Gb x16 devices in one rank: 2 bank groups x 4 banks, 64K rows of
8 KB across the rank), driven one command per DRAM clock (1,200 MHz, tCK = 0.833 ns) by a model of the
controller: per-port queues (the XPIs), a round-robin port arbiter that moves 64-byte HIF commands into a
read CAM and a write CAM, and a scheduler that picks one command per clock, oldest row hit first, then the
oldest request's ACT or PRE (first-ready, first-come-first-served), keeping rows open. Refresh is all-bank:
every tREFI the controller stops opening rows, finishes the CAS of requests it already queued for open rows,
precharges all banks (PREA) and refreshes (REF), after which nothing opens a row for tRFC.

Requests come from the fabric's ports (HP0..HP3, ``port_bytes`` per beat at ``fabric_hz``): `Ddr4Channel.read`
and `Ddr4Channel.write` take a burst (a port, a byte address, a length, the fabric cycle it arrived), cut it
into 64-byte DRAM bursts (BL8 on the 64-bit bus), and `Ddr4Channel.advance` runs the DRAM clock up to a fabric
cycle. A read burst's beats become available to the port as its DRAM bursts' data leave the bus (plus
``response_ck``), and the port delivers them in order, one per fabric cycle (all bursts of a port share one
AXI ID, so the XPI returns them in order). A write is posted: its B response is due once all its DRAM bursts
are in the write CAM. Data semantics: a write's bytes are visible to every read that enters the controller
after it (`Ddr4Channel.memory`).

Every command goes to `Ddr4Channel.log` as a `Command`; `check_timing` re-checks a log against the JEDEC
constraints independently of the scheduler (the random tests run it).

Parameters and their sources: `Ddr4Params`. Simplifications (what the model leaves out): one rank, no ECC, no
DRAM power-down or self-refresh, no ZQ calibration, no refresh postponement (DDR4 allows up to 8), no
per-port QoS or aging (the HP ports' default is best-effort round robin), no read-data backpressure (the
port's read buffer takes every beat the DRAM delivers), no write-to-read forwarding inside the controller
(data semantics are the order of entry instead), the address map of `Ddr4Params` (row, bank, bank group,
column from the top; the K26's boot-time ADDRMAP values were not found).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from fractions import Fraction

__all__ = ["Ddr4Params", "Burst", "Command", "Ddr4Channel", "check_timing", "TimingViolation"]


@dataclass(frozen=True)
class Ddr4Params:
    """The channel, its DRAM timing (in DRAM clocks, tCK = 1/``clock_hz``) and the controller.

    ==================  ==========  =================================================================================
    parameter           value       source
    ==================  ==========  =================================================================================
    clock_hz            1.2 GHz     DDR4-2400: 2,400 MT/s, two transfers per clock. K26 SOM data sheet (DS987):
                                    "4 GB 64-bit wide, 2400 Mb/s memory"
    bus_bytes           8           the 64-bit channel (DS987)
    burst_length        8           DDR4 BL8 (JEDEC JESD79-4; Micron 8Gb DDR4 data sheet): 64 bytes per burst,
                                    4 clocks on the bus
    bank_groups         2           an x16 DDR4 device has 2 bank groups of 4 banks (Micron MT40A512M16 data
    banks_per_group     4           sheet; gem5's DDR4_2400_4x16 model of it). 4 GB on 64 bits in x16 parts is four
                                    8 Gb devices (MT40A512M16 class); DS987 does not name the part
    rows, columns       65536, 1024 8 Gb x16: 64K rows, 1K columns (2 KB page per device, 8 KB across the rank)
    CL                  17          DDR4-2400 speed bin 17-17-17 (Micron -083: tAA = tRCD = tRP = 14.16 ns)
    CWL                 12          Micron DDR4-2400 speed bin: CWL 12 or 16 (the lower one)
    tRCD, tRP           17, 17      14.16 ns (speed bin 17-17-17)
    tRAS                39          32 ns (speed bin), rounded up to clocks
    tRC                 56          tRAS + tRP (46.16 ns)
    tCCD_S              4           Micron data sheet (4 CK, every speed)
    tCCD_L              6           max(4 CK, 5 ns) at 2400 (Micron; gem5: "@2400 data rate, tCCD_L is 6 CK")
    tRRD_S              7           2 KB page: max(4 CK, 5.3 ns) (Micron; gem5 DDR4_2400_4x16)
    tRRD_L              8           2 KB page: max(4 CK, 6.4 ns)
    tFAW                36          2 KB page: 30 ns
    tWR                 18          15 ns
    tWTR_S, tWTR_L      3, 9        max(2 CK, 2.5 ns), max(4 CK, 7.5 ns)
    tRTP                9           max(4 CK, 7.5 ns)
    tRTW                11          read CAS to write CAS on one rank: CL + BL/2 + 2 - CWL (JEDEC's RL + BL/2 -
                                    WL + 2 tCK turnaround; gem5 uses the same 2 CK)
    tRFC                420         8 Gb die: tRFC1 = 350 ns (Micron 8Gb; gem5 "tRFC is 350ns")
    tREFI               9360        7.8 us (JEDEC at <= 85 C; UG1087 RFSHTMG: "7.8us for DDR3 and DDR4")
    read_cam            64          the DDRC's read CAM entries (64-byte HIF commands). UG1085 names the CAM
    write_cam           64          but not its depth; 64 + 64 is the largest configuration of the controller
                                    family (Synopsys uMCTL2, "up to 64 reads plus 64 writes"): an assumption
    write_high          48          write CAM entries that switch the scheduler to writes while reads wait, and
    write_low           16          the level it drains to (UG1085's read/write arbitration prefers reads and
                                    stays in one direction; the thresholds are not documented: an assumption)
    request_ck          24          DRAM clocks from a port's address handshake to the controller's queue, and
    response_ck         24          from the data on the DRAM bus to the port (the AFI FIFO's clock crossing,
                                    the XPI, the PHY): 20 ns each way, NOT SOURCED (no figure found in UG1085
                                    or DS987); the streaming efficiency does not depend on them while the
                                    outstanding bursts cover them, the latency figures do
    ==================  ==========  =================================================================================

    Address map (``address_map``, the fields from the top): the 64-bit bus gives byte bits [2:0], a BL8 burst
    bits [5:3]; the default "row-bank-bg-column" puts the rest of the column above them to bit 12 (an 8 KB
    row), then the bank group (bit 13), the bank (bits 15:14), the row (bits 31:16). The DDRC maps HIF
    address bits to column, bank, bank group and row bits with its ADDRMAP registers (UG1087 ADDRMAP0..11);
    the values the K26 boot firmware programs were not found, so this map is an assumption (Vivado's "row
    bank column" ordering). "row-column-bank-bg" interleaves the banks at every 64-byte burst instead
    (bank group bit 6, bank bits 8:7): `benchmarks.ddr --map` measures the stream under either.

    Port arbitration: UG1085 "Port Arbiter": read/write arbitration, priority by aging and QoS, then round robin
    among ports of the same priority. The HP ports share XPIs (HP1 and HP2 share XPI 4; HP0 shares one with the
    DisplayPort, HP3 with the FPD DMA, both idle here), so the model arbitrates round robin over the ports at
    equal priority, one HIF command per DRAM clock.
    """

    clock_hz: int = 1_200_000_000
    bus_bytes: int = 8
    burst_length: int = 8
    bank_groups: int = 2
    banks_per_group: int = 4
    rows: int = 65536
    columns: int = 1024
    CL: int = 17
    CWL: int = 12
    tRCD: int = 17
    tRP: int = 17
    tRAS: int = 39
    tRC: int = 56
    tCCD_S: int = 4
    tCCD_L: int = 6
    tRRD_S: int = 7
    tRRD_L: int = 8
    tFAW: int = 36
    tWR: int = 18
    tWTR_S: int = 3
    tWTR_L: int = 9
    tRTP: int = 9
    tRTW: int = 11
    tRFC: int = 420
    tREFI: int = 9360
    read_cam: int = 64
    write_cam: int = 64
    write_high: int = 48
    write_low: int = 16
    request_ck: int = 24
    response_ck: int = 24
    refresh: bool = True
    address_map: str = "row-bank-bg-column"

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "refresh":
                if not isinstance(v, bool):
                    raise TypeError(f"Ddr4Params.refresh must be a bool, not {v!r}")
                continue
            if f.name == "address_map":
                if not isinstance(v, str) or sorted(v.split("-")) != ["bank", "bg", "column", "row"]:
                    raise ValueError(f"Ddr4Params.address_map must order row, bank, bg and column (from the top, "
                                     f"joined by '-'), not {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Ddr4Params.{f.name} must be an integer >= 0, not {v!r}")
        for name in ("bank_groups", "banks_per_group", "rows", "columns", "bus_bytes", "burst_length"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Ddr4Params.{name} must be a power of two, not {v!r}")
        if not 0 < self.write_low < self.write_high <= self.write_cam:
            raise ValueError(f"Ddr4Params needs 0 < write_low < write_high <= write_cam, not {self.write_low}, "
                             f"{self.write_high}, {self.write_cam}")
        if self.read_cam < 1:
            raise ValueError("Ddr4Params.read_cam must be at least 1")

    @property
    def burst_bytes(self) -> int:
        """Bytes of one DRAM burst (64)."""
        return self.bus_bytes * self.burst_length

    @property
    def burst_ck(self) -> int:
        """DRAM clocks a burst occupies the data bus (4)."""
        return self.burst_length // 2

    @property
    def banks(self) -> int:
        return self.bank_groups * self.banks_per_group

    @property
    def row_bytes(self) -> int:
        """Bytes of one row across the rank (8 KB)."""
        return self.columns * self.bus_bytes

    @property
    def capacity(self) -> int:
        return self.row_bytes * self.banks * self.rows

    @property
    def peak_bytes_per_s(self) -> float:
        """2 x clock x bus bytes: 19.2 GB/s."""
        return 2 * self.clock_hz * self.bus_bytes

    def locate(self, addr: int) -> tuple[int, int, int, int]:
        """(bank group, bank in the group, row, column) of a byte address (``address_map``, class docstring)."""
        sizes = {"column": self.columns // self.burst_length, "bg": self.bank_groups, "bank": self.banks_per_group,
                 "row": self.rows}
        a = (addr % self.capacity) // self.burst_bytes
        v = {}
        for name in reversed(self.address_map.split("-")):
            v[name] = a % sizes[name]
            a //= sizes[name]
        col = v["column"] * self.burst_length + (addr // self.bus_bytes) % self.burst_length
        return v["bg"], v["bank"], v["row"], col


@dataclass(eq=False)
class Burst:
    """One AXI burst from a port: what it asked for, and when it is served (fabric cycles).

    ``ready``: for a read, the fabric cycle each of its ``port_bytes`` beats is available at the port, in
    order (`Ddr4Channel` delivers a port's beats in order, one per fabric cycle; the list grows as the DRAM
    bursts behind the beats are scheduled); for a write, one entry: the cycle its B response is due. ``done``:
    the last of them, once all are known (else None)."""
    port: int
    addr: int
    nbytes: int
    write: bool
    arrival: int
    data: bytes | None = None
    ready: list[int] = field(default_factory=list)
    read_data: bytes | None = None
    pieces_left: int = 0
    _avail: list[int] = field(default_factory=list)

    @property
    def beats(self) -> int:
        """Entries of a complete ``ready``: the read's beats, or the write's one response."""
        return len(self._avail) if not self.write else 1

    @property
    def done(self) -> int | None:
        return self.ready[-1] if len(self.ready) == self.beats else None


@dataclass(frozen=True)
class Command:
    """One DRAM command: its clock, kind (ACT, PRE, PREA, REF, RD, WR), bank group, bank, row, column."""
    ck: int
    kind: str
    bg: int = -1
    bank: int = -1
    row: int = -1
    col: int = -1


@dataclass(eq=False)
class _Piece:
    """A 64-byte HIF command in the CAM."""
    burst: Burst
    index: int              # which 64-byte piece of the burst (data offset)
    addr: int
    bg: int
    bank: int
    row: int
    col: int
    entered: int            # DRAM clock it entered the CAM


class _Bank:
    __slots__ = ("row", "act_ok", "cas_ok", "pre_ok", "last_act")

    def __init__(self):
        self.row = None     # the open row, or None
        self.act_ok = 0     # earliest ACT (tRP after PRE, tRC after ACT, tRFC after REF)
        self.cas_ok = 0     # earliest RD/WR (tRCD after ACT)
        self.pre_ok = 0     # earliest PRE (tRAS after ACT, tRTP after RD, write recovery after WR)
        self.last_act = -10 ** 9


class Ddr4Channel:
    """The channel and its controller (module docstring), clocked by `advance`.

    Parameters
    ----------
    params : Ddr4Params
    fabric_hz : the clock of the ports (requests and beats count in its cycles).
    ports : number of ports (HP0 ..).
    port_bytes : bytes per beat of a port (16: 128-bit HP ports).
    memory : bytearray or None. The bytes behind the channel (addresses modulo its length); None: reads
        return no data (timing only).
    log : keep every command in `log` (the tests check it; long runs may turn it off).
    start : the fabric cycle the channel starts at (its first refresh falls due tREFI later).
    """

    def __init__(self, params: Ddr4Params = Ddr4Params(), *, fabric_hz: float, ports: int = 4,
                 port_bytes: int = 16, memory: bytearray | None = None, log: bool = True, start: int = 0):
        if not fabric_hz > 0:
            raise ValueError(f"fabric_hz must be positive, not {fabric_hz!r}")
        if ports < 1:
            raise ValueError(f"ports must be at least 1, not {ports!r}")
        if port_bytes < 1 or params.burst_bytes % port_bytes:
            raise ValueError(f"port_bytes must divide the {params.burst_bytes}-byte DRAM burst, not {port_bytes!r}")
        self.p = params
        self.ratio = Fraction(params.clock_hz) / Fraction(fabric_hz).limit_denominator(10 ** 6)  # DRAM clocks/cycle
        self.ports = ports
        self.port_bytes = port_bytes
        self.memory = memory
        self.keep_log = log
        self.log: list[Command] = []
        self.now = self.start_ck = self.to_ck(start)  # the next DRAM clock to run
        self.banks = [[_Bank() for _ in range(params.banks_per_group)] for _ in range(params.bank_groups)]
        self.xpi = [deque() for _ in range(ports)]   # per port: (visible at ck, piece) in order
        self.rr = 0                                   # round-robin pointer of the port arbiter
        self.read_cam: list[_Piece] = []
        self.write_cam: list[_Piece] = []
        self.writing = False                          # the scheduler's direction
        self.last_cas = -10 ** 9
        self.last_cas_bg = [-10 ** 9] * params.bank_groups
        self.last_rd = -10 ** 9
        self.last_wr_end = -10 ** 9                   # end of the last write's data on the bus
        self.last_wr_end_bg = [-10 ** 9] * params.bank_groups
        self.acts: deque = deque(maxlen=4)            # the last four ACTs (tFAW)
        self.last_act = -10 ** 9
        self.last_act_bg = [-10 ** 9] * params.bank_groups
        self.refresh_due = self.now + params.tREFI if params.refresh else None
        self.refresh_state = None                     # None, "drain" (PREA next) or the REF clock due
        self.pending: list[list[Burst]] = [[] for _ in range(ports)]   # reads per port in order, not all delivered
        self.delivered = [-1] * ports                 # fabric cycle of the port's last delivered beat
        self.busy_ck = 0                              # DRAM clocks with data on the bus
        self.commands = 0

    # --- clocks ---------------------------------------------------------------------------------------------

    def to_ck(self, cycle: int) -> int:
        """The first DRAM clock at or after the start of fabric `cycle`."""
        return math.ceil(cycle * self.ratio)

    def to_cycle(self, ck: int) -> int:
        """The first fabric cycle that starts at or after DRAM clock `ck`."""
        return math.ceil(ck / self.ratio)

    # --- requests -------------------------------------------------------------------------------------------

    def read(self, port: int, addr: int, nbytes: int, at: int) -> Burst:
        """A read burst of `nbytes` from `addr` on `port`, its address handshake in fabric cycle `at`."""
        return self._submit(Burst(port, addr, nbytes, False, at))

    def write(self, port: int, addr: int, data: bytes, at: int) -> Burst:
        """A write burst of `data` to `addr` on `port`, complete (address and last data beat) in cycle `at`."""
        return self._submit(Burst(port, addr, len(data), True, at, data=bytes(data)))

    def _submit(self, b: Burst) -> Burst:
        if not 0 <= b.port < self.ports:
            raise ValueError(f"port must be 0..{self.ports - 1}, not {b.port!r}")
        if b.nbytes < 1 or b.addr % self.port_bytes or b.nbytes % self.port_bytes:
            raise ValueError(f"a burst is whole {self.port_bytes}-byte beats at a beat address, not {b.nbytes} "
                             f"bytes at {b.addr:#x}")
        if self.to_ck(b.arrival) < self.now:
            raise ValueError(f"a burst arriving in cycle {b.arrival} is in the past (DRAM clock {self.now})")
        bb = self.p.burst_bytes
        first, last = b.addr // bb, (b.addr + b.nbytes - 1) // bb
        visible = self.to_ck(b.arrival) + self.p.request_ck
        b.pieces_left = last - first + 1
        if not b.write:
            b._avail = [None] * (b.nbytes // self.port_bytes)
            b.read_data = bytearray(b.nbytes) if self.memory is not None else None
            self.pending[b.port].append(b)
        for k, blk in enumerate(range(first, last + 1)):
            a = blk * bb
            bg, bank, row, col = self.p.locate(a)
            self.xpi[b.port].append((visible, _Piece(b, k, a, bg, bank, row, col, -1)))
        return b

    # --- the clock ----------------------------------------------------------------------------------------

    def advance(self, cycle: int) -> None:
        """Run the DRAM clock up to the start of fabric `cycle` (its clocks before it)."""
        end = self.to_ck(cycle)
        while self.now < end:
            if self._idle():
                nxt = min([end] + [q[0][0] for q in self.xpi if q] +
                          ([self.refresh_due] if self.refresh_due is not None else []))
                if nxt > self.now:
                    self.now = nxt
                    continue
            self._step(self.now)
            self.now += 1
        self._deliver(cycle)

    def run(self, limit: int = 10 ** 9) -> int:
        """Advance until every submitted burst is served; returns the fabric cycle after the last."""
        cycle = self.to_cycle(self.now)
        while self._busy():
            cycle = self.to_cycle(self.now) + 1
            if cycle > limit:
                raise RuntimeError(f"the channel did not finish by fabric cycle {limit}")
            self.advance(cycle)
        self._deliver(10 ** 18)
        return cycle

    def _busy(self) -> bool:
        return bool(self.read_cam or self.write_cam or any(self.xpi) or any(self.pending))

    def _idle(self) -> bool:
        return not (self.read_cam or self.write_cam or self.refresh_state is not None or
                    any(q and q[0][0] <= self.now for q in self.xpi))

    def _step(self, ck: int) -> None:
        p = self.p
        if self.refresh_due is not None and ck >= self.refresh_due and self.refresh_state is None:
            self.refresh_state = "drain"
        self._arbitrate(ck)
        if self.refresh_state is not None and self._refresh(ck):
            return
        cmd = self._schedule(ck)
        if cmd is not None:
            self.commands += 1

    def _arbitrate(self, ck: int) -> None:
        """The port arbiter: one HIF command per clock from the next port (round robin) with one visible and
        room for it in its CAM."""
        p = self.p
        for k in range(self.ports):
            port = (self.rr + k) % self.ports
            q = self.xpi[port]
            if not q or q[0][0] > ck:
                continue
            piece = q[0][1]
            cam, size = (self.write_cam, p.write_cam) if piece.burst.write else (self.read_cam, p.read_cam)
            if len(cam) >= size:
                continue
            q.popleft()
            piece.entered = ck
            cam.append(piece)
            b = piece.burst
            if b.write:
                if self.memory is not None:
                    off = piece.index * p.burst_bytes - (b.addr % p.burst_bytes)
                    lo, hi = max(off, 0), min(off + p.burst_bytes, b.nbytes)
                    start = (piece.addr + lo - off) % len(self.memory)
                    self.memory[start:start + hi - lo] = b.data[lo:hi]
                b.pieces_left -= 1
                if not b.pieces_left:      # posted: B once the burst is in the controller
                    b.ready = [self.to_cycle(ck + 1 + p.response_ck)]
            elif self.memory is not None:
                off = piece.index * p.burst_bytes - (b.addr % p.burst_bytes)
                lo, hi = max(off, 0), min(off + p.burst_bytes, b.nbytes)
                start = (piece.addr + lo - off) % len(self.memory)
                b.read_data[lo:hi] = self.memory[start:start + hi - lo]
            self.rr = (port + 1) % self.ports
            return

    def _refresh(self, ck: int) -> bool:
        """Refresh: True if it took the command slot (or holds the rows closed) this clock."""
        p = self.p
        if self.refresh_state == "drain":
            # CAS of requests queued before the refresh fell due, for rows already open, go first
            for piece in self.read_cam + self.write_cam:
                bank = self.banks[piece.bg][piece.bank]
                if piece.entered < self.refresh_due and bank.row == piece.row:
                    return False
            open_banks = [b for g in self.banks for b in g if b.row is not None]
            if any(b.pre_ok > ck for b in open_banks):
                return True
            if open_banks:
                for b in open_banks:
                    b.row = None
                    b.act_ok = max(b.act_ok, ck + p.tRP)
                self._log(Command(ck, "PREA"))
                self.refresh_state = ck + p.tRP
                return True
            self.refresh_state = max(ck, max(b.act_ok for g in self.banks for b in g))
        if ck < self.refresh_state:
            return True
        self._log(Command(ck, "REF"))
        for g in self.banks:
            for b in g:
                b.act_ok = max(b.act_ok, ck + p.tRFC)
        self.refresh_state = None
        self.refresh_due += p.tREFI
        return True

    def _schedule(self, ck: int) -> Command | None:
        """One command: the oldest CAS that can go (a row hit), else the oldest request's ACT or PRE that can."""
        p = self.p
        if self.writing:
            if not self.write_cam or (self.read_cam and len(self.write_cam) <= p.write_low):
                self.writing = False
        elif self.write_cam and (not self.read_cam or len(self.write_cam) >= p.write_high):
            self.writing = True
        if self.refresh_state == "drain":
            # only the CAS of requests queued before the refresh fell due, to rows already open, either direction
            for cam in (self.read_cam, self.write_cam):
                for piece in cam:
                    bank = self.banks[piece.bg][piece.bank]
                    if bank.row == piece.row and piece.entered < self.refresh_due and self._cas_ok(ck, piece, bank):
                        return self._cas(ck, piece, bank, cam)
            return None
        cam = self.write_cam if self.writing else self.read_cam
        if not cam:
            return None
        for piece in cam:
            bank = self.banks[piece.bg][piece.bank]
            if bank.row == piece.row and self._cas_ok(ck, piece, bank):
                return self._cas(ck, piece, bank, cam)
        wanted = {(q.bg, q.bank, q.row) for q in cam}
        for piece in cam:
            bank = self.banks[piece.bg][piece.bank]
            if bank.row == piece.row:
                continue
            if bank.row is None:
                if self._act_ok(ck, piece.bg, bank):
                    return self._act(ck, piece, bank)
            elif (piece.bg, piece.bank, bank.row) not in wanted and bank.pre_ok <= ck:
                bank.row = None
                bank.act_ok = max(bank.act_ok, ck + p.tRP)
                return self._log(Command(ck, "PRE", piece.bg, piece.bank))
        return None

    def _cas_ok(self, ck, piece, bank) -> bool:
        p = self.p
        if ck < bank.cas_ok or ck < self.last_cas + p.tCCD_S or ck < self.last_cas_bg[piece.bg] + p.tCCD_L:
            return False
        if piece.burst.write:
            return ck >= self.last_rd + p.tRTW
        return ck >= self.last_wr_end + p.tWTR_S and ck >= self.last_wr_end_bg[piece.bg] + p.tWTR_L

    def _act_ok(self, ck, bg, bank) -> bool:
        p = self.p
        return (ck >= bank.act_ok and ck >= self.last_act + p.tRRD_S and
                ck >= self.last_act_bg[bg] + p.tRRD_L and (len(self.acts) < 4 or ck >= self.acts[0] + p.tFAW))

    def _act(self, ck, piece, bank) -> Command:
        p = self.p
        bank.row = piece.row
        bank.cas_ok = ck + p.tRCD
        bank.pre_ok = ck + p.tRAS
        bank.act_ok = ck + p.tRC
        bank.last_act = ck
        self.last_act = ck
        self.last_act_bg[piece.bg] = ck
        self.acts.append(ck)
        return self._log(Command(ck, "ACT", piece.bg, piece.bank, piece.row))

    def _cas(self, ck, piece, bank, cam) -> Command:
        p = self.p
        cam.remove(piece)
        self.last_cas = ck
        self.last_cas_bg[piece.bg] = ck
        b = piece.burst
        if b.write:
            end = ck + p.CWL + p.burst_ck
            self.last_wr_end = end
            self.last_wr_end_bg[piece.bg] = end
            bank.pre_ok = max(bank.pre_ok, end + p.tWR)
            self.busy_ck += p.burst_ck
            return self._log(Command(ck, "WR", piece.bg, piece.bank, piece.row, piece.col))
        self.last_rd = ck
        bank.pre_ok = max(bank.pre_ok, ck + p.tRTP)
        self.busy_ck += p.burst_ck
        # the port's beats of this DRAM burst: beat i of 16 bytes leaves the bus at the end of clock ck + CL + i'
        base = piece.index * p.burst_bytes - (b.addr % p.burst_bytes)
        per_ck = 2 * p.bus_bytes
        for j in range(p.burst_bytes // self.port_bytes):
            off = base + j * self.port_bytes
            if 0 <= off < b.nbytes:
                last_byte_ck = ck + p.CL + (j * self.port_bytes + self.port_bytes - 1) // per_ck
                b._avail[off // self.port_bytes] = self.to_cycle(last_byte_ck + 1 + p.response_ck)
        b.pieces_left -= 1
        return self._log(Command(ck, "RD", piece.bg, piece.bank, piece.row, piece.col))

    def _log(self, cmd: Command) -> Command:
        if self.keep_log:
            self.log.append(cmd)
        return cmd

    def _deliver(self, cycle: int) -> None:
        """Extend `Burst.ready` of each port's read bursts in order by the beats whose data is scheduled, one
        beat per fabric cycle per port (a beat waits for the beats before it, of its burst and the port's
        earlier bursts)."""
        for port, q in enumerate(self.pending):
            while q:
                b = q[0]
                t = self.delivered[port]
                while len(b.ready) < len(b._avail) and b._avail[len(b.ready)] is not None:
                    t = max(b._avail[len(b.ready)], t + 1)
                    b.ready.append(t)
                self.delivered[port] = t
                if len(b.ready) < len(b._avail):
                    break
                q.pop(0)
                if b.read_data is not None:
                    b.read_data = bytes(b.read_data)


class TimingViolation(AssertionError):
    pass


def check_timing(log: list[Command], p: Ddr4Params, start_ck: int = 0) -> int:
    """Check a command log against the DRAM's rules, independently of the scheduler: one command per clock,
    ACT to a closed bank and CAS to its open row, tRCD, tRAS, tRC, tRP, tRTP, write recovery, tCCD_S/L,
    tRRD_S/L, tFAW, tRTW, tWTR_S/L, REF with every bank closed and tRP after the last PRE, tRFC after REF, and a
    REF in every tREFI window past the first (counted from `start_ck`, `Ddr4Channel.start_ck`). Raises
    `TimingViolation` naming the rule; returns the commands checked."""
    def fail(msg, c):
        raise TimingViolation(f"{msg} at clock {c.ck}: {c}")

    NEVER = -10 ** 9
    row = {}
    last = {k: {} for k in ("act", "pre", "rd", "wr_end")}
    cas, cas_bg, act, act_bg = NEVER, {}, NEVER, {}
    rd, wr_end, wr_end_bg = NEVER, NEVER, {}
    acts: list[int] = []
    ref_end, last_ck, refs = NEVER, None, []
    for c in log:
        if last_ck is not None and c.ck <= last_ck:
            fail("two commands in one clock, or out of order", c)
        last_ck = c.ck
        key = (c.bg, c.bank)
        if c.kind == "ACT":
            if row.get(key) is not None:
                fail("ACT to an open bank", c)
            if c.ck < ref_end:
                fail("ACT within tRFC of REF", c)
            if c.ck < last["act"].get(key, NEVER) + p.tRC:
                fail("tRC", c)
            if c.ck < last["pre"].get(key, NEVER) + p.tRP:
                fail("tRP", c)
            if c.ck < act + p.tRRD_S or c.ck < act_bg.get(c.bg, NEVER) + p.tRRD_L:
                fail("tRRD", c)
            if len(acts) >= 4 and c.ck < acts[-4] + p.tFAW:
                fail("tFAW", c)
            row[key] = c.row
            last["act"][key] = act = act_bg[c.bg] = c.ck
            acts.append(c.ck)
        elif c.kind in ("RD", "WR"):
            if row.get(key) != c.row:
                fail("CAS to a row that is not open", c)
            if c.ck < last["act"][key] + p.tRCD:
                fail("tRCD", c)
            if c.ck < cas + p.tCCD_S or c.ck < cas_bg.get(c.bg, NEVER) + p.tCCD_L:
                fail("tCCD", c)
            if c.kind == "RD":
                if c.ck < wr_end + p.tWTR_S or c.ck < wr_end_bg.get(c.bg, NEVER) + p.tWTR_L:
                    fail("tWTR", c)
                last["rd"][key] = rd = c.ck
            else:
                if c.ck < rd + p.tRTW:
                    fail("tRTW", c)
                last["wr_end"][key] = wr_end = wr_end_bg[c.bg] = c.ck + p.CWL + p.burst_ck
            cas = cas_bg[c.bg] = c.ck
        elif c.kind in ("PRE", "PREA"):
            keys = [key] if c.kind == "PRE" else [k for k, r in row.items() if r is not None]
            for k in keys:
                if row.get(k) is None:
                    fail("PRE to a closed bank", c)
                if c.ck < last["act"][k] + p.tRAS:
                    fail("tRAS", c)
                if c.ck < last["rd"].get(k, NEVER) + p.tRTP:
                    fail("tRTP", c)
                if c.ck < last["wr_end"].get(k, NEVER) + p.tWR:
                    fail("tWR", c)
                row[k] = None
                last["pre"][k] = c.ck
        elif c.kind == "REF":
            if any(r is not None for r in row.values()):
                fail("REF with a bank open", c)
            if any(c.ck < t + p.tRP for t in last["pre"].values()):
                fail("tRP before REF", c)
            if any(c.ck < t + p.tRC for t in last["act"].values()):
                fail("tRC before REF", c)
            ref_end = c.ck + p.tRFC
            refs.append(c.ck)
        else:
            fail("an unknown command", c)
    if p.refresh and log:
        # every refresh falls due tREFI after the one before; it waits at most for the CAS and the row
        # closing of what was queued (a CAM's worth of bursts, bounded by tRAS + tRC + the CAM at tCCD_L)
        slack = p.tRAS + p.tRC + (p.read_cam + p.write_cam) * p.tCCD_L + p.tRP
        for n, t in enumerate(refs, 1):
            due = start_ck + n * p.tREFI
            if t < due or t > due + slack:
                raise TimingViolation(f"REF {n} at clock {t}, due at {due} (slack {slack})")
        if log[-1].ck >= start_ck + (len(refs) + 1) * p.tREFI + slack:
            raise TimingViolation(f"no REF {len(refs) + 1} by clock {log[-1].ck}")
    return len(log)
