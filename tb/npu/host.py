"""Host-side code of the full-chip bench: plain blocking Python, run in a `cocotb.task.bridge` thread.

`compare_tokens` runs an oracle-format case token by token through ``Runtime(backend="rtl")`` and
``Runtime(backend="iss", arithmetic="hardware")`` (the same host code path, `firmware.runtime`) and records,
per step, whether the logits are bit-identical, whether every byte of the NPU's DDR equals the ISS's view
of it (the KV cache, the logits, the scratch area and every byte the program must not touch), the largest
logit difference to the float64 golden model `sim.gemma3n.Model`, and the NPU's CSR counters.

`load_npz` reads the oracle format (``config_json``, ``w/<tensor>``, ``input_ids``; as
``tests/fixtures/hf_gemma3n_tiny.py`` writes it) directly with NumPy.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from firmware.pack import Image, pack
from firmware.runtime import CsrBackend, Placed, Runtime, program_image
from hdl.isa import DescKind
from sim.iss import ExecutionError, Machine

__all__ = ["Case", "load_npz", "iss_ddr", "compare_tokens", "board_tokens", "check_window", "GUARD"]

from .bench import GUARD
from .monitor import compare


@dataclass
class Case:
    name: str
    config: dict
    tensors: dict[str, np.ndarray]
    input_ids: np.ndarray


def load_npz(path: str | Path) -> Case:
    path = Path(path)
    with np.load(path) as d:
        missing = [k for k in ("config_json", "input_ids") if k not in d.files]
        if missing:
            raise ValueError(f"{path} is not an oracle-format npz: it has no {missing[0]!r} entry "
                             f"(expected config_json, input_ids and w/<tensor> entries)")
        return Case(path.stem, json.loads(str(d["config_json"])),
                    {k[2:]: d[k] for k in d.files if k.startswith("w/")},
                    d["input_ids"].astype(np.int64).reshape(-1))


def iss_kv_region(machine: Machine, image: Image) -> np.ndarray:
    """The KV region as the NPU holds it (firmware.pack layout, either ``kv_format``), built from the ISS's KV
    cache (sim.iss keeps the cache outside its DDR image)."""
    base, size = image.region("KV")
    kv = np.zeros(size, np.uint8)
    for d in image.descriptors:
        if d.kind != DescKind.KV:
            continue
        raw = machine.kv_bytes(d.index)
        kv[d.weight_offset:d.weight_offset + raw.size] = raw
    return kv


def iss_ddr(machine: Machine, image: Image, program, program_writes=()) -> np.ndarray:
    """Every byte of the image as the ISS leaves it (`Image.ddr`, window by window): the packed image with the
    program (and the prefill programs the host wrote behind it: `CsrBackend.program_writes`), the LOGITS and
    SCRATCH regions and staged rows the ISS wrote, and its KV cache in the KV region."""
    ddr = program_image(image, program)
    base = image.region("PROGRAM")[0]
    for at, code in program_writes:
        off = image.ddr_offset(base + at, code.size)
        ddr[off:off + code.size] = code
    base, size = image.region("KV")
    off = image.ddr_offset(base, size)
    ddr[off:off + size] = iss_kv_region(machine, image)
    return ddr


def check_window(device, expected: np.ndarray, image: Image) -> list[str]:
    """Compare every DDR window of the device with `expected` (an `Image.ddr`-shaped array for `image`) placed
    where the host placed the image (`firmware.runtime.Placed`; with the re-based descriptor table when the
    windows moved), and the guard byte elsewhere; return a
    description of the first differing ranges, named by the image's regions (empty: identical)."""
    placed = Placed(image, device.windows)
    if placed.relocated:            # the host wrote the re-based descriptor table
        expected = expected.copy()
        off = image.ddr_offset(image.region("DESC")[0], placed.descriptor_table.size)
        expected[off:off + placed.descriptor_table.size] = placed.descriptor_table
    problems = []
    for w in device.windows:
        window = np.frombuffer(device.bench.window(w.name), np.uint8)
        want = np.full(window.size, GUARD, np.uint8)
        for p in image.windows:
            if placed.target[p.window] is w:
                at = p.base + placed.delta[p.window] - w.base
                want[at:at + p.size] = expected[p.ddr_offset:p.ddr_offset + p.size]
        diff = np.nonzero(window != want)[0]
        if diff.size:
            for lo, hi in _runs(diff):
                problems.append(f"[{w.base + lo:#x}, {w.base + hi:#x}) ({hi - lo} bytes, "
                                f"{_where(image, placed, w.base + lo)})")
    return problems


def _where(image: Image, placed: Placed, addr: int) -> str:
    """The region (and offset) of device address `addr`, or "outside the image"."""
    for name in image.regions:
        for a, n in image.pieces[name]:
            lo = placed.address(name, a - image.region(name)[0])
            if lo <= addr < lo + n:
                return f"{name}+{addr - placed.base(name):#x}"
    return "outside the image"


