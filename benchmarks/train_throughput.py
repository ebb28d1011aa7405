"""Throughput of draft training on a real target: target feature extraction (tokens/s) and training steps
(blocks/s, sequence tokens/s) with the full or a reduced drafting vocabulary, hard labels or top-k distillation.

    python benchmarks/train_throughput.py --target smollm2-135m-instruct --sequences 24 --steps 6

The sequences are real prompts with their existing responses (a decontaminated seeded mix of the built-in
sources), labelled by the target under teacher forcing with its top-k (not timed here: see
train_data_throughput.py). Features are stored offline in a temporary folder, so the training figures exclude
the target forward. Wall and CPU seconds are both reported: on a shared machine the wall figure depends on the
other jobs, while the CPU figure divided by the threads approximates an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.draft import DFlashDraftModel, default_target_layer_ids
from flashdraft.models import REGISTRY, load_target
from flashdraft.train import EvalIndex, load_eval_sets, load_sources, mix_prompts, remove_overlaps
from flashdraft.train.blocks import TrainingSequence
from flashdraft.train.features import build_feature_store, extract_features
from flashdraft.train.labels import encode_with_response, label_batch
from flashdraft.train.loss import DraftVocabulary
from flashdraft.train.records import TrainingRecord
from flashdraft.train.trainer import TrainConfig, Trainer

CONFIGS = {  # name: (drafting vocabulary size or None for the full vocabulary, distillation weight)
    "full-hard": (None, 0.0),
    "8k-hard": (8192, 0.0),
    "4k-hard": (4096, 0.0),
    "full-distill": (None, 1.0),
    "8k-distill": (8192, 1.0),
}


def labelled_sequences(model, tokenizer, count: int, max_tokens: int, top_k: int, seed: int) -> list[TrainingSequence]:
    pools = load_sources(["sharegpt", "codeio"])  # the sources whose prompts carry a response
    index = EvalIndex(load_eval_sets())
    pools = {name: remove_overlaps(prompts, index)[0] for name, prompts in pools.items()}
    mix = [p for p in mix_prompts(pools, {"sharegpt": 0.5, "codeio": 0.5}, 4 * count, seed=seed, max_chars=2000)
           if p.response][:count]
    end = tokenizer.eos_token_id
    encoded = [encode_with_response(tokenizer, prompt, end, max_tokens) for prompt in mix]
    sequences = []
    for start in range(0, len(encoded), 4):
        chunk = encoded[start : start + 4]
        for (ids, response_start), (labels, top) in zip(chunk, label_batch(model, chunk, top_k, end)):
            record = TrainingRecord(id=f"s{len(sequences)}", source="bench", input_ids=ids,
                                    response_start=response_start, labels=labels, topk_ids=top[0], topk_probs=top[1])
            sequences.append(TrainingSequence.from_record(record, max_length=2048))
    return sequences


def timed(function):
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    parser.add_argument("--sequences", type=int, default=24, help="training sequences (prompt + response)")
    parser.add_argument("--max-response-tokens", type=int, default=256, help="response tokens per sequence")
    parser.add_argument("--draft-layers", type=int, default=2, help="draft layers")
    parser.add_argument("--block-size", type=int, default=16, help="block size")
    parser.add_argument("--num-anchors", type=int, default=64, help="blocks per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per configuration")
    parser.add_argument("--store-top-k", type=int, default=8, help="stored top-k for distillation")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="configurations to time, comma separated: VOCAB-LABELS, VOCAB full/8k/4k, LABELS "
                        "hard (cross-entropy) or distill (top-k distillation)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest on a shared CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load_target(args.target)
    config = model.config.get_text_config()
    layer_ids = default_target_layer_ids(config.num_hidden_layers, 5)
    sequences = labelled_sequences(model, tokenizer, args.sequences, args.max_response_tokens, args.store_top_k, 0)
    tokens = sum(len(s) for s in sequences)
    results = {"target": args.target, "sequences": len(sequences), "tokens": tokens, "threads": args.threads,
               "load_average": os.getloadavg()[0], "features": {}, "training": {}}

    # Feature extraction: the target forward over batches of 8 sequences.
    batches = [sequences[i : i + 8] for i in range(0, len(sequences), 8)]
    _, wall, cpu = timed(lambda: [extract_features(model, [s.input_ids for s in b], layer_ids) for b in batches])
    results["features"] = {"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}
    print(f"load average {results['load_average']:.1f}, {args.threads} thread(s), {len(sequences)} sequences, "
          f"{tokens} tokens", flush=True)
    print("| stage | wall s/step | blocks/s | sequence tokens/s | per CPU-second |")
    print("|---|---|---|---|---|")
    print(f"| feature extraction | | | {tokens / wall:.0f} | {tokens / cpu:.0f} tokens |", flush=True)

    with tempfile.TemporaryDirectory(prefix="flashdraft-bench-") as folder:
        store = build_feature_store(model, sequences, Path(folder) / "features", layer_ids, progress=False)
        mask = REGISTRY[args.target].mask_token_id if args.target in REGISTRY else tokenizer.mask_token_id
        for name in filter(None, args.configs.split(",")):
            vocab_size, distill = CONFIGS[name]
            torch.manual_seed(0)
            draft = DFlashDraftModel.for_target(model.config, num_layers=args.draft_layers,
                                                block_size=args.block_size, mask_token_id=mask,
                                                target_layer_ids=layer_ids)
            vocabulary = None
            if vocab_size:
                vocabulary, _ = DraftVocabulary.most_frequent(sequences, vocab_size, model.config.vocab_size)
            train_config = TrainConfig(num_anchors=args.num_anchors, batch_size=args.batch_size, grad_accum=1,
                                       max_steps=args.steps + 1, distill_weight=distill, checkpoint_every=10**6)
            trainer = Trainer(draft, model, sequences, store, Path(folder) / name, train_config,
                              vocabulary=vocabulary, progress=False)
            trainer.train_step()  # warm-up
            steps, wall, cpu = timed(lambda trainer=trainer: [trainer.train_step() for _ in range(args.steps)])
            blocks = sum(s["blocks"] for s in steps)
            seq_tokens = sum(s["tokens"] for s in steps)
            results["training"][name] = {
                "seconds_per_step": wall / args.steps, "blocks_per_s": blocks / wall,
                "tokens_per_s": seq_tokens / wall, "blocks_per_cpu_s": blocks / cpu,
            }
            print(f"| training, {name} | {wall / args.steps:.2f} | {blocks / wall:.0f} | {seq_tokens / wall:.0f} | "
                  f"{blocks / cpu:.0f} blocks |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
