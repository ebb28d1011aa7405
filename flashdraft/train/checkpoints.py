"""Trainer checkpoints on disk: written atomically with a checksum file beside each, read back without unpickling
objects (`weights_only=True`) and refused, with the reason, when truncated, changed or holding non-finite values.

A checkpoint holds the draft, optimizer, scheduler, RNG states, the step, the evaluation history and the run's
fingerprint; `Trainer` (trainer.py) decides when to write one and how to resume from the newest intact one.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from pathlib import Path

import torch

from ..files import file_sha256, write_atomic

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_FORMAT = 2  # 2: read with weights_only=True, checksum beside it (1, pickled objects, is refused)
CHECKPOINT_KEYS = {"draft", "optimizer", "scheduler", "step", "elapsed", "rng", "evaluations", "best", "fingerprint"}


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an infinity."""
    return [name for name, tensor in tensors.items()
            if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all()]


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be trusted; the message says why."""


def write_checkpoint(state: dict, folder: Path, step: int, keep: int) -> Path:
    """Write `state` as checkpoint `step` in `folder` atomically, with its checksum file, and keep the newest `keep`
    checkpoints. The checksum is of the bytes on disk, and goes in place first: a checkpoint always has its checksum
    file (a kill between the two renames leaves a checksum file alone, or a stale one that resume reports)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    temporary = path.with_suffix(".tmp")
    torch.save(state, temporary)
    record = {"format": CHECKPOINT_FORMAT, "step": step, "bytes": temporary.stat().st_size,
              "sha256": file_sha256(temporary)}
    write_atomic(checksum_path(path), json.dumps(record) + "\n")
    os.replace(temporary, path)
    for old in sorted(folder.glob("step-*.pt"))[: -keep]:
        old.unlink()
        checksum_path(old).unlink(missing_ok=True)
    return path


def checksum_path(checkpoint: Path) -> Path:
    return checkpoint.with_suffix(".json")


def checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.stem.split("-")[1])


def python_rng_state() -> list:
    # random.getstate() is (version, tuple of ints, gauss_next): kept as plain lists, which weights_only reads
    version, internal, gauss_next = random.getstate()
    return [version, list(internal), gauss_next]


def set_python_rng_state(state: list) -> None:
    version, internal, gauss_next = state
    random.setstate((version, tuple(internal), gauss_next))


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's state, after checking it against its checksum file and for non-finite values; raises
    `DamagedCheckpoint` saying what is wrong. Nothing is unpickled but tensors and plain values."""
    record_path = checksum_path(path)
    if not record_path.is_file():
        raise DamagedCheckpoint(f"it has no checksum file {record_path.name} (written by an older flashdraft, whose "
                                "checkpoints this one does not read)")
    try:
        record = json.loads(record_path.read_text())
        size = path.stat().st_size
    except (OSError, ValueError) as error:
        raise DamagedCheckpoint(f"it or its checksum file cannot be read ({error})") from None
    if not isinstance(record, dict):
        raise DamagedCheckpoint(f"its checksum file {record_path.name} holds no checksum")
    if size != record.get("bytes"):
        raise DamagedCheckpoint(f"it has {size} bytes where {record.get('bytes')} were written (truncated?)")
    if file_sha256(path) != record.get("sha256"):
        raise DamagedCheckpoint("its sha256 differs from the one recorded when it was written")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any failure to read it (zip, pickle, a refused object) means: do not use it
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DamagedCheckpoint(f"it cannot be read ({reason})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT or not CHECKPOINT_KEYS <= state.keys():
        raise DamagedCheckpoint(f"it is not a flashdraft checkpoint of format {CHECKPOINT_FORMAT}")
    moments = {f"optimizer {key} of parameter {index}": value
               for index, values in state["optimizer"]["state"].items() for key, value in values.items()}
    bad = non_finite(state["draft"]) + non_finite(moments)
    if bad:
        raise DamagedCheckpoint(f"it holds non-finite values ({', '.join(bad[:3])})")
    return state
