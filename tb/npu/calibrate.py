"""cocotb test ``calibrate``: micro-programs that isolate each cost of the RTL controller, for the
performance model (`firmware.perf.fit_rates`; `python -m benchmarks.npu` runs it and fits).

Every program is run on the RTL (CYCLES from START to DONE) and through the ISS's ``count`` arithmetic (its
passes and instructions). Each repeats one kind of work `REPS` times at two sizes, so the fit separates the
fixed cost of a pass from its elements. The results go to the JSON file ``NPU_RESULT``:
``[{"name", "cycles", "words"}]`` (the host rebuilds the ISS counters from the words). With
``NPU_CALIBRATE=gemm`` the programs are `gemm_programs` instead: WGEMMs of 1, 4 and 8 tokens against the
same products as WGEMVs; with ``NPU_CALIBRATE=gemm_shapes`` they are `gemm_shape_programs`: WGEMMs of more
shapes and token counts (ragged rows and columns, partial and several token tiles) for the WGEMM cost of
`firmware.perf` (`tests/test_perf.py` holds the cycles measured with it).
"""

from __future__ import annotations

import json
from pathlib import Path

import cocotb
from cocotb.task import bridge

from firmware.compiler import Program
from firmware.pack import pack
from firmware.runtime import CsrBackend, attach_rtl_device, detach_rtl_device
from hdl.config import HardwareConfig
from hdl.isa import CtrlFunc, DdrRegion, DmaDir, Opcode, ScalarFunc, VecFunc, encode
from sim.config import ModelConfig
from tb.npu.bench import NpuBench, SimDevice
from tb.npu.host import load_npz
from tb.runner import ROOT, bench_env

REPS = 16


def _ctrl(func, imm=0):
    return encode(Opcode.CTRL, func=func, imm=imm)


def micro_programs(image, hw: HardwareConfig) -> dict[str, list[int]]:
    """name -> program words (each ends with HALT)."""
    halt = _ctrl(CtrlFunc.HALT)
    mat = next(d for d in image.descriptors if d.kind == 0 and d.layout == 0 and d.cols <= hw.gemv_max_cols
               and d.rows <= 256)
    progs = {"nop": [_ctrl(CtrlFunc.NOP)] * REPS}
    for n in (4, 64):
        vec = lambda f, s=0: encode(Opcode.VEC, func=f, dst=64, a=0, b=32, s=s, async_=0)   # noqa: E731
        progs[f"vec_add_{n}"] = [_ctrl(CtrlFunc.SETVL, n)] + [vec(VecFunc.ADD)] * REPS
        progs[f"vec_sum_{n}"] = [_ctrl(CtrlFunc.SETVL, n)] + [vec(VecFunc.SUM, 1)] * REPS
        progs[f"vec_gelu_mul_{n}"] = [_ctrl(CtrlFunc.SETVL, n)] + [vec(VecFunc.GELU_MUL)] * REPS
        progs[f"dma_in_{n}"] = [_ctrl(CtrlFunc.SETVL, n)] + [
            encode(Opcode.DMA, dir=DmaDir.DDR_TO_L2, region=DdrRegion.CONST, l2=0, offset=0, async_=0)] * REPS
        progs[f"dma_out_{n}"] = [_ctrl(CtrlFunc.SETVL, n)] + [
            encode(Opcode.DMA, dir=DmaDir.L2_TO_DDR, region=DdrRegion.SCRATCH, l2=0, offset=0, async_=0)] * REPS
    progs["scalar_ld"] = [encode(Opcode.SCALAR, func=ScalarFunc.LD, d=1, a=0, b=0, imm=5)] * REPS
    progs["scalar_add"] = [encode(Opcode.SCALAR, func=ScalarFunc.ADD, d=1, a=1, b=2, imm=0)] * REPS
    progs["scalar_recip"] = [encode(Opcode.SCALAR, func=ScalarFunc.RECIP, d=1, a=3, b=0, imm=0)] * REPS
    def gemv(reuse):
        return encode(Opcode.WGEMV, dst=128, src=0, desc=mat.index, accm=0, findemax=0, sparse=0, reuse=reuse, mask=0,
                      async_=0)

    progs["wgemv"] = [_ctrl(CtrlFunc.SETVL, 4)] + [gemv(0)] * REPS
    # the same WGEMVs without their quantiser passes (reuse), which separates quant_pass from gemv_fixed
    progs["wgemv_reuse"] = [_ctrl(CtrlFunc.SETVL, 4)] + [gemv(0)] + [gemv(1)] * (REPS - 1)
    return {k: v + [halt] for k, v in progs.items()}


