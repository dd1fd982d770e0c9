"""The DDR4 channel model (`tb.ddr4.model`): directed sequences whose cycle counts follow by hand from the timing
parameters, seeded random streams checked against the timing rules (`check_timing`) and for their data, the
parameter checks, the cocotb adapter serving reads and writes under random pauses (tb/ddr4/test_axi.py), and the
DDR probe behind the model in Verilator (tb/ddr4/test_probe.py).

The directed cases run the ports at the DRAM clock (1 fabric cycle = 1 tCK) with no request or response
pipeline (``request_ck = response_ck = 0``), so every number is a sum of DDR4-2400 timings: CL = tRCD = tRP =
17, tRAS = 39, tRC = 56, tCCD_S = 4, tCCD_L = 6, tRTP = 9, tRFC = 420, tREFI = 9360, a 64-byte burst on the
bus for 4 clocks. A read's beats (16 bytes, one per clock) are available the clock after they leave the bus:
a RD at clock c has its last beat available at c + CL + 4 = c + 21.
"""

from __future__ import annotations

import random

import pytest

from hdl.config import HardwareConfig
from hdl.ddrprobe import DdrProbe
from tb.ddr4 import Ddr4Channel, Ddr4Params, TimingViolation, check_timing
from tb.ddr4.model import Command
from tb.runner import BUILD_ROOT, run

P = Ddr4Params(request_ck=0, response_ck=0, refresh=False)
ROW = P.row_bytes                     # 8 KB: the next row-sized block is the other bank group
SAME_BANK_NEXT_ROW = P.row_bytes * P.banks


def channel(params=P, ports=2, **kw):
    return Ddr4Channel(params, fabric_hz=params.clock_hz, ports=ports, **kw)


def kinds(ch):
    return [(c.ck, c.kind) for c in ch.log]


def test_parameters_and_address_map():
    p = Ddr4Params()
    assert (p.burst_bytes, p.burst_ck, p.banks, p.row_bytes, p.capacity) == (64, 4, 8, 8192, 4 << 30)
    assert p.peak_bytes_per_s == 19.2e9
    assert p.tRC == p.tRAS + p.tRP and p.tRTW == p.CL + p.burst_ck + 2 - p.CWL
    # ns -> clocks at tCK = 1/1.2 GHz, rounded up: the values of the docstring table
    def ck(ns):
        return -(-round(ns * 1200) // 1000)
    assert (ck(14.16), ck(32), ck(46.16), ck(5), ck(5.3), ck(6.4), ck(30), ck(15), ck(7.5), ck(350), ck(7800)) == \
        (p.tRCD, p.tRAS, p.tRC, p.tCCD_L, p.tRRD_S, p.tRRD_L, p.tFAW, p.tWR, p.tRTP, p.tRFC, p.tREFI)
    assert p.locate(0) == (0, 0, 0, 0) and p.locate(64) == (0, 0, 0, 8)
    assert p.locate(ROW) == (1, 0, 0, 0) and p.locate(2 * ROW) == (0, 1, 0, 0)
    assert p.locate(SAME_BANK_NEXT_ROW + 128) == (0, 0, 1, 16)
    # the other map: bank group, then bank, at every 64-byte burst
    q = Ddr4Params(address_map="row-column-bank-bg")
    assert [q.locate(a) for a in (8, 64, 128, 512, 8192 * 8)] == \
        [(0, 0, 0, 1), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 8), (0, 0, 1, 0)]
    for kw, msg in [(dict(CL=-1), "CL must be an integer >= 0, not -1"), (dict(tRP=1.5), "tRP must be an integer"),
                    (dict(banks_per_group=3), "banks_per_group must be a power of two, not 3"),
                    (dict(write_low=60), "0 < write_low < write_high <= write_cam"),
                    (dict(refresh=1), "refresh must be a bool"),
                    (dict(address_map="row-bank-column"), "address_map must order row, bank, bg and column")]:
        with pytest.raises((ValueError, TypeError), match=msg):
            Ddr4Params(**kw)
    with pytest.raises(ValueError, match="fabric_hz must be positive"):
        Ddr4Channel(fabric_hz=0)
    with pytest.raises(ValueError, match="port_bytes must divide the 64-byte DRAM burst, not 24"):
        Ddr4Channel(fabric_hz=3e8, port_bytes=24)
    ch = channel()
    with pytest.raises(ValueError, match="port must be 0..1, not 2"):
        ch.read(2, 0, 64, 0)
    with pytest.raises(ValueError, match="whole 16-byte beats at a beat address, not 64 bytes at 0x8"):
        ch.read(0, 8, 64, 0)


