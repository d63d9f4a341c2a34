"""Replies parsed into messages with a checkpoint's response template: the same messages transformers'
`parse_response` gives (response.py, Tokenizer.parse_response)."""

from __future__ import annotations

import json
import os.path
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockpress.response import (
    GEMMA4_MARKERS,
    AnswerStream,
    PartialReader,
    PatternBudget,
    PatternTooCostly,
    answer_without_tools,
    common_prefix,
    compile_template,
    gemma4_response_template,
    parse_partial,
    parse_response,
    reads_thoughts,
    reasoning_markers,
    regions_only,
)
from blockpress.tokenizer import Tokenizer, train_bpe_tokenizer

# Gemma 4's reply format: thoughts in a channel, calls as call:NAME{key:value} with strings between <|"|> markers
# and bare keys, the turn ending with <turn|> (or a tool response, which the model waits for). blockpress's built-in
# one, read for checkpoints that ship none (test_the_built_in_gemma4_template_reads_as_transformers_fallback).
GEMMA4 = gemma4_response_template()
# Qwen 3.5's: calls as <function=NAME> with <parameter=KEY> tags, every value text until typed by the tool's schema.
QWEN35 = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
            "close_pattern": r"</function>\s*</tool_call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                             "merge_duplicates": True},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)"},
    },
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "scale": {"type": ["number", "null"]}}}}}]

HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Text with the markers' characters in it, so that near-misses and stray markers come up.
TEXT = st.lists(st.sampled_from(list("ab <|>\"/=:{},\n") + ["<turn|>", "<|tool_call>", "<channel|>", "<think>"]),
                max_size=12).map("".join)
NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
SCALAR = st.one_of(st.text(st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)), max_size=8),
                   st.integers(-10**6, 10**6), st.booleans(), st.none(),
                   st.floats(allow_nan=False, allow_infinity=False, width=32))
VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAME, inner, max_size=3),
                     max_leaves=6)


def gemma_value(value: Any) -> str:
    """A value as Gemma 4 writes it in a call."""
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(gemma_value, value)) + "]"
    return json.dumps(value)


@st.composite
def gemma_replies(draw: st.DrawFn) -> str:
    parts = []
    for kind in draw(st.lists(st.sampled_from(["text", "thought", "call"]), max_size=5)):
        if kind == "text":
            parts.append(draw(TEXT))
        elif kind == "thought":
            parts.append(f"<|channel>thought\n{draw(TEXT)}<channel|>")
        else:
            parts.append(f"<|tool_call>call:{draw(NAME)}{gemma_value(draw(st.dictionaries(NAME, VALUE, max_size=4)))}"
                         "<tool_call|>")
    return "".join(parts) + draw(st.sampled_from(["", "<turn|>", "<eos>", "<|tool_response>"]))


@st.composite
def qwen_replies(draw: st.DrawFn) -> str:
    parts = []
    for kind in draw(st.lists(st.sampled_from(["text", "think", "call"]), max_size=5)):
        if kind == "text":
            parts.append(draw(TEXT))
        elif kind == "think":
            parts.append(f"<think>{draw(TEXT)}</think>")
        else:
            name = draw(st.sampled_from(["weather", "other"]))
            params = draw(st.lists(st.tuples(st.sampled_from(["city", "days", "metric", "hours", "scale", "x"]),
                                             st.sampled_from(["Oslo", "7", "3.0", "true", "0", "[1, 2]", "null",
                                                              "1e3", "nan", " 5 ", "x<y"])), max_size=4))
            body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
            parts.append(f"\n<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>")
    return "".join(parts) + draw(st.sampled_from(["", "<|im_end|>", "\n<|im_end|>\n<|endoftext|>"]))


def theirs(text: str, template: dict, prefix: str = "", tools: Any = None) -> Any:
    """transformers' message, or the kind of error it raised."""
    from transformers.utils.chat_parsing import parse_response as hf_parse_response

    try:
        return hf_parse_response(text, template, prefix=prefix, tools=tools)
    except (ValueError, KeyError):
        return ValueError


def ours(text: str, template: dict, prefix: str = "", tools: Any = None) -> Any:
    try:
        return parse_response(compile_template(template), text, prefix, tools)
    except ValueError:
        return ValueError


@HYPOTHESIS
@given(gemma_replies(), st.sampled_from(["", "<|turn>user\nhi<turn|>\n<|turn>model\n",
                                         "<|turn>model\n<|channel>thought\n", "<|turn>model\nSure: <|tool_call>"]))
def test_gemma4_replies_parse_as_in_transformers(reply: str, prefix: str) -> None:
    assert ours(reply, GEMMA4, prefix) == theirs(reply, GEMMA4, prefix)


@HYPOTHESIS
@given(qwen_replies(), st.sampled_from([None, TOOLS]), st.sampled_from(["", "<|im_start|>assistant\n<think>\n"]))
def test_xml_tool_calls_typed_by_the_tools_parse_as_in_transformers(reply: str, tools: Any, prefix: str) -> None:
    assert ours(reply, QWEN35, prefix, tools) == theirs(reply, QWEN35, prefix, tools)


@st.composite
def small_templates(draw: st.DrawFn) -> dict:
    """Response templates beyond Gemma 4's and Qwen 3.5's: other content parsers and their args, optional and
    repeated fields joined or not, lists of literal markers where one starts another, a second field, an implicit
    field with or without a close, and defaults."""
    kind = draw(st.sampled_from(["text", "int", "float", "bool", "json", "kv-lines"]))
    one: dict[str, Any] = {"open": draw(st.sampled_from(["<a>", ["<a>", "<a>b"], ["<a>b", "<a>"]])),
                           "close": draw(st.sampled_from(["</a>", ["</a>", "END"]])), "content": kind}
    args = {"strip": draw(st.booleans())} if draw(st.booleans()) else {}
    if kind == "json" and draw(st.booleans()):
        args["allow_non_json"] = True
    if kind == "kv-lines" and draw(st.booleans()):
        args["kv_sep"] = draw(st.sampled_from([":", "="]))
    if args:
        one["content_args"] = args
    if draw(st.booleans()):
        one["repeats"] = True
        if kind == "text" and draw(st.booleans()):
            one["join"] = draw(st.sampled_from(["", "|"]))
    if draw(st.booleans()):
        one["optional"] = draw(st.booleans())
    fields: dict[str, Any] = {"one": one}
    if draw(st.booleans()):
        fields["two"] = draw(st.sampled_from([{"open": "<b>", "close": "</b>"}, {"open": "<b>"}]))
    if draw(st.booleans()):
        fields["content"] = draw(st.sampled_from([{}, {"close": "END"}, {"close": ["END", "[S]"]},
                                                  {"content_args": {"strip": False}}]))
    template = {"start_anchor": "[S]", "fields": fields}
    if draw(st.booleans()):
        template["defaults"] = {"role": "assistant"}
    return template


SMALL_PIECES = st.sampled_from(["a", " ", "\n", "1", "true", "x:1", "k: v", "<a>", "<a>b", "<ab>", "</a>", "<b>",
                                "</b>", "[S]", "END", "0", "\t", "{", "}", ":"])


@settings(HYPOTHESIS, max_examples=600)
@given(small_templates(), st.lists(SMALL_PIECES, max_size=10).map("".join),
       st.sampled_from(["", "[S]", "x[S]<a>", "[S]a[S]", "<a>x"]))
