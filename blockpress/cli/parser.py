"""The argparse tree: every command's flags and help (the flag groups several commands share are common.py's).
Building it imports no torch (--help, a mistyped flag): the commands import it when they run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any, TypeVar, overload

import blockpress
from blockpress.cli.bench import cmd_bench
from blockpress.cli.chat import CHAT_HELP, cmd_chat
from blockpress.cli.common import (
    CONFIDENCE_HELP,
    DEFAULT_MODEL,
    DEVICE_HELP,
    TypedFlag,
    add_load_args,
    add_model_args,
    add_sampling_args,
    add_template_kwargs_arg,
    add_threads_arg,
    add_token_healing_arg,
)
from blockpress.cli.generate import FILE_BATCH_SIZE, cmd_generate
from blockpress.cli.infill import cmd_infill
from blockpress.cli.info import cmd_info, cmd_quantize
from blockpress.cli.serve import cmd_serve
from blockpress.cli.sudoku import cmd_sudoku
from blockpress.cli.train import cmd_train
from blockpress.config import RANKINGS, SAMPLERS, SCHEMES

_Namespace = TypeVar("_Namespace")


class Parser(argparse.ArgumentParser):
    """A parser whose --help and --version text fails as any command's output fails: argparse drops an OSError
    writing it, so `blockpress --help | head -c 10` exited 0 where every command exits 141 (docs/cli.md)."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if file is None or file is not sys.stdout:  # an error's usage to stderr: argparse's way (its 2 must get out)
            return super()._print_message(message, file)
        if message:
            file.write(message)  # a BrokenPipeError or OutputError reaches main(): 141, or 1 with its line


class CommandParser(Parser):
    """A command's parser: an argument it does not know is its own error, under its usage line (argparse leaves
    them to the top-level parser, whose usage names no command's flags)."""

    # argparse's own overloads (typeshed's): the namespace returned is the one given, else a new Namespace
    @overload
    def parse_known_args(self, args: Iterable[str] | None = None,
                         namespace: None = None) -> tuple[argparse.Namespace, list[str]]: ...
    @overload
    def parse_known_args(self, args: Iterable[str] | None, namespace: _Namespace) -> tuple[_Namespace, list[str]]: ...
    @overload
    def parse_known_args(self, *, namespace: _Namespace) -> tuple[_Namespace, list[str]]: ...

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            # a puzzle, a grid row or a box row ('-98') whose first cell is empty ('-'), or a grid's border word
            # ('------+-------+------', as format_board prints a board), reads to argparse as a flag it does not know
            # (a flag has letters; -1, a negative number, is a flag's value)
            cells = set("0123456789.-_*|+")
            dashed = self.prog.endswith(" sudoku") and any(e.startswith("-") and len(e) >= 3 and set(e) <= cells
                                                            for e in extras)
            self.error(f"unrecognized arguments: {' '.join(extras)}"
                       + ("; a puzzle or border word that starts with '-' goes after -- (blockpress sudoku [FLAGS] -- "
                          "PUZZLE...)"
                          if dashed else ""))
        return namespace, extras


