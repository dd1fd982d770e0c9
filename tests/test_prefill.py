"""Prefill programs (`firmware.compiler.compile_tokens`, `Runtime.prefill`) on the instruction-set simulator.

Hardware arithmetic: a prompt run through prefill programs leaves every bit where feeding its ids one by one
through `step` leaves it: the logits after the prompt and at every later step, and every byte of the KV
cache. Reference arithmetic: prefill then `step` reproduces the float64 golden model (and transformers, the
fixtures) within the bounds of tests/test_iss.py. The fixtures cover sliding windows the prompts cross, KV
sharing, sparse layers, and prompts longer than one program.
"""

import numpy as np
import pytest

from firmware.compiler import MAX_TOKENS, compile_token, compile_tokens, gemm_pays
from firmware.generate import generate
from firmware.pack import pack
from firmware.runtime import Runtime
from firmware.sampling import Sampler, SamplingParams
from hdl.config import PRESETS as HW
from hdl.isa import CtrlFunc, Opcode, decode
from sim.config import ModelConfig
from sim.gemma3n import Model
from tests.oracle import FIXTURES, load_case

REFERENCE_TOL = 1e-6


def _runtimes(case, hw="tiny", memory_map="flat", **kw):
    n = len(case.input_ids) + 1
    return [Runtime.from_hf(case.config, case.tensors, arithmetic="hardware", hw=hw, max_positions=n,
                            memory_map=memory_map, **kw) for _ in range(2)]


def _assert_same_state(plain: Runtime, pre: Runtime, what: str):
    assert plain.position == pre.position, what
    for layer, slot in plain.image.kv_slots.items():
        np.testing.assert_array_equal(pre.machine.kv_bytes(slot), plain.machine.kv_bytes(slot),
                                      err_msg=f"{what}: KV cache of layer {layer}")


@pytest.mark.parametrize("name, prompt, tokens, gemm, hw", [
    ("f64_s3_l5", 9, None, True, "tiny"),      # no KV sharing: the whole prompt in programs of 4, window 6 crossed
    ("f64_s1_l15", 11, 3, True, "tiny"),       # 5 KV-shared layers, 5 sparse, window 5: programs below it, then steps
    ("f32_s4_l12", 7, 2, False, "tiny"),       # 6 shared, 4 sparse, WGEMVs per token, a remainder program of 1
    ("f64_s2_l7", 3, None, True, "tiny"),      # a prompt shorter than a tile
    # the GEMV engine runs the WGEMMs, four tokens a weight stream (ACT_N 0 after each: no reuse across them)
    ("f64_s3_l5", 9, None, None, "tiny_v4"),   # programs of 4, 4 and 1
    ("f64_s1_l15", 11, 3, None, "tiny_v4"),    # tiles of 3, KV sharing and sparse layers
])
def test_prefill_leaves_every_bit_where_steps_leave_it(name, prompt, tokens, gemm, hw):
    case = load_case(FIXTURES / f"{name}.npz")
    plain, pre = _runtimes(case, hw=hw)
    pre.prefill_gemm = gemm
    if tokens is not None:
        pre.prefill_tokens = tokens
    ids = [int(t) for t in case.input_ids]
    want = [plain.step(t) for t in ids[:prompt]]
    got = pre.prefill(ids[:prompt])
    np.testing.assert_array_equal(got, want[-1])
    _assert_same_state(plain, pre, f"{name} after the prompt")
    programs = pre.counters.instructions["CTRL.SETPOS"]
    assert programs > 0, "no prefill program ran"
    if gemm is not False and (gemm or gemm_pays(HW[hw], pre.prefill_tokens)):
        assert pre.counters.instructions["WGEMM"] > 0
    for k, t in enumerate(ids[prompt:]):
        np.testing.assert_array_equal(pre.step(t), plain.step(t), err_msg=f"{name} step {prompt + k}")
    _assert_same_state(plain, pre, f"{name} at the end")


def test_prefill_on_the_staged_memory_map():
    # kv260's map stages the PLE table's rows: each prompt token's row in its own slot
    case = load_case(FIXTURES / "f64_s3_l5.npz")
    plain, pre = _runtimes(case, memory_map="kv260")
    assert pre.image.host_tables and pre.image.staging_slots == HW["tiny"].systolic_rows
    ids = [int(t) for t in case.input_ids][:8]
    want = [plain.step(t) for t in ids]
    np.testing.assert_array_equal(pre.prefill(ids), want[-1])
    _assert_same_state(plain, pre, "staged map")


