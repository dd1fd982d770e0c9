"""DDR bandwidth probe: reads DDR on every HP port with the GEMV engine's access pattern and counts what it got.

The performance model (`firmware.perf`) assumes the memory controller delivers a fraction ``ddr_efficiency``
of the DDR4 peak to the weight stream. The probe measures that fraction on the board: it is a second, small
design with the NPU's outside shape (``s_axi`` on HPM0 through `hdl.axi_csr.AxiToCsr`, ``m_axi0`` ..
``m_axi<N-1>`` on HP0.., ``o_irq``), so it drops into the same system top and the same host plumbing, and
`python -m firmware.ddrprobe` runs it.

Access pattern: the dense GEMV engine's (`hdl.gemv.GemvPort`) on a matrix laid out as `firmware.pack` lays it
out. ROWS rows of ROW_BYTES bytes from WBASE, SCALE_BYTES bytes of scales per row from SBASE (row-major),
cut into tiles of TILE_ROWS rows; tile ``j`` goes to port ``j mod PORTS``. Per tile a port issues one DMA
command for the tile's scales, then the rows in chunks of ``hdl.ddrprobe_map.gemv_chunk_bytes(hw)`` bytes
(kv260: 256, one full burst), round robin over the tile's rows: chunk 0 of every row of the tile, then
chunk 1, ... The matrix is read PASSES times; a pass starts when every port has finished the previous one,
as the engine takes its next command only when idle. Every port has its own sequencer and its own
`hdl.axi.AxiReadDma`, which splits a command into INCR bursts of up to ``axi_max_burst_beats`` beats, cut at
4 KB, with up to ``axi_max_outstanding`` bursts in flight; ``MAX_OUTSTANDING`` lowers that limit (the AR
handshake is held back while a port has that many bursts in flight). The data is discarded. `sim.ddrprobe`
gives the commands, bursts and byte counts of any configuration. The write channels are tied idle.

START latches the configuration; three setup cycles derive the tile strides and every port's first tile
(one small multiplication: the scale bytes of the last, partial tile), then the ports start.

Counters (64 bit, zeroed at START; the map is `hdl.ddrprobe_map`): CYCLES, the cycles from the START to the
last beat; BYTES_P<p>, R beats times bytes per beat on port p; BURSTS, AR handshakes; ERROR_BEATS, R beats
answered SLVERR or DECERR; LAT_SUM and the 32-bit LAT_MIN and LAT_MAX of the read latency, the cycles from a
burst's AR handshake to its first R beat (each port keeps its bursts' AR times in a FIFO: responses come back
in order, all bursts use ID 0).

Ports
-----
``s_axi``          In(AxiSignature(40, 128, 16)): the CSRs, as on the NPU (the PS's HPM0)
``m_axi<p>``       Out(AxiSignature.from_config(hw)), p < ``hw.axi_ports``: reads only
``o_irq``          STATUS.DONE (level; IRQ_ACK or the next START clears it)
"""

from __future__ import annotations

from amaranth import Cat, Module, Mux, Signal, signed
from amaranth.lib import fifo, wiring
from amaranth.lib.wiring import In, Out

from .axi import AxiReadDma, AxiReadSignature, AxiSignature, AxiWriteSignature
from .axi_csr import HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS, AxiToCsr
from .config import HardwareConfig
from .csr import CsrBlock, port_name
from .ddrprobe_map import (
    COUNTERS,
    MAX_PORTS,
    MAX_TILE_ROWS,
    PROBE_ID,
    REGISTERS,
    ROW_BYTES_BITS,
    SCALE_BYTES_BITS,
    by_name,
    gemv_chunk_bytes,
    version_word,
)

__all__ = ["DdrProbe"]


