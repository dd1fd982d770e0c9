"""The pass monitor: the steps the RTL controller starts, read from the NPU's ``o_trace``, against `sim.plan`.

Every cycle the monitor reads `hdl.controller.trace_layout` off the top and records what the controller
started: a GEMV-engine job (`sim.plan.Engine`), a WGEMM tile (`Gemm`), a pass (`Pass`; ``beside`` when it was
taken in the same cycle as an engine job), a scalar-ALU operation (`Alu`), in that order within a cycle, and
an instruction retiring. `PassMonitor.take` hands the instructions recorded since the last call, each as its
list of steps; `compare` checks them against the ISS's plans of the same program run (`sim.iss.Machine.steps`
through its ``trace``), instruction by instruction.
"""

from __future__ import annotations

import cocotb
from amaranth import Shape
from cocotb.triggers import RisingEdge

from hdl.controller import BSrc, Sink, Src, trace_layout
from hdl.ddrio import DdrFormat
from hdl.sfu import SfuOp
from sim.plan import Alu, Engine, Gemm, Pass

__all__ = ["PassMonitor", "decode_cycle", "compare"]


def _field(bits: int, layout, path: str) -> int:
    """The unsigned value of field `path` ("a.b.c") of `layout` in `bits`."""
    offset = 0
    for name in path.split("."):
        f = layout[name]
        offset += f.offset
        layout = f.shape
    width = Shape.cast(layout).width
    return (bits >> offset) & ((1 << width) - 1)


def decode_cycle(bits: int, layout) -> tuple[list, bool]:
    """(the steps started in one cycle, whether an instruction retired) from the trace's `bits`."""
    def get(path):
        return _field(bits, layout, path)
    steps = []
    engine = bool(get("gemv_valid"))
    if engine:
        cmd = dict(layout["gemv"].shape["cmd"].shape)
        vecs = get("gemv.cmd.vecs") if "vecs" in cmd else 0
        steps.append(Engine(rows=get("gemv.cmd.rows"), cols=get("gemv.cmd.cols"), accm=bool(get("gemv.cmd.accm")),
                            sparse=bool(get("gemv.cmd.sparse")), vectors=vecs + 1,
                            int8="int8" in cmd and bool(get("gemv.cmd.int8"))))
    if get("gemm_valid"):
        steps.append(Gemm(rows=get("gemm.cmd.rows"), cols=get("gemm.cmd.cols"), tokens=get("gemm.cmd.ntok"),
                          accm=bool(get("gemm.cmd.accm"))))
    if get("pass_valid"):
        strided = "wr_stride" in dict(layout["pass_"].shape)      # a DDR sink that scatters bytes (V rows)
        op = None if get("pass_.bypass") else SfuOp(get("pass_.op")).name
        src = Src(get("pass_.a")).name
        steps.append(Pass(op=op, src=src, b=BSrc(get("pass_.b")).name, sink=Sink(get("pass_.sink")).name,
                          n=get("pass_.n"), fmt=DdrFormat(get("pass_.ddr_fmt")).name if src == "DDR" else None,
                          beside=engine, stride=strided and bool(get("pass_.wr_stride"))))
    if get("alu_valid"):
        steps.append(Alu())
    return steps, bool(get("retire"))


class PassMonitor:
    """Records the controller's steps per instruction from ``dut.o_trace`` (start it with `start`)."""

    def __init__(self, dut, hw):
        self.dut, self.layout = dut, trace_layout(hw)
        self._done: list[list] = []          # instructions retired since the last `take`
        self._open: list = []                # the steps of the instruction running

    def start(self) -> None:
        cocotb.start_soon(self._run())

    async def _run(self):
        clk, trace = self.dut.clk, self.dut.o_trace
        while True:
            await RisingEdge(clk)
            bits = int(trace.value)
            if not bits:
                continue
            steps, retired = decode_cycle(bits, self.layout)
            self._open.extend(steps)
            if retired:
                self._done.append(self._open)
                self._open = []

    def where(self) -> str:
        """Where the controller stands, for a message on a hang: the instructions retired since the last `take`,
        the last one's steps and those the running instruction has started."""
        last = self._done[-1] if self._done else []
        return (f"{len(self._done)} instructions retired since the monitor was last read (the last: {last[-3:]}); "
                f"the running one started {len(self._open)} steps: {self._open[-3:]}")

    def take(self) -> tuple[list[list], list]:
        """(the retired instructions' steps since the last call, the steps of an instruction that stopped
        without retiring: an error)."""
        done, opened = self._done, self._open
        self._done, self._open = [], []
        return done, opened


def compare(rtl: list[list], unfinished: list, iss: list[tuple[int, object, list]], listing=None) -> list[str]:
    """Problems between the RTL's steps per instruction and the ISS's ``(pc, insn, steps)`` per executed
    instruction of the same run (empty: the same steps, instruction by instruction)."""
    problems = []

    def where(k):
        pc, insn, _ = iss[k]
        text = listing[pc].strip() if listing is not None and 0 <= pc < len(listing) else insn.op.name
        return f"instruction {k} (pc {pc}: {text})"
    if len(rtl) != len(iss):
        problems.append(f"the RTL retired {len(rtl)} instructions, the ISS ran {len(iss)}")
    for k, (got, (_, _, want)) in enumerate(zip(rtl, iss)):
        if list(got) != list(want):
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            problems.append(f"{where(k)}: step {first} differs: RTL "
                            f"{got[first] if first < len(got) else 'nothing'} ({len(got)} steps), plan "
                            f"{want[first] if first < len(want) else 'nothing'} ({len(want)} steps)")
            if len(problems) >= 8:
                break
    if unfinished:
        problems.append(f"steps after the last retired instruction: {unfinished[:4]}")
    return problems
