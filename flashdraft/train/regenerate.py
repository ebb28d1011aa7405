"""Regeneration: the target writes the responses of the training prompts, so the draft learns the target's own
distribution. Batched, resumable, written as training records (see `flashdraft.train.records`).

Prompts are sorted by length into groups of `GROUP_BATCHES` batches; a group is decoded by continuous batching
(`flashdraft.Batch`, plain decoding): `batch_size` prompts at a time, a finished one replaced by the next at once,
so the rows stay full until the group's last answers. A group's records are written in its planned order when it
is done, so a resumed run writes the same shards as an uninterrupted one. Greedy decoding (temperature 0) gives each
prompt exactly what the target's own `generate` gives it alone (bit for bit with the engine's int8 arithmetic); a
sampled answer draws from a generator seeded by the run's seed and the prompt's place in the set. Two kinds of run
decode each batch left-padded instead (`TargetModel.generate_batch`): those that store the target's top-k
probabilities (`top_k` > 0), which need every step's logits, and those on transformers' forward (a GPU), where a
continuous batch would run row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from .. import text
from ..target import TargetModel
from .config import PipelineConfig
from .prompts import Prompt, encode_prompt
from .records import DEFAULT_RECORDS_PER_SHARD, RunStats, TrainingRecord, run_resumable

BYTES_PER_TOKEN = 8  # a token id in JSON with its separator
# Batches a continuously batched group holds: its rows run full until its last few answers, whose tail (fewer rows
# than `batch_size`) a longer group makes rarer; a kill loses at most the group being decoded.
GROUP_BATCHES = 8
BYTES_PER_TOPK_ENTRY = 20  # an id and a probability


def required_stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a response (`flashdraft.text.stop_token_ids`); a target without any is refused, since its
    responses would never end."""
    ids = list(text.stop_token_ids(model, tokenizer))
    if not ids:
        raise ValueError("the target defines no end-of-sequence token: set model.generation_config.eos_token_id")
    return ids


