"""What drafting fewer block positions costs in acceptance: tau by replay at small round sizes, with the draft run
on its whole block (as the decoding loop runs it) against a block cut to the round's size (a cheaper pass).

    python benchmarks/replay_draft_rows.py --datasets humaneval gsm8k mt-bench --num-samples 30 --max-new-tokens 256

The target's greedy answers come from the same cache as `flashdraft bench --replay` (same prompts, same seed).
"""

from __future__ import annotations

import argparse

from tqdm.auto import tqdm

from flashdraft.evaluation.datasets import DATASETS
from flashdraft.evaluation.replay import cached_greedy_answers, replay, replay_text
from flashdraft.models import DEFAULT_TARGET, load_draft, load_target, shipped_draft
from flashdraft.proposals import DFlashProposer
from flashdraft.target import TargetModel
from flashdraft.text import encode_chat, stop_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=None, help="draft folder (default: the target's shipped draft)")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench"], choices=list(DATASETS))
    parser.add_argument("--num-samples", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="round sizes (tokens verified)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="transformers", choices=["auto", "flashdraft", "transformers"],
                        help="the target's forward; acceptance does not depend on it, and transformers' needs no "
                        "kernel measurement first (default: transformers)")
    args = parser.parse_args()
    target, tokenizer = load_target(args.target, engine=args.engine)
    draft = load_draft(str(args.draft or shipped_draft(args.target, target.config)))
    adapter = TargetModel(target)
    proposer = DFlashProposer(draft, adapter)
    stops = stop_token_ids(target, tokenizer)
    print(f"| dataset | round size | tau, whole block ({draft.block_size}) | tau, block cut to the round |")
    print("|---|---:|---:|---:|")
    for name in args.datasets:
        samples = DATASETS[name].load(args.num_samples or None, args.seed)
        prompts = [encode_chat(tokenizer, sample.messages([])) for sample in samples]
        answers = cached_greedy_answers(target, prompts, args.max_new_tokens, stops, 8)
        texts = [replay_text(adapter, draft.target_layer_ids, p, a) for p, a in zip(prompts, answers)]
        for size in args.sizes:
            taus = []
            for draft_size in (max(size, draft.block_size), size):
                lengths = [n for text in tqdm(texts, desc=f"{name} {size}/{draft_size}", leave=False)
                           for n in replay(proposer, text, size, draft_size)]
                taus.append(sum(lengths) / max(len(lengths), 1))
            print(f"| {name} | {size} | {taus[0]:.3f} | {taus[1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
