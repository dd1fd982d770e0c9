"""Weight packer: a Gemma 3n checkpoint (or any tensor mapping) -> one DDR memory image + a JSON manifest.

The image is what the NPU reads during a token (docs/architecture.md, "DDR memory map"):

==========  ==========================================================================================
region      contents
==========  ==========================================================================================
DESC        descriptor table, 32 bytes each: KV-cache slots first (ATTN/KVST address them with 8 bits),
            then one per weight matrix (or row chunk of one: the LM head is split to fit L2)
CONST       binary32 vectors and small matrices: norm gains, ``correct_output_scale``, the AltUp router,
            prediction and correction coefficients, RoPE frequency tables (in turns, two words each), and
            tensors derived from the checkpoint at pack time (`folded_router`)
WEIGHTS     INT4 matrices (two per byte, low nibble first) followed by their binary16 group scales
            (row-major [rows, groups]; group-major [groups, rows] for column-major matrices)
KV          the KV cache: per cache layer, ``capacity`` positions (sliding layers keep a ring of
            `sliding_window` positions; full layers `max_positions`); ``kv_format`` "fp16": K then V,
            binary16; "int8": INT4 planes and scales as `sim.numerics.KvInt8Layout` (the V planes'
            constant scales are the WEIGHTS entry ``kv.v_plane_scales``, the slots' scale offset)
LOGITS      the token's soft-capped logits, binary32
PROGRAM     the token program (written by the compiler)
==========  ==========================================================================================

Every region starts on a 4 KiB boundary. The manifest records every tensor (region, byte offset, shape,
format, layout, group, scale offset) and every descriptor; nothing about the layout is implicit.

Packing streams tensor by tensor, and large matrices in row chunks, into a NumPy array or a memory-mapped
file (`out`), so E4B (about 3.6 GB of image) packs without holding the model twice.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from hdl.config import HardwareConfig
from sim.config import ModelConfig
from sim.gemma3n import resolve_tensor_names
from sim.numerics import KvInt8Layout, pack_int4, quantize_weights, v_plane_scales

__all__ = ["Image", "TensorEntry", "Descriptor", "pack", "DESC_BYTES", "DescKind", "Layout",
           "rope_turn_table", "logit_chunk_rows", "logit_chunks", "ffn_pieces", "folded_router", "folded_router_name"]

ALIGN = 4096
DESC_BYTES = 32
CHUNK_BYTES = 64 * 2**20      # float64 working set of one quantisation chunk


class DescKind:
    INT4 = 0
    KV = 2


class Layout:
    ROW = 0       # row-major: row r is contiguous (cols/2 bytes)
    COL = 1       # column-major: column k is contiguous (rows/2 bytes); for sparse column skipping


@dataclass
class TensorEntry:
    name: str
    region: str
    offset: int                 # bytes from the region base
    shape: tuple
    format: str                 # "int4" | "fp32" | "fp16"
    layout: int = Layout.ROW
    group: int = 0
    scale_offset: int | None = None
    nbytes: int = 0
    scale_nbytes: int = 0


@dataclass
class Descriptor:
    index: int
    kind: int
    tensor: str                 # tensor name, or "kv:<layer>"
    row_start: int = 0
    rows: int = 0
    cols: int = 0
    weight_offset: int = 0      # bytes within WEIGHTS (or KV for slots)
    scale_offset: int = 0
    layout: int = Layout.ROW
    group: int = 0
    capacity: int = 0           # KV slots: positions held
    heads: int = 0              # KV slots: KV heads
    head_dim: int = 0

    def to_bytes(self) -> bytes:
        """32 bytes, little-endian: u64 weight_offset, u64 scale_offset, u32 rows, u32 cols,
        u8 kind, u8 layout, u8 log2(group), u8 heads, u16 head_dim, u16 reserved. KV slots store their
        capacity in `rows` and K/V width in `cols` (heads * head_dim); their `layout` is the cache format (0
        binary16, 1 INT8 planes) and, for INT8, `scale_offset` the WEIGHTS offset of the V planes' scales."""
        rows = self.capacity if self.kind == DescKind.KV else self.rows
        cols = self.heads * self.head_dim if self.kind == DescKind.KV else self.cols
        glog = int(math.log2(self.group)) if self.group else 0
        return struct.pack("<QQIIBBBBHH", self.weight_offset, self.scale_offset, rows, cols, self.kind,
                           self.layout, glog, self.heads, self.head_dim, 0)


