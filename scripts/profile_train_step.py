"""Where a training step's time goes: ms per step, then one step under torch.profiler, as JSON.

A small model's step is bound by per-op host overhead, not by the GPU: this counts the ops, the host syncs
(`aten::item`) and the busiest kernels, so the next speed change goes after the right thing. Uses the sudoku
task (no corpus needed) and the shipped blockpress-sudoku weights.

    python scripts/profile_train_step.py --device cuda --batch-size 256 --out $OUT/train_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_sudoku import AugmentedSource, _generate  # noqa: E402

import blockpress  # noqa: E402
from blockpress.bench import profile_ops  # noqa: E402
from blockpress.checkpoint import resolve_device  # noqa: E402
from blockpress.train import TrainConfig, Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after the warm-up steps)")
    ap.add_argument("--warmup-steps", type=int, default=2,
                    help="untimed steps first (allocator, kernels' first calls); 0 times the first step too")
    ap.add_argument("--puzzles", type=int, default=64,
                    help="sudoku puzzles made for the batches (augmented each step; more only takes longer to make)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--compile", action="store_true", help="also time the step under torch.compile (TrainConfig.compile): "
                    "compile seconds, ms per step, and whether it fell back to eager")
    args = ap.parse_args()
    # Refused here, in one line, before the puzzles are made and the model loads: they were tracebacks (TrainConfig's
    # ValueError for --batch-size 0, ZeroDivisionError for --steps 0, resolve_device's for a GPU this machine lacks).
    for flag, value in (("--batch-size", args.batch_size), ("--steps", args.steps), ("--puzzles", args.puzzles)):
        if value < 1:
            ap.error(f"{flag}: expected a positive integer, got {value}")
    if args.warmup_steps < 0:
        ap.error(f"--warmup-steps: expected 0 or more, got {args.warmup_steps}")
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        ap.error(f"--{exc}")
    puzzles = [_generate(seed) for seed in range(args.puzzles)]
    lm = blockpress.load("blockpress-sudoku", dtype=torch.float32, device=device)
    cfg = TrainConfig(steps=1000, batch_size=args.batch_size, noise_token_id=3, aux_ar_weight=0.25, log_every=1000)
    trainer = Trainer(lm, AugmentedSource(puzzles, 0), cfg, Path("/tmp/profile_train_step"), progress=False)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup_steps):
        trainer.train_step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    trace = profile_ops(trainer.train_step, device)
    result = {"device": str(device), "batch_size": args.batch_size, "puzzles": len(puzzles),
              "warmup_steps": args.warmup_steps, "steps": args.steps, "ms_per_step": round(ms, 2), **trace}

    def save() -> None:  # after each part, so a time limit during compilation keeps the eager profile
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))

    save()
    if args.compile:
        compiled = Trainer(lm, AugmentedSource(puzzles, 0), replace(cfg, compile=True), Path("/tmp/profile_train_step"),
                           progress=False)
        t0 = time.perf_counter()
        for _ in range(2):  # the first step compiles; the second runs what was compiled
            compiled.train_step()
        sync()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            compiled.train_step()
        sync()
        compiled_ms = (time.perf_counter() - t0) * 1e3 / args.steps
        result["compiled"] = {"compile_s": round(compile_s, 1), "ms_per_step": round(compiled_ms, 2),
                              "speedup": round(ms / compiled_ms, 3), "compile_error": compiled.compile_error}
    save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
