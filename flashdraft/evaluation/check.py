"""A draft's acceptance check: does it still accept what its model card says it does?

A draft whose weights are damaged but finite (a flipped exponent, a wrong file) loads without complaint and runs at
tau 1.00: lossless, only slower, and silently so. Its folder may carry `CHECK_FILE`, the tau it reached when it was
shipped on three fixed code prompts at its own block size (what `record_check` writes); where the target and the
draft meet, `check_draft` measures the same once per machine (cached under $FLASHDRAFT_HOME/checks) and warns in
one line when the draft keeps less than half of the tokens it accepted then.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from ..decoding import generate
from ..files import cache_home, file_sha256, shape_key, write_atomic
from ..target import TargetModel
from ..text import encode_chat, stop_token_ids

CHECK_FILE = "acceptance-check.json"
CHECK_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that reverses the words of a sentence.",
)
CHECK_TOKENS = 48


def measure_check(target, tokenizer, draft) -> float:
    """The draft's mean tau on `CHECK_PROMPTS`, `CHECK_TOKENS` greedy tokens each, its own proposals alone at its
    own block size (the context lookup left out, so the figure is the draft's)."""
    stop = stop_token_ids(target, tokenizer)
    taus = []
    for prompt in CHECK_PROMPTS:
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt}])
        result = generate(target, draft, ids, max_new_tokens=CHECK_TOKENS, stop_token_ids=stop,
                          block_size=draft.block_size, proposals="dflash")
        taus.append(result.tau)
    return sum(taus) / len(taus)


def record_check(folder: Path, target, tokenizer, draft) -> float:
    """Measure the check and keep it in the draft's folder, as the figure later checks hold the draft to."""
    value = measure_check(target, tokenizer, draft)
    write_atomic(folder / CHECK_FILE, json.dumps({"tau": round(value, 4), "prompts": list(CHECK_PROMPTS),
                                                  "max_new_tokens": CHECK_TOKENS,
                                                  "block_size": draft.block_size}, indent=1) + "\n")
    return value


def falls_far_below(measured: float, recorded: float) -> bool:
    """Whether the draft keeps less than half the tokens beyond the bonus that it accepted when recorded."""
    return measured - 1.0 < 0.5 * (recorded - 1.0)


def check_draft(folder: Path | None, target, tokenizer, draft) -> str | None:
    """The warning for a draft that accepts far less than its folder's recorded check, else None (and None for a
    folder without a record). Measured once per draft, target shape and machine, then read from the cache."""
    if folder is None or not (Path(folder) / CHECK_FILE).is_file():
        return None
    folder = Path(folder)
    try:
        recorded = float(json.loads((folder / CHECK_FILE).read_text())["tau"])
    except (ValueError, KeyError, TypeError):
        return f"draft {folder}: {CHECK_FILE} is unreadable; its acceptance is not checked"
    engine = TargetModel(target).engine
    identity = json.dumps({"draft": sorted((p.name, file_sha256(p)) for p in folder.glob("*.safetensors")),
                           "target": shape_key(target.config), "recorded": recorded,
                           "arithmetic": engine.arithmetic if engine is not None else None}, sort_keys=True)
    cached = cache_home() / "checks" / f"{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"
    try:
        measured = float(json.loads(cached.read_text())["tau"])
    except (OSError, ValueError, KeyError):
        measured = measure_check(target, tokenizer, draft)
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cached, json.dumps({"tau": measured}) + "\n")
    if falls_far_below(measured, recorded):
        return (f"warning: draft {folder} accepts far less than when it was shipped (tau {measured:.2f} on its "
                f"acceptance check, {recorded:.2f} recorded in {CHECK_FILE}): its weights may be damaged, or it was "
                "trained for another target. The output stays the target's own, only slower")
    return None


def warn_if_weak(folder: Path | None, target, tokenizer, draft) -> None:
    """`check_draft`'s warning, if any, on stderr in one line."""
    warning = check_draft(folder, target, tokenizer, draft)
    if warning is not None:
        print(warning, file=sys.stderr)
