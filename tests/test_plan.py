"""The controller's plan of each instruction (sim.plan): directed instructions against step lists read off the
sequencers (`hdl.controller`: every ``launch(...)`` is a `Pass`, every GEMV job an `Engine`, every
GEMM command a `Gemm`, every ``alu(...)`` an `Alu`), and the ISS's counters as the sum of the plans it ran."""

import random
from collections import Counter

import pytest

from firmware.compiler import compile_token
from firmware.pack import Descriptor, pack
from hdl.config import PRESETS as HW
from hdl.config import V_PLANE_LOG2_GROUP
from hdl.isa import CtrlFunc, CvoFunc, DdrRegion, DmaDir, Opcode, ScalarFunc, ShapeCache, VecFunc, decode, encode
from sim.config import PRESETS
from sim.iss import COUNT, Machine
from sim.plan import ATTN_RECIP, PASS_KINDS, Alu, Engine, Gemm, Pass, State, plan

TINY, TINY16 = HW["tiny"], HW["tiny_fp16"]

# a descriptor load: DDR -> the descriptor register, bypassing the SFU, DESCRIPTOR's 256 bits = 8 words
DESC = Pass(None, "DDR", "NONE", "DESC", 8, "F32")
MATRIX = Descriptor(0, 0, "w", rows=48, cols=80, layout=0, group=32)
COLUMNS = Descriptor(1, 0, "w", rows=48, cols=80, layout=1, group=32)
KV16 = Descriptor(2, 2, "kv:0", capacity=16, heads=2, head_dim=16, layout=0)
KV8 = Descriptor(3, 2, "kv:0", capacity=2048, heads=2, head_dim=32, layout=1)


def insn(op, **fields):
    return decode(encode(op, **fields))


def steps(i, hw=TINY, **state):
    return plan(i, State(**state), hw)


def scalar(func):
    return insn(Opcode.SCALAR, func=func, d=1, a=2, b=3, imm=5)


def vec(func):
    return insn(Opcode.VEC, func=func, dst=64, a=0, b=32, s=1, async_=0)


def cvo(func, accm=0, recip_scale=0):
    return insn(Opcode.CVO, func=func, src=0, dst=64, length=24, sub_emax=0, recip_scale=recip_scale, accm=accm,
                async_=0)


def wgemv(desc, accm=0, findemax=0, sparse=0, reuse=0, async_=0):
    return insn(Opcode.WGEMV, dst=64, src=0, desc=desc.index, accm=accm, findemax=findemax, sparse=sparse,
                reuse=reuse, mask=0, async_=async_)


def test_step_vocabulary_is_the_controllers():
    """Sources, b operands and sinks are the names of the controller's enums; the pass kinds the perf model's."""
    from firmware.perf import PASS_KINDS as PERF_KINDS
    from hdl.controller import BSrc, Sink, Src
    from sim.plan import B_SOURCES, SINKS, SOURCES
    assert SOURCES == tuple(Src.__members__) and B_SOURCES == tuple(BSrc.__members__)
    assert SINKS == tuple(Sink.__members__)
    assert PERF_KINDS == PASS_KINDS == ("sfu", "vec", "reduce", "copy", "quant", "ddr_read", "ddr_copy", "ddr_write",
                                        "ddr_scatter")


