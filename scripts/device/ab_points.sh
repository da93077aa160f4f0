#!/usr/bin/env bash
# Two throughput points of results/throughput measured again, for this tree and optionally for
# another revision in the same call (an A/B of a refactor): LLaDA2.0-mini 32K at the 80 GB cap,
# dense bs 32 and HERALD with the `selected` kernel output bs 80, benchmark defaults otherwise.
#
#   scripts/device/ab_points.sh [TREE ...]
#
# TREE: "." (this tree) or a .tgz of another revision's herald/ package, made with
#   git archive REV herald | gzip > old.tgz
# Each TREE's points go to $OUT/points_<i>_<name>/ (throughput.jsonl, README.md); a summary of
# tok/s per tree and point is printed last and written to $OUT/ab_summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
trees=("$@"); [ ${#trees[@]} -eq 0 ] && trees=(.)
i=0
for tree in "${trees[@]}"; do
    i=$((i + 1))
    if [ "$tree" = "." ]; then root=$PWD; name=this
    else root=$(mktemp -d); tar xzf "$tree" -C "$root"; name=$(basename "$tree" .tgz); fi
    dir=$OUT/points_${i}_$name
    # a fresh compile cache per tree: neither pays or skips the other's torch.compile work
    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    for spec in "dense 32" "herald-selected 80"; do
        set -- $spec
        (cd "$root" && PYTHONPATH=$root timeout 400 python3 -m herald.bench.throughput \
            --model llada2-mini --context 32768 --mode "$1" --batches "$2" --gpu-memory-gb 80 \
            --out "$dir") 2>&1 | tail -4
    done
done
python3 "$(dirname "$0")/ab_summary.py" "$OUT" "points_*" | tee "$OUT/ab_summary.txt"
