"""Training data: SFT pairs from JSONL, raw-text corpora as memory-mapped token shards, canvas batches.

A training example is a prompt and a response (token ids). The response is cut into canvases; the
last canvas is completed with EOS (so the model learns where answers end), and one is always added
when the response fills its canvases exactly. Batches left-pad prompts so every row's canvases start
at the same slot; canvases a row does not have are padding, never attended and never scored.
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checks import check_text, warn_user
from .config import CHAT_TURNS
from .files import (
    KeyTwice,
    cr_alone_error,
    one_value_a_key,
    parse_json,
    text_of_file,
    undecodable_byte,
    utf16_note,
)
from .response import reasoning_markers
from .tokenizer import REASONING_FIELDS, chat_message


@dataclass
class Example:
    # Token ids: a list, or (JSONL examples, load_jsonl) an array("i"), 4 bytes a token where a list of ints takes
    # some 36: a file's examples are all held for the whole run (11 MB of memory per MB of JSONL as lists). An array
    # is not a list: == with a list (or an Example holding lists) is False and array + list raises; list(ex.prompt)
    # for a list. The prompt readers (lm.generate, chat_ids, ...) take an array as a list of ids; infill templates not
    prompt: Sequence[int]
    response: Sequence[int]
    ends: bool = True  # False for windows cut from running text: no EOS after the response
    # What split_heldout hashes in place of (prompt, response): an earlier turn of a chat carries its last turn's
    split_key: tuple[Sequence[int], Sequence[int]] | None = None
    # The prompt is a chat template's rendering (a `messages` record): its end is the template's turn header, never
    # healed (chat keeps it), where a prompt/response record's end is the user's text (Trainer.prompts_healed)
    templated: bool = False


@dataclass
class Batch:
    ids: torch.Tensor  # [B, P + N*C] clean tokens: left-padded prompt, then canvases
    valid: torch.Tensor  # [B, S] bool: real tokens (prompt tokens and the row's own canvases)
    scored: torch.Tensor  # [B, N*C] bool: canvas positions that carry a diffusion target
    ar_scored: torch.Tensor  # [B, S] bool: positions whose *next* token is an AR target
    prompt_length: int
    canvas_length: int

    @property
    def canvas_ids(self) -> torch.Tensor:
        return self.ids[:, self.prompt_length :]

    def rows(self, index: slice | torch.Tensor) -> Batch:
        return Batch(self.ids[index], self.valid[index], self.scored[index], self.ar_scored[index],
                     self.prompt_length, self.canvas_length)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.ids.to(device), self.valid.to(device), self.scored.to(device), self.ar_scored.to(device),
                     self.prompt_length, self.canvas_length)


def canvas_count(example: Example, canvas_length: int) -> int:
    """The whole canvases an example's response takes: with the EOS that make_batch puts after an answer (one more
    canvas when the response fills its canvases exactly), or, for a window of running text, no more than its own."""
    if example.ends:
        return len(example.response) // canvas_length + 1
    return max(1, -(-len(example.response) // canvas_length))


def make_batch(
    examples: Sequence[Example], canvas_length: int, pad_id: int, eos_id: int, max_canvases: int | None = None
) -> Batch:
    """Lay examples out as [left-padded prompt | canvases]; see the module docstring. The EOS that ends each answer
    (Example.ends) is put here, after its response: an Example's response holds no EOS of its own."""
    if not examples:
        raise ValueError("make_batch: no examples")
    c = canvas_length
    counts = [canvas_count(e, c) for e in examples]
    if max_canvases is not None:
        counts = [min(n, max_canvases) for n in counts]
    p = max(len(e.prompt) for e in examples)
    n = max(counts)
    b = len(examples)
    ids = torch.full((b, p + n * c), pad_id, dtype=torch.long)
    valid = torch.zeros(b, p + n * c, dtype=torch.bool)
    for i, (e, k) in enumerate(zip(examples, counts)):
        if not e.prompt:
            raise ValueError(f"example {i}: empty prompt (it needs at least a BOS token)")
        ids[i, p - len(e.prompt) : p] = torch.tensor(e.prompt)
        fill = eos_id if e.ends else pad_id
        body = (list(e.response) + [fill] * (k * c))[: k * c]
        ids[i, p : p + k * c] = torch.tensor(body)
        valid[i, p - len(e.prompt) : p + (k * c if e.ends else min(len(e.response), k * c))] = True
    scored = valid[:, p:].clone()
    # AR targets: every real token whose successor is real, up to and including the first EOS of the response.
    ar = valid.clone()
    ar[:, :-1] &= valid[:, 1:]
    ar[:, -1] = False
    for i, e in enumerate(examples):
        end = p + min(len(e.response), counts[i] * c)  # slot of the first EOS (or the end of the kept canvases)
        ar[i, end:] = False  # no next-token target after the EOS
    return Batch(ids, valid, scored, ar, p, c)


# -- JSONL ------------------------------------------------------------------------------------------------
def _ids_field(obj: dict, key: str, where: str) -> array[int]:
    value = obj[key]
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{where}: field {key!r} must be a list of integers")
    # held as an array("i") (Example): an id past its 32 bits is no vocabulary's, and said so rather than overflow
    if (bad := next((t for t in value if not -(2**31) <= t < 2**31), None)) is not None:
        raise ValueError(f"{where}: field {key!r}: {bad} is no token id (ids are 32-bit integers)")
    return array("i", value)




