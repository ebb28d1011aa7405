"""The cost of one training micro-step of the shipped recipe, by precision and attention layout.

    python benchmarks/bench_train_step.py --contexts 400 700 1000 --repeats 4

One sequence's step as `flashdraft train` runs it with the shipped draft's settings: a 2-layer draft for the default
target, 128 blocks of 8 over a context of C positions (anchors drawn at random, sorted), the target's features,
the 8,192-token drafting head and its chunked cross-entropy, forward and backward. The data are random: the
figures are of the compute, which does not depend on the values. Each setting runs `--repeats` times, the settings
alternating so that a busy machine slows all alike; the least time is reported, with the ratios to the first
setting (float32, one attention over all keys) measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig

from flashdraft import DFlashDraftModel
from flashdraft import draft as draft_module
from flashdraft.models import prepare
from flashdraft.train.blocks import block_attention_mask
from flashdraft.train.loss import head_cross_entropy

SETTINGS = {  # name: (autocast dtype or None, queries per attention group)
    "float32, whole attention": (None, 10**9),
    "bfloat16, whole attention": (torch.bfloat16, 10**9),
    "bfloat16, query groups": (torch.bfloat16, draft_module.QUERY_GROUP),
}


def micro_step(target_config, context: int, blocks: int = 128, block_size: int = 8, vocabulary: int = 8192):
    """A closure running one forward and backward of the draft over `blocks` blocks of a `context`-long sequence."""
    torch.manual_seed(0)
    draft = DFlashDraftModel.for_target(target_config, num_layers=2, block_size=block_size, mask_token_id=0,
                                        target_layer_ids=[1, 8, 14, 20, 27])
    width = target_config.hidden_size
    anchors = torch.sort(torch.randperm(context - block_size)[:blocks] + 1).values[None]
    mask = block_attention_mask(anchors, context, block_size)
    positions = torch.cat([torch.arange(context)[None], (anchors[:, :, None] + torch.arange(block_size)).view(1, -1)],
                          dim=1)
    features = torch.randn(1, context, 5 * width)
    block = torch.randn(1, blocks * block_size, width)
    head = torch.randn(vocabulary, width) * 0.02
    labelled = blocks * (block_size - 1)
    labels, probs = torch.randint(0, vocabulary, (labelled, 1)), torch.ones(labelled, 1)

    def run(dtype):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            hidden = draft(block, features, positions, attention_mask=mask)
            predicting = hidden.view(1, blocks, block_size, width)[:, :, 1:].reshape(-1, width)
            losses, _ = head_cross_entropy(predicting, head, None, labels, probs)
        losses.sum().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[400, 700, 1000], help="context lengths C")
    parser.add_argument("--repeats", type=int, default=4, help="timed runs of each setting")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_config = AutoConfig.from_pretrained(prepare("smollm2-135m-instruct"))
    print("| context | " + " | ".join(f"{name}: ms" for name in SETTINGS) + " | " +
          " | ".join(f"{name} vs the first" for name in list(SETTINGS)[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(SETTINGS) - 1))
    for context in args.contexts:
        run = micro_step(target_config, context)
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(args.repeats + 1):  # the first round warms up and is not counted
            for name, (dtype, group) in SETTINGS.items():
                draft_module.QUERY_GROUP = group
                start = time.perf_counter()
                run(dtype)
                times[name].append(time.perf_counter() - start)
        best = {name: min(values[1:]) for name, values in times.items()}
        first = best[next(iter(SETTINGS))]
        print(f"| {context} | " + " | ".join(f"{1e3 * value:.0f}" for value in best.values()) + " | " +
              " | ".join(f"{first / value:.2f}x" for value in list(best.values())[1:]) + " |")


if __name__ == "__main__":
    main()
