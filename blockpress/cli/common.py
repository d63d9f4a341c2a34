"""What the commands share: the model loaded (load_model, load_announced: said on stderr, checked first), the flag
groups of loading, stepping and sampling, the sampling flags as the library's keywords, the stats line, and the
flags a library error is named by (as_flags)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import sys
import time
import warnings
from typing import Any

from blockpress.config import PREFILL_CHUNK, RANKINGS, SAMPLERS, SCHEMES

DEFAULT_MODEL = "blockpress-code"
RANDOM_PREFIX = "random-"


def load_model(spec: str, dtype: str | None, device: str, quantize: str | None = None,
               adapter: str | None = None, progress: Any = False) -> Any:
    """An HF folder, a shipped model name, a LoRA adapter folder (its base with it), or `random-<preset>` (random
    weights, byte-level tokenizer); `quantize`: "int8", "fp8" or "int4" (see blockpress.quantize), or "none"
    (an adapter folder's base unquantized); `adapter`: a LoRA folder for the model (blockpress.load's)."""
    import blockpress
    from blockpress.lm import NO_QUANTIZATION

    if spec.startswith(RANDOM_PREFIX):
        from blockpress.tokenizer import train_bpe_tokenizer

        if adapter is not None:
            raise ValueError(f"--adapter: --model {spec} has random weights, not the base an adapter was trained on")
        config = preset_config(spec[len(RANDOM_PREFIX):], f"--model {spec}")
        tokenizer = train_bpe_tokenizer([""], vocab_size=300)  # bytes + special tokens, no merges
        if tokenizer.vocab_size > config.text.vocab_size:
            raise ValueError(f"--model {spec}: vocabulary too small for a byte-level tokenizer")
        lm = blockpress.random_model(config, seed=0, dtype=dtype, device=device, tokenizer=tokenizer)
        return lm.quantize(quantize) if quantize and quantize != NO_QUANTIZATION else lm
    with warnings.catch_warnings():
        # vision tensors: text-only is the documented behaviour; every other load warning is the user's to see
        warnings.filterwarnings("ignore", message=r".*vision tensors ignored")
        return blockpress.load(spec, dtype=dtype, device=device, quantize=quantize, adapter=adapter, progress=progress)


def preset_config(name: str, flag: str) -> Any:
    """ModelConfig.preset, its error naming `flag`, the flag and value the user typed (the library's names its
    argument, `preset`)."""
    import blockpress

    try:
        return blockpress.ModelConfig.preset(name)
    except ValueError as exc:
        raise ValueError(as_flags(str(exc), {"preset": flag})) from None


def load_announced(args: argparse.Namespace, keep: str | None = None) -> Any:
    """load_model, saying so on stderr first: a large checkpoint takes tens of seconds that would look like a hang.
    `keep`: a line that stays (serve's log, naming where it will listen); otherwise the line is shown only on a
    terminal and erased once loaded, so it never mixes into the output or a script's stderr."""
    if args.prefill_chunk is not None and args.prefill_chunk <= 0:  # before the load, which can take a while
        raise ValueError(f"--prefill-chunk: expected a positive integer (tokens per pass), got {args.prefill_chunk}")
    check_cuda_graphs(args)
    # (quantize runs no matmul: its --dtype is the one the model is read and written in)
    slow = emulated_dtype_note(args.dtype, args.device) if getattr(args, "command", None) != "quantize" else None
    if slow is not None:
        print(slow, file=sys.stderr, flush=True)
    terminal = sys.stderr is not None and sys.stderr.isatty()
    if keep:
        print(keep, file=sys.stderr, flush=True)
    from blockpress.live import clip_to_row, display_width, terminal_columns  # (imports torch, as loads do)

    line = f"loading {args.model} ..."
    # Cut to one row: "\r" goes back to the start of a wrapped line's last row only, so each redraw on a terminal
    # narrower than the line (a split tmux pane) would leave a copy of its first rows behind, and so would the erasing.
    columns = terminal_columns(sys.stderr) if terminal else 0
    shown = [clip_to_row(line, columns)]  # every line shown, the widest erased at the end
    if terminal and not keep:
        print(shown[0], end="", file=sys.stderr, flush=True)
    started, last = time.perf_counter(), [0.0]

    def progress(done: int, total: int) -> None:
        """The share read, on the loading line: a 26B's 50 GB from a network disk take minutes without a sign of
        life. Only after a second (most loads end sooner) and at most 4 times a second."""
        now = time.perf_counter()
        if now - started < 1.0 or (now - last[0] < 0.25 and done < total) or total <= 0:
            return
        last[0] = now
        size = f"{total / 1e9:.1f} GB" if total >= 1e9 else f"{total / 1e6:.1f} MB"
        shown.append(clip_to_row(f"{line} {100 * done // total}% of {size}", columns))
        print("\r" + shown[-1], end="", file=sys.stderr, flush=True)

    try:
        lm = load_model(args.model, args.dtype, args.device, args.quantize, args.adapter,
                        progress=progress if terminal and not keep else False)
        if args.prefill_chunk is not None:
            lm.model.prefill_chunk = args.prefill_chunk
        # last: --quantize and --adapter are applied in the load, and the steps are made over the modules they leave
        if args.compile:
            lm.compile(**(serve_compile_options() if args.command == "serve" else {}))
        elif args.cuda_graphs:
            lm.cuda_graphs()  # an FP8 model whose GPU lacks the grouped GEMM is refused here, naming the flag
    finally:
        if terminal and not keep:  # the line erased, loaded or not: overwritten with spaces, which every terminal
            # takes; the escape "\x1b[K" shows as "^[[K" where TERM=dumb (Emacs' shell) and on a Windows console
            # without VT processing (conhost, cmd.exe) as "←[K"
            width = max(display_width(x) for x in shown)
            print("\r" + " " * width + "\r", end="", file=sys.stderr, flush=True)
    if args.compile and not keep:  # silent minutes otherwise, read as a hang (serve says it as it warms up)
        print("note: --compile: the first steps of each batch size and prompt length compile before they run "
              "(minutes on a CPU)", file=sys.stderr, flush=True)
    return lm


def load_text_model(args: argparse.Namespace, what: str) -> Any:
    """load_announced for a command that reads text: a model without a tokenizer refused, naming --model and the
    text it cannot take (`what`: "prompt", "template")."""
    lm = load_announced(args)
    if lm.tokenizer is None:
        raise ValueError(f"--model {args.model}: has no tokenizer.json, so it cannot take a text {what}")
    return lm


def emulated_dtype_note(dtype: str | None, device: str) -> str | None:
    """A line on stderr when --dtype asks for half precision that this CPU only emulates (checkpoint.native_dtype
    picks float32 there when no --dtype is given): measured about 30x slower matmuls on an AVX2 CPU, which a user
    would otherwise take for a hang. None when it computes natively or runs elsewhere."""
    import torch

    from blockpress.checkpoint import cpu_computes_natively

    if dtype not in ("bfloat16", "float16") or device.split(":")[0] != "cpu":  # a bad --device is load's to refuse
        return None
    if cpu_computes_natively(getattr(torch, dtype)):
        return None
    short, isa = ("bf16", "AVX512-BF16 / AMX") if dtype == "bfloat16" else ("fp16", "AVX512-FP16 / AMX")
    return (f"note: --dtype {dtype}: this CPU has no native {short} matmuls ({isa}), so they run emulated, many "
            f"times slower than float32 (the default here)")


QUANTIZE_HELP = ("quantize the projections while loading: int8 (weights; on a CPU a packed int8 kernel multiplies "
                 "bf16 rows, and a float32 model's passes of up to 128 rows in bf16; --dtype bfloat16 pays only with "
                 "native bf16 matmuls, AVX512-BF16 or AMX: elsewhere float32 is faster), fp8 (weights and activations, for GPUs with FP8 tensor "
                 "cores) or int4 (weights, groups of 32: for memory; on a CPU in bfloat16 or float32 torch's int4 "
                 "GEMM multiplies passes of up to 128 rows). Default: none (a folder saved "
                 "quantized: its own scheme, the only one it takes; an adapter folder given as --model: the "
                 "quantization it was trained over; none loads its base unquantized)")


def add_load_args(p: argparse.ArgumentParser, runs: bool = True) -> None:
    """What every command that loads a model applies to it as it loads: --quantize, --adapter, --prefill-chunk
    (`runs=False`, info: nothing is encoded, so no --prefill-chunk)."""
    p.add_argument("--quantize", choices=[*SCHEMES, "none"], default=None, help=QUANTIZE_HELP)
    p.add_argument("--adapter", default=None, metavar="FOLDER",
                   help="a LoRA adapter folder (PEFT's format: `blockpress train --lora-rank`'s OUT/adapter) to apply "
                        "over --model: merged in float32, or with --quantize kept unmerged over the quantized base. "
                        "An adapter folder may also be given as --model itself: it loads the base it was trained on")
    if runs:
        p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                       help="prompt tokens encoded per pass: a long prompt's attention masks take N x its length, not "
                            f"its length squared; the result is the same (default: {PREFILL_CHUNK})")
        add_step_args(p)