def test_pass_kinds():
    # a DDR sink first, then a DDR source, the quantiser, bypass, reductions, the short path from L2, the rest
    table = [(Pass(None, "PACK", "NONE", "DDR", 4), "ddr_write"),
             (Pass(None, "REG", "NONE", "DDR", 1), "ddr_write"),
             (Pass("MUL", "DDR", "L2", "L2", 9, "F16"), "ddr_read"),
             (Pass(None, "DDR", "NONE", "DESC", 8, "F32"), "ddr_read"),
             (Pass(None, "DDR", "NONE", "L2", 8, "F32"), "ddr_copy"),
             (Pass(None, "DDR", "NONE", "L2", 8, "F16"), "ddr_read"),
             (Pass(None, "DDR", "NONE", "L2", 8, "INT4"), "ddr_read"),
             (Pass("MUL", "DDR", "L2", "L2", 9, "F32"), "ddr_read"),
             (Pass(None, "L2", "NONE", "QUANT", 80), "quant"),
             (Pass(None, "L2", "NONE", "REG", 1), "copy"),
             (Pass(None, "REG", "NONE", "L2", 1), "copy"),
             (Pass("DOT", "L2", "L2", "L2", 16), "reduce"),
             (Pass("REDUCE_SUM", "L2", "NONE", "L2", 24), "reduce"),
             (Pass("MULS_MUL", "L2", "L2", "L2", 32), "vec"),
             (Pass("COPY", "L2", "NONE", "L2", 40), "vec"),
             (Pass("GELU_MUL", "L2", "L2", "L2", 40), "sfu"),
             (Pass("ROPE_COS", "PAIRS", "NONE", "L2", 24), "sfu"),
             (Pass("RECIP", "REG", "NONE", "REG", 1), "sfu")]
    for p, kind in table:
        assert p.kind == kind, p


def test_steps_check_their_fields():
    with pytest.raises(ValueError, match=r"Pass.op must be None or the name of an hdl.sfu.SfuOp member, not 'FOO'"):
        Pass("FOO", "L2", "NONE", "L2", 1)
    with pytest.raises(ValueError, match=r"Pass.src must be one of L2, PAIRS, DDR, REG, PACK, not 'SRAM'"):
        Pass(None, "SRAM", "NONE", "L2", 1)
    with pytest.raises(ValueError, match=r"Pass.b must be one of NONE, L2, not 'DDR'"):
        Pass("ADD", "L2", "DDR", "L2", 1)
    with pytest.raises(ValueError, match=r"Pass.sink must be one of L2, REG, DDR, DESC, QUANT, MASK, not 'PACK'"):
        Pass(None, "L2", "NONE", "PACK", 1)
    with pytest.raises(ValueError, match=r"Pass.n must be a positive integer, not 0"):
        Pass(None, "L2", "NONE", "L2", 0)
    with pytest.raises(ValueError, match=r"Pass.fmt must be one of F32, F16, INT4 for a DDR source and None for any "
                                         r"other, not None with src 'DDR'"):
        Pass(None, "DDR", "NONE", "L2", 4)
    with pytest.raises(ValueError, match=r"Pass.fmt must be .* not 'F32' with src 'L2'"):
        Pass(None, "L2", "NONE", "L2", 4, "F32")
    with pytest.raises(ValueError, match=r"Engine.cols must be a positive integer, not 0"):
        Engine(4, 0, False, False)
    with pytest.raises(ValueError, match=r"Gemm.tokens must be a positive integer, not True"):
        Gemm(4, 4, True, False)


def test_ctrl_and_memset_start_nothing():
    for func in CtrlFunc:
        assert steps(insn(Opcode.CTRL, func=func, imm=7)) == []
    assert steps(insn(Opcode.MEMSET, cache=ShapeCache.FMAP, slot=3, a=2, b=16, c=0)) == []


