#!/usr/bin/env bash
# GPU call for the kv_pad=512 default (~7 minutes): the GPU-marked tests (budget 1.0 in every
# mode now runs with the default padding), the dense engine's decode throughput with kv_pad 0
# vs 512 at the paper's LLaDA2.0-mini Dense batches, and the throughput harness smoke.
#   run: bash scripts/device/kv_pad_default.sh      (everything under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/device/gpu_tests.sh 240
for pad in 0 512; do
  timeout 150 python3 -m herald.bench.dense --only llada2-mini --kv-pad $pad \
    --out "$OUT/dense_kvpad$pad" 2>&1 | grep -E "tok/s" | tail -2
done
LIMIT=200 bash scripts/device/throughput.sh smoke 2>&1 | tail -25
