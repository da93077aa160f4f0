#!/usr/bin/env bash
# Next GPU call (~7 minutes): (1) the GPU-marked tests (the CPU pool's pinned registration fix);
# (2) the retrieval stream at LLaDA2.0-mini 32K x 64, 5%, in both kernel output modes, with 12,
# 14 and 16 selection threads (the kernel alone streams ~80 GB/s with 16 threads, ~55 GB/s inside
# the engine with 14). Then, as separate calls: LIMIT=420 bash scripts/device/throughput.sh resume
#   run: bash scripts/device/selected_and_threads.sh      (everything under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/device/gpu_tests.sh 200
for om in selected full; do
  timeout 220 python3 -m herald.bench.profile_offload --no-profile --blocks 3 --batch 64 \
    --output-mode $om --threads 12,14,16 --out "$OUT/threads_$om" > "$OUT/threads_$om.log" 2>&1
  echo "== $om rc $?"; grep -E "^\[threads|main " "$OUT/threads_$om.log" | cut -c1-120
done
