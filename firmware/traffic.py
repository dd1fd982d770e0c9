"""DDR traffic of one decode token, counted by the ISS on the compiled program (no weights needed).

``python -m firmware.traffic --model e4b --hw kv260 --positions 128 1024 4096`` plans the E4B image
(`firmware.pack.pack` with ``fill=False``), compiles the token program and runs it in the ISS's
``count`` arithmetic at each position, then prints bytes per token by region and the bandwidth roofline
(tokens/s if every byte moved at the hardware's peak rate).
"""

from __future__ import annotations

import argparse
import sys

from hdl.config import HardwareConfig
from sim.config import ModelConfig
from sim.iss import COUNT, Counters, Machine

from .compiler import compile_token
from .pack import pack
from .perf import POSITION, _check_counts

__all__ = ["token_traffic", "main"]


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
    args = p.parse_args(argv)
    cfg, hw = ModelConfig.preset(args.model), HardwareConfig.preset(args.hw)
    try:
        res = token_traffic(cfg, hw, args.positions)
    except (ExecutionError, ValueError) as e:
        p.error(f"argument --positions: {args.model} on {args.hw} cannot run position {max(args.positions)}: {e}")
    peak = hw.peak_weight_bytes_per_second
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


if __name__ == "__main__":
    sys.exit(main())