def parse_examples(obj: Any, tokenizer: Any, where: str, *, vocab_size: int | None = None,
                   context: tuple[int, int, int | None] | None = None, chat_turns: str = "all",
                   cut: list[tuple[str, bool]] | None = None) -> list[Example]:
    """The examples of one JSONL record: {"prompt", "response"} text, {"prompt_ids", "response_ids"}, or a
    {"messages"} chat. A chat gives one example per assistant turn that answers a user (chat_turns "all", as chat
    fine-tuning trains every reply), each prompted with the conversation before it, or the last turn alone ("last").
    `context`: as load_jsonl's. `cut`: the trained assistant turns whose content the chat template rendered only in
    part (content_cut) are appended to it, each as (where, whether its content holds a thought's opening marker), for
    the caller to warn once for all its records; None: this call warns of its own."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if not ({"prompt_ids", "response_ids", "messages"} & set(obj) or {"prompt", "response"} <= set(obj)):
        raise ValueError(f"{where}: expected 'prompt'+'response', 'messages', or 'prompt_ids'+'response_ids'")
    if chat_turns not in CHAT_TURNS:
        raise ValueError(f"chat_turns: expected one of {list(CHAT_TURNS)}, got {chat_turns!r}")
    # A record whose text is both a chat and a prompt/response (a leftover column) would train on the chat alone.
    # Fields of no whole text (ultrachat's `prompt` beside its `messages`, the nulls a dataframe export writes for
    # a row's missing columns) are metadata, as is the text beside token ids (they win: the text was tokenized).
    present = {k for k, v in obj.items() if v is not None}
    if {"messages", "prompt", "response"} <= present and not {"prompt_ids", "response_ids"} & present:
        raise ValueError(f"{where}: holds both a chat ('messages') and a 'prompt'+'response'; which one is this "
                         "record's text? One format a record (remove the other)")
    # the format its fields that hold values make (a null column beside them is none), else its fields' own
    keys = present if {"prompt_ids", "response_ids", "messages"} & present or {"prompt", "response"} <= present \
        else set(obj)
    if "prompt_ids" in keys or "response_ids" in keys:
        for key in ("prompt_ids", "response_ids"):
            if key not in keys:
                raise ValueError(f"{where}: has {'prompt_ids' if key == 'response_ids' else 'response_ids'} but no {key!r}")
        examples = [(where, Example(_ids_field(obj, "prompt_ids", where), _ids_field(obj, "response_ids", where)))]
    elif tokenizer is None:
        raise ValueError(f"{where}: text records need a tokenizer; this model has none (a fresh model takes "
                         "one with --tokenizer FOLDER; or write prompt_ids/response_ids)")
    elif "messages" in keys:
        turns_cut: list[tuple[str, bool]] = []
        examples = _chat_examples(obj["messages"], tokenizer, where, chat_turns, turns_cut, vocab_size, context)
        if cut is not None:
            cut += turns_cut
        elif turns_cut:
            warn_content_cut(turns_cut, tokenizer, where)
        return [ex for _, ex in examples]  # (each checked as it was made)
    else:
        for key in ("prompt", "response"):
            if not isinstance(obj[key], str):
                raise ValueError(f"{where}: field {key!r} must be a string")
            # a JSON escape of half an emoji ("\\ud83d", as scraped text holds) named here, with its field: the
            # tokenizer's own check names its parameter, "text", which this record has not
            check_text(obj[key], f"{where}: {key}")
        # A text longer than the context times the longest token's characters cannot fit: refused before it is
        # tokenized, as the server refuses a request's (a response of 8 MB took 17 s and 1.4 GB to refuse by its
        # tokens; 100 MB ran out of memory). With max_canvases a response of any length is cut to fit.
        most = tokenizer.longest_token() if context is not None else 0
        if context is not None and len(obj["prompt"]) > context[1] * most:
            raise ValueError(f"{where}: 'prompt': {len(obj['prompt']):,} characters cannot fit the model's context of "
                             f"{context[1]} tokens (no token of this vocabulary holds more than {most} characters, so "
                             f"a text of more than {context[1] * most:,} is refused before it is tokenized)")
        prompt = tokenizer.encode_prompt(obj["prompt"])
        room = 0 if context is None else context[1] - len(prompt)  # the positions the response may take
        if context is not None and room < context[0]:  # not one canvas of response fits, however it is cut
            raise ValueError(f"{where}: 'prompt': {len(prompt)} tokens leave {max(room, 0)} of the model's context of "
                             f"{context[1]} positions, less than one canvas of response ({context[0]})")
        if context is not None and not context[2] and room > 0 and len(obj["response"]) > room * most:
            fits = room // context[0]  # canvases of response the context has room for, as check_fits says
            hint = f"; --max-canvases {fits} keeps the first {fits} canvases of each response and fits it" if fits else ""
            raise ValueError(f"{where}: 'response': {len(obj['response']):,} characters cannot fit the {room} positions "
                             f"that the model's context of {context[1]} leaves after a prompt of {len(prompt)} tokens "
                             f"(no token of this vocabulary holds more than {most} characters, so a response of more "
                             f"than {room * most:,} is refused before it is tokenized){hint}")
        # make_batch ends it with EOS, as an ids record
        response = _kept_response(tokenizer, obj["response"], context)
        examples = [(where, Example(array("i", prompt), array("i", response)))]
    for at, ex in examples:
        _check_example(ex, at, vocab_size, context)
    return [ex for _, ex in examples]


def _kept_response(tokenizer: Any, text: str, context: tuple[int, int, int | None] | None,
                   end: int | None = None) -> list[int]:
    """The ids of a response (a prompt/response record's, or a chat's reply): whole, or with max_canvases
    (context[2]) the first max_canvases canvases of them, which are all make_batch lays out. A response far longer is
    cut before it is tokenized: a 12 MB one kept to 4 canvases took 230 s and 3 GB to tokenize whole, and the hint of
    the refusal without --max-canvases (a 48 MB response) led there. The text kept holds at least a canvas more tokens
    than are kept (no token holds more than longest_token characters), and where the tokenizer splits at
    _PIECE_BOUNDARY (encode_document) it is cut at one a canvas past that at most, so the ids kept are the whole text's;
    another tokenizer's cut, or one in a stretch without a boundary (base64, minified JSON: encoded whole, it was 1.7 M
    ids kept of 2 MB), changes at most its last tokens, in the canvas dropped. (A response no longer than that is kept
    whole, as before: split_heldout hashes the ids kept.) `end`: a chat reply's end of turn (turn_end_id): a reply kept
    whole ends at its last one (_chat_examples says why); a reply cut is read up to the end marker's last text where
    that falls within the text kept (a template can write more than a canvas after it: a closing line when the chat
    ends with the assistant), and ends there as a whole one does, so its ids are the whole reply's too."""
    if context is not None and context[2]:
        keep = context[2] * context[0]
        limit = (keep + context[0]) * tokenizer.longest_token()
        if len(text) > limit and _splits_at_boundaries(tokenizer):
            # (within a canvas's characters more: a blob followed by a line far on was encoded up to that line)
            cut = _PIECE_BOUNDARY.search(text, limit, limit + context[0] * tokenizer.longest_token())
            limit = cut.start() if cut else limit
        if len(text) > limit:
            marker = tokenizer.decode([end], skip_special_tokens=False) if end is not None else ""
            last = text.rfind(marker) if marker else -1
            if last < 0 or last + len(marker) > limit:  # the end of turn (if any) is past the text kept
                return tokenizer.encode(text[:limit])[:keep]
            # what follows the end of turn is the template's, no more the reply's: the text up to it is short
            return _ended(tokenizer.encode(text[: last + len(marker)]), end)[:keep]
    return _ended(tokenizer.encode(text), end)


def _ended(ids: list[int], end: int | None) -> list[int]:
    """`ids` up to their last `end` (a chat reply's end of turn; _chat_examples says why), all of them without one."""
    if end is not None and end in ids:
        ids = ids[: len(ids) - ids[::-1].index(end)]
    return ids


# the roles chat templates render ("developer": OpenAI's system role, rendered as "system" unless the template has a
# place of its own for it)
KNOWN_ROLES = ("system", "developer", "user", "assistant", "model", "tool")


