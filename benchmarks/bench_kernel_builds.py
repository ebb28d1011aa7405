"""Two builds of the native kernels against each other on a registry target's int8 products, in one process: every
product of one forward (as `bench_block_gemm.py`), for M rows, each build in turn.

    cp -r flashdraft/csrc RUNS/csrc-before            # before changing the kernel
    python benchmarks/bench_kernel_builds.py RUNS/csrc-before flashdraft/csrc --target qwen2.5-coder-0.5b-instruct \
        --threads 2 --rows 1 2 4 8 16

What it answers: whether a change to `csrc/` makes the products faster, measured where it can be seen at all on a
shared machine (a step's time wanders by a fifth between processes here; within one, by a few per cent). Both
builds are compiled as `flashdraft.native` compiles the library, and must give the same bits on every row count
(checked first). The weight tables are the current `flashdraft.quantized`'s, so the two trees must agree on
`block_weight`. Pause background work first: it times. Prints Markdown.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402

from flashdraft.engine.kernels import interleaved_seconds  # noqa: E402
from flashdraft.models import load_target  # noqa: E402
from flashdraft.native.build import FLAGS, OPENMP_FLAG  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402


def build(sources: Path, folder: Path, name: str) -> ctypes.CDLL:
    """The kernels of `sources` (a csrc folder) compiled with the library's own flags and loaded."""
    library = folder / f"{name}.so"
    files = sorted(str(path) for path in sources.glob("*.c"))
    if not files:
        raise SystemExit(f"no C sources in {sources}")
    subprocess.run(["cc", *FLAGS, OPENMP_FLAG, "-o", str(library), *files], check=True)
    loaded = ctypes.CDLL(str(library))
    loaded.block_gemm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                  ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    loaded.block_gemm.restype = None
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="csrc folder of the first build")
    parser.add_argument("after", type=Path, help="csrc folder of the second build")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct", help="registry target (%(default)s)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16], help="M, rows a product")
    parser.add_argument("--threads", type=int, default=2, help="threads sharing each product's panels")
    parser.add_argument("--repeats", type=int, default=10, help="turns (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        libraries = {"before": build(args.before, Path(folder), "before"),
                     "after": build(args.after, Path(folder), "after")}
        model, _ = load_target(args.target, arithmetic="int8")
        weights = list(TargetModel(model).engine.blocks.values())
        inputs = {m: [torch.randn(m, weight.shape[1]) for weight in weights] for m in args.rows}
        outputs = {(name, m): [torch.empty(m, weight.shape[0]) for weight in weights]
                   for name in libraries for m in args.rows}

        def one_pass(name: str, m: int) -> None:
            for weight, x, y in zip(weights, inputs[m], outputs[(name, m)]):
                libraries[name].block_gemm(ctypes.addressof(weight.tables), len(weight.parts), x.data_ptr(), m,
                                           x.shape[1], y.data_ptr(), weight.shape[0], int(args.threads > 1), 0)

        for m in args.rows:  # the same bits both ways, before any timing
            one_pass("before", m)
            one_pass("after", m)
            if not all(torch.equal(a, b) for a, b in zip(outputs[("before", m)], outputs[("after", m)])):
                raise SystemExit(f"the two builds give different bits at {m} rows")
        seconds = interleaved_seconds({(name, m): (lambda name=name, m=m: one_pass(name, m))
                                       for name in libraries for m in args.rows}, args.repeats)
    print(f"## {args.target}: {len(weights)} products a forward, {args.threads} thread(s), least of {args.repeats} "
          "turns\n")
    print("| build | " + " | ".join(f"M={m}" for m in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for name in libraries:
        print(f"| {name} | " + " | ".join(f"{seconds[(name, m)] * 1e3:.1f} ms" for m in args.rows) + " |")
    print("| after / before | " + " | ".join(f"{seconds[('after', m)] / seconds[('before', m)]:.3f}"
                                             for m in args.rows) + " |")


if __name__ == "__main__":
    main()
