"""Batched decode (`Runtime.step_many`) and speculative verify passes (`Runtime.verify`, `Runtime.rollback`) on
the instruction-set simulator in hardware arithmetic.

Batched: every stream's logits row is, bit for bit, what the same sequence gives run alone through `step`, and
every stream's KV cache holds the bytes of that lone run, with the streams at different positions. Verify: each
row of a verify pass is the logits `step` gives at that position, and after `rollback` the position and every
byte of the KV cache are those of stepping the kept ids alone (the pass crossing a sliding ring's end), and
decoding goes on with the same bits. The fixtures cover KV sharing of a sliding layer and rings smaller than a
pass.
"""

import numpy as np
import pytest

from firmware.compiler import compile_tokens
from firmware.generate import generate, generate_speculative, generate_streams
from firmware.generate import main as generate_main
from firmware.pack import kv_row_ranges, logit_stride, pack, save_image
from firmware.runtime import Runtime
from firmware.sampling import Sampler, SamplingParams
from firmware.speculate import SpecStats
from hdl.config import PRESETS as HW
from sim.config import ModelConfig
from tests.oracle import FIXTURES, load_case


def _runtime(case, hw="tiny", **kw):
    return Runtime.from_hf(case.config, case.tensors, arithmetic="hardware", hw=hw, max_positions=16, **kw)


def _ids(case):
    return [int(t) for t in case.input_ids]


def _same_cache(a: Runtime, stream: int, b: Runtime, what: str):
    for layer, slot in b.image.kv_slots.items():
        np.testing.assert_array_equal(a.machine.kv_bytes(a.image.stream_slots[stream][layer]),
                                      b.machine.kv_bytes(slot), err_msg=f"{what}: KV cache of layer {layer}")


@pytest.mark.parametrize("name, memory_map, hw", [
    ("f64_s2_l7", "flat", "tiny"), ("f64_s1_l15", "kv260", "tiny"),
    # the GEMV engine of four vectors: the projections, the sparse layers' gate and up, the unembedding and
    # the LM head as WGEMMs of the three streams' tokens
    ("f64_s1_l15", "kv260", "tiny_v4"), ("f32_s4_l12", "flat", "tiny_v4")])
def test_each_stream_of_a_batch_is_its_sequence_alone(name, memory_map, hw):
    case = load_case(FIXTURES / f"{name}.npz")
    ids = _ids(case)
    streams = 3
    batch = _runtime(case, hw, streams=streams, memory_map=memory_map)
    alone = [_runtime(case, hw, memory_map=memory_map) for _ in range(streams)]      # each sequence by itself
    assert batch.streams == streams and batch.image.logit_rows >= streams
    # three sequences, stream 1 two tokens ahead (a prefill on it alone), so the positions differ in every step
    seqs = [ids[0:5], ids[3:10], ids[5:10][::-1]]
    batch.use_stream(1)
    batch.prefill(seqs[1][:2])
    batch.use_stream(0)
    alone[1].prefill(seqs[1][:2])
    done = [0, 2, 0]
    for step in range(3):
        rows = batch.step_many([seq[k] for seq, k in zip(seqs, done)])
        assert rows.shape == (streams, batch.config.vocab_size)
        for s, seq in enumerate(seqs):
            np.testing.assert_array_equal(rows[s], alone[s].step(seq[done[s]]),
                                          err_msg=f"{name} step {step} stream {s}")
            _same_cache(batch, s, alone[s], f"{name} step {step} stream {s}")
            done[s] += 1
        assert batch.positions == done
    assert batch.counters.instructions["CTRL.SETPOS"] > 0
    if hw == "tiny_v4":
        assert batch.counters.instructions["WGEMM"] > 0


