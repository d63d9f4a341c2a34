"""The live view of `blockpress generate` on a terminal: the canvas redrawn as it settles.

Changing tokens are dim, settled ones bright, committed text plain. The view redraws one region, the prompt's last
line and everything after it, by moving the cursor up over the rows it drew last time. (A saved cursor position,
ESC 7 / ESC[s, does not survive the screen scrolling: each redraw then began lower and left a copy behind.) While
live, the region is cut to the screen's height, since rows scrolled off cannot be redrawn; the final text is
written whole.
"""

from __future__ import annotations

import codecs
import os
import shutil
import sys
import unicodedata
from collections.abc import Mapping
from typing import Any, TextIO

from .healing import strip_prefix

SETTLED, CHANGING, ELIDED, RESET = "\x1b[1;32m", "\x1b[2;33m", "\x1b[2m", "\x1b[0m"
# Control characters in model output would move the cursor or, an escape sequence, change the terminal's state
# (colours, the screen, the title): drawn as U+FFFD (tab and newline stay). C1 controls too: some terminals obey them.
_CONTROLS = {c: "\ufffd" for c in (*range(32), 127, *range(0x80, 0xA0)) if c not in (9, 10)}

Piece = tuple[str, str]  # (text, style); style "" is plain


def terminal_text(text: str) -> str:
    """Model output as it may be written to a terminal: control characters as U+FFFD, "\\r\\n" as the newline it
    shows as (a model can write any token, and a random or small one does: an escape sequence left the terminal
    coloured or cleared). Text written anywhere else (a pipe, --json) is the model's, unchanged."""
    return text.replace("\r\n", "\n").translate(_CONTROLS)


