"""The golden model against Hugging Face transformers (the oracle fixtures) and its input checks."""

import re

import numpy as np
import pytest

from sim.config import PRESETS, ModelConfig
from sim.gemma3n import Model, gaussian_std_multiplier, gelu_tanh
from sim.random_weights import random_tensors
from tests.oracle import TRAINED, fixture_paths, load_case, load_checkpoint_case

# Bounds of the golden model against transformers, stated in docs/golden-model.md.
# float64 golden vs transformers --float64: measured 2.4e-12 at worst; float32 golden vs transformers
# float32: measured 3.6e-4 at worst (different summation order, logits of magnitude ~25).
TOL = {np.float64: 1e-9, np.float32: 5e-3}


@pytest.mark.parametrize("path", fixture_paths(), ids=lambda p: p.stem)
def test_matches_transformers_every_step(path):
    case = load_case(path)
    model = Model.from_hf(case.config, case.tensors, dtype=case.dtype)
    assert model.config.num_hidden_layers == case.config["num_hidden_layers"]
    for step, token in enumerate(case.input_ids):
        logits = model.step(token)
        assert logits.dtype == case.dtype
        err = np.max(np.abs(logits.astype(np.float64) - case.logits[step]))
        assert err <= TOL[case.dtype], f"{case.name} step {step} (token {token}): max |dlogit| = {err:.3e}"


@pytest.mark.parametrize("path", fixture_paths("f64"), ids=lambda p: p.stem)
def test_float32_mode_tracks_float64_oracle(path):
    # The float32 mode runs the same code with float32 arithmetic; against the float64 oracle it must
    # stay within the float32 bound as well.
    case = load_case(path)
    model = Model.from_hf(case.config, case.tensors, dtype=np.float32)
    got = np.stack([model.step(t) for t in case.input_ids]).astype(np.float64)
    assert np.max(np.abs(got - case.logits)) <= TOL[np.float32]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_trained_model_matches_transformers_every_step(dtype):
    # The built-in trained model (firmware/models/gemma3n-tiny-pydoc), read from its checkpoint directory as
    # `firmware.generate` reads it, against transformers --float64 on 80 tokens of its held-out text
    # (positions 64..79 lie beyond the sliding window). Trained weights, unlike random ones, give the logits
    # a distribution that generation depends on; the bounds are the random fixtures' (TOL).
    from firmware.generate import BUILTIN_MODEL

    case = load_checkpoint_case(TRAINED / "f64_pydoc_80.npz", BUILTIN_MODEL)
    cfg = ModelConfig.from_hf(case.config)
    assert len(case.input_ids) > cfg.sliding_window and cfg.sparse_layers and cfg.num_kv_shared_layers
    model = Model.from_pretrained(BUILTIN_MODEL, dtype=dtype)
    got = np.stack([model.step(t) for t in case.input_ids]).astype(np.float64)
    err = np.max(np.abs(got - case.logits), axis=1)
    assert np.all(err <= TOL[dtype]), f"step {int(np.argmax(err))}: max |dlogit| = {err.max():.3e}"


def test_fixtures_cover_the_features():
    # The committed fixtures must keep exercising what the golden model has to get right.
    cases = [load_case(p) for p in fixture_paths()]
    assert {c.dtype for c in cases} == {np.float32, np.float64}
    for c in cases:
        cfg = ModelConfig.from_hf(c.config)
        assert len(c.input_ids) > cfg.sliding_window, f"{c.name}: sequence does not cross the window"
        assert np.any(c.input_ids >= cfg.vocab_size_per_layer_input), f"{c.name}: no id outside PLE vocab"
    assert any(ModelConfig.from_hf(c.config).num_kv_shared_layers for c in cases)
    assert any(ModelConfig.from_hf(c.config).sparse_layers for c in cases)
    assert len({ModelConfig.from_hf(c.config).num_hidden_layers for c in cases}) >= 3


