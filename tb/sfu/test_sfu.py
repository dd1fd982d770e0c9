"""cocotb side of the whole-SFU bench (`hdl.sfu.Sfu`): every operation, seeded random data plus edge values,
random valid gaps on ``i_cmd``/``i_data`` and random ``o_data.ready``; results against `sim.sfu` (and NumPy
float32 for add/mul) in the compositions of `sim.iss` (FMAS two roundings, SOFTCAP tanh(x*recip(c))*c, ...),
bit for bit. Elements go in beats: one per beat for the functions; for `SHORT_OPS` a random mix of 1..4 per
beat (element-wise ops) or full beats with a short last (reductions, the SFU's contract). Parameters: NPU_HW
(preset), SEED, ROUNDS (commands per operation), STALL (0/1)."""

import cocotb
import numpy as np
from amaranth.lib import data
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge

from hdl.config import PRESETS
from hdl.fp import QNAN
from hdl.l2 import LANES
from hdl.sfu import REDUCE_OPS, SHORT_OPS, SfuOp, command_layout, data_layout, result_layout
from sim import sfu as model
from tb.runner import bench_env

F32 = np.float32
EDGES = np.array([0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000,
                  0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                  0x3F800000, 0xBF800000, 0x4B000000, 0x1F800000, 0x5F800000, 0x42C80000, 0xC2DC0000,
                  0x3A000000, 0x39FFFFFF, 0x47C35000, 0x4CBEBC20], np.uint32)


def f32(u):
    return np.asarray(u, np.uint32).view(np.float32)


def u32(x):
    return np.asarray(x, np.float32).view(np.uint32)


def operands(rng, n):
    """n binary32 bit patterns: a third random bits, a third wide-range normals, a third edge values."""
    kind = rng.integers(0, 3, n)
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    wide = u32((rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n)).astype(F32))
    edge = EDGES[rng.integers(0, len(EDGES), n)]
    return np.where(kind == 0, bits, np.where(kind == 1, wide, edge)).astype(np.uint32)


def expected(op, a, b, c, hw):
    """The result bits of one command (sim.iss compositions on sim.sfu functions)."""
    O = SfuOp
    fa, fb = f32(a), f32(b)
    s, si, emax = (f32(np.uint32(c[k]))[()] for k in ("s", "s_inv", "emax"))
    with np.errstate(all="ignore"):
        if op in (O.ROPE_COS, O.ROPE_SIN):
            f = (a.astype(np.uint64) << np.uint64(32)) | b.astype(np.uint64)
            return (model.rope_cos if op is O.ROPE_COS else model.rope_sin)(f, c["pos"])
        red = {O.REDUCE_SUM: lambda: model.reduce_sum(fa, hw), O.SUM: lambda: model.reduce_sum(fa, hw),
               O.REDUCE_MAX: lambda: model.reduce_max(fa, hw), O.MAX: lambda: model.reduce_max(fa, hw),
               O.SUMSQ: lambda: model.reduce_sum(fa * fa, hw), O.DOT: lambda: model.reduce_sum(fa * fb, hw)}
        if op in red:
            return np.array([red[op]()], F32)
        vec = {O.ADD: lambda: fa + fb, O.SUB: lambda: fa - fb, O.MUL: lambda: fa * fb, O.MULS: lambda: fa * s,
               O.ADDS: lambda: fa + s, O.FMAS: lambda: fa * s + fb, O.COPY: lambda: fa.copy(),
               O.RELU_SUBS: lambda: np.maximum(fa - s, F32(0)), O.GELU_MUL: lambda: model.gelu_tanh(fa) * fb,
               O.MULS_MUL: lambda: (fa * s) * fb}
        if op in vec:
            return np.asarray(vec[op](), F32)
        x = fa - emax if c["sub_emax"] else fa
        cvo = {O.EXP: model.exp, O.SQRT: model.sqrt, O.GELU: model.gelu_tanh, O.SIN: model.sin, O.COS: model.cos,
               O.RECIP: model.recip, O.TANH: model.tanh, O.RSQRT: model.rsqrt,
               O.SCALE: lambda v: v * (si if c["recip_scale"] else s),
               O.SOFTCAP: lambda v: model.tanh(v * si) * s}
        y = np.asarray(cvo[op](x), F32)
        return (fb + y).astype(F32) if c["accm"] else y


