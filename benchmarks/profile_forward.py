"""Where a target forward and a draft pass spend their time on this CPU (issue: a faster exact engine on CPU).

    python benchmarks/profile_forward.py --target smollm2-135m-instruct --sizes 1 4 16 --threads 2

For each forward size n: the target runs n new tokens after a cached context (as a verification does), under
`torch.profiler`; the time is split by the module the operator ran in (the output head, the attention and MLP
projections, the attention kernel, norms and rotary, the rest) and the top operators by self time are listed.
The shipped draft's pass at its block size is profiled the same way. "Outside operators" is the wall time not
covered by any profiled operator: Python and framework overhead. Prints Markdown. The target runs transformers'
forward (its modules are what the regions label); `benchmarks/bench_engine.py` times flashdraft's engine against it.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from flashdraft.models import load_draft, load_target, shipped_draft  # noqa: E402
from flashdraft.proposals import DFlashProposer  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402


def label_modules(model: torch.nn.Module, head: torch.nn.Module) -> list:
    """Wrap each module of interest in a `record_function` region named by what it is."""

    def region(name):
        def before(module, args):
            module._flashdraft_region = record_function(name)
            module._flashdraft_region.__enter__()

        def after(module, args, output):
            module._flashdraft_region.__exit__(None, None, None)

        return before, after

    handles = []
    modules = list(model.named_modules())
    if all(module is not head for _, module in modules):  # a draft's head (the target's rows) lives outside it
        modules.append(("head", head))
    for name, module in modules:
        kind = None
        if module is head:
            kind = "head"
        elif name == "fc":
            kind = "context projection (fc)"
        elif name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            kind = "attention projections"
        elif name.endswith(("gate_proj", "up_proj", "down_proj")):
            kind = "MLP projections"
        elif name.endswith(("norm", "layernorm")) or "RMSNorm" in type(module).__name__:
            kind = "norms"
        elif "Rotary" in type(module).__name__:
            kind = "rotary tables"
        if kind:
            before, after = region(f"region::{kind}")
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    return handles


def split(prof, wall_us: float) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Self CPU time by region (operators outside every region by their own name's group) and the top ops."""
    by_region: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    events = [e for e in prof.events() if not e.name.startswith("region::") and e.device_type.name == "CPU"]
    regions = [e for e in prof.events() if e.name.startswith("region::")]
    for event in events:
        top[event.name] += event.self_cpu_time_total
        start, end = event.time_range.start, event.time_range.end
        inside = [r for r in regions if r.time_range.start <= start and end <= r.time_range.end]
        if inside:
            name = min(inside, key=lambda r: r.time_range.end - r.time_range.start).name.removeprefix("region::")
        elif "attention" in event.name or "softmax" in event.name:
            name = "attention kernel"
        else:
            name = "other operators"
        by_region[name] += event.self_cpu_time_total
    by_region["outside operators (Python, framework)"] = max(wall_us - sum(by_region.values()), 0.0)
    return dict(by_region), sorted(top.items(), key=lambda item: -item[1])[:8]


def report(title: str, run, repeats: int) -> None:
    run()  # warm-up
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            run()
    wall_us = (time.perf_counter() - began) * 1e6
    regions, top = split(prof, wall_us)
    print(f"\n### {title}: {wall_us / repeats / 1000:.1f} ms per call (profiled; {repeats} calls)\n")
    print("| where | ms per call | share |\n|---|---:|---:|")
    for name, us in sorted(regions.items(), key=lambda item: -item[1]):
        print(f"| {name} | {us / repeats / 1000:.2f} | {us / wall_us:.0%} |")
    print("\ntop operators by self time: " + ", ".join(f"{name} {us / repeats / 1000:.2f} ms" for name, us in top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    parser.add_argument("--draft", default=None, help="draft folder (default: the target's shipped draft)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16], help="tokens per target forward")
    parser.add_argument("--context", type=int, default=128, help="cached tokens before each forward")
    parser.add_argument("--repeats", type=int, default=20, help="profiled calls per measurement")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, _ = load_target(args.target)
    target = TargetModel(model, engine="transformers")  # the module hooks below label transformers' forward
    handles = label_modules(model, target.lm_head)
    print(f"{args.target}, float32, {args.threads} thread(s), {torch.__config__.parallel_info().splitlines()[0]}, "
          f"BLAS: {'MKL' if torch.backends.mkl.is_available() else 'other'}; context {args.context} tokens")
    ids = torch.randint(0, target.vocab_size, (1, args.context + max(args.sizes)))
    positions = torch.arange(ids.shape[1])[None]
    cache = target.new_cache()
    target.forward(ids[:, : args.context], positions[:, : args.context], cache, None, logits_to_keep=1)
    for n in args.sizes:
        window = slice(args.context, args.context + n)

        def verify(window=window, n=n):
            target.forward(ids[:, window], positions[:, window], cache, None)
            target.rollback(cache, n)

        report(f"target forward, {n} token(s)", verify, args.repeats)

    draft = load_draft(str(args.draft or shipped_draft(args.target, model.config)))
    proposer = DFlashProposer(draft, target)
    handles += label_modules(draft, proposer.head)
    width = len(draft.target_layer_ids) * target.hidden_size
    context = torch.randn(1, args.context + 2, width)
    anchor = torch.zeros(1, dtype=torch.long)
    proposer.begin(args.context + 2 + draft.block_size)
    proposer.propose(anchor, context[:, : args.context], args.context, draft.block_size)  # the cached context

    def draft_pass():  # a decoding round's pass: two new context positions after the cached ones
        proposer.propose(anchor, context[:, args.context :], args.context + 2, draft.block_size)
        proposer.cache.crop(-2)

    report(f"draft pass, block {draft.block_size}, 2 new context positions after {args.context}", draft_pass,
           args.repeats)
    for handle in handles:
        handle.remove()


if __name__ == "__main__":
    main()