COMPILE_HELP = ("run each decoding step (the decoder pass, the sampler step, an AR token's encoder pass) through "
                "torch.compile (lm.compile()). The first steps compile, and so do the first of a new batch size or "
                "prompt length: minutes on a CPU, even for a tiny model. It pays for long runs where per-op overhead "
                "dominates (bf16 on a CPU, small batches on a GPU), not for one short answer")
GRAPHS_HELP = ("replay each decoder pass (and an AR token's encoder pass) from a CUDA graph, captured once a "
               "canvas: a small batch's pass on a GPU spends most of its time launching kernels from Python, "
               "which a replay skips. Needs --device cuda and bfloat16 weights (--dtype bfloat16 unless the checkpoint "
               "stores bf16): refused at once otherwise")
SERVE_WARM_UP = ("; serve runs a few short generations with it before it answers (a line on stderr says so), so the "
                 "first clients do not wait for them")


def add_step_args(p: argparse.ArgumentParser) -> None:
    """--compile and --cuda-graphs: one or the other (lm.cuda_graphs() replaces the compiled steps, and a graph
    replays the eager pass), so argparse refuses both together."""
    warm = SERVE_WARM_UP if p.prog.endswith(" serve") else ""
    graphs = GRAPHS_HELP
    if p.get_default("dtype") is not None:  # (sudoku's: float32 unless told, whatever the checkpoint stores)
        graphs = graphs.replace(" unless the checkpoint stores bf16", f": this command loads {p.get_default('dtype')} "
                                                                      "unless told, whatever the checkpoint stores")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compile", action="store_true", help=f"{COMPILE_HELP}{warm}. Not with --cuda-graphs")
    g.add_argument("--cuda-graphs", action="store_true", help=f"{graphs}{warm}. Not with --compile")


