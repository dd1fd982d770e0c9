"""Quality of the NPU's arithmetic: perplexity on held-out text of a trained model, against the float64 golden model.

``python -m firmware.accuracy [--checkpoint DIR] [--text FILE] [--hw PRESET] [--max-tokens N] [--by-topic]
[--quantizer search|rtn] [--json]`` reads a
Hugging Face checkpoint directory (default: the built-in model, `firmware.generate.BUILTIN_MODEL`) and a text
(default: the checkpoint's ``heldout.txt``, text the model was never trained on), tokenizes the text with the
checkpoint's ``tokenizer.model`` and scores its first N tokens teacher-forced: every token is predicted from the
ones before it, in contexts of at most ``--context`` positions (default: the model's ``max_position_embeddings``)
that each start with BOS, so every scored token is predicted exactly once. Four arithmetics run the same
contexts, token by token (`perplexity`):

- ``float64``: the golden model `sim.gemma3n.Model` in float64, the reference;
- ``float32``: the same model in float32;
- ``int4 weights``: the golden model in float64 with every weight the packer stores as INT4 replaced by the value
  its INT4 code and binary16 scale stand for (`int4_exact`): the share of the weight format in the error;
- ``hardware``: the NPU's token program on the instruction-set simulator in hardware arithmetic
  (`firmware.runtime.Runtime`, ``arithmetic="hardware"``, preset ``--hw``): INT4 weights, block-FP INT8
  activations, the KV cache format, binary32 and the SFU's functions, bit for bit what the RTL computes.

Per arithmetic: the perplexity ``exp(mean NLL)`` of the text's tokens, its ratio to float64's, top-1
agreement with float64 (the same arg-max) and the mean KL(float64 || it) of the next-token distributions; the
target (docs/requirements.md N7) is a hardware perplexity at most 5 % above float64's. ``--group`` /
``--block`` / ``--kv-format`` override the weight group, activation block and KV cache format of the preset,
and the command also prints what those numerics cost E4B on the kv260 preset (`e4b_cost`): bytes per token at
L = 128 and 4,096 counted by the ISS (`firmware.traffic`) and the modelled tok/s (`firmware.perf`), so one
command gives both sides of a numerics choice (docs/numerics.md "Choosing the numerics"). With several contexts
it also prints the range of the hardware ratio over them. ``--int4-exact`` gives every arithmetic the INT4 values,
so the weight rounding costs nothing and the hardware row shows the rest of the arithmetic alone. ``--quantizer``
chooses how the packer gives INT4 weights their codes and scales (`sim.numerics.quantize_weights`: ``search``, the
default, or ``rtn``), for the ``int4 weights`` and ``hardware`` rows alike.

``--by-topic`` scores each topic of the text alone (`split_topics`: a topic starts at a title line underlined with
``*``, as the Python documentation's topics in the built-in model's ``heldout.txt``), as if each were a ``--text``
of its own: its first N tokens (default: all of them) in its own contexts. It prints each topic's perplexities and
ratios, then all topics together (`Perplexity.combine`).

``python -m firmware.accuracy --model tiny --seeds 0 1 2 --steps 32`` (any of ``--model``, ``--seeds``,
``--steps``) measures random-weight models of a preset instead, over greedy decodes (`measure`): max |Δlogit|,
top-1 agreement, mean and max KL per seed. Random models have no trained redundancy, so their figures say
little about a real model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from hdl.config import HardwareConfig
from sim.config import ModelConfig
from sim.gemma3n import Model, resolve_tensor_names

from .runtime import Runtime

__all__ = ["measure", "Accuracy", "int4_exact", "perplexity", "perplexities", "score", "Score", "Perplexity",
           "contexts", "split_topics", "ARITHMETICS", "e4b_cost", "main"]

# The rows of `perplexity`, in order.
ARITHMETICS = ("float64", "float32", "int4 weights", "hardware")
DEFAULT_TOKENS = 512         # tokens `main` scores without --max-tokens: one context of the built-in model
TARGET_RATIO = 1.05          # docs/requirements.md N7: hardware perplexity at most 5 % above float64's


@dataclass
class Accuracy:
    max_abs: float
    top1: float
    kl_mean: float
    kl_max: float


@dataclass
class Score:
    """One arithmetic's figures over the scored tokens (`perplexity`)."""

    perplexity: float         # exp(mean negative log-likelihood of the text's tokens)
    ratio: float              # perplexity / float64's
    top1: float               # fraction of positions whose arg-max equals float64's
    kl_mean: float            # mean KL(float64 || this) of the next-token distributions, nats
    max_abs: float            # largest |logit - float64 logit|


