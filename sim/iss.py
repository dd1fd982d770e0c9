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
  arithmetic is IEEE binary32 with round-to-nearest-even. Transcendental SFU functions are NumPy's
  binary32 versions until the SFU's own bit-exact models replace them (docs/numerics.md).

Counters (`Counters`) record what does not depend on timing: instructions per opcode and bytes read and
written per DDR region, with sparse column skipping counted as the hardware fetches.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from hdl.isa import (
    CtrlFunc, CvoFunc, DdrRegion, DecodeError, DmaDir, ErrorCode, Opcode, ScalarFunc, ShapeCache, VecFunc, decode,
)

from .config import ModelConfig

__all__ = ["Machine", "Counters", "ExecutionError", "REFERENCE", "HARDWARE", "COUNT"]

REFERENCE = "reference"
HARDWARE = "hardware"
COUNT = "count"      # no arithmetic: instructions and bytes only (E4B without its weights)
N_SREGS = 8


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

    def total_read(self) -> int:
        return sum(self.bytes_read.values())


def _gelu_tanh(x):
    dt = x.dtype.type
    inner = dt(math.sqrt(2.0 / math.pi)) * (x + dt(0.044715) * (x * x * x))
    return dt(0.5) * x * (dt(1.0) + np.tanh(inner))