def serve_compile_options() -> dict[str, Any]:
    """torch.compile's options for serve, whose batches and prompts never settle: every size dynamic from the
    start (each kind of batch still takes graphs of its own, within lm.compile's recompile limit: generate.py's
    RECOMPILE_LIMIT)."""
    return {"dynamic": True}


def check_cuda_graphs(args: argparse.Namespace) -> None:
    """--cuda-graphs where they cannot replay (a CPU, weights other than bf16) refused before the model loads, as
    lm.cuda_graphs() would refuse it after: a 26B checkpoint takes minutes to load. The dtype is the one the load
    would pick: --dtype, else random weights' float32, else the checkpoint's (its plan reads headers, no data)."""
    if not getattr(args, "cuda_graphs", False):
        return
    import torch

    from blockpress.lm import _graphs_refusal

    try:
        device = torch.device(args.device)
    except RuntimeError:  # not a device at all: the load's to refuse, naming --device
        return
    if device.type != "cuda" or args.dtype is not None:  # (off CUDA the device is the refusal, whatever the dtype)
        dtype = getattr(torch, args.dtype or "float32")
    elif args.model.startswith(RANDOM_PREFIX):
        dtype = torch.float32  # random_model's when no --dtype is given
    else:
        from blockpress.checkpoint import plan_model
        from blockpress.lm import resolve_model

        path, _, quantize = resolve_model(args.model, args.quantize, args.adapter)
        dtype = plan_model(path, None, device, quantize, weights=False).dtype
    why = _graphs_refusal(device, dtype)
    if why is not None:
        raise ValueError(f"--cuda-graphs: {why}; run with --device cuda --dtype bfloat16, or without --cuda-graphs")
    from blockpress import lm

    if lm.GROUPED_MM is None:  # as lm.cuda_graphs() refuses it, after the load
        raise ValueError(f"--cuda-graphs: torch {torch.__version__} has no grouped GEMM (torch._grouped_mm, from torch "
                         "2.8 on), which the experts need in a graph; use a newer torch, or run without --cuda-graphs")


