#!/bin/bash
# Issue 11, recipe A/B on the draft's initialisation (BENCHMARKS.md, "The recipe A/B on the draft's initialisation"):
# a draft from scratch with its layers copied from the target's last layers against random layers, 300 steps each on
# the same seeded 1,324 corpus records, offline features built once, then both arms side by side on one thread each.
set -euo pipefail
WORK=${WORK:-$HOME/.cache/flashdraft/train/ab-init}
OUT=${OUT:-ab-init}
# The A/B's draw was from the corpus at 11,205 records; CORPUS=folder of commit a10483a's corpus/ redraws it exactly.
python "$(dirname "$0")/corpus.py" train-folder "$WORK" --records 1324 ${CORPUS:+--corpus "$CORPUS"}
COMMON="--target smollm2-135m-instruct --work-dir $WORK --draft-layers 2 --block-size 8 --feature-layers 1,8,14,20,27
    --draft-vocab-size 8192 --compute-dtype bfloat16 --num-prompts 20000 --labels regenerate --max-new-tokens 512
    --label-minutes 0 --features offline --feature-dtype float16 --num-anchors 128 --loss-weights acceptance --lr 6e-4
    --warmup-ratio 0.02 --batch-size 1 --grad-accum 4 --eval-sets heldout --eval-prompts 16 --eval-max-new-tokens 128
    --heldout 24 --seed 0"
flashdraft train $COMMON --output "$OUT/features" --threads 2 --until features
ARM="--threads 1 --max-steps 300 --checkpoint-every 50 --eval-every 150"
flashdraft train $COMMON $ARM --output "$OUT/target" --run-name ab-init-target --init-from-target > "$OUT-target.log" 2>&1 &
flashdraft train $COMMON $ARM --output "$OUT/random" --run-name ab-init-random --no-init-from-target > "$OUT-random.log" 2>&1 &
wait
