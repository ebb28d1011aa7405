#!/bin/bash
# Issue 11, the recipe A/Bs run from scratch (BENCHMARKS.md, "The recipe A/B on ..."): two drafts trained at equal
# compute on the same seeded 1,324 corpus records, 300 steps each, everything equal but the options given for each
# arm; each arm's offline features are built first (arms reading the same layers share one store), then the two arms
# train side by side on one thread each.
#
#   bash scripts/recipe_ab.sh NAME "ARM_A OPTIONS" "ARM_B OPTIONS"
#   bash scripts/recipe_ab.sh ab-init "--init-from-target" "--no-init-from-target"
#   bash scripts/recipe_ab.sh ab-layers "--feature-layers 1,8,14,20,27" "--feature-layers 1,14,27,29"
#
# Results: NAME/a/training.json and NAME/b/training.json (held-out tau and accuracy), logs NAME-a.log, NAME-b.log.
set -euo pipefail
NAME=$1 ARM_A=$2 ARM_B=$3
WORK=${WORK:-$HOME/.cache/flashdraft/train/recipe-ab}
# The A/Bs' draw was from the corpus at 11,205 records; CORPUS=folder of commit a10483a's corpus/ redraws it exactly.
python "$(dirname "$0")/corpus.py" train-folder "$WORK" --records 1324 ${CORPUS:+--corpus "$CORPUS"}
COMMON="--target smollm2-135m-instruct --work-dir $WORK --draft-layers 2 --block-size 8
    --draft-vocab-size 8192 --compute-dtype bfloat16 --num-prompts 20000 --labels regenerate --max-new-tokens 512
    --label-minutes 0 --features offline --feature-dtype float16 --num-anchors 128 --loss-weights acceptance --lr 6e-4
    --warmup-ratio 0.02 --batch-size 1 --grad-accum 4 --eval-sets heldout --eval-prompts 16 --eval-max-new-tokens 128
    --heldout 24 --seed 0"
for ARM in "$ARM_A" "$ARM_B"; do
    # shellcheck disable=SC2086  # the options are meant to split into words
    flashdraft train $COMMON $ARM --output "$NAME/features" --threads 2 --until features
done
STEPS="--threads 1 --max-steps 300 --checkpoint-every 50 --eval-every 150"
# shellcheck disable=SC2086
flashdraft train $COMMON $STEPS $ARM_A --output "$NAME/a" --run-name "$NAME-a" > "$NAME-a.log" 2>&1 &
# shellcheck disable=SC2086
flashdraft train $COMMON $STEPS $ARM_B --output "$NAME/b" --run-name "$NAME-b" > "$NAME-b.log" 2>&1 &
wait
