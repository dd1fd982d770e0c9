"""The NPU's instruction set: the one definition that the RTL decoder, the assembler, the disassembler and
the instruction-set simulator all use (docs/isa.md is its prose).

Every instruction is a 64-bit word: ``opcode = word[63:60]`` and a 60-bit body whose fields are packed
MSB-first in the order listed in `FORMATS` (pccx v002's convention). Opcodes 0x0-0x4 keep pccx v002's
field layouts bit for bit (GEMV, GEMM, MEMCPY, MEMSET, CVO); 0x5-0xD are this NPU's extensions for what
pccx cannot express (weight streaming from DDR, element-wise vector ops, fused decode attention, the KV
cache, embedding gathers, scalar registers, DMA with DDR addresses, control, multi-token GEMM on the
systolic array). Fields named ``rsvd*`` must be zero; a word that breaks any rule of `decode` is
malformed and the hardware stops with the matching `ErrorCode`.

Each format is also an Amaranth `data.StructLayout` (`layout`), so the RTL decodes with the same bit
positions the assembler packs with (``layout(op).const({...}).as_bits()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from amaranth import unsigned
from amaranth.lib import data, enum

__all__ = [
    "Opcode", "CvoFunc", "VecFunc", "VEC_REDUCTIONS", "ScalarFunc", "CtrlFunc", "DmaDir", "DdrRegion", "ShapeCache",
    "ErrorCode", "DescKind", "DESCRIPTOR", "DESC_WORDS", "DESC_BYTES", "FMAP_ENTRY", "SCALAR_REGS", "SHAPE_SLOTS",
    "Field", "FORMATS", "WORD_BITS", "L2_ADDR_BITS", "layout", "encode", "decode", "DecodeError", "Instruction",
]

WORD_BITS = 64
OPCODE_BITS = 4
BODY_BITS = WORD_BITS - OPCODE_BITS
L2_ADDR_BITS = 17            # pccx: 17-bit addresses of 16-byte L2 words (2 MiB of address space)


class Opcode(enum.Enum, shape=OPCODE_BITS):
    GEMV = 0x0      # pccx
    GEMM = 0x1      # pccx
    MEMCPY = 0x2    # pccx
    MEMSET = 0x3    # pccx
    CVO = 0x4       # pccx (functions 8-15 are extensions)
    WGEMV = 0x5     # GEMV with the weight matrix streamed from DDR through a descriptor
    VEC = 0x6       # element-wise vector operations and reductions over VL elements
    ATTN = 0x7      # fused decode attention of one KV head group over the DDR KV cache
    KVST = 0x8      # store this position's K and V into the DDR KV cache
    GATHER = 0x9    # one row of a DDR table (embeddings), selected by the token id
    SCALAR = 0xA    # scalar register arithmetic
    DMA = 0xB       # L2 <-> DDR copies with DDR region offsets
    CTRL = 0xC      # vector length, fences, halt
    WGEMM = 0xD     # WGEMV for T tokens at once on the systolic array (prefill, verification, batches)


class CvoFunc(enum.Enum, shape=4):
    """SFU functions of CVO. 0-7 are pccx v002's; 8-15 are extensions Gemma 3n needs."""
    EXP = 0
    SQRT = 1
    GELU = 2
    SIN = 3
    COS = 4
    REDUCE_SUM = 5
    SCALE = 6
    RECIP = 7
    TANH = 8
    RSQRT = 9
    REDUCE_MAX = 10
    SOFTCAP = 11      # c * tanh(x / c), c = S[0]: the final logit soft-cap
    ROPE_COS = 12     # cos(pos * f_j) for the RoPE frequency table at src (accurate range reduction)
    ROPE_SIN = 13     # sin(pos * f_j)


class VecFunc(enum.Enum, shape=5):
    """Element-wise operations of VEC over VL binary32 elements (S = scalar register file)."""
    ADD = 0           # d = a + b
    SUB = 1           # d = a - b
    MUL = 2           # d = a * b
    MULS = 3          # d = a * S[s]
    ADDS = 4          # d = a + S[s]
    FMAS = 5          # d = a * S[s] + b           (one rounding per operation: multiply, then add)
    COPY = 6          # d = a
    RELU_SUBS = 7     # d = max(a - S[s], 0)        (Gaussian top-k cutoff)
    GELU_MUL = 8      # d = gelu_tanh(a) * b        (FFN gate x up, PLE gate x per-layer input)
    ROPE = 9          # d = rotate_half RoPE of a, heads of HD elements, cos at b, sin at b + HD/2 elements
    RMSNORM = 10      # per HD-element segment: d = a * (mean(a * a) + S[s])^-1/2 * b   (b: HD gains)
    RMSNORM_NG = 11   # per HD-element segment: d = a * (mean(a * a) + S[s])^-1/2       (no gain: V-norm)
    SUMSQ = 16        # S[s] = sum(a * a)           (RMSNorm)
    SUM = 17          # S[s] = sum(a)
    MAX = 18          # S[s] = max(a)
    DOT = 19          # S[s] = sum(a * b)