DEVICE_HELP = "torch device: auto (a CUDA GPU where torch sees one, else the CPU), cpu, cuda, cuda:N or mps"


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """--threads, for the commands that run a model (run_command sets torch's threads from it)."""
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (default: 0, torch's choice; 1 can be faster on a busy machine)")


def add_model_args(p: argparse.ArgumentParser, device_help: str = DEVICE_HELP + " (default: auto)",
                   runs: bool = True) -> None:
    """--model and how it loads. `runs=False` (info, which counts a model and runs nothing): no flag that only
    running it reads (--threads, --prefill-chunk), since one given there would be silently ignored."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"shipped model name, Hugging Face checkpoint folder, a repo id already in the Hugging Face "
                        f"cache (owner/name[@revision]), a LoRA adapter folder (OUT/adapter of `blockpress train "
                        f"--lora-rank`: its base with it, quantized as it was trained), or "
                        f"random-<tiny|small|medium|26b-a4b> (random weights of that shape, for quick checks; `blockpress bench "
                        f"--preset` times them). Default: {DEFAULT_MODEL}")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights dtype (default: the checkpoint's; bf16/fp16 weights load as float32 on a CPU "
                        "without native half-precision matmuls)")
    p.add_argument("--device", default="auto", help=device_help)
    if runs:
        add_threads_arg(p)
    add_load_args(p, runs)


CONFIDENCE_HELP = ("read by the confidence sampler: each step accepts the positions whose most likely token has at "
                   "least this probability, in (0, 1] (refused with another sampler)")


def add_sampling_args(p: argparse.ArgumentParser, lengths: bool = True, stop: bool = True) -> None:
    """`lengths=False` (infill: the template sets the length) hides the length flags; given anyway, they get an
    error that says how to size the holes instead of argparse's "unrecognized arguments". `stop=False`: the
    command has no --stop, so the help does not name it."""
    # (said in the description, which argparse wraps to the terminal's width; a group's title is one line)
    g = p.add_argument_group("sampling", "defaults: the checkpoint's generation_config.json, and "
                             "blockpress_generation_config.json over it; run `blockpress info --model M` to see them")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"new tokens to generate (at most: EOS{' or --stop' if stop else ''} may end sooner)"
                   if lengths else argparse.SUPPRESS)
    g.add_argument("--min-new-tokens", type=int, default=0,
                   help="no end-of-sequence before this many tokens (without --max-new-tokens, a default length "
                        "below it grows to it)" if lengths else argparse.SUPPRESS)
    # (also under the library's and generation_config.json's name, which users carry over from the Python API)
    g.add_argument("--steps", "--max-denoising-steps", dest="steps", type=int, default=None, action=TypedFlag,
                   help="max denoising steps per canvas")
    g.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="acceptance rule: entropy_bound (the reference's), confidence, topk, greedy")
    g.add_argument("--entropy-bound", type=float, default=None,
                   help="read by the entropy_bound and greedy samplers: each step accepts the most certain positions "
                        "while their entropies add up to at most this (refused with another sampler)")
    g.add_argument("--confidence", type=float, default=None, help=CONFIDENCE_HELP)
    g.add_argument("--rank-by", choices=RANKINGS, default=None,
                   help="the order positions are accepted in (topk, entropy_bound, greedy): lowest entropy first, "
                        "widest gap between the two most likely tokens first, or left to right")
    g.add_argument("--presence-penalty", type=float, default=None,
                   help="OpenAI's: lower a token's logit once it appears in the new text (-2 to 2)")
    g.add_argument("--frequency-penalty", type=float, default=None,
                   help="OpenAI's: lower a token's logit for each time it appears in the new text (-2 to 2)")
    g.add_argument("--top-k", type=int, default=None,
                   help="draw each candidate token from the k most likely only (0: all); refused where nothing is "
                        "drawn (a greedy sampler, --temperature 0, --ar without --temperature)")
    g.add_argument("--top-p", type=float, default=None,
                   help="draw each candidate token from the nucleus: the fewest most likely tokens holding this "
                        "probability (1: all); refused where nothing is drawn, as --top-k is")
    g.add_argument("--t-max", type=float, default=None,
                   help="temperature at the first step (of the candidate draws and of acceptance alike)")
    g.add_argument("--t-min", type=float, default=None,
                   help="the schedule's low end: the temperature falls linearly from --t-max at the first step to "
                        "--t-min + (--t-max - --t-min) / --steps at the last, as the reference's does (of the "
                        "candidate draws and of acceptance alike)")
    g.add_argument("--temperature", type=float, default=None,
                   help="OpenAI's temperature (the library's draw_temperature): candidates are drawn at the "
                        "schedule's temperature (--t-max down to --t-min) times this, while acceptance keeps the "
                        "schedule; 0: the most likely candidates, under the sampler's own acceptance rule (--sampler, "
                        "else the model's default). A model that decodes greedily by default (blockpress-code) samples "
                        "when given one above 0; with --sampler greedy only 0 is taken")
    g.add_argument("--seed", type=int, default=None,
                   help="make the run reproducible (default: a fresh seed each run; greedy decoding, and "
                        "--temperature 0, start from seed 0 and repeat anyway)")


def template_kwargs_arg(text: str) -> dict[str, Any]:
    """--chat-template-kwargs' JSON object of chat-template variables, checked as a server request's are (names,
    reserved ones): refused while the arguments are parsed, before a model loads."""
    from blockpress.files import parse_json
    from blockpress.tokenizer import template_variables

    text = utf8_argument(text)  # (read here, as argparse parses: run_command's utf8_arguments comes after)
    try:
        value = parse_json(text)  # nested past the recursion limit: this error, not a traceback
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"enable_thinking\": true}}' ({exc})") \
            from None
    try:
        return template_variables(value, "--chat-template-kwargs")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--chat-template-kwargs: ")) from None


def add_template_kwargs_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--chat-template-kwargs", type=template_kwargs_arg, default={}, metavar="JSON",
                   help=f"variables for the chat template{what}, as a JSON object: '{{\"enable_thinking\": true}}' turns "
                        "a Gemma 4 template's thinking on (the name vLLM's requests give them); a template that never "
                        "reads one ignores it")


def add_token_healing_arg(p: argparse.ArgumentParser, what: str, note: str) -> None:
    """--no-token-healing, for `what` the command heals (generate: the prompt's end; infill: the holes' edges)."""
    p.add_argument("--no-token-healing", action="store_true", default=None,  # None: not given (generate: the model's)
                   help=f"keep {what} as typed (by default the model may re-choose it when it is whitespace and a "
                        f"longer token could have merged there; {note})")


def sampling_kwargs(args: argparse.Namespace, lm: Any) -> dict[str, Any]:
    """The sampling flags as `lm.generate` keywords. With --temperature, the whole SamplerConfig, built as the
    server builds a request's: the flags over `lm`'s settings, then SamplerConfig.with_temperature (which may
    change the sampler: a flag is checked against the sampler asked for, not the one the temperature picks)."""
    kw = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, seed=args.seed)
    settings = dict(max_denoising_steps=args.steps, sampler=args.sampler, entropy_bound=args.entropy_bound,
                    confidence=args.confidence, t_max=args.t_max, t_min=args.t_min, rank_by=args.rank_by,
                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                    top_k=args.top_k, top_p=args.top_p)
    if args.temperature is None:
        cfg = lm.sampler_defaults.with_(**settings)
        check_draw_filters(args, cfg.argmax_candidates, "--sampler greedy" if args.sampler == "greedy" else
                           "this model's default sampler (greedy)" if cfg.sampler == "greedy" else
                           "this model's default candidates (argmax)",
                           "leave out --sampler greedy and give --temperature above 0" if args.sampler == "greedy"
                           else "give --temperature above 0")
        return {**kw, **settings}
    if args.sampler == "greedy" and args.temperature != 0:
        # The server keeps greedy then (clients send a temperature by habit); a flag typed on purpose that changes
        # nothing is refused, as the library refuses draw_temperature with greedy.
        raise ValueError(f"--temperature {args.temperature}: --sampler greedy takes the most likely candidates and "
                         "draws none, so it would be ignored; leave out --sampler greedy to draw them at this "
                         "temperature, or give --temperature 0")
    cfg = lm.sampler_defaults.with_(**settings).with_temperature(args.temperature,
                                                                 sampler_given=args.sampler is not None)
    check_draw_filters(args, cfg.argmax_candidates, f"--temperature {args.temperature}", "give one above 0")
    return {**kw, "sampler": cfg}


def default_budget(lm: Any, prompt_length: int, least: int) -> int:
    """The new tokens of a run that gives no --max-new-tokens, counted ahead of the call (a batch's per-row budgets,
    chat's room check): the checkpoint's default for a `prompt_length`-token prompt, grown to a --min-new-tokens
    `least` past it, as the library grows it when given no max_new_tokens (lm._budgets), and a checkpoint's
    max_length that leaves no room then leaves the minimum. Not the default alone: passed on as max_new_tokens, a
    --min-new-tokens 80 was refused naming a "max_new_tokens=64" never given."""
    return max(lm.default_new_tokens(prompt_length, room_needed=least <= 0), least)


def check_draw_filters(args: argparse.Namespace, argmax: bool, why: str, fix: str) -> None:
    """--top-k / --top-p typed where the candidates are the most likely tokens (`argmax`, because of `why`): nothing is
    drawn for them to filter, so the run would ignore them without a word (as --temperature with --sampler greedy
    is refused). `fix`: how to draw."""
    for flag, value, idle, legal in (("--top-k", args.top_k, 0, lambda k: k > 0),
                                     ("--top-p", args.top_p, 1.0, lambda p: 0 < p < 1)):
        # (a value out of its range is left to the range check, which says what the flag takes)
        if argmax and value is not None and value != idle and legal(value):
            raise ValueError(f"{flag} {value}: {why} takes the most likely tokens and draws none, so {flag} would "
                             f"be ignored; {fix} to draw them")


def decoded(texts: list[str] | None, what: str) -> list[str]:
    """A run's texts (Commit.texts_so_far, GenerationOutput.texts, ...), which every run of a model with a tokenizer
    has: the commands that print text refuse a model without one before they run it."""
    if texts is None:
        raise ValueError(f"{what}: no text, as the model has no tokenizer")
    return texts


def stats_line(out: Any, seconds: float) -> dict[str, Any]:
    return stats_of(int(out.num_new_tokens.sum()), int(out.forward_passes.max()), float(out.tokens_per_forward.mean()),
                    seconds)


def stats_of(new_tokens: int, passes: int, tokens_per_forward: float, seconds: float) -> dict[str, Any]:
    """The stats line's figures, from a finished output's counts (stats_line) or from those seen so far."""
    return dict(new_tokens=new_tokens, forward_passes=passes, tokens_per_forward=round(tokens_per_forward, 3),
                tok_s=round(new_tokens / seconds, 2) if seconds > 0 else None, seconds=round(seconds, 3))


def printable(text: str) -> str:
    """Model output for stdout: on a terminal, its control characters drawn as U+FFFD (live.terminal_text); piped,
    the text as the model wrote it."""
    from blockpress.live import terminal_text

    return terminal_text(text) if sys.stdout is not None and sys.stdout.isatty() else text


def print_stats(stats: dict[str, Any], own_line: bool = False) -> None:
    """The stats line on stderr, after an empty line unless `own_line` (the output before it ended its line). The
    text before it is flushed first: a standard output that cannot be written (`> /dev/full`, `>&-`) then fails
    here, said in one line, where otherwise the stats line would come first, as if the text had been written."""
    if sys.stdout is not None:
        sys.stdout.flush()
    made = (f"{stats['filled_tokens']} filled of {stats['template_tokens']} template tokens" if "filled_tokens" in stats
            else f"{stats['new_tokens']} new tokens")
    lead = "" if own_line else "\n"
    print(f"{lead}[{made} · {stats['forward_passes']} forward passes · "
          f"{stats['tokens_per_forward']} tokens/forward · {stats['tok_s']} tok/s]", file=sys.stderr)


# Library checks name their arguments; the user typed flags: their errors say which flag to change. A command's
# options stand for the settings of their own names (argparse's dest: --max-new-tokens for max_new_tokens);
# FLAG_OF adds, per command, the library's names for settings its flags name otherwise. Per command, since
# commands differ: the library's max_new_tokens is generate's --max-new-tokens but bench's --new-tokens (one
# global map named --max-new-tokens to bench users, who cannot type it).
FLAG_OF: dict[str, dict[str, str]] = {
    **{command: {"max_denoising_steps": "--steps"} for command in ("generate", "chat", "sudoku")},
    "infill": {"max_denoising_steps": "--steps", "prompt": "--prefix"},  # --prefix is the library's prompt
    "bench": {"max_denoising_steps": "--steps", "max_new_tokens": "--new-tokens", "prompt": "--prompt-length"},
}


class TypedFlag(argparse.Action):
    """A flag of several names (--steps, --max-denoising-steps), stored as argparse stores one, that also records
    the name typed (args.typed_flags: each of its names to that one), so an error names the flag the user wrote,
    not '--steps: expected ...' for a --max-denoising-steps on a command line that holds no --steps."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        if option_string is not None:  # (an abbreviation comes as the full name: --max-den, --max-denoising-steps)
            typed = {**getattr(namespace, "typed_flags", {}), **{name: option_string for name in self.option_strings}}
            namespace.typed_flags = typed


# The flags that name a file or folder to read or write (each command's that has it: generate's and infill's --input
# and --output, sudoku's --file, train's --data, --heldout-data, --train-config and --out, bench's --out and --plot)
PATH_FLAGS = ("input", "output", "file", "data", "heldout_data", "train_config", "out", "plot", "config", "tokenizer")


# The arguments that are text, for the model or the server, not paths (a path's bytes must reach the file system as
# they came). --chat-template-kwargs is read as argparse parses it (template_kwargs_arg), before these.
TEXT_ARGUMENTS = ("prompt", "template", "prefix", "system", "stop", "puzzles", "served_name", "root_path", "api_key")


def utf8_argument(value: str) -> str:
    """A text argument as the UTF-8 it was typed in. Under a locale that is not UTF-8 (an ASCII one with UTF-8 mode
    off) Python decodes argv with the locale's codec, and the bytes it cannot read arrive as surrogates: 'grüße' was
    refused as "not valid UTF-8 (byte 0xc3 ...)", where the same bytes piped in are read as UTF-8 (utf8_stdio). They
    are read so here too, by their bytes (os.fsencode undoes the locale's decoding); bytes that are not UTF-8 stay
    surrogates, for the check to name."""
    if not any("\udc80" <= ch <= "\udcff" for ch in value):
        return value
    try:
        return os.fsencode(value).decode("utf-8")
    except UnicodeError:
        return value


def utf8_arguments(args: argparse.Namespace) -> None:
    """Each text argument of `args` (TEXT_ARGUMENTS; --stop and sudoku's puzzles are lists) as utf8_argument reads it."""
    for name in TEXT_ARGUMENTS:
        value = getattr(args, name, None)
        if isinstance(value, str):
            setattr(args, name, utf8_argument(value))
        elif isinstance(value, list):
            setattr(args, name, [utf8_argument(v) if isinstance(v, str) else v for v in value])


def expand_path_flags(args: argparse.Namespace) -> None:
    """Each path flag of `args` that starts with ~ or ~user, expanded as a shell would (files.expand_user, its
    refusal of a ~user with no home naming the flag): a shell leaves a ~ after `=` as it is (`--input=~/in.jsonl`),
    as Windows' cmd.exe and PowerShell leave it in any argument to a program, so the file would be looked for in a
    folder named ~ ("--input ~/in.jsonl: No such file or directory"), where --model and train's --out expand it."""
    from blockpress.files import expand_user

    for name in PATH_FLAGS:
        value = getattr(args, name, None)
        # (quantize's folder is its argument OUT, not a flag)
        flag = "OUT" if (name, getattr(args, "command", None)) == ("out", "quantize") else \
            typed_flag(args, "--" + name.replace("_", "-"))
        # an unset variable in a script (`--out "$OUT"`): bench would write nothing and say nothing (train's and
        # quantize's folders have refusals of their own, which say what the folder is for)
        if value == "" and (name, getattr(args, "command", None)) not in (("out", "train"), ("out", "quantize")):
            raise ValueError(f"{flag}: an empty path; give a file or folder name")
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, str(expand_user(value, flag)))


def check_file_path(flag: str, value: str) -> None:
    """A flag's path to write a file at, refused where it ends with a path separator: pathlib drops a trailing one,
    so `--output results/` would write a file named results where the folder results/ is meant (and is not
    there)."""
    if value.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {value}: ends with {value[-1]}, as a folder's path does; give a file (a name "
                         "after the folder)")


