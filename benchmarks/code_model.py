"""Quality of a code model on held-out stdlib modules: block diffusion vs AR decoding of the same weights.

Figures (JSON):
- parseable: fraction of generated function bodies that `ast.parse` accepts. The prompt is the function's
  source up to its `def` line, without the newline that ends it (BPE merges a newline with the indentation
  after it, so the model writes both; see `blockpress.tasks.code`). The completion is cut where the body ends (the first non-blank line indented
  no deeper than the `def`) or at the last complete line, and must hold at least one statement.
- parseable_ceiling: the same judge over the functions' own bodies cut at --max-new-tokens tokens, as a model
  writing the original code returns them: what faithful code scores under this budget (a body it cuts inside a
  statement or an open bracket does not parse; at 64 tokens about one in seven). A reference point, not a bound: a
  body of `pass` parses at any budget.
- parseable_without_loops: the same, less bodies that repeat a line (8+ characters) three times or more: a
  loop that ends on a complete line parses, but it is the model's commonest failure.
- infill_exact: exact-match rate of single-line infills (null with `--infills 0`). One body line becomes a hole
  of its own token length; diffusion sees the following lines too (a constrained canvas), AR only the prefix (its
  first line is judged). A fill matches with its indentation (tasks.code.fills_the_line).
- tokens_per_forward and tok/s at the model's default settings (the AR baseline takes the same repetition
  penalties).
- trailing_newline: parseable rate when the prompt ends with the `def` line's newline, as people type it,
  with and without token healing (`--healing-functions` of the same functions; 0 skips it).
- space_infill: mid-line infills after a space (`--space-infills`, 0 skips them): a body line's text up to a space
  inside it is a text template's fixed text, the rest of the line its hole (as long as running text's tokens of
  the space and the rest), the lines after fixed behind it. Diffusion only, its holes as typed
  (token_healing=False: the lone space token stays) and healed (infill's default: the space's position joins the
  hole); `exact` is the rate of fills that are the line's rest, `double_space` of fills that start with whitespace
  after the template's space.

    python benchmarks/code_model.py --model blockpress-code --functions 100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings

import torch
from benchmark_args import Formatter, checkpoint, fail, non_negative_int, positive_int, progress

import blockpress
from blockpress.generate import canvas_positions, escape_template
from blockpress.sampling import SamplerConfig
from blockpress.tasks.code import (
    Function,
    budget_ceiling,
    completion_parses,
    completion_parses_without_loops,
    fills_the_line,
    infill_cases,
    model_heldout_functions,
    space_infill_cases,
)
from blockpress.tokenizer import Tokenizer

PROMPT_MAX = 256  # a prompt's last tokens kept: the function's source up to its `def` line, cut to fit
# The held-out functions' shuffle, whatever --seed: the test split is its first --functions, and
# scripts/tune_code_sampler.py and rerank_code_candidates.py validate on the functions after it in the same order
# (seed 0). --seed shuffled it too, and then 8-15 of 100 test functions were among the validation ones.
SPLIT_SEED = 0

# Sampler options that mean the same for AR decoding; without --sampler-options both engines read the
# checkpoint's generation_config.json (penalties included).
AR_OPTIONS = ("presence_penalty", "frequency_penalty")


def sampler_options(text: str) -> dict:
    """--sampler-options: a JSON object of SamplerConfig's settings, each checked as generate checks it. Bad JSON, a
    list, an unknown or misspelt setting were tracebacks (JSONDecodeError, AttributeError, generate's ValueError)."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of sampler settings, got {text!r}")
    known = [f.name for f in dataclasses.fields(SamplerConfig)]
    unknown = [key for key in options if key not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]}: no such sampler setting; expected some of {', '.join(known)}")
    try:
        SamplerConfig(**options)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return options


