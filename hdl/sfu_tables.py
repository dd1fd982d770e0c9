"""The SFU's constants and coefficient tables, shared by the RTL (`hdl.sfu`) and the bit-exact model
(`sim.sfu`): table geometries, the cubic fits (`table`), the exp, tanh, GELU and sine constants and the
Payne-Hanek windows of ``2**K / 2pi``. The algorithms that use them are described in `sim.sfu`.

This module imports only the standard library and NumPy, so the golden model runs without Amaranth.
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["RECIP_GEOM", "SQRT_GEOM", "TANH_GEOM", "SIN_GEOM", "EXP_SEGMENTS", "table", "TABLES",
           "EXP_CLAMP", "EXP_INV", "EXP_MAGIC", "EXP_L_HI", "EXP_L_LO", "TANH_LO", "TANH_HI", "GELU_K0",
           "GELU_K1", "SIN_LO", "HALF_PI", "PH_K", "PH_GUARD", "PH_WINDOW", "SINCOS_LO", "payne_hanek_window"]

F32 = np.float32


# --- coefficient tables ----------------------------------------------------------------------------------

@functools.cache
def _pi_fixed(bits: int) -> int:
    """floor(pi * 2**bits) from Machin's formula with 64 guard bits."""
    g = bits + 64
    one = 1 << g

    def atan_inv(n):
        total, term, k, sign = 0, one // n, 1, 1
        while term:
            total += sign * (term // k)
            term //= n * n
            k += 2
            sign = -sign
        return total

    return (16 * atan_inv(5) - 4 * atan_inv(239)) >> 64


def _fit_cubic(f, a: float, h: float) -> np.ndarray:
    """Cubic in t on [0, h) approximating f(a + t), least squares on Chebyshev nodes, relative weights."""
    k = np.arange(48)
    t = h / 2 * (1 - np.cos(np.pi * (k + 0.5) / 48))
    y = f(a + t)
    w = 1.0 / np.maximum(np.abs(y), 1e-300)
    v = np.vander(t, 4, increasing=True)
    c, *_ = np.linalg.lstsq(v * w[:, None], y * w, rcond=None)
    return c


def _logseg_table(f, e_lo: int, binades: int, j_bits: int) -> np.ndarray:
    rows = []
    for b in range(binades):
        base = 2.0 ** (e_lo + b)
        h = base / (1 << j_bits)
        for j in range(1 << j_bits):
            rows.append(_fit_cubic(f, base + j * h, h))
    return np.array(rows).astype(np.float32)


# Table geometry: (first binade exponent, binades, fraction bits per binade).
RECIP_GEOM = (0, 1, 6)
SQRT_GEOM = (0, 2, 6)
TANH_GEOM = (-12, 16, 5)
SIN_GEOM = (-16, 16, 5)
EXP_SEGMENTS = 32


@functools.cache
def table(name: str) -> np.ndarray:
    """The coefficient table `name` (float32, shape (segments, 4): c0..c3) the RTL loads."""
    if name == "recip":
        return _logseg_table(lambda z: 1.0 / z, *RECIP_GEOM)
    if name == "rsqrt":
        return _logseg_table(lambda z: 1.0 / np.sqrt(z), *SQRT_GEOM)
    if name == "sqrt":
        return _logseg_table(np.sqrt, *SQRT_GEOM)
    if name == "tanh":
        return _logseg_table(np.tanh, *TANH_GEOM)
    if name == "sin":
        return _logseg_table(lambda z: np.sin(np.pi / 2 * z), *SIN_GEOM)
    if name == "exp":
        t = 2.0 ** (np.arange(EXP_SEGMENTS) / EXP_SEGMENTS)
        return (t[:, None] / np.array([1, 1, 2, 6])[None, :]).astype(np.float32)
    raise ValueError(f"unknown SFU table {name!r}; choose one of: {', '.join(TABLES)}")


TABLES = ("recip", "rsqrt", "sqrt", "tanh", "sin", "exp")


# --- exp -------------------------------------------------------------------------------------------------

EXP_CLAMP = (F32(-110.0), F32(100.0))
EXP_INV = F32(EXP_SEGMENTS / math.log(2))                      # 32/ln2 rounded
EXP_MAGIC = F32(1.5 * 2 ** 23)                                  # x + MAGIC rounds x to an integer (|x| < 2**22)
EXP_L_HI = F32(round(math.log(2) / EXP_SEGMENTS * 2 ** 17) / 2 ** 17)   # 11 significant bits
EXP_L_LO = F32(math.log(2) / EXP_SEGMENTS - float(EXP_L_HI))


# --- tanh, gelu ------------------------------------------------------------------------------------------

TANH_LO = F32(2.0 ** TANH_GEOM[0])
TANH_HI = F32(2.0 ** (TANH_GEOM[0] + TANH_GEOM[1]))

GELU_K0 = F32(-2 * math.sqrt(2 / math.pi))
GELU_K1 = F32(-2 * math.sqrt(2 / math.pi) * 0.044715)


# --- sin / cos -------------------------------------------------------------------------------------------

SIN_LO = F32(2.0 ** SIN_GEOM[0])
HALF_PI = F32(math.pi / 2)

PH_K = 288                       # bits of 2**K / 2pi kept (covers every binary32 exponent)
PH_GUARD = 8                     # guard bits below the 64-bit turn
PH_WINDOW = 64 + 24 + PH_GUARD   # bits of the constant the 24-bit significand is multiplied by
SINCOS_LO = F32(2.0 ** -12)


@functools.cache
def _inv_2pi() -> int:
    """floor(2**PH_K / (2*pi))."""
    pi = _pi_fixed(PH_K + 16)
    return (1 << (2 * PH_K + 16)) // (2 * pi)


def payne_hanek_window(e: int) -> int:
    """The PH_WINDOW-bit window of 2**K/2pi for a significand with weight 2**e (e = exponent - 150): the
    turn is ``(M * window >> (24 + PH_GUARD)) mod 2**64``. The RTL stores one window per exponent."""
    shift = PH_K - 64 - e - 24 - PH_GUARD
    return (_inv_2pi() >> shift) & ((1 << PH_WINDOW) - 1)