def test_scalar():
    # LI, MAX and MAXI write the register file at once; the arithmetic goes through the ALU (LDPOS: int -> float);
    # the functions are one element through the SFU; LD and ST one element around it
    for f in (ScalarFunc.LI, ScalarFunc.MAX, ScalarFunc.MAXI):
        assert steps(scalar(f)) == [], f
    for f in (ScalarFunc.ADD, ScalarFunc.SUB, ScalarFunc.MUL, ScalarFunc.MULI, ScalarFunc.ADDI, ScalarFunc.LDPOS):
        assert steps(scalar(f)) == [Alu()], f
    for f in (ScalarFunc.RSQRT, ScalarFunc.SQRT, ScalarFunc.RECIP, ScalarFunc.TANH):
        assert steps(scalar(f)) == [Pass(f.name, "REG", "NONE", "REG", 1)], f
    assert steps(scalar(ScalarFunc.LD)) == [Pass(None, "L2", "NONE", "REG", 1)]
    assert steps(scalar(ScalarFunc.ST)) == [Pass(None, "REG", "NONE", "L2", 1)]
    assert set(ScalarFunc) == {ScalarFunc.LI, ScalarFunc.MAX, ScalarFunc.MAXI, ScalarFunc.ADD, ScalarFunc.SUB,
                               ScalarFunc.MUL, ScalarFunc.MULI, ScalarFunc.ADDI, ScalarFunc.LDPOS, ScalarFunc.RSQRT,
                               ScalarFunc.SQRT, ScalarFunc.RECIP, ScalarFunc.TANH, ScalarFunc.LD, ScalarFunc.ST}


def test_dma():
    rd = insn(Opcode.DMA, dir=DmaDir.DDR_TO_L2, region=DdrRegion.CONST, l2=4, offset=0, async_=0)
    wr = insn(Opcode.DMA, dir=DmaDir.L2_TO_DDR, region=DdrRegion.LOGITS, l2=4, offset=0, async_=0)
    assert steps(rd, vl=40) == [Pass(None, "DDR", "NONE", "L2", 40, "F32")]
    assert steps(wr, vl=40) == [Pass(None, "L2", "NONE", "DDR", 40)]


def test_vec_one_pass():
    # two-operand functions read b from L2; the reductions end in a register
    assert steps(vec(VecFunc.ADD), vl=40) == [Pass("ADD", "L2", "L2", "L2", 40)]
    assert steps(vec(VecFunc.FMAS), vl=40) == [Pass("FMAS", "L2", "L2", "L2", 40)]
    assert steps(vec(VecFunc.MULS), vl=40) == [Pass("MULS", "L2", "NONE", "L2", 40)]
    assert steps(vec(VecFunc.RELU_SUBS), vl=40) == [Pass("RELU_SUBS", "L2", "NONE", "L2", 40)]
    assert steps(vec(VecFunc.COPY), vl=40) == [Pass("COPY", "L2", "NONE", "L2", 40)]
    assert steps(vec(VecFunc.GELU_MUL), vl=40) == [Pass("GELU_MUL", "L2", "L2", "L2", 40)]
    assert steps(vec(VecFunc.SUMSQ), vl=40) == [Pass("SUMSQ", "L2", "NONE", "REG", 40)]
    assert steps(vec(VecFunc.MAX), vl=40) == [Pass("MAX", "L2", "NONE", "REG", 40)]
    assert steps(vec(VecFunc.DOT), vl=40) == [Pass("DOT", "L2", "L2", "REG", 40)]


def test_vec_rmsnorm_per_segment():
    # RMS_1 SUMSQ -> p_result; RMS_2, RMS_3 the ALU (x 1/HD, + S[s]); RMS_4 RSQRT; RMS_5 x * r (* g)
    segment = [Pass("SUMSQ", "L2", "NONE", "REG", 32), Alu(), Alu(), Pass("RSQRT", "REG", "NONE", "REG", 1)]
    assert steps(vec(VecFunc.RMSNORM), vl=64, hd=32) == 2 * (segment + [Pass("MULS_MUL", "L2", "L2", "L2", 32)])
    assert steps(vec(VecFunc.RMSNORM_NG), vl=96, hd=32) == 3 * (segment + [Pass("MULS", "L2", "NONE", "L2", 32)])


def test_vec_rope_six_passes_per_head():
    # ROPE_1..ROPE_6: x1 cos, x2 sin, x2 cos, x1 sin into the scratch; t0 - t1, t2 + t3 into dst; HD/2 each
    head = [Pass("MUL", "L2", "L2", "L2", 16), Pass("MUL", "L2", "L2", "L2", 16), Pass("MUL", "L2", "L2", "L2", 16),
            Pass("MUL", "L2", "L2", "L2", 16), Pass("SUB", "L2", "L2", "L2", 16), Pass("ADD", "L2", "L2", "L2", 16)]
    assert steps(vec(VecFunc.ROPE), vl=64, hd=32) == 2 * head


