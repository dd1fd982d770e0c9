"""cocotb bench of `hdl.gemv.GemvEngine`: seeded random and directed GEMVs compared bit for bit with
`sim.numerics.gemv`, under random AXI read latency, AR/R stalls and `o_y`/`i_acc` flow control; `ddr4_stream`
and `benchmark` (with DDR4_MHZ) put every port behind one shared DDR4 channel model (`tb.ddr4`)."""

from __future__ import annotations

import cocotb
import numpy as np
from cocotb.triggers import FallingEdge

from hdl.config import HardwareConfig
from hdl.gemv import command_layout, gemv_parts
from sim.numerics import segment_size
from tb.ddr4 import check_timing
from tb.gemv.bench import (GemvBench, check_span_reads, check_sparse_reads, dense_spans, int8_case, masked_spans,
                           pack_fields, random_case)
from tb.runner import bench_env

MEM = 1 << 18


def make_bench(dut, seed, **kw):
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    # the engine's row mask, activation vectors, V layout, vector pairs and interleaved rows as built (ROW_MASK,
    # VECTORS, KV_V_LAYOUT, PAIRS, INTERLEAVE), else the preset's
    cfg = cfg.replace(gemv_row_mask=bench_env("ROW_MASK", str(int(cfg.gemv_row_mask))) == "1",
                      gemv_vectors=int(bench_env("VECTORS", str(cfg.gemv_vectors))),
                      kv_v_layout=bench_env("KV_V_LAYOUT", cfg.kv_v_layout),
                      gemv_pairs=bench_env("PAIRS", str(int(cfg.gemv_pairs))) == "1",
                      gemv_interleave=bench_env("INTERLEAVE", str(int(cfg.gemv_interleave))) == "1")
    return cfg, GemvBench(dut, cfg, mem_size=int(bench_env("MEM_SIZE", str(MEM))), seed=seed,
                          max_cols=cfg.gemv_max_cols, **kw)


async def seeded_bench(dut):
    """The bench of the run's SEED and FLOW (memory latency, jitter and stall probability), reset; with the
    run's NumPy generator and seed."""
    seed = int(bench_env("SEED", "1"))
    lat, jit, p = [(0, 0, 0.0), (20, 10, 0.25), (60, 0, 0.05)][int(bench_env("FLOW", "1"))]
    cfg, tb = make_bench(dut, seed, latency=lat, jitter=jit, p_stall=p)
    await tb.reset()
    return cfg, tb, np.random.default_rng(seed), seed


def check(case, y, block, what):
    want = case.expected(block)
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32),
                                  err_msg=f"{what}: {case.rows}x{case.cols} group {case.group} "
                                          f"accm {case.acc is not None} sparse {case.sparse} int8 {case.int8} "
                                          f"pitch {case.pitch} offset {case.w_offset}")


def sparse_case(cfg, rng, rows, cols, density, **kw):
    """A sparse (column-major) case whose activations are non-zero with probability `density`."""
    case = random_case(cfg, rng, rows, cols, zero_cols=0.0, **kw)
    case.q_a[rng.random(cols) >= density] = 0
    case.q_a[(case.q_a == 0) & (rng.random(cols) < density)] = 1     # keep the density (rng gave a 0)
    case.sparse = True
    return case


async def run_sparse(tb, cfg, case, what, base):
    y, cycles = await tb.run(case, base=base)
    check(case, y, cfg.act_block, what)
    nbytes = check_sparse_reads(cfg, tb, case)
    nz = int(np.count_nonzero(case.q_a))
    if case.rows % (2 * cfg.bytes_per_beat) == 0 and case.w_offset == 0 and case.s_offset == 0:
        # Beat-aligned columns and scale slices: exactly the non-zero columns' and the scales' bytes.
        want = nz * case.rows // 2 + len(case.scale_bytes())
        assert nbytes == want, f"{what}: read {nbytes} bytes, expected {want}"
    return y, cycles


