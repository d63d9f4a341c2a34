"""The command line, end to end (random-tiny until the shipped model lands)."""

import argparse
import contextlib
import functools
import importlib.util
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
import torch
from fp8 import FP8
from hypothesis import given, settings
from hypothesis import strategies as st
from terminal import read_terminal

import blockpress
from blockpress.cli import build_parser, main
from blockpress.cli.common import TypedFlag, utf8_arguments
from blockpress.live import terminal_text

# The shipped model when the package has it (it does in the repository); random weights otherwise.
# The shipped blockpress-code measures a held-out next-token loss of 2.42 nats on the test's four functions;
# of 12 bodies, 8 greedy AR ones parse and 9 diffusion ones (the default decoding, frequency penalty 0.5 included;
# 7 and 9 without it; float32 weights, 1 thread).
CODE_NLL_MAX = 3.5
CODE_AR_PARSE_MIN = 4
CODE_DIFFUSION_PARSE_MIN = 6
MODEL = "blockpress-code" if "blockpress-code" in blockpress.shipped_models() else "random-tiny"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "blockpress.cli", *args], capture_output=True, text=True, timeout=300)


def test_a_path_flag_given_after_an_equals_sign_expands_a_home_path(tmp_path, capsys, monkeypatch):
    """A shell leaves a ~ after = as it is (`--input=~/in.jsonl`; cmd.exe and PowerShell in any argument), and the
    file was looked for in a folder named ~ ('--input ~/in.jsonl: No such file or directory'), where --model and
    train's --out expanded it. Each command's path flags expand it now, and a ~user with no home is named by flag."""
    from blockpress.cli.common import PATH_FLAGS, expand_path_flags

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    (home / "in.jsonl").write_text('{"prompt": "def f(x):"}\n{"prompt": "x"}\n')
    assert main(["generate", "--input=~/in.jsonl", "--output=~/out.jsonl", "--model", "random-tiny",
                 "--max-new-tokens", "2", "--steps", "1", "--threads", "1"]) == 0
    assert [json.loads(x)["line"] for x in (home / "out.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no folder named ~
    given = {"generate": ["--input=~/a", "--output=~/b"], "infill": ["--input=~/a", "--output=~/b"],
             "sudoku": ["--file=~/a"], "bench": ["--out=~/a", "--plot=~/b"],
             "train": ["--data=~/a", "--heldout-data=~/b", "--train-config=~/c", "--out=~/d", "--config=~/e",
                       "--tokenizer=~/f"]}
    seen = set()
    for command, flags in given.items():
        args = build_parser().parse_args([command, *flags])
        expand_path_flags(args)
        paths = {name: getattr(args, name) for name in PATH_FLAGS if getattr(args, name, None) is not None}
        assert sorted(paths.values()) == [str(home / x) for x in "abcdef"[:len(flags)]], command
        seen |= set(paths)
    assert seen == set(PATH_FLAGS)
    # an empty one (an unset variable in a script): bench --out '' wrote nothing and said nothing
    for command, flags in given.items():
        for flag in flags:
            if (command, flag) == ("train", "--out=~/d"):  # train's own refusal says what the folder is for
                continue
            args = build_parser().parse_args([command, *[f for f in flags if f != flag], flag.split("=")[0] + "="])
            with pytest.raises(ValueError, match=rf"^{flag.split('=')[0]}: an empty path; give a file or folder name$"):
                expand_path_flags(args)
    assert main(["bench", "--out", ""]) == 2 and "--out: an empty path" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["sudoku", "--file=~no-such-user-blockpress/p.txt"]) == 2
    assert capsys.readouterr().err == ("blockpress sudoku: error: --file: '~no-such-user-blockpress/p.txt' starts with "
                                       "~no-such-user-blockpress, and no home folder is known for a user "
                                       "'no-such-user-blockpress'; give the path without it\n")
    assert main(["quantize", "--model", "random-tiny", "~no-such-user-blockpress/q"]) == 2  # an argument, not a flag
    assert capsys.readouterr().err.startswith("blockpress quantize: error: OUT: '~no-such-user-blockpress/q' starts")


def test_generate_ar_is_generate_ar_with_the_flags(capsys):
    """`generate --ar` decodes with lm.generate_ar: its text is the library's for the same settings, one token a
    pass; the diffusion-only flags are refused by name."""
    flags = ["--model", MODEL, "--max-new-tokens", "10", "--temperature", "0.8", "--top-k", "20", "--seed", "3",
             "--no-token-healing", "--json"]
    assert main(["generate", "def f(x):", "--ar", *flags]) == 0
    data = json.loads(capsys.readouterr().out)
    lm = blockpress.load(MODEL)
    want = lm.generate_ar("def f(x):", max_new_tokens=10, temperature=0.8, top_k=20, seed=3)
    assert data["text"] == want.texts[0] and data["new_tokens"] == int(want.num_new_tokens[0])
    assert data["forward_passes"] == data["new_tokens"] and data["tokens_per_forward"] == 1.0 and data["seed"] == 3
    assert main(["generate", "def f(x):", "--ar", "--steps", "4", *flags]) == 2
    assert "--steps" in capsys.readouterr().err


def test_generate_json(capsys):
    assert main(["generate", "def f(x):", "--model", MODEL, "--max-new-tokens", "20", "--steps", "3",
                 "--seed", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["new_tokens"] <= 20 and data["forward_passes"] >= 1
    for key in ("text", "new_tokens", "forward_passes", "tokens_per_forward", "tok_s"):
        assert key in data


def test_max_denoising_steps_is_the_library_name_of_steps(capsys):
    """--max-denoising-steps (the Python API's and generation_config.json's name) was "unrecognized arguments"."""
    runs = {}
    for flag in ("--steps", "--max-denoising-steps"):
        assert main(["generate", "def f(x):", "--model", MODEL, "--max-new-tokens", "12", flag, "2", "--seed", "1",
                     "--json"]) == 0
        runs[flag] = json.loads(capsys.readouterr().out)
    assert runs["--steps"]["text"] == runs["--max-denoising-steps"]["text"]
    # two steps a canvas at most: the 12 tokens took at most one canvas's two passes (more steps would take more)
    assert runs["--max-denoising-steps"]["forward_passes"] <= 2 * -(-12 // blockpress.load(MODEL).config.canvas_length)


@pytest.mark.parametrize("command", [["generate", "hi"], ["generate", "hi", "--ar"], ["infill", "a<|hole:2|>"]])
def test_an_error_names_the_flag_as_typed(capsys, command):
    """`--max-denoising-steps 0` was refused as '--steps: expected an integer ...', a flag the user never typed (and
    --ar's refusal of it too): the error names the name typed, an abbreviation by its full name, the last one given
    where both are."""
    for typed, flags in [("--max-denoising-steps", ["--max-denoising-steps", "0"]),
                         ("--max-denoising-steps", ["--max-den", "0"]), ("--steps", ["--steps", "0"]),
                         ("--steps", ["--max-denoising-steps", "0", "--steps", "0"])]:
        assert main([*command, "--model", "random-tiny", *flags]) == 2
        assert capsys.readouterr().err.split("error: ")[1].startswith(typed + ": "), (command, flags)


def test_every_flag_of_several_names_records_the_one_typed():
    """A flag with another name (an alias, as --max-denoising-steps is --steps') is a TypedFlag, so the errors of its
    setting name the name the user typed; --help and a --x/--no-x pair (a name each value) are not aliases."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    aliases = [(name, a.option_strings) for name, p in commands.items() for a in p._actions
               if len(a.option_strings) > 1 and not isinstance(a, (argparse._HelpAction,
                                                                     argparse.BooleanOptionalAction))]
    assert ("generate", ["--steps", "--max-denoising-steps"]) in aliases
    for name, strings in aliases:
        action = next(a for a in commands[name]._actions if a.option_strings == strings)
        assert isinstance(action, TypedFlag), (name, strings)


@pytest.mark.parametrize("command", [["generate", "def add(a, b):", "--max-new-tokens", "8"],
                                     ["infill", "def f(<|hole:4|>):"]])
def test_json_gives_the_seed_that_repeats_the_text(capsys, command):
    """Without --seed a run draws a fresh seed, and generate's and infill's --json never said which (chat's did): a
    sampled text one liked could not be had again. The object gives it, and --seed with it repeats the text."""
    flags = [*command, "--model", MODEL, "--steps", "2", "--temperature", "1.5", "--json"]
    assert main(flags) == 0
    drawn = json.loads(capsys.readouterr().out)
    assert isinstance(drawn["seed"], int)
    assert main([*flags, "--seed", str(drawn["seed"])]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["text"] == drawn["text"] and again["seed"] == drawn["seed"]
    assert again.get("fills") == drawn.get("fills")


def test_generate_stop(capsys):
    base = ["generate", "def f(x):", "--model", MODEL, "--max-new-tokens", "40", "--steps", "3", "--seed", "1",
            "--json"]
    assert main(base) == 0
    whole = json.loads(capsys.readouterr().out)
    stop = whole["text"][3:5]
    assert main(base + ["--stop", stop, "--stop", "\x00never"]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["text"] == whole["text"][: whole["text"].index(stop)]
    assert cut["new_tokens"] < whole["new_tokens"]


def test_the_live_view_ends_on_the_answers_text(capsys, monkeypatch):
    """On a terminal the canvas is redrawn step by step; the screen must end on the same text --json gives
    (canvases decoded one by one split characters between them, and a stop could cut the last one)."""
    base = ["generate", "hello", "--model", "random-tiny", "--max-new-tokens", "40", "--steps", "2"]
    for seed in ("1", "2", "3"):
        assert main(base + ["--seed", seed, "--json"]) == 0
        want = json.loads(capsys.readouterr().out)["text"]
        monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
        monkeypatch.setenv("TERM", "xterm")
        assert main(base + ["--seed", seed]) == 0
        monkeypatch.undo()
        screen = capsys.readouterr().out
        assert "\x1b[2m" in screen or "\x1b[" in screen  # it did draw
        # the last redraw: the prompt's line and the answer, as a terminal is given it (control characters as U+FFFD),
        # its line ended
        assert screen.rsplit("\r\x1b[J", 1)[1] == terminal_text("hello" + want) + "\n"


def test_generate_reads_the_prompt_from_stdin_given_a_dash(capsys, monkeypatch):
    base = ["generate", "--model", "random-tiny", "--max-new-tokens", "8", "--steps", "2", "--seed", "4", "--json"]
    assert main(base[:1] + ["def add(a, b):"] + base[1:]) == 0
    want = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(sys, "stdin", io.StringIO("def add(a, b):"))
    assert main(base[:1] + ["-"] + base[1:]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["prompt"] == "def add(a, b):" and got["text"] == want["text"]


def windows_stream(data: bytes | None = None) -> io.TextIOWrapper:
    """A standard stream as Python opens a file or pipe on a Western-European Windows: the ANSI code page, strict."""
    return io.TextIOWrapper(io.BytesIO(data or b""), encoding="cp1252", errors="strict")


def test_output_to_a_file_is_utf8_whatever_the_locale(monkeypatch):
    """Redirected on Windows, stdout was cp1252: a prompt or answer with any character outside it ("\u2713") ended
    in "'charmap' codec can't encode character" after the whole generation, and nothing was written."""
    out = windows_stream()
    monkeypatch.setattr(sys, "stdout", out)
    prompt = "def check(): return '\u2713 \u6570'  # "
    assert main(["generate", prompt, "--model", "random-tiny", "--max-new-tokens", "4", "--steps", "2",
                 "--seed", "1", "--no-live"]) == 0
    out.flush()
    assert out.buffer.getvalue().decode("utf-8").startswith(prompt)


def test_a_chat_prompt_that_is_not_utf8_is_named_prompt_before_the_model_loads(capsys, monkeypatch):
    """`generate PROMPT --chat` named a prompt that is no UTF-8 "messages[0].content" (messages[1] with --system),
    after loading the model, where every other path names `prompt`."""
    def no_load(args):
        raise AssertionError("the model was loaded first")

    monkeypatch.setattr("blockpress.cli.common.load_announced", no_load)
    for extra in ([], ["--system", "be brief"]):
        assert main(["generate", "caf\udce9", "--chat", "--model", "random-tiny", *extra]) == 2
        err = capsys.readouterr().err
        assert "error: prompt: not valid UTF-8 (byte 0xe9 at character 3)" in err, err


def test_utf8_arguments_under_an_ascii_locale_are_read_as_utf8(capsys):
    """Under an ASCII locale with UTF-8 mode off, Python decodes argv as ASCII with surrogateescape: "grüße" typed in
    UTF-8 arrived as surrogates and was refused as "prompt: not valid UTF-8 (byte 0xc3 at character 6)" (--stop,
    --system, infill's template alike), where the same bytes piped in are read as UTF-8. Bytes that are not UTF-8
    are still named."""
    def typed(text):
        return text.encode("utf-8").decode("ascii", "surrogateescape")  # what Python's argv holds there

    assert main(["generate", typed("def grüße():"), "--model", "random-tiny", "--max-new-tokens", "2", "--steps", "2",
                 "--stop", typed("✓"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "def grüße():"
    assert main(["generate", "caf" + "\xe9".encode("latin-1").decode("ascii", "surrogateescape"), "--model",
                 "random-tiny"]) == 2
    assert "prompt: not valid UTF-8 (byte 0xe9 at character 3)" in capsys.readouterr().err
    # --chat-template-kwargs is read as argparse parses (its type=), --served-name is text too
    parsed = build_parser().parse_args(["chat", "--chat-template-kwargs", typed('{"name": "Jürgen"}')])
    assert parsed.chat_template_kwargs == {"name": "Jürgen"}
    args = argparse.Namespace(served_name=typed("modèle"), root_path=typed("/modèle"), api_key=typed("clé"))
    utf8_arguments(args)
    assert (args.served_name, args.root_path, args.api_key) == ("modèle", "/modèle", "clé")


def test_piped_prompt_is_read_as_utf8_whatever_the_locale(capsys, monkeypatch):
    """Piped on Windows, stdin was decoded as cp1252: a UTF-8 prompt reached the model as mojibake ("grüße" as
    "grÃ¼ÃŸe"), silently. A BOM is dropped; bytes that are not UTF-8 are refused by name, not guessed at."""
    base = ["generate", "-", "--model", "random-tiny", "--max-new-tokens", "2", "--steps", "2", "--json"]
    monkeypatch.setattr(sys, "stdin", windows_stream("\ufeffdef gr\u00fc\u00dfe(name):\n".encode("utf-8")))
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "def gr\u00fc\u00dfe(name):\n"
    monkeypatch.setattr(sys, "stdin", windows_stream(b"def gr\xfc(name):\n"))  # cp1252's own bytes: not UTF-8
    assert main(base) == 2
    assert "prompt: not valid UTF-8 (byte 0xfc at character 6)" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "infill", "chat"])
@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-16-be"])
def test_utf16_piped_in_is_said_to_be_utf16(capsys, monkeypatch, command, codec):
    """Windows PowerShell 5's `|` and `>` write UTF-16: piped into `generate -` or `infill -` it was refused as "not
    valid UTF-8 (byte 0xff at character 0)" alone, where --input and --data say it is UTF-16 and how to save it.
    Without a byte-order mark (iconv -t UTF-16LE) its ASCII is valid UTF-8, NULs between the letters: generate and
    chat sent the model that, exit 0, and infill said the template "has no holes"."""
    # (a chat's first line empty: nothing to tell UTF-16 by, and the next lines went to the model)
    text = "\ndef add(a, b):\n<|hole|>\n" if command == "chat" and codec != "utf-16" else "def add(a, b):\n<|hole|>\n"
    stream = io.TextIOWrapper(io.BytesIO(text.encode(codec)), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stream)
    assert main([command, *["-"] * (command != "chat"), "--model", "random-tiny", "--steps", "2"]) == 2
    key = {"generate": "prompt", "infill": "template", "chat": "standard input"}[command]
    said = ("not valid UTF-8 (byte 0xff at character 0); it is UTF-16 (it starts with a UTF-16 byte-order mark"
            if codec == "utf-16" else "holds NUL characters; it is UTF-16 without a byte-order mark")
    assert f"error: {key}: {said}" in capsys.readouterr().err


def test_a_prompt_with_a_nul_here_and_there_is_no_utf16():
    from blockpress.files import utf16_text_error

    assert utf16_text_error("abc\x00def\x00ghi", "prompt") is None  # NULs fewer than a quarter
    # UTF-8 text with NULs in it: these read as UTF-16 (a whole unit of NULs, multi-byte UTF-8 as CJK), but their
    # NULs do not sit one a unit at the same offset
    for text in ("\x00", "\x00\x00", "\x00\x00\x00\x00", "\u65e5\u672c\u8a9e\x00\u4e2d\u6587\x00",
                 "\u540d\u524d\x00\u5024\x00", "\u65e5\u672c\x00", "\u00e9\x00"):
        assert utf16_text_error(text, "prompt") is None, text
    assert "UTF-16" in str(utf16_text_error("ab".encode("utf-16-le").decode(), "prompt"))
    assert "UTF-16" in str(utf16_text_error("y\x00", "prompt"))  # a line of one letter (chat's "y" piped in)


@pytest.mark.parametrize("command", ["generate", "infill"])
def test_a_piped_text_with_windows_line_endings_is_the_text_with_lf_ones(capsys, monkeypatch, command):
    """stdin is split at "\n" alone on Linux and macOS (Python translates CRLF only on Windows): a prompt file saved
    on Windows and piped in prompted the model with "\r\n", other tokens and another answer than the same text."""
    base = [command, "-", "--model", "random-tiny", "--steps", "2", "--seed", "3", "--json", "--threads", "1"]
    base += ["--max-new-tokens", "4"] if command == "generate" else []
    text = "def add(a, b):\n    <|hole|>\n\nprint(add(1, 2))\n"
    got = []
    for data in (text, text.replace("\n", "\r\n"), "\ufeff" + text.replace("\n", "\r")):
        # stdin as Python opens a pipe on Linux and macOS: lines end at "\n" alone (Python's own stdin, whose line
        # endings the CLI sets; a program's own wrapper keeps its own)
        stream = io.TextIOWrapper(io.BytesIO(data.encode()), encoding="utf-8", newline="\n")
        monkeypatch.setattr(sys, "stdin", stream)
        monkeypatch.setattr(sys, "__stdin__", stream)
        assert main(base) == 0
        got.append(json.loads(capsys.readouterr().out))
    key = "prompt" if command == "generate" else "template"
    kept = [{k: v for k, v in g.items() if k not in ("tok_s", "seconds")} for g in got]  # (the clock's)
    assert got[0][key] == text and kept[1] == kept[0] and kept[2] == kept[0]


def test_a_terminal_said_to_be_ascii_is_read_as_utf8(capsys, monkeypatch):
    """Under PYTHONIOENCODING=ascii (or an ASCII locale) a terminal's stdin decoded strictly as ASCII: "grüße" typed
    at `generate -` ended it with "'ascii' codec can't decode byte 0xc3 in position 6", and chat refused the message
    as "not valid UTF-8", which it was. ASCII's superset, UTF-8, reads what the terminal sent."""
    class Terminal(io.BytesIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(Terminal("def grüße(x):\n".encode()), encoding="ascii"))
    assert main(["generate", "-", "--model", "random-tiny", "--max-new-tokens", "2", "--steps", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "def grüße(x):\n"


@pytest.mark.parametrize("tty", [True, False])
def test_stderr_said_to_be_ascii_gets_one_character_for_each_it_cannot_show(monkeypatch, tty):
    """Under PYTHONIOENCODING=ascii stderr wrote "…" (a loading line cut to one row) as the six characters "\u2026",
    so the line wrapped and its erase left the first row on screen, and the stats line's "·" came out as "\xb7". A
    terminal now gets "?" (one column, as the character took); a file or pipe gets UTF-8, as stdout does."""
    from blockpress.cli.output import utf8_stdio

    class Stream(io.BytesIO):
        def isatty(self) -> bool:
            return tty

    raw = Stream()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="ascii", errors="backslashreplace"))
    utf8_stdio()
    print("…ng random-tiny · 3 tok/s", file=sys.stderr, flush=True)
    assert raw.getvalue() == (b"?ng random-tiny ? 3 tok/s\n" if tty else "…ng random-tiny · 3 tok/s\n".encode())


@pytest.mark.parametrize("tty", [False, True])
def test_a_path_of_undecodable_bytes_is_printed_to_a_strict_utf8_stdout(monkeypatch, tty):
    """Under en_US.UTF-8 (any UTF-8 locale but C.UTF-8) stdout is UTF-8 with errors='strict': a model folder named
    b"mod\\xe8le" (held as the surrogate "\\udce8") failed `info`, and `quantize` after writing its folder, with
    "surrogates not allowed", status 2. A file or pipe now gets the path's own bytes, as `ls` writes them; a
    terminal "?"."""
    from blockpress.cli.output import utf8_stdio

    class Stream(io.BytesIO):
        def isatty(self) -> bool:
            return tty

    for errors in ("strict", "surrogateescape"):  # (C.UTF-8 and PYTHONUTF8=1 give surrogateescape: a terminal got
        # the raw bytes, 0x9b among them a control sequence's start)
        raw = Stream()
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8", errors=errors))
        utf8_stdio()
        print("wrote mod\udce8\udc9ble: int8", flush=True)
        assert raw.getvalue() == (b"wrote mod??le: int8\n" if tty else b"wrote mod\xe8\x9ble: int8\n"), errors


def test_an_error_naming_undecodable_bytes_reaches_an_ascii_stderr_file():
    """A path of bytes the locale cannot decode reaches Python as surrogates; stderr said to be ASCII and written
    to a file or pipe is made UTF-8 with its own backslashreplace kept, so the error naming the path is written
    (strict, the reporter itself failed: "lost sys.stderr", exit 1)."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    r = subprocess.run([sys.executable, "-m", "blockpress", "info", "--model", b"/nonexistent/caf\xff"],
                       capture_output=True, env=env, timeout=120)
    assert r.returncode == 2 and b"no such folder" in r.stderr and b"caf\\udcff" in r.stderr, r.stderr


def test_chat_json_on_a_terminal_lets_line_editing_draw_its_prompt(monkeypatch, capsys):
    """chat --json on a terminal printed "you> " itself and read with input(""): stdout being the terminal, input()
    edits the line with readline, which took the line to start at column 0, so Ctrl-A, the arrows or history drew
    over the prompt ("y/helphelp" for "you> //help"). readline is given the prompt wherever it edits the line."""
    import builtins

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    prompts = []
    lines = iter(["/help", "/exit"])

    def typed(prompt=""):
        prompts.append(prompt)
        return next(lines)

    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr(builtins, "input", typed)
    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    assert main(["chat", "--model", "random-tiny", "--json"]) == 0
    assert prompts == ["you> ", "you> "] and "you> " not in capsys.readouterr().err
    assert [json.loads(line)["prompt"] for line in screen.getvalue().splitlines()] == ["/help", "/exit"]


def test_generate_plain_prints_text_and_stats(capsys):
    # In this process, through main() (a subprocess paid torch's import and the model's load: 3-9 s on a busy 2-core
    # machine); `python -m blockpress` itself is test_python_m_blockpress_runs_the_command's.
    code = main(["generate", "def add(a, b):", "--max-new-tokens", "16", "--steps", "2", "--no-live"])  # default model
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("def add(a, b):") and len(out.strip()) > len("def add(a, b):")
    assert "tokens/forward" in err and "tok/s" in err


def test_infill_keeps_fixed_text(capsys):
    assert main(["infill", "left <|hole:5|> right", "--model", MODEL, "--steps", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["text"].startswith("left ") and data["text"].endswith(" right")
    assert data["text"] == "left " + data["fills"][0] + " right"  # the hole's own text, without the healed space
    # the 5 hole tokens are what the model wrote: tokens/forward counts them, not the template's fixed ones (the
    # space before the hole is healed into it, and the hole keeps its length)
    # new_tokens counted the template's fixed tokens too (tokens_per_forward did not): they are what the model wrote
    assert data["new_tokens"] == data["filled_tokens"] == 5 < data["template_tokens"]
    assert data["tok_s"] == pytest.approx(5 / data["seconds"], rel=0.05)  # what the model wrote, per second
    assert data["tokens_per_forward"] == pytest.approx(5 / data["forward_passes"], abs=1e-3)


def test_infill_help_lists_no_length_flags(capsys):
    """An infill is as long as its template: the flags are refused, so the help does not offer them."""
    with pytest.raises(SystemExit):
        main(["infill", "--help"])
    out = capsys.readouterr().out
    assert "--hole-length" in out and "--max-new-tokens" not in out and "--min-new-tokens" not in out


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "9"], "--max-new-tokens: an infill is as long as its template"),
    (["--min-new-tokens", "2"], "--min-new-tokens: an infill is as long as its template"),
    (["--hole-length", "0"], "--hole-length: expected a positive integer, got 0"),
    (["--prefix", "caf\udcff"], "--prefix: not valid UTF-8 (byte 0xff at character 3)"),  # the byte, as chat's
])
def test_infill_flags_that_cannot_apply_are_named(capsys, args, message):
    assert main(["infill", "left <|hole|> right", "--model", MODEL, "--steps", "2", *args]) == 2
    assert message in capsys.readouterr().err


def test_info_json(capsys):
    assert main(["info", "--model", MODEL, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters_total"] > data["parameters_active"] > 0
    assert data["tokenizer"] is True


def test_info_shows_the_config_variants_a_checkpoint_sets(tmp_path, capsys):
    """A checkpoint may set an activation, attention biases and RoPE types other than DiffusionGemma's own (they run
    as in the reference); info says which this one has."""
    from reference import make_reference

    rope = {"full_attention": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    make_reference(tmp_path, hidden_activation="silu", attention_bias=True, rope_parameters=rope)
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["hidden_activation"], data["attention_bias"]) == ("silu", True)
    assert data["rope"] == {"sliding": "default", "full": "llama3"}
    assert main(["info", "--json"]) == 0  # the shipped model: DiffusionGemma's own
    data = json.loads(capsys.readouterr().out)
    assert (data["hidden_activation"], data["attention_bias"]) == ("gelu_pytorch_tanh", False)
    assert data["rope"] == {"sliding": "default", "full": "proportional"}


def test_info_shows_the_context_length(tmp_path, capsys):
    """Every "exceed the model's context" error counts against max_position_embeddings, which info did not show
    (text, --json or the summary): planning a long prompt meant opening config.json."""
    from reference import make_reference

    make_reference(tmp_path, max_position_embeddings=96)
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_position_embeddings"] == 96 and "context 96," in data["summary"]
    assert main(["info", "--model", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^ *max_position_embeddings: 96$", text, re.M)
    assert len({line.index(": ") for line in text.splitlines()}) == 1  # one column of names, the longest's


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_info_gives_the_kv_cache_bytes_a_token_takes(capsys, dtype):
    """Sizing --max-context or --max-batch needs the KV cache's bytes as well as the weights' (info gave only
    those): per token, what a cache blockpress allocates takes, every layer keeping every token."""
    assert main(["info", "--model", "random-tiny", "--dtype", dtype, "--json"]) == 0
    per_token = json.loads(capsys.readouterr().out)["kv_cache_bytes_per_token"]
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), dtype=dtype, device="meta")
    cache = lm.new_cache(1, 100)
    assert per_token * 100 == sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))


def test_info_on_a_random_26b_counts_without_allocating(capsys):
    assert main(["info", "--model", "random-26b-a4b", "--dtype", "bfloat16", "--json"]) == 0  # 50 GB if allocated
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cpu" and 25e9 < data["parameters_total"] < 26e9  # the figures are for --device
    assert 3.7e9 < data["parameters_active"] < 3.9e9 and data["weights_bytes"] == pytest.approx(2 * data["parameters_total"], rel=0.01)
    assert data["max_position_embeddings"] == 256 * 1024  # the released model's context: 256K tokens (it said 128K)


def test_weights_that_cannot_fit_are_refused_before_allocating(monkeypatch, capsys):
    import blockpress.checkpoint

    monkeypatch.setattr(blockpress.checkpoint, "available_bytes", lambda device: 10_000)
    with pytest.raises(ValueError, match=r"random_model: .* needs 0\.0 GB on cpu but 0\.0 GB are available"):
        blockpress.random_model(blockpress.ModelConfig.tiny())
    assert main(["generate", "x", "--model", "random-small", "--no-live"]) == 2  # the CLI: a one-line error
    assert "random_model: " in capsys.readouterr().err
    monkeypatch.setattr(blockpress.checkpoint, "available_bytes", lambda device: None)  # unknown: no check
    assert blockpress.random_model(blockpress.ModelConfig.tiny()).num_parameters() > 0


def test_a_checkpoint_that_cannot_fit_is_refused_before_reading(monkeypatch):
    """Loading converts (float32 from bf16, quantized) or copies to a GPU: checked first, like random_model. A
    CPU load in the file's own dtype maps the file and allocates nothing, so it is not refused."""
    import blockpress.checkpoint

    monkeypatch.setattr(blockpress.checkpoint, "available_bytes", lambda device: 10_000)
    with pytest.raises(ValueError, match=r"load: .*blockpress-code.* in float32: needs 0\.0 GB on cpu"):
        blockpress.load("blockpress-code", dtype="float32")
    with pytest.raises(ValueError, match=r"in bfloat16, int8: needs"):
        blockpress.load("blockpress-code", dtype="bfloat16", quantize="int8")
    assert blockpress.load("blockpress-code", dtype="bfloat16").dtype == torch.bfloat16  # mapped, not copied


def test_chat_reuses_cache(monkeypatch, capsys):
    import blockpress.lm

    seen = []
    original = blockpress.lm.LM.generate

    def spy(self, prompt, *a, **kw):
        cache = kw.get("cache")
        seen.append((len(prompt[0]), cache is not None and cache.length > 0))
        return original(self, prompt, *a, **kw)

    monkeypatch.setattr(blockpress.lm.LM, "generate", spy)
    lines = iter(["hello there", "", "and again", "/exit"])  # a blank line is skipped, not the end
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "6", "--steps", "2"]) == 0
    assert len(seen) == 2
    assert seen[0][1] is False and seen[1][1] is True  # the second turn continues the cache
    assert seen[1][0] < seen[0][0] + 6 + 20  # ... and does not re-encode the whole conversation
    assert replies(capsys.readouterr().err) == 2


def replies(err):
    """Chat replies made: each ends with its stats line on stderr (piped, stdout holds the replies alone)."""
    return err.count(" tok/s]")


def test_a_bad_turn_does_not_end_the_chat(monkeypatch, capsys):
    """A message longer than the context used to end the whole session; now it is dropped and the chat goes on,
    and the next turn still continues the cache of the turns before."""
    from blockpress.cli.common import load_model

    lm = load_model(MODEL, None, "cpu")
    cfg = lm.config
    context, canvas = cfg.text.max_position_embeddings, cfg.canvas_length

    def length(k):
        return len(lm.chat_prompt([{"role": "user", "content": "x " * k}]))

    k = next(k for k in range(context - canvas, 0, -1) if length(k) <= context - canvas)  # alone: one canvas left
    lines = iter(["hello there", "x " * k, "and again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "6", "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert replies(captured.err) == 2
    assert "error: no room for a reply: the conversation with this message holds" in captured.err
    # what a reply needs (free positions short of a canvas are no room): it said only what the conversation held
    assert f", and a reply needs a whole canvas of {canvas} tokens;" in captured.err
    assert "that message was dropped" in captured.err and "/reset starts a new one" in captured.err


def test_chat_a_message_too_long_for_any_conversation_is_not_told_to_reset(monkeypatch, capsys):
    """A message that alone outgrows the context, sent after a turn, was refused with "no room for a reply ...
    /reset starts a new one" (a 10,500-character paste: 6043 tokens of 4096), and after /reset the same message
    was refused again, the conversation lost for nothing. It is "too long" wherever it comes, the turns kept."""
    from blockpress.cli.common import load_model

    context = load_model(MODEL, None, "meta").config.text.max_position_embeddings
    lines = iter(["hello there", "x " * context, "and again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "6", "--steps", "2", "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    error = out[1]["error"]
    assert error.startswith("the message is too long: ") and "shorten it" in error and "/reset" not in error
    assert out[2]["cached_tokens"] > 0  # the third turn continues the first: the conversation was kept


def second_turn_fails(monkeypatch, failure: BaseException | type[BaseException]) -> list[int]:
    """LM.generate spied on: the list returned gets the cache length each turn finds; the second turn writes itself
    into the cache, then raises `failure` (a Ctrl-C, a GPU out of memory)."""
    import blockpress.lm

    seen = []
    original = blockpress.lm.LM.generate

    def spy(self, prompt, *a, **kw):
        cache = kw.get("cache")
        seen.append(0 if cache is None else cache.length)
        if len(seen) == 2:
            original(self, prompt, *a, **{**kw, "max_new_tokens": 2})
            raise failure
        return original(self, prompt, *a, **kw)

    monkeypatch.setattr(blockpress.lm.LM, "generate", spy)
    return seen


def test_chat_reset_and_ctrl_c(monkeypatch, capsys):
    """Ctrl-C stops a reply and keeps the conversation (its cache back to the turns before); /reset starts over;
    Ctrl-D ends the line for the shell."""
    seen = second_turn_fails(monkeypatch, KeyboardInterrupt)  # the user stops it
    lines = iter(["hello there", "stop this one", "and again", "/reset", "fresh start"])

    def typed(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "6", "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert replies(captured.err) == 3 and "(stopped; that message was dropped" in captured.err
    assert seen[1] == seen[2] > 0  # the third turn found the cache as the first left it
    assert seen[3] == 0  # after /reset: nothing cached
    assert captured.err.endswith("\n")


@pytest.mark.parametrize("as_json", [False, True])
def test_infill_ctrl_c_says_it_was_interrupted(monkeypatch, capsys, as_json):
    """Ctrl-C during infill exited 130 with nothing on stdout or stderr, where generate says it was cut short."""
    import blockpress.lm

    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(blockpress.lm.LM, "infill", interrupted)
    assert main(["infill", "x = <|hole:2|>", "--model", MODEL, "--seed", "3",
                 *(["--json"] if as_json else [])]) == 130
    captured = capsys.readouterr()
    assert "interrupted (an infill is printed once every hole is filled)" in captured.err
    if as_json:  # the seed asked for, as generate's object gives it (docs/cli.md, "Seeds in --json")
        assert json.loads(captured.out) == {"text": None, "fills": None, "template": "x = <|hole:2|>", "seed": 3,
                                            "interrupted": True}
    else:
        assert captured.out == ""


def test_chat_replies_are_never_empty_by_default():
    assert build_parser().parse_args(["chat"]).min_new_tokens == 1
    assert build_parser().parse_args(["chat", "--min-new-tokens", "0"]).min_new_tokens == 0
    assert build_parser().parse_args(["generate", "x"]).min_new_tokens == 0


@pytest.mark.parametrize("command", ["generate", "infill", "chat", "info", "quantize"])
def test_help_explains(command, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--help"])
    assert exc.value.code == 0
    assert "--model" in capsys.readouterr().out


def subcommands():
    import argparse

    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def documentation() -> str:
    """The README and every page of docs/, one text."""
    root = Path(__file__).resolve().parents[1]
    return "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])


def test_every_flag_the_readme_gives_a_command_exists():
    """Each `blockpress CMD ... --flag` the README and docs/ write (their command lines and the commands quoted in
    their prose) is a flag of that command's parser, so a renamed or dropped flag fails here, not in a reader's
    shell."""
    readme = documentation()
    commands = subcommands()
    pattern = r"blockpress (" + "|".join(commands) + r")\b([^\n`]*)"
    seen, missing = 0, []
    for match in re.finditer(pattern, readme):
        command, rest = match.groups()
        known = {flag for action in commands[command]._actions for flag in action.option_strings}
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            seen += 1
            if flag not in known:
                missing.append(f"blockpress {command} {flag}")
    assert seen > 50, "the README's command lines were not found"
    assert not missing, f"the README names flags its commands do not take: {missing}"


@pytest.mark.parametrize("command", ["generate", "infill", "chat"])
def test_t_min_help_says_where_the_schedule_ends(command):
    """--t-min's help said "temperature at the last step", which the schedule never reaches: it ends at
    t_min + (t_max - t_min) / steps, as the reference's does (1.375, not 1.0, for 4 steps from 2.5 to 1.0)."""
    from blockpress.sampling import temperature

    help_text = " ".join(subcommands()[command].format_help().split())
    assert "temperature at the last step" not in help_text
    assert "--t-min + (--t-max - --t-min) / --steps at the last" in help_text
    cfg = blockpress.SamplerConfig(t_max=2.5, t_min=1.0, max_denoising_steps=4)
    assert float(temperature(cfg, 1)) == pytest.approx(cfg.t_min + (cfg.t_max - cfg.t_min) / 4)
    assert float(temperature(cfg, 4)) == pytest.approx(cfg.t_max)


@pytest.mark.parametrize("command", ["generate", "infill", "chat", "sudoku", "serve"])
def test_cuda_graphs_help_says_which_dtype_the_check_reads(command):
    """Every --cuda-graphs help said a checkpoint that stores bf16 needs no --dtype; sudoku loads float32 unless told
    (its --dtype's default), and so refused blockpress-sudoku (stored in bf16) on a GPU. The help says what the
    check reads: the command's own --dtype default where it has one."""
    from blockpress.cli.common import check_cuda_graphs

    parser = subcommands()[command]
    help_text = " ".join(parser.format_help().split())
    default = parser.get_default("dtype")
    assert ("--dtype bfloat16 unless the checkpoint stores bf16" in help_text) == (default is None), command
    if default is not None:
        assert f"--dtype bfloat16: this command loads {default} unless told" in help_text
        args = argparse.Namespace(cuda_graphs=True, device="cuda", dtype=default, model="blockpress-sudoku")
        with pytest.raises(ValueError, match=f"needs bfloat16 weights .*, not {default}; run with --device cuda "
                                             "--dtype bfloat16"):
            check_cuda_graphs(args)  # (the flag's default, not the checkpoint's bf16: as the help now says)


@pytest.mark.parametrize("command", ["generate", "infill", "chat"])
def test_seed_help_shows_its_default(command):
    """The README says every --help includes defaults; --seed's said only "make the run reproducible"."""
    help_text = " ".join(subcommands()[command].format_help().split())
    assert "default: a fresh seed each run" in help_text


# Each command's required arguments, so that an unknown flag is the one thing wrong.
REQUIRED = {"generate": ["x"], "infill": ["x"], "train": ["--data", "d", "--out", "o"], "quantize": ["o"]}


@settings(max_examples=40, deadline=None)
@given(command=st.sampled_from(sorted(subcommands())), name=st.from_regex(r"zz[a-z]{1,8}", fullmatch=True),
       value=st.sampled_from(["", "=1"]), before=st.booleans())
def test_an_unknown_flag_is_the_commands_error(command, name, value, before):
    """`blockpress bench --model X` (any unknown flag of any command) got the top-level usage,
    `usage: blockpress [-h] [--version] COMMAND ...`, naming neither the command nor its flags. (A value rides
    in the flag's own word: `--zz 1 x` leaves argparse to take 1 for generate's prompt and x for the stray.)"""
    from contextlib import redirect_stderr

    flag = [f"--{name}{value}"]
    given_args = [command, *(flag if before else []), *REQUIRED.get(command, []), *([] if before else flag)]
    with pytest.raises(SystemExit) as exc, redirect_stderr(io.StringIO()) as stderr:
        main(given_args)
    err = stderr.getvalue()
    assert exc.value.code == 2
    assert err.startswith(f"usage: blockpress {command} ")
    assert f"blockpress {command}: error: unrecognized arguments: {' '.join(flag)}" in err


def test_info_offers_no_flag_it_ignores(capsys):
    """`info --help` listed --threads and --prefill-chunk, and `info --prefill-chunk -5 --threads 3` passed,
    ignored: info counts a model on the meta device and runs nothing. The commands that run one keep them."""
    helps = {command: parser.format_help() for command, parser in subcommands().items()}
    for flag in ("--threads", "--prefill-chunk"):
        assert flag not in helps["info"]
        assert all(flag in helps[c] for c in ("generate", "infill", "chat", "serve", "sudoku"))
        with pytest.raises(SystemExit):
            main(["info", flag, "3"])
        assert f"blockpress info: error: unrecognized arguments: {flag} 3" in capsys.readouterr().err


def test_quantize_help_ties_int8_bf16_to_cpus_with_native_bf16():
    """--quantize's help told every CPU "int8 (weights; on a CPU use --dtype bfloat16)": on one without native
    bf16 matmuls (an AVX2 EPYC) bf16 made int8 generate slower (4.1 -> 2.3 tok/s), and that CPU's default dtype is
    float32 for the same reason. The help names the condition checkpoint.cpu_computes_natively checks."""
    from blockpress.checkpoint import cpu_computes_natively

    text = " ".join(subcommands()["generate"].format_help().split())
    assert "on a CPU use --dtype bfloat16" not in text
    assert "pays only with native bf16 matmuls" in text and "float32 is faster" in text
    for instructions in ("AVX512-BF16", "AMX"):  # what the help tells users to look for is what the code checks
        assert instructions in text and instructions in cpu_computes_natively.__doc__


def test_bench_model_points_at_preset(capsys):
    """bench takes its random weights' shape as --preset; --model (as generate's random-small) said only
    "unrecognized arguments", under the top-level usage."""
    assert main(["bench", "--model", "random-small"]) == 2
    assert "blockpress bench: error: --model: bench times random weights of a preset's shape, never a checkpoint; " \
           "use --preset small" in capsys.readouterr().err
    assert main(["bench", "--model", "some/checkpoint"]) == 2
    assert "use --preset tiny, small, medium or 26b-a4b" in capsys.readouterr().err
    assert "--model" not in subcommands()["bench"].format_help()  # offered nowhere: it is not bench's


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_help_names_flags_not_setting_names(command):
    """`train --help` said "give heldout_data" (TrainConfig's field) where the user types --heldout-data. No
    command's help names one of its own settings by its underscored name (its dest, or the library's name a flag
    stands for in FLAG_OF) where a flag exists; a choice's value (the entropy_bound sampler) is no setting."""
    from blockpress.cli.common import flags_of

    parser = subcommands()[command]
    options = [a for a in parser._actions if a.option_strings]
    values = {str(c) for a in options for c in (a.choices or ())}
    flag_of = flags_of(command)
    text = parser.format_help()  # metavars are upper case: HELDOUT_DATA is no match
    leaks = {n: f for n, f in flag_of.items()
             if "_" in n and n not in values and re.search(rf"(?<![\w-]){n}(?![\w-])", text)}
    assert not leaks, f"{command} --help names settings where it means flags: {leaks}"


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_errors_name_only_flags_the_command_has(command):
    """One global map turned every library error's setting into one flag: bench's context errors named
    --max-new-tokens (its flag is --new-tokens) and `prompt` (--prompt-length). Each command's map names only
    its own flags, whatever setting a library error starts with."""
    from blockpress.cli.common import FLAG_OF, as_flags, flags_of

    flags = {s for a in subcommands()[command]._actions for s in a.option_strings}
    names = {n for per_command in FLAG_OF.values() for n in per_command} | {"max_new_tokens", "prompt", "new_tokens"}
    for name in names:
        message = as_flags(f"{name}: too many", flags_of(command))
        assert message == f"{name}: too many" or message.split(":")[0] in flags, (name, message)


@pytest.mark.parametrize("library, flag", [("max_new_tokens", "--new-tokens"), ("prompt", "--prompt-length"),
                                           ("new_tokens", "--new-tokens"), ("max_denoising_steps", "--steps")])
def test_bench_library_errors_name_bench_flags(monkeypatch, capsys, library, flag):
    import blockpress.bench as bench

    def refuse(settings, on_row=None):
        raise ValueError(f"{library}: 32 prompt + 140000 new tokens exceed the model's context")

    monkeypatch.setattr(bench, "run_bench", refuse)
    assert main(["bench", "--preset", "tiny", "--new-tokens", "16", "--steps", "1", "--no-reference"]) == 2
    assert f"blockpress bench: error: {flag}: 32 prompt + 140000" in capsys.readouterr().err


def test_every_rank_by_offers_every_ranking():
    """`sudoku --rank-by` offered entropy|margin while the other commands (and SamplerConfig) also take position."""
    from blockpress.sampling import RANKINGS

    offered = {name: tuple(a.choices) for name, p in subcommands().items() for a in p._actions if a.dest == "rank_by"}
    assert {"generate", "infill", "chat", "sudoku"} <= set(offered)
    assert all(choices == RANKINGS for choices in offered.values()), offered
    assert build_parser().parse_args(["sudoku", "." * 81, "--rank-by", "position"]).rank_by == "position"


def test_an_empty_prompt_is_bos_alone_in_every_generate(capsys, tmp_path):
    """An empty prompt is taken alike by lm.generate, lm.generate_ar, `generate ""`, `generate --ar ""` and an
    --input line {"prompt": ""} (the server's completions too: test_serve): BOS alone, the same text as BOS's id
    given as the prompt, as docs/cli.md and docs/python-api.md say."""
    from blockpress.cli.common import load_model

    lm = load_model("random-tiny", None, "cpu")  # the CLI's random-tiny, weights and tokenizer
    bos = lm.tokenizer.bos_id
    texts = {}
    for ar, kw in ((False, {"max_denoising_steps": 2}), (True, {})):
        run = lm.generate_ar if ar else lm.generate
        out = run("", max_new_tokens=4, seed=3, **kw)
        assert out.prompt_length == 1 and out.sequences[0, 0] == bos and out.num_new_tokens.tolist() == [4]
        assert out.texts == run([[bos]], max_new_tokens=4, seed=3, **kw).texts
        texts[ar] = out.texts[0]
    flags = ["--model", "random-tiny", "--max-new-tokens", "4", "--seed", "3"]
    for ar in (False, True):
        assert main(["generate", "", *flags, "--json", *(["--ar"] if ar else ["--steps", "2"])]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == texts[ar]
    (tmp_path / "in.jsonl").write_text('{"prompt": ""}\n')
    assert main(["generate", "--input", str(tmp_path / "in.jsonl"), *flags, "--steps", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == texts[False]


def test_an_empty_chat_message_is_a_turn_as_lm_chat_takes_it_and_the_repl_skips_it(capsys, tmp_path, monkeypatch):
    """An empty user message is a turn the chat template renders, as lm.chat and the server's chat completions take
    it: `generate --chat ""` and an --input line of it reply as lm.chat does (with --system it asks something). The
    REPL alone, where an empty message is a slip as a blank line is, sends none: an empty or whitespace-only \"\"\"
    block is said on one line and skipped, and the conversation goes on."""
    from blockpress.cli.common import load_model

    lm = load_model("random-tiny", None, "cpu")
    flags = ["--model", "random-tiny", "--max-new-tokens", "4", "--steps", "2", "--seed", "3", "--threads", "1"]
    for system in (None, "Greet the user."):
        messages = [{"role": "system", "content": system}] * (system is not None) + [{"role": "user", "content": ""}]
        want = lm.chat(messages, max_new_tokens=4, max_denoising_steps=2, seed=3).texts[0]
        given = ["--system", system] if system else []
        assert main(["generate", "", "--chat", *flags, *given, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == want
        (tmp_path / "in.jsonl").write_text(json.dumps({"messages": messages[-1:]}) + "\n" + '{"prompt": ""}\n')
        assert main(["generate", "--input", str(tmp_path / "in.jsonl"), "--chat", *flags, *given]) == 0
        assert [json.loads(x)["text"] for x in capsys.readouterr().out.splitlines()] == [want, want]
    sent = chat_turns(monkeypatch, ['"""', "  ", "\t", '"""', "hi"])
    assert sent == ["hi"]  # the block never reached the model
    assert capsys.readouterr().err.count("error: the message is empty; it was not sent\n") == 1


def test_bad_model_path_is_a_clear_error(capsys):
    # in this process: an exception main() does not turn into its message (a traceback in a real run) fails the test
    assert main(["generate", "x", "--model", "/no/such/folder"]) == 2
    err = capsys.readouterr().err
    assert "error: --model /no/such/folder: no such folder" in err and "Traceback" not in err
    assert "hf download" not in err  # a path is no model to download


@pytest.mark.parametrize("command", [["generate", "hi"], ["infill", "a<|hole|>"], ["chat"], ["serve"], ["info"],
                                     ["sudoku", "0" * 81], ["quantize", "q", "--quantize", "int8"],
                                     ["train", "--data", "d.jsonl", "--out", "o"]], ids=lambda c: c[0])
def test_a_model_not_found_is_named_by_its_flag(command, capsys, monkeypatch, tmp_path):
    """A model not found read "error: model 'nope': ..." where every other error names the flag: it is the flag and
    the value typed, as a shell takes it ('--model 'my model': ...'), in every command that takes --model."""
    monkeypatch.chdir(tmp_path)  # (quantize's and train's folders, were they made)
    for typed, shown in [("nope", "--model nope: "), ("my model", "--model 'my model': "),
                         ("blockpress-cod", "--model blockpress-cod: ")]:
        assert main([*command, "--model", typed]) == 2
        assert capsys.readouterr().err.split("error: ", 1)[1].startswith(shown), (command, typed)


@settings(max_examples=200, deadline=None)
@given(value=st.text(min_size=1), rest=st.text().filter(lambda t: "\n" not in t))
def test_as_flags_names_a_valued_setting_as_typed(value, rest):
    """A library error naming its setting and value ("model 'x': ...") names the flag and the value a shell reads
    back as the value typed; one that is not printable keeps Python's repr, escapes and all."""
    import shlex

    from blockpress.cli.common import as_flags

    message = as_flags(f"model {value!r}: {rest}", {"model": "--model"})
    flag, _, shown = message.partition(" ")
    assert flag == "--model" and message.endswith(f": {rest}")
    shown = shown[:len(shown) - len(rest) - 2]
    assert (shlex.split(shown) == [value]) if value.isprintable() else shown == repr(value)
    assert as_flags(f"model {value!r}: {rest}", {"prompt": "--prefix"}) == f"model {value!r}: {rest}"


@settings(max_examples=60, deadline=None)
@given(command=st.sampled_from(["generate", "infill", "chat"]),
       temperature=st.one_of(st.just(0.0), st.floats(0.01, 2.0)),
       sampler=st.sampled_from([None, "entropy_bound", "confidence", "topk", "greedy"]),
       default=st.sampled_from(["entropy_bound", "greedy", "confidence", "topk"]), candidates=st.sampled_from(["sample", "argmax"]),
       bound=st.sampled_from([None, 0.3]), confidence=st.sampled_from([None, 0.5]))
def test_temperature_flag_is_the_servers_temperature(command, temperature, sampler, default, candidates, bound,
                                                     confidence):
    """There was no --temperature (OpenAI's; SamplerConfig.draw_temperature): only --t-max/--t-min, which move
    acceptance too. Given, it decodes as the server decodes a request with that temperature and sampler, over
    the checkpoint's settings (blockpress-code's greedy sampler then samples); a setting the sampler asked for
    ignores is refused by both alike."""
    pytest.importorskip("fastapi")
    from types import SimpleNamespace

    from blockpress.cli.common import sampling_kwargs
    from blockpress.serve import APIError, CompletionRequest, sampler_config

    defaults = blockpress.SamplerConfig(sampler=default, candidates=candidates)
    given_args = [command, "x"][: 1 if command == "chat" else 2] + ["--temperature", str(temperature)]
    for flag, value in (("--sampler", sampler), ("--entropy-bound", bound), ("--confidence", confidence)):
        given_args += [flag, str(value)] if value is not None else []
    args = build_parser().parse_args(given_args)
    body = CompletionRequest(model="m", prompt="x", temperature=temperature, sampler=sampler, entropy_bound=bound,
                             confidence=confidence)
    if sampler == "greedy" and temperature != 0:  # the server keeps greedy (a client's habit); the CLI refuses it
        with pytest.raises(ValueError, match=f"--temperature {temperature}: --sampler greedy takes the most likely"):
            sampling_kwargs(args, SimpleNamespace(sampler_defaults=defaults))
        return
    try:
        server = sampler_config(defaults, body)
    except APIError as exc:
        with pytest.raises(ValueError) as refused:
            sampling_kwargs(args, SimpleNamespace(sampler_defaults=defaults))
        assert str(refused.value) == exc.message and exc.param in ("entropy_bound", "confidence")
        return
    cli = sampling_kwargs(args, SimpleNamespace(sampler_defaults=defaults))["sampler"]
    assert cli == server
    if temperature == 0:  # the rule asked for, else the checkpoint's, over the most likely candidates
        assert cli.sampler == (sampler or default) and cli.argmax_candidates and cli.draw_temperature == 1.0
        assert confidence is None or cli.confidence == confidence
        assert bound is None or cli.entropy_bound == bound
    else:
        assert cli.sampler == "greedy" if sampler == "greedy" else (
            not cli.argmax_candidates and cli.draw_temperature == temperature)


def test_a_sampler_flag_the_sampler_ignores_is_refused_and_confidence_is_read(capsys):
    """`--sampler topk --entropy-bound 50` ran as if the bound were not there, and the confidence sampler's own
    threshold had no flag. Now the ignored flag is refused by name, with the sampler that ignores it (a
    checkpoint's default sampler too: sudoku's topk), and --confidence reaches the sampler's settings."""
    base = ["generate", "x", "--model", "random-tiny", "--max-new-tokens", "8", "--steps", "3", "--seed", "3",
            "--json", "--threads", "1"]
    for sampler, flag in (("topk", "--entropy-bound"), ("confidence", "--entropy-bound"), ("topk", "--confidence"),
                          ("greedy", "--confidence"), ("entropy_bound", "--confidence")):
        assert main(base + ["--sampler", sampler, flag, "0.5"]) == 2
        err = capsys.readouterr().err
        assert f"{flag}: the {sampler} sampler does not read it" in err and "Traceback" not in err
    assert main(base + ["--sampler", "confidence", "--confidence", "1.5"]) == 2
    assert "--confidence: expected a probability in (0, 1], got 1.5" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "random-tiny", "--sampler", "confidence", "--confidence", "0.5",
                 "--max-new-tokens", "8", "--steps", "2", "--json", "--threads", "1"]) == 0
    capsys.readouterr()
    if "blockpress-sudoku" in blockpress.shipped_models():
        assert main(["sudoku", "." * 81, "--confidence", "0.5", "--threads", "1"]) == 2
        assert "--confidence: the topk sampler (the default here) does not read it" in capsys.readouterr().err
    for command in ("generate", "infill", "chat", "sudoku"):
        assert "--confidence" in subcommands()[command].format_help()


def test_temperature_0_keeps_the_sampler_asked_for(capsys):
    """`--sampler confidence --confidence X --temperature 0` ran the greedy sampler whatever X was (the same text
    as `--sampler greedy`): temperature 0 swapped the sampler. Now it keeps the confidence rule, with argmax
    candidates, so the threshold is read; without --sampler, 0 is still greedy. Either way a run repeats."""
    if MODEL != "blockpress-code":
        pytest.skip("random weights are too flat for a threshold to tell apart")
    base = ["generate", "def f(x):", "--model", MODEL, "--max-new-tokens", "16", "--json", "--threads", "1",
            "--temperature", "0"]

    def run(*extra):
        assert main(base + list(extra)) == 0
        out = json.loads(capsys.readouterr().out)
        return out["text"], out["forward_passes"]

    low, high = run("--sampler", "confidence", "--confidence", "0.5"), run("--sampler", "confidence", "--confidence", "0.99")
    assert low != high
    assert run("--sampler", "confidence", "--confidence", "0.5") == low  # no seed: argmax candidates start at seed 0
    assert run() == run("--sampler", "greedy") != low


def test_a_temperature_the_greedy_sampler_would_ignore_is_refused(capsys):
    """`--sampler greedy --temperature 0.7` ran greedy, the temperature unread (seeds 1 and 2 gave the same text),
    where the library refuses a draw temperature with greedy: it is refused by name, exit 2; 0 is taken."""
    base = ["generate", "x", "--model", "random-tiny", "--max-new-tokens", "4", "--steps", "2", "--json",
            "--threads", "1", "--sampler", "greedy"]
    assert main(base + ["--temperature", "0.7"]) == 2
    err = capsys.readouterr().err
    assert "error: --temperature 0.7: --sampler greedy takes the most likely candidates" in err
    assert "Traceback" not in err
    assert main(base + ["--temperature", "0"]) == 0


def test_temperature_flag_changes_the_draws_and_names_itself(capsys):
    # a whole canvas of random-tiny (16): cut to 8, the one position a step accepts among them drew alike
    base = ["generate", "x", "--model", "random-tiny", "--max-new-tokens", "16", "--steps", "2", "--seed", "3",
            "--json", "--threads", "1"]
    texts = []
    for extra in ([], ["--temperature", "1"], ["--temperature", "0.05"]):
        assert main(base + extra) == 0
        texts.append(json.loads(capsys.readouterr().out)["text"])
    assert texts[0] == texts[1] != texts[2]  # 1: the checkpoint's draws; a low one draws other tokens
    assert main(base + ["--temperature", "-1"]) == 2
    assert "error: --temperature: expected a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--steps", "-4"), ("--steps", "2147483648"), ("--presence-penalty", "3"),
                                         ("--threads", "-2")])
def test_bad_argument_is_a_clear_error(flag, value, capsys):
    """The error names the flag typed (the library's checks name max_denoising_steps, presence_penalty). In
    process: the exit status and message are main()'s (a subprocess paid torch's import for each; the end-to-end
    exit status is test_bad_model_path_is_a_clear_error's)."""
    assert main(["generate", "x", "--model", MODEL, flag, value]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: " in err and "Traceback" not in err


def test_bench_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "16", "--steps", "2",
                 "--repeats", "1", "--plot", str(tmp_path / "p.png"), "--out", str(tmp_path / "b.json")]) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 2] and "partial" not in data  # (a run cut short's is marked)
    assert data["machine"]["device"] == "cpu" and isinstance(data["machine"]["native_bf16"], bool)
    assert data["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    for row in data["rows"]:
        for engine in ("blockpress", "blockpress_ar", "reference"):
            assert row[engine]["tok_s"] > 0 and row[engine]["new_tokens"] == 16 * row["batch"]
        assert row["blockpress"]["forward_passes"] == 2 * 1  # one 16-token canvas, 2 fixed steps
        assert row["gemm_ms_per_step"] > 0 and row["speedup_bound_at_this_precision"] > 0
        assert row["speedup_vs_reference"] == pytest.approx(row["blockpress"]["tok_s"] / row["reference"]["tok_s"])
        for engine in ("blockpress", "blockpress_ar", "reference"):  # a CPU run reports the heap's growth (null
            grown = row[engine]["peak_memory_growth_gb"]  # for a run over before the sampler's first sample)
            assert grown is None or grown >= 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bench_leaves_out_a_reference_too_old_to_load_the_checkpoint_and_says_so(monkeypatch, capsys):
    """transformers 5.15-5.19 cannot build a model from a config with no vision_config, which blockpress saves for a
    text-only model: bench failed inside from_pretrained, the whole run with it. It runs without the reference."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "__version__", "5.19.0")
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "--new-tokens", "16", "--steps", "1",
                 "--repeats", "1", "--no-ar"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["reference_available"] is False and "reference" not in data["rows"][0]
    assert ("bench: the reference is left out: transformers 5.19.0 cannot load the checkpoint blockpress saves; it "
            "needs 5.20 or later") in err.splitlines()


@pytest.mark.parametrize("where", ["from_pretrained", "generate"])
def test_bench_leaves_out_a_reference_that_fails_and_says_so(monkeypatch, capsys, where):
    """Any failure of the reference's (python -OO: transformers reads docstrings it strips; -W error: a torch
    DeprecationWarning inside its generate) ended the whole run, exit 2 or a traceback never naming the reference."""
    transformers = pytest.importorskip("transformers")

    def fails(*args, **kwargs):
        raise DeprecationWarning("something torch deprecates")

    cls = transformers.DiffusionGemmaForBlockDiffusion
    monkeypatch.setattr(cls, where, classmethod(fails) if where == "from_pretrained" else fails)
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "--new-tokens", "16", "--steps", "1",
                 "--repeats", "1", "--no-ar"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["reference_available"] is False and data["rows"][0]["blockpress"]["tok_s"] > 0
    assert ("bench: the reference is left out: transformers failed (DeprecationWarning: something torch deprecates); "
            "--no-reference leaves it out without trying") in err.splitlines()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads this process's mappings")
def test_bench_reference_maps_nothing_of_the_folder_it_was_loaded_from(monkeypatch):
    """The reference was loaded (by transformers, as views of the mapped model.safetensors) from a temporary folder
    removed as _reference returned, while it still mapped the file. Windows refuses to delete a mapped file: the
    cleanup raised outside the reference's own failure handling and `bench` ended at its first canvas. Simulated:
    the folder's cleanup refuses, as Windows does, while this process maps a file in it."""
    pytest.importorskip("transformers")
    from blockpress import bench

    class WindowsTemporaryDirectory(tempfile.TemporaryDirectory):
        def cleanup(self):
            with open("/proc/self/maps") as maps:
                mapped = [line.split(None, 5)[5].strip() for line in maps if self.name + os.sep in line]
            if mapped:
                raise PermissionError(13, "The process cannot access the file because it is being used by another "
                                      "process", mapped[0])
            super().cleanup()

    monkeypatch.setattr(bench.tempfile, "TemporaryDirectory", WindowsTemporaryDirectory)
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    ref = bench._reference(lm)
    assert ref is not None
    # the copies are the weights: the tied embedding stays one tensor
    assert ref.get_output_embeddings().weight is ref.get_input_embeddings().weight


def test_bench_leaves_out_a_transformers_without_diffusiongemma_and_says_so(monkeypatch, capsys):
    """A transformers 4 (which peft's loose requirements pull in) has no DiffusionGemmaForBlockDiffusion: the
    reference was left out without a word, while the progress line said it was being built."""
    import sys
    import types

    old = types.ModuleType("transformers")  # as transformers 4 is, for this: a version and no DiffusionGemma
    old.__version__ = "4.46.3"
    monkeypatch.setitem(sys.modules, "transformers", old)
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "--new-tokens", "16", "--steps", "1",
                 "--repeats", "1", "--no-ar"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["reference_available"] is False
    assert ("bench: the reference is left out: transformers 4.46.3 has no DiffusionGemma; it needs 5.20 or later"
            in err.splitlines())


def test_bench_says_each_row_on_stderr_as_it_goes(capsys):
    """bench said nothing until it ended: a run cut by a timeout (the GPU session's) left an empty log. Now a line
    as each model is built and as each row starts and ends; stdout is still the JSON alone."""
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "16", "--steps", "1",
                 "--repeats", "1", "--no-reference"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)["rows"]
    lines = err.splitlines()
    assert lines[0] == "bench: canvas 16: building the tiny model (float32, cpu)"
    for i, row in enumerate(rows):
        assert lines[1 + 2 * i] == f"bench: batch {row['batch']}, canvas 16: warming up and timing each engine (1 run each)"
        assert re.fullmatch(rf"bench: batch {row['batch']}, canvas 16: done in \d+ s \(tok/s: blockpress "
                            rf"{row['blockpress']['tok_s']:.1f}, blockpress_ar {row['blockpress_ar']['tok_s']:.1f}\)",
                            lines[2 + 2 * i])
    assert len(lines) == 1 + 2 * len(rows)


def test_bench_writes_each_row_as_it_is_measured(tmp_path, monkeypatch):
    """The GPU session's sweep runs under a timeout: --out and --plot were written only at the end, so a sweep cut
    short left nothing of the batch sizes it had measured. Here the second batch size fails."""
    pytest.importorskip("matplotlib")
    import blockpress.bench as bench

    real_row = bench._bench_row

    def failing_at_batch_2(lm, ref, variants, b, s, ar):
        if b == 2:
            raise RuntimeError("CUDA out of memory (stand-in)")
        return real_row(lm, ref, variants, b, s, ar)

    monkeypatch.setattr(bench, "_bench_row", failing_at_batch_2)
    out, plot = tmp_path / "b.json", tmp_path / "p.png"
    with pytest.raises(RuntimeError, match="stand-in"):
        main(["bench", "--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "8", "--steps", "1",
              "--repeats", "1", "--no-reference", "--out", str(out), "--plot", str(plot)])
    data = json.loads(out.read_text())
    assert data["partial"] is True and [r["batch"] for r in data["rows"]] == [1]
    assert data["rows"][0]["blockpress"]["tok_s"] > 0 and data["rows"][0]["diffusion_over_ar"] > 0
    assert plot.stat().st_size > 1000 and sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "p.png"]


@pytest.mark.parametrize("with_out", [False, True])
def test_bench_interrupted_prints_the_rows_measured(tmp_path, monkeypatch, capsys, with_out):
    """A Ctrl-C exited 130 with nothing on stdout and nothing said: without --out every row measured was lost."""
    import blockpress.bench as bench

    real_row = bench._bench_row

    def interrupted_at_batch_2(lm, ref, variants, b, s, ar):
        if b == 2:
            raise KeyboardInterrupt
        return real_row(lm, ref, variants, b, s, ar)

    monkeypatch.setattr(bench, "_bench_row", interrupted_at_batch_2)
    out = tmp_path / "b.json"
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "8", "--steps", "1",
                 "--repeats", "1", "--no-reference",
                 *(["--out", str(out), "--plot", str(tmp_path / "p.png")] if with_out else [])]) == 130
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["partial"] is data["interrupted"] is True and [r["batch"] for r in data["rows"]] == [1]
    assert data["rows"][0]["blockpress"]["tok_s"] > 0
    said = captured.err.strip().splitlines()[-1]
    assert said.startswith("bench: interrupted after 1 row (their JSON on stdout")
    if with_out:  # the same bytes: the file named the plot, and put its two marks in the other order
        assert f"and in {out}" in said and out.read_text() == captured.out and data["plot"] == str(tmp_path / "p.png")


def test_bench_interrupted_before_a_row_says_so(monkeypatch, capsys):
    import blockpress.bench as bench

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "_bench_row", interrupted)
    assert main(["bench", "--preset", "tiny", "--new-tokens", "8", "--steps", "1", "--no-reference"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines()[-1] == "bench: interrupted after 0 rows"


@pytest.mark.parametrize("with_out", [False, True])
def test_bench_out_of_memory_at_a_later_batch_prints_the_rows_measured(tmp_path, monkeypatch, capsys, with_out):
    """The memory pre-check is a floor: batch 4000 of the tiny preset passed it and then ran out of memory (a real
    address-space limit). Exit 1 with nothing on stdout, the batch-1 row lost, and the hint said "the rows measured
    so far are in --out" to a run given no --out. Now they are on stdout, marked partial, and said where."""
    import blockpress.bench as bench

    real_row = bench._bench_row

    def out_of_memory_at_batch_2(lm, ref, variants, b, s, ar):
        if b == 2:  # the CPU allocator's error, as torch raises it
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 4096000000 bytes. Error code 12 (Cannot allocate memory)")
        return real_row(lm, ref, variants, b, s, ar)

    monkeypatch.setattr(bench, "_bench_row", out_of_memory_at_batch_2)
    out = tmp_path / "b.json"
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "8", "--steps", "1",
                 "--repeats", "1", "--no-reference", "--threads", "1", *(["--out", str(out)] if with_out else [])]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["partial"] is True and "interrupted" not in data and [r["batch"] for r in data["rows"]] == [1]
    said, error = captured.err.strip().splitlines()[-2:]
    assert said == ("bench: stopped by an error after 1 row (their JSON on stdout"
                    + (f" and in {out}" if with_out else "") + ', marked "partial")')
    assert error.startswith("blockpress bench: error: the device ran out of memory (")
    assert error.endswith("; smaller --batch-sizes or --new-tokens take less") and "--out" not in error
    if with_out:
        assert json.loads(out.read_text()) == data


def test_bench_says_its_own_error_when_stdout_cannot_take_the_rows_measured():
    """The partial rows printed before the error is raised on: with stdout full (or its reader gone) that print's
    own error replaced the run's, so "cannot write to standard output" was said, never the out-of-memory."""
    if not os.path.exists("/dev/full"):  # (Linux's; macOS and Windows have no full device)
        pytest.skip("no /dev/full here")
    code = ("import sys, blockpress.bench as bench\n"
            "real = bench._bench_row\n"
            "def row(lm, ref, variants, b, s, ar):\n"
            "    if b == 2:\n"
            "        raise RuntimeError('[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can\\'t allocate '\n"
            "                           'memory: you tried to allocate 4096000000 bytes. Error code 12')\n"
            "    return real(lm, ref, variants, b, s, ar)\n"
            "bench._bench_row = row\n"
            "from blockpress.cli import main\n"
            "sys.exit(main(['bench', '--preset', 'tiny', '--batch-sizes', '1', '2', '--new-tokens', '8', '--steps',"
            " '1', '--repeats', '1', '--no-reference', '--threads', '1']))\n")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-c", code], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 1, done.stderr
    assert "error: the device ran out of memory (" in done.stderr.strip().splitlines()[-1], done.stderr


def test_peak_memory_on_cpu_sees_what_a_run_allocates():
    from blockpress.bench import PeakMemory

    with PeakMemory(torch.device("cpu"), interval=0.001) as mem:
        block = torch.ones(64, 1024, 1024)  # 256 MB, written, then freed before the block ends
        del block
    with PeakMemory(torch.device("cpu"), interval=0.001) as idle:
        time.sleep(0.05)
    assert mem.figures()["peak_memory_growth_gb"] >= 0.2
    assert 0 <= idle.figures()["peak_memory_growth_gb"] < 0.05


def test_peak_memory_of_a_run_over_before_its_first_sample_is_null():
    """A run that ends before the sampling thread's first sample was reported as growing by 0.0 GB, a figure it
    never measured (bench's AR engine at one new token on the tiny preset, however much it allocated)."""
    from blockpress.bench import PeakMemory

    with PeakMemory(torch.device("cpu"), interval=60) as mem:
        block = torch.ones(64, 1024, 1024)
        del block
    assert mem.figures() == {"peak_memory_growth_gb": None}


def test_peak_memory_on_cuda_leaves_out_what_was_resident_before(monkeypatch):
    """Each engine's CUDA figure was the device-wide peak: blockpress's weights, the reference's copy and a
    quantized twin all stay resident, so every engine's figure carried all of them. It is now the peak beyond
    what was allocated at the run's start, as on a CPU. The allocator is faked: 6 GB resident, the run reaches
    6.5 GB."""
    from blockpress.bench import PeakMemory

    allocated = {"now": 6e9, "peak": 7e9}  # an earlier run's peak is forgotten by the reset

    def reset(device):
        allocated["peak"] = allocated["now"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated["peak"])
    with PeakMemory(torch.device("cuda")) as mem:
        allocated["peak"] = 6.5e9  # the run's caches and work, freed by its end
    assert mem.figures() == {"peak_memory_growth_gb": pytest.approx(0.5)}


def test_bench_variants_add_their_own_columns(monkeypatch):
    """--compile (and --cuda-graphs on a GPU) add a column per engine; torch.compile itself is stubbed out here."""
    import blockpress.bench as bench
    from blockpress.bench import BenchSettings, run_bench
    from blockpress.lm import LM

    enabled, reference_runs = [], []
    monkeypatch.setattr(LM, "compile", lambda self, **options: enabled.append("compile") or self)
    real_reference_run = bench._reference_run

    def counted(*args, **kwargs):
        row = real_reference_run(*args, **kwargs)
        reference_runs.append(row["seconds"])
        return row

    monkeypatch.setattr(bench, "_reference_run", counted)
    out = run_bench(BenchSettings(preset="tiny", batch_sizes=[1, 2], new_tokens=8, steps=2, repeats=1, compile=True))
    assert enabled == ["compile"]
    # Per batch size: a warm-up, a timed and a memory run, all engines (compiled ones included) taking turns.
    assert len(reference_runs) == 6
    for i, row in enumerate(out["rows"]):
        assert row["blockpress_compiled"]["new_tokens"] == 8 * row["batch"]
        assert row["compiled_over_eager"] == pytest.approx(row["blockpress_compiled"]["tok_s"] / row["blockpress"]["tok_s"])
        assert row["blockpress_ar_compiled"]["tok_s"] > 0
        assert "blockpress_cuda_graphs" not in row
        # Every ratio is against the reference's fastest (here: only) timed run.
        assert row["reference"]["seconds"] == reference_runs[3 * i + 1]
        for key in ("blockpress", "blockpress_compiled"):
            ratio = "speedup_vs_reference" if key == "blockpress" else "compiled_speedup_vs_reference"
            assert row[ratio] == pytest.approx(row[key]["tok_s"] / row["reference"]["tok_s"])


def test_bench_gives_every_engine_the_same_tries_and_times_ar_with_one_canvas(monkeypatch):
    """"Each engine's fastest of --repeats runs" was untrue with variants: the eager engines and the reference
    were re-timed beside each variant, (1 + variants) x repeats tries against the variants' repeats. And AR, which
    has no canvas, was re-timed for every canvas swept. Each engine (LM or reference object) now gets one warm-up,
    --repeats timed runs and one memory run; AR engines only with the first canvas. torch.compile is stubbed."""
    from collections import Counter

    import blockpress.bench as bench
    from blockpress.lm import LM

    monkeypatch.setattr(LM, "compile", lambda self, **options: self)
    runs, alive = Counter(), []  # alive: no engine's id is reused by a later one
    for name in ("_diffusion", "_ar", "_reference_run"):
        def counted(engine, *args, real=getattr(bench, name), name=name, **kwargs):
            alive.append(engine)
            runs[name, id(engine), kwargs.get("memory", False)] += 1
            return real(engine, *args, **kwargs)

        monkeypatch.setattr(bench, name, counted)
    out = bench.run_bench(bench.BenchSettings(preset="tiny", canvas_lengths=[2, 4], new_tokens=4, steps=1,
                                              prompt_length=2, repeats=2, compile=True, quantize="int8"))
    timed = {key: n for key, n in runs.items() if not key[2]}
    assert set(timed.values()) == {1 + 2} and set(n for key, n in runs.items() if key[2]) == {1}
    # per canvas: eager, compiled and int8 diffusion (and the reference); AR's three with the first canvas alone
    assert Counter(key[0] for key in timed) == Counter(_diffusion=6, _ar=3, _reference_run=2 * out["reference_available"])
    first, second = out["rows"]
    assert "blockpress_ar" in first and "blockpress_ar_int8" in first and "blockpress_ar" not in second
    assert second["diffusion_over_ar"] == pytest.approx(second["blockpress"]["tok_s"] / first["blockpress_ar"]["tok_s"])


def test_bench_compile_that_cannot_build_is_a_clear_error(monkeypatch, capsys):
    """Where torch.compile cannot build (no C++ compiler: a Windows install without MSVC; simulated by CXX pointing
    nowhere, it ended in 120 lines of torch._dynamo traceback), --compile is named with the cause, in one line.
    The failure is stubbed here: inductor's own error, raised by the first compiled step."""
    import torch

    import blockpress.generate as generate

    def unbuildable(fn, **options):
        def run(*args, **kwargs):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: "
                               "(None, 'cl')\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace")
        return run

    monkeypatch.setattr(generate.torch, "compile", unbuildable)
    assert generate.torch is torch
    assert main(["bench", "--preset", "tiny", "--canvas-lengths", "8", "--new-tokens", "8", "--steps", "2",
                 "--repeats", "1", "--no-reference", "--no-ar", "--compile"]) == 2
    err = capsys.readouterr().err
    assert ("blockpress bench: error: --compile: torch.compile could not compile blockpress's steps (RuntimeError: "
            "InvalidCxxCompiler: No working C++ compiler found") in err
    assert err.count("error:") == 1


def test_bench_cuda_graphs_on_cpu_is_a_clear_error(capsys):
    # in this process: an exception main() does not turn into its message (a traceback in a real run) fails the test
    assert main(["bench", "--preset", "tiny", "--cuda-graphs", "--new-tokens", "8", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-graphs: needs a CUDA device" in err and "Traceback" not in err


def counted_compile(monkeypatch) -> dict[str, list[str]]:
    """torch.compile as StepFunctions.compiled calls it, stubbed to run each function as it is (inductor takes
    minutes here), noting the thread of every call under the function's name: decode through `lm.compile()`'s
    steps, and the counts say so."""
    import threading

    import blockpress.generate as generate

    calls: dict[str, list[str]] = {}

    @functools.wraps(torch.compile)  # its signature, which StepFunctions.compiled reads for recompile_limit
    def compile_(fn, **options):
        calls.setdefault("dynamic", []).append(repr(options.get("dynamic")))
        calls.setdefault("recompile_limit", []).append(repr(options.get("recompile_limit")))

        def run(*args, **kwargs):
            calls.setdefault(fn.__name__, []).append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(generate.torch, "compile", compile_)
    return calls


SUDOKU = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


@pytest.mark.parametrize("args", [
    ["generate", "def f(x):", "--max-new-tokens", "20", "--steps", "3", "--seed", "1", "--json"],
    ["generate", "def f(x):", "--max-new-tokens", "6", "--ar", "--json"],
    ["infill", "def f(<|hole:4|>):\n    return x", "--steps", "3", "--seed", "1", "--json"],
    ["sudoku", SUDOKU, "--steps", "4", "--json"],
])
def test_compile_decodes_through_the_compiled_steps_and_gives_the_same_text(monkeypatch, capsys, args):
    """generate, infill, chat and sudoku had no --compile (only bench did): lm.compile() is applied after the load,
    its steps run every pass (a denoising step a decoder pass and a sampler step; --ar a token's encoder pass),
    and the answer is the eager run's."""
    model = [] if args[0] == "sudoku" else ["--model", MODEL]
    assert main([*args, *model]) == 0
    eager = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    calls = counted_compile(monkeypatch)
    assert main([*args, *model, "--compile"]) == 0
    captured = capsys.readouterr()
    compiled = [json.loads(line) for line in captured.out.splitlines()]
    untimed = lambda rows: [{k: v for k, v in row.items() if k not in ("tok_s", "seconds")} for row in rows]  # noqa: E731
    assert untimed(compiled) == untimed(eager) and compiled
    if "--ar" in args:  # the first token comes from the prompt's encode, each one after from a one-token pass
        assert len(calls["encode"]) == compiled[0]["new_tokens"] - 1 and "denoise" not in calls
    elif args[0] == "sudoku":
        assert len(calls["denoise"]) == len(calls["denoise_step"]) == compiled[0]["steps"]
    else:
        assert len(calls["denoise"]) == len(calls["denoise_step"]) == compiled[0]["forward_passes"]
    assert "--compile: the first steps of each batch size and prompt length compile" in captured.err
    assert calls["dynamic"] == ["None"] * 3  # torch's default; a limit for several kinds of batch, where torch has it
    assert calls["recompile_limit"] == [str(blockpress.generate.RECOMPILE_LIMIT)] * 3 or \
        "recompile_limit" not in inspect.signature(torch.compile).parameters


def test_chat_compile_decodes_through_the_compiled_steps(monkeypatch, capsys):
    lines = iter(["hello there", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    args = ["chat", "--model", MODEL, "--max-new-tokens", "6", "--steps", "2", "--seed", "3", "--json"]
    assert main(args) == 0
    eager = json.loads(capsys.readouterr().out.splitlines()[0])
    calls = counted_compile(monkeypatch)
    lines = iter(["hello there", "/exit"])
    assert main([*args, "--compile"]) == 0
    reply = json.loads(capsys.readouterr().out.splitlines()[0])
    assert reply["text"] == eager["text"] and len(calls["denoise"]) == reply["forward_passes"] > 0


@pytest.mark.parametrize("command", ["generate", "infill", "chat", "sudoku", "serve"])
@pytest.mark.parametrize("flags, needs", [([], "a model on a CUDA device, not cpu"),
                                          (["--device", "cuda", "--dtype", "float32"], "bfloat16 weights")])
def test_cuda_graphs_where_they_cannot_replay_is_one_line_before_loading(monkeypatch, capsys, command, flags, needs):
    """--cuda-graphs on a CPU, or in float32 (the experts' grouped GEMM on CUDA is bf16 only), is refused naming the
    flag and what it needs before the model loads (a 26B takes minutes), exit 2; with --compile too, argparse
    refuses the pair (lm.cuda_graphs() would replace the compiled steps)."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    given = {"generate": ["x"], "infill": ["a <|hole|>"], "sudoku": [SUDOKU], "serve": ["--port", "0"]}
    args = [command, *given.get(command, []), *(["--model", "random-tiny"] if command != "sudoku" else []), *flags]
    assert main([*args, "--cuda-graphs"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"blockpress {command}: error: --cuda-graphs: needs {needs}")
    assert "--device cuda --dtype bfloat16" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main([*args, "--compile", "--cuda-graphs"])
    assert exc.value.code == 2
    assert "error: argument --cuda-graphs: not allowed with argument --compile" in capsys.readouterr().err


def test_serve_compiles_before_it_answers_and_the_engine_runs_the_compiled_steps(monkeypatch, capsys):
    """serve --compile warms up before it says it serves: the first steps (a row alone over two canvases, then two
    rows of unequal prompts) run on the main thread before the engine thread that owns the model starts, so no
    client waits for the compile, and the requests then run the same compiled steps on the engine thread: a batch of
    three that shrinks as rows end, each with its own temperature, answered as the eager server answers them. The
    warm-up is neither counted in /metrics nor left in the prefix cache."""
    import concurrent.futures as cf

    bodies = [{"model": "random-tiny", "prompt": "a" * k, "max_tokens": 16 * k, "seed": k, "temperature": 0.5 + k / 4}
              for k in (1, 2, 3)]
    seen = []

    def send(http):
        seen.append({name: list(threads) for name, threads in calls.items()})  # as the server starts answering
        with cf.ThreadPoolExecutor(3) as pool:
            answers = [r.json()["choices"][0]["text"] for r in pool.map(
                lambda body: http.post("/v1/completions", json=body), bodies)]
        metrics = http.get("/metrics").text
        return answers, [line for line in metrics.splitlines() if re.match(r"blockpress_(requests|batches|prefix)", line)]

    answers = serve_answering(monkeypatch, send)
    calls: dict[str, list[str]] = {}
    assert main(["serve", "--model", "random-tiny", "--port", "0"]) == 0
    eager, eager_metrics = answers.pop()
    capsys.readouterr()
    calls = counted_compile(monkeypatch)
    assert main(["serve", "--model", "random-tiny", "--port", "0", "--compile"]) == 0
    compiled, metrics = answers.pop()
    err = capsys.readouterr().err
    assert compiled == eager
    warm = seen[-1]
    assert warm["denoise"] and set(warm["denoise"]) == set(warm["denoise_step"]) == {"MainThread"}
    assert set(calls["denoise"][len(warm["denoise"]):]) == {"blockpress-engine"}
    assert calls["dynamic"] == ["True"] * 3  # every size dynamic from the start: serve's shapes never settle
    # and room for more kinds of batch than torch's 8 graphs a step (past them a step ran eagerly), where torch has it
    assert calls["recompile_limit"] == [str(blockpress.generate.RECOMPILE_LIMIT)] * 3 or \
        "recompile_limit" not in inspect.signature(torch.compile).parameters
    said = [err.index(line) for line in ("--compile: compiling the model's steps (minutes on a CPU) with a few short "
                                         "generations before serving", "warmed up in", "blockpress serving 'random-tiny'")]
    assert said == sorted(said)
    # the requests and their prompts kept: as the eager server's (the warm-up's are in none of them). How the three
    # were batched is the engine's timing (on a busy CI machine the first came alone once: batches 2, the eager 1), so
    # the batches are counted, each run's own
    def batches(lines):
        return int(next(line for line in lines if line.startswith("blockpress_batches_total")).split()[1])

    def others(lines):
        return [line for line in lines if not line.startswith("blockpress_batches_total")]

    assert "blockpress_requests_total 3" in metrics and others(metrics) == others(eager_metrics)
    assert 1 <= batches(metrics) <= 3 and 1 <= batches(eager_metrics) <= 3


@pytest.mark.parametrize("args", [["serve", "--port", "0"], ["generate", "x", "--json"], ["generate", "x", "--ar"]])
def test_compile_that_cannot_build_is_one_line(monkeypatch, capsys, args):
    """Where torch.compile cannot build (no C++ compiler), --compile ended in a page of torch._dynamo traceback at
    the first step; it is bench's one line naming --compile and torch's reason, and serve stops so in its warm-up,
    before it says it serves. Stubbed: dynamo's error, raised by the first compiled step."""
    from torch._dynamo.exc import TorchDynamoException

    import blockpress.generate as generate

    def unbuildable(fn, **options):
        def run(*args, **kwargs):
            raise TorchDynamoException("InvalidCxxCompiler: No working C++ compiler found\n\nmore of torch's trace")
        return run

    answers = serve_answering(monkeypatch, lambda http: pytest.fail("served"))
    monkeypatch.setattr(generate.torch, "compile", unbuildable)
    assert main([*args, "--model", "random-tiny", "--compile"]) == 2
    err = capsys.readouterr().err
    assert (f"blockpress {args[0]}: error: --compile: torch.compile could not compile blockpress's steps "
            "(TorchDynamoException: InvalidCxxCompiler: No working C++ compiler found); run without --compile") in err
    assert "blockpress serving" not in err and "trace\n" not in err and err.count("error:") == 1 and not answers
    monkeypatch.undo()  # without --compile, dynamo's error is no compile failure of ours: it is raised as it is
    monkeypatch.setattr(generate.StepFunctions, "eager", lambda model: generate.StepFunctions(
        *[unbuildable(None)] * 3))
    with pytest.raises(TorchDynamoException):
        main(["generate", "x", "--model", "random-tiny"])


def test_bench_canvas_sweep(tmp_path):
    assert main(["bench", "--preset", "tiny", "--canvas-lengths", "4", "16", "--new-tokens", "16", "--steps", "2",
                 "--repeats", "1", "--no-ar", "--out", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["canvas"] for r in rows] == [4, 16]
    # 16 new tokens are four 4-token canvases or one 16-token canvas, 2 fixed steps each.
    assert [r["blockpress"]["forward_passes"] for r in rows] == [8, 2]
    assert [r["reference"]["new_tokens"] for r in rows] == [16, 16]
    assert all("blockpress_ar" not in r for r in rows)


def test_shipped_model_is_small_and_complete():
    if MODEL != "blockpress-code":
        pytest.skip("blockpress-code is not in this package")
    lm = blockpress.load("blockpress-code")
    folder = lm.path
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 25e6
    assert lm.tokenizer is not None and lm.tokenizer.chat_template
    assert lm.tokenizer.decode(lm.tokenizer.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    assert json.loads((folder / "corpus_manifest.json").read_text())["heldout_modules"]


def test_shipped_code_model_has_learned_held_out_python():
    """The shipped model on modules it never saw: next-token loss far below chance (ln 8192 = 9.0 nats for an
    untrained model), and greedy AR and block-diffusion bodies that parse. Thresholds sit below what the packaged model measures
    here (see the README), with room for platform numerics."""
    if MODEL != "blockpress-code":
        pytest.skip("blockpress-code is not in this package")
    import math

    import torch

    from blockpress.tasks.code import completion_parses, model_heldout_functions

    lm = blockpress.load("blockpress-code", dtype="float32")
    funcs = model_heldout_functions(lm.path)[:12]
    nll = []
    for f in funcs[:4]:
        ids = torch.tensor([lm.tokenizer.encode(f.prefix + f.body, add_bos=True)[-256:]])
        with torch.no_grad():
            logits = lm.model.encode(ids, lm.new_cache(1, ids.shape[1]), logits="all")
        nll.append(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    assert sum(nll) / len(nll) < CODE_NLL_MAX < math.log(lm.config.text.vocab_size)
    prompts = [lm.tokenizer.encode(f.prompt_text, add_bos=True)[-256:] for f in funcs]
    out = lm.generate_ar(prompts, max_new_tokens=48)
    assert sum(completion_parses(f, text) for f, text in zip(funcs, out.texts)) >= CODE_AR_PARSE_MIN
    out = lm.generate(prompts, max_new_tokens=48, seed=0)  # block diffusion, the checkpoint's own decoding
    assert sum(completion_parses(f, text) for f, text in zip(funcs, out.texts)) >= CODE_DIFFUSION_PARSE_MIN


def test_bench_engines_take_turns_and_keep_their_fastest_run():
    from blockpress.bench import _best_interleaved

    calls, times = [], {"a": iter([3.0, 1.0, 2.0, 9.0]), "b": iter([5.0, 6.0, 4.0, 9.0])}

    def engine(name):
        def run(memory=False):
            calls.append((name, memory))
            row = {"seconds": next(times[name]), "name": name}
            return {**row, "peak_memory_growth_gb": 0.5} if memory else row
        return run

    best = _best_interleaved(3, {"a": engine("a"), "b": engine("b")})
    # Timed runs never carry the memory sampler; one untimed run each afterwards measures memory.
    assert calls == [("a", False), ("b", False)] * 3 + [("a", True), ("b", True)]
    assert best == {"a": {"seconds": 1.0, "name": "a", "peak_memory_growth_gb": 0.5},
                    "b": {"seconds": 4.0, "name": "b", "peak_memory_growth_gb": 0.5}}


@pytest.mark.parametrize("gb", ["-1", "nan", "inf"])
def test_serve_rejects_a_negative_or_unbounded_prefix_cache_before_loading(capsys, monkeypatch, gb):
    """A budget must be a finite number of GiB (nan got 'cannot convert float NaN to integer', naming no flag,
    and inf an OverflowError traceback, both after the model had loaded)."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["serve", "--model", "random-tiny", "--prefix-cache-gb", gb]) == 2
    assert f"blockpress serve: error: --prefix-cache-gb: expected 0 (off) or more GiB, a finite number, got {gb}" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("name", ["", " ", "\t\n"])
def test_serve_refuses_an_empty_served_name_before_loading(capsys, monkeypatch, name):
    """--served-name "" served the model's default name without a word (an empty value read as no flag); one of
    spaces only would make an id no client sends. Refused by the flag, before the model loads."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["serve", "--model", "random-tiny", "--port", "0", "--served-name", name]) == 2
    assert f"blockpress serve: error: --served-name: expected the model id clients send, got {name!r}" in (
        capsys.readouterr().err)


def test_serve_refuses_a_bad_or_busy_port_before_loading(capsys, monkeypatch):
    """The port is bound before the model loads: one clear line, and no "serving" line for a server that never
    served (before: the line, then uvicorn's error; an out-of-range port a traceback)."""
    import socket

    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["serve", "--port", "99999"]) == 2
    assert "--port: expected 0-65535" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in err and "serving" not in err


@pytest.mark.parametrize("os_name, reused", [("posix", True), ("nt", False)])
def test_serve_rebinds_a_lingering_port_but_not_a_windows_port_in_use(monkeypatch, os_name, reused):
    """SO_REUSEADDR lets a restarted server bind while old connections linger (POSIX); on Windows the same option
    lets a second `blockpress serve` bind a port another server listens on, so both ran and clients reached either
    (before: set everywhere). Off where os.name is nt, as socket.create_server leaves it."""
    import socket

    import blockpress.cli.serve as serve_cli

    monkeypatch.setattr(serve_cli, "os", types.SimpleNamespace(name=os_name))
    sock = serve_cli.bind_socket("127.0.0.1", 0)
    try:
        assert bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)) is reused
    finally:
        sock.close()


def serve_answering(monkeypatch, send):
    """`blockpress serve` with uvicorn's place taken by a server that calls `send(http)` once, `http` a TestClient
    of the app serve built, and returns: the list each run's result is appended to."""
    from fastapi.testclient import TestClient

    import blockpress.cli.serve

    answers = []

    class Server:
        first_signal = None  # (no stop signal: the run ends by itself)

        def __init__(self, config):
            self.app = config.app

        def run(self, sockets):
            with TestClient(self.app) as http:
                answers.append(send(http))

    monkeypatch.setattr(blockpress.cli.serve, "_server_class", lambda: Server)
    return answers


def test_serve_log_level_and_access_log_reach_uvicorn_and_the_servers_own_lines(monkeypatch, capsys):
    """serve ran uvicorn at a fixed "warning" (its access log never shown), and the server's own lines went to
    logging's last resort (WARNING and above, whatever the operator wanted): --log-level and --no-access-log set both."""
    import logging

    import blockpress.cli.serve

    configs = []
    log = logging.getLogger("blockpress.serve")

    class Server:
        first_signal = None

        def __init__(self, config):
            configs.append(config)

        def run(self, sockets):  # the server's own lines, while it runs
            log.info("serve: an info line")
            log.warning("serve: a warning line")
            log.error("serve: an error line")

    monkeypatch.setattr(blockpress.cli.serve, "_server_class", lambda: Server)
    assert main(["serve", "--model", "random-tiny", "--port", "0"]) == 0
    config = configs.pop()
    assert config.log_level == "info" and config.access_log is True  # the defaults: vLLM's and uvicorn's
    err = capsys.readouterr().err
    assert all(f"serve: an {word} line" in err or f"serve: a {word} line" in err for word in ("info", "warning", "error"))
    assert main(["serve", "--model", "random-tiny", "--port", "0", "--log-level", "error", "--no-access-log"]) == 0
    config = configs.pop()
    assert config.access_log is False and logging.getLogger("uvicorn.error").level == logging.ERROR
    err = capsys.readouterr().err
    assert "serve: an error line" in err and "info line" not in err and "warning line" not in err
    logging.getLogger("uvicorn.error").setLevel(logging.INFO)  # (uvicorn's own loggers, as the next serve sets them)


def test_serve_behind_a_proxy_that_strips_root_path_answers_and_writes_its_urls_with_it(monkeypatch, capsys):
    """serve had no --root-path: behind a proxy that serves it at /llm (and strips it), /docs fetched /openapi.json,
    outside the proxy's prefix. The routes answer as without it, and the URLs the server writes carry it."""
    import threading

    import httpx
    import uvicorn

    import blockpress.cli.serve

    answers = []

    class Server(uvicorn.Server):  # uvicorn itself, with serve's config, asked once it is up
        first_signal = None

        def run(self, sockets=None):
            thread = threading.Thread(target=super().run, kwargs={"sockets": sockets}, daemon=True)
            thread.start()
            while not self.started and thread.is_alive():
                time.sleep(0.05)
            base = "http://{}:{}".format(*sockets[0].getsockname()[:2])
            answers.append([httpx.get(base + path, timeout=30) for path in ("/v1/models", "/docs", "/openapi.json")])
            self.should_exit = True
            thread.join(30)

    monkeypatch.setattr(blockpress.cli.serve, "_server_class", lambda: Server)
    assert main(["serve", "--model", "random-tiny", "--port", "0", "--root-path", "/llm", "--log-level", "error"]) == 0
    models, docs, schema = answers.pop()
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "random-tiny"
    assert "url: '/llm/openapi.json'" in docs.text and schema.json()["servers"] == [{"url": "/llm"}]
    monkeypatch.setattr(blockpress.cli.serve, "load_announced", lambda *a, **k: pytest.fail("loaded before the check"))
    for bad in ("llm", "/llm/", "/", "/a b"):
        assert main(["serve", "--port", "0", "--root-path", bad]) == 2
        assert f"--root-path: expected the path prefix the proxy strips, such as /llm (starting with /, no trailing " \
               f"slash), got {bad!r}" in capsys.readouterr().err
    # uvicorn writes the prefix into every request as ASCII: one past it passed the check, then dropped every request
    assert main(["serve", "--port", "0", "--root-path", "/modèle"]) == 2
    assert "--root-path: '/modèle' is not ASCII; give the prefix as the proxy sends it, percent-encoded " \
           "(/mod%C3%A8le for /modèle)" in capsys.readouterr().err


def test_serve_logs_to_a_stream_nothing_reads_without_a_traceback_a_line_and_leaves_its_loggers_as_they_were(
        monkeypatch, capsys):
    """The access log is on stdout: where nothing read it any more (`serve | tee log` after tee is gone), each request
    printed logging's ~90-line 'Logging error' traceback to stderr. And main(["serve"]) in a process that goes on left
    the "blockpress" loggers writing to its stream since closed ('I/O operation on closed file' at the next line)."""
    import logging

    import blockpress.cli.serve
    from blockpress.cli.serve import log_config

    read, write = os.pipe()
    os.close(read)  # the reader gone: a write is EPIPE (Python ignores SIGPIPE), BrokenPipeError
    config = log_config("info")
    dead = open(write, "w")
    try:
        for name in ("default", "access"):
            spec = dict(config["handlers"][name])
            module, _, cls = spec.pop("class").rpartition(".")
            handler = getattr(__import__(module, fromlist=[cls]), cls)(dead)
            handler.emit(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "GET /health", None, None))
    finally:
        with contextlib.suppress(OSError):
            dead.close()
    assert "Logging error" not in capsys.readouterr().err

    class Server:
        first_signal = None

        def __init__(self, config):
            pass

        def run(self, sockets):
            pass

    monkeypatch.setattr(blockpress.cli.serve, "_server_class", lambda: Server)
    ours = logging.getLogger("blockpress")
    before = ours.handlers[:], ours.level, ours.propagate
    try:  # (uvicorn.Config sets its logging up, log_config's, as it is made)
        assert main(["serve", "--model", "random-tiny", "--port", "0"]) == 0
    finally:
        after = ours.handlers[:], ours.level, ours.propagate
        ours.handlers[:], ours.level, ours.propagate = before
    assert after == before


def test_serve_caps_a_requests_context_with_max_context(monkeypatch, capsys):
    """create_app could cap a request's prompt + max_tokens, but serve had no flag for it: on a model with a 131072-token
    context, one client's max_tokens 100000 ran (and held the engine) for as long as it took."""
    answers = serve_answering(monkeypatch, lambda http: [http.post("/v1/completions", json={
        "model": "random-tiny", "prompt": "hello", "max_tokens": max_tokens, "seed": 1}) for max_tokens in (40, 16)])
    assert main(["serve", "--model", "random-tiny", "--port", "0", "--max-context", "40"]) == 0
    refused, answered = answers[0]
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "max_tokens", refused.text
    assert "max_tokens 40 (whole 16-token canvases: 48 positions) exceed the context of 40 tokens" in error["message"]
    assert answered.status_code == 200
    for bad, says in (("0", "--max-context: expected a positive integer, got 0"),
                      ("999999999", "--max-context: expected a positive integer of at most the model's context of")):
        assert main(["serve", "--model", "random-tiny", "--port", "0", "--max-context", bad]) == 2
        assert says in capsys.readouterr().err


def test_serve_lets_the_origins_named_call_it_from_a_browser(monkeypatch, capsys):
    """serve had no way to let a web front end on another origin call it (its preflight got a 405)."""
    import blockpress.cli.serve

    answers = serve_answering(monkeypatch, lambda http: http.options("/v1/completions", headers={
        "Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST"}))
    assert main(["serve", "--model", "random-tiny", "--port", "0", "--allowed-origins", "http://localhost:5173"]) == 0
    assert answers[0].status_code == 200
    assert answers[0].headers["access-control-allow-origin"] == "http://localhost:5173"
    monkeypatch.setattr(blockpress.cli.serve, "load_announced", lambda *a, **k: pytest.fail("loaded before the check"))
    assert main(["serve", "--port", "0", "--allowed-origins", "http://localhost:5173/"]) == 2
    assert "--allowed-origins: 'http://localhost:5173/' is not an origin" in capsys.readouterr().err


def test_serve_requires_the_api_key_from_the_flag_or_the_environment(monkeypatch, capsys):
    """serve had no key: on --host 0.0.0.0 anyone who reached the port could use the model. --api-key (else
    BLOCKPRESS_API_KEY) is required of /v1 requests; the startup line says a key is needed, never the key."""
    import blockpress.cli.serve

    answers = serve_answering(monkeypatch, lambda http: [http.get("/v1/models", headers=h).status_code for h in (
        {}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer s3cret-key"})])
    for args, env in ((["--api-key", "s3cret-key"], None), ([], "s3cret-key")):
        if env is None:
            monkeypatch.delenv("BLOCKPRESS_API_KEY", raising=False)
        else:
            monkeypatch.setenv("BLOCKPRESS_API_KEY", env)
        assert main(["serve", "--model", "random-tiny", "--port", "0", *args]) == 0
        assert answers.pop() == [401, 401, 200]
        err = capsys.readouterr().err
        assert "requests to /v1 need the API key" in err and "s3cret-key" not in err
    monkeypatch.delenv("BLOCKPRESS_API_KEY")
    assert main(["serve", "--model", "random-tiny", "--port", "0", "--host", "0.0.0.0"]) == 0
    assert answers.pop() == [200, 200, 200]  # no key: open, as before, and said so beyond loopback
    assert "\nwarning: no API key, so anyone who reaches 0.0.0.0:" in capsys.readouterr().err  # as every warning
    monkeypatch.setattr(blockpress.cli.serve, "load_announced", lambda *a, **k: pytest.fail("loaded before the check"))
    assert main(["serve", "--port", "0", "--api-key", " s3cret "]) == 2
    err = capsys.readouterr().err
    assert "--api-key: expected a non-empty key of printable ASCII" in err and "s3cret" not in err


def test_serve_names_the_variable_a_bad_api_key_came_from(monkeypatch, capsys):
    """A BLOCKPRESS_API_KEY with a secret file's trailing newline was refused as a bad --api-key, a flag the operator
    never gave."""
    import blockpress.cli.serve

    monkeypatch.setattr(blockpress.cli.serve, "load_announced", lambda *a, **k: pytest.fail("loaded before the check"))
    monkeypatch.setenv("BLOCKPRESS_API_KEY", "s3cret\n")
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: BLOCKPRESS_API_KEY: expected a non-empty key of printable ASCII" in err, err
    assert "--api-key" not in err and "s3cret" not in err
    assert main(["serve", "--port", "0", "--api-key", " k"]) == 2  # the flag, given, is still the one named
    assert "error: --api-key: expected" in capsys.readouterr().err


def test_serve_reads_the_api_key_from_a_file_named_by_api_key_file(monkeypatch, capsys, tmp_path):
    """The key could come only from --api-key, which the process list shows, or the variable: --api-key-file reads
    it from a file (a mounted secret), less its trailing newline, and a file that gives no key is refused by name."""
    import blockpress.cli.serve

    monkeypatch.delenv("BLOCKPRESS_API_KEY", raising=False)
    answers = serve_answering(monkeypatch, lambda http: [http.get("/v1/models", headers=h).status_code for h in (
        {}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer s3cret-key"})])
    key = tmp_path / "key"
    key.write_text("s3cret-key\n")
    assert main(["serve", "--model", "random-tiny", "--port", "0", "--api-key-file", str(key)]) == 0
    assert answers.pop() == [401, 401, 200]
    err = capsys.readouterr().err
    assert "requests to /v1 need the API key" in err and "s3cret-key" not in err
    monkeypatch.setattr(blockpress.cli.serve, "load_announced", lambda *a, **k: pytest.fail("loaded before the check"))
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "spaced").write_text(" s3cret \n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    for args, says in (
            ([str(tmp_path / "missing")], f"--api-key-file {tmp_path / 'missing'}: cannot read the key from it (No such "
                                          "file or directory)"),
            ([str(tmp_path)], f"--api-key-file {tmp_path}: cannot read the key from it (is a folder)"),
            ([str(tmp_path / "binary")], "cannot read the key from it (not UTF-8 text)"),
            ([str(tmp_path / "empty")], f"--api-key-file {tmp_path / 'empty'}: the file is empty; expected the key"),
            ([str(tmp_path / "spaced")], "--api-key-file: expected a non-empty key of printable ASCII"),
            ([str(key), "--api-key", "other"], "--api-key-file: not together with --api-key")):
        assert main(["serve", "--port", "0", "--api-key-file", *args]) == 2
        err = capsys.readouterr().err
        assert says in err and "s3cret" not in err, err


def test_serve_stops_on_sigterm_while_its_model_loads(monkeypatch, capsys):
    """serve loads its model (and warms up under --compile) before uvicorn takes the stop signals: a SIGTERM there
    killed it by the default action, without a word, where a Ctrl-C said "interrupted" and every other command says
    "stopped by SIGTERM"."""
    import signal

    import blockpress.cli.serve

    reached = []  # the handler found (pytest's SIG_DFL would end the test run): called, the signal was not taken
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: reached.append(signum))
    try:
        def load(*args, **kwargs):
            signal.raise_signal(signal.SIGTERM)
            pytest.fail("loading went on after the SIGTERM")

        monkeypatch.setattr(blockpress.cli.serve, "load_announced", load)
        monkeypatch.setattr(blockpress.cli.serve, "_server_class", lambda: pytest.fail("served after the SIGTERM"))
        assert main(["serve", "--model", "random-tiny", "--port", "0"]) == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert reached == []
    assert capsys.readouterr().err.endswith("blockpress serve: stopped by SIGTERM\n")


@pytest.mark.parametrize("flag", ["--max-batch", "--max-queue", "--max-stops"])
def test_serve_rejects_an_empty_batch_or_queue(flag):
    """A batch of 0 never took a request (every one hung, the engine spinning); a queue of 0 meant no limit."""
    from blockpress.cli.common import load_model
    from blockpress.serve import create_app

    assert main(["serve", "--model", "random-tiny", flag, "0"]) == 2
    name = flag[2:].replace("-", "_")
    with pytest.raises(ValueError, match=f"{name}: expected a positive integer"):
        create_app(load_model("random-tiny", None, "cpu"), **{name: 0})


@pytest.mark.parametrize("args, message", [
    (["--batch-sizes", "0"], "--batch-sizes: expected positive integers"),
    (["--canvas-lengths", "0"], "--canvas-lengths: expected positive integers"),
    (["--repeats", "0"], "--repeats: expected a positive integer"),
    # the sampler's bound was met once the model was built and the first row timing (26b-a4b: 50 GB built first)
    (["--steps", str(2**31)], f"--steps: expected an integer in [1, {2**31 - 1}], got {2**31}"),
    (["--device", "cuda"], "device: 'cuda' asked for, but this torch sees no CUDA GPU"),  # was torch's assertion
    (["--device", "meta"], "--device: 'meta' holds shapes only, so nothing runs there to time; give cpu or cuda"),
    (["--threads", "-1"], "--threads: expected 0"),
    (["--out", "/no/such/folder/b.json"], "--out: no folder"),
    (["--out", "/tmp"], "--out: '/tmp' is a folder"),
    (["--plot", "/tmp/b.txt"], "--plot: expected a file ending in one of .png"),
    (["--out", "/tmp/b.png", "--plot", "/tmp/./b.png"], "--out: '/tmp/b.png' is the --plot file too; give the JSON"),
    (["--layers", "1"], "--layers: expected a count of layers that ends in a full-attention one, as a DiffusionGemma's "
                        "last layer is: one of 2; got 1"),
])
def test_bench_bad_arguments_fail_before_running(args, message, monkeypatch, capsys):
    """In process, through main() (a subprocess each paid torch's import: about 3 s apiece); a bench that ran
    before refusing is a failure here, not just a slow pass."""
    import blockpress.bench

    monkeypatch.setattr(blockpress.bench, "run_bench", lambda *a, **k: pytest.fail("ran the bench first"))
    assert main(["bench", "--preset", "tiny", "--new-tokens", "8", "--steps", "2", "--no-reference", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="a FIFO stands in for a device")
def test_bench_out_that_is_not_a_regular_file_is_refused(tmp_path, monkeypatch, capsys):
    """bench writes --out beside it and moves it into place after each row: as root, `--out /dev/null` (the usual
    way to discard output) replaced the device with a regular file holding the JSON; as a user it was refused as a
    folder that cannot be written into. A FIFO stands in for the device (no root needed to make one)."""
    import stat

    import blockpress.bench

    monkeypatch.setattr(blockpress.bench, "run_bench", lambda *a, **k: pytest.fail("ran the bench first"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in [str(fifo)] + (["/dev/null"] if os.path.exists("/dev/null") else []):
        assert main(["bench", "--preset", "tiny", "--no-reference", "--out", path]) == 2
        assert f"--out: {path!r} is not a regular file (a device, a pipe or a socket)" in capsys.readouterr().err
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_bench_threads_past_the_cpus_fail_before_torch_sees_them():
    """--threads 100000 was a segmentation fault (139) in torch's thread pool: run end to end, where a crash is an
    exit status and not the test process's own."""
    r = run_cli("bench", "--preset", "tiny", "--new-tokens", "8", "--steps", "2", "--no-reference", "--threads",
                "100000")
    assert r.returncode == 2 and "--threads: expected 0 (torch's default) to " in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--canvas-lengths", "140000"], "--canvas-lengths: 32 prompt + 16 new tokens in whole 140000-token canvases"),
    (["--new-tokens", "140000"], "--new-tokens: 32 prompt + 140000 new tokens"),
    (["--prompt-length", "140000"], "--prompt-length: 140000 prompt + 16 new tokens"),
    # the tokens fit, the preset's 16-token canvas does not
    (["--prompt-length", "131060", "--new-tokens", "4"], "--prompt-length: 131060 prompt + 4 new tokens in whole "
                                                         "16-token canvases (16 positions)"),
])
def test_bench_refuses_a_run_past_the_context_before_building_a_model(monkeypatch, capsys, args, message):
    """A swept canvas past the context was not refused (bench sat minutes in its first pass), and a too long
    --new-tokens / --prompt-length was refused only once the models were built, naming flags bench lacks."""
    import blockpress.bench as bench

    monkeypatch.setattr(bench, "random_model", lambda *a, **k: pytest.fail("built a model"))
    assert main(["bench", "--preset", "tiny", "--new-tokens", "16", "--steps", "1", "--no-reference", *args]) == 2
    err = capsys.readouterr().err
    assert f"blockpress bench: error: {message}" in err and "context of 131072 tokens" in err


def test_bench_layers_times_the_presets_first_layers_and_counts_their_weights(monkeypatch, capsys):
    """--layers N: the 26b-a4b's first 6 layers (5 sliding, 1 full, as in the whole) are 11.3 GB in bf16 where the whole
    is 50.5: a shape this 24 GB CPU holds. The weights the refusal counts and the JSON's settings are the cut's."""
    import blockpress.bench as bench

    monkeypatch.setattr(bench, "available_bytes", lambda device: 4 * 10**9)
    monkeypatch.setattr(bench, "random_model", lambda *a, device="cpu", **k: blockpress.random_model(
        *a, device=device, **k) if device == "meta" else pytest.fail("built a model"))
    assert main(["bench", "--preset", "26b-a4b", "--layers", "6", "--dtype", "bfloat16", "--no-reference"]) == 2
    err = capsys.readouterr().err
    cut = blockpress.random_model(blockpress.ModelConfig.gemma_26b_a4b().first_layers(6), dtype="bfloat16",
                                  device="meta").weights_bytes()
    assert (f"--preset: 26b-a4b (its first 6 of 30 layers) in bfloat16 needs {cut / 1e9:.1f} GB of weights on cpu but "
            "4.0 GB are available" in err)
    assert 11e9 < cut < 12e9
    monkeypatch.undo()
    assert main(["bench", "--preset", "tiny", "--layers", "2", "--new-tokens", "8", "--steps", "1", "--repeats", "1",
                 "--no-reference", "--no-ar"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["layers"] == 2
    assert result["params"] == blockpress.ModelConfig.preset("tiny").num_parameters()


def test_first_layers_keeps_each_layer_as_it_was():
    from blockpress.config import ConfigError

    whole = blockpress.ModelConfig.gemma_26b_a4b()
    cut = whole.first_layers(12)
    assert cut.text.num_hidden_layers == 12 and cut.text.layer_types == whole.text.layer_types[:12]
    assert [(s.kind, s.head_dim, s.num_kv_heads) for s in cut.text.layers] == [
        (s.kind, s.head_dim, s.num_kv_heads) for s in whole.text.layers[:12]]
    assert cut.text.hidden_size == whole.text.hidden_size and cut.text.vocab_size == whole.text.vocab_size
    six = [whole.first_layers(n).num_parameters() for n in (6, 12)]  # each 6 layers hold the pattern once
    assert whole.num_parameters() - six[0] == 4 * (six[1] - six[0]) and cut.num_parameters() == six[1]
    assert whole.text.num_hidden_layers == 30  # the preset itself unchanged
    with pytest.raises(ConfigError, match=r"layers: .* one of 6, 12, 18, 24, 30; got 7"):
        whole.first_layers(7)


def test_bench_refuses_a_batch_whose_cache_cannot_fit_before_building_a_model(monkeypatch, capsys):
    """Only the weights were checked: `--batch-sizes 100000000` built the model, then died in torch's allocator
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 25600000000 bytes"), naming no flag."""
    import blockpress.bench as bench

    assert main(["info", "--model", "random-tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # a cache of 32 prompt + 16 new + one 16-token canvas of scratch a row, and the canvas's float32 logits
    row = (32 + 16 + 16) * info["kv_cache_bytes_per_token"] + 16 * info["vocab_size"] * 4
    monkeypatch.setattr(bench, "available_bytes", lambda device: info["weights_bytes"] + 5 * row + row // 2)
    real = bench.random_model
    monkeypatch.setattr(bench, "random_model", lambda *a, device="cpu", **k: real(*a, device=device, **k)
                        if device == "meta" else pytest.fail("built a model"))
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "6", "--new-tokens", "16", "--steps", "1",
                 "--no-reference"]) == 2
    err = capsys.readouterr().err
    assert "blockpress bench: error: --batch-sizes: batch 6 with a 16-token canvas needs at least" in err
    assert "KV cache" in err and err.rstrip().endswith("at most 5 rows fit") and "Traceback" not in err


def test_version(capsys, monkeypatch):
    """--version is the package's __version__, which pyproject.toml reads its version from. It was the installed
    metadata's, which an editable install wrote once: a later change to __version__ left --version behind."""
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.0.1")  # an editable install's stale metadata
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    out = capsys.readouterr().out.strip()
    assert done.value.code == 0 and out == f"blockpress {blockpress.__version__}"
    assert re.fullmatch(r"blockpress \d+\.\d+\.\d+\S*", out)


def test_python_m_blockpress_runs_the_command():
    """`python -m blockpress` said "No module named blockpress.__main__"; it is the blockpress command."""
    r = subprocess.run([sys.executable, "-m", "blockpress", "--version"], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, f"blockpress {blockpress.__version__}", "")


@pytest.mark.parametrize("args, message", [
    (["generate", "x", "--model", "random-tiny", "--stop", ""], "generate: error: --stop: stop strings must be non-empty"),
    (["generate", "x", "--model", "random-tiny", "--device", "cuda:99"], "generate: error: --device: 'cuda:99' asked for"),
    (["info", "--model", "blockpress-sudoku", "--device", "cuda:99"], "info: error: --device: 'cuda:99' asked for"),
    (["sudoku", "." * 81, "--ensemble", "0"], "sudoku: error: --ensemble: expected 1 to 64 views, got 0"),
    (["bench", "--preset", "bogus"], "bench: error: --preset: unknown preset 'bogus'; expected one of"),
    (["info", "--model", "random-bogus"], "info: error: --model random-bogus: unknown preset 'bogus'; expected one of"),
    (["generate", "x", "--model", "random-huge"], "generate: error: --model random-huge: unknown preset 'huge'"),
    # past int64: torch's "Overflow when unpacking long long" named no flag
    (["generate", "x", "--model", "random-tiny", "--max-new-tokens", "9" * 23],
     f"generate: error: --max-new-tokens: 2 prompt + {'9' * 23} new tokens"),
    (["infill", "x = 1", "--model", "random-tiny"],
     "infill: error: template: has no holes to fill; mark them with <|hole|> (--hole-length tokens) or <|hole:N|>"),
    # the library's prompt is infill's --prefix (the error said "prompt:", a flag infill does not have)
    (["infill", "<|hole:2|>", "--model", "random-tiny", "--prefix", "x" * 131_100],
     "infill: error: --prefix: 131101 prompt + 2 new tokens"),
])
def test_errors_name_the_flag_typed(args, message, capsys):
    """Library checks name their arguments (stop, device, ensemble, preset) and offer the Python API's -1 ids; the
    command line's errors name its flags and markers instead."""
    assert main(args + (["--threads", "1"] if args[0] != "info" else [])) == 2  # info runs nothing
    err = capsys.readouterr().err
    assert message in err and "-1 ids" not in err


@pytest.mark.parametrize("args, broken", [
    (["info", "--json", "--model", "random-tiny"], "stdout"),
    (["sudoku", "." * 80 + "1", "--show-steps", "--steps", "2"], "stderr"),
    (["--version"], "stdout"),
    (["generate", "--help"], "stdout"),
])
def test_a_reader_that_goes_away_ends_the_run_quietly(args, broken):
    """`blockpress info --json | head -c 10` ended in "error: [Errno 32] Broken pipe" and status 2, `sudoku
    --show-steps P 2>&1 | head -2` in status 1: now status 141, as a tool stopped by SIGPIPE, and no message.
    --help and --version exited 0 there (argparse dropped the BrokenPipeError): 141 too."""
    threads = ["--threads", "1"] if args[0] == "sudoku" else []  # the one that runs a model
    proc = subprocess.Popen([sys.executable, "-m", "blockpress.cli", *args, *threads],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    getattr(proc, broken).close()  # before the command writes a byte: python starts in over a second
    other = proc.stderr if broken == "stdout" else proc.stdout
    rest = other.read()
    assert proc.wait(timeout=300) == 141 and rest == b""


def run_with_stdout(stdout, *args, buffered=True, stdin=None):
    """Run the command line with descriptor 1 as `stdout` ("full": /dev/full, "closed": no descriptor 1 at all,
    as a shell's `>&-` leaves it). `buffered`: Python's own buffering of stdout, as a user's shell has it (without
    PYTHONUNBUFFERED, which CI sets), where a failure meets the interpreter's last flush."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED" or not buffered}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    target = open("/dev/full", "w") if stdout == "full" else None
    try:
        return subprocess.run([sys.executable, "-m", "blockpress.cli", *args], stdout=target, stderr=subprocess.PIPE,
                              input=stdin, text=True, env=env, timeout=300,
                              preexec_fn=(lambda: os.close(1)) if stdout == "closed" else None)
    finally:
        if target is not None:
            target.close()


NO_STDOUT = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full and a descriptor to close")


GENERATE = ["generate", "def f(x):", "--model", MODEL, "--max-new-tokens", "4", "--steps", "2", "--threads", "1"]


@NO_STDOUT
@pytest.mark.parametrize("stdout, reason", [("full", "No space left on device"), ("closed", "Bad file descriptor")])
@pytest.mark.parametrize("args, buffered", [
    (["info", "--model", "random-tiny"], True),
    (["info", "--model", "random-tiny", "--json"], False),
    (GENERATE, True),
    ([*GENERATE, "--json"], False),
    (["--version"], True),
    (["generate", "--help"], True),
])
def test_a_stdout_that_cannot_be_written_is_said_once(args, stdout, reason, buffered):
    """`blockpress info > /dev/full` said "error: [Errno 28] No space left on device" and then Python's own
    "Exception ignored in: <_io.TextIOWrapper name='<stdout>'...> OSError: [Errno 28]", status 120 (unbuffered: the
    first line alone, status 2, a bad argument's); with stdout closed (`>&-`) generate ended in a traceback
    (None.isatty()) and info printed nothing with status 0. Now one line names standard output, status 1."""
    r = run_with_stdout(stdout, *args, buffered=buffered)
    command = "blockpress" if args[0].startswith("-") or "--help" in args else f"blockpress {args[0]}"
    assert r.returncode == 1, r.stderr
    # no stats line before it either, as if the text had been written (the text is flushed before it)
    assert [line for line in r.stderr.splitlines() if line] == [
        f"{command}: error: cannot write to standard output: {reason}"], r.stderr


@NO_STDOUT
@pytest.mark.parametrize("stdout, reason", [("full", "No space left on device"), ("closed", "Bad file descriptor")])
def test_chat_with_a_stdout_that_cannot_be_written_says_so(stdout, reason):
    """`blockpress chat < messages.txt >&-` ended in "RuntimeError: input(): lost sys.stdout", a traceback."""
    r = run_with_stdout(stdout, "chat", "--model", MODEL, "--max-new-tokens", "4", "--steps", "2", "--threads", "1",
                        stdin="hi\n")
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == f"blockpress chat: error: cannot write to standard output: {reason}"
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr


def test_a_missing_optional_package_names_its_extra(tmp_path, capsys, monkeypatch):
    """`serve` without fastapi/uvicorn and `train --lora-rank` without peft were ModuleNotFoundError tracebacks."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "blockpress.serve", raising=False)  # nor imported yet
    assert main(["serve", "--port", "0"]) == 2
    assert "error: uvicorn is not installed (needed for blockpress serve); pip install 'blockpress[serve]'" in \
        capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "peft", None)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt_ids": [2, 5, 6], "response_ids": [10, 11]}) + "\n")
    assert main(["train", "--model", "random-tiny", "--data", str(data), "--out", str(tmp_path / "out"), "--steps", "1",
                 "--heldout", "0", "--quiet", "--lora-rank", "2"]) == 2
    assert "error: peft is not installed (needed for --lora-rank); pip install 'blockpress[train]'" in \
        capsys.readouterr().err


@pytest.mark.parametrize("as_model", [False, True])
def test_loading_an_adapter_without_peft_names_the_adapter(tmp_path, capsys, monkeypatch, as_model):
    """`generate --model OUT/adapter` (or --adapter) without peft said "needed for --lora-rank", a flag generate
    does not have."""
    pytest.importorskip("peft")
    from blockpress.train import add_lora, save_adapter

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8))
    lm.save(tmp_path / "base")
    save_adapter(add_lora(lm.model, rank=2, alpha=4), tmp_path / "adapter", 2, 4, str(tmp_path / "base"))
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "peft.tuners.lora", None)
    model = ["--model", str(tmp_path / "adapter")] if as_model else \
        ["--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter")]
    assert main(["generate", *model, "--max-new-tokens", "1", "--no-live", "x"]) == 2
    err = capsys.readouterr().err
    assert "error: peft is not installed (needed for a LoRA adapter: --adapter, or an adapter folder as --model); " \
           "pip install 'blockpress[train]'" in err and "--lora-rank" not in err


def test_bench_plot_without_matplotlib_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """It ran the whole sweep, then died in a ModuleNotFoundError traceback from bench.plot (exit 1)."""
    import blockpress.bench

    monkeypatch.setattr(blockpress.bench, "run_bench", lambda *a, **k: pytest.fail("ran the benchmark"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["bench", "--preset", "tiny", "--plot", str(tmp_path / "p.png")]) == 2
    assert "blockpress bench: error: matplotlib is not installed (needed for --plot); pip install " \
           "'blockpress[train]'" in capsys.readouterr().err


def help_text(capsys, *args):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes


def test_help_says_where_the_checkpoint_defaults_are(capsys):
    for command in ("generate", "infill", "chat"):
        assert "run `blockpress info --model M` to see them" in help_text(capsys, command)
    assert "--max-new-tokens MAX_NEW_TOKENS new tokens to generate (at most: EOS or --stop may end sooner)" in \
        help_text(capsys, "generate")
    shipped = blockpress.load("blockpress-sudoku").sampler_defaults  # sudoku's default model
    text = help_text(capsys, "sudoku")
    assert f"max denoising steps (default: the model's; {shipped.max_denoising_steps} for blockpress-sudoku)" in text
    assert f"acceptance rule (default: the model's; {shipped.sampler} for blockpress-sudoku)" in text


def test_info_lists_the_default_length(capsys):
    """generation_defaults left out max_new_tokens (blockpress-sudoku's generation_config.json says 81)."""
    assert main(["info", "--model", "blockpress-sudoku", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["generation_defaults"]["max_new_tokens"] == 81


def test_info_says_whether_generate_heals_and_which_ids_end_a_row(tmp_path, capsys):
    """generation_defaults left out token_healing, which changes `generate`'s default (a run fine-tuned on prompts
    ending in whitespace writes false, and generate then keeps the prompt's last token), and the EOS ids."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    for say in (None, False, True):
        if say is not None:
            lm.generation_config["token_healing"] = say
        lm.generation_config["eos_token_id"] = [1, 7]
        lm.save(tmp_path / str(say))
        assert main(["info", "--model", str(tmp_path / str(say)), "--json"]) == 0
        defaults = json.loads(capsys.readouterr().out)["generation_defaults"]
        assert defaults["token_healing"] is (say is not False) and defaults["eos_token_id"] == [1, 7]


def test_chat_prompts_only_a_terminal(monkeypatch, capsys):
    """Piped messages printed "you> " before each reply on stdout ("you> model> ..."), then "model> " still: a
    script reading the replies got our decoration. Piped, stdout now holds the replies alone."""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stdin, prompted in ((io.StringIO("hello\n"), False), (Terminal("hello\n"), True)):
        monkeypatch.setattr(sys, "stdin", stdin)
        screen = Terminal()
        monkeypatch.setattr(sys, "stdout", screen)  # a terminal's stdout: the turns are marked there
        assert main(["chat", "--model", MODEL, "--max-new-tokens", "4", "--steps", "2", "--threads", "1"]) == 0
        out = screen.getvalue()
        if prompted:
            assert out.startswith("you> model> ") and out.count("you> ") == 2
        else:
            assert "you> " not in out and "model> " not in out and out.endswith("\n")
    monkeypatch.undo()  # capsys's stdout again, for --help
    assert "is a small code model: its replies are code" in help_text(capsys, "chat")


def test_chat_typed_at_a_terminal_into_a_file_prompts_on_the_terminal(monkeypatch, capsys):
    """`blockpress chat > chat.txt` (or `| tee log`) typed at a terminal: "you> " went to stdout, so the screen
    showed no prompt and the file held "you> model> " before each reply, without what was typed. The prompt goes
    to stderr, the screen, and stdout holds the replies alone, as any stdout that is not the terminal does."""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("hello\nmore\n"))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "4", "--steps", "2", "--threads", "1"]) == 0
    captured = capsys.readouterr()  # capsys's stdout is no terminal: a file's
    assert "you> " not in captured.out and "model> " not in captured.out and captured.out.endswith("\n")
    assert captured.err.count("you> ") == 3 and replies(captured.err) == 2


def test_bench_times_no_engine_on_its_first_run(monkeypatch):
    """Each engine's first run pays one-time setup (the reference's took ~3.7 s more): with --repeats 1 it was
    the run reported for whichever batch size came first. Every engine now runs once untimed first."""
    from dataclasses import replace

    import blockpress.bench as bench

    first_runs, real_timed = set(), bench._timed
    setup_seconds = 1e6  # what a first run "took": no machine is that slow, so a reported one shows

    def slow_first_call(fn, device, memory):
        timed = real_timed(fn, device, memory)
        if fn.__code__ not in first_runs:  # each engine's call is its own lambda
            first_runs.add(fn.__code__)
            return replace(timed, seconds=setup_seconds)
        return timed

    monkeypatch.setattr(bench, "_timed", slow_first_call)
    out = bench.run_bench(bench.BenchSettings(preset="tiny", batch_sizes=[1, 2], new_tokens=8, steps=2, repeats=1))
    engines = ("blockpress", "blockpress_ar") + (("reference",) if out["reference_available"] else ())
    assert len(first_runs) == len(engines)
    for row in out["rows"]:
        assert all(row[engine]["seconds"] < setup_seconds for engine in engines)


def test_a_closed_stdout_is_no_crash():
    """`blockpress info >&-`: the flush met a None stdout (a traceback); then the output was lost with status 0, said
    nowhere. Now it is said, status 1 (test_a_stdout_that_cannot_be_written_is_said_once has the other commands)."""
    r = subprocess.run(["sh", "-c", f'"{sys.executable}" -m blockpress.cli info --model {MODEL} >&-'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr == "blockpress info: error: cannot write to standard output: Bad file descriptor\n"


def test_an_installed_but_unusable_optional_package_keeps_its_own_error(monkeypatch, capsys):
    import blockpress.cli.parser

    def too_old(args):
        raise ImportError("cannot import name 'inject_adapter_in_model' from 'peft'", name="peft")

    monkeypatch.setattr(blockpress.cli.parser, "cmd_info", too_old)
    with pytest.raises(ImportError, match="cannot import name"):
        main(["info", "--model", MODEL])


def interrupt_after_first_commit(monkeypatch):
    """LM.stream as it runs, then Ctrl-C right after its first committed canvas; returns that canvas' text."""
    import blockpress.lm
    from blockpress.generate import Commit

    original, first = blockpress.lm.LM.stream, []

    def stream(self, *args, **kwargs):
        for event in original(self, *args, **kwargs):
            yield event
            if isinstance(event, Commit):
                first.append(event.texts[0])
                raise KeyboardInterrupt

    monkeypatch.setattr(blockpress.lm.LM, "stream", stream)
    return first


def test_an_interrupted_generate_keeps_the_text_committed_so_far(monkeypatch, capsys):
    """Ctrl-C with --no-live (or piped) printed only "interrupted": the committed canvases were lost. Now stdout gets
    the prompt and the text so far, and --json one object marked interrupted, with the figures up to then."""
    base = ["generate", "def f(x):", "--model", MODEL, "--max-new-tokens", "64", "--min-new-tokens", "64",
            "--steps", "2", "--seed", "3", "--threads", "1"]
    assert main(base + ["--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["interrupted"] is False
    first = interrupt_after_first_commit(monkeypatch)
    assert main(base + ["--no-live"]) == 130
    captured = capsys.readouterr()
    assert first[0] and captured.out == "def f(x):" + first[0] + "\n"
    from blockpress.cli.common import load_model

    canvas = load_model(MODEL, None, "meta").config.canvas_length
    assert f"interrupted ({canvas} new tokens committed)" in captured.err
    assert main(base + ["--json"]) == 130
    cut = json.loads(capsys.readouterr().out)
    assert cut["interrupted"] is True and cut["text"] == first[1] and whole["text"].startswith(cut["text"])
    assert cut["new_tokens"] == canvas and 1 <= cut["forward_passes"] <= 2 and cut["prompt"] == "def f(x):"


def test_info_says_an_unread_generation_config_key_once(tmp_path, capsys):
    """info builds its LM from the folder's files as load does: a key blockpress does not read was said by the
    reading and again when info read the sampler defaults (review)."""
    blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0).save(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.7}))
    capsys.readouterr()
    assert main(["info", "--model", str(tmp_path / "m"), "--json"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "temperature" in line]
    assert len(said) == 1 and str(tmp_path / "m" / "generation_config.json") in said[0], said


def test_info_counts_without_reading_the_weights(monkeypatch, capsys, tmp_path):
    """`info` loaded the model to count it (a bf16 26B became 101 GB of float32 on an AVX2 CPU), and a folder
    with config.json alone could not be described. It now counts on the meta device, from the safetensors headers."""
    import shutil

    import blockpress.checkpoint

    def never(*args, **kwargs):
        pytest.fail("read tensor data")

    monkeypatch.setattr(blockpress.checkpoint.MappedSafetensors, "tensor", never)
    monkeypatch.setattr(blockpress.checkpoint, "load_model", never)
    folder = blockpress.lm.resolve_path("blockpress-code")
    assert main(["info", "--model", str(folder), "--dtype", "float32", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["dtype"] == "float32" and full["device"] == "cpu"
    assert full["weights_bytes"] == pytest.approx(4 * full["parameters_total"], rel=0.01)
    header = (folder / "model.safetensors").stat().st_size - full["checkpoint_bytes"]
    assert full["checkpoint_dtype"] == "bfloat16" and 0 < header < 100_000  # the file: tensors' bytes + header
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--quantize", "int8", "--json"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert bare["parameters_total"] == full["parameters_total"] and bare["checkpoint_bytes"] is None
    assert bare["quantization"] == "int8" and bare["weights_bytes"] < full["weights_bytes"] / 2
    assert bare["tokenizer"] is False


def test_serve_says_it_is_loading(monkeypatch, capsys):
    """A big checkpoint loads for tens of seconds with nothing on screen, while a client's request got no answer."""
    import blockpress.cli.common

    def load(*args, **kwargs):
        print("load started", file=sys.stderr)
        raise ValueError("--model random-tiny: stop here")

    monkeypatch.setattr(blockpress.cli.common, "load_model", load)
    assert main(["serve", "--model", "random-tiny", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockpress: loading random-tiny ... (http://127.0.0.1:") and "load started" in err


def test_chat_help_names_its_commands_and_no_stop(capsys):
    text = help_text(capsys, "chat")
    assert "new tokens to generate (at most: EOS may end sooner)" in text and "--stop" not in text
    assert "/reset starts a new conversation; /exit, /quit or Ctrl-D quits" in text and "//" in text


def chat_turns(monkeypatch, lines, *flags):
    """Run `chat` on `lines` piped in; returns the user messages the model was given."""
    import blockpress.tokenizer

    sent, original = [], blockpress.tokenizer.Tokenizer.apply_chat_template

    def spy(self, messages, *args, **kwargs):
        sent.append(messages[-1]["content"])
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(blockpress.tokenizer.Tokenizer, "apply_chat_template", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "4", "--steps", "2", "--threads", "1", *flags]) == 0
    return sent[1:]  # the first render is the template's check at start


def test_chat_refuses_utf16_piped_in_and_sends_nothing(monkeypatch, capsys):
    """UTF-16 piped in (`type notes.txt | blockpress chat` of a Notepad "Unicode" file) dropped its first line with
    a bare "not valid UTF-8 (byte 0xff ...)" and sent the model every later line as NUL-interleaved text, exiting 0;
    it is refused as UTF-16 before any message is sent, as `generate -` refuses it."""
    import blockpress.tokenizer

    sent, original = [], blockpress.tokenizer.Tokenizer.apply_chat_template

    def spy(self, messages, *args, **kwargs):
        sent.append(messages[-1]["content"])
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(blockpress.tokenizer.Tokenizer, "apply_chat_template", spy)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("hello\nworld\n".encode("utf-16")), encoding="utf-8"))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "4", "--steps", "2", "--threads", "1", "--json"]) == 2
    out, err = capsys.readouterr()
    assert sent[1:] == [] and out == ""  # (the first render is the template's check at start)
    assert "error: standard input: not valid UTF-8 (byte 0xff at character 0); it is UTF-16 (it starts with a " \
           "UTF-16 byte-order mark" in err


def test_chat_refuses_unknown_commands(monkeypatch, capsys):
    """"/exit now" and "/foo" went to the model as messages; // sends a message that starts with a slash."""
    sent = chat_turns(monkeypatch, ["/exit now", "/foo", "//etc/hosts?", "/exit", "never sent"])
    err = capsys.readouterr().err
    assert sent == ["/etc/hosts?"]
    assert "error: unknown command '/exit now'; /reset starts a new conversation" in err and "'/foo'" in err


def test_chat_lines_ending_in_crlf_send_no_carriage_return(monkeypatch, capsys):
    """Piped lines that end in "\r\n" (a file written on Windows) reached the model as "hi\r", and --json echoed
    that prompt; commands worked, being stripped. The line's terminator is not part of the message."""
    sent = chat_turns(monkeypatch, ["hi\r", "a\rb \r", "/help\r", "/exit\r", "never sent"], "--json")
    assert sent == ["hi", "a\rb "]  # only the terminator's "\r" goes: the message's own text stays as typed
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["prompt"] for t in lines] == ["hi", "a\rb ", "/help", "/exit"]


def test_chat_bad_messages_are_named_by_their_own_text(monkeypatch, capsys):
    """Invalid UTF-8 was placed in the rendered template ("at character 27"); a first message longer than the
    context was told "the conversation so far holds 0 of 4096 tokens: /reset starts a new one"."""
    from blockpress.cli.common import load_model

    context = load_model(MODEL, None, "meta").config.text.max_position_embeddings
    chat_turns(monkeypatch, ["caf\udcff", "x " * context])
    err = capsys.readouterr().err
    assert "error: not valid UTF-8 (byte 0xff at character 3 of the message)" in err
    assert "error: the message is too long: " in err and "/reset" not in err.split("the message is too long")[1]
    assert replies(err) == 0


def test_chat_text_past_the_context_in_characters_is_refused_in_the_chats_words(monkeypatch, capsys):
    """A message, or a conversation, whose text alone is more characters than the context times the vocabulary's
    longest token holds is refused before the template renders it; lm.chat_prompt's error named the API's
    `messages`, where the chat says whether to shorten the message or /reset. (The bound is lowered to one
    character a token here, so that a few thousand characters cross it.)"""
    import blockpress.tokenizer
    from blockpress.cli.common import load_model

    context = load_model(MODEL, None, "meta").config.text.max_position_embeddings
    monkeypatch.setattr(blockpress.tokenizer.Tokenizer, "longest_token", lambda self: 1)
    first, second, alone = "x" * (context * 3 // 4), "y" * (context // 2), "z" * (context + 1)
    sent = chat_turns(monkeypatch, [first, second, alone, "hi"])
    err = capsys.readouterr().err
    assert sent == [first, "hi"]  # neither refused turn reached the template
    held = re.search(r"error: no room for a reply: the conversation with this message holds ([\d,]+) characters, "
                     rf"and the model's context of {context} tokens holds at most {context:,} characters", err)
    assert held and int(held[1].replace(",", "")) >= len(first) + len(second)  # the first reply's text besides
    assert f"error: the message is too long: {len(alone):,} characters, and the model's context" in err
    assert err.count("/reset starts a new one") == 1 and replies(err) == 2


def test_chat_near_a_full_context_shortens_the_reply(monkeypatch, capsys):
    """A turn that left fewer positions than --max-new-tokens was refused outright; it now gets what fits: the
    whole canvases left (a reply of every position left ran its last canvas past the context)."""
    import blockpress.lm
    from blockpress.cli.common import load_model

    lm = load_model(MODEL, None, "meta")
    context = lm.config.text.max_position_embeddings

    def length(k):
        return len(lm.tokenizer.apply_chat_template([{"role": "user", "content": "x " * k}], tokenize=True))

    canvas = lm.config.canvas_length
    low, high = 0, 4 * context  # the longest message that leaves the reply one canvas and some positions more
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if length(mid) <= context - canvas - 6 else (low, mid - 1)
    k = low
    room = (context - length(k)) // canvas * canvas
    assert room < context - length(k)
    asked = []
    original = blockpress.lm.LM.generate
    monkeypatch.setattr(blockpress.lm.LM, "generate",
                        lambda self, *a, **kw: asked.append(kw["max_new_tokens"]) or original(self, *a, **kw))
    monkeypatch.setattr(sys, "stdin", io.StringIO("x " * k + "\n"))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "64", "--steps", "2", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert asked == [room] and 0 < room < 64 and replies(err) == 1 and length(k) + room <= context
    assert f"this reply gets at most {room}, not 64" in err


def test_profiling_in_bench_keeps_stderr_clean(capfd):
    """torch's profiler writes "USDT: ... profiler_start/stop" lines from C++ on each start and stop; `bench`
    printed them. Only those are silenced: what the profiled code writes still shows."""
    from blockpress.bench import _gemm_ms_per_step, profile_ops

    def work():
        print("said inside", file=sys.stderr, flush=True)
        return torch.ones(8, 8) @ torch.ones(8, 8)

    ops = profile_ops(work, torch.device("cpu"))
    assert ops["aten_ops"] > 0
    lm = blockpress.random_model(blockpress.ModelConfig.tiny())
    assert _gemm_ms_per_step(lm, torch.tensor([[5, 6, 7]]), passes=1) >= 0
    print("said after", file=sys.stderr, flush=True)
    err = capfd.readouterr().err
    assert "profiler_st" not in err and "USDT" not in err
    assert "said inside" in err and "said after" in err


def test_commands_show_the_loads_warnings_but_the_vision_note(tmp_path, capsys):
    """load_model silenced every warning to hide the vision-tensor note: a `temperature` in generation_config.json
    (not a blockpress setting, so ignored) went unsaid by generate while info said it."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(blockpress.lm.resolve_path("blockpress-code"), folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.5}))
    assert main(["generate", "x = 1", "--model", str(folder), "--max-new-tokens", "4", "--steps", "2",
                 "--no-live", "--threads", "1"]) == 0
    assert re.search(r"^warning: .*temperature", capsys.readouterr().err, re.M)


def test_warnings_are_lines_of_the_command_not_of_pythons_form(tmp_path, capsys):
    """The CLI printed a library warning as Python does, `/path/blockpress/config.py:446: UserWarning: ...` and
    then that line of blockpress's source. It says `warning: MESSAGE`; the library's users keep Python's form."""
    import warnings

    blockpress.random_model(blockpress.ModelConfig.tiny()).save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["foo_bar"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    before = warnings.showwarning
    assert main(["info", "--model", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err == "warning: text_config.foo_bar: unknown field, ignored\n"
    assert warnings.showwarning is before
    with pytest.warns(UserWarning, match="text_config.foo_bar: unknown field"):  # the library: Python's warning
        blockpress.ModelConfig.from_dict(config)


@pytest.mark.parametrize("action", ["ignore", "error"])
def test_the_users_warning_filters_still_decide(tmp_path, capsys, action):
    """main() put its own 'default' filter for UserWarning in front of the user's: python -W ignore, PYTHONWARNINGS
    and -W error::UserWarning were overridden, and the warning printed anyway."""
    import warnings

    blockpress.random_model(blockpress.ModelConfig.tiny()).save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["foo_bar"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter(action)
        if action == "ignore":
            assert main(["info", "--model", str(tmp_path)]) == 0
            assert "warning:" not in capsys.readouterr().err
        else:
            with pytest.raises(UserWarning, match="foo_bar"):
                main(["info", "--model", str(tmp_path)])


def test_chat_survives_a_bad_byte_under_a_utf8_locale():
    """Under a UTF-8 locale stdin decodes strictly: the UnicodeDecodeError left input() and ended the chat
    (the in-process tests pass surrogates in directly and never met it)."""
    import os

    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}  # as en_US.UTF-8 sets it (not installed here)
    r = subprocess.run([sys.executable, "-m", "blockpress.cli", "chat", "--model", MODEL, "--max-new-tokens", "4",
                        "--steps", "2", "--threads", "1"], input=b"caf\xff\nhello\n", capture_output=True,
                       timeout=300, env=env)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err
    assert "not valid UTF-8 (byte 0xff at character 3 of the message)" in err
    assert err.count("tokens/forward") == 1  # the next message was answered


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_info_figures_are_a_loads(capsys, quantize):
    """info built its meta model by hand and cast the rotary tables too (192 bytes off a real bf16 load)."""
    extra = ["--quantize", quantize] if quantize else []
    assert main(["info", "--model", "blockpress-code", "--dtype", "bfloat16", "--json", *extra]) == 0
    info = json.loads(capsys.readouterr().out)
    lm = blockpress.load("blockpress-code", dtype="bfloat16", quantize=quantize)
    assert info["weights_bytes"] == lm.weights_bytes() and info["dtype"] == "bfloat16"


def test_info_keeps_a_loads_refusals(tmp_path, capsys):
    """A pickle checkpoint was described as a folder without weights (checkpoint_bytes null), and a pre-quantized
    one was counted as if it could run."""
    import shutil

    shutil.copy(blockpress.lm.resolve_path("blockpress-code") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    assert main(["info", "--model", str(tmp_path), "--json"]) == 2
    assert "pickle checkpoint (pytorch_model.bin)" in capsys.readouterr().err
    (tmp_path / "pytorch_model.bin").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    assert main(["info", "--model", str(tmp_path), "--json"]) == 2
    assert "pre-quantized checkpoint (quantization_config: gptq)" in capsys.readouterr().err


def test_info_refuses_a_checkpoint_missing_a_weight_as_a_load_does(tmp_path, capsys):
    """info described a checkpoint that lacked a weight (exit 0) that blockpress.load refuses: the headers say so
    (checkpoint.check_complete, which plan_model runs for both), so info now fails with the load's message."""
    from safetensors.torch import load_file, save_file

    blockpress.random_model(blockpress.ModelConfig.tiny(), dtype="bfloat16").save(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    # a stored copy of a tied weight: a load compares it with the decoder's; info, reading no data, counts it
    tensors["lm_head.weight"] = tensors["model.decoder.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert info_json(capsys, "--model", str(tmp_path))["tied_copies"] == 1
    del tensors["model.decoder.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(blockpress.CheckpointError) as refused:
        blockpress.load(tmp_path)
    assert "missing tensor(s) model.decoder.norm.weight" in str(refused.value)
    assert main(["info", "--model", str(tmp_path), "--json"]) == 2
    assert str(refused.value) in capsys.readouterr().err


class FakeClock:
    """time.perf_counter that moves only when a costed call says so: the figures become exact arithmetic."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def costed(monkeypatch, obj, name, clock, seconds):
    """Each call of obj.name advances `clock` by `seconds`."""
    real = getattr(obj, name)

    def call(*args, **kwargs):
        clock.now += seconds
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, call, raising=False)


def tiny_bench_model(canvas):
    cfg = blockpress.ModelConfig.preset("tiny")
    cfg.canvas_length, cfg.text.eos_token_id = canvas, None  # as bench builds it: fixed work
    return blockpress.random_model(cfg, seed=0)


@pytest.mark.parametrize("batch, new_tokens", [(1, 1), (2, 4), (1, 9)])
def test_bench_ar_step_time_counts_the_passes_after_the_prefill(monkeypatch, batch, new_tokens):
    """The prefill's logits give each row its first token, so n new tokens take n - 1 one-token passes after it:
    ms/step divided by n (0.086 ms "per step" at --new-tokens 1, where one pass took ~8 ms)."""
    import time

    import blockpress.bench as bench

    lm, clock = tiny_bench_model(4), FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    costed(monkeypatch, lm.model, "encode", clock, 1.0)  # every encoder pass (prefill or one token) takes 1 s
    s = bench.BenchSettings(preset="tiny", new_tokens=new_tokens, steps=2, canvas_lengths=[1], reference=False)
    row = bench._ar(lm, torch.randint(3, 50, (batch, 3)), s)
    assert row["forward_passes"] == new_tokens and row["seconds"] == pytest.approx(new_tokens)
    assert row["prefill_ms"] == pytest.approx(1000)
    if new_tokens == 1:  # no pass after the prefill: nothing to divide
        assert row["ms_per_step"] is None and row["tok_s_without_prefill"] is None
    else:
        assert row["ms_per_step"] == pytest.approx(1000)
        assert row["tok_s_without_prefill"] == pytest.approx(batch)  # one token a row per 1 s pass


def test_bench_diffusion_step_time_leaves_out_the_canvas_encodes(monkeypatch):
    """A decoder step was "decoder pass plus its share of the committed canvases' encoder passes"; the canvas
    encodes are now their own figure. 8 tokens in 4-token canvases, 2 steps each: prefill, 4 decoder passes,
    1 encode of the first canvas."""
    import time

    import blockpress.bench as bench

    lm, clock = tiny_bench_model(4), FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    costed(monkeypatch, lm.model, "encode", clock, 1.0)
    costed(monkeypatch, lm.model, "denoise", clock, 0.01)
    s = bench.BenchSettings(preset="tiny", new_tokens=8, steps=2, canvas_lengths=[4], reference=False)
    row = bench._diffusion(lm, torch.randint(3, 50, (1, 3)), s)
    assert row["forward_passes"] == 4 and row["new_tokens"] == 8
    assert row["prefill_ms"] == pytest.approx(1000) and row["canvas_encode_ms"] == pytest.approx(1000)
    assert row["ms_per_step"] == pytest.approx(10)
    assert row["tok_s_without_prefill"] == pytest.approx(8 / 1.04)
    assert row["seconds"] == pytest.approx(2.04)
    assert lm.model.__dict__["encode"].__qualname__.startswith("costed")  # the harness put back what it wrapped


def reference_run_on_a_fake_clock(monkeypatch) -> tuple[dict, object]:
    """The reference model and its bench row (8 tokens in 4-token canvases, 2 steps each, a 3-token prompt) on a clock where
    each encoder pass takes 1 s and each decoder pass 10 ms."""
    import time

    pytest.importorskip("transformers")
    import blockpress.bench as bench

    lm, clock = tiny_bench_model(4), FakeClock()
    ref = bench._reference(lm)
    monkeypatch.setattr(time, "perf_counter", clock)
    # registered before the harness's hooks, so each pass's cost lands between the harness's two readings
    ref.model.encoder.register_forward_hook(lambda *_: setattr(clock, "now", clock.now + 1.0))
    ref.model.decoder.register_forward_hook(lambda *_: setattr(clock, "now", clock.now + 0.01))
    s = bench.BenchSettings(preset="tiny", new_tokens=8, steps=2, canvas_lengths=[4])
    return bench._reference_run(ref, torch.randint(3, 50, (1, 3)), s, lm.device), ref


def test_bench_reference_has_the_same_step_figures(monkeypatch):
    """The reference row had seconds and tok/s only: no prefill, no time per step to set beside blockpress's.
    Its encoder is timed as blockpress's is: 8 tokens in 4-token canvases, 2 steps each."""
    row, ref = reference_run_on_a_fake_clock(monkeypatch)
    assert row["forward_passes"] == 4 and row["new_tokens"] == 8
    assert row["prefill_ms"] == pytest.approx(1000) and row["canvas_encode_ms"] == pytest.approx(1000)
    assert row["ms_per_step"] == pytest.approx(10)
    assert row["tok_s_without_prefill"] == pytest.approx(8 / 1.04)
    assert not ref.model.encoder._forward_pre_hooks  # the harness's hooks are gone


def test_bench_reference_passes_are_counted_whatever_tokens_it_makes():
    """The reference's passes were inferred from its tokens_per_forward, which leaves pad tokens out: a run whose
    random weights made the pad id once among 64 tokens reported 33 passes for the 32 it ran. Here its pad id is
    a token it makes, so one of its 8 new tokens is pad (7 / 4 tokens per pass: "5 passes"): still 2 canvases x
    2 steps."""
    pytest.importorskip("transformers")
    import blockpress.bench as bench

    lm = tiny_bench_model(4)
    ref = bench._reference(lm)
    prompt = torch.randint(3, 50, (1, 3), generator=torch.Generator().manual_seed(0))
    s = bench.BenchSettings(preset="tiny", new_tokens=8, steps=2, canvas_lengths=[4])
    torch.manual_seed(0)
    made = ref.generate(prompt, max_new_tokens=8, max_denoising_steps=2, confidence_threshold=1e-30).sequences[:, 3:]
    pad = int(made[0, 0])
    ref.generation_config.pad_token_id = pad
    seen = []
    ref.model.decoder.register_forward_hook(lambda *_: seen.append(1))
    torch.manual_seed(0)
    row = bench._reference_run(ref, prompt, s, lm.device)
    assert row["forward_passes"] == len(seen) == 2 * 2
    assert row["tokens_per_forward"] == 8 / 4 and row["new_tokens"] == 8
    torch.manual_seed(0)  # the run above did make pad tokens: its tokens_per_forward is below 2
    out = ref.generate(prompt, max_new_tokens=8, max_denoising_steps=2, confidence_threshold=1e-30)
    assert bool((out.sequences[:, 3:] == pad).any()) and float(out.tokens_per_forward.mean()) < 2


def test_bench_figures_define_every_figure_reported():
    """Each engine's entry and each row holds only figures the JSON's "figures" defines, and the reference row
    now has blockpress's per-step figures."""
    import re

    from blockpress.bench import BenchSettings, run_bench

    out = run_bench(BenchSettings(preset="tiny", new_tokens=8, steps=2, canvas_lengths=[4], repeats=1,
                                  quantize="int8"))
    engine, row_figures = out["figures"]["engine"], out["figures"]["row"]
    names = [re.compile(re.sub(r"<\w+>", r"\\w+", k) + "$") for k in row_figures]
    engines = {"blockpress", "blockpress_ar", "blockpress_int8", "blockpress_ar_int8", "reference"}
    for row in out["rows"]:
        if out["reference_available"]:
            assert {"prefill_ms", "canvas_encode_ms", "ms_per_step", "tok_s_without_prefill"} <= set(row["reference"])
            assert row["step_speedup_vs_reference"] == pytest.approx(row["reference"]["ms_per_step"]
                                                                     / row["blockpress"]["ms_per_step"])
        for key, value in row.items():
            if key in engines:
                assert set(value) <= set(engine), key
            else:
                assert key in ("batch", "canvas") or any(n.match(key) for n in names), key


@pytest.mark.parametrize("canvas_lengths, what", [(None, "the tiny preset's 16-token canvas"),
                                                  ([4, 32], "canvas lengths [4, 32] (--canvas-lengths)")])
def test_bench_warns_of_a_canvas_longer_than_the_new_tokens(canvas_lengths, what, capsys):
    """A canvas longer than the new tokens was refused when given with --canvas-lengths (naming new_tokens, not
    the flag) and timed without a word when it was the preset's (medium at --new-tokens 16: 8x the denoising).
    Both are now timed (what a model of that canvas pays) with the same line on stderr, naming the flags."""
    from blockpress.bench import BenchSettings

    note = BenchSettings(preset="tiny", new_tokens=8, canvas_lengths=canvas_lengths).long_canvas()
    assert note.startswith(f"8 new tokens (--new-tokens) with {what}: ")
    assert f"--new-tokens {max(canvas_lengths or [16])} (a multiple of " in note
    assert BenchSettings(preset="tiny", new_tokens=16).long_canvas() is None  # the canvas fits
    assert BenchSettings(preset="tiny", new_tokens=8, canvas_lengths=[8, 2]).long_canvas() is None
    assert BenchSettings(preset="tiny", new_tokens=1).long_canvas().startswith("1 new token (--new-tokens) with")
    # on the command line: one plain line, before anything runs (here the --cuda-graphs refusal on a CPU)
    sweep = ["--canvas-lengths", *map(str, canvas_lengths)] if canvas_lengths else []
    assert main(["bench", "--preset", "tiny", "--new-tokens", "8", "--cuda-graphs", *sweep]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"bench: {note}"


def test_bench_notes_a_partly_used_last_canvas_and_advice_that_keeps_every_position():
    """Only a canvas longer than the new tokens was noted: 20 new tokens in 16-token canvases denoise 32 positions
    and drop 12 without a word. And the note's advice, "--canvas-lengths of at most 20", still dropped 4 at canvas 8
    (and then said nothing), as "--new-tokens 32" still dropped 4 at canvas 12 of a sweep of 12 and 32."""
    from blockpress.bench import BenchSettings

    def note(new_tokens, canvases):
        return BenchSettings(preset="tiny", new_tokens=new_tokens, canvas_lengths=canvases).long_canvas()

    assert "dropped (12 of the 32 denoised at canvas 16; AR's do not)" in note(20, [16])
    swept = note(20, [8, 32])
    assert "(4 of the 24 denoised at canvas 8, 12 of the 32 denoised at canvas 32;" in swept
    assert swept.endswith("--new-tokens 32 (a multiple of every canvas length) or --canvas-lengths that divide 20")
    assert note(32, [8, 32]) is None and note(20, [4, 5, 10, 20]) is None  # the advice followed: nothing dropped
    assert "(4 of the 36 denoised at canvas 12;" in note(32, [12, 32]) and "--new-tokens 96 (" in note(32, [12, 32])
    assert note(96, [12, 32]) is None
    # a multiple of every length far past the run (7, 11, 13, 256: 256,256, past the context) is not advised
    far = note(20, [7, 11, 13, 256])
    assert "--new-tokens" not in far.split("to time only what is kept:")[1] and far.endswith(
        "to time only what is kept: --canvas-lengths that divide 20")


def test_bench_top_level_canvas_is_every_canvas_swept():
    """With --canvas-lengths 4 16 the JSON's top level said "canvas": 4 while half its rows were at 16."""
    from blockpress.bench import BenchSettings, run_bench

    settings = dict(preset="tiny", new_tokens=4, steps=1, prompt_length=2, repeats=1, reference=False, ar=False)
    swept = run_bench(BenchSettings(**settings, canvas_lengths=[2, 4]))
    assert swept["canvases"] == [2, 4] == [r["canvas"] for r in swept["rows"]] and "canvas" not in swept
    single = run_bench(BenchSettings(**settings, canvas_lengths=[4]))
    assert single["canvases"] == [4] and single["canvas"] == 4


def test_bench_plot_ticks_the_batch_sizes_and_keeps_the_legend_off_the_lines():
    """Batch 3 had no tick (log2 ticks at powers of two), and with 8 lines the legend sat over the data."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from blockpress.bench import figure

    engines = ("blockpress", "blockpress_ar", "blockpress_int8", "blockpress_ar_int8", "reference")
    rows = [{"batch": b, "canvas": c, **{e: {"tok_s": 10.0 * b + c} for e in engines}} for c in (4, 16) for b in (1, 3, 5)]
    result = {"rows": rows, "params": 190_000, "machine": {"threads": 1},
              "settings": {"preset": "tiny", "dtype": "float32", "new_tokens": 16, "steps": 1, "device": "cpu"}}
    fig = figure(result)
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == [1, 3, 5] and [t.get_text() for t in ax.get_xticklabels()] == ["1", "3", "5"]
    fig.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1 and len(ax.get_legend().get_texts()) == 8
    assert "1 step a canvas" in ax.get_title()
    plt.close(fig)


def test_bench_plot_refuses_a_path_without_a_plot_suffix_by_name(tmp_path):
    """plot(result, "bench_plot") failed in matplotlib with "Format 'partial' is not supported": the staging name's
    own ".partial" was taken for the format, and the path and the formats taken went unnamed."""
    pytest.importorskip("matplotlib")
    from blockpress.bench import plot

    result = {"rows": [{"batch": 1, "canvas": 16, "blockpress": {"tok_s": 10.0}}], "params": 1e5,
              "machine": {"threads": 1},
              "settings": {"preset": "tiny", "dtype": "float32", "new_tokens": 4, "steps": 1, "device": "cpu"}}
    for name in ("bench_plot", "bench.txt"):
        with pytest.raises(ValueError, match=r"^path: expected a file ending in one of \.png, \.svg, .*, got '.*"
                                             + name + "'$"):
            plot(result, tmp_path / name)
    assert list(tmp_path.iterdir()) == []
    plot(result, tmp_path / "bench.SVG")  # the suffix's format, whatever its case
    assert (tmp_path / "bench.SVG").read_text().startswith("<?xml") and len(list(tmp_path.iterdir())) == 1


def test_bench_help_says_the_plot_format_follows_the_suffix(capsys):
    """--plot said "write a PNG" while .svg, .pdf, .jpg, .webp were written too."""
    from blockpress.bench import PLOT_FORMATS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the suffix picks the format" in text and all(f".{f}" in text for f in PLOT_FORMATS)


def test_bench_compile_says_it_is_compiling(monkeypatch, capsys):
    """torch.compile took minutes for the tiny preset on a 2-core CPU (help: "tens of seconds") without a word on
    stderr. torch.compile itself is stubbed out here."""
    import blockpress.bench as bench
    from blockpress.lm import LM

    monkeypatch.setattr(LM, "compile", lambda self, **options: self)
    bench.run_bench(bench.BenchSettings(preset="tiny", batch_sizes=[1, 2], new_tokens=4, steps=1, prompt_length=2,
                                        canvas_lengths=[4], repeats=1, reference=False, ar=False, compile=True))
    err = capsys.readouterr().err
    assert [line.split(",")[0] for line in err.splitlines() if "compiling" in line] == [
        "bench: compiling blockpress with torch.compile for batch 1", "bench: compiling blockpress with torch.compile for batch 2"]
    assert err.count("bench: compiled in") == 2
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tens of seconds" not in text and "minutes on a CPU" in text


def test_bench_errors_name_the_flags_and_give_advice_bench_can_take(monkeypatch, capsys):
    """--cuda-graphs on a CPU named the field cuda_graphs; weights too big for the device were refused with
    random_model's advice, device='meta', which bench refuses."""
    import blockpress.bench as bench

    assert main(["bench", "--preset", "tiny", "--cuda-graphs", "--new-tokens", "16", "--steps", "1"]) == 2
    assert "blockpress bench: error: --cuda-graphs: needs a CUDA device" in capsys.readouterr().err
    too_little = lambda device: 1000  # noqa: E731  (bytes free: less than any preset's weights)
    monkeypatch.setattr("blockpress.checkpoint.available_bytes", too_little)
    monkeypatch.setattr(bench, "available_bytes", too_little, raising=False)
    assert main(["bench", "--preset", "tiny", "--new-tokens", "16", "--steps", "1", "--no-reference"]) == 2
    err = capsys.readouterr().err
    assert "GB are available" in err and "a smaller --preset, --dtype or --layers" in err and "device='meta'" not in err
    assert "blockpress info --model random-tiny --device meta" in err


def info_json(capsys, *args):
    assert main(["info", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("stored,declared", [("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "bfloat16")])
@pytest.mark.parametrize("dtype,quantize", [(None, None), (None, "int8"), ("bfloat16", "int4"), ("float32", None)])
def test_info_reports_the_dtype_and_bytes_a_load_gives(tmp_path, capsys, stored, declared, dtype, quantize):
    """info planned the load on its own (its dtype rule fell back to config.json's declared dtype, a load's does
    not); both now go through checkpoint.plan_model. The folder's files and its config.json disagree here."""
    blockpress.random_model(blockpress.ModelConfig.tiny(), dtype=stored).save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": declared}))
    flags = [*(["--dtype", dtype] if dtype else []), *(["--quantize", quantize] if quantize else [])]
    info = info_json(capsys, "--model", str(tmp_path), *flags)
    lm = blockpress.load(tmp_path, dtype=dtype, quantize=quantize)
    assert info["dtype"] == str(lm.dtype).removeprefix("torch.") and info["checkpoint_dtype"] == stored
    assert info["weights_bytes"] == lm.weights_bytes() and info["quantization"] == lm.quantization


@pytest.mark.parametrize("native", [True, False])
def test_info_says_why_it_computes_in_another_dtype_than_the_one_stored(tmp_path, monkeypatch, capsys, native):
    """On a CPU without native bf16, info showed dtype float32 beside checkpoint_dtype bfloat16 and never said why;
    only --dtype's help did. dtype_note says it, and what --dtype bfloat16 does (the CPU is stood in for)."""
    from blockpress import checkpoint

    blockpress.random_model(blockpress.ModelConfig.tiny(), dtype="bfloat16").save(tmp_path)
    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: native)
    info = info_json(capsys, "--model", str(tmp_path))
    if native:
        assert info["dtype"] == "bfloat16" and info["dtype_note"] is None
    else:
        assert info["dtype"] == "float32" and info["checkpoint_dtype"] == "bfloat16"
        assert info["dtype_note"].startswith("stored bfloat16, computed in float32: this CPU has no native bf16 "
                                             "matmuls (AVX512-BF16 / AMX); --dtype bfloat16 forces it, slower here")
    assert info_json(capsys, "--model", str(tmp_path), "--dtype", "bfloat16")["dtype_note"] is None  # asked for
    assert info_json(capsys, "--model", str(tmp_path), "--device", "meta")["dtype_note"] is None  # not a CPU


def test_info_keeps_a_loads_check_that_the_scheme_runs(tmp_path, monkeypatch, capsys):
    """info quantized its meta model without asking whether the scheme runs on --device (fp8 in float32 on CUDA
    does not): it described a load that would be refused. The refusal is stood in for here (no GPU needed)."""
    import blockpress.quantize

    def refuse(scheme, device, dtype):
        if device.type != "meta":  # the meta layout itself never runs
            raise ValueError(f"quantize={scheme!r}: does not run on {device}")

    monkeypatch.setattr(blockpress.quantize, "check_runs", refuse)
    assert main(["info", "--model", MODEL, "--quantize", "fp8", "--json"]) == 2
    assert "does not run on cpu" in capsys.readouterr().err


def test_info_on_a_config_alone_ignores_a_dtype_it_cannot_compute_in(tmp_path, capsys):
    """A config.json alone that declared `"dtype": "auto"` was refused with "dtype: expected one of ...", an error
    about a flag nobody gave; with no weights to go by, the default (float32) is described."""
    config = json.loads((blockpress.lm.resolve_path(MODEL) / "config.json").read_text())
    config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "auto"}))
    assert info_json(capsys, "--model", str(tmp_path))["dtype"] == "float32"
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert info_json(capsys, "--model", str(tmp_path), "--device", "meta")["dtype"] == "bfloat16"


@pytest.mark.parametrize("template, message", [
    ("x = <|hole:0|>", "template: <|hole:0|> holds no token"),
    ("x = <|HOLE|>", "template: '<|HOLE|>' looks like a hole marker but is not one"),
    ("x = <| hole |>", "template: '<| hole |>' looks like a hole marker but is not one"),
    ("x = 1", "template: has no holes to fill; mark them with <|hole|> (--hole-length tokens) or <|hole:N|>"),
    ("", "template: empty text"),
])
def test_infill_refuses_a_bad_template_before_loading(template, message, monkeypatch, capsys):
    """infill loaded the model first, so a typo in a marker cost a full load (minutes for a 26B) before its error;
    sudoku already checked its puzzles first. The library's own parser checks it now, before the load."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["infill", template, "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert f"infill: error: {message}" in err and "-1 ids" not in err


@pytest.mark.parametrize("args, message", [
    (["x = <|hole:99999999999999999999|>"],
     "template: <|hole:99999999999999999999|> takes the template past the model's context of 131072 tokens"),
    (["x = <|hole:131072|>"], "template: <|hole:131072|> takes the template past the model's context of 131072"),
    (["x = <|hole|>", "--hole-length", "99999999999999999999"],
     "--hole-length: 99999999999999999999 tokens for each <|hole|> take the template past the model's context of "
     "131072 tokens"),
])
def test_infill_refuses_a_hole_past_the_context_before_loading(args, message, monkeypatch, capsys):
    """The check before the load parsed the template with no context to check against, so it laid each hole out
    as a list of its length first: an OverflowError traceback for 10**20 tokens, an 80 GB list for 10**10. The
    context is read from the model's config (a preset's here) without loading it."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["infill", *args, "--model", "random-tiny", "--threads", "1"]) == 2
    assert f"infill: error: {message}" in capsys.readouterr().err


def test_infill_keeps_the_templates_tokens_with_no_token_healing(capsys):
    """--no-token-healing was generate's alone: infill always healed the space before a hole into it (the library's
    token_healing=False was out of reach), so a hole after a space could not be N tokens after it."""
    runs = []
    for flags in ([], ["--no-token-healing"]):
        assert main(["infill", "left <|hole:5|> right", "--model", MODEL, "--steps", "2", "--seed", "0", "--json",
                     "--threads", "1", *flags]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    healed, kept = runs
    assert kept["template_tokens"] == healed["template_tokens"] + 1 and kept["filled_tokens"] == 5
    assert kept["text"] == "left " + kept["fills"][0] + " right"


def test_infill_still_fills_after_the_early_check(capsys):
    """The check before the load passes a good template through unchanged (fixed text with a stand-in tokenizer)."""
    assert main(["infill", "def f(x):\n    return <|hole:3|>\n", "--model", MODEL, "--steps", "2", "--seed", "0",
                 "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].startswith("def f(x):\n    return") and len(out["fills"]) == 1 and out["filled_tokens"] == 3


def test_top_k_and_top_p_reach_the_sampler(capsys, monkeypatch):
    """--top-k and --top-p filter the candidate draws (SamplerConfig.top_k / top_p); bad values are named."""
    seen = []
    original = blockpress.LM.stream
    monkeypatch.setattr(blockpress.LM, "stream", lambda self, *a, **kw: seen.append(kw) or original(self, *a, **kw))
    base = ["generate", "x", "--model", "random-tiny", "--max-new-tokens", "4", "--steps", "2", "--no-live"]
    assert main([*base, "--top-k", "3", "--top-p", "0.5"]) == 0
    assert seen[0]["top_k"] == 3 and seen[0]["top_p"] == 0.5
    assert main([*base, "--top-p", "1.5"]) == 2
    assert "--top-p: expected a probability in (0, 1]" in capsys.readouterr().err


def test_generate_chat_prompts_through_the_chat_template(monkeypatch, capsys):
    """`generate` sent <bos> + the raw text even to an instruction-tuned model; --chat renders it as a user message
    (after --system's) with the template's generation prompt, and prints the reply alone."""
    import blockpress.lm
    from blockpress.cli.common import load_model

    prompts, original = [], blockpress.lm.LM.stream
    monkeypatch.setattr(blockpress.lm.LM, "stream", lambda self, prompt, *a, **kw: prompts.append(prompt)
                        or original(self, prompt, *a, **kw))
    tok = load_model(MODEL, None, "meta").tokenizer
    base = ["generate", "Write a haiku.", "--chat", "--model", MODEL, "--max-new-tokens", "8", "--steps", "2",
            "--seed", "3", "--threads", "1"]
    for system in (None, "Be brief."):
        messages = [{"role": "system", "content": system}] * (system is not None) + [
            {"role": "user", "content": "Write a haiku."}]
        flags = ["--system", system] if system else []
        assert main([*base, *flags, "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert prompts[-1] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        assert got["prompt"] == "Write a haiku."
        assert got["text"] == load_model(MODEL, None, "cpu").chat(messages, max_new_tokens=8, max_denoising_steps=2,
                                                                   seed=3).texts[0]
        assert main([*base, *flags, "--no-live"]) == 0
        assert capsys.readouterr().out == got["text"] + "\n"  # the reply, not the prompt before it


def test_chat_json_lines_are_the_replies(monkeypatch, capsys):
    """Piped replies hold newlines themselves, so plain stdout could not be split into replies; --json gives one
    line per line read: its reply, the error that dropped it, or the command it was ("/bogus" and "/help" got no
    line, so a script reading one line per line it wrote fell out of step, or waited forever)."""
    from blockpress.cli.common import load_model

    context = load_model(MODEL, None, "meta").config.text.max_position_embeddings
    lines = ["def add(a, b):", "/help", "/bogus", "x " * context, "", "/reset", "now a class", "/exit", "unread"]
    flags = ["chat", "--model", MODEL, "--max-new-tokens", "24", "--steps", "2", "--seed", "1", "--threads", "1"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(flags) == 0
    plain = capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main([*flags, "--json"]) == 0
    out = capsys.readouterr().out
    turns = [json.loads(line) for line in out.splitlines()]
    assert [t["prompt"] for t in turns] == [line for line in lines[: lines.index("/exit") + 1] if line]
    assert turns[1] == {"prompt": "/help", "command": "help"} and turns[4] == {"prompt": "/reset", "command": "reset"}
    assert turns[-1] == {"prompt": "/exit", "command": "exit"}  # answered too; "unread" is not
    assert turns[2]["error"].startswith("unknown command '/bogus'") and "text" not in turns[2]
    assert turns[3]["error"].startswith("the message is too long") and "text" not in turns[3]
    replies_ = [turns[0]["text"], turns[5]["text"]]
    assert "".join(r + "\n" for r in replies_) == plain and any("\n" in r for r in replies_)
    for t in (turns[0], turns[5]):
        assert {"new_tokens", "forward_passes", "tokens_per_forward", "tok_s", "seconds"} <= set(t)


def test_chat_json_says_how_much_of_the_prompt_the_cache_held(monkeypatch, capsys):
    """A script could not see the cache's reuse (the help promised "each turn encodes only the new tokens", which a
    reply that re-tokenizes differently breaks): each reply's line has prompt_tokens (the conversation with the
    chat template) and cached_tokens, the rest being what the turn encoded."""
    import blockpress.lm

    encoded, original = [], blockpress.lm.LM.generate

    def spy(self, prompt, *a, **kw):
        encoded.append(len(prompt[0]))
        return original(self, prompt, *a, **kw)

    monkeypatch.setattr(blockpress.lm.LM, "generate", spy)
    lines = ["def add(a, b):", "and a test", "/reset", "again"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "8", "--steps", "2", "--threads", "1", "--json"]) == 0
    turns = [t for t in map(json.loads, capsys.readouterr().out.splitlines()) if "text" in t]
    assert [t["prompt_tokens"] - t["cached_tokens"] for t in turns] == encoded
    assert turns[0]["cached_tokens"] == 0 == turns[2]["cached_tokens"]  # a new conversation: nothing cached
    assert 0 < turns[1]["cached_tokens"] < turns[1]["prompt_tokens"]


def test_chat_help_lists_the_commands(monkeypatch, capsys):
    """"/help" was refused as an unknown command."""
    from blockpress.cli.chat import CHAT_HELP

    sent = chat_turns(monkeypatch, ["/help", "/exit"])
    err = capsys.readouterr().err
    assert sent == [] and CHAT_HELP in err and "unknown command" not in err
    for command in ("/help", "/reset", "/exit", "/quit", "//"):
        assert command in CHAT_HELP


def test_chat_needs_a_chat_template(tmp_path, capsys):
    from blockpress.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([""], vocab_size=300)
    tokenizer.chat_template = None
    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), tokenizer=tokenizer).save(tmp_path)
    for command in (["generate", "hi", "--chat"], ["chat"]):
        assert main([*command, "--model", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"error: --model {tmp_path}: has no chat template" in err and command[-1] in err
    assert main(["generate", "hi", "--system", "x"]) == 2
    assert "--system: a system message goes with --chat" in capsys.readouterr().err


def test_generate_chat_refuses_token_healing_by_name(monkeypatch, capsys):
    """--chat never heals (its prompt ends with the template's turn header), and an explicit --token-healing with it
    was dropped without a word: the reply was the unhealed one. It is refused before the model loads."""
    import blockpress.cli.generate

    monkeypatch.setattr(blockpress.cli.common, "load_announced", lambda args: pytest.fail("loaded the model first"))
    assert main(["generate", "hi", "--chat", "--token-healing"]) == 2
    assert "error: --token-healing: not with --chat, whose prompt ends with the chat template's turn header" in (
        capsys.readouterr().err)


def test_chat_without_a_tokenizer_names_the_tokenizer(tmp_path, capsys):
    """A folder whose tokenizer_config.json holds a chat template but which has no tokenizer.json: chat blamed the
    missing chat template, which is there; the tokenizer is what is missing (as generate --chat said)."""
    blockpress.random_model(blockpress.ModelConfig.preset("tiny")).save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    for command in (["generate", "hi", "--chat"], ["chat"]):
        assert main([*command, "--model", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"--model {tmp_path}: has no tokenizer.json" in err and "chat template" not in err
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "a", "template": "a<|hole|>"}) + "\n")
    for command, what in ((["generate", "hi"], "prompt"), (["infill", "a<|hole|>"], "template"),
                          (["generate", "--input", str(tmp_path / "in.jsonl")], "prompt"),
                          (["infill", "--input", str(tmp_path / "in.jsonl")], "template")):
        assert main([*command, "--model", str(tmp_path), "--output", str(tmp_path / "out.jsonl")]
                    if "--input" in command else [*command, "--model", str(tmp_path)]) == 2
        assert f"--model {tmp_path}: has no tokenizer.json, so it cannot take a text {what}" in capsys.readouterr().err


def test_prefill_chunk_is_set_on_the_model_and_changes_nothing_but_memory(capsys):
    """--prefill-chunk N: prompts encode N tokens a pass (the model's prefill_chunk); the output is the same."""
    from blockpress.cli.common import load_announced

    args = build_parser().parse_args(["generate", "x", "--model", "random-tiny", "--prefill-chunk", "3"])
    assert load_announced(args).model.prefill_chunk == 3
    base = ["generate", "def add(a, b):\n    return", "--model", "random-tiny", "--max-new-tokens", "16",
            "--steps", "2", "--seed", "5", "--json"]
    assert main(base) == 0
    whole = json.loads(capsys.readouterr().out)["text"]
    assert main(base + ["--prefill-chunk", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == whole
    assert main(base + ["--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk: expected a positive integer (tokens per pass), got 0" in capsys.readouterr().err


def test_chat_system_message_starts_every_conversation(monkeypatch, capsys):
    """`generate --chat` took --system and `chat` did not: a model tuned with a system prompt could not be chatted
    with as trained. It starts the conversation, and the new one after /reset, as generate --chat renders it."""
    from blockpress.lm import LM

    rendered, original = [], LM.chat_prompt
    monkeypatch.setattr(LM, "chat_prompt", lambda self, messages, **kw: rendered.append(
        [dict(m) for m in messages]) or original(self, messages, **kw))
    lines = iter(["hello there", "and again", "/reset", "fresh start", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    assert main(["chat", "--model", MODEL, "--system", "Be brief.", "--max-new-tokens", "4", "--steps", "2"]) == 0
    system = {"role": "system", "content": "Be brief."}
    turns = rendered[1:]  # (the first renders a probe: the template takes a system message)
    assert [[m["role"] for m in r] for r in turns] == [["system", "user"], ["system", "user", "assistant", "user"],
                                                       ["system", "user"]]
    assert all(r[0] == system for r in rendered) and turns[2][1]["content"] == "fresh start"
    assert replies(capsys.readouterr().err) == 3


def test_bench_gemm_bound_is_the_reference_step_time_over_the_gemm_time(monkeypatch):
    """The GEMM bound divided the reference's whole run, its prefill and canvas encodes included, by its decoder
    passes: with a 4,096-token prompt it read 313x where the reference's own time per step gave 11.4x. Here the
    reference's encoder passes take 1 s each and its decoder passes 10 ms: the bound is its 10 ms a step over
    blockpress's GEMM time, not (2 s + 4 x 10 ms) / 4 passes over it."""
    import blockpress.bench as bench

    reference, _ = reference_run_on_a_fake_clock(monkeypatch)
    row = {"reference": reference, "blockpress": {"tok_s": 100.0, "ms_per_step": 4.0, "forward_passes": 4},
           "gemm_ms_per_step": 2.0}
    bench._add_ratios(row, [])
    assert row["speedup_bound_at_this_precision"] == pytest.approx(10 / 2)
    assert row["step_speedup_vs_reference"] == pytest.approx(10 / 4)
    # a reference whose steps were not timed (its encoder unseen) gives no bound rather than a whole-run one
    row = {"reference": {"tok_s": 1.0, "seconds": 2.04}, "blockpress": row["blockpress"], "gemm_ms_per_step": 2.0}
    bench._add_ratios(row, [])
    assert "speedup_bound_at_this_precision" not in row


def test_bench_sweeps_sizes_in_ascending_order_each_once(tmp_path, monkeypatch):
    """--batch-sizes 4 1 2 1 was timed in the order typed, 1 twice, and the plot joined the points in that order
    (a line doubling back through batch 1). Sizes and canvas lengths are now swept ascending, each once; the
    rows' timing is stubbed out."""
    pytest.importorskip("matplotlib")
    import blockpress.bench as bench

    timed = []

    def row(lm, ref, variants, b, s, ar):
        timed.append((lm.config.canvas_length, b))
        engines = {"blockpress": {"tok_s": 10.0 * b}, **({"blockpress_ar": {"tok_s": 5.0 * b}} if ar else {})}
        return {"batch": b, "canvas": lm.config.canvas_length, **engines}

    monkeypatch.setattr(bench, "_bench_row", row)
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "4", "1", "2", "1", "--canvas-lengths", "8", "4", "8",
                 "--new-tokens", "8", "--steps", "1", "--no-reference", "--out", str(tmp_path / "b.json")]) == 0
    assert timed == [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["settings"]["batch_sizes"] == [1, 2, 4] and data["canvases"] == [4, 8]
    for line in bench.figure(data).axes[0].get_lines():  # every line runs left to right
        xs = list(line.get_xdata())
        assert xs == sorted(set(xs)) == [1, 2, 4]
    assert bench.BenchSettings(preset="tiny", batch_sizes=[3, 3, 1]).batch_sizes == [1, 3]


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "0"], "--top-p: expected a probability in (0, 1]"),
    (["--steps", "0"], "--steps: expected an integer in [1, 2147483647], got 0"),
    (["--seed", "-1"], "--seed: expected an integer in [0, 2**63), got -1"),
    (["--temperature", "-1"], "--temperature: expected a finite number >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer, got 0"),
    (["--min-new-tokens", "40", "--max-new-tokens", "8"], "--min-new-tokens: expected an integer in [0,"),
    (["--min-new-tokens", "100000"], "--min-new-tokens: a one-word message takes "),
])
def test_chat_refuses_a_bad_sampling_flag_at_start(flags, message, monkeypatch, capsys):
    """chat built its sampling settings per message: with a bad flag every message was refused ("that message was
    dropped, the conversation goes on"), the REPL ran on and exited 0. It is refused before a line is read, exit 2,
    as generate refuses it."""
    monkeypatch.setattr("builtins.input", lambda _prompt: pytest.fail("read a message"))
    assert main(["chat", "--model", MODEL, "--threads", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert f"chat: error: {message}" in err and "dropped" not in err


def test_chat_refuses_a_system_message_that_leaves_no_room(monkeypatch, capsys):
    """A --system longer than the context made every message "too long ... shorten it" (and /reset did not help):
    a session that could never work, exit 0. It is refused at start, naming --system."""
    from blockpress.cli.common import load_model

    context = load_model(MODEL, None, "meta").config.text.max_position_embeddings
    monkeypatch.setattr("builtins.input", lambda _prompt: pytest.fail("read a message"))
    assert main(["chat", "--model", MODEL, "--threads", "1", "--system", "x " * context]) == 2
    err = capsys.readouterr().err
    assert "chat: error: --system: with the chat template and a one-word message it takes " in err
    assert f"of the model's {context} tokens, leaving 0, and a reply needs a whole canvas of" in err


def chat_on_a_terminal(keys, *flags):
    """Run `chat --json` on a pseudo-terminal, typing each of `keys` once the prompt for it is shown; returns the
    JSON lines it wrote (the terminal's echo and stderr share the output: the JSON lines are picked out)."""
    import os
    import pty
    import select
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "blockpress.cli", "chat", "--model", MODEL, "--json",
                             "--max-new-tokens", "4", "--steps", "2", "--threads", "1", *flags],
                            stdin=slave, stdout=slave, stderr=slave, env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    out = b""
    try:
        for typed in [*keys, None]:
            shown = out.count(b"you> ")
            deadline = time.monotonic() + 120
            # the next prompt (or, after the last keys, the end of the run)
            while (proc.poll() is None if typed is None else out.count(b"you> ") == shown):
                assert time.monotonic() < deadline, out.decode(errors="replace")
                if select.select([master], [], [], 0.2)[0]:
                    try:
                        out += os.read(master, 4096)
                    except OSError:  # the other end closed: the run ended
                        break
            if typed is not None:
                os.write(master, typed)
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    return [json.loads(line) for line in out.decode(errors="replace").splitlines() if line.startswith("{")]


@pytest.mark.skipif(sys.platform == "win32" or importlib.util.find_spec("readline") is None,
                    reason="needs a pseudo-terminal and readline")
def test_chat_on_a_terminal_edits_lines_and_keeps_history():
    """input() without readline: Left-arrow reached the model as "\\x1b[D" and Up-arrow sent "\\x1b[A" as a
    message. On a terminal the arrow keys now edit the line and recall the last one."""
    lines = chat_on_a_terminal([b"ac\x1b[Db\r", b"\x1b[A\r", b"/exit\r"])
    assert [line["prompt"] for line in lines] == ["abc", "abc", "/exit"]


def test_chat_sends_a_message_of_several_lines(monkeypatch, capsys):
    """A message could not hold a newline: a pasted 3-line function was 3 messages with 3 replies, and a script
    could not send one at all. Lines between two lines of \"\"\" are one message, as typed (a block is never a
    command); with --json a line that is a JSON string is the text it holds; a block left open is not sent."""
    block = ['"""', "def add(a, b):", '    """Add."""', "/not a command", "", '"""  ']
    sent = chat_turns(monkeypatch, [*block, '"x = 1\\ny = 2"', '"a" and "b"', "/help", '"""', "never closed"],
                      "--json")
    assert sent == ['def add(a, b):\n    """Add."""\n/not a command\n', "x = 1\ny = 2", '"a" and "b"']
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in out] == [*sent, "/help", "never closed"]
    assert "text" in out[0] and out[3] == {"prompt": "/help", "command": "help"}
    assert out[4]["error"].startswith('the message started by a line of """ ended without')


def test_chat_pasted_blocks_open_and_close_as_typed_ones(monkeypatch, capsys):
    """readline 8.1+ takes a terminal's paste of several lines as one line, newlines and all (bracketed paste):
    a pasted block, \"\"\" lines included, was sent with its \"\"\" lines as part of the message, and a paste whose
    last line was the \"\"\" closing a block typed open was one more line of it, the block left open. A paste that
    holds a \"\"\" line is read a line at a time, as typed; one that holds none is one message, never a command."""
    import blockpress.tokenizer

    sent, original = [], blockpress.tokenizer.Tokenizer.apply_chat_template

    def spy(self, messages, *args, **kwargs):
        sent.append(messages[-1]["content"])
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(blockpress.tokenizer.Tokenizer, "apply_chat_template", spy)
    typed = iter(['"""\ndef f():\n    return 1\n"""',  # a block pasted whole
                  '"""', 'x = 1\r\n"""',  # a block typed open, its end pasted (a CRLF paste)
                  "// a comment\nfoo()",  # no block line: the paste is the message, as pasted
                  '"""\nkept\n"""\nafter',  # lines after a pasted block are lines typed after it
                  "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(typed))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "4", "--steps", "2", "--threads", "1", "--json"]) == 0
    assert sent[1:] == ["def f():\n    return 1", "x = 1", "// a comment\nfoo()", "kept", "after"]
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in out] == [*sent[1:], "/exit"] and all("text" in line for line in out[:-1])


def test_chat_json_strings_are_messages_never_commands(monkeypatch, capsys):
    """A JSON string is the text it holds, yet it was then read as a command: a script that JSON-encodes each
    message got '"/usr/bin is slow\\nwhy?"' refused as an unknown command and '"//x"' sent as "/x". Like a block,
    it is a message whatever it starts with; a plain line is still a command."""
    sent = chat_turns(monkeypatch, ['"/usr/bin is slow\\nwhy?"', '"//x"', '"/reset"', "/reset"], "--json")
    assert sent == ["/usr/bin is slow\nwhy?", "//x", "/reset"]
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert ["text" in line for line in out] == [True, True, True, False] and out[3]["command"] == "reset"


def test_chat_json_answers_a_json_string_holding_a_lone_surrogate_and_goes_on(monkeypatch, capsys):
    """'"\\ud800"' (a lone surrogate no byte read stands for) was dropped as not UTF-8, and then its JSON line failed to
    encode it: the chat ended with exit 2 and the lines after it were never read. Its line now says it, U+FFFD for
    the surrogate, and the chat goes on."""
    sent = chat_turns(monkeypatch, ["hi", '"\\ud800"', '"a\\udfffb"', "hello"], "--json")
    assert sent == ["hi", "hello"]
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in out] == ["hi", "\ufffd", "a\ufffdb", "hello"]
    assert "lone surrogate U+D800" in out[1]["error"] and "text" in out[3]


def test_chat_json_answers_an_empty_message(monkeypatch, capsys):
    """An empty JSON string or block is no blank line: it was skipped with no JSON line, and a script that waits
    for one line per line it wrote waited forever. It is refused, with its line; blank lines are still skipped."""
    sent = chat_turns(monkeypatch, ['""', '"""', '"""', '"  "', "", "hi"], "--json")
    assert sent == ["hi"]
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out[:3] == [{"prompt": "", "error": "the message is empty"}, {"prompt": "", "error": "the message is empty"},
                       {"prompt": "  ", "error": "the message is empty"}]
    assert len(out) == 4 and out[3]["prompt"] == "hi" and "text" in out[3]


def test_chat_json_says_which_seed_each_reply_was_drawn_with(monkeypatch, capsys):
    """Without --seed each turn draws a fresh seed, and --json never said which: a sampled reply one liked could not
    be had again. Its line gives the seed, and lm.chat with seeds=[it] repeats the reply."""
    flags = ["--max-new-tokens", "8", "--steps", "2", "--temperature", "1.5", "--json"]
    chat_turns(monkeypatch, ["def add(a, b):"], *flags)
    line = json.loads(capsys.readouterr().out)
    lm = blockpress.load(MODEL)
    sampler = lm.sampler_defaults.with_(max_denoising_steps=2).with_temperature(1.5, sampler_given=False)
    again = lm.chat([{"role": "user", "content": "def add(a, b):"}], max_new_tokens=8, min_new_tokens=1,
                    sampler=sampler, seeds=[line["seed"]])
    assert again.texts[0] == line["text"]
    # as chat's --help says: generate --chat repeats it too, given chat's minimum of 1 (its own default is 0)
    assert main(["generate", "def add(a, b):", "--chat", "--model", MODEL, *flags, "--seed", str(line["seed"]),
                 "--min-new-tokens", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == line["text"]
    assert "lm.chat(..., seeds=[seed]) repeats the reply given this command's --min-new-tokens as its minimum, 1 by " \
           "default here and 0 in lm.chat" in " ".join(run_cli("chat", "--help").stdout.split())


def test_chat_without_json_reads_a_json_line_as_typed(monkeypatch, capsys):
    assert chat_turns(monkeypatch, ['"x = 1\\ny = 2"']) == ['"x = 1\\ny = 2"']


def test_the_console_script_ends_quietly_on_a_ctrl_c_while_torch_imports():
    """The console script was blockpress.cli:main, whose import imports torch (a second or more) before main's
    Ctrl-C handling exists: a Ctrl-C then printed a traceback from inside torch's import and the process died of
    SIGINT. The script pyproject.toml names is imported as the installed wrapper imports it, with a Ctrl-C arriving
    while torch imports: status 130, and the one line that says so."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    target = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["blockpress"]
    module, _, function = target.partition(":")
    wrapper = f"""
import sys

class CtrlC:  # the import of torch is where the Ctrl-C lands
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
from {module} import {function}
sys.exit({function}())
"""
    r = subprocess.run([sys.executable, "-c", wrapper, "info"], cwd=root, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (130, "blockpress info: interrupted\n")


@pytest.mark.skipif(sys.platform == "win32", reason="no SIGTERM or SIGHUP to raise on Windows")
@pytest.mark.parametrize("signum, status, said", [("SIGINT", 130, "interrupted"),
                                                  ("SIGTERM", 143, "stopped by SIGTERM")])
def test_a_stop_signal_while_a_command_imports_torch_stops_it(signum, status, said):
    """A Ctrl-C in a command's first second, while torch's C start-up imports numpy, raised its KeyboardInterrupt
    inside that import, which torch clears: the command ran to the end and exited 0. A SIGTERM there killed the
    process without a word. The signal, raised (as delivered) when numpy starts importing: its status and line."""
    script = f"""
import signal, sys

class Stop:  # numpy, imported by torch's C start-up, is where the signal lands
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.{signum})

assert "torch" not in sys.modules
sys.meta_path.insert(0, Stop())
from blockpress.cli import main
sys.exit(main())
"""
    r = subprocess.run([sys.executable, "-c", script, "info", "--model", "random-tiny", "--json"], capture_output=True,
                       text=True, timeout=60)
    assert (r.returncode, r.stderr, r.stdout) == (status, f"blockpress info: {said}\n", "")


@pytest.mark.parametrize("terminal", [True, False])
def test_chat_replies_on_a_terminal_show_control_characters_harmlessly(terminal, monkeypatch, capsys):
    """A reply went to the terminal as the model wrote it: an escape sequence in it (the tiny random model writes
    \\x03, \\x0c, \\x18) could leave the terminal coloured or cleared. On a terminal they show as U+FFFD; piped, the
    reply is the model's own text."""
    import blockpress.lm

    original = blockpress.lm.LM.chat_ids

    def reply_with_escapes(self, *a, **kw):
        out = original(self, *a, **kw)
        out.texts = ["red \x1b[31malert\x07"]
        return out

    monkeypatch.setattr(blockpress.lm.LM, "chat_ids", reply_with_escapes)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    chat_turns(monkeypatch, ["hi"])
    out = capsys.readouterr().out
    assert out == ("red \ufffd[31malert\ufffd\n" if terminal else "red \x1b[31malert\x07\n")


@pytest.mark.parametrize("native", [True, False])
def test_an_emulated_half_precision_dtype_is_named_before_a_slow_run(monkeypatch, capsys, native):
    """--dtype bfloat16 on a CPU without bf16 matmuls ran about 30x slower than the float32 a load picks there by
    itself, with nothing said: it looked like a hang. A note on stderr says so (the CPU is stood in for)."""
    from blockpress import checkpoint

    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: native)
    args = ["generate", "def f(x):", "--model", "random-tiny", "--max-new-tokens", "8", "--steps", "1", "--json"]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert ("no native bf16 matmuls" in err) is not native
    assert main(args) == 0 and "native" not in capsys.readouterr().err  # float32 (the default here): nothing said
    assert main([*args, "--dtype", "bfloat16", "--device", "meta"]) != 0  # not a CPU: no note (meta cannot run)
    assert "native" not in capsys.readouterr().err


class TerminalIO(io.StringIO):
    def isatty(self):
        return True


def live_chat(monkeypatch, lines, stdout, on_event, *flags):
    """`chat` typed at a terminal, its replies to `stdout`; on_event(event, stdout) sees each of lm.chat_stream's
    events before the command does."""
    import blockpress.lm

    original = blockpress.lm.LM.chat_stream

    def spy(self, *a, **kw):
        for event in original(self, *a, **kw):
            on_event(event, stdout)
            yield event

    monkeypatch.setattr(blockpress.lm.LM, "chat_stream", spy)
    monkeypatch.setattr(sys, "stdin", TerminalIO("".join(line + "\n" for line in lines)))
    monkeypatch.setattr(sys, "stdout", stdout)
    return main(["chat", "--model", MODEL, "--max-new-tokens", "80", "--min-new-tokens", "70", "--steps", "2",
                 "--seed", "3", "--threads", "1", *flags])


def test_chat_on_a_terminal_shows_the_reply_as_it_is_made(monkeypatch, capsys):
    """On a terminal chat showed nothing until a reply was done (an 819-token one: ~30 s of blank screen), then
    all of it. Each canvas's text is printed as it commits now, and the reply printed is the one a non-terminal
    stdout gets at the same seed."""
    from blockpress.generate import Commit, Done

    seen = []  # (the reply's settled text at a Commit, what the screen held at the next event)

    def watch(event, stdout):
        if seen and seen[-1][1] is None:
            seen[-1] = (seen[-1][0], stdout.getvalue())
        if isinstance(event, Commit):
            seen.append((event.settled_texts[0], None))
        assert not isinstance(event, Done) or len(seen) > 1  # the reply takes several canvases

    screen = TerminalIO()
    assert live_chat(monkeypatch, ["hi"], screen, watch) == 0
    assert replies(capsys.readouterr().err) == 1  # its stats line, as before
    assert len(seen) > 1  # several canvases, each shown before the next was made
    for settled, shown in seen:
        assert shown.endswith("model> " + terminal_text(settled)) and settled
    piped = io.StringIO()
    monkeypatch.undo()
    monkeypatch.setattr(sys, "stdin", TerminalIO("hi\n"))
    monkeypatch.setattr(sys, "stdout", piped)
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "80", "--min-new-tokens", "70", "--steps", "2",
                 "--seed", "3", "--threads", "1"]) == 0
    # the screen's is the reply a stdout that is no terminal gets (unmarked there: the prompts go to stderr)
    assert screen.getvalue() == "you> model> " + terminal_text(piped.getvalue()) + "you> "


@pytest.mark.parametrize("out_of_memory", [True, False])
def test_chat_failing_midway_on_a_terminal_says_so_on_a_line_of_its_own(monkeypatch, out_of_memory):
    """A reply that failed after its first canvas was on screen (a GPU out of memory on a long conversation,
    non-finite logits) had its error written on after the last word shown: "model> def f(xerror: the device ran
    out of memory ...". The error starts a line of its own, as a Ctrl-C's note does; the chat goes on."""
    import dataclasses

    import blockpress.lm
    from blockpress.generate import Commit

    original = blockpress.lm.LM.chat_stream
    turns = []
    failure = torch.OutOfMemoryError(OOM) if out_of_memory else ValueError("the logits are not finite")

    def fails_after_a_canvas(self, *a, **kw):
        turns.append(1)
        for event in original(self, *a, **kw):
            if isinstance(event, Commit) and len(turns) == 1:
                yield dataclasses.replace(event, settled_texts=["def f(x"])  # a line part way along
                raise failure
            yield event

    monkeypatch.setattr(blockpress.lm.LM, "chat_stream", fails_after_a_canvas)
    screen = TerminalIO()  # stdout and stderr: one terminal
    monkeypatch.setattr(sys, "stdin", TerminalIO("hello\n" + "x " * 5000 + "\nagain\n"))
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "40", "--steps", "2", "--threads", "1"]) == 0
    shown = screen.getvalue()
    assert "model> def f(x\nerror: " in shown and "that message was dropped" in shown
    assert "you> error: the message is too long" in shown  # refused before any reply: no blank line first
    assert shown.count(" tok/s]") == 1  # the third message was answered


def test_chat_stopped_on_a_terminal_leaves_what_was_made_on_screen(monkeypatch, capsys):
    """A Ctrl-C during a reply on a terminal threw away everything made so far. What was committed stays on screen;
    the turn is dropped from the conversation as before, which goes on."""
    from blockpress.generate import Commit

    made = []

    def stop_after_a_canvas(event, stdout):
        if made and len(made) == 1:
            made.append(stdout.getvalue())
            raise KeyboardInterrupt
        if isinstance(event, Commit) and not made:
            made.append(event.settled_texts[0])

    screen = TerminalIO()
    assert live_chat(monkeypatch, ["hi", "again"], screen, stop_after_a_canvas) == 0
    assert made[0] and made[1].endswith("model> " + terminal_text(made[0]))
    assert "(stopped; that message was dropped, the conversation goes on)" in capsys.readouterr().err
    assert screen.getvalue().startswith(made[1]) and screen.getvalue().count("model> ") == 2


def test_loading_line_on_a_terminal_is_erased_without_escape_sequences(monkeypatch):
    """The "loading M ..." line a terminal's stderr shows during the load was erased with "\\r\\x1b[K": shown as
    "^[[K" where TERM=dumb (Emacs' shell) and "←[K" on a Windows console without VT processing. Spaces erase it
    on any terminal; a pipe still gets no line at all."""
    from blockpress.cli.common import load_announced

    args = build_parser().parse_args(["generate", "x", "--model", "random-tiny"])
    for stderr, shown in ((TerminalIO(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stderr)
        load_announced(args)
        err = stderr.getvalue()
        assert "\x1b" not in err
        assert err == ("loading random-tiny ...\r" + " " * len("loading random-tiny ...") + "\r" if shown else "")


def test_loading_line_on_a_terminal_shows_the_share_read(monkeypatch, tmp_path):
    """A load that reads for more than a second shows how much of the checkpoint is read (a 26B's 50 GB took
    minutes behind a bare "loading M ..."), then the widest line shown is erased."""
    import blockpress.cli.common
    from blockpress.cli.common import load_announced

    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0).save(tmp_path / "m")
    clock = iter(range(0, 10_000, 2))  # every reading of the clock two seconds on: each weight read is shown
    monkeypatch.setattr(blockpress.cli.common, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    stderr = TerminalIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    args = build_parser().parse_args(["generate", "x", "--model", str(tmp_path / "m"), "--dtype", "float32"])
    load_announced(args)
    err = stderr.getvalue()
    shown = err.split("\r")
    assert shown[0] == f"loading {tmp_path / 'm'} ..."
    assert re.fullmatch(rf"loading {re.escape(str(tmp_path / 'm'))} \.\.\. 100% of \d+\.\d MB", shown[-3])
    assert shown[-2] == " " * max(len(x) for x in shown[:-2]) and shown[-1] == ""
    percents = [int(re.search(r"(\d+)% of", x)[1]) for x in shown[1:-2]]
    assert len(percents) > 3 and percents == sorted(percents)


OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.20 GiB "
       "is free.\nIncluding non-PyTorch memory, this process has 138.00 GiB memory in use. (stand-in)")


@pytest.mark.parametrize("argv, flag", [
    (["generate", "def f(x):", "--max-new-tokens", "8"], "--max-new-tokens"),
    (["infill", "def f(<|hole|>):"], "--prefill-chunk"),
])
def test_out_of_memory_is_one_line_naming_what_takes_less(monkeypatch, capsys, argv, flag):
    """A GPU's OutOfMemoryError (a RuntimeError, which no handler took) ended the command in a torch traceback."""
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(OOM)

    for name in ("generate", "stream", "infill"):
        monkeypatch.setattr(blockpress.LM, name, out_of_memory)
    assert main([*argv, "--model", "random-tiny", "--no-live"] if argv[0] == "generate" else
                [*argv, "--model", "random-tiny"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"blockpress {argv[0]}: error: the device ran out of memory (CUDA out of memory. "
                              "Tried to allocate 20.00 GiB.")
    assert flag in err[-1] and "Traceback" not in "\n".join(err)


CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes. Error code 12"
# torch's texts elsewhere (c10/core/impl/alloc_cpu.cpp's _MSC_VER branch; aten/src/ATen/mps/MPSAllocator.mm): plain
# RuntimeErrors as well
WINDOWS_CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to "
                   "allocate 1099511627776 bytes.")
MPS_OOM = ("MPS backend out of memory (MPS allocated: 17.36 GB, other allocations: 613.56 MB, max allowed: 18.13 GB). "
           "Tried to allocate 192.00 MB on private pool.")


@pytest.mark.parametrize("failure", [RuntimeError(CPU_OOM), RuntimeError(WINDOWS_CPU_OOM), RuntimeError(MPS_OOM),
                                     MemoryError()])
def test_the_cpus_out_of_memory_is_one_line_too(monkeypatch, capsys, failure):
    """The CLI took torch.OutOfMemoryError alone: the CPU allocator's RuntimeError and Python's MemoryError (what a
    CPU run meets) escaped main() with a traceback, and a chat lost its conversation. The CPU allocator's text on
    Windows ("not enough memory") and MPS's were still not recognised."""
    def out_of_memory(*args, **kwargs):
        raise failure

    monkeypatch.setattr(blockpress.LM, "stream", out_of_memory)
    assert main(["generate", "def f(x):", "--max-new-tokens", "8", "--model", "random-tiny", "--no-live"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("blockpress generate: error: the device ran out of memory (") and "--max-new-tokens" in err[-1]
    assert "()" not in err[-1]  # (MemoryError() has no message: its name stands in)
    monkeypatch.undo()
    turns = []

    def fails_once(self, *args, **kwargs):
        turns.append(1)
        if len(turns) == 1:
            raise failure
        return original(self, *args, **kwargs)

    original = blockpress.LM.chat_ids  # (what a chat off a terminal calls)
    monkeypatch.setattr(blockpress.LM, "chat_ids", fails_once)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "4", "--steps", "2", "--threads", "1"]) == 0
    assert len(turns) == 2 and "that message was dropped, the conversation goes on" in capsys.readouterr().err


def test_every_flag_an_out_of_memory_hint_names_is_one_its_command_takes():
    """sudoku's hint said "a smaller --max-new-tokens or --prefill-chunk": it has no --max-new-tokens (its canvas is
    the 81 cells), and what it can shrink, the puzzles and --ensemble views a batch holds, went unnamed."""
    from blockpress.cli.output import OOM_HINTS

    subparsers = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    for command, hint in OOM_HINTS.items():
        taken = {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}
        named = set(re.findall(r"--[a-z][a-z-]*", hint))
        assert named and named <= taken, (command, named - taken)


def test_sudoku_out_of_memory_names_its_own_flags(monkeypatch, capsys):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr("blockpress.tasks.sudoku_model.solve", out_of_memory)
    assert main(["sudoku", "." * 80 + "1", "--threads", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("blockpress sudoku: error: the device ran out of memory (CUDA out of memory. ")
    assert "--ensemble" in err[-1] and "--max-new-tokens" not in err[-1]


def test_other_runtime_errors_still_raise(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug (stand-in)")

    monkeypatch.setattr(blockpress.LM, "generate", broken)
    monkeypatch.setattr(blockpress.LM, "stream", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "x", "--model", "random-tiny", "--max-new-tokens", "8", "--no-live"])


def test_chat_out_of_memory_drops_the_turn_and_goes_on(monkeypatch, capsys):
    """A GPU out of memory on one turn of a long conversation ended the whole chat (exit 1, the conversation lost);
    like a too-long message it drops that turn: the next one finds the cache as the turns before left it."""
    seen = second_turn_fails(monkeypatch, torch.OutOfMemoryError(OOM))  # the GPU runs out
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\na long one\nand again\n"))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", "6", "--steps", "2", "--json"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [t["prompt"] for t in lines] == ["hello there", "a long one", "and again"]
    assert lines[1]["error"].startswith("the device ran out of memory (CUDA out of memory. Tried to allocate")
    assert "--max-new-tokens" in lines[1]["error"] and "/reset" in lines[1]["error"]
    assert lines[0]["text"] and lines[2]["text"] and "text" not in lines[1]
    assert seen[1] == seen[2] > 0  # the third turn found the cache as the first left it
    assert "Traceback" not in captured.err


# A child process that runs `blockpress ARGS` with TARGET (module:attribute) wrapped: the wrapper sends this process
# SIG on its call number AT (after the first Commit, for LM.stream), as `timeout`, docker stop or a closed terminal
# would, then waits for it. A real signal, so in a child: unhandled, it ends the process where it stands.
SIGNALLED = """
import importlib, os, signal, sys, time
from blockpress.cli import main
from blockpress.generate import Commit

target, at, sig, args = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3]), sys.argv[4:]
# Under `nohup pytest` the child inherits SIGHUP ignored, which blockpress rightly leaves ignored: the signal sent
# below then did nothing, and the test waited out its 30 s sleep to fail. The test is of a terminal that closes.
signal.signal(sig, signal.SIG_DFL)
module, _, name = target.rpartition(":")
owner = importlib.import_module(module)
if "." in name:
    cls, name = name.split(".")
    owner = getattr(owner, cls)
original, calls = getattr(owner, name), []

def send():
    os.kill(os.getpid(), sig)
    time.sleep(30)  # the signal is taken here
    sys.exit("the signal did not stop the run")

def stream(*a, **kw):  # LM.stream: the signal after its first committed canvas
    for event in original(*a, **kw):
        yield event
        if isinstance(event, Commit):
            send()

def wrapped(*a, **kw):
    calls.append(1)
    if len(calls) == at:
        send()
    return original(*a, **kw)

setattr(owner, name, stream if name == "stream" else wrapped)
sys.exit(main(args))
"""


def run_signalled(target, at, signame, *args, stdin=""):
    return subprocess.run([sys.executable, "-c", SIGNALLED, target, str(at), signame, *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


STOP_SIGNALS = [pytest.param(name, marks=pytest.mark.skipif(sys.platform == "win32", reason=f"no {name} on Windows"))
                for name in ("SIGTERM", "SIGHUP")]


@pytest.mark.parametrize("signame", STOP_SIGNALS)
def test_generate_stopped_by_sigterm_or_sighup_keeps_the_text_as_a_ctrl_c_does(signame):
    """`timeout 60 blockpress generate --json` printed nothing: a SIGTERM (or a SIGHUP, the terminal closed) killed
    the process where it stood, where a Ctrl-C prints the text committed so far. They stop it as a Ctrl-C does,
    and the exit status is 128 + the signal (143, 129), as a shell reports a process the signal ended."""
    import signal

    r = run_signalled("blockpress.lm:LM.stream", 1, signame, "generate", "def f(x):", "--model", MODEL, "--json",
                      "--max-new-tokens", "64", "--min-new-tokens", "64", "--steps", "2", "--threads", "1")
    assert r.returncode == 128 + getattr(signal, signame), r.stderr
    cut = json.loads(r.stdout)
    assert cut["interrupted"] is True and cut["text"] and cut["prompt"] == "def f(x):"
    assert f"stopped by {signame} ({cut['new_tokens']} new tokens committed)" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("signame", STOP_SIGNALS)
def test_bench_stopped_by_sigterm_prints_the_rows_measured(signame):
    """A SIGTERM (`timeout`, a scheduler's time limit) lost every row bench had measured without --out."""
    import signal

    r = run_signalled("blockpress.bench:_bench_row", 2, signame, "bench", "--preset", "tiny", "--batch-sizes", "1",
                      "2", "--new-tokens", "8", "--steps", "1", "--repeats", "1", "--no-reference", "--threads", "1")
    assert r.returncode == 128 + getattr(signal, signame), r.stderr
    data = json.loads(r.stdout)
    assert data["partial"] is data["interrupted"] is True and [row["batch"] for row in data["rows"]] == [1]
    assert r.stderr.strip().splitlines()[-1].startswith(f"bench: stopped by {signame} after 1 row")


def test_chat_stopped_by_sigterm_ends_and_says_so():
    """A SIGTERM mid-reply killed chat where it stood. It ends the chat (a Ctrl-C drops the turn and goes on: a
    SIGTERM asks the process to end), the turn answered with its JSON line, later lines not read."""
    r = run_signalled("blockpress.lm:LM.chat_ids", 2, "SIGTERM", "chat", "--model", MODEL, "--json",
                      "--max-new-tokens", "4", "--steps", "2", "--threads", "1", stdin="hello\nsecond\nthird\n")
    assert r.returncode == 143, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["hello", "second"] and "text" in lines[0]
    assert lines[1]["error"] == "stopped by SIGTERM"
    assert "(stopped by SIGTERM; that message was dropped and the chat ends)" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(sys.platform == "win32" or importlib.util.find_spec("readline") is None,
                    reason="needs a pseudo-terminal and readline")
def test_chat_stopped_by_sigterm_at_the_prompt_gives_the_terminal_back():
    """A SIGTERM while chat waited at "you> " killed it inside readline, which had the terminal without line editing
    or echo (ICANON and ECHO off): left so, what was typed next was not shown. Now readline puts the terminal back,
    the chat says it ends, and the status is 143."""
    import os
    import pty
    import select
    import signal
    import termios
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "blockpress.cli", "chat", "--model", MODEL, "--threads", "1"],
                            stdin=slave, stdout=slave, stderr=slave, env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 120
        while b"you> " not in out:
            assert time.monotonic() < deadline and proc.poll() is None, out.decode(errors="replace")
            if select.select([master], [], [], 0.2)[0]:
                out += os.read(master, 4096)
        time.sleep(0.5)  # readline waits for the line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        while select.select([master], [], [], 0.2)[0]:
            try:
                out += os.read(master, 4096)
            except OSError:
                break
        lflag = termios.tcgetattr(master)[3]
        assert lflag & termios.ICANON and lflag & termios.ECHO
        assert out.decode(errors="replace").replace("\r\n", "\n").endswith("stopped by SIGTERM: the chat ends\n")
    finally:
        proc.kill()
        proc.wait()
        os.close(master)


WAITING = """
import importlib, sys, time
from blockpress.cli import main

target, args = sys.argv[1], sys.argv[2:]
module, _, name = target.rpartition(":")
owner = importlib.import_module(module)
if "." in name:
    cls, name = name.split(".")
    owner = getattr(owner, cls)

def wait(*a, **kw):  # the command at work, on a line of its own, until the stop comes
    sys.stderr.write("working\\n")
    sys.stderr.flush()
    time.sleep(60)
    sys.exit("no stop came")

def stream(*a, **kw):
    wait()
    yield

setattr(owner, name, stream if name == "stream" else wait)
sys.exit(main(args))
"""


def on_a_terminal(argv, ready, stop):
    """Run `argv` on a pseudo-terminal that is its controlling terminal and, once `ready` (bytes) is shown, stop it:
    `stop` "ctrl-c" types Ctrl-C (the terminal echoes "^C" and sends SIGINT), or a signal's name is sent. Returns
    the exit status and every byte the terminal got (its "\\n" is "\\r\\n")."""
    import fcntl
    import os
    import pty
    import select
    import signal
    import termios
    import time

    master, slave = pty.openpty()

    def controlling_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, preexec_fn=controlling_terminal,
                            env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    out, sent = b"", False
    try:
        deadline = time.monotonic() + 240
        while True:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            if select.select([master], [], [], 0.1)[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the other end closed: the run ended
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
            if not sent and ready in out:
                time.sleep(0.3)
                os.write(master, b"\x03") if stop == "ctrl-c" else proc.send_signal(getattr(signal, stop))
                sent = True
        return proc.wait(timeout=60), out
    finally:
        proc.kill()
        proc.wait()
        os.close(master)


WORKING = [  # (what is made to wait for the stop, the command, the stop line's start)
    ("blockpress.lm:LM.infill", ["infill", "x = <|hole:2|>"], b"interrupted (an infill is printed once"),
    ("blockpress.lm:LM.stream", ["generate", "x", "--no-live"], b"x\r\ninterrupted (0 new tokens committed)"),
    ("blockpress.lm:LM.stream", ["generate", "x", "--json"], b'{"text": "", "prompt": "x"'),
    ("blockpress.lm:LM.generate_ar", ["generate", "x", "--ar"], b"interrupted (--ar prints its text"),
    ("blockpress.tasks.sudoku_model:solve", ["sudoku", "." + "34678912672195348198342567859761423426853791713924856961537284287419635345286179"], b"interrupted (0 of 1 puzzles"),
    ("blockpress.bench:run_bench", ["bench", "--preset", "tiny"], b"bench: interrupted after 0 rows"),
]
LOADING = ("blockpress.cli.common:load_model", ["generate", "x"], b"blockpress generate: interrupted")  # run_command's own


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("target, args, said", WORKING, ids=[f"{a[0]}:{t.rpartition(':')[2]}" for t, a, _ in WORKING])
def test_a_ctrl_c_on_a_terminal_is_said_off_its_echo(target, args, said):
    """After a Ctrl-C typed on a terminal, infill, sudoku, bench, serve and generate --no-live, --json and --ar
    wrote their stop line (or the text so far) on the line of the terminal's "^C" echo: "^Cinterrupted (an infill
    is printed ...)", "^C{\"text\": ...". Generate's live view and chat began a fresh line. Now each does."""
    model = [] if args[0] in ("bench", "sudoku") else ["--model", MODEL]
    status, out = on_a_terminal([sys.executable, "-c", WAITING, target, *args, *model, "--threads", "1"],
                                b"working\r\n", "ctrl-c")
    assert status == 130, out
    assert out.endswith(b"^C\r\n" + said) or b"^C\r\n" + said in out, out
    assert b"\r\n\r\n" not in out.split(b"^C")[-1], out  # and no blank line


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_a_sigterm_on_a_terminal_leaves_no_blank_line():
    """A SIGTERM echoes nothing: the stop line follows the last line as it is (run_command's fallback, while the
    model loaded, gave any terminal a newline first, a blank line)."""
    for target, args, said in (WORKING[0], LOADING):
        status, out = on_a_terminal([sys.executable, "-c", WAITING, target, *args, "--model", MODEL, "--threads", "1"],
                                    b"working\r\n", "SIGTERM")
        assert status == 143, out
        stopped = said.replace(b"interrupted", b"stopped by SIGTERM")
        assert b"working\r\n" + stopped in out or b"working\r\n\r" in out and b"\r" + stopped in out, out
        assert b"\r\n\r\n" not in out, out


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_serve_stopped_by_ctrl_c_on_a_terminal_says_so_off_its_echo():
    """serve's "blockpress: stopping; ..." went on the "^C" line, and its last line, "blockpress serve:
    interrupted", came after a blank line."""
    status, out = on_a_terminal([sys.executable, "-m", "blockpress.cli", "serve", "--model", MODEL, "--port", "0",
                                 "--threads", "1"], b"blockpress serving", "ctrl-c")
    assert status == 130, out
    tail = out.split(b"^C")[-1]
    assert tail.startswith(b"\r\nblockpress: stopping; requests in flight get up to 30 s"), out
    # (uvicorn's INFO lines of its shutdown between them, at the default --log-level info)
    assert b"(signal again to stop now)\r\n" in tail and tail.endswith(b"\r\nblockpress serve: interrupted\r\n"), out
    assert b"\r\n\r\n" not in tail, out  # no blank line


SERVE_STOPPED_MID_ENCODE = """
import atexit, os, signal, sys, threading, time
import httpx
import blockpress.serve as serve
from blockpress.cli import main
serve.Engine.close.__defaults__ = (0.5,)  # (the shutdown's wait for the engine thread, shortened)
encoding = threading.Event()
def encode(batch):  # a long prompt's encode: one call, which no cut reaches until it ends
    encoding.set()
    time.sleep(60)
serve.Batch.advance = encode
port = int(sys.argv[1])
def client():
    for _ in range(600):
        try:
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "random-tiny", "prompt": "x"}, timeout=90)
            return
        except httpx.ConnectError:
            time.sleep(0.1)
threading.Thread(target=client, daemon=True).start()
stop = getattr(signal, sys.argv[2])
if sys.argv[3] == "pid1":  # a container's PID 1 ignores a signal left at its default action: uvicorn's raise of it
    signal.raise_signal = lambda sig: None  # once shut down ends nothing, and run() returns
threading.Thread(target=lambda: encoding.wait(60) and os.kill(os.getpid(), stop), daemon=True).start()
atexit.register(lambda: print("finalising", "with" if serve._LIVE_ENGINES else "without", "a live engine", flush=True))
sys.exit(main(["serve", "--model", "random-tiny", "--port", sys.argv[1], "--threads", "1", "--shutdown-timeout", "0"]))
"""


@pytest.mark.parametrize("stop, pid1, status", [("SIGINT", "", 130), ("SIGTERM", "pid1", 143)])
def test_serve_stopped_while_the_engine_encodes_a_long_prompt_exits_without_finalising_around_it(stop, pid1, status):
    """A Ctrl-C while the engine encoded a long prompt (one call, which the cut reaches only at its end) said
    "interrupted", waited 20 s (the shutdown's join, then the exit hook's), and the interpreter finalised with the
    engine thread inside torch: "terminate called without an active exception", SIGABRT (134). The process now ends
    once the shutdown's wait is over, with the stop's status, without finalising around the engine thread; also
    where uvicorn's raise of a SIGTERM once shut down ends nothing (a container's PID 1: `docker stop` with no
    --init), where serve returned 0 and finalised around it (review)."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", SERVE_STOPPED_MID_ENCODE, str(port), stop, pid1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr[-2000:])
    if not pid1:
        assert done.stderr.endswith("blockpress serve: interrupted\n"), done.stderr[-2000:]
    assert "finalising" not in done.stdout, done.stdout


def test_infill_stopped_by_sigterm_says_so():
    r = run_signalled("blockpress.lm:LM.infill", 1, "SIGTERM", "infill", "x = <|hole:2|>", "--model", MODEL,
                      "--json", "--threads", "1")
    assert r.returncode == 143, r.stderr
    assert json.loads(r.stdout)["interrupted"] is True
    assert "stopped by SIGTERM (an infill is printed once every hole is filled)" in r.stderr


def test_the_stop_signal_handlers_are_put_back_after_a_command():
    """main() may run in a process that goes on (a test, a notebook): SIGTERM's and SIGHUP's handlers are its own
    again afterwards, and a SIGHUP that nohup ignored stays ignored while the command runs."""
    import signal

    from blockpress.stopping import stop_signals_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with stop_signals_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    if hasattr(signal, "SIGHUP"):
        old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            with stop_signals_interrupt():
                assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        finally:
            signal.signal(signal.SIGHUP, old)


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGHUP"), reason="no SIGHUP")
def test_a_training_runs_stop_handlers_leave_an_ignored_signal_ignored():
    """`nohup blockpress train` stopped at its next step when the terminal closed: the run's handler took the SIGHUP
    that nohup had the process ignore (generate's and serve's left it ignored)."""
    import signal

    from blockpress.train import _StopOnInterrupt

    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        stop = _StopOnInterrupt()
        try:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop._handle
        finally:
            stop.restore()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_closed_stdin_and_stderr_read_as_dev_null(tmp_path):
    """A descriptor the shell closed (`<&-`, `2>&-`) is None to Python: a closed stdin ended `infill -` and chat in
    AttributeError tracebacks, and print(file=None) writes to stdout, so a closed stderr's stats line went into
    generate --input's JSON lines."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f():"}\n')
    base = [sys.executable, "-m", "blockpress"]
    r = subprocess.run([*base, "infill", "-"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: os.close(0))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "template: empty text" in r.stderr, r.stderr
    r = subprocess.run([*base, "generate", "--input", str(tmp_path / "p.jsonl"), "--max-new-tokens", "4", "--threads",
                        "1"], capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.close(2))
    assert r.returncode == 0
    assert [json.loads(line)["prompt"] for line in r.stdout.splitlines()] == ["def f():"], r.stdout


@pytest.mark.parametrize("as_json", [False, True])
def test_sudoku_ctrl_c_says_it_was_interrupted(monkeypatch, capsys, as_json):
    """A Ctrl-C during sudoku exited 130 with nothing said, where generate, infill and bench say they were cut short
    (on a terminal the shell's prompt then followed "^C" on its line)."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("blockpress.tasks.sudoku_model.solve", interrupted)
    assert main(["sudoku", "." * 80 + "1", "--threads", "1", *(["--json"] if as_json else [])]) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines()[-1] == "interrupted (0 of 1 puzzles solved, printed above)"


def test_bench_out_on_a_full_disk_keeps_the_rows_and_names_the_file(tmp_path, monkeypatch, capsys):
    """--out on a disk that filled during the run (measured on an 8 KiB tmpfs: the second row's write) stopped bench
    with "error: [Errno 28] No space left on device", naming no file, left the half-written .b.json.partial beside
    it, and printed none of the rows measured. Now the rows go to stdout (marked partial), the half-written file is
    removed, and the error names --out."""
    import errno

    writes = []
    original = Path.write_text

    def disk_fills(self, text, *a, **kw):
        writes.append(self.name)
        if len(writes) == 2:  # the second row's: part of it written, then the disk is full
            original(self, text[: len(text) // 2], *a, **kw)
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, text, *a, **kw)

    monkeypatch.setattr(Path, "write_text", disk_fills)
    out = tmp_path / "b.json"
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "2", "4", "--new-tokens", "8", "--steps", "1",
                 "--repeats", "1", "--no-reference", "--threads", "1", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["partial"] is True and [r["batch"] for r in data["rows"]] == [1, 2]
    assert captured.err.strip().splitlines()[-1] == (f"blockpress bench: error: --out {out}: cannot write it (No space "
                                                     "left on device)")
    # (not "and in b.json": it holds the first row alone)
    assert 'bench: stopped by an error after 2 rows (their JSON on stdout, marked "partial")' in captured.err
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # the first row's, whole; no .b.json.partial
    assert [r["batch"] for r in json.loads(out.read_text())["rows"]] == [1]


def test_bench_out_is_staged_under_a_name_of_its_own(tmp_path, monkeypatch, capsys):
    """--out was staged as .b.json.partial, one name for every run: two runs with one --out wrote, moved and
    removed each other's file. Each write names it by its process and a token; what runs that are gone left is
    removed, a running one's kept."""
    import blockpress.bench

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
    running = f".b.json.{os.getppid()}-0123abcd.partial"
    for name in (running, f".b.json.{gone}-0123abcd.partial", ".b.json.partial"):
        (tmp_path / name).write_text("{")
    staged = []
    original = Path.write_text

    def noted(self, text, *a, **kw):
        staged.append(self.name)
        return original(self, text, *a, **kw)

    def measured(settings, on_row):  # (the measuring itself is not what is tested: seconds on a loaded machine)
        on_row({"rows": [{"batch": 1}]})
        return {"rows": [{"batch": 1}, {"batch": 2}]}

    monkeypatch.setattr(Path, "write_text", noted)
    monkeypatch.setattr(blockpress.bench, "run_bench", measured)
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "2", "--out", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    assert len(staged) == 2 and all(re.fullmatch(rf"\.b\.json\.{os.getpid()}-[0-9a-f]{{8}}\.partial", name)
                                    for name in staged)
    assert sorted(p.name for p in tmp_path.iterdir()) == [running, "b.json"]
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == [{"batch": 1}, {"batch": 2}]


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_bench_refuses_an_unwritable_out_folder_before_measuring(tmp_path, monkeypatch, capsys, flag):
    """An --out in a folder that cannot be written (a read-only disk, measured on a read-only tmpfs; another user's
    folder) was found by the first write, after the first row had been measured: 20 s at --preset tiny, minutes at
    larger ones, the run then lost. It is refused before anything is built, as a missing folder is."""
    import os

    import blockpress.bench as bench

    readonly = tmp_path.resolve()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == readonly and mode & os.W_OK
                        else real_access(p, mode, **kw))
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: pytest.fail("measured before refusing the flag"))
    name = "b.json" if flag == "--out" else "b.png"
    assert main(["bench", "--preset", "tiny", flag, str(tmp_path / name)]) == 2
    assert capsys.readouterr().err.strip() == (f"blockpress bench: error: {flag}: cannot write into the folder "
                                               f"{str(tmp_path)!r} (read-only, or not yours)")


def test_bench_out_gets_the_whole_run_when_stdouts_reader_has_gone(tmp_path):
    """`blockpress bench --out b.json | true`: the print of the result met the broken pipe (status 141, as it should)
    before --out was written whole, so b.json kept the last row's copy, marked "partial": true, though every row was
    measured."""
    out = tmp_path / "b.json"
    proc = subprocess.Popen([sys.executable, "-m", "blockpress.cli", "bench", "--preset", "tiny", "--batch-sizes", "1",
                             "--new-tokens", "8", "--steps", "1", "--repeats", "1", "--no-reference", "--threads", "1",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdout.close()  # the reader gone before the command writes a byte
    assert proc.wait(timeout=300) == 141
    data = json.loads(out.read_text())
    assert "partial" not in data and [r["batch"] for r in data["rows"]] == [1]


SOLVED = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


def test_sudoku_solves_a_batch_at_a_time_and_a_ctrl_c_keeps_the_answers_printed(monkeypatch, capsys):
    """sudoku decoded every puzzle given in one batch: ~2.2 MB a puzzle (400: 1.2 GB peak), nothing printed until
    the last was solved, and a Ctrl-C exited 130 with nothing on stdout or stderr."""
    from blockpress.tasks import sudoku_model

    real, sizes = sudoku_model.solve, []

    def solve(lm, puzzles, **kwargs):
        sizes.append(len(puzzles))
        if len(sizes) == 3:
            raise KeyboardInterrupt
        return real(lm, puzzles, **kwargs)

    monkeypatch.setattr(sudoku_model, "solve", solve)
    puzzles = [SOLVED[:k] + "." + SOLVED[k + 1:] for k in range(5)]  # one empty cell each: a step or two
    assert main(["sudoku", *puzzles, "--batch-size", "2", "--json", "--threads", "1"]) == 130
    out, err = capsys.readouterr()
    assert sizes == [2, 2, 1]
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["puzzle"] for r in rows] == [p.replace(".", "0") for p in puzzles[:4]]  # the two batches solved
    assert all(r["valid"] and r["solution"] == SOLVED for r in rows)
    assert err.strip().splitlines()[-1] == "interrupted (4 of 5 puzzles solved, printed above)"


def test_sudoku_shows_a_bar_on_a_terminal_while_its_answers_go_to_a_file(monkeypatch, capsys):
    """`sudoku --json --file big.csv > out.jsonl` solved for minutes without a sign on the terminal. A bar of the
    puzzles solved is drawn on stderr when it is a terminal (a pty here) and stdout is not; on a pipe, or with one
    batch, nothing; stdout holds the answers alone."""
    import fcntl
    import io
    import pty
    import struct
    import termios

    from blockpress.tasks import sudoku_model

    def solve(lm, puzzles, **kwargs):
        return [sudoku_model.ModelSolution(puzzle=p, solution=SOLVED, valid=True, steps=1, errors=[])
                for p in puzzles]

    monkeypatch.setattr(sudoku_model, "solve", solve)
    main_fd, terminal_fd = pty.openpty()
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # (a new pty has 0 columns)
    terminal = open(terminal_fd, "w", buffering=1, closefd=True)
    try:
        for stream, count, drawn in ((terminal, 5, True), (terminal, 2, False), (io.StringIO(), 5, False)):
            monkeypatch.setattr(sys, "stderr", stream)
            assert main(["sudoku", *[SOLVED[:80] + "."] * count, "--json", "--batch-size", "2", "--threads", "1"]) == 0
            assert [json.loads(line)["solution"] for line in capsys.readouterr().out.splitlines()] == [SOLVED] * count
            stream.flush()
            shown = read_terminal(main_fd, 2 if drawn else 0.2)
            if stream is terminal:
                assert ("sudoku: " in shown and "/5 [" in shown and "puzzle/s" in shown) == drawn, shown
            else:
                assert "\r" not in stream.getvalue()
    finally:
        terminal.close()
        os.close(main_fd)


def test_sudoku_batches_are_bounded_by_default_and_the_flag_is_checked(monkeypatch, capsys):
    from blockpress.tasks import sudoku_model

    sizes = []

    def solve(lm, puzzles, **kwargs):
        sizes.append(len(puzzles))
        return [sudoku_model.ModelSolution(puzzle=p, solution=SOLVED, valid=True, steps=1, errors=[])
                for p in puzzles]

    monkeypatch.setattr(sudoku_model, "solve", solve)
    assert main(["sudoku", *[SOLVED[:80] + "."] * 70, "--json", "--threads", "1"]) == 0
    assert sizes == [32, 32, 6] and len(capsys.readouterr().out.splitlines()) == 70
    assert main(["sudoku", SOLVED[:80] + ".", "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "blockpress sudoku: error: --batch-size: expected a positive integer, got 0"


@pytest.mark.parametrize("json_flag", [True, False])
def test_generate_ar_ctrl_c_says_it_was_interrupted(monkeypatch, capsys, json_flag):
    """`generate --ar` cut by a Ctrl-C exited 130 with nothing on stdout or stderr, --json too: a script reading the
    object got none (the diffusion path prints the text so far and "interrupted": true)."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(blockpress.LM, "generate_ar", interrupted)
    flags = ["--json"] if json_flag else []
    assert main(["generate", "def f(", "--ar", "--model", "random-tiny", "--seed", "3", *flags]) == 130
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == "interrupted (--ar prints its text once it is done)"
    if json_flag:
        assert json.loads(out) == {"text": None, "prompt": "def f(", "seed": 3, "interrupted": True}
    else:
        assert out == ""


def test_serve_refuses_the_meta_device_as_the_other_commands_do(monkeypatch, capsys):
    """`serve --device meta` listened, /health said ok, and every request got a 400 naming `device`, a client error
    for the server's own setting (generate, infill, chat, sudoku and bench refuse it, exit 2)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    served = []
    server = lambda config: types.SimpleNamespace(run=lambda sockets: served.append(config))  # noqa: E731
    monkeypatch.setattr("blockpress.cli.serve._server_class", lambda: server)
    assert main(["serve", "--model", "random-tiny", "--device", "meta", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("blockpress serve: error: --device: this model is on the meta device")
    assert served == []


@pytest.mark.parametrize("command, loader", [(["generate", "def f():"], "blockpress.cli.common.load_model"),
                                             (["info"], "blockpress.checkpoint.plan_model"),
                                             (["infill", "a <|hole|> b"], "blockpress.cli.common.load_model")])
def test_a_ctrl_c_while_the_model_loads_says_so(monkeypatch, capsys, command, loader):
    """A Ctrl-C (or SIGTERM) before a command's own handling, while its model loaded, exited 130 without a word."""
    import signal

    from blockpress.stopping import Stopped

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, interrupted)
    assert main([*command, "--model", MODEL]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"blockpress {command[0]}: interrupted"

    def terminated(*args, **kwargs):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(loader, terminated)
    assert main([*command, "--model", MODEL]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"blockpress {command[0]}: stopped by SIGTERM"


def test_the_readme_says_which_seed_greedy_json_gives(capsys):
    """The README said generate's and infill's --json give a fresh seed each run without --seed (chat's each turn, and
    seed=None a fresh one per row): blockpress-code decodes greedily by default and gave "seed": 0 every run, as
    --help says (greedy decoding draws nothing). The README now says so where it promises a fresh one."""
    readme = documentation()
    for promise in ("a fresh one each run without\n`--seed`", "fresh each turn without `--seed`",
                    "seed=None draws a fresh seed per row"):
        at = readme.index(promise) + len(promise)
        assert "0 where" in readme[at:at + 40], f"the README promises {promise!r} without greedy's 0"
    seeds = set()
    for _ in range(2):
        assert main(["generate", "def f(x):", "--model", "blockpress-code", "--max-new-tokens", "4", "--json"]) == 0
        seeds.add(json.loads(capsys.readouterr().out)["seed"])
    assert seeds == {0}
    lm = blockpress.load("blockpress-code")
    assert lm.generate(["a", "b"], max_new_tokens=4).extra["seeds"] == [0, 0]


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("argv", [["generate", "x"], ["infill", "x <|hole|>"], ["chat"], ["serve"], ["info"],
                                  ["sudoku", "0" * 81], ["train", "--data", "d.jsonl", "--out", "o"]])
def test_the_device_defaults_to_a_cuda_gpu_where_torch_sees_one(monkeypatch, argv, cuda):
    """--device defaulted to cpu: on a GPU machine `blockpress generate --model google/diffusiongemma-26B-A4B-it`
    loaded 50 GB into host memory and decoded on the CPU, unless told. The default is now auto, named before the
    command runs: cuda where torch sees a GPU, else cpu; bench still runs where it is told (cpu by default)."""
    import torch

    from blockpress.checkpoint import resolve_device
    from blockpress.cli import build_parser, run_command

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = build_parser().parse_args(argv)
    seen = []
    args.func = lambda a: seen.append(a.device) or 0
    assert run_command(args) == 0 and seen == ["cuda" if cuda else "cpu"]
    assert resolve_device("auto") == resolve_device(" Auto ") == torch.device("cuda" if cuda else "cpu")
    assert build_parser().parse_args(["bench"]).device == "cpu"
    assert "auto, a CUDA GPU where torch sees one, else the CPU" in " ".join(
        subcommands()[argv[0]].format_help().replace(" (a CUDA", ", a CUDA").split())


SPIN_PROBE = """
import os, sys
seen = []
sys.addaudithook(lambda event, args: event == "import" and args[0] == "torch" and not seen
                 and seen.append(os.environ.get("GOMP_SPINCOUNT")))
from blockpress.cli import main
code = main(["info", "--model", "random-tiny", "--device", "meta", "--json"])
print("SEEN", seen)
sys.exit(code)
"""


@pytest.mark.parametrize("own", [None, "123"])
def test_commands_give_torch_a_short_openmp_spin_unless_the_user_set_one(own, monkeypatch):
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: the CLI must set it before a command imports torch,
    and must leave a value the user set."""
    from blockpress.cli import OPENMP_SPINS

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if own is not None:
        env["GOMP_SPINCOUNT"] = own
    done = subprocess.run([sys.executable, "-c", SPIN_PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = own if own is not None else str(OPENMP_SPINS)
    assert f"SEEN [{expected!r}]" in done.stdout


def gemma4_chat(tmp_path, monkeypatch, replies, methods=("chat_ids", "chat_stream")):
    """A tiny model whose tokenizer has Gemma 4's markers as special tokens and no response template (as a real
    Gemma 4 checkpoint), with test_tokenizer's Gemma-4-style chat template, saved to `tmp_path`; each chat turn
    writes the next of `replies` (forced by a logits processor, a canvas a step: --steps 1), then <eos>. Returns
    the conversations each turn was prompted with (ids) and the model's tokenizer."""
    import torch
    from test_response import gemma4_tokenizer
    from test_tokenizer import GEMMA4_STYLE_TEMPLATE

    import blockpress.lm

    tok = gemma4_tokenizer()
    tok.chat_template = GEMMA4_STYLE_TEMPLATE
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), tokenizer=tok)
    lm.save(tmp_path)
    canvas, prompts, left = lm.config.canvas_length, [], list(replies)

    def forcing(target):
        canvases = iter(range(0, 10**6, canvas))

        def force(logits, rows):  # one step a canvas: its positions get the target's tokens, then <eos>
            start = next(canvases)
            want = [target[i] if i < len(target) else tok.eos_id for i in range(start, start + logits.shape[1])]
            forced = torch.full_like(logits, float("-inf"))
            forced[:, torch.arange(len(want)), torch.tensor(want)] = 0.0
            return forced
        return force

    for name in methods:  # ("stream": generate's)
        original = getattr(blockpress.lm.LM, name)

        def turn(self, ids, *a, original=original, **kw):
            prompts.append(list(ids))
            return original(self, ids, *a, **{**kw, "logits_processor": forcing(tok.encode(left.pop(0)) + [tok.eos_id])})
        monkeypatch.setattr(blockpress.lm.LM, name, turn)
    return prompts, tok


def test_chat_keeps_a_gemma4_thought_apart_from_the_answer(tmp_path, monkeypatch, capsys):
    """With Gemma 4's tokenizer a reply's thought channel, its markers left out of the text, read "thought\\nLet me
    think.Hello there.": shown so, and kept so in the conversation, where the chat template's strip_thinking could
    no longer drop it from the later prompts. The reply is read with the built-in Gemma 4 template now: --json's
    text is the answer, `reasoning` the thought; the conversation goes on with the answer and the thought as
    reasoning_content, which the template renders as the model's own reply with its thought channel; the cache is
    reused up to the first difference, as before."""
    replies = ["<|channel>thought\nLet me think.<channel|>Hello there.", "<|channel>thought\n<channel|>Fine."]
    prompts, tok = gemma4_chat(tmp_path, monkeypatch, replies)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nand again\n"))
    assert main(["chat", "--model", str(tmp_path), "--json", "--steps", "1", "--max-new-tokens", "60",
                 "--threads", "1"]) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(t["text"], t.get("reasoning")) for t in turns] == [("Hello there.", "Let me think."), ("Fine.", None)]
    as_written = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": replies[0]},
                  {"role": "user", "content": "and again"}]
    assert prompts[1] == tok.apply_chat_template(as_written, tokenize=True)  # the thought cut, as the model wrote it
    assert "think" not in tok.decode(prompts[1])
    written = prompts[0] + tok.encode(replies[0])  # what the cache held: only the rest was encoded
    shared = next(i for i, (a, b) in enumerate(zip(written, prompts[1])) if a != b)
    assert turns[1]["cached_tokens"] == shared == len(prompts[0])


def test_chat_on_a_terminal_shows_a_gemma4_thought_dimmed_above_the_answer(tmp_path, monkeypatch, capsys):
    """On a terminal the thought is shown dimmed as it is written, the answer on a line of its own under it (it
    was "thought\\nLet me think.Hello there."); piped, stdout holds the answer alone."""
    reply = "<|channel>thought\nLet me think.<channel|>Hello there."
    gemma4_chat(tmp_path, monkeypatch, [reply, reply, reply])
    screen = TerminalIO()
    monkeypatch.setattr(sys, "stdin", TerminalIO("hi\n"))
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    flags = ["chat", "--model", str(tmp_path), "--steps", "1", "--max-new-tokens", "60", "--threads", "1"]
    assert main(flags) == 0
    shown = screen.getvalue()
    assert "".join(re.findall("\x1b\\[2m(.*?)\x1b\\[0m", shown, re.DOTALL)) == "Let me think."  # all of it dim
    assert re.sub(r"\x1b\[[0-9;]*m", "", shown) == "you> model> Let me think.\nHello there.\nyou> "
    # TERM=dumb (Emacs' shell) prints escapes as text: the thought was dimmed there too
    monkeypatch.setenv("TERM", "dumb")
    screen = TerminalIO()
    monkeypatch.setattr(sys, "stdin", TerminalIO("hi\n"))
    monkeypatch.setattr(sys, "stdout", screen)
    assert main(flags) == 0
    assert screen.getvalue() == "you> model> Let me think.\nHello there.\nyou> "
    monkeypatch.setenv("TERM", "xterm-256color")
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    monkeypatch.setattr(sys, "stdout", piped)
    assert main(flags) == 0
    assert piped.getvalue() == "Hello there.\n"


CHAT_REPLIES = {  # Gemma 4 replies that each read differently
    "plain": "Hello there, how are you today?",
    "thought then text": "<|channel>thought\nLet me think.<channel|>Hello there, how are you?",
    "thought then call": '<|channel>thought\nLet me think.<channel|>Checking.<|tool_call>call:weather{city:<|"|>Oslo<|"|>}'
                         '<tool_call|>',
    "leading whitespace": "  Hello there, how are you today?",
}


@pytest.mark.parametrize("name", list(CHAT_REPLIES))
def test_chat_shows_and_keeps_the_answer_the_server_gives(name, tmp_path, monkeypatch):
    """`chat` read a reply as the server did before it read its thought-then-call and leading-whitespace replies
    anew: a thought then a call showed the thought and "Checking." live, then kept the whole text, the thought glued
    to it ("thought\\nLet me think.Checking.call:weather..."), and a reply opening with whitespace showed nothing
    until its end. What it shows (the thought dimmed, the answer under it) and keeps in the conversation is now the
    message the server answers the same reply with, unstreamed, to a request without tools (Reply.tool_message), and
    the answer's start is on screen before the reply is done."""
    pytest.importorskip("fastapi")
    import blockpress.lm
    from blockpress.generate import Done
    from blockpress.response import (
        PartialReader,
        compile_template,
        gemma4_response_template,
        parse_response,
        regions_only,
    )
    from blockpress.serve import JobDone, Reply

    reply = CHAT_REPLIES[name]
    prompts, tok = gemma4_chat(tmp_path, monkeypatch, [reply, "Fine."])
    screen = TerminalIO()
    live = []  # the screen when the reply was done, before its rest was printed
    stream = blockpress.lm.LM.chat_stream

    def spy(self, *a, **kw):
        for event in stream(self, *a, **kw):
            if isinstance(event, Done):
                live.append(screen.getvalue())
            yield event
    monkeypatch.setattr(blockpress.lm.LM, "chat_stream", spy)
    monkeypatch.setattr(sys, "stdin", TerminalIO("hi\nand again\n"))
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert main(["chat", "--model", str(tmp_path), "--steps", "1", "--max-new-tokens", "96", "--threads", "1"]) == 0
    # the server's unstreamed answer to the same prompt and reply, read as serve reads a request without tools
    template, prefix = compile_template(gemma4_response_template()), tok.decode(prompts[0], skip_special_tokens=False)
    text = tok.decode(tok.encode(reply))
    served = Reply([], "chat", "m", 1, parse=lambda raw: parse_response(template, raw, prefix, keep_empty=True),
                   read_partial=lambda: PartialReader(template, prefix), calls_wanted=False,
                   plain=lambda raw: tok.decode(tok.encode(raw)),
                   read_regions=lambda: PartialReader(regions_only(template), prefix))
    called = served.tool_message(JobDone(text, len(tok.encode(reply)) + 1, 1, "stop", 0, reply))
    message = called["message"] if called is not None else {"role": "assistant", "content": text}
    thought = message.get("reasoning_content")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", screen.getvalue())
    assert shown.startswith("you> model> " + (f"{thought}\n" if thought else "") + message["content"] + "\nyou> ")
    assert "".join(re.findall("\x1b\\[2m(.*?)\x1b\\[0m", screen.getvalue(), re.DOTALL)) == (thought or "")
    kept = [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "and again"}]
    assert prompts[1] == tok.apply_chat_template(kept, tokenize=True)  # the conversation goes on with it
    before_done = re.sub(r"\x1b\[[0-9;]*m", "", live[0])
    assert shown.startswith(before_done)
    # more than the thought was on screen before the reply's end
    assert len(before_done) > len("you> model> " + (f"{thought}\n" if thought else "")), before_done


def test_generate_chat_gives_a_gemma4_thought_apart_from_the_answer(tmp_path, monkeypatch, capsys):
    """generate --chat with a Gemma 4 template's thinking on (--chat-template-kwargs) printed the reply with its
    thought channel's markers left out, "thought\\nLet me think.Hello there.", as chat did before it read replies
    with the response template: now the answer alone (--json: text, and the thought as reasoning), as chat gives it."""
    reply = "<|channel>thought\nLet me think.<channel|>Hello there."
    plain = "No thought."
    prompts, tok = gemma4_chat(tmp_path, monkeypatch, [reply, reply, plain], methods=("stream",))
    flags = ["generate", "--model", str(tmp_path), "--chat", "hi", "--chat-template-kwargs", '{"enable_thinking": true}',
             "--steps", "1", "--max-new-tokens", "60", "--threads", "1", "--no-live"]
    assert main([*flags, "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["text"], said["reasoning"]) == ("Hello there.", "Let me think.")
    json_help = next(a.help for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions
                     if "--json" in a.option_strings)
    assert [key for key in said if not re.search(rf"\b{key}\b", json_help)] == []  # (reasoning was left out)
    assert "<|think|>" in tok.decode(prompts[0], skip_special_tokens=False)  # the kwargs reached the template
    assert main(flags) == 0
    assert capsys.readouterr().out == "Hello there.\n"
    assert main([*flags, "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["text"] == plain and "reasoning" not in said
    import torch

    from blockpress.generate import GenerationOutput

    def ar_output(self, ids, **kw):  # --ar decodes with generate_ar: its output, the reply's tokens
        new = tok.encode(reply) + [tok.eos_id]
        return GenerationOutput(
            sequences=torch.tensor([ids + new]), prompt_length=len(ids), texts=[tok.decode(new)],
            tokens_per_forward=torch.ones(1), forward_passes=torch.tensor([len(new)]),
            num_new_tokens=torch.tensor([len(new)]), steps_per_canvas=torch.ones(1, 1, dtype=torch.long),
            extra={"seeds": [0]})
    monkeypatch.setattr(blockpress.lm.LM, "generate_ar", ar_output)
    at = flags.index("--steps")
    assert main([*flags[:at], *flags[at + 2:], "--ar", "--json"]) == 0  # (--ar takes no --steps)
    said = json.loads(capsys.readouterr().out)
    assert (said["text"], said["reasoning"]) == ("Hello there.", "Let me think.")


def test_chat_template_kwargs_reach_the_template_of_chat_and_generate_chat(tmp_path, monkeypatch, capsys):
    """A template's own variables ({"enable_thinking": true} for Gemma 4's) could not be set from the command line:
    chat, generate --chat and serve (whose requests send them as vLLM's chat_template_kwargs) take them as JSON."""
    from blockpress.tokenizer import train_bpe_tokenizer

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=300, canvas_length=8),
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    lm.tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                                  "{% if enable_thinking %}THINKING{% endif %}")
    lm.save(tmp_path / "m")
    marker = len(lm.tokenizer.encode("THINKING"))

    def chat_prompt_tokens(*extra):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
        assert main(["chat", "--model", str(tmp_path / "m"), "--max-new-tokens", "2", "--steps", "1", "--json",
                     "--threads", "1", *extra]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[0])["prompt_tokens"]

    plain = chat_prompt_tokens()
    assert chat_prompt_tokens("--chat-template-kwargs", '{"enable_thinking": true}') == plain + marker
    assert chat_prompt_tokens("--chat-template-kwargs", '{"never_read": 1}') == plain

    from blockpress.lm import LM

    rendered, original = [], LM.chat_prompt
    monkeypatch.setattr(LM, "chat_prompt",
                        lambda self, *a, **k: rendered.append(original(self, *a, **k)) or rendered[-1])

    def generated(*extra):  # (generate's --json has no prompt_tokens: the prompt it rendered last)
        assert main(["generate", "hi", "--model", str(tmp_path / "m"), "--chat", "--max-new-tokens", "2", "--steps",
                     "1", "--json", "--threads", "1", *extra]) == 0
        assert json.loads(capsys.readouterr().out)["text"] is not None
        return len(rendered[-1])

    assert generated("--chat-template-kwargs", '{"enable_thinking": true}') == generated() + marker
    for flags, words in ((['{"messages": 1}'], "'messages' is set by the chat rendering itself"),
                         (["[1]"], "expected an object of template variables"),
                         (["{nope"], "expected a JSON object such as"),
                         # nested past the recursion limit: a RecursionError's traceback
                         (["[" * 5000 + "]" * 5000], "expected a JSON object such as")):
        with pytest.raises(SystemExit) as exit_:
            main(["chat", "--model", str(tmp_path / "m"), "--chat-template-kwargs", *flags])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--chat-template-kwargs" in err and words in err, err
    assert main(["generate", "hi", "--model", str(tmp_path / "m"), "--chat-template-kwargs",
                 '{"enable_thinking": true}', "--no-live"]) == 2
    assert "--chat-template-kwargs: the chat template's variables go with --chat" in capsys.readouterr().err


# -- quantize: a quantized folder written from the command line -----------------------------------------------------


def same_buffers(a, b):
    """The two models hold the same tensors: names, dtypes and values (the codes and scales included)."""
    left, right = a.model.state_dict(), b.model.state_dict()
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype and torch.equal(left[name], right[name]), name


def test_quantize_writes_the_folder_a_quantized_load_saves(tmp_path, capsys):
    """`blockpress quantize --model M --quantize int4 OUT` writes what blockpress.load(M, quantize="int4").save(OUT)
    writes: OUT loads as int4 with the same codes, scales and other tensors, and generate runs it with no --quantize
    to the tokens --quantize int4 over M writes. --json reports the folder, the scheme and both folders' bytes."""
    from blockpress.checkpoint import checkpoint_files

    out = tmp_path / "q"
    assert main(["quantize", "--model", MODEL, "--quantize", "int4", "--device", "cpu", "--json", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    from blockpress.lm import resolve_path

    source = resolve_path(MODEL) if not MODEL.startswith("random-") else None
    on_disk = lambda folder: sum(f.stat().st_size for f in checkpoint_files(folder))  # noqa: E731
    assert data["out"] == str(out) and data["model"] == MODEL and data["quantization"] == "int4"
    assert data["bytes"] == on_disk(out) and data["seconds"] > 0
    if source is not None:
        assert data["source"] == str(source) and data["source_bytes"] == on_disk(source) > data["bytes"]
    loaded = blockpress.load(out)
    assert loaded.quantization == "int4"
    same_buffers(loaded, blockpress.load(MODEL, quantize="int4"))
    common = ["--max-new-tokens", "8", "--device", "cpu", "--no-live", "def area(r):"]
    assert main(["generate", "--model", str(out), *common]) == 0
    written = capsys.readouterr().out
    assert main(["generate", "--model", MODEL, "--quantize", "int4", *common]) == 0
    assert written.strip() and written == capsys.readouterr().out


@pytest.mark.parametrize("scheme", ["int8", FP8, "int4"])
def test_quantize_random_weights_and_overwrite(scheme, tmp_path, capsys):
    """random-<preset> quantizes as a load of it does, and prints one line naming the folder and scheme; a folder
    holding a checkpoint is written over only with --overwrite (its files replaced, another file left)."""
    from blockpress.cli.common import load_model

    out = tmp_path / "q"
    out.mkdir()
    (out / ".model.safetensors.tmp").write_bytes(b"x")  # a killed save's leftover: the folder counts as empty
    assert main(["quantize", "--model", "random-tiny", "--quantize", scheme, "--device", "cpu", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: {scheme}, ") and "MB" in line and line.count("\n") == 0
    assert not (out / ".model.safetensors.tmp").exists()
    same_buffers(blockpress.load(out), load_model("random-tiny", None, "cpu", scheme))
    (out / "notes.txt").write_text("mine")
    other = "int4" if scheme != "int4" else "int8"
    assert main(["quantize", "--model", "random-small", "--quantize", other, str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["quantize", "--model", "random-tiny", "--quantize", other, "--overwrite", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["source_bytes"] is None
    assert blockpress.load(out).quantization == other and (out / "notes.txt").read_text() == "mine"


def test_quantize_onto_a_full_disk_says_so_and_leaves_the_folder_as_it_was(tmp_path, monkeypatch, capsys):
    """A disk that filled while the safetensors were written ended quantize (and any save) in a traceback:
    safetensors' SafetensorError ('I/O error: No space left on device') is not an OSError. Now it is one, naming the
    file, said in one line; the checkpoint written over is left whole."""
    from safetensors import SafetensorError

    from blockpress import checkpoint

    out = tmp_path / "q"
    assert main(["quantize", "--model", "random-tiny", "--quantize", "int8", "--device", "cpu", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:  # part of it written, as a disk that fills does
            f.write(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(checkpoint, "save_file", full)
    assert main(["quantize", "--model", "random-tiny", "--quantize", "int4", "--overwrite", "--device", "cpu",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"blockpress quantize: error: OUT {out}: cannot write it ({out / 'model.safetensors'}: I/O error: "
                   "No space left on device (os error 28))\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # a new OUT (its parent too) is not left behind, empty
    fresh = tmp_path / "new" / "q"
    assert main(["quantize", "--model", "random-tiny", "--quantize", "int4", "--device", "cpu", str(fresh)]) == 2
    assert capsys.readouterr().err == (f"blockpress quantize: error: OUT {fresh}: cannot write it ({fresh / 'model.safetensors'}: "
                                       "I/O error: No space left on device (os error 28))\n")
    assert not (tmp_path / "new").exists()


def test_quantize_in_bfloat16_has_no_note_of_slow_matmuls(tmp_path, monkeypatch, capsys):
    """The note that a CPU without native bf16 runs bf16 matmuls emulated is for the commands that run the model:
    quantize runs none, and said it on every --dtype bfloat16 there (the CPU is stood in for)."""
    from blockpress import checkpoint

    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: False)
    argv = ["--model", "random-tiny", "--quantize", "int8", "--dtype", "bfloat16", "--device", "cpu"]
    assert main(["quantize", *argv, "--json", str(tmp_path / "q")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["dtype"] == "bfloat16" and "native" not in err
    assert blockpress.load(tmp_path / "q", dtype="bfloat16").quantization == "int8"


def quantize_refusals(tmp_path):
    """(arguments, what the one line says) for each refusal, with the folders they need made in `tmp_path`."""
    plain, stored, adapter = tmp_path / "plain", tmp_path / "int8", tmp_path / "adapter"
    blockpress.random_model(blockpress.ModelConfig.tiny()).save(plain)
    blockpress.random_model(blockpress.ModelConfig.tiny()).quantize("int8").save(stored)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")  # what marks an adapter folder (no config.json beside it)
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    new = str(tmp_path / "new")
    return [
        (["--model", str(plain), new], "--quantize: required: the scheme to write, int8, fp8 or int4"),
        (["--model", str(stored), "--quantize", "int4", new],
         f"--model {stored}: stored quantized with int8 (its codes, not the unquantized weights), so --quantize int4 "
         "cannot be made from it"),
        (["--model", str(adapter), "--quantize", "int8", new], f"--model {adapter}: a LoRA adapter folder"),
        (["--model", str(plain), "--quantize", "int8", str(plain)],
         f"OUT {plain}: is the folder --model {plain} is read from"),
        (["--model", str(plain), "--quantize", "int8", "--overwrite", str(plain)],
         f"OUT {plain}: is the folder --model {plain} is read from"),
        (["--model", str(plain), "--quantize", "int8", str(stored)],
         f"OUT {stored}: not empty (holds config.json, generation_config.json, model.safetensors); give a new or "
         "empty folder, or --overwrite"),
        (["--model", str(plain), "--quantize", "int8", "--overwrite", str(tmp_path / "other")],
         f"OUT {tmp_path / 'other'}: --overwrite: holds no checkpoint to write over (no config.json, but notes.txt)"),
        (["--model", str(plain), "--quantize", "int8", str(tmp_path / "file")], f"OUT {tmp_path / 'file'}: a file"),
        # "" was the current folder: "not empty (holds ...)", and with --overwrite the checkpoint there written over
        (["--model", str(plain), "--quantize", "int8", "--overwrite", ""],
         "OUT: expected the folder to write the quantized checkpoint to, got ''"),
        (["--model", "random-huge", "--quantize", "int8", new], "--model random-huge: unknown preset 'huge'"),
    ]


def test_a_second_name_for_a_folder_is_the_folder(tmp_path, monkeypatch, capsys):
    """quantize's OUT against --model and bench's --out against --plot compared resolved path strings. On macOS's
    case-insensitive volumes realpath keeps the case it is given (runs/base is runs/Base), and on Linux a bind mount
    gives a folder a second name: `quantize --model runs/Base --quantize int8 runs/base --overwrite` wrote the codes
    over the checkpoint they were made from. Simulated: a link is the second name, and resolve keeps the name it is
    given, as realpath does there."""
    plain = tmp_path / "Base"
    blockpress.random_model(blockpress.ModelConfig.tiny()).save(plain)
    alias = tmp_path / "base"
    alias.symlink_to(plain)
    monkeypatch.setattr(Path, "resolve", lambda self, strict=False: Path(os.path.abspath(self)))
    weights = (plain / "model.safetensors").read_bytes()
    assert main(["quantize", "--model", str(plain), "--quantize", "int8", "--overwrite", str(alias)]) == 2
    assert f"OUT {alias}: is the folder --model {plain} is read from" in capsys.readouterr().err
    assert (plain / "model.safetensors").read_bytes() == weights
    assert main(["bench", "--preset", "tiny", "--out", str(alias / "b.png"), "--plot", str(plain / "b.png")]) == 2
    assert f"--out: '{alias / 'b.png'}' is the --plot file too" in capsys.readouterr().err


def test_quantize_refusals_are_one_line_before_the_load(tmp_path, monkeypatch, capsys):
    """Each refusal is one line under the command's name naming the flag or OUT, exit 2, and comes before the model
    is loaded (a 26B takes minutes); OUT is left unmade."""
    cases = quantize_refusals(tmp_path)

    def no_load(*args, **kwargs):
        raise AssertionError("loaded")

    monkeypatch.setattr("blockpress.cli.common.load_model", no_load)
    for argv, said in cases:
        assert main(["quantize", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"blockpress quantize: error: {said}") and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "new").exists()
    with pytest.raises(SystemExit) as exc:  # an unknown scheme: argparse's own, naming the choices
        main(["quantize", "--quantize", "int3", "o"])
    assert exc.value.code == 2
    assert "argument --quantize: invalid choice: 'int3' (choose from 'int8', 'fp8', 'int4')" in capsys.readouterr().err


def test_info_before_the_shards_are_fetched_gives_the_bytes_their_index_says(tmp_path, capsys):
    """With config.json and the shards' index alone (a download of a repo's JSON files, to look at a model before
    its weights), checkpoint_bytes was None: now the index's total_size, which the folder with its shards agrees
    with; an index without that number still gives None."""
    import shutil

    from blockpress.checkpoint import save_model

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=64, canvas_length=8))
    save_model(lm.model, tmp_path / "full", max_shard_bytes=20_000)
    fetched = tmp_path / "json"
    fetched.mkdir()
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(tmp_path / "full" / name, fetched / name)

    def stored_bytes(folder):
        assert main(["info", "--model", str(folder), "--device", "meta", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["checkpoint_bytes"]

    whole = stored_bytes(tmp_path / "full")
    assert whole == sum(p.stat().st_size for p in (tmp_path / "full").glob("model-*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in (tmp_path / "full").glob("model-*.safetensors"))
    assert stored_bytes(fetched) == whole
    index = json.loads((fetched / "model.safetensors.index.json").read_text())
    del index["metadata"]
    (fetched / "model.safetensors.index.json").write_text(json.dumps(index))
    assert stored_bytes(fetched) is None


# generate --input: a JSONL file of prompts, batched by length and written back in input order
INPUT_LINES = [
    {"prompt": "def add(a, b):", "id": "a"},
    {"prompt": "class Stack:\n    def push(self, x):\n        ", "id": "b", "seed": 7, "max_new_tokens": 5},
    {"prompt": "x", "max_new_tokens": 3},
    {"messages": [{"role": "user", "content": "Write a haiku."}], "id": "d"},
    {"prompt": "import os\nimport sys\n\ndef main(argv):", "seed": 3, "tags": ["long", 1]},
]


def write_input(path: Path, lines=INPUT_LINES) -> Path:
    """The lines as JSONL, a blank line after the first (skipped, but counted in the line numbers)."""
    texts = [json.dumps(x) for x in lines]
    path.write_text("\n".join(texts[:1] + [""] + texts[1:]) + "\n")
    return path


@contextlib.contextmanager
def rows_asked(monkeypatch, method: str):
    """blockpress.LM.<method> (generate, infill) counting the rows of each call: the list of counts, filled as the
    calls come (an --input run's --resume asks only for the rows its output lacks)."""
    calls: list[int] = []
    original = getattr(blockpress.LM, method)
    with monkeypatch.context() as patch:
        patch.setattr(blockpress.LM, method, lambda self, rows, *a, **kw: calls.append(len(rows))
                      or original(self, rows, *a, **kw))
        yield calls


def output_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("flags", [["--steps", "2"], ["--steps", "2", "--temperature", "1.5"], ["--ar"]],
                         ids=["greedy", "sampled", "ar"])
def test_generate_input_rows_are_their_runs_alone_in_input_order(tmp_path, capsys, flags):
    """Rows of mixed lengths (in batches of 2, sorted by length) come back in input order, each with its carried
    keys and line number, and each row's text is what `generate PROMPT --json` gives it alone with its seed and
    budget (a messages line: `generate --chat`'s)."""
    # float32: in bf16 (blockpress-code's dtype on a CPU with native bf16) batch padding moves the logits by ~0.1, and a
    # row drawn at temperature 1.5 with a seed drawn at random then differed from its run alone in about 1 run of 2
    # (docs/cli.md: "up to the rounding that batching can move")
    base = ["--model", MODEL, "--dtype", "float32", "--max-new-tokens", "6", "--threads", "1", *flags]
    src, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert main(["generate", "--input", str(src), "--output", str(out), "--batch-size", "2", *base]) == 0
    got = output_lines(out)
    assert [g["line"] for g in got] == [1, 3, 4, 5, 6]
    assert [g.get("id") for g in got] == ["a", "b", None, "d", None] and got[4]["tags"] == ["long", 1]
    assert "rows" in capsys.readouterr().err  # the stats line
    for line, g in zip(INPUT_LINES, got):
        alone = ["generate", line.get("prompt") or line["messages"][0]["content"], "--json", *base]
        alone += ["--chat"] * ("messages" in line) + ["--seed", str(g["seed"])]
        alone += ["--max-new-tokens", str(line["max_new_tokens"])] if "max_new_tokens" in line else []
        assert main(alone) == 0
        want = json.loads(capsys.readouterr().out)
        assert g["text"] == want["text"] and g["new_tokens"] == want["new_tokens"]
        assert g["forward_passes"] == want["forward_passes"] and g.get("prompt") == line.get("prompt")
        assert g.get("messages") == line.get("messages")  # what --resume checks a messages line by
        if "seed" in line:
            assert g["seed"] == line["seed"]


def test_generate_input_refuses_a_bad_line_by_file_and_line_before_running(tmp_path, capsys, monkeypatch):
    from blockpress.batchfile import read_rows

    cases = [('{"prompt": 3}', "prompt: expected a str"), ('[1]', "expected an object"),
             ('{"text": "x"}', 'one of "prompt"'), ('{"prompt": "a", "messages": []}', "got both"),
             ('{"prompt": "a", "seed": -1}', "seed: expected an integer"),
             ('{"prompt": "a", "max_new_tokens": 1.5}', "max_new_tokens: expected an integer of at least 1"),
             ('{"prompt": "a", "seed": 9223372036854775808}', "seed: expected an integer below 2**63, got 9223"),
             ('{"prompt": "a", "text": "b"}', "text: a key the output line writes"), ('{"prompt": ', "not JSON"),
             # json.loads keeps a key's last value: the first prompt, id or message content was silently lost
             ('{"prompt": "a", "id": 1, "prompt": "b"}', '"prompt" is given twice in one object'),
             ('{"messages": [{"role": "user", "content": "a", "content": "b"}]}', '"content" is given twice'),
             # Python's json reads them and writes them back into the output, which no JSON reader (nor --resume,
             # NaN being unequal to itself) took then
             ('{"prompt": "a", "score": NaN}', "NaN is not JSON"), ('{"prompt": "a", "x": [-Infinity]}', "-Infinity is"),
             # JSON, but past a float: Python reads inf and writes Infinity back
             ('{"prompt": "a", "id": 1e400}', "1e400 is past a float's range (read as inf, it would be written back "
                                              "as Infinity, which is not JSON)"),
             ('{"prompt": "a", "id": -1e999}', "-1e999 is past a float's range")]
    for line, message in cases:
        with pytest.raises(ValueError) as err:
            read_rows("f.jsonl", b'{"prompt": "ok"}\n\n' + line.encode() + b"\n")
        assert str(err.value).startswith("f.jsonl:3: ") and message in str(err.value)
    # a line the model refuses (a message without content; a prompt past the context) is named too, and nothing ran
    calls = []
    monkeypatch.setattr(blockpress.LM, "generate", lambda *a, **kw: calls.append(a))
    out = tmp_path / "out.jsonl"
    for bad, message in [({"messages": [{"role": "user"}]}, "messages[0].content"),
                         ({"prompt": "x " * 5000}, "exceed the model's context"),
                         # past the context times the longest token: refused before it is tokenized
                         ({"prompt": "x" * 10**6}, "1,000,000 characters cannot fit the model's context")]:
        src = tmp_path / "in.jsonl"
        src.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(bad) + "\n")
        assert main(["generate", "--input", str(src), "--output", str(out), "--model", MODEL]) == 2
        err = capsys.readouterr().err
        assert f"{src}:2: " in err and message in err
    assert not calls and not out.exists()
    assert main(["generate", "hi", "--input", str(src)]) == 2 and "not both" in capsys.readouterr().err
    assert main(["generate", "--model", MODEL]) == 2 and "got neither" in capsys.readouterr().err


def test_generate_ar_input_checks_its_flags_and_every_line_before_the_output_is_made(tmp_path, capsys):
    """--ar --input checked only as each batch ran: a line whose own max_new_tokens was below --min-new-tokens was
    refused after the lines before it were written, naming no line ("max_new_tokens[0]"), and a bad --top-p left an
    empty --output that the rerun then had to --overwrite."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "def f():"}) + "\n" + json.dumps({"prompt": "g", "max_new_tokens": 2}) + "\n")
    base = ["generate", "--input", str(src), "--output", str(out), "--model", MODEL, "--ar", "--batch-size", "1",
            "--threads", "1"]
    assert main([*base, "--min-new-tokens", "4", "--max-new-tokens", "6"]) == 2
    assert f"{src}:2: min_new_tokens: expected an integer in [0, max_new_tokens=2], got 4" in capsys.readouterr().err
    assert not out.exists()
    for flags, says in [(["--top-p", "0"], "--top-p: expected a probability"),
                        (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer, got 0"),
                        (["--min-new-tokens", "3", "--max-new-tokens", "2"], "--min-new-tokens: expected an integer")]:
        assert main([*base, *flags]) == 2
        assert says in capsys.readouterr().err and not out.exists(), flags
    assert main([*base, "--max-new-tokens", "3"]) == 0 and len(out.read_text().splitlines()) == 2


def test_a_min_new_tokens_past_the_default_length_raises_it_in_input_rows_and_chat(tmp_path, capsys, monkeypatch):
    """--min-new-tokens past the checkpoint's default length (blockpress-code's 64): generate PROMPT grew the default
    to it, as the library does, but generate --input (--ar too) and chat passed the default on as max_new_tokens
    and were refused with "min_new_tokens: expected an integer in [0, max_new_tokens=64], got 80", naming a count
    never given. Each row now gets what generate PROMPT gives it alone; a line's own max_new_tokens still binds."""
    from blockpress.tokenizer import train_bpe_tokenizer

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=300, canvas_length=8),
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    lm.generation_config = {**lm.generation_config, "max_new_tokens": 4}
    lm.save(tmp_path / "m")
    src, out = write_input(tmp_path / "in.jsonl", [{"prompt": "def f():"}]), tmp_path / "out.jsonl"
    common = ["--model", str(tmp_path / "m"), "--min-new-tokens", "10", "--seed", "2", "--threads", "1"]
    for ar in (["--steps", "1"], ["--ar"]):
        assert main(["generate", "def f():", *common, *ar, "--json"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert main(["generate", "--input", str(src), "--output", str(out), "--overwrite", *common, *ar,
                     "--no-live"]) == 0, capsys.readouterr().err
        row = json.loads(out.read_text())
        assert row["new_tokens"] == alone["new_tokens"] == 10 and row["text"] == alone["text"]
    write_input(src, [{"prompt": "def f():", "max_new_tokens": 6}])
    assert main(["generate", "--input", str(src), "--output", str(out), "--overwrite", *common, "--ar",
                 "--no-live"]) == 2
    assert f"{src}:1: min_new_tokens: expected an integer in [0, max_new_tokens=6], got 10" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert main(["chat", *common, "--steps", "1", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.splitlines()[0])["new_tokens"] == 10


def test_input_whose_lines_end_in_cr_alone_is_said_to():
    """A file saved with classic Mac OS line endings (a CR alone) was one line to the reader, refused as 'not JSON
    (Extra data, column 17)', which said nothing of why: the endings are named, with how to save it; its lines
    saved with LF or CRLF read as the rows they are, and a bad line with no CR in it is refused as before."""
    from blockpress.batchfile import GENERATE, INFILL, read_rows

    for kind, lines in ((GENERATE, [{"prompt": "a"}, {"prompt": "b", "id": 2}, {"messages": [{"role": "user",
                                                                                             "content": "c"}]}]),
                        (INFILL, [{"template": "x = <|hole|>"}, {"template": "<|hole:2|>"}, {"template": "<|hole|>;"}])):
        texts = [json.dumps(x).encode() for x in lines]
        want = read_rows("in.jsonl", b"\n".join(texts) + b"\n", kind)
        assert [r.line for r in want] == list(range(1, len(lines) + 1))
        assert read_rows("in.jsonl", b"\r\n".join(texts) + b"\r\n", kind) == want
        for data in (b"\r".join(texts) + b"\r", b"\r".join(texts), texts[0] + b"\n" + b"\r".join(texts[1:])):
            where = "in.jsonl:1" if data.startswith(b"\r".join(texts[:2])) else "in.jsonl:2"
            with pytest.raises(ValueError) as err:
                read_rows("in.jsonl", data, kind)
            assert str(err.value) == (f"{where}: is several lines ended by a CR alone (as classic Mac OS saved text), "
                                      "not by LF or CRLF: save the file with LF or CRLF line endings (tr '\\r' '\\n' "
                                      "writes them so)")
    with pytest.raises(ValueError, match=re.escape("p.jsonl:2: not JSON (Extra data, column 17)")):
        read_rows("p.jsonl", b'{"prompt": "a"}\n{"prompt": "b"} {"prompt": "c"}\r\n')


def test_input_that_is_one_json_document_is_said_to_be_not_json_lines():
    """A .json file of a list of prompts, or an object pretty-printed across lines, was refused by its first line as
    'not JSON (Expecting value, column 2)', which said nothing of why: it is named as one JSON document, with how to
    write JSON Lines. A JSON Lines file with a bad line is still refused by that line."""
    from blockpress.batchfile import INFILL, read_rows

    lines = [{"prompt": "a"}, {"prompt": "b", "id": 2}]
    for data, what in [(json.dumps(lines, indent=2), "a list of 2 items"), (json.dumps(lines), "a list of 2 items"),
                       (json.dumps(lines[1], indent=2), "an object across several lines")]:
        with pytest.raises(ValueError) as err:
            read_rows("p.json", b"\xef\xbb\xbf" + data.encode())
        assert str(err.value).startswith(f"p.json: is one JSON document ({what}), not JSON Lines: give each object a "
                                         "line of its own (jq -c ")
    with pytest.raises(ValueError, match=re.escape("h.json: is one JSON document (a list of 1 item)")):
        read_rows("h.json", json.dumps([{"template": "<|hole|>"}], indent=1).encode(), INFILL)
    for data, said in [(b'{"prompt": "a"}\n{"prompt": \n', "p.jsonl:2: not JSON"),
                       (b'{"prompt": "a"}\n[1]\n', "p.jsonl:2: expected an object")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            read_rows("p.jsonl", data)


def test_input_in_utf16_without_a_byte_order_mark_is_said_to_be_utf16():
    """A one-line file saved as UTF-16 with no byte-order mark (iconv -t UTF-16LE, .NET's Encoding.Unicode) was
    called "one JSON document (an object across several lines)": the check re-read the bytes with json.loads, which
    detects UTF-16 by itself. It is refused by its line, said to be UTF-16; a line with a NUL here and there is not."""
    from blockpress.batchfile import read_rows

    for codec in ("utf-16-le", "utf-16-be"):
        # (text not ASCII too: caf\u00e9 is no UTF-8 there, 5 \u20ac and \u4e50 fill the NUL of their high byte)
        for text in ('{"prompt": "def f(x):"}\n', '{"prompt": "a"}\r\n{"prompt": "b"}\r\n', '{"prompt": "caf\u00e9"}\n',
                     '{"prompt": "5 \u20ac"}\r\n', '{"prompt": "\u4e50"}\r\n{"prompt": "b"}\r\n',
                     '{"prompt": "\u30bd\u30fc\u30c8\u95a2\u6570\u3092\u66f8\u3044\u3066"}\n',  # (few NULs)
                     '{"prompt": "\u4e0a\u040a"}\n'):  # (a 0x0A byte inside a character: the split at b"\n" cut it)
            with pytest.raises(ValueError) as err:
                read_rows("in.jsonl", text.encode(codec))
            assert str(err.value).startswith("in.jsonl:1: not ") and str(err.value).endswith(
                "; it is UTF-16 (read so, without a byte-order mark, it is a JSON object): save it as UTF-8"), (
                codec, text, str(err.value))
    with pytest.raises(ValueError) as err:
        read_rows("in.jsonl", b'{"prompt": "a\x00b"}\n')  # a raw NUL in a string, the file UTF-8
    assert str(err.value) == "in.jsonl:1: not JSON (Invalid control character at, column 14)"
    with pytest.raises(ValueError) as err:  # NULs alone at the end (what a crash leaves): not UTF-16
        read_rows("in.jsonl", b'{"prompt": "a"}\n' + b"\x00" * 64 + b"\n")
    assert str(err.value) == "in.jsonl:2: not JSON (Expecting value, column 1)"


@pytest.mark.parametrize("kind_name", ["GENERATE", "INFILL"])
def test_an_input_line_giving_a_setting_no_line_reads_is_said_to_be_copied_not_applied(kind_name):
    """A line's "stop" or "min_new_tokens" (generate), or "prompt" (lm.infill's name for the context) or
    "hole_length" (infill), was copied to its output line beside the run's settings, as if applied, and was not:
    the text ran past the stop, the template was filled without the context. Such keys are still copied (a
    dataset's own fields: an infilling benchmark's "prompt" and "suffix"), and each is said once, by FILE:LINE, with
    what sets it; a null one, or a label the run does not know, is not."""
    from blockpress import batchfile

    kind = getattr(batchfile, kind_name)
    base = {"prompt": "def f(x):"} if kind is batchfile.GENERATE else {"template": "x = <|hole|>"}
    own = ({"stop": ["\n"]}, {"min_new_tokens": 5}, {"max_tokens": 9}, {"system": "be brief"}) \
        if kind is batchfile.GENERATE else ({"prompt": "def area(r):\n"}, {"hole_length": 4}, {"max_tokens": 9})
    for extra in (*own, {"temperature": 0.5}, {"max_denoising_steps": 4}, {"token_healing": False},
                  {"draw_temperature": 0.5}, {"n": 2}, {"num_return_sequences": 2}, {"seeds": [1, 2]}):
        (key,) = extra
        data = json.dumps({**base, "temperature": None}) + "\n" + json.dumps({**base, "id": 2, **extra}) + "\n"
        rows = batchfile.read_rows("p.jsonl", data.encode(), kind)
        assert rows[1].carried == {"id": 2, **extra}
        notes = batchfile.unapplied_notes("p.jsonl", rows, kind)
        assert len(notes) == 1 and notes[0].startswith(f"p.jsonl:2: {key}: copied to the output lines as it is, not "
                                                       "applied; "), notes
    assert batchfile.unapplied_notes("p.jsonl", batchfile.read_rows("p.jsonl", json.dumps(
        {**base, "id": 3, "label": "stop"}).encode(), kind), kind) == []
    flags = {name: how.split(" sets it")[0] for name, how in kind.unapplied.items() if how.startswith("--")}
    assert flags["max_denoising_steps"] == "--steps" and flags["temperature"] == flags["draw_temperature"] == "--temperature"
    assert all('repeat its line, each with its own "seed"' in kind.unapplied[k] for k in ("n", "num_return_sequences", "seeds"))
    assert flags["token_healing"] == ("--token-healing / --no-token-healing" if kind is batchfile.GENERATE
                                      else "--no-token-healing")
    parser = build_parser()  # every flag named is one the command takes
    command = "generate" if kind is batchfile.GENERATE else "infill"
    taken = {o for a in parser._subparsers._group_actions[0].choices[command]._actions for o in a.option_strings}
    assert {f for how in flags.values() for f in how.split(" / ")} <= taken


@pytest.mark.parametrize("command", ["generate", "infill"])
def test_input_says_on_stderr_which_line_keys_are_copied_not_applied(tmp_path, capsys, command):
    """The notes are printed before the run, once a key, and the lines run as they would without the key."""
    line = {"prompt": "x", "stop": ["\n"], "temperature": 0.1} if command == "generate" else \
        {"template": "x = <|hole|>", "prompt": "y", "hole_length": 3}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(line) + "\n" + json.dumps(line) + "\n")
    assert main([command, "--model", "random-tiny", "--input", str(src), "--seed", "1",
                 *(["--max-new-tokens", "2", "--no-live"] if command == "generate" else ["--hole-length", "2"])]) == 0
    captured = capsys.readouterr()
    notes = [x for x in captured.err.splitlines() if "copied to the output lines as it is, not applied" in x]
    named = {"stop", "temperature"} if command == "generate" else {"prompt", "hole_length"}
    assert sorted(x.split(": ")[2] for x in notes) == sorted(named), notes
    # warnings, as every other: a script that looks for "warning:" on stderr finds them
    assert all(x.startswith(f"warning: {src}:1: ") for x in notes) and len(captured.out.splitlines()) == 2


def test_generate_input_refuses_a_system_message_beside_system_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A messages line with a system message (or a "developer" one, OpenAI's name for it, which the template reads as
    system) beside --system is refused by FILE:LINE before the model loads: "developer" met the template's own
    'Chat template error: Only the first message may have the system role', and either came after the load."""
    monkeypatch.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
    for role in ("system", "developer"):
        src = write_input(tmp_path / "in.jsonl", [INPUT_LINES[0], {"messages": [{"role": role, "content": "Be brief."},
                                                                                {"role": "user", "content": "hi"}]}])
        assert main(["generate", "--input", str(src), "--model", MODEL, "--system", "Be kind."]) == 2
        assert capsys.readouterr().err == (f"blockpress generate: error: {src}:3: messages: has a system message, and "
                                           "--system gives one too; drop one\n")


def test_generate_input_names_messages_in_a_chat_template_error(tmp_path, capsys, monkeypatch):
    """A messages line the chat template refuses (its raise_exception) is named by FILE:LINE and its messages field,
    where 'in.jsonl:3: Chat template error: ...' named no field; with --system, as the messages after its message.
    The template's own text names no message, so the error names none either; nothing is generated."""
    monkeypatch.setattr(blockpress.LM, "generate", lambda *a, **kw: pytest.fail("a row was generated"))
    tokenizer = blockpress.load(MODEL).tokenizer
    late_system = [{"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."}]
    tool = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]  # a role the template has not
    for messages, flags, field in ((late_system, [], "messages"), (tool, [], "messages"),
                                   (tool, ["--system", "Be kind."], "messages (after --system's message)")):
        with pytest.raises(ValueError, match="^Chat template error: ") as refused:
            tokenizer.apply_chat_template(messages)
        src = write_input(tmp_path / "in.jsonl", [INPUT_LINES[0], {"messages": messages}])
        assert main(["generate", "--input", str(src), "--model", MODEL, *flags]) == 2
        assert capsys.readouterr().err == f"blockpress generate: error: {src}:3: {field}: {refused.value}\n"


def test_generate_output_is_not_overwritten_and_resume_appends_the_rest(tmp_path, capsys, monkeypatch):
    """An existing --output is refused unless --overwrite; --resume over a run cut short (two lines and half a
    third) generates only the lines it lacks, and the file ends as one whole run's."""
    src, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    base = ["generate", "--input", str(src), "--output", str(out), "--model", MODEL, "--max-new-tokens", "6",
            "--steps", "2", "--threads", "1", "--temperature", "1.5", "--seed", "11"]
    assert main(base) == 0
    whole = out.read_text()
    out.write_text("partial")
    assert main(base) == 2 and "--overwrite" in capsys.readouterr().err and out.read_text() == "partial"
    assert main([*base, "--overwrite"]) == 0 and out.read_text() == whole
    lines = whole.splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])  # cut short while writing the third line
    with rows_asked(monkeypatch, "generate") as calls:
        assert main([*base, "--resume"]) == 0
    assert out.read_text() == whole and sum(calls) == 3
    capsys.readouterr()
    # an output of every line, or another file's, is read before the model loads (a 26B's load takes minutes)
    monkeypatch.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
    assert main([*base, "--resume"]) == 0 and out.read_text() == whole
    assert capsys.readouterr().err == f"--resume: {out} holds every line of {src} already; nothing is left to run\n"
    out.write_text(json.dumps({"line": 99, "text": ""}) + "\n")
    assert main([*base, "--resume"]) == 2 and "line 99" in capsys.readouterr().err


def test_generate_output_that_is_the_input_or_no_file_is_refused_before_the_model_loads(tmp_path, capsys,
                                                                                        monkeypatch):
    """--output naming the --input file (by another spelling too) is refused whatever the flags, the prompts kept
    (with --overwrite it emptied them, then wrote the output over them); a folder, or a path in a folder that does
    not exist, is named as --output's, and nothing loads."""
    src = write_input(tmp_path / "in.jsonl")
    prompts = src.read_bytes()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
    for output in [str(src), "./in.jsonl", "../" + tmp_path.name + "/in.jsonl"]:
        for flags in [[], ["--overwrite"], ["--resume"]]:
            assert main(["generate", "--input", "in.jsonl", "--output", output, "--model", MODEL, *flags]) == 2
            assert "is the --input file" in capsys.readouterr().err and src.read_bytes() == prompts
    (tmp_path / "d").mkdir()
    for output, message in [("d", "--output d: is a folder"), ("no/out.jsonl", "the folder no does not exist")]:
        assert main(["generate", "--input", "in.jsonl", "--output", output, "--model", MODEL, "--overwrite"]) == 2
        assert message in capsys.readouterr().err
    # an --input that cannot be read is named as --input's (it was a bare "[Errno 2] No such file or directory")
    for path, message in [("nope.jsonl", "--input nope.jsonl: No such file or directory"), ("d", "--input d: is a folder")]:
        assert main(["generate", "--input", path, "--model", MODEL]) == 2
        assert message in capsys.readouterr().err


def test_input_refuses_json_before_the_model_loads_and_no_live_hides_the_progress_bar(tmp_path, monkeypatch,
                                                                                       capsys):
    """--json and --no-live were taken with --input and changed nothing. --json is refused (the output lines are
    JSON already), naming the keys a line has, before the model loads; --no-live hides the progress bar a terminal's
    stderr shows, the stats line kept."""
    src = write_input(tmp_path / "in.jsonl", INPUT_LINES[:2])
    holes = write_input(tmp_path / "holes.jsonl", INFILL_LINES[:1])
    with monkeypatch.context() as m:
        m.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
        for command, path in [("generate", src), ("infill", holes)]:
            assert main([command, "--input", str(path), "--json", "--model", MODEL]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"blockpress {command}: error: --json: not with --input") and "\n" not in err
            assert "line, text, " in err and "seed" in err
    base = ["generate", "--input", str(src), "--model", MODEL, "--max-new-tokens", "2", "--steps", "1",
            "--threads", "1"]
    for flags, bar in [([], True), (["--no-live"], False)]:
        monkeypatch.setattr(sys, "stderr", TerminalIO())
        assert main([*base, *flags]) == 0
        err = sys.stderr.getvalue()
        assert ("row/s" in err) is bar and "[2 rows · " in err  # tqdm's rate, and the stats line either way
        assert [json.loads(x)["line"] for x in capsys.readouterr().out.splitlines()] == [1, 3]


def test_input_output_dash_is_standard_output(tmp_path, capsys, monkeypatch):
    """--output - writes standard output, as --input - reads standard input (it wrote a file named "-"); --resume and
    --overwrite, which need a file, are refused with it."""
    monkeypatch.chdir(tmp_path)
    write_input(tmp_path / "in.jsonl", INPUT_LINES[:1])
    base = ["generate", "--input", "in.jsonl", "--output", "-", "--model", MODEL, "--max-new-tokens", "2",
            "--steps", "1", "--threads", "1"]
    assert main(base) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["line"] == 1 and not (tmp_path / "-").exists()
    assert "[1 row · " in err  # (the stats line said "1 rows")
    for flag in ("--resume", "--overwrite"):
        assert main([*base, flag]) == 2 and f"{flag}: goes with --output FILE" in capsys.readouterr().err


def test_resume_refuses_the_output_of_another_input_by_its_prompt_and_copied_keys(tmp_path):
    """--resume reads an output line as done only where its prompt and copied keys are the input line's: another
    file's output, with lines at the same numbers, had its texts kept under this file's lines."""
    from blockpress.batchfile import done_lines, read_rows

    src = write_input(tmp_path / "in.jsonl")
    rows = read_rows("in.jsonl", src.read_bytes())
    out = tmp_path / "out.jsonl"

    def written(row, **change):  # the output line a run writes for `row` (its own seed, if it has one), `change` over it
        obj = {"line": row.line, **row.carried, "text": "t", **({"prompt": row.prompt} if row.prompt else {}),
               "new_tokens": 1, "forward_passes": 1, "tokens_per_forward": 1.0, "seed": row.seed or 0, **change}
        return json.dumps({k: v for k, v in obj.items() if v is not None}) + "\n"

    out.write_text("".join(written(r) for r in rows[:3]))
    assert done_lines(out, rows) == {1, 3, 4}
    out.write_text("".join(written(r) for r in [*rows[:3], rows[1]]))  # two outputs put together: line 3 twice
    with pytest.raises(ValueError, match="out.jsonl:4: line 3: written already, at .*out.jsonl:2; an output holds each"):
        done_lines(out, rows)
    for change, key in [({"prompt": "def sub(a, b):"}, "prompt"), ({"id": "z"}, "id"), ({"id": None}, "id"),
                        ({"label": 1}, "label"), ({"seed": 8}, "seed")]:  # (the line gives seed 7)
        out.write_text(written(rows[0]) + written(rows[1], **change))
        with pytest.raises(ValueError, match=f"out.jsonl:2: line 3: its {key} is not the input line's"):
            done_lines(out, rows)
    # a line's own max_new_tokens (5), which an output line records where it has settings (one of before does not)
    out.write_text(written(rows[1]))
    assert done_lines(out, rows) == {3}
    for change in [{"max_new_tokens": 6}, {"settings": {}}]:
        out.write_text(written(rows[1], **change))
        with pytest.raises(ValueError, match="out.jsonl:1: line 3: its max_new_tokens is not the input line's"):
            done_lines(out, rows)
    out.write_text(written(rows[1], max_new_tokens=5, settings={}) + written(rows[2], max_new_tokens=3, settings={}))
    assert done_lines(out, rows) == {3, 4}
    out.write_text(written(rows[0], max_new_tokens=5, settings={}))  # (a line that gives none)
    with pytest.raises(ValueError, match="line 1: its max_new_tokens is not the input line's"):
        done_lines(out, rows)


def test_resume_refuses_the_output_of_another_conversation_by_its_messages(tmp_path):
    """A messages line's output repeats its messages, as a prompt line's repeats its prompt, and --resume checks
    them: the output line wrote no prompt, so another file's conversation at the same line number was taken as done.
    An output written before the key was (no "messages") is taken on its line number and copied keys, as it was."""
    from blockpress.batchfile import done_lines, read_rows

    rows = read_rows("in.jsonl", write_input(tmp_path / "in.jsonl").read_bytes())
    chat = rows[3]  # {"messages": [...], "id": "d"}, line 5
    assert chat.messages is not None and chat.line == 5
    out = tmp_path / "out.jsonl"

    def written(**change):
        obj = {"line": chat.line, **chat.carried, "text": "t", "messages": chat.messages, "new_tokens": 1, **change}
        return json.dumps({k: v for k, v in obj.items() if v is not None}) + "\n"

    for held in [written(), written(messages=None)]:
        out.write_text(held)
        assert done_lines(out, rows) == {5}
    other = [{"role": "user", "content": "Write a sonnet."}]
    for change, key in [({"messages": other}, "messages"), ({"messages": chat.messages + other}, "messages"),
                        ({"messages": None, "prompt": "Write a haiku."}, "prompt")]:
        out.write_text(written(**change))
        with pytest.raises(ValueError, match=f"out.jsonl:1: line 5: its {key} is not the input line's"):
            done_lines(out, rows)
    # a prompt line's output naming messages is another file's too
    out.write_text(json.dumps({"line": 1, "id": "a", "text": "t", "prompt": rows[0].prompt, "messages": other}) + "\n")
    with pytest.raises(ValueError, match="line 1: its messages is not the input line's"):
        done_lines(out, rows)


def test_resume_after_a_whole_last_line_without_its_newline_appends_on_a_line_of_its_own(tmp_path):
    """An output whose last line is whole but lacks its newline (a cut just before it, an editor's save) keeps the
    line and gets its newline, so the next line appended starts a line of its own (it ran on from it)."""
    from blockpress.batchfile import done_lines, read_rows

    rows = read_rows("in.jsonl", write_input(tmp_path / "in.jsonl").read_bytes())
    out = tmp_path / "out.jsonl"
    first = json.dumps({"line": 1, "id": "a", "text": "t", "prompt": rows[0].prompt})
    for held in [first, first + "\n"]:
        out.write_text(held)
        assert done_lines(out, rows) == {1}
        assert out.read_text() == first + "\n"
    # a file that is no output (--output notes.txt by mistake), or another input's, is refused as it is: its last line
    # was cut (or a newline added) before the lines above it were read and refused
    other = json.dumps({"line": 1, "text": "t", "prompt": "another prompt"})
    for held in ["my notes\nthe last line", "my notes\n" + first, other + "\n" + first[:10], other + "\n" + first]:
        out.write_text(held)
        with pytest.raises(ValueError, match="out.jsonl:1: "):
            done_lines(out, rows)
        assert out.read_text() == held


def test_resume_refuses_an_output_made_with_other_settings_by_flag_before_the_model_loads(tmp_path, capsys,
                                                                                          monkeypatch):
    """Each output line records the flags that change what its row gets (`settings`); --resume with another value of
    one, or one added or left out, is refused by that flag as typed, with both values, before the model loads, where
    the file silently got lines made two ways. --batch-size and --no-live change no row and are not compared; an
    output written before lines recorded settings is taken as it was, with one warning line."""
    src, out = write_input(tmp_path / "in.jsonl", INPUT_LINES[:3]), tmp_path / "out.jsonl"
    # float32: in bfloat16 (what a CPU with native bf16 loads the model in) a row batched with longer ones is padded, and
    # the padding moves its rounding (documented for --batch-size), so at temperature 1.5 the resumed rows, run one at
    # a time, drew other tokens on an AVX512-BF16 machine
    base = ["generate", "--input", str(src), "--output", str(out), "--model", MODEL, "--max-new-tokens", "4",
            "--steps", "2", "--threads", "1", "--temperature", "1.5", "--seed", "11", "--dtype", "float32"]
    assert main(base) == 0
    whole = out.read_text()
    first, *rest = whole.splitlines(keepends=True)
    out.write_text(first)
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
        for flags, message in [
                ([*base, "--max-new-tokens", "8"], "--max-new-tokens: {}:1 was written with 4, this run asks 8"),
                ([*base, "--max-denoising-steps", "3"], "--max-denoising-steps: {}:1 was written with 2, this run asks 3"),
                ([*base, "--top-k", "5"], "--top-k: {}:1 was written without it, this run asks 5"),
                ([*base, "--chat"], "--chat: {}:1 was written without it, this run asks for it"),
                ([*base, "--no-token-healing"], "--no-token-healing: {}:1 was written without it, this run asks for it"),
                ([*base, "--dtype", "bfloat16"], "--dtype: {}:1 was written with float32, this run asks bfloat16"),
                ([*base[:-4], *base[-2:]], "--seed: {}:1 was written with 11, this run is without it")]:
            assert main([*flags, "--resume"]) == 2
            assert capsys.readouterr().err == (f"blockpress generate: error: {message.format(out)}; resume with the "
                                               "flags the output was made with, or give --overwrite to start it again\n")
            assert out.read_text() == first
    assert json.loads(first)["settings"]["max_new_tokens"] == 4
    assert main([*base, "--resume", "--batch-size", "1", "--no-live"]) == 0 and out.read_text() == whole
    # an output of before: its lines taken unchecked, said once
    old = json.dumps({k: v for k, v in json.loads(first).items() if k != "settings"}) + "\n"
    out.write_text(old)
    capsys.readouterr()
    assert main([*base, "--resume"]) == 0 and out.read_text() == old + "".join(rest)
    assert capsys.readouterr().err.startswith(f"warning: --resume: 1 line of {out} was written before output lines "
                                              "recorded their settings; the flags they were made with could not be "
                                              "checked against this run's\n[2 rows · ")
    # infill --input's lines alike, --hole-length among them
    holes, filled = write_input(tmp_path / "holes.jsonl", INFILL_LINES[:1]), tmp_path / "filled.jsonl"
    run = ["infill", "--input", str(holes), "--output", str(filled), "--model", MODEL, "--steps", "1", "--threads", "1"]
    assert main(run) == 0 and json.loads(filled.read_text())["settings"]["hole_length"] == 8
    monkeypatch.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
    assert main([*run, "--hole-length", "4", "--resume"]) == 2
    assert f"--hole-length: {filled}:1 was written with 8, this run asks 4;" in capsys.readouterr().err


def test_resume_checks_the_dtype_a_run_computes_in_given_or_by_default(tmp_path, capsys, monkeypatch):
    """An output line recorded --dtype as typed, so with none given a bf16 checkpoint's rows made in bfloat16 on a
    CPU with native bf16 matmuls were continued silently in float32 on one without (the file then held rows of
    both), and an output made with --dtype float32 was refused by a run that computes in float32 by default. The
    dtype is recorded as run, and with no --dtype checked once the load has picked it."""
    from blockpress import checkpoint
    from blockpress.cli.common import load_model

    folder = tmp_path / "m"
    load_model("random-tiny", "bfloat16", "cpu").save(folder)  # stored in bf16
    src, out = write_input(tmp_path / "in.jsonl", INPUT_LINES[:2]), tmp_path / "out.jsonl"
    run = ["generate", "--input", str(src), "--output", str(out), "--model", str(folder), "--max-new-tokens", "2",
           "--steps", "1", "--threads", "1", "--seed", "3", "--no-live"]
    holes, filled = write_input(tmp_path / "holes.jsonl", INFILL_LINES[:2]), tmp_path / "filled.jsonl"
    fill = ["infill", "--input", str(holes), "--output", str(filled), "--model", str(folder), "--steps", "1",
            "--threads", "1", "--seed", "3"]
    for command, path in ((run, out), (fill, filled)):
        monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: True)
        assert main(command) == 0
        first = path.read_text().splitlines(keepends=True)[0]
        assert json.loads(first)["settings"]["dtype"] == "bfloat16"
        path.write_text(first)
        monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: False)  # loads in float32
        capsys.readouterr()
        assert main([*command, "--resume"]) == 2 and path.read_text() == first
        assert capsys.readouterr().err.endswith(f" error: --dtype: {path}:1 was written with bfloat16; with no "
                                                "--dtype this run computes in float32, the load's pick for this "
                                                "machine: give --dtype bfloat16 to continue it, or --overwrite to "
                                                "start it again\n")
        assert main([*command, "--resume", "--dtype", "bfloat16"]) == 0  # (emulated: slow, but these rows)
    # made with --dtype float32, continued where float32 is the default
    assert main([*run, "--dtype", "float32", "--overwrite"]) == 0
    whole = out.read_text()
    assert {json.loads(line)["settings"]["dtype"] for line in whole.splitlines()} == {"float32"}
    out.write_text(whole.splitlines(keepends=True)[0])
    assert main([*run, "--resume"]) == 0 and out.read_text() == whole
    # a line written before lines recorded the dtype a run without --dtype computed in: taken unchecked, as lines
    # written before lines recorded settings at all are (it was refused, and --overwrite was the only way on)
    line = json.loads(whole.splitlines()[0])
    del line["settings"]["dtype"]
    out.write_text(json.dumps(line) + "\n")
    capsys.readouterr()
    assert main([*run, "--resume"]) == 0 and len(out.read_text().splitlines()) == 2
    assert f"--resume: 1 line of {out} records no dtype" in capsys.readouterr().err  # (said: they may differ)
    # a line of before settings were recorded at all is said once, as such (it was counted in both warnings)
    bare = {k: v for k, v in line.items() if k != "settings"}
    second = json.loads(whole.splitlines()[1])
    del second["settings"]["dtype"]
    write_input(tmp_path / "more.jsonl", INPUT_LINES[:3])
    out.write_text(json.dumps(bare) + "\n" + json.dumps(second) + "\n")
    capsys.readouterr()
    assert main([*run[:2], str(tmp_path / "more.jsonl"), *run[3:], "--resume"]) == 0
    err = capsys.readouterr().err
    assert "1 line of" in err and f"--resume: 1 line of {out} records no dtype" in err and "2 lines" not in err, err
    out.write_text(json.dumps(line) + "\n")  # (--dtype given: such a line was made without it, as it says)
    assert main([*run, "--resume", "--dtype", "float32"]) == 2


def test_resume_knows_a_model_folder_however_it_is_spelled(tmp_path, capsys, monkeypatch):
    """--resume compared --model as typed: the same folder given as --model=~/code, or relatively from its parent,
    was refused, while two folders each typed `m` from two working directories were taken as one (the output then
    held lines of two models). A folder is recorded by where it is; a line of before that holds it as typed,
    relative to this run's working directory, still matches."""
    home = tmp_path / "home"
    from blockpress.cli.common import load_model

    lm = load_model("random-tiny", None, "cpu")  # (a tokenizer with it, for the text prompts)
    for folder in (home / "code", tmp_path / "A" / "m", tmp_path / "B" / "m"):
        lm.save(folder)
    monkeypatch.setenv("HOME", str(home))
    src, out = write_input(tmp_path / "in.jsonl", INPUT_LINES[:2]), tmp_path / "out.jsonl"
    run = ["generate", "--input", str(src), "--output", str(out), "--max-new-tokens", "2", "--steps", "1",
           "--threads", "1", "--seed", "1"]
    assert main([*run, "--model", str(home / "code")]) == 0
    assert json.loads(out.read_text().splitlines()[0])["settings"]["model"] == str((home / "code").resolve())
    monkeypatch.chdir(home)
    for spelling in ("--model=~/code", "--model=code"):
        assert main([*run, spelling, "--resume"]) == 0 and "holds every line" in capsys.readouterr().err
    legacy = [json.loads(line) for line in out.read_text().splitlines()]
    for line in legacy:
        line["settings"]["model"] = "code"
    out.write_text("".join(json.dumps(line) + "\n" for line in legacy))
    assert main([*run, "--model", "code", "--resume"]) == 0
    for line in legacy:  # as typed with ~, the identical flags
        line["settings"]["model"] = "~/code"
    out.write_text("".join(json.dumps(line) + "\n" for line in legacy))
    assert main([*run, "--model=~/code", "--resume"]) == 0
    # a bare shipped name is the shipped model whatever folder of that name is here: recorded as the name, and a
    # folder of that name (./name) is another model
    for name in {"random-tiny", MODEL}:
        (home / name).mkdir()
        assert main([*run, "--model", name, "--overwrite"]) == 0
        assert json.loads(out.read_text().splitlines()[0])["settings"]["model"] == name
        assert main([*run, "--model", f"./{name}", "--resume"]) == 2
        assert f"was written with {name}, this run asks {home / name}" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path / "A")
    assert main([*run, "--model", "m", "--overwrite"]) == 0
    monkeypatch.chdir(tmp_path / "B")
    assert main([*run, "--model", "m", "--resume"]) == 2
    assert f"was written with {tmp_path / 'A' / 'm'}, this run asks {tmp_path / 'B' / 'm'}" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["seed", "steps", "model"]), st.integers(0, 2) | st.booleans()),
       st.dictionaries(st.sampled_from(["seed", "steps", "model"]), st.integers(0, 2) | st.booleans()))
def test_resume_settings_check_refuses_exactly_a_difference_naming_a_setting_that_differs(tmp_path_factory, held,
                                                                                          wanted):
    """check_settings passes an output whose every line holds this run's settings (a line of no settings unchecked,
    counted), and refuses one that differs in any setting, naming a flag whose values differ."""
    from blockpress.batchfile import check_settings

    out = tmp_path_factory.mktemp("settings") / "out.jsonl"
    out.write_text(json.dumps({"line": 1}) + "\n" + json.dumps({"line": 2, "settings": held}) + "\n")
    flag = lambda key: f"--{key}"  # noqa: E731
    if held == wanted:
        assert check_settings(out, wanted, flag) == 1
        return
    with pytest.raises(ValueError) as err:
        check_settings(out, wanted, flag)
    key = str(err.value).split(":")[0].removeprefix("--")
    assert held.get(key, "absent") != wanted.get(key, "absent") and f"{out}:2 was written " in str(err.value)


# The command with its AT-th call of LM.generate held in generation until a stop comes: that call's rows are
# generated again and again (the signal lands inside the model's run, as a user's Ctrl-C does), for at most 60 s.
HELD = """
import signal, sys, time
import blockpress
from blockpress.cli import main

# Python leaves SIGINT ignored where its parent did (a job started with & by a shell without job control)
signal.signal(signal.SIGINT, signal.default_int_handler)
at, args = int(sys.argv[1]), sys.argv[2:]
original, calls = blockpress.LM.generate, []

def held(*a, **kw):
    calls.append(1)
    if len(calls) < at:
        return original(*a, **kw)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        original(*a, **kw)
    sys.exit("no stop came")

blockpress.LM.generate = held
sys.exit(main(args))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no SIGINT to send a process on Windows")
def test_generate_input_stopped_by_ctrl_c_keeps_whole_lines_and_resume_finishes_the_run(tmp_path):
    """A SIGINT to `generate --input F --output O` once O has a line (the next batch generating): exit 130, a line
    on stderr naming the lines written and saying --resume continues, every line of O whole JSON; --resume then
    ends O as the run that was never stopped writes it (same seeds)."""
    import signal
    import time

    # prompts of ascending length, so batches of one run (and are written) in input order
    src = write_input(tmp_path / "in.jsonl", [{"prompt": " ".join("abcdef"[:n]), "id": n} for n in range(1, 7)])
    out, whole = tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    flags = ["generate", "--input", str(src), "--model", MODEL, "--batch-size", "1", "--max-new-tokens", "4",
             "--steps", "2", "--temperature", "1.5", "--seed", "11", "--threads", "1"]
    proc = subprocess.Popen([sys.executable, "-c", HELD, "2", *flags, "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().endswith("\n")):  # the first batch's line, written whole
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    kept = out.read_text().splitlines(keepends=True)
    assert all(x.endswith("\n") and json.loads(x)["line"] for x in kept) and len(kept) == 1
    assert f"interrupted (1 of 6 lines written to {out}; --resume continues)" in err and "Traceback" not in err
    assert main([*flags, "--output", str(out), "--resume"]) == 0
    assert main([*flags, "--output", str(whole)]) == 0
    assert out.read_text() == whole.read_text() and [g["id"] for g in output_lines(out)] == list(range(1, 7))


def test_input_lines_read_the_same_from_a_file_with_a_byte_order_mark_and_crlf_endings(tmp_path):
    """A file saved as "UTF-8 with BOM" with Windows line endings reads as the plain one: its first line was refused
    as "not JSON (Unexpected UTF-8 BOM ...)", where training's JSONL reading takes such a file."""
    from blockpress.batchfile import read_rows

    plain = write_input(tmp_path / "in.jsonl").read_bytes()
    windows = b"\xef\xbb\xbf" + plain.replace(b"\n", b"\r\n")
    assert read_rows("w.jsonl", windows) == read_rows("in.jsonl", plain)
    # Windows PowerShell 5's > writes UTF-16: said so, as training's data reading says it (it read 'not UTF-8 (byte
    # 0xff at byte 1)' alone); a file of another encoding is not called UTF-16
    for data, why in [(plain.decode().encode("utf-16"), "; it is UTF-16 (it starts with a UTF-16 byte-order mark"),
                      ('{"prompt": "caf\xe9"}'.encode("latin-1"), "")]:
        with pytest.raises(ValueError) as err:
            read_rows("u.jsonl", data)
        assert str(err.value).startswith("u.jsonl:1: not UTF-8 (byte 0x") and why in str(err.value)
        assert ("UTF-16" in str(err.value)) is bool(why)


# infill --input: a JSONL file of templates, through generate --input's machinery
INFILL_LINES = [
    {"template": "def add(a, b):\n    return <|hole:4|>", "id": "a"},
    {"template": "x = <|hole:3|> + 1", "prefix": "a = 2\n", "seed": 5},
    {"template": "import <|hole|>\nimport <|hole:2|>", "tags": ["two holes"]},
]


def test_infill_input_rows_are_their_runs_alone_in_input_order_and_resume_appends_the_rest(tmp_path, capsys, monkeypatch):
    """Templates of mixed lengths (in batches of 2) come back in input order with their carried keys, and each
    row's fills are what `infill TEMPLATE --seed S --json` gives it alone (its prefix too); --resume over a run
    cut short runs only the lines it lacks, and the file ends as one whole run's."""
    # float32, as test_generate_input_rows_are_their_runs_alone_in_input_order's
    base = ["--model", MODEL, "--dtype", "float32", "--steps", "2", "--threads", "1", "--temperature", "1.5"]
    src, out = write_input(tmp_path / "in.jsonl", INFILL_LINES), tmp_path / "out.jsonl"
    run = ["infill", "--input", str(src), "--output", str(out), "--batch-size", "2", *base]
    assert main(run) == 0
    got = output_lines(out)
    assert [g["line"] for g in got] == [1, 3, 4] and [g.get("id") for g in got] == ["a", None, None]
    assert got[2]["tags"] == ["two holes"] and got[1]["seed"] == 5 and len(got[2]["fills"]) == 2
    capsys.readouterr()
    for line, g in zip(INFILL_LINES, got):
        alone = ["infill", line["template"], "--json", "--seed", str(g["seed"]), *base]
        assert main(alone + (["--prefix", line["prefix"]] if "prefix" in line else [])) == 0
        want = json.loads(capsys.readouterr().out)
        assert {k: g[k] for k in want if k in g} == {k: v for k, v in want.items() if k in g}
        assert g.get("prefix") == line.get("prefix") and "tok_s" not in g and "interrupted" not in g
    run += ["--seed", "11"]  # (a seed drawn afresh would fill the resumed lines otherwise)
    assert main([*run, "--overwrite"]) == 0
    whole = out.read_text()
    lines = whole.splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][:10])  # cut short while writing the second line
    with rows_asked(monkeypatch, "infill") as calls:
        assert main([*run, "--resume"]) == 0
    assert out.read_text() == whole and sum(calls) == 2
    # another file's output at the same line numbers is not taken as done, nor loads the model; nor does a whole one
    monkeypatch.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
    assert main([*run, "--resume"]) == 0 and "holds every line" in capsys.readouterr().err
    src.write_text(json.dumps({"template": "y = <|hole:2|>", "id": "a"}) + "\n")
    assert main([*run, "--resume"]) == 2 and "line 1: its template is not the input line's" in capsys.readouterr().err


def test_infill_input_refuses_a_bad_line_by_file_and_line_before_running(tmp_path, capsys, monkeypatch):
    """A bad line (no template, a template without a hole or with an unterminated marker, a length of its own, a
    key the output writes) is refused by FILE:LINE before the model loads; a prefix past the context after it, and
    nothing runs; --output naming the --input file is refused as generate's is."""
    from blockpress.batchfile import INFILL, read_rows

    for line, message in [('{"prompt": "x"}', '"template"'), ('{"template": 3}', "template: expected a str"),
                          ('{"template": "<|hole|>", "max_new_tokens": 4}', "max_new_tokens: an infill is as long"),
                          ('{"template": "<|hole|>", "fills": []}', "fills: a key the output line writes")]:
        with pytest.raises(ValueError) as err:
            read_rows("f.jsonl", b'{"template": "<|hole|>"}\n\n' + line.encode() + b"\n", INFILL)
        assert str(err.value).startswith("f.jsonl:3: ") and message in str(err.value)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    calls = []
    monkeypatch.setattr(blockpress.LM, "infill", lambda *a, **kw: calls.append(a))
    with monkeypatch.context() as m:
        m.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
        for bad, message in [({"template": "x = 1"}, "template: has no holes to fill"),
                             ({"template": "x = <|hole:3"}, "template: '<|hole:3' looks like a hole marker")]:
            src.write_text(json.dumps({"template": "<|hole|>"}) + "\n" + json.dumps(bad) + "\n")
            assert main(["infill", "--input", str(src), "--output", str(out), "--model", MODEL]) == 2
            err = capsys.readouterr().err
            assert f"{src}:2: {message}" in err
        assert main(["infill", "--input", str(src), "--output", str(src), "--model", MODEL, "--overwrite"]) == 2
        assert "is the --input file" in capsys.readouterr().err
        assert main(["infill", "x <|hole|>", "--input", str(src)]) == 2 and "not both" in capsys.readouterr().err
        assert main(["infill", "x <|hole|>", "--resume"]) == 2 and "goes with --input" in capsys.readouterr().err
        # --batch-size was taken without --input, any value (0, -3) accepted for a run it changed nothing in
        for command, given in (("infill", "x <|hole|>"), ("generate", "x")):
            for size in ("0", "4"):
                assert main([command, given, "--batch-size", size]) == 2
                assert "--batch-size: goes with --input FILE" in capsys.readouterr().err
        assert main(["infill", "--input", str(src), "--prefix", "x"]) == 2 and '"prefix"' in capsys.readouterr().err
    src.write_text(json.dumps({"template": "<|hole|>", "prefix": "x " * 5000}) + "\n")
    assert main(["infill", "--input", str(src), "--output", str(out), "--model", MODEL]) == 2
    assert f"{src}:1: prefix: " in capsys.readouterr().err and not calls and not out.exists()


@pytest.mark.parametrize("command, lines", [("generate", INPUT_LINES[:2]), ("infill", INFILL_LINES[:2])])
def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, command,
                                                                            lines):
    """An --output in a read-only folder (a read-only disk, another user's folder) was found by its first write, once
    the model had loaded; a path under a file was said to be in a folder that 'does not exist'."""
    import os

    src = write_input(tmp_path / "in.jsonl", lines)
    readonly = (tmp_path / "ro").resolve()
    readonly.mkdir()
    (readonly / "old.jsonl").write_text("")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode & os.W_OK and Path(p).resolve() in
                        (readonly, readonly / "old.jsonl") else real_access(p, mode, **kw))
    monkeypatch.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
    for output, flags, message in [
            (readonly / "out.jsonl", [], f"cannot be written (its folder {readonly} or the file is read-only, or not "
                                         "yours)"),
            (readonly / "old.jsonl", ["--resume"], f"cannot be written (its folder {readonly} or the file is "
                                                   "read-only, or not yours)"),
            (src / "out.jsonl", [], f"{src} is a file, not a folder")]:
        assert main([command, "--input", str(src), "--output", str(output), "--model", MODEL, *flags]) == 2
        assert capsys.readouterr().err == f"blockpress {command}: error: --output {output}: {message}\n"


def test_a_file_flag_that_ends_with_a_separator_is_refused_as_a_folders_path(tmp_path, capsys, monkeypatch):
    """pathlib drops a trailing "/": `--output results/` (a folder that is not there yet) wrote a file named results,
    as bench's --out and --plot did; each is refused before anything loads or runs."""
    import blockpress.bench as bench

    src = write_input(tmp_path / "in.jsonl", INPUT_LINES[:1])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
    monkeypatch.setattr("blockpress.cli.common.load_announced", lambda args: pytest.fail("the model loaded"))
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: pytest.fail("measured before refusing the flag"))
    for argv, flag in [(["generate", "--input", str(src), "--output"], "--output"),
                       (["infill", "--input", str(src), "--output"], "--output"),
                       (["bench", "--preset", "tiny", "--out"], "--out"), (["bench", "--preset", "tiny", "--plot"],
                                                                          "--plot")]:
        for path in ["results/", f"sub{os.sep}"]:
            assert main([*argv, path]) == 2
            assert capsys.readouterr().err == (f"blockpress {argv[0]}: error: {flag} {path}: ends with {path[-1]}, "
                                               "as a folder's path does; give a file (a name after the folder)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a file every write to fails")
@pytest.mark.parametrize("command, lines", [("generate", INPUT_LINES[:2]), ("infill", INFILL_LINES[:2])])
def test_an_output_file_that_cannot_be_written_is_named_once(tmp_path, capsys, command, lines):
    """A full disk under --output ended in "error: [Errno 28] No space left on device", naming no flag; it names
    --output and says --resume continues (exit 2, as bench's --out that cannot be written)."""
    src = write_input(tmp_path / "in.jsonl", lines)
    assert main([command, "--input", str(src), "--output", "/dev/full", "--overwrite", "--model", MODEL, "--steps",
                 "1", "--threads", "1", *(["--max-new-tokens", "2"] if command == "generate" else [])]) == 2
    assert capsys.readouterr().err == (f"blockpress {command}: error: --output /dev/full: cannot write it (No space "
                                       "left on device); the whole lines it holds stay, and --resume continues\n")


def test_a_system_message_that_is_not_utf8_is_named_as_system(tmp_path, capsys, monkeypatch):
    """--system's bytes that are not UTF-8 (a command line's arrive as surrogates) were named "messages[0].content",
    and with --input a message of none of the file's lines; they are --system's."""
    src = write_input(tmp_path / "in.jsonl", [line for line in INPUT_LINES if "messages" in line])
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    for args in (["generate", "x", "--chat"], ["generate", "--input", str(src)], ["chat"]):
        assert main([*args, "--system", "\udcff", "--model", MODEL, "--threads", "1"]) == 2
        assert capsys.readouterr().err.endswith("error: --system: not valid UTF-8 (byte 0xff at character 0)\n")


def test_chat_caps_a_reply_to_the_room_the_context_has_left(monkeypatch, capsys):
    """A message that leaves room for a reply shorter than --max-new-tokens gets the shorter reply, and says so on
    stderr (one line, before the reply), rather than a refusal."""
    from blockpress.cli.common import load_model
    from blockpress.generate import canvas_room

    lm = load_model(MODEL, None, "cpu")
    context, canvas = lm.config.text.max_position_embeddings, lm.config.canvas_length

    def length(k):
        return len(lm.chat_prompt([{"role": "user", "content": "x " * k}]))

    k = next(k for k in range(context - canvas, 0, -1) if length(k) <= context - canvas)
    room = canvas_room(context, length(k), canvas)
    wanted = room + canvas
    lines = iter(["x " * k, "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    assert main(["chat", "--model", MODEL, "--max-new-tokens", str(wanted), "--steps", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert f"(the context has room for {room} more tokens: this reply gets at most {room}, not {wanted}; " \
           "/reset starts a new conversation)" in captured.err
    out = [json.loads(line) for line in captured.out.splitlines()]
    assert "text" in out[0] and out[0]["prompt_tokens"] == length(k) and out[1] == {"prompt": "/exit", "command": "exit"}


@pytest.mark.parametrize("command", ["generate", "chat", "infill", "sudoku", "bench", "train", "serve", "info"])
def test_help_fits_an_80_column_terminal(command, monkeypatch, capsys):
    """argparse wraps help and descriptions but not a group's title: the sampling group's 159-character title ran
    past the edge of every terminal."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    wide = [line for line in capsys.readouterr().out.splitlines() if len(line) > 80]
    assert wide == []


@pytest.mark.parametrize("device", ["auto", "AUTO", " Auto "])
def test_bench_runs_on_the_device_auto_names(device):
    """BenchSettings(device="AUTO") (or "auto" from the Python API) passed the settings check, which resolves any
    spelling, and then crashed as the run began: machine() handed the raw string to torch.device. The settings keep
    torch's spelling of the device resolved."""
    from blockpress import bench

    s = bench.BenchSettings(preset="tiny", device=device, new_tokens=2, steps=1, prompt_length=2, repeats=1,
                            reference=False, ar=False)
    assert s.device == "cpu"
    assert bench.run_bench(s)["machine"]["device"] == "cpu"


def test_a_model_already_on_the_gpu_that_cuda_names_is_not_moved(monkeypatch):
    """Tensors report cuda:0, and torch.device("cuda") != torch.device("cuda:0"): lm.to("cuda") on a model loaded
    there moved it again (a second copy's memory checked, caches dropped, graphs recaptured) where lm.to("cpu") on
    the CPU is a no-op. The device asked for is compared with the index torch would use (and "mps" with index 0,
    as MPS tensors report it); resolve_device itself keeps the spelling (torchrun reads an index given as the
    user's). Simulated: torch sees one GPU and the model reports cuda:0."""
    import blockpress.lm as lm_module
    from blockpress.checkpoint import indexed_device, resolve_device

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("cuda") == torch.device("cuda")
    assert indexed_device(resolve_device("cuda")) == indexed_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert indexed_device(resolve_device("cuda:0")) == torch.device("cuda", 0)
    assert indexed_device(resolve_device("mps")) == torch.device("mps", 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(lm_module.LM, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(lm_module, "check_fits", lambda *a: pytest.fail(f"checked room for a move: {a}"))
    monkeypatch.setattr(lm.model, "to", lambda *a, **k: pytest.fail(f"moved: {a}"))
    assert lm.to("cuda") is lm and lm.to(torch.device("cuda")) is lm


# From a mutation hunt over the CLI: the --input run's closing stats line, how batches are formed, --batch-size 0.
def test_input_stats_line_counts_rows_tokens_seconds_and_tok_s(monkeypatch, capsys):
    from blockpress.batchfile import InOrderWriter, Row
    from blockpress.cli import generate as gen

    clock = iter([100.0, 100.0, 103.0, 103.0])  # t0, the bar's postfix, the end (3 s)
    monkeypatch.setattr(gen.time, "perf_counter", lambda: next(clock))
    rows = [Row(1, prompt="a"), Row(2, prompt="b")]
    out = io.StringIO()
    code = gen.run_file_rows(rows, InOrderWriter(out, [1, 2]), [rows],
                             lambda batch: [{"line": r.line, "new_tokens": 5} for r in batch], "generate", None,
                             bar=False)
    assert code == 0 and out.getvalue().count("\n") == 2
    assert capsys.readouterr().err.strip() == "[2 rows · 10 new tokens · 3.0 s · 3.33 tok/s]"


def test_batches_sort_a_window_by_length_and_never_mix_kinds():
    """A batch that mixed chat and plain rows (healing is a call's) or seeded and unseeded rows (run_batch reads the
    first row's) would come out wrong; sorting within one batch rather than a window of them saves no padding."""
    from blockpress.batchfile import WINDOW_BATCHES, Row, batches

    def lines(groups):
        return [[r.line for r in g] for g in groups]

    rows = [Row(n) for n in range(1, 7)]
    length = {1: 9, 2: 1, 3: 9, 4: 1, 5: 5, 6: 5}
    same = {n: (False,) for n in length}
    # a window of 8 batches of 2 holds all six rows: the short ones go together
    assert lines(batches(rows, 2, length, same)) == [[2, 4], [5, 6], [1, 3]]
    # chat rows (or rows with seeds of their own) never share a call with the others, even if a batch is left short
    kind = {1: (True,), 2: (False,), 3: (True,), 4: (False,), 5: (False,), 6: (True,)}
    got = lines(batches(rows, 4, length, kind))
    assert got == [[2, 4, 5], [6, 1, 3]]
    assert all(len({kind[n] for n in g}) == 1 for g in got)
    # past a window, rows are not moved across it (a line is written once those before it are)
    many = [Row(n) for n in range(1, 2 * WINDOW_BATCHES + 2)]
    lengths = {r.line: -r.line for r in many}
    got = lines(batches(many, 1, lengths, {r.line: () for r in many}))
    assert [g[0] for g in got[:WINDOW_BATCHES]] == list(range(WINDOW_BATCHES, 0, -1))


def test_an_input_run_refuses_a_batch_size_of_0(tmp_path, capsys):
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": "a"}\n')
    assert main(["generate", "--input", str(rows), "--model", MODEL, "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err



EMBEDDED_MAIN = """
import os, sys, torch
from blockpress.cli import main
torch.set_num_threads(2)
def state():
    return (torch.get_num_threads(), os.environ.get("GOMP_SPINCOUNT"),
            [(s.encoding, s.errors) for s in (sys.stdin, sys.stdout, sys.stderr)])
before = state()
code = main(["generate", "def f", "--model", "random-tiny", "--max-new-tokens", "4", "--steps", "2", "--json",
             "--threads", "1"])
after = state()
print("BEFORE", before, file=sys.stderr)
print("AFTER", after, file=sys.stderr)
print("READ", repr(sys.stdin.read()), file=sys.stderr)
sys.exit(code if before == after else 9)
"""


def test_main_in_a_program_s_own_process_leaves_its_threads_environment_and_streams_as_they_were():
    """main() called in-process (a notebook, a tool embedding the CLI) set torch's thread count to --threads, put
    GOMP_SPINCOUNT in the environment every later subprocess inherits, and left stdout writing surrogates as raw bytes
    and stdin reading as utf-8-sig with its line endings translated, for the rest of that program's life."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "PYTHONUTF8")}
    env["PYTHONIOENCODING"] = "utf-8:strict"  # (C.UTF-8 would give surrogateescape: the streams as the user had them)
    done = subprocess.run([sys.executable, "-c", EMBEDDED_MAIN], capture_output=True, env=env, input=b"x\r\ny",
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert "READ 'x\\r\\ny'" in done.stderr.decode()  # the program's own read: its line endings as they came
    streams = "[('utf-8', 'strict'), ('utf-8', 'strict'), ('utf-8', 'backslashreplace')]"
    assert f"BEFORE (2, None, {streams})" in done.stderr.decode()


@pytest.mark.parametrize("flags, refused", [
    (["--top-k", "1"], "--top-k 1: this model's default sampler (greedy) takes the most likely tokens"),
    (["--top-p", "0.5"], "--top-p 0.5: this model's default sampler (greedy)"),
    (["--temperature", "0", "--top-k", "3"], "--top-k 3: --temperature 0.0 takes the most likely tokens"),
    (["--sampler", "greedy", "--top-p", "0.2"], "leave out --sampler greedy and give --temperature above 0"),
    (["--ar", "--top-k", "2"], "--top-k 2: --ar without --temperature takes the most likely tokens"),
    (["--ar", "--temperature", "0", "--top-p", "0.3"], "--top-p 0.3: --ar --temperature 0 takes"),
    (["--temperature", "0.5", "--top-k", "3"], None), (["--ar", "--temperature", "0.5", "--top-k", "3"], None),
    (["--sampler", "entropy_bound", "--top-k", "3"], None), (["--top-k", "0", "--top-p", "1"], None)])
def test_draw_filters_where_nothing_is_drawn_are_refused_by_flag(flags, refused, capsys):
    """blockpress-code decodes greedily, as --ar does without --temperature: --top-k and --top-p ran there with the
    text byte for byte the one without them, and nothing said so (as --temperature with --sampler greedy is refused)."""
    code = main(["generate", "def f", "--max-new-tokens", "2", "--seed", "1", "--no-live", *flags])
    err = capsys.readouterr().err
    if refused is None:
        assert code == 0, err
    else:
        assert code == 2 and refused in err, err


def test_main_in_process_leaves_a_program_s_own_stdin_wrapper_its_line_endings():
    """A program reading stdin through its own TextIOWrapper(newline="") (csv's advice, to keep "\\r\\n") had it
    translating "\\r\\n" to "\\n" after a main() that never read stdin: only Python's own stdin's could be put back."""
    program = "\n".join([
        "import io, sys",
        "from blockpress.cli import main",
        'sys.stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", newline="")',
        'code = main(["generate", "def f", "--model", "random-tiny", "--max-new-tokens", "2", "--steps", "2", "--json"])',
        'print("RESULT", code, repr(sys.stdin.read()), file=sys.stderr)'])
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "PYTHONUTF8")}
    done = subprocess.run([sys.executable, "-c", program], input=b"a,b\r\nc,d\r\n", capture_output=True, env=env,
                          timeout=120)
    assert "RESULT 0 'a,b\\r\\nc,d\\r\\n'" in done.stderr.decode(), done.stderr.decode()[-2000:]


@pytest.mark.parametrize("field, value", [("batch_sizes", [True]), ("canvas_lengths", [True, 16]), ("new_tokens", True),
                                          ("steps", True), ("prompt_length", True), ("repeats", True)])
def test_bench_settings_take_no_bool_for_a_count(field, value):
    """True ran as 1 (batch_sizes=[True, 1] collapsed to [True], written to the JSON as "batch": true), where
    every other count of blockpress is refused as a bool; numpy integers are taken, as plain ints."""
    import numpy as np

    from blockpress.bench import BenchSettings

    with pytest.raises(ValueError, match=f"^{field}: expected (a )?positive integer"):
        BenchSettings(preset="tiny", **{field: value})
    s = BenchSettings(preset="tiny", batch_sizes=[np.int64(2), 1], new_tokens=np.int64(8))
    assert s.batch_sizes == [1, 2] and type(s.batch_sizes[1]) is int and type(s.new_tokens) is int
