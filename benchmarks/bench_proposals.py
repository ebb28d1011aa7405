"""The proposals against plain decoding on the same engine: `flashdraft.generate` with `block_size=1`, with the
shipped draft (hybrid proposals, the default), with the draft alone (`proposals="dflash"`, block size by cost) and
with `proposals="lookup"`, in turns prompt by prompt (a rotating
order), greedy, with the chat template and the target's stop tokens.

    python benchmarks/bench_proposals.py --dataset humaneval --prompts 6 --max-new-tokens 128
    python benchmarks/bench_proposals.py --near-best 0.97 0.93   # the hybrid's planner band, each value a method
    python benchmarks/bench_proposals.py --planned-sizes   # also hybrid and dflash without confidence sizing

`flashdraft bench` compares against transformers' `generate`, which does not run on flashdraft's CPU engine; this
isolates what the proposals add on top of it. Like the CLI, it chooses how torch's threads wait before torch
loads (`choose_thread_waiting`).
Prints one line per prompt (tokens/s of each, whether all outputs agree), the mean tokens/s and the pooled tau.
`--near-best` runs the hybrid once per value of `flashdraft.proposals.NEAR_BEST` (a round takes the longest of the
options within that fraction of the best expected tokens per second). `--planned-sizes` adds "hybrid-planned" and
"dflash-planned": greedy rounds of the planner's size, not sized again by the draft's confidence
(`HybridProposer.size_by_confidence` off).
"""

from __future__ import annotations

import argparse
import statistics
import time

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import flashdraft  # noqa: E402
from flashdraft import proposals  # noqa: E402
from flashdraft.evaluation.datasets import get_dataset  # noqa: E402
from flashdraft.models import shipped_draft  # noqa: E402
from flashdraft.text import encode_chat, stop_token_ids  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    parser.add_argument("--draft", default=None, help="draft folder (default: the target's shipped draft)")
    parser.add_argument("--dataset", default="humaneval", help="evaluation set the prompts come from")
    parser.add_argument("--prompts", type=int, default=6, help="prompts (first turns)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer at most")
    parser.add_argument("--near-best", type=float, nargs="+", default=[], metavar="F",
                        help="also run the hybrid with these planner bands (default: only the library's)")
    parser.add_argument("--planned-sizes", action="store_true",
                        help="also run hybrid and dflash with rounds of the planned size (no confidence sizing)")
    args = parser.parse_args()

    model, tokenizer = flashdraft.load_target(args.target)
    folder = args.draft or shipped_draft(args.target, model.config)
    if folder is None:
        raise SystemExit(f"no draft is shipped for {args.target}: pass --draft FOLDER")
    draft = flashdraft.load_draft(str(folder))
    settings = {"max_new_tokens": args.max_new_tokens, "stop_token_ids": stop_token_ids(model, tokenizer)}
    methods = {
        "plain": lambda ids: flashdraft.generate(model, None, ids, block_size=1, **settings),
        "hybrid": lambda ids: flashdraft.generate(model, draft, ids, **settings),
        "dflash": lambda ids: flashdraft.generate(model, draft, ids, proposals="dflash", **settings),
        "lookup": lambda ids: flashdraft.generate(model, None, ids, proposals="lookup", **settings),
    }
    for band in args.near_best:
        methods[f"hybrid@{band}"] = lambda ids, band=band: with_band(band, lambda: methods["hybrid"](ids))
    if args.planned_sizes:
        for name in ("hybrid", "dflash"):
            methods[f"{name}-planned"] = lambda ids, name=name: planned_sizes(lambda: methods[name](ids))
    samples = get_dataset(args.dataset).load(args.prompts)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": s.turns[0]}]) for s in samples]
    for run in methods.values():  # warm-up: kernels, verify costs, caches
        run(prompts[0][:32])
    rates: dict[str, list[float]] = {name: [] for name in methods}
    rounds: dict[str, list[int]] = {name: [] for name in methods}
    names = list(methods)
    for i, ids in enumerate(prompts):
        outputs = {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            began = time.perf_counter()
            result = methods[name](ids)
            rates[name].append(len(result.tokens) / (time.perf_counter() - began))
            outputs[name] = result.tokens
            rounds[name] += result.acceptance_lengths
        agree = len({tuple(tokens) for tokens in outputs.values()}) == 1
        print(f"prompt {i}: " + ", ".join(f"{name} {rates[name][-1]:.1f}" for name in names)
              + f" tokens/s; outputs identical: {agree}")
    means = {name: statistics.mean(values) for name, values in rates.items()}
    print("mean tokens/s: " + ", ".join(f"{name} {value:.1f} ({value / means['plain']:.2f}x plain)"
                                        for name, value in means.items()))
    print("tau: " + ", ".join(f"{name} {sum(lengths) / len(lengths):.2f}" for name, lengths in rounds.items()))


def with_band(band: float, run):
    """`run()` with the hybrid planner's band set to `band`, restored after."""
    default, proposals.NEAR_BEST = proposals.NEAR_BEST, band
    try:
        return run()
    finally:
        proposals.NEAR_BEST = default


def planned_sizes(run):
    """`run()` with greedy rounds of the planner's size (confidence sizing off), restored after."""
    proposals.HybridProposer.size_by_confidence = False
    try:
        return run()
    finally:
        proposals.HybridProposer.size_by_confidence = True


if __name__ == "__main__":
    main()
