"""The DDR bandwidth probe: its register map, the command/burst/count model against hand-computed cases and
against the GEMV engine's own bursts (tb/ddrprobe/test_gemv_pattern.py), the host tool on stand-in boards
(`tb.board.make_standin`, with a register model of the probe), and the cocotb bench of the RTL against the
model (tb/ddrprobe/test_ddrprobe.py)."""

import re
import threading
import time

import pytest
from amaranth.hdl import Fragment

from firmware.board import BoardUnavailable, UioCsr
from firmware.ddrprobe import (
    DEFAULT_COLS,
    DEFAULT_PASSES,
    DEFAULT_ROWS,
    Measurement,
    check_probe,
    default_timeout,
    main,
    open_probe,
    report,
)
from hdl.config import HardwareConfig
from hdl.csr_map import NPU_ID
from hdl.ddrprobe import DdrProbe
from hdl.ddrprobe_map import (
    CTRL_IRQ_ACK,
    CTRL_START,
    GEMV_TILE_ROWS,
    LAT_MIN_NONE,
    PROBE_ID,
    REGISTERS,
    STATUS_BUSY,
    STATUS_CONFIG_ERROR,
    STATUS_DONE,
    by_name,
    gemv_chunk_bytes,
    markdown_table,
    version_word,
)
from hdl.gemv import GemvEngine
from hdl.memory_map import MEMORY_MAPS
from sim.ddrprobe import ProbeConfig, bursts, commands, counts
from tb.board import make_standin
from tb.runner import run

TINY = HardwareConfig.preset("tiny")          # 2 ports x 8 bytes, bursts of up to 16 beats: chunks of 128 bytes
KV260 = HardwareConfig.preset("kv260")        # 4 ports x 16 bytes at 300 MHz: chunks of 256 bytes
LOAD_PROBE = re.escape("load the probe's app: sudo xmutil loadapp gemma3n-ddrprobe")


def test_map():
    offsets = [r.offset for r in REGISTERS]
    assert len(set(offsets)) == len(offsets)
    assert PROBE_ID == int.from_bytes(b"DDRP", "big") and PROBE_ID != NPU_ID
    assert by_name("ID").offset == 0 and by_name("CTRL").access == "cmd" and by_name("BYTES_P3_HI").access == "ro"
    assert by_name("TILE_ROWS").reset == GEMV_TILE_ROWS and by_name("PASSES").reset == 1
    assert "| 0x01c | ROW_BYTES | rw |" in markdown_table()
    with pytest.raises(KeyError, match="no DDR probe CSR named 'NOPE'"):
        by_name("NOPE")


def test_engine_constants():
    # The probe's tile and chunk are the GEMV engine's (the bursts themselves: test_model_matches_the_gemv_engine)
    for hw in (TINY, KV260):        # the engine's default tile, without building an engine that is never used
        assert GemvEngine._check(hw, None, None)[1] == GEMV_TILE_ROWS
    assert (gemv_chunk_bytes(TINY), gemv_chunk_bytes(KV260)) == (128, 256)


# --- the model ------------------------------------------------------------------------------------------

def test_commands_follow_the_gemv_tiles():
    # 19 rows of 300 bytes (chunks of 128, 128, 44) and 4 scale bytes per row, tiles of 8 over 2 ports:
    # tile 0 (rows 0-7) and tile 2 (rows 16-18) on port 0, tile 1 on port 1
    cfg = ProbeConfig(wbase=0x1000, sbase=0x9000, rows=19, row_bytes=300, scale_bytes=4)
    p0, p1 = commands(TINY, cfg)

    def tile(first, trows):
        out = [(0x9000 + 4 * first, 4 * trows)]
        for off, n in ((0, 128), (128, 128), (256, 44)):
            out += [(0x1000 + 300 * (first + t) + off, n) for t in range(trows)]
        return out

    assert p0 == tile(0, 8) + tile(16, 3) and p1 == tile(8, 8)
    # one port takes every tile; no scales; three passes repeat the pass
    one = ProbeConfig(0x1000, 0x9000, 19, 300, 0, ports=1, passes=3)
    assert commands(TINY, one) == [sorted_by_tiles(TINY, one) * 3, []]
    assert commands(TINY, ProbeConfig(0, 0, 0, 100)) == [[], []]