def test_other_content_parsers_and_marker_lists_parse_as_in_transformers(template: dict, reply: str,
                                                                         prefix: str) -> None:
    """The differential tests above read with Gemma 4's and Qwen 3.5's templates alone: the other parsers (int,
    float, bool, json, kv-lines), strip, optional, join, lists of markers and a prompt with several start anchors
    (the reply's turn begins after the last) read the same message as transformers', or are refused as there."""
    assert ours(reply, template, prefix) == theirs(reply, template, prefix)


def one_field(field: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A template of `field` (named "one") and the implicit content field."""
    return {"start_anchor": "[S]", "defaults": defaults or {}, "fields": {"one": field, "content": {}}}


TWO_AT_ONE_PLACE = {"start_anchor": "[S]", "fields": {"one": {"open": "<x>", "close": "</x>"},
                                                      "two": {"open": "<x>y", "close": "</x>"}, "content": {}}}
OPEN_AT_A_CLOSE = {"start_anchor": "[S]", "fields": {"one": {"open": "<x>", "close": "</x>"},
                                                     "content": {"close": "<x>"}}}


@pytest.mark.parametrize("template, reply, expected", [
    # of markers found at one place, the longer wins: in one field's list, and between two fields; and an opening
    # wins over a closing
    (one_field({"open": ["<a>", "<a>b"], "close": "</a>"}), "<a>by</a>", {"one": "y"}),
    (TWO_AT_ONE_PLACE, "<x>yz</x>", {"two": "z"}),
    (OPEN_AT_A_CLOSE, "a<x>b</x>c", {"one": "b", "content": "c"}),
    # bool reads true in any case
    (one_field({"open": "<a>", "close": "</a>", "content": "bool"}), "<a> True </a>", {"one": True}),
    (one_field({"open": "<a>", "close": "</a>", "content": "bool"}), "<a>TRUE</a>x", {"one": True, "content": "x"}),
    # a default is kept even where it is empty
    (one_field({"open": "<a>", "close": "</a>"}, {"role": "assistant", "content": ""}), "",
     {"role": "assistant", "content": ""}),
    # join: the occurrences in the order written
    (one_field({"open": "<a>", "close": "</a>", "repeats": True, "join": "|"}), "<a>x</a><a> y</a>z",
     {"one": "x|y", "content": "z"}),
])
def test_markers_content_parsers_and_defaults_read_as_in_transformers(template: dict, reply: str,
                                                                      expected: Any) -> None:
    """Single cases the drawn templates above seldom meet, each as transformers' parse_response reads it."""
    assert theirs(reply, template) == expected
    assert ours(reply, template) == expected


TYPED_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "number"}, "b": {"type": ["integer", "boolean"]}, "flag": {"type": "boolean"},
    "n": {"oneOf": [{"type": "integer"}]}, "hours": {"type": "array"}}}}}]


