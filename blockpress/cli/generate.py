"""`blockpress generate`: one prompt (drawn live on a terminal), --ar, and --input FILE's batch run, which `infill
--input` shares (check_file_flags, run_file)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from blockpress.checks import check_text
from blockpress.cli.chat import ReplyReader, check_chat_template, system_turn
from blockpress.cli.common import (
    check_draw_filters,
    check_file_path,
    decoded,
    default_budget,
    load_text_model,
    print_stats,
    printable,
    sampling_kwargs,
    stats_line,
    stats_of,
    typed_flag,
)
from blockpress.cli.output import print_warning
from blockpress.files import utf16_text_error
from blockpress.stopping import fresh_line, stop_status, stop_word

FILE_BATCH_SIZE = 8  # --input's rows a call when --batch-size is not given


def from_file(args: argparse.Namespace, given: str | None, name: str, what: str) -> bool:
    """Whether the command runs --input FILE (a JSONL file of `what`) rather than its one `name` argument (`given`):
    one of them, and --input's companion flags only with it."""
    if (given is None) == (args.input is None):
        raise ValueError(f"{name}: give {name.upper()} (one text) or --input FILE (a JSONL file of {what}), "
                         f"{'not both' if args.input is not None else 'got neither'}")
    if args.input is None and (args.output, args.overwrite, args.resume, args.batch_size) != (None, False, False, None):
        flag = ("--output" if args.output is not None else "--overwrite" if args.overwrite else
                "--resume" if args.resume else "--batch-size")
        raise ValueError(f"{flag}: goes with --input FILE (one {name.upper()}'s result is printed)")
    return args.input is not None


def model_heals(lm: Any) -> bool:
    """Whether the model's generation settings leave generate healing a plain prompt's last token (a model
    fine-tuned on prompts ending in whitespace learned to follow that lone token: its training run wrote
    token_healing false); yes where they do not say."""
    return bool(lm.generation_config.get("token_healing", True))


def healing_wanted(lm: Any, args: argparse.Namespace) -> bool:
    """Whether generate heals a plain prompt's last token: --token-healing / --no-token-healing where given, else
    the model's say (model_heals)."""
    return model_heals(lm) if args.no_token_healing is None else not args.no_token_healing


