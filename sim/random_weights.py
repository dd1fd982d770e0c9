"""Seeded random Gemma 3n weights for any `ModelConfig`: test inputs and the packer's ``--model`` presets.

The value ranges follow ``tests/fixtures/hf_gemma3n_tiny.py`` (and for the same reason): norm gains and
``correct_output_scale`` in U(0.5, 1.5) so that no path is switched off (transformers' own init leaves
``correct_output_scale`` at 0, which disables PLE), a strong AltUp router, ``[out, in]`` linear weights
with std 1/sqrt(fan_in), embeddings scaled so that logits are O(10) and the soft-cap matters.
"""

from __future__ import annotations

import zlib

import numpy as np

from .config import ModelConfig

__all__ = ["random_tensors"]


def _draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("correct_output_scale") or (name.endswith("norm.weight") and len(shape) == 1):
        return rng.uniform(0.5, 1.5, shape)
    if name == "embed_tokens.weight":
        # std 8 / sqrt(D) keeps logits O(10) at any width (N(0, 1) at D = 64, as in the oracle), so the
        # 30 tanh(x / 30) soft-cap matters without saturating.
        return rng.normal(0.0, 8.0 / np.sqrt(shape[1]), shape)
    if name == "embed_tokens_per_layer.weight":
        return rng.normal(0.0, 0.5, shape)
    if name.endswith("altup.modality_router.weight"):
        # The router sees RMSNorm(x) / D, so it needs a large weight to leave tanh's linear range.
        return rng.normal(0.0, 4.0, shape)
    if name.endswith("prediction_coefs.weight") or name.endswith("correction_coefs.weight"):
        return rng.normal(0.0, 0.25, shape)
    if len(shape) == 2:
        return rng.normal(0.0, shape[1] ** -0.5, shape)
    return rng.normal(0.0, 0.1, shape)


def random_tensors(cfg: ModelConfig, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Every tensor of `cfg.tensor_shapes()` (Hugging Face names, ``[out, in]``), filled with seeded
    random values. Each tensor has its own generator seeded from (seed, crc32(name)), so a tensor's
    values do not depend on which other tensors exist."""
    out = {}
    for name, shape in cfg.tensor_shapes().items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        out[name] = _draw(name, shape, rng).astype(dtype)
    return out
