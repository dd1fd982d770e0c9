"""Hardware parameters of the NPU: the single source of truth for every hardware-shaped number.

`HardwareConfig` is a frozen, self-validating dataclass; `PRESETS` holds ``kv260`` (the target: the
Kria KV260's XCK26 with four 128-bit HP ports at 300 MHz) and ``tiny`` (small enough for full-chip
simulation in CI). RTL, golden block models, firmware and benches all read it; derived quantities
(weights per cycle, lanes, bytes per beat) are properties, never re-typed.

This module imports only the standard library: the NumPy golden models in ``sim/`` use it without
Amaranth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["HardwareConfig", "DeviceBudget", "PRESETS", "XCK26", "ceil_log2", "DSP48E2_MUL_A_BITS",
           "DSP48E2_MUL_B_BITS", "DSP48E2_P_BITS", "segment_sum_bound", "segment_sum_bits", "GEMV_PAIR_SHIFT",
           "gemv_pair_problem"]


@dataclass(frozen=True)
class DeviceBudget:
    """Fabric resources of an FPGA device, for utilisation reports."""

    name: str
    lut: int
    ff: int
    dsp: int
    bram36: int
    uram: int


# Zynq UltraScale+ XCK26 (K26 SOM), DS987: 117,120 CLB LUTs, 234,240 CLB flip-flops, 1,248 DSP48E2,
# 144 36 Kb block RAMs (5.1 Mb), 64 UltraRAMs (18 Mb).
XCK26 = DeviceBudget("xck26-sfvc784-2LV-c", lut=117_120, ff=234_240, dsp=1_248, bram36=144, uram=64)

# DSP48E2 (UG579): the multiplier's A/D-side and B-side widths and the P accumulator. The systolic PE's two
# products per slice are sized against them (hdl.dsp, hdl.systolic, sim.systolic).
DSP48E2_MUL_A_BITS = 27
DSP48E2_MUL_B_BITS = 18
DSP48E2_P_BITS = 48


def segment_sum_bound(seg: int, act_bits: int = 8, weight_bits: int | None = None) -> int:
    """The largest magnitude of a sum of `seg` INT4 x INT(`act_bits`) products: ``seg * 8 * 2**(act_bits -
    1)`` (all -8 weights times all -2**(act_bits - 1) activations); with `weight_bits` (default INT4) the
    weights are INT(`weight_bits`): ``seg * 2**(weight_bits - 1) * 2**(act_bits - 1)``. The one statement of
    it: the GEMV engine's isum width, the systolic field spacing and the golden models (`sim.numerics`) use it."""
    if isinstance(seg, bool) or not isinstance(seg, int) or seg < 1:
        raise ValueError(f"segment length must be a positive integer, not {seg!r}")
    wb = HardwareConfig.WEIGHT_BITS if weight_bits is None else weight_bits
    return seg * 2 ** (wb - 1) * 2 ** (act_bits - 1)


def segment_sum_bits(seg: int, act_bits: int = 8, weight_bits: int | None = None) -> int:
    """Signed width that holds every sum of `seg` INT(`weight_bits`, default 4) x INT(`act_bits`) products
    (`segment_sum_bound`)."""
    return segment_sum_bound(seg, act_bits, weight_bits).bit_length() + 1


# `gemv_pairs`: where the odd vector's field starts in a pair's DSP48E2 word (hdl.dsp.DspPairMul, hdl.gemv.SegmentMac)
GEMV_PAIR_SHIFT = 19


