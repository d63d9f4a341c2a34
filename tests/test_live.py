"""The live terminal view, rendered through a terminal emulator (pyte): what stays on screen is what a plain write
of the answer leaves, wherever the prompt starts and however long the answer grows."""

import io
import json
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockpress.cli import main
from blockpress.live import LiveView, display_width, fit, rows_of, terminal_text

pyte = pytest.importorskip("pyte")


class Chars:
    """A tokenizer whose token i is the i-th character of an alphabet."""

    def __init__(self, alphabet: str):
        self.alphabet = alphabet

    def decode(self, ids):
        return "".join(self.alphabet[i] for i in ids)


def screen_after(data: str, columns: int, lines: int, above: int) -> list[str]:
    """The screen once `data` is written after `above` lines of earlier output (a tty turns \\n into \\r\\n)."""
    screen = pyte.Screen(columns, lines)
    stream = pyte.Stream(screen)
    stream.feed("".join(f"$ earlier output {i}\r\n" for i in range(above)))
    stream.feed(data.replace("\n", "\r\n"))
    return screen.display


# Narrow characters only where pyte renders: it puts a wide character that does not fit in a row's last cell,
# where xterm wraps it (rows_of follows xterm; test_widths checks it).
ALPHABET = "abc xyz\n\t(){}=:"
texts = st.text(alphabet=ALPHABET, max_size=60)


@settings(max_examples=60, deadline=None)
@given(prompt=texts, canvases=st.lists(st.lists(st.lists(st.integers(0, len(ALPHABET) - 1), min_size=1, max_size=24),
                                                min_size=1, max_size=4), min_size=1, max_size=3),
       columns=st.integers(8, 40), lines=st.integers(3, 12), above=st.integers(0, 14), color=st.booleans())
def test_the_screen_ends_as_a_plain_write_leaves_it(prompt, canvases, columns, lines, above, color):
    tok = Chars(ALPHABET)
    out = io.StringIO()
    view = LiveView(tok, prompt, color=color, out=out, size=lambda: (columns, lines))
    final = ""
    for drafts in canvases:
        for draft in drafts:
            view.draft(draft)
        final += tok.decode(drafts[-1])
        view.commit(final)
    view.commit(final, final=True)
    assert settled(screen_after(out.getvalue(), columns, lines, above), screen_after(prompt + final, columns, lines, above))


def settled(live: list[str], plain: list[str]) -> bool:
    """The live screen shows what a plain write shows, without stale copies: the same rows, except that a region
    which grew and shrank again scrolled the screen further, so its end may sit higher, over blank rows."""
    def strip(rows):
        rows = [r.rstrip() for r in rows]
        while rows and not rows[-1]:
            rows.pop()
        return rows

    live, plain = strip(live), strip(plain)
    return live == plain[len(plain) - len(live):] if len(live) <= len(plain) else False


