"""The host runtime: one interface for every backend that runs the NPU's token program.

>>> rt = Runtime.from_hf(config, tensors, backend="iss", arithmetic="reference")
>>> rt.reset(); logits = rt.step(2)

`from_hf` packs the weights into a DDR image (`firmware.pack`), compiles the token program
(`firmware.compiler`) and loads both into the backend; `step` writes the token id and the position,
runs the program and returns the soft-capped logits, exactly like `sim.gemma3n.Model.step`. Sampling and
generation (`firmware.generate`) sit on top of it. Backends: ``"iss"`` (the instruction-set simulator,
`sim.iss`) today; the RTL bench and the board use the same calls.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hdl.config import HardwareConfig
from sim.config import ModelConfig
from sim.gemma3n import resolve_tensor_names
from sim.iss import HARDWARE, REFERENCE, Machine

from .compiler import Program, compile_token
from .pack import Image, pack

__all__ = ["Runtime"]


class Runtime:
    """Drives one backend through token programs; see the module docstring."""

    def __init__(self, config: ModelConfig, image: Image, program: Program, machine: Machine):
        self.config = config
        self.image = image
        self.program = program
        self.machine = machine
        self.position = 0

    @classmethod
    def from_hf(cls, config: Mapping | ModelConfig, tensors: Mapping[str, np.ndarray], backend: str = "iss",
                arithmetic: str = REFERENCE, hw: HardwareConfig | str = "kv260",
                max_positions: int | None = None) -> "Runtime":
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
        hw = HardwareConfig.preset(hw) if isinstance(hw, str) else hw
        if backend != "iss":
            raise ValueError(f"backend {backend!r} is not available yet; use 'iss'")
        if arithmetic not in (REFERENCE, HARDWARE):
            raise ValueError(f"arithmetic must be {REFERENCE!r} or {HARDWARE!r}, not {arithmetic!r}")
        image = pack(cfg, tensors, hw, max_positions=max_positions)
        program = compile_token(cfg, image, hw)
        source = None
        if arithmetic == REFERENCE:
            source = {name: tensors[full] for name, full in resolve_tensor_names(cfg, tensors).items()}
        machine = Machine(image, hw, arithmetic, source=source)
        return cls(cfg, image, program, machine)

    def reset(self) -> None:
        """Clear the KV cache; the next `step` is position 0."""
        self.machine.reset_kv()
        self.position = 0

    def step(self, token_id: int) -> np.ndarray:
        """Run the token program for `token_id` at the current position; return the logits."""
        c = self.config
        token_id = int(token_id)
        if not 0 <= token_id < c.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {c.vocab_size})")
        self.machine.run(self.program.words, token=token_id, pos=self.position)
        self.position += 1
        return self.machine.logits.copy()
