"""DDR bandwidth probe: reads DDR on every HP port with the GEMV engine's access pattern and counts what it got.

The performance model (`firmware.perf`) assumes the memory controller delivers a fraction ``ddr_efficiency``
of the DDR4 peak to the weight stream. The probe measures that fraction on the board: it is a second, small
design with the NPU's outside shape (``s_axi`` on HPM0 through `hdl.axi_csr.AxiToCsr`, ``m_axi0`` ..
``m_axi<N-1>`` on HP0.., ``o_irq``), so it drops into the same system top and the same host plumbing, and
`python -m firmware.ddrprobe` runs it.

Access pattern (the GEMV engine's, `hdl.gemv`): the range ``[BASE, BASE + TOTAL_BYTES)`` is cut into chunks of
``CHUNK_BYTES`` (a row tile) and chunk ``j`` goes to port ``j mod PORTS``. Every port has its own sequencer
and its own `hdl.axi.AxiReadDma` (one command per chunk), so it reads its chunks back to back with INCR
bursts of up to ``axi_max_burst_beats`` beats, split at 4 KB, and up to ``axi_max_outstanding`` bursts in
flight; ``MAX_OUTSTANDING`` lowers that limit (the AR handshake is held back while a port has that many
bursts in flight). The data is discarded. `sim.ddrprobe` gives the bursts and byte counts of any
configuration. The write channels are tied idle.

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

from amaranth import Cat, Module, Mux, Signal
from amaranth.lib import fifo, wiring
from amaranth.lib.wiring import In, Out

from .axi import AxiReadDma, AxiReadSignature, AxiSignature, AxiWriteSignature
from .axi_csr import HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS, AxiToCsr
from .config import HardwareConfig
from .csr import CsrBlock, port_name
from .ddrprobe_map import COUNTERS, MAX_PORTS, PROBE_ID, REGISTERS, by_name, version_word

__all__ = ["DdrProbe"]


class DdrProbe(wiring.Component):
    """The DDR bandwidth probe for the hardware configuration `hw` (module docstring).

    Parameters
    ----------
    hw : HardwareConfig
        The HP ports (``axi_ports`` of at most 4, widths), ``axi_max_burst_beats``,
        ``axi_max_outstanding``.

    Members
    -------
    s_axi : In(AxiSignature(HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS))
    m_axi<p> : Out(AxiSignature.from_config(hw))
    o_irq : Out(1)
    """

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
        N, B, MO = hw.axi_ports, hw.bytes_per_beat, hw.axi_max_outstanding

        m.submodules.bridge = bridge = AxiToCsr()
        m.submodules.csr = csr = CsrBlock(REGISTERS)
        wiring.connect(m, wiring.flipped(self.s_axi), bridge.s_axi)
        wiring.connect(m, bridge.m_axil, csr.axil)

        def reg(name):
            return getattr(csr, port_name(by_name(name)))

        start_cmd, ack_cmd = reg("CTRL")[0], reg("CTRL")[2]

        # --- START: latch the configuration ------------------------------------------------------------
        n_ports = Signal(range(N + 1))
        limit = Signal(range(MO + 1))
        chunk = Signal(32)
        base = Signal(64)
        total = Signal(64)
        running = Signal()              # from the cycle after START to the last beat
        go = Signal()                   # the first running cycle: the sequencers load
        done = Signal()
        cfg_err = Signal()

        ports_csr, max_out_csr, chunk_csr = reg("PORTS"), reg("MAX_OUTSTANDING"), reg("CHUNK_BYTES")
        total_csr = Cat(reg("TOTAL_BYTES_LO"), reg("TOTAL_BYTES_HI"))
        bad = Signal()
        m.d.comb += bad.eq((ports_csr > N) | ((chunk_csr == 0) & (total_csr != 0)))
        accept = Signal()
        m.d.comb += accept.eq(start_cmd & ~running)
        m.d.sync += go.eq(0)
        with m.If(accept):
            m.d.sync += [
                done.eq(bad), cfg_err.eq(bad),
                n_ports.eq(Mux(ports_csr == 0, N, ports_csr)),
                limit.eq(Mux((max_out_csr == 0) | (max_out_csr > MO), MO, max_out_csr)),
                chunk.eq(chunk_csr), base.eq(Cat(reg("BASE_LO"), reg("BASE_HI"))), total.eq(total_csr),
                running.eq(~bad), go.eq(~bad),
            ]
        with m.Elif(ack_cmd):
            m.d.sync += done.eq(0)

        # bytes between two chunks of one port
        stride = Signal(32 + N.bit_length())
        with m.Switch(n_ports):
            for k in range(1, N + 1):
                with m.Case(k):
                    m.d.comb += stride.eq(chunk * k)

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

            off = Signal(64, name=f"seq{p}_off")        # this port's next chunk, from BASE
            left = Signal(64, name=f"seq{p}_left")      # bytes from there to the end
            active = Signal(name=f"seq{p}_active")
            cmd = dma.i_cmd
            with m.If(go):
                m.d.sync += [off.eq(chunk * p), left.eq(total - chunk * p),
                             active.eq((n_ports > p) & (total > chunk * p))]
            with m.Elif(cmd.valid & cmd.ready):
                m.d.sync += [off.eq(off + stride), left.eq(left - stride)]
                with m.If(left <= stride):
                    m.d.sync += active.eq(0)
            m.d.comb += [cmd.valid.eq(active), cmd.p.addr.eq((base + off)[:hw.axi_addr_bits]),
                         cmd.p.nbytes.eq(Mux(left > chunk, chunk, left))]
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
            lv, lt = Signal(name=f"port{p}_lat_valid"), Signal(32, name=f"port{p}_lat")
            m.d.comb += [times.w_en.eq(ar_fire), times.w_data.eq(now), times.r_en.eq(lv),
                         lv.eq(r_fire & first), lt.eq(now - times.r_data)]
            ar_fires.append(ar_fire)
            r_fires.append(r_fire)
            err_beats.append(r_fire & port.rresp[1])    # SLVERR and DECERR
            lat_valid.append(lv)
            lat.append(lt)

        with m.If(running & ~go & ~Cat(*busy).any()):
            m.d.sync += [running.eq(0), done.eq(1)]

        # --- counters ----------------------------------------------------------------------------------
        incr = {
            "CYCLES": running,
            "BURSTS": sum(ar_fires),
            "ERROR_BEATS": sum(err_beats),
            "LAT_SUM": sum(Mux(v, t, 0) for v, t in zip(lat_valid, lat)),
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
        for v, t in zip(lat_valid, lat):
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
