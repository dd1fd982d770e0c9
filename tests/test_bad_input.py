"""Bad input gets one clear line: checkpoints, configs, tensors and API arguments.

Every class of bad input is made on purpose from a good tiny checkpoint (`sim.checkpoint.write_checkpoint` of
`sim.random_weights.random_tensors`) and must be rejected at the call with one message that names the file,
tensor or field: by `Checkpoint`, `ModelConfig.from_hf`, the golden model, the packer and the ISS (the last
three with the same words for the same tensor, from one validation function), and by ``python -m
firmware.generate`` / ``python -m firmware.pack`` with that line on stderr and exit status 2, no traceback.
"""

import json
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from firmware.compiler import compile_token
from firmware.generate import generate
from firmware.generate import main as generate_main
from firmware.pack import main as pack_main
from firmware.pack import pack
from firmware.runtime import IssBackend, Runtime
from firmware.sampling import Sampler, SamplingParams
from hdl.config import PRESETS as HW
from sim.checkpoint import INDEX_NAME, TEXT_PREFIX, Checkpoint, write_checkpoint
from sim.config import PRESETS
from sim.gemma3n import Model, resolve_tensor_names
from sim.iss import Machine
from sim.random_weights import random_tensors

ROOT = Path(__file__).resolve().parents[1]
CFG = PRESETS["tiny"]
GREEDY = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.0))
SHARD = "model-00001-of-00001.safetensors"
FLOATS = "(float16, bfloat16, float32, float64)"


@pytest.fixture(scope="module")
def tensors():
    # bf16 values held as float32: the checkpoint stores them exactly, so in-memory and on-disk runs agree bit
    # for bit in both arithmetics.
    return {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in random_tensors(CFG, seed=5).items()}


@pytest.fixture(scope="module")
def good(tmp_path_factory, tensors):
    path = tmp_path_factory.mktemp("good")
    assert write_checkpoint(path, CFG.to_hf(), tensors) == [SHARD]
    return path


def make(tmp_path, tensors, *, config=None, **kwargs) -> Path:
    path = tmp_path / "ckpt"
    write_checkpoint(path, CFG.to_hf() if config is None else config, tensors, **kwargs)
    return path


def replace_tensor(path: Path, name: str, value: np.ndarray) -> Path:
    """Store `value` (in its own dtype) as canonical tensor `name` of the checkpoint at `path`; the shard's path."""
    full = TEXT_PREFIX + name
    shard = path / json.loads((path / INDEX_NAME).read_text())["weight_map"][full]
    with safe_open(str(shard), framework="numpy") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    stored[full] = value
    save_file(stored, str(shard), metadata={"format": "pt"})
    return shard


def nan_at(t, where):
    t = t.copy()
    t[where] = np.nan
    return t


# --- item 1: the ISS reads a checkpoint ------------------------------------------------------------------------

def test_lazy_tensor_indexes_rows_like_an_array(good, tensors):
    t = Checkpoint(good)[TEXT_PREFIX + "embed_tokens.weight"]
    want = tensors["embed_tokens.weight"].astype(ml_dtypes.bfloat16)
    assert len(t) == CFG.vocab_size and t.dtype == np.dtype(ml_dtypes.bfloat16)
    for key in (3, -1, np.int64(7), slice(2, 5), slice(300, 400), slice(5, 2), slice(None, None, -7), (4, 9),
                (slice(1, 3), 2), (Ellipsis, 1)):
        got = t[key]
        assert got.shape == want[key].shape and np.array_equal(got, want[key]), key
    assert np.array_equal(np.asarray(t, dtype=np.float64), want.astype(np.float64))
    with pytest.raises(IndexError, match=rf"row 320 is out of range for tensor '{TEXT_PREFIX}embed_tokens.weight' "
                                         r"with 320 rows"):
        t[320]
    with pytest.raises(TypeError, match=r"is indexed by row \(an integer or a slice\), not 2.0"):
        t[2.0]


