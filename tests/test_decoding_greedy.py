"""Greedy decoding is lossless: flashdraft's tokens equal `target.generate(do_sample=False)`."""

import random

import pytest
import torch

import flashdraft
from flashdraft import decoding
from flashdraft.adaptive import VerifyCosts

from tiny import (
    ARCHITECTURES,
    OracleProposer,
    chosen_rejections,
    greedy_reference,
    random_case,
    tiny_draft,
    tiny_target,
)

MASK = 1
TARGETS = {arch: tiny_target(arch, seed=i, forbid_token=MASK) for i, arch in enumerate(ARCHITECTURES)}
DRAFTS = {arch: tiny_draft(t, block_size=16, mask_token_id=MASK) for arch, t in TARGETS.items()}


@pytest.mark.parametrize("case", range(120))
def test_random_draft_matches_target(case):
    rng = random.Random(case)
    arch = ARCHITECTURES[case % 3]
    target = TARGETS[arch]
    prompt, max_new, block_size = random_case(rng)
    result = flashdraft.generate(target, DRAFTS[arch], prompt, max_new_tokens=max_new, block_size=block_size)
    assert result.tokens == greedy_reference(target, prompt, max_new)
    assert MASK not in result.tokens
    assert sum(result.acceptance_lengths) + 1 >= len(result.tokens)


