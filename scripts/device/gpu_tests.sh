#!/usr/bin/env bash
# GPU-marked tests on the device machine (the server's: scripts/device/serve_tests.sh); the full log
# goes to $OUT/pytest_gpu.log. Argument: the time limit in seconds (400; the 23 tests took ~200 s).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout "${1:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/server tests > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu exit $?"; grep -E "passed|failed|Error|error" "$OUT/pytest_gpu.log" | tail -12
