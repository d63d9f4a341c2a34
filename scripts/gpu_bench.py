"""Prepared GPU speed check (issue 7): diffusion vs AR decoding on one checkpoint shape, JSON to a folder.

Default: the DiffusionGemma 26B-A4B shape with random bf16 weights, batch 1, 4,096-token prompt,
256-token canvas, 16 fixed denoising steps (adaptive stopping off, EOS disabled so the work is fixed),
then the same weights decoding 256 tokens autoregressively. Sized to finish well inside 8 minutes on
an H200; on a CPU use --preset tiny for a smoke run.

    python scripts/gpu_bench.py --out $OUT                       # on the GPU machine
    python scripts/gpu_bench.py --preset tiny --device cpu --prompt-length 16 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import blockpress
from blockpress.bench import describe_run_memory, profile_ops, run_memory
from blockpress.checkpoint import available_bytes
from blockpress.config import preset_names
from blockpress.generate import canvas_positions
from blockpress.model import GROUPED_MM

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}
# What the rates mean (written into the JSON): the same names as `blockpress bench`'s, for the same quantities.
# tok_s was the rate after the prefill here and with it in bench, one name for two figures.
FIGURES = {
    "tok_s": "new tokens / wall time of the whole generate call, prefill included (as bench's tok_s)",
    "tok_s_without_prefill": "tokens made after the prefill / the time after it (generate's denoise_seconds); "
                             "diffusion: every new token; AR: all but the first, which the prefill's logits give",
    "ms_per_step": "diffusion: denoise_seconds / decoder passes, the committed canvases' encoder passes included "
                   "(bench's ms_per_step leaves them out)",
    "ms_per_token": "AR: denoise_seconds / the one-token passes after the prefill (new tokens - 1)",
    "diffusion_over_ar": "diffusion tok_s / AR tok_s, only when both made the same new tokens (--ar-tokens equal to "
                         "--new-tokens): each spreads one prefill over its tokens; diffusion_over_ar_without_prefill: "
                         "of tok_s_without_prefill, a rate per token after it, whatever the counts",
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], blockpress.generate.GenerationOutput],
          device: torch.device) -> tuple[blockpress.generate.GenerationOutput, float]:
    """fn's output and its wall seconds, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def diffusion_rates(out: blockpress.generate.GenerationOutput, seconds: float) -> dict[str, float]:
    """A diffusion run's tok_s (with its prefill: `seconds` is the whole call) and tok_s_without_prefill."""
    n = int(out.num_new_tokens[0])
    return {"tok_s": n / seconds, "tok_s_without_prefill": n / out.denoise_seconds}


def ar_rates(out: blockpress.generate.GenerationOutput, seconds: float) -> dict[str, float | None]:
    """An AR run's new tokens, its tok_s (with its prefill), and after it: the prefill's logits give the first
    token, so n tokens take n - 1 passes after it (None for one token). The count goes with every rate, as tok_s
    compares only at equal counts (a run's one prefill is spread over them)."""
    n = int(out.num_new_tokens[0])
    after = n - 1
    return {"new_tokens": n, "tok_s": n / seconds,
            "tok_s_without_prefill": after / out.denoise_seconds if after else None,
            "ms_per_token": out.denoise_seconds * 1e3 / after if after else None}


def diffusion_over_ar(diffusion: dict, ar: dict) -> dict[str, float | str]:
    """The engines' ratios (see FIGURES). With the prefill, only for equal new tokens: a 4,096-token prompt's prefill
    spread over 256 diffusion tokens but 64 AR ones (the prepared session's --ar-tokens) flattered diffusion by its
    share of the AR run. After the prefill both are rates per token, comparable whatever the counts."""
    ratios: dict[str, float | str] = {}
    if diffusion["new_tokens"] == ar["new_tokens"]:
        ratios["diffusion_over_ar"] = diffusion["tok_s"] / ar["tok_s"]
    else:
        ratios["diffusion_over_ar_omitted"] = (
            f"diffusion made {diffusion['new_tokens']} new tokens, AR {ar['new_tokens']}: their tok_s spread one "
            "prefill over different counts (--ar-tokens equal to --new-tokens compares them)")
    if ar["tok_s_without_prefill"]:
        ratios["diffusion_over_ar_without_prefill"] = diffusion["tok_s_without_prefill"] / ar["tok_s_without_prefill"]
    return ratios


