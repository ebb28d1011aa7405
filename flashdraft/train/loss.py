"""The training loss of a draft: weighted block cross-entropy through the target's frozen output head, in chunks.

Block position k (1..B-1) is weighted exp(-(k-1)/gamma): a round stops accepting at its first miss, so early
positions matter most (gamma about 7 for B=16 and 4 for B=8, as published).

The head is frozen and the vocabulary can be large: the logits of 4096 block positions at a 150k vocabulary would
take 2.4 GB. `head_cross_entropy` walks the positions in chunks and, since only the hidden states need a gradient,
computes that gradient chunk by chunk in the same pass: memory stays at [chunk, V], and the head's matmul runs
twice per position (logits, input gradient) instead of three times with activation checkpointing.

Reduced drafting vocabulary (`DraftVocabulary`): the draft proposes from the N tokens most frequent among the
target's outputs (the training labels); the loss is a softmax over those N rows of the head. A position whose
label lies outside them is left out of the loss (weight 0): no proposal from the reduced vocabulary can be
accepted there, so it says nothing about which in-vocabulary token to rank first. Accuracy counts such positions
as misses, so it stays an estimate of acceptance.

Distillation: the target distribution of a position is (1 - w) * one-hot(label) + w * p_topk, with p_topk the
target's stored top-k probabilities renormalised over the ids the draft can propose. w = 0 is plain
cross-entropy; w = 1 is top-k distillation: cross-entropy to p_topk, which is KL(p_topk || q) plus the entropy of
p_topk (a constant for the draft).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .blocks import IGNORE, BlockBatch, TrainingSequence

DEFAULT_CHUNK = 1024  # positions per pass through the head: [chunk, V] float32 logits, 200 MB at V = 49k


# The least weight a block position gets under acceptance weights (relative to the largest): enough that a position
# still learns while the ones before it are rarely accepted.
ACCEPTANCE_WEIGHT_FLOOR = 0.05


def default_gamma(block_size: int) -> float:
    """The position-weight decay: the line through the published (B=8, 4) and (B=16, 7)."""
    return 4.0 + 3.0 * (block_size - 8) / 8


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B-1] weights exp(-(k-1)/gamma) of block positions k = 1..B-1."""
    if gamma <= 0:
        raise ValueError(f"gamma must be positive, got {gamma}")
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def acceptance_weights(accuracy: Sequence[float], floor: float = ACCEPTANCE_WEIGHT_FLOOR) -> torch.Tensor:
    """[B-1] weights of block positions k = 1..B-1 in proportion to what each adds to the expected accepted length.

    With per-position accuracies a_k, a round accepts E = a_1 + a_1 a_2 + a_1 a_2 a_3 + ... tokens (taking the
    positions as independent), so dE/da_k = (a_1 ... a_{k-1}) (1 + a_{k+1} + a_{k+1} a_{k+2} + ...): a position
    is worth training only as far as the ones before it are accepted. Scaled to a largest weight of 1 and floored
    at `floor`, so the later positions keep learning until the earlier ones reach them."""
    a = torch.as_tensor(accuracy, dtype=torch.float64).clamp(0.0, 1.0)
    if a.ndim != 1 or a.numel() == 0:
        raise ValueError(f"acceptance weights need one accuracy per block position, got shape {tuple(a.shape)}")
    before = torch.cumprod(torch.cat([a.new_ones(1), a[:-1]]), dim=0)  # a_1 ... a_{k-1}
    after = torch.ones_like(a)  # 1 + a_{k+1} + a_{k+1} a_{k+2} + ...
    for k in range(a.numel() - 2, -1, -1):
        after[k] = 1.0 + a[k + 1] * after[k + 1]
    weights = before * after
    return (weights / weights.max()).clamp(min=floor).float()


