#!/usr/bin/env bash
# Rebuild the shipped demo drafter (dflash_core/demo/gemma-3-270m-dflash) for Gemma 3 270M: these
# defaults are the exact settings it was trained with (on one H200; docs/train.md has the results).
# Uses the demo target that dflash installs. WORK holds the regenerated data and checkpoints;
# TARGET_DIR overrides the converted demo target (or convert the
# GGUF with dflash_core.gguf.convert_gguf); arguments after the script override the flags below.
#
# On a CPU, the cheaper settings of the first (CPU-trained) demo drafter take about 1.5 hours on 2
# cores: STEPS=600 LOSS_VOCAB=data MAX_NEW_TOKENS=48 scripts/train_demo_drafter.sh --layers 1 --eval-every 100
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/dflash-demo-train}"
STEPS="${STEPS:-4000}"
LOSS_VOCAB="${LOSS_VOCAB:-full}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-256}"
TARGET_DIR="${TARGET_DIR:-$(python3 -c 'from dflash_core.demo import demo_target_dir; print(demo_target_dir())')}"
dflash train --target "$TARGET_DIR" --data dflash_core/demo/prompts.txt --out "$WORK" --no-chat \
  --layers 2 --heads 4 --kv-heads 1 --head-dim 128 --intermediate-size 1024 \
  --max-new-tokens "$MAX_NEW_TOKENS" --steps "$STEPS" --batch 4 --anchors 6 --lr 1e-3 --warmup 30 \
  --eval-every 500 --save-every 250 --loss-vocab "$LOSS_VOCAB" --save-dtype bfloat16 --seed 0 "$@"
mkdir -p dflash_core/demo/gemma-3-270m-dflash
cp "$WORK/config.json" "$WORK/model.safetensors" "$WORK/train_report.json" dflash_core/demo/gemma-3-270m-dflash/
