"""Bit-exact NumPy model of the SFU (special function unit): every function as the exact sequence of
binary32 operations, integer bit manipulations and table look-ups the RTL (`hdl/sfu.py`) performs.

Conventions
-----------
Inputs and outputs are float32 NumPy arrays (the RoPE functions take uint64 turn arrays). Every arithmetic
step is one IEEE binary32 operation with round-to-nearest-even: NumPy float32 ``+``, ``*`` and
``np.ldexp`` (which `hdl.fp.FpAdd`, `FpMul` and `FpLdexp` reproduce bit for bit), or an exact integer
operation on the bit pattern. The tables and constants (`table`, the geometries, `payne_hanek_window`) are
generated in `hdl.sfu_tables`, which the RTL imports too, and re-exported here. NaN results are the canonical
quiet NaN (``hdl.fp.QNAN``); tests compare NaN-ness for them.

Algorithms (why in brackets; error bounds against float64 NumPy, measured by tests/test_sfu_model.py
over dense sweeps and edge values, are in `BOUNDS` and docs/sfu.md):

- Shared evaluator: a cubic per table segment, Horner in binary32,
  ``p = ((c3*t + c2)*t + c1)*t + c0`` (6 operations). Segments are *log segments*: a positive argument
  ``z`` is split by its binary32 exponent and the top ``J`` fraction bits (the table index is a bit
  field), and ``t = z - segment_start`` is exact (same binade). Coefficients are float64 least-squares
  fits on Chebyshev nodes weighted for relative error, rounded to binary32. [One evaluator for every
  function; a cubic keeps the table small; binary32 Horner is bit-exact in the RTL by construction.]
- recip, rsqrt, sqrt: normalise to ``m * 2**e`` (a subnormal is first multiplied by 2**24, exactly),
  evaluate on ``m`` in [1, 2) (recip) or on ``m * 2**(e & 1)`` in [1, 4) (rsqrt, sqrt; the exponent parity
  picks the binade), then `ldexp` by ``-e``, ``-(e >> 1)`` or ``e >> 1``. 64 segments per binade.
- exp: Cody-Waite reduction ``x = (32*k + j) * ln2/32 + r``: ``n = rne(x * 32/ln2)`` by the 1.5*2**23
  magic add, ``r = (x - n*L_HI) - n*L_LO`` with an 11-bit ``L_HI`` (``n*L_HI`` and the subtraction are
  exact), ``p = 2**(j/32) * e**r`` as a Taylor cubic per ``j`` (32 segments, ``|r| <= ln2/64``), then
  ``ldexp(p, k)`` (overflow to inf, gradual underflow). The input is clamped to [-110, 100] first so
  infinities and huge values need no extra path. [Cody-Waite keeps ``r`` exact where a binary32
  ``x*log2(e)`` would lose 2**-17 absolute; the 2**(j/32) table makes a cubic enough.]
- tanh: log segments of ``|x|`` over [2**-12, 16) (16 binades x 32), ``tanh(x) = x`` below 2**-12 and
  ±1 at 16 and above, result clamped to 1 in magnitude. [Direct table: full relative accuracy near 0,
  which softcap and AltUp need, and one evaluator pass.]
- gelu_tanh: ``x * sigma(2u)`` = ``x * recip(1 + exp(-2u))`` with ``-2u = x * (K1*x*x + K0)``; ``-inf``
  gives -0. [The sigmoid form keeps relative accuracy for negative x, where ``0.5x(1 + tanh u)`` cancels.]
- sin_turns/cos_turns (u0.64 turns): ``cos_turns(t) = sin_turns(t + 2**62)``; the top two bits pick the
  quadrant, the remaining 62 bits ``f`` give ``g = f`` or ``2**62 - f`` (exact integers), ``z = fp32(g *
  2**-62)`` (one rounding), ``sin(pi/2 * z)`` by log segments over [2**-16, 1) (16 binades x 32),
  ``z * pi/2`` below 2**-16, 1 at z = 1; quadrants 2 and 3 negate. [Integer quadrant folding is exact, so
  the only angle error is the 2**-64-turn input grid: RoPE phases stay accurate at any position.]
- sin/cos (binary32 radians): ``|x| < 2**-12`` gives ``x`` / 1; otherwise the turn ``x / 2pi`` as u0.64 by
  Payne-Hanek: the 24-bit significand times a 96-bit window of ``2**K / 2pi`` chosen by the exponent
  (`payne_hanek_window`), then sin_turns/cos_turns. [Exact range reduction for every binary32.]
- rope_sin/rope_cos: ``t = (f * pos) mod 2**64`` with ``f`` u0.64, then sin_turns/cos_turns.
- reduce_sum/reduce_max: `reduce_lanes` interleaved accumulators (element ``i`` goes to lane ``i mod P``,
  each lane folds its elements in index order starting from -0.0 / -inf), then a pairwise tree over the
  lanes in index order: ``((l0+l1)+(l2+l3))+...``. max is ``np.maximum`` (NaN wins; on equal values,
  including ±0, the second operand).
"""

