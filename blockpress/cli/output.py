"""Standard output and standard error for the commands: stdout guarded (a failed write said as such), read and
written as UTF-8, warnings as `warning:` lines, and what a run that ran out of memory says."""

from __future__ import annotations

import codecs
import errno
import io
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any


def progress_bar(items: Iterable[Any] | None = None, *, hidden: bool = False, **options: Any) -> Any:
    """tqdm's bar (over `items`, or updated by hand) on stderr, which stdout's JSON or answers never share, drawn on a
    terminal alone (disable=None): on a pipe or a log file (CI, nohup) its redraws, up to 10 a second, filled the log
    with carriage returns. Cleared when done. `hidden`, or no stderr (pythonw, a service): none drawn."""
    from tqdm import tqdm

    return tqdm(items, file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=True if hidden or sys.stderr is None else None, **options)

class OutputError(Exception):
    """A write to standard output failed for a reason other than its reader going away (a full disk, `> /dev/full`,
    a descriptor the shell closed, `>&-`): the command's output is lost, and the run ends saying so (exit 1)."""


class GuardedStdout(io.RawIOBase):
    """Descriptor 1 under the command's sys.stdout (guard_stdout), its failures raised as OutputError: as plain
    OSErrors, a full disk would end in "error: [Errno 28] No space left on device", status 2 (a bad argument's) or,
    once the interpreter's last flush meets it, 120 and "Exception ignored ... OSError", never saying that standard
    output is what failed. After one failure the rest is dropped, so the run's end cannot fail again. `fd` None: no
    standard output at all (`>&-`), where Python's sys.stdout is None, on which generate would fail (None.isatty()) and
    info would print nothing with status 0. A reader gone away stays a BrokenPipeError (141, quietly)."""

    def __init__(self, fd: int | None):
        super().__init__()
        self.fd, self.failed = fd, False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        if self.fd is None:
            raise io.UnsupportedOperation("standard output is closed")
        return self.fd

    def isatty(self) -> bool:
        return self.fd is not None and os.isatty(self.fd)

    def write(self, data: Any) -> int:
        size = len(memoryview(data))
        if self.failed:
            return size
        try:
            if self.fd is None:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            return os.write(self.fd, data)
        except (BrokenPipeError, BlockingIOError):
            raise
        except OSError as exc:
            self.failed = True
            raise OutputError(exc.strerror or str(exc)) from None


def guard_stdout() -> Any:
    """Point sys.stdout at a GuardedStdout on descriptor 1, with the encoding, error handler and buffering Python
    gave it; returns the stream it replaced (to put back), or False where it was left as it is: a caller's own
    stream (a test's capture) and a Windows console, whose stream is not a plain descriptor."""
    old = sys.stdout
    if old is not None and old is not sys.__stdout__:
        return False
    fd = None
    if old is not None:
        try:
            fd = old.fileno()
            old.flush()
        except (OSError, ValueError):
            return False
        if sys.platform == "win32" and old.isatty():
            return False
    raw = GuardedStdout(fd)
    # PYTHONUNBUFFERED (-u) gives stdout no buffer under its text layer: kept so
    unbuffered = old is not None and not isinstance(getattr(old, "buffer", None), io.BufferedIOBase)
    sys.stdout = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                  encoding=getattr(old, "encoding", None) or "utf-8",
                                  errors=getattr(old, "errors", None) or "strict",
                                  newline=None if sys.platform == "win32" else "\n",
                                  line_buffering=getattr(old, "line_buffering", False),
                                  write_through=unbuffered or getattr(old, "write_through", False))
    return old


