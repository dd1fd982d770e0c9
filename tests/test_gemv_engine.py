"""The whole GEMV engine (tiny preset) in cocotb + Verilator: bit-exact against sim.numerics.gemv under
random AXI latency and stalls, and behind the DDR4 channel model (tb/gemv/test_gemv.py)."""

import pytest

from hdl.config import HardwareConfig
from hdl.gemv import GemvEngine
from tb.runner import run

TINY = HardwareConfig.preset("tiny")


def _run(testcase, cfg=TINY, build="gemv_tiny", **env):
    run(GemvEngine(cfg), toplevel="gemv", test_module="tb.gemv.test_gemv", build_name=build,
        testcase=testcase, extra_env={"NPU_HW": "tiny", "ROW_MASK": str(int(cfg.gemv_row_mask)),
                                      **{k: str(v) for k, v in env.items()}})


def test_tiny_has_the_row_mask():
    assert TINY.gemv_row_mask          # so the benches below build the engine with it


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_engine_random(flow):
    _run("random_gemvs", SEED=21 + flow, FLOW=flow)


def test_engine_corners_errors_throughput():
    _run(["corner_cases", "bad_command_and_read_error", "throughput"])


@pytest.mark.parametrize("vectors, flow", [(4, 1), pytest.param(2, 2, marks=pytest.mark.slow),
                                           pytest.param(3, 0, marks=pytest.mark.slow)])
def test_engine_multi_vector(vectors, flow):
    """Dense GEMVs of 1 .. V activation vectors on an engine built with `gemv_vectors` V: each vector bit-exact,
    the matrix read once; the other modes between them; sparse or masked commands with V vectors rejected."""
    _run(["multi_vector_random"] + (["multi_vector_throughput"] if vectors == 4 else []),
         TINY.replace(gemv_vectors=vectors), build=f"gemv_tiny_v{vectors}", SEED=71 + vectors, FLOW=flow,
         VECTORS=vectors)


TINY_ROWS = TINY.replace(gemv_vectors=4, kv_v_layout="rows")


@pytest.mark.parametrize("cfg, flow", [(TINY_ROWS, 1), pytest.param(TINY_ROWS, 2, marks=pytest.mark.slow),
                                       pytest.param(TINY.replace(kv_v_layout="rows"), 0, marks=pytest.mark.slow)],
                         ids=["v4-1", "v4-2", "v1-0"])
def test_engine_int8(cfg, flow):
    """INT8 weights on the tiny engine with V rows (``gemv_int8``; four vectors, and one under ``-m slow``): the
    random int8 commands among INT4 ones, the corners and the rejected int8 commands, bit-exact with every beat
    read once; the default run also the throughput case (aligned at least 90 % of the port rate)."""
    extra = ["int8_corners", "int8_port_rate"] if flow == 1 else []
    _run(["int8_random"] + extra, cfg, build=f"gemv_tiny_rows_v{cfg.gemv_vectors}", SEED=91 + flow, FLOW=flow,
         VECTORS=cfg.gemv_vectors, KV_V_LAYOUT="rows")


TINY_PAIRS = TINY_ROWS.replace(gemv_pairs=True)