def test_reset_replays_bit_identically():
    case = load_case(fixture_paths("f64")[0])
    model = Model.from_hf(case.config, case.tensors)
    first = [model.step(t) for t in case.input_ids]
    model.reset()
    assert model.position == 0
    second = [model.step(t) for t in case.input_ids]
    np.testing.assert_array_equal(np.stack(first), np.stack(second))


@pytest.mark.parametrize("prefix", ["", "model.", "model.language_model."])
def test_tensor_name_prefixes(prefix):
    case = load_case(fixture_paths("f64_s0")[0])
    bare = {k.removeprefix("model."): v for k, v in case.tensors.items()}
    model = Model.from_hf(case.config, {prefix + k: v for k, v in bare.items()})
    np.testing.assert_array_equal(model.step(case.input_ids[0]),
                                  Model.from_hf(case.config, case.tensors).step(case.input_ids[0]))


def test_dead_kv_tensors_of_shared_layers_are_ignored():
    # transformers 4.5x checkpoints carry k/v/k_norm weights for the KV-shared layers; they must not be
    # used (the shared layers read the cache of the last non-shared layer of their type).
    case = load_case(fixture_paths("f64_s0")[0])
    cfg = ModelConfig.from_hf(case.config)
    rng = np.random.default_rng(0)
    tensors = dict(case.tensors)
    for i in range(cfg.first_kv_shared_layer, cfg.num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = rng.normal(size=(cfg.kv_dim, cfg.hidden_size))
        tensors[f"model.layers.{i}.self_attn.v_proj.weight"] = rng.normal(size=(cfg.kv_dim, cfg.hidden_size))
        tensors[f"model.layers.{i}.self_attn.k_norm.weight"] = rng.normal(size=(cfg.head_dim,))
    model = Model.from_hf(case.config, tensors)
    for step, token in enumerate(case.input_ids):
        assert np.max(np.abs(model.step(token) - case.logits[step])) <= TOL[np.float64]


def test_missing_tensor_names_tensor_and_shape():
    case = load_case(fixture_paths("f64_s0")[0])
    tensors = dict(case.tensors)
    del tensors["model.layers.2.mlp.down_proj.weight"]
    cfg = ModelConfig.from_hf(case.config)
    shape = re.escape(str((cfg.hidden_size, cfg.intermediate_size[2])))
    with pytest.raises(ValueError, match=rf"missing tensor 'layers\.2\.mlp\.down_proj\.weight' "
                                         rf"\(expected shape {shape}\)"):
        Model.from_hf(case.config, tensors)


def test_wrong_shape_names_tensor_and_expected_shape():
    case = load_case(fixture_paths("f64_s0")[0])
    tensors = dict(case.tensors)
    cfg = ModelConfig.from_hf(case.config)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = q.T  # [in, out]: the wrong orientation
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' has shape "
                                         + re.escape(f"{q.T.shape}; expected {(cfg.q_dim, cfg.hidden_size)}")):
        Model.from_hf(case.config, tensors)


def test_unknown_and_duplicate_tensors_are_rejected():
    case = load_case(fixture_paths("f64_s0")[0])
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.0\.mlp\.gate\.weight'"):
        Model.from_hf(case.config, {**case.tensors, "model.layers.0.mlp.gate.weight": np.zeros(3)})
    with pytest.raises(ValueError, match=r"tensor 'norm\.weight' is given twice"):
        Model.from_hf(case.config, {**case.tensors, "norm.weight": case.tensors["model.norm.weight"]})


def test_non_text_components_are_skipped():
    case = load_case(fixture_paths("f64_s0")[0])
    tensors = {**case.tensors, "model.vision_tower.timm_model.stem.conv.weight": np.zeros((2, 2)),
               "model.embed_audio.embedding.weight": np.zeros((3, 4))}
    np.testing.assert_array_equal(Model.from_hf(case.config, tensors).step(2),
                                  Model.from_hf(case.config, case.tensors).step(2))


