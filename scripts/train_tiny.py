#!/usr/bin/env python3
"""Train the built-in tiny Gemma 3n (``firmware/models/gemma3n-tiny-pydoc``) on the Python documentation.

What it makes
-------------
A Hugging Face checkpoint directory of ``Gemma3nForCausalLM`` with every structural feature of Gemma 3n on
(4 AltUp streams, LAuReL, per-layer embeddings, QK- and V-norm, sliding and full attention with two RoPE
thetas, KV sharing for both layer types, Gaussian top-k sparsity in the first two layers, the final logit
soft-cap, tied embeddings), sized for the NPU's ``tiny`` hardware preset (hidden size 128 = its
``gemv_sparse_max_rows``, FFN 512 <= its ``gemv_max_cols``, heads of 32), and a SentencePiece tokenizer trained
on the same text. ``OUT`` receives:

  config.json, model.safetensors   the model (bf16, as the released Gemma 3n checkpoints)
  tokenizer.model                  SentencePiece BPE, pad 0 / EOS 1 / BOS 2 / unk 3 as Gemma, "\\n" a piece
  training.csv                     step, mean training loss since the last row, held-out loss (nats per
                                   token and per byte), seconds
  heldout.txt                      the held-out text (never trained on), for perplexity measurements

The text
--------
``pydoc_data.topics`` (the documentation of Python's statements, types and operators that ships with
every Python; 79 topics, 465 KB in Python 3.11.7). Topics are taken in sorted order of their names; every
tenth one (positions 0, 10, ..., 70: 8 topics, 32 KB) is held out, the other 71 are the training text. Prose
paragraphs are re-joined into one line each (the documentation wraps them at 72 columns); code, grammar,
lists and headings keep their lines. A document is BOS + its pieces + EOS; a training sequence is BOS
followed by ``--seq - 1`` consecutive pieces of the training stream from a random offset, so position 0
always holds BOS, as in generation. The text differs between Python versions: the script prints its
SHA-256 and says when it is not the one the committed model was trained on.

Reproducibility
---------------
Everything random is seeded from ``--seed`` (torch's initialisation, the batch offsets, SentencePiece).
A run on the same versions (torch 2.13.0+cpu, transformers 5.23.0, sentencepiece 0.2.3, numpy 2.4.6, Python
3.11.7) and the same ``--threads`` writes the same weights and tokenizer (two runs: bit-identical). torch and
transformers are not dependencies of the project: run the script in a throwaway virtual environment, outside
the repository::

    python3 -m venv /tmp/trainenv
    /tmp/trainenv/bin/pip install torch==2.13.0 transformers==5.23.0 sentencepiece==0.2.3 numpy==2.4.6 \\
        safetensors==0.8.0
    /tmp/trainenv/bin/python scripts/train_tiny.py firmware/models/gemma3n-tiny-pydoc

(the defaults are the committed model's settings; firmware/models/gemma3n-tiny-pydoc/README.md has the run).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository: firmware.cli's argument types
from firmware.cli import NON_NEGATIVE, POSITIVE, arg_type  # noqa: E402

# SHA-256 of the training text (UTF-8) the committed model was trained on: Python 3.11.7's pydoc_data.topics.
COMMITTED_TEXT_SHA256 = "9dd906bd8b2a5a6db7e49d99251eabbf5e5d06679264fd98cbf0b425ad09be62"

HELD_OUT_EVERY = 10  # every tenth topic in sorted order (positions 0, 10, ...) is held out


LEARNING_RATE = arg_type("a number in (0, 1)", float, lambda v: 0 < v < 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/train_tiny.py",
        description="Train a tiny Gemma 3n (every feature on) and its SentencePiece tokenizer on pydoc_data.topics; "
                    "write a Hugging Face checkpoint directory. Needs torch and transformers (module docstring).")
    p.add_argument("out", metavar="OUT", help="output directory (created; files in it are overwritten)")
    p.add_argument("--seed", type=NON_NEGATIVE, default=0, help="seed of everything random (default: 0)")
    p.add_argument("--steps", type=POSITIVE, default=600, help="optimiser steps (default: 600)")
    p.add_argument("--batch", type=POSITIVE, default=8, help="sequences per step (default: 8)")
    p.add_argument("--seq", type=arg_type("an integer in [2, 512]", int, lambda v: 2 <= v <= 512), default=256,
                   help="tokens per sequence, BOS included (default: 256)")
    p.add_argument("--vocab", type=arg_type("an integer in [256, 32768]", int, lambda v: 256 <= v <= 32768),
                   default=2048, help="SentencePiece vocabulary size (default: 2048)")
    p.add_argument("--lr", type=LEARNING_RATE, default=2e-3, help="peak AdamW learning rate (default: 2e-3)")
    p.add_argument("--warmup", type=NON_NEGATIVE, default=50, help="linear warm-up steps (default: 50)")
    p.add_argument("--eval-every", type=POSITIVE, default=50,
                   help="steps between held-out evaluations and training.csv rows (default: 50)")
    # One thread: on a machine whose cores are busy with other work, two OpenMP threads spin-wait for each
    # other and a step takes 20 times longer (measured: 0.8 s -> 21 s).
    p.add_argument("--threads", type=POSITIVE, default=1, help="torch CPU threads (default: 1)")
    return p


# --- the text ---------------------------------------------------------------------------------------


def _is_underline(line: str) -> bool:
    return len(line) >= 3 and set(line) <= set("*=-^~#")


def reflow(text: str) -> str:
    """Join the hard-wrapped lines of prose paragraphs; keep code, lists, tables and headings as they are."""
    out, para = [], []

    def flush():
        if para:
            prose = not any(line[:1].isspace() or _is_underline(line) for line in para)
            out.append(" ".join(para) if prose else "\n".join(para))
            para.clear()

    for line in text.rstrip("\n").split("\n"):
        line = line.rstrip()
        if line:
            para.append(line)
        else:
            flush()
            out.append("")
    flush()
    return "\n".join(out).strip("\n") + "\n"


def split_topics() -> tuple[list[str], list[str], list[str]]:
    """(training documents, held-out documents, held-out topic names)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [reflow(topics[n]) for i, n in enumerate(names) if i % HELD_OUT_EVERY]
    held = [n for i, n in enumerate(names) if not i % HELD_OUT_EVERY]
    return train, [reflow(topics[n]) for n in held], held


