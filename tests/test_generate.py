"""The generation loop, the tokenizer wrapper and the ``python -m firmware.generate`` command line.

`generate` is driven by small deterministic fake backends whose logits are built so that the expected
ids follow from the construction; the CLI runs once more end to end on the built-in model (a tiny Gemma 3n
trained on the Python documentation, ``firmware/models/gemma3n-tiny-pydoc``).
"""

import io
import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import sentencepiece

import firmware.generate as fg
from firmware.generate import BUILTIN_MODEL, generate, main
from firmware.sampling import Sampler, SamplingParams
from firmware.tokenizer import Tokenizer
from sim.config import ModelConfig

GREEDY = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.0))

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A field programmable gate array runs the neural network.",
    "Gemma is a family of small open language models.",
    "Sampling picks the next token from a probability distribution.",
    "Hello world, this is a tiny corpus for a test tokenizer.",
    "The cat sat on the mat and the dog sat on the log.",
]


class CountingModel:
    """A backend whose logits after token t have their unique maximum at (t + 1) % vocab, so greedy
    decoding counts upwards. Records every reset and every fed token."""

    def __init__(self, vocab_size=8, *, eos=1, bos=2, max_positions=512):
        self.config = SimpleNamespace(vocab_size=vocab_size, eos_token_id=eos, bos_token_id=bos,
                                      max_position_embeddings=max_positions)
        self.fed = []
        self.resets = 0

    def reset(self):
        self.fed = []
        self.resets += 1

    def step(self, token_id):
        self.fed.append(token_id)
        logits = np.zeros(self.config.vocab_size)
        logits[(token_id + 1) % self.config.vocab_size] = 10.0
        return logits


class FixedLogitsModel:
    """A backend without `config` that always returns the same logits."""

    def __init__(self, logits):
        self.logits = np.asarray(logits, dtype=np.float64)

    def reset(self):
        pass

    def step(self, token_id):
        return self.logits.copy()


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    # A ~100-piece model trained here with Gemma's special ids (pad 0, EOS 1, BOS 2, unk 3), so no
    # tokenizer file is committed and the test does not depend on a download.
    prefix = tmp_path_factory.mktemp("tokenizer") / "tok"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES * 4), model_prefix=str(prefix), vocab_size=100, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, character_coverage=1.0, hard_vocab_limit=False,
        minloglevel=2)
    return prefix.with_suffix(".model")


# --- generate() -------------------------------------------------------------------------------------


def test_greedy_counts_and_stops_at_eos():
    model = CountingModel()
    # From 5 the argmax chain is 6, 7, 0, 1; 1 is EOS, which ends generation and is returned.
    assert generate(model, [5], 10, GREEDY) == [6, 7, 0, 1]
    # The prompt and every new token but the last were fed, after one reset.
    assert model.fed == [5, 6, 7, 0]
    assert model.resets == 1


def test_prompt_is_fed_token_by_token():
    model = CountingModel()
    assert generate(model, [2, 4, 3], 3, GREEDY) == [4, 5, 6]
    assert model.fed == [2, 4, 3, 4, 5]


def test_ignoring_eos_runs_to_max_new_tokens():
    model = CountingModel()
    assert generate(model, [5], 10, GREEDY, stop_at_eos=False) == [6, 7, 0, 1, 2, 3, 4, 5, 6, 7]


def test_explicit_eos_id_overrides_config():
    assert generate(CountingModel(), [5], 10, GREEDY, eos_id=0) == [6, 7, 0]


def test_without_config_there_is_no_eos_and_no_vocab_check():
    assert generate(FixedLogitsModel([0.0, 5.0]), [0], 3, GREEDY) == [1, 1, 1]


def test_zero_new_tokens_does_nothing():
    model = CountingModel()
    assert generate(model, [5], 0, GREEDY) == []
    assert model.fed == []


def test_sampler_sees_prompt_and_generated_as_context():
    # Logits favour id 2 (2.0) over id 3 (1.9). With 2 in the prompt the repetition penalty makes it
    # 2/1.15 = 1.739 < 1.9, so 3 is chosen; then both are in the context (1.739 vs 1.9/1.15 = 1.652)
    # and 2 wins again.
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.15))
    assert generate(FixedLogitsModel([0.0, 0.0, 2.0, 1.9]), [0], 1, sampler) == [2]
    assert generate(FixedLogitsModel([0.0, 0.0, 2.0, 1.9]), [2], 2, sampler) == [3, 2]