def test_cvo():
    recip = Pass("RECIP", "REG", "NONE", "REG", 1)                  # CVO_R: 1 / S[0]
    assert steps(cvo(CvoFunc.EXP)) == [Pass("EXP", "L2", "NONE", "L2", 24)]
    assert steps(cvo(CvoFunc.SCALE)) == [Pass("SCALE", "L2", "NONE", "L2", 24)]
    assert steps(cvo(CvoFunc.SCALE, recip_scale=1)) == [recip, Pass("SCALE", "L2", "NONE", "L2", 24)]
    assert steps(cvo(CvoFunc.SOFTCAP)) == [recip, Pass("SOFTCAP", "L2", "NONE", "L2", 24)]
    # element-wise accm: the SFU adds the old dst (b from L2)
    assert steps(cvo(CvoFunc.GELU, accm=1)) == [Pass("GELU", "L2", "L2", "L2", 24)]
    # REDUCE and ROPE with accm: the result staged in the scratch, then ADDed to dst (one element for REDUCE)
    assert steps(cvo(CvoFunc.REDUCE_MAX)) == [Pass("REDUCE_MAX", "L2", "NONE", "L2", 24)]
    assert steps(cvo(CvoFunc.REDUCE_SUM, accm=1)) == [Pass("REDUCE_SUM", "L2", "NONE", "L2", 24),
                                                      Pass("ADD", "L2", "L2", "L2", 1)]
    assert steps(cvo(CvoFunc.ROPE_COS)) == [Pass("ROPE_COS", "PAIRS", "NONE", "L2", 24)]
    assert steps(cvo(CvoFunc.ROPE_SIN, accm=1)) == [Pass("ROPE_SIN", "PAIRS", "NONE", "L2", 24),
                                                    Pass("ADD", "L2", "L2", "L2", 24)]
    assert [s.kind for s in steps(cvo(CvoFunc.REDUCE_SUM, accm=1))] == ["reduce", "vec"]
    assert [s.kind for s in steps(cvo(CvoFunc.ROPE_SIN, accm=1))] == ["sfu", "vec"]


def test_wgemv():
    q = Pass(None, "L2", "NONE", "QUANT", 80)                       # WG_Q: src into the quantiser
    assert steps(wgemv(MATRIX), desc=MATRIX) == [DESC, q, Engine(48, 80, False, False)]
    assert steps(wgemv(MATRIX, async_=1), desc=MATRIX) == [DESC, q, Engine(48, 80, False, False)]
    assert steps(wgemv(MATRIX, reuse=1, accm=1), desc=MATRIX) == [DESC, Engine(48, 80, True, False)]
    assert steps(wgemv(MATRIX, findemax=1, async_=1), desc=MATRIX) == [
        DESC, q, Engine(48, 80, False, False), Pass("REDUCE_MAX", "L2", "NONE", "REG", 48)]
    assert steps(wgemv(COLUMNS, sparse=1, accm=1), desc=COLUMNS) == [DESC, q, Engine(48, 80, True, True)]


def test_gather():
    i = insn(Opcode.GATHER, dst=64, desc=0, remap=1, async_=0)
    assert steps(i, desc=MATRIX) == [DESC, Pass(None, "DDR", "NONE", "L2", 80, "INT4")]


def test_kvst_fp16():
    # K, then V, heads x head_dim binary16 elements each (the descriptor's cols of a KV slot)
    i = insn(Opcode.KVST, k=0, v=16, slot=KV16.index, shape_ptr=0, async_=0)
    store = Pass(None, "L2", "NONE", "DDR", 32)
    assert steps(i, TINY16, desc=KV16) == [DESC, store, store]


