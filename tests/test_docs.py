"""The documentation describes the design as it is (docs/ and the READMEs).

Every Markdown page is checked for development-history wording (sessions, "previously", "no longer", commit
hashes, dates, issue numbers, ...), for references to files outside the repository, and for the paths,
modules, commands and test names it mentions: each must exist in the repository. The README's parameter
table must equal `hdl.config.parameter_table()`.

The checks are functions of the text, so that `test_rules_*` can show what each rule catches and what it
lets through (hex constants, DDR addresses, the word "session" as part of another word).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hdl.config import PRESETS, HardwareConfig, parameter_table

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "tests" / "fixtures" / "README.md", *(ROOT / "docs").glob("*.md")])
# The repository's top-level Python packages and folders that documentation names by path or module.
PACKAGES = ("benchmarks", "firmware", "hdl", "sim", "tb", "tests")
FOLDERS = (".ci", "benchmarks", "constraints", "docs", "firmware", "hdl", "scripts", "sim", "tb", "tests")

# Wording that tells the history of the code instead of describing it.
HISTORY = [
    (r"\bsessions?\b", "a development session"),
    # (not "issue 3.7": the issue cost of firmware.perf.Rates)
    (r"\b(?:issue|pull request|PR)\s*#?\d+\b(?!\.\d)|(?<![\w&])#\d+\b", "an issue or pull-request number"),
    (r"\b(?:last|previous|earlier|prior)\s+(?:session|commit|revision|change|measurement|run|version)s?\b",
     "an earlier state of the repository"),
    (r"\b(?:first|old|older|earlier|previous|prior)\s+(?:version|design|implementation)\b", "an earlier version"),
    (r"\b(?:before|since|after|until)\s+(?:the|this|that)\s+(?:change|fix|rewrite|refactor(?:ing)?|commit)\b",
     "a change in time"),
    (r"\b(?:was|were|has been|have been|got)\s+(?:changed|replaced|removed|moved|renamed|rewritten|reworked|"
     r"re-?measured|re-?run|fixed|added|dropped|switched)\b", "a change narrated"),
    (r"\bwe\s+(?:changed|moved|replaced|removed|added|fixed|switched|now|re-?measured)\b", "a change narrated"),
    (r"\b(?:previously|formerly|originally|no longer|used to be|nowadays)\b", "an earlier state"),
    (r"\bnow\b", '"now" (as against an earlier state)'),
    (r"\b(?:today|recently|at the time of writing)\b|\bas of (?:now|today|\d{4})", "a point in time"),
    (r"\bthe current (?:version|design|code|implementation)\b", '"the current ..." (as against an earlier one)'),
    (r"\bre-?measured\b|\bnot re-?run\b", "a re-measurement"),
    (r"\b(?:19|20)\d\d-\d\d-\d\d\b|\bchangelog\b", "a dated entry"),
    # A commit hash: 7 to 40 lower-case hex digits with at least one letter and one digit, standing alone.
    # 0x-prefixed constants and addresses (0x8_0000_0000, 0x7FC00000) are words with the x, so never match.
    (r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w])", "a commit hash"),
]

# Files outside the repository: what the project needs from them is in docs/requirements.md.
OUTSIDE = [
    (r"\.\./shared|(?<![\w.-])shared/(?:reference|spec|oracle|hooks)\b", "the shared folder beside the repository"),
    (r"(?<![\w.])/work/", "an absolute path of a development machine"),
    (r"\b(?:ARCHITECTURE|STYLE|TOOLCHAIN)\.md\b|\b(?:ARCHITECTURE|TOOLCHAIN)\s+(?:decision\s+|§\s*)?\d",
     "a planning document outside the repository"),
    (r"\bperf-anchors\b|\bpccx-v002-digest\b|\bgemma3n-semantics\.md\b|\bkv260-board\.md\b|\bthe (?:pccx )?digest\b",
     "a reference note outside the repository"),
    (r"(?i)\b(?:the|this|our)\s+brief\b|\bbrief's\b", "the brief (restate it in docs/requirements.md)"),
]


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _findings(text: str, rules, flags=re.IGNORECASE) -> list[str]:
    found = []
    for pattern, what in rules:
        for m in re.finditer(pattern, text, flags if "(?=[0-9a-f]" not in pattern else 0):
            found.append(f"line {_line(text, m.start())}: {what}: {m.group(0)!r}")
    return found


def history_findings(text: str) -> list[str]:
    """Development-history wording in `text`, one line per finding."""
    return _findings(text, HISTORY)


def outside_findings(text: str) -> list[str]:
    """References to files outside the repository in `text` (case-sensitive: ARCHITECTURE, ...)."""
    return _findings(text, OUTSIDE, flags=0)


def _module_path(dotted: str) -> tuple[Path | None, list[str]]:
    """The longest prefix of `dotted` that is a module or package of the repository, and the names after it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for path in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
            if path.is_file():
                return path, parts[n:]
    return None, parts


