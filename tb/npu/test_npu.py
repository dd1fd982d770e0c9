"""cocotb full-chip bench of `hdl.npu.Npu`: the host code of `firmware.runtime` drives the simulated NPU
(`tb.npu.bench`), DDR is cocotbext-axi RAM on every AXI master with random pauses on every channel, CSRs go
through cocotbext-axi's AXI-Lite master.

Tests:

- ``tokens``: an oracle case (``NPU_NPZ``, default the f64_s2_l7 fixture: 7 layers, sliding window 3,
  2 KV-shared layers, 1 sparse layer) token by token (``NPU_TOKENS``, default 4: position 3 crosses the
  window and overwrites ring slot 0, and its id 313 is outside the PLE vocabulary) through
  ``Runtime(backend="rtl")`` and ``Runtime(backend="iss", arithmetic="hardware")``: the logits of every step
  bit for bit, and every byte of DDR (KV cache, logits, scratch, and everything the program must not
  touch) equal to the ISS's view of it; with ``NPU_PREFILL`` = P the first P ids run as one
  ``Runtime.prefill`` (prefill programs, their projections as WGEMMs) checked as one step.
- ``bad_input``: programs with a reserved opcode, an L2 address beyond L2 (in a field, and a vector running
  past L2), no HALT, and START written while busy each end in STATUS.ERROR with the documented
  `hdl.isa.ErrorCode` and ERROR_PC (the ISS agrees on both; START while busy: the running program
  completes, STATUS = DONE | ERROR, ERROR_PC = its HALT); the NPU accepts a new START afterwards (STATUS
  reads 0 after IRQ_ACK), and every byte of DDR except what the program wrote before the error (which the
  ISS predicts) is unchanged.
- ``hazards``: directed programs of async WGEMVs (`hazard_programs`): every hazard an in-flight WGEMV can
  meet, FENCE, HALT right behind one, and an error while one runs; the DDR results and the error equal the
  ISS's (sequential execution). First, async WGEMVs whose weight reads get SLVERR (`async_fault_programs`)
  end in BUS_ERROR at the WGEMV's index, with independent work or another WGEMV behind them, and the
  programs after them run clean.
- ``gemm``: WGEMM on the systolic array (`gemm_programs`): several token tiles, accm, async WGEMMs with
  passes, a DMA and a WGEMV that meet or follow their rows, ragged rows (a descriptor of 13 rows) and columns
  (112), several row tiles and column chunks, HALT right behind one; a non-finite input in the second tile,
  malformed WGEMMs (no tokens, a column-major matrix, groups the scale lanes do not take, ranges past L2) and
  bus errors on the weights (async and not): DDR and the outcome equal the ISS's.
- ``tokpos``: CTRL SETTOK and SETPOS between the instructions that read TOKEN and POS (`tokpos_programs`):
  GATHERs of several tokens in one program (the host's TOKEN_ID first, a remapped one last), ROPE_COS/SIN and
  LDPOS at several positions, KVST at two positions and ATTN at three, SETTOK and SETPOS right behind an
  async WGEMV and WGEMM (their rows unchanged), an async WGEMV failing while SETTOK or SETPOS waits for it
  (BUS_ERROR at the WGEMV's index) and a GATHER after SETTOK beyond its table (ADDRESS_RANGE, the row
  before it written): DDR and the outcome equal the ISS's.
- ``board``: the on-board runtime's own code (`firmware.board.Kv260Device`: discovery, u-dma-buf windows, image
  load, relocation, PLE staging, the CSR protocol, the UIO interrupt wait) on the NPU, through a stand-in
  board (`tb.board`: sysfs files, ``/dev/<window>`` files the bench's DDR maps, a pty as ``/dev/uio0``, the CSR
  accesses as AXI4 transactions), packed for the kv260 map (``NPU_MEMORY_MAP``, ``NPU_WINDOW_BYTES``) with the
  high bank's buffer 1 MiB above where the map puts it, so the host relocates; logits and DDR equal the
  ISS's every step.
- ``compare``: what ``python -m tb.npu`` runs: `tokens` with the float64 golden model, the results written
  to the JSON file ``NPU_RESULT`` instead of asserted.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import threading
from pathlib import Path

import cocotb
import numpy as np
from cocotb.task import bridge
from cocotb.triggers import ClockCycles

from firmware.compiler import Program
from firmware.pack import pack
from firmware.runtime import CsrBackend, attach_rtl_device, detach_rtl_device
from hdl import csr_map
from hdl.config import HardwareConfig
from hdl.isa import (CtrlFunc, CvoFunc, DdrRegion, DecodeError, DmaDir, ErrorCode, Opcode, ScalarFunc, ShapeCache,
                     VecFunc, decode, encode)
from sim.config import ModelConfig
from sim.iss import HARDWARE, ExecutionError, Machine
from hdl.memory_map import memory_map
from tb.npu.bench import FLAT_WINDOWS, GUARD, NpuBench, SimDevice, parse_window_bytes, sim_memory_map, sim_windows
from tb.board import make_standin
from tb.npu.host import board_tokens, check_window, compare_modes, compare_tokens, iss_ddr, load_npz
from tb.runner import ROOT, bench_env

DEFAULT_NPZ = ROOT / "tests" / "fixtures" / "f64_s2_l7.npz"


def params():
    hw = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    seed = int(bench_env("SEED", "0"))
    npz = Path(bench_env("NPU_NPZ", str(DEFAULT_NPZ)))
    tokens = int(bench_env("NPU_TOKENS", "4"))
    return hw, seed, npz, tokens


def memory_map_name() -> str:
    """``NPU_MEMORY_MAP``: the memory map the token tests pack for and the bench's DDR windows (default flat)."""
    return bench_env("NPU_MEMORY_MAP", "flat")


def window_bytes() -> tuple[int, ...] | int:
    """``NPU_WINDOW_BYTES``: a board map's windows are clipped to these sizes (`sim_memory_map`, e.g. "128K,64M")."""
    sizes = parse_window_bytes(bench_env("NPU_WINDOW_BYTES", "64M"))
    return sizes[0] if len(sizes) == 1 else sizes


async def setup(dut, hw, seed, **kw):
    kw.setdefault("windows", sim_windows(memory_map_name(), window_bytes()))
    kw.setdefault("timeout_cycles", int(bench_env("NPU_TIMEOUT_CYCLES", "20000000")))
    bench = NpuBench(dut, hw, seed=seed, **kw)
    await bench.start()
    device = SimDevice(bench)
    attach_rtl_device(device)
    return bench, device


