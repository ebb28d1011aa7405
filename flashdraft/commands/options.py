"""The options every command that loads models shares: where the models run and in which precision.

One definition and one default for all: `--device auto` runs on the GPU when torch sees one, else on the CPU;
`--dtype auto` is bfloat16 on a GPU and float32 on a CPU (bfloat16 is several times slower than float32 on a CPU).
`flashdraft.cli.check_device` validates an explicit device before any model loads.
"""

from __future__ import annotations

import argparse
import math
import sys

from flashdraft.rules import PROPOSAL_MODES, parse_block_size, resolve_dtype

DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("auto", "flashdraft", "transformers")  # flashdraft.target.ENGINES, without loading torch for --help
ARITHMETICS = ("auto", "float32", "int8")  # flashdraft.engine.ARITHMETICS, likewise


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
        parser.add_argument("--arithmetic", choices=ARITHMETICS, default="auto",
                            help="how the engine computes the target's products: auto (default) = int8 where the "
                            "target comes from a GGUF (the registry's: its own quantized blocks against activations "
                            "rounded to 8 bits, as llama.cpp computes), else float32; float32 = transformers' own "
                            "results; int8 = int8 or an error saying why not. Speculation never changes the output "
                            "of either")


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
    parser.add_argument("--proposals", default=None, choices=PROPOSAL_MODES,
                        help="what each round verifies: hybrid (the default with a draft) = the draft's block or the "
                        "continuation of the context's latest match of its last tokens or both, whichever is "
                        "expected to be faster, round by round; dflash = the draft alone; lookup = the context alone, "
                        "no draft loaded (also what runs, with a note, for a target no draft is shipped for)")


def temperature(text: str) -> float:
    """`--temperature`: a finite number >= 0 (0 = greedy). NaN and infinity are refused here, before any model
    loads: float() takes "nan" and "inf", and neither is a temperature."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a temperature: give a finite number >= 0 (0 = greedy)")
    return value


def top_p(text: str) -> float:
    """`--top-p`: a probability mass in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"{text!r} is not a nucleus mass: give a number in (0, 1] (1 = all tokens)")
    return value


def at_least(minimum: int):
    """An argparse type for integers >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in some messages
    return parse


def text_argument(what: str):
    """An argparse type for text that becomes tokens: valid UTF-8 (the shell hands Python undecodable bytes as lone
    surrogates, which the tokenizer would fail on deep inside, after the models load) and not blank."""

    def parse(text: str) -> str:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise argparse.ArgumentTypeError(
                f"the {what} is not valid UTF-8 text (undecodable bytes from character {error.start}): pass it in "
                "UTF-8 (convert it with e.g. `iconv -f latin1 -t utf-8`)") from None
        if not text.strip():
            raise argparse.ArgumentTypeError(f"the {what} is empty: give the text to answer")
        return text

    parse.__name__ = what
    return parse


def status(message: str) -> None:
    """One line on stderr saying what a command does while it waits (importing torch, loading models)."""
    print(message, file=sys.stderr, flush=True)


def device_and_dtype(args: argparse.Namespace):
    """The torch device and dtype the options name, `auto` resolved."""
    import torch

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    return device, resolve_dtype(args.dtype, device.type)


def how_to_get_a_draft(target_name: str) -> str:
    return (f"make one with `flashdraft train --target {target_name} -o DRAFT` (on the target's own answers: "
            "`flashdraft corpus`) and pass --draft DRAFT")


LOOKUP_INSTEAD = ("decoding with the context lookup alone (the output is the target's own; faster where the answer "
                  "repeats its context)")


def draft_or_lookup(
    draft: str | None, proposals: str | None, target_name: str, config, *, instead: str = LOOKUP_INSTEAD
) -> tuple[str | None, str | None]:
    """The draft a command loads and the proposals it runs, for a loaded target (`config`) and the `--draft` and
    `--proposals` given: the given draft, else the one shipped for the target (`flashdraft.models.shipped_draft`).
    Where none is shipped the command still runs, on the context lookup alone, and says so in one line (`instead`:
    what it runs) with how to get a draft; only `--proposals dflash`, which asks for the draft alone, is refused.
    (None, "lookup") then."""
    from flashdraft.models import shipped_draft

    if draft is not None or proposals == "lookup":
        return draft, proposals
    if (shipped := shipped_draft(target_name, config)) is not None:
        return str(shipped), proposals
    if proposals == "dflash":
        raise ValueError(f"--proposals dflash needs a draft, and none is shipped for {target_name}: "
                         f"{how_to_get_a_draft(target_name)}, or use --proposals lookup")
    status(f"No draft is shipped for {target_name}: {instead}. For a draft, {how_to_get_a_draft(target_name)}.")
    return None, "lookup"
