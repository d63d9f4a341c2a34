"""Checks of public-API arguments that need no torch, so that every module can share them (the tokenizer imports
no torch: a tokenizer-only tool should not load it)."""

from __future__ import annotations

import math
import numbers
from typing import Any


def check_flag(name: str, value: Any, none: bool = False) -> bool | None:
    """A boolean flag of the public API: True or False (or None where `none` allows it), never a truthy stand-in:
    "no" would read as True, and 1 or np.bool_ pass `in (True, False)`."""
    if not (isinstance(value, bool) or (none and value is None)):
        raise ValueError(f"{name}: expected True{', False or None' if none else ' or False'}, got {value!r}")
    return value


def is_finite_number(value: Any) -> bool:
    """A real, finite number (numpy's included): not a string from a JSON file, not a bool, not inf or NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: Any) -> bool:
    """An integer (numpy's included: np.int64 from an array's arithmetic) that is not a bool (True would pass
    for 1). Callers keep int(value): a numpy integer overflows silently and is not JSON."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def utf8_problem(text: str) -> str | None:
    """What keeps `text` from being UTF-8, or None. Python holds such text with lone surrogates: a byte that was
    not UTF-8 on a command line or stdin ("byte 0xff at character 3", U+DC80..U+DCFF), or half of a UTF-16 pair
    cut apart, which JSON can write ("\\ud800": "lone surrogate U+D800 at character 3")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if 0xDC80 <= code <= 0xDCFF:
            return f"byte 0x{code - 0xDC00:02x} at character {exc.start}"
        return f"lone surrogate U+{code:04X} at character {exc.start}"
    return None


def check_text(text: Any, name: str) -> str:
    """`text` if it is a str that UTF-8 can encode (what a tokenizer takes, and what generated text always is),
    else a ValueError naming `name` and the first character that cannot be."""
    if not isinstance(text, str):
        raise ValueError(f"{name}: expected a str, got {type(text).__name__}")
    problem = utf8_problem(text)
    if problem is not None:
        raise ValueError(f"{name}: not valid UTF-8 ({problem})")
    return text
