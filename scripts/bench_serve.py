"""Load benchmark of `flashdraft serve`, batched against the serial worker: `flashdraft bench-serve` (the logic lives
in `flashdraft.bench.serving`; see `flashdraft bench-serve --help`). Kept so earlier commands still run:

    python scripts/bench_serve.py --requests 32 --max-tokens 64 --concurrency 1 4 8 16 --max-batch-size 1 16
"""

import sys

from flashdraft.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-serve", *sys.argv[1:]]))