def cmd_generate(args: argparse.Namespace) -> int:
    from blockpress.generate import Commit, Done, Draft, encode_texts
    from blockpress.healing import heal
    from blockpress.live import LiveView, live_terminal

    if from_file(args, args.prompt, "prompt", "prompts"):
        return generate_file(args)
    if args.system is not None and not args.chat:
        raise ValueError("--system: a system message goes with --chat (the chat template renders it)")
    if args.chat_template_kwargs and not args.chat:
        raise ValueError("--chat-template-kwargs: the chat template's variables go with --chat (without it the prompt "
                         "is not rendered through the template)")
    if args.chat and args.no_token_healing is False:  # --token-healing: asked for by name, it would do nothing
        raise ValueError("--token-healing: not with --chat, whose prompt ends with the chat template's turn header "
                         "(the template's own, never healed); drop --token-healing, or --chat to heal a plain prompt")
    if args.prompt != "-":  # before the model loads; with --chat it was named as the message it becomes
        check_text(args.prompt, "prompt")
    lm = load_text_model(args, "prompt")
    if args.chat:
        check_chat_template(lm, args, "--chat (drop it to continue the prompt as plain text)")
    if args.prompt == "-":  # as infill's template
        args.prompt = sys.stdin.read()
        if error := utf16_text_error(args.prompt, "prompt"):  # (UTF-16 piped in: said so, as --input's is)
            raise error
        check_text(args.prompt, "prompt")
    live = live_terminal(sys.stdout) and not args.no_live and not args.json
    prompt: Any = args.prompt
    shown = args.prompt  # what the output starts with: the text continued; with --chat, the reply stands alone
    if args.chat:
        prompt, shown = lm.chat_prompt([*system_turn(args), {"role": "user", "content": args.prompt}],
                                       **args.chat_template_kwargs), ""
    # a chat prompt ends with the template's turn header, which is the template's to keep, not a typed last token
    healing = healing_wanted(lm, args) and not args.chat
    prefix = heal(lm.tokenizer, encode_texts([args.prompt], lm.tokenizer)[0]).prefix if healing else ""
    if args.ar:
        return generate_ar(lm, args, prompt, shown, healing)
    view = LiveView(lm.tokenizer, shown, prefix, color=not os.environ.get("NO_COLOR")) if live else None
    t0 = time.perf_counter()
    out = None
    # The text and the new tokens committed so far, as the last Commit has them: a Ctrl-C's result.
    text, n, passes = "", 0, 0
    answer, thought = "", None  # the whole reply's (Done), its thought apart where the response template reads one
    try:
        for event in lm.stream(prompt, drafts=live, token_healing=healing, stop=args.stop,
                               **sampling_kwargs(args, lm)):
            if isinstance(event, Draft) and view:
                view.draft(event.tokens[0].tolist())
            elif isinstance(event, Commit):
                if event.num_new_tokens is None:  # (every Commit of the decoding loop has it)
                    raise ValueError("generate: a commit without its num_new_tokens")
                text, n = decoded(event.texts_so_far, "generate")[0], int(event.num_new_tokens[0])
                passes += int(event.steps[0])
                if view:
                    view.commit(text)
            elif isinstance(event, Done):
                out = event.output
                answer, thought = decoded(out.texts, "generate")[0], None
                if args.chat:  # a thought the response template reads, apart from the answer, as `chat` gives it
                    reply = ReplyReader(lm, prompt).read(out)
                    answer, thought = reply.answer, reply.thought
                if view:  # the thought (where there is one) and the answer on a line of its own, as `chat` shows them
                    view.commit(f"{thought}\n{answer}" if thought else answer, final=True)
    except KeyboardInterrupt as exc:  # a Ctrl-C, or a SIGTERM or SIGHUP (Stopped)
        # The text committed so far is the run's result, as the README promises: on the live view it stays on
        # screen; piped or --no-live it goes to stdout like a finished run's, and --json says it was cut short.
        seconds = time.perf_counter() - t0
        stats = stats_of(n, passes, n / passes if passes else 0.0, seconds)
        if view:
            view.abort()  # the text so far stays, the draft goes, and the shell's prompt gets its own line
        else:
            # off the terminal's "^C", where the text or the object would have started (the live view redraws
            # its region from the start of a line)
            print(fresh_line(exc), end="", file=sys.stderr, flush=True)
            if args.json:
                # the seed a drawn one was is known only once the run is done (out.extra["seeds"]): null then
                print(json.dumps(dict(text=text, prompt=args.prompt, **stats, seed=args.seed, interrupted=True)))
            else:
                print(printable(shown + text))
        print(f"{stop_word(exc)} ({n} new tokens committed)", file=sys.stderr)
        return stop_status(exc)
    if out is None:  # (LM.stream ends every run with its Done)
        raise ValueError("generate: the run ended without its output")
    stats = stats_line(out, time.perf_counter() - t0)
    if args.json:
        # the seed the text was drawn with (a fresh one without --seed): --seed with it repeats the text
        print(json.dumps(dict(text=answer, **({"reasoning": thought} if thought else {}), prompt=args.prompt,
                              **stats, seed=out.extra["seeds"][0], interrupted=False)))
    else:
        if not live:
            print(printable(shown + answer))
        print_stats(stats, own_line=live)  # (the live view's last line ended with the text)
    return 0


# The flags of block diffusion's acceptance rule and schedule: generate_ar has neither, so --ar refuses them by
# name rather than run without them (its draws take --temperature, --top-k, --top-p and the penalties).
DIFFUSION_ONLY_FLAGS = ("steps", "sampler", "entropy_bound", "confidence", "rank_by", "t_max", "t_min")


def check_ar_flags(args: argparse.Namespace) -> None:
    given = [typed_flag(args, "--" + name.replace("_", "-")) for name in DIFFUSION_ONLY_FLAGS
             if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{given[0]}: --ar decodes one token at a time, with no denoising steps, acceptance rule or "
                         "temperature schedule; drop it (--temperature, --top-k, --top-p and the penalties shape "
                         "AR's draws)")
    check_draw_filters(args, not args.temperature, "--ar without --temperature" if args.temperature is None else
                       "--ar --temperature 0", "give --temperature above 0")


