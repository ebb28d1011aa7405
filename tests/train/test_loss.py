"""The training loss: chunked head cross-entropy equals the plain one (values and gradients), position weights,
reduced drafting vocabulary, and top-k distillation targets."""

import math

import pytest
import torch
import torch.nn.functional as F

from flashdraft.train.blocks import IGNORE, TrainingSequence, make_blocks
from flashdraft.train.loss import (
    ACCEPTANCE_WEIGHT_FLOOR,
    DraftVocabulary,
    acceptance_weights,
    block_loss,
    block_targets,
    default_gamma,
    head_cross_entropy,
    label_counts,
    position_weights,
)
from flashdraft.train.records import TrainingRecord
from train.tiny_training import one_thread  # noqa: F401

V, D = 50, 16


def random_head(seed=0, bias=False):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=generator)
    return weight, torch.randn(V, generator=generator) if bias else None


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_hard_cross_entropy_equals_plain(chunk, bias):
    weight, head_bias = random_head(1, bias)
    hidden = torch.randn(10, D, generator=torch.Generator().manual_seed(2), requires_grad=True)
    labels = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(3))
    row_weights = torch.rand(10, generator=torch.Generator().manual_seed(4))
    losses, predicted = head_cross_entropy(hidden, weight, head_bias, labels[:, None], torch.ones(10, 1), chunk)
    (losses * row_weights).sum().backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    logits = F.linear(hidden, weight, head_bias)
    reference = F.cross_entropy(logits, labels, reduction="none")
    (reference * row_weights).sum().backward()
    assert torch.allclose(losses, reference, atol=1e-5)
    assert torch.allclose(ours, hidden.grad, atol=1e-5)
    assert torch.equal(predicted, logits.argmax(-1))


def test_soft_targets_equal_cross_entropy_to_a_distribution():
    weight, _ = random_head(5)
    hidden = torch.randn(6, D, generator=torch.Generator().manual_seed(6), requires_grad=True)
    ids = torch.randint(0, V, (6, 4), generator=torch.Generator().manual_seed(7))
    ids[0, 1] = ids[0, 0]  # a repeated id adds up
    probs = torch.rand(6, 4, generator=torch.Generator().manual_seed(8))
    probs = probs / probs.sum(1, keepdim=True)
    losses, _ = head_cross_entropy(hidden, weight, None, ids, probs, chunk_size=4)
    losses.sum().backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    target = torch.zeros(6, V).scatter_add_(1, ids, probs)
    reference = -(target * F.log_softmax(hidden @ weight.T, -1)).sum(1)
    reference.sum().backward()
    assert torch.allclose(losses, reference, atol=1e-5)
    assert torch.allclose(ours, hidden.grad, atol=1e-5)


def test_position_weights_and_default_gamma():
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0
    weights = position_weights(16, 7.0)
    assert weights.shape == (15,)
    assert weights[0] == 1.0
    assert math.isclose(weights[14].item(), math.exp(-14 / 7), rel_tol=1e-6)
    with pytest.raises(ValueError, match="gamma"):
        position_weights(16, 0.0)


def test_acceptance_weights_are_each_positions_share_of_the_expected_accepted_length():
    a = [0.5, 0.4, 0.2]
    # E = a1 + a1 a2 + a1 a2 a3; dE/da1 = 1 + a2 + a2 a3 = 1.48, dE/da2 = a1 (1 + a3) = 0.6, dE/da3 = a1 a2 = 0.2
    expected = torch.tensor([1.48, 0.6, 0.2]) / 1.48
    assert torch.allclose(acceptance_weights(a, floor=0.0), expected, atol=1e-6)
    # the same derivative, numerically
    def accepted(acc):
        total, product = 0.0, 1.0
        for value in acc:
            product *= value
            total += product
        return total
    for k in range(3):
        bumped = list(a)
        bumped[k] += 1e-6
        assert math.isclose((accepted(bumped) - accepted(a)) / 1e-6, expected[k].item() * 1.48, rel_tol=1e-4)


