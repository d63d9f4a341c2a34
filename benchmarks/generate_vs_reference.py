"""blockpress `generate` vs the reference transformers `generate`, same random checkpoint, same settings.

Prints one JSON object: tok/s (with and without prefill), tokens per forward, forward passes, and the
ratio blockpress / reference, measured side by side in one run (this machine is noisy: compare ratios).

    python benchmarks/generate_vs_reference.py --preset small   # ~15M params, canvas 64
    python benchmarks/generate_vs_reference.py --preset medium  # ~60M params, canvas 128
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings

import torch

import blockpress
from blockpress.config import PRESETS, ModelConfig


def preset_config(name: str) -> ModelConfig:
    return ModelConfig.preset(name)


def time_blockpress(lm, prompt, args):
    best = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = lm.generate(prompt, max_new_tokens=args.new_tokens, max_denoising_steps=args.steps, seed=0,
                          adaptive_stopping=False)
        total = time.perf_counter() - t0
        row = dict(seconds=total, denoise_seconds=out.denoise_seconds, new_tokens=int(out.num_new_tokens.sum()),
                   forward_passes=int(out.forward_passes.sum()), tokens_per_forward=float(out.tokens_per_forward.mean()))
        best = row if best is None or row["seconds"] < best["seconds"] else best
    return best


def time_reference(ref, prompt, args):
    best = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = ref.generate(prompt, max_new_tokens=args.new_tokens, max_denoising_steps=args.steps,
                               confidence_threshold=1e-30)  # never confident: fixed steps, like ours
        total = time.perf_counter() - t0
        new = out.sequences.shape[1] - prompt.shape[1]
        row = dict(seconds=total, new_tokens=int(new * prompt.shape[0]),
                   tokens_per_forward=float(out.tokens_per_forward.float().mean()))
        row["forward_passes"] = round(row["new_tokens"] / row["tokens_per_forward"])
        best = row if best is None or row["seconds"] < best["seconds"] else best
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DiffusionGemmaForBlockDiffusion

    cfg = preset_config(args.preset)
    # Random weights emit EOS at random: with no EOS id both engines do the same, fixed amount of work.
    cfg.text.eos_token_id = None
    lm = blockpress.random_model(cfg, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        lm.save(tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp).eval()
    prompt = torch.randint(3, cfg.text.vocab_size, (args.batch, args.prompt_length), generator=torch.Generator().manual_seed(0))
    ours = time_blockpress(lm, prompt, args)
    theirs = time_reference(ref, prompt, args)
    for row in (ours, theirs):
        row["tok_s"] = row["new_tokens"] / row["seconds"]
    result = dict(
        benchmark="generate_vs_reference", preset=args.preset, params=cfg.num_parameters(),
        active_params=cfg.num_parameters(active=True), batch=args.batch, new_tokens=args.new_tokens,
        steps=args.steps, canvas=cfg.canvas_length, prompt_length=args.prompt_length, threads=args.threads,
        blockpress=ours, reference=theirs, speedup=ours["tok_s"] / theirs["tok_s"],
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
