"""firmware.accuracy: the perplexity of the built-in trained model on held-out text in float64, float32, float64
with INT4 weights and the NPU's hardware arithmetic (ISS), reproduced here from the golden model with the bounds
written below; its command line; and the INT4-exact mode that isolates the weight rounding."""

import contextlib
import io
import json
import re
import math
import shutil

import numpy as np
import pytest

from firmware import accuracy
from firmware.accuracy import int4_exact
from firmware.generate import BUILTIN_MODEL
from firmware.pack import pack
from firmware.tokenizer import Tokenizer
from hdl.config import PRESETS as HW
from sim.checkpoint import write_checkpoint
from sim.config import PRESETS, TINY_HF_CONFIG
from sim.gemma3n import Model
from sim.numerics import dequantize_weights, quantize_weights, unpack_int4
from sim.random_weights import random_tensors

HELDOUT = f"{BUILTIN_MODEL}/heldout.txt"


def _run(argv, capsys):
    assert accuracy.main(argv) == 0
    return capsys.readouterr().out


def _bad(argv, capsys):
    """The one error line of `main(argv)`, which must exit with status 2 and no traceback."""
    with pytest.raises(SystemExit) as e:
        accuracy.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("python -m firmware.accuracy")]
    assert len(lines) == 1, err
    return lines[0]