class DefaultsFormatter(argparse.HelpFormatter):
    """Ends an option's help with its default, unless the help already names one (or there is none to name)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower() or text == argparse.SUPPRESS
                or action.default is None or action.default is False or action.default == ""
                or action.default == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def add_input_args(p: argparse.ArgumentParser, title: str, line: str) -> None:
    """--input FILE and its companions (generate's and infill's batch-file mode); `line`: what a line holds."""
    g = p.add_argument_group(title)
    g.add_argument("--input", default=None, metavar="FILE",
                   help=f"a JSONL file (- for standard input), a line each: {line}; other keys (\"id\") "
                        "are copied to the output line; read and checked whole before anything runs")
    g.add_argument("--output", default=None, metavar="FILE",
                   help="write the results here (default, or -: standard output): a JSON object a line, in input order, "
                        "--json's fields (but tok_s, seconds and interrupted) with `line` (the input line), the copied keys and "
                        "`settings` (the flags that change a row, which --resume checks), "
                        "each written as soon as the lines before it are")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    g.add_argument("--resume", action="store_true",
                   help="continue an existing --output file: the input lines it holds are skipped (each checked against "
                        "its input line: prompt, messages or template, the seed and new-token limit it gives, and the copied keys, and its settings against this run's flags), "
                        "the rest appended")
    g.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help=f"rows a call (default {FILE_BATCH_SIZE}; rows of similar length together; each row's result "
                        "is what it gives alone, up to rounding: in bfloat16 a sampled row can differ, --dtype float32 "
                        "keeps that to near-ties)")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """A flag per TrainConfig field, its help the field's own description (metadata "help")."""
    import typing
    from dataclasses import fields

    from blockpress.train_config import TrainConfig

    types = typing.get_type_hints(TrainConfig)
    g = p.add_argument_group("training settings (flags override --train-config)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = next((t for t in typing.get_args(types[f.name]) if t is not type(None)), types[f.name])  # X | None: X
        text = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if kind is bool:
            g.add_argument(flag, default=None, action=argparse.BooleanOptionalAction, help=text)
        else:
            g.add_argument(flag, type=kind, default=None, choices=f.metadata["choices"], help=text)


def add_generate_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress generate`'s flags."""
    p = sub.add_parser("generate", formatter_class=DefaultsFormatter, help="complete a prompt, showing the canvas as it settles",
                       description="Complete PROMPT, or with --chat answer it as a chat message. On a terminal "
                                   "the canvas is drawn live as tokens settle (dim = still changing, bright = "
                                   "settled); a stats line ends the run.")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the text to continue (with --chat: the user's message), or - to read it from standard "
                        "input (or --input FILE instead, for many)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as one user message through the model's chat template and print the reply "
                        "alone (how an instruction-tuned model such as google/diffusiongemma-26B-A4B-it expects its "
                        "prompts; without it the text is continued as it is, after BOS)")
    p.add_argument("--ar", action="store_true",
                   help="decode autoregressively, one token per pass (lm.generate_ar: the same weights' encoder and "
                        "LM head, the baseline `blockpress bench` times): greedy unless --temperature > 0; no live "
                        "canvas, and the diffusion-only flags (--steps, --sampler, --entropy-bound, --confidence, "
                        "--rank-by, --t-max, --t-min) are refused")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: a system message before PROMPT (as the template renders one)")
    add_template_kwargs_arg(p, " (with --chat)")
    p.add_argument("--no-live", action="store_true",
                   help="print only the final text (no live canvas); after a Ctrl-C, the text committed until then. "
                        "With --input: no progress bar (the stats line stays)")
    add_token_healing_arg(p, "the prompt's last token", "e.g. a trailing newline before indentation; never with "
                                                          "--chat, whose prompt ends with the template's turn header. "
                          "A model whose generation settings say token_healing false (blockpress train writes that "
                          "for a model fine-tuned on prompts that end in such whitespace) keeps it unless "
                          "--token-healing")
    p.add_argument("--token-healing", dest="no_token_healing", action="store_false", default=None,
                   help="heal the prompt's last token even where the model's generation settings say "
                        "token_healing false")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the completion where TEXT appears, leaving TEXT out (repeatable; e.g. "
                        "--stop $'\\n\\n' for one paragraph or function; a special token's text, e.g. "
                        "'<end_of_turn>', ends it at that token)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, reasoning (with --chat only: the thought apart from the answer, "
                        "where the model wrote one its response template reads), prompt, new_tokens, forward_passes, "
                        "tokens_per_forward, tok_s, seconds, seed (the one the text was drawn with, fresh each run without --seed: --seed "
                        "with it repeats the text), interrupted (true after a Ctrl-C: text is what was committed "
                        "until then, the figures too, seed null unless --seed was given; with --ar, which prints its "
                        "text once done, only text null, prompt and seed; exit status 130). Not with --input, whose "
                        "output lines are JSON already")
    add_input_args(p, "many prompts from a file (instead of PROMPT)",
                   '{"prompt": "text"} or {"messages": [...]} (a conversation, through the chat template as --chat '
                   'renders one; --system comes first), with its own new-token limit and seed where it gives them')
    p.set_defaults(func=cmd_generate)


def add_infill_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress infill`'s flags."""
    p = sub.add_parser("infill", formatter_class=DefaultsFormatter, help="fill the <|hole|> markers of a text, keeping every other token",
                       description="Fill the holes of TEMPLATE (<|hole|> is a hole of --hole-length tokens, "
                                   "<|hole:N|> one of N tokens). Fixed text is never changed. A backslash keeps "
                                   "a marker as text: \\<|hole|> is the text <|hole|>, \\\\<|hole|> a backslash "
                                   "and then a hole. Text that only looks like a marker (<|HOLE|>, <| hole |>, "
                                   "\"<|hole\") is refused as a typo unless a backslash keeps it so too "
                                   "(\\<|HOLE|> is the text <|HOLE|>; in Python, blockpress.escape_template "
                                   "escapes a whole text).")
    p.add_argument("template", nargs="?", default=None,
                   help="text with hole markers, or - to read it from standard input (or --input FILE instead, for "
                        "many)")
    p.add_argument("--prefix", default="", help="context before the template (encoded, not shown)")
    p.add_argument("--hole-length", type=int, default=8, help="tokens per plain <|hole|> marker (default 8)")
    add_model_args(p)
    add_sampling_args(p, lengths=False)
    add_token_healing_arg(p, "a space right before a hole (or ending --prefix before a leading one)",
                          "healed, the space opens into the hole, taking one of its N positions; kept, each hole is "
                          "N tokens after it")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text (the filled template), fills (each hole's text, one per "
                        "marker, in order), template (as given), new_tokens (the tokens the model wrote: the holes', "
                        "as generate counts them; also named filled_tokens), template_tokens (the template's "
                        "length, fixed tokens and holes), forward_passes, tokens_per_forward and tok_s (both of "
                        "the tokens written), seconds, seed (the one the holes were drawn with, fresh each run "
                        "without --seed: --seed with it repeats the fills), interrupted (false; after a Ctrl-C, exit 130, the object "
                        "holds only text and fills null, template and interrupted true: an infill is printed "
                        "whole). Not with --input, whose output lines are JSON already")
    add_input_args(p, "many templates from a file (instead of TEMPLATE)",
                   '{"template": "text with <|hole|> markers"}, with its own "prefix" (--prefix\'s context) and '
                   'seed where it gives them')
    p.set_defaults(func=cmd_infill)


def add_chat_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress chat`'s flags."""
    p = sub.add_parser("chat", formatter_class=DefaultsFormatter, help="multi-turn chat with the model's chat template (cache reused)",
                       description="A multi-turn REPL. The KV cache of the conversation is kept between turns, "
                                   "so each turn encodes the new message and whatever of the last reply "
                                   "re-tokenizes differently through the chat template (a reply's text can encode "
                                   "to other tokens than the model wrote: two \"\\n\" tokens as one "
                                   "\"\\n\\n\"), the cache going back to the prefix both share (--json says how many "
                                   "tokens were reused). A reply is never empty: "
                                   "--min-new-tokens defaults to 1 here (0 allows an immediate end of turn). "
                                   f"The default model, {DEFAULT_MODEL}, is a small code model: its replies are "
                                   "code; give --model for a chat model. Lines: " + CHAT_HELP + ". On a terminal "
                                   "the turns are marked you> and model>, and a reply is printed as each canvas commits (Ctrl-C "
                                   "leaves that part on screen and drops the turn); with messages piped in, or stdout sent to a file "
                                   "or pipe (you> then shows on stderr), stdout holds the replies alone, each ending in a newline (stats and notes go to stderr); a reply "
                                   "may hold newlines too, so a script that reads replies gives --json. Near a "
                                   "full context a reply gets the tokens that still fit (said on stderr).")
    add_model_args(p)
    add_sampling_args(p, stop=False)
    p.add_argument("--json", action="store_true",
                   help="stdout holds one JSON object per line for each line read (blank lines aside; /exit "
                        "and /quit end the chat, lines after them unread), or block of lines between \"\"\" lines, "
                        "in order: a message's reply {text, reasoning (the thought apart from the answer, where "
                        "the model wrote one the response template reads: Gemma 4's), prompt, new_tokens, "
                        "forward_passes, tokens_per_forward, tok_s, seconds, prompt_tokens (the conversation with "
                        "the chat template), cached_tokens (those the cache held: the rest were encoded this turn), seed (the one "
                        "drawn when --seed is not given: lm.chat(..., seeds=[seed]) repeats the reply given this command's "
                        "--min-new-tokens as its minimum, 1 by default here and 0 in lm.chat; generate --chat --seed "
                        "N needs --min-new-tokens 1 too)}, "
                        "{prompt, error} when the message was "
                        "dropped (too long, empty, stopped with Ctrl-C, an unknown /command), or {prompt, command} for "
                        "/reset, /help, /exit and /quit. A line that is a JSON string (\"x = 1\\ny = 2\") "
                        "is read as the text it holds, a message even when it starts with /, so a script can send newlines "
                        "(any other line as it is). E.g. "
                        "printf 'hi\\nmore\\n' | blockpress chat --json --model M | jq -r .text")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message that starts the conversation (and the new one after /reset), as the "
                        "chat template renders one: as generate --chat --system")
    add_template_kwargs_arg(p, " of every turn")
    p.set_defaults(func=cmd_chat, min_new_tokens=1)


def add_train_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress train`'s flags."""
    p = sub.add_parser("train", formatter_class=DefaultsFormatter, help="train or fine-tune a model (block diffusion + auxiliary AR loss)",
        description="Train a fresh model (--config PRESET|config.json) or fine-tune one (--model). --out receives "
                    "an HF-format checkpoint, metrics.jsonl and loss.png. Data lines: {\"prompt\": str, \"response\": str}, "
                    "{\"messages\": [...]} (an example per assistant turn: --chat-turns), or {\"prompt_ids\": [...], \"response_ids\": [...]}; or raw text, "
                    "cut into windows of a random-length prompt and --response-canvases canvases: {\"text\": str} "
                    "lines, a .txt/.py/.md file or a folder of them, or a glob of token shards. Run under `torchrun --nproc-per-node N` for several "
                    "processes (DDP).",
    )
    p.add_argument("--model", default=None, help="checkpoint folder, shipped name or cached repo id to fine-tune")
    p.add_argument("--config", default=None, help="fresh model: a config.json or a preset (tiny, small, medium)")
    p.add_argument("--tokenizer", default=None, help="fresh model: a folder with tokenizer.json for text data")
    p.add_argument("--data", default=None, help="(required, except with --resume: the run's own) FILE.jsonl (examples, or {\"text\": ...} lines; several: a glob "
                   "of .jsonl files alone, or a folder of them, its .md files left out as dataset cards), a .txt/.py/.md file, a folder of them, or a glob of token shards "
                   "(blockpress.data.write_shard writes them; scripts/build_code_corpus.py in a clone of the blockpress "
                   "repository builds a corpus of them)")
    p.add_argument("--out", required=True, help="output folder (checkpoint, metrics.jsonl, trainer_state.pt); the run holds it "
                   "until it ends: a second run on it is refused")
    p.add_argument("--train-config", default=None, help="JSON file with training settings (fields below)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP + " (default: auto)")
    add_threads_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("--resume", action="store_true", help="continue the run in --out (weights, optimizer state, "
                   "step) with its saved settings; flags given now override them (--steps: the new end of the "
                   "cosine schedule). It trains on the run's own --data, recorded with it, unless --data is given "
                   "(other data is warned about)")
    add_train_args(p)
    p.set_defaults(func=cmd_train)


def add_sudoku_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress sudoku`'s flags."""
    p = sub.add_parser("sudoku", formatter_class=DefaultsFormatter, help="solve sudoku puzzles with a block-diffusion model",
                       description="Solve PUZZLE(s): 81 characters each, 0 . - _ or * for an empty cell (words "
                                   "that start with -, a puzzle's or a border's, go after --, which ends the flags: "
                                   "blockpress sudoku -- $(cat board.txt)). The givens are "
                                   "fixed positions of the canvas; the model alone fills the rest (no rules, no "
                                   "search), unless --rules. Default model: blockpress-sudoku. Exit status: 0 "
                                   "when every answer is a valid solution, 1 when any is not, 2 for bad input.")
    p.add_argument("puzzles", nargs="*", help="puzzles, 81 characters each (or words that add up to one: a grid's 9 "
                   "rows, or its 81 cells one a word, '|' and border words between them skipped; a row with no givens is "
                   "'.........', '000000000' or '---|---|---', and '---------', which may be a border, is refused); - reads them from standard input (as --file - does; standard "
                   "input is read once)")
    p.add_argument("--file", default=None,
                   help="a file of puzzles (- for standard input): one per line, or 9-line grids; blank lines, "
                        "'#' comments, border lines (+---+) and header lines between puzzles ('Grid 01') skipped. Or a "
                        "CSV with a header naming its columns, as Kaggle's 'quizzes,solutions' (or puzzle,solution): "
                        "the answers are then also scored against its solutions (matches, cell accuracy)")
    p.add_argument("--model", default="blockpress-sudoku", help="model (default: blockpress-sudoku)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="weights dtype")
    p.add_argument("--device", default="auto", help=DEVICE_HELP + " (default: auto)")
    add_load_args(p)
    p.add_argument("--steps", "--max-denoising-steps", dest="steps", type=int, default=None, action=TypedFlag,
                   help="max denoising steps (default: the model's; 81 for blockpress-sudoku)")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="acceptance rule (default: the model's; topk for blockpress-sudoku)")
    p.add_argument("--rank-by", choices=RANKINGS, default=None,
                   help="the order cells are accepted in (topk, entropy_bound, greedy): lowest entropy first, widest "
                        "gap between the two most likely digits first, or reading order (default: the model's)")
    p.add_argument("--confidence", type=float, default=None, help=CONFIDENCE_HELP)
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: 0, torch's choice)")
    p.add_argument("--show-steps", action="store_true", help="print the board as the canvas settles (one puzzle)")
    p.add_argument("--rules", action="store_true",
                   help="rule-aware decoding: each step, a cell may not take a digit that a settled cell in its row, "
                        "column or box holds (candidate filtering only, no search)")
    p.add_argument("--ensemble", type=int, default=1, metavar="N",
                   help="denoise each puzzle as N symmetric views of the board (relabelled digits, permuted rows "
                        "and columns) that pool their predictions every step; no rules, no search; N times the work")
    p.add_argument("--batch-size", type=int, default=32, metavar="N",
                   help="puzzles decoded together (each --ensemble view a row of the batch); each batch's answers are "
                        "printed as it ends, so a Ctrl-C keeps them, and the memory is a batch's, not the whole "
                        "file's")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per puzzle: puzzle, solution, valid, steps, errors (the rules an invalid "
                        "solution breaks, with their cells); with a CSV's solution also expected, correct and "
                        "cell_accuracy (of the empty cells)")
    p.set_defaults(func=cmd_sudoku)


def add_serve_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress serve`'s flags."""
    p = sub.add_parser("serve", formatter_class=DefaultsFormatter, help="OpenAI-compatible HTTP server (chat, completions, streaming)",
                       description="Serve the model over an OpenAI-compatible API: /v1/chat/completions, "
                                   "/v1/completions, /v1/models, /health, /metrics. Diffusion settings are "
                                   "per-request extra body fields (max_denoising_steps, sampler, entropy_bound, "
                                   "t_min, t_max, min_tokens, drafts, ...).")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--served-name", default=None, help="model id clients use, the one /v1/models lists and requests "
                   "must name (default: the model's folder name, a LoRA run's OUT/adapter OUT's, or the id given)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="rows generated at once, over all running batches: one per sampled choice (a request with "
                        "n: 4 takes 4; n greedy choices take 1); bounds the memory of generation")
    p.add_argument("--max-queue", type=int, default=64,
                   help="rows waiting for --max-batch room before a request gets 429, counted as --max-batch counts "
                        "them (clients that left free theirs at once)")
    p.add_argument("--max-context", type=int, default=None, metavar="TOKENS",
                   help="the most tokens a request's prompt and max_tokens may take together (the answer in whole "
                        "canvases); a longer request gets a 400 naming max_tokens or the prompt and this limit (vLLM's "
                        "--max-model-len; default: the model's context, max_position_embeddings); /v1/models gives it as "
                        "max_model_len")
    p.add_argument("--max-body-bytes", type=int, default=None, metavar="BYTES",
                   help="the largest request body taken; a larger one gets a 413, none of it kept (from its "
                        "Content-Length, or as soon as a chunked body passes it; the rest, up to 64 MiB, is read and "
                        "dropped first so the client gets the answer). Default: room for the context's "
                        "text as JSON, 12 bytes a character of the longest text that could fit, plus 1 MiB "
                        "(4 MiB on blockpress-code)")
    p.add_argument("--max-stops", type=int, default=16, metavar="N",
                   help="the most stop strings a request's `stop` may list (OpenAI takes 4); more get a 400 naming "
                        "stop: each is searched for in every answer's text at every canvas, on the thread that serves "
                        "every client")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds a stop signal (Ctrl-C, SIGTERM) lets requests in flight finish before they are cut "
                        "(a second signal cuts them at once)")
    p.add_argument("--prefix-cache-gb", type=float, default=1.0,
                   help="GiB of recent prompts' keys and values kept, so a prompt that starts like an earlier one "
                        "(a system prompt, a chat's previous turns) encodes only the rest (default: 1; 0: off). "
                        "A cached prompt's logits differ from a fresh encode's by rounding (~1e-6), which can change "
                        "a seeded sampled answer: use 0 where a seed must repeat exactly")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="origins of web pages allowed to call the API from a browser (CORS), as the browser sends "
                        "them: http://localhost:3000 (no path, no trailing slash), or '*' for any (default: none, "
                        "so only clients outside a browser, and pages served from the server's own origin, can); a "
                        "POST from any other page that needs no preflight gets a 403, and CORS refuses the rest")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host names (whole, as the Host header carries them, without the port) that a request "
                        "reaching the server at a loopback address may name besides localhost, 127.0.0.1, [::1], the "
                        "machine's own name and IP addresses, or '*' for any: "
                        "the public name a reverse proxy on this machine passes on (default: none; another Host gets "
                        "a 403, which stops DNS rebinding: a page whose name is pointed at 127.0.0.1 would otherwise "
                        "be on the server's own origin and read its answers)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key of every request to /v1 (`Authorization: Bearer KEY`, the header the openai "
                        "client sends the key it is given in; others get a 401; /health and /metrics stay open), as vLLM's "
                        "--api-key. Default: the BLOCKPRESS_API_KEY environment variable, else no key; prefer the "
                        "variable or --api-key-file, since a flag's value shows in the process list")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="--api-key's key read from this file (one trailing newline left out), so it stays out of the "
                        "process list: a mounted secret, a file only the server's user can read; not with --api-key")
    p.add_argument("--root-path", default=None, metavar="PREFIX",
                   help="the path prefix a reverse proxy in front strips (it serves the API at PREFIX/v1 and sends "
                        "/v1 on): the routes answer as without it, and the URLs the server writes (/docs' "
                        "openapi.json) carry it; uvicorn's --root-path")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="the least severe log lines shown, uvicorn's (its startup lines, the access log) and the "
                        "server's own (a failed batch, a reply the response template cannot read), on stderr (the "
                        "access log on stdout)")
    p.add_argument("--no-access-log", action="store_true",
                   help="leave out uvicorn's access log, a line on stdout per request (shown at --log-level info "
                        "and debug)")
    add_template_kwargs_arg(p, " of every chat request (a request's own win, name by name)")
    p.set_defaults(func=cmd_serve)


