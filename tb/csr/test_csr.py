"""cocotb bench of `hdl.csr.CsrBlock` behind cocotbext-axi's AxiLiteMaster, with random pauses on all five
AXI-Lite channels. A Python model of the map (from `hdl.csr_map`, independent of the RTL) predicts every
read value and response; command registers are checked by watching their one-cycle pulses."""

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ReadOnly, RisingEdge
from cocotbext.axi import AxiLiteBus, AxiLiteMaster, AxiResp

from hdl.csr_map import REGISTERS
from tb.runner import bench_env

RO = [r for r in REGISTERS if r.access == "ro"]
RW = [r for r in REGISTERS if r.access == "rw"]
CMD = [r for r in REGISTERS if r.access == "cmd"]
MAPPED = {r.offset for r in REGISTERS}


def pauses(rng, p):
    while True:
        yield int(rng.random() < p)


async def setup(dut, rng, pause):
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    master = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "axil", bus_separator="__"), dut.clk, dut.rst)
    if pause:
        for ch in (master.write_if.aw_channel, master.write_if.w_channel, master.write_if.b_channel,
                   master.read_if.ar_channel, master.read_if.r_channel):
            ch.set_pause_generator(pauses(rng, pause))
    ro_values = {}
    for r in RO:
        ro_values[r.name] = rng.randrange(1 << 32)
        getattr(dut, "i_" + r.name.lower()).value = ro_values[r.name]
    dut.rst.value = 1
    for _ in range(3):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    await RisingEdge(dut.clk)
    return master, ro_values


async def watch_pulses(dut, log):
    sig = {r.name: getattr(dut, "o_" + r.name.lower()) for r in CMD}
    while True:
        await RisingEdge(dut.clk)
        await ReadOnly()
        for name, s in sig.items():
            v = int(s.value)
            if v:
                log.append((name, v))


@cocotb.test()
async def random_access(dut):
    seed = int(bench_env("SEED", "0"))
    rng = random.Random(seed)
    for pause in (0.0, 0.3, 0.6):
        master, ro_values = await setup(dut, rng, pause)
        model = {r.name: r.reset for r in RW}
        pulses = []
        cocotb.start_soon(watch_pulses(dut, pulses))
        for step in range(150):
            kind = rng.random()
            if kind < 0.45:                                    # write a word or some bytes
                reg = rng.choice(REGISTERS)
                nbytes = rng.choice([4, 4, 4, 1, 2])
                lane = rng.randrange(0, 4 - nbytes + 1) if nbytes < 4 else 0
                data = bytes(rng.randrange(256) for _ in range(nbytes))
                resp = await master.write(reg.offset + lane, data)
                if reg.access == "ro":
                    assert resp.resp == AxiResp.SLVERR, f"seed {seed}: write to RO {reg.name} gave {resp.resp}"
                else:
                    assert resp.resp == AxiResp.OKAY, f"seed {seed}: write to {reg.name} gave {resp.resp}"
                if reg.access == "rw":
                    b = bytearray(model[reg.name].to_bytes(4, "little"))
                    b[lane:lane + nbytes] = data
                    model[reg.name] = int.from_bytes(b, "little")
                elif reg.access == "cmd":
                    for _ in range(3):
                        await RisingEdge(dut.clk)
                    expect = int.from_bytes(data, "little") << (8 * lane)
                    got = [v for n, v in pulses if n == reg.name]
                    pulses.clear()
                    if expect:
                        assert got == [expect], f"seed {seed}: {reg.name} pulses {got}, expected [{expect:#x}]"
                    else:
                        assert got == [], f"seed {seed}: {reg.name} pulsed {got} on a zero write"
            elif kind < 0.9:                                   # read any register
                reg = rng.choice(REGISTERS)
                resp = await master.read(reg.offset, 4)
                got = int.from_bytes(resp.data, "little")
                expect = {"rw": model.get(reg.name), "ro": ro_values.get(reg.name), "cmd": 0}[reg.access]
                assert resp.resp == AxiResp.OKAY and got == expect, \
                    f"seed {seed} step {step}: read {reg.name} = {got:#x} ({resp.resp}), expected {expect:#x}"
            else:                                              # unmapped offset
                off = rng.choice([o for o in range(0, 4096, 4) if o not in MAPPED])
                wr = await master.write(off, b"\x01\x02\x03\x04")
                rd = await master.read(off, 4)
                assert wr.resp == AxiResp.SLVERR and rd.resp == AxiResp.SLVERR and rd.data == b"\0\0\0\0", \
                    f"seed {seed}: unmapped {off:#x} answered {wr.resp}/{rd.resp}"
        # after all that, every rw register holds the model's value
        for r in RW:
            got = int.from_bytes((await master.read(r.offset, 4)).data, "little")
            assert got == model[r.name], f"seed {seed}: {r.name} = {got:#x}, model {model[r.name]:#x}"
            assert int(getattr(dut, "o_" + r.name.lower()).value) == model[r.name]


@cocotb.test()
async def concurrent_reads_and_writes(dut):
    """Reads and writes in flight at the same time, issued without awaiting each other."""
    rng = random.Random(int(bench_env("SEED", "0")) + 1)
    master, _ = await setup(dut, rng, 0.4)
    regs = RW[:8]
    values = [rng.randrange(1 << 32) for _ in regs]
    writes = [master.init_write(r.offset, v.to_bytes(4, "little")) for r, v in zip(regs, values)]
    for ev in writes:
        await ev.wait()
        assert ev.data.resp == AxiResp.OKAY
    reads = [master.init_read(r.offset, 4) for r in regs]
    for r, v, ev in zip(regs, values, reads):
        await ev.wait()
        assert int.from_bytes(ev.data.data, "little") == v, f"{r.name}"
