#!/usr/bin/env bash
# One prepared GPU session for issues 5 and 7, sized for a 15-minute H200 lease (about 9.5 minutes of run:
# call it with timeout_s 590 and nothing else, as `OUT=$OUT bash scripts/gpu_session.sh`). Every phase is
# fitted to a deadline (DEADLINE s after the start, default 570), and every result is in $OUT as soon as it
# exists, so a run cut short still returns what it finished.
#
#   Phase A (BENCH_S s, then at most 90 s): the 26B-A4B speed check, the GPU to itself
#            (scripts/gpu_bench.py: eager, AR, CUDA graphs, a short profile, then FP8; a phase that fails is
#            recorded in bench.json and the next one runs), then a batch-size sweep with its plot (`blockpress
#            bench`, rewritten after each batch size), while the CPU cores generate more sudoku puzzles (seeded;
#            extends .gpu/sudoku-puzzles.jsonl, each as it is made). A failed exit leaves its log's tail in
#            session.log.
#   Phase B (at most TRAIN_MIN min, less if the clock says so): three trainings side by side on the GPU, each
#            annealing its learning rate over its budget: blockpress-code and blockpress-sudoku continued from
#            the shipped weights (and their decoding defaults), the sudoku AR baseline continued with the same
#            budget. Each run saves before its last evaluation, and a timeout stops (then kills) one that hangs,
#            40 s before the deadline. A run that dies in its first minute is retried once with batches built in
#            the loop and no autocast (out of memory: with half the batch). Each checkpoint is cast to bf16 and
#            tarred into $OUT as soon as its run ends (at most 8 files of 16 MiB come back).
#   Then, if time remains, one training step is profiled, eager (extra.tar); COMPILE=1's figure is not measured.
#
# Needs .gpu/corpus (the code corpus built here: the device has another Python, so another stdlib) and
# .gpu/sudoku-puzzles.jsonl, carried with the call (scripts/prepare_gpu_session.sh builds both). Smoke run on a
# CPU (float32: a CPU without native bf16 would crawl; tiny shapes, a short clock), after that script, with PY a
# Python that has blockpress's requirements (here: python, a venv activated; .ci/run makes one in .venv):
#   OUT=/tmp/s DEVICE=cpu BENCH_PRESET=tiny BENCH_DTYPE=float32 BATCH_PRESET=tiny PROMPT_LENGTH=16 NEW_TOKENS=32 \
#     PUZZLES=12300 CODE_BATCH=8 SUDOKU_BATCH=8 WORKERS=1 DEADLINE=300 PY=python \
#     bash scripts/gpu_session.sh 60 0.3
set -u
OUT=${OUT:?set OUT to the output folder}
BENCH_S=${1:-150}
TRAIN_MIN=${2:-3.3}
DEADLINE=${DEADLINE:-570}  # seconds after the start by which everything is in $OUT
case $DEADLINE in ''|*[!0-9]*) echo "DEADLINE: expected whole seconds, got '$DEADLINE'" >&2; exit 2;; esac
DEVICE=${DEVICE:-cuda}
BENCH_PRESET=${BENCH_PRESET:-26b-a4b}
BENCH_DTYPE=${BENCH_DTYPE:-bfloat16}
PROMPT_LENGTH=${PROMPT_LENGTH:-4096}
NEW_TOKENS=${NEW_TOKENS:-256}
PUZZLES=${PUZZLES:-150000}
BATCH_PRESET=${BATCH_PRESET:-medium}
CODE_BATCH=${CODE_BATCH:-512}
SUDOKU_BATCH=${SUDOKU_BATCH:-1024}
WORKERS=${WORKERS:-4}
DATA=${GPU_DATA:-.gpu}  # what prepare_gpu_session.sh built
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
W=${WORK:-/tmp/gpu_session}
rm -rf "$W" && mkdir -p "$W/extra" "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/session.log"; }

log "start: device $DEVICE, bench ${BENCH_S}s, training ${TRAIN_MIN} min"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"; } >>"$OUT/session.log" 2>&1
if [ "$DEVICE" = cuda ] && ! nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200; then
  log "warning: not an H200 ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)): the bench's figures do not compare with issue 7's H200 ones"
