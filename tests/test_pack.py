"""The weight packer on a synthetic bf16 checkpoint in the released format, read back byte by byte."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from firmware.pack import Layout, folded_router, folded_router_name, pack, rope_turn_table
from hdl.config import PRESETS as HW
from hdl.isa import DESC_BYTES
from sim.checkpoint import Checkpoint, write_checkpoint
from sim.config import PRESETS
from sim.numerics import quantize_weights, unpack_int4
from sim.random_weights import random_tensors

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tensors = random_tensors(CFG, seed=4)
    write_checkpoint(path, {"model_type": "gemma3n", "text_config": CFG.to_hf()}, tensors, max_shard_bytes=50_000)
    ckpt = Checkpoint(path)
    image = pack(CFG, ckpt, HW["tiny"], out=path / "image.npy")
    bf16 = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in tensors.items()}
    return image, bf16, path


def test_int4_matrices_read_back(packed):
    image, bf16, _ = packed
    for name, e in image.tensors.items():
        if e.format != "int4":
            continue
        rows, cols = e.shape
        q_ref, s_ref = quantize_weights(bf16[name], e.group)
        raw = image.view("WEIGHTS", e.offset, e.nbytes)
        if e.layout == Layout.ROW:
            q = unpack_int4(raw.reshape(rows, -1))[:, :cols]
        else:
            q = unpack_int4(raw.reshape(cols, rows // 2)).T
        np.testing.assert_array_equal(q, q_ref, err_msg=name)
        s = image.view("WEIGHTS", e.scale_offset, e.scale_nbytes).view("<f2")
        # row-major matrices keep [rows, groups]; column-major ones store their scales group-major
        s = s.reshape(rows, -1) if e.layout == Layout.ROW else s.reshape(-1, rows).T
        np.testing.assert_array_equal(s, s_ref, err_msg=name)


def test_sparse_down_projections_are_column_major(packed):
    image, _, _ = packed
    for i in range(CFG.num_hidden_layers):
        layout = image.tensors[f"layers.{i}.mlp.down_proj.weight"].layout
        assert layout == (Layout.COL if i in CFG.sparse_layers else Layout.ROW)


def test_constants_and_descriptors_read_back(packed):
    image, bf16, _ = packed
    e = image.tensors["layers.3.altup.prediction_coefs.weight"]
    got = image.view("CONST", e.offset, e.nbytes).view("<f4").reshape(e.shape)
    np.testing.assert_array_equal(got, bf16["layers.3.altup.prediction_coefs.weight"].astype(np.float32))
    e = image.tensors["rope.full"]
    np.testing.assert_array_equal(image.view("CONST", e.offset, e.nbytes).view("<u4"),
                                  rope_turn_table(CFG.rope_theta_full, CFG.head_dim))
    for d in image.descriptors:
        raw = bytes(image.view("DESC", d.index * DESC_BYTES, DESC_BYTES))
        woff, soff, rows, cols, kind, layout, glog, heads, hd, _ = struct.unpack("<QQIIBBBBHH", raw)
        assert (woff, kind, layout) == (d.weight_offset, d.kind, d.layout)
        if kind == 2:
            assert (rows, cols, heads, hd) == (d.capacity, CFG.kv_dim, CFG.num_key_value_heads, CFG.head_dim)
        else:
            assert (soff, rows, cols, 1 << glog) == (d.scale_offset, d.rows, d.cols, d.group)
    # KV slots come first so that ATTN/KVST's 8-bit slot field reaches them.
    assert sorted(image.kv_slots.values()) == list(range(len(CFG.kv_cache_layers)))


def test_router_norm_gain_is_folded_into_the_router(packed):
    """Every layer's CONST router for the compiled program is modality_router * router_norm gain, column by
    column: the float64 product (what reference arithmetic reads) rounded once to binary32 (the bytes)."""
    image, bf16, _ = packed
    n, D = CFG.altup_num_inputs, CFG.hidden_size
    for i in range(CFG.num_hidden_layers):
        p = f"layers.{i}.altup."
        router, gain = bf16[p + "modality_router.weight"], bf16[p + "router_norm.weight"]
        want = np.array([[router[j, k] * gain[k] for k in range(D)] for j in range(n)])
        e = image.tensors[folded_router_name(i)]
        assert (e.region, e.shape, e.format) == ("CONST", (n, D), "fp32")
        np.testing.assert_array_equal(image.const64[e.name].reshape(n, D), want, err_msg=e.name)
        got = image.view("CONST", e.offset, e.nbytes).view("<f4").reshape(n, D)
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=e.name)
        assert not np.array_equal(got, router.astype(np.float32)), "the gain is not folded in"


def test_folded_router_checks_its_inputs():
    tensors = random_tensors(CFG, 0)
    n, D = CFG.altup_num_inputs, CFG.hidden_size
    router, gain = tensors["layers.1.altup.modality_router.weight"], tensors["layers.1.altup.router_norm.weight"]
    with pytest.raises(ValueError, match=rf"tensor 'layers\.1\.altup\.modality_router\.weight' has shape "
                                         rf"\({D}, {n}\); expected \({n}, {D}\)"):
        folded_router(CFG, 1, router.T, gain)
    with pytest.raises(ValueError, match=rf"tensor 'layers\.1\.altup\.router_norm\.weight' has shape "
                                         rf"\(1, {D}\); expected \({D},\)"):
        folded_router(CFG, 1, router, gain[None])
    # through the packer: a wrong-shape or missing source of the fold is named with its expected shape
    tensors["layers.1.altup.router_norm.weight"] = gain[:-1]
    with pytest.raises(ValueError, match=rf"tensor 'layers\.1\.altup\.router_norm\.weight' has shape "
                                         rf"\({D - 1},\); expected \({D},\)"):
        pack(CFG, tensors, HW["tiny"])
    del tensors["layers.1.altup.router_norm.weight"]
    with pytest.raises(ValueError, match=rf"missing tensor 'layers\.1\.altup\.router_norm\.weight' "
                                         rf"\(expected shape \({D},\)\)"):
        pack(CFG, tensors, HW["tiny"])


def test_regions_and_manifest(packed):
    image, _, path = packed
    manifest = json.loads(json.dumps(image.manifest()))
    bases = sorted((r["base"], r["size"], k) for k, r in manifest["regions"].items())
    for (b0, s0, _), (b1, _, _) in zip(bases, bases[1:]):
        assert b0 % 4096 == 0 and b0 + s0 == b1
    used = manifest["region_bytes_used"]
    for name, r in manifest["regions"].items():
        assert used.get(name, 0) <= r["size"], name
    assert set(manifest["tensors"]) >= set(CFG.tensor_shapes())
    # The image is a memory-mapped .npy file of exactly the planned size.
    on_disk = np.load(path / "image.npy", mmap_mode="r")
    assert on_disk.shape == image.ddr.shape


def test_pack_errors():
    tensors = random_tensors(CFG, 0)
    del tensors["layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.0\.mlp\.up_proj\.weight' \(expected shape"):
        pack(CFG, tensors, HW["tiny"])
    tensors = random_tensors(CFG, 0)
    tensors["norm.weight"] = tensors["norm.weight"][:-1]
    with pytest.raises(ValueError, match=rf"tensor 'norm\.weight' has shape \({CFG.hidden_size - 1},\); "
                                         rf"expected \({CFG.hidden_size},\)"):
        pack(CFG, tensors, HW["tiny"])
    with pytest.raises(ValueError, match="pack needs tensors unless fill=False"):
        pack(CFG, None, HW["tiny"])


def test_lm_head_chunks_end_in_a_shrinking_tail():
    """E4B on kv260: a row streams ~8x as long as it is soft-capped and stored (1,056 bytes against 2 cycles of
    4 ports x 16 bytes), so the chunks end in 4,096, 512 and 64 rows and each chunk's finish fits under the next
    one's stream; the chunks cover the vocabulary, start on L2 words and fit the logits buffers, for any size."""
    from firmware.pack import ffn_pieces, logit_chunk_rows, logit_chunks
    e4b, kv = PRESETS["e4b"], HW["kv260"]
    assert [n for _, n in logit_chunks(e4b, kv)] == [28352] + [32768] * 7 + [4096, 512, 64]
    assert logit_chunks(PRESETS["tiny"], HW["tiny"]) == [(0, 320)]           # one chunk: nothing to hide under
    narrow = e4b.replace(hidden_size=256)                                    # 160 bytes a row: k = 1, no tail
    assert [n for _, n in logit_chunks(narrow, kv)] == [32768] * 8 + [256]
    rng = np.random.default_rng(5)
    for vocab in [32769, 32772, 36000, 65539] + [int(v) for v in rng.integers(32769, 300_000, 20)]:
        cfg = e4b.replace(vocab_size=vocab, vocab_size_per_layer_input=min(vocab, e4b.vocab_size_per_layer_input))
        chunks = logit_chunks(cfg, kv)
        assert [r0 for r0, _ in chunks] == [sum(n for _, n in chunks[:j]) for j in range(len(chunks))]
        assert sum(n for _, n in chunks) == vocab and all(r0 % 4 == 0 for r0, _ in chunks), vocab
        assert all(0 < n <= logit_chunk_rows(cfg, kv) for _, n in chunks), vocab
        assert [n for _, n in chunks[-3:-1]] == [4096, 512] and 64 <= chunks[-1][1] < 68, vocab
    # the FFN's up pieces: quarters with the last one split F/4 - F/32 + F/32 when F % 128 == 0
    assert ffn_pieces(e4b, 0) == [(0, 4096), (4096, 4096), (8192, 4096), (12288, 3584), (15872, 512)]
    assert ffn_pieces(e4b.replace(intermediate_size=(48,) * 35), 0) == [(0, 12), (12, 12), (24, 12), (36, 12)]
    assert ffn_pieces(e4b.replace(intermediate_size=(40,) * 35), 0) == [(0, 20), (20, 20)]
    assert ffn_pieces(e4b.replace(intermediate_size=(42,) * 35), 0) == [(0, 42)]