@pytest.mark.parametrize("arithmetic", ["reference", "hardware"])
def test_generate_on_the_iss_from_a_checkpoint(good, tensors, arithmetic):
    # End to end through the command line: the ids of a Runtime over the same (bf16-exact) tensors in memory.
    r = subprocess.run([sys.executable, "-m", "firmware.generate", "--backend", "iss", "--arithmetic", arithmetic,
                        "--checkpoint", str(good), "--prompt-ids", "2,17,5", "--max-new-tokens", "5",
                        "--temperature", "0", "--repetition-penalty", "1", "--ignore-eos"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    ids = [int(x) for x in r.stdout.splitlines()[0].split()]
    rt = Runtime.from_hf(CFG, tensors, backend="iss", arithmetic=arithmetic)
    assert ids == generate(rt, [2, 17, 5], 5, GREEDY, stop_at_eos=False)
    if arithmetic == "reference":       # and reference arithmetic is the golden model
        assert ids == generate(Model.from_hf(CFG, tensors), [2, 17, 5], 5, GREEDY, stop_at_eos=False)


# --- item 2: bad checkpoint directories -------------------------------------------------------------------------

def _truncate(path):
    shard = path / SHARD
    shard.write_bytes(shard.read_bytes()[:100_000])


def _garbage(path):
    (path / SHARD).write_bytes(b"this is not a safetensors file " * 10)


def _config(path, config):
    (path / "config.json").write_text(json.dumps(config))


def _without(key):
    return {k: v for k, v in CFG.to_hf().items() if k != key}


def _index(path, change):
    index = json.loads((path / INDEX_NAME).read_text())
    change(index["weight_map"])
    (path / INDEX_NAME).write_text(json.dumps(index))


# (id, how to break a good checkpoint, exception type, message given the checkpoint's path). Every one is a
# problem of the directory's files: `Checkpoint` itself rejects it.
FILE_CASES = [
    ("truncated-shard", _truncate, ValueError,
     lambda p: f"{p / SHARD}: not a readable safetensors file (Error while deserializing header: "),
    ("garbage-shard", _garbage, ValueError, lambda p: f"{p / SHARD}: not a readable safetensors file ("),
    ("config-not-json", lambda p: (p / "config.json").write_text("{hidden_size: 64"), ValueError,
     lambda p: f"{p / 'config.json'}: not a JSON file (Expecting property name"),
    ("config-is-a-list", lambda p: _config(p, [CFG.to_hf()]), ValueError,
     lambda p: f"{p / 'config.json'}: expected a JSON object (the model config), not an array"),
    ("string-for-integer", lambda p: _config(p, {**CFG.to_hf(), "hidden_size": "64"}), TypeError,
     lambda p: f"{p / 'config.json'}: hidden_size must be an integer, not '64'"),
    ("nested-string-for-integer",
     lambda p: _config(p, {"model_type": "gemma3n", "text_config": {**CFG.to_hf(), "num_hidden_layers": "10"}}),
     TypeError, lambda p: f"{p / 'config.json'}: text_config: num_hidden_layers must be an integer, not '10'"),
    ("string-for-number", lambda p: _config(p, {**CFG.to_hf(), "rms_norm_eps": "1e-6"}), TypeError,
     lambda p: f"{p / 'config.json'}: rms_norm_eps must be a number, not '1e-6'"),
    ("missing-hidden-size", lambda p: _config(p, _without("hidden_size")), ValueError,
     lambda p: f"{p / 'config.json'}: missing required field 'hidden_size' (a Gemma 3n text config gives every "
               f"tensor dimension)"),
    ("weight-map-integer", lambda p: _index(p, lambda m: m.update({TEXT_PREFIX + "norm.weight": 5})), ValueError,
     lambda p: f"{p / INDEX_NAME}: weight_map['{TEXT_PREFIX}norm.weight'] must be the file name of a shard in the "
               f"directory, not 5"),
    ("weight-map-missing-shard",
     lambda p: _index(p, lambda m: m.update({TEXT_PREFIX + "norm.weight": "model-00002-of-00002.safetensors"})),
     FileNotFoundError, lambda p: f"shard 'model-00002-of-00002.safetensors' named in {INDEX_NAME} is missing from "
                                  f"{str(p)!r}"),
]


@pytest.fixture
def broken(request, tmp_path, tensors):
    _, damage, exc, message = request.param
    path = make(tmp_path, tensors)
    damage(path)
    return path, exc, message(path)


@pytest.mark.parametrize("broken", FILE_CASES, ids=[c[0] for c in FILE_CASES], indirect=True)
def test_bad_checkpoint_files(broken, tmp_path, capsys):
    path, exc, message = broken
    for load in (Checkpoint, Model.from_pretrained):
        with pytest.raises(exc) as e:
            load(path)
        assert str(e.value).startswith(message), (load, str(e.value))
    full = str(e.value)
    # The command lines: that line on stderr, exit status 2.
    with pytest.raises(SystemExit) as e:
        generate_main(["--checkpoint", str(path)])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"python -m firmware.generate: cannot load --checkpoint {str(path)!r}: {full}\n"
    for args in (["--plan"], ["--out", str(tmp_path / "image")]):
        assert pack_main(["--checkpoint", str(path), "--hw", "tiny", *args]) == 2
        assert capsys.readouterr().err == f"python -m firmware.pack: {full}\n", args


@pytest.fixture(scope="module")
def iss_image(tensors):
    # A good image: the ISS's reference arithmetic reads its weights from the source tensors instead.
    image = pack(CFG, tensors, HW["kv260"])
    return image, compile_token(CFG, image, HW["kv260"])


def run_iss(image_program, cfg, source):
    image, program = image_program
    m = Machine(image, HW["kv260"], "reference", source={k: source[f] for k, f in
                                                           resolve_tensor_names(cfg, source).items()})
    m.run(program.words, token=2, pos=0)


# (id, canonical name, bad value as stored, exception type, message tail)
TENSOR_CASES = [
    ("int8-norm", "norm.weight", lambda t: np.ones(t.shape, np.int8), TypeError,
     f"has dtype int8; expected a floating-point tensor {FLOATS}"),
    ("int32-matrix", "layers.1.laurel.linear_left.weight", lambda t: np.ones(t.shape, np.int32), TypeError,
     f"has dtype int32; expected a floating-point tensor {FLOATS}"),
    ("nan-matrix", "layers.1.laurel.linear_left.weight",
     lambda t: nan_at(t, (3, 5)).astype(ml_dtypes.bfloat16), ValueError,
     "holds a non-finite value (NaN or infinity); weights must be finite"),
    ("nan-embedding-row", "embed_tokens.weight",
     lambda t: nan_at(t, 2).astype(ml_dtypes.bfloat16), ValueError,      # token 2's row: the ISS reads it
     "holds a non-finite value (NaN or infinity); weights must be finite"),
    ("inf-norm", "layers.2.post_attention_layernorm.weight",
     lambda t: np.full(t.shape, np.inf, np.float32), ValueError,
     "holds a non-finite value (NaN or infinity); weights must be finite"),
]


@pytest.mark.parametrize("name, bad, exc, tail", [c[1:] for c in TENSOR_CASES], ids=[c[0] for c in TENSOR_CASES])
def test_bad_tensors_one_message_everywhere(tmp_path, tensors, iss_image, capsys, name, bad, exc, tail):
    path = make(tmp_path, tensors)
    shard = replace_tensor(path, name, bad(tensors[name]))
    ckpt = Checkpoint(path)                              # the files are fine: the tensor is not
    # The ISS checks every source tensor's dtype, and the values of the rows it reads: matrices and table rows
    # (1-D tensors come from the image's CONST region).
    iss_reads = exc is TypeError or len(tensors[name].shape) == 2
    in_memory = {**tensors, name: np.asarray(bad(tensors[name]))}
    for source, cfg, message in ((ckpt, ckpt.model_config, f"tensor '{TEXT_PREFIX}{name}' in {shard} {tail}"),
                                 (in_memory, CFG, f"tensor '{name}' {tail}")):      # no file: the canonical name
        users = {"golden": partial(Model.from_hf, cfg, source), "packer": partial(pack, cfg, source, HW["tiny"])}
        if source is ckpt:
            users["golden, lazy"] = partial(Model.from_pretrained, path, lazy=True)
        if iss_reads:
            users["iss"] = partial(run_iss, iss_image, cfg, source)
        for who, use in users.items():
            with pytest.raises(exc) as e:
                use()
            assert str(e.value) == message, who
    message = f"tensor '{TEXT_PREFIX}{name}' in {shard} {tail}"
    # The command lines. A dtype is file metadata, seen before any weight is read; a NaN is found while its
    # tensor is read, so the loading or packing progress lines on stderr may come first.
    with pytest.raises(SystemExit) as e:
        generate_main(["--checkpoint", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    line = f"python -m firmware.generate: cannot load --checkpoint {str(path)!r}: {message}\n"
    assert (err == line) if exc is TypeError else (err.endswith("\n" + line) and "Traceback" not in err)
    out = tmp_path / "image"
    assert pack_main(["--checkpoint", str(path), "--hw", "tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    line = f"python -m firmware.pack: {message}\n"
    assert (err == line) if exc is TypeError else (err.endswith("\n" + line) and "Traceback" not in err)
    assert not (out / "image.npy").exists()               # no half-written image stays behind
    if exc is TypeError:                                  # --plan reads no weights, but it checks dtypes
        assert pack_main(["--checkpoint", str(path), "--hw", "tiny", "--plan"]) == 2
        assert capsys.readouterr().err == line


def test_command_lines_answer_a_bad_checkpoint_in_one_line(tmp_path, tensors):
    # The real entry points, in their own processes: one line on stderr, exit status 2, no traceback.
    path = make(tmp_path, tensors, config={**CFG.to_hf(), "hidden_size": "64"})
    line = f"{path / 'config.json'}: hidden_size must be an integer, not '64'\n"
    for module, args, prefix in (
            ("firmware.generate", ["--backend", "iss"], f"python -m firmware.generate: cannot load --checkpoint "
                                                        f"{str(path)!r}: "),
            ("firmware.pack", ["--out", str(tmp_path / "image")], "python -m firmware.pack: ")):
        r = subprocess.run([sys.executable, "-m", module, "--checkpoint", str(path), *args], capture_output=True,
                           text=True, cwd=ROOT)
        assert (r.returncode, r.stderr) == (2, prefix + line), module


# --- item 3: API arguments, checked at the call -----------------------------------------------------------------

@pytest.mark.parametrize("value, exc", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                        ("16", TypeError)])
def test_max_positions_must_be_a_positive_integer(tensors, value, exc):
    message = f"max_positions must be a positive integer, not {value!r}"
    for call in (lambda: Runtime.from_hf(CFG, tensors, max_positions=value),
                 lambda: pack(CFG, tensors, HW["tiny"], max_positions=value)):
        with pytest.raises(exc) as e:
            call()
        assert str(e.value) == message


def test_runtime_arguments(tensors):
    image = pack(CFG, tensors, HW["tiny"], max_positions=np.int64(8))           # NumPy integers are integers
    # sliding rings: the window and a program's three further tokens (firmware.pack.ring_rows); full layers: 8
    assert {d.capacity for d in image.descriptors if d.kind == 2} == {CFG.sliding_window + 3, 8}
    with pytest.raises(TypeError, match=r"^tensors must be a mapping of tensor names to arrays, not NoneType$"):
        Runtime.from_hf(CFG, None)
    with pytest.raises(TypeError, match=r"^hw must be a hardware preset name or a HardwareConfig, not 3$"):
        Runtime.from_hf(CFG, tensors, hw=3)
    with pytest.raises(TypeError, match=r"^image must be a packed firmware.pack.Image \(firmware.pack.load_image\), "
                                        r"not str$"):
        Runtime.on_device("image", object())
    with pytest.raises(TypeError, match=r"^device must be an NpuDevice; object has no csr_read, csr_write, mem_read, "
                                        r"mem_write, wait_interrupt, hw, windows$"):
        Runtime.on_device(image, object())


def test_token_and_position_are_checked_at_the_call(tensors):
    image = pack(CFG, tensors, HW["tiny"])
    program = compile_token(CFG, image, HW["tiny"])
    model = Model.from_hf(CFG, tensors)
    rt = Runtime(CFG, image, program, IssBackend(HW["tiny"], "hardware"))
    machine = rt.machine
    steps = {"golden": model.step, "runtime": rt.step,
             "iss": lambda t: machine.run(program.words, token=t, pos=0)}
    for value in (2.7, True, "2", np.float64(2.0), None):
        for who, step in steps.items():
            with pytest.raises(TypeError) as e:
                step(value)
            assert str(e.value) == f"token id must be an integer, not {value!r}", who
    for value in (-1, CFG.vocab_size):
        for step in (model.step, rt.step):
            with pytest.raises(ValueError, match=re.escape(f"token id {value} is outside the vocabulary [0, 320)")):
                step(value)
    assert model.position == rt.position == 0                 # nothing ran
    # The ISS takes what the host writes to the 32-bit TOKEN_ID and POSITION registers: -1 no longer wraps to the
    # last row (a token beyond a table is the program's ADDRESS_RANGE error, as on the NPU).
    for kwargs, message in (({"token": -1, "pos": 0}, "token id -1 is outside the 32-bit TOKEN_ID register "
                                                       "[0, 4294967296)"),
                            ({"token": 2**32, "pos": 0}, "token id 4294967296 is outside the 32-bit TOKEN_ID "
                                                         "register [0, 4294967296)"),
                            ({"token": 2, "pos": -1}, "position -1 is outside the 32-bit POSITION register "
                                                      "[0, 4294967296)")):
        with pytest.raises(ValueError) as e:
            machine.run(program.words, **kwargs)
        assert str(e.value) == message
    with pytest.raises(TypeError) as e:
        machine.run(program.words, token=2, pos=1.5)
    assert str(e.value) == "position must be an integer, not 1.5"
    # NumPy integers are integers everywhere.
    np.testing.assert_array_equal(model.step(np.int64(2)), Model.from_hf(CFG, tensors).step(2))
    machine.run(program.words, token=np.int32(2), pos=np.uint64(0))
    assert rt.step(np.int16(2)).shape == (CFG.vocab_size,)