@cocotb.test()
async def tokens(dut):
    hw, seed, npz, n = params()
    bench, device = await setup(dut, hw, seed)
    case = load_npz(npz)
    try:
        mm = sim_memory_map(memory_map_name(), window_bytes())
        records = await bridge(compare_tokens)(device, case, hw, n, golden=False, memory_map=mm, log=dut._log.info,
                                               prefill=int(bench_env("NPU_PREFILL", "0")))
    finally:
        detach_rtl_device()
    assert not bench.faults, f"accesses outside the DDR window: {bench.faults[:8]}"
    assert not bench.unquiet, f"the NPU was not quiet at its interrupt: {bench.unquiet[:4]}"
    for r in records:
        np.testing.assert_array_equal(r["logits_rtl"].view(np.uint32), r["logits_iss"].view(np.uint32),
                                      err_msg=f"{case.name} step {r['step']} (token {r['token']}): RTL logits "
                                              f"differ from the ISS in {r['mismatches']} places")
        assert not r["ddr_problems"], \
            f"{case.name} step {r['step']}: DDR differs from the ISS's view: {'; '.join(r['ddr_problems'])}"
        assert not r["plan_problems"], \
            f"{case.name} step {r['step']}: the controller's steps differ from sim.plan: {'; '.join(r['plan_problems'])}"


@cocotb.test()
async def modes(dut):
    """Batched steps (NPU_STREAMS) or speculative verify passes with rollbacks (NPU_SPECULATE drafts), NPU_TOKENS
    times (`tb.npu.host.compare_modes`): every logits row and every DDR byte against the ISS."""
    hw, seed, npz, n = params()
    bench, device = await setup(dut, hw, seed)
    case = load_npz(npz)
    try:
        mm = sim_memory_map(memory_map_name(), window_bytes())
        records = await bridge(compare_modes)(device, case, hw, n, streams=int(bench_env("NPU_STREAMS", "1")),
                                              speculate=int(bench_env("NPU_SPECULATE", "0")), memory_map=mm,
                                              log=dut._log.info)
    finally:
        detach_rtl_device()
    assert not bench.faults, f"accesses outside the DDR window: {bench.faults[:8]}"
    result = bench_env("NPU_RESULT", "")
    if result:
        Path(result).write_text(json.dumps({"npz": str(npz), "hw": hw.name, "seed": seed, "steps": [
            {k: v for k, v in r.items() if not k.startswith("logits_")} for r in records]}, indent=1))
    for r in records:
        np.testing.assert_array_equal(r["logits_rtl"].view(np.uint32), r["logits_iss"].view(np.uint32),
                                      err_msg=f"{case.name} {r['what']}: RTL logits differ from the ISS in "
                                              f"{r['mismatches']} places")
        assert not r["ddr_problems"], f"{case.name} {r['what']}: DDR differs from the ISS's: {'; '.join(r['ddr_problems'])}"


@cocotb.test()
async def compare(dut):
    hw, seed, npz, n = params()
    bench, device = await setup(dut, hw, seed)
    case = load_npz(npz)
    try:
        mm = sim_memory_map(memory_map_name(), window_bytes())
        records = await bridge(compare_tokens)(device, case, hw, n, golden=True, memory_map=mm, log=dut._log.info,
                                               prefill=int(bench_env("NPU_PREFILL", "0")))
    finally:
        detach_rtl_device()
    out = {"npz": str(npz), "hw": hw.name, "seed": seed, "memory_map": memory_map_name(),
           "windows": [[w.name, w.base, w.size] for w in bench.windows], "faults": bench.faults[:16],
           "steps": [{k: v for k, v in r.items() if not k.startswith("logits_")} for r in records]}
    Path(bench_env("NPU_RESULT")).write_text(json.dumps(out, indent=1))


@cocotb.test()
async def board(dut):
    hw, seed, npz, n = params()
    name = memory_map_name() if memory_map_name() != "flat" else "kv260"
    mm = sim_memory_map(name, window_bytes())
    moved = {mm.windows[0].name: mm.windows[0].base + (1 << 20)}
    with tempfile.TemporaryDirectory() as root, make_standin(root, mm, phys_addrs=moved) as stand_in:
        windows = tuple(stand_in.windows.values())
        backing = stand_in.buffers()
        for buf in backing.values():        # what DDR holds before the host writes (check_window's guard)
            buf[:] = bytes([GUARD]) * len(buf)
        bench = NpuBench(dut, hw, seed=seed, windows=windows, backing=backing)
        await bench.start()
        results = {}
        host = threading.Thread(target=board_tokens, args=(stand_in, mm, load_npz(npz), hw, n, bench, results),
                                daemon=True)
        host.start()
        cycles = 0
        while host.is_alive():
            await stand_in.csr.serve(bench.csr_read, bench.csr_write)
            stand_in.interrupt.update(bool(dut.o_irq.value))
            await ClockCycles(dut.clk, 16)
            cycles += 16
            assert cycles < bench.timeout_cycles * (n + 1), "the host did not finish"
        stand_in.csr.close()
        bench.mem.close()
    if "error" in results:
        raise results["error"]
    assert results["hw"] == hw.name and results["relocated"]
    assert not bench.faults, f"accesses outside the DDR windows: {bench.faults[:8]}"
    assert not bench.unquiet, f"the NPU was not quiet at its interrupt: {bench.unquiet[:4]}"
    assert stand_in.interrupt.count >= n, "the host waited on the interrupt for every token"
    for r in results["records"]:
        np.testing.assert_array_equal(r["logits_rtl"].view(np.uint32), r["logits_iss"].view(np.uint32),
                                      err_msg=f"board step {r['step']} (token {r['token']})")
        assert not r["ddr_problems"], f"board step {r['step']}: DDR differs: {'; '.join(r['ddr_problems'])}"


# --- bad input -------------------------------------------------------------------------------------------

def _program(words) -> Program:
    return Program(words=list(words), steps=["bad_input"] * len(words))


def _ctrl(func, imm=0):
    return encode(Opcode.CTRL, func=func, imm=imm)


