"""The token performance model (firmware.perf): properties that must hold whatever the rates."""

from dataclasses import replace

import pytest

from firmware.perf import DDR_PEAK_BYTES_PER_S, Rates, estimate
from hdl.config import HardwareConfig
from sim.config import ModelConfig


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny"), HardwareConfig.preset("kv260")


def test_never_beats_the_roofline(tiny):
    cfg, hw = tiny
    ideal = Rates(gemv_efficiency=1.0, ddr_efficiency=1.0, vec_lanes=1 << 20, attn_lanes=1 << 20, issue_overhead=0)
    for e in estimate(cfg, hw, [3, 20], ideal):
        assert 0.98 < e.roofline_fraction <= 1.0 + 1e-9, e.roofline_fraction
        assert e.roofline_tok_s == pytest.approx(DDR_PEAK_BYTES_PER_S / e.bytes_total)


def test_rates_move_the_right_units(tiny):
    cfg, hw = tiny
    base = Rates(issue_overhead=0)
    a = estimate(cfg, hw, [10], base)[0]
    b = estimate(cfg, hw, [10], replace(base, vec_lanes=2 * base.vec_lanes))[0]
    assert b.cycles["vector"] == pytest.approx(a.cycles["vector"] / 2)
    assert b.cycles["weights"] == a.cycles["weights"]
    c = estimate(cfg, hw, [10], replace(base, issue_overhead=10))[0]
    assert c.total_cycles > a.total_cycles
    # longer contexts cost attention cycles only
    d = estimate(cfg, hw, [40], base)[0]
    assert d.cycles["attention"] > a.cycles["attention"] and d.cycles["weights"] == a.cycles["weights"]
