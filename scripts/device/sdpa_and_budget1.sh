#!/usr/bin/env bash
# Next GPU call (~5 minutes): (1) classify the intermittent budget-1.0 mismatch (tiny-llada2,
# herald): is dense itself deterministic, are selections in position order; (2) the offload
# engine's per-block times with PyTorch's SDPA pick (cuDNN, plan built per new key length) vs
# HERALD_SDPA_BACKENDS=flash,efficient,math, in both kernel output modes.
#   run: bash scripts/device/sdpa_and_budget1.sh      (everything under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 90 python3 scripts/device/diagnose_budget1.py 3 2>&1 | tail -8
echo "== same with kv_pad=512 in both engines"
timeout 90 python3 scripts/device/diagnose_budget1.py 3 512 2>&1 | tail -7
for om in full selected; do
  for be in default flash,efficient,math; do
    tag=${om}_${be//,/-}
    if [ "$be" = default ]; then unset HERALD_SDPA_BACKENDS; else export HERALD_SDPA_BACKENDS=$be; fi
    timeout 100 python3 -m herald.bench.profile_offload --no-profile --blocks 4 --output-mode $om \
      --out "$OUT/prof_$tag" > "$OUT/prof_$tag.log" 2>&1
    echo "== $tag rc $?"; grep -E "main " "$OUT/prof_$tag.log" | tail -3 | cut -c1-150
  done
done
unset HERALD_SDPA_BACKENDS
timeout 100 python3 -m herald.bench.profile_offload --no-profile --blocks 4 --kv-pad 512 \
  --out "$OUT/prof_full_kvpad" > "$OUT/prof_full_kvpad.log" 2>&1
echo "== full kv_pad=512 rc $?"; grep -E "main " "$OUT/prof_full_kvpad.log" | tail -3 | cut -c1-150
