#!/usr/bin/env bash
# Build what scripts/gpu_session.sh carries to the GPU machine, in .gpu/ (ignored by git, about 18 MB):
# the stdlib code corpus encoded with blockpress-code's own tokenizer (this machine's Python: the GPU
# machine has another, hence another stdlib) and the first 12,000 training puzzles. Then, in the agent:
#   run(command="OUT=$OUT bash scripts/gpu_session.sh", carry=[".gpu"], timeout_s=590)
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo /.gpu/ >>.git/info/exclude; }
mkdir -p .gpu
[ -f .gpu/corpus/train.bin ] || $PY scripts/build_code_corpus.py --out .gpu/corpus --tokenizer blockpress/models/blockpress-code
[ -f .gpu/sudoku-puzzles.jsonl ] || $PY scripts/train_sudoku.py --out /tmp/unused --puzzles 12000 \
    --puzzle-cache .gpu/sudoku-puzzles.jsonl --puzzle-workers 2 --only-puzzles
du -sh .gpu
