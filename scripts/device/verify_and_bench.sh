#!/usr/bin/env bash
# One device call for the next session (~9 minutes): every GPU-marked test, the HERALD run at
# size eager and with CUDA graphs, then the dense throughput run (may need its own call).
# Everything lands under $OUT.
#   run: bash scripts/device/verify_and_bench.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/device/gpu_tests.sh 200
timeout 150 python3 -m herald.bench.offload --out "$OUT/offload" 2>&1 | tail -3
timeout 150 python3 -m herald.bench.offload --cuda-graph --out "$OUT/offload_graphs" 2>&1 | tail -3
timeout 240 python3 -m herald.bench.dense --out "$OUT/dense" 2>&1 | tail -7
