"""The host runtime: one interface for every backend that runs the NPU's token program.

>>> rt = Runtime.from_hf(config, tensors, backend="iss", arithmetic="reference")
>>> rt.reset(); logits = rt.step(2)

`from_hf` packs the weights into a DDR image (`firmware.pack`), compiles the token program
(`firmware.compiler`) and loads both into the backend; `step` writes the token id and the position,
runs the program and returns the soft-capped logits, exactly like `sim.gemma3n.Model.step`. Sampling and
generation (`firmware.generate`) sit on top of it.

Backends (`Backend`: ``load``, ``reset_kv``, ``run``, ``counters``):

- ``"iss"``: `IssBackend`, the instruction-set simulator (`sim.iss.Machine`) in reference or hardware
  arithmetic.
- ``"rtl"``: `CsrBackend` over the simulated NPU of the full-chip bench (``python -m tb.npu``), which
  attaches its device with `attach_rtl_device`. `CsrBackend` is the host protocol of
  docs/architecture.md (CSR map `hdl.csr_map`): it puts the image and the program in DDR, writes every
  region base, the program base and length, the descriptor count, TOKEN_ID and POSITION, starts, waits for DONE or ERROR and
  reads the logits from the LOGITS region. The board backend is the same class over a device that maps the
  KV260's CSR window and DDR.

A device (`NpuDevice`) is four blocking calls: ``csr_read``, ``csr_write``, ``mem_read``, ``mem_write``
(physical DDR byte addresses), plus ``wait_interrupt`` (block until the NPU's interrupt line is high) and the
attributes ``hw`` (its `HardwareConfig`) and ``windows`` (the DDR windows reserved for it,
`hdl.memory_map.Window`s: the bench's memory model, or the u-dma-buf buffers on the board,
`firmware.board`). The image goes to the windows its memory map names (`Placed`).

Host tables (PLE staging, `firmware.pack`): before every run, `Runtime.step` writes the token's row of each
host table into the image's staging place, on every backend, so the ISS and the NPU read the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from hdl import csr_map
from hdl.config import HardwareConfig
from hdl.isa import DESC_BYTES, DdrRegion, DescKind, ErrorCode
from hdl.memory_map import Window
from sim.config import ModelConfig, check_index, check_positive_int
from sim.gemma3n import resolve_tensor_names
from sim.iss import HARDWARE, REFERENCE, ExecutionError, Machine
from sim.numerics import WEIGHT_METHODS

from .compiler import (Program, compile_token, compile_tokens, multi_token_limit, prefill_runs, program_tokens,
                       sliding_ring)
from .pack import Image, kv_row_ranges, kv_slot_bytes, logit_stride, pack

__all__ = ["Runtime", "Backend", "IssBackend", "CsrBackend", "NpuDevice", "Placed", "hardware_of", "attach_rtl_device",
           "detach_rtl_device", "program_image", "BackendUnavailable"]

BACKENDS = ("iss", "rtl")


class BackendUnavailable(ValueError):
    """The backend asked for cannot run in this process (the RTL backend outside its bench)."""


class Backend(Protocol):
    """What `Runtime` needs from a machine that runs token programs."""

    def load(self, image: Image, program: Program) -> None:
        """Take the DDR image and the token program (once, before any `run`)."""

    def reset_kv(self) -> None:
        """Clear the KV cache (a new sequence)."""

    def write(self, region: str, offset: int, data: np.ndarray) -> None:
        """Write bytes into a region of the NPU's DDR between runs (the host's staged rows)."""

    def run(self, token: int, pos: int) -> np.ndarray:
        """Run the program for `token` at position `pos` until HALT; return a copy of the logits. Raises
        `sim.iss.ExecutionError` (with the `ErrorCode` and the instruction index) if the program stops on an
        error."""

    def run_words(self, words: list[int], token: int, pos: int) -> np.ndarray:
        """Run another program (a bound prefill program, `firmware.compiler.Program.bind`) once, as `run`
        runs the loaded one; the loaded program stays the one `run` runs."""

    def logit_rows(self, n: int) -> np.ndarray:
        """The first `n` logits rows of the last run (``[n, vocab]``, float32 or the ISS's float64): a program
        that leaves every token's logits (`firmware.compiler.compile_tokens`' ``logits="all"``)."""

    def kv_save(self, rows: list[tuple[int, int]]):
        """The KV cache's contents at ring rows ``(slot, row)`` (an opaque copy for `kv_restore`)."""

    def kv_restore(self, saved) -> None:
        """Put back what `kv_save` copied."""

    def kv_copy(self, src: int, dst: int) -> None:
        """Make KV slot `dst` (descriptor index) hold what slot `src` holds (the same shape)."""

    @property
    def counters(self):
        """Performance counters: `sim.iss.Counters` (cumulative) for the ISS, the CSR counters of the last
        run (``{"CYCLES": ..., ...}``) for the NPU."""


