"""Write a trained draft folder as the shipped draft: weights in bfloat16 (half the bytes; `load_draft` loads them
into float32 on a CPU), the model card and `training.json` copied as they are.

    python scripts/ship_draft.py /root/fd-runs/ship-v3 flashdraft/drafts/smollm2-135m-instruct

Measure the written folder, not the source: rounding to bfloat16 moves the logits a little, so acceptance can move
by a hair (`flashdraft bench --replay --draft FOLDER ...`).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from flashdraft.draft import DFlashDraftModel

CARRIED = ("README.md", "training.json")


def ship(source: Path, destination: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    draft = DFlashDraftModel.from_pretrained(source, dtype=torch.float32)
    if destination.resolve() == source.resolve():
        raise ValueError(f"{destination} is the source folder: write the shipped draft elsewhere")
    destination.mkdir(parents=True, exist_ok=True)
    for stale in destination.glob("*.safetensors"):
        stale.unlink()  # a folder holds one draft: no shard of the previous one stays beside the new weights
    draft.to(dtype).save_pretrained(destination)
    for name in CARRIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)
    return destination


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="trained draft folder (flashdraft train's --output)")
    parser.add_argument("destination", type=Path, help="folder to write, e.g. flashdraft/drafts/TARGET")
    args = parser.parse_args()
    folder = ship(args.source, args.destination)
    size = sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    print(f"shipped {args.source} to {folder} in bfloat16: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
