"""Train blockpress-sudoku (block diffusion) or its AR baseline (same backbone, next-token loss only).

Puzzles come from blockpress.tasks.sudoku's seeded generator (a third each easy/medium/hard), seeds
0..N-1; test sets use seeds from 10,000,000 so they are never trained on.

    python scripts/train_sudoku.py --out runs/sudoku --minutes 40
    python scripts/train_sudoku.py --out runs/sudoku-ar --minutes 40 --ar
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import blockpress
from blockpress.config import FULL, SLIDING, ModelConfig, TextConfig
from blockpress.data import Example
from blockpress.tasks.sudoku import DIFFICULTIES, VOCAB, encode_prompt, encode_solution, generate
from blockpress.train import ExampleSource, TrainConfig, Trainer

TEST_SEED = 10_000_000


def sudoku_config() -> ModelConfig:
    text = TextConfig(
        vocab_size=VOCAB.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=32,
        num_global_key_value_heads=2, sliding_window=256, num_experts=4, top_k_experts=2,
        moe_intermediate_size=128, layer_types=[SLIDING] * 5 + [FULL], max_position_embeddings=512,
        pad_token_id=VOCAB.pad, eos_token_id=VOCAB.eos, bos_token_id=VOCAB.bos,
    )
    return ModelConfig(text=text, canvas_length=81)


def puzzles(n: int, seed0: int) -> list[Example]:
    out = []
    for i in range(n):
        p = generate(seed0 + i, DIFFICULTIES[i % 3])
        out.append(Example(encode_prompt(p.puzzle), encode_solution(p.solution), ends=False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--puzzles", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--minutes", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ar", action="store_true", help="train the autoregressive baseline instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    train = puzzles(args.puzzles, 0)
    held = puzzles(64, TEST_SEED + 5_000_000)
    gen_s = time.perf_counter() - t0
    lm = blockpress.random_model(sudoku_config(), seed=0, device=args.device)
    lm.generation_config = {"max_denoising_steps": 32, "max_new_tokens": 81}
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=100,
                      weight_decay=0.01, log_every=25, eval_every=500, eval_batches=1, save_every=250,
                      max_minutes=args.minutes, diffusion_weight=0.0 if args.ar else 1.0, seed=0)
    result = Trainer(lm, ExampleSource(train, 0), cfg, args.out, heldout=ExampleSource(held, 1), progress=False).train()
    summary = {"ar": args.ar, "puzzles": args.puzzles, "puzzle_generation_s": round(gen_s, 1), "steps": result.steps,
               "params": lm.num_parameters(active=False), "first_loss": result.losses[0],
               "last_loss": result.losses[-1], "eval": result.eval_losses,
               "train_tok_s": round(result.tokens_per_second, 1)}
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