def typed_flag(args: argparse.Namespace, flag: str) -> str:
    """`flag` as the user typed it: another of its names where a TypedFlag recorded one, else itself."""
    typed: dict[str, str] = getattr(args, "typed_flags", {})
    return typed.get(flag, flag)


def command_flags(args: argparse.Namespace) -> dict[str, str]:
    """flags_of(args.command), each flag under the name the user typed it by (typed_flag). Without --adapter, an
    adapter the library names is the folder given as --model (its base loads with it), so none is named --adapter."""
    flags = {name: typed_flag(args, flag) for name, flag in flags_of(args.command).items()}
    if getattr(args, "adapter", None) is None:
        flags.pop("adapter", None)
    return flags


def flags_of(command: str) -> dict[str, str]:
    """`command`'s settings by name, as the flags that set them: its options' own names, and FLAG_OF's."""
    from blockpress.cli.parser import build_parser  # (parser.py imports this module)

    parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    own = {a.dest: max(a.option_strings, key=len) for a in parser._actions
           if a.option_strings and a.dest != argparse.SUPPRESS and a.dest != "help"}
    return {**own, **FLAG_OF.get(command, {})}


def train_flag_of() -> dict[str, str]:
    """`train`'s settings by name: each TrainConfig field is the flag of the same name, and --device."""
    from dataclasses import fields

    from blockpress.train_config import TrainConfig

    # and --device, train's own flag: the load's "device: 'mps' asked for, but MPS is not available here" named no flag
    return {**{f.name: "--" + f.name.replace("_", "-") for f in fields(TrainConfig)}, "device": "--device"}