def test_sampler_receives_the_full_context():
    seen = []

    def recording_sampler(logits, context_ids):
        seen.append(list(context_ids))
        return GREEDY(logits, context_ids)

    generate(CountingModel(), [2, 3], 3, recording_sampler)
    assert seen == [[2, 3], [2, 3, 4], [2, 3, 4, 5]]


def test_progress_once_per_new_token():
    calls = []
    generate(CountingModel(), [2], 4, GREEDY, progress=lambda *a: calls.append(a))
    assert [(done, total) for done, total, _ in calls] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    elapsed = [e for _, _, e in calls]
    assert all(e >= 0 for e in elapsed) and elapsed == sorted(elapsed)


def test_progress_stops_with_eos():
    calls = []
    generate(CountingModel(), [6], 10, GREEDY, progress=lambda *a: calls.append(a))
    assert [done for done, _, _ in calls] == [1, 2, 3]  # 7, 0, 1 (EOS)


def test_generate_errors():
    with pytest.raises(ValueError, match=r"^prompt_ids must contain at least one token"):
        generate(CountingModel(), [], 4, GREEDY)
    with pytest.raises(ValueError, match=r"^prompt id 8 is outside the model's vocabulary \[0, 8\)$"):
        generate(CountingModel(), [2, 8], 4, GREEDY)
    with pytest.raises(ValueError, match=r"^max_new_tokens must be >= 0, not -1$"):
        generate(CountingModel(), [2], -1, GREEDY)
    with pytest.raises(TypeError, match=r"^max_new_tokens must be an integer, not 2\.0$"):
        generate(CountingModel(), [2], 2.0, GREEDY)


# --- Tokenizer --------------------------------------------------------------------------------------


def test_tokenizer_round_trip(tokenizer_path):
    tok = Tokenizer.from_file(tokenizer_path)
    # The special ids come from the model file, here trained with Gemma's numbering.
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (2, 1, 100)
    text = "The quick brown dog sat on the mat."
    ids = tok.encode(text)
    assert ids[0] == 2 and len(ids) > 2
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert ids[1:] == tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text  # BOS is a control piece and decodes to nothing
    assert tok.decode(ids + [tok.eos_id]) == text


def test_tokenizer_errors(tokenizer_path, tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match=re.escape(f"tokenizer model {str(missing)!r} does not exist")):
        Tokenizer.from_file(missing)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a protobuf")
    with pytest.raises(ValueError, match=re.escape(f"tokenizer model {str(garbage)!r} is not a valid "
                                                   f"SentencePiece model")):
        Tokenizer.from_file(garbage)
    tok = Tokenizer.from_file(tokenizer_path)
    with pytest.raises(ValueError, match=r"^token id 100 is outside the tokenizer vocabulary \[0, 100\)$"):
        tok.decode([5, 100])
    with pytest.raises(TypeError, match=r"^text must be a str, not 5$"):
        tok.encode(5)
    with pytest.raises(TypeError, match=r"^processor must be a sentencepiece\.SentencePieceProcessor"):
        Tokenizer("tokenizer.model")


# --- command line, on a fake backend ----------------------------------------------------------------


@pytest.fixture
def fake_model(monkeypatch):
    """Replace the golden model loader by a CountingModel; the test sets its size via `.vocab`."""
    holder = SimpleNamespace(vocab=8, model=None, calls=[])

    def load(checkpoint, *, dtype, **backend):
        holder.calls.append((checkpoint, dtype))
        holder.model = CountingModel(holder.vocab)
        return holder.model

    monkeypatch.setattr(fg, "load_model", load)
    return holder


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_cli_greedy_ids(fake_model, capsys):
    code, out, err = run(["--temperature", "0", "--prompt-ids", "5", "--max-new-tokens", "6"], capsys)
    assert code == 0
    assert out[0] == "6 7 0 1"  # stops at the fake's EOS (1)
    # The built-in model's tokenizer decodes the ids (control ids 0..3 decode to nothing).
    assert out[1:] == [builtin_tokenizer().decode([6, 7, 0, 1])] and len(out) == 2
    assert fake_model.calls == [(None, np.float32)]
    lines = err.splitlines()
    # Not a terminal: one plain progress line per token, then the summary.
    assert [line.split("]")[0] for line in lines[:4]] == ["[  1/6", "[  2/6", "[  3/6", "[  4/6"]
    assert all(line.endswith(" tok/s") for line in lines[:4])
    assert re.fullmatch(r"generated 4 tokens after a 1-token prompt in \d+\.\d\d s \(.* tok/s\)", lines[4])
    assert len(lines) == 5