def test_row_miss_on_an_idle_bank():
    # ACT at 0, RD at tRCD = 17, last beat at 17 + 21 = 38
    ch = channel()
    r = ch.read(0, 0, 64, 0)
    ch.run()
    assert kinds(ch) == [(0, "ACT"), (17, "RD")]
    assert r.ready == [35, 36, 37, 38] and r.done == 38


def test_row_hit():
    # the second 64 bytes of the same row enter the controller a clock later and hit the open row: its RD
    # waits tCCD_L (same bank group) after the first, 17 + 6 = 23, done at 23 + 21 = 44
    ch = channel()
    a, b = ch.read(0, 0, 64, 0), ch.read(0, 64, 64, 0)
    ch.run()
    assert kinds(ch) == [(0, "ACT"), (17, "RD"), (23, "RD")]
    assert (a.done, b.done) == (38, 44)
    # a 256-byte burst (an HP port's 16 x 16 bytes): four RDs tCCD_L apart, its 16 beats in order
    ch = channel()
    r = ch.read(0, 0, 256, 0)
    ch.run()
    assert kinds(ch) == [(0, "ACT"), (17, "RD"), (23, "RD"), (29, "RD"), (35, "RD")]
    assert r.ready == [35, 36, 37, 38, 41, 42, 43, 44, 47, 48, 49, 50, 53, 54, 55, 56]


def test_beats_reach_the_port_as_their_dram_bursts_are_scheduled():
    # banks interleaved at every 64-byte burst: a 128-byte read is two DRAM bursts in the two bank groups. ACT
    # (group 0) at 0; the second burst enters a clock later, its ACT waits tRRD_S: 7; RDs at 17 and 24. After
    # clock 20 the first four beats are known (35..38) and the read is not done; then 24 + 17 + 1 = 42..45
    q = Ddr4Params(request_ck=0, response_ck=0, refresh=False, address_map="row-column-bank-bg")
    ch = channel(q)
    r = ch.read(0, 0, 128, 0)
    ch.advance(20)
    assert kinds(ch) == [(0, "ACT"), (7, "ACT"), (17, "RD")]
    assert r.ready == [35, 36, 37, 38] and r.done is None
    ch.run()
    assert r.ready == [35, 36, 37, 38, 42, 43, 44, 45] and r.done == 45


def test_two_ports_on_one_bank():
    # port 0 reads row 0, port 1 row 1 of the same bank, both at cycle 0. The arbiter takes port 0 first:
    # ACT row 0 at 0, RD at 17 (done 38). The bank's row stays open while port 0's request wants it; PRE at
    # max(ACT + tRAS, RD + tRTP) = max(39, 26) = 39, ACT row 1 at max(PRE + tRP, ACT + tRC) = 56, RD at 73,
    # done 73 + 21 = 94
    ch = channel()
    a, b = ch.read(0, 0, 64, 0), ch.read(1, SAME_BANK_NEXT_ROW, 64, 0)
    ch.run()
    assert kinds(ch) == [(0, "ACT"), (17, "RD"), (39, "PRE"), (56, "ACT"), (73, "RD")]
    assert (a.done, b.done) == (38, 94)
    check_timing(ch.log, P)


def test_row_miss_after_a_hit_stream():
    # a read of row 1 arriving while the bank serves row 0: PRE waits for tRAS and tRTP of the last RD
    ch = channel()
    first = [ch.read(0, 64 * k, 64, 0) for k in range(8)]       # RDs at 17, 23, ..., 59
    late = ch.read(1, SAME_BANK_NEXT_ROW, 64, 30)
    ch.run()
    rd = [ck for ck, k in kinds(ch) if k == "RD"]
    assert rd[:8] == [17 + 6 * k for k in range(8)]
    # PRE at max(0 + 39, 59 + 9) = 68, ACT at 85, RD at 102, done 123
    assert kinds(ch)[9:] == [(68, "PRE"), (85, "ACT"), (102, "RD")]
    assert first[-1].done == 59 + 21 and late.done == 123