def as_flags(message: str, flag_of: dict[str, str]) -> str:
    """`message` with the setting it starts with ("max_new_tokens: ...", "model 'nope': ...") named as the flag
    `flag_of` maps it to, and so where it suggests a value for one of them ("...; prompt_max 56 fits": "--prompt-max 56")."""
    # A check that names the value too ("model 'nope': not a checkpoint folder ..."): the flag, then the value as a
    # shell takes it ("--model nope: ..."), as the commands' own checks name both (a value that is not printable
    # keeps its Python quotes and escapes)
    valued = re.match(r"""(\w+) ('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"):""", message)
    if valued and valued[1] in flag_of:
        value = ast.literal_eval(valued[2])
        shown = shlex.quote(value) if value.isprintable() else valued[2]
        return f"{flag_of[valued[1]]} {shown}{message[valued.end() - 1:]}"
    name, sep, rest = message.partition(":")
    names = name.split("/")  # a check of two settings together names both: "prompt_min/prompt_max: ..."
    if not (sep and all(n in flag_of for n in names)):
        return message
    for n in names:
        rest = re.sub(rf"(?<![\w-]){re.escape(n)} (?=[0-9])", f"{flag_of[n]} ", rest)
    return "/".join(flag_of[n] for n in names) + sep + rest
