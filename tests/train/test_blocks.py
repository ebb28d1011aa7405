"""Blocks, anchors and the block-sparse mask: the training forward over many blocks equals the decoding loop's
draft forward block by block, and no block sees its anchor's features or anything after them."""

import pytest
import torch

from flashdraft import draft as draft_module
from flashdraft.proposals import DFlashProposer
from flashdraft.target import TargetModel
from flashdraft.train.blocks import IGNORE, TrainingSequence, block_attention_mask, make_blocks, sample_anchors
from flashdraft.train.records import TrainingRecord
from train.tiny_training import one_thread  # noqa: F401

from tiny import tiny_draft, tiny_target

MASK = 1
BLOCK = 8


def random_sequence(length: int, response_start: int, seed: int = 0, width: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 96, (length,), generator=generator).tolist()
    record = TrainingRecord(id=f"s{seed}", source="test", input_ids=ids, response_start=response_start)
    return TrainingSequence.from_record(record, max_length=10_000)


def training_logits(draft, target, sequence, anchors, features):
    """[n, B-1, V] logits of every block from one training forward."""
    batch = make_blocks([sequence], [anchors], draft.block_size, draft.mask_token_id)
    hidden = draft(
        target.embed(batch.block_ids), features[:, : batch.context_length], batch.position_ids,
        attention_mask=batch.attention_mask,
    )
    hidden = hidden.view(1, len(anchors), draft.block_size, -1)[0, :, 1:]
    return target.head(hidden)


@pytest.mark.parametrize("arch, attn, window", [
    ("llama", "sdpa", None), ("qwen3", "sdpa", None), ("qwen3", "eager", None), ("qwen3", "sdpa", 10),
    ("llama", "eager", 10),
])
def test_training_forward_equals_decoding_draft_forward(arch, attn, window):
    model = tiny_target(arch, seed=3)
    target = TargetModel(model)
    draft = tiny_draft(model, block_size=BLOCK, mask_token_id=MASK, num_layers=2, seed=4, attn_implementation=attn)
    if window is not None:  # the first layer slides: the training mask must cut the window too
        draft.config.sliding_window = window
        draft.config.layer_types = ["sliding_attention", "full_attention"]
        draft.layers[0].self_attn.sliding_window = window
    sequence = random_sequence(60, response_start=7, seed=1)
    features = torch.randn(1, 60, len(draft.target_layer_ids) * 32, generator=torch.Generator().manual_seed(5))
    anchors = [7, 8, 19, 33, 34, 50, 58]
    with torch.no_grad():
        trained = training_logits(draft, target, sequence, anchors, features)
        # The decoding loop's path: rounds whose anchors are `anchors`, each handing the draft the features
        # verified since the previous round, with the draft's context cache carried over.
        proposer = DFlashProposer(draft, target)
        proposer.begin(60 + BLOCK)
        previous = 0
        for j, anchor in enumerate(anchors):
            inferred = proposer.logits(sequence.input_ids[anchor].view(1), features[:, previous:anchor], anchor, BLOCK)
            previous = anchor
            assert (trained[j] - inferred).abs().max() < 1e-5, f"block at anchor {anchor}"


@pytest.mark.parametrize("window", [None, 40])
def test_a_forward_over_many_blocks_attends_in_query_groups_each_block_as_decoding_does(monkeypatch, window):
    model = tiny_target("qwen3", seed=3)
    target = TargetModel(model)
    draft = tiny_draft(model, block_size=BLOCK, mask_token_id=MASK, num_layers=2, seed=4)
    if window is not None:
        draft.config.sliding_window = window
        draft.config.layer_types = ["sliding_attention", "full_attention"]
        draft.layers[0].self_attn.sliding_window = window
    groups = []
    attend = draft_module.attend_in_query_groups
    monkeypatch.setattr(draft_module, "attend_in_query_groups", lambda *a, **k: groups.append(1) or attend(*a, **k))
    sequence = random_sequence(240, response_start=5, seed=2)
    features = torch.randn(1, 240, len(draft.target_layer_ids) * 32, generator=torch.Generator().manual_seed(6))
    anchors = sorted(torch.randperm(225, generator=torch.Generator().manual_seed(7))[:40].add(5).tolist())
    with torch.no_grad():
        trained = training_logits(draft, target, sequence, anchors, features)  # 320 queries: three groups
        assert len(groups) == 2  # each layer
        proposer = DFlashProposer(draft, target)
        proposer.begin(240 + BLOCK)
        previous = 0
        for j, anchor in enumerate(anchors):
            inferred = proposer.logits(sequence.input_ids[anchor].view(1), features[:, previous:anchor], anchor, BLOCK)
            previous = anchor
            assert (trained[j] - inferred).abs().max() < 1e-5, f"block at anchor {anchor}"


