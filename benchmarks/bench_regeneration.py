"""Corpus regeneration's decoding: left-padded batches against continuous batching, the same prompts and answers.

    python benchmarks/bench_regeneration.py --target qwen2.5-coder-0.5b-instruct --prompts 48 --max-new-tokens 512

Prompts: HumanEval and MT-Bench's first turns, half each, planned into batches by length as regeneration plans them
(`flashdraft.train.records.plan_batches`). "padded" decodes each batch of `--batch-size` left-padded
(`TargetModel.generate_batch`, what regeneration did before 2026-12-06); "continuous" decodes the same order
`--batch-size` prompts at a time, a finished one replaced at once (`flashdraft.train.regenerate.decode_continuously`,
what it does now). Prints each one's tokens per second and how many answers are identical (all of them with the
engine's int8 arithmetic). Pause background jobs while it runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdraft.evaluation.datasets import get_dataset
from flashdraft.models import load_target
from flashdraft.text import encode_chat
from flashdraft.train.records import plan_batches
from flashdraft.train.regenerate import decode_continuously, generate_batch, required_stop_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct", help="registry name or folder")
    parser.add_argument("--prompts", type=int, default=48, help="prompts, half HumanEval, half MT-Bench")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="longest answer (the corpus's: 512)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (the corpus's: 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a background regeneration uses 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target)
    stops = required_stop_token_ids(model, tokenizer)
    samples = [*get_dataset("humaneval").load(args.prompts - args.prompts // 2),
               *get_dataset("mt-bench").load(args.prompts // 2)]
    prompts = [encode_chat(tokenizer, sample.messages([])) for sample in samples]
    plan = plan_batches([len(ids) for ids in prompts], [str(i) for i in range(len(prompts))], args.batch_size)
    answers = {}
    for method in ("padded", "continuous"):
        began = time.perf_counter()
        if method == "padded":
            answers[method] = [answer for batch in plan for answer in generate_batch(
                model, [prompts[i] for i in batch], args.max_new_tokens, stops, pad_token_id=stops[0])[0]]
        else:
            order = [i for batch in plan for i in batch]
            answers[method] = decode_continuously(model, [prompts[i] for i in order], args.batch_size,
                                                  args.max_new_tokens, stops)
        seconds = time.perf_counter() - began
        tokens = sum(map(len, answers[method]))
        print(f"{method:>10}: {tokens} tokens in {seconds:.0f} s, {tokens / seconds:.1f} tokens/s", flush=True)
    same = sum(a == b for a, b in zip(answers["padded"], answers["continuous"]))
    print(f"identical answers: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