def commands(hw, rng, rounds):
    """(op, command dict, a, b) for every operation, `rounds` commands each, shuffled."""
    out = []
    for op in SfuOp:
        for r in range(rounds):
            n = int(rng.integers(1, 3 * hw.sfu_reduce_lanes + 5)) if r else 1
            if op in REDUCE_OPS and r == rounds - 1:
                n = 70
            a, b = operands(rng, n), operands(rng, n)
            if op in (SfuOp.EXP, SfuOp.GELU, SfuOp.GELU_MUL, SfuOp.TANH, SfuOp.SOFTCAP) and r % 2:
                a = u32((rng.standard_normal(n) * 6).astype(F32))
            if op in (SfuOp.ROPE_COS, SfuOp.ROPE_SIN):
                a = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
                b = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
            s = F32(rng.choice([rng.standard_normal() * 4, 30.0, -0.0, 1e-42, 3e38]))
            with np.errstate(all="ignore"):
                c = dict(op=op, length=n, sub_emax=int(rng.integers(0, 2)), recip_scale=int(rng.integers(0, 2)),
                         accm=int(rng.integers(0, 2)) if r % 3 == 1 else 0,
                         s=int(u32(s)), s_inv=int(u32(model.recip(np.array([s]))[0])),
                         emax=int(u32(F32(rng.standard_normal() * 3))),
                         pos=int(rng.choice([0, 1, 4095, 32767, 32768, int(rng.integers(0, 2 ** 20))])))
            out.append((op, c, a, b))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def compare(op, got, want, a):
    got = np.asarray(got, np.uint32)
    if op is SfuOp.COPY:                       # a copy keeps NaN payloads
        np.testing.assert_array_equal(got, a, err_msg="COPY")
        return
    want_nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(f32(got)), want_nan, err_msg=f"{op.name}: NaN-ness")
    np.testing.assert_array_equal(got[want_nan], np.full(want_nan.sum(), QNAN, np.uint32),
                                  err_msg=f"{op.name}: NaN bits")
    np.testing.assert_array_equal(got[~want_nan], u32(want)[~want_nan], err_msg=f"{op.name}")


async def reset(dut):
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value = 1
    dut.i_cmd__valid.value = 0
    dut.i_data__valid.value = 0
    dut.o_data__ready.value = 0
    await RisingEdge(dut.clk)
    await FallingEdge(dut.clk)
    dut.rst.value = 0


def beat_sizes(op, n, rng):
    """The element counts of the beats of one command of `n` elements (see the module docstring)."""
    if op not in SHORT_OPS:
        return [1] * n
    if op in REDUCE_OPS or rng.random() < 0.5:
        return [LANES] * (n // LANES) + ([n % LANES] if n % LANES else [])
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(min(rng.integers(1, LANES + 1), n - sum(sizes))))
    return sizes


def beat_bits(a, b, i, k):
    """Input beat of elements i .. i + k - 1 (lanes from k on hold junk a real producer might leave)."""
    pad = lambda v: [int(x) for x in v[i:i + k]] + [0xDEADBEEF] * (LANES - k)
    return int(data_layout().const({"a": pad(a), "b": pad(b), "n": k}).as_bits())


def result_beat(value):
    """(results of an output beat) from its bits."""
    view = data.Const(result_layout(), int(value))
    return [int(view.y[j]) for j in range(int(view.n))]


async def drive(dut, hw, cmds, stall, rng):
    """Push every command and its beats with random gaps, collect outputs with random ready; returns the
    outputs per command and the cycle count."""
    layout = command_layout(hw)
    data = [(c, a, b, beat_sizes(op, len(a), rng)) for op, c, a, b in cmds]
    ci, di, bi, de = 0, 0, 0, 0           # next command, command whose data is sent, its beat, first element
    want_out = sum(1 if op in REDUCE_OPS else len(a) for op, _, a, _ in cmds)
    outs, cycles = [], 0
    while len(outs) < want_out:
        await FallingEdge(dut.clk)
        cycles += 1
        assert cycles < 20 * want_out + 5000, f"SFU stalled after {len(outs)} of {want_out} results"
        go = lambda: (not stall) or rng.random() < 0.75
        cmd_valid = ci < len(cmds) and go()
        dut.i_cmd__valid.value = int(cmd_valid)
        if cmd_valid:
            dut.i_cmd__payload.value = int(layout.const(cmds[ci][1]).as_bits())
        data_valid = di < ci and go()
        while data_valid and bi >= len(data[di][3]):
            di, bi, de = di + 1, 0, 0
            data_valid = di < ci
        dut.i_data__valid.value = int(data_valid)
        if data_valid:
            dut.i_data__payload.value = beat_bits(data[di][1], data[di][2], de, data[di][3][bi])
        ready = (not stall) or rng.random() < 0.7
        dut.o_data__ready.value = int(ready)
        await ReadOnly()
        if cmd_valid and dut.i_cmd__ready.value:
            ci += 1
        if data_valid and dut.i_data__ready.value:
            de += data[di][3][bi]
            bi += 1
        if ready and dut.o_data__valid.value:
            outs.extend(result_beat(dut.o_data__payload.value))
    return outs, cycles


