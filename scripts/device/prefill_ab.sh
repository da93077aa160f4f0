#!/usr/bin/env bash
# Prefill attention on the device machine, in one call (at most ~9.5 minutes):
#   1. the block-attention kernel's GPU tests (the prefill kernel's bits against the general
#      kernel, the HERALD_PREFILL_ATTENTION switch);
#   2. scripts/diagnostics/prefill_attention_bench.py: one layer's attention over 4K/16K/32K
#      prompts in 4,096-token chunks, LLaDA2.0-mini and SDAR-8B-Chat heads, the SDPA path
#      against the Triton prefill kernel over a sweep of its tiles;
#   3. the engines' real prefill (python -m herald.bench.prefill), LLaDA2.0-mini dense and herald
#      at 4K/16K/32K x 4 prompts, HERALD_PREFILL_ATTENTION sdpa then triton in one
#      process (a ratio only means something within one call: hosts differ).
# Files back: gpu.txt, pytest_block_kernel.log, prefill_attention.json, prefill_attention.log,
# prefill.jsonl (each record names its prefill_attention), prefill_ab.log.
# The working tree that travels is capped at 64 MiB: move results/ and checkpoints/ out first.
# Env: SKIP_TESTS=1 skips step 1; QUICK=1 times only the default tile in step 2; SIDES (the
# order of step 3's sides, "sdpa,triton"); CHUNKS (step 3's prompt tokens per prefill forward,
# a list: "4096"; with Triton a chunk length costs no compilation, so e.g. SIDES=triton
# CHUNKS=4096,16384 asks whether longer chunks prefill faster).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse --short HEAD 2>/dev/null; free -g | head -2; nproc; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kv/test_block_kernel.py \
    > "$OUT/pytest_block_kernel.log" 2>&1
  echo "block kernel GPU tests exit $?"; tail -3 "$OUT/pytest_block_kernel.log"
fi
quick=(); [ "${QUICK:-0}" = "1" ] && quick=(--quick)
timeout 160 python3 scripts/diagnostics/prefill_attention_bench.py "${quick[@]}" \
  --out "$OUT/prefill_attention.json" 2>&1 | tee "$OUT/prefill_attention.log" | grep -E "best|sdpa|r64 n64 w4 s3"
echo "prefill attention bench exit ${PIPESTATUS[0]}"
timeout 300 python3 -m herald.bench.prefill --model llada2-mini --modes dense,herald \
  --prompts 4096,16384,32768 --requests 4 --prefill-attention "${SIDES:-sdpa,triton}" \
  --chunk-tokens "${CHUNKS:-4096}" \
  --out "$OUT" 2>&1 | grep -v "^USDT" | tee "$OUT/prefill_ab.log" | grep -E "tok/s|Error"
echo "bench prefill exit ${PIPESTATUS[0]}"