@dataclass
class Perplexity:
    """`score`'s result: the scored tokens, the contexts they were scored in, one `Score` per arithmetic (the
    reference first; `perplexity`: `ARITHMETICS`) and each arithmetic's perplexity per context."""

    tokens: int
    contexts: int
    scores: dict
    per_context: list         # per context: {"tokens": n, arithmetic: its perplexity over the context's tokens}

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "contexts": self.contexts,
                "scores": {name: asdict(s) for name, s in self.scores.items()}, "per_context": self.per_context}

    @classmethod
    def combine(cls, parts: Sequence["Perplexity"]) -> "Perplexity":
        """The figures of several scorings (texts scored apart, the same arithmetics) over all their tokens:
        perplexities from the summed NLL, top-1 and KL token-weighted, the largest |Δlogit|, the contexts in
        order."""
        n = sum(p.tokens for p in parts)
        names = list(parts[0].scores)
        ppl = {name: math.exp(sum(p.tokens * math.log(p.scores[name].perplexity) for p in parts) / n)
               for name in names}
        reference = names[0]
        scores = {name: Score(ppl[name], ppl[name] / ppl[reference],
                              sum(p.tokens * p.scores[name].top1 for p in parts) / n,
                              sum(p.tokens * p.scores[name].kl_mean for p in parts) / n,
                              max(p.scores[name].max_abs for p in parts)) for name in names}
        return cls(n, sum(p.contexts for p in parts), scores, [c for p in parts for c in p.per_context])

    def context_ratios(self, name: str = "hardware") -> list[float]:
        """Arithmetic `name`'s perplexity over each context's tokens, divided by the reference's (the first
        arithmetic: float64 in `perplexity`)."""
        reference = next(iter(self.scores))
        return [c[name] / c[reference] for c in self.per_context]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - np.max(x)
    return z - np.log(np.sum(np.exp(z)))


def int4_exact(cfg: ModelConfig, tensors, hw: HardwareConfig, only=None, quantizer: str = "search") -> dict:
    """`tensors` (canonical or checkpoint names; arrays or lazy tensors) with every INT4-packed matrix replaced by
    its dequantised INT4 values, float64, under the same key, as the packer's `quantizer` gives them (packing them
    again with it reproduces the same values: a group's largest value is 7 or 8 times its scale, and ``rtn``'s
    scale ``max|w|/7`` or ``search``'s first candidates, ``max|w|/7`` and ``max|w|/8``, give that scale back with no
    error). `only`, a predicate on canonical names (``"layers.0.mlp.down_proj.weight"``), restricts the
    replacement to the matrices it accepts."""
    from sim.numerics import dequantize_weights, quantize_weights

    from .pack import pack
    plan = pack(cfg, None, hw, max_positions=1, fill=False)
    keys = resolve_tensor_names(cfg, tensors)
    out = dict(tensors)
    for name, e in plan.tensors.items():
        if e.format == "int4" and (only is None or only(name)):
            key = keys[name]
            q, scale = quantize_weights(np.asarray(tensors[key], np.float64), e.group, quantizer)
            out[key] = dequantize_weights(q, scale, e.group)
    return out


