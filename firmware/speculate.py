"""Host side of speculative decoding with prompt-lookup drafts.

One decoding step of speculative decoding has three parts:

1. **Draft** (`draft`): up to k candidate ids are read off the context itself: the ids that followed
   the most recent earlier occurrence of the context's last n-gram (prompt lookup; there is no draft
   model).
2. **Verify** (on the NPU): one program runs the k+1 positions "last accepted id, drafts[0], ...,
   drafts[k-1]" and returns one float logits row per position, so row j holds the logits of the
   position after ``context + drafts[:j]``.
3. **Accept** (`accept`): the speculative-sampling rule (Leviathan et al., "Fast Inference from
   Transformers via Speculative Decoding", 2023; Chen et al., "Accelerating Large Language Model
   Decoding with Speculative Sampling", 2023) with a deterministic draft keeps a prefix of the drafts
   and appends one id of its own, 1 to k+1 ids in all. The ids it emits have exactly the distribution
   that plain decoding with `firmware.sampling` gives, one position at a time; greedy decoding gives
   exactly the same ids.

The key/value entries that the verify pass wrote for rejected drafts belong to positions that did not
happen: `firmware.runtime.Runtime.rollback` gives them back their earlier bytes and the stream its position
after the kept ids. `SpecStats` counts drafted and
accepted ids per verify pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from firmware.sampling import SamplingParams, draw, next_token_distribution

__all__ = ["draft", "accept", "SpecStats"]


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value!r}")
    return int(value)


def _check_ids(name: str, ids) -> list[int]:
    """`ids` (any iterable of integers) as a list of Python ints, each checked to be >= 0."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Iterable, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of token ids, not {ids!r}")
    out = list(ids.tolist() if isinstance(ids, np.ndarray) else ids)
    for j, i in enumerate(out):
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{name}[{j}] must be an integer token id, not {i!r}")
        if i < 0:
            raise ValueError(f"{name}[{j}] must be a token id >= 0, not {i!r}")
    return [int(i) for i in out]


