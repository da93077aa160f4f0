#!/usr/bin/env bash
# The GPU forward's Triton kernels on the device machine: their GPU tests, the MoE block
# benchmark (grouped-GEMM vs fused, optional tile sweep), and the engine's GPU tests.
#
#   scripts/device/forward_kernels.sh [--sweep]
#
# Logs go to $OUT: pytest_kernels.log, pytest_gpu.log, moe.log, moe/moe.jsonl.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
    tests/models/test_moe_triton.py tests/kv/test_block_kernel.py tests/models/test_moe.py \
    > "$OUT/pytest_kernels.log" 2>&1
echo "kernel tests exit $?"; tail -15 "$OUT/pytest_kernels.log"
timeout 200 python3 -m herald.bench.moe --tokens 32,1024,2560,4096 "$@" --out "$OUT/moe" 2>&1 | tee "$OUT/moe.log" | grep -v "^  best" | tail -8
grep "^  best" "$OUT/moe.log" | head -12
timeout "${GPU_TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/server \
    --deselect tests/models/test_moe_triton.py --deselect tests/kv/test_block_kernel.py tests \
    > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu exit $?"; grep -E "passed|failed|Error" "$OUT/pytest_gpu.log" | tail -12