def test_cli_defaults(fake_model, capsys):
    # Default prompt [BOS = 2], 32 new tokens, sampling at T = 1, top-p 0.9. The fake's favourite
    # (logit 10, never yet in the context) has probability e^10 / (e^10 + 7) = 0.9997 > 0.9, so the
    # nucleus is that one token and the sampled run is deterministic: 3, 4, 5, 6, 7, 0, then EOS (1).
    code, out, _ = run([], capsys)
    assert code == 0
    assert fake_model.model.fed[0] == 2
    assert out[0] == "3 4 5 6 7 0 1"


def test_cli_ignore_eos_and_options(fake_model, capsys):
    code, out, _ = run(["--temperature", "0", "--prompt-ids", "2, 3", "--max-new-tokens", "10", "--ignore-eos",
                        "--dtype", "float64"], capsys)
    assert code == 0
    assert out[0] == "4 5 6 7 0 1 2 3 4 5"
    assert fake_model.model.fed[:2] == [2, 3]
    assert fake_model.calls == [(None, np.float64)]


def test_cli_progress_on_a_terminal(fake_model, capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["--temperature", "0", "--prompt-ids", "2", "--max-new-tokens", "3"]) == 0
    text = term.getvalue()
    # Three in-place updates (carriage return, no newline), then one newline and the summary.
    assert text.count("\r") == 3
    assert text.split("\n")[0].startswith("\r[  1/3]")
    assert text.split("\n")[1].startswith("generated 3 tokens")


def test_cli_prompt_text_with_tokenizer(fake_model, tokenizer_path, capsys):
    fake_model.vocab = 100  # the same size as the test tokenizer, so every id decodes
    tok = Tokenizer.from_file(tokenizer_path)
    prompt = "The lazy dog"
    code, out, _ = run(["--tokenizer", str(tokenizer_path), "--prompt", prompt, "--temperature", "0",
                        "--max-new-tokens", "3"], capsys)
    assert code == 0
    prompt_ids = tok.encode(prompt)
    assert prompt_ids[0] == 2
    last = prompt_ids[-1]
    new = [(last + k) % 100 for k in (1, 2, 3)]
    # The model saw BOS + the encoded text, then counted upwards from its last id.
    assert fake_model.model.fed == prompt_ids + new[:2]
    assert out == [" ".join(map(str, new)), tok.decode(new)]


def test_cli_ids_beyond_the_tokenizer_are_marked(fake_model, tokenizer_path, capsys):
    # A model vocabulary can be larger than the tokenizer's (E4B: 262400 rows, 262144 pieces).
    fake_model.vocab = 120
    tok = Tokenizer.from_file(tokenizer_path)
    code, out, _ = run(["--tokenizer", str(tokenizer_path), "--prompt-ids", "97", "--temperature", "0",
                        "--max-new-tokens", "4"], capsys)
    assert code == 0
    assert out == ["98 99 100 101", tok.decode([98, 99]) + "<id 100><id 101>"]