def top_k_of(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """[n, V] logits -> the k most probable ids per row and their probabilities (temperature 1, 6 digits)."""
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids.tolist(), [[round(p, 6) for p in row] for row in probs.tolist()]


def generate_batch(
    model,
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    top_k: int = 0,
    pad_token_id: int = 0,
) -> tuple[list[list[int]], list[tuple[list[list[int]], list[list[float]]]] | None]:
    """The target's answers to a batch of prompts (`TargetModel.generate_batch`) and, when `top_k` > 0, for each
    prompt the top-k ids and probabilities at every response position."""
    top: list[tuple[list, list]] = [([], []) for _ in prompt_ids]

    def keep_top_k(rows: list[int], logits: torch.Tensor) -> None:
        top_ids, top_probs = top_k_of(logits, top_k)
        for live, row in enumerate(rows):
            top[row][0].append(top_ids[live])
            top[row][1].append(top_probs[live])

    responses = TargetModel(model).generate_batch(
        prompt_ids, max_new_tokens, stop_ids, temperature=temperature, generator=generator,
        pad_token_id=pad_token_id, on_logits=keep_top_k if top_k else None,
    )
    return responses, (top if top_k else None)


def decode_continuously(model, prompt_ids: Sequence[list[int]], rows: int, max_new_tokens: int, stop_ids: Sequence[int],
                        temperature: float = 0.0, seeds: Sequence[int] | None = None) -> list[list[int]]:
    """The target's answers to prompts decoded `rows` at a time by continuous batching (`flashdraft.Batch`, plain
    decoding), each prompt's answer what it gets alone (sampled ones from their own `seeds`). Returns each prompt's
    new token ids, in order, a stop token included when one ended it."""
    from ..batching import Batch

    batch = Batch(TargetModel(model), None, block_size=1)
    sequences, queued = [], 0
    while queued < len(prompt_ids) or len(batch):
        while queued < len(prompt_ids) and len(batch) < rows:
            sequences.append(batch.add(prompt_ids[queued], max_new_tokens=max_new_tokens, temperature=temperature,
                                       stop_token_ids=stop_ids,
                                       seed=seeds[queued] if seeds is not None and temperature > 0 else None))
            queued += 1
        batch.step()
    return [sequence.result.tokens for sequence in sequences]


def regenerate_settings(model, tokenizer, *, max_new_tokens: int, temperature: float, top_k: int, batch_size: int,
                        seed: int) -> dict:
    """The settings a record folder of `regenerate` is made with (its meta.json): records made with others differ.
    The engine's arithmetic is one where it is int8 (greedy answers in int8 and in float32 differ now and then);
    float32 records, made before there was a choice, say nothing of it."""
    target = TargetModel(model)
    arithmetic = target.engine.arithmetic if target.engine is not None else "float32"
    return {
        "stage": "regenerate",
        **target.identity(),
        **({"arithmetic": arithmetic} if arithmetic != "float32" else {}),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "batch_size": batch_size,
        "seed": seed,
        "stop_token_ids": required_stop_token_ids(model, tokenizer),
    }


def regenerate(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    output_dir: str | Path,
    *,
    max_new_tokens: int = PipelineConfig.max_new_tokens,  # the defaults of `flashdraft train`
    temperature: float = PipelineConfig.temperature,
    top_k: int = PipelineConfig.store_top_k,
    batch_size: int = PipelineConfig.data_batch_size,
    seed: int = PipelineConfig.seed,
    records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
    progress: bool = True,
    time_limit: float | None = None,
) -> RunStats:
    """Let the target answer every prompt and append the results to the record shards in `output_dir`.

    Resumable: prompts already in `output_dir` are skipped, so calling it again after a kill continues where it
    stopped (with the same settings; other settings are refused); `time_limit` (seconds) stops it early the same
    way. `top_k` > 0 also stores the target's top-k probabilities at each response position, for distillation.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    settings = regenerate_settings(model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_k=top_k, batch_size=batch_size, seed=seed)
    stops = settings["stop_token_ids"]
    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]

    # Continuous batching pays on the engine (the CPU), whose batch rows each sit at their own positions; on
    # transformers' forward (a GPU) a continuous batch runs row by row, so there the batches stay left-padded.
    continuous = not top_k and TargetModel(model).engine is not None

    def process_batch(batch_number: int, batch: list[int]) -> list[TrainingRecord]:
        if not continuous:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + batch_number) if temperature > 0 else None
            responses, top = generate_batch(
                model, [encoded[i] for i in batch], max_new_tokens, stops, temperature, generator, top_k, pad_token_id
            )
        else:
            responses, top = decode_continuously(model, [encoded[i] for i in batch], batch_size, max_new_tokens, stops,
                                                 temperature, [seed * 1_000_003 + i for i in batch]), None
        return [
            TrainingRecord(
                id=prompts[i].id,
                source=prompts[i].source,
                input_ids=encoded[i] + response,
                response_start=len(encoded[i]),
                topk_ids=top[row][0] if top else None,
                topk_probs=top[row][1] if top else None,
            )
            for row, (i, response) in enumerate(zip(batch, responses))
        ]

    average_prompt = sum(map(len, encoded)) / max(len(encoded), 1)
    bytes_per_record = int(
        (average_prompt + max_new_tokens) * BYTES_PER_TOKEN + max_new_tokens * top_k * BYTES_PER_TOPK_ENTRY
    )
    return run_resumable(
        ids=[prompt.id for prompt in prompts],
        lengths=[len(ids) for ids in encoded],
        folder=output_dir,
        settings=settings,
        process_batch=process_batch,
        batch_size=batch_size * GROUP_BATCHES if continuous else batch_size,
        bytes_per_record=bytes_per_record,
        description="regenerating",
        records_per_shard=records_per_shard,
        progress=progress,
        time_limit=time_limit,
    )
