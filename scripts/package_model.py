"""Copy a trained checkpoint into the package (blockpress/models/NAME) so `blockpress.load(NAME)` finds it.

Weights are stored in bfloat16 (half the bytes; this CPU family computes bf16 natively), with the
tokenizer, generation defaults, the training metrics and, for code models, the corpus manifest (which
modules were held out). Fails if the folder would exceed --max-mb.

    python scripts/package_model.py runs/code blockpress-code --manifest corpus/manifest.json
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import blockpress

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("name")
    ap.add_argument("--manifest", default=None, help="corpus manifest.json to ship as corpus_manifest.json")
    ap.add_argument("--generation", default=None, help="JSON of generation defaults to write")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-mb", type=float, default=25.0)
    args = ap.parse_args()
    src = Path(args.checkpoint)
    dst = ROOT / "blockpress" / "models" / args.name
    lm = blockpress.load(src, dtype=args.dtype)
    if args.generation:
        lm.generation_config.update(json.loads(args.generation))
    if dst.exists():
        shutil.rmtree(dst)
    lm.save(dst)
    for extra in ("metrics.jsonl", "summary.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    if args.manifest:
        shutil.copy(args.manifest, dst / "corpus_manifest.json")
    size = sum(f.stat().st_size for f in dst.iterdir()) / 1e6
    if size > args.max_mb:
        raise SystemExit(f"{dst}: {size:.1f} MB is over the {args.max_mb} MB limit")
    print(json.dumps({"name": args.name, "path": str(dst), "mb": round(size, 2), "params": lm.num_parameters(False)}))


if __name__ == "__main__":
    main()
