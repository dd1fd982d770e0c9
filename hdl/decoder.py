"""Instruction decoder: checks one 64-bit word exactly as `hdl.isa.decode` does, in one cycle of logic.

The decoder is generated from `hdl.isa.FORMATS`, so the RTL and the software decoder cannot drift: for every
word, ``o_error`` is the `ErrorCode` that `hdl.isa.decode` raises (``NONE`` for a valid word) with the same
priority, because the checks are made field by field in the same MSB-first order and the first failing
field wins:

- opcode 0xD..0xF                                → BAD_OPCODE
- a reserved field (``rsvd*``) not zero          → RESERVED_BITS
- a coded field (function, cache, direction, region) holding an undefined value → BAD_FUNCTION
- an L2 word address ≥ the configured L2 size    → ADDRESS_RANGE
- MEMCPY with both ``from_device`` and ``to_device`` → BAD_FUNCTION (checked after the fields)

``o_insn`` carries the raw word, ``o_opcode`` the opcode; the execution units view the word through
`hdl.isa.layout(op)`. The decoder is purely combinational (``latency = 0``); the controller registers its
outputs in its issue stage.
"""

from __future__ import annotations

from amaranth import Const, Module, Mux, unsigned
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .isa import BODY_BITS, FORMATS, WORD_BITS, ErrorCode, Opcode

__all__ = ["Decoder"]


def _defined_values(kind) -> list[int]:
    return sorted(member.value for member in kind)


class Decoder(wiring.Component):
    """Combinational checker of one instruction word.

    Parameters
    ----------
    l2_words : number of 16-byte L2 words; L2 address fields must be below it.

    Members
    -------
    i_word : In(64)
    o_opcode : Out(Opcode)
    o_error : Out(ErrorCode)
    """

    latency = 0

    def __init__(self, l2_words: int):
        if not isinstance(l2_words, int) or l2_words < 1:
            self._MustUse__silence = True     # rejected: no "created but never used" warning on top
            raise ValueError(f"l2_words must be a positive integer, not {l2_words!r}")
        self._l2_words = l2_words
        super().__init__({"i_word": In(WORD_BITS), "o_opcode": Out(Opcode), "o_error": Out(ErrorCode)})

    @property
    def l2_words(self) -> int:
        return self._l2_words

    def _field_errors(self, op: Opcode, word):
        """(condition, code) per field in decode()'s order."""
        checks = []
        pos = BODY_BITS
        for f in FORMATS[op]:
            pos -= f.width
            v = word[pos:pos + f.width]
            if f.reserved:
                checks.append((v != 0, ErrorCode.RESERVED_BITS))
            elif f.kind is not None:
                defined = _defined_values(f.kind)
                if len(defined) < (1 << f.width):
                    ok = 0
                    for value in defined:
                        ok = ok | (v == value)
                    checks.append((~ok, ErrorCode.BAD_FUNCTION))
            elif f.l2_addr and self._l2_words < (1 << f.width):
                checks.append((v >= self._l2_words, ErrorCode.ADDRESS_RANGE))
        if op is Opcode.MEMCPY:
            positions, p = {}, BODY_BITS
            for f in FORMATS[op]:
                p -= f.width
                positions[f.name] = p
            checks.append((word[positions["from_device"]] & word[positions["to_device"]], ErrorCode.BAD_FUNCTION))
        return checks

    def elaborate(self, platform):
        m = Module()
        word = self.i_word
        opcode = word[BODY_BITS:WORD_BITS]
        m.d.comb += self.o_opcode.eq(opcode)
        with m.Switch(opcode):
            for op in Opcode:
                with m.Case(op.value):
                    m.d.comb += self.o_error.eq(self._chain(self._field_errors(op, word)))
            with m.Default():
                m.d.comb += self.o_error.eq(ErrorCode.BAD_OPCODE)
        return m

    @staticmethod
    def _chain(checks):
        code = Const(ErrorCode.NONE.value, unsigned(4))
        for cond, err in reversed(checks):
            code = Mux(cond, err.value, code)
        return code
