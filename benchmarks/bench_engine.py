"""The CPU engine (flashdraft/engine/) against transformers' forward on this machine: issue 16's four figures,
each measured interleaved in one run.

    python benchmarks/bench_engine.py --threads 2 --prompts 6 --max-new-tokens 96

1. Plain decoding: `flashdraft.generate(block_size=1)` (library defaults, so the engine) against a separately loaded
   transformers model's own `generate` (greedy, its defaults), prompt by prompt in turns: tokens per second, and
   whether the tokens are identical.
2. Forward costs after a cached context: the engine's T(n) against transformers' T(1) and T(n), and against the
   same engine reading every weight as float32 (`FLASHDRAFT_PACKED=0`, a separately loaded copy of the model).
3. The draft pass (the shipped draft at its block size) against the engine's T(1).
4. Regeneration (`TargetModel.generate_batch`, batches of 8 prompts, greedy): response tokens per CPU-second of
   this process, engine against transformers, and the engine's decoding steps with each layer one native call (the
   default) against the same operator by operator.
Like the CLI, it chooses how torch's threads wait before torch loads (`flashdraft.files.choose_thread_waiting`);
it prints the choice. Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from flashdraft.files import WAITING_VARIABLES, choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402

import flashdraft  # noqa: E402
from flashdraft.engine import KERNEL_ROWS, interleaved_seconds, unsupported_reason  # noqa: E402
from flashdraft.evaluation.datasets import get_dataset  # noqa: E402
from flashdraft.models import load_draft, load_target, shipped_draft  # noqa: E402
from flashdraft.proposals import DFlashProposer  # noqa: E402
from flashdraft.sampling import SamplingParams  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402
from flashdraft.text import encode_chat  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    parser.add_argument("--draft", default=None, help="draft folder (default: the target's shipped draft)")
    parser.add_argument("--dataset", default="humaneval", help="evaluation set the prompts come from")
    parser.add_argument("--prompts", type=int, default=6, help="prompts for plain decoding")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens per plain decoding")
    parser.add_argument("--regenerate-prompts", type=int, default=16, help="prompts for the regeneration figure")
    parser.add_argument("--regenerate-tokens", type=int, default=64, help="tokens per regenerated answer")
    parser.add_argument("--repeats", type=int, default=9, help="timed turns per forward cost")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load_target(args.target)
    reference_model, _ = load_target(args.target)  # transformers' own, never touched by the engine
    target = TargetModel(model)
    reference = TargetModel(reference_model, engine="transformers")
    if target.engine is None:
        raise SystemExit(f"the engine cannot run {args.target}: {unsupported_reason(model)}")
    os.environ["FLASHDRAFT_PACKED"] = "0"  # read when an engine is built: this one keeps float32 weights only
    float32_target = TargetModel(load_target(args.target)[0])
    assert float32_target.engine is not None
    del os.environ["FLASHDRAFT_PACKED"]
    samples = get_dataset(args.dataset).load(max(args.prompts, args.regenerate_prompts))
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": s.turns[0]}]) for s in samples]
    blas = "MKL" if torch.backends.mkl.is_available() else "other"
    waiting = ", ".join(f"{name}={os.environ[name]}" for name in WAITING_VARIABLES if name in os.environ)
    print(f"{args.target}, float32, {args.threads} torch thread(s), torch BLAS {blas}, numpy "
          f"{__import__('numpy').__version__}, {waiting}; kernels chosen: "
          + ", ".join(f"{kind} {target.engine.kernels.table.get(kind)}" for kind in ("qkv", "head"))
          + f"; weights read as {target.engine.packed_formats()}")

    # 1. Plain decoding, prompt by prompt in turns; neither stops early, so both make max_new_tokens tokens.
    decode = {"flashdraft": [], "transformers": []}
    identical = 0
    for ids in prompts[: args.prompts]:
        outputs: dict[str, list[int]] = {}

        def ours(ids=ids, outputs=outputs):
            outputs["flashdraft"] = flashdraft.generate(model, None, ids, max_new_tokens=args.max_new_tokens,
                                                        block_size=1).tokens

        def theirs(ids=ids, outputs=outputs):
            out = reference_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=args.max_new_tokens,
                                           eos_token_id=None, pad_token_id=0)
            outputs["transformers"] = out[0, len(ids):].tolist()

        seconds = interleaved_seconds({"flashdraft": ours, "transformers": theirs}, 1, statistics.median)
        for name, spent in seconds.items():
            decode[name].append(args.max_new_tokens / spent)
        identical += outputs["flashdraft"] == outputs["transformers"]
    ours_tps, theirs_tps = statistics.median(decode["flashdraft"]), statistics.median(decode["transformers"])
    print(f"\n| plain decoding ({args.prompts} {args.dataset} prompts x {args.max_new_tokens} tokens) | tokens/s |\n"
          f"|---|---:|\n| transformers `generate` | {theirs_tps:.1f} |\n| flashdraft, block size 1 | {ours_tps:.1f} "
          f"|\n| **ratio** | **{ours_tps / theirs_tps:.2f}x** |\n\nidentical outputs: {identical} of {args.prompts}")

    # 2. and 3. Forward costs and the draft pass, all in turns.
    context = 128
    ids = torch.randint(0, target.vocab_size, (1, context + max(KERNEL_ROWS)))
    positions = torch.arange(ids.shape[1])[None]
    caches = {}
    for name, adapter in (("flashdraft", target), ("transformers", reference), ("float32", float32_target)):
        caches[name] = adapter.new_cache()
        adapter.forward(ids[:, :context], positions[:, :context], caches[name], None, logits_to_keep=1)

    def forward(adapter, name, n):
        def run():
            adapter.forward(ids[:, context : context + n], positions[:, context : context + n], caches[name], None)
            adapter.rollback(caches[name], n)
        return run

    draft = load_draft(str(args.draft or shipped_draft(args.target, model.config)))
    proposer = DFlashProposer(draft, target)
    features = torch.randn(1, context + 1, len(draft.target_layer_ids) * target.hidden_size)
    anchor = torch.zeros(1, dtype=torch.long)
    proposer.begin(context + 2 + draft.block_size)
    proposer.propose(anchor, features[:, :context], context, draft.block_size, draft.block_size, SamplingParams(),
                     None)

    def draft_pass():  # a round's pass: one new context position after the cached ones, then dropped again
        proposer.propose(anchor, features[:, context:], context + 1, draft.block_size, draft.block_size,
                         SamplingParams(), None)
        proposer.cache.crop(-1)

    sizes = (1, 2, 4, 8, 16)
    works = {f"flashdraft T({n})": forward(target, "flashdraft", n) for n in sizes}
    works |= {f"transformers T({n})": forward(reference, "transformers", n) for n in (1, 4, 16)}
    works |= {f"flashdraft T({n}), float32 weights": forward(float32_target, "float32", n) for n in (1, 4, 16)}
    works[f"draft pass (block {draft.block_size})"] = draft_pass
    seconds = interleaved_seconds(works, args.repeats, statistics.median)
    eager_one = seconds["transformers T(1)"]
    print(f"\n| after {context} cached tokens | ms | / transformers T(1) |\n|---|---:|---:|")
    for name, spent in seconds.items():
        print(f"| {name} | {spent * 1e3:.1f} | {spent / eager_one:.2f} |")
    draft_share = seconds[f"draft pass (block {draft.block_size})"] / seconds["flashdraft T(1)"]
    print(f"\ndraft pass / flashdraft T(1): {draft_share:.2f}; "
          f"flashdraft T(4) / transformers T(1): {seconds['flashdraft T(4)'] / eager_one:.2f}")

    # 4. Regeneration: greedy answers in batches of 8, per CPU-second of this process (threads included).
    batch = prompts[: args.regenerate_prompts]
    produced = {}

    def regenerate(adapter, name):
        def run():
            answers = []
            for first in range(0, len(batch), 8):
                answers += adapter.generate_batch(batch[first : first + 8], args.regenerate_tokens, [])
            produced[name] = sum(len(a) for a in answers)
        return run

    # The engine's decoding steps with each layer one native call (the default), and operator by operator.
    forms = {"transformers": (reference, True), "flashdraft engine": (target, True),
             "flashdraft engine, layers operator by operator": (target, False)}
    cpu = {}
    for name in [*forms] * 2:
        adapter, native_layers = forms[name]
        target.engine.use_native_layers = native_layers
        began = time.process_time()
        regenerate(adapter, name)()
        cpu.setdefault(name, []).append(produced[name] / (time.process_time() - began))
    target.engine.use_native_layers = True
    rates = {name: statistics.mean(values) for name, values in cpu.items()}
    print(f"\n| regeneration ({len(batch)} prompts x {args.regenerate_tokens} tokens, batches of 8) | response tokens "
          f"per CPU-second | / transformers |\n|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | **{rate / rates['transformers']:.2f}x** |")


if __name__ == "__main__":
    main()
