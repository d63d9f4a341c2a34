"""Server latency and throughput at several concurrency levels, on loopback (bounded request counts).

Starts `blockpress serve` in-process on 127.0.0.1, then for each concurrency level sends a fixed number
of completion requests with the official openai client and prints JSON: p50/p95 latency, requests/s and
completion tokens/s.

    python benchmarks/serve_load.py --model blockpress-code --levels 1 8 32 --requests 32
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import statistics
import time

import httpx
import openai
from benchmark_args import Formatter, checkpoint_or_random, fail, positive_int

from blockpress.cli.common import load_model
from blockpress.serve import create_app, start_in_background


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The q-quantile by nearest rank: the smallest value with at least q of the values at or below it (rounding
    the rank down put p95 below the median for two requests)."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--model", type=checkpoint_or_random, default="blockpress-code",
                    help="a shipped name, a folder or random-<preset>")
    ap.add_argument("--levels", type=positive_int, nargs="+", default=[1, 8, 32],
                    help="concurrent clients, one run each (in ascending order, each once; the server queues up "
                         "to the largest, none refused; the clients share this process: about 2 file descriptors "
                         "each, see ulimit -n)")
    ap.add_argument("--requests", type=positive_int, default=32, help="requests per level")
    ap.add_argument("--max-tokens", type=positive_int, default=64, help="completion tokens per request")
    ap.add_argument("--max-batch", type=positive_int, default=32, help="the server's largest batch")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    lm = load_model(args.model, "float32", "cpu")
    # a queue for every client of the largest level: at 256 (its old fixed size), a level above 256 + --max-batch was
    # refused with the server's 429 partway through, a limit no flag named
    base, server = start_in_background(create_app(lm, "m", max_queue=max(256, *args.levels),
                                                  max_batch=args.max_batch))
    # a connection for every client of the largest level: httpx's default pool holds 1,000, so a level above it ran
    # 1,000 requests at once under its own name
    most = max(args.levels)
    http = openai.DefaultHttpxClient(limits=httpx.Limits(max_connections=most, max_keepalive_connections=most))
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600, http_client=http)
    prompts = ["def parse_header(line):", "class LRUCache:", "def is_prime(n):", "import os\n\ndef walk(path):"]

    def one(i: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        r = client.completions.create(model="m", prompt=prompts[i % len(prompts)], max_tokens=args.max_tokens, seed=i)
        return time.perf_counter() - t0, r.usage.completion_tokens

    result = {"benchmark": "serve_load", "model": args.model, "max_tokens": args.max_tokens, "levels": {}}
    try:
        one(0)  # warm-up
        for level in sorted(set(args.levels)):  # a level given twice was run twice, the JSON keeping the last
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(level) as pool:
                rows = list(pool.map(one, range(args.requests)))
            wall = time.perf_counter() - t0
            lat = sorted(r[0] for r in rows)
            result["levels"][level] = {
                "requests": len(rows), "p50_s": statistics.median(lat), "p95_s": nearest_rank(lat, 0.95),
                "requests_per_s": len(rows) / wall, "completion_tok_s": sum(r[1] for r in rows) / wall,
            }
    except openai.APIStatusError as exc:  # was the openai client's 21-line traceback (--max-tokens 100000)
        if result["levels"]:  # the levels measured before it were lost with it
            print(json.dumps({**result, "partial": True}, indent=2))
        fail(refused(exc), 1)
    finally:
        server.should_exit = True
    print(json.dumps(result, indent=2))


def refused(exc: openai.APIStatusError) -> str:
    """The line for a request the server refused: its status and reason, and the flag that takes less when the
    reason is the completion's length (a --max-tokens past the model's context)."""
    body = exc.body if isinstance(exc.body, dict) else {}
    reason = body.get("message") or str(exc)
    hint = "; a smaller --max-tokens fits" if "max_tokens" in reason else ""
    return f"the server refused a request (HTTP {exc.status_code}: {reason}){hint}"


if __name__ == "__main__":
    main()
