"""WGEMV `mask`: the sparse layers' up projection fetches only the rows of the gate units the top-k keeps.

The ISS and the compiler run it on a `HardwareConfig` with `gemv_row_mask`; the token's results must not
change by a bit against the same NPU without it, and the bytes it saves are the rows of the zero gate units,
counted here from the gate vector itself. (The RTL runs it in the GEMV engine's bench, tests/test_gemv_engine.py,
and the full chip, tests/test_npu.py.)
"""

import dataclasses

import numpy as np
import pytest

from firmware.compiler import compile_token
from firmware.pack import ffn_pieces, pack
from firmware.runtime import Runtime
from hdl.config import PRESETS as HW
from hdl.isa import CtrlFunc, ErrorCode, Opcode, decode, encode
from sim.config import PRESETS
from sim.gemma3n import Model
from sim.iss import ExecutionError, Machine
from sim.numerics import gemv, quantize_activations
from sim.random_weights import random_tensors
from tests.oracle import fixture_paths, load_case

MASKED = dataclasses.replace(HW["tiny"], gemv_row_mask=True)
PLAIN = dataclasses.replace(HW["tiny"], gemv_row_mask=False)
HALT = encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)


def wgemv(d, *, src=0, dst=1024, reuse=1, mask=1, sparse=0):
    return encode(Opcode.WGEMV, dst=dst, src=src, desc=d.index, accm=0, findemax=0, sparse=sparse, reuse=reuse,
                  mask=mask, async_=0)


def masked_words(program):
    return [decode(w) for w in program.words if w >> 60 == Opcode.WGEMV.value and decode(w).mask]


def test_compiler_masks_the_up_pieces_of_the_sparse_layers_only():
    cfg = PRESETS["tiny"]
    image = pack(cfg, random_tensors(cfg, 0), MASKED)
    words = masked_words(compile_token(cfg, image, MASKED))
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.activation_sparsity_pattern[i] > 0]
    assert sparse and len(words) == sum(len(ffn_pieces(cfg, i)) for i in sparse)
    assert {image.descriptors[w.desc].tensor for w in words} == {f"layers.{i}.mlp.up_proj.weight" for i in sparse}
    assert all(w.reuse and not w.sparse for w in words)
    assert masked_words(compile_token(cfg, pack(cfg, random_tensors(cfg, 0), PLAIN), PLAIN)) == []