def describe_faults(device, image: Image) -> str:
    """The bench's accesses outside the DDR windows, with the image region nearest each."""
    faults = getattr(getattr(device, "bench", None), "faults", [])
    if not faults:
        return "no access outside the DDR windows"
    placed = Placed(image, device.windows)
    out = []
    for kind, addr, n in faults[:8]:
        near = min(image.regions, key=lambda r: abs(addr - placed.base(r)))
        out.append(f"{kind} of {n} bytes at {addr:#x} (near {near} at {placed.base(near):#x}, "
                   f"{addr - placed.base(near):+#x})")
    return f"{len(faults)} accesses outside the DDR windows: " + "; ".join(out)


def _runs(idx: np.ndarray, limit: int = 8):
    out = []
    start = prev = int(idx[0])
    for i in idx[1:]:
        i = int(i)
        if i != prev + 1:
            out.append((start, prev + 1))
            start = i
        prev = i
    out.append((start, prev + 1))
    return out[:limit]


def compare_tokens(device, case: Case, hw, tokens: int, *, golden: bool = True, memory_map="flat",
                   log=print, prefill: int = 0) -> list[dict]:
    """Run the first `tokens` ids of `case` through the RTL and the ISS; one record per step (see module
    docstring), the first `prefill` ids as one `Runtime.prefill` (its prefill programs) recorded as one step.
    Never raises on a mismatch: the caller decides."""
    ids = case.input_ids[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"{case.name} has {len(case.input_ids)} input ids, fewer than the {tokens} asked for")
    if not 0 <= prefill <= tokens:
        raise ValueError(f"prefill must be from 0 to the {tokens} tokens run, not {prefill}")
    t0 = time.perf_counter()
    rtl = Runtime.from_hf(case.config, case.tensors, backend="rtl", hw=hw, device=device, memory_map=memory_map)
    iss = Runtime.from_hf(case.config, case.tensors, backend="iss", arithmetic="hardware", hw=hw,
                          memory_map=memory_map)
    model = None
    if golden:
        from sim.gemma3n import Model
        model = Model.from_hf(case.config, case.tensors, dtype=np.float64)
    # the prefill programs' projections as WGEMMs (the path a tile that pays for the array takes), on both
    rtl.prefill_gemm = iss.prefill_gemm = True
    placed = rtl.backend.placed
    where = ", ".join(f"{p.window} {p.size} bytes at {p.base + placed.delta[p.window]:#x}" for p in rtl.image.windows)
    log(f"{case.name}: image ({rtl.image.memory_map} map) {where}, program "
        f"{len(rtl.program.words)} words ({time.perf_counter() - t0:.1f} s to pack and compile twice)")
    records = []
    assert isinstance(rtl.backend, CsrBackend)
    monitor = getattr(getattr(device, "bench", None), "monitor", None)
    plans = []
    iss.backend.trace = lambda pc, insn, machine: plans.append((pc, insn, list(machine.steps)))
    listing = rtl.program.listing().splitlines()
    runs = [(0, ids[:prefill])] if prefill else []
    runs += [(step, ids[step:step + 1]) for step in range(prefill, tokens)]
    for step, run in runs:
        t0 = time.perf_counter()
        if monitor is not None:
            monitor.take()
        token = int(run[-1])
        what = f"prefill of positions {step}..{step + len(run) - 1}" if len(run) > 1 else f"position {step}"
        try:
            a = rtl.prefill([int(t) for t in run]) if len(run) > 1 else rtl.step(token)
        except ExecutionError as e:
            raise AssertionError(f"{case.name} step {step} (token {token}, {what}): {e}; instruction {e.pc}; "
                                 f"{describe_faults(device, rtl.image)}") from None
        wall = time.perf_counter() - t0
        plans.clear()
        b = iss.prefill([int(t) for t in run]) if len(run) > 1 else iss.step(token)
        expected = iss_ddr(iss.machine, iss.image, iss.program, rtl.backend.program_writes)
        rec = {"step": step if len(run) == 1 else f"{step}-{step + len(run) - 1}", "token": token,
               "position": step + len(run) - 1,
               "identical": bool(np.array_equal(a.view(np.uint32), b.view(np.uint32))),
               "mismatches": int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32))),
               "ddr_problems": check_window(device, expected, rtl.image),
               "counters": rtl.counters, "wall_s": round(wall, 2)}
        rec["ddr_identical"] = not rec["ddr_problems"]
        if monitor is not None:        # the steps the RTL controller started, against the ISS's plans
            rec["plan_problems"] = compare(*monitor.take(), plans, listing if len(run) == 1 else None)
        if model is not None:
            for t in run:
                g = model.step(int(t))
            rec["max_abs_diff_golden"] = float(np.max(np.abs(a.astype(np.float64) - g)))
        rec["logits_rtl"] = a
        rec["logits_iss"] = b
        records.append(rec)
        log(f"step {rec['step']} token {token}: logits {'bit-identical' if rec['identical'] else 'DIFFER'}"
            f", steps {'as planned' if not rec.get('plan_problems') else 'DIFFER'}"
            f", DDR {'identical' if rec['ddr_identical'] else 'DIFFERS'}, {rec['counters'].get('CYCLES')} cycles"
            f" ({wall:.1f} s)")
    return records


