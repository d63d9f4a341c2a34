#!/usr/bin/env bash
# Build what scripts/gpu_session.sh carries to the GPU machine, in .gpu/ (ignored by git, about 18 MB):
# the stdlib code corpus encoded with blockpress-code's own tokenizer (this machine's Python: the GPU
# machine has another, hence another stdlib) and the first 12,000 training puzzles. Run it in the checkout the
# device tool sends (the session's own, not a git worktree beside it: .gpu travels only from there). Then, in the
# agent, naming the H200 (a call without a kind may get an H100, whose figures do not compare with issue 7's) and,
# where the device time left is short, a DEADLINE under the limit the tool gives the command (limit_s - 20):
#   run(command="OUT=$OUT bash scripts/gpu_session.sh", carry=[".gpu"], timeout_s=590, kind="nvidia-h200")
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python}
# (in a worktree .git is a file: the exclude file is where git says, so .gpu/ is never committed; a copy that is
# no git checkout has none to keep)
if exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
  grep -qx '/.gpu/' "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")" && echo /.gpu/ >>"$exclude"; }
  if [ "$(git rev-parse --git-dir)" != "$(git rev-parse --git-common-dir)" ]; then
    echo "note: $PWD is a git worktree; the device tool sends the session's main checkout, so build .gpu there" >&2
  fi
fi
mkdir -p .gpu
[ -f .gpu/corpus/train.bin ] || $PY scripts/build_code_corpus.py --out .gpu/corpus --tokenizer blockpress/models/blockpress-code
[ -f .gpu/sudoku-puzzles.jsonl ] || $PY scripts/train_sudoku.py --out /tmp/unused --puzzles 12000 \
    --puzzle-cache .gpu/sudoku-puzzles.jsonl --puzzle-workers 2 --only-puzzles
du -sh .gpu
