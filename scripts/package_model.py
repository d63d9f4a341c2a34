"""Copy a trained checkpoint into the package (blockpress/models/NAME) so `blockpress.load(NAME)` finds it.

Weights are stored in bfloat16 (half the bytes; this CPU family computes bf16 natively), with the
tokenizer, generation defaults, the training metrics and, for code models, the corpus manifest (which
modules were held out: the checkpoint's own corpus_manifest.json, unless --manifest gives another). The
package is built beside the old one, loaded once and size-checked, and only then takes its place: a failure
(over --max-mb, bad settings, a missing file) leaves the shipped model as it was.

    python scripts/package_model.py runs/code blockpress-code --manifest corpus/manifest.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

from script_args import json_flag

import blockpress

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "blockpress" / "models"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="the trained checkpoint folder")
    ap.add_argument("name", help="the model's name in the package: letters, digits, '-', '_' and '.'")
    ap.add_argument("--manifest", default=None, help="corpus manifest.json to ship as corpus_manifest.json "
                    "(default: the checkpoint's own corpus_manifest.json, where it has one)")
    ap.add_argument("--generation", default=None, help="JSON object of generation defaults to write")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-mb", type=float, default=25.0)
    args = ap.parse_args()
    # A plain folder name: "" or "." would be the models folder itself (replacing every shipped model), ".." outside.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.name) or ".." in args.name:
        ap.error(f"name: expected a plain folder name (letters, digits, '-', '_', '.'), got {args.name!r}")
    if args.manifest and not Path(args.manifest).is_file():
        ap.error(f"--manifest: no file {args.manifest!r}")
    generation = {}
    if args.generation:
        generation = json_flag(ap, "--generation", args.generation, "object")
    src = Path(args.checkpoint)
    try:
        lm = blockpress.load(src, dtype=args.dtype)
        lm.generation_config.update(generation)
        lm.sampler_defaults  # noqa: B018  (the settings are checked as the packaged model will read them)
    except (ValueError, OSError) as exc:
        ap.error(str(exc))
    dst = MODELS / args.name
    with tempfile.TemporaryDirectory(dir=MODELS) as tmp:
        new = Path(tmp) / args.name
        lm.save(new)
        # corpus_manifest.json too: re-packaging a shipped code model (new --generation defaults) dropped it, and
        # with it the record of the held-out modules the code benchmarks evaluate on
        for extra in ("metrics.jsonl", "summary.json", "corpus_manifest.json"):
            if (src / extra).exists():
                shutil.copy(src / extra, new / extra)
        if args.manifest:  # over the checkpoint's own
            shutil.copy(args.manifest, new / "corpus_manifest.json")
        size = sum(f.stat().st_size for f in new.iterdir()) / 1e6
        if size > args.max_mb:
            ap.error(f"{args.name}: {size:.1f} MB is over --max-mb {args.max_mb:g}; the package is unchanged")
        blockpress.load(new)  # it loads as shipped, or the old one stays
        if dst.exists():
            shutil.rmtree(dst)
        new.rename(dst)
    print(json.dumps({"name": args.name, "path": str(dst), "mb": round(size, 2), "params": lm.num_parameters(False)}))


if __name__ == "__main__":
    main()