def test_kvst_int8():
    # per head (KV_K .. KV_V3): K into the quantiser (and the packer); its plane words hi, lo (32 nibbles = 4
    # words) and scale rows hi, lo (32 / act_block 16 = 2); V into the quantiser twice; its plane words; its scale
    i = insn(Opcode.KVST, k=0, v=16, slot=KV8.index, shape_ptr=0, async_=0)
    q = Pass(None, "L2", "NONE", "QUANT", 32)
    words, scales = Pass(None, "PACK", "NONE", "DDR", 4), Pass(None, "PACK", "NONE", "DDR", 2)
    head = [q, words, words, scales, scales, q, q, words, words, Pass(None, "REG", "NONE", "DDR", 1)]
    assert steps(i, TINY, desc=KV8) == [DESC] + head + head


def attn(kv_head=0):
    return insn(Opcode.ATTN, dst=64, q=0, slot=0, kv_head=kv_head, shape_ptr=5, async_=0)


def test_attn_fp16():
    # 2 query heads of 16 at position 2: 3 positions. Per position the K row and a DOT per head (AT_K, AT_DOT);
    # per head MAX, EXP(s - max), SUM, RECIP, MULS (AT_SM1..5); per position the V row, then per head p into a
    # register and p * V into dst (MULS at the first position, FMAS after)
    row = Pass(None, "DDR", "NONE", "L2", 16, "F16")
    dot = Pass("DOT", "L2", "L2", "L2", 16)
    softmax = [Pass("MAX", "L2", "NONE", "REG", 3), Pass("EXP", "L2", "NONE", "L2", 3),
               Pass("SUM", "L2", "NONE", "REG", 3), Pass("RECIP", "REG", "NONE", "REG", 1),
               Pass("MULS", "L2", "NONE", "L2", 3)]
    p = Pass(None, "L2", "NONE", "REG", 1)
    first = [row, p, Pass("MULS", "L2", "NONE", "L2", 16), p, Pass("MULS", "L2", "NONE", "L2", 16)]
    later = [row, p, Pass("FMAS", "L2", "L2", "L2", 16), p, Pass("FMAS", "L2", "L2", "L2", 16)]
    want = [DESC] + 3 * [row, dot, dot] + 2 * softmax + first + 2 * later
    assert steps(attn(), TINY16, pos=2, fmap=(2, 16, 0)) == want
    # a sliding window of 4 at position 9: the last 4 positions
    got = steps(attn(), TINY16, pos=9, fmap=(2, 16, 4))
    assert Counter(got)[row] == 8 and Pass("MAX", "L2", "NONE", "REG", 4) in got


def test_attn_int8_chunks():
    # 2 query heads of 32 at position 1029: 1030 positions, V chunks of gemv_max_cols = 1024 and 6. Per head
    # (AT_H .. AT_O): q into the quantiser; K GEMVs lo, hi (1030 rows of 32, accm on hi); MAX, EXP, SUM; the V row
    # scales (DDR) times the weights; per chunk the weights into the quantiser and V GEMVs lo, hi (32 rows, sparse,
    # accm but for the first chunk's lo), RECIP(sum) started beside the first chunk's lo; the output x recip(sum)
    assert TINY.gemv_max_cols == 1024
    head = [Pass(None, "L2", "NONE", "QUANT", 32), Engine(1030, 32, False, False), Engine(1030, 32, True, False),
            Pass("MAX", "L2", "NONE", "REG", 1030), Pass("EXP", "L2", "NONE", "L2", 1030),
            Pass("SUM", "L2", "NONE", "REG", 1030), Pass("MUL", "DDR", "L2", "L2", 1030, "F16"),
            Pass(None, "L2", "NONE", "QUANT", 1024), Engine(32, 1024, False, True),
            Pass("RECIP", "REG", "NONE", "REG", 1, beside=True), Engine(32, 1024, True, True),
            Pass(None, "L2", "NONE", "QUANT", 6), Engine(32, 6, True, True), Engine(32, 6, True, True),
            Pass("MULS", "L2", "NONE", "L2", 32)]
    assert steps(attn(1), TINY, pos=1029, fmap=(2, 32, 0)) == [DESC] + head + head
    assert ATTN_RECIP == Pass("RECIP", "REG", "NONE", "REG", 1, beside=True) != Pass("RECIP", "REG", "NONE", "REG", 1)
    # one chunk: RECIP beside the lo GEMV, both V GEMVs of 32 rows x 3 positions
    one = steps(attn(), TINY, pos=2, fmap=(1, 32, 0))
    assert one[-5:] == [Pass(None, "L2", "NONE", "QUANT", 3), Engine(32, 3, False, True), ATTN_RECIP,
                        Engine(32, 3, True, True), Pass("MULS", "L2", "NONE", "L2", 32)]


