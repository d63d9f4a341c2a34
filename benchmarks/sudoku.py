"""Sudoku: block diffusion vs an autoregressive baseline, per difficulty, on fresh puzzles.

Test puzzles are generated from seeds starting at 10,000,000 (training uses seeds below the puzzle
count), so none was trained on. Seed i gives one solution grid at every difficulty, with fewer givens the
harder the level: the three difficulties are paired (the same 200 boards at three clue levels), not 600
separate puzzles; each level's figure is a fair sample of that level. Prints JSON: exact-solve rate, cell accuracy on the empty cells, mean
denoising steps and puzzles/s for each engine and difficulty. The model alone decides (no rules);
`--rules` adds the rule-aware option (candidate filtering, no search) as a separate `diffusion_rules` entry;
`--ensemble N` adds N pooled symmetric views (no rules, no search) as `diffusion_ensemble`. A Ctrl-C prints the
difficulties finished so far, marked `"partial": true, "interrupted": true` (exit status 130).

    python benchmarks/sudoku.py --model blockpress-sudoku --per-difficulty 200 --rules --ensemble 8

The AR baseline (`scripts/train_sudoku.py --ar`: 3,767 CPU steps at batch 32, then 876 H200 steps at batch 256;
bf16 weights; its summary.json has the budget) is kept in
benchmarks/baselines/sudoku-ar, so a fresh clone reproduces the side-by-side table. It decodes with
`sudoku_model.solve_ar`: greedy, left to right, the givens forced as the diffusion canvas keeps them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from benchmark_args import (
    Formatter,
    checkpoint,
    checkpoint_or_none,
    fail,
    int_between,
    positive_int,
    progress,
    step_count,
)

import blockpress
from blockpress.sampling import SAMPLERS
from blockpress.tasks import sudoku_model
from blockpress.tasks.sudoku import DIFFICULTIES, cell_accuracy, generate

TEST_SEED = 10_000_000


def evaluate(results, truth, seconds):
    return {
        "exact": sum(r.valid for r in results) / len(results),
        "cell_accuracy": sum(cell_accuracy(r.solution, t.solution, t.puzzle) for r, t in zip(results, truth))
        / len(results),
        "mean_steps": sum(r.steps for r in results) / len(results),
        "puzzles_per_s": len(results) / seconds,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--model", type=checkpoint, default="blockpress-sudoku", help="the diffusion model: a shipped name or a folder")
    ap.add_argument("--ar-model", type=checkpoint_or_none, default=str(Path(__file__).parent / "baselines" / "sudoku-ar"),
                    help="the AR baseline checkpoint (same backbone, AR-trained; default: the one kept here; '' skips it)")
    ap.add_argument("--per-difficulty", type=positive_int, default=200,
                    help="fresh puzzles per difficulty (default 200: one puzzle is half a point)")
    ap.add_argument("--steps", type=step_count, default=None, help="max denoising steps (default: the model's)")
    ap.add_argument("--sampler", default=None, choices=SAMPLERS, help="the sampler (default: the model's)")
    ap.add_argument("--batch", type=positive_int, default=25, help="puzzles decoded together")
    ap.add_argument("--threads", type=positive_int, default=2, help="CPU threads")
    ap.add_argument("--rules", action="store_true",
                    help="also decode with the rule-aware option (reported separately as diffusion_rules)")
    ap.add_argument("--compare-skip", action="store_true",
                    help="also decode with stopped puzzles kept in the batch (skip_stopped_rows=False)")
    # past MAX_VIEWS: a traceback after the first difficulty's plain run (200 puzzles: minutes)
    ap.add_argument("--ensemble", type=int_between(0, sudoku_model.MAX_VIEWS), default=0,
                    help="also decode each puzzle as N pooled symmetric views (reported separately as "
                         "diffusion_ensemble; 0 or 1: off)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(args.model, dtype="float32")
        ar = blockpress.load(args.ar_model, dtype="float32") if args.ar_model else None
    for flag, name, model in (("--model", args.model, lm), ("--ar-model", args.ar_model, ar)):
        try:  # before the puzzles are made: another model (blockpress-code) was a traceback after them
            if model is not None:
                sudoku_model.check_sudoku_model(model)
        except ValueError as exc:
            fail(f"{flag} {name}: {str(exc).removeprefix('model: ')}")
    out = {"benchmark": "sudoku", "model": args.model, "ar_model": args.ar_model,
           "params": lm.num_parameters(active=False), "per_difficulty": args.per_difficulty}
    try:
        for level in DIFFICULTIES:
            truth = [generate(TEST_SEED + i, level)
                     for i in progress(range(args.per_difficulty), desc=f"{level} puzzles", unit="puzzle")]
            row = {}
            for name, fn in (("diffusion", lambda b: sudoku_model.solve(lm, b, args.steps, args.sampler)),
                             ("diffusion_no_skip", (lambda b: sudoku_model.solve(
                                 lm, b, args.steps, args.sampler, skip_stopped_rows=False)) if args.compare_skip else None),
                             ("diffusion_rules", (lambda b: sudoku_model.solve(
                                 lm, b, args.steps, args.sampler, rules=True)) if args.rules else None),
                             ("diffusion_ensemble", (lambda b: sudoku_model.solve(
                                 lm, b, args.steps, args.sampler, ensemble=args.ensemble)) if args.ensemble > 1 else None),
                             ("ar", (lambda b: sudoku_model.solve_ar(ar, b)) if ar else None)):
                if fn is None:
                    continue
                t0 = time.perf_counter()
                results = []
                # progress on stderr: an ensemble of 200 puzzles a difficulty runs for many minutes on a CPU
                for i in progress(range(0, len(truth), args.batch), desc=f"{level} {name}", unit="batch"):
                    results += fn([t.puzzle for t in truth[i : i + args.batch]])
                row[name] = evaluate(results, truth, time.perf_counter() - t0)
            if "diffusion_no_skip" in row:
                row["skip_speedup"] = row["diffusion"]["puzzles_per_s"] / row["diffusion_no_skip"]["puzzles_per_s"]
            out[level] = row
    except KeyboardInterrupt:
        # the difficulties finished are the run's result: they were lost under a KeyboardInterrupt traceback
        done = [level for level in DIFFICULTIES if level in out]
        if done:
            print(json.dumps({**out, "partial": True, "interrupted": True}, indent=2))
        print(f"{Path(sys.argv[0]).name}: interrupted after {len(done)} of {len(DIFFICULTIES)} difficulties"
              + (f" ({', '.join(done)}: their JSON on stdout, marked \"partial\")" if done else ""), file=sys.stderr)
        sys.exit(130)  # as blockpress's commands on Ctrl-C
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