def qwen_call(*params: tuple[str, str]) -> str:
    """A Qwen 3.5 call of f with these (key, value) parameters, as the model writes one."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"


ID_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "id": {"type": ["string", "integer"]}, "n": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "k": {"type": "integer"}}}}}]
QWEN35_JSON_VALUES = {**QWEN35, "fields": {**QWEN35["fields"], "tool_calls": {
    **QWEN35["fields"]["tool_calls"], "content_args": {**QWEN35["fields"]["tool_calls"]["content_args"],
                                                      "value_parser": {"name": "json"}}}}}


@pytest.mark.parametrize("template, reply, tools, expected", [
    # unquoted keys: text inside a quoted value that looks like a key was quoted ({"a":"x,"b":y"}), and a key after ", "
    # was not ({"a":1, b:2}): both replies were refused as JSON and answered as plain text, the call lost
    (GEMMA4, '<|tool_call>call:f{a:"x,b:y"}<tool_call|>', None, {"a": "x,b:y"}),
    (GEMMA4, "<|tool_call>call:f{a:1, b:2}<tool_call|>", None, {"a": 1, "b": 2}),
    (GEMMA4, '<|tool_call>call:f{ a : 1 ,b:{c :"d:e"}}<tool_call|>', None, {"a": 1, "b": {"c": "d:e"}}),
    # a string in JSON is one on purpose: a parameter whose schema allows strings keeps it (it was read as 7)
    (GEMMA4, '<|tool_call>call:f{id:<|"|>007<|"|>,n:<|"|>3.0<|"|>,k:<|"|>5<|"|>}<tool_call|>', ID_TOOLS,
     {"id": "007", "n": "3.0", "k": 5}),
    # merge_duplicates: a first value that is itself a list stays one value (it was spread into the merged list)
    (QWEN35_JSON_VALUES, "<tool_call>\n<function=f>\n<parameter=a>\n[1, 2]\n</parameter>\n<parameter=a>\n3\n"
     "</parameter>\n</function>\n</tool_call>", None, {"a": [[1, 2], 3]}),
    # typed by the schema: a number written 3.0 stays a float, a boolean written 0 is false; a type in a oneOf
    # counts as one in an anyOf; an array argument given twice is the list of both texts
    (QWEN35, qwen_call(("x", "3.0"), ("b", "1"), ("flag", "0"), ("n", "7")), TYPED_TOOLS,
     {"x": 3.0, "b": 1, "flag": False, "n": 7}),
    (QWEN35, qwen_call(("hours", "[1]"), ("hours", "[2]")), TYPED_TOOLS, {"hours": ["[1]", "[2]"]}),
])
def test_tool_call_arguments_read_as_in_transformers(template: dict, reply: str, tools: Any, expected: Any) -> None:
    """Compared as the JSON text the server sends, where 3 and 3.0, or 1 and true, differ (== takes them for equal)."""
    want = theirs(reply, template, tools=tools)
    assert want["tool_calls"][0]["function"]["arguments"] == expected  # (the case is transformers' reading)
    assert json.dumps(ours(reply, template, tools=tools), sort_keys=True) == json.dumps(want, sort_keys=True)


def settled_by_transformers(template: dict, text: str, prefix: str, cut: int) -> Any:
    """(the regions transformers' stream parser has closed, the open region's text it has let through) once fed
    `text` in two pieces at `cut`; or ValueError."""
    from transformers.utils.chat_parsing.response_parser import ResponseParser

    try:
        parser = ResponseParser(template, prefix=prefix)
        events = parser.initial_events + parser.feed(text[:cut]) + parser.feed(text[cut:])
    except (ValueError, KeyError):
        return ValueError
    closed, open_text = dict(template.get("defaults", {})), ""
    for event in events:
        if event["type"] == "region_close":
            repeats = template["fields"][event["field"]].get("repeats", False)
            closed[event["field"]] = closed.get(event["field"], []) + [event["value"]] if repeats else event["value"]
        open_text = open_text + event["text"] if event["type"] == "region_chunk" else ""
    return closed, open_text


@HYPOTHESIS
@given(st.sampled_from([("gemma", GEMMA4), ("qwen", QWEN35)]), st.data(), st.integers(0, 400), st.integers(0, 400),
       st.sampled_from(["", "<|turn>model\n<|channel>thought\n", "<|im_start|>assistant\n<think>\n"]))
def test_a_growing_reply_settles_what_transformers_stream_parser_settles(template: Any, data: Any, end: int,
                                                                         cut: int, prefix: str) -> None:
    """parse_partial, on a reply's start, closes the regions transformers' stream parser has closed by then and
    holds back the same tail (a marker's possible start, or a marker that could grow); Qwen's pattern that may
    start with whitespace holds the whitespace there, which is whitespace either side of the region (stripped)."""
    name, template = template
    reply = data.draw(gemma_replies() if name == "gemma" else qwen_replies())
    text = reply[: min(end, len(reply))]
    try:
        partial = parse_partial(compile_template(template), text, prefix)
        ours = (partial.closed, partial.text)
    except ValueError:
        ours = ValueError
    theirs = settled_by_transformers(template, text, prefix, min(cut, len(text)))
    if name == "qwen" and ours is not ValueError and theirs is not ValueError:
        ours, theirs = (ours[0], ours[1].rstrip()), (theirs[0], theirs[1].rstrip())
    assert ours == theirs


# Qwen 3.5's with markers that start with their literal (response._settles: Qwen 3.5's own settle too, through the
# whitespace their patterns start with), so that both kinds of marker are read on from where the last read stopped.
QWEN_SETTLING = json.loads(json.dumps(QWEN35))
QWEN_SETTLING["fields"]["tool_calls"]["open_pattern"] = r"<tool_call>\s*<function=(?P<name>[^>\n]+)>"
QWEN_SETTLING["fields"]["content"] = {"close": ["<|im_end|>", "<|endoftext|>"]}


def partial_or_error(read: Callable[[], Any]) -> Any:
    try:
        partial = read()
    except ValueError as exc:
        return type(exc), str(exc)
    return partial.closed, partial.open, partial.text, partial.opened_at, partial.closed_at


@HYPOTHESIS
@given(st.sampled_from([("gemma", GEMMA4, True), ("qwen", QWEN35, True), ("qwen", QWEN_SETTLING, True)]),
       st.data(), st.lists(st.integers(0, 400), max_size=12),
       st.sampled_from(["", "<|turn>model\n<|channel>thought\n", "<|im_start|>assistant\n<think>\n"]),
       st.sampled_from([None, TOOLS]))
def test_a_growing_reply_read_on_settles_what_it_settles_read_whole(template: Any, data: Any, cuts: list[int],
                                                                    prefix: str, tools: Any) -> None:
    """A stream read its reply whole at every chunk (parse_partial), a cost growing with its length squared.
    PartialReader reads on from where its last read stopped (a template whose markers settle once found, as Gemma
    4's do), and each of its reads is the whole read of the same text: the regions closed, the open one and its
    text, or the same error; a text that does not go on from the last one's (here: a shorter one) too."""
    name, spec, resumable = template
    reply = data.draw(gemma_replies() if name == "gemma" else qwen_replies())
    compiled = compile_template(spec)
    assert compiled.resumable is resumable
    reader = PartialReader(compiled, prefix, tools)
    ends = sorted(min(cut, len(reply)) for cut in cuts) + [len(reply)]
    if data.draw(st.booleans()):  # the same reply, read in an order that goes back too
        ends = [min(cut, len(reply)) for cut in cuts] + [len(reply)]
    for end in ends:
        whole = partial_or_error(lambda end=end: parse_partial(compiled, reply[:end], prefix, tools))
        assert partial_or_error(lambda end=end: reader.read(reply[:end])) == whole, reply[:end]


@pytest.mark.parametrize("name, spec, reply", [
    ("gemma", GEMMA4, f"<|tool_call>call:{{<|tool_call>call:ab{gemma_value({'c': 1})}<tool_call|>ok<turn|>"),
    ("qwen", QWEN_SETTLING, "<tool_call>x<tool_call>\n<function=weather>\n</function>\n</tool_call>ok<|im_end|>"),
])
def test_a_marker_at_the_text_end_after_a_start_that_came_to_nothing_takes_no_text_back(name: str, spec: Any,
                                                                                       reply: str) -> None:
    """A call's marker whose pattern match ended at the text's end was held back from its own start, past an earlier
    start of the marker that more text had already ruled out ('<|tool_call>call:{'); the next read, the match no
    longer at the end, held back from that earlier start: the open text read '<|tool_call>call:{', then '', and a
    reader going on from the first read missed the earlier start and read another message. Each read holds back
    from the earliest: its open text only grows, and reading on reads as reading whole."""
    compiled = compile_template(spec)
    reader, before = PartialReader(compiled), None
    for end in range(len(reply) + 1):
        partial = parse_partial(compiled, reply[:end])
        assert partial_or_error(lambda end=end: reader.read(reply[:end])) == partial_or_error(lambda p=partial: p)
        if before is not None and (before.closed, before.open) == (partial.closed, partial.open):
            assert partial.text.startswith(before.text), reply[:end]
        before = partial
    assert parse_response(compiled, reply)["content"].endswith("ok")


# Pieces of a Qwen reply where whitespace runs meet its markers, whose patterns take the whitespace before them
# (\s*<tool_call>, \s*<|im_end|>): runs before a marker, before text, at the end, and markers' starts alone.
QWEN_PIECES = st.sampled_from([" ", "\n", "  \n ", "\t", "a", "b.", "<", "<tool", "<tool_call>", "<|im_end|>",
                               "<|endoftext|>", "<|im_", "<think>", "</think>", "\n<tool_call>\n<function=weather>\n",
                               "<parameter=city>\nOslo\n</parameter>\n", "</function>", "</function>\n </tool_call>",
                               "</tool_call>"])


@HYPOTHESIS
@given(st.lists(QWEN_PIECES, max_size=16).map("".join), st.lists(st.integers(1, 6), min_size=1, max_size=4),
       st.sampled_from(["", "<|im_start|>assistant\n<think>\n"]), st.sampled_from([None, TOOLS]))
def test_a_qwen_reply_read_on_where_whitespace_runs_meet_its_markers(reply: str, steps: list[int], prefix: str,
                                                                    tools: Any) -> None:
    """Qwen 3.5's markers are patterns that take the whitespace before them (\\s*<tool_call>), and its replies were
    read whole at every chunk. They are read on now, and a chunk's edge inside a run of whitespace that a marker may
    yet follow (its match would start at the run's start) reads as the whole read of the same text: at chunks of
    any size, a run cut anywhere, before a marker, text or the reply's end."""
    compiled = compile_template(QWEN35)
    assert compiled.resumable
    reader, end = PartialReader(compiled, prefix, tools), 0
    for step in steps * (len(reply) + 1):
        end = min(end + step, len(reply))
        whole = partial_or_error(lambda end=end: parse_partial(compiled, reply[:end], prefix, tools))
        assert partial_or_error(lambda end=end: reader.read(reply[:end])) == whole, reply[:end]
        if end == len(reply):
            break


@pytest.mark.parametrize("pattern, settles", [
    (r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>", True), (r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", True),
    (r"\n?<x>", True), (r"[ \t]*\n?<x>", True), (r"<x>\s*", True),  # (a match at the text's end is held back)
    (r".*<x>", False),  # takes the head's start: a later <x> moves the match's end
    (r"\s*\n<x>", False), (r"\s*", False), (r"(?:ab|a)", False),  # the repeat takes \n; no literal; a starts ab
    (r"\s*?<x>", False), (r"(?:<a|<ab)", False),  # lazy; one text starts another (a later b lengthens <a)
    (r"(?:<a>|<ab>)", True),  # none starts another: at one place one of them at most
])
def test_which_patterns_settle_once_their_literal_is_found(pattern: str, settles: bool) -> None:
    """_settles: a marker pattern whose match no longer changes once its literal is found, so that a growing reply
    is read on from where the last read stopped: optional leading repeats of characters that the literal does not
    start with, literal texts, and repeats followed by a literal they cannot take."""
    from blockpress.response import _settles

    assert _settles(pattern) is settles


def test_a_growing_reply_holds_back_a_marker_that_may_be_starting() -> None:
    template = compile_template(GEMMA4)
    call = f"<|tool_call>call:weather{gemma_value({'city': 'Oslo'})}<tool_call|>"
    for text, content, calls in [("Checking <|tool_", "Checking", 0), ("Checking <|tool_call>call:wea", "Checking", 0),
                                 ("Checking." + call[:-1], "Checking.", 0), ("Checking." + call, "Checking.", 1),
                                 ("Checking." + call + call[:20], "Checking.", 1)]:
        partial = parse_partial(template, text)
        assert partial.settled_text("content") == content, text
        assert len(partial.closed.get("tool_calls", [])) == calls, text


@pytest.mark.parametrize("reply, settled", [("<a>  x", "x"), ("<a>x</a><a> y", "x|y"), ("<a>x</a>", "x")])
def test_a_fields_settled_text_is_the_start_of_its_whole_value(reply: str, settled: str) -> None:
    """settled_text, what a stream sends of a field so far: the open region's text trimmed on both sides as its whole
    value will be, after the field's closed occurrences joined as the whole value joins them (a delta sent is never
    taken back, so text the whole value lacks is a wrong reply)."""
    template = compile_template(one_field({"open": "<a>", "close": "</a>", "repeats": True, "join": "|"}))
    assert parse_partial(template, reply).settled_text("one") == settled
    assert parse_response(template, reply + "</a>")["one"].startswith(settled)


def test_a_gemma4_call_reads_as_the_call_written() -> None:
    args = {"city": "Paris, <FR>", "days": 3, "hours": [9, 12.5], "metric": True, "where": {"lat": 1}}
    reply = f"Checking.<|tool_call>call:weather{gemma_value(args)}<tool_call|><turn|>"
    message = parse_response(compile_template(GEMMA4), reply)
    assert message == {"role": "assistant", "content": "Checking.",
                       "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": args}}]}


