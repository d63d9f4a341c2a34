"""The `blockpress` command line: generate, infill, chat, info, quantize."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import io
import ipaddress
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Generator, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, TypeVar, overload

import blockpress
from blockpress.checks import check_text, compile_failure, utf8_problem

# Torch and the modules that import it are imported by the commands that run a model, not here: importing torch
# takes seconds, and building the parser (--help, a mistyped flag) needs none of it. The names the help shows
# come from torch-free modules (config, train_config).
from blockpress.config import PREFILL_CHUNK, RANKINGS, SCHEMES
from blockpress.files import parse_json
from blockpress.stopping import Stopped, fresh_line, stop_signals_interrupt, stop_status, stop_word

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
    """load_model, saying so on stderr first: a large checkpoint takes tens of seconds that looked like a hang.
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
    # narrower than the line (a split tmux pane) left a copy of its first rows behind, and so did the erasing.
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
            # takes; the escape "\x1b[K" showed as "^[[K" where TERM=dumb (Emacs' shell) and on a Windows console
            # without VT processing (conhost, cmd.exe) as "←[K"
            width = max(display_width(x) for x in shown)
            print("\r" + " " * width + "\r", end="", file=sys.stderr, flush=True)
    if args.compile and not keep:  # silent minutes otherwise, read as a hang (serve says it as it warms up)
        print("note: --compile: the first steps of each batch size and prompt length compile before they run "
              "(minutes on a CPU)", file=sys.stderr, flush=True)
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


QUANTIZE_HELP = ("quantize the projections while loading: int8 (weights; on a CPU, --dtype bfloat16 runs a packed "
                 "int8 kernel, which pays only with native bf16 matmuls, AVX512-BF16 or AMX: elsewhere bf16's other "
                 "ops take scalar fallbacks and float32 is faster), fp8 (weights and activations, for GPUs with FP8 "
                 "tensor cores) or int4 (weights, groups of 32: for memory, not speed). Default: none (a folder saved "
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
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compile", action="store_true", help=f"{COMPILE_HELP}{warm}. Not with --cuda-graphs")
    g.add_argument("--cuda-graphs", action="store_true", help=f"{GRAPHS_HELP}{warm}. Not with --compile")


OPENMP_SPINS = 10_000  # GOMP_SPINCOUNT for every command's torch (see run_command)
SERVE_RECOMPILE_LIMIT = 32  # graphs a compiled step may hold in `serve --compile` (torch's default: 8)


def serve_compile_options() -> dict[str, Any]:
    """torch.compile's options for serve, whose batches and prompts never settle: every size dynamic from the
    start, and room for more graphs a step. Each kind of batch (one row or several, padded or not, a canvas's first
    step or a later one, inductor's cache-length ranges) is a graph of its own: on random-tiny the decoder pass held
    torch's limit of 8 after the warm-up, and the next kind (n=3) ran eagerly from then on. The limit is torch.compile's
    own argument (torch 2.13; older ones keep 8): dynamo's config is per thread, and the engine thread runs the steps."""
    import inspect

    import torch

    options: dict[str, Any] = {"dynamic": True}
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        options["recompile_limit"] = SERVE_RECOMPILE_LIMIT
    return options


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
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json, and "
                             "blockpress_generation_config.json over it; run `blockpress info --model M` to see them)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"new tokens to generate (at most: EOS{' or --stop' if stop else ''} may end sooner)"
                   if lengths else argparse.SUPPRESS)
    g.add_argument("--min-new-tokens", type=int, default=0,
                   help="no end-of-sequence before this many tokens" if lengths else argparse.SUPPRESS)
    # (also under the library's and generation_config.json's name, which users carry over from the Python API)
    g.add_argument("--steps", "--max-denoising-steps", dest="steps", type=int, default=None,
                   help="max denoising steps per canvas")
    g.add_argument("--sampler", choices=["entropy_bound", "confidence", "topk", "greedy"], default=None,
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
                   help="draw each candidate token from the k most likely only (0: all)")
    g.add_argument("--top-p", type=float, default=None,
                   help="draw each candidate token from the nucleus: the fewest most likely tokens holding this "
                        "probability (1: all)")
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
    from blockpress.tokenizer import template_variables

    try:
        value = json.loads(text)
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
        return {**kw, **settings}
    if args.sampler == "greedy" and args.temperature != 0:
        # The server keeps greedy then (clients send a temperature by habit); a flag typed on purpose that changes
        # nothing is refused, as the library refuses draw_temperature with greedy.
        raise ValueError(f"--temperature {args.temperature}: --sampler greedy takes the most likely candidates and "
                         "draws none, so it would be ignored; leave out --sampler greedy to draw them at this "
                         "temperature, or give --temperature 0")
    cfg = lm.sampler_defaults.with_(**settings).with_temperature(args.temperature,
                                                                 sampler_given=args.sampler is not None)
    return {**kw, "sampler": cfg}


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


def print_stats(stats: dict[str, Any]) -> None:
    made = (f"{stats['filled_tokens']} filled of {stats['template_tokens']} template tokens" if "filled_tokens" in stats
            else f"{stats['new_tokens']} new tokens")
    print(f"\n[{made} · {stats['forward_passes']} forward passes · "
          f"{stats['tokens_per_forward']} tokens/forward · {stats['tok_s']} tok/s]", file=sys.stderr)


def from_file(args: argparse.Namespace, given: str | None, name: str, what: str) -> bool:
    """Whether the command runs --input FILE (a JSONL file of `what`) rather than its one `name` argument (`given`):
    one of them, and --input's companion flags only with it."""
    if (given is None) == (args.input is None):
        raise ValueError(f"{name}: give {name.upper()} (one text) or --input FILE (a JSONL file of {what}), "
                         f"{'not both' if args.input is not None else 'got neither'}")
    if args.input is None and (args.output, args.overwrite, args.resume) != (None, False, False):
        flag = "--output" if args.output is not None else "--overwrite" if args.overwrite else "--resume"
        raise ValueError(f"{flag}: goes with --input FILE (one {name.upper()}'s result is printed)")
    return args.input is not None


def healing_wanted(lm: Any, args: argparse.Namespace) -> bool:
    """Whether generate heals a plain prompt's last token: --token-healing / --no-token-healing where given, else
    the model's generation settings (a model fine-tuned on prompts ending in whitespace learned to follow that lone
    token: its training run wrote token_healing false), else yes."""
    if args.no_token_healing is None:
        return bool(lm.generation_config.get("token_healing", True))
    return not args.no_token_healing


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
    lm = load_announced(args)
    if lm.tokenizer is None:
        raise ValueError(f"--model {args.model}: has no tokenizer.json, so it cannot take a text prompt")
    if args.chat:
        check_chat_template(lm, args, "--chat (drop it to continue the prompt as plain text)")
    if args.prompt == "-":  # as infill's template
        args.prompt = sys.stdin.read()
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
        print_stats(stats)
    return 0


# The flags of block diffusion's acceptance rule and schedule: generate_ar has neither, so --ar refuses them by
# name rather than run without them (its draws take --temperature, --top-k, --top-p and the penalties).
DIFFUSION_ONLY_FLAGS = ("steps", "sampler", "entropy_bound", "confidence", "rank_by", "t_max", "t_min")


def check_ar_flags(args: argparse.Namespace) -> None:
    given = ["--" + name.replace("_", "-") for name in DIFFUSION_ONLY_FLAGS if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{given[0]}: --ar decodes one token at a time, with no denoising steps, acceptance rule or "
                         "temperature schedule; drop it (--temperature, --top-k, --top-p and the penalties shape "
                         "AR's draws)")


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
        # says so, as infill's does (--json: one object that says it was cut short; it exited 130 with nothing at
        # all, so a script reading the object got none)
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
    from blockpress.batchfile import GENERATE, read_input
    from blockpress.generate import encode_texts
    from blockpress.healing import heal

    if args.ar:
        check_ar_flags(args)
    output = check_file_flags(args, GENERATE)
    name, rows = read_input(args.input, GENERATE)  # every line checked before the model loads
    chats = [args.chat or row.messages is not None for row in rows]
    if not any(chats):
        for flag, value in (("--system", args.system), ("--chat-template-kwargs", args.chat_template_kwargs)):
            if value:
                raise ValueError(f"{flag}: no line of {name} is a chat (give --chat, or \"messages\" lines), so "
                                 "the chat template renders none")
    if any(chats) and args.no_token_healing is False:
        raise ValueError("--token-healing: not with chat lines, whose prompt ends with the chat template's turn "
                         "header (the template's own, never healed)")
    lm = load_announced(args)
    if lm.tokenizer is None:
        raise ValueError(f"--model {args.model}: has no tokenizer.json, so it cannot take a text prompt")
    if any(chats):
        check_chat_template(lm, args, "a chat line (--chat, or \"messages\")")
    kw = {k: v for k, v in sampling_kwargs(args, lm).items() if k not in ("max_new_tokens", "seed")}
    wanted = healing_wanted(lm, args)
    if not args.ar:  # the flags alone, on a one-token prompt: their errors name the flag, not a line
        lm.stream("x", max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop, **kw)
    ready: dict[int, FileRow] = {}
    for row, chat in zip(rows, chats, strict=True):
        where = f"{name}:{row.line}"
        try:
            if chat:
                given = row.messages if row.messages is not None else [{"role": "user", "content": row.prompt}]
                if args.system is not None and any(isinstance(m, dict) and m.get("role") == "system" for m in given):
                    raise ValueError("messages: has a system message, and --system gives one too; drop one")
                ids = lm.chat_prompt([*system_turn(args), *given], **args.chat_template_kwargs)
            else:
                ids = encode_texts([row.prompt or ""], lm.tokenizer)[0]  # (a line without messages has a prompt)
            healing = wanted and not chat
            budget = row.max_new_tokens or args.max_new_tokens
            if budget is None:  # the checkpoint's default, as the run alone counts it: after the prompt (healed)
                budget = lm.default_new_tokens(len(heal(lm.tokenizer, ids).ids) if healing else len(ids))
            seed = row.seed if row.seed is not None else args.seed
            if args.ar:  # (generate_ar runs as it checks: only the context is checked here)
                context = lm.config.text.max_position_embeddings
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
                **({"prompt": row.prompt} if row.prompt is not None else {}), new_tokens=int(out.num_new_tokens[i]),
                forward_passes=int(out.forward_passes[i]),
                tokens_per_forward=round(float(out.tokens_per_forward[i]), 3), seed=out.extra["seeds"][i]))
        return lines

    return run_file(args, output, rows, GENERATE, run_batch, "generate", {r: len(ready[r].ids) for r in ready},
                    {r: (ready[r].chat, ready[r].seed is None) for r in ready})


def check_file_flags(args: argparse.Namespace, kind: Any) -> Path | None:
    """--input's companion flags (--batch-size, --output, --overwrite, --resume), checked before anything loads;
    the --output path, if one is given."""
    from blockpress.batchfile import check_output

    if args.batch_size < 1:
        raise ValueError(f"--batch-size: expected a positive integer (rows per call), got {args.batch_size}")
    if args.output is None and (args.overwrite or args.resume):
        raise ValueError(f"{'--overwrite' if args.overwrite else '--resume'}: goes with --output FILE (standard "
                         "output is written as it goes)")
    if args.overwrite and args.resume:
        raise ValueError("--resume: not with --overwrite (which starts the output again); give one")
    output = Path(args.output) if args.output is not None else None
    if output is not None:
        check_output(output, args.input, kind)
    if output is not None and output.exists() and not (args.overwrite or args.resume):
        raise ValueError(f"--output {output}: exists; give --overwrite to replace it, or --resume to continue it")
    return output


def run_file(args: argparse.Namespace, output: Path | None, rows: list[Any], kind: Any,
             run_batch: Callable[[list[Any]], list[dict[str, Any]]], command: str, length: dict[int, int],
             group: dict[int, tuple[Any, ...]]) -> int:
    """An --input run's rows (every one checked) to --output or stdout: the lines an --output already holds skipped
    (--resume), the rest in batches (batchfile.batches: by `length`, never mixing a `group`) through
    `run_batch`, which gives each row's output line (its new_tokens counted for the stats)."""
    from blockpress.batchfile import InOrderWriter, batches, done_lines

    todo = rows
    if output is not None and output.exists() and args.resume:
        done = done_lines(output, rows, kind)
        todo = [row for row in rows if row.line not in done]
    out: IO[str]
    if output is not None:
        try:
            out = output.open("a" if args.resume else "w" if args.overwrite else "x", encoding="utf-8")
        except OSError as exc:  # a read-only file or folder: the error named no flag
            raise OSError(f"--output {output}: cannot write it ({exc.strerror or exc})") from None
    else:
        out = sys.stdout
    try:
        return run_file_rows(todo, InOrderWriter(out, [r.line for r in todo]),
                             batches(todo, args.batch_size, length, group), run_batch, command, output)
    finally:
        if out is not sys.stdout:
            out.close()


