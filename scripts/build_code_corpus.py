"""Build the blockpress-code corpus from the running interpreter's standard library.

Every machine with Python has it, so the corpus needs no download. Steps:
  1. collect the stdlib's .py files, its test suite included (no site-packages, no generated tables);
  2. drop exact duplicates (by content hash);
  3. hold out whole modules (about 5%, chosen by a stable hash of the module path): never trained on;
  4. train a byte-level BPE tokenizer on the training files;
  5. write token shards (documents joined by EOS) and a JSON manifest.

    python scripts/build_code_corpus.py --out corpus/ --vocab-size 8192
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path, PurePath

from script_args import progress

from blockpress.data import write_shard
from blockpress.tokenizer import DEFAULT_SPECIAL_TOKENS, Tokenizer, train_bpe_tokenizer

SKIP_PARTS = {"site-packages", "__pycache__", "ensurepip"}
MAX_BYTES = 200_000  # generated tables (unicode data, encodings) teach nothing about code
# the byte alphabet and the special tokens: a smaller --vocab-size was silently this one (no merges learnt)
MIN_VOCAB = 256 + len(DEFAULT_SPECIAL_TOKENS)


def stdlib_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or rel.parts[0].startswith("encodings"):
            continue
        if path.stat().st_size > MAX_BYTES or path.stat().st_size < 200:
            continue
        files.append(path)
    return files


def module_name(path: PurePath, root: PurePath) -> str:
    """`path` under `root`, '/' between its parts on every platform: what the held-out split hashes and the manifest
    lists (str() gave backslashes on Windows: another split from the same stdlib)."""
    return path.relative_to(root).as_posix()


def is_heldout(rel: str, fraction: float) -> bool:
    h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < fraction


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--vocab-size", type=int, default=8192,
                    help=f"tokenizer vocabulary, at least {MIN_VOCAB} (the 256 bytes and the special tokens)")
    ap.add_argument("--heldout", type=float, default=0.05, help="fraction of modules held out, in [0, 1)")
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N files (smoke tests); 0: all")
    ap.add_argument("--tokenizer", default=None,
                    help="encode with this folder's tokenizer instead of training one (e.g. blockpress/models/"
                         "blockpress-code, to rebuild the corpus that model was trained on)")
    args = ap.parse_args()
    # Before any work: --heldout 1.5 held out every file (an empty train.bin, a tokenizer trained on nothing),
    # -1 none; --max-files -1 sliced off the last file; --vocab-size 10 gave a vocabulary of 262, all exit 0.
    if not 0 <= args.heldout < 1:
        ap.error(f"--heldout: expected a fraction in [0, 1), got {args.heldout:g}")
    if args.max_files < 0:
        ap.error(f"--max-files: expected an integer >= 0 (0: every file), got {args.max_files}")
    if args.vocab_size < MIN_VOCAB:
        ap.error(f"--vocab-size: expected at least {MIN_VOCAB} (the 256 bytes and {len(DEFAULT_SPECIAL_TOKENS)} "
                 f"special tokens), got {args.vocab_size}")
    root = Path(sysconfig.get_paths()["stdlib"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    seen: set[str] = set()
    train, held = [], []
    files = stdlib_files(root)
    # bars on a terminal's stderr: the whole standard library (13,000 files, 160 MB) takes minutes to read and encode
    for path in progress(files[: args.max_files or None], desc="reading", unit="file"):
        text = path.read_text(encoding="utf-8", errors="replace")
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        rel = module_name(path, root)
        (held if is_heldout(rel, args.heldout) else train).append((rel, text))
    if not train:  # a few --max-files under a large --heldout: nothing to train the tokenizer or a model on
        ap.error(f"--heldout {args.heldout:g}: all {len(held)} files read were held out, none is left to train on; "
                 "a smaller --heldout or a larger --max-files")

    if args.tokenizer:
        tokenizer = Tokenizer.from_dir(args.tokenizer)
    else:
        # the tokenizers library's bars (stderr) end each phase with a newline on stdout: only where both are a terminal
        tokenizer = train_bpe_tokenizer((t for _, t in train), vocab_size=args.vocab_size,
                                        progress=all(s is not None and s.isatty() for s in (sys.stdout, sys.stderr)))
    tokenizer.save(out / "tokenizer")
    eos = tokenizer.eos_id

    def docs(items, split):
        for _, text in progress(items, desc=f"encoding {split}", unit="file"):
            yield tokenizer.encode(text) + [eos]

    n_train = write_shard(out / "train.bin", docs(train, "train"), tokenizer.vocab_size)
    n_held = write_shard(out / "heldout.bin", docs(held, "heldout"), tokenizer.vocab_size)
    manifest = {
        "source": str(root), "train_files": len(train), "heldout_files": len(held),
        "heldout_modules": [r for r, _ in held], "train_tokens": n_train, "heldout_tokens": n_held,
        "vocab_size": tokenizer.vocab_size,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(json.dumps({k: v for k, v in manifest.items() if k != "heldout_modules"}))


if __name__ == "__main__":
    main()
