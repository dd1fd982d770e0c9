"""The controller's plan of one instruction: the steps the RTL controller starts for it, in order.

The controller (`hdl.controller`, docs/architecture.md "The NPU in RTL") executes an instruction as a short
sequence of steps. `plan` states that sequence once, from the decoded instruction and the machine state it
depends on; the ISS counts its steps (`sim.iss.Counters`: ``passes``, ``pass_elements``, ``alu_ops``,
``attn_recips``), the perf model prices them (`firmware.perf`), and a full-chip bench monitor can compare them
with the steps the RTL starts, instruction by instruction. Four kinds of step:

- `Pass`: one pass of the pass engine, `n` elements from a source through the SFU (or around it: ``op``
  None, the controller's ``bypass``) into a sink. ``src``, ``b`` and ``sink`` are the names of the
  controller's ``Src``, ``BSrc`` and ``Sink`` members, ``op`` the name of an `hdl.sfu.SfuOp` member, ``fmt``
  a DDR source's `hdl.ddrio.DdrFormat` member.
- `Engine`: one command to the GEMV engine (WGEMV; INT8 ATTN's K and V GEMVs).
- `Gemm`: one WGEMM token tile to the GEMM unit, after that tile's quantiser passes (one per token).
- `Alu`: one scalar-ALU operation (binary32 add, multiply or int -> float).

Where the controller starts an engine command and a pass in one state (INT8 ATTN: a head's first V GEMV and
the RECIP pass of its softmax sum), the `Engine` step comes first and the pass has ``beside=True``.

The plan is that of an instruction that passes its checks; a failing instruction stops somewhere in it (the
ISS reports where and why). Values the controller reads from a descriptor come from the `firmware.pack`
descriptor the instruction names (`State.desc`; a KV slot's width is ``heads * head_dim``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hdl.isa import DESC_WORDS, VEC_REDUCTIONS, CvoFunc, DmaDir, Opcode, ScalarFunc, VecFunc
from hdl.l2 import LANES
from hdl.sfu import REDUCE_OPS, SHORT_OPS, SfuOp

__all__ = ["Pass", "Engine", "Gemm", "Alu", "Step", "State", "plan", "wgemm_steps", "attn_positions", "attn_pieces",
           "attn_chunks", "attn_k_group", "PASS_KINDS", "SOURCES", "B_SOURCES", "SINKS", "DDR_FORMATS", "DESC_LOAD",
           "ATTN_RECIP"]

# The names of the controller's Src, BSrc and Sink members (tests/test_plan.py checks them against
# hdl.controller): strings, so that the model does not depend on the controller.
SOURCES = ("L2", "PAIRS", "DDR", "REG", "PACK")
B_SOURCES = ("NONE", "L2")
SINKS = ("L2", "REG", "DDR", "DESC", "QUANT", "MASK")
DDR_FORMATS = ("F32", "F16", "INT4")        # hdl.ddrio.DdrFormat
# What a pass costs like (firmware.perf.Rates: ``<kind>_pass``): "sfu" (the SFU's functions), "vec" (its short
# path, element-wise: `hdl.sfu.SHORT_OPS` from L2), "reduce" (the short path to one result), "copy" (around the
# SFU, L2 or a scalar into L2 or a scalar), "quant" (L2 -> the activation quantiser or the GEMV engine's row
# mask, four elements a cycle), "ddr_read", "ddr_copy" (DDR binary32 around the SFU into L2: the `DdrReader`'s
# wide commands, an L2 word a cycle; DMA), "ddr_write", "ddr_scatter" (a DDR write whose elements' bytes go a
# `stride` apart, a one-beat burst each: KVST's V rows).
PASS_KINDS = ("sfu", "vec", "reduce", "copy", "quant", "ddr_read", "ddr_copy", "ddr_write", "ddr_scatter")

_OPS = frozenset(op.name for op in SfuOp)
_REDUCE = frozenset(op.name for op in REDUCE_OPS)
_SHORT = frozenset(op.name for op in SHORT_OPS)


def _check_count(owner: str, name: str, v, least: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        requirement = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ValueError(f"{owner}.{name} must be {requirement}, not {v!r}")


@dataclass(frozen=True)
class Pass:
    """One pass: `n` elements (the ``n`` of the controller's pass command, `hdl.controller.passes.pass_layout`)
    from `src` (and `b`) through SFU operation `op` (None: around the SFU) into `sink`. `beside`: started in the
    same cycle as the `Engine` step before it, and run beside that command (INT8 ATTN's RECIP). `fmt`: the
    format of a DDR source's elements (`DDR_FORMATS`), None for every other source. `stride`: a DDR sink that
    scatters its elements' low bytes a stride apart (`hdl.ddrwrite.DdrWriter`; KVST's V rows)."""
    op: str | None
    src: str
    b: str
    sink: str
    n: int
    fmt: str | None = None
    beside: bool = False
    stride: bool = False

    def __post_init__(self):
        if self.op is not None and self.op not in _OPS:
            raise ValueError(f"Pass.op must be None or the name of an hdl.sfu.SfuOp member, not {self.op!r}")
        for name, names in (("src", SOURCES), ("b", B_SOURCES), ("sink", SINKS)):
            if getattr(self, name) not in names:
                raise ValueError(f"Pass.{name} must be one of {', '.join(names)}, not {getattr(self, name)!r}")
        if (self.src == "DDR") != (self.fmt in DDR_FORMATS):
            raise ValueError(f"Pass.fmt must be one of {', '.join(DDR_FORMATS)} for a DDR source and None for "
                             f"any other, not {self.fmt!r} with src {self.src!r}")
        _check_count("Pass", "n", self.n, 1)
        if self.stride and self.sink != "DDR":
            raise ValueError(f"Pass.stride needs the DDR sink, not {self.sink!r}")

    @property
    def kind(self) -> str:
        """What the pass costs like (`PASS_KINDS`)."""
        if self.sink == "DDR":
            return "ddr_scatter" if self.stride else "ddr_write"
        if self.src == "DDR":
            return "ddr_copy" if self.op is None and self.sink == "L2" and self.fmt == "F32" else "ddr_read"
        if self.sink in ("QUANT", "MASK"):
            return "quant"
        if self.op is None:
            return "copy"
        if self.op in _REDUCE:
            return "reduce"
        if self.op in _SHORT and self.src == "L2":
            return "vec"
        return "sfu"


@dataclass(frozen=True)
class Engine:
    """One GEMV engine command: `rows` x `cols` of INT4 weights (dense: row-major; `sparse`: column-major,
    the columns of zero activations skipped), accumulating onto the old rows with `accm`, for `vectors`
    activation vectors (a WGEMM tile where the GEMV engine takes several, ``gemv_vectors`` > 1); with `int8`,
    dense INT8 weights, one a byte (INT8 ATTN's V rows, ``kv_v_layout`` "rows")."""
    rows: int
    cols: int
    accm: bool
    sparse: bool
    vectors: int = 1
    int8: bool = False

    def __post_init__(self):
        _check_count("Engine", "rows", self.rows, 1)
        _check_count("Engine", "cols", self.cols, 1)
        _check_count("Engine", "vectors", self.vectors, 1)


@dataclass(frozen=True)
class Gemm:
    """One WGEMM token tile: `tokens` (at most ``gemm_tile``) token vectors through `rows` x `cols` INT4
    weights on the GEMM unit (or, with ``gemv_vectors`` > 1, the GEMV engine), accumulating with `accm`."""
    rows: int
    cols: int
    tokens: int
    accm: bool

    def __post_init__(self):
        for name in ("rows", "cols", "tokens"):
            _check_count("Gemm", name, getattr(self, name), 1)


@dataclass(frozen=True)
class Alu:
    """One scalar-ALU operation (SCALAR ADD/SUB/MUL/MULI/ADDI/LDPOS; RMSNORM's two per segment)."""


Step = Pass | Engine | Gemm | Alu


@dataclass(frozen=True)
class State:
    """The machine state a plan depends on.

    Parameters
    ----------
    vl, hd : the vector length VL and head dimension HD (CTRL SETVL, SETHD)
    pos : the POSITION register
    desc : the `firmware.pack.Descriptor` the instruction names (WGEMV, WGEMM, GATHER: ``desc``; KVST, ATTN:
        ``slot``), as `sim.iss.Machine` holds it in ``image.descriptors``; None for the others
    fmap : ATTN: the FMAP shape-cache entry at its ``shape_ptr``, (heads, head_dim, window)
    """
    vl: int = 0
    hd: int = 0
    pos: int = 0
    desc: object = None
    fmap: tuple[int, int, int] = (0, 0, 0)


# The descriptor load of WGEMV, WGEMM, GATHER, KVST and ATTN: its `hdl.isa.DESCRIPTOR` words from DDR
DESC_LOAD = Pass(None, "DDR", "NONE", "DESC", DESC_WORDS, "F32")
# INT8 ATTN: 1 / sum of a head's softmax, beside the head's first V GEMV
ATTN_RECIP = Pass("RECIP", "REG", "NONE", "REG", 1, beside=True)


def _quant(n: int) -> Pass:
    return Pass(None, "L2", "NONE", "QUANT", n)


def attn_positions(pos: int, window: int) -> int:
    """The positions ATTN attends to at position `pos` (its ``a_n``): all up to `pos`, or the last `window`."""
    return min(pos + 1, window) if window else pos + 1


def attn_pieces(pos: int, n: int, capacity: int) -> list[tuple[int, int]]:
    """The ring slots INT8 ATTN reads at position `pos` for its `n` positions (`attn_positions`) in a slot of
    `capacity` ring rows, as ``(first slot, slots)`` pieces in the order of the scores: all `capacity` slots in
    slot order where ``n == capacity``; else the n slots from ``(pos + 1 - n) mod capacity`` on (the oldest
    position first), wrapping at the ring's end into a second piece from slot 0. A ring wider than the window
    (the room for the tokens a program stores before a KV-sharing layer reads it) takes the second form."""
    if n == capacity:
        return [(0, n)]
    s0 = (pos + 1 - n) % capacity
    n1 = min(n, capacity - s0)
    return [(s0, n1)] + ([(0, n - n1)] if n1 < n else [])


def attn_k_group(hw, n: int) -> int:
    """The query heads whose scores one pair of INT8 ATTN's K GEMVs computes over `n` positions: on a GEMV engine
    of ``gemv_vectors`` V > 1 vectors, V (the group's queries as the engine's vectors, each K plane read once for
    them) where V rows of scores, each `n` rounded up to a whole L2 word, fit the controller's scratch; else 1.
    The last group of an instruction takes the heads left."""
    V = hw.gemv_vectors
    stride = -(-n // LANES) * LANES                  # binary32 elements per L2 word
    return V if V > 1 and V * stride <= hw.l2_scratch_bytes // 4 else 1


def wgemm_steps(rows: int, cols: int, tokens: int, accm: bool, hw) -> list:
    """A WGEMM's steps after its descriptor load: per token tile of up to ``hw.gemm_tile`` tokens, one
    quantiser pass per token, then the tile's `Gemm` (the GEMM unit's tile), or where the GEMV engine runs WGEMM
    (``gemv_vectors`` > 1) its `Engine` command of that many vectors."""
    steps = []
    for t0 in range(0, tokens, hw.gemm_tile):
        n = min(hw.gemm_tile, tokens - t0)
        tile = Engine(rows, cols, bool(accm), False, n) if hw.gemv_vectors > 1 else Gemm(rows, cols, n, bool(accm))
        steps += [_quant(cols)] * n + [tile]
    return steps


def _scalar(i, st, hw):
    f = i.func
    if f in (ScalarFunc.ADD, ScalarFunc.SUB, ScalarFunc.MUL, ScalarFunc.MULI, ScalarFunc.ADDI, ScalarFunc.LDPOS):
        return [Alu()]
    if f in (ScalarFunc.RSQRT, ScalarFunc.SQRT, ScalarFunc.RECIP, ScalarFunc.TANH):
        return [Pass(f.name, "REG", "NONE", "REG", 1)]
    if f is ScalarFunc.LD:
        return [Pass(None, "L2", "NONE", "REG", 1)]
    if f is ScalarFunc.ST:
        return [Pass(None, "REG", "NONE", "L2", 1)]
    return []                                   # LI, MAX, MAXI: in the register file, at once


def _dma(i, st, hw):
    if i.dir is DmaDir.DDR_TO_L2:
        return [Pass(None, "DDR", "NONE", "L2", st.vl, "F32")]
    if i.dir is DmaDir.L2_TO_DDR:
        return [Pass(None, "L2", "NONE", "DDR", st.vl)]
    return []                                   # L2_TO_L2 is BAD_FUNCTION


_TWO_OPERAND = (VecFunc.ADD, VecFunc.SUB, VecFunc.MUL, VecFunc.FMAS, VecFunc.GELU_MUL, VecFunc.DOT)


def _vec(i, st, hw):
    f, n, hd = i.func, st.vl, st.hd
    if f in (VecFunc.RMSNORM, VecFunc.RMSNORM_NG):
        # per HD segment: SUMSQ -> s; s * fp32(1/HD), + S[s] in the ALU; RSQRT; x * r (* g: MULS_MUL) into dst
        scale = Pass("MULS_MUL", "L2", "L2", "L2", hd) if f is VecFunc.RMSNORM else Pass("MULS", "L2", "NONE", "L2", hd)
        return [Pass("SUMSQ", "L2", "NONE", "REG", hd), Alu(), Alu(), Pass("RSQRT", "REG", "NONE", "REG", 1),
                scale] * (n // hd)
    if f is VecFunc.ROPE:
        # per head: four products into the scratch (x1 cos, x2 sin, x2 cos, x1 sin), then SUB and ADD into dst
        half = hd // 2
        return [Pass(op, "L2", "L2", "L2", half) for op in ("MUL", "MUL", "MUL", "MUL", "SUB", "ADD")] * (n // hd)
    b = "L2" if f in _TWO_OPERAND else "NONE"
    return [Pass(f.name, "L2", b, "REG" if f in VEC_REDUCTIONS else "L2", n)]


def _cvo(i, st, hw):
    f, n = i.func, i.length
    rope = f in (CvoFunc.ROPE_COS, CvoFunc.ROPE_SIN)
    red = f in (CvoFunc.REDUCE_SUM, CvoFunc.REDUCE_MAX)
    staged = bool(i.accm) and (rope or red)     # the result into the scratch, then added to dst
    steps = []
    if f is CvoFunc.SOFTCAP or (f is CvoFunc.SCALE and i.recip_scale):
        steps.append(Pass("RECIP", "REG", "NONE", "REG", 1))           # 1 / S[0]
    steps.append(Pass(f.name, "PAIRS" if rope else "L2", "L2" if i.accm and not staged else "NONE", "L2", n))
    if staged:
        steps.append(Pass("ADD", "L2", "L2", "L2", 1 if red else n))
    return steps


def _wgemv(i, st, hw):
    d = st.desc
    steps = [DESC_LOAD] + ([] if i.reuse else [_quant(d.cols)])
    if i.mask:          # the row mask's pass into the engine: one L2 element a row
        steps.append(Pass(None, "L2", "NONE", "MASK", d.rows))
    steps.append(Engine(d.rows, d.cols, bool(i.accm), bool(i.sparse)))
    if i.findemax:
        steps.append(Pass("REDUCE_MAX", "L2", "NONE", "REG", d.rows))
    return steps


def _wgemm(i, st, hw):
    d = st.desc
    return [DESC_LOAD] + wgemm_steps(d.rows, d.cols, i.tokens, i.accm, hw)


def _gather(i, st, hw):
    return [DESC_LOAD, Pass(None, "DDR", "NONE", "L2", st.desc.cols, "INT4")]


def _kvst(i, st, hw):
    d = st.desc
    if hw.kv_format == "fp16":
        w = d.heads * d.head_dim
        return [DESC_LOAD, Pass(None, "L2", "NONE", "DDR", w), Pass(None, "L2", "NONE", "DDR", w)]
    # per KV head: K into the quantiser and the packer, its two plane rows (8 nibbles a word) and two scale rows
    # out; V into the quantiser twice (its row exponent, then the values), its two plane columns and its scale
    hd = d.head_dim
    words = Pass(None, "PACK", "NONE", "DDR", hd // 8)
    scales = Pass(None, "PACK", "NONE", "DDR", -(-hd // hw.act_block))
    # V rows (``kv_v_layout`` "rows"): the row's INT8 values, a byte into each of the head_dim rows
    v = [words, words] if hw.kv_v_layout == "planes" else [Pass(None, "PACK", "NONE", "DDR", hd, stride=True)]
    head = [_quant(hd), words, words, scales, scales, _quant(hd), _quant(hd)] + v + [Pass(None, "REG", "NONE", "DDR", 1)]
    return [DESC_LOAD] + head * d.heads


def _attn(i, st, hw):
    heads, hd, window = st.fmap
    n = attn_positions(st.pos, window)
    if hw.kv_format == "fp16":
        # per position (oldest first) the K row into the scratch and a DOT per head into the scores; per head
        # MAX, EXP(s - max), SUM, RECIP, MULS; per position the V row and per head p into a scalar, p * V into dst
        row = Pass(None, "DDR", "NONE", "L2", hd, "F16")
        p = Pass(None, "L2", "NONE", "REG", 1)
        steps = [DESC_LOAD] + ([row] + [Pass("DOT", "L2", "L2", "L2", hd)] * heads) * n
        steps += [Pass("MAX", "L2", "NONE", "REG", n), Pass("EXP", "L2", "NONE", "L2", n),
                  Pass("SUM", "L2", "NONE", "REG", n), Pass("RECIP", "REG", "NONE", "REG", 1),
                  Pass("MULS", "L2", "NONE", "L2", n)] * heads
        steps += [row] + [p, Pass("MULS", "L2", "NONE", "L2", hd)] * heads
        steps += ([row] + [p, Pass("FMAS", "L2", "L2", "L2", hd)] * heads) * (n - 1)
        return steps
    # INT8: per group of heads (`attn_k_group`), each query into the quantiser (the engine's vectors 0, 1 ...);
    # the K GEMVs (lo, then hi with accm) into the scratch; then per head of the group MAX, EXP(s - max), SUM; the
    # V row scales (DDR) times the weights; per chunk of gemv_max_cols positions the weights into the quantiser
    # and the V GEMVs (lo, hi), RECIP(sum) beside the first; then times recip(sum)
    # The K GEMVs, the V row scales and the V chunks run piece by piece of the ring (`attn_pieces`; without a
    # slot descriptor, a ring of the n positions).
    pieces = attn_pieces(st.pos, n, n if st.desc is None else st.desc.capacity)
    head = [Pass("MAX", "L2", "NONE", "REG", n), Pass("EXP", "L2", "NONE", "L2", n),
            Pass("SUM", "L2", "NONE", "REG", n)] + [Pass("MUL", "DDR", "L2", "L2", k, "F16") for _, k in pieces]
    if hw.kv_v_layout == "rows":
        return _attn_v_rows(heads, hd, n, pieces, head, hw)
    for i, cols in enumerate(attn_chunks(pieces, hw)):
        head += [_quant(cols), Engine(hd, cols, i != 0, True)]
        if i == 0:
            head.append(ATTN_RECIP)
        head.append(Engine(hd, cols, True, True))
    head.append(Pass("MULS", "L2", "NONE", "L2", hd))
    steps, group = [DESC_LOAD], attn_k_group(hw, n)
    for h0 in range(0, heads, group):
        g = min(group, heads - h0)
        steps += [_quant(hd)] * g
        for _, k in pieces:
            steps += [Engine(k, hd, False, False, g), Engine(k, hd, True, False, g)]
        steps += head * g
    return steps


def _attn_v_rows(heads: int, hd: int, n: int, pieces, head: list, hw) -> list:
    """INT8 ATTN over V rows (``kv_v_layout`` "rows"), per group of heads (`attn_k_group`): the queries into the
    quantiser (the engine's vectors), the K GEMVs (lo, then hi with accm) per piece; per head of the group MAX,
    EXP(s - max), SUM, the V row scales times the weights, RECIP(sum); per V chunk each head's weights into the
    quantiser (vector h) and one GEMV of INT8 weights over the V rows for the whole group (accm after the
    first chunk); then per head times recip(sum)."""
    steps, group = [DESC_LOAD], attn_k_group(hw, n)
    recip = Pass("RECIP", "REG", "NONE", "REG", 1)
    for h0 in range(0, heads, group):
        g = min(group, heads - h0)
        steps += [_quant(hd)] * g
        for _, k in pieces:
            steps += [Engine(k, hd, False, False, g), Engine(k, hd, True, False, g)]
        steps += (head + [recip]) * g
        for i, cols in enumerate(attn_chunks(pieces, hw)):
            steps += [_quant(cols)] * g + [Engine(hd, cols, i != 0, False, g, int8=True)]
        steps += [Pass("MULS", "L2", "NONE", "L2", hd)] * g
    return steps


def attn_chunks(pieces, hw) -> list[int]:
    """The positions of INT8 ATTN's V chunks, in order: each piece of the ring (`attn_pieces`) in chunks of
    ``gemv_max_cols`` (the GEMV engine's activation memory)."""
    return [min(hw.gemv_max_cols, k - c0) for _, k in pieces for c0 in range(0, k, hw.gemv_max_cols)]


_PLANS = {Opcode.SCALAR: _scalar, Opcode.DMA: _dma, Opcode.VEC: _vec, Opcode.CVO: _cvo, Opcode.WGEMV: _wgemv,
          Opcode.WGEMM: _wgemm, Opcode.GATHER: _gather, Opcode.KVST: _kvst, Opcode.ATTN: _attn}


def plan(insn, state: State, hw) -> list:
    """The steps (`Pass`, `Engine`, `Gemm`, `Alu`) the controller starts for the decoded instruction `insn`
    (`hdl.isa.Instruction`) in machine state `state` on hardware `hw` (`hdl.config.HardwareConfig`), in the
    order it starts them. CTRL and MEMSET start none (SETHD's 1/HD is a sequential divider), nor do the pccx
    GEMV, GEMM and MEMCPY (BAD_FUNCTION)."""
    fn = _PLANS.get(insn.op)
    return [] if fn is None else fn(insn, state, hw)
