"""What the scripts' JSON flags share: the text read as JSON, or argparse's one usage line naming the flag (exit 2)
before any model loads, rather than a JSONDecodeError or TypeError traceback after it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from blockpress.cli.output import progress_bar

progress = progress_bar  # the scripts' bars: a terminal's alone, on stderr


def json_flag(ap: argparse.ArgumentParser, flag: str, text: str, expected: str) -> Any:
    """`text` of `flag` as JSON of the `expected` kind: "object" (a dict) or "objects" (a non-empty list of dicts)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        ap.error(f"{flag}: not JSON ({exc})")
    if expected == "object" and not isinstance(value, dict):
        ap.error(f"{flag}: expected a JSON object, got {text!r}")
    if expected == "objects" and not (isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
        ap.error(f"{flag}: expected a JSON list of objects (settings), got {text!r}")
    return value