class NpuDevice(Protocol):
    """The NPU as the host sees it: its CSR window and the DDR windows reserved for it."""

    hw: HardwareConfig
    windows: tuple[Window, ...]      # physical DDR windows the host may use (`hdl.memory_map.Window`)

    def csr_read(self, offset: int) -> int: ...

    def csr_write(self, offset: int, value: int) -> None: ...

    def mem_read(self, addr: int, nbytes: int) -> bytes: ...

    def mem_write(self, addr: int, data) -> None: ...

    def wait_interrupt(self) -> None: ...


class IssBackend:
    """The instruction-set simulator as a backend."""

    def __init__(self, hw: HardwareConfig, arithmetic: str = HARDWARE, source: Mapping | None = None):
        self.hw, self.arithmetic, self.source = hw, arithmetic, source
        self.machine: Machine | None = None
        self.program: Program | None = None
        self.trace = None             # if set: `Machine.run`'s trace(pc, insn, machine) after every instruction

    def load(self, image: Image, program: Program) -> None:
        self.machine = Machine(image, self.hw, self.arithmetic, source=self.source)
        self.program = program

    def reset_kv(self) -> None:
        self.machine.reset_kv()

    def write(self, region: str, offset: int, data: np.ndarray) -> None:
        self.machine.image.view(region, offset, len(data))[:] = np.frombuffer(bytes(data), np.uint8)

    def run(self, token: int, pos: int) -> np.ndarray:
        return self.run_words(self.program.words, token, pos)

    def run_words(self, words: list[int], token: int, pos: int) -> np.ndarray:
        self.machine.run(words, token=token, pos=pos, trace=self.trace)
        return self.machine.logits.copy()

    def logit_rows(self, n: int) -> np.ndarray:
        return self.machine.logit_rows(n).copy()

    def kv_save(self, rows: list[tuple[int, int]]):
        return self.machine.kv_save(rows)

    def kv_restore(self, saved) -> None:
        self.machine.kv_restore(saved)

    def kv_copy(self, src: int, dst: int) -> None:
        self.machine.kv_copy(src, dst)

    @property
    def counters(self):
        return self.machine.counters


def program_image(image: Image, program: Program) -> np.ndarray:
    """The bytes the NPU's DDR holds (`Image.ddr`, every window's used part): the packed image with the program's
    words (little-endian u64) at the start of the PROGRAM region."""
    words = program_bytes(image, program)
    ddr = image.ddr.copy()
    off = image.ddr_offset(image.region("PROGRAM")[0], words.size)
    ddr[off:off + words.size] = words
    return ddr


def program_bytes(image: Image, program: Program) -> np.ndarray:
    """The program's words as the bytes of the PROGRAM region (ValueError if they do not fit it)."""
    size = image.region("PROGRAM")[1]
    words = np.asarray(program.words, dtype="<u8")
    if words.nbytes > size:
        raise ValueError(f"the program ({len(words)} words, {words.nbytes} bytes) does not fit the PROGRAM "
                         f"region ({size} bytes)")
    return words.view(np.uint8)


def hardware_of(image: Image) -> HardwareConfig:
    """The hardware preset `image` was packed for (its manifest's ``hardware``)."""
    from hdl.config import PRESETS
    for hw in PRESETS.values():
        if hw.to_dict() == image.hardware:
            return hw
    raise ValueError(f"the image was packed for hardware {image.hardware.get('name', '?')!r} with parameters that "
                     f"match no preset of this firmware ({', '.join(PRESETS)}); pack it again")


