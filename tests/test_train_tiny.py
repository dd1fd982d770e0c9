"""``scripts/train_tiny.py``, the script that trained the built-in model: its command line answers bad options
with one line and exit status 2 before it needs torch, and says in one line that torch is missing (the
project's environment has no torch; the training runs in a throwaway one, its docstring says which)."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_tiny.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("args, message", [
    (["out", "--steps", "0"], "argument --steps: must be a positive integer, not '0'"),
    (["out", "--seed", "-1"], "argument --seed: must be an integer >= 0, not '-1'"),
    (["out", "--seq", "1"], "argument --seq: must be an integer in [2, 512], not '1'"),
    (["out", "--vocab", "100"], "argument --vocab: must be an integer in [256, 32768], not '100'"),
    (["out", "--lr", "nan"], "argument --lr: must be a number in (0, 1), not 'nan'"),
    (["out", "--threads", "x"], "argument --threads: must be a positive integer, not 'x'"),
    ([], "the following arguments are required: OUT"),
])
def test_bad_options_are_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == f"scripts/train_tiny.py: error: {message}"


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_missing_torch_is_one_line(tmp_path):
    r = run(str(tmp_path / "out"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("scripts/train_tiny.py: needs torch, transformers, sentencepiece and numpy")
    assert not (tmp_path / "out").exists()