@pytest.mark.parametrize("template, says", [
    ([], "expected a JSON object"),
    ({"fields": {"content": {}}}, "start_anchor"),
    ({"start_anchor": "x", "fields": {}}, "fields: expected a non-empty object"),
    ({"start_anchor": "x", "fields": {"a": {}, "b": {}}}, "only one field may have no open"),
    ({"start_anchor": "x", "fields": {"a": {"content": "yaml"}}}, "fields.a.content: expected one of"),
    ({"start_anchor": "x", "fields": {"a": {"open_pattern": "(?P<n>x"}}}, "fields.a.open_pattern: not a valid"),
    ({"start_anchor": "x", "fields": {"a": {"open_pattern": "(?P<n>x)"}}}, "only a transform can use"),
    ({"start_anchor": "x", "fields": {"a": {"open": "x", "transform": "id-{content}"}}}, "mixes a {placeholder}"),
    ({"start_anchor": "x", "fields": {"a": {"open": "x", "joins": ","}}}, "unknown keys ['joins']"),
    ({"start_anchor": "x", "fields": {"a": {"open": "x", "join": ","}}}, 'join: only with "repeats": true'),
    ({"start_anchor": "x", "version": 2, "fields": {"a": {}}}, "version"),
])
def test_a_bad_response_template_is_a_clear_error(template: Any, says: str) -> None:
    with pytest.raises(ValueError, match="response_template") as err:
        compile_template(template)
    assert says in str(err.value)


def test_a_template_reads_thoughts_with_a_reasoning_content_field_written_with_its_first_markers() -> None:
    """reads_thoughts: a template with a reasoning_content field gives a reply's thought apart (the server's
    reasoning_content, the chat command's dimmed thought), one without it gives none. reasoning_markers: the texts
    training writes a thought between, the first of each list, which is what the model writes; None where patterns
    mark the thought (they say how to read one, not how to write one)."""
    assert reads_thoughts(QWEN35) and reads_thoughts(GEMMA4)
    assert not reads_thoughts({"start_anchor": "x", "fields": {"content": {}}}) and not reads_thoughts(None)
    spec = {"fields": {"reasoning_content": {"open": ["<think>", "<thinking>"], "close": ["</think>", "</thinking>"]}}}
    assert reasoning_markers(spec) == ("<think>", "</think>")
    assert reasoning_markers({"fields": {"reasoning_content": {"open_pattern": "<t>", "close": "</t>"}}}) is None


def test_empty_matches_do_not_hang() -> None:
    template = {"start_anchor": "x", "fields": {"a": {"open_pattern": "", "close_pattern": ""}}}
    with pytest.raises(ValueError, match="empty text"):
        parse_response(compile_template(template), "abc")


# Nested repeats: the `regex` module, as `re`, tries every way to split a run of word characters between them, so a
# near miss of 40 characters takes hours (a minute at 28 under `re`, doubling with each one).
NESTED = r"(?:\w|\w\w)+"
NEAR_MISS = "w" * 40 + "!"


