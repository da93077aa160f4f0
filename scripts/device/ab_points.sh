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
python3 - "$OUT" <<'PY' | tee "$OUT/ab_summary.txt"
import json, pathlib, sys
for d in sorted(pathlib.Path(sys.argv[1]).glob("points_*")):
    for line in (d / "throughput.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "point":
            print(f"{d.name:28s} {r['variant']:16s} bs {r['batch']:3d} {r['status']:6s} "
                  f"{r.get('decode_tokens_per_s', 0):8.1f} tok/s  fwd "
                  f"{1e3 * (r.get('forward_median_s') or 0):6.2f} ms  {r['time_utc']}")
PY
