#!/usr/bin/env bash
# The fused MoE's numerics-fixing tiles (block_m, block_k), never measured away from 64 x 64:
# the fused GEMMs' GPU tests, then each GEMM timed alone at LLaDA2.0-mini's shapes over
# block_m 16/32/64 x block_k 64/128/256 (block_n 64/128, 4 warps, 3-4 stages), at the token
# counts of a dense 32K bs 32 forward (1,024), HERALD's bs 80 main stream (2,560) and its fused
# draft step (5,120), and the alignment (sort by expert) per block_m. ~5-7 minutes (an estimate:
# not yet run), mostly compiles.
#
#   bash scripts/device/moe_sweep.sh          (pytest_moe.log, moe.log, moe/moe.jsonl in $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/models/test_moe_triton.py \
    > "$OUT/pytest_moe.log" 2>&1
echo "fused MoE GPU tests exit $?"; tail -2 "$OUT/pytest_moe.log"
timeout "${SWEEP_S:-400}" python3 -m herald.bench.moe --tokens "${TOKENS:-1024,2560,5120}" --sweep \
    --sweep-block-m "${BLOCK_M:-16,32,64}" --sweep-block-k "${BLOCK_K:-64,128,256}" \
    --sweep-block-n 64,128 --sweep-warps 4 --sweep-stages 3,4 --iters 10 --repeats 3 \
    --out "$OUT/moe" > "$OUT/moe.log" 2>&1
echo "sweep exit $?"; grep -E "^T |both GEMMs|alignment|best (gate_up|down):" "$OUT/moe.log"
