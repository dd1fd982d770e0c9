"""The SentencePiece tokenizer of a Gemma checkpoint (``tokenizer.model``), as a thin wrapper.

Gemma's BOS is 2 and EOS is 1, but the ids are read from the model file (``bos_id()``/``eos_id()``)
rather than written here, so a test tokenizer trained with other ids works too.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable

import sentencepiece

__all__ = ["Tokenizer"]

class Tokenizer:
    """Text ↔ token ids through a loaded ``sentencepiece.SentencePieceProcessor``.

    Use `Tokenizer.from_file` to load a ``tokenizer.model``.

    Members
    -------
    bos_id, eos_id : int
        Beginning- and end-of-sequence ids of the model (``-1`` if the model defines none).
    vocab_size : int
        Number of pieces; valid ids are ``0 .. vocab_size-1``.
    """

    def __init__(self, processor: sentencepiece.SentencePieceProcessor):
        if not isinstance(processor, sentencepiece.SentencePieceProcessor):
            raise TypeError(f"processor must be a sentencepiece.SentencePieceProcessor, not {processor!r}")
        self._sp = processor

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a SentencePiece model file; `FileNotFoundError` or `ValueError` name the path."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer model {path!r} does not exist or is not a file")
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.load(path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"tokenizer model {path!r} is not a valid SentencePiece model: {e}") from None
        return cls(sp)

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """The ids of `text`, preceded by BOS when `add_bos` (Gemma prompts start with BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {text!r}")
        ids = [int(i) for i in self._sp.encode(text, out_type=int)]
        if add_bos:
            if self.bos_id < 0:
                raise ValueError("add_bos=True, but the tokenizer model defines no BOS id")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; control pieces (BOS, EOS, padding) decode to nothing."""
        ids = [operator.index(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the tokenizer vocabulary [0, {self.vocab_size})")
        return self._sp.decode(ids)