from __future__ import annotations

import numpy as np

from hdl.sfu_tables import (
    EXP_CLAMP,
    EXP_INV,
    EXP_L_HI,
    EXP_L_LO,
    EXP_MAGIC,
    EXP_SEGMENTS,
    GELU_K0,
    GELU_K1,
    HALF_PI,
    PH_GUARD,
    RECIP_GEOM,
    SIN_GEOM,
    SIN_LO,
    SINCOS_LO,
    SQRT_GEOM,
    TABLES,
    TANH_GEOM,
    TANH_HI,
    TANH_LO,
    payne_hanek_window,
    table,
)

__all__ = ["exp", "tanh", "gelu_tanh", "sqrt", "rsqrt", "recip", "sin", "cos", "sin_turns", "cos_turns",
           "rope_sin", "rope_cos", "reduce_sum", "reduce_max", "fmax", "scale", "softcap", "table", "TABLES",
           "payne_hanek_window", "BOUNDS", "QNAN", "horner", "logseg_index"]

F32 = np.float32
QNAN = 0x7FC00000
_NAN = np.array([QNAN], np.uint32).view(np.float32)[0]


# --- bit helpers ----------------------------------------------------------------------------------------

def _f(x):
    return np.asarray(x, dtype=np.float32)


def _bits(x):
    return _f(x).view(np.uint32)


def _from_bits(b):
    return np.asarray(b, dtype=np.uint32).view(np.float32)


def _expf(x):
    """Biased exponent field of binary32 values."""
    return ((_bits(x) >> 23) & 0xFF).astype(np.int64)


def _ldexp(x, k):
    return np.ldexp(_f(x), np.asarray(k, dtype=np.int32))


# --- the shared evaluator --------------------------------------------------------------------------------

def horner(c, t):
    """``((c3*t + c2)*t + c1)*t + c0`` in binary32, six RNE operations in this order. `c`: (..., 4)."""
    c = _f(c)
    t = _f(t)
    h = c[..., 3] * t
    h = h + c[..., 2]
    h = h * t
    h = h + c[..., 1]
    h = h * t
    return h + c[..., 0]


def logseg_index(z, e_lo: int, j_bits: int):
    """Table index and exact local variable of positive binary32 `z` in [2**e_lo, ...) for log segments
    of ``2**j_bits`` per binade: ``index = (exponent - e_lo) << j_bits | top j_bits fraction bits``,
    ``t = z - (z with the lower fraction bits cleared)``."""
    b = _bits(z)
    low = 23 - j_bits
    idx = ((_expf(z) - 127 - e_lo) << j_bits) | ((b >> low) & ((1 << j_bits) - 1)).astype(np.int64)
    start = _from_bits(b & np.uint32((0xFFFFFFFF << low) & 0xFFFFFFFF))
    return idx, _f(z) - start