def run_file_rows(todo: list[Any], writer: Any, groups: Iterable[list[Any]],
                  run_batch: Callable[[list[Any]], list[dict[str, Any]]], command: str, output: Path | None) -> int:
    """An --input run's loop: one `run_batch` a batch, its rows written as they can be; a progress bar on a
    terminal's stderr, and the stats line at the end (or after a Ctrl-C, what was written)."""
    from tqdm import tqdm

    bar = tqdm(total=len(todo), unit="row", desc=command, dynamic_ncols=True, leave=False,
               disable=None if sys.stderr is not None else True, file=sys.stderr)
    t0, new_tokens = time.perf_counter(), 0
    try:
        for batch in groups:
            for row, line in zip(batch, run_batch(batch), strict=True):
                new_tokens += line["new_tokens"]
                writer.add(row.line, line)
            bar.update(len(batch))
            seconds = time.perf_counter() - t0
            bar.set_postfix_str(f"{new_tokens / seconds:.1f} tok/s" if seconds > 0 else "")
    except KeyboardInterrupt as exc:  # a Ctrl-C, SIGTERM or SIGHUP: the lines written stay, and --resume goes on
        bar.close()
        where = f" to {output}; --resume continues" if output is not None else ""
        print(f"{fresh_line(exc)}{stop_word(exc)} ({writer.written} of {len(todo)} lines written{where})",
              file=sys.stderr)
        return stop_status(exc)
    bar.close()
    seconds = time.perf_counter() - t0
    tok_s = round(new_tokens / seconds, 2) if seconds > 0 else None
    print(f"[{len(todo)} rows · {new_tokens} new tokens · {seconds:.1f} s · {tok_s} tok/s]", file=sys.stderr)
    return 0


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
    context, a hole of 10**10 tokens was laid out as a list of 10**10 ids before any check.)"""
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
    for flag, value in (("--prefix", args.prefix), ("template", text)):
        check_text(value, flag)  # bytes that were not UTF-8 arrive as surrogates: it names the byte, as chat does
    check_template(text, args.hole_length, model_context(args))
    lm = load_announced(args)
    if lm.tokenizer is None:
        raise ValueError(f"--model {args.model}: has no tokenizer.json, so it cannot take a text template")
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
            print(json.dumps(dict(text=None, fills=None, template=text, interrupted=True)))
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
    from blockpress.batchfile import INFILL, read_input

    if args.prefix:  # one context for every line would not be in the output lines --resume checks
        raise ValueError('--prefix: not with --input; give each line that has one its own "prefix"')
    output = check_file_flags(args, INFILL)
    name, rows = read_input(args.input, INFILL)
    context = model_context(args)
    for row in rows:
        try:
            check_template(row.template or "", args.hole_length, context)  # (an infill line has one)
        except ValueError as exc:
            raise ValueError(f"{name}:{row.line}: {exc}") from None
    lm = load_announced(args)
    if lm.tokenizer is None:
        raise ValueError(f"--model {args.model}: has no tokenizer.json, so it cannot take a text template")
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
                              seed=out.extra["seeds"][i]))
        return lines

    return run_file(args, output, rows, INFILL, run_batch, "infill",
                    # the text's length in characters: the templates are not tokenized until the batch
                    {r.line: len(r.template or "") + len(r.prefix or "") for r in rows},
                    {r.line: (seeds[r.line] is None,) for r in rows})


# A line of this alone opens a message of several lines, and the next one sends it (a code model's chat is sent
# code: one line, one message, split a pasted function into a message per line). Ollama's REPL takes the same.
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
    """--system as the message a conversation starts with (generate --chat, chat); [] without it."""
    return [{"role": "system", "content": args.system}] if args.system is not None else []


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
    wanted = kw["max_new_tokens"] if kw["max_new_tokens"] is not None else lm.default_new_tokens(len(ids))
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
    input() reads through readline once the module is imported, and without it the arrow keys reached the model as
    escape sequences ("\\x1b[D"). A pipe is read as it was: input() uses readline only on a terminal. Some
    Pythons have no readline (Windows'): lines are then read plainly, as before."""
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
    answer_without_tools, which the server's replies use). The reply's text leaves special tokens out, so a Gemma 4
    reply's thought channel read "thought\\n...answer": shown glued to the answer, and kept so in the conversation,
    where the chat template's strip_thinking (which cuts at <|channel> / <channel|>) could no longer drop it from
    later prompts."""

    lm: Any
    prompt: list[int]  # the conversation's ids: the template's start_anchor in it marks where the reply began
    tokens: list[int] = dataclasses.field(default_factory=list)  # the reply's valid tokens so far (Commit)
    color: bool = True  # the thought dimmed on screen (off: NO_COLOR, as generate's live view)
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


def cmd_chat(args: argparse.Namespace) -> int:
    from blockpress.generate import Commit, Done, canvas_room

    lm = load_announced(args)
    check_chat_start(lm, args, check_chat_template(lm, args, "chat"))
    context = lm.config.text.max_position_embeddings
    chat_flags = flags_of("chat")
    system = system_turn(args)  # every conversation starts with it, one after /reset too: as the model was tuned
    messages: list[dict[str, str]] = list(system)
    cache = None
    print(f"blockpress chat — /help lists the commands, /exit or Ctrl-D quits; {BLOCK} on a line of its own "
          "starts and ends a message of several lines", file=sys.stderr)
    # On a terminal the turns are marked "you> " and "model> "; piped, stdout holds the replies alone, one after
    # another (a script reads what the model said, not our decoration). With --json stdout holds one JSON line per
    # message and nothing else, and so does a stdout sent elsewhere from a terminal (`> chat.txt`, `| tee log`):
    # "you> " goes to stderr, the screen (input() would write it to stdout: the file got "you> model> " and the
    # user typed at no prompt), replies get no mark.
    interactive = sys.stdin.isatty()
    on_screen = interactive and not args.json and sys.stdout is not None and sys.stdout.isatty()
    marker = "model> " if on_screen else ""
    if interactive:
        enable_line_editing()
    # On a terminal the reply is printed as each canvas commits (an 819-token reply was ~30 s of blank screen, and
    # a Ctrl-C showed nothing of it); piped or --json, it is written whole once done, as before.
    opened = False  # "model> " and the reply's start are on screen: an error that ends the turn takes a new line

    def live_reply(events: Generator[Any, None, None], reader: ReplyReader) -> Any:
        """Print "model> " and each Commit's growth of its settled text (no half character, no start of a stop
        string that may yet be cut: Commit.settled_texts; a thought dimmed, the answer under it: ReplyReader.live),
        flushed; returns Done's output. A Ctrl-C leaves the part printed on screen."""
        nonlocal opened
        opened = False
        try:
            for n, event in enumerate(events):
                if n == 0:  # after the request's checks: an error in them is said on a line of its own
                    print(marker, end="", flush=True)
                    opened = True
                if isinstance(event, Commit):
                    settled = decoded(event.settled_texts, "chat")[0]
                    settled = settled[: len(settled) - 1] if settled.endswith("\r") else settled  # "\r\n": one newline
                    print(reader.live(event, settled), end="", flush=True)
                elif isinstance(event, Done):
                    return event.output
        finally:  # a Ctrl-C while printing: the stream takes its turn out of the cache now, not when collected
            events.close()
        raise RuntimeError("the reply's stream ended without its end")  # chat passes no `cancelled`

    pending: list[str] = []  # the lines of a paste still to be read, after the first (read_line)

    def read_line(first: bool) -> str:
        """A line, without its terminator; on a terminal prompted "you> " (`first`: a message's first line) or, in
        a block of several lines, "...> ". A terminal's paste of several lines comes back whole, newlines and all
        (readline 8.1+ takes it as one line: bracketed paste); one that holds a BLOCK line is read a line at a
        time, as typed lines are, so its blocks open and close: whole, the BLOCK lines were sent to the model as
        part of the message, and a paste that should close an open block left it open."""
        if pending:
            return pending.pop(0)
        mark = "you> " if first else "...> "
        if interactive and not on_screen:  # stdout holds the replies (or JSON lines) alone
            print(mark, end="", file=sys.stderr, flush=True)
        line = input(mark if on_screen else "")
        if "\n" in line and any(part.rstrip("\r").rstrip() == BLOCK for part in line.split("\n")):
            line, *rest = line.split("\n")
            pending.extend(part.removesuffix("\r") for part in rest)
        return line.removesuffix("\r")  # "\r\n" ends one too

    def new_line() -> str:
        """"\n" where a reply that failed midway (a GPU out of memory, non-finite logits) is part way along a line
        on screen: its error was written on after the last word ("model> def f(error: ...")."""
        return "\n" if on_screen and opened else ""

    def no_reply(user: str, **fields: Any) -> None:
        """With --json, a line that gets no reply (a dropped message, said on stderr, or a command) still gets its
        JSON line: a script that wrote N lines reads N back, in order, and never waits on one that will not come."""
        if args.json:
            shown = user.encode("utf-8", "surrogateescape").decode("utf-8", "replace")  # bad bytes as U+FFFD
            print(json.dumps(dict(prompt=shown, **fields)), flush=True)
    # Under a UTF-8 locale stdin decodes strictly, and one bad byte would raise out of input() and end the chat;
    # as surrogates it reaches the per-message check below, which names the byte and goes on.
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        block: list[str] | None = None  # a message of several lines, as read so far
        verbatim = False  # a block or a JSON string: the text it holds is the message, never a command
        try:
            user = read_line(first=True)
            if user.rstrip() == BLOCK:  # its lines are the message, as typed, up to the next such line
                block = []
                while (line := read_line(first=False)).rstrip() != BLOCK:
                    block.append(line)
                user, verbatim = "\n".join(block), True
            elif "\n" in user:  # a paste of several lines: one message, as a block is (never a command)
                verbatim = True
            elif args.json and user.startswith('"'):
                text = json_line(user)
                user, verbatim = text, text != user  # a JSON string never reads back as itself
        except EOFError:
            print(file=sys.stderr)  # the shell's prompt on a line of its own
            if block is not None:  # cut short: not the message that was meant
                error = f"the message started by a line of {BLOCK} ended without the line of {BLOCK} that sends it"
                print(f"error: {error}; it was not sent", file=sys.stderr)
                no_reply("\n".join(block), error=error)
            break
        except KeyboardInterrupt as exc:  # at the prompt, as in a shell: a fresh line (a block typed so far is dropped)
            # ("you> " is on the line, or, read from a file or pipe, at most the "^C")
            print(end="\n" if interactive else fresh_line(exc), file=sys.stderr)
            if isinstance(exc, Stopped):  # a SIGTERM or SIGHUP ends the chat, as Ctrl-D does, and says so
                print(f"{stop_word(exc)}: the chat ends", file=sys.stderr)
                return stop_status(exc)
            pending.clear()
            continue
        if not user.strip():  # a blank line is skipped, not an end: piped conversations have them between messages
            if verbatim:  # an empty block or JSON string was sent as a message: a script waits for its line
                error = "the message is empty"
                print(f"error: {error}; it was not sent", file=sys.stderr)
                no_reply(user, error=error)
            continue
        # A block or a JSON string is a message whatever it starts with: a script that JSON-encodes each message
        # sends "/usr/bin is slow" as it is (only a plain line is a command, and only there // escapes a /).
        command = "" if verbatim else user.strip()
        if command in ("/exit", "/quit"):  # answered too: a script reads one line per line it wrote
            no_reply(user, command=command[1:])
            break
        if command == "/help":
            print(CHAT_HELP, file=sys.stderr)
            no_reply(user, command="help")
            continue
        if command == "/reset":
            messages, cache = list(system), None
            print("(a new conversation)", file=sys.stderr)
            no_reply(user, command="reset")
            continue
        if command.startswith("//"):  # the escape: a message that starts with a slash
            user = user.replace("/", "", 1)
        elif command.startswith("/"):  # a mistyped command ("/exit now", "/rest") is not a message to the model
            error = f"unknown command {command!r}; {CHAT_HELP}"
            print(f"error: {error}", file=sys.stderr)
            no_reply(user, error=error)
            continue
        problem = utf8_problem(user)  # bytes that were not UTF-8 arrive as surrogates; the position is the line's
        if problem is not None:
            error = f"not valid UTF-8 ({problem} of the message)"
            print(f"error: {error}; that message was dropped, the conversation goes on", file=sys.stderr)
            no_reply(user, error=error)
            continue
        messages.append({"role": "user", "content": user})
        opened = False  # nothing of this turn's reply is on screen yet
        try:
            ids = lm.chat_prompt(messages, **args.chat_template_kwargs)
            kw = sampling_kwargs(args, lm)
            wanted = kw["max_new_tokens"] if kw["max_new_tokens"] is not None else lm.default_new_tokens(len(ids))
            canvas = lm.config.canvas_length  # the reply takes whole canvases: the new tokens that fit fill them
            room = canvas_room(context, len(ids), canvas)
            if room < wanted and room < max(1, kw["min_new_tokens"]):  # not even the shortest reply fits: refuse
                # Would a new conversation take it? If not, the message itself is too long, and "/reset" would
                # only throw the conversation away for the same refusal.
                alone = ids if len(messages) == len(system) + 1 else lm.chat_prompt([*system, messages[-1]],
                                                                                    **args.chat_template_kwargs)
                if canvas_room(context, len(alone), canvas) < max(1, kw["min_new_tokens"]):
                    raise ValueError(f"the message is too long: {len(alone)} tokens with the chat template"
                                     f"{' and --system' if system else ''}, and the "
                                     f"model's context holds {context} (the reply included); shorten it")
                raise ValueError(f"no room for a reply: the conversation with this message holds {len(ids)} of the "
                                 f"model's {context} tokens, leaving {max(0, context - len(ids))}, and "
                                 f"{reply_needs(kw['min_new_tokens'], canvas)}; /reset starts a new one")
            if room < wanted:  # a shorter reply than asked, rather than none
                kw["max_new_tokens"] = room
                print(f"(the context has room for {room} more tokens: this reply gets at most {room}, not {wanted}; "
                      "/reset starts a new conversation)", file=sys.stderr)
            t0 = time.perf_counter()
            reader = ReplyReader(lm, ids, color=not os.environ.get("NO_COLOR"))
            # only what the conversation does not share with the cache is encoded (lm.chat_ids)
            if on_screen:
                out = live_reply(lm.chat_stream(ids, cache=cache, return_cache=True, drafts=False, **kw), reader)
            else:
                out = lm.chat_ids(ids, cache=cache, return_cache=True, **kw)
        except KeyboardInterrupt as exc:  # the reply is abandoned, the conversation is not
            messages.pop()  # lm.chat_stream / chat_ids took the stopped turn out of the cache
            pending.clear()  # and the rest of a paste with it, as a terminal drops what was typed ahead
            if isinstance(exc, Stopped):  # a SIGTERM or SIGHUP: the reply so far stays, its line ended, and the chat ends
                print(f"{new_line() or fresh_line(exc)}({stop_word(exc)}; that message was dropped and the chat ends)",
                      file=sys.stderr)
                no_reply(user, error=stop_word(exc))
                return stop_status(exc)
            # on a line of its own: off the reply's last word, or the terminal's "^C" (a blank line in a log)
            print(f"{new_line() or fresh_line(exc)}(stopped; that message was dropped, the conversation goes on)",
                  file=sys.stderr)
            no_reply(user, error="stopped")
            continue
        except ValueError as exc:  # one bad turn (too long, a bad template) must not end the conversation
            messages.pop()
            print(f"{new_line()}error: {as_flags(str(exc), chat_flags)}; that message was dropped, the conversation "
                  "goes on", file=sys.stderr)
            no_reply(user, error=as_flags(str(exc), chat_flags))
            continue
        except RuntimeError as exc:  # a GPU out of memory on a long conversation: the turns before it stay usable
            if not out_of_memory(exc):
                raise
            messages.pop()  # the cache holds the turns before this one (lm.chat_ids / chat_stream roll it back)
            release_device_memory()
            error = out_of_memory_message(exc, "chat", "/reset frees the conversation's cache, and ")
            print(f"{new_line()}error: {error}; that message was dropped, the conversation goes on", file=sys.stderr)
            no_reply(user, error=error)
            continue
        cache = out.cache
        read = reader.read(out)
        reply = read.answer
        stats = stats_line(out, time.perf_counter() - t0)
        if args.json:  # the conversation's tokens, and those the cache held (the rest were encoded this turn)
            # and the seed the reply was drawn with (a fresh one each turn without --seed): seeds= repeats it
            stats.update(prompt_tokens=len(ids), cached_tokens=out.extra["reused_prompt_tokens"][0],
                         seed=out.extra["seeds"][0])
            thought = {"reasoning": read.thought} if read.thought else {}  # (text: the answer alone; an empty one: none)
            print(json.dumps(dict(text=reply, **thought, prompt=user, **stats)), flush=True)
        elif on_screen:  # the reply is on screen already, up to its last settled text
            print(reader.rest(read), flush=True)
            print_stats(stats)
        else:
            # flushed: a script waits for each reply, and `| tee log` shows it before its stats line on stderr
            print(printable(reply), flush=True)  # unmarked: stdout is not the screen, or stdin is no terminal
            print_stats(stats)
        messages.append(read.message)
    return 0


