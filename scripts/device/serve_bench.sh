#!/usr/bin/env bash
# herald bench serve on the device machine (one H200): end-to-end load on a real herald serve over
# loopback through the openai client, dense then herald, LLaDA2.0-mini with random weights. The
# server runs as a child process (herald bench serve's default; its output in OUT/server.log).
#
#   bash scripts/device/serve_bench.sh                  # dense, then --mode herald
#   MODES=dense bash scripts/device/serve_bench.sh      # one mode
#
# The machine has no package index: the wheels carried in .whl/ are installed under /tmp/site
# first (the server's, and the openai client's: openai, httpx2, httpcore2, truststore, jiter,
# anyio, idna, h11; fetched here by the command in scripts/device/serve_tests.sh's header). Name
# .whl in the run's carry. The working tree that travels is capped at 64 MiB: move checkpoints/
# and results/ out of the tree before the call (llada2-mini is a preset: nothing is loaded from
# checkpoints/).
#
# Defaults: --prompt-tokens 16256 (LLaDA2.0-mini's config says max_position_embeddings 16384 and
# herald serve caps a request at it: 16256 prompt tokens + 128 generated fill that context; a
# 16384-token prompt is refused before anything starts; HERALD_ALLOW_LONG_CONTEXT=1 in the env
# lifts the cap, e.g. PROMPT=32640), concurrency 1 8 32 (twice as many requests per level),
# max_tokens 128 (4 blocks), steps 20, a 45 s limit per level, one warm-up request, and herald
# bench throughput's point beside each level (--throughput-point, measured after the levels on
# the same model). The prefill budget is 65536 tokens per decode forward (herald serve's
# default, 4096, gives the dense engine one 4096-token piece per forward: at concurrency 32
# requests then finish faster than new ones are prefilled; the offloading modes scale it by a
# block's forwards).
#
# Expected time: ~10 s for the wheels, then per mode ~30 s to start (imports, model, engine and,
# with herald, the pinned CPU pool), at most 3 x 45 s of levels (less when every request of a
# level completes sooner), ~30-60 s of throughput points; each mode is also cut off by timeout at
# LIMIT seconds (default 250), so the whole call stays under ~8.5 minutes. The records are
# appended and the README rebuilt after every level, so a mode cut off keeps its finished levels.
# Files back: gpu.txt, serve_bench.jsonl, README.md, serve_bench.log, server.log. Keep them by appending
# serve_bench.jsonl to results/serve_bench/serve_bench.jsonl and rebuilding its README here:
# python -m herald.bench.serve_report results/serve_bench.
# Env: MODEL (llada2-mini; sdar-8b-chat is the other preset), MODES ("dense herald"),
# PROMPT (16256), CONC ("1 8 32"), MAX_TOKENS (128), STEPS (20),
# DURATION (45), PREFILL (65536), LIMIT (250), EXTRA (more flags, e.g. "--requests 16").
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  python3 -c "import torch, openai; print('torch', torch.__version__, 'openai', openai.__version__)"
  free -g | head -2; nproc; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
rc=0
for mode in ${MODES:-dense herald}; do
    timeout "${LIMIT:-250}" python3 -m herald.bench.serve --model "${MODEL:-llada2-mini}" --device cuda \
        --mode "$mode" --prompt-tokens "${PROMPT:-16256}" --concurrency ${CONC:-1 8 32} \
        --max-tokens "${MAX_TOKENS:-128}" --steps "${STEPS:-20}" \
        --duration-limit-s "${DURATION:-45}" --max-prefill-tokens "${PREFILL:-65536}" \
        --warmup-requests 1 --throughput-point ${EXTRA:-} --out "$OUT" 2>&1 \
        | grep -v "^USDT" | tee -a "$OUT/serve_bench.log"
    status=${PIPESTATUS[0]}
    echo "$mode: exit $status"
    [ "$status" -eq 0 ] || rc=$status
done
exit $rc
