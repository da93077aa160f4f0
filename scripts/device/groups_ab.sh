#!/usr/bin/env bash
# The retrieval job in request groups (OffloadConfig.retrieval_groups, HERALD_RETRIEVAL_GROUPS),
# checked and measured in one call (~8 minutes; ~10 with SERVE=1, then carry .whl):
#
#   bash scripts/device/groups_ab.sh                 (everything under $OUT)
#
# 1. The GPU tests that run the grouped path: the Triton RMSNorm (every forward's norms on
#    CUDA), the GPU fetch's kernel and the engine's tokens with either fetch, 1 or 3 groups,
#    with and without retrieval delays (tests/engine/test_gpu_fetch.py); log pytest_gpu.log.
# 2. The A/B at LLaDA2.0-mini 32K, HERALD `selected` bs 80, sides alternated (SIDES, default
#    "1 2 1"), then dense bs 32 for the ratio (scripts/device/switch_ab.sh); per point the
#    retrieval job's parts (query to host, kernel, the rest) are in its throughput.jsonl.
# 3. With SERVE=1, the server's batch invariance on CUDA in every mode with 2 groups (32
#    concurrent prompts: the grouped path at a served batch); log pytest_serve.log.
# At most 8 files come back: the two logs, switch_ab.txt, and the points' throughput.jsonl.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/models/test_rmsnorm_triton.py \
    tests/engine/test_gpu_fetch.py > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu exit $?"; tail -2 "$OUT/pytest_gpu.log"; grep -E "^FAILED" "$OUT/pytest_gpu.log"
AB_VAR=HERALD_RETRIEVAL_GROUPS SIDES=${SIDES:-1 2 1} POINT_LIMIT=${POINT_LIMIT:-80} \
    bash "$(dirname "$0")/switch_ab.sh"
if [ "${SERVE:-0}" = 1 ]; then
    HERALD_RETRIEVAL_GROUPS=2 LIMIT=${SERVE_LIMIT:-100} bash "$(dirname "$0")/serve_tests.sh" \
        -m gpu tests/server/test_batch_invariance.py
fi
find "$OUT" -type f ! -name "*.log" ! -name "*.jsonl" ! -name "switch_ab.txt" -delete
