"""Overhead of flashdraft's decoding loop: `block_size=1` (plain autoregressive decoding through the
speculative loop) against the target's own `generate(do_sample=False)`, interleaved prompt by prompt.

    python benchmarks/bench_loop.py --target smollm2-135m-instruct --prompts 8 --max-new-tokens 128

Prints a Markdown table; the ratio is the loop's decode speed over `generate`'s (>= 0.95 is the goal).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashdraft
from flashdraft.models import load_target
from flashdraft.text import encode_chat

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain why the sky is blue in three sentences.",
    "List five prime numbers and say why each is prime.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Write a haiku about autumn rain.",
    "How do I sort a dictionary by value in Python?",
    "Summarise the plot of Romeo and Juliet.",
    "Give three tips for writing clear emails.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts")
    args = parser.parse_args()

    model, tokenizer = load_target(args.target)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in (PROMPTS * 4)[: args.prompts]]

    def run_generate(ids):
        # No end token for either method: both produce exactly max_new_tokens, so per-token times compare.
        began = time.perf_counter()
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=args.max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist(), time.perf_counter() - began

    def run_loop(ids):
        began = time.perf_counter()
        result = flashdraft.generate(model, None, ids, max_new_tokens=args.max_new_tokens, block_size=1)
        return result.tokens, time.perf_counter() - began

    run_generate(prompts[0]), run_loop(prompts[0])  # warm-up
    times = {"generate": [], "loop": []}
    identical = 0
    for _ in range(args.repeats):
        for ids in prompts:
            reference, t_generate = run_generate(ids)
            tokens, t_loop = run_loop(ids)
            times["generate"].append(t_generate / len(reference))
            times["loop"].append(t_loop / len(tokens))
            identical += tokens == reference
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print(f"| method | ms/token (median of {len(times['loop'])}) |\n|---|---|")
    print(f"| target.generate(do_sample=False) | {ms['generate']:.1f} |")
    print(f"| flashdraft loop, block_size=1 | {ms['loop']:.1f} |")
    print(f"\nloop speed / generate speed = {ms['generate'] / ms['loop']:.3f}; "
          f"identical outputs: {identical}/{len(times['loop'])}")


if __name__ == "__main__":
    main()
