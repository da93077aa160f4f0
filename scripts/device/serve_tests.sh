#!/usr/bin/env bash
# The server's tests on the device machine, which has no package index: the wheels carried in
# .whl/ (fastapi, starlette, pydantic, pydantic-core, uvicorn and what they need beyond the
# machine's image; for scripts/device/serve_bench.sh also the openai client, which talks HTTP
# through httpx2 and httpcore2, and their truststore, jiter, and anyio, idna and h11 newer than the
# image's may be) are installed under /tmp/site first. Fetch them here, once, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl fastapi starlette pydantic \
#     pydantic-core uvicorn annotated-types typing-inspection 'typing-extensions>=4.16' sniffio \
#     annotated-doc opentelemetry-api importlib-metadata lazy-importer \
#     openai==3.57.0 httpx2 httpcore2 truststore jiter anyio idna h11
# and name .whl in the run's carry. Runs the GPU-marked server tests (batch invariance in every
# mode on CUDA) unless told otherwise:
#   bash scripts/device/serve_tests.sh [pytest args...]     # default: -m gpu tests/server
# The log goes to $OUT/pytest_serve.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ $# -gt 0 ] || set -- -m gpu tests/server
timeout "${LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/pytest_serve.log" 2>&1
echo "pytest $* exit $?"; grep -E "passed|failed|Error|differ" "$OUT/pytest_serve.log" | tail -12
