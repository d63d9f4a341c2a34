"""What the benchmark scripts share on their command lines: checked number types and the help layout."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from blockpress.cli import DefaultsFormatter
from blockpress.config import ModelConfig, preset_names

RANDOM_PREFIX = "random-"  # serve_load's --model also takes random-<preset>, as `blockpress serve` does


class Formatter(argparse.RawDescriptionHelpFormatter, DefaultsFormatter):
    """The module docstring as written, and each option's default after its help (as `blockpress --help`)."""


def _int_at_least(least: int, what: str) -> Callable[[str], int]:
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    check.__name__ = what  # argparse names the type in some of its own messages
    return check


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


def preset_name(text: str) -> str:
    """A random checkpoint shape ModelConfig.preset knows: an unknown --preset was its traceback, after parsing."""
    try:
        ModelConfig.preset(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("preset: ")) from None
    return text


def preset_weights_that_cannot_fit(preset: str, dtype: str = "float32", flags: str = "--preset") -> str | None:
    """Why `preset`'s random weights in `dtype` cannot fit in this machine's memory, naming `flags`, or None: found
    before the model is built (it was random_model's traceback, `--preset 26b-a4b`)."""
    import torch

    import blockpress
    from blockpress.checkpoint import available_bytes

    free = available_bytes(torch.device("cpu"))
    needed = blockpress.random_model(ModelConfig.preset(preset), dtype=dtype, device="meta").weights_bytes()
    if free is None or needed <= free:
        return None
    return (f"{flags}: {preset} in {dtype} needs {needed / 1e9:.1f} GB of weights but {free / 1e9:.1f} GB are "
            f"available; a smaller {' or '.join(flags.split('/'))}")


PRESET_HELP = f"random checkpoint shape: {', '.join(preset_names())}"  # every name preset_name takes


def checkpoint(text: str) -> str:
    """A model `blockpress.load` can read: a shipped name, a checkpoint folder (its config.json read, not its weights)
    or an adapter folder over one. A typo or a folder that is no checkpoint was an 18-line traceback once the script
    started loading; now argparse's one line names the flag, before any work."""
    from blockpress.lm import resolve_model

    try:
        path = resolve_model(text)[0]
        ModelConfig.from_file(path / "config.json")
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def checkpoint_or_none(text: str) -> str:
    """`checkpoint`, or '' (none: the script skips what needs it)."""
    return text and checkpoint(text)


def checkpoint_or_random(text: str) -> str:
    """`checkpoint`, or random-<preset> (random weights of a preset's shape, as `blockpress serve --model` takes)."""
    if text.startswith(RANDOM_PREFIX):
        preset_name(text[len(RANDOM_PREFIX):])
        return text
    return checkpoint(text)