def sorted_by_tiles(hw, cfg):
    """The commands of one pass on one port, written out tile after tile."""
    out = []
    for first in range(0, cfg.rows, cfg.tile_rows):
        trows = min(cfg.tile_rows, cfg.rows - first)
        for off in range(0, cfg.row_bytes, gemv_chunk_bytes(hw)):
            out += [(cfg.wbase + cfg.row_bytes * (first + t) + off, min(gemv_chunk_bytes(hw), cfg.row_bytes - off))
                    for t in range(trows)]
    return out


def test_bursts_split_at_max_length_and_4k():
    # one row of 300 bytes at 0xF83, no scales, one port: commands (0xF83, 128), (0x1003, 128), (0x1083, 44);
    # beats of 8 from the aligned start: 17 beats from 0xF80 cut at 0x1000 (16), then 17 (16 + 1), then 6
    cfg = ProbeConfig(0xF83, 0, 1, 300, 0, ports=1)
    assert bursts(TINY, cfg) == [[(0xF80, 16), (0x1000, 1), (0x1000, 16), (0x1080, 1), (0x1080, 6)], []]
    c = counts(TINY, cfg)
    assert (c.bursts, c.bytes_per_port, c.error_beats) == (5, (8 * 40, 0), 0)
    assert counts(TINY, cfg, error_beat=lambda a: a >= 0x1080).error_beats == 7
    two = counts(TINY, ProbeConfig(0xF83, 0, 1, 300, 0, ports=1, passes=2), error_beat=lambda a: a >= 0x1080)
    assert (two.bursts, two.bytes, two.error_beats) == (10, 640, 14)


