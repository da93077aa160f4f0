#!/usr/bin/env bash
# GPU call (~6 minutes) for a DecodeBatch change: the GPU-marked tests (one of them runs apply()
# under torch.cuda.set_sync_debug_mode("error")), then scripts/diagnostics/decode_batch_ab.py
# against an earlier DecodeBatch (tokens of every engine equal, dense ms/step with each).
# Before the call, on the dev machine:
#   git show <commit>:herald/engine/decode_batch.py > .dev/old_decode_batch.py
# and name .dev in carry (the tracked results/ is over the call's size limit: move it out of the
# tree for the call and back after it).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/device/gpu_tests.sh 240
timeout 300 python3 scripts/diagnostics/decode_batch_ab.py .dev/old_decode_batch.py cuda \
  2>&1 | grep -v Warning | tail -12