def bad_programs(hw: HardwareConfig, with_dma: bool = True):
    """(name, words, expected ErrorCode, expected ERROR_PC) of every malformed program."""
    l2w = hw.l2_bytes // 16
    halt = _ctrl(CtrlFunc.HALT)
    # Work done before the error: 16 CONST words through L2 into LOGITS (an output the ISS predicts).
    prefix = [_ctrl(CtrlFunc.SETVL, 16), _ctrl(CtrlFunc.NOP)]
    if with_dma:
        prefix += [encode(Opcode.DMA, dir=DmaDir.DDR_TO_L2, region=DdrRegion.CONST, l2=8, offset=0, async_=0),
                   encode(Opcode.DMA, dir=DmaDir.L2_TO_DDR, region=DdrRegion.LOGITS, l2=8, offset=0, async_=0)]
    p = len(prefix)
    vec = dict(func=VecFunc.COPY, a=0, b=0, s=0, async_=0)
    cases = [
        ("reserved opcode 0xE", prefix + [0xE << 60 | 0x123, halt], ErrorCode.BAD_OPCODE, p),
        ("reserved opcode 0xF", prefix + [0xF << 60, halt], ErrorCode.BAD_OPCODE, p),
        ("L2 address field beyond L2", prefix + [encode(Opcode.VEC, dst=l2w, **vec), halt],
         ErrorCode.ADDRESS_RANGE, p),
        ("no HALT", prefix + [_ctrl(CtrlFunc.NOP)], ErrorCode.BAD_LENGTH, p + 1),
    ]
    if with_dma:
        cases.append(("vector running past L2",
                      prefix + [_ctrl(CtrlFunc.SETVL, 64), encode(Opcode.VEC, dst=l2w - 4, **vec), halt],
                      ErrorCode.ADDRESS_RANGE, p + 1))
    return prefix + [halt], cases


def _iss_outcome(image, hw, words, token=0, pos=0):
    img = dataclasses.replace(image, ddr=image.ddr.copy())
    m = Machine(img, hw, HARDWARE)
    try:
        m.run(words, token=token, pos=pos)
        err = None
    except ExecutionError as e:
        err = (e.code, e.pc)
    return m, img, err


def bad_input_host(device, case, hw, log, with_dma=True) -> list[str]:
    """Blocking host code of `bad_input`; returns the failures (empty: pass)."""
    cfg = ModelConfig.from_hf(case.config)
    image = pack(cfg, case.tensors, hw, max_positions=4)
    npu = CsrBackend(device)
    good, cases = bad_programs(hw, with_dma)
    failures = []

    def expect_memory(words, what):
        m, img, _ = _iss_outcome(image, hw, words)
        problems = check_window(device, iss_ddr(m, img, _program(words)), image)
        if problems:
            failures.append(f"{what}: DDR differs from the ISS's prediction: {'; '.join(problems)}")

    def run_good(after):
        npu.load(image, _program(good))
        status = npu.csr_read("STATUS")
        if status & (csr_map.STATUS_BUSY | csr_map.STATUS_DONE | csr_map.STATUS_ERROR):
            failures.append(f"after {after} and IRQ_ACK: STATUS = {status:#x}, expected 0")
        try:
            npu.run(0, 0)
        except ExecutionError as e:
            failures.append(f"after {after}: a good program stopped with {e.code.name} at {e.pc}")
            return
        expect_memory(good, f"the good program after {after}")

    run_good("reset")
    for name, words, code, pc in cases:
        _, _, iss = _iss_outcome(image, hw, words)
        if iss != (code, pc):
            failures.append(f"{name}: the ISS reports {iss}, the test expects {(code, pc)}")
        npu.load(image, _program(words))
        try:
            npu.run(0, 0)
            failures.append(f"{name}: the NPU reached HALT (expected {code.name} at {pc})")
        except ExecutionError as e:
            if (e.code, e.pc) != (code, pc):
                failures.append(f"{name}: ERROR_CODE {e.code.name}, ERROR_PC {e.pc}; expected {code.name}, {pc}")
        log(f"bad input: {name}: done")
        expect_memory(words, name)
        run_good(name)

    # START while busy: a long program (NOPs, then the DMA pair, HALT); START again while it runs. The START
    # is ignored; the program completes (DONE, its DMA done) and ERROR reports START_WHILE_BUSY at the HALT.
    long = [_ctrl(CtrlFunc.NOP)] * 2000 + good
    halt_pc = len(long) - 1
    npu.load(image, _program(long))
    npu.start(0, 0)
    status = npu.csr_read("STATUS")
    if not status & csr_map.STATUS_BUSY:
        failures.append(f"START while busy: STATUS = {status:#x} right after START ({len(long)} words)")
    npu.csr_write("CTRL", csr_map.CTRL_START)
    device.wait_interrupt()
    status = npu.csr_read("STATUS")
    want = csr_map.STATUS_DONE | csr_map.STATUS_ERROR
    if status != want:
        failures.append(f"START while busy: STATUS = {status:#x}, expected DONE | ERROR ({want:#x})")
    try:
        npu.wait()
        failures.append("START while busy: the NPU reported DONE without ERROR")
    except ExecutionError as e:
        if (e.code, e.pc) != (ErrorCode.START_WHILE_BUSY, halt_pc):
            failures.append(f"START while busy: ERROR_CODE {e.code.name}, ERROR_PC {e.pc}; expected "
                            f"START_WHILE_BUSY at the HALT ({halt_pc})")
    expect_memory(long, "START while busy")
    run_good("START while busy")
    return failures


# --- async WGEMV: hazards ---------------------------------------------------------------------------------