def meta_model(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The model `args` names, built on the meta device (shapes, dtypes, no memory) by the plan `blockpress.load`
    carries out on --device (checkpoint.plan_model), and what its folder stores: the safetensors headers only,
    never a tensor's data. (Loading to count converted a bf16 checkpoint to float32 on a CPU without native bf16:
    101 GB for a 26B.)"""
    from blockpress.checkpoint import index_total_size, plan_model, resolve_device, tensor_kind
    from blockpress.lm import LM, read_generation_config, resolve_model

    if args.model.startswith(RANDOM_PREFIX):  # random weights: float32 unless --dtype, as `random_model` makes them
        resolve_device(args.device)  # checked as a load would: the figures are for this device
        return load_model(args.model, args.dtype, "meta", args.quantize, args.adapter), dict(
            checkpoint_dtype=None, dtype_note=None, checkpoint_bytes=None, tied_copies=None)
    path, adapter, quantize = resolve_model(args.model, args.quantize, args.adapter)  # the base, as a load takes it
    if args.adapter is not None and adapter is not None:  # its own run's merged checkpoint refused, another base
        from blockpress.train import check_adapter_pairing  # warned about, as a load

        check_adapter_pairing(adapter, path, quantize)
    plan = plan_model(path, args.dtype, args.device, quantize, weights=False)  # config.json alone works too
    tokenizer = None
    if (path / "tokenizer.json").exists():  # as blockpress.load reads it
        from blockpress.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path)
    generation = read_generation_config(path, plan.config.text.vocab_size)
    if adapter is not None:
        from blockpress.train import adapter_generation

        generation.update(adapter_generation(adapter))  # as blockpress.load puts them over the base's
    lm = LM(plan.meta_model(), tokenizer, generation, path=path, adapter=adapter)
    if adapter is not None:
        from blockpress.train import check_adapter_base

        check_adapter_base(adapter, lm.model)  # a base of another shape: refused as a load refuses it
    # stored copies of tied weights (untied checkpoints hold them): a load compares their values with the decoder's
    # tensors and refuses one that differs; info reads no data, so it can only count them
    copies = sum(tensor_kind(n)[0] == "copy" for f in plan.files for n in f.keys())
    return lm, dict(checkpoint_dtype=str(plan.stored).removeprefix("torch.") if plan.stored else None,
                    dtype_note=widened_note(plan.widened_from, plan.dtype, bool(plan.files)),
                    # the shards' headers; before they are fetched, what their index says they hold
                    checkpoint_bytes=(sum(f.nbytes(n) for f in plan.files for n in f.keys()) if plan.files
                                      else index_total_size(path)),
                    tied_copies=copies or None)


def widened_note(own: Any, dtype: Any, stored: bool) -> str | None:
    """Why a load computes in `dtype` rather than the checkpoint's `own` (checkpoint.native_dtype), or None when it
    does not: said by `info` alone, not by every command that loads."""
    if own is None:
        return None
    name, wide = str(own).removeprefix("torch."), str(dtype).removeprefix("torch.")
    short = {"bfloat16": "bf16", "float16": "fp16"}.get(name, name)
    isa = "AVX512-FP16 / AMX" if name == "float16" else "AVX512-BF16 / AMX"
    return (f"{'stored' if stored else 'declared'} {name}, computed in {wide}: this CPU has no native {short} "
            f"matmuls ({isa}); --dtype {name} forces it, slower here (lm.save writes {name} back)")


def cmd_info(args: argparse.Namespace) -> int:
    from blockpress.cache import KVCache

    lm, stored = meta_model(args)
    cfg = lm.config
    adapter = None
    if lm.adapter is not None:
        from blockpress.train import describe_adapter

        adapter = describe_adapter(lm.adapter)
    # a LoRA adapter over a quantized base stays unmerged, in float32 (over a float one it is merged: no bytes more)
    adapter_bytes = 4 * adapter["parameters"] if adapter and lm.quantization else 0
    info = dict(
        model=args.model, path=str(lm.path) if lm.path else None, summary=cfg.describe(),
        parameters_total=lm.num_parameters(active=False), parameters_active=lm.num_parameters(active=True),
        # the dtype and bytes the weights would take loaded on --device (with --dtype / --quantize)
        dtype=str(lm.dtype).replace("torch.", ""), quantization=lm.quantization, device=args.device,
        weights_bytes=lm.weights_bytes() + adapter_bytes, adapter=adapter,
        # a sequence's keys and values per token, in the model's dtype: every layer keeps every token (sliding ones
        # too), so a request of N tokens (prompt, answer and a canvas of scratch) takes N times this, per row
        kv_cache_bytes_per_token=KVCache.bytes_per_token(cfg.text, lm.dtype),
        **stored,  # what the folder's safetensors hold (None: no weights in it)
        # the context every "exceed the model's context" error counts against: prompt, cache and canvases
        canvas_length=cfg.canvas_length, max_position_embeddings=cfg.text.max_position_embeddings,
        vocab_size=cfg.text.vocab_size, layers=cfg.text.num_hidden_layers,
        sliding_window=cfg.text.sliding_window, experts=cfg.text.num_experts, top_k=cfg.text.top_k_experts,
        # what a checkpoint may set otherwise than DiffusionGemma's own (each runs as in the reference)
        hidden_activation=cfg.text.hidden_activation, attention_bias=cfg.text.attention_bias,
        rope={kind.removesuffix("_attention"): cfg.text.resolved_rope_parameters[kind].get("rope_type", "default")
              for kind in cfg.text.kinds},
        tokenizer=lm.tokenizer is not None,
        generation_defaults={"max_new_tokens": lm.default_max_new_tokens, **asdict(lm.sampler_defaults)},
    )
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:>20}: {v}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Load --model quantized with --quantize (each projection as it is read: the full-precision weights are never
    all in memory) and save it to OUT as lm.save writes a quantized model, which every command's --model then loads
    as stored. Everything that can be refused is refused before the load: a 26B takes minutes to read."""
    from blockpress.checkpoint import checkpoint_files, folder_quantization
    from blockpress.lm import resolve_path
    from blockpress.train import ADAPTER_DIR, is_adapter_folder

    if args.quantize is None:
        raise ValueError("--quantize: required: the scheme to write, int8, fp8 or int4 (see docs/quantization.md)")
    source = None  # the folder the weights are read from (random-<preset>: none)
    if args.model.startswith(RANDOM_PREFIX):
        preset_config(args.model[len(RANDOM_PREFIX):], f"--model {args.model}")
    else:
        source = resolve_path(args.model)
        if is_adapter_folder(source) or (not (source / "config.json").is_file()
                                         and is_adapter_folder(source / ADAPTER_DIR)):
            # Merged into the codes, an adapter's update would be rounded to their step, and a QLoRA adapter
            # learned its update over the quantized base, not the full one: either way not the model it was.
            raise ValueError(f"--model {args.model}: a LoRA adapter folder; quantize the model it adapts instead: a "
                             "plain LoRA run's --out holds the merged checkpoint (give that folder), and adapters "
                             "trained over a quantized base (QLoRA) stay apart, loaded over the folder this writes "
                             "(--model THAT_FOLDER --adapter ADAPTER_FOLDER)")
        stored = folder_quantization(source)
        if stored is not None and stored != args.quantize:
            raise ValueError(f"--model {args.model}: stored quantized with {stored} (its codes, not the unquantized "
                             f"weights), so --quantize {args.quantize} cannot be made from it; give the unquantized "
                             f"checkpoint as --model (or --quantize {stored} to copy it as it is)")
    out = Path(os.path.expanduser(args.out))
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {args.out}: a file, not a folder")
    if source is not None and out.is_dir() and out.resolve() == source.resolve():
        raise ValueError(f"OUT {args.out}: is the folder --model {args.model} is read from; give another folder "
                         "(the unquantized checkpoint is what a quantization is made from)")
    # a killed save's temporaries alone (StagedFiles') leave a folder as good as empty: the next save replaces them
    held = sorted(p.name for p in out.iterdir() if not (p.name.startswith(".") and p.name.endswith(".tmp"))
                  ) if out.is_dir() else []
    if held and not args.overwrite:
        raise ValueError(f"OUT {args.out}: not empty (holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''});"
                         " give a new or empty folder, or --overwrite to write over the checkpoint it holds")
    if held and not (out / "config.json").is_file():  # --overwrite replaces a checkpoint, not a folder of other files
        raise ValueError(f"OUT {args.out}: --overwrite: holds no checkpoint to write over (no config.json, but "
                         f"{', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); give a new or empty folder")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):  # found now, not after the load
        raise ValueError(f"OUT {args.out}: cannot be written ({existing} is "
                         f"{'not a folder' if not existing.is_dir() else 'not writable'})")

    started = time.perf_counter()
    lm = load_announced(args)
    terminal = sys.stderr is not None and sys.stderr.isatty()
    line = f"writing {args.out} ..."
    if terminal:  # a 15 GB write takes a while too; erased once written, as the loading line is
        print(line, end="", file=sys.stderr, flush=True)
    try:
        lm.save(out)
    except OSError as exc:  # a full disk: the save left OUT as it was (StagedFiles), and the error named no path
        raise OSError(f"OUT {args.out}: cannot write it ({exc.strerror or exc})") from None
    finally:
        if terminal:
            print("\r" + " " * len(line) + "\r", end="", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started

    def on_disk(folder: Path) -> int:
        return sum(f.stat().st_size for f in checkpoint_files(folder))

    written, read = on_disk(out), None if source is None else on_disk(source)
    result = dict(out=str(out), model=args.model, source=str(source) if source else None,
                  quantization=lm.quantization,
                  # the one written (a bf16 checkpoint widened to float32 for this CPU saves bf16: LM.widened_from)
                  dtype=str(lm.widened_from or lm.dtype).removeprefix("torch."),
                  bytes=written, source_bytes=read, seconds=round(seconds, 3))
    if args.json:
        print(json.dumps(result))
    else:
        against = f" against {read / 1e6:.1f} MB for {args.model}" if read else ""
        print(f"wrote {out}: {lm.quantization}, {written / 1e6:.1f} MB{against}, in {seconds:.1f} s")
    return 0


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


DEFAULT_HELDOUT = 0.02  # train: the fraction of JSONL examples held out when --heldout is not given


def cmd_train(args: argparse.Namespace) -> int:
    from dataclasses import fields

    import blockpress
    from blockpress.data import is_examples, left_out, load_jsonl, split_heldout
    from blockpress.train import (
        ExampleSource,
        ShardSource,
        TrainConfig,
        Trainer,
        check_resumable,
        init_distributed,
    )

    args.device = init_distributed(args.device)  # under torchrun on CUDA: this process's GPU, cuda:LOCAL_RANK
    args.out = os.path.expanduser(args.out)  # --out=~/x reaches us unexpanded (bash expands ~ only at a word's start)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out}: a file, not a folder")
    # before the model loads: the folder is made only at the first save, minutes later
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {args.out}: cannot be created ({existing} is "
                         f"{'not a folder' if not existing.is_dir() else 'not writable'})")
    if args.resume:
        check_resumable(args.out)
    if args.data is None:
        if not args.resume:
            raise ValueError("--data: required (the training data; with --resume, the run's own is read from --out)")
        from blockpress.train import recorded_data

        args.data = recorded_data(out)
        if args.data is None:
            raise ValueError(f"--resume: the run in {args.out} does not record its data (a run saved before it was, "
                             "or one a Trainer ran without it); give it again with --data")
        print(f"--resume: training on the run's own data, {args.data}", file=sys.stderr)
    if not args.resume and (out / "trainer_state.pt").exists():
        raise ValueError(f"--out {args.out}: already holds a training run (trainer_state.pt); continue it with "
                         "--resume, or give another folder")
    # metrics.jsonl alone: a run that stopped before its first save, nothing to resume; this run starts it over.
    stale_metrics = not args.resume and (out / "metrics.jsonl").is_file()
    if not args.resume and (out / "config.json").exists():  # e.g. --model X --out X: the run would overwrite it
        raise ValueError(f"--out {args.out}: already holds a checkpoint (config.json); give another folder")
    # A resumed run keeps its own settings; --train-config and flags given now override them.
    raw: dict[str, Any] = resumed_train_config(out) if args.resume else {}
    saved = dict(raw)
    if args.train_config:
        from blockpress.files import read_json_object

        try:
            given = read_json_object(args.train_config, where="--train-config ")
        except OSError as exc:
            raise ValueError(f"--train-config {args.train_config}: {exc}") from None
        # each value its field's type, before the model loads: the file is named, where from_dict below cannot
        TrainConfig.check_fields(given, where=f"--train-config {args.train_config}: ")
        raw.update(given)
    for f in fields(TrainConfig):
        value = getattr(args, f.name)
        if value is not None:
            raw[f.name] = value
    cfg = TrainConfig.from_dict(raw)
    if args.resume and saved.get("lora_rank"):
        from blockpress.train import TRAINER_STATE_FILE, check_continues, read_trainer_state

        # before the base is looked for and loaded (a minute for a quantized one): a finished LoRA run said "give
        # --model", then, with it, that it had finished
        state = read_trainer_state(out / TRAINER_STATE_FILE, map_location="cpu")
        check_continues(args.out, state, cfg)
        lora_shape = state.get("base_shape")  # (checked against the model as soon as it loads)
        del state
    if args.resume and saved.get("lora_rank") and args.model is not None:
        from blockpress.train import check_lora_resume_model

        check_lora_resume_model(args.out, args.model)  # before it loads, and before the data is read with it
    if args.resume and args.model is None and args.config is None:
        from blockpress.train import LORA_BASE_FILE, lora_base

        # A LoRA run to be resumed keeps its adapters apart from the base they adapt, recorded beside them (a run its
        # clock stopped also holds its merged checkpoint, which is not that base).
        if (out / LORA_BASE_FILE).is_file() or not (out / "config.json").is_file():
            args.model = lora_base(out)
            if args.model is None:
                raise ValueError(f"--resume: {args.out} holds a LoRA run's adapters, and not the base model they "
                                 "adapt; give it again with --model (or --config)")
        else:
            args.model = args.out  # the run's own last checkpoint; Trainer.resume restores optimizer and step
    if (args.model is None) == (args.config is None):
        raise ValueError("give exactly one of --model (fine-tune a checkpoint) or --config (a fresh model)")
    if args.model and args.tokenizer:
        raise ValueError("--tokenizer: only for a fresh model (--config); a checkpoint given by --model brings its own")
    if args.resume and saved.get("heldout") is not None and raw.get("heldout") != saved["heldout"]:
        # another split would score examples the run already trained on as held out (or train on held-out ones)
        raise ValueError(f"--heldout: the run in {args.out} holds out {saved['heldout']} of its examples; a resumed "
                         "run keeps its split (leave --heldout out, or start a new run)")
    # (--heldout-data is recorded whole, below: the same file typed relative again is no change)
    changed = {k: (saved[k], v) for k, v in raw.items() if k in saved and saved[k] != v
               and not (k == "heldout_data" and v and saved[k] and Path(v).resolve() == Path(saved[k]).resolve())}
    if changed:  # after the arguments are checked: an error there comes alone
        print_warning("--resume: the run's saved settings, except " +
                      ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    if args.model:
        # float32 weights unless asked: AdamW steps on bf16 weights round small updates away (a bf16 checkpoint
        # fine-tuned in bf16 changed 10% of its weights where float32 changed 19%). LoRA trains float32
        # adapters, so its frozen base may stay in its own dtype.
        # --quantize: each projection quantized as it is read (QLoRA: the full-precision base never exists at once)
        # (an adapter folder as --model: merged into its base, unquantized unless --quantize says otherwise)
        from blockpress.checkpoint import folder_quantization
        from blockpress.lm import resolve_path

        stored = (None if cfg.quantize or args.model.startswith(RANDOM_PREFIX)  # (random weights: no folder)
                  else folder_quantization(resolve_path(args.model)))
        if stored is not None and cfg.lora_rank:  # QLoRA over it, as --quantize of its scheme would say (recorded
            # with the run and its adapters, so that a resume and a load of them take the same base)
            raw["quantize"] = stored
            cfg = dataclasses.replace(cfg, quantize=stored)
            if not args.quiet:
                print(f"--model {args.model}: stored quantized ({stored}); its LoRA adapters train over it as QLoRA "
                      f"(--quantize {stored})", file=sys.stderr)
        elif stored is not None:  # (with --quantize, the load refuses another scheme than the stored one)
            raise ValueError(f"--model {args.model}: stored quantized ({stored}); a full fine-tune needs the "
                             f"unquantized weights; train LoRA adapters over it instead (--lora-rank R: QLoRA), or "
                             "fine-tune the unquantized checkpoint")
        lm = load_model(args.model, cfg.dtype or (None if cfg.lora_rank else "float32"), args.device,
                        cfg.quantize or "none")
        if args.resume and saved.get("lora_rank") and lora_shape:
            from blockpress.train import shape_differences

            # another base (its recorded one gone) of another shape: said before the data is read with it
            differ = shape_differences(lora_shape, lm.model, "this model")
            if differ:
                raise ValueError(f"--model {args.model}: not of the shape of the base the LoRA run in {args.out} "
                                 f"trained its adapters over: {', '.join(differ)}")
        if "noise_token_id" not in raw and "noise_token_id" in lm.generation_config:
            # continue the model's own recipe: an absorbing-noise model fine-tuned with uniform noise forgets it
            cfg = TrainConfig.from_dict({**raw, "noise_token_id": lm.generation_config["noise_token_id"]})
    else:
        if not args.config.endswith(".json"):
            mcfg = preset_config(args.config, f"--config {args.config}")
        else:
            try:
                mcfg = blockpress.ModelConfig.from_file(args.config)
            except (ValueError, OSError) as exc:  # their messages start with the path, or name a field
                message = str(exc)
                raise ValueError(f"--config {message}" if message.startswith(str(Path(args.config)))
                                 else f"--config {args.config}: {message}") from None
        tokenizer = None
        if args.tokenizer:
            from blockpress.lm import check_tokenizer, resolve_path
            from blockpress.tokenizer import Tokenizer

            tokenizer_path = Path(args.tokenizer)  # its tokenizer.json, its folder, or a shipped model's name
            if tokenizer_path.is_file() and tokenizer_path.name != "tokenizer.json":  # its folder's own would be read
                raise ValueError(f"--tokenizer {args.tokenizer}: expected a tokenizer.json, the folder that holds "
                                 "one, or a shipped model's name")
            try:
                tokenizer = Tokenizer.from_dir(tokenizer_path.parent if tokenizer_path.is_file()
                                               else resolve_path(args.tokenizer))
            except (ValueError, OSError) as exc:
                raise ValueError(f"--tokenizer {args.tokenizer}: {exc}") from None
            if not args.config.endswith(".json"):  # a preset is a shape; its vocabulary is the tokenizer's
                mcfg = dataclasses.replace(mcfg, text=dataclasses.replace(mcfg.text, vocab_size=tokenizer.vocab_size))
            check_tokenizer(tokenizer, mcfg.text.vocab_size, f"--tokenizer {args.tokenizer}")  # (random_model's check)
            if tokenizer.eos_id is None:  # an example's end is learned as this token: without one, answers never end
                raise ValueError(f"--tokenizer {args.tokenizer}: names no EOS token (eos_token in "
                                 "tokenizer_config.json); the model learns to end its answers with it")
            # The saved model's specials must be the tokenizer's: the preset's Gemma ids (pad 0, eos 1, bos 2) would
            # fill the canvases after an answer with whatever token the tokenizer put there.
            eos = tokenizer.eos_ids if len(tokenizer.eos_ids) > 1 else tokenizer.eos_id
            # (an id the tokenizer does not name keeps the config's)
            text = mcfg.text
            mcfg = dataclasses.replace(mcfg, text=dataclasses.replace(
                text, eos_token_id=eos,
                bos_token_id=text.bos_token_id if tokenizer.bos_id is None else tokenizer.bos_id,
                pad_token_id=text.pad_token_id if tokenizer.pad_id is None else tokenizer.pad_id))
        lm = blockpress.random_model(mcfg, seed=cfg.seed, dtype=cfg.dtype or "float32", device=args.device,
                                     tokenizer=tokenizer)
    vocab = lm.config.text.vocab_size

    def examples_of(path: str, flag: str) -> list[Any]:
        try:
            return load_jsonl(path, lm.tokenizer, vocab, context=(lm.config.canvas_length,
                              lm.config.text.max_position_embeddings, cfg.max_canvases or None),
                              chat_turns=cfg.chat_turns)
        except (ValueError, OSError) as exc:  # missing, unreadable, empty, a bad line: the flag's path (as text's)
            raise type(exc)(f"{flag} {exc}") from None

    for flag, data in (("--data", args.data), ("--heldout-data", cfg.heldout_data)):
        try:  # a README.md beside JSONL files: say it is not trained on
            note = left_out(data) if data else None
            # what the data is, read from its first line: an error there (not JSON, not UTF-8) names the flag as one
            # on a later line does (it named the file alone, whichever of --data and --heldout-data it was)
            is_examples(data) if data else None
        except ValueError as exc:  # a folder or glob of JSONL and other files; the message starts with the path
            raise ValueError(f"{flag} {exc}") from None
        if note:
            print_warning(f"{flag} {data}: {note}")
    source: ExampleSource | ShardSource
    heldout: ExampleSource | ShardSource | None
    if is_examples(args.data):
        cfg.check_examples()  # before the examples are read (the Trainer checks again)
        if cfg.heldout_data:  # the held-out examples are a file of their own
            if not is_examples(cfg.heldout_data):
                raise ValueError(f"--heldout-data {cfg.heldout_data}: not JSONL examples; with JSONL examples as --data, "
                                 "held-out examples are a JSONL file of them (or the --heldout fraction of --data)")
            if cfg.heldout:
                raise ValueError("--heldout/--heldout-data: the held-out examples are a fraction of --data or the "
                                 "examples of --heldout-data; give one of them")
            train, held = examples_of(args.data, "--data"), examples_of(cfg.heldout_data, "--heldout-data")
        else:
            fraction = cfg.heldout
            if fraction is None:
                if args.resume:  # a run saved before train_config.json kept it: the split may differ from the run's
                    print_warning(f"--resume: the run in {args.out} did not record its --heldout; holding out "
                                  f"{DEFAULT_HELDOUT} (give the value it was started with, if another)")
                fraction = DEFAULT_HELDOUT
                cfg = dataclasses.replace(cfg, heldout=fraction)  # saved with the run: --resume keeps the split
            examples = examples_of(args.data, "--data")
            train, held = split_heldout(examples, fraction)
            if fraction > 0 and not held:
                print_warning(f"--heldout {fraction}: holds out none of {len(examples)} examples; no held-out "
                              "loss")
        if cfg.chat_turns != cfg.default("chat_turns") and not any(e.templated for e in (*train, *held)):
            # it would be ignored: prompt/response and ids records are one example each, with no turns to choose
            raise ValueError(f"--chat-turns {cfg.chat_turns}: for JSONL examples of chat `messages`; the examples "
                             "given are prompt/response (or ids) records, one example each, with no turns")
        source = ExampleSource(train, cfg.seed)
        heldout = ExampleSource(held, cfg.seed) if held else None
    else:
        if cfg.heldout:  # it would be ignored: running text has no examples to split
            raise ValueError("--heldout: for JSONL examples (a fraction of them); with raw text or token shards "
                             "give the held-out text or shards with --heldout-data")
        if cfg.chat_turns != cfg.default("chat_turns"):  # it would be ignored: running text has no chats
            raise ValueError(f"--chat-turns {cfg.chat_turns}: for JSONL examples of chat `messages`; running text "
                             "has no turns")
        # each window after the BOS that generate puts before a text prompt (ShardSource)
        bos = lm.tokenizer.bos_id if lm.tokenizer is not None else None
        source = ShardSource(train_corpus(args.data, "--data", lm.tokenizer, vocab), cfg, lm.config.canvas_length, bos)
        heldout = ShardSource(train_corpus(cfg.heldout_data, "--heldout-data", lm.tokenizer, vocab), cfg,
                              lm.config.canvas_length, bos) if cfg.heldout_data else None
    base_dtype = lm.dtype
    # LoRA: the adapters are merged in float32 at the end; the checkpoint stays float32 unless --dtype asks to round
    import torch

    merged_dtype = getattr(torch, cfg.dtype) if cfg.dtype else torch.float32
    if cfg.heldout_data:  # recorded with the run as --data is, whole: --resume from another folder reads it too
        cfg = dataclasses.replace(cfg, heldout_data=str(Path(cfg.heldout_data).resolve()))
    trainer = Trainer(lm, source, cfg, args.out, heldout=heldout, progress=not args.quiet, merged_dtype=merged_dtype,
                      data=str(Path(args.data).resolve()))  # one spelling of a file: --resume compares them
    if trainer.prompts_healed and trainer.rank == 0 and isinstance(source, ExampleSource):  # (only examples heal)
        print(f"--data: {trainer.prompts_healed} of {len(source.examples)} training prompts end in whitespace that "
              "token healing would re-choose, and the model learns to answer after it as it is: its generation "
              "settings say token_healing false, so `blockpress generate` keeps a prompt's end as typed "
              "(--token-healing heals it)", file=sys.stderr)
    if stale_metrics and trainer.rank == 0:  # after every check: a refused run leaves the folder as it was
        print(f"--out {args.out}: replacing the metrics.jsonl of a run that stopped before its first save (no "
              "trainer_state.pt to resume from)", file=sys.stderr)
        (out / "metrics.jsonl").unlink()
    if args.resume:
        trainer.resume()
    if not args.quiet and trainer.rank == 0:  # what the run trains on: nothing said it (a folder's stray files,
        # a chat's turns, a --heldout split, how many passes --steps makes went unseen); after --resume, which
        # says where the run's data stands
        print(data_summary(args.data, source, heldout, cfg, lm.config.canvas_length, trainer.data_start),
              file=sys.stderr)
    trainable = {"trainable_parameters": trainer.trainable_parameters,
                 "trainable_fraction": round(trainer.trainable_parameters / max(trainer.total_parameters, 1), 6)}
    if cfg.lora_rank and not args.quiet and trainer.rank == 0:
        print(f"--lora-rank {cfg.lora_rank}: training {trainer.trainable_parameters:,} of "
              f"{trainer.total_parameters:,} parameters ({100 * trainable['trainable_fraction']:.3g}%) on "
              f"{cfg.lora_targets}", file=sys.stderr)
    if cfg.warmup_steps > cfg.steps:
        print_warning(f"--warmup-steps {cfg.warmup_steps} is more than --steps {cfg.steps}: the learning rate never "
                      f"reaches --lr {cfg.lr}")
    result = trainer.train()
    if trainer.rank == 0:
        _plot_training(Path(args.out), quiet=args.quiet)
    if not args.quiet and trainer.rank == 0:  # under torchrun, one summary, not one a process
        losses = result.losses
        print(json.dumps({"out": args.out, "steps": result.steps, "stopped": result.stopped,
                          "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
                          "eval_losses": result.eval_losses,
                          "tokens_per_second": round(result.tokens_per_second, 1), **trainable}))
    if cfg.quantize and result.stopped != "interrupted" and trainer.rank == 0:
        from blockpress.train import ADAPTER_DIR, base_name

        adapter = Path(args.out) / ADAPTER_DIR
        named = base_name(lm) is not None  # the folder names its base (one loaded from a folder): it loads alone
        flags = f"--model {adapter}" if named else f"--model BASE --adapter {adapter} --quantize {cfg.quantize}"
        python = repr(str(adapter)) if named else f"BASE, adapter={str(adapter)!r}, quantize={cfg.quantize!r}"
        # a base saved quantized is itself the quantized checkpoint, and has no unquantized weights to merge into
        from blockpress.checkpoint import folder_quantization

        saved_quantized = lm.path is not None and folder_quantization(lm.path) is not None
        base = (f"(over {lm.path}, saved {cfg.quantize})" if saved_quantized
                else "(no checkpoint of the quantized base)")
        merge = "" if saved_quantized else "; --quantize none merges them into the unquantized base instead"
        print(f"--quantize {cfg.quantize}: {adapter} holds the adapters, unmerged {base}; run them as trained, over "
              f"the {cfg.quantize} base: `blockpress generate {flags} PROMPT` (chat, serve and info alike{merge}), or "
              f"in Python blockpress.load({python})", file=sys.stderr)
    elif cfg.lora_rank and result.stopped != "interrupted" and base_dtype != merged_dtype and trainer.rank == 0:
        base = str(base_dtype)[6:]
        # (--dtype takes float32 and bfloat16: a float16 base, trained with loss scaling, is cast by save's dtype)
        how = (f"--dtype {base} saves that" if base != "float16" else
               f"blockpress.load({str(args.out)!r}).save(FOLDER, dtype='float16') writes that")
        print(f"--lora-rank: the adapters were merged in float32 and {args.out} holds a {str(merged_dtype)[6:]} "
              f"checkpoint (the base was {base}; {how}, rounding part of the adapters' update away)", file=sys.stderr)
    if result.stopped == "interrupted":
        import signal

        adapters = f" (its adapters so far load as --model {Path(args.out) / 'adapter'})" if cfg.lora_rank else ""
        # 128 + the signal, as a shell reports a process it ended: a scheduler's SIGTERM (timeout, Slurm, docker stop)
        # exited 130, Ctrl-C's status, and a job script could not tell the two apart
        signum = result.stop_signal or signal.SIGINT
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        if trainer.rank == 0:  # the process that saves (under torchrun each said "saved")
            print(f"{what} at step {result.steps}: saved in {args.out}{adapters}; continue with --resume",
                  file=sys.stderr)
        _leave_peers()  # rank 0 has saved and said so: only now may a process exit non-zero
        return 128 + signum
    _leave_peers()
    return 0


def _leave_peers() -> None:
    """Under torchrun: wait for every process, then leave the process group. torchrun stops the other processes as
    soon as one exits non-zero (a stop's 130 or 143), so a process that left at once cut rank 0 short after its save,
    before it said where the run was saved, or during it; and a group never left could abort at exit ("terminate
    called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def data_summary(data: str, source: Any, heldout: Any, cfg: Any, canvas_length: int,
                 start: tuple[int, int] = (0, 0)) -> str:
    """The line `train` starts with: how much data --data gave, how much of it is held out, and how many passes over
    it --steps x --batch-size make. `start`: (step, examples consumed) where a resumed run goes on (Trainer's
    data_start); a run resumed at another batch size consumed its first steps at the old one."""
    from blockpress.train import ExampleSource

    step, seen = start
    drawn = seen + (cfg.steps - step) * cfg.batch_size

    def span(first: int, last: int) -> str:
        return f"step {last}" if first == last else f"steps {first}-{last}"

    if seen == step * cfg.batch_size:  # one batch size all along
        steps, draw = f"--steps {cfg.steps} x --batch-size {cfg.batch_size}", "draws"
    else:
        steps = f"the {seen:,} of {span(1, step)} and {span(step + 1, cfg.steps)} x --batch-size {cfg.batch_size}"
        draw = "draw"
    upto = "up to " if cfg.max_minutes else ""  # the clock may end the run first
    if isinstance(source, ExampleSource):
        n = len(source.examples)
        held = len(heldout.examples) if isinstance(heldout, ExampleSource) else None
        of = (f"{n:,} examples (--heldout-data: {held:,})" if cfg.heldout_data and held is not None else
              f"{n + held:,} examples, {held:,} held out, {n:,} trained on" if held is not None else f"{n:,} examples")
        from blockpress.data import canvas_count

        cut = sum(canvas_count(e, canvas_length) > cfg.max_canvases for e in source.examples) if cfg.max_canvases else 0
        cuts = (f"; --max-canvases {cfg.max_canvases} cuts {cut:,} of their responses short (their end, EOS, is not "
                "trained)") if cut else ""
        return f"--data {data}: {of}; {steps} {draw} {upto}{drawn:,}: {drawn / n:.3g} epochs{cuts}"
    shards = source.shards
    count, kind = (shards.documents, "document") if shards.documents else (len(shards.arrays), "shard file")
    where = f" in {count:,} {kind}{'s' if count != 1 else ''}"
    response = cfg.response_canvases * canvas_length
    return (f"--data {data}: {shards.tokens:,} tokens{where}; {steps} windows of {response} response tokens cover "
            f"{upto}{_times(drawn * response / shards.tokens)} of them")


def _times(ratio: float) -> str:
    """A share of the data as a reader takes it in: "2.5x", or "0.56%" for a small one (not "0.0056x")."""
    return f"{ratio:.3g}x" if ratio >= 0.1 else f"{100 * ratio:.2g}%"


def train_corpus(path: str, flag: str, tokenizer: Any, vocab_size: int) -> Any:
    """Running text for `train` as TokenShards: raw text (a .txt/.py/.md file, a folder of them, JSONL lines
    {"text": ...}) tokenised in memory, or a glob of token shards; errors name `flag`."""
    from blockpress.data import TokenShards, is_examples, is_raw_text, load_text, shard_files

    if is_examples(path):  # neither running text nor shards, whatever its name
        raise ValueError(f"{flag} {path}: JSONL examples (prompt/response, messages or ids); running text is "
                         "{\"text\": ...} JSONL lines, a .txt/.py/.md file or a folder of them, or a glob of token "
                         "shards")
    if not is_raw_text(path):
        return TokenShards(shard_files(path, flag), vocab_size)
    try:
        return load_text(path, tokenizer, vocab_size)
    except (ValueError, OSError) as exc:  # their messages start with the path
        raise type(exc)(f"{flag} {exc}") from None


def resumed_train_config(out: Path) -> dict[str, Any]:
    """The settings the run in `out` was started with (train_config.json; older runs: trainer_state.pt)."""
    from dataclasses import fields

    from blockpress.files import read_json_object
    from blockpress.train import TRAIN_CONFIG_FILE, TRAINER_STATE_FILE, TrainConfig, read_trainer_state

    file = out / TRAIN_CONFIG_FILE
    if file.is_file():
        saved = read_json_object(file, where="--resume: ")
    else:
        saved = read_trainer_state(out / TRAINER_STATE_FILE, map_location="cpu").get("config", {})
    known = {f.name for f in fields(TrainConfig)}
    return {k: v for k, v in saved.items() if k in known}


def _plot_training(out: Path, quiet: bool) -> None:
    """loss.png beside metrics.jsonl: the curves of the whole run, resumed parts included."""
    from blockpress.train import plot_metrics

    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        return
    try:
        plot_metrics(metrics, out / "loss.png")
    except ImportError:
        if not quiet:
            print_warning("no loss.png: matplotlib is not installed (pip install 'blockpress[train]')")
        return
    if not quiet:
        print(f"loss curves: {out / 'loss.png'}", file=sys.stderr)


def cmd_sudoku(args: argparse.Namespace) -> int:
    from blockpress.tasks import sudoku_model
    from blockpress.tasks.sudoku import (
        cell_accuracy,
        format_board,
        is_puzzle_csv,
        join_grid_rows,
        read_puzzle_csv,
        split_puzzle_file,
    )

    if args.puzzles.count("-") + (args.file == "-") > 1:  # the second reader would get an empty stdin, silently
        raise ValueError("standard input can be read once: give - once (a puzzle argument or --file -)")
    puzzles: list[str] = []
    expected: list[str | None] = []  # each puzzle's solution, where a CSV gave one: the answers are scored against it

    def read(text: str, name: str) -> None:
        # stdin keeps bytes that are not UTF-8 as surrogates (as generate's does): named here as such, by line, where
        # the puzzle reader saw "illegal character '\udcff'", a character the input never held
        for n, line in enumerate(text.splitlines(), start=1):
            if (problem := utf8_problem(line)) is not None:
                raise ValueError(f"{name} line {n}: not valid UTF-8 ({problem})")
        pairs = read_puzzle_csv(text, name) if is_puzzle_csv(text) else [(p, None) for p in split_puzzle_file(text, name)]
        puzzles.extend(p for p, _ in pairs)
        expected.extend(s for _, s in pairs)

    for k, word in enumerate(args.puzzles, start=1):  # a command line's bytes that are not UTF-8 arrive so too
        check_text(word, f"puzzle argument {k}")
    for text in join_grid_rows(args.puzzles):  # - reads them from standard input, as a --file would be read
        if text == "-":
            read(sys.stdin.read(), "stdin")
        else:
            puzzles.append(text)
            expected.append(None)
    if args.file == "-":
        read(sys.stdin.read(), "--file -")
    elif args.file:
        try:
            # utf-8-sig: the file's own encoding whatever the locale says, a BOM (Notepad's) left out
            lines = Path(args.file).read_text(encoding="utf-8-sig").splitlines()
        except (OSError, UnicodeDecodeError) as exc:  # a folder, a missing or a binary file
            raise ValueError(f"--file {args.file}: cannot read puzzles from it ({exc})") from None
        read("\n".join(lines), f"--file {args.file}")
    if not puzzles:
        raise ValueError("give at least one puzzle (81 characters, 0 . - _ or * for empty), or --file")
    if args.batch_size < 1:  # before the model loads
        raise ValueError(f"--batch-size: expected a positive integer, got {args.batch_size}")
    puzzles = sudoku_model.prepare(puzzles)  # clear errors before the model is even loaded (warns of the unsettled)
    lm = load_announced(args)

    def show(step: int, boards: list[str]) -> None:
        print(f"step {step}\n{format_board(boards[0])}\n", file=sys.stderr)

    on_draft = show if args.show_steps and len(puzzles) == 1 else None
    if args.show_steps and len(puzzles) > 1:
        print_warning(f"--show-steps: shows one puzzle's steps; {len(puzzles)} puzzles given, so none are shown")
    results: list[Any] = []
    scored = []  # (matches the file's solution, cell accuracy on the empty cells) of each puzzle that came with one
    t0 = time.perf_counter()
    try:
        # --batch-size puzzles at a time, each batch's answers printed as it ends: one batch of every puzzle given
        # grew ~2.2 MB a puzzle (400: 1.2 GB peak; a Kaggle CSV of 100,000 would want ~220 GB), printed nothing until
        # the last was solved, and a Ctrl-C lost them all. A row's answer is the same in any batch (its randomness
        # is its seed's), up to float rounding.
        for start in range(0, len(puzzles), args.batch_size):
            batch = puzzles[start:start + args.batch_size]
            done = sudoku_model.solve(lm, batch, max_denoising_steps=args.steps, sampler=args.sampler,
                                      seed=args.seed, on_draft=on_draft, rules=args.rules, rank_by=args.rank_by,
                                      ensemble=args.ensemble, confidence=args.confidence, checked=True)
            for r, truth in zip(done, expected[start:start + args.batch_size]):
                score = None if truth is None else (r.solution == truth, cell_accuracy(r.solution, truth, r.puzzle))
                if score is not None:
                    scored.append(score)
                print_sudoku_answer(r, truth, score, args.json)
            results.extend(done)
            if sys.stdout is not None:  # each batch's answers out now (piped, Python holds them in a buffer)
                sys.stdout.flush()
    except KeyboardInterrupt as exc:  # a Ctrl-C, SIGTERM or SIGHUP (off the terminal's "^C")
        print(f"{fresh_line(exc)}{stop_word(exc)} ({len(results)} of {len(puzzles)} puzzles solved, printed above)",
              file=sys.stderr)
        return stop_status(exc)
    seconds = time.perf_counter() - t0
    if not args.json:
        solved = sum(r.valid for r in results)
        accuracy = "" if not scored else (
            f" · {sum(c for c, _ in scored)}/{len(scored)} match the file's solutions, cell accuracy "
            f"{sum(a for _, a in scored) / len(scored):.1%}")
        print(f"[{solved}/{len(results)} valid{accuracy} · {len(results) / seconds:.2f} puzzles/s]", file=sys.stderr)
        if solved < len(results) and args.ensemble == 1 and not args.rules:
            # The measured trade (benchmarks/RESULTS.md): 8 pooled views solved 97.5% of medium puzzles
            # against 86.5% for one, at an eighth of the speed.
            print("hint: --ensemble 8 pools the model's predictions over 8 symmetric views of each puzzle (no "
                  "rules; 8x the work); --rules adds candidate filtering", file=sys.stderr)
    return 0 if all(r.valid for r in results) else 1  # scripts can tell a failed solve without parsing


def print_sudoku_answer(r: Any, truth: str | None, score: tuple[bool, float] | None, as_json: bool) -> None:
    """One answer of `sudoku`, as a JSON line or as its board, whether it is valid, and the rules it breaks."""
    from blockpress.tasks.sudoku import format_board

    if as_json:
        row = {"puzzle": r.puzzle, "solution": r.solution, "valid": r.valid, "steps": r.steps, "errors": r.errors}
        if score is not None:
            row.update(expected=truth, correct=score[0], cell_accuracy=score[1])
        print(json.dumps(row))
        return
    print(format_board(r.solution))
    # which rules the grid breaks, and where: the board alone does not show it
    against = "" if score is None else (" · matches the file's solution" if score[0] else
                                        f" · differs from the file's solution (cell accuracy {score[1]:.1%})")
    print(f"{'valid' if r.valid else 'INVALID'} · {r.steps} denoising steps{against}"
          + "".join(f"\n  {error}" for error in r.errors) + "\n")


def served_name(model: str) -> str:
    """The model id clients send: a folder's own name; a shipped name or a cached repo id as given (a hub model
    keeps its "owner/name", as vLLM serves it); a LoRA run's adapter folder (OUT/adapter), its run's name."""
    from blockpress.train import ADAPTER_DIR, is_adapter_folder

    folder = Path(model).expanduser()
    if not folder.is_dir():
        return model
    # its name as the absolute path spells it (".." taken out, links kept): "." and "./" have no name of their own,
    # so `serve --model .` from inside the folder served the id ''
    path = Path(os.path.abspath(folder))
    if path.name == ADAPTER_DIR and is_adapter_folder(path) and path.parent.name:
        # every run's adapter folder has that name: two runs served were both 'adapter'
        return path.parent.name
    return path.name or model


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.prefix_cache_gb < math.inf:  # nan and inf too: int() of them failed after the model loaded
        raise ValueError(f"--prefix-cache-gb: expected 0 (off) or more GiB, a finite number, got {args.prefix_cache_gb}")
    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-context", args.max_context), ("--max-body-bytes", args.max_body_bytes),
                        ("--max-stops", args.max_stops)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: expected a positive integer, got {value}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout: expected seconds >= 0, got {args.shutdown_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected 0-65535 (0: any free port), got {args.port}")
    import uvicorn

    from blockpress.serve import check_api_key, check_origins, create_app, header_deadline_protocol, warm_up

    check_origins(args.allowed_origins or ())  # before the model loads, as the other flags
    # the flag, else the variable (an empty one is unset, as vLLM reads VLLM_API_KEY); never printed
    api_key = check_api_key(args.api_key if args.api_key is not None else os.environ.get("BLOCKPRESS_API_KEY") or None)
    sock = bind_socket(args.host, args.port)  # first: a port in use fails before the model loads
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    # A big checkpoint loads for tens of seconds before the server answers: say what the wait is.
    lm = load_announced(args, keep=f"blockpress: loading {args.model} ... (http://{url_host}:{port}/v1 answers "
                                   "once it is loaded)")
    name = args.served_name or served_name(args.model)
    app = create_app(lm, name, max_queue=args.max_queue, max_batch=args.max_batch, max_context=args.max_context,
                     prefix_cache_bytes=int(args.prefix_cache_gb * 2**30), allowed_origins=args.allowed_origins or (),
                     api_key=api_key, max_body_bytes=args.max_body_bytes, max_stops=args.max_stops,
                     chat_template_kwargs=args.chat_template_kwargs)
    if args.compile or args.cuda_graphs:
        # Here, before the engine thread that owns the model starts: the first clients waited minutes for the compile
        # (vLLM captures its graphs at startup too). Connections made meanwhile wait in the socket's backlog.
        flag, doing = (("--compile", "compiling the model's steps (minutes on a CPU)") if args.compile else
                       ("--cuda-graphs", "capturing CUDA graphs"))
        print(f"blockpress: {flag}: {doing} with a few short generations before serving ...", file=sys.stderr,
              flush=True)
        started = time.perf_counter()
        warm_up(app)  # a compiler that cannot build stops the start here, in one line (run_command)
        print(f"blockpress: warmed up in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    # that a key is required, never the key: the line lands in logs and terminals others read
    access = "; requests to /v1 need the API key" if api_key is not None else ""
    print(f"blockpress serving {name!r} on http://{url_host}:{port}/v1{access}", file=sys.stderr)
    if api_key is None and not ipaddress.ip_address(host).is_loopback:
        print(f"blockpress: no API key, so anyone who reaches {url_host}:{port} can use the model: set "
              "BLOCKPRESS_API_KEY (or --api-key) to require one", file=sys.stderr)
    try:
        _server_class()(uvicorn.Config(app, log_level="warning", http=header_deadline_protocol(),
                                       timeout_graceful_shutdown=args.shutdown_timeout)).run(sockets=[sock])
    except KeyboardInterrupt as exc:  # uvicorn raises the Ctrl-C again once shut down: the last line, said as the
        # stop's, on the line after "stopping" (run_command's went off a "^C" long gone: a blank line between)
        print(f"blockpress serve: {stop_word(exc)}", file=sys.stderr)
        return stop_status(exc)
    return 0


def _server_class() -> type:
    import asyncio
    import contextlib
    import signal

    import uvicorn

    from blockpress.stopping import on_signals

    class Server(uvicorn.Server):
        """uvicorn's server, saying what a stop signal does (uvicorn says it at INFO, below our log level: a
        server finishing a long request looked hung)."""

        signals = 0  # stop signals received
        loop: asyncio.AbstractEventLoop | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signals += 1
            if self.signals == 1:
                grace = self.config.timeout_graceful_shutdown  # None (uvicorn's default): no limit
                print(f"{fresh_line(sig)}blockpress: stopping; requests in flight get "
                      + ("all the time they take" if grace is None else f"up to {grace:g} s")
                      + " to finish (signal again to stop now)", file=sys.stderr)
                return super().handle_exit(sig, frame)
            engine = self._engine()
            if self.signals == 2 and engine is not None and self.loop is not None:
                # Stop now: end the grace period by cutting what is in flight (each request a 503), so the shutdown
                # finishes as at the grace period's end and the engine thread is joined. uvicorn's own second
                # signal forces the exit: only SIGINT's (a second SIGTERM waited out the grace period), and its
                # skipped shutdown left the requests a bare 500 and the engine thread inside torch (rc 134).
                # Scheduled on the loop: this handler may interrupt the loop's thread while it holds the
                # engine's lock.
                print(f"{fresh_line(sig)}blockpress: stopping now; requests in flight are cut", file=sys.stderr)
                self.loop.call_soon_threadsafe(engine.cut)
                return None
            self.force_exit = True  # a third signal: uvicorn's forced exit, whatever is left

        def _engine(self) -> Any:
            return getattr(getattr(self.config.app, "state", None), "engine", None)

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            """uvicorn's SIGINT and SIGTERM, and a SIGHUP (the terminal closed: an ssh session that dropped) taken
            as they are: it killed the server where it stood, each request in flight a dropped connection ("Server
            disconnected without sending a response") rather than finished in the grace period. uvicorn raises the
            signal again once shut down (after ours is put back), so the exit status is still SIGHUP's."""
            hangup = getattr(signal, "SIGHUP", None)
            with super().capture_signals(), on_signals(() if hangup is None else (hangup,), self.handle_exit):
                yield

        async def shutdown(self, sockets: Any = None) -> None:
            # The grace period ends here, a moment before uvicorn cancels the requests still running: cut them
            # first, so they get a 503 (a stream: an error event) and the engine stops within a step (a cancel
            # alone answered a bare 500 and left the engine generating for nobody, and the exit aborted).
            engine, grace = self._engine(), self.config.timeout_graceful_shutdown
            if engine is not None and grace is not None:  # None: uvicorn waits for them without a limit
                asyncio.get_running_loop().call_later(grace, engine.cut)
            await super().shutdown(sockets)

    return Server


def bind_socket(host: str, port: int) -> Any:
    """A listening socket on host:port, or an error that names them."""
    import socket

    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        # As uvicorn does: IPv4 unless the host is an IPv6 address ("localhost" may list ::1 first, and clients
        # of http://127.0.0.1 would then be refused).
        info = next((a for a in found if a[0] == socket.AF_INET), found[0]) if ":" not in host else found[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        raise OSError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def cmd_bench(args: argparse.Namespace) -> int:
    from blockpress.bench import PLOT_FORMATS, BenchSettings, plot, run_bench

    if args.model is not None:
        preset = args.model[len(RANDOM_PREFIX):] if args.model.startswith(RANDOM_PREFIX) else None
        raise ValueError("--model: bench times random weights of a preset's shape, never a checkpoint; "
                         + (f"use --preset {preset}" if preset else
                            "use --preset tiny, small, medium or 26b-a4b (a checkpoint's speed: the stats line of "
                            "`blockpress generate --model M`)"))
    s = BenchSettings(preset=args.preset, batch_sizes=args.batch_sizes, new_tokens=args.new_tokens, steps=args.steps,
                      prompt_length=args.prompt_length, repeats=args.repeats, reference=not args.no_reference,
                      ar=not args.no_ar, dtype=args.dtype, device=args.device, compile=args.compile,
                      cuda_graphs=args.cuda_graphs, canvas_lengths=args.canvas_lengths, quantize=args.quantize)
    # Found now, not after minutes of benchmarking.
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag}: no folder {str(Path(path).parent)!r} to write {path!r} into")
        if path and Path(path).is_dir():
            raise ValueError(f"{flag}: {path!r} is a folder; give a file name")
        if path and not os.access(Path(path).resolve().parent, os.W_OK):  # a read-only disk, another user's folder:
            # the first write, after the first row (minutes at a large preset), was the first to find it
            raise ValueError(f"{flag}: cannot write into the folder {str(Path(path).parent)!r} (read-only, or not "
                             "yours)")
    if args.plot and Path(args.plot).suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise ValueError(f"--plot: expected a file ending in one of {', '.join('.' + f for f in PLOT_FORMATS)}, "
                         f"got {args.plot!r}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # run_command names the extra that has it
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    def write(result: dict[str, Any], done: bool) -> None:
        """--out and --plot as the run stands: after each row too, so a sweep cut short (a timeout, a failure at a
        larger batch) keeps the rows it measured, its JSON marked "partial"."""
        if args.plot:
            result["plot"] = str(args.plot)
        if args.out:  # written beside it, then moved into place: a kill while it writes leaves the last one whole
            out = Path(args.out)
            written = out.with_name(f".{out.name}.partial")
            try:
                written.write_text(json.dumps(result if done else {**result, "partial": True}, indent=2) + "\n")
                os.replace(written, out)
            except OSError as exc:  # a full disk: the half-written file went on lying beside it, and the error
                # ("[Errno 28] No space left on device") named no file
                try:
                    written.unlink(missing_ok=True)
                except OSError:
                    pass
                raise OSError(f"--out {args.out}: cannot write it ({exc.strerror or exc})") from None
        if args.plot:  # (matplotlib is there: checked above)
            plot(result, args.plot)

    measured: dict[str, Any] = {}  # the result as of the last row measured

    def on_row(so_far: dict[str, Any]) -> None:
        measured.update(so_far)
        write(so_far, done=False)

    try:
        result = run_bench(s, on_row=on_row)
    except OSError:  # --out could not be written (a full disk): the rows measured still go to stdout, as on a Ctrl-C
        if measured.get("rows"):
            print(json.dumps({**measured, "partial": True}, indent=2))
        raise
    except KeyboardInterrupt as exc:
        # The rows measured are the run's result, as a cut-short generate --json's text is: on stdout too (they were
        # in --out alone, and without it lost: exit 130, nothing said).
        rows = len(measured.get("rows", []))
        print(fresh_line(exc), end="", file=sys.stderr, flush=True)  # off the terminal's "^C"
        if rows:
            print(json.dumps({**measured, "partial": True, "interrupted": True}, indent=2))
        print(f"bench: {stop_word(exc)} after {rows} row{'s' if rows != 1 else ''}"
              + (f" (their JSON on stdout{' and in ' + str(args.out) if args.out else ''}, marked \"partial\")"
                 if rows else ""), file=sys.stderr)
        return stop_status(exc)
    if args.plot:
        result["plot"] = str(args.plot)
    try:
        print(json.dumps(result, indent=2))  # first: whatever fails after this, the figures are on screen
    finally:  # and --out gets the whole run when stdout's reader has gone (`| true`): it kept the last row's "partial"
        write(result, done=True)
    return 0


_Namespace = TypeVar("_Namespace")


class CommandParser(argparse.ArgumentParser):
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
            # a puzzle whose first cell is empty ('-') reads to argparse as a flag it does not know
            cells = set("0123456789.-_*|+")
            dashed = self.prog.endswith(" sudoku") and any(e.startswith("-") and len(e) > 9 and set(e) <= cells
                                                            for e in extras)
            self.error(f"unrecognized arguments: {' '.join(extras)}"
                       + ("; a puzzle that starts with '-' goes after -- (blockpress sudoku [FLAGS] -- PUZZLE)"
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


def flags_of(command: str) -> dict[str, str]:
    """`command`'s settings by name, as the flags that set them: its options' own names, and FLAG_OF's."""
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
    """`message` with the setting it starts with ("max_new_tokens: ...") named as the flag `flag_of` maps it to,
    and so where it suggests a value for one of them ("...; prompt_max 56 fits": "--prompt-max 56")."""
    name, sep, rest = message.partition(":")
    names = name.split("/")  # a check of two settings together names both: "prompt_min/prompt_max: ..."
    if not (sep and all(n in flag_of for n in names)):
        return message
    for n in names:
        rest = re.sub(rf"(?<![\w-]){re.escape(n)} (?=[0-9])", f"{flag_of[n]} ", rest)
    return "/".join(flag_of[n] for n in names) + sep + rest


def add_input_args(p: argparse.ArgumentParser, title: str, line: str) -> None:
    """--input FILE and its companions (generate's and infill's batch-file mode); `line`: what a line holds."""
    g = p.add_argument_group(title)
    g.add_argument("--input", default=None, metavar="FILE",
                   help=f"a JSONL file (- for standard input), a line each: {line} (docs/cli.md); other keys (\"id\") "
                        "are copied to the output line; read and checked whole before anything runs")
    g.add_argument("--output", default=None, metavar="FILE",
                   help="write the results here (default: standard output): a JSON object a line, in input order, "
                        "--json's fields (but tok_s, seconds and interrupted) with `line` (the input line) and the copied keys, "
                        "each written as soon as the lines before it are")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    g.add_argument("--resume", action="store_true",
                   help="continue an existing --output file: the input lines it holds are skipped, the rest appended")
    g.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="rows a call (rows of similar length together; each row's result is what it gives alone)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="blockpress",
        description="Run block-diffusion language models (DiffusionGemma and our own small ones) locally.",
    )
    # the package's own figure, which pyproject.toml's version is read from: the installed metadata can be an
    # editable install's, written before __version__ last changed
    ap.add_argument("--version", action="version", version=f"blockpress {blockpress.__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)

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
                   help="print only the final text (no live canvas); after a Ctrl-C, the text committed until then")
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
                   help="print one JSON object: text, prompt, new_tokens, forward_passes, tokens_per_forward, tok_s, "
                        "seconds, seed (the one the text was drawn with, fresh each run without --seed: --seed "
                        "with it repeats the text), interrupted (true after a Ctrl-C: text is what was committed "
                        "until then, the figures too, seed null unless --seed was given; with --ar, which prints its "
                        "text once done, only text null, prompt and seed; exit status 130)")
    add_input_args(p, "many prompts from a file (instead of PROMPT)",
                   '{"prompt": "text"} or {"messages": [...]} (a conversation, through the chat template as --chat '
                   'renders one; --system comes first), with its own new-token limit and seed where it gives them')
    p.set_defaults(func=cmd_generate)

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
                        "whole)")
    add_input_args(p, "many templates from a file (instead of TEMPLATE)",
                   '{"template": "text with <|hole|> markers"}, with its own "prefix" (--prefix\'s context) and '
                   'seed where it gives them')
    p.set_defaults(func=cmd_infill)

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
                        "drawn when --seed is not given: lm.chat(..., seeds=[seed]) repeats the reply)}, "
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
    p.add_argument("--out", required=True, help="output folder (checkpoint, metrics.jsonl, trainer_state.pt)")
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

    p = sub.add_parser("sudoku", formatter_class=DefaultsFormatter, help="solve sudoku puzzles with a block-diffusion model",
                       description="Solve PUZZLE(s): 81 characters each, 0 . - _ or * for an empty cell (a puzzle "
                                   "that starts with - goes after --). The givens are "
                                   "fixed positions of the canvas; the model alone fills the rest (no rules, no "
                                   "search), unless --rules. Default model: blockpress-sudoku. Exit status: 0 "
                                   "when every answer is a valid solution, 1 when any is not, 2 for bad input.")
    p.add_argument("puzzles", nargs="*", help="puzzles, 81 characters each (or words that add up to one: a grid's 9 "
                   "rows, or its 81 cells one a word); - reads them from standard input (as --file - does; standard "
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
    p.add_argument("--steps", "--max-denoising-steps", dest="steps", type=int, default=None,
                   help="max denoising steps (default: the model's; 81 for blockpress-sudoku)")
    p.add_argument("--sampler", choices=["entropy_bound", "confidence", "topk", "greedy"], default=None,
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
                        "--max-model-len; default: the model's context, max_position_embeddings)")
    p.add_argument("--max-body-bytes", type=int, default=None, metavar="BYTES",
                   help="the largest request body taken; a larger one gets a 413 before it is read (from its "
                        "Content-Length, or as soon as a chunked body passes it). Default: room for the context's "
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
                        "so only clients outside a browser, and pages served from the server's own origin, can)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key of every request to /v1 (`Authorization: Bearer KEY`, the header the openai "
                        "client sends the key it is given in; others get a 401; /health and /metrics stay open), as vLLM's "
                        "--api-key. Default: the BLOCKPRESS_API_KEY environment variable, else no key; prefer the "
                        "variable, since a flag's value shows in the process list")
    add_template_kwargs_arg(p, " of every chat request (a request's own win, name by name)")
    p.set_defaults(func=cmd_serve)

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
    p.add_argument("--plot", default=None, help="write a plot of tok/s against batch size here (.png, .svg, .pdf, "
                                                 ".jpg, .jpeg or .webp: the suffix picks the format)")
    p.add_argument("--out", default=None, help="also write the JSON here (and the plot, with --plot) after each "
                                                "row too, marked \"partial\": true until the run ends: a sweep cut "
                                                "short keeps the rows it measured")
    p.set_defaults(func=cmd_bench)

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
                        "tensor cores) or int4 (weights, groups of 32: for memory, not speed); see "
                        "docs/quantization.md")
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
    return ap


# Optional packages: the extra of pyproject.toml that installs each, and what needs it, by command ("*": any other).
# peft is needed by train's --lora-rank and by every command that loads a LoRA adapter: a message naming
# --lora-rank to `generate --model OUT/adapter` named a flag generate does not have.
EXTRA_OF = {"fastapi": ("serve", {"*": "blockpress serve"}), "uvicorn": ("serve", {"*": "blockpress serve"}),
            "peft": ("train", {"train": "--lora-rank", "*": "a LoRA adapter: --adapter, or an adapter folder as --model"}),
            "matplotlib": ("train", {"bench": "--plot", "*": "loss.png"})}


class OutputError(Exception):
    """A write to standard output failed for a reason other than its reader going away (a full disk, `> /dev/full`,
    a descriptor the shell closed, `>&-`): the command's output is lost, and the run ends saying so (exit 1)."""


class GuardedStdout(io.RawIOBase):
    """Descriptor 1 under the command's sys.stdout (guard_stdout), its failures raised as OutputError: as the
    OSError they were, a full disk ended in "error: [Errno 28] No space left on device", status 2 (a bad argument's)
    or, once the interpreter's last flush met it, 120 and "Exception ignored ... OSError", and never said that
    standard output was what failed. After one failure the rest is dropped, so the run's end cannot fail again. `fd`
    None: no standard output at all (`>&-`), where Python's sys.stdout was None, and generate failed on
    None.isatty() and info printed nothing with status 0. A reader gone away stays a BrokenPipeError (141, quietly)."""

    def __init__(self, fd: int | None):
        super().__init__()
        self.fd, self.failed = fd, False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        if self.fd is None:
            raise io.UnsupportedOperation("standard output is closed")
        return self.fd

    def isatty(self) -> bool:
        return self.fd is not None and os.isatty(self.fd)

    def write(self, data: Any) -> int:
        size = len(memoryview(data))
        if self.failed:
            return size
        try:
            if self.fd is None:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            return os.write(self.fd, data)
        except (BrokenPipeError, BlockingIOError):
            raise
        except OSError as exc:
            self.failed = True
            raise OutputError(exc.strerror or str(exc)) from None


def guard_stdout() -> Any:
    """Point sys.stdout at a GuardedStdout on descriptor 1, with the encoding, error handler and buffering Python
    gave it; returns the stream it replaced (to put back), or False where it was left as it is: a caller's own
    stream (a test's capture) and a Windows console, whose stream is not a plain descriptor."""
    old = sys.stdout
    if old is not None and old is not sys.__stdout__:
        return False
    fd = None
    if old is not None:
        try:
            fd = old.fileno()
            old.flush()
        except (OSError, ValueError):
            return False
        if sys.platform == "win32" and old.isatty():
            return False
    raw = GuardedStdout(fd)
    # PYTHONUNBUFFERED (-u) gives stdout no buffer under its text layer: kept so
    unbuffered = old is not None and not isinstance(getattr(old, "buffer", None), io.BufferedIOBase)
    sys.stdout = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                  encoding=getattr(old, "encoding", None) or "utf-8",
                                  errors=getattr(old, "errors", None) or "strict",
                                  newline=None if sys.platform == "win32" else "\n",
                                  line_buffering=getattr(old, "line_buffering", False),
                                  write_through=unbuffered or getattr(old, "write_through", False))
    return old


