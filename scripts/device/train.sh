#!/usr/bin/env bash
# Train the small SDAR code model on the GPU machine: one call, at most ~9 minutes wall
# (corpus scan, BPE training, tokenization, compile and training all inside MAX_MINUTES, then a
# short sample decode on the CPU).
#
#   bash scripts/device/train.sh                                  # fresh run
#   RESUME=checkpoints/code-sdar/ckpt bash scripts/device/train.sh  # continue a copied run
#
# Writes under $OUT/train/ (8 files, each < 16 MiB, so all of them come back):
#   ckpt/               config.json, model-0000{1,2}-of-00002.safetensors (bf16, ~29.5 MB in all),
#                       model.safetensors.index.json, tokenizer.json, tokenizer_config.json
#   train_state.json    resume state (global step, tokens, data position, run history)
#   train_log.json      data manifest + digest, config, per-interval progress, final/val loss
# To continue: copy $OUT/train/ into the repo (e.g. checkpoints/code-sdar/) and pass
# RESUME=checkpoints/code-sdar/ckpt; its train_state.json (beside ckpt/) is found automatically.
# A resumed run keeps the tokenizer and the data order, re-warms fresh AdamW moments (they are
# too big to bring back) and may change SEQ_LEN (e.g. SEQ_LEN=16384 BATCH=2 for 16K contexts).
# A twice larger model under the same 30 MB budget: int8 storage with per-row scales
# (herald.models.quant; 28.7M parameters, 28.9 MB of tensors + 0.5 MB tokenizer), a fresh run of
#   EXTRA="--storage int8 --hidden-size 512 --num-heads 8 --num-layers 9 --intermediate-size 1344" bash scripts/device/train.sh
# (two ~15 MB shards; a resumed run keeps the checkpoint's storage; `--shape large` is that shape).
# RULER-style task sequences mixed in (haystacks from the training corpus, never the stdlib),
# continuing the bundled model at 16K, then at 32K (README, "Retraining the embedded model"):
#   RESUME=checkpoints/code-sdar/ckpt SEQ_LEN=16384 BATCH=2 EXTRA="--task-mix 0.5" bash scripts/device/train.sh
#   RESUME=checkpoints/code-sdar-ruler/ckpt SEQ_LEN=32768 BATCH=1 EXTRA="--task-mix 0.5" bash scripts/device/train.sh
#
# Env: RESUME, MAX_MINUTES (7.8), SEQ_LEN (8192), BATCH (4), LR (1e-3), WARMUP (100), SEED (0),
#      LOG_EVERY (50 steps per progress line),
#      SAMPLE (1: decode a stdlib prompt at the end), GPU_TESTS (0: 1 runs tests/train -m gpu
#      first, ~30-60 s more: lower MAX_MINUTES), EXTRA (more `herald train` flags).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DEST=$OUT/train
mkdir -p "$DEST"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c 'import sys, torch, tokenizers; print("python", sys.version.split()[0], "torch",
torch.__version__, "tokenizers", tokenizers.__version__, "cpus", __import__("os").cpu_count())'

if [ "${GPU_TESTS:-0}" = "1" ]; then
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/train 2>&1 | tail -3
fi

args=(--out "$DEST/ckpt" --work-dir /tmp/herald-train --seed "${SEED:-0}"
      --seq-len "${SEQ_LEN:-8192}" --batch-size "${BATCH:-4}" --lr "${LR:-1e-3}"
      --warmup-steps "${WARMUP:-100}" --max-minutes "${MAX_MINUTES:-7.8}"
      --log-every "${LOG_EVERY:-50}")
if [ -n "${RESUME:-}" ]; then
  args+=(--resume "$RESUME")
fi
# shellcheck disable=SC2206
args+=(${EXTRA:-})
echo "herald train ${args[*]}"
python3 -m herald train "${args[@]}"
rc=$?
echo "herald train exit $rc"
ls -l "$DEST" "$DEST/ckpt" 2>/dev/null
[ $rc -eq 0 ] || exit $rc

if [ "${SAMPLE:-1}" = "1" ]; then
  # A held-out stdlib file's head as the prompt, formatted like the training documents.
  prompt=/tmp/herald-train/sample_prompt.txt
  python3 - "$prompt" <<'EOF'
import sys, sysconfig
from pathlib import Path
from herald.train.corpus import format_document
src = Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"
text = "\n".join(src.read_text().split("\n")[:60]) + "\n"
Path(sys.argv[1]).write_text(format_document("json/decoder.py", text))
EOF
  HERALD_COMPILE=0 timeout 40 python3 -m herald generate --model "$DEST/ckpt" \
    --prompt-file "$prompt" --max-new-tokens 96 --device cpu --quiet 2>&1 | tail -20
fi
exit 0
