"""The whole NPU: CSRs (behind an AXI4 slave), program fetch, the controller with its datapath, and the AXI4
HP ports.

`Npu(hw)` is what the KV260 system top (`hdl.kv260`) puts beside the PS and what the full-chip bench
(`tb/npu`) simulates.

Ports
-----
``s_axi``       AXI4 slave with the widths of the PS's M_AXI_HPM0_FPD (`hdl.axi_csr`: 40-bit addresses, 128-bit
                data, 16-bit IDs): the CSRs of `hdl.csr_map` (docs/architecture.md) through `AxiToCsr`, which
                takes any AXI4 transfer (bursts, narrow and unaligned, any IDs)
``m_axi<p>``    p = 0 .. ``hw.axi_ports - 1``: AXI4 masters toward the HP ports (full read + write)
``o_irq``       STATUS.DONE | STATUS.ERROR (level; IRQ_ACK clears it)
``o_trace``     what the controller starts, cycle by cycle (`hdl.controller.trace_layout`): the benches' pass
                monitor reads it; the KV260 system leaves it unconnected

Port use (docs/architecture.md, "AXI ports"): the GEMV engine streams weights on every port (rows tile by
tile, round robin); port 0 also carries, through an `AxiReadArbiter` (round robin per burst, responses
routed by ID), the program fetch and the `DdrReader` (descriptors, DMA, GATHER rows, K/V rows), and all
writes (DMA to LOGITS/SCRATCH, KVST). Every reader on port 0 only asks for what its buffer can take (the
credit rule), so no reader can hold the shared R channel while the controller waits on another.

Start: CTRL.START while idle zeroes the counters, resets the controller and its datapath (architectural
registers start at 0), then starts the fetch and the controller (waiting for the fetch to drain a previous
program's bursts first). START while busy is ignored and reported (STATUS.ERROR with ERROR_CODE
START_WHILE_BUSY once the running program has completed).
"""

from __future__ import annotations


from amaranth import Cat, Module, Mux, ResetInserter, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .axi import AxiReadArbiter, AxiReadSignature, AxiSignature, AxiWriteSignature
from .axi_csr import HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS, AxiToCsr
from .config import HardwareConfig
from .controller import REGIONS, Controller, trace_layout
from . import csr_map
from .csr import CsrBlock, port_name
from .csr_map import NPU_ID, by_name, version_word
from .fetch import Fetch

__all__ = ["Npu", "COUNTERS"]

COUNTERS = csr_map.COUNTER_NAMES




