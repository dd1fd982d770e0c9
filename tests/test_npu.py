"""Full-chip tests of the NPU RTL (`hdl.npu.Npu`, `tiny` preset) through the cocotb bench `tb.npu`.

All share ONE Verilator build (``build/sim/npu_tiny``; the Npu's Verilog is converted once per process,
`tb.npu.simulate`): the token-by-token comparison with the ISS, the malformed programs, and the
``python -m tb.npu`` command line on two tokens. The host side's argument checks need no simulation.

Cost: the build takes about 10 minutes on 2 shared cores (Verilator front end about 190 s of CPU, the C++
of a 65 MB model the rest); a token of the f64_s2_l7 fixture is about 1.8 x 10^5 cycles (SFU passes,
firmware.perf) at 1.4 to 2.4 ms per simulated cycle on shared cores, i.e. 4 to 7 minutes per token. The
build alone would take half of the default suite's 20-minute budget, so every test that simulates the NPU
is ``slow`` (``python -m pytest -m slow tests/test_npu.py``); the host side's checks stay in the default run.
"""

import re

import numpy as np
import pytest

from firmware.runtime import BackendUnavailable, Runtime
from hdl.config import HardwareConfig
from sim.config import PRESETS
from sim.gemma3n import Model
from sim.random_weights import random_tensors
from tb.npu.__main__ import main
from tb.npu.host import load_npz
from tb.npu import simulate
from tb.runner import ROOT

HW = HardwareConfig.preset("tiny")
FIXTURE = ROOT / "tests" / "fixtures" / "f64_s2_l7.npz"


def _bench(testcase: str, seed: int = 1, **env):
    simulate(HW, testcase, seed=seed, env={"NPU_NPZ": str(FIXTURE), **env})


@pytest.mark.slow
def test_tokens_bit_identical_to_the_iss():
    """f64_s2_l7, 4 tokens: sliding window 3 crossed (ring slot 0 rewritten at position 3), KV-shared
    layers 5-6, sparse layer 0, PLE id remap (313) at step 3; logits and all of DDR every step."""
    _bench("tokens", NPU_TOKENS="4")


@pytest.mark.slow
def test_prefill_programs_bit_identical_to_the_iss():
    """f64_s3_l5 (no KV sharing, window 6): the first 6 ids as prefill programs of 4 and 2 tokens (their
    projections WGEMMs, SETTOK/SETPOS per token), then position 6 as a decode step (it rewrites ring slot 0);
    the logits, every byte of DDR and the controller's steps against the ISS's."""
    simulate(HW, "tokens", seed=5, env={"NPU_NPZ": str(ROOT / "tests" / "fixtures" / "f64_s3_l5.npz"),
                                        "NPU_TOKENS": "7", "NPU_PREFILL": "6"})


@pytest.mark.slow
def test_prefill_on_the_multi_vector_engine_bit_identical_to_the_iss():
    """tiny_v4 (the GEMV engine takes four activation vectors and runs WGEMM; no GEMM unit): f64_s3_l5's first 6
    ids as prefill programs of 4 and 2 tokens, their projections WGEMMs of 4 and 2 vectors a weight stream, then
    position 6 as a decode step; the logits, every byte of DDR and the controller's steps against the ISS's."""
    simulate(HardwareConfig.preset("tiny_v4"), "tokens", seed=5,
             env={"NPU_NPZ": str(ROOT / "tests" / "fixtures" / "f64_s3_l5.npz"), "NPU_TOKENS": "7",
                  "NPU_PREFILL": "6"})


@pytest.mark.slow
def test_batched_step_on_the_multi_vector_engine_bit_identical_to_the_iss():
    """tiny_v4, f64_s2_l7 (sparse layer 0, KV-shared layers 5-6), 3 streams, one batched step: the projections,
    the sparse layer's gate and up, the unembedding and the LM head WGEMMs of the 3 tokens, the buffers of the
    attention and after the FFN laid over the FFN's; both the logits rows and every byte of DDR against the
    ISS."""
    simulate(HardwareConfig.preset("tiny_v4"), "modes", seed=9, env={"NPU_NPZ": str(FIXTURE), "NPU_TOKENS": "1",
                                                                      "NPU_STREAMS": "3"})


