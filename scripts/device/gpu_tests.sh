#!/usr/bin/env bash
# GPU-marked tests on the device machine; the full log goes to $OUT/pytest_gpu.log.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout "${1:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/server tests > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu exit $?"; grep -E "passed|failed|Error|error" "$OUT/pytest_gpu.log" | tail -12
