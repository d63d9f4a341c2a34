"""Pick blockpress-code's decoding defaults on a validation split (never the benchmark's test functions).

Validation functions come from the same held-out modules as `benchmarks/code_model.py` (never trained on),
taken after the benchmark's first --test-functions of the shuffled list, so the two sets are disjoint.
Prints one JSON line per setting (parseable rate, tokens per forward) and the best. With --ar, the AR
baseline's (generate_ar's) settings: AR_SETTINGS unless --settings gives others.

    python scripts/tune_code_sampler.py --model runs/code --functions 40
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from script_args import json_flag, progress

import blockpress
from blockpress.lm import GENERATE_AR_OPTIONS
from blockpress.tasks.code import completion_parses, model_heldout_functions

SETTINGS = [
    {},  # the checkpoint's generation_config.json
    {"sampler": "entropy_bound", "t_max": 0.4, "t_min": 0.1},
    {"sampler": "entropy_bound", "entropy_bound": 0.03, "t_max": 0.3, "t_min": 0.05},
    {"sampler": "greedy"},
    {"sampler": "greedy", "entropy_bound": 0.02},
    {"sampler": "confidence", "confidence": 0.9, "t_max": 0.4, "t_min": 0.1},
    {"sampler": "topk", "max_denoising_steps": 16, "t_max": 0.3, "t_min": 0.05},  # 2 tokens a step (canvas 32)
    {"sampler": "topk", "max_denoising_steps": 32, "t_max": 0.3, "t_min": 0.05},  # 1 token a step
    # The previous default: every token re-decided each step, self-conditioning on. The shipped one (first row)
    # keeps accepted tokens and feeds no prediction back.
    {"sampler": "greedy", "entropy_bound": 0.02, "keep_accepted": False, "self_conditioning": True},
]
# --ar's: SETTINGS are diffusion samplers' (t_max is no keyword of generate_ar: the second one was a traceback).
# Greedy, with the penalties code_model.py gives the AR baseline: generate_ar gets no seed here, so a sampled
# setting would not repeat.
AR_SETTINGS = [{}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}]
# what a --settings entry may give generate_ar: the script passes the prompts and the count, and JSON has no
# SamplerConfig, cache or function
AR_KEYWORDS = sorted(set(GENERATE_AR_OPTIONS) - {"prompt", "max_new_tokens", "sampler", "attention_mask", "cache",
                                                 "return_cache", "prefix_cache", "logits_processor"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="blockpress-code")
    ap.add_argument("--manifest", default=None, help="corpus manifest.json (default: the model's own)")
    ap.add_argument("--functions", type=int, default=40)
    ap.add_argument("--test-functions", type=int, default=100, help="the benchmark's test split, skipped here")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=10, help="prompts decoded together")
    ap.add_argument("--settings", default=None, help="JSON list of settings to compare instead of the built-in ones")
    ap.add_argument("--ar", action="store_true", help="decode with generate_ar to compare the AR baseline (settings: "
                    "presence_penalty, frequency_penalty, temperature, top_k, top_p, ...; by default greedy, plain "
                    "and with each penalty)")
    args = ap.parse_args()
    # Before the model loads: --functions 0 decoded nothing and ended in ZeroDivisionError, --batch 0 in range()'s
    # ValueError, and --settings that is not a JSON list of objects in a JSONDecodeError or TypeError traceback.
    for flag, value in (("--functions", args.functions), ("--batch", args.batch), ("--threads", args.threads),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            ap.error(f"{flag}: expected a positive integer, got {value}")
    if args.test_functions < 0:  # was a slice from the end of the list, into the functions validated on
        ap.error(f"--test-functions: expected an integer >= 0, got {args.test_functions}")
    settings = AR_SETTINGS if args.ar else SETTINGS
    if args.settings is not None:
        settings = json_flag(ap, "--settings", args.settings, "objects")
    for i, setting in enumerate(settings if args.ar else ()):  # was a traceback after the settings before it ran
        if unknown := sorted(set(setting) - set(AR_KEYWORDS)):
            ap.error(f"--settings[{i}]: {unknown[0]!r} is no option of generate_ar (--ar; it takes "
                     f"{', '.join(AR_KEYWORDS)})")
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(args.model, dtype="float32")
    funcs = model_heldout_functions(lm.path, args.manifest, seed=0)
    if args.test_functions >= len(funcs):  # none left to validate on: a ZeroDivisionError after the model loaded
        ap.error(f"--test-functions: {args.test_functions} skips all {len(funcs)} held-out functions; at most "
                 f"{len(funcs) - 1} leaves one to validate on")
    funcs = funcs[args.test_functions : args.test_functions + args.functions]
    prompts = [lm.tokenizer.encode(f.prompt_text, add_bos=True)[-256:] for f in funcs]
    rows = []
    for setting in settings:
        ok = new = passes = 0
        # Batched (left-padded, one seed per row): every row computes what it would alone, only faster.
        for lo in progress(range(0, len(funcs), args.batch), desc=json.dumps(setting or "generation_config"), unit="batch"):
            batch = prompts[lo : lo + args.batch]
            out = (lm.generate_ar(batch, max_new_tokens=args.max_new_tokens, **setting) if args.ar else
                   lm.generate(batch, max_new_tokens=args.max_new_tokens,
                               seeds=list(range(1_000 + lo, 1_000 + lo + len(batch))), **setting))
            ok += sum(completion_parses(f, text) for f, text in zip(funcs[lo : lo + args.batch], out.texts))
            new += int(out.num_new_tokens.sum())
            passes += int(out.forward_passes.sum())
        row = {"setting": setting or "generation_config", "parseable": ok / len(funcs),
               "tokens_per_forward": new / max(1, passes)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"best": max(rows, key=lambda r: (r["parseable"], r["tokens_per_forward"]))}))


if __name__ == "__main__":
    main()
