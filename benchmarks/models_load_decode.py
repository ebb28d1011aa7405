"""Sizes, load times and plain decode speed of the registry's target models on this machine.

    python benchmarks/models_load_decode.py smollm2-135m-instruct qwen2.5-coder-0.5b-instruct

For each model: the GGUF and converted-folder sizes; the first `prepare` (verify + dequantize + save, into a fresh
temporary cache unless --home is given); a later `load_target` from the prepared folder; and plain greedy decoding
through transformers' `generate` in float32, as milliseconds per new token (the time of N+1 new tokens minus the
time of 1, divided by N, so the prompt's prefill is left out). Prints a Markdown table, a row per model as it is done.

On a machine shared with other busy processes, run it with OMP_WAIT_POLICY=PASSIVE: by default OpenMP threads
spin while waiting, and spinning threads competing for the same cores made decoding here up to 15x slower.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.models import REGISTRY, load_target, prepare, prepared_folder

PROMPT = "Write a Python function that checks whether a number is prime."


def folder_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.iterdir() if file.is_file())


@torch.no_grad()
def decode_ms_per_token(model, tokenizer, new_tokens: int, repeats: int) -> float:
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]

    def seconds(count: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False)
        return time.perf_counter() - start

    seconds(2)  # warm-up
    best_long = min(seconds(new_tokens + 1) for _ in range(repeats))
    best_short = min(seconds(1) for _ in range(repeats))
    return (best_long - best_short) / new_tokens * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", choices=list(REGISTRY), metavar="NAME", help="registry models to measure")
    parser.add_argument(
        "--home",
        help="cache to prepare into and keep (default: a fresh temporary one, removed at the end); a model already "
        "prepared there shows no first-prepare time",
    )
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per timed generation")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per length (the best counts)")
    args = parser.parse_args()

    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="flashdraft-bench-home-"))
    os.environ["FLASHDRAFT_HOME"] = str(home)
    # This machine is shared: the load average says how much the figures below were slowed by other work.
    print(
        f"torch threads: {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
        f"load average at start: {os.getloadavg()[0]:.1f}, cache: {home}\n"
    )
    print("| model | GGUF | prepared folder (fp32) | first prepare | later load | plain decode, fp32 |")
    print("|---|---|---|---|---|---|", flush=True)
    try:
        for name in args.names:
            entry = REGISTRY[name]
            first = "-"
            if prepared_folder(name) is None:
                start = time.perf_counter()
                prepare(name)
                first = f"{time.perf_counter() - start:.0f} s"
            start = time.perf_counter()
            model, tokenizer = load_target(name)
            later = time.perf_counter() - start
            ms = decode_ms_per_token(model, tokenizer, args.new_tokens, args.repeats)
            print(
                f"| {name} | {entry.gguf_size / 1e6:.0f} MB | {folder_bytes(prepared_folder(name)) / 1e9:.2f} GB "
                f"| {first} | {later:.1f} s | {ms:.0f} ms ({1000 / ms:.1f} tok/s) |",
                flush=True,
            )
            del model
    finally:
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