# The VEC functions that reduce into the scalar register S[s] instead of writing L2
VEC_REDUCTIONS = (VecFunc.SUMSQ, VecFunc.SUM, VecFunc.MAX, VecFunc.DOT)


class ScalarFunc(enum.Enum, shape=4):
    LI = 0            # S[d] = imm
    ADD = 1           # S[d] = S[a] + S[b]
    MUL = 2           # S[d] = S[a] * S[b]
    MULI = 3          # S[d] = S[a] * imm
    ADDI = 4          # S[d] = S[a] + imm
    RSQRT = 5         # S[d] = 1 / sqrt(S[a])
    SQRT = 6          # S[d] = sqrt(S[a])
    RECIP = 7         # S[d] = 1 / S[a]
    LDPOS = 8         # S[d] = float(POS)
    TANH = 9          # S[d] = tanh(S[a])
    SUB = 10          # S[d] = S[a] - S[b]
    MAXI = 11         # S[d] = max(S[a], imm)
    LD = 12           # S[d] = L2 element imm (binary32 element index)
    MAX = 13          # S[d] = max(S[a], S[b])
    ST = 14           # L2 element imm = S[a]


class CtrlFunc(enum.Enum, shape=4):
    NOP = 0
    SETVL = 1         # VL = imm (elements)
    SETHD = 2         # HD = imm (RoPE head dimension)
    FENCE = 3         # wait until every earlier instruction has completed
    HALT = 4          # end of program: wait for completion, set DONE
    SETTOK = 5        # TOKEN = imm, once every earlier instruction has completed (multi-token programs)
    SETPOS = 6        # POS = imm, likewise


class DmaDir(enum.Enum, shape=2):
    DDR_TO_L2 = 0
    L2_TO_DDR = 1
    L2_TO_L2 = 2


class DdrRegion(enum.Enum, shape=3):
    """DDR regions whose base addresses are CSRs; DMA, descriptors and the KV cache use offsets."""
    CONST = 0         # constants: norm gains, RoPE frequency tables, small FP32 tensors
    LOGITS = 1        # the token's output: soft-capped logits
    SCRATCH = 2       # spill space
    WEIGHTS = 3       # packed INT4 weights and scales (read through descriptors)
    KV = 4            # the KV cache
    DESC = 5          # the weight descriptor table


class DescKind(enum.IntEnum, shape=8):
    """What a weight descriptor describes."""
    INT4 = 0          # an INT4 matrix (or a row chunk of one) with binary16 group scales, in WEIGHTS
    KV = 2            # a KV cache slot, in KV (capacity, heads, head_dim; the cache format in `layout`)


# The weight descriptor, 32 bytes little-endian in the DESC region: what `firmware.pack` writes and the
# controller reads (`data.View` over the eight words it loads), one layout for both. KV slots keep their
# capacity in `rows` and K/V width (heads x head_dim) in `cols`; their `layout` is the cache format (0 binary16,
# 1 INT8 with V planes, 2 INT8 with V rows: `HardwareConfig.kv_layout_code`) and, for INT8, `scale_offset` the
# WEIGHTS offset of the V GEMVs' scales.
DESCRIPTOR = data.StructLayout({
    "weight_offset": unsigned(64),    # bytes from WEIGHTS_BASE (KV slots: from KV_BASE)
    "scale_offset": unsigned(64),     # bytes from WEIGHTS_BASE
    "rows": unsigned(32),
    "cols": unsigned(32),
    "kind": DescKind,
    "layout": unsigned(8),            # 0 row-major, 1 column-major (firmware.pack.Layout); KV: the format
    "log2_group": unsigned(8),        # log2 of the scale group (columns per scale)
    "heads": unsigned(8),
    "head_dim": unsigned(16),
    "reserved": unsigned(16),
})
DESC_WORDS = DESCRIPTOR.size // 32
DESC_BYTES = DESCRIPTOR.size // 8


class ShapeCache(enum.Enum, shape=2):
    """MEMSET targets. pccx defines 0 and 1; 2 writes a scalar register (a:b = binary32 bits)."""
    FMAP = 0
    WEIGHT = 1
    SCALAR = 2


# A shape-cache entry (MEMSET FMAP a, b, c; ATTN reads the entry at `shape_ptr`): the query heads of a KV
# group, their head dimension and the sliding window (0: full attention).
FMAP_ENTRY = data.StructLayout({"heads": unsigned(16), "head_dim": unsigned(16), "window": unsigned(16)})