def test_attention_in_query_groups_has_the_gradients_of_one_attention(monkeypatch):
    model = tiny_target("qwen3", seed=3)
    target = TargetModel(model)
    sequences = [random_sequence(200, response_start=5, seed=s) for s in (3, 4)]
    anchors = [sorted(torch.randperm(190, generator=torch.Generator().manual_seed(s))[:30].add(5).tolist())
               for s in (8, 9)]
    batch = make_blocks(sequences, anchors, BLOCK, MASK)
    width = len(tiny_draft(model).target_layer_ids) * 32
    features = torch.randn(2, batch.context_length, width, generator=torch.Generator().manual_seed(6))
    gradients = {}
    for name, group in (("grouped", draft_module.QUERY_GROUP), ("whole", 10**9)):
        monkeypatch.setattr(draft_module, "QUERY_GROUP", group)
        draft = tiny_draft(model, block_size=BLOCK, mask_token_id=MASK, num_layers=2, seed=4)
        hidden = draft(target.embed(batch.block_ids), features, batch.position_ids, attention_mask=batch.attention_mask)
        hidden.square().mean().backward()
        gradients[name] = {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}
    assert gradients["grouped"].keys() == gradients["whole"].keys()
    for name, gradient in gradients["grouped"].items():
        assert torch.allclose(gradient, gradients["whole"][name], rtol=1e-4, atol=1e-6), name


def test_one_block_equals_a_fresh_proposer_at_any_anchor():
    model = tiny_target("qwen2", seed=6)
    target = TargetModel(model)
    draft = tiny_draft(model, block_size=BLOCK, mask_token_id=MASK, seed=7)
    sequence = random_sequence(40, response_start=3, seed=2)
    features = torch.randn(1, 40, len(draft.target_layer_ids) * 32, generator=torch.Generator().manual_seed(8))
    anchors = [3, 11, 12, 38]
    with torch.no_grad():
        trained = training_logits(draft, target, sequence, anchors, features)
        for j, anchor in enumerate(anchors):
            proposer = DFlashProposer(draft, target)
            proposer.begin(40 + BLOCK)
            inferred = proposer.logits(sequence.input_ids[anchor].view(1), features[:, :anchor], anchor, BLOCK)
            assert (trained[j] - inferred).abs().max() < 1e-5


def test_mask_is_exactly_context_before_anchor_plus_own_block():
    anchors = torch.tensor([[2, 5, 9], [4, 0, 0]])
    mask = block_attention_mask(anchors, context_length=9, block_size=3)
    assert mask.shape == (2, 1, 9, 9 + 9)
    for row in range(2):
        for query in range(9):
            block = query // 3
            for key in range(18):
                if key < 9:
                    expected = key < int(anchors[row, block])
                else:
                    expected = (key - 9) // 3 == block
                assert bool(mask[row, 0, query, key]) == expected, (row, query, key)


def test_make_blocks_layout_positions_and_labels():
    sequence = random_sequence(12, response_start=4, seed=3)
    batch = make_blocks([sequence], [[4, 9]], block_size=4, mask_token_id=MASK)
    ids = sequence.input_ids
    assert batch.context_length == 9
    assert batch.block_ids[0].tolist() == [ids[4].item(), MASK, MASK, MASK, ids[9].item(), MASK, MASK, MASK]
    assert batch.position_ids[0].tolist() == list(range(9)) + [4, 5, 6, 7, 9, 10, 11, 12]
    # Block at 9 learns positions 10 and 11; position 12 is past the end.
    assert batch.labels[0].tolist() == [ids[5:8].tolist(), [ids[10].item(), ids[11].item(), IGNORE]]