def test_acceptance_weights_are_floored_and_follow_the_accuracy():
    weak = acceptance_weights([0.1] * 15)
    assert weak.shape == (15,) and weak[0] == 1.0
    assert weak[2:].eq(ACCEPTANCE_WEIGHT_FLOOR).all()  # 0.1 * 0.1 < the floor: the later positions keep the floor
    strong = acceptance_weights([0.9] * 15)
    assert (strong[1:-1] > weak[1:-1]).all() and (strong >= ACCEPTANCE_WEIGHT_FLOOR).all()
    assert torch.equal(acceptance_weights([0.0, 0.0]), torch.tensor([1.0, ACCEPTANCE_WEIGHT_FLOOR]))
    with pytest.raises(ValueError, match="one accuracy per block position"):
        acceptance_weights([])


def sequence(ids, response_start, labels=None, topk=None, seq_id="s"):
    record = TrainingRecord(
        id=seq_id, source="t", input_ids=ids, response_start=response_start, labels=labels,
        topk_ids=topk[0] if topk else None, topk_probs=topk[1] if topk else None,
    )
    return TrainingSequence.from_record(record, 1000)


def test_block_loss_is_the_position_weighted_sum():
    torch.manual_seed(0)
    seqs = [sequence(torch.randint(2, V, (20,)).tolist(), 4, seq_id="a"),
            sequence(torch.randint(2, V, (13,)).tolist(), 2, seq_id="b")]
    batch = make_blocks(seqs, [[4, 9, 17], [2, 11]], block_size=4, mask_token_id=1)
    weights = position_weights(4, 2.0)
    targets = block_targets(batch, weights)
    hidden = torch.randn(2, 3 * 4, D)
    weight, _ = random_head(9)
    output = block_loss(hidden, targets, weight, None, None, block_size=4, chunk_size=5)
    expected, counted = 0.0, torch.zeros(3, dtype=torch.long)
    for row in range(2):
        for block in range(3):
            for k in range(1, 4):
                label = int(batch.labels[row, block, k - 1])
                if label == IGNORE:
                    continue
                counted[k - 1] += 1
                logits = hidden[row, block * 4 + k] @ weight.T
                expected += weights[k - 1] * F.cross_entropy(logits[None], torch.tensor([label]))
    assert torch.allclose(output.loss, torch.as_tensor(expected), atol=1e-4)
    assert torch.equal(output.counted, counted)
    # sequence b has 2 blocks; its last block at 11 learns 12 only; padding block learns nothing
    assert counted.tolist() == [5, 4, 3]


def test_most_frequent_vocabulary_ties_coverage_and_mapping():
    seqs = [sequence([9, 9, 5, 5, 5, 7, 7, 3], 1)]  # labels: 9 x1, 5 x3, 7 x2, 3 x1
    counts = label_counts(seqs, V)
    assert counts[5] == 3 and counts[9] == 1 and counts.sum() == 7
    vocabulary, coverage = DraftVocabulary.most_frequent(seqs, 3, V)
    assert vocabulary.ids.tolist() == [3, 5, 7]  # 5, 7, then 3 before 9 on the tie
    assert math.isclose(coverage, 6 / 7)
    assert vocabulary.full_to_draft[7] == 2 and vocabulary.full_to_draft[9] == -1
    with pytest.raises(ValueError, match="vocabulary size"):
        DraftVocabulary.most_frequent(seqs, V + 1, V)


def test_vocabulary_from_counts_takes_the_most_counted_ties_to_the_lower_id():
    counts = torch.zeros(V, dtype=torch.long)
    counts[[4, 8, 2, 6]] = torch.tensor([5, 5, 9, 1])
    assert DraftVocabulary.from_counts(counts, 3).ids.tolist() == [2, 4, 8]
    assert DraftVocabulary.from_counts(counts, 1).ids.tolist() == [2]
    with pytest.raises(ValueError, match="vocabulary size"):
        DraftVocabulary.from_counts(counts, 0)