def test_copy_stream_continues_another_streams_sequence():
    case = load_case(FIXTURES / "f64_s1_l15.npz")          # KV sharing, window 5
    ids = _ids(case)
    batch, alone = _runtime(case, streams=3), _runtime(case)
    batch.prefill(ids[:6])
    batch.copy_stream(0, 2)
    assert batch.positions == [6, 0, 6]
    for layer, slot in batch.image.kv_slots.items():
        np.testing.assert_array_equal(batch.machine.kv_bytes(batch.image.stream_slots[2][layer]),
                                      batch.machine.kv_bytes(slot), err_msg=f"layer {layer}")
    rows = batch.step_many([ids[6], ids[0], ids[9]])
    alone.prefill(ids[:6])
    np.testing.assert_array_equal(rows[2], alone.step(ids[9]))
    with pytest.raises(ValueError, match="stream"):
        batch.copy_stream(0, 3)


def test_batches_larger_than_a_program_run_in_several():
    case = load_case(FIXTURES / "f64_s3_l5.npz")
    ids = _ids(case)
    batch = _runtime(case, streams=5)
    assert batch.batch_tokens == HW["tiny"].systolic_rows == 4      # a token tile per program: 4 + 1
    alone = _runtime(case)
    rows = batch.step_many(ids[:5])
    for s in range(5):
        alone.reset()
        np.testing.assert_array_equal(rows[s], alone.step(ids[s]), err_msg=f"stream {s}")


@pytest.mark.parametrize("name, before, n, keep, hw", [
    ("f64_s3_l5", 4, 4, 1, "tiny"),      # window 6: positions 4..7 wrap the ring; only the first id kept
    ("f64_s3_l5", 5, 4, 3, "tiny"),
    ("f64_s3_l5", 0, 4, 4, "tiny"),      # every id kept
    ("f64_s2_l7", 0, 3, 2, "tiny"),      # a shared sliding layer: a pass below the window (3)
    ("f64_s3_l5", 4, 4, 2, "tiny_v4"),   # the pass's projections and LM head as WGEMMs of its four ids
    ("f32_s4_l12", 1, 3, 1, "tiny_v4"),  # sparse layers, KV sharing
])
def test_verify_rows_are_steps_and_rollback_restores_the_cache(name, before, n, keep, hw):
    case = load_case(FIXTURES / f"{name}.npz")
    ids = _ids(case)
    spec, plain = _runtime(case, hw, logit_rows=8), _runtime(case, hw)
    for t in ids[:before]:
        spec.step(t)
        plain.step(t)
    assert spec.verify_tokens() >= n
    rows = spec.verify(ids[before:before + n])
    assert rows.shape == (n, spec.config.vocab_size) and spec.position == before + n
    for j in range(n):
        np.testing.assert_array_equal(rows[j], plain.step(ids[before + j]), err_msg=f"{name} row {j}")
    spec.rollback(keep)
    plain.reset()
    for t in ids[:before + keep]:
        plain.step(t)
    assert spec.position == plain.position == before + keep
    _same_cache(spec, 0, plain, f"{name} after rollback({keep})")
    for t in ids[before + keep:before + keep + 2]:
        np.testing.assert_array_equal(spec.step(t), plain.step(t), err_msg=f"{name} after the rollback")


def test_verify_limits_and_misuse_are_clear_errors():
    shared = load_case(FIXTURES / "f64_s2_l7.npz")       # window 3, KV-shared layers read a sliding ring
    rt = _runtime(shared, logit_rows=8)
    ids = _ids(shared)
    # its rings hold the window and 3 more rows: a pass of 4 ids (a program's tokens) at any position
    assert [rt.verify_tokens(p) for p in (0, 1, 2, 5, 40)] == [4, 4, 4, 4, 4]
    with pytest.raises(ValueError, match="verify takes at most 4 ids at position 0"):
        rt.verify(ids[:5])
    with pytest.raises(ValueError, match="rollback follows a verify"):
        rt.rollback(1)
    rt.verify(ids[:2])
    with pytest.raises(ValueError, match="keep"):
        rt.rollback(3)
    with pytest.raises(ValueError, match="keep"):
        rt.rollback(0)
    rt.step(ids[2])
    with pytest.raises(ValueError, match="rollback follows a verify"):
        rt.rollback(1)
    for bad, err in (([], ValueError), ("ab", TypeError), ([1, rt.config.vocab_size], ValueError)):
        with pytest.raises(err):
            rt.verify(bad)