# WGEMM programs: the activations (1,024 binary32 from the CONST region) loaded to L2 word 0, outputs at 1024.
_GEMM_LOAD = [_ctrl(CtrlFunc.SETVL, 1024),
              encode(Opcode.DMA, dir=DmaDir.DDR_TO_L2, region=DdrRegion.CONST, l2=0, offset=0, async_=0)]


def _wgemm_program(d, tokens: int) -> list[int]:
    """The activation load, one WGEMM of `tokens` tokens through descriptor `d`, HALT."""
    return _GEMM_LOAD + [encode(Opcode.WGEMM, dst=1024, src=0, desc=d.index, tokens=tokens, accm=0, async_=0),
                         _ctrl(CtrlFunc.HALT)]


def gemm_programs(image, hw: HardwareConfig) -> dict[str, list[int]]:
    """name -> program: one WGEMM of T tokens, or T WGEMVs (the same products on the GEMV engine), for two
    matrices (128 x 64: 16 row tiles, one chunk; 64 x 128: 8 row tiles, two chunks)."""
    by = image.matrices()
    halt, load = _ctrl(CtrlFunc.HALT), _GEMM_LOAD
    progs = {}
    for name in ("layers.1.self_attn.q_proj.weight", "layers.1.self_attn.o_proj.weight"):
        d = by[name]
        ins, outs = -(-d.cols // 4), -(-d.rows // 4)
        for t in (1, 4, 8):
            progs[f"wgemm_{d.rows}x{d.cols}_t{t}"] = _wgemm_program(d, t)
            progs[f"wgemv_{d.rows}x{d.cols}_t{t}"] = load + [
                encode(Opcode.WGEMV, dst=1024 + k * outs, src=k * ins, desc=d.index, accm=0, findemax=0, sparse=0,
                       reuse=0, mask=0, async_=0) for k in range(t)] + [halt]
        progs[f"load_{d.rows}x{d.cols}"] = load + [halt]
    return progs


GEMM_SHAPES = (("layers.0.self_attn.q_proj.weight", (2, 3, 12)), ("layers.0.self_attn.o_proj.weight", (2, 12)),
               ("layers.0.self_attn.k_proj.weight", (1, 4, 8)), ("per_layer_model_projection.weight", (4, 5)),
               ("embed_tokens_per_layer.weight", (1, 4, 7)), ("embed_tokens.weight", (4,)),
               ("altup_projections.0.weight", (4, 16)))


def gemm_shape_programs(image, hw: HardwareConfig) -> dict[str, list[int]]:
    """name -> program: the activation load, then one WGEMM of T tokens (``wgemm_<rows>x<cols>_t<T>``), for the
    matrices and token counts of `GEMM_SHAPES`; ``load`` is the load alone."""
    by = image.matrices()
    progs = {"load": _GEMM_LOAD + [_ctrl(CtrlFunc.HALT)]}
    for name, tokens in GEMM_SHAPES:
        d = by[name]
        for t in tokens:
            progs[f"wgemm_{d.rows}x{d.cols}_t{t}"] = _wgemm_program(d, t)
    return progs


def _measure(device, image, progs, log) -> list[dict]:
    npu = CsrBackend(device)
    out = []
    for name, words in progs.items():
        npu.load(image, Program(words=words, steps=[name] * len(words)))
        npu.run(0, 0)
        cycles = npu.csr_read64("CYCLES")
        log(f"calibrate {name}: {cycles} cycles")
        out.append({"name": name, "cycles": cycles, "words": [int(w) for w in words]})
    return out


def calibrate_host(device, case, hw, log) -> list[dict]:
    image = pack(ModelConfig.from_hf(case.config), case.tensors, hw, max_positions=4)
    mode = bench_env("NPU_CALIBRATE", "micro")
    progs = {"gemm": gemm_programs, "gemm_shapes": gemm_shape_programs}.get(mode, micro_programs)(image, hw)
    return _measure(device, image, progs, log)


@cocotb.test()
async def calibrate(dut):
    hw = HardwareConfig.preset(bench_env("NPU_HW", "tiny"))
    bench = NpuBench(dut, hw, seed=int(bench_env("SEED", "0")), pause=float(bench_env("NPU_PAUSE", "0")))
    await bench.start()
    device = SimDevice(bench)
    attach_rtl_device(device)
    case = load_npz(Path(bench_env("NPU_NPZ", str(ROOT / "tests" / "fixtures" / "f64_s2_l7.npz"))))
    try:
        results = await bridge(calibrate_host)(device, case, hw, dut._log.info)
    finally:
        detach_rtl_device()
    Path(bench_env("NPU_RESULT")).write_text(json.dumps(results))
