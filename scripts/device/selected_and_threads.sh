#!/usr/bin/env bash
# Next GPU call (~8 minutes): (1) the GPU-marked tests (the CPU pool's pinned registration fix);
# (2) the retrieval stream at LLaDA2.0-mini 32K x 64, 5%, in both kernel output modes, with 12,
# 14 and 16 selection threads (the kernel alone streams ~80 GB/s with 16 threads, ~55 GB/s inside
# the engine with 14); (3) the throughput plan's pending points (Fig. 13 holds HERALD with the
# `selected` output mode at 16K and 32K) until LIMIT.
#   run: bash scripts/device/selected_and_threads.sh      (everything under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/device/gpu_tests.sh 200
for om in selected full; do
  timeout 150 python3 -m herald.bench.profile_offload --no-profile --blocks 3 --batch 64 \
    --output-mode $om --threads 12,14,16 --out "$OUT/threads_$om" > "$OUT/threads_$om.log" 2>&1
  echo "== $om rc $?"; grep -E "^\[threads|main " "$OUT/threads_$om.log" | cut -c1-120
done
LIMIT=${LIMIT:-150} bash scripts/device/throughput.sh resume --figures fig13 2>&1 | tail -15
