"""How well a draft's confidence predicts acceptance: the calibration that greedy rounds are sized by
(`HybridProposer.confident_plan`, docs/decoding.md).

Replays greedy decoding at the draft's whole block (as `flashdraft bench --replay` does: the target's answers, its
features in one forward, draft passes alone) and, for every proposal the target's answer tested (those up to the
first miss), notes the probability the draft gave its own token and whether it was accepted. Prints the share
accepted per confidence bin, pooled over the datasets, and tau at the whole block.

    python benchmarks/bench_confidence.py --target qwen2.5-coder-0.5b-instruct --prompts 12
"""

from __future__ import annotations

import argparse

from flashdraft.evaluation.datasets import get_dataset
from flashdraft.evaluation.replay import cached_greedy_answers, replay_text
from flashdraft.models import load_draft, load_target, shipped_draft
from flashdraft.proposals import GREEDY, DFlashProposer, confidences, draft_tokens
from flashdraft.sampling import matching_prefix
from flashdraft.target import TargetModel
from flashdraft.text import encode_chat, stop_token_ids

EDGES = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    parser.add_argument("--draft", default=None, help="draft folder (default: the target's shipped draft)")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mt-bench", "gsm8k"])
    parser.add_argument("--prompts", type=int, default=12, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer at most")
    args = parser.parse_args()

    model, tokenizer = load_target(args.target)
    folder = args.draft or shipped_draft(args.target, model.config)
    if folder is None:
        raise SystemExit(f"no draft is shipped for {args.target}: pass --draft FOLDER")
    draft = load_draft(str(folder), target=args.target)
    target = TargetModel(model)
    proposer = DFlashProposer(draft, target)
    block = draft.block_size
    tested, accepted = [0] * (len(EDGES) - 1), [0] * (len(EDGES) - 1)
    rounds = []
    for name in args.datasets:
        samples = get_dataset(name).load(args.prompts)
        prompts = [encode_chat(tokenizer, sample.messages([])) for sample in samples]
        answers = cached_greedy_answers(model, prompts, args.max_new_tokens, stop_token_ids(model, tokenizer), 8)
        for prompt, answer in zip(prompts, answers):
            text = replay_text(target, draft.target_layer_ids, prompt, answer)
            ids, start, seen = text.token_ids, text.prompt_length, 0
            proposer.begin(ids.numel() + block)
            while (emitted := start - text.prompt_length + 1) < text.answer_length:
                size = min(block, text.answer_length - emitted)
                logits, _ = proposer.round_logits(ids[start : start + 1], text.features[:, seen:start], start, block)
                logits = logits[: size - 1]
                proposals = draft_tokens(logits, proposer.vocab_ids, GREEDY, None, target.vocab_size)[0]
                matched = int(matching_prefix(proposals, ids[start + 1 : start + size]))
                for k, confidence in enumerate(confidences(logits)[: min(matched + 1, size - 1)]):
                    bin_ = next(b for b in range(len(EDGES) - 1) if confidence <= EDGES[b + 1])
                    tested[bin_] += 1
                    accepted[bin_] += k < matched
                rounds.append(matched + 1)
                seen, start = start, start + matched + 1
    print(f"{args.target}, draft {folder}: {len(rounds)} rounds at block {block}, tau {sum(rounds) / len(rounds):.2f}")
    print("| draft's confidence | proposals tested | accepted |\n|---|---:|---:|")
    for b in range(len(EDGES) - 1):
        share = f"{accepted[b] / tested[b]:.3f}" if tested[b] else "-"
        print(f"| {EDGES[b]:.2f}-{EDGES[b + 1]:.2f} | {tested[b]} | {share} |")


if __name__ == "__main__":
    main()
