"""Error of the NPU's hardware arithmetic against the float64 golden model, over greedy decodes.

``python -m firmware.accuracy --seeds 0 1 2 --steps 32 --hw tiny`` runs, for each seed, a random model
of the chosen preset through the ISS in hardware arithmetic and through `sim.gemma3n.Model` in float64,
feeding both the golden model's greedy tokens, and reports per seed: max |Δlogit|, top-1 agreement, and
the mean and max KL(golden || hardware) of the next-token distributions. ``--group`` / ``--block``
override the weight group and activation block of the hardware preset (the numerics study in
docs/numerics.md). ``--int4-exact`` first replaces every tensor the packer stores as INT4 by the values
its INT4 codes and binary16 scales stand for, in both models: the weight rounding then costs nothing and
what remains is the rest of the hardware arithmetic (INT8 activation blocks, binary32, the SFU functions,
the binary16 KV cache).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from hdl.config import HardwareConfig
from sim.config import ModelConfig
from sim.gemma3n import Model
from sim.random_weights import random_tensors

from .runtime import Runtime

__all__ = ["measure", "Accuracy", "int4_exact", "main"]


@dataclass
class Accuracy:
    max_abs: float
    top1: float
    kl_mean: float
    kl_max: float


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - np.max(x)
    return z - np.log(np.sum(np.exp(z)))


def int4_exact(cfg: ModelConfig, tensors, hw: HardwareConfig) -> dict:
    """`tensors` with every INT4-packed matrix replaced by its dequantised INT4 values (packing them again
    reproduces the same codes and scales: the largest code of each group is ±7, so the scale is kept)."""
    from sim.numerics import dequantize_weights, quantize_weights

    from .pack import pack
    plan = pack(cfg, None, hw, max_positions=1, fill=False)
    out = dict(tensors)
    for name, e in plan.tensors.items():
        if e.format == "int4":
            q, scale = quantize_weights(np.asarray(tensors[name], np.float64), e.group)
            out[name] = dequantize_weights(q, scale, e.group)
    return out


def measure(cfg: ModelConfig, tensors, hw: HardwareConfig, steps: int = 32, first: int | None = None) -> Accuracy:
    """`steps` greedy steps (1 to the model's ``max_position_embeddings``) of both models from token `first`
    (default BOS); ValueError for a step count outside that range."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= cfg.max_position_embeddings:
        raise ValueError(f"steps must be an integer from 1 to the model's {cfg.max_position_embeddings} positions "
                         f"(max_position_embeddings), not {steps!r}")
    golden = Model.from_hf(cfg, tensors, dtype=np.float64)
    rt = Runtime.from_hf(cfg, tensors, arithmetic="hardware", hw=hw, max_positions=steps)
    token = cfg.bos_token_id if first is None else first
    errs, agree, kls = [], 0, []
    for _ in range(steps):
        g = golden.step(token)
        h = rt.step(token).astype(np.float64)
        errs.append(np.max(np.abs(g - h)))
        agree += int(np.argmax(g) == np.argmax(h))
        lg, lh = _log_softmax(g), _log_softmax(h)
        kls.append(float(np.sum(np.exp(lg) * (lg - lh))))
        token = int(np.argmax(g))
    return Accuracy(float(max(errs)), agree / steps, float(np.mean(kls)), float(max(kls)))


def main(argv=None) -> int:
    """``python -m firmware.accuracy``: see ``--help``. Bad input: one line on stderr naming the option, exit
    status 2."""
    from hdl.config import PRESETS as HW_PRESETS
    from sim.config import PRESETS as MODEL_PRESETS

    from .cli import POSITIVE, arg_type
    from .perf import POSITION

    def pow2(v):
        return v >= 1 and v & (v - 1) == 0

    p = argparse.ArgumentParser(prog="python -m firmware.accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS), help="model preset (default tiny)")
    p.add_argument("--hw", default="tiny", choices=sorted(HW_PRESETS), help="hardware preset (default tiny)")
    p.add_argument("--seeds", type=POSITION, nargs="+", default=[0, 1, 2], metavar="SEED",
                   help="seeds of the random models (integers >= 0; default 0 1 2)")
    p.add_argument("--steps", type=POSITIVE, default=32, metavar="N",
                   help="greedy steps (at most the model's max_position_embeddings; default 32)")
    p.add_argument("--group", type=arg_type("0 or a power of two", int, lambda v: v == 0 or pow2(v)), metavar="G",
                   help="weight group (0 = one scale per row)")
    p.add_argument("--block", type=arg_type("a power of two", int, pow2), metavar="B", help="activation block")
    p.add_argument("--kv-format", choices=("fp16", "int8"), help="KV cache format (default: the preset's)")
    p.add_argument("--int4-exact", action="store_true",
                   help="weights replaced by their INT4 values in both models (isolates the other arithmetic)")
    args = p.parse_args(argv)
    cfg = ModelConfig.preset(args.model)
    hw = HardwareConfig.preset(args.hw)
    if args.steps > cfg.max_position_embeddings:
        p.error(f"argument --steps: must be at most the {args.model} model's {cfg.max_position_embeddings} "
                f"positions (max_position_embeddings), not {args.steps}")
    for option, name, value in (("--group", "weight_group", args.group), ("--block", "act_block", args.block),
                                ("--kv-format", "kv_format", args.kv_format)):
        if value is not None:
            try:
                hw = hw.replace(**{name: value})
            except ValueError as e:
                p.error(f"argument {option}: {value} does not fit hardware {args.hw}: {e}")
    print(f"model {args.model}, hardware {hw.name}: weight group {hw.weight_group or 'row'}, "
          f"activation block {hw.act_block}, KV cache {hw.kv_format}, {args.steps} greedy steps"
          + (", weights INT4-exact in both models" if args.int4_exact else ""))
    print(f"{'seed':>5} {'max |dlogit|':>13} {'top-1':>7} {'mean KL':>9} {'max KL':>9}")
    for seed in args.seeds:
        tensors = random_tensors(cfg, seed, dtype=np.float64)
        if args.int4_exact:
            tensors = int4_exact(cfg, tensors, hw)
        a = measure(cfg, tensors, hw, args.steps)
        print(f"{seed:>5} {a.max_abs:>13.3f} {a.top1:>7.2%} {a.kl_mean:>9.4f} {a.kl_max:>9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