def generate_ar(lm: Any, args: argparse.Namespace, prompt: Any, shown: str, healing: bool) -> int:
    """`generate --ar`: the same backbone decoding one token at a time (lm.generate_ar), greedy unless
    --temperature > 0, with the checkpoint's top_k, top_p and penalties under the flags; no live canvas (there is
    none), the text and the stats line (or --json) as a diffusion run prints them."""
    check_ar_flags(args)
    t0 = time.perf_counter()
    try:
        out = lm.generate_ar(prompt, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                             temperature=args.temperature, seed=args.seed, top_k=args.top_k, top_p=args.top_p,
                             presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                             token_healing=healing, stop=args.stop)
    except KeyboardInterrupt as exc:  # a Ctrl-C, SIGTERM or SIGHUP
        # generate_ar gives its text once it is done (no commits along the way): a Ctrl-C leaves none to show, and
        # says so, as infill's does (--json: one object that says it was cut short, so that a script reading the
        # object gets one)
        print(fresh_line(exc), end="", file=sys.stderr, flush=True)  # off the terminal's "^C"
        if args.json:
            print(json.dumps(dict(text=None, prompt=args.prompt, seed=args.seed, interrupted=True)))
        print(f"{stop_word(exc)} (--ar prints its text once it is done)", file=sys.stderr)
        return stop_status(exc)
    stats = stats_line(out, time.perf_counter() - t0)
    answer, thought = out.texts[0], None
    if args.chat:  # a thought the response template reads, apart from the answer, as a diffusion run gives it
        reply = ReplyReader(lm, prompt).read(out)
        answer, thought = reply.answer, reply.thought
    if args.json:
        print(json.dumps(dict(text=answer, **({"reasoning": thought} if thought else {}), prompt=args.prompt,
                              **stats, seed=out.extra["seeds"][0], interrupted=False)))
    else:
        print(printable(shown + answer))
        print_stats(stats)
    return 0


@dataclasses.dataclass
class FileRow:
    """An --input row made ready to run: its prompt's ids, whether it is a chat (no healing: a call's), its
    budget and seed (its own, else the flags'; None: the library draws one)."""

    ids: list[int]
    chat: bool
    healing: bool
    max_new_tokens: int
    seed: int | None