@dataclass
class Image:
    """A packed DDR image and its manifest."""
    ddr: np.ndarray                                   # uint8, the whole image
    regions: dict[str, tuple[int, int]]               # name -> (base, size)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    descriptors: list[Descriptor] = field(default_factory=list)
    kv_slots: dict[int, int] = field(default_factory=dict)         # cache layer -> descriptor index
    config: dict = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)
    const64: dict[str, np.ndarray] = field(default_factory=dict)   # CONST entries' exact (float64) values
    scalar_index: dict[str, int] = field(default_factory=dict)     # name -> element of the "scalars" entry

    def region(self, name: str) -> tuple[int, int]:
        return self.regions[name]

    def view(self, region: str, offset: int, nbytes: int) -> np.ndarray:
        base, size = self.regions[region]
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"{region} access [{offset}, {offset + nbytes}) is outside the region ({size} bytes)")
        return self.ddr[base + offset: base + offset + nbytes]

    def descriptor(self, tensor: str, row_start: int = 0, rows: int | None = None) -> Descriptor:
        """The descriptor of `tensor` starting at `row_start` (and covering `rows` rows, if given)."""
        for d in self.descriptors:
            if d.tensor == tensor and d.row_start == row_start and (rows is None or d.rows == rows):
                return d
        raise KeyError(f"no descriptor for {tensor!r} at row {row_start}" + (f" with {rows} rows" if rows else ""))

    def matrices(self) -> dict[str, Descriptor]:
        """Tensor name -> the descriptor of the whole matrix (not its row chunks or pieces), every INT4 matrix."""
        out = {}
        for d in self.descriptors:
            if d.kind == DescKind.INT4 and d.row_start == 0 and d.rows == self.tensors[d.tensor].shape[0]:
                out.setdefault(d.tensor, d)
        return out

    def manifest(self) -> dict:
        return {
            "format": "gemma3n-npu-image/1",
            "regions": {k: {"base": b, "size": s} for k, (b, s) in self.regions.items()},
            "region_bytes_used": self.region_usage(),
            "tensors": {k: {**asdict(v), "shape": list(v.shape)} for k, v in self.tensors.items()},
            "descriptors": [asdict(d) for d in self.descriptors],
            "kv_slots": {str(k): v for k, v in self.kv_slots.items()},
            "config": self.config,
            "hardware": self.hardware,
        }

    def region_usage(self) -> dict[str, int]:
        used = {k: 0 for k in self.regions}
        for t in self.tensors.values():
            used[t.region] += t.nbytes + t.scale_nbytes
        used["DESC"] = len(self.descriptors) * DESC_BYTES
        return used

    def write_manifest(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.manifest(), f, indent=1)


