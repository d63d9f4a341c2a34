"""Checks of public-API arguments that need no torch, so that every module can share them (the tokenizer imports
no torch: a tokenizer-only tool should not load it)."""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, TypeVar

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # blockpress/, for warn_user


# The allocators that say "out of memory" with a plain RuntimeError, not torch.OutOfMemoryError: the CPU's
# (c10/core/impl/alloc_cpu.cpp), posix_memalign's text on Linux and macOS and _aligned_malloc's on Windows (and
# Android), and MPS's (aten/src/ATen/mps/MPSAllocator.mm). Windows' alone went unmatched: a traceback, a chat ended.
ALLOCATOR_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
                      "MPS backend out of memory")


def allocation_failed(exc: BaseException) -> bool:
    """Whether `exc` is a device's refusal to allocate: torch's OutOfMemoryError (a CUDA GPU's), an allocator's
    RuntimeError (the CPU's, MPS's: ALLOCATOR_FAILURES), or Python's MemoryError. Without importing torch (the CLI
    asks it of any command's error, and most never import torch)."""
    torch = sys.modules.get("torch")
    return isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and any(text in str(exc) for text in ALLOCATOR_FAILURES))


def check_flag(name: str, value: Any, none: bool = False) -> bool | None:
    """A boolean flag of the public API: True or False (or None where `none` allows it), never a truthy stand-in:
    "no" would read as True, and 1 or np.bool_ pass `in (True, False)`."""
    if not (isinstance(value, bool) or (none and value is None)):
        raise ValueError(f"{name}: expected True{', False or None' if none else ' or False'}, got {value!r}")
    return value


def is_finite_number(value: Any) -> bool:
    """A real, finite number (numpy's included): not a string from a JSON file, not a bool, not inf or NaN, nor an
    integer past a float's range (10**400 from a JSON file: math.isfinite raised a bare OverflowError)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_int(value: Any) -> bool:
    """An integer (numpy's included: np.int64 from an array's arithmetic) that is not a bool (True would pass
    for 1). Callers keep int(value): a numpy integer overflows silently and is not JSON."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def plain_number(value: Any) -> Any:
    """An integer (is_int) as a Python int and any other finite number (is_finite_number) as a Python float, for a
    setting that is kept: np.float32(1e-4) is not JSON (a run's train_config.json and metrics rows), and a numpy
    integer's arithmetic wraps. Anything else (a bool, a string, inf) as it is, for the caller's check to refuse."""
    if is_int(value):
        return int(value)
    return float(value) if is_finite_number(value) else value


def check_positive_int(value: Any, name: str) -> None:
    """A count of the public API (max_new_tokens, num_return_sequences): an integer (is_int) above 0, else a
    ValueError naming `name`."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


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


def check_keywords(call: str, given: Iterable[str], options: Iterable[str], settings: Iterable[str] = (),
                   hints: dict[str, str] | None = None) -> None:
    """Refuse a keyword that `call` does not take, with one error for every entry point: it names the keyword,
    suggests the closest one `call` takes (a typo: max_new_token), and lists them all, `call`'s own `options`
    first, then the sampler `settings` it passes on. `hints`: a word more for a keyword that another API takes
    (temperature, say). A ValueError, as every other bad argument is: not Python's TypeError, which an app that
    catches ValueError for bad user parameters would miss."""
    options = list(options)
    settings = [s for s in settings if s not in options]
    unknown = sorted(set(given) - set(options) - set(settings))
    if not unknown:
        return
    name = unknown[0]
    # A hint's word, or a typo of it (temprature), gets the hint, which names what to use; any other the keyword
    # closest to it (cutoff 0.7: "streamer" is not a typo of "sampler")
    hinted = difflib.get_close_matches(name, list(hints or ()), n=1, cutoff=0.8)
    close = [] if hinted else difflib.get_close_matches(name, options + settings, n=1, cutoff=0.7)
    guess = f" (did you mean {close[0]}?)" if close else ""
    hint = f"; {hints[hinted[0]]}" if hints and hinted else ""
    takes = ", and ".join(([", ".join(options)] if options else [])
                          + ([f"the sampler settings {', '.join(settings)}"] if settings else []))
    raise ValueError(f"{name}: {call} takes no such keyword{guess}{hint}; it takes {takes}")


F = TypeVar("F", bound=Callable[..., Any])


def outside_inference_mode(fn: F) -> F:
    """`fn` run with torch.inference_mode off even when called under it, for calls whose tensors outlive them (a
    model's weights, a cache): a parameter made under it could not be quantized or trained later ("Inference tensors
    do not track version counter"), and a cache made under it refused writes outside it. torch's own decorator
    would put a frame of torch's between a caller and blockpress's code, which warn_user would name as the caller."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        import torch  # (this module imports no torch: the CLI's parser uses it)

        with torch.inference_mode(False):
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


def warn_user(message: str) -> None:
    """warnings.warn(message) attributed to the first caller outside blockpress: a fixed stacklevel named
    blockpress's own line whenever a path was longer than the one it was counted for (blockpress.load(quantize=
    "int4") reaches the int4 warning through plan_model and quantize), and a warning shows the line it names (and
    is shown once per line, by the default filter). With no caller outside (the CLI), the line that warned."""
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=2 if frame is None else level)


def compile_failure(err: BaseException, name: str = "--compile") -> ValueError:
    """A torch.compile failure (no C++ compiler: a Windows install without MSVC's cl, a slim container) in one line
    under `name`, with torch's first line: torch's trace is a page long. `bench` and the decoding commands say it."""
    why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    return ValueError(f"{name}: torch.compile could not compile blockpress's steps ({why}); run without --compile "
                      "(set TORCHDYNAMO_VERBOSE=1 for torch's trace)")


_T = TypeVar("_T")


def weak_members(live: weakref.WeakSet[_T]) -> list[_T]:
    """The members of `live` now, for an exit hook to close (the open streams, the live engines): copied again where
    another thread adds one meanwhile ("Set changed size during iteration"), none after three tries."""
    for _ in range(3):
        try:
            return list(live)
        except RuntimeError:
            continue
    return []