def test_reduced_vocabulary_loss_ignores_outside_labels_and_counts_them_as_misses():
    seqs = [sequence([2, 3, 4, 5, 6, 7, 8, 9], 1)]
    batch = make_blocks(seqs, [[1, 4]], block_size=3, mask_token_id=1)  # blocks learn tokens 4, 5 and 7, 8
    vocabulary = DraftVocabulary.from_ids([4, 5, 7, 10], V)  # 8 is outside
    weights = position_weights(3, 4.0)
    targets = block_targets(batch, weights, vocabulary)
    assert targets.labels.tolist() == [4, 5, 7, 8]
    assert targets.weights.tolist() == [weights[0].item(), weights[1].item(), weights[0].item(), 0.0]
    assert targets.target_ids[:3, 0].tolist() == [0, 1, 2]
    weight, _ = random_head(10)
    hidden = torch.zeros(1, 6, D)
    hidden[:] = weight[4]  # every position leans towards token 4
    output = block_loss(hidden, targets, weight[vocabulary.ids], None, vocabulary, block_size=3)
    reduced_logits = hidden[0, 1] @ weight[vocabulary.ids].T
    expected = sum(w * F.cross_entropy(reduced_logits[None], torch.tensor([i]))
                   for w, i in zip(weights.tolist() + weights[:1].tolist(), [0, 1, 2]))
    assert torch.allclose(output.loss, torch.as_tensor(expected), atol=1e-5)
    predicted_full = vocabulary.ids[reduced_logits.argmax()].item()
    hits = [predicted_full == label for label in [4, 5, 7, 8]]
    assert output.correct.tolist() == [hits[0] + hits[2], hits[1] + hits[3]]
    assert output.counted.tolist() == [2, 2]


def test_distillation_targets_mix_and_renormalise_over_the_drafting_vocabulary():
    ids = [2, 3, 4, 5]
    topk = ([[4, 8, 9], [5, 9, 8], [6, 7, 8]], [[0.6, 0.2, 0.1], [0.5, 0.3, 0.0], [0.1, 0.1, 0.1]])
    seqs = [sequence(ids, 1, topk=topk)]  # response positions 1, 2, 3
    batch = make_blocks(seqs, [[1]], block_size=3, mask_token_id=1)  # learns positions 2, 3
    weights = position_weights(3, 4.0)
    pure = block_targets(batch, weights, distill_weight=1.0)
    dense = torch.zeros(2, V).scatter_add_(1, pure.target_ids, pure.target_probs)
    # probabilities are stored as float16
    assert torch.allclose(dense[0, [5, 9, 8]], torch.tensor([0.5, 0.3, 0.0]) / 0.8, atol=1e-3)
    assert torch.allclose(dense.sum(1), torch.ones(2))
    mixed = block_targets(batch, weights, distill_weight=0.25)
    dense = torch.zeros(2, V).scatter_add_(1, mixed.target_ids, mixed.target_probs)
    assert torch.isclose(dense[0, 4], torch.tensor(0.75))  # the hard label of position 2 is token 4
    assert torch.isclose(dense[0, 5], torch.tensor(0.25 * 0.5 / 0.8), atol=1e-3)
    vocabulary = DraftVocabulary.from_ids([4, 5, 8], V)
    reduced = block_targets(batch, weights, vocabulary, distill_weight=1.0)
    dense = torch.zeros(2, 3).scatter_add_(1, reduced.target_ids, reduced.target_probs)
    assert torch.allclose(dense[0], torch.tensor([0.0, 1.0, 0.0]))  # 9 outside; 8 has probability 0
    assert torch.allclose(dense[1], torch.tensor([0.0, 0.0, 1.0]))  # of 6, 7, 8 only 8 remains
    with pytest.raises(ValueError, match="top-k"):
        block_targets(make_blocks([sequence(ids, 1)], [[1]], 3, 1), weights, distill_weight=0.5)
