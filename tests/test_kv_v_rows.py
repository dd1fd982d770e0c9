"""The INT8 KV cache with V as rows (``HardwareConfig.kv_v_layout = "rows"``, docs/numerics.md "KV cache"): one
INT8 plane per head, row-major ``[head_dim, capacity]``, read once per KV head by a dense GEMV of INT8 weights over
the group's query heads. Its bytes, its attention against independent float64 arithmetic, its engine commands and
what the performance model makes of it."""

import numpy as np
import pytest

from firmware.compiler import SHAPE_FULL, compile_token
from firmware.pack import kv_row_ranges, pack
from firmware.perf import Rates, cycles_of
from hdl.config import PRESETS as HW
from hdl.isa import CtrlFunc, ErrorCode, Opcode, ShapeCache, encode
from sim.config import PRESETS
from sim.iss import ExecutionError, Machine
from sim.numerics import KV_Q_MAX, KvInt8Layout, quantize_kv_v
from sim.random_weights import random_tensors

from tests.test_kv_int8 import (
    ATTN_INT8_TOL,
    _decode_slot,
    _softmax_attention,
    attention_errors,
    hardware_and_count_counters,
)

ROWS = {name: HW[name].replace(kv_v_layout="rows") for name in ("tiny", "tiny_v4")}
HALT = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)


