"""Parse a chat model's reply into a message (content, reasoning, tool calls) with a declarative response template.

A checkpoint may ship a `response_template` in tokenizer_config.json, the format transformers 5 reads for
`tokenizer.parse_response`: regions of the reply ("fields") that open and close at literal markers or regex
patterns, each parsed as text, a number, JSON (with dialect knobs for tool-call syntaxes such as Gemma 4's), shallow
XML (each value read by a parser of its own, or by one a group of its tag picks), key-value lines or a Python-style
list of calls by keyword (`[f(city="Paris")]`), and optionally reshaped by a transform. For example (Gemma 4's tool
calls):

    {"start_anchor": "<|turn>model\\n", "defaults": {"role": "assistant"},
     "fields": {"tool_calls": {"open_pattern": "<\\\\|tool_call>call:(?P<name>\\\\w+)", "close": "<tool_call|>",
                               "repeats": true, "content": "json",
                               "content_args": {"unquoted_keys": true, "string_delims": [["<|\\"|>", "<|\\"|>"]]},
                               "transform": {"type": "function", "function": {"name": "{name}",
                                                                              "arguments": "{content}"}}},
                "content": {"close": ["<turn|>", "<eos>"]}}}

The field with no opening marker collects the text outside every other region (here the reply's content). Parsing
gives the same message as transformers' `parse_response` for the same template, prompt and reply. A reply still
being written is read by the same scan (`parse_partial`): what it has settled so far, the regions it has closed and
the open region's text short of a tail where a marker may yet begin, as transformers' stream parser holds it back;
a stream reads it chunk after chunk with a PartialReader, which reads on from where its last read stopped.
Patterns are compiled as transformers compiles them, with the `regex` module (its default syntax is Python `re`'s,
and it also knows `\\p{...}` classes). They are the checkpoint maker's, and one with nested repeats (`(a|a)*`,
`(\\w|\\w\\w)+`) backtracks for hours on a reply of 40 characters that almost matches it: one read of a reply may
spend RESPONSE_PATTERN_SECONDS in them, and all the reads of one reply together (a stream's read at each chunk and
its last parse_response) RESPONSE_PATTERN_TOTAL_SECONDS, past which it is refused (PatternTooCostly).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os.path
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import regex

if TYPE_CHECKING:  # typeshed has these modules under their names before 3.11 only (sre_parse warns on import since)
    import sre_constants
    import sre_parse as sre_parser
else:
    from re import _constants as sre_constants  # (the stdlib's own regex parser: a pattern's literal start)
    from re import _parser as sre_parser

from .files import parse_json

TEMPLATE_KEYS = frozenset({"version", "defaults", "fields", "start_anchor", "start_anchor_pattern"})
FIELD_KEYS = frozenset({"open", "open_pattern", "close", "close_pattern", "content", "content_args", "repeats", "join",
                        "optional", "transform", "transform_each"})
# A transform's string that is one placeholder, {name} or {name.key.key}: replaced by that value (any type).
PLACEHOLDER = re.compile(r"\{(\w+(?:\.\w+)*)\}")
# Control characters stand in for the custom-delimited strings while the json dialect is rewritten into JSON.
STASH_OPEN, STASH_CLOSE = "\x01", "\x02"
STASHED = re.compile(re.escape(STASH_OPEN) + r"(\d+)" + re.escape(STASH_CLOSE))
# What the template's patterns may take: one read of a reply (a parse_response, or a stream's parse_partial of the
# reply so far), and all the reads of one reply together (PatternBudget). A real template's patterns read a reply in
# milliseconds: streamed in chunks of 8 characters, a reply of 16,000 takes 0.03 s of Gemma 4's in all and 0.17 s of
# Qwen 3.5's when each chunk reads the reply again, growing with its length squared, so the total allows a reply 7
# times that long read so; a PartialReader of a template whose markers settle (Gemma 4's) searches each chunk's
# text once. The server reads replies on its event loop: these are also the longest it stops answering for them.
RESPONSE_PATTERN_SECONDS = 1.0
RESPONSE_PATTERN_TOTAL_SECONDS = 10.0
T = TypeVar("T")
# A marker: the template's regex (`regex`, searched within a PatternBudget), or its literal texts (`re`).
Marker = re.Pattern[str] | regex.Pattern[str]


class PatternTooCostly(ValueError):
    """A response template's patterns that ran past their time reading a reply (PatternBudget)."""


@dataclass
class PatternBudget:
    """The time the template's patterns may take reading one reply: `seconds` a read, `total` all its reads
    together. A stream gives its reads (a PartialReader's) and its last parse_response one budget. Each search gets what
    is left as the `regex` module's timeout, which counts the process's CPU time, and spends the clock's time it
    took (on a loaded machine, more: the next search then finds less left). A read that runs out is refused
    (PatternTooCostly), and so is every later read of the reply, at once and with the same words (a pattern that
    ran out on the reply so far would run out on its longer text too)."""

    seconds: float = RESPONSE_PATTERN_SECONDS
    total: float = RESPONSE_PATTERN_TOTAL_SECONDS
    spent: float = 0.0
    read_from: float = 0.0  # `spent` when this read began (begin_read)
    refused: str | None = None  # why it ran out, said again by every later read

    def begin_read(self) -> None:
        self.read_from = self.spent

    def run(self, where: str, pattern: regex.Pattern[str], search: Callable[[float], T]) -> T:
        """`search(timeout)` with what is left of the budget; PatternTooCostly naming `where`, the pattern and the
        limit when that runs out."""
        read_left, total_left = self.seconds - (self.spent - self.read_from), self.total - self.spent
        if read_left <= total_left:
            limit = f"the {self.seconds:g} s that one read of a reply may take (RESPONSE_PATTERN_SECONDS)"
        else:
            limit = (f"the {self.total:g} s that all the reads of one reply may take together "
                     "(RESPONSE_PATTERN_TOTAL_SECONDS)")
        if self.refused is None and min(read_left, total_left) <= 0:
            self.refused = (f"{where}: the pattern {pattern.pattern!r:.120} was not run, as the template's patterns "
                            f"before it spent {limit}")
        if self.refused is not None:
            raise PatternTooCostly(self.refused)
        start = time.monotonic()
        try:
            return search(min(read_left, total_left))
        except TimeoutError:
            self.refused = (f"{where}: the pattern {pattern.pattern!r:.120} ran past {limit}; nested repeats such as "
                            "(a|a)* or (\\w|\\w\\w)+ backtrack without end on text that almost matches them")
            raise PatternTooCostly(self.refused) from None
        finally:
            self.spent += time.monotonic() - start

    def search(self, where: str, pattern: Marker, text: str,
               pos: int = 0) -> re.Match[str] | regex.Match[str] | None:
        """pattern.search(text, pos): the template's regex within the budget, a literal marker (re) as it is."""
        if isinstance(pattern, re.Pattern):
            return pattern.search(text, pos)
        return self.run(where, pattern, lambda timeout: pattern.search(text, pos, timeout=timeout))

    def finditer(self, where: str, pattern: Marker, text: str) -> list[re.Match[str]] | list[regex.Match[str]]:
        """pattern.finditer(text), all of it, as `search`."""
        if isinstance(pattern, re.Pattern):
            return list(pattern.finditer(text))
        return self.run(where, pattern, lambda timeout: list(pattern.finditer(text, timeout=timeout)))


# Gemma 4's reply markers: its turns, thinking channel and tool calls. Each is one special token of its tokenizer
# (decode leaves them out of a reply's text by default), so a tokenizer that has every one as a special token writes
# Gemma 4's replies (DiffusionGemma's checkpoints share its tokenizer); no other tokenizer has them.
GEMMA4_MARKERS = ("<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>")


