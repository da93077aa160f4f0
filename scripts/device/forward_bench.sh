#!/usr/bin/env bash
# herald bench forward on the device machine (one H200): the decode forward's time, kernel
# breakdown and floor at the acceptance points, and prefill tokens/s, one part per call, each
# part under the 10-minute command limit.
#
#   scripts/device/forward_bench.sh smoke          # ~3 min harness check: LLaDA2.0-mini 2K bs 8,
#                                                  # dense + HERALD, 5 reps, 4K prefill
#   scripts/device/forward_bench.sh llada          # LLaDA2.0-mini: dense 32K bs 32, dense 2K bs 80,
#                                                  # HERALD 32K bs 80 (main stream + draft step)
#   scripts/device/forward_bench.sh llada-prefill  # LLaDA2.0-mini prefill, 4K/16K/32K x 4 prompts
#   scripts/device/forward_bench.sh sdar           # SDAR-8B-Chat: dense 32K bs 12, HERALD 32K bs 24
#   scripts/device/forward_bench.sh sdar-prefill   # SDAR-8B-Chat prefill, 4K/16K/32K x 4 prompts
#
# Records: the committed results/forward/forward.jsonl is copied to $OUT/forward.jsonl first and
# each part appends to it, so $OUT/forward.jsonl always holds every point so far; copy it over
# results/forward/forward.jsonl after each call (the next call starts from the committed copy
# again), and append $OUT/forward.log to results/forward/forward.log. $OUT/forward.md and the two
# plots are rebuilt by every part (locally: python -m herald.bench.forward_report results/forward).
# Files back: gpu.txt, forward.jsonl, forward.log, forward.md, forward_vs_floor.png,
# forward_breakdown.png (6 of the 8 allowed). The working tree that travels is capped at 64 MiB:
# move results/ and checkpoints/ out of the tree before the call except results/forward/.
#
# HERALD's points need the CPU KV pool in host memory: LLaDA2.0-mini 32K bs 80 ~96 GiB, SDAR-8B
# 32K bs 24 ~109 GiB (pool + pinned staging; the benchmark refuses a point that does not fit the
# host's available memory before allocating anything, and says by how much). The dense and HERALD
# engines of SDAR run as two commands, so that a refused HERALD point leaves the dense one measured.
# Env: REPS (20), EXTRA (more flags, e.g. "--no-profile"), HERALD_TRITON (the kernels' switch,
# default auto as served).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  free -g | head -2; nproc; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
[ -f "$OUT/forward.jsonl" ] || cp results/forward/forward.jsonl "$OUT/" 2>/dev/null || true
bench() {  # one benchmark command, its output kept in forward.log
    timeout "${LIMIT:-540}" python3 -m herald.bench.forward --out "$OUT" --reps "${REPS:-20}" \
        ${EXTRA:-} "$@" 2>&1 | grep -v "^USDT" | tee -a "$OUT/forward.log"
    echo "exit ${PIPESTATUS[0]}"
}
part=${1:-smoke}
case "$part" in
    smoke)
        bench --models llada2-mini --contexts 2K --batches 8 --modes dense,herald,herald-draft \
            --reps 5 --prefill-prompts 4K --prefill-requests 2
        ;;
    llada)
        bench --models llada2-mini --prefill-prompts none
        ;;
    llada-prefill)
        bench --models llada2-mini --modes dense,herald --prefill-only --prefill-prompts 4K,16K,32K
        ;;
    sdar)
        LIMIT=240 bench --models sdar-8b-chat --modes dense --prefill-prompts none
        LIMIT=330 bench --models sdar-8b-chat --modes herald,herald-draft --prefill-prompts none
        ;;
    sdar-prefill)
        bench --models sdar-8b-chat --modes dense,herald --prefill-only --prefill-prompts 4K,16K,32K
        ;;
    *)
        echo "unknown part $part: smoke | llada | llada-prefill | sdar | sdar-prefill" >&2
        exit 2
        ;;
esac
