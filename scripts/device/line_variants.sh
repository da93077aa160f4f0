#!/usr/bin/env bash
# Line task: how much the long context helps (dense vs the 512-token control) under
# each target setting and in-file cap, measured with many examples on the GPU machine (dense
# and the control only: ~1 s per 10 examples at 8K on the H200). One call, ~6 minutes.
#
#   CKPT=checkpoints/code-sdar/ckpt bash scripts/device/line_variants.sh
#
# Exploratory. Note: cross_file_first and cross_file_later draw from one pool of every eligible
# target (~170 at 8K on Python 3.12), so the seed only orders it: another seed asks the same
# targets with the same prompts. A confirmation must exclude the targets measured here
# (`herald eval --exclude-examples`), which is what the CONFIRM step below does.
# Writes $OUT/line-variants.tgz: one `herald eval` folder per variant (<setting>-in<cap>/), each
# with its README (the paired bootstrap of dense minus control) and runs/.
# Env: CKPT (required), SEED (1), SETTINGS ("cross_file_first cross_file_random
#      cross_file_later"), N_FIRST (400: every cross_file_first / cross_file_later target at 8K;
#      fewer exist), N_RANDOM (512), CONTEXT (8192), TIME_LIMIT (200 s per variant),
#      CAPS ("1024 4096"), RESUME_FROM (a folder of earlier variant folders, e.g.
#      results/eval/line-variants: their finished units are skipped).
#      CONFIRM_N (0 = off): then, the variant whose dense-minus-control interval at CONTEXT has
#      the highest lower bound (ties: the larger difference), if that bound is above 0, gets a
#      run on other targets: `eval.sh 8k` with the line task only, seed 0, CONFIRM_N examples,
#      every mode and budget, excluding the targets of that variant's run here (packed as
#      $OUT/eval-8k.tgz; CONFIRM_TIME_LIMIT, default 240 s). For a pooled setting the pool may
#      hold too few other targets on the same Python; eval then says so.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HERALD_COMPILE=${HERALD_COMPILE:-0}
OUT=${OUT:-/tmp/out}
: "${CKPT:?set CKPT to the checkpoint directory}"
ROOT=$OUT/line-variants
mkdir -p "$ROOT"
[ -n "${RESUME_FROM:-}" ] && cp -r "$RESUME_FROM"/. "$ROOT"/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
for setting in ${SETTINGS:-cross_file_first cross_file_random cross_file_later}; do
  n=${N_FIRST:-400}
  [ "$setting" = cross_file_random ] && n=${N_RANDOM:-512}
  for cap in ${CAPS:-1024 4096}; do
    dest=$ROOT/$setting-in$cap
    echo "== $setting, in-file cap $cap, n $n"
    timeout 300 python3 -m herald eval --model "$CKPT" --out "$dest" --task line \
      --contexts "${CONTEXT:-8192}" --modes dense -n "$n" --seed "${SEED:-1}" \
      --line-setting "$setting" --infile-tokens "$cap" --analysis-examples 0 \
      --time-limit-s "${TIME_LIMIT:-200}" 2>&1 | grep -oE "NOTE: .*|line_[0-9]+_[a-z]+: score .*"
    [ -f "$dest/README.md" ] && grep -E "line \(ES\)" "$dest/README.md"
  done
done
# The choice: highest lower bound of the 95% interval of dense minus control at CONTEXT (ties:
# the larger difference); one line per folder: "<lower bound> <difference> <folder>".
best=$(for r in "$ROOT"/*/README.md; do
  line=$(grep -E "^- ${CONTEXT:-8192} tokens, line \(ES\):" "$r" | head -1)
  lo=$(echo "$line" | sed -nE 's/.*paired bootstrap \[([-+0-9.]+),.*/\1/p')
  diff=$(echo "$line" | sed -nE 's/.*: ([-+0-9.]+) points,.*/\1/p')
  [ -n "$lo" ] && [ -n "$diff" ] && echo "$lo $diff $(basename "$(dirname "$r")")"
done | LC_ALL=C sort -g -k1,1 -k2,2 | tail -1)
echo "highest lower bound: ${best:-none}"
tar czf "$OUT/line-variants.tgz" -C "$OUT" line-variants && rm -rf "$ROOT"
echo "packed $OUT/line-variants.tgz"
lo=${best%% *}
if [ "${CONFIRM_N:-0}" -gt 0 ] && [ -n "$best" ] && LC_ALL=C awk "BEGIN{exit !($lo > 0)}"; then
  variant=${best##* }
  setting=${variant%-in*}
  cap=${variant##*-in}
  seen=$OUT/seen-$variant.json  # the chosen variant's targets, outside the packed folder
  tar xzf "$OUT/line-variants.tgz" -O "line-variants/$variant/examples/line_${CONTEXT:-8192}.json" > "$seen"
  echo "== confirmation (seed 0, other targets): $setting, in-file cap $cap, n $CONFIRM_N"
  N=$CONFIRM_N TIME_LIMIT=${CONFIRM_TIME_LIMIT:-240} \
    EXTRA="--task line --line-setting $setting --infile-tokens $cap --exclude-examples $seen" \
    bash scripts/device/eval.sh 8k
fi