def raised_in_time(read: Callable[[], Any]) -> BaseException | None:
    """What `read()` raised (None: nothing), run in a thread that must end within a minute however long the
    pattern would have run: the test fails, where it would otherwise hang."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            read()
            raised.append(None)
        except BaseException as exc:  # (handed to the test)
            raised.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the read did not end"
    return raised[0]


@pytest.mark.parametrize("where, spec, prefix, reply, matched", [
    ("fields.tool_calls.open_pattern",
     {"fields": {"tool_calls": {"open_pattern": f"<call>{NESTED}:", "close": "</call>"}, "content": {}}}, "",
     f"Sure. <call>{NEAR_MISS}", ("<call>ab:", "")),
    ("fields.tool_calls.close_pattern",
     {"fields": {"tool_calls": {"open": "<call>", "close_pattern": f"{NESTED};"}, "content": {}}}, "",
     f"Sure. <call>{NEAR_MISS};", ("<call>ab;", "")),
    ("start_anchor", {"start_anchor_pattern": f"<model>{NESTED}\n", "fields": {"content": {}}}, f"<model>{NEAR_MISS}",
     "Hi.", ("Hi.", "<model>ab\n")),
    ("an xml-inline content's tag_pattern", {"fields": {"tool_calls": {
        "open": "<call>", "close": "</call>", "content": "xml-inline",
        "content_args": {"tag_pattern": f"<p=(?P<key>{NESTED})>(?P<value>.*?)</p>"}}, "content": {}}}, "",
     f"<call><p={NEAR_MISS}</call>", ("<call><p=ab>c</p></call>", "")),
])
def test_a_pattern_that_backtracks_without_end_is_refused_naming_it(where: str, spec: dict, prefix: str, reply: str,
                                                                    matched: tuple[str, str]) -> None:
    """A checkpoint's pattern with nested repeats held parse_response (so the server, or the caller) for hours on a
    reply, or a prompt, of 40 characters that almost matches it. Past the time one read may take it is refused,
    naming the pattern's place in the template, the pattern and the limit; the same template reads a reply that
    matches as before (a limit of 0.05 s here)."""
    spec = spec if "start_anchor_pattern" in spec else {"start_anchor": "<model>", **spec}
    template = compile_template(spec)
    raised = raised_in_time(lambda: parse_response(template, reply, prefix, budget=PatternBudget(seconds=0.05)))
    assert isinstance(raised, PatternTooCostly), raised
    assert str(raised).startswith("response_template")
    for says in (where, repr(NESTED)[1:-1], "ran past the 0.05 s that one read of a reply may take "
                 "(RESPONSE_PATTERN_SECONDS)"):
        assert says in str(raised)
    text, before = matched
    read = ours(text, spec, before)
    assert read == theirs(text, spec, before) and read is not ValueError


def test_a_streamed_replys_reads_share_one_budget() -> None:
    """A stream reads its reply again at each chunk (parse_partial), each read under the limit alone: the reads of
    one reply share one PatternBudget, whose total is bounded too, and once a read is refused every later one is
    refused at once, with the same words (the last parse_response included)."""
    template = compile_template({"start_anchor": "<model>", "fields": {
        "tool_calls": {"open_pattern": f"<call>{NESTED}:", "close": "</call>"}, "content": {}}})
    reply = f"Sure. <call>{NEAR_MISS}"
    budget = PatternBudget(seconds=60, total=0.05)
    reads = [lambda end=end: parse_partial(template, reply[:end], budget=budget) for end in range(1, len(reply) + 1)]
    raised = [raised_in_time(read) for read in reads + [lambda: parse_response(template, reply, budget=budget)]]
    first = next(i for i, exc in enumerate(raised) if exc is not None)
    # (the search that runs out is refused as it runs past; on a loaded machine the clock's time of the searches
    # before it may spend the budget first, and the next is refused unrun, naming the same limit)
    assert re.search(r"(ran past|spent) the 0\.05 s that all the reads of one reply may take together "
                     r"\(RESPONSE_PATTERN_TOTAL_SECONDS\)", str(raised[first])), str(raised[first])
    assert all(isinstance(exc, PatternTooCostly) and str(exc) == str(raised[first]) for exc in raised[first:])
    assert first > reply.index("<call>")  # the text before the near miss was read within the budget


def test_a_pattern_in_the_regex_modules_syntax_reads_as_in_transformers() -> None:
    """Patterns compile with the `regex` module, as transformers' do: a \\p{...} class (refused as an invalid
    expression under `re`) reads the same call."""
    template = {"start_anchor": "<model>", "fields": {
        "tool_calls": {"open_pattern": r"<call:(?P<name>\p{L}+)>", "close": "</call>", "content": "json",
                       "repeats": True, "transform": {"name": "{name}", "arguments": "{content}"}},
        "content": {}}}
    reply = 'Voilà <call:météo>{"ville": "Paris"}</call>'
    assert ours(reply, template) == theirs(reply, template) == {
        "content": "Voilà", "tool_calls": [{"name": "météo", "arguments": {"ville": "Paris"}}]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tok = train_bpe_tokenizer(["hello world, the weather in Paris"] * 4, vocab_size=300)
    tok.response_template = GEMMA4
    return tok


def gemma4_tokenizer(markers: list[str] | None = None) -> Tokenizer:
    """A tiny tokenizer with Gemma 4's markers (all of them, or `markers`) as special tokens, and no response
    template, as a real Gemma 4 or DiffusionGemma checkpoint has none."""
    tok = train_bpe_tokenizer(["hello world, the weather in Paris and Oslo"] * 4, vocab_size=300)
    tok.backend.add_special_tokens(list(GEMMA4_MARKERS if markers is None else markers) + ['<|"|>', "<|tool_response>",
                                                                                         "<tool_response|>"])
    return tok


def test_the_built_in_gemma4_template_reads_as_transformers_fallback(tmp_path: Path) -> None:
    """A Gemma 4 checkpoint ships no response_template, so its replies were text, calls and thought and all. A
    tokenizer with Gemma 4's markers as special tokens reads them with the built-in template, as transformers' server
    reads them with its fallback for "gemma4"; the built-in one is never saved, and a checkpoint's own wins."""
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    tok = gemma4_tokenizer()
    assert tok.response_template is None and tok.reply_template == GEMMA4
    paris, oslo = {"city": "Paris", "days": 2, "hours": [9, 12.5]}, {"city": "Oslo", "metric": True}
    reply = (f"<|channel>thought\nTwo cities.<channel|>Checking both.<|tool_call>call:weather{gemma_value(paris)}"
             f"<tool_call|><|tool_call>call:weather{gemma_value(oslo)}<tool_call|><|tool_response>")
    assert tok.decode(tok.encode(reply), skip_special_tokens=False) == reply  # (what the server reads)
    prefix = "<|turn>user\nWeather?<turn|>\n<|turn>model\n"
    message = tok.parse_response(reply, prefix)
    assert message == theirs(reply, _RESPONSE_TEMPLATE_FALLBACKS[("gemma4",)], prefix) == {
        "role": "assistant", "reasoning_content": "Two cities.", "content": "Checking both.",
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": paris}},
                       {"type": "function", "function": {"name": "weather", "arguments": oslo}}]}
    tok.save(tmp_path / "saved")
    assert "response_template" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    loaded = Tokenizer.from_dir(tmp_path / "saved")
    assert loaded.response_template is None and loaded.parse_response(reply, prefix) == message
    loaded.save(tmp_path / "again")  # loaded from a folder: saved as the folder had it, with none
    assert "response_template" not in json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())
    loaded.response_template = QWEN35  # the checkpoint's own wins
    assert loaded.reply_template == QWEN35 and loaded.parse_response("<think>a</think>b") == {
        "role": "assistant", "reasoning_content": "a", "content": "b"}
    # one marker missing, or only text: no reply format blockpress knows
    assert gemma4_tokenizer(list(GEMMA4_MARKERS[:-1])).reply_template is None
    plain = train_bpe_tokenizer(["hello world"] * 4, vocab_size=270)
    plain.backend.add_tokens(list(GEMMA4_MARKERS))  # tokens of their own, but not special ones
    assert plain.reply_template is None
    with pytest.raises(ValueError, match="response_template: this tokenizer has none"):
        plain.parse_response(reply)


def test_the_tokenizer_reads_keeps_and_saves_the_response_template_as_transformers_does(
        tok: Tokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok.save(tmp_path / "built")
    loaded = Tokenizer.from_dir(tmp_path / "built")
    assert loaded.response_template == GEMMA4
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "built"))
    assert hf.response_template == GEMMA4
    reply = 'Hi.<|tool_call>call:weather{city:<|"|>Oslo<|"|>}<tool_call|><turn|>'
    assert loaded.parse_response(reply) == hf.parse_response(reply, prefix="")
    hf.save_pretrained(tmp_path / "theirs")  # a checkpoint transformers wrote: read, and kept when saved again
    loaded = Tokenizer.from_dir(tmp_path / "theirs")
    assert loaded.response_template == GEMMA4
    loaded.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())["response_template"] == GEMMA4
    loaded.response_template = QWEN35  # changed since loading: saved as changed
    loaded.save(tmp_path / "changed")
    assert Tokenizer.from_dir(tmp_path / "changed").response_template == QWEN35
    loaded.response_template = None
    loaded.save(tmp_path / "none")
    assert "response_template" not in json.loads((tmp_path / "none" / "tokenizer_config.json").read_text())


def test_parse_response_without_a_template_says_so(tok: Tokenizer) -> None:
    bare = train_bpe_tokenizer(["abc"], vocab_size=270)
    with pytest.raises(ValueError, match="response_template: this tokenizer has none"):
        bare.parse_response("hi")
    with pytest.raises(ValueError, match="text: expected a str"):
        tok.parse_response([1, 2])  # type: ignore[arg-type]


# A template whose calls are a Python-style list, [f(a=1), g(b="x")] (content "python-call-list").
PYCALLS = {"start_anchor": "<start>", "fields": {
    "tool_calls": {"open": "<calls>", "close": "</calls>", "content": "python-call-list", "transform_each": True,
                   "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}},
    "content": {}}}
PY_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "s": {"type": "string"}, "b": {"type": "boolean"}}}}}]
# pieces of the grammar and of what it refuses: escapes, surrogates, numbers at the edges, names with - and .
PY_SCALARS = st.sampled_from([
    '"x"', "'y'", '"a\\nb"', "'\\u00e9'", '"\\ud83d\\ude00"', '"\\ud83d"', '"\\q"', '"\\/"', "'it\\'s'", '""', "'\"'",
    "1", "-0", "0.5", "1e3", "-2.5E-3", "9007199254740991", "9007199254740992", "-9007199254740991", "1e400",
    "01", "1.", ".5", "+1", "True", "true", "False", "None", "null", "none", "nan", "x", '"\n"', "[]", "{}"])