def exit_if_past_context(lm: blockpress.LM, max_new_tokens: int, model: str) -> None:
    """Exit naming --max-new-tokens when a prompt of PROMPT_MAX tokens and its new tokens' whole canvases (as
    generate takes them) pass the model's context: it was generate's traceback at the first long prompt."""
    context, canvas = lm.config.text.max_position_embeddings, lm.config.canvas_length
    taken = canvas_positions(max_new_tokens, canvas)
    if PROMPT_MAX + taken > context:
        fits = (context - PROMPT_MAX) // canvas * canvas
        fail(f"--max-new-tokens: prompts of up to {PROMPT_MAX} tokens + {max_new_tokens} new tokens in whole "
                 f"{canvas}-token canvases ({taken} positions) exceed {model}'s context of {context} tokens; "
                 f"at most {fits} fits")


def function_prompt(tok: Tokenizer, function: Function) -> list[int]:
    """A function's prompt ids: its source up to the `def` line, the last PROMPT_MAX tokens of it."""
    return tok.encode(function.prompt_text, add_bos=True)[-PROMPT_MAX:]


def completion_figures(lm: blockpress.LM, funcs: list[Function], engine: str, max_new_tokens: int, seed: int,
                       options: dict) -> tuple[dict, list[str]]:
    """Complete each function's body with `engine` ("diffusion": lm.generate, seeded seed + its index; "ar":
    lm.generate_ar) and `options`: (the figures the module docstring names, the completions' texts)."""
    ok, strict, new, passes, seconds, examples, texts = 0, 0, 0, 0, 0.0, [], []
    # a bar on stderr, as benchmarks/sudoku.py draws (a run of 100 functions takes minutes and printed nothing)
    for i, f in enumerate(progress(funcs, desc=f"{engine} completions", unit="function")):
        prompt = function_prompt(lm.tokenizer, f)
        t0 = time.perf_counter()
        if engine == "diffusion":
            out = lm.generate([prompt], max_new_tokens=max_new_tokens, seed=seed + i, **options)
        else:
            out = lm.generate_ar([prompt], max_new_tokens=max_new_tokens, **options)
        seconds += time.perf_counter() - t0
        text = out.texts[0]
        texts.append(text)
        good = completion_parses(f, text)
        ok += good
        strict += completion_parses_without_loops(f, text)
        new += int(out.num_new_tokens[0])
        passes += int(out.forward_passes[0])
        if len(examples) < 3:
            examples.append({"prompt_tail": f.prompt_text[-120:], "completion": text[:300], "parses": good})
    figures = {"parseable": ok / max(1, len(funcs)), "parseable_without_loops": strict / max(1, len(funcs)),
               "tokens_per_forward": new / max(1, passes), "tok_s": new / max(seconds, 1e-9), "examples": examples}
    return figures, texts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--model", type=checkpoint, default="blockpress-code", help="a shipped name or a folder")
    ap.add_argument("--manifest", default=None, help="corpus manifest.json listing held-out modules "
                    "(default: the one shipped with the model)")
    ap.add_argument("--functions", type=positive_int, default=100, help="held-out functions to complete")
    ap.add_argument("--infills", type=non_negative_int, default=100, help="single-line infills (0: skip them)")
    ap.add_argument("--space-infills", type=non_negative_int, default=100,
                    help="mid-line infills after a space, as typed and healed (0: skip them)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64, help="new tokens per completion")
    ap.add_argument("--seed", type=int, default=0, help="seeds the sampler and picks the infill lines (the split of "
                    "the held-out functions is fixed, disjoint from the tuning scripts' validation functions)")
    ap.add_argument("--threads", type=positive_int, default=2, help="CPU threads")
    ap.add_argument("--skip", type=non_negative_int, default=0,
                    help="start after this many functions of the shuffled list "
                    "(the test split is the first --functions; scripts/tune_code_sampler.py validates after it)")
    ap.add_argument("--healing-functions", type=non_negative_int, default=40,
                    help="functions for the trailing-newline / token-healing comparison (0: skip)")
    ap.add_argument("--sampler-options", type=sampler_options, default=None, help="JSON object of diffusion sampler settings "
                    "(default: the model's generation_config.json)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(args.model, dtype="float32")
    tok = lm.tokenizer
    exit_if_past_context(lm, args.max_new_tokens, args.model)
    heldout = model_heldout_functions(lm.path, args.manifest, SPLIT_SEED)
    if args.skip >= len(heldout):  # no function left: a ZeroDivisionError, or (--healing-functions 0) rates of 0.0
        fail(f"--skip: {args.skip} skips all {len(heldout)} held-out functions; at most {len(heldout) - 1} "
                 "leaves one")
    funcs = heldout[args.skip : args.skip + args.functions]
    options = args.sampler_options or {}
    ar_options = {k: v for k, v in options.items() if k in AR_OPTIONS}  # the same penalties for the AR baseline
    result: dict = {"benchmark": "code_model", "model": args.model, "functions": len(funcs),
                    "params": lm.num_parameters(active=False), "active_params": lm.num_parameters(active=True),
                    "sampler_options": options or "generation_config"}

    result["parseable_ceiling"] = budget_ceiling(tok, funcs, args.max_new_tokens)
    for engine in ("diffusion", "ar"):
        result[engine] = completion_figures(lm, funcs, engine, args.max_new_tokens, args.seed,
                                            options if engine == "diffusion" else ar_options)[0]

    if args.healing_functions:
        # The prompt as typed ends with the newline; healing lets the model merge it with the indentation.
        trailing: dict = {}
        for engine in ("diffusion", "ar"):
            for healing in (False, True):
                ok = 0
                for i, f in enumerate(progress(funcs[: args.healing_functions], unit="function",
                                           desc=f"{engine} trailing newline, {'healed' if healing else 'plain'}")):
                    prompt = tok.encode(f.prompt_text + "\n", add_bos=True)[-PROMPT_MAX:]
                    kw = dict(max_new_tokens=args.max_new_tokens, token_healing=healing)
                    out = (lm.generate([prompt], seed=args.seed + i, **kw, **options) if engine == "diffusion"
                           else lm.generate_ar([prompt], **kw, **ar_options))
                    ok += completion_parses(f, "\n" + out.texts[0])
                # over the functions used: fewer than asked when --functions is smaller
                trailing.setdefault(engine, {})["healed" if healing else "plain"] = ok / len(funcs[: args.healing_functions])
        result["trailing_newline"] = dict(functions=min(args.healing_functions, len(funcs)), **trailing)

    cases = infill_cases(funcs, tok, lm.config.canvas_length, args.infills, args.seed)
    hits_diff = hits_ar = 0
    for i, case in enumerate(progress(cases, desc="infills", unit="infill")):
        prompt = tok.encode(case.before, add_bos=True)[-PROMPT_MAX:]
        out = lm.infill([-1] * len(case.hole) + case.suffix, prompt=[prompt], seed=args.seed + i, **options)
        got = tok.decode(out.new_tokens[0, : len(case.hole)].tolist())
        hits_diff += fills_the_line(got, case.target)
        ar = lm.generate_ar([prompt], max_new_tokens=len(case.hole), **ar_options)
        hits_ar += fills_the_line(tok.decode(ar.new_tokens[0].tolist()).removeprefix("\n").split("\n")[0], case.target)
    result["infill_cases"] = len(cases)
    # null without cases (--infills 0): no rate was measured, and 0.0 would read as every infill missed
    result["diffusion"]["infill_exact"] = hits_diff / len(cases) if cases else None
    result["ar"]["infill_exact"] = hits_ar / len(cases) if cases else None

    spaced = space_infill_cases(funcs, tok, lm.config.canvas_length, args.space_infills, args.seed)
    if spaced:
        result["space_infill"] = {"cases": len(spaced)}
    for healing in (False, None) if spaced else ():  # None: infill's default, which heals a text template's holes
        exact = double = 0
        for i, case in enumerate(progress(spaced, desc=f"space infills, {'healed' if healing is None else 'as typed'}",
                                      unit="infill")):
            prompt = tok.encode(case.before, add_bos=True)[-PROMPT_MAX:]
            template = (escape_template("\n" + case.start, before_hole=True) + f"<|hole:{case.length}|>"
                        + escape_template(case.suffix))
            fill = lm.infill(template, prompt=[prompt], seed=args.seed + i, token_healing=healing, **options).fills[0][0]
            exact += fill == case.target
            double += fill[:1].isspace()
        result["space_infill"]["healed" if healing is None else "as_typed"] = {
            "exact": exact / len(spaced), "double_space": double / len(spaced)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
