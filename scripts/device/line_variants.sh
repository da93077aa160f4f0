#!/usr/bin/env bash
# Issue 6, line task: how much the long context helps (dense vs the 512-token control) under
# each target setting and in-file cap, measured with many examples on the GPU machine (dense
# and the control only: ~1 s per 10 examples at 8K on the H200). One call, ~6 minutes.
#
#   CKPT=checkpoints/code-sdar/ckpt bash scripts/device/line_variants.sh
#
# Exploratory: the default SEED=1 keeps these example sets apart from the seed-0 sets that the
# acceptance run (scripts/device/eval.sh) uses, so the variant chosen here is confirmed on
# examples it was not chosen on.
# Writes $OUT/line-variants.tgz: one `herald eval` folder per variant (<setting>-in<cap>/), each
# with its README (the paired bootstrap of dense minus control) and runs/.
# Env: CKPT (required), SEED (1), N_FIRST (400: all ~370 cross_file_first targets at 8K),
#      N_RANDOM (512), CONTEXT (8192), TIME_LIMIT (200 s per variant), CAPS ("1024 4096").
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HERALD_COMPILE=${HERALD_COMPILE:-0}
OUT=${OUT:-/tmp/out}
: "${CKPT:?set CKPT to the checkpoint directory}"
ROOT=$OUT/line-variants
mkdir -p "$ROOT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
for setting in cross_file_first cross_file_random; do
  n=${N_FIRST:-400}
  [ "$setting" = cross_file_random ] && n=${N_RANDOM:-512}
  for cap in ${CAPS:-1024 4096}; do
    dest=$ROOT/$setting-in$cap
    echo "== $setting, in-file cap $cap, n $n"
    timeout 300 python3 -m herald.cli eval --model "$CKPT" --out "$dest" --task line \
      --contexts "${CONTEXT:-8192}" --modes dense -n "$n" --seed "${SEED:-1}" \
      --line-setting "$setting" --infile-tokens "$cap" --analysis-examples 0 \
      --time-limit "${TIME_LIMIT:-200}" 2>&1 | grep -oE "NOTE: .*|line_[0-9]+_[a-z]+: score .*"
    [ -f "$dest/README.md" ] && grep -E "line \(ES\)" "$dest/README.md"
  done
done
tar czf "$OUT/line-variants.tgz" -C "$OUT" line-variants && rm -rf "$ROOT"
echo "packed $OUT/line-variants.tgz"