@pytest.mark.slow
def test_verify_pass_on_the_multi_vector_engine_bit_identical_to_the_iss():
    """tiny_v4, f64_s3_l5: a verify pass of 4 ids (the LM head's chunks WGEMMs of 4 tokens, every row's logits)
    and its rollback: the logits rows and every byte of DDR against the ISS."""
    simulate(HardwareConfig.preset("tiny_v4"), "modes", seed=10,
             env={"NPU_NPZ": str(ROOT / "tests" / "fixtures" / "f64_s3_l5.npz"), "NPU_TOKENS": "1",
                  "NPU_SPECULATE": "3"})


@pytest.mark.slow
def test_batched_steps_bit_identical_to_the_iss():
    """f64_s3_l5, 2 streams (their own KV slots, their own positions), 2 batched steps (their projections WGEMVs
    per token, as `gemm_pays` has it on tiny): both logits rows and every byte of DDR against the ISS."""
    simulate(HW, "modes", seed=7, env={"NPU_NPZ": str(ROOT / "tests" / "fixtures" / "f64_s3_l5.npz"),
                                       "NPU_TOKENS": "2", "NPU_STREAMS": "2"})


@pytest.mark.slow
def test_verify_passes_and_rollbacks_bit_identical_to_the_iss():
    """f64_s3_l5, speculative verify passes of 3 ids (every row's logits), each followed by a rollback that keeps
    1, then 2 of them (the KV rows of the rest restored by the host): the logits rows and every byte of DDR
    against the ISS."""
    simulate(HW, "modes", seed=8, env={"NPU_NPZ": str(ROOT / "tests" / "fixtures" / "f64_s3_l5.npz"),
                                       "NPU_TOKENS": "2", "NPU_SPECULATE": "2"})


@pytest.mark.slow
def test_tokens_at_the_kv260_addresses():
    """The kv260 memory map with the high window clipped so WEIGHTS splits over both banks (base below 4 GB,
    pieces above it), the PLE row staged by the host: 3 tokens, logits and every byte of DDR."""
    _bench("tokens", seed=3, NPU_TOKENS="3", NPU_MEMORY_MAP="kv260", NPU_WINDOW_BYTES="128K,64M")


@pytest.mark.slow
def test_the_board_runtime_drives_the_npu():
    """`firmware.board.Kv260Device` and `Runtime.on_device` on the RTL through the stand-in board, relocating a
    moved buffer: 2 tokens, bit-identical to the ISS."""
    _bench("board", seed=4, NPU_TOKENS="2", NPU_MEMORY_MAP="kv260", NPU_WINDOW_BYTES="128K,64M")


@pytest.mark.slow
def test_tokens_bit_identical_to_the_iss_with_the_binary16_kv_cache():
    """The other `kv_format` (ATTN on the SFU): its own Verilator build (``build/sim/npu_tiny_fp16``), 3 tokens."""
    simulate(HardwareConfig.preset("tiny_fp16"), "tokens", seed=2,
             env={"NPU_NPZ": str(FIXTURE), "NPU_TOKENS": "3"})


@pytest.mark.slow
def test_async_wgemv_hazards_give_sequential_results():
    _bench("hazards")


def test_hazard_programs_have_the_expected_iss_outcomes():
    """The directed async-WGEMV and WGEMV-reuse programs mean what they say: the ISS ends each one as the bench
    expects, and the reuse program's rows after the source changed are those of the old source."""
    from firmware.pack import pack
    from sim.config import ModelConfig
    from tb.npu.test_npu import _iss_outcome, hazard_programs
    case = load_npz(FIXTURE)
    image = pack(ModelConfig.from_hf(case.config), case.tensors, HW, max_positions=4)
    progs = {name: (words, want) for name, words, want in hazard_programs(image, HW)}
    for name, (words, want) in progs.items():
        assert _iss_outcome(image, HW, words)[2] == want, name
    words, _ = progs["WGEMV reuse: the engine's activations"]
    m, _, _ = _iss_outcome(image, HW, words)
    from hdl.isa import decode, encode
    gate = decode(words[4])
    assert gate.reuse
    alone = encode(gate.op, **{**gate.fields, "reuse": 0})
    fresh, _, _ = _iss_outcome(image, HW, words[:2] + [alone] + words[-1:])       # the gate WGEMV of x alone
    rows = slice(128 * 4, 128 * 4 + 128)
    np.testing.assert_array_equal(m.l2[rows], fresh.l2[rows])