def rope_turn_table(theta: float, head_dim: int) -> np.ndarray:
    """RoPE frequencies in turns, ``f_j = theta^(-2j/d) / (2 pi)``, j < d/2, as unsigned 0.64 fixed point
    split into two 32-bit words (high, low) per entry: the SFU multiplies by the integer position exactly
    and keeps the fraction, so the phase stays accurate at any position (numerics contract)."""
    j = np.arange(head_dim // 2, dtype=np.float64)
    f = theta ** (-2.0 * j / head_dim) / (2.0 * math.pi)
    fixed = [int(round(math.ldexp(v, 64))) for v in f]
    words = np.array([[x >> 32, x & 0xFFFFFFFF] for x in fixed], dtype=np.uint32)
    return words.reshape(-1)


def logit_chunk_rows(cfg: ModelConfig, hw: HardwareConfig) -> int:
    """The most LM-head rows computed per WGEMV: one chunk of logits takes at most a quarter of L2 and fits the
    16-bit length of the CVO that soft-caps it."""
    return min(cfg.vocab_size, hw.l2_bytes // 16, 1 << 15)


def logit_chunks(cfg: ModelConfig, hw: HardwareConfig) -> list[tuple[int, int]]:
    """``(row_start, rows)`` of the LM head's WGEMVs. A chunk's soft-cap and store (about two cycles per row:
    a CVO and a DMA at one element per cycle) run under the next chunk's weight stream, so only the last
    chunk's finish waits. A row streams in about ``k = row bytes // (2 x ports x beat bytes)`` times as long as it
    finishes (E4B on kv260: 1,056 // 128 = 8), so with ``k >= 2`` the chunks end in a tail that shrinks by k
    while it stays at least 64 rows: each hides the one before it (E4B: 28,352, 7 x 32,768, then 4,096, 512 and
    64 rows; the last finish is ~340 cycles instead of ~66k). Chunks start on whole L2 words (the DMA's
    16-byte offsets): the rows beyond a multiple of four go to the last chunk. Otherwise (or with the whole
    vocabulary in one chunk) chunks of `logit_chunk_rows`, the remainder last."""
    C, S, D = logit_chunk_rows(cfg, hw), cfg.vocab_size, cfg.hidden_size
    row_bytes = (D + 1) // 2 + -(-D // (hw.weight_group or D)) * 2
    k = row_bytes // (2 * hw.axi_ports * hw.bytes_per_beat)
    tail, size = [], C
    while S > C and k >= 2 and size // k // 4 * 4 >= 64:
        size = size // k // 4 * 4
        tail.append(size)
    if not tail:
        return [(r0, min(C, S - r0)) for r0 in range(0, S, C)]
    rest = S - sum(tail)
    sizes = ([rest % C // 4 * 4] if rest % C >= 4 else []) + [C] * (rest // C) + tail
    sizes[-1] += S - sum(sizes)
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    return list(zip(starts, sizes))


def ffn_pieces(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """``(row_start, rows)`` of the pieces the up projection of layer `layer` runs in (one WGEMV each, with their
    own descriptors). The compiler runs GELU(gate) * up of a piece under the next piece's weight stream
    (firmware.compiler), so only the last piece's GELU * up waits: with ``F % 128 == 0`` four quarters, the last one
    split into ``F/4 - F/32`` and a tail of ``F/32`` rows (the tail's stream hides the piece before it while
    D >= ~800 at the kv260's rates; E4B: 3,584 + 199 cycles of GELU under 512 rows' 9.4k of stream); else four
    quarters when they come in whole L2 words, else two halves, else one piece."""
    f = cfg.intermediate_size[layer]
    if f % 128 == 0:
        q, t = f // 4, f // 32
        sizes = [q, q, q, q - t, t]
    elif f % 16 == 0:
        sizes = [f // 4] * 4
    elif f % 8 == 0:
        sizes = [f // 2] * 2
    else:
        sizes = [f]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return list(zip(starts, sizes))


def _row_pieces(cfg: ModelConfig, hw: HardwareConfig, name: str, rows: int) -> list[tuple[int, int]]:
    """``(row_start, rows)`` of the extra descriptors of matrix `name`: the LM head's chunks, the FFN up
    projection's pieces; none for the rest."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        out = logit_chunks(cfg, hw)
    elif name.endswith("mlp.up_proj.weight"):
        out = ffn_pieces(cfg, int(name.split(".")[1]))
    else:
        return []
    return [] if out == [(0, rows)] else out


def folded_router_name(layer: int) -> str:
    """The CONST entry of layer `layer`'s AltUp router with the router-norm gain folded in (`folded_router`)."""
    return f"layers.{layer}.altup.modality_router_folded"


def folded_router(cfg: ModelConfig, layer: int, router, gain) -> np.ndarray:
    """``W'[j, k] = W[j, k] * g[k]`` in float64: layer `layer`'s ``altup.modality_router.weight`` [n, D] with
    ``altup.router_norm.weight`` [D] folded into its columns, so that the router
    ``tanh(W (rmsnorm(x) * g / D))`` is ``tanh((W' x) * (mean(x^2) + eps)^-1/2 / D)``: one SUMSQ and n DOTs
    over the raw x, no normalised copy of it. The packer stores it once rounded to binary32."""
    p = f"layers.{layer}.altup."
    w, g = np.asarray(router, dtype=np.float64), np.asarray(gain, dtype=np.float64)
    for name, v, shape in (("modality_router.weight", w, (cfg.altup_num_inputs, cfg.hidden_size)),
                           ("router_norm.weight", g, (cfg.hidden_size,))):
        if v.shape != shape:
            raise ValueError(f"tensor {p + name!r} has shape {v.shape}; expected {shape}")
    return w * g


def scalar_constants(cfg: ModelConfig) -> tuple[dict[str, int], np.ndarray]:
    """The model's scalar constants, in one CONST vector (float64 here; binary32 in the image), and the
    index of each: programs load them with SCALAR LD instead of rounding them into immediates."""
    from sim.gemma3n import gaussian_std_multiplier

    named = {
        "embed_scale": math.sqrt(cfg.hidden_size),
        "ple_embed_scale": math.sqrt(cfg.hidden_size_per_layer_input),
        "ple_proj_scale": cfg.hidden_size ** -0.5,
        "inv_sqrt2": 1.0 / math.sqrt(2.0),
        "inv_hidden": 1.0 / cfg.hidden_size,
        "eps": cfg.rms_norm_eps,
        "mag_floor": 1e-5,
        "softcap": cfg.final_logit_softcapping or 0.0,
        "inv_streams": 1.0 / cfg.altup_num_inputs,
        "one": 1.0,
        "minus_one": -1.0,
    }
    for i, s in enumerate(cfg.activation_sparsity_pattern):
        named[f"std_mult.{i}"] = gaussian_std_multiplier(s) if s > 0 else 0.0
        named[f"inv_ffn.{i}"] = 1.0 / cfg.intermediate_size[i]
    index = {k: n for n, k in enumerate(named)}
    return index, np.array(list(named.values()), dtype=np.float64)


def _is_const(name: str, shape) -> bool:
    return len(shape) == 1 or name.endswith(("prediction_coefs.weight", "correction_coefs.weight",
                                             "modality_router.weight"))


def _layout(cfg: ModelConfig, name: str) -> int:
    if name.endswith("mlp.down_proj.weight"):
        layer = int(name.split(".")[1])
        if cfg.activation_sparsity_pattern[layer] > 0:
            return Layout.COL
    return Layout.ROW


def _group(hw: HardwareConfig, cols: int) -> int:
    g = hw.weight_group or cols
    return min(g, 1 << (cols - 1).bit_length()) if cols < g else g


class _Allocator:
    def __init__(self):
        self.sizes: dict[str, int] = {}

    def take(self, region: str, nbytes: int, align: int = 16) -> int:
        off = -(-self.sizes.get(region, 0) // align) * align
        self.sizes[region] = off + nbytes
        return off


def pack(config: Mapping | ModelConfig, tensors: Mapping | None, hw: HardwareConfig, *,
         max_positions: int | None = None, program_bytes: int = 1 << 20, out: str | os.PathLike | None = None,
         progress=None, fill: bool = True) -> Image:
    """Pack `tensors` (Hugging Face names, any prefix, ``[out, in]``; arrays or lazy tensors) for
    hardware `hw`. `max_positions` bounds the KV cache of full-attention layers (default: the model's
    ``max_position_embeddings``). With `out`, the image is a memory-mapped file at that path. With
    ``fill=False`` (and `tensors` None) only the layout is planned: regions, descriptors and manifest,
    over an image of zeros that the OS does not back until written (for byte counts of E4B)."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    if tensors is None:
        if fill:
            raise ValueError("pack needs tensors unless fill=False")
        tensors = {name: _Shape(shape) for name, shape in cfg.tensor_shapes().items()}
    max_positions = cfg.max_position_embeddings if max_positions is None else max_positions
    expected = cfg.tensor_shapes()
    by_name = resolve_tensor_names(cfg, tensors)

    # --- plan: every entry and descriptor, then allocate the image once -----------------------------
    alloc = _Allocator()
    entries: dict[str, TensorEntry] = {}
    descs: list[Descriptor] = []
    kv_slots = {}
    int8_kv = hw.kv_format == "int8"
    vscale_off = 0
    if int8_kv:
        n = 2 * cfg.head_dim * 2
        vscale_off = alloc.take("WEIGHTS", n, 64)
        entries["kv.v_plane_scales"] = TensorEntry("kv.v_plane_scales", "WEIGHTS", vscale_off,
                                                   (2, cfg.head_dim), "fp16", nbytes=n)
    for layer in cfg.kv_cache_layers:
        cap = cfg.sliding_window if cfg.is_sliding(layer) else max_positions
        cap = min(cap, max_positions)
        if int8_kv:
            nbytes = KvInt8Layout(cap, cfg.num_key_value_heads, cfg.head_dim, hw.act_block).nbytes
        else:
            nbytes = 2 * cap * cfg.kv_dim * 2   # K and V, binary16
        off = alloc.take("KV", nbytes, 64)
        kv_slots[layer] = len(descs)
        descs.append(Descriptor(len(descs), DescKind.KV, f"kv:{layer}", weight_offset=off, capacity=cap,
                                heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, scale_offset=vscale_off,
                                layout=int(int8_kv)))
    if len(descs) > 256:
        raise ValueError(f"{len(descs)} KV cache layers do not fit the 8-bit slot field of ATTN/KVST")
    for name, shape in expected.items():
        if _is_const(name, shape):
            n = math.prod(shape) * 4
            entries[name] = TensorEntry(name, "CONST", alloc.take("CONST", n), shape, "fp32", nbytes=n)
            continue
        rows, cols = shape
        group = _group(hw, cols)
        layout = _layout(cfg, name)
        if layout == Layout.COL and rows % 2:
            raise ValueError(f"column-major {name!r} needs an even number of rows, not {rows}")
        pcols = cols + cols % 2
        nbytes = rows * pcols // 2
        ngroups = -(-cols // group)
        off = alloc.take("WEIGHTS", nbytes, 64)
        soff = alloc.take("WEIGHTS", rows * ngroups * 2, 64)
        entries[name] = TensorEntry(name, "WEIGHTS", off, shape, "int4", layout, group, soff, nbytes,
                                    rows * ngroups * 2)
        # One descriptor for the whole matrix (GEMVs, and row gathers from embedding tables); the LM head
        # also gets one per chunk of rows, the FFN up projection one per piece (`_row_pieces`).
        descs.append(Descriptor(len(descs), DescKind.INT4, name, 0, rows, cols, off, soff, layout, group))
        for r0, n in _row_pieces(cfg, hw, name, rows):
            assert layout == Layout.ROW, "row chunks of a column-major matrix have no contiguous scales"
            descs.append(Descriptor(len(descs), DescKind.INT4, name, r0, n, cols,
                                    off + r0 * pcols // 2, soff + r0 * ngroups * 2, layout, group))
    folded = {folded_router_name(i): i for i in range(cfg.num_hidden_layers)}    # derived: name -> layer
    n = cfg.altup_num_inputs * cfg.hidden_size * 4
    for name in folded:
        entries[name] = TensorEntry(name, "CONST", alloc.take("CONST", n), (cfg.altup_num_inputs, cfg.hidden_size),
                                    "fp32", nbytes=n)
    for theta_name in ("rope.sliding", "rope.full"):
        n = cfg.head_dim // 2 * 8
        entries[theta_name] = TensorEntry(theta_name, "CONST", alloc.take("CONST", n), (cfg.head_dim // 2, 2),
                                          "u0.64", nbytes=n)
    scalar_index, scalars = scalar_constants(cfg)
    entries["scalars"] = TensorEntry("scalars", "CONST", alloc.take("CONST", scalars.size * 4), scalars.shape,
                                     "fp32", nbytes=scalars.size * 4)
    alloc.take("DESC", len(descs) * DESC_BYTES)
    alloc.take("LOGITS", cfg.vocab_size * 4)
    alloc.take("PROGRAM", program_bytes)
    alloc.take("SCRATCH", 4096)
    regions = {}
    base = 0
    for name in ("DESC", "CONST", "WEIGHTS", "KV", "LOGITS", "SCRATCH", "PROGRAM"):
        size = -(-max(alloc.sizes.get(name, 0), 1) // ALIGN) * ALIGN
        regions[name] = (base, size)
        base += size
    if out is None:
        ddr = np.zeros(base, dtype=np.uint8)
    else:
        ddr = np.lib.format.open_memmap(os.fspath(out), mode="w+", dtype=np.uint8, shape=(base,))
    image = Image(ddr, regions, entries, descs, kv_slots, cfg.to_hf(), hw.to_dict(), scalar_index=scalar_index)

    # --- fill ----------------------------------------------------------------------------------------
    for i, d in enumerate(descs):
        image.view("DESC", i * DESC_BYTES, DESC_BYTES)[:] = np.frombuffer(d.to_bytes(), np.uint8)
    if not fill:
        return image
    names = list(entries)
    for n_done, name in enumerate(names):
        e = entries[name]
        if progress is not None:
            progress(n_done, len(names), name)
        if name == "kv.v_plane_scales":
            image.view("WEIGHTS", e.offset, e.nbytes)[:] = v_plane_scales(cfg.head_dim).astype("<f2").view(np.uint8).reshape(-1)
        elif e.format == "u0.64":
            table = rope_turn_table(cfg.rope_theta_sliding if name == "rope.sliding" else cfg.rope_theta_full,
                                    cfg.head_dim)
            image.view("CONST", e.offset, e.nbytes)[:] = table.astype("<u4").view(np.uint8)
            image.const64[name] = table.astype(np.float64)
        elif e.format == "fp32":
            if name == "scalars":
                v = scalars
            elif name in folded:
                p = f"layers.{folded[name]}.altup."
                v = folded_router(cfg, folded[name], _load(tensors[by_name[p + "modality_router.weight"]]),
                                  _load(tensors[by_name[p + "router_norm.weight"]]))
            else:
                v = np.asarray(_load(tensors[by_name[name]]), dtype=np.float64)
            image.view("CONST", e.offset, e.nbytes)[:] = v.astype("<f4").reshape(-1).view(np.uint8)
            image.const64[name] = v.reshape(-1)
        else:
            _pack_int4_tensor(image, e, tensors[by_name[name]])
    if progress is not None:
        progress(len(names), len(names), "")
    return image


class _Shape:
    """A stand-in tensor that only has a shape (layout planning without weights)."""

    def __init__(self, shape):
        self.shape = tuple(shape)


def _load(value):
    return value.load() if hasattr(value, "load") else np.asarray(value)


def _rows(value, r0, r1):
    return value.rows(r0, r1) if hasattr(value, "rows") else np.asarray(value[r0:r1])


def _pack_int4_tensor(image: Image, e: TensorEntry, value) -> None:
    rows, cols = e.shape
    pcols = cols + cols % 2
    ngroups = -(-cols // e.group)
    step = max(1, CHUNK_BYTES // (8 * cols)) if e.layout == Layout.ROW else rows
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = np.asarray(_rows(value, r0, r1), dtype=np.float64)
        q, s = quantize_weights(w, e.group)
        if e.layout == Layout.ROW:
            qp = np.pad(q, ((0, 0), (0, pcols - cols)))
            image.view("WEIGHTS", e.offset + r0 * pcols // 2, (r1 - r0) * pcols // 2)[:] = pack_int4(qp).reshape(-1)
        else:
            image.view("WEIGHTS", e.offset, e.nbytes)[:] = pack_int4(np.ascontiguousarray(q.T)).reshape(-1)
        if e.layout == Layout.ROW:       # row-major [rows, groups]: a row's scales with the row
            image.view("WEIGHTS", e.scale_offset + r0 * ngroups * 2, (r1 - r0) * ngroups * 2)[:] = \
                s.astype("<f2").reshape(-1).view(np.uint8)
        else:                            # group-major [groups, rows]: a column pass reads group g's scales
            image.view("WEIGHTS", e.scale_offset, e.scale_nbytes)[:] = \
                np.ascontiguousarray(s.T).astype("<f2").reshape(-1).view(np.uint8)
