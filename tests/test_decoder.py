"""The RTL instruction decoder reports, for every word, exactly the ErrorCode that `hdl.isa.decode` raises.

Words are seeded random encodings of every opcode (valid by construction, with random L2 addresses around
the configured size), the same words with random bits flipped (reserved fields, undefined codes, opcodes
0xD-0xF), and directed words per error kind. The software decoder is the independent reference: it is the
one the assembler, the ISS and the hypothesis round-trip tests already pin.
"""

import random

import numpy as np
import pytest
from amaranth.sim import Simulator

from hdl.decoder import Decoder
from hdl.isa import BODY_BITS, FORMATS, DecodeError, ErrorCode, Opcode, decode, encode

L2_WORDS = 4096        # the tiny preset's 64 KiB L2


def expected(word: int, l2_words: int) -> ErrorCode:
    try:
        decode(word, l2_words=l2_words)
    except DecodeError as e:
        return e.code
    return ErrorCode.NONE


def random_valid(rng: random.Random, op: Opcode, l2_words: int) -> int:
    values = {}
    for f in FORMATS[op]:
        if f.reserved:
            continue
        if f.kind is not None:
            values[f.name] = rng.choice(list(f.kind))
        elif f.l2_addr:
            values[f.name] = rng.randrange(l2_words)
        else:
            values[f.name] = rng.randrange(1 << f.width)
    if op is Opcode.MEMCPY and values["from_device"] and values["to_device"]:
        values["to_device"] = 0
    return encode(op, l2_words=l2_words, **values)


def corpus(seed: int, l2_words: int, n: int) -> list[int]:
    rng = random.Random(seed)
    words = []
    for _ in range(n):
        op = rng.choice(list(Opcode))
        w = random_valid(rng, op, l2_words)
        r = rng.random()
        if r < 0.35:
            for _ in range(rng.randint(1, 3)):
                w ^= 1 << rng.randrange(64)
        elif r < 0.45:     # an L2 address at or just beyond the end of L2
            pos = BODY_BITS
            fields = []
            for f in FORMATS[op]:
                pos -= f.width
                if f.l2_addr:
                    fields.append((f, pos))
            if fields:
                f, pos = rng.choice(fields)
                w &= ~(((1 << f.width) - 1) << pos)
                w |= rng.choice([l2_words - 1, l2_words, l2_words + 1, (1 << f.width) - 1]) << pos
        words.append(w)
    # directed: each reserved opcode, all-ones, all-zeros, MEMCPY host-to-host
    words += [c << BODY_BITS for c in range(max(op.value for op in Opcode) + 1, 0x10)] + [(1 << 64) - 1, 0]
    words.append(encode(Opcode.MEMCPY, from_device=1, to_device=0, dest=0, src=0, aux=0, shape_ptr=0, async_=0)
                 | 1 << (BODY_BITS - 2))
    return words


def rtl_decode(words: list[int], l2_words: int) -> list[int]:
    dut = Decoder(l2_words)
    out = []

    async def bench(ctx):
        for w in words:
            ctx.set(dut.i_word, w)
            out.append(ctx.get(dut.o_error).value)

    sim = Simulator(dut)
    sim.add_testbench(bench)
    sim.run()
    return out


@pytest.mark.parametrize("seed,l2_words", [(0, L2_WORDS), (1, 1 << 16), (2, 1 << 17)])
def test_rtl_decoder_equals_software_decoder(seed, l2_words):
    words = corpus(seed, l2_words, 2500)
    exp = [expected(w, l2_words).value for w in words]
    got = rtl_decode(words, l2_words)
    want = {ErrorCode.NONE, ErrorCode.BAD_OPCODE, ErrorCode.RESERVED_BITS, ErrorCode.BAD_FUNCTION}
    if l2_words < 1 << 17:                        # a 17-bit address cannot exceed a 2 MiB L2
        want.add(ErrorCode.ADDRESS_RANGE)
    assert set(exp) >= {e.value for e in want}, set(exp)     # the corpus exercises every check
    bad = [(hex(w), e, g) for w, e, g in zip(words, exp, got) if e != g]
    assert not bad, f"seed {seed}: {len(bad)} words differ, first (word, expected, rtl): {bad[:5]}"
    np.testing.assert_array_equal(np.array(got), np.array(exp))


def test_decoder_rejects_bad_size():
    with pytest.raises(ValueError, match="l2_words must be a positive integer"):
        Decoder(0)