fi
for f in "$DATA"/corpus/train.bin "$DATA"/corpus/heldout.bin "$DATA"/sudoku-puzzles.jsonl; do
  # (carry=[".gpu"] from a checkout that lacks it sends nothing: every training would fail)
  [ -f "$f" ] || { log "missing $f: run scripts/prepare_gpu_session.sh in the checkout the device tool sends"; exit 2; }
done

# -- phase A ---------------------------------------------------------------------------------------------------
cp "$DATA"/sudoku-puzzles.jsonl "$W/puzzles.jsonl"
# (niced, four cores left free: the eager engine's speed is bound by the CPU's work per operation)
nice -n 19 $PY scripts/train_sudoku.py --out "$W/unused" --puzzles "$PUZZLES" --puzzle-cache "$W/puzzles.jsonl" \
    --puzzle-workers "$(( $(nproc) > 6 ? $(nproc) - 4 : 1 ))" --only-puzzles >"$W/puzzles.log" 2>&1 &
PUZZLE_PID=$!
# No compiled phase: it failed under the device's torch 2.11 (InductorError) and took its time; CUDA graphs and
# the FP8 phase (last, in place) get it instead.
timeout "$BENCH_S" $PY scripts/gpu_bench.py --preset "$BENCH_PRESET" --device "$DEVICE" --dtype "$BENCH_DTYPE" \
    --prompt-length "$PROMPT_LENGTH" --new-tokens "$NEW_TOKENS" --ar-tokens 64 --out "$W/bench" \
    --compile-mode none >"$W/bench.log" 2>&1
rc=$?
log "bench exit $rc$( [ $rc -eq 124 ] && echo ": its ${BENCH_S} s ran out; bench.json holds the phases it finished")"
cp "$W/bench/result.json" "$OUT/bench.json" 2>/dev/null
# result.json exists from the first phase on: the log's end (the traceback, or the phase a timeout cut) is kept
# whenever the run did not finish
[ $rc -eq 0 ] && [ -f "$OUT/bench.json" ] || tail -30 "$W/bench.log" | cut -c1-300 >>"$OUT/session.log"
# Batch-size sweep on a mid-size shape (diffusion vs AR, eager and CUDA graphs; --no-reference: the reference is
# not timed in this session, which has no minutes for it) and its plot, into $OUT at once. bench rewrites both after each batch size, so a
# timeout keeps the sizes it measured (the JSON then says "partial": true); its log goes along.
timeout 90 $PY -m blockpress.cli bench --preset "$BATCH_PRESET" --device "$DEVICE" --dtype "$BENCH_DTYPE" \
    --batch-sizes 1 4 16 64 --steps 16 --new-tokens 128 --repeats 1 --no-reference \
    $( [ "$DEVICE" = cuda ] && echo --cuda-graphs ) \
    --out "$W/extra/bench_batch.json" --plot "$W/extra/bench_batch.png" >"$W/extra/bench_batch.log" 2>&1
rc=$?
log "batch sweep exit $rc$( [ $rc -eq 124 ] && echo ": its 90 s ran out; extra.tar holds the batch sizes it finished")"
[ $rc -eq 0 ] || tail -15 "$W/extra/bench_batch.log" | cut -c1-300 >>"$OUT/session.log"
tar -C "$W" -cf "$OUT/extra.tar" extra 2>/dev/null
for _ in $(seq 20); do kill -0 $PUZZLE_PID 2>/dev/null || break; sleep 1; done  # at most 20 s more
if kill -0 $PUZZLE_PID 2>/dev/null; then
  kill $PUZZLE_PID; wait $PUZZLE_PID 2>/dev/null
  [ -n "$(tail -c 1 "$W/puzzles.jsonl")" ] && sed -i '$ d' "$W/puzzles.jsonl"  # a line cut short by the kill
  log "puzzles: stopped at the deadline with $(wc -l <"$W/puzzles.jsonl") (each is written as it is made)"
