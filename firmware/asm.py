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
    if not isinstance(line, str):
        raise TypeError(f"a line of assembly must be a str, not {type(line).__name__}")
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
    if isinstance(text, (bytes, bytearray)):
        raise TypeError("assemble takes text (a str or lines of str), not bytes; decode it first")
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
    """Words to text, one line each; a malformed word is a `DecodeError` naming its index (``word 3: ...``)."""
    lines = []
    for i, w in enumerate(words):
        try:
            lines.append(disassemble(w, l2_words=l2_words))
        except DecodeError as e:
            raise DecodeError(e.code, f"word {i}: {e}") from None
    return "\n".join(lines)


def _read_text(path: str) -> str:
    """The UTF-8 text of `path` (``-``: standard input); `AsmError` naming the file for what is not."""
    name = "<stdin>" if path == "-" else path
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise AsmError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise AsmError(f"{name}: is a directory, not a file") from None
    except OSError as e:
        raise AsmError(f"{name}: cannot read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise AsmError(f"{name}: line {line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") \
            from None


def _parse_words(text: str, name: str) -> list[tuple[int, int]]:
    """(line number, word) of each hex word, any number per line (whitespace between them, ``#`` or ``;``
    starts a comment); `AsmError` naming the line and the word's index for a token that is not a 64-bit hex
    word."""
    words = []
    for n, line in enumerate(text.splitlines(), 1):
        for token in line.split("#", 1)[0].split(";", 1)[0].split():
            try:
                w = None if token.startswith(("+", "-")) else int(token, 16)
            except ValueError:
                w = None
            if w is None or w >= 1 << 64:
                raise AsmError(f"{name}: line {n}: word {len(words)}: {token!r} is not a 64-bit hex word")
            words.append((n, w))
    return words


def main(argv=None) -> int:
    """``python -m firmware.asm asm|dis [FILE]``. Bad input (a missing, unreadable or non-UTF-8 file, a line
    that does not assemble, a token that is not a hex word or a word that does not decode): one line on stderr
    naming the file and the line (and for ``dis`` the word's index), exit status 2."""
    p = argparse.ArgumentParser(prog="python -m firmware.asm", description="NPU assembler / disassembler")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("asm", help="text -> hex words (one per line)")
    a.add_argument("file", nargs="?", default="-", help="assembly text (default -: standard input)")
    d = sub.add_parser("dis", help="hex words (one per line) -> text")
    d.add_argument("file", nargs="?", default="-", help="hex words (default -: standard input)")
    args = p.parse_args(argv)
    name = "<stdin>" if args.file == "-" else args.file
    try:
        src = _read_text(args.file)
        if args.cmd == "asm":
            try:
                words = assemble(src)
            except AsmError as e:
                raise AsmError(f"{name}: {e}") from None
            out = "\n".join(f"{w:016x}" for w in words)
        else:
            text = []
            for i, (n, w) in enumerate(_parse_words(src, name)):
                try:
                    text.append(disassemble(w))
                except DecodeError as e:
                    raise AsmError(f"{name}: line {n}: word {i}: {e}") from None
            out = "\n".join(text)
    except AsmError as e:
        print(f"python -m firmware.asm: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
