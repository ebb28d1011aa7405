"""The int8 kernel against this CPU's own multiply-add peak: how close `block_gemm` comes to its instructions'
throughput when its weight sits in the caches, one thread.

    python benchmarks/bench_kernel_peak.py
    python benchmarks/bench_kernel_peak.py --rows 1 4 8 16 --types Q5_0 Q8_0

What it answers: whether a verification of M rows is bound by the kernel's code or by the machine. The peak is
measured, not looked up: a C loop of independent multiply-adds gives the time of one, a 512-bit `VPDPBUSD` (64 int8
multiply-adds) with AVX-512 VNNI, else a 256-bit `VPMADDUBSW` with the `VPADDW` that sums its pairs (32) with AVX2.
A panel block (16 weight rows x 32 columns, the kernel's unit) takes 8 `VPDPBUSD` a row, or 16 `VPMADDUBSW` (32 for
codes past 6 bits, Q8_0's, which AVX2 multiplies as two 4-bit halves), so that many times the instruction's time
is the floor of a row's cost per block whatever the code; the table gives each weight type's measured cost per
block and row and the share of the floor it reaches. Each time is less a call's fixed cost (Python, ctypes, rounding
the activations), measured on a weight of 8 blocks. Pause background work first: it times. Prints Markdown.
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
from flashdraft.quantized import FORMATS, BlockWeight, Codes, Format, FusedBlocks

PEAK_PROGRAM = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#if defined(__AVX512VNNI__)
#define CHAINS 12
typedef __m512i vector;
#define SET1(v) _mm512_set1_epi32(v)
#define LANE0(v) _mm512_reduce_add_epi32(v)
/* the sum is an input, so no turn's product can be hoisted out of the loop */
#define TURN() for (int i = 0; i < CHAINS; i++) sums[i] = _mm512_dpbusd_epi32(sums[i], codes, x)
#else
#define CHAINS 6
typedef __m256i vector;
#define SET1(v) _mm256_set1_epi32(v)
#define LANE0(v) _mm256_extract_epi16(v, 0)
/* written out: a compiler would compute the same product once for all the sums */
#define PAIR(T, S) "vpmaddubsw %[x], %[codes], %%" T "\n\t vpaddw %%" T ", %[" S "], %[" S "]\n\t"
#define TURN()                                                                                                    \
    __asm__ volatile(PAIR("ymm10", "s0") PAIR("ymm11", "s1") PAIR("ymm12", "s2") PAIR("ymm13", "s3")             \
                     PAIR("ymm14", "s4") PAIR("ymm15", "s5")                                                      \
                     : [s0] "+x"(sums[0]), [s1] "+x"(sums[1]), [s2] "+x"(sums[2]), [s3] "+x"(sums[3]),             \
                       [s4] "+x"(sums[4]), [s5] "+x"(sums[5])                                                     \
                     : [codes] "x"(codes), [x] "x"(x)                                                             \
                     : "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15")
#endif
int main(void) {
    vector sums[CHAINS], codes = SET1(0x01020304), x = SET1(0x05060708);
    for (int i = 0; i < CHAINS; i++) sums[i] = SET1(i);
    const long turns = 50000000;
    double best = 1e9;
    for (int repeat = 0; repeat < 3; repeat++) {
        struct timespec start, end;
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (long n = 0; n < turns; n++) TURN();
        clock_gettime(CLOCK_MONOTONIC, &end);
        const double seconds = (end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) * 1e-9;
        if (seconds < best) best = seconds;
    }
    int total = 0;
    for (int i = 0; i < CHAINS; i++) total += LANE0(sums[i]);
    printf("%.6f %d\n", best / (turns * (double)CHAINS) * 1e9, total & 1);
    return 0;
}
"""


def peak_nanoseconds() -> float | None:
    """The time of one multiply-add instruction when nothing waits on it (independent sums): a 512-bit VPDPBUSD, or
    a 256-bit VPMADDUBSW and its VPADDW without AVX-512 VNNI; None where neither builds."""
    with tempfile.TemporaryDirectory() as folder:
        source, program = Path(folder) / "peak.c", Path(folder) / "peak"
        source.write_text(PEAK_PROGRAM)
        built = subprocess.run(["cc", "-O3", "-funroll-loops", "-march=native", "-o", str(program), str(source)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return None
        return float(subprocess.run([str(program)], capture_output=True, text=True, check=True).stdout.split()[0])


def instructions_per_block(version: str, fmt: Format) -> int | None:
    """Multiply-add instructions a row of a 16 x 32 panel block takes at the least, for the kernel `version`."""
    if "avx512-vnni" in version:
        return 8
    if version == "avx2":  # codes past 6 bits go in two 4-bit halves
        return 32 if fmt.code_limit > 63 else 16
    return None


def random_weight(type_name: str, rows: int, cols: int, seed: int) -> FusedBlocks:
    """A weight of `type_name`'s layout with random codes and modest random scales (and minimums)."""
    fmt = FORMATS[type_name]
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, fmt.code_limit + 1, (rows, cols), dtype=np.uint8)
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
    version = quantized.kernel_version()
    peak = peak_nanoseconds() if instructions_per_block(version, FORMATS["Q8_0"]) else None
    instruction = "512-bit VPDPBUSD" if "avx512-vnni" in version else "256-bit VPMADDUBSW + VPADDW"
    print(f"## The int8 kernel in the caches, one thread ({version}, weight {n} x {k})\n")
    if peak is None:
        print("No AVX-512 VNNI or AVX2 here: the kernel's times alone.\n")
    else:
        print(f"One {instruction}: {peak:.3f} ns, so a row of a 16 x 32 panel block costs at least "
              + ", ".join(f"{instructions_per_block(version, FORMATS[t]) * peak:.2f} ns ({t})" for t in args.types)
              + ".\n")
    print("| type | " + " | ".join(f"M={m}: ns per block and row" for m in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for type_name in args.types:
        weight, tiny = random_weight(type_name, n, k, seed=0), random_weight(type_name, 16, 256, seed=1)
        floor = None if peak is None else instructions_per_block(version, FORMATS[type_name]) * peak
        cells = []
        for m in args.rows:
            # less the fixed cost of a call (Python, ctypes, rounding the rows), from a weight of 8 blocks
            fixed = seconds_per_call(torch.randn(m, 256), tiny) * (1 - 8 / panel_blocks)
            per_row = (seconds_per_call(torch.randn(m, k), weight) - fixed) * 1e9 / panel_blocks / m
            cells.append(f"{per_row:.2f}" + ("" if floor is None else f" ({floor / per_row:.0%} of peak)"))
        print(f"| {type_name} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
