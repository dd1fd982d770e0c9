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
    "INT4_MIN", "INT4_MAX", "INT8_MAX", "pack_int4", "unpack_int4", "quantize_weights", "WEIGHT_METHODS",
    "SEARCH_FRACTIONS",
    "dequantize_weights", "quantize_activations", "dequantize_activations", "segment_size",
    "segment_sum_bound", "segment_sum_bits", "gemv", "gemv_order", "KV_Q_MAX", "split_int8", "pow2_binary16",
    "quantize_kv_k", "quantize_kv_v", "KvInt8Layout", "v_plane_scales", "V_PLANE_LOG2_GROUP",
]

INT4_MIN, INT4_MAX = -8, 7
INT8_MAX = 127
# INT8 KV cache values: q = 16·hi + lo with hi, lo two's complement INT4, so that the GEMV engine (INT4 x INT8)
# computes with them as two planes; |q| <= KV_Q_MAX = 119 keeps both nibbles in [-8, 7] (docs/numerics.md, "KV
# cache"). The V planes' GEMVs have one scale group per row (V_PLANE_LOG2_GROUP: 2**16 columns covers any
# command). Both live in hdl.config with the hardware that uses them.
from hdl.config import KV_Q_MAX, V_PLANE_LOG2_GROUP  # noqa: E402


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


# Weight quantisers (`quantize_weights`' `method`): "search" (the default, what the packer stores) and "rtn".
WEIGHT_METHODS = ("search", "rtn")
# The scales the search tries for a group, as fractions of round-to-nearest's ``max|w| / 7``: 1.00 down to 0.60 in
# steps of 0.01, and 7/8 (``max|w| / 8``: the largest magnitude becomes exactly -8, or is clipped to 7 if positive);
# largest first, so ties go to round-to-nearest's scale. On the built-in trained model no group picks a fraction
# below 0.6, and steps of 0.02 or 0.05 leave more error (docs/numerics.md "Weights").
SEARCH_FRACTIONS = tuple(sorted({*(round(1.0 - 0.01 * k, 2) for k in range(41)), 0.875}, reverse=True))
_SEARCH_CHUNK = 1 << 20      # weights per step of the search: its one float64 buffer is 8 MB


def _round_to_scale(wp: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``clip(rne(w / s), -8, 7)`` per group (`s` [..., groups, 1] float64; a zero scale gives 0), float64."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.rint(wp / np.where(s > 0, s, 1.0)), 0.0)
    return np.clip(q, INT4_MIN, INT4_MAX)


def _search_scales(wp: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """Per group of `wp` [rows, groups, group], the binary16 scale among ``fp16(c · amax / 7)``, c in
    `SEARCH_FRACTIONS`, whose codes ``clip(rne(w / scale), -8, 7)`` give the least squared error
    ``Σ (w - q·scale)²``; the first (largest c) of equal ones. Each candidate is `_round_to_scale` and the error,
    computed in place in one buffer of `_SEARCH_CHUNK` weights."""
    rows, ng, group = wp.shape
    best = (amax / INT4_MAX).astype(np.float16)
    step = max(1, _SEARCH_CHUNK // (ng * group))
    buf = np.empty((min(step, rows), ng, group))
    for r0 in range(0, rows, step):
        w = wp[r0:r0 + step]
        a = amax[r0:r0 + step]
        b = buf[:len(w)]
        best_err = np.full(a.shape, np.inf)
        chosen = best[r0:r0 + step]                 # a view: written through into `best`
        for c in SEARCH_FRACTIONS:
            scale = (c * a / INT4_MAX).astype(np.float16)
            s = scale.astype(np.float64)[:, :, None]
            np.divide(w, np.where(s > 0, s, 1.0), out=b)     # an all-zero group: 0 / 1
            np.rint(b, out=b)
            np.clip(b, INT4_MIN, INT4_MAX, out=b)
            np.multiply(b, s, out=b)
            np.subtract(w, b, out=b)
            np.square(b, out=b)
            err = b.sum(axis=2)
            better = err < best_err
            best_err[better] = err[better]
            chosen[better] = scale[better]
    return best


def quantize_weights(w: np.ndarray, group: int, method: str = "search") -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT4 with one binary16 scale per (row, group of `group` columns).

    ``q = clip(rne(w / scale), -8, 7)`` computed in float64 from the stored (binary16) scale, so the stored pair
    is self-consistent; an all-zero group has scale 0 and q = 0. A last, shorter group is allowed. `method`
    chooses the scale:

    - ``"search"`` (default): among ``fp16(c · max|w| / 7)`` for c in `SEARCH_FRACTIONS` (1, 0.99, ..., 0.6
      and 7/8), the one whose codes give the group the least squared error ``Σ (w - q·scale)²``, each candidate
      evaluated after its rounding to binary16; of equal errors the largest scale. A smaller scale rounds the
      bulk of the group more finely and clips its largest weights to 7 (or -8); c = 1 is round-to-nearest's
      scale, so no group's error exceeds round-to-nearest's.
    - ``"rtn"``: round-to-nearest, ``scale = fp16(max|w| / 7)``.

    Returns ``(q int8 [rows, cols], scale float16 [rows, groups])``. This runs in the packer, offline: only the
    stored values matter to the hardware, which reads any scale the same way."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"quantize_weights needs a [rows, cols] matrix, not shape {w.shape}")
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ValueError(f"group must be a positive integer, not {group!r}")
    if method not in WEIGHT_METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, WEIGHT_METHODS))}, not {method!r}")
    rows, cols = w.shape
    ng = _groups(cols, group)
    pad = ng * group - cols
    wp = np.pad(w, ((0, 0), (0, pad))).reshape(rows, ng, group)
    amax = np.max(np.abs(wp), axis=2)
    with np.errstate(over="ignore"):
        scale = (amax / INT4_MAX).astype(np.float16)
    if not np.all(np.isfinite(scale)):
        raise ValueError("a weight group's scale overflows binary16 (|w| > 458 752)")
    if method == "search":
        scale = _search_scales(wp, amax)
    q = _round_to_scale(wp, scale.astype(np.float64)[:, :, None])
    q = q.astype(np.int8).reshape(rows, ng * group)[:, :cols]
    return q, scale


