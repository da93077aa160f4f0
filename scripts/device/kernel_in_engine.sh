#!/usr/bin/env bash
# The CPU selection kernel alone and inside the HERALD engine on the same host, in one call: is
# the in-engine rate below the kernel's own (contention with the engine's other CPU work), or is
# the kernel itself below the host's DRAM probe (its per-core work)?
#
#   bash scripts/device/kernel_in_engine.sh            (~6-7 minutes; everything under $OUT)
#
# 1. `herald bench kernel` at LLaDA2.0-mini's shape, S = 32K, one representative query (n_q 1),
#    selected and full outputs, no naive baseline, at THREADS_ALONE selection threads (default
#    "16 14"); each writes kernel_t<N>/ (kernel.json with the DRAM probes, README.md).
# 2. `herald.bench.profile_offload` at 32K, batch BATCH (80), 5%, selected output, 3 blocks, at
#    THREADS_ENGINE ("14,16"): per block main / retrieval / stall and the retrieval job's
#    per-layer (query wait, kernel, after) seconds; the log is engine.log.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; free -g | head -2
  grep -m1 "model name" /proc/cpuinfo; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
for t in ${THREADS_ALONE:-16 14}; do
    HERALD_SELECTION_THREADS=$t timeout 150 python3 -m herald.bench.kernel --seq-lens 32768 \
        --n-q 1 --skip-naive --k-gib 2 --out "$OUT/kernel_t$t" > "$OUT/kernel_t$t.log" 2>&1
    echo "== kernel alone, $t threads: exit $?"
    grep -E "^\| (torch_sum|native_probe|selected|full) " "$OUT/kernel_t$t/README.md" | head -8
done
timeout 300 python3 -m herald.bench.profile_offload --no-profile --blocks 3 --batch "${BATCH:-80}" \
    --output-mode selected --threads "${THREADS_ENGINE:-14,16}" --out "$OUT/engine" \
    > "$OUT/engine.log" 2>&1
echo "== in engine: exit $?"
grep -E "^\[threads|main " "$OUT/engine.log" | cut -c1-200