def test_wgemm_token_tiles():
    # 9 tokens on the tiny array's 4 token rows: tiles of 4, 4, 1, each a quantiser pass per token then the tile
    assert TINY.systolic_rows == 4
    i = insn(Opcode.WGEMM, dst=64, src=0, desc=0, tokens=9, accm=1, async_=1)
    q = Pass(None, "L2", "NONE", "QUANT", 80)
    assert steps(i, desc=MATRIX) == [DESC, q, q, q, q, Gemm(48, 80, 4, True), q, q, q, q, Gemm(48, 80, 4, True),
                                     q, Gemm(48, 80, 1, True)]


def test_pccx_formats_start_nothing():
    for op in (Opcode.GEMV, Opcode.GEMM):
        i = insn(op, dest=0, src=0, findemax=0, accm=0, w_scale=0, size_ptr=0, shape_ptr=0, lanes=0)
        assert steps(i) == []


def _summed(plans):
    """The counters a list of (opcode name, steps) adds up to: passes and elements by (opcode, kind), ALU
    operations, and (COUNT arithmetic: every V column fetched) RECIP passes by the V GEMV they run beside."""
    passes, elements, recips, alu = Counter(), Counter(), Counter(), 0
    for name, ss in plans:
        if name == "WGEMM":
            continue
        for k, s in enumerate(ss):
            if isinstance(s, Alu):
                alu += 1
            elif isinstance(s, Pass) and s.beside:
                e = ss[k - 1]
                recips[(e.rows, e.cols, 1 << V_PLANE_LOG2_GROUP, e.cols)] += 1
            elif isinstance(s, Pass):
                passes[(name, s.kind)] += 1
                elements[(name, s.kind)] += s.n
    return passes, elements, recips, alu


@pytest.mark.parametrize("hw", [TINY, TINY16], ids=lambda hw: hw.name)
def test_iss_counts_the_steps_of_its_plans(hw):
    """A whole compiled token: the ISS's pass counters are the sums over the plans it hands out (``steps`` in
    its trace, the same as `Machine.plan_of` at that point)."""
    cfg = PRESETS["tiny"]
    image = pack(cfg, None, hw, max_positions=8, fill=False)
    words = compile_token(cfg, image, hw).words
    m = Machine(image, hw, COUNT)
    plans = []

    def trace(pc, i, machine):
        assert machine.steps == machine.plan_of(i)
        plans.append((i.op.name, machine.steps))

    m.run(words, token=2, pos=5, trace=trace)
    c = m.counters
    passes, elements, recips, alu = _summed(plans)
    assert c.passes == passes and c.pass_elements == elements and c.alu_ops == alu and c.attn_recips == recips
    assert bool(recips) == (hw.kv_format == "int8") and alu > 0
    assert {name for name, _ in passes} >= {"ATTN", "KVST", "VEC", "CVO", "WGEMV", "DMA", "GATHER", "SCALAR"}


