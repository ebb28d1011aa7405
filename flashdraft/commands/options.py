"""The options every command that loads models shares: where the models run and in which precision.

One definition and one default for all: `--device auto` runs on the GPU when torch sees one, else on the CPU;
`--dtype auto` is bfloat16 on a GPU and float32 on a CPU (bfloat16 is several times slower than float32 on a CPU).
`flashdraft.cli.check_device` validates an explicit device before any model loads.
"""

from __future__ import annotations

import argparse

from flashdraft.rules import parse_block_size, resolve_dtype

DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("auto", "flashdraft", "transformers")  # flashdraft.target.ENGINES, without loading torch for --help


def add_device_options(parser, engine: bool = True) -> None:
    """--device and --dtype (and --engine, unless `engine` is False), on a parser or an argument group."""
    parser.add_argument("--device", default="auto",
                        help="torch device, e.g. cpu, cuda, cuda:1 (default: auto = cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="model weights' dtype (default: auto = bfloat16 on CUDA, float32 on CPU)")
    if engine:
        parser.add_argument("--engine", choices=ENGINES, default="auto",
                            help="the target's forward: auto (default) = flashdraft's exact CPU engine where it "
                            "runs (Llama, Qwen2, Qwen3 in float32 on CPU), else transformers'; flashdraft = the engine "
                            "or an error saying why not; transformers = always transformers' forward")


def block_size(text: str) -> int | str:
    """`--block-size`: "auto" (chosen round by round) or an integer >= 1 (1 = no speculation)."""
    try:
        return parse_block_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer >= 1 (1 = no speculation) nor auto") from None


def add_block_size_option(parser) -> None:
    parser.add_argument("--block-size", type=block_size, default="auto",
                        help="tokens verified per round, anchor included: an integer >= 1 (1 = no speculation) or auto "
                        "(default: auto = chosen round by round for the most tokens per second, never above the "
                        "draft's own block size; the context lookup's rounds up to 16)")


def add_proposals_option(parser) -> None:
    # No `choices`: the library's check (`flashdraft.decoding.check_proposals`) is the one list, run before any model
    # loads; importing it here would load torch for `--help`.
    parser.add_argument("--proposals", default=None, metavar="{hybrid,dflash,lookup}",
                        help="what each round verifies: hybrid (the default with a draft) = the draft's block or the "
                        "continuation of the context's latest match of its last tokens or both, whichever is "
                        "expected to be faster, round by round; dflash = the draft alone; lookup = the context alone, "
                        "no draft loaded")


def device_and_dtype(args: argparse.Namespace):
    """The torch device and dtype the options name, `auto` resolved."""
    import torch

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    return device, resolve_dtype(args.dtype, device.type)
