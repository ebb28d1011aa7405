"""Where flashdraft's CPU engine spends a forward: its matrix products, kernel by kernel, against everything else.

    python benchmarks/profile_engine.py --sizes 1 4 8 16 --repeats 10

The engine's products run in native code that `torch.profiler` does not see (`flashdraft/native/`), so this
times each product call directly (wrapping the engine's kernels) during forwards of n new tokens after 128 cached
ones, as a verification runs, and reports the median forward, the products' share by weight, and the rest
(attention, norms, rotary, copies, Python). Chooses how torch's threads wait like the CLI. Prints Markdown.
"""

from __future__ import annotations

import argparse

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads

import collections  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from flashdraft import engine as engine_module  # noqa: E402
from flashdraft.models import load_target  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402

NAMES = {"qkv": "q/k/v", "o": "o", "gate_up": "gate/up", "down": "down", "head": "head"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16], help="new tokens per forward")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per size (after 3 warm-ups)")
    args = parser.parse_args()

    engine = TargetModel(load_target(args.target)[0]).engine
    if engine is None:
        raise SystemExit(f"{args.target} does not run on the CPU engine")
    kinds = {id(weight): kind for layer in engine.layers
             for kind, weight in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down))}
    kinds[id(engine.head_weight)] = "head"
    spent: dict[str, float] = collections.defaultdict(float)
    used: dict[str, str] = {}

    def timed(name, product):
        def run(x, weight, forms):
            began = time.perf_counter()
            out = product(x, weight, forms)
            spent[kinds[id(weight)]] += time.perf_counter() - began
            used[kinds[id(weight)]] = name
            return out
        return run

    engine_module.PRODUCTS.update({name: timed(name, product) for name, product in engine_module.PRODUCTS.items()})
    engine.kernels = engine_module.KernelChoice(engine.kernels.table)  # look the wrapped products up

    context = 128
    ids = torch.randint(0, engine.embed.shape[0], (1, context + max(args.sizes)))
    positions = torch.arange(ids.shape[1])[None]
    cache = engine.new_cache()
    engine.forward(ids[:, :context], positions[:, :context], cache, logits_to_keep=1)
    print(f"| ms per forward (median of {args.repeats}) | " + " | ".join(f"{n} token(s)" for n in args.sizes) + " |")
    print("|---|" + "---:|" * len(args.sizes))
    rows: dict[str, list[str]] = collections.defaultdict(list)
    for n in args.sizes:
        window = slice(context, context + n)
        times = []
        for _ in range(args.repeats + 3):
            spent.clear()
            began = time.perf_counter()
            engine.forward(ids[:, window], positions[:, window], cache)
            times.append((time.perf_counter() - began, dict(spent)))
            cache.crop(-n)
        total, products = sorted(times[3:], key=lambda pair: pair[0])[args.repeats // 2]
        for kind, name in NAMES.items():
            rows[f"{name} products"].append(f"{products.get(kind, 0.0) * 1e3:.1f} ({used.get(kind, '-')})")
        rows["all products"].append(f"{sum(products.values()) * 1e3:.1f}")
        rows["everything else"].append(f"{(total - sum(products.values())) * 1e3:.1f}")
        rows["**forward**"].append(f"**{total * 1e3:.1f}**")
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
