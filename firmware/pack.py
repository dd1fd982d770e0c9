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
            `ring_rows` positions, the window and a program's further tokens; full layers `max_positions`);
            ``kv_format`` "fp16": K then V,
            binary16; "int8": INT4 planes and scales as `sim.numerics.KvInt8Layout` (the V planes'
            constant scales are the WEIGHTS entry ``kv.v_plane_scales``, the slots' scale offset)
LOGITS      the token's soft-capped logits, binary32
PROGRAM     the token program (written by the compiler)
==========  ==========================================================================================

Every region starts on a 4 KiB boundary. The manifest records every tensor (region, byte offset, shape,
format, layout, group, scale offset) and every descriptor; nothing about the layout is implicit.

Memory maps (`hdl.memory_map`). The image is placed in the windows of a memory map: ``flat`` (one window
at address 0: the regions follow each other, the host adds its DDR base) or a board's reserved windows
(``kv260``: two windows, one in each 2 GiB bank, the high one above 4 GB). Every region but WEIGHTS lies
in one window; WEIGHTS is split between windows at tensor boundaries (a matrix's INT4 bytes and its scales
are each contiguous), since the descriptors address it by 64-bit offsets from WEIGHTS_BASE, the lowest
address of any of its pieces. Region bases are physical (link) addresses; `Image.ddr` holds the used
part of each window, one after the other (`Image.windows`), and the host writes each to its window
(relocating if a window lies elsewhere: `firmware.runtime`).

PLE staging. With a map's ``ple_staged`` (kv260) the per-layer embedding table (E4B: 1.18 GB, of which a
token reads one 4.5 KB row) is not in DDR: the image holds a staged row per token of a program
(`staging_slots`, a descriptor of one row each, so GATHER's PLE remap rule reads it for any token; the
decode program reads slot 0) and the whole table is a host table
(`Image.host_tables`, rows of INT4 bytes followed by their binary16 scales, quantised exactly as in
DDR); the host copies the token's row into place before every START (`Image.stage_rows`).

Packing streams tensor by tensor, and large matrices in row chunks, into a NumPy array or a memory-mapped
file (`out`), so E4B (about 3.6 GB of image) packs without holding the model twice.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from hdl.config import HardwareConfig
from hdl.isa import DESC_BYTES, DESCRIPTOR, DescKind
from hdl.memory_map import MemoryMap, memory_map as _memory_map
from sim.config import ModelConfig, check_positive_int
from sim.gemma3n import check_weight_dtype, check_weight_values, resolve_tensor_names
from sim.numerics import WEIGHT_METHODS, KvInt8Layout, pack_int4, quantize_weights, v_plane_scales

__all__ = ["Image", "TensorEntry", "Descriptor", "Placement", "HostTable", "pack", "save_image", "load_image",
           "region_map", "DESC_BYTES", "DescKind", "Layout", "REGION_ORDER", "PLE_TABLE",
           "rope_turn_table", "logit_stride", "kv_slot_name", "kv_row_ranges",
           "kv_slot_bytes", "ring_rows", "logit_chunk_rows", "logit_chunks", "head_tokens", "ffn_pieces",
           "folded_router", "folded_router_name"]

ALIGN = 4096
REGION_ORDER = ("DESC", "CONST", "WEIGHTS", "KV", "LOGITS", "SCRATCH", "PROGRAM")
PLE_TABLE = "embed_tokens_per_layer.weight"     # the table a map with ``ple_staged`` keeps on the host
IMAGE_FORMAT = "gemma3n-npu-image/3"
CHUNK_BYTES = 64 * 2**20      # float64 working set of one quantisation chunk


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
    staged: bool = False        # a host table: DDR holds the rows the host stages (`Image.stage_rows`)


@dataclass(frozen=True)
class Placement:
    """The used part of one memory-map window: ``[base, base + size)`` holds ``Image.ddr[ddr_offset:][:size]``."""
    window: str
    base: int
    size: int
    ddr_offset: int

    @property
    def end(self) -> int:
        return self.base + self.size


@dataclass
class HostTable:
    """A table the host keeps (PLE staging): ``data[r]`` is row r's INT4 bytes then its binary16 scales."""
    name: str
    data: np.ndarray                  # uint8 [rows, row_bytes + scale_bytes]
    row_bytes: int
    scale_bytes: int


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
        """The descriptor as the NPU reads it: `hdl.isa.DESCRIPTOR`, 32 bytes little-endian."""
        kv = self.kind == DescKind.KV
        bits = DESCRIPTOR.const({
            "weight_offset": self.weight_offset, "scale_offset": self.scale_offset,
            "rows": self.capacity if kv else self.rows, "cols": self.heads * self.head_dim if kv else self.cols,
            "kind": DescKind(self.kind), "layout": self.layout,
            "log2_group": int(math.log2(self.group)) if self.group else 0,
            "heads": self.heads, "head_dim": self.head_dim}).as_bits()
        return bits.to_bytes(DESC_BYTES, "little")


