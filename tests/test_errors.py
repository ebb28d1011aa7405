"""Bad input gets an error that names the problem (and, where there is one, the fix)."""

import pytest
import torch

import flashdraft

from tiny import tiny_draft, tiny_target

TARGET = tiny_target("llama", max_positions=64)
DRAFT = tiny_draft(TARGET)


def generate(draft=DRAFT, prompt=(5, 6, 7), **kwargs):
    kwargs.setdefault("max_new_tokens", 4)
    return flashdraft.generate(TARGET, draft, list(prompt), **kwargs)


def test_draft_for_another_hidden_size():
    other = tiny_draft(tiny_target("llama", hidden_size=48))
    with pytest.raises(ValueError, match="draft expects target hidden size 48, target has 32"):
        generate(other)


def test_draft_for_a_target_with_another_layer_count():
    other = tiny_draft(tiny_target("llama", num_layers=6))
    with pytest.raises(ValueError, match="made for a target with 6 layers, target has 4"):
        generate(other)


def test_target_layer_id_beyond_the_target():
    draft = tiny_draft(TARGET, target_layer_ids=[1, 4])
    with pytest.raises(ValueError, match=r"reads target layers \[4\], but the target has layers 0..3"):
        generate(draft)


def test_mask_token_outside_the_vocabulary():
    with pytest.raises(ValueError, match="mask token id 96 is outside the target's vocabulary of 96"):
        generate(tiny_draft(TARGET, mask_token_id=96))


@pytest.mark.parametrize("block_size", [0, -3])
def test_block_size_below_one(block_size):
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        generate(block_size=block_size)


def test_block_size_above_one_without_a_draft():
    with pytest.raises(ValueError, match="block_size 4 needs proposals: pass a draft, or proposals='lookup'"):
        generate(None, block_size=4)


def test_empty_prompt():
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(prompt=())


def test_prompt_token_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 96\)"):
        generate(prompt=(5, 200))


def test_negative_max_new_tokens():
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got -1"):
        generate(max_new_tokens=-1)


@pytest.mark.parametrize("temperature", [-0.5, float("nan"), float("inf")])
def test_a_temperature_that_is_not_a_finite_number_at_least_zero(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        generate(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, 1.5, -0.1])
def test_top_p_outside_the_unit_interval(top_p):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(temperature=1.0, top_p=top_p)


def test_negative_top_k():
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        generate(top_k=-1)


def test_prompt_plus_new_tokens_beyond_the_target_positions():
    message = r"prompt \(3 tokens\) plus max_new_tokens \(62\) exceeds the target's maximum of 64"
    with pytest.raises(ValueError, match=message):
        generate(max_new_tokens=62)
    assert len(generate(max_new_tokens=61).tokens) == 61  # the exact limit is fine


def test_batched_prompt_is_refused_where_one_sequence_is_expected():
    # `generate` decodes several prompts together (a batch); `stream` follows one sequence.
    with pytest.raises(ValueError, match=r"batch size 1\), got shape \[2, 3\]"):
        next(iter(flashdraft.stream(TARGET, DRAFT, [[1, 2, 3], [4, 5, 6]], max_new_tokens=4)))
    with pytest.raises(ValueError, match=r"batch size 1\), got shape \[2, 1, 3\]"):
        flashdraft.generate(TARGET, DRAFT, torch.tensor([[[1, 2, 3]], [[4, 5, 6]]]), max_new_tokens=4)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_seed_outside_64_bits(seed, temperature):
    # Greedy decoding does not use the seed, but a seed no generator takes is an error either way.
    message = rf"seed must be a 64-bit integer, in \[-2\*\*63, 2\*\*64 - 1\], got {seed}"
    with pytest.raises(ValueError, match=message):
        generate(temperature=temperature, seed=seed)


@pytest.mark.parametrize("seed", [1.5, "7", True])
def test_seed_that_is_not_an_integer(seed):
    with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
        generate(temperature=1.0, seed=seed)


def test_seeds_at_both_ends_of_the_64_bit_range_are_taken():
    for seed in (-(2**63), 2**64 - 1):
        assert len(generate(temperature=1.0, seed=seed).tokens) == 4