def test_cli_checkpoint_tokenizer_is_found(fake_model, tokenizer_path, tmp_path, capsys):
    fake_model.vocab = 100
    (tmp_path / "tokenizer.model").write_bytes(tokenizer_path.read_bytes())
    code, out, _ = run(["--checkpoint", str(tmp_path), "--prompt", "Hello", "--max-new-tokens", "2",
                        "--temperature", "0"], capsys)
    assert code == 0
    assert fake_model.calls == [(str(tmp_path), np.float32)]
    assert len(out) == 2  # ids and text: the tokenizer came from the checkpoint directory


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "0"], r"argument --top-p: must be a number in \(0, 1\], not '0'"),
    (["--top-p", "x"], r"argument --top-p: must be a number in \(0, 1\], not 'x'"),
    (["--temperature", "-1"], r"argument --temperature: must be a finite number >= 0, not '-1'"),
    (["--temperature", "inf"], r"argument --temperature: must be a finite number >= 0, not 'inf'"),
    (["--repetition-penalty", "0"], r"argument --repetition-penalty: must be a finite number > 0, not '0'"),
    (["--max-new-tokens", "0"], r"argument --max-new-tokens: must be a positive integer, not '0'"),
    (["--seed", "-3"], r"argument --seed: must be an integer >= 0, not '-3'"),
    (["--dtype", "float16"], r"argument --dtype: invalid choice: 'float16'"),
    (["--prompt-ids", "2,x"], r"argument --prompt-ids: must be comma-separated token ids"),
    (["--prompt-ids", "2,-1"], r"argument --prompt-ids: token ids must be >= 0, not -1"),
    (["--prompt-ids", "2", "--prompt", "hi"], r"argument --prompt: not allowed with argument --prompt-ids"),
    (["--checkpoint", os.path.dirname(__file__), "--prompt", "hi"],  # a directory without tokenizer.model
     r"--prompt needs a tokenizer: pass --tokenizer PATH"),
    (["--prompt-ids", "2,8"], r"prompt id 8 is outside the model's vocabulary \[0, 8\)"),
    (["--max-new-tokens", "513"], r"a 1-token prompt plus --max-new-tokens 513 needs more than the "
                                  r"model's 512 positions"),
    (["--checkpoint", "/nonexistent/dir"], r"--checkpoint '/nonexistent/dir' is not a directory"),
    (["--tokenizer", "/nonexistent/tokenizer.model"],
     r"--tokenizer: tokenizer model '/nonexistent/tokenizer\.model' does not exist"),
])
def test_cli_bad_options(fake_model, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_bad_checkpoint_directory(tmp_path, capsys):
    # The real loader on an empty directory: an argparse error naming the directory, not a traceback.
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(tmp_path)])
    assert exc.value.code == 2
    assert f"cannot load --checkpoint {str(tmp_path)!r}" in capsys.readouterr().err


# --- command line, on the built-in model -------------------------------------------------------------


def builtin_tokenizer():
    return Tokenizer.from_file(os.path.join(BUILTIN_MODEL, "tokenizer.model"))


def test_cli_builtin_model_greedy_matches_a_plain_argmax_loop(capsys):
    from sim.gemma3n import Model

    code, out, err = run(["--temperature", "0", "--repetition-penalty", "1", "--max-new-tokens", "6",
                          "--ignore-eos", "--prompt", "The Python"], capsys)
    assert code == 0
    ids = [int(i) for i in out[0].split()]
    # Greedy without penalty is argmax feeding back argmax, after BOS and the prompt's pieces.
    model = Model.from_pretrained(BUILTIN_MODEL, dtype=np.float32)
    tok = builtin_tokenizer()
    for token in tok.encode("The Python"):
        logits = model.step(token)
    expected = []
    for _ in range(6):
        token = int(np.argmax(logits))
        expected.append(token)
        logits = model.step(token)
    assert ids == expected
    assert "\n".join(out[1:]) == tok.decode(ids)
    assert f"generated 6 tokens after a {len(tok.encode('The Python'))}-token prompt" in err


def test_cli_builtin_model_sampling_is_seeded(capsys):
    argv = ["--max-new-tokens", "5", "--ignore-eos", "--prompt", "A class"]
    _, first, _ = run(argv + ["--seed", "1"], capsys)
    _, again, _ = run(argv + ["--seed", "1"], capsys)
    assert first == again
    ids = [int(i) for i in first[0].split()]
    assert len(ids) == 5 and all(0 <= i < builtin_tokenizer().vocab_size for i in ids)
    assert "\n".join(first[1:]) == builtin_tokenizer().decode(ids)  # ids, then their text


