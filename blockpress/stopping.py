"""Stop signals: Ctrl-C (SIGINT), SIGTERM (`timeout`, docker stop, Slurm, systemd) and SIGHUP (the terminal closed:
an ssh session that dropped, without nohup or tmux). Torch-free, so the CLI can take them before a model loads.

`train` stops after its step and saves (train._StopOnInterrupt); the other commands that run a model take SIGTERM
and SIGHUP as they take a Ctrl-C (`stop_signals_interrupt`): the text, rows or turn so far are kept as after a
Ctrl-C, and the exit status is 128 + the signal, as a shell reports a process the signal ended.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

# SIGHUP where the platform has it (not Windows)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, raised where a Ctrl-C's KeyboardInterrupt would be: every `except KeyboardInterrupt`
    keeps what a Ctrl-C keeps. `signum` is the signal; `name` says it ("SIGTERM")."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


def stop_status(exc: BaseException | None = None) -> int:
    """The exit status of a run that `exc` stopped: 128 + its signal (130 for a Ctrl-C)."""
    return 128 + (exc.signum if isinstance(exc, Stopped) else signal.SIGINT)


def stop_word(exc: BaseException) -> str:
    """"interrupted" after a Ctrl-C, "stopped by SIGTERM" (or SIGHUP) after a Stopped: each command's message."""
    return f"stopped by {exc.name}" if isinstance(exc, Stopped) else "interrupted"


def fresh_line(stop: BaseException | int) -> str:
    """"\n" where a stop's first line would start on the "^C" its Ctrl-C left: stderr is a terminal that echoes
    control characters (ECHO and ECHOCTL, as a terminal is by default), and `stop` (the KeyboardInterrupt, or the
    signal number) is a SIGINT. "" otherwise: a SIGTERM or SIGHUP, or stderr a file or pipe, echoes nothing, and a
    newline there was a blank line. Where termios cannot say (Windows), a terminal gets the newline."""
    signum = stop.signum if isinstance(stop, Stopped) else stop if isinstance(stop, int) else signal.SIGINT
    stream = sys.stderr
    try:
        if signum != signal.SIGINT or stream is None or not stream.isatty():
            return ""
        fd = stream.fileno()
    except (OSError, ValueError):
        return ""
    try:
        import termios
    except ImportError:
        return "\n"
    try:
        lflag = termios.tcgetattr(fd)[3]
    except (termios.error, OSError, ValueError):
        return "\n"
    echoes = bool(lflag & termios.ECHO and lflag & getattr(termios, "ECHOCTL", 0))
    return "\n" if echoes else ""


def terminal_fds() -> list[int]:
    """stdout's and stderr's descriptors that are a terminal, found while it is up: once hung up, isatty says no."""
    out = []
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                out.append(fd)
        except OSError:
            pass
    return out


def leave_hung_up_terminal(fds: list[int]) -> None:
    """Point `fds`, stdout and stderr that were the closed terminal (terminal_fds), at /dev/null, as nohup would
    have: every write to a hung-up terminal fails (EIO), and the next one would end the run with that error instead
    of what its stop does. A file or pipe they were sent to stays (a log still gets the end of the run)."""
    for fd in fds:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fd)
            finally:  # (a failed dup2 kept it open: a descriptor leaked at each)
                os.close(null)
        except OSError:  # the descriptor is gone already: nothing more can be lost by writing to it
            pass


@contextmanager
def on_signals(signals: tuple[int, ...], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """While inside, `handler(signum, frame)` takes each of `signals`, a SIGHUP after pointing the closed terminal at
    /dev/null. Only the main thread can take signals: elsewhere, and for a signal the process ignores (`nohup`'s
    SIGHUP), nothing changes. The handlers found are put back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    terminal = terminal_fds()
    hangup = getattr(signal, "SIGHUP", None)

    def handle(signum: int, frame: Any) -> None:
        if signum == hangup:
            leave_hung_up_terminal(terminal)
        handler(signum, frame)

    previous = {sig: signal.signal(sig, handle) for sig in signals if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, was in previous.items():
            if was is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(sig, was)


@contextmanager
def interrupts_deferred(signals: tuple[int, ...] = (signal.SIGINT,)) -> Iterator[None]:
    """While inside, a Ctrl-C (SIGINT; each of `signals`) waits, and is delivered as the block ends: for work that
    must be all or nothing and cannot be undone cheaply (an in-place cast of every weight, which an interrupt part-way
    left half cast: every later pass failed in torch, and a second cast to the dtype the model claimed did nothing)."""
    first: dict[int, Any] = {}  # each signal caught, with the frame it first came in
    try:
        with on_signals(signals, lambda signum, frame: first.setdefault(signum, frame)):
            yield
    finally:
        # Each signal caught, once, a Ctrl-C last: only the first is delivered, and a SIGTERM after a Ctrl-C would be
        # lost where the Ctrl-C's KeyboardInterrupt was caught (a REPL goes on) or its handler raised first
        for signum in sorted(first, key=lambda s: s == signal.SIGINT):
            handler = signal.getsignal(signum)
            if callable(handler):
                # to the handler found (Python's KeyboardInterrupt, an app's own), called as the signal would have:
                # not the signal raised again, which a loop's wakeup fd (asyncio's add_signal_handler) has already
                # been told of while it waited, so its callback would run twice (a second Ctrl-C: "force exit" to some
                # servers)
                handler(int(signum), first[signum])  # (a plain int, as a signal's delivery passes it)
            else:  # the default action (SIG_DFL), which only the signal itself takes
                signal.raise_signal(signum)


def stop_signals_interrupt() -> AbstractContextManager[None]:
    """While inside, a SIGTERM or SIGHUP raises Stopped (a KeyboardInterrupt) in the main thread, as a Ctrl-C raises
    KeyboardInterrupt: they killed the process where it stood, so `timeout 60 blockpress generate --json` printed
    nothing where a Ctrl-C prints the text so far, the live view was left mid-draft without its line ended, and
    `bench`'s rows were lost."""
    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    return on_signals(tuple(sig for sig in STOP_SIGNALS if sig != signal.SIGINT), stop)