@pytest.mark.parametrize("flow", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_engine_vector_pairs(flow):
    """`gemv_pairs` (two vectors a DSP48E2, an adder tree a pair, the MAC two cycles longer): dense GEMVs of 1
    to 4 vectors among the other modes, INT8 commands among INT4 ones and the INT8 corners, each vector
    bit-exact with every beat read once; the multi-vector throughput case at the port rate."""
    _run(["multi_vector_random", "multi_vector_throughput", "int8_random", "int8_corners"], TINY_PAIRS,
         build="gemv_tiny_pairs", SEED=61 + flow, FLOW=flow, VECTORS=4, KV_V_LAYOUT="rows", PAIRS=1)


TINY_IL = TINY.replace(gemv_interleave=True)


@pytest.mark.slow
@pytest.mark.parametrize("flow", [0, 1, 2])
def test_engine_interleave(flow):
    """`gemv_interleave` (each chunk round's beats presented beat-major, the tile's rows interleaved per beat,
    through a round reorder memory a port; a segment sum per row in `SegmentMac`) on the tiny engine: the random
    dense GEMVs (sub-sums among them) and the masked ones, bit-exact with the dense ones between them; flow 1 also
    the corners, the rejected commands and read errors, the sparse mode between dense commands, and the
    throughput case, at least 91 % of the port rate (the round the reader takes after a port's last beat, T x 16
    cycles, is 2.8 % of this 128 x 1024 GEMV)."""
    extra = ["corner_cases", "bad_command_and_read_error", "sparse_random", "throughput"] if flow == 1 else []
    _run(["random_gemvs", "masked_random"] + extra, TINY_IL, build="gemv_tiny_il", SEED=111 + flow, FLOW=flow,
         INTERLEAVE=1, MIN_EFFICIENCY=0.91)


@pytest.mark.parametrize("cfg, build", [
    (TINY_PAIRS.replace(gemv_interleave=True), "gemv_tiny_il_pairs"),
    pytest.param(TINY.replace(gemv_vectors=4, gemv_interleave=True), "gemv_tiny_il_v4", marks=pytest.mark.slow),
    pytest.param(TINY_ROWS.replace(gemv_interleave=True), "gemv_tiny_il_rows", marks=pytest.mark.slow),
], ids=["pairs", "v4", "rows-v4"])
def test_engine_interleave_vectors_int8(cfg, build):
    """`gemv_interleave` with four activation vectors (each row's segment sums kept per vector, the walk's
    (s, v, t) order unchanged): dense GEMVs of 1 to 4 vectors among the other modes, each vector bit-exact, every
    beat read once, the multi-vector throughput within its bounds; with V rows (vector pairs; without them under
    ``-m slow``) also the INT8 commands among INT4 ones (a beat half an activation word: order (k, t, sel)), the
    INT8 corners and the INT8 port rate. The default suite's one interleaved build (pairs) also runs the one-vector
    cases of `test_engine_interleave`: random dense and masked GEMVs, corners, rejected commands and read errors,
    the sparse mode, the throughput at least 91 % of the port rate."""
    int8 = ["int8_random", "int8_corners", "int8_port_rate"] if cfg.gemv_int8 else []
    one = (["random_gemvs", "masked_random", "corner_cases", "bad_command_and_read_error", "sparse_random",
            "throughput"] if cfg.gemv_pairs else [])
    _run(one + ["multi_vector_random", "multi_vector_throughput"] + int8, cfg, build=build, SEED=121, FLOW=1,
         VECTORS=4, KV_V_LAYOUT=cfg.kv_v_layout, PAIRS=int(cfg.gemv_pairs), INTERLEAVE=1, MIN_EFFICIENCY=0.91)


@pytest.mark.slow
def test_engine_int8_kv260():
    """The kv260 engine with V rows (4 x 128-bit ports, four vectors, 22-bit segment sums): the random int8
    commands among INT4 ones and the corners, bit-exact; the throughput case on 256 x 2048 (the attention's 256
    rows; one vector at least 90 % of the port rate)."""
    cfg = HardwareConfig.preset("kv260").replace(kv_v_layout="rows")
    run(GemvEngine(cfg), toplevel="gemv", test_module="tb.gemv.test_gemv", build_name="gemv_kv260_rows",
        testcase=["int8_random", "int8_corners", "int8_port_rate"],
        extra_env={"NPU_HW": "kv260", "KV_V_LAYOUT": "rows", "SEED": "95", "FLOW": "1", "CASES": "8",
                   "ROWS": "256", "COLS": "2048", "MEM_SIZE": str(1 << 21)})


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_engine_sparse_random(flow):
    """Sparse mode: densities 0 / 5 / 30 / 100 %, bit-exact, only non-zero columns' beats read."""
    _run("sparse_random", SEED=31 + flow, FLOW=flow)


def test_engine_sparse_corners():
    _run("sparse_corners")


@pytest.mark.parametrize("flow", [0, 1, 2])
def test_engine_sparse_parts(flow):
    """Sparse mode on the engine built with `gemv_vectors` 4: two binary32 pipelines a port (`gemv_parts`), rows
    P * q + k on pipeline k. The random cases (densities 0 / 5 / 30 / 100 %, accm, rows up to
    `gemv_sparse_max_rows`, a port with 2 rows) and the corners (signed zeros, empty segments, all -8 x +-127,
    max cols, a multi-vector dense command between sparse ones), bit-exact; flow 1 adds the rejected commands and
    the read error, and the throughput case: the back end's bound with two pipelines, half the one-pipeline one."""
    extra = ["bad_command_and_read_error", "sparse_parts_throughput"] if flow == 1 else []
    _run(["sparse_random", "sparse_corners"] + extra, TINY.replace(gemv_vectors=4), build="gemv_tiny_v4",
         SEED=81 + flow, FLOW=flow, VECTORS=4, CASES=12)


def test_engine_sparse_throughput():
    """The same throughput case on the one-pipeline engine (the tiny preset): its bound, nseg x prow cycles."""
    _run("sparse_parts_throughput")


@pytest.mark.parametrize("flow", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_engine_row_mask(flow):
    """WGEMV `mask` on the tiny engine (it has the row mask): masked GEMVs at live-row densities 0 to 100 %
    bit-exact, reading only the live rows' beats; dense ones after them unchanged."""
    _run("masked_random", SEED=51 + flow, FLOW=flow)


@pytest.mark.slow
def test_engine_without_row_mask():
    """The engine built without the row mask (`gemv_row_mask` off): the random dense and sparse GEMVs."""
    _run(["random_gemvs", "sparse_random"], cfg=TINY.replace(gemv_row_mask=False), build="gemv_tiny_nomask",
         SEED=61, FLOW=1)


def test_engine_behind_ddr4():
    """Every port on one `tb.ddr4` channel, random AR/R pauses and o_y/i_acc flow control: a dense 320 x 1024
    GEMV (180 KB, longer than a refresh interval) and a sparse 128 x 1024 one at 30 %, bit-exact; bytes read
    = weight + scale bytes (dense) or the non-zero columns' beats (sparse); cycles >= bytes over the ports'
    peak and over the DDR4 peak per cycle; the DRAM command log keeps every timing rule. At 1,500 MHz the
    tiny engine's two 8-byte ports (24 GB/s) ask for more than the DDR4 peak, so the DDR binds."""
    _run("ddr4_stream", FABRIC_MHZ=1500, ROWS=320, SEED=3, P_STALL=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("flow", [1, 2])
def test_engine_random_kv260(flow):
    """The kv260 engine (4 x 128-bit ports, 128 lanes) on the same random cases; about 2 minutes of Verilator
    build. benchmarks/gemv.py also checks every E4B-shaped result of this engine bit for bit."""
    cfg = HardwareConfig.preset("kv260")
    run(GemvEngine(cfg), toplevel="gemv", test_module="tb.gemv.test_gemv", build_name="gemv_kv260",
        testcase="random_gemvs", extra_env={"NPU_HW": "kv260", "SEED": str(41 + flow), "FLOW": str(flow)})


@pytest.mark.slow
@pytest.mark.parametrize("flow", [1, 2])
def test_engine_interleave_kv260(flow):
    """The kv260 engine with `gemv_interleave` (4 x 128-bit ports, four vectors in pairs, V rows; rounds of 8 rows
    x 16 beats): the random dense GEMVs and the INT8 ones among INT4 ones with 1 to 4 vectors, bit-exact."""
    cfg = HardwareConfig.preset("kv260").replace(gemv_interleave=True)
    run(GemvEngine(cfg), toplevel="gemv", test_module="tb.gemv.test_gemv", build_name="gemv_kv260_il",
        testcase=["random_gemvs", "int8_random"],
        extra_env={"NPU_HW": "kv260", "INTERLEAVE": "1", "SEED": str(131 + flow), "FLOW": str(flow), "CASES": "8",
                   "MEM_SIZE": str(1 << 21)})


@pytest.mark.parametrize("argv, message", [
    (["--ddr4", "--clocks", "0"], "argument --clocks: must be a number of MHz in [1, 1000], not '0'"),
    (["--ddr4", "--clocks", "300", "fast"], "argument --clocks: must be a number of MHz in [1, 1000], not 'fast'"),
])
def test_benchmark_bad_arguments(argv, message, capsys):
    # one line naming the option, exit status 2, before anything is built
    from benchmarks.gemv import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("python -m benchmarks.gemv: error:")]
    assert len(lines) == 1 and message in lines[0], err
