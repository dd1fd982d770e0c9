"""Bit-exact model of the systolic GEMM engine (docs/systolic.md): ``Y = X Wᵀ`` for T tokens at once.

The engine computes, for every token, exactly what the GEMV engine computes (`sim.numerics.gemv`): per
*segment* (the intersection of a weight group and an activation block) an exact integer sum, one binary32
multiply by the binary16 weight scale, an exact power-of-two activation scaling, and binary32 additions in
segment order. A prompt prefilled on the array therefore gives bit for bit the numbers of decoding it token
by token.

How the hardware gets there, and what this module models literally:

* **The PE** (one DSP48E2) multiplies one INT8 activation by two INT4 weights of two neighbouring output
  rows packed into the 27-bit multiplier port, ``wp = w0 + w1 · 2**F`` (`pack_pair`), and accumulates the
  30-bit products over one segment in the 48-bit P register. ``P = Σ a·w0 + 2**F · Σ a·w1`` exactly; the
  two sums come back out with one sign correction (`extract_pair`): ``lo`` = the low F bits read as two's
  complement, ``hi`` = the bits above plus the borrow bit ``P[F-1]``. This is exact while
  ``|Σ a·w0| < 2**(F-1)``: `field_bits` picks F for a segment length (F = 18 for 64-element segments).
* **The array** is output-stationary: R token rows × C columns of PEs (2C output rows), the reduction
  dimension streams through in time, one segment per P accumulation (`array_segment_sums`).
* **The scale stage** turns every segment sum into binary32 and accumulates segments in order
  (`scale_and_accumulate`).
* **A tile** (`gemm_tile`) is the array's unit of work: up to R tokens × up to 2C output rows × the whole
  reduction. `gemm` is the composition of tiles over any shape.

`tile_streams` writes the stream beats the RTL tile engine consumes (the GEMM weight layout: k-major
within a tile of 2C rows) and `untile_output` reads its output beats back; benches and the packer share
them.

Imports only NumPy and the numerics contract, so it runs without Amaranth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hdl.config import DSP48E2_MUL_A_BITS as MUL_A_BITS
from hdl.config import DSP48E2_MUL_B_BITS as MUL_B_BITS
from hdl.config import DSP48E2_P_BITS as P_BITS

from .numerics import INT4_MAX, INT4_MIN, segment_size, segment_sum_bits

__all__ = [
    "EXP_BITS", "field_bits", "pack_pair", "extract_pair", "array_segment_sums", "scale_and_accumulate",
    "gemm_tile", "gemm", "TileGeometry", "tile_streams", "untile_output",
]

# Block exponents of binary32 activations lie in [-155, 122] (sim.numerics._block_exponent of the
# smallest subnormal and of the largest finite value): 9-bit two's complement holds them.
EXP_BITS = 9
ACT_MIN, ACT_MAX = -128, 127     # the INT8 range the PE handles (the quantiser uses only ±127)


def field_bits(seg: int, act_bits: int = 8) -> int:
    """Spacing F of the two weights in the DSP's 27-bit port for segments of `seg` products.

    The low field holds ``Σ a·w0`` over a segment; it is recovered exactly iff its magnitude stays below
    ``2**(F-1)``. The largest magnitude is ``seg · 8 · 2**(act_bits-1)`` (all -8 weights, all -128
    activations), so F is one bit more than that needs. The packed weight (F + 5 bits) must fit the
    27-bit port and the high sum must fit the 48-bit accumulator above F.
    """
    f = segment_sum_bits(seg, act_bits)
    if f + 5 > MUL_A_BITS or 2 * f > P_BITS or act_bits > MUL_B_BITS:
        raise ValueError(f"a segment of {seg} INT4 x INT{act_bits} products does not fit two per DSP48E2 "
                         f"(field of {f} bits)")
    return f


def pack_pair(w0: np.ndarray, w1: np.ndarray, field: int) -> np.ndarray:
    """The multiplier operand of the PE: ``w0 + w1 · 2**field`` (signed, int64)."""
    return np.asarray(w0, dtype=np.int64) + (np.asarray(w1, dtype=np.int64) << field)


def extract_pair(p: np.ndarray, field: int) -> tuple[np.ndarray, np.ndarray]:
    """The sign correction: split an accumulator ``P = lo + hi · 2**field`` (|lo| < 2**(field-1)) into
    ``(lo, hi)``. ``lo`` is P's low `field` bits read as two's complement; ``hi`` is ``P >> field``
    (arithmetic) plus bit ``field-1`` of P, the borrow a negative ``lo`` took from the high field."""
    p = np.asarray(p, dtype=np.int64)
    low = p & ((1 << field) - 1)
    lo = np.where(low >> (field - 1), low - (1 << field), low)
    hi = (p >> field) + ((p >> (field - 1)) & 1)
    return lo, hi


def _seg_geometry(cols: int, group: int, block: int) -> tuple[int, int]:
    seg = segment_size(group, block)
    return seg, -(-cols // seg)


def array_segment_sums(q_w: np.ndarray, q_a: np.ndarray, seg: int) -> np.ndarray:
    """What the PEs hand to the scale stage: for every token t, output row n and segment s the exact
    ``Σ_k q_w[n, k] · q_a[t, k]`` over the segment, computed the way the array computes it — output rows
    paired into one packed operand, products accumulated in a 48-bit P, the pair extracted with the sign
    correction. Returns int64 [T, rows, nseg]; an odd last row is paired with a zero row."""
    q_w = np.asarray(q_w)
    q_a = np.asarray(q_a)
    rows, cols = q_w.shape
    tokens = q_a.shape[0]
    nseg = -(-cols // seg)
    f = field_bits(seg)
    kp = nseg * seg
    w = np.zeros((rows + rows % 2, kp), dtype=np.int64)
    w[:rows, :cols] = q_w
    a = np.zeros((tokens, kp), dtype=np.int64)
    a[:, :cols] = q_a
    packed = pack_pair(w[0::2], w[1::2], f).reshape(-1, nseg, seg)          # [pairs, nseg, seg]
    p = np.einsum("psk,tsk->tps", packed, a.reshape(tokens, nseg, seg))     # exact in int64
    assert np.all(np.abs(p) < 2 ** (P_BITS - 1)), "the 48-bit accumulator cannot overflow"
    lo, hi = extract_pair(p, f)
    out = np.empty((tokens, w.shape[0], nseg), dtype=np.int64)
    out[:, 0::2], out[:, 1::2] = lo, hi
    return out[:, :rows]


def scale_and_accumulate(isum: np.ndarray, scale_w: np.ndarray, e_a: np.ndarray, *, group: int,
                         block: int) -> np.ndarray:
    """The scale stage, per (token, output row): ``part = ldexp(fp32(isum) × fp32(scale), e)`` with one
    binary32 rounding, then ``y = ((part_0 + part_1) + …)`` in binary32, in segment order. `isum` is
    [T, rows, nseg], `scale_w` binary16 [rows, groups], `e_a` [T, blocks]. Returns binary32 [T, rows]."""
    tokens, rows, nseg = isum.shape
    seg = segment_size(group, block)
    assert np.all(np.abs(isum) < 2 ** 24), "segment sums are exact in binary32"
    starts = np.arange(nseg) * seg
    sw = np.asarray(scale_w).astype(np.float32)[:, starts // group]              # [rows, nseg]
    ea = np.asarray(e_a, dtype=np.int32)[:, starts // block]                     # [T, nseg]
    part = np.ldexp(isum.astype(np.float32) * sw[None], ea[:, None, :])          # [T, rows, nseg]
    y = part[:, :, 0].copy()
    for s in range(1, nseg):
        y = y + part[:, :, s]                                                    # binary32 RNE, in order
    return y.astype(np.float32)


def _check(q_w, scale_w, q_a, e_a, group, block):
    q_w, q_a = np.asarray(q_w), np.asarray(q_a)
    if q_w.ndim != 2:
        raise ValueError(f"weights must be a [rows, cols] matrix, not shape {q_w.shape}")
    rows, cols = q_w.shape
    if q_a.ndim != 2 or q_a.shape[1] != cols:
        raise ValueError(f"activations must be [tokens, {cols}] to match the weight columns, not shape "
                         f"{q_a.shape}")
    if q_w.dtype.kind not in "iu" or q_a.dtype.kind not in "iu":
        raise TypeError(f"weights and activations are integers, not {q_w.dtype} and {q_a.dtype}")
    if q_w.size and (q_w.min() < INT4_MIN or q_w.max() > INT4_MAX):
        raise ValueError(f"INT4 weights must be in [{INT4_MIN}, {INT4_MAX}], got [{q_w.min()}, {q_w.max()}]")
    if q_a.size and (q_a.min() < ACT_MIN or q_a.max() > ACT_MAX):
        raise ValueError(f"INT8 activations must be in [{ACT_MIN}, {ACT_MAX}], got [{q_a.min()}, {q_a.max()}]")
    seg, nseg = _seg_geometry(cols, group, block)
    groups, blocks = -(-cols // group), -(-cols // block)
    if np.shape(scale_w) != (rows, groups):
        raise ValueError(f"weight scales must be [{rows}, {groups}] (rows x ceil({cols}/{group})), not "
                         f"{np.shape(scale_w)}")
    if np.asarray(scale_w).dtype != np.float16:
        raise TypeError(f"weight scales are binary16, not {np.asarray(scale_w).dtype}")
    if np.shape(e_a) != (q_a.shape[0], blocks):
        raise ValueError(f"activation exponents must be [{q_a.shape[0]}, {blocks}] (tokens x "
                         f"ceil({cols}/{block})), not {np.shape(e_a)}")
    e = np.asarray(e_a)
    lim = 2 ** (EXP_BITS - 1)
    if e.size and (e.min() < -lim or e.max() >= lim):
        raise ValueError(f"activation exponents must fit {EXP_BITS}-bit two's complement, got "
                         f"[{e.min()}, {e.max()}]")
    return q_w, q_a, seg


def gemm_tile(q_w, scale_w, q_a, e_a, *, group: int, block: int) -> np.ndarray:
    """One tile of the array: ``q_w`` [rows ≤ 2C, cols], ``q_a`` [tokens ≤ R, cols] (the caller keeps
    within the array), the whole reduction. Segment sums from the packed PE arithmetic, then the scale
    stage. Returns binary32 [tokens, rows]."""
    q_w, q_a, seg = _check(q_w, scale_w, q_a, e_a, group, block)
    isum = array_segment_sums(q_w, q_a, seg)
    return scale_and_accumulate(isum, scale_w, e_a, group=group, block=block)


def gemm(q_w, scale_w, q_a, e_a, *, group: int, block: int, acc=None, tile: tuple[int, int] = (32, 64)) \
        -> np.ndarray:
    """Bit-exact model of the GEMM engine for T tokens: ``q_w`` INT4 [rows, cols] with binary16 scales
    [rows, ceil(cols/group)], ``q_a`` INT8 [T, cols] with block exponents ``e_a`` [T, ceil(cols/block)].
    Computed tile by tile (`tile` = (tokens, output rows) per tile: the array's R and 2C); every output
    depends only on its own token and row, so the result is independent of the tiling and equal, token by
    token, to `sim.numerics.gemv`. With `acc` (binary32 [T, rows]) the result is ``acc + y`` (``accm``).
    Returns binary32 [T, rows]."""
    q_w, q_a, _ = _check(q_w, scale_w, q_a, e_a, group, block)
    tt, tr = tile
    if tt < 1 or tr < 1:
        raise ValueError(f"tile must be positive (tokens, rows), not {tile!r}")
    rows, tokens = q_w.shape[0], q_a.shape[0]
    y = np.empty((tokens, rows), dtype=np.float32)
    e_a, scale_w = np.asarray(e_a), np.asarray(scale_w)
    for t0 in range(0, tokens, tt):
        for r0 in range(0, rows, tr):
            y[t0:t0 + tt, r0:r0 + tr] = gemm_tile(q_w[r0:r0 + tr], scale_w[r0:r0 + tr], q_a[t0:t0 + tt],
                                                  e_a[t0:t0 + tt], group=group, block=block)
    if acc is not None:
        acc = np.asarray(acc)
        if acc.shape != (tokens, rows) or acc.dtype != np.float32:
            raise ValueError(f"acc must be binary32 [{tokens}, {rows}], not {acc.dtype} {acc.shape}")
        y = acc + y
    return y.astype(np.float32)


# --- the tile engine's streams --------------------------------------------------------------------------

@dataclass(frozen=True)
class TileGeometry:
    """Shapes of the RTL tile engine's streams (hdl.systolic.SystolicEngine), from the hardware config.

    ``R`` token rows, ``C`` PE columns (``2C`` output rows per tile), segments of ``seg`` k-steps.
    One k-step of weights is ``2C`` INT4 values (output rows n0..n0+2C-1 at one column k, low nibble
    first); it arrives split over ``wgt_ports`` weight streams of ``beat_bits`` each, port p carrying rows
    ``p·2C/wgt_ports ..`` of the step; a beat holds ``steps_per_beat`` consecutive k-steps of its port.
    """

    rows: int            # R
    cols: int            # C
    group: int
    block: int
    beat_bits: int
    max_ports: int

    @classmethod
    def from_config(cls, cfg) -> "TileGeometry":
        return cls(rows=cfg.systolic_rows, cols=cfg.systolic_cols, group=cfg.weight_group or 0,
                   block=cfg.act_block, beat_bits=cfg.axi_data_bits, max_ports=cfg.axi_ports)

    def __post_init__(self):
        if self.group == 0:
            raise ValueError("the GEMM engine needs a weight group (per-row scales: use group = cols)")
        step = self.step_bits
        if step % self.beat_bits and self.beat_bits % step:
            raise ValueError(f"a k-step of {step} weight bits and a {self.beat_bits}-bit beat must divide one "
                             f"another")
        if self.wgt_ports > self.max_ports:
            raise ValueError(f"a k-step needs {self.wgt_ports} weight ports, only {self.max_ports} exist")
        if self.seg < 2 * self.rows:
            raise ValueError(f"segments of {self.seg} k-steps are shorter than the 2 x {self.rows} cycles the "
                             f"array needs to drain a segment; use fewer rows or a longer segment")
        if self.seg % self.steps_per_beat:
            raise ValueError(f"segments ({self.seg}) must hold whole beats of {self.steps_per_beat} steps")

    @property
    def seg(self) -> int:
        return segment_size(self.group, self.block)

    @property
    def field(self) -> int:
        return field_bits(self.seg)

    @property
    def step_bits(self) -> int:
        return 2 * self.cols * 4

    @property
    def wgt_ports(self) -> int:
        return max(1, self.step_bits // self.beat_bits)

    @property
    def port_step_bits(self) -> int:
        return self.step_bits // self.wgt_ports

    @property
    def steps_per_beat(self) -> int:
        return self.beat_bits // self.port_step_bits

    def nseg(self, cols: int) -> int:
        return -(-cols // self.seg)


def _nibbles_to_int(vals: np.ndarray) -> int:
    out = 0
    for i, v in enumerate(np.asarray(vals).tolist()):
        out |= (int(v) & 0xF) << (4 * i)
    return out


def tile_streams(geo: TileGeometry, q_w, scale_w, q_a, e_a) -> dict:
    """The beats the tile engine consumes for ``gemm`` of these operands, tile by tile (token tiles outer,
    row tiles inner; the activations of a token tile are re-sent for every row tile). Shapes that do not
    fill the array are padded with zero weights, zero activations, zero scales and zero exponents; K is
    padded to whole segments. Returns a dict of Python lists: ``cmd`` (segments per tile), ``wgt`` (one
    list of beat integers per port), ``act`` (per k-step, R INT8), ``exp`` (per block, R exponents),
    ``scale`` (per group, 2C binary16 bit patterns), and ``tiles`` (their (t0, r0) origins)."""
    q_w, q_a, seg = _check(q_w, scale_w, q_a, e_a, geo.group, geo.block)
    rows, cols = q_w.shape
    tokens = q_a.shape[0]
    R, N = geo.rows, 2 * geo.cols
    nseg = geo.nseg(cols)
    kp = nseg * seg
    ngroups, nblocks = -(-kp // geo.group), -(-kp // geo.block)
    sbits = np.asarray(scale_w, dtype=np.float16).view(np.uint16)
    out = {"cmd": [], "wgt": [[] for _ in range(geo.wgt_ports)], "act": [], "exp": [], "scale": [],
           "tiles": []}
    per_port = N // geo.wgt_ports
    for t0 in range(0, tokens, R):
        a = np.zeros((R, kp), dtype=np.int64)
        a[:min(R, tokens - t0), :cols] = q_a[t0:t0 + R]
        e = np.zeros((R, nblocks), dtype=np.int64)
        eb = np.asarray(e_a)[t0:t0 + R]
        e[:eb.shape[0], :eb.shape[1]] = eb
        for r0 in range(0, rows, N):
            out["tiles"].append((t0, r0))
            out["cmd"].append(nseg)
            w = np.zeros((N, kp), dtype=np.int64)
            w[:min(N, rows - r0), :cols] = q_w[r0:r0 + N]
            s = np.zeros((N, ngroups), dtype=np.int64)
            sb = sbits[r0:r0 + N]
            s[:sb.shape[0], :sb.shape[1]] = sb
            for p in range(geo.wgt_ports):
                part = w[p * per_port:(p + 1) * per_port]          # [per_port rows, kp]
                for k0 in range(0, kp, geo.steps_per_beat):
                    beat = part[:, k0:k0 + geo.steps_per_beat].T.reshape(-1)   # k-major, rows inside
                    out["wgt"][p].append(_nibbles_to_int(beat))
            out["act"].extend(a[:, k].tolist() for k in range(kp))
            out["exp"].extend(e[:, b].tolist() for b in range(nblocks))
            out["scale"].extend(s[:, g].tolist() for g in range(ngroups))
    return out


def untile_output(geo: TileGeometry, beats: list[list[int]], tokens: int, rows: int) -> np.ndarray:
    """Reassemble the engine's output beats (per tile, R beats of 2C binary32 bit patterns, in the order of
    `tile_streams`) into binary32 [tokens, rows]."""
    R, N = geo.rows, 2 * geo.cols
    y = np.zeros((tokens, rows), dtype=np.float32)
    it = iter(beats)
    for t0 in range(0, tokens, R):
        for r0 in range(0, rows, N):
            tile = np.array([next(it) for _ in range(R)], dtype=np.uint64).astype(np.uint32).view(np.float32)
            y[t0:t0 + R, r0:r0 + N] = tile[:min(R, tokens - t0), :min(N, rows - r0)]
    return y
