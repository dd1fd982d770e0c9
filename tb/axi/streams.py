"""Drivers for Amaranth `lib.stream` ports (``<name>__valid``, ``__ready``, ``__payload``) in cocotb benches.

Each side acts at the falling edge and samples the handshake in the ReadOnly phase of the same cycle,
so the transfer rules hold by construction: the source raises ``valid`` without looking at ``ready``
(rule 3), and a transfer is counted exactly when both are high at a rising edge. ``p_idle`` / ``p_stall``
are the probabilities of a random bubble on ``valid`` / ``ready`` in a cycle (random flow control).
"""

from __future__ import annotations

import random

from cocotb.triggers import FallingEdge, ReadOnly


class StreamSource:
    def __init__(self, dut, name: str, clock, *, rng: random.Random | None = None, p_idle: float = 0.0):
        self.valid, self.ready = getattr(dut, f"{name}__valid"), getattr(dut, f"{name}__ready")
        self.payload = getattr(dut, f"{name}__payload", None)
        self.clock, self.rng, self.p_idle = clock, rng or random.Random(0), p_idle
        self.valid.value = 0

    async def send(self, items):
        """Send every payload integer of `items`, in order; returns when the last one is accepted."""
        for item in items:
            while True:
                await FallingEdge(self.clock)
                if self.p_idle and self.rng.random() < self.p_idle:
                    self.valid.value = 0
                    continue
                self.valid.value = 1
                if self.payload is not None:
                    self.payload.value = item
                await ReadOnly()
                if int(self.ready.value):
                    break
        await FallingEdge(self.clock)
        self.valid.value = 0


class StreamSink:
    def __init__(self, dut, name: str, clock, *, rng: random.Random | None = None, p_stall: float = 0.0):
        self.valid, self.ready = getattr(dut, f"{name}__valid"), getattr(dut, f"{name}__ready")
        self.payload = getattr(dut, f"{name}__payload")
        self.clock, self.rng, self.p_stall = clock, rng or random.Random(0), p_stall
        self.items: list[int] = []
        self.ready.value = 0

    async def run(self):
        while True:
            await FallingEdge(self.clock)
            self.ready.value = int(not (self.p_stall and self.rng.random() < self.p_stall))
            await ReadOnly()
            if int(self.valid.value) and int(self.ready.value):
                self.items.append(int(self.payload.value))

    async def wait_for(self, n: int, timeout_cycles: int = 1_000_000):
        for _ in range(timeout_cycles):
            if len(self.items) >= n:
                return self.items
            await FallingEdge(self.clock)
        raise AssertionError(f"timeout: {len(self.items)} of {n} items received")


def pauses(rng: random.Random, p: float):
    """A cocotbext-axi pause generator: True (pause) with probability `p` each cycle."""
    while True:
        yield rng.random() < p