class Placed:
    """An image placed in a device's windows: each image window goes to the device window of the same name (a
    one-window ``flat`` image to the first device window that holds it), at that window's base. Region bases
    and WEIGHTS offsets follow (relocation): `base(region)`, `address(region, offset)`, and `descriptor_table`,
    the DESC region's bytes with every WEIGHTS offset re-based (identical to the image's when the windows lie
    where the memory map put them). ValueError, before anything is written, if a window is missing or too
    small."""

    def __init__(self, image: Image, windows: tuple[Window, ...]):
        self.image = image
        self.target: dict[str, Window] = {}
        self.delta: dict[str, int] = {}
        by_name = {w.name: w for w in windows}
        have = ", ".join(f"{w.name} ({w.size:,} bytes at {w.base:#x})" for w in windows) or "none"
        for p in image.windows:
            if p.window in by_name:
                w = by_name[p.window]
            elif len(image.windows) == 1 and image.memory_map == "flat":
                w = next((w for w in windows if w.size >= p.size), None)
                if w is None:
                    raise ValueError(f"the DDR image ({p.size:,} bytes) fits none of the device's windows: {have}")
            else:
                raise ValueError(f"the image was packed for memory map {image.memory_map!r}, whose window "
                                 f"{p.window!r} the device does not have (it has: {have})")
            if p.size > w.size:
                raise ValueError(f"the image needs {p.size:,} bytes in window {p.window!r}; the device's "
                                 f"{w.name!r} has {w.size:,} (reserve more memory: docs/kv260.md)")
            self.target[p.window] = w
            self.delta[p.window] = w.base - p.base
        self.bases = {r: self._moved(b) for r, (b, _) in image.regions.items()}
        wlo = min(self._moved(a) for a, _ in image.pieces["WEIGHTS"])
        self.bases["WEIGHTS"] = wlo
        self.relocated = any(v != 0 for v in self.delta.values())
        self.descriptor_table = image.view("DESC", 0, len(image.descriptors) * DESC_BYTES).copy()
        if self.relocated:
            w0 = image.region("WEIGHTS")[0]
            table = []
            for d in image.descriptors:
                d = dataclasses.replace(d, scale_offset=self._moved(w0 + d.scale_offset) - wlo)
                if d.kind == DescKind.INT4:
                    d.weight_offset = self._moved(w0 + d.weight_offset) - wlo
                table.append(np.frombuffer(d.to_bytes(), np.uint8))
            self.descriptor_table = np.concatenate(table) if table else self.descriptor_table

    def _moved(self, addr: int) -> int:
        for p in self.image.windows:
            if p.base <= addr < p.end:
                return addr + self.delta[p.window]
        raise ValueError(f"address {addr:#x} lies in no window of the image")

    def base(self, region: str) -> int:
        return self.bases[region]

    def address(self, region: str, offset: int) -> int:
        """The device address of byte `offset` of `region` (WEIGHTS: through the window that holds it)."""
        if region == "WEIGHTS":
            return self._moved(self.image.region("WEIGHTS")[0] + offset)
        return self.bases[region] + offset

    def chunks(self, chunk: int = 64 << 20):
        """``(device address, bytes)`` of the whole image in pieces of at most `chunk` bytes (views of `ddr`)."""
        for p in self.image.windows:
            w = self.target[p.window]
            for k in range(0, p.size, chunk):
                n = min(chunk, p.size - k)
                yield w.base + k, self.image.ddr[p.ddr_offset + k:p.ddr_offset + k + n]


