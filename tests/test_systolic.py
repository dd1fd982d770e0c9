"""The GEMM model (sim/systolic.py) against independent references: the GEMV contract token by token (bit
for bit), float64 dequantised math (with a stated bound), plain integer products for the DSP packing, and an
independent reader of the tile engine's stream layout."""

import numpy as np
import pytest

from hdl.config import PRESETS
from sim.numerics import dequantize_activations, dequantize_weights, gemv, quantize_activations, quantize_weights
from sim.systolic import (
    TileGeometry, array_segment_sums, extract_pair, field_bits, gemm, gemm_tile, pack_pair, tile_streams,
    untile_output,
)


def operands(rng, rows, cols, tokens, group, block, *, heavy=False):
    w = rng.standard_t(5, size=(rows, cols)) if heavy else rng.normal(size=(rows, cols))
    q_w, s_w = quantize_weights(w * rng.uniform(0.01, 3.0, size=(rows, 1)), group)
    x = (rng.normal(size=(tokens, cols)) * rng.uniform(1e-3, 50.0, size=(tokens, 1))).astype(np.float32)
    qa, ea = zip(*(quantize_activations(v, block) for v in x)) if tokens else ((), ())
    q_a = np.array(qa, dtype=np.int8).reshape(tokens, cols)
    e_a = np.array(ea, dtype=np.int32).reshape(tokens, -(-cols // block))
    return q_w, s_w, q_a, e_a


SHAPES = [  # rows, cols, tokens, group, block: non-multiples of the array and of segments included
    (64, 128, 32, 128, 64), (70, 200, 9, 32, 16), (5, 64, 3, 64, 128), (1, 7, 1, 32, 16),
    (130, 384, 33, 128, 64), (33, 100, 17, 16, 64), (8, 4096, 2, 128, 64),
]


@pytest.mark.parametrize("rows, cols, tokens, group, block", SHAPES)
def test_gemm_equals_gemv_token_by_token(rows, cols, tokens, group, block):
    # The prefill identity: every token of the GEMM is bit-identical to the GEMV engine on that token.
    rng = np.random.default_rng(rows * 1000 + cols)
    q_w, s_w, q_a, e_a = operands(rng, rows, cols, tokens, group, block, heavy=True)
    acc = rng.normal(size=(tokens, rows)).astype(np.float32)
    y = gemm(q_w, s_w, q_a, e_a, group=group, block=block)
    ya = gemm(q_w, s_w, q_a, e_a, group=group, block=block, acc=acc, tile=(4, 8))
    for t in range(tokens):
        ref = gemv(q_w, s_w, q_a[t], e_a[t], group=group, block=block)
        np.testing.assert_array_equal(y[t].view(np.uint32), ref.view(np.uint32), err_msg=f"token {t}")
        refa = gemv(q_w, s_w, q_a[t], e_a[t], group=group, block=block, acc=acc[t])
        np.testing.assert_array_equal(ya[t].view(np.uint32), refa.view(np.uint32), err_msg=f"token {t} accm")


def test_gemm_is_independent_of_tiling():
    rng = np.random.default_rng(5)
    q_w, s_w, q_a, e_a = operands(rng, 50, 96, 11, 32, 16)
    ys = [gemm(q_w, s_w, q_a, e_a, group=32, block=16, tile=t).view(np.uint32) for t in [(1, 1), (4, 8), (32, 64)]]
    np.testing.assert_array_equal(ys[0], ys[1])
    np.testing.assert_array_equal(ys[0], ys[2])


@pytest.mark.parametrize("rows, cols, tokens, group, block", SHAPES)
def test_gemm_against_float64_dequantised(rows, cols, tokens, group, block):
    # Bound: every segment part has one binary32 rounding (relative 2**-24) and the nseg parts are added
    # with nseg - 1 binary32 roundings, so |y - exact| <= nseg * 2**-24 * sum_s |part_s| (first order; the
    # second-order term is far below it for nseg <= 64). `exact` is float64 math on the dequantised values.
    rng = np.random.default_rng(cols)
    q_w, s_w, q_a, e_a = operands(rng, rows, cols, tokens, group, block)
    y = gemm(q_w, s_w, q_a, e_a, group=group, block=block).astype(np.float64)
    wd = dequantize_weights(q_w, s_w, group)
    xd = np.stack([dequantize_activations(q_a[t], e_a[t], block) for t in range(tokens)])
    exact = xd @ wd.T
    seg = min(group, block)
    nseg = -(-cols // seg)
    pad = nseg * seg - cols
    terms = np.abs(np.einsum("tsk,rsk->trs", np.pad(xd, ((0, 0), (0, pad))).reshape(tokens, nseg, seg),
                             np.pad(wd, ((0, 0), (0, pad))).reshape(rows, nseg, seg))).sum(axis=2)
    bound = nseg * 2.0 ** -24 * terms + 1e-45
    assert np.all(np.abs(y - exact) <= bound), float(np.max(np.abs(y - exact) / bound))


def test_field_spacing():
    # F = bits of the worst segment sum (seg * 8 * 128) plus a sign bit.
    assert field_bits(64) == 18 and field_bits(16) == 16 and field_bits(128) == 19 and field_bits(1) == 12
    with pytest.raises(ValueError, match="does not fit two per DSP48E2"):
        field_bits(1 << 13)
    with pytest.raises(ValueError, match="positive integer"):
        field_bits(0)


def test_pack_extract_exhaustive():
    # All INT4 x INT4 x INT8 triples through the packed product and the sign correction, for every field
    # spacing the presets use: the two fields are exactly the two integer products.
    w0, w1, a = np.meshgrid(np.arange(-8, 8), np.arange(-8, 8), np.arange(-128, 128), indexing="ij")
    for seg in (16, 64):
        f = field_bits(seg)
        lo, hi = extract_pair(pack_pair(w0, w1, f) * a, f)
        np.testing.assert_array_equal(lo, w0 * a)
        np.testing.assert_array_equal(hi, w1 * a)


def test_segment_sums_equal_plain_integer_sums():
    rng = np.random.default_rng(3)
    for seg in (16, 64):
        q_w = rng.integers(-8, 8, size=(7, 3 * seg - 5))
        q_a = rng.integers(-128, 128, size=(5, 3 * seg - 5))
        q_w[0], q_a[0] = -8, -128                          # the worst case in one row/token
        got = array_segment_sums(q_w, q_a, seg)
        pad = 5
        expect = np.einsum("rsk,tsk->trs", np.pad(q_w, ((0, 0), (0, pad))).reshape(7, 3, seg),
                           np.pad(q_a, ((0, 0), (0, pad))).reshape(5, 3, seg))
        np.testing.assert_array_equal(got, expect)


def test_gemm_corner_cases():
    # All -8 weights, +-127 activations, zero rows and columns: still the GEMV's bits.
    group, block, cols = 32, 16, 64
    q_w = np.full((6, cols), -8, dtype=np.int8)
    q_w[2] = 0
    s_w = np.full((6, cols // group), 0.5, dtype=np.float16)
    q_a = np.full((4, cols), 127, dtype=np.int8)
    q_a[1] = -127
    q_a[2] = 0
    q_a[3, ::2] = -127
    e_a = np.full((4, cols // block), -3, dtype=np.int32)
    y = gemm(q_w, s_w, q_a, e_a, group=group, block=block)
    for t in range(4):
        np.testing.assert_array_equal(y[t], gemv(q_w, s_w, q_a[t], e_a[t], group=group, block=block))
    assert y[0, 0] == -8 * 127 * cols * 0.5 / 8 and np.all(y[:, 2] == 0) and np.all(y[2] == 0)


def test_bad_input_is_named():
    q_w, s_w = np.zeros((4, 32), np.int8), np.zeros((4, 1), np.float16)
    q_a, e_a = np.zeros((2, 32), np.int8), np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match=r"activations must be \[tokens, 32\]"):
        gemm(q_w, s_w, q_a[:, :16], e_a, group=32, block=16)
    with pytest.raises(ValueError, match=r"weight scales must be \[4, 1\]"):
        gemm(q_w, np.zeros((4, 2), np.float16), q_a, e_a, group=32, block=16)
    with pytest.raises(TypeError, match="binary16"):
        gemm(q_w, s_w.astype(np.float32), q_a, e_a, group=32, block=16)
    with pytest.raises(ValueError, match=r"activation exponents must be \[2, 2\]"):
        gemm(q_w, s_w, q_a, e_a[:, :1], group=32, block=16)
    with pytest.raises(ValueError, match="9-bit"):
        gemm(q_w, s_w, q_a, e_a + 300, group=32, block=16)
    with pytest.raises(ValueError, match=r"INT4 weights must be in \[-8, 7\]"):
        gemm(q_w + 9, s_w, q_a, e_a, group=32, block=16)
    with pytest.raises(ValueError, match="must divide one another"):
        gemm(q_w, np.zeros((4, 2), np.float16), q_a, np.zeros((2, 3), np.int32), group=24, block=16)
    with pytest.raises(ValueError, match=r"acc must be binary32 \[2, 4\]"):
        gemm(q_w, s_w, q_a, e_a, group=32, block=16, acc=np.zeros((2, 4)))


def read_streams(geo, streams, tokens, rows, cols):
    """An independent reader of the stream layout: rebuild each tile's operands from the beats (as the RTL
    consumes them) and compute it with `gemm_tile`; returns the output beats."""
    R, N, seg = geo.rows, 2 * geo.cols, geo.seg
    wq = [list(p) for p in streams["wgt"]]
    acts, exps, scales = list(streams["act"]), list(streams["exp"]), list(streams["scale"])
    beats = []
    per_port = N // geo.wgt_ports
    for nseg in streams["cmd"]:
        kp = nseg * seg
        w = np.zeros((N, kp), dtype=np.int64)
        for p in range(geo.wgt_ports):
            for b in range(kp // geo.steps_per_beat):
                beat = wq[p].pop(0)
                for i in range(geo.steps_per_beat * per_port):
                    nib = beat >> (4 * i) & 0xF
                    k, r = b * geo.steps_per_beat + i // per_port, p * per_port + i % per_port
                    w[r, k] = nib - 16 if nib > 7 else nib
        a = np.array([acts.pop(0) for _ in range(kp)]).T
        ngroups, nblocks = -(-kp // geo.group), -(-kp // geo.block)
        e = np.array([exps.pop(0) for _ in range(nblocks)]).T
        s = np.array([scales.pop(0) for _ in range(ngroups)], dtype=np.uint16).T.view(np.float16)
        y = gemm_tile(w, s, a, e, group=geo.group, block=geo.block)
        beats.extend(y.view(np.uint32).tolist())
    assert not any(wq) and not acts and not exps and not scales
    return beats


@pytest.mark.parametrize("preset", ["tiny", "kv260"])
def test_stream_layout_round_trip(preset):
    geo = TileGeometry.from_config(PRESETS[preset])
    rng = np.random.default_rng(11)
    for rows, cols, tokens in [(2 * geo.cols + 3, 3 * geo.seg - 7, geo.rows + 1), (1, 5, 1)]:
        q_w, s_w, q_a, e_a = operands(rng, rows, cols, tokens, geo.group, geo.block)
        streams = tile_streams(geo, q_w, s_w, q_a, e_a)
        y = untile_output(geo, read_streams(geo, streams, tokens, rows, cols), tokens, rows)
        np.testing.assert_array_equal(y, gemm(q_w, s_w, q_a, e_a, group=geo.group, block=geo.block))


def test_geometry_of_presets():
    kv, tiny = (TileGeometry.from_config(PRESETS[p]) for p in ("kv260", "tiny"))
    assert (kv.seg, kv.field, kv.wgt_ports, kv.steps_per_beat) == (128, 19, 1, 2)      # 32 x 8: 64-bit k-steps
    assert (tiny.seg, tiny.field, tiny.wgt_ports, tiny.steps_per_beat) == (16, 16, 1, 2)
    with pytest.raises(ValueError, match="shorter than the 2 x 32 cycles"):
        TileGeometry.from_config(PRESETS["kv260"].replace(act_block=32))


@pytest.mark.parametrize("preset", ["tiny", "kv260"])
def test_rtl_geometry_matches_model(preset):
    # hdl never imports sim (the dependency direction), so the engine derives its geometry itself; it must agree with the
    # model's, which writes the streams.
    from hdl.systolic import EngineGeometry
    cfg = PRESETS[preset]
    rtl, model = EngineGeometry(cfg), TileGeometry.from_config(cfg)
    for name in ("rows", "cols", "seg", "field", "wgt_ports", "port_step_bits", "steps_per_beat"):
        assert getattr(rtl, name) == getattr(model, name), name
