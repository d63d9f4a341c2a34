"""An OpenAI-compatible HTTP server for block-diffusion models (FastAPI + uvicorn).

Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics (Prometheus text).
With an api_key (serve's --api-key / BLOCKPRESS_API_KEY), every /v1 request must send it as `Authorization:
Bearer <key>`, else a 401 (RequireKey); /health and /metrics stay open. Every answer carries its request's
X-Request-Id (the client's, or one made: RequestId), which the log lines of its failure name.

One worker thread owns the model. Requests wait in a bounded queue (429 when full; a client that left frees its
place at once). The worker keeps several batches running, each its own stream, and advances them in turn a canvas
at a time; between canvases it starts a batch of the oldest waiting request plus every waiting one with the same
batch-wide sampler settings, while the rows of all running batches stay within `max_batch`. So requests that arrive
together share each denoising step, and one that arrives while a long one runs starts at its next canvas instead of
waiting for its end. The queue and `max_batch` count rows: one per sampled choice. Their lengths may differ: each row has its own
max_tokens and min_tokens, and a row whose max_tokens is spent leaves the batch, as one that wrote EOS does. So
may `temperature` (above 0), `top_p` and `top_k`, which real clients vary most: each row draws its candidates with
its own (sampling.RowDraws). The rest (temperature 0, which takes the most likely candidates, the penalties and the
diffusion fields) is the batch's. Each request's jobs are checked alone (the library's own checks) before they are queued, so a
value one client sends gets its request a 400 naming the field, and never fails a batch that others joined.
Every row's randomness comes from its own seed, so in float32 a response is the same whether it ran alone or in
a batch, up to rounding (a batch left-pads shorter prompts, and the other shapes move logits by ~1e-6, which
self-conditioning can grow until a near-tie flips; rare). In bf16 the shapes move logits by ~0.1 on
blockpress-code, which changes sampled tokens more often. The prefix cache (on by default) moves them the same
way: a prompt it already holds is encoded in another shape than the first time, so a seeded sampled request can
answer otherwise once its prompt is cached (1 of 4 48-token replies of blockpress-code in a probe; random-weight
models, with their near-ties everywhere, far more often). --prefix-cache-gb 0 makes a seed repeat exactly.

Diffusion settings are per request, as extra body fields: max_denoising_steps, sampler, entropy_bound,
confidence, t_min, t_max, stability_threshold, confidence_threshold, min_tokens, drafts (stream the
settling canvas too), token_healing (let the model re-choose the prompt's last token; see healing.py; completions only). `temperature` T > 0 tempers
the candidate draws (SamplerConfig.draw_temperature = T: the schedule's temperature times T), while acceptance,
ranking and stopping keep the schedule, so a small T approaches the greedy answer; 0 means the acceptance rule of the request's `sampler` (else the
model's default) over the most likely candidates (candidates="argmax"): greedy decoding.
`top_p` (OpenAI's) and the extra `top_k` filter those draws (SamplerConfig.top_p / top_k: the nucleus, the k most
likely tokens); where the candidates are argmax (greedy) they change nothing, as the argmax is always kept.
OpenAI's presence_penalty and frequency_penalty apply to the new tokens (see SamplerConfig).

Infilling rides on the constrained canvas (/v1/completions): OpenAI's `suffix` (one not empty) makes the answer
exactly `max_tokens` tokens that lead into the suffix (a canvas hole has a fixed length; a text prompt's trailing space
joins the hole, as a text template's does; a hole marker in the suffix is its text, as escape_template keeps it),
less what its first stop string cuts (`stop` is cut from the fill once it is written; a template takes none); the
extra field `template` takes text with <|hole|> / <|hole:N|> markers after the prompt and answers with the whole filled text. Canvas
requests batch with each other whatever their lengths (each row writes its own canvas), not with plain ones. In the
usage a canvas's fixed tokens (the template's text, the suffix) are prompt tokens, its holes the completion tokens.

/v1/completions takes OpenAI's prompt forms: a text, token ids, or a list of either (choice j of prompt i has index
i*n + j; each prompt is answered as it would be alone, and the usage adds up).

Chat replies default to `min_tokens: 1`, so a reply does not open with its end of turn unless the request sends 0.
That default bans the end of turn alone: a stop string ends the reply wherever it appears (so a stop that the first
token holds gives an empty reply with finish_reason "stop"), and the content never holds one. A `min_tokens` the
client sends is vLLM's: no end of turn and no stop string inside the first `min_tokens` tokens.

Tool use: `tools`, an assistant's `tool_calls` and `tool` messages go to the checkpoint's chat template (the one
renderer, Tokenizer.apply_chat_template), which decides how they read. A model's tool-call syntax is its own: where
the checkpoint's tokenizer_config.json has a `response_template` (transformers 5's format; see response.py), or its
tokenizer has Gemma 4's markers as special tokens (a built-in template then: Tokenizer.reply_template), a reply
to a request with tools is read with it, and the calls it holds come back as OpenAI's `message.tool_calls` (arguments
as JSON text) with finish_reason "tool_calls", the rest as the content; streamed, the content goes out as the reply
settles it (response.PartialReader: short of a tail that may begin a call's marker) and each call as one
`delta.tool_calls` chunk once its closing marker is written, so the chunks add up to the whole answer (ToolStream). A thought
the template marks is `reasoning_content` (streamed as it is written), call or no call. A reply that holds neither a call nor
a thought, or one the template cannot read, is text as before (but for a thought before a call it cannot read, kept as
`reasoning_content`, as below), and without a response template every reply is
text (the client parses it). A request without tools (or with tool_choice "none") is read for its thought alone,
where the template reads thoughts, as transformers' server and vLLM's reasoning parsers read every reply: the thought
is `reasoning_content` (an empty one is left out), not glued to the content; a call such a reply writes anyway makes
it text, as before, but for a thought written before the call, which a stream has sent: that stays the answer's
`reasoning_content`, the text around it the content (response.thought_then_text). `tool_choice` is only "auto" or "none";
`parallel_tool_calls: false` keeps a reply's first call alone (Reply.one_call).

Prompts are kept encoded between requests (prefix.py, a byte budget): a request that starts like an earlier
one (the same system prompt, the previous turns of a chat) encodes only the rest, and its usage reports the
reused tokens as `prompt_tokens_details.cached_tokens`, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import email.message
import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import threading
import time
import unicodedata
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, FailFast, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from .checks import allocation_failed, check_positive_int, check_text, is_int, weak_members
from .config import SamplerName
from .files import parse_json, undecodable_byte

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # (typing's own from 3.13; only read by type checkers here)
from .generate import (
    Cancelled,
    Commit,
    Done,
    Draft,
    Template,
    canvas_positions,
    canvas_room,
    cut_at_stop,
    escape_template,
    hole_runs,
    parse_template,
    parse_text_template,
    settled_text,
    text_with_special_tokens,
)
from .healing import heal, heal_into_template, strip_prefix
from .lm import LM, Events
from .prefix import PrefixCache
from .response import (
    AnswerStream,
    PartialMessage,
    PartialReader,
    PatternBudget,
    answer_without_tools,
    compile_template,
    parse_response,
    reads_thoughts,
    regions_only,
    thought_then_text,
)
from .sampling import MAX_COUNT, ROW_SETTINGS, SamplerConfig, choice_seed
from .tokenizer import MessageError, TextStream, chat_message, template_variables

# -- request bodies (OpenAI fields + diffusion extras; anything else is rejected with a clear 400) ---------


# Strict types, as OpenAI's API: "5" or true is not a max_tokens, 2.0 not an n; NaN is no temperature.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FirstBadItem(FailFast):
    """pydantic's FailFast, hashable: typing's Union hashes its members' metadata, and FailFast (a dataclass) has no
    hash, so a union of lists could not carry it."""

    def __hash__(self) -> int:
        return hash(type(self))


T = TypeVar("T")
# A request's list, validated to its first bad item only: an error for every bad item, each read one by one on
# the event loop (FastAPI, validation_error), would hold every client for seconds on a long list's 400.
Items = Annotated[list[T], FirstBadItem()]

# The most denoising steps a canvas may take, a request's max_denoising_steps or the model's default: each step is a
# forward pass of the whole batch, on the engine thread that serves every client.
MAX_STEPS = 1024


class _Body(BaseModel):
    """A request body, or an object in one: strict types, and a field it does not have refused (STRICT)."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_field(cls, data: Any) -> Any:
        """The object with its first unknown field alone of all it has, the one the 400 names: an error for each,
        which FastAPI and validation_error read one by one on the event loop, would hold every client for seconds on
        an object of many unknown keys."""
        if not isinstance(data, dict):
            return data
        first = next((k for k in data if k not in cls.model_fields), None)
        if first is None:
            return data
        return {k: v for k, v in data.items() if k in cls.model_fields or k == first}


class _NullIsDefault(_Body):
    """A body whose `nullable` fields take null as their default, as OpenAI's API documents them ("integer or
    null"); clients and proxies that write every unset field send them so."""

    nullable: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.nullable}


class StreamOptions(_NullIsDefault):
    model_config = STRICT
    nullable = frozenset({"include_usage"})

    include_usage: bool = False  # OpenAI's: one last chunk, before [DONE], with the request's usage
    # OpenAI's padding of chunks against a network side channel: no chunk here carries it, asked or not (a client
    # reads none; the server is on the client's own network)
    include_obfuscation: bool | None = None


# The values of unimplemented OpenAI fields that ask for nothing (None always passes).
NOOP_VALUES: dict[str, tuple] = {
    "logprobs": (False, 0), "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (False, True), "functions": ([],), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "logit_bias": ({},), "echo": (False,), "best_of": (1,),
    "store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],),
}
# OpenAI chat fields (ChatRequest's) that only its own models serve: the values that ask for nothing here (null always
# does; "medium" is OpenAI's default verbosity)
CHAT_ONLY_NOOPS: dict[str, tuple] = {"reasoning_effort": (), "verbosity": ("medium",), "audio": (), "prediction": (),
                                     "moderation": (), "web_search_options": ()}
# Why a field is refused, where it is not simply missing from a block-diffusion engine.
NOOP_WHY = {"tool_choice": "the server does not force tool calls: it reads those the model writes, where the "
                           "checkpoint has a response_template",
            "tools": "only /v1/chat/completions renders tools, through the chat template",
            "store": "answers are not kept for retrieval", "service_tier": "one engine serves every request alike",
            "modalities": "the reply is text", "audio": "the reply is text",
            "reasoning_effort": "a thinking template's thought is turned on or off with chat_template_kwargs, "
                                "e.g. {\"enable_thinking\": true}"}


# The request field that each library argument the engine passes comes from (Engine.check's errors name the field).
LIBRARY_NAMES = {"seeds": "seed", "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                 "draw_temperature": "temperature"}


class _Common(_NullIsDefault):
    model_config = STRICT
    nullable = frozenset({"n", "stream"})

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's: any int64. The engine's seeds are in [0, 2**63): a negative one (-1, which UIs written for vLLM send)
    # is folded into that range as seed % 2**63 (build_jobs), so it still repeats its answer (-1 is 2**63 - 1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stop: str | Items[str] | None = None
    # Labels for the client's own bookkeeping, with no effect on the answer (as at OpenAI, which only stores
    # metadata with a stored completion, and `store` is refused here)
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict | None = None
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache reuses prompts without one
    # diffusion extras
    # as vLLM's extra: the draws keep the k most likely tokens (0, or vLLM's -1: all; sampler_config maps -1 to 0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_COUNT)
    max_denoising_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    sampler: SamplerName | None = None  # (the library's own list: a rule added there is offered here)
    # SamplerConfig checks these (sampler_config answers a 400 naming the field): their ranges are not restated
    # here, where a copy would drift from the library's
    entropy_bound: float | None = None
    confidence: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    drafts: bool = False
    token_healing: bool = False
    # OpenAI fields blockpress does not implement. Clients and proxies often send their no-op values, which pass
    # (NOOP_VALUES); anything else is refused by name (`unsupported`).
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    logit_bias: dict | None = None
    echo: bool | None = None
    best_of: int | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list | None = None

    implemented: ClassVar[frozenset[str]] = frozenset()  # fields of NOOP_VALUES a request kind does implement
    noop_values: ClassVar[dict[str, tuple]] = NOOP_VALUES  # what asks for nothing, where a kind reads a value otherwise

    def unsupported(self) -> str | None:
        """The first unimplemented OpenAI field this request uses for real, if any."""
        for name, noop in self.noop_values.items():
            if name in self.implemented:
                continue
            value = getattr(self, name)
            if value is not None and not any(type(value) is type(v) and value == v for v in noop):
                return name
        return None


class TextPart(_Body):
    model_config = STRICT
    type: Literal["text"]
    text: str
    # Anthropic's prompt-caching hint ({"type": "ephemeral"}), which litellm's openai/ provider and apps written for
    # several providers pass through: a label, as prompt_cache_key is (the prefix cache keeps what it keeps), never
    # given to the chat template (Message.for_template)
    cache_control: dict | None = None


class FunctionDef(_Body):
    model_config = STRICT
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema, which the chat template prints
    strict: bool | None = None


class Tool(_Body):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionCall(_Body):
    model_config = STRICT
    name: str = Field(min_length=1)
    arguments: str  # OpenAI's: the arguments as JSON text

    @field_validator("arguments", mode="before")
    @classmethod
    def _json_object(cls, text: Any) -> str:
        # Templates take the arguments as an object (transformers' tool-use form; vLLM parses them too): text
        # that is not one would print wrongly or break the template.
        if not isinstance(text, str):
            raise PydanticCustomError("string_type", "expected the arguments as JSON text (a string, as OpenAI "
                                      "writes them), got {got}", {"got": type(text).__name__})
        try:
            value = parse_json(text)  # JSON nested past the recursion limit: refused here, not a 500
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise PydanticCustomError("json_object", "expected a JSON object as text, got {text}",
                                      {"text": repr(text[:80])})
        return text


class ToolCall(_Body):
    model_config = STRICT
    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall


class Message(_Body):
    model_config = STRICT
    # "developer" is what OpenAI's newer clients call the system role (rendered as "system" unless the chat template
    # has a place of its own for it); "tool" carries a tool call's result
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # current SDKs send a list of parts: text ones are joined by "\n" (vLLM's), others refused. Null only beside
    # tool_calls (check).
    content: str | Items[TextPart] | None = None
    name: str | None = None
    tool_calls: Items[ToolCall] | None = None  # an assistant's calls, as the client's earlier turn recorded them
    tool_call_id: str | None = None  # a tool message's: the call it answers
    # An assistant's thought, as this server answers it (vLLM's name): an agent loop sends the reply back as it came,
    # and a template such as Gemma 4's reads it (or leaves past thoughts out)
    reasoning_content: str | None = None
    # The rest of an openai client's reply object (ChatCompletionMessage), which an agent loop sends back as
    # `message.model_dump()` writes it, each null: refused, they would make every second turn a 400 ("unknown
    # field 'messages[1].refusal'"). Null (annotations: also []) asks for nothing; a value this server cannot
    # render is refused by name (check).
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None
    unread: ClassVar[dict[str, str]] = {
        "refusal": "this server's replies hold no refusals, and the chat template renders none",
        "annotations": "the chat template renders none", "audio": "the reply is text",
        "function_call": "send the call as tool_calls, which the chat template renders"}

    def check(self, i: int) -> None:
        """OpenAI's rules between the fields, as a 400 naming messages[i]'s field."""
        where = f"messages[{i}]"
        for name, why in self.unread.items():
            if getattr(self, name) not in (None, []):
                accepted = "null or []" if name == "annotations" else "null"
                raise APIError(400, f"{where}.{name}: not supported by this server ({why}; only {accepted} is "
                                    "accepted)", f"{where}.{name}")
        if self.reasoning_content is not None and self.role != "assistant":
            raise APIError(400, f"{where}.reasoning_content: only an assistant message has a thought, not a "
                           f"{self.role!r} one", f"{where}.reasoning_content")
        if self.tool_calls is not None and self.role != "assistant":
            raise APIError(400, f"{where}.tool_calls: only an assistant message has them, not a {self.role!r} one",
                           f"{where}.tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise APIError(400, f"{where}.tool_call_id: " + ("a tool message names the call it answers" if
                                self.role == "tool" else f"only a tool message has one, not a {self.role!r} one"),
                           f"{where}.tool_call_id")

    def for_template(self, i: int) -> dict:
        """messages[i] as transformers' templates take it (None fields are left out by the tokenizer), its content
        as `blockpress train` reads it from a file (chat_message: text parts joined by "\\n"; null only beside
        tool_calls)."""
        content = self.content if not isinstance(self.content, list) else [
            p.model_dump(exclude={"cache_control"}) for p in self.content]
        calls = None if self.tool_calls is None else [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                      "arguments": json.loads(c.function.arguments)}}
            for c in self.tool_calls]
        try:  # "developer" stays (developer=True): lm.chat_prompt's chat_message, which knows the template, decides
            return chat_message({"role": self.role, "content": content, "name": self.name, "tool_calls": calls,
                                 "tool_call_id": self.tool_call_id, "reasoning_content": self.reasoning_content}, i,
                                developer=True)
        except MessageError as exc:
            raise APIError(400, str(exc), exc.field) from None