def test_python_call_lists_hold_numbers_and_nesting_to_their_limits():
    """Integers past JSON's safe range (a JavaScript client reads the arguments as float64) are refused on either
    side of zero, and lists nest at most _CALL_MAX_NESTING deep: the edges themselves pass."""
    from blockpress.response import _CALL_MAX_NESTING, _CallList

    assert _CallList(f"[f(a={2**53 - 1}, b={-(2**53 - 1)})]").calls()[0]["arguments"] == {"a": 2**53 - 1,
                                                                                        "b": -(2**53 - 1)}
    for text in (f"[f(a={2**53 + 1})]", f"[f(a={-(2**53 + 1)})]",
                 "[f(a=" + "[" * (_CALL_MAX_NESTING + 1) + "]" * (_CALL_MAX_NESTING + 1) + ")]"):
        with pytest.raises(ValueError):
            _CallList(text).calls()
    deep = "[" * _CALL_MAX_NESTING + "]" * _CALL_MAX_NESTING
    assert _CallList(f"[f(a={deep})]").calls()[0]["arguments"]["a"] is not None


@st.composite
def py_values(draw: Any, depth: int = 0) -> str:
    if depth >= 2 or draw(st.booleans()):
        return draw(PY_SCALARS)
    if draw(st.booleans()):
        return "[" + ", ".join(draw(st.lists(py_values(depth + 1), max_size=3))) + "]"
    keys = draw(st.lists(st.sampled_from(['"k"', "'j'", '"k"', "k", "1"]), max_size=3))
    return "{" + ", ".join(f"{k}: {draw(py_values(depth + 1))}" for k in keys) + "}"


@st.composite
def py_call_lists(draw: Any) -> str:
    space = st.sampled_from(["", " ", "\n", "\t ", "\r\n"])
    calls = []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["f", "get_weather", "ns.tool", "a-b", "_x1", "1f", "f-"]))
        args = [f"{draw(st.sampled_from(['a', 's', 'b', 'a', 'x_1', '2']))}{draw(space)}={draw(space)}"
                f"{draw(py_values())}" for _ in range(draw(st.integers(0, 3)))]
        tail = draw(st.sampled_from(["", "", "", ",", " ,"]))  # a trailing comma is refused
        calls.append(f"{name}{draw(space)}({draw(space)}{(',' + draw(space)).join(args)}{tail})")
    text = draw(space) + "[" + f",{draw(space)}".join(calls) + "]" + draw(space)
    if draw(st.integers(0, 3)) == 0:  # a stray character somewhere
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(list("[](){},=:'\"\\x1-. "))) + text[at:]
    return text


@HYPOTHESIS
@given(py_call_lists(), st.sampled_from([None, PY_TOOLS]))
def test_python_call_lists_parse_as_in_transformers(calls: str, tools: Any) -> None:
    """content "python-call-list" (it was refused as an unknown parser, so serve would not start on such a
    checkpoint): every call list, and every near miss, reads as transformers reads it or is refused as it is."""
    reply = f"ok <calls>{calls}</calls>"
    assert ours(reply, PYCALLS, tools=tools) == theirs(reply, PYCALLS, tools=tools)


def test_a_python_call_list_reads_into_calls_typed_by_the_tools() -> None:
    reply = "<calls>[f(a='7', s=\"007\", b=true), g(x=[1, {\"y\": None}])]</calls>"
    message = ours(reply, PYCALLS, tools=PY_TOOLS)
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "f", "arguments": {"a": 7, "s": "007", "b": True}},
        {"name": "g", "arguments": {"x": [1, {"y": None}]}}]
    assert message == theirs(reply, PYCALLS, tools=PY_TOOLS)


@pytest.mark.parametrize("calls", [
    "[f(a=" + "1" * 5000 + ")]",  # past Python's digits for int(): refused by the grammar's own limit, in its words
    "[f(a=" + "9" * 17 + ")]",  # past 16 digits
    '[f(s="\\udc00\\udc00")]',  # two low surrogates are no pair
    '[f(s="\\udbff\\udfff")]',  # the last pair
])
def test_a_python_call_lists_long_integers_and_surrogates_read_as_in_transformers(calls: str) -> None:
    """Integers past 16 digits are refused (past 4,300, int() itself would refuse them, with Python's words, not the
    parser's), and a \\u escape pairs a high surrogate with a low one only, as transformers' grammar reads them."""
    reply = f"<calls>{calls}</calls>"
    assert ours(reply, PYCALLS) == theirs(reply, PYCALLS)
    if theirs(reply, PYCALLS) is ValueError:
        with pytest.raises(ValueError, match="python-call-list"):
            parse_response(compile_template(PYCALLS), reply)


def test_a_closing_patterns_captures_reach_the_transform() -> None:
    """A closing marker's named groups are the region's, as its opening's are (they never reached the transform,
    while a template without a transform for them was refused as losing them)."""
    template = {"start_anchor": "<start>", "fields": {"content": {}, "tool_calls": {
        "open_pattern": r"<call:(?P<name>\w+)>", "close_pattern": r"</call:(?P<id>\w+)(?::(?P<name>\w+))?>",
        "repeats": True, "content": "json", "transform": {"id": "{id}", "name": "{name}", "arguments": "{content}"}}}}
    reply = 'hi <call:f>{"a": 1}</call:c7> and <call:g>{}</call:c8:h> bye'
    message = ours(reply, template)
    assert message["tool_calls"] == [{"id": "c7", "name": "f", "arguments": {"a": 1}},
                                     {"id": "c8", "name": "h", "arguments": {}}]  # the closing's wins over the opening's
    assert message == theirs(reply, template)


def test_a_transform_naming_a_key_of_a_text_value_is_a_clear_error() -> None:
    """A transform's {content.a} where the content read as text: refused naming the key, as transformers refuses it
    (not a TypeError from indexing a string)."""
    template = {"start_anchor": "[S]", "fields": {"one": {"open": "<a>", "close": "</a>",
                                                          "transform": {"x": "{content.a}"}}, "content": {}}}
    assert theirs("<a>abc</a>", template) is ValueError
    with pytest.raises(ValueError, match="has no key 'a'"):
        parse_response(compile_template(template), "<a>abc</a>")