def gemma4_response_template() -> dict[str, Any]:
    """A response template for Gemma 4's replies, a new dict each call: an optional thought,
    <|channel>thought\n...<channel|>, the content, and calls <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>
    (bare keys, strings between <|"|> markers), the turn ending at <turn|> (or <|tool_response>, where the model waits
    for a tool's answer, or <eos>). Real Gemma 4 and DiffusionGemma checkpoints ship no response_template (one has
    only the legacy response_schema, which is not read), so their replies would not be read without it; transformers'
    server falls back to its own for the "gemma4" model type, and reads a reply as this does."""
    return {
        "defaults": {"role": "assistant"},
        # the model's turn; after a tool's answer the model goes on in the same turn, with no new header
        "start_anchor": ["<|turn>model\n", "<tool_response|>"],
        "fields": {
            "reasoning_content": {"open": "<|channel>thought\n", "close": "<channel|>"},
            "tool_calls": {
                "open_pattern": r"<\|tool_call>call:(?P<name>\w+)",
                "close": "<tool_call|>",
                "repeats": True,
                "content": "json",
                "content_args": {"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
            },
            "content": {"close": ["<turn|>", "<|tool_response>", "<eos>"]},
        },
    }


def regions_only(template: ResponseTemplate) -> ResponseTemplate:
    """The template with each field that makes a value of its text (json, a transform, ...) keeping it as text: the
    same regions, opened and closed at the same markers, read whatever their text holds (a malformed call reads),
    for where a reply's regions are (PartialMessage.opened_at, closed_at)."""
    fields = {name: f if f.content == "text" and f.transform is None
              else dataclasses.replace(f, content="text", content_args={}, transform=None, transform_each=False)
              for name, f in template.fields.items()}
    return dataclasses.replace(template, fields=fields)


def builtin_response_template(is_special: Callable[[str], bool]) -> dict[str, Any] | None:
    """The response template for a tokenizer whose checkpoint ships none, by the special tokens it has
    (`is_special(text)`: the text is one special token of it): Gemma 4's where every one of GEMMA4_MARKERS is one;
    None otherwise (the replies are text). A checkpoint's own response_template always wins over this."""
    return gemma4_response_template() if all(is_special(marker) for marker in GEMMA4_MARKERS) else None


def reads_thoughts(spec: Mapping[str, Any] | None) -> bool:
    """Whether a response template (spec) has a `reasoning_content` field: replies read with it give their thought
    apart from the answer (the server's reasoning_content, the chat command's dimmed thought)."""
    return spec is not None and "reasoning_content" in spec.get("fields", {})


def reasoning_markers(spec: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """The literal texts a response template's `reasoning_content` field opens and closes with (the first of each
    list: what the model writes), e.g. Gemma 4's ("<|channel>thought\n", "<channel|>"); None where the template has
    no such field, or marks it with patterns (which say how to read a thought, not how to write one)."""
    field = (spec or {}).get("fields", {}).get("reasoning_content")
    if not isinstance(field, Mapping):
        return None
    opens, closes = _marker_texts(field, "open"), _marker_texts(field, "close")
    if not (opens and closes and isinstance(opens[0], str) and isinstance(closes[0], str)):
        return None
    return opens[0], closes[0]


@dataclass(frozen=True, kw_only=True)  # (16 fields, several pairs of one type: by name, none can swap)
class Field:
    """One region of a reply, compiled."""

    name: str
    open: Marker | None  # None: the implicit field, open wherever no other region is
    close: Marker | None  # None: it runs to the next region's opening (or the reply's end)
    # Each marker's literal texts (None: a pattern), which tell a growing reply's tail that may yet become one
    open_texts: tuple[str, ...] | None
    close_texts: tuple[str, ...] | None
    content: str
    content_args: dict[str, Any]
    repeats: bool  # every occurrence is kept, in a list (or joined into one string with `join`)
    join: str | None
    optional: bool
    transform: Any
    transform_each: bool
    # The non-empty literal texts each marker's matches start with (its texts, or a pattern's _pattern_heads), read
    # once here: a growing reply's tail that may begin one is held back (_pending)
    open_heads: tuple[str, ...] = ()
    close_heads: tuple[str, ...] = ()
    # The one-character items (op, arg) of the optional repeats a marker's pattern starts with before its literal
    # head (Qwen's \s* before <tool_call>): a run of the characters they take before a head's possible start may be
    # the match's start, so a read that goes on holds its searches back to the run's start (_lead_start)
    open_lead: tuple[tuple[Any, Any], ...] = ()
    close_lead: tuple[tuple[Any, Any], ...] = ()


@dataclass(frozen=True)
class ResponseTemplate:
    """A response template, checked and compiled (`compile_template`)."""

    start_anchor: Marker  # where the assistant's message starts in the prompt: the parse begins after its last
    fields: dict[str, Field]
    implicit: str | None
    defaults: dict[str, Any]
    # Every region marker is literal text or a pattern whose match more text cannot change (_settles): a growing
    # reply's read (PartialReader) then goes on from where the last one stopped instead of reading it all again.
    resumable: bool = False


def compile_template(spec: Any) -> ResponseTemplate:
    """Check a response template (the JSON object) and compile its patterns; bad input is a ValueError naming the
    key."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"response_template: expected a JSON object, got {type(spec).__name__}")
    if spec.get("version", 1) != 1:
        raise ValueError(f"response_template.version: only version 1 is known, got {spec['version']!r}")
    if unknown := sorted(set(spec) - TEMPLATE_KEYS):
        raise ValueError(f"response_template: unknown keys {unknown} (expected some of {sorted(TEMPLATE_KEYS)})")
    defaults = spec.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ValueError(f"response_template.defaults: expected an object, got {type(defaults).__name__}")
    raw_fields = spec.get("fields")
    if not isinstance(raw_fields, dict) or not raw_fields:
        raise ValueError("response_template.fields: expected a non-empty object of fields by name")
    fields = {name: _compile_field(name, raw) for name, raw in raw_fields.items()}
    implicit = [name for name, f in fields.items() if f.open is None]
    if len(implicit) > 1:
        raise ValueError(f"response_template.fields: only one field may have no open / open_pattern (the one that "
                         f"takes the text outside the others), got {implicit}")
    anchor = _marker(spec, "start_anchor", "start_anchor_pattern", "response_template")
    if anchor is None:
        raise ValueError("response_template: needs start_anchor (text) or start_anchor_pattern (a regex): where the "
                         "assistant's message starts in the prompt")
    resumable = all(marker is None or isinstance(marker, re.Pattern) or _settles(marker.pattern)
                    for f in fields.values() for marker in (f.open, f.close))
    return ResponseTemplate(anchor, fields, implicit[0] if implicit else None, copy.deepcopy(defaults), resumable)


def _compile_field(name: str, raw: Any) -> Field:
    where = f"response_template.fields.{name}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {type(raw).__name__}")
    if unknown := sorted(set(raw) - FIELD_KEYS):
        raise ValueError(f"{where}: unknown keys {unknown} (expected some of {sorted(FIELD_KEYS)})")
    content = raw.get("content", "text")
    if content not in CONTENT_PARSERS:
        raise ValueError(f"{where}.content: expected one of {sorted(CONTENT_PARSERS)}, got {content!r}")
    args = raw.get("content_args", {})
    if not isinstance(args, dict):
        raise ValueError(f"{where}.content_args: expected an object, got {type(args).__name__}")
    repeats, join, each = raw.get("repeats", False), raw.get("join"), raw.get("transform_each", False)
    if join is not None and not isinstance(join, str):
        raise ValueError(f"{where}.join: expected a string, got {type(join).__name__}")
    if join is not None and not repeats:
        raise ValueError(f"{where}.join: only with \"repeats\": true (it joins the occurrences)")
    if not isinstance(each, bool):
        raise ValueError(f"{where}.transform_each: expected true or false, got {each!r}")
    transform = raw.get("transform")
    if each and transform is None:
        raise ValueError(f"{where}.transform_each: set, but the field has no transform")
    opener = _marker(raw, "open", "open_pattern", where)
    closer = _marker(raw, "close", "close_pattern", where)
    if transform is None:
        captured = sorted({*(opener.groupindex if opener else ()), *(closer.groupindex if closer else ())})
        if captured:  # only a transform can put a capture into the message: without one it would vanish
            raise ValueError(f"{where}: its patterns capture {captured}, which only a transform can use; add a "
                             "transform (e.g. {\"name\": \"{name}\", \"arguments\": \"{content}\"}) or drop the names")
    else:
        _check_transform(transform, f"{where}.transform")
    open_texts, close_texts = _marker_texts(raw, "open"), _marker_texts(raw, "close")
    return Field(name=name, open=opener, close=closer, open_texts=open_texts, close_texts=close_texts,
                 content=content, content_args=args, repeats=bool(repeats), join=join,
                 optional=bool(raw.get("optional", True)), transform=transform, transform_each=each,
                 open_heads=_heads(opener, open_texts), close_heads=_heads(closer, close_texts),
                 open_lead=_lead(opener, open_texts), close_lead=_lead(closer, close_texts))


def _heads(marker: Marker | None, texts: tuple[str, ...] | None) -> tuple[str, ...]:
    """The non-empty literal texts a marker's matches start with: its texts, or its pattern's _pattern_heads."""
    if marker is None:
        return ()
    return tuple(head for head in (texts or _pattern_heads(marker.pattern)) if head)


def _lead(marker: Marker | None, texts: tuple[str, ...] | None) -> tuple[tuple[Any, Any], ...]:
    """The one-character items of the optional repeats a pattern marker starts with (_pattern_items); none for
    literal texts."""
    if marker is None or texts is not None:
        return ()
    items = _pattern_items(marker.pattern)
    return () if items is None else tuple(arg[2][0] for _, arg in items[: _leading_repeats(items)])


def _marker_texts(spec: Mapping[str, Any], literal: str) -> tuple[str, ...] | None:
    """A marker's literal texts, as `_marker` checked them (None: given as a pattern, or not at all)."""
    texts = spec.get(literal)
    return None if texts is None else tuple([texts] if isinstance(texts, str) else texts)


def _marker(spec: Mapping[str, Any], literal: str, pattern: str, where: str) -> Marker | None:
    """A region's marker as a pattern: literal text, a list of alternative texts, or a regex (DOTALL)."""
    if literal in spec and pattern in spec:
        raise ValueError(f"{where}: give {literal} or {pattern}, not both")
    if pattern in spec:
        try:
            return regex.compile(spec[pattern], regex.DOTALL)
        except (regex.error, TypeError) as exc:
            raise ValueError(f"{where}.{pattern}: not a valid regular expression: {exc}") from None
    if literal not in spec:
        return None
    texts = spec[literal]
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{where}.{literal}: expected a non-empty string or a non-empty list of them, got "
                         f"{spec[literal]!r:.80}")
    # Longest first: where two alternatives match at one place, the longer one is the marker.
    ordered = sorted(dict.fromkeys(texts), key=len, reverse=True)
    # (blockpress's own pattern of escaped texts, which cannot backtrack: re, faster, and searched without a limit)
    return re.compile("|".join(map(re.escape, ordered)), re.DOTALL)


def _check_transform(transform: Any, where: str) -> None:
    """A transform's strings are a whole placeholder or plain text: "{name}" is a value, "id-{name}" is refused."""
    if isinstance(transform, dict):
        for key, value in transform.items():
            _check_transform(value, f"{where}.{key}")
    elif isinstance(transform, list):
        for i, value in enumerate(transform):
            _check_transform(value, f"{where}[{i}]")
    elif isinstance(transform, str) and PLACEHOLDER.search(transform) and not PLACEHOLDER.fullmatch(transform):
        raise ValueError(f"{where}: {transform!r} mixes a {{placeholder}} with text; a string is either one "
                         "placeholder or plain text")


# -- content parsers: a region's text -> its value -------------------------------------------------------------


def _text(text: str, args: dict[str, Any], budget: PatternBudget | None = None) -> str:
    return text.strip() if args.get("strip", True) else text


def _json(text: str, args: dict[str, Any], budget: PatternBudget) -> Any:
    """JSON, or a model's dialect of it: `string_delims` [[open, close], ...] mark strings that are not quoted
    (Gemma 4 writes <|"|>text<|"|>), `unquoted_keys` allows {key:1}, `allow_non_json` keeps unparseable text."""
    delims = args.get("string_delims", [])
    if delims and (STASH_OPEN in text or STASH_CLOSE in text):
        raise ValueError("json: the text holds the control characters \\x01 / \\x02 that custom string delimiters "
                         "are rewritten through")
    strings: list[str] = []

    def stash(match: re.Match) -> str:  # out of the way of the key quoting, then back as JSON strings
        strings.append(match.group(1))
        return f"{STASH_OPEN}{len(strings) - 1}{STASH_CLOSE}"

    rewritten = text
    for opener, closer in delims:
        rewritten = re.sub(re.escape(opener) + "(.*?)" + re.escape(closer), stash, rewritten, flags=re.DOTALL)
    if args.get("unquoted_keys", False):
        # A quoted string is matched whole and put back as it was, so that text inside a value that looks like a key
        # ({a:"x,b:y"}) is never quoted; a bare key may have whitespace around it ({a:1, b:2}). As transformers reads
        # it: the key-only pattern quoted inside strings and skipped keys after ", ".
        rewritten = re.sub(r'"(?:\\.|[^"\\])*"|(?<=[{,])(\s*)(\w+)(\s*):',
                           lambda m: m.group(0) if m.group(2) is None else f'{m.group(1)}"{m.group(2)}"{m.group(3)}:',
                           rewritten)
    if strings:  # in one pass: a str.replace over the whole text per string was quadratic in a call's strings
        rewritten = STASHED.sub(lambda m: json.dumps(strings[int(m.group(1))]), rewritten)
    try:
        return parse_json(rewritten)
    except json.JSONDecodeError as exc:
        if args.get("allow_non_json"):
            return _text(text, args)
        raise ValueError(f"json: cannot read {text!r:.200} as JSON" + (f" (rewritten: {rewritten!r:.200})"
                         if rewritten != text else "") + f": {exc}") from None


def _sub_value(text: str, parser: dict[str, Any] | None, budget: PatternBudget) -> Any:
    """A nested value parsed by {"name": parser, "args": {...}} (xml-inline's and kv-lines' value_parser)."""
    if parser is None:
        return text
    return parse_content(text, parser.get("name", "text"), parser.get("args", {}), budget)


def _xml_inline(text: str, args: dict[str, Any], budget: PatternBudget) -> dict[str, Any]:
    """Shallow tags, <parameter=city>Paris</parameter>: `tag_pattern` names groups `key` and `value`; a repeated key
    keeps the last value, or all of them in a list with `merge_duplicates`. A pattern with no `value` group reads
    each value as ''; an optional one that takes no part in a tag (<(?P<key>\\w+)(?:=(?P<value>[^>]*))?>) gives None,
    as in transformers, and with a value parser, which has no text to read, the reply is one the template cannot
    read (a ValueError, as for a value the parser refuses)."""
    pattern = args.get("tag_pattern")
    if pattern is None:
        raise ValueError("xml-inline: content_args.tag_pattern is required (a regex with groups key and value)")
    try:
        compiled = regex.compile(pattern, regex.DOTALL)
    except (regex.error, TypeError) as exc:
        raise ValueError(f"xml-inline: tag_pattern {pattern!r:.120} is not a valid regular expression: {exc}") from None
    by_group, by_capture = _value_parser_by(args.get("value_parser_by"), compiled)
    out: dict[str, Any] = {}
    merged: set[str] = set()  # keys holding a list of their values (a first value that is a list stays one value)
    for match in budget.finditer("response_template: an xml-inline content's tag_pattern", compiled, text):
        found = match.groupdict()
        if "key" not in found:
            raise ValueError(f"xml-inline: tag_pattern {pattern!r} has no group named 'key'")
        # (groupdict holds an optional group that takes no part in the match as None: the model's tag, not the pattern)
        if found["key"] is None:
            raise ValueError(f"xml-inline: the group 'key' of tag_pattern {pattern!r} takes no part in the tag "
                             f"{match.group(0)!r:.120}, which so names no key")
        # the tag says how its value reads (<int name=n>7</int>); a capture with no parser of its own takes value_parser
        parser = by_capture.get(found[by_group], args.get("value_parser")) if by_group else args.get("value_parser")
        if parser is not None and "value" in found and found["value"] is None:
            raise ValueError(f"xml-inline: the group 'value' of tag_pattern {pattern!r} takes no part in the tag "
                             f"{match.group(0)!r:.120}, so its value parser {parser.get('name', 'text')!r} has no "
                             "text to read")
        key, value = found["key"], _sub_value(found.get("value", ""), parser, budget)
        if args.get("merge_duplicates", False) and key in out:
            if key not in merged:
                out[key] = [out[key]]
                merged.add(key)
            out[key].append(value)
        else:
            out[key] = value
    return out


def _value_parser_by(spec: Any, compiled: regex.Pattern[str]) -> tuple[str | None, dict[str, Any]]:
    """xml-inline's `value_parser_by`, {"group": a named group of tag_pattern, "parsers": {what it captures: a
    value_parser}}, as (group, parsers); (None, {}) where it is not given."""
    if spec is None:
        return None, {}
    group, parsers = (spec.get("group"), spec.get("parsers")) if isinstance(spec, dict) else (None, None)
    if not isinstance(group, str) or not isinstance(parsers, dict):
        raise ValueError("xml-inline: content_args.value_parser_by: expected {\"group\": a named group of tag_pattern, "
                         f"\"parsers\": {{what it captures: a value_parser}}}}, got {spec!r:.120}")
    if group not in compiled.groupindex:
        raise ValueError(f"xml-inline: content_args.value_parser_by.group: tag_pattern has no group named {group!r} "
                         f"(it has {sorted(compiled.groupindex)})")
    return group, parsers


def _kv_lines(text: str, args: dict[str, Any], budget: PatternBudget) -> dict[str, Any]:
    """Lines of key<kv_sep>value (default ":"), split at `line_sep` (default a newline)."""
    kv_sep = args.get("kv_sep", ":")
    out = {}
    for line in text.split(args.get("line_sep", "\n")):
        line = _text(line, args)
        if line and kv_sep in line:
            key, value = line.split(kv_sep, 1)
            out[_text(key, args)] = _sub_value(_text(value, args), args.get("value_parser"), budget)
    return out


# python-call-list: `[get_weather(city="Paris"), f()]`, a strict grammar (no positional arguments, no trailing
# commas, JSON's numbers and string escapes plus '...' strings, True/False/None or true/false/null), so that what it
# reads is read alike by every implementation: its tokens, then _CallList reads them.
_CALL_TOKENS = regex.compile(r"""
      (?P<space>[ \t\n\r]+)
    | (?P<string>'(?:[^'\\\n\r]|\\.)*'|"(?:[^"\\\n\r]|\\.)*")
    | (?P<number>-?(?:0|[1-9][0-9]*)(?P<fraction>\.[0-9]+)?(?P<exponent>[eE][+-]?[0-9]+)?)
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:[-.][A-Za-z0-9_]+)*)
    | (?P<mark>[][{}(),:=])
""", regex.VERBOSE | regex.DOTALL)
_CALL_CONSTANTS = {"True": True, "true": True, "False": False, "false": False, "None": None, "null": None}
_CALL_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_CALL_MAX_INTEGER = 2**53 - 1  # JSON's safe integers: the arguments go on as JSON
_CALL_MAX_NESTING = 100  # lists and dicts inside one argument


class _CallList:
    """One python-call-list text, read token by token (`kind`, `text`, `start`)."""

    def __init__(self, text: str) -> None:
        self.text, self.tokens, self.at = text, [], 0
        pos = 0
        while pos < len(text):
            match = _CALL_TOKENS.match(text, pos)
            if match is None:
                self.fail(f"unexpected {text[pos]!r}", pos)
            if match.lastgroup != "space":
                kind = "mark" if match.lastgroup == "mark" else match.lastgroup
                self.tokens.append((kind, match.group(), match.start()))
            pos = match.end()
        self.tokens.append(("end", "", len(text)))

    def fail(self, what: str, pos: int | None = None) -> NoReturn:
        pos = self.tokens[self.at][2] if pos is None else pos
        raise ValueError(f"python-call-list: {what} at character {pos} of {self.text!r:.200}")

    def peek(self, text: str) -> bool:
        kind, got, _ = self.tokens[self.at]
        return kind == "mark" and got == text

    def take(self, kind: str, what: str, mark: str | None = None) -> str:
        """The next token, which must be of `kind` (and be `mark`, given one): else an error expecting `what`."""
        got_kind, got, _ = self.tokens[self.at]
        if got_kind != kind or (mark is not None and got != mark):
            self.fail(f"expected {what}, got {got!r}" if got_kind != "end" else f"expected {what}, got the end")
        self.at += 1
        return got

    def sequence(self, close: str, item: Callable[[], T]) -> list[T]:
        """Items up to `close`, a comma between each (none after the last)."""
        items: list[T] = []
        if not self.peek(close):
            items.append(item())
            while not self.peek(close):
                self.take("mark", f"',' or {close!r}", ",")
                items.append(item())
        self.take("mark", repr(close), close)
        return items

    def unique(self, pairs: list[tuple[str, Any]], what: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                self.fail(f"{what} {key!r} given twice")
            out[key] = value
        return out

    def calls(self) -> list[dict[str, Any]]:
        self.take("mark", "'['", "[")
        calls = self.sequence("]", self.call)
        self.take("end", "the end after the closing ']'")
        return calls

    def call(self) -> dict[str, Any]:
        name = self.take("name", "a function name")
        self.take("mark", "'('", "(")
        return {"name": name, "arguments": self.unique(self.sequence(")", self.argument), "argument")}

    def argument(self) -> tuple[str, Any]:
        key = self.take("name", "an argument's name (arguments are given by name)")
        self.take("mark", "'=' (arguments are given by name)", "=")
        return key, self.value(0)

    def value(self, nesting: int) -> Any:
        kind, got, _ = self.tokens[self.at]
        if kind == "mark" and got in "[{":
            if nesting >= _CALL_MAX_NESTING:
                self.fail(f"lists and dicts nested more than {_CALL_MAX_NESTING} deep")
            self.at += 1
            if got == "[":
                return self.sequence("]", lambda: self.value(nesting + 1))
            return self.unique(self.sequence("}", lambda: self.entry(nesting + 1)), "key")
        if kind == "string":
            self.at += 1
            return self.unquote(got)
        if kind == "number":
            return self.number(got)
        if kind == "name" and got in _CALL_CONSTANTS:
            self.at += 1
            return _CALL_CONSTANTS[got]
        self.fail(f"expected a value (a string, number, list, dict, True, False or None), got {got!r}")

    def entry(self, nesting: int) -> tuple[str, Any]:
        if self.tokens[self.at][0] != "string":
            self.fail("expected a dict key, which must be a string")
        key = self.value(nesting)
        self.take("mark", "':'", ":")
        return key, self.value(nesting)

    def number(self, got: str) -> int | float:
        if regex.fullmatch(r"-?[0-9]+", got):  # an integer: checked by its digits before int() reads them
            if len(got.lstrip("-")) > 16 or abs(int(got)) > _CALL_MAX_INTEGER:
                self.fail(f"integer {got:.30} outside +-(2**53 - 1)")
            self.at += 1
            return int(got)
        if math.isinf(value := float(got)):
            self.fail(f"number {got:.30} too large")
        self.at += 1
        return value

    def unquote(self, quoted: str) -> str:
        body, out, i = quoted[1:-1], [], 0
        if regex.search(r"[\ud800-\udfff]", body):
            self.fail("a lone surrogate in a string")
        while (slash := body.find("\\", i)) >= 0:
            out.append(body[i:slash])
            code, i = body[slash + 1], slash + 2
            if code in _CALL_ESCAPES:
                out.append(_CALL_ESCAPES[code])
                continue
            if code != "u" or not regex.fullmatch(r"[0-9a-fA-F]{4}", body[i:i + 4]):
                self.fail(f"the escape {body[slash:slash + 2]!r} (a string takes JSON's escapes alone, and \\\\' in '...')")
            point, i = int(body[i:i + 4], 16), i + 4
            low = regex.match(r"\\u([dD][c-fC-F][0-9a-fA-F]{2})", body[i:i + 6])
            if 0xD800 <= point < 0xDC00 and low:  # a UTF-16 pair: one character
                point, i = 0x10000 + ((point - 0xD800) << 10) + (int(low[1], 16) - 0xDC00), i + 6
            if 0xD800 <= point <= 0xDFFF:
                self.fail("a lone surrogate escape in a string")
            out.append(chr(point))
        return "".join(out) + body[i:]


def _python_call_list(text: str, args: dict[str, Any], budget: PatternBudget) -> list[dict[str, Any]]:
    """Calls by keyword, `[get_weather(city="Paris")]`, as [{"name": "get_weather", "arguments": {"city": "Paris"}}]."""
    return _CallList(text).calls()


TYPED_CONTENT = frozenset({"json", "python-call-list"})  # content parsers whose values carry their own types (see _type_arguments)
# Each takes the text, its content_args and the reply's PatternBudget (for a pattern the template gives them).
CONTENT_PARSERS: dict[str, Callable[[str, dict[str, Any], PatternBudget], Any]] = {
    "text": _text,
    "int": lambda text, args, budget: int(_text(text, args)),
    "float": lambda text, args, budget: float(_text(text, args)),
    "bool": lambda text, args, budget: _text(text, args).lower() in ("true", "1"),
    "json": _json,
    "xml-inline": _xml_inline,
    "kv-lines": _kv_lines,
    "python-call-list": _python_call_list,
}


def parse_content(text: str, parser: str, args: dict[str, Any], budget: PatternBudget) -> Any:
    if parser not in CONTENT_PARSERS:
        raise ValueError(f"value_parser.name: expected one of {sorted(CONTENT_PARSERS)}, got {parser!r}")
    return CONTENT_PARSERS[parser](text, args, budget)


def _fill(transform: Any, scope: dict[str, Any]) -> Any:
    """The transform with each placeholder string replaced by its value from `scope` ({a.b}: scope["a"]["b"])."""
    if isinstance(transform, dict):
        return {key: _fill(value, scope) for key, value in transform.items()}
    if isinstance(transform, list):
        return [_fill(value, scope) for value in transform]
    whole = PLACEHOLDER.fullmatch(transform) if isinstance(transform, str) else None
    if whole is None:
        return transform
    root, *keys = whole.group(1).split(".")
    if root not in scope:
        raise ValueError(f"transform: {transform} names nothing the region has (it has {sorted(scope)})")
    value = scope[root]
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"transform: {transform}: the value has no key {key!r} (it is {value!r:.80})")
        value = value[key]
    return value


def _field_value(body: str, field: Field, captures: dict[str, str], budget: PatternBudget) -> Any:
    value = parse_content(body, field.content, field.content_args, budget)
    if field.transform is None:
        return value
    if not field.transform_each:
        return _fill(field.transform, {**captures, "content": value})
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ValueError(f"{field.name}: transform_each needs the content to be a list of objects, got {value!r:.80}")
    return [_fill(field.transform, {**captures, **item}) for item in value]


# -- tool-call arguments typed by the tools' schemas --------------------------------------------------------------


def tool_parameters(tools: Any) -> dict[str, dict[str, Any]]:
    """Each tool's parameter schemas by tool name, from tools as chat templates take them ({"type": "function",
    "function": {...}} or the function object itself)."""
    if tools is not None and not isinstance(tools, (list, tuple)):  # (one tool's dict matched no name, silently)
        raise ValueError(f"tools: expected a list of tool schemas (as apply_chat_template takes), got "
                         f"{type(tools).__name__}")
    params = {}
    for tool in tools or []:
        if callable(tool):
            raise ValueError(f"tools: got the function {getattr(tool, '__name__', tool)!r}; pass its JSON schema")
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            schema = function.get("parameters")
            properties = schema.get("properties") if isinstance(schema, dict) else None
            params[function["name"]] = properties if isinstance(properties, dict) else {}
    return params


def _types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows, in order (type, a list of types, anyOf / oneOf, nullable)."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else []
    if isinstance(declared, list):
        types += [t for t in declared if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types += _types(option)
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    return types


def _typed(text: str, types: list[str]) -> Any:
    """`text` as the first of `types` that reads it; the text itself when none does (a string parameter)."""
    for kind in types:
        try:
            if kind == "integer":
                try:
                    return int(text)
                except ValueError:
                    number = float(text)  # a whole number written as one: 3.0
                    if number.is_integer():
                        return int(number)
            elif kind == "number":
                number = float(text)
                if number == number and abs(number) != float("inf"):  # not NaN or infinite: no JSON number
                    return int(number) if number.is_integer() and "." not in text else number
            elif kind == "boolean" and text.strip().lower() in ("true", "1", "false", "0"):
                return text.strip().lower() in ("true", "1")
            elif kind == "null" and text.strip() in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                value = parse_json(text)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except ValueError:  # (json.JSONDecodeError is one)
            continue
    return text


def _type_arguments(value: Any, params: dict[str, dict[str, Any]], typed: bool = False) -> Any:
    """Tool calls in `value` with their text arguments read as their schema's types: "7" is 7 for an integer
    parameter and stays "7" for a string one (text-based call formats write every value as text). `typed`: the
    arguments came from a format with types of its own (JSON), where a string is one on purpose: a parameter whose
    schema allows strings keeps it ("007" for ["string", "integer"] was read as 7), as transformers does."""
    if isinstance(value, list):
        return [_type_arguments(item, params, typed) for item in value]
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return value
    arguments, properties = function.get("arguments"), params.get(function["name"])
    if not isinstance(arguments, dict) or not properties:
        return value
    for key, argument in arguments.items():
        types = _types(properties.get(key))
        if not types or (typed and "string" in types):
            continue
        if isinstance(argument, str):
            arguments[key] = _typed(argument, types)
        elif isinstance(argument, list) and "array" not in types:  # a key given several times (merge_duplicates)
            arguments[key] = [_typed(a, types) if isinstance(a, str) else a for a in argument]
    return value


# -- the parse --------------------------------------------------------------------------------------------------


def parse_response(template: ResponseTemplate, text: str, prefix: str = "", tools: Any = None,
                   budget: PatternBudget | None = None, keep_empty: bool = False) -> dict[str, Any]:
    """The message a reply `text` holds. `prefix`: the prompt it answers, whose part after the template's last
    start_anchor (an assistant turn the template began, e.g. an opened <think>) is read as the reply's start.
    `tools`: the request's tools; tool-call arguments written as text get their parameters' types. `budget`: the
    time the template's patterns may take (a new PatternBudget where None; a stream's reads share one), past which
    PatternTooCostly. `keep_empty`: keep the fields whose regions the reply has but left empty (an empty thought,
    <|channel>thought\n<channel|>), which transformers' message leaves out, as this does by default."""
    message, _, _ = _read(template, text, prefix, tools, ended=True, budget=budget or PatternBudget())
    fields = template.fields
    if missing := [name for name, f in fields.items() if not f.optional and name not in message]:
        raise ValueError(f"the reply has no {missing} (fields the response_template marks optional: false)")

    def empty(value: Any) -> bool:
        return value is None or (isinstance(value, (str, list, dict)) and not value)

    return {key: value for key, value in message.items() if keep_empty or key in template.defaults or not empty(value)}


@dataclass(frozen=True)
class PartialMessage:
    """What a reply still being written has settled (`parse_partial`)."""

    template: ResponseTemplate
    closed: dict[str, Any]  # the values of the regions it has closed, gathered as parse_response gathers them
    open: str | None  # the field whose region it ends in (None: none, or the implicit one with no text yet)
    text: str  # that region's text so far, short of a tail where a marker may yet begin
    # Where in the reply's text each field's first region opened (its marker's start; 0 for one the prompt opened),
    # and where its last closed region ended (past its closing marker, or where the next region's marker starts)
    opened_at: dict[str, int] = dataclasses.field(default_factory=dict)
    closed_at: dict[str, int] = dataclasses.field(default_factory=dict)

    def began(self, name: str) -> bool:
        """Whether the reply has opened field `name`'s region: it is open now, or one of its regions closed."""
        return self.open == name or name in self.closed

    def settled_text(self, name: str) -> str:
        """The start of text field `name`'s value that more text cannot change while its region stays the last
        one: a closed value, or the open region's text with the whitespace that `strip` may drop held back (a
        field that keeps only its last occurrence, as transformers' does, starts over if it opens again)."""
        field = self.template.fields.get(name)
        before = self.closed.get(name)
        before = before if isinstance(before, str) else None
        if field is None or self.open != name or field.content != "text":
            return before or ""
        now = self.text.strip() if field.content_args.get("strip", True) else self.text
        return now if field.join is None or before is None else before + field.join + now


def parse_partial(template: ResponseTemplate, text: str, prefix: str = "", tools: Any = None,
                  budget: PatternBudget | None = None) -> PartialMessage:
    """What the start `text` of a reply settles, whatever follows it: the regions it has closed (a tool call whose
    closing marker is there), and the open region's text before any tail that could be the start of a marker (or a
    marker that more text could lengthen). `prefix`, `tools` and `budget` as for parse_response, whose scan this
    is: the whole reply's message holds these values. A stream reads its reply again at each chunk: give every read
    of one reply the same budget, so that their time together is bounded."""
    return PartialReader(template, prefix, tools, budget).read(text)


class PartialReader:
    """parse_partial of one growing reply, read after read, at a cost that grows with the text each read adds
    rather than with all of it: a stream's reads of a reply of N characters take about O(N) together, where
    reading it whole at every chunk took O(N^2) (each read searched the reply from its start). Each read gives the
    PartialMessage that parse_partial gives for the same text. What a read settles (the regions it has closed, the
    open region's text short of a marker's possible start) is what every longer reply settles (parse_partial's
    premise); the next read goes on from there, its searches from where the last one held back. It does so only
    for a template whose markers are literal texts or patterns that match the same once found (_settles: Gemma 4's
    built-in one, Qwen 3.5's \\s*<tool_call>, whose searches go on from the start of a run of whitespace that may
    begin a match); any other's reply is read whole at each read, as parse_partial reads it. A read whose text does
    not continue the last one's is read from the start. A read that fails (ValueError: a region that cannot be
    read, PatternTooCostly) fails again for every later, longer text, with the same words; a whole reply's read
    (ended=True) that fails does not: the next read starts over."""

    def __init__(self, template: ResponseTemplate, prefix: str = "", tools: Any = None,
                 budget: PatternBudget | None = None) -> None:
        self.template, self.prefix, self.tools = template, prefix, tools
        self.budget = budget or PatternBudget()
        self.params = tool_parameters(tools)
        self.start: str | None = None  # the prompt's part the reply goes on (_reply_start), once read
        self.text = ""  # the text of the last read
        self.state: _Scan | None = None  # where the last read stopped: None, read from the start
        self.failed: ValueError | None = None

    def read(self, text: str, ended: bool = False) -> PartialMessage:
        """What the reply's start `text` settles (parse_partial(template, text, prefix, tools, budget)); `ended`:
        `text` is the whole reply, so a marker at its end is one (a call's `<|tool_call>call:weathe`, which more
        text could lengthen, opened no region), and its last region closes. A read after an ended one starts over."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        if not (self.template.resumable and self.state is not None and text.startswith(self.text)):
            self.state, self.failed = None, None
        if self.failed is not None:
            raise self.failed
        self.budget.begin_read()
        if self.start is None:
            self.start = _reply_start(self.template, self.prefix, self.budget)
        if self.state is None:
            self.state = _Scan(copy.deepcopy(self.template.defaults), self.template.implicit, {})
        self.text = text
        try:
            message, current, body = _scan(self.template, self.start + text, self.params, ended, self.budget,
                                           self.state)
        except ValueError as exc:
            if ended:  # a whole reply's failure says nothing of a longer one's: the next read starts over
                self.state = None
            else:
                self.failed = exc
            raise
        scanned, self.state = self.state, None if ended else self.state
        # (a copy: the next read adds to the reader's own lists; the values in them are not changed after)
        closed = {key: list(value) if isinstance(value, list) else value for key, value in message.items()}
        lead = len(self.start)
        return PartialMessage(self.template, closed, current, body,
                              opened_at={name: max(0, at - lead) for name, at in scanned.opened_at.items()},
                              closed_at={name: max(0, at - lead) for name, at in scanned.closed_at.items()})


def _literal_heads(items: Any) -> list[str]:
    """The literal texts a parsed pattern's matches may start with, after leading parts that may match nothing
    (Qwen's \\s* before <tool_call>), each as far as it is literal (the pattern may go on after it)."""
    head = ""
    for op, arg in items:
        if op is sre_constants.LITERAL:
            head += chr(arg)
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and arg[0] == 0 and not head:
            continue
        elif op is sre_constants.SUBPATTERN:
            return [head + h for h in _literal_heads(arg[-1])]
        elif op is sre_constants.BRANCH:
            return [head + h for branch in arg[1] for h in _literal_heads(branch)]
        else:
            break
    return [head]


def _pattern_heads(pattern: str) -> list[str]:
    """_literal_heads of a pattern, as the stdlib's parser reads it; none for `regex` syntax it does not know
    (\\p{...}): then no tail is held back for that marker's start."""
    try:
        return _literal_heads(sre_parser.parse(pattern, re.DOTALL))
    except re.error:
        return []


# What one character of text may be, as the stdlib's parser writes it (a class's categories: as `regex` reads them).
ONE_CHARACTER = (sre_constants.LITERAL, sre_constants.NOT_LITERAL, sre_constants.ANY, sre_constants.IN)
CATEGORIES = {sre_constants.CATEGORY_DIGIT: r"\d", sre_constants.CATEGORY_NOT_DIGIT: r"\D",
              sre_constants.CATEGORY_SPACE: r"\s", sre_constants.CATEGORY_NOT_SPACE: r"\S",
              sre_constants.CATEGORY_WORD: r"\w", sre_constants.CATEGORY_NOT_WORD: r"\W"}


def _takes(op: Any, arg: Any, char: str) -> bool | None:
    """Whether the one-character item (op, arg) matches `char`; None where this cannot tell."""
    if op is sre_constants.LITERAL:
        return arg == ord(char)
    if op is sre_constants.NOT_LITERAL:
        return arg != ord(char)
    if op is sre_constants.ANY:  # (the markers are compiled DOTALL)
        return True
    negate, hit = False, False
    for item_op, item_arg in arg:
        if item_op is sre_constants.NEGATE:
            negate = True
        elif item_op is sre_constants.LITERAL:
            hit = hit or item_arg == ord(char)
        elif item_op is sre_constants.RANGE:
            hit = hit or item_arg[0] <= ord(char) <= item_arg[1]
        elif item_op is sre_constants.CATEGORY and item_arg in CATEGORIES:
            hit = hit or regex.fullmatch(CATEGORIES[item_arg], char) is not None
        else:
            return None
    return hit != negate


def _pattern_items(pattern: str) -> list[tuple[Any, Any]] | None:
    """A pattern's items as the stdlib's parser reads it, groups flattened; None where it cannot (a parse error, an
    inline flag, a group's own flags)."""
    try:
        parsed = sre_parser.parse(pattern, re.DOTALL)
    except re.error:
        return None
    if parsed.state.flags & ~(re.DOTALL | re.UNICODE):
        return None
    items: list[tuple[Any, Any]] = []

    def flatten(sub: Any) -> bool:
        for op, arg in sub:
            if op is sre_constants.SUBPATTERN:
                if arg[1] or arg[2] or not flatten(arg[3]):  # (a group's own flags)
                    return False
            else:
                items.append((op, arg))
        return True

    return items if flatten(parsed) else None


def _leading_repeats(items: list[tuple[Any, Any]]) -> int:
    """How many optional greedy repeats of one character a pattern's items start with (\\s*, \\n?)."""
    k = 0
    while (k < len(items) and items[k][0] is sre_constants.MAX_REPEAT and items[k][1][0] == 0
           and len(items[k][1][2]) == 1 and items[k][1][2][0][0] in ONE_CHARACTER):
        k += 1
    return k


def _first_characters(op: Any, arg: Any) -> list[str] | None:
    """The characters a literal item may start with: a literal's own, or each alternative's first of a choice
    between literal texts of which none starts another (at one place at most one of them can match: Qwen's
    (?:<|im_end|>|<|endoftext|>)); None for any other item."""
    if op is sre_constants.LITERAL:
        return [chr(arg)]
    if op is not sre_constants.BRANCH:
        return None
    texts = []
    for branch in arg[1]:
        if not branch or any(item_op is not sre_constants.LITERAL for item_op, _ in branch):
            return None
        texts.append("".join(chr(c) for _, c in branch))
    if any(a != b and b.startswith(a) for a in texts for b in texts) or len(set(texts)) < len(texts):
        return None
    return [text[0] for text in texts]


def _settles(pattern: str) -> bool:
    """Whether a marker pattern's match, once found short of the text's end, is the one any longer text gives:
    optional repeats of one character that cannot take what follows them (Qwen's \\s* before <tool_call>), then a
    literal head (a text, or a choice between texts of which none starts another), then literal or one-character
    items, such choices, and greedy repeats of one character that end the pattern or are followed by a literal the
    repeat cannot take (Gemma 4's <\\|tool_call>call:(?P<name>\\w+)). The regex engine then never chooses between
    ways to match: the match starts at the earliest run of the leading repeats' characters just before its head
    (text before the head), and what it matched depends on no text after its end but the character that ended a
    repeat; a text's end that falls inside a match, inside the literal head, or in a run of the leading repeats'
    characters that a head may yet follow is held back (_pending, _lead_start). Anything else (other alternatives,
    lookarounds, anchors, lazy repeats, inline flags, a pattern the stdlib cannot parse) is read whole again at
    every chunk, as it may match differently once more text comes."""
    items = _pattern_items(pattern)
    if items is None:
        return False
    lead = _leading_repeats(items)
    if lead == len(items) or (heads := _first_characters(*items[lead])) is None:
        return False
    if any(_takes(op, arg, char) is not False for _, (_, _, [(op, arg)]) in items[:lead] for char in heads):
        return False
    for k, (op, arg) in enumerate(items[lead:], lead):
        if op in ONE_CHARACTER or _first_characters(op, arg) is not None:
            continue
        if op is not sre_constants.MAX_REPEAT or len(arg[2]) != 1 or arg[2][0][0] not in ONE_CHARACTER:
            return False
        if k + 1 < len(items):
            after = _first_characters(*items[k + 1])
            repeated_op, repeated = arg[2][0]
            if after is None or any(_takes(repeated_op, repeated, char) is not False for char in after):
                return False
    return True


def _lead_start(buffer: str, lo: int, at: int, lead: tuple[tuple[Any, Any], ...]) -> int:
    """Where the run of characters that a marker's leading repeats take (`lead`: Field.open_lead or close_lead)
    ending at `at` starts, no earlier than `lo`: a head there, or after more text, makes a match that starts
    there (Qwen's \\s*<tool_call> after "text  \\n"). A character the item cannot tell counts as taken."""
    while at > lo and any(_takes(op, arg, buffer[at - 1]) is not False for op, arg in lead):
        at -= 1
    return at


def _pending(buffer: str, pos: int, texts: tuple[str, ...] | None, heads: tuple[str, ...],
             match: re.Match[str] | regex.Match[str] | None) -> int:
    """Where a growing reply's text (read from `pos`) may hold a marker that more text would complete or change,
    len(buffer) where nowhere: the earliest of a complete `match` that ends at the text's end and could still grow,
    a tail that is a proper prefix of the marker's text, and (a pattern's) text that starts as its matches start
    (`heads`: Field.open_heads or close_heads)."""
    found = len(buffer)
    for head in heads:
        if texts is None:  # a pattern: what follows its literal start may yet make a match there
            at = buffer.find(head, pos)
            if 0 <= at < found and (match is None or at != match.start()):
                found = at
        for start in range(max(pos, len(buffer) - len(head) + 1), found):
            if head.startswith(buffer[start:]):
                found = start
                break
    if match is not None and match.end() == len(buffer) and (
            match.start() == match.end() or texts is None
            or any(len(t) > match.end() - match.start() and t.startswith(match.group()) for t in texts)):
        # (no earlier than a possible start before it: the next read, the match no longer at the end, holds there)
        return min(found, match.start())
    return found


@dataclass
class _Scan:
    """Where a read of a reply stands between its rounds (_scan): the values of the regions it has closed, the
    region it is in (its field, its opening marker's captures, its text so far, whether it has begun) and where the
    next round starts. `resume`: where that round's searches may start (>= pos), as the reply's text before it
    holds no marker nor a marker's possible start (see PartialReader)."""

    message: dict[str, Any]
    current: str | None
    captures: dict[str, str]
    body: str = ""
    opened: bool = False
    pos: int = 0
    resume: int = 0
    # where in the reply (its buffer) each field's first region opened (its marker's start), and where its last
    # closed region ended (past its closing marker, or where the next region's marker starts)
    opened_at: dict[str, int] = dataclasses.field(default_factory=dict)
    closed_at: dict[str, int] = dataclasses.field(default_factory=dict)


def _scan(template: ResponseTemplate, buffer: str, params: dict[str, dict[str, Any]], ended: bool,
          budget: PatternBudget, state: _Scan) -> tuple[dict[str, Any], str | None, str]:
    """Read a reply (`buffer`: the prompt's part after its last start anchor, then the reply) from `state` into
    (the values of the regions it closes, the region open at its end, that region's text), and leave `state` at
    the start of its last round. `ended`: the reply is whole, so its end closes the last region; else markers the
    text's end may still be part of wait for more text, and the text before them is the open region's. `params`:
    the tools' parameters (tool_parameters). Every search of the template's patterns spends `budget`."""
    message, fields = state.message, template.fields

    def close(at: int) -> None:
        """End the current region at `at`: its value goes into the message (when it got any text or was opened by
        a marker); the implicit region is current again."""
        if state.current is not None and state.opened:
            state.closed_at[state.current] = at
            field = fields[state.current]
            value = _field_value(state.body, field, state.captures, budget)
            # with value_parser_by the reply itself says how each value reads, which the tools' schemas must not undo
            if params and "value_parser_by" not in field.content_args:
                value = _type_arguments(value, params, typed=field.content in TYPED_CONTENT)
            if field.join is not None:
                if not isinstance(value, str):
                    raise ValueError(f"{field.name}: join needs each occurrence to be text, got {value!r:.80}")
                before = message.get(field.name)
                message[field.name] = value if before is None else before + field.join + value
            elif field.repeats:
                message.setdefault(field.name, []).append(value)
            else:
                message[field.name] = value
        state.current, state.captures, state.body, state.opened = template.implicit, {}, "", False

    # Every round moves past text or changes region; patterns that match empty text at one place could go round
    # forever, so the rounds are bounded.
    for _ in range(4 * len(buffer) + 8):
        pos, current = state.pos, state.current
        start = max(pos, state.resume)  # (no marker, nor a marker's start, before it)
        # (kind, field, its marker's pattern, texts, heads and lead) of each marker that could come next
        watch: list[tuple[str, Field, Marker, tuple[str, ...] | None, tuple[str, ...], tuple[tuple[Any, Any], ...]]] = []
        if current is None or current == template.implicit:  # else inside a marked region: only its end counts
            watch = [("open", f, f.open, f.open_texts, f.open_heads, f.open_lead)
                     for f in fields.values() if f.open is not None]
        if current is not None and (end := fields[current].close) is not None:
            field = fields[current]
            watch.append(("close", field, end, field.close_texts, field.close_heads, field.close_lead))
        best: tuple[str, Field, re.Match[str] | regex.Match[str]] | None = None
        best_key: tuple[int, int, bool, str] | None = None
        hold = resume = len(buffer)
        for kind, field, pattern, texts, heads, lead in watch:
            where = f"response_template.fields.{field.name}.{kind}" + ("" if texts else "_pattern")
            match = budget.search(where, pattern, buffer, start)
            if not ended:
                pending = _pending(buffer, start, texts, heads, match)
                hold = min(hold, pending)
                if lead:  # a match may start before its possible head, in the run of characters its lead takes
                    resume = min(resume, _lead_start(buffer, start, pending, lead))
                if match is not None and match.start() >= pending:  # not a marker yet: more text may change it
                    continue
            # The earliest marker wins; then the longest; then an opening over a closing; then by name.
            if match is None:
                continue
            key = (match.start(), match.start() - match.end(), kind != "open", field.name)
            if best_key is None or key < best_key:
                best, best_key = (kind, field, match), key
        if best is not None and best[2].start() >= hold:  # a marker that may still begin earlier goes first
            best = None
        if best is None:  # no marker left: the rest is the current region's, and the reply's end ends it
            body, opened = state.body, state.opened
            if pos < hold and current is not None:
                body, opened = body + buffer[pos:hold], True
            if not ended:
                state.resume = min(hold, resume)
                return message, current if opened else None, body
            state.body, state.opened = body, opened
            close(len(buffer))
            break
        kind, field, match = best
        if match.start() > pos and current is not None:
            state.body, state.opened = state.body + buffer[pos:match.start()], True
        state.pos = match.end()
        if kind == "open":
            close(match.start())
            state.current, state.body, state.opened = field.name, "", True
            state.opened_at.setdefault(field.name, match.start())
            state.captures = {k: v for k, v in match.groupdict().items() if v is not None}
        else:
            was_open = state.opened
            # the closing marker's own captures (</call:(?P<id>...)>) are the region's too, as the opening's are
            state.captures.update({k: v for k, v in match.groupdict().items() if v is not None})
            close(match.end())
            if not was_open and match.start() == match.end():  # an empty closing of an empty region: nothing left
                if not ended:
                    return message, None, ""
                break
    else:
        raise ValueError("response_template: its patterns match empty text at one place over and over; give the "
                         "markers some text to match")
    return message, None, ""


def _reply_start(template: ResponseTemplate, prefix: str, budget: PatternBudget) -> str:
    """The prompt's part that the reply goes on: after its last start anchor (all of it where it has none)."""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix: expected a str, got {type(prefix).__name__}")
    ends = [m.end() for m in budget.finditer("response_template.start_anchor", template.start_anchor, prefix)]
    return prefix[ends[-1]:] if ends else prefix


def _read(template: ResponseTemplate, text: str, prefix: str, tools: Any, ended: bool,
          budget: PatternBudget) -> tuple[dict[str, Any], str | None, str]:
    """_scan of a whole reply, or of a reply's start, from its beginning."""
    if not isinstance(text, str):
        raise ValueError(f"text: expected a str, got {type(text).__name__}")
    budget.begin_read()
    state = _Scan(copy.deepcopy(template.defaults), template.implicit, {})
    return _scan(template, _reply_start(template, prefix, budget) + text, tool_parameters(tools), ended, budget,
                 state)


# -- a reply's answer, whole or streamed (the server's chat replies and `blockpress chat` alike) ----------------------


def common_prefix(a: str, b: str, known: str) -> str:
    """os.path.commonprefix([a, b]), compared from the end of `known` where both start with it (what a stream has
    sent of them): a stream's comparisons of its growing texts then take time in the text each chunk adds, where
    comparing them whole at each chunk (a character a step, in Python) took time in the reply's length squared."""
    if not (a.startswith(known) and b.startswith(known)):
        return os.path.commonprefix([a, b])
    end = len(known)
    while end < len(a) and end < len(b) and a[end] == b[end]:
        end += 1
    return a[:end]


def thought_then_text(regions: Callable[[], PartialReader], plain: Callable[[str], str],
                      raw: str) -> dict[str, Any] | None:
    """The assistant message of a reply to which no tools were offered and that writes a call, which makes the
    reply text: None (the text) unless a thought came before the call. A stream shows that thought as it is
    written, before the call's marker does, so the answer keeps it as `reasoning_content`, the thought the template
    reads before the call, and its content is the reply's text around that thought (before it, then after it: the
    call written as text), its ends trimmed as the template trims a content. (A thought after the call, which a
    stream has not shown, is text too.) `regions`: a new reader of where the reply's regions are (regions_only);
    `plain`: the answer's text of a part of the reply `raw` (its special tokens left out)."""
    try:
        whole = regions().read(raw, ended=True)  # (a reply cut inside a call's name still opened that call)
        call_at, thought_at = whole.opened_at.get("tool_calls"), whole.opened_at.get("reasoning_content")
        if call_at is None or thought_at is None or thought_at > call_at:
            return None
        before = regions().read(raw[:call_at])  # (the call's marker: the reply's start settles)
    except ValueError:  # (the template's patterns out of time: the text, as before)
        return None
    reasoning, thought_end = before.closed.get("reasoning_content"), before.closed_at.get("reasoning_content")
    if not isinstance(reasoning, str) or thought_end is None:
        return None
    content = (plain(raw[:thought_at]) + plain(raw[thought_end:])).strip()
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}


def answer_without_tools(parse: Callable[[str], dict[str, Any]], regions: Callable[[], PartialReader],
                         plain: Callable[[str], str], raw: str) -> dict[str, Any] | None:
    """The assistant message of a whole reply `raw` to which no tools were offered, read with a template that reads
    thoughts (`parse`: parse_response of it, keep_empty): its thought as `reasoning_content` apart from the content
    (an empty thought is one: its markers are out of the content, but it is not kept); None where the answer is
    the reply's text: no thought, or a reply the template cannot read. A call makes the reply text, but for a thought
    before it (thought_then_text)."""
    try:
        parsed = parse(raw)
    except ValueError:  # (a call the request offers no tools for is text, whatever it holds)
        return thought_then_text(regions, plain, raw)
    if parsed.get("tool_calls"):
        return thought_then_text(regions, plain, raw)
    reasoning, content = parsed.get("reasoning_content"), parsed.get("content")
    if not isinstance(reasoning, str):
        return None
    return {"role": "assistant", "content": content if isinstance(content, str) else "",
            **({"reasoning_content": reasoning} if reasoning else {})}


@dataclass
class AnswerStream:
    """What a stream of a reply read with a response template has sent of its answer's thought and content: each
    goes out as the reply settles it, so that what is sent adds up to the whole answer (answer_without_tools, or
    the server's tool message). Until a thought shows, the content sent is also the start of the reply's plain
    text, which is the answer where no thought (nor, with tools, call) comes; after one, the answer is the
    template's reading."""

    content: str = ""
    reasoning: str = ""
    unread: bool = False  # the template cannot read the reply so far (a malformed call): the answer is text
    reader: PartialReader | None = None  # the reply's, made at its first read

    def advance(self, read_partial: Callable[[], PartialReader], raw: str, plain: str,
                calls_wanted: bool) -> tuple[list[dict[str, str]], PartialMessage | None]:
        """The deltas ({"reasoning_content": ...} or {"content": ...}) that the reply so far settles and that were
        not sent, and what it reads (None: it is unread). `raw`: the reply so far with its special tokens, `plain`
        its answer's text, each short of a tail that may yet change; `calls_wanted`: the request offers tools."""
        if self.unread:
            return [], None
        if self.reader is None:
            self.reader = read_partial()
        try:
            partial = self.reader.read(raw)
        except ValueError:
            self.unread = True
            return [], None
        if not calls_wanted and partial.began("tool_calls"):
            self.unread = True  # a call where the request offers no tools: the answer is text (answer_without_tools)
            return [], None
        deltas: list[dict[str, str]] = []
        reasoning = partial.settled_text("reasoning_content")
        thought = bool(reasoning) or partial.began("reasoning_content")
        if len(reasoning) > len(self.reasoning) and reasoning.startswith(self.reasoning):
            deltas.append({"reasoning_content": reasoning[len(self.reasoning):]})
            self.reasoning = reasoning
        content = partial.settled_text("content")
        if not thought:  # the answer may yet be the plain text
            if content and not calls_wanted:
                # Without tools the answer is the plain text unless a thought shows (a call leaves it text), so the
                # plain text's leading whitespace, which the template's content trims, is its start once text
                # follows. Where the request offers tools, a call would make the answer the template's trimmed
                # content: a reply that opens with whitespace then sends nothing until its call or its end.
                content = plain[: len(plain) - len(plain.lstrip())] + content
            content = common_prefix(plain, content, self.content)
        if len(content) > len(self.content) and content.startswith(self.content):
            deltas.append({"content": content[len(self.content):]})
            self.content = content
        return deltas, partial
