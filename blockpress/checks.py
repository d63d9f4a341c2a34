"""Checks of public-API arguments that need no torch, so that every module can share them (the tokenizer imports
no torch: a tokenizer-only tool should not load it)."""

from __future__ import annotations

from typing import Any


def check_flag(name: str, value: Any, none: bool = False) -> bool | None:
    """A boolean flag of the public API: True or False (or None where `none` allows it), never a truthy stand-in:
    "no" would read as True, and 1 or np.bool_ pass `in (True, False)`."""
    if not (isinstance(value, bool) or (none and value is None)):
        raise ValueError(f"{name}: expected True{', False or None' if none else ' or False'}, got {value!r}")
    return value
