"""The L2 scratchpad and its element movers: `L2`, `ElemReader`, `ElemWriter`.

L2 holds ``hw.l2_bytes // 16`` words of 128 bits; binary32 element ``e`` lives in word ``e // 4``, lane
``e % 4`` (lane ``i`` = bits ``32 i .. 32 i + 31``). Let ``EA = (hw.l2_bytes // 4 - 1).bit_length()`` (element
address bits), ``NB = EA + 1`` (element count bits: a count of every element of L2 fits) and
``WA = EA - 2`` (word address bits); `l2_geometry` computes them.

**The memory.** One `amaranth.lib.memory.Memory` of 128-bit words with one synchronous read port and one
write port with 32-bit granularity (simple dual port), so that Vivado (and Yosys ``synth_xilinx -uram``)
maps it to UltraRAM: on ``kv260`` 64 Ki x 128 = 32 URAM288 (16 deep x 2 wide), half the XCK26's 64. Every
cycle, one read and one write can happen.

**Banks** (``banks``, default 1; the NPU's controller uses 2). The words are interleaved over ``banks``
memories (word ``w`` in bank ``w % banks``), each with its own read and write per cycle and its own
arbiters below; all banks have the same latency, so a port (granted by at most one bank per cycle) still
gets its words in request order. Two ports streaming consecutive words collide at most once and then
alternate banks, one word per cycle each. The URAM count is unchanged (each bank is half as deep).

**Arbitration.** Reads and writes are arbitrated separately (per bank), each round-robin among the *requesting* ports
(after a grant to port ``k``, port ``k + 1`` has the highest priority), so no port is starved and a single
requesting port gets every cycle. A read is granted only when its port has a *credit*: the port's response
buffer (``latency + 1`` words, a `fifo.SyncFIFO`) has room for it and for every read of that port still in
the pipeline. A client that never takes its responses therefore fills only its own buffer and then blocks
only itself; responses never wait inside the shared pipeline.

**Same-word read and write in one cycle.** The read returns the OLD data (the read port is not transparent
to the write port). Between cycles, order is grant order: a read granted after a write's grant sees it.
URAM288 executes port A before port B within a cycle (port A reading, port B writing: A reads the old data),
so the rule is native to the URAM with the read on port A. Words are written only in the lanes whose
``mask`` bit is set.

**Combinational paths.** ``rd{i}_req.ready`` depends on every read port's ``valid`` and on registered
credit counts, ``wr{j}.ready`` on every write port's ``valid``; no ``valid`` depends on a ``ready``, and
``rd{i}_resp`` comes from a FIFO (no path from ``rd{i}_resp.ready`` to anything but that FIFO's read).

**Throughput and latency.** Reads: a granted request's word is read in the next cycle, passes
``read_regs`` output registers (Vivado absorbs the first into the URAM's output register, which a 300 MHz
cascade of 16 URAMs needs) and is written into the port's buffer; it is on ``rd{i}_resp`` `latency`
= ``2 + read_regs`` cycles after the request's transfer (buffer empty). With ``latency + 1`` credits per
port, one client requesting every cycle and taking every response gets one word per cycle. Writes take one
cycle: one word per cycle.

Addresses wrap modulo the L2 size (the decoder rejects out-of-range operands, `hdl.isa`).
"""

from __future__ import annotations

from amaranth import Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from .config import HardwareConfig

__all__ = ["L2", "ElemReader", "ElemWriter", "l2_geometry", "cmd_layout", "write_layout", "elem_layout",
           "beat_layout", "WORD_BITS", "LANES", "ELEM_BITS"]

WORD_BITS = 128          # one L2 word: the AXI HP data width on kv260, four binary32 lanes
ELEM_BITS = 32           # binary32 elements travel as raw bits
LANES = WORD_BITS // ELEM_BITS


