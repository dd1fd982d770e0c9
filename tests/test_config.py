"""Model and hardware configuration: presets, Hugging Face loading, validation messages."""

import json

import numpy as np
import pytest

from hdl.config import PRESETS as HW
from hdl.config import XCK26, HardwareConfig
from sim.config import E4B_HF_CONFIG, FULL, PRESETS, REQUIRED_HF_FIELDS, SLIDING, ModelConfig
from tests.oracle import fixture_paths, load_case


def test_e4b_structure():
    # E4B facts written out independently of sim.config (google/gemma-3n-E4B's config.json as transformers
    # reads it): full attention every fifth layer, KV sharing from layer 20, sparse layers 0..9.
    e4b = PRESETS["e4b"]
    assert [i for i in range(35) if e4b.layer_types[i] == FULL] == [4, 9, 14, 19, 24, 29, 34]
    assert e4b.first_kv_shared_layer == 20
    assert [e4b.kv_source(i) for i in (18, 19, 20, 23, 24, 33, 34)] == [18, 19, 18, 18, 19, 18, 19]
    assert e4b.sparse_layers == tuple(range(10))
    assert e4b.rope_theta(4) == 1e6 and e4b.rope_theta(3) == 1e4
    assert e4b.ple_dim == 8960
    # "E4B text parameters: 6.84 G in total, of which 2.35 G is the PLE table and 0.54 G the main embedding."
    assert round(e4b.parameter_count() / 1e9, 2) == 6.84
    shapes = e4b.tensor_shapes()
    assert round(shapes["embed_tokens_per_layer.weight"][0] * shapes["embed_tokens_per_layer.weight"][1] / 1e9,
                 2) == 2.35
    assert "layers.20.self_attn.k_proj.weight" not in shapes and "layers.19.self_attn.k_proj.weight" in shapes


@pytest.mark.parametrize("path", fixture_paths(), ids=lambda p: p.stem)
def test_kv_sharing_matches_transformers(path):
    # The oracle dumps transformers' kv_sharing_modes: '' (own cache), 'store' (last non-shared layer of
    # its type) or 'reuse'. Every reusing layer must read a 'store' layer of its own type.
    case = load_case(path)
    cfg = ModelConfig.from_hf(case.config)
    with np.load(path) as d:
        modes = list(d["kv_sharing_modes"])
    assert list(cfg.layer_types) == case.config["layer_types"]
    for i, mode in enumerate(modes):
        assert cfg.is_kv_shared(i) == (mode == "reuse"), i
        if mode == "reuse":
            src = cfg.kv_source(i)
            assert modes[src] == "store" and cfg.layer_types[src] == cfg.layer_types[i], i
        else:
            assert cfg.kv_source(i) == i


def test_from_hf_round_trip_and_nesting():
    for cfg in PRESETS.values():
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert ModelConfig.from_hf({"model_type": "gemma3n", "text_config": cfg.to_hf()}) == cfg
        assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_from_hf_defaults_and_legacy_spellings():
    # A config that gives only the required fields (the tensor dimensions) takes the rest from
    # Gemma3nTextConfig()'s defaults: E4B's dimensions are E4B.
    required = {k: E4B_HF_CONFIG[k] for k in REQUIRED_HF_FIELDS}
    assert ModelConfig.from_hf({"model_type": "gemma3n_text", **required}) == PRESETS["e4b"]
    legacy = {k: v for k, v in E4B_HF_CONFIG.items() if k != "rope_parameters"}
    legacy.update(rope_theta=500_000.0, rope_local_base_freq=20_000.0, eos_token_id=[1, 106])
    cfg = ModelConfig.from_hf(legacy)
    assert (cfg.rope_theta_full, cfg.rope_theta_sliding, cfg.eos_token_id) == (500_000.0, 20_000.0, 1)
    # transformers' default sparsity: the first 10 layers only when there are more than 10 layers.
    assert ModelConfig.from_hf({**required, "num_hidden_layers": 10, "num_kv_shared_layers": 0}).sparse_layers == ()
    assert ModelConfig.from_hf({**required, "activation_sparsity_pattern": 0.5}).activation_sparsity_pattern == \
        (0.5,) * 35


@pytest.mark.parametrize("change, exc, message", [
    ({"hidden_activation": "relu"}, ValueError, "hidden_activation is 'relu'"),
    ({"attention_bias": True}, ValueError, "attention_bias = True is not Gemma 3n"),
    ({"model_type": "llama"}, ValueError, "model_type is 'llama'"),
    ({"rope_parameters": {FULL: {"rope_type": "yarn", "rope_theta": 1e6}}}, ValueError,
     "rope_parameters\\['full_attention'\\] has rope_type 'yarn'"),
    ({"num_attention_heads": 7}, ValueError, r"num_attention_heads \(7\) must be a multiple of num_key_value_heads"),
    ({"intermediate_size": [16384] * 34}, ValueError, r"intermediate_size has 34 entries; expected one per layer"),
    ({"layer_types": [SLIDING] * 34 + ["chunked"]}, ValueError, r"layer_types\[34\] is 'chunked'"),
    ({"layer_types": [SLIDING] * 20 + [FULL] * 15}, ValueError,
     "leaves no non-shared full_attention layer whose KV cache"),
    ({"num_kv_shared_layers": 35}, ValueError, r"num_kv_shared_layers \(35\) must be below"),
    ({"hidden_size": 0}, ValueError, "hidden_size must be at least 1, not 0"),
    ({"head_dim": 255}, ValueError, "head_dim must be even"),
    ({"hidden_size": 2048.0}, TypeError, "hidden_size must be an integer, not 2048.0"),
    ({"vocab_size_per_layer_input": 300000}, ValueError, r"must not exceed vocab_size \(262400\)"),
    ({"activation_sparsity_pattern": [1.0] * 35}, ValueError, r"activation_sparsity_pattern\[0\] must be"),
    ({"altup_active_idx": 4}, ValueError, r"altup_active_idx \(4\) must be below altup_num_inputs \(4\)"),
])
def test_model_config_errors(change, exc, message):
    with pytest.raises(exc, match=message):
        ModelConfig.from_hf({**E4B_HF_CONFIG, **change})


