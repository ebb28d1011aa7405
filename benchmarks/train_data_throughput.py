"""Throughput of the training-data stages on a real target: regeneration (the target writes responses) and
teacher-forced labelling (the target labels existing responses in one forward), in response tokens per second.

    python benchmarks/train_data_throughput.py --target smollm2-135m-instruct --prompts 32

Both stages read the same decontaminated, seeded mix of built-in prompts; the labelling stage uses the prompts of
that mix that carry an existing response (ShareGPT replies, CodeI/O reference code). Records go to a temporary
folder unless --output is given.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.models import load_target
from flashdraft.train import (
    EvalIndex,
    label_responses,
    load_eval_sets,
    load_sources,
    mix_prompts,
    read_records,
    regenerate,
    remove_overlaps,
)
from flashdraft.train.sources import DEFAULT_PROPORTIONS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per stage")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="response tokens per prompt, both stages")
    parser.add_argument("--max-chars", type=int, default=2000, help="truncate prompts and responses to this")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="mix seed")
    parser.add_argument("--output", type=Path, default=None, help="keep the records here (default: a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load_target(args.target)
    pools = load_sources()
    index = EvalIndex(load_eval_sets())
    pools = {name: remove_overlaps(prompts, index)[0] for name, prompts in pools.items()}
    mix = mix_prompts(pools, DEFAULT_PROPORTIONS, total=20 * args.prompts, seed=args.seed, max_chars=args.max_chars)
    to_regenerate = mix[: args.prompts]
    to_label = [prompt for prompt in mix if prompt.response][: args.prompts]

    output = args.output or Path(tempfile.mkdtemp(prefix="flashdraft-bench-"))
    started = time.perf_counter()
    # CPU seconds of this process as well as wall seconds: on a shared machine the wall figure depends on what else
    # runs, while with one thread the CPU figure approximates the wall time on an idle core.
    cpu_started = time.process_time()
    regenerated = regenerate(
        model,
        tokenizer,
        to_regenerate,
        output / "regenerated",
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    cpu_regenerate = time.process_time() - cpu_started
    labelled = label_responses(
        model,
        tokenizer,
        to_label,
        output / "labelled",
        max_response_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    cpu_label = time.process_time() - cpu_started - cpu_regenerate
    print(f"target {args.target}, {args.threads} thread(s), batch {args.batch_size}, records in {output}")
    for name, stats, cpu in (
        ("regeneration", regenerated, cpu_regenerate),
        ("teacher-forced labels", labelled, cpu_label),
    ):
        print(
            f"{name}: {stats.written} prompts, {stats.prompt_tokens} prompt + {stats.tokens} response tokens; "
            f"wall {stats.seconds:.1f} s = {stats.tokens_per_second:.1f} response tokens/s; "
            f"CPU {cpu:.1f} s = {stats.tokens / cpu:.1f} response tokens per CPU second"
        )
    records = list(read_records(output / "labelled"))
    agree = sum(a == b for r in records for a, b in zip(r.labels, r.input_ids[r.response_start :]))
    share = agree / sum(len(r.labels) for r in records)
    print(f"teacher-forced labels equal the existing text at {share:.1%} of positions")
    print(f"total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