def l2_geometry(hw: HardwareConfig) -> tuple[int, int, int]:
    """``(EA, NB, WA)``: element address bits, element count bits, word address bits of `hw`'s L2."""
    if not isinstance(hw, HardwareConfig):
        raise TypeError(f"hw must be a HardwareConfig, not {hw!r}")
    ea = (hw.l2_bytes // (ELEM_BITS // 8) - 1).bit_length()
    return ea, ea + 1, ea - (LANES - 1).bit_length()


def _checked_geometry(component, hw) -> tuple[int, int, int]:
    try:
        return l2_geometry(hw)
    except (TypeError, ValueError):
        component._MustUse__silence = True     # rejected: no "created but never used" warning
        raise


def cmd_layout(hw: HardwareConfig) -> data.StructLayout:
    """``{addr: unsigned(EA), n: unsigned(NB)}``: n elements starting at element ``addr``."""
    ea, nb, _ = l2_geometry(hw)
    return data.StructLayout({"addr": unsigned(ea), "n": unsigned(nb)})


def write_layout(hw: HardwareConfig) -> data.StructLayout:
    """``{addr: unsigned(WA), data: unsigned(128), mask: unsigned(4)}``; mask bit i writes lane i."""
    _, _, wa = l2_geometry(hw)
    return data.StructLayout({"addr": unsigned(wa), "data": unsigned(WORD_BITS), "mask": unsigned(LANES)})


def elem_layout() -> data.StructLayout:
    """``{data: unsigned(32), last: 1}``: one element, ``last`` on the command's final one."""
    return data.StructLayout({"data": unsigned(ELEM_BITS), "last": 1})


def beat_layout() -> data.StructLayout:
    """``{data: unsigned(128), n: unsigned(3), last: 1}``: ``n`` (1..4) consecutive elements in lanes
    ``0 .. n-1`` of ``data`` (lane i = bits ``32 i ..``; lanes from n on are unspecified), ``last`` on the
    command's final beat."""
    return data.StructLayout({"data": unsigned(WORD_BITS), "n": unsigned(3), "last": 1})


def _round_robin(m: Module, reqs: list, name: str) -> list[Signal]:
    """One-hot grants among `reqs`, the highest priority going to the port after the last one granted."""
    n = len(reqs)
    grant = [Signal(name=f"{name}_grant{i}") for i in range(n)]
    if n == 1:
        m.d.comb += grant[0].eq(reqs[0])
        return grant
    last = Signal(range(n), name=f"{name}_last")
    with m.Switch(last):
        for prev in range(n):
            with m.Case(prev):
                order = [(prev + k) % n for k in range(1, n + 1)]
                for pos, idx in enumerate(order):
                    earlier = Cat(*(reqs[j] for j in order[:pos]))
                    m.d.comb += grant[idx].eq(reqs[idx] & ~earlier.any() if pos else reqs[idx])
    for i in range(n):
        with m.If(grant[i]):
            m.d.sync += last.eq(i)
    return grant


def one_hot_mux(grant: list, values: list):
    """AND-OR multiplexer: the value whose grant is set (grants are one-hot), else 0."""
    out = 0
    for g, v in zip(grant, values):
        out = out | Mux(g, v, 0)
    return out


def set_bits(bits):
    """(a bit of `bits` is set, two or more are), as a balanced tree of halves: no carry chain."""
    if len(bits) == 1:
        return bits[0], Const(0, 1)
    h = len(bits) // 2
    any_lo, two_lo = set_bits(bits[:h])
    any_hi, two_hi = set_bits(bits[h:])
    return any_lo | any_hi, two_lo | two_hi | (any_lo & any_hi)


class L2(wiring.Component):
    """The L2 scratchpad: simple dual-port word memory shared by arbitrated read and write ports.

    Parameters
    ----------
    hw : HardwareConfig
    read_ports : number of read ports (at least 1).
    write_ports : number of write ports (at least 1).
    read_regs : registers after the memory's read data (default 1, the URAM output register).

    Members (for i < read_ports, j < write_ports)
    -------
    rd{i}_req : In(stream unsigned(WA))       word address to read
    rd{i}_resp : Out(stream unsigned(128))    the words, in request order per port
    wr{j} : In(stream write_layout(hw))       ``{addr, data, mask}``; lane k written iff mask bit k

    Latency
    -------
    `latency` = ``2 + read_regs`` cycles from a read request's transfer to its response's ``valid``
    (empty response buffer, no competing port). Writes are done at the end of the cycle of their transfer.
    """

    def __init__(self, hw: HardwareConfig, *, read_ports: int, write_ports: int, read_regs: int = 1,
                 banks: int = 1):
        for what, v, lo in (("read_ports", read_ports, 1), ("write_ports", write_ports, 1),
                            ("read_regs", read_regs, 0), ("banks", banks, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                self._MustUse__silence = True     # rejected: no "created but never used" warning
                raise ValueError(f"{what} must be an integer of at least {lo}, not {v!r}")
        _, _, wa = _checked_geometry(self, hw)
        if banks & (banks - 1) or banks > hw.l2_bytes // (WORD_BITS // 8):
            self._MustUse__silence = True
            raise ValueError(f"banks must be a power of two of at most the L2's words, not {banks!r}")
        self._hw, self._read_ports, self._write_ports, self._read_regs = hw, read_ports, write_ports, read_regs
        self._banks = banks
        members = {}
        for i in range(read_ports):
            members[f"rd{i}_req"] = In(stream.Signature(unsigned(wa)))
            members[f"rd{i}_resp"] = Out(stream.Signature(unsigned(WORD_BITS)))
        for j in range(write_ports):
            members[f"wr{j}"] = In(stream.Signature(write_layout(hw)))
        super().__init__(members)

    @property
    def hw(self) -> HardwareConfig:
        return self._hw

    @property
    def depth(self) -> int:
        """Words of L2."""
        return self._hw.l2_bytes // (WORD_BITS // 8)

    @property
    def banks(self) -> int:
        """Word-interleaved banks (word ``w`` in bank ``w % banks``), each with its own read and write per cycle."""
        return self._banks

    @property
    def read_ports(self) -> int:
        return self._read_ports

    @property
    def write_ports(self) -> int:
        return self._write_ports

    @property
    def latency(self) -> int:
        """Cycles from a read request's transfer to its response (empty buffer)."""
        return 2 + self._read_regs

    @property
    def resp_depth(self) -> int:
        """Words of each read port's response buffer = credits per port. A credit is held from the grant
        (cycle t) until the response leaves the buffer (t + latency at the earliest), and freed the cycle
        after: latency + 1 credits sustain one word per cycle."""
        return self.latency + 1

    def elaborate(self, platform):
        m = Module()
        R, W, B = self._read_ports, self._write_ports, self._banks
        D = self.resp_depth
        bb = (B - 1).bit_length()                 # bank bits: the low bits of the word address
        bank_of = (lambda a: a[:bb]) if bb else (lambda a: Const(0, 1))
        row_of = (lambda a: a[bb:]) if bb else (lambda a: a)

        req = [getattr(self, f"rd{i}_req") for i in range(R)]
        resp = [getattr(self, f"rd{i}_resp") for i in range(R)]
        wr = [getattr(self, f"wr{j}") for j in range(W)]
        bufs = []
        owed = []                    # per port: reads granted whose response has not left the buffer
        credit = []                  # per port: owed < D, as a register of its own (the grants start from it)
        for i in range(R):
            buf = fifo.SyncFIFO(width=WORD_BITS, depth=D)
            m.submodules[f"rd{i}_buf"] = buf
            bufs.append(buf)
            owed.append(Signal(range(D + 1), name=f"rd{i}_owed"))
            credit.append(Signal(init=1, name=f"rd{i}_credit"))
        port_bits = max(1, (R - 1).bit_length())
        rgrants = [[] for _ in range(R)]          # per port: its grant by each bank
        wgrants = [[] for _ in range(W)]
        outs = []                                 # per bank: (valid, port, data) at the end of its pipeline
        for k in range(B):
            mem = Memory(shape=unsigned(WORD_BITS), depth=self.depth // B, init=[])
            m.submodules[f"mem{k}" if B > 1 else "mem"] = mem
            wp = mem.write_port(granularity=ELEM_BITS)
            rp = mem.read_port(transparent_for=())         # a same-cycle write is not seen: OLD data
            tag = f"b{k}_" if B > 1 else ""

            # --- writes: round-robin among the valid write ports of this bank, one word per cycle ------------
            wgrant = _round_robin(m, [s.valid & (bank_of(s.payload.addr) == k) for s in wr], f"{tag}wr")
            for j, g in enumerate(wgrant):
                wgrants[j].append(g)
            m.d.comb += [
                wp.addr.eq(row_of(one_hot_mux(wgrant, [s.payload.addr for s in wr]))),
                wp.data.eq(one_hot_mux(wgrant, [s.payload.data for s in wr])),
                wp.en.eq(one_hot_mux(wgrant, [s.payload.mask for s in wr])),
            ]

            # --- reads: round-robin among the ports that request this bank and hold a credit -----------------
            rgrant = _round_robin(m, [s.valid & (bank_of(s.payload) == k) & c for s, c in zip(req, credit)],
                                  f"{tag}rd")
            for i, g in enumerate(rgrant):
                rgrants[i].append(g)
            rgranted = Signal(name=f"{tag}rd_granted")
            m.d.comb += [
                rgranted.eq(Cat(*rgrant).any()),
                rp.addr.eq(row_of(one_hot_mux(rgrant, [s.payload for s in req]))),
                rp.en.eq(rgranted),
            ]

            # Pipeline: which port the word in each stage belongs to.
            s_valid, s_port = Signal(name=f"{tag}s1_valid"), Signal(port_bits, name=f"{tag}s1_port")
            m.d.sync += [s_valid.eq(rgranted), s_port.eq(one_hot_mux(rgrant, [Const(i, port_bits)
                                                                               for i in range(R)]))]
            s_data = rp.data
            for r in range(self._read_regs):
                v, p, d = (Signal(name=f"{tag}s{r + 2}_valid"), Signal(port_bits, name=f"{tag}s{r + 2}_port"),
                           Signal(WORD_BITS, name=f"{tag}s{r + 2}_data"))
                m.d.sync += [v.eq(s_valid), p.eq(s_port)]
                with m.If(s_valid):
                    m.d.sync += d.eq(s_data)
                s_valid, s_port, s_data = v, p, d
            outs.append((s_valid, s_port, s_data))

        for j, s in enumerate(wr):
            m.d.comb += s.ready.eq(Cat(*wgrants[j]).any())
        for i in range(R):
            granted = Cat(*rgrants[i]).any()
            m.d.comb += req[i].ready.eq(granted)
            # a port is granted by at most one bank per cycle and every bank has the same latency, so at most
            # one word arrives per port and cycle, in request order
            arrive = [v & (p == i) for v, p, _ in outs]
            buf = bufs[i]
            m.d.comb += [
                buf.w_data.eq(one_hot_mux(arrive, [d for _, _, d in outs])),
                buf.w_en.eq(Cat(*arrive).any()),          # a credit guarantees room
                resp[i].payload.eq(buf.r_data),
                resp[i].valid.eq(buf.r_rdy),
                buf.r_en.eq(resp[i].ready),
            ]
            popped = Signal(name=f"rd{i}_popped")
            m.d.comb += popped.eq(buf.r_rdy & resp[i].ready)
            m.d.sync += owed[i].eq(owed[i] + granted - popped)
            # owed reaches D from D (a grant and a pop, or neither) or from D - 1 (a grant, no pop)
            full = (owed[i] == D) & (granted == popped) | (owed[i] == D - 1) & granted & ~popped
            m.d.sync += credit[i].eq(~full)
        return m


class ElemReader(wiring.Component):
    """Streams ``n`` consecutive binary32 elements of L2, from any element address, out of one read port.

    Parameters
    ----------
    hw : HardwareConfig

    Members
    -------
    i_cmd : In(stream cmd_layout(hw))     ``{addr, n}``; accepted when the previous command has produced all
                                          its elements (``o_busy`` low); n = 0 is accepted and produces nothing
    o_req : Out(stream unsigned(WA))      word reads, to an `L2` ``rd{i}_req``
    i_resp : In(stream unsigned(128))     their words, from the same port's ``rd{i}_resp``
    o_elem : Out(stream elem_layout())    the elements ``addr .. addr + n - 1`` in order, ``last`` on the n-th
    o_busy : Out(1)                       a command is producing elements

    With ``beats=True`` (the reader that feeds the activation quantiser) there are also:

    i_beats : In(1)                       sampled with each command: 1 = the command's elements leave on
                                          ``o_beat`` instead of ``o_elem``
    o_beat : Out(stream beat_layout())    four consecutive elements per beat (the last beat the rest), from
                                          any element address: ``addr + 4 j .. addr + 4 j + 3`` in lanes 0..3

    Notes
    -----
    The reader requests exactly the words ``addr // 4 .. (addr + n - 1) // 4``, as fast as the L2 port's
    credits allow, so several reads are always in flight; it needs one word per four elements, so
    ``o_elem`` runs at one element per cycle once the first word has arrived (``latency`` + 2 cycles after
    the command). A word is taken from ``i_resp`` in the cycle its predecessor's last lane leaves.

    ``o_beat`` runs at one beat (four elements) per cycle, one word per cycle from L2. At an address that
    is not a multiple of four a beat is the held word's lanes ``addr % 4 ..`` followed by the next word's
    first lanes, taken straight from ``i_resp`` in the cycle of the beat (so the beat waits for that word),
    and that word is then held for the next beat.
    """

    def __init__(self, hw: HardwareConfig, *, beats: bool = False):
        _, _, wa = _checked_geometry(self, hw)
        self._hw = hw
        self._beats = bool(beats)
        ports = {
            "i_cmd": In(stream.Signature(cmd_layout(hw))),
            "o_req": Out(stream.Signature(unsigned(wa))),
            "i_resp": In(stream.Signature(unsigned(WORD_BITS))),
            "o_elem": Out(stream.Signature(elem_layout())),
            "o_busy": Out(1),
        }
        if self._beats:
            ports.update({"i_beats": In(1), "o_beat": Out(stream.Signature(beat_layout()))})
        super().__init__(ports)

    def elaborate(self, platform):
        m = Module()
        _, nb, wa = l2_geometry(self._hw)
        lane_bits = (LANES - 1).bit_length()

        req_addr = Signal(wa)
        req_left = Signal(nb)              # words still to request
        elems_left = Signal(nb)            # elements still to produce
        lane = Signal(lane_bits)           # lane of the next element in `word`
        word = Signal(WORD_BITS)
        have = Signal()                    # `word` holds unsent lanes

        # elems_left != 0 and req_left != 0, each a flag registered with its count (no compare of the count
        # ahead of the handshakes it gates)
        busy = Signal()
        req_any = Signal()
        more = Signal()                    # elems_left > LANES: more than one beat left
        m.d.comb += [self.o_busy.eq(busy), self.i_cmd.ready.eq(~busy)]
        beat_mode = Signal()               # the command's elements leave on o_beat
        with m.If(self.i_cmd.valid & ~busy):
            addr, n = self.i_cmd.payload.addr, self.i_cmd.payload.n
            first = addr[lane_bits:]
            # words touched: (addr % 4 + n + 3) // 4, or none for n = 0
            m.d.sync += [
                req_addr.eq(first),
                req_left.eq(Mux(n == 0, 0, (addr[:lane_bits] + n + (LANES - 1)) >> lane_bits)),
                req_any.eq(n != 0),
                elems_left.eq(n),
                busy.eq(n != 0),
                more.eq(n > LANES),
                lane.eq(addr[:lane_bits]),
            ]
            if self._beats:
                m.d.sync += beat_mode.eq(self.i_beats)

        m.d.comb += [self.o_req.valid.eq(req_any), self.o_req.payload.eq(req_addr)]
        with m.If(self.o_req.valid & self.o_req.ready):
            m.d.sync += [req_addr.eq(req_addr + 1), req_left.eq(req_left - 1), req_any.eq(req_left != 1)]

        take = Signal()
        word_done = Signal()               # this cycle's element is the last one drawn from `word`
        m.d.comb += [
            self.o_elem.valid.eq(have & ~beat_mode),
            self.o_elem.payload.data.eq(word.word_select(lane, ELEM_BITS)),
            self.o_elem.payload.last.eq(elems_left == 1),
            take.eq(self.o_elem.valid & self.o_elem.ready),
            word_done.eq(take & ((lane == LANES - 1) | (elems_left == 1))),
        ]
        with m.If(take):
            m.d.sync += [lane.eq(lane + 1), elems_left.eq(elems_left - 1), busy.eq(elems_left != 1),
                         more.eq(elems_left > LANES + 1)]
        if not self._beats:
            m.d.comb += self.i_resp.ready.eq(busy & (~have | word_done))
            with m.If(self.i_resp.valid & self.i_resp.ready):
                m.d.sync += [word.eq(self.i_resp.payload), have.eq(1)]
            with m.Elif(word_done):
                m.d.sync += have.eq(0)
            return m

        # Beats: `lane` stays at addr % 4; a beat is `word`'s lanes lane..3, then (if it needs more) the next
        # word's lanes 0..lane-1 straight from i_resp, which then becomes `word`.
        cnt = Signal(3)                    # (elems_left is at most LANES unless `more`)
        m.d.comb += cnt.eq(Mux(more, LANES, elems_left[:3]))
        need_next = Signal()
        m.d.comb += need_next.eq(cnt > LANES - lane)
        both = Cat(word, self.i_resp.payload)
        beat_take, beat_last = Signal(), Signal()
        m.d.comb += [
            self.o_beat.valid.eq(beat_mode & have & (~need_next | self.i_resp.valid)),
            self.o_beat.payload.n.eq(cnt),
            self.o_beat.payload.last.eq(~more),
            beat_take.eq(self.o_beat.valid & self.o_beat.ready),
            beat_last.eq(beat_take & ~more),
        ]
        with m.Switch(lane):
            for j in range(LANES):
                with m.Case(j):
                    m.d.comb += self.o_beat.payload.data.eq(both[ELEM_BITS * j:ELEM_BITS * (j + LANES)])
        with m.If(beat_take):
            m.d.sync += [elems_left.eq(elems_left - cnt), busy.eq(more), more.eq(elems_left > 2 * LANES)]
        # the next word is taken when nothing is held, when a beat uses its first lanes, or when a beat
        # empties `word` exactly
        beat_frees = beat_take & (need_next | (cnt == LANES - lane))
        m.d.comb += self.i_resp.ready.eq(busy & (~have | Mux(beat_mode, beat_frees, word_done)))
        with m.If(self.i_resp.valid & self.i_resp.ready & ~beat_last):
            m.d.sync += [word.eq(self.i_resp.payload), have.eq(1)]
        with m.Elif(word_done | beat_last | beat_frees):
            m.d.sync += have.eq(0)
        return m


class ElemWriter(wiring.Component):
    """Writes ``n`` consecutive binary32 elements into L2 at any element address, through one write port.

    Parameters
    ----------
    hw : HardwareConfig
    beats : take the elements as beats of up to four (``i_beat``) instead of one by one (``i_elem``).

    Members
    -------
    i_cmd : In(stream cmd_layout(hw))     ``{addr, n}``; accepted when ``o_busy`` is low
    i_elem : In(stream unsigned(32))      the n elements, in order (not with ``beats=True``)
    i_beat : In(stream beat_layout())     with ``beats=True`` only: the n elements, in order, as beats of
                                          ``n`` (1..4) elements in lanes ``0 .. n-1``; ``last`` is ignored
    o_wr : Out(stream write_layout(hw))   masked word writes, to an `L2` ``wr{j}``
    o_busy : Out(1)                       from the cycle after the command's transfer until the cycle its last
                                          word is accepted by L2 (inclusive)
    o_done : Out(1)                       one-cycle pulse the cycle after that (n = 0: the cycle after the
                                          command's transfer; nothing is written)

    Notes
    -----
    Either way the writes are the minimal sequence: each word of ``[addr, addr + n)`` once, in address
    order, with the lane mask of the elements that land in it (partial first and last words are written
    only in the lanes the range covers).

    Elements: consecutive elements of one word are gathered in a lane buffer; the element that completes a
    word (lane 3, or the command's last element) moves it, with its lane mask, into the ``o_wr`` register.
    The element that completes a word is accepted only when the ``o_wr`` register is free or being emptied
    in that cycle, so elements flow at one per cycle while L2 accepts a word per four cycles.

    Beats: a beat's elements go to lanes ``lane .. lane + n - 1`` of an eight-lane window, the word being
    filled (lanes 0..3) and the next one (4..7), where ``lane`` is the next element's lane; the beat's
    data rotated by ``lane`` serves both words. A beat that reaches lane 3 (or is the command's last)
    completes the word: the word, merged from the lane buffer and the beat, goes into the ``o_wr`` register,
    and the lanes past 3 stay in the lane buffer as the start of the next word. So full beats run at one
    per cycle (one word write per cycle) from any start lane, with one more cycle at the end when the last
    beat spills into a final partial word (the flush); beats of one element run at one per cycle.
    Contract: the beats' counts sum to the command's ``n`` (no beat crosses into the next command), and no
    beat has ``n = 0``; neither is checked.

    Combinational paths: ``i_cmd.ready``, ``o_wr``, ``o_busy`` and ``o_done`` come from registers.
    ``i_elem.ready`` depends on registers and ``o_wr.ready``; ``i_beat.ready`` on registers,
    ``i_beat.payload.n`` (whether the beat completes a word) and ``o_wr.ready``, never on ``i_beat.valid``.
    ``o_wr.ready`` reaches nothing but these readies and the registers' next values.
    """

    def __init__(self, hw: HardwareConfig, *, beats: bool = False):
        _checked_geometry(self, hw)
        self._hw = hw
        self._beats = bool(beats)
        super().__init__({
            "i_cmd": In(stream.Signature(cmd_layout(hw))),
            **({"i_beat": In(stream.Signature(beat_layout()))} if self._beats else
               {"i_elem": In(stream.Signature(unsigned(ELEM_BITS)))}),
            "o_wr": Out(stream.Signature(write_layout(hw))),
            "o_busy": Out(1),
            "o_done": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        _, nb, wa = l2_geometry(self._hw)
        lane_bits = (LANES - 1).bit_length()

        active = Signal()
        done = Signal()
        waddr = Signal(wa)                 # word the lane buffer belongs to
        lane = Signal(lane_bits)           # lane of the next element
        left = Signal(nb)                  # elements still to accept
        acc = Signal(data.ArrayLayout(unsigned(ELEM_BITS), LANES))
        acc_mask = Signal(LANES)

        m.d.comb += [self.o_busy.eq(active), self.o_done.eq(done), self.i_cmd.ready.eq(~active)]
        m.d.sync += done.eq(0)
        with m.If(self.i_cmd.valid & ~active):
            addr, n = self.i_cmd.payload.addr, self.i_cmd.payload.n
            m.d.sync += [waddr.eq(addr[lane_bits:]), lane.eq(addr[:lane_bits]), left.eq(n), acc_mask.eq(0)]
            with m.If(n == 0):
                m.d.sync += done.eq(1)
            with m.Else():
                m.d.sync += active.eq(1)
        if self._beats:
            self._elaborate_beats(m, active, done, waddr, lane, left, acc, acc_mask)
            return m

        out_free = Signal()
        completes = Signal()
        m.d.comb += [
            out_free.eq(~self.o_wr.valid | self.o_wr.ready),
            completes.eq((lane == LANES - 1) | (left == 1)),
            self.i_elem.ready.eq(active & (left != 0) & (~completes | out_free)),
        ]
        bit = Signal(LANES)
        m.d.comb += bit.eq(1 << lane)
        with m.If(self.o_wr.valid & self.o_wr.ready):
            m.d.sync += self.o_wr.valid.eq(0)
            with m.If(left == 0):                        # the command's last word
                m.d.sync += [active.eq(0), done.eq(1)]
        with m.If(self.i_elem.valid & self.i_elem.ready):
            m.d.sync += [lane.eq(lane + 1), left.eq(left - 1)]
            with m.If(completes):
                merged = Cat(*(Mux(lane == k, self.i_elem.payload, acc[k]) for k in range(LANES)))
                m.d.sync += [
                    self.o_wr.valid.eq(1),
                    self.o_wr.payload.addr.eq(waddr),
                    self.o_wr.payload.data.eq(merged),
                    self.o_wr.payload.mask.eq(acc_mask | bit),
                    acc_mask.eq(0),
                    waddr.eq(waddr + 1),
                ]
            with m.Else():
                m.d.sync += [acc[lane].eq(self.i_elem.payload), acc_mask.eq(acc_mask | bit)]
        return m

    def _elaborate_beats(self, m, active, done, waddr, lane, left, acc, acc_mask):
        beat = self.i_beat.payload
        # The beat's lanes in the eight-lane window (word being filled, next word); bit 3 set = the beat
        # reaches lane 3, so it completes the word.
        span = Signal(2 * LANES)
        m.d.comb += span.eq(Cat(*(beat.n > k for k in range(LANES))) << lane)
        cur, ovf = span[:LANES], span[LANES:]
        rot = Signal(data.ArrayLayout(unsigned(ELEM_BITS), LANES))     # beat lane j in lane (lane + j) % 4
        both = Cat(beat.data, beat.data)
        with m.Switch(lane):
            for j in range(LANES):
                with m.Case(j):
                    m.d.comb += rot.eq(both[ELEM_BITS * (LANES - j):ELEM_BITS * (2 * LANES - j)])

        out_free, completes, take, flush = Signal(), Signal(), Signal(), Signal()
        m.d.comb += [
            out_free.eq(~self.o_wr.valid | self.o_wr.ready),
            completes.eq(span[LANES - 1] | (left == beat.n)),
            self.i_beat.ready.eq(active & (left != 0) & (~completes | out_free)),
            take.eq(self.i_beat.valid & self.i_beat.ready),
            # all beats taken, lanes of a final partial word still held (the last beat spilled into it)
            flush.eq(active & (left == 0) & acc_mask.any() & out_free),
        ]
        with m.If(self.o_wr.valid & self.o_wr.ready):
            m.d.sync += self.o_wr.valid.eq(0)
            with m.If((left == 0) & ~acc_mask.any()):            # the command's last word
                m.d.sync += [active.eq(0), done.eq(1)]
        put = Signal(LANES)                                     # the beat's lanes in the word being filled
        m.d.comb += put.eq(Mux(take, cur, 0))
        with m.If((take & completes) | flush):
            m.d.sync += [
                self.o_wr.valid.eq(1),
                self.o_wr.payload.addr.eq(waddr),
                self.o_wr.payload.data.eq(Cat(*(Mux(put[k], rot[k], acc[k]) for k in range(LANES)))),
                self.o_wr.payload.mask.eq(acc_mask | put),
                acc_mask.eq(Mux(take, ovf, 0)),
                waddr.eq(waddr + 1),
            ]
        with m.Elif(take):
            m.d.sync += acc_mask.eq(acc_mask | cur)
        with m.If(take):
            m.d.sync += [lane.eq(lane + beat.n), left.eq(left - beat.n)]
            for k in range(LANES):
                with m.If(cur[k] | ovf[k]):
                    m.d.sync += acc[k].eq(rot[k])
