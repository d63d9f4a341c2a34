"""Train blockpress-sudoku (block diffusion) or its AR baseline (same backbone, next-token loss only).

Puzzles come from blockpress.tasks.sudoku's seeded generator (a third each easy/medium/hard), seeds
0..N-1; test sets use seeds from 10,000,000 so they are never trained on.

    python scripts/train_sudoku.py --out runs/sudoku --minutes 40
    python scripts/train_sudoku.py --out runs/sudoku-ar --minutes 40 --ar
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

import blockpress
from blockpress.checkpoint import resolve_device
from blockpress.cli.common import as_flags, train_flag_of
from blockpress.config import FULL, SLIDING, ModelConfig, TextConfig
from blockpress.data import Example
from blockpress.lm import read_generation_config, resolve_path
from blockpress.sampling import is_int
from blockpress.tasks.sudoku import (
    DIFFICULTIES,
    VOCAB,
    Puzzle,
    encode_prompt,
    encode_solution,
    generate,
    random_symmetry,
)
from blockpress.train import ExampleSource, TrainConfig, Trainer, check_resumable

TEST_SEED = 10_000_000


def sudoku_config(layers: int = 6, hidden: int = 128) -> ModelConfig:
    """The shipped shape is the default; every sixth layer attends globally, and the last one does (as the model
    requires) whatever the depth (all of them see the whole board: the sliding window, 256, is longer than prompt
    plus canvas). `hidden`: a multiple of 64, split into heads of 32 dims, two query heads per key-value head."""
    if not is_int(hidden) or hidden <= 0 or hidden % 64:  # the heads derived below would not divide evenly
        raise ValueError(f"hidden: expected a positive multiple of 64 (heads of 32 dims, two per key-value head), "
                         f"got {hidden!r}")
    text = TextConfig(
        vocab_size=VOCAB.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), head_dim=32, global_head_dim=32,
        num_global_key_value_heads=max(1, hidden // 64), sliding_window=256, num_experts=4, top_k_experts=2,
        moe_intermediate_size=hidden,
        layer_types=[FULL if (i + 1) % 6 == 0 or i == layers - 1 else SLIDING for i in range(layers)],
        max_position_embeddings=512,
        pad_token_id=VOCAB.pad, eos_token_id=VOCAB.eos, bos_token_id=VOCAB.bos,
    )
    return ModelConfig(text=text, canvas_length=81)


def to_example(puzzle: str, solution: str) -> Example:
    return Example(encode_prompt(puzzle), encode_solution(solution), ends=False)


def _generate(seed: int, levels: tuple[str, ...] = DIFFICULTIES) -> Puzzle:
    return generate(seed, levels[seed % len(levels)])


def base_puzzles(n: int, seed0: int, cache: Path | None = None, workers: int = 1,
                 levels: tuple[str, ...] = DIFFICULTIES) -> list[Puzzle]:
    """Puzzles seed0..seed0+n-1, the `levels` in turn (by default a third of each difficulty); cached as JSON
    lines. A cache that holds the first puzzles of the same levels is extended, so a bigger run reuses a smaller
    one's work; one of other levels is refused (a ValueError naming it), and left as it is. Each puzzle is appended as it is made (in seed order), so a run stopped part-way (SIGTERM, a
    deadline's `timeout`) keeps what it made: at most its last line cut short, which the next read drops."""
    have: list[Puzzle] = []
    if cache is not None and cache.exists():
        text = cache.read_text()
        lines = text.splitlines()[: None if text.endswith("\n") else -1]  # a last line cut short by a kill
        rows = [json.loads(line) for line in lines]
        # every row kept is checked, not only the first len(levels): a cache of easy,medium,hard starts as one of
        # easy,medium does, and was taken for it (the run trained on the hard boards it was told to skip)
        if rows and rows[0]["seed"] == seed0 and all(r["difficulty"] == levels[i % len(levels)]
                                                     for i, r in enumerate(rows[:n])):
            have = [Puzzle(**row) for row in rows[:n]]
        elif rows:  # another run's puzzles: replaced by this run's, they were lost (up to 150k, tens of CPU minutes)
            made = ",".join(dict.fromkeys(r["difficulty"] for r in rows[: len(DIFFICULTIES)]))
            raise ValueError(f"--puzzle-cache {cache}: holds {len(rows):,} puzzles of --levels {made} from seed "
                             f"{rows[0]['seed']}, not of --levels {','.join(levels)} from seed {seed0}; give another "
                             "--puzzle-cache (it is kept as it is)")
    if len(have) >= n:
        return have
    seeds = range(seed0 + len(have), seed0 + n)
    out = list(have)
    with contextlib.ExitStack() as stack:
        file = None
        if cache is not None:  # what is kept, whole lines only (none of a cache made for other levels), then appended
            cache.parent.mkdir(parents=True, exist_ok=True)
            kept = cache.with_name(cache.name + ".tmp")
            kept.write_text("".join(json.dumps(p.__dict__) + "\n" for p in have))
            os.replace(kept, cache)
            file = stack.enter_context(cache.open("a"))
        if workers > 1:
            import multiprocessing

            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(workers))
            made = pool.imap(partial(_generate, levels=levels), seeds, chunksize=256)
        else:
            made = (_generate(s, levels) for s in seeds)
        # SIGTERM's default ends the process at once: the pool's workers then went on with their chunks for
        # nobody (about 50 s), holding the cores the next phase needs, and the file lost its unwritten buffer.
        # Raised instead, it leaves this `with`, which closes the file and terminates the workers. Set after the
        # fork, so the workers keep the default.
        stack.enter_context(_terminate_raises())
        for puzzle in made:
            out.append(puzzle)
            if file is not None:
                file.write(json.dumps(puzzle.__dict__) + "\n")
    return out


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """SIGTERM as SystemExit while inside (then the handler before). Only the main thread can set one: elsewhere,
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def puzzles(n: int, seed0: int) -> list[Example]:
    return [to_example(p.puzzle, p.solution) for p in base_puzzles(n, seed0)]


class AugmentedSource:
    """Base puzzles in a seeded shuffled order, each seen through a fresh random symmetry of the board
    (bands, rows, stacks, columns, transpose, digit relabelling): example i of step k is a pure function
    of (seed, k, i), as the trainer requires for exact resume."""

    def __init__(self, base: list[Puzzle], seed: int):
        # The order is drawn over the puzzles themselves (the permutation depends only on their count and the seed):
        # each batch encodes its own boards after their symmetry, so encoding every base puzzle up front was work
        # for nothing, 7.9 s and 150,000 examples held at the GPU session's 150,000 puzzles, before the first step.
        self.order = ExampleSource(base, seed)
        self.seed = seed

    def batch(self, step: int, size: int) -> list[Example]:
        out = []
        for i, p in enumerate(self.order.batch(step, size)):
            sym = random_symmetry(random.Random(self.seed * 1_000_003 + step * 4099 + i))
            out.append(to_example(sym.apply(p.puzzle), sym.apply(p.solution)))
        return out


def checked_settings(ap: argparse.ArgumentParser,
                     args: argparse.Namespace) -> tuple[tuple[str, ...], ModelConfig | None, TrainConfig]:
    """The levels, the fresh model's config (None with --init-from) and the TrainConfig of `args`, built before any
    puzzle is generated (minutes of work) so that their own checks refuse bad values first, as errors naming the
    flag."""
    levels = tuple(args.levels.split(","))
    if any(level not in DIFFICULTIES for level in levels):
        ap.error(f"--levels: expected a comma-separated subset of {','.join(DIFFICULTIES)}, got {args.levels!r}")
    for flag, value in (("--puzzles", args.puzzles), ("--heldout-puzzles", args.heldout_puzzles)):
        if value <= 0:
            ap.error(f"{flag}: expected a positive integer, got {value}")
    if args.init_from and args.resume:
        ap.error("--init-from and --resume: choose one")
    # torch's own errors, after every puzzle was made: "set_num_threads expects a positive integer", and a
    # traceback for a device this machine does not have
    if args.threads < 0:
        ap.error(f"--threads: expected 0 (torch's default) or more, got {args.threads}")
    try:
        resolve_device(args.device)
    except ValueError as exc:
        ap.error(f"--{exc}")
    # The settings by the flags that give them (TrainConfig's and the model config's errors name their fields).
    flag_of = {**train_flag_of(), "max_minutes": "--minutes", "hidden": "--hidden",
               "text_config.num_hidden_layers": "--layers"}
    try:
        if args.resume:
            check_resumable(args.out)
        model_config = None if args.init_from else sudoku_config(args.layers, args.hidden)
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                          weight_decay=0.01, aux_ar_weight=1.0 if args.ar else args.aux_ar_weight,
                          cpu_autocast=args.cpu_autocast, log_every=25, eval_every=500, eval_batches=1,
                          save_every=250, max_minutes=args.minutes, diffusion_weight=0.0 if args.ar else 1.0,
                          seed=args.seed, time_schedule=args.time_schedule, data_workers=args.data_workers,
                          autocast=not args.no_autocast, compile=args.compile,
                          noise_token_id=VOCAB.digit_id("0") if args.noise == "empty" else -1)
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError; OSError: no trainer_state.pt
        ap.error(as_flags(str(exc), flag_of))
    if args.init_from:  # its config read now: a misspelt name or folder fails before the puzzles, not after them
        try:
            ModelConfig.from_file(resolve_path(args.init_from) / "config.json")
        except (ValueError, OSError) as exc:
            ap.error(f"--init-from: {exc}")
    return levels, model_config, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--puzzles", type=int, default=20000)
    ap.add_argument("--levels", default=",".join(DIFFICULTIES),
                    help="difficulties to train on, comma-separated, taken in turn (e.g. medium,hard once easy "
                    "puzzles are solved: no compute spent on them)")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--minutes", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ar", action="store_true", help="train the autoregressive baseline instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-augment", action="store_true", help="train on the generated boards only")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out (weights, optimizer, step)")
    ap.add_argument("--puzzle-cache", type=Path, default=None, help="JSON-lines cache of the generated puzzles")
    ap.add_argument("--init-from", default=None,
                    help="start from these weights (a model name or folder) with a fresh optimizer and schedule")
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="data order, board symmetries and noise (change it when continuing)")
    ap.add_argument("--aux-ar-weight", type=float, default=1.0, help="weight of the encoder's next-token loss")
    ap.add_argument("--noise", choices=("uniform", "empty"), default="uniform",
                    help="corruption: uniform random tokens (DiffusionGemma's recipe) or the empty-cell digit 0 "
                         "(absorbing noise; the model then decodes with noise_token_id set)")
    ap.add_argument("--cpu-autocast", action="store_true", help="bf16 autocast on CPUs with native bf16")
    ap.add_argument("--layers", type=int, default=6, help="layers of a fresh model (not with --init-from); every sixth "
                    "and the last attend globally")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of a fresh model, a multiple of 64")
    ap.add_argument("--time-schedule", action="store_true",
                    help="anneal the learning rate over --minutes rather than --steps (GPU runs sized by time)")
    ap.add_argument("--data-workers", type=int, default=0, help="processes building batches ahead of the GPU")
    ap.add_argument("--puzzle-workers", type=int, default=1, help="processes generating puzzles")
    ap.add_argument("--no-autocast", action="store_true", help="train in float32 on a GPU too")
    ap.add_argument("--heldout-puzzles", type=int, default=64,
                    help="puzzles held out for the eval loss (one batch of them is evaluated: more than --batch-size "
                         "only takes longer to make, about 20 ms each)")
    ap.add_argument("--only-puzzles", action="store_true", help="generate (and cache) the puzzles, then stop")
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step (falls back to eager, "
                    "with a warning, if compilation fails)")
    args = ap.parse_args()
    levels, model_config, cfg = checked_settings(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        base = base_puzzles(args.puzzles, 0, args.puzzle_cache, args.puzzle_workers, levels)
    except ValueError as exc:
        ap.error(str(exc))
    if args.only_puzzles:
        print(json.dumps({"puzzles": len(base), "seconds": round(time.perf_counter() - t0, 1)}))
        return
    source = (ExampleSource([to_example(p.puzzle, p.solution) for p in base], args.seed) if args.no_augment
              else AugmentedSource(base, args.seed))
    held = puzzles(args.heldout_puzzles, TEST_SEED + 5_000_000)
    gen_s = time.perf_counter() - t0
    t_train = time.perf_counter()
    if args.init_from:  # its own decoding defaults stay (the shipped model's sampler was tuned for it)
        lm = blockpress.load(args.init_from, dtype=torch.float32, device=args.device)
    else:  # (a resumed run's weights are read by trainer.resume; its decoding defaults, as it saved them, here)
        lm = blockpress.random_model(model_config, seed=0, device=args.device)
        lm.generation_config = (read_generation_config(Path(args.out), lm.config.text.vocab_size) if args.resume
                                else {"max_denoising_steps": 32, "max_new_tokens": 81})
    trainer = Trainer(lm, source, cfg, args.out, heldout=ExampleSource(held, 1), progress=False)
    if args.resume:
        trainer.resume()
    result = trainer.train()
    summary = {"ar": args.ar, "init_from": args.init_from, "noise": args.noise, "aux_ar_weight": cfg.aux_ar_weight,
               "puzzles": args.puzzles, "heldout_puzzles": len(held), "levels": list(levels), "augment": not args.no_augment,
               "batch_size": args.batch_size, "lr": args.lr, "puzzle_generation_s": round(gen_s, 1), "steps": result.steps,
               "params": lm.num_parameters(active=False), "device": args.device, "first_loss": result.losses[0],
               "last_loss": result.losses[-1], "eval": result.eval_losses,
               "train_tok_s": round(result.tokens_per_second, 1),
               "train_minutes": round((time.perf_counter() - t_train) / 60, 1), "threads": torch.get_num_threads(),
               "compile": args.compile, "compile_error": result.compile_error}
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
