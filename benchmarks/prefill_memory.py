"""Peak memory and time of encoding one long prompt, in one pass and in chunks of queries (`encode`'s chunk_size).

Each encode runs in a fresh subprocess on a random model: the figure is the growth of that process's peak resident
size (VmHWM, reset in the child, as load_memory.py does) over its size once the model and the KV cache are
allocated, so it counts what encoding itself adds (masks, attention scores, activations), not the cache.

    python benchmarks/prefill_memory.py --tokens 16384 --chunks 0 2048 512 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmark_args import PRESET_HELP, Formatter, fail, measure_in_child, positive_int, preset_name
from load_memory import RssSampler, reset_peak, status


def measure_encode(preset: str, tokens: int, chunk: int, batch: int, threads: int, repeats: int) -> dict[str, Any]:
    """Encode `tokens` random tokens per row in this process; chunk 0: one pass over the whole prompt. The time is
    the least of `repeats` encodes (a shared machine's slow spells), the peak that of all of them."""
    import torch

    import blockpress

    torch.set_num_threads(threads)

    lm = blockpress.random_model(blockpress.ModelConfig.preset(preset), seed=0)
    prompt = torch.randint(0, lm.config.text.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    cache = lm.new_cache(batch, tokens)
    with torch.no_grad():  # a warm-up on a few tokens: lazy initialisation stays out of the figure
        lm.model.encode(prompt[:, :8], lm.new_cache(batch, 8))
    exact = reset_peak()
    sampler = None if exact else RssSampler()
    before = status("VmRSS")
    seconds = float("inf")
    for _ in range(repeats):
        cache.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            lm.model.encode(prompt, cache, chunk_size=chunk or tokens)
        seconds = min(seconds, time.perf_counter() - t0)
    peak = status("VmHWM") if sampler is None else sampler.stop()
    return {"chunk_size": chunk or tokens, "seconds": seconds, "peak_growth_bytes": peak - before,
            "peak_from": "VmHWM, reset in the child" if exact else "VmRSS sampled every 1 ms (a lower bound)"}


def what_cannot_fit(preset: str, batch: int, tokens: int) -> str | None:
    """Why the weights and the KV cache cannot fit in memory, or None: found here, before a child is started, where
    a child's allocator traceback was relayed (`--batch 100000000`)."""
    import torch

    import blockpress
    from blockpress.cache import KVCache
    from blockpress.checkpoint import available_bytes

    cfg = blockpress.ModelConfig.preset(preset)
    free = available_bytes(torch.device("cpu"))
    weights = blockpress.random_model(cfg, device="meta").weights_bytes()
    cache = batch * tokens * KVCache.bytes_per_token(cfg.text, torch.float32)
    if free is None or weights + cache <= free:
        return None
    return (f"--batch/--tokens: {batch} x {tokens} tokens need a {cache / 1e9:.1f} GB KV cache (float32) beside "
            f"{weights / 1e9:.1f} GB of {preset} weights, but {free / 1e9:.1f} GB are available")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--preset", type=preset_name, default="tiny", help=PRESET_HELP)
    ap.add_argument("--tokens", type=positive_int, default=16384, help="prompt length")
    ap.add_argument("--batch", type=positive_int, default=1, help="prompts encoded together")
    ap.add_argument("--threads", type=positive_int, default=1, help="CPU threads for torch (steadier times)")
    ap.add_argument("--repeats", type=positive_int, default=3, help="encodes per chunk size; the fastest is reported")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 2048, 512],
                    help="chunk sizes to measure, each in its own process (0: the whole prompt in one pass)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # the measuring process: this chunk
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.child is not None:
        print(json.dumps(measure_encode(args.preset, args.tokens, args.child, args.batch, args.threads,
                                        args.repeats)))
        return
    if any(chunk < 0 for chunk in args.chunks):
        fail(f"--chunks: expected sizes >= 0 (0: one pass), got {args.chunks}")
    from blockpress import ModelConfig

    context = ModelConfig.preset(args.preset).text.max_position_embeddings
    if args.tokens > context:  # was encoded anyway, positions past the context, for minutes before any figure
        fail(f"--tokens: {args.tokens} tokens exceed the {args.preset} preset's context of {context} tokens "
                 "(max_position_embeddings)")
    if (why := what_cannot_fit(args.preset, args.batch, args.tokens)) is not None:
        fail(why)
    rows = []
    for chunk in args.chunks:
        cmd = [sys.executable, __file__, "--preset", args.preset, "--tokens", str(args.tokens),
               "--batch", str(args.batch), "--threads", str(args.threads), "--repeats", str(args.repeats),
               "--child", str(chunk)]
        rows.append(measure_in_child(cmd, "the encoding process"))
    print(json.dumps({"benchmark": "prefill_memory", "preset": args.preset, "tokens": args.tokens,
                      "batch": args.batch, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
