"""Seeded binary32 activation vectors for the quantiser's tests (pysim, tests/test_quant.py,
tests/test_kvpack.py) and its end-to-end WGEMV bench (tb/quant/test_quant_gemv.py), and the pysim driver of
its element stream (four elements per beat: `beats`)."""

from __future__ import annotations

import numpy as np

from hdl.l2 import LANES, beat_layout

__all__ = ["F32_MAX", "spread_vector", "send_words", "beats", "LANES"]

F32_MAX = np.finfo(np.float32).max


def spread_vector(rng: np.random.Generator, n: int, block: int, *, scales=(-160, 128)) -> np.ndarray:
    """Finite binary32 values over a range of magnitudes: each block has a random scale ``2**c``, c uniform
    in `scales` (the default spans the whole binary32 range: all-subnormal, all-zero and overflowing blocks,
    overflow clipped to the largest finite value), elements spread ``2**-14 .. 1`` around it, random signs,
    some zeros of both signs and, with the default scales, some raw random finite bit patterns."""
    nb = -(-n // block)
    c = np.repeat(rng.integers(scales[0], scales[1] + 1, nb), block)[:n]
    mag = rng.uniform(0.5, 1.0, n) * np.exp2(c - rng.integers(0, 15, n).astype(np.float64))
    x = np.where(rng.random(n) < 0.5, -mag, mag)
    x = np.clip(x, -F32_MAX, F32_MAX).astype(np.float32)
    if scales == (-160, 128):
        raw = (rng.integers(0, 2, n, dtype=np.uint32) << 31) | (rng.integers(0, 0xFF, n, dtype=np.uint32) << 23) | \
            rng.integers(0, 1 << 23, n, dtype=np.uint32)                      # exponent field < 0xFF: finite
        x = np.where(rng.random(n) < 0.05, raw.view(np.float32), x)
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.03] = -0.0
    return x.astype(np.float32)


async def send_words(ctx, port, words, *, rng=None, p_idle: float = 0.0) -> None:
    """Drive the stream `port` (an Amaranth simulator testbench's view) with `words` (raw 32-bit patterns) in
    order, each held until accepted; before each, `valid` drops for a cycle with probability `p_idle` (drawn
    from `rng`, a `random.Random`), repeatedly. `valid` is low at the end."""
    payload = port.payload.as_value() if hasattr(port.payload, "as_value") else port.payload   # a struct: raw bits
    for v in words:
        while p_idle and rng.random() < p_idle:
            ctx.set(port.valid, 0)
            await ctx.tick()
        ctx.set(port.valid, 1)
        ctx.set(payload, int(v))
        await ctx.tick().until(port.ready)
    ctx.set(port.valid, 0)


def beats(words) -> list[int]:
    """One quantiser command's elements (raw 32-bit patterns) as `hdl.l2.beat_layout` payloads: lanes of
    four consecutive elements, the last beat the rest, its ``n`` and ``last`` set."""
    words = [int(w) for w in words]
    layout, out = beat_layout(), []
    for i in range(0, len(words), LANES):
        chunk = words[i:i + LANES]
        data = sum(w << (32 * k) for k, w in enumerate(chunk))
        out.append(layout.const({"data": data, "n": len(chunk), "last": int(i + LANES >= len(words))}).as_bits())
    return out