def test_masked_program_changes_no_bit_and_skips_the_zero_gate_rows():
    """Hardware arithmetic: logits and every KV byte equal the unmasked program's; the weight bytes drop by
    exactly the rows (INT4 row and its scales) of the gate units that are zero when each masked WGEMV runs."""
    cfg = PRESETS["tiny"]
    tensors = random_tensors(cfg, 4)
    plain = Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw=PLAIN)
    masked = Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw=MASKED)
    zero_rows = []

    def count(pc, insn, m):
        if insn.op is Opcode.WGEMV and insn.mask:
            d = m.image.descriptors[insn.desc]
            zero_rows.append((d, int(np.count_nonzero(m.l2[insn.src * 4:insn.src * 4 + d.rows] == 0))))

    masked.backend.trace = count
    for token in (2, 7, 300, 5, 41):
        np.testing.assert_array_equal(masked.step(token), plain.step(token))
    np.testing.assert_array_equal(masked.machine.image.view("KV", 0, masked.machine.image.region("KV")[1]),
                                  plain.machine.image.view("KV", 0, plain.machine.image.region("KV")[1]))
    assert sum(z for _, z in zero_rows) > 0
    saved = sum(z * ((d.cols + d.cols % 2) // 2 + -(-d.cols // d.group) * 2) for d, z in zero_rows)
    a, b = masked.machine.counters, plain.machine.counters
    assert b.bytes_read["WEIGHTS"] - a.bytes_read["WEIGHTS"] == saved
    assert a.weight_bytes_skipped - b.weight_bytes_skipped == saved


@pytest.mark.parametrize("path", fixture_paths("f64")[:1], ids=lambda p: p.stem)
def test_masked_program_reproduces_golden_model(path):
    case = load_case(path)
    rt = Runtime.from_hf(case.config, case.tensors, backend="iss", arithmetic="reference", hw=MASKED)
    golden = Model.from_hf(case.config, case.tensors)
    for step, token in enumerate(case.input_ids):
        assert np.max(np.abs(rt.step(token) - golden.step(token))) <= 1e-6, f"{case.name} step {step}"


def _up_image():
    cfg = PRESETS["tiny"]
    tensors = random_tensors(cfg, 5)
    image = pack(cfg, tensors, MASKED)
    gate, up = (image.descriptor(f"layers.0.mlp.{n}_proj.weight") for n in ("gate", "up"))
    return image, gate, up


def test_masked_rows_read_plus_zero_and_the_others_the_contract():
    """Directed mask values: ±0 skip a row (its result +0), any other value, NaN and infinities included,
    keeps it, with the result of the unmasked WGEMV."""
    image, gate, up = _up_image()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(gate.cols).astype(np.float32)
    mask = rng.standard_normal(up.rows).astype(np.float32)
    mask[::3] = 0.0
    mask[1::7] = -0.0
    mask[2:6] = [np.nan, np.inf, -np.inf, 1e-45]
    setvl = encode(Opcode.CTRL, func=CtrlFunc.SETVL, imm=gate.cols)
    m = Machine(image, MASKED, "hardware")
    m.l2[:gate.cols] = x
    m.l2[2048:2048 + up.rows] = mask
    m.l2[4096:4096 + up.rows] = 7.0                       # stale values the masked rows must overwrite
    m.run([setvl, wgemv(gate, reuse=0, mask=0, dst=256), wgemv(up, src=512), HALT], token=0, pos=0)
    q_w, s_w = m._int4_rows(image.tensors[up.tensor], up.row_start, up.rows)
    q_a, e_a = quantize_activations(x, MASKED.act_block)
    want = gemv(q_w, s_w, q_a, e_a, group=up.group, block=MASKED.act_block)
    live = mask != 0
    got = m.l2[4096:4096 + up.rows]
    np.testing.assert_array_equal(got[live], want[live])
    assert np.all(got[~live] == 0) and not np.any(np.signbit(got[~live]))
    row = (up.cols + up.cols % 2) // 2 + -(-up.cols // up.group) * 2
    gate_bytes = gate.rows * ((gate.cols + gate.cols % 2) // 2 + -(-gate.cols // gate.group) * 2)
    assert m.counters.bytes_read["WEIGHTS"] == gate_bytes + np.count_nonzero(live) * row


@pytest.mark.parametrize("hw, words, code, match", [
    (PLAIN, lambda g, u: [wgemv(g, reuse=0, mask=0, dst=256), wgemv(u, src=512)], ErrorCode.BAD_FUNCTION,
     "no row mask"),
    (MASKED, lambda g, u: [wgemv(u, reuse=0, src=512)], ErrorCode.BAD_FUNCTION, "needs reuse"),
    (MASKED, lambda g, u: [wgemv(g, reuse=0, mask=0, dst=256), wgemv(u, src=512, sparse=1)],
     ErrorCode.BAD_FUNCTION, "needs reuse"),
    (MASKED, lambda g, u: [wgemv(g, reuse=0, mask=0, dst=256), wgemv(u, src=MASKED.l2_bytes // 16 - 2)],
     ErrorCode.ADDRESS_RANGE, "exceeds L2"),
])
def test_bad_masked_wgemv_stops_with_its_code(hw, words, code, match):
    image, gate, up = _up_image()
    m = Machine(image, hw, "hardware")
    setvl = encode(Opcode.CTRL, func=CtrlFunc.SETVL, imm=gate.cols)
    with pytest.raises(ExecutionError, match=match) as e:
        m.run([setvl] + words(gate, up) + [HALT], token=0, pos=0)
    assert e.value.code is code
