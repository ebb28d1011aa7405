"""Tiny training setups shared by the trainer tests: a random target, a small draft, learnable sequences."""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft import DFlashDraftModel
from flashdraft.train.blocks import TrainingSequence
from flashdraft.train.records import TrainingRecord
from flashdraft.train.trainer import TrainConfig

from tiny import tiny_target

MASK = 1
VOCAB = 96
FEATURE_LAYERS = [0, 2]


def next_token(token: int) -> int:
    """A fixed successor function: sequences that follow it are learnable from the anchor token alone."""
    return (token * 7 + 3) % (VOCAB - 5) + 5


def pattern_sequences(count: int, seed: int = 0, min_length: int = 12, max_length: int = 30) -> list[TrainingSequence]:
    """`count` sequences of a random prompt followed by a response that follows `next_token`."""
    rng = random.Random(seed)
    sequences = []
    for i in range(count):
        prompt = [rng.randrange(5, VOCAB) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(5, VOCAB)]
        while len(prompt) + len(response) < rng.randint(min_length, max_length):
            response.append(next_token(response[-1]))
        record = TrainingRecord(id=f"seq{seed}-{i}", source="pattern" if i % 2 else "other",
                                input_ids=prompt + response, response_start=len(prompt))
        sequences.append(TrainingSequence.from_record(record, max_length=64))
    return sequences


def tiny_config(**settings) -> TrainConfig:
    """Trainer settings for the tiny runs: one micro-batch per step, evaluation at the end only, short evaluation
    answers, unless a test says otherwise (the defaults, `PipelineConfig`'s, are sized for real training)."""
    return TrainConfig(**{"grad_accum": 1, "eval_every": 0, "eval_max_new_tokens": 64, **settings})


def target_and_draft(seed: int = 0, draft_seed: int = 1, block_size: int = 4, num_layers: int = 1):
    target = tiny_target("llama", seed=seed, forbid_token=MASK)
    torch.manual_seed(draft_seed)
    draft = DFlashDraftModel.for_target(
        target.config, num_layers=num_layers, block_size=block_size, mask_token_id=MASK, target_layer_ids=FEATURE_LAYERS
    )
    return target, draft


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: starting threads costs more than the work, above all on a CPU shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
