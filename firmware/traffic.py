"""DDR traffic of one decode token, counted by the ISS on the compiled program (no weights needed).

``python -m firmware.traffic --model e4b --hw kv260 --positions 128 1024 4096`` plans the E4B image
(`firmware.pack.pack` with ``fill=False``), compiles the token program and runs it in the ISS's
``count`` arithmetic at each position, then prints bytes per token by region and the bandwidth roofline
(tokens/s if every byte moved at the hardware's peak rate); ``--json`` prints the same figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from hdl.config import HardwareConfig
from sim.config import ModelConfig
from sim.iss import COUNT, Counters, Machine

from .compiler import compile_token
from .pack import pack
from .perf import POSITION, _check_counts

__all__ = ["token_traffic", "to_json", "main"]


def token_traffic(cfg: ModelConfig, hw: HardwareConfig, positions: list[int]) -> dict[int, Counters]:
    """Counters of one token at each position (integers >= 0; a cache full up to that position is assumed);
    ValueError/TypeError for a negative, non-integer or empty list of positions."""
    positions = _check_counts("positions", positions, 0)
    image = pack(cfg, None, hw, max_positions=max(positions) + 1, fill=False)
    program = compile_token(cfg, image, hw)
    out = {}
    for pos in positions:
        m = Machine(image, hw, COUNT)
        m.run(program.words, token=2, pos=pos)
        out[pos] = m.counters
    return out


def main(argv=None) -> int:
    """``python -m firmware.traffic``: see ``--help``. Bad input: one line on stderr naming the option, exit
    status 2."""
    from hdl.config import PRESETS as HW_PRESETS
    from sim.config import PRESETS as MODEL_PRESETS
    from sim.iss import ExecutionError

    p = argparse.ArgumentParser(prog="python -m firmware.traffic", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="e4b", choices=sorted(MODEL_PRESETS), help="model preset (default e4b)")
    p.add_argument("--hw", default="kv260", choices=sorted(HW_PRESETS), help="hardware preset (default kv260)")
    p.add_argument("--positions", type=POSITION, nargs="+", default=[128, 1024, 4096], metavar="POS",
                   help="positions of the decode token (integers >= 0; default 128 1024 4096)")
    p.add_argument("--json", action="store_true",
                   help="print the figures as one JSON object (bytes per token by region and roofline tok/s per "
                        "position, the clock and the peak used) instead of the table")
    args = p.parse_args(argv)
    cfg, hw = ModelConfig.preset(args.model), HardwareConfig.preset(args.hw)
    try:
        res = token_traffic(cfg, hw, args.positions)
    except (ExecutionError, ValueError) as e:
        p.error(f"argument --positions: {args.model} on {args.hw} cannot run position {max(args.positions)}: {e}")
    peak = hw.peak_weight_bytes_per_second
    if args.json:
        print(json.dumps(to_json(args.model, hw, res), indent=1))
        return 0
    print(f"{args.model} on {args.hw}: {peak / 1e9:.1f} GB/s peak")
    print(f"{'position':>9} {'weights MB':>11} {'KV read MB':>11} {'other MB':>9} {'total MB':>9} "
          f"{'skipped MB':>11} {'roofline tok/s':>15}")
    for pos, c in res.items():
        w = c.bytes_read["WEIGHTS"]
        kv = c.bytes_read["KV"]
        total = c.total_read() + sum(c.bytes_written.values())
        other = total - w - kv
        print(f"{pos:>9} {w / 1e6:>11.1f} {kv / 1e6:>11.1f} {other / 1e6:>9.1f} {total / 1e6:>9.1f} "
              f"{c.weight_bytes_skipped / 1e6:>11.1f} {peak / total:>15.2f}")
    return 0


def to_json(model: str, hw: HardwareConfig, res: dict[int, Counters]) -> dict:
    """The figures of ``python -m firmware.traffic --json``: per position the bytes per token read and written by
    region, their total, the weight bytes the sparse layers skip and the roofline tok/s (every byte at the
    ports' peak, ``ports x bytes per beat x clock``; the DDR efficiency of that bound is 1: it is the peak)."""
    peak = hw.peak_weight_bytes_per_second
    out = {"model": model, "hw": hw.name, "clock_hz": hw.clock_hz, "peak_bytes_per_s": peak, "ddr_efficiency": 1.0,
           "positions": []}
    for pos, c in res.items():
        total = c.total_read() + sum(c.bytes_written.values())
        out["positions"].append({
            "position": pos, "bytes_per_token": total, "bytes_read": dict(c.bytes_read),
            "bytes_written": dict(c.bytes_written), "weight_bytes": c.bytes_read["WEIGHTS"],
            "kv_read_bytes": c.bytes_read["KV"], "weight_bytes_skipped": c.weight_bytes_skipped,
            "roofline_tok_s": peak / total})
    return out


if __name__ == "__main__":
    sys.exit(main())
