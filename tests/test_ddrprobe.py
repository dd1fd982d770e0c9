"""The DDR bandwidth probe: its register map, the burst/count model against hand-computed cases, the host tool
without a board, and the cocotb bench of the RTL against the model (tb/ddrprobe/test_ddrprobe.py)."""

import mmap

import pytest
from amaranth.hdl import Fragment

from firmware.ddrprobe import Measurement, UioDevice, find_uio, main, report
from hdl.config import HardwareConfig
from hdl.csr_map import NPU_ID
from hdl.ddrprobe import DdrProbe
from hdl.ddrprobe_map import PROBE_ID, REGISTERS, by_name, markdown_table
from sim.ddrprobe import ProbeConfig, bursts, chunks, counts
from tb.runner import run

TINY = HardwareConfig.preset("tiny")          # 2 ports x 8 bytes, bursts of up to 16 beats
KV260 = HardwareConfig.preset("kv260")        # 4 ports x 16 bytes at 300 MHz


def test_map():
    offsets = [r.offset for r in REGISTERS]
    assert len(set(offsets)) == len(offsets)
    assert PROBE_ID == int.from_bytes(b"DDRP", "big") and PROBE_ID != NPU_ID
    assert by_name("ID").offset == 0 and by_name("CTRL").access == "cmd" and by_name("BYTES_P3_HI").access == "ro"
    assert "| 0x018 | CHUNK_BYTES | rw |" in markdown_table()
    with pytest.raises(KeyError, match="no DDR probe CSR named 'NOPE'"):
        by_name("NOPE")


def test_chunks_round_robin():
    # 20,000 bytes in chunks of 8,192 over both ports: port 0 gets chunks 0 and 2, port 1 chunk 1
    assert chunks(TINY, ProbeConfig(0x100, 20_000, 8192)) == [[(0x100, 8192), (0x100 + 16384, 3616)],
                                                               [(0x100 + 8192, 8192)]]
    assert chunks(TINY, ProbeConfig(0x100, 20_000, 8192, ports=1)) == [[(0x100, 8192), (0x2100, 8192),
                                                                        (0x4100, 3616)], []]
    assert chunks(TINY, ProbeConfig(0, 0, 8192)) == [[], []]


def test_bursts_split_at_max_length_and_4k():
    # one 300-byte chunk at 0xF83: beats from 0xF80 (3 + 300 bytes = 38 beats of 8): 16 beats to 0x1000 (the
    # 4 KB boundary), then 16, then 6
    assert bursts(TINY, ProbeConfig(0xF83, 300, 4096)) == [[(0xF80, 16), (0x1000, 16), (0x1080, 6)], []]
    # 16-byte beats, 256-byte bursts; a chunk of 1,000 bytes at 0x8 reads 63 beats
    got = bursts(KV260, ProbeConfig(0x8, 1000, 1000, ports=1))[0]
    assert got == [(0x0, 16), (0x100, 16), (0x200, 16), (0x300, 15)]
    c = counts(KV260, ProbeConfig(0x8, 1000, 1000, ports=1))
    assert (c.bursts, c.bytes_per_port, c.bytes, c.error_beats) == (4, (1008, 0, 0, 0), 1008, 0)
    # beats the memory refuses: those at and above 0x300
    assert counts(KV260, ProbeConfig(0x8, 1000, 1000, ports=1), error_beat=lambda a: a >= 0x300).error_beats == 15


def test_config_checks():
    assert ProbeConfig(0, 1, 1).check(TINY).outstanding(TINY) == TINY.axi_max_outstanding
    assert ProbeConfig(0, 1, 1, max_outstanding=2).outstanding(TINY) == 2
    assert ProbeConfig(0, 1, 1, max_outstanding=99).outstanding(TINY) == TINY.axi_max_outstanding
    with pytest.raises(ValueError, match=r"probe ports must be 1..2 \(0: all\), not 3"):
        ProbeConfig(0, 1, 1, ports=3).check(TINY)
    with pytest.raises(ValueError, match="probe chunk_bytes must be at least 1"):
        ProbeConfig(0, 1, 0).check(TINY)
    top = 1 << TINY.axi_addr_bits
    ProbeConfig(top - 4096, 4096, 4096).check(TINY)
    with pytest.raises(ValueError, match=f"exceeds the {TINY.axi_addr_bits}-bit AXI address space"):
        ProbeConfig(top - 4096, 4097, 4096).check(TINY)
    with pytest.raises(ValueError, match=r"probe chunk_bytes must be an integer in 0..2\*\*32 - 1, not 4294967296"):
        ProbeConfig(0, 1, 1 << 32).check(TINY)


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
    cfg = ProbeConfig(0x8_0000_0000, 57_600_000, 8192)
    m = Measurement(KV260, cfg, cycles=1_000_000, bytes_per_port=(14_400_000,) * 4, bursts=225_000, error_beats=0,
                    lat_sum=225_000 * 60, lat_min=40, lat_max=90)
    assert m.port_efficiency == pytest.approx(0.9) and m.ddr_efficiency == pytest.approx(0.9)
    text = report(m)
    assert "17.280 GB/s: 90.0 % of the ports' peak" in text
    assert "mean 60.0 cycles (200 ns), min 40 (133 ns), max 90 (300 ns)" in text
    assert text.splitlines()[-1] == "python -m firmware.perf --hw kv260 --ddr-efficiency 0.900"


def test_find_uio(tmp_path):
    assert find_uio("npu", tmp_path / "absent") is None
    for n, name in ((0, "axi-pmon"), (3, "npu")):
        (tmp_path / f"uio{n}").mkdir()
        (tmp_path / f"uio{n}" / "name").write_text(name + "\n")
    assert str(find_uio("npu", tmp_path)) == "/dev/uio3"
    assert find_uio("ddrprobe", tmp_path) is None


def test_cli_without_a_board(tmp_path, capsys):
    assert main([], uio_root=tmp_path / "uio") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no UIO device named 'npu'" in err and "Traceback" not in err
    assert main(["--ports", "5"], uio_root=tmp_path) == 2
    assert capsys.readouterr().err == "firmware.ddrprobe: probe ports must be 1..4 (0: all), not 5\n"


def test_uio_device_csr_window(tmp_path):
    path = tmp_path / "uio0"
    path.write_bytes(bytes(mmap.PAGESIZE) + (1).to_bytes(4, "little"))
    dev = UioDevice(path)
    dev.csr_write(0x18, 0x1234_5678)
    assert dev.csr_read(0x18) == 0x1234_5678 and dev.csr_read(0x1C) == 0
    dev.close()
    assert path.read_bytes()[0x18:0x1C] == bytes.fromhex("78563412")


# --- the RTL --------------------------------------------------------------------------------------------

def _bench(hw, seed, latency=20, pause=0.2, runs=6):
    run(DdrProbe(hw), toplevel="ddrprobe", build_name=f"ddrprobe_{hw.name}", test_module="tb.ddrprobe.test_ddrprobe",
        extra_env={"NPU_HW": hw.name, "SEED": str(seed), "LATENCY": str(latency), "PAUSE": str(pause),
                   "RANDOM_RUNS": str(runs)})


def test_probe_bench_tiny():
    _bench(TINY, 0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_probe_bench_tiny_more_seeds(seed):
    _bench(TINY, seed, latency=[5, 40, 80][seed - 1], pause=[0.0, 0.3, 0.5][seed - 1], runs=12)


@pytest.mark.slow
def test_probe_bench_kv260():
    _bench(KV260, 4, latency=60, runs=4)
