#!/usr/bin/env bash
# A/B of the retrieval stream's CPU path (selection threads, blocking waits, the hand-off scatter
# on the kernel's threads, the gather fused into the kernel, the copy stream) at LLaDA2.0-mini
# 32K, herald 5%, `selected` kernel output: this tree against an older herald package.
#   here:  git archive HEAD herald | tar -x -C .ab/before   (then overwrite herald/offload,
#          herald/csrc and herald/kv/pinned.py with the older commit's: git archive OLD ...)
#          and ignore .ab/ (.git/info/exclude)
#   run:   bash scripts/device/offload_cpu_path_ab.sh [BATCH] [BEFORE_THREADS]   carry: .ab/before
# Compare per block: retrieval s, stall s, and the per-layer sums kernel / gather_copy /
# query_to_host; the kernel's GB/s = K bytes read per block / kernel s.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BATCH=${1:-80}; BEFORE_THREADS=${2:-14}
ROOT=$PWD
for side in after before; do
  if [ "$side" = after ]; then
    cd "$ROOT"; export HERALD_CACHE_DIR=/tmp/hc_after; unset HERALD_SELECTION_THREADS
  else
    cd "$ROOT/.ab/before" || exit 1
    export HERALD_CACHE_DIR=/tmp/hc_before HERALD_SELECTION_THREADS=$BEFORE_THREADS
  fi
  # cwd first on sys.path (python -m), so each side imports its own herald
  PYTHONPATH=$PWD timeout 280 python3 -m herald.bench.profile_offload --no-profile --blocks 4 \
    --batch "$BATCH" --output-mode selected --out "$OUT/$side" > "$OUT/$side.log" 2>&1
  echo "== $side rc $?"; grep -E "threads=|decode_tok|main " "$OUT/$side.log" | cut -c1-300
done