def test_prefill_in_reference_arithmetic_reproduces_the_golden_model():
    case = load_case(FIXTURES / "f64_s1_l15.npz")
    rt = Runtime.from_hf(case.config, case.tensors, arithmetic="reference", hw="tiny")
    rt.prefill_gemm = True
    golden = Model.from_hf(case.config, case.tensors)
    ids = [int(t) for t in case.input_ids]
    prompt = 4
    for t in ids[:prompt]:
        want = golden.step(t)
    got = rt.prefill(ids[:prompt])
    assert rt.counters.instructions["WGEMM"] > 0
    assert np.max(np.abs(got - want)) <= REFERENCE_TOL
    assert np.max(np.abs(got - case.logits[prompt - 1])) <= 1e-9
    for k, t in enumerate(ids[prompt:], prompt):
        got = rt.step(t)
        assert np.max(np.abs(got - golden.step(t))) <= REFERENCE_TOL, f"step {k}"
        assert np.max(np.abs(got - case.logits[k])) <= 1e-9, f"step {k}"


def test_generate_runs_the_prompt_as_prefill():
    case = load_case(FIXTURES / "f64_s3_l5.npz")
    plain, pre = _runtimes(case)
    pre.prefill_gemm = True
    ids = [int(t) for t in case.input_ids][:6]
    greedy = Sampler(SamplingParams(temperature=0.0))
    assert generate(pre, ids, 4, greedy) == generate(plain, ids, 4, greedy)
    assert pre.counters.instructions["WGEMM"] > 0 and plain.counters.instructions["WGEMM"] == 0


def _tight_hw(case, tokens):
    """tiny_v4 with L2 program words between what a `tokens`-token program needs with its prefetch pairs'
    second buffers and what it needs without them (the controller's scratch grown to take the rest)."""
    from firmware.compiler import L2Map, _Emitter, _l2_map
    hw = HW["tiny_v4"]
    cfg = ModelConfig.from_hf(case.config)
    image = pack(cfg, None, hw, max_positions=len(case.input_ids) + 1, fill=False, logit_rows=tokens)
    top = {}
    for tight in (False, True):
        e = _Emitter(cfg, image, hw, tokens, None, None)
        e.head_tokens = True
        _l2_map(e, image, tight)
        top[tight] = e.l2.top
    assert top[True] < top[False]
    return hw.replace(name="tiny_v4_tight", l2_scratch_bytes=hw.l2_bytes - 16 * top[True])


def test_a_tight_l2_shares_the_prefetch_buffers_and_changes_no_bit():
    # four-token programs that fit L2 only with each prefetch pair's two buffers one (a prefetch then waits for
    # the buffer's last reader): the prompt's and a verify pass's bits are those of steps
    case = load_case(FIXTURES / "f64_s1_l15.npz")            # KV sharing, sparse layers
    hw = _tight_hw(case, 4)
    cfg = ModelConfig.from_hf(case.config)
    image = pack(cfg, None, hw, max_positions=len(case.input_ids) + 1, fill=False, logit_rows=4)
    tight = compile_tokens(cfg, image, hw, 4, logits="all").l2_map
    assert tight["gain2"][0] == tight["gain"][0] and tight["router2"][0] == tight["router"][0]
    roomy = compile_tokens(cfg, image, HW["tiny_v4"], 4, logits="all").l2_map
    assert roomy["gain2"][0] != roomy["gain"][0]
    with pytest.raises(ValueError, match="L2 is too small"):
        compile_tokens(cfg, image, hw.replace(l2_scratch_bytes=hw.l2_scratch_bytes + 16), 4, logits="all")
    plain, pre = _runtimes(case, hw=hw, logit_rows=4)
    spec = _runtimes(case, hw=hw, logit_rows=4)[0]
    pre.prefill_tokens = 4
    ids = [int(t) for t in case.input_ids]
    want = [plain.step(t) for t in ids[:4]]
    np.testing.assert_array_equal(pre.prefill(ids[:4]), want[-1])
    _assert_same_state(plain, pre, "after the prompt")
    rows = spec.verify(ids[:4])                  # below the window of 5 that a KV-shared layer reads
    for j in range(4):
        np.testing.assert_array_equal(rows[j], want[j], err_msg=f"verify row {j}")
    _assert_same_state(plain, spec, "after the verify pass")


def test_e4b_programs_hold_four_tokens_on_the_engine_of_four_vectors():
    from firmware.compiler import program_tokens
    from sim.config import PRESETS as MODELS
    cfg, hw = MODELS["e4b"], HW["kv260"].replace(gemv_vectors=4)
    image = pack(cfg, None, hw, max_positions=600, fill=False, logit_rows=4)
    assert program_tokens(cfg, image, hw) == 4
    prog = compile_tokens(cfg, image, hw, 4, logits="all")
    assert prog.l2_map["gain2"][0] == prog.l2_map["gain"][0]          # the tight layout
    # the FFN's buffers carry the attention's, the post-FFN ones and the sparse top-k's
    gate, up = prog.l2_map["gate"][0], prog.l2_map["up"][0]
    assert prog.l2_map["q"][0] >= gate and prog.l2_map["dn"][0] == up and prog.l2_map["centred"][0] > up
    heads = [decode(w) for w, s in zip(prog.words, prog.steps) if s.startswith("5 LM head")]
    assert all(i.tokens == 4 for i in heads if i.op is Opcode.WGEMM) and \
        not any(i.op is Opcode.WGEMV for i in heads)