class ErrorCode(enum.Enum, shape=4):
    """The error status the controller reports (CSR) when it stops on a bad instruction or access."""
    NONE = 0
    BAD_OPCODE = 1          # opcode 0xE-0xF
    RESERVED_BITS = 2       # a reserved field is not zero
    BAD_FUNCTION = 3        # an undefined function / cache / direction / region code
    ADDRESS_RANGE = 4       # an L2 or DDR range outside the configured memory
    BAD_DESCRIPTOR = 5      # a weight descriptor that is malformed or out of range
    START_WHILE_BUSY = 6    # the host wrote START while a program was running
    BAD_LENGTH = 7          # a zero or oversized length
    BUS_ERROR = 8           # an AXI read or write was answered SLVERR or DECERR (program fetch or data)
    NON_FINITE = 9          # a WGEMV input holds an infinity or a NaN (it cannot be quantised)


@dataclass(frozen=True)
class Field:
    name: str
    width: int
    kind: type | None = None      # an enum class for coded fields
    l2_addr: bool = False         # an L2 word address (checked against the configured L2 size)

    @property
    def reserved(self) -> bool:
        return self.name.startswith("rsvd")


def _a(name):
    return Field(name, L2_ADDR_BITS, l2_addr=True)


def _b(name):
    return Field(name, 1)


# Field lists, MSB first after the opcode; each sums to 60 bits.
FORMATS: dict[Opcode, tuple[Field, ...]] = {
    Opcode.GEMV: (_a("dest"), _a("src"), _b("findemax"), _b("accm"), _b("w_scale"), Field("rsvd_flags", 3),
                  Field("size_ptr", 6), Field("shape_ptr", 6), Field("lanes", 5), Field("rsvd", 3)),
    Opcode.GEMM: (_a("dest"), _a("src"), _b("findemax"), _b("accm"), _b("w_scale"), Field("rsvd_flags", 3),
                  Field("size_ptr", 6), Field("shape_ptr", 6), Field("lanes", 5), Field("rsvd", 3)),
    Opcode.MEMCPY: (_b("from_device"), _b("to_device"), _a("dest"), _a("src"), Field("aux", 17),
                    Field("shape_ptr", 6), _b("async_")),
    Opcode.MEMSET: (Field("cache", 2, ShapeCache), Field("slot", 6), Field("a", 16), Field("b", 16),
                    Field("c", 16), Field("rsvd", 4)),
    Opcode.CVO: (Field("func", 4, CvoFunc), _a("src"), _a("dst"), Field("length", 16), _b("sub_emax"),
                 _b("recip_scale"), _b("accm"), Field("rsvd", 2), _b("async_")),
    Opcode.WGEMV: (_a("dst"), _a("src"), Field("desc", 16), _b("accm"), _b("findemax"), _b("sparse"),
                   _b("reuse"), _b("mask"), Field("rsvd", 4), _b("async_")),
    Opcode.VEC: (Field("func", 5, VecFunc), _a("dst"), _a("a"), _a("b"), Field("s", 3), _b("async_")),
    Opcode.ATTN: (_a("dst"), _a("q"), Field("slot", 8), Field("kv_head", 4), Field("shape_ptr", 6),
                  Field("rsvd", 7), _b("async_")),
    Opcode.KVST: (_a("k"), _a("v"), Field("slot", 8), Field("shape_ptr", 6), Field("rsvd", 11), _b("async_")),
    Opcode.GATHER: (_a("dst"), Field("desc", 16), _b("remap"), Field("rsvd", 25), _b("async_")),
    Opcode.SCALAR: (Field("func", 4, ScalarFunc), Field("d", 3), Field("a", 3), Field("b", 3), Field("imm", 32),
                    Field("rsvd", 15)),
    Opcode.DMA: (Field("dir", 2, DmaDir), Field("region", 3, DdrRegion), _a("l2"), Field("offset", 32),
                 Field("rsvd", 5), _b("async_")),
    Opcode.CTRL: (Field("func", 4, CtrlFunc), Field("imm", 32), Field("rsvd", 24)),
    Opcode.WGEMM: (_a("dst"), _a("src"), Field("desc", 16), Field("tokens", 8), _b("accm"), _b("async_")),
}

for _op, _fields in FORMATS.items():
    assert sum(f.width for f in _fields) == BODY_BITS, (_op, sum(f.width for f in _fields))


def _width(op: Opcode, name: str) -> int:
    return next(f.width for f in FORMATS[op] if f.name == name)


SCALAR_REGS = 1 << _width(Opcode.SCALAR, "d")            # the scalar registers s0 .. s7 (MEMSET SCALAR: slot < 8)
SHAPE_SLOTS = 1 << _width(Opcode.MEMSET, "slot")         # entries of each shape cache (ATTN/KVST shape_ptr)
assert SHAPE_SLOTS == 1 << _width(Opcode.ATTN, "shape_ptr")