@pytest.mark.parametrize("case", range(120))
def test_oracle_with_chosen_rejections_matches_target(case):
    """Full and partial acceptance: an oracle proposer, corrupted at random positions, drives every path of
    the acceptance arithmetic (all accepted, none accepted, rejection at each offset, budget cut-offs)."""
    rng = random.Random(1000 + case)
    arch = ARCHITECTURES[case % 3]
    target = TARGETS[arch]
    prompt, max_new, block_size = random_case(rng)
    block_size = max(block_size, 2)
    reference = greedy_reference(target, prompt, max_new)
    wrong_at = chosen_rejections(rng, len(prompt), max_new)
    oracle = OracleProposer(len(prompt), reference, 96, wrong_at)
    result = flashdraft.generate(target, oracle, prompt, max_new_tokens=max_new, block_size=block_size)
    assert result.tokens == reference
    if not wrong_at and max_new > 1:
        # A perfect proposer: every round but the last accepts the whole block.
        assert all(n == block_size for n in result.acceptance_lengths[:-1])
        assert len(result.acceptance_lengths) == -(-(max_new - 1) // block_size)


def test_acceptance_lengths_follow_the_chosen_rejections():
    target = TARGETS["llama"]
    prompt = [5, 6, 7]
    reference = greedy_reference(target, prompt, 40)
    # Anchor of round 1 sits at position 3 (the prefill's token); proposals at 4..10 with block 8.
    oracle = OracleProposer(3, reference, 96, wrong_at={6})
    result = flashdraft.generate(target, oracle, prompt, max_new_tokens=17, block_size=8)
    assert result.tokens == reference[:17]
    # Round 1: proposals 4, 5 accepted, 6 rejected -> 3 tokens (positions 4, 5 and the bonus at 6).
    # Round 2: anchor at 7, all 7 accepted + bonus -> 8; round 3: the 5 remaining tokens, block cut to 5
    # (the draft still drafts a full block; only 4 proposals are verified).
    assert result.acceptance_lengths == [3, 8, 5]
    assert result.block_sizes == [8, 8, 5]
    assert oracle.calls == [(3, 8), (6, 8), (14, 8)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_stop_token_positions(arch, block_size):
    """A stop token inside an accepted block, as the bonus token and as the very first token."""
    target = TARGETS[arch]
    prompt = [9, 10, 11, 12]
    reference = greedy_reference(target, prompt, 40)
    for stop_index in (0, 1, 3, 7, 12, 20):
        stop = reference[stop_index]
        expected = greedy_reference(target, prompt, 40, stop_token_ids=[stop])
        assert expected[-1] == stop and stop not in expected[:-1]
        for wrong_at in (set(), {len(prompt) + len(expected) - 1}, {len(prompt) + len(expected)}):
            oracle = OracleProposer(len(prompt), reference, 96, wrong_at)
            for draft in (oracle, DRAFTS[arch]):
                result = flashdraft.generate(
                    target, draft, prompt, max_new_tokens=40, stop_token_ids=[stop], block_size=block_size
                )
                assert result.tokens == expected
                assert result.stop_reason == "stop"


def test_stop_token_inside_fully_accepted_block_ends_there():
    target = TARGETS["qwen3"]
    prompt = [3, 4]
    reference = greedy_reference(target, prompt, 30)
    stop = reference[5]
    expected = reference[: reference.index(stop) + 1]
    oracle = OracleProposer(2, reference, 96)
    result = flashdraft.generate(target, oracle, prompt, max_new_tokens=30, stop_token_ids=[stop], block_size=16)
    assert result.tokens == expected
    assert result.acceptance_lengths == [16]  # the stop token was mid-block; the rest of the block is dropped


@pytest.mark.parametrize("max_new", [0, 1, 2, 15, 16, 17, 31, 32, 33])
def test_max_new_tokens_is_exact_at_block_boundaries(max_new):
    target = TARGETS["llama"]
    prompt = [20, 21, 22]
    reference = greedy_reference(target, prompt, 40)
    oracle = OracleProposer(3, reference, 96)
    result = flashdraft.generate(target, oracle, prompt, max_new_tokens=max_new, block_size=16)
    assert result.tokens == reference[:max_new]
    assert result.stop_reason == "length"


def test_block_size_one_is_autoregressive_without_a_draft():
    target = TARGETS["qwen2"]
    prompt = [7] * 10
    result = flashdraft.generate(target, None, prompt, max_new_tokens=25)
    assert result.tokens == greedy_reference(target, prompt, 25)
    assert result.acceptance_lengths == [1] * 24
    assert result.tau == 1.0


def test_stream_yields_each_round_and_ends_with_the_result():
    target = TARGETS["llama"]
    prompt = [30, 31]
    reference = greedy_reference(target, prompt, 20)
    oracle = OracleProposer(2, reference, 96, wrong_at={6, 12})
    chunks = flashdraft.stream(target, oracle, prompt, max_new_tokens=20, block_size=8)
    pieces = list(chunks)
    assert pieces[0] == reference[:1]  # the prefill's token comes first, alone
    assert [len(p) for p in pieces[1:]] == chunks.result.acceptance_lengths[: len(pieces) - 1]
    assert sum(pieces, []) == reference == chunks.result.tokens


def test_closing_a_stream_stops_generation():
    target = TARGETS["llama"]
    chunks = flashdraft.stream(target, None, [3, 4, 5], max_new_tokens=50)
    for i, _ in enumerate(chunks):
        if i == 2:
            chunks.close()
    assert len(chunks.result.tokens) == 3
    assert chunks.result.stop_reason is None


def test_accepts_tensor_prompts_of_either_shape():
    target = TARGETS["llama"]
    reference = greedy_reference(target, [5, 6, 7], 5)
    for prompt in (torch.tensor([5, 6, 7]), torch.tensor([[5, 6, 7]])):
        assert flashdraft.generate(target, DRAFTS["llama"], prompt, max_new_tokens=5).tokens == reference


def test_the_default_block_size_is_auto_as_in_the_cli_and_the_server(monkeypatch):
    # Costs where a whole block costs 1.5 steps (AMX, a GPU), instead of timings of a tiny model on a busy machine:
    # the first round's size then does not depend on the machine (on an AVX2 CI host it probed 2 tokens, not 16).
    flat = VerifyCosts({1: 1.0, 16: 1.5})
    monkeypatch.setattr(decoding, "cached_costs", lambda target, proposer, size: (flat, 0.1))
    target, prompt = TARGETS["qwen2"], [4, 5, 6]
    default = flashdraft.generate(target, DRAFTS["qwen2"], prompt, max_new_tokens=40)
    auto = flashdraft.generate(target, DRAFTS["qwen2"], prompt, max_new_tokens=40, block_size="auto")
    fixed = flashdraft.generate(target, DRAFTS["qwen2"], prompt, max_new_tokens=40, block_size=None)
    assert default.tokens == auto.tokens == fixed.tokens == greedy_reference(target, prompt, 40)
    assert default.block_sizes == auto.block_sizes
    emitted = 1  # None: the draft's own size in every round, until the budget shortens it
    for size, length in zip(fixed.block_sizes, fixed.acceptance_lengths):
        assert size == min(16, 40 - emitted)
        emitted += length
    # The first round drafts the whole block (it costs 1.6 steps here) and verifies as much of it as the draft's
    # confidence pays for, at least one token; the adaptive choice then turns a random draft's speculation off.
    assert default.block_sizes[0] >= 2 and 1 in default.block_sizes
