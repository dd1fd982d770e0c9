"""The integer core's number formats, bit-exact: INT4 weights, block-scaled INT8 activations, and the
GEMV arithmetic that combines them (docs/numerics.md is the prose version of this module).

Weights are INT4, two's complement, packed two per byte, **low nibble first**, and unpacked exactly as
the spec's dequantisation formula::

    w0 = byte & 0x0F; w0 -= 16 if w0 > 7
    w1 = byte >> 4;   w1 -= 16 if w1 > 7

Each output row has one scale per *group* of `group` consecutive input columns, stored as IEEE binary16.
Activations are INT8 in blocks of `block` elements sharing a power-of-two scale ``2**e`` (block floating
point): quantising is an exponent shift and one round-to-nearest-even, exact in hardware.

A GEMV ``y = W x`` is computed per *segment* (the intersection of a weight group and an activation
block; one of `group`, `block` divides the other):

    isum  = sum of w_q * a_q over the segment           exact integer (|isum| < 2**24)
    part  = fp32(fp32(isum) * fp32(scale_w)) * 2**e_a   one binary32 rounding (RNE), exact power of two
    y     = ((part_0 + part_1) + part_2) + ...         binary32 RNE additions, in segment order

Zero activations contribute exactly zero to `isum`, so skipping the weight columns of zero activations
(the sparse FFN layers) gives bit-identical results.
"""

from __future__ import annotations

import numpy as np

# The worst INT4 x INT8 segment sum sizes hardware too; it lives in hdl.config (hdl never imports sim).
from hdl.config import segment_sum_bits, segment_sum_bound

__all__ = [
    "INT4_MIN", "INT4_MAX", "INT8_MAX", "pack_int4", "unpack_int4", "quantize_weights",
    "dequantize_weights", "quantize_activations", "dequantize_activations", "segment_size",
    "segment_sum_bound", "segment_sum_bits", "gemv",
]

INT4_MIN, INT4_MAX = -8, 7
INT8_MAX = 127


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack INT4 values (any integer dtype, each in [-8, 7]) two per byte along the last axis, element
    2i in the low nibble of byte i. The last axis must have even length."""
    q = np.asarray(q)
    if q.dtype.kind not in "iu":
        raise TypeError(f"pack_int4 needs integers, not {q.dtype}")
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of values along the last axis, not {q.shape[-1]}")
    if q.size and (q.min() < INT4_MIN or q.max() > INT4_MAX):
        raise ValueError(f"INT4 values must be in [{INT4_MIN}, {INT4_MAX}], got [{q.min()}, {q.max()}]")
    n = q.astype(np.int16) & 0xF
    return (n[..., 0::2] | (n[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """The spec's formula: low nibble first, values above 7 minus 16. Returns int8, twice as long."""
    b = np.asarray(packed)
    if b.dtype != np.uint8:
        raise TypeError(f"unpack_int4 needs uint8 bytes, not {b.dtype}")
    w0 = (b & 0x0F).astype(np.int8)
    w1 = (b >> 4).astype(np.int8)
    w0 = np.where(w0 > 7, w0 - 16, w0).astype(np.int8)
    w1 = np.where(w1 > 7, w1 - 16, w1).astype(np.int8)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), dtype=np.int8)
    out[..., 0::2] = w0
    out[..., 1::2] = w1
    return out


