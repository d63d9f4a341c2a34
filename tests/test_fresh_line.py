"""Where a stop's message starts on a terminal: after the "^C" its Ctrl-C drew, or where the cursor is."""

import os
import signal
import sys

import pytest

termios = pytest.importorskip("termios")
from blockpress.stopping import Stopped, fresh_line  # noqa: E402


@pytest.mark.skipif(not hasattr(os, "openpty") or not hasattr(termios, "ECHOCTL"), reason="needs a pty with ECHOCTL")
@pytest.mark.parametrize("drop, want", [(0, "\n"), ("ECHOCTL", ""), ("ECHO", "")])
def test_fresh_line_follows_the_terminals_echo_of_control_characters(monkeypatch, drop, want):
    """A terminal set `stty -echoctl` (or -echo) draws no "^C"
    on Ctrl-C, so the stop message must start where the cursor is: a "\\n" there is a blank line. fresh_line's
    docstring promises "" there; no test had the terminal echo differently from a new pty's default."""
    main_fd, terminal_fd = os.openpty()
    stream = os.fdopen(terminal_fd, "w")
    try:
        attrs = termios.tcgetattr(terminal_fd)
        attrs[3] |= termios.ECHO | termios.ECHOCTL
        if drop:
            attrs[3] &= ~getattr(termios, drop)
        termios.tcsetattr(terminal_fd, termios.TCSANOW, attrs)
        monkeypatch.setattr(sys, "stderr", stream)
        assert fresh_line(KeyboardInterrupt()) == want
        assert fresh_line(int(signal.SIGINT)) == want
        assert fresh_line(Stopped(signal.SIGTERM)) == ""  # a SIGTERM echoes nothing, whatever the terminal does
    finally:
        stream.close()
        os.close(main_fd)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_hung_up_terminal_that_cannot_be_replaced_leaks_no_descriptor():
    """leave_hung_up_terminal opens /dev/null to put in each descriptor's place: where dup2 failed, it stayed open."""
    from blockpress.stopping import leave_hung_up_terminal

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        leave_hung_up_terminal([-1])  # (no descriptor: dup2 fails with EBADF)
    assert len(os.listdir("/proc/self/fd")) == before