def gemv_pair_problem(cfg: "HardwareConfig", int8: bool) -> str | None:
    """Why two vectors cannot share a DSP48E2 per lane exactly on `cfg` (`gemv_pairs`; `int8`: the MAC also takes
    INT8 weights), or None. The activations are the quantiser's, at most 2**(act_bits - 1) - 1 in magnitude
    (`sim.numerics.quantize_activations`): ``hi·2**GEMV_PAIR_SHIFT + lo`` must fit the pre-adder's
    `DSP48E2_MUL_A_BITS`, and a beat's sum of one vector's products (W INT4 products; B INT8 ones, a half of
    the activation word) the low field's GEMV_PAIR_SHIFT bits, signed."""
    amax = 2 ** (cfg.act_bits - 1) - 1
    if amax * 2 ** GEMV_PAIR_SHIFT + amax >= 2 ** (DSP48E2_MUL_A_BITS - 1):
        return (f"act_bits <= {DSP48E2_MUL_A_BITS - GEMV_PAIR_SHIFT} (two activations in the DSP48E2's "
                f"{DSP48E2_MUL_A_BITS}-bit pre-adder)")
    beat = max(segment_sum_bound(cfg.weights_per_beat, 1), segment_sum_bound(cfg.bytes_per_beat, 1, 8) if int8
               else 0) * amax
    if beat >= 2 ** (GEMV_PAIR_SHIFT - 1):
        return f"a beat's sum of products below 2**{GEMV_PAIR_SHIFT - 1} (the pair's low field), not up to {beat}"
    return None


def ceil_log2(x: int) -> int:
    """The smallest k with 2**k >= x (x >= 1): bit widths and shifts of power-of-two sizes."""
    return (x - 1).bit_length()