def test_builtin_model_and_tokenizer():
    # The built-in checkpoint: the tokenizer has Gemma's special ids and covers the model's vocabulary, the
    # text round-trips (newlines and runs of spaces are pieces), and the config is the trained model's.
    tok = builtin_tokenizer()
    cfg = ModelConfig.from_json_file(os.path.join(BUILTIN_MODEL, "config.json"))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (cfg.bos_token_id, cfg.eos_token_id, cfg.vocab_size) \
        == (2, 1, 2048)
    text = 'The "for" statement:\n\n   for i in range(10):\n       print(i)\n'
    assert tok.decode(tok.encode(text)) == text and tok.encode(text)[0] == 2
    assert cfg.sparse_layers and cfg.num_kv_shared_layers and len(set(cfg.layer_types)) == 2


def test_cli_default_run_prints_english(capsys):
    # The README's demo: the built-in model, greedy from a prompt, prints words of its training text.
    code, out, _ = run(["--prompt", "The Python", "--temperature", "0", "--max-new-tokens", "24"], capsys)
    assert code == 0
    ids = [int(t) for t in out[0].split()]
    text = "\n".join(out[1:])  # the text may hold newlines
    assert text == fg._decode(builtin_tokenizer(), ids)
    words = re.findall(r"[a-z]+", text)
    assert len(words) >= 8 and sum(w in COMMON_WORDS for w in words) >= 4, text


COMMON_WORDS = {"the", "a", "an", "is", "of", "to", "and", "in", "be", "are", "that", "for", "as", "it", "with",
                "object", "objects", "function", "value", "type", "name", "method", "class", "statement"}


def test_cli_iss_backend_generates_what_the_golden_model_generates(capsys):
    # The same host code drives the golden model and the NPU's token program (ISS, reference arithmetic).
    argv = ["--max-new-tokens", "6", "--temperature", "0", "--ignore-eos"]
    _, golden, _ = run(argv, capsys)
    _, iss, _ = run(argv + ["--backend", "iss", "--hw", "tiny"], capsys)
    assert golden == iss
    code, hw_out, _ = run(argv + ["--backend", "iss", "--arithmetic", "hardware", "--hw", "tiny"], capsys)
    assert code == 0 and len(hw_out[0].split()) == 6


def test_cli_quantizer_packs_the_iss_image_with_it(capsys):
    # --quantizer rtn: the ISS in hardware arithmetic runs the round-to-nearest image, whose greedy ids are
    # those of a Runtime packed with quantizer="rtn" (the search's image gives other logits)
    from firmware.runtime import Runtime
    from sim.checkpoint import Checkpoint
    from sim.numerics import WEIGHT_METHODS
    assert fg.QUANTIZERS == WEIGHT_METHODS
    code, out, _ = run(["--backend", "iss", "--arithmetic", "hardware", "--hw", "tiny", "--quantizer", "rtn",
                        "--max-new-tokens", "3", "--temperature", "0", "--repetition-penalty", "1"], capsys)
    assert code == 0
    ckpt = Checkpoint(BUILTIN_MODEL)
    runtimes = {q: Runtime.from_hf(ckpt.model_config, ckpt, arithmetic="hardware", hw="tiny", quantizer=q)
                for q in WEIGHT_METHODS}
    assert runtimes["rtn"].image.quantizer == "rtn"
    logits = {q: rt.step(ckpt.model_config.bos_token_id) for q, rt in runtimes.items()}
    assert not np.array_equal(logits["rtn"], logits["search"])
    new = []
    for _ in range(3):
        new.append(int(np.argmax(logits["rtn"])))
        logits["rtn"] = runtimes["rtn"].step(new[-1])
    assert out[0].split() == [str(i) for i in new]


@pytest.mark.parametrize("argv", [["--quantizer", "rtn"], ["--backend", "iss", "--quantizer", "rtn"]])
def test_cli_quantizer_needs_int4_weights(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--quantizer applies to the NPU's INT4 weights: --backend iss --arithmetic hardware, or --backend kv260")


def test_cli_iss_options_need_the_iss_backend(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--arithmetic", "hardware"])
    assert e.value.code == 2
    assert "--arithmetic and --hw apply to --backend iss only" in capsys.readouterr().err
