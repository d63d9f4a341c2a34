"""Does choosing among several diffusion drafts by the backbone's own AR likelihood make more bodies parse?

For each validation function (after the benchmark's test split, as in tune_code_sampler.py) this decodes the
shipped greedy draft plus K-1 sampled drafts, scores every draft with the causal (encoder) pass of the same
weights (log-probability of its new tokens), and reports the parseable rate of the greedy draft, of the draft
with the highest total and mean log-probability, and of "any draft parses" (the ceiling a perfect chooser
would reach). No parser is used to choose.

    python scripts/rerank_code_candidates.py --candidates 4 --functions 120
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from script_args import json_flag

import blockpress
from blockpress.tasks.code import completion_parses, model_heldout_functions


@torch.no_grad()
def new_token_logprobs(lm: blockpress.LM, prompt: list[int], new: list[int]) -> torch.Tensor:
    """log p(new[i] | prompt, new[:i]) under the causal pass, one per new token."""
    ids = torch.tensor([prompt + new])
    cache = lm.new_cache(1, ids.shape[1])
    logp = lm.model.encode(ids, cache, logits="all")[0].log_softmax(-1)
    return logp[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="blockpress-code")
    ap.add_argument("--candidates", type=int, default=4, help="drafts per function: the greedy one and K-1 sampled")
    ap.add_argument("--functions", type=int, default=120)
    ap.add_argument("--test-functions", type=int, default=100, help="the benchmark's test split, skipped here")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sampled", default='{"sampler": "entropy_bound", "t_max": 0.3, "t_min": 0.05}',
                    help="JSON sampler settings of the sampled drafts (the rest from generation_config.json)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    # Before the model loads: --candidates 0 scored no draft and printed every rate as 0.0 (exit 0), --functions 0
    # divided by zero, and --sampled that is not a JSON object was a JSONDecodeError traceback.
    for flag, value in (("--candidates", args.candidates), ("--functions", args.functions), ("--threads", args.threads),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            ap.error(f"{flag}: expected a positive integer, got {value}")
    if args.test_functions < 0:  # was a slice from the end of the list, into the functions validated on
        ap.error(f"--test-functions: expected an integer >= 0, got {args.test_functions}")
    sampled = json_flag(ap, "--sampled", args.sampled, "object")
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(args.model, dtype="float32")
    funcs = model_heldout_functions(lm.path, None, seed=0)
    if args.test_functions >= len(funcs):  # none left to validate on: a ZeroDivisionError after the model loaded
        ap.error(f"--test-functions: {args.test_functions} skips all {len(funcs)} held-out functions; at most "
                 f"{len(funcs) - 1} leaves one to validate on")
    funcs = funcs[args.test_functions : args.test_functions + args.functions]
    hits = {"greedy": 0, "best_total": 0, "best_mean": 0, "any": 0}
    for i, f in enumerate(funcs):
        prompt = lm.tokenizer.encode(f.prompt_text, add_bos=True)[-256:]
        outs = [lm.generate([prompt], max_new_tokens=args.max_new_tokens, seed=i)]
        if args.candidates > 1:
            seeds = [1_000 + i * args.candidates + k for k in range(args.candidates - 1)]
            outs.append(lm.generate([prompt] * len(seeds), max_new_tokens=args.max_new_tokens, seeds=seeds, **sampled))
        drafts = []
        for out in outs:
            for row, text in enumerate(out.texts):
                new = out.new_tokens[row, : int(out.num_new_tokens[row])].tolist()
                logp = new_token_logprobs(lm, prompt, new)
                drafts.append({"total": float(logp.sum()), "mean": float(logp.mean()),
                               "parses": completion_parses(f, text)})
        hits["greedy"] += drafts[0]["parses"]
        hits["best_total"] += max(drafts, key=lambda d: d["total"])["parses"]
        hits["best_mean"] += max(drafts, key=lambda d: d["mean"])["parses"]
        hits["any"] += any(d["parses"] for d in drafts)
    print(json.dumps({"functions": len(funcs), "candidates": args.candidates, "sampled": sampled,
                      "parseable": {k: v / len(funcs) for k, v in hits.items()}}))


if __name__ == "__main__":
    main()