def train_tokenizer(docs: list[str], vocab: int, seed: int) -> bytes:
    """A SentencePiece BPE model (bytes): Gemma's special ids, text kept as is (identity normalisation, no
    dummy prefix, runs of spaces as pieces), "\\n" a piece of its own."""
    import sentencepiece

    lines = [line for doc in docs for line in doc.split("\n") if line]
    buf = io.BytesIO()
    sentencepiece.set_random_generator_seed(seed)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=["\n"], character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=False,
        max_sentence_length=1 << 16, num_threads=1, minloglevel=2)
    return buf.getvalue()


# --- the model --------------------------------------------------------------------------------------


def model_config(vocab: int):
    from transformers import Gemma3nTextConfig

    S, F = "sliding_attention", "full_attention"
    layer_types = [S, S, F, S, S, F]  # the last two share KV: layer 4 reads layer 3's, layer 5 layer 2's
    n = len(layer_types)
    return Gemma3nTextConfig(
        vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=128, intermediate_size=[512] * n,
        num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        hidden_size_per_layer_input=16, laurel_rank=16, altup_num_inputs=4, altup_active_idx=0,
        altup_correct_scale=True, altup_coef_clip=120.0, num_kv_shared_layers=2, layer_types=layer_types,
        activation_sparsity_pattern=[0.95, 0.95] + [0.0] * (n - 2), sliding_window=64,
        rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                         F: {"rope_type": "default", "rope_theta": 1_000_000.0}},
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False, attention_dropout=0.0,
        pad_token_id=0, eos_token_id=1, bos_token_id=2)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import numpy as np
        import sentencepiece
        import torch
        import transformers
        from transformers import Gemma3nForCausalLM
    except ImportError as e:
        sys.exit(f"scripts/train_tiny.py: needs torch, transformers, sentencepiece and numpy ({e}); run it in the "
                 f"throwaway environment its docstring describes (pip install torch==2.13.0 transformers==5.23.0 "
                 f"sentencepiece==0.2.3 numpy==2.4.6 safetensors==0.8.0)")

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)

    train_docs, held_docs, held_names = split_topics()
    train_text = "".join(train_docs)
    digest = hashlib.sha256(train_text.encode()).hexdigest()
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"sentencepiece {sentencepiece.__version__}, numpy {np.__version__}; {args.threads} threads")
    print(f"text: {len(train_docs)} training topics ({len(train_text.encode()):,} bytes, sha256 {digest[:16]}...), "
          f"{len(held_docs)} held out ({sum(len(d.encode()) for d in held_docs):,} bytes: {', '.join(held_names)})")
    if digest != COMMITTED_TEXT_SHA256:
        print("note: this Python's pydoc_data.topics is not the text the committed model was trained on "
              "(Python 3.11.7); the result will differ")

    sp_proto = train_tokenizer(train_docs, args.vocab, args.seed)
    sp = sentencepiece.SentencePieceProcessor(model_proto=sp_proto)
    bos, eos = sp.bos_id(), sp.eos_id()

    def stream(docs):
        ids = []
        for doc in docs:
            ids += sp.encode(doc) + [eos]
        return np.array(ids, dtype=np.int64)

    train_ids, held_ids = stream(train_docs), stream(held_docs)
    print(f"tokenizer: {sp.vocab_size()} pieces; {len(train_ids):,} training tokens "
          f"({len(train_text.encode()) / len(train_ids):.2f} bytes each), {len(held_ids):,} held-out tokens")

    cfg = model_config(sp.vocab_size())
    cfg._attn_implementation = "sdpa"
    model = Gemma3nForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, layers {cfg.layer_types}, KV sharing {cfg.kv_sharing_modes}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step):  # linear warm-up, then cosine decay to a tenth of the peak
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    span = args.seq - 1

    def batch():
        offsets = rng.integers(0, len(train_ids) - span, size=args.batch)
        body = np.stack([train_ids[o:o + span] for o in offsets])
        return torch.from_numpy(np.concatenate([np.full((args.batch, 1), bos), body], axis=1))

    def loss_of(ids):
        logits = model(input_ids=ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1))

    def held_out_loss():
        """Mean loss per token over the held-out stream, in consecutive BOS-prefixed chunks of --seq tokens."""
        model.eval()
        chunks = [held_ids[i:i + span] for i in range(0, len(held_ids) - 1, span)]
        total, count = 0.0, 0
        with torch.no_grad():
            for k in range(0, len(chunks), args.batch):
                group = [c for c in chunks[k:k + args.batch]]
                width = max(len(c) for c in group)
                ids = np.full((len(group), width + 1), sp.pad_id(), dtype=np.int64)
                ids[:, 0] = bos
                for j, c in enumerate(group):
                    ids[j, 1:1 + len(c)] = c
                ids = torch.from_numpy(ids)
                logits = model(input_ids=ids, use_cache=False).logits
                mask = torch.zeros(ids.shape, dtype=torch.bool)
                for j, c in enumerate(group):
                    mask[j, 1:1 + len(c)] = True
                nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                        ids[:, 1:].reshape(-1), reduction="none")
                total += float(nll[mask[:, 1:].reshape(-1)].sum())
                count += int(mask[:, 1:].sum())
        model.train()
        return total / count

    def sample(prompt="The Python ", n=48):
        model.eval()
        ids = [bos] + sp.encode(prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        model.train()
        return prompt + sp.decode(out[0, len(ids):].tolist())

    os.makedirs(args.out, exist_ok=True)
    held_bytes = sum(len(d.encode()) for d in held_docs)
    per_byte = len(held_ids) / held_bytes  # nats per token -> nats per byte
    rows = [("step", "train_loss", "heldout_loss", "heldout_nats_per_byte", "seconds")]
    first = held_out_loss()
    rows.append((0, "", f"{first:.4f}", f"{first * per_byte:.4f}", "0"))
    print(f"step     0: held-out {first:.4f}")
    model.train()
    t0, running = time.perf_counter(), []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = loss_of(batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            held = held_out_loss()
            train_loss = sum(running) / len(running)
            seconds = time.perf_counter() - t0
            rows.append((step + 1, f"{train_loss:.4f}", f"{held:.4f}", f"{held * per_byte:.4f}", f"{seconds:.0f}"))
            print(f"step {step + 1:5d}: train {train_loss:.4f}, held-out {held:.4f} nats/token ({seconds:.0f} s)",
                  flush=True)
            running = []
    train_seconds = time.perf_counter() - t0

    # Stored as bf16, as the released checkpoints; the final figures are those of the stored weights.
    model = model.to(torch.bfloat16).to(torch.float32)
    held = held_out_loss()
    print(f"bf16 weights: held-out {held:.4f} nats/token = {held * per_byte:.4f} nats/byte, "
          f"perplexity {math.exp(held):.2f}")
    print(f"greedy: {sample()!r}")
    model.to(torch.bfloat16).save_pretrained(args.out)
    gen_cfg = os.path.join(args.out, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    with open(os.path.join(args.out, "tokenizer.model"), "wb") as f:
        f.write(sp_proto)
    with open(os.path.join(args.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(held_docs))
    with open(os.path.join(args.out, "training.csv"), "w", newline="") as f:
        csv.writer(f).writerows(rows)
    print(f"wrote {args.out}: training {train_seconds:.0f} s, {time.perf_counter() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