@cocotb.test()
async def every_op_random_stalls(dut):
    hw = PRESETS[bench_env("NPU_HW", "tiny")]
    rng = np.random.default_rng(int(bench_env("SEED", "1")))
    cmds = commands(hw, rng, int(bench_env("ROUNDS", "4")))
    await reset(dut)
    outs, cycles = await drive(dut, hw, cmds, bench_env("STALL", "1") == "1", rng)
    k = 0
    for op, c, a, b in cmds:
        n = 1 if op in REDUCE_OPS else len(a)
        compare(op, outs[k:k + n], expected(op, a, b, c, hw), a)
        k += n
    dut._log.info(f"{len(cmds)} commands, {k} results in {cycles} cycles")


async def _timed(dut, layout, op, a, b, width=1):
    """One command of len(a) elements in beats of `width` with no stalls: (cycle of the first input, cycles
    of the result beats, results)."""
    n = len(a)
    dut.o_data__ready.value = 1
    dut.i_cmd__valid.value = 1
    dut.i_cmd__payload.value = int(layout.const(dict(op=op, length=n)).as_bits())
    # held until taken: a short command waits a cycle or two for the previous long elements' exits to be counted
    while True:
        await ReadOnly()
        taken = bool(dut.i_cmd__ready.value)
        await FallingEdge(dut.clk)
        if taken:
            break
    dut.i_cmd__valid.value = 0
    first_in, times, outs, i, cycle = None, [], [], 0, 0
    want = 1 if op in REDUCE_OPS else n
    while len(outs) < want:
        k = min(width, n - i)
        dut.i_data__valid.value = int(i < n)
        if i < n:
            dut.i_data__payload.value = beat_bits(a, b, i, k)
        await ReadOnly()
        if i < n and dut.i_data__ready.value:
            first_in = cycle if first_in is None else first_in
            i += k
            last_in = cycle
        if dut.o_data__valid.value:
            outs.extend(result_beat(dut.o_data__payload.value))
            times.append(cycle)
        await FallingEdge(dut.clk)
        cycle += 1
        assert cycle < 2000
    dut.i_data__valid.value = 0
    return first_in, last_in, times, outs


@cocotb.test()
async def latency_and_full_rate(dut):
    """No stalls: the first result comes `latency` (GELU_MUL, one element per beat) or `short_latency` (ADD,
    four per beat) cycles after the first beat, then one beat per cycle; a reduction's scalar comes a fixed
    number of cycles after its last beat."""
    hw = PRESETS[bench_env("NPU_HW", "tiny")]
    n = 64
    rng = np.random.default_rng(5)
    a, b = u32(rng.standard_normal(n).astype(F32)), u32(rng.standard_normal(n).astype(F32))
    await reset(dut)
    layout = command_layout(hw)
    for op, width, latency, want in (
            (SfuOp.GELU_MUL, 1, int(bench_env("LATENCY", "0")), lambda: model.gelu_tanh(f32(a)) * f32(b)),
            (SfuOp.ADD, LANES, int(bench_env("SHORT_LATENCY", "0")), lambda: f32(a) + f32(b))):
        first_in, _, times, outs = await _timed(dut, layout, op, a, b, width)
        assert times[0] - first_in == latency, \
            f"{op.name}: first result after {times[0] - first_in} cycles, latency {latency}"
        assert times[-1] - times[0] == n // width - 1, f"{op.name}: not one beat per cycle"
        with np.errstate(all="ignore"):
            compare(op, outs, want(), a)
    _, last_in, times, outs = await _timed(dut, layout, SfuOp.DOT, a, b, LANES)
    compare(SfuOp.DOT, outs, np.array([model.reduce_sum(f32(a) * f32(b), hw)]), a)
    dut._log.info(f"SFU latency {bench_env('LATENCY', '?')}, short {bench_env('SHORT_LATENCY', '?')}; reduction of "
                  f"{n}: scalar {times[0] - last_in} cycles after the last beat")
