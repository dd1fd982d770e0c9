"""The controller's sequencers in Amaranth's simulator, against `sim.plan`: the fast controller tier.

Each sequencer (`hdl.controller.VectorSequencer`, `AttentionSequencer`, `MatrixSequencer`) runs directed
instructions with the real scalar ALU and divider beside it; the bench plays the pass engine and the engine
tracker at their stream contracts (a pass is taken at once and completes a seeded random number of cycles
later; a GEMV job or a WGEMM tile keeps the tracker busy for a random while), records every step the
sequencer starts, and compares them with the plan of the same instruction (`sim.plan.plan`, the ISS's
decomposition). Values are the full-chip bench's business (tests/test_npu.py, ``-m slow``); the order,
kinds and sizes of the steps, the error codes of bad instructions, and every DDR address KVST and ATTN name on
the INT8 cache (against `sim.numerics.KvInt8Layout`) are checked here in seconds.
"""

import random

import pytest
from amaranth import Elaboratable, Module
from amaranth.lib.wiring import connect
from amaranth.sim import Simulator

from firmware.pack import Descriptor
from hdl.config import HardwareConfig
from hdl.controller import AttentionSequencer, BSrc, MatrixSequencer, ScalarAlu, Sink, Src, VectorSequencer
from hdl.ddrio import DdrFormat
from hdl.isa import CvoFunc, DdrRegion, DescKind, DmaDir, ErrorCode, Opcode, VecFunc, decode, encode
from hdl.seq import SeqDivider
from hdl.sfu import SfuOp
from sim.numerics import KvInt8Layout
from sim.plan import DESC_LOAD, Alu, Engine, Gemm, Pass, State, attn_k_group, attn_pieces, plan

TINY = HardwareConfig.preset("tiny")
TINY_FP16 = HardwareConfig.preset("tiny_fp16")
ONE = 0x3F800000              # binary32 1.0: every scalar result the bench hands back


class Rig(Elaboratable):
    """A sequencer with the real `SeqDivider` and `ScalarAlu` on its ports."""

    def __init__(self, seq):
        self.seq = seq
        self.alu = ScalarAlu() if hasattr(seq, "o_alu") else None

    def elaborate(self, platform):
        m = Module()
        m.submodules.seq = seq = self.seq
        m.submodules.div = div = SeqDivider()
        m.d.comb += [div.i_start.eq(seq.div.start), div.i_num.eq(seq.div.num), div.i_den.eq(seq.div.den),
                     seq.div.busy.eq(div.o_busy), seq.div.q.eq(div.o_q), seq.div.r.eq(div.o_r)] \
            if hasattr(seq, "div") else []
        if self.alu is not None:
            m.submodules.alu = self.alu
            connect(m, seq.o_alu, self.alu.i_cmd)
            connect(m, self.alu.o_y, seq.i_alu)
        return m


def _name(cls, v):
    return v.name if isinstance(v, cls) else cls(v).name