# --- reciprocal, square roots -----------------------------------------------------------------------------

def _normalise(a):
    """Positive finite non-zero binary32 `a` as (m in [1, 2), e): a = m * 2**e. Subnormals are multiplied
    by 2**24 first (exact)."""
    a = _f(a)
    sub = _expf(a) == 0
    a2 = np.where(sub, a * F32(2.0 ** 24), a)
    e = _expf(a2) - 127 - 24 * sub
    m = _from_bits((_bits(a2) & np.uint32(0x007FFFFF)) | np.uint32(0x3F800000))
    return m, e


def recip(x):
    """1/x. Specials: ±0 -> ±inf, ±inf -> ±0, NaN -> NaN."""
    x = _f(x)
    with np.errstate(all="ignore"):
        a = np.abs(x)
        ok = (a > 0) & np.isfinite(a)
        m, e = _normalise(np.where(ok, a, F32(1)))
        idx, t = logseg_index(m, RECIP_GEOM[0], RECIP_GEOM[2])
        p = horner(table("recip")[idx], t)
        y = _ldexp(p, -e)
        y = np.where(a == 0, F32(np.inf), np.where(np.isinf(a), F32(0), y))
        y = np.where(np.signbit(x), -y, y)
        return np.where(np.isnan(x), _NAN, y).astype(np.float32)


def _sqrt_core(x, name):
    a = _f(x)
    ok = (a > 0) & np.isfinite(a)
    m, e = _normalise(np.where(ok, a, F32(1)))
    odd = (e & 1).astype(np.uint32)
    z = _from_bits(_bits(m) + (odd << np.uint32(23)))         # m * 2**(e & 1), in [1, 4)
    idx, t = logseg_index(z, SQRT_GEOM[0], SQRT_GEOM[2])
    p = horner(table(name)[idx], t)
    return p, e >> 1


def sqrt(x):
    """sqrt(x). Specials: ±0 -> ±0, +inf -> +inf, x < 0 or NaN -> NaN."""
    x = _f(x)
    with np.errstate(all="ignore"):
        p, q = _sqrt_core(x, "sqrt")
        y = _ldexp(p, q)
        y = np.where(x == 0, x, np.where(np.isposinf(x), x, y))
        return np.where(np.isnan(x) | (x < 0), _NAN, y).astype(np.float32)


def rsqrt(x):
    """1/sqrt(x). Specials: +0 -> +inf, -0 -> -inf, +inf -> +0, x < 0 or NaN -> NaN."""
    x = _f(x)
    with np.errstate(all="ignore"):
        p, q = _sqrt_core(x, "rsqrt")
        y = _ldexp(p, -q)
        y = np.where(x == 0, np.where(np.signbit(x), F32(-np.inf), F32(np.inf)), np.where(np.isposinf(x), F32(0), y))
        return np.where(np.isnan(x) | (x < 0), _NAN, y).astype(np.float32)


# --- exp -------------------------------------------------------------------------------------------------

def exp(x):
    """e**x (softmax: x <= 0 after subtracting the running max). Overflow -> +inf, underflow -> gradual,
    then 0; NaN -> NaN."""
    x = _f(x)
    with np.errstate(all="ignore"):
        xc = np.minimum(np.maximum(x, EXP_CLAMP[0]), EXP_CLAMP[1])
        tm = xc * EXP_INV + EXP_MAGIC
        n = _bits(tm).astype(np.int64) - int(_bits(EXP_MAGIC))
        nf = tm - EXP_MAGIC
        r = (xc - nf * EXP_L_HI) - nf * EXP_L_LO
        p = horner(table("exp")[n & (EXP_SEGMENTS - 1)], r)
        y = _ldexp(p, n >> 5)
        return np.where(np.isnan(x), _NAN, y).astype(np.float32)


# --- tanh, gelu ------------------------------------------------------------------------------------------