KV_FORMATS = ("fp16", "int8")
# How the INT8 cache holds V (docs/numerics.md "KV cache"): "planes", two INT4 planes of columns (a position's
# column, D/2 bytes) that ATTN reads per query head with sparse GEMVs; "rows", one INT8 plane of rows (V
# element d's row, one byte per position) that ATTN reads once per KV head with a dense GEMV of INT8 weights
# over the group's query heads.
KV_V_LAYOUTS = ("planes", "rows")
# The INT8 KV cache's number format (docs/numerics.md "KV cache"; sim.numerics): values q = 16·hi + lo with
# hi, lo two's complement INT4, so |q| <= 119; the V planes' GEMVs use one scale group per row (2**16 columns).
KV_Q_MAX = 119
V_PLANE_LOG2_GROUP = 16


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class HardwareConfig:
    """Parameters of one NPU build.

    Parameters
    ----------
    name : preset name, for reports.
    clock_hz : fabric clock the design is built and modelled for.
    axi_ports : number of AXI4 HP master ports streaming weights (the KV260 PS has HP0..HP3).
    axi_data_bits : data width of each HP port (128 on Zynq UltraScale+).
    axi_addr_bits : address width of the masters (the PS decodes 40 bits on HP ports).
    axi_id_bits : AXI ID width of each master.
    axi_max_burst_beats : longest burst the DMA issues (AXI4 INCR allows 256; 16 suits the HP ports).
    axi_max_outstanding : read bursts in flight per port, enough to cover the DDR latency.
    act_bits : width of activation integers fed to the MAC arrays.
    acc_bits : width of the exact integer accumulators.
    act_block : activations sharing one scale (a power of two).
    weight_group : weights of one output row sharing one scale along the input dimension (a power of
        two; 0 means one scale per output row).
    systolic_rows, systolic_cols : systolic array size (GEMM engine).
    l2_bytes : on-chip scratchpad size (URAM).
    constant_cache_bytes : on-chip constant cache size (BRAM).
    l2_scratch_bytes : the top of L2 reserved for the controller's own buffers (RoPE products, the K/V
        row and the attention scores of ATTN); the compiler allocates below it. It bounds ATTN to
        ``(l2_scratch_bytes / 4 - 2 * head_dim) / heads`` visible positions (docs/architecture.md).
    device : the FPGA whose budget the utilisation report compares against.
    l2_banks : word-interleaved L2 banks (a power of two): a wide pass's two operand streams get a word per
        cycle each from two banks (`hdl.l2.L2`).
    sfu_reduce_lanes : SFU block: interleaved partial accumulators of the SFU reductions (a power of two;
        it fixes the binary32 summation order, sim/sfu.py, docs/sfu.md). The RTL takes four elements per
        cycle into four banks of ``sfu_reduce_lanes / 4`` lanes, one adder each, so it needs more than the
        adder's latency (6) per bank: 32 or 64 (hdl.sfu.Sfu rejects less).
    gemv_max_cols : GEMV block: the widest GEMV input (columns) the engine's activation memory holds (a
        power of two; E4B's FFN width 16384 on kv260).
    gemv_sparse_max_rows : GEMV block: the most rows of a sparse (column-major) GEMV; every port keeps
        per-row integer sums and binary32 accumulators for its share (a power of two, at least one beat of
        INT4 weights per port; E4B's hidden size 2048 on kv260).
    gemv_row_mask : GEMV block: WGEMV `mask` (docs/isa.md, docs/gemv.md "Row mask"): the rows whose mask
        element is zero are not fetched (the up projection of the sparse layers, whose gate units the
        Gaussian top-k zeroes); a masked WGEMV on an NPU without it stops with `BAD_FUNCTION`
        (`python -m firmware.perf --no-row-mask` prices the NPU without it).
    gemv_vectors : GEMV block: activation vectors the GEMV engine multiplies with each weight beat (1 to 4); an
        NPU with more than one runs WGEMM on the GEMV engine, that many tokens per weight stream, and has no GEMM
        unit (each vector has its own activation and exponent memories, multipliers and adder tree in every
        port; docs/gemv.md "Several vectors").
    gemv_pairs : GEMV block: the vectors in pairs (``gemv_vectors`` even): a pair shares a DSP48E2 per lane, one
        weight times both activations packed 19 bits apart by the slice's pre-adder, and one adder tree, with
        lane pairs summed through the slices' P cascade (`hdl.gemv.SegmentMac` ``pairs``; docs/gemv.md "Vector
        pairs"). The activations must lie in the quantiser's [-127, 127].
    gemv_interleave : GEMV block: the dense datapath takes each chunk round's weight beats with the tile's rows
        interleaved per beat, beat k of every row before beat k + 1, through a round reorder memory a port
        (`hdl.gemv.GemvPort`; docs/gemv.md "Rows interleaved per beat"), so that one activation word serves as many
        consecutive cycles as the tile has rows (the first step to one copy of the activations shared by the
        ports).
    kv_format : the KV cache format: ``"fp16"`` (binary16 K and V; ATTN runs on the SFU, one element per
        cycle) or ``"int8"`` (power-of-two scaled INT8 K and V held as two INT4 planes; ATTN's dot products
        run on the GEMV engine at the weight-stream rate). docs/numerics.md, "KV cache".
    kv_v_layout : INT8 KV cache: how V is held, ``"planes"`` (two INT4 planes of position columns; ATTN's V
        GEMVs sparse, per query head) or ``"rows"`` (one INT8 plane of rows, a byte per position; ATTN's V GEMV
        dense over the KV group's query heads, one pass over V per KV head). "rows" is modelled in the ISS and
        the performance model; the RTL builds "planes" (its attention sequencer refuses "rows").
    kv_max_head_dim : INT8 KV cache: the widest head KVST quantises (the KV packer's memory; a multiple of 8
        and of a beat of INT4 weights, and at most ``gemv_sparse_max_rows``, the V GEMVs' rows).
    """

    name: str
    clock_hz: int
    axi_ports: int
    axi_data_bits: int
    axi_addr_bits: int
    axi_id_bits: int
    axi_max_burst_beats: int
    axi_max_outstanding: int
    act_bits: int
    acc_bits: int
    act_block: int
    weight_group: int
    systolic_rows: int
    systolic_cols: int
    l2_bytes: int
    constant_cache_bytes: int
    l2_scratch_bytes: int = 16 << 10
    device: DeviceBudget = XCK26
    l2_banks: int = 2
    # --- SFU block (sim/sfu.py, hdl/sfu.py) ---
    sfu_reduce_lanes: int = 32
    # --- GEMV block (hdl/gemv.py) ---
    gemv_max_cols: int = 16384
    gemv_sparse_max_rows: int = 2048
    gemv_row_mask: bool = False
    gemv_vectors: int = 1
    gemv_pairs: bool = False
    gemv_interleave: bool = False
    # --- KV cache (sim/iss.py ATTN/KVST, firmware/pack.py, docs/numerics.md "KV cache") ---
    kv_format: str = "fp16"
    kv_v_layout: str = "planes"
    kv_max_head_dim: int = 256

    # The weight format is part of the architecture, not a knob: INT4, two per byte, low nibble first.
    WEIGHT_BITS = 4

    def __post_init__(self):
        def integer(field, minimum=1):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{field} must be an integer, not {v!r}")
            if v < minimum:
                raise ValueError(f"{field} must be at least {minimum}, not {v!r}")
            return v

        for field in ("clock_hz", "axi_ports", "axi_addr_bits", "axi_id_bits", "axi_max_outstanding",
                      "systolic_rows", "systolic_cols"):
            integer(field)
        integer("weight_group", minimum=0)
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {', '.join(KV_FORMATS)}, not {self.kv_format!r}")
        if self.kv_v_layout not in KV_V_LAYOUTS:
            raise ValueError(f"kv_v_layout must be one of {', '.join(KV_V_LAYOUTS)}, not {self.kv_v_layout!r}")
        if self.kv_v_layout != "planes" and self.kv_format != "int8":
            raise ValueError(f"kv_v_layout {self.kv_v_layout!r} is a layout of the INT8 cache; kv_format is "
                             f"{self.kv_format!r}")
        integer("kv_max_head_dim", 8)
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty string, not {self.name!r}")
        if not _is_pow2(integer("axi_data_bits", 32)) or self.axi_data_bits > 1024:
            raise ValueError(f"axi_data_bits must be a power of two from 32 to 1024, not {self.axi_data_bits!r}")
        if not 1 <= integer("axi_max_burst_beats") <= 256:
            raise ValueError(f"axi_max_burst_beats must be 1..256 (AXI4 INCR), not {self.axi_max_burst_beats!r}")
        if self.axi_max_burst_beats * self.bytes_per_beat > 4096:
            raise ValueError(f"axi_max_burst_beats ({self.axi_max_burst_beats}) x {self.bytes_per_beat} bytes "
                             f"exceeds the 4 KB an AXI burst may span")
        if not 12 < self.axi_addr_bits <= 64:
            raise ValueError(f"axi_addr_bits must be 13..64, not {self.axi_addr_bits!r}")
        if integer("act_bits", 2) > 16:
            raise ValueError(f"act_bits must be 2..16, not {self.act_bits!r}")
        if integer("acc_bits", 8) > 64:
            raise ValueError(f"acc_bits must be 8..64, not {self.acc_bits!r}")
        if not _is_pow2(integer("act_block")):
            raise ValueError(f"act_block must be a power of two, not {self.act_block!r}")
        if self.weight_group and not _is_pow2(self.weight_group):
            raise ValueError(f"weight_group must be 0 (per row) or a power of two, not {self.weight_group!r}")
        if not _is_pow2(integer("l2_bytes")) or self.l2_bytes < self.bytes_per_beat:
            raise ValueError(f"l2_bytes must be a power of two of at least one beat "
                             f"({self.bytes_per_beat} bytes), not {self.l2_bytes!r}")
        if integer("l2_scratch_bytes", 64) % 16 or self.l2_scratch_bytes >= self.l2_bytes:
            raise ValueError(f"l2_scratch_bytes must be a multiple of 16 below l2_bytes ({self.l2_bytes}), "
                             f"not {self.l2_scratch_bytes!r}")
        if not _is_pow2(integer("l2_banks")) or self.l2_banks > 8:
            raise ValueError(f"l2_banks must be a power of two from 1 to 8, not {self.l2_banks!r}")
        if not _is_pow2(integer("constant_cache_bytes")):
            raise ValueError(f"constant_cache_bytes must be a power of two, not {self.constant_cache_bytes!r}")
        # SFU block.
        if not _is_pow2(integer("sfu_reduce_lanes")) or self.sfu_reduce_lanes > 64:
            raise ValueError(f"sfu_reduce_lanes must be a power of two from 1 to 64, not {self.sfu_reduce_lanes!r}")
        # GEMV block.
        if not _is_pow2(integer("gemv_max_cols")) or self.gemv_max_cols < max(self.weights_per_beat, self.act_block):
            raise ValueError(f"gemv_max_cols must be a power of two of at least one beat ({self.weights_per_beat}) "
                             f"and one activation block ({self.act_block}), not {self.gemv_max_cols!r}")
        if not _is_pow2(integer("gemv_sparse_max_rows")) or \
                self.gemv_sparse_max_rows < self.axi_ports * self.weights_per_beat:
            raise ValueError(f"gemv_sparse_max_rows must be a power of two of at least axi_ports x weights_per_beat "
                             f"({self.axi_ports * self.weights_per_beat}), not {self.gemv_sparse_max_rows!r}")
        if not 1 <= integer("gemv_vectors") <= 4:
            raise ValueError(f"gemv_vectors must be 1 to 4, not {self.gemv_vectors!r}")
        if not isinstance(self.gemv_pairs, bool):
            raise ValueError(f"gemv_pairs must be True or False, not {self.gemv_pairs!r}")
        if not isinstance(self.gemv_interleave, bool):
            raise ValueError(f"gemv_interleave must be True or False, not {self.gemv_interleave!r}")
        if self.gemv_pairs:
            problem = "an even gemv_vectors" if self.gemv_vectors % 2 else gemv_pair_problem(self, self.gemv_int8)
            if problem:
                raise ValueError(f"gemv_pairs needs {problem}: {self.gemv_vectors} vectors of {self.act_bits} bits, "
                                 f"{self.weights_per_beat} lanes")
        # The widest dot product an accumulator must hold exactly: one weight group (or act block) of
        # INT4 x INT(act_bits) products. Checked so that no configuration silently overflows.
        span = max(self.weight_group or 1, self.act_block)
        need = self.WEIGHT_BITS + self.act_bits - 1 + max(1, (span - 1).bit_length())
        if self.acc_bits < need:
            raise ValueError(f"acc_bits ({self.acc_bits}) cannot hold a sum of {span} INT4 x INT{self.act_bits} "
                             f"products exactly; need at least {need}")
        unit = max(8, self.weights_per_beat)
        if self.kv_max_head_dim % unit or self.kv_max_head_dim > self.gemv_sparse_max_rows:
            raise ValueError(f"kv_max_head_dim must be a multiple of {unit} (8 and a beat of INT4 weights) and "
                             f"at most gemv_sparse_max_rows ({self.gemv_sparse_max_rows}), not "
                             f"{self.kv_max_head_dim!r}")

    # --- derived --------------------------------------------------------------------------------

    @property
    def bytes_per_beat(self) -> int:
        return self.axi_data_bits // 8

    @property
    def kv_layout_code(self) -> int:
        """A KV slot descriptor's `layout` for this cache (hdl.isa.DESCRIPTOR): 0 binary16, 1 INT8 with V planes,
        2 INT8 with V rows."""
        return 0 if self.kv_format == "fp16" else 1 + KV_V_LAYOUTS.index(self.kv_v_layout)

    @property
    def weights_per_beat(self) -> int:
        """INT4 weights in one beat of one port."""
        return self.axi_data_bits // self.WEIGHT_BITS

    @property
    def gemv_lanes(self) -> int:
        """INT4 multiply lanes of the GEMV engine: one per weight arriving per cycle on all ports."""
        return self.axi_ports * self.weights_per_beat

    @property
    def gemv_int8(self) -> bool:
        """The GEMV engine runs commands with INT8 weights (`hdl.gemv.command_layout`'s `int8`): the INT8 KV
        cache with V rows (``kv_format == "int8"`` and ``kv_v_layout == "rows"``), whose ATTN multiplies each V
        plane (one signed byte per element) with the softmax weights in the engine."""
        return self.kv_format == "int8" and self.kv_v_layout == "rows"

    @property
    def segment_sum_weight_bits(self) -> int:
        """The widest weight the GEMV engine's segment sums take: 8 with `gemv_int8`, else INT4."""
        return 8 if self.gemv_int8 else self.WEIGHT_BITS

    @property
    def segment_sum_bits(self) -> int:
        """Signed width of every segment sum of this config: a segment holds at most `act_block` INT4 x
        INT(`act_bits`) products (`segment_sum_bits`; kv260: 19, tiny: 16), INT8 x INT(`act_bits`) ones with
        `gemv_int8` (kv260 with V rows: 23)."""
        return segment_sum_bits(self.act_block, self.act_bits, self.segment_sum_weight_bits)

    @property
    def gemm_tile(self) -> int:
        """Tokens a WGEMM streams its weights once for: V = `gemv_vectors` on an NPU whose GEMV engine runs WGEMM
        (V > 1; it has no GEMM unit), else `systolic_rows`."""
        return self.gemv_vectors if self.gemv_vectors > 1 else self.systolic_rows

    @property
    def l2_program_words(self) -> int:
        """16-byte L2 words a program may allocate (below the controller's scratch)."""
        return (self.l2_bytes - self.l2_scratch_bytes) // 16

    @property
    def peak_weight_bytes_per_second(self) -> float:
        return self.axi_ports * self.bytes_per_beat * self.clock_hz

    @classmethod
    def preset(cls, name: str) -> "HardwareConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown hardware preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}") \
                from None

    def replace(self, **changes) -> "HardwareConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["device"] = self.device.name
        d.update(bytes_per_beat=self.bytes_per_beat, weights_per_beat=self.weights_per_beat,
                 gemv_lanes=self.gemv_lanes)
        return d


