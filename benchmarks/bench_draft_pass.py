"""The draft pass against the target's one-token step on the CPU engine, in alternating turns: a round's pass (one
new context position after 200 cached, the whole block drafted) then a T(1) after as many cached tokens, so that each
finds its weights evicted by the other as in decoding. Reports the least and the median of each and their ratio.

    python benchmarks/bench_draft_pass.py --turns 40
    FLASHDRAFT_DRAFT_INT8=0 python benchmarks/bench_draft_pass.py     # the pass in bfloat16 arithmetic, not 8-bit
    FLASHDRAFT_DRAFT_INT8=0 FLASHDRAFT_DRAFT_BF16=0 python benchmarks/bench_draft_pass.py     # in float32
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_draft_pass.py     # threads that sleep at once
    python benchmarks/bench_draft_pass.py --warm                      # also passes back to back (weights in cache)
    python benchmarks/bench_draft_pass.py --step-by-step              # an 8-bit draft's layers operator by operator
    python benchmarks/bench_draft_pass.py --layers-only               # its layers native, the rest of the pass in torch

Like the CLI, it chooses how torch's threads wait before torch loads (`choose_thread_waiting`) and prints the
choice. Pause background work first: it times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from flashdraft.files import WAITING_VARIABLES, choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402

from flashdraft.models import load_draft, load_target, shipped_draft  # noqa: E402
from flashdraft.proposals import DFlashProposer  # noqa: E402
from flashdraft.sampling import SamplingParams  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    parser.add_argument("--draft", default=None, help="draft folder (default: the target's shipped draft)")
    parser.add_argument("--context", type=int, default=200, help="cached positions before the round")
    parser.add_argument("--turns", type=int, default=40, help="timed turns (after 5 warm-ups)")
    parser.add_argument("--warm", action="store_true", help="also time passes back to back, weights in cache")
    parser.add_argument("--step-by-step", action="store_true",
                        help="run an 8-bit draft's layers operator by operator, not one native call each")
    parser.add_argument("--layers-only", action="store_true",
                        help="run an 8-bit draft's layers in one native call each, the rest of its pass in torch "
                             "(not the whole pass in one call)")
    args = parser.parse_args()

    torch.manual_seed(0)
    target = TargetModel(load_target(args.target)[0])
    if target.engine is None:
        raise SystemExit(f"{args.target} does not run on the CPU engine")
    folder = args.draft or shipped_draft(args.target, target.config)
    if folder is None:
        raise SystemExit(f"{args.target} has no shipped draft: give --draft FOLDER")
    draft = load_draft(str(folder))
    proposer = DFlashProposer(draft, target)
    if args.step_by_step and proposer.on_engine:
        proposer.forward.use_native_layers = False
    if args.layers_only and proposer.on_engine:
        proposer.forward.use_whole_pass = False
    context, block = args.context, draft.block_size
    features = torch.randn(1, context + 1, len(draft.target_layer_ids) * target.hidden_size)
    anchor = torch.tensor([5])
    proposer.begin(context + 2 + block)
    proposer.propose(anchor, features[:, :context], context, block, block, SamplingParams())

    def draft_pass():
        proposer.propose(anchor, features[:, context:], context + 1, block, block, SamplingParams())
        proposer.cache.crop(-1)

    cache = target.engine.new_cache()
    target.engine.forward(torch.arange(context)[None] % target.vocab_size, torch.arange(context)[None], cache)

    def step():
        target.engine.forward(torch.tensor([[7]]), torch.tensor([[context]]), cache)
        cache.crop(context)

    for _ in range(5):
        draft_pass(), step()
    times: dict[str, list[float]] = {"draft pass": [], "T(1)": []}
    for _ in range(args.turns):
        for name, work in (("draft pass", draft_pass), ("T(1)", step)):
            began = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - began)
    waiting = ", ".join(f"{name}={os.environ[name]}" for name in WAITING_VARIABLES if name in os.environ)
    forward = proposer.forward
    native_layers = proposer.on_engine and forward.native_layers and forward.use_native_layers
    layers = ("the whole pass in one native call" if native_layers and forward.use_whole_pass else
              "one native call a layer" if native_layers else "layers operator by operator")
    arithmetic = ("8-bit integer" if getattr(forward, "int8", None) else
                  "bfloat16" if getattr(forward, "bf16_dot", False) else "float32")
    print(f"{args.target}, draft {args.draft or 'shipped'} (block {block}, {arithmetic} arithmetic, "
          f"{'engine' if proposer.on_engine else 'module'} pass, {layers}), {torch.get_num_threads()} threads, "
          f"{waiting}")
    least = {name: min(spent) for name, spent in times.items()}
    median = {name: statistics.median(spent) for name, spent in times.items()}
    for name in times:
        print(f"{name}: {least[name] * 1e3:.2f} ms least, {median[name] * 1e3:.2f} median")
    print(f"draft pass / T(1): {least['draft pass'] / least['T(1)']:.3f} least, "
          f"{median['draft pass'] / median['T(1)']:.3f} median")
    if args.warm:
        warm = []
        for _ in range(args.turns):
            began = time.perf_counter()
            draft_pass()
            warm.append(time.perf_counter() - began)
        print(f"draft pass back to back (weights in cache): {min(warm) * 1e3:.2f} ms least, "
              f"{statistics.median(warm) * 1e3:.2f} median")


if __name__ == "__main__":
    main()
