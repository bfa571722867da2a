#!/usr/bin/env bash
# Rebuild the shipped demo drafter (dflash_core/demo/gemma-3-270m-dflash) for Gemma 3 270M with
# the settings it was trained with (on one H200, 2026-12-03, run 7; docs/train.md has the results):
# 1024 prompts of each category of `dflash corpus` (the Python standard library and the bundled
# prompt sets), the target's greedy responses, then 2507 steps (the H200 run was cut there by
# `--minutes 6`). Uses the demo target that dflash installs. WORK holds the prompts, the
# regenerated data and the checkpoints; TARGET_DIR overrides the converted demo target (or
# convert the GGUF with dflash_core.gguf.convert_gguf); arguments after the script override the
# flags below.
#
# A CPU regenerates the responses at a few dozen tokens/s: more than a day for these 518 K tokens on
# 2 cores. PER_CATEGORY=100 STEPS=600 LOSS_VOCAB=data scripts/train_demo_drafter.sh is a smaller
# run of the same recipe (hours).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/dflash-demo-train}"
STEPS="${STEPS:-2507}"
PER_CATEGORY="${PER_CATEGORY:-1024}"
LOSS_VOCAB="${LOSS_VOCAB:-full}"
TARGET_DIR="${TARGET_DIR:-$(python3 -c 'from dflash_core.demo import demo_target_dir; print(demo_target_dir())')}"
mkdir -p "$WORK"
dflash corpus --out "$WORK/prompts.jsonl" --per-category "$PER_CATEGORY"
dflash train --target "$TARGET_DIR" --data "$WORK/prompts.jsonl" --out "$WORK" --no-chat \
  --layers 3 --heads 4 --kv-heads 1 --head-dim 128 --intermediate-size 1536 \
  --max-new-tokens 128 --max-prompt-tokens 256 --generation-batch 256 --shard-prompts 1024 \
  --steps "$STEPS" --batch 32 --anchors 8 --lr 1e-3 --warmup 200 --eval-every 2000 --save-every 1000 \
  --tap-cache-gb 40 --loss-vocab "$LOSS_VOCAB" --save-dtype bfloat16 --seed 0 "$@"
mkdir -p dflash_core/demo/gemma-3-270m-dflash
cp "$WORK/config.json" "$WORK/model.safetensors" "$WORK/train_report.json" dflash_core/demo/gemma-3-270m-dflash/