def contexts(ids: Sequence[int], bos: int, context: int) -> list[list[int]]:
    """The scoring contexts of token ids `ids` (a text's tokens, no BOS): consecutive pieces of at most
    ``context - 1`` tokens, each preceded by `bos`; position t of a context predicts its token t + 1, so every id
    is predicted once, from the ids before it in its context."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ValueError(f"context must be an integer >= 2 (BOS and one token), not {context!r}")
    return [[bos, *ids[k:k + context - 1]] for k in range(0, len(ids), context - 1)]


def split_topics(text: str) -> list[tuple[str, str]]:
    """The topics of `text` as ``(title, text)``: a topic starts at a line underlined by a line of as many ``*``
    (the title of a Python documentation topic) and runs to the next one; each topic's text ends with one newline
    (the built-in model's ``heldout.txt`` is its topics joined by newlines). Text before the first title is a
    topic titled ``""``; a text without titles is one topic."""
    lines = text.split("\n")
    starts = [i for i in range(len(lines) - 1)
              if lines[i].strip() and lines[i + 1] == "*" * len(lines[i]) and (i == 0 or not lines[i - 1].strip())]
    if not starts or starts[0] > 0:
        starts.insert(0, 0)
    out = []
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        body = "\n".join(lines[a:b]).strip("\n")
        if body:
            title = lines[a] if a + 1 < len(lines) and lines[a + 1] == "*" * len(lines[a]) and lines[a] else ""
            out.append((title, body + "\n"))
    return out


def perplexity(cfg: ModelConfig, tensors: Mapping, ids: Sequence[int], hw: HardwareConfig, *,
               context: int | None = None, exact_int4: bool = False, quantizer: str = "search") -> Perplexity:
    """Score the token ids `ids` (a text's tokens, without BOS) teacher-forced in each arithmetic of `ARITHMETICS`
    (`contexts` of at most `context` positions, default the model's ``max_position_embeddings``), the four models
    stepped side by side. `tensors` are the checkpoint's (canonical or checkpoint names). `quantizer`: the packer's
    INT4 quantiser (`int4_exact`, `firmware.pack.pack`), for the INT4 and hardware rows. With `exact_int4`, every
    arithmetic gets the INT4 values of the weights (`int4_exact`), so the ``hardware`` row measures the rest of the
    hardware arithmetic alone. ValueError for no ids, an id outside the vocabulary or a context outside
    ``[2, max_position_embeddings]``; the ISS's `sim.iss.ExecutionError` if the program stops on an error."""
    return perplexities(cfg, tensors, [ids], hw, context=context, exact_int4=exact_int4, quantizer=quantizer)[0]


def perplexities(cfg: ModelConfig, tensors: Mapping, texts: Sequence[Sequence[int]], hw: HardwareConfig, *,
                 context: int | None = None, exact_int4: bool = False,
                 quantizer: str = "search") -> list[Perplexity]:
    """`perplexity` of several texts' token ids, each scored alone (its own contexts) on the same four models."""
    context = cfg.max_position_embeddings if context is None else context
    if isinstance(context, bool) or not isinstance(context, int) or not 2 <= context <= cfg.max_position_embeddings:
        raise ValueError(f"context must be an integer from 2 to the model's {cfg.max_position_embeddings} positions "
                         f"(max_position_embeddings), not {context!r}")
    texts = [[int(i) for i in ids] for ids in texts]
    if not texts or not all(texts):
        raise ValueError("the text has no tokens to score")
    bad = [i for ids in texts for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary [0, {cfg.vocab_size})")
    quantised = int4_exact(cfg, tensors, hw, quantizer=quantizer)
    if exact_int4:
        tensors = quantised
    longest = min(max(map(len, texts)) + 1, context)
    models = {"float64": Model.from_hf(cfg, tensors, dtype=np.float64),
              "float32": Model.from_hf(cfg, tensors, dtype=np.float32),
              "int4 weights": Model.from_hf(cfg, quantised, dtype=np.float64),
              "hardware": Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw=hw, max_positions=longest - 1,
                                          quantizer=quantizer)}
    return [score(models, ids, cfg.bos_token_id, context) for ids in texts]


def score(models: Mapping, ids: Sequence[int], bos: int, context: int) -> Perplexity:
    """Score the token ids `ids` teacher-forced on each backend of `models` (name -> an object with ``reset()`` and
    ``step(id) -> logits``, as `firmware.generate`'s backends), stepped side by side over the `contexts` of at most
    `context` positions; the first backend is the reference that ratios, top-1 agreement and KL are taken
    against."""
    chunks = contexts(ids, bos, context)
    reference = next(iter(models))
    nll = {name: 0.0 for name in models}
    agree = {name: 0 for name in models}
    kl = {name: 0.0 for name in models}
    max_abs = {name: 0.0 for name in models}
    per_context = []
    for chunk in chunks:
        for m in models.values():
            m.reset()
        before = dict(nll)
        for t in range(len(chunk) - 1):
            logits = {name: np.asarray(m.step(chunk[t]), np.float64) for name, m in models.items()}
            ref = logits[reference]
            lref = _log_softmax(ref)
            top = int(np.argmax(ref))
            for name, x in logits.items():
                lx = _log_softmax(x)
                nll[name] -= float(lx[chunk[t + 1]])
                agree[name] += int(np.argmax(x) == top)
                kl[name] += float(np.sum(np.exp(lref) * (lref - lx)))
                max_abs[name] = max(max_abs[name], float(np.max(np.abs(x - ref))))
        k = len(chunk) - 1
        per_context.append({"tokens": k, **{name: math.exp((nll[name] - before[name]) / k) for name in models}})
    n = len(ids)
    ppl = {name: math.exp(nll[name] / n) for name in models}
    scores = {name: Score(ppl[name], ppl[name] / ppl[reference], agree[name] / n, kl[name] / n, max_abs[name])
              for name in models}
    return Perplexity(n, len(chunks), scores, per_context)


def measure(cfg: ModelConfig, tensors, hw: HardwareConfig, steps: int = 32, first: int | None = None,
            quantizer: str = "search") -> Accuracy:
    """`steps` greedy steps (1 to the model's ``max_position_embeddings``) of both models from token `first`
    (default BOS), the hardware's weights packed with `quantizer`; ValueError for a step count outside that
    range."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= cfg.max_position_embeddings:
        raise ValueError(f"steps must be an integer from 1 to the model's {cfg.max_position_embeddings} positions "
                         f"(max_position_embeddings), not {steps!r}")
    golden = Model.from_hf(cfg, tensors, dtype=np.float64)
    rt = Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw=hw, max_positions=steps, quantizer=quantizer)
    token = cfg.bos_token_id if first is None else first
    errs, agree, kls = [], 0, []
    for _ in range(steps):
        g = golden.step(token)
        h = rt.step(token).astype(np.float64)
        errs.append(np.max(np.abs(g - h)))
        agree += int(np.argmax(g) == np.argmax(h))
        lg, lh = _log_softmax(g), _log_softmax(h)
        kls.append(float(np.sum(np.exp(lg) * (lg - lh))))
        token = int(np.argmax(g))
    return Accuracy(float(max(errs)), agree / steps, float(np.mean(kls)), float(max(kls)))


def e4b_cost(hw: HardwareConfig, positions: Sequence[int] = (128, 4096)) -> list[dict] | None:
    """What the numerics of `hw` (weight group, activation block, KV cache format) cost E4B on the kv260 preset
    at each of `positions`: bytes per token counted by the ISS (`firmware.traffic`) and the modelled decode rate
    (`firmware.perf.estimate`). None if the kv260 preset cannot take them."""
    from .perf import estimate
    try:
        target = HardwareConfig.preset("kv260").replace(weight_group=hw.weight_group, act_block=hw.act_block,
                                                        kv_format=hw.kv_format, kv_v_layout=hw.kv_v_layout)
        estimates = estimate(ModelConfig.preset("e4b"), target, list(positions))
    except ValueError:
        return None
    return [{"position": e.position, "bytes_per_token": e.bytes_total, "tok_s": e.tok_s} for e in estimates]


def _random_main(p: argparse.ArgumentParser, args, hw: HardwareConfig) -> int:
    """The random-model mode (``--model``/``--seeds``/``--steps``)."""
    from sim.random_weights import random_tensors

    cfg = ModelConfig.preset(args.model)
    if args.steps > cfg.max_position_embeddings:
        p.error(f"argument --steps: must be at most the {args.model} model's {cfg.max_position_embeddings} "
                f"positions (max_position_embeddings), not {args.steps}")
    print(f"model {args.model} (random weights), hardware {hw.name}: weight group {hw.weight_group or 'row'}, "
          f"activation block {hw.act_block}, KV cache {hw.kv_format}"
          f"{' (V rows)' if hw.kv_v_layout == 'rows' else ''}, INT4 quantizer {args.quantizer}, "
          f"{args.steps} greedy steps"
          + (", weights INT4-exact in both models" if args.int4_exact else ""))
    print(f"{'seed':>5} {'max |dlogit|':>13} {'top-1':>7} {'mean KL':>9} {'max KL':>9}")
    for seed in args.seeds:
        tensors = random_tensors(cfg, seed, dtype=np.float64)
        if args.int4_exact:
            tensors = int4_exact(cfg, tensors, hw, quantizer=args.quantizer)
        a = measure(cfg, tensors, hw, args.steps, quantizer=args.quantizer)
        print(f"{seed:>5} {a.max_abs:>13.3f} {a.top1:>7.2%} {a.kl_mean:>9.4f} {a.kl_max:>9.4f}")
    return 0


def _read_text(p: argparse.ArgumentParser, path: str) -> str:
    if not os.path.exists(path):
        p.error(f"argument --text: {path!r} does not exist")
    if not os.path.isfile(path):
        p.error(f"argument --text: {path!r} is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        p.error(f"argument --text: {path!r} is not UTF-8 text ({e.reason} at byte {e.start})")
    except OSError as e:
        p.error(f"argument --text: cannot read {path!r}: {e.strerror}")


def main(argv=None) -> int:
    """``python -m firmware.accuracy``: see ``--help``. Bad input: one line on stderr naming the option or the
    file, exit status 2."""
    from hdl.config import PRESETS as HW_PRESETS
    from sim.checkpoint import Checkpoint
    from sim.config import PRESETS as MODEL_PRESETS
    from sim.iss import ExecutionError
    from sim.numerics import WEIGHT_METHODS

    from .cli import POSITIVE, arg_type
    from .generate import BUILTIN_MODEL
    from .perf import POSITION
    from .tokenizer import Tokenizer

    def pow2(v):
        return v >= 1 and v & (v - 1) == 0

    p = argparse.ArgumentParser(prog="python -m firmware.accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", metavar="DIR",
                   help="Hugging Face checkpoint directory with tokenizer.model (default: the built-in model)")
    p.add_argument("--text", metavar="FILE",
                   help="UTF-8 text to score (default: the checkpoint's heldout.txt)")
    p.add_argument("--max-tokens", type=POSITIVE, metavar="N",
                   help="score the text's first N tokens (default 512; with --by-topic: each topic's, default all)")
    p.add_argument("--by-topic", action="store_true",
                   help="score each topic of the text alone (a title line underlined with '*' starts a topic)")
    p.add_argument("--context", type=arg_type("an integer >= 2", int, lambda v: v >= 2), metavar="N",
                   help="positions per scoring context, BOS included (default: the model's max_position_embeddings)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--hw", choices=sorted(HW_PRESETS),
                   help="hardware preset (default kv260; tiny with --model)")
    p.add_argument("--group", type=arg_type("0 or a power of two", int, lambda v: v == 0 or pow2(v)), metavar="G",
                   help="weight group (0 = one scale per row)")
    p.add_argument("--block", type=arg_type("a power of two", int, pow2), metavar="B", help="activation block")
    p.add_argument("--kv-format", choices=("fp16", "int8"), help="KV cache format (default: the preset's)")
    p.add_argument("--kv-v-layout", choices=("planes", "rows"),
                   help="INT8 cache: V as two INT4 planes or as INT8 rows (default: the preset's)")
    p.add_argument("--quantizer", default="search", choices=WEIGHT_METHODS,
                   help="the packer's INT4 scales: search (least squared error per group; default) or rtn "
                        "(round-to-nearest)")
    p.add_argument("--int4-exact", action="store_true",
                   help="weights replaced by their INT4 values in every model (isolates the other arithmetic)")
    random_mode = p.add_argument_group("random-weight models (any of these options selects them)")
    random_mode.add_argument("--model", choices=sorted(MODEL_PRESETS), help="model preset (default tiny)")
    random_mode.add_argument("--seeds", type=POSITION, nargs="+", metavar="SEED",
                             help="seeds of the random models (integers >= 0; default 0 1 2)")
    random_mode.add_argument("--steps", type=POSITIVE, metavar="N",
                             help="greedy steps (at most the model's max_position_embeddings; default 32)")
    args = p.parse_args(argv)
    random = args.model is not None or args.seeds is not None or args.steps is not None
    if random:
        for option, value in (("--checkpoint", args.checkpoint), ("--text", args.text),
                              ("--max-tokens", args.max_tokens), ("--context", args.context),
                              ("--json", args.json or None), ("--by-topic", args.by_topic or None)):
            if value is not None:
                p.error(f"argument {option}: not allowed with random-weight models (--model, --seeds, --steps)")
        args.model = args.model or "tiny"
        args.seeds = [0, 1, 2] if args.seeds is None else args.seeds
        args.steps = 32 if args.steps is None else args.steps
    hw_name = args.hw or ("tiny" if random else "kv260")
    hw = HardwareConfig.preset(hw_name)
    kv_v_layout = args.kv_v_layout
    if args.kv_format == "fp16" and kv_v_layout is None:
        kv_v_layout = "planes"                         # the binary16 cache has one layout
    for option, changes in (("--group", {"weight_group": args.group}), ("--block", {"act_block": args.block}),
                            ("--kv-v-layout" if args.kv_v_layout else "--kv-format",
                             {"kv_format": args.kv_format, "kv_v_layout": kv_v_layout})):
        changes = {name: value for name, value in changes.items() if value is not None}
        if changes:
            try:
                hw = hw.replace(**changes)
            except ValueError as e:
                value = " ".join(str(v) for v in changes.values())
                p.error(f"argument {option}: {value} does not fit hardware {hw_name}: {e}")
    if random:
        return _random_main(p, args, hw)

    directory = BUILTIN_MODEL if args.checkpoint is None else args.checkpoint
    what = "the built-in model" if args.checkpoint is None else f"{args.checkpoint!r}"
    if not os.path.isdir(directory):
        p.error(f"argument --checkpoint: {directory!r} is not a directory")
    text_path = os.path.join(directory, "heldout.txt") if args.text is None else args.text
    if args.text is None and not os.path.isfile(text_path):
        p.error(f"argument --text: {what} has no heldout.txt; name the text to score")
    text = _read_text(p, text_path)
    tok_path = os.path.join(directory, "tokenizer.model")
    try:
        tokenizer = Tokenizer.from_file(tok_path)
    except (OSError, ValueError) as e:
        p.error(f"argument --checkpoint: {what} needs its tokenizer: {e}")
    try:
        ckpt = Checkpoint(directory)
    except (OSError, ValueError, TypeError) as e:
        p.error(f"argument --checkpoint: cannot load {what}: {e}")
    cfg = ckpt.model_config
    if args.context is not None and args.context > cfg.max_position_embeddings:
        p.error(f"argument --context: must be at most the model's {cfg.max_position_embeddings} positions "
                f"(max_position_embeddings), not {args.context}")
    if args.by_topic:
        topics = [(title, tokenizer.encode(body, add_bos=False)[:args.max_tokens]) for title, body in split_topics(text)]
        topics = [(title, ids) for title, ids in topics if ids]
    else:
        topics = [(None, tokenizer.encode(text, add_bos=False)[:args.max_tokens or DEFAULT_TOKENS])]
    if not topics or not topics[0][1]:
        p.error(f"argument --text: {text_path!r} has no tokens to score")
    try:
        parts = perplexities(cfg, ckpt, [ids for _, ids in topics], hw, context=args.context,
                             exact_int4=args.int4_exact, quantizer=args.quantizer)
    except (ValueError, TypeError, ExecutionError) as e:
        p.exit(2, f"{p.prog}: cannot score {text_path!r} with {what} on hardware {hw.name}: {e}\n")
    result = Perplexity.combine(parts)
    cost = e4b_cost(hw)
    hardware = {"preset": hw_name, "weight_group": hw.weight_group, "act_block": hw.act_block,
                "kv_format": hw.kv_format, "kv_v_layout": hw.kv_v_layout, "quantizer": args.quantizer}
    if args.json:
        by_topic = {"topics": [{"title": title, **r.to_dict()} for (title, _), r in zip(topics, parts)]}
        print(json.dumps({"checkpoint": os.path.abspath(directory), "text": os.path.abspath(text_path),
                          "hardware": hardware, "int4_exact": args.int4_exact, **result.to_dict(),
                          **(by_topic if args.by_topic else {}), "e4b": cost, "target_ratio": TARGET_RATIO}, indent=2))
        return 0
    scored = (f"{len(topics)} topic{'s' if len(topics) > 1 else ''} scored alone, " if args.by_topic else "")
    print(f"{os.path.basename(os.path.normpath(directory))}, {os.path.basename(text_path)}: {scored}{result.tokens} "
          f"tokens scored in {result.contexts} context{'s' if result.contexts > 1 else ''} of at most "
          f"{args.context or cfg.max_position_embeddings} positions"
          + (" (weights INT4-exact in every model)" if args.int4_exact else ""))
    print(f"hardware {hw_name}: weight group {hw.weight_group or 'row'}, activation block {hw.act_block}, "
          f"KV cache {hw.kv_format}{' (V rows)' if hw.kv_v_layout == 'rows' else ''}, INT4 quantizer {args.quantizer}")
    print("E4B with these numerics on kv260: " + ("they do not fit" if cost is None else ", ".join(
        f"{c['bytes_per_token'] / 1e6:,.1f} MB per token and {c['tok_s']:.2f} tok/s modelled at L = {c['position']:,}"
        for c in cost)))
    print(f"{'arithmetic':<14} {'perplexity':>11} {'/ float64':>10} {'top-1':>8} {'mean KL':>9} {'max |dlogit|':>13}")
    for name, s in result.scores.items():
        print(f"{name:<14} {s.perplexity:>11.3f} {s.ratio:>10.4f} {s.top1:>8.2%} {s.kl_mean:>9.4f} {s.max_abs:>13.3f}")
    if args.by_topic:
        width = max(5, *(len(title) for title, _ in topics))
        print(f"{'topic':<{width}} {'tokens':>7} {'float64':>9} {'int4 weights':>13} {'hardware':>9} "
              f"{'int4 / float64':>15} {'hardware / float64':>19}")
        for (title, _), r in zip(topics, parts):
            f64, int4, hard = (r.scores[name] for name in ("float64", "int4 weights", "hardware"))
            print(f"{title:<{width}} {r.tokens:>7} {f64.perplexity:>9.3f} {int4.perplexity:>13.3f} "
                  f"{hard.perplexity:>9.3f} {int4.ratio:>15.4f} {hard.ratio:>19.4f}")
        r = [part.scores["hardware"].ratio for part in parts]
        print(f"hardware / float64 per topic: {min(r):.4f} to {max(r):.4f} "
              f"({sum(x > TARGET_RATIO for x in r)} of {len(r)} above {TARGET_RATIO:.2f})")
    if result.contexts > 1:
        r = result.context_ratios()
        print(f"hardware / float64 per context: {min(r):.4f} to {max(r):.4f} "
              f"({sum(x > TARGET_RATIO for x in r)} of {len(r)} above {TARGET_RATIO:.2f})")
    hw_ratio = result.scores["hardware"].ratio
    print(f"hardware perplexity {hw_ratio - 1:+.2%} against float64: "
          f"{'within' if hw_ratio <= TARGET_RATIO else 'beyond'} the {TARGET_RATIO - 1:.0%} target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
