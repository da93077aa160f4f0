#!/usr/bin/env bash
# herald bench serve --url against a `herald serve` started here by hand (the server alone in
# its process, the clients in another), LLaDA2.0-mini with random weights, on the device machine:
# how the child-process default of herald bench serve (serve_bench.sh) was first checked against
# the in-process server, whose engine thread shared one interpreter lock with 32 streaming
# clients. It also serves a server whose flags herald bench serve does not set.
#
#   MODE=herald CONC="32" bash scripts/device/serve_external.sh
#
# Carry .whl (see serve_bench.sh's header); move checkpoints/ and results/ out of the tree.
# Env: MODEL (llada2-mini), DEVICE (cuda), MODE (herald), PROMPT (16256), CONC ("32"), MAX_TOKENS (128), STEPS (20), DURATION (60),
# PREFILL (65536), BATCH (the largest CONC), PORT (8123), LIMIT (300 s for the benchmark).
# NO_WHEELS=1 skips the wheels (a machine that has the server's packages).
# Files back: server.log, serve_bench.jsonl, README.md, serve_bench.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${NO_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
PROMPT=${PROMPT:-16256} MAX_TOKENS=${MAX_TOKENS:-128} PORT=${PORT:-8123} CONC=${CONC:-32}
BATCH=${BATCH:-$(echo $CONC | tr ' ' '\n' | sort -n | tail -1)}
python3 -m herald serve --model "${MODEL:-llada2-mini}" --device "${DEVICE:-cuda}" --mode "${MODE:-herald}" \
    --max-batch-size "$BATCH" --max-seq-len $((PROMPT + MAX_TOKENS)) \
    --max-prefill-tokens "${PREFILL:-65536}" --max-waiting $((2 * BATCH)) --port "$PORT" \
    > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
python3 - "$PORT" <<'PY' || { echo "the server did not get ready"; tail -20 "$OUT/server.log"; exit 1; }
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(240):
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:  # it listens once warm
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(1)
PY
grep -v "^USDT" "$OUT/server.log" | tail -5
timeout "${LIMIT:-300}" python3 -m herald.bench.serve --url "http://127.0.0.1:$PORT" \
    --model "${MODEL:-llada2-mini}" --prompt-tokens "$PROMPT" --concurrency $CONC \
    --max-tokens "$MAX_TOKENS" --steps "${STEPS:-20}" --duration-limit-s "${DURATION:-60}" \
    --warmup-requests 1 --out "$OUT" 2>&1 | grep -v "^USDT" | tee -a "$OUT/serve_bench.log"
exit "${PIPESTATUS[0]}"
