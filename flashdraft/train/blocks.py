"""Training sequences, random anchors, and the block-sparse attention mask of one forward over many blocks.

A training sequence of L tokens opens n blocks at random anchor positions a_1 < ... < a_n inside its response.
Block j is [token a_j, mask, ..., mask] (B tokens) at positions a_j .. a_j+B-1: exactly the block the decoding
loop drafts when a_j is the last verified token. Its queries see the target features of the positions strictly
before a_j and the B positions of block j (bidirectionally), nothing else: not the anchor's own features, not
the other blocks. Block position k (1..B-1) learns the target's token at a_j + k. All blocks of a batch go
through the draft in one forward, keys laid out as

    [context 0 .. C-1 ; block 1 ; block 2 ; ... ; block n]          (C = the largest anchor of the batch)
    query of block j may see: context position p  iff  p < a_j;  block key  iff  it belongs to block j

and position ids [0 .. C-1 ; a_1 .. a_1+B-1 ; ... ; a_n .. a_n+B-1], so RoPE places every key and query where
the decoding loop puts it. Context positions at or after C are visible to no block and are never computed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..rules import check_block_size
from .records import TrainingRecord

IGNORE = -100  # label of a block position with nothing to learn (before the response, after the sequence end)


@dataclass
class TrainingSequence:
    """One training record as tensors, truncated to the training length.

    `labels[p]` is the target's token at position p (its own token for regenerated responses, its greedy prediction
    under teacher forcing), IGNORE before the response. `topk_ids/topk_probs[p]` are the target's top-k at p
    (distillation), zeros before the response."""

    id: str
    source: str
    input_ids: torch.Tensor  # [L] long
    response_start: int
    labels: torch.Tensor  # [L] long
    topk_ids: torch.Tensor | None = None  # [L, K] int32
    topk_probs: torch.Tensor | None = None  # [L, K] float16

    @classmethod
    def from_record(cls, record: TrainingRecord, max_length: int) -> TrainingSequence:
        length = min(len(record.input_ids), max_length)
        start = record.response_start
        labels = torch.full((length,), IGNORE, dtype=torch.long)
        response_labels = record.response_labels[: max(length - start, 0)]
        labels[start : start + len(response_labels)] = torch.tensor(response_labels, dtype=torch.long)
        topk_ids = topk_probs = None
        if record.topk_ids is not None:
            top_ids = record.topk_ids[: max(length - start, 0)]
            k = len(record.topk_ids[0]) if record.topk_ids else 1
            topk_ids = torch.zeros(length, k, dtype=torch.int32)
            topk_probs = torch.zeros(length, k, dtype=torch.float16)
            if top_ids:
                topk_ids[start : start + len(top_ids)] = torch.tensor(top_ids, dtype=torch.int32)
                topk_probs[start : start + len(top_ids)] = torch.tensor(
                    record.topk_probs[: len(top_ids)], dtype=torch.float16
                )
        return cls(
            id=record.id,
            source=record.source,
            input_ids=torch.tensor(record.input_ids[:length], dtype=torch.long),
            response_start=start,
            labels=labels,
            topk_ids=topk_ids,
            topk_probs=topk_probs,
        )

    def __len__(self) -> int:
        return self.input_ids.numel()

    @property
    def anchor_positions(self) -> range:
        """Where a block can open: on a response token (the decoding loop's first anchor is the first response
        token) with at least one position after it to learn."""
        return range(self.response_start, len(self) - 1)


def check_training_block_size(block_size: int) -> None:
    """A block trains positions 1..B-1 after its anchor: B must leave at least one."""
    check_block_size(block_size, minimum=2, what="a training block size", hint=" (one position to learn)")


def sample_anchors(sequence: TrainingSequence, num_anchors: int, seed: int, epoch: int) -> list[int]:
    """`num_anchors` distinct anchor positions (all of them when the response has fewer), sorted.

    Seeded by (seed, epoch, sequence id) alone, so each epoch draws new anchors while any process, and a resumed
    run, draws the same ones for the same sequence."""
    positions = sequence.anchor_positions
    rng = random.Random(f"{seed}:{epoch}:{sequence.id}")  # string seeds are hashed stably (SHA-512)
    return sorted(rng.sample(positions, min(num_anchors, len(positions))))


@dataclass
class BlockBatch:
    """The draft inputs and the labels of a batch of blocks (b sequences, n blocks each, block size B)."""

    block_ids: torch.Tensor  # [b, n*B] anchor token then B-1 mask tokens, per block
    position_ids: torch.Tensor  # [b, C + n*B] context positions 0..C-1, then each block's positions
    attention_mask: torch.Tensor  # bool [b, 1, n*B, C + n*B], True = visible
    anchors: torch.Tensor  # [b, n] long; 0 for padding blocks
    valid: torch.Tensor  # [b, n] bool: False for the padding blocks of sequences with fewer anchors
    labels: torch.Tensor  # [b, n, B-1] target token at anchor + k, IGNORE where there is none
    topk_ids: torch.Tensor | None  # [b, n, B-1, K] long
    topk_probs: torch.Tensor | None  # [b, n, B-1, K] float32

    @property
    def context_length(self) -> int:
        return self.position_ids.shape[1] - self.block_ids.shape[1]

    @property
    def block_size(self) -> int:
        return self.labels.shape[-1] + 1


def block_attention_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """bool [b, 1, n*B, C + n*B]: a query of block j sees context positions < anchors[:, j] and block j only."""
    batch, num_blocks = anchors.shape
    context = torch.arange(context_length, device=anchors.device)
    sees_context = context[None, None, :] < anchors[:, :, None]  # [b, n, C]
    sees_context = sees_context.repeat_interleave(block_size, dim=1)  # [b, n*B, C]
    block_of = torch.arange(num_blocks, device=anchors.device).repeat_interleave(block_size)  # [n*B]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # [b, n*B, n*B]
    return torch.cat([sees_context, sees_block], dim=2)[:, None]


def make_blocks(
    sequences: Sequence[TrainingSequence], anchors: Sequence[Sequence[int]], block_size: int, mask_token_id: int
) -> BlockBatch:
    """Lay out the blocks of `sequences` opened at `anchors` (one sorted list per sequence) for one forward."""
    check_training_block_size(block_size)
    batch, num_blocks = len(sequences), max(len(a) for a in anchors)
    if num_blocks == 0:
        raise ValueError("no block to train: every sequence of the batch has a response shorter than 2 tokens")
    anchor_tensor = torch.zeros(batch, num_blocks, dtype=torch.long)
    valid = torch.zeros(batch, num_blocks, dtype=torch.bool)
    for row, row_anchors in enumerate(anchors):
        anchor_tensor[row, : len(row_anchors)] = torch.tensor(row_anchors, dtype=torch.long)
        valid[row, : len(row_anchors)] = True
    context_length = int(anchor_tensor.max())
    offsets = torch.arange(block_size)
    block_positions = anchor_tensor[:, :, None] + offsets  # [b, n, B]

    # Gather per-position labels (and top-k) from each sequence, padded past its end with IGNORE.
    width = max(len(s) for s in sequences) + block_size
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    labels = torch.full((batch, width), IGNORE, dtype=torch.long)
    with_topk = all(s.topk_ids is not None for s in sequences)
    if with_topk:
        k = sequences[0].topk_ids.shape[1]
        topk_ids = torch.zeros(batch, width, k, dtype=torch.long)
        topk_probs = torch.zeros(batch, width, k, dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = sequence.input_ids
        labels[row, : len(sequence)] = sequence.labels
        if with_topk:
            topk_ids[row, : len(sequence)] = sequence.topk_ids.long()
            topk_probs[row, : len(sequence)] = sequence.topk_probs.float()
    rows = torch.arange(batch)[:, None, None]
    predicted = block_positions[:, :, 1:]  # [b, n, B-1] the positions block positions 1..B-1 learn
    block_labels = torch.where(valid[:, :, None], labels[rows, predicted], IGNORE)

    block_ids = torch.full((batch, num_blocks, block_size), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = input_ids.gather(1, anchor_tensor)
    context_positions = torch.arange(context_length).expand(batch, -1)
    return BlockBatch(
        block_ids=block_ids.view(batch, -1),
        position_ids=torch.cat([context_positions, block_positions.view(batch, -1)], dim=1),
        attention_mask=block_attention_mask(anchor_tensor, context_length, block_size),
        anchors=anchor_tensor,
        valid=valid,
        labels=block_labels,
        topk_ids=topk_ids[rows, predicted] if with_topk else None,
        topk_probs=topk_probs[rows, predicted] if with_topk else None,
    )