class CsrBackend:
    """The NPU behind its CSRs and DDR (`NpuDevice`): the host protocol of docs/architecture.md.

    `load` checks the NPU's ID and VERSION against the image before it writes anything, places the image in
    the device's windows (`Placed`), writes it (with `progress(done, total)` calls), the program and the
    descriptor table, then every region base CSR, the program base and length and the descriptor count.
    """

    def __init__(self, device: NpuDevice, progress=None):
        self.device = device
        self.progress = progress
        self.image: Image | None = None
        self.program: Program | None = None
        self.placed: Placed | None = None
        self._counters: dict[str, int] = {}
        self.program_writes: list[tuple[int, np.ndarray]] = []    # (offset in PROGRAM, bytes) of `run_words`

    # --- CSRs by name ------------------------------------------------------------------------------------

    def csr_read(self, name: str) -> int:
        return self.device.csr_read(csr_map.by_name(name).offset)

    def csr_write(self, name: str, value: int) -> None:
        self.device.csr_write(csr_map.by_name(name).offset, value & 0xFFFF_FFFF)

    def csr_write64(self, name: str, value: int) -> None:
        self.csr_write(f"{name}_LO", value)
        self.csr_write(f"{name}_HI", value >> 32)

    def csr_read64(self, name: str) -> int:
        return self.csr_read(f"{name}_LO") | self.csr_read(f"{name}_HI") << 32

    # --- Backend -----------------------------------------------------------------------------------------

    def check(self, image: Image) -> None:
        """The NPU answers with its ID and was built for the hardware the image was packed for (VERSION)."""
        dev = self.device
        ident = dev.csr_read(csr_map.by_name("ID").offset)
        if ident != csr_map.NPU_ID:
            raise RuntimeError(f"no NPU answers: ID reads {ident:#010x}, expected {csr_map.NPU_ID:#010x}")
        version, want = dev.csr_read(csr_map.by_name("VERSION").offset), csr_map.version_word(image.hardware)
        if version & 0xFF != want & 0xFF:
            raise RuntimeError(f"the NPU implements ISA version {version & 0xFF}; this firmware needs "
                               f"{want & 0xFF}")
        if version != want:
            raise RuntimeError(f"the NPU was built for other hardware parameters (VERSION {version:#010x}) than "
                               f"the image was packed for ({image.hardware.get('name', '?')!r}: {want:#010x})")

    def load(self, image: Image, program: Program) -> None:
        self.check(image)
        placed = Placed(image, tuple(self.device.windows))
        code = program_bytes(image, program)
        total, done = image.ddr.size, 0
        for addr, chunk in placed.chunks():
            self.device.mem_write(addr, chunk)
            done += chunk.size
            if self.progress is not None:
                self.progress(done, total)
        self.device.mem_write(placed.base("PROGRAM"), code)
        if placed.relocated:
            self.device.mem_write(placed.base("DESC"), placed.descriptor_table)
        for region in DdrRegion:
            self.csr_write64(f"{region.name}_BASE", placed.base(region.name))
        self.csr_write64("PROGRAM_BASE", placed.base("PROGRAM"))
        self.csr_write("PROGRAM_LEN", len(program.words))
        self.csr_write("DESC_COUNT", len(image.descriptors))
        self.image, self.program, self.placed = image, program, placed

    def reset_kv(self) -> None:
        size = self.image.region("KV")[1]
        base = self.placed.base("KV")
        for k in range(0, size, 64 << 20):
            self.device.mem_write(base + k, bytes(min(64 << 20, size - k)))

    def write(self, region: str, offset: int, data: np.ndarray) -> None:
        self.device.mem_write(self.placed.address(region, offset), data)

    def start(self, token: int, pos: int) -> None:
        """Write TOKEN_ID and POSITION and start the program (does not wait)."""
        self.csr_write("TOKEN_ID", token)
        self.csr_write("POSITION", pos)
        self.csr_write("CTRL", csr_map.CTRL_START)

    def wait(self) -> int:
        """Wait until the program stops; return STATUS and acknowledge it. Raises `ExecutionError` on ERROR."""
        status = self.csr_read("STATUS")
        while not status & (csr_map.STATUS_DONE | csr_map.STATUS_ERROR):
            self.device.wait_interrupt()
            status = self.csr_read("STATUS")
        self._counters = {name: self.csr_read64(name) for name in csr_map.COUNTER_NAMES}
        if status & csr_map.STATUS_ERROR:
            code, pc = self.csr_read("ERROR_CODE"), self.csr_read("ERROR_PC")
            self.csr_write("CTRL", csr_map.CTRL_IRQ_ACK)
            try:
                code = ErrorCode(code)
            except ValueError:
                raise RuntimeError(f"the NPU stopped with an undefined ERROR_CODE {code} at instruction {pc}") \
                    from None
            raise ExecutionError(code, pc, f"the NPU stopped with {code.name} (STATUS {status:#x})")
        self.csr_write("CTRL", csr_map.CTRL_IRQ_ACK)
        return status

    def run(self, token: int, pos: int) -> np.ndarray:
        self.start(token, pos)
        self.wait()
        return self.logits()

    def run_words(self, words: list[int], token: int, pos: int) -> np.ndarray:
        """The words go into the PROGRAM region behind the loaded program (PROGRAM_BASE and PROGRAM_LEN point
        at them for this run, then back at the loaded program)."""
        code = np.asarray(words, dtype="<u8").view(np.uint8)
        at = -(-len(self.program.words) * 8 // 64) * 64
        if at + code.size > self.image.region("PROGRAM")[1]:
            raise ValueError(f"a program of {len(words)} words does not fit the PROGRAM region behind the loaded "
                             f"one ({self.image.region('PROGRAM')[1]} bytes); pack with a larger program_bytes")
        base = self.placed.base("PROGRAM")
        self.device.mem_write(base + at, code)
        self.program_writes.append((at, code))
        self.csr_write64("PROGRAM_BASE", base + at)
        self.csr_write("PROGRAM_LEN", len(words))
        try:
            return self.run(token, pos)
        finally:
            self.csr_write64("PROGRAM_BASE", base)
            self.csr_write("PROGRAM_LEN", len(self.program.words))

    def logits(self) -> np.ndarray:
        return self.logit_rows(1)[0]

    def logit_rows(self, n: int) -> np.ndarray:
        cfg = ModelConfig.from_hf(self.image.config)
        stride = logit_stride(cfg)
        raw = self.device.mem_read(self.placed.base("LOGITS"), 4 * stride * n)
        return np.frombuffer(raw, dtype="<f4").reshape(n, stride)[:, :cfg.vocab_size].astype(np.float32)

    def kv_save(self, rows: list[tuple[int, int]]):
        ranges = [r for slot, row in rows for r in kv_row_ranges(self.image, slot, row)]
        return [(off, self.device.mem_read(self.placed.address("KV", off), n)) for off, n in ranges]

    def kv_restore(self, saved) -> None:
        for off, raw in saved:
            self.device.mem_write(self.placed.address("KV", off), raw)

    def kv_copy(self, src: int, dst: int) -> None:
        a, b = self.image.descriptors[src], self.image.descriptors[dst]
        n = kv_slot_bytes(self.image, src)
        for k in range(0, n, 64 << 20):
            raw = self.device.mem_read(self.placed.address("KV", a.weight_offset + k), min(64 << 20, n - k))
            self.device.mem_write(self.placed.address("KV", b.weight_offset + k), raw)

    def ddr(self, region: str) -> np.ndarray:
        """A copy of one DDR region as the NPU left it (uint8; not WEIGHTS, which may span windows)."""
        return np.frombuffer(self.device.mem_read(self.placed.base(region), self.image.region(region)[1]),
                             dtype=np.uint8).copy()

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)