def compare_modes(device, case: Case, hw, steps: int, *, streams: int = 1, speculate: int = 0,
                  memory_map="flat", log=print) -> list[dict]:
    """Batched steps (``streams`` > 1: `Runtime.step_many`, stream s fed id ``(step + 3 s) mod n`` of `case`)
    or speculative verify passes (``speculate`` drafts: `Runtime.verify` of the next ``speculate + 1`` ids, as
    many as a pass may run there, then `Runtime.rollback` keeping ``1 + step mod n`` of them) on the RTL and
    the ISS, `steps` times, the programs' projections as `gemm_pays` chooses (WGEMVs per token on tiny); one
    record per
    step: every logits row of both, and every DDR byte after the step (after the rollback: the restored KV
    rows). Never raises on a mismatch."""
    ids = [int(t) for t in case.input_ids]
    kw = dict(hw=hw, memory_map=memory_map, streams=streams, logit_rows=max(streams, speculate + 1))
    rtl = Runtime.from_hf(case.config, case.tensors, backend="rtl", device=device, **kw)
    iss = Runtime.from_hf(case.config, case.tensors, backend="iss", arithmetic="hardware", **kw)
    records = []
    for step in range(steps):
        t0 = time.perf_counter()
        if streams > 1:
            run = [ids[(step + 3 * s) % len(ids)] for s in range(streams)]
            what = f"batched step {step} (ids {run})"
            a, b = rtl.step_many(run), iss.step_many(run)
        else:
            pos = rtl.position
            n = min(speculate + 1, rtl.verify_tokens(), len(ids) - pos)
            run, keep = ids[pos:pos + n], 1 + step % n
            what = f"verify of positions {pos}..{pos + n - 1}, {keep} kept"
            a, b = rtl.verify(run), iss.verify(run)
            rtl.rollback(keep)
            iss.rollback(keep)
        wall = time.perf_counter() - t0
        expected = iss_ddr(iss.machine, iss.image, iss.program, rtl.backend.program_writes)
        rec = {"step": step, "what": what, "rows": int(a.shape[0]),
               "identical": bool(np.array_equal(a.view(np.uint32), b.view(np.uint32))),
               "mismatches": int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32))),
               "ddr_problems": check_window(device, expected, rtl.image), "counters": rtl.counters,
               "positions": list(rtl.positions), "wall_s": round(wall, 2), "logits_rtl": a, "logits_iss": b}
        records.append(rec)
        log(f"{what}: {rec['rows']} logits rows {'bit-identical' if rec['identical'] else 'DIFFER'}, DDR "
            f"{'identical' if not rec['ddr_problems'] else 'DIFFERS'}, {rec['counters'].get('CYCLES')} cycles "
            f"({wall:.1f} s)")
    return records


def board_tokens(board, memory_map, case: Case, hw, tokens: int, bench, results: dict) -> None:
    """The on-board runtime on the simulated NPU: `firmware.board.Kv260Device` over the stand-in board `board`
    (`tb.board`: sysfs, the DDR files the bench's memory maps, the pty interrupt, the CSR link), with
    `Runtime.on_device` running the first `tokens` ids of `case` packed for `memory_map`, beside the ISS.
    Plain blocking code for a plain thread (the device blocks in ``read()`` on the interrupt). Fills `results`:
    ``records`` (per step: logits of both, the DDR comparison), ``relocated``, ``hw``; or ``error``."""
    from firmware.board import Kv260Device
    try:
        with Kv260Device(memory_map, root=board.root, csr=board.csr) as dev:
            results["hw"] = dev.hw.name
            image = pack(case.config, case.tensors, hw, memory_map=memory_map)
            rtl = Runtime.on_device(image, dev)
            iss = Runtime.from_hf(case.config, case.tensors, backend="iss", arithmetic="hardware", hw=hw,
                                  memory_map=memory_map)
            results["relocated"] = rtl.backend.placed.relocated
            view = _BenchView(bench)
            records = []
            for step, token in enumerate(case.input_ids[:tokens]):
                a, b = rtl.step(int(token)), iss.step(int(token))
                records.append({"step": step, "token": int(token), "logits_rtl": a, "logits_iss": b,
                                "ddr_problems": check_window(view, iss_ddr(iss.machine, iss.image, iss.program),
                                                             rtl.image)})
            results["records"] = records
    except BaseException as e:       # reported by the bench
        results["error"] = e


class _BenchView:
    """What `check_window` reads of a device: the bench's windows and their contents."""

    def __init__(self, bench):
        self.bench, self.windows = bench, bench.windows