class ChatRequest(_Common):
    messages: Items[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens (chat only)
    # A reply does not end before it begins unless asked: an end-of-turn token may not come first (a block-diffusion
    # canvas that puts one at position 0 otherwise answers terse prompts with nothing). 0 allows it. This default
    # bans the end of turn alone: a stop string still ends the reply where it begins, as OpenAI's (an empty reply,
    # when the first token holds it); a min_tokens the client sends also holds stop strings back, as vLLM's.
    min_tokens: int = Field(default=1, ge=0)
    # Rendered into the prompt by the chat template, as it renders tool calls and results; the reply's calls are
    # read with the checkpoint's response template, where it has one.
    tools: Items[Tool] | None = None
    # vLLM's and SGLang's extra: variables for the chat template ({"enable_thinking": true} turns Gemma 4's thinking
    # on), over the server's defaults (create_app's chat_template_kwargs); a template that never reads one ignores it
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's chat fields that only its own models serve: null (which the openai client sends for a None argument)
    # asks for nothing and passes; a value is refused by name, as the other unimplemented fields' are
    reasoning_effort: str | None = None
    verbosity: str | None = None
    audio: dict | None = None
    prediction: dict | None = None
    moderation: Any = None
    web_search_options: dict | None = None
    # hints for OpenAI's prompt cache, as prompt_cache_key is: labels here (the prefix cache keeps what it keeps)
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    implemented: ClassVar[frozenset[str]] = frozenset({"tools", "parallel_tool_calls"})  # (false: one call, see Reply)
    noop_values: ClassVar[dict[str, tuple]] = {**NOOP_VALUES, **CHAT_ONLY_NOOPS}

    def template_tools(self) -> list[dict] | None:
        """The tools as templates take them; [] (what some clients send for none) is none."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class CompletionRequest(_Common):
    # OpenAI's forms: one prompt (text or token ids), or a batch of them (choice j of prompt i has index i*n + j)
    # ("" is a prompt: BOS alone, as lm.generate("") and `blockpress generate ""` take it; request_prompts refuses [])
    prompt: str | Items[int] | Items[str] | Items[list[int]]
    # OpenAI's insert mode: the completion fills exactly max_tokens tokens between the prompt and this text
    suffix: str | None = None
    # blockpress: text with <|hole|> / <|hole:N|> markers after the prompt; the answer is the filled text
    template: str | None = None
    # The legacy logprobs is a count of alternatives, and 0 still asks for the sampled tokens' own log probabilities
    # (OpenAI: "always returns the logprob of the sampled token"; vLLM alike): not a no-op here, as chat's false is
    noop_values: ClassVar[dict[str, tuple]] = {**NOOP_VALUES, "logprobs": (False,)}

    @field_validator("suffix")
    @classmethod
    def _nothing_after(cls, suffix: str | None) -> str | None:
        """An empty suffix is none: a fill-in-the-middle client at a file's end sends one, whose answer would
        otherwise be a canvas of exactly max_tokens, never shorter."""
        return suffix or None


@dataclass(frozen=True)
class Canvas:
    """A constrained canvas (`suffix` or `template`) and the prompt it follows."""

    prompt: list[int]  # as the engine takes it: a suffix request's trailing space moves into the hole
    tokens: list[int]  # token ids, -1 in the holes
    answer_tokens: int | None  # suffix: the leading tokens that are the answer; None: all of it (a filled template)
    heal_prefix: str = ""  # the moved space, which the hole's first token starts with (the prompt's, not the answer's)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers
        self.code = code


def unknown_model(name: str, served: str) -> APIError:
    """The 404 of a model name that is not the one this server serves (`served`), a request's or /v1/models/{name}'s."""
    return APIError(404, f"model {name!r} does not exist; this server has {served!r}", "model",
                    code="model_not_found")  # (OpenAI's type and code for it)


def error_body(message: str, kind: str, param: str | None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def route_path(scope: dict) -> str:
    """The path a request's routes match: its path less the app's root_path. Mounted in another app
    (host.mount("/llm", app)) or under uvicorn's --root-path, Starlette keeps the whole path ("/llm/v1/models") in
    scope["path"] and routes on what follows the root_path, so a check of the whole path would miss /v1/ (and let
    every request past the key). Starlette's own helper for this is private in the versions we allow."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


class RequireKey:
    """ASGI middleware: a request to /v1/* without `Authorization: Bearer <key>` gets a 401 in OpenAI's error shape
    (what the openai client sends its api_key as), as vLLM's --api-key; /health and /metrics stay open for probes
    and scrapers (they carry no prompt or answer). Pure ASGI rather than a route dependency, so that an unknown
    route, a wrong model or a malformed body under /v1 is a 401 too, not an answer that tells a stranger what the
    server has; CORS wraps it (create_app), so a browser's preflight, which never carries the key, still passes,
    and a page can read its 401."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = route_path(scope)
        if scope["type"] != "http" or not (path == "/v1" or path.startswith("/v1/")):
            return await self.app(scope, receive, send)
        given = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        scheme, _, token = (given[0] if given else b"").partition(b" ")
        # compare_digest of digests: the time taken tells neither how much of a guess was right nor the key's length
        if scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.key):
            return await self.app(scope, receive, send)
        message = ("incorrect API key provided" if given else
                   "no API key provided: send it as the header `Authorization: Bearer <key>` (the openai client's "
                   "api_key)") + ("; this server requires the key it was started with (--api-key, --api-key-file or "
                                  "BLOCKPRESS_API_KEY)")
        response = JSONResponse(error_body(message, "invalid_request_error", None, "invalid_api_key"),
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def header(scope: dict, name: bytes) -> str | None:
    """The first value of the request header `name` (lower case), or None where the request sends none."""
    return next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == name), None)


# An X-Request-Id taken as the client sent it: visible ASCII, at most 128 characters (one with spaces or control
# characters, or longer, would be a log line's and a response id's to carry: one is made instead, as for none)
REQUEST_ID = re.compile(r"[!-~]{1,128}")
REQUEST_ID_KEY = "blockpress.request_id"  # the scope's key of it, for the handlers


def new_request_id() -> str:
    """An id for a request that sent none (24 hex digits, as OpenAI's and vLLM's completion ids)."""
    return uuid.uuid4().hex[:24]


def request_id(request: Request) -> str | None:
    """The request's id (RequestId), None in an app that has not the middleware (a test's Reply)."""
    return request.scope.get(REQUEST_ID_KEY)


class RequestId:
    """ASGI middleware, outermost: each request's id, the `X-Request-Id` it sent (REQUEST_ID) or one made here, sent
    back as the `X-Request-Id` header of every answer (a refusal of the checks around the routes, an error, a stream),
    in a completion's `id` (chatcmpl-<id>, as vLLM's) and in the server's log lines of its failure, so an operator can
    match a client's complaint to the log. An internal error no handler answered is answered here, a 500 in OpenAI's
    shape with the id (Starlette's own, outside, has none), its line naming the id before uvicorn's traceback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = header(scope, b"x-request-id")
        rid = given if given is not None and REQUEST_ID.fullmatch(given) else new_request_id()
        scope[REQUEST_ID_KEY] = rid
        started = False

        async def send_with_id(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.error("serve: request %s failed on an internal error (its traceback follows)", rid)
            if not started:
                response = JSONResponse(error_body(f"internal server error (request {rid})", "server_error", None),
                                        status_code=500)
                await response(scope, receive, send_with_id)
            raise


# The body types a page may POST to another origin without a preflight (the fetch standard's CORS-safelisted ones)
SIMPLE_BODY_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data", "text/plain")


class RequireOrigin:
    """ASGI middleware: a POST from a web page (its Origin header) that needs no preflight, whose origin is neither
    one of `origins` nor the server's own (http(s):// and its Host), gets a 403 in OpenAI's error shape, before any
    of its body is read. CORS alone hides the answer from such a page, not the request from the server: a no-cors
    fetch with a Blob body (no Content-Type, which FastAPI before 0.132 parses as JSON) would run a generation. A
    JSON POST from another origin is preflighted, which CORS answers for the origins allowed alone, so it is left to
    CORS: a same-origin page behind a proxy that rewrites Host (nginx's default) keeps working. A client outside a
    browser sends no Origin and passes; '*' in `origins` lets any page."""

    def __init__(self, app: Any, origins: Sequence[str]) -> None:
        self.app, self.origins = app, set(origins)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        origin = header(scope, b"origin") if scope["type"] == "http" and scope.get("method") == "POST" else None
        media = (header(scope, b"content-type") or "").partition(";")[0].strip().lower()
        if origin is None or "*" in self.origins or origin in self.origins or media and media not in SIMPLE_BODY_TYPES:
            return await self.app(scope, receive, send)
        host = (header(scope, b"host") or "").lower()
        if host and origin.lower() in (f"http://{host}", f"https://{host}"):  # a page the server's origin serves
            return await self.app(scope, receive, send)
        response = JSONResponse(error_body(f"a web page on {origin!r} may not call this server: only pages on its own "
                                           "origin or on one that serve's --allowed-origins names (create_app's "
                                           "allowed_origins) may", "invalid_request_error", None, "origin_not_allowed"),
                                status_code=403)
        await response(scope, receive, send)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the Host names a request at a loopback address may carry


def is_loopback(address: str) -> bool:
    """Whether `address` (an ASGI scope's server host) is a loopback IP address, IPv4-mapped ones included (a
    dual-stack socket sees 127.0.0.1 as ::ffff:127.0.0.1); a name or a Unix socket's path is not."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return (ip.ipv4_mapped or ip).is_loopback if isinstance(ip, ipaddress.IPv6Address) else ip.is_loopback


def is_ip_address(name: str) -> bool:
    """Whether a Host header's name (its port taken off) is an IP address: 10.0.0.5, [::1]."""
    try:
        ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


class RequireHost:
    """ASGI middleware: a request that reached the server at a loopback address must name in its Host header one of
    LOOPBACK_HOSTS or of `hosts`, the machine's own name or an IP address (any port; '*' in `hosts`: any name), else
    a 403 naming its Host. DNS rebinding: a page on evil.example whose name the attacker then points at 127.0.0.1
    is, to the browser, on the server's own origin, so it could drive the model and read every answer (CORS and
    RequireOrigin see a same-origin page); its requests still say `Host: evil.example`. A request at another address
    (a server listening beyond loopback) is not checked: there an API key guards it."""

    def __init__(self, app: Any, hosts: Sequence[str]) -> None:
        # (the machine's own name too: Debian and Ubuntu map it to 127.0.1.1, and it is no attacker's to rebind)
        self.app, self.hosts = app, {*LOOPBACK_HOSTS, socket.gethostname().lower(), *(h.lower() for h in hosts)}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        server = scope.get("server") or ("",)
        if scope["type"] != "http" or "*" in self.hosts or not is_loopback(str(server[0])):
            return await self.app(scope, receive, send)
        host = header(scope, b"host")
        # the name without its port: "[::1]" of "[::1]:8000", "localhost" of "localhost:8000"
        name = (host.partition("]")[0] + "]" if host.startswith("[") else host.partition(":")[0]) if host else None
        # (no Host: HTTP/1.0, never a browser; an IP address, the URL `serve --host 0.0.0.0` prints among them, names
        # no domain an attacker could point at this machine)
        if name is None or name.lower().rstrip(".") in self.hosts or is_ip_address(name):
            return await self.app(scope, receive, send)
        response = JSONResponse(error_body(f"Host {host!r} is not this server's: at a loopback address it answers "
                                           f"only {', '.join(LOOPBACK_HOSTS)} (any port) and the names serve's "
                                           "--allowed-hosts gives (create_app's allowed_hosts; a reverse proxy's "
                                           "public name)", "invalid_request_error", None, "host_not_allowed"),
                                status_code=403)
        await response(scope, receive, send)


# The most bytes of a refused body read and dropped before its 413 (BodyLimit.drain), so that its connection closes
# cleanly: past it the body is a client's mistake too large to wait for.
DRAIN_BYTES = 64 << 20
# Seconds for a request's whole body to arrive (BodyLimit), and a second more for each BODY_RATE bytes of it (its
# Content-Length, or what has come): a large body on a slow link has the time it needs, a trickle of a few bytes not
BODY_TIMEOUT = 120.0
BODY_RATE = 32 << 10  # bytes a second


class BodyLimit:
    """ASGI middleware: a request body of more than `limit` bytes gets a 413 in OpenAI's error shape, none of it
    kept when its Content-Length says so, else as soon as a chunked body passes the limit (the rest is read and
    dropped first, up to `drain_bytes`: see drain). FastAPI reads and
    JSON-parses a body whole before any check of the handlers: a huge prompt would take seconds and memory of its
    own size for the 400 its length gets, and a list of prompts or tools each under the per-text bound would have no
    bound at all. The
    body read here is handed on to the app as one message (it is read whole anyway), then the client's own, so
    a disconnect still reaches a stream. A client that stops sending mid-body gets a 408 after `idle_timeout`
    seconds without a byte (nginx's client_body_timeout): else a connection that sends a Content-Length and then
    nothing would be held open for good, so a few hundred such clients could take every file descriptor. So does a
    body not whole within `body_timeout` seconds of its headers, and a second more for each BODY_RATE bytes of its
    Content-Length (or of what has come): the idle timer restarts at every byte, so a byte every 59 s would hold
    the connection as long as the limit lasts (years), as the whole header is timed for the same reason
    (header_deadline_protocol)."""

    def __init__(self, app: Any, limit: int, idle_timeout: float = 60.0, drain_bytes: int = DRAIN_BYTES,
                 body_timeout: float | None = None) -> None:
        self.app, self.limit, self.idle_timeout, self.drain_bytes = app, limit, idle_timeout, drain_bytes
        self.body_timeout = BODY_TIMEOUT if body_timeout is None else body_timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = asyncio.get_running_loop().time()
        declared = [v for k, v in scope.get("headers", []) if k.lower() == b"content-length"]
        length = int(declared[0]) if declared and declared[0].strip().isdigit() else 0

        def allowed(size: int) -> float:  # seconds for the whole body, a drain's included
            return self.body_timeout + max(length, size) / BODY_RATE

        if length > self.limit:
            return await self.refuse(scope, receive, send, f"is {length} bytes, more than", True, length,
                                     started=False, deadline=start + allowed(0))
        chunks: list[bytes] = []
        size = 0
        message: dict[str, Any] = {"type": "http.request", "body": b"", "more_body": True}  # an ASGI message
        while message["type"] == "http.request" and message.get("more_body", False):
            left = start + allowed(size) - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), min(self.idle_timeout, max(left, 0.0)))
            except TimeoutError:
                return await self.timed_out(scope, receive, send, allowed(size) if left < self.idle_timeout else None)
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self.refuse(scope, receive, send, "is more than", message.get("more_body", False),
                                         started=True, deadline=start + allowed(size))
            chunks.append(message.get("body", b""))
        first = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}
                 if message["type"] == "http.request" else message]  # (a client that left mid-body: its disconnect)
        encoding = (header(scope, b"content-encoding") or "identity").strip().lower()
        if size and encoding != "identity":
            # Nothing here decodes a compressed body: read as it came, gzip's bytes were "not UTF-8", and a plain
            # body labelled gzip was served as if the label were not there (RFC 9110's answer is a 415)
            message_text = f"Content-Encoding {encoding!r} is not supported: send the request body uncompressed"
            response = JSONResponse(error_body(message_text, "invalid_request_error", None, "unsupported_encoding"),
                                    status_code=415, headers={"Accept-Encoding": "identity"})
            return await response(scope, receive, send)

        async def replay() -> dict:
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)

    async def timed_out(self, scope: dict, receive: Any, send: Any, allowed: float | None) -> None:
        """The 408 of a body that stopped arriving, or that was not whole within the `allowed` seconds."""
        late = (f"it did not arrive whole within {allowed:.3g} s" if allowed is not None else
                f"nothing came for {self.idle_timeout:g} s")
        await self.close_with(scope, receive, send, 408, "request_timeout",
                              f"the request body stopped arriving: {late}, so the request was given up; send the "
                              "whole body at once")

    async def refuse(self, scope: dict, receive: Any, send: Any, size: str, more: bool,
                     declared: int | None = None, *, started: bool, deadline: float) -> None:
        await self.drain(scope, receive, more, declared, started, deadline)
        await self.close_with(scope, receive, send, 413, "request_too_large",
                              f"the request body {size} the {self.limit} bytes this server takes (room for the "
                              "context's text as JSON; serve's --max-body-bytes sets it)")

    async def drain(self, scope: dict, receive: Any, more: bool, declared: int | None, started: bool,
                    deadline: float) -> None:
        """Read the rest of a refused body (`more`: some is still to come), dropping it, before the 413: a
        connection closed with bytes of it unread is reset (TCP RST), which can destroy the answer on its way, so
        the client reads a connection error in place of the 413 (httpx's AsyncClient, the openai AsyncOpenAI
        client's), and an openai client sends the body again on a connection error. As
        nginx's lingering close, within bounds: not past `drain_bytes` (nor a body declared longer: it is closed
        at once), nor past `idle_timeout` without a byte or the body's `deadline` (the event loop's time), nor
        where the client waits for `100 Continue` before it sends any and none was read (not `started`: it reads
        the 413 first). Once a read asked for the body,
        the server has sent `100 Continue` and the client is sending: a chunked body over the limit with `Expect:
        100-continue` (curl's default) would otherwise get the 413's headers and then a reset, its body lost."""
        expects = [v for k, v in scope.get("headers", []) if k.lower() == b"expect"]
        if not more or (declared is not None and declared > self.drain_bytes) or \
                (not started and any(v.strip().lower() == b"100-continue" for v in expects)):
            return
        drained = 0
        while more and drained <= self.drain_bytes:
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), min(self.idle_timeout, max(left, 0.0)))
            except TimeoutError:
                return
            if message["type"] != "http.request":  # the client left
                return
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)

    @staticmethod
    async def close_with(scope: dict, receive: Any, send: Any, status: int, code: str, message: str) -> None:
        """An error in OpenAI's shape, and the connection closed: the rest of the body is never read, so it cannot
        carry another request."""
        response = JSONResponse(error_body(message, "invalid_request_error", None, code), status_code=status,
                                headers={"Connection": "close"})
        await response(scope, receive, send)