async def run_sparse_and_masked(tb, cfg, rng, after: str):
    """A random sparse command, then (with ``gemv_row_mask``) a masked one, each bit-exact: the other modes
    between commands of the mode under test (`after` names it in the messages)."""
    W = cfg.weights_per_beat
    s = sparse_case(cfg, rng, 2 * int(rng.integers(1, cfg.gemv_sparse_max_rows // 2 + 1)), 3 * W + 1, 0.3)
    await run_sparse(tb, cfg, s, f"sparse after {after}", base=4096)
    if cfg.gemv_row_mask:
        mk = random_case(cfg, rng, 21, 3 * W)
        mk.mask = rng.random(21) < 0.4
        y, _ = await tb.run(mk, base=8192)
        check(mk, y, cfg.act_block, f"masked after {after}")


@cocotb.test()
async def sparse_random(dut):
    """Seeded random sparse GEMVs at densities 0, 5, 30 and 100 %: bit-exact, and only the non-zero
    columns' (and the scales') beats are read."""
    cfg, tb, rng, seed = await seeded_bench(dut)
    W, R = cfg.weights_per_beat, cfg.gemv_sparse_max_rows
    n = int(bench_env("CASES", "8"))
    for k in range(n):
        density = [0.0, 0.05, 0.3, 1.0][k % 4]
        rows = 2 * int(rng.integers(1, R // 2 + 1)) if rng.random() < 0.6 else int(rng.choice([2, W, R, 2 * W + 2]))
        cols = int(rng.choice([1, W - 1, W + 1, 2 * cfg.weight_group, int(rng.integers(1, 300))]))
        group = int(rng.choice([0, 0, 8, 16, 64])) or None
        case = sparse_case(cfg, rng, rows, cols, density, group=group, accm=rng.random() < 0.4,
                           misalign=rng.random() < 0.3,
                           e_range=(-150, 40) if rng.random() < 0.3 else (-20, 8))
        await run_sparse(tb, cfg, case, f"sparse case {k} density {density} (seed {seed})",
                         base=int(rng.integers(0, 8)) * 4096)
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0


@cocotb.test()
async def sparse_corners(dut):
    cfg, tb = make_bench(dut, 6, latency=9, jitter=6, p_stall=0.2)
    await tb.reset()
    rng = np.random.default_rng(6)
    W, R, blk = cfg.weights_per_beat, cfg.gemv_sparse_max_rows, cfg.act_block
    cases = []
    for a in (127, -127):                  # all -8 weights x saturating activations, every column
        c = sparse_case(cfg, rng, 2 * W, 5 * W + 3, 1.0)
        c.q_w[:] = -8
        c.q_a[:] = a
        cases.append((f"all -8 x {a}", c))
    c = sparse_case(cfg, rng, 2 * W, 7 * W, 0.0)
    c.q_a[3 * W + 5] = -128 + 1
    cases.append(("a single non-zero column", c))
    c = sparse_case(cfg, rng, W + 2, 4 * W + 1, 0.0)
    c.q_a[-1] = 77
    cases.append(("only the last column", c))
    c = sparse_case(cfg, rng, R, 6 * W, 0.1, accm=True)
    c.q_w[::3] = 0
    cases.append(("zero rows, max rows, accm", c))
    # Signed zeros: every part +-0 (zero activations or zero weights, random scale signs, parts that
    # underflow), so each row's result is -0 only if all its parts are -0, as in sim.numerics.gemv.
    c = sparse_case(cfg, rng, 24, 6 * blk, 0.0, accm=True, group=blk)
    c.q_a[blk + 2] = 5
    c.q_w[:, blk + 2] = 0
    c.q_w[::4, blk + 2] = 1
    c.scale[:] = np.where(rng.random(c.scale.shape) < 0.7, -1.0, 1.0).astype(np.float16)
    c.scale[1::5, :] = -1.0
    c.e_a[:] = -155                        # 5 x 2**-155 rounds to a signed zero
    c.acc[:] = np.where(rng.random(24) < 0.5, -0.0, 0.0).astype(np.float32)
    cases.append(("signed zeros", c))
    c = sparse_case(cfg, rng, 10, 3 * W, 0.0)
    c.scale[:] = -1.0
    cases.append(("all zero activations: -0 results", c))
    cases.append(("1 column", sparse_case(cfg, rng, 2, 1, 1.0)))
    cases.append(("max cols", sparse_case(cfg, rng, 2 * W, tb.max_cols, 0.05)))
    # INT8 attention's V planes: one scale group per row, every column of the activation memory non-zero
    v_rows = cfg.axi_ports * W
    cases.append(("max cols, every column, one group per row", sparse_case(cfg, rng, v_rows, tb.max_cols, 1.0,
                                                                           group=1 << 16)))
    cases.append(("max cols - 1, 90 %, one group per row", sparse_case(cfg, rng, v_rows, tb.max_cols - 1, 0.9,
                                                                       group=1 << 16)))
    for what, case in cases:
        await run_sparse(tb, cfg, case, what, base=4096)
    # A dense GEMV after the sparse ones, then a sparse one again: the modes share the AXI ports.
    d = random_case(cfg, rng, 19, 3 * W + 1)
    y, _ = await tb.run(d, base=8192)
    check(d, y, blk, "dense after sparse")
    s = sparse_case(cfg, rng, 20, 2 * W, 0.3)
    await run_sparse(tb, cfg, s, "sparse after dense", base=0)
    if cfg.gemv_vectors > 1:
        # a dense command of every vector (all the binary32 pipelines, the dense exponent selects) between
        # sparse ones, which take the same pipelines with vector 0's exponents
        d = multi_case(cfg, rng, 21, 3 * W + 5, cfg.gemv_vectors, accm=True)
        y, _ = await tb.run(d, base=8192)
        check(d, y, blk, "multi-vector dense after sparse")
        s = sparse_case(cfg, rng, R, 5 * W + 1, 0.3, accm=True)
        await run_sparse(tb, cfg, s, "sparse after multi-vector dense", base=4096)
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0


@cocotb.test()
async def masked_random(dut):
    """WGEMV `mask` (an engine with gemv_row_mask): seeded random masked GEMVs at live-row densities 0, 5, 30 and
    100 %, with and without accm, some misaligned, dense ones between them: bit-exact (a skipped row reads +0
    before accm), and exactly the live rows' scale and chunk beats are read."""
    cfg, tb, rng, seed = await seeded_bench(dut)
    W = cfg.weights_per_beat
    for k, density in enumerate([0.05, 0.3, 1.0, 0.0, 0.05, 0.3, 0.6, 0.05]):
        rows = int(rng.choice([1, 4, 9, 33, 64, int(rng.integers(1, 140))]))
        cols = int(rng.choice([W - 1, W, 3 * W + 5, 2 * cfg.weight_group, int(rng.integers(1, 400))]))
        group = int(rng.choice([0, 0, 8, 64])) or None
        case = random_case(cfg, rng, rows, cols, group=group, accm=rng.random() < 0.4,
                           misalign=rng.random() < 0.3)
        case.mask = rng.random(rows) < density
        y, _ = await tb.run(case, base=int(rng.integers(0, 8)) * 4096)
        check(case, y, cfg.act_block, f"masked case {k} (seed {seed}, density {density})")
        check_span_reads(cfg, tb, masked_spans(cfg, case, *tb.last_addrs))
        if k % 3 == 1:                              # a dense command after a masked one
            dense = random_case(cfg, rng, 17, 2 * W + 3)
            y, _ = await tb.run(dense, base=0)
            check(dense, y, cfg.act_block, "dense after masked")
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0


def multi_case(cfg, rng, rows, cols, nvec, **kw):
    """A dense case with `nvec` activation vectors (each its own INT8 values, block exponents and accm values)."""
    cases = [random_case(cfg, rng, rows, cols, **kw) for _ in range(nvec)]
    c = cases[0]
    c.q_a = np.stack([x.q_a for x in cases])
    c.e_a = np.stack([x.e_a for x in cases])
    if c.acc is not None:
        c.acc = np.stack([x.acc for x in cases], axis=1)
    return c


@cocotb.test()
async def multi_vector_random(dut):
    """Dense GEMVs of one to `gemv_vectors` activation vectors (seeded random shapes, groups, accm, exponents,
    misalignment): each vector's results bit-exact against `sim.numerics.gemv` of that vector, and the matrix's
    weight and scale beats read exactly once whatever the vectors; single-vector dense, sparse and masked commands
    between them; a sparse or masked command with more than one vector is rejected without results."""
    cfg, tb, rng, seed = await seeded_bench(dut)
    W, V = cfg.weights_per_beat, cfg.gemv_vectors
    assert V > 1, "the bench needs an engine built with VECTORS > 1"
    n = int(bench_env("CASES", "10"))
    for k in range(n):
        nvec = [V, 1 + k % V, int(rng.integers(1, V + 1))][k % 3]
        rows = int(rng.choice([1, 2, 7, 8, 9, 17, 33, int(rng.integers(1, 70))]))
        cols = int(rng.choice([1, W - 1, W + 1, 3 * W + 5, 2 * cfg.weight_group, int(rng.integers(1, 400))]))
        group = int(rng.choice([0, 0, 8, 16, 64, 128])) or None
        case = multi_case(cfg, rng, rows, cols, nvec, group=group, accm=rng.random() < 0.4,
                          misalign=rng.random() < 0.3,
                          e_range=(-150, 40) if rng.random() < 0.3 else (-20, 8))
        y, _ = await tb.run(case, base=int(rng.integers(0, 8)) * 4096)
        check(case, y, cfg.act_block, f"case {k}, {nvec} vectors (seed {seed})")
        check_span_reads(cfg, tb, dense_spans(cfg, case, *tb.last_addrs, tb.tile_rows))
        if k % 4 == 1:                              # the other modes between multi-vector commands
            d = random_case(cfg, rng, 13, 2 * W + 3, accm=True)
            y, _ = await tb.run(d, base=0)
            check(d, y, cfg.act_block, "single-vector dense after multi-vector")
            await run_sparse_and_masked(tb, cfg, rng, "multi-vector")
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0
    for sparse, mask in [(1, 0)] + ([(0, 1)] if cfg.gemv_row_mask else []):
        await tb.reset()
        n0 = len(tb.out.items)
        await tb.cmd.send([pack_fields(command_layout(cfg), wbase=0, sbase=4096, rows=8, cols=40, log2_group=5,
                                       sparse=sparse, mask=mask, vecs=V - 1)])
        for _ in range(60):
            await FallingEdge(dut.clk)
        assert int(dut.o_bad_cmd.value) == 1 and len(tb.out.items) == n0 and int(dut.o_busy.value) == 0, \
            f"sparse {sparse} mask {mask} with {V} vectors was not rejected"
    await tb.reset()
    case = multi_case(cfg, rng, 11, 3 * W + 1, V, accm=True)
    y, _ = await tb.run(case, base=0)
    check(case, y, cfg.act_block, "multi-vector after rejected commands")


@cocotb.test()
async def multi_vector_throughput(dut):
    """One ROWS x COLS matrix with 1 .. V activation vectors at a fixed LATENCY: each bit-exact; the cycles lie
    between the larger of two bounds, the matrix's bytes at the ports' peak and the back end's binary32 parts (one
    per pipeline and cycle, `gemv_parts` pipelines a port: ceil(nvec / P) cycles per row and segment over the
    tiles a port takes, `firmware.perf`'s WGEMM cost on this engine), and that bound plus 10 % and the memory
    latency's fixed costs."""
    cfg, tb = make_bench(dut, 13, latency=int(bench_env("LATENCY", "30")))
    await tb.reset()
    rng = np.random.default_rng(13)
    V, N, T = cfg.gemv_vectors, cfg.axi_ports, tb.tile_rows
    rows, cols = int(bench_env("ROWS", "128")), int(bench_env("COLS", str(cfg.gemv_max_cols)))
    seg = segment_size(cfg.weight_group, cfg.act_block)
    for nvec in range(1, V + 1):
        case = multi_case(cfg, rng, rows, cols, nvec, group=cfg.weight_group)
        y, cycles = await tb.run(case, base=0)
        check(case, y, cfg.act_block, f"{nvec} vectors")
        nbytes = len(case.weight_bytes()) + len(case.scale_bytes())
        stream = nbytes / (N * cfg.bytes_per_beat)
        back = -(-(-(-rows // T)) // N) * T * -(-nvec // gemv_parts(cfg)) * -(-cols // seg)
        bound = max(stream, back)
        dut._log.info(f"GEMV {rows}x{cols}, {nvec} vectors: {cycles} cycles; bytes at the ports' peak {stream:.0f}, "
                      f"back end {back}: {cycles / bound:.3f} of the larger")
        assert bound <= cycles <= 1.1 * bound + 400, f"{nvec} vectors: {cycles} cycles against the bound {bound:.0f}"


@cocotb.test()
async def sparse_parts_throughput(dut):
    """A ROWS x COLS sparse GEMV at DENSITY (5 %) at a fixed LATENCY: bit-exact; its cycles lie between the
    back end's bound, ``nseg * max(prow / P, MIN_WALK)`` issue cycles a port (P = `gemv_parts` binary32
    pipelines take a row group of P rows a cycle), and that bound plus 10 % and the fixed costs (the first
    segment's fetch, the last results' drain through the merge). With P = 2 the bound is half the P = 1 one, so
    the run shows that the second pipeline takes its rows."""
    from hdl.gemv import SparsePort
    cfg, tb = make_bench(dut, 17, latency=int(bench_env("LATENCY", "30")))
    await tb.reset()
    rng = np.random.default_rng(17)
    W, N, P = cfg.weights_per_beat, cfg.axi_ports, gemv_parts(cfg)
    rows, cols = int(bench_env("ROWS", str(cfg.gemv_sparse_max_rows))), int(bench_env("COLS", "1024"))
    density = float(bench_env("DENSITY", "0.05"))
    case = sparse_case(cfg, rng, rows, cols, density, group=cfg.weight_group)
    y, cycles = await run_sparse(tb, cfg, case, f"sparse {rows}x{cols} at {density:g}", base=0)
    prow = -(-rows // (N * W)) * W
    nseg = -(-cols // segment_size(cfg.weight_group, cfg.act_block))
    bound = {p: nseg * max(prow // p, SparsePort.MIN_WALK) for p in (1, P)}
    dut._log.info(f"sparse GEMV {rows}x{cols} at {100 * density:g} % ({np.count_nonzero(case.q_a)} non-zero), "
                  f"P = {P}: {cycles} cycles; back-end bound {bound[P]} (P = 1: {bound[1]}): "
                  f"{cycles / bound[P]:.3f} of it")
    assert bound[P] <= cycles <= 1.1 * bound[P] + 400, f"{cycles} cycles against the bound {bound[P]}"
    assert P == 1 or cycles < 0.7 * bound[1], f"{cycles} cycles: the other pipelines took no rows"


@cocotb.test()
async def random_gemvs(dut):
    cfg, tb, rng, seed = await seeded_bench(dut)
    W = cfg.weights_per_beat
    n = int(bench_env("CASES", "12"))
    for k in range(n):
        rows = int(rng.choice([1, 2, 7, 8, 9, 17, 33, int(rng.integers(1, 70))]))
        cols = int(rng.choice([1, 2, W - 1, W, W + 1, 3 * W + 5, 2 * cfg.weight_group, int(rng.integers(1, 400))]))
        group = int(rng.choice([0, 0, 8, 16, 64, 128])) or None
        case = random_case(cfg, rng, rows, cols, group=group, accm=rng.random() < 0.4,
                           misalign=rng.random() < 0.3,
                           e_range=(-150, 40) if rng.random() < 0.3 else (-20, 8))
        y, _ = await tb.run(case, base=int(rng.integers(0, 8)) * 4096)
        check(case, y, cfg.act_block, f"case {k} (seed {seed})")


@cocotb.test()
async def corner_cases(dut):
    cfg, tb = make_bench(dut, 5, latency=7, jitter=5, p_stall=0.2)
    await tb.reset()
    rng = np.random.default_rng(5)
    blk = cfg.act_block
    W = cfg.weights_per_beat
    cases = []
    # All -8 weights against saturating activations (+127 and -127), largest scales and exponents that stay finite.
    for a in (127, -127):
        c = random_case(cfg, rng, 9, 5 * W + 3)
        c.q_w[:] = -8
        c.q_a[:] = a
        cases.append(("all -8 x %d" % a, c))
    # Zero rows and zero columns (whole segments and blocks of zero activations), with accm.
    c = random_case(cfg, rng, 20, 7 * W, accm=True)
    c.q_w[::3] = 0
    c.q_a[:2 * blk] = 0
    c.q_a[-blk:] = 0
    cases.append(("zero rows and columns, accm", c))
    # Negative zero: every part -0 (negative scales times zero sums): y must stay -0; with accm, -0 + -0.
    c = random_case(cfg, rng, 8, 3 * W, accm=True)
    c.q_a[:] = 0
    c.scale[:] = -1.0
    c.acc[:] = -0.0
    cases.append(("negative zeros", c))
    # One row, one column; a matrix exactly one tile; rows not a multiple of ports x tile rows.
    cases.append(("1x1", random_case(cfg, rng, 1, 1)))
    cases.append(("tile", random_case(cfg, rng, 8, 2 * W)))
    cases.append(("ragged", random_case(cfg, rng, 8 * cfg.axi_ports + 3, W + 1, misalign=True)))
    # The widest row the activation memory holds.
    cases.append(("max cols", random_case(cfg, rng, 3, tb.max_cols)))
    for what, case in cases:
        y, _ = await tb.run(case, base=4096)
        check(case, y, blk, what)
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0


@cocotb.test()
async def bad_command_and_read_error(dut):
    """A sparse command with an odd number of rows (columns of rows/2 bytes) or more rows than
    `gemv_sparse_max_rows` is rejected without results; a read past the memory is flagged."""
    cfg, tb = make_bench(dut, 9, latency=3)
    await tb.reset()
    rng = np.random.default_rng(9)
    case = random_case(cfg, rng, 4, 40)
    await tb.load_activations(case.q_a, case.e_a)
    for rows in (5, cfg.gemv_sparse_max_rows + 2):
        await tb.cmd.send([pack_fields(command_layout(cfg), wbase=0, sbase=4096, rows=rows, cols=40, log2_group=5,
                                       sparse=1)])
        for _ in range(50):
            await FallingEdge(dut.clk)
        assert int(dut.o_bad_cmd.value) == 1 and len(tb.out.items) == 0 and int(dut.o_busy.value) == 0
    y, _ = await tb.run(case, base=8192)                 # the engine still works
    check(case, y, cfg.act_block, "after a rejected command")
    assert int(dut.o_error.value) == 0
    # Weights that run past the end of memory: SLVERR, reported on o_error (results are then meaningless).
    waddr = MEM - 16
    word = pack_fields(command_layout(cfg), wbase=waddr, sbase=4096, rows=2, cols=64, log2_group=5)
    await tb.cmd.send([word])
    await tb.out.wait_for(4 + 2, timeout_cycles=20_000)
    assert int(dut.o_error.value) == 1
    # The same in sparse mode (the port's DMA is shared by both modes): non-zero activations whose columns
    # run past the end of memory; the GEMV still ends with its results and o_error is set again after a reset.
    for _ in range(50):
        await FallingEdge(dut.clk)
    await tb.reset()
    assert int(dut.o_error.value) == 0
    s = sparse_case(cfg, rng, 4, 64, 1.0)
    await tb.load_activations(s.q_a, s.e_a)
    n0 = len(tb.out.items)
    word = pack_fields(command_layout(cfg), wbase=MEM - 16, sbase=4096, rows=4, cols=64, log2_group=5, sparse=1)
    await tb.cmd.send([word])
    await tb.out.wait_for(n0 + 4, timeout_cycles=20_000)
    for _ in range(50):
        await FallingEdge(dut.clk)
    assert int(dut.o_error.value) == 1 and int(dut.o_busy.value) == 0 and len(tb.out.items) == n0 + 4
    # After a reset both modes run bit-exact again.
    await tb.reset()
    s = sparse_case(cfg, rng, 6, 70, 0.3, accm=True)
    await run_sparse(tb, cfg, s, "sparse after a read error", base=8192)
    d = random_case(cfg, rng, 9, 50, accm=True)
    y, _ = await tb.run(d, base=0)
    check(d, y, cfg.act_block, "dense after a read error")
    assert int(dut.o_error.value) == 0


@cocotb.test()
async def throughput(dut):
    """Cycles of a streaming-size GEMV against the ideal bytes / (ports x bytes per beat)."""
    cfg, tb = make_bench(dut, 11, latency=int(bench_env("LATENCY", "30")))
    await tb.reset()
    rng = np.random.default_rng(11)
    rows, cols = int(bench_env("ROWS", "128")), int(bench_env("COLS", "1024"))
    case = random_case(cfg, rng, rows, cols)
    y, cycles = await tb.run(case, base=0)
    check(case, y, cfg.act_block, "throughput case")
    nbytes = len(case.weight_bytes()) + len(case.scale_bytes())
    ideal = nbytes / (cfg.axi_ports * cfg.bytes_per_beat)
    eff = ideal / cycles
    dut._log.info(f"GEMV {rows}x{cols}: {cycles} cycles, ideal {ideal:.0f}, port efficiency {100 * eff:.1f} %")
    floor = float(bench_env("MIN_EFFICIENCY", "0.93"))
    assert eff >= floor, f"port efficiency {eff:.3f} below {floor}"


def percentile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0


def bytes_read(tb, cfg) -> int:
    return sum(beats for port in tb.port_bursts() for _, beats in port) * cfg.bytes_per_beat


@cocotb.test()
async def ddr4_stream(dut):
    """The engine behind the DDR4 model (every port on one `tb.ddr4` channel at FABRIC_MHZ) under random AR/R
    pauses and `o_y`/`i_acc` flow control: a dense GEMV of ROWS x COLS and a sparse one, bit-exact; the bytes
    read are the matrix's weight + scale bytes (dense) or exactly the non-zero columns' and the scales' beats
    (sparse); no GEMV takes fewer cycles than its bytes over the ports' peak or over the DDR4 peak per fabric
    cycle; the channel's command log keeps every DRAM timing rule, with a refresh inside the dense GEMV."""
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    mhz = float(bench_env("FABRIC_MHZ", "1500"))
    seed = int(bench_env("SEED", "3"))
    tb = GemvBench(dut, cfg, mem_size=MEM, seed=seed, p_stall=float(bench_env("P_STALL", "0.1")),
                   max_cols=cfg.gemv_max_cols, ddr4_mhz=mhz)
    await tb.reset()
    rng = np.random.default_rng(seed)
    rows, cols = int(bench_env("ROWS", "320")), int(bench_env("COLS", str(cfg.gemv_max_cols)))
    params = tb.ddr4_params
    ddr_per_cycle = params.peak_bytes_per_s / (mhz * 1e6)          # DDR4 peak bytes per fabric cycle
    port_per_cycle = cfg.axi_ports * cfg.bytes_per_beat
    channel = tb.use_ddr4(mhz)
    dense = random_case(cfg, rng, rows, cols, accm=True)
    y, cycles = await tb.run(dense, base=0)
    check(dense, y, cfg.act_block, f"dense {rows}x{cols} behind DDR4 at {mhz:g} MHz (seed {seed})")
    nbytes = bytes_read(tb, cfg)
    want = len(dense.weight_bytes()) + len(dense.scale_bytes())
    assert nbytes == want, f"dense: read {nbytes} bytes, the matrix has {want}"
    assert cycles >= nbytes / port_per_cycle and cycles >= nbytes / ddr_per_cycle, \
        f"dense: {cycles} cycles for {nbytes} bytes is above a peak"
    assert len(tb.latencies()) == sum(len(port) for port in tb.port_bursts())
    # the DDR4 peak alone keeps the dense GEMV longer than tREFI, so the channel must refresh inside it
    assert nbytes / ddr_per_cycle * channel.ratio > params.tREFI
    assert any(c.kind == "REF" for c in channel.log), "no refresh inside the dense GEMV"
    sparse = sparse_case(cfg, rng, min(rows, cfg.gemv_sparse_max_rows) // 2 * 2, cols, 0.3)
    y, cycles = await run_sparse(tb, cfg, sparse, f"sparse behind DDR4 at {mhz:g} MHz (seed {seed})", base=MEM // 2)
    nbytes = bytes_read(tb, cfg)
    assert cycles >= nbytes / port_per_cycle and cycles >= nbytes / ddr_per_cycle
    assert not tb.ddr4.errors, tb.ddr4.errors[0]
    check_timing(channel.log, params, channel.start_ck)
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0


@cocotb.test()
async def benchmark(dut):
    """E4B-shaped GEMVs for benchmarks/gemv.py: cycles from command to last result, bit-exact checked.
    Parameters: BENCH_SHAPES (comma list of "<rows>x<cols>", or "<rows>x<cols>@<density>" for a sparse GEMV
    whose activations have round(density * cols) non-zero values at random columns), BENCH_GROUP (the weight
    group, default the preset's), AXI_OUTSTANDING (the engine's `axi_max_outstanding`, default the preset's),
    LATENCY, BENCH_MEM, BENCH_OUT (JSON file), DDR4_MHZ (comma list of fabric
    clocks: every shape runs behind a fresh DDR4 channel model at each clock instead of the fixed-latency
    memories; the channel's command log is checked with `check_timing` and the read latencies are recorded per
    burst)."""
    import json
    cfg = HardwareConfig.preset(bench_env("NPU_HW", "kv260"))
    cfg = cfg.replace(axi_max_outstanding=int(bench_env("AXI_OUTSTANDING", str(cfg.axi_max_outstanding))))
    clocks = [float(c) for c in bench_env("DDR4_MHZ", "").split(",") if c]
    tb = GemvBench(dut, cfg, mem_size=int(bench_env("BENCH_MEM")), seed=1, latency=int(bench_env("LATENCY", "64")),
                   max_cols=cfg.gemv_max_cols, ddr4_mhz=clocks[0] if clocks else None)
    await tb.reset()
    rng = np.random.default_rng(1)
    results = []
    for shape in bench_env("BENCH_SHAPES").split(","):
        dims, _, density = shape.partition("@")
        rows, cols = (int(v) for v in dims.split("x"))
        case = random_case(cfg, rng, rows, cols, zero_rows=0.0, zero_cols=0.0,
                           group=int(bench_env("BENCH_GROUP", "0")) or None)
        case.q_a[case.q_a == 0] = 1
        if density:
            nz = round(float(density) * cols)
            case.q_a[rng.permutation(cols)[nz:]] = 0
            case.sparse = True
        for mhz in clocks or [None]:
            channel = tb.use_ddr4(mhz) if mhz else None
            y, cycles = await tb.run(case, base=0, timeout=50_000_000)
            check(case, y, cfg.act_block, f"benchmark {shape}" + (f" at {mhz:g} MHz" if mhz else ""))
            sbytes = len(case.scale_bytes())
            if case.sparse:
                nbytes = check_sparse_reads(cfg, tb, case)
                wbytes = nbytes - sbytes
                assert wbytes == np.count_nonzero(case.q_a) * rows // 2, "sparse bytes read"
            else:
                wbytes = len(case.weight_bytes())
                assert bytes_read(tb, cfg) == wbytes + sbytes, "dense bytes read"
            ideal = (wbytes + sbytes) / (cfg.axi_ports * cfg.bytes_per_beat)
            seg = min(case.group, cfg.act_block)
            parts = rows * -(-cols // seg)                 # one binary32 part per row and segment
            nsegs_nz = len({k // seg for k in np.flatnonzero(case.q_a)})
            r = dict(rows=rows, cols=cols, weight_bytes=wbytes, scale_bytes=sbytes, cycles=cycles,
                     ideal=ideal, efficiency=ideal / cycles, sparse=bool(case.sparse),
                     nonzero=int(np.count_nonzero(case.q_a)), parts=parts,
                     pipelines=gemv_parts(cfg) if case.sparse else 1,
                     part_bound=parts / (cfg.axi_ports * (gemv_parts(cfg) if case.sparse else 1)),
                     segments_with_nonzero=nsegs_nz,
                     segments=-(-cols // seg))
            if mhz:
                assert not tb.ddr4.errors, tb.ddr4.errors[0]
                check_timing(channel.log, tb.ddr4_params, channel.start_ck)
                lats, ns = tb.latencies(), 1e3 / mhz
                nbytes = wbytes + sbytes
                seconds = cycles / (mhz * 1e6)
                r.update(fabric_mhz=mhz, bytes=nbytes, bursts=len(lats), gb_s=nbytes / seconds / 1e9,
                         ddr_efficiency=nbytes / seconds / tb.ddr4_params.peak_bytes_per_s,
                         port_efficiency=ideal / cycles,
                         port_peak_gb_s=cfg.axi_ports * cfg.bytes_per_beat * mhz * 1e6 / 1e9,
                         lat_mean_ns=sum(lats) / len(lats) * ns, lat_min_ns=min(lats) * ns,
                         lat_p50_ns=percentile(lats, 0.5) * ns, lat_p90_ns=percentile(lats, 0.9) * ns,
                         lat_p99_ns=percentile(lats, 0.99) * ns, lat_max_ns=max(lats) * ns,
                         lat_mean_cycles=sum(lats) / len(lats), lat_max_cycles=max(lats),
                         refreshes=sum(c.kind == "REF" for c in channel.log),
                         activates=sum(c.kind == "ACT" for c in channel.log),
                         refresh_intervals=cycles * float(channel.ratio) / tb.ddr4_params.tREFI)
                dut._log.info(f"{shape} at {mhz:g} MHz: {cycles} cycles, {100 * r['ddr_efficiency']:.1f} % of the "
                              f"DDR4 peak, {100 * r['port_efficiency']:.1f} % of the ports', latency mean "
                              f"{r['lat_mean_ns']:.0f} ns, p99 {r['lat_p99_ns']:.0f} ns")
            else:
                dut._log.info(f"{shape}: {cycles} cycles, ideal {ideal:.0f}, efficiency {100 * ideal / cycles:.2f} %")
            results.append(r)
    with open(bench_env("BENCH_OUT"), "w") as f:
        json.dump(results, f, indent=1)


async def run_dense(tb, cfg, case, what, base):
    """A dense (INT4 or int8) case: bit-exact, and its weight and scale beats read exactly once."""
    y, cycles = await tb.run(case, base=base)
    check(case, y, cfg.act_block, what)
    check_span_reads(cfg, tb, dense_spans(cfg, case, *tb.last_addrs, tb.tile_rows))
    return y, cycles


def random_int8(cfg, rng, max_rows=70):
    """A random int8 case: rows, cols (beat multiples and not), pitch (= cols or up to 70 bytes more), group,
    vectors 1 .. V, accm, exponents, and the weights' start (any byte)."""
    W, B, V = cfg.weights_per_beat, cfg.bytes_per_beat, cfg.gemv_vectors
    rows = int(rng.choice([1, 2, 7, 8, 9, 17, 33, int(rng.integers(1, max_rows + 1))]))
    cols = int(rng.choice([1, B - 1, B, B + 1, W + 3, 3 * W + 5, 2 * cfg.weight_group, int(rng.integers(1, 400))]))
    group = int(rng.choice([0, 0, 2, 4, 8, 16, 64, 1 << 16])) or None    # (2, 4: segments narrower than a beat)
    if group:                                       # at most the engine's segments a row
        cols = min(cols, cfg.gemv_max_cols // min(cfg.act_block, cfg.weight_group) * group)
    pitch = cols if rng.random() < 0.3 else cols + int(rng.integers(1, 71))
    nvec = int(rng.integers(1, V + 1)) if V > 1 else None
    return int8_case(cfg, rng, rows, cols, pitch=pitch, vectors=nvec, group=group, accm=rng.random() < 0.4,
                     misalign=rng.random() < 0.5, e_range=(-150, 40) if rng.random() < 0.3 else (-20, 8))


@cocotb.test()
async def int8_random(dut):
    """INT8 weights (an engine with ``gemv_int8``): seeded random int8 commands (`random_int8`: rows, cols, pitch,
    the rows' start at any byte, groups, vectors 1 .. V, accm) and INT4 dense commands between them, each vector
    bit-exact against `sim.numerics.gemv` with the INT8 weights, every weight and scale beat read once; a sparse
    and a masked GEMV after them."""
    cfg, tb, rng, seed = await seeded_bench(dut)
    assert cfg.gemv_int8, "the bench needs an engine built with KV_V_LAYOUT=rows"
    W = cfg.weights_per_beat
    n = int(bench_env("CASES", "14"))
    for k in range(n):
        case = random_int8(cfg, rng)
        await run_dense(tb, cfg, case, f"int8 case {k} (seed {seed})", base=int(rng.integers(0, 4)) * 4096)
        if k % 3 == 2:                              # an INT4 command between int8 ones
            d = random_case(cfg, rng, int(rng.integers(1, 40)), int(rng.integers(1, 300)), accm=rng.random() < 0.5,
                            misalign=True)
            await run_dense(tb, cfg, d, f"INT4 after int8 {k} (seed {seed})", base=int(rng.integers(0, 4)) * 4096)
    await run_sparse_and_masked(tb, cfg, rng, "int8")
    d = random_int8(cfg, rng)
    await run_dense(tb, cfg, d, "int8 after sparse and masked", base=0)
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0


@cocotb.test()
async def int8_corners(dut):
    """int8 corners: all -128 weights against -128 and 127 activations (the largest segment sums; -127 with
    `gemv_pairs`, whose activations are the quantiser's), one column,
    one row, pitch = cols, rows of a whole and of an odd number of beats at every start byte of a beat, the
    attention's V shape (head_dim rows, one scale group, every vector, accm), the widest row; then an int8 command
    with `sparse` or `mask` is rejected without results, and the engine runs again."""
    cfg, tb = make_bench(dut, 15, latency=9, jitter=6, p_stall=0.2)
    await tb.reset()
    rng = np.random.default_rng(15)
    W, B, V = cfg.weights_per_beat, cfg.bytes_per_beat, cfg.gemv_vectors
    vec = V if V > 1 else None
    cases = []
    for a in (-127 if cfg.gemv_pairs else -128, 127):
        c = int8_case(cfg, rng, 9, 5 * W + 3, pitch=5 * W + 7, group=cfg.act_block)
        c.q_w[:] = -128
        c.q_a[:] = a
        c.scale[:] = 1.0
        cases.append((f"all -128 x {a}", c))
    cases.append(("1 column", int8_case(cfg, rng, 5, 1, pitch=1)))
    cases.append(("1 row", int8_case(cfg, rng, 1, 3 * B + 1, pitch=1000)))
    cases.append(("pitch = cols, accm", int8_case(cfg, rng, 19, 2 * W + 5, accm=True, vectors=vec)))
    for what, case in cases:
        case.w_offset = int(rng.integers(0, 2 * B))
    for off in range(B):
        c = int8_case(cfg, rng, 11, 4 * B if off % 2 else 3 * B + 3, pitch=4 * B + off, vectors=vec)
        c.w_offset = off
        cases.append((f"rows at byte {off} of a beat", c))
    hd = cfg.kv_max_head_dim
    c = int8_case(cfg, rng, hd, 300, pitch=517, group=1 << 16, accm=True, vectors=vec)
    c.w_offset = 3
    cases.append(("attention V rows", c))
    c = int8_case(cfg, rng, 3, tb.max_cols, pitch=tb.max_cols + 1)
    c.w_offset = 1
    cases.append(("max cols", c))
    for what, case in cases:
        await run_dense(tb, cfg, case, what, base=4096)
    assert int(dut.o_error.value) == 0 and int(dut.o_bad_cmd.value) == 0
    for extra in [dict(sparse=1)] + ([dict(mask=1)] if cfg.gemv_row_mask else []):
        await tb.reset()
        n0 = len(tb.out.items)
        await tb.cmd.send([pack_fields(command_layout(cfg), wbase=0, sbase=4096, rows=8, cols=40, log2_group=5,
                                       int8=1, pitch=40, **extra)])
        for _ in range(60):
            await FallingEdge(dut.clk)
        assert int(dut.o_bad_cmd.value) == 1 and len(tb.out.items) == n0 and int(dut.o_busy.value) == 0, \
            f"int8 with {extra} was not rejected"
    await tb.reset()
    c = int8_case(cfg, rng, 13, 77, pitch=80, vectors=vec, accm=True)
    await run_dense(tb, cfg, c, "int8 after rejected commands", base=0)


@cocotb.test()
async def int8_port_rate(dut):
    """int8 GEMVs of ROWS x COLS at a fixed LATENCY, bit-exact: with rows aligned to beats (pitch = COLS, a beat
    multiple, at a beat-aligned address) the cycles against the ideal, the weight and scale bytes over the ports'
    peak, at least MIN_EFFICIENCY (0.9) for one vector; with every vector; then rows at any byte (pitch COLS + 3,
    odd start: each chunk one DDR beat more), reported."""
    cfg, tb = make_bench(dut, 19, latency=int(bench_env("LATENCY", "30")))
    await tb.reset()
    rng = np.random.default_rng(19)
    V = cfg.gemv_vectors
    rows, cols = int(bench_env("ROWS", "128")), int(bench_env("COLS", str(cfg.gemv_max_cols)))
    floor = float(bench_env("MIN_EFFICIENCY", "0.9"))
    runs = [("aligned", cols, 0, None)] + ([("aligned", cols, 0, V)] if V > 1 else []) + \
        [("misaligned", cols + 3, 5, None)] + ([("misaligned", cols + 3, 5, V)] if V > 1 else [])
    for what, pitch, off, vec in runs:
        case = int8_case(cfg, rng, rows, cols, pitch=pitch, vectors=vec, group=cfg.weight_group)
        case.w_offset = off
        _, cycles = await run_dense(tb, cfg, case, f"int8 throughput {what}", base=0)
        nbytes = rows * cols + len(case.scale_bytes())
        ideal = nbytes / (cfg.axi_ports * cfg.bytes_per_beat)
        eff = ideal / cycles
        dut._log.info(f"int8 GEMV {rows}x{cols} {what} (pitch {pitch}, offset {off}), {vec or 1} vectors: "
                      f"{cycles} cycles, ideal {ideal:.0f}, port efficiency {100 * eff:.1f} %")
        if what == "aligned" and vec is None:
            assert eff >= floor, f"int8 port efficiency {eff:.3f} below {floor}"
