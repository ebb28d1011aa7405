"""Where a round of the decoding loop goes: the draft's proposal, the target's verification, and the rest of the loop
(acceptance, rollback, the proposer's bookkeeping, Python), timed inside real greedy decoding.

    OMP_NUM_THREADS=2 python benchmarks/bench_round.py --target qwen2.5-coder-0.5b-instruct --threads 2 --prompts 3

Runs each prompt with the shipped draft alone at its block size (`--proposals dflash`) and with plain decoding
(block size 1), interleaved, wrapping the proposer's `propose` and the target's `forward` in timers. Prints per
round: milliseconds in each part and the verification's cost in plain steps, then what a round would yield with no
loop overhead (tau over the round's cost in plain steps) against what it did. Pause background jobs first.
"""

from __future__ import annotations

import argparse
import statistics
import time

from flashdraft.files import choose_thread_waiting

choose_thread_waiting()  # as the CLI does, before torch loads

import torch  # noqa: E402

import flashdraft  # noqa: E402
from flashdraft.models import load_draft, load_target, shipped_draft  # noqa: E402
from flashdraft.proposals import DFlashProposer  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402
from flashdraft.text import encode_chat  # noqa: E402

PROMPTS = [
    "Write a Python function that returns the longest palindromic substring of a string.",
    "Explain the difference between a process and a thread, with an example of each.",
    "Write a Python class for a bank account with deposit, withdraw and a transaction history.",
    "A train travels 120 km in 1.5 hours and then 80 km in 1 hour. What is its average speed?",
]


class Timed:
    """Wraps a callable and sums the seconds its calls take."""

    def __init__(self, function):
        self.function, self.seconds = function, 0.0

    def __call__(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load_target(args.target)
    draft_folder = shipped_draft(args.target, model.config)
    if draft_folder is None:
        raise SystemExit(f"{args.target} has no shipped draft")
    draft = load_draft(str(draft_folder))
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in (PROMPTS * 4)[: args.prompts]]

    # One target and one proposer for every run (an engine packs its weights once), their calls timed.
    target = TargetModel(model)
    proposer = DFlashProposer(draft, target)
    forward, propose = Timed(target.forward), Timed(proposer.propose)
    target.forward, proposer.propose = forward, propose

    def run(ids, block_size):
        forward.seconds = propose.seconds = 0.0
        result = flashdraft.generate(target, proposer if block_size > 1 else None, ids,
                                     max_new_tokens=args.max_new_tokens, block_size=block_size,
                                     proposals="dflash" if block_size > 1 else None)
        return dict(tokens=result.tokens, rounds=len(result.acceptance_lengths), decode=result.decode_seconds,
                    verify=forward.seconds - result.prefill_seconds, propose=propose.seconds, tau=result.tau)

    block = draft.block_size
    for size in (1, block):  # warm-up
        run(prompts[0], size)
    rows = {"plain": [], "draft": []}
    identical = 0
    for ids in prompts:
        plain, drafted = run(ids, 1), run(ids, block)
        rows["plain"].append(plain)
        rows["draft"].append(drafted)
        identical += plain["tokens"] == drafted["tokens"]

    def per_round(rs, key):
        return 1000 * statistics.mean(r[key] / r["rounds"] for r in rs)

    step = per_round(rows["plain"], "decode")
    print(f"| {args.target}, {args.threads} thread(s), block {block} | ms a round | in plain steps |")
    print("|---|---:|---:|")
    print(f"| plain decoding: a step (verify {per_round(rows['plain'], 'verify'):.2f} ms) | {step:.2f} | 1.00 |")
    for part in ("propose", "verify"):
        value = per_round(rows["draft"], part)
        print(f"| draft alone: {part} | {value:.2f} | {value / step:.2f} |")
    total = per_round(rows["draft"], "decode")
    rest = total - per_round(rows["draft"], "propose") - per_round(rows["draft"], "verify")
    print(f"| draft alone: the rest of the loop | {rest:.2f} | {rest / step:.2f} |")
    print(f"| draft alone: the round | {total:.2f} | {total / step:.2f} |")
    plain_rest = step - per_round(rows["plain"], "verify")
    tau = statistics.mean(r["tau"] for r in rows["draft"])
    print(f"\ntau {tau:.2f}: {tau / (total / step):.2f}x plain decoding measured; "
          f"{tau * step / (total - rest + plain_rest):.2f}x were a round's loop no dearer than a plain step's "
          f"({plain_rest:.2f} ms); identical outputs {identical}/{len(prompts)}")


if __name__ == "__main__":
    main()
