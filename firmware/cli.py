"""Argument types shared by the command lines (``python -m firmware.generate``, ``.perf``, ``.traffic``,
``.accuracy``, ``.compiler``, ``.pack``, ``tb.npu``): each converts, checks and reports one line,
``must be <requirement>, not '<text>'``, which argparse prints with the option's name and exit status 2."""

from __future__ import annotations

import argparse

__all__ = ["arg_type", "POSITIVE", "NON_NEGATIVE"]


def arg_type(requirement: str, convert, check, name: str | None = None):
    """An argparse ``type=``: ``convert(text)``, then ``check(value)``; either failing is ``must be
    <requirement>, not '<text>'``. `name` (default: the requirement) is what argparse calls the type."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {requirement}, not {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, not {text!r}")
        return value
    parse.__name__ = name or requirement
    return parse


POSITIVE = arg_type("a positive integer", int, lambda v: v >= 1)
NON_NEGATIVE = arg_type("an integer >= 0", int, lambda v: v >= 0)