def test_refresh_in_a_stream():
    # the first refresh falls due at tREFI = 9360. A read arriving at 9350 opens its row (ACT 9350) and, being
    # queued before the refresh fell due, gets its RD (9367, done 9388); then PREA at ACT + tRAS = 9389, REF at
    # PREA + tRP = 9406; the next read (arriving at 9400, same row) waits for tRFC: ACT at 9406 + 420 = 9826,
    # RD at 9843, done 9864
    p = Ddr4Params(request_ck=0, response_ck=0)
    ch = channel(p)
    a = ch.read(0, 0, 64, 9350)
    ch.advance(9400)
    b = ch.read(0, 64, 64, 9400)
    ch.run()
    assert kinds(ch) == [(9350, "ACT"), (9367, "RD"), (9389, "PREA"), (9406, "REF"), (9826, "ACT"), (9843, "RD")]
    assert (a.done, b.done) == (9388, 9864)
    check_timing(ch.log, p)
    # an idle channel refreshes on time, every tREFI, with no PREA (every bank is closed)
    ch = channel(p)
    ch.advance(3 * 9360 + 1)
    assert kinds(ch) == [(9360, "REF"), (18720, "REF"), (28080, "REF")]


def test_continuous_stream_loses_the_refresh_time():
    # four ports asking for 256-byte bursts of one sequential 512 KB stream faster than the DRAM serves them:
    # over three refresh intervals the data bus is busy more than 85 % of the clocks, never during a tRFC
    p = Ddr4Params(request_ck=0, response_ck=0)
    ch = channel(p, ports=4)
    for k in range(2000):
        ch.read(k % 4, k * 256, 256, k)
    ch.run()
    check_timing(ch.log, p)
    end, refs = ch.log[-1].ck, sum(c.kind == "REF" for c in ch.log)
    assert refs == 3 and 0.85 < ch.busy_ck / end < 1 - refs * p.tRFC / end


