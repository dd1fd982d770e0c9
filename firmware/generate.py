"""Autoregressive text generation on a Gemma 3n backend, and its command line.

``python -m firmware.generate`` runs the model token by token and samples on the host (`firmware.sampling`).
Without ``--checkpoint`` it uses the built-in model `BUILTIN_MODEL` (``firmware/models/gemma3n-tiny-pydoc``: a
1.8 M-parameter Gemma 3n trained on the Python documentation by ``scripts/train_tiny.py``, with its
SentencePiece tokenizer), so the whole path runs in seconds without any download::

    python -m firmware.generate --prompt "The Python " --max-new-tokens 32 --temperature 0
    python -m firmware.generate --checkpoint ~/gemma-3n-E4B --prompt "The capital of France is"

stdout gets the generated ids on one line and, when a tokenizer is known, their text on the next; per-token
progress and a final summary go to stderr.

A *backend* is any object with ``reset()`` (forget the sequence: empty KV cache, position 0) and
``step(token_id) -> logits`` (append one token and return the float logits over the vocabulary that predict
the next one); optionally ``prefill(ids) -> logits`` (append several, the logits after the last: the prompt
runs through it) and ``config`` with ``vocab_size``, ``bos_token_id`` and ``eos_token_id``. The golden
model ``sim.gemma3n.Model`` is one; the NPU runtime (`firmware.runtime.Runtime`, with prefill programs) is
another.
"""

from __future__ import annotations

import argparse
import math
import operator
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from .cli import arg_type
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer

__all__ = ["BUILTIN_MODEL", "generate", "generate_streams", "generate_speculative", "load_model", "main"]

# The built-in model: a Hugging Face checkpoint directory shipped with the package (its README.md says how
# scripts/train_tiny.py made it, with the training curve).
BUILTIN_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "gemma3n-tiny-pydoc")
# the packer's INT4 quantisers (`sim.numerics.WEIGHT_METHODS`, named here so that the sampling side needs no sim)
QUANTIZERS = ("search", "rtn")

Progress = Callable[[int, int, float], object]


def _config_attr(model, name: str):
    return getattr(getattr(model, "config", None), name, None)