def run(seq, word, *, vl=0, hd=0, pos=0, desc=None, fmap=(0, 0, 0), act_n=0, seed=1, max_cycles=200_000,
        ddr=None, engine_busy=0):
    """Run one instruction on `seq`; (its steps, its end code). `engine_busy`: cycles the engine tracker is still
    active at the start (an async WGEMV running). With a list `ddr`, every DDR address the
    instruction names is appended to it, in order: ``("rd", addr)`` for a DDR source, ``("wr", addr)`` for a
    DDR sink, ``("gemv", wbase, sbase)`` for a GEMV job."""
    rig = Rig(seq)
    rng = random.Random(seed)
    out = {}

    async def bench(ctx):
        c = seq.i_ctx
        for sig, v in ((c.word, word), (c.vl, vl), (c.hd, hd), (c.inv_hd, ONE), (c.pos, pos), (c.token, 3),
                       (c.emax, ONE), (c.fmap.heads, fmap[0]), (c.fmap.head_dim, fmap[1]), (c.fmap.window, fmap[2])):
            ctx.set(sig, v)
        for i in range(8):
            ctx.set(c.s[i], ONE)
        for r in DdrRegion:
            ctx.set(c.base[r.value], 0x1000_0000 * (r.value + 1))
        if desc is not None:
            kv = desc.kind == DescKind.KV
            for name, v in (("weight_offset", desc.weight_offset), ("scale_offset", desc.scale_offset),
                            ("rows", desc.capacity if kv else desc.rows),
                            ("cols", desc.heads * desc.head_dim if kv else desc.cols), ("kind", DescKind(desc.kind)),
                            ("layout", desc.layout), ("log2_group", desc.group.bit_length() - 1 if desc.group else 0),
                            ("heads", desc.heads), ("head_dim", desc.head_dim)):
                ctx.set(getattr(c.desc, name), v)
        ctx.set(seq.o_pass.ready, 1)
        engine = hasattr(seq, "o_gemv")
        if engine:
            ctx.set(seq.o_gemv.ready, 1)
            if hasattr(seq, "o_gemm"):
                ctx.set(seq.o_gemm.ready, 1)
            # the tracker's state is there before the instruction starts (the sequencers register checks on it
            # from the start cycle on)
            ctx.set(seq.i_engine.active, engine_busy > 0)
            ctx.set(seq.i_engine.idle, engine_busy == 0)
            ctx.set(seq.i_engine.act_n, act_n)
        ctx.set(seq.i_start, 1)
        await ctx.tick()
        ctx.set(seq.i_start, 0)
        steps, pass_left, busy_left, n_act = [], None, engine_busy, act_n
        for _ in range(max_cycles):
            ctx.set(seq.i_done.valid, pass_left == 0)
            ctx.set(seq.i_done.payload.result, ONE)
            if engine:
                ctx.set(seq.i_engine.active, busy_left > 0)
                ctx.set(seq.i_engine.idle, busy_left == 0)
                ctx.set(seq.i_engine.act_n, n_act)
            started_engine = False
            if engine and ctx.get(seq.o_gemv.valid):
                assert busy_left == 0, "a GEMV job while the engine runs"
                j = seq.o_gemv.payload.cmd
                vectors = ctx.get(j.vecs) + 1 if seq.hw.gemv_vectors > 1 else 1
                if word >> 60 == Opcode.WGEMM.value and seq.hw.gemv_row_mask:
                    assert not ctx.get(j.mask), "a WGEMM's GEMV job with the row mask"
                int8 = "int8" in dict(j.shape().members) and bool(ctx.get(j.int8))
                steps.append(Engine(ctx.get(j.rows), ctx.get(j.cols), bool(ctx.get(j.accm)), bool(ctx.get(j.sparse)),
                                    vectors, int8=int8))
                if ddr is not None:
                    ddr.append(("gemv", ctx.get(j.wbase), ctx.get(j.sbase)) + ((ctx.get(j.pitch),) if int8 else ()))
                busy_left, started_engine = rng.randint(1, 30), True
            if hasattr(seq, "o_gemm") and ctx.get(seq.o_gemm.valid):
                assert busy_left == 0, "a WGEMM tile while the engine runs"
                j = seq.o_gemm.payload.cmd
                steps.append(Gemm(ctx.get(j.rows), ctx.get(j.cols), ctx.get(j.ntok), bool(ctx.get(j.accm))))
                busy_left = rng.randint(1, 30)
            next_pass = None if pass_left in (None, 0) else pass_left - 1
            if ctx.get(seq.o_pass.valid):
                assert pass_left in (None, 0), "a pass while the engine runs one"
                p = seq.o_pass.payload
                op = None if ctx.get(p.bypass) else _name(SfuOp, ctx.get(p.op))
                src = _name(Src, ctx.get(p.a))
                stride = ctx.get(p.wr_stride) if "wr_stride" in dict(p.shape().members) else 0
                steps.append(Pass(op, src, _name(BSrc, ctx.get(p.b)), _name(Sink, ctx.get(p.sink)), ctx.get(p.n),
                                  _name(DdrFormat, ctx.get(p.ddr_fmt)) if src == "DDR" else None,
                                  beside=started_engine, stride=stride != 0))
                if ddr is not None and _name(Src, ctx.get(p.a)) == "DDR":
                    ddr.append(("rd", ctx.get(p.ddr_addr)))
                if ddr is not None and _name(Sink, ctx.get(p.sink)) == "DDR":
                    ddr.append(("wr", ctx.get(p.ddr_addr)) + ((stride,) if stride else ()))
                next_pass = rng.randint(0, 6)
            if rig.alu is not None and ctx.get(rig.alu.i_cmd.valid) and ctx.get(rig.alu.i_cmd.ready):
                steps.append(Alu())
            if engine and ctx.get(seq.o_act_n.valid):
                n_act = ctx.get(seq.o_act_n.payload)
            if ctx.get(seq.o_end.valid):
                out["steps"], out["code"] = steps, _name(ErrorCode, ctx.get(seq.o_end.payload.code))
                return
            await ctx.tick()
            pass_left = next_pass
            busy_left = max(0, busy_left - 1)
        raise AssertionError("the sequencer did not end the instruction")

    sim = Simulator(rig)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return out["steps"], out["code"]