PRESETS: dict[str, HardwareConfig] = {
    # The target. Four HP ports x 128 bit at 300 MHz = 19.2 GB/s, the DDR4-2400 x64 peak: 128 INT4
    # weights per cycle. Group 128 / block 128: docs/numerics.md ("Choosing the numerics": blocks of 16 to 128
    # give the same quality; a segment of 128 columns is four beats, so one binary32 pipeline a port keeps four
    # vectors at the stream rate). The GEMV engine takes four activation vectors and runs WGEMM, four tokens a
    # weight stream (no GEMM unit; docs/architecture.md "Decisions").
    "kv260": HardwareConfig(
        name="kv260", clock_hz=300_000_000, axi_ports=4, axi_data_bits=128, axi_addr_bits=40,
        axi_id_bits=6, axi_max_burst_beats=16, axi_max_outstanding=8, act_bits=8, acc_bits=32,
        act_block=128, weight_group=128, systolic_rows=32, systolic_cols=8,
        l2_bytes=1 << 20, constant_cache_bytes=64 << 10, l2_scratch_bytes=128 << 10, sfu_reduce_lanes=32,
        gemv_max_cols=16384, gemv_sparse_max_rows=2048, gemv_row_mask=True, kv_format="int8", gemv_vectors=4,
        gemv_pairs=True, kv_v_layout="rows"),
    # Small enough that the full chip simulates in seconds in Verilator; same structure.
    "tiny": HardwareConfig(
        name="tiny", clock_hz=100_000_000, axi_ports=2, axi_data_bits=64, axi_addr_bits=40,
        axi_id_bits=4, axi_max_burst_beats=16, axi_max_outstanding=4, act_bits=8, acc_bits=32,
        act_block=16, weight_group=32, systolic_rows=4, systolic_cols=4,
        l2_bytes=64 << 10, constant_cache_bytes=4 << 10, l2_scratch_bytes=16 << 10, sfu_reduce_lanes=32,
        gemv_max_cols=1024, gemv_sparse_max_rows=128, gemv_row_mask=True, kv_format="int8", kv_max_head_dim=128),
}
# The binary16 KV cache (ATTN on the SFU) on the tiny NPU: the other `kv_format`, kept buildable and tested.
PRESETS["tiny_fp16"] = PRESETS["tiny"].replace(name="tiny_fp16", kv_format="fp16")
# The tiny NPU whose GEMV engine takes four activation vectors and runs WGEMM (no GEMM unit): the multi-token
# engine, kept buildable and tested.
PRESETS["tiny_v4"] = PRESETS["tiny"].replace(name="tiny_v4", gemv_vectors=4, gemv_pairs=True, kv_v_layout="rows")
# The KV260 NPU with one activation vector and the GEMM unit (the 32 x 8 systolic array) for WGEMM: the
# alternative docs/systolic.md measures, kept buildable and tested. Its activation blocks are 64: a segment of
# 64 k-steps drains the array's 2 x 32 rows exactly, so every scale lane is busy (docs/systolic.md).
PRESETS["kv260_gemm"] = PRESETS["kv260"].replace(name="kv260_gemm", gemv_vectors=1, gemv_pairs=False, act_block=64)