def draft(context_ids: Iterable[int], k: int, *, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` draft ids by prompt lookup: what followed the context's last n-gram the last time.

    With ``L = len(context_ids)`` and ``c = context_ids``, for ``n = max_ngram, max_ngram - 1, ...,
    min_ngram`` in turn: the suffix is ``c[L-n:]``; a match is a start ``s`` with ``c[s:s+n] ==
    c[L-n:]`` and ``s < L - n`` (an earlier occurrence, never the suffix itself, which also leaves at
    least one id after the match). The first n that has a match decides: with ``s`` the largest (most
    recent) match, the drafts are ``c[s+n : s+n+k]``, fewer than `k` when the context ends first. These
    ids may run into the suffix itself (in ``c = [1, 2, 1, 2, 1, 2]`` the 3-gram ``[2, 1, 2]`` matches at
    ``s = 1`` and the drafts are ``[1, 2]``), so periodic text drafts its own continuation. When no n
    has a match (including ``L <= min_ngram``), or ``k == 0``, the result is ``[]``.

    Parameters
    ----------
    context_ids : iterable of int
        The prompt and every id generated so far, in order; ids are integers ``>= 0``.
    k : int
        The most ids to propose, ``>= 0``.
    max_ngram, min_ngram : int
        The longest and shortest suffix tried, ``1 <= min_ngram <= max_ngram``. Longer suffixes are
        tried first because a longer match predicts the continuation better.

    Raises
    ------
    TypeError, ValueError
        For an argument of the wrong type or value; the message names the argument.
    """
    ids = _check_ids("context_ids", context_ids)
    k = _check_count("k", k, 0)
    max_ngram = _check_count("max_ngram", max_ngram, 1)
    min_ngram = _check_count("min_ngram", min_ngram, 1)
    if min_ngram > max_ngram:
        raise ValueError(f"min_ngram must be <= max_ngram, not min_ngram={min_ngram}, max_ngram={max_ngram}")
    length = len(ids)
    if k == 0 or length < 2:
        return []
    c = np.asarray(ids, dtype=object if max(ids) >= 2**63 else np.int64)
    # n can be at most L - 1: a match at s >= 0 needs s < L - n.
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Window s of c[:L-1] is c[s:s+n] for s = 0 .. L-1-n, exactly the starts with s < L - n.
        windows = sliding_window_view(c[:length - 1], n)
        starts = np.flatnonzero(np.all(windows == c[length - n:], axis=1))
        if starts.size:
            s = int(starts[-1])
            return ids[s + n:s + n + k]
    return []


def _check_rows(logits_rows, n_drafts: int) -> tuple[list, int]:
    """The rows of `logits_rows` as a list, checked to be ``n_drafts + 1`` 1-D rows of one length."""
    if isinstance(logits_rows, np.ndarray):
        if logits_rows.ndim != 2:
            raise ValueError(f"logits_rows must be one 1-D row per position, not shape {logits_rows.shape}")
        rows = list(logits_rows)
    elif isinstance(logits_rows, Sequence) and not isinstance(logits_rows, (str, bytes)):
        rows = list(logits_rows)
    else:
        raise TypeError(f"logits_rows must be a sequence of logits rows, not {logits_rows!r}")
    if len(rows) != n_drafts + 1:
        raise ValueError(f"logits_rows must have len(drafts) + 1 = {n_drafts + 1} rows, not {len(rows)}")
    shapes = [np.shape(r) for r in rows]
    if any(len(s) != 1 for s in shapes) or len(set(shapes)) != 1:
        raise ValueError(f"logits_rows must be 1-D rows of one vocabulary size, not shapes {shapes}")
    return rows, shapes[0][0]


def accept(logits_rows, context_ids: Iterable[int], drafts: Sequence[int], params: SamplingParams,
           rng: np.random.Generator) -> list[int]:
    """The ids one verify pass emits: the accepted prefix of `drafts`, then one correction or bonus id.

    With ``k = len(drafts)`` and, for each position j, ``p_j = next_token_distribution(logits_rows[j],
    context_ids + emitted, params)`` where ``emitted`` is every draft accepted before j (so the repetition
    penalty sees exactly the context that plain decoding would), for ``j = 0, 1, ..., k-1`` with
    ``d = drafts[j]``:

    - **Greedy** (``params.greedy``): ``d`` is accepted iff it is the greedy id ``argmax(p_j)`` (ties
      to the lowest id); otherwise the greedy id is emitted and the pass ends.
    - **Sampling**: ``u = rng.random()``; ``d`` is accepted iff ``u < p_j[d]``. Otherwise the
      correction id is drawn with `firmware.sampling.draw` from the residual ``max(p_j − q, 0)``, q the
      point mass at ``d``: that is ``p_j`` with ``p_j[d]`` set to 0 (``draw`` normalises), and the pass
      ends. The residual is never empty on rejection: ``p_j[d] == 1`` makes every ``u < 1`` accept.

    If all k drafts are accepted, a bonus id comes from ``p_k`` (row k): its argmax when greedy, else
    `draw`. With ``k == 0`` this is exactly one plain decoding step, the id `firmware.sampling.Sampler`
    gives from the same generator state.

    Random numbers are consumed in this fixed order, so a run is reproducible from the generator's
    seed: one uniform per examined draft (drafts 0, 1, ... up to and including the first rejected
    one), then the one uniform of ``draw`` for the correction or bonus id; ``1 + (drafts examined)``
    in all. Greedy decoding consumes none.

    Parameters
    ----------
    logits_rows : sequence of 1-D arrays, or a 2-D array
        ``len(drafts) + 1`` logits rows of one vocabulary size; row j is for the position after
        ``context_ids + drafts[:j]``. Rows after the first rejection are not used.
    context_ids : iterable of int
        The prompt and every id generated before this pass.
    drafts : sequence of int
        The drafted ids, each in the vocabulary.
    params : SamplingParams
        The same settings plain decoding uses.
    rng : numpy.random.Generator
        The generator the draws come from (only its ``random()`` is called).

    Returns
    -------
    list of int
        ``drafts[:a]`` followed by one more id, where ``a`` is the number of accepted drafts:
        1 to ``len(drafts) + 1`` ids.

    Notes
    -----
    The first emitted id has distribution ``p_0``: it is ``d`` with probability ``p_0[d]``, and any
    ``y != d`` with probability ``(1 − p_0[d]) · p_0[y] / (1 − p_0[d]) = p_0[y]``. Given that ``d`` was
    accepted, the next id is decided the same way from ``p_1``, which is the distribution plain
    decoding uses after ``d``; by induction every emitted id has the plain-decoding distribution.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, not {params!r}")
    if not (isinstance(drafts, (Sequence, np.ndarray)) and not isinstance(drafts, (str, bytes))):
        raise TypeError(f"drafts must be a sequence of token ids, not {drafts!r}")
    drafts = _check_ids("drafts", drafts)
    rows, vocab_size = _check_rows(logits_rows, len(drafts))
    for j, d in enumerate(drafts):
        if d >= vocab_size:
            raise ValueError(f"drafts[{j}] = {d} is outside the vocabulary [0, {vocab_size})")
    context = _check_ids("context_ids", context_ids)
    if not params.greedy and not callable(getattr(rng, "random", None)):
        raise TypeError(f"rng must be a numpy.random.Generator, not {rng!r}")

    emitted: list[int] = []
    for j, d in enumerate(drafts):
        p = next_token_distribution(rows[j], context + emitted, params)
        if params.greedy:
            best = int(np.argmax(p))
            if d != best:
                return emitted + [best]
        elif not rng.random() < p[d]:
            residual = p.copy()
            residual[d] = 0.0
            # p[d] < 1 leaves mass elsewhere; the check only guards against rounding of a one-hot p.
            if residual.sum() > 0:
                return emitted + [draw(residual, rng)]
        emitted.append(d)
    p = next_token_distribution(rows[len(drafts)], context + emitted, params)
    return emitted + [int(np.argmax(p)) if params.greedy else draw(p, rng)]


@dataclass
class SpecStats:
    """Running counts of speculative decoding, updated with `add` after every verify pass.

    Attributes
    ----------
    drafted : int
        Draft ids sent to verification.
    accepted : int
        Draft ids accepted (every pass emits its accepted drafts plus one id of its own).
    passes : int
        Verify passes.
    emitted : int
        Ids emitted, ``accepted + passes``.
    """

    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    emitted: int = 0

    def add(self, drafted: int, emitted: int) -> None:
        """Count one verify pass that checked `drafted` drafts and emitted `emitted` ids (``len(accept(...))``)."""
        drafted = _check_count("drafted", drafted, 0)
        emitted = _check_count("emitted", emitted, 1)
        if emitted > drafted + 1:
            raise ValueError(f"emitted must be <= drafted + 1 = {drafted + 1}, not {emitted}")
        self.drafted += drafted
        self.accepted += emitted - 1
        self.passes += 1
        self.emitted += emitted

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted ids; 0.0 before anything is drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Emitted ids per verify pass (1.0 is plain decoding); 0.0 before the first pass."""
        return self.emitted / self.passes if self.passes else 0.0

    def summary(self) -> str:
        """One line: passes, emitted ids per pass, and accepted over drafted ids."""
        return (f"{self.emitted} tokens in {self.passes} verify passes ({self.tokens_per_pass:.2f} tokens/pass); "
                f"{self.accepted}/{self.drafted} drafts accepted ({self.acceptance_rate:.1%})")