def test_step_many_rejects_bad_input_before_running():
    case = load_case(FIXTURES / "f64_s3_l5.npz")
    rt = _runtime(case, streams=2)
    with pytest.raises(ValueError, match="one id per stream: 2 ids, not 3"):
        rt.step_many([1, 2, 3])
    with pytest.raises(ValueError, match="token id"):
        rt.step_many([1, rt.config.vocab_size])
    with pytest.raises(ValueError, match="stream"):
        rt.use_stream(2)
    assert rt.positions == [0, 0] and sum(rt.counters.instructions.values()) == 0
    with pytest.raises(ValueError, match="streams must be a positive integer"):
        _runtime(case, streams=0)


def test_pack_gives_each_stream_its_own_slots_and_logits_rows():
    cfg, hw = ModelConfig.preset("tiny"), HW["tiny"]
    image = pack(cfg, None, hw, fill=False, streams=3, logit_rows=5)
    layers = len(cfg.kv_cache_layers)
    assert image.streams == 3 and image.logit_rows >= 5
    assert image.logit_rows == image.region("LOGITS")[1] // (4 * logit_stride(cfg))     # the region's 4 KB pages
    assert [sorted(s.values()) for s in image.stream_slots] == [list(range(k * layers, (k + 1) * layers))
                                                                 for k in range(3)]
    assert image.region("LOGITS")[1] >= 5 * logit_stride(cfg) * 4
    # the slots' bytes do not overlap, and a ring row's byte ranges lie inside its slot
    spans = sorted((image.descriptors[i].weight_offset, i) for s in image.stream_slots for i in s.values())
    for (a, i), (b, _) in zip(spans, spans[1:]):
        assert all(off + n <= b for off, n in kv_row_ranges(image, i, image.descriptors[i].capacity - 1))
    with pytest.raises(ValueError, match="do not fit the 8-bit slot field"):
        pack(cfg, None, hw, fill=False, streams=256 // layers + 1)
    with pytest.raises(ValueError, match="streams must be a positive integer"):
        pack(cfg, None, hw, fill=False, streams=0)


def test_compile_tokens_checks_streams_and_logits_rows():
    cfg, hw = ModelConfig.preset("tiny"), HW["tiny"]
    image = pack(cfg, None, hw, fill=False, streams=2)
    prog = compile_tokens(cfg, image, hw, 2, streams=(0, 1), logits="all")
    assert prog.streams == (0, 1) and prog.logits == "all"
    with pytest.raises(ValueError, match="stream 2 is not one of the image's 2"):
        compile_tokens(cfg, image, hw, 2, streams=(0, 2))
    with pytest.raises(ValueError, match="one stream index per token"):
        compile_tokens(cfg, image, hw, 2, streams=(0,))
    n = image.logit_rows + 1
    with pytest.raises(ValueError, match=f"the logits of {n} tokens need {n} rows in LOGITS; the image holds {n - 1}"):
        compile_tokens(cfg, image, hw, n, logits="all")
    with pytest.raises(ValueError, match="logits must be 'last', 'all' or 'none', not 'every'"):
        compile_tokens(cfg, image, hw, 2, logits="every")


def test_generate_streams_gives_each_stream_its_lone_continuation():
    case = load_case(FIXTURES / "f64_s3_l5.npz")
    prompt = _ids(case)[:3]
    params = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.15)
    batch = _runtime(case, streams=3)
    out = generate_streams(batch, prompt, 6, [Sampler(params, seed=s) for s in (4, 5, 6)], stop_at_eos=False)
    alone = _runtime(case)
    for s, seed in enumerate((4, 5, 6)):
        assert out[s] == generate(alone, prompt, 6, Sampler(params, seed=seed), stop_at_eos=False), f"stream {s}"
    assert len({tuple(o) for o in out}) > 1                  # the seeds differ, and so do the continuations
    with pytest.raises(ValueError, match="one stream per sampler: 2 samplers, 3 stream"):
        generate_streams(batch, prompt, 2, [Sampler(params), Sampler(params)])