@dataclass
class DraftVocabulary:
    """The target token ids a draft proposes from, and the map from full ids to rows of the reduced head."""

    ids: torch.Tensor  # [N] sorted target token ids
    full_to_draft: torch.Tensor  # [V] index into `ids`, -1 for tokens outside

    @classmethod
    def from_ids(cls, ids: torch.Tensor | Sequence[int], vocab_size: int) -> DraftVocabulary:
        ids = torch.as_tensor(ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise ValueError(
                f"draft vocabulary ids must be non-empty and within the target vocabulary [0, {vocab_size})"
            )
        full_to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
        full_to_draft[ids] = torch.arange(ids.numel())
        return cls(ids, full_to_draft)

    @classmethod
    def most_frequent(
        cls, sequences: Sequence[TrainingSequence], size: int, vocab_size: int
    ) -> tuple[DraftVocabulary, float]:
        """The `size` tokens most frequent among the labels of `sequences` (ties: lower id first), and the share of
        labels they cover."""
        counts = label_counts(sequences, vocab_size)
        vocabulary = cls.from_counts(counts, size)
        return vocabulary, vocabulary.coverage(counts)

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int) -> DraftVocabulary:
        """The `size` most counted tokens of `counts` ([V] per target token; ties: lower id first)."""
        vocab_size = counts.numel()
        if not 0 < size <= vocab_size:
            raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}] (the target vocabulary), got {size}")
        order = torch.sort(-counts, stable=True).indices
        return cls.from_ids(order[:size], vocab_size)

    def coverage(self, counts: torch.Tensor) -> float:
        """Share of the counted tokens that the vocabulary contains."""
        total = int(counts.sum())
        return float(counts[self.ids].sum()) / total if total else 0.0

    def __len__(self) -> int:
        return self.ids.numel()


def label_counts(sequences: Sequence[TrainingSequence], vocab_size: int) -> torch.Tensor:
    """[V] how often each token is a training label."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sequence in sequences:
        labels = sequence.labels[sequence.labels != IGNORE]
        counts += torch.bincount(labels, minlength=vocab_size)
    return counts


@dataclass
class BlockTargets:
    """What each labelled block position should predict, flattened over the batch's [b, n, B-1] positions."""

    rows: torch.Tensor  # [N] index of each labelled position in the flattened [b * n * (B-1)]
    labels: torch.Tensor  # [N] full-vocabulary label
    offsets: torch.Tensor  # [N] k - 1, the block position minus one
    target_ids: torch.Tensor  # [N, m] rows of the (reduced) head
    target_probs: torch.Tensor  # [N, m] their probabilities; each row sums to 1, or to 0 when unusable
    weights: torch.Tensor  # [N] exp(-(k-1)/gamma), 0 where nothing can be learned

    @property
    def weight_sum(self) -> float:
        return float(self.weights.sum())


def block_targets(
    batch: BlockBatch,
    weights_by_position: torch.Tensor,
    vocabulary: DraftVocabulary | None = None,
    distill_weight: float = 0.0,
) -> BlockTargets:
    """The training targets of a batch (see the module doc): needs no model, so a trainer can sum the weights of a
    whole step (all micro-batches, all processes) before the first forward."""
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distillation weight must be in [0, 1], got {distill_weight}")
    labels = batch.labels.reshape(-1)
    rows = (labels != IGNORE).nonzero().squeeze(1)
    labels = labels[rows]
    offsets = rows % (batch.block_size - 1)
    ids, probs = labels[:, None], torch.ones(len(rows), 1)
    if distill_weight > 0:
        if batch.topk_ids is None:
            raise ValueError(
                "distillation needs the target's top-k probabilities: make the records with --store-top-k > 0"
            )
        top_ids = batch.topk_ids.reshape(-1, batch.topk_ids.shape[-1])[rows]
        top_probs = batch.topk_probs.reshape(-1, batch.topk_probs.shape[-1])[rows]
        if vocabulary is not None:  # renormalise over the ids the draft can propose
            top_probs = top_probs * (vocabulary.full_to_draft[top_ids] >= 0)
        top_probs = top_probs / top_probs.sum(1, keepdim=True).clamp_min(1e-12)
        ids = torch.cat([ids, top_ids], dim=1)
        probs = torch.cat([probs * (1 - distill_weight), top_probs * distill_weight], dim=1)
    if vocabulary is not None:
        mapped = vocabulary.full_to_draft[ids]
        probs = probs * (mapped >= 0)
        probs = probs / probs.sum(1, keepdim=True).clamp_min(1e-12)
        ids = mapped.clamp_min(0)
    usable = probs.sum(1) > 0.5  # rows are 1 or 0 after renormalising
    return BlockTargets(
        rows=rows,
        labels=labels,
        offsets=offsets,
        target_ids=ids,
        target_probs=probs,
        weights=weights_by_position[offsets] * usable,
    )


