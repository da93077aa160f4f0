#!/usr/bin/env bash
# Dense and HERALD throughput points with herald's Triton kernels off and on (HERALD_TRITON), in
# one run on the device machine: LLaDA2.0-mini 32K at the 80 GB cap, dense bs 32 and HERALD
# `selected` bs 80.
#
#   scripts/device/forward_ab.sh [POINT ...]      POINT: "MODE BATCH", e.g. "dense 32"
#
# Each HERALD_TRITON value's points (TRITON_VALUES, default "0 auto") go to
# $OUT/triton_<value>/ (throughput.jsonl, README.md); the summary (tok/s, forward median per
# variant and point) is printed and written to $OUT/ab_summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
points=("$@"); [ ${#points[@]} -eq 0 ] && points=("dense 32" "herald-selected 80")
for spec in "${points[@]}"; do
    for triton in ${TRITON_VALUES:-0 auto}; do
        set -- $spec
        HERALD_TRITON=$triton timeout 300 python3 -m herald.bench.throughput --model llada2-mini \
            --context 32768 --mode "$1" --batches "$2" --gpu-memory-gb 80 \
            --out "$OUT/triton_$triton" 2>&1 | tail -3
    done
done
python3 "$(dirname "$0")/ab_summary.py" "$OUT" "triton_*" | tee "$OUT/ab_summary.txt"
