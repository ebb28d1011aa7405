#!/usr/bin/env bash
# A device call carries the working tree, 64 MiB at most; the repository's tracked files are more since the Qwen
# draft (97 MB, 68 MB of it that draft's weights). Before the calls, `away` takes tracked paths the calls do not
# need out of the tree and the index (into a stash outside the checkout); after them, `back` restores both.
# Nothing is committed either way, and `away` refuses while an earlier `away` waits for its `back`.
#   bash benchmarks/gpu/tree.sh size              # MB a call would carry now (without its carried paths)
#   bash benchmarks/gpu/tree.sh away PATH...      # e.g. flashdraft/drafts/qwen2.5-coder-0.5b-instruct
#   bash benchmarks/gpu/tree.sh back
set -euo pipefail
usage="usage: bash benchmarks/gpu/tree.sh size | away PATH... | back"
cd "$(dirname "$0")/../.."
stash="$HOME/.flashdraft-tree-away$PWD"  # this checkout's, outside it (a call never carries it)
size() {
    git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' path; do
        [ -f "$path" ] && printf '%s\0' "$path"
    done | du -cb --files0-from=- | tail -1 | awk '{printf "%.1f MB travel (64 MiB = 67.1 MB at most)\n", $1 / 1e6}'
}
case "${1:?$usage}" in
    size) size ;;
    away)
        shift
        [ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
        if [ -s "$stash/paths" ]; then
            echo "tree.sh: $(tr '\n' ' ' <"$stash/paths")are away already: bring them back first (tree.sh back)" >&2
            exit 1
        fi
        mkdir -p "$stash"
        for path in "$@"; do
            path="${path%/}"
            [ -n "$(git ls-files -- "$path")" ] || { echo "tree.sh: $path is not tracked" >&2; exit 1; }
            git rm -r -q --cached -- "$path"
            mkdir -p "$stash/$(dirname "$path")"
            mv "$path" "$stash/$path"
            echo "$path" >>"$stash/paths"
        done
        size ;;
    back)
        [ -s "$stash/paths" ] || { echo "tree.sh: nothing is away"; exit 0; }
        while IFS= read -r path; do
            mkdir -p "$(dirname "$path")"
            mv "$stash/$path" "$path"
            git reset -q -- "$path"
        done <"$stash/paths"
        rm -f "$stash/paths"
        size ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