def test_a_head_a_wgemm_cannot_read_runs_per_token():
    # the tiny model on kv260: hidden 64 puts the LM head in groups of 64, not the NPU's 128; every token's logits
    # then come from its own WGEMVs (a WGEMM of it would stop with BAD_DESCRIPTOR), the rest of the program as
    # WGEMMs of both tokens
    from sim.iss import COUNT, Machine
    cfg, hw = ModelConfig.preset("tiny"), HW["kv260"]
    image = pack(cfg, None, hw, fill=False, max_positions=16, logit_rows=2)
    prog = compile_tokens(cfg, image, hw, 2, logits="all")
    heads = [decode(w).op for w, s in zip(prog.words, prog.steps) if s.startswith("5 LM head")]
    assert Opcode.WGEMV in heads and Opcode.WGEMM not in heads
    assert any(decode(w).op is Opcode.WGEMM for w in prog.words)
    Machine(image, hw, COUNT).run(prog.bind([1, 2], [0, 1]), token=1, pos=0)


def _ring_limit(pos, window, ring):
    """The most tokens a program may store from `pos` before one of them overwrites a ring row that the
    program's first token attends to (positions max(0, pos - window + 1) .. pos): by brute force."""
    seen = range(max(0, pos - window + 1), pos + 1)
    t = 1
    while t < 64 and not any((pos + t) % ring == q % ring for q in seen):
        t += 1
    return t


def test_multi_token_limit_keeps_shared_sliding_rings_exact():
    shared = load_case(FIXTURES / "f64_s1_l15.npz")          # KV-shared layers read a sliding layer's ring
    rt = Runtime.from_hf(shared.config, shared.tensors, arithmetic="hardware", hw="tiny")
    w = rt.config.sliding_window
    ring = min(rt.image.descriptors[s].capacity for layer, s in rt.image.kv_slots.items()
               if rt.config.is_sliding(layer))
    assert ring == w + HW["tiny"].gemm_tile - 1               # the window and a program's three further tokens
    positions = (0, w - 2, w - 1, w, 3 * w, 3 * w + 1)
    assert [rt.multi_token_limit(p) for p in positions] == [_ring_limit(p, w, ring) for p in positions]
    assert [rt.multi_token_limit(p) for p in positions] == [w + 3, 5, 4, 4, 4, 4]
    # rings as wide as the window (an image packed without the further rows): below the window only
    from firmware.compiler import multi_token_limit
    assert [multi_token_limit(rt.config, p, w) for p in positions] == [_ring_limit(p, w, w) for p in positions]
    alone = load_case(FIXTURES / "f64_s3_l5.npz")             # no KV sharing
    rt = Runtime.from_hf(alone.config, alone.tensors, arithmetic="hardware", hw="tiny")
    assert rt.multi_token_limit(10 * rt.config.sliding_window) == MAX_TOKENS


def test_prefill_program_structure_and_bind():
    cfg, hw = ModelConfig.preset("tiny"), HW["tiny"]
    image = pack(cfg, None, hw, fill=False)
    assert compile_tokens(cfg, image, hw, tokens=1).words == compile_token(cfg, image, hw).words
    prog = compile_tokens(cfg, image, hw, tokens=3, gemm=True)
    kinds = [(f, t) for _, f, t in prog.slots]
    # SETTOK before each token's embedding and PLE rows, SETPOS before its RoPE phases and every KV store
    # or attention
    assert kinds.count((CtrlFunc.SETTOK, 2)) == 2
    assert kinds.count((CtrlFunc.SETPOS, 1)) == 2 + cfg.num_hidden_layers
    words = prog.bind([5, 6, 7], [40, 41, 42])
    for index, func, t in prog.slots:
        insn = decode(words[index])
        assert insn.op is Opcode.CTRL and insn.func is func and insn.imm == ([5, 6, 7] if func is CtrlFunc.SETTOK
                                                                             else [40, 41, 42])[t]
    assert [w for k, w in enumerate(words) if k not in {i for i, _, _ in prog.slots}] == \
        [w for k, w in enumerate(prog.words) if k not in {i for i, _, _ in prog.slots}]
    gemms = [decode(w) for w in prog.words if w >> 60 == Opcode.WGEMM.value]
    assert gemms and all(g.tokens == 3 for g in gemms)
    assert not any(w >> 60 == Opcode.WGEMM.value for w in compile_tokens(cfg, image, hw, 3, gemm=False).words)
    with pytest.raises(ValueError, match="runs 3 tokens: got 2 ids and 3 positions"):
        prog.bind([1, 2], [0, 1, 2])


