"""The ISA definition, assembler and disassembler: pccx known answers, round trips, malformed words."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firmware.asm import AsmError, assemble, assemble_line, disassemble
from hdl.isa import FORMATS, CvoFunc, DecodeError, ErrorCode, Opcode, decode, encode, layout

# pccx v002 golden encodings, computed by hand from pccx v002's published field tables (docs/isa.md).
PCCX_KNOWN_ANSWERS = [
    ("gemv dest=0x100 src=0x0 size_ptr=0 shape_ptr=0 lanes=15", 0x0008000000000078),
    ("gemv dest=0x300 src=0x200 size_ptr=0 shape_ptr=1 lanes=15", 0x0018000800000178),
    ("gemm dest=0x1ffff src=0x1 findemax accm size_ptr=5 shape_ptr=6 lanes=0", 0x1FFFF80007014600),
    ("memset cache=weight slot=0 a=1 b=4096 c=4096", 0x3400001100010000),
    ("memcpy from_device dest=0x40 src=0x0 aux=0x0 shape_ptr=2 async", 0x2800800000000005),
    ("cvo.gelu src=0x100 dst=0x200 length=4096", 0x4200800080040000),
    ("cvo.exp src=0x10 dst=0x20 length=256 sub_emax async", 0x4000080008004021),
]


@pytest.mark.parametrize("text, word", PCCX_KNOWN_ANSWERS)
def test_pccx_known_answers(text, word):
    assert assemble_line(text) == word
    assert disassemble(word) == text


def test_pccx_shift_mask_recipe():
    # pccx v002's shift recipes, applied by hand, agree with encode() on arbitrary field values.
    dest, src, flags, size, shape, lanes = 0x1ABCD, 0x0F0F0, 0b101000, 17, 42, 9
    recipe = 0 << 60 | dest << 43 | src << 26 | flags << 20 | size << 14 | shape << 8 | lanes << 3
    assert encode(Opcode.GEMV, dest=dest, src=src, findemax=1, accm=0, w_scale=1, size_ptr=size,
                  shape_ptr=shape, lanes=lanes) == recipe
    func, length, cflags = 7, 65535, 0b10100
    recipe = 4 << 60 | func << 56 | 0x1234 << 39 | 0x4321 << 22 | length << 6 | cflags << 1 | 1
    assert encode(Opcode.CVO, func=CvoFunc.RECIP, src=0x1234, dst=0x4321, length=length, sub_emax=1,
                  recip_scale=0, accm=1, async_=1) == recipe
    recipe = 2 << 60 | 0 << 59 | 1 << 58 | 0x11111 << 41 | 0x2222 << 24 | 0x333 << 7 | 5 << 1 | 0
    assert encode(Opcode.MEMCPY, from_device=0, to_device=1, dest=0x11111, src=0x2222, aux=0x333, shape_ptr=5,
                  async_=0) == recipe
    recipe = 3 << 60 | 1 << 58 | 63 << 52 | 0xFFFF << 36 | 0x1234 << 20 | 0xBEEF << 4
    assert encode(Opcode.MEMSET, cache=1, slot=63, a=0xFFFF, b=0x1234, c=0xBEEF) == recipe


def field_values(op):
    """A strategy for the non-reserved fields of a valid `op` instruction."""
    parts = {}
    for f in FORMATS[op]:
        if f.reserved:
            continue
        parts[f.name] = st.sampled_from(list(f.kind)) if f.kind is not None else st.integers(0, 2**f.width - 1)
    strategy = st.fixed_dictionaries(parts)
    if op is Opcode.MEMCPY:
        strategy = strategy.filter(lambda v: not (v["from_device"] and v["to_device"]))
    return strategy


def plain(fields):
    return {k: getattr(v, "value", v) for k, v in fields.items()}


@st.composite
def valid_instruction(draw):
    op = draw(st.sampled_from(list(FORMATS)))
    return op, draw(field_values(op))


@settings(max_examples=400)
@given(valid_instruction())
def test_every_valid_word_round_trips(insn):
    op, values = insn
    word = encode(op, **values)
    assert 0 <= word < 2**64 and word >> 60 == op.value
    decoded = decode(word)
    assert decoded.op is op and plain(decoded.fields) == plain(values)
    text = disassemble(word)
    assert assemble_line(text) == word
    assert disassemble(assemble_line(text)) == text
    # The Amaranth layout the RTL decodes with puts every field where encode() put it.
    assert layout(op).const({"opcode": op, **values}).as_bits() == word


@given(st.integers(0xE, 0xF), st.integers(0, 2**60 - 1))
def test_reserved_opcodes_are_rejected(opcode, body):
    with pytest.raises(DecodeError, match=rf"field 'opcode': {opcode:#x} is reserved") as e:
        decode(opcode << 60 | body)
    assert e.value.code is ErrorCode.BAD_OPCODE


@st.composite
def word_with_reserved_bits(draw):
    op = draw(st.sampled_from([op for op, fields in FORMATS.items() if any(f.reserved for f in fields)]))
    reserved = []
    pos = 60
    for f in FORMATS[op]:
        pos -= f.width
        if f.reserved:
            reserved.append((f, pos))
    f, pos = draw(st.sampled_from(reserved))
    bits = draw(st.integers(1, 2**f.width - 1))
    return op, draw(field_values(op)), f, pos, bits


@given(word_with_reserved_bits())
def test_reserved_bits_are_rejected_naming_the_field(case):
    op, values, f, pos, bits = case
    word = encode(op, **values) | bits << pos
    with pytest.raises(DecodeError, match=rf"reserved field '{f.name}' of {op.name} is {bits:#x}; it must be 0") as e:
        decode(word)
    assert e.value.code is ErrorCode.RESERVED_BITS


def test_undefined_codes_are_rejected_naming_the_field():
    word = encode(Opcode.VEC, func=0, dst=0, a=0, b=0, s=0, async_=0) | 31 << 55
    with pytest.raises(DecodeError, match=r"field 'func' of VEC: 0x1f is not a defined VecFunc") as e:
        decode(word)
    assert e.value.code is ErrorCode.BAD_FUNCTION
    word = encode(Opcode.MEMSET, cache=0, slot=0, a=0, b=0, c=0) | 3 << 58
    with pytest.raises(DecodeError, match=r"field 'cache' of MEMSET: 0x3 is not a defined ShapeCache"):
        decode(word)
    word = encode(Opcode.DMA, dir=0, region=0, l2=0, offset=0, async_=0) | 7 << 55
    with pytest.raises(DecodeError, match=r"field 'region' of DMA: 0x7 is not a defined DdrRegion"):
        decode(word)
    word = encode(Opcode.MEMCPY, from_device=1, to_device=0, dest=0, src=0, aux=0, shape_ptr=0, async_=0) | 1 << 58
    with pytest.raises(DecodeError, match=r"'from_device' and 'to_device' of MEMCPY are both 1"):
        decode(word)


@given(st.integers(2**10, 2**17 - 1))
def test_out_of_range_addresses_are_rejected_naming_the_field(addr):
    l2_words = 2**10
    word = encode(Opcode.CVO, func=CvoFunc.EXP, src=5, dst=addr, length=1, sub_emax=0, recip_scale=0, accm=0,
                  async_=0)
    with pytest.raises(DecodeError, match=rf"field 'dst' of CVO: address {addr:#x} is beyond L2 \(1024 words\)") as e:
        decode(word, l2_words=l2_words)
    assert e.value.code is ErrorCode.ADDRESS_RANGE
    with pytest.raises(ValueError, match=r"field 'dst' of CVO: address .* is beyond L2"):
        encode(Opcode.CVO, l2_words=l2_words, func=CvoFunc.EXP, src=5, dst=addr, length=1, sub_emax=0,
               recip_scale=0, accm=0, async_=0)


def test_not_a_word():
    with pytest.raises(DecodeError, match="64-bit unsigned integer"):
        decode(2**64)
    with pytest.raises(DecodeError, match="64-bit unsigned integer"):
        decode(-1)


@pytest.mark.parametrize("text, message", [
    ("frob dest=1", r"unknown mnemonic 'frob'"),
    ("cvo src=0 dst=0 length=1", r"cvo needs a function suffix"),
    ("cvo.frob src=0 dst=0 length=1", r"cvo has no function 'frob'"),
    ("gemv.exp dest=0", r"gemv takes no function suffix"),
    ("gemv dest=0x100 src=0 size_ptr=0 shape_ptr=0 lanes=15 colour=3", r"gemv has no field 'colour'"),
    ("gemv dest=0x100 src=0 size_ptr=0 shape_ptr=0", r"gemv needs field 'lanes'"),
    ("gemv dest=0x20000 src=0 size_ptr=0 shape_ptr=0 lanes=0", r"field 'dest' of GEMV is 17 bits wide; 131072"),
    ("gemv dest=zz src=0 size_ptr=0 shape_ptr=0 lanes=0", r"field 'dest' of gemv: 'zz' is not an integer"),
    ("gemv dest src=0 size_ptr=0 shape_ptr=0 lanes=0", r"field 'dest' of gemv needs a value"),
    ("dma.x", r"dma takes no function suffix"),
    ("dma dir=sideways region=const l2=0 offset=0", r"field 'dir' of dma: 'sideways' is not one of"),
    ("gemv dest=1 dest=2 src=0 size_ptr=0 shape_ptr=0 lanes=0", r"field 'dest' given twice"),
])
def test_assembler_errors(text, message):
    with pytest.raises(AsmError, match=message):
        assemble_line(text)


def test_program_errors_name_the_line():
    with pytest.raises(AsmError, match=r"line 3: unknown mnemonic 'nop'"):
        assemble("ctrl.nop imm=0\n# comment\nnop\n")
    assert assemble("ctrl.setvl imm=2048 ; comment\n\n  ctrl.halt imm=0") == [
        encode(Opcode.CTRL, func=1, imm=2048), encode(Opcode.CTRL, func=4, imm=0)]


def test_docs_field_tables_match_the_code():
    import re
    from pathlib import Path

    from hdl.isa import field_table

    doc = (Path(__file__).parent.parent / "docs" / "isa.md").read_text()
    for op in Opcode:
        m = re.search(rf"<!-- fields:{op.name} -->\n(.*?)\n<!-- /fields -->", doc, re.S)
        assert m, f"docs/isa.md has no field table for {op.name}"
        assert m.group(1) == field_table(op), f"docs/isa.md's {op.name} table is out of date"