def tanh(x):
    """tanh(x); |result| <= 1; NaN -> NaN."""
    x = _f(x)
    with np.errstate(all="ignore"):
        a = np.abs(x)
        inside = (a >= TANH_LO) & (a < TANH_HI)
        idx, t = logseg_index(np.where(inside, a, TANH_LO), TANH_GEOM[0], TANH_GEOM[2])
        p = np.minimum(horner(table("tanh")[idx], t), F32(1))
        y = np.where(a < TANH_LO, a, np.where(inside, p, F32(1)))
        y = np.where(np.signbit(x), -y, y)
        return np.where(np.isnan(x), _NAN, y).astype(np.float32)


def gelu_tanh(x):
    """0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3))) = x / (1 + exp(-2u)); -inf -> -0, NaN -> NaN."""
    x = _f(x)
    with np.errstate(all="ignore"):
        v = (GELU_K1 * (x * x) + GELU_K0) * x
        y = x * recip(exp(v) + F32(1))
        y = np.where(np.isneginf(x), F32(-0.0), y)
        return np.where(np.isnan(x), _NAN, y).astype(np.float32)


# --- sin / cos -------------------------------------------------------------------------------------------

_Q = np.uint64(62)


def sin_turns(t):
    """sin(2*pi*t/2**64) for `t` uint64 (u0.64 fraction of a turn)."""
    t = np.asarray(t, dtype=np.uint64)
    q = (t >> _Q).astype(np.int64)
    f = t & np.uint64((1 << 62) - 1)
    g = np.where(q & 1, np.uint64(1 << 62) - f, f)               # exact; 2**62 when f = 0 in odd quadrants
    z = _ldexp(g.astype(np.float32), -62)                        # uint64 -> binary32 is one RNE rounding
    with np.errstate(all="ignore"):
        inside = (z >= SIN_LO) & (z < F32(1))
        idx, tt = logseg_index(np.where(inside, z, SIN_LO), SIN_GEOM[0], SIN_GEOM[2])
        p = horner(table("sin")[idx], tt)
        y = np.where(z >= F32(1), F32(1), np.where(inside, p, z * HALF_PI))
        return np.where(q >= 2, -y, y).astype(np.float32)


def cos_turns(t):
    """cos(2*pi*t/2**64) = sin_turns(t + 2**62 mod 2**64)."""
    return sin_turns(np.asarray(t, dtype=np.uint64) + np.uint64(1 << 62))


def _turns_of(x):
    """u0.64 turns of |x| (finite, >= 2**-12) by Payne-Hanek, and the sign of x."""
    b = _bits(x)
    e = ((b >> 23) & 0xFF).astype(np.int64)
    mant = (b & 0x7FFFFF).astype(np.int64) | np.where(e > 0, 1 << 23, 0)
    eff = np.maximum(e, 1) - 150
    out = np.empty(b.shape, dtype=np.uint64)
    for i, (mm, ee) in enumerate(zip(mant.ravel().tolist(), eff.ravel().tolist())):
        out.flat[i] = ((mm * payne_hanek_window(ee)) >> (24 + PH_GUARD)) & ((1 << 64) - 1)
    return out


def _sincos(x, cosine: bool):
    x = _f(x)
    a = np.abs(x)
    fin = np.isfinite(a) & (a >= SINCOS_LO)
    t = _turns_of(np.where(fin, a, F32(1)))
    t = np.where(np.signbit(x) & ~np.bool_(cosine), np.uint64(0) - t, t)
    y = cos_turns(t) if cosine else sin_turns(t)
    small = F32(1) if cosine else x
    y = np.where(a < SINCOS_LO, small, y)
    return np.where(np.isfinite(x), y, _NAN).astype(np.float32)


def sin(x):
    """sin(x), x in binary32 radians (exact Payne-Hanek reduction); ±inf, NaN -> NaN."""
    return _sincos(x, cosine=False)


def cos(x):
    """cos(x), x in binary32 radians; ±inf, NaN -> NaN."""
    return _sincos(x, cosine=True)


