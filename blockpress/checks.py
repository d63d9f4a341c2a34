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
