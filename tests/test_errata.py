"""Each spec erratum (docs/gemma3n-errata.md) pinned by a test.

For every place where the pccx spec disagrees with the real Gemma 3n, a subclass of the golden model
implements the spec's version of that one step. The test shows that the spec's version does not
reproduce transformers (the float64 oracle fixture) by a wide margin, while the golden model does to
1e-9 (tests/test_gemma3n.py). If someone "fixes" the golden model towards the spec, both fail.
"""

import math

import numpy as np
import pytest

from sim.gemma3n import Model
from tests.oracle import fixture_paths, load_case

GOLDEN_TOL = 1e-9


def run(model_cls, case):
    model = model_cls.from_hf(case.config, case.tensors, dtype=np.float64)
    return np.stack([model.step(t) for t in case.input_ids])


@pytest.fixture(scope="module")
def case():
    # 10 layers, window 4 crossed by 12 steps, KV sharing, 3 sparse layers, id 313 outside the PLE vocab.
    return load_case(fixture_paths("f64_s0_l10")[0])


def max_err(model_cls, case):
    return float(np.max(np.abs(run(model_cls, case) - case.logits)))


def test_golden_model_matches(case):
    assert max_err(Model, case) <= GOLDEN_TOL


class SpecAltUpCorrect(Model):
    """D1, spec 4.E: activated = outputs * altup_scale feeds the router, the innovation and the PLE gate."""

    def _altup_correct(self, i, pred, out):
        self._activated = out * self.weights[f"layers.{i}.altup.correct_output_scale"]
        return super()._altup_correct(i, pred, self._activated)

    def _ple_gate_input(self, i, corrected):
        return self._activated


class SpecAltUpInit(Model):
    """D2, spec 2: xs[k+1] = x0 . altup_projs[k] with no magnitude matching."""

    def _altup_init(self, x0):
        n = self.config.altup_num_inputs
        return np.stack([x0] + [self.weights.matvec(f"altup_projections.{k}.weight", x0) for k in range(n - 1)])


class SpecNoVNorm(Model):
    """D3, spec 4.B: V stored as projected, no RMSNorm."""

    def _v_norm(self, v):
        return v


class SpecInterleavedRope(Model):
    """D4, spec section 0: RoPE on interleaved pairs (x_2i, x_2i+1)."""

    def _rope(self, x, pos, theta):
        angle = pos * self._inv_freq[theta]
        cos, sin = np.cos(angle), np.sin(angle)
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
        out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
        return out


class SpecNoSlidingWindow(Model):
    """D5, spec 4.B-4/5: every layer attends to all pos + 1 cached positions."""

    def _window(self, layer):
        return None


class SpecScaledScores(Model):
    """D6, spec section 0 GQA formula: scores = Q K^T / sqrt(d_head)."""

    def _scores(self, q, k):
        return q @ k.T / math.sqrt(self.config.head_dim)


class SpecPleIdClip(Model):
    """D7, spec 1: token_id = min(token_id, V_ple - 1) for the PLE lookup (262143 in E4B)."""

    def _ple_id(self, token_id):
        return min(token_id, self.config.vocab_size_per_layer_input - 1)


class SpecFp16KvCache(Model):
    """D9, spec 4.B-4: the KV cache stores float16."""

    def reset(self):
        super().reset()
        for store in self._kv.values():
            append = store.append
            store.append = lambda pos, k, v, append=append: append(pos, k.astype(np.float16), v.astype(np.float16))


class SpecTopkAsWritten(Model):
    """D10, spec 002 section 4: 'square -> reduce_sum -> x 1/N -> sqrt' is the RMS, not the std."""

    def _gaussian_topk(self, g, multiplier):
        rms = np.sqrt(np.mean(g * g))
        return np.maximum(g - (np.mean(g) + rms * multiplier), 0.0)


class BesselTopk(Model):
    """D10, second opinion (llama.cpp): the sample std with 1/(n-1)."""

    def _gaussian_topk(self, g, multiplier):
        return np.maximum(g - (np.mean(g) + np.std(g, ddof=1) * multiplier), 0.0)


@pytest.mark.parametrize("variant, at_least", [
    (SpecAltUpCorrect, 1.0),      # measured 39.7
    (SpecAltUpInit, 1.0),         # measured 21.3
    (SpecNoVNorm, 1.0),           # measured 22.5
    (SpecInterleavedRope, 1.0),   # measured 30.1
    (SpecNoSlidingWindow, 1.0),   # measured 39.2
    (SpecScaledScores, 1.0),      # measured 29.2
    (SpecPleIdClip, 1.0),         # measured 15.2, only from the step with id 313 on
    (SpecTopkAsWritten, 0.5),     # measured 1.21
    (BesselTopk, 1e-3),           # measured 1.52(n = 128 here; 3e-5 relative std change at n = 16384)
    (SpecFp16KvCache, 1e-6),      # measured 0.049: rounding only, far outside the 1e-9 bound
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_spec_version_does_not_reproduce_transformers(case, variant, at_least):
    assert max_err(variant, case) >= at_least


def test_ple_id_clip_only_matters_from_the_out_of_vocab_id(case):
    # D7 changes nothing before id 313 (step 3) is seen; the embedding itself reads the raw id.
    steps = int(np.argmax(case.input_ids >= case.config["vocab_size_per_layer_input"]))
    got = run(SpecPleIdClip, case)
    np.testing.assert_allclose(got[:steps], case.logits[:steps], rtol=0, atol=GOLDEN_TOL)
    assert np.max(np.abs(got[steps] - case.logits[steps])) > 1.0


def test_sliding_window_only_matters_once_crossed(case):
    # D5 changes nothing while every position is still inside the window.
    w = case.config["sliding_window"]
    got = run(SpecNoSlidingWindow, case)
    np.testing.assert_allclose(got[:w], case.logits[:w], rtol=0, atol=GOLDEN_TOL)


def test_unembed_clamp_d8():
    # D8: transformers clamps the mean square at 1e-5 (an RMS floor of 3.16e-3); the spec clamps the RMS
    # at 1e-12. They differ only for a near-zero stream, which is where this test puts one.
    cfg_case = load_case(fixture_paths("f64_s0_l10")[0])
    model = Model.from_hf(cfg_case.config, cfg_case.tensors)
    x = np.full(64, 1e-4)
    target = 2.0
    hf = x * target / math.sqrt(1e-5)            # mean(x^2) = 1e-8 < 1e-5 -> clamped
    spec = x * target / max(1e-4, 1e-12)          # rms(x) = 1e-4
    got = model._magnitude_match(x, target)
    np.testing.assert_allclose(got, hf, rtol=1e-15)
    assert not np.allclose(got, spec)


def test_kv_cache_keeps_model_dtype(case):
    # D9: the cache holds the model dtype (float64 here), not float16.
    model = Model.from_hf(case.config, case.tensors, dtype=np.float64)
    model.step(2)
    assert all(store.k.dtype == np.float64 and store.v.dtype == np.float64 for store in model._kv.values())


def test_spec_as_written_loses_the_argmax(case):
    # All of D1-D5, D7 and D10-as-written together (the spec's own page 001 agrees with transformers on
    # D6): the greedy token differs from transformers' on most steps.
    class Spec(SpecAltUpCorrect, SpecAltUpInit, SpecNoVNorm, SpecInterleavedRope, SpecNoSlidingWindow,
               SpecPleIdClip, SpecTopkAsWritten):
        pass

    got = run(Spec, case)
    agree = np.mean(np.argmax(got, axis=1) == np.argmax(case.logits, axis=1))
    assert agree <= 0.25