def _insn(hw, op, **fields):
    word = encode(op, l2_words=hw.l2_bytes // 16, **fields)
    return word, decode(word, l2_words=hw.l2_bytes // 16)


def check(seq_cls, hw, op, fields, *, seed=1, **state):
    """The sequencer's steps for one instruction equal its plan (after the controller's descriptor load)."""
    word, insn = _insn(hw, op, **fields)
    steps, code = run(seq_cls(hw), word, seed=seed, **state)
    want = plan(insn, State(vl=state.get("vl", 0), hd=state.get("hd", 0), pos=state.get("pos", 0),
                            desc=state.get("desc"), fmap=state.get("fmap", (0, 0, 0))), hw)
    if want[:1] == [DESC_LOAD]:
        want = want[1:]
    assert code == "NONE"
    assert steps == want, f"{op.name}: {len(steps)} steps, plan {len(want)}"
    return steps


VEC = [
    ({"func": VecFunc.ADD, "dst": 64, "a": 0, "b": 16, "s": 0, "async_": 0}, {"vl": 37}),
    ({"func": VecFunc.SUM, "dst": 0, "a": 0, "b": 0, "s": 2, "async_": 0}, {"vl": 61}),
    ({"func": VecFunc.DOT, "dst": 0, "a": 0, "b": 32, "s": 2, "async_": 0}, {"vl": 16}),
    ({"func": VecFunc.GELU_MUL, "dst": 64, "a": 0, "b": 32, "s": 0, "async_": 0}, {"vl": 9}),
    ({"func": VecFunc.RMSNORM, "dst": 64, "a": 0, "b": 32, "s": 1, "async_": 0}, {"vl": 48, "hd": 16}),
    ({"func": VecFunc.RMSNORM_NG, "dst": 64, "a": 0, "b": 0, "s": 1, "async_": 0}, {"vl": 32, "hd": 32}),
    ({"func": VecFunc.ROPE, "dst": 64, "a": 0, "b": 32, "s": 0, "async_": 0}, {"vl": 64, "hd": 16}),
]
CVO = [
    {"func": CvoFunc.EXP, "src": 0, "dst": 64, "length": 10, "sub_emax": 1, "recip_scale": 0, "accm": 0, "async_": 0},
    {"func": CvoFunc.SOFTCAP, "src": 0, "dst": 64, "length": 7, "sub_emax": 0, "recip_scale": 0, "accm": 1,
     "async_": 0},
    {"func": CvoFunc.SCALE, "src": 0, "dst": 64, "length": 5, "sub_emax": 0, "recip_scale": 1, "accm": 0,
     "async_": 0},
    {"func": CvoFunc.REDUCE_SUM, "src": 0, "dst": 64, "length": 33, "sub_emax": 0, "recip_scale": 0, "accm": 1,
     "async_": 0},
    {"func": CvoFunc.ROPE_COS, "src": 0, "dst": 64, "length": 8, "sub_emax": 0, "recip_scale": 0, "accm": 1,
     "async_": 0},
]


@pytest.mark.parametrize("fields,state", VEC, ids=[f["func"].name for f, _ in VEC])
def test_vector_sequencer_vec(fields, state):
    check(VectorSequencer, TINY, Opcode.VEC, fields, **state)


@pytest.mark.parametrize("fields", CVO, ids=[f"{f['func'].name}{'_accm' if f['accm'] else ''}" for f in CVO])
def test_vector_sequencer_cvo(fields):
    check(VectorSequencer, TINY, Opcode.CVO, fields)


@pytest.mark.parametrize("direction,region", [(DmaDir.DDR_TO_L2, DdrRegion.CONST), (DmaDir.L2_TO_DDR, DdrRegion.LOGITS)])
def test_vector_sequencer_dma(direction, region):
    check(VectorSequencer, TINY, Opcode.DMA, {"dir": direction, "region": region, "l2": 4, "offset": 3,
                                              "async_": 0}, vl=21)


def _matrix(rows, cols, layout=0, group=32):
    return Descriptor(index=0, kind=DescKind.INT4, tensor="w", rows=rows, cols=cols, weight_offset=256,
                      scale_offset=8192, layout=layout, group=group)


WGEMV = [
    ({"accm": 0, "findemax": 0, "sparse": 0, "reuse": 0, "mask": 0, "async_": 0}, {}),
    ({"accm": 1, "findemax": 0, "sparse": 0, "reuse": 0, "mask": 0, "async_": 1}, {}),
    ({"accm": 0, "findemax": 1, "sparse": 0, "reuse": 0, "mask": 0, "async_": 0}, {}),
    ({"accm": 0, "findemax": 0, "sparse": 0, "reuse": 1, "mask": 0, "async_": 1}, {"act_n": 40}),
    ({"accm": 0, "findemax": 0, "sparse": 1, "reuse": 0, "mask": 0, "async_": 0}, {"layout": 1}),
]


@pytest.mark.parametrize("flags,extra", WGEMV, ids=["plain", "accm_async", "findemax", "reuse", "sparse"])
def test_matrix_sequencer_wgemv(flags, extra):
    desc = _matrix(24, 40, layout=extra.get("layout", 0))
    check(MatrixSequencer, TINY, Opcode.WGEMV, {"dst": 64, "src": 0, "desc": 0, **flags}, desc=desc,
          act_n=extra.get("act_n", 0))


def test_matrix_sequencer_wgemm_in_tiles():
    steps = check(MatrixSequencer, TINY, Opcode.WGEMM, {"dst": 200, "src": 0, "desc": 0, "tokens": 9, "accm": 1,
                                                        "async_": 0}, desc=_matrix(12, 20))
    assert [s.tokens for s in steps if isinstance(s, Gemm)] == [4, 4, 1]


@pytest.mark.parametrize("rows,dst,code", [(12, 4090, "NONE"), (12, 4091, "ADDRESS_RANGE"),
                                           (70_000, 0, "ADDRESS_RANGE"), (0xFFFF_FFFF, 0, "ADDRESS_RANGE")],
                         ids=["last_row_fits", "one_row_beyond", "rows_past_the_span_stride", "rows_max"])
def test_matrix_sequencer_wgemm_output_range(rows, dst, code):
    # the output range ends at dst + (tokens - 1) * stride + rows: exactly at L2's end fits, past it fails; rows
    # beyond L2 fail it whatever the saturated stride of the span's product
    fields = {"dst": dst, "src": 0, "desc": 0, "tokens": 2, "accm": 0, "async_": 0}
    if code == "NONE":
        check(MatrixSequencer, TINY, Opcode.WGEMM, fields, desc=_matrix(rows, 20))
    else:
        word, _ = _insn(TINY, Opcode.WGEMM, **fields)
        assert run(MatrixSequencer(TINY), word, desc=_matrix(rows, 20)) == ([], code)


def test_matrix_sequencer_gather():
    check(MatrixSequencer, TINY, Opcode.GATHER, {"dst": 8, "desc": 0, "remap": 0, "async_": 0}, desc=_matrix(10, 24))


def _slot(capacity, heads, head_dim, hw):
    return Descriptor(index=0, kind=DescKind.KV, tensor="kv:0", capacity=capacity, heads=heads, head_dim=head_dim,
                      weight_offset=4096, scale_offset=65536, layout=hw.kv_layout_code)


TINY_ROWS = TINY.replace(kv_v_layout="rows")          # the INT8 cache's V as rows (docs/numerics.md "KV cache")


@pytest.mark.parametrize("hw", [TINY, TINY_FP16, TINY_ROWS], ids=["int8", "fp16", "int8_v_rows"])
def test_attention_sequencer_kvst(hw):
    check(AttentionSequencer, hw, Opcode.KVST, {"k": 0, "v": 16, "slot": 0, "shape_ptr": 0, "async_": 0},
          pos=5, desc=_slot(8, 2, 16, hw))


@pytest.mark.parametrize("hw,pos,capacity,window", [(TINY, 6, 8, 0), (TINY, 1500, 2048, 0), (TINY, 9, 4, 4),
                                                    (TINY, 10, 8, 6), (TINY, 7, 8, 6), (TINY, 2500, 2100, 2000),
                                                    (TINY_FP16, 5, 8, 0), (TINY_FP16, 9, 8, 3),
                                                    (TINY_ROWS, 6, 8, 0), (TINY_ROWS, 1500, 2048, 0),
                                                    (TINY_ROWS, 10, 8, 6), (TINY_ROWS, 2500, 2100, 2000)],
                         ids=["int8", "int8_two_chunks", "int8_window", "int8_wrapped_ring", "int8_wide_ring",
                              "int8_wrapped_chunks", "fp16", "fp16_window", "v_rows", "v_rows_two_chunks",
                              "v_rows_wrapped_ring", "v_rows_wrapped_chunks"])
def test_attention_sequencer_attn(hw, pos, capacity, window):
    steps = check(AttentionSequencer, hw, Opcode.ATTN, {"dst": 64, "q": 0, "slot": 0, "kv_head": 1, "shape_ptr": 0,
                                                        "async_": 0},
                  pos=pos, desc=_slot(capacity, 2, 16, hw), fmap=(2, 16, window))
    assert steps


TINY_V4 = HardwareConfig.preset("tiny_v4")


@pytest.mark.parametrize("heads,pos,capacity,window,vectors", [
    (6, 9, 16, 0, [4, 4, 2, 2]), (3, 5, 8, 0, [3, 3]), (1, 0, 4, 0, [1, 1]), (2, 1500, 2048, 0, [1, 1, 1, 1]),
    (6, 10, 8, 6, [4] * 4 + [2] * 4)],
    ids=["groups_of_4_and_2", "one_group_of_3", "one_head", "scores_beyond_the_scratch", "wrapped_ring"])
def test_attention_sequencer_k_gemvs_once_per_group(heads, pos, capacity, window, vectors):
    """On the GEMV engine of four vectors an INT8 ATTN's K GEMVs take up to four query heads at once (their
    queries quantised into the engine's vectors first), then each head's softmax and V GEMVs follow alone; where
    four rows of scores do not fit the scratch (4 x 1,504 > 4,096 elements on tiny), one head at a time."""
    hw = TINY_V4.replace(kv_v_layout="planes")
    steps = check(AttentionSequencer, hw, Opcode.ATTN, {"dst": 64, "q": 0, "slot": 0, "kv_head": 1, "shape_ptr": 0,
                                                        "async_": 0},
                  pos=pos, desc=_slot(capacity, 2, 16, hw), fmap=(heads, 16, window))
    k = [s for s in steps if isinstance(s, Engine) and not s.sparse]
    assert [s.vectors for s in k] == vectors
    assert [s.accm for s in k] == [False, True] * (len(vectors) // 2)


@pytest.mark.parametrize("heads,pos,capacity,window,k_vectors,v_vectors", [
    (6, 9, 16, 0, [4, 4, 2, 2], [4, 2]), (3, 5, 8, 0, [3, 3], [3]), (1, 0, 4, 0, [1, 1], [1]),
    (2, 1500, 2048, 0, [1, 1, 1, 1], [1, 1, 1, 1]), (6, 10, 8, 6, [4] * 4 + [2] * 4, [4, 4, 2, 2])],
    ids=["groups_of_4_and_2", "one_group_of_3", "one_head", "scores_beyond_the_scratch", "wrapped_ring"])
def test_attention_sequencer_v_rows_once_per_group(heads, pos, capacity, window, k_vectors, v_vectors):
    """V rows on the GEMV engine of four vectors: a group's query heads share its K GEMVs and, per chunk of
    positions, one GEMV of INT8 weights over the V rows (each head's weights in its own vector; accm after the
    group's first chunk), the plan of `sim.plan` step for step (`check`)."""
    hw = TINY_V4.replace(kv_v_layout="rows")
    steps = check(AttentionSequencer, hw, Opcode.ATTN, {"dst": 64, "q": 0, "slot": 0, "kv_head": 1,
                                                        "shape_ptr": 0, "async_": 0},
                  pos=pos, desc=_slot(capacity, 2, 16, hw), fmap=(heads, 16, window))
    k = [s for s in steps if isinstance(s, Engine) and not s.int8]
    v = [s for s in steps if isinstance(s, Engine) and s.int8]
    assert [s.vectors for s in k] == k_vectors and not any(s.sparse for s in steps if isinstance(s, Engine))
    assert [s.vectors for s in v] == v_vectors
    assert [s.rows for s in v] == [16] * len(v_vectors)


@pytest.mark.parametrize("busy", [1, 2, 17])
def test_attention_sequencer_attn_waits_for_an_async_wgemv(busy):
    """ATTN's GEMVs use the engine: with an async WGEMV still running when ATTN starts (`busy` cycles), it waits
    for the engine, then runs its plan (the program's ATTN after a LAuReL WGEMV)."""
    check(AttentionSequencer, TINY, Opcode.ATTN, {"dst": 64, "q": 0, "slot": 0, "kv_head": 1, "shape_ptr": 0,
                                                  "async_": 0},
          pos=0, desc=_slot(3, 2, 16, TINY), fmap=(2, 16, 3), engine_busy=busy, max_cycles=20_000)


@pytest.mark.parametrize("seq_cls,op,fields,state,code", [
    (VectorSequencer, Opcode.VEC, {"func": VecFunc.ADD, "dst": 0, "a": 0, "b": 0, "s": 0, "async_": 0}, {"vl": 0},
     "BAD_LENGTH"),
    (VectorSequencer, Opcode.VEC, {"func": VecFunc.RMSNORM, "dst": 0, "a": 0, "b": 0, "s": 0, "async_": 0},
     {"vl": 40, "hd": 16}, "BAD_LENGTH"),
    (VectorSequencer, Opcode.DMA, {"dir": DmaDir.DDR_TO_L2, "region": DdrRegion.LOGITS, "l2": 0, "offset": 0,
                                   "async_": 0}, {"vl": 4}, "BAD_FUNCTION"),
    (MatrixSequencer, Opcode.WGEMV, {"dst": 0, "src": 0, "desc": 0, "accm": 0, "findemax": 0, "sparse": 1,
                                     "reuse": 0, "mask": 0, "async_": 0}, {"desc": _matrix(24, 40)}, "BAD_DESCRIPTOR"),
    (MatrixSequencer, Opcode.WGEMV, {"dst": 0, "src": 0, "desc": 0, "accm": 0, "findemax": 0, "sparse": 0,
                                     "reuse": 1, "mask": 0, "async_": 0}, {"desc": _matrix(24, 40), "act_n": 8},
     "BAD_LENGTH"),
    (MatrixSequencer, Opcode.WGEMV, {"dst": 0, "src": 0, "desc": 0, "accm": 0, "findemax": 0, "sparse": 0,
                                     "reuse": 0, "mask": 1, "async_": 0}, {"desc": _matrix(24, 40)},
     "BAD_FUNCTION"),
    (AttentionSequencer, Opcode.ATTN, {"dst": 64, "q": 0, "slot": 0, "kv_head": 0, "shape_ptr": 0, "async_": 0},
     {"pos": 3, "desc": _slot(8, 2, 16, TINY), "fmap": (2, 32, 0)}, "BAD_LENGTH"),
    (AttentionSequencer, Opcode.ATTN, {"dst": 64, "q": 0, "slot": 0, "kv_head": 0, "shape_ptr": 0, "async_": 0},
     {"pos": 9, "desc": _slot(8, 2, 16, TINY), "fmap": (2, 16, 0)}, "ADDRESS_RANGE"),
], ids=["vl0", "rmsnorm_segments", "dma_region", "sparse_layout", "reuse_cols", "mask_without_reuse",
        "attn_head_dim", "attn_beyond_ring"])
def test_sequencers_end_bad_instructions_with_the_isa_error(seq_cls, op, fields, state, code):
    word, _ = _insn(TINY, op, **fields)
    steps, got = run(seq_cls(TINY), word, **state)
    assert (got, steps) == (code, [])


def test_a_different_plan_fails_the_monitor_comparison():
    """The full-chip monitor's comparison (`tb.npu.monitor.compare`) catches a step out of order or missing."""
    from tb.npu.monitor import compare
    word, insn = _insn(TINY, Opcode.VEC, func=VecFunc.ROPE, dst=64, a=0, b=32, s=0, async_=0)
    steps, _ = run(VectorSequencer(TINY), word, vl=32, hd=16)
    want = plan(insn, State(vl=32, hd=16), TINY)
    assert compare([steps], [], [(0, insn, want)]) == []
    swapped = want[:4] + [want[5], want[4]] + want[6:]
    assert compare([steps], [], [(0, insn, swapped)])
    assert compare([steps], [], [(0, insn, want[:-1])])
    assert compare([steps, []], [], [(0, insn, want)])


def _base(region):
    """The bench's DDR base of `region` (`run`)."""
    return 0x1000_0000 * (region.value + 1)


KV260 = HardwareConfig.preset("kv260")
KV260_ROWS = KV260.replace(kv_v_layout="rows")


@pytest.mark.parametrize("hw,pos,capacity,head_dim,window", [
    (TINY, 5, 8, 16, 0), (TINY, 1500, 2048, 16, 0), (KV260, 700, 1024, 256, 0), (KV260, 20000, 32768, 256, 0),
    (TINY, 10, 8, 16, 6), (TINY, 2500, 2100, 16, 2000), (KV260, 1000, 515, 256, 512),
    (TINY_ROWS, 5, 8, 16, 0), (TINY_ROWS, 1500, 2048, 16, 0), (KV260_ROWS, 700, 1024, 256, 0),
    (KV260_ROWS, 20000, 32768, 256, 0), (TINY_ROWS, 10, 8, 16, 6), (TINY_ROWS, 2500, 2100, 16, 2000),
    (KV260_ROWS, 1000, 515, 256, 512)],
    ids=["tiny", "tiny_two_chunks", "kv260", "kv260_two_chunks", "tiny_wrapped_ring", "tiny_wrapped_chunks",
         "kv260_wrapped_ring", "rows_tiny", "rows_tiny_two_chunks", "rows_kv260", "rows_kv260_two_chunks",
         "rows_tiny_wrapped_ring", "rows_tiny_wrapped_chunks", "rows_kv260_wrapped_ring"])
def test_int8_kvst_and_attn_address_the_slot_as_its_layout(hw, pos, capacity, head_dim, window):
    """Every DDR address KVST and ATTN name on the INT8 cache is where `sim.numerics.KvInt8Layout` (the ISS's
    and the packer's layout) puts that plane row, scale row or V column: per head the K planes' rows and their
    scale rows and the V planes' columns at the ring slot, its V scale; ATTN's K GEMVs (lo, then hi), the V row
    scales, and per chunk of positions its V GEMVs (lo, then hi) with the V planes' scale table, each from the
    first slot of its piece of the ring (a ring wider than the window wraps: `sim.plan.attn_pieces`). V rows
    (``kv_v_layout`` "rows"): KVST scatters V a byte into each row from the slot's byte in row 0, the rows a
    capacity apart; ATTN's one V GEMV per chunk and group starts at the chunk's first slot in row 0, its rows a
    capacity apart, with the table's lo half (scale 1)."""
    heads, kv_head = 2, 1
    desc = _slot(capacity, heads, head_dim, hw)
    rows = hw.kv_v_layout == "rows"
    lay = KvInt8Layout(capacity, heads, head_dim, hw.act_block, hw.kv_v_layout)
    slot, table = _base(DdrRegion.KV) + desc.weight_offset, _base(DdrRegion.WEIGHTS) + desc.scale_offset
    r = pos % capacity
    row, srow = r * head_dim // 2, r * lay.kblocks * 2
    want = []
    for j in range(heads):
        want += [("wr", slot + lay.k_hi(j) + row), ("wr", slot + lay.k_lo(j) + row), ("wr", slot + lay.ks_hi(j) + srow),
                 ("wr", slot + lay.ks_lo(j) + srow)]
        want += ([("wr", slot + lay.v(j) + r, capacity)] if rows else
                 [("wr", slot + lay.v_hi(j) + row), ("wr", slot + lay.v_lo(j) + row)])
        want.append(("wr", slot + lay.vs(j) + 2 * r))
    got = []
    word, _ = _insn(hw, Opcode.KVST, k=0, v=256, slot=0, shape_ptr=0, async_=0)
    assert run(AttentionSequencer(hw), word, pos=pos, desc=desc, ddr=got)[1] == "NONE"
    assert got == want

    q_heads, n = 2, min(pos + 1, window or capacity)
    group = attn_k_group(hw, n)        # kv260 at 701 positions: both heads' K GEMVs at once; at 20,001 one each
    assert group == (4 if hw.name == "kv260" and n in (701, 512) else 1)
    pieces = attn_pieces(pos, n, capacity)
    assert len(pieces) == (2 if window else 1)
    # the V chunks' first slots: each piece from its first slot in chunks of gemv_max_cols
    chunks = [first + c0 for first, k in pieces for c0 in range(0, k, hw.gemv_max_cols)]
    want = []
    for h0 in range(0, q_heads, group):
        for first, _ in pieces:
            want += [("gemv", slot + lay.k_lo(kv_head) + first * head_dim // 2,
                      slot + lay.ks_lo(kv_head) + first * lay.kblocks * 2),
                     ("gemv", slot + lay.k_hi(kv_head) + first * head_dim // 2,
                      slot + lay.ks_hi(kv_head) + first * lay.kblocks * 2)]
        for _ in range(min(group, q_heads - h0)):
            want += [("rd", slot + lay.vs(kv_head) + 2 * first) for first, _ in pieces]
            for c in [] if rows else chunks:
                want += [("gemv", slot + lay.v_lo(kv_head) + c * head_dim // 2, table + 2 * head_dim),
                         ("gemv", slot + lay.v_hi(kv_head) + c * head_dim // 2, table)]
        if rows:
            want += [("gemv", slot + lay.v(kv_head) + c, table + 2 * head_dim, capacity) for c in chunks]
    got = []
    word, _ = _insn(hw, Opcode.ATTN, dst=64, q=0, slot=0, kv_head=kv_head, shape_ptr=0, async_=0)
    assert run(AttentionSequencer(hw), word, pos=pos, desc=desc, fmap=(q_heads, head_dim, window), ddr=got)[1] == "NONE"
    assert got == want
ODD = TINY.replace(name="odd", systolic_rows=1, l2_banks=1, act_block=32, gemv_max_cols=512)


@pytest.mark.parametrize("hw", [KV260, ODD], ids=lambda h: h.name)
def test_sequencers_on_other_configurations(hw):
    """The kv260 preset (E4B-sized heads of 256, 4 query heads, a 512-position ring) and a configuration at the
    edges (one-row systolic array, one L2 bank, blocks of 32)."""
    hd = min(256, hw.kv_max_head_dim)
    check(VectorSequencer, hw, Opcode.VEC, {"func": VecFunc.RMSNORM, "dst": 64, "a": 0, "b": 32, "s": 1, "async_": 0},
          vl=2 * hd, hd=hd)
    check(AttentionSequencer, hw, Opcode.ATTN, {"dst": 64, "q": 0, "slot": 0, "kv_head": 1, "shape_ptr": 0,
                                                "async_": 0}, pos=700, desc=_slot(1024, 2, hd, hw), fmap=(4, hd, 0))
    check(AttentionSequencer, hw, Opcode.KVST, {"k": 0, "v": 256, "slot": 0, "shape_ptr": 0, "async_": 0}, pos=5,
          desc=_slot(512, 2, hd, hw))
    steps = check(MatrixSequencer, hw, Opcode.WGEMM, {"dst": 2000, "src": 0, "desc": 0, "tokens": 7, "accm": 0,
                                                      "async_": 1}, desc=_matrix(64, 128, group=hw.weight_group))
    tiles = [s for s in steps if isinstance(s, Gemm if hw.gemv_vectors == 1 else Engine)]
    assert len(tiles) == -(-7 // hw.gemm_tile)
    if hw.gemv_vectors > 1:            # kv260: tiles of its four vectors on the GEMV engine
        assert [s.vectors for s in tiles] == [4, 3]


@pytest.mark.parametrize("tokens", [8, 9, 33, 255])
def test_wgemm_on_the_multi_vector_engine_for_any_token_count(tokens):
    """kv260 (the GEMV engine of four vectors, with the row mask): the WGEMM's tiles are plain GEMV jobs whatever
    its `tokens` field holds (its bits lie where a WGEMV has `mask` and `sparse`), tiles of 4 and the rest."""
    steps = check(MatrixSequencer, KV260, Opcode.WGEMM, {"dst": 2000, "src": 0, "desc": 0, "tokens": tokens,
                                                         "accm": 0, "async_": 1},
                  desc=_matrix(8, 128, group=KV260.weight_group))
    jobs = [s for s in steps if isinstance(s, Engine)]
    assert [s.vectors for s in jobs] == [4] * (tokens // 4) + ([tokens % 4] if tokens % 4 else [])
    assert not any(s.sparse for s in jobs)


def test_matrix_sequencer_masked_wgemv_sends_its_mask_first():
    """WGEMV `mask` on a controller whose engine has the row mask: the MASK pass of d.rows elements from src,
    then the engine's command (the plan of the ISS); without reuse, or on an NPU without the mask, it stops
    with BAD_FUNCTION."""
    import dataclasses
    masked = dataclasses.replace(TINY, gemv_row_mask=True)
    plain = dataclasses.replace(TINY, gemv_row_mask=False)
    fields = {"dst": 64, "src": 8, "desc": 0, "accm": 0, "findemax": 0, "sparse": 0, "reuse": 1, "mask": 1,
              "async_": 0}
    steps = check(MatrixSequencer, masked, Opcode.WGEMV, fields, desc=_matrix(24, 40), act_n=40)
    assert [s.sink for s in steps if isinstance(s, Pass)] == ["MASK"]
    word, _ = _insn(masked, Opcode.WGEMV, **{**fields, "reuse": 0})
    assert run(MatrixSequencer(masked), word, desc=_matrix(24, 40))[1] == "BAD_FUNCTION"
    word, _ = _insn(plain, Opcode.WGEMV, **fields)
    assert run(MatrixSequencer(plain), word, desc=_matrix(24, 40), act_n=40) == ([], "BAD_FUNCTION")
