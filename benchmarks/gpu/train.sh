#!/usr/bin/env bash
# Draft training on the lent GPU machine (see benchmarks/gpu/README.md, "Training there"). The target's weights
# reach the machine in parts (benchmarks/gpu/target_pack.py), one or two a call, because a call carries at most 64 MiB:
#   bash benchmarks/gpu/train.sh stash OUT         # keep the parts this call carried outside the repository
#   bash benchmarks/gpu/train.sh train OUT SECONDS # stash, unpack, train for SECONDS, return the drafts in OUT
# The drafts come back as OUT/drafts.tar.* (15 MB pieces: a returned file is at most 16 MiB); here:
#   cat DIR/drafts.tar.* | tar x -C DEST
set -euo pipefail
what="${1:?usage: bash benchmarks/gpu/train.sh stash|train OUT [SECONDS]}"
out="${2:?usage: bash benchmarks/gpu/train.sh stash|train OUT [SECONDS]}"
cd "$(dirname "$0")/../.."
store="$HOME/flashdraft-pack"
mkdir -p "$store" "$out"
cp .gpu/target/* "$store"/ 2>/dev/null || true  # none on a later call of the same machine: the stash holds them
if ls .whl/*.whl >/dev/null 2>&1; then  # the transformers release flashdraft pins, once, outside the repository
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/flashdraft-site" \
        .whl/*.whl
fi
ls -l "$store"
[ "$what" = stash ] && exit 0
seconds="${3:?train needs SECONDS}"
export PYTHONPATH="$HOME/flashdraft-site:$PWD" PYTHONUNBUFFERED=1
python3 benchmarks/gpu/target_pack.py unpack "$store" "$HOME/flashdraft-target" 2>&1 | tee "$out/train.log"
rm -rf "$HOME/fd-out"  # a run of another length cannot resume this one's checkpoints
# The inner limit leaves the call time to pack what was written, also when training overruns.
# The shipped drafts' recipe (docs/training.md): flashdraft train --corpus with the options below.
timeout "$((seconds + 45))" python3 -m flashdraft.cli train --corpus corpus/smollm2-135m-instruct -o "$HOME/fd-out" \
    --target "$HOME/flashdraft-target" --init-draft flashdraft/drafts/smollm2-135m-instruct \
    --heldout-ids corpus/smollm2-135m-instruct/draws/heldout-v15.txt --seconds "$seconds" \
    --epochs 4 --batch-size 16 --grad-accum 2 --num-anchors 128 --loss-weights acceptance --compute-dtype bfloat16 \
    --checkpoint-every 1000000 --keep-checkpoints 1 "${@:4}" \
    2>&1 | grep -v "Writing model shards" | tee -a "$out/train.log" || echo "training stopped: status $?" | tee -a "$out/train.log"
cp "$HOME/fd-out/work/run/metrics.jsonl" "$out/" 2>/dev/null || true
(cd "$HOME/fd-out" && tar cf - $(ls -d final mean step-* reached.txt 2>/dev/null)) | split -b 15M - "$out/drafts.tar."
ls -l "$out"