def rope_turns(f, pos: int):
    """``(f * pos) mod 2**64`` for u0.64 frequencies `f` (uint64) and an integer position."""
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or pos < 0:
        raise ValueError(f"RoPE position must be a non-negative integer, not {pos!r}")
    f = np.asarray(f, dtype=np.uint64)
    return f * np.uint64(int(pos) % (1 << 64))                   # uint64 multiply wraps modulo 2**64


def rope_cos(f, pos: int):
    return cos_turns(rope_turns(f, pos))


def rope_sin(f, pos: int):
    return sin_turns(rope_turns(f, pos))


# --- reductions ------------------------------------------------------------------------------------------

def fmax(a, b):
    """``np.maximum`` semantics on binary32 (NaN if either is NaN; on equality, including ±0, `b`)."""
    a, b = _f(a), _f(b)
    y = np.where(a > b, a, b)
    return np.where(np.isnan(a) | np.isnan(b), _NAN, y).astype(np.float32)


def _reduce(x, hw, op, init):
    x = _f(x).ravel()
    lanes = hw.sfu_reduce_lanes
    if x.size == 0:
        raise ValueError("an SFU reduction needs at least one element")
    acc = np.full(lanes, init, dtype=np.float32)
    with np.errstate(all="ignore"):
        for i in range(0, x.size, lanes):
            chunk = x[i:i + lanes]
            acc[:chunk.size] = op(acc[:chunk.size], chunk)
        while acc.size > 1:
            acc = op(acc[0::2], acc[1::2])
    return F32(acc[0])


def reduce_sum(x, hw):
    """Binary32 sum in the SFU's order: `hw.sfu_reduce_lanes` interleaved lanes from -0.0, then a pairwise
    tree over the lanes."""
    return _reduce(x, hw, lambda a, b: _f(a + b), F32(-0.0))


def reduce_max(x, hw):
    """Binary32 max in the SFU's order (lanes from -inf, then a pairwise tree; `fmax` semantics)."""
    return _reduce(x, hw, fmax, F32(-np.inf))


# --- scalar compositions ---------------------------------------------------------------------------------

def scale(x, s, recip_scale: bool = False):
    """CVO SCALE: ``x * s``, or with `recip_scale` ``x * recip(s)`` (not a division)."""
    s = F32(s)
    return (_f(x) * (recip(s) if recip_scale else s)).astype(np.float32)


def softcap(x, c):
    """CVO SOFTCAP: ``c * tanh(x * recip(c))``."""
    c = F32(c)
    return (tanh(_f(x) * recip(c)) * c).astype(np.float32)


# Error bounds against float64 NumPy, asserted by tests/test_sfu_model.py (ulp = binary32 ulp of the exact
# result; "abs" alternatives apply where the result is tiny or the function has a zero).
BOUNDS = {
    "recip": "1.5 ulp (measured 1.01)",
    "rsqrt": "1.5 ulp (measured 1.01)",
    "sqrt": "1.5 ulp (measured 1.00)",
    "exp": "1.5 ulp for normal results (measured 1.01); 1 subnormal ulp (2**-149) below 2**-126",
    "tanh": "1.5 ulp (measured 1.00)",
    "gelu_tanh": "relative (6 + 4|v|)*2**-24 (v = -2u, rounded in binary32); |result| < 1e-30: absolute 1e-30",
    "sin_turns": "2 ulp (measured 1.7)",
    "cos_turns": "2 ulp (measured 1.7)",
    "sin": "2 ulp (measured 1.75)",
    "cos": "2 ulp (measured 1.7)",
    "rope_sin": "2**-23 absolute + the table's phase error pos * 2**-65 turns",
    "rope_cos": "2**-23 absolute + the table's phase error pos * 2**-65 turns",
    "softcap": "3.5 ulp",
    "scale(recip_scale)": "2 ulp",
    "reduce_sum": "(n/P + log2 P + 1) * 2**-24 * sum|x|",
}