def generate_file(args: argparse.Namespace) -> int:
    """`generate --input FILE`: every line read and checked (batchfile.read_input, then each row's prompt as the
    run alone would take it) before anything runs; then batches of --batch-size rows of similar length, each row
    with its own budget and seed (so each is what it gives alone), written in input order as they finish."""
    from blockpress.batchfile import GENERATE, read_input, unapplied_notes
    from blockpress.generate import encode_texts
    from blockpress.healing import heal
    from blockpress.tokenizer import TemplateRaised

    if args.ar:
        check_ar_flags(args)
    output = check_file_flags(args, GENERATE)
    name, rows = read_input(args.input, GENERATE)  # every line checked before the model loads
    for note in unapplied_notes(name, rows, GENERATE):
        print_warning(note)
    chats = [args.chat or row.messages is not None for row in rows]
    if not any(chats):
        for flag, value in (("--system", args.system), ("--chat-template-kwargs", args.chat_template_kwargs)):
            if value:
                raise ValueError(f"{flag}: no line of {name} is a chat (give --chat, or \"messages\" lines), so "
                                 "the chat template renders none")
    # before the load: the lines' own. "developer" is OpenAI's name for the system role, read as "system": else it
    # meets the template's refusal ('Chat template error: Only the first message may have the system role')
    system_roles = ("system", "developer") if args.system is not None else ()
    for row in rows:
        if any(isinstance(m, dict) and m.get("role") in system_roles for m in row.messages or []):
            raise ValueError(f"{name}:{row.line}: messages: has a system message, and --system gives one too; drop one")
    if any(chats) and args.no_token_healing is False:
        raise ValueError("--token-healing: not with chat lines, whose prompt ends with the chat template's turn "
                         "header (the template's own, never healed)")
    settings = run_settings(args, GENERATE_SETTINGS)
    done = lines_done(args, output, rows, GENERATE, settings)
    if len(done) == len(rows):
        return all_done(output, name)
    lm = load_text_model(args, "prompt")
    settings = loaded_settings(args, output, GENERATE_SETTINGS, lm)
    if any(chats):
        check_chat_template(lm, args, "a chat line (--chat, or \"messages\")")
    kw = {k: v for k, v in sampling_kwargs(args, lm).items() if k not in ("max_new_tokens", "seed")}
    wanted = healing_wanted(lm, args)
    if not args.ar:  # the flags alone, on a one-token prompt: their errors name the flag, not a line
        lm.stream("x", max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop, **kw)
    else:  # generate_ar checks as it runs: one token on a one-token prompt, before --output is made (a bad --top-p
        # would leave an empty file that a rerun then has to --overwrite); the counts' bounds are checked here, so
        # that a --min-new-tokens of 200 does not cost a 200-token run first
        least, given = args.min_new_tokens or 0, args.max_new_tokens
        if given is not None and given >= 1 and not 0 <= least <= given:
            raise ValueError(f"min_new_tokens: expected an integer in [0, max_new_tokens={given}], got {least}")
        lm.generate_ar("x", max_new_tokens=given if given is not None and given < 1 else 1,
                       min_new_tokens=least if least < 0 else min(least, 1),
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                       stop=args.stop, seed=args.seed)
    ready: dict[int, FileRow] = {}
    for row, chat in zip(rows, chats, strict=True):
        where = f"{name}:{row.line}"
        try:
            if chat:
                given = row.messages if row.messages is not None else [{"role": "user", "content": row.prompt}]
                try:
                    ids = lm.chat_prompt([*system_turn(args), *given], **args.chat_template_kwargs)
                except TemplateRaised as exc:  # the template's raise_exception, about the line's messages: named
                    # so (its text is the template's own, which names no message, so none is guessed at here)
                    if row.messages is None:
                        raise
                    after = " (after --system's message)" if args.system is not None else ""
                    raise ValueError(f"messages{after}: {exc}") from None
            else:
                ids = encode_texts([row.prompt or ""], lm.tokenizer,  # (a line without messages has a prompt)
                                   context=lm.config.text.max_position_embeddings)[0]
            healing = wanted and not chat
            budget = row.max_new_tokens or args.max_new_tokens
            if budget is None:  # the checkpoint's default, as the run alone counts it: after the prompt (healed),
                # grown to a --min-new-tokens past it
                budget = default_budget(lm, len(heal(lm.tokenizer, ids).ids) if healing else len(ids),
                                        args.min_new_tokens)
            seed = row.seed if row.seed is not None else args.seed
            if args.ar:  # (generate_ar runs as it checks: the line's own settings are checked here)
                context = lm.config.text.max_position_embeddings
                if (args.min_new_tokens or 0) > budget:  # refused by the line, not mid-file by a batch
                    raise ValueError(f"min_new_tokens: expected an integer in [0, max_new_tokens={budget}], got "
                                     f"{args.min_new_tokens}")
                if len(ids) + budget > context:
                    raise ValueError(f"prompt: {len(ids)} prompt + {budget} new tokens exceed the model's context "
                                     f"of {context} tokens")
            else:  # checked as the run alone would be, and not run (the stream is never iterated)
                lm.stream(ids, max_new_tokens=budget, seed=seed, token_healing=healing, stop=args.stop, **kw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        ready[row.line] = FileRow(ids, chat, healing, budget, seed)

    def run_batch(batch: list[Any]) -> list[dict[str, Any]]:
        """One lm.generate (--ar: lm.generate_ar) for `batch`: each row's output line."""
        from types import SimpleNamespace

        rows = [ready[r.line] for r in batch]
        first = rows[0]  # a batch's rows share healing and whether they have seeds (batchfile.batches)
        seeds = dict(seeds=[r.seed for r in rows]) if first.seed is not None else dict(seed=None)
        budgets = [r.max_new_tokens for r in rows]
        if args.ar:
            out = lm.generate_ar([r.ids for r in rows], max_new_tokens=budgets,
                                 min_new_tokens=args.min_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, presence_penalty=args.presence_penalty,
                                 frequency_penalty=args.frequency_penalty, token_healing=first.healing,
                                 stop=args.stop, **seeds)
        else:
            out = lm.generate([r.ids for r in rows], max_new_tokens=budgets, token_healing=first.healing,
                              stop=args.stop, **seeds, **kw)
        texts = decoded(out.texts, "generate")
        lines = []
        for i, (row, prepared) in enumerate(zip(batch, rows, strict=True)):
            answer, thought = texts[i], None
            if prepared.chat:  # a thought the response template reads, apart, as generate --chat gives it
                alone = SimpleNamespace(texts=[texts[i]], new_tokens=out.new_tokens[i:i + 1],
                                        num_new_tokens=out.num_new_tokens[i:i + 1])
                reply = ReplyReader(lm, prepared.ids).read(alone)
                answer, thought = reply.answer, reply.thought
            lines.append(dict(
                line=row.line, **row.carried, text=answer, **({"reasoning": thought} if thought else {}),
                **({"prompt": row.prompt} if row.prompt is not None else {"messages": row.messages}),
                **({"max_new_tokens": row.max_new_tokens} if row.max_new_tokens is not None else {}),
                new_tokens=int(out.num_new_tokens[i]),
                forward_passes=int(out.forward_passes[i]),
                tokens_per_forward=round(float(out.tokens_per_forward[i]), 3), seed=out.extra["seeds"][i],
                settings=settings))
        return lines

    return run_file(args, output, rows, done, run_batch, "generate", {r: len(ready[r].ids) for r in ready},
                    {r: (ready[r].chat, ready[r].seed is None) for r in ready})


def check_file_flags(args: argparse.Namespace, kind: Any) -> Path | None:
    """--input's companion flags (--batch-size, --output, --overwrite, --resume), checked before anything loads;
    the --output path, if one is given."""
    from blockpress.batchfile import check_output

    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size: expected a positive integer (rows per call), got {args.batch_size}")
    if args.json:  # accepted, it changed nothing: a flag either means something or is refused
        raise ValueError(f"--json: not with --input, whose output is JSON lines already, one object a row "
                         f"({', '.join(kind.output_keys)} where they apply, and the copied keys); drop --json")
    # "-" is standard output, as --input's "-" is standard input (not a file named "-")
    output = Path(args.output) if args.output not in (None, "-") else None
    if output is not None and not output.is_dir():  # (a folder that is there is named as one by check_output)
        check_file_path(typed_flag(args, "--output"), args.output)
    if output is None and (args.overwrite or args.resume):
        raise ValueError(f"{'--overwrite' if args.overwrite else '--resume'}: goes with --output FILE (standard "
                         "output is written as it goes)")
    if args.overwrite and args.resume:
        raise ValueError("--resume: not with --overwrite (which starts the output again); give one")
    if output is not None:
        check_output(output, args.input, kind)
    if output is not None and output.exists() and not (args.overwrite or args.resume):
        raise ValueError(f"--output {output}: exists; give --overwrite to replace it, or --resume to continue it")
    return output


def lines_done(args: argparse.Namespace, output: Path | None, rows: list[Any], kind: Any,
               settings: dict[str, Any]) -> set[int]:
    """The input lines an existing --output holds already (--resume; none otherwise), read before the model loads:
    another file's output is refused then, not once a model of minutes has loaded, and so is one
    made with other `settings` (run_settings), by the flag that differs (but for a dtype the load decides, which
    loaded_settings checks); lines written before output lines recorded their settings are taken unchecked, with a
    warning."""
    from blockpress.batchfile import check_settings, done_lines

    if output is None or not output.exists() or not args.resume:
        return set()
    done = done_lines(output, rows, kind)
    unchecked = check_settings(output, settings, lambda key: typed_flag(args, "--" + key.replace("_", "-")),
                               recorded=recorded_setting, skip=() if args.dtype is not None else ("dtype",))
    if unchecked:
        print_warning(f"--resume: {unchecked} line{'' if unchecked == 1 else 's'} of {output} "
                      f"{'was' if unchecked == 1 else 'were'} written before output lines recorded their settings; "
                      "the flags they were made with could not be checked against this run's")
    return done


# The flags that change what an --input row gets, which each output line records (run_settings) and --resume checks.
# Not --batch-size: each row draws as it would alone (a resumed run batches the rows left otherwise anyway); nor
# --prefill-chunk, --compile, --cuda-graphs, --threads (the same computation, up to the rounding batching moves too),
# --no-live or --output. --device by its kind: a seed draws from a generator on the device, so a seeded row on cuda
# is not the row on cpu. --dtype by the dtype the model computes in, given or not: with none given the load picks it
# by the machine as --device's default does (a bf16 checkpoint computes in float32 on a CPU without native bf16
# matmuls), and a bf16 row is not the float32 one.
LOAD_SETTINGS = ("model", "adapter", "quantize", "dtype", "device")
SAMPLING_SETTINGS = ("steps", "sampler", "entropy_bound", "confidence", "rank_by", "t_max", "t_min", "temperature",
                     "top_k", "top_p", "presence_penalty", "frequency_penalty", "seed", "no_token_healing")
GENERATE_SETTINGS = (*LOAD_SETTINGS, "max_new_tokens", "min_new_tokens", *SAMPLING_SETTINGS, "stop", "ar", "chat",
                     "system", "chat_template_kwargs")


def run_settings(args: argparse.Namespace, names: tuple[str, ...], lm: Any = None) -> dict[str, Any]:
    """The flags `names` as an --input run's output lines record them: each by its dest, a flag not given (None,
    False, empty) left out; --device by its kind, --dtype by the dtype the loaded `lm` computes in (before the
    load, `lm` None: as given), and --token-healing (no_token_healing False) under its own name."""
    settings: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name)
        if name == "device":
            value = value.split(":")[0]  # (cuda:1's rows are cuda:0's)
        if name == "dtype" and lm is not None:
            value = str(lm.dtype).removeprefix("torch.")  # (as --dtype names it: "bfloat16")
        if name == "no_token_healing" and value is False:
            name, value = "token_healing", True
        value = recorded_setting(name, value)
        if value is not None and value is not False and value != {} and value != []:
            settings[name] = value
    return settings


