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
    assert sum(a.by_opcode.values()) == pytest.approx(a.total_cycles)


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
