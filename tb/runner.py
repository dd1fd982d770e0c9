"""Run cocotb benches on Verilator against Amaranth components: one helper shared by every bench in ``tb/``.

A bench is a Python module of ``@cocotb.test()`` coroutines (``tb/<block>/test_*.py``) plus a pytest
wrapper that calls `run` with the component to simulate. `run` writes the component's Verilog (only when
its text changed, so Verilator does not rebuild), builds the model once per build directory, runs the
selected testcases and fails with the names of the failing cocotb tests.

Parameters reach the cocotb side as environment variables (`extra_env`); `bench_env` reads them back.
The repository root is put on the bench's ``PYTHONPATH`` so benches import ``sim``, ``hdl`` and ``tb``.

Example::

    from tb.runner import run
    run(GemvEngine(cfg), toplevel="gemv", test_module="tb.gemv.test_gemv",
        extra_env={"NPU_HW": cfg.name, "SEED": "1"})
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ROOT", "BUILD_ROOT", "write_if_changed", "verilog_of", "run", "bench_env"]

ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = ROOT / "build" / "sim"

# Amaranth's Verilog trips Verilator's width and case-completeness lint; linting generated
# code tells nothing the Amaranth checks do not, so those warnings are waived, nothing else.
VERILATOR_ARGS = ["-Wno-WIDTHEXPAND", "-Wno-WIDTHTRUNC", "-Wno-CASEINCOMPLETE", "-Wno-UNOPTFLAT",
                  "-Wno-PINCONNECTEMPTY", "-Wno-UNSIGNED", "-Wno-CMPCONST"]


def write_if_changed(path: Path, text: str) -> bool:
    """Write `text` to `path` unless it already holds exactly that; returns whether it wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


def verilog_of(component, name: str) -> str:
    from amaranth.back import verilog
    return verilog.convert(component, name=name, emit_src=False)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def run(component, *, toplevel: str, test_module: str, build_name: str | None = None,
        testcase: str | list[str] | None = None, extra_env: Mapping[str, str] | None = None,
        waves: bool = False, seed: int | None = None, timeout_s: float | None = None,
        verilog: str | None = None) -> Path:
    """Generate Verilog for `component`, build it with Verilator and run the cocotb `test_module` on it.

    `build_name` names the build directory under ``build/sim/`` (default: the toplevel): give every
    distinct component configuration its own name so models are not rebuilt back and forth. Raises
    ``AssertionError`` naming the failures when any cocotb test fails or none ran. `verilog`: the
    component's Verilog (named `toplevel`) when the caller already has it (converting a whole NPU takes
    about 40 s; benches that run it several times convert once); `component` may then be None.
    """
    build_dir = BUILD_ROOT / _safe(build_name or toplevel)
    with _exclusive(build_dir):         # test processes running side by side (pytest -n) share build dirs
        return _run_locked(component, build_dir, toplevel, test_module, testcase, extra_env, waves, seed, verilog)


@contextlib.contextmanager
def _exclusive(build_dir: Path):
    """Hold an exclusive lock on `build_dir` (a ``.lock`` file beside it) while building and running in it."""
    import fcntl
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_locked(component, build_dir, toplevel, test_module, testcase, extra_env, waves, seed, verilog):
    from cocotb_tools.runner import get_results, get_runner

    source = build_dir / f"{toplevel}.v"
    write_if_changed(source, verilog_of(component, toplevel) if verilog is None else verilog)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.update(extra_env or {})
    runner = get_runner("verilator")
    runner.build(sources=[source], hdl_toplevel=toplevel, build_dir=build_dir, always=False,
                 build_args=VERILATOR_ARGS + (["--trace-fst"] if waves else []),
                 waves=waves, timescale=("1ns", "1ps"))
    results = build_dir / f"{_safe(test_module)}.{_safe(str(testcase or 'all'))}.results.xml"
    pytest_test = os.environ.pop("PYTEST_CURRENT_TEST", None)   # we check results ourselves, by name
    try:
        runner.test(hdl_toplevel=toplevel, test_module=test_module, build_dir=build_dir, testcase=testcase,
                    extra_env=env, waves=waves, seed=seed, results_xml=str(results),
                    timescale=("1ns", "1ps"))
    except SystemExit as e:      # the simulator crashed before writing results
        raise AssertionError(f"{test_module} on {toplevel}: the simulator exited with {e.code}") from None
    finally:
        if pytest_test is not None:
            os.environ["PYTEST_CURRENT_TEST"] = pytest_test
    num_tests, num_failed = get_results(results)
    failed = _failed_names(results)
    if num_tests == 0:
        raise AssertionError(f"{test_module} on {toplevel}: no cocotb test ran (testcase={testcase!r})")
    if num_failed:
        raise AssertionError(f"{test_module} on {toplevel}: {num_failed} of {num_tests} cocotb tests failed: "
                             f"{', '.join(failed)} (log above; results in {results})")
    return results


def _failed_names(results: Path) -> list[str]:
    import xml.etree.ElementTree as ET
    names = []
    for case in ET.parse(results).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            names.append(case.get("name", "?"))
    return names


def bench_env(name: str, default: str | None = None) -> str:
    """A parameter passed by `run(extra_env=...)`, read inside a cocotb test."""
    value = os.environ.get(name, default)
    if value is None:
        raise RuntimeError(f"bench parameter {name} is not set; run this bench through tb.runner.run")
    return value