def hazard_programs(image, hw: HardwareConfig) -> list[tuple[str, list[int], tuple | None]]:
    """(name, words, expected (ErrorCode, pc) or None) of directed async-WGEMV programs: every hazard an
    in-flight WGEMV can meet (a pass reading its rows at once, a pass writing its source, an independent pass
    beside it, the next WGEMV with accm on the same rows, a partial overwrite of those rows, a DMA reading
    them, FENCE, HALT right behind one) and an error while one runs. Results leave through SCRATCH/LOGITS."""
    dense = {k: d for k, d in image.matrices().items() if d.layout == 0 and d.cols == 64}
    q, gate, up, small = (dense[f"layers.0.{n}.weight"] for n in
                          ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj", "laurel.linear_left"))
    assert q.rows == gate.rows == up.rows == 128 and small.rows == 8, "the fixture's tiny shapes changed"
    setvl = lambda n: _ctrl(CtrlFunc.SETVL, n)
    vec = lambda f, dst, a, b=0: encode(Opcode.VEC, func=f, dst=dst, a=a, b=b, s=0, async_=0)
    wgemv = lambda dst, d, accm=0: encode(Opcode.WGEMV, dst=dst, src=0, desc=d.index, accm=accm, findemax=0,
                                          sparse=0, reuse=0, mask=0, async_=1)
    dma = lambda d, region, l2, off: encode(Opcode.DMA, dir=d, region=region, l2=l2, offset=off, async_=0)
    # L2 words: x 0..15, A 64..95, B 128..159, C 192..223, D 256..287, E 320..321
    body = [
        setvl(64), dma(DmaDir.DDR_TO_L2, DdrRegion.CONST, 0, 0),
        wgemv(64, q),                                    # A = Wq x
        setvl(128), vec(VecFunc.ADD, 128, 64, 64),       # B = A + A: reads A at once
        wgemv(192, gate),                                # C = Wg x
        setvl(64), vec(VecFunc.MUL, 0, 0, 0),            # x = x * x: the source of the running WGEMV
        setvl(128), vec(VecFunc.ADD, 256, 128, 128),     # D = B + B: independent of C
        wgemv(192, up, accm=1),                          # C += Wu x^2 (waits for the engine; reads C)
        setvl(16), vec(VecFunc.COPY, 200, 256),          # C[32:48] = D[0:16]: meets the running rows
        setvl(1024), dma(DmaDir.L2_TO_DDR, DdrRegion.SCRATCH, 64, 0),     # A..D out
        wgemv(320, small),                               # E = Ws x^2
        setvl(8), dma(DmaDir.L2_TO_DDR, DdrRegion.LOGITS, 320, 0),        # E out at once
        wgemv(324, small), _ctrl(CtrlFunc.FENCE),
        dma(DmaDir.L2_TO_DDR, DdrRegion.LOGITS, 324, 2),
        wgemv(64, small),                                # HALT right behind a WGEMV
    ]
    halt = _ctrl(CtrlFunc.HALT)
    reuse = lambda dst, d: encode(Opcode.WGEMV, dst=dst, src=0, desc=d.index, accm=0, findemax=0, sparse=0,
                                  reuse=1, mask=0, async_=1)
    wide = next(d for d in image.descriptors if d.kind == 0 and d.layout == 0 and d.cols == 128)
    held = [
        setvl(64), dma(DmaDir.DDR_TO_L2, DdrRegion.CONST, 0, 0),
        wgemv(64, q),                                    # A = Wq x (quantises x into the engine)
        vec(VecFunc.MUL, 0, 0, 0),                       # x = x * x, while A streams
        reuse(128, gate),                                # B = Wg x: the engine's x, not L2's x^2
        reuse(192, up),                                  # C = Wu x
        wgemv(256, small),                               # E = Ws x^2 (quantises again)
        setvl(1024), dma(DmaDir.L2_TO_DDR, DdrRegion.SCRATCH, 0, 0),      # x^2, A..E out
    ]
    return [("hazards", body + [halt], None),
            ("an error while a WGEMV runs", body[:3] + [0xE << 60, halt], (ErrorCode.BAD_OPCODE, 3)),
            ("WGEMV reuse: the engine's activations", held + [halt], None),
            ("WGEMV reuse before any quantiser pass", held[:2] + [reuse(128, gate), halt], (ErrorCode.BAD_LENGTH, 2)),
            ("WGEMV reuse of another length", held[:3] + [reuse(128, wide), halt], (ErrorCode.BAD_LENGTH, 3))]


BAD_WEIGHT_OFFSET = 1 << 28     # beyond the bench's 64 MiB DDR window: the RAM answers SLVERR


def _bench_image(case, hw):
    """The fixture packed where the bench's flat DDR window is, so that the host places it without relocating
    (a relocation re-bases the descriptor table from the manifest, which would undo a broken descriptor)."""
    mm = dataclasses.replace(memory_map("flat"), windows=FLAT_WINDOWS)
    return pack(ModelConfig.from_hf(case.config), case.tensors, hw, max_positions=4, memory_map=mm)


def async_fault_programs(image, hw: HardwareConfig):
    """(name, words, expected (ErrorCode, pc)) of async WGEMVs whose weights meet bus errors, and the image
    whose DDR descriptor of q_proj points outside the DDR window (the ISS reads the manifest, so it runs
    these programs to HALT: the expected outcomes are the documented imprecise error, at the WGEMV's pc)."""
    d = next(d for d in image.descriptors if d.tensor == "layers.0.self_attn.q_proj.weight")
    gate = next(d for d in image.descriptors if d.tensor == "layers.0.mlp.gate_proj.weight")
    bad = dataclasses.replace(image, ddr=image.ddr.copy())
    at = bad.ddr_offset(bad.region("DESC")[0] + 32 * d.index, 8)
    bad.ddr[at:at + 8] = np.frombuffer((d.weight_offset + BAD_WEIGHT_OFFSET).to_bytes(8, "little"), np.uint8)
    wgemv = lambda dst, desc: encode(Opcode.WGEMV, dst=dst, src=0, desc=desc.index, accm=0, findemax=0,
                                     sparse=0, reuse=0, mask=0, async_=1)
    head = [_ctrl(CtrlFunc.SETVL, 64), encode(Opcode.DMA, dir=DmaDir.DDR_TO_L2, region=DdrRegion.CONST, l2=0,
                                              offset=0, async_=0), wgemv(64, d)]
    halt = _ctrl(CtrlFunc.HALT)
    add = encode(Opcode.VEC, func=VecFunc.ADD, dst=256, a=128, b=128, s=0, async_=0)
    return bad, [
        ("a bus error on an async WGEMV, independent work after it",
         head + [_ctrl(CtrlFunc.SETVL, 128), add, halt], (ErrorCode.BUS_ERROR, 2)),
        ("a bus error on an async WGEMV, another WGEMV after it", head + [wgemv(192, gate), halt],
         (ErrorCode.BUS_ERROR, 2)),
    ]


def run_directed(device, hw, cases, broken, log, tag) -> list[str]:
    """Run (image, name, words, expected outcome[, position[, token]]) programs on the NPU and the ISS (the
    host's POSITION and TOKEN_ID, default 0); returns the failures. On
    `broken` (an image whose weights point outside the DDR window) the ISS, which does not model bus errors,
    is taken to agree with the expected outcome."""
    npu = CsrBackend(device)
    failures = []
    only = bench_env("NPU_PROGRAMS", "")       # a part of the names of the programs to run (default all)
    for img0, name, words, want, *at in cases:
        if only not in name:
            continue
        pos, token = (list(at) + [0, 0])[:2]
        m, img, iss = _iss_outcome(img0, hw, words, token=token, pos=pos)
        if img0 is broken and iss is None:
            iss = want
        if iss != want:
            failures.append(f"{name}: the ISS reports {iss}, the test expects {want}")
        npu.load(img0, _program(words))
        seen = len(device.bench.unquiet)
        try:
            npu.run(token, pos)
            got = None
        except ExecutionError as e:
            got = (e.code, e.pc)
        failures += [f"{name}: not quiet at the interrupt: {'; '.join(busy)}"
                     for _, busy in device.bench.unquiet[seen:]]
        if got != want:
            failures.append(f"{name}: the NPU ended with {got}, expected {want}")
        problems = check_window(device, iss_ddr(m, img, _program(words)), img0)
        if problems:
            failures.append(f"{name}: DDR differs from the ISS: {'; '.join(problems)}")
        failures += [f"{name}: {p}" for p in _unit_counter_problems(words, npu.counters, got is None, hw)]
        log(f"{tag}: {name}: {npu.counters}")
    return failures


def _unit_counter_problems(words, counters, completed, hw) -> list[str]:
    """The GEMV and GEMM busy counters against the program: zero for a unit no instruction uses (the GEMV
    engine: WGEMV, ATTN on the INT8 KV cache, and WGEMM where the engine has several vectors and there is no
    GEMM unit), and non-zero for the unit that runs a WGEMM of at least one token in a program that
    completed."""
    ops = []
    for w in words:
        try:
            ops.append(decode(w))
        except DecodeError:
            pass
    wgemm_unit = "GEMV_BUSY" if hw.gemv_vectors > 1 else "GEMM_BUSY"
    gemv_users = (Opcode.WGEMV, Opcode.ATTN) + ((Opcode.WGEMM,) if hw.gemv_vectors > 1 else ())
    problems = []
    for unit, users in (("GEMV_BUSY", gemv_users), ("GEMM_BUSY", (Opcode.WGEMM,) if hw.gemv_vectors == 1 else ())):
        if not any(i.op in users for i in ops) and counters[unit]:
            problems.append(f"{unit} = {counters[unit]} with no {' or '.join(u.name for u in users) or 'user'} in "
                            f"the program")
    if completed and any(i.op == Opcode.WGEMM and i.tokens for i in ops) and not counters[wgemm_unit]:
        problems.append(f"{wgemm_unit} = 0 after a WGEMM ran")
    return problems


def hazards_host(device, case, hw, log) -> list[str]:
    """Blocking host code of `hazards`; returns the failures (empty: pass)."""
    image = _bench_image(case, hw)
    bad, faulty = async_fault_programs(image, hw)
    cases = [(bad, *c) for c in faulty] + [(image, *c) for c in hazard_programs(image, hw)]
    return run_directed(device, hw, cases, bad, log, "hazards")


# --- ATTN and KVST on the INT8 KV cache ---------------------------------------------------------------------

ATTN_POS = 1100      # beyond tiny's gemv_max_cols (1024): the V GEMVs run in two chunks


def _random_kv(image, hw: HardwareConfig, seed: int = 7):
    """`image` with every INT8 KV slot filled at random: planes of random nibbles, K scales 2**(e+4) / 2**e
    and V row scales 2**e for small random e (sim.numerics.KvInt8Layout)."""
    from sim.numerics import KvInt8Layout
    rng = np.random.default_rng(seed)
    img = dataclasses.replace(image, ddr=image.ddr.copy())
    base = img.region("KV")[0]
    for d in img.descriptors:
        if d.kind != 2:
            continue
        lay = KvInt8Layout(d.capacity, d.heads, d.head_dim, hw.act_block)
        at = img.ddr_offset(base + d.weight_offset, 1)      # the slot in the image (one window holds KV)
        img.ddr[at:at + lay.scales_base] = rng.integers(0, 256, lay.scales_base, dtype=np.uint8)
        for j in range(d.heads):
            e = rng.integers(-6, -2, d.capacity * lay.kblocks)
            for off, bias in ((lay.ks_hi(j), 4), (lay.ks_lo(j), 0)):
                img.ddr[at + off:at + off + lay.kscale] = np.exp2(e + bias).astype("<f2").view(np.uint8)
            vs = np.exp2(rng.integers(-3, 2, d.capacity)).astype("<f2").view(np.uint8)
            img.ddr[at + lay.vs(j):at + lay.vs(j) + 2 * d.capacity] = vs
    return img


def attention_programs(image, hw: HardwareConfig):
    """(image, name, words, expected (ErrorCode, pc) or None, position) of directed ATTN/KVST programs on a
    random INT8 KV cache: full attention over 1,101 positions (two V chunks) for both KV heads, a sliding ring,
    KVST then ATTN, ATTN waiting for an async WGEMV, a ring wider than the window (wrapping and not), and the
    errors (a non-finite query, K or V value, a scale beyond binary16, a slot descriptor of the other format). Results
    leave through LOGITS."""
    from firmware.compiler import SHAPE_FULL, SHAPE_SLIDING
    cfg = ModelConfig.from_hf(image.config)
    img = _random_kv(image, hw)
    full = img.kv_slots[next(i for i in cfg.kv_cache_layers if not cfg.is_sliding(i))]
    slide = img.kv_slots[next(i for i in cfg.kv_cache_layers if cfg.is_sliding(i))]
    hd, group = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    w = group * hd // 4                                     # L2 words of one group's queries / outputs
    halt = _ctrl(CtrlFunc.HALT)
    setvl = lambda n: _ctrl(CtrlFunc.SETVL, n)
    dma = lambda d, region, l2, off: encode(Opcode.DMA, dir=d, region=region, l2=l2, offset=off, async_=0)
    shape = lambda slot, win: encode(Opcode.MEMSET, cache=ShapeCache.FMAP, slot=slot, a=group, b=hd, c=win)
    attn = lambda dst, q, slot, kvh, ptr: encode(Opcode.ATTN, dst=dst, q=q, slot=slot, kv_head=kvh, shape_ptr=ptr,
                                                 async_=0)
    kvst = lambda k, v, slot: encode(Opcode.KVST, k=k, v=v, slot=slot, shape_ptr=0, async_=0)
    store = lambda elem, hi16: [encode(Opcode.MEMSET, cache=ShapeCache.SCALAR, slot=1, a=hi16, b=0, c=0),
                                encode(Opcode.SCALAR, func=ScalarFunc.ST, d=0, a=1, b=0, imm=elem)]
    # L2 words: queries / K and V rows from CONST at 0.. (2w), outputs at 64.., the WGEMV's rows at 128..; only
    # what a program writes leaves (L2 keeps the previous program's data on the NPU, not in the ISS)
    head = [setvl(2 * group * hd), dma(DmaDir.DDR_TO_L2, DdrRegion.CONST, 0, 0),
            shape(SHAPE_FULL, 0), shape(SHAPE_SLIDING, cfg.sliding_window)]
    out = lambda n: [setvl(n), dma(DmaDir.L2_TO_DDR, DdrRegion.LOGITS, 64, 0)]
    both = [attn(64, 0, full, 0, SHAPE_FULL), attn(64 + w, w, full, 1, SHAPE_FULL)]
    q_inf = store(hd + 3, 0x7F80)                           # head 1's query element 3 = inf
    kv_w = cfg.num_key_value_heads * hd // 4
    qproj = next(d for d in img.descriptors if d.tensor == "layers.0.self_attn.q_proj.weight")
    wgemv = encode(Opcode.WGEMV, dst=128, src=0, desc=qproj.index, accm=0, findemax=0, sparse=0,
                   reuse=0, mask=0, async_=1)
    p = len(head)
    cases = [
        ("full attention over 1,101 positions, both KV heads", head + both + out(2 * group * hd) + [halt], None,
         ATTN_POS),
        ("sliding attention on a full ring", head + [attn(64, 0, slide, 1, SHAPE_SLIDING)] + out(group * hd)
         + [halt], None, ATTN_POS),
        ("KVST, then attention over the new row", head + [kvst(0, kv_w, full), attn(64, 0, full, 0, SHAPE_FULL)]
         + out(group * hd) + [halt], None, 37),
        ("attention while an async WGEMV runs", head + [setvl(64), wgemv, attn(64, 0, full, 1, SHAPE_FULL)]
         + out(group * hd) + [setvl(qproj.rows), dma(DmaDir.L2_TO_DDR, DdrRegion.SCRATCH, 128, 0), halt], None, 9),
        ("a query holding an infinity", head + q_inf + both + [halt], (ErrorCode.NON_FINITE, p + 2), 5),
        ("KVST of a V row holding an infinity", head + store(4 * kv_w + hd + 1, 0x7F80) + [kvst(0, kv_w, full), halt],
         (ErrorCode.NON_FINITE, p + 2), 6),
        ("KVST of a K value beyond the binary16 scales", head + store(hd + 2, 0x4900) + [kvst(0, kv_w, full), halt],
         (ErrorCode.NON_FINITE, p + 2), 6),
        # a ring one row wider than the window: positions pos - window + 1 .. pos, from the oldest one's slot on,
        # wrapping at the ring's end where they do (sim.plan.attn_pieces)
        *((f"sliding attention over a ring wider than its window at position {pos}",
           head + [shape(SHAPE_SLIDING, cfg.sliding_window - 1), attn(64, 0, slide, 0, SHAPE_SLIDING)]
           + out(group * hd) + [halt], None, pos) for pos in (ATTN_POS, ATTN_POS + 1)),
    ]
    reuse = encode(Opcode.WGEMV, dst=128, src=0, desc=qproj.index, accm=0, findemax=0, sparse=0,
                   reuse=1, mask=0, async_=1)
    cases.append(("WGEMV reuse after an ATTN (its GEMVs quantised into the engine)",
                  head + [setvl(64), wgemv, attn(64, 0, full, 1, SHAPE_FULL), reuse, halt],
                  (ErrorCode.BAD_LENGTH, p + 3), 9))
    wrong = _with_descriptor(img, full, layout=0)
    progs = [(img, *c) for c in cases]
    progs.append((wrong, "a binary16 slot descriptor", head + [attn(64, 0, full, 0, SHAPE_FULL), halt],
                  (ErrorCode.BAD_DESCRIPTOR, p), 3))
    return progs


def attention_host(device, case, hw, log) -> list[str]:
    """Blocking host code of `attention`; returns the failures (empty: pass)."""
    image = pack(ModelConfig.from_hf(case.config), case.tensors, hw, max_positions=ATTN_POS + 4)
    return run_directed(device, hw, attention_programs(image, hw), None, log, "attention")


# --- WGEMM on the systolic array ----------------------------------------------------------------------------

def _with_descriptor(image, index, **changes):
    """The image with descriptor `index` changed in its manifest and in DDR."""
    d = dataclasses.replace(image.descriptors[index], **changes)
    img = dataclasses.replace(image, ddr=image.ddr.copy(), descriptors=list(image.descriptors))
    img.descriptors[index] = d
    at = img.ddr_offset(img.region("DESC")[0] + 32 * index, 32)
    img.ddr[at:at + 32] = np.frombuffer(d.to_bytes(), np.uint8)
    return img


def gemm_programs(image, hw: HardwareConfig):
    """(image, name, words, expected (ErrorCode, pc) or None) of directed WGEMM programs (see ``gemm``)."""
    by = image.matrices()
    q, o, small = (by[f"layers.1.{n}.weight"] for n in ("self_attn.q_proj", "self_attn.o_proj", "laurel.linear_left"))
    wide, table = by["embed_tokens_per_layer.weight"], by["embed_tokens.weight"]
    g8 = by["layers.1.laurel.linear_right.weight"]
    colmajor = next(d for d in image.descriptors if d.kind == 0 and d.layout == 1)
    assert (q.rows, q.cols, o.rows, o.cols, wide.cols, small.rows) == (128, 64, 64, 128, 112, 8), \
        "the fixture's tiny shapes changed"
    assert g8.group != hw.weight_group
    # a ragged sub-matrix: 13 rows of the embedding table from row 5
    entry = image.tensors[table.tensor]
    pcols, ngroups = table.cols + table.cols % 2, -(-table.cols // table.group)
    ragged = _with_descriptor(image, table.index, rows=13, row_start=5,
                              weight_offset=entry.offset + 5 * pcols // 2,
                              scale_offset=entry.scale_offset + 5 * ngroups * 2)
    setvl = lambda n: _ctrl(CtrlFunc.SETVL, n)
    wgemm = lambda dst, src, d, t, accm=0, a=1: encode(Opcode.WGEMM, dst=dst, src=src, desc=d.index, tokens=t,
                                                        accm=accm, async_=a)
    dma = lambda d, region, l2, off: encode(Opcode.DMA, dir=d, region=region, l2=l2, offset=off, async_=0)
    load = [setvl(1024), dma(DmaDir.DDR_TO_L2, DdrRegion.CONST, 0, 0)]      # x: L2 words 0..255
    halt = _ctrl(CtrlFunc.HALT)
    tiles = load + [
        wgemm(512, 0, q, 6, a=0),                        # two token tiles (4 + 2): words 512..703
        wgemm(512, 16, q, 6, accm=1),                    # += the next six tokens' products, async
        setvl(64), encode(Opcode.VEC, func=VecFunc.ADD, dst=704, a=512, b=512, s=0, async_=0),   # meets its rows
        setvl(832), dma(DmaDir.L2_TO_DDR, DdrRegion.SCRATCH, 512, 0),              # words 512..719
        wgemm(720, 0, o, 5),                             # 128 columns: two chunks; 720..799
        setvl(320), dma(DmaDir.L2_TO_DDR, DdrRegion.LOGITS, 720, 0),              # meets its rows
        encode(Opcode.WGEMV, dst=800, src=0, desc=small.index, accm=0, findemax=0, sparse=0, reuse=0, mask=0, async_=1),
        wgemm(802, 0, ragged.descriptors[table.index], 9, a=0),     # 13 rows, three token tiles: 802..837
        wgemm(838, 0, small, 1),
        setvl(160), dma(DmaDir.L2_TO_DDR, DdrRegion.SCRATCH, 800, 208),           # words 800..839
        wgemm(1024, 0, q, 4), halt,                      # HALT right behind an async WGEMM
    ]
    wide_prog = load + [
        wgemm(512, 0, wide, 3),                          # 256 rows (32 row tiles) x 112 columns: 512..703
        setvl(768), dma(DmaDir.L2_TO_DDR, DdrRegion.SCRATCH, 512, 0),   # reads its rows: waits
        halt,
    ]
    inf = [encode(Opcode.MEMSET, cache=ShapeCache.SCALAR, slot=1, a=0x7F80, b=0, c=0),
           encode(Opcode.SCALAR, func=ScalarFunc.ST, d=0, a=1, b=0, imm=5 * 64 + 3)]   # token 5's x[3] = inf
    bad = lambda *w: load + list(w) + [halt]
    progs = [
        (ragged, "WGEMM: token tiles, accm, async hazards, ragged rows", tiles, None),
        (image, "WGEMM: 32 row tiles, 112 columns", wide_prog, None),
        (image, "WGEMM: an infinity in the second token tile", load + inf + [wgemm(512, 0, q, 6), halt],
         (ErrorCode.NON_FINITE, 4)),
        (image, "WGEMM of no tokens", bad(wgemm(512, 0, q, 0)), (ErrorCode.BAD_LENGTH, 2)),
        (image, "WGEMM of a column-major matrix", bad(wgemm(512, 0, colmajor, 2)), (ErrorCode.BAD_DESCRIPTOR, 2)),
        (image, "WGEMM with groups of 8", bad(wgemm(512, 0, g8, 2)), (ErrorCode.BAD_DESCRIPTOR, 2)),
        (image, "WGEMM source past L2", bad(wgemm(512, 4090, q, 2)), (ErrorCode.ADDRESS_RANGE, 2)),
        (image, "WGEMM rows past L2", bad(wgemm(4000, 0, q, 6)), (ErrorCode.ADDRESS_RANGE, 2)),
    ]
    # bus errors: q_proj's weights outside the DDR window
    at = image.ddr_offset(image.region("DESC")[0] + 32 * q.index, 8)
    broken = dataclasses.replace(image, ddr=image.ddr.copy())
    broken.ddr[at:at + 8] = np.frombuffer((q.weight_offset + BAD_WEIGHT_OFFSET).to_bytes(8, "little"), np.uint8)
    add = encode(Opcode.VEC, func=VecFunc.ADD, dst=900, a=800, b=800, s=0, async_=0)
    progs += [
        (broken, "a bus error on an async WGEMM, independent work after it",
         load + [wgemm(512, 0, q, 3), setvl(64), add, halt], (ErrorCode.BUS_ERROR, 2)),
        (broken, "a bus error on a WGEMM of two token tiles", load + [wgemm(512, 0, q, 6, a=0), halt],
         (ErrorCode.BUS_ERROR, 2)),
    ]
    return progs, broken


def gemm_host(device, case, hw, log) -> list[str]:
    """Blocking host code of `gemm`; returns the failures (empty: pass)."""
    image = _bench_image(case, hw)
    progs, broken = gemm_programs(image, hw)
    return run_directed(device, hw, progs, broken, log, "gemm")


# --- CTRL SETTOK and SETPOS -----------------------------------------------------------------------------------

def tokpos_programs(image, hw: HardwareConfig):
    """(image, name, words, expected (ErrorCode, pc) or None, position, token) of directed programs that change
    TOKEN and POS between the instructions that read them (see ``tokpos``), and the image whose q_proj
    weights lie outside the DDR window (the ISS runs its programs to HALT). KVST and ATTN use a random INT8
    KV cache. Results leave through LOGITS and SCRATCH."""
    from firmware.compiler import SHAPE_FULL
    cfg = ModelConfig.from_hf(image.config)
    img = _random_kv(image, hw)
    by = img.matrices()
    q0, q1 = by["layers.0.self_attn.q_proj.weight"], by["layers.1.self_attn.q_proj.weight"]
    embed = img.descriptor("embed_tokens.weight", 0, cfg.vocab_size)
    full = img.kv_slots[next(i for i in cfg.kv_cache_layers if not cfg.is_sliding(i))]
    assert (q0.rows, q0.cols, q1.rows, embed.cols, img.descriptors[full].capacity) == (128, 64, 128, 64, 4), \
        "the fixture's tiny shapes changed"
    hd, group = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    halt, setvl = _ctrl(CtrlFunc.HALT), lambda n: _ctrl(CtrlFunc.SETVL, n)
    settok, setpos = lambda t: _ctrl(CtrlFunc.SETTOK, t), lambda p: _ctrl(CtrlFunc.SETPOS, p)
    dma = lambda d, region, l2, off: encode(Opcode.DMA, dir=d, region=region, l2=l2, offset=off, async_=0)
    gather = lambda dst, remap=0: encode(Opcode.GATHER, dst=dst, desc=embed.index, remap=remap, async_=0)
    cvo = lambda f, src, dst, n: encode(Opcode.CVO, func=f, src=src, dst=dst, length=n, sub_emax=0, recip_scale=0,
                                        accm=0, async_=0)
    ldpos = lambda d: encode(Opcode.SCALAR, func=ScalarFunc.LDPOS, d=d, a=0, b=0, imm=0)
    st_reg = lambda a, elem: encode(Opcode.SCALAR, func=ScalarFunc.ST, d=0, a=a, b=0, imm=elem)
    kvst = lambda k, v: encode(Opcode.KVST, k=k, v=v, slot=full, shape_ptr=0, async_=0)
    attn = lambda dst, q, kvh: encode(Opcode.ATTN, dst=dst, q=q, slot=full, kv_head=kvh, shape_ptr=SHAPE_FULL,
                                      async_=0)
    wgemv = lambda dst, d: encode(Opcode.WGEMV, dst=dst, src=0, desc=d.index, accm=0, findemax=0, sparse=0,
                                  reuse=0, mask=0, async_=1)
    wgemm = lambda dst, d, t: encode(Opcode.WGEMM, dst=dst, src=0, desc=d.index, tokens=t, accm=0, async_=1)
    rope = img.tensors["rope.full"]
    # L2 words: GATHER rows of 16 words at 0, 16, 32, 48
    gathers = [gather(0), settok(11), gather(16), settok(cfg.vocab_size - 1), gather(32),
               settok(0xFFFF_FFFF), gather(48, remap=1), setvl(256), dma(DmaDir.L2_TO_DDR, DdrRegion.LOGITS, 0, 0)]
    # the table of hd/2 frequencies at 64..67; cos/sin pairs of two words at 80, 84, 88; LDPOS's at 96 (elements)
    ropes = [setvl(rope.nbytes // 4), dma(DmaDir.DDR_TO_L2, DdrRegion.CONST, 64, rope.offset // 16)]
    for k, p in enumerate((None, 5, 0x1234_5678)):
        ropes += ([] if p is None else [setpos(p)]) + [
            cvo(CvoFunc.ROPE_COS, 64, 80 + 4 * k, hd // 2), cvo(CvoFunc.ROPE_SIN, 64, 82 + 4 * k, hd // 2),
            ldpos(k + 1), st_reg(k + 1, 96 * 4 + k)]
    ropes += [setvl(33 * 4), dma(DmaDir.L2_TO_DDR, DdrRegion.LOGITS, 64, 0)]
    # queries, K and V rows from CONST at 0..31; KVST at positions 1 (the host's) and 2, ATTN at 2, 3 and 1 into
    # 64, 80, 96
    kv_w = cfg.num_key_value_heads * hd // 4
    kv = [setvl(2 * group * hd), dma(DmaDir.DDR_TO_L2, DdrRegion.CONST, 0, 0),
          encode(Opcode.MEMSET, cache=ShapeCache.FMAP, slot=SHAPE_FULL, a=group, b=hd, c=0),
          kvst(0, kv_w), setpos(2), kvst(2 * kv_w, 3 * kv_w), attn(64, 0, 0), setpos(3), attn(80, 16, 1),
          setpos(1), attn(96, 0, 1), setvl(3 * group * hd), dma(DmaDir.L2_TO_DDR, DdrRegion.LOGITS, 64, 0)]
    # x (two tokens) at 0..31; the WGEMV's rows at 128..159, the WGEMM's at 192..255, the GATHER's at 256..271,
    # LDPOS's at 272
    behind = [setvl(2 * q0.cols), dma(DmaDir.DDR_TO_L2, DdrRegion.CONST, 0, 0), setvl(q0.cols),
              wgemv(128, q0), setpos(2), ldpos(1), st_reg(1, 272 * 4),
              wgemm(192, q1, 2), settok(9), gather(256),
              setvl(145 * 4), dma(DmaDir.L2_TO_DDR, DdrRegion.SCRATCH, 128, 0)]
    beyond = [gather(0), setvl(embed.cols), dma(DmaDir.L2_TO_DDR, DdrRegion.LOGITS, 0, 0), settok(cfg.vocab_size),
              gather(16), halt]
    # an async WGEMV whose weights meet bus errors, SETTOK or SETPOS right behind it
    at = img.ddr_offset(img.region("DESC")[0] + 32 * q0.index, 8)
    broken = dataclasses.replace(img, ddr=img.ddr.copy())
    broken.ddr[at:at + 8] = np.frombuffer((q0.weight_offset + BAD_WEIGHT_OFFSET).to_bytes(8, "little"), np.uint8)
    failing = behind[:4]
    progs = [
        (img, "GATHER of the host's token, then of three set by SETTOK", gathers + [halt], None, 0, 7),
        (img, "ROPE_COS/SIN and LDPOS at the host's position, then at two set by SETPOS", ropes + [halt], None, 3, 0),
        (img, "KVST at two positions, ATTN at three", kv + [halt], None, 1, 0),
        (img, "SETPOS and SETTOK right behind an async WGEMV and WGEMM", behind + [halt], None, 0, 2),
        (img, "a GATHER after SETTOK beyond its table", beyond, (ErrorCode.ADDRESS_RANGE, 4), 0, 5),
        (broken, "a bus error on an async WGEMV, SETPOS behind it", failing + [setpos(2), gather(256), halt],
         (ErrorCode.BUS_ERROR, 3), 0, 0),
        (broken, "a bus error on an async WGEMV, SETTOK behind it", failing + [settok(9), gather(256), halt],
         (ErrorCode.BUS_ERROR, 3), 0, 0),
    ]
    return progs, broken


def tokpos_host(device, case, hw, log) -> list[str]:
    """Blocking host code of `tokpos`; returns the failures (empty: pass)."""
    progs, broken = tokpos_programs(_bench_image(case, hw), hw)
    return run_directed(device, hw, progs, broken, log, "tokpos")


async def _directed(dut, host):
    """Run a directed-program host (`gemm_host`, `hazards_host`: each includes programs whose weights lie
    outside the DDR window) and check its failures and the bench's out-of-window accesses."""
    hw, seed, npz, _ = params()
    bench, device = await setup(dut, hw, seed)
    case = load_npz(npz)
    failures = await bridge(host)(device, case, hw, dut._log.info)
    hi = max(w.end for w in bench.windows)
    assert not failures, "\n".join(failures)
    if bench_env("NPU_PROGRAMS", ""):
        return                                  # some programs only: the bad descriptor's may not have run
    assert bench.faults and all(k == "read" and a >= hi for k, a, _ in bench.faults), \
        f"expected only the bad descriptor's weight reads outside the window: {bench.faults[:8]}"


@cocotb.test()
async def gemm(dut):
    await _directed(dut, gemm_host)


@cocotb.test()
async def tokpos(dut):
    await _directed(dut, tokpos_host)


@cocotb.test()
async def hazards(dut):
    await _directed(dut, hazards_host)


@cocotb.test()
async def attention(dut):
    hw, seed, npz, _ = params()
    bench, device = await setup(dut, hw, seed)
    failures = await bridge(attention_host)(device, load_npz(npz), hw, dut._log.info)
    assert not bench.faults, f"accesses outside the DDR window: {bench.faults[:8]}"
    assert not bench.unquiet, f"the NPU was not quiet at its interrupt: {bench.unquiet[:4]}"
    assert not failures, "\n".join(failures)


@cocotb.test()
async def bad_input(dut):
    hw, seed, npz, _ = params()
    bench, device = await setup(dut, hw, seed)
    case = load_npz(npz)
    with_dma = bench_env("NPU_BAD_DMA", "1") == "1"
    failures = await bridge(bad_input_host)(device, case, hw, dut._log.info, with_dma)
    assert not bench.faults, f"accesses outside the DDR window: {bench.faults[:8]}"
    assert not bench.unquiet, f"the NPU was not quiet at its interrupt: {bench.unquiet[:4]}"
    assert not failures, "\n".join(failures)
