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
(DDR byte addresses), plus ``wait_interrupt`` (block until the NPU's interrupt line is high) and the
attributes ``hw`` (its `HardwareConfig`), ``ddr_base`` and ``ddr_size`` (where the image may go).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from hdl import csr_map
from hdl.config import HardwareConfig
from hdl.isa import DdrRegion, ErrorCode
from sim.config import ModelConfig
from sim.gemma3n import resolve_tensor_names
from sim.iss import HARDWARE, REFERENCE, ExecutionError, Machine

from .compiler import Program, compile_token
from .pack import Image, pack

__all__ = ["Runtime", "Backend", "IssBackend", "CsrBackend", "NpuDevice", "attach_rtl_device",
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

    def run(self, token: int, pos: int) -> np.ndarray:
        """Run the program for `token` at position `pos` until HALT; return a copy of the logits. Raises
        `sim.iss.ExecutionError` (with the `ErrorCode` and the instruction index) if the program stops on an
        error."""

    @property
    def counters(self):
        """Performance counters: `sim.iss.Counters` (cumulative) for the ISS, the CSR counters of the last
        run (``{"CYCLES": ..., ...}``) for the NPU."""


class NpuDevice(Protocol):
    hw: HardwareConfig
    ddr_base: int
    ddr_size: int

    def csr_read(self, offset: int) -> int: ...

    def csr_write(self, offset: int, value: int) -> None: ...

    def mem_read(self, addr: int, nbytes: int) -> bytes: ...

    def mem_write(self, addr: int, data: bytes) -> None: ...

    def wait_interrupt(self) -> None: ...


class IssBackend:
    """The instruction-set simulator as a backend."""

    def __init__(self, hw: HardwareConfig, arithmetic: str = HARDWARE, source: Mapping | None = None):
        self.hw, self.arithmetic, self.source = hw, arithmetic, source
        self.machine: Machine | None = None
        self.program: Program | None = None

    def load(self, image: Image, program: Program) -> None:
        self.machine = Machine(image, self.hw, self.arithmetic, source=self.source)
        self.program = program

    def reset_kv(self) -> None:
        self.machine.reset_kv()

    def run(self, token: int, pos: int) -> np.ndarray:
        self.machine.run(self.program.words, token=token, pos=pos)
        return self.machine.logits.copy()

    @property
    def counters(self):
        return self.machine.counters


def program_image(image: Image, program: Program) -> np.ndarray:
    """The bytes the NPU's DDR holds: the packed image with the program's words (little-endian u64) at the
    start of the PROGRAM region."""
    base, size = image.region("PROGRAM")
    words = np.asarray(program.words, dtype="<u8")
    if words.nbytes > size:
        raise ValueError(f"the program ({len(words)} words, {words.nbytes} bytes) does not fit the PROGRAM "
                         f"region ({size} bytes)")
    ddr = image.ddr.copy()
    ddr[base:base + words.nbytes] = words.view(np.uint8)
    return ddr


class CsrBackend:
    """The NPU behind its CSRs and DDR (`NpuDevice`): the host protocol of docs/architecture.md.

    The image goes to DDR at ``device.ddr_base``; every region base CSR then holds ``ddr_base`` plus the
    region's offset in the image.
    """

    def __init__(self, device: NpuDevice):
        self.device = device
        self.image: Image | None = None
        self.program: Program | None = None
        self._counters: dict[str, int] = {}
        self._checked_id = False

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

    def load(self, image: Image, program: Program) -> None:
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
        ddr = program_image(image, program)
        if ddr.size > dev.ddr_size:
            raise ValueError(f"the DDR image ({ddr.size} bytes) does not fit the device's DDR window "
                             f"({dev.ddr_size} bytes at {dev.ddr_base:#x})")
        dev.mem_write(dev.ddr_base, ddr.tobytes())
        for region in DdrRegion:
            self.csr_write64(f"{region.name}_BASE", dev.ddr_base + image.region(region.name)[0])
        self.csr_write64("PROGRAM_BASE", dev.ddr_base + image.region("PROGRAM")[0])
        self.csr_write("PROGRAM_LEN", len(program.words))
        self.csr_write("DESC_COUNT", len(image.descriptors))
        self.image, self.program = image, program

    def reset_kv(self) -> None:
        base, size = self.image.region("KV")
        self.device.mem_write(self.device.ddr_base + base, bytes(size))

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

    def logits(self) -> np.ndarray:
        n = ModelConfig.from_hf(self.image.config).vocab_size
        raw = self.device.mem_read(self.device.ddr_base + self.image.region("LOGITS")[0], 4 * n)
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)

    def ddr(self, region: str) -> np.ndarray:
        """A copy of one DDR region as the NPU left it (uint8)."""
        base, size = self.image.region(region)
        return np.frombuffer(self.device.mem_read(self.device.ddr_base + base, size), dtype=np.uint8).copy()

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
        self.position = 0
        backend.load(image, program)

    @property
    def machine(self) -> Machine:
        """The ISS machine (``backend="iss"`` only)."""
        if not isinstance(self.backend, IssBackend):
            raise AttributeError(f"{type(self.backend).__name__} has no ISS machine")
        return self.backend.machine

    @property
    def counters(self):
        return self.backend.counters

    @classmethod
    def from_hf(cls, config: Mapping | ModelConfig, tensors: Mapping[str, np.ndarray], backend: str = "iss",
                arithmetic: str | None = None, hw: HardwareConfig | str = "kv260",
                max_positions: int | None = None, device: NpuDevice | None = None) -> "Runtime":
        """Pack, compile and load. `arithmetic` (ISS only): ``"reference"`` (default) or ``"hardware"``; the
        RTL always computes hardware arithmetic. `device` (RTL only): the NPU to drive (default: the one the
        full-chip bench attached)."""
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
        hw = HardwareConfig.preset(hw) if isinstance(hw, str) else hw
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}")
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
        image = pack(cfg, tensors, hw, max_positions=max_positions)
        program = compile_token(cfg, image, hw)
        if backend == "iss":
            source = None
            if arithmetic == REFERENCE:
                source = {name: tensors[full] for name, full in resolve_tensor_names(cfg, tensors).items()}
            return cls(cfg, image, program, IssBackend(hw, arithmetic, source))
        return cls(cfg, image, program, CsrBackend(device))

    def reset(self) -> None:
        """Clear the KV cache; the next `step` is position 0."""
        self.backend.reset_kv()
        self.position = 0

    def step(self, token_id: int) -> np.ndarray:
        """Run the token program for `token_id` at the current position; return the logits."""
        c = self.config
        token_id = int(token_id)
        if not 0 <= token_id < c.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {c.vocab_size})")
        logits = self.backend.run(token_id, self.position)
        self.position += 1
        return logits
