"""Prepared GPU training job: train a config on one GPU within a fixed time budget, output to a folder.

Builds the stdlib code corpus (or the sudoku data) on the machine, trains with bf16 autocast, and writes
the HF checkpoint, metrics.jsonl and a summary JSON into --out. Everything it needs ships in the repo.
The --minutes budget is the training's alone: the data is built before it starts. The code corpus takes
about a minute; the sudoku puzzles about 10 ms of CPU each, spread over --puzzle-workers processes (200,000:
some 35 minutes on one core, under 3 on 14), less what --puzzle-cache already holds (prepare_gpu_session.sh
makes the first 12,000 there).

    python scripts/train_gpu.py --task code --minutes 8 --out $OUT
    python scripts/train_gpu.py --task sudoku --minutes 8 --out $OUT       # then --task sudoku-ar
    python scripts/train_gpu.py --task code --minutes 0.2 --device cpu --steps 3 --out /tmp/x   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> None:
    """Run a step; one that fails has said why on stderr (a flag's usage error, no GPU), so this ends with its exit
    status alone: check=True added a CalledProcessError traceback of this script under the step's own message.

    A stop signal (Ctrl-C, SIGTERM, SIGHUP) reaches the step exactly once, and this script waits for it: a trainer
    then finishes its step and saves. The step runs in a process group of its own and this script passes each
    signal on. Before, a Ctrl-C reached both from the terminal and subprocess.run killed the trainer 0.25 s later,
    mid-save; a SIGTERM to this script alone left the trainer running on, an orphan. (Passing signals on to a child
    in this group would have given it two where `timeout` signals the whole group, and a second signal stops a
    trainer at once, unsaved.)"""
    from blockpress.stopping import STOP_SIGNALS, on_signals

    child = subprocess.Popen(cmd, process_group=0)
    with on_signals(STOP_SIGNALS, lambda signum, frame: child.send_signal(signum)):
        rc = child.wait()
    if rc:
        raise SystemExit(rc if rc > 0 else 128 - rc)  # a step a signal killed: the shell's 128 + its number


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["code", "sudoku", "sudoku-ar"], default="code")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time budget (the data is built before it starts)")
    ap.add_argument("--steps", type=int, default=20000, help="schedule length (the budget usually ends first)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--noise", choices=["absorbing", "uniform"], default="absorbing",
                    help="absorbing: corrupt to one noise token (<|hole|> for code, the empty-cell 0 for sudoku), as the "
                         "shipped models were trained last; uniform: DiffusionGemma's random tokens")
    ap.add_argument("--puzzles", type=int, default=200_000,
                    help="sudoku: training puzzles, made before the budget starts (about 10 ms of CPU each, over "
                         "--puzzle-workers processes; the cache's are not made again)")
    ap.add_argument("--puzzle-cache", default=str(ROOT / ".gpu" / "sudoku-puzzles.jsonl"),
                    help="sudoku: the puzzles' JSON-lines cache, read and extended (default: .gpu/'s, which "
                         "scripts/prepare_gpu_session.sh starts)")
    ap.add_argument("--puzzle-workers", type=int, default=max(1, (os.cpu_count() or 1) - 2),
                    help="sudoku: processes making puzzles (default: this machine's cores less two)")
    ap.add_argument("--heldout-puzzles", type=int, default=64,
                    help="sudoku: puzzles held out for the eval loss (train_sudoku.py's --heldout-puzzles)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.task.startswith("sudoku"):
        cmd = [sys.executable, str(ROOT / "scripts" / "train_sudoku.py"), "--out", str(out / "model"),
               "--puzzles", str(args.puzzles), "--puzzle-cache", args.puzzle_cache,
               "--puzzle-workers", str(args.puzzle_workers), "--heldout-puzzles", str(args.heldout_puzzles),
               "--steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--minutes", str(args.minutes),
               "--device", args.device]
        if args.task == "sudoku-ar":
            cmd += ["--ar"]
        elif args.noise == "absorbing":
            cmd += ["--noise", "empty"]
        run(cmd)
        print((out / "model" / "summary.json").read_text())
        return
    corpus = out / "corpus"
    run([sys.executable, str(ROOT / "scripts" / "build_code_corpus.py"), "--out", str(corpus)])
    cmd = [
        sys.executable, "-m", "blockpress.cli", "train", "--config", str(ROOT / "scripts" / "configs" / "blockpress-code.json"),
        "--tokenizer", str(corpus / "tokenizer"), "--data", str(corpus / "train.bin"),
        "--heldout-data", str(corpus / "heldout.bin"), "--out", str(out / "model"), "--device", args.device,
        "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
        "--warmup-steps", "200", "--prompt-min", "16", "--prompt-max", "128", "--response-canvases", "2",
        "--log-every", "20", "--eval-every", "500", "--save-every", "500", "--max-minutes", str(args.minutes),
        "--quiet",
    ]
    if args.noise == "absorbing":
        from blockpress.tokenizer import Tokenizer

        cmd += ["--noise-token-id", str(Tokenizer.from_dir(corpus / "tokenizer").token_to_id("<|hole|>"))]
    run(cmd)
    lines = [json.loads(x) for x in (out / "model" / "metrics.jsonl").read_text().splitlines()]
    summary = {"task": args.task, "steps": max(x["step"] for x in lines),
               "last_loss": next((x["loss"] for x in reversed(lines) if "loss" in x), None),  # None: stopped before a log
               "eval": [(x["step"], x["eval_loss"]) for x in lines if "eval_loss" in x],
               "tok_s": next((x["tok_s"] for x in reversed(lines) if "tok_s" in x), None)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