@dataclass
class Image:
    """A packed DDR image and its manifest.

    `regions` maps each region to ``(base, size)``: its physical (link) address in the memory map and its
    size (WEIGHTS split over windows: the span from its lowest to its highest byte; `pieces` lists what it
    holds in each window). `windows` says where each part of `ddr` goes."""
    ddr: np.ndarray                                   # uint8: the used part of every window, in map order
    regions: dict[str, tuple[int, int]]               # name -> (base address, size)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    descriptors: list[Descriptor] = field(default_factory=list)
    kv_slots: dict[int, int] = field(default_factory=dict)         # cache layer -> descriptor index
    config: dict = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)
    const64: dict[str, np.ndarray] = field(default_factory=dict)   # CONST entries' exact (float64) values
    scalar_index: dict[str, int] = field(default_factory=dict)     # name -> element of the "scalars" entry
    windows: list[Placement] = field(default_factory=list)
    pieces: dict[str, list[tuple[int, int]]] = field(default_factory=dict)   # region -> [(address, bytes)]
    memory_map: str = "flat"
    host_tables: dict[str, HostTable] = field(default_factory=dict)
    quantizer: str = "search"                         # how the INT4 codes and scales were chosen (`pack`)
    # per stream (batched decode): cache layer -> descriptor index; stream 0's is `kv_slots`
    stream_slots: list[dict[int, int]] = field(default_factory=list)

    def __post_init__(self):
        if not self.stream_slots:
            self.stream_slots = [self.kv_slots]
        if not self.windows:          # one window at address 0 holding the whole array
            self.windows = [Placement("ddr", 0, int(self.ddr.size), 0)]
        if not self.pieces:
            self.pieces = {k: [v] for k, v in self.regions.items()}

    @property
    def streams(self) -> int:
        """The independent sequences the image has KV slots for."""
        return len(self.stream_slots)

    @property
    def logit_rows(self) -> int:
        """The tokens' logits rows the LOGITS region holds (`logit_stride` elements apart)."""
        return self.regions["LOGITS"][1] // (4 * logit_stride(ModelConfig.from_hf(self.config)))

    def region(self, name: str) -> tuple[int, int]:
        return self.regions[name]

    def ddr_offset(self, addr: int, nbytes: int) -> int:
        """Where the bytes ``[addr, addr + nbytes)`` of the memory map lie in `ddr` (one window holds them)."""
        for w in self.windows:
            if w.base <= addr and addr + nbytes <= w.end:
                return w.ddr_offset + addr - w.base
        raise ValueError(f"[{addr:#x}, {addr + nbytes:#x}) lies in no single window of the image "
                         f"({', '.join(f'{w.window} [{w.base:#x}, {w.end:#x})' for w in self.windows)})")

    def at(self, addr: int, nbytes: int) -> np.ndarray:
        """The image's bytes at physical (link) addresses ``[addr, addr + nbytes)``."""
        off = self.ddr_offset(addr, nbytes)
        return self.ddr[off:off + nbytes]

    def view(self, region: str, offset: int, nbytes: int) -> np.ndarray:
        base, size = self.regions[region]
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"{region} access [{offset}, {offset + nbytes}) is outside the region ({size} bytes)")
        return self.at(base + offset, nbytes)

    def window_bytes(self, window: str) -> np.ndarray:
        """The bytes the image puts in `window` (a view of `ddr`)."""
        w = next(p for p in self.windows if p.window == window)
        return self.ddr[w.ddr_offset:w.ddr_offset + w.size]

    @property
    def staging_slots(self) -> int:
        """Tokens a program may run at once as far as the host tables go: their staging slots (no host table:
        no limit, reported as 0)."""
        return min((sum(d.tensor == name for d in self.descriptors) for name in self.host_tables), default=0)

    def stage_rows(self, token: int, slot: int = 0) -> list[tuple[str, int, np.ndarray]]:
        """``(region, offset, bytes)`` the host writes before running `token` as token `slot` of a program:
        for every host table, the row GATHER reads for it (row 0 for an id beyond the table: the PLE remap
        rule), bytes then scales, into staging slot `slot`."""
        out = []
        for name, t in self.host_tables.items():
            e = self.tensors[name]
            row = t.data[token if 0 <= token < t.data.shape[0] else 0]
            out.append((e.region, e.offset + slot * t.row_bytes, row[:t.row_bytes]))
            out.append((e.region, e.scale_offset + slot * t.scale_bytes, row[t.row_bytes:]))
        return out

    def descriptor(self, tensor: str, row_start: int = 0, rows: int | None = None) -> Descriptor:
        """The descriptor of `tensor` starting at `row_start` (and covering `rows` rows, if given)."""
        for d in self.descriptors:
            if d.tensor == tensor and d.row_start == row_start and (rows is None or d.rows == rows):
                return d
        raise KeyError(f"no descriptor for {tensor!r} at row {row_start}" + (f" with {rows} rows" if rows else ""))

    def matrices(self) -> dict[str, Descriptor]:
        """Tensor name -> the descriptor of the whole matrix (not its row chunks or pieces), every INT4 matrix
        held whole in DDR (a staged host table is not)."""
        out = {}
        for d in self.descriptors:
            if d.kind == DescKind.INT4 and d.row_start == 0 and d.rows == self.tensors[d.tensor].shape[0]:
                out.setdefault(d.tensor, d)
        return out

    def manifest(self) -> dict:
        return {
            "format": IMAGE_FORMAT,
            "memory_map": self.memory_map,
            "quantizer": self.quantizer,
            "regions": {k: {"base": b, "size": s} for k, (b, s) in self.regions.items()},
            "pieces": {k: [list(p) for p in v] for k, v in self.pieces.items()},
            "windows": [asdict(w) for w in self.windows],
            "region_bytes_used": self.region_usage(),
            "tensors": {k: {**asdict(v), "shape": list(v.shape)} for k, v in self.tensors.items()},
            "descriptors": [asdict(d) for d in self.descriptors],
            "kv_slots": {str(k): v for k, v in self.kv_slots.items()},
            "stream_slots": [{str(k): v for k, v in slots.items()} for slots in self.stream_slots],
            "scalar_index": self.scalar_index,
            "host_tables": {k: {"rows": int(t.data.shape[0]), "row_bytes": t.row_bytes,
                                "scale_bytes": t.scale_bytes} for k, t in self.host_tables.items()},
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


def logit_stride(cfg: ModelConfig) -> int:
    """Elements from one token's logits row to the next in LOGITS: the vocabulary in whole 16-byte words (the
    DMA's offsets)."""
    return -(-cfg.vocab_size // 4) * 4


def kv_slot_name(layer: int, stream: int = 0) -> str:
    """The descriptor name of cache layer `layer`'s KV slot of stream `stream`."""
    return f"kv:{layer}" if stream == 0 else f"kv:{layer}:{stream}"


def _kv_int8_layout(image: "Image", d) -> KvInt8Layout:
    """The INT8 layout of KV slot descriptor `d` (its `layout` 1: V planes, 2: V rows)."""
    return KvInt8Layout(d.capacity, d.heads, d.head_dim, image.hardware["act_block"],
                        "rows" if d.layout == 2 else "planes")


def kv_row_ranges(image: "Image", slot: int, row: int) -> list[tuple[int, int]]:
    """``(offset in KV, bytes)`` of every byte KVST writes into ring row `row` of KV slot `slot` (descriptor
    index): INT8 (`sim.numerics.KvInt8Layout`), per head its two K plane rows, its V (two plane columns, or a
    byte in each V row), its two K scale rows and its V scale; binary16, the K row and the V row."""
    d = image.descriptors[slot]
    if d.kind != DescKind.KV or not 0 <= row < d.capacity:
        raise ValueError(f"descriptor {slot} is not a KV slot with a ring row {row}")
    if d.layout:
        lay = _kv_int8_layout(image, d)
        half, ks = d.head_dim // 2, lay.kblocks * 2
        out = []
        for j in range(d.heads):
            out += [(at(j) + row * half, half) for at in (lay.k_hi, lay.k_lo)] + lay.v_row_ranges(j, row)
            out += [(at(j) + row * ks, ks) for at in (lay.ks_hi, lay.ks_lo)]
            out.append((lay.vs(j) + 2 * row, 2))
        return [(d.weight_offset + off, n) for off, n in out]
    w = d.heads * d.head_dim * 2
    return [(d.weight_offset + row * w, w), (d.weight_offset + (d.capacity + row) * w, w)]


def kv_slot_bytes(image: "Image", slot: int) -> int:
    """The bytes of KV slot `slot` (descriptor index) from its offset in KV: the INT8 layout's, or K and V rows of
    binary16."""
    d = image.descriptors[slot]
    if d.kind != DescKind.KV:
        raise ValueError(f"descriptor {slot} is not a KV slot")
    if d.layout:
        return _kv_int8_layout(image, d).nbytes
    return 2 * d.capacity * d.heads * d.head_dim * 2


def logit_chunk_rows(cfg: ModelConfig, hw: HardwareConfig, tokens: int = 1) -> int:
    """The most LM-head rows computed per WGEMV: one chunk of logits takes at most a quarter of L2 and fits the
    16-bit length of the CVO that soft-caps it. With `tokens` > 1, the rows per token of a WGEMM that computes
    a chunk for that many tokens in the same room (their rows token after token, each on whole L2 words)."""
    rows = min(cfg.vocab_size, hw.l2_bytes // 16, 1 << 15)
    return rows if tokens == 1 else max(4, rows // tokens // 4 * 4)


def head_tokens(hw: HardwareConfig) -> int:
    """The most tokens one LM-head WGEMM computes (`logit_chunks` with that many tokens has its descriptors):
    `gemv_vectors` where the GEMV engine runs WGEMM, its tokens sharing one weight stream; 1 (every token's
    logits WGEMVs of their own) on an NPU with the GEMM unit, which re-streams the weights per tile."""
    return hw.gemv_vectors


def logit_chunks(cfg: ModelConfig, hw: HardwareConfig, tokens: int = 1) -> list[tuple[int, int]]:
    """``(row_start, rows)`` of the LM head's WGEMVs. A chunk's soft-cap and store (about two cycles per row:
    a CVO and a DMA at one element per cycle) run under the next chunk's weight stream, so only the last
    chunk's finish waits. A row streams in about ``k = row bytes // (2 x ports x beat bytes)`` times as long as it
    finishes (E4B on kv260: 1,056 // 128 = 8), so with ``k >= 2`` the chunks end in a tail that shrinks by k
    while it stays at least 64 rows: each hides the one before it (E4B: 28,352, 7 x 32,768, then 4,096, 512 and
    64 rows; the last finish is ~340 cycles instead of ~66k). Chunks start on whole L2 words (the DMA's
    16-byte offsets): the rows beyond a multiple of four go to the last chunk. Otherwise (or with the whole
    vocabulary in one chunk) chunks of `logit_chunk_rows`, the remainder last. With `tokens` > 1: the chunks of
    a WGEMM of that many tokens (`logit_chunk_rows`), whose finish is `tokens` times as long (k / tokens)."""
    C, S, D = logit_chunk_rows(cfg, hw, tokens), cfg.vocab_size, cfg.hidden_size
    row_bytes = (D + 1) // 2 + -(-D // (hw.weight_group or D)) * 2
    k = row_bytes // (2 * hw.axi_ports * hw.bytes_per_beat * tokens)
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


def ring_rows(cfg: ModelConfig, hw: HardwareConfig) -> int:
    """Rows of a sliding-window layer's KV ring: the window and one more per further token a program may run
    (`HardwareConfig.gemm_tile` - 1), so that a program's tokens all stored in the ring replace no row its
    first token still attends to (a layer sharing this KV cache reads it after them: `firmware.compiler.
    multi_token_limit`). ATTN reads the window's positions from the oldest one's slot on (`sim.plan.attn_pieces`)."""
    return cfg.sliding_window + hw.gemm_tile - 1


def staging_slots(hw: HardwareConfig) -> int:
    """Staging slots of a staged host table: one per token of a WGEMM token tile (`HardwareConfig.gemm_tile`),
    the most a prefill program runs at once (`firmware.compiler.compile_tokens`)."""
    return hw.gemm_tile


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
        if head_tokens(hw) > 1:          # and the chunks of the multi-token LM head's WGEMMs
            out += [c for c in logit_chunks(cfg, hw, head_tokens(hw)) if c not in out]
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
    """Byte offsets within each region, in allocation order; every allocation is remembered (`items`), so that
    a region split between windows can be placed item by item (`_place`)."""

    def __init__(self):
        self.sizes: dict[str, int] = {}
        self.items: dict[str, list[tuple[int, int, int]]] = {}       # region -> [(offset, bytes, align)]

    def take(self, region: str, nbytes: int, align: int = 16) -> int:
        off = -(-self.sizes.get(region, 0) // align) * align
        self.sizes[region] = off + nbytes
        self.items.setdefault(region, []).append((off, nbytes, align))
        return off


def _round(n: int, align: int) -> int:
    return -(-n // align) * align


class _Layout:
    """Where each region's bytes go in a memory map: region bases, WEIGHTS pieces, the used part of every
    window. `address(region, offset)` turns an allocator offset into a physical (link) address."""

    def __init__(self, alloc: _Allocator, mm: MemoryMap):
        cursor = {w.name: w.base for w in mm.windows}
        self.bases: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.pieces: dict[str, list[tuple[int, int]]] = {}
        self._items: list[tuple[int, int, int]] = []             # WEIGHTS: (offset, bytes, address), by offset

        def put(nbytes, align, what, windows):
            for w in windows:
                at = _round(cursor[w.name], align)
                if at + nbytes <= w.end:
                    cursor[w.name] = at + nbytes
                    return at
            free = ", ".join(f"{w.name} {w.end - _round(cursor[w.name], align):,}" for w in mm.windows)
            hint = f" (the KV cache takes {alloc.sizes.get('KV', 0):,}; fewer max_positions or streams shrink it)"
            raise ValueError(f"memory map {mm.name!r}: {what} ({nbytes:,} bytes) fits in no window "
                             f"(bytes left: {free}); the image needs {self.total_bytes(alloc):,} bytes, the map "
                             f"has {mm.total:,}{hint}")

        # One window: the regions one after the other. Several: every region but WEIGHTS in the last window
        # that holds it (the low bank on kv260), then WEIGHTS tensor by tensor from the first window on.
        split = len(mm.windows) > 1
        for region in REGION_ORDER:
            if region == "WEIGHTS" and split:
                continue
            size = _round(max(alloc.sizes.get(region, 0), 1), ALIGN)
            self.bases[region] = put(size, ALIGN, f"region {region}", mm.windows[::-1] if split else mm.windows)
            self.sizes[region] = size
            self.pieces[region] = [(self.bases[region], size)]
        if split:
            for off, nbytes, align in alloc.items.get("WEIGHTS", [(0, 1, ALIGN)]):
                self._items.append((off, nbytes, put(nbytes, max(align, 64), "a WEIGHTS tensor",
                                                     mm.windows)))
            lo = min(a for _, _, a in self._items)
            self.bases["WEIGHTS"] = lo
            self.sizes["WEIGHTS"] = _round(max(a + n for _, n, a in self._items) - lo, ALIGN)
            runs = []
            for a, n in sorted((a, n) for _, n, a in self._items):
                if runs and a - (runs[-1][0] + runs[-1][1]) < ALIGN and mm.window_of(runs[-1][0]) is mm.window_of(a):
                    runs[-1] = (runs[-1][0], a + n - runs[-1][0])
                else:
                    runs.append((a, n))
            self.pieces["WEIGHTS"] = runs
        self.windows = []
        offset = 0
        for w in mm.windows:
            used = _round(cursor[w.name] - w.base, ALIGN)
            if used:
                self.windows.append(Placement(w.name, w.base, used, offset))
                offset += used
        self.nbytes = offset

    @staticmethod
    def total_bytes(alloc: _Allocator) -> int:
        return sum(_round(max(alloc.sizes.get(r, 0), 1), ALIGN) for r in REGION_ORDER)

    def offset(self, region: str, offset: int) -> int:
        """An allocator offset in `region` as an offset from the region's base."""
        if region != "WEIGHTS" or not self._items:
            return offset
        k = bisect.bisect_right(self._items, (offset, float("inf"))) - 1
        start, nbytes, addr = self._items[k]
        assert start <= offset <= start + nbytes, (region, offset)
        return addr + offset - start - self.bases[region]


def pack(config: Mapping | ModelConfig, tensors: Mapping | None, hw: HardwareConfig, *,
         max_positions: int | None = None, program_bytes: int = 1 << 20, out: str | os.PathLike | None = None,
         progress=None, fill: bool = True, memory_map: str | MemoryMap = "flat",
         quantizer: str = "search", streams: int = 1, logit_rows: int | None = None) -> Image:
    """Pack `tensors` (Hugging Face names, any prefix, ``[out, in]``; arrays or lazy tensors) for
    hardware `hw`. `max_positions` bounds the KV cache of full-attention layers (default: the model's
    ``max_position_embeddings``). With `out`, the image is a memory-mapped file at that path (host tables
    beside it, ``<stem>.<table>.npy``). With ``fill=False`` only the layout is planned (`tensors` may be None;
    given ones are checked without reading their values): regions, descriptors and manifest, over an image of
    zeros that the OS does not back until written (for byte counts of E4B). `memory_map` (`hdl.memory_map`)
    places the regions in its windows; a region that fits no window is a ValueError naming it and the bytes left.
    `quantizer` (`sim.numerics.WEIGHT_METHODS`) is how INT4 matrices get their codes and scales
    (`sim.numerics.quantize_weights`' `method`: ``"search"``, the least-squared-error scale, or ``"rtn"``,
    round-to-nearest); the hardware reads either the same way. `streams`: independent sequences the image
    serves (batched decode), each with KV slots of its own (`Image.stream_slots`). `logit_rows`: the logits
    rows the LOGITS region holds (one per token of a program that returns every token's logits: a batched
    step, a speculative verify), `streams` by default.

    Bad input is rejected at the call with the golden model's messages (`sim.gemma3n`): a missing, unknown
    or misshapen tensor and a non-floating-point dtype before anything is allocated; a NaN or an infinity
    while the tensor is quantised (the files made for `out` are removed then). `max_positions` and
    `program_bytes` must be positive integers."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    if max_positions is not None:
        max_positions = check_positive_int("max_positions", max_positions)
    program_bytes = check_positive_int("program_bytes", program_bytes)
    streams = check_positive_int("streams", streams)
    logit_rows = streams if logit_rows is None else check_positive_int("logit_rows", logit_rows)
    if quantizer not in WEIGHT_METHODS:
        raise ValueError(f"quantizer must be one of {', '.join(map(repr, WEIGHT_METHODS))}, not {quantizer!r}")
    mm = _memory_map(memory_map)
    given = tensors is not None
    if not given:
        if fill:
            raise ValueError("pack needs tensors unless fill=False")
        tensors = {name: _Shape(shape) for name, shape in cfg.tensor_shapes().items()}
    elif not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of tensor names to arrays, not {type(tensors).__name__}")
    max_positions = cfg.max_position_embeddings if max_positions is None else max_positions
    expected = cfg.tensor_shapes()
    by_name = resolve_tensor_names(cfg, tensors)
    if given:
        for name in expected:
            check_weight_dtype(name, tensors[by_name[name]])

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
    stream_slots = []
    for s in range(streams):
        stream_slots.append(kv_slots := {})
        for layer in cfg.kv_cache_layers:
            cap = ring_rows(cfg, hw) if cfg.is_sliding(layer) else max_positions
            cap = min(cap, max_positions)
            if int8_kv:
                nbytes = KvInt8Layout(cap, cfg.num_key_value_heads, cfg.head_dim, hw.act_block).nbytes
            else:
                nbytes = 2 * cap * cfg.kv_dim * 2   # K and V, binary16
            off = alloc.take("KV", nbytes, 64)
            kv_slots[layer] = len(descs)
            descs.append(Descriptor(len(descs), DescKind.KV, kv_slot_name(layer, s), weight_offset=off,
                                    capacity=cap, heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                    scale_offset=vscale_off, layout=hw.kv_layout_code))
    if len(descs) > 256:
        raise ValueError(f"{len(descs)} KV cache slots ({streams} stream(s) of {len(cfg.kv_cache_layers)} layers) "
                         f"do not fit the 8-bit slot field of ATTN/KVST (256)")
    slots = []                                  # staging slots 1.. of the staged tables (their descriptors)
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
        staged = mm.ple_staged and name == PLE_TABLE
        # rows in DDR: a staged host table holds a staging slot per token of a multi-token program
        held = staging_slots(hw) if staged else rows
        nbytes = held * pcols // 2
        ngroups = -(-cols // group)
        off = alloc.take("WEIGHTS", nbytes, 64)
        soff = alloc.take("WEIGHTS", held * ngroups * 2, 64)
        entries[name] = TensorEntry(name, "WEIGHTS", off, shape, "int4", layout, group, soff, nbytes,
                                    held * ngroups * 2, staged=staged)
        # One descriptor for the whole matrix (GEMVs, and row gathers from embedding tables); the LM head
        # also gets one per chunk of rows, the FFN up projection one per piece (`_row_pieces`).
        descs.append(Descriptor(len(descs), DescKind.INT4, name, 0, 1 if staged else held, cols, off, soff, layout,
                                group))
        if staged:
            # one descriptor of one row per further staging slot (GATHER's remap rule reads it for any token),
            # after every other descriptor: the decode program's words do not depend on the memory map
            slots += [(name, t, cols, off + t * pcols // 2, soff + t * ngroups * 2, layout, group)
                      for t in range(1, held)]
            continue
        for r0, n in _row_pieces(cfg, hw, name, rows):
            assert layout == Layout.ROW, "row chunks of a column-major matrix have no contiguous scales"
            descs.append(Descriptor(len(descs), DescKind.INT4, name, r0, n, cols,
                                    off + r0 * pcols // 2, soff + r0 * ngroups * 2, layout, group))
    for name, t, cols, off, soff, layout, group in slots:
        descs.append(Descriptor(len(descs), DescKind.INT4, name, t, 1, cols, off, soff, layout, group))
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
    alloc.take("LOGITS", logit_rows * logit_stride(cfg) * 4)
    alloc.take("PROGRAM", program_bytes)
    alloc.take("SCRATCH", 4096)
    lay = _Layout(alloc, mm)
    for e in entries.values():
        e.offset = lay.offset(e.region, e.offset)
        if e.scale_offset is not None:
            e.scale_offset = lay.offset("WEIGHTS", e.scale_offset)
    for d in descs:
        d.scale_offset = lay.offset("WEIGHTS", d.scale_offset)
        if d.kind == DescKind.INT4:
            d.weight_offset = lay.offset("WEIGHTS", d.weight_offset)
    regions = {name: (lay.bases[name], lay.sizes[name]) for name in REGION_ORDER}
    if out is None:
        ddr = np.zeros(lay.nbytes, dtype=np.uint8)
    else:
        ddr = np.lib.format.open_memmap(os.fspath(out), mode="w+", dtype=np.uint8, shape=(lay.nbytes,))
    host_tables = {}
    for name, e in entries.items():
        if e.staged:
            rows, slots = e.shape[0], staging_slots(hw)
            row_bytes, scale_bytes = e.nbytes // slots, e.scale_nbytes // slots
            if out is None:
                data = np.zeros((rows, row_bytes + scale_bytes), np.uint8)
            else:
                data = np.lib.format.open_memmap(_host_table_path(out, name), mode="w+", dtype=np.uint8,
                                                 shape=(rows, row_bytes + scale_bytes))
            host_tables[name] = HostTable(name, data, row_bytes, scale_bytes)
    image = Image(ddr, regions, entries, descs, stream_slots[0], cfg.to_hf(), hw.to_dict(),
                  scalar_index=scalar_index, windows=lay.windows, pieces=lay.pieces, memory_map=mm.name,
                  host_tables=host_tables, quantizer=quantizer, stream_slots=stream_slots)

    # --- fill ----------------------------------------------------------------------------------------
    for i, d in enumerate(descs):
        image.view("DESC", i * DESC_BYTES, DESC_BYTES)[:] = np.frombuffer(d.to_bytes(), np.uint8)
    if not fill:
        return image
    try:
        _fill(image, cfg, entries, tensors, by_name, folded, scalars, progress, quantizer)
    except BaseException:   # a non-finite weight (or an interrupt): no half-written image stays behind
        if out is not None:
            for path in [os.fspath(out)] + [_host_table_path(out, name) for name in host_tables]:
                if os.path.exists(path):
                    os.remove(path)
        raise
    return image


def _fill(image: Image, cfg: ModelConfig, entries: dict[str, TensorEntry], tensors, by_name: dict[str, str],
          folded: dict[str, int], scalars: np.ndarray, progress, quantizer: str) -> None:
    """Write every entry's values into the planned `image` (`pack`'s second half)."""
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
                check_weight_values(name, tensors[by_name[name]], v)
            image.view("CONST", e.offset, e.nbytes)[:] = v.astype("<f4").reshape(-1).view(np.uint8)
            image.const64[name] = v.reshape(-1)
        elif e.staged:
            _pack_host_table(image.host_tables[name], e, tensors[by_name[name]], quantizer)
        else:
            _pack_int4_tensor(image, e, tensors[by_name[name]], quantizer)
    if progress is not None:
        progress(len(names), len(names), "")


class _Shape:
    """A stand-in tensor that only has a shape (layout planning without weights)."""

    def __init__(self, shape):
        self.shape = tuple(shape)


def _load(value):
    return value.load() if hasattr(value, "load") else np.asarray(value)


def _rows(value, r0, r1):
    return value.rows(r0, r1) if hasattr(value, "rows") else np.asarray(value[r0:r1])


def _host_table_path(out, name: str) -> str:
    out = os.fspath(out)
    stem = out[:-4] if out.endswith(".npy") else out
    return f"{stem}.{name}.npy"


def _pack_host_table(table: HostTable, e: TensorEntry, value, quantizer: str) -> None:
    """A staged table's rows, quantised as `_pack_int4_tensor` quantises a row-major matrix."""
    rows, cols = e.shape
    pcols = cols + cols % 2
    step = max(1, CHUNK_BYTES // (8 * cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = np.asarray(_rows(value, r0, r1), dtype=np.float64)
        check_weight_values(e.name, value, w)
        q, sc = quantize_weights(w, e.group, quantizer)
        table.data[r0:r1, :table.row_bytes] = pack_int4(np.pad(q, ((0, 0), (0, pcols - cols))))
        table.data[r0:r1, table.row_bytes:] = sc.astype("<f2").view(np.uint8).reshape(r1 - r0, -1)


def _pack_int4_tensor(image: Image, e: TensorEntry, value, quantizer: str) -> None:
    rows, cols = e.shape
    pcols = cols + cols % 2
    ngroups = -(-cols // e.group)
    step = max(1, CHUNK_BYTES // (8 * cols)) if e.layout == Layout.ROW else rows
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = np.asarray(_rows(value, r0, r1), dtype=np.float64)
        check_weight_values(e.name, value, w)
        q, s = quantize_weights(w, e.group, quantizer)
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


# --- on disk -----------------------------------------------------------------------------------------------

def save_image(image: Image, directory: str | os.PathLike) -> None:
    """Write `image` to `directory`: ``manifest.json``, ``image.npy`` (the windows' bytes) and one
    ``<table>.npy`` per host table. An image packed with ``out=<directory>/image.npy`` is already there: only the
    manifest is written."""
    d = os.fspath(directory)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "image.npy")
    if getattr(image.ddr, "filename", None) is None or os.path.abspath(image.ddr.filename) != os.path.abspath(path):
        np.save(path, image.ddr)
    else:
        image.ddr.flush()
    for name, t in image.host_tables.items():
        tpath = _host_table_path(path, name)
        if getattr(t.data, "filename", None) is None or os.path.abspath(t.data.filename) != os.path.abspath(tpath):
            np.save(tpath, t.data)
        else:
            t.data.flush()
    image.write_manifest(os.path.join(d, "manifest.json"))


def load_image(directory: str | os.PathLike) -> Image:
    """The image `save_image` wrote to `directory`, its arrays memory-mapped (copy on write: running it does not
    change the files). Raises ValueError naming the file and what it expected."""
    d = os.fspath(directory)
    mpath = os.path.join(d, "manifest.json")
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{d}: no packed image here (no manifest.json); make one with python -m firmware.pack "
                         f"--checkpoint DIR --out {d}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{mpath}: not a readable image manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != IMAGE_FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise ValueError(f"{mpath}: format is {got!r}, expected {IMAGE_FORMAT!r}; pack the checkpoint again")
    try:
        ddr = np.load(os.path.join(d, "image.npy"), mmap_mode="c")
        tensors = {k: TensorEntry(**{**v, "shape": tuple(v["shape"])}) for k, v in m["tensors"].items()}
        descs = [Descriptor(**v) for v in m["descriptors"]]
        windows = [Placement(**w) for w in m["windows"]]
        host_tables = {}
        for name, t in m["host_tables"].items():
            data = np.load(_host_table_path(os.path.join(d, "image.npy"), name), mmap_mode="r")
            if data.shape != (t["rows"], t["row_bytes"] + t["scale_bytes"]):
                raise ValueError(f"host table {name!r} has shape {data.shape}, the manifest says "
                                 f"{(t['rows'], t['row_bytes'] + t['scale_bytes'])}")
            host_tables[name] = HostTable(name, data, t["row_bytes"], t["scale_bytes"])
        image = Image(ddr, {k: (v["base"], v["size"]) for k, v in m["regions"].items()}, tensors, descs,
                      {int(k): v for k, v in m["kv_slots"].items()}, m["config"], m["hardware"],
                      scalar_index=m["scalar_index"], windows=windows,
                      pieces={k: [tuple(p) for p in v] for k, v in m["pieces"].items()},
                      memory_map=m["memory_map"], host_tables=host_tables, quantizer=m["quantizer"],
                      stream_slots=[{int(k): v for k, v in slots.items()} for slots in
                                    m.get("stream_slots", [m["kv_slots"]])])
        if image.quantizer not in WEIGHT_METHODS:
            raise ValueError(f"quantizer is {image.quantizer!r}, expected one of "
                             f"{', '.join(map(repr, WEIGHT_METHODS))}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{d}: the packed image is incomplete or inconsistent: {e}") from None
    if sum(w.size for w in windows) != ddr.size:
        raise ValueError(f"{d}/image.npy holds {ddr.size:,} bytes; the manifest's windows need "
                         f"{sum(w.size for w in windows):,}")
    return image


def region_map(image: Image) -> str:
    """The image's placement as a table: windows, regions (WEIGHTS by piece), host tables and the total."""
    mib = 1 << 20
    lines = [f"memory map {image.memory_map}:", f"  {'window':<10} {'base':>16} {'used':>14}"]
    for w in image.windows:
        lines.append(f"  {w.window:<10} {w.base:>#16x} {w.size / mib:>10.1f} MiB")
    lines.append(f"  {'region':<10} {'base':>16} {'bytes':>14}  window")
    used = image.region_usage()
    for name in REGION_ORDER:
        for k, (addr, n) in enumerate(image.pieces[name]):
            w = next((p.window for p in image.windows if p.base <= addr < p.end), "?")
            label = name if k == 0 else ""
            lines.append(f"  {label:<10} {addr:>#16x} {n:>14,}  {w}")
        if name in used and len(image.pieces[name]) > 1:
            lines.append(f"  {'':<10} {'(used)':>16} {used[name]:>14,}")
    for name, t in image.host_tables.items():
        lines.append(f"  host table {name}: {t.data.shape[0]:,} rows x {t.data.shape[1]:,} B = "
                     f"{t.data.nbytes / mib:,.1f} MiB, kept on the host; one row staged per token "
                     f"({image.staging_slots} slots)")
    total = image.ddr.size
    lines.append(f"  NPU-side total: {total / mib:,.1f} MiB ({total / 1e9:.3f} GB) in {len(image.windows)} "
                 f"window(s)")
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------------------------

def _cli_args(argv):
    import argparse

    from hdl.config import PRESETS as HW_PRESETS
    from hdl.memory_map import MEMORY_MAPS
    from sim.config import PRESETS as MODEL_PRESETS

    from .cli import POSITIVE

    p = argparse.ArgumentParser(
        prog="python -m firmware.pack",
        description="Pack a Gemma 3n checkpoint into the NPU's DDR image for a hardware preset and memory map, "
                    "or (--plan) print where every region would go without reading any weights.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="Hugging Face checkpoint directory (config.json, "
                                                           "*.safetensors)")
    src.add_argument("--model", choices=sorted(MODEL_PRESETS),
                     help="a built-in configuration (e4b, tiny); weights are seeded random (--seed)")
    p.add_argument("--seed", type=int, default=0, help="with --model: the random weights' seed (default 0)")
    p.add_argument("--hw", default="kv260", choices=sorted(HW_PRESETS), help="hardware preset (default kv260)")
    p.add_argument("--memory-map", default="kv260", choices=list(MEMORY_MAPS),
                   help="where the image goes (default kv260: the K26's reserved windows, hdl.memory_map)")
    p.add_argument("--max-positions", type=POSITIVE, default=None, metavar="N",
                   help="positions the KV cache holds (default: the model's max_position_embeddings)")
    p.add_argument("--quantizer", default="search", choices=WEIGHT_METHODS,
                   help="INT4 scales: search (least squared error per group; default) or rtn (round-to-nearest)")
    p.add_argument("--streams", type=POSITIVE, default=1, metavar="B",
                   help="independent sequences with KV caches of their own (batched decode; default 1)")
    p.add_argument("--logit-rows", type=POSITIVE, default=None, metavar="N",
                   help="tokens' logits rows in LOGITS: a batched step's streams, a speculative verify pass's "
                        "ids (default: --streams)")
    p.add_argument("--plan", action="store_true", help="only plan: print the region map, write nothing")
    p.add_argument("--out", metavar="DIR", help="directory for manifest.json, image.npy and the host tables")
    args = p.parse_args(argv)
    if not args.plan and args.out is None:
        p.error("--out DIR is needed to write the image (or --plan to only print the region map)")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint!r} is not a directory")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out!r} exists and is not a directory")
    return p, args


def main(argv=None) -> int:
    """``python -m firmware.pack``: see ``--help``. Bad input: one line on stderr, exit status 2."""
    import sys
    import time

    p, args = _cli_args(argv)
    hw = HardwareConfig.preset(args.hw)
    try:
        if args.checkpoint is not None:
            from sim.checkpoint import Checkpoint
            ckpt = Checkpoint(args.checkpoint)
            cfg, tensors = ckpt.model_config, ckpt
        else:
            cfg = ModelConfig.preset(args.model)
            tensors = None
            if not args.plan:
                from sim.random_weights import random_tensors
                tensors = random_tensors(cfg, args.seed)
        if args.plan:
            # A checkpoint's tensor names, shapes and dtypes are checked (file metadata); no weight is read.
            image = pack(cfg, tensors, hw, max_positions=args.max_positions, fill=False, memory_map=args.memory_map,
                         streams=args.streams, logit_rows=args.logit_rows)
        else:
            os.makedirs(args.out, exist_ok=True)
            t0 = time.monotonic()

            def progress(done, total, name):
                if done == total or done % max(1, total // 20) == 0:
                    print(f"packing: {done}/{total} tensors ({time.monotonic() - t0:.0f} s) {name}",
                          file=sys.stderr, flush=True)
            image = pack(cfg, tensors, hw, max_positions=args.max_positions, memory_map=args.memory_map,
                         out=os.path.join(args.out, "image.npy"), progress=progress, quantizer=args.quantizer,
                         streams=args.streams, logit_rows=args.logit_rows)
            save_image(image, args.out)
            if args.checkpoint is not None and os.path.isfile(os.path.join(args.checkpoint, "tokenizer.model")):
                import shutil
                shutil.copyfile(os.path.join(args.checkpoint, "tokenizer.model"),
                                os.path.join(args.out, "tokenizer.model"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = str(e).strip("'\"") if isinstance(e, KeyError) else str(e)     # KeyError's str() is quoted
        print(f"python -m firmware.pack: {msg}", file=sys.stderr)
        return 2
    print(f"{cfg.num_hidden_layers}-layer Gemma 3n (hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size:,}) "
          f"for hardware {hw.name}, KV cache of {args.max_positions or cfg.max_position_embeddings:,} positions")
    print(region_map(image))
    if not args.plan:
        print(f"wrote {args.out}: " + ", ".join(sorted(os.listdir(args.out))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