def _int4_codes(image, name):
    e = image.tensors[name]
    rows, cols = e.shape
    raw = image.view("WEIGHTS", e.offset, e.nbytes)
    s = image.view("WEIGHTS", e.scale_offset, e.scale_nbytes).view("<f2")
    if e.layout == Layout.ROW:
        return unpack_int4(raw.reshape(rows, -1))[:, :cols], s.reshape(rows, -1)
    return unpack_int4(raw.reshape(cols, rows // 2)).T, s.reshape(-1, rows).T


def test_quantizer_choice(tmp_path, capsys):
    # pack(quantizer=) and python -m firmware.pack --quantizer: the scale search by default, round-to-nearest on
    # request; the same layout and bytes either way, different codes and scales, the manifest naming the quantizer
    from firmware.pack import load_image, main
    tensors = random_tensors(CFG, seed=4)
    search, rtn = (pack(CFG, tensors, HW["tiny"], quantizer=q) for q in ("search", "rtn"))
    assert (search.manifest()["quantizer"], rtn.manifest()["quantizer"]) == ("search", "rtn")
    assert search.ddr.size == rtn.ddr.size
    assert {**search.manifest(), "quantizer": None} == {**rtn.manifest(), "quantizer": None}
    for name in ("layers.0.mlp.down_proj.weight", "layers.2.self_attn.q_proj.weight", "embed_tokens.weight"):
        w = np.asarray(tensors[name], np.float64)
        for image, method in ((search, "search"), (rtn, "rtn")):
            q, s = _int4_codes(image, name)
            q_ref, s_ref = quantize_weights(w, image.tensors[name].group, method)
            np.testing.assert_array_equal(q, q_ref, err_msg=f"{name} {method}")
            np.testing.assert_array_equal(s, s_ref, err_msg=f"{name} {method}")
        assert not np.array_equal(_int4_codes(search, name)[1], _int4_codes(rtn, name)[1]), name
    with pytest.raises(ValueError, match=r"^quantizer must be one of 'search', 'rtn', not 'gptq'$"):
        pack(CFG, tensors, HW["tiny"], quantizer="gptq")
    assert main(["--model", "tiny", "--seed", "4", "--hw", "tiny", "--memory-map", "flat", "--quantizer", "rtn",
                 "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    name = "layers.2.self_attn.q_proj.weight"
    loaded = load_image(tmp_path)
    assert loaded.quantizer == "rtn"
    np.testing.assert_array_equal(_int4_codes(loaded, name)[1], _int4_codes(rtn, name)[1])
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--plan", "--quantizer", "gptq"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --quantizer: invalid choice: 'gptq'" in err.splitlines()[-1]
