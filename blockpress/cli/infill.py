"""`blockpress infill`: one template, or --input FILE's (generate.py's batch run), every template checked before
the model loads."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any

from blockpress.checks import check_text
from blockpress.cli.common import (
    RANDOM_PREFIX,
    as_flags,
    decoded,
    load_text_model,
    preset_config,
    print_stats,
    printable,
    sampling_kwargs,
    stats_of,
)
from blockpress.cli.generate import (
    LOAD_SETTINGS,
    SAMPLING_SETTINGS,
    all_done,
    check_file_flags,
    from_file,
    lines_done,
    loaded_settings,
    run_file,
    run_settings,
)
from blockpress.cli.output import print_warning
from blockpress.files import utf16_text_error
from blockpress.stopping import fresh_line, stop_status, stop_word


def model_context(args: argparse.Namespace) -> int:
    """The context (max_position_embeddings) of the model `args` names, read from its config.json (a
    random-<preset>'s from the preset) without loading it. Its errors are the load's own: the model is found and
    config.json read as `blockpress.load` finds and reads them."""
    if args.model.startswith(RANDOM_PREFIX):
        return preset_config(args.model[len(RANDOM_PREFIX):], f"--model {args.model}").text.max_position_embeddings
    from blockpress.config import ModelConfig
    from blockpress.lm import resolve_model

    path, _, _ = resolve_model(args.model, args.quantize, args.adapter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # config.json's warnings (an unknown field) are the load's to show, once
        return ModelConfig.from_file(path / "config.json").text.max_position_embeddings


def check_template(text: str, hole_length: int, context: int) -> None:
    """The template's marker errors (a typo such as <|HOLE|>, <|hole:0|>, no holes, empty text) and a hole that
    cannot fit the model's `context`, found by the library's own parser before the model loads: a large checkpoint
    takes minutes to load. The fixed text is passed over, not tokenized (no tokenizer yet): one stand-in token per
    piece of it, so the length checked is a lower bound and the load's check has the last word. (Without the
    context, a huge hole would be laid out as a list of ids before any check.)"""
    from types import SimpleNamespace

    from blockpress.generate import parse_template

    stand_in = lambda piece: [0]  # noqa: E731  (one stand-in id per piece of fixed text)
    untokenized = SimpleNamespace(encode=stand_in, encode_plain=stand_in)
    try:
        parse_template(text, untokenized, 1, hole_length, context)
    except ValueError as exc:
        if str(exc).startswith("template: has no holes"):  # the library's message offers -1 ids: not for a command line
            raise ValueError("template: has no holes to fill; mark them with <|hole|> (--hole-length tokens) or "
                             "<|hole:N|>") from None
        if str(exc).startswith("template: <|hole|> takes"):  # a bare marker's length is the flag's
            raise ValueError(f"--hole-length: {hole_length} tokens for each <|hole|> take the template past the "
                             f"model's context of {context} tokens") from None
        raise


def cmd_infill(args: argparse.Namespace) -> int:
    file = from_file(args, args.template, "template", "templates")
    for flag in ("max_new_tokens", "min_new_tokens"):
        if getattr(args, flag) not in (None, 0):  # an infill's length is its template's
            raise ValueError(f"--{flag.replace('_', '-')}: an infill is as long as its template; size the holes "
                             "with <|hole:N|> or --hole-length")
    if args.hole_length < 1:
        raise ValueError(f"--hole-length: expected a positive integer, got {args.hole_length}")
    if file:
        return infill_file(args)
    text = args.template if args.template != "-" else sys.stdin.read()
    # UTF-16 piped in: said so, as --input's is
    if args.template == "-" and (error := utf16_text_error(text, "template")):
        raise error
    for flag, value in (("--prefix", args.prefix), ("template", text)):
        check_text(value, flag)  # bytes that were not UTF-8 arrive as surrogates: it names the byte, as chat does
    check_template(text, args.hole_length, model_context(args))
    lm = load_text_model(args, "template")
    kw = {k: v for k, v in sampling_kwargs(args, lm).items() if k not in ("max_new_tokens", "min_new_tokens")}
    t0 = time.perf_counter()
    try:
        out = lm.infill(text, prompt=args.prefix or None, hole_length=args.hole_length,
                        token_healing=False if args.no_token_healing else None, **kw)
    except KeyboardInterrupt as exc:
        # An infill is printed once every hole is filled: a Ctrl-C leaves none to show, and says so (--json: one
        # object as generate's says it was cut short, so a script reading it is not left with nothing)
        print(fresh_line(exc), end="", file=sys.stderr, flush=True)  # off the terminal's "^C"
        if args.json:
            print(json.dumps(dict(text=None, fills=None, template=text, seed=args.seed, interrupted=True)))
        print(f"{stop_word(exc)} (an infill is printed once every hole is filled)", file=sys.stderr)
        return stop_status(exc)
    filled = out.texts[0]  # the fixed text as written (special tokens too), the holes filled
    stats = infill_stats(out, 0, time.perf_counter() - t0)
    if args.json:
        print(json.dumps(dict(text=filled, fills=out.fills[0], template=text, **stats, seed=out.extra["seeds"][0],
                              interrupted=False)))
    else:
        print(printable(filled))
        print_stats(stats)
    return 0


def infill_stats(out: Any, i: int, seconds: float) -> dict[str, Any]:
    """Row `i`'s figures in an infill's output: new_tokens (also filled_tokens) are the tokens the model wrote, the
    holes', as generate's are and as tokens_per_forward and tok_s count them; template_tokens is the whole
    template, fixed tokens included."""
    filled_n = int(out.num_chosen_tokens[i])
    stats = stats_of(filled_n, int(out.forward_passes[i]), float(out.tokens_per_forward[i]), seconds)
    stats["template_tokens"] = int(out.num_new_tokens[i])
    stats["filled_tokens"] = filled_n
    return stats


def infill_file(args: argparse.Namespace) -> int:
    """`infill --input FILE`: generate --input's run (check_file_flags, run_file) for a file of templates, every
    template checked before the model loads (as `infill TEMPLATE` checks its one) and again, with its prefix, as
    the run alone would take it; each batch one lm.infill, each row with its own seed."""
    from blockpress.batchfile import INFILL, read_input, unapplied_notes

    if args.prefix:  # one context for every line would not be in the output lines --resume checks
        raise ValueError('--prefix: not with --input; give each line that has one its own "prefix"')
    output = check_file_flags(args, INFILL)
    name, rows = read_input(args.input, INFILL)
    for note in unapplied_notes(name, rows, INFILL):
        print_warning(note)
    context = model_context(args)
    for row in rows:
        try:
            check_template(row.template or "", args.hole_length, context)  # (an infill line has one)
        except ValueError as exc:
            raise ValueError(f"{name}:{row.line}: {exc}") from None
    names = (*LOAD_SETTINGS, "hole_length", *SAMPLING_SETTINGS)
    done = lines_done(args, output, rows, INFILL, run_settings(args, names))
    if len(done) == len(rows):
        return all_done(output, name)
    lm = load_text_model(args, "template")
    settings = loaded_settings(args, output, names, lm)
    kw = {k: v for k, v in sampling_kwargs(args, lm).items() if k not in ("max_new_tokens", "min_new_tokens", "seed")}
    healing = False if args.no_token_healing else None
    lm.stream("", template="<|hole:1|>", seed=args.seed, **kw)  # the flags alone: their errors name the flag
    seeds: dict[int, int | None] = {}
    for row in rows:
        seeds[row.line] = row.seed if row.seed is not None else args.seed
        try:  # checked as the run alone would be, and not run (the stream is never iterated); "": BOS alone,
            # as infill without a prefix starts
            lm.stream(row.prefix or "", template=row.template, hole_length=args.hole_length, seed=seeds[row.line],
                      token_healing=healing, **kw)
        except ValueError as exc:
            raise ValueError(f"{name}:{row.line}: {as_flags(str(exc), {'prompt': 'prefix'})}") from None

    def run_batch(batch: list[Any]) -> list[dict[str, Any]]:
        given = [seeds[r.line] for r in batch]  # a batch's rows all have seeds, or none has (batchfile.batches)
        out = lm.infill([r.template for r in batch], prompt=[r.prefix or "" for r in batch],
                        hole_length=args.hole_length, token_healing=healing,
                        **(dict(seeds=given) if given[0] is not None else dict(seed=None)), **kw)
        texts = decoded(out.texts, "infill")
        lines = []
        for i, row in enumerate(batch):
            stats = {k: v for k, v in infill_stats(out, i, 0.0).items() if k not in ("tok_s", "seconds")}
            lines.append(dict(line=row.line, **row.carried, text=texts[i], fills=out.fills[i], template=row.template,
                              **({"prefix": row.prefix} if row.prefix is not None else {}), **stats,
                              seed=out.extra["seeds"][i], settings=settings))
        return lines

    return run_file(args, output, rows, done, run_batch, "infill",
                    # the text's length in characters: the templates are not tokenized until the batch
                    {r.line: len(r.template or "") + len(r.prefix or "") for r in rows},
                    {r.line: (seeds[r.line] is None,) for r in rows})