def test_iss_counts_no_passes_for_wgemm():
    """A WGEMM's plan is handed out, but its passes are priced from its shape (firmware.perf.wgemm_cost)."""
    cfg = PRESETS["tiny"]
    image = pack(cfg, None, TINY, max_positions=2, fill=False)
    d = next(d for d in image.descriptors if d.kind == 0 and d.layout == 0 and d.group == TINY.weight_group
             and d.cols <= 256 and d.rows <= 256)
    seen = []
    words = [encode(Opcode.WGEMM, dst=1024, src=0, desc=d.index, tokens=5, accm=0, async_=0),
             encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)]
    m = Machine(image, TINY, COUNT)
    m.run(words, token=0, pos=0, trace=lambda pc, i, machine: seen.append(machine.steps))
    q = Pass(None, "L2", "NONE", "QUANT", d.cols)
    assert seen[0] == [DESC, q, q, q, q, Gemm(d.rows, d.cols, 4, False), q, Gemm(d.rows, d.cols, 1, False)]
    assert not m.counters.passes and not m.counters.pass_elements


def test_plan_of_names_a_missing_descriptor():
    cfg = PRESETS["tiny"]
    image = pack(cfg, None, TINY, max_positions=2, fill=False)
    n = len(image.descriptors)
    with pytest.raises(ValueError, match=rf"GATHER names descriptor {n}; the table has {n}"):
        Machine(image, TINY, COUNT).plan_of(insn(Opcode.GATHER, dst=0, desc=n, remap=0, async_=0))


def test_attn_pieces_are_the_visible_positions_in_order():
    """`attn_pieces`: a full ring in slot order; otherwise the ring slots of positions pos - n + 1 .. pos, oldest
    first, in at most two runs of consecutive slots (the second from slot 0 where the ring wraps)."""
    from sim.plan import attn_pieces
    rng = random.Random(3)
    cases = [(10, 6, 8), (7, 6, 8), (5, 6, 8), (13, 8, 8), (0, 1, 4), (515, 512, 515), (514, 512, 515)]
    cases += [(p, min(p + 1, w), c) for p, w, c in ((rng.randrange(3000), rng.randint(1, 600), 0) for _ in range(300))
              for c in [w + rng.randint(0, 5)]]
    for pos, n, cap in cases:
        pieces = attn_pieces(pos, n, cap)
        slots = [s for first, k in pieces for s in range(first, first + k)]
        want = list(range(cap)) if n == cap else [p % cap for p in range(pos - n + 1, pos + 1)]
        assert slots == want, (pos, n, cap)
        assert len(pieces) <= 2 and all(k > 0 for _, k in pieces)


def test_attn_int8_over_a_ring_wider_than_its_window():
    # tiny, a ring of 8 for a window of 6 at position 10: positions 5..10 in slots 5, 6, 7, then 0, 1, 2. The K
    # GEMVs (lo, hi) per piece, the V row scales per piece, the V chunks per piece (RECIP beside the first)
    slot = Descriptor(4, 2, "kv:0", capacity=8, heads=2, head_dim=32, layout=1)
    got = steps(attn(), TINY, pos=10, fmap=(1, 32, 6), desc=slot)
    q = Pass(None, "L2", "NONE", "QUANT", 3)
    assert got == [DESC, Pass(None, "L2", "NONE", "QUANT", 32), Engine(3, 32, False, False), Engine(3, 32, True, False),
                   Engine(3, 32, False, False), Engine(3, 32, True, False), Pass("MAX", "L2", "NONE", "REG", 6),
                   Pass("EXP", "L2", "NONE", "L2", 6), Pass("SUM", "L2", "NONE", "REG", 6),
                   Pass("MUL", "DDR", "L2", "L2", 3, "F16"), Pass("MUL", "DDR", "L2", "L2", 3, "F16"),
                   q, Engine(32, 3, False, True), ATTN_RECIP, Engine(32, 3, True, True),
                   q, Engine(32, 3, True, True), Engine(32, 3, True, True), Pass("MULS", "L2", "NONE", "L2", 32)]