def loaded_settings(args: argparse.Namespace, output: Path | None, names: tuple[str, ...], lm: Any) -> dict[str, Any]:
    """run_settings once `lm` has loaded, its dtype among them; with no --dtype, the one the load picked is checked
    against an output resumed (lines_done, before the load, could not), so a file made in bfloat16 on one machine
    is not continued in float32 on another, and one made with --dtype float32 is continued where float32 is the
    default."""
    from blockpress.batchfile import recorded_settings

    settings = run_settings(args, names, lm)
    if args.dtype is None and output is not None and output.exists() and args.resume:
        dtype, unknown = settings["dtype"], 0
        for number, held in recorded_settings(output):  # (lines_done compared the rest, and said lines without any)
            if held is None:
                continue
            if "dtype" not in held:  # written before lines recorded the dtype a run without --dtype computed in
                unknown += 1
            elif held["dtype"] != dtype:
                raise ValueError(f"--dtype: {output}:{number} was written with {held['dtype']}; with no --dtype this "
                                 f"run computes in {dtype}, the load's pick for this machine: give --dtype "
                                 f"{held['dtype']} to continue it, or --overwrite to start it again")
        if unknown:
            print_warning(f"--resume: {unknown} line{'' if unknown == 1 else 's'} of {output} "
                          f"record{'s' if unknown == 1 else ''} no dtype (written before lines recorded the one a run "
                          f"computes in); the rest are computed in {dtype}, which those may not have been "
                          "(--overwrite starts the file again)")
    return settings