else
  wait $PUZZLE_PID
  log "puzzles: $(tail -1 "$W/puzzles.log")"
fi
NPUZ=$(wc -l <"$W/puzzles.jsonl")

# -- phase B ---------------------------------------------------------------------------------------------------
# Seen on an H200 (2026-11-30), four runs side by side with 16 CPU threads each: 2.3-3.2 steps/s per sudoku run
# and 2.9 per code run; one sudoku run alone (4 threads, 10 data workers): 7.8 steps/s. The aggregate is about
# the same, so the step, not the GPU, is the limit: bigger batches (4x those runs') buy tokens almost for free,
# and two CPU threads per run leave the cores to the data workers. (A 12-layer sudoku model from scratch
# reached only loss 0.41 against 0.25 in that budget, so the session no longer trains one.) One each where the
# cores are fewer than the three runs' six threads (TRAIN_THREADS sets it): on the 2-core CPU of the smoke run above, two each spun
# against each other (an RMSNorm 28 ms against 1.7 ms) and every run logged one step in its budget, 9 with one.
export OMP_NUM_THREADS=${TRAIN_THREADS:-$(( $(nproc) >= 6 ? 2 : 1 ))}
COMPILE_FLAG=$( [ "${COMPILE:-0}" = 1 ] && echo --compile )
# The trainings get what the clock leaves: 75 s are kept for the last evaluation, saving and packing.
LEFT_MIN=$(awk -v s=$(( DEADLINE - SECONDS - 75 )) 'BEGIN { printf "%.2f", s / 60 }')
TRAIN_MIN=$(awk -v a="$TRAIN_MIN" -v b="$LEFT_MIN" 'BEGIN { m = (a < b ? a : b); printf "%.2f", (m > 0.3 ? m : 0.3) }')
log "training for $TRAIN_MIN min (deadline ${DEADLINE}s, now ${SECONDS}s)"
if awk -v m="$LEFT_MIN" 'BEGIN { exit !(m < 0.3) }'; then
  log "no time left to train: done at ${SECONDS}s"
  exit 0
