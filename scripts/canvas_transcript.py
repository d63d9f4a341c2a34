r"""Print how a canvas settles, step by step, as plain text (the README's transcript of the live view).

Tokens that changed since the previous step are wrapped in [brackets]; settled ones are bare.

    python scripts/canvas_transcript.py $'import os\n\ndef list_files(path):'
"""

from __future__ import annotations

import argparse

import blockpress
from blockpress.generate import Commit, Draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--model", default="blockpress-code")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # One line each, not a traceback (generate's ValueError, load's FileNotFoundError)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps: expected a positive integer, got {args.steps}")
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens: expected a positive integer, got {args.max_new_tokens}")
    try:
        lm = blockpress.load(args.model)
    except (ValueError, OSError) as exc:
        ap.error(f"--model: {exc}")
    tok = lm.tokenizer
    previous = None
    for event in lm.stream(args.prompt, max_new_tokens=args.max_new_tokens, max_denoising_steps=args.steps,
                           seed=args.seed):
        if isinstance(event, Draft):
            ids = event.tokens[0].tolist()
            parts = []
            for i, t in enumerate(ids):
                piece = tok.decode([t]).replace("\n", "\\n")
                parts.append(piece if previous is not None and previous[i] == t else f"[{piece}]")
            previous = ids
            print(f"step {event.step:>2}: {''.join(parts)}")
        elif isinstance(event, Commit):
            previous = None
            print(f"commit : {event.texts[0]!r}")


if __name__ == "__main__":
    main()
