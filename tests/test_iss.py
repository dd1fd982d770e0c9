"""The compiled token program on the instruction-set simulator.

Reference arithmetic (float64, unquantised weights) must reproduce the golden model: that proves the
program, the ISA and the packer compute Gemma 3n. Hardware arithmetic is exercised for determinism,
counters and error handling here; its accuracy is measured in docs/numerics.md.
"""

import dataclasses
import numpy as np
import pytest

from firmware.asm import disassemble
from firmware.compiler import compile_token
from firmware.pack import ffn_pieces, logit_chunks, pack
from firmware.runtime import Runtime
from hdl.config import PRESETS as HW
from hdl.isa import CtrlFunc, ErrorCode, Opcode, encode
from sim.config import PRESETS, ModelConfig
from sim.gemma3n import Model
from sim.iss import ExecutionError, Machine
from sim.random_weights import random_tensors
from tests.oracle import TRAINED, fixture_paths, load_case, load_checkpoint_case

REFERENCE_TOL = 1e-6


@pytest.mark.parametrize("hw", ["tiny", "kv260"])
@pytest.mark.parametrize("path", fixture_paths("f64"), ids=lambda p: p.stem)
def test_reference_program_reproduces_golden_model(path, hw):
    case = load_case(path)
    rt = Runtime.from_hf(case.config, case.tensors, backend="iss", arithmetic="reference", hw=hw)
    golden = Model.from_hf(case.config, case.tensors)
    for step, token in enumerate(case.input_ids):
        got, want = rt.step(token), golden.step(token)
        assert np.max(np.abs(got - want)) <= REFERENCE_TOL, f"{case.name} step {step}"
    # ... and therefore transformers itself (the fixture), within the golden model's own bound.
    rt.reset()
    got = np.stack([rt.step(t) for t in case.input_ids])
    assert np.max(np.abs(got - case.logits)) <= 1e-9


def test_reference_program_reproduces_golden_model_on_the_trained_model():
    # The built-in trained model on the tiny NPU: the compiled program in reference arithmetic against the
    # golden model every step, and so against transformers (the fixture's 80 held-out tokens).
    from firmware.generate import BUILTIN_MODEL

    case = load_checkpoint_case(TRAINED / "f64_pydoc_80.npz", BUILTIN_MODEL)
    rt = Runtime.from_hf(case.config, case.tensors, backend="iss", arithmetic="reference", hw="tiny")
    golden = Model.from_hf(case.config, case.tensors)
    got = []
    for step, token in enumerate(case.input_ids):
        got.append(rt.step(token))
        assert np.max(np.abs(got[-1] - golden.step(token))) <= REFERENCE_TOL, f"step {step}"
    assert np.max(np.abs(np.stack(got) - case.logits)) <= 1e-9


def test_e4b_shaped_program_beyond_the_window():
    # E4B's dimensions (D 2048, 8/2 heads of 256, FFN 16384, PLE 256, LAuReL 64, 4 AltUp streams) in three
    # layers: sliding (sparse), full, and a KV-shared sliding layer that reads layer 0's cache; a window of
    # 4 so that positions 4..9 lie beyond it.
    e4b = PRESETS["e4b"]
    cfg = e4b.replace(num_hidden_layers=3, intermediate_size=e4b.intermediate_size[:3],
                      activation_sparsity_pattern=(0.95, 0.0, 0.0), layer_types=("sliding_attention",
                      "full_attention", "sliding_attention"), num_kv_shared_layers=1, vocab_size=512,
                      vocab_size_per_layer_input=256, sliding_window=4)
    assert cfg.kv_source(2) == 0
    tensors = random_tensors(cfg, seed=11, dtype=np.float64)
    rt = Runtime.from_hf(cfg, tensors, arithmetic="reference", hw="kv260", max_positions=16)
    golden = Model.from_hf(cfg, tensors)
    for pos, token in enumerate([2, 300, 17, 5, 9, 44, 301, 3, 1, 8]):
        assert np.max(np.abs(rt.step(token) - golden.step(token))) <= REFERENCE_TOL, pos