def add_bench_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress bench`'s flags."""
    p = sub.add_parser("bench", formatter_class=DefaultsFormatter, help="speed: diffusion vs AR vs the reference, same random checkpoint",
                       description="Side-by-side speed of blockpress generate, blockpress generate_ar and the "
                                   "reference transformers generate (when installed) on one random checkpoint, fixed "
                                   "steps, EOS off. Prints JSON (tok/s with and without prefill, tokens/forward, "
                                   "ms/step, prefill ms, peak memory beyond the weights: the allocator's on CUDA, the heap's on a CPU; "
                                   "its \"figures\" says what each one means for each engine); --plot "
                                   "draws tok/s against batch size. A line on stderr as each row starts and ends.")
    p.add_argument("--preset", default="small", help="model shape: tiny, small (~15M), medium (~60M), 26b-a4b")
    # not bench's: given anyway, an error that points at --preset instead of argparse's "unrecognized arguments"
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1],
                   help="batch sizes to sweep (timed in ascending order, each once)")
    p.add_argument("--canvas-lengths", type=int, nargs="+", default=None,
                   help="canvas lengths to sweep (same weights; default: the preset's; ascending, each once)")
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens per row")
    p.add_argument("--steps", type=int, default=48, help="denoising steps per canvas (fixed)")
    p.add_argument("--prompt-length", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--repeats", type=int, default=2, help="runs per engine (variants included), the engines taking turns; each one's fastest counts")
    p.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    p.add_argument("--no-ar", action="store_true", help="skip the AR engine")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP + " (default: cpu: a benchmark runs where it is "
                                                   "told)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--compile", action="store_true",
                   help="also time blockpress through torch.compile (its first runs compile, for each batch size: "
                        "minutes on a CPU, even for the tiny preset; a line on stderr says when)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also time blockpress with each pass replayed from a CUDA graph (CUDA devices only)")
    p.add_argument("--quantize", choices=SCHEMES, default=None,
                   help="also time blockpress (diffusion and AR) with the projections quantized, on the same "
                        "checkpoint")
    p.add_argument("--layers", type=int, default=None,
                   help="time the preset's first N layers alone, each as in the whole model (N must end on a "
                        "full-attention layer: 6 holds the 26b-a4b's pattern once, 5 sliding and 1 full): a shape "
                        "a machine can hold when the whole one does not (default: every layer)")
    p.add_argument("--plot", default=None, help="write a plot of tok/s against batch size here (.png, .svg, .pdf, "
                                                 ".jpg, .jpeg or .webp: the suffix picks the format)")
    p.add_argument("--out", default=None, help="also write the JSON here (and the plot, with --plot) after each "
                                                "row too, marked \"partial\": true until the run ends: a sweep cut "
                                                "short keeps the rows it measured")
    p.set_defaults(func=cmd_bench)


def add_info_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress info`'s flags."""
    p = sub.add_parser("info", formatter_class=DefaultsFormatter, help="parameters, config summary, dtype, memory",
                       description="Describe a model: parameters (total and active per token), shape, dtype, memory. "
                                   "Nothing is loaded: the model is counted on the meta device from config.json and "
                                   "the safetensors headers, by the plan a load follows (a folder with config.json "
                                   "alone, or with the shards' index before the shards are fetched, works too, in the "
                                   "dtype it declares), and refused as a load refuses it "
                                   "where the headers tell (a tensor missing, unexpected or of another shape). dtype and "
                                   "weights_bytes: what loading on --device with --dtype / --quantize would take; "
                                   "kv_cache_bytes_per_token: the keys and values one row keeps per token (all layers, "
                                   "sliding ones too; times prompt + answer + a canvas for a request, times its rows); "
                                   "checkpoint_dtype and checkpoint_bytes: what the folder stores (before its shards are fetched, the bytes "
                                   "its index says they hold); dtype_note: why "
                                   "dtype differs from it, where it does; "
                                   "tied_copies: the encoder / LM head copies it stores (tie_word_embeddings false), "
                                   "which a load compares with the decoder's weights, refusing one that differs "
                                   "(info reads no tensor data, so it counts them only); "
                                   "hidden_activation, attention_bias and rope (each layer kind's rope_type): where a "
                                   "checkpoint may differ from DiffusionGemma's own.")
    add_model_args(p, device_help="the device the dtype and memory figures are for: bf16/fp16 weights would load "
                                  "as float32 on a CPU without native half-precision matmuls (default: auto, a CUDA "
                                  "GPU where torch sees one, else the CPU; nothing is loaded there)", runs=False)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)