def silence_output() -> None:
    """Point stdout and stderr at the null device: after a broken pipe, any later write (the interpreter's last
    flush, an error line) would hit it again and end in a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a stream without a file descriptor (a test's capture) has nothing to flush there
            pass
    os.close(devnull)


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:
    """warnings.showwarning for the command line: `warning: MESSAGE` on stderr, as its errors are lines of their
    own (Python's form names a file and line of blockpress and prints that line of its source)."""
    stream = sys.stderr if file is None else file
    if stream is not None:  # no console at all (pythonw): nowhere to say it
        print(f"warning: {message}", file=stream)


def print_warning(message: str) -> None:
    """A command's own warning (a flag that cannot act as given, a file left out): the line show_warning gives the
    library's, so a script that looks for `warning:` on stderr finds every one."""
    show_warning(message, UserWarning, __file__, 0)


def is_utf8(stream: Any) -> bool:
    """Whether text stream `stream` encodes as UTF-8 (a stream without an encoding, a test's capture, counts)."""
    import codecs

    encoding = getattr(stream, "encoding", None)
    return not encoding or codecs.lookup(encoding).name in ("utf-8", "utf-8-sig")


def utf8_stdio() -> None:
    """Standard output written, and standard input read, as UTF-8 when they are a file or pipe: the encoding every
    file blockpress reads and writes has. Python gives them the locale's, which on Windows is an ANSI code page
    (cp1252): `generate ... > out.txt` ended in "'charmap' codec can't encode character" after the whole
    generation for any text outside it (CJK, emoji, "✓"), and a piped UTF-8 prompt was read as mojibake ("grüße"
    as "grÃ¼ÃŸe"), silently. Stdin keeps surrogateescape, so bytes that are not UTF-8 reach the prompt checks,
    which name them. A terminal keeps its own encoding (a Windows console is UTF-8 already); one that cannot show
    a character gets "?" rather than the error."""
    stdout, stdin = sys.stdout, sys.stdin
    if stdout is not None and hasattr(stdout, "reconfigure") and not is_utf8(stdout):
        if stdout.isatty():
            stdout.reconfigure(errors="replace")
        else:
            stdout.reconfigure(encoding="utf-8")
    if stdin is not None and hasattr(stdin, "reconfigure") and not stdin.isatty():
        try:  # a BOM (Notepad's, PowerShell's) is no part of the prompt, under a UTF-8 locale too
            stdin.reconfigure(encoding="utf-8-sig", errors="surrogateescape")
        except (OSError, ValueError):  # read from already (an embedding caller): the encoding can no longer change
            pass


def output_failed(exc: BrokenPipeError | OutputError, who: str) -> int:
    """The status of a run whose standard output failed: its reader gone away (`| head`: quietly, 128 + SIGPIPE, as
    Unix tools stop), or a write that failed (GuardedStdout: said under `who`, a runtime error's 1)."""
    if isinstance(exc, BrokenPipeError):
        silence_output()
        return 141
    print(f"{who}: error: cannot write to standard output: {exc}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    utf8_stdio()
    replaced = guard_stdout()
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help, --version: their text is out once flushed, and that can fail too
            if exc.code in (0, None) and sys.stdout is not None:
                sys.stdout.flush()
            raise
        # Set for the command's run alone, not on import: the library's users keep Python's warnings.
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            # Each run says each of its warnings once: a new filter also clears the record of warnings an earlier
            # main() in this process already showed (a test, a notebook), which would silence them here.
            warnings.filterwarnings("default", category=UserWarning)
            return run_command(args)
    except (BrokenPipeError, OutputError) as exc:  # the parser's (a command's own are run_command's)
        return output_failed(exc, "blockpress")
    finally:
        if replaced is not False:  # the caller's stream back, ours flushed (a failure in it was said, or is moot)
            try:
                sys.stdout.flush()
            except (OutputError, OSError, ValueError):
                pass
            sys.stdout = replaced


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command; a bad argument, a missing optional package or a broken pipe ends it with the exit
    status the README lists, and a message under the command's name."""
    # libgomp (torch's OpenMP on Linux) has each idle thread spin 300,000 times before it sleeps. Beside other work
    # those spins take the cores the other threads wait for: blockpress-code wrote 6-8 tok/s on 2 busy cores against
    # 14-20 sleeping at once, and 50 alone either way. 10,000 spins kept 47-51 alone and gave 13-19 there. Set before
    # the command imports torch (the parser imports none), and only where the user set no value of their own.
    os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPINS))
    try:
        if getattr(args, "threads", 0):
            if args.threads < 0:
                raise ValueError(f"--threads: expected 0 (torch's default) or more, got {args.threads}")
            cpus = os.cpu_count()
            if cpus is not None and args.threads > cpus:  # 100000: a segmentation fault in torch's thread pool
                raise ValueError(f"--threads: expected 0 (torch's default) to {cpus}, the CPUs of this machine "
                                 f"(more threads only wait for one), got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        if getattr(args, "device", None) == "auto":  # (the default) named before the command reads it: its notes,
            # torchrun's GPU per process and its --json say the device the run is on
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.command in ("train", "serve"):  # each takes its stop signals itself (a save; uvicorn's shutdown)
            code = args.func(args)
        else:
            with stop_signals_interrupt():
                code = args.func(args)
        if sys.stdout is not None:  # a reader gone away (`| head`) is met here, not in the interpreter's last flush
            sys.stdout.flush()
        return code
    except ImportError as exc:
        package = (exc.name or "").partition(".")[0]
        # only a package that is missing: one installed but too old fails with its own message
        if package not in EXTRA_OF or not isinstance(exc, ModuleNotFoundError) or exc.name != package:
            raise
        extra, uses = EXTRA_OF[package]
        print(f"blockpress {args.command}: error: {package} is not installed (needed for "
              f"{uses.get(args.command, uses['*'])}); pip install 'blockpress[{extra}]'", file=sys.stderr)
        return 2
    except (BrokenPipeError, OutputError) as exc:  # before OSError's: not the arguments' fault
        return output_failed(exc, f"blockpress {args.command}")
    except (ValueError, OSError) as exc:  # OSError: a missing, unreadable or existing path
        flagged = ("generate", "infill", "chat", "bench", "sudoku", "info", "serve", "quantize")
        message = as_flags(str(exc), flags_of(args.command)) if args.command in flagged else str(exc)
        if args.command == "train":
            message = as_flags(message, train_flag_of())
        print(f"blockpress {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a command without its own handling, or before it (while loading)
        # said, as the commands' own handlers say it: a Ctrl-C while the model loaded exited 130 without a word
        print(f"{fresh_line(exc)}blockpress {args.command}: {stop_word(exc)}", file=sys.stderr)  # off the "^C"
        return stop_status(exc)
    except RuntimeError as exc:
        if getattr(args, "compile", False) and compile_failed(exc):
            print(f"blockpress {args.command}: error: {compile_failure(exc)}", file=sys.stderr)
            return 2
        if not out_of_memory(exc):
            raise
        print(f"blockpress {args.command}: error: {out_of_memory_message(exc, args.command)}", file=sys.stderr)
        return 1


# What uses the memory a command ran out of, and the flags that take less (each command's own).
OOM_HINTS = {
    "generate": "a smaller --max-new-tokens or --prefill-chunk, fewer prompts at once, or --quantize int8 / fp8 "
                "take less",
    "chat": "a smaller --max-new-tokens or --prefill-chunk, or --quantize int8 / fp8 take less",
    # sudoku's canvas is always 81 cells after an 83-token prompt: its memory is the batch, a row per puzzle and view
    "sudoku": "a smaller --batch-size (puzzles at once), a smaller --ensemble (each view is a row of the batch), or "
              "--quantize int8 / fp8 take less",
    "infill": "smaller holes, a smaller --prefill-chunk, or --quantize int8 / fp8 take less",
    "bench": "smaller --batch-sizes or --new-tokens take less (the rows measured so far are in --out)",
    "train": "a smaller --micro-batch-size takes less (gradient accumulation keeps --batch-size); so does "
             "--max-canvases",
}


def out_of_memory_message(exc: BaseException, command: str, before_hint: str = "") -> str:
    """"the device ran out of memory (torch's first line); ..." with what takes less for `command` (OOM_HINTS)."""
    reason = (str(exc).splitlines() or [""])[0]
    hint = OOM_HINTS.get(command, "a smaller model, --dtype bfloat16, or --quantize")
    return f"the device ran out of memory ({reason}); {before_hint}{hint}"


def compile_failed(exc: BaseException) -> bool:
    """torch.compile's own error (dynamo's, inductor's wrapped in it: no C++ compiler, say), checked without
    importing torch's compiler for a run that never compiled."""
    errors = sys.modules.get("torch._dynamo.exc")
    return errors is not None and isinstance(exc, errors.TorchDynamoException)


def release_device_memory() -> None:
    """Hand the blocks torch's caching allocator holds back to the GPU after an out-of-memory error, so the next
    try (a shorter reply, another request) starts from what is really in use."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (a GPU's), checked without importing torch for a command that never did."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ()))


if __name__ == "__main__":
    sys.exit(main())
