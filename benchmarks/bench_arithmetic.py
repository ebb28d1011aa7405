"""The engine's two arithmetics side by side on one target, in one run: int8 on the GGUF's own blocks (the default
for registry targets) against float32 (transformers' own results).

    python benchmarks/bench_arithmetic.py --target smollm2-135m-instruct --threads 1 --prompts 8
    python benchmarks/bench_arithmetic.py --target qwen2.5-coder-0.5b-instruct --threads 2 --prompts 4
    python benchmarks/bench_arithmetic.py --target qwen2.5-coder-0.5b-instruct --threads 2 --prompts 0 --context 600

1. Forward costs after a 128-token context (`--context`), interleaved: T(n) for n = 1, 2, 4, 8, 16 and T(n) / T(1),
   each way
   (and int8 without its AMX tile products, where the kernel uses them).
2. The draft pass of the target's shipped draft (where it has one) against T(1), each way.
3. Plain greedy decoding (`flashdraft.generate(block_size=1)`) of HumanEval and MT-Bench prompts, prompt by prompt
   in turns: tokens per second each way, and how many answers are identical token for token.

Like the CLI, it chooses how torch's threads wait before torch loads. Pause background work first: it times.
Prints Markdown.
"""

from __future__ import annotations

import argparse
import statistics
import time

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402

import flashdraft  # noqa: E402
from flashdraft.engine import interleaved_seconds  # noqa: E402
from flashdraft.evaluation.datasets import get_dataset  # noqa: E402
from flashdraft.models import load_draft, load_target, shipped_draft  # noqa: E402
from flashdraft.proposals import DFlashProposer  # noqa: E402
from flashdraft.sampling import SamplingParams  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402
from flashdraft.text import encode_chat  # noqa: E402

SIZES = (1, 2, 4, 8, 16)
ARITHMETICS = ("int8", "float32")
VECTOR_ONLY = "int8, vector panels only"  # timed too where the int8 kernel uses AMX tiles (the same bits)


def forward_seconds(targets: dict[str, TargetModel], repeats: int, cached: int = 128) -> dict[tuple[str, int], float]:
    """T(n) after `cached` cached tokens, every arithmetic and size in turns (least of `repeats`)."""
    context = torch.randint(100, 1000, (1, cached + max(SIZES)), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(context.shape[1])[None]
    works = {}
    for name, target in targets.items():
        engine = target.engine
        cache = engine.new_cache()
        engine.forward(context[:, :cached], positions[:, :cached], cache, logits_to_keep=1)

        def step(n, engine=engine, cache=cache, tiles=True):
            flashdraft.quantized.use_tiles(tiles)
            engine.forward(context[:, cached : cached + n], positions[:, cached : cached + n], cache)
            cache.crop(cached)
            flashdraft.quantized.use_tiles(True)

        works.update({(name, n): (lambda n=n, step=step: step(n)) for n in SIZES})
        if name == "int8" and "+amx" in flashdraft.quantized.kernel_version():  # the same int8 steps without tiles
            works.update({(VECTOR_ONLY, n): (lambda n=n, step=step: step(n, tiles=False)) for n in SIZES})
    return interleaved_seconds(works, repeats)


def draft_seconds(targets: dict[str, TargetModel], draft, repeats: int, context: int = 128) -> dict[str, float]:
    """One block-sized draft pass after `context` context positions and 1 new one, each arithmetic in turns (as
    benchmarks/bench_draft_pass.py, which also interleaves T(1))."""
    block = draft.block_size
    features = torch.randn(1, context + 1, len(draft.target_layer_ids) * draft.config.hidden_size)
    anchor = torch.tensor([5])
    works = {}
    for name, target in targets.items():
        proposer = DFlashProposer(draft, target)
        proposer.begin(context + 2 + block)
        proposer.propose(anchor, features[:, :context], context, block, block, SamplingParams())

        def draft_pass(proposer=proposer):
            proposer.propose(anchor, features[:, context:], context + 1, block, block, SamplingParams())
            proposer.cache.crop(-1)

        works[name] = draft_pass
    return interleaved_seconds(works, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry target (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts decoded each way (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=15, help="turns of the forward timings (default: %(default)s)")
    parser.add_argument("--context", type=int, default=128,
                        help="cached tokens before each timed forward and draft pass (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    targets, tokenizer = {}, None
    for arithmetic in ARITHMETICS:
        model, tokenizer = load_target(args.target, arithmetic=arithmetic)
        targets[arithmetic] = TargetModel(model)
        assert targets[arithmetic].engine.arithmetic == arithmetic, f"{args.target} cannot run {arithmetic}"
    print(f"## {args.target}, {args.threads} thread(s), int8 kernel {flashdraft.quantized.kernel_version()}, "
          f"{args.context} cached tokens\n")
    seconds = forward_seconds(targets, args.repeats, args.context)
    print("| arithmetic | " + " | ".join(f"T({n})" for n in SIZES) + " | T(8)/T(1) | T(16)/T(1) |")
    print("|---|" + "---:|" * (len(SIZES) + 2))
    for name in [name for name in (*ARITHMETICS, VECTOR_ONLY) if (name, 1) in seconds]:
        t = {n: seconds[(name, n)] for n in SIZES}
        print(f"| {name} | " + " | ".join(f"{t[n] * 1e3:.1f} ms" for n in SIZES)
              + f" | {t[8] / t[1]:.2f} | {t[16] / t[1]:.2f} |")
    folder = shipped_draft(args.target, targets["int8"].config)
    if folder is not None:
        draft = load_draft(str(folder))
        passes = draft_seconds(targets, draft, args.repeats, args.context)
        print("\n| arithmetic | draft pass | draft pass / T(1) |\n|---|---:|---:|")
        for name in ARITHMETICS:
            print(f"| {name} | {passes[name] * 1e3:.2f} ms | {passes[name] / seconds[(name, 1)]:.2f} |")
    halves = {"humaneval": args.prompts - args.prompts // 2, "mt-bench": args.prompts // 2}
    samples = [sample for name, count in halves.items() if count for sample in get_dataset(name).load(count)]
    if not samples:  # --prompts 0: the costs alone
        return
    speeds = {name: [] for name in ARITHMETICS}
    same = 0
    for sample in samples:
        ids = encode_chat(tokenizer, sample.messages([]))
        stop = flashdraft.stop_token_ids(targets["int8"].model, tokenizer)
        answers = {}
        for name in ARITHMETICS:
            began = time.perf_counter()
            result = flashdraft.generate(targets[name].model, None, ids, max_new_tokens=args.max_new_tokens,
                                         stop_token_ids=stop, block_size=1)
            speeds[name].append(len(result.tokens) / (time.perf_counter() - began))
            answers[name] = result.tokens
        same += answers["int8"] == answers["float32"]
    print("\n| arithmetic | plain decoding, tokens/s (median per prompt) |\n|---|---:|")
    for name in ARITHMETICS:
        print(f"| {name} | {statistics.median(speeds[name]):.1f} |")
    print(f"\nint8 and float32 answers identical token for token: {same} of {len(samples)} prompts "
          f"({args.max_new_tokens} tokens at most).")


if __name__ == "__main__":
    main()
