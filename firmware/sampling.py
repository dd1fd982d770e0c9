"""Host-side next-token sampling (spec section 6): repetition penalty, temperature, top-p.

The NPU returns the soft-capped logits of one position; everything after that runs on the host, in
float64, in this order:

1. **Repetition penalty** ρ (Hugging Face's ``RepetitionPenaltyLogitsProcessor``): for every token id
   that already occurs in the context (prompt + generated so far), once per distinct id however often
   it occurs, ``logit ← logit·ρ`` if ``logit < 0`` else ``logit/ρ``. Ids not in the context are left
   alone. (Applying ρ to *all* ids would be a different, wrong, distribution.)
2. **Temperature** T. ``T = 0`` is greedy decoding: the next id is ``argmax`` of the penalised logits,
   ties going to the lowest id. For ``T > 0``: ``z = logits/T − max(logits/T)``,
   ``probs = exp(z)/Σexp(z)``.
3. **Top-p** (nucleus) p: sort the ids by probability, descending, ties by lower id first (a stable
   sort); keep ``{i : cumsum(sorted)_i − sorted_i < p}``, i.e. the smallest prefix whose mass reaches
   p (never fewer than one token; ``p >= 1`` keeps every id); renormalise the kept probabilities.
4. **Draw** from the categorical distribution with a seeded `numpy.random.Generator` (see `draw`).

`Sampler` bundles a `SamplingParams` with its own generator, so a run is reproducible from its seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingParams", "apply_repetition_penalty", "next_token_distribution", "draw", "Sampler"]


def _check_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits.

    Parameters
    ----------
    temperature : float
        Softmax temperature; ``0`` means greedy (argmax) decoding. Must be finite and ``>= 0``.
    top_p : float
        Nucleus mass, in ``(0, 1]``; ``1`` disables top-p.
    repetition_penalty : float
        ρ of the repetition penalty, finite and ``> 0``; ``1`` disables it. The spec's 1.15 is the
        default.
    """

    temperature: float = 1.0
    top_p: float = 0.9
    repetition_penalty: float = 1.15

    def __post_init__(self):
        t = _check_real("temperature", self.temperature)
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature!r}")
        p = _check_real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        _check_penalty(self.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_penalty(penalty) -> float:
    r = _check_real("repetition_penalty", penalty)
    if not (math.isfinite(r) and r > 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0, not {penalty!r}")
    return r


def _check_logits(logits) -> np.ndarray:
    """A float64 copy of `logits`, which must be a non-empty, finite, real 1-D array."""
    a = np.asarray(logits)
    if a.dtype.kind not in "iuf":
        raise TypeError(f"logits must be an array of real numbers, not dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"logits must be a 1-D array over the vocabulary, not shape {a.shape}")
    if a.size == 0:
        raise ValueError("logits must not be empty")
    a = a.astype(np.float64)  # always a copy: callers' arrays are never modified
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        raise ValueError(f"logits must be finite, but logits[{bad[0]}] is {float(a[bad[0]])!r}")
    return a


def _check_context(context_ids, vocab_size: int) -> np.ndarray:
    """The distinct ids of `context_ids` (any iterable of integers), each checked to be in the vocab."""
    ids = list(context_ids.tolist() if isinstance(context_ids, np.ndarray) else context_ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"context ids must be integers, not {i!r}")
        if not 0 <= i < vocab_size:
            raise ValueError(f"context id {i} is outside the vocabulary [0, {vocab_size})")
    return np.unique(np.asarray(ids, dtype=np.int64))


def apply_repetition_penalty(logits: np.ndarray, context_ids: Iterable[int], penalty: float) -> np.ndarray:
    """Penalise the ids that occur in the context; returns a new float64 array.

    Every distinct id of `context_ids` is penalised exactly once: a negative logit is multiplied by
    `penalty`, a zero or positive one divided by it (so a zero logit stays zero). All other ids are
    unchanged, as in Hugging Face's ``RepetitionPenaltyLogitsProcessor``.
    """
    out = _check_logits(logits)
    rho = _check_penalty(penalty)
    ids = _check_context(context_ids, out.size)
    picked = out[ids]
    out[ids] = np.where(picked < 0, picked * rho, picked / rho)
    return out


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p filter of a probability vector: zeros outside the nucleus, renormalised inside."""
    if top_p >= 1:
        return probs
    # Negating makes the stable ascending sort a descending one that keeps equal probabilities in id
    # order, i.e. ties go to the lower id.
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    # The spec's rule, literally: the mass strictly before token i is below p. The first token always
    # passes (x − x == 0 exactly, and p > 0).
    keep = np.cumsum(sorted_probs) - sorted_probs < top_p
    out = np.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out / out.sum()


def next_token_distribution(logits, context_ids: Iterable[int], params: SamplingParams) -> np.ndarray:
    """The float64 distribution the next id is drawn from.

    Penalty, then temperature and top-p, as in the module docstring; ids outside the nucleus have
    probability zero. For ``temperature == 0`` the result is a one-hot vector at the greedy id
    (argmax of the penalised logits, ties to the lowest id).
    """
    penalised = apply_repetition_penalty(logits, context_ids, params.repetition_penalty)
    if params.greedy:
        onehot = np.zeros_like(penalised)
        onehot[np.argmax(penalised)] = 1.0  # np.argmax returns the first, i.e. lowest, maximal id
        return onehot
    scaled = penalised / params.temperature
    z = scaled - scaled.max()
    e = np.exp(z)
    return _nucleus(e / e.sum(), float(params.top_p))


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One categorical draw from `probs` (non-negative, not necessarily normalised).

    Exactly one ``u = rng.random()`` is consumed; the result is the first id, in id order, whose
    float64 cumulative probability exceeds ``u·total`` (``total`` = the last cumulative value). Ids of
    probability zero are never returned. The same generator state therefore always gives the same id,
    independent of NumPy's ``Generator.choice`` implementation.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 1 or probs.size == 0:
        raise ValueError(f"probs must be a non-empty 1-D array, not shape {probs.shape}")
    if np.any(probs < 0):
        raise ValueError(f"probs must be non-negative, but probs[{np.flatnonzero(probs < 0)[0]}] is "
                         f"{float(probs[probs < 0][0])!r}")
    cdf = np.cumsum(probs)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"probs must have a positive finite sum, not {total!r}")
    u = rng.random()
    # side="right" gives the first index i with cdf[i] > u·total; u < 1 keeps i below len(cdf).
    return int(np.searchsorted(cdf, u * total, side="right"))


class Sampler:
    """Chooses next tokens with fixed `SamplingParams` and its own seeded random generator.

    Parameters
    ----------
    params : SamplingParams
        The sampling settings.
    seed : int
        Seed of the ``numpy.random.default_rng`` the sampler owns. The same seed, params and logits
        give the same ids. Greedy decoding (``temperature == 0``) consumes no random numbers.
    """

    def __init__(self, params: SamplingParams = SamplingParams(), seed: int = 0):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {params!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an integer, not {seed!r}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, not {seed!r}")
        self._params = params
        self._seed = int(seed)
        self._rng = np.random.default_rng(self._seed)

    @property
    def params(self) -> SamplingParams:
        return self._params

    @property
    def seed(self) -> int:
        return self._seed

    def __call__(self, logits, context_ids: Iterable[int]) -> int:
        """The next token id, given this position's `logits` and every id so far (prompt + generated)."""
        probs = next_token_distribution(logits, context_ids, self._params)
        if self._params.greedy:
            return int(np.argmax(probs))
        return draw(probs, self._rng)