def test_a_program_without_logits_leaves_logits_alone_and_everything_else_as_with_them():
    """``logits="none"`` (the prefill programs before a prompt's last): no output section, LOGITS untouched, and
    the KV cache and later steps as after the program that computes the last token's logits."""
    case = load_case(FIXTURES / "f64_s1_l15.npz")              # KV sharing, sparse layers
    cfg, hw = ModelConfig.from_hf(case.config), HW["tiny_v4"]
    ids = [int(t) for t in case.input_ids]
    with_, without = _runtimes(case, hw="tiny_v4")
    image = with_.image
    full, none = (compile_tokens(cfg, image, hw, 3, logits=k) for k in ("last", "none"))
    assert not any(s.startswith("5 ") for s in none.steps) and any(s.startswith("5 ") for s in full.steps)
    assert [w for w, s in zip(full.words, full.steps) if not s.startswith("5 ")] == none.words
    one = compile_tokens(cfg, image, hw, 1, logits="none")
    assert len(one.words) < len(compile_token(cfg, image, hw).words)
    stale = np.arange(without.machine.logits.size, dtype=without.machine.logits.dtype)
    without.machine.logits[:] = stale
    for rt, prog in ((with_, full), (without, none)):
        for t, token in enumerate(ids[:3]):
            for region, offset, data in image.stage_rows(token, slot=t):
                rt.backend.write(region, offset, data)
        rt.backend.run_words(prog.bind(ids[:3], range(3)), ids[0], 0)
        rt.position = 3
    np.testing.assert_array_equal(without.machine.logits, stale)
    assert not np.array_equal(with_.machine.logits, stale)
    _assert_same_state(with_, without, "after a program of 3 tokens")
    for k, t in enumerate(ids[3:6]):
        np.testing.assert_array_equal(without.step(t), with_.step(t), err_msg=f"step {3 + k}")


def test_gemm_pays_where_the_array_outruns_the_gemv_stream():
    # kv260_gemm: 2C = 16 rows per k-step against 4 ports x 32 weights per beat: the array takes 128 / 16 = 8
    # tokens' time per pass, re-streamed per tile of 32 tokens (from 33 tokens on, two passes against 33 x 16 /
    # 128)
    kv = HW["kv260_gemm"]
    assert [t for t in range(1, 65) if gemm_pays(kv, t)] == list(range(9, 65))
    assert not gemm_pays(kv, 8) and gemm_pays(kv, 9)
    # tiny: 2C = 8 against 2 x 16: more than 4 tokens per tile of 4 never happens, so never
    assert not any(gemm_pays(HW["tiny"], t) for t in range(1, 65))
    # the GEMV engine of several vectors (tiny_v4's, kv260's) streams the weights once per tile of them: from two
    # tokens on
    for name in ("tiny_v4", "kv260"):
        assert [t for t in range(1, 9) if gemm_pays(HW[name], t)] == list(range(2, 9)), name


@pytest.mark.parametrize("tokens, message", [
    (0, "tokens must be an integer from 1 to 255"), (256, "tokens must be an integer from 1 to 255"),
    (True, "tokens must be an integer"), (64, "L2 is too small"),
])
def test_compile_tokens_rejects_bad_counts(tokens, message):
    cfg, hw = ModelConfig.preset("tiny"), HW["tiny"]
    with pytest.raises(ValueError, match=message):
        compile_tokens(cfg, pack(cfg, None, hw, fill=False), hw, tokens=tokens)


def test_compile_tokens_needs_a_staging_slot_per_token():
    cfg, hw = ModelConfig.preset("tiny"), HW["tiny"]
    image = pack(cfg, None, hw, fill=False, memory_map="kv260")
    with pytest.raises(ValueError, match="needs 5 host-table staging slots; the image has 4"):
        compile_tokens(cfg, image, hw, tokens=5)


def test_prefill_rejects_bad_ids_before_running():
    case = load_case(FIXTURES / "f64_s3_l5.npz")
    rt = Runtime.from_hf(case.config, case.tensors, arithmetic="hardware", hw="tiny")
    for ids, err in (([], ValueError), ([1, rt.config.vocab_size], ValueError), ("abc", TypeError),
                     ([1, -2], ValueError)):
        with pytest.raises(err):
            rt.prefill(ids)
    assert rt.position == 0 and sum(rt.counters.instructions.values()) == 0     # nothing ran
    with pytest.raises(ValueError, match="prefill_tokens"):
        rt.prefill_tokens = 0
