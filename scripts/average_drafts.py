"""Average the weights of drafts continued from one another (`flashdraft.train.averaging`) into a draft folder.

    python scripts/average_drafts.py OUT --like /root/fd-runs/v14 \
        flashdraft/drafts/smollm2-135m-instruct /root/fd-runs/v14 RUN/checkpoints/step-00000900.pt

`--like` gives the config and buffers (the drafting vocabulary) of the result; it is one of the averaged drafts only
when listed among them. The folder is in float32: ship it with `scripts/ship_draft.py`, then measure the shipped
folder (`flashdraft bench --replay --draft FOLDER ...`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashdraft.draft import DFlashDraftModel
from flashdraft.train.averaging import average_drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="folder to write the averaged draft to")
    parser.add_argument("sources", type=Path, nargs="+", help="draft folders or trainer checkpoints (step-*.pt)")
    parser.add_argument("--like", type=Path, required=True,
                        help="draft folder whose config and drafting vocabulary the result keeps")
    args = parser.parse_args()
    try:
        draft = average_drafts(DFlashDraftModel.from_pretrained(args.like, dtype=torch.float32), args.sources)
    except (ValueError, OSError) as error:
        raise SystemExit(f"average_drafts: {error}") from None
    draft.save_pretrained(args.output)
    print(f"averaged {len(args.sources)} drafts into {args.output} (config and vocabulary of {args.like})")


if __name__ == "__main__":
    main()
