"""Shared driver of the GEMV engine bench and the benchmark: lays a case out in DDR like `firmware.pack`
(dense: row-major INT4 rows of ceil(cols/2) bytes, row-major binary16 scales; sparse: column-major INT4
columns of rows/2 bytes, group-major binary16 scales; int8: rows of `cols` signed bytes `pitch` bytes apart,
the gaps filled with other bytes, row-major scales), loads the activations, issues the command, streams
`i_acc`, collects `o_y` and counts cycles. `sparse_spans` is the independent account of the bytes a sparse
GEMV may read (the non-zero columns' and the scales' port slices), which the benches compare with the
bursts the memories saw.

Every port gets its own `LatencyAxiReadRam` holding the same DDR image (the HP ports of the KV260 all
see the same DDR), or, with ``ddr4_mhz``, all ports share one DDR4 channel model: a `tb.ddr4.Ddr4Channel` (the
DRAM clock its own 1,200 MHz, the fabric clock ``ddr4_mhz``) served through `tb.ddr4.axi.Ddr4AxiMemory`, whose
memory holds the case data, so the results are still checked bit for bit; `use_ddr4` puts a fresh channel at
another fabric clock behind the ports between GEMVs, and `latencies` and `ddr4_channel.log` (for
`tb.ddr4.check_timing`) hold each run's read latencies and DRAM commands.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, RisingEdge
from cocotbext.axi import AxiReadBus

from hdl.config import HardwareConfig
from hdl.gemv import EXP_BITS, GemvEngine, command_layout
from sim.numerics import gemv, gemv_order, pack_int4
from tb.axi.memory import LatencyAxiReadRam
from tb.axi.streams import StreamSink, StreamSource, pauses
from tb.ddr4 import Ddr4Channel, Ddr4Params
from tb.ddr4.axi import Ddr4AxiMemory


def pack_fields(layout, **values) -> int:
    """The integer a `data.StructLayout` payload port carries for these field values."""
    word = 0
    for name, field in layout:
        v = int(values.get(name, 0))
        word |= (v & ((1 << field.width) - 1)) << field.offset
    return word


@dataclass
class Case:
    q_w: np.ndarray          # int8 [rows, cols]
    scale: np.ndarray        # float16 [rows, groups]
    q_a: np.ndarray          # int8 [cols], or [vectors, cols] (a command with `vecs`)
    e_a: np.ndarray          # int32 [blocks], or [vectors, blocks]
    group: int
    acc: np.ndarray | None = None   # float32 [rows] (accm), or [rows, vectors]
    w_offset: int = 0        # extra byte offset of the weights (alignment tests)
    s_offset: int = 0
    sparse: bool = False     # column-major weights, group-major scales, zero-activation columns skipped
    mask: np.ndarray | None = None   # bool [rows]: a masked command (`gemv_row_mask`), only these rows fetched
    int8: bool = False       # INT8 weights (`gemv_int8`): row r's `cols` bytes at r * pitch
    pitch: int = 0           # int8: bytes from one row's start to the next (at least cols)

    @property
    def rows(self):
        return self.q_w.shape[0]

    @property
    def cols(self):
        return self.q_w.shape[1]

    @property
    def vectors(self) -> int | None:
        """The activation vectors of a multi-vector case (None: a single vector, no `vecs` field)."""
        return self.q_a.shape[0] if self.q_a.ndim == 2 else None

    def expected(self, block):
        if self.vectors is not None:            # each vector's GEMV, as [rows, vectors]
            return np.stack([gemv(self.q_w, self.scale, self.q_a[v], self.e_a[v], group=self.group, block=block,
                                  acc=None if self.acc is None else self.acc[:, v])
                             for v in range(self.vectors)], axis=1)
        if self.mask is None:
            return gemv(self.q_w, self.scale, self.q_a, self.e_a, group=self.group, block=block, acc=self.acc)
        # WGEMV mask: a skipped row reads +0, then accm adds the old value as for every row
        y = np.where(self.mask, gemv(self.q_w, self.scale, self.q_a, self.e_a, group=self.group, block=block),
                     np.float32(0))
        return y if self.acc is None else (self.acc + y).astype(np.float32)

    def weight_bytes(self) -> bytes:
        if self.int8:                         # rows `pitch` apart; the gaps hold bytes no row may read
            assert self.pitch >= self.cols
            img = np.full((self.rows, self.pitch), 0x5A, np.uint8)
            img[:, :self.cols] = self.q_w.view(np.uint8)
            return img.tobytes()[:(self.rows - 1) * self.pitch + self.cols]
        if self.sparse:                       # column k = rows/2 bytes, rows 2i / 2i+1 = low / high nibble
            return pack_int4(np.ascontiguousarray(self.q_w.T)).tobytes()
        q = self.q_w
        if q.shape[1] % 2:
            q = np.pad(q, ((0, 0), (0, 1)))
        return pack_int4(q).tobytes()

    def scale_bytes(self) -> bytes:
        if self.sparse:                       # [groups, rows]
            return np.ascontiguousarray(self.scale.T).astype("<f2").tobytes()
        return self.scale.astype("<f2").tobytes()


class GemvBench:
    """The engine's environment: its AXI read memory, its input streams and the `o_y` sink.

    Parameters
    ----------
    mem_size : bytes of the DDR image (each private memory's size, or the DDR4 channel's memory).
    latency, jitter : cycles of the private memories' read latency (ignored with ``ddr4_mhz``).
    p_stall : probability per cycle of an AR or R pause on every port (either memory) and of an idle
        `i_acc` or stalled `o_y` cycle.
    ddr4_mhz : None, or the fabric clock in MHz at which all ports share one `tb.ddr4` channel.
    ddr4_params : the channel's `Ddr4Params` (default the model's).
    """

    def __init__(self, dut, cfg: HardwareConfig, *, mem_size: int, seed: int = 0, latency: int = 0,
                 jitter: int = 0, p_stall: float = 0.0, max_cols: int, ddr4_mhz: float | None = None,
                 ddr4_params: Ddr4Params | None = None):
        self.dut, self.cfg, self.max_cols = dut, cfg, max_cols
        self.tile_rows = GemvEngine.default_tile_rows()
        self.rng = random.Random(seed)
        self.mem_size = mem_size
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
        self.rams = []
        self.ddr4 = None
        if ddr4_mhz is not None:
            self.ddr4_params = ddr4_params or Ddr4Params()
            self.ddr4_memory = bytearray(mem_size)
            rs = [random.Random(seed * 100 + p) for p in range(cfg.axi_ports)]
            stalls = {k: [pauses(random.Random(r.random()), p_stall) for r in rs] for k in ("ar", "r")} \
                if p_stall else None
            self.ddr4 = Ddr4AxiMemory(dut, dut.clk, [f"m_axi{p}" for p in range(cfg.axi_ports)],
                                      self._channel(ddr4_mhz, 2), pauses=stalls)
        else:
            for p in range(cfg.axi_ports):
                r = random.Random(seed * 100 + p)
                self.rams.append(LatencyAxiReadRam(
                    AxiReadBus.from_prefix(dut, f"m_axi{p}", bus_separator="__"), dut.clk, size=mem_size,
                    latency=latency, jitter=jitter, max_outstanding=cfg.axi_max_outstanding, rng=r,
                    ar_pause=pauses(random.Random(r.random()), p_stall) if p_stall else None,
                    r_pause=pauses(random.Random(r.random()), p_stall) if p_stall else None))
        self.cmd = StreamSource(dut, "i_cmd", dut.clk)
        self.act = StreamSource(dut, "i_act", dut.clk)
        self.exp = StreamSource(dut, "i_exp", dut.clk)
        self.acc = StreamSource(dut, "i_acc", dut.clk, rng=random.Random(seed + 7), p_idle=p_stall)
        self.out = StreamSink(dut, "o_y", dut.clk, rng=random.Random(seed + 8), p_stall=p_stall)
        self.mask = StreamSource(dut, "i_mask", dut.clk) if cfg.gemv_row_mask else None
        self.cycle = 0
        cocotb.start_soon(self._count())
        cocotb.start_soon(self.out.run())

    def _channel(self, mhz: float, start: int) -> Ddr4Channel:
        self.ddr4_mhz = mhz
        return Ddr4Channel(self.ddr4_params, fabric_hz=mhz * 1e6, ports=self.cfg.axi_ports,
                           port_bytes=self.cfg.bytes_per_beat, memory=self.ddr4_memory, start=start)

    def use_ddr4(self, mhz: float) -> Ddr4Channel:
        """A fresh DDR4 channel at fabric clock `mhz` behind the ports (between GEMVs: no burst in flight); its
        DRAM clock and first refresh interval start two cycles from now."""
        assert self.ddr4 is not None, "the bench was built without ddr4_mhz"
        assert not any(port.reads for port in self.ddr4.ports), "bursts in flight"
        self.ddr4.channel = self._channel(mhz, self.ddr4.cycle + 2)
        self.ddr4.reset_records()
        return self.ddr4.channel

    @property
    def ddr4_channel(self) -> Ddr4Channel:
        return self.ddr4.channel

    def port_bursts(self) -> list[list[tuple[int, int]]]:
        """Per port, the (address, beats) of the bursts read since the last `run` began."""
        return self.ddr4.bursts if self.ddr4 is not None else [ram.bursts for ram in self.rams]

    def latencies(self) -> list[int]:
        """The DDR4 bench's read latencies of the last run (cycles, AR handshake to first R beat), all ports."""
        return [x for port in self.ddr4.latencies for x in port]

    async def _count(self):
        while True:
            await RisingEdge(self.dut.clk)
            self.cycle += 1

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(3):
            await FallingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await FallingEdge(self.dut.clk)

    def write(self, addr: int, data: bytes):
        if self.ddr4 is not None:
            assert addr + len(data) <= self.mem_size, "the data does not fit the bench memory"
            self.ddr4_memory[addr:addr + len(data)] = data
        for ram in self.rams:
            ram.write(addr, data)

    async def load_activations(self, q_a: np.ndarray, e_a: np.ndarray):
        """Vector 0's activations and exponents (or each vector's, for [vectors, n] arrays)."""
        cfg, W = self.cfg, self.cfg.weights_per_beat
        act_layout = self.dut_layouts()["act"]
        exp_layout = self.dut_layouts()["exp"]
        for vec, (qa, ea) in enumerate(zip(np.atleast_2d(q_a), np.atleast_2d(e_a))):
            q = np.pad(qa.astype(np.int8), (0, -len(qa) % W)).reshape(-1, W)
            await self.act.send([pack_fields(act_layout, addr=k, q=int.from_bytes(row.tobytes(), "little"), vec=vec)
                                 for k, row in enumerate(q)])
            await self.exp.send([pack_fields(exp_layout, addr=k, e=int(e) & ((1 << EXP_BITS) - 1), vec=vec)
                                 for k, e in enumerate(ea)])

    async def load_mask(self, live: np.ndarray):
        """The row mask of the next command, MASK_LANES rows a word from row 0 (as the controller's MASK pass
        sends it)."""
        from hdl.rowmask import MASK_LANES, mask_layout
        bits = np.pad(live.astype(np.int64), (0, -len(live) % MASK_LANES)).reshape(-1, MASK_LANES)
        layout = mask_layout(self.cfg.gemv_max_cols)
        await self.mask.send([pack_fields(layout, addr=k, bits=int(sum(int(b) << i for i, b in enumerate(w))))
                              for k, w in enumerate(bits)])

    def dut_layouts(self):
        from amaranth import signed
        from amaranth.lib import data
        W = self.cfg.weights_per_beat
        vec = {"vec": range(self.cfg.gemv_vectors)} if self.cfg.gemv_vectors > 1 else {}
        return {
            "act": data.StructLayout({"addr": range(self.max_cols // W),
                                      "q": data.ArrayLayout(signed(self.cfg.act_bits), W), **vec}),
            "exp": data.StructLayout({"addr": range(max(2, self.max_cols // self.cfg.act_block)),
                                      "e": signed(EXP_BITS), **vec}),
        }

    def place(self, case: Case, base: int) -> tuple[int, int]:
        """Write the case's weights and scales at `base` (+ the case's offsets); returns their addresses."""
        wb = case.weight_bytes()
        waddr = base + case.w_offset
        saddr = -(-(waddr + len(wb)) // 64) * 64 + case.s_offset
        self.write(waddr, wb)
        self.write(saddr, case.scale_bytes())
        assert saddr + len(case.scale_bytes()) <= self.mem_size, "case does not fit the bench memory"
        return waddr, saddr

    async def run(self, case: Case, *, base: int = 0, timeout: int = 2_000_000):
        """Runs one GEMV; returns (result float32 [rows] (multi-vector: [rows, vectors]), cycles from command
        acceptance to the last result).
        `self.last_addrs` keeps the weight and scale addresses, each memory's `bursts` the bursts of this run."""
        sparse = case.sparse
        waddr, saddr = self.place(case, base)
        self.last_addrs = (waddr, saddr)
        if self.ddr4 is not None:
            self.ddr4.reset_records()           # its bursts and latencies
        for ram in self.rams:
            ram.bursts.clear()
        await self.load_activations(case.q_a, case.e_a)
        n0 = len(self.out.items)
        if case.mask is not None:
            await self.load_mask(case.mask)
        nvec = case.vectors or 1
        rr, vv = gemv_order(case.rows, nvec, self.tile_rows)
        word = pack_fields(command_layout(self.cfg), wbase=waddr, sbase=saddr, rows=case.rows, cols=case.cols,
                           log2_group=case.group.bit_length() - 1, accm=case.acc is not None, sparse=sparse,
                           mask=case.mask is not None, vecs=nvec - 1, int8=case.int8, pitch=case.pitch)
        if case.acc is not None:
            old = case.acc.astype(np.float32).reshape(case.rows, nvec)[rr, vv]
            cocotb.start_soon(self.acc.send([int(v) for v in old.view(np.uint32)]))
        await self.cmd.send([word])
        t0 = self.cycle
        n = case.rows * nvec
        items = await self.out.wait_for(n0 + n, timeout_cycles=timeout)
        cycles = self.cycle - t0
        y = np.array(items[n0:n0 + n], dtype=np.uint32).view(np.float32)
        for _ in range(20):
            await FallingEdge(self.dut.clk)
        assert len(self.out.items) == n0 + n, "the engine produced more results than rows x vectors"
        if case.vectors is None:
            return y, cycles
        out = np.empty((case.rows, nvec), np.float32)
        out[rr, vv] = y
        return out, cycles


def random_case(cfg: HardwareConfig, rng: np.random.Generator, rows: int, cols: int, *, group: int | None = None,
                accm: bool = False, zero_cols: float = 0.1, zero_rows: float = 0.1, e_range=(-20, 8),
                misalign: bool = False) -> Case:
    group = group or (cfg.weight_group if cols >= cfg.weight_group else 1 << (cols - 1).bit_length())
    ng = -(-cols // group)
    q_w = rng.integers(-8, 8, (rows, cols)).astype(np.int8)
    q_w[rng.random(rows) < zero_rows] = 0
    # Any finite binary16 scale: random magnitude (normal and subnormal) and sign, some zeros.
    scale = (rng.standard_normal((rows, ng)) * np.exp2(rng.integers(-20, 6, (rows, ng)))).astype(np.float16)
    scale[rng.random((rows, ng)) < 0.05] = 0
    q_a = rng.integers(-127, 128, cols).astype(np.int8)
    q_a[rng.random(cols) < zero_cols] = 0
    nb = -(-cols // cfg.act_block)
    e_a = rng.integers(e_range[0], e_range[1] + 1, nb).astype(np.int32)
    acc = (rng.standard_normal(rows) * 100).astype(np.float32) if accm else None
    if acc is not None:
        acc[rng.random(rows) < 0.1] = 0
    return Case(q_w, scale, q_a, e_a, group, acc,
                w_offset=int(rng.integers(0, 64)) if misalign else 0,
                s_offset=2 * int(rng.integers(0, 32)) if misalign else 0)


def int8_case(cfg: HardwareConfig, rng: np.random.Generator, rows: int, cols: int, *, pitch: int | None = None,
              vectors: int | None = None, **kw) -> Case:
    """An int8 case (`random_case`'s scales, activations, exponents and accm with INT8 weights over the whole
    range, some rows zero): rows `pitch` bytes apart (default `cols`); with `vectors`, that many activation
    vectors (each its own values, exponents and accm values)."""
    cases = [random_case(cfg, rng, rows, cols, **kw) for _ in range(vectors or 1)]
    c = cases[0]
    c.q_w = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
    c.q_w[rng.random(rows) < 0.1] = 0
    c.int8, c.pitch = True, cols if pitch is None else pitch
    if vectors is not None:
        c.q_a = np.stack([x.q_a for x in cases])
        c.e_a = np.stack([x.e_a for x in cases])
        if c.acc is not None:
            c.acc = np.stack([x.acc for x in cases], axis=1)
    return c


def dense_spans(cfg: HardwareConfig, case: Case, waddr: int, saddr: int, tile_rows: int) \
        -> list[list[tuple[int, int]]]:
    """Per port, the byte ranges ``(start, end)`` a dense GEMV must read, one per transfer, whatever its vectors:
    tile j (rows ``j * T ..``) on port ``j mod N``, its rows' scales as one transfer, then each row in chunks of
    ``max(burst, act_block / W)`` beats (``act_block / (W/2)`` with ``gemv_int8``), so every weight and scale
    byte once; an int8 case's rows are `cols` bytes `pitch` apart."""
    N, W, B, T = cfg.axi_ports, cfg.weights_per_beat, cfg.bytes_per_beat, tile_rows
    rows, rowbytes, g2 = case.rows, (case.cols + 1) // 2, -(-case.cols // case.group) * 2
    cbb = max(cfg.axi_max_burst_beats, cfg.act_block // (W // 2 if cfg.gemv_int8 else W), 1) * B
    if case.int8:
        rowbytes = case.cols
    out = [[] for _ in range(N)]
    for j in range(-(-rows // T)):
        r0, r1 = j * T, min(rows, (j + 1) * T)
        spans = out[j % N]
        spans.append((saddr + r0 * g2, saddr + r1 * g2))
        stride = case.pitch if case.int8 else rowbytes
        spans += [(waddr + r * stride + c, waddr + r * stride + min(c + cbb, rowbytes))
                  for r in range(r0, r1) for c in range(0, rowbytes, cbb)]
    return out


def sparse_spans(cfg: HardwareConfig, case: Case, waddr: int, saddr: int) -> list[list[tuple[int, int]]]:
    """Per port, the byte ranges ``(start, end)`` a sparse GEMV must read, in the engine's row split (port p
    owns rows ``p * prow ..``, ``prow = ceil(rows / (ports * W)) * W``): group g's scales of its rows, then
    its slice of every column whose INT8 activation is non-zero."""
    N, W = cfg.axi_ports, cfg.weights_per_beat
    rows = case.rows
    prow = -(-rows // (N * W)) * W
    groups = -(-case.cols // case.group)
    out = []
    for p in range(N):
        rp = max(0, min(prow, rows - p * prow))
        spans = []
        if rp:
            spans += [(saddr + (g * rows + p * prow) * 2, saddr + (g * rows + p * prow + rp) * 2) for g in range(groups)]
            spans += [(waddr + k * rows // 2 + p * prow // 2, waddr + k * rows // 2 + (p * prow + rp) // 2)
                      for k in np.flatnonzero(case.q_a)]
        out.append(spans)
    return out


def check_sparse_reads(cfg: HardwareConfig, tb: GemvBench, case: Case):
    """The bursts of the last run read exactly the beats of `sparse_spans` (as a multiset: one transfer per
    span), so no beat lying wholly inside a skipped column was read; returns the bytes read."""
    B = cfg.bytes_per_beat
    waddr, saddr = tb.last_addrs
    total = 0
    zero_cols = [k for k in range(case.cols) if case.q_a[k] == 0]
    for p, (bursts, spans) in enumerate(zip(tb.port_bursts(), sparse_spans(cfg, case, waddr, saddr))):
        want = sorted(a for s, e in spans for a in range(s - s % B, e, B))
        got = sorted(a + n * B for a, beats in bursts for n in range(beats))
        assert got == want, f"port {p}: the beats read differ from the non-zero columns' and scales' beats"
        total += len(got) * B
        rows, prow = case.rows, -(-case.rows // (cfg.axi_ports * cfg.weights_per_beat)) * cfg.weights_per_beat
        lo, hi = p * prow // 2, min(rows, (p + 1) * prow) // 2
        gotset = set(got)
        for k in zero_cols:                # no beat wholly inside a skipped column's slice
            s, e = waddr + k * rows // 2 + lo, waddr + k * rows // 2 + hi
            first = -(-s // B) * B
            assert not any(a in gotset for a in range(first, e - B + 1, B)), f"port {p}: column {k} was read"
    return total


def masked_spans(cfg: HardwareConfig, case: Case, waddr: int, saddr: int) -> list[list[tuple[int, int]]]:
    """Per port, the byte ranges ``(start, end)`` a masked GEMV must read, one per transfer, in the engine's row
    split (port p owns rows ``p * prow ..``, as `sparse_spans`): each live row's scales (``groups * 2`` bytes at
    ``saddr + r * groups * 2``) and its chunks (``rowbytes`` at ``waddr + r * rowbytes`` in pieces of a chunk,
    ``max(burst, act_block / W)`` beats)."""
    N, W, B = cfg.axi_ports, cfg.weights_per_beat, cfg.bytes_per_beat
    rows, rowbytes, g2 = case.rows, (case.cols + 1) // 2, -(-case.cols // case.group) * 2
    prow = -(-rows // (N * W)) * W
    cbb = max(cfg.axi_max_burst_beats, cfg.act_block // W, 1) * B
    out = []
    for p in range(N):
        spans = []
        for r in np.flatnonzero(case.mask[p * prow:(p + 1) * prow]) + p * prow:
            r = int(r)
            spans.append((saddr + r * g2, saddr + (r + 1) * g2))
            spans += [(waddr + r * rowbytes + c, waddr + r * rowbytes + min(c + cbb, rowbytes))
                      for c in range(0, rowbytes, cbb)]
        out.append(spans)
    return out


def check_span_reads(cfg: HardwareConfig, tb: GemvBench, spans: list[list[tuple[int, int]]]) -> int:
    """The bursts of the last run read exactly the beats of `spans` (per port, as a multiset: one transfer per
    span); returns the bytes read."""
    B = cfg.bytes_per_beat
    total = 0
    for p, (bursts, want_spans) in enumerate(zip(tb.port_bursts(), spans)):
        want = sorted(a for s, e in want_spans for a in range(s - s % B, e, B))
        got = sorted(a + n * B for a, beats in bursts for n in range(beats))
        assert got == want, f"port {p}: the beats read differ from the live rows' scales and chunks"
        total += len(got) * B
    return total
