#!/usr/bin/env bash
# On the device machine: decode throughput vs batch with measured ceilings
# (python -m herald.bench.throughput). Every point is appended to $OUT/throughput/throughput.jsonl
# as soon as it is measured; points already in results/throughput/*.jsonl are skipped (resume).
#
#   scripts/device/throughput.sh smoke              # harness check, ~3 min: LLaDA2.0-mini 16K,
#                                                   # dense + HERALD, 2 batches each, 1 timed block
#   scripts/device/throughput.sh part I N [ARGS]    # part I of N of the full plan (N = 8)
#   scripts/device/throughput.sh resume [ARGS]      # whatever is still pending, until LIMIT
#   scripts/device/throughput.sh all [ARGS]         # every part in sequence (no time limit)
#   scripts/device/throughput.sh report             # README.md from the JSONL (plots need matplotlib)
#
# ARGS go to the benchmark, e.g. --models sdar-8b-chat, --offload-cuda-graph, --dry-run.
# The device machine returns at most 8 files from $OUT, so the results folder comes back as ONE
# archive, $OUT/throughput.tgz (the folder is removed after packing; a call that lost its
# throughput.jsonl to that limit lost its points). After each call: tar xzf throughput.tgz -C /tmp,
# copy /tmp/throughput/throughput.jsonl over results/throughput/throughput.jsonl (it holds the
# earlier points plus the new ones), append the new lines of its throughput.log to the committed
# one, and rebuild README.md and the plots:
#   python -m herald.bench.throughput --report results/throughput
# RESULTS: the committed folder whose points count as done (default results/throughput). A run
# on another host shape that must not mix with it gets its own, e.g. LLaDA2.0-mini with the
# two-GPU machine's 256 GiB of DRAM (the CPU pool bounds HERALD's batch on the one-GPU machine):
#   RESULTS=results/throughput_256g CUDA_VISIBLE_DEVICES=0 scripts/device/throughput.sh resume \
#       --models llada2-mini --contexts 32768 --modes herald-selected,herald,dense
# LIMIT: seconds after which a call starts no new point (default 480, so a call ends < 10 min).
# SDAR-8B at 32K needs more DRAM than 125 GiB for large batches: on the two-GPU machine
# (256 GiB) run `CUDA_VISIBLE_DEVICES=0 scripts/device/throughput.sh resume --models sdar-8b-chat`.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
LIMIT=${LIMIT:-480}
RES=$OUT/throughput
mkdir -p "$RES"
cp "${RESULTS:-results/throughput}"/*.jsonl "$RES/" 2>/dev/null || true
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; free -g; nproc;
  lscpu | grep -E "^(Model name|Socket|NUMA|Thread|Core)"; } \
    > "$RES/machine_$(date -u +%Y%m%dT%H%M%SZ).txt" 2>&1
bench() {  # the hard stop stays under the device's 10-minute limit per command
    timeout $((${1} + 90)) python3 -m herald.bench.throughput --time-limit-s "$1" "${@:2}" \
        2>&1 | tee -a "$RES/throughput.log"
}
mode=${1:-resume}
shift || true
case "$mode" in
    smoke)
        bench "$LIMIT" --plan smoke --timed-blocks 1 --out "$OUT/throughput_smoke" "$@"
        ;;
    part)
        i=$1 n=$2
        shift 2
        bench "$LIMIT" --plan all --part "$i/$n" --out "$RES" "$@"
        ;;
    resume)
        bench "$LIMIT" --plan all --out "$RES" "$@"
        ;;
    all)
        for i in 1 2 3 4 5 6 7 8; do
            bench 100000 --plan all --part "$i/8" --out "$RES" "$@"
        done
        ;;
    report)
        python3 -m herald.bench.throughput --report "$RES"
        ;;
    *)
        echo "usage: $0 smoke | part I N | resume | all | report [ARGS]" >&2
        exit 2
        ;;
esac
rc=$?
tar czf "$OUT/throughput.tgz" -C "$(dirname "$RES")" "$(basename "$RES")" && rm -rf "$RES"
[ -d "$OUT/throughput_smoke" ] && tar czf "$OUT/throughput_smoke.tgz" -C "$OUT" throughput_smoke \
    && rm -rf "$OUT/throughput_smoke"
echo "exit $rc; results packed in $OUT/throughput.tgz (see the header for merging them)"
exit $rc