def test_model_config_preset_lookup():
    assert ModelConfig.preset("tiny") is PRESETS["tiny"]
    with pytest.raises(ValueError, match="unknown model preset 'e2b'; choose one of: e4b, tiny"):
        ModelConfig.preset("e2b")


def test_hardware_presets():
    kv = HW["kv260"]
    # Four 128-bit HP ports at 300 MHz: 128 INT4 weights per cycle, 19.2 GB/s (the DDR4-2400 x64 peak).
    assert kv.gemv_lanes == 128 and kv.weights_per_beat == 32 and kv.bytes_per_beat == 16
    assert kv.peak_weight_bytes_per_second == 19.2e9
    assert kv.device is XCK26 and XCK26.dsp == 1248
    assert HardwareConfig.preset("tiny") is HW["tiny"]
    assert json.loads(json.dumps(kv.to_dict()))["gemv_lanes"] == 128
    # WGEMM on the GEMV engine of four vectors, no GEMM unit; kv260_gemm: one vector and the 32 x 8 array, whose
    # segments of 64 k-steps drain its 2 x 32 rows exactly (activation blocks of 64 against kv260's 128)
    assert kv.gemv_vectors == 4 and kv.gemm_tile == 4 and kv.act_block == 128
    assert HW["kv260_gemm"].gemv_vectors == 1 and HW["kv260_gemm"].gemm_tile == 32
    assert HW["kv260_gemm"].act_block == 2 * HW["kv260_gemm"].systolic_rows
    assert HW["kv260_gemm"].replace(name="kv260", gemv_vectors=4, gemv_pairs=True, act_block=128) == kv
    assert kv.gemv_pairs and HW["tiny_v4"].gemv_pairs and not HW["tiny"].gemv_pairs
    with pytest.raises(ValueError, match="unknown hardware preset 'zcu104'; choose one of: kv260, kv260_gemm, "
                                         "tiny"):
        HardwareConfig.preset("zcu104")


@pytest.mark.parametrize("change, exc, message", [
    ({"axi_data_bits": 96}, ValueError, "axi_data_bits must be a power of two from 32 to 1024, not 96"),
    ({"axi_max_burst_beats": 512}, ValueError, r"axi_max_burst_beats must be 1..256"),
    ({"axi_max_burst_beats": 256, "axi_data_bits": 256}, ValueError, "exceeds the 4 KB an AXI burst may span"),
    ({"act_block": 48}, ValueError, "act_block must be a power of two, not 48"),
    ({"weight_group": 100}, ValueError, r"weight_group must be 0 \(per row\) or a power of two, not 100"),
    ({"acc_bits": 16}, ValueError, r"acc_bits \(16\) cannot hold a sum of 128 INT4 x INT8 products exactly"),
    ({"axi_ports": 0}, ValueError, "axi_ports must be at least 1, not 0"),
    ({"clock_hz": 3e8}, TypeError, "clock_hz must be an integer"),
    ({"l2_bytes": 1000}, ValueError, "l2_bytes must be a power of two"),
    ({"name": ""}, TypeError, "name must be a non-empty string"),
    ({"gemv_vectors": 3, "gemv_pairs": True}, ValueError, "gemv_pairs needs an even gemv_vectors: 3 vectors of 8 "
                                                         "bits, 32 lanes"),
    ({"act_bits": 10, "gemv_pairs": True}, ValueError, r"gemv_pairs needs act_bits <= 8 \(two activations in the "
                                                       r"DSP48E2's 27-bit pre-adder\): 4 vectors of 10 bits"),
    ({"axi_data_bits": 256, "gemv_pairs": True}, ValueError, r"gemv_pairs needs a beat's sum of products below "
                                                             r"2\*\*18 \(the pair's low field\), not up to 520192"),
    ({"gemv_pairs": 1}, ValueError, "gemv_pairs must be True or False, not 1"),
    ({"gemv_interleave": "yes"}, ValueError, "gemv_interleave must be True or False, not 'yes'"),
])
def test_hardware_config_errors(change, exc, message):
    with pytest.raises(exc, match=message):
        HW["kv260"].replace(**change)


def test_hdl_never_imports_sim_tb_or_firmware():
    # The dependency direction: the gateware stands alone; facts shared with the golden models (the DSP48E2
    # widths, the worst segment sum, the SFU tables) live in hdl.config and hdl.sfu_tables, which sim imports.
    # A fresh interpreter imports every hdl module.
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    code = ("import importlib, pkgutil, sys, hdl\n"
            "for m in pkgutil.iter_modules(hdl.__path__):\n"
            "    importlib.import_module('hdl.' + m.name)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('sim', 'tb', 'firmware')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
