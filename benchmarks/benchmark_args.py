"""What the benchmark scripts share on their command lines: checked number types and the help layout."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from blockpress.cli.output import progress_bar
from blockpress.cli.parser import DefaultsFormatter
from blockpress.config import ModelConfig, preset_names
from blockpress.sampling import MAX_COUNT

progress = progress_bar  # the benchmarks' bars: a terminal's alone, on stderr

RANDOM_PREFIX = "random-"  # serve_load's --model also takes random-<preset>, as `blockpress serve` does


class Formatter(argparse.RawDescriptionHelpFormatter, DefaultsFormatter):
    """The module docstring as written, and each option's default after its help (as `blockpress --help`)."""


def fail(message: str, status: int = 2) -> NoReturn:
    """End the run with `PROG: error: MESSAGE` on stderr, PROG the script's file name, as argparse ends one whose
    flags it refuses: the checks made once the flags were read (a size past the context, weights that cannot fit)
    said their message bare, and a run's own failures named it otherwise. Status 2, argparse's, for the flags; 1 for
    a failure of the run itself (a measuring process's error, a server's refusal)."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    raise SystemExit(status)



def _int_at_least(least: int, what: str, most: int | None = None) -> Callable[[str], int]:
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    check.__name__ = what  # argparse names the type in some of its own messages
    return check


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


def int_between(least: int, most: int) -> Callable[[str], int]:
    """An integer in [least, most]: what a library call refuses past `most` was its traceback after the work before."""
    return _int_at_least(least, f"an integer in [{least}, {most}]", most)


step_count = int_between(1, MAX_COUNT)  # denoising steps, as the sampler takes them


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fewest seconds `run()` took in `repeats` runs: the run least disturbed by the machine's other work."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


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


def measure_in_child(cmd: list[str], what: str) -> dict[str, Any]:
    """Run a measuring process (`cmd`, printing its figures as JSON on its last stdout line) and return its figures.
    A child that fails ends this one with its own error, named `what` ("the loading process"); a CalledProcessError
    would hide it. A SIGTERM or SIGHUP to this process stops the child too, and ends with 128 + the signal: by
    default this one died and left the child measuring on, an orphan (a Ctrl-C reaches both from the terminal)."""
    from blockpress.stopping import stop_signals_interrupt, stop_status, stop_word

    try:
        with stop_signals_interrupt():  # as a KeyboardInterrupt: subprocess.run kills the child on its way out
            out = subprocess.run(cmd, capture_output=True, text=True)
    except KeyboardInterrupt as exc:
        print(f"{os.path.basename(sys.argv[0])}: {stop_word(exc)}", file=sys.stderr)
        raise SystemExit(stop_status(exc)) from None
    if out.returncode != 0:
        fail(f"{what} failed (exit status {out.returncode}):\n{out.stderr.strip()}", 1)
    return json.loads(out.stdout.strip().splitlines()[-1])