def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, sampler: Callable, *,
             stop_at_eos: bool = True, eos_id: int | None = None,
             progress: Progress | None = None) -> list[int]:
    """Continue `prompt_ids` by up to `max_new_tokens` sampled tokens; returns only the new ids.

    Parameters
    ----------
    model
        The backend (see the module docstring). It is `reset` first, then fed the prompt with ``prefill``
        if it has one, else one token at a time with ``step``; every sampled token except the last is fed
        back with ``step``.
    prompt_ids : sequence of int
        At least one id (Gemma prompts start with BOS); checked against ``model.config.vocab_size``
        when the backend has one.
    max_new_tokens : int
        Upper bound on the number of new ids, ``>= 0``.
    sampler : callable
        ``sampler(logits, context_ids) -> int``, e.g. a `firmware.sampling.Sampler`. `context_ids` is
        the full context, prompt + generated so far, which is what the repetition penalty looks at.
    stop_at_eos : bool
        Stop after the first sampled `eos_id` (which is included in the result).
    eos_id : int or None
        Defaults to ``model.config.eos_token_id``; with neither, generation never stops early.
    progress : callable or None
        ``progress(done, total, elapsed_seconds)`` is called after every generation step, i.e. once per
        new token, with ``done`` new tokens out of ``total = max_new_tokens`` and the wall time since
        the call started (so the first step includes the prompt).
    """
    prompt = [operator.index(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids must contain at least one token (a Gemma prompt starts with BOS)")
    vocab_size = _config_attr(model, "vocab_size")
    if vocab_size is not None:
        for t in prompt:
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt id {t} is outside the model's vocabulary [0, {vocab_size})")
    max_new_tokens = _check_max_new(max_new_tokens)
    if eos_id is None:
        eos_id = _config_attr(model, "eos_token_id")
    if max_new_tokens == 0:
        return []

    start = time.perf_counter()
    model.reset()
    if callable(getattr(model, "prefill", None)):       # the NPU runtime: the prompt as prefill programs
        logits = model.prefill(prompt)
    else:
        for t in prompt:
            logits = model.step(t)
    context = list(prompt)
    new: list[int] = []
    while True:
        token = operator.index(sampler(logits, context))
        new.append(token)
        context.append(token)
        if progress is not None:
            progress(len(new), max_new_tokens, time.perf_counter() - start)
        if len(new) == max_new_tokens or (stop_at_eos and eos_id is not None and token == eos_id):
            return new
        logits = model.step(token)


def generate_streams(model, prompt_ids: Sequence[int], max_new_tokens: int, samplers: Sequence[Callable], *,
                     stop_at_eos: bool = True, eos_id: int | None = None,
                     progress: Progress | None = None) -> list[list[int]]:
    """Batched decode: one continuation of `prompt_ids` per sampler, all advancing in lockstep, one token of
    every stream per step (`firmware.runtime.Runtime.step_many`: the streams share each weight stream);
    returns each stream's new ids. `model` needs ``streams`` (as many as `samplers`), ``prefill`` (on stream
    0), ``copy_stream`` (the prompt's cache into the other streams) and ``step_many``; each stream is the sequence `generate` gives with its sampler alone. A
    stream that has stopped (EOS) is fed its last id until the others stop, its output dropped.
    ``progress(done, total, elapsed)`` after every step (``done``: the steps so far)."""
    prompt = [operator.index(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids must contain at least one token (a Gemma prompt starts with BOS)")
    streams = getattr(model, "streams", 1)
    if len(samplers) != streams or not callable(getattr(model, "step_many", None)):
        raise ValueError(f"generate_streams needs a backend with one stream per sampler: {len(samplers)} "
                         f"samplers, {streams} stream(s)")
    max_new_tokens = _check_max_new(max_new_tokens)
    if eos_id is None:
        eos_id = _config_attr(model, "eos_token_id")
    new: list[list[int]] = [[] for _ in range(streams)]
    if max_new_tokens == 0:
        return new
    start = time.perf_counter()
    model.reset()
    rows = [model.prefill(prompt)] * streams   # the prompt once, on stream 0, then its cache copied to the rest
    for s in range(1, streams):
        model.copy_stream(0, s)
    contexts = [list(prompt) for _ in range(streams)]
    live = [True] * streams
    for step in range(1, max_new_tokens + 1):
        for s in range(streams):
            if not live[s]:
                continue
            token = operator.index(samplers[s](rows[s], contexts[s]))
            new[s].append(token)
            contexts[s].append(token)
            live[s] = not (stop_at_eos and eos_id is not None and token == eos_id)
        if progress is not None:
            progress(step, max_new_tokens, time.perf_counter() - start)
        if step == max_new_tokens or not any(live):
            return new
        rows = model.step_many([c[-1] for c in contexts])


def generate_speculative(model, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams, *,
                         draft_tokens: int, seed: int = 0, stats=None, stop_at_eos: bool = True,
                         eos_id: int | None = None, progress: Progress | None = None) -> list[int]:
    """Speculative decoding with prompt-lookup drafts (`firmware.speculate`): per verify pass up to
    `draft_tokens` ids drafted from the context, the last id and the drafts run in one program
    (``model.verify``), the acceptance rule keeps a prefix of the drafts and adds one id, and ``model.rollback``
    drops the rest from the KV cache. Greedy (temperature 0) gives exactly the ids of `generate`; sampling
    draws from the same distribution as `generate` (with its own use of the random generator, seeded by
    `seed`). `stats`: a `firmware.speculate.SpecStats` to count the passes in. ``progress(done, total,
    elapsed)`` after every pass."""
    from .speculate import SpecStats, accept, draft

    prompt = [operator.index(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids must contain at least one token (a Gemma prompt starts with BOS)")
    if not all(callable(getattr(model, a, None)) for a in ("verify", "rollback", "verify_tokens")):
        raise ValueError("speculative decoding needs a backend with verify passes (the NPU runtime)")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 0:
        raise ValueError(f"draft_tokens must be an integer >= 0, not {draft_tokens!r}")
    tile = min(getattr(model, "prefill_tokens", draft_tokens + 1), model.image.logit_rows) \
        if hasattr(model, "image") else draft_tokens + 1
    if draft_tokens + 1 > tile:
        raise ValueError(f"{draft_tokens} drafts make verify passes of {draft_tokens + 1} ids; a program runs at "
                         f"most {tile} (what L2, the staging slots and the logits rows hold)")
    max_new_tokens = _check_max_new(max_new_tokens)
    if eos_id is None:
        eos_id = _config_attr(model, "eos_token_id")
    stats = SpecStats() if stats is None else stats
    rng = np.random.default_rng(seed)
    new: list[int] = []
    if max_new_tokens == 0:
        return new
    start = time.perf_counter()
    model.reset()
    if len(prompt) > 1:
        model.prefill(prompt[:-1])
    context = list(prompt)
    while True:
        k = max(0, min(draft_tokens, model.verify_tokens() - 1, max_new_tokens - len(new) - 1))
        drafts = draft(context, k) if k else []
        rows = model.verify([context[-1]] + drafts)
        out = accept(rows, context, drafts, params, rng)
        model.rollback(len(out))               # the last id and the accepted drafts stay
        stats.add(len(drafts), len(out))
        for token in out:
            new.append(token)
            context.append(token)
            if len(new) == max_new_tokens or (stop_at_eos and eos_id is not None and token == eos_id):
                if progress is not None:
                    progress(len(new), max_new_tokens, time.perf_counter() - start)
                return new
        if progress is not None:
            progress(len(new), max_new_tokens, time.perf_counter() - start)


def _check_max_new(max_new_tokens) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an integer, not {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, not {max_new_tokens!r}")
    return max_new_tokens


def load_model(checkpoint: str | os.PathLike | None = None, *, dtype=np.float32, backend: str = "golden",
               arithmetic: str = "reference", hw: str = "kv260", max_positions: int | None = None,
               quantizer: str = "search", streams: int = 1, logit_rows: int | None = None):
    """A backend for `generate`: the golden model ``sim.gemma3n.Model`` (``backend="golden"``) or the
    NPU's token program on the instruction-set simulator (``backend="iss"``, `firmware.runtime.Runtime`,
    in ``reference`` or ``hardware`` arithmetic on hardware preset `hw`, its INT4 weights packed with
    `quantizer`, `firmware.pack.pack`, with `streams` KV caches and `logit_rows` logits rows), from a Hugging
    Face checkpoint directory (default: the built-in model, `BUILTIN_MODEL`).

    The ISS reads a checkpoint's tensors as they are stored (`sim.checkpoint.LazyTensor`: the packer reads them
    in row chunks, reference arithmetic row by row, as it reads arrays). A bad checkpoint raises OSError,
    ValueError or TypeError with one message naming the file, tensor or field (`sim.checkpoint`)."""
    from sim.gemma3n import Model  # imported here: the sampling and tokenizer code must not need sim

    builtin = checkpoint is None
    checkpoint = BUILTIN_MODEL if builtin else checkpoint
    if backend == "golden":
        # The built-in model loads in a blink; a real checkpoint reports its progress.
        return Model.from_pretrained(checkpoint, dtype=dtype, progress=None if builtin else _LoadProgress(sys.stderr))
    from sim.checkpoint import Checkpoint

    from .runtime import Runtime

    ckpt = Checkpoint(checkpoint)
    return Runtime.from_hf(ckpt.model_config, ckpt, backend="iss", arithmetic=arithmetic, hw=hw,
                           max_positions=max_positions, quantizer=quantizer, streams=streams, logit_rows=logit_rows)


def load_packed(image_dir: str | os.PathLike, *, backend: str = "kv260", checkpoint=None,
                max_positions: int | None = None, board_root: str = "/", log=None, quantizer: str | None = None):
    """A `Runtime` over a packed image (`firmware.pack.save_image`): on the board (``backend="kv260"``:
    `firmware.board.Kv260Device`, which raises `firmware.board.BoardUnavailable` where there is none) or on the
    ISS in hardware arithmetic (``"iss"``). With `checkpoint` and no image in `image_dir`, the checkpoint is
    packed there first (for the device's hardware and the kv260 memory map; `max_positions` default 4,096; INT4
    weights by `quantizer`, default ``"search"``). A `quantizer` other than the one the image in `image_dir` was
    packed with is a ValueError naming both."""
    from .pack import load_image, pack, save_image
    from .runtime import IssBackend, Runtime, hardware_of

    log = log or (lambda msg: None)
    device = None
    if backend == "kv260":
        from .board import Kv260Device
        device = Kv260Device(root=board_root)
    if checkpoint is not None and not os.path.exists(os.path.join(image_dir, "manifest.json")):
        from hdl.config import HardwareConfig
        from sim.checkpoint import Checkpoint
        ckpt = Checkpoint(checkpoint)
        hw = device.hw if device is not None else HardwareConfig.preset("kv260")
        log(f"packing {checkpoint} into {image_dir} for {hw.name} (once)")
        os.makedirs(image_dir, exist_ok=True)
        image = pack(ckpt.config, ckpt, hw, max_positions=max_positions or 4096, memory_map="kv260",
                     out=os.path.join(image_dir, "image.npy"), progress=_LoadProgress(sys.stderr),
                     quantizer=quantizer or "search")
        save_image(image, image_dir)
    image = load_image(image_dir)
    if quantizer is not None and image.quantizer != quantizer:
        raise ValueError(f"{image_dir} holds an image packed with the {image.quantizer!r} quantizer, not "
                         f"{quantizer!r}: pack the checkpoint into another directory (python -m firmware.pack "
                         f"--quantizer {quantizer} --out DIR)")
    if device is None:
        from sim.config import ModelConfig
        from .compiler import compile_token
        hw = hardware_of(image)
        cfg = ModelConfig.from_hf(image.config)
        return Runtime(cfg, image, compile_token(cfg, image, hw), IssBackend(hw, "hardware"))
    return Runtime.on_device(image, device, progress=_ImageProgress(sys.stderr))


class _ImageProgress:
    """Image loading progress on a stream: a bar rewritten in place on a terminal, a line per tenth otherwise."""

    def __init__(self, stream):
        self._stream, self._start, self._shown = stream, time.perf_counter(), -1
        self._tty = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if not self._tty and tenth == self._shown:
            return
        self._shown = tenth
        bar = "#" * (30 * done // max(total, 1))
        t = time.perf_counter() - self._start
        line = f"loading image [{bar:<30}] {done / 2**20:,.0f}/{total / 2**20:,.0f} MiB ({t:.0f} s)"
        self._stream.write(("\r" + line + ("\n" if done == total else "")) if self._tty else line + "\n")
        self._stream.flush()


# --- command line -----------------------------------------------------------------------------------


def _arg_type(name: str, convert, check, requirement: str):
    return arg_type(requirement, convert, check, name)


def _parse_ids(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated token ids such as '2,105,2364', not {text!r}") from None
    bad = [i for i in ids if i < 0]
    if bad:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, not {bad[0]}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m firmware.generate",
        description="Generate tokens with the Gemma 3n golden model and host-side sampling "
                    "(repetition penalty, temperature, top-p).")
    model = p.add_argument_group("model")
    model.add_argument("--checkpoint", metavar="DIR",
                       help="Hugging Face checkpoint directory (config.json + *.safetensors); default: the "
                            "built-in model, a tiny Gemma 3n trained on the Python documentation "
                            "(firmware/models/gemma3n-tiny-pydoc)")
    model.add_argument("--backend", choices=("golden", "iss", "kv260"), default="golden",
                       help="golden: the NumPy golden model; iss: the NPU's compiled token program on the "
                            "instruction-set simulator; kv260: the NPU on the board (run on the KV260, with the "
                            "app loaded: docs/kv260.md) (default: golden)")
    model.add_argument("--image", metavar="DIR",
                       help="with --backend kv260 (or iss, hardware arithmetic): a packed image "
                            "(python -m firmware.pack --out DIR); with --checkpoint too, the checkpoint is packed "
                            "into DIR first if DIR holds no image")
    model.add_argument("--max-positions", metavar="N", default=None,
                       type=_arg_type("max_positions", int, lambda v: v >= 1, "a positive integer"),
                       help="with --backend iss or kv260 and a checkpoint: positions the KV cache holds "
                            "(default: the model's max_position_embeddings; kv260 packs 4096)")
    model.add_argument("--arithmetic", choices=("reference", "hardware"), default="reference",
                       help="with --backend iss: float64 reference arithmetic or the NPU's INT4/INT8/binary32 "
                            "arithmetic (default: reference)")
    model.add_argument("--hw", default="kv260", help="with --backend iss: hardware preset (default: kv260)")
    model.add_argument("--quantizer", choices=QUANTIZERS, default=None,
                       help="with hardware arithmetic: how the packer chooses the INT4 weights' codes and scales: "
                            "search (least squared error per group) or rtn (round-to-nearest) (default: search; "
                            "a packed --image keeps its own)")
    model.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                       help="floating-point type the model computes in (default: float32)")
    model.add_argument("--tokenizer", metavar="PATH",
                       help="SentencePiece tokenizer.model (default: DIR/tokenizer.model if present, and the "
                            "built-in model's own without --checkpoint)")
    prompt = p.add_argument_group("prompt").add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text; needs a tokenizer (BOS is prepended)")
    prompt.add_argument("--prompt-ids", metavar="IDS", type=_parse_ids,
                        help="prompt as comma-separated token ids, e.g. 2,105,2364 (default: just BOS)")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", metavar="N", default=32,
                          type=_arg_type("max_new_tokens", int, lambda v: v >= 1, "a positive integer"),
                          help="maximum number of tokens to generate (default: 32)")
    sampling.add_argument("--temperature", metavar="T", default=1.0,
                          type=_arg_type("temperature", float, lambda v: math.isfinite(v) and v >= 0,
                                         "a finite number >= 0"),
                          help="softmax temperature; 0 means greedy decoding (default: 1.0)")
    sampling.add_argument("--top-p", metavar="P", default=0.9,
                          type=_arg_type("top_p", float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                          help="nucleus mass; 1 disables top-p (default: 0.9)")
    sampling.add_argument("--repetition-penalty", metavar="R", default=1.15,
                          type=_arg_type("repetition_penalty", float, lambda v: math.isfinite(v) and v > 0,
                                         "a finite number > 0"),
                          help="penalty on tokens already in the context; 1 disables it (default: 1.15)")
    sampling.add_argument("--seed", metavar="N", default=0,
                          type=_arg_type("seed", int, lambda v: v >= 0, "an integer >= 0"),
                          help="seed of the sampling random generator (default: 0)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating after an end-of-sequence token")
    npu = p.add_argument_group("NPU decoding modes (--backend iss or kv260)")
    npu.add_argument("--streams", metavar="B", default=1,
                     type=_arg_type("streams", int, lambda v: 1 <= v <= 64, "an integer from 1 to 64"),
                     help="sample B continuations of the prompt at once (seeds --seed .. --seed + B - 1) in "
                          "batched steps, one weight stream per step; printed one per line (default: 1)")
    npu.add_argument("--speculate", metavar="K", default=0,
                     type=_arg_type("speculate", int, lambda v: 0 <= v <= 254, "an integer from 0 to 254"),
                     help="speculative decoding: up to K prompt-lookup drafts per verify pass; prints the "
                          "acceptance statistics (default: 0, plain decoding)")
    return p


class _ProgressPrinter:
    """Per-token progress on a stream: rewritten in place (``\\r``) on a terminal, one line each otherwise."""

    def __init__(self, stream):
        self._stream = stream
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._width = 0  # length of the last in-place line, to blank it out when the next one is shorter

    def __call__(self, done: int, total: int, elapsed: float) -> None:
        rate = done / elapsed if elapsed > 0 else math.inf
        line = f"[{done:>{max(3, len(str(total)))}}/{total}] {rate:.1f} tok/s"
        if self._tty:
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def finish(self, n_new: int, n_prompt: int, elapsed: float) -> None:
        if self._tty and self._width:
            self._stream.write("\n")
        rate = n_new / elapsed if elapsed > 0 else math.inf
        self._stream.write(f"generated {n_new} tokens after a {n_prompt}-token prompt in {elapsed:.2f} s "
                           f"({rate:.2f} tok/s)\n")
        self._stream.flush()


class _LoadProgress:
    """Checkpoint loading progress on stderr: one line per tenth of the tensors."""

    def __init__(self, stream):
        self._stream = stream
        self._start = time.perf_counter()
        self._shown = -1

    def __call__(self, done: int, total: int, name: str) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth != self._shown:
            self._shown = tenth
            self._stream.write(f"loading checkpoint: {done}/{total} tensors "
                               f"({time.perf_counter() - self._start:.1f} s)\n")
            self._stream.flush()


def _decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Text of `ids`; ids the tokenizer does not know (a model vocabulary can be larger, as E4B's 262400
    rows are against the tokenizer's 262144 pieces) appear as ``<id N>``."""
    parts, run = [], []
    for i in ids:
        if i < tokenizer.vocab_size:
            run.append(i)
            continue
        parts.append(tokenizer.decode(run))
        parts.append(f"<id {i}>")
        run = []
    parts.append(tokenizer.decode(run))
    return "".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    # Everything that can be checked without the model is checked before the (possibly slow) load.
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint!r} is not a directory")
    tokenizer_path = args.tokenizer
    # Without --checkpoint (and without a packed --image) the built-in model runs, with its own tokenizer.
    model_dir = args.checkpoint
    if args.checkpoint is None and args.image is None:
        model_dir = BUILTIN_MODEL
    if tokenizer_path is None and model_dir is not None:
        candidate = os.path.join(model_dir, "tokenizer.model")
        if os.path.isfile(candidate):
            tokenizer_path = candidate
    tokenizer = None
    if tokenizer_path is not None:
        try:
            tokenizer = Tokenizer.from_file(tokenizer_path)
        except (OSError, ValueError) as e:
            parser.error(f"--tokenizer: {e}")
    if args.prompt is not None and tokenizer is None and args.image is None:
        parser.error("--prompt needs a tokenizer: pass --tokenizer PATH, or a --checkpoint directory that "
                     "contains tokenizer.model, or give the prompt as --prompt-ids")

    dtype = {"float32": np.float32, "float64": np.float64}[args.dtype]
    backend = {} if args.backend == "golden" else {"backend": "iss", "arithmetic": args.arithmetic, "hw": args.hw,
                                                   "max_positions": args.max_positions}
    if args.backend != "iss" and (args.arithmetic != "reference" or args.hw != "kv260"):
        parser.error("--arithmetic and --hw apply to --backend iss only")
    if args.quantizer is not None and (args.backend == "golden"
                                       or (args.backend == "iss" and args.arithmetic != "hardware")):
        parser.error("--quantizer applies to the NPU's INT4 weights: --backend iss --arithmetic hardware, or "
                     "--backend kv260")
    if args.quantizer is not None and args.image is None:
        backend["quantizer"] = args.quantizer
    if (args.streams > 1 or args.speculate) and args.backend == "golden":
        parser.error("--streams and --speculate run on the NPU: --backend iss or kv260")
    if args.streams > 1 and args.speculate:
        parser.error("--streams and --speculate do not combine: choose one")
    if args.image is None:
        backend.update(streams=args.streams, logit_rows=max(args.streams, args.speculate + 1))
    if args.max_positions is not None and args.backend == "golden":
        parser.error("--max-positions applies to --backend iss or kv260 (the golden model keeps every position)")
    if args.image is not None and args.backend == "golden":
        parser.error("--image applies to --backend kv260 or iss")
    if args.backend == "kv260" or args.image is not None:
        if args.image is None and args.checkpoint is None:
            parser.error("--backend kv260 needs --image DIR (python -m firmware.pack --out DIR) or --checkpoint DIR")
        if args.backend == "iss" and args.arithmetic != "hardware":
            parser.error("a packed --image runs in --arithmetic hardware")
        image_dir = args.image or os.path.join(os.path.expanduser("~/.cache/gemma3n-npu"),
                                               os.path.basename(os.path.normpath(args.checkpoint)))
        from .board import BoardUnavailable
        try:
            model = load_packed(image_dir, backend=args.backend, checkpoint=args.checkpoint,
                                max_positions=args.max_positions, board_root=os.environ.get("NPU_BOARD_ROOT", "/"),
                                log=lambda msg: print(msg, file=sys.stderr), quantizer=args.quantizer)
        except (BoardUnavailable, OSError, ValueError, TypeError, RuntimeError) as e:
            print(f"python -m firmware.generate: {e}", file=sys.stderr)
            return 2
        image = model.image
        if image.streams < args.streams:
            print(f"python -m firmware.generate: --streams {args.streams}: {image_dir} holds KV caches for "
                  f"{image.streams} stream(s); pack it with python -m firmware.pack --streams {args.streams}",
                  file=sys.stderr)
            return 2
        if image.logit_rows < args.speculate + 1:
            print(f"python -m firmware.generate: --speculate {args.speculate}: {image_dir} holds "
                  f"{image.logit_rows} logits row(s), a verify pass needs {args.speculate + 1}; pack it with "
                  f"python -m firmware.pack --logit-rows {args.speculate + 1}", file=sys.stderr)
            return 2
        if tokenizer is None and os.path.isfile(os.path.join(image_dir, "tokenizer.model")):
            tokenizer = Tokenizer.from_file(os.path.join(image_dir, "tokenizer.model"))
        if args.prompt is not None and tokenizer is None:
            parser.error(f"--prompt needs a tokenizer: {image_dir} has no tokenizer.model; pass --tokenizer PATH")
    else:
        try:
            model = load_model(args.checkpoint, dtype=dtype, **backend)
        except (OSError, ValueError, TypeError, KeyError) as e:
            # One line, no usage text: the options were right, the checkpoint is not.
            msg = str(e).strip("'\"") if isinstance(e, KeyError) else str(e)
            what = "the built-in model" if args.checkpoint is None else f"--checkpoint {args.checkpoint!r}"
            parser.exit(2, f"{parser.prog}: cannot load {what}: {msg}\n")

    if args.prompt is not None:
        prompt_ids = tokenizer.encode(args.prompt, add_bos=True)
    elif args.prompt_ids is not None:
        prompt_ids = args.prompt_ids
    else:
        bos = _config_attr(model, "bos_token_id")
        if bos is None and tokenizer is not None and tokenizer.bos_id >= 0:
            bos = tokenizer.bos_id
        if bos is None:
            parser.error("the model defines no BOS id; give the prompt with --prompt-ids")
        prompt_ids = [bos]
    vocab_size = _config_attr(model, "vocab_size")
    if vocab_size is not None:
        for t in prompt_ids:
            if t >= vocab_size:
                parser.error(f"prompt id {t} is outside the model's vocabulary [0, {vocab_size})")
    max_positions = getattr(model, "max_positions", None) or _config_attr(model, "max_position_embeddings")
    # The last sampled token is never fed back, so the model sees prompt + new - 1 positions.
    if max_positions is not None and len(prompt_ids) + args.max_new_tokens - 1 > max_positions:
        parser.error(f"a {len(prompt_ids)}-token prompt plus --max-new-tokens {args.max_new_tokens} needs "
                     f"more than the model's {max_positions} positions (max_position_embeddings, or the KV "
                     f"cache's --max-positions)")
    eos_id = _config_attr(model, "eos_token_id")
    if eos_id is None and tokenizer is not None and tokenizer.eos_id >= 0:
        eos_id = tokenizer.eos_id

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            repetition_penalty=args.repetition_penalty)
    printer = _ProgressPrinter(sys.stderr)
    start = time.perf_counter()
    if args.streams > 1:
        samplers = [Sampler(params, seed=args.seed + s) for s in range(args.streams)]
        out = generate_streams(model, prompt_ids, args.max_new_tokens, samplers, stop_at_eos=not args.ignore_eos,
                               eos_id=eos_id, progress=printer)
        elapsed = time.perf_counter() - start
        printer.finish(sum(map(len, out)), len(prompt_ids), elapsed)
        for s, ids in enumerate(out):
            rate = len(ids) / elapsed if elapsed > 0 else math.inf
            print(f"stream {s} (seed {args.seed + s}, {len(ids)} tokens, {rate:.2f} tok/s): "
                  + " ".join(str(i) for i in ids))
            if tokenizer is not None:
                print(f"stream {s}: {_decode(tokenizer, ids)}")
        return 0
    if args.speculate:
        from .speculate import SpecStats
        stats = SpecStats()
        try:
            ids = generate_speculative(model, prompt_ids, args.max_new_tokens, params, draft_tokens=args.speculate,
                                       seed=args.seed, stats=stats, stop_at_eos=not args.ignore_eos,
                                       eos_id=eos_id, progress=printer)
        except ValueError as e:
            parser.error(f"--speculate {args.speculate}: {e}")
        printer.finish(len(ids), len(prompt_ids), time.perf_counter() - start)
        print(f"speculative decoding (up to {args.speculate} drafts a pass): {stats.summary()}", file=sys.stderr)
    else:
        ids = generate(model, prompt_ids, args.max_new_tokens, Sampler(params, seed=args.seed),
                       stop_at_eos=not args.ignore_eos, eos_id=eos_id, progress=printer)
        printer.finish(len(ids), len(prompt_ids), time.perf_counter() - start)

    print(" ".join(str(i) for i in ids))
    if tokenizer is not None:
        print(_decode(tokenizer, ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
