#!/usr/bin/env bash
# One environment switch's A/B, its values alternated in one call so that neither side gets the
# machine's fresher state: LLaDA2.0-mini 32K at the 80 GB cap, HERALD with the `selected` kernel
# output at bs 80 (its peak batch), one point per entry of SIDES in that order, each in its own
# process with AB_VAR set to that entry, then dense bs 32 for the ratio. One folder of raw
# records per point under $OUT (<value>_<n>/, n counting the points; dense/); a summary table
# last, also in $OUT/switch_ab.txt.
#
#   AB_VAR=HERALD_FETCH SIDES="cpu gpu cpu gpu" bash scripts/device/switch_ab.sh
#   bash scripts/device/huge_pages_ab.sh          # AB_VAR=HERALD_HUGE_PAGES, SIDES="1 0 1 0"
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
AB_VAR=${AB_VAR:?name the switch, e.g. AB_VAR=HERALD_FETCH}
SIDES=${SIDES:?the values to alternate, e.g. SIDES="cpu gpu cpu gpu"}
point() {  # point DIR MODE BATCH
    timeout "${POINT_LIMIT:-150}" python3 -m herald.bench.throughput --model llada2-mini \
        --context 32768 --mode "$2" --batches "$3" --gpu-memory-gb 80 --out "$1" 2>&1 \
        | grep -E "DRAM read|CPU KV pool|tok/s" | sed 's/^/  /'
}
n=0
for value in $SIDES; do
    n=$((n + 1))
    echo "$AB_VAR=$value, point $n"
    (export "$AB_VAR=$value"; point "$OUT/${value}_$n" herald-selected 80)
done
echo "dense"; point "$OUT/dense" dense 32
python3 - "$OUT" <<'PY' | tee "$OUT/switch_ab.txt"
import glob, json, os, statistics, sys
# Selection bandwidth: K of every prefix row and V of the selected ones, all offloaded layers and
# requests, over the kernel's seconds per block (the retrieval stream's "kernel" part).
print("| point | tok/s | forward ms | main s | retrieval s | stall s | kernel s | kernel GB/s | "
      "DRAM probe GB/s | kernel / probe |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for d in sorted(glob.glob(os.path.join(sys.argv[1], "*", "throughput.jsonl"))):
    recs = [json.loads(x) for x in open(d)]
    probe = next((r["dram"]["torch_sum_all_gbs"] for r in recs if r.get("kind") == "machine"), 0)
    for r in (r for r in recs if r.get("kind") == "point" and r.get("status") == "ok"):
        m = lambda k: statistics.mean(r[k]) if r.get(k) else float("nan")
        parts = r.get("block_retrieval_parts_s") or []
        kern = statistics.mean(p["kernel"] for p in parts) if parts else float("nan")
        g, sk = r.get("kv_geometry") or {}, r.get("selection_kernel") or {}
        row = g.get("num_layers", 0) * g.get("num_kv_heads", 0) * g.get("head_dim", 0) * g.get("itemsize", 0)
        gb = r["batch"] * row * (r["context"] + sk.get("k_rows", 0)) / 1e9
        bw = gb / kern if parts else float("nan")
        name = os.path.basename(os.path.dirname(d))
        print(f"| {name} | {r['decode_tokens_per_s']:.0f} | {1e3 * r['forward_median_s']:.1f} | "
              f"{m('block_main_s'):.2f} | {m('block_retrieval_s'):.2f} | {m('block_stall_s'):.2f} | "
              f"{kern:.3f} | {bw:.1f} | {probe:.1f} | {bw / probe if probe else float('nan'):.2f} |")
PY