XML_BY_TAG = {"start_anchor": "<start>", "fields": {"content": {}, "tool_calls": {
    "open_pattern": r"<call=(?P<name>\w+)>", "close": "</call>", "content": "xml-inline",
    "content_args": {"tag_pattern": r"<(?P<type>int|str|json|any) name=(?P<key>\w+)>(?P<value>.*?)</(?P=type)>",
                     "value_parser": {"name": "text", "args": {"strip": True}},
                     "value_parser_by": {"group": "type", "parsers": {"int": {"name": "int"}, "json": {"name": "json"}}}},
    "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}}}}


@pytest.mark.parametrize("tools", [None, PY_TOOLS])
@pytest.mark.parametrize("reply, arguments", [
    ('x <call=f><int name=a>7</int><str name=s>007</str><json name=b>[1]</json><any name=c> 5 </any></call>',
     {"a": 7, "s": "007", "b": [1], "c": "5"}),
    ("<call=f><str name=a>7</str></call>", {"a": "7"}),  # text by its tag, for an integer parameter of PY_TOOLS
])
def test_xml_inline_reads_each_value_by_its_tags_parser(tools: Any, reply: str, arguments: dict[str, Any]) -> None:
    """value_parser_by picks each value's parser from what a group of the tag captures, falling back to
    value_parser; the tools' schemas then leave the values as the reply typed them (it was ignored: every value
    was text, then typed by the schema)."""
    message = ours(reply, XML_BY_TAG, tools=tools)
    assert message["tool_calls"]["function"]["arguments"] == arguments
    assert message == theirs(reply, XML_BY_TAG, tools=tools)


@pytest.mark.parametrize("by, says", [
    ({"group": "kind", "parsers": {}}, "no group named 'kind'"),
    ({"group": "type"}, "value_parser_by: expected"),
    ("type", "value_parser_by: expected"),
])
def test_a_bad_value_parser_by_is_refused_naming_it(by: Any, says: str) -> None:
    field = XML_BY_TAG["fields"]["tool_calls"]
    template = {**XML_BY_TAG, "fields": {**XML_BY_TAG["fields"], "tool_calls": {
        **field, "content_args": {**field["content_args"], "value_parser_by": by}}}}
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_response(compile_template(template), "<call=f><int name=a>1</int></call>")


def xml_optional(tag_pattern: str, value_parser: dict[str, Any] | None = None) -> dict[str, Any]:
    """A template whose calls are tags of `tag_pattern`, each value read by `value_parser`."""
    args = {"tag_pattern": tag_pattern, **({"value_parser": value_parser} if value_parser else {})}
    return {"start_anchor": "<start>", "fields": {"content": {}, "tool_calls": {
        "open": "<call>", "close": "</call>", "content": "xml-inline", "content_args": args}}}


@pytest.mark.parametrize("parser", [{"name": "int"}, {"name": "json"}, {"name": "text"}])
def test_xml_inline_tag_whose_value_group_takes_no_part_is_a_reply_the_template_cannot_read(parser: Any) -> None:
    """A tag_pattern with an optional value group, <(?P<key>\\w+)(?:=(?P<value>[^>]*))?>, and a tag without one
    (<b>): its value parser was handed None, an AttributeError / TypeError that the readers, which answer a reply the
    template cannot read as text (they catch ValueError), let through. It is a ValueError naming the group and the
    tag; with no value parser the value is None, as in transformers (a pattern with no value group reads '')."""
    optional = r"<(?P<key>\w+)(?:=(?P<value>[^>]*))?>"
    template = xml_optional(optional, parser)
    with pytest.raises(ValueError, match=r"^xml-inline: the group 'value' of tag_pattern .* takes no part in the tag "
                                         rf"'<b>', so its value parser '{parser['name']}' has no text to read$"):
        parse_response(compile_template(template), "<call><a=1><b></call>")
    compiled = compile_template(template)
    assert answer_without_tools(lambda reply: parse_response(compiled, reply, keep_empty=True),
                                lambda: PartialReader(regions_only(compiled)), str, "hi <call><b></call>") is None
    assert ours("<call><a=1><b></call>", xml_optional(optional))["tool_calls"] == {"a": "1", "b": None}
    assert ours("<call><a=1><b></call>", xml_optional(optional)) == theirs("<call><a=1><b></call>", xml_optional(optional))
    assert ours("<call><a></call>", xml_optional(r"<(?P<key>\w+)>"))["tool_calls"] == {"a": ""}


def test_xml_inline_key_group_that_takes_no_part_is_not_called_missing() -> None:
    """An optional key group that takes no part in a tag was reported as "tag_pattern has no group named 'key'",
    which it has; the tag is what names no key."""
    with pytest.raises(ValueError, match=r"^xml-inline: the group 'key' of tag_pattern .* takes no part in the tag "
                                         r"'<=1>', which so names no key$"):
        parse_response(compile_template(xml_optional(r"<(?P<key>\w+)?=(?P<value>[^>]*)>")), "<call><=1></call>")
    with pytest.raises(ValueError, match=r"^xml-inline: tag_pattern .* has no group named 'key'$"):
        parse_response(compile_template(xml_optional(r"<(?P<name>\w+)=(?P<value>[^>]*)>")), "<call><a=1></call>")


def test_a_read_after_a_whole_replys_read_starts_over_even_after_a_failure() -> None:
    """A reader's read of a whole reply (ended=True) that failed, on a call cut inside its JSON, failed every later
    read of a longer text with the same words, where a fresh reader reads it."""
    cut = 'Sure. <|tool_call>call:get{city:<|"|>Par'
    whole = cut + 'is<|"|>}<tool_call|>'
    template = compile_template(GEMMA4)
    reader = PartialReader(template)
    with pytest.raises(ValueError):
        reader.read(cut, ended=True)
    fresh = PartialReader(template).read(whole)
    again = reader.read(whole)
    assert again.closed == fresh.closed and again.closed["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert reader.read(whole, ended=True).closed == PartialReader(template).read(whole, ended=True).closed


# ---------------------------------------------------------------------------------------------------------------
# A streamed reply read for its thought (response.AnswerStream, as the server and `blockpress chat` stream a reply to
# a request without tools): what is sent adds up to the whole answer (answer_without_tools, or the plain text).

GEMMA4_SPECIAL = re.compile("|".join(map(re.escape, (*GEMMA4_MARKERS, '<|"|>'))))


def gemma4_plain(raw: str) -> str:
    """The answer's text of a Gemma 4 reply: its special tokens left out, as a decode leaves them out."""
    return GEMMA4_SPECIAL.sub("", raw)


def streamed(pieces: list[str], calls_wanted: bool = False) -> tuple[AnswerStream, dict[str, Any]]:
    """A Gemma 4 reply streamed a token (piece) at a time through an AnswerStream, and its whole answer (the assistant
    message answer_without_tools reads in it, or its plain text where that is None)."""
    template = compile_template(GEMMA4)
    stream, raw, sent = AnswerStream(), "", {"content": "", "reasoning_content": ""}
    for piece in pieces:
        raw += piece
        deltas, _ = stream.advance(lambda: PartialReader(template), raw, gemma4_plain(raw), calls_wanted)
        for delta in deltas:
            for key, text in delta.items():
                sent[key] += text
    assert (sent["content"], sent["reasoning_content"]) == (stream.content, stream.reasoning)  # the deltas add up
    whole = answer_without_tools(lambda reply: parse_response(template, reply, keep_empty=True),
                                 lambda: PartialReader(regions_only(template)), gemma4_plain, raw)
    return stream, whole if whole is not None else {"role": "assistant", "content": gemma4_plain(raw)}


CALL = ["<|tool_call>", "call:weather{city:", '<|"|>', "Oslo", '<|"|>', "}", "<tool_call|>"]


def test_a_streamed_reply_without_tools_sends_no_thought_written_after_a_call() -> None:
    """A call where the request offers no tools makes the reply text (a thought after it too, which is not read
    apart): once the call opens the stream stops reading the template, so the thought written after it is not sent
    as reasoning_content, which the whole answer (its text) does not have."""
    stream, whole = streamed(["Checking.", *CALL, "<|channel>", "thought\nHmm.", "<channel|>", "Done."])
    assert whole == {"role": "assistant", "content": "Checking.call:weather{city:Oslo}thought\nHmm.Done."}
    assert stream.unread and stream.reasoning == "" and stream.content == "Checking."


@pytest.mark.parametrize("calls_wanted, sent", [(False, "  Hello there."), (True, "")])
def test_a_streamed_reply_opening_with_whitespace_sends_its_text_as_written(calls_wanted: bool, sent: str) -> None:
    """Without tools a reply with no thought is its plain text, leading whitespace and all (the template's content
    trims it): the stream sends that text as it is written, not nothing until the end. Where the request offers
    tools a call would make the answer the trimmed content, so nothing goes out before the call or the end."""
    stream, whole = streamed(["  ", "Hello", " there", "."], calls_wanted)
    assert stream.content == sent and stream.reasoning == ""
    if not calls_wanted:
        assert whole == {"role": "assistant", "content": "  Hello there."}


def test_a_thought_before_a_call_without_tools_keeps_the_text_before_and_after_it() -> None:
    """A thought then a call, without tools: the thought is reasoning_content (a stream sent it), the content the
    reply's text before the thought then after it (the call written as text), trimmed at its ends; what the stream
    sent of it is its start."""
    stream, whole = streamed(["Intro. ", "<|channel>", "thought\nHmm.", "<channel|>", "Checking.", *CALL])
    assert whole == {"role": "assistant", "content": "Intro. Checking.call:weather{city:Oslo}",
                     "reasoning_content": "Hmm."}
    assert stream.reasoning == "Hmm." and stream.content == "Intro."
    assert whole["content"].startswith(stream.content)


@pytest.mark.parametrize("pieces, content", [
    (["Checking.", *CALL], "Checking."),  # the text up to a call, all of it: the call is text, but no more is sure
    (["Hello", " there."], "Hello there."),
])
def test_a_streamed_reply_without_tools_sends_all_its_settled_text(pieces: list[str], content: str) -> None:
    """The content sent is the whole settled text, its last character too (common_prefix of the plain text and the
    template's content runs to their end where they agree)."""
    stream, whole = streamed(pieces)
    assert stream.content == content and whole["content"].startswith(content)


@settings(max_examples=100, deadline=None)
@given(st.text("ab", max_size=6), st.text("ab", max_size=6), st.text("ab", max_size=6), st.integers(0, 6))
def test_common_prefix_is_os_paths_from_what_was_sent(head: str, a: str, b: str, cut: int) -> None:
    """common_prefix compares from the end of what a stream sent where both texts start with it: the same
    os.path.commonprefix gives, whether both texts start with `known` or not, up to their last character."""
    a, b = head + a, head + b
    for known in (head[:cut], a[:cut], b, "b" + a):
        assert common_prefix(a, b, known) == os.path.commonprefix([a, b]), known
    assert common_prefix(a, a, "") == a


def test_transform_each_gives_an_items_key_over_a_capture_of_the_same_name() -> None:
    """With transform_each each item's keys join the region's captures in the transform's scope, and an item's key
    wins over a capture of the same name, as in transformers (process_field: {**captures, **item})."""
    template = {"start_anchor": "<start>", "fields": {"content": {}, "tool_calls": {
        "open_pattern": r"<calls from=(?P<name>\w+)>", "close": "</calls>", "content": "json", "transform_each": True,
        "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}}}}
    reply = 'ok <calls from=planner>[{"name": "weather", "arguments": {"city": "Oslo"}}, {"arguments": {}}]</calls>'
    message = ours(reply, template)
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}},
                                     {"type": "function", "function": {"name": "planner", "arguments": {}}}]
    assert message == theirs(reply, template)


def _json_before(text: str, args: dict) -> object:
    """response._json as first written: each stashed string put back with a str.replace over the whole text."""
    from blockpress.response import STASH_CLOSE, STASH_OPEN, parse_json

    strings: list[str] = []

    def stash(match: re.Match) -> str:
        strings.append(match.group(1))
        return f"{STASH_OPEN}{len(strings) - 1}{STASH_CLOSE}"

    rewritten = text
    for opener, closer in args["string_delims"]:
        rewritten = re.sub(re.escape(opener) + "(.*?)" + re.escape(closer), stash, rewritten, flags=re.DOTALL)
    rewritten = re.sub(r'"(?:\\.|[^"\\])*"|(?<=[{,])(\s*)(\w+)(\s*):',
                       lambda m: m.group(0) if m.group(2) is None else f'{m.group(1)}"{m.group(2)}"{m.group(3)}:',
                       rewritten)
    for i, string in enumerate(strings):
        rewritten = rewritten.replace(f"{STASH_OPEN}{i}{STASH_CLOSE}", json.dumps(string))
    try:
        return parse_json(rewritten)
    except json.JSONDecodeError:
        return text.strip()


_JSON_ARGS = {"string_delims": [['<|"|>', '<|"|>'], ["<<", ">>"]], "unquoted_keys": True, "allow_non_json": True}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(['<|"|>', "<<", ">>", "{", "}", "[", "]", ",", ":", "a", "b1", '"', "\\", " ", "1",
                                 "é"]), max_size=40))
def test_json_strings_put_back_in_one_pass_read_as_before(pieces: list[str]) -> None:
    """The json parser's delimited strings go back in one pass: the same value (or text) as one str.replace each."""
    from blockpress.response import parse_content

    text = "".join(pieces)
    assert parse_content(text, "json", _JSON_ARGS, PatternBudget()) == _json_before(text, _JSON_ARGS)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z]\w{0,3}", fullmatch=True),
                       st.lists(st.text('ab"\\{}:,<>|\n é', max_size=8).filter(lambda v: '<|"|>' not in v), max_size=3),
                       max_size=6))
