"""The token performance model (firmware.perf): properties that must hold whatever the costs, and the fit."""

from dataclasses import replace

import pytest

from firmware.perf import DDR_PEAK_BYTES_PER_S, Rates, cycles_of, estimate, fit_rates
from hdl.config import HardwareConfig
from sim.config import ModelConfig

FREE = dict(issue=0, sfu_pass=0, reduce_pass=0, copy_pass=0, ddr_read_pass=0, ddr_write_pass=0, alu_op=0,
            gemv_fixed=0)


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny"), HardwareConfig.preset("kv260")


def test_never_beats_the_roofline(tiny):
    cfg, hw = tiny
    ideal = Rates(gemv_efficiency=1.0, ddr_efficiency=1.0, elements_per_cycle=1 << 20, **FREE)
    for e in estimate(cfg, hw, [3, 20], ideal):
        assert e.roofline_fraction <= 1.0 + 1e-9, e.roofline_fraction
        assert e.roofline_tok_s == pytest.approx(DDR_PEAK_BYTES_PER_S / e.bytes_total)


def test_costs_move_the_right_units(tiny):
    cfg, hw = tiny
    base = Rates()
    a = estimate(cfg, hw, [10], base)[0]
    b = estimate(cfg, hw, [10], replace(base, sfu_pass=2 * base.sfu_pass))[0]
    assert b.cycles["sfu"] > a.cycles["sfu"] and b.cycles["weights"] == a.cycles["weights"]
    assert b.cycles["reduce"] == a.cycles["reduce"]
    # longer contexts cost attention passes, not weights
    d = estimate(cfg, hw, [40], base)[0]
    assert d.by_opcode["ATTN"] > a.by_opcode["ATTN"] and d.cycles["weights"] == a.cycles["weights"]
    assert sum(a.by_opcode.values()) == pytest.approx(a.total_cycles + a.hidden)
    assert 0 < a.hidden < a.cycles["weights"]


def _overlap_runs(async_):
    """hidden cycles of [SETVL, WGEMV, SETVL, VEC.ADD, HALT] with the ADD independent of / reading the rows."""
    from firmware.pack import pack
    from firmware.perf import _stream_rate, schedule
    from hdl.isa import CtrlFunc, Opcode, VecFunc, encode
    from sim.iss import COUNT, Machine
    cfg, hw = ModelConfig.preset("tiny"), HardwareConfig.preset("tiny")
    image = pack(cfg, None, hw, max_positions=4, fill=False)
    d = next(d for d in image.descriptors if d.kind == 0 and d.layout == 0 and d.rows >= 64)
    rates = Rates()
    out = {}
    for case, a in (("independent", 1024), ("reads the rows", 512)):
        words = [encode(Opcode.CTRL, func=CtrlFunc.SETVL, imm=d.cols),
                 encode(Opcode.WGEMV, dst=512, src=0, desc=d.index, accm=0, findemax=0, sparse=0, async_=async_),
                 encode(Opcode.CTRL, func=CtrlFunc.SETVL, imm=64),
                 encode(Opcode.VEC, func=VecFunc.ADD, dst=2048, a=a, b=a, s=0, async_=0),
                 encode(Opcode.CTRL, func=CtrlFunc.HALT, imm=0)]
        m = Machine(image, hw, COUNT)
        s = schedule(m, words, hw, rates, token=0, pos=0)
        stream = m.counters.gemv_bytes / _stream_rate(hw, rates) + rates.gemv_fixed
        out[case] = (s.hidden, stream)
    return out, rates


def test_schedule_hides_the_weight_stream_only_under_independent_work():
    out, r = _overlap_runs(async_=1)
    after = 2 * r.issue + r.sfu_pass + 64           # SETVL, then the ADD's issue and SFU pass
    hidden, stream = out["independent"]
    assert hidden == pytest.approx(min(stream, after))
    hidden, _ = out["reads the rows"]
    assert hidden == pytest.approx(r.issue)         # only the SETVL: the ADD waits for the last row
    for hidden, _ in _overlap_runs(async_=0)[0].values():
        assert hidden == 0                          # a synchronous WGEMV hides nothing


def test_fit_recovers_known_costs(tiny):
    """Cycle counts made from known costs over varied runs (random instruction mixes) are fitted back."""
    import numpy as np
    from collections import Counter
    from sim.iss import Counters
    _, hw = tiny
    truth = Rates(issue=5, sfu_pass=190, reduce_pass=231, copy_pass=9, ddr_read_pass=60, ddr_write_pass=70,
                  alu_op=11, gemv_fixed=123)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(20):
        c = Counters()
        c.instructions = Counter({"VEC.ADD": int(rng.integers(1, 500)), "WGEMV": int(rng.integers(0, 50))})
        for kind in ("sfu", "reduce", "copy", "ddr_read", "ddr_write"):
            n = int(rng.integers(0, 300))
            c.passes[("VEC", kind)] = n
            c.pass_elements[("VEC", kind)] = n * int(rng.integers(1, 64))
        c.alu_ops = int(rng.integers(0, 100))
        c.gemv_bytes = int(rng.integers(0, 10**6))
        c.bytes_read["WEIGHTS"] = c.gemv_bytes
        units, _ = cycles_of(c, hw, truth)
        samples.append((c, sum(units.values())))
    fitted = fit_rates(samples, hw)
    for name in FREE:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-6), name
