"""Reading what a test's output drew on a pseudo-terminal."""

import os
import select


def read_terminal(fd: int, wait: float) -> str:
    """What the terminal whose main side is `fd` shows: all it passes on within `wait` seconds, then until it has
    been quiet for 0.2 s. One os.read returned whatever the tty layer had passed on by then: under load (the whole
    suite on every core) that was a run's first line alone ("loading blockpress-sudoku ..."), its bar still to come."""
    shown, timeout = b"", wait
    while select.select([fd], [], [], timeout)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # (the other side closed)
            break
        if not chunk:
            break
        shown, timeout = shown + chunk, 0.2
    return shown.decode()
