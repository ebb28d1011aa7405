"""A draft's products in 8-bit integers (`quantized.block_gemm` on Q8_0 blocks) against bfloat16 arithmetic
(`native.bf16_dot_gemm`), on the shipped draft's shapes at 8 rows (a block-8 pass), serial and on all of torch's
threads. Twelve random weights of each shape are multiplied in turn, so that weights stream from memory as in a
pass; least time per product over 30 rounds.

    python benchmarks/bench_draft_products.py

Like the CLI, it chooses how torch's threads wait before torch loads. Pause background work first: it times.
"""

from __future__ import annotations

import time

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402

from flashdraft import native, quantized  # noqa: E402

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576), "o": (576, 576), "head": (8192, 576)}
ROWS, COPIES, ROUNDS = 8, 12, 30


def least_seconds(multiply, x, packed, parallel: bool) -> float:
    least = float("inf")
    for _ in range(ROUNDS):
        began = time.perf_counter()
        for weight in packed:
            multiply(x, weight, parallel)
        least = min(least, (time.perf_counter() - began) / len(packed))
    return least


def main() -> None:
    if not native.bf16_dot_available():
        raise SystemExit("needs a CPU with AVX512_BF16 and a built native kernel")
    generator = torch.Generator().manual_seed(0)
    print("| product | weight | bfloat16, serial | int8, serial | bfloat16, all threads | int8, all threads |")
    print("|---|---|---:|---:|---:|---:|")
    for kind, (outputs, inputs) in SHAPES.items():
        weights = [torch.randn(outputs, inputs, generator=generator) * 0.05 for _ in range(COPIES)]
        int8 = [quantized.q8_blocks(w) for w in weights]
        bf16 = [native.pack_bfloat16(w) for w in weights]
        x = torch.randn(ROWS, inputs, generator=generator)
        cells = [least_seconds(multiply, x, packed, parallel) * 1e6 for parallel in (False, True)
                 for multiply, packed in ((native.bf16_dot_gemm, bf16), (quantized.block_gemm, int8))]
        print(f"| {kind} | {outputs} x {inputs} | " + " | ".join(f"{cell:.0f} us" for cell in cells) + " |")


if __name__ == "__main__":
    main()
