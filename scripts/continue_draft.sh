#!/bin/bash
# Issue 11, the recipe of drafts v11-v14 in one script (BENCHMARKS.md, "Draft v14"): continue the shipped draft on a
# draw of corpus answers, then average it with the run's drafts and keep what the held-out records say is best.
#
#   bash scripts/continue_draft.sh OUT RECORDS STEPS [LR]
#   bash scripts/continue_draft.sh /root/fd-runs/v15 3600 1600 6e-4
#
# Stages, each resumed when the script runs again: the draw (`flashdraft corpus train-folder OUT/work --records
# RECORDS`, leaving out every shipped draft's draw, corpus/TARGET/draws/*.txt; its ids go to OUT/draw.txt, to
# commit as draws/vNN.txt with the draft), its offline features, the shipped draft's held-out
# baseline (one step at lr 1e-12), the run (one schedule of STEPS steps, evaluated every STEPS/4), then the means of
# the shipped draft with the run's kept and last drafts (`scripts/average_drafts.py`), each evaluated on the same
# held-out records. It prints every held-out tau; ship the best after its replay (`scripts/ship_draft.py`, then
# `flashdraft bench --replay`). Pause the regeneration first: a niced thread beside the run still stalls its steps.
set -euo pipefail
OUT=$1 RECORDS=$2 STEPS=$3 LR=${4:-6e-4}
HERE=$(cd "$(dirname "$0")" && pwd)
SHIPPED="$HERE/../flashdraft/drafts/smollm2-135m-instruct"
WORK="$OUT/work"
mkdir -p "$OUT"
[ -d "$OUT/init" ] || cp -r "$SHIPPED" "$OUT/init"  # the draft the run starts from, as it was when it began
if [ ! -d "$WORK/records-regenerate" ]; then
    python "$HERE/corpus.py" train-folder "$WORK" --records "$RECORDS" \
        $(for drawn in "$HERE"/../corpus/smollm2-135m-instruct/draws/*.txt; do echo --exclude "$drawn"; done)
fi
[ -f "$OUT/draw.txt" ] || python -c "import sys; from flashdraft.train.records import read_records
print(''.join(sorted(r.id + '\n' for r in read_records(sys.argv[1]))), end='')" "$WORK/records-regenerate" > "$OUT/draw.txt"
COMMON="--target smollm2-135m-instruct --work-dir $WORK --draft-layers 2 --block-size 8
    --feature-layers 1,8,14,20,27 --draft-vocab-size 8192 --draft-vocab-corpus $HERE/../corpus/smollm2-135m-instruct
    --compute-dtype bfloat16 --threads 2 --num-prompts 20000 --labels regenerate --max-new-tokens 512
    --label-minutes 0 --features offline --feature-dtype float16 --max-length 2048 --epochs 3 --num-anchors 128
    --loss-weights acceptance --warmup-ratio 0.02 --batch-size 1 --grad-accum 4 --checkpoint-every 100
    --keep-checkpoints 2 --eval-sets heldout --eval-prompts 16 --eval-max-new-tokens 128 --heldout 24 --seed 0"
evaluate() {  # held-out tau of a draft folder: one step at lr 1e-12 (a failure stops the script; see the log)
    # shellcheck disable=SC2086  # the options are meant to split into words
    flashdraft train $COMMON --init-draft "$2" --output "$OUT/eval-$1" --run-name "eval-$1" --max-steps 1 \
        --lr 1e-12 --eval-every 1 > "$OUT/eval-$1.log" 2>&1
    grep -a "draft written" "$OUT/eval-$1.log"
}
# shellcheck disable=SC2086
flashdraft train $COMMON --init-draft "$OUT/init" --output "$OUT/run" --until features > "$OUT/features.log" 2>&1
evaluate init "$OUT/init"
# shellcheck disable=SC2086
flashdraft train $COMMON --init-draft "$OUT/init" --output "$OUT/run" --run-name run --max-steps "$STEPS" \
    --lr "$LR" --eval-every $((STEPS / 4)) > "$OUT/run.log" 2>&1
grep -a "draft written" "$OUT/run.log"
LAST=$(find "$WORK/runs/run/checkpoints" -name "step-*.pt" | sort | tail -n 1)  # the run's last step
python "$HERE/average_drafts.py" "$OUT/mean-init-kept" --like "$OUT/run" "$OUT/init" "$OUT/run"
python "$HERE/average_drafts.py" "$OUT/mean-init-last" --like "$OUT/run" "$OUT/init" "$LAST"
python "$HERE/average_drafts.py" "$OUT/mean-init-kept-last" --like "$OUT/run" "$OUT/init" "$OUT/run" "$LAST"
for NAME in mean-init-kept mean-init-last mean-init-kept-last; do
    python "$HERE/ship_draft.py" "$OUT/$NAME" "$OUT/$NAME-bf16"
    evaluate "$NAME" "$OUT/$NAME-bf16"
done
python "$HERE/ship_draft.py" "$OUT/run" "$OUT/run-bf16"
evaluate run "$OUT/run-bf16"