@pytest.mark.slow
def test_int8_attention_and_kvst_give_the_iss_results():
    """ATTN/KVST on a random INT8 KV cache (tb.npu.test_npu.attention_programs): two V chunks, a sliding ring,
    KVST then ATTN, an async WGEMV before ATTN, and the errors."""
    _bench("attention")


@pytest.mark.slow
def test_int8_attention_on_the_multi_vector_engine_gives_the_iss_results():
    """The same ATTN/KVST programs on tiny_v4, whose ATTN runs its K GEMVs once for a group's query heads (the
    queries in the engine's vectors; over 1,101 positions four rows of scores exceed tiny's scratch: one head at a
    time), and stops before the group of a bad query."""
    simulate(HardwareConfig.preset("tiny_v4"), "attention", seed=1, env={"NPU_NPZ": str(FIXTURE)})


def test_attention_programs_have_the_expected_iss_outcomes():
    """The directed ATTN/KVST programs mean what they say: the ISS ends each one as the bench expects, and the
    good ones write finite, non-trivial outputs."""
    from firmware.pack import pack
    from sim.config import ModelConfig
    from tb.npu.test_npu import ATTN_POS, _iss_outcome, attention_programs
    case = load_npz(FIXTURE)
    image = pack(ModelConfig.from_hf(case.config), case.tensors, HW, max_positions=ATTN_POS + 4)
    for img, name, words, want, pos in attention_programs(image, HW):
        m, _, got = _iss_outcome(img, HW, words, pos=pos)
        assert got == want, name
        if want is None:
            out = m.l2[64 * 4:64 * 4 + 64]
            assert np.all(np.isfinite(out)) and np.count_nonzero(out) == 64, name


@pytest.mark.slow
def test_tokpos_programs_give_the_iss_results():
    """CTRL SETTOK and SETPOS between the instructions that read TOKEN and POS (tb.npu.test_npu.tokpos_programs):
    GATHER, ROPE_COS/SIN, LDPOS, KVST and ATTN at the set values, the async matrices behind them, the errors."""
    _bench("tokpos")