class Machine:
    """One NPU, as the ISS sees it: L2, scalar registers, CSRs, the KV cache, the DDR image.

    Parameters
    ----------
    image : firmware.pack.Image
        The packed DDR image with its manifest.
    arithmetic : ``"reference"`` or ``"hardware"``
    source : mapping, optional
        The unquantised tensors (canonical names) that reference arithmetic reads; required for it.
    """

    def __init__(self, image, hw, arithmetic: str = HARDWARE, source=None):
        if arithmetic not in (REFERENCE, HARDWARE, COUNT):
            raise ValueError(f"arithmetic must be {REFERENCE!r}, {HARDWARE!r} or {COUNT!r}, not {arithmetic!r}")
        if arithmetic == REFERENCE and source is None:
            raise ValueError("reference arithmetic needs the unquantised source tensors")
        self.image = image
        self.hw = hw
        self.arithmetic = arithmetic
        self.source = source
        self.dtype = np.float64 if arithmetic == REFERENCE else np.float32
        self.l2_words = hw.l2_bytes // 16
        self.l2 = np.zeros(self.l2_words * 4, dtype=self.dtype)
        self.model = ModelConfig.from_hf(image.config)
        self.s = np.zeros(N_SREGS, dtype=self.dtype)
        self.shape_cache = {ShapeCache.FMAP: np.zeros((64, 3), np.int64), ShapeCache.WEIGHT: np.zeros((64, 3), np.int64)}
        self.vl = 0
        self.hd = 0
        self.emax = self.dtype(0)
        self.token = 0
        self.pos = 0
        self.counters = Counters()
        self._kv = {}
        self._const_index = sorted((e.offset, e.nbytes, name) for name, e in image.tensors.items()
                                   if e.region == "CONST")
        self.logits = np.zeros(self.model.vocab_size, dtype=self.dtype)   # mirror of the LOGITS region
        self.reset_kv()

    # --- host interface --------------------------------------------------------------------------------

    def reset_kv(self) -> None:
        kv = {}
        if self.arithmetic == COUNT:
            self._kv = kv
            return
        for d in self.image.descriptors:
            if d.kind == 2:
                shape = (d.capacity, d.heads, d.head_dim)
                kv[d.index] = (np.zeros(shape, self.dtype if self.arithmetic == REFERENCE else np.float16),
                               np.zeros(shape, self.dtype if self.arithmetic == REFERENCE else np.float16),
                               np.full(d.capacity, -1, np.int64))
        self._kv = kv

    def run(self, program: list[int], *, token: int, pos: int) -> None:
        """Execute a whole program (until HALT) for one token at one position."""
        self.token, self.pos = int(token), int(pos)
        for pc, word in enumerate(program):
            try:
                insn = decode(word, l2_words=self.l2_words)
            except DecodeError as e:
                raise ExecutionError(e.code, pc, str(e)) from None
            name = insn.op.name + ("." + insn.fields["func"].name if "func" in insn.fields else "")
            self.counters.instructions[name] += 1
            if insn.op is Opcode.CTRL and insn.func is CtrlFunc.HALT:
                return
            try:
                getattr(self, "_x_" + insn.op.name.lower())(insn)
            except ExecutionError as e:
                raise ExecutionError(e.code, pc, str(e).split(": ", 1)[-1]) from None
        raise ExecutionError(ErrorCode.BAD_LENGTH, len(program), "the program ended without HALT")

    # --- helpers ----------------------------------------------------------------------------------------

    def _err(self, code: ErrorCode, msg: str):
        raise ExecutionError(code, -1, msg)

    def _vec(self, word_addr: int, n: int) -> slice:
        start = word_addr * 4
        if n <= 0:
            self._err(ErrorCode.BAD_LENGTH, f"vector length {n} must be positive")
        if start + n > self.l2.size:
            self._err(ErrorCode.ADDRESS_RANGE, f"L2 range [{start}, {start + n}) (elements) exceeds L2 "
                                               f"({self.l2.size} elements)")
        return slice(start, start + n)

    def _round(self, x):
        return np.asarray(x, dtype=self.dtype)

    def _desc(self, index: int):
        if index >= len(self.image.descriptors):
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {index} does not exist "
                                                f"({len(self.image.descriptors)} in the table)")
        self.counters.bytes_read["DESC"] += 32
        return self.image.descriptors[index]

    # --- instructions -----------------------------------------------------------------------------------

    def _x_wgemv(self, i):
        d = self._desc(i.desc)
        if d.kind != 0:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {i.desc} is not a weight matrix")
        x = self.l2[self._vec(i.src, d.cols)]
        if i.sparse and d.layout != 1:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"sparse WGEMV needs a column-major matrix ({d.tensor})")
        entry = self.image.tensors[d.tensor]
        ngroups = -(-d.cols // d.group)
        if self.arithmetic == COUNT:
            y = None
        elif self.arithmetic == REFERENCE:
            w = np.asarray(self.source[d.tensor][d.row_start:d.row_start + d.rows], dtype=np.float64)
            y = w @ x
        else:
            from .numerics import gemv, quantize_activations
            q_w, s_w = self._int4_rows(entry, d.row_start, d.rows)
            q_a, e_a = quantize_activations(x.astype(np.float32), self.hw.act_block)
            y = gemv(q_w, s_w, q_a, e_a, group=d.group, block=self.hw.act_block)
        # Bytes: dense reads every row; sparse reads the columns of non-zero activations only.
        pcols = d.cols + d.cols % 2
        if i.sparse:
            nz = self._density_columns(d) if y is None else np.count_nonzero(x)
            read = nz * d.rows // 2
            self.counters.weight_bytes_skipped += (d.cols - nz) * d.rows // 2
        else:
            read = d.rows * pcols // 2
        self.counters.bytes_read["WEIGHTS"] += read + d.rows * ngroups * 2
        out = self._vec(i.dst, d.rows)
        if y is None:
            return
        if i.accm:
            y = self.l2[out] + y
        self.l2[out] = y
        if i.findemax:
            self.emax = self.dtype(np.max(y))

    def _density_columns(self, d) -> int:
        layer = int(d.tensor.split(".")[1])
        return round(d.cols * (1.0 - self.model.activation_sparsity_pattern[layer]))

    def _int4_rows(self, entry, r0, n):
        from .numerics import unpack_int4
        rows, cols = entry.shape
        pcols = cols + cols % 2
        ngroups = -(-cols // entry.group)
        if entry.layout == 0:
            raw = self.image.view("WEIGHTS", entry.offset + r0 * pcols // 2, n * pcols // 2)
            q = unpack_int4(raw.reshape(n, pcols // 2))[:, :cols]
        else:
            raw = self.image.view("WEIGHTS", entry.offset, entry.nbytes)
            q = unpack_int4(raw.reshape(cols, rows // 2)).T[r0:r0 + n]
        s = self.image.view("WEIGHTS", entry.scale_offset + r0 * ngroups * 2, n * ngroups * 2)
        return q, s.view("<f2").reshape(n, ngroups)

    def _x_gather(self, i):
        d = self._desc(i.desc)
        if d.kind != 0:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {i.desc} is not a table")
        row = self.token
        if row >= d.rows:
            if not i.remap:
                self._err(ErrorCode.ADDRESS_RANGE, f"token {row} is outside table {d.tensor} ({d.rows} rows)")
            row = 0
        entry = self.image.tensors[d.tensor]
        ngroups = -(-d.cols // d.group)
        self.counters.bytes_read["WEIGHTS"] += (d.cols + d.cols % 2) // 2 + ngroups * 2
        if self.arithmetic == COUNT:
            return
        if self.arithmetic == REFERENCE:
            v = np.asarray(self.source[d.tensor][d.row_start + row], dtype=np.float64)
        else:
            q, s = self._int4_rows(entry, d.row_start + row, 1)
            scale = np.repeat(s.astype(np.float32), entry.group, axis=1)[:, :d.cols]
            v = (q.astype(np.float32) * scale)[0]          # exact: 4-bit x 11-bit significands
        self.l2[self._vec(i.dst, d.cols)] = v

    def _x_dma(self, i):
        n = self.vl
        nbytes = 4 * n
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
                self.logits[offset // 4: offset // 4 + n] = self.l2[sl]

    def _const64(self, offset, n):
        """Reference arithmetic reads CONST through the manifest: the float64 values behind the bytes."""
        for off, nbytes, name in self._const_index:
            if off <= offset and offset + 4 * n <= off + nbytes:
                src = self.image.const64[name].reshape(-1)
                k = (offset - off) // 4
                return src[k:k + n]
        self._err(ErrorCode.ADDRESS_RANGE, f"CONST range at {offset} spans no single constant")

    def _x_vec(self, i):
        if self.arithmetic == COUNT:
            return
        f = i.func
        n = self.vl
        a = self.l2[self._vec(i.a, n)]
        b = self.l2[self._vec(i.b, n)] if f in (VecFunc.ADD, VecFunc.SUB, VecFunc.MUL, VecFunc.FMAS,
                                                VecFunc.GELU_MUL, VecFunc.DOT) else None
        s = self.s[i.s]
        dt = self.dtype
        if f is VecFunc.SUMSQ:
            self.s[i.s] = np.sum(a * a)
            return
        if f is VecFunc.SUM:
            self.s[i.s] = np.sum(a)
            return
        if f is VecFunc.MAX:
            self.s[i.s] = np.max(a)
            return
        if f is VecFunc.DOT:
            self.s[i.s] = np.sum(a * b)
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
            d = _gelu_tanh(a) * b
        elif f in (VecFunc.RMSNORM, VecFunc.RMSNORM_NG, VecFunc.ROPE):
            hd = self.hd
            if hd <= 0 or n % hd:
                self._err(ErrorCode.BAD_LENGTH, f"VL ({n}) must be a multiple of HD ({hd})")
            x = a.reshape(n // hd, hd)
            if f is VecFunc.ROPE:
                t = self.l2[self._vec(i.b, hd)]
                cos, sin = t[:hd // 2], t[hd // 2:]
                x1, x2 = x[:, :hd // 2], x[:, hd // 2:]
                d = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1).reshape(-1)
            else:
                y = x * (np.mean(x * x, axis=1, keepdims=True) + s) ** dt(-0.5)
                if f is VecFunc.RMSNORM:
                    y = y * self.l2[self._vec(i.b, hd)]
                d = y.reshape(-1)
        else:  # pragma: no cover - every VecFunc is handled above
            self._err(ErrorCode.BAD_FUNCTION, f"VEC {f.name}")
        self.l2[self._vec(i.dst, n)] = d

    def _x_scalar(self, i):
        if self.arithmetic == COUNT:
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
            s[i.d] = self.dtype(1) / np.sqrt(s[i.a])
        elif f is ScalarFunc.SQRT:
            s[i.d] = np.sqrt(s[i.a])
        elif f is ScalarFunc.RECIP:
            s[i.d] = self.dtype(1) / s[i.a]
        elif f is ScalarFunc.TANH:
            s[i.d] = np.tanh(s[i.a])
        elif f is ScalarFunc.LDPOS:
            s[i.d] = self.pos
        elif f is ScalarFunc.MAX:
            s[i.d] = max(s[i.a], s[i.b])
        elif f in (ScalarFunc.LD, ScalarFunc.ST):
            if i.imm >= self.l2.size:
                self._err(ErrorCode.ADDRESS_RANGE, f"SCALAR {f.name} element {i.imm} is beyond L2")
            if f is ScalarFunc.LD:
                s[i.d] = self.l2[i.imm]
            else:
                self.l2[i.imm] = s[i.a]

    def _imm(self, bits: int):
        return self.dtype(np.array([bits], dtype="<u4").view("<f4")[0])

    def _x_ctrl(self, i):
        if i.func is CtrlFunc.SETVL:
            self.vl = i.imm
        elif i.func is CtrlFunc.SETHD:
            self.hd = i.imm

    def _x_memset(self, i):
        if i.cache is ShapeCache.SCALAR:
            if i.slot >= N_SREGS or i.c:
                self._err(ErrorCode.BAD_FUNCTION, "MEMSET SCALAR needs slot < 8 and c = 0")
            self.s[i.slot] = self._imm(i.a << 16 | i.b)
        else:
            self.shape_cache[i.cache][i.slot] = (i.a, i.b, i.c)

    def _x_kvst(self, i):
        d = self._desc(i.slot)
        if d.kind != 2:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {i.slot} is not a KV slot")
        w = d.heads * d.head_dim
        self.counters.bytes_written["KV"] += 2 * w * 2
        if self.arithmetic == COUNT:
            return
        k_store, v_store, positions = self._kv[d.index]
        slot = self.pos % d.capacity
        k_store[slot] = self.l2[self._vec(i.k, w)].reshape(d.heads, d.head_dim)
        v_store[slot] = self.l2[self._vec(i.v, w)].reshape(d.heads, d.head_dim)
        positions[slot] = self.pos

    def _x_attn(self, i):
        d = self._desc(i.slot)
        if d.kind != 2:
            self._err(ErrorCode.BAD_DESCRIPTOR, f"descriptor {i.slot} is not a KV slot")
        heads, head_dim, window = (int(v) for v in self.shape_cache[ShapeCache.FMAP][i.shape_ptr])
        if head_dim != d.head_dim or i.kv_head >= d.heads or heads <= 0:
            self._err(ErrorCode.BAD_LENGTH, f"ATTN shape ({heads} heads of {head_dim}) does not match the slot")
        if window and window > d.capacity:
            self._err(ErrorCode.BAD_LENGTH, f"window {window} exceeds the slot's {d.capacity} positions")
        if not window and self.pos >= d.capacity:
            self._err(ErrorCode.ADDRESS_RANGE, f"position {self.pos} exceeds the KV slot ({d.capacity})")
        if self.arithmetic == COUNT:
            seen = min(self.pos + 1, window) if window else self.pos + 1
            self.counters.bytes_read["KV"] += 2 * seen * head_dim * 2
            return
        k_store, v_store, positions = self._kv[d.index]
        lo = self.pos - window + 1 if window else 0
        visible = (positions >= max(lo, 0)) & (positions <= self.pos)
        k = k_store[visible, i.kv_head].astype(self.dtype)
        v = v_store[visible, i.kv_head].astype(self.dtype)
        self.counters.bytes_read["KV"] += 2 * int(visible.sum()) * head_dim * 2
        q = self.l2[self._vec(i.q, heads * head_dim)].reshape(heads, head_dim)
        scores = q @ k.T
        e = np.exp(scores - np.max(scores, axis=1, keepdims=True))
        p = e / np.sum(e, axis=1, keepdims=True)
        self.l2[self._vec(i.dst, heads * head_dim)] = (p @ v).reshape(-1)

    def _x_cvo(self, i):
        if self.arithmetic == COUNT:
            return
        f, n = i.func, i.length
        x = self.l2[self._vec(i.src, n * (2 if f in (CvoFunc.ROPE_COS, CvoFunc.ROPE_SIN) else 1))]
        dt = self.dtype
        if f in (CvoFunc.ROPE_COS, CvoFunc.ROPE_SIN):
            words = self._u32(x).reshape(n, 2)
            turns = np.array([((int(hi) << 32 | int(lo)) * self.pos) % (1 << 64) for hi, lo in words],
                             dtype=np.float64) / 2.0**64
            ang = 2.0 * np.pi * turns
            y = (np.cos(ang) if f is CvoFunc.ROPE_COS else np.sin(ang)).astype(dt)
        elif f is CvoFunc.REDUCE_SUM:
            y = np.array([np.sum(x)], dt)
        elif f is CvoFunc.REDUCE_MAX:
            y = np.array([np.max(x)], dt)
        else:
            if i.sub_emax:
                x = x - self.emax
            if f is CvoFunc.EXP:
                y = np.exp(x)
            elif f is CvoFunc.SQRT:
                y = np.sqrt(x)
            elif f is CvoFunc.GELU:
                y = _gelu_tanh(x)
            elif f is CvoFunc.SIN:
                y = np.sin(x)
            elif f is CvoFunc.COS:
                y = np.cos(x)
            elif f is CvoFunc.SCALE:
                y = x / self.s[0] if i.recip_scale else x * self.s[0]
            elif f is CvoFunc.RECIP:
                y = dt(1) / x
            elif f is CvoFunc.TANH:
                y = np.tanh(x)
            elif f is CvoFunc.RSQRT:
                y = dt(1) / np.sqrt(x)
            elif f is CvoFunc.SOFTCAP:
                c = self.s[0]
                y = np.tanh(x / c) * c
            else:  # pragma: no cover
                self._err(ErrorCode.BAD_FUNCTION, f"CVO {f.name}")
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