# The simulated NPU of the full-chip bench (tb/npu), attached while a cocotb test runs the host code.
_rtl_device: NpuDevice | None = None


def attach_rtl_device(device: NpuDevice | None) -> None:
    """Make `device` the NPU that ``backend="rtl"`` drives (the full-chip bench calls this)."""
    global _rtl_device
    _rtl_device = device


def detach_rtl_device() -> None:
    attach_rtl_device(None)


class Runtime:
    """Drives one backend through token programs; see the module docstring."""

    def __init__(self, config: ModelConfig, image: Image, program: Program, backend: Backend):
        self.config = config
        self.image = image
        self.program = program
        self.backend = backend
        self.positions = [0] * image.streams       # each stream's next position
        self.stream = 0                             # the stream `step`, `prefill` and `verify` advance
        self._verified = None                       # the last `verify`: (stream, first position, n, saved rows)
        # prefill programs: WGEMMs for the projections (True), WGEMVs (False), or `gemm_pays`'s choice (None)
        self.prefill_gemm: bool | None = None
        self._prefill_tokens: int | None = None
        self._programs: dict[tuple, Program] = {}
        backend.load(image, program)

    @property
    def position(self) -> int:
        """The next position of the current `stream`."""
        return self.positions[self.stream]

    @position.setter
    def position(self, value: int) -> None:
        self.positions[self.stream] = value

    @property
    def streams(self) -> int:
        """The independent sequences the image holds KV caches for (`firmware.pack.pack`'s streams)."""
        return self.image.streams

    @property
    def machine(self) -> Machine:
        """The ISS machine (``backend="iss"`` only)."""
        if not isinstance(self.backend, IssBackend):
            raise AttributeError(f"{type(self.backend).__name__} has no ISS machine")
        return self.backend.machine

    @property
    def counters(self):
        return self.backend.counters

    @property
    def max_positions(self) -> int:
        """Positions the KV cache holds: the capacity of the full-attention layers' slots (sliding layers keep
        a ring of their window)."""
        full = [d.capacity for layer, i in self.image.kv_slots.items() if not self.config.is_sliding(layer)
                for d in (self.image.descriptors[i],)]
        return min(full) if full else self.config.max_position_embeddings

    @classmethod
    def from_hf(cls, config: Mapping | ModelConfig, tensors: Mapping[str, np.ndarray], backend: str = "iss",
                arithmetic: str | None = None, hw: HardwareConfig | str = "kv260",
                max_positions: int | None = None, device: NpuDevice | None = None,
                memory_map: str = "flat", progress=None, quantizer: str = "search", streams: int = 1,
                logit_rows: int | None = None) -> "Runtime":
        """Pack, compile and load. `arithmetic` (ISS only): ``"reference"`` (default) or ``"hardware"``; the
        RTL always computes hardware arithmetic. `device` (RTL only): the NPU to drive (default: the one the
        full-chip bench attached). `memory_map` (`hdl.memory_map`): where the image goes. `max_positions`: None
        or a positive integer. `quantizer`: the packer's INT4 quantiser (`firmware.pack.pack`). `streams`: the
        independent sequences served (`step_many`), each with a KV cache of its own; `logit_rows`: the tokens'
        logits a program may leave at once (`step_many`, `verify`; default `streams`). Bad arguments raise
        TypeError or ValueError here, before anything is packed."""
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
        if not isinstance(tensors, Mapping):
            raise TypeError(f"tensors must be a mapping of tensor names to arrays, not {type(tensors).__name__}")
        hw = HardwareConfig.preset(hw) if isinstance(hw, str) else hw
        if not isinstance(hw, HardwareConfig):
            raise TypeError(f"hw must be a hardware preset name or a HardwareConfig, not {hw!r}")
        if max_positions is not None:
            max_positions = check_positive_int("max_positions", max_positions)
        streams = check_positive_int("streams", streams)
        if logit_rows is not None:
            logit_rows = check_positive_int("logit_rows", logit_rows)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}")
        if quantizer not in WEIGHT_METHODS:
            raise ValueError(f"quantizer must be one of {', '.join(map(repr, WEIGHT_METHODS))}, not {quantizer!r}")
        if backend == "iss":
            arithmetic = REFERENCE if arithmetic is None else arithmetic
            if arithmetic not in (REFERENCE, HARDWARE):
                raise ValueError(f"arithmetic must be {REFERENCE!r} or {HARDWARE!r}, not {arithmetic!r}")
        else:
            if arithmetic not in (None, HARDWARE):
                raise ValueError(f"the RTL computes {HARDWARE!r} arithmetic, not {arithmetic!r}")
            device = _rtl_device if device is None else device
            if device is None:
                raise BackendUnavailable(
                    "backend 'rtl' is not available yet in this process: it drives the simulated NPU and runs "
                    "inside the full-chip bench (python -m tb.npu --hf-npz FILE, or tests/test_npu.py), which "
                    "attaches the NPU with firmware.runtime.attach_rtl_device")
            if device.hw != hw:
                raise ValueError(f"the simulated NPU is built for hardware preset {device.hw.name!r}, "
                                 f"not {hw.name!r}")
        image = pack(cfg, tensors, hw, max_positions=max_positions, memory_map=memory_map, quantizer=quantizer,
                     streams=streams, logit_rows=logit_rows)
        program = compile_token(cfg, image, hw)
        if backend == "iss":
            source = None
            if arithmetic == REFERENCE:
                source = {name: tensors[full] for name, full in resolve_tensor_names(cfg, tensors).items()}
            return cls(cfg, image, program, IssBackend(hw, arithmetic, source))
        return cls(cfg, image, program, CsrBackend(device, progress))

    @classmethod
    def on_device(cls, image: Image, device: NpuDevice, progress=None) -> "Runtime":
        """Run a packed image (`firmware.pack.load_image`) on `device` (the board: `firmware.board.Kv260Device`):
        check the NPU's ID and VERSION against the image, compile the token program for the device's hardware
        and load both (`CsrBackend.load`, `progress(done, total)` per written chunk)."""
        if not isinstance(image, Image):
            raise TypeError(f"image must be a packed firmware.pack.Image (firmware.pack.load_image), not "
                            f"{type(image).__name__}")
        missing = [m for m in ("csr_read", "csr_write", "mem_read", "mem_write", "wait_interrupt") if
                   not callable(getattr(device, m, None))] + [a for a in ("hw", "windows") if not hasattr(device, a)]
        if missing:
            raise TypeError(f"device must be an NpuDevice; {type(device).__name__} has no {', '.join(missing)}")
        backend = CsrBackend(device, progress)
        backend.check(image)
        cfg = ModelConfig.from_hf(image.config)
        return cls(cfg, image, compile_token(cfg, image, device.hw), backend)

    def reset(self) -> None:
        """Clear the KV cache of every stream; each stream's next `step` is position 0."""
        self.backend.reset_kv()
        self.positions = [0] * self.streams
        self._verified = None

    def use_stream(self, stream: int) -> None:
        """Make `stream` the one `step`, `prefill`, `verify` and `rollback` advance (`streams` of them)."""
        self.stream = check_index("stream", stream, self.streams, "the image's streams")

    def step(self, token_id: int) -> np.ndarray:
        """Stage the token's host-table rows, run the token program for `token_id` at the current stream's
        position and return the logits."""
        token_id = check_index("token id", token_id, self.config.vocab_size, "the vocabulary")
        for region, offset, data in self.image.stage_rows(token_id):
            self.backend.write(region, offset, data)
        if self.stream == 0:
            logits = self.backend.run(token_id, self.position)
        else:
            logits = self.backend.run_words(self._compiled(1, (self.stream,), "last").words, token_id,
                                            self.position)
        self.position += 1
        self._verified = None
        return logits

    def copy_stream(self, src: int, dst: int) -> None:
        """Make stream `dst` continue where stream `src` stands: its KV cache a copy of `src`'s, its position
        `src`'s (a prompt prefilled once for every stream)."""
        src = check_index("stream", src, self.streams, "the image's streams")
        dst = check_index("stream", dst, self.streams, "the image's streams")
        if src != dst:
            for layer, slot in self.image.stream_slots[src].items():
                self.backend.kv_copy(slot, self.image.stream_slots[dst][layer])
            self.positions[dst] = self.positions[src]
        self._verified = None

    def step_many(self, ids) -> np.ndarray:
        """Batched decode: stream s's next token is ``ids[s]``, one per stream, each at its own position; returns
        their logits ``[streams, vocab]`` (row s: stream s's, bit for bit what `step` gives on that stream
        alone). The tokens run in batched programs of up to `batch_tokens` streams (one weight stream each).
        Bad ids raise here, before anything runs."""
        ids = self._ids(ids)
        if len(ids) != self.streams:
            raise ValueError(f"step_many takes one id per stream: {self.streams} ids, not {len(ids)}")
        for s in range(self.streams):
            if self.positions[s] >= self.max_positions:
                raise ValueError(f"stream {s} is at position {self.positions[s]}: the KV cache holds "
                                 f"{self.max_positions} positions")
        out = []
        per = self.batch_tokens
        for s0 in range(0, self.streams, per):
            run = ids[s0:s0 + per]
            streams = tuple(range(s0, s0 + len(run)))
            program = self._compiled(len(run), streams, "all")
            for t, token in enumerate(run):
                for region, offset, data in self.image.stage_rows(token, slot=t):
                    self.backend.write(region, offset, data)
            self.backend.run_words(program.bind(run, [self.positions[s] for s in streams]), run[0],
                                   self.positions[s0])
            out.append(self.backend.logit_rows(len(run)))
            for s in streams:
                self.positions[s] += 1
        self._verified = None
        return np.concatenate(out)

    def verify(self, ids) -> np.ndarray:
        """Speculative decoding's verify pass on the current stream: run `ids` (the last id not yet run, then
        the drafts) at the next positions in one program and return every position's logits ``[len(ids),
        vocab]`` (row j: after ``ids[:j + 1]``, bit for bit what `step` gives). The KV rows the drafts write are
        saved first, so that `rollback` can drop the rejected ones. At most `verify_tokens` ids (the program's
        tile, the LOGITS rows, `firmware.compiler.multi_token_limit`)."""
        ids = self._ids(ids)
        n, pos = len(ids), self.position
        limit = self.verify_tokens(pos)
        if n > limit:
            raise ValueError(f"verify takes at most {limit} ids at position {pos} (the program's token tile, the "
                             f"image's logits rows, the sliding window of a shared KV layer), not {n}")
        if pos + n > self.max_positions:
            raise ValueError(f"{n} ids from position {pos} go beyond the KV cache's {self.max_positions} positions")
        # the rows of the drafts' positions (a ring row each: `verify_tokens` keeps them apart), one by one
        saved = {q: [(r, self.backend.kv_save([r])) for r in self._kv_rows(self.stream, q)]
                 for q in range(pos + 1, pos + n)}
        if n == 1:
            rows = self.step(ids[0])[None]
        else:
            for t, token in enumerate(ids):
                for region, offset, data in self.image.stage_rows(token, slot=t):
                    self.backend.write(region, offset, data)
            program = self._compiled(n, (self.stream,) * n, "all")
            self.backend.run_words(program.bind(ids, range(pos, pos + n)), ids[0], pos)
            rows = self.backend.logit_rows(n)
            self.position += n
        self._verified = (self.stream, pos, n, saved)
        return rows

    def rollback(self, keep: int) -> None:
        """Keep the first `keep` ids of the last `verify` (1 ..its ids): the stream's position goes back to the
        one after them and the KV rows the others wrote get their earlier contents back, byte for byte the
        cache that stepping the kept ids alone leaves."""
        if self._verified is None or self._verified[0] != self.stream:
            raise ValueError("rollback follows a verify on the same stream (nothing ran in between)")
        stream, pos, n, saved = self._verified
        keep = check_index("keep", keep - 1, n, f"the {n} verified ids") + 1
        for q in range(pos + keep, pos + n):
            for _, copy in saved[q]:
                self.backend.kv_restore(copy)
        self.position = pos + keep
        self._verified = None

    def prefill(self, ids) -> np.ndarray:
        """Run the prompt `ids` from the current position and return the logits after the last one, leaving
        the runtime (position, KV cache) where ``step`` on each id would have left it, with the same bits.

        The ids run in prefill programs of up to `prefill_tokens` tokens (`firmware.compiler.compile_tokens`:
        the projections once for all of them), one after another (`firmware.compiler.prefill_runs`); a run of
        one id, and the ids a multi-token program may not run (`firmware.compiler.multi_token_limit`), run
        through the decode program. Only the last program computes logits: the others leave out the output
        section (``logits="none"``), whose LM head streams as many weight bytes as a fifth of a token's. Bad
        ids raise here, before anything runs."""
        ids = self._ids(ids)
        runs = prefill_runs(self.config, len(ids), self.position, self.prefill_tokens,
                            sliding_ring(self.config, self.image))
        logits, k = None, 0
        for i, (pos, n) in enumerate(runs):
            run = ids[k:k + n]
            k += n
            last = i == len(runs) - 1
            if n == 1 and last:
                logits = self.step(run[0])
                continue
            program = self._compiled(n, (self.stream,) * n, "last" if last else "none")
            for t, token in enumerate(run):
                for region, offset, data in self.image.stage_rows(token, slot=t):
                    self.backend.write(region, offset, data)
            logits = self.backend.run_words(program.bind(run, range(pos, pos + n)), run[0], pos)
            self.position += n
        self._verified = None
        return logits

    def _ids(self, ids) -> list[int]:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            raise TypeError(f"ids must be a sequence of token ids, not {type(ids).__name__}")
        ids = [check_index("token id", t, self.config.vocab_size, "the vocabulary") for t in ids]
        if not ids:
            raise ValueError("ids must hold at least one token id")
        return ids

    def _kv_rows(self, stream: int, pos: int) -> list[tuple[int, int]]:
        """``(slot, ring row)`` that KVST writes for `pos` on `stream`: one per cache layer."""
        return [(slot, pos % self.image.descriptors[slot].capacity)
                for slot in self.image.stream_slots[stream].values()]

    def _compiled(self, tokens: int, streams: tuple[int, ...], logits: str) -> Program:
        key = (tokens, streams, logits, self.prefill_gemm)
        if key not in self._programs:
            self._programs[key] = compile_tokens(self.config, self.image, self._hw, tokens, gemm=self.prefill_gemm,
                                                 streams=streams, logits=logits)
        return self._programs[key]

    @property
    def batch_tokens(self) -> int:
        """Streams per batched program (`step_many`): as many as `prefill_tokens` allows, the image's logits
        rows at most."""
        return max(1, min(self.prefill_tokens, self.image.logit_rows, self.streams))

    def verify_tokens(self, pos: int | None = None) -> int:
        """The most ids a `verify` at `pos` (default: the current stream's position) runs: a prefill program's
        tokens (`prefill_tokens`), the image's logits rows, `multi_token_limit`, and the narrowest sliding ring
        (so that no two of them share a ring row)."""
        pos = self.position if pos is None else pos
        rings = [self.image.descriptors[slot].capacity for layer, slot in self.image.kv_slots.items()
                 if self.config.is_sliding(layer)]
        return max(1, min([self.prefill_tokens, self.image.logit_rows, self.multi_token_limit(pos)] + rings))

    def multi_token_limit(self, pos: int) -> int:
        """`firmware.compiler.multi_token_limit` of this model."""
        return multi_token_limit(self.config, pos, sliding_ring(self.config, self.image))

    @property
    def _hw(self) -> HardwareConfig:
        """The hardware the backend runs (an ISS's, a device's), else the image's preset."""
        hw = getattr(self.backend, "hw", None) or getattr(getattr(self.backend, "device", None), "hw", None)
        return hw if isinstance(hw, HardwareConfig) else hardware_of(self.image)

    @property
    def prefill_tokens(self) -> int:
        """Tokens per prefill program: `firmware.compiler.program_tokens` (at most a token tile of the systolic
        array, as many as fit L2 and the host tables' staging slots); settable (1 runs every prompt token
        through ``step``)."""
        if self._prefill_tokens is None:
            self._prefill_tokens = program_tokens(self.config, self.image, self._hw, self.prefill_gemm)
        return self._prefill_tokens

    @prefill_tokens.setter
    def prefill_tokens(self, n: int) -> None:
        self._prefill_tokens = check_positive_int("prefill_tokens", n)

    def prefill_program(self, tokens: int) -> Program:
        """The prefill program of `tokens` tokens (compiled once; `prefill_gemm` as `compile_tokens`'s gemm)."""
        return self._compiled(tokens, (0,) * tokens, "last")
