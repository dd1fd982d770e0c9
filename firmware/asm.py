"""Assembler and disassembler for the NPU's 64-bit instructions (`hdl.isa` is the definition).

Text syntax, one instruction per line, ``#`` or ``;`` starts a comment::

    gemv dest=0x100 src=0x0 size_ptr=0 shape_ptr=0 lanes=15 findemax
    cvo.exp src=0x10 dst=0x20 length=256 sub_emax async
    memset cache=weight slot=0 a=1 b=4096 c=4096
    vec.muls dst=0x200 a=0x100 b=0x0 s=1
    ctrl.halt imm=0

The mnemonic is the opcode in lower case; a ``func`` field is written as a suffix (``cvo.exp``). Every
other field is ``name=value`` (integers in decimal or 0x-hex, coded fields by name, e.g. ``dir=ddr_to_l2``);
one-bit fields are written as a bare word when set and left out when clear (``async`` for the ``async_``
field). `disassemble` prints exactly this canonical form, so ``assemble(disassemble(w)) == w`` for every
valid word, and ``disassemble(assemble(t))`` is `t` in canonical form.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from hdl.isa import FORMATS, DecodeError, Opcode, decode, encode

__all__ = ["assemble", "assemble_line", "disassemble", "disassemble_program", "AsmError", "main"]


class AsmError(ValueError):
    """A line that does not assemble; the message names the line and the field."""


def _text_name(field_name: str) -> str:
    return field_name.rstrip("_")


def _lookup(op: Opcode):
    by_text = {}
    for f in FORMATS[op]:
        if not f.reserved:
            by_text[_text_name(f.name)] = f
    return by_text


def _parse_int(text: str) -> int:
    return int(text, 0)


def assemble_line(line: str, *, l2_words: int | None = None) -> int | None:
    """One line of text to a word; None for a blank or comment line."""
    code = line.split("#", 1)[0].split(";", 1)[0].strip()
    if not code:
        return None
    head, *args = code.split()
    mnemonic, _, func = head.partition(".")
    try:
        op = Opcode[mnemonic.upper()]
    except KeyError:
        raise AsmError(f"unknown mnemonic {mnemonic!r}; known: "
                       f"{', '.join(o.name.lower() for o in Opcode)}") from None
    fields = _lookup(op)
    values = {}
    if "func" in fields:
        if not func:
            raise AsmError(f"{mnemonic} needs a function suffix, e.g. {mnemonic}."
                           f"{next(iter(fields['func'].kind)).name.lower()}")
        try:
            values["func"] = fields["func"].kind[func.upper()]
        except KeyError:
            raise AsmError(f"{mnemonic} has no function {func!r}; known: "
                           f"{', '.join(m.name.lower() for m in fields['func'].kind)}") from None
    elif func:
        raise AsmError(f"{mnemonic} takes no function suffix (got .{func})")
    for arg in args:
        name, eq, text = arg.partition("=")
        f = fields.get(name)
        if f is None or name == "func":
            raise AsmError(f"{mnemonic} has no field {name!r}; its fields are "
                           f"{', '.join(n for n in fields if n != 'func')}")
        if f.name in values:
            raise AsmError(f"field {name!r} given twice")
        if not eq:
            if f.width != 1:
                raise AsmError(f"field {name!r} of {mnemonic} needs a value ({name}=...)")
            values[f.name] = 1
        elif f.kind is not None:
            try:
                values[f.name] = f.kind[text.upper()]
            except KeyError:
                raise AsmError(f"field {name!r} of {mnemonic}: {text!r} is not one of "
                               f"{', '.join(m.name.lower() for m in f.kind)}") from None
        else:
            try:
                values[f.name] = _parse_int(text)
            except ValueError:
                raise AsmError(f"field {name!r} of {mnemonic}: {text!r} is not an integer") from None
    for name, f in fields.items():
        if f.name not in values:
            if f.width == 1:
                values[f.name] = 0
            else:
                raise AsmError(f"{mnemonic} needs field {name!r}")
    try:
        return encode(op, l2_words=l2_words, **values)
    except ValueError as e:
        raise AsmError(str(e)) from None


def assemble(text: str | Iterable[str], *, l2_words: int | None = None) -> list[int]:
    """A program's text to its words; errors name the line number."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    words = []
    for n, line in enumerate(lines, 1):
        try:
            w = assemble_line(line, l2_words=l2_words)
        except AsmError as e:
            raise AsmError(f"line {n}: {e}") from None
        if w is not None:
            words.append(w)
    return words


def disassemble(word: int, *, l2_words: int | None = None) -> str:
    """One word to its canonical text; `hdl.isa.DecodeError` for a malformed word."""
    insn = decode(word, l2_words=l2_words)
    head = insn.op.name.lower()
    parts = []
    for f in FORMATS[insn.op]:
        if f.reserved:
            continue
        v = insn.fields[f.name]
        name = _text_name(f.name)
        if f.name == "func":
            head += "." + v.name.lower()
        elif f.kind is not None:
            parts.append(f"{name}={v.name.lower()}")
        elif f.width == 1:
            if v:
                parts.append(name)
        elif f.l2_addr or f.name in ("imm", "offset", "aux"):
            parts.append(f"{name}={v:#x}")
        else:
            parts.append(f"{name}={v}")
    return " ".join([head] + parts)


def disassemble_program(words: Iterable[int], *, l2_words: int | None = None) -> str:
    return "\n".join(disassemble(w, l2_words=l2_words) for w in words)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m firmware.asm", description="NPU assembler / disassembler")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("asm", help="text -> hex words (one per line)")
    a.add_argument("file", nargs="?", default="-")
    d = sub.add_parser("dis", help="hex words (one per line) -> text")
    d.add_argument("file", nargs="?", default="-")
    args = p.parse_args(argv)
    src = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
    try:
        if args.cmd == "asm":
            print("\n".join(f"{w:016x}" for w in assemble(src)))
        else:
            words = [int(t, 16) for t in src.split()]
            print(disassemble_program(words))
    except (AsmError, DecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