def test_tokpos_programs_have_the_expected_iss_outcomes():
    """The directed SETTOK/SETPOS programs mean what they say: the ISS ends each one as the bench expects (the
    bus error cases excepted: the ISS does not model the DDR window), each GATHER writes the row of the token
    set before it (the remapped one row 0), the positions' RoPE values and ATTN outputs differ, and LDPOS
    stores each position."""
    from tb.npu.test_npu import _bench_image, _iss_outcome, tokpos_programs
    progs, broken = tokpos_programs(_bench_image(load_npz(FIXTURE), HW), HW)
    ran = {}
    for img, name, words, want, pos, token in progs:
        m, _, got = _iss_outcome(img, HW, words, token=token, pos=pos)
        assert got == (None if img is broken else want), name
        ran[name] = (img, words, m)
    img, words, m = ran["GATHER of the host's token, then of three set by SETTOK"]
    alone = [words[0], words[-1]]                          # GATHER into 0, HALT
    rows = [m.l2[64 * k:64 * k + 64] for k in range(4)]
    for row, token in zip(rows, (7, 11, 319, 0)):
        np.testing.assert_array_equal(row, _iss_outcome(img, HW, alone, token=token)[0].l2[:64])
    assert len({r.tobytes() for r in rows}) == 4
    m = ran["ROPE_COS/SIN and LDPOS at the host's position, then at two set by SETPOS"][2]
    cs = [m.l2[(80 + 4 * k) * 4:(84 + 4 * k) * 4] for k in range(3)]
    assert all(np.all(np.isfinite(c)) for c in cs) and len({c.tobytes() for c in cs}) == 3
    np.testing.assert_array_equal(m.l2[96 * 4:96 * 4 + 3], np.float32([3, 5, 0x1234_5678]))
    m = ran["KVST at two positions, ATTN at three"][2]
    outs = [m.l2[(64 + 16 * k) * 4:(80 + 16 * k) * 4] for k in range(3)]
    assert all(np.all(np.isfinite(o)) and np.count_nonzero(o) == 64 for o in outs)
    assert len({o.tobytes() for o in outs}) == 3
    img, words, m = ran["SETPOS and SETTOK right behind an async WGEMV and WGEMM"]
    assert m.l2[272 * 4] == 2
    np.testing.assert_array_equal(m.l2[256 * 4:272 * 4], _iss_outcome(img, HW, alone, token=9)[0].l2[:64])
    for lo, hi in ((128, 160), (192, 256)):                # the WGEMV's rows, the WGEMM's two tokens' rows
        rows = m.l2[lo * 4:hi * 4]
        assert np.all(np.isfinite(rows)) and np.count_nonzero(rows) == rows.size
    m = ran["a GATHER after SETTOK beyond its table"][2]
    np.testing.assert_array_equal(m.l2[:64], _iss_outcome(img, HW, alone, token=5)[0].l2[:64])


@pytest.mark.slow
def test_bad_input_ends_in_the_documented_error_state():
    _bench("bad_input")


