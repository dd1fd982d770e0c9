"""A stand-in KV260 for `firmware.board.Kv260Device`: the board's files in a directory, so that the device's
real code runs against them: discovery, mmap of the DDR, cache syncs and the UIO interrupt protocol.

- `make_standin` (`standin`) builds ``sys/class/uio/...``, ``sys/class/u-dma-buf/<name>/...`` and ``dev/``.
  ``dev/<name>`` is a sparse file per DDR window, and ``dev/uio0`` links to a pseudo-terminal.
- `PtyInterrupt` (`interrupt`) holds the pty's master end. It reads the host's enable words and writes the
  interrupt count when the NPU's line is high.
- `CsrLink` (`csr`) is the device's ``csr=`` when a simulation serves the CSRs. A store to a mapped page
  cannot become a bus transaction, so the CSR page is the one part of the board that cannot be a file.
  `RegisterFile` is the CSR map's semantics in Python, for tests that need no NPU.

Running the host against the simulated NPU. The host must run in a plain thread, not a `cocotb.task.bridge`
thread, because its ``wait_interrupt`` blocks in ``read()`` on the pty while the simulation keeps running.
It only meets the simulation through the CSR link, the pty and the shared DDR files::

    board = make_standin(tmp_path, memory_map)               # a map whose windows fit the AXI address space
    ddr = board.memory()                                     # mem= of every AxiRamRead/AxiRamWrite
    host = threading.Thread(target=run_host, args=(board,))  # run_host: Kv260Device(memory_map,
    host.start()                                             #   root=board.root, csr=board.csr) + CsrBackend
    while host.is_alive():
        await board.csr.serve(bench.csr_read, bench.csr_write)   # AXI-Lite transactions for the host
        board.interrupt.update(bool(dut.o_irq.value))            # level: delivered once per enable
        await ClockCycles(dut.clk, 16)
    board.close(); ddr.close()

The full-chip bench's ``board`` test (`tb.npu.test_npu`) runs this loop on the NPU
(``pytest -m slow tests/test_npu.py -k board``).
"""

from .csr import CsrLink, CsrRequest, RegisterFile
from .interrupt import PtyInterrupt
from .standin import SYNC_FILES, StandinBoard, SyncRecord, decode_sync, make_standin

__all__ = ["make_standin", "StandinBoard", "SyncRecord", "decode_sync", "SYNC_FILES",
           "PtyInterrupt", "CsrLink", "CsrRequest", "RegisterFile"]
