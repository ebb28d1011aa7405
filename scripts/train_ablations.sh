#!/bin/bash
# Issue 4, item 12: effect of the drafting vocabulary, teacher-forced vs regenerated labels and top-k distillation on
# tau at equal steps (200 steps of one sequence). Runs A-C label 240 ShareGPT/CodeI/O prompts by teacher forcing;
# run D uses the shipped draft's regenerated records (its work folder, WORK_REGEN, must exist: see its model card).
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
OUT=${OUT:-ablations}
WORK_TF=${WORK_TF:-$HOME/.cache/flashdraft/train/ablation-tf}
WORK_TOP8=${WORK_TOP8:-$HOME/.cache/flashdraft/train/ablation-tf-top8}
WORK_REGEN=${WORK_REGEN:-$HOME/.cache/flashdraft/train/smollm2-v2}
TF="--target smollm2-135m-instruct --sources sharegpt,codeio --proportions sharegpt=0.5,codeio=0.5 --num-prompts 240
    --max-prompt-chars 800 --labels teacher-forced --max-new-tokens 160 --data-batch-size 8 --seed 0 --heldout 16"
REGEN="--target smollm2-135m-instruct --work-dir $WORK_REGEN --sources codeio,leetcode,math,sharegpt
    --proportions codeio=0.3,leetcode=0.2,math=0.3,sharegpt=0.2 --num-prompts 1200 --max-prompt-chars 1500
    --labels regenerate --max-new-tokens 256 --temperature 0 --data-batch-size 16 --seed 1 --label-minutes 0 --heldout 24"
COMMON="--draft-layers 2 --block-size 16 --feature-layers 5 --max-steps 200 --num-anchors 64 --lr 1e-3 --batch-size 1
    --grad-accum 1 --eval-every 100 --eval-sets heldout,humaneval,gsm8k --eval-prompts 16 --eval-max-new-tokens 128"
flashdraft train $TF $COMMON --work-dir "$WORK_TF" --store-top-k 0 --draft-vocab-size 8192 --run-name A -o "$OUT/A"
flashdraft train $TF $COMMON --work-dir "$WORK_TF" --store-top-k 0 --draft-vocab-size 0 --run-name B -o "$OUT/B"
flashdraft train $TF $COMMON --work-dir "$WORK_TOP8" --store-top-k 8 --distill-weight 1 --draft-vocab-size 8192 --run-name C -o "$OUT/C"
flashdraft train $REGEN $COMMON --draft-vocab-size 8192 --run-name D -o "$OUT/D"