def recorded_setting(name: str, value: Any) -> Any:
    """A setting's value as an output line records it (--resume reads lines of before through it too): --model's and
    --adapter's folder by where it is, however it was spelled (--model=~/code, code from its parent, through a
    symlink): as typed, the same folder would be refused on resuming, and two folders both typed `m` from two working
    directories would be taken as one. A name that loads no folder (a shipped model, which a bare name always is,
    random-<preset>, a hub repo id) stays as it is, as does every other setting."""
    from blockpress.cli.common import RANDOM_PREFIX
    from blockpress.lm import shipped_models

    if name not in ("model", "adapter") or not isinstance(value, str) or not value:
        return value
    if name == "model" and (value in shipped_models() or value.startswith(RANDOM_PREFIX)):
        return value
    folder = Path(os.path.expanduser(value))  # (Path.expanduser raises with no home known)
    return str(folder.resolve()) if folder.is_dir() else value


def all_done(output: Path | None, name: str) -> int:
    """--resume over an --output that holds every line: said, and no model loaded."""
    print(f"--resume: {output} holds every line of {name} already; nothing is left to run", file=sys.stderr)
    return 0


def run_file(args: argparse.Namespace, output: Path | None, rows: list[Any], done: set[int],
             run_batch: Callable[[list[Any]], list[dict[str, Any]]], command: str, length: dict[int, int],
             group: dict[int, tuple[Any, ...]]) -> int:
    """An --input run's rows (every one checked) to --output or stdout: the lines `done` (lines_done: an --output
    holds them already) skipped, the rest in batches (batchfile.batches: by `length`, never mixing a `group`)
    through `run_batch`, which gives each row's output line (its new_tokens counted for the stats)."""
    from blockpress.batchfile import InOrderWriter, batches

    todo = [row for row in rows if row.line not in done]
    out: IO[str]
    if output is not None:
        try:
            out = output.open("a" if args.resume else "w" if args.overwrite else "x", encoding="utf-8")
        except OSError as exc:  # a read-only file or folder: the error alone names no flag
            raise OSError(f"--output {output}: cannot write it ({exc.strerror or exc})") from None
    else:
        out = sys.stdout
    try:
        return run_file_rows(todo, InOrderWriter(out, [r.line for r in todo]),
                             batches(todo, args.batch_size or FILE_BATCH_SIZE, length, group), run_batch, command, output,
                             bar=not getattr(args, "no_live", False))  # (infill has no --no-live)
    finally:
        if out is not sys.stdout:
            try:
                out.close()
            except OSError:  # the rest of a line whose write failed, said already (run_file_rows): all others
                pass  # were flushed as they were written


