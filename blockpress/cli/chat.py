"""`blockpress chat`: the REPL, and a reply read with the response template (ReplyReader), which generate --chat
uses too."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Generator
from typing import Any

from blockpress.checks import allocation_failed, check_text, utf8_problem
from blockpress.cli.common import (
    as_flags,
    command_flags,
    decoded,
    default_budget,
    load_announced,
    print_stats,
    printable,
    sampling_kwargs,
    stats_line,
)
from blockpress.cli.output import out_of_memory_message, release_device_memory
from blockpress.files import parse_json, utf16_text_error
from blockpress.stopping import Stopped, fresh_line, stop_status, stop_word

# A line of this alone opens a message of several lines, and the next one sends it (a code model's chat is sent
# code: one line, one message, would split a pasted function into a message per line). Ollama's REPL takes the same.
BLOCK = '"""'

# The chat REPL's commands: one text for /help, for a refused line and for --help.
CHAT_HELP = ("/reset starts a new conversation; /exit, /quit or Ctrl-D quits; /help lists these commands; Ctrl-C stops "
             "a reply; any other line starting with / is refused (start a message with // to send it with one "
             f"leading /); a line of {BLOCK} alone starts a message of several lines, sent at the next such line")


def check_chat_template(lm: Any, args: argparse.Namespace, use: str) -> list[int]:
    """The model can render a conversation (`use` says what needs it), --system's message first; a broken template,
    or one that refuses a system message, fails now, once. Returns the conversation it rendered: --system and a
    one-word message, the shortest one."""
    if lm.tokenizer is None:  # a template in its tokenizer_config.json would still have no tokenizer to run with
        raise ValueError(f"--model {args.model}: has no tokenizer.json, so it cannot take text, which {use} needs")
    if lm.tokenizer.chat_template is None:
        raise ValueError(f"--model {args.model}: has no chat template (chat_template.jinja, or chat_template in "
                         f"tokenizer_config.json), which {use} needs")
    return lm.chat_prompt([*system_turn(args), {"role": "user", "content": "hi"}], **args.chat_template_kwargs)


def system_turn(args: argparse.Namespace) -> list[dict[str, str]]:
    """--system as the message a conversation starts with (generate --chat, chat); [] without it. Checked here,
    so its bytes that are not UTF-8 are named as --system's (else they would be "messages[0].content", a message of
    the conversation, or with generate --input none of the file's)."""
    return [{"role": "system", "content": check_text(args.system, "--system")}] if args.system is not None else []


