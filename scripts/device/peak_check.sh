#!/usr/bin/env bash
# The start-up memory check on the device machine: its GPU tests, then herald serve started with
# configurations that do and do not fit, each timed from launch to "ready" or to its refusal.
#
#   bash scripts/device/peak_check.sh
#
# Carry .whl (the server's wheels; scripts/device/serve_tests.sh's header says how to fetch them).
# Each configuration is a line of CONFIGS: a name, then herald serve's flags (LLaDA2.0-mini,
# random weights). Defaults: herald at max batch 64, 16K context and a 65,536-token prefill budget
# (it ran out of GPU memory under 32 clients on an 80 GB H100 before the check existed), then the
# same at max batch 32. On a card larger than an H100 80GB, each server gets
# --gpu-memory-utilization for CAP_GIB (default 79.2, an H100 80GB's memory; none where that is
# within 2% of the card) so that the check
# meets the same limit (CAP_GIB=none: the whole card). A server that comes up is stopped with
# SIGINT at once.
# Files back: gpu.txt, pytest_serve.log, peak_<name>.log, peak_check.txt (name, exit, seconds,
# outcome).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
CAP=""
if [ "${CAP_GIB:-79.2}" != none ]; then
    CAP=$(python3 -c "f = ${CAP_GIB:-79.2} * 1024 / $total_mib; print(f'--gpu-memory-utilization {f:.4f}' if f < 0.98 else '')")
fi
echo "cap: ${CAP:-none}" | tee -a "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/server/test_peak_check.py tests/server/test_warmup.py > "$OUT/pytest_serve.log" 2>&1
    echo "gpu tests exit $?"; tail -3 "$OUT/pytest_serve.log"
fi
CONFIGS=${CONFIGS:-"herald64 --mode herald --max-batch-size 64 --max-seq-len 16384 --max-prefill-tokens 65536
herald32 --mode herald --max-batch-size 32 --max-seq-len 16384 --max-prefill-tokens 65536"}
while read -r name flags; do
    [ -n "$name" ] || continue
    log="$OUT/peak_$name.log"; start=$(date +%s.%N)
    # shellcheck disable=SC2086
    timeout "${SERVE_LIMIT:-200}" python3 -m herald serve --model llada2-mini --device cuda \
        --port 0 $flags $CAP > "$log" 2>&1 &
    pid=$!; outcome=timeout
    while kill -0 "$pid" 2> /dev/null; do
        if grep -q "herald serve ready" "$log"; then outcome=ready; kill -INT "$pid"; break; fi
        sleep 0.5
    done
    secs=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
    wait "$pid"; rc=$?
    [ "$outcome" = ready ] || outcome="exited"
    echo "$name exit $rc after $secs s: $outcome" | tee -a "$OUT/peak_check.txt"
    grep -E "memory check|refus|out of memory|ready|Error" "$log" | cut -c1-400 | tail -6
done <<< "$CONFIGS"