def as_sent(text: str, stream: TextIO) -> str:
    """`text` as `stream` sends it to the terminal: a character its encoding cannot hold as "?" (cli/output.py's
    utf8_stdio has a terminal that is not UTF-8 replace it). The view counts the rows of this: counted as the two
    cells a CJK character takes, the one-cell "?" drawn in its place made each redraw move the cursor above the
    region and erase the lines before it (PYTHONIOENCODING=ascii, a latin-1 or cp1252 terminal)."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        if codecs.lookup(encoding).name == "utf-8":
            return text
    except LookupError:
        return text
    return text.encode(encoding, errors="replace").decode(encoding, errors="replace")


def live_terminal(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """A terminal that can take cursor movement: a tty whose TERM is not "dumb", and on Windows a console whose
    VT processing is on or could be turned on (a console left without it, as conhost gives cmd.exe and PowerShell
    on Windows 10 unless asked, prints escape sequences as text: every redraw as "←[2A←[J..." lines)."""
    if env is None:
        env = os.environ
    if not stream.isatty() or env.get("TERM", "") == "dumb":
        return False
    return sys.platform != "win32" or windows_vt_mode(stream)


ENABLE_VIRTUAL_TERMINAL_PROCESSING = 0x0004


def windows_vt_mode(stream: TextIO) -> bool:
    """Windows: whether `stream`'s console takes escape sequences, turning its VT processing on if it can (Windows
    Terminal has it on; conhost takes it from Windows 10 1511 when asked). False on any failure: no live view."""
    try:
        import ctypes
        import msvcrt

        kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
        handle = msvcrt.get_osfhandle(stream.fileno())  # type: ignore[attr-defined]
        mode = ctypes.c_uint32()
        if not kernel32.GetConsoleMode(handle, ctypes.byref(mode)):
            return False
        if mode.value & ENABLE_VIRTUAL_TERMINAL_PROCESSING:
            return True
        return bool(kernel32.SetConsoleMode(handle, mode.value | ENABLE_VIRTUAL_TERMINAL_PROCESSING))
    except (ImportError, AttributeError, OSError, ValueError):  # not Windows, or a stream without a console handle
        return False


# A format character (Cf) that terminals draw one cell wide (wcwidth 1): counted as none, every redraw of a line
# holding it would fall a row short and leave a copy of the line behind
SOFT_HYPHEN = "\u00ad"


def display_width(text: str) -> int:
    """Terminal cells `text` takes: wide East Asian characters two, combining marks none, tabs to the next stop."""
    width = 0
    for ch in text:
        if ch == "\t":
            width += 8 - width % 8
        elif (unicodedata.combining(ch) or unicodedata.category(ch) in ("Cf", "Mn", "Me")) and ch != SOFT_HYPHEN:
            continue  # combining marks, zero-width spaces and joiners, variation selectors: no cell
        else:
            width += 2 if unicodedata.east_asian_width(ch) in "WF" else 1
    return width


def clip_to_row(text: str, columns: int) -> str:
    """`text` as one row of a `columns`-wide terminal, never wrapping (its last column left free: some terminals
    wrap once it is written): its end after a "…" where it is wider. `columns` 0 or less (a size not known): whole."""
    if columns <= 0 or display_width(text) < columns:
        return text
    kept = len(text)  # measured after the "…", as it is drawn (a tab reaches its tab stop from there), and the free
    while kept > 0 and display_width("…" + text[kept - 1:]) < columns:  # column left
        kept -= 1
    return "…" + text[kept:]


def terminal_columns(stream: TextIO) -> int:
    """The width of the terminal `stream` is (stderr may be one where stdout is a file); 0 where none is known."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def terminal_size(stream: TextIO) -> os.terminal_size:
    """The size of the terminal `stream` is, asked of the terminal itself: shutil.get_terminal_size reads COLUMNS and
    LINES first, and a stale or overridden one (COLUMNS=10, a resized window's old value) left copies of a redrawn
    view behind or erased the lines above it. Else shutil's answer (its variables, then 80x24)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return shutil.get_terminal_size()
    # a pty no one sized (ssh -tt from a script, os.openpty) says 0 x 0: unknown, as shutil reads it
    return size if size.columns > 0 and size.lines > 0 else shutil.get_terminal_size()


def rows_of(text: str, columns: int) -> int:
    """Terminal rows `text` takes from column 0, wrapped as xterm does: a wide character that does not fit at
    the end of a row starts the next one, and a line exactly as wide as the screen takes one row."""
    rows = 0
    for line in text.split("\n"):
        rows += 1
        col = 0
        for ch in line:
            if ch == "\t":  # to the next stop, never past the last column (nor wrapping from it)
                col = min((col // 8 + 1) * 8, columns - 1)
                continue
            cells = display_width(ch)
            if col + cells > columns:
                rows += 1
                col = 0
            col += cells
    return rows


def fit(pieces: list[Piece], columns: int, max_rows: int) -> list[Piece]:
    """The last lines of `pieces` that fit in `max_rows` rows, after a dim "…" line when any were left out."""
    lines: list[list[Piece]] = [[]]
    for text, style in pieces:
        for j, part in enumerate(text.split("\n")):
            if j:
                lines.append([])
            if part:
                lines[-1].append((part, style))
    # Measured from the end, as far as a screen holds: the whole text, measured at every step, cost a long answer's
    # length (a redraw of an 80,000-character answer took 40 ms)
    needs: list[int] = []
    for line in reversed(lines):
        needs.append(rows_of("".join(t for t, _ in line), columns))
        if sum(needs) > max_rows:  # (each line takes a row at least: a screen's lines are summed at most)
            break
    else:
        return pieces
    kept: list[list[Piece]] = []
    used = 1  # the "…" line
    for line, need in zip(reversed(lines), needs):
        if used + need > max_rows:
            break
        kept.insert(0, line)
        used += need
    if not kept:  # one line taller than the screen: as many of its last characters as surely fit
        room = (max_rows - 1) * columns
        tail: list[Piece] = []
        for text, style in reversed(lines[-1]):
            n = 0
            for ch in reversed(text):
                cells = 8 if ch == "\t" else display_width(ch)  # a tab takes at most 8
                if cells > room:
                    break
                room -= cells
                n += 1
            if n:
                tail.insert(0, (text[len(text) - n :], style))
            if n < len(text):
                break
        # A cell budget is not a row count: on an odd width a row of wide characters leaves its last cell empty,
        # and the kept line would run past the screen (its top scrolled off, the redraw leaving "…" rows behind). So
        # the line's start goes, a character at a time, until it takes the rows it may.
        while tail and rows_of("".join(t for t, _ in tail), columns) > max_rows - 1:
            text, style = tail[0]
            tail[0] = (text[1:], style)
            if not tail[0][0]:
                tail.pop(0)
        kept = [tail]
    out: list[Piece] = [("…", ELIDED)]
    for line in kept:
        out += [("\n", ""), *line]
    return out


class LiveView:
    """Redraws the answer as the canvas settles. `draft` shows a step's canvas after the committed text, `commit`
    sets the committed text (the answer so far, or, `final`, the whole answer), `abort` leaves the committed text on
    screen after an interruption."""

    def __init__(self, tokenizer: Any, prompt: str, healed_prefix: str = "", color: bool = True,
                 out: TextIO | None = None, size: Any = None):
        self.tokenizer, self.color, self.out = tokenizer, color, out or sys.stdout
        self.size = size or (lambda: terminal_size(self.out))  # () -> (columns, lines)
        self.healed_prefix = healed_prefix  # the first draft token repeats it (token healing): not drawn twice
        head, newline, self.tail = prompt.rpartition("\n")
        self.out.write(head + newline)  # the prompt's earlier lines are written once; its last one is redrawn
        self.committed = ""
        self.previous: list[int] | None = None
        self.rows = 1  # rows the region took when last drawn (the cursor is on its last one)
        self._draw([], live=True)

    def draft(self, tokens: list[int]) -> None:
        pieces = []
        for i, t in enumerate(tokens):
            piece = self.tokenizer.decode([t])
            if i == 0 and not self.committed and self.healed_prefix:
                piece = strip_prefix(piece, self.healed_prefix)
            settled = self.previous is not None and i < len(self.previous) and self.previous[i] == t
            pieces.append((piece, SETTLED if settled else CHANGING))
        self.previous = tokens
        self._draw([(self.committed, ""), *pieces], live=True)

    def commit(self, text: str, final: bool = False) -> None:
        """Show the answer so far (Commit.texts_so_far: decoded whole, so a character whose bytes two canvases share
        is drawn once it is complete), or (`final`) the whole answer, written out in full rather than redrawn, and
        its line ended: with stderr (the stats line) elsewhere the shell's prompt came on the text's last line."""
        self.committed = text
        self.previous = None
        self._draw([(self.committed, "")], live=not final)
        if final:
            self.out.write("\n")
            self.out.flush()

    def abort(self) -> None:
        """After Ctrl-C: the text committed so far, plainly, and a newline for the shell's prompt."""
        self._draw([(self.committed, "")], live=False)
        self.out.write("\n")
        self.out.flush()

    def _draw(self, pieces: list[Piece], live: bool) -> None:
        columns, lines = self.size()
        columns = max(columns, 1)
        pieces = [(self.tail, ""), *((t, s) for t, s in pieces if t)]
        # control characters would move the cursor and spoil the row count; the final text, written whole, is on
        # the terminal too; and the rows are those of what the terminal is sent (as_sent)
        pieces = [(as_sent(terminal_text(t), self.out), s) for t, s in pieces]
        if live:
            pieces = fit(pieces, columns, max(lines - 1, 2))
        up = f"\x1b[{self.rows - 1}A" if self.rows > 1 else ""
        body = "".join(style + text + RESET if style and self.color else text for text, style in pieces)
        self.out.write(up + "\r\x1b[J" + body)
        self.out.flush()
        self.rows = rows_of("".join(t for t, _ in pieces), columns)
