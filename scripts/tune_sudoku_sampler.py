"""Pick blockpress-sudoku's decoding defaults on a validation set (never the test set, never trained on).

Validation puzzles use seeds from 20,000,000 (training: below the puzzle count; the benchmark's test set:
from 10,000,000). Prints JSON: exact-solve rate, cell accuracy and mean steps per sampler setting, medium
and hard puzzles. The model alone decides every cell in every setting (no rules, no search).

    python scripts/tune_sudoku_sampler.py --model runs/sudoku --per-difficulty 24
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import warnings

import torch
from script_args import json_flag

import blockpress
from blockpress.sampling import SamplerConfig
from blockpress.tasks import sudoku_model
from blockpress.tasks.sudoku import cell_accuracy, generate

VALIDATION_SEED = 20_000_000
SETTINGS = [
    {"sampler": "entropy_bound", "entropy_bound": 0.1, "max_denoising_steps": 64},
    {"sampler": "entropy_bound", "entropy_bound": 0.03, "max_denoising_steps": 81},
    {"sampler": "entropy_bound", "entropy_bound": 0.3, "max_denoising_steps": 64},
    {"sampler": "confidence", "confidence": 0.9, "max_denoising_steps": 81},
    {"sampler": "topk", "max_denoising_steps": 48},
    {"sampler": "topk", "max_denoising_steps": 81},
    # Temperature 1: the self-conditioning input then matches training (softmax of untempered logits).
    {"sampler": "topk", "max_denoising_steps": 81, "t_max": 1.0, "t_min": 1.0},
    # A hot start: adaptive stopping no longer commits the grid after a few steps.
    {"sampler": "topk", "max_denoising_steps": 81, "t_max": 3.0, "t_min": 1.0},
    # The same, ranking cells by the margin between their two most likely digits.
    {"sampler": "topk", "max_denoising_steps": 81, "t_max": 3.0, "t_min": 1.0, "rank_by": "margin"},
    # The shipped default: a cooler start, which the weights trained on the H200 prefer.
    {"sampler": "topk", "max_denoising_steps": 81, "t_max": 2.5, "t_min": 1.0, "rank_by": "margin"},
    # Masked-diffusion decoding: a digit once accepted stays, and no prediction is fed back.
    {"sampler": "topk", "max_denoising_steps": 81, "t_max": 1.0, "t_min": 1.0, "rank_by": "margin",
     "candidates": "argmax", "keep_accepted": True, "self_conditioning": False},
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="blockpress-sudoku")
    ap.add_argument("--per-difficulty", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--settings", default=None,
                    help="JSON list of settings to compare instead of the built-in ones: objects of solve's "
                         "options; a setting without sampler or max_denoising_steps takes the model's")
    ap.add_argument("--quantize", choices=["int8", "fp8", "int4"], default=None,
                    help="quantize the model while loading (blockpress.quantize)")
    args = ap.parse_args(argv)
    # Checked before the model loads and the puzzles are made: a setting without "max_denoising_steps" raised
    # KeyError, and --per-difficulty 0 ZeroDivisionError, each after that work.
    if args.per_difficulty < 1:
        ap.error(f"--per-difficulty: expected a positive integer, got {args.per_difficulty}")
    if args.threads < 1:
        ap.error(f"--threads: expected a positive integer, got {args.threads}")
    settings = SETTINGS
    if args.settings is not None:
        settings = json_flag(ap, "--settings", args.settings, "objects")
    # a misspelt option ran the settings before it, then ended in a traceback without the "best" line
    takes = {*inspect.signature(sudoku_model.solve).parameters, *(f.name for f in dataclasses.fields(SamplerConfig))}
    takes -= {"lm", "puzzles", "sampler_options", "on_draft", "checked"}
    for i, setting in enumerate(settings):
        if unknown := sorted(set(setting) - takes):
            ap.error(f"--settings[{i}]: {unknown[0]!r} is no option of sudoku_model.solve (it takes {', '.join(sorted(takes))})")
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(args.model, dtype="float32", quantize=args.quantize)
    try:  # before the puzzles are made: another model (blockpress-code) was a traceback after them
        sudoku_model.check_sudoku_model(lm)
    except ValueError as exc:
        ap.error(f"--model {args.model}: {str(exc).removeprefix('model: ')}")
    truth = {level: [generate(VALIDATION_SEED + i, level) for i in range(args.per_difficulty)]
             for level in ("medium", "hard")}
    out = []
    for setting in settings:
        options = {k: v for k, v in setting.items() if k not in ("sampler", "max_denoising_steps")}
        row = dict(setting, quantize=args.quantize, weights_bytes=lm.weights_bytes())
        for level, puzzles in truth.items():
            # None: the model's own (its generation_config.json), as sudoku_model.solve reads it
            solved = sudoku_model.solve(lm, [p.puzzle for p in puzzles], setting.get("max_denoising_steps"),
                                        setting.get("sampler"), **options)
            row[level] = {
                "exact": sum(s.valid for s in solved) / len(solved),
                "cell_accuracy": sum(cell_accuracy(s.solution, p.solution, p.puzzle) for s, p in zip(solved, puzzles))
                / len(solved),
                "mean_steps": sum(s.steps for s in solved) / len(solved),
            }
        out.append(row)
        print(json.dumps(row), flush=True)
    best = max(out, key=lambda r: (r["medium"]["exact"] + r["hard"]["exact"],
                                   r["medium"]["cell_accuracy"] + r["hard"]["cell_accuracy"]))
    print(json.dumps({"best": best}))


if __name__ == "__main__":
    main()
