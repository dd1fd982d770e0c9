"""Instruction-set simulator: runs NPU programs on a packed DDR image, instruction by instruction.

Two arithmetics run the same program on the same image:

- ``reference``: float64 everywhere, unquantised weights (the checkpoint's values, found through the
  manifest), exact transcendental functions. A compiled token program run this way must reproduce
  `sim.gemma3n.Model` (to 1e-6): this proves that the program computes Gemma 3n.
- ``count``: no arithmetic at all, only the counters, on an image that may hold no weights (a plan
  from ``pack(..., fill=False)``). Sparse layers count the columns of their target density, and
  attention the positions a full cache would hold: bytes per token for E4B without its 15 GB.
- ``hardware``: the NPU's arithmetic. L2 holds binary32; WGEMV and GATHER read the INT4 weights and
  binary16 scales from the image and compute with `sim.numerics` (bit-exact); activations are quantised
  to block-floating-point INT8 on the way into the GEMV; the KV cache holds binary16. Element-wise
  arithmetic is IEEE binary32 with round-to-nearest-even; transcendental functions and reductions are the
  SFU's bit-exact models (`sim.sfu`), in the order the hardware computes them (docs/numerics.md).

Both arithmetics run one composition of every instruction (`_Reference` and `_Hardware` supply the
primitive functions): a division is a multiply by a reciprocal, a mean a sum times 1/n, softmax
``exp(s - max) * recip(sum)``, and every reduction has one order, so the reference run proves the
composition and the hardware run is what the RTL must reproduce bit for bit.

Counters (`Counters`) record what does not depend on timing: instructions per opcode and bytes read and
written per DDR region, with sparse column skipping counted as the hardware fetches, and the steps the
controller starts for each instruction (its plan, `sim.plan`; `Machine.plan_of`, ``Machine.steps``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from hdl.isa import (
    SCALAR_REGS, SHAPE_SLOTS, VEC_REDUCTIONS, CtrlFunc, CvoFunc, DdrRegion, DecodeError, DmaDir, ErrorCode, Opcode,
    ScalarFunc, ShapeCache, VecFunc, decode,
)

from .config import ModelConfig, check_index
from .gemma3n import check_weight_dtype, check_weight_values
from . import sfu
from .numerics import (V_PLANE_LOG2_GROUP, KvInt8Layout, gemv, pack_int4, quantize_activations, quantize_kv_k,
                       quantize_kv_v, unpack_int4)
from .plan import Alu, Engine, Pass, State, attn_chunks, attn_k_group, attn_pieces, attn_positions, plan
from .systolic import gemm

__all__ = ["Machine", "Counters", "ExecutionError", "REFERENCE", "HARDWARE", "COUNT"]

REFERENCE = "reference"
HARDWARE = "hardware"
COUNT = "count"      # no arithmetic: instructions and bytes only (E4B without its weights)


class ExecutionError(RuntimeError):
    """The program stopped on an error; `code` is the `ErrorCode` the hardware would report and `pc` the
    index of the offending instruction."""

    def __init__(self, code: ErrorCode, pc: int, message: str):
        super().__init__(f"instruction {pc}: {message}")
        self.code = code
        self.pc = pc


@dataclass
class Counters:
    instructions: Counter = field(default_factory=Counter)        # opcode name (with function) -> count
    bytes_read: Counter = field(default_factory=Counter)          # region -> bytes
    bytes_written: Counter = field(default_factory=Counter)
    weight_bytes_skipped: int = 0                                  # sparse WGEMV columns not fetched
    elements: Counter = field(default_factory=Counter)             # opcode name -> elements processed
    # The RTL controller's passes (`sim.plan`, docs/architecture.md): (opcode name, kind) -> passes and elements.
    # Kinds (`sim.plan.Pass.kind`): "sfu" (through the SFU's long path: the functions), "vec" (its short path:
    # the element-wise arithmetic, `hdl.sfu.SHORT_OPS`), "reduce" (the short path to one result), "copy" (L2 ->
    # L2 or a scalar), "quant" (L2 -> the activation quantiser, four elements per cycle: `hdl.l2.ElemReader`
    # beats), "ddr_read", "ddr_copy" (DDR binary32 into L2, an L2 word a cycle: DMA), "ddr_write". Not a WGEMM's:
    # `firmware.perf.wgemm_cost` prices it from its shape.
    passes: Counter = field(default_factory=Counter)
    pass_elements: Counter = field(default_factory=Counter)
    alu_ops: int = 0                                               # scalar-ALU operations (add, mul, int->float)
    gemv_bytes: int = 0                                            # weight + scale bytes streamed by WGEMV
    # sparse WGEMVs by shape, (rows, cols, group, non-zero columns) -> count: their time is bound by the
    # engine's per-row binary32 parts, not by their bytes (firmware.perf.sparse_gemv_cycles)
    sparse_gemvs: Counter = field(default_factory=Counter)
    # masked WGEMVs by shape, (rows, cols, group, live rows) -> count: the engine gathers the live rows first
    # and merges every row, live or not, one a cycle (firmware.perf.masked_gemv_cycles)
    masked_gemvs: Counter = field(default_factory=Counter)
    # ATTN on the GEMV engine (kv_format "int8"): its engine commands, their bytes (KV planes and scales; not
    # in gemv_bytes) and its sparse commands by shape (as sparse_gemvs)
    attn_gemvs: int = 0
    attn_gemv_bytes: int = 0
    attn_sparse_gemvs: Counter = field(default_factory=Counter)
    # its K GEMVs of several query heads at once (`sim.plan.attn_k_group`) by shape, (rows, cols, group, vectors)
    # -> count: bound by the larger of their bytes and the engine's binary32 parts (firmware.perf)
    attn_group_gemvs: Counter = field(default_factory=Counter)
    # its V GEMVs of INT8 weights over the V rows (``kv_v_layout`` "rows") by shape, (rows, positions, vectors)
    # -> count: bound by the larger of their bytes and the engine's binary32 parts (firmware.perf)
    attn_v_gemvs: Counter = field(default_factory=Counter)
    # INT8 ATTN's RECIP pass per head, which runs beside the head's first chunk of V GEMVs (two sparse commands of
    # this shape, as attn_sparse_gemvs): it costs only what it outlasts them by (firmware.perf.cycles_of)
    attn_recips: Counter = field(default_factory=Counter)

    def total_read(self) -> int:
        return sum(self.bytes_read.values())


class _Reference:
    """Exact functions in float64: the reference arithmetic's primitives."""

    dtype = np.float64

    def __init__(self, hw):
        self.hw = hw

    @staticmethod
    def exp(x):
        return np.exp(x)

    @staticmethod
    def tanh(x):
        return np.tanh(x)

    @staticmethod
    def gelu_tanh(x):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))

    @staticmethod
    def sqrt(x):
        return np.sqrt(x)

    @staticmethod
    def rsqrt(x):
        return 1.0 / np.sqrt(x)

    @staticmethod
    def recip(x):
        return 1.0 / x

    @staticmethod
    def sin(x):
        return np.sin(x)

    @staticmethod
    def cos(x):
        return np.cos(x)

    @staticmethod
    def _turns(t):
        return 2.0 * np.pi * (np.asarray(t, dtype=np.uint64).astype(np.float64) / 2.0**64)

    def sin_turns(self, t):
        return np.sin(self._turns(t))

    def cos_turns(self, t):
        return np.cos(self._turns(t))

    @staticmethod
    def reduce_sum(x):
        return np.sum(x, axis=-1)

    @staticmethod
    def reduce_max(x):
        return np.max(x, axis=-1)


