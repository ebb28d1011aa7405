"""The native attention kernel alone against torch's fused kernel, on the default target's attention shapes (9 query
heads, 3 key/value heads, head_dim 64) or another's (`--shape`): a step of n queries over a cache, causal within the
step, on one thread and on all of torch's, in alternating turns; least time of each.

    python benchmarks/bench_attention_kernel.py
    python benchmarks/bench_attention_kernel.py --queries 1 4 8 16 --keys 129 512 2048
    python benchmarks/bench_attention_kernel.py --shape 14 2 64     # Qwen2.5-Coder-0.5B's shapes

Like the CLI, it chooses how torch's threads wait before torch loads. Pause background work first: it times.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashdraft import native  # noqa: E402

CAPACITY, TURNS = 4096, 300


def least_microseconds(functions: dict, turns: int = TURNS) -> dict[str, float]:
    """Each function's least time over `turns` alternating calls, in microseconds."""
    least = dict.fromkeys(functions, float("inf"))
    for _ in range(turns):
        for name, function in functions.items():
            began = time.perf_counter()
            function()
            least[name] = min(least[name], time.perf_counter() - began)
    return {name: seconds * 1e6 for name, seconds in least.items()}


def torch_attention(queries, keys, values, end: int, visible):
    n, heads, head_dim = queries.shape
    return F.scaled_dot_product_attention(queries.view(1, n, heads, head_dim).transpose(1, 2), keys[:, :, :end],
                                          values[:, :, :end], attn_mask=visible, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--keys", type=int, nargs="+", default=[129, 512, 2048], help="cached keys after the step")
    parser.add_argument("--shape", type=int, nargs=3, default=[9, 3, 64], metavar=("HEADS", "KV_HEADS", "HEAD_DIM"),
                        help="attention shape (default: the default target's, 9 3 64; Qwen2.5-Coder-0.5B: 14 2 64)")
    args = parser.parse_args()
    heads, kv_heads, head_dim = args.shape
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, kv_heads, CAPACITY, head_dim, generator=generator)
    values = torch.randn(1, kv_heads, CAPACITY, head_dim, generator=generator)
    threads = torch.get_num_threads()
    print(f"| queries | keys | torch, {threads} threads | native, 1 thread | native, {threads} threads |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.queries:
        queries = torch.randn(n, heads, head_dim, generator=generator)
        for end in args.keys:
            start = end - n
            visible = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]

            fused = partial(torch_attention, queries, keys, values, end, None if n == 1 else visible)
            times = least_microseconds({
                "torch": fused,
                "native": partial(native.causal_attention, queries, keys, values, start),
                "parallel": partial(native.causal_attention, queries, keys, values, start, parallel=True),
            })
            print(f"| {n} | {end} | {times['torch']:.1f} us | {times['native']:.1f} us | {times['parallel']:.1f} us |")


if __name__ == "__main__":
    main()
