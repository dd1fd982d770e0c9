"""cocotb bench of the stand-in board's wiring on RTL: `firmware.board.Kv260Device` runs unchanged in a plain
host thread against `hdl.csr.CsrBlock` behind cocotbext-axi's AxiLiteMaster.

This is the loop the full-chip bench uses (`tb.board` docstring). `CsrLink.serve` turns the host's CSR
accesses into AXI-Lite transactions, `PtyInterrupt.update` delivers the interrupt line to the host's blocking
``read()``, and `WindowedMemory` is the DDR both sides see. A small model stands in for the core behind the
block: it answers START with DONE and the interrupt 2,000 cycles later, copies the 16 bytes at
PROGRAM_BASE to SCRATCH_BASE through the shared DDR, and drops the line on IRQ_ACK. The host starts three
runs and waits for each on the interrupt, and the bench checks what it read.
"""

import tempfile
import threading

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from cocotbext.axi import AxiLiteBus, AxiLiteMaster, AxiResp

from firmware.board import Kv260Device
from hdl import csr_map
from hdl.config import PRESETS
from hdl.memory_map import MemoryMap, Window
from tb.board import make_standin

MAP = MemoryMap("bench", (Window("ddr_a", 0x0100_0000, 1 << 20), Window("ddr_b", 0x0400_0000, 1 << 20)),
                csr_base=0xA000_0000)
OFF = {r.name: r.offset for r in csr_map.REGISTERS}
RUNS = 3


def host(board, results: dict) -> None:
    """The host program: plain blocking code, as on the board."""
    try:
        with Kv260Device(MAP, root=board.root, csr=board.csr) as dev:
            results["hw"] = dev.hw.name
            for run in range(RUNS):
                src, dst = 0x0400_0100 + 64 * run, 0x0100_0200 + 64 * run
                dev.mem_write(src, bytes(range(16 * run, 16 * run + 16)))
                dev.csr_write(OFF["PROGRAM_BASE_LO"], src)
                dev.csr_write(OFF["SCRATCH_BASE_LO"], dst)
                dev.csr_write(OFF["CTRL"], csr_map.CTRL_START)
                status = dev.csr_read(OFF["STATUS"])
                while not status & csr_map.STATUS_DONE:
                    results.setdefault("counts", []).append(dev.wait_interrupt(timeout_s=60))
                    status = dev.csr_read(OFF["STATUS"])
                dev.csr_write(OFF["CTRL"], csr_map.CTRL_IRQ_ACK)
                results.setdefault("copied", []).append(dev.mem_read(dst, 16))
    except BaseException as e:     # reported by the bench
        results["error"] = e


async def core(dut, ddr, line: dict) -> None:
    """The behaviour behind the CSR block: START -> (copy, DONE, interrupt) later; IRQ_ACK -> line low."""
    while True:
        await RisingEdge(dut.clk)
        await ReadOnly()
        ctrl = int(dut.o_ctrl.value)
        if ctrl & csr_map.CTRL_START:
            src, dst = int(dut.o_program_base_lo.value), int(dut.o_scratch_base_lo.value)
            await ClockCycles(dut.clk, 2000)     # long enough that the host is waiting on the interrupt
            ddr[dst:dst + 16] = ddr[src:src + 16]
            dut.i_status.value = csr_map.STATUS_DONE
            line["high"] = True
        elif ctrl & csr_map.CTRL_IRQ_ACK:
            await RisingEdge(dut.clk)
            dut.i_status.value = 0
            line["high"] = False


@cocotb.test()
async def host_runs_through_the_standin(dut):
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    axil = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "axil", bus_separator="__"), dut.clk, dut.rst)

    async def csr_read(offset):
        resp = await axil.read(offset, 4)
        assert resp.resp == AxiResp.OKAY, f"CSR read at {offset:#x} answered {resp.resp!r}"
        return int.from_bytes(resp.data, "little")

    async def csr_write(offset, value):
        resp = await axil.write(offset, value.to_bytes(4, "little"))
        assert resp.resp == AxiResp.OKAY, f"CSR write at {offset:#x} answered {resp.resp!r}"

    for r in csr_map.REGISTERS:
        if r.access == "ro":
            getattr(dut, "i_" + r.name.lower()).value = 0
    dut.i_id.value = csr_map.NPU_ID
    dut.i_version.value = csr_map.version_word(PRESETS["tiny"].to_dict())
    dut.rst.value = 1
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0

    with tempfile.TemporaryDirectory() as root, make_standin(root, MAP) as board:
        ddr, line, results = board.memory(), {"high": False}, {}
        cocotb.start_soon(core(dut, ddr, line))
        thread = threading.Thread(target=host, args=(board, results), daemon=True)
        thread.start()
        cycles = 0
        while thread.is_alive():
            await board.csr.serve(csr_read, csr_write)
            board.interrupt.update(line["high"])
            await ClockCycles(dut.clk, 16)
            cycles += 16
            assert cycles < 2_000_000, "the host did not finish"
        board.csr.close()
        ddr.close()
        if "error" in results:
            raise results["error"]
        assert results["hw"] == "tiny"
        assert results["copied"] == [bytes(range(16 * r, 16 * r + 16)) for r in range(RUNS)]
        assert results["counts"] == list(range(1, RUNS + 1)), results["counts"]
        assert board.interrupt.count == RUNS and board.interrupt.words == [1] * RUNS