def silence_output() -> None:
    """Point stdout and stderr at the null device: after a broken pipe, any later write (the interpreter's last
    flush, an error line) would hit it again and end in a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a stream without a file descriptor (a test's capture) has nothing to flush there
            pass
    os.close(devnull)


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:
    """warnings.showwarning for the command line: `warning: MESSAGE` on stderr, as its errors are lines of their
    own (Python's form names a file and line of blockpress and prints that line of its source)."""
    stream = sys.stderr if file is None else file
    if stream is not None:  # no console at all (pythonw): nowhere to say it
        print(f"warning: {message}", file=stream)


def print_warning(message: str) -> None:
    """A command's own warning (a flag that cannot act as given, a file left out): the line show_warning gives the
    library's, so a script that looks for `warning:` on stderr finds every one."""
    show_warning(message, UserWarning, __file__, 0)


def is_utf8(stream: Any) -> bool:
    """Whether text stream `stream` encodes as UTF-8 (a stream without an encoding, a test's capture, counts)."""
    encoding = getattr(stream, "encoding", None)
    return not encoding or codecs.lookup(encoding).name in ("utf-8", "utf-8-sig")


def utf8_stdio() -> Callable[[], None]:
    """Standard output written, and standard input read, as UTF-8 when they are a file or pipe: the encoding every
    file blockpress reads and writes has. Python gives them the locale's, which on Windows is an ANSI code page
    (cp1252): `generate ... > out.txt` would end in "'charmap' codec can't encode character" after the whole
    generation for any text outside it (CJK, emoji, "✓"), and a piped UTF-8 prompt would be read as mojibake
    ("grüße" as "grÃ¼ÃŸe"), silently. Stdin keeps surrogateescape, so bytes that are not UTF-8 reach the prompt checks,
    which name them. Piped text's line endings are read as Python reads them on Windows: CRLF (or a CR alone) as
    "\n" (on Linux and macOS the CRs would stay: a prompt file saved on Windows would prompt the model with "\r\n",
    other tokens and another answer than the same text's). A terminal keeps its own encoding (a Windows console is UTF-8
    already); one that cannot show a character gets "?" rather than the error. A path whose bytes are not UTF-8 (Python
holds them as surrogates) goes to a stdout file or pipe as those bytes, to a terminal as "?". A terminal said to be ASCII
    (PYTHONIOENCODING=ascii, an ASCII locale) is read as UTF-8, ASCII's superset and what terminals send: typed
    "grüße" would otherwise end `generate -` with "'ascii' codec can't decode byte 0xc3", and chat would refuse it as
    "not valid UTF-8", which it is."""
    stdin = sys.stdin
    restore = stdio_restorer()
    for out in (sys.stdout, sys.stderr):  # (stderr: the progress lines and stats; its default backslashreplace wrote
        # "…" as the six characters "\u2026", which wrapped a line cut to one row, and its erase left the first row)
        if out is not None and hasattr(out, "reconfigure") and not is_utf8(out):
            if out.isatty():
                out.reconfigure(errors="replace")
            elif out is sys.stderr:  # an error naming a path of undecodable bytes (surrogates) is still written
                out.reconfigure(encoding="utf-8", errors="backslashreplace")
            else:  # such a path printed as its own bytes, as `ls > file` writes it
                out.reconfigure(encoding="utf-8", errors="surrogateescape")
        elif out is sys.stdout and out is not None and hasattr(out, "reconfigure") and \
                getattr(out, "errors", None) != ("replace" if out.isatty() else "surrogateescape"):
            # UTF-8 already: strict (en_US.UTF-8 and every other UTF-8 locale but C.UTF-8), where a path of bytes that
            # are not UTF-8 (b"mod\xe8le", held as the surrogate "\udce8") failed `info` and `quantize` after their
            # work (quantize's folder written) with "surrogates not allowed", naming no flag; or surrogateescape
            # (C.UTF-8, PYTHONUTF8=1), which sent a terminal raw bytes (0x9b is a CSI, a control sequence). A file or
            # pipe gets the path's own bytes, as `ls` writes them; a terminal "?", as for any character it cannot show.
            out.reconfigure(errors="replace" if out.isatty() else "surrogateescape")
    if stdin is None or not hasattr(stdin, "reconfigure"):
        return restore
    try:
        if not stdin.isatty():  # a BOM (Notepad's, PowerShell's) is no part of the prompt, under a UTF-8 locale too
            # (the line endings of Python's own stdin alone: a program's own wrapper, main() called in-process, keeps
            # its newline setting, which cannot be read back to restore)
            stdin.reconfigure(encoding="utf-8-sig", errors="surrogateescape",
                              **({"newline": None} if stdin is sys.__stdin__ else {}))
        elif stdin.encoding and codecs.lookup(stdin.encoding).name == "ascii":
            stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
    except (OSError, ValueError):  # read from already (an embedding caller): the encoding can no longer change
        pass
    return restore


def stdio_restorer() -> Callable[[], None]:
    """What puts the standard streams' encoding, errors and (stdin's) line endings back as they are now: main() called
    in a program's own process (a notebook, a test, a tool embedding the CLI) must leave that program's streams as it
    had them, not writing surrogates as raw bytes or reading a BOM away for the rest of its life. A stream the
    command read from (chat's piped stdin) cannot be changed back: Python refuses once it has decoded text buffered,
    and it keeps the command's decoding."""
    saved = [(stream, stream.encoding, stream.errors) for stream in (sys.stdin, sys.stdout, sys.stderr)
             if stream is not None and hasattr(stream, "reconfigure")]

    def restore() -> None:
        for stream, encoding, errors in saved:
            if (stream.encoding, stream.errors) == (encoding, errors):
                continue
            # stdin's line endings: Python's own (TextIOWrapper shows no newline setting to read back), "\n" but on
            # Windows, where it reads CRLF as "\n" already; only the stdin whose encoding utf8_stdio changed was moved
            newline = {"newline": None if os.name == "nt" else "\n"} if stream is sys.__stdin__ else {}
            try:
                stream.reconfigure(encoding=encoding, errors=errors, **newline)
            except (OSError, ValueError):  # read from since (chat): its encoding can no longer change back
                try:
                    stream.reconfigure(errors=errors)
                except (OSError, ValueError):
                    pass

    return restore


def output_failed(exc: BrokenPipeError | OutputError, who: str) -> int:
    """The status of a run whose standard output failed: its reader gone away (`| head`: quietly, 128 + SIGPIPE, as
    Unix tools stop), or a write that failed (GuardedStdout: said under `who`, a runtime error's 1)."""
    if isinstance(exc, BrokenPipeError):
        silence_output()
        return 141
    print(f"{who}: error: cannot write to standard output: {exc}", file=sys.stderr)
    return 1


# What uses the memory a command ran out of, and the flags that take less (each command's own).
OOM_HINTS = {
    "generate": "a smaller --max-new-tokens or --prefill-chunk, fewer prompts at once, or --quantize int8 / fp8 "
                "take less",
    "chat": "a smaller --max-new-tokens or --prefill-chunk, or --quantize int8 / fp8 take less",
    # sudoku's canvas is always 81 cells after an 83-token prompt: its memory is the batch, a row per puzzle and view
    "sudoku": "a smaller --batch-size (puzzles at once), a smaller --ensemble (each view is a row of the batch), or "
              "--quantize int8 / fp8 take less",
    "infill": "smaller holes, a smaller --prefill-chunk, or --quantize int8 / fp8 take less",
    # (the rows measured before it: cmd_bench says where, on stdout and in --out when one was given)
    "bench": "smaller --batch-sizes or --new-tokens take less",
    "train": "a smaller --micro-batch-size takes less (gradient accumulation keeps --batch-size); so does "
             "--max-canvases",
}


def out_of_memory_message(exc: BaseException, command: str, before_hint: str = "") -> str:
    """"the device ran out of memory (torch's first line); ..." with what takes less for `command` (OOM_HINTS)."""
    reason = (str(exc).splitlines() or [""])[0] or type(exc).__name__  # (Python's MemoryError() says nothing)
    hint = OOM_HINTS.get(command, "a smaller model, --dtype bfloat16, or --quantize")
    return f"the device ran out of memory ({reason}); {before_hint}{hint}"


def compile_failed(exc: BaseException) -> bool:
    """torch.compile's own error (dynamo's, inductor's wrapped in it: no C++ compiler, say), checked without
    importing torch's compiler for a run that never compiled."""
    errors = sys.modules.get("torch._dynamo.exc")
    return errors is not None and isinstance(exc, errors.TorchDynamoException)


def release_device_memory() -> None:
    """Hand the blocks torch's caching allocator holds back to the GPU after an out-of-memory error, so the next
    try (a shorter reply, another request) starts from what is really in use."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if torch is not None and torch.backends.mps.is_available():  # (MPS's out of memory is answered too: checks.py)
        torch.mps.empty_cache()