@pytest.mark.parametrize("name, phrase, repeat", [
    ("f64_s3_l5", 3, 8),         # window 6, no KV sharing: passes of 4 ids across the ring's end
    ("f64_s1_l15", 2, 3),        # window 5 and KV-shared layers: passes only below the window
])
def test_greedy_speculative_decoding_gives_the_plain_ids_and_cache(name, phrase, repeat):
    case = load_case(FIXTURES / f"{name}.npz")
    ids = _ids(case)
    prompt = (ids[:phrase] * 3)[:repeat]                      # a repeated phrase: prompt lookup drafts from it
    greedy = SamplingParams(temperature=0.0)
    spec, plain = _runtime(case, logit_rows=4), _runtime(case)
    stats = SpecStats()
    got = generate_speculative(spec, prompt, 7, greedy, draft_tokens=3, stats=stats, stop_at_eos=False)
    want = generate(plain, prompt, 7, Sampler(greedy), stop_at_eos=False)
    assert got == want
    assert stats.drafted > 0 and stats.passes < 7 + 1 and stats.emitted >= 7
    # the cache holds the prompt and every new id but the last, as plain decoding leaves it
    assert spec.position == plain.position == len(prompt) + 6
    _same_cache(spec, 0, plain, f"{name} after speculative decoding")
    tile = min(spec.prefill_tokens, spec.image.logit_rows)
    with pytest.raises(ValueError, match=f"{tile} drafts make verify passes of {tile + 1} ids; a program runs at "
                                         f"most {tile}"):
        generate_speculative(spec, prompt, 2, greedy, draft_tokens=tile)


@pytest.mark.parametrize("argv, message", [
    (["--streams", "2"], "--streams and --speculate run on the NPU: --backend iss or kv260"),
    (["--speculate", "2"], "--streams and --speculate run on the NPU: --backend iss or kv260"),
    (["--backend", "iss", "--streams", "2", "--speculate", "2"], "--streams and --speculate do not combine"),
    (["--backend", "iss", "--streams", "0"], "argument --streams: must be an integer from 1 to 64, not '0'"),
    (["--backend", "iss", "--speculate", "-1"], "argument --speculate: must be an integer from 0 to 254, not '-1'"),
])
def test_generate_cli_rejects_bad_mode_options(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        generate_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_cli_needs_an_image_with_the_streams_and_rows(tmp_path, capsys):
    case = load_case(FIXTURES / "f64_s3_l5.npz")
    image = pack(ModelConfig.from_hf(case.config), case.tensors, HW["tiny"], max_positions=16,
                 out=tmp_path / "image.npy")
    save_image(image, tmp_path)
    base = ["--backend", "iss", "--arithmetic", "hardware", "--image", str(tmp_path), "--prompt-ids", "2,5"]
    assert generate_main(base + ["--streams", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"--streams 2: {tmp_path} holds KV caches for 1 stream(s); pack it with python -m firmware.pack --streams 2")
    assert generate_main(base + ["--speculate", "7"]) == 2
    assert "a verify pass needs 8; pack it with python -m firmware.pack --logit-rows 8" in capsys.readouterr().err
    # a run that fits: two greedy ids by speculative decoding on the image, as plain decoding gives them
    assert generate_main(base + ["--speculate", "2", "--max-new-tokens", "2", "--temperature", "0"]) == 0
    spec = capsys.readouterr().out.splitlines()[0]
    assert generate_main(base + ["--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == spec


def test_streams_beyond_the_kv260_map_are_a_clear_error():
    e4b, kv = ModelConfig.preset("e4b"), HW["kv260"]
    image = pack(e4b, None, kv, fill=False, memory_map="kv260", max_positions=4096, streams=2)   # two fit
    assert image.streams == 2
    with pytest.raises(ValueError, match=r"the KV cache takes 205,660,160; fewer max_positions or streams shrink"):
        pack(e4b, None, kv, fill=False, memory_map="kv260", max_positions=4096, streams=8)
