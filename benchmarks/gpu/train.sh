#!/usr/bin/env bash
# Draft training on the lent GPU machine (see benchmarks/gpu/README.md, "Training there"). The target's weights
# reach the machine in parts (benchmarks/gpu/target_pack.py), one or two a call, because a call carries at most 64 MiB:
#   bash benchmarks/gpu/train.sh stash OUT                          # keep the parts this call carried, outside the repository
#   bash benchmarks/gpu/train.sh train OUT SECONDS TARGET [OPTION...] # stash, unpack, train for SECONDS, return the drafts
# TARGET names the corpus (corpus/TARGET), its held-out list and the draft the run continues: the one that travelled
# in the parts (target_pack.py --draft), else the repository's flashdraft/drafts/TARGET. OPTIONs go to
# `flashdraft train` after the recipe below (a later option wins).
# The drafts named in RETURN (default "final"; e.g. RETURN="final mean") come back as draft packs OUT/NAME (parts of
# 15 MB: a returned file is at most 16 MiB, all of them 64 MiB, which one 0.5B target's draft, compressed, fits); here:
#   python benchmarks/gpu/target_pack.py unpack DIR/final --draft-out DEST/final
set -euo pipefail
usage="usage: bash benchmarks/gpu/train.sh stash OUT | train OUT SECONDS TARGET [OPTION...]"
what="${1:?$usage}"
out="${2:?$usage}"
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
seconds="${3:?$usage}"
target="${4:?$usage}"
case "$target" in  # each corpus's held-out records: what its shipped drafts' tau was measured on
    smollm2-135m-instruct) heldout=heldout-v15.txt ;;
    qwen2.5-coder-0.5b-instruct) heldout=heldout-v1.txt ;;
    *) echo "train.sh: no held-out list known for $target (add it above)" >&2; exit 2 ;;
esac
export PYTHONPATH="$HOME/flashdraft-site:$PWD" PYTHONUNBUFFERED=1
python3 benchmarks/gpu/target_pack.py unpack "$store" "$HOME/flashdraft-target" --draft-out "$HOME/flashdraft-draft" \
    2>&1 | tee "$out/train.log"
start="flashdraft/drafts/$target"
[ -f "$HOME/flashdraft-draft/model.safetensors" ] && start="$HOME/flashdraft-draft"
rm -rf "$HOME/fd-out"  # a run of another length cannot resume this one's checkpoints
# The inner limit leaves the call time to pack what was written, also when training overruns.
# The shipped drafts' recipe (docs/training.md): flashdraft train --corpus with the options below.
timeout "$((seconds + 45))" python3 -m flashdraft.cli train --corpus "corpus/$target" -o "$HOME/fd-out" \
    --target "$HOME/flashdraft-target" --init-draft "$start" \
    --heldout-ids "corpus/$target/draws/$heldout" --seconds "$seconds" \
    --epochs 4 --batch-size 16 --grad-accum 2 --num-anchors 128 --loss-weights acceptance --compute-dtype bfloat16 \
    --checkpoint-every 1000000 --keep-checkpoints 1 "${@:5}" \
    2>&1 | grep -v "Writing model shards" | tee -a "$out/train.log" || echo "training stopped: status $?" | tee -a "$out/train.log"
cp "$HOME/fd-out/work/run/metrics.jsonl" "$HOME/fd-out/reached.txt" "$out/" 2>/dev/null || true
for name in ${RETURN:-final}; do
    [ -d "$HOME/fd-out/$name" ] || { echo "no $name draft to return" | tee -a "$out/train.log"; continue; }
    python3 benchmarks/gpu/target_pack.py pack "$out/$name" --draft "$HOME/fd-out/$name" --part-mb 15,15,15,15,15 \
        --preset 1  # 48 MB for the 0.5B target's draft in ~10 s (preset 6: 46 MB in a minute)
done
ls -lR "$out"