class _HeadCrossEntropy(torch.autograd.Function):
    """Per-position cross-entropy to a sparse target distribution through a frozen head, chunked.

    The gradient with respect to the hidden states is computed in the forward pass (softmax minus target, times
    the head), so no [N, V] tensor is ever kept."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, target_probs, chunk_size):
        losses = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        predicted = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        gradient = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, hidden.shape[0], chunk_size):
            chunk = slice(start, start + chunk_size)
            logits = (hidden[chunk] @ weight.T).float()  # [c, V]
            if bias is not None:
                logits += bias.float()
            predicted[chunk] = logits.argmax(dim=-1)
            log_normalizer = logits.logsumexp(dim=-1, keepdim=True)  # [c, 1]
            ids, probs = target_ids[chunk], target_probs[chunk]  # [c, m]
            losses[chunk] = -(probs * (logits.gather(1, ids) - log_normalizer)).sum(1)
            if gradient is not None:
                softmax = logits.sub_(log_normalizer).exp_()  # in place: the logits are no longer needed
                softmax.mul_(probs.sum(1, keepdim=True)).scatter_add_(1, ids, -probs)  # d loss / d logits
                gradient[chunk] = (softmax.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(gradient)
        ctx.mark_non_differentiable(predicted)
        return losses, predicted

    @staticmethod
    def backward(ctx, grad_losses, grad_predicted):
        (gradient,) = ctx.saved_tensors
        return grad_losses[:, None].to(gradient.dtype) * gradient, None, None, None, None, None


def head_cross_entropy(
    hidden: torch.Tensor,  # [N, d]
    weight: torch.Tensor,  # [V, d] frozen head rows
    bias: torch.Tensor | None,  # [V] or None
    target_ids: torch.Tensor,  # [N, m] rows of `weight`
    target_probs: torch.Tensor,  # [N, m]
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses [N] = -sum_j p_j log softmax(hidden @ weight.T + bias)[ids_j], argmax row [N]), in chunks."""
    target_probs = target_probs.to(device=hidden.device, dtype=torch.float32)
    return _HeadCrossEntropy.apply(hidden, weight, bias, target_ids.to(hidden.device), target_probs, chunk_size)


@dataclass
class LossOutput:
    """The summed (not yet normalised) weighted loss of a batch, and its per-position counts."""

    loss: torch.Tensor  # sum of weight * cross-entropy, differentiable
    correct: torch.Tensor  # [B-1] block positions whose argmax equals the label
    counted: torch.Tensor  # [B-1] labelled block positions


def block_loss(
    hidden: torch.Tensor,  # [b, n*B, d] draft output for the blocks of `batch`
    targets: BlockTargets,
    head_weight: torch.Tensor,  # [V or N, d] the (reduced) frozen head
    head_bias: torch.Tensor | None,
    vocabulary: DraftVocabulary | None,
    block_size: int,
    chunk_size: int = DEFAULT_CHUNK,
) -> LossOutput:
    """Weighted cross-entropy of block positions 1..B-1 (the anchor's output is dropped, as in decoding)."""
    batch, width, dim = hidden.shape
    predicting = hidden.view(batch, width // block_size, block_size, dim)[:, :, 1:].reshape(-1, dim)
    device = hidden.device
    labelled = predicting[targets.rows.to(device)]  # [N, d]
    losses, predicted = head_cross_entropy(
        labelled, head_weight, head_bias, targets.target_ids, targets.target_probs, chunk_size
    )
    if vocabulary is not None:
        predicted = vocabulary.ids.to(device)[predicted]
    hits = (predicted == targets.labels.to(device)).long()
    offsets = targets.offsets.to(device)
    return LossOutput(
        loss=(losses * targets.weights.to(device)).sum(),
        correct=torch.zeros(block_size - 1, dtype=torch.long, device=device).index_add_(0, offsets, hits).cpu(),
        counted=torch.bincount(offsets, minlength=block_size - 1).cpu(),
    )