def test_json_calls_of_delimited_strings_read_as_before(value: dict[str, list[str]]) -> None:
    """Gemma 4's calls, {key:<|"|>text<|"|>} and lists of them, strings with quotes, backslashes and braces."""
    from blockpress.response import parse_content

    text = "{" + ",".join(f"{k}:[" + ",".join(f'<|"|>{v}<|"|>' for v in vs) + "]" for k, vs in value.items()) + "}"
    got = parse_content(text, "json", _JSON_ARGS, PatternBudget())
    assert got == _json_before(text, _JSON_ARGS) == value


def test_a_call_with_many_delimited_strings_reads_in_time_linear_in_them() -> None:
    """A call's Gemma 4 strings (<|"|>...<|"|>, a list of file names, say) each went back with a str.replace over
    the whole text: 6,000 took 0.75-1.37 s and 25,000 21.6 s, on the server's event loop as a stream settles them.
    The time is this thread's CPU time, not the wall clock's: beside two busy processes (CI's other xdist worker on 2
    cores) the wall clock counts the time the thread waits for a core, and 1,500 against 6,000 strings took x8-x29."""
    import time

    template = compile_template(gemma4_response_template())

    def cost(n: int) -> float:
        reply = '<|tool_call>call:f{' + ",".join(f'k{i}:<|"|>v{i}<|"|>' for i in range(n)) + '}<tool_call|>'
        best = float("inf")
        for _ in range(5):  # the least of a few: a loaded machine only adds time (its caches shared)
            start = time.thread_time()
            out = parse_response(template, reply)
            best = min(best, time.thread_time() - start)
        assert len(out["tool_calls"][0]["function"]["arguments"]) == n
        return best

    small, large = cost(1500), cost(6000)
    # linear: x3.7-4.4 alone; the replace-per-string version: x20 (2.9 and 10.8 ms against 26 and 547 ms)
    assert large / small < 10, f"x4 strings took x{large / small:.1f} the time (linear: ~4, quadratic: ~20)"


@pytest.mark.parametrize("tools", [{"type": "function", "function": {"name": "weather"}}, "weather", 3])
def test_tools_that_are_not_a_list_are_refused_by_name(tools: Any) -> None:
    """apply_chat_template refuses one tool's dict; parse_response matched no tool with it (arguments left untyped),
    and crashed on an int with a bare TypeError."""
    with pytest.raises(ValueError, match=r"^tools: expected a list of tool schemas .*, got (dict|str|int)$"):
        parse_response(compile_template(GEMMA4), "hi", "", tools)
    assert parse_response(compile_template(GEMMA4), "hi", "", None)["content"] == "hi"