def add_quantize_command(sub: argparse._SubParsersAction[CommandParser]) -> None:
    """`blockpress quantize`'s flags."""
    p = sub.add_parser("quantize", formatter_class=DefaultsFormatter,
                       help="write a quantized copy of a model (int8, fp8, int4) that loads as stored",
                       description="Quantize --model with --quantize and write it to OUT as blockpress.load(model, "
                                   "quantize=...).save(OUT) would: each projection's codes and scales, config.json "
                                   "naming the scheme, the tokenizer and generation settings as they were. Every "
                                   "command's --model then loads OUT quantized, with no --quantize and no "
                                   "quantizing (the 26B-A4B's 50 GB of bf16 weights become a 15 GB int4 folder). "
                                   "The projections are quantized as they are read, on --device (a GPU quantizes "
                                   "faster), so the unquantized weights are never all in memory. Prints the folder, "
                                   "the scheme, its weights' bytes on disk against the source's, and the seconds it "
                                   "took. Only blockpress reads OUT: keep the unquantized checkpoint for "
                                   "transformers.")
    p.add_argument("out", metavar="OUT", help="the folder to write (new or empty; see --overwrite)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="the unquantized model: a Hugging Face checkpoint folder, a shipped model name, a repo id "
                        "already in the Hugging Face cache (owner/name[@revision]), or random-<tiny|small|medium|"
                        "26b-a4b> (random weights of that shape, for quick checks). Not a LoRA adapter folder: "
                        "give the merged checkpoint of its run, or load a QLoRA adapter over OUT with --adapter. "
                        f"Default: {DEFAULT_MODEL}")
    p.add_argument("--quantize", choices=SCHEMES, default=None,
                   help="(required) the scheme: int8 (weights), fp8 (weights and activations, for GPUs with FP8 "
                        "tensor cores) or int4 (weights, groups of 32: for memory, and on a CPU fast AR passes)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the dtype the model loads in, and the one the tensors left unquantized (embedding, norms, "
                        "router) are written in (default: the checkpoint's)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP + " (default: auto): where the weights are "
                                                                  "quantized")
    add_threads_arg(p)
    p.add_argument("--overwrite", action="store_true",
                   help="write over the checkpoint OUT holds (its weights, config and tokenizer files replaced "
                        "together once all are written; other files left as they are); without it a folder that "
                        "is not empty is refused")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: out, model, source (the folder read; null for random-<preset>), "
                        "quantization, dtype (the one the unquantized tensors are written in), bytes (OUT's "
                        "safetensors on disk), source_bytes (the source's; null for random-<preset>), seconds "
                        "(loading, quantizing and writing)")
    # what load_announced reads of a loading command's flags: none of them here (nothing runs the model)
    p.set_defaults(func=cmd_quantize, adapter=None, prefill_chunk=None, compile=False, cuda_graphs=False)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="blockpress",
        description="Run block-diffusion language models (DiffusionGemma and our own small ones) locally.",
    )
    # the package's own figure, which pyproject.toml's version is read from: the installed metadata can be an
    # editable install's, written before __version__ last changed
    ap.add_argument("--version", action="version", version=f"blockpress {blockpress.__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)

    add_generate_command(sub)
    add_infill_command(sub)
    add_chat_command(sub)
    add_train_command(sub)
    add_sudoku_command(sub)
    add_serve_command(sub)
    add_bench_command(sub)
    add_info_command(sub)
    add_quantize_command(sub)
    return ap