def _decode_v_rows(raw, d, block):
    """K as `_decode_slot` reads it; V from the head's INT8 rows: head j's at 4·j·plane + 2·plane bytes, byte
    ``d·capacity + p`` = element d at ring row p, times the row's scale (read back independently of sim.iss)."""
    k, _ = _decode_slot(raw, d, block)
    C, H, D = d.capacity, d.heads, d.head_dim
    plane = C * D // 2
    vs_base = 4 * H * plane + 2 * H * C * (-(-D // block)) * 2
    v = np.zeros((C, H, D))
    for j in range(H):
        q = raw[4 * j * plane + 2 * plane:4 * j * plane + 2 * plane + C * D].view(np.int8).reshape(D, C).T
        v[:, j] = q.astype(np.float64) * raw[vs_base + 2 * j * C:vs_base + 2 * (j + 1) * C].view("<f2")[:, None]
    return k, v


def test_the_layout_is_checked():
    with pytest.raises(ValueError, match="kv_v_layout must be one of planes, rows, not 'cols'"):
        HW["tiny"].replace(kv_v_layout="cols")
    with pytest.raises(ValueError, match="kv_v_layout 'rows' is a layout of the INT8 cache; kv_format is 'fp16'"):
        HW["tiny_fp16"].replace(kv_v_layout="rows")
    with pytest.raises(ValueError, match="v_layout must be 'planes' or 'rows'"):
        KvInt8Layout(8, 1, 16, 16, "cols")
    assert [HW["tiny_fp16"].kv_layout_code, HW["tiny"].kv_layout_code, ROWS["tiny"].kv_layout_code] == [0, 1, 2]


def test_kvst_writes_each_v_element_into_its_row():
    """Every KVST: the V bytes at (row d, ring row p) are the INT8 values of `quantize_kv_v`, the K bytes those of
    the planes layout, and the bytes that change are within `kv_row_ranges` of that ring row."""
    cfg = PRESETS["tiny"]
    images = {lay: pack(cfg, random_tensors(cfg, 0), hw, max_positions=40)
              for lay, hw in (("planes", HW["tiny"]), ("rows", ROWS["tiny"]))}
    machines = {lay: Machine(images[lay], hw, "hardware") for lay, hw in (("planes", HW["tiny"]), ("rows", ROWS["tiny"]))}
    image = images["rows"]
    full = cfg.kv_cache_layers[-1]
    slot = image.kv_slots[full]
    d = image.descriptors[slot]
    assert d.layout == 2 and images["planes"].descriptors[slot].layout == 1
    w = d.heads * d.head_dim
    rng = np.random.default_rng(7)
    lay = KvInt8Layout(d.capacity, d.heads, d.head_dim, HW["tiny"].act_block, "rows")
    for pos in range(12):
        k = rng.standard_normal(w).astype(np.float32) * np.float32(2.0 ** rng.integers(-6, 6))
        v = rng.standard_normal(w).astype(np.float32) * np.float32(2.0 ** rng.integers(-6, 6))
        before = machines["rows"].kv_bytes(slot).copy()
        for m in machines.values():
            m.l2[0:w], m.l2[w:2 * w] = k, v
            m.run([encode(Opcode.KVST, k=0, v=w // 4, slot=slot, shape_ptr=0, async_=0), HALT], token=0, pos=pos)
        raw = machines["rows"].kv_bytes(slot)
        for j in range(d.heads):
            hi, lo, s = quantize_kv_v(v[j * d.head_dim:(j + 1) * d.head_dim])
            q = raw[lay.v(j):lay.v(j) + lay.capacity * d.head_dim].view(np.int8).reshape(d.head_dim, -1)[:, pos]
            np.testing.assert_array_equal(q, 16 * hi.astype(np.int16) + lo)
            assert np.abs(q).max() <= KV_Q_MAX
        changed = np.flatnonzero(raw != before)
        allowed = np.zeros(raw.size, bool)
        for off, n in kv_row_ranges(image, slot, pos):
            allowed[off - d.weight_offset:off - d.weight_offset + n] = True
        assert allowed[changed].all() and allowed.sum() == d.heads * lay.position_bytes
        k_rows, _ = _decode_v_rows(raw, d, HW["tiny"].act_block)
        k_planes, _ = _decode_slot(machines["planes"].kv_bytes(slot), d, HW["tiny"].act_block)
        np.testing.assert_array_equal(k_rows, k_planes)
    # a machine built on the image reads the same cache back from DDR (the inverse of kv_bytes)
    base, _ = image.region("KV")
    image.ddr[base + d.weight_offset:base + d.weight_offset + raw.size] = raw
    np.testing.assert_array_equal(Machine(image, ROWS["tiny"], "hardware").kv_bytes(slot), raw)


@pytest.mark.parametrize("hw", ["tiny", "tiny_v4"])
def test_attention_over_v_rows_against_float64(hw):
    """Every ATTN of a tiny model's tokens with V as rows against float64 softmax attention over the K and V the
    slot's bytes stand for, within the INT8 cache's bound."""
    worst = attention_errors(ROWS[hw], _decode_v_rows)
    assert max(worst) < ATTN_INT8_TOL, max(worst)


def test_v_rows_one_gemv_per_chunk_and_group():
    """Over 70 positions of a full layer with the V chunks cut at 32 (`gemv_max_cols`): per group of query heads
    two K GEMVs and one V GEMV per chunk (the planes: two V GEMVs per chunk and head), the V bytes read once per
    group, and every head's output that of one head at a time (tiny) bit for bit."""
    cfg = PRESETS["tiny"]
    full = cfg.kv_cache_layers[-1]
    heads, n = 6, 70
    outs = {}
    for name in ("tiny", "tiny_v4"):
        hw = ROWS[name].replace(gemv_max_cols=32)
        image = pack(cfg, random_tensors(cfg, 0), hw, max_positions=n)
        m = Machine(image, hw, "hardware")
        slot = image.kv_slots[full]
        d = image.descriptors[slot]
        w = d.heads * d.head_dim
        rng = np.random.default_rng(5)
        for pos in range(n):
            m.l2[0:w], m.l2[w:2 * w] = rng.standard_normal(w), rng.standard_normal(w)
            m.run([encode(Opcode.KVST, k=0, v=w // 4, slot=slot, shape_ptr=0, async_=0), HALT], token=0, pos=pos)
        q0 = 2 * w // 4
        m.l2[q0 * 4: q0 * 4 + heads * d.head_dim] = np.random.default_rng(6).standard_normal(heads * d.head_dim)
        before, vbytes = m.counters.attn_gemvs, m.counters.attn_gemv_bytes
        prog = [encode(Opcode.MEMSET, cache=ShapeCache.FMAP, slot=SHAPE_FULL, a=heads, b=d.head_dim, c=0),
                encode(Opcode.ATTN, dst=q0 + 64, q=q0, slot=slot, kv_head=0, shape_ptr=SHAPE_FULL, async_=0), HALT]
        m.run(prog, token=0, pos=n - 1)
        groups = 6 if name == "tiny" else 2                    # tiny_v4: groups of 4 and 2 heads
        chunks = -(-n // 32)
        assert m.counters.attn_gemvs - before == groups * (2 + chunks)
        k_bytes = 2 * (n * d.head_dim // 2 + n * -(-d.head_dim // hw.act_block) * 2)
        assert m.counters.attn_gemv_bytes - vbytes == groups * (k_bytes + n * d.head_dim + chunks * d.head_dim * 2)
        outs[name] = m.l2[(q0 + 64) * 4: (q0 + 64) * 4 + heads * d.head_dim].copy()
        k, v = _decode_v_rows(m.kv_bytes(slot), d, hw.act_block)
        q = m.l2[q0 * 4: q0 * 4 + heads * d.head_dim].astype(np.float64).reshape(heads, -1)
        for h in range(heads):
            want = _softmax_attention(q[h], k[:, 0], v[:, 0])
            assert np.max(np.abs(outs[name][h * d.head_dim:(h + 1) * d.head_dim] - want)) < \
                ATTN_INT8_TOL * np.max(np.abs(v[:, 0]))
    np.testing.assert_array_equal(outs["tiny"], outs["tiny_v4"])


def test_a_slot_of_the_planes_layout_is_a_bad_descriptor():
    cfg = PRESETS["tiny"]
    image = pack(cfg, random_tensors(cfg, 0), HW["tiny"], max_positions=9)
    m = Machine(image, ROWS["tiny"], "hardware")
    slot = image.kv_slots[cfg.kv_cache_layers[0]]
    with pytest.raises(ExecutionError, match="holds the int8 format; this NPU's cache is int8 with V rows") as e:
        m.run([encode(Opcode.KVST, k=0, v=8, slot=slot, shape_ptr=0, async_=0), HALT], token=0, pos=0)
    assert e.value.code is ErrorCode.BAD_DESCRIPTOR


def test_counts_match_between_count_and_hardware_arithmetic_and_the_model_prices_v_by_its_bytes():
    """COUNT arithmetic (the perf model's input) counts what hardware arithmetic counts; the model's V GEMVs over
    rows cost their bytes at the stream rate (or the back end), and the KV stream is below the planes' on the
    engine of four vectors at a position where V dominates."""
    cfg = PRESETS["tiny"]
    hw = ROWS["tiny_v4"]
    a, b = hardware_and_count_counters(hw, max_positions=40)
    assert a.attn_gemvs == b.attn_gemvs > 0 and a.attn_gemv_bytes == b.attn_gemv_bytes
    assert a.attn_v_gemvs == b.attn_v_gemvs and not a.attn_sparse_gemvs and a.passes == b.passes
    assert a.bytes_written["KV"] == 6 * len(cfg.kv_cache_layers) * cfg.num_key_value_heads \
        * (2 * cfg.head_dim + 4 * -(-cfg.head_dim // hw.act_block) + 2)
    kv = {}
    for lay in ("planes", "rows"):
        h = HW["tiny_v4"].replace(kv_v_layout=lay)
        p = pack(cfg, None, h, max_positions=40, fill=False)
        m = Machine(p, h, "count")
        m.run(compile_token(cfg, p, h).words, token=2, pos=39)
        kv[lay] = cycles_of(m.counters, h, Rates())[0]["kv_stream"]
    assert 0 < kv["rows"] < kv["planes"]


@pytest.mark.parametrize("module", ["firmware.perf", "firmware.accuracy"])
def test_the_clis_refuse_v_rows_of_the_binary16_cache(module, capsys):
    import importlib
    main = importlib.import_module(module).main
    args = ["--kv-format", "fp16", "--kv-v-layout", "rows"] + (["--model", "tiny"] if module.endswith("accuracy") else [])
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--kv-v-layout" in err and "kv_v_layout 'rows' is a layout of the INT8 cache; kv_format is 'fp16'" in err