@pytest.mark.slow
def test_cli_two_tokens(capsys):
    assert main(["--hf-npz", str(FIXTURE), "--tokens", "2", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+(yes|NO)", line)]
    assert [r[:5] for r in rows] == [["0", "2", "yes", "same", "planned"], ["1", "24", "yes", "same", "planned"]], out
    # max |logit - golden| as printed: the ISS's hardware arithmetic against the float64 model, computed here
    case = load_npz(FIXTURE)
    iss = Runtime.from_hf(case.config, case.tensors, backend="iss", arithmetic="hardware", hw=HW)
    golden = Model.from_hf(case.config, case.tensors, dtype=np.float64)
    for r, token in zip(rows, case.input_ids[:2]):
        diff = np.max(np.abs(iss.step(token).astype(np.float64) - golden.step(token)))
        assert r[5] == f"{diff:.3e}", (r, diff)
        assert int(r[6]) > 0 and int(r[7]) == len(iss.program.words)      # CYCLES, INSNS (HALT retires)
    assert "all steps bit-identical" in out


def test_cli_argument_errors(capsys, tmp_path):
    for argv, message in [
        (["--hf-npz", str(tmp_path / "none.npz")], "no such file"),
        (["--hf-npz", str(FIXTURE), "--tokens", "0"], "must be a positive integer, not '0'"),
        (["--hf-npz", str(FIXTURE), "--tokens", "17"], "has only 16 input ids"),
        (["--hf-npz", str(FIXTURE), "--hw", "big"], "--hw must be one of kv260, kv260_gemm, tiny, tiny_fp16, tiny_v4, not 'big'"),
        (["--hf-npz", str(FIXTURE), "--tokens", "3", "--prefill", "4"], "--prefill 4: more than the 3 tokens run"),
        (["--hf-npz", str(FIXTURE), "--prefill", "0"], "must be a positive integer, not '0'"),
        (["--hf-npz", str(FIXTURE), "--streams", "2", "--prefill", "2"], "separate runs: give one of them"),
        (["--hf-npz", str(FIXTURE), "--streams", "2", "--speculate", "2"], "separate runs: give one of them"),
        (["--hf-npz", str(FIXTURE), "--speculate", "0"], "must be a positive integer, not '0'"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(1))
    with pytest.raises(SystemExit):
        main(["--hf-npz", str(bad)])
    assert "has no 'config_json' entry" in capsys.readouterr().err


def test_rtl_backend_outside_the_bench_says_where_it_runs():
    cfg = PRESETS["tiny"]
    with pytest.raises(BackendUnavailable, match=r"runs inside the full-chip bench \(python -m tb.npu"):
        Runtime.from_hf(cfg, random_tensors(cfg, 0), backend="rtl", hw="tiny")
    with pytest.raises(ValueError, match="the RTL computes 'hardware' arithmetic, not 'reference'"):
        Runtime.from_hf(cfg, random_tensors(cfg, 0), backend="rtl", arithmetic="reference", hw="tiny")
    with pytest.raises(ValueError, match="backend must be one of 'iss', 'rtl', not 'board'"):
        Runtime.from_hf(cfg, random_tensors(cfg, 0), backend="board")


@pytest.mark.slow
def test_wgemm_on_the_systolic_array_gives_the_iss_results():
    """WGEMM programs (tb.npu.test_npu.gemm_programs): token tiles, accm, async hazards, ragged shapes, errors."""
    _bench("gemm")


@pytest.mark.slow
def test_wgemm_on_the_multi_vector_engine_gives_the_iss_results():
    """The same WGEMM programs on tiny_v4, whose GEMV engine runs them in tiles of four vectors: 9 tokens (a
    tile of one after two of four; its `tokens` field has the bit a WGEMV reads as `mask`), accm, hazards,
    errors; results, outcomes and DDR against the ISS, the GEMV engine's busy counter the WGEMM's."""
    simulate(HardwareConfig.preset("tiny_v4"), "gemm", seed=1, env={"NPU_NPZ": str(FIXTURE)})


def test_gemm_programs_have_the_expected_iss_outcomes():
    """The directed WGEMM programs mean what they say: the ISS ends each one as the bench expects (the bus
    error cases excepted: the ISS does not model the DDR window), and the good ones write real results."""
    from firmware.pack import pack
    from sim.config import ModelConfig
    from tb.npu.test_npu import _iss_outcome, gemm_programs
    case = load_npz(FIXTURE)
    image = pack(ModelConfig.from_hf(case.config), case.tensors, HW, max_positions=4)
    progs, broken = gemm_programs(image, HW)
    for img, name, words, want in progs:
        m, _, got = _iss_outcome(img, HW, words)
        if img is not broken:
            assert got == want, name
        if want is None:
            out = m.l2[512 * 4:512 * 4 + 192 * 4]
            assert np.all(np.isfinite(out)) and np.count_nonzero(out) > 700, name


def test_csr_backend_refuses_an_npu_of_another_isa_or_build():
    """The host reads VERSION before it loads anything: an NPU of another ISA version, or one built for
    other hardware parameters than the image was packed for, is refused with a message that says which."""
    from firmware.compiler import compile_token
    from firmware.pack import pack
    from firmware.runtime import CsrBackend
    from hdl import csr_map
    from hdl.memory_map import Window
    from sim.config import ModelConfig
    cfg = ModelConfig.preset("tiny")
    image = pack(cfg, None, HW, max_positions=4, fill=False)
    program = compile_token(cfg, image, HW)

    class Device:
        hw, windows = HW, (Window("ddr", 0x1000000, 64 << 20),)

        def __init__(self, version):
            self.version, self.written = version, 0

        def csr_read(self, offset):
            return {csr_map.by_name("ID").offset: csr_map.NPU_ID,
                    csr_map.by_name("VERSION").offset: self.version}.get(offset, 0)

        def csr_write(self, offset, value):
            pass

        def mem_write(self, addr, data):
            self.written += len(data)

    good = csr_map.version_word(HW.to_dict())
    assert good & 0xFF == csr_map.ISA_VERSION == 3
    dev = Device(good)
    CsrBackend(dev).load(image, program)
    assert dev.written > 0
    for version, match in ((good & ~0xFF | 1, "ISA version 1; this firmware needs 3"),
                           (csr_map.version_word(HardwareConfig.preset("kv260").to_dict()), "other hardware")):
        dev = Device(version)
        with pytest.raises(RuntimeError, match=match):
            CsrBackend(dev).load(image, program)
        assert dev.written == 0
