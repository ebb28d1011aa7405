"""The int8 kernel alone on a registry target's own GGUF blocks: every product of one forward (q/k/v, o, gate/up,
down of each layer, and the head), for M rows, with and without the AMX tile products, in interleaved turns.

    python benchmarks/bench_block_gemm.py --target qwen2.5-coder-0.5b-instruct --rows 1 4 8 12 16
    python benchmarks/bench_block_gemm.py --target qwen2.5-coder-1.5b-instruct --threads 2

What it answers: what a step of M rows costs the products against one row (the weight is read from memory once
per pass either way), and from how many rows the tiles pay (`TILE_MIN_ROWS` in `flashdraft/csrc/block_gemm.c`).
Both ways give the same bits; this checks that too on every size. Pause background work first: it times.
Prints Markdown.
"""

from __future__ import annotations

import argparse

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402

from flashdraft import quantized  # noqa: E402
from flashdraft.engine.kernels import interleaved_seconds  # noqa: E402
from flashdraft.models import load_target  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry target (default: %(default)s)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 9, 12, 16], help="M, rows a product")
    parser.add_argument("--threads", type=int, default=1, help="threads sharing each product's panels")
    parser.add_argument("--repeats", type=int, default=10, help="turns (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_target(args.target, arithmetic="int8")
    weights = list(TargetModel(model).engine.blocks.values())
    types = sorted({name for weight in weights for name in weight.types})
    parallel = args.threads > 1
    ways = {"vector panels": False}
    if quantized.use_tiles(True):
        ways["with AMX tiles"] = True
    inputs = {m: torch.randn(m, max(weight.shape[1] for weight in weights)) for m in args.rows}

    def one_pass(m: int, tiles: bool) -> list[torch.Tensor]:
        quantized.use_tiles(tiles)
        return [quantized.block_gemm(inputs[m][:, : weight.shape[1]].contiguous(), weight, parallel=parallel)
                for weight in weights]

    for m in args.rows:  # the same bits both ways, before any timing
        outputs = [one_pass(m, tiles) for tiles in ways.values()]
        assert all(torch.equal(a, b) for other in outputs[1:] for a, b in zip(outputs[0], other)), m
    seconds = interleaved_seconds({(way, m): (lambda m=m, tiles=tiles: one_pass(m, tiles))
                                   for way, tiles in ways.items() for m in args.rows}, args.repeats)
    quantized.use_tiles(True)
    print(f"## {args.target}: {len(weights)} products a forward ({', '.join(types)}), {args.threads} thread(s), "
          f"kernel {quantized.kernel_version()}\n")
    one = seconds[("vector panels", 1)]
    print("| products | " + " | ".join(f"M={m}" for m in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for way in ways:
        print(f"| {way} | " + " | ".join(f"{seconds[(way, m)] * 1e3:.1f} ms ({seconds[(way, m)] / one:.2f})"
                                         for m in args.rows) + " |")


if __name__ == "__main__":
    main()