def test_listing_maps_every_instruction_to_a_step():
    cfg = PRESETS["tiny"]
    image = pack(cfg, random_tensors(cfg, 0), HW["tiny"])
    prog = compile_token(cfg, image, HW["tiny"])
    lines = prog.listing().splitlines()
    assert len(lines) == len(prog.words) == len(prog.steps)
    assert all(step for step in prog.steps)
    for i in range(cfg.num_hidden_layers):
        assert any(s.startswith(f"layer {i}: 4.B-5 attention") for s in prog.steps)
    assert prog.steps[-1] == "end" and disassemble(prog.words[-1]) == "ctrl.halt imm=0x0"
    # KV-shared layers store nothing; cache layers store once each.
    stores = [s for w, s in zip(prog.words, prog.steps) if w >> 60 == Opcode.KVST.value]
    assert len(stores) == len(cfg.kv_cache_layers)


def test_hardware_arithmetic_is_deterministic_and_counts_bytes():
    cfg = PRESETS["tiny"]
    tensors = random_tensors(cfg, 0)
    a = Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw="tiny")
    b = Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw="tiny")
    tokens = (2, 7, 300)
    for token in tokens:
        la, lb = a.step(token), b.step(token)
        np.testing.assert_array_equal(la, lb)
        assert la.dtype == np.float32 and np.all(np.abs(la) <= cfg.final_logit_softcapping)
    c = a.machine.counters
    # WGEMVs per token, counted from the model: LAuReL 2, Q, O, the gate, the up pieces, down, PLE gate and
    # projection, plus K and V on cache layers; the PLE projection, AltUp projections and unprojections;
    # LM-head chunks. The tiny FFN (128 rows) runs up in quarters with the last split 28 + 4.
    n = cfg.altup_num_inputs
    assert all(ffn_pieces(cfg, i) == [(0, 32), (32, 32), (64, 32), (96, 28), (124, 4)]
               for i in range(cfg.num_hidden_layers))
    per_token = sum(8 + 5 + (0 if cfg.is_kv_shared(i) else 2) for i in range(cfg.num_hidden_layers)) \
        + 1 + 2 * (n - 1)
    per_token += -(-cfg.vocab_size // min(cfg.vocab_size, HW["tiny"].l2_bytes // 16, 1 << 15))
    assert c.instructions["WGEMV"] == len(tokens) * per_token
    # Bytes: every INT4 matrix once per token (the PLE table only as one gathered row, the embedding as the
    # LM head plus one gathered row), minus the columns the sparse down projections skipped.
    e = a.image.tensors
    row = {name: (e[name].shape[1] + 1) // 2 + -(-e[name].shape[1] // e[name].group) * 2
           for name in ("embed_tokens.weight", "embed_tokens_per_layer.weight")}
    dense = sum(t.nbytes + t.scale_nbytes for t in e.values()
                if t.format == "int4" and t.name != "embed_tokens_per_layer.weight")
    assert c.bytes_read["WEIGHTS"] + c.weight_bytes_skipped == len(tokens) * (dense + sum(row.values()))
    assert c.weight_bytes_skipped > 0
    assert c.bytes_written["LOGITS"] == len(tokens) * cfg.vocab_size * 4
    # KV: per cache layer and KV head, int8 (the tiny preset) two planes of K and V (head_dim/2 bytes each), K's
    # two binary16 scales per act_block and V's one per row
    assert HW["tiny"].kv_format == "int8"
    per_head = 2 * cfg.head_dim + 4 * -(-cfg.head_dim // HW["tiny"].act_block) + 2
    assert c.bytes_written["KV"] == len(tokens) * len(cfg.kv_cache_layers) * cfg.num_key_value_heads * per_head


def machine_for(cfg=None, hw="tiny"):
    cfg = cfg or PRESETS["tiny"]
    image = pack(cfg, random_tensors(cfg, 0), HW[hw])
    return Machine(image, HW[hw], "hardware"), image


def test_malformed_word_stops_with_the_error_code():
    m, _ = machine_for()
    halt = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    with pytest.raises(ExecutionError, match=r"instruction 1: field 'opcode': 0xe is reserved") as e:
        m.run([encode(Opcode.CTRL, func=CtrlFunc.NOP, imm=0), 0xE << 60, halt], token=0, pos=0)
    assert e.value.code is ErrorCode.BAD_OPCODE and e.value.pc == 1
    with pytest.raises(ExecutionError, match="reserved field 'rsvd' of CTRL") as e:
        m.run([encode(Opcode.CTRL, func=CtrlFunc.NOP, imm=0) | 1, halt], token=0, pos=0)
    assert e.value.code is ErrorCode.RESERVED_BITS
    with pytest.raises(ExecutionError, match="ended without HALT"):
        m.run([encode(Opcode.CTRL, func=CtrlFunc.NOP, imm=0)], token=0, pos=0)


def test_out_of_range_accesses_stop_with_the_error_code():
    m, image = machine_for()
    halt = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    l2_words = HW["tiny"].l2_bytes // 16
    # An L2 address beyond the configured L2 is a decode error.
    bad = encode(Opcode.VEC, func=0, dst=l2_words, a=0, b=0, s=0, async_=0)
    with pytest.raises(ExecutionError) as e:
        m.run([bad, halt], token=0, pos=0)
    assert e.value.code is ErrorCode.ADDRESS_RANGE
    # A vector that starts inside L2 but runs past its end.
    setvl = encode(Opcode.CTRL, func=CtrlFunc.SETVL, imm=64)
    bad = encode(Opcode.VEC, func=0, dst=l2_words - 1, a=0, b=0, s=0, async_=0)
    with pytest.raises(ExecutionError, match=r"instruction 1: L2 range .* exceeds L2") as e:
        m.run([setvl, bad, halt], token=0, pos=0)
    assert e.value.code is ErrorCode.ADDRESS_RANGE
    # A descriptor that does not exist.
    bad = encode(Opcode.WGEMV, dst=0, src=0, desc=len(image.descriptors), accm=0, findemax=0, sparse=0, reuse=0, mask=0,
                 async_=0)
    with pytest.raises(ExecutionError, match="descriptor .* does not exist") as e:
        m.run([bad, halt], token=0, pos=0)
    assert e.value.code is ErrorCode.BAD_DESCRIPTOR
    # A token outside a table that is not remapped.
    embed = image.descriptor("embed_tokens.weight")
    bad = encode(Opcode.GATHER, dst=0, desc=embed.index, remap=0, async_=0)
    with pytest.raises(ExecutionError, match="token 999 is outside table") as e:
        m.run([bad, halt], token=999, pos=0)
    assert e.value.code is ErrorCode.ADDRESS_RANGE


def test_full_attention_beyond_the_kv_capacity_is_an_error():
    cfg = PRESETS["tiny"]
    rt = Runtime.from_hf(cfg, random_tensors(cfg, 0), arithmetic="hardware", hw="tiny", max_positions=6)
    for t in range(6):
        rt.step(t + 2)
    with pytest.raises(ExecutionError, match=r"position 6 exceeds the KV slot \(6 positions\)") as e:
        rt.step(3)
    assert e.value.code is ErrorCode.ADDRESS_RANGE


def test_runtime_argument_errors():
    cfg = PRESETS["tiny"]
    t = random_tensors(cfg, 0)
    with pytest.raises(ValueError, match="backend 'rtl' is not available yet in this process: it drives the "
                                         "simulated NPU"):
        Runtime.from_hf(cfg, t, backend="rtl")
    with pytest.raises(ValueError, match="arithmetic must be 'reference' or 'hardware'"):
        Runtime.from_hf(cfg, t, arithmetic="exact")
    rt = Runtime.from_hf(cfg, t)
    with pytest.raises(ValueError, match=r"token id 320 is outside the vocabulary \[0, 320\)"):
        rt.step(cfg.vocab_size)


def test_compiler_rejects_unsupported_shapes():
    cfg = ModelConfig.from_hf({**PRESETS["tiny"].to_hf(), "head_dim": 12})
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        compile_token(cfg, None, HW["tiny"])


def test_compiler_rejects_altup_streams_not_in_whole_words():
    cfg = ModelConfig.from_hf({**PRESETS["tiny"].to_hf(), "altup_num_inputs": 3})
    with pytest.raises(ValueError, match="altup_num_inputs must be a multiple of 4"):
        compile_token(cfg, None, HW["tiny"])
    cfg = ModelConfig.from_hf({**PRESETS["tiny"].to_hf(), "altup_num_inputs": 8})
    with pytest.raises(ValueError, match="altup_num_inputs must be at most 5"):
        compile_token(cfg, None, HW["tiny"])


@pytest.mark.parametrize("tokens", [1, 5])
def test_wgemm_equals_wgemv_per_token(tokens):
    """WGEMM (the systolic array, sim.systolic) gives, token by token, the bits of WGEMV (the GEMV engine),
    and in reference arithmetic the float64 product; weights stream once per systolic_rows tokens."""
    cfg, hw = PRESETS["tiny"], HW["tiny"]
    tensors = random_tensors(cfg, 3)
    image = pack(cfg, tensors, hw)
    d = next(d for d in image.descriptors if d.kind == 0 and d.layout == 0 and d.tensor.endswith("up_proj.weight"))
    halt = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    in_stride, out_stride = -(-d.cols // 4), -(-d.rows // 4)
    src, dst = 0, 2048
    rng = np.random.default_rng(tokens)
    xs = (rng.standard_normal((tokens, d.cols)) * np.array([0.1, 3.0, 40.0])[rng.integers(0, 3, d.cols)])
    xs[:, rng.integers(0, d.cols, 5)] = 0.0
    for arithmetic in ("hardware", "reference"):
        source = {d.tensor: tensors[d.tensor]} if arithmetic == "reference" else None
        batch = Machine(image, hw, arithmetic, source=source)
        for t in range(tokens):
            batch.l2[(src + t * in_stride) * 4:(src + t * in_stride) * 4 + d.cols] = xs[t]
        batch.run([encode(Opcode.WGEMM, dst=dst, src=src, desc=d.index, tokens=tokens, accm=0, async_=0), halt],
                  token=0, pos=0)
        got = np.stack([batch.l2[(dst + t * out_stride) * 4:(dst + t * out_stride) * 4 + d.rows]
                        for t in range(tokens)])
        if arithmetic == "reference":
            np.testing.assert_allclose(got, xs @ np.asarray(tensors[d.tensor], np.float64).T, rtol=1e-12,
                                       atol=1e-12)
            continue
        single = Machine(image, hw, "hardware")
        for t in range(tokens):
            single.l2[:d.cols] = xs[t].astype(np.float32)
            single.run([encode(Opcode.WGEMV, dst=dst, src=0, desc=d.index, accm=0, findemax=0, sparse=0,
                               reuse=0, mask=0,
                               async_=0), halt], token=0, pos=0)
            np.testing.assert_array_equal(got[t], single.l2[dst * 4:dst * 4 + d.rows], err_msg=f"token {t}")
        passes = -(-tokens // hw.systolic_rows)
        assert batch.counters.bytes_read["WEIGHTS"] == passes * single.counters.bytes_read["WEIGHTS"] // tokens


def test_wgemm_rejects_zero_tokens_and_column_major():
    m, image = machine_for()
    halt = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    dense = next(d for d in image.descriptors if d.kind == 0 and d.layout == 0)
    with pytest.raises(ExecutionError, match="at least one token") as e:
        m.run([encode(Opcode.WGEMM, dst=0, src=0, desc=dense.index, tokens=0, accm=0, async_=0), halt],
              token=0, pos=0)
    assert e.value.code is ErrorCode.BAD_LENGTH
    colmajor = next(d for d in image.descriptors if d.kind == 0 and d.layout == 1)
    with pytest.raises(ExecutionError, match="not a row-major weight matrix") as e:
        m.run([encode(Opcode.WGEMM, dst=0, src=0, desc=colmajor.index, tokens=2, accm=0, async_=0), halt],
              token=0, pos=0)
    assert e.value.code is ErrorCode.BAD_DESCRIPTOR


def test_wgemm_group_columns_and_non_finite_tiles():
    """WGEMM's own checks: groups other than the scale lanes' (BAD_DESCRIPTOR), more columns than the
    activation memory (BAD_LENGTH), and a non-finite input in token tile 1 (NON_FINITE) with tile 0's rows
    written and tile 1's untouched (docs/isa.md, WGEMM)."""
    m, image = machine_for()
    hw = m.hw
    halt = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    run = lambda d, **kw: m.run([encode(Opcode.WGEMM, **{"dst": 1024, "src": 0, "desc": d.index, "tokens": 2,
                                                         "accm": 0, "async_": 0, **kw}), halt], token=0, pos=0)
    odd = next(d for d in image.descriptors if d.kind == 0 and d.layout == 0 and d.group != hw.weight_group)
    with pytest.raises(ExecutionError, match="scale lanes take groups") as e:
        run(odd)
    assert e.value.code is ErrorCode.BAD_DESCRIPTOR
    dense = next(d for d in image.descriptors if d.kind == 0 and d.layout == 0 and d.group == hw.weight_group)
    wide = dataclasses.replace(dense, cols=hw.gemv_max_cols + 1)
    image.descriptors[dense.index] = wide
    try:
        with pytest.raises(ExecutionError, match="exceeds the activation memory") as e:
            run(wide)
        assert e.value.code is ErrorCode.BAD_LENGTH
    finally:
        image.descriptors[dense.index] = dense
    R, stride_in, stride_out = hw.systolic_rows, -(-dense.cols // 4), -(-dense.rows // 4)
    tokens = R + 1
    m.l2[:] = 0.5
    m.l2[(R * stride_in) * 4 + 1] = np.inf                     # token R: the first of tile 1
    before = m.l2.copy()
    with pytest.raises(ExecutionError, match="token tile 1") as e:
        run(dense, tokens=tokens)
    assert e.value.code is ErrorCode.NON_FINITE
    out = lambda t: slice((1024 + t * stride_out) * 4, (1024 + t * stride_out) * 4 + dense.rows)  # noqa: E731
    for t in range(R):
        assert np.all(m.l2[out(t)] != before[out(t)]), f"tile 0, token {t} not written"
    np.testing.assert_array_equal(m.l2[out(R)], before[out(R)])


def test_sparse_wgemv_reads_column_major_weights_and_group_major_scales():
    """Hardware WGEMV on a column-major (sparse-layer) down projection equals the numerics contract applied
    to the checkpoint tensor quantised independently of the packer's layout, for dense and sparse x."""
    from sim.numerics import gemv, quantize_activations, quantize_weights
    cfg, hw = PRESETS["tiny"], HW["tiny"]
    tensors = random_tensors(cfg, 5)
    image = pack(cfg, tensors, hw)
    d = next(d for d in image.descriptors if d.kind == 0 and d.layout == 1)
    q_w, s_w = quantize_weights(np.asarray(tensors[d.tensor], np.float64), d.group)
    halt = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    rng = np.random.default_rng(0)
    for density in (1.0, 0.05):
        x = rng.standard_normal(d.cols).astype(np.float32)
        x[rng.random(d.cols) >= density] = 0.0
        m = Machine(image, hw, "hardware")
        m.l2[:d.cols] = x
        m.run([encode(Opcode.WGEMV, dst=1024, src=0, desc=d.index, accm=0, findemax=0, sparse=1,
                      reuse=0, mask=0, async_=0), halt],
              token=0, pos=0)
        q_a, e_a = quantize_activations(x, hw.act_block)
        np.testing.assert_array_equal(m.l2[4096:4096 + d.rows],
                                      gemv(q_w, s_w, q_a, e_a, group=d.group, block=hw.act_block))
        # bytes: the columns whose quantised activation is non-zero, plus every scale
        ngroups = -(-d.cols // d.group)
        assert m.counters.bytes_read["WEIGHTS"] == np.count_nonzero(q_a) * d.rows // 2 + d.rows * ngroups * 2
        # and its shape for the performance model (firmware.perf.sparse_gemv_cycles)
        assert m.counters.sparse_gemvs == {(d.rows, d.cols, d.group, np.count_nonzero(q_a)): 1}
    # an activation far below its block's maximum quantises to 0: its column is skipped, as the engine does
    x = np.zeros(d.cols, np.float32)
    x[:3] = [40.0, 1e-6, -3.0]
    m = Machine(image, hw, "hardware")
    m.l2[:d.cols] = x
    m.run([encode(Opcode.WGEMV, dst=1024, src=0, desc=d.index, accm=0, findemax=0, sparse=1,
                  reuse=0, mask=0, async_=0), halt],
          token=0, pos=0)
    assert m.counters.bytes_read["WEIGHTS"] == 2 * d.rows // 2 + d.rows * -(-d.cols // d.group) * 2


def test_compiler_moves_independent_work_under_weight_streams():
    """The program's overlap structure (the perf model's hidden cycles depend on it): every norm-gain, scale and
    router DMA sits right behind an async WGEMV (or its SETVL) or at a point where no stream has started, and
    the inactive AltUp predictions and corrections follow a WGEMV whose rows they do not read."""
    from hdl.isa import DmaDir, decode
    cfg = PRESETS["e4b"].replace(num_hidden_layers=3, intermediate_size=PRESETS["e4b"].intermediate_size[:3],
                                 activation_sparsity_pattern=(0.95, 0.0, 0.0), layer_types=(
                                     "sliding_attention", "full_attention", "sliding_attention"),
                                 num_kv_shared_layers=1, vocab_size=512, vocab_size_per_layer_input=256)
    image = pack(cfg, None, HW["kv260"], max_positions=8, fill=False)
    prog = compile_token(cfg, image, HW["kv260"])
    ops = [decode(w) for w in prog.words]
    gains = {e.offset // 16 for n, e in image.tensors.items() if e.region == "CONST" and
             (n.endswith("norm.weight") or n.endswith("correct_output_scale") or n.endswith("modality_router_folded"))}
    first_stream = next(k for k, o in enumerate(ops) if o.op is Opcode.WGEMV)

    def prefetch(o):
        return o.op is Opcode.DMA and o.dir is DmaDir.DDR_TO_L2 and o.offset in gains

    routers = {image.tensors[f"layers.{i}.altup.modality_router_folded"].offset // 16
               for i in range(cfg.num_hidden_layers)}
    behind, total, ffn = 0, 0, 0
    for k, o in enumerate(ops):
        if prefetch(o) and k > first_stream:
            total += 1
            back = k - 1              # over the SETVLs and other prefetches placed behind the same WGEMV
            while ops[back].op is Opcode.CTRL and ops[back].func is CtrlFunc.SETVL or prefetch(ops[back]):
                back -= 1
            behind += ops[back].op is Opcode.WGEMV and bool(ops[back].async_)
            if o.offset in routers and ops[back].op is Opcode.WGEMV:
                # a router (8 K elements) goes behind the largest stream since its buffer's reader: an FFN matrix
                ffn += image.descriptors[ops[back].desc].tensor.split(".")[-2] in ("gate_proj", "up_proj",
                                                                                   "down_proj")
    # the rest wait for their buffer's last reader, which comes after the last WGEMV
    assert total >= 9 * cfg.num_hidden_layers and behind >= 0.75 * total, (behind, total)
    assert ffn >= 2 * cfg.num_hidden_layers - 2, ffn
    for i in range(cfg.num_hidden_layers):
        for what, after in (("4.A AltUp predict, the other streams", f"layers.{i}.mlp.gate_proj.weight"),
                            ("4.E AltUp correct, the other streams", f"layers.{i}.per_layer_input_gate.weight")):
            k = prog.steps.index(f"layer {i}: {what} (under the " + ("gate projection's stream)" if "predict" in what
                                                                     else "PLE streams)"))
            w = max(j for j in range(k) if ops[j].op is Opcode.WGEMV)
            assert image.descriptors[ops[w].desc].tensor == after, (i, what)
            assert ops[w].async_


@pytest.mark.parametrize("arithmetic", ["hardware", "reference"])
def test_wgemv_reuse_computes_with_the_engines_activations(arithmetic):
    """WGEMV `reuse` skips the quantiser pass: the GEMV engine keeps the last vector it quantised, so a reuse
    after the source changed still computes with the old vector (in both arithmetics), costs no copy pass,
    and stops with BAD_LENGTH when the engine holds nothing (START) or a vector of another length."""
    from hdl.isa import VecFunc
    from sim.iss import COUNT
    cfg, hw = PRESETS["tiny"], HW["tiny"]
    tensors = random_tensors(cfg, 0)
    image = pack(cfg, tensors, hw)
    by = {k: d for k, d in image.matrices().items() if d.layout == 0}
    q, gate = by["layers.0.self_attn.q_proj.weight"], by["layers.0.mlp.gate_proj.weight"]
    wide = next(d for d in by.values() if d.cols != q.cols)
    halt = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)
    load = [encode(Opcode.CTRL, func=CtrlFunc.SETVL, imm=q.cols)]
    x = np.random.default_rng(3).standard_normal(q.cols)
    gemv = lambda dst, d, reuse: encode(Opcode.WGEMV, dst=dst, src=0, desc=d.index, accm=0, findemax=0, sparse=0,
                                        reuse=reuse, mask=0, async_=0)
    square = encode(Opcode.VEC, func=VecFunc.MUL, dst=0, a=0, b=0, s=0, async_=0)
    def machine():
        mm = Machine(image, hw, arithmetic, source=tensors if arithmetic == "reference" else None)
        mm.l2[:q.cols] = x
        return mm

    m = machine()
    m.run(load + [gemv(64, q, 0), square, gemv(128, gate, 1), halt], token=0, pos=0)
    got = m.l2[512:512 + gate.rows].copy()
    x2 = m.l2[:q.cols].copy()
    fresh = machine()
    fresh.run(load + [gemv(128, gate, 0), halt], token=0, pos=0)
    np.testing.assert_array_equal(got, fresh.l2[512:512 + gate.rows])
    assert not np.array_equal(x2, fresh.l2[:q.cols])                 # the source did change
    counted = Machine(image, hw, COUNT)
    counted.run(load + [gemv(64, q, 0), gemv(128, gate, 1), halt], token=0, pos=0)
    assert counted.counters.passes[("WGEMV", "quant")] == 1
    for words, pc in ((load + [gemv(128, gate, 1), halt], 1), (load + [gemv(64, q, 0), gemv(128, wide, 1), halt], 2)):
        with pytest.raises(ExecutionError, match="reuse") as e:
            machine().run(words, token=0, pos=0)
        assert e.value.code is ErrorCode.BAD_LENGTH and e.value.pc == pc
    # a new program run starts with nothing held (START)
    with pytest.raises(ExecutionError, match="reuse"):
        m.run(load + [gemv(128, gate, 1), halt], token=0, pos=0)


def test_compiler_reuses_the_engines_activations():
    """The E4B-shaped program quantises each vector once: Q, K and V reuse LAuReL's input, the up pieces the
    gate's, the LM-head chunks the first chunk's."""
    from hdl.isa import decode
    cfg = ModelConfig.preset("e4b")
    hw = HW["kv260"]
    image = pack(cfg, None, hw, max_positions=8, fill=False)
    prog = compile_token(cfg, image, hw)
    ins = [decode(w) for w in prog.words]
    wg = [(i, s) for i, s in zip(ins, prog.steps) if i.op is Opcode.WGEMV]
    reused = [s for i, s in wg if i.reuse]
    chunks = len(logit_chunks(cfg, hw))
    assert chunks == 11
    # per layer Q and the 5 up pieces, K and V on cache layers; 10 LM-head chunks after the first; the 3 AltUp
    # projections of x0 (the PLE projection quantised it)
    assert [n for _, n in ffn_pieces(cfg, 0)] == [4096, 4096, 4096, 3584, 512]
    assert len(reused) == 6 * cfg.num_hidden_layers + 2 * len(cfg.kv_cache_layers) + (chunks - 1) + 3


def test_compiler_forgets_the_engines_vector_when_its_source_is_written():
    """The emitter sets `reuse` only while nothing has written the held vector's L2 source since it was
    quantised: a VEC, CVO, DMA, GATHER, WGEMV or SCALAR ST into it, or an INT8 ATTN (which quantises into
    the engine), makes the next WGEMV of that source quantise again; reductions and writes elsewhere do not."""
    from firmware.compiler import _Emitter
    from hdl.isa import CvoFunc, DdrRegion, DmaDir, ScalarFunc, VecFunc, decode
    cfg, hw = PRESETS["tiny"], HW["tiny"]
    image = pack(cfg, None, hw, max_positions=4, fill=False)
    q, k = "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight"
    cols = image.descriptor(q).cols
    src, far = 64, 64 + cols // 4 + 64                 # word addresses: the source, and L2 beyond it

    def reused(between):
        e = _Emitter(cfg, image, hw)
        e.setvl(cols)
        e.wgemv(q, 1024, src)
        between(e)
        e.wgemv(k, 1536, src)
        return decode(e.prog.words[-1]).reuse

    vec = lambda dst, f=VecFunc.ADD: lambda e: e.vec(f, dst=dst, a=far, b=far)
    assert reused(lambda e: None) == 1
    assert reused(vec(far)) == 1
    assert reused(vec(src, VecFunc.SUMSQ)) == 1                 # a reduction writes a scalar register
    assert reused(vec(src + cols // 4 - 1)) == 0                 # the last word of the source
    assert reused(vec(src)) == 0
    assert reused(lambda e: e.emit(Opcode.CVO, func=CvoFunc.EXP, src=far, dst=src, length=4, sub_emax=0,
                                   recip_scale=0, accm=0, async_=0)) == 0
    assert reused(lambda e: e.emit(Opcode.DMA, dir=DmaDir.DDR_TO_L2, region=DdrRegion.CONST, l2=src, offset=0,
                                   async_=0)) == 0
    assert reused(lambda e: e.emit(Opcode.DMA, dir=DmaDir.L2_TO_DDR, region=DdrRegion.SCRATCH, l2=src, offset=0,
                                   async_=0)) == 1
    assert reused(lambda e: e.scalar(ScalarFunc.ST, a=0, imm=src * 4 + 3)) == 0
    assert reused(lambda e: e.scalar(ScalarFunc.ST, a=0, imm=far * 4)) == 1
    assert reused(lambda e: e.wgemv(q, src, far)) == 0          # another vector quantised, its rows on src
    assert reused(lambda e: e.emit(Opcode.ATTN, dst=far, q=far, slot=0, kv_head=0, shape_ptr=0, async_=0)) == 0
    # a WGEMV whose rows overwrite its own source leaves nothing to reuse
    e = _Emitter(cfg, image, hw)
    e.setvl(cols)
    e.wgemv(q, src, src)
    e.wgemv(k, 1536, src)
    assert decode(e.prog.words[-1]).reuse == 0


def test_lm_head_in_a_shrinking_tail_of_chunks_gives_the_same_logits(monkeypatch):
    """A vocabulary beyond one chunk (tiny NPU: 4,096 rows) with rows wide enough for a tail (D 128: 72 bytes a
    row against 2 x 2 ports x 8 bytes, k = 2): 7 chunks (968, then 2,048 halving to 64) through both logits
    buffers. The hardware-arithmetic logits are bit-identical to those of plain 4,096-row chunks (each row's
    GEMV does not depend on its chunk), and the reference arithmetic matches the float64 model."""
    import firmware.compiler as compiler
    import firmware.pack as packer
    cfg = PRESETS["tiny"].replace(hidden_size=128, vocab_size=5000, vocab_size_per_layer_input=256)
    hw = HW["tiny"]
    assert [n for _, n in logit_chunks(cfg, hw)] == [968, 2048, 1024, 512, 256, 128, 64]
    tensors = random_tensors(cfg, seed=3, dtype=np.float64)
    golden = Model.from_hf(cfg, tensors)
    ref = Runtime.from_hf(cfg, tensors, arithmetic="reference", hw="tiny")
    tail = Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw="tiny")

    def plain(cfg, hw, tokens=1):
        C = packer.logit_chunk_rows(cfg, hw, tokens)
        return [(r0, min(C, cfg.vocab_size - r0)) for r0 in range(0, cfg.vocab_size, C)]

    monkeypatch.setattr(packer, "logit_chunks", plain)
    monkeypatch.setattr(compiler, "logit_chunks", plain)
    flat = Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw="tiny")
    wgemvs = lambda rt: sum(w >> 60 == Opcode.WGEMV.value for w in rt.program.words)
    assert wgemvs(tail) == wgemvs(flat) + 5                          # 7 LM-head chunks against 2
    for token in (2, 4999, 17):
        np.testing.assert_array_equal(tail.step(token), flat.step(token))
        assert np.max(np.abs(ref.step(token) - golden.step(token))) <= REFERENCE_TOL
