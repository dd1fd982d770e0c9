"""`Model.from_pretrained` on a synthetic checkpoint written in the released Gemma 3n format:
``config.json`` (multimodal, with ``text_config``), bf16 ``model-0000i-of-0000N.safetensors`` shards and
``model.safetensors.index.json``, tensor names under ``model.language_model.``."""

import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest

from sim.checkpoint import INDEX_NAME, Checkpoint, write_checkpoint
from sim.config import PRESETS
from sim.gemma3n import Model
from sim.random_weights import random_tensors

CFG = PRESETS["tiny"]


def read_safetensors_header(path):
    # The safetensors layout, read by hand: an 8-byte little-endian header length, then a JSON header.
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tensors = random_tensors(CFG, seed=3)
    # What a converted checkpoint also carries: dead k/v/k_norm of KV-shared layers (transformers 4.5x).
    rng = np.random.default_rng(1)
    for i in range(CFG.first_kv_shared_layer, CFG.num_hidden_layers):
        tensors[f"layers.{i}.self_attn.k_proj.weight"] = rng.normal(size=(CFG.kv_dim, CFG.hidden_size))
        tensors[f"layers.{i}.self_attn.v_proj.weight"] = rng.normal(size=(CFG.kv_dim, CFG.hidden_size))
        tensors[f"layers.{i}.self_attn.k_norm.weight"] = rng.normal(size=(CFG.head_dim,))
    config = {"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"],
              "text_config": CFG.to_hf(), "vision_config": {"model_type": "gemma3n_vision"}}
    shards = write_checkpoint(path, config, tensors, max_shard_bytes=40_000)
    return path, tensors, shards


def test_written_in_the_hugging_face_format(checkpoint):
    path, tensors, shards = checkpoint
    assert len(shards) > 1
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == {"model.language_model." + n for n in tensors}
    total = 0
    for shard in shards:
        header = read_safetensors_header(path / shard)
        assert header["__metadata__"] == {"format": "pt"}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            assert index["weight_map"][name] == shard
            assert info["dtype"] == "BF16"
            assert info["data_offsets"][1] - info["data_offsets"][0] == 2 * int(np.prod(info["shape"]))
            total += info["data_offsets"][1] - info["data_offsets"][0]
    assert index["metadata"]["total_size"] == total


@pytest.mark.parametrize("lazy", [False, True])
def test_from_pretrained_equals_from_hf_on_the_bf16_values(checkpoint, lazy):
    path, tensors, _ = checkpoint
    calls = []
    model = Model.from_pretrained(path, dtype=np.float64, lazy=lazy,
                                  progress=lambda i, n, name: calls.append((i, n, name)))
    assert model.config == CFG
    assert len(calls) == len(CFG.tensor_shapes()) + 1 and calls[-1][0] == calls[-1][1]
    bf16 = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in tensors.items()}
    reference = Model.from_hf(CFG.to_hf(), bf16, dtype=np.float64)
    for token in (2, 100, 300, 5, 0, 7):  # 300 is outside the PLE vocabulary (256)
        np.testing.assert_array_equal(model.step(token), reference.step(token))


def test_lazy_mode_keeps_matrices_in_the_files(checkpoint):
    path, _, _ = checkpoint
    model = Model.from_pretrained(path, dtype=np.float32, lazy=True)
    stored = model.weights._store["layers.0.mlp.gate_proj.weight"]
    assert not isinstance(stored, np.ndarray) and stored.dtype_name == "BF16"
    assert isinstance(model.weights._store["norm.weight"], np.ndarray)


def test_checkpoint_reads_rows_without_loading(checkpoint):
    path, tensors, _ = checkpoint
    ckpt = Checkpoint(path)
    t = ckpt["model.language_model.embed_tokens.weight"]
    assert t.shape == (CFG.vocab_size, CFG.hidden_size)
    np.testing.assert_array_equal(t.rows(5, 7).astype(np.float32),
                                  tensors["embed_tokens.weight"][5:7].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_wrong_shape_in_checkpoint(tmp_path):
    tensors = random_tensors(CFG, seed=0)
    tensors["layers.1.laurel.linear_left.weight"] = np.zeros((CFG.laurel_rank + 1, CFG.hidden_size))
    write_checkpoint(tmp_path, CFG.to_hf(), tensors)
    wrong, right = (CFG.laurel_rank + 1, CFG.hidden_size), (CFG.laurel_rank, CFG.hidden_size)
    with pytest.raises(ValueError, match=r"tensor 'model\.language_model\.layers\.1\.laurel\.linear_left\.weight'"
                                         + re.escape(f" has shape {wrong}; expected {right}")):
        Model.from_pretrained(tmp_path)


def test_missing_tensor_in_checkpoint(tmp_path):
    tensors = random_tensors(CFG, seed=0)
    del tensors["altup_unembed_projections.2.weight"]
    write_checkpoint(tmp_path, CFG.to_hf(), tensors)
    shape = re.escape(str((CFG.hidden_size, CFG.hidden_size)))
    with pytest.raises(ValueError, match=rf"missing tensor 'altup_unembed_projections\.2\.weight' "
                                         rf"\(expected shape {shape}\)"):
        Model.from_pretrained(tmp_path)


def test_broken_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        Checkpoint(tmp_path)
    shards = write_checkpoint(tmp_path, CFG.to_hf(), random_tensors(CFG, seed=0), max_shard_bytes=100_000)
    assert len(shards) > 1
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard '{shards[-1]}' named in "
                                                r"model\.safetensors\.index\.json is missing"):
        Checkpoint(tmp_path)