def _groups(cols: int, size: int) -> int:
    return -(-cols // size)


def quantize_weights(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric round-to-nearest INT4 with one binary16 scale per (row, group of `group` columns).

    ``scale = fp16(max|w| / 7)`` over the group; ``q = clip(rne(w / scale), -8, 7)`` computed in float64
    from the rounded scale (so the stored pair is self-consistent); an all-zero group has scale 0 and
    q = 0. A last, shorter group is allowed. Returns ``(q int8 [rows, cols], scale float16 [rows,
    groups])``. This runs in the packer, offline: only the stored values matter to the hardware."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"quantize_weights needs a [rows, cols] matrix, not shape {w.shape}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive integer, not {group!r}")
    rows, cols = w.shape
    ng = _groups(cols, group)
    pad = ng * group - cols
    wp = np.pad(w, ((0, 0), (0, pad))).reshape(rows, ng, group)
    amax = np.max(np.abs(wp), axis=2)
    scale = (amax / INT4_MAX).astype(np.float16)
    if not np.all(np.isfinite(scale)):
        raise ValueError("a weight group's scale overflows binary16 (|w| > 458 752)")
    s = scale.astype(np.float64)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.rint(wp / np.where(s > 0, s, 1.0)), 0.0)
    q = np.clip(q, INT4_MIN, INT4_MAX).astype(np.int8).reshape(rows, ng * group)[:, :cols]
    return q, scale


def dequantize_weights(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """The real values the INT4 weights stand for, in float64 (exact)."""
    cols = q.shape[1]
    s = np.repeat(scale.astype(np.float64), group, axis=1)[:, :cols]
    return q.astype(np.float64) * s


def _block_exponent(amax: np.ndarray) -> np.ndarray:
    """The smallest e with amax * 2**-e <= 127, from the binary32 exponent and one mantissa compare:
    amax = m * 2**k, m in [0.5, 1); e = k - 7 if m <= 127/128 else k - 6. amax = 0 gives e = 0."""
    m, k = np.frexp(amax.astype(np.float32))
    e = np.where(m <= np.float32(127.0 / 128.0), k - 7, k - 6)
    return np.where(amax > 0, e, 0).astype(np.int32)


def quantize_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Block floating point: per block of `block` elements (a last, shorter block allowed), exponent
    ``e`` = the smallest with ``max|x| * 2**-e <= 127``, and ``q = rne(x * 2**-e)`` (an exact scaling, then
    one rounding to the nearest integer, ties to even). Input binary32; returns ``(q int8, e int32)``."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"activations are binary32, not {x.dtype}")
    if x.ndim != 1:
        raise ValueError(f"quantize_activations needs a vector, not shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("activations must be finite to be quantised")
    n = x.shape[0]
    nb = _groups(n, block)
    xp = np.pad(x, (0, nb * block - n)).reshape(nb, block)
    e = _block_exponent(np.max(np.abs(xp), axis=1))
    q = np.rint(np.ldexp(xp.astype(np.float64), -e[:, None]))  # exact in float64, then RNE
    return q.astype(np.int8).reshape(-1)[:n], e


def dequantize_activations(q: np.ndarray, e: np.ndarray, block: int) -> np.ndarray:
    n = q.shape[0]
    return np.ldexp(q.astype(np.float64), np.repeat(e, block)[:n])


def segment_size(group: int, block: int) -> int:
    """The GEMV's unit of exact integer summation: the smaller of group and block, which must divide
    the larger."""
    small, large = sorted((group, block))
    if large % small:
        raise ValueError(f"weight group ({group}) and activation block ({block}) must divide one another")
    return small


def gemv(q_w: np.ndarray, scale_w: np.ndarray, q_a: np.ndarray, e_a: np.ndarray, *, group: int, block: int,
         acc: np.ndarray | None = None) -> np.ndarray:
    """Bit-exact model of the GEMV engine: ``y = W x`` from INT4 weights ``q_w`` [rows, cols] with binary16
    scales ``scale_w`` [rows, ceil(cols/group)], INT8 activations ``q_a`` [cols] with block exponents
    ``e_a``. Per segment: exact integer sum, one binary32 multiply by the weight scale, an exact
    power-of-two scaling; segments added in order in binary32 (RNE). With `acc` (binary32 [rows]), the
    result is added to it at the end (``accm``). Returns binary32 [rows]."""
    rows, cols = q_w.shape
    if q_a.shape != (cols,):
        raise ValueError(f"activation length {q_a.shape} does not match the {cols} weight columns")
    seg = segment_size(group, block)
    nseg = _groups(cols, seg)
    pad = nseg * seg - cols
    w = np.pad(q_w.astype(np.int64), ((0, 0), (0, pad))).reshape(rows, nseg, seg)
    a = np.pad(q_a.astype(np.int64), (0, pad)).reshape(nseg, seg)
    isum = np.einsum("rsk,sk->rs", w, a)                                   # exact
    assert np.all(np.abs(isum) < 2**24), "segment sums must stay exact in binary32"
    starts = np.arange(nseg) * seg
    sw = scale_w.astype(np.float32)[:, starts // group]                    # [rows, nseg]
    ea = e_a[starts // block]                                              # [nseg]
    part = np.ldexp(isum.astype(np.float32) * sw, ea[None, :].astype(np.int32))
    y = part[:, 0].copy()
    for s in range(1, nseg):
        y = y + part[:, s]                                                 # binary32 RNE, in order
    if acc is not None:
        y = np.asarray(acc, dtype=np.float32) + y
    return y.astype(np.float32)
