"""cocotb check of the probe's model against the GEMV engine itself: the dense GEMVs of several shapes run on
`hdl.gemv.GemvEngine` (tb/gemv's bench, which records every burst each port's memory sees), and every port's
bursts, in order, must equal `sim.ddrprobe.bursts` for the same matrix (`ProbeConfig.gemv` at the addresses
the bench placed the weights and scales). The results are checked bit-exact as well, so the engine ran the
GEMV it was given.

Parameters (environment): NPU_HW (the preset), SEED.
"""

from __future__ import annotations

import cocotb
import numpy as np

from hdl.config import HardwareConfig
from hdl.ddrprobe_map import gemv_chunk_bytes
from sim.ddrprobe import ProbeConfig, bursts
from tb.gemv.bench import GemvBench, random_case
from tb.runner import bench_env

MEM = 1 << 18


@cocotb.test()
async def engine_bursts(dut):
    hw = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    seed = int(bench_env("SEED", "3"))
    tb = GemvBench(dut, hw, mem_size=MEM, seed=seed, latency=12, jitter=4, p_stall=0.1, max_cols=hw.gemv_max_cols)
    await tb.reset()
    rng = np.random.default_rng(seed)
    N, W, T, C = hw.axi_ports, hw.weights_per_beat, 8, gemv_chunk_bytes(hw)
    shapes = [
        (1, 1, None, False),                         # one row of one column: one scale, one chunk
        (N * T, 4 * C * 2, None, False),             # one tile per port, rows of four chunks
        (3 * N * T + 5, 3 * C + 7, 16, True),        # a partial last tile, odd columns, unaligned rows and scales
        (2 * T + 1, hw.gemv_max_cols, None, False),  # the widest row: scales of a tile over several bursts
        (T - 3, W + 1, None, True),                  # fewer rows than a tile
    ]
    for k, (rows, cols, group, misalign) in enumerate(shapes):
        case = random_case(hw, rng, rows, cols, group=group, misalign=misalign)
        y, _ = await tb.run(case, base=int(rng.integers(0, 4)) * 4096 + 4096)
        want = case.expected(hw.act_block)
        np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32), err_msg=f"shape {k}: results")
        waddr, saddr = tb.last_addrs
        cfg = ProbeConfig.gemv(hw, rows, cols, base=waddr, sbase=saddr, group=case.group)
        model = bursts(hw, cfg)
        for p, ram in enumerate(tb.rams):
            assert ram.bursts == model[p], \
                f"shape {k} ({rows} x {cols}, group {case.group}, weights at {waddr:#x}, scales at {saddr:#x}): " \
                f"port {p}: the engine's bursts {ram.bursts[:8]}... ({len(ram.bursts)}), the probe's model " \
                f"{model[p][:8]}... ({len(model[p])})"
