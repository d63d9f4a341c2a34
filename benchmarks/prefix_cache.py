"""What keeping prompts encoded between requests buys (`PrefixCache`, what `blockpress serve` does by default).

Two workloads, each run with and without a prefix cache on the same random checkpoint, side by side:
- chat: a system prompt, then turns; each turn's prompt is the whole conversation so far (the previous
  replies as generated) plus a new user message, as OpenAI-style clients send it;
- shared: independent requests that open with the same long system prompt.
Fixed work (adaptive stopping off, no EOS). Prints JSON: per workload, prompt tokens, tokens reused, encode
seconds and end-to-end seconds for both, and their ratios (no cache / cache).

    python benchmarks/prefix_cache.py --preset small --system-tokens 1024 --turns 6
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from benchmark_args import (
    PRESET_HELP,
    Formatter,
    fail,
    non_negative_int,
    positive_int,
    preset_name,
    preset_weights_that_cannot_fit,
    step_count,
)

import blockpress
from blockpress import ModelConfig, PrefixCache
from blockpress.generate import canvas_positions


def run_workload(lm: blockpress.LM, prompts: list, follow_replies: bool, kw: dict, prefix_cache: PrefixCache | None
                 ) -> dict:
    """Generate for each prompt in turn; with `follow_replies`, each prompt is the conversation so far plus it."""
    history: list[int] = []
    encode_s = total_s = 0.0
    prompt_tokens = reused = 0
    for i, piece in enumerate(prompts):
        prompt = history + piece if follow_replies else piece
        t0 = time.perf_counter()
        out = lm.generate([prompt], seed=i, prefix_cache=prefix_cache, **kw)
        total_s += time.perf_counter() - t0
        encode_s += out.encode_seconds
        prompt_tokens += len(prompt)
        reused += out.extra["reused_prompt_tokens"][0]
        if follow_replies:
            history = prompt + out.new_tokens[0].tolist()
    return {"prompt_tokens": prompt_tokens, "reused_tokens": reused, "encode_s": round(encode_s, 4),
            "total_s": round(total_s, 4)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--preset", type=preset_name, default="small",
                    help=PRESET_HELP)
    ap.add_argument("--system-tokens", type=non_negative_int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--user-tokens", type=positive_int, default=48, help="tokens of each new user message / question")
    ap.add_argument("--turns", type=positive_int, default=6, help="chat turns, and independent requests of `shared`")
    ap.add_argument("--new-tokens", type=positive_int, default=64, help="new tokens per request")
    ap.add_argument("--steps", type=step_count, default=16, help="denoising steps per canvas (fixed)")
    ap.add_argument("--threads", type=positive_int, default=2, help="CPU threads")
    ap.add_argument("--repeats", type=positive_int, default=2,
                    help="runs of each engine, alternating; the fastest is kept")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if (why := preset_weights_that_cannot_fit(args.preset)) is not None:
        fail(why)
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.preset(args.preset)
    # the chat's last request is the longest: the system prompt, every user message and every reply before it
    longest = args.system_tokens + args.turns * args.user_tokens + (args.turns - 1) * args.new_tokens
    taken = canvas_positions(args.new_tokens, cfg.canvas_length)  # its reply, in whole canvases
    if longest + taken > cfg.text.max_position_embeddings:  # was generate's traceback, at the request that passed it
        fail(f"--system-tokens/--user-tokens/--turns/--new-tokens: the chat's last request, {longest} prompt "
                 f"tokens + {args.new_tokens} new tokens in whole {cfg.canvas_length}-token canvases ({taken} "
                 f"positions), exceeds the {args.preset} preset's context of {cfg.text.max_position_embeddings} "
                 "tokens (max_position_embeddings)")
    cfg.text.eos_token_id = None
    lm = blockpress.random_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = cfg.text.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=g).tolist()

    system = tokens(args.system_tokens)
    chat = [system + tokens(args.user_tokens)] + [tokens(args.user_tokens) for _ in range(args.turns - 1)]
    shared = [system + tokens(args.user_tokens) for _ in range(args.turns)]
    kw = dict(max_new_tokens=args.new_tokens, max_denoising_steps=args.steps, adaptive_stopping=False)
    lm.generate([tokens(16)], **kw)  # warm-up
    result: dict = {"benchmark": "prefix_cache", "preset": args.preset, "threads": args.threads,
                    "system_tokens": args.system_tokens, "user_tokens": args.user_tokens, "turns": args.turns,
                    "new_tokens": args.new_tokens, "steps": args.steps}
    for name, prompts, follow in (("chat", chat, True), ("shared", shared, False)):
        best: dict[str, dict] = {}
        for _ in range(args.repeats):  # alternate, so a noisy minute hits both engines
            for engine in ("no_cache", "prefix_cache"):
                r = run_workload(lm, prompts, follow, kw, PrefixCache() if engine == "prefix_cache" else None)
                if engine not in best or r["total_s"] < best[engine]["total_s"]:
                    best[engine] = r
        result[name] = {**best, "encode_ratio": round(best["no_cache"]["encode_s"] / best["prefix_cache"]["encode_s"], 2),
                        "total_ratio": round(best["no_cache"]["total_s"] / best["prefix_cache"]["total_s"], 3)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
