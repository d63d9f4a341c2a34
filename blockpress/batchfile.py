"""`blockpress generate --input FILE` and `infill --input FILE`: a JSONL file of prompts (or templates) read and
checked whole, ordered into batches of similar length, and the results written back in input order. Torch-free: the
command runs the model (cli/generate.py, cli/infill.py). The two commands differ only in their lines' keys (a LineKind)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from blockpress.checks import check_text, is_int
from blockpress.files import (
    KeyTwice,
    NotJSONNumber,
    cr_alone_error,
    finite_float,
    one_value_a_key,
    parse_json,
    refuse_non_json_numbers,
    same_place,
    undecodable_byte,
    utf16_note,
)

# Rows are sorted by length within a window of this many batches, not across the whole file: the output is written
# in input order, so a line can only be written once the lines before it are, and a crash or Ctrl-C loses at most
# one window's rows rather than everything after a long first prompt.
WINDOW_BATCHES = 8


@dataclass
class Row:
    """One input line: `prompt` (text to continue, or with --chat the user's message) or `messages` (a
    conversation), its own `max_new_tokens` and `seed` where it gives them, and the keys carried to its output;
    for infill, `template` (text with hole markers) and `prefix` (context before it) in place of the first two."""

    line: int
    prompt: str | None = None
    messages: list[Any] | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    carried: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    prefix: str | None = None


@dataclass(frozen=True)
class LineKind:
    """What a command's lines hold: `input_keys` (read; any other key is carried to its output line unchanged, an
    "id", a label), `output_keys` (written: a line may not carry one, which its output would overwrite), `shape`
    (an example line, for the errors), `what` (the lines' plural, for the errors), `read` (fills a Row's own
    fields from a line's object, its errors naming the field), `given` (a Row's own fields as its output line
    repeats them: --resume checks them against the input's), `added` (keys of `given` that outputs written
    before they were repeated lack: --resume takes such a line on its line number and copied keys, as it did) and
    `unapplied` (keys that name a setting no line reads, -> what gives it: `unapplied_notes`)."""

    input_keys: tuple[str, ...]
    output_keys: tuple[str, ...]
    shape: str
    what: str
    read: Callable[[dict[str, Any], Row, str], None]
    given: Callable[[Row], dict[str, Any]]
    added: tuple[str, ...] = ()
    unapplied: dict[str, str] = field(default_factory=dict)


def _read_prompt(obj: dict[str, Any], row: Row, where: str) -> None:
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f'{where}: expected one of "prompt" (a text) or "messages" (a conversation), got '
                         f"{'both' if 'prompt' in obj else 'neither'}")
    if "prompt" in obj:
        row.prompt = check_text(obj["prompt"], f"{where}: prompt")
    elif not isinstance(obj["messages"], list) or not obj["messages"]:
        raise ValueError(f"{where}: messages: expected a list of messages ({{\"role\": ..., \"content\": ...}}), "
                         f"got {json.dumps(obj['messages'])[:40]}")
    else:
        row.messages = obj["messages"]
    _read_ints(obj, row, where, ("max_new_tokens", "seed"))


def _read_template(obj: dict[str, Any], row: Row, where: str) -> None:
    if "template" not in obj:
        raise ValueError(f'{where}: expected "template" (text with <|hole|> markers), got none')
    if obj.get("max_new_tokens") is not None:  # it would be carried and ignored: the template sets the length
        raise ValueError(f"{where}: max_new_tokens: an infill is as long as its template; size the holes with "
                         "<|hole:N|> or --hole-length")
    row.template = check_text(obj["template"], f"{where}: template")
    if obj.get("prefix") is not None:
        row.prefix = check_text(obj["prefix"], f"{where}: prefix")
    _read_ints(obj, row, where, ("seed",))


def _read_ints(obj: dict[str, Any], row: Row, where: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        least = 1 if key == "max_new_tokens" else 0
        value = obj.get(key)
        if value is not None and (not is_int(value) or not least <= value < 2**63):
            # (a value past int64 must not be told it should be "at least 1", which it is)
            what = "below 2**63" if is_int(value) and value >= least else f"of at least {least}"
            raise ValueError(f"{where}: {key}: expected an integer {what}, got {json.dumps(value)}")
        setattr(row, key, value)


def _run_wide(*names: str, flags: dict[str, str]) -> dict[str, str]:
    """Run settings that a line might give for itself, each -> how to give it: the run's flag (`flags`: a name's
    own, where it is not --NAME)."""
    return {name: f"{flags.get(name, '--' + name.replace('_', '-'))} sets it for the whole run (lines that need "
                  "another value go in a file of their own)" for name in names}


# Keys a line may give that name a setting no line reads (the run's flags set it). They are copied to the output line
# as any other key is (a dataset's own fields, "prompt" and "suffix" of an infilling benchmark, say), but said to be
# not applied: beside the run's settings each would look applied (a line's "stop", and its text running past it).
SAMPLING_KEYS = ("steps", "max_denoising_steps", "sampler", "entropy_bound", "confidence", "rank_by", "t_max", "t_min",
                 "temperature", "draw_temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty",
                 "token_healing", "no_token_healing")
SAMPLING_FLAGS = {"max_denoising_steps": "--steps", "token_healing": "--token-healing / --no-token-healing",
                  "no_token_healing": "--no-token-healing", "draw_temperature": "--temperature"}
# OpenAI's and transformers' names for a line's own length
BUDGETS = dict.fromkeys(("max_tokens", "max_completion_tokens", "max_length"), 'a line\'s own budget is "max_new_tokens" here')
# A line is one completion: the library's and the server's names for several samples of one prompt
SAMPLES = dict.fromkeys(("n", "num_return_sequences", "seeds"),
                        'a line makes one completion: for several samples of a prompt, repeat its line, each with its '
                        'own "seed"')


def _own_seed(row: Row) -> dict[str, Any]:
    """A line's own seed, as its output line holds it (the seed it was drawn with): a seed edited in the input was
    taken as done with the old one. (A line without one is drawn with --seed's, which the settings check, or afresh.)"""
    return {"seed": row.seed} if row.seed is not None else {}


GENERATE = LineKind(
    input_keys=("prompt", "messages", "max_new_tokens", "seed"),
    output_keys=("line", "text", "reasoning", "prompt", "messages", "max_new_tokens", "new_tokens", "forward_passes",
                 "tokens_per_forward", "seed", "settings"),
    shape='{"prompt": "..."} or {"messages": [...]}', what="prompts", read=_read_prompt,
    # a messages line's output repeats its messages as a prompt line's repeats its prompt (it repeated nothing, so
    # --resume could not tell another conversation's output line from this one's), and its own max_new_tokens
    given=lambda row: {"prompt": row.prompt, "messages": row.messages, "max_new_tokens": row.max_new_tokens,
                       **_own_seed(row)}, added=("messages", "max_new_tokens"),
    unapplied={**_run_wide(*SAMPLING_KEYS, "min_new_tokens", "min_tokens", "stop", "stop_strings", "stop_sequences",
                           "chat_template_kwargs", flags={**SAMPLING_FLAGS, "min_tokens": "--min-new-tokens",
                                                          "stop_strings": "--stop", "stop_sequences": "--stop"}),
               "system": 'a "messages" line\'s own system message, or --system for the whole run, sets it',
               **BUDGETS, **SAMPLES})
INFILL = LineKind(
    input_keys=("template", "prefix", "seed", "max_new_tokens"),
    output_keys=("line", "text", "fills", "template", "prefix", "new_tokens", "template_tokens", "filled_tokens",
                 "forward_passes", "tokens_per_forward", "seed", "settings"),
    shape='{"template": "... <|hole|> ..."}', what="templates", read=_read_template,
    given=lambda row: {"template": row.template, "prefix": row.prefix, **_own_seed(row)},
    unapplied={**_run_wide(*SAMPLING_KEYS, flags={**SAMPLING_FLAGS, "token_healing": "--no-token-healing"}),
               "hole_length": "<|hole:N|> in the template sizes a hole, or --hole-length every bare one",
               "prompt": 'the context before a template is a line\'s "prefix" here', **BUDGETS, **SAMPLES})


def read_rows(name: str, data: bytes, kind: LineKind = GENERATE) -> list[Row]:
    """Every non-blank line of the JSONL `data` (the file `name`) as a Row of `kind`; the first bad line is a
    ValueError naming NAME:LINE and its field, so no generation starts on a file that would fail part way."""
    rows = []
    # a byte-order mark (Notepad's "UTF-8 with BOM") is no part of the first line, as training's JSONL reading takes it
    mark = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    data = data[mark:]
    for number, raw in enumerate(data.split(b"\n"), 1):
        where = f"{name}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # (the first line's byte counted in the file, its mark too, as training's)
            raise ValueError(f"{where}: not UTF-8 ({undecodable_byte(exc, mark if number == 1 else 0)})"
                             f"{utf16_note(data[:2]) or _utf16_unmarked_note(data)}") from None
        if not text.strip():
            continue
        try:
            obj = parse_json(text, object_pairs_hook=one_value_a_key, parse_constant=refuse_non_json_numbers,
                             parse_float=finite_float)
        except json.JSONDecodeError as exc:
            note = _utf16_unmarked_note(data)
            if note:  # (before cr_alone_error: UTF-16's CRLF, "\r\0\n\0", leaves a CR inside the line it splits)
                raise ValueError(f"{where}: not JSON ({exc.msg}, column {exc.colno}){note}") from None
            raise (_one_document(name, data) or cr_alone_error(where, raw)
                   or ValueError(f"{where}: not JSON ({exc.msg}, column {exc.colno})")) from None
        except KeyTwice as exc:  # json.loads keeps the last value: the first prompt (or id, ...) would be silently lost
            raise exc.said_at(where) from None
        except NotJSONNumber as exc:  # Python writes it back as it came, and no JSON reader takes the output then
            raise ValueError(f"{where}: {exc.args[0]}; write null or a string instead") from None
        if not isinstance(obj, dict):
            raise _one_document(name, data) or ValueError(f"{where}: expected an object {kind.shape}, got "
                                                          f"{type(obj).__name__}")
        rows.append(_row(obj, number, where, kind))
    if not rows:
        raise ValueError(f"{name}: no lines to generate from (every line is blank)")
    return rows


def _one_document(name: str, data: bytes) -> ValueError | None:
    """The error for a file that is one JSON document (a list of lines, a .json file, pretty-printed across lines)
    rather than JSON Lines, None for any other: its first line was refused as 'not JSON (Expecting value, column
    2)', which said nothing of why."""
    try:
        # the text as read_rows decoded it: json.loads(bytes) detects UTF-16 and UTF-32 by itself, so a one-line
        # UTF-16 file without a byte-order mark was called an object across several lines
        whole = parse_json(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(whole, list):
        what, jq = f"a list of {len(whole)} item{'' if len(whole) == 1 else 's'}", "jq -c '.[]'"
    elif isinstance(whole, dict):  # (an object on one line is a line: this is one across several)
        what, jq = "an object across several lines", "jq -c ."
    else:
        return None
    return ValueError(f"{name}: is one JSON document ({what}), not JSON Lines: give each object a line of its own "
                      f"({jq} writes them so)")


def _utf16_unmarked_note(data: bytes) -> str:
    """utf16_note for a file of UTF-16 without a byte-order mark (iconv -t UTF-16LE, .NET's Encoding.Unicode): "" but
    for one whose first line, the file read as UTF-16 (little- or big-endian), is a JSON object. Read as UTF-8 its
    ASCII decodes, NULs and all ('not JSON' with no word of why), and its other text is bytes that are no UTF-8.
    The whole file, not the line read_rows split: a character with a 0x0A byte (\u4e0a, \u040a) is cut in two by
    the split at b"\\n"."""
    if b"\x00" not in data:
        return ""
    for cut in (data, data[1:]):
        cut = cut[: len(cut) // 2 * 2]
        for codec in ("utf-16-le", "utf-16-be"):
            try:
                first = next((line for line in cut.decode(codec).splitlines() if line.strip()), "")
                obj = parse_json(first)
            except (UnicodeDecodeError, ValueError):
                continue
            if isinstance(obj, dict):
                return "; it is UTF-16 (read so, without a byte-order mark, it is a JSON object): save it as UTF-8"
    return ""


def _row(obj: dict[str, Any], number: int, where: str, kind: LineKind) -> Row:
    row = Row(number, carried={k: v for k, v in obj.items() if k not in kind.input_keys})
    kind.read(obj, row, where)
    clash = [k for k in row.carried if k in kind.output_keys]
    if clash:
        raise ValueError(f"{where}: {clash[0]}: a key the output line writes ({', '.join(kind.output_keys)}); "
                         "rename it")
    return row


def unapplied_notes(name: str, rows: list[Row], kind: LineKind = GENERATE) -> list[str]:
    """A line for each key of `kind.unapplied` that the lines of `name` give (not null): copied to the output lines,
    not applied, and what sets it; said before a run, so a dataset's "stop" or "temperature" does not look used."""
    notes = []
    for key, how in kind.unapplied.items():
        first = next((row.line for row in rows if row.carried.get(key) is not None), None)
        if first is not None:
            notes.append(f"{name}:{first}: {key}: copied to the output lines as it is, not applied; {how}")
    return notes


def read_input(path: str, kind: LineKind = GENERATE) -> tuple[str, list[Row]]:
    """--input's rows, and the name its errors use ("-": standard input, named so)."""
    if path == "-":
        return "<stdin>", read_rows("<stdin>", sys.stdin.buffer.read(), kind)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:  # (a bare "[Errno 2] No such file or directory: 'x'" named no flag)
        what = "is a folder" if Path(path).is_dir() else exc.strerror or str(exc)
        raise ValueError(f"--input {path}: {what} (expected a JSONL file of {kind.what}, or - for standard "
                         "input)") from None
    return path, read_rows(path, data, kind)


def check_output(output: Path, input_path: str, kind: LineKind = GENERATE) -> None:
    """--output's path, checked before the model loads: not a folder, in a folder that exists, and not the --input
    file itself (opened to write, with --overwrite, it emptied the prompts once read; the run then wrote its output
    over them)."""
    if output.is_dir():
        raise ValueError(f"--output {output}: is a folder; give a file to write the output lines to")
    if output.parent.exists() and not output.parent.is_dir():  # (not "the folder ... does not exist")
        raise ValueError(f"--output {output}: {output.parent} is a file, not a folder")
    if not output.parent.is_dir():
        raise ValueError(f"--output {output}: the folder {output.parent} does not exist")
    # a read-only disk or another user's folder: else found by the first write, once the model has loaded (minutes for
    # a large one). A file there that can be written (--resume, --overwrite) is written in place.
    if not os.access(output if output.exists() else output.parent, os.W_OK):
        raise ValueError(f"--output {output}: cannot be written (its folder {output.parent} or the file is "
                         "read-only, or not yours)")
    if input_path != "-" and same_place(output, input_path):
        raise ValueError(f"--output {output}: is the --input file; write the output to another file (it would "
                         f"replace the {kind.what})")


def done_lines(path: Path, rows: list[Row], kind: LineKind = GENERATE) -> set[int]:
    """The input lines an existing output already holds (--resume). A last line cut short (the run stopped while
    writing it) is dropped from the file, to be written again (one whole but for its newline gets it), once every
    other line is read as this input's output: any line that is not an output line is an error naming it, and so is
    a line number the input does not have (the output of another file), and the file is left as it was."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    cut = newline = False
    if lines and lines[-1] and not data.endswith(b"\n"):
        try:
            parse_json(lines[-1])
        except (json.JSONDecodeError, UnicodeDecodeError):
            cut, lines = True, lines[:-1]
        else:  # a whole line without its newline (cut just before it, or an editor's save): the first line
            # appended would run on from it, two objects on one line
            newline = True
    done = _output_lines(path, lines, rows, kind)
    # only now: a file that is no output (--output notes.txt by mistake) would lose its last line to the cut,
    # then be refused
    if cut:
        with path.open("r+b") as f:  # the partial line goes; the rest is kept as written
            f.truncate(len(data) - len(data.split(b"\n")[-1]))
    if newline:
        with path.open("ab") as f:
            f.write(b"\n")
    return done


def _output_lines(path: Path, lines: list[bytes], rows: list[Row], kind: LineKind) -> set[int]:
    """done_lines' reading of the output's whole `lines`: the input lines they hold, each checked."""
    known = {r.line: r for r in rows}
    done: dict[int, int] = {}  # each input line's output line
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = parse_json(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path}:{number}: not an output line (not JSON); --resume reads the output a run "
                             "wrote") from None
        if not isinstance(obj, dict) or not is_int(obj.get("line")):
            raise ValueError(f"{path}:{number}: not an output line (no \"line\" number); --resume reads the output "
                             "a run wrote")
        if obj["line"] not in known:
            raise ValueError(f"{path}:{number}: line {obj['line']}: the input has no such line to generate from "
                             "(is this the output of another input file?)")
        # the prompt (template) and the copied keys, as the input line gives them: the same line number in another
        # file's output would be taken as done, and its text kept under this file's line
        row = known[obj["line"]]
        # (a line that records its settings was written since every key of `added` was: each is checked)
        given = {k: v for k, v in {**kind.given(row), **row.carried}.items()
                 if k in obj or k not in kind.added or "settings" in obj}
        other = [k for k in (*given, *sorted(set(obj) - set(kind.output_keys))) if obj.get(k) != given.get(k)]
        if other:
            raise ValueError(f"{path}:{number}: line {obj['line']}: its {other[0]} is not the input line's (was the "
                             "input line edited, or is this the output of another input file?)")
        if obj["line"] in done:  # (two outputs put together): the file would end with the line twice
            raise ValueError(f"{path}:{number}: line {obj['line']}: written already, at {path}:{done[obj['line']]}; an "
                             "output holds each input line once")
        done[obj["line"]] = number
    return set(done)


def recorded_settings(path: Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, the settings it was made with) for each line of the output `path`: None for a line written
    before output lines recorded them; settings that are no object are refused, naming the line."""
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        held = parse_json(raw).get("settings")
        if held is not None and not isinstance(held, dict):
            raise ValueError(f"{path}:{number}: settings: expected an object of the settings the line was made with, "
                             f"got {json.dumps(held)[:40]}")
        yield number, held


def check_settings(path: Path, settings: dict[str, Any], flag: Callable[[str], str],
                   recorded: Callable[[str, Any], Any] = lambda key, value: value, skip: Collection[str] = ()) -> int:
    """--resume's check that every line of the output `path` (done_lines has read it) was made with this run's
    `settings` (the flags that change what a row gets, as its output lines record them): the first line made
    otherwise is refused by the first setting that differs, named by its `flag` with both values, so a resumed file
    never holds lines made two ways. The count of lines written before output lines recorded their settings (taken
    unchecked, as they were).
    `recorded(key, value)`: a held value as this run would record it (a --model folder typed otherwise in lines of
    before: by where it is). `skip`: settings not compared, this run's not known yet (a dtype the load decides)"""
    wanted = json.loads(json.dumps(settings))  # as a line holds them (a tuple as a list, a float as JSON reads it)
    unchecked = 0
    for number, held in recorded_settings(path):
        if held is None:
            unchecked += 1
            continue
        held = {key: recorded(key, value) for key, value in held.items()}
        for key in [*wanted, *(k for k in held if k not in wanted)]:
            if key not in skip and held.get(key) != wanted.get(key):
                raise ValueError(f"{flag(key)}: {path}:{number} was written {_with(held, key)}, this run "
                                 f"{_asks(wanted, key)}; resume with the flags the output was made with, or give "
                                 "--overwrite to start it again")
    return unchecked


def _with(settings: dict[str, Any], key: str) -> str:
    return "without it" if key not in settings else "with it" if settings[key] is True else \
        f"with {_shown(settings[key])}"


def _asks(settings: dict[str, Any], key: str) -> str:
    return "is without it" if key not in settings else "asks for it" if settings[key] is True else \
        f"asks {_shown(settings[key])}"


def _shown(value: Any) -> str:
    """A setting's value as a shell takes it (a model's path, a --system text), else as JSON (a --stop list)."""
    if isinstance(value, str):
        return shlex.quote(value) if value.isprintable() else json.dumps(value)
    return json.dumps(value)


def batches(rows: list[Row], size: int, length: dict[int, int], kind: dict[int, tuple[Any, ...]]) -> Iterator[list[Row]]:
    """`rows` in batches of at most `size`, each window of WINDOW_BATCHES batches sorted by prompt `length` (by
    line number) so a batch's rows pad little. `kind`: what rows of one call must share (chat or not: healing is
    a call's; a seed of their own or not): a batch never mixes kinds, so one may be smaller than `size`."""
    window = size * WINDOW_BATCHES
    for start in range(0, len(rows), window):
        ordered = sorted(rows[start:start + window], key=lambda r: (kind[r.line], length[r.line], r.line))
        batch: list[Row] = []
        for row in ordered:
            if batch and (len(batch) == size or kind[batch[0].line] != kind[row.line]):
                yield batch
                batch = []
            batch.append(row)
        if batch:
            yield batch


class InOrderWriter:
    """Output lines written in input order as soon as every line before them is (and flushed at once): a batch's
    results come out of order, sorted by length."""

    def __init__(self, out: IO[str], order: list[int]) -> None:
        self.out, self.order, self.next = out, order, 0
        self.waiting: dict[int, str] = {}  # lines done before the ones ahead of them, as their JSON
        self.written = 0

    def add(self, line: int, obj: dict[str, Any]) -> None:
        self.waiting[line] = json.dumps(obj)  # as generate --json writes its object
        while self.next < len(self.order) and self.order[self.next] in self.waiting:
            self.out.write(self.waiting.pop(self.order[self.next]) + "\n")
            self.next += 1
            self.written += 1
        self.out.flush()
