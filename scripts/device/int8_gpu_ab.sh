#!/usr/bin/env bash
# HERALD with the int8 copy of K scored on the GPU (first_pass="int8-gpu") against the CPU
# kernel and dense, checked and measured in one call (~6-8 minutes):
#
#   bash scripts/device/int8_gpu_ab.sh            (everything under $OUT)
#
# 1. Its GPU tests: the engine's selections are the int8 rule's on its own KV with the GPU fetch,
#    and budget 1.0 equals dense (tests/engine/test_offload_int8_device.py,
#    test_offload.py::test_budget_one_equals_dense_on_gpu); log pytest_int8_gpu.log.
# 2. Throughput points at LLaDA2.0-mini 32K, 80 GB cap, each in its own process, in the order of
#    POINTS (default: HERALD int8-gpu bs 64, HERALD `selected` bs 80, dense bs 32, int8-gpu bs
#    96; on an 80 GB H100 int8-gpu ran out of memory from bs 72, results/offload/int8_gpu/): one
#    folder of raw records per point ($OUT/<variant>_<batch>/throughput.jsonl), the summary last
#    (also in $OUT/int8_gpu_ab.txt). At most 8 files come back: keep POINTS short, and delete
#    the points' README.md and plots when more than ~6 points run.
# MODEL (default llada2-mini) picks the model of every point; SDAR-8B-Chat's HERALD against its
# dense at 32K (the CPU pool holds 24 requests there on the one-GPU host):
#   MODEL=sdar-8b-chat SKIP_TESTS=1 POINT_LIMIT=240 POINTS="dense:12 herald-selected:24" \
#     bash scripts/device/int8_gpu_ab.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${SKIP_TESTS:-0}" != 1 ]; then  # (SKIP_TESTS=1: scripts/device/gpu_tests.sh ran them)
    timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/engine/test_offload_int8_device.py \
        "tests/engine/test_offload.py::test_budget_one_equals_dense_on_gpu" \
        "tests/engine/test_offload.py::test_random_retrieval_delays_do_not_change_output" \
        > "$OUT/pytest_int8_gpu.log" 2>&1
    echo "pytest -m gpu exit $?"; tail -2 "$OUT/pytest_int8_gpu.log"
    grep -E "^FAILED" "$OUT/pytest_int8_gpu.log"
fi
for spec in ${POINTS:-herald-int8-gpu:64 herald-selected:80 dense:32 herald-int8-gpu:96}; do
    variant=${spec%%:*} batch=${spec##*:}
    echo "$variant bs $batch"
    timeout "${POINT_LIMIT:-150}" python3 -m herald.bench.throughput --model "${MODEL:-llada2-mini}" \
        --context 32768 --mode "$variant" --batches "$batch" --gpu-memory-gb 80 \
        --out "$OUT/${variant}_$batch" 2>&1 | grep -E "CPU KV pool|tok/s|Error" | sed 's/^/  /'
done
python3 "$(dirname "$0")/ab_summary.py" "$OUT" "*_*" > "$OUT/summary.tmp"
mv "$OUT/summary.tmp" "$OUT/int8_gpu_ab.txt"; cat "$OUT/int8_gpu_ab.txt"
find "$OUT" -mindepth 2 \( -name "*.png" -o -name README.md \) -delete  # (8 files come back)