class AnswerStopped:
    """ASGI middleware: a request cancelled because the server is shutting down (uvicorn at the grace period's end;
    serve's second stop signal) before its handler had the engine answer it (its body still arriving, its prompt
    being tokenized or rendered in a worker thread) gets the 503 that the engine's own jobs get then, in OpenAI's
    shape, not uvicorn's plain-text 500 and an "Exception in ASGI application" traceback. A response already under
    way (a stream whose client reads slowly) ends there, its connection closed. A cancel while the engine still
    serves is not a shutdown's, and goes on."""

    def __init__(self, app: Any, engine: Engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            stopped = self.engine.stopped()
            if stopped is None:
                raise
            if not started:
                response = JSONResponse(error_body(stopped, "server_error", None), status_code=503,
                                        headers={"Connection": "close"})
                await response(scope, receive, send)


def body_limit(context: int, token_chars: int) -> int:
    """The default most bytes of a request body: a text as long as the context's longest (`context` tokens of
    `token_chars` characters, the bound ServerState.check_length puts on one text) JSON-escaped at its widest, 12
    bytes a character (\\uXXXX\\uXXXX, as clients that escape non-ASCII send a character past U+FFFF), and a MiB
    for the rest of the request."""
    return context * token_chars * 12 + (1 << 20)


HEADER_TIMEOUT = 60.0  # seconds for a request's line and headers to arrive whole (nginx's client_header_timeout)


def header_deadline_protocol(seconds: float = HEADER_TIMEOUT) -> type:
    """uvicorn's h11 protocol with a deadline on the request line and headers: a connection that has not sent them
    whole within `seconds` of opening (or of the next request's first byte) gets a 408 in OpenAI's error shape and is closed.
    uvicorn arms its only timer (keep-alive) after a first response and cancels it on any byte, so a client that
    connects and sends nothing, or half a header, or a header byte a minute, would hold a file descriptor for good: a
    thousand such take every descriptor a default ulimit allows. The whole header, not the gap between bytes, is
    timed, so trickling does not keep a connection. Once the headers are in, BodyLimit times the body."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps(error_body(f"the request's headers did not arrive within {seconds:g} s, so the connection "
                                 "was closed; send the request line and headers at once",
                                 "invalid_request_error", None, "request_timeout")).encode()
    reply = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: %d\r\n\r\n%s" % (len(body), body))

    class HeaderDeadline(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def arm(self) -> None:
            self.disarm()
            self.deadline = self.loop.call_later(seconds, self.deadline_passed)

        def disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # a kept-alive connection's next request: timed from its first byte (the gap before it is uvicorn's
            # keep-alive timeout's, which closes an idle connection quietly)
            if self.deadline is None and self.conn.their_state is h11.IDLE:
                self.arm()
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole request line and headers were parsed
                self.disarm()

        def deadline_passed(self) -> None:
            self.deadline = None
            # IDLE: no request parsed since the connection opened or its last response (h11 leaves IDLE on a whole
            # request line and headers, and comes back only when a response is done)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(reply)
                self.transport.close()

    return HeaderDeadline


def check_api_key(key: str | None, name: str = "api_key") -> str | None:
    """`create_app`'s api_key: None (no key), or one an HTTP header can carry as sent. The key itself is never
    shown: errors say what is wrong with it, under `name`, where the key came from (serve's BLOCKPRESS_API_KEY: an
    operator who set only the variable would look for an --api-key they never gave)."""
    if key is None:
        return None
    if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or key != key.strip():
        what = f"a {type(key).__name__}" if not isinstance(key, str) else f"a key of {len(key)} characters"
        raise ValueError(f"{name}: expected a non-empty key of printable ASCII characters without leading or trailing "
                         f"spaces (clients send it in an HTTP header), got {what}")
    return key


# -- the engine ---------------------------------------------------------------------------------------------


# What the engine thread tells a request's handler about one job, in order: drafts and texts while it runs, then
# one JobDone or JobError.
@dataclass(frozen=True)
class JobDraft:
    text: str  # the committed text and the settling canvas after it
    step: int


@dataclass(frozen=True)
class JobText:
    text: str  # all the job's text so far (a canvas committed), cut at a stop string as the engine cuts the answer
    raw: str | None = None  # its new tokens so far with their special tokens, not cut (Job.keep_special)


@dataclass(frozen=True)
class JobDone:
    text: str  # the answer, cut at its stop string
    tokens: int  # completion tokens
    passes: int  # forward passes
    finish: str  # OpenAI's finish_reason: "stop" or "length"
    reused: int  # prompt tokens the prefix cache held
    raw: str | None = None  # the answer with its special tokens, for a response template (Job.keep_special)


@dataclass(frozen=True)
class JobError:
    message: str
    status: int = 500  # 503: the server cut the job (it is shutting down)



@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    sampler: SamplerConfig
    seed: int
    stop: list[str]
    drafts: bool
    token_healing: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # (job, event) pairs; a request's jobs share one, so their choices interleave
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.perf_counter)
    copies: int = 1  # choices this job answers: greedy choices are one answer, computed once
    choices: range = range(1)  # their indices in the response
    group: int = 0  # which of the request's prompts it answers
    # A constrained canvas (`suffix` or `template`): its token ids, -1 in the holes, and how many of the new tokens
    # (of the healed layout) are the answer (suffix mode: the hole before the suffix; None: all of it, a filled
    # template). A healed suffix canvas starts with the prompt's space, which opens into the hole.
    canvas: list[int] | None = None
    answer_tokens: int | None = None
    # Text of the prompt that the answer's first token starts with (token healing, or a suffix's healed space);
    # not part of the answer.
    heal_prefix: str = ""
    # Also send the answer with its special tokens (JobDone.raw): a reply the response template reads for tool calls,
    # whose markers are often special tokens, which the answer's text leaves out.
    keep_special: bool = False
    # The minimum is chat's default, not the client's min_tokens: it bans only the end of turn, and a stop string
    # inside it ends the reply as anywhere (an OpenAI client never sees its stop string in the content).
    eos_only_minimum: bool = False
    # Runs in a batch of its own: its batch could not allocate its memory (Engine._advance)
    alone: bool = False
    request_id: str = ""  # its request's (RequestId; Reply sets it), for the log lines of its failure

    def key(self) -> tuple:
        """What the jobs of one batch share. Not max_tokens nor min_tokens, nor the candidate draw's temperature,
        top_p and top_k (ROW_SETTINGS): the engine takes them per row; nor a canvas's length, as the engine lays out
        canvases of any lengths together. Canvas jobs and free ones stay apart: a template is the whole batch's."""
        return (self.sampler.batch_wide(), self.token_healing, self.canvas is not None, id(self) if self.alone else 0)

    @property
    def holes(self) -> int:
        return sum(t < 0 for t in self.canvas) if self.canvas is not None else 0

    @property
    def fixed_tokens(self) -> int:
        """A canvas's tokens that the client wrote (a template's text, the suffix): prompt tokens in the usage, as
        OpenAI counts a suffix; the holes are the completion."""
        return len(self.canvas) - self.holes if self.canvas is not None else 0

    def answer(self, texts: list[str], fills: list[list[str]] | None, row: int) -> str:
        """This job's answer, as row `row` of the engine's `texts` and template `fills` (so far, or final) reads:
        in suffix mode the hole before the suffix, its fill (the suffix is the client's text), cut before its first
        stop string; else the text."""
        if self.answer_tokens is None:
            return texts[row]
        # The hole is written whole (its length is fixed, and the library takes no stop strings with a template:
        # Engine._stream passes none), so the fill is cut here, as the engine cuts a plain row's text
        return cut_at_stop(fills[row][0] if fills is not None and fills[row] else "", self.stop)

    def put(self, item: JobDraft | JobText | JobDone | JobError) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self, item))


log = logging.getLogger("blockpress.serve")


def request_ids(jobs: Sequence[Job]) -> str:
    """The requests of `jobs`, for a log line: an operator finds a client's X-Request-Id in it."""
    return "requests " + ", ".join(dict.fromkeys(job.request_id or "?" for job in jobs))


def report(job: Job, error: JobError) -> None:
    """Send `job` its error, where anyone still waits for it: a request whose event loop is gone (shutdown) cannot
    be told, and trying would raise out of the engine thread."""
    try:
        job.put(error)
    except RuntimeError:
        pass