def reply_needs(min_new_tokens: int, canvas: int) -> str:
    """Why free positions may not do for a chat reply: it takes whole canvases (28 free of a 32-token canvas are
    no room), as many as --min-new-tokens needs."""
    shortest = max(1, min_new_tokens)
    need = -(-shortest // canvas) * canvas
    return (f"a reply needs a whole canvas of {canvas} tokens" if need == canvas else
            f"a reply of at least {shortest} tokens (--min-new-tokens) needs {need}, in whole {canvas}-token canvases")


def check_chat_start(lm: Any, args: argparse.Namespace, ids: list[int]) -> None:
    """What would refuse every message, refused once at start (exit 2, as generate refuses it) instead of message
    after message in a session that can never work: a bad sampling flag (--top-p 0, --steps 0, --seed -1,
    --min-new-tokens above --max-new-tokens) and a --system that leaves no room for a reply. Checked on the shortest
    conversation, `ids` (check_chat_template's), by building the run the chat loop would give it: lm.stream
    checks every argument when called and runs nothing until iterated, and this stream never is."""
    from blockpress.generate import canvas_room

    kw = sampling_kwargs(args, lm)
    context, canvas = lm.config.text.max_position_embeddings, lm.config.canvas_length
    room = canvas_room(context, len(ids), canvas)  # as the chat loop counts it
    if room < max(1, kw["min_new_tokens"]):
        needs = reply_needs(kw["min_new_tokens"], canvas)
        if args.system is not None:
            raise ValueError(f"--system: with the chat template and a one-word message it takes {len(ids)} of the "
                             f"model's {context} tokens, leaving {max(0, context - len(ids))}, and {needs}; "
                             "shorten it")
        raise ValueError(f"--min-new-tokens: a one-word message takes {len(ids)} of the model's {context} tokens, "
                         f"leaving {max(0, context - len(ids))}, and {needs}")
    wanted = kw["max_new_tokens"] if kw["max_new_tokens"] is not None else default_budget(lm, len(ids),
                                                                                           kw["min_new_tokens"])
    lm.stream(ids, **{**kw, "max_new_tokens": min(wanted, room)})  # checked, never run (the loop caps it so too)


def json_line(line: str) -> str:
    """A line read by `chat --json`: a JSON string ("def f():\\n    pass") is the text it holds, so a script can send
    a message of several lines; any other line, one that only starts with a quote too, is the text as it is."""
    try:
        text = parse_json(line)
    except json.JSONDecodeError:
        return line
    return text if isinstance(text, str) else line


def enable_line_editing() -> None:
    """Line editing (the arrow keys, Ctrl-A/E, ...) and history (Up, Down) for input() on a terminal: Python's
    input() reads through readline once the module is imported, and without it the arrow keys would reach the model as
    escape sequences ("\\x1b[D"). A pipe is read plainly: input() uses readline only on a terminal. Some
    Pythons have no readline (Windows'): lines are then read plainly too."""
    try:
        import readline  # noqa: F401  (importing it is what turns it on)
    except ImportError:
        pass


# A thought on a terminal: dim (live.py's ELIDED), and back to plain after each piece, so that a Ctrl-C or an error
# mid-thought leaves the terminal as it was.
DIM, UNDIM = "\x1b[2m", "\x1b[0m"


@dataclasses.dataclass
class ChatReply:
    """A chat reply as `chat` shows and keeps it: the answer, the thought the checkpoint's response template reads
    in it (None: none, or no template that reads thoughts), and the assistant message the conversation goes on
    with."""

    answer: str
    thought: str | None
    message: dict[str, Any]


@dataclasses.dataclass
class ReplyReader:
    """Reads a chat reply with the tokenizer's response template (Tokenizer.reply_template: the checkpoint's, or
    Gemma 4's built in) where that template reads thoughts: the thought apart from the answer, as the server gives
    it (reasoning_content) to a request without tools, streamed and whole alike (response.AnswerStream and
    answer_without_tools, which the server's replies use). The reply's text leaves special tokens out, so read as text a
    Gemma 4 reply's thought channel would be "thought\\n...answer": shown glued to the answer, and kept so in the
    conversation, where the chat template's strip_thinking (which cuts at <|channel> / <channel|>) could not drop it
    from later prompts."""

    lm: Any
    prompt: list[int]  # the conversation's ids: the template's start_anchor in it marks where the reply began
    tokens: list[int] = dataclasses.field(default_factory=list)  # the reply's valid tokens so far (Commit)
    color: bool = True  # the thought dimmed on screen (off: NO_COLOR or TERM=dumb, as generate's live view)
    shown_thought: str = ""  # what `live` printed
    shown_answer: str = ""
    # the compiled template, or None where replies are text (no template, or one that reads no thought)
    template: Any = dataclasses.field(init=False)
    prefix: str = dataclasses.field(init=False)  # the prompt's text, its special tokens kept
    # what `live` has settled of the reply, read on from where its last read stopped (one PartialReader a reply)
    stream: Any = dataclasses.field(init=False)
    budget: Any = dataclasses.field(init=False)  # the time the template's patterns may take: all the reply's reads
    decoded: Any = dataclasses.field(init=False)  # the reply's text with special tokens, decoded on at each commit

    def __post_init__(self) -> None:
        from blockpress.response import AnswerStream, PatternBudget, compile_template, reads_thoughts
        from blockpress.tokenizer import TextStream

        spec = self.lm.tokenizer.reply_template
        thoughts = reads_thoughts(spec)
        self.template = compile_template(spec) if thoughts else None
        self.prefix = self.lm.tokenizer.decode(self.prompt, skip_special_tokens=False) if thoughts else ""
        self.stream, self.budget = AnswerStream(), PatternBudget()
        self.decoded = TextStream(self.lm.tokenizer, skip_special_tokens=False)

    def raw(self, tokens: list[int]) -> str:
        """The reply's text with its special tokens (a TextStream's: what the tokens since the last call add is
        decoded, not the whole reply again)."""
        from blockpress.generate import text_with_special_tokens

        return text_with_special_tokens(self.lm.tokenizer, tokens, self.lm._eos_ids(), "", [], self.decoded)

    def plain(self, raw: str) -> str:
        """The answer's text of a part of the reply read with its special tokens: those left out, as the answer
        is decoded."""
        tok = self.lm.tokenizer
        return tok.decode(tok.encode(raw))

    def reader(self, regions: bool = False) -> Any:
        """A new PartialReader of the reply (`regions`: of where its regions are, response.regions_only)."""
        from blockpress.response import PartialReader, regions_only

        template = regions_only(self.template) if regions else self.template
        return PartialReader(template, self.prefix, budget=self.budget)

    def read(self, out: Any) -> ChatReply:
        """The whole reply (Done's output): its answer and thought where the template reads a thought (an empty one
        too: its markers are out of the answer), else its text, as before (a call, which chat offers no tools for,
        or a reply the template cannot read, is text too, but for a thought written before the call): the message
        the server answers a request without tools with (response.answer_without_tools)."""
        from blockpress.response import answer_without_tools, parse_response

        text = decoded(out.texts, "chat")[0]
        template = self.template
        if template is not None:
            raw = self.raw(out.new_tokens[0, : int(out.num_new_tokens[0])].tolist())
            message = answer_without_tools(
                lambda reply: parse_response(template, reply, self.prefix, budget=self.budget, keep_empty=True),
                lambda: self.reader(regions=True), self.plain, raw)
            if message is not None:
                # the template sees what the model wrote: its answer, and its thought as reasoning_content (Gemma
                # 4's templates leave a past thought out of the prompt; those that replay it read it there)
                return ChatReply(message["content"], message.get("reasoning_content"), message)
        return ChatReply(text, None, {"role": "assistant", "content": text})

    def live(self, event: Any, settled: str) -> str:
        """What a Commit adds to the screen: the thought's growth dimmed, then the answer's on a line of its own, as
        the template settles them (response.AnswerStream, as the server streams them); `settled`, the plain settled
        text, until a thought shows."""
        from blockpress.generate import settled_text

        if self.template is None:
            return self._grow("", settled)
        written = int(event.num_new_tokens[0])
        self.tokens += event.tokens[0, : written - len(self.tokens)].tolist()
        self.stream.advance(self.reader, settled_text(self.raw(self.tokens), []), settled, calls_wanted=False)
        return self._grow(self.stream.reasoning, self.stream.content)  # (unread: the rest is printed once done)

    def _grow(self, thought: str, answer: str) -> str:
        """The text that takes the screen from what it shows to `thought` and `answer` (what it shows of each that
        they do not start with stays: the whole reply prints the rest)."""
        from blockpress.live import terminal_text

        piece = ""
        if len(thought) > len(self.shown_thought) and thought.startswith(self.shown_thought) and not self.shown_answer:
            dim, undim = (DIM, UNDIM) if self.color else ("", "")
            piece += dim + terminal_text(thought[len(self.shown_thought):]) + undim
            self.shown_thought = thought
        if len(answer) > len(self.shown_answer) and answer.startswith(self.shown_answer):
            if not self.shown_answer and self.shown_thought:
                piece += "\n"  # the answer on a line of its own, under the thought
            piece += terminal_text(answer[len(self.shown_answer):])
            self.shown_answer = answer
        return piece

    def rest(self, reply: ChatReply) -> str:
        """What the screen still needs once the reply is done."""
        return self._grow(reply.thought or "", reply.answer)

@dataclasses.dataclass
class Message:
    """A message as read: its text, and whether it is one whatever it holds (a block or a JSON string: never a
    command)."""

    text: str
    verbatim: bool


@dataclasses.dataclass
class ChatSession:
    """A chat's state from message to message: the conversation and its cache, where its lines come from and its
    replies go, and what a reply has put on screen so far."""

    lm: Any
    args: argparse.Namespace
    system: list[dict[str, str]]  # every conversation starts with it, one after /reset too: as the model was tuned
    flags: dict[str, str]  # the names its settings were typed by, which an error names (command_flags)
    interactive: bool  # stdin is a terminal
    on_screen: bool  # and stdout too, without --json: the turns are marked and the reply printed as it commits
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    cache: Any = None
    # "model> " and the reply's start are on screen: an error that ends the turn takes a new line
    opened: bool = False
    pending: list[str] = dataclasses.field(default_factory=list)  # the lines of a paste still to be read (read_line)

    @property
    def marker(self) -> str:
        return "model> " if self.on_screen else ""

    def live_reply(self, events: Generator[Any, None, None], reader: ReplyReader) -> Any:
        """Print "model> " and each Commit's growth of its settled text (no half character, no start of a stop
        string that may yet be cut: Commit.settled_texts; a thought dimmed, the answer under it: ReplyReader.live),
        flushed; returns Done's output. A Ctrl-C leaves the part printed on screen."""
        from blockpress.generate import Commit, Done

        self.opened = False
        try:
            for n, event in enumerate(events):
                if n == 0:  # after the request's checks: an error in them is said on a line of its own
                    print(self.marker, end="", flush=True)
                    self.opened = True
                if isinstance(event, Commit):
                    settled = decoded(event.settled_texts, "chat")[0]
                    settled = settled[: len(settled) - 1] if settled.endswith("\r") else settled  # "\r\n": one newline
                    print(reader.live(event, settled), end="", flush=True)
                elif isinstance(event, Done):
                    return event.output
        finally:  # a Ctrl-C while printing: the stream takes its turn out of the cache now, not when collected
            events.close()
        raise RuntimeError("the reply's stream ended without its end")  # chat passes no `cancelled`

    def read_line(self, first: bool) -> str:
        """A line, without its terminator; on a terminal prompted "you> " (`first`: a message's first line) or, in
        a block of several lines, "...> ". A terminal's paste of several lines comes back whole, newlines and all
        (readline 8.1+ takes it as one line: bracketed paste); one that holds a BLOCK line is read a line at a
        time, as typed lines are, so its blocks open and close: whole, the BLOCK lines would go to the model as
        part of the message, and a paste that should close an open block would leave it open."""
        if self.pending:
            return self.pending.pop(0)
        mark = "you> " if first else "...> "
        # input() edits the line with readline where stdout is a terminal too (--json on one): readline must know the
        # prompt there, or it redraws the line over it. Elsewhere stdout holds the replies (or JSON lines) alone.
        edited = self.interactive and sys.stdout is not None and sys.stdout.isatty()
        if self.interactive and not edited:
            print(mark, end="", file=sys.stderr, flush=True)
        line = input(mark if edited else "")
        # UTF-16 piped in (Windows PowerShell 5's |, `type` of a Notepad "Unicode" file) ends the chat, as `generate -`
        # refuses it: past the mark's line its lines are valid UTF-8, NULs between the letters, and the per-message
        # check (to_send) would drop the first line alone and send the model the rest as garbage. Every piped line is
        # checked: without a byte-order mark, a first line that is empty (or a lone "\r\0") shows nothing
        if not self.interactive and (error := utf16_text_error(line, "standard input")):
            raise error
        if "\n" in line and any(part.rstrip("\r").rstrip() == BLOCK for part in line.split("\n")):
            line, *rest = line.split("\n")
            self.pending.extend(part.removesuffix("\r") for part in rest)
        return line.removesuffix("\r")  # "\r\n" ends one too

    def new_line(self) -> str:
        """"\n" where a reply that failed midway (a GPU out of memory, non-finite logits) is part way along a line
        on screen: its error would otherwise be written on after the last word ("model> def f(error: ...")."""
        return "\n" if self.on_screen and self.opened else ""

    def no_reply(self, user: str, **fields: Any) -> None:
        """With --json, a line that gets no reply (a dropped message, said on stderr, or a command) still gets its
        JSON line: a script that wrote N lines reads N back, in order, and never waits on one that will not come."""
        if self.args.json:
            try:  # bad bytes read from stdin (surrogate escapes) as U+FFFD
                shown = user.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            except UnicodeEncodeError:  # a lone surrogate no byte stands for: a JSON string's "\ud800"
                shown = re.sub("[\ud800-\udfff]", "\ufffd", user)
            print(json.dumps(dict(prompt=shown, **fields)), flush=True)

    def read_message(self) -> Message | None:
        """The next message: a line, a block of lines between BLOCK lines, a paste, or with --json a JSON string;
        None at the end of the input (a block it cut short is said, and not sent)."""
        block: list[str] | None = None  # a message of several lines, as read so far
        verbatim = False  # a block or a JSON string: the text it holds is the message, never a command
        try:
            user = self.read_line(first=True)
            if user.rstrip() == BLOCK:  # its lines are the message, as typed, up to the next such line
                block = []
                while (line := self.read_line(first=False)).rstrip() != BLOCK:
                    block.append(line)
                user, verbatim = "\n".join(block), True
            elif "\n" in user:  # a paste of several lines: one message, as a block is (never a command)
                verbatim = True
            elif self.args.json and user.startswith('"'):
                text = json_line(user)
                user, verbatim = text, text != user  # a JSON string never reads back as itself
        except EOFError:
            print(file=sys.stderr)  # the shell's prompt on a line of its own
            if block is not None:  # cut short: not the message that was meant
                error = f"the message started by a line of {BLOCK} ended without the line of {BLOCK} that sends it"
                print(f"error: {error}; it was not sent", file=sys.stderr)
                self.no_reply("\n".join(block), error=error)
            return None
        return Message(user, verbatim)

    def interrupted_at_prompt(self, exc: KeyboardInterrupt) -> int | None:
        """A Ctrl-C at the prompt, as in a shell: a fresh line (a block typed so far is dropped), and the chat goes
        on (None); a SIGTERM or SIGHUP ends the chat, as Ctrl-D does, and says so: its exit status."""
        # ("you> " is on the line, or, read from a file or pipe, at most the "^C")
        print(end="\n" if self.interactive else fresh_line(exc), file=sys.stderr)
        if isinstance(exc, Stopped):
            print(f"{stop_word(exc)}: the chat ends", file=sys.stderr)
            return stop_status(exc)
        self.pending.clear()
        return None

    def to_send(self, message: Message, command: str) -> str | None:
        """The text to send the model, or None where the line is not one: a command, done (but /exit, which the
        loop ends at), one refused, or a message that is not UTF-8, said and dropped."""
        user = message.text
        if command == "/help":
            print(CHAT_HELP, file=sys.stderr)
            self.no_reply(user, command="help")
            return None
        if command == "/reset":
            self.messages, self.cache = list(self.system), None
            print("(a new conversation)", file=sys.stderr)
            self.no_reply(user, command="reset")
            return None
        if command.startswith("//"):  # the escape: a message that starts with a slash
            user = user.replace("/", "", 1)
        elif command.startswith("/"):  # a mistyped command ("/exit now", "/rest") is not a message to the model
            error = f"unknown command {command!r}; {CHAT_HELP}"
            print(f"error: {error}", file=sys.stderr)
            self.no_reply(user, error=error)
            return None
        problem = utf8_problem(user)  # bytes that were not UTF-8 arrive as surrogates; the position is the line's
        if problem is not None:
            error = f"not valid UTF-8 ({problem} of the message)"
            print(f"error: {error}; that message was dropped, the conversation goes on", file=sys.stderr)
            self.no_reply(user, error=error)
            return None
        return user

    def reply_settings(self, ids: list[int]) -> dict[str, Any]:
        """The sampling settings of the reply to the conversation `ids`: --max-new-tokens capped to the room the
        context has left, said; refused where not even the shortest reply fits."""
        from blockpress.generate import canvas_room

        args, lm, context = self.args, self.lm, self.lm.config.text.max_position_embeddings
        kw = sampling_kwargs(args, lm)
        wanted = kw["max_new_tokens"] if kw["max_new_tokens"] is not None else default_budget(lm, len(ids),
                                                                                               kw["min_new_tokens"])
        canvas = lm.config.canvas_length  # the reply takes whole canvases: the new tokens that fit fill them
        room = canvas_room(context, len(ids), canvas)
        if room < wanted and room < max(1, kw["min_new_tokens"]):  # not even the shortest reply fits: refuse
            # Would a new conversation take it? If not, the message itself is too long, and "/reset" would
            # only throw the conversation away for the same refusal.
            alone = ids if len(self.messages) == len(self.system) + 1 else lm.chat_prompt(
                [*self.system, self.messages[-1]], **args.chat_template_kwargs)
            if canvas_room(context, len(alone), canvas) < max(1, kw["min_new_tokens"]):
                raise ValueError(f"the message is too long: {len(alone)} tokens with the chat template"
                                 f"{' and --system' if self.system else ''}, and the "
                                 f"model's context holds {context} (the reply included); shorten it")
            raise ValueError(f"no room for a reply: the conversation with this message holds {len(ids)} of the "
                             f"model's {context} tokens, leaving {max(0, context - len(ids))}, and "
                             f"{reply_needs(kw['min_new_tokens'], canvas)}; /reset starts a new one")
        if room < wanted:  # a shorter reply than asked, rather than none
            kw["max_new_tokens"] = room
            print(f"(the context has room for {room} more tokens: this reply gets at most {room}, not {wanted}; "
                  "/reset starts a new conversation)", file=sys.stderr)
        return kw

    def check_characters(self) -> None:
        """Refuse a turn whose text alone the context cannot hold, before the template renders it (lm.chat_prompt's
        bound, which names the API's `messages`), in the chat's words: the message is too long (shorten it) or the
        conversation is (/reset), as reply_settings says them for the tokens."""
        context, most = self.lm.config.text.max_position_embeddings, self.lm.tokenizer.longest_token()
        bound = (f"the model's context of {context} tokens holds at most {context * most:,} characters (no token of "
                 f"this vocabulary holds more than {most})")
        alone = sum(len(m["content"]) for m in self.system) + len(self.messages[-1]["content"])
        if alone > context * most:
            raise ValueError(f"the message is too long: {alone:,} characters"
                             f"{' with --system' if self.system else ''}, and {bound}; shorten it")
        if (chars := sum(len(m["content"]) for m in self.messages)) > context * most:
            raise ValueError(f"no room for a reply: the conversation with this message holds {chars:,} characters, "
                             f"and {bound}; /reset starts a new one")

    def turn(self, user: str) -> int | None:
        """`user` sent and its reply shown; a turn that fails (too long, stopped, out of memory) is dropped and the
        conversation goes on. None, or where a SIGTERM or SIGHUP ends the chat, its exit status."""
        lm, args = self.lm, self.args
        self.messages.append({"role": "user", "content": user})
        self.opened = False  # nothing of this turn's reply is on screen yet
        try:
            self.check_characters()
            ids = lm.chat_prompt(self.messages, **args.chat_template_kwargs)
            kw = self.reply_settings(ids)
            t0 = time.perf_counter()
            from blockpress.live import live_terminal

            # dimmed only where escapes show as such: not under NO_COLOR, TERM=dumb, or a Windows console without VT
            reader = ReplyReader(lm, ids, color=not os.environ.get("NO_COLOR") and live_terminal(sys.stdout))
            # only what the conversation does not share with the cache is encoded (lm.chat_ids)
            if self.on_screen:
                out = self.live_reply(lm.chat_stream(ids, cache=self.cache, return_cache=True, drafts=False, **kw),
                                      reader)
            else:
                out = lm.chat_ids(ids, cache=self.cache, return_cache=True, **kw)
        except KeyboardInterrupt as exc:  # the reply is abandoned, the conversation is not
            self.messages.pop()  # lm.chat_stream / chat_ids took the stopped turn out of the cache
            self.pending.clear()  # and the rest of a paste with it, as a terminal drops what was typed ahead
            if isinstance(exc, Stopped):  # a SIGTERM or SIGHUP: the reply so far stays, its line ended, and the chat ends
                print(f"{self.new_line() or fresh_line(exc)}({stop_word(exc)}; that message was dropped and the chat "
                      "ends)", file=sys.stderr)
                self.no_reply(user, error=stop_word(exc))
                return stop_status(exc)
            # on a line of its own: off the reply's last word, or the terminal's "^C" (a blank line in a log)
            print(f"{self.new_line() or fresh_line(exc)}(stopped; that message was dropped, the conversation goes on)",
                  file=sys.stderr)
            self.no_reply(user, error="stopped")
            return None
        except ValueError as exc:  # one bad turn (too long, a bad template) must not end the conversation
            self.messages.pop()
            error = as_flags(str(exc), self.flags)
            print(f"{self.new_line()}error: {error}; that message was dropped, the conversation goes on",
                  file=sys.stderr)
            self.no_reply(user, error=error)
            return None
        except (RuntimeError, MemoryError) as exc:  # out of memory on a long conversation (a GPU's, the CPU
            # allocator's, Python's): the turns before it stay usable
            if not allocation_failed(exc):
                raise
            self.messages.pop()  # the cache holds the turns before this one (lm.chat_ids / chat_stream roll it back)
            release_device_memory()
            error = out_of_memory_message(exc, "chat", "/reset frees the conversation's cache, and ")
            print(f"{self.new_line()}error: {error}; that message was dropped, the conversation goes on",
                  file=sys.stderr)
            self.no_reply(user, error=error)
            return None
        self.cache = out.cache
        read = reader.read(out)
        self.show(user, ids, out, reader, read, time.perf_counter() - t0)
        self.messages.append(read.message)
        return None

    def show(self, user: str, ids: list[int], out: Any, reader: ReplyReader, read: ChatReply, seconds: float) -> None:
        """The reply, as stdout takes it: a JSON line (--json), the rest of what is on screen, or the reply alone;
        then its stats."""
        reply = read.answer
        stats = stats_line(out, seconds)
        if self.args.json:  # the conversation's tokens, and those the cache held (the rest were encoded this turn)
            # and the seed the reply was drawn with (a fresh one each turn without --seed): seeds= repeats it
            stats.update(prompt_tokens=len(ids), cached_tokens=out.extra["reused_prompt_tokens"][0],
                         seed=out.extra["seeds"][0])
            thought = {"reasoning": read.thought} if read.thought else {}  # (text: the answer alone; an empty one: none)
            print(json.dumps(dict(text=reply, **thought, prompt=user, **stats)), flush=True)
        elif self.on_screen:  # the reply is on screen already, up to its last settled text
            print(reader.rest(read), flush=True)
            print_stats(stats)
        else:
            # flushed: a script waits for each reply, and `| tee log` shows it before its stats line on stderr
            print(printable(reply), flush=True)  # unmarked: stdout is not the screen, or stdin is no terminal
            print_stats(stats)


def cmd_chat(args: argparse.Namespace) -> int:
    lm = load_announced(args)
    check_chat_start(lm, args, check_chat_template(lm, args, "chat"))
    chat = open_chat(lm, args)
    while True:
        try:
            message = chat.read_message()
        except KeyboardInterrupt as exc:
            status = chat.interrupted_at_prompt(exc)
            if status is not None:
                return status
            continue
        if message is None:
            break
        # a blank line is skipped, not an end: piped conversations have them between messages
        if not message.text.strip():
            if message.verbatim:  # an empty block or JSON string was sent as a message: a script waits for its line
                error = "the message is empty"
                print(f"error: {error}; it was not sent", file=sys.stderr)
                chat.no_reply(message.text, error=error)
            continue
        # A block or a JSON string is a message whatever it starts with: a script that JSON-encodes each message
        # sends "/usr/bin is slow" as it is (only a plain line is a command, and only there // escapes a /).
        command = "" if message.verbatim else message.text.strip()
        if command in ("/exit", "/quit"):  # answered too: a script reads one line per line it wrote
            chat.no_reply(message.text, command=command[1:])
            break
        user = chat.to_send(message, command)
        if user is None:
            continue
        status = chat.turn(user)
        if status is not None:
            return status
    return 0


def open_chat(lm: Any, args: argparse.Namespace) -> ChatSession:
    """The chat's session, its banner said and its input set up: line editing on a terminal, and bytes that are not
    UTF-8 read as surrogates."""
    flags = command_flags(args)
    system = system_turn(args)  # every conversation starts with it, one after /reset too: as the model was tuned
    print(f"blockpress chat — /help lists the commands, /exit or Ctrl-D quits; {BLOCK} on a line of its own "
          "starts and ends a message of several lines", file=sys.stderr)
    # On a terminal the turns are marked "you> " and "model> "; piped, stdout holds the replies alone, one after
    # another (a script reads what the model said, not our decoration). With --json stdout holds one JSON line per
    # message and nothing else, and so does a stdout sent elsewhere from a terminal (`> chat.txt`, `| tee log`):
    # "you> " goes to stderr, the screen (input() would write it to stdout: the file would get "you> model> " and
    # the user type at no prompt), replies get no mark.
    interactive = sys.stdin.isatty()
    on_screen = interactive and not args.json and sys.stdout is not None and sys.stdout.isatty()
    if interactive:
        enable_line_editing()
    # Under a UTF-8 locale stdin decodes strictly, and one bad byte would raise out of input() and end the chat;
    # as surrogates it reaches the per-message check, which names the byte and goes on.
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    # On a terminal the reply is printed as each canvas commits (else a long reply is a long blank screen, and a
    # Ctrl-C shows nothing of it); piped or --json, it is written whole once done.
    return ChatSession(lm=lm, args=args, system=system, flags=flags, interactive=interactive, on_screen=on_screen,
                       messages=list(system))
