#!/usr/bin/env bash
# herald eval on the GPU machine: one part per call, each under ~9 minutes wall.
#
#   CKPT=checkpoints/code-sdar/ckpt bash scripts/device/eval.sh smoke       # ~1-2 min check
#   CKPT=checkpoints/code-sdar/ckpt bash scripts/device/eval.sh 4k          # 4096-token contexts
#   CKPT=checkpoints/code-sdar/ckpt bash scripts/device/eval.sh 8k          # 8192
#   CKPT=checkpoints/code-sdar/ckpt bash scripts/device/eval.sh 16k-line    # 16384, line task
#   CKPT=checkpoints/code-sdar/ckpt bash scripts/device/eval.sh 16k-recall  # 16384, recall task
#   CKPT=checkpoints/code-sdar/ckpt bash scripts/device/eval.sh all         # everything, no cap
#
# Each part writes $OUT/eval/<part>/ (examples/, runs/, results.json, README.md, plots if
# matplotlib is there). Units run most important first (dense, control, each mode at its
# operating budget, the Fig. 7/9 analysis, then the other budgets); none starts after TIME_LIMIT
# seconds, and every finished unit is already on disk, so a part cut short still reports.
# The device machine returns at most 8 files from $OUT, none deeper than $OUT/a/b/file, so the
# whole part comes back as ONE archive, $OUT/eval-<part>.tgz (the folder itself is removed after
# packing): unpack it on the dev machine with tar xzf eval-<part>.tgz -C <dest> (gives <dest>/<part>).
# Merge on the dev machine: unpack each part of one run into one folder, then
#   python -m herald eval --report --out results/eval/<run>
# (parts of one run only: --report refuses a folder that mixes models or example selections).
# To finish a cut-short part: copy it back to $OUT/eval/<part> first (e.g. from the committed
# results/eval/<run>/<part>) and rerun the same part: finished units are skipped.
# The device call carries at most 64 MiB of the working tree, and the repository's tracked files
# (checkpoint and results/) are more than that since 2026-12-01: before the call, move results/
# out of the tree and copy back only the files the command names (its --exclude-examples files,
# the part folder being resumed); put results/ back after the call.
#
# Env: CKPT (checkpoint directory, required), N (64 examples per task and context),
#      TIME_LIMIT (480), ANALYSIS (8 examples for Fig. 7/9; 0 = off), EXTRA (more flags),
#      HERALD_COMPILE (0: eager; accuracy runs need no torch.compile warm-up per new shape).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HERALD_COMPILE=${HERALD_COMPILE:-0}
OUT=${OUT:-/tmp/out}
PART=${1:-smoke}
: "${CKPT:?set CKPT to the checkpoint directory}"
DEST=$OUT/eval/$PART
mkdir -p "$DEST"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.cuda.is_available()); import importlib.util as u;
print("matplotlib", "yes" if u.find_spec("matplotlib") else "no (no plots; --report redraws)")'

args=(--model "$CKPT" --out "$DEST" -n "${N:-64}" --time-limit-s "${TIME_LIMIT:-480}"
      --analysis-examples "${ANALYSIS:-8}")
case "$PART" in
  smoke)      args=(--model "$CKPT" --out "$DEST" -n 4 --contexts 4096 --kv-budget 0.05
                    --analysis-examples 2 --time-limit-s 300) ;;
  4k)         args+=(--contexts 4096) ;;
  8k)         args+=(--contexts 8192) ;;
  16k-line)   args+=(--contexts 16384 --task line) ;;
  16k-recall) args+=(--contexts 16384 --task recall) ;;
  all)        args=(--model "$CKPT" --out "$DEST" -n "${N:-64}"
                    --analysis-examples "${ANALYSIS:-8}") ;;
  *) echo "unknown part $PART: smoke | 4k | 8k | 16k-line | 16k-recall | all"; exit 2 ;;
esac
# shellcheck disable=SC2206
args+=(${EXTRA:-})
echo "herald eval ${args[*]}"
if [ "$PART" = "all" ]; then
  python3 -m herald eval "${args[@]}"
else
  timeout 570 python3 -m herald eval "${args[@]}"
fi
rc=$?
echo "herald eval exit $rc"
ls "$DEST" 2>/dev/null
[ -f "$DEST/README.md" ] && sed -n '/## Overview/,/## Fig. 7/p' "$DEST/README.md"
tar czf "$OUT/eval-$PART.tgz" -C "$OUT/eval" "$PART" && rm -rf "$DEST" && rmdir "$OUT/eval" 2>/dev/null
echo "packed $OUT/eval-$PART.tgz"
exit $rc
