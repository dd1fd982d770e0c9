"""Bad input to the firmware's command-line tools and the functions behind them: one line naming the file or the
option and what was expected, exit status 2, no traceback (``python -m firmware.asm``, ``firmware.perf``,
``firmware.traffic``, ``firmware.accuracy``, ``firmware.compiler``); the Python APIs raise ValueError/TypeError
with the same message at the call. The commands run in-process (``main(argv)``); one subprocess per module
checks that ``python -m`` reaches the same ``main``."""

import json
import math
import os
import struct
import subprocess
import sys

import pytest

from firmware import accuracy, asm, compiler, perf, traffic
from hdl.config import HardwareConfig
from sim.config import TINY_HF_CONFIG, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelConfig.preset("tiny")
TINY_HW = HardwareConfig.preset("tiny")


def _bad(main, argv, capsys):
    """Run `main(argv)` expecting bad input: (stderr) after exit status 2 (argparse's SystemExit or a return)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


def _error_line(err):
    """The one line that says what is wrong (argparse prints the usage above it)."""
    lines = [line for line in err.splitlines() if line.startswith("python -m firmware.")]
    assert len(lines) == 1, err
    return lines[0]


# --- python -m firmware.asm ---------------------------------------------------------------------------------

@pytest.fixture
def files(tmp_path):
    def write(name, data):
        path = tmp_path / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(path)
    return write


def test_asm_round_trip(files, capsys):
    assert asm.main(["asm", files("ok.s", "ctrl.setvl imm=4  # comment\n\nctrl.halt imm=0\n")]) == 0
    words = capsys.readouterr().out
    assert asm.main(["dis", files("ok.hex", words)]) == 0
    assert capsys.readouterr().out.splitlines() == ["ctrl.setvl imm=0x4", "ctrl.halt imm=0x0"]


@pytest.mark.parametrize("cmd", ["asm", "dis"])
def test_asm_unreadable_files(cmd, files, tmp_path, capsys):
    missing = str(tmp_path / "missing.s")
    assert _error_line(_bad(asm.main, [cmd, missing], capsys)) == f"python -m firmware.asm: {missing}: no such file"
    assert _error_line(_bad(asm.main, [cmd, str(tmp_path)], capsys)) == \
        f"python -m firmware.asm: {tmp_path}: is a directory, not a file"
    binary = files("binary", b"ctrl.halt imm=0\n\x00\xff\xfe\n")
    assert _error_line(_bad(asm.main, [cmd, binary], capsys)) == \
        f"python -m firmware.asm: {binary}: line 2: not UTF-8 text (byte 0xff at offset 17)"


def test_asm_bad_line_names_file_and_line(files, capsys):
    path = files("bad.s", "ctrl.setvl imm=4\n# a comment\nctrl.halt imm=0 foo=1\n")
    assert _error_line(_bad(asm.main, ["asm", path], capsys)) == \
        f"python -m firmware.asm: {path}: line 3: ctrl has no field 'foo'; its fields are imm"
    path = files("bad2.s", "ctrl.setvl imm=zz\n")
    assert "bad2.s: line 1: field 'imm' of ctrl: 'zz' is not an integer" in _bad(asm.main, ["asm", path], capsys)


@pytest.mark.parametrize("token", ["zz", "-1", "+1", "1" + "0" * 16, "0x"])
def test_dis_bad_token_names_line_and_word(token, files, capsys):
    path = files("bad.hex", f"c400000000000000 c400000000000000\n\n# comment\nc400000000000000 {token}\n")
    assert _error_line(_bad(asm.main, ["dis", path], capsys)) == \
        f"python -m firmware.asm: {path}: line 4: word 3: {token!r} is not a 64-bit hex word"


def test_dis_bad_word_names_line_and_word(files, capsys):
    path = files("bad.hex", "c400000000000000\nf000000000000000\n")
    assert _error_line(_bad(asm.main, ["dis", path], capsys)) == \
        f"python -m firmware.asm: {path}: line 2: word 1: field 'opcode': 0xf is reserved"


def test_asm_api_types_and_word_index():
    with pytest.raises(TypeError, match="not bytes; decode it first"):
        asm.assemble(b"ctrl.halt imm=0")
    with pytest.raises(TypeError, match="a line of assembly must be a str, not int"):
        asm.assemble([7])
    with pytest.raises(asm.DecodeError, match=r"^word 1: field 'opcode': 0xf is reserved"):
        asm.disassemble_program([0xC400000000000000, 0xF000000000000000])


# --- python -m firmware.perf / firmware.traffic -------------------------------------------------------------

PERF_BAD = [
    (["--model", "e5b"], "argument --model: invalid choice: 'e5b' (choose from 'e4b', 'tiny')"),
    (["--hw", "zcu104"], "argument --hw: invalid choice: 'zcu104'"),
    (["--positions", "-1"], "argument --positions: must be an integer >= 0, not '-1'"),
    (["--positions", "1.5"], "argument --positions: must be an integer >= 0, not '1.5'"),
    (["--positions"], "argument --positions: expected at least one argument"),
    (["--prefill", "0"], "argument --prefill: must be a positive integer, not '0'"),
    (["--prefill", "8", "-2"], "argument --prefill: must be a positive integer, not '-2'"),
    (["--ddr-efficiency", "0"], "argument --ddr-efficiency: must be a number in (0, 1], not '0'"),
    (["--ddr-efficiency", "1.5"], "argument --ddr-efficiency: must be a number in (0, 1], not '1.5'"),
    (["--ddr-efficiency", "nan"], "argument --ddr-efficiency: must be a number in (0, 1], not 'nan'"),
    (["--gemv-efficiency", "-0.5"], "argument --gemv-efficiency: must be a number in (0, 1], not '-0.5'"),
    (["--elements-per-cycle", "0"], "argument --elements-per-cycle: must be a finite number > 0, not '0'"),
    (["--elements-per-cycle", "inf"], "argument --elements-per-cycle: must be a finite number > 0, not 'inf'"),
    (["--issue", "-1"], "argument --issue: must be a finite number >= 0, not '-1'"),
    (["--sfu-pass", "inf"], "argument --sfu-pass: must be a finite number >= 0, not 'inf'"),
    (["--gemm-row", "x"], "argument --gemm-row: must be a finite number >= 0, not 'x'"),
    (["--kv-format", "fp8"], "argument --kv-format: invalid choice: 'fp8'"),
]


@pytest.mark.parametrize("argv, message", PERF_BAD)
def test_perf_bad_options(argv, message, capsys):
    assert message in _error_line(_bad(perf.main, ["--model", "tiny", "--hw", "tiny"] + argv, capsys))


def test_perf_every_cost_is_validated(capsys):
    # every Rates field has an option, and every one of them refuses a negative number
    for f in perf.fields(perf.Rates):
        option = "--" + f.name.replace("_", "-")
        assert f"argument {option}: must be " in _bad(perf.main, [option, "-3"], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--model", "e5b"], "argument --model: invalid choice: 'e5b'"),
    (["--hw", "zcu104"], "argument --hw: invalid choice: 'zcu104'"),
    (["--positions", "-1"], "argument --positions: must be an integer >= 0, not '-1'"),
    (["--positions", "x"], "argument --positions: must be an integer >= 0, not 'x'"),
])
def test_traffic_bad_options(argv, message, capsys):
    assert message in _error_line(_bad(traffic.main, argv, capsys))


@pytest.mark.parametrize("main, argv, option", [
    (perf.main, ["--positions", "100000", "--prefill"], "--positions"),
    (perf.main, ["--positions", "3", "--prefill", "100000"], "--prefill"),
    (traffic.main, ["--positions", "100000"], "--positions"),
])
def test_positions_beyond_the_hardware(main, argv, option, capsys):
    # the tiny NPU's L2 scratch holds the scores of 4096 positions: the ISS's error, named after the option
    line = _error_line(_bad(main, ["--model", "tiny", "--hw", "tiny"] + argv, capsys))
    assert line.startswith(f"python -m {main.__module__}: error: argument {option}: tiny on tiny cannot run "), line
    assert "elements of L2 scratch; there are 4096 (HardwareConfig.l2_scratch_bytes)" in line


def test_perf_api_validates_at_the_call():
    with pytest.raises(ValueError, match=r"^positions must be integers >= 0, not -1$"):
        perf.estimate(TINY, TINY_HW, [3, -1])
    with pytest.raises(ValueError, match=r"^positions must name at least one value, not \[\]$"):
        perf.estimate(TINY, TINY_HW, [])
    with pytest.raises(TypeError, match=r"^positions must be integers, not 1.5$"):
        perf.estimate(TINY, TINY_HW, [1.5])
    with pytest.raises(TypeError, match=r"^positions must be a list of integers, not 3$"):
        perf.estimate(TINY, TINY_HW, 3)
    with pytest.raises(ValueError, match=r"^tokens must be positive integers, not 0$"):
        perf.prefill(TINY, TINY_HW, [0])
    with pytest.raises(ValueError, match=r"^Rates\.issue must be a finite number >= 0, not -1$"):
        perf.estimate(TINY, TINY_HW, [3], perf.Rates(issue=-1))
    with pytest.raises(ValueError, match=r"^Rates\.gemm_row must be a finite number >= 0, not -0.5$"):
        perf.prefill(TINY, TINY_HW, [3], perf.Rates(gemm_row=-0.5))
    for bad in (0, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"^Rates\.ddr_efficiency must be a number in \(0, 1\], not "):
            perf.Rates(ddr_efficiency=bad)
    with pytest.raises(ValueError, match=r"^Rates\.elements_per_cycle must be a finite number > 0, not 0$"):
        perf.Rates(elements_per_cycle=0)
    with pytest.raises(ValueError, match=r"^Rates\.sfu_pass must be a finite number, not nan$"):
        perf.Rates(sfu_pass=math.nan)
    with pytest.raises(ValueError, match=r"^Rates\.issue must be a finite number, not '3'$"):
        perf.Rates(issue="3")
    with pytest.raises(ValueError, match=r"^positions must be integers >= 0, not -1$"):
        traffic.token_traffic(TINY, TINY_HW, [-1])


# --- python -m firmware.accuracy ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--model", "e5b"], "argument --model: invalid choice: 'e5b'"),
    (["--hw", "zcu104"], "argument --hw: invalid choice: 'zcu104'"),
    (["--seeds", "-1"], "argument --seeds: must be an integer >= 0, not '-1'"),
    (["--steps", "0"], "argument --steps: must be a positive integer, not '0'"),
    (["--steps", "513"], "argument --steps: must be at most the tiny model's 512 positions "
                         "(max_position_embeddings), not 513"),
    (["--group", "3"], "argument --group: must be 0 or a power of two, not '3'"),
    (["--group", "-4"], "argument --group: must be 0 or a power of two, not '-4'"),
    (["--block", "0"], "argument --block: must be a power of two, not '0'"),
    (["--model", "tiny", "--block", "1048576"], "argument --block: 1048576 does not fit hardware tiny: gemv_max_cols "
                                                "must be"),
    (["--kv-format", "fp8"], "argument --kv-format: invalid choice: 'fp8'"),
])
def test_accuracy_bad_options(argv, message, capsys):
    assert message in _error_line(_bad(accuracy.main, argv, capsys))


def test_accuracy_api_validates_steps():
    for steps in (0, 513, 2.0):
        with pytest.raises(ValueError, match=r"^steps must be an integer from 1 to the model's 512 positions"):
            accuracy.measure(TINY, None, TINY_HW, steps)


# --- python -m firmware.compiler ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_program():
    from firmware.pack import pack
    return compiler.compile_token(TINY, pack(TINY, None, TINY_HW, fill=False), TINY_HW)


def test_compiler_prints_the_listing(tiny_program, tmp_path, capsys):
    assert compiler.main(["--model", "tiny", "--hw", "tiny"]) == 0
    assert capsys.readouterr().out == tiny_program.listing() + "\n"
    # a checkpoint directory: only its config.json is read
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    assert compiler.main(["--checkpoint", str(tmp_path), "--hw", "tiny", "--max-positions", "64",
                          "--memory-map", "kv260"]) == 0
    assert capsys.readouterr().out == tiny_program.listing() + "\n"


def test_compiler_writes_words_and_listing(tiny_program, tmp_path, capsys):
    out = tmp_path / "token.bin"
    assert compiler.main(["--model", "tiny", "--hw", "tiny", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert list(struct.unpack(f"<{len(data) // 8}Q", data)) == tiny_program.words
    assert (tmp_path / "token.bin.lst").read_text() == tiny_program.listing() + "\n"
    assert f"wrote {out} ({len(tiny_program.words)} words" in capsys.readouterr().err


def test_compiler_prints_a_prefill_program(capsys):
    from firmware.pack import pack
    want = compiler.compile_tokens(TINY, pack(TINY, None, TINY_HW, fill=False), TINY_HW, tokens=3)
    assert compiler.main(["--model", "tiny", "--hw", "tiny", "--tokens", "3"]) == 0
    text = capsys.readouterr().out
    assert text == want.listing() + "\n"
    assert "ctrl.settok imm=0x2" in text and "ctrl.setpos imm=0x2" in text


def test_compiler_prints_the_l2_map(capsys):
    from firmware.pack import pack
    hw = TINY_HW.replace(gemv_vectors=4)
    want = compiler.compile_tokens(TINY, pack(TINY, None, hw, fill=False, logit_rows=3), hw, tokens=3, logits="all")
    assert compiler.main(["--model", "tiny", "--hw", "tiny", "--gemv-vectors", "4", "--tokens", "3", "--logits",
                          "all", "--l2-map"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert set(rows) == set(want.l2_map)
    for name, (address, elements) in want.l2_map.items():
        copies = 3 if name in want.l2_strides else 1
        assert rows[name][:3] == [str(address), str(-(-elements // 4) * copies), str(elements)], name
    # buffers laid over the gate's words (`_OVERLAYS`)
    gate = want.l2_map["gate"]
    assert [k for k, (a, _) in want.l2_map.items() if k != "gate" and gate[0] <= a < gate[0] + 3 * -(-gate[1] // 4)]
    used = max(a + -(-n // 4) * (3 if k in want.l2_strides else 1) for k, (a, n) in want.l2_map.items())
    assert lines[-1] == f"{used:,} of {hw.l2_program_words:,} words used (3 token(s) a program)"


def test_compiler_bad_input(tmp_path, capsys):
    empty, bad_json, not_gemma = (tmp_path / n for n in ("empty", "bad_json", "not_gemma"))
    for d in (empty, bad_json, not_gemma):
        d.mkdir()
    (bad_json / "config.json").write_text("{bad")
    (not_gemma / "config.json").write_text('{"a": 1}')
    cases = [
        ([], "one of the arguments --checkpoint --model is required"),
        (["--model", "tiny", "--checkpoint", str(empty)], "argument --checkpoint: not allowed with argument --model"),
        (["--model", "e5b"], "argument --model: invalid choice: 'e5b' (choose from 'e4b', 'tiny')"),
        (["--model", "tiny", "--hw", "zcu104"], "argument --hw: invalid choice: 'zcu104'"),
        (["--model", "tiny", "--memory-map", "zcu104"], "argument --memory-map: invalid choice: 'zcu104'"),
        (["--model", "tiny", "--max-positions", "0"], "argument --max-positions: must be a positive integer, not '0'"),
        (["--model", "tiny", "--max-positions", "x"], "argument --max-positions: must be a positive integer, not 'x'"),
        (["--checkpoint", str(tmp_path / "none")], f"argument --checkpoint: {str(tmp_path / 'none')!r} is not a "
                                                   f"directory"),
        (["--checkpoint", str(empty)], f"argument --checkpoint: {str(empty)!r} has no config.json"),
        (["--checkpoint", str(bad_json)], f"argument --checkpoint: {str(bad_json / 'config.json')!r} is not a "
                                          f"Gemma 3n config: Expecting property name"),
        (["--checkpoint", str(not_gemma)], "is not a Gemma 3n config: missing required fields 'vocab_size'"),
        # E4B's whole context of 32,768 positions fits the kv260 map with kv260's K scales (a block of 128), not
        # with kv260_gemm's (blocks of 64: twice the K scales)
        (["--model", "e4b", "--hw", "kv260_gemm", "--memory-map", "kv260"],
         "cannot compile for --hw kv260_gemm, --memory-map kv260: memory map 'kv260': a "),
        (["--model", "tiny", "--out", str(tmp_path)], f"argument --out: cannot write {str(tmp_path)!r}: "
                                                      f"Is a directory"),
        (["--model", "tiny", "--out", str(tmp_path / "no" / "x.bin")], "argument --out: cannot write "),
        (["--model", "tiny", "--tokens", "0"], "argument --tokens: must be a positive integer, not '0'"),
        (["--model", "tiny", "--tokens", "300"], "cannot compile for --hw kv260, --memory-map flat, --tokens 300: "
                                                 "tokens must be an integer from 1 to 255"),
        (["--model", "e4b", "--tokens", "8"], "--tokens 8: L2 is too small: buffer "),
        (["--model", "e4b", "--gemv-vectors", "4", "--tokens", "5"], "--tokens 5: L2 is too small: buffer "),
        (["--model", "tiny", "--gemv-vectors", "0"], "argument --gemv-vectors: must be an integer from 1 to 4, "
                                                     "not '0'"),
        (["--model", "tiny", "--logits", "first"], "argument --logits: invalid choice: 'first'"),
    ]
    for argv, message in cases:
        assert message in _error_line(_bad(compiler.main, argv, capsys)), argv


# --- python -m: the modules' entry points -------------------------------------------------------------------

@pytest.mark.parametrize("module, argv, message", [
    ("asm", ["asm", "/nonexistent/prog.s"], "python -m firmware.asm: /nonexistent/prog.s: no such file"),
    ("perf", ["--ddr-efficiency", "0"], "argument --ddr-efficiency: must be a number in (0, 1], not '0'"),
    ("traffic", ["--positions", "-1"], "argument --positions: must be an integer >= 0, not '-1'"),
    ("accuracy", ["--steps", "0"], "argument --steps: must be a positive integer, not '0'"),
    ("compiler", ["--model", "e5b"], "argument --model: invalid choice: 'e5b'"),
])
def test_python_m(module, argv, message):
    r = subprocess.run([sys.executable, "-m", f"firmware.{module}", *argv], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_compiler_help():
    r = subprocess.run([sys.executable, "-m", "firmware.compiler", "--help"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0 and "--max-positions N" in r.stdout and "--out FILE" in r.stdout, r.stderr