def _field_meanings() -> dict[str, str]:
    """Each `HardwareConfig` field's short meaning: the first sentence of its entry in the class docstring's
    ``Parameters`` section, up to a semicolon, without parenthesised remarks."""
    import inspect
    import re

    doc = inspect.cleandoc(HardwareConfig.__doc__).split("----------\n", 1)[1]
    meanings = {}
    for names, text in re.findall(r"^(\w[\w, ]*?) : (.*?)(?=^\w[\w, ]* : |\Z)", doc, re.M | re.S):
        text = " ".join(text.split())
        while True:                                          # innermost parentheses first
            shorter = re.sub(r"\s*\([^()]*\)", "", text)
            if shorter == text:
                break
            text = shorter
        text = re.split(r"\.(?:\s|$)|;", text, maxsplit=1)[0].strip()
        for name in names.split(","):
            meanings[name.strip()] = text.replace("``", "`")
    missing = [f.name for f in dataclasses.fields(HardwareConfig) if f.name not in meanings]
    if missing:
        raise ValueError(f"HardwareConfig's docstring does not describe {', '.join(missing)}")
    return meanings


def _format_value(field: str, value) -> str:
    if isinstance(value, DeviceBudget):
        return value.name
    if isinstance(value, bool):
        return "yes" if value else "no"
    if field == "clock_hz":
        return f"{value / 1e6:g} MHz"
    if field.endswith("_bytes"):
        for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
        return f"{value} B"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def parameter_table(presets: dict[str, HardwareConfig] | None = None) -> str:
    """A Markdown table of every `HardwareConfig` field: one row per field with its short meaning (from the
    class docstring), one column per preset (default: `PRESETS`). The README shows it; ``python -m hdl.config
    --markdown`` prints it."""
    presets = PRESETS if presets is None else presets
    meanings = _field_meanings()
    lines = ["| parameter | meaning | " + " | ".join(f"`{name}`" for name in presets) + " |",
             "|---|---|" + "---|" * len(presets)]
    for f in dataclasses.fields(HardwareConfig):
        values = " | ".join(_format_value(f.name, getattr(hw, f.name)) for hw in presets.values())
        lines.append(f"| `{f.name}` | {meanings[f.name]} | {values} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m hdl.config",
                                 description="The hardware presets: as JSON, or as the README's parameter table.")
    ap.add_argument("--markdown", action="store_true", help="print the Markdown parameter table")
    args = ap.parse_args()
    if args.markdown:
        print(parameter_table())
    else:
        print(json.dumps({name: hw.to_dict() for name, hw in PRESETS.items()}, indent=2))