@settings(max_examples=60, deadline=None)
@given(text=texts, columns=st.integers(4, 30), max_rows=st.integers(2, 10))
def test_fit_keeps_the_last_lines_within_the_rows(text, columns, max_rows):
    pieces = [(text[: len(text) // 2], ""), (text[len(text) // 2 :], "s")]
    kept = fit(pieces, columns, max_rows)
    shown = "".join(t for t, _ in kept)
    assert rows_of(shown, columns) <= max(max_rows, rows_of(text, columns) if kept == pieces else max_rows)
    if kept == pieces:
        assert rows_of(text, columns) <= max_rows
    else:
        assert shown.startswith("…\n")
        body = shown[2:]
        last_line = text.split("\n")[-1]
        assert text.endswith(body) or last_line.endswith(body)  # the end of the text, never the start


def test_fit_measures_the_last_screenful_not_the_whole_answer(monkeypatch):
    """fit measured the whole text, character by character, before taking its last lines: at every denoising step of
    the live view, a redraw of an 80,000-character answer took 40 ms. It measures from the end, a screen's worth."""
    import blockpress.live as live

    measured = []
    real = live.display_width
    monkeypatch.setattr(live, "display_width", lambda ch: (measured.append(ch), real(ch))[1])
    line = "x = compute(y) + 1  # a line of code"
    pieces = [(line + "\n", "") for _ in range(2000)]  # 76,000 characters
    shown = "".join(t for t, _ in fit(pieces, 80, 24))
    assert shown.startswith("…\n") and shown.endswith(line + "\n") and rows_of(shown, 80) <= 24
    assert len(measured) < 3 * 24 * len(line), len(measured)  # (whole: 73,621)


@pytest.mark.parametrize("columns", [10, 11, 20, 21, 41])
def test_fit_keeps_a_line_of_wide_characters_taller_than_the_screen_within_it(columns):
    """One line taller than the screen kept as many characters as (rows - 1) x columns cells hold: on an odd width a
    row of wide characters leaves its last cell empty, so the kept line ran past the screen (11 columns, 24 rows:
    11 stray "…" rows and 70 rows where 60 fit)."""
    kept = fit([("中" * 600, "")], columns, 24)
    shown = "".join(t for t, _ in kept)
    assert shown.startswith("…\n") and rows_of(shown, columns) <= 24
    assert rows_of(shown, columns) >= 23 and ("中" * 600).endswith(shown[2:])  # (as much as fits, of its end)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "cp1252"])
def test_a_terminal_that_cannot_show_the_text_keeps_the_lines_above_the_view(encoding):
    """A terminal whose encoding cannot hold a character is sent "?" for it (one cell, utf8_stdio's errors="replace"),
    but the view counted the rows of the text before encoding, a CJK character as two cells: each redraw moved the
    cursor above its region and erased the user's earlier lines."""
    tok = Chars("ab名 :")
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding=encoding, errors="replace", write_through=True)
    prompt = "def f(x):  # " + "名" * 30
    view = LiveView(tok, prompt, color=False, out=out, size=lambda: (40, 30))
    final = ""
    for drafts in ([[0, 1, 2], [0, 1, 2, 2, 3]], [[4, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]]):
        for draft in drafts:
            view.draft(draft)
        final += tok.decode(drafts[-1])
        view.commit(final)
    view.commit(final, final=True)
    plain = (prompt + final).encode(encoding, errors="replace").decode(encoding)
    live = screen_after(raw.getvalue().decode(encoding), 40, 30, 8)
    assert live[0] == "$ earlier output 0".ljust(40)
    assert settled(live, screen_after(plain, 40, 30, 8))


def test_widths():
    assert display_width("ab\t") == 8 and display_width("中文") == 4 and display_width("e\u0301") == 1
    # a soft hyphen is drawn one cell wide (wcwidth 1); counted as none, each redraw left a copy of its line behind
    assert display_width("hy\u00adphen") == 7 and display_width("a\u200bb\u200d") == 2
    assert rows_of("x" * 10, 10) == 1 and rows_of("x" * 11, 10) == 2 and rows_of("a\n\nb", 10) == 3
    assert rows_of("x" * 9 + "中", 10) == 2 and rows_of("x" * 8 + "中", 10) == 1  # a wide one wraps whole
    assert rows_of("\t" * 3, 10) == 1 and rows_of("ab\tc", 10) == 1 and rows_of("ab\tcde", 10) == 2


def test_the_cli_live_view_leaves_one_copy_of_the_answer(capsys, monkeypatch):
    """End to end on a terminal at the bottom of a full screen (before: each redraw started lower than the last,
    leaving copies of the draft once the screen scrolled)."""
    base = ["generate", "hello", "--model", "random-tiny", "--max-new-tokens", "40", "--steps", "3", "--seed", "2"]
    assert main(base + ["--json"]) == 0
    want = json.loads(capsys.readouterr().out)["text"]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr("shutil.get_terminal_size", lambda *a: os.terminal_size((30, 6)))
    assert main(base) == 0
    drawn, stderr = capsys.readouterr()
    assert "\x1b[" in drawn  # it did draw live
    # the text's line ended on stdout (with stderr elsewhere the shell's prompt came on it), the stats line right after
    assert drawn.endswith("\n") and stderr.startswith("[40 new tokens")
    plain = terminal_text("hello" + want)  # as a terminal is given it: control characters as U+FFFD
    assert settled(screen_after(drawn, 30, 6, above=10), screen_after(plain, 30, 6, above=10))


@pytest.mark.parametrize("env, live, colored", [({"TERM": "dumb"}, False, False), ({"NO_COLOR": "1"}, True, False),
                                                ({}, True, True)])
def test_dumb_terminals_and_no_color(capsys, monkeypatch, env, live, colored):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["generate", "hi", "--model", "random-tiny", "--max-new-tokens", "8", "--steps", "2"]) == 0
    drawn = capsys.readouterr().out
    assert ("\x1b[J" in drawn) == live and ("\x1b[2;33m" in drawn) == colored


def test_ctrl_c_leaves_the_committed_text_and_a_fresh_line(capsys, monkeypatch):
    import blockpress.lm

    original = blockpress.lm.LM.stream

    def interrupted(self, *args, **kwargs):
        for n, event in enumerate(original(self, *args, **kwargs)):
            if n == 3:
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(blockpress.lm.LM, "stream", interrupted)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm")
    assert main(["generate", "hi", "--model", "random-tiny", "--max-new-tokens", "8", "--steps", "4"]) == 130
    captured = capsys.readouterr()
    assert captured.out.endswith("\r\x1b[Jhi\n")  # the draft cleared, nothing committed yet, the line ended
    assert "interrupted" in captured.err


def test_control_characters_from_the_model_never_reach_the_terminal():
    """The live view drew control characters as U+FFFD while live, but wrote the final text whole, as the model
    wrote it: an escape sequence in it (a random or small model writes any token) coloured or cleared the
    terminal. A "\\r\\n" shows as the newline it is."""
    out = io.StringIO()
    view = LiveView(Chars("a"), "p", color=False, out=out, size=lambda: (40, 10))
    answer = "red \x1b[31mtext\x07 \x9b2J x\r\ny"
    view.commit(answer[:6])
    view.commit(answer, final=True)
    written = out.getvalue()
    assert "\x1b[31m" not in written and "\x07" not in written and "\x9b" not in written and "\r\n" not in written
    assert written.endswith("pred \ufffd[31mtext\ufffd \ufffd2J x\ny\n")  # (the final text's line ended)


class _Tty(io.StringIO):
    def isatty(self):
        return True

    def fileno(self):
        return 1


def test_live_view_on_windows_only_where_the_console_takes_escape_sequences(monkeypatch):
    """A Windows console without VT processing (conhost under cmd.exe or PowerShell on Windows 10, unless asked)
    prints escape sequences as text: the live view drew every redraw as "←[2A←[J..." lines. There it is live
    only where VT processing is on or can be turned on; elsewhere it prints the result alone, as TERM=dumb does."""
    import blockpress.live as live

    asked = []
    monkeypatch.setattr(live, "windows_vt_mode", lambda stream: asked.append(stream) or vt)
    tty = _Tty()
    for platform, vt, want in (("linux", False, True), ("darwin", False, True), ("win32", False, False),
                               ("win32", True, True)):
        monkeypatch.setattr(sys, "platform", platform)
        assert live.live_terminal(tty, env={}) is want, (platform, vt)
        assert live.live_terminal(io.StringIO(), env={}) is False  # a pipe never
        assert live.live_terminal(tty, env={"TERM": "dumb"}) is False
    assert len(asked) == 2  # asked on Windows alone, of a terminal alone


@pytest.mark.parametrize("mode, settable, want, set_to", [
    (0x3, True, True, 0x7),     # off: turned on
    (0x7, True, True, None),    # on already (Windows Terminal): left as it is
    (0x3, False, False, 0x7),   # a console too old to take it
    (None, True, False, None),  # no console behind the handle (GetConsoleMode fails)
])
def test_windows_vt_mode_turns_vt_processing_on_when_it_can(monkeypatch, mode, settable, want, set_to):
    """The console calls, stubbed (this runs on any OS): ENABLE_VIRTUAL_TERMINAL_PROCESSING (0x4) added to the
    console's mode, the rest of it kept."""
    import ctypes
    import types

    import blockpress.live as live

    calls = []

    class Kernel32:
        @staticmethod
        def GetConsoleMode(handle, ref):
            assert handle == 101
            if mode is None:
                return 0
            ref._obj.value = mode
            return 1

        @staticmethod
        def SetConsoleMode(handle, value):
            calls.append(value)
            return 1 if settable else 0

    monkeypatch.setattr(ctypes, "windll", types.SimpleNamespace(kernel32=Kernel32), raising=False)
    monkeypatch.setitem(sys.modules, "msvcrt", types.SimpleNamespace(get_osfhandle=lambda fd: 100 + fd))
    assert live.windows_vt_mode(_Tty()) is want
    assert calls == ([] if set_to is None else [set_to])


def test_clip_to_row_keeps_a_line_to_one_row_of_the_terminal():
    """The "loading MODEL ... 45% of 52.3 GB" line wrapped on a terminal narrower than it, and each redraw (a "\\r"
    goes back to the start of the last row only) left a copy of its first rows on screen."""
    from blockpress.live import clip_to_row, display_width

    line = "loading blockpress-code ... 19% of 21.7 MB"
    assert clip_to_row(line, 80) == line and clip_to_row(line, 0) == line  # it fits; no size known
    assert clip_to_row(line, 20) == "…... 19% of 21.7 MB" and display_width(clip_to_row(line, 20)) == 19
    for columns in range(2, 45):
        assert display_width(clip_to_row(line, columns)) < columns
    assert clip_to_row("日本語日本語日本語", 8) == "…日本語"  # wide characters: two cells each
    for columns in range(2, 24):  # a tab's width depends on the column it starts at: the "…" before it counts
        assert display_width(clip_to_row("loading /m/ab\tcd ...", columns)) < columns


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_the_loading_line_never_wraps_on_a_narrow_terminal():
    """On a 20-column terminal the loading line (and the spaces that erase it) took three rows, and the screen kept
    "loading blockpress-c" copies above the answer. Each is now one row, cut from the left."""
    import fcntl
    import select
    import struct
    import subprocess
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 10, 20, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "blockpress.cli", "generate", "def f(x):", "--max-new-tokens",
                             "2", "--steps", "1", "--threads", "1"], stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    out = b""
    try:
        while select.select([master], [], [], 120)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the run ended
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=60) == 0, out
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    loading = out.decode().split("def f(x):")[0]  # the loading line's redraws, before the answer
    assert "loading" in loading or "…" in loading, out
    assert all(len(piece) < 20 for piece in loading.split("\r")), out