def _chat_examples(messages: Any, tokenizer: Any, where: str, chat_turns: str, cut: list[tuple[str, bool]],
                   vocab_size: int | None, context: tuple[int, int, int | None] | None) -> list[tuple[str, Example]]:
    """(where, example) of each assistant turn of a `messages` record trained on (parse_examples); `where` names
    the turn when there are several. The turns whose content the template rendered only in part are named in `cut`.
    Each example is checked (_check_example) as it is made: the first turn too long for `context` stops the record."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        raise ValueError(f"{where}: 'messages' must be a list ending with an assistant message")
    if messages[-1].get("role") not in ("assistant", "model"):  # named: "Assistant" and "bot" are typos to see
        raise ValueError(f"{where}: messages[{len(messages) - 1}].role is {messages[-1].get('role')!r}; the last "
                         "message must be the assistant's ('assistant' or 'model'), the reply trained on")
    # as `blockpress serve` reads a request's messages, so the model is prompted as it was trained (every turn is
    # rendered with the tokenizer's default template)
    developer = tokenizer.renders_developer()
    chat = [chat_message(message, i, developer) for i, message in enumerate(messages)]
    replies = [i for i, message in enumerate(chat) if message["role"] in ("assistant", "model")]
    asked = next((i for i, message in enumerate(chat) if message["role"] == "user"), len(chat))
    last = replies[-1]
    if asked > last:
        # the model would learn to answer no one: a prompt of a system turn, or of nothing but the template
        # a role of another name there is most likely the user's, mistyped ("usr", "human")
        other = next((i for i, message in enumerate(chat[:last]) if message["role"] not in KNOWN_ROLES), None)
        named = (f" (messages[{other}].role is {chat[other]['role']!r}, not one of {list(KNOWN_ROLES)})"
                 if other is not None else "")
        raise ValueError(f"{where}: 'messages' has no user message before the assistant's (messages[{last}]){named}; "
                         "give the user turn it answers before it")
    # An earlier turn before any user turn (a greeting) is context only: it answers no one. A turn of tool calls alone
    # is trained on as the template writes the calls.
    trained = [i for i in replies if i > asked] if chat_turns == "all" else [last]
    end = tokenizer.turn_end_id()
    examples = []
    for i in trained:
        at = f"{where}: messages[{i}]" if len(trained) > 1 else where
        prompt = str(tokenizer.apply_chat_template(chat[:i], add_generation_prompt=True))
        prompt, reply = _rendered_reply(tokenizer, chat, i, prompt, at)
        content = chat[i].get("content")
        if isinstance(content, str) and content_cut(content, reply):
            markers = reasoning_markers(tokenizer.reply_template)
            cut.append((f"{where}: messages[{i}]", markers is not None and markers[0].strip() in content))
        # The reply ends at the template's end of turn (Gemma's <end_of_turn>, Gemma 4's <turn|>), then the EOS
        # make_batch adds: what the template writes after it (a newline) is between turns, where generation has
        # stopped, and the next turn's prompt holds it. With max_canvases a long reply is cut before it is tokenized,
        # as a prompt/response record's response is (_kept_response): it was tokenized whole for the canvases kept.
        response = _kept_response(tokenizer, reply, context, end)
        example = Example(array("i", tokenizer.encode(prompt)), array("i", response), templated=True)
        # now, not once every turn is made: each renders the whole chat before it, so a chat of 600 turns spent 6 s
        # making the turns after the one that could never fit
        _check_example(example, at, vocab_size, context)
        examples.append((at, example))
    # A later turn's prompt holds the earlier replies: the turns of a conversation fall on one side of the held-out
    # split together, that of its last turn (split_heldout), the side the conversation takes when only it is trained on.
    key = (examples[-1][1].prompt, examples[-1][1].response)
    for _, ex in examples[:-1]:
        ex.split_key = key
    return examples


def content_cut(content: str | None, reply: str) -> bool:
    """Whether the rendered assistant turn `reply` lost text of its message's `content`: the content, whitespace aside
    (templates trim it, and may lay a thought out on lines of their own), is not in it. Gemma 4's template strips a
    thought written in content (<|channel>thought ...<channel|>), so the turn trains on the answer alone."""
    if not isinstance(content, str):  # (tool calls alone: no content)
        return False
    squeezed = "".join(content.split())
    return bool(squeezed) and squeezed not in "".join(reply.split())


def warn_content_cut(turns: list[tuple[str, bool]], tokenizer: Any, where: str) -> None:
    """One warning for the assistant turns `turns` ((where, whether its content holds a thought's opening marker),
    where "file:line: messages[i]") whose content the chat template rendered only in part (content_cut), of the
    records read at `where`: the turns train on what it rendered, which a user whose data was cut must hear of."""
    markers = reasoning_markers(tokenizer.reply_template)
    thoughts = sum(thought for _, thought in turns)
    many = len(turns) > 1
    hint = ""
    if markers and thoughts:
        held = f"{thoughts} of them hold" if many else "it holds"
        hint = (f"; {held} a thought in content ({markers[0].strip()}...{markers[1].strip()}), which the template "
                "strips: give it as the message's reasoning_content to train on it")
    warn_user(f"{where}: the chat template leaves out part of the assistant's content in {len(turns)} "
              f"turn{'s' if many else ''} trained on ({'the first at ' if many else ''}{turns[0][0]}), which "
              f"train{'' if many else 's'} on the turn as the template renders it{hint}")


def _rendered_reply(tokenizer: Any, chat: list[dict[str, Any]], i: int, prompt: str, where: str) -> tuple[str, str]:
    """(the prompt to train with, the text of assistant turn chat[i] as the chat template writes it after `prompt`
    (chat[:i] rendered with add_generation_prompt=True)): the rendering of chat[:i+1] past that prompt, as TRL cuts a
    completion, so tool calls are in the template's own format and the turn ends with its own end marker. Its thought
    (reasoning_content), where the template does not render it (Gemma 4's tool-less turns), goes first, between the
    markers of the tokenizer's response template's reasoning field; a thought neither can write is refused, never
    dropped. The prompt is `prompt`, but where it ends with an empty thought the turn does not hold (below)."""
    full = str(tokenizer.apply_chat_template(chat[: i + 1], add_generation_prompt=False))
    # Google's Gemma 4 template, thinking off, ends its generation prompt with a closed, empty thought
    # (<|channel>thought\n<channel|>) that no rendered turn holds: the turn is cut after the prompt without it. A turn
    # without a thought trains after the whole prompt (what the server prompts with); one with a thought trains
    # after the prompt without it, the thought in the reply, else it would follow an empty one.
    markers = reasoning_markers(tokenizer.reply_template)
    empty = markers[0] + markers[1] if markers else ""
    start = prompt
    if empty and prompt.endswith(empty) and not full.startswith(prompt) and full.startswith(prompt[: -len(empty)]):
        start = prompt[: -len(empty)]
    if not full.startswith(start):
        raise ValueError(f"{where}: the chat template renders the conversation up to messages[{i}] differently from "
                         f"the prompt before it (messages[:{i}] with add_generation_prompt=True is not its start), so "
                         "the assistant's turn cannot be cut from it to train on")
    reply = full[len(start):]
    if chat[i].get("tool_calls"):  # a template that writes no tool calls (Phi-3.5's, Granite 3.3's) would teach an
        # empty turn where the model should call the tool: refused, as a thought it cannot write is
        callless = {key: value for key, value in chat[i].items() if key != "tool_calls"}
        try:
            without = str(tokenizer.apply_chat_template([*chat[:i], callless], add_generation_prompt=False))
        except ValueError:  # a template that refuses a turn with neither content nor calls (Ministral 3's) writes them
            without = None
        if without == full:
            raise ValueError(f"{where}: messages[{i}].tool_calls: the chat template does not render tool calls, so "
                             "the turn would train without them; write the calls in the content as the model should, "
                             "or use a template that renders tool_calls")
    field, thought = next(((k, chat[i][k]) for k in REASONING_FIELDS if chat[i].get(k) is not None), (None, None))
    if field is None or thought == "":
        return prompt, reply
    if not isinstance(thought, str):
        raise ValueError(f"{where}: messages[{i}].{field}: expected text, got {type(thought).__name__}")
    bare = {key: value for key, value in chat[i].items() if key not in REASONING_FIELDS}
    if str(tokenizer.apply_chat_template([*chat[:i], bare], add_generation_prompt=False)) != full:
        return start, reply  # the template writes the thought itself (Qwen 3's <think>...</think>)
    if markers is None:
        raise ValueError(f"{where}: messages[{i}].{field}: the chat template does not render the assistant's thought, "
                         "and the tokenizer's response template has no reasoning_content field with open and close "
                         "texts to write it between, so it cannot be trained on; leave the field out to train the "
                         "turn without it")
    return start, markers[0] + thought + markers[1] + reply


def _check_example(ex: Example, where: str, vocab_size: int | None, context: tuple[int, int, int | None] | None) -> None:
    """Refuse an example with no prompt, ids outside the vocabulary, or (given `context`) too long for the model."""
    if not ex.prompt:
        raise ValueError(f"{where}: empty prompt")
    if vocab_size is not None:
        bad = [t for ids in (ex.prompt, ex.response) for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if context is not None:
        check_fits(ex, where, context)


def check_fits(ex: Example, where: str, context: tuple[int, int, int | None], flag: str = "--max-canvases") -> None:
    """Refuse an example whose prompt and whole canvases of response (as make_batch lays them out, the first
    max_canvases only when set) take more positions than the model has: it would train positions the model is
    never allowed to use. `context`: as load_jsonl's; `flag`: what the error names to cut responses short."""
    canvas, positions, max_canvases = context
    canvases = canvas_count(ex, canvas)  # whole canvases, the EOS included (make_batch)
    length = len(ex.prompt) + min(canvases, max_canvases or canvases) * canvas
    if length > positions:
        fits = (positions - len(ex.prompt)) // canvas  # canvases of response the context has room for
        cut = f"; {flag} {fits} keeps the first {fits} canvases of each response and fits it" if fits >= 1 else ""
        raise ValueError(f"{where}: prompt and response take {length} positions (a prompt of {len(ex.prompt)} "
                         f"tokens and a response of {len(ex.response)}, in whole canvases of {canvas}), more than "
                         f"the model's context of {positions}{cut}")


def jsonl_objects(path: Path, read: Callable[[int], None] | None = None) -> Iterator[tuple[str, Any]]:
    """("file:line", the decoded JSON value) of each non-blank line; errors name the file and line. `read(size)`:
    called with the bytes of each line, blank ones too, before its value is given (load_jsonl's progress)."""
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            if read is not None:
                read(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not valid UTF-8 ({undecodable_byte(exc)}){utf16_note(raw)}") from None
            if n == 1:  # a byte-order mark, as some Windows editors write: json.loads refuses it
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                obj = parse_json(line, object_pairs_hook=one_value_a_key)
            except json.JSONDecodeError as exc:
                # a file of CR-alone line ends is one line, refused as "Extra data": said why, as --input says it
                raise cr_alone_error(where, raw) or ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            except KeyTwice as exc:  # json.loads keeps the last value: the first response would be silently lost
                raise exc.said_at(where) from None
            yield where, obj


def is_glob(path: str | Path) -> bool:
    """A pattern to expand: it holds *, ? or [ and names no file or folder that exists. A path that exists is
    read as it is (as a shell passes on a pattern that matches nothing): "data [v2]/train.jsonl" was a character class
    that matched no file, so the file itself was refused (and the folder "data [v2]" read as raw text)."""
    return any(c in str(path) for c in "*?[") and not Path(path).exists()


def jsonl_files(path: str | Path) -> list[Path]:
    """The JSONL files `path` names: itself (a name ending .jsonl), the files a glob matches when all are .jsonl
    (a glob matching .jsonl and other files is refused),
    or a folder's .jsonl files (searched recursively; its .md files are left out: dataset cards, see
    left_out), sorted; [] else. A folder of .jsonl and also .txt/.py files is refused: which one was meant?"""
    text = str(path)
    if is_glob(text):
        matches = sorted(glob.glob(text, recursive=True))  # ** is any depth, as in a shell's globstar and HF datasets
        jsonl = [Path(m) for m in matches if m.lower().endswith(".jsonl")]
        other = [m for m in matches if not m.lower().endswith(".jsonl")]
        if jsonl and other:  # read as token shards, it would fail on the other file's missing sidecar
            more = f" and {len(other) - 3} more" if len(other) > 3 else ""
            raise ValueError(f"{path}: matches JSONL files ({', '.join(map(str, jsonl[:3]))}"
                             f"{' and more' if len(jsonl) > 3 else ''}) and also {', '.join(other[:3])}{more}, which "
                             f"{'is' if len(other) == 1 else 'are'} not JSONL; a glob names JSONL files or token shards, not both: narrow it (e.g. "
                             f"'{Path(text).parent / '*.jsonl'}')")
        return jsonl
    if text.lower().endswith(".jsonl"):
        return [Path(path)]
    if Path(path).is_dir():
        files = _folder_files(Path(path))
        jsonl, raw = files[".jsonl"], files[".txt"] + files[".py"]
        if jsonl and raw:
            raise ValueError(f"{path}: holds JSONL files ({_some(jsonl, path)}) and raw text ({_some(raw, path)}); "
                             "a data folder is one or the other: move one kind out, or name the JSONL files with a "
                             f"glob ('{Path(path) / '*.jsonl'}')")
        return jsonl
    return []


def left_out(path: str | Path, own_run: str | Path | None = None) -> str | None:
    """A note of what a data folder leaves out, or None when it leaves nothing out: a folder of JSONL its .md
    files (a README.md or dataset card beside the data, as datasets are shipped, is not training text), and any
    folder its hidden files and training runs' folders (_folder_files; `own_run`, the run reading the data, unsaid).
    Raises
    jsonl_files' errors: a folder or glob of JSONL and other files."""
    jsonl = jsonl_files(path)
    cards = _folder_files(Path(path))[".md"] if jsonl and Path(path).is_dir() else []
    hidden = hidden_data_files(path)
    folder = Path(path)
    runs = sorted(_folder_walk(folder)[1]) if folder.is_dir() and not is_glob(path) else []
    runs = [run for run in runs if own_run is None or run.resolve() != Path(own_run).resolve()]
    notes = [f"leaves out {_some(cards, path)} (a .md file beside .jsonl files is taken for a dataset card, not "
             "data)"] if cards else []
    if runs:
        notes.append(f"leaves out {len(runs)} training run folder{'s' if len(runs) > 1 else ''} ({_some(runs, path)}: "
                     "one holding a trainer_state.pt, a blockpress train_config.json or a run's metrics.jsonl log)")
    if hidden:
        notes.append(f"leaves out {len(hidden)} hidden file{'s' if len(hidden) > 1 else ''}, named or inside a "
                     f"folder named with a leading '.' ({_some(hidden, path)}): a .venv or .git is no training "
                     "data (name such a folder itself to train on it)")
    if not notes:
        return None
    return f"reads {_some(jsonl, path)}; " * bool(cards) + "; ".join(notes)


TRAIN_CONFIG_FILE = "train_config.json"  # a training run's settings, beside its trainer_state.pt (train.py)
TRAINER_STATE_FILE = "trainer_state.pt"  # a run's step, optimizer state, ...: written last, the save's commit marker
METRICS_FILE = "metrics.jsonl"  # a run's log (train.py), a row a line: all a run that stopped before its first save left


# TrainConfig settings every blockpress version has saved: steps, batch_size and lr alone are every tool's (a
# t5 run's train_config.json beside a user's data had its folder left out as a run of ours)
_RUN_CONFIG_KEYS = frozenset({"steps", "batch_size", "lr", "aux_ar_weight", "self_conditioning_prob", "t_eps"})


def _is_run_config(path: Path) -> bool:
    """Whether `path` is a training run's train_config.json (TrainConfig's settings: _RUN_CONFIG_KEYS among them),
    not a file of another tool that bears the name: its folder, data and all, was left out unsaid."""
    if path.name != TRAIN_CONFIG_FILE:
        return False
    try:
        saved = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and _RUN_CONFIG_KEYS <= saved.keys()


def _is_run_log(path: Path) -> bool:
    """Whether `path` is a training run's metrics.jsonl: empty (a run that diverged before it logged a row), its
    first line cut short (a run killed as it wrote it), or one of the run's rows ({"step": ..., "loss": ...}); not
    data that happens to bear the name."""
    if path.name != METRICS_FILE:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except (OSError, ValueError):
        return False
    try:
        row = parse_json(first)
    except ValueError:
        return True
    return isinstance(row, dict) and "step" in row and ("loss" in row or "stopped" in row)


def _run_folders(folder: Path, paths: list[Path]) -> set[Path]:
    """The training runs' folders below `folder` among its `paths` (_folder_files says why they are no data)."""
    return {p.parent for p in paths if (p.name == TRAINER_STATE_FILE or _is_run_config(p) or _is_run_log(p))
            and p.parent != folder}


def _folder_files(folder: Path, hidden: bool = False) -> dict[str, list[Path]]:
    """A data folder's files of each suffix that data is read from (.jsonl and TEXT_SUFFIXES), searched recursively,
    each list sorted. Hidden files and folders (a name starting with ".") are left out, as git and ls leave them:
    a project folder's .venv put its site-packages into the training text (91% of the tokens of a one-file project),
    and a .ipynb_checkpoints folder a second copy of each file. `hidden`: those left out, instead.

    A training run's folder below `folder` (one holding a trainer_state.pt or TrainConfig's train_config.json, or the
    log of a run that stopped before its first save) is left out too, its files being the run's, not data: `train
    --data . --out run` read run/metrics.jsonl as data when it was resumed (or run again after a divergence at step
    2), and every later run on the same folder failed on it."""
    return {suffix: list(files) for suffix, files in _folder_walk(folder)[0][hidden].items()}


# A walk of a data folder: its files of each data suffix, not hidden (False) and hidden (True), and the training
# runs' folders below it (_folder_files)
FolderWalk = tuple[dict[bool, dict[str, list[Path]]], set[Path]]
# The walks made inside folders_listed_once(), by folder; None outside it, where each look walks the folder afresh
_WALKS: ContextVar[dict[Path, FolderWalk] | None] = ContextVar("_WALKS", default=None)


@contextmanager
def folders_listed_once() -> Iterator[None]:
    """Within it each data folder is walked once, however many of jsonl_files, is_examples, left_out, load_text, ...
    look at it: `train` walked a --data folder 9 times before its first step, outside any bar (200k small files: 6
    minutes without a sign, the tokenizing a few seconds of it). For the span of a command's reading of its data,
    over which the folder is taken not to change."""
    token = _WALKS.set({})
    try:
        yield
    finally:
        _WALKS.reset(token)


def _folder_walk(folder: Path) -> FolderWalk:
    """`folder` walked (_folder_files' lists, hidden and not, and its runs' folders), or the walk made of it already
    inside folders_listed_once()."""
    walks = _WALKS.get()
    if walks is not None and folder in walks:
        return walks[folder]
    found: dict[bool, dict[str, list[Path]]] = {hidden: {suffix: [] for suffix in (".jsonl", *TEXT_SUFFIXES)} for hidden in (False, True)}
    paths = sorted(folder.rglob("*"))
    runs = _run_folders(folder, paths)
    for file in paths:
        suffix = file.suffix.lower()
        if suffix in found[False] and not runs.intersection(file.parents) and file.is_file():
            found[any(part.startswith(".") for part in file.relative_to(folder).parts)][suffix].append(file)
    if walks is not None:
        walks[folder] = (found, runs)
    return found, runs


def named_files(path: str | Path) -> set[Path]:
    """Every file `path` may read data from, resolved: itself, a glob's matches, or a folder's data files (the
    suffixes of _folder_files, whichever kind the folder turns out to hold); for telling two flags' files apart."""
    if is_glob(path):
        return {Path(m).resolve() for m in glob.glob(str(path), recursive=True) if Path(m).is_file()}
    if Path(path).is_dir():
        return {f.resolve() for files in _folder_files(Path(path)).values() for f in files}
    return {Path(path).resolve()} if Path(path).is_file() else set()


def hidden_data_files(folder: str | Path) -> list[Path]:
    """The files of a data folder that load_text and load_jsonl leave out as hidden (_folder_files), for a message."""
    folder = Path(folder)
    if not folder.is_dir() or is_glob(folder):
        return []
    return sorted(f for files in _folder_files(folder, hidden=True).values() for f in files)


def _some(files: Sequence[Path], folder: str | Path, shown: int = 3) -> str:
    """A few of `files` by their names inside `folder`, for a message."""
    names = [str(f.relative_to(folder)) for f in files[:shown]]
    return ", ".join(names) + (f" and {len(files) - shown} more" if len(files) > shown else "")


def load_jsonl(path: str | Path, tokenizer: Any = None, vocab_size: int | None = None,
               context: tuple[int, int, int | None] | None = None, chat_turns: str = "all", *,
               progress: Callable[[int, int], None] | None = None) -> list[Example]:
    """The examples of every record of a JSONL file (or of the files a glob or folder of them holds, in name order:
    jsonl_files; a chat record gives one per assistant turn trained on: parse_examples); errors name the file and
    line. `context`: (canvas length, the model's max positions, the most canvases a response keeps or None), to
    refuse an example that would not fit before a batch allocates it. `progress(done, total)`: called with the bytes
    read so far and in all, after each record (800k prompt/response records took 150 s to tokenize, 10k chats 70 s)."""
    out = []
    cut: list[tuple[str, bool]] = []  # warned of once for the whole data, not a line per record
    files = jsonl_files(path) or [Path(path)]
    done, total = 0, sum(file.stat().st_size for file in files if file.is_file())  # (a missing one: its error)

    def read(size: int) -> None:
        nonlocal done
        done += size

    records = (record for file in files for record in jsonl_objects(file, read))
    for where, obj in records:
        try:
            out += parse_examples(obj, tokenizer, where, vocab_size=vocab_size, context=context,
                                  chat_turns=chat_turns, cut=cut)
        except (ValueError, TypeError) as exc:  # the tokenizer's and chat template's own messages lack the line
            message = str(exc)
            raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None
        if progress is not None:
            progress(done, total)
    if not out:
        raise ValueError(f"{path}: no examples")
    if cut:
        warn_content_cut(cut, tokenizer, str(path))
    return out


def split_digests(examples: Sequence[Example]) -> list[str]:
    """Short digests of examples' content (split_heldout's _digest), sorted: what a run records of the examples it
    holds out, so that --resume can tell whether it holds out the same ones (Trainer.resume). A digest of the token
    ids, as the split is made by them: a change to how blockpress tokenizes a record changes both."""
    return sorted(_digest((e.prompt, e.response)).hex()[:16] for e in examples)


def split_heldout(examples: Sequence[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """Deterministic held-out split by content hash (stable across runs and machines); the turns of one chat are
    held out together (Example.split_key). An example also trained on is no held-out example: its copies that a
    held-out record holds (a conversation's first turn, which its extension by one more turn, a record of its own in
    chat-tree datasets, repeats) train, so no example is on both sides."""
    if not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
        raise ValueError(f"heldout: expected a fraction in [0, 1), got {fraction!r}")
    # each example's content by the SHA-1 of its ids as JSON, its side by that digest's first 4 bytes, as before (the
    # JSON texts themselves, held for every example at once, took more memory than the examples' arrays: 7.8 MB
    # against 6.6 for 4 MB of JSONL)
    own = [_digest((e.prompt, e.response)) for e in examples]
    sides = [int.from_bytes((_digest(e.split_key) if e.split_key else key)[:4], "big") / 0xFFFFFFFF < fraction
             for e, key in zip(examples, own)]
    # (not whole groups of records joined by a shared turn: chats that open with one canned exchange would then be one
    # group, and --heldout would hold out none of them or all)
    trained = {key for key, held_out in zip(own, sides) if not held_out}
    train: list[Example] = []
    held: list[Example] = []
    for e, key, held_out in zip(examples, own, sides):
        (held if held_out and key not in trained else train).append(e)
    if not train:  # (else: "split_heldout: the held-out fraction left no training examples", naming no setting)
        raise ValueError(f"heldout: {fraction} holds out all {len(examples)} example{'s' if len(examples) > 1 else ''}, "
                         "leaving none to train on (each is held out by a hash of its content: a few examples, or "
                         "copies of one, fall together); give a smaller fraction, or 0")
    return train, held


def _digest(ids: tuple[Sequence[int], Sequence[int]]) -> bytes:
    """split_heldout's hash of a (prompt, response): the same for lists and arrays of the same ids."""
    return hashlib.sha1(json.dumps([list(ids[0]), list(ids[1])]).encode()).digest()


# -- raw corpora -------------------------------------------------------------------------------------------
def write_shard(path: str | Path, token_lists: Iterable[list[int]], vocab_size: int) -> int:
    """Concatenate documents into one flat uint16/uint32 file; returns the token count."""
    dtype = np.uint16 if vocab_size <= 65_536 else np.uint32
    total = 0
    with open(path, "wb") as f:
        for ids in token_lists:
            arr = np.asarray(ids, dtype=dtype)
            f.write(arr.tobytes())
            total += len(arr)
    Path(str(path) + ".json").write_text(json.dumps({"dtype": np.dtype(dtype).name, "tokens": total}))
    return total


SHARD_DTYPES = ("uint16", "uint32")  # what write_shard writes: token ids are unsigned integers
# Where shards come from, for messages an installed user reads: the corpus script is in the source repository,
# not in the wheel, so a bare "scripts/..." pointed at nothing there.
SHARD_SOURCE = ("blockpress.data.write_shard writes them with their sidecars; scripts/build_code_corpus.py "
                "in a clone of the blockpress repository builds a corpus of them")


def shard_files(pattern: str, flag: str) -> list[str]:
    """The token shards a glob names (their .json sidecars are not shards), or a clear error."""
    path = Path(pattern)
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {pattern}: is a directory; expected a .jsonl file or a glob of token shards "
                                f"(e.g. {pattern}/*.bin)")
    if path.is_file() and not Path(f"{pattern}.json").is_file():  # one file, and not a shard: say what would do
        with path.open("rb") as f:
            starts = f.read(64).decode("utf-8", "replace").lstrip("\ufeff \t\r\n")
        rename = f"; it starts with '{{': if it is JSONL, rename it to {path.with_suffix('.jsonl').name}" if starts[:1] == "{" else ""
        if starts[:1] == "[":  # a JSON array of records, as Alpaca-style datasets ship: one object a line is JSONL
            import shlex

            rename = (f"; it starts with '[': a JSON array of records is written as JSONL, one object a line, by "
                      f"python -c \"import json,sys; [print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]\" "
                      f"{shlex.quote(str(path))} > {shlex.quote(str(path.with_suffix('.jsonl')))}")
        raise ValueError(f"{flag} {pattern}: expected a .jsonl file (one JSON object per line) or token shards, each "
                         f"with its .json sidecar ({SHARD_SOURCE}){rename}")
    files = [pattern] if path.is_file() else sorted(f for f in glob.glob(pattern, recursive=True)
                                                    if not f.endswith(".json"))
    if not files:
        raise FileNotFoundError(f"{flag} {pattern}: no token shards match (expected a .jsonl file or a glob of "
                                ".bin shards, each with its .json sidecar)")
    return files


def _open_shard(path: Path, vocab_size: int | None) -> np.ndarray:
    """Memory-map one shard after checking its sidecar against the file: a dtype write_shard writes, a token
    count that matches the bytes, and (given vocab_size) ids the model has."""
    sidecar = Path(str(path) + ".json")
    try:
        meta = parse_json(sidecar.read_text(encoding="utf-8-sig"))  # whatever the locale's encoding
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read its sidecar {sidecar.name} ({exc}); token shards come with one "
                         f"({SHARD_SOURCE})") from None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    if dtype not in SHARD_DTYPES:
        raise ValueError(f"{sidecar}: \"dtype\" must be one of {list(SHARD_DTYPES)}, got {dtype!r}")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise ValueError(f"{path}: {size} bytes is not a whole number (> 0) of {dtype} tokens")
    with path.open("rb") as f:
        # np.save's file: its header (magic, then a dict as text) would be read as tokens, silently where the sidecar
        # gives no count (a uint16 shard would begin 20115, 19797, 22864, ...). Raw ids never start so: these are 3
        # uint16 ids in a row, or one uint32 id past any vocabulary.
        if f.read(6) == b"\x93NUMPY":
            raise ValueError(f"{path}: is a NumPy .npy file (np.save), whose header would be read as tokens; a token "
                             f"shard holds the raw ids alone: write it with write_shard, or with "
                             f"ids.astype(np.{dtype}).tofile(path) beside its sidecar")
    tokens = meta.get("tokens")
    if tokens is not None and tokens != size // itemsize:
        raise ValueError(f"{sidecar}: says {tokens!r} tokens, but {path.name} holds {size // itemsize} {dtype} tokens")
    array = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    if vocab_size is not None:
        top = int(array.max())  # one pass over the file, once: an out-of-range id would fail deep in torch
        if top >= vocab_size:
            raise ValueError(f"{path}: holds token id {top}, outside the model's vocabulary of {vocab_size}")
    return array


class TokenShards:
    """Memory-mapped token files; windows are cut into a random-length prompt and a response."""

    def __init__(self, paths: Sequence[str | Path], vocab_size: int | None = None):
        self._hold([_open_shard(Path(p), vocab_size) for p in paths])

    @classmethod
    def of_tokens(cls, tokens: np.ndarray) -> TokenShards:
        """One shard held in memory: raw text tokenised as a shard file would hold it (see load_text)."""
        shards = cls.__new__(cls)
        shards._hold([tokens])
        return shards

    def _hold(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self.documents: int | None = None  # raw text's documents (load_text); None: shard files, as written
        self.sizes = np.array([len(a) for a in self.arrays])
        if self.sizes.sum() == 0:
            raise ValueError("TokenShards: the shards hold no tokens")

    @property
    def tokens(self) -> int:
        return int(self.sizes.sum())

    def sample(self, generator: torch.Generator, prompt_range: tuple[int, int], response_length: int) -> Example:
        lo, hi = prompt_range
        plen = int(torch.randint(lo, hi + 1, (), generator=generator))
        need = plen + response_length
        weights = torch.tensor(np.maximum(self.sizes - need + 1, 0), dtype=torch.float)  # each shard's windows
        if weights.sum() == 0:
            raise ValueError(f"TokenShards: no shard holds a {need}-token window (the longest holds "
                             f"{int(self.sizes.max())} tokens; a window is a prompt of prompt_min..prompt_max tokens "
                             "and response_canvases canvases)")
        shard = int(torch.multinomial(weights, 1, generator=generator))
        start = int(torch.randint(0, int(self.sizes[shard]) - need + 1, (), generator=generator))
        window = self.arrays[shard][start : start + need].astype(np.int64).tolist()
        return Example(window[:plen], window[plen:], ends=False)


# -- raw text ---------------------------------------------------------------------------------------------
TEXT_SUFFIXES = (".txt", ".py", ".md")  # files read as raw text, alone or in a folder


def is_raw_text(path: str | Path) -> bool:
    """A folder, a .txt/.py/.md file, or JSONL (jsonl_files) whose first record is {"text": ...}."""
    files = jsonl_files(path)
    if not files:
        return Path(path).is_dir() or Path(path).suffix.lower() in TEXT_SUFFIXES
    if not files[0].is_file():  # a folder named x.jsonl is a mistake load_jsonl names
        return False
    # the first record of the first file holding one (an empty first file decided nothing), by the fields that hold
    # a value: a dataframe's export writes {"text": ..., "prompt": null, "response": null}
    first = next((obj for f in files if f.is_file() for _, obj in jsonl_objects(f)), None)
    given = {k for k, v in first.items() if v is not None} if isinstance(first, dict) else set()
    return "text" in given and not {"prompt", "response", "messages", "prompt_ids", "response_ids"} & given


def is_examples(path: str | Path) -> bool:
    """JSONL examples: a .jsonl file, or a glob or folder of them (jsonl_files), that is not raw text (is_raw_text)."""
    return bool(jsonl_files(path)) and not is_raw_text(path)


# Where a byte-level BPE's pre-tokenizer (GPT-2's split, what train_bpe_tokenizer makes) always ends a piece: before
# a line that starts with a non-space character after one that ends with one, and before a space between two of
# them ("a b" is "a", " b"). Only whitespace runs span characters of two kinds there, and a non-space character
# never joins one, so no piece spans such a point, and the text's ids are those of its two sides. In any script
# (it was printable ASCII only: a Russian or Greek file had no such point, and was encoded whole, at some 200 bytes
# of memory a character); Python's \s is a superset of the pattern's Unicode White_Space, so a character that may be
# either is never cut beside.
_PIECE_BOUNDARY = re.compile(r"(?<=\S\n)(?=\S)|(?<=\S)(?= \S)")
DOCUMENT_CHUNK = 1 << 18  # characters encoded at once, at most (but for a stretch without a boundary)


def _splits_at_boundaries(tokenizer: Any) -> bool:
    """Whether encode_document may encode `tokenizer`'s text in pieces (_PIECE_BOUNDARY): a byte-level BPE that
    splits by GPT-2's pattern, adds no prefix space (each piece would get one), normalizes nothing, and has no added
    token holding whitespace or taking the whitespace beside it (lstrip / rstrip / single_word, as RoBERTa's <mask>:
    either could span a boundary). Other tokenizers encode a document whole."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:  # a stand-in tokenizer (tests)
        return False
    try:
        import tokenizers

        pre = backend.pre_tokenizer
        return (isinstance(pre, tokenizers.pre_tokenizers.ByteLevel) and pre.use_regex and not pre.add_prefix_space
                and backend.normalizer is None
                and not any(any(c.isspace() for c in t.content) or t.lstrip or t.rstrip or t.single_word
                            for t in backend.get_added_tokens_decoder().values()))
    except (AttributeError, ImportError):  # a stand-in tokenizer (tests), or none of tokenizers'
        return False


def encode_document(tokenizer: Any, text: str, chunk: int | None = None) -> list[int]:
    """tokenizer.encode(text), the same ids, encoded in pieces of about `chunk` characters where the tokenizer
    allows (_splits_at_boundaries): see _encoded_pieces."""
    return [t for _, piece in _encoded_pieces(tokenizer, text, chunk) for t in piece]


def _encoded_pieces(tokenizer: Any, text: str, chunk: int | None = None) -> Iterator[tuple[int, list[int]]]:
    """The ids of `text` a piece at a time, each with the piece's length in characters (for a progress bar):
    tokenizers holds some 500 bytes per token of one string while it encodes it (an 18 MB .txt file peaked at
    3.1 GB; a 100 MB one would take 17 GB), so a large file or {"text"} line is encoded in pieces cut at
    _PIECE_BOUNDARY, whose ids are the whole text's. A tokenizer that may merge across such a point gets the text
    whole. `chunk`: characters a piece takes at least, DOCUMENT_CHUNK unless given."""
    chunk = chunk or DOCUMENT_CHUNK
    if len(text) <= chunk or not _splits_at_boundaries(tokenizer):
        yield len(text), tokenizer.encode(text)
        return
    start = 0
    while start < len(text):
        cut = _PIECE_BOUNDARY.search(text, start + chunk) if len(text) - start > chunk else None
        end = cut.start() if cut else len(text)
        yield end - start, tokenizer.encode(text[start:end])
        start = end


def load_corpus(path: str, flag: str, tokenizer: Any, vocab_size: int, *,
                progress: Callable[[int, int], None] | None = None) -> TokenShards:
    """Running text to train or evaluate on, as `blockpress train` and a Trainer read it: raw text (a .txt/.py/.md
    file, a folder of them, JSONL lines {"text": ...}) tokenised in memory (load_text, `progress` alike), or a glob of
    token shards; errors name `flag` (--data, heldout_data)."""
    if is_examples(path):  # neither running text nor shards, whatever its name
        raise ValueError(f"{flag} {path}: JSONL examples (prompt/response, messages or ids); running text is "
                         "{\"text\": ...} JSONL lines, a .txt/.py/.md file or a folder of them, or a glob of token "
                         "shards")
    if not is_raw_text(path):
        return TokenShards(shard_files(path, flag), vocab_size)
    try:
        return load_text(path, tokenizer, vocab_size, progress=progress)
    except (ValueError, OSError) as exc:  # their messages start with the path
        raise type(exc)(f"{flag} {exc}") from None


def load_text(path: str | Path, tokenizer: Any, vocab_size: int | None = None, *,
              progress: Callable[[int, int], None] | None = None) -> TokenShards:
    """Raw text as one in-memory shard, laid out as write_shard lays out documents (scripts/build_code_corpus.py:
    each document's tokens, then EOS), so training cuts it into windows as it cuts token shards. `path`: a
    .txt/.py/.md file, a folder of them (searched recursively), or JSONL lines {"text": ...} (a file, a glob or
    a folder of them: jsonl_files). `progress(done, total)`: called with the characters tokenized so far and in all,
    first with none done, then after each piece of a document (a corpus of hundreds of MB takes minutes)."""
    files = jsonl_files(path)  # {"text"} lines: a file, a glob or a folder of them
    path = Path(path)
    if tokenizer is None:
        raise ValueError(f"{path}: raw text needs a tokenizer; this model has none (a fresh model takes one with "
                         "--tokenizer FOLDER)")
    if not files and path.is_dir():
        found = _folder_files(path)
        files = sorted(f for suffix in TEXT_SUFFIXES for f in found[suffix])
        if not files:
            raise ValueError(f"{path}: a folder without {'/'.join(TEXT_SUFFIXES)} or .jsonl files (token shards are "
                             f"given as a glob, e.g. {path}/*.bin)")
    elif not files and is_glob(path):  # a glob is for token shards or JSONL files
        raise ValueError(f"{path}: raw text is given as one file or a folder of them (searched recursively), not "
                         "a glob; globs are for token shards and JSONL files")
    files = files or [path]
    texts: list[tuple[str, str]] = []  # (where, text)
    for file in files:
        if file.suffix.lower() == ".jsonl":
            for where, obj in jsonl_objects(file):
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ValueError(f"{where}: expected {{\"text\": string}} like the file's first line")
                # (the tokenizer's own check of a lone surrogate, "\\ud83d", would name no file or line)
                texts.append((where, check_text(obj["text"], f"{where}: text")))
            continue
        if not file.is_file():  # (read_text's own error puts "[Errno 2]" before the path)
            raise FileNotFoundError(f"{file}: no such data file")
        try:
            data = file.read_bytes()
        except OSError as exc:  # unreadable: the path first, as every error here
            raise OSError(f"{file}: cannot be read ({exc.strerror or exc})") from None
        try:
            # a byte-order mark (Notepad's "UTF-8 with BOM") is no text to train on, as JSONL leaves it out
            # (jsonl_objects): read with it, it would be three tokens of U+FEFF before each such document
            texts.append((str(file), text_of_file(data)))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{file}: not valid UTF-8 ({undecodable_byte(exc)}){utf16_note(data[:2])}"
                             ) from None
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    # Each piece's ids as a compact array as soon as it is encoded (a document's Python list of ints takes 36 bytes a
    # token, and the int64 corpus 8), uint16 in the end where the ids fit, as write_shard's shards
    documents = [text for _, text in texts if text.strip()]
    tokens: list[np.ndarray] = []
    done, total = 0, sum(map(len, documents))
    if progress is not None:  # the total at once: a bar without one, over one large file, showed nothing for minutes
        progress(done, total)
    for text in documents:
        for length, ids in _encoded_pieces(tokenizer, text):  # (a large document a piece at a time: its bar moves)
            tokens.append(np.array(ids, dtype=np.uint32))
            done += length
            if progress is not None:
                progress(done, total)
        tokens.append(np.array(eos, dtype=np.uint32))
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.uint32)
    if vocab_size is not None and len(flat) and int(flat.max()) >= vocab_size:
        raise ValueError(f"{path}: the tokenizer gives id {int(flat.max())}, outside the model's vocabulary of "
                         f"{vocab_size}")
    if not len(flat):
        raise ValueError(f"{path}: no text")
    shards = TokenShards.of_tokens(flat.astype(np.uint16) if int(flat.max()) < 65_536 else flat)
    shards.documents = len(documents)  # (what `train` says it read: files, lines)
    return shards
