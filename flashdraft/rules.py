"""The rules several layers must agree on, each written once: tau (the mean acceptance length), what a block size
may be, and which dtype "auto" stands for.

Pure Python (torch is imported only to name a dtype), so that the command line checks its arguments with the same
rules before torch loads, and the decoding loop, the trainer, the benchmark and the draft's config check use them
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence


def tau(acceptance_lengths: Sequence[int]) -> float:
    """Mean acceptance length (tokens per target verification: accepted proposals + the bonus token); 0.0 when
    there were no rounds."""
    return sum(acceptance_lengths) / len(acceptance_lengths) if acceptance_lengths else 0.0


def check_block_size(value, *, minimum: int = 1, maximum: int | None = None, what: str = "block_size",
                     hint: str = "") -> None:
    """Raise a ValueError unless `value` is an integer (not a bool) in [minimum, maximum]. `what` names the setting
    in the message, `hint` says why the bound is there or what else is accepted. The callers' bounds: 1 to decode
    (1 = no speculation), 2 to train or to benchmark a draft (one position after the anchor), at most the draft
    config's MAX_BLOCK_SIZE."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum and (
            maximum is None or value <= maximum):
        return
    bound = f"in {minimum}..{maximum}" if maximum is not None else f"an integer >= {minimum}"
    raise ValueError(f"{what} must be {bound}, got {value!r}{hint}")


def parse_block_size(text: str) -> int | str:
    """A block size written as text (a command-line option): "auto", or an integer >= 1."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = text
    check_block_size(value)
    return value


# What a decoding round verifies besides the target's own token (`flashdraft.proposals`): the draft's block or the
# context's lookup, whichever pays (hybrid), the draft alone, or the lookup alone.
PROPOSAL_MODES = ("hybrid", "dflash", "lookup")


def auto_dtype(device_type: str) -> str:
    """The dtype "auto" stands for: bfloat16 on a GPU, float32 elsewhere (bfloat16 is several times slower than
    float32 on a CPU)."""
    return "bfloat16" if device_type == "cuda" else "float32"


def resolve_dtype(name: str, device_type: str):
    """The torch dtype of `name` ("auto" resolved for `device_type`)."""
    import torch

    return getattr(torch, auto_dtype(device_type) if name == "auto" else name)