def graphed_ar_run(lm: blockpress.LM, prompt: torch.Tensor, new_tokens: int,
                   device: torch.device) -> tuple[blockpress.generate.GenerationOutput, float, int]:
    """The AR baseline's timed run with its encoder pass replayed from a CUDA graph (lm.cuda_graphs() on), its wall
    seconds, and the graphs it captured inside it (0: every token replayed). The untimed run before it has the
    same shape: a graph is keyed on the cache's capacity, prompt + new tokens + 1, so a shorter warm-up's graph
    was no use to the timed run, which then paid a capture of its own."""
    lm.generate_ar(prompt, max_new_tokens=new_tokens)  # captures
    sync(device)
    before = lm.step_functions.encode_step.captures
    out, seconds = timed(lambda: lm.generate_ar(prompt, max_new_tokens=new_tokens), device)
    return out, seconds, lm.step_functions.encode_step.captures - before


def what_cannot_fit(cfg: blockpress.ModelConfig, args: argparse.Namespace, device: torch.device) -> str | None:
    """Why the weights and the longest run's cache and logits cannot fit on the device (run_memory, as `blockpress
    bench` counts them), or None: found before any weight is made, where torch's allocator failed after the
    26B-A4B model was built (minutes of a timed lease)."""
    new = max(args.new_tokens, args.ar_tokens)
    taken, limit = args.prompt_length + canvas_positions(new, cfg.canvas_length), cfg.text.max_position_embeddings
    if taken > limit:
        return (f"--prompt-length/--new-tokens/--ar-tokens: {args.prompt_length} prompt + {new} new tokens in whole "
                f"{cfg.canvas_length}-token canvases ({taken} positions) exceed the {args.preset} preset's context of "
                f"{limit} tokens")
    free = available_bytes(device)
    if free is None:
        return None
    meta = blockpress.random_model(cfg, dtype=args.dtype, device="meta")
    weights = meta.weights_bytes()
    if weights > free:
        return (f"--preset/--dtype: {args.preset} in {args.dtype} needs {weights / 1e9:.1f} GB of weights on {device} "
                f"but {free / 1e9:.1f} GB are available")
    run = run_memory(cfg.text, meta.dtype, 1, args.prompt_length, new, cfg.canvas_length)
    if weights + sum(run.values()) <= free:
        return None
    return (f"--prompt-length/--new-tokens/--ar-tokens: {args.prompt_length} prompt + {new} new tokens need at least "
            f"{describe_run_memory(run)} on {device} beside {weights / 1e9:.1f} GB of {args.preset} weights in "
            f"{args.dtype}, but {free / 1e9:.1f} GB are available")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="26b-a4b", choices=preset_names(), help="model shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-length", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--ar-tokens", type=int, default=256)
    ap.add_argument("--out", required=True, help="folder for result.json")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode for the compiled phase ('none' skips it; 'reduce-overhead' = CUDA graphs)")
    ap.add_argument("--compile-if-under-s", type=float, default=240.0,
                    help="run the compiled phase only if the eager phases took less than this (time limits)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="also time diffusion with CUDA-graph replay of the decoder (CUDA only)")
    ap.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                    help="last phase: quantize the model to FP8 in place (blockpress.quantize) and time it again, "
                         "with its logits' error against the unquantized weights")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="record the busiest and most frequent ops of each engine (torch.profiler)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device(args.device)
    cfg = blockpress.ModelConfig.preset(args.preset)
    cfg.text.eos_token_id = None
    if (why := what_cannot_fit(cfg, args, device)) is not None:
        ap.error(why)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "gpu_bench", "args": vars(args), "torch": torch.__version__,
                    "grouped_mm": getattr(GROUPED_MM, "__name__", None), "figures": FIGURES}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)

    def note(message: str) -> None:
        """A progress line on stderr (stdout carries the JSON), flushed: the session's log then says which phase a
        timeout cut, where it held nothing until the end."""
        print(f"gpu_bench [{time.perf_counter() - t_start:.0f} s]: {message}", file=sys.stderr, flush=True)

    def save(done: str | None = None) -> None:  # after every phase, so a timeout still leaves what was measured
        # written beside it, then moved into place: a kill while it writes (the session's timeout) leaves the last
        # one whole, where it left a truncated file that the session then copied as bench.json
        written = out_dir / ".result.json.partial"
        written.write_text(json.dumps(result, indent=2))
        os.replace(written, out_dir / "result.json")
        if done is not None:
            note(done)

    note(f"building the {args.preset} model ({args.dtype}, {device})")
    t0 = time.perf_counter()
    lm = blockpress.random_model(cfg, seed=0, dtype=args.dtype, device=device)
    sync(device)
    result["init_seconds"] = time.perf_counter() - t0
    result["params_total"], result["params_active"] = cfg.num_parameters(), cfg.num_parameters(active=True)
    save(f"model built in {result['init_seconds']:.1f} s")
    v = cfg.text.vocab_size
    prompt = torch.randint(3, v, (1, args.prompt_length), generator=torch.Generator().manual_seed(0))

    def diffusion() -> blockpress.generate.GenerationOutput:
        return lm.generate(prompt, max_new_tokens=args.new_tokens, max_denoising_steps=args.steps, seed=0,
                           adaptive_stopping=False)

    note(f"diffusion: warm-up, then the timed run ({args.prompt_length} prompt, {args.new_tokens} new tokens, "
         f"{args.steps} steps)")
    diffusion()  # warm-up (allocator, kernels)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out, total = timed(diffusion, device)
    eager_out = out
    passes = int(out.forward_passes[0])
    result["diffusion"] = dict(
        new_tokens=int(out.num_new_tokens[0]), forward_passes=passes,
        tokens_per_forward=float(out.tokens_per_forward[0]), prefill_ms=out.encode_seconds * 1e3,
        ms_per_step=out.denoise_seconds * 1e3 / passes,
        **diffusion_rates(out, total),
    )
    if device.type == "cuda":
        result["diffusion"]["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    save(f"diffusion: {result['diffusion']['tok_s']:.1f} tok/s")

    note(f"ar: warm-up, then the timed run ({args.ar_tokens} new tokens)")

    lm.generate_ar(prompt, max_new_tokens=8)  # warm-up
    ar, total = timed(lambda: lm.generate_ar(prompt, max_new_tokens=args.ar_tokens), device)
    eager_ar = ar
    result["ar"] = dict(prefill_ms=ar.encode_seconds * 1e3, **ar_rates(ar, total))
    # Roofline: each decode pass must read at least the active weights once.
    bytes_per_pass = cfg.num_parameters(active=True) * torch.tensor([], dtype=lm.dtype).element_size()
    gpu = result.get("gpu", "")
    bandwidth = next((bw for name, bw in HBM_BYTES_PER_S.items() if name in gpu), None)
    if bandwidth:
        if result["ar"]["ms_per_token"]:
            result["ar"]["roofline_fraction"] = bytes_per_pass / bandwidth / (result["ar"]["ms_per_token"] / 1e3)
        result["diffusion"]["weights_roofline_fraction"] = (
            bytes_per_pass / bandwidth / (result["diffusion"]["ms_per_step"] / 1e3))
    result.update(diffusion_over_ar(result["diffusion"], result["ar"]))
    save(f"ar: {result['ar']['tok_s']:.1f} tok/s")
    # Both engines with their passes replayed from CUDA graphs (LM.cuda_graphs): same kernels, no per-op launches.
    if device.type == "cuda" and args.cuda_graphs:
        note("cuda graphs: diffusion capture, then the timed run")
        try:
            lm.cuda_graphs()
            t0 = time.perf_counter()
            diffusion()  # captures
            sync(device)
            capture_s = time.perf_counter() - t0
            before = lm.step_functions.denoise.captures  # (no name kept: it would hold the graphs through FP8)
            graphed, total = timed(diffusion, device)
            result["diffusion_cuda_graphs"] = dict(
                ms_per_step=graphed.denoise_seconds * 1e3 / int(graphed.forward_passes[0]),
                **diffusion_rates(graphed, total),
                same_tokens_as_eager=bool(torch.equal(graphed.sequences, eager_out.sequences)),
                # captures inside the timed run (0: every step replayed; the cache came back at the same memory)
                timed_run_captures=lm.step_functions.denoise.captures - before, first_run_seconds=capture_s)
            save(f"cuda graphs: diffusion {result['diffusion_cuda_graphs']['tok_s']:.1f} tok/s; now ar")
            graphed_ar, total, captures = graphed_ar_run(lm, prompt, args.ar_tokens, device)
            result["ar_cuda_graphs"] = dict(
                **ar_rates(graphed_ar, total),
                same_tokens_as_eager=bool(torch.equal(graphed_ar.sequences, eager_ar.sequences)),
                timed_run_captures=captures)
            if bandwidth and result["ar_cuda_graphs"]["ms_per_token"]:
                result["ar_cuda_graphs"]["roofline_fraction"] = (
                    bytes_per_pass / bandwidth / (result["ar_cuda_graphs"]["ms_per_token"] / 1e3))
        except Exception as exc:  # recorded, not raised, like the compiled phase
            result["cuda_graphs_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        lm.step_functions = None
        save("cuda graphs: " + ("failed (cuda_graphs_error)" if "cuda_graphs_error" in result else "done"))

    if args.profile:  # a short trace of each engine (2 denoising steps, 4 AR tokens, a 256-token prompt): cheap
        short = prompt[:, :256]
        note("profile: diffusion 2 steps, ar 4 tokens")
        try:
            result["profile"] = {
                "diffusion_2_steps": profile_ops(lambda: lm.generate(short, max_new_tokens=cfg.canvas_length,
                                                                     max_denoising_steps=2, seed=0,
                                                                     adaptive_stopping=False), device),
                "ar_4_tokens": profile_ops(lambda: lm.generate_ar(short, max_new_tokens=4), device),
            }
        except Exception as exc:  # recorded, not raised (a profiler that fails, CUPTI say): the FP8 phase still runs
            result["profile_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        save("profile: " + ("failed (profile_error)" if "profile_error" in result else "done"))

    # The same two engines through torch.compile (LM.compile). Eager figures are already saved, so a
    # failure or a timeout here loses nothing.
    if args.compile_mode != "none" and time.perf_counter() - t_start < args.compile_if_under_s:
        note(f"compiled ({args.compile_mode}): compiling, then the timed runs")
        try:
            lm.compile(**({} if args.compile_mode == "default" else {"mode": args.compile_mode}))
            t0 = time.perf_counter()
            diffusion()  # compiles
            result["compile_seconds"] = time.perf_counter() - t0
            out, total = timed(diffusion, device)
            result["diffusion_compiled"] = dict(ms_per_step=out.denoise_seconds * 1e3 / int(out.forward_passes[0]),
                                                **diffusion_rates(out, total))
            save(f"compiled: diffusion {result['diffusion_compiled']['tok_s']:.1f} tok/s; now ar")
            # the timed run's own shape: the cache's capacity (prompt + new tokens + 1) is in the compiled graph, so
            # a shorter warm-up left the timed run a recompile (2.3 tok/s against eager's 98 on the tiny preset)
            lm.generate_ar(prompt, max_new_tokens=args.ar_tokens)
            ar, total = timed(lambda: lm.generate_ar(prompt, max_new_tokens=args.ar_tokens), device)
            result["ar_compiled"] = ar_rates(ar, total)
        except Exception as exc:  # recorded, not raised: the eager figures stand on their own
            result["compile_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        save("compiled: " + ("failed (compile_error)" if "compile_error" in result else "done"))
    # FP8 weights and activations (vLLM's published setting), in place, so last: error, memory, speed.
    if args.fp8:
        note("fp8: quantizing, logits' error")
        try:
            lm.step_functions = None
            probe_prompt, probe_canvas = prompt[:, :512], torch.randint(3, v, (1, cfg.canvas_length),
                                                                         generator=torch.Generator().manual_seed(1))
            before = lm.logits(probe_prompt, probe_canvas)
            bytes_before = lm.weights_bytes()
            lm.quantize("fp8")
            after = lm.logits(probe_prompt, probe_canvas)
            result["fp8"] = dict(
                weights_gb=lm.weights_bytes() / 1e9, weights_gb_before=bytes_before / 1e9,
                logits_max_abs_error=float((after - before).abs().max()), logits_max_abs=float(before.abs().max()),
                top1_agreement=float((after.argmax(-1) == before.argmax(-1)).float().mean()),
                grouped_experts=all(getattr(m, "grouped_fp8", True) for m in lm.model.modules()))
            save("fp8: quantized; now diffusion")
            diffusion()  # warm-up
            out, total = timed(diffusion, device)
            result["fp8"].update(ms_per_step=out.denoise_seconds * 1e3 / int(out.forward_passes[0]),
                                 **diffusion_rates(out, total),
                                 grouped_experts=all(getattr(m, "grouped_fp8", True) for m in lm.model.modules()))
            save(f"fp8: diffusion {result['fp8']['tok_s']:.1f} tok/s; now ar")
            lm.generate_ar(prompt, max_new_tokens=8)  # warm-up: the FP8 kernels' first call stays out of the timing
            ar, total = timed(lambda: lm.generate_ar(prompt, max_new_tokens=min(64, args.ar_tokens)), device)
            result["fp8"].update({f"ar_{k}": v for k, v in ar_rates(ar, total).items()})
            save(f"fp8: ar {result['fp8']['ar_tok_s']:.1f} tok/s")
            if device.type == "cuda" and args.cuda_graphs:  # FP8 kernels, launched from a graph
                note("fp8: cuda graphs")
                try:
                    lm.cuda_graphs()
                    diffusion()  # captures
                    graphed, total = timed(diffusion, device)
                    result["fp8"].update({f"cuda_graphs_{k}": v for k, v in diffusion_rates(graphed, total).items()})
                except Exception as exc:  # recorded: the eager FP8 figures stand
                    result["fp8"]["cuda_graphs_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                lm.step_functions = None
        except Exception as exc:  # recorded, not raised
            result["fp8_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        save("fp8: " + ("failed (fp8_error)" if "fp8_error" in result else "done"))
    print(json.dumps(result, indent=2))
    note("done")


if __name__ == "__main__":
    main()
