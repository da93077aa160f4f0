#!/usr/bin/env bash
# The CPU selection kernel alone and inside the HERALD engine on the same host, in one call: is
# the in-engine rate below the kernel's own (contention with the engine's other CPU work), or is
# the kernel itself below the host's DRAM probe (its per-core work)? At most 8 files come back
# from the device: host.txt, kernel_t16/{kernel.json,README.md}, kernel_t8/README.md,
# engine_<pf>.log and engine_<pf>/profile_offload.json.
#
#   bash scripts/device/kernel_in_engine.sh            (at most 9 minutes; everything under $OUT)
#
# 1. `herald bench kernel` at LLaDA2.0-mini's shape, S = 32K, one representative query (n_q 1),
#    selected and full outputs, no naive baseline, at THREADS_ALONE selection threads (default
#    "16 8": does the kernel scale with cores, or is 8 already at the 16-thread rate?); each
#    writes kernel_t<N>/ (kernel.json with the DRAM probes, the prefetch sweep and the ISA
#    variants, README.md).
# 2. `herald.bench.profile_offload` at 32K, batch BATCH (80), 5%, selected output, 3 blocks, once
#    per HERALD_SELECTION_PREFETCH value in PREFETCHES (default "t0:1 t1:1"; t0:1 is the
#    default): per block main / retrieval / stall and the retrieval job's per-layer (query wait,
#    kernel, after) seconds; the logs are engine_<value>.log.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; free -g | head -2
  lscpu | grep -E "^(Model name|Thread|Core|Socket|NUMA node\(s\)|CPU max MHz|L2|L3)"; } \
  > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
first=1
for t in ${THREADS_ALONE:-16 8}; do
    HERALD_SELECTION_THREADS=$t timeout 120 python3 -m herald.bench.kernel --seq-lens 32768 \
        --n-q 1 --skip-naive --k-gib 2 --out "$OUT/kernel_t$t" > "$OUT/kernel_t$t.log" 2>&1
    echo "== kernel alone, $t threads: exit $?"
    grep -E "^\| (torch_sum|native_probe|selected|full) " "$OUT/kernel_t$t/README.md" | head -8
    sed -n '/^## Extras/,/^## Correctness/p' "$OUT/kernel_t$t/README.md" | grep "^|"
    tail -3 "$OUT/kernel_t$t.log"; rm -f "$OUT/kernel_t$t.log" "$OUT/kernel_t$t"/*.png
    [ $first = 1 ] || rm -f "$OUT/kernel_t$t/kernel.json"  # (8 files back at most)
    first=0
done
for pf in ${PREFETCHES:-t0:1 t1:1}; do
    tag=${pf/:/}
    HERALD_SELECTION_PREFETCH=$pf timeout 150 python3 -m herald.bench.profile_offload --no-profile \
        --blocks 3 --batch "${BATCH:-80}" --output-mode selected --out "$OUT/engine_$tag" \
        > "$OUT/engine_$tag.log" 2>&1
    echo "== in engine, prefetch $pf: exit $?"
    grep -E "^\[threads|main " "$OUT/engine_$tag.log" | cut -c1-220
done