def test_bank_group_alternation():
    # rows open in bank group 0 (bank 0) and bank group 1 (bank 0) by a warm-up read each; at clock 1000 eight
    # 64-byte reads enter, one per clock, in order. Alternating bank groups, each RD waits only tCCD_S = 4 after
    # the one before (and tCCD_L = 6 after the last of its own group, already past): RDs at 1000, 1004, ...,
    # 1028, the last done at 1049. All in bank group 0: tCCD_L = 6 apart, RDs at 1000, 1006, ..., 1042, done 1063.
    def run_case(addrs):
        ch = channel()
        ch.read(0, 0, 64, 0)
        ch.read(0, ROW, 64, 0)
        ch.advance(1000)
        rs = [ch.read(0, a, 64, 1000) for a in addrs]
        ch.run()
        return [ck for ck, k in kinds(ch) if k == "RD" and ck >= 1000], rs[-1].done, ch

    alt = [(k // 2) * 64 + (k % 2) * ROW for k in range(8)]
    rd, done, ch = run_case(alt)
    assert rd == [1000 + 4 * k for k in range(8)] and done == 1049
    check_timing(ch.log, P)
    rd, done, ch = run_case([64 * k for k in range(8)])
    assert rd == [1000 + 6 * k for k in range(8)] and done == 1063


def test_fabric_clock_conversion():
    # 300 MHz ports: 4 DRAM clocks per cycle. A read at cycle 10 is visible at clock 40 + request_ck (24):
    # ACT 64, RD 81. Beat j (16 bytes) leaves the bus in clock 81 + 17 + j and is at the port response_ck (24)
    # clocks after that clock ends: clocks 123, 124, 125, 126, i.e. cycles 31, 31, 32, 32 (rounded up). The
    # port takes one beat per cycle: 31, 32, 33, 34
    ch = Ddr4Channel(Ddr4Params(refresh=False), fabric_hz=300e6)
    r = ch.read(0, 0, 64, 10)
    ch.run()
    assert kinds(ch) == [(64, "ACT"), (81, "RD")]
    assert r.ready == [31, 32, 33, 34]
    # 250 MHz: 4.8 clocks per cycle, rounded up at the crossing
    ch = Ddr4Channel(Ddr4Params(refresh=False), fabric_hz=250e6)
    assert (ch.to_ck(5), ch.to_ck(6), ch.to_cycle(24), ch.to_cycle(25)) == (24, 29, 5, 6)


def test_writes_then_reads_return_the_data():
    mem = bytearray(1 << 16)
    p = Ddr4Params(request_ck=0, response_ck=0, refresh=False)
    ch = channel(p, memory=mem)
    data = bytes(range(256))
    w = ch.write(0, 0x100, data, 0)
    r = ch.read(1, 0x100, 256, 5)
    ch.run()
    assert w.done is not None and r.read_data == data
    assert [c.kind for c in ch.log].count("WR") == 4 and [c.kind for c in ch.log].count("RD") == 4
    check_timing(ch.log, p)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_streams(seed):
    """Four ports, random reads and writes of 1..16 beats (no 4 KB crossing) over 256 KB, at random times, with
    refresh: the log keeps every timing rule, every read returns the bytes of the writes that entered before it
    (a reference memory updated in the same order), every burst is served, beats in order."""
    rng = random.Random(seed)
    p = Ddr4Params()
    size = 1 << 18
    mem = bytearray(rng.randbytes(size))
    ch = Ddr4Channel(p, fabric_hz=rng.choice([300e6, 250e6, 200e6]), memory=mem)
    ref = bytearray(mem)
    t, reads, writes = 0, [], []
    for _ in range(1500):
        t += rng.choice([0, 0, 1, 2, 5, 40])
        beats = rng.randrange(1, 17)
        addr = rng.randrange(0, size // 16) * 16
        addr -= max(0, (addr & 0xFFF) + 16 * beats - 0x1000)
        port = rng.randrange(4)
        ch.advance(t)
        if rng.random() < 0.3:
            writes.append(ch.write(port, addr, rng.randbytes(16 * beats), t))
        else:
            reads.append(ch.read(port, addr, 16 * beats, t))
    ch.run()
    check_timing(ch.log, p, ch.start_ck)
    assert sum(c.kind == "REF" for c in ch.log) >= 1
    # replay the order of entry into the controller on the reference memory
    assert all(w.done is not None for w in writes) and all(r.done is not None for r in reads)
    for b in writes:
        ref[b.addr:b.addr + b.nbytes] = b.data
    assert mem == ref
    for port in range(4):
        mine = [b for b in reads if b.port == port]
        flat = [x for b in mine for x in b.ready]
        assert flat == sorted(flat) and len(set(flat)) == len(flat), f"port {port}: beats out of order"
        for b in mine:
            assert b.ready[0] > b.arrival
    assert all(r.read_data is not None and len(r.read_data) == r.nbytes for r in reads)


def test_read_data_follows_the_order_of_entry():
    # a write and then a read of the same bytes on another port: the read sees the write; a read entering
    # before the write sees the old bytes
    mem = bytearray(b"\x11" * 4096)
    ch = channel(memory=mem)
    before = ch.read(1, 0, 64, 0)
    ch.advance(1)
    ch.write(0, 0, b"\x22" * 64, 1)
    ch.advance(3)
    after = ch.read(1, 0, 64, 3)
    ch.run()
    assert before.read_data == b"\x11" * 64 and after.read_data == b"\x22" * 64


def test_check_timing_catches_violations():
    ok = [Command(0, "ACT", 0, 0, 5), Command(17, "RD", 0, 0, 5, 0), Command(39, "PRE", 0, 0)]
    assert check_timing(ok, P) == 3
    cases = [
        ([Command(0, "ACT", 0, 0, 5), Command(16, "RD", 0, 0, 5, 0)], "tRCD"),
        ([Command(0, "ACT", 0, 0, 5), Command(17, "RD", 0, 0, 6, 0)], "CAS to a row that is not open"),
        ([Command(0, "ACT", 0, 0, 5), Command(38, "PRE", 0, 0)], "tRAS"),
        ([Command(0, "ACT", 0, 0, 5), Command(17, "RD", 0, 0, 5, 0), Command(22, "RD", 0, 0, 5, 8)], "tCCD"),
        ([Command(0, "ACT", 0, 0, 5), Command(7, "ACT", 0, 1, 5)], "tRRD"),
        ([Command(0, "ACT", 0, 0, 1), Command(7, "ACT", 1, 0, 1), Command(15, "ACT", 0, 1, 1),
          Command(22, "ACT", 1, 1, 1), Command(30, "ACT", 0, 2, 1)], "tFAW"),
        ([Command(0, "ACT", 0, 0, 5), Command(39, "PRE", 0, 0), Command(55, "ACT", 0, 0, 6)], "tRC"),
        ([Command(0, "ACT", 0, 0, 5), Command(40, "PRE", 0, 0), Command(56, "ACT", 0, 0, 6)], "tRP"),
        ([Command(0, "ACT", 0, 0, 5), Command(17, "WR", 0, 0, 5, 0), Command(40, "RD", 0, 0, 5, 8)], "tWTR"),
        ([Command(0, "ACT", 0, 0, 5), Command(17, "RD", 0, 0, 5, 0), Command(27, "WR", 0, 0, 5, 8)], "tRTW"),
        ([Command(0, "ACT", 0, 0, 5), Command(17, "RD", 0, 0, 5, 0), Command(30, "REF")], "REF with a bank open"),
        ([Command(0, "REF"), Command(419, "ACT", 0, 0, 1)], "ACT within tRFC"),
        ([Command(0, "ACT", 0, 0, 5), Command(0, "ACT", 1, 0, 5)], "two commands in one clock"),
    ]
    for log, rule in cases:
        with pytest.raises(TimingViolation, match=rule):
            check_timing(log, P)
    with pytest.raises(TimingViolation, match="no REF 1"):
        check_timing([Command(20000, "ACT", 0, 0, 1)], Ddr4Params())


# --- the DDR probe behind the model, in Verilator ------------------------------------------------------------

KV260 = HardwareConfig.preset("kv260")


def probe_run(clocks, rows, cols, passes=1, out=None):
    out = out or BUILD_ROOT / f"ddr4_probe_{rows}x{cols}.json"
    run(DdrProbe(KV260), toplevel="ddrprobe", build_name="ddrprobe_kv260", test_module="tb.ddr4.test_probe",
        extra_env={"NPU_HW": "kv260", "FABRIC_MHZ": ",".join(f"{c:g}" for c in clocks), "ROWS": str(rows),
                   "COLS": str(cols), "PASSES": str(passes), "OUT": str(out)})
    import json
    return json.loads(out.read_text())


@pytest.mark.slow
def test_probe_behind_the_model():
    # a 256 x 2048 matrix (256 KB and its scales) at 300 and 200 MHz: the counters, bursts, latencies and the
    # DRAM timing rules are checked inside the bench (tb/ddr4/test_probe.py); here the figures
    res = probe_run([300, 200], 256, 2048)
    assert [r["fabric_mhz"] for r in res] == [300, 200]
    # at 300 MHz the four ports ask for the whole DDR peak and the DRAM binds; at 200 MHz the ports bind
    assert 0.85 < res[0]["ddr_efficiency"] < 0.97 and res[1]["port_efficiency"] > 0.97
    assert res[0]["lat_mean_ns"] > res[0]["lat_min_ns"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "argument --rows: must be a positive integer, not '0'"),
    (["--clocks", "300", "fast"], "argument --clocks: must be a number of MHz in [1, 1000], not 'fast'"),
    (["--outstanding", "9"], "argument --outstanding: must be an integer in 0..8, not '9'"),
    (["--pipeline-ck", "-1"], "argument --pipeline-ck: must be an integer >= 0, not '-1'"),
    (["--map", "bank-row"], "argument --map: invalid choice: 'bank-row'"),
])
def test_benchmark_bad_arguments(argv, message, capsys):
    # one line naming the option, exit status 2, before anything is built
    from benchmarks.ddr import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("python -m benchmarks.ddr: error:")]
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("seed, pause, mhz", [
    (0, 0.3, 300),
    pytest.param(1, 0.0, 250, marks=pytest.mark.slow),
    pytest.param(2, 0.6, 200, marks=pytest.mark.slow),
])
def test_axi_adapter_reads_and_writes(seed, pause, mhz):
    # tb/ddr4/test_axi.py: cocotbext-axi masters through a passthrough into the model, pauses on both sides (a
    # small Verilator build: the first seed runs in the default suite, in about 15 s)
    from tb.ddr4.passthrough import AxiPassthrough
    run(AxiPassthrough(KV260), toplevel="ddr4_passthrough", build_name="ddr4_passthrough",
        test_module="tb.ddr4.test_axi", extra_env={"SEED": str(seed), "PAUSE": str(pause), "FABRIC_MHZ": str(mhz)})