def test_token_and_position_limits():
    cfg = PRESETS["tiny"].replace(max_position_embeddings=3)
    model = Model.from_hf(cfg, random_tensors(cfg, 0), dtype=np.float32)
    with pytest.raises(ValueError, match=rf"token id {cfg.vocab_size} is outside the vocabulary "
                                         rf"\[0, {cfg.vocab_size}\)"):
        model.step(cfg.vocab_size)
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        model.step(-1)
    for _ in range(3):
        model.step(5)
    with pytest.raises(ValueError, match=r"position 3 reaches max_position_embeddings \(3\)"):
        model.step(5)


def test_dtype_must_be_float32_or_float64():
    cfg = PRESETS["tiny"]
    with pytest.raises(ValueError, match="dtype must be float32 or float64, not float16"):
        Model.from_hf(cfg, random_tensors(cfg, 0), dtype=np.float16)


def test_gelu_tanh_known_values():
    # GELU-tanh by hand: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    x = np.array([-3.0, -1.0, 0.0, 0.5, 2.0])
    expected = [0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3))) for v in x]
    np.testing.assert_allclose(gelu_tanh(x), expected, rtol=1e-15, atol=1e-300)
    assert gelu_tanh(np.float32([1.0])).dtype == np.float32


def test_std_multiplier_is_torch_float32_icdf():
    # transformers: Normal(0, 1).icdf(tensor(0.95, float32)) -> 1.6448535919189453 (float32), the nearest
    # float32 to the true 95th percentile 1.6448536269514722.
    # Known answers printed by torch 2.13.0: Normal(0, 1).icdf(torch.tensor(p)).item().
    torch_icdf = {0.5: 0.0, 0.75: 0.6744897365570068, 0.9: 1.281551480293274, 0.95: 1.6448535919189453,
                  0.99: 2.326348304748535}
    for p, expected in torch_icdf.items():
        assert gaussian_std_multiplier(p) == expected, p


def test_e4b_dimensions_run_the_same_code():
    # E4B's layer dims (D 2048, 8/2 heads of 256, FFN 16384, PLE 256, LAuReL 64, 4 AltUp streams) with
    # two layers and a small vocabulary, so that the test stays small; float32 and float64 agree.
    e4b = PRESETS["e4b"]
    cfg = e4b.replace(num_hidden_layers=2, intermediate_size=e4b.intermediate_size[:2],
                      activation_sparsity_pattern=(0.95, 0.0), layer_types=e4b.layer_types[:2],
                      num_kv_shared_layers=0, vocab_size=512, vocab_size_per_layer_input=256)
    tensors = random_tensors(cfg, seed=7)
    m32 = Model.from_hf(cfg, tensors, dtype=np.float32)
    m64 = Model.from_hf(cfg, tensors, dtype=np.float64)
    for token in (2, 300, 17):  # 300 is outside the PLE vocabulary of this config
        a, b = m32.step(token), m64.step(token)
        assert a.shape == (cfg.vocab_size,) and np.all(np.abs(b) <= cfg.final_logit_softcapping)
        assert np.max(np.abs(a - b)) < 5e-3


def test_sliding_window_of_one_follows_the_mask():
    # transformers' decode path is wrong for a window of 1 (tests/fixtures/README.md); its prefill pass
    # applies the sliding mask as specified, and the golden model must agree with that one.
    path = fixture_paths()[0].parent / "hf_decode_bug" / "f64_s11_w1.npz"
    case = load_case(path)
    assert case.config["sliding_window"] == 1
    with np.load(path) as d:
        prefill = d["logits_prefill"].astype(np.float64)
    model = Model.from_hf(case.config, case.tensors)
    got = np.stack([model.step(t) for t in case.input_ids])
    assert np.max(np.abs(got - prefill)) <= TOL[np.float64]
    assert np.max(np.abs(got - case.logits)) > 1.0  # the decode path's bug, documented


def test_integer_tensor_is_rejected():
    cfg = PRESETS["tiny"]
    tensors = random_tensors(cfg, 0)
    tensors["norm.weight"] = np.ones(cfg.hidden_size, dtype=np.int32)
    with pytest.raises(TypeError, match="tensor 'norm.weight' has dtype int32; expected a floating-point tensor"):
        Model.from_hf(cfg, tensors)