def missing_references(text: str, page: Path) -> list[str]:
    """Paths, Markdown links, modules, ``python -m`` commands and ``file.py::test`` names in `text` (the page
    `page`) that do not exist in the repository."""
    missing = []
    # Markdown links, relative to the page (as a Markdown renderer resolves them).
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        path = (page.parent / target).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            missing.append(f"line {_line(text, m.start())}: link {m.group(1)!r}")
    # ../ paths, relative to the page: inside the repository, and there.
    for m in re.finditer(r"(?<![\w.])(?:\.\./)+[\w.*/-]*[\w*]", text):
        path = (page.parent / m.group(0)).resolve()
        if not path.is_relative_to(ROOT) or not (path.exists() or any(ROOT.glob(str(path.relative_to(ROOT))))):
            missing.append(f"line {_line(text, m.start())}: {m.group(0)!r} is not in the repository")
    # Repository paths, written from the root (docs/sfu.md, hdl/fp.py, tests/fixtures/*.npz).
    folders = "|".join(re.escape(f) for f in FOLDERS)
    for m in re.finditer(rf"(?<![\w/.~-])(?:{folders})/[\w.*/-]*[\w*]", text):
        if not any(ROOT.glob(m.group(0))) and not (ROOT / m.group(0)).exists():
            missing.append(f"line {_line(text, m.start())}: path {m.group(0)!r}")
    # Test names: tests/test_x.py::test_name.
    for m in re.finditer(r"(tests/[\w/]+\.py)::(\w+)", text):
        path = ROOT / m.group(1)
        if path.is_file() and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{m.group(2)}\b|^{m.group(2)}\s*=",
                                            path.read_text(), re.M):
            missing.append(f"line {_line(text, m.start())}: test {m.group(0)!r}")
    # Modules (hdl.sfu, firmware.perf.Rates) and `python -m` commands of the repository's packages.
    packages = "|".join(PACKAGES)
    for m in re.finditer(rf"(?<![\w./-])(?:{packages})(?:\.[A-Za-z_]\w*)+", text):
        path, rest = _module_path(m.group(0))
        if path is None or len(rest) == len(m.group(0).split(".")):
            missing.append(f"line {_line(text, m.start())}: module {m.group(0)!r}")
        elif rest and not re.search(rf"\b{re.escape(rest[0])}\b", path.read_text()):
            missing.append(f"line {_line(text, m.start())}: {rest[0]!r} is not in {path.relative_to(ROOT)}")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_history(page):
    found = history_findings(page.read_text())
    assert not found, f"{page.relative_to(ROOT)} tells history; describe the design as it is:\n" + "\n".join(found)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_references_outside_the_repository(page):
    found = outside_findings(page.read_text())
    assert not found, (f"{page.relative_to(ROOT)} refers to files outside the repository; restate what is "
                       f"needed (docs/requirements.md):\n" + "\n".join(found))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_modules_and_tests_exist(page):
    found = missing_references(page.read_text(), page)
    assert not found, f"{page.relative_to(ROOT)} names what the repository does not have:\n" + "\n".join(found)