def test_teacher_forced_labels_and_topk_are_gathered_by_position():
    record = TrainingRecord(
        id="t", source="test", input_ids=[10, 11, 12, 13, 14, 15], response_start=3, labels=[40, 41, 42],
        topk_ids=[[40, 7], [41, 8], [42, 9]], topk_probs=[[0.5, 0.25], [0.75, 0.125], [1.0, 0.0]],
    )
    sequence = TrainingSequence.from_record(record, max_length=100)
    assert sequence.labels.tolist() == [IGNORE] * 3 + [40, 41, 42]
    batch = make_blocks([sequence], [[3]], block_size=3, mask_token_id=MASK)
    assert batch.labels[0, 0].tolist() == [41, 42]
    assert batch.topk_ids[0, 0].tolist() == [[41, 8], [42, 9]]
    assert batch.topk_probs[0, 0].tolist() == [[0.75, 0.125], [1.0, 0.0]]


def test_truncation_keeps_labels_aligned():
    record = TrainingRecord(id="t", source="test", input_ids=list(range(20, 40)), response_start=5)
    sequence = TrainingSequence.from_record(record, max_length=8)
    assert len(sequence) == 8
    assert sequence.labels.tolist() == [IGNORE] * 5 + [25, 26, 27]
    assert list(sequence.anchor_positions) == [5, 6]


def test_anchors_are_distinct_in_the_response_seeded_and_redrawn_each_epoch():
    sequence = random_sequence(200, response_start=50, seed=4)
    first = sample_anchors(sequence, 16, seed=0, epoch=0)
    assert first == sorted(set(first)) and len(first) == 16
    assert all(50 <= a <= 198 for a in first)
    assert sample_anchors(sequence, 16, seed=0, epoch=0) == first
    assert sample_anchors(sequence, 16, seed=0, epoch=1) != first
    assert sample_anchors(sequence, 16, seed=1, epoch=0) != first
    short = random_sequence(10, response_start=6, seed=5)
    assert sample_anchors(short, 16, seed=0, epoch=0) == [6, 7, 8]


@pytest.mark.parametrize("where", ["at", "after"])
def test_features_at_or_after_the_anchor_do_not_reach_the_block(where):
    model = tiny_target("llama", seed=9)
    target = TargetModel(model)
    draft = tiny_draft(model, block_size=BLOCK, mask_token_id=MASK, seed=10)
    sequence = random_sequence(50, response_start=5, seed=6)
    features = torch.randn(1, 50, len(draft.target_layer_ids) * 32, generator=torch.Generator().manual_seed(11))
    anchors = [10, 20, 40]
    with torch.no_grad():
        reference = training_logits(draft, target, sequence, anchors, features)
        changed = features.clone()
        changed[0, 20 if where == "at" else 30] += 5.0  # the anchor of block 1 / between blocks 1 and 2
        logits = training_logits(draft, target, sequence, anchors, changed)
    assert torch.equal(logits[0], reference[0])
    assert torch.equal(logits[1], reference[1])  # block 1 must not see its own anchor's features nor later ones
    assert (logits[2] - reference[2]).abs().max() > 1e-3  # block 2 sees position 20 and 30


def test_a_feature_before_the_anchor_changes_the_block():
    model = tiny_target("llama", seed=12)
    target = TargetModel(model)
    draft = tiny_draft(model, block_size=BLOCK, mask_token_id=MASK, seed=13)
    sequence = random_sequence(30, response_start=5, seed=7)
    features = torch.randn(1, 30, len(draft.target_layer_ids) * 32, generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        reference = training_logits(draft, target, sequence, [12, 25], features)
        changed = features.clone()
        changed[0, 11] += 5.0  # the last position block 0 may see
        logits = training_logits(draft, target, sequence, [12, 25], changed)
    assert (logits[0] - reference[0]).abs().max() > 1e-3


def test_every_training_entry_refuses_a_block_of_one():
    """One rule (a block must leave a position to learn) for the blocks, the trainer and the pipeline's config."""
    from flashdraft.train.blocks import check_training_block_size
    from flashdraft.train.pipeline import PipelineConfig

    with pytest.raises(ValueError, match=r"a training block size must be an integer >= 2, got 1 \(one position"):
        check_training_block_size(1)
    with pytest.raises(ValueError, match="a training block size must be an integer >= 2"):
        PipelineConfig(output="unused", block_size=1)
    check_training_block_size(2)
