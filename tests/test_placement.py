"""The image in a board's memory map: PLE staging, window placement and relocation by the host, the packed
image on disk, and ``python -m firmware.pack``."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from firmware.compiler import compile_token
from firmware.pack import load_image, pack, save_image
from firmware.runtime import CsrBackend, IssBackend, Placed, Runtime
from hdl import csr_map
from hdl.config import HardwareConfig
from hdl.isa import DESC_BYTES, DescKind
from hdl.memory_map import MEMORY_MAPS, Window
from sim.config import ModelConfig
from tb.npu.host import load_npz
from tb.runner import ROOT

HW = HardwareConfig.preset("tiny")
CASE = load_npz(ROOT / "tests" / "fixtures" / "f64_s2_l7.npz")        # its 4th id (313) is beyond the PLE vocab
KV260 = MEMORY_MAPS["kv260"]
# The K26 map with a high window too small for the tiny model's weights: WEIGHTS splits over both banks.
SPLIT = dataclasses.replace(KV260, windows=(Window("npu_hi", KV260.windows[0].base, 128 << 10), KV260.windows[1]))


def _logits(memory_map, arithmetic="hardware", tokens=4, stage=True):
    rt = Runtime.from_hf(CASE.config, CASE.tensors, backend="iss", arithmetic=arithmetic, hw=HW,
                         memory_map=memory_map)
    if not stage:
        rt.image.host_tables.clear()
    return rt, [rt.step(int(t)).view(np.uint32).copy() for t in CASE.input_ids[:tokens]]


@pytest.mark.parametrize("arithmetic", ["hardware", "reference"])
def test_every_map_gives_the_flat_images_logits(arithmetic):
    """The same model packed flat, for the K26 (weights in the high bank, the rest in the low one) and split
    (WEIGHTS over both banks, offsets from a base below 4 GB to pieces above it), with the PLE row staged by the
    host each step: bit-identical logits on the ISS."""
    _, flat = _logits("flat", arithmetic)
    for mm in ("kv260", SPLIT):
        rt, out = _logits(mm, arithmetic)
        assert rt.image.host_tables and len(rt.image.windows) == 2
        for step, (a, b) in enumerate(zip(out, flat)):
            np.testing.assert_array_equal(a, b, err_msg=f"{getattr(mm, 'name', mm)} step {step}")
    assert len({KV260.window_of(a).name for a, _ in _logits(SPLIT, tokens=0)[0].image.pieces["WEIGHTS"]}) == 2


def test_without_staging_the_logits_differ():
    """The staged row is what GATHER reads: with no staging the hardware-arithmetic logits change."""
    _, flat = _logits("flat", tokens=2)
    _, unstaged = _logits("kv260", tokens=2, stage=False)
    assert not np.array_equal(flat[1], unstaged[1])


def test_staged_rows_are_the_flat_images_rows():
    flat = pack(CASE.config, CASE.tensors, HW)
    staged = pack(CASE.config, CASE.tensors, HW, memory_map="kv260")
    name = "embed_tokens_per_layer.weight"
    e, t = flat.tensors[name], staged.host_tables[name]
    rows = e.shape[0]
    assert t.data.shape[0] == rows and t.row_bytes == e.nbytes // rows and t.scale_bytes == e.scale_nbytes // rows
    np.testing.assert_array_equal(t.data[:, :t.row_bytes], flat.view("WEIGHTS", e.offset, e.nbytes).reshape(rows, -1))
    np.testing.assert_array_equal(t.data[:, t.row_bytes:],
                                  flat.view("WEIGHTS", e.scale_offset, e.scale_nbytes).reshape(rows, -1))
    writes = staged.stage_rows(10_000)                       # beyond the table: row 0 (the PLE remap rule)
    np.testing.assert_array_equal(writes[0][2], t.data[0, :t.row_bytes])


class _Memory:
    """A device whose DDR is a dict of windows (bytearrays) and whose CSRs are a register file: enough to see
    what `CsrBackend.load` writes where."""

    def __init__(self, windows, version):
        self.windows = windows
        self.buf = {w.name: bytearray(w.size) for w in windows}
        self.regs = {csr_map.by_name("ID").offset: csr_map.NPU_ID, csr_map.by_name("VERSION").offset: version}

    def _at(self, addr, n):
        w = next(w for w in self.windows if w.holds(addr, n))
        return self.buf[w.name], addr - w.base

    def mem_write(self, addr, data):
        data = bytes(memoryview(data).cast("B"))
        b, off = self._at(addr, len(data))
        b[off:off + len(data)] = data

    def mem_read(self, addr, n):
        b, off = self._at(addr, n)
        return bytes(b[off:off + n])

    def csr_write(self, offset, value):
        self.regs[offset] = value

    def csr_read(self, offset):
        return self.regs.get(offset, 0)


def test_relocated_windows_rebase_regions_and_descriptors():
    """u-dma-buf buffers elsewhere than the map says: every region base CSR and every WEIGHTS offset in the
    descriptor table the host writes points at the same bytes in the moved windows."""
    image = pack(CASE.config, CASE.tensors, HW, memory_map=SPLIT)
    program = compile_token(ModelConfig.from_hf(image.config), image, HW)
    moved = (Window("npu_hi", 0x8_4000_0000, 1 << 20), Window("npu_lo", 0x7000_0000, 4 << 20))
    dev = _Memory(moved, csr_map.version_word(HW.to_dict()))
    CsrBackend(dev).load(image, program)
    csr = lambda name: dev.regs[csr_map.by_name(name + "_LO").offset] | dev.regs[csr_map.by_name(name + "_HI").offset] << 32
    desc = np.frombuffer(dev.mem_read(csr("DESC_BASE"), len(image.descriptors) * DESC_BYTES), "<u8").reshape(-1, 4)
    wbase = csr("WEIGHTS_BASE")
    assert wbase == 0x7000_0000 + image.region("WEIGHTS")[0] - KV260.windows[1].base
    for d in image.descriptors:
        if d.kind != DescKind.INT4:
            continue
        n = d.rows * (d.cols + d.cols % 2) // 2
        e = image.tensors[d.tensor]
        want = image.view("WEIGHTS", e.offset + d.row_start * (d.cols + d.cols % 2) // 2, n).tobytes()
        assert dev.mem_read(wbase + int(desc[d.index, 0]), n) == want, d.tensor
    logits = image.region("LOGITS")[0] - KV260.windows[1].base + 0x7000_0000
    assert csr("LOGITS_BASE") == logits


def test_placement_errors():
    image = pack(CASE.config, None, HW, fill=False, memory_map="kv260")
    with pytest.raises(ValueError, match=r"memory map 'kv260', whose window 'npu_lo' the device does not have"):
        Placed(image, (Window("npu_hi", 0x8_0000_0000, 1 << 30),))
    with pytest.raises(ValueError, match=r"the image needs [\d,]+ bytes in window 'npu_lo'; the device's 'npu_lo' "
                                         r"has 4,096 \(reserve more memory: docs/kv260.md\)"):
        Placed(image, (Window("npu_hi", 0x8_0000_0000, 1 << 30), Window("npu_lo", 0x6000_0000, 4096)))


def test_saved_image_runs_like_the_packed_one(tmp_path):
    rt, want = _logits(SPLIT, tokens=3)
    save_image(rt.image, tmp_path)
    loaded = load_image(tmp_path)
    assert loaded.manifest() == rt.image.manifest()
    again = Runtime(rt.config, loaded, rt.program, type(rt.backend)(HW, "hardware"))
    for t, w in zip(CASE.input_ids[:3], want):
        np.testing.assert_array_equal(again.step(int(t)).view(np.uint32), w)
    with pytest.raises(ValueError, match="no packed image here"):
        load_image(tmp_path / "nothing")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "firmware.pack", *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_pack_command_line(tmp_path):
    r = _cli("--model", "e4b", "--plan", "--max-positions", "4096")
    assert r.returncode == 0, r.stderr
    assert "memory map kv260" in r.stdout and "NPU-side total: 2,236.8 MiB (2.345 GB) in 2 window(s)" in r.stdout
    r = _cli("--model", "tiny", "--hw", "tiny", "--out", str(tmp_path / "img"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "image.embed_tokens_per_layer.weight.npy", "image.npy", "manifest.json"]
    for args, msg in ((("--model", "e4b", "--plan", "--max-positions", "1000000"), "region KV"),
                      (("--model", "tiny"), "--out DIR is needed"),
                      (("--checkpoint", str(tmp_path / "none"), "--plan"), "is not a directory"),
                      (("--model", "e4b", "--plan", "--memory-map", "zcu104"), "invalid choice: 'zcu104'")):
        r = _cli(*args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_generate_on_a_packed_image_and_without_a_board(tmp_path):
    """``--image`` runs a packed image on the ISS (hardware arithmetic) with the ids of a Runtime over the same
    image; ``--backend kv260`` where there is no board is one line naming what is missing, exit status 2."""
    assert _cli("--model", "tiny", "--hw", "tiny", "--out", str(tmp_path)).returncode == 0
    def run(*args):
        return subprocess.run([sys.executable, "-m", "firmware.generate", *args], capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, "NPU_BOARD_ROOT": str(tmp_path)})
    # greedy without the default repetition penalty: the arg-max of each step, as the loop below takes it
    r = run("--backend", "iss", "--arithmetic", "hardware", "--image", str(tmp_path), "--prompt-ids", "2,5,7",
            "--max-new-tokens", "3", "--temperature", "0", "--repetition-penalty", "1")
    assert r.returncode == 0, r.stderr
    image = load_image(tmp_path)
    cfg = ModelConfig.from_hf(image.config)
    rt = Runtime(cfg, image, compile_token(cfg, image, HW), IssBackend(HW, "hardware"))
    for t in (2, 5, 7):
        logits = rt.step(t)
    new = []
    for _ in range(3):
        new.append(int(np.argmax(logits)))
        logits = rt.step(new[-1])
    assert r.stdout.split("\n")[0].split() == [str(i) for i in new]
    # the image keeps the quantizer it was packed with; asking for another is one line naming both
    r = run("--backend", "iss", "--arithmetic", "hardware", "--image", str(tmp_path), "--quantizer", "rtn")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"python -m firmware.generate: {tmp_path} holds an image packed with the 'search' quantizer, not 'rtn': pack "
        "the checkpoint into another directory (python -m firmware.pack --quantizer rtn --out DIR)"]
    r = run("--backend", "kv260", "--image", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"python -m firmware.generate: no UIO device named 'npu' in {tmp_path}/sys/class/uio (there is none): load "
        "the app: sudo xmutil loadapp gemma3n-npu"]
