"""The int8 kernel against this CPU's own multiply-add peak: how close `block_gemm` comes to the VNNI instructions'
throughput when its weight sits in the caches, one thread.

    python benchmarks/bench_kernel_peak.py
    python benchmarks/bench_kernel_peak.py --rows 1 4 8 16 --types Q5_0 Q8_0

What it answers: whether a verification of M rows is bound by the kernel's code or by the machine. The peak is
measured, not looked up: a C loop of independent 512-bit `VPDPBUSD` instructions (64 int8 multiply-adds each) gives
the time of one. A panel block (16 weight rows x 32 columns, the kernel's unit) takes 8 of them a row, so
8 x that time is the floor of a row's cost per block whatever the code; the table gives each weight type's measured
cost per block and row and the share of the floor it reaches. Machines without AVX-512 VNNI print the kernel's
times alone. Each time is less a call's fixed cost (Python, ctypes, rounding the activations), measured on a
weight of 8 blocks. Pause background work first: it times. Prints Markdown.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flashdraft import native, quantized
from flashdraft.quantized import FORMATS, BlockWeight, Codes, FusedBlocks

PEAK_PROGRAM = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(void) {
    __m512i sums[12], codes = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x05060708);
    for (int i = 0; i < 12; i++) sums[i] = _mm512_set1_epi32(i);
    const long turns = 50000000;
    double best = 1e9;
    for (int repeat = 0; repeat < 3; repeat++) {
        struct timespec start, end;
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (long n = 0; n < turns; n++) {
            for (int i = 0; i < 12; i++) sums[i] = _mm512_dpbusd_epi32(sums[i], codes, x);
        }
        clock_gettime(CLOCK_MONOTONIC, &end);
        const double seconds = (end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) * 1e-9;
        if (seconds < best) best = seconds;
    }
    int total = 0;
    for (int i = 0; i < 12; i++) total += _mm512_reduce_add_epi32(sums[i]);
    printf("%.6f %d\n", best / (turns * 12.0) * 1e9, total & 1);
    return 0;
}
"""


def vnni_nanoseconds() -> float | None:
    """The time of one 512-bit VPDPBUSD when nothing waits on it (12 independent sums), or None without one."""
    with tempfile.TemporaryDirectory() as folder:
        source, program = Path(folder) / "peak.c", Path(folder) / "peak"
        source.write_text(PEAK_PROGRAM)
        built = subprocess.run(["cc", "-O3", "-funroll-loops", "-march=native", "-o", str(program), str(source)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return None
        return float(subprocess.run([str(program)], capture_output=True, text=True, check=True).stdout.split()[0])


def random_weight(type_name: str, rows: int, cols: int, seed: int) -> FusedBlocks:
    """A weight of `type_name`'s layout with random codes and modest random scales (and minimums)."""
    fmt = FORMATS[type_name]
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**fmt.bits, (rows, cols), dtype=np.uint8)
    scale = rng.uniform(1e-3, 1e-2, (rows, cols // fmt.block)).astype(np.float32)
    minimum = None if fmt.offset else -8 * scale
    return FusedBlocks.of([BlockWeight.of(Codes(type_name, codes, scale, minimum))])


def seconds_per_call(x: torch.Tensor, weight: FusedBlocks, budget: float = 0.3) -> float:
    """Least time of one product over 5 runs of about `budget` seconds each."""
    quantized.block_gemm(x, weight)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget / 5:
        quantized.block_gemm(x, weight)
        calls += 1
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            quantized.block_gemm(x, weight)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16], help="M, rows a product")
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q5_0", "Q8_0", "Q6_K"], choices=sorted(FORMATS))
    parser.add_argument("--shape", type=int, nargs=2, default=[512, 1024], metavar=("N", "K"),
                        help="weight rows and columns; the default's largest type fits a core's L2 (default: 512 1024)")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit(f"the native kernel is unavailable: {native.unavailable_reason()}")
    torch.set_num_threads(1)
    n, k = args.shape
    panel_blocks = n // 16 * (k // 32)
    peak = vnni_nanoseconds() if "avx512-vnni" in quantized.kernel_version() else None
    floor = None if peak is None else 8 * peak
    print(f"## The int8 kernel in the caches, one thread ({quantized.kernel_version()}, weight {n} x {k})\n")
    if floor is None:
        print("No AVX-512 VNNI here: the kernel's times alone.\n")
    else:
        print(f"One 512-bit VPDPBUSD: {peak:.3f} ns, so a row of a 16 x 32 panel block costs at least "
              f"{floor:.2f} ns.\n")
    print("| type | " + " | ".join(f"M={m}: ns per block and row" for m in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for type_name in args.types:
        weight, tiny = random_weight(type_name, n, k, seed=0), random_weight(type_name, 16, 256, seed=1)
        cells = []
        for m in args.rows:
            # less the fixed cost of a call (Python, ctypes, rounding the rows), from a weight of 8 blocks
            fixed = seconds_per_call(torch.randn(m, 256), tiny) * (1 - 8 / panel_blocks)
            per_row = (seconds_per_call(torch.randn(m, k), weight) - fixed) * 1e9 / panel_blocks / m
            cells.append(f"{per_row:.2f}" + ("" if floor is None else f" ({floor / per_row:.0%} of peak)"))
        print(f"| {type_name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