class _Hardware:
    """The SFU's bit-exact binary32 models (`sim.sfu`); element-wise + and x are NumPy binary32 (RNE)."""

    dtype = np.float32

    def __init__(self, hw):
        self.hw = hw
        self._sfu = sfu
        for name in ("exp", "tanh", "gelu_tanh", "sqrt", "rsqrt", "recip", "sin", "cos", "sin_turns", "cos_turns"):
            setattr(self, name, getattr(sfu, name))

    def _rows(self, fn, x):
        x = np.asarray(x, dtype=np.float32)
        if x.ndim == 1:
            return np.float32(fn(x, self.hw))
        return np.array([fn(r, self.hw) for r in x.reshape(-1, x.shape[-1])], np.float32).reshape(x.shape[:-1])

    def reduce_sum(self, x):
        return self._rows(self._sfu.reduce_sum, x)

    def reduce_max(self, x):
        return self._rows(self._sfu.reduce_max, x)


class Machine:
    """One NPU, as the ISS sees it: L2, scalar registers, CSRs, the KV cache, the DDR image.

    Parameters
    ----------
    image : firmware.pack.Image
        The packed DDR image with its manifest.
    arithmetic : ``"reference"`` or ``"hardware"``
    source : mapping, optional
        The unquantised tensors (canonical names) that reference arithmetic reads; required for it. Values
        are arrays or anything that indexes rows like one (``t[i]``, ``t[a:b]``: `sim.checkpoint.LazyTensor`),
        so a checkpoint is read row by row as the program uses it. Their dtypes are checked here and the rows
        read for finiteness (`sim.gemma3n.check_weight_dtype` / `check_weight_values`, the golden model's and
        the packer's messages).
    """

    # The TOKEN_ID and POSITION registers are 32 bits wide (hdl.csr_map).
    _CSR_RANGE = 1 << 32

    def __init__(self, image, hw, arithmetic: str = HARDWARE, source=None):
        if arithmetic not in (REFERENCE, HARDWARE, COUNT):
            raise ValueError(f"arithmetic must be {REFERENCE!r}, {HARDWARE!r} or {COUNT!r}, not {arithmetic!r}")
        if arithmetic == REFERENCE and source is None:
            raise ValueError("reference arithmetic needs the unquantised source tensors")
        if arithmetic == REFERENCE:
            for name, value in source.items():
                check_weight_dtype(name, value)
        self.image = image
        self.hw = hw
        self.arithmetic = arithmetic
        self.source = source
        self.dtype = np.float64 if arithmetic == REFERENCE else np.float32
        self.f = _Reference(hw) if arithmetic == REFERENCE else _Hardware(hw) if arithmetic == HARDWARE else None
        self.l2_words = hw.l2_bytes // 16
        self.scratch_elements = hw.l2_scratch_bytes // 4     # the controller's buffers (ROPE, ATTN, CVO accm)
        self.l2 = np.zeros(self.l2_words * 4, dtype=self.dtype)
        self.model = ModelConfig.from_hf(image.config)
        self.s = np.zeros(SCALAR_REGS, dtype=self.dtype)
        self.shape_cache = {ShapeCache.FMAP: np.zeros((SHAPE_SLOTS, 3), np.int64),
                            ShapeCache.WEIGHT: np.zeros((SHAPE_SLOTS, 3), np.int64)}
        self.vl = 0
        self.hd = 0
        self.emax = self.dtype(0)
        # the GEMV engine's activations (WGEMV `reuse`): the last vector quantised into it and its length ACT_N
        self.act_x, self.act_n = None, 0
        self.token = 0
        self.pos = 0
        self.counters = Counters()
        self.touched: list[tuple[int, int]] = []     # L2 element ranges [lo, hi) the current instruction used
        self.steps: list = []                         # the controller's steps for it (`plan_of`)
        self._v_nonzero: list = []    # INT8 ATTN: per head, the V columns its first chunk's GEMVs fetch (or None: all)
        self._kv = {}
        self._const_index = sorted((e.offset, e.nbytes, name) for name, e in image.tensors.items()
                                   if e.region == "CONST")
        # mirror of the LOGITS region: rows of `logit_stride` elements (a token's logits each), `logits` the first
        self._stride = -(-self.model.vocab_size // 4) * 4
        self._logit_rows = np.zeros(image.regions["LOGITS"][1] // 4, dtype=self.dtype)
        self.logits = self._logit_rows[:self.model.vocab_size]
        self.reset_kv()
        if arithmetic == HARDWARE:
            self._load_kv()

    # --- host interface --------------------------------------------------------------------------------

    def reset_kv(self) -> None:
        kv = {}
        if self.arithmetic == COUNT:
            self._kv = kv
            return
        for d in self.image.descriptors:
            if d.kind != 2:
                continue
            shape = (d.capacity, d.heads, d.head_dim)
            if self._int8_kv():
                nb = self._kv_layout(d).kblocks
                kv[d.index] = {"k_hi": np.zeros(shape, np.int8), "k_lo": np.zeros(shape, np.int8),
                               "ks_hi": np.zeros(shape[:2] + (nb,), np.float16),
                               "ks_lo": np.zeros(shape[:2] + (nb,), np.float16),
                               "vs": np.zeros(shape[:2], np.float16)}
                kv[d.index].update({name: np.zeros(shape, np.int8) for name in self._v_names()})
            else:
                kv[d.index] = (np.zeros(shape, self.dtype if self.arithmetic == REFERENCE else np.float16),
                               np.zeros(shape, self.dtype if self.arithmetic == REFERENCE else np.float16),
                               np.full(d.capacity, -1, np.int64))
        self._kv = kv

    def logit_rows(self, n: int) -> np.ndarray:
        """The LOGITS region's first `n` rows (``[n, vocab]``, a view): token t's logits of a program that
        leaves every token's (row 0: `logits`)."""
        if not 1 <= n <= self._logit_rows.size // self._stride:
            raise ValueError(f"LOGITS holds {self._logit_rows.size // self._stride} rows, not {n}")
        return self._logit_rows[:n * self._stride].reshape(n, self._stride)[:, :self.model.vocab_size]

    def kv_save(self, rows) -> list:
        """A copy of the KV cache at ring rows ``(slot, row)`` (descriptor index, row), for `kv_restore`."""
        out = []
        for slot, row in rows:
            kv = self._kv[slot]
            out.append((slot, row, {k: a[row].copy() for k, a in kv.items()} if isinstance(kv, dict)
                        else tuple(a[row].copy() for a in kv)))
        return out

    def kv_restore(self, saved) -> None:
        """Put back the rows `kv_save` copied."""
        for slot, row, val in saved:
            kv = self._kv[slot]
            for k, a in (kv.items() if isinstance(kv, dict) else enumerate(kv)):
                a[row] = val[k]

    def kv_copy(self, src: int, dst: int) -> None:
        """KV slot `dst` (descriptor index) becomes a copy of slot `src` (slots of one shape)."""
        a, b = self._kv[src], self._kv[dst]
        for k, arr in (a.items() if isinstance(a, dict) else enumerate(a)):
            b[k][...] = arr

    def _kv_layout(self, d) -> KvInt8Layout:
        return KvInt8Layout(d.capacity, d.heads, d.head_dim, self.hw.act_block, self.hw.kv_v_layout)

    def _v_names(self) -> tuple[str, ...]:
        """The INT8 cache's V arrays: its two INT4 planes, or its INT8 rows (``kv_v_layout``)."""
        return ("v_hi", "v_lo") if self.hw.kv_v_layout == "planes" else ("v",)

    def _int8_kv(self) -> bool:
        """The INT8 KV cache runs in hardware arithmetic; reference arithmetic keeps exact K and V."""
        return self.hw.kv_format == "int8" and self.arithmetic != REFERENCE

    def kv_cache(self, slot: int):
        """The ISS's copy of KV slot `slot` (descriptor index). ``kv_format`` "fp16" (and reference arithmetic):
        (K, V), each ``[capacity, heads, head_dim]`` (binary16 in hardware arithmetic). "int8": a dict of the
        planes ``k_hi, k_lo`` and ``v_hi, v_lo`` (``kv_v_layout`` "planes"; INT4 values) or ``v`` ("rows"; INT8
        values), each ``[capacity, heads, head_dim]``, the K scales ``ks_hi,
        ks_lo`` ``[capacity, heads, ceil(head_dim / act_block)]`` and the V scales ``vs`` ``[capacity, heads]``
        (binary16)."""
        kv = self._kv[slot]
        return kv if isinstance(kv, dict) else kv[:2]

    def _load_kv(self) -> None:
        """The INT8 KV cache the image's KV region holds (zeros from `firmware.pack`; a bench may prepare one),
        read as the NPU reads it: the inverse of `kv_bytes` (for every slot: one whose descriptor names the
        other format is never used, and its bytes stay as they are)."""
        base, size = self.image.region("KV")
        for d in self.image.descriptors:
            if d.kind != 2 or not self._int8_kv():
                continue        # binary16 slots start empty: their positions are tracked, not in DDR
            kv = self._kv[d.index]
            raw = self.image.view("KV", d.weight_offset, size - d.weight_offset)
            lay = self._kv_layout(d)
            C, D, nb = d.capacity, d.head_dim, lay.kblocks
            for j in range(d.heads):
                for name, at in self._int4_planes(lay):
                    kv[name][:, j] = unpack_int4(raw[at(j):at(j) + lay.plane].reshape(C, D // 2))
                if lay.v_layout == "rows":
                    kv["v"][:, j] = raw[lay.v(j):lay.v(j) + C * D].view(np.int8).reshape(D, C).T
                for name, at in (("ks_hi", lay.ks_hi), ("ks_lo", lay.ks_lo)):
                    kv[name][:, j] = raw[at(j):at(j) + lay.kscale].view("<f2").reshape(C, nb)
                kv["vs"][:, j] = raw[lay.vs(j):lay.vs(j) + 2 * C].view("<f2")

    @staticmethod
    def _int4_planes(lay: KvInt8Layout) -> tuple:
        """The slot's INT4 planes, (name in the ISS's copy, offset of head j's plane)."""
        planes = (("k_hi", lay.k_hi), ("k_lo", lay.k_lo))
        return planes + ((("v_hi", lay.v_hi), ("v_lo", lay.v_lo)) if lay.v_layout == "planes" else ())

    def kv_bytes(self, slot: int) -> np.ndarray:
        """KV slot `slot` as the NPU holds it in its KV region (firmware.pack layout), uint8, from the ISS's copy
        (hardware arithmetic)."""
        d = self.image.descriptors[slot]
        kv = self._kv[slot]
        if not isinstance(kv, dict):
            k, v, _ = kv
            return np.concatenate([k.astype("<f2").reshape(-1), v.astype("<f2").reshape(-1)]).view(np.uint8)
        lay = self._kv_layout(d)
        out = np.zeros(lay.nbytes, np.uint8)

        def put(off, raw):
            out[off:off + raw.size] = raw
        for j in range(d.heads):
            for name, at in self._int4_planes(lay):
                put(at(j), pack_int4(kv[name][:, j]).reshape(-1))          # [C, D]: a K row or a V column per position
            if lay.v_layout == "rows":
                put(lay.v(j), kv["v"][:, j].T.reshape(-1).view(np.uint8))  # [D, C]: a byte per position in each row
            put(lay.ks_hi(j), kv["ks_hi"][:, j].astype("<f2").reshape(-1).view(np.uint8))
            put(lay.ks_lo(j), kv["ks_lo"][:, j].astype("<f2").reshape(-1).view(np.uint8))
            put(lay.vs(j), kv["vs"][:, j].astype("<f2").view(np.uint8))
        return out

    def run(self, program: list[int], *, token: int, pos: int, trace=None) -> None:
        """Execute a whole program (until HALT) for one token at one position.

        `trace`, if given, is called after every executed instruction (HALT included) as
        ``trace(pc, insn, machine)``; ``machine.touched`` then holds the L2 element ranges the instruction
        read or wrote (outside the controller's scratch), ``machine.steps`` the steps the controller started for
        it (`sim.plan.plan`, what ``counters.passes`` counts), ``machine.counters`` its counts so far.

        `token` and `pos` are what the host writes to TOKEN_ID and POSITION: Python or NumPy integers in
        ``[0, 2**32)`` (TypeError or ValueError otherwise, in `firmware.runtime.Runtime.step`'s words). A token
        beyond a table or a position beyond a KV slot is the program's error (`ExecutionError`), as on the NPU."""
        self.token = check_index("token id", token, self._CSR_RANGE, "the 32-bit TOKEN_ID register")
        self.pos = check_index("position", pos, self._CSR_RANGE, "the 32-bit POSITION register")
        # START resets the architectural registers (the hardware resets its controller); L2, the shape cache
        # and DDR keep their contents
        self.s[:] = 0
        self.vl = self.hd = 0
        self.emax = self.dtype(0)
        self.act_x, self.act_n = None, 0
        for pc, word in enumerate(program):
            try:
                insn = decode(word, l2_words=self.l2_words)
            except DecodeError as e:
                raise ExecutionError(e.code, pc, str(e)) from None
            name = insn.op.name + ("." + insn.fields["func"].name if "func" in insn.fields else "")
            self.counters.instructions[name] += 1
            self._name = name
            self.touched, self.steps, self._v_nonzero = [], [], []
            if insn.op is Opcode.CTRL and insn.func is CtrlFunc.HALT:
                if trace is not None:
                    trace(pc, insn, self)
                return
            try:
                getattr(self, "_x_" + insn.op.name.lower())(insn)
            except ExecutionError as e:
                raise ExecutionError(e.code, pc, str(e).split(": ", 1)[-1]) from None
            self.steps = self.plan_of(insn)
            self._count_steps(insn, self.steps)
            if trace is not None:
                trace(pc, insn, self)
        raise ExecutionError(ErrorCode.BAD_LENGTH, len(program), "the program ended without HALT")

    # --- helpers ----------------------------------------------------------------------------------------

    def _err(self, code: ErrorCode, msg: str):
        raise ExecutionError(code, -1, msg)

    def _source_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of the unquantised tensor `name` (reference arithmetic), float64, checked finite."""
        value = self.source[name]
        rows = np.asarray(value[start:stop], dtype=np.float64)
        check_weight_values(name, value, rows)
        return rows

    def _vec(self, word_addr: int, n: int) -> slice:
        start = word_addr * 4
        if n <= 0:
            self._err(ErrorCode.BAD_LENGTH, f"vector length {n} must be positive")
        if start + n > self.l2.size:
            self._err(ErrorCode.ADDRESS_RANGE, f"L2 range [{start}, {start + n}) (elements) exceeds L2 "
                                               f"({self.l2.size} elements)")
        self.touched.append((start, start + n))
        return slice(start, start + n)

    def _round(self, x):
        return np.asarray(x, dtype=self.dtype)

    def _desc(self, index: int):
        if index >= len(self.image.descriptors):
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {index} does not exist "
                                                f"({len(self.image.descriptors)} in the table)")
        self.counters.bytes_read["DESC"] += 32
        return self.image.descriptors[index]

    def plan_of(self, insn) -> list:
        """The steps the controller starts for the decoded instruction `insn` in the machine's current state
        (`sim.plan.plan`: VL, HD, POSITION, the descriptor it names, ATTN's FMAP entry). `run` keeps the plan of
        each executed instruction in ``steps``."""
        index = insn.slot if insn.op in (Opcode.KVST, Opcode.ATTN) else insn.fields.get("desc")
        if index is not None and index >= len(self.image.descriptors):
            raise ValueError(f"{insn.op.name} names descriptor {index}; the table has "
                             f"{len(self.image.descriptors)}")
        fmap = (0, 0, 0)
        if insn.op is Opcode.ATTN:
            fmap = tuple(int(v) for v in self.shape_cache[ShapeCache.FMAP][insn.shape_ptr])
        state = State(vl=self.vl, hd=self.hd, pos=self.pos,
                      desc=None if index is None else self.image.descriptors[index], fmap=fmap)
        return plan(insn, state, self.hw)

    def _count_steps(self, insn, steps) -> None:
        """Count the controller's `steps` for `insn` (its plan): passes by kind with their elements, ALU
        operations, and INT8 ATTN's RECIP passes by the shape of the V GEMV they run beside (with the V columns
        that GEMV fetches, `_v_nonzero`). A WGEMM's steps are not counted: `firmware.perf.wgemm_cost` prices
        the instruction from its shape."""
        if insn.op is Opcode.WGEMM:
            return
        c, name = self.counters, insn.op.name
        # a plan repeats a few step objects (ATTN: per position and head), so count each object once
        times = Counter(map(id, steps))
        beside = False
        for k, step in dict(zip(map(id, steps), steps, strict=True)).items():
            if isinstance(step, Alu):
                c.alu_ops += times[k]
            elif isinstance(step, Pass) and step.beside:
                beside = True
            elif isinstance(step, Pass):
                key = (name, step.kind)
                c.passes[key] += times[k]
                c.pass_elements[key] += times[k] * step.n
        if not beside:
            return
        engine, nonzero = None, iter(self._v_nonzero)
        for step in steps:
            if isinstance(step, Engine):
                engine = step
            elif isinstance(step, Pass) and step.beside:
                nz = next(nonzero, None)
                c.attn_recips[(engine.rows, engine.cols, 1 << V_PLANE_LOG2_GROUP,
                               engine.cols if nz is None else nz)] += 1

    # --- instructions -----------------------------------------------------------------------------------

    def _x_wgemv(self, i):
        d = self._desc(i.desc)
        if d.kind != 0:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {i.desc} is not a weight matrix")
        if i.mask and not self.hw.gemv_row_mask:
            self._err(ErrorCode.BAD_FUNCTION, "WGEMV mask: this NPU's GEMV engine has no row mask")
        if i.mask and (i.sparse or not i.reuse):
            self._err(ErrorCode.BAD_FUNCTION, "WGEMV mask needs reuse (src then names the row mask) and a dense "
                                              "matrix")
        if i.mask:             # src is the row mask; the activations are the engine's (checked below)
            live = self.l2[self._vec(i.src, d.rows)] != 0
            x = None
        else:
            x = self.l2[self._vec(i.src, d.cols)]
        if i.reuse and not i.mask:   # the engine's activations, not src (checked below, after the shape checks)
            self.touched.pop()
        if i.sparse and d.layout != 1:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"sparse WGEMV needs a column-major matrix ({d.tensor})")
        if not i.sparse and d.layout != 0:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"dense WGEMV needs a row-major matrix ({d.tensor})")
        if d.cols > self.hw.gemv_max_cols or (i.sparse and (d.rows > self.hw.gemv_sparse_max_rows or d.rows % 2)) \
                or (i.mask and d.rows > self.hw.gemv_max_cols):
            self._err(ErrorCode.BAD_LENGTH, f"WGEMV of {d.rows} x {d.cols} exceeds the GEMV engine (at most "
                                            f"{self.hw.gemv_max_cols} columns; sparse: an even number of rows, at "
                                            f"most {self.hw.gemv_sparse_max_rows}; mask: at most "
                                            f"{self.hw.gemv_max_cols} rows)")
        if i.reuse:
            self._vec(i.dst, d.rows)
            self.touched.pop()
            if d.cols != self.act_n:
                self._err(ErrorCode.BAD_LENGTH, f"WGEMV reuse of {d.cols} activations, but the GEMV engine holds "
                                                f"{self.act_n}")
            x = self.act_x
        else:
            if self.arithmetic != COUNT and not np.all(np.isfinite(x)):
                self._err(ErrorCode.NON_FINITE, "a WGEMV input holds an infinity or a NaN")
            self.act_x, self.act_n = x.copy(), d.cols
        entry = self.image.tensors[d.tensor]
        ngroups = -(-d.cols // d.group)
        if self.arithmetic == COUNT:
            y = None
        elif self.arithmetic == REFERENCE:
            w = self._source_rows(d.tensor, d.row_start, d.row_start + d.rows)
            y = w @ x
        else:
            q_w, s_w = self._int4_rows(entry, d.row_start, d.rows)
            q_a, e_a = quantize_activations(x.astype(np.float32), self.hw.act_block)
            y = gemv(q_w, s_w, q_a, e_a, group=d.group, block=self.hw.act_block)
        if i.mask and y is not None:
            # the rows of a zero mask element are not fetched and read +0 (every row's result is its own)
            y = np.where(live, y, self.dtype(0))
        fetched = d.rows
        if i.mask:
            fetched = self._density_rows(d) if self.arithmetic == COUNT else int(np.count_nonzero(live))
            self.counters.masked_gemvs[(d.rows, d.cols, d.group, fetched)] += 1
            self.counters.weight_bytes_skipped += (d.rows - fetched) * ((d.cols + d.cols % 2) // 2 + ngroups * 2)
        # Bytes: dense reads every fetched row; sparse reads the columns of non-zero activations only.
        pcols = d.cols + d.cols % 2
        if i.sparse:
            # the engine skips the columns whose quantised activation is 0 (a tiny x can quantise to 0)
            nz = self._density_columns(d) if y is None else \
                np.count_nonzero(quantize_activations(x.astype(np.float32), self.hw.act_block)[0])
            read = nz * d.rows // 2
            self.counters.weight_bytes_skipped += (d.cols - nz) * d.rows // 2
            self.counters.sparse_gemvs[(d.rows, d.cols, d.group, int(nz))] += 1
        else:
            read = fetched * pcols // 2
        self.counters.bytes_read["WEIGHTS"] += read + fetched * ngroups * 2
        self.counters.gemv_bytes += read + fetched * ngroups * 2
        self.counters.elements[self._name] += 2 * read
        out = self._vec(i.dst, d.rows)
        if y is None:
            return
        if i.accm:
            y = self.l2[out] + y
        self.l2[out] = y
        if i.findemax:
            self.emax = self.dtype(self.f.reduce_max(y))

    def _x_wgemm(self, i):
        """T tokens through one weight matrix on the systolic array: token t reads L2[src + t*ceil(cols/4)]
        and writes L2[dst + t*ceil(rows/4)] (16-byte word strides). Bit-identical, token by token, to
        WGEMV (sim.systolic.gemm); the weights stream once per token tile of R = `HardwareConfig.gemm_tile`
        tokens (`systolic_rows`, or `gemv_vectors` where the GEMV engine runs WGEMM, which then holds no
        reusable activations: ACT_N 0), and the tiles run one after another: a non-finite input in tile j stops
        the instruction with the results of tiles 0 .. j-1 written (docs/isa.md)."""
        d = self._desc(i.desc)
        if d.kind != 0 or d.layout != 0:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {i.desc} is not a row-major weight matrix")
        if d.group != self.hw.weight_group:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {i.desc} has weight groups of {d.group}; the "
                                                f"systolic array's scale lanes take groups of {self.hw.weight_group}")
        if i.tokens == 0:
            self._err(ErrorCode.BAD_LENGTH, "WGEMM needs at least one token")
        if d.cols > self.hw.gemv_max_cols:
            self._err(ErrorCode.BAD_LENGTH, f"WGEMM of {d.cols} columns exceeds the activation memory "
                                            f"({self.hw.gemv_max_cols})")
        t_count = i.tokens
        in_stride, out_stride = -(-d.cols // 4), -(-d.rows // 4)
        srcs = [self._vec(i.src + t * in_stride, d.cols) for t in range(t_count)]
        outs = [self._vec(i.dst + t * out_stride, d.rows) for t in range(t_count)]
        entry = self.image.tensors[d.tensor]
        R = self.hw.gemm_tile
        if self.hw.gemv_vectors > 1:
            self.act_x, self.act_n = None, 0        # the GEMV engine's memories hold the tiles' tokens
        ngroups = -(-d.cols // d.group)
        per_tile = d.rows * (d.cols + d.cols % 2) // 2 + d.rows * ngroups * 2
        if self.arithmetic != COUNT:
            if self.arithmetic == REFERENCE:
                w = self._source_rows(d.tensor, d.row_start, d.row_start + d.rows)
            else:
                q_w, s_w = self._int4_rows(entry, d.row_start, d.rows)
        for t0 in range(0, t_count, R):
            tile = range(t0, min(t_count, t0 + R))
            xs = [self.l2[srcs[t]] for t in tile]
            if self.arithmetic != COUNT and not all(np.all(np.isfinite(x)) for x in xs):
                self._err(ErrorCode.NON_FINITE, f"a WGEMM input of token tile {t0 // R} holds an infinity or a NaN")
            self.counters.bytes_read["WEIGHTS"] += per_tile
            self.counters.elements[self._name] += len(tile) * d.rows * d.cols
            if self.arithmetic == COUNT:
                continue
            if self.arithmetic == REFERENCE:
                y = np.stack(xs) @ w.T
            else:
                qa = [quantize_activations(x.astype(np.float32), self.hw.act_block) for x in xs]
                y = gemm(q_w, s_w, np.stack([q for q, _ in qa]), np.stack([e for _, e in qa]), group=d.group,
                         block=self.hw.act_block, tile=(R, 2 * self.hw.systolic_cols))
            for t, yt in zip(tile, y):
                out = outs[t]
                self.l2[out] = (self.l2[out] + yt) if i.accm else yt

    def _density_rows(self, d) -> int:
        """The live rows of a masked WGEMV without values (COUNT): the up projection of a sparse layer keeps the
        gate units above its Gaussian top-k cutoff, ``1 - sparsity`` of them."""
        layer = int(d.tensor.split(".")[1])
        return round(d.rows * (1.0 - self.model.activation_sparsity_pattern[layer]))

    def _density_columns(self, d) -> int:
        layer = int(d.tensor.split(".")[1])
        return round(d.cols * (1.0 - self.model.activation_sparsity_pattern[layer]))

    def _int4_rows(self, entry, r0, n):
        rows, cols = entry.shape
        pcols = cols + cols % 2
        ngroups = -(-cols // entry.group)
        if entry.layout == 0:
            raw = self.image.view("WEIGHTS", entry.offset + r0 * pcols // 2, n * pcols // 2)
            q = unpack_int4(raw.reshape(n, pcols // 2))[:, :cols]
        else:
            raw = self.image.view("WEIGHTS", entry.offset, entry.nbytes)
            q = unpack_int4(raw.reshape(cols, rows // 2)).T[r0:r0 + n]
        if entry.layout == 0:        # scales row-major [rows, groups]
            s = self.image.view("WEIGHTS", entry.scale_offset + r0 * ngroups * 2, n * ngroups * 2)
            return q, s.view("<f2").reshape(n, ngroups)
        s = self.image.view("WEIGHTS", entry.scale_offset, rows * ngroups * 2)    # group-major [groups, rows]
        return q, s.view("<f2").reshape(ngroups, rows).T[r0:r0 + n]

    def _x_gather(self, i):
        d = self._desc(i.desc)
        if d.kind != 0 or d.layout != 0:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {i.desc} is not a row-major table")
        row = self.token
        if row >= d.rows:
            if not i.remap:
                self._err(ErrorCode.ADDRESS_RANGE, f"token {row} is outside table {d.tensor} ({d.rows} rows)")
            row = 0
        entry = self.image.tensors[d.tensor]
        ngroups = -(-d.cols // d.group)
        self.counters.bytes_read["WEIGHTS"] += (d.cols + d.cols % 2) // 2 + ngroups * 2
        self.counters.elements[self._name] += d.cols
        if self.arithmetic == COUNT:
            self._vec(i.dst, d.cols)        # the L2 range (firmware.perf.schedule)
            return
        if self.arithmetic == REFERENCE:
            if entry.staged:        # the host staged the token's row of the whole table (firmware.pack)
                row = self.token if self.token < entry.shape[0] else 0
            v = self._source_rows(d.tensor, d.row_start + row, d.row_start + row + 1)[0]
        else:
            q, s = self._int4_rows(entry, d.row_start + row, 1)
            scale = np.repeat(s.astype(np.float32), entry.group, axis=1)[:, :d.cols]
            v = (q.astype(np.float32) * scale)[0]          # exact: 4-bit x 11-bit significands
        self.l2[self._vec(i.dst, d.cols)] = v

    def _x_dma(self, i):
        n = self.vl
        nbytes = 4 * n
        self.counters.elements[self._name] += n
        offset = i.offset * 16
        region = i.region.name
        if i.dir is DmaDir.L2_TO_L2:
            self._err(ErrorCode.BAD_FUNCTION, "DMA L2_TO_L2 is not used; use VEC COPY")
        sl = self._vec(i.l2, n)
        if i.dir is DmaDir.DDR_TO_L2:
            if i.region is not DdrRegion.CONST and i.region is not DdrRegion.SCRATCH:
                self._err(ErrorCode.BAD_FUNCTION, f"DMA reads CONST or SCRATCH, not {region}")
            raw = self.image.view(region, offset, nbytes)
            self.counters.bytes_read[region] += nbytes
            if self.arithmetic == COUNT:
                return
            if self.arithmetic == REFERENCE and i.region is DdrRegion.CONST:
                self.l2[sl] = self._const64(offset, n)
            else:
                self.l2[sl] = raw.view("<f4").astype(self.dtype)
        else:
            if i.region is not DdrRegion.LOGITS and i.region is not DdrRegion.SCRATCH:
                self._err(ErrorCode.BAD_FUNCTION, f"DMA writes LOGITS or SCRATCH, not {region}")
            self.counters.bytes_written[region] += nbytes
            if self.arithmetic == COUNT:
                return
            self.image.view(region, offset, nbytes)[:] = self.l2[sl].astype("<f4").view(np.uint8)
            if i.region is DdrRegion.LOGITS:
                self._logit_rows[offset // 4: offset // 4 + n] = self.l2[sl]

    def _const64(self, offset, n):
        """Reference arithmetic reads CONST through the manifest: the float64 values behind the bytes."""
        for off, nbytes, name in self._const_index:
            if off <= offset and offset + 4 * n <= off + nbytes:
                src = self.image.const64[name].reshape(-1)
                k = (offset - off) // 4
                return src[k:k + n]
        self._err(ErrorCode.ADDRESS_RANGE, f"CONST range at {offset} spans no single constant")

    def _x_vec(self, i):
        self.counters.elements[self._name] += self.vl
        f = i.func
        n = self.vl
        a = self.l2[self._vec(i.a, n)]
        b = self.l2[self._vec(i.b, n)] if f in (VecFunc.ADD, VecFunc.SUB, VecFunc.MUL, VecFunc.FMAS,
                                                VecFunc.GELU_MUL, VecFunc.DOT) else None
        if self.arithmetic == COUNT:          # only the L2 ranges (firmware.perf.schedule)
            if f in (VecFunc.ROPE, VecFunc.RMSNORM):
                self._vec(i.b, self.hd)
            if f not in VEC_REDUCTIONS:
                self._vec(i.dst, n)
            return
        s = self.s[i.s]
        dt, fn = self.dtype, self.f
        if f is VecFunc.SUMSQ:
            self.s[i.s] = fn.reduce_sum(a * a)
            return
        if f is VecFunc.SUM:
            self.s[i.s] = fn.reduce_sum(a)
            return
        if f is VecFunc.MAX:
            self.s[i.s] = fn.reduce_max(a)
            return
        if f is VecFunc.DOT:
            self.s[i.s] = fn.reduce_sum(a * b)
            return
        if f is VecFunc.ADD:
            d = a + b
        elif f is VecFunc.SUB:
            d = a - b
        elif f is VecFunc.MUL:
            d = a * b
        elif f is VecFunc.MULS:
            d = a * s
        elif f is VecFunc.ADDS:
            d = a + s
        elif f is VecFunc.FMAS:
            d = a * s + b
        elif f is VecFunc.COPY:
            d = a.copy()
        elif f is VecFunc.RELU_SUBS:
            d = np.maximum(a - s, dt(0))
        elif f is VecFunc.GELU_MUL:
            d = fn.gelu_tanh(a) * b
        elif f in (VecFunc.RMSNORM, VecFunc.RMSNORM_NG, VecFunc.ROPE):
            hd = self.hd
            if hd <= 0 or n % hd:
                self._err(ErrorCode.BAD_LENGTH, f"VL ({n}) must be a multiple of HD ({hd})")
            if f is VecFunc.ROPE and (hd % 2 or 2 * hd > self.scratch_elements):
                self._err(ErrorCode.BAD_LENGTH, f"ROPE needs an even HD of at most {self.scratch_elements // 2} "
                                                f"(the controller's L2 scratch), not {hd}")
            x = a.reshape(n // hd, hd)
            if f is VecFunc.ROPE:
                t = self.l2[self._vec(i.b, hd)]
                cos, sin = t[:hd // 2], t[hd // 2:]
                x1, x2 = x[:, :hd // 2], x[:, hd // 2:]
                d = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1).reshape(-1)
            else:
                # mean = sum(x*x) * (1/HD) (exact for a power-of-two HD), then one rsqrt per segment
                ms = fn.reduce_sum(x * x) * dt(1.0 / hd)
                y = x * fn.rsqrt(ms + s)[:, None]
                if f is VecFunc.RMSNORM:
                    y = y * self.l2[self._vec(i.b, hd)]
                d = y.reshape(-1)
        else:  # pragma: no cover - every VecFunc is handled above
            self._err(ErrorCode.BAD_FUNCTION, f"VEC {f.name}")
        self.l2[self._vec(i.dst, n)] = d

    def _x_scalar(self, i):
        if self.arithmetic == COUNT:
            if i.func in (ScalarFunc.LD, ScalarFunc.ST):
                self.touched.append((i.imm, i.imm + 1))
            return
        f, s = i.func, self.s
        imm = self._imm(i.imm)
        if f is ScalarFunc.LI:
            s[i.d] = imm
        elif f is ScalarFunc.ADD:
            s[i.d] = s[i.a] + s[i.b]
        elif f is ScalarFunc.SUB:
            s[i.d] = s[i.a] - s[i.b]
        elif f is ScalarFunc.MUL:
            s[i.d] = s[i.a] * s[i.b]
        elif f is ScalarFunc.MULI:
            s[i.d] = s[i.a] * imm
        elif f is ScalarFunc.ADDI:
            s[i.d] = s[i.a] + imm
        elif f is ScalarFunc.MAXI:
            s[i.d] = max(s[i.a], imm)
        elif f is ScalarFunc.RSQRT:
            s[i.d] = self._scalar_fn(self.f.rsqrt, s[i.a])
        elif f is ScalarFunc.SQRT:
            s[i.d] = self._scalar_fn(self.f.sqrt, s[i.a])
        elif f is ScalarFunc.RECIP:
            s[i.d] = self._scalar_fn(self.f.recip, s[i.a])
        elif f is ScalarFunc.TANH:
            s[i.d] = self._scalar_fn(self.f.tanh, s[i.a])
        elif f is ScalarFunc.LDPOS:
            s[i.d] = self.pos
        elif f is ScalarFunc.MAX:
            s[i.d] = max(s[i.a], s[i.b])
        elif f in (ScalarFunc.LD, ScalarFunc.ST):
            if i.imm >= self.l2.size:
                self._err(ErrorCode.ADDRESS_RANGE, f"SCALAR {f.name} element {i.imm} is beyond L2")
            self.touched.append((i.imm, i.imm + 1))
            if f is ScalarFunc.LD:
                s[i.d] = self.l2[i.imm]
            else:
                self.l2[i.imm] = s[i.a]

    def _scalar_fn(self, fn, x):
        return fn(np.array([x], dtype=self.dtype))[0]

    def _imm(self, bits: int):
        return self.dtype(np.array([bits], dtype="<u4").view("<f4")[0])

    def _x_ctrl(self, i):
        if i.func is CtrlFunc.SETVL:
            self.vl = i.imm
        elif i.func is CtrlFunc.SETHD:
            self.hd = i.imm
        elif i.func is CtrlFunc.SETTOK:
            self.token = i.imm
        elif i.func is CtrlFunc.SETPOS:
            self.pos = i.imm

    def _x_memset(self, i):
        if i.cache is ShapeCache.SCALAR:
            if i.slot >= SCALAR_REGS or i.c:
                self._err(ErrorCode.BAD_FUNCTION, f"MEMSET SCALAR needs slot < {SCALAR_REGS} and c = 0")
            self.s[i.slot] = self._imm(i.a << 16 | i.b)
        else:
            self.shape_cache[i.cache][i.slot] = (i.a, i.b, i.c)

    def _kv_desc(self, index):
        d = self._desc(index)
        if d.kind != 2:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {index} is not a KV slot")
        fmt = self.hw.kv_layout_code
        if d.layout != fmt:
            names = ("fp16", "int8", "int8 with V rows")
            self._err(ErrorCode.BAD_DESCRIPTOR, f"KV slot {index} holds the "
                                                f"{names[d.layout] if d.layout < 3 else f'unknown ({d.layout})'} "
                                                f"format; this NPU's cache is {names[fmt]}")
        if fmt:
            self._check_int8_slot(d)
        return d

    def _x_kvst(self, i):
        d = self._kv_desc(i.slot)
        w = d.heads * d.head_dim
        if self.hw.kv_format == "int8":     # per head: K's two planes and scales, V's two planes and scale
            self.counters.bytes_written["KV"] += d.heads * self._kv_layout(d).position_bytes
        else:
            self.counters.bytes_written["KV"] += 2 * w * 2
        self.counters.elements[self._name] += 2 * w
        if self.arithmetic == COUNT:
            self._vec(i.k, w)
            self._vec(i.v, w)
            return
        if self._int8_kv():
            return self._kvst_int8(i, d)
        k_store, v_store, positions = self._kv[d.index]
        slot = self.pos % d.capacity
        k_store[slot] = self.l2[self._vec(i.k, w)].reshape(d.heads, d.head_dim)
        v_store[slot] = self.l2[self._vec(i.v, w)].reshape(d.heads, d.head_dim)
        positions[slot] = self.pos

    def _x_attn(self, i):
        d = self._kv_desc(i.slot)
        heads, head_dim, window = (int(v) for v in self.shape_cache[ShapeCache.FMAP][i.shape_ptr])
        if head_dim != d.head_dim or i.kv_head >= d.heads or heads <= 0:
            self._err(ErrorCode.BAD_LENGTH, f"ATTN shape ({heads} heads of {head_dim}) does not match the slot")
        # A ring as wide as the window serves every position; a narrower slot (a cache sized for fewer
        # positions than the window, or a full-attention layer) only positions below its capacity.
        if (not window or window > d.capacity) and self.pos >= d.capacity:
            self._err(ErrorCode.ADDRESS_RANGE, f"position {self.pos} exceeds the KV slot ({d.capacity} positions)")
        seen = attn_positions(self.pos, window)
        int8 = self.hw.kv_format == "int8"
        if int8:
            self.act_x, self.act_n = None, 0        # its GEMVs quantise into the engine (WGEMV reuse)
        # fp16: the scores of every head and the K/V row; int8: one head's scores at a time
        need = seen if int8 else heads * seen + head_dim
        if need > self.scratch_elements:
            self._err(ErrorCode.BAD_LENGTH, f"ATTN over {seen} positions of {heads} heads needs {need} elements "
                                            f"of L2 scratch; there are {self.scratch_elements} "
                                            f"(HardwareConfig.l2_scratch_bytes)")
        if self.arithmetic == COUNT:
            self._vec(i.q, heads * head_dim)
            self._vec(i.dst, heads * head_dim)
            if int8:
                self._attn_int8_counts(d, heads, attn_pieces(self.pos, seen, d.capacity), None)
                return
            self.counters.bytes_read["KV"] += 2 * seen * head_dim * 2
            self.counters.elements[self._name] += heads * seen * head_dim
            return
        if self._int8_kv():
            return self._attn_int8(i, d, heads, head_dim, seen)
        k_store, v_store, positions = self._kv[d.index]
        lo = self.pos - window + 1 if window else 0
        visible = np.nonzero((positions >= max(lo, 0)) & (positions <= self.pos))[0]
        visible = visible[np.argsort(positions[visible], kind="stable")]          # oldest position first
        k = k_store[visible, i.kv_head].astype(self.dtype)
        v = v_store[visible, i.kv_head].astype(self.dtype)
        self.counters.bytes_read["KV"] += 2 * visible.size * head_dim * 2
        self.counters.elements[self._name] += heads * visible.size * head_dim
        q = self.l2[self._vec(i.q, heads * head_dim)].reshape(heads, head_dim)
        # scores: one dot product per (head, position); softmax as exp(s - max) * recip(sum); then the
        # V rows accumulated in position order, oldest first (one rounding per product and per add).
        fn = self.f
        scores = fn.reduce_sum(q[:, None, :] * k[None, :, :])                  # [heads, n]
        e = fn.exp(scores - fn.reduce_max(scores)[:, None])
        p = e * fn.recip(fn.reduce_sum(e))[:, None]
        out = p[:, 0, None] * v[0][None, :]
        for t in range(1, v.shape[0]):
            out = out + p[:, t, None] * v[t][None, :]
        self.l2[self._vec(i.dst, heads * head_dim)] = out.reshape(-1)

    def _kvst_int8(self, i, d):
        """KVST into the INT8 cache (docs/numerics.md, "KV cache"): per KV head in order, K quantised per
        `act_block` elements, then V per row (power-of-two scales, |q| <= 119), each split into two INT4 planes
        and written with its scales. A non-finite input or a scale beyond binary16 stops the instruction with
        the heads (and the head's K) before it written, as the controller does."""
        w, hd = d.heads * d.head_dim, d.head_dim
        k = self.l2[self._vec(i.k, w)].astype(np.float32).reshape(d.heads, hd)
        v = self.l2[self._vec(i.v, w)].astype(np.float32).reshape(d.heads, hd)
        kv = self._kv[d.index]
        r = self.pos % d.capacity
        big = "a KVST value is too large for the binary16 scales of the INT8 KV cache"
        for j in range(d.heads):
            if not np.all(np.isfinite(k[j])):
                self._err(ErrorCode.NON_FINITE, "a KVST input holds an infinity or a NaN")
            kh, kl, sh, sl = quantize_kv_k(k[j], self.hw.act_block)
            if not np.all(np.isfinite(sh)):
                self._err(ErrorCode.NON_FINITE, big)
            kv["k_hi"][r, j], kv["k_lo"][r, j], kv["ks_hi"][r, j], kv["ks_lo"][r, j] = kh, kl, sh, sl
            if not np.all(np.isfinite(v[j])):
                self._err(ErrorCode.NON_FINITE, "a KVST input holds an infinity or a NaN")
            vh, vl, vs = quantize_kv_v(v[j])
            if not np.isfinite(vs):
                self._err(ErrorCode.NON_FINITE, big)
            if self.hw.kv_v_layout == "planes":
                kv["v_hi"][r, j], kv["v_lo"][r, j] = vh, vl
            else:
                kv["v"][r, j] = 16 * vh.astype(np.int16) + vl
            kv["vs"][r, j] = vs

    def _check_int8_slot(self, d):
        """An INT8 KV slot: a head the packer and the V GEMVs take."""
        if d.head_dim % 8 or d.head_dim > self.hw.kv_max_head_dim:
            self._err(ErrorCode.BAD_LENGTH, f"the INT8 KV cache needs a head_dim that is a multiple of 8 and at "
                                            f"most {self.hw.kv_max_head_dim} (kv_max_head_dim), not {d.head_dim}")

    def _attn_int8_counts(self, d, heads, pieces, nonzero):
        """Bytes and engine commands of one INT8 ATTN over the ring `pieces` (`sim.plan.attn_pieces`) of slot
        `d`; `nonzero[h][c]` V columns fetched for head h's chunk c (the sparse GEMV skips the positions whose
        quantised weight is 0); None: every column."""
        c, hw, hd = self.counters, self.hw, d.head_dim
        n = sum(k for _, k in pieces)
        k_bytes = 2 * (n * hd // 2 + n * self._kv_layout(d).kblocks * 2)     # both planes and their scales
        nonzero = [None] * heads if nonzero is None else nonzero
        self._v_nonzero = [nz[0] if nz is not None else None for nz in nonzero[:heads]]
        group = attn_k_group(hw, n)
        for h in range(heads):
            if h % group == 0:       # the K GEMVs (lo, hi) per piece, once for the heads of the group
                vectors = min(group, heads - h)
                for _, k in pieces:
                    if vectors > 1:
                        c.attn_group_gemvs[(k, hd, hw.act_block, vectors)] += 2
                    c.attn_gemvs += 2
                c.attn_gemv_bytes += k_bytes
                c.bytes_read["KV"] += k_bytes
            v_bytes = 0
            if hw.kv_v_layout == "rows":
                if h % group == 0:   # one GEMV of INT8 weights per chunk, once for the heads of the group
                    for cols in attn_chunks(pieces, hw):
                        v_bytes += hd * cols + hd * 2
                        c.attn_v_gemvs[(hd, cols, min(group, heads - h))] += 1
                        c.attn_gemvs += 1
            else:
                for ci, cols in enumerate(attn_chunks(pieces, hw)):
                    nz = cols if nonzero[h] is None else nonzero[h][ci]
                    v_bytes += 2 * (nz * hd // 2 + hd * 2)
                    shape = (hd, cols, 1 << V_PLANE_LOG2_GROUP, int(nz))
                    c.attn_sparse_gemvs[shape] += 2
                    c.attn_gemvs += 2
            c.attn_gemv_bytes += v_bytes
            c.bytes_read["KV"] += v_bytes + n * 2           # + the V row scales
            c.elements[self._name] += 2 * n * hd

    def _attn_int8(self, i, d, heads, hd, n):
        """ATTN on the INT8 cache: per head, the scores as two GEMVs over the K planes (lo, then hi with accm), the
        softmax on the SFU, the V row scales folded into its weights, and the output per chunk of `gemv_max_cols`
        positions as two sparse GEMVs over the V planes (``kv_v_layout`` "planes"), or one GEMV of INT8 weights
        over the V rows ("rows"; scale 1, the table's lo half: the group's heads as the engine's vectors, each
        head's value its own), times recip(sum). The ring's slots in the order of
        `sim.plan.attn_pieces` (slot order for a full ring; a ring wider than the window from the oldest visible
        position on, in two pieces where it wraps), the V chunks within each piece (`attn_chunks`). The K
        GEMVs serve a group of heads at once (`sim.plan.attn_k_group`; the same values as one by one), whose
        queries are all quantised first: a bad query stops with the heads of the groups before it written."""
        hw, fn, B = self.hw, self.f, self.hw.act_block
        kv = self._kv[d.index]
        j = i.kv_head
        q = self.l2[self._vec(i.q, heads * hd)].astype(np.float32).reshape(heads, hd)
        dst = self._vec(i.dst, heads * hd)
        # the V planes' scales as the slot's table in WEIGHTS holds them ([2, hd]: the hi plane's, the lo plane's)
        v_hi_s, v_lo_s = self.image.view("WEIGHTS", d.scale_offset, 4 * hd).view("<f2").reshape(2, hd, 1)
        nonzero, group = [], attn_k_group(hw, n)
        pieces = attn_pieces(self.pos, n, d.capacity)
        rows = np.concatenate([np.arange(a, a + k) for a, k in pieces])       # the visible slots, in score order
        chunks = np.cumsum([0] + attn_chunks(pieces, hw))
        for h in range(heads):                   # head by head: a bad query stops before its group
            if h % group == 0 and not np.all(np.isfinite(q[h:h + group])):
                self._attn_int8_counts(d, h, pieces, nonzero)
                self._err(ErrorCode.NON_FINITE, "an ATTN query holds an infinity or a NaN")
            qa, qe = quantize_activations(q[h], B)
            s = gemv(kv["k_lo"][rows, j], kv["ks_lo"][rows, j], qa, qe, group=B, block=B)
            s = gemv(kv["k_hi"][rows, j], kv["ks_hi"][rows, j], qa, qe, group=B, block=B, acc=s)
            e = fn.exp(s - fn.reduce_max(s))
            r = fn.recip(fn.reduce_sum(e))
            x = kv["vs"][rows, j].astype(np.float32) * e
            o, nz = None, []
            for c0, c1 in zip(chunks[:-1], chunks[1:]):
                xa, xe = quantize_activations(x[c0:c1], B)
                nz.append(int(np.count_nonzero(xa)))
                cols = rows[c0:c1]
                planes = (("v_lo", v_lo_s), ("v_hi", v_hi_s)) if hw.kv_v_layout == "planes" else (("v", v_lo_s),)
                for plane, scale in planes:
                    o = gemv(kv[plane][cols, j].T, scale, xa, xe, group=1 << V_PLANE_LOG2_GROUP, block=B, acc=o)
            self.l2[dst.start + h * hd: dst.start + (h + 1) * hd] = o * r
            nonzero.append(nz)
        self._attn_int8_counts(d, heads, pieces, nonzero)

    def _x_cvo(self, i):
        self.counters.elements[self._name] += i.length
        f, n = i.func, i.length
        if self.arithmetic == COUNT:
            self._vec(i.src, n * (2 if f in (CvoFunc.ROPE_COS, CvoFunc.ROPE_SIN) else 1))
            self._vec(i.dst, 1 if f in (CvoFunc.REDUCE_SUM, CvoFunc.REDUCE_MAX) else n)
            return
        if i.accm and n > self.scratch_elements and f in (CvoFunc.REDUCE_SUM, CvoFunc.REDUCE_MAX, CvoFunc.ROPE_COS,
                                                          CvoFunc.ROPE_SIN):
            self._err(ErrorCode.BAD_LENGTH, f"CVO {f.name} with accm stages its {n} results in the L2 scratch "
                                            f"({self.scratch_elements} elements)")
        x = self.l2[self._vec(i.src, n * (2 if f in (CvoFunc.ROPE_COS, CvoFunc.ROPE_SIN) else 1))]
        dt, fn = self.dtype, self.f
        if f in (CvoFunc.ROPE_COS, CvoFunc.ROPE_SIN):
            # u0.64 frequency (two words, high first) times the integer position, modulo one turn: exact
            words = self._u32(x).reshape(n, 2)
            turns = np.array([((int(hi) << 32 | int(lo)) * self.pos) % (1 << 64) for hi, lo in words],
                             dtype=np.uint64)
            y = (fn.cos_turns(turns) if f is CvoFunc.ROPE_COS else fn.sin_turns(turns)).astype(dt)
        elif f is CvoFunc.REDUCE_SUM:
            y = np.array([fn.reduce_sum(x)], dt)
        elif f is CvoFunc.REDUCE_MAX:
            y = np.array([fn.reduce_max(x)], dt)
        else:
            if i.sub_emax:
                x = x - self.emax
            if f is CvoFunc.EXP:
                y = fn.exp(x)
            elif f is CvoFunc.SQRT:
                y = fn.sqrt(x)
            elif f is CvoFunc.GELU:
                y = fn.gelu_tanh(x)
            elif f is CvoFunc.SIN:
                y = fn.sin(x)
            elif f is CvoFunc.COS:
                y = fn.cos(x)
            elif f is CvoFunc.SCALE:       # recip_scale: a multiply by the reciprocal (no divider)
                y = x * (self._scalar_fn(fn.recip, self.s[0]) if i.recip_scale else self.s[0])
            elif f is CvoFunc.RECIP:
                y = fn.recip(x)
            elif f is CvoFunc.TANH:
                y = fn.tanh(x)
            elif f is CvoFunc.RSQRT:
                y = fn.rsqrt(x)
            elif f is CvoFunc.SOFTCAP:     # c * tanh(x * (1/c))
                c = self.s[0]
                y = fn.tanh(x * self._scalar_fn(fn.recip, c)) * c
            else:  # pragma: no cover
                self._err(ErrorCode.BAD_FUNCTION, f"CVO {f.name}")
            y = np.asarray(y, dtype=dt)
        out = self._vec(i.dst, y.size)
        self.l2[out] = (self.l2[out] + y) if i.accm else y

    def _u32(self, x):
        # Raw 32-bit words in L2 (the RoPE turn tables): binary32 L2 keeps their bits, float64 L2 their value.
        if self.dtype == np.float32:
            return x.view(np.uint32)
        return x.astype(np.uint64)

    def _x_gemv(self, i):
        self._err(ErrorCode.BAD_FUNCTION, "pccx GEMV (L2 weights) is decoded but not used by this NPU; use WGEMV")

    _x_gemm = _x_gemv

    def _x_memcpy(self, i):
        self._err(ErrorCode.BAD_FUNCTION, "pccx MEMCPY is decoded but host-side routes do not exist here; use DMA")
