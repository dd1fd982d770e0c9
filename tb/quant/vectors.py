"""Seeded binary32 activation vectors for the quantiser's tests (pysim, tests/test_quant.py) and its
end-to-end WGEMV bench (tb/quant/test_quant_gemv.py)."""

from __future__ import annotations

import numpy as np

__all__ = ["F32_MAX", "spread_vector"]

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
