#!/usr/bin/env bash
# One device-machine call: GPU tests, then the dense throughput benchmark. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-300 > "$OUT/cpu.txt"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/models tests/engine 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
timeout 400 python3 -m herald.bench.dense --out "$OUT/dense" "$@" 2>&1 | tee "$OUT/dense.log"
