"""Bounds every size and setting accepts, and how an integer is written in an error message.

Shared by the model spec, its Hugging Face reader and the training settings (split out of
``model.py`` so that the family table, which ``model.py`` reads, can use them too).
"""

from __future__ import annotations

import re

__all__ = ["MAX_COUNT", "STRICT_INT", "describe_int", "parse_strict_int"]

MAX_COUNT = 2**31 - 1
"""Largest integer a size or setting accepts (layers, widths, vocabulary, batch, ranks...): far
beyond any real model or run, and it keeps every product of sizes exact and finite in float64."""


def describe_int(value: int) -> str:
    """An int for an error message, without converting a huge one to float or to thousands of
    digits (``int.__str__`` refuses more than 4300)."""
    if value.bit_length() <= 64:
        return str(value)
    return f"a number of about 10^{int(value.bit_length() * 0.30103)}"


STRICT_INT = re.compile(r"[+-]?[0-9]{1,30}")
"""An integer as text: base-10 digits only, at most 30 of them (``int()`` would also take
``1_000`` and thousands of digits)."""


def parse_strict_int(text: str) -> int:
    """``int(text)`` for text that matches :data:`STRICT_INT`."""
    return int(text.strip())