def _json(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert accuracy.main(argv) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def first_64():
    """`python -m firmware.accuracy --max-tokens 64 --json`: the built-in model, its held-out text, kv260, the
    packer's default quantiser (the scale search)."""
    return _json(["--max-tokens", "64", "--json"])


@pytest.fixture(scope="module")
def first_64_rtn():
    """The same with round-to-nearest weights: ``--quantizer rtn``."""
    return _json(["--max-tokens", "64", "--json", "--quantizer", "rtn"])


def _golden_perplexity(tensors=None, tokens=64):
    """exp(mean NLL) of the held-out text's first `tokens` tokens on the golden model in float64 (the built-in model's
    weights, or `tensors`), each predicted from BOS and the tokens before it: a loop written out here, independent
    of `firmware.accuracy.score`."""
    with open(HELDOUT, encoding="utf-8") as f:
        ids = Tokenizer.from_file(f"{BUILTIN_MODEL}/tokenizer.model").encode(f.read())[:tokens + 1]
    if tensors is None:
        model = Model.from_pretrained(BUILTIN_MODEL, dtype=np.float64)
    else:
        from sim.checkpoint import Checkpoint
        model = Model.from_hf(Checkpoint(BUILTIN_MODEL).model_config, tensors, dtype=np.float64)
    nll = 0.0
    for t in range(tokens):
        logits = model.step(ids[t])
        z = logits - logits.max()
        nll -= z[ids[t + 1]] - math.log(np.sum(np.exp(z)))
    return math.exp(nll / tokens)


def test_float64_perplexity_is_the_golden_models(first_64):
    # Perplexity = exp(mean NLL) of the text's first 64 tokens, each predicted from BOS and the tokens before it.
    assert first_64["tokens"] == 64 and first_64["contexts"] == 1
    assert first_64["scores"]["float64"]["perplexity"] == pytest.approx(_golden_perplexity(), rel=1e-12)


def test_int4_perplexity_is_the_golden_models_on_quantised_weights(first_64, first_64_rtn):
    # the INT4 row: every matrix the packer stores as INT4 quantised here with sim.numerics.quantize_weights (each
    # method) and dequantised, the rest as in the checkpoint, scored by the loop above
    from sim.checkpoint import Checkpoint
    from sim.gemma3n import resolve_tensor_names
    ckpt = Checkpoint(BUILTIN_MODEL)
    plan = pack(ckpt.model_config, None, HW["kv260"], max_positions=1, fill=False)
    keys = resolve_tensor_names(ckpt.model_config, ckpt)
    for method, figures in (("search", first_64), ("rtn", first_64_rtn)):
        tensors = dict(ckpt)
        for name, e in plan.tensors.items():
            if e.format == "int4":
                w = np.asarray(ckpt[keys[name]], np.float64)
                tensors[keys[name]] = dequantize_weights(*quantize_weights(w, e.group, method), e.group)
        assert figures["scores"]["int4 weights"]["perplexity"] == pytest.approx(_golden_perplexity(tensors),
                                                                                 rel=1e-12), method


def test_the_figures_of_the_first_64_held_out_tokens(first_64):
    """The figures docs/numerics.md quotes for ``--max-tokens 64`` (kv260: group 128, block 128, INT8 KV cache, the
    scale search)."""
    s = first_64["scores"]
    assert first_64["hardware"] == {"preset": "kv260", "weight_group": 128, "act_block": 128, "kv_format": "int8",
                                    "kv_v_layout": "rows", "quantizer": "search"}
    assert s["float64"]["perplexity"] == pytest.approx(65.924, abs=1e-3)
    assert s["float32"]["ratio"] == pytest.approx(1.0, abs=1e-6) and s["float32"]["top1"] == 1.0
    assert s["float32"]["kl_mean"] < 1e-10
    assert s["int4 weights"]["perplexity"] == pytest.approx(68.027, abs=1e-3)
    assert s["hardware"]["perplexity"] == pytest.approx(68.475, abs=1e-3)
    # the target (docs/requirements.md N7): at most 5 % above float64
    assert s["hardware"]["ratio"] <= 1.05
    # the INT4 weights are almost all of the hardware's error: the rest adds under 0.01 nats of KL
    assert 0.84 <= s["hardware"]["top1"] and s["hardware"]["kl_mean"] <= 0.07
    assert s["hardware"]["top1"] >= s["int4 weights"]["top1"] - 1 / 64       # at most one token's arg-max apart
    assert s["hardware"]["kl_mean"] - s["int4 weights"]["kl_mean"] < 0.01
    # E4B with these numerics: the ISS's count (firmware.traffic) and the performance model (firmware.perf)
    e4b = {c["position"]: c for c in first_64["e4b"]}
    # the K planes once per KV head (its 4 query heads as the GEMV engine's four vectors): 6 fewer K reads of
    # 2 x 128 bytes and 2 x 4 binary16 scales per visible position than one per query head (35 layers x 129
    # positions at L = 128; 7 x 4,097 + 28 x 512 at 4,096); V as rows, read once per KV head: per visible
    # position 2 x 256 INT8 bytes and the 8 query heads' binary16 V scales instead of 8 x (2 x 128 + 2) bytes of
    # planes, per V chunk 2 tables of 256 binary16 row scales instead of 8 of 2 x 256; at 4,096 the sliding
    # layers' windows wrap past the end of their rings of 515 rows: a second V chunk
    seen = {128: 35 * 129, 4096: 7 * 4097 + 28 * 512}
    k_saved = {pos: 6 * n * 272 for pos, n in seen.items()}
    v_saved = {pos: n * (8 * 258 - 2 * 256 - 8 * 2) + chunks * (8 * 2 * 256 * 2 - 2 * 256 * 2)
               for (pos, n), chunks in zip(seen.items(), (35, 63))}
    # K's scales per activation block of 128 (kv260's act_block): per KV head and plane 2 binary16 scales instead
    # of the 4 of blocks of 64, read at every visible position and written once per cache layer (20)
    k_blocks = {pos: 2 * n * 2 * (4 - 2) * 2 + 20 * 2 * 2 * (4 - 2) * 2 for pos, n in seen.items()}
    assert e4b[128]["bytes_per_token"] == 2_014_095_952 - k_saved[128] - v_saved[128] - k_blocks[128]
    assert e4b[4096]["bytes_per_token"] == (2_177_335_952 - k_saved[4096] + 28 * 8 * 2 * 256 * 2 - v_saved[4096]
                                            - k_blocks[4096])
    assert e4b[128]["tok_s"] == pytest.approx(8.42, abs=0.01) and e4b[4096]["tok_s"] == pytest.approx(8.05, abs=0.01)


def test_round_to_nearest_figures(first_64, first_64_rtn):
    """``--quantizer rtn``: the same bytes per token, round-to-nearest's figures, and a third more KL than the
    search's."""
    s, rtn = first_64["scores"], first_64_rtn["scores"]
    assert first_64_rtn["hardware"]["quantizer"] == "rtn" and first_64_rtn["e4b"] == first_64["e4b"]
    assert rtn["float64"] == s["float64"]
    assert rtn["int4 weights"]["perplexity"] == pytest.approx(67.546, abs=1e-3)
    assert rtn["hardware"]["perplexity"] == pytest.approx(68.198, abs=1e-3)
    assert rtn["hardware"]["kl_mean"] > 1.3 * s["hardware"]["kl_mean"]
    assert rtn["int4 weights"]["kl_mean"] > 1.3 * s["int4 weights"]["kl_mean"]


def test_contexts_score_every_token_once():
    assert accuracy.contexts([5, 6, 7, 8, 9], bos=2, context=3) == [[2, 5, 6], [2, 7, 8], [2, 9]]
    assert accuracy.contexts([5], bos=2, context=512) == [[2, 5]]
    with pytest.raises(ValueError, match=r"^context must be an integer >= 2"):
        accuracy.contexts([5], bos=2, context=1)


def test_table_and_int4_exact_mode(capsys):
    # three contexts of at most 4 positions (3, 3 and 2 tokens); with every model on the INT4 values the weight rounding
    # costs nothing: the INT4 row is the float64 row, and the hardware row is the rest of the arithmetic alone
    out = _run(["--max-tokens", "8", "--context", "4", "--hw", "tiny", "--int4-exact"], capsys)
    lines = out.splitlines()
    assert lines[0] == ("gemma3n-tiny-pydoc, heldout.txt: 8 tokens scored in 3 contexts of at most 4 positions "
                        "(weights INT4-exact in every model)")
    assert lines[1] == "hardware tiny: weight group 32, activation block 16, KV cache int8, INT4 quantizer search"
    assert re.fullmatch(r"E4B with these numerics on kv260: 2,202\.4 MB per token and \d\.\d\d tok/s modelled at "
                        r"L = 128, 2,306\.7 MB per token and \d\.\d\d tok/s modelled at L = 4,096.*", lines[2])
    rows = {line[:14].strip(): line[14:].split() for line in lines[4:8]}
    assert list(rows) == list(accuracy.ARITHMETICS)
    assert rows["int4 weights"][:2] == rows["float64"][:2] == [rows["float64"][0], "1.0000"]
    assert float(rows["hardware"][3]) < 0.01
    assert lines[8].startswith("hardware / float64 per context: ") and len(lines) == 10
    assert lines[9].endswith("within the 5% target")


def test_own_text_and_overrides(tmp_path, capsys):
    text = tmp_path / "text.txt"
    sentence = "The \"if\" statement is used for conditional execution.\n"
    text.write_text(sentence, encoding="utf-8")
    n = len(Tokenizer.from_file(f"{BUILTIN_MODEL}/tokenizer.model").encode(sentence, add_bos=False))
    out = json.loads(_run(["--text", str(text), "--hw", "tiny", "--group", "64", "--block", "32",
                           "--kv-format", "fp16", "--json"], capsys))
    assert out["text"] == str(text) and out["tokens"] == n == 13 and out["contexts"] == 1
    assert out["hardware"] == {"preset": "tiny", "weight_group": 64, "act_block": 32, "kv_format": "fp16",
                               "kv_v_layout": "planes", "quantizer": "search"}
    assert out["e4b"][0]["bytes_per_token"] > 2_014_095_952     # group 64: more scales than kv260's 128


def test_bad_input(tmp_path, capsys):
    empty, latin, bare = tmp_path / "empty.txt", tmp_path / "latin.txt", tmp_path / "bare"
    empty.write_text("")
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    cases = [
        (["--text", str(tmp_path / "none.txt")], f"argument --text: {str(tmp_path / 'none.txt')!r} does not exist"),
        (["--text", str(tmp_path)], f"argument --text: {str(tmp_path)!r} is not a file"),
        (["--text", str(latin)], f"argument --text: {str(latin)!r} is not UTF-8 text (invalid continuation byte at "
                                 f"byte 3)"),
        (["--text", str(empty)], f"argument --text: {str(empty)!r} has no tokens to score"),
        (["--checkpoint", str(tmp_path / "none")], f"argument --checkpoint: {str(tmp_path / 'none')!r} is not a "
                                                   f"directory"),
        (["--checkpoint", str(bare)], f"argument --text: {str(bare)!r} has no heldout.txt; name the text to score"),
        (["--checkpoint", str(bare), "--text", HELDOUT], f"argument --checkpoint: {str(bare)!r} needs its "
                                                         f"tokenizer: tokenizer model"),
        (["--max-tokens", "0"], "argument --max-tokens: must be a positive integer, not '0'"),
        (["--context", "1"], "argument --context: must be an integer >= 2, not '1'"),
        (["--context", "513"], "argument --context: must be at most the model's 512 positions "
                               "(max_position_embeddings), not 513"),
        (["--hw", "zcu104"], "argument --hw: invalid choice: 'zcu104'"),
        (["--group", "3"], "argument --group: must be 0 or a power of two, not '3'"),
        (["--block", "1048576"], "argument --block: 1048576 does not fit hardware kv260: gemv_max_cols must be"),
        (["--model", "tiny", "--json"], "argument --json: not allowed with random-weight models (--model, --seeds, "
                                        "--steps)"),
        (["--steps", "4", "--max-tokens", "4"], "argument --max-tokens: not allowed with random-weight models"),
        (["--seeds", "0", "--text", HELDOUT], "argument --text: not allowed with random-weight models"),
        (["--steps", "4", "--by-topic"], "argument --by-topic: not allowed with random-weight models"),
        (["--quantizer", "gptq"], "argument --quantizer: invalid choice: 'gptq'"),
    ]
    for argv, message in cases:
        assert message in _bad(argv, capsys), argv


def test_a_tokenizer_beyond_the_models_vocabulary_is_one_line(tmp_path, capsys):
    # a random tiny model (320 ids) beside the built-in model's tokenizer (2,048 pieces)
    write_checkpoint(tmp_path, TINY_HF_CONFIG, random_tensors(PRESETS["tiny"], 0))
    shutil.copyfile(f"{BUILTIN_MODEL}/tokenizer.model", tmp_path / "tokenizer.model")
    line = _bad(["--checkpoint", str(tmp_path), "--text", HELDOUT, "--max-tokens", "4"], capsys)
    assert line.startswith(f"python -m firmware.accuracy: cannot score {HELDOUT!r} with {str(tmp_path)!r} on "
                           f"hardware kv260: token id "), line
    assert line.endswith("is outside the model's vocabulary [0, 320)"), line


def test_int4_exact_tensors_pack_without_rounding():
    cfg, hw = PRESETS["tiny"], HW["kv260"]
    exact = int4_exact(cfg, random_tensors(cfg, 1, dtype=np.float64), hw)
    image = pack(cfg, exact, hw)
    checked = 0
    for name, e in image.tensors.items():
        if e.format != "int4":
            continue
        rows, cols = e.shape
        raw = image.view("WEIGHTS", e.offset, e.nbytes)
        s = image.view("WEIGHTS", e.scale_offset, e.scale_nbytes).view("<f2")
        if e.layout == 0:
            q, s = unpack_int4(raw.reshape(rows, -1))[:, :cols], s.reshape(rows, -1)
        else:
            q, s = unpack_int4(raw.reshape(cols, rows // 2)).T, s.reshape(-1, rows).T
        np.testing.assert_array_equal(dequantize_weights(q, s, e.group), exact[name], err_msg=name)
        checked += 1
    assert checked > 10


def test_int4_exact_takes_checkpoint_names():
    from sim.checkpoint import Checkpoint
    ckpt = Checkpoint(BUILTIN_MODEL)
    exact = int4_exact(ckpt.model_config, ckpt, HW["kv260"])
    key = next(k for k in ckpt if k.endswith("layers.0.mlp.down_proj.weight"))
    assert key != "layers.0.mlp.down_proj.weight" and isinstance(exact[key], np.ndarray)
    assert not np.array_equal(exact[key], np.asarray(ckpt[key], np.float64))


def test_one_tensor_class_at_a_time():
    # the per-tensor study of docs/numerics.md: the golden model with one class of matrices rounded to INT4
    from sim.checkpoint import Checkpoint
    ckpt = Checkpoint(BUILTIN_MODEL)
    cfg = ckpt.model_config
    only = int4_exact(cfg, ckpt, HW["kv260"], only=lambda name: name.endswith("q_proj.weight"))
    changed = [k for k in ckpt if isinstance(only[k], np.ndarray)]
    assert len(changed) == cfg.num_hidden_layers and all(k.endswith("q_proj.weight") for k in changed)
    with open(HELDOUT, encoding="utf-8") as f:
        ids = Tokenizer.from_file(f"{BUILTIN_MODEL}/tokenizer.model").encode(f.read(), add_bos=False)[:12]
    result = accuracy.score({"float64": Model.from_hf(cfg, ckpt), "q_proj": Model.from_hf(cfg, only)}, ids,
                            cfg.bos_token_id, context=8)
    assert (result.tokens, result.contexts, [c["tokens"] for c in result.per_context]) == (12, 2, [7, 5])
    s = result.scores
    assert s["float64"].ratio == 1.0 and s["float64"].kl_mean == 0.0 and s["q_proj"].kl_mean > 0.0
    # the whole text's perplexity is the token-weighted geometric mean of the contexts'
    whole = math.exp(sum(c["tokens"] * math.log(c["q_proj"]) for c in result.per_context) / 12)
    assert s["q_proj"].perplexity == pytest.approx(whole, rel=1e-12)


# --- the held-out text topic by topic ---------------------------------------------------------------------------

TOPICS = ['The "assert" statement', "Binary bitwise operations", "Comparisons", 'The "if" statement',
          "Identifiers and keywords", "Numeric literals", "Slicings", 'Mapping Types — "dict"']


def test_split_topics():
    # heldout.txt is the eight held-out topics of pydoc_data.topics joined by newlines, each ending in one newline
    with open(HELDOUT, encoding="utf-8") as f:
        text = f.read()
    topics = accuracy.split_topics(text)
    assert [title for title, _ in topics] == TOPICS
    assert "\n".join(body for _, body in topics) == text
    assert all(body.startswith(f"{title}\n{'*' * len(title)}\n") and body.endswith("\n") and
               not body.endswith("\n\n") for title, body in topics)
    # text before the first title is a topic of its own; a text without titles is one topic; an underline of
    # another length or character is not a title
    assert accuracy.split_topics("intro\n\nA\n*\nbody\n") == [("", "intro\n"), ("A", "A\n*\nbody\n")]
    assert accuracy.split_topics("no titles\n") == [("", "no titles\n")]
    assert accuracy.split_topics("Title\n****\nx\n") == [("", "Title\n****\nx\n")]
    assert accuracy.split_topics("Title\n=====\nx\n") == [("", "Title\n=====\nx\n")]


def test_by_topic(capsys):
    # each topic scored alone, its first 3 tokens in contexts of at most 3 positions (2 contexts per topic)
    out = _run(["--by-topic", "--max-tokens", "3", "--context", "3", "--hw", "tiny"], capsys)
    lines = out.splitlines()
    assert lines[0] == ("gemma3n-tiny-pydoc, heldout.txt: 8 topics scored alone, 24 tokens scored in 16 contexts "
                        "of at most 3 positions")
    assert lines[1].endswith("INT4 quantizer search")
    assert lines[8].split() == ["topic", "tokens", "float64", "int4", "weights", "hardware", "int4", "/", "float64",
                                "hardware", "/", "float64"]
    rows = lines[9:17]
    assert [row[:len(title)] for row, title in zip(rows, TOPICS)] == TOPICS
    assert all(row[max(map(len, TOPICS)):].split()[0] == "3" for row in rows)
    assert lines[17].startswith("hardware / float64 per topic: ") and lines[17].endswith(" of 8 above 1.05)")
    assert lines[18].startswith("hardware / float64 per context: ") and lines[18].endswith(" of 16 above 1.05)")
    # --json: the whole (all topics) first, then each topic's figures; the whole is the topics combined
    out = json.loads(_run(["--by-topic", "--max-tokens", "3", "--context", "3", "--hw", "tiny", "--json"], capsys))
    assert [t["title"] for t in out["topics"]] == TOPICS and out["tokens"] == 24 and out["contexts"] == 16
    f64 = [t["scores"]["float64"]["perplexity"] for t in out["topics"]]
    assert out["scores"]["float64"]["perplexity"] == pytest.approx(math.exp(sum(map(math.log, f64)) / 8), rel=1e-12)
    whole = json.loads(_run(["--max-tokens", "3", "--context", "3", "--hw", "tiny", "--json"], capsys))
    assert whole["scores"] == out["topics"][0]["scores"]          # the first topic alone is the text's start


def test_combine():
    a = accuracy.Perplexity(2, 1, {"x": accuracy.Score(4.0, 1.0, 1.0, 0.0, 0.0),
                                   "y": accuracy.Score(8.0, 2.0, 0.5, 0.2, 1.0)}, [{"tokens": 2, "x": 4.0, "y": 8.0}])
    b = accuracy.Perplexity(1, 1, {"x": accuracy.Score(32.0, 1.0, 1.0, 0.0, 0.0),
                                   "y": accuracy.Score(32.0, 1.0, 1.0, 0.5, 3.0)}, [{"tokens": 1, "x": 32.0, "y": 32.0}])
    c = accuracy.Perplexity.combine([a, b])
    assert (c.tokens, c.contexts, len(c.per_context)) == (3, 2, 2)
    assert c.scores["x"].perplexity == pytest.approx(8.0) and c.scores["y"].perplexity == pytest.approx(2 ** (11 / 3))
    assert c.scores["y"].ratio == pytest.approx(2 ** (2 / 3)) and c.scores["y"].top1 == pytest.approx(2 / 3)
    assert c.scores["y"].kl_mean == pytest.approx(0.3) and c.scores["y"].max_abs == 3.0
