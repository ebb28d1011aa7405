"""The cost of a training step's target features, by the forward that computes them.

    OMP_NUM_THREADS=2 python benchmarks/bench_features.py --target qwen2.5-coder-0.5b-instruct --threads 2

`flashdraft train` runs the target over every micro-batch's sequences for the hidden states of the draft's feature
layers (`OnlineFeatures`), which on a CPU is most of a step. Three ways, on one micro-batch of random tokens (the
compute does not depend on the values) of `--lengths` tokens, the ways alternating so that a busy machine slows all
alike; the least of `--repeats` runs each, and the ratios to the first, measured in the same run:
  - transformers' padded forward in bfloat16 (`--dtype bfloat16`, the recipe of the drafts v1-v6);
  - transformers' padded forward in float32 (`--engine transformers`);
  - the engine, each sequence alone (`--dtype float32` on a CPU: int8 on the GGUF's blocks for a registry target,
    the features decoding gives the draft).
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdraft.models import load_target
from flashdraft.target import TargetModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct", help="registry target")
    parser.add_argument("--lengths", type=int, nargs="+", default=[620, 480, 350, 210],
                        help="token counts of the micro-batch's sequences (default: 4, about the corpus's spread)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="feature layers (default: the target's shipped draft's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    float32, _ = load_target(args.target, dtype=torch.float32)
    bfloat16, _ = load_target(args.target, dtype=torch.bfloat16)
    layers = args.layers
    if layers is None:
        from flashdraft import load_draft
        layers = list(load_draft(None, target=args.target).target_layer_ids)
    ways = {
        "transformers, bfloat16": TargetModel(bfloat16, engine="transformers"),
        "transformers, float32": TargetModel(float32, engine="transformers"),
        "engine, each sequence": TargetModel(float32),
    }
    engine = ways["engine, each sequence"].engine
    print(f"target {args.target}, feature layers {layers}, {args.threads} threads, sequences {args.lengths}; "
          f"engine: {engine.arithmetic if engine is not None else 'none (runs transformers)'}")
    generator = torch.Generator().manual_seed(0)
    vocabulary = float32.config.vocab_size
    sequences = [torch.randint(0, vocabulary, (n,), generator=generator) for n in args.lengths]
    times = {name: [] for name in ways}
    for target in ways.values():  # a first, untimed run each: kernels chosen, caches warm
        target.padded_hidden_states(sequences, layers)
    for _ in range(args.repeats):
        for name, target in ways.items():
            began = time.perf_counter()
            target.padded_hidden_states(sequences, layers)
            times[name].append(time.perf_counter() - began)
    first = min(next(iter(times.values())))
    tokens = sum(args.lengths)
    for name, runs in times.items():
        least = min(runs)
        print(f"{name:24s} {least:7.2f} s  ({tokens / least:6.0f} tokens/s, {least / first:.2f} of the first)")


if __name__ == "__main__":
    main()