class Npu(wiring.Component):
    def __init__(self, hw: HardwareConfig):
        self._hw = hw
        members = {"s_axi": In(AxiSignature(HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS)), "o_irq": Out(1),
                   "o_trace": Out(trace_layout(hw))}
        for p in range(hw.axi_ports):
            members[f"m_axi{p}"] = Out(AxiSignature.from_config(hw))
        super().__init__(members)

    @property
    def hw(self):
        return self._hw

    def elaborate(self, platform):
        m = Module()
        hw = self._hw
        m.submodules.csr = csr = CsrBlock()
        m.submodules.csr_bridge = bridge = AxiToCsr(HPM0_ADDR_BITS, HPM0_DATA_BITS, HPM0_ID_BITS)
        wiring.connect(m, wiring.flipped(self.s_axi), bridge.s_axi)
        wiring.connect(m, bridge.m_axil, csr.axil)

        def reg(name):
            return getattr(csr, port_name(by_name(name)))

        ctrl = reg("CTRL")
        start_cmd, clear_cmd, ack_cmd = ctrl[0], ctrl[1], ctrl[2]

        ctl = Controller(hw)
        core_reset = Signal()
        m.submodules.ctl = ResetInserter(core_reset)(ctl)
        m.submodules.fetch = fetch = Fetch(hw)
        m.d.comb += self.o_trace.eq(ctl.o_trace)

        # --- start sequencing -------------------------------------------------------------------------
        pending = Signal()              # START accepted, waiting for the fetch to drain, then reset, start
        resetting = Signal()
        go = Signal()
        m.d.sync += [core_reset.eq(0), go.eq(0)]
        with m.If(start_cmd & ~ctl.o_busy & ~pending & ~resetting):
            m.d.sync += pending.eq(1)
        with m.If(pending & ~fetch.o_busy):
            m.d.sync += [pending.eq(0), resetting.eq(1), core_reset.eq(1)]
        with m.If(resetting):
            m.d.sync += [resetting.eq(0), go.eq(1)]
        m.d.comb += [
            ctl.i_start.eq(go | (start_cmd & ctl.o_busy)),     # while busy: recorded as START_WHILE_BUSY
            ctl.i_ack.eq(ack_cmd),
            fetch.i_start.eq(go),
            fetch.i_base.eq(Cat(reg("PROGRAM_BASE_LO"), reg("PROGRAM_BASE_HI"))[:hw.axi_addr_bits]),
            fetch.i_len.eq(reg("PROGRAM_LEN")),
            ctl.i_prog_len.eq(reg("PROGRAM_LEN")),
            fetch.i_stop.eq(ctl.o_stop),
            ctl.i_token.eq(reg("TOKEN_ID")), ctl.i_pos.eq(reg("POSITION")), ctl.i_desc_count.eq(reg("DESC_COUNT")),
        ]
        wiring.connect(m, fetch.o_insn, ctl.i_insn)
        for r in REGIONS:
            m.d.comb += getattr(ctl, f"i_base_{r.name.lower()}").eq(
                Cat(reg(f"{r.name}_BASE_LO"), reg(f"{r.name}_BASE_HI")))

        busy = Signal()
        m.d.comb += busy.eq(ctl.o_busy | pending | resetting | go)
        m.d.comb += [
            reg("ID").eq(NPU_ID),
            reg("VERSION").eq(version_word(hw.to_dict())),
            reg("STATUS").eq(Cat(busy, ctl.o_done & ~busy, ctl.o_error & ~busy)),
            reg("ERROR_CODE").eq(ctl.o_error_code),
            reg("ERROR_PC").eq(ctl.o_error_pc),
            self.o_irq.eq(~busy & (ctl.o_done | ctl.o_error)),
        ]

        # --- AXI ports --------------------------------------------------------------------------------
        m.submodules.arb0 = arb = AxiReadArbiter(hw, 3)
        wiring.connect(m, fetch.axi, arb.s0)
        wiring.connect(m, ctl.m_rd, arb.s1)
        wiring.connect(m, ctl.m_gemv0, arb.s2)
        # port 0: the arbiter's reads and the controller's writes; ports 1..: GEMV reads, no writes
        rsig = AxiReadSignature.from_config(hw)
        wsig = AxiWriteSignature(hw.axi_addr_bits, hw.axi_data_bits, hw.axi_id_bits)
        _drive(m, self.m_axi0, arb.m, rsig)
        _drive(m, self.m_axi0, ctl.m_wr, wsig)
        for p in range(1, hw.axi_ports):
            port = getattr(self, f"m_axi{p}")
            _drive(m, port, getattr(ctl, f"m_gemv{p}"), rsig)
            m.d.comb += port.bready.eq(1)

        # --- counters ---------------------------------------------------------------------------------
        ports = [getattr(self, f"m_axi{p}") for p in range(hw.axi_ports)]
        clear = Signal()
        m.d.comb += clear.eq(clear_cmd | core_reset)
        bytes_r, bytes_w = _traffic(m, ports, hw.bytes_per_beat, clear)
        gemv_beat = sum((getattr(ctl, f"m_gemv{p}").rvalid & getattr(ctl, f"m_gemv{p}").rready)
                        for p in range(hw.axi_ports))
        u = ctl.o_unit_busy
        running = Signal()
        m.d.comb += running.eq(ctl.o_busy)
        incr = {
            "CYCLES": running,
            "INSNS": ctl.o_retire,
            "GEMV_BUSY": u.gemv,
            "GEMV_STALL": u.gemv & (gemv_beat == 0),
            "SFU_BUSY": u.sfu,
            "ATTN_BUSY": u.attn,
            "DMA_BUSY": u.dma,
            "ISSUE_STALL": u.issue_wait & running,
            "BYTES_READ": bytes_r,
            "BYTES_WRITTEN": bytes_w,
            "GEMM_BUSY": u.gemm,
        }
        for name in COUNTERS:
            c = _counter(m, name, incr[name], clear)
            m.d.comb += [reg(f"{name}_LO").eq(c[:32]), reg(f"{name}_HI").eq(c[32:])]
        return m


def _traffic(m, ports, B, clear):
    """The bytes the AXI `ports` read and write in a cycle, two cycles late: the handshakes and strobes are
    registered, then their counts, so the ports' paths end at a register, and the strobes' popcount and the
    64-bit sums are paths of their own (the counters lag by two cycles): (read, written). `clear` zeroes both
    stages with the counters, so what a counter adds after a clear happened after it."""
    n = len(ports)
    r_fire, w_fire = Signal(n, name="r_fire"), Signal(n, name="w_fire")
    w_strb = [Signal(B, name=f"w_strb{i}") for i in range(n)]
    bytes_r = Signal(range(n * B + 1), name="bytes_r")
    bytes_w = Signal(range(n * B + 1), name="bytes_w")
    m.d.sync += [r_fire.eq(Cat(p.rvalid & p.rready for p in ports)), w_fire.eq(Cat(p.wvalid & p.wready for p in ports)),
                 [w.eq(p.wstrb) for w, p in zip(w_strb, ports)],
                 bytes_r.eq(sum(r_fire[i] for i in range(n)) * B),
                 bytes_w.eq(sum(Mux(w_fire[i], sum(w_strb[i][k] for k in range(B)), 0) for i in range(n)))]
    with m.If(clear):
        m.d.sync += [r_fire.eq(0), w_fire.eq(0), bytes_r.eq(0), bytes_w.eq(0)]
    return bytes_r, bytes_w


def _counter(m, name, incr, clear):
    """A 64-bit CSR counter adding `incr` each cycle, zeroed by `clear`."""
    c = Signal(64, name=f"cnt_{name.lower()}")
    with m.If(clear):
        m.d.sync += c.eq(0)
    with m.Else():
        m.d.sync += c.eq(c + incr)
    return c



def _drive(m, port, master, sig):
    """Connect the members of `sig` between a master interface and the matching members of a wider `port`
    (an AXI4 master port carrying the read channels of one unit and the write channels of another)."""
    for name, member in sig.members.items():
        if member.flow == Out:
            m.d.comb += getattr(port, name).eq(getattr(master, name))
        else:
            m.d.comb += getattr(master, name).eq(getattr(port, name))
