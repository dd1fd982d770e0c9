#!/usr/bin/env bash
# Set up the on-board runtime on a KV260 running Kria Ubuntu (docs/kv260.md): a .venv with only what the host
# side needs (NumPy, Amaranth for the ISA definitions, SentencePiece, safetensors + ml_dtypes to read
# checkpoints), at the versions pyproject.toml pins. No simulators, no Yosys. Idempotent.
#
# Ubuntu 22.04's default Python is 3.10; the project needs 3.11, which Ubuntu ships as python3.11 (universe).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
RUNTIME_PACKAGES=(numpy amaranth sentencepiece safetensors ml_dtypes)

say() { printf 'setup-board: %s\n' "$*"; }
die() { printf 'setup-board: error: %s\n' "$*" >&2; exit 1; }

py_ok() { "$1" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; }

PY=
for cand in python3.13 python3.12 python3.11 python3; do
    if command -v "$cand" >/dev/null && py_ok "$cand"; then PY=$cand; break; fi
done
if [[ -z $PY ]]; then
    command -v apt-get >/dev/null || die "no Python >= 3.11 and no apt-get; install Python 3.11"
    say "installing python3.11 and python3.11-venv with apt"
    sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11 python3.11-venv
    PY=python3.11
fi
[[ -x $VENV/bin/python ]] && py_ok "$VENV/bin/python" || { say "creating $VENV with $PY"; "$PY" -m venv --clear "$VENV"; }

# The pins of the runtime packages, from pyproject.toml (the single list of dependencies); Amaranth without
# its builtin-yosys extra (the board generates no Verilog).
mapfile -t reqs < <("$VENV/bin/python" - "${RUNTIME_PACKAGES[@]}" <<'PY'
import re, sys, tomllib
with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for want in sys.argv[1:]:
    pin = next(d for d in deps if re.match(rf"{want}(\[|=)", d.split()[0]))
    print(re.sub(r"\[.*?\]", "", pin.split()[0]))
PY
)
say "pip: ${reqs[*]}"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${reqs[@]}"
"$VENV/bin/python" -c 'import firmware.board, firmware.generate, firmware.ddrprobe' \
    || die "the runtime does not import; see the error above"
say "done: $VENV/bin/python -m firmware.generate --backend kv260 --image DIR --prompt TEXT"