def test_e4b_matrices_on_kv260():
    # FFN gate/up (16,384 x 2,048) and down (2,048 x 16,384), group 128: every chunk and every tile's scales
    # are whole 256-byte bursts, dealt evenly over the four ports
    up = ProbeConfig.gemv(KV260, 16384, 2048, base=0x8_0000_0000)
    assert (up.row_bytes, up.scale_bytes, up.sbase, up.tile_rows) == (1024, 32, 0x8_0000_0000 + (16 << 20), 8)
    down = ProbeConfig.gemv(KV260, 2048, 16384, base=0x8_0000_0000, passes=3)
    assert (down.row_bytes, down.scale_bytes, down.matrix_bytes) == (8192, 256, 2048 * (8192 + 256))
    for cfg, per_pass in ((up, 16384 * 4 + 2048), (down, 2048 * 32 + 256 * 8)):
        c = counts(KV260, cfg)
        assert c.bursts == per_pass * cfg.pass_count
        assert c.bytes_per_port == (cfg.matrix_bytes * cfg.pass_count // 4,) * 4
    assert ProbeConfig.gemv(KV260, 5, 3, base=0x10, group=2) == ProbeConfig(0x10, 0x40, 5, 2, 4)


def test_config_checks():
    ok = ProbeConfig(0, 0x1000, 4, 100, 8)
    assert ok.check(TINY).outstanding(TINY) == TINY.axi_max_outstanding
    assert ProbeConfig(0, 0, 1, 1, max_outstanding=2).outstanding(TINY) == 2
    assert ProbeConfig(0, 0, 1, 1, max_outstanding=99).outstanding(TINY) == TINY.axi_max_outstanding
    cases = [
        (dict(ports=3), r"probe ports must be 1..2 \(0: all\), not 3"),
        (dict(tile_rows=12), "probe tile_rows must be a power of two from 1 to 1024, not 12"),
        (dict(tile_rows=2048), "power of two from 1 to 1024, not 2048"),
        (dict(tile_rows=0), "power of two from 1 to 1024, not 0"),
        (dict(row_bytes=0), "probe row_bytes must be at least 1"),
        (dict(row_bytes=1 << 24), r"probe row_bytes must be an integer in 0..2\*\*24 - 1, not 16777216"),
        (dict(scale_bytes=1 << 20), r"probe scale_bytes must be an integer in 0..2\*\*20 - 1"),
        (dict(rows=-1), r"probe rows must be an integer in 0..2\*\*32 - 1, not -1"),
        (dict(wbase=(1 << 40) - 399), r"probe rows \[0xfffffffe71, 0x10000000001\) exceed the 40-bit AXI"),
        (dict(sbase=(1 << 40) - 16), r"probe scales \[0xfffffffff0, 0x10000000010\) exceed"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            ProbeConfig(**{**ok.__dict__, **change}).check(TINY)
    ProbeConfig(0, 0, 0, 0).check(TINY)                    # no rows: nothing to read, any row length
    with pytest.raises(ValueError, match="matrix cols must be a positive integer, not 0"):
        ProbeConfig.gemv(TINY, 4, 0, base=0)
    with pytest.raises(ValueError, match="group must be a power of two, not 24"):
        ProbeConfig.gemv(TINY, 4, 64, base=0, group=24)


def test_probe_constructor():
    probe = DdrProbe(TINY)
    assert probe.hw is TINY and {"s_axi", "o_irq", "m_axi0", "m_axi1"} == set(probe.signature.members)
    Fragment.get(probe, None)                 # elaborates
    with pytest.raises(TypeError, match="DdrProbe needs a HardwareConfig, not 'tiny'"):
        DdrProbe("tiny")
    with pytest.raises(ValueError, match="DdrProbe has byte counters for 4 ports, not the 8 of 'kv260'"):
        DdrProbe(KV260.replace(axi_ports=8, gemv_sparse_max_rows=4096))


# --- the host tool --------------------------------------------------------------------------------------

def test_report_efficiencies():
    # kv260: 19.2 GB/s peak on both counts; 9 bytes in every 10 of the ports' peak over 1e6 cycles
    cfg = ProbeConfig.gemv(KV260, 16384, 2048, base=0x8_0000_0000, passes=2)
    m = Measurement(KV260, cfg, cycles=1_000_000, bytes_per_port=(14_400_000,) * 4, bursts=225_000, error_beats=0,
                    lat_sum=225_000 * 60, lat_min=40, lat_max=90)
    assert m.port_efficiency == pytest.approx(0.9) and m.ddr_efficiency == pytest.approx(0.9)
    text = report(m)
    assert text.startswith("DDR probe on kv260: 16,384 rows of 1,024 bytes from 0x800000000 and 32 scale bytes per "
                           "row from 0x801000000, 2 passes; tiles of 8 rows on 4 of 4 ports")
    assert "17.280 GB/s: 90.0 % of the ports' peak" in text
    assert "mean 60.0 cycles (200 ns), min 40 (133 ns), max 90 (300 ns)" in text
    assert text.splitlines()[-1] == "python -m firmware.perf --hw kv260 --ddr-efficiency 0.900"
    # the default run (264 MiB) waits the minimum second; a longer one the time at 5 % of the ports' peak
    assert default_timeout(KV260, ProbeConfig.gemv(KV260, DEFAULT_ROWS, DEFAULT_COLS, base=0,
                                                   passes=DEFAULT_PASSES)) == 1.0
    big = ProbeConfig.gemv(KV260, 16384, 2048, base=0, passes=200)
    assert default_timeout(KV260, big) == pytest.approx(big.matrix_bytes * 200 / (0.05 * 19.2e9))


class ProbeRegisters:
    """The probe's register map in Python, for the host tool on a stand-in board (`UioCsr`'s ``csr=``): the
    ``rw`` registers hold what is written; CTRL.START checks the configuration as the RTL does
    (`ProbeConfig.check`) and runs it on an ideal memory (the model's counts; each port one beat per cycle,
    every burst answered one cycle after its address), or, with `finish` False, stays busy. The interrupt
    line (`irq`) is STATUS.DONE."""

    def __init__(self, hw, *, ident=PROBE_ID, version=None, finish=True):
        self.hw, self.finish = hw, finish
        self.values = {r.name: r.reset for r in REGISTERS}
        self.values.update(ID=ident, VERSION=version_word(hw.to_dict()) if version is None else version,
                           LAT_MIN=LAT_MIN_NONE)
        self.by_offset = {r.offset: r for r in REGISTERS}
        self.started: list[ProbeConfig] = []

    @property
    def irq(self) -> bool:
        return bool(self.values["STATUS"] & STATUS_DONE)

    def read32(self, offset):
        return self.values[self.by_offset[offset].name]

    def _set64(self, name, value):
        self.values[f"{name}_LO"], self.values[f"{name}_HI"] = value & 0xFFFF_FFFF, value >> 32

    def _get64(self, name):
        return self.values[f"{name}_LO"] | self.values[f"{name}_HI"] << 32

    def write32(self, offset, value):
        r = self.by_offset[offset]
        assert r.access != "ro", f"write to read-only {r.name}"
        if r.access == "rw":
            self.values[r.name] = value
            return
        if value & CTRL_IRQ_ACK:
            self.values["STATUS"] &= ~STATUS_DONE
        if value & CTRL_START and not self.values["STATUS"] & STATUS_BUSY:
            v = self.values
            cfg = ProbeConfig(self._get64("WBASE"), self._get64("SBASE"), v["ROWS"], v["ROW_BYTES"],
                              v["SCALE_BYTES"], v["TILE_ROWS"], v["PASSES"], v["PORTS"], v["MAX_OUTSTANDING"])
            self.started.append(cfg)
            for name in ("CYCLES", "BURSTS", "ERROR_BEATS", "LAT_SUM", *(f"BYTES_P{p}" for p in range(4))):
                self._set64(name, 0)
            try:
                cfg.check(self.hw)
            except ValueError:
                v["STATUS"] = STATUS_DONE | STATUS_CONFIG_ERROR
                return
            if not self.finish:
                v["STATUS"] = STATUS_BUSY
                return
            c = counts(self.hw, cfg)
            beats = [b // self.hw.bytes_per_beat for b in c.bytes_per_port]
            self._set64("CYCLES", max(beats) + 1 if c.bursts else 0)
            self._set64("BURSTS", c.bursts)
            self._set64("LAT_SUM", c.bursts)
            for p, b in enumerate(c.bytes_per_port):
                self._set64(f"BYTES_P{p}", b)
            v["LAT_MIN"], v["LAT_MAX"] = (1, 1) if c.bursts else (LAT_MIN_NONE, 0)
            v["STATUS"] = STATUS_DONE


@pytest.fixture
def probe_board(tmp_path):
    """A stand-in KV260 with the probe's app loaded: the UIO device, and a thread that delivers the interrupt
    whenever the host has enabled it and the registers' line is high."""
    board = make_standin(tmp_path)
    board.registers = ProbeRegisters(KV260)
    stop = threading.Event()

    def deliver():
        while not stop.wait(0.005):
            if board.interrupt.poll() and board.registers.irq:
                board.interrupt.update(True)

    thread = threading.Thread(target=deliver)
    thread.start()
    yield board
    stop.set()
    thread.join()
    board.close()


def test_cli_on_a_standin_board(probe_board, capsys):
    regs = probe_board.registers
    argv = ["--root", str(probe_board.root), "--rows", "64", "--cols", "2048", "--passes", "2"]
    assert main(argv, csr=regs) == 0
    out = capsys.readouterr().out
    want = ProbeConfig.gemv(KV260, 64, 2048, base=MEMORY_MAPS["kv260"].windows[0].base, passes=2)
    assert regs.started == [want]
    c = counts(KV260, want)
    assert f"read {c.bytes:,} bytes" in out and f"in {c.bursts:,} bursts" in out
    assert out.splitlines()[-1].startswith("python -m firmware.perf --hw kv260 --ddr-efficiency ")
    assert not regs.irq, "the tool left DONE (the interrupt line) up"
    # the host's re-enable word reaches the stand-in board's record when its delivery thread next reads the pty
    # (every 5 ms): wait for it rather than race it
    deadline = time.monotonic() + 5.0
    while not probe_board.interrupt.words and time.monotonic() < deadline:
        time.sleep(0.005)
    assert probe_board.interrupt.words == [1]


def test_cli_at_another_clock(probe_board, capsys):
    """``--clock-mhz``: a probe built for another core clock (`python -m hdl.build --clock-mhz`) answers with its
    preset's VERSION, and its cycles are seconds at that clock."""
    regs = probe_board.registers
    argv = ["--root", str(probe_board.root), "--rows", "64", "--cols", "2048", "--passes", "2", "--clock-mhz", "251"]
    assert main(argv, csr=regs) == 0
    out = capsys.readouterr().out
    assert " cycles at 251 MHz = " in out and "x 251 MHz = " in out


def test_cli_without_a_board(tmp_path, capsys):
    assert main(["--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"firmware.ddrprobe: no UIO device named 'npu' in \S+/sys/class/uio \(there is none\): "
                        rf"{LOAD_PROBE}\n", err)
    with make_standin(tmp_path / "pty") as board:           # on the board, the CSR page of /dev/uioN is mapped
        assert main(["--root", str(board.root)]) == 2
        assert "cannot map the CSR window of" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--ports", "5"], "probe ports must be 1..4 (0: all), not 5"),
    (["--rows", "0"], "matrix rows must be a positive integer, not 0"),
    (["--tile-rows", "3"], "probe tile_rows must be a power of two from 1 to 1024, not 3"),
    (["--group", "48"], "group must be a power of two, not 48"),
    (["--memory-map", "nope"], "unknown memory map 'nope'; choose one of: flat, kv260"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, not 0.0"),
    (["--clock-mhz", "0"], "--clock-mhz must be a number of MHz in (0, 1000], not 0.0"),
])
def test_cli_bad_arguments(tmp_path, capsys, args, message):
    assert main(args + ["--root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"firmware.ddrprobe: {message}\n"


@pytest.mark.parametrize("regs, message", [
    (dict(ident=NPU_ID), rf"the DDR probe's ID register \(CSR 0x000 at 0xa0000000 via \S+/dev/uio0\) reads "
                         rf"0x47334e31 \(\"G3N1\"\): the NPU is loaded, not the probe; {LOAD_PROBE}"),
    (dict(ident=0), rf"reads 0x00000000, expected 0x44445250 \(\"DDRP\"\): the programmable logic does not hold "
                    rf"the probe; {LOAD_PROBE}"),
    (dict(version=version_word(KV260.to_dict()) & ~0xFF | 1),
     r"the DDR probe is version 1 \(VERSION reads 0x[0-9a-f]{8}\), this tool drives version 2: rebuild it"),
    (dict(version=version_word(TINY.to_dict())),
     r"VERSION reads 0x[0-9a-f]{8}; a probe built for 'kv260' reads 0x[0-9a-f]{8}: pass the --hw it was built "
     r"for or rebuild it"),
], ids=["npu", "other", "probe-version", "other-preset"])
def test_another_design_answers(probe_board, capsys, regs, message):
    probe_board.registers = ProbeRegisters(KV260, **regs)
    assert main(["--root", str(probe_board.root)], csr=probe_board.registers) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"firmware.ddrprobe: (.* )?{message}.*\n", err) and err.count("\n") == 1
    assert probe_board.registers.started == []
    with pytest.raises(BoardUnavailable, match=message):
        open_probe(KV260, root=probe_board.root, csr=probe_board.registers)


def test_timeout_without_interrupt(probe_board, capsys):
    probe_board.registers.finish = False
    argv = ["--root", str(probe_board.root), "--rows", "16", "--passes", "1", "--timeout", "0.2"]
    assert main(argv, csr=probe_board.registers) == 2
    assert capsys.readouterr().err == ("firmware.ddrprobe: no interrupt from the DDR probe within 0.2 s (STATUS 0x1: "
                                       "busy): its reads did not complete; check --base against the DDR ranges, or "
                                       "allow longer with --timeout\n")


def test_uio_csr_is_the_board_layer(probe_board):
    # open_probe is firmware.board's UioCsr with the probe's messages
    with open_probe(KV260, root=probe_board.root, csr=probe_board.registers) as dev:
        assert isinstance(dev, UioCsr) and dev.path == probe_board.root / "dev/uio0"
        check_probe(dev, KV260)
        with pytest.raises(TimeoutError, match=r"^no interrupt from the DDR probe \(\S+/dev/uio0\) within 0.1 s$"):
            dev.wait_interrupt(0.1)
    with pytest.raises(ValueError, match=r"^the DDR probe device \(\S+/dev/uio0\) is closed$"):
        dev.csr_read(0)


# --- the RTL --------------------------------------------------------------------------------------------

def _bench(hw, seed, latency=20, pause=0.2, runs=6, testcase=None, **env):
    run(DdrProbe(hw), toplevel="ddrprobe", build_name=f"ddrprobe_{hw.name}", test_module="tb.ddrprobe.test_ddrprobe",
        testcase=testcase, extra_env={"NPU_HW": hw.name, "SEED": str(seed), "LATENCY": str(latency),
                                      "PAUSE": str(pause), "RANDOM_RUNS": str(runs), **env})


def test_probe_bench_tiny():
    _bench(TINY, 0)


def test_model_matches_the_gemv_engine():
    # the same component as tests/test_gemv_engine.py's tiny bench, so the two share one Verilator build
    run(GemvEngine(TINY), toplevel="gemv", build_name="gemv_tiny", test_module="tb.ddrprobe.test_gemv_pattern",
        extra_env={"NPU_HW": "tiny", "SEED": "3"})


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_probe_bench_tiny_more_seeds(seed):
    _bench(TINY, seed, latency=[5, 40, 80][seed - 1], pause=[0.0, 0.3, 0.5][seed - 1], runs=12)


@pytest.mark.slow
def test_probe_bench_kv260():
    _bench(KV260, 4, latency=60, runs=4)


@pytest.mark.slow
def test_model_matches_the_gemv_engine_kv260():
    run(GemvEngine(KV260), toplevel="gemv", build_name="gemv_kv260", test_module="tb.ddrprobe.test_gemv_pattern",
        extra_env={"NPU_HW": "kv260", "SEED": "4"})
