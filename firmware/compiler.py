"""Token compiler: model config + packed image (manifest) -> the instruction program for one decode token,
or for T tokens at once (a prefill program).

The decode program is position independent: the token id and the position are CSRs that GATHER, KVST, ATTN
and the RoPE functions read, so one program serves every token of a sequence. `compile_token` returns the
words and a listing that maps every instruction to the step of the Gemma 3n pipeline it implements
(docs/architecture.md, "Dataflow of one token").

`compile_tokens(..., tokens=T)` emits the same pipeline for T tokens: every per-token buffer has T copies,
the projections run once for all T tokens (WGEMM on the systolic array, or T WGEMVs when those are faster:
`gemm_pays`), and the vector work, KV stores and attention run token by token in order, so token t attends
to the tokens before it exactly as if they had been decoded one by one; only the last token's logits are
computed. CTRL SETTOK / SETPOS give each token its id and position; their immediates are placeholders
(the token's index) that `Program.bind` replaces by the ids and positions of a run. Every token's results
are bit for bit those of the decode program: the same instructions on the same values (WGEMM is
bit-identical to WGEMV, docs/systolic.md).

L2 is allocated statically (`L2Map`): every buffer the token needs gets a fixed word address, checked
against the configured L2 size. Scalar registers: S7 holds the RMSNorm epsilon, S5 holds 1/D, S6 the
AltUp magnitude target; S0-S4 are temporaries.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from hdl.config import HardwareConfig
from hdl.isa import (VEC_REDUCTIONS, CtrlFunc, CvoFunc, DdrRegion, DmaDir, Opcode, ScalarFunc, ShapeCache, VecFunc,
                     decode, encode)
from sim.config import ModelConfig

from .pack import (Image, Layout, ffn_pieces, folded_router_name, head_tokens, logit_chunk_rows, logit_chunks,
                   logit_stride)

__all__ = ["compile_token", "compile_tokens", "gemm_pays", "multi_token_limit", "prefill_runs", "program_tokens",
           "sliding_ring", "Program", "L2Map", "MAX_TOKENS"]

EPS, TARGET, INV_D = 7, 6, 5
SHAPE_SLIDING, SHAPE_FULL = 0, 1


@dataclass
class Program:
    words: list[int] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)      # the pipeline step of each word
    l2_map: dict[str, tuple[int, int]] = field(default_factory=dict)   # buffer -> (word address, elements)
    l2_strides: dict[str, int] = field(default_factory=dict)   # per-token buffer -> words between copies
    tokens: int = 1                                      # tokens per run (a prefill program: more than one)
    streams: tuple[int, ...] = (0,)                      # each token's stream (its KV slots)
    logits: str = "last"                                 # whose logits it leaves in LOGITS: the last token's, "all"
    #                                                      every token's, "none" (no output section)
    # (word index, SETTOK or SETPOS, token index) of every word whose immediate `bind` sets
    slots: list[tuple[int, CtrlFunc, int]] = field(default_factory=list)

    def bind(self, ids, positions) -> list[int]:
        """The words for a run of `ids` at `positions` (one each per token; the decode program takes neither:
        its token and position are the CSRs)."""
        ids, positions = list(ids), list(positions)
        if len(ids) != self.tokens or len(positions) != self.tokens:
            raise ValueError(f"the program runs {self.tokens} tokens: got {len(ids)} ids and {len(positions)} "
                             f"positions")
        words = list(self.words)
        for index, func, t in self.slots:
            imm = ids[t] if func is CtrlFunc.SETTOK else positions[t]
            words[index] = encode(Opcode.CTRL, func=func, imm=int(imm))
        return words

    def l2_listing(self, words: int) -> str:
        """The L2 buffers by address: word address, words (all of a per-token buffer's copies), elements a copy,
        and the words used of the `words` a program owns."""
        rows = sorted(self.l2_map.items(), key=lambda kv: (kv[1][0], kv[0]))
        copies = {name: self.tokens if name in self.l2_strides else 1 for name, _ in rows}
        out = [f"{'buffer':<14} {'word':>7} {'words':>7} {'elements':>9}"]
        out += [f"{name:<14} {a:>7} {-(-n // 4) * copies[name]:>7} {n:>9}" + (f" x {copies[name]} tokens"
                                                                              if copies[name] > 1 else "")
                for name, (a, n) in rows]
        used = max(a + -(-n // 4) * copies[name] for name, (a, n) in rows)
        out.append(f"{used:,} of {words:,} words used ({self.tokens} token(s) a program)")
        return "\n".join(out)

    def listing(self) -> str:
        from .asm import disassemble
        width = len(str(len(self.words)))
        return "\n".join(f"{n:>{width}}  {w:016x}  {disassemble(w):<72} # {s}"
                         for n, (w, s) in enumerate(zip(self.words, self.steps)))


class L2Map:
    """Static allocation of L2 buffers in 16-byte words. A per-token buffer has one copy per token, one after
    another (`stride` words apart); its name means the copy of token `t`."""

    def __init__(self, words: int, tokens: int = 1):
        self.words, self.tokens = words, tokens
        self.top = 0
        self.buffers: dict[str, tuple[int, int]] = {}
        self.stride: dict[str, int] = {}     # per-token buffer -> words between two tokens' copies
        self.t = 0                           # the token whose copies the names mean

    def alloc(self, name: str, elements: int, per_token: bool = False, over: str | None = None,
              offset: int = 0) -> int:
        """Allocate `name`; with `over`, inside the words of buffer `over` (all its tokens' copies) from word
        `offset` on (their lives must not overlap). A per-token buffer's copies lie one after another wherever
        it is."""
        if name in self.buffers:
            raise ValueError(f"L2 buffer {name!r} allocated twice")
        size = -(-elements // 4)
        copies = self.tokens if per_token else 1
        if over is not None:
            base, n = self.buffers[over]
            if offset + size * copies > -(-n // 4) * (self.tokens if over in self.stride else 1):
                raise ValueError(f"L2 buffer {name!r} ({copies} x {elements} elements) does not fit in buffer "
                                 f"{over!r} from word {offset}")
            self.buffers[name] = (base + offset, elements)
            if per_token:
                self.stride[name] = size
            return base + offset
        if self.top + size * copies > self.words:
            what = f"{copies} copies of {elements} elements" if copies > 1 else f"{elements} elements"
            raise ValueError(f"L2 is too small: buffer {name!r} ({what}) does not fit in {self.words} words "
                             f"({self.top} used)")
        self.buffers[name] = (self.top, elements)
        if per_token:
            self.stride[name] = size
        self.top += size * copies
        return self.buffers[name][0]

    def __getitem__(self, name: str) -> int:
        return self.buffers[name][0] + self.t * self.stride.get(name, 0)


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# Double buffers of `_Emitter.prefetch`: norm gains and scales; the AltUp modality router.
PREFETCH_PAIRS = (("gain", "gain2"), ("router", "router2"))


def gemm_pays(hw: HardwareConfig, tokens: int) -> bool:
    """Whether one WGEMM of `tokens` tokens streams a dense matrix faster than `tokens` WGEMVs: the array takes
    a k-step of 2C rows per cycle and re-streams the weights per tile of R tokens, the GEMV engine a beat of
    W weights per port and cycle on N ports (docs/systolic.md). Where the GEMV engine runs WGEMM
    (``gemv_vectors`` V > 1) it streams the weights once per V tokens: it pays from two tokens on."""
    if hw.gemv_vectors > 1:
        return tokens > 1
    tiles = -(-tokens // hw.systolic_rows)
    return tiles * hw.weights_per_beat * hw.axi_ports < 2 * hw.systolic_cols * tokens


class _Emitter:
    def __init__(self, cfg: ModelConfig, image: Image, hw: HardwareConfig, tokens: int = 1,
                 gemm: bool | None = None, streams: tuple[int, ...] | None = None):
        self.cfg, self.image, self.hw = cfg, image, hw
        self.kv_streams = (0,) * tokens if streams is None else tuple(streams)   # each token's KV slots
        self.prog = Program(tokens=tokens, streams=self.kv_streams)
        self.step = ""
        self.vl = None
        self.hd = None
        self.T = tokens
        self.gemm = gemm_pays(hw, tokens) if gemm is None else bool(gemm)
        self.looping = False                      # inside `each`: names mean one token's copies
        self.head_tokens = False                  # the LM head's WGEMMs serve every token (`_output`)
        self._up_wgemm: bool | None = None        # `up_wgemm`, once known
        self.l2 = L2Map(hw.l2_program_words, tokens)
        self.vl_after: list[int | None] = []      # the vector length in effect after each word
        self.streams: list[tuple[int, int]] = []  # (index, weight bytes) of every async WGEMV
        self.last_use: dict[str, int] = {}        # prefetch buffer -> index of its last reader
        self.turn: dict[tuple, int] = {}          # prefetch buffer pair -> the one to fill next
        self.engine: tuple[int, int] | None = None   # (src word, cols) the GEMV engine holds (WGEMV reuse)

    def emit(self, op: Opcode, **fields):
        self.prog.words.append(encode(op, l2_words=self.l2.words, **fields))
        self.prog.steps.append(self.step)
        self.vl_after.append(self.vl)
        self._forget_overwritten(op, fields)

    def _l2_write(self, op: Opcode, f: dict) -> tuple[int, int] | None:
        """The L2 elements [lo, hi) that a word of `op` with fields `f` writes (None: no L2 write)."""
        if op is Opcode.VEC and f["func"] not in VEC_REDUCTIONS:
            return f["dst"] * 4, f["dst"] * 4 + self.vl
        if op is Opcode.CVO:
            return f["dst"] * 4, f["dst"] * 4 + f["length"]
        if op is Opcode.DMA and f["dir"] is DmaDir.DDR_TO_L2:
            return f["l2"] * 4, f["l2"] * 4 + self.vl
        if op in (Opcode.GATHER, Opcode.WGEMV):
            d = self.image.descriptors[f["desc"]]
            return f["dst"] * 4, f["dst"] * 4 + (d.cols if op is Opcode.GATHER else d.rows)
        if op is Opcode.WGEMM:
            d = self.image.descriptors[f["desc"]]
            return f["dst"] * 4, f["dst"] * 4 + (f["tokens"] - 1) * -(-d.rows // 4) * 4 + d.rows
        if op is Opcode.SCALAR and f["func"] is ScalarFunc.ST:
            return f["imm"], f["imm"] + 1
        return None

    def _forget_overwritten(self, op: Opcode, f: dict):
        """Forget the engine's vector (no later WGEMV may `reuse` it) when the word just emitted writes into
        its L2 source or quantises something else into the engine (INT8 ATTN; WGEMM where the GEMV engine runs
        it)."""
        if self.engine is None:
            return
        src, cols = self.engine
        w = self._l2_write(op, f)
        if op is Opcode.ATTN or (op is Opcode.WGEMM and self.hw.gemv_vectors > 1) or \
                (w is not None and w[0] < src * 4 + cols and src * 4 < w[1]):
            self.engine = None

    # --- tokens -------------------------------------------------------------------------------------------

    def each(self, only: int | None = None):
        """Iterate over the tokens (`only`: that one), the per-token buffer names meaning each token's copies
        in turn. Inside an iteration it yields the current token alone, so building blocks that loop over the
        tokens serve one token when called from a token's iteration."""
        if self.looping:
            yield self.l2.t
            return
        self.looping = True
        try:
            for t in range(self.T) if only is None else (only,):
                self.l2.t = t
                yield t
        finally:
            self.looping, self.l2.t = False, 0

    def kv_slot(self, t: int, layer: int) -> int:
        """The KV slot (descriptor index) of cache layer `layer` for token `t`: its stream's."""
        return self.image.stream_slots[self.kv_streams[t]][layer]

    def settok(self, t: int):
        """Token t's id into TOKEN (a multi-token program only; `Program.bind` sets the immediate)."""
        if self.T > 1:
            self.emit(Opcode.CTRL, func=CtrlFunc.SETTOK, imm=t)

    def setpos(self, t: int):
        """Token t's position into POS (a multi-token program only)."""
        if self.T > 1:
            self.emit(Opcode.CTRL, func=CtrlFunc.SETPOS, imm=t)

    def wgemm_reads(self, name: str, row_start: int = 0, rows: int | None = None) -> bool:
        """Whether a WGEMM can read matrix `name` (those rows): dense, row-major, in the NPU's weight groups."""
        d = self.image.descriptor(name, row_start, rows)
        return d.layout == Layout.ROW and d.group == self.hw.weight_group

    def up_wgemm(self) -> bool:
        """Whether the FFN's up projections run as one WGEMM a piece for every token (`_ffn`, `up_words`)."""
        if self._up_wgemm is None:
            self._up_wgemm = self.T > 1 and self.gemm and all(
                self.wgemm_reads(self.sub(i, "mlp.up_proj.weight"), r0, rows)
                for i in range(self.cfg.num_hidden_layers) for r0, rows in ffn_pieces(self.cfg, i))
        return self._up_wgemm

    def proj(self, name: str, dst: str, src: str, *, sparse=0, row_start=0, rows=None, mask=None,
             live: float = 1.0, dst_off: int = 0, gemm_dst: int | None = None):
        """The projection of matrix `name` from buffer `src` into buffer `dst` (+ `dst_off` words) for every
        token (inside a token's iteration: for that token), with `mask` a buffer name (its elements from
        `dst_off` words on) for a masked WGEMV: one async WGEMM of all tokens when `gemm` holds,
        the matrix is dense and row-major and the buffers' copies lie one matrix side apart (the WGEMM's token
        strides; `gemm_dst`: the WGEMM's own output address for a `dst` laid out by the caller); otherwise a
        WGEMV per token."""
        d = self.image.descriptor(name, row_start, rows)
        m = self.l2
        strides = m.stride.get(src) == -(-d.cols // 4) and (gemm_dst is not None
                                                             or m.stride.get(dst) == -(-d.rows // 4))
        if (self.looping or self.T == 1 or not self.gemm or sparse or mask is not None
                or not self.wgemm_reads(name, row_start, rows) or not strides):
            for _ in self.each():
                self.wgemv(name, m[dst] + dst_off, m[src], sparse=sparse, row_start=row_start, rows=rows,
                           mask=None if mask is None else m[mask] + dst_off, live=live)
            return
        self.emit(Opcode.WGEMM, dst=m[dst] + dst_off if gemm_dst is None else gemm_dst, src=m[src], desc=d.index,
                  tokens=self.T, accm=0, async_=1)
        self.streams.append((len(self.prog.words) - 1, d.rows * d.cols * -(-self.T // self.hw.gemm_tile)))

    # --- small building blocks ----------------------------------------------------------------------

    def setvl(self, n: int):
        if n != self.vl:
            self.vl = n
            self.emit(Opcode.CTRL, func=CtrlFunc.SETVL, imm=n)

    def sethd(self, n: int):
        if n != self.hd:
            self.emit(Opcode.CTRL, func=CtrlFunc.SETHD, imm=n)
            self.hd = n

    def vec(self, func: VecFunc, dst=0, a=0, b=0, s=0):
        self.emit(Opcode.VEC, func=func, dst=dst, a=a, b=b, s=s, async_=0)

    def scalar(self, func: ScalarFunc, d=0, a=0, b=0, imm=0):
        self.emit(Opcode.SCALAR, func=func, d=d, a=a, b=b, imm=imm)

    def const(self, reg: int, name: str):
        """S[reg] = scalar constant `name` (from the scalars vector loaded into L2 at start)."""
        self.scalar(ScalarFunc.LD, d=reg, imm=self.l2["scalars"] * 4 + self.image.scalar_index[name])

    def _const_dma(self, name: str, dst: int) -> tuple[int, dict]:
        """The element count of CONST vector `name` and the fields of the DMA that loads it into L2 at `dst`."""
        e = self.image.tensors[name]
        if e.offset % 16:
            raise ValueError(f"constant {name!r} is not 16-byte aligned in CONST")
        return e.nbytes // 4, dict(dir=DmaDir.DDR_TO_L2, region=DdrRegion.CONST, l2=dst, offset=e.offset // 16,
                                   async_=0)

    def dma_in(self, name: str, dst: int):
        n, fields = self._const_dma(name, dst)
        self.setvl(n)
        self.emit(Opcode.DMA, **fields)

    def wgemv(self, name: str, dst: int, src: int, *, accm=0, sparse=0, row_start=0, rows=None, mask=None,
              live: float = 1.0):
        """An async WGEMV of matrix `name` (rows from `row_start`) on the vector at `src`: with `reuse` when the
        GEMV engine still holds that vector, quantised by an earlier WGEMV, and nothing has written it since
        (docs/isa.md, WGEMV). With `mask` (an L2 word address; the engine must hold `src`) only the rows whose
        mask element is not zero are fetched, about `live` of them."""
        d = self.image.descriptor(name, row_start, rows)
        reuse = int(self.engine == (src, d.cols))
        if mask is not None and not reuse:
            raise ValueError(f"a masked WGEMV of {name} needs the engine to hold its input (reuse)")
        self.engine = (src, d.cols)       # held from here on (emit forgets it if the rows overwrite src)
        # async: the engine streams the weights while later independent passes run (the NPU tracks the hazards
        # on dst, docs/architecture.md "Overlap")
        self.emit(Opcode.WGEMV, dst=dst, src=src if mask is None else mask, desc=d.index, accm=accm, findemax=0,
                  sparse=sparse, reuse=reuse, mask=int(mask is not None), async_=1)
        self.streams.append((len(self.prog.words) - 1, round(d.rows * d.cols * live)))

    def prefetch(self, name: str, pair: tuple[str, str] = PREFETCH_PAIRS[0]) -> int:
        """Load the CONST vector `name` (a norm gain, a scale, the AltUp router) into the next buffer of `pair`
        (`PREFETCH_PAIRS`) where it costs nothing: right behind the largest async WGEMV after the buffer's last
        reader (the latest of equals), so that the DMA runs under its weight stream; right behind that reader
        when no WGEMV follows it. The words in between neither read nor write the buffer (only these DMAs write
        it, only the readers `use` records read it), so the results are those of loading it in place; the
        vector length in force there is restored after the DMA. Returns the buffer's L2 word address."""
        buf = pair[self.turn.get(pair, 0)]
        self.turn[pair] = 1 - self.turn.get(pair, 0)
        n, dma = self._const_dma(name, self.l2[buf])
        words, steps = self.prog.words, self.prog.steps
        end = len(words)
        after = self.last_use.get(buf, -1)
        behind = [(nbytes, i) for i, nbytes in self.streams if i > after]
        if behind:
            pos = max(behind)[1] + 1          # the largest stream since the last reader (the latest of equals)
        elif self.streams:
            pos = after + 1                   # every stream precedes the reader: right behind the reader
        else:
            pos = end                         # no stream yet: in place
        before = self.vl_after[pos - 1] if pos else None
        new = []
        if before != n:
            new.append((CtrlFunc.SETVL, n))
        new.append(None)
        if pos < end and before != n and before is not None:
            new.append((CtrlFunc.SETVL, before))
        ins_words, ins_vl = [], []
        vl = before
        for item in new:
            if item is None:
                ins_words.append(encode(Opcode.DMA, l2_words=self.l2.words, **dma))
            else:
                vl = item[1]
                ins_words.append(encode(Opcode.CTRL, l2_words=self.l2.words, func=item[0], imm=vl))
            ins_vl.append(vl)
        words[pos:pos] = ins_words
        steps[pos:pos] = [self.step] * len(ins_words)
        self.vl_after[pos:pos] = ins_vl
        k = len(ins_words)
        self.last_use = {b: (i + k if i >= pos else i) for b, i in self.last_use.items()}
        self.streams = [(i + k if i >= pos else i, nbytes) for i, nbytes in self.streams]
        if pos == end:
            self.vl = vl
        return self.l2[buf]

    def use(self, buf_addr: int):
        """The word just emitted is the last so far to read the prefetch buffer at `buf_addr`."""
        for b in (b for pair in PREFETCH_PAIRS for b in pair):
            if self.l2[b] == buf_addr:
                self.last_use[b] = len(self.prog.words) - 1

    def rmsnorm(self, dst: str, src: str, n: int, seg: int, gain: str | None):
        """RMSNorm of buffer `src` into buffer `dst` for every token (`each`), with the CONST gain `gain`."""
        m = self.l2
        for _ in self.each():
            if gain is None:
                self.setvl(n)
                self.sethd(seg)
                self.vec(VecFunc.RMSNORM_NG, dst=m[dst], a=m[src], s=EPS)
            else:
                g = self.prefetch(gain)
                self.setvl(n)
                self.sethd(seg)
                self.vec(VecFunc.RMSNORM, dst=m[dst], a=m[src], b=g, s=EPS)
                self.use(g)

    def sub(self, i: int, name: str) -> str:
        return f"layers.{i}.{name}"


def compile_token(config: ModelConfig | dict, image: Image, hw: HardwareConfig) -> Program:
    """The instruction program that computes one decode token of `config` on the NPU: from the token id
    (CSR) to the soft-capped logits in the LOGITS region."""
    return compile_tokens(config, image, hw, tokens=1)


# Buffers a multi-token program lays over another's words, (host, names) in order (over the FFN's buffers only
# where they have a copy per token, one WGEMM serving every token): whatever lives only before
# the FFN (the setup's PLE rows; the attention's and LAuReL's) over the gate, whatever lives only after it (the
# down projection's output up to the per-layer input's projection) over the up projection, which is dead once
# GELU(gate) * up is formed; the unembedding's over the AltUp predictions, dead after the last correction.
# Each group starts at the host's first word; the sparse top-k's `centred` lies at the up projection's end, beyond
# the first piece of up, which streams while the top-k runs (`_ffn`).
_OVERLAYS = (("gate", ("x0", "ple")),
             ("gate", ("xn", "lt", "lr", "laurel", "q", "k", "v", "attn", "o", "pg", "pp")),
             ("up", ("dn", "out", "innov", "gi")), ("up", ("centred",)),
             ("pred0", ("acc",)), ("pred1", ("u",)))

# per-token buffers: (name, elements) in allocation order; the rest have one copy ("tokens" in the module doc)
_SHARED = ("scalars", "ple", "gain", "gain2", "laurel", "centred", "router", "router2", "coefs", "u", "acc",
           "rope.sliding", "rope.full", "logits", "logits2")


def compile_tokens(config: ModelConfig | dict, image: Image, hw: HardwareConfig, tokens: int = 1,
                   gemm: bool | None = None, streams=None, logits: str = "last") -> Program:
    """The program that runs `tokens` tokens (each at its own position, bound by `Program.bind`) and leaves
    soft-capped logits in the LOGITS region; ``tokens=1`` is the decode program. `gemm`: run the dense
    projections as WGEMMs (True), as WGEMVs per token (False), or as `gemm_pays` decides (None).

    `streams`: each token's stream, whose KV slots (`Image.stream_slots`) its KVST and ATTN use; by default
    every token is stream 0's, one sequence at consecutive positions (prefill). Tokens of one stream run in
    order, each attending to the ones before it; tokens of distinct streams are independent sequences
    (batched decode). `logits`: ``"last"`` leaves the last token's logits at row 0, ``"all"`` every token's,
    token t's at row t (`firmware.pack.logit_stride` elements apart; the image's `logit_rows` must hold them:
    a batched step, a speculative verify); ``"none"`` leaves out the output section (AltUp unembedding, final
    norm, LM head) and LOGITS untouched: a prefill program before the prompt's last, whose logits nobody reads."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    if logits not in LOGITS:
        raise ValueError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
    if cfg.head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (RoPE tables in whole L2 words), not {cfg.head_dim}")
    if cfg.altup_num_inputs % 4:
        raise ValueError(f"altup_num_inputs must be a multiple of 4 (AltUp coefficient rows in whole L2 words), "
                         f"not {cfg.altup_num_inputs}")
    if cfg.altup_num_inputs > INV_D:
        raise ValueError(f"altup_num_inputs must be at most {INV_D} (the prediction coefficients take S0..S{{n-1}}, "
                         f"below the constants in S{INV_D}..S7), not {cfg.altup_num_inputs}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be an integer from 1 to {MAX_TOKENS} (WGEMM's token field), not {tokens!r}")
    if streams is not None:
        if isinstance(streams, (str, bytes)) or not hasattr(streams, "__len__") or len(streams) != tokens:
            raise ValueError(f"streams must give one stream index per token ({tokens}), not {streams!r}")
        for s in streams:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < image.streams:
                raise ValueError(f"stream {s!r} is not one of the image's {image.streams} stream(s) "
                                 f"(0..{image.streams - 1}; firmware.pack.pack's streams)")
    if logits == "all" and tokens > image.logit_rows:
        raise ValueError(f"the logits of {tokens} tokens need {tokens} rows in LOGITS; the image holds "
                         f"{image.logit_rows} (firmware.pack.pack's logit_rows)")
    slots = image.staging_slots
    if image.host_tables and tokens > slots:
        raise ValueError(f"a program of {tokens} tokens needs {tokens} host-table staging slots; the image has "
                         f"{slots}")
    e = _Emitter(cfg, image, hw, tokens, gemm, None if streams is None else tuple(int(s) for s in streams))
    e.prog.logits = logits
    # every token's logits from LM-head WGEMMs, the tokens sharing each chunk's weight stream (`head_tokens`;
    # the unembedding's buffers then have a copy per token)
    head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    e.head_tokens = logits == "all" and 1 < tokens <= head_tokens(hw) and e.gemm and e.wgemm_reads(head)
    D, n, P, L = cfg.hidden_size, cfg.altup_num_inputs, cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    hd, F = cfg.head_dim, max(cfg.intermediate_size)
    a = cfg.altup_active_idx
    # --- L2 map ---------------------------------------------------------------------------------------
    # with too little room for every buffer, the prefetch pairs' second buffers are their first (`_l2_map`)
    for tight in ((False, True) if tokens > 1 else (False,)):
        e.l2 = L2Map(hw.l2_program_words, tokens)
        try:
            _l2_map(e, image, tight)
            break
        except ValueError:
            if tight or tokens == 1:
                raise
    m = e.l2

    _setup(e)
    for i in range(L):
        _layer(e, cfg, i)
    if e.head_tokens:
        _output(e)
    elif logits != "none":
        for t in e.each(only=None if logits == "all" else tokens - 1):
            _output(e, t if logits == "all" else 0)
    e.step = "end"
    e.emit(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    e.prog.l2_map = dict(m.buffers)
    e.prog.l2_strides = dict(m.stride)
    e.prog.slots = [(k, CtrlFunc(f), int(t)) for k, w in enumerate(e.prog.words)
                    for f, t in [_ctrl_slot(w)] if f is not None]
    return e.prog


MAX_TOKENS = 255
LOGITS = ("last", "all", "none")            # compile_tokens' `logits`


def sliding_ring(cfg: ModelConfig, image: Image) -> int | None:
    """The fewest rows of `image`'s sliding-window KV rings (`firmware.pack.ring_rows`), None without one."""
    rings = [image.descriptors[slot].capacity for slots in (image.stream_slots or [image.kv_slots])
             for layer, slot in slots.items() if cfg.is_sliding(layer)]
    return min(rings) if rings else None


def multi_token_limit(cfg: ModelConfig, pos: int, ring: int | None) -> int:
    """The most tokens one program may run from position `pos`, with sliding-window KV rings of `ring` rows
    (`sliding_ring` of the image; None: as wide as the window). A layer that shares the KV cache of a sliding-window
    layer reads that layer's ring after every token of the program has been stored; a later token's row then
    replaces the row of position p + T - 1 - ring, which the program's first token p still attends to unless
    it lies before the window (T <= ring - window + 1) or the ring has not wrapped (p + T <= ring). So with such
    a layer a program's tokens stay within those bounds (the rest run one per program); otherwise any number."""
    if any(cfg.is_kv_shared(i) and cfg.is_sliding(cfg.kv_source(i)) for i in range(cfg.num_hidden_layers)):
        ring = cfg.sliding_window if ring is None else ring
        return max(1, ring - cfg.sliding_window + 1, ring - pos)
    return MAX_TOKENS


def prefill_runs(cfg: ModelConfig, n: int, start: int, per_program: int,
                 ring: int | None) -> list[tuple[int, int]]:
    """``(position, tokens)`` of the programs that run `n` prompt tokens from position `start` with up to
    `per_program` tokens a program (`multi_token_limit` with rings of `ring` rows; one token: the decode
    program)."""
    runs, pos, end = [], start, start + n
    while pos < end:
        k = min(end - pos, per_program, multi_token_limit(cfg, pos, ring))
        runs.append((pos, k))
        pos += k
    return runs


def program_tokens(cfg: ModelConfig, image: Image, hw: HardwareConfig, gemm: bool | None = None) -> int:
    """The most tokens a prefill program runs on `image`: a WGEMM token tile at most (`HardwareConfig.gemm_tile`),
    as many as the host tables' staging slots and L2 hold."""
    n = min(hw.gemm_tile, image.staging_slots or hw.gemm_tile)
    while n > 1:
        try:
            compile_tokens(cfg, image, hw, n, gemm)
            return n
        except ValueError:
            n -= 1
    return 1


def _ctrl_slot(word: int):
    """(function, token index) of a CTRL SETTOK / SETPOS word, else (None, None)."""
    from hdl.isa import decode
    if word >> 60 != Opcode.CTRL.value:
        return None, None
    insn = decode(word)
    if insn.func in (CtrlFunc.SETTOK, CtrlFunc.SETPOS):
        return insn.func, insn.imm
    return None, None


def _l2_map(e: _Emitter, image: Image, tight: bool):
    """Allocate the program's L2 buffers in `e.l2`. `tight`: the prefetch pairs' second buffers (`PREFETCH_PAIRS`)
    are their first, so that a prefetch waits for the buffer's last reader (the same results, less of the DMAs
    hidden); ValueError where the buffers do not fit."""
    cfg, hw, tokens, m = e.cfg, e.hw, e.T, e.l2
    D, n, P, L = cfg.hidden_size, cfg.altup_num_inputs, cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    hd, F = cfg.head_dim, max(cfg.intermediate_size)
    m.alloc("scalars", image.tensors["scalars"].nbytes // 4)
    for k in range(n):
        m.alloc(f"xs{k}", D, per_token=True)
        m.alloc(f"pred{k}", D, per_token=True)
    sizes = {"x0": D, "pli": L * P, "ple": L * P, "gain": max(D, hd), "gain2": max(D, hd), "xn": D,
             "lt": cfg.laurel_rank, "lr": D, "laurel": D, "q": cfg.q_dim, "k": cfg.kv_dim, "v": cfg.kv_dim,
             "attn": cfg.q_dim, "o": D, "xa": D, "h": D, "gate": F, "up": up_words(cfg) if e.up_wgemm() else F,
             "centred": F, "dn": D, "out": D,
             "innov": D, "gi": D, "pg": P, "pp": D, "router": n * D, "router2": n * D, "coefs": n * n * n,
             "mvec": n, "u": D, "acc": D, "rope.sliding": hd, "rope.full": hd, "cs.sliding": hd, "cs.full": hd}
    # A multi-token program lays buffers whose lives do not meet over one another (`_OVERLAYS`) where they fit;
    # the unembedding's buffers have a copy per token where the LM head's WGEMMs serve every token.
    overlaid = {name for _, names in _OVERLAYS for name in names} if tokens > 1 else set()

    def per_token(name):
        # the FFN's buffers have one copy per token only where one WGEMM serves every token (else the FFN runs
        # token by token, `_layer`)
        return (name not in _SHARED or (name in ("u", "acc") and e.head_tokens)) and \
            (name not in ("gate", "up") or e.gemm)

    for name, size in sizes.items():
        if tight and name in ("gain2", "router2"):
            m.alloc(name, size, over=name[:-1])
        elif name not in overlaid:
            m.alloc(name, size, per_token=per_token(name))
    if overlaid:
        first_up = tokens * max(-(-ffn_pieces(cfg, i)[0][1] // 4) for i in range(L))
        for over, names in _OVERLAYS:
            if over in ("gate", "up") and not e.gemm:
                # one copy of the FFN's buffers, which the FFN token by token overwrites while the other tokens'
                # buffers laid over them would live
                for name in names:
                    m.alloc(name, sizes[name], per_token=per_token(name))
                continue
            offset, host = 0, -(-m.buffers[over][1] // 4) * (tokens if over in m.stride else 1)
            for name in names:
                words = -(-sizes[name] // 4) * (tokens if per_token(name) else 1)
                if name == "centred":
                    offset = host - words
                    if offset < first_up:
                        offset = host              # no room beyond up's first piece: its own words
                if offset + words <= host:
                    m.alloc(name, sizes[name], per_token=per_token(name), over=over, offset=offset)
                    offset += words
                else:
                    m.alloc(name, sizes[name], per_token=per_token(name))
    # the logits of a multi-token program go over the FFN's buffers where they fit (unused by then)
    free = ["up", "gate", "centred"] if tokens > 1 else []

    def logits_buffer(name):
        rows = logit_chunk_rows(cfg, hw)
        for over in free:
            if -(-rows // 4) <= -(-m.buffers[over][1] // 4) * (tokens if over in m.stride else 1):
                free.remove(over)
                return m.alloc(name, rows, over=over)
        return m.alloc(name, rows)
    logits_buffer("logits")
    if cfg.vocab_size > logit_chunk_rows(cfg, hw):
        # a second logits buffer lets a chunk's soft-cap and store run under the next chunk's weight stream;
        # without room for it the chunks run one after another (the same results)
        try:
            logits_buffer("logits2")
        except ValueError:
            pass
    if tokens > 1:
        m.alloc("target", 1, per_token=True)      # each token's AltUp magnitude target between projections



def _setup(e: _Emitter):
    """Constants, each token's RoPE cos/sin, embedding, per-layer inputs and AltUp streams."""
    cfg, m, image = e.cfg, e.l2, e.image
    D, n, P, L = cfg.hidden_size, cfg.altup_num_inputs, cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    hd, a = cfg.head_dim, cfg.altup_active_idx
    # --- 0. constants and per-token tables --------------------------------------------------------------
    e.step = "setup: scalar constants"
    e.dma_in("scalars", m["scalars"])
    e.const(EPS, "eps")
    e.const(INV_D, "inv_hidden")
    e.emit(Opcode.MEMSET, cache=ShapeCache.FMAP, slot=SHAPE_SLIDING, a=cfg.num_attention_heads // cfg.num_key_value_heads,
           b=hd, c=cfg.sliding_window)
    e.emit(Opcode.MEMSET, cache=ShapeCache.FMAP, slot=SHAPE_FULL, a=cfg.num_attention_heads // cfg.num_key_value_heads,
           b=hd, c=0)
    for kind in ("sliding", "full"):
        e.step = f"setup: RoPE cos/sin at this position ({kind} theta)"
        e.dma_in(f"rope.{kind}", m[f"rope.{kind}"])
        for t in e.each():
            e.setpos(t)
            e.emit(Opcode.CVO, func=CvoFunc.ROPE_COS, src=m[f"rope.{kind}"], dst=m[f"cs.{kind}"], length=hd // 2,
                   sub_emax=0, recip_scale=0, accm=0, async_=0)
            e.emit(Opcode.CVO, func=CvoFunc.ROPE_SIN, src=m[f"rope.{kind}"], dst=m[f"cs.{kind}"] + hd // 8,
                   length=hd // 2, sub_emax=0, recip_scale=0, accm=0, async_=0)

    # --- 1. embedding -----------------------------------------------------------------------------------
    e.step = "1 embedding x0 = E[id] * sqrt(D)"
    embed = image.descriptor("embed_tokens.weight", 0, cfg.vocab_size)
    x0 = "xs0" if a == 0 else "x0"
    for t in e.each():
        e.settok(t)
        e.emit(Opcode.GATHER, dst=m["x0"], desc=embed.index, remap=0, async_=0)
        e.const(0, "embed_scale")
        e.setvl(D)
        e.vec(VecFunc.MULS, dst=m[x0], a=m["x0"], s=0)

    # --- 3. per-layer inputs ----------------------------------------------------------------------------
    e.step = "3 PLE projection x0 W^T * D^-1/2, RMSNorm per layer"
    e.proj("per_layer_model_projection.weight", "pli", x0)
    for t in e.each():
        e.step = "3 PLE projection x0 W^T * D^-1/2, RMSNorm per layer"
        e.const(0, "ple_proj_scale")
        e.setvl(L * P)
        e.vec(VecFunc.MULS, dst=m["pli"], a=m["pli"], s=0)
        e.rmsnorm("pli", "pli", L * P, P, "per_layer_projection_norm.weight")
        e.step = "3 PLE table row (id outside the PLE vocab -> row 0) * sqrt(P), sum, * 1/sqrt(2)"
        # a staged table holds token t's row in its staging slot t (the slot's descriptor has one row)
        table = image.descriptor("embed_tokens_per_layer.weight", t if image.host_tables else 0)
        e.settok(t)
        e.emit(Opcode.GATHER, dst=m["ple"], desc=table.index, remap=1, async_=0)
        e.const(0, "ple_embed_scale")
        e.setvl(L * P)
        e.vec(VecFunc.MULS, dst=m["ple"], a=m["ple"], s=0)
        e.vec(VecFunc.ADD, dst=m["pli"], a=m["pli"], b=m["ple"])
        e.const(0, "inv_sqrt2")
        e.vec(VecFunc.MULS, dst=m["pli"], a=m["pli"], s=0)

    # --- 2. AltUp init ----------------------------------------------------------------------------------
    e.step = "2 AltUp init: target = rms(x0)"
    for _ in e.each():
        e.setvl(D)
        e.vec(VecFunc.SUMSQ, a=m[x0], s=TARGET)
        e.scalar(ScalarFunc.MUL, d=TARGET, a=TARGET, b=INV_D)
        e.scalar(ScalarFunc.SQRT, d=TARGET, a=TARGET)
        if e.T > 1:
            e.scalar(ScalarFunc.ST, a=TARGET, imm=m["target"] * 4)
    for k in range(n - 1):
        e.step = f"2 AltUp init: xs[{k + 1}] = x0 P_{k}^T rescaled to rms(x0)"
        e.proj(f"altup_projections.{k}.weight", f"xs{k + 1}", x0)
        for _ in e.each():
            if e.T > 1:
                e.scalar(ScalarFunc.LD, d=TARGET, imm=m["target"] * 4)
            _magnitude_match(e, m[f"xs{k + 1}"])
    if a != 0:
        for _ in e.each():
            e.setvl(D)
            e.vec(VecFunc.COPY, dst=m["xs0"], a=m["x0"])


def _output(e: _Emitter, row: int = 0):
    """The logits of the current token into LOGITS row `row`; with `head_tokens` (called outside `each`) every
    token's, token t's into row t: the unembedding projections and each LM-head chunk one WGEMM of all the
    tokens (the chunks of `logit_chunks` for that many tokens), a chunk's rows token after token in the logits
    buffer, soft-capped in one pass and stored a token at a time."""
    cfg, m, hw = e.cfg, e.l2, e.hw
    D, n = cfg.hidden_size, cfg.altup_num_inputs
    T = e.T if e.head_tokens else 1
    e.step = "5 unembed: target = rms(xs[0])"
    for _ in e.each():
        e.setvl(D)
        e.vec(VecFunc.SUMSQ, a=m["xs0"], s=TARGET)
        e.scalar(ScalarFunc.MUL, d=TARGET, a=TARGET, b=INV_D)
        e.scalar(ScalarFunc.SQRT, d=TARGET, a=TARGET)
        if T > 1:
            e.scalar(ScalarFunc.ST, a=TARGET, imm=m["target"] * 4)
        e.vec(VecFunc.COPY, dst=m["acc"], a=m["xs0"])
    for k in range(n - 1):
        e.step = f"5 unembed: xs[{k + 1}] U_{k}^T rescaled, summed"
        e.proj(f"altup_unembed_projections.{k}.weight", "u", f"xs{k + 1}")
        for _ in e.each():
            if T > 1:
                e.scalar(ScalarFunc.LD, d=TARGET, imm=m["target"] * 4)
            _magnitude_match(e, m["u"])
            e.setvl(D)
            e.vec(VecFunc.ADD, dst=m["acc"], a=m["acc"], b=m["u"])
    e.step = "5 mean of the streams, final norm"
    for _ in e.each():
        e.const(0, "inv_streams")
        e.setvl(D)
        e.vec(VecFunc.MULS, dst=m["acc"], a=m["acc"], s=0)
    e.rmsnorm("acc", "acc", D, D, "norm.weight")
    head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    bufs = [m["logits"]] + ([m["logits2"]] if "logits2" in m.buffers else [])

    def finish(r0, rows, buf):
        """Soft-cap the chunk of logits at `buf` (T tokens' rows, one after another) and store it."""
        e.step = f"5 LM head rows {r0}..{r0 + rows - 1}, soft-cap, store logits"
        stride = -(-rows // 4)
        if cfg.final_logit_softcapping is not None:
            e.const(0, "softcap")
            e.emit(Opcode.CVO, func=CvoFunc.SOFTCAP, src=buf, dst=buf, length=(T - 1) * stride * 4 + rows,
                   sub_emax=0, recip_scale=0, accm=0, async_=0)
        e.setvl(rows)
        for t in range(T):
            e.emit(Opcode.DMA, dir=DmaDir.L2_TO_DDR, region=DdrRegion.LOGITS, l2=buf + t * stride,
                   offset=((row + t) * logit_stride(cfg) + r0) * 4 // 16, async_=0)

    pending = None
    for k, (r0, rows) in enumerate(logit_chunks(cfg, hw, head_tokens(hw) if T > 1 else 1)):
        e.step = f"5 LM head rows {r0}..{r0 + rows - 1}, soft-cap, store logits"
        buf = bufs[k % len(bufs)]
        if T > 1:
            d = e.image.descriptor(head, r0, rows)
            e.emit(Opcode.WGEMM, dst=buf, src=m["acc"], desc=d.index, tokens=T, accm=0, async_=1)
            e.streams.append((len(e.prog.words) - 1, d.rows * d.cols))
        else:
            e.wgemv(head, buf, m["acc"], row_start=r0, rows=rows)
        if pending is not None:          # the previous chunk, under this one's stream (the other buffer)
            finish(*pending)
        pending = (r0, rows, buf)
        if len(bufs) == 1:
            finish(*pending)
            pending = None
    if pending is not None:
        finish(*pending)


def _magnitude_match(e: _Emitter, buf: int):
    """buf *= target / sqrt(max(mean(buf^2), 1e-5)), target in S6."""
    e.setvl(e.cfg.hidden_size)
    e.vec(VecFunc.SUMSQ, a=buf, s=1)
    e.scalar(ScalarFunc.MUL, d=1, a=1, b=INV_D)
    e.const(2, "mag_floor")
    e.scalar(ScalarFunc.MAX, d=1, a=1, b=2)
    e.scalar(ScalarFunc.SQRT, d=1, a=1)
    e.vec(VecFunc.MULS, dst=buf, a=buf, s=TARGET)
    e.scalar(ScalarFunc.RECIP, d=1, a=1)
    e.vec(VecFunc.MULS, dst=buf, a=buf, s=1)


def _router(e: _Emitter, i: int, src: str):
    """mvec = tanh(W_router (rmsnorm(src) * g / D)), n values, computed as tanh((W' src) * rs): the router-norm
    gain g is folded into the router's columns at pack time (W', `firmware.pack.folded_router`) and
    rs = (sum(src^2) * (1/D) + eps)^-1/2 * (1/D) uses RMSNORM's mean and epsilon. One SUMSQ and one DOT per
    router row over src, no normalised copy of it; the n tanh in one CVO pass over mvec. Uses S0 and S1. Every
    token's, the router loaded once."""
    cfg, m = e.cfg, e.l2
    D, n = cfg.hidden_size, cfg.altup_num_inputs
    w = None
    for _ in e.each():
        e.setvl(D)
        e.vec(VecFunc.SUMSQ, a=m[src], s=1)
        e.scalar(ScalarFunc.MUL, d=1, a=1, b=INV_D)
        e.scalar(ScalarFunc.ADD, d=1, a=1, b=EPS)
        e.scalar(ScalarFunc.RSQRT, d=1, a=1)
        e.scalar(ScalarFunc.MUL, d=1, a=1, b=INV_D)              # S1 = rs
        if w is None:
            w = e.prefetch(folded_router_name(i), PREFETCH_PAIRS[1])
        e.setvl(D)
        for j in range(n):
            e.vec(VecFunc.DOT, a=w + j * D // 4, b=m[src], s=0)
            e.use(w)
            e.scalar(ScalarFunc.MUL, d=0, a=0, b=1)
            e.scalar(ScalarFunc.ST, a=0, imm=m["mvec"] * 4 + j)
        # one SFU pass for the n tanh, not n one-element passes (the same function, the same bits)
        e.emit(Opcode.CVO, func=CvoFunc.TANH, src=m["mvec"], dst=m["mvec"], length=n, sub_emax=0, recip_scale=0,
               accm=0, async_=0)


def _layer(e: _Emitter, cfg: ModelConfig, i: int):
    m = e.l2
    D, n, hd = cfg.hidden_size, cfg.altup_num_inputs, cfg.head_dim
    a = cfg.altup_active_idx
    L = f"layer {i}: "
    if D % 4:
        raise ValueError(f"hidden_size must be a multiple of 4 (whole L2 words), not {D}")
    # 4.A AltUp predict
    e.step = L + "4.A AltUp router on xs[active]"
    _router(e, i, f"xs{a}")
    e.step = L + "4.A AltUp predict: pred[r] = xs[r] + sum_c C[r][c] xs[c]"
    e.dma_in(e.sub(i, "altup.prediction_coefs.weight"), m["coefs"])

    def predict(rows):
        for _ in e.each():
            for r in rows:
                e.setvl(n)
                for c in range(n):
                    e.vec(VecFunc.DOT, a=m["coefs"] + (r * n + c) * n // 4, b=m["mvec"], s=c)
                e.setvl(D)
                for c in range(n):      # the first FMAS adds xs[r] itself: pred[r] needs no copy of it first
                    e.vec(VecFunc.FMAS, dst=m[f"pred{r}"], a=m[f"xs{c}"], b=m[f"xs{r}" if c == 0 else f"pred{r}"],
                          s=c)
    # Only the active stream's prediction is needed now; the others are first read by the correction, so
    # they run under the gate projection's weight stream (the coefficients and the router's mvec stay in L2
    # until the correction's router and coefficients replace them).
    predict([a])
    x_in = f"pred{a}"
    e.step = L + "4.B input norm"
    e.rmsnorm("xn", x_in, D, D, e.sub(i, "input_layernorm.weight"))
    # The projections are software-pipelined: each WGEMV is issued before the vector work on the previous
    # one's rows, so that work runs while the engine streams the next matrix (async WGEMV; the NPU tracks
    # the hazards, docs/architecture.md "Overlap"). Every buffer keeps one producer per layer.
    kind = "sliding" if cfg.is_sliding(i) else "full"
    shared = cfg.is_kv_shared(i)
    laurel = L + "4.C LAuReL: xn + norm(R(L(xn)))"
    q_step = L + f"4.B Q projection, QK-norm, RoPE ({kind})"
    # xn is quantised once, for LAuReL's left matrix; Q, K and V `reuse` it. LAuReL's right matrix (input lt)
    # comes after them, its norm and merge under o_proj's stream.
    e.step = laurel
    e.proj(e.sub(i, "laurel.linear_left.weight"), "lt", "xn")
    e.step = q_step
    e.proj(e.sub(i, "self_attn.q_proj.weight"), "q", "xn")
    kv = L + "4.B K projection, K-norm, RoPE; V projection, V-norm; store to the KV cache"

    def norm_rope(buf, n, gain):
        for _ in e.each():
            e.rmsnorm(buf, buf, n, hd, e.sub(i, gain))
            e.setvl(n)
            e.sethd(hd)
            e.vec(VecFunc.ROPE, dst=m[buf], a=m[buf], b=m[f"cs.{kind}"])

    if not shared:
        e.step = kv
        e.proj(e.sub(i, "self_attn.k_proj.weight"), "k", "xn")
    e.step = q_step
    norm_rope("q", cfg.q_dim, "self_attn.q_norm.weight")
    if not shared:
        e.step = kv
        e.proj(e.sub(i, "self_attn.v_proj.weight"), "v", "xn")
        norm_rope("k", cfg.kv_dim, "self_attn.k_norm.weight")
    e.step = laurel
    e.proj(e.sub(i, "laurel.linear_right.weight"), "lr", "lt")
    src = cfg.kv_source(i)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    # token by token, in order: token t's KV row is stored before its attention and after token t-1's, so it
    # attends to the tokens before it and itself, as in decoding
    for t in e.each():
        if not shared:
            e.step = kv
            e.rmsnorm("v", "v", cfg.kv_dim, hd, None)
            e.setpos(t)
            e.emit(Opcode.KVST, k=m["k"], v=m["v"], slot=e.kv_slot(t, i), shape_ptr=0, async_=0)
        else:
            e.setpos(t)
        e.step = L + f"4.B-5 attention over the KV cache of layer {src} ({kind}" + \
            (f", window {cfg.sliding_window})" if cfg.is_sliding(i) else ")")
        for g in range(cfg.num_key_value_heads):
            off = g * group * hd // 4
            e.emit(Opcode.ATTN, dst=m["attn"] + off, q=m["q"] + off, slot=e.kv_slot(t, src), kv_head=g,
                   shape_ptr=SHAPE_SLIDING if cfg.is_sliding(i) else SHAPE_FULL, async_=0)
    e.step = L + "4.B-5 o_proj, 4.C post-attention norm, residual, LAuReL merge / sqrt(2)"
    e.proj(e.sub(i, "self_attn.o_proj.weight"), "o", "attn")
    gate_step = L + "4.D FFN: pre-norm, gate"
    for _ in e.each():
        e.step = laurel
        e.rmsnorm("lr", "lr", D, D, e.sub(i, "laurel.post_laurel_norm.weight"))
        e.setvl(D)
        e.vec(VecFunc.ADD, dst=m["laurel"], a=m["xn"], b=m["lr"])
        e.step = L + "4.B-5 o_proj, 4.C post-attention norm, residual, LAuReL merge / sqrt(2)"
        e.rmsnorm("o", "o", D, D, e.sub(i, "post_attention_layernorm.weight"))
        e.setvl(D)
        e.vec(VecFunc.ADD, dst=m["xa"], a=m[x_in], b=m["o"])
        e.vec(VecFunc.ADD, dst=m["xa"], a=m["xa"], b=m["laurel"])
        e.const(0, "inv_sqrt2")
        e.vec(VecFunc.MULS, dst=m["xa"], a=m["xa"], s=0)
        e.step = gate_step
        e.rmsnorm("h", "xa", D, D, e.sub(i, "pre_feedforward_layernorm.weight"))
    if e.T > 1 and not e.gemm:
        # token by token where the projections are WGEMVs anyway (the FFN's buffers then have one copy)
        for _ in e.each():
            _ffn(e, cfg, i, predict)
    else:
        _ffn(e, cfg, i, predict)
    e.rmsnorm("dn", "dn", D, D, e.sub(i, "post_feedforward_layernorm.weight"))
    for _ in e.each():
        e.setvl(D)
        e.vec(VecFunc.ADD, dst=m["out"], a=m["xa"], b=m["dn"])
    e.step = L + "4.E AltUp correct (router on the unscaled output)"
    _router(e, i, "out")
    e.dma_in(e.sub(i, "altup.correction_coefs.weight"), m["coefs"])

    def correct(rows):
        for _ in e.each():
            e.const(4, "one")
            for r in rows:
                e.setvl(n)
                e.vec(VecFunc.DOT, a=m["coefs"] + r * n // 4, b=m["mvec"], s=0)
                e.scalar(ScalarFunc.ADD, d=0, a=0, b=4)
                e.setvl(D)
                e.vec(VecFunc.FMAS, dst=m[f"xs{r}"], a=m["innov"], b=m[f"pred{r}"], s=0)
    # The PLE reads only the active stream: the other streams' corrections run under its two weight streams.
    others = [r for r in range(n) if r != a]
    for _ in e.each():
        e.setvl(D)
        e.vec(VecFunc.SUB, dst=m["innov"], a=m["out"], b=m[x_in])
        correct([a])
    _ple(e, cfg, i, correct, others)


def _ffn(e: _Emitter, cfg: ModelConfig, i: int, predict):
    """4.D: gate, the other streams' predictions under its stream, the sparse top-k, up in pieces with
    GELU(gate) * up under the next piece's stream, down (every token's, or the current token's)."""
    m = e.l2
    n, a = cfg.altup_num_inputs, cfg.altup_active_idx
    F = cfg.intermediate_size[i]
    L = f"layer {i}: "
    e.step = L + "4.D FFN: pre-norm, gate"
    e.proj(e.sub(i, "mlp.gate_proj.weight"), "gate", "h")
    e.step = L + "4.A AltUp predict, the other streams (under the gate projection's stream)"
    predict([r for r in range(n) if r != a])
    pieces = ffn_pieces(cfg, i)
    sparse = cfg.activation_sparsity_pattern[i] > 0
    up_step = L + "4.D FFN: up, GELU(gate) * up, down" + (" (sparse: zero columns skipped)" if sparse else "")
    e.step = up_step
    up = e.sub(i, "mlp.up_proj.weight")
    # With the GEMV engine's row mask the up projection of a sparse layer fetches only the rows of the gate
    # units the top-k keeps (GELU(0) * up = 0 whatever up is), so it runs after the top-k; without it, its first
    # piece streams while the top-k runs.
    # (a masked WGEMV reuses the engine's activations, h, which only a token's own gate WGEMV leaves there: where
    # one WGEMM serves every token, the up projection is a WGEMM too, its rows of zeroed gate units multiplied by
    # GELU(0) = 0 all the same)
    masked = sparse and e.hw.gemv_row_mask and (e.T == 1 or e.looping)
    live = 1.0 - cfg.activation_sparsity_pattern[i]
    # as WGEMMs, the pieces take turns in two slots of `up` (`up_words`), piece k's outputs token after token in
    # slot k % 2 (a piece's WGEMM strides): piece k + 1 streams into one while GELU(gate) * up reads the other
    whole = not e.looping and not masked and e.up_wgemm()
    slot = e.T * up_words(cfg) // 8

    def up_off(k, rows, t):
        return (k % 2) * slot + t * -(-rows // 4) if whole else pieces[k][0] // 4

    def up_piece(k):
        r0, rows = pieces[k]
        e.proj(up, "up", "h", row_start=r0, rows=rows, dst_off=r0 // 4,
               gemm_dst=e.l2.buffers["up"][0] + up_off(k, rows, 0) if whole else None,
               **(dict(mask="gate", live=live) if masked else {}))
        if whole:
            assert decode(e.prog.words[-1]).op is Opcode.WGEMM, f"{up} rows {r0}.. must be one WGEMM"

    if not masked:
        up_piece(0)
    if sparse:
        e.step = L + "4.D Gaussian top-k: cutoff = mean + z * std (population)"
        for _ in e.each():
            e.setvl(F)
            e.vec(VecFunc.SUM, a=m["gate"], s=0)
            e.const(1, f"inv_ffn.{i}")
            e.scalar(ScalarFunc.MUL, d=0, a=0, b=1)                  # S0 = mean
            e.const(2, "minus_one")
            e.scalar(ScalarFunc.MUL, d=2, a=0, b=2)                  # S2 = -mean
            e.vec(VecFunc.ADDS, dst=m["centred"], a=m["gate"], s=2)
            e.vec(VecFunc.SUMSQ, a=m["centred"], s=3)
            e.scalar(ScalarFunc.MUL, d=3, a=3, b=1)
            e.scalar(ScalarFunc.SQRT, d=3, a=3)                      # S3 = std
            e.const(4, f"std_mult.{i}")
            e.scalar(ScalarFunc.MUL, d=3, a=3, b=4)
            e.scalar(ScalarFunc.ADD, d=3, a=0, b=3)                  # cutoff
            e.vec(VecFunc.RELU_SUBS, dst=m["gate"], a=m["gate"], s=3)
    e.step = up_step
    if masked:
        up_piece(0)
    for k, (r0, rows) in enumerate(pieces):
        if k + 1 < len(pieces):
            up_piece(k + 1)
        for t in e.each():
            e.setvl(rows)
            base = e.l2.buffers["up"][0] + up_off(k, rows, t) if whole else m["up"] + r0 // 4
            e.vec(VecFunc.GELU_MUL, dst=m["gate"] + r0 // 4, a=m["gate"] + r0 // 4, b=base)
    down = e.sub(i, "mlp.down_proj.weight")
    e.proj(down, "dn", "gate", sparse=int(sparse and e.image.tensors[down].layout == Layout.COL))


def up_words(cfg: ModelConfig) -> int:
    """Elements a token's copy of the up projection's buffer takes where one WGEMM a piece serves every token:
    two slots of the widest piece (`firmware.pack.ffn_pieces`, `_ffn`), the whole width with one piece."""
    pieces = [rows for i in range(cfg.num_hidden_layers) for _, rows in ffn_pieces(cfg, i)]
    widest = -(-max(pieces) // 4) * 4
    return 2 * widest if 2 * widest < max(cfg.intermediate_size) else -(-max(cfg.intermediate_size) // 4) * 4


def _ple(e: _Emitter, cfg: ModelConfig, i: int, correct, others):
    """4.E: the per-layer input's gate and projection, the other streams' corrections under their streams."""
    m = e.l2
    D, a, P = cfg.hidden_size, cfg.altup_active_idx, cfg.hidden_size_per_layer_input
    L = f"layer {i}: "
    e.step = L + "4.E PLE: gate(xs[active] * correct_output_scale) * pli, project, norm, add to xs[1:]"
    step = e.step
    if cfg.altup_correct_scale:
        g = e.prefetch(e.sub(i, "altup.correct_output_scale"))
        for _ in e.each():
            e.setvl(D)
            e.vec(VecFunc.MUL, dst=m["gi"], a=m[f"xs{a}"], b=g)
            e.use(g)
    else:
        for _ in e.each():
            e.setvl(D)
            e.vec(VecFunc.COPY, dst=m["gi"], a=m[f"xs{a}"])
    e.proj(e.sub(i, "per_layer_input_gate.weight"), "pg", "gi")
    if P % 4:
        raise ValueError(f"hidden_size_per_layer_input must be a multiple of 4, not {P}")
    half = (len(others) + 1) // 2
    for _ in e.each():
        e.step = L + "4.E AltUp correct, the other streams (under the PLE streams)"
        correct(others[:half])
        e.step = step
        e.setvl(P)
        e.vec(VecFunc.GELU_MUL, dst=m["pg"], a=m["pg"], b=m["pli"] + i * P // 4)
    e.proj(e.sub(i, "per_layer_projection.weight"), "pp", "pg")
    e.step = L + "4.E AltUp correct, the other streams (under the PLE streams)"
    correct(others[half:])
    e.step = step
    e.rmsnorm("pp", "pp", D, D, e.sub(i, "post_per_layer_input_norm.weight"))
    for _ in e.each():
        e.setvl(D)
        for r in range(1, cfg.altup_num_inputs):
            e.vec(VecFunc.ADD, dst=m[f"xs{r}"], a=m[f"xs{r}"], b=m["pp"])


# --- command line ------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    """``python -m firmware.compiler (--checkpoint DIR | --model M) [--hw HW] [--gemv-vectors V] [--memory-map MAP]
    [--max-positions N] [--tokens T] [--logits {last,all}] [--l2-map] [--out FILE]``: the token program
    (``--tokens``: a prefill program of T tokens, its SETTOK/SETPOS immediates the token indices; with
    ``--logits all`` every token's logits, as a verify pass computes them) of a model for a hardware preset, over
    an image that is only planned (`firmware.pack.pack` with ``fill=False``: no weights are read). Prints the
    listing (`Program.listing`), or with ``--l2-map`` the program's L2 buffers (word address, words, and the
    words used of those a program owns), or writes the words (little-endian u64) to FILE and the listing to
    FILE.lst. Bad input: one line on stderr naming the option, exit status 2."""
    import argparse
    import json
    import os
    import sys

    from hdl.config import PRESETS as HW_PRESETS
    from hdl.memory_map import MEMORY_MAPS
    from sim.config import PRESETS as MODEL_PRESETS

    from .cli import POSITIVE, arg_type
    from .pack import pack

    p = argparse.ArgumentParser(prog="python -m firmware.compiler",
                                description="Compile the NPU's token program for a model and a hardware preset "
                                            "and print its listing (or write it with --out).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR",
                     help="Hugging Face checkpoint directory (only its config.json is read)")
    src.add_argument("--model", choices=sorted(MODEL_PRESETS), help="a built-in configuration")
    p.add_argument("--hw", default="kv260", choices=sorted(HW_PRESETS), help="hardware preset (default kv260)")
    p.add_argument("--memory-map", default="flat", choices=list(MEMORY_MAPS),
                   help="where the planned image goes (default flat; the program's words do not depend on it, "
                        "the plan checks the image fits)")
    p.add_argument("--max-positions", type=POSITIVE, metavar="N",
                   help="positions the KV cache holds (default: the model's max_position_embeddings)")
    p.add_argument("--tokens", type=POSITIVE, default=1, metavar="T",
                   help=f"tokens per program: 1 is the decode program, more a prefill program "
                        f"(compile_tokens; at most {MAX_TOKENS}) (default 1)")
    p.add_argument("--gemv-vectors", type=arg_type("an integer from 1 to 4", int, lambda v: 1 <= v <= 4),
                   metavar="V", help="activation vectors of the GEMV engine (HardwareConfig.gemv_vectors): with V > 1 "
                                     "WGEMM runs on it (default: the preset's)")
    p.add_argument("--logits", default="last", choices=LOGITS,
                   help="the last token's logits (a prefill program, default), every token's (a verify pass) or "
                        "none (a prefill program before the prompt's last)")
    p.add_argument("--l2-map", action="store_true", help="print the program's L2 buffers instead of the listing")
    p.add_argument("--out", metavar="FILE", help="write the words to FILE and the listing to FILE.lst")
    args = p.parse_args(argv)
    if args.checkpoint is not None:
        path = os.path.join(args.checkpoint, "config.json")
        if not os.path.isdir(args.checkpoint):
            p.error(f"argument --checkpoint: {args.checkpoint!r} is not a directory")
        try:
            with open(path, encoding="utf-8") as f:
                cfg = ModelConfig.from_hf(json.load(f))
        except FileNotFoundError:
            p.error(f"argument --checkpoint: {args.checkpoint!r} has no config.json")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            reason = str(e).strip("'\"")       # a KeyError's message comes quoted
            p.error(f"argument --checkpoint: {path!r} is not a Gemma 3n config: {reason}")
    else:
        cfg = ModelConfig.preset(args.model)
    hw = HardwareConfig.preset(args.hw)
    if args.gemv_vectors:
        hw = hw.replace(gemv_vectors=args.gemv_vectors, gemv_pairs=hw.gemv_pairs and args.gemv_vectors % 2 == 0)
    try:
        image = pack(cfg, None, hw, fill=False, max_positions=args.max_positions, memory_map=args.memory_map,
                     logit_rows=args.tokens if args.logits == "all" else 1)
        program = compile_tokens(cfg, image, hw, tokens=args.tokens, logits=args.logits)
    except ValueError as e:
        p.error(f"cannot compile for --hw {args.hw}, --memory-map {args.memory_map}"
                + (f", --tokens {args.tokens}" if args.tokens > 1 else "") + f": {e}")
    if args.l2_map:
        print(program.l2_listing(hw.l2_program_words))
        return 0
    if args.out is None:
        print(program.listing())
        return 0
    listing = args.out + ".lst"
    try:
        with open(args.out, "wb") as f:
            f.write(struct.pack(f"<{len(program.words)}Q", *program.words))
        with open(listing, "w", encoding="utf-8") as f:
            f.write(program.listing() + "\n")
    except OSError as e:
        p.error(f"argument --out: cannot write {e.filename!r}: {e.strerror}")
    print(f"wrote {args.out} ({len(program.words)} words, {8 * len(program.words)} bytes) and {listing}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