@pytest.mark.skipif(sys.platform == "win32", reason="no pty")
def test_the_view_sizes_itself_by_its_terminal_not_columns(monkeypatch):
    """shutil.get_terminal_size reads COLUMNS and LINES first: a stale or overridden one (COLUMNS=10 in an 80-column
    window) moved every redraw's cursor by the wrong count of rows, erasing the lines above or leaving copies."""
    import fcntl
    import pty
    import struct
    import termios

    main_fd, terminal_fd = pty.openpty()
    try:
        fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 20, 50, 0, 0))
        monkeypatch.setenv("COLUMNS", "10")
        monkeypatch.setenv("LINES", "300")
        with open(terminal_fd, "w", closefd=False) as out:
            view = LiveView(Chars("a"), "p", color=False, out=out)
            assert tuple(view.size()) == (50, 20)
        view = LiveView(Chars("a"), "p", color=False, out=io.StringIO())  # no terminal: the variables, as shutil
        assert tuple(view.size()) == (10, 300)
        # a terminal that reports no size (0 x 0: a pty no one sized) is unknown: the variables again
        fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        with open(terminal_fd, "w", closefd=False) as out:
            assert tuple(LiveView(Chars("a"), "p", color=False, out=out).size()) == (10, 300)
    finally:
        os.close(main_fd)
        os.close(terminal_fd)


# From a mutation hunt over live.py: a lone CR from the model, and which draft tokens are drawn as settled.
def test_a_lone_carriage_return_is_drawn_harmlessly_and_crlf_as_a_newline():
    from blockpress.live import terminal_text

    assert terminal_text("a\rb\r\nc") == "a\ufffdb\nc"


def test_a_token_is_settled_only_where_it_is_the_previous_drafts_token():
    from blockpress.live import CHANGING, SETTLED, LiveView

    class Chars:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    out = io.StringIO()
    view = LiveView(Chars(), "p", out=out, size=lambda: (80, 24))
    view.draft([ord("a"), ord("b")])
    out.truncate(0)
    out.seek(0)
    view.draft([ord("a"), ord("c")])
    drawn = out.getvalue()
    assert SETTLED + "a" in drawn and CHANGING + "c" in drawn