def dequantize_weights(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """The real values the INT4 weights stand for, in float64 (exact)."""
    cols = q.shape[1]
    s = np.repeat(scale.astype(np.float64), group, axis=1)[:, :cols]
    return q.astype(np.float64) * s


def _block_exponent(amax: np.ndarray, limit: int = INT8_MAX) -> np.ndarray:
    """The smallest e with amax * 2**-e <= limit (64 <= limit <= 127), from the binary32 exponent and one
    mantissa compare: amax = m * 2**k, m in [0.5, 1); e = k - 7 if m <= limit/128 else k - 6. amax = 0 gives
    e = 0."""
    if not 64 <= limit <= 127:
        raise ValueError(f"the quantiser's limit must be in [64, 127], not {limit!r}")
    m, k = np.frexp(amax.astype(np.float32))
    e = np.where(m <= np.float32(limit / 128.0), k - 7, k - 6)
    return np.where(amax > 0, e, 0).astype(np.int32)


def quantize_activations(x: np.ndarray, block: int, limit: int = INT8_MAX) -> tuple[np.ndarray, np.ndarray]:
    """Block floating point: per block of `block` elements (a last, shorter block allowed), exponent
    ``e`` = the smallest with ``max|x| * 2**-e <= limit`` (127; `KV_Q_MAX` for the INT8 KV cache), and
    ``q = rne(x * 2**-e)`` (an exact scaling, then one rounding to the nearest integer, ties to even, so
    ``|q| <= limit``). Input binary32; returns ``(q int8, e int32)``."""
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
    e = _block_exponent(np.max(np.abs(xp), axis=1), limit)
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


def gemv_order(rows: int, vectors: int, tile_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The order of a GEMV command's results when it multiplies the matrix with `vectors` activation vectors
    (the GEMV engine's `vecs`, ``HardwareConfig.gemv_vectors``): tile by tile (`tile_rows` rows), in a tile
    vector by vector. Returns (row, vector) of each result in that order; each value is `gemv` of its vector,
    and accm's old values come in the same order."""
    r = np.arange(rows)
    runs = [(r[j:j + tile_rows], v) for j in range(0, rows, tile_rows) for v in range(vectors)]
    return (np.concatenate([x for x, _ in runs]).astype(np.int64),
            np.concatenate([np.full(len(x), v, np.int64) for x, v in runs]))


# --- the INT8 KV cache (HardwareConfig.kv_format == "int8") ------------------------------------------------

def split_int8(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``q = 16·hi + lo`` with ``hi = floor((q + 8) / 16)`` and ``lo = q - 16·hi``: for ``|q| <= KV_Q_MAX`` both
    are INT4 (hi in [-7, 7], lo in [-8, 7]). Returns ``(hi, lo)`` as int8."""
    q = np.asarray(q).astype(np.int16)
    if q.size and np.max(np.abs(q)) > KV_Q_MAX:
        raise ValueError(f"INT8 KV values must lie in [-{KV_Q_MAX}, {KV_Q_MAX}]")
    hi = (q + 8) >> 4
    return hi.astype(np.int8), (q - 16 * hi).astype(np.int8)


def pow2_binary16(e: np.ndarray) -> np.ndarray:
    """binary16 ``2**e``, rounded to nearest even: exact for -24 <= e <= 15, 0 below (2**-25 ties to 0),
    +inf above."""
    e = np.asarray(e, dtype=np.int64)
    with np.errstate(over="ignore"):
        return np.ldexp(1.0, np.clip(e, -40, 40)).astype(np.float16)


def quantize_kv_k(k: np.ndarray, block: int):
    """One K row (binary32 [head_dim]) into the INT8 KV format: per block of `block` elements a power-of-two
    exponent with ``|q| <= KV_Q_MAX`` (`quantize_activations` with that limit), ``q`` split into two INT4
    planes, and the planes' binary16 scales ``2**(e + 4)`` (hi) and ``2**e`` (lo). Then ``k ≈ Σ`` over the
    planes of ``plane · scale``: the GEMV engine's dot product with a query is that of the lo plane plus that
    of the hi plane. Returns ``(hi, lo, scale_hi, scale_lo)``."""
    q, e = quantize_activations(np.asarray(k, np.float32), block, KV_Q_MAX)
    hi, lo = split_int8(q)
    return hi, lo, pow2_binary16(e + 4), pow2_binary16(e)


def quantize_kv_v(v: np.ndarray):
    """One V row (binary32 [head_dim]) into the INT8 KV format: one power-of-two exponent for the whole row
    (``|q| <= KV_Q_MAX``), ``q`` split into two INT4 planes, and the row's binary16 scale ``2**e`` (folded
    into the softmax weights by ATTN; the planes' own scales are the constants 16 and 1). Returns
    ``(hi, lo, scale)``."""
    v = np.asarray(v, np.float32)
    q, e = quantize_activations(v, v.shape[0], KV_Q_MAX)
    hi, lo = split_int8(q)
    return hi, lo, pow2_binary16(e[0])


class KvInt8Layout:
    """Where one KV slot's INT8 cache lives in its slice of the KV region (bytes from the slot's offset), for
    `capacity` positions (C) of `heads` KV heads (H) of `head_dim` (D) elements, K scaled per `block` (B)
    elements. Per head j, ``2·C·D`` bytes of planes, each usable as a GEMV matrix as it stands:

    - ``k_hi(j)``, ``k_lo(j)``: INT4, row-major ``[C, D]`` (position p = row p): dense GEMVs, one row per
      position;
    - `v_layout` "planes": ``v_hi(j)``, ``v_lo(j)``: INT4, column-major ``[D, C]`` (position p = column p, D/2
      bytes): sparse GEMVs;
    - `v_layout` "rows": ``v(j)`` (at ``v_hi(j)``, the room of both planes): INT8 ``q``, row-major ``[D, C]``
      (V element d = row d, position p = byte p of it): a dense GEMV of INT8 weights;

    then per head the K planes' binary16 scales, row-major ``[C, ceil(D/B)]``: ``ks_hi(j)`` (``2**(e+4)``) and
    ``ks_lo(j)`` (``2**e``); then per head the V rows' binary16 scales ``vs(j)`` ``[C]``. The V GEMVs' own
    scales are constants (`v_plane_scales`: 16 and 1 for the planes, 1 for the rows; one group per row), a table
    in WEIGHTS shared by every slot."""

    def __init__(self, capacity: int, heads: int, head_dim: int, block: int, v_layout: str = "planes"):
        if head_dim % 2:
            raise ValueError(f"the INT8 KV planes need an even head_dim, not {head_dim}")
        if v_layout not in ("planes", "rows"):
            raise ValueError(f"v_layout must be 'planes' or 'rows', not {v_layout!r}")
        self.capacity, self.heads, self.head_dim, self.block = capacity, heads, head_dim, block
        self.v_layout = v_layout
        self.plane = capacity * head_dim // 2
        self.kblocks = -(-head_dim // block)
        self.kscale = capacity * self.kblocks * 2
        self.scales_base = 4 * heads * self.plane
        self.vs_base = self.scales_base + 2 * heads * self.kscale
        self.nbytes = self.vs_base + heads * capacity * 2
        # one position of one head: its K plane rows and scales, its V (two plane rows, or a byte in each V row)
        # and its V scale
        self.position_bytes = 4 * (head_dim // 2) + 2 * self.kblocks * 2 + 2

    def k_hi(self, j: int) -> int:
        return 4 * j * self.plane

    def k_lo(self, j: int) -> int:
        return self.k_hi(j) + self.plane

    def v_hi(self, j: int) -> int:
        return self.k_hi(j) + 2 * self.plane

    def v_lo(self, j: int) -> int:
        return self.k_hi(j) + 3 * self.plane

    def v(self, j: int) -> int:
        """Layout "rows": head j's INT8 V plane, ``[D, C]``."""
        return self.v_hi(j)

    def v_row_ranges(self, j: int, row: int) -> list[tuple[int, int]]:
        """``(offset, bytes)`` of head j's V at ring row `row`: the two plane columns ("planes"), or one byte in
        each of the D rows ("rows")."""
        if self.v_layout == "planes":
            half = self.head_dim // 2
            return [(self.v_hi(j) + row * half, half), (self.v_lo(j) + row * half, half)]
        return [(self.v(j) + d * self.capacity + row, 1) for d in range(self.head_dim)]

    def ks_hi(self, j: int) -> int:
        return self.scales_base + 2 * j * self.kscale

    def ks_lo(self, j: int) -> int:
        return self.ks_hi(j) + self.kscale

    def vs(self, j: int) -> int:
        return self.vs_base + 2 * j * self.capacity


def v_plane_scales(head_dim: int) -> np.ndarray:
    """The V planes' binary16 scales, ``[2, head_dim]``: the hi plane's 16, the lo plane's 1 (one group per row:
    the sparse GEMV's group-major scales of a single group)."""
    return np.stack([np.full(head_dim, 16.0), np.ones(head_dim)]).astype(np.float16)