class DdrProbe(wiring.Component):
    """The DDR bandwidth probe for the hardware configuration `hw` (module docstring).

    Parameters
    ----------
    hw : HardwareConfig
        The HP ports (``axi_ports`` of at most 4, widths), ``axi_max_burst_beats``,
        ``axi_max_outstanding``, and what sets the GEMV engine's chunk (``act_block``).

    Members
    -------
    s_axi : In(AxiSignature(HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS))
    m_axi<p> : Out(AxiSignature.from_config(hw))
    o_irq : Out(1)
    """

    #: Cycles from the cycle after START to the first DMA command (the configuration's derived values and the
    #: sequencers' first tiles).
    SETUP_CYCLES = 3

    def __init__(self, hw: HardwareConfig):
        self._MustUse__silence = True           # until the checks pass: a rejected probe is not "unused"
        if not isinstance(hw, HardwareConfig):
            raise TypeError(f"DdrProbe needs a HardwareConfig, not {hw!r}")
        if hw.axi_ports > MAX_PORTS:
            raise ValueError(f"DdrProbe has byte counters for {MAX_PORTS} ports, not the {hw.axi_ports} of "
                             f"{hw.name!r}")
        self._MustUse__silence = False
        self._hw = hw
        members = {"s_axi": In(AxiSignature(HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS)), "o_irq": Out(1)}
        for p in range(hw.axi_ports):
            members[f"m_axi{p}"] = Out(AxiSignature.from_config(hw))
        super().__init__(members)

    hw = property(lambda self: self._hw)

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        N, B, MO, AB = hw.axi_ports, hw.bytes_per_beat, hw.axi_max_outstanding, hw.axi_addr_bits
        C = gemv_chunk_bytes(hw)
        LT = MAX_TILE_ROWS.bit_length()          # log2 tile rows: 0 .. log2 MAX_TILE_ROWS

        m.submodules.bridge = bridge = AxiToCsr()
        m.submodules.csr = csr = CsrBlock(REGISTERS)
        wiring.connect(m, wiring.flipped(self.s_axi), bridge.s_axi)
        wiring.connect(m, bridge.m_axil, csr.axil)

        def reg(name):
            return getattr(csr, port_name(by_name(name)))

        start_cmd, ack_cmd = reg("CTRL")[0], reg("CTRL")[2]

        # --- START: check and latch the configuration --------------------------------------------------
        n_ports = Signal(range(N + 1))
        limit = Signal(range(MO + 1))
        rows = Signal(32)
        row_bytes = Signal(ROW_BYTES_BITS)
        scale_bytes = Signal(SCALE_BYTES_BITS)
        lt = Signal(range(LT))                   # log2 TILE_ROWS
        wbase = Signal(AB)
        sbase = Signal(AB)
        passes = Signal(32)                      # passes left, this one included
        running = Signal()                       # from the cycle after START to the last beat
        setup = Signal(2)                        # one-hot: the two cycles that derive the sequencers' values
        go = Signal()                            # the sequencers load (the third setup cycle; every pass)
        done = Signal()
        cfg_err = Signal()

        tile_csr, rows_csr = reg("TILE_ROWS"), reg("ROWS")
        rb_csr, sb_csr = reg("ROW_BYTES"), reg("SCALE_BYTES")
        tile_ok = (tile_csr != 0) & ((tile_csr & (tile_csr - 1)) == 0) & (tile_csr <= MAX_TILE_ROWS)
        lt_csr = Signal(range(LT))
        for k in range(LT):
            with m.If(tile_csr[k]):
                m.d.comb += lt_csr.eq(k)
        bad = Signal()
        m.d.comb += bad.eq((reg("PORTS") > N) | ~tile_ok | (rb_csr >> ROW_BYTES_BITS != 0) |
                           (sb_csr >> SCALE_BYTES_BITS != 0) | ((rb_csr == 0) & (rows_csr != 0)))
        accept = Signal()
        m.d.comb += accept.eq(start_cmd & ~running)
        max_out_csr, passes_csr = reg("MAX_OUTSTANDING"), reg("PASSES")
        m.d.sync += [setup.eq(setup << 1), go.eq(setup[-1])]
        with m.If(accept):
            m.d.sync += [
                done.eq(bad), cfg_err.eq(bad),
                n_ports.eq(Mux(reg("PORTS") == 0, N, reg("PORTS"))),
                limit.eq(Mux((max_out_csr == 0) | (max_out_csr > MO), MO, max_out_csr)),
                rows.eq(rows_csr), row_bytes.eq(rb_csr), scale_bytes.eq(sb_csr), lt.eq(lt_csr),
                wbase.eq(Cat(reg("WBASE_LO"), reg("WBASE_HI"))), sbase.eq(Cat(reg("SBASE_LO"), reg("SBASE_HI"))),
                passes.eq(Mux(passes_csr == 0, 1, passes_csr)),
                running.eq(~bad), setup.eq(~bad),
            ]
        with m.Elif(ack_cmd):
            m.d.sync += done.eq(0)

        # Setup 1: a tile's bytes (rows and scales), the rows of the last tile (rows mod T).
        tile_rows = Signal(range(MAX_TILE_ROWS + 1))
        tile_w = Signal(ROW_BYTES_BITS + LT)     # T * row_bytes
        tile_s = Signal(SCALE_BYTES_BITS + LT)   # T * scale_bytes: the scales of a whole tile
        rem_rows = Signal(range(MAX_TILE_ROWS))
        # Setup 2: the strides of a port (n tiles), every port's first tile, the last tile's scale bytes.
        step_w = Signal(ROW_BYTES_BITS + LT + 3)
        step_s = Signal(SCALE_BYTES_BITS + LT + 3)
        step_r = Signal(range(N * MAX_TILE_ROWS + 1))
        last_s = Signal(SCALE_BYTES_BITS + LT)   # (rows mod T) * scale_bytes
        first_w = [Signal(AB, name=f"port{p}_first_w") for p in range(N)]
        first_s = [Signal(AB, name=f"port{p}_first_s") for p in range(N)]
        first_left = [Signal(signed(34), name=f"port{p}_first_left") for p in range(N)]
        with m.If(setup[0]):
            m.d.sync += [tile_rows.eq(1 << lt), tile_w.eq(row_bytes << lt), tile_s.eq(scale_bytes << lt),
                         rem_rows.eq(rows & ((1 << lt) - 1))]
        with m.If(setup[1]):
            with m.Switch(n_ports):
                for k in range(1, N + 1):
                    with m.Case(k):
                        m.d.sync += [step_w.eq(tile_w * k), step_s.eq(tile_s * k), step_r.eq(tile_rows * k)]
            m.d.sync += last_s.eq(rem_rows * scale_bytes)
            for p in range(N):
                m.d.sync += [first_w[p].eq(wbase + tile_w * p), first_s[p].eq(sbase + tile_s * p),
                             first_left[p].eq(rows - tile_rows * p)]
        has_scales = scale_bytes != 0

        # --- per port: sequencer, DMA, outstanding limit, latency timestamps ----------------------------------
        now = Signal(32)                # free-running: AR times and latencies modulo 2**32
        m.d.sync += now.eq(now + 1)
        busy = []
        ar_fires, r_fires, err_beats, lat_valid, lat = [], [], [], [], []
        rsig = AxiReadSignature.from_config(hw)
        wsig = AxiWriteSignature(hw.axi_addr_bits, hw.axi_data_bits, hw.axi_id_bits)
        for p in range(N):
            port = getattr(self, f"m_axi{p}")
            m.submodules[f"dma{p}"] = dma = AxiReadDma(hw, len_bits=32)
            m.d.comb += dma.o_data.ready.eq(1)          # the data is counted on the bus, then dropped

            # The sequencer walks its tiles as `hdl.gemv.GemvPort`'s does: the tile's scales, then chunk
            # rounds over the tile's rows. Addresses advance by additions only.
            active = Signal(name=f"seq{p}_active")
            in_scales = Signal(name=f"seq{p}_in_scales")   # the tile's scale command comes next
            left = Signal(signed(34), name=f"seq{p}_left")  # rows from this tile to the matrix's end
            tile = Signal(AB, name=f"seq{p}_tile")          # the tile's row 0
            saddr = Signal(AB, name=f"seq{p}_saddr")        # the tile's scales
            chunk = Signal(AB, name=f"seq{p}_chunk")        # this round's chunk in row 0
            addr = Signal(AB, name=f"seq{p}_addr")          # this round's chunk in row t
            coff = Signal(ROW_BYTES_BITS, name=f"seq{p}_coff")   # the chunk's offset in a row
            trow = Signal(range(MAX_TILE_ROWS), name=f"seq{p}_row")    # the row in the tile
            partial = Signal(name=f"seq{p}_partial")        # the tile has fewer than T rows
            m.d.comb += partial.eq(left < tile_rows)
            rest = Signal(ROW_BYTES_BITS, name=f"seq{p}_rest")
            m.d.comb += rest.eq(row_bytes - coff)
            last_row = trow == Mux(partial, left, tile_rows) - 1
            last_chunk = rest <= C
            cmd = dma.i_cmd
            m.d.comb += cmd.valid.eq(active)
            with m.If(in_scales):
                m.d.comb += [cmd.p.addr.eq(saddr), cmd.p.nbytes.eq(Mux(partial, last_s, tile_s))]
            with m.Else():
                m.d.comb += [cmd.p.addr.eq(addr), cmd.p.nbytes.eq(Mux(last_chunk, rest, C))]
            with m.If(go):
                m.d.sync += [active.eq((n_ports > p) & (first_left[p] > 0)), in_scales.eq(has_scales),
                             left.eq(first_left[p]), tile.eq(first_w[p]), saddr.eq(first_s[p]),
                             chunk.eq(first_w[p]), addr.eq(first_w[p]), coff.eq(0), trow.eq(0)]
            with m.Elif(cmd.valid & cmd.ready):
                with m.If(in_scales):
                    m.d.sync += in_scales.eq(0)
                with m.Elif(~last_row):
                    m.d.sync += [trow.eq(trow + 1), addr.eq(addr + row_bytes)]
                with m.Elif(~last_chunk):
                    m.d.sync += [trow.eq(0), coff.eq(coff + C), chunk.eq(chunk + C), addr.eq(chunk + C)]
                with m.Else():                          # the tile's last command: on to the port's next tile
                    m.d.sync += [trow.eq(0), coff.eq(0), in_scales.eq(has_scales), left.eq(left - step_r),
                                 tile.eq(tile + step_w), chunk.eq(tile + step_w), addr.eq(tile + step_w),
                                 saddr.eq(saddr + step_s)]
                    with m.If(left <= step_r):
                        m.d.sync += active.eq(0)
            busy += [active, dma.o_busy]

            # The port: the DMA's read channels, AR held back at `limit` bursts in flight (the limit is
            # constant while running, so a raised ARVALID stays up until its handshake); writes idle.
            inflight = Signal(range(MO + 1), name=f"port{p}_inflight")
            allow = Signal(name=f"port{p}_allow")
            m.d.comb += allow.eq(inflight < limit)
            for name, member in rsig.members.items():
                if name in ("arvalid", "arready"):
                    continue
                if member.flow == Out:
                    m.d.comb += getattr(port, name).eq(getattr(dma.axi, name))
                else:
                    m.d.comb += getattr(dma.axi, name).eq(getattr(port, name))
            m.d.comb += [port.arvalid.eq(dma.axi.arvalid & allow), dma.axi.arready.eq(port.arready & allow)]
            for name, member in wsig.members.items():
                if member.flow == Out:
                    m.d.comb += getattr(port, name).eq(1 if name == "bready" else 0)
            ar_fire, r_fire = Signal(name=f"port{p}_ar_fire"), Signal(name=f"port{p}_r_fire")
            m.d.comb += [ar_fire.eq(port.arvalid & port.arready), r_fire.eq(port.rvalid & port.rready)]
            m.d.sync += inflight.eq(inflight + ar_fire - (r_fire & port.rlast))

            # AR times, popped by each burst's first R beat (in order: one ID)
            m.submodules[f"ar_times{p}"] = times = fifo.SyncFIFO(width=32, depth=MO)
            first = Signal(init=1, name=f"port{p}_first")
            with m.If(r_fire):
                m.d.sync += first.eq(port.rlast)
            lv, lt_p = Signal(name=f"port{p}_lat_valid"), Signal(32, name=f"port{p}_lat")
            m.d.comb += [times.w_en.eq(ar_fire), times.w_data.eq(now), times.r_en.eq(lv),
                         lv.eq(r_fire & first), lt_p.eq(now - times.r_data)]
            ar_fires.append(ar_fire)
            r_fires.append(r_fire)
            err_beats.append(r_fire & port.rresp[1])    # SLVERR and DECERR
            lat_valid.append(lv)
            lat.append(lt_p)

        # A pass ends when every sequencer has issued its last command and every DMA has delivered it; the
        # next pass starts, or the run ends.
        with m.If(running & (setup == 0) & ~go & ~Cat(*busy).any()):
            with m.If(passes > 1):
                m.d.sync += [passes.eq(passes - 1), go.eq(1)]
            with m.Else():
                m.d.sync += [running.eq(0), done.eq(1)]

        # --- counters ----------------------------------------------------------------------------------
        incr = {
            "CYCLES": running,
            "BURSTS": sum(ar_fires),
            "ERROR_BEATS": sum(err_beats),
            "LAT_SUM": sum(Mux(v, t, 0) for v, t in zip(lat_valid, lat, strict=True)),
        }
        for p in range(MAX_PORTS):
            incr[f"BYTES_P{p}"] = r_fires[p] * B if p < N else 0
        values = {}
        for name, _ in COUNTERS:
            c = Signal(64, name=f"cnt_{name.lower()}")
            with m.If(accept):
                m.d.sync += c.eq(0)
            with m.Else():
                m.d.sync += c.eq(c + incr[name])
            m.d.comb += [reg(f"{name}_LO").eq(c[:32]), reg(f"{name}_HI").eq(c[32:])]
            values[name] = c
        lat_min, lat_max = Signal(32, init=0xFFFF_FFFF), Signal(32)
        new_min, new_max = lat_min, lat_max
        for v, t in zip(lat_valid, lat, strict=True):
            new_min = Mux(v & (t < new_min), t, new_min)
            new_max = Mux(v & (t > new_max), t, new_max)
        with m.If(accept):
            m.d.sync += [lat_min.eq(0xFFFF_FFFF), lat_max.eq(0)]
        with m.Else():
            m.d.sync += [lat_min.eq(new_min), lat_max.eq(new_max)]

        m.d.comb += [
            reg("ID").eq(PROBE_ID),
            reg("VERSION").eq(version_word(hw.to_dict())),
            reg("STATUS").eq(Cat(running, done, values["ERROR_BEATS"] != 0, cfg_err)),
            reg("LAT_MIN").eq(lat_min), reg("LAT_MAX").eq(lat_max),
            self.o_irq.eq(done),
        ]
        return m