def run_file_rows(todo: list[Any], writer: Any, groups: Iterable[list[Any]],
                  run_batch: Callable[[list[Any]], list[dict[str, Any]]], command: str, output: Path | None,
                  bar: bool = True) -> int:
    """An --input run's loop: one `run_batch` a batch, its rows written as they can be; a progress bar on a
    terminal's stderr unless `bar` is False (--no-live), and the stats line at the end (or after a Ctrl-C, what was
    written)."""
    from tqdm import tqdm

    progress = tqdm(total=len(todo), unit="row", desc=command, dynamic_ncols=True, leave=False,
                    disable=None if bar and sys.stderr is not None else True, file=sys.stderr)
    t0, new_tokens = time.perf_counter(), 0
    try:
        for batch in groups:
            for row, line in zip(batch, run_batch(batch), strict=True):
                new_tokens += line["new_tokens"]
                try:
                    writer.add(row.line, line)
                except OSError as exc:
                    if output is None:  # standard output's failures are run_command's (a reader gone: 141)
                        raise
                    # a full disk says "error: [Errno 28] No space left on device", naming no flag (exit 2, as
                    # bench's --out and quantize's OUT that cannot be written)
                    progress.close()
                    raise OSError(f"--output {output}: cannot write it ({exc.strerror or exc}); the whole lines it "
                                  "holds stay, and --resume continues") from None
            progress.update(len(batch))
            seconds = time.perf_counter() - t0
            progress.set_postfix_str(f"{new_tokens / seconds:.1f} tok/s" if seconds > 0 else "")
    except KeyboardInterrupt as exc:  # a Ctrl-C, SIGTERM or SIGHUP: the lines written stay, and --resume goes on
        progress.close()
        where = f" to {output}; --resume continues" if output is not None else ""
        print(f"{fresh_line(exc)}{stop_word(exc)} ({writer.written} of {len(todo)} lines written{where})",
              file=sys.stderr)
        return stop_status(exc)
    progress.close()
    seconds = time.perf_counter() - t0
    tok_s = round(new_tokens / seconds, 2) if seconds > 0 else None
    rows = f"{len(todo)} row{'' if len(todo) == 1 else 's'}"  # (not "[1 rows · ...")
    print(f"[{rows} · {new_tokens} new tokens · {seconds:.1f} s · {tok_s} tok/s]", file=sys.stderr)
    return 0