def layout(op: Opcode) -> data.StructLayout:
    """The Amaranth layout of a whole 64-bit word of format `op` (LSB first, as Amaranth orders fields)."""
    fields = {}
    for f in reversed(FORMATS[op]):
        fields[f.name] = f.kind if f.kind is not None else unsigned(f.width)
    fields["opcode"] = Opcode
    return data.StructLayout(fields)


class DecodeError(ValueError):
    """A malformed instruction word. `code` is the `ErrorCode` the hardware reports for it."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Instruction:
    """A decoded instruction: its opcode and every non-reserved field (enums for coded fields)."""
    op: Opcode
    fields: dict

    def __getattr__(self, name):
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None


def _positions(op: Opcode):
    pos = BODY_BITS
    for f in FORMATS[op]:
        pos -= f.width
        yield f, pos


def encode(op: Opcode, *, l2_words: int | None = None, **values) -> int:
    """Pack an instruction; every non-reserved field must be given. Raises `ValueError` naming the field
    for an unknown field, a value out of range, or an L2 address beyond `l2_words`."""
    op = Opcode(op)
    known = {f.name for f in FORMATS[op] if not f.reserved}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{op.name} has no field {sorted(unknown)[0]!r}; its fields are {', '.join(sorted(known))}")
    missing = known - set(values)
    if missing:
        raise ValueError(f"{op.name} needs field {sorted(missing)[0]!r}")
    word = op.value << BODY_BITS
    for f, pos in _positions(op):
        if f.reserved:
            continue
        v = values[f.name]
        if f.kind is not None:
            try:
                v = f.kind(v).value
            except ValueError:
                raise ValueError(f"field {f.name!r} of {op.name}: {v!r} is not a {f.kind.__name__}") from None
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, int) or not 0 <= v < (1 << f.width):
            raise ValueError(f"field {f.name!r} of {op.name} is {f.width} bits wide; {v!r} does not fit")
        if f.l2_addr and l2_words is not None and v >= l2_words:
            raise ValueError(f"field {f.name!r} of {op.name}: address {v:#x} is beyond L2 ({l2_words} words)")
        word |= v << pos
    return word


def decode(word: int, *, l2_words: int | None = None) -> Instruction:
    """Unpack and check a 64-bit word. Raises `DecodeError` (with the hardware's `ErrorCode`) naming the
    field for: a reserved opcode, a non-zero reserved field, an undefined code in a coded field, or an L2
    address beyond `l2_words`."""
    if not isinstance(word, int) or not 0 <= word < (1 << WORD_BITS):
        raise DecodeError(ErrorCode.BAD_OPCODE, f"an instruction is a 64-bit unsigned integer, not {word!r}")
    code = word >> BODY_BITS
    try:
        op = Opcode(code)
    except ValueError:
        raise DecodeError(ErrorCode.BAD_OPCODE, f"field 'opcode': {code:#x} is reserved") from None
    fields = {}
    for f, pos in _positions(op):
        v = (word >> pos) & ((1 << f.width) - 1)
        if f.reserved:
            if v:
                raise DecodeError(ErrorCode.RESERVED_BITS,
                                  f"reserved field {f.name!r} of {op.name} is {v:#x}; it must be 0")
            continue
        if f.kind is not None:
            try:
                v = f.kind(v)
            except ValueError:
                raise DecodeError(ErrorCode.BAD_FUNCTION,
                                  f"field {f.name!r} of {op.name}: {v:#x} is not a defined "
                                  f"{f.kind.__name__}") from None
        elif f.l2_addr and l2_words is not None and v >= l2_words:
            raise DecodeError(ErrorCode.ADDRESS_RANGE,
                              f"field {f.name!r} of {op.name}: address {v:#x} is beyond L2 ({l2_words} words)")
        fields[f.name] = v
    if op is Opcode.MEMCPY and fields["from_device"] and fields["to_device"]:
        raise DecodeError(ErrorCode.BAD_FUNCTION, "fields 'from_device' and 'to_device' of MEMCPY are both 1 "
                                                  "(host to host is undefined)")
    return Instruction(op, fields)


def field_table(op: Opcode) -> str:
    """The markdown field table of one format (word bits, width, field), as docs/isa.md shows it."""
    rows = [f"| 63:60 | 4 | opcode = {op.value:#x} |"]
    pos = BODY_BITS
    for f in FORMATS[op]:
        hi, lo = pos - 1, pos - f.width
        pos = lo
        bits = f"{hi}" if hi == lo else f"{hi}:{lo}"
        what = f.name + (f" ({f.kind.__name__})" if f.kind is not None else "") + (" L2 word address" if f.l2_addr else "")
        rows.append(f"| {bits} | {f.width} | {what} |")
    return "\n".join(["| word bits | width | field |", "|---|---|---|"] + rows)