fi
minutes_left() {  # what the clock leaves a run started now, keeping 75 s to evaluate, save and pack
  awk -v s=$(( DEADLINE - SECONDS - 75 )) 'BEGIN { m = s / 60; printf "%.2f", (m > 0.3 ? m : 0.3) }'
}
# Each training also runs under a timeout, for a run that hangs or overruns its --max-minutes (a stuck data worker,
# a long first compile): SIGTERM 40 s before the deadline makes it finish its step and save (the trainer's own
# handler), SIGKILL 15 s later if it does not, and the others' results and its own save still get packed.
STOP=(timeout -s TERM -k 15)
stop_after() { local s=$(( DEADLINE - SECONDS - 40 )); echo $(( s > 30 ? s : 30 )); }
code_run() {  # $1: extra flags
  "${STOP[@]}" "$(stop_after)" $PY -m blockpress.cli train --model blockpress/models/blockpress-code --dtype float32 \
    --data "$DATA"/corpus/train.bin --heldout-data "$DATA"/corpus/heldout.bin --out "$W/code" --device "$DEVICE" \
    --steps 1000000 --batch-size "$CODE_BATCH" --lr 1e-3 --warmup-steps 100 --prompt-min 16 --prompt-max 128 \
    --response-canvases 2 --log-every 50 --eval-every 1000 --eval-batches 8 --save-every 0 \
    --max-minutes "$TRAIN_MIN" --time-schedule --noise-token-id 5 --seed 21 --quiet $COMPILE_FLAG "$@"
}
sudoku_run() {  # $1: out name, then flags
  local name=$1; shift
  "${STOP[@]}" "$(stop_after)" $PY scripts/train_sudoku.py --out "$W/$name" --noise empty --aux-ar-weight 0.25 --puzzles "$NPUZ" \
    --puzzle-cache "$W/puzzles.jsonl" --batch-size "$SUDOKU_BATCH" --steps 1000000 --minutes "$TRAIN_MIN" --time-schedule \
    --device "$DEVICE" $COMPILE_FLAG "$@"
}
with_retry() {  # $1: name, $2: its batch size, then the command; one that fails within 60 s is retried, safer
  local name=$1 batch=$2; shift 2
  local t0=$SECONDS
  "$@" >"$W/$name.log" 2>&1
  local rc=$?
  # (124, 137: stopped by its timeout, which leaves no time to retry)
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 137 ] && [ $(( SECONDS - t0 )) -lt 60 ]; then
    # Out of memory: half the batch, autocast kept (it takes less memory). Else without workers or autocast.
    local safe=(--data-workers 0 --no-autocast)
    if grep -qi "out of memory" "$W/$name.log" && [ "$batch" -gt 1 ]; then safe=(--batch-size $(( batch / 2 ))); fi
    log "$name failed early (exit $rc), retrying with ${safe[*]}: $(tail -3 "$W/$name.log" | tr '\n' ' ')"
    mv "$W/$name.log" "$W/$name.first.log"
    rm -rf "${W:?}/$name"  # the failed start's folder: `blockpress train` refuses an --out that holds a run
    # this subshell's budget: the retry ends with the others, not a minute later
    TRAIN_MIN=$(awk -v a="$TRAIN_MIN" -v b="$(minutes_left)" 'BEGIN { printf "%.2f", (a < b ? a : b) }')
    "$@" "${safe[@]}" >"$W/$name.log" 2>&1
    rc=$?
  fi
  case $rc in
    124) log "$name exit 124: stopped by its timeout (it saves after the step it is in)";;
    137) log "$name exit 137: killed by its timeout, 15 s after the stop signal";;
    *) log "$name exit $rc";;
  esac
}
pack() {  # $1: run name. The checkpoint in bf16, its metrics and log, into $OUT as soon as the run ends
  local name=$1
  if [ -f "$W/$name/model.safetensors" ]; then
    $PY -c "import sys, torch, blockpress; blockpress.load(sys.argv[1], dtype=torch.bfloat16).save(sys.argv[2])" \
      "$W/$name" "$W/pack/$name" >>"$W/$name.pack.log" 2>&1
    cp "$W/$name"/metrics.jsonl "$W/$name"/summary.json "$W/$name.log" "$W/pack/$name/" 2>/dev/null
    tar -C "$W/pack" -cf "$W/$name.tar" "$name" && split -b 15m -d "$W/$name.tar" "$OUT/$name.tar."
    [ -f "$W/$name.tar" ] || tail -5 "$W/$name.pack.log" >>"$OUT/session.log"  # $W does not come back
  fi
  log "$name: $(tail -c 400 "$W/$name/metrics.jsonl" 2>/dev/null | tail -1 | cut -c1-300) $(tail -2 "$W/$name.log" | tr '\n' ' ' | cut -c1-300)"
}
{ with_retry code "$CODE_BATCH" code_run --data-workers "$WORKERS"; pack code; } &
{ with_retry sudoku "$SUDOKU_BATCH" sudoku_run sudoku --init-from blockpress-sudoku --lr 1e-3 --seed 31 --data-workers "$WORKERS"
  pack sudoku; } &
{ with_retry sudoku-ar "$SUDOKU_BATCH" sudoku_run sudoku-ar --ar --init-from benchmarks/baselines/sudoku-ar --lr 1e-3 --seed 31 \
    --data-workers "$WORKERS"; pack sudoku-ar; } &
wait

# -- what time remains: one training step profiled (eager; compile would not fit) -------------------------------
LEFT=$(( DEADLINE - SECONDS - 15 ))
if [ "$LEFT" -gt 30 ]; then
  timeout "$(( LEFT < 90 ? LEFT : 90 ))" $PY scripts/profile_train_step.py --device "$DEVICE" --batch-size 256 \
      --out "$W/extra/train_profile.json" >"$W/train_profile.log" 2>&1 || tail -5 "$W/train_profile.log" >>"$OUT/session.log"
  tar -C "$W" -cf "$OUT/extra.tar" extra 2>/dev/null
fi
log "done at ${SECONDS}s"
