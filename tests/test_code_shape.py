"""The shape of the RTL source: no function or method in `hdl/` over `MAX_LINES` lines (the controller is a set
of components, not one FSM), and `hdl/` never imports `sim/` (the models import the RTL's definitions, not the
other way round)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 250
HDL = sorted((ROOT / "hdl").rglob("*.py"))


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_in_hdl_is_longer_than_the_limit():
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)" for p in HDL for name, line, n in _functions(p)
            if n > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_hdl_does_not_import_sim():
    bad = []
    for p in HDL:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{p.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n == "sim" or n.startswith("sim.")]
    assert not bad, bad


def test_the_limit_catches_a_long_function(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f():\n" + "    x = 1\n" * MAX_LINES)
    assert [n for _, _, n in _functions(src)] == [MAX_LINES + 1]