def test_readme_parameter_table_is_generated():
    m = re.search(r"<!-- parameters -->\n(.*?)\n<!-- /parameters -->", (ROOT / "README.md").read_text(), re.S)
    assert m, "README.md has no <!-- parameters --> ... <!-- /parameters --> section"
    assert m.group(1) == parameter_table(), ("README.md's parameter table is out of date: replace it with the "
                                             "output of `python -m hdl.config --markdown`")


def test_parameter_table_has_a_row_per_field_and_a_column_per_preset():
    import dataclasses

    lines = parameter_table().splitlines()
    assert lines[0] == "| parameter | meaning | " + " | ".join(f"`{p}`" for p in PRESETS) + " |"
    rows = [line.split(" | ") for line in lines[2:]]
    assert [r[0].strip("|` ") for r in rows] == [f.name for f in dataclasses.fields(HardwareConfig)]
    assert all(len(r) == 2 + len(PRESETS) and r[1] for r in rows)
    kv260 = {r[0].strip("|` "): r[2] for r in rows}
    assert kv260["clock_hz"] == "300 MHz" and kv260["l2_bytes"] == "1 MiB" and kv260["gemv_max_cols"] == "16,384"
    two = parameter_table({"tiny": PRESETS["tiny"], "kv260": PRESETS["kv260"]}).splitlines()
    assert two[0] == "| parameter | meaning | `tiny` | `kv260` |"


@pytest.mark.parametrize("line", [
    "Measured in session 12 and again since session 14.",
    "The last session moved the quantiser.",
    "Re-measured at 3ff3915 (2026-11-25).",
    "The adder was replaced by a tree; the RTL now takes four lanes.",
    "Previously the SFU took 191 cycles; it no longer does.",
    "The sparse datapaths were cut (issue 28).",
    "The first version without chunks reached 91.5 %.",
])
def test_rules_catch_history(line):
    assert history_findings(line), line


@pytest.mark.parametrize("line", [
    "The answer to `../shared/ARCHITECTURE.md`.",
    "As the brief asks, 8 tok/s (perf-anchors §1).",
    "Fixtures written by ../shared/oracle/hf_gemma3n_tiny.py.",
    "The tables of shared/reference/pccx-v002-digest.md and /work/shared/spec/.",
    "ARCHITECTURE decision 2; TOOLCHAIN 6.",
])
def test_rules_catch_references_outside_the_repository(line):
    assert outside_findings(line), line


@pytest.mark.parametrize("line", [
    "`npu_hi` at `0x8_0000_0000`, the PMU at `0x7FF0_0000`, ID 0x47334E31, NaN 0x7FC00000.",
    "`0x1FFFF80007014600`; L_HI = 0x3CB17000; 2,178.5 MB; 1e-9; f64_s0_l10.npz; 16384 x 2048.",
    "Latency 191 cycles; 36,641 → 22,221 LUT; 2**-24; u0.64; the defaced and effaced words.",
    "A token program per token; the known answers; a brief pause; issue 3.7 cycles; the current tile.",
])
def test_rules_let_the_design_through(line):
    assert not history_findings(line) and not outside_findings(line), line


def test_named_paths_must_exist():
    page = ROOT / "docs" / "architecture.md"
    assert not missing_references("`hdl/fp.py`, docs/sfu.md, tests/fixtures/*.npz, `python -m firmware.perf`, "
                                  "`hdl.isa.DESCRIPTOR`, tests/test_isa.py::test_pccx_known_answers", page)
    bad = ("`hdl/nothing.py`, [a link](missing.md), `python -m firmware.nothing`, `hdl.isa.NO_SUCH_NAME`, "
           "tests/test_isa.py::test_no_such_test, ../../outside.md, ../shared/ARCHITECTURE.md")
    assert len(missing_references(bad, page)) == 7
    assert not missing_references("../README.md, ../hdl/fp.py", page)