class Metrics:
    BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # requests: answered, refused as the queue was full (429), left by their client (499), failed or cut (5xx)
        self.counters = {"requests_total": 0, "rejected_total": 0, "cancelled_total": 0, "failed_total": 0,
                         "completion_tokens_total": 0, "prompt_tokens_total": 0, "cached_prompt_tokens_total": 0,
                         "forward_passes_total": 0, "batches_total": 0}
        # Cumulative histogram counts, as Prometheus reads them: a list of every latency would grow without end, and
        # rendering it would hold the lock the engine thread needs.
        self.buckets = [0] * len(self.BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0

    def add(self, **values: int) -> None:
        with self.lock:
            for k, v in values.items():
                self.counters[k] += v

    def observe(self, seconds: float) -> None:
        with self.lock:
            for i, bound in enumerate(self.BUCKETS):
                self.buckets[i] += seconds <= bound
            self.latency_sum += seconds
            self.latency_count += 1

    def render(self, gauges: dict[str, float]) -> str:
        with self.lock:  # Prometheus's text format, typed so that histogram_quantile and rate() apply
            lines = []
            for k, v in self.counters.items():
                lines += [f"# TYPE blockpress_{k} counter", f"blockpress_{k} {v}"]
            for k, value in gauges.items():
                lines += [f"# TYPE blockpress_{k} gauge", f"blockpress_{k} {value}"]
            lines.append("# TYPE blockpress_request_seconds histogram")
            for bound, n in zip(self.BUCKETS, self.buckets):
                lines.append(f'blockpress_request_seconds_bucket{{le="{bound}"}} {n}')
            lines.append(f'blockpress_request_seconds_bucket{{le="+Inf"}} {self.latency_count}')
            lines.append(f"blockpress_request_seconds_sum {self.latency_sum}")
            lines.append(f"blockpress_request_seconds_count {self.latency_count}")
        return "\n".join(lines) + "\n"


class Batch:
    """A batch the engine is generating: its jobs (one a row), their stream, and what of their answers it has told
    so far. The engine advances several of these in turn, a canvas at a time (Engine._loop)."""

    def __init__(self, engine: Engine, jobs: list[Job]) -> None:
        self.engine, self.jobs = engine, jobs
        self.events: Events | None = None  # made at the first advance
        self.texts = [""] * len(jobs)  # each job's answer so far (the engine's text of all its committed tokens)
        self.tokens: list[list[int]] = [[] for _ in jobs]  # each job's valid new tokens so far (Job.keep_special)
        # their text with special tokens, decoded on at each commit (Job.keep_special), not whole again
        self.raws = [TextStream(engine.lm.tokenizer, skip_special_tokens=False) for _ in jobs]
        self.committed = False  # whether a canvas has committed: until then a draft starts with the healed prompt text
        self.told = False  # whether any job was sent anything (a draft, a commit's text)
        # Each job's valid new tokens, forward passes and last valid token so far, and whether it has had its JobDone:
        # a row is answered at the commit it finishes in, not when its batch's longest row ends (a short answer
        # batched beside a long one would otherwise wait for it, its stream's finish_reason and [DONE] with it)
        self.counts = [0] * len(jobs)
        self.passes = [0] * len(jobs)
        self.last_token: list[int | None] = [None] * len(jobs)
        self.answered = [False] * len(jobs)

    def advance(self) -> bool:
        """Handle the stream's events up to and including its next Commit (and the Done after it, where that commit
        ended every row). Returns whether the batch has finished: done, or ended as every client left or a cut."""
        if self.events is None:  # made here, not under the engine's lock (the library checks the arguments)
            self.events = self.engine._stream(self.jobs)
            self.engine.metrics.add(batches_total=1)
        for event in self.events:  # it ends without Done once every client has left
            if isinstance(event, Draft):
                self.draft(event)
            elif isinstance(event, Commit):
                self.commit(event)
                if not bool(event.finished.all()):  # else Done follows at once: answer now, not a round later
                    return False
            elif isinstance(event, Done):
                self.done(event.output)
                return True
            elif isinstance(event, Cancelled):  # every client left, or a cut: the work done for nobody is load too
                def unanswered(counts: Any) -> int:  # (the answered rows were counted then)
                    return sum(n for n, answered in zip(counts.tolist(), self.answered) if not answered)
                self.engine.metrics.add(completion_tokens_total=unanswered(event.num_new_tokens),
                                        forward_passes_total=unanswered(event.forward_passes))
                return True
        return True

    def close(self) -> None:
        """Let go of a finished batch's stream, which stops at its last event (Done, Cancelled) holding the batch's
        KV cache and outputs until it is closed. Left to the engine thread's list of the round it advanced, the
        batches that finished in it would stay until the next round begins, which an idle server never begins: the
        last round's caches would stay while nothing runs."""
        if self.events is not None:
            self.events.close()

    def draft(self, event: Draft) -> None:
        tok = self.engine.lm.tokenizer
        for i, job in enumerate(self.jobs):
            if job.drafts and not self.answered[i]:  # (an answered row's stream has ended)
                draft = tok.decode(event.tokens[i].tolist())
                draft = draft if self.committed else strip_prefix(draft, job.heal_prefix)
                self.told = True
                job.put(JobDraft(self.texts[i] + draft, event.step))

    def commit(self, event: Commit) -> None:
        lm = self.engine.lm
        self.committed = self.told = True
        texts, written = event.texts_so_far, event.num_new_tokens
        if texts is None or written is None:  # the decoding loop sets both where a tokenizer is, as a server's has
            raise ValueError("commit: the event has no texts_so_far or num_new_tokens (a model without a tokenizer?)")
        for i, job in enumerate(self.jobs):
            if self.answered[i]:
                continue
            # decoded whole, healed prefix left out, cut at a stop string past the min_tokens' text
            self.texts[i] = job.answer(texts, event.fills_so_far, i)
            n = int(written[i])
            fresh = event.tokens[i, : n - self.counts[i]].tolist()  # this canvas's valid tokens
            self.counts[i], self.passes[i] = n, self.passes[i] + int(event.steps[i])
            if fresh:
                self.last_token[i] = fresh[-1]
            raw = None
            if job.keep_special or (job.answer_tokens is not None and job.stop):  # (a suffix cut at a stop: fill_tokens)
                self.tokens[i] += fresh
            if job.keep_special:  # (a stop string is the stream's to mind: JobDone.raw is cut at it)
                raw = text_with_special_tokens(lm.tokenizer, self.tokens[i], lm._eos_ids(), job.heal_prefix, [],
                                               self.raws[i])
            job.put(JobText(self.texts[i], raw))
            if (bool(event.finished[i]) and event.stopped is not None and event.reused_prompt_tokens is not None
                    and event.num_chosen_tokens is not None):
                self.answer(i, self.texts[i], event.stopped[i], event.reused_prompt_tokens[i],
                            None if job.canvas is None else int(event.num_chosen_tokens[i]))

    def done(self, out: Any) -> None:
        for i, job in enumerate(self.jobs):
            if self.answered[i]:
                continue
            self.counts[i], self.passes[i] = int(out.num_new_tokens[i]), int(out.forward_passes[i])
            n = self.counts[i]
            self.last_token[i] = int(out.new_tokens[i, n - 1]) if n else None
            self.tokens[i] = out.new_tokens[i, :n].tolist()
            self.answer(i, job.answer(out.texts, out.fills, i), out.extra["stopped"][i],
                        out.extra["reused_prompt_tokens"][i],
                        None if job.canvas is None else int(out.num_chosen_tokens[i]))

    def fill_tokens(self, i: int) -> int:
        """Suffix job `i`'s hole tokens through the one that completes the stop string its fill is cut at, as a
        plain row that a stop string ends counts its tokens (all of the hole's where no stop string is in it). The
        fewest tokens whose text holds a stop, by bisection: a start of the hole that holds one, longer ones do too."""
        tok, job = self.engine.lm.tokenizer, self.jobs[i]
        hole = self.tokens[i][: job.answer_tokens]

        def holds(p: int) -> bool:  # as a growing row's text is searched: a trailing U+FFFD may be a character's
            # first bytes, which a stop ending in U+FFFD must not match (p tokens holding one would not stay so)
            text = strip_prefix(tok.decode(hole[:p]), job.heal_prefix)  # the fill of its first p tokens
            return len(cut_at_stop(text, job.stop, growing=True)) < len(text)

        lo, hi = 0, len(hole)  # holds(lo) is False (no text); holds(hi) is looked at first
        if not holds(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(mid) else (mid, hi)
        return hi

    def answer(self, i: int, text: str, stopped: bool, reused: int, chosen: int | None = None) -> None:
        """Job `i`'s JobDone, its row having ended (EOS, its max_tokens, a stop string, or its canvas written) with
        `text`; `chosen`: a canvas's tokens the model wrote (its holes), the completion tokens there."""
        lm, job, n = self.engine.lm, self.jobs[i], self.counts[i]
        # "length" where the job's own max_tokens ended it, not an EOS nor a stop string
        ended = (n < job.max_tokens or stopped or job.canvas is not None
                 or (n == job.max_tokens and self.last_token[i] in lm._eos_ids()))
        raw = None
        if job.keep_special:
            raw = text_with_special_tokens(lm.tokenizer, self.tokens[i], lm._eos_ids(), job.heal_prefix,
                                           job.stop if stopped else [])
        tokens = n if chosen is None else chosen
        if job.answer_tokens is not None and job.stop:  # a suffix's fill cut at a stop string (Job.answer)
            tokens = min(tokens, self.fill_tokens(i))
        # (the prompt, its cached part and the latency count once per request, in `respond`)
        self.engine.metrics.add(completion_tokens_total=tokens, forward_passes_total=self.passes[i])
        self.answered[i] = True
        job.put(JobDone(text, tokens, self.passes[i], "stop" if ended else "length", reused, raw))


class Engine:
    """One thread that owns the model and generates every request's jobs. It keeps several batches running at
    once, each its own stream, and advances them in turn a canvas at a time, so a short request that arrives
    while a long one runs starts at the long one's next canvas instead of after its end. Between canvases it
    starts a batch of the waiting jobs while the rows of all running batches stay within `max_batch`."""

    def __init__(self, lm: Any, max_queue: int = 64, max_batch: int = 8, prefix_cache: PrefixCache | None = None):
        self.lm, self.max_queue, self.max_batch, self.prefix_cache = lm, max_queue, max_batch, prefix_cache
        self.waiting: list[Job] = []  # submitted, not yet in a batch, oldest first
        # One lock over `waiting` and `batches`: a job moving from one to the other is never missed by a cut, and
        # a request arriving meanwhile is counted against max_queue. `arrived` wakes the engine thread.
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        self.stopping = False
        # Why the engine thread ended on an error of ours (Engine._loop), else None: nothing answers requests then
        self.failure: str | None = None
        self.batches: list[Batch] = []  # the batches the engine thread is generating, in the order they started
        self.metrics = Metrics()
        # Started when the app starts or the first request comes (`start`), not here: only the app's shutdown ends
        # it, so an app made and never served (a notebook cell run again, a refused setting after it) would keep a
        # thread waiting forever, and the model with it.
        self.thread = threading.Thread(target=self._loop, daemon=True, name="blockpress-engine")

    def start(self) -> None:
        """Start the engine thread, unless it has started (or the engine has closed)."""
        with self.lock:
            self._start()

    def _start(self) -> None:
        if self.thread.ident is None and not self.stopping:  # (the lock held)
            _LIVE_ENGINES.add(self)
            self.thread.start()

    def stopped(self) -> str | None:
        """Why the engine answers no more requests (the app shutting down, or an error of ours that ended its thread),
        else None: a request queued now would never be answered, and /health says so rather than "ok"."""
        if self.failure is not None:
            return self.failure
        if self.stopping:  # (from close's first step: the thread may run on for a step, answering no new request)
            return "the server is shutting down"
        if self.thread.ident is not None and not self.thread.is_alive():
            return "the server's engine thread has ended"
        return None

    def check_room(self, prompts: int, each: int) -> None:
        """Refuse a request of `prompts` prompts of `each` jobs that can never fit the queue: a 400 naming what is too
        large, not "retry later"."""
        if prompts * each <= self.max_queue:
            return
        room = f"can never fit the server's queue of {self.max_queue}"
        if each > self.max_queue:
            raise APIError(400, f"n: {each} choices {room}", "n")
        per = f" x {each} choices" if each > 1 else ""
        raise APIError(400, f"prompt: {prompts} prompts{per} ({prompts * each} jobs) {room}; send fewer prompts "
                            "a request", "prompt")

    def check_request(self, jobs: list[Job]) -> None:
        """Refuse a request whose jobs can never fit the queue (check_room) or one the library would refuse (check),
        before any of them is queued. The library reads every prompt id, so a handler runs this in a worker thread
        (respond): on the event loop, a request of many long prompts would hold every other client (/health, each
        stream's next chunk)."""
        if jobs:
            prompts = len({j.group for j in jobs})
            self.check_room(prompts, len(jobs) // prompts)  # a prompt's sampled choices (greedy ones are one job)
        for job in jobs:
            self.check(job)

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's choices, all or none (a half-queued request would run choices nobody receives), once
        check_request has passed them."""
        with self.lock:
            if (stopped := self.stopped()) is not None:  # nothing would answer: a 503 now, not a wait forever
                self.metrics.add(failed_total=1)  # (an error rate alert must see a server that answers nothing)
                raise APIError(503, stopped, kind="server_error")
            self._drop_cancelled()  # a client that left frees its place at once, not when the engine next looks
            if self.max_queue - len(self.waiting) < len(jobs):
                self.metrics.add(rejected_total=1)
                raise APIError(429, "the server is busy: the request queue is full, retry later", kind="rate_limit_error",
                               headers={"Retry-After": "1"})  # OpenAI's clients back off by it
            self.waiting += jobs
            self._start()  # an app run without its lifespan (TestClient outside `with`) starts it here
            self.arrived.notify()

    def depth(self) -> int:
        """The jobs waiting for a batch, those of clients that left not counted."""
        with self.lock:
            return sum(not j.cancelled.is_set() for j in self.waiting)

    def running(self) -> int:
        """The rows of running batches that hold a place of `max_batch`: those of clients that left not counted
        (their rows stop within a step)."""
        with self.lock:
            return self._running()

    def _running(self) -> int:
        # (the lock held) nor the rows already answered: one of n choices that ended stays in its batch until its
        # request's last choice ends (it is released with the request), but computes nothing and holds no place
        return sum(not (j.cancelled.is_set() or answered) for batch in self.batches
                   for j, answered in zip(batch.jobs, batch.answered))

    def _drop_cancelled(self) -> None:
        self.waiting = [j for j in self.waiting if not j.cancelled.is_set()]

    def cut(self, message: str = "the server is shutting down") -> None:
        """End every queued and running job now: each gets a 503 error event, and the engine stops its batches
        within a step (a stop signal's grace period has run out). Jobs that finished meanwhile are unaffected."""
        with self.lock:
            jobs = self.waiting + [j for batch in self.batches for j in batch.jobs]
            for job in jobs:
                job.cancelled.set()
            self.arrived.notify()
        for job in jobs:
            report(job, JobError(message, 503))

    def stop(self) -> None:
        """Refuse every new request (a 503: `stopped`) and cut what is queued or running; the engine thread ends
        within a step. A stop signal's grace period has run out: a request submitted after a bare cut (one whose
        prompt was still being tokenized) was queued and run for nobody."""
        with self.lock:
            self.stopping = True
        self.cut()

    def close(self, timeout: float = 10.0) -> None:
        """Cut what is still queued or running and stop the engine thread (the app's shutdown calls this).
        Waiting for a batch nobody would receive would hold the exit, and an interpreter that finalises while the
        engine thread is inside torch aborts."""
        self.stop()
        if self.thread.ident is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _admit(self) -> None:
        """Start batches of waiting jobs while rows are free (the lock held): the oldest job's, with every waiting
        job of the same settings (Job.key) that fits beside it, then the next oldest's."""
        self._drop_cancelled()
        # A row whose client left is no longer computed and its cache row goes at its batch's next canvas: its place
        # is free now (else it holds a short request behind a long batch for the whole batch).
        room = self.max_batch - self._running()
        while self.waiting and room > 0:
            keys = self._keys()
            if not keys:
                break
            if self.waiting[0].alone and self.batches:  # its batch could not allocate beside others: it runs alone
                break
            jobs = [j for j, key in zip(self.waiting, keys) if key == keys[0]][:room]
            taken = {id(j) for j in jobs}
            self.waiting = [j for j in self.waiting if id(j) not in taken]
            try:
                batch = Batch(self, jobs)
            except Exception as exc:  # a defect of ours: these requests get an error, not the engine thread's end
                self._failed(jobs, exc)
                continue
            self.batches.append(batch)
            room -= len(jobs)
            if jobs[0].alone:  # (nothing starts beside it either)
                break

    def _keys(self) -> list[tuple]:
        """Each waiting job's Job.key, in order (the lock held). A job whose key cannot be made leaves the queue with
        an error, itself alone: a defect of ours there would end the engine thread, and every request after it would
        wait forever."""
        keys, kept = [], []
        for job in self.waiting:
            try:
                keys.append(job.key())
            except Exception as exc:
                self._failed([job], exc)
                continue
            kept.append(job)
        self.waiting = kept
        return keys

    @staticmethod
    def _failed(jobs: list[Job], exc: Exception) -> None:
        log.exception("serve: could not start a batch of %d (%s)", len(jobs), request_ids(jobs))
        for job in jobs:
            report(job, JobError(f"the server could not start this request: {exc}"))

    def _round(self) -> list[Batch] | None:
        """The batches to advance next, once there are any (new ones started first), or None once closing."""
        with self.lock:
            while not self.stopping:
                try:
                    self._admit()
                except Exception as exc:  # a defect of ours: the jobs waiting now get an error, and the engine goes
                    # on (kept queued, they would meet the same error at every round, the engine spinning on it)
                    jobs, self.waiting = self.waiting, []
                    self._failed(jobs, exc)
                if self.batches:
                    return list(self.batches)
                self.arrived.wait()
            return None

    def _loop(self) -> None:
        try:
            while (batches := self._round()) is not None:
                for batch in batches:  # a canvas each, in turn: no batch waits for another's end
                    try:
                        finished = self._advance(batch)
                    except Exception as exc:  # a defect of ours outside the batch's advance: as a failed batch's
                        log.exception("serve: a batch of %d failed (%s)", len(batch.jobs), request_ids(batch.jobs))
                        for job, answered in zip(batch.jobs, batch.answered):
                            if not answered:
                                report(job, JobError(str(exc)))
                        self._close(batch)
                        finished = True
                    if finished:
                        with self.lock:
                            self.batches.remove(batch)
        except BaseException as exc:  # (logged here whole: the thread then ends without raising it again)
            # Nothing answers requests once this thread ends: those queued or running get a 503 now, later ones at
            # once (submit), and /health is a 503, not "ok" (a load balancer would send traffic to a server that
            # answers nothing, each request waiting forever)
            log.critical("serve: the engine thread ended on an error; every request gets a 503", exc_info=True)
            with self.lock:
                self.failure = f"the server's engine stopped on an internal error ({type(exc).__name__}: {exc})"
            self.cut(self.failure)

    def _advance(self, batch: Batch) -> bool:
        """Advance `batch` by a canvas: whether it has finished (a failed one has: its jobs got the error)."""
        if batch.events is None and all(j.cancelled.is_set() for j in batch.jobs):
            return True  # every client left, or a cut, before it started
        try:
            finished = batch.advance()
        except Exception as exc:  # keep serving; this batch's requests get a 500-style error event, the rest go on
            if allocation_failed(exc) and len(batch.jobs) > 1 and not batch.told:
                # A batch's cache is its rows x its longest row: one request's max_tokens would fail the requests beside
                # it (each answerable alone). Nothing is told yet: each runs alone, and one that fails alone is told.
                log.warning("serve: a batch of %d (%s) could not allocate its memory (%s); its requests run one "
                            "by one", len(batch.jobs), request_ids(batch.jobs), (str(exc).splitlines() or [""])[0])
                for job in batch.jobs:
                    job.alone = True
                with self.lock:
                    self.waiting[:0] = batch.jobs
                self._close(batch)
                return True
            log.exception("serve: a batch of %d failed (%s)", len(batch.jobs), request_ids(batch.jobs))
            for job in batch.jobs:
                report(job, JobError(str(exc)))
            finished = True
        if finished:  # its cache goes now, not when the batch object does (see Batch.close)
            self._close(batch)
        return finished

    @staticmethod
    def _close(batch: Batch) -> None:
        """batch.close(), an error of it logged: its jobs are answered (or queued again) by now, and raised, it would
        fail the round that every other batch is in."""
        try:
            batch.close()
        except Exception:
            log.exception("serve: could not close a finished batch of %d (%s)", len(batch.jobs),
                          request_ids(batch.jobs))

    def check(self, job: Job) -> None:
        """Refuse a job the library would refuse (a 400 naming the field), before it is queued: alone, so that a
        value one request sends can never fail a batch that others joined (a top_k past int64 would, with a 500
        for every request in it). The library checks everything before it generates, and this starts nothing."""
        try:
            self._stream([job])
        except ValueError as exc:
            name = str(exc).split(":", 1)[0].split("[", 1)[0]  # the library's name, without a row's index
            raise APIError(400, str(exc), LIBRARY_NAMES.get(name, name)) from None

    def _stream(self, batch: list[Job]) -> Events:
        """The engine's stream of `batch`, one job a row (not started: the library has checked the arguments)."""
        first = batch[0]
        return self.lm.stream(
            # each job's own lengths; a canvas sets its length (no minimum: it is written whole)
            [j.prompt for j in batch], min_new_tokens=[j.min_tokens for j in batch] if first.canvas is None else 0,
            min_new_tokens_eos_only=[j.eos_only_minimum for j in batch],
            max_new_tokens=[j.max_tokens for j in batch] if first.canvas is None else None,
            # Drafts cost device->host copies every step: only when a client asked. Clients that leave still free
            # the engine within a step (`cancelled` is asked before each), not when the canvas commits.
            # the batch's sampler, with each job's own temperature, top_p and top_k (see Job.key)
            sampler=first.sampler, **{name: [getattr(j.sampler, name) for j in batch] for name in ROW_SETTINGS},
            seeds=[j.seed for j in batch], drafts=any(j.drafts for j in batch),
            # per row: a client that left a shared batch stops its row within a step, and its cache row is freed at
            # the next canvas (every client gone: the stream's Cancelled)
            cancelled=lambda: [j.cancelled.is_set() for j in batch],
            # a canvas's holes are healed at their edges (its fixed part is text the client wrote)
            # (a suffix's stop strings cut its fill once it is written whole: Job.answer; a template takes none)
            token_healing=first.token_healing or first.canvas is not None,
            stop=[j.stop for j in batch] if first.canvas is None else None,
            prefix_cache=self.prefix_cache,
            template=None if first.canvas is None else [j.canvas for j in batch],
        )


# Engines whose thread has started are closed at exit, while torch is whole: a script that ends while a request is
# in flight (start_in_background, whose daemon thread nobody joins; uvicorn's shutdown waits for the request before
# the app's lifespan closes the engine) left the engine thread inside torch at the interpreter's teardown, and the
# process aborted ("terminate called without an active exception"). atexit runs while daemon threads still run, so
# close's cut and join end it within a step. A process-wide registry, as lm._OPEN_STREAMS is for streams: the exit is
# the process's. Weak: the engine thread holds its engine while it runs, and a closed one may go.
_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    for engine in weak_members(_LIVE_ENGINES):
        with contextlib.suppress(Exception):
            engine.close()


def _close_when_gone(engine_ref: weakref.ref[Engine]) -> None:
    """Close the engine of an app that has been collected, if it is still there. The collection may run in any
    thread, the engine's own among them, which may hold the engine's lock then (close takes it, and would wait for
    itself): it closes from another thread there."""
    engine = engine_ref()
    if engine is None:
        return
    if threading.current_thread() is engine.thread:
        threading.Thread(target=engine.close, daemon=True, name="blockpress-engine-close").start()
    else:
        engine.close()


# -- the app --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerState:
    """What the request handlers share."""

    lm: Any
    engine: Engine
    model_name: str
    context: int  # the most tokens a prompt and its answer may take
    # The most characters one token of the vocabulary holds (Tokenizer.longest_token), which bounds the text that
    # can fit the context before it is tokenized; None: no such check.
    token_chars: int | None = None
    max_stops: int = 16  # the most stop strings a request may send (create_app's max_stops)
    # chat-template variables every chat request renders with, under its own chat_template_kwargs (create_app's)
    template_defaults: dict[str, Any] = field(default_factory=dict)

    def check_length(self, chars: int, name: str, param: str) -> None:
        """Refuse text of `chars` characters that cannot fit the context whatever its tokens, before it is tokenized:
        the tokenizer holds the GIL, so a huge prompt would freeze every client (streams, /health) for a minute or
        more before the 400 that its token count gets, and take gigabytes of memory."""
        if self.token_chars is not None and chars > self.context * self.token_chars:
            raise APIError(400, f"{name}: {chars} characters cannot fit the context of {self.context} tokens (no token "
                                f"of this vocabulary holds more than {self.token_chars} characters, so more than "
                                f"{self.context * self.token_chars} are refused before tokenizing)", param)


@dataclass
class Usage:
    """A request's usage so far: completion tokens, forward passes, and prompt tokens the prefix cache held."""

    completion: int = 0
    passes: int = 0
    reused: dict[int, int] = field(default_factory=dict)  # by prompt: its choices share it, so count it once

    def add(self, job: Job, done: JobDone) -> None:
        self.completion += done.tokens * job.copies
        self.passes += done.passes
        # The least of its choices: the first one encodes a prompt the cache lacks, the others of its batch then
        # reuse what it kept (prefix.encode_prompts), which the request itself encoded and is no cached token.
        before = self.reused.get(job.group)
        self.reused[job.group] = done.reused if before is None else min(before, done.reused)

    @property
    def cached(self) -> int:
        return sum(self.reused.values())


@dataclass
class Reply:
    """One request's answer in the making: its jobs, and what every response object of it says."""

    jobs: list[Job]
    kind: Literal["chat", "completion"]
    model: str
    prompt_tokens: int
    id: str = field(init=False)
    # every job's events, as they come: a stream sends each choice's text as soon as it is there
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # A chat reply's reader for tool calls (response.py's parse_response with the checkpoint's response template, the
    # prompt and the tools), when the request has tools and the checkpoint a response template; its jobs keep
    # special tokens (Job.keep_special). `read_partial`: a new reader of the same template for a streamed reply so
    # far, chunk after chunk (response.PartialReader, one a choice).
    parse: Callable[[str], dict] | None = None
    read_partial: Callable[[], PartialReader] | None = None
    # OpenAI's parallel_tool_calls false: at most one call per reply. A model writes what it writes, so the reply
    # keeps its first call and drops the rest (as vLLM does); the calls it keeps are answered in the next turn.
    one_call: bool = False
    # The request offers tools (and tool_choice is not "none"): a call comes back as one. Else the reply is read for
    # its thought alone, and one that writes a call anyway is answered as text (but for a thought before the
    # call, which a stream has sent: response.thought_then_text).
    calls_wanted: bool = True
    # The answer's text of a part of the reply read with special tokens (Job.keep_special): those left out, as the
    # answer's text is decoded. `read_regions`: a reader of where the reply's regions are (response.regions_only).
    plain: Callable[[str], str] | None = None
    read_regions: Callable[[], PartialReader] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # the request's id (RequestId): the response's id is chatcmpl-<it>, as vLLM's (None: one made)
    request_id: str | None = None

    def __post_init__(self) -> None:
        self.request_id = self.request_id or new_request_id()
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id
        first = 0
        for job in self.jobs:  # not queued yet
            job.events, job.choices = self.events, range(first, first + job.copies)
            job.request_id = self.request_id
            first += job.copies

    def tool_message(self, done: JobDone, ids: Sequence[str] = ()) -> dict | None:
        """A done answer as the assistant message the response template reads in it, and the finish_reason: its
        tool calls as OpenAI's `tool_calls` (each with a new id, or the one in `ids` (a stream sent it), its
        arguments as JSON text; finish_reason "tool_calls"), and its thought as `reasoning_content` apart from the
        content, call or no call (a thinking model's reply to a request with tools may answer in words). None where
        the answer is text: no `parse`, or neither a call nor a thought in the reply (an empty thought is one: its
        markers are out of the content), or calls in a shape that is not {"type": "function", "function": {"name":
        ..., "arguments": ...}}, or calls where the request offers no tools (`calls` false), or a reply the response
        template cannot read (the model wrote a malformed call), which is logged."""
        if self.parse is None or done.raw is None:
            return None
        if not self.calls_wanted:  # (as `blockpress chat` reads its replies)
            if self.read_regions is None or self.plain is None:
                raise ValueError("tool_message: a reply read without tools needs plain and read_regions")
            answer = answer_without_tools(self.parse, self.read_regions, self.plain, done.raw)
            return None if answer is None else {"message": answer, "finish_reason": done.finish}
        try:
            parsed = self.parse(done.raw)
        except ValueError as exc:
            start = self.readable_start(done.raw)
            if start is None:
                log.warning("serve: request %s: the response template cannot read a reply (%s), so it is answered "
                            "as text", self.request_id, exc)
                return self.text_answer(done)
            # a call cut by max_tokens, or a malformed one, after calls that closed: those are answered (a stream
            # sent each as it closed), the rest dropped, as parallel_tool_calls false drops a reply's later calls
            log.warning("serve: request %s: the response template cannot read the end of a reply (%s); the calls "
                        "it closed before are answered, the rest dropped", self.request_id, exc)
            parsed = start
        calls = self.calls(parsed.get("tool_calls"), ids)
        if calls is None:  # its first call has a shape OpenAI's calls have not (logged): text, as above
            return self.text_answer(done)
        reasoning = parsed.get("reasoning_content")
        if not (calls or isinstance(reasoning, str)):
            return None
        reasoning = reasoning or None  # (an empty thought: none to show)
        content = parsed.get("content")
        content = content if isinstance(content, str) and content else None
        message: dict[str, Any] = {"role": "assistant", "content": content if calls or content is not None else ""}
        if calls:
            message["tool_calls"] = calls
        if reasoning is not None:  # what vLLM and DeepSeek's API call it
            message["reasoning_content"] = reasoning
        return {"message": message, "finish_reason": "tool_calls" if calls and done.finish == "stop" else done.finish}

    def text_answer(self, done: JobDone) -> dict | None:
        """A reply with tools answered as text (None: its plain text) but for a thought before the call that made it
        text, which a stream sent apart as it was written (left in the content, the whole answer would hold the
        thought again): kept apart, as a reply without tools does."""
        answer = None if self.read_regions is None or self.plain is None or done.raw is None else \
            thought_then_text(self.read_regions, self.plain, done.raw)
        return None if answer is None else {"message": answer, "finish_reason": done.finish}

    def readable_start(self, raw: str) -> dict[str, Any] | None:
        """A reply the response template cannot read whole, read up to there: the tool calls, content and thought of
        its longest start that reads, where that start closed a call (None: it closed none, or no reader)."""
        if self.read_partial is None:
            return None
        read_partial = self.read_partial

        def read(end: int) -> PartialMessage | None:
            try:
                return read_partial().read(raw[:end])
            except ValueError:
                return None

        partial = read(len(raw))
        if partial is None:  # the longest start that reads (a start that does not is followed by none that does)
            low, high = 0, len(raw)
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if read(middle) is not None else (low, middle - 1)
            partial = read(low)
        if partial is None or not partial.closed.get("tool_calls"):
            return None
        return {"tool_calls": partial.closed["tool_calls"], "content": partial.settled_text("content"),
                "reasoning_content": partial.settled_text("reasoning_content") if partial.began("reasoning_content")
                else None}

    def calls(self, found: Any, ids: Sequence[str] = ()) -> list[dict] | None:
        """openai_calls of a parsed reply, the first alone where the request allows one (one_call)."""
        calls = openai_calls(found, ids)
        return calls[:1] if calls is not None and self.one_call else calls

    def choice(self, i: int, text: str | None, finish: str | None, delta: bool) -> dict:
        if self.kind == "chat":
            key = "delta" if delta else "message"
            content = {} if text is None else ({"content": text} if delta else {"role": "assistant", "content": text})
            return {"index": i, key: content, "finish_reason": finish}
        return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}

    def usage(self, totals: Usage) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": totals.completion,
                "total_tokens": self.prompt_tokens + totals.completion, "forward_passes": totals.passes,
                "prompt_tokens_details": {"cached_tokens": totals.cached}}


def openai_calls(found: Any, ids: Sequence[str] = ()) -> list[dict] | None:
    """A parsed message's tool calls as OpenAI's (ids from `ids`, then new ones; arguments as JSON text); None where
    one has a shape that is not {"type": "function", "function": {"name": ..., "arguments": ...}}, which is logged.
    A call whose arguments are no JSON object ends them: the calls before it (None where it is the first)."""
    calls: list[dict] = []
    for k, call in enumerate([found] if isinstance(found, dict) else found or []):  # (a field without "repeats")
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            log.warning("serve: the response template gave a tool call of an unknown shape, %.200r; the reply is "
                        "answered as text", call)
            return None
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):  # a template's raw text (allow_non_json): a call only if it is an object
            try:
                arguments_value = parse_json(arguments)
            except json.JSONDecodeError:
                arguments_value = None
        else:
            arguments_value = arguments
        if not isinstance(arguments_value, dict):
            # OpenAI's arguments are an object's JSON, and the server refuses any other in the assistant message an
            # agent sends back next turn (a template prints them as an object's keys): the calls before it are the
            # answer, the rest dropped (as after a malformed call); as the first, the reply is text
            log.warning("serve: the response template gave a tool call whose arguments are no object, %.200r; %s",
                        call, "the reply is answered as text" if k == 0 else "it and the calls after it are dropped")
            return calls or None
        calls.append({"id": ids[k] if k < len(ids) else "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": function["name"], "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    return calls


def copy_calls(value: Any, copy: int) -> Any:
    """A job's choice message, or stream delta, for its copy `copy` (n greedy choices are one answer computed once):
    its calls' ids its own, each derived from the first copy's (else the copies would share one id, where OpenAI's
    are unique per call); copy 0 and a value with no calls as they are."""
    if copy == 0 or not isinstance(value, dict):
        return value
    if "tool_calls" in value:
        return {**value, "tool_calls": [
            {**call, "id": "call_" + hashlib.sha256(f"{call['id']}/{copy}".encode()).hexdigest()[:24]}
            if "id" in call else call for call in value["tool_calls"]]}
    return {**value, **{key: copy_calls(value[key], copy) for key in ("message", "delta") if key in value}}


@dataclass
class ToolStream(AnswerStream):
    """A streamed chat reply read for tool calls (Reply.parse): what of it has been sent. Its thought and content go
    out as the reply settles them (AnswerStream, as `blockpress chat` shows them), and each call once its closing
    marker is written, so that the chunks add up to the whole answer (Reply.tool_message)."""

    calls: list[dict] = field(default_factory=list)

    def new_calls(self, calls: Sequence[Any]) -> list[dict]:
        """A delta for each of `calls` past those sent (`self.calls`), at its index in the reply."""
        sent = len(self.calls)
        return [{"tool_calls": [{"index": k, **call}]} for k, call in enumerate(calls[sent:], sent)]

    def settle(self, reply: Reply, item: JobText, stops: Sequence[str]) -> list[dict]:
        """The deltas that the reply so far settles and that have not been sent."""
        if reply.read_partial is None:
            raise ValueError("settle: the reply has no read_partial to read it with (a reply read for tool calls "
                             "has parse and read_partial both)")
        if self.unread or item.raw is None:
            return []
        # (a stop string cuts the answer: only text before every one that may be starting is settled)
        deltas, partial = self.advance(reply.read_partial, settled_text(cut_at_stop(item.raw, stops), stops),
                                       settled_text(item.text, stops), reply.calls_wanted)
        if partial is None:
            return list(deltas)
        calls = reply.calls(partial.closed.get("tool_calls"), [c["id"] for c in self.calls])
        if calls is None:
            self.unread = True
            return list(deltas)
        out = [*deltas, *self.new_calls(calls)]
        self.calls = calls
        return out

    def finish(self, reply: Reply, done: JobDone) -> tuple[list[dict], str]:
        """The deltas left of the whole answer, and its finish_reason."""
        called = reply.tool_message(done, [c["id"] for c in self.calls])
        message = called["message"] if called is not None else {"content": done.text}
        content, reasoning = message["content"] or "", message.get("reasoning_content") or ""
        calls = message.get("tool_calls", [])
        deltas = []
        for key, whole, sent in (("reasoning_content", reasoning, self.reasoning), ("content", content, self.content)):
            if len(whole) > len(sent) and whole.startswith(sent):
                deltas.append({key: whole[len(sent):]})
        if not content.startswith(self.content) or not reasoning.startswith(self.reasoning) or \
                calls[: len(self.calls)] != self.calls:
            # a template whose content (or thought) keeps only its last part, written after a call or a thought
            # (no point of a reply rules a later one out), or a malformed call after well-formed ones sent already:
            # what was sent cannot be taken back
            log.warning("serve: request %s: a streamed reply's chunks differ from its whole answer (%d calls, %.80r "
                        "and thought %.80r sent; the answer has %.80r, thought %.80r and %d calls)", reply.request_id,
                        len(self.calls), self.content, self.reasoning, content, reasoning, len(calls))
        deltas += self.new_calls(calls)
        return deltas, called["finish_reason"] if called is not None else done.finish


def field_path(loc: Sequence[str | int]) -> str:
    """A field's place as OpenAI writes it: messages[0].content."""
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")


def union_tag(loc: Sequence[str | int], names: frozenset[str]) -> int | None:
    """Where pydantic put a union member's tag in `loc` ("str" in ("prompt", "str")), if anywhere: the first
    element that is neither a list index nor a field name."""
    return next((i for i, x in enumerate(loc) if isinstance(x, str) and x not in names), None)


def read_as_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body with this Content-Type as JSON: application/json or application/*+json
    (text/json and application/jsonl are read as bytes, which then are "not a JSON object"). A body with none is
    not read as JSON since FastAPI 0.132 (requests' post(data=json.dumps(...)) sends none); before it, it was, and
    then a body that comes to "not a JSON object" is not one, and the hint to send the header does no harm."""
    if not content_type:
        return False
    header = email.message.Message()
    header["content-type"] = content_type
    subtype = header.get_content_subtype()
    return header.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def validation_error(exc: RequestValidationError, content_type: str | None) -> JSONResponse:
    """A request body that does not fit its model, as OpenAI's 400 naming the field."""
    names = frozenset(f for m in (ChatRequest, CompletionRequest, Message, TextPart, StreamOptions, Tool, FunctionDef,
                                  ToolCall, FunctionCall) for f in m.model_fields)
    errors = [(e, [x for x in e.get("loc", []) if x != "body"]) for e in exc.errors()]
    err, loc = errors[0]
    param = field_path(loc) or None
    msg = err.get("msg", "invalid request")
    tag = union_tag(loc, names) if err.get("type") != "extra_forbidden" else None  # (an unknown field's name)
    if tag is not None:
        # A field of several types (prompt: str | list[int]; a message's content) fails once per type, each under
        # the type's tag: name the field and every form it takes, not "prompt.str: Input should be a valid
        # string", and, where the value had one form's shape, what inside it is wrong.
        field_loc = loc[:tag]
        members = [(e, x) for e, x in errors if x[:tag] == field_loc and union_tag(x, names) == tag]
        forms = list(dict.fromkeys(x[tag] for _, x in members))
        inner = list(dict.fromkeys(x[tag] for _, x in members if len(x) > tag + 1))
        param, msg = field_path(field_loc), f"expected {' or '.join(forms)}"
        if len(inner) == 1:  # the value had that form's shape: say what inside it is wrong
            e, x = next((e, x) for e, x in members if x[tag] == inner[0] and len(x) > tag + 1)
            where = param + field_path([y for y in x[tag + 1:] if y not in forms])
            if x[-1] == "type" and "content" in field_loc and e.get("type") == "literal_error":
                msg += f"; only text parts are supported ({where} is {e.get('input')!r})"
            else:
                msg += f"; {where}: {e.get('msg')}"
        elif err.get("input") is None:
            msg += ", got null"
    if not loc and err.get("type") in ("missing", "model_attributes_type", "dict_type"):
        msg = "the request body must be a JSON object"
        if not read_as_json(content_type):
            msg += f" sent with Content-Type: application/json (got {content_type or 'none'})"
    elif err.get("type") == "extra_forbidden":
        msg = f"unknown field {param!r}"
        if param == "max_completion_tokens":  # OpenAI's chat field; the legacy completions take max_tokens
            msg += " (a /v1/chat/completions field; /v1/completions takes max_tokens)"
    elif err.get("type") == "json_invalid":
        # why and where, as --input names a bad line's (loc: the character json stopped at, counted from 0); a raw
        # newline or tab in a string (a prompt typed over lines in curl -d '...') is the usual cause, so said how to
        # write one
        reason = err.get("ctx", {}).get("error", "decode error")
        where = f", character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        hint = "; a newline or tab inside a string is written \\n or \\t" if "control character" in reason else ""
        msg, param = f"the request body is not valid JSON ({reason}{where}{hint})", None
    elif err.get("type") == "too_short":  # pydantic says "at least 1 item", also of a string
        msg = "must not be empty"
    return JSONResponse(error_body(f"{param}: {msg}" if param else msg, "invalid_request_error", param),
                        status_code=400)


def build_jobs(state: ServerState, body: _Common, prompt: list[int],
               loop: asyncio.AbstractEventLoop | None = None) -> list[Job]:
    """A request's jobs for one prompt: one per sampled choice, or one for all its greedy choices. `loop`: the event
    loop their events go to (None: the running one; given where they are built in a worker thread)."""
    lm, model_name, context = state.lm, state.model_name, state.context
    # The served name alone, as /v1/models lists it (a folder's name too, under --served-name, would be taken
    # here while /v1/models/{its name} answers 404; vLLM refuses it as well)
    if not same_model(body.model, model_name):
        raise unknown_model(body.model, model_name)
    field_name = body.unsupported()
    if field_name:
        noop = [json.dumps(v) for v in body.noop_values[field_name]]  # as a client writes them
        accepted = f"{', '.join(noop)} or " if noop else ""
        raise APIError(400, f"{field_name}: not supported by this server ({NOOP_WHY.get(field_name, 'block diffusion')}"
                            f"; only {accepted}null is accepted)", field_name)
    # the field the limit came from, for the errors: chat's max_completion_tokens (the openai client's name) wins
    limit_name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    given = getattr(body, "max_completion_tokens", None) or body.max_tokens
    prompt_param = "messages" if isinstance(body, ChatRequest) else "prompt"  # (so chat's 400s name messages)
    free = getattr(body, "template", None) is None  # (a template's length is its own, checked by completion_jobs)
    # A suffix request's trailing space heals into its hole, leaving the prompt a token shorter: bounded here by that
    # (so a max_tokens of 10**12 is refused before its canvas is built), measured exactly by completion_jobs, which
    # also cuts the default to the room beside the suffix (a prompt that cannot heal is its whole length: counted
    # a token short, its 400 named max_tokens where the prompt left no canvas)
    heals = getattr(body, "suffix", None) is not None and bool(heal(lm.tokenizer, prompt).prefix)
    used = len(prompt) - heals
    # Where max_length leaves no room, a min_tokens the client sent is the length, as in the library (not a 400
    # naming a max_tokens never sent); not chat's default 1, which only bans an empty reply
    asked = free and "min_tokens" in body.model_fields_set and body.min_tokens > 0
    try:  # the model's default: its generation config's max_new_tokens, or max_length less the prompt
        max_tokens = given or lm.default_new_tokens(len(prompt), room_needed=not asked)
    except ValueError as exc:  # (the library's advice names its own argument, max_new_tokens: the client's is below)
        raise APIError(400, f"{prompt_param}: {str(exc).split('; pass ')[0]}; send {limit_name}",
                       prompt_param) from None
    canvas = lm.config.canvas_length
    if not given and free:
        # No limit sent: the default is cut to the whole canvases the context has left, as vLLM gives what fits and
        # `blockpress chat` shortens its reply (not a 400 naming a max_tokens the client never sent). Where not
        # even min_tokens (at least one token) fits, that is what is said.
        room = canvas_room(context, used, canvas)
        if room < max(1, body.min_tokens):
            param = prompt_param if room == 0 else "min_tokens"
            needs = f"min_tokens {body.min_tokens}" if room else f"one {canvas}-token canvas"
            raise APIError(400, f"{param}: {len(prompt)} prompt tokens leave room for {room} new tokens (whole "
                                f"{canvas}-token canvases) in the context of {context} tokens, too few for {needs}",
                           param)
        # the default grows to a min_tokens past it (not a 400 naming a max_tokens the client never sent), as
        # vLLM's default, the context's room, takes it
        max_tokens = min(max(max_tokens, body.min_tokens), room)
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens: {body.min_tokens} is more than {limit_name} {max_tokens}", "min_tokens")
    taken = canvas_positions(max_tokens, canvas)  # block diffusion's new tokens take whole canvases
    if free and used + taken > context:
        # the prompt is what to shorten when it leaves no room for one canvas
        param = prompt_param if used + canvas > context else limit_name
        whole = f" (whole {canvas}-token canvases: {taken} positions)" if taken != max_tokens else ""
        raise APIError(400, f"{param}: {len(prompt)} prompt tokens + {limit_name} {max_tokens}{whole} exceed the "
                            f"context of {context} tokens", param)
    cfg = sampler_config(lm.sampler_defaults, body)
    sent = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(sent) > state.max_stops:  # each is searched for in every row's text at every canvas, on the engine thread
        raise APIError(400, f"stop: {len(sent)} stop strings are more than the {state.max_stops} this server takes "
                            "(serve's --max-stops)", "stop")
    stops = [s for s in sent if s]
    if body.seed is not None:
        seed = body.seed % 2**63  # a negative int64 folded into the engine's range (see _Common.seed)
    elif cfg.argmax_candidates:  # temperature 0: the same answer every time, so no random starting canvas
        seed = 0
    else:
        seed = int.from_bytes(uuid.uuid4().bytes[:6], "little")
    loop = loop or asyncio.get_running_loop()
    # the healed token's text, which the first new tokens repeat (the LM heals each prompt the same way)
    prefix = heal(lm.tokenizer, prompt).prefix if body.token_healing else ""
    eos_only = "min_tokens" not in body.model_fields_set  # the default: chat's 1 (ChatRequest.min_tokens)
    # n greedy choices are one answer n times, as OpenAI's: run it once, as n copies; else a job a choice
    greedy = cfg.argmax_candidates
    seeds = [seed] if greedy else [choice_seed(seed, i) for i in range(body.n)]
    return [Job(prompt=prompt, max_tokens=max_tokens, min_tokens=body.min_tokens, sampler=cfg, seed=s, stop=stops,
                drafts=body.drafts, token_healing=body.token_healing, loop=loop, events=asyncio.Queue(),
                copies=body.n if greedy else 1, heal_prefix=prefix, eos_only_minimum=eos_only) for s in seeds]


def sampler_config(defaults: SamplerConfig, body: _Common) -> SamplerConfig:
    """The checkpoint's sampler settings with the request's diffusion fields and OpenAI temperature applied."""
    overrides = {k: getattr(body, k) for k in ("max_denoising_steps", "sampler", "entropy_bound", "confidence",
                                               "t_min", "t_max", "stability_threshold", "confidence_threshold",
                                               "presence_penalty", "frequency_penalty", "top_k", "top_p")}
    if body.top_k == -1:  # vLLM's "all tokens", which SamplerConfig calls 0
        overrides["top_k"] = 0
    try:
        cfg = defaults.with_(**overrides).with_temperature(body.temperature, sampler_given=body.sampler is not None)
        # Greedy candidates draw nothing for top_p / top_k to filter: OpenAI's clients send them by habit, so they
        # are taken and change nothing (the library refuses a call's own, which would be ignored)
        return cfg.with_(top_k=0, top_p=1.0) if cfg.argmax_candidates else cfg
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(":", 1)[0]) from None


def constrained_canvas(state: ServerState, body: CompletionRequest, prompt: list[int], max_tokens: int,
                       from_text: bool) -> Canvas:
    """The canvas of a `suffix` or `template` request after `prompt` (`from_text`: the client sent it as text)."""
    tok = state.lm.tokenizer
    given = "suffix" if body.suffix is not None else "template"
    for other, clash in (("template", body.suffix is not None and body.template is not None),
                         # A template's answer is the whole filled text, which a stop string would cut inside the
                         # client's own text; a suffix's fill is cut at one (Job.answer). (Empty stop strings are
                         # none, as build_jobs drops them: "" and [""] alike.)
                         ("stop", body.template is not None
                          and any([body.stop] if isinstance(body.stop, str) else body.stop or [])),
                         ("token_healing", body.token_healing)):
        if clash:
            raise APIError(400, f"{other}: not with {given} (a constrained canvas has a fixed length and fixed "
                                "tokens)", other)
    text = body.suffix if body.suffix is not None else body.template
    if text is None:
        raise ValueError("constrained_canvas: a request with neither suffix nor template has no constrained canvas")
    state.check_length(len(text), given, given)
    if body.suffix is not None:
        try:
            # The suffix is the client's text, encoded as lm.infill encodes escape_template(suffix): a hole marker in
            # it (a file that mentions "<|hole|>") is plain text, not the model's absorbing noise token in the fixed
            # tokens; other special tokens (<eos>) stay special, as in a template
            fixed, _ = parse_text_template(escape_template(check_text(body.suffix, "suffix")), tok, 1, None)
            holes = [-1] * max_tokens + fixed
        except ValueError as exc:
            raise APIError(400, str(exc), "suffix") from None
        if not from_text:
            return Canvas(prompt, holes, max_tokens)
        # A text prompt's trailing space joins the hole, as lm.infill does with a text prompt (the engine heals
        # that position; the answer leaves the space out, the prompt holds it)
        [healed], canvas = heal_into_template(tok, [prompt], Template([holes], [hole_runs(holes)]))
        return Canvas(healed.ids, canvas.rows[0], max_tokens, healed.prefix)
    try:
        return Canvas(prompt, parse_template(body.template, tok, 1, 8, state.context).rows[0], None)
    except ValueError as exc:
        raise APIError(400, str(exc), "template") from None


def _one_id_list(prompt: list[int] | list[str] | list[list[int]]) -> TypeIs[list[int]]:
    """A prompt list that is one prompt's ids (CompletionRequest's validation gave it one kind of item)."""
    return isinstance(prompt[0], int)


def request_prompts(body: CompletionRequest) -> tuple[Sequence[str | list[int]], bool]:
    """A completion request's prompts as sent (texts or id lists), and whether it sent one alone (not in a list)."""
    prompt = body.prompt
    if not isinstance(prompt, str) and not prompt:  # no prompt at all, or one of no token ids
        raise APIError(400, "prompt: must not be empty", "prompt")
    if isinstance(prompt, str) or _one_id_list(prompt):
        return [prompt], True
    return prompt, False


def completion_prompts(state: ServerState, body: CompletionRequest) -> Iterator[tuple[list[int], bool]]:
    """The token ids of a completion request's prompts (one, or OpenAI's batch of texts or of id lists), each with
    whether it came as text, tokenized one at a time as they are taken (so a request is refused at its first prompt
    when all of them can never fit the queue)."""
    prompts, one = request_prompts(body)
    for i, prompt in enumerate(prompts):
        name = "prompt" if one else f"prompt[{i}]"
        if isinstance(prompt, str):
            state.check_length(len(prompt), name, "prompt")
            try:
                encoded = state.lm.tokenizer.encode_prompt(check_text(prompt, name))
            except ValueError as exc:
                raise APIError(400, str(exc), "prompt") from None
            if not encoded:  # "" where the tokenizer has no BOS: no token to start from, as the library refuses it
                raise APIError(400, f"{name}: must not be empty (this tokenizer has no BOS token to start from)",
                               "prompt")
            yield encoded, True
            continue
        if not prompt:
            raise APIError(400, f"{name}: must not be empty", "prompt")
        bad = [t for t in prompt if not 0 <= t < state.lm.config.text.vocab_size]
        if bad:
            raise APIError(400, f"{name}: token id {bad[0]} is outside the vocabulary", "prompt")
        yield list(prompt), False


def completion_jobs(state: ServerState, body: CompletionRequest, prompt: list[int], from_text: bool,
                    loop: asyncio.AbstractEventLoop | None = None) -> list[Job]:
    """A completion request's jobs for one prompt, on a constrained canvas when it sends `suffix` or `template`
    (`loop`: as build_jobs')."""
    jobs = build_jobs(state, body, prompt, loop)
    if body.suffix is None and body.template is None:
        return jobs
    c, context = state.lm.config.canvas_length, state.context
    canvas = constrained_canvas(state, body, prompt, jobs[0].max_tokens, from_text)
    # a suffix's canvas is its holes and its fixed tokens (and a healed space moved out of the prompt)
    fixed = len(canvas.tokens) - jobs[0].max_tokens if body.suffix is not None else len(canvas.tokens)
    room = canvas_room(context, len(canvas.prompt), c)
    if body.suffix is not None and not body.max_tokens and room - fixed < jobs[0].max_tokens \
            and room - fixed >= max(1, body.min_tokens):
        # No limit sent: the default is cut to what the context has room for beside the suffix (and a healed space),
        # as build_jobs cuts a plain request's beside its prompt (not a 400 naming the prompt, when a shorter fill fits)
        canvas = constrained_canvas(state, body, prompt, room - fixed, from_text)
        for job in jobs:
            job.max_tokens = room - fixed
    for job in jobs:  # not queued yet: a refusal below drops them
        job.prompt, job.canvas, job.answer_tokens = canvas.prompt, canvas.tokens, canvas.answer_tokens
        job.heal_prefix = canvas.heal_prefix
    if jobs[0].holes > jobs[0].max_tokens:  # the holes are what the model writes: max_tokens bounds them
        raise APIError(400, f"template: its holes hold {jobs[0].holes} tokens, more than max_tokens "
                            f"{jobs[0].max_tokens}; raise max_tokens or shorten the holes", "template")
    taken = canvas_positions(len(canvas.tokens), c)  # whole canvases, as any answer's
    if len(canvas.prompt) + taken > context:
        # what to shorten: the prompt where it leaves no canvas, else the template, or the suffix where not one hole
        # fits beside it, else the client's max_tokens (or the min_tokens that outgrew the room left)
        param = ("prompt" if len(canvas.prompt) + c > context else "template" if body.suffix is None
                 else "suffix" if room <= fixed else "max_tokens" if body.max_tokens else "min_tokens")
        raise APIError(400, f"{param}: {len(prompt)} prompt tokens + a {len(canvas.tokens)}-token canvas ({taken} "
                            f"positions in whole canvases) exceed the context of {context} tokens", param)
    return jobs


def finished(engine: Engine, reply: Reply, totals: Usage) -> None:
    """A request's every choice is answered: its prompt, the part of it reused, and its latency, once."""
    engine.metrics.add(requests_total=1, prompt_tokens_total=reply.prompt_tokens,
                       cached_prompt_tokens_total=totals.cached)
    engine.metrics.observe(time.perf_counter() - reply.jobs[0].created)


def release(engine: Engine, reply: Reply, unanswered: str | None) -> None:
    """A request's handler is done with it: the engine stops rows that would run for nobody, and a request that was
    not answered counts as `unanswered` ("cancelled_total": its client left; "failed_total": an error or a cut)."""
    for job in reply.jobs:
        job.cancelled.set()
    if unanswered is not None:
        engine.metrics.add(**{unanswered: 1})


async def respond(engine: Engine, reply: Reply, body: _Common, request: Request) -> Any:
    """Queue a request's jobs and answer it: one JSON object, or a stream of server-sent events."""
    if body.stream_options is not None and not body.stream:  # checked before any job is queued
        raise APIError(400, "stream_options: only with stream: true", "stream_options")
    if body.drafts and not body.stream:  # no stream to carry them, and they cost the whole batch a draft a step
        raise APIError(400, "drafts: only with stream: true (drafts are streamed as the canvas settles)", "drafts")
    # the library's checks read every prompt id: off the event loop (Engine.check_request). Nothing is queued before
    # they pass, so a client that leaves meanwhile leaves nothing behind.
    await asyncio.to_thread(engine.check_request, reply.jobs)
    engine.submit(reply.jobs)  # a refused request counts in rejected_total; an answered one in requests_total
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        # An event stream is neither cached nor buffered on its way: nginx (proxy_buffering on by default) in front of
        # a web front end would hold every chunk until the answer's end, unless told not to
        return StreamingResponse(stream_reply(engine, reply, with_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await collect_reply(engine, reply, request)


async def stream_reply(engine: Engine, reply: Reply, with_usage: bool) -> AsyncIterator[str]:
    """A request's server-sent events: OpenAI's chunks, then the usage (when asked) and [DONE]."""
    # OpenAI's chunk objects: chat.completion.chunk, and text_completion for the legacy completions
    chunk_object = "chat.completion.chunk" if reply.kind == "chat" else "text_completion"

    def sse(choices: list[dict], **extra: Any) -> str:
        chunk = {"id": reply.id, "object": chunk_object, "created": reply.created, "model": reply.model,
                 "choices": [{**c, "logprobs": None} for c in choices], **extra}  # (every choice has it, null)
        if with_usage and "usage" not in chunk:
            chunk["usage"] = None  # as OpenAI: every chunk but the last carries a null usage
        return f"data: {json.dumps(chunk)}\n\n"

    totals = Usage()
    sent = {job.choices.start: "" for job in reply.jobs}  # each job's text sent so far
    streams: dict[int, ToolStream] = {}  # each job's, where the reply is read for tool calls
    unanswered: str | None = "failed_total"  # until the answer is whole, or the client leaves
    item = None
    try:
        if reply.kind == "chat":  # OpenAI's first delta of a choice names the role
            for job in reply.jobs:
                yield sse([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                           for i in job.choices])
        working = len(reply.jobs)
        while working:
            job, item = await reply.events.get()
            if isinstance(item, JobError):
                yield f"data: {json.dumps(error_body(item.message, 'server_error', None))}\n\n"
                return
            if isinstance(item, JobDraft):
                yield sse([reply.choice(i, None, None, True) for i in job.choices],
                          blockpress={"draft": item.text, "step": item.step})
                continue
            if reply.parse is not None:  # read for tool calls: content as it settles, each call once it is whole
                tools = streams.setdefault(job.choices.start, ToolStream())
                if isinstance(item, JobText):
                    deltas, finish = tools.settle(reply, item, job.stop), None
                else:
                    totals.add(job, item)
                    deltas, finish = tools.finish(reply, item)
                for delta in deltas:
                    yield sse([{"index": i, "delta": copy_calls(delta, i - job.choices.start), "finish_reason": None}
                               for i in job.choices])
                if finish is not None:
                    yield sse([{"index": i, "delta": {}, "finish_reason": finish} for i in job.choices])
                    working -= 1
                continue
            # The chunks must add up to the plain answer: send only text no later event can take back, and the
            # rest with the final text.
            text = item.text if isinstance(item, JobDone) else settled_text(item.text, job.stop)
            before = sent[job.choices.start]
            piece = text[len(before):] if text.startswith(before) else ""
            if piece:
                sent[job.choices.start] = text
                yield sse([reply.choice(i, piece, None, True) for i in job.choices])
            if isinstance(item, JobDone):
                totals.add(job, item)  # the engine ended stopped rows and cut their text
                yield sse([reply.choice(i, None if reply.kind == "chat" else "", item.finish, True)
                           for i in job.choices])
                working -= 1
        finished(engine, reply, totals)
        unanswered = None
        if with_usage:
            yield sse([], usage=reply.usage(totals))
        yield "data: [DONE]\n\n"
    except (GeneratorExit, asyncio.CancelledError):  # the client left: starlette closes or cancels the stream
        if unanswered is not None and not isinstance(item, JobError):  # (one that failed first failed)
            unanswered = "cancelled_total"
        raise
    finally:
        release(engine, reply, unanswered)  # a client that left frees its rows


async def client_left(request: Request) -> None:
    """Return once the client has closed the connection. Once a body is read whole, the next message the server
    gives is the disconnect (or none until the answer is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_reply(engine: Engine, reply: Reply, request: Request) -> dict:
    """A request's answer as one JSON object, once every job is done."""
    choices, totals = [], Usage()
    working = len(reply.jobs)
    unanswered: str | None = "failed_total"  # until every choice is in, or the client leaves
    # A client that leaves frees its rows at once, as a stream's does: asking after it only now and then, a
    # burst of clients that gave up would keep their queue places (429s to the next) a while longer
    left = asyncio.ensure_future(client_left(request))
    try:
        while working:
            event = asyncio.ensure_future(reply.events.get())
            await asyncio.wait((event, left), return_when=asyncio.FIRST_COMPLETED)
            if not event.done():  # the client left
                event.cancel()
                unanswered = "cancelled_total"
                raise APIError(499, "the client closed the connection", kind="client_closed")
            job, item = event.result()
            if isinstance(item, JobError):
                raise APIError(item.status, item.message if item.status == 503 else
                               f"generation failed: {item.message}", kind="server_error")
            if isinstance(item, JobDone):  # the engine ended stopped rows and cut their text
                called = reply.tool_message(item)
                choices += [{"index": i, **copy_calls(called, i - job.choices.start)} if called
                            else reply.choice(i, item.text, item.finish, False) for i in job.choices]
                totals.add(job, item)
                working -= 1
        choices.sort(key=lambda c: c["index"])
        if reply.kind == "chat":  # fields OpenAI's schema requires of a choice and its message: null here
            choices = [{**c, "message": {**c["message"], "refusal": None}, "logprobs": None} for c in choices]
        unanswered = None
    finally:
        left.cancel()
        # Answered, failed, or the handler cancelled (uvicorn ends a shutdown's grace period so: a cut)
        release(engine, reply, unanswered)
    finished(engine, reply, totals)
    return {"id": reply.id, "object": "chat.completion" if reply.kind == "chat" else "text_completion",
            "created": reply.created, "model": reply.model, "choices": choices, "usage": reply.usage(totals)}


# What warm_up generates: a row alone, again with a longer prompt, then both as two rows (another batch size, left
# padding), then two rows of one prompt (no padding). Under serve's compile options (cli/common.py's
# serve_compile_options: dynamic sizes) these leave later requests nothing new to compile but for new
# sampler settings. Inductor guards the cache's length by ranges as well, so some batches (n=3, three padded
# rows) still add graphs of the decoder pass, past torch's default limit of 8 (lm.compile's is 32).
WARM_UP_PROMPTS = (("Hello",), ("Write a function that adds two numbers.",),
                   ("Hello", "Write a function that adds two numbers."), ("Hello", "Hello"))


def warm_up(app: FastAPI) -> None:
    """Run the server's first generations now, on the calling thread, before the engine thread starts (so before
    the app serves): under lm.compile() the first passes of each shape compile (minutes on a CPU), and under
    lm.cuda_graphs() the first capture pays CUDA's lazy setup, which the first clients would otherwise wait for. Each
    batch of WARM_UP_PROMPTS goes as a request's jobs go (completion_jobs, Engine._stream), over two canvases (the cache
    grows between them; no EOS before the end, min_tokens, as a row that ends in its first canvas would leave the second
    unwarmed); the two-row ones only where max_batch takes them. Nothing is answered or counted, and the prefix cache is
    left empty. The compiled code is the process's, so the engine thread runs it as it is."""
    state: ServerState = app.state.server
    engine, canvas = state.engine, state.lm.config.canvas_length
    if engine.thread.ident is not None:  # it owns the model from then on
        raise ValueError("warm_up: the engine thread has started; warm the app up before it serves")
    loop = asyncio.new_event_loop()  # the jobs' own; nothing is put on it
    try:
        for prompts in WARM_UP_PROMPTS:
            ids = [state.lm.tokenizer.encode_prompt(text) for text in prompts]
            rooms = [min(2 * canvas, canvas_room(state.context, len(row), canvas)) for row in ids]
            if len(prompts) > engine.max_batch or min(rooms) == 0:  # (a --max-context below the longer prompt)
                continue
            jobs = [job for row, room in zip(ids, rooms) for job in completion_jobs(
                state, CompletionRequest(model=state.model_name, prompt=row, max_tokens=room, min_tokens=room, seed=0),
                row, True, loop)]
            for _ in engine._stream(jobs):
                pass
    finally:
        loop.close()
        if engine.prefix_cache is not None:
            engine.prefix_cache.clear()


@dataclass
class ServerLimits:
    """create_app's limits, checked: `context` is max_context, or the model's where it gives none."""
    max_queue: int
    max_batch: int
    max_stops: int
    prefix_cache_bytes: int
    context: int
    max_body_bytes: int | None


def check_serving(lm: LM, *, max_queue: int, max_batch: int, max_context: int | None, prefix_cache_bytes: int,
                  max_body_bytes: int | None, max_stops: int) -> ServerLimits:
    """create_app's model checked servable (a tokenizer, runnable weights, default steps a request may take, a
    response template that compiles) and its limits checked, each refused by name; the limits as plain ints."""
    if lm.tokenizer is None:
        raise ValueError("serve: the model has no tokenizer.json; the OpenAI API needs text in and out")
    # a model on the meta device (shapes only) cannot run: refused here, as generate refuses it, rather than served
    # with /health "ok" and every request a 400 that blamed the client's `device`
    lm._check_runnable()
    if not is_int(prefix_cache_bytes) or prefix_cache_bytes < 0:  # (True would be a cache of one byte; "1" a TypeError)
        raise ValueError(f"prefix_cache_bytes: expected 0 (off) or more, got {prefix_cache_bytes!r}")
    steps = lm.sampler_defaults.max_denoising_steps  # what every request that sends none would take
    if steps > MAX_STEPS:
        raise ValueError(f"serve: the model's default max_denoising_steps ({steps}, its generation_config.json's) is "
                         f"more than the {MAX_STEPS} a request may ask for, and each step is a forward pass of every "
                         "row of its batch; set a smaller max_denoising_steps in generation_config.json")
    if lm.tokenizer.reply_template is not None:  # a broken one fails here, not in every request with tools
        compile_template(lm.tokenizer.reply_template)
    # a batch of 0 would never take a request: every one would hang; True is no count (it would pass as 1)
    for name, value in (("max_queue", max_queue), ("max_batch", max_batch), ("max_stops", max_stops)):
        check_positive_int(value, name)
    limit = lm.config.text.max_position_embeddings
    # past the model's positions the library refuses anyway: a larger limit would only be one the server never keeps
    if max_context is not None and (not is_int(max_context) or not 1 <= max_context <= limit):
        raise ValueError(f"max_context: expected a positive integer of at most the model's context of {limit} tokens "
                         f"(max_position_embeddings), got {max_context!r}")
    if max_body_bytes is not None and (not is_int(max_body_bytes) or max_body_bytes < 1):
        raise ValueError(f"max_body_bytes: expected a positive integer (bytes), got {max_body_bytes!r}")
    # as plain ints: numpy's pass the checks, and a limit reaches responses (/v1/models, /health), which JSON writes
    return ServerLimits(int(max_queue), int(max_batch), int(max_stops), int(prefix_cache_bytes),
                        limit if max_context is None else int(max_context),
                        None if max_body_bytes is None else int(max_body_bytes))


async def api_error(_: Request, exc: APIError) -> JSONResponse:
    """An APIError in OpenAI's error shape."""
    return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status,
                        headers=exc.headers)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """An unknown route or method in OpenAI's error shape, not FastAPI's {"detail": ...}."""
    headers, code = getattr(exc, "headers", None), None
    if exc.status_code == 405:  # every method the path answers (Starlette names the first route's: GET, not HEAD)
        methods = {m for route in request.app.router.routes if route.matches(request.scope)[0] != Match.NONE
                   for m in getattr(route, "methods", None) or ()}
        if methods:
            headers = {**(headers or {}), "Allow": ", ".join(sorted(methods))}
    detail = str(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":  # an unknown route, said as OpenAI says it
        detail, code = f"Invalid URL ({request.method} {request.url.path})", "unknown_url"
    if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "There was an error parsing the body", of bytes
        cause = exc.__cause__  # that are not UTF-8: said as the server's other bodies that are not JSON
        detail = (f"the request body is not valid JSON: not UTF-8 ({undecodable_byte(cause)}); send "
                  "JSON as UTF-8")
    return JSONResponse(error_body(detail, "invalid_request_error", None, code), status_code=exc.status_code,
                        headers=headers)


async def request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that does not parse as the route's request, in OpenAI's error shape (`validation_error`)."""
    return validation_error(exc, request.headers.get("content-type"))


def add_middleware_stack(app: FastAPI, body_bytes: int, api_key: str | None, origins: list[str],
                         hosts: list[str], engine: Engine) -> None:
    """The app's middleware: the limit on a request's body, the key check (none where `api_key` is None), the
    CORS of `origins` with the refusal of other pages' requests (RequireOrigin), the Host check of `hosts`, and
    the 503 of a request the shutdown cancels (AnswerStopped, around them), inside the request id (RequestId)."""
    # innermost: the key is checked (RequireKey) before a body is read, and CORS lets a page read the 413
    app.add_middleware(BodyLimit, limit=body_bytes)
    if api_key is not None:  # added first, so that CORS (added after it) wraps it: see RequireKey
        app.add_middleware(RequireKey, key=api_key)
    # inside CORS: a preflight from a page not allowed is still CORS's to answer (its 400)
    app.add_middleware(RequireOrigin, origins=origins)
    if origins:  # a browser sends a preflight OPTIONS before a JSON POST from another origin: without this, a 405
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "HEAD", "POST"],
                           allow_headers=["*"],  # (the openai JS client sends its x-stainless-* headers)
                           expose_headers=["Retry-After", "X-Request-Id"])  # a 429's back-off, for the page to read
    app.add_middleware(RequireHost, hosts=hosts)  # a rebound name is refused before anything else
    app.add_middleware(AnswerStopped, engine=engine)  # a request cancelled anywhere in the stack
    app.add_middleware(RequestId)  # outermost: every answer carries the id, a refusal of the checks too


def template_messages(state: ServerState, body: ChatRequest) -> list[dict]:
    """The messages, each checked, as the template takes them: in a worker thread, as checking a conversation of tens of
    thousands of messages on the event loop would hold every other client."""
    # a template renders each message as a token at least (its turn's marker), so more messages than the context
    # has tokens never fit: refused before a render that would run past TEMPLATE_SECONDS (150,000 one-character
    # messages took 25 s), whose error is the 500 of a broken template, which clients retry
    if len(body.messages) > state.context:
        raise APIError(400, f"messages: {len(body.messages)} messages cannot fit the context of {state.context} "
                            "tokens (each one the template renders takes a token at least)", "messages")
    for i, message in enumerate(body.messages):
        message.check(i)
    # the template renders every message's text: more than the context can hold is refused before rendering
    state.check_length(sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content)
                           for m in body.messages if m.content is not None), "messages", "messages")
    return [m.for_template(i) for i, m in enumerate(body.messages)]


async def render_chat(state: ServerState, body: ChatRequest) -> tuple[list[int], list[dict] | None]:
    """A chat request's prompt, its messages and tools rendered by the chat template, and the tools."""
    lm = state.lm
    # each in a worker thread: on the event loop, dumping 30,000 tools (1 s) or checking every text of a few MB of
    # chat_template_kwargs (2.5 s) held every other client (streams, /health) meanwhile
    messages = await asyncio.to_thread(template_messages, state, body)
    tools = await asyncio.to_thread(body.template_tools)
    try:
        variables = {**state.template_defaults,
                     **await asyncio.to_thread(template_variables, body.chat_template_kwargs)}
    except ValueError as exc:
        raise APIError(400, str(exc), "chat_template_kwargs") from None
    if lm.tokenizer.chat_template is None:  # a model that cannot chat: the request's to change, not a failure
        raise APIError(400, "messages: this model has no chat template (no chat_template.jinja, nor chat_template "
                            "in tokenizer_config.json), so it cannot render messages; send the prompt as text to "
                            "/v1/completions", "messages")
    try:
        # as `blockpress chat` and lm.chat render them; in a worker thread, as the encode of a long text takes
        # a while (0.25 s for 240 KB) and the event loop serves every other client meanwhile
        prompt = await asyncio.to_thread(functools.partial(lm.chat_prompt, messages, tools=tools, **variables))
    except MessageError as exc:  # a field of the request's to change: tools a template never reads, say
        raise APIError(400, str(exc), exc.field) from None
    except ValueError as exc:  # a broken chat template is the server's fault (500), bad messages the client's
        broken = str(exc).startswith("chat_template:")
        raise APIError(500 if broken else 400, str(exc) if broken else f"messages: {exc}", "messages",
                       "server_error" if broken else "invalid_request_error") from None
    return prompt, tools


@dataclass
class ReplyReaders:
    """What reads a chat reply with the checkpoint's response template (Reply's parse, read_partial, read_regions):
    all None where the reply is read as plain text."""
    parse: Callable[[str], dict] | None = None
    read_partial: Callable[[], PartialReader] | None = None
    read_regions: Callable[[], PartialReader] | None = None


def reply_readers(lm: LM, prompt: list[int], tools: list[dict] | None, calls: bool) -> ReplyReaders:
    """The readers of a chat reply: for its calls where the request offers tools (`calls`); for its thought alone
    where it does not (or asks for no call), as transformers' server and vLLM's reasoning parsers read every reply: else
    a thought would be the content's start, glued to the answer."""
    spec = lm.tokenizer.reply_template  # the checkpoint's response template, or the built-in one its tokens tell
    if spec is None or not (calls or reads_thoughts(spec)):
        return ReplyReaders()
    # the prompt as the template reads it: its anchor marks where the reply's turn began
    template = compile_template(spec)
    # One PatternBudget for every read of the request's replies (each stream reads its reply again at each
    # chunk), so that the template's patterns hold the event loop a bounded time for it; past that each
    # reply is refused (PatternTooCostly), so answered as text, as a reply the template cannot read.
    read = {"prefix": lm.tokenizer.decode(prompt, skip_special_tokens=False), "tools": tools,
            "budget": PatternBudget()}
    return ReplyReaders(functools.partial(parse_response, template, keep_empty=True, **read),
                        functools.partial(PartialReader, template, **read),
                        functools.partial(PartialReader, regions_only(template), **read))


async def chat_reply(state: ServerState, body: ChatRequest, request: Request) -> Any:
    """/v1/chat/completions: the messages rendered, the reply read with the response template where it applies."""
    lm = state.lm
    if body.token_healing:  # as `generate --chat --token-healing` and lm.chat refuse it
        raise APIError(400, "token_healing: not with chat completions, whose prompt ends with the chat template's "
                            "turn header (the template's own, never healed); send a plain prompt to /v1/completions "
                            "to heal it", "token_healing")
    prompt, tools = await render_chat(state, body)
    jobs = build_jobs(state, body, prompt)
    calls = bool(tools) and body.tool_choice != "none"
    readers = reply_readers(lm, prompt, tools, calls)
    if readers.parse is not None:
        for job in jobs:
            job.keep_special = True
    reply = Reply(jobs, "chat", body.model, len(prompt), parse=readers.parse, read_partial=readers.read_partial,
                  one_call=body.parallel_tool_calls is False, calls_wanted=calls,
                  plain=lambda raw: lm.tokenizer.decode(lm.tokenizer.encode(raw)), read_regions=readers.read_regions,
                  request_id=request_id(request))
    return await respond(state.engine, reply, body, request)


def completion_batch(state: ServerState, body: CompletionRequest,
                     loop: asyncio.AbstractEventLoop) -> tuple[list[Job], int]:
    """A completions request's jobs, each prompt's in its group, and the prompt tokens they take."""
    jobs, prompt_tokens = [], 0
    count = len(request_prompts(body)[0])
    for i, (prompt, from_text) in enumerate(completion_prompts(state, body)):
        group = completion_jobs(state, body, prompt, from_text, loop)
        if i == 0:  # before the others are tokenized: refusing a huge list only after would cost seconds and memory
            state.engine.check_room(count, len(group))
        for job in group:
            job.group = i
            jobs.append(job)
        # a canvas's fixed tokens are the client's too (a text prompt's healed space moved into them: once)
        prompt_tokens += len(group[0].prompt) + group[0].fixed_tokens
    return jobs, prompt_tokens


async def completion_reply(state: ServerState, body: CompletionRequest, request: Request) -> Any:
    """/v1/completions: each prompt's jobs, answered."""
    # The prompts, a suffix and a template are tokenized in a worker thread (the tokenizer lets go of the GIL):
    # on the event loop a long prompt would hold /health and every stream in flight for the whole encode
    jobs, prompt_tokens = await asyncio.to_thread(completion_batch, state, body, asyncio.get_running_loop())
    return await respond(state.engine, Reply(jobs, "completion", body.model, prompt_tokens,
                                                   request_id=request_id(request)), body, request)


def same_model(asked: str, served: str) -> bool:
    """Whether a request's model id names the served model (`served`, composed: NFC), whichever Unicode form the
    client spelled it in."""
    return unicodedata.normalize("NFC", asked) == served


def create_app(lm: LM, model_name: str = "blockpress", *, max_queue: int = 64, max_batch: int = 8,
               max_context: int | None = None, prefix_cache_bytes: int = 1 << 30,
               allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] = (), api_key: str | None = None,
               max_body_bytes: int | None = None, max_stops: int = 16,
               chat_template_kwargs: dict[str, Any] | None = None) -> FastAPI:
    """`prefix_cache_bytes`: keys and values of recent prompts kept for reuse (0: none; see prefix.py).
    `max_context`: the most tokens a prompt and its answer may take, at most the model's max_position_embeddings
    (None: that). `allowed_origins`: the browser origins ("http://localhost:3000", or "*" for any) whose pages may
    call the API (CORS); none by default, so a web page the user happens to visit cannot drive the model (a POST
    from a page on another origin that needs no preflight gets a 403: RequireOrigin). `allowed_hosts`: Host names
    (whole, without the port) that a request reaching the server at a loopback address may carry besides localhost,
    127.0.0.1, [::1], the machine's own name and IP addresses ("*": any), such as the public name a reverse proxy
    passes on; others get a 403, which stops DNS rebinding (RequireHost).
    `api_key`: requests to /v1/* must send `Authorization: Bearer <api_key>`, else get a 401 (RequireKey);
    None: anyone who reaches the port may. `max_body_bytes`: a larger request body gets a 413 before it is parsed
    (BodyLimit; None: body_limit of the context, 4 MiB on blockpress-code). `max_stops`: the most stop strings a
    request may send (more: a 400 naming `stop`); each one is searched for in every row's text at every canvas on the
    engine thread that serves every client, so a million of them would hold it for seconds a canvas.
    `chat_template_kwargs`: chat-template variables for every chat request ({"enable_thinking": True}); a request's
    own chat_template_kwargs win, name by name.
    The app's lifespan starts and closes the engine thread. Mounted in another app (host.mount("/llm", app)), whose
    lifespan Starlette runs instead, it starts at the first request and closes when the app is collected, or at
    exit; enter `app.router.lifespan_context(app)` in the host's lifespan to close it with the host."""
    limits = check_serving(lm, max_queue=max_queue, max_batch=max_batch, max_context=max_context,
                           prefix_cache_bytes=prefix_cache_bytes, max_body_bytes=max_body_bytes, max_stops=max_stops)
    # (a folder name of bytes that are no UTF-8, read as lone surrogates, made every answer naming the model a 500;
    # composed, as clients type it: a macOS folder name is decomposed, "e" then its accent)
    model_name = unicodedata.normalize("NFC", check_text(model_name, "model_name"))
    origins, hosts, api_key = check_origins(allowed_origins), check_hosts(allowed_hosts), check_api_key(api_key)
    template_defaults = template_variables(chat_template_kwargs)
    engine = Engine(lm, max_queue=limits.max_queue, max_batch=limits.max_batch,
                    prefix_cache=PrefixCache(limits.prefix_cache_bytes) if limits.prefix_cache_bytes > 0 else None)
    token_chars = lm.tokenizer.longest_token()
    # Token healing's texts (each id decoded alone, and those a longer one starts with), worked out once here rather
    # than by the first request that heals: every `suffix` or `template` canvas does (and `token_healing`), and at
    # 262,144 tokens they take seconds, which that client (and every one behind it on the engine thread) waited.
    lm.tokenizer.token_texts()
    lm.tokenizer.extendable_texts()
    state = ServerState(lm, engine, model_name, limits.context, token_chars=token_chars, max_stops=limits.max_stops,
                        template_defaults=template_defaults)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        engine.start()
        yield
        # the engine thread holds the model: end it with the app. At the interpreter's exit (start_in_background's
        # script ending with a request in flight) the exit hook may be closing it already, and the executor that
        # to_thread needs is gone: it is closed here, in this thread
        try:
            await asyncio.to_thread(engine.close)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            engine.close()

    app = FastAPI(title="blockpress", description="OpenAI-compatible block-diffusion server", lifespan=lifespan)
    app.state.engine, app.state.server = engine, state
    # Starlette runs no mounted app's lifespan (host.mount("/llm", create_app(lm))): the first request started the
    # engine thread (Engine.submit) and nothing ended it, so the thread and the model outlived the host app (a
    # notebook cell run again kept one more model a run). The engine now closes when the app goes. The finalizer
    # holds neither the app nor the engine: a running engine is held by its thread, and one never started or ended
    # goes with the app (held here, it and the model would outlive the app's collection); the exit is
    # _close_live_engines's.
    weakref.finalize(app, _close_when_gone, weakref.ref(engine)).atexit = False
    # The app alone holds the model: FastAPI keeps every endpoint function in a cache of the process
    # (fastapi.dependencies.models, 4096 of them), so an endpoint that closed over the model, its engine or its
    # prefix cache would keep them after the app has shut down and gone. The endpoints reach them through this.
    serving = weakref.ref(state)

    def served() -> ServerState:
        """The state the app holds (app.state.server): gone only with the app itself."""
        state = serving()
        if state is None:
            raise APIError(503, "the server has shut down", None, "server_error")
        return state

    add_middleware_stack(app, limits.max_body_bytes or body_limit(state.context, token_chars), api_key, origins,
                         hosts, engine)
    # errors in OpenAI's shape: the API's own, an unknown route or method, a body that does not parse
    app.exception_handler(APIError)(api_error)
    app.exception_handler(StarletteHTTPException)(http_error)
    app.exception_handler(RequestValidationError)(request_validation_error)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await chat_reply(served(), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion_reply(served(), body, request)

    # max_model_len (vLLM's field): the most tokens a prompt and its answer may take, the limit requests are refused
    # past (build_jobs: the prompt and whole canvases), max_context where given, not the model's positions then
    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "blockpress",
                  "max_model_len": state.context}

    # HEAD too (uptime probes and load balancers send it to the models route): the GET's status and headers, no
    # body; a route of its own out of the schema, as /health's below
    @app.head("/v1/models", include_in_schema=False)
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.head("/v1/models/{model_id:path}", include_in_schema=False)
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # OpenAI's retrieve; a hub model's id holds a slash
        if not same_model(model_id, model_name):
            raise unknown_model(model_id, model_name)
        return model_card

    # some probes send HEAD: a route of its own, out of the schema, since one route of both methods gives both the
    # same operation id, and every fetch of /openapi.json (a visit to /docs) would log FastAPI's warning of it
    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health():
        engine = served().engine
        if (stopped := engine.stopped()) is not None:  # nothing answers requests: a probe takes the server out
            return JSONResponse({"status": "engine stopped", "reason": stopped}, status_code=503)
        return {"status": "ok", "queue_depth": engine.depth(), "running_rows": engine.running()}

    @app.get("/metrics")
    async def metrics():
        engine = served().engine
        gauges = {"queue_depth": engine.depth(), "running_rows": engine.running()}
        if engine.prefix_cache is not None:
            gauges.update(prefix_cache_entries=len(engine.prefix_cache), prefix_cache_bytes=engine.prefix_cache.nbytes)
        return PlainTextResponse(engine.metrics.render(gauges))

    return app


def check_origins(origins: Sequence[str]) -> list[str]:
    """`create_app`'s allowed_origins, each "*" or an origin as a browser sends it (scheme://host[:port]): one
    with a path or a trailing slash would never match, and every call from that page would fail its CORS check."""
    if isinstance(origins, str):
        raise ValueError(f"allowed_origins: expected a list of origins, got the string {origins!r}")
    for origin in origins:
        if origin != "*" and not (isinstance(origin, str) and re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#\s]+",
                                                                             origin)):
            raise ValueError(f"allowed_origins: {origin!r} is not an origin; expected scheme://host[:port] as a "
                             "browser sends it (no path, no trailing slash), or '*' for any")
    return list(origins)


def check_hosts(hosts: Sequence[str]) -> list[str]:
    """`create_app`'s allowed_hosts, each "*" or a name as a Host header carries it, without the port
    (api.example.com, 10.0.0.5, [::1]): one with a scheme, a path or a port would never match."""
    if isinstance(hosts, str):
        raise ValueError(f"allowed_hosts: expected a list of host names, got the string {hosts!r}")
    # a bracketed IPv6 address, or a name: no scheme, path or port, and (a name is compared whole) no wildcard,
    # *.example.com or Django's .example.com, nor a trailing dot
    name = re.compile(r"\[[0-9a-fA-F:.]+\]|[^\s/:@\[\]*.]([^\s/:@\[\]*]*[^\s/:@\[\]*.])?")
    for host in hosts:
        if host != "*" and not (isinstance(host, str) and name.fullmatch(host)):
            raise ValueError(f"allowed_hosts: {host!r} is not a host name; expected a whole name as a Host header "
                             "carries it, without the port or a wildcard (api.example.com, 10.0.0.5, [::1]), or '*' "
                             "for any")
    return list(hosts)


def start_in_background(app: FastAPI, host: str = "127.0.0.1", timeout: float = 30.0,
                        header_timeout: float = HEADER_TIMEOUT) -> tuple[str, Any]:
    """Run `app` with uvicorn on a free loopback port in a daemon thread (tests, benchmarks), with `serve`'s
    deadline on request headers, once it answers HTTP (any status at /health: a host app that mounts blockpress under
    a path may have none).

    Returns (base URL, uvicorn server); set `server.should_exit = True` to stop it. A script that ends with a request
    still in flight need not wait for it: at exit the engine cuts it (a 503) and stops. A server whose startup fails
    (its error logged) raises at once; one that does not answer within `timeout` seconds is stopped, and raises.
    """
    import httpx
    import uvicorn

    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error",
                                           http=header_deadline_protocol(header_timeout)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://{host}:{port}"
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        # Started (listening, its lifespan run) and answering, whatever the status: only a 200 at /health was
        # taken, so a host app without one was waited out for the whole timeout, then called "not up" while it served.
        if server.started:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(base + "/health")
                return base, server
        if not thread.is_alive():  # its startup failed (the app's lifespan, the port): nothing will come up
            raise RuntimeError(f"serve: the server on {base} stopped before it came up; its error is logged above")
        time.sleep(0.05)
    server.should_exit = True  # not left running unreturned (if it comes up yet, it stops at once)
    raise RuntimeError(f"serve: the server did not come up on {base} within {timeout} s; it is stopped")
