"""Teacher-forced labels: target-aligned training labels without generation.

Existing text (a prompt's `response`, e.g. ShareGPT's own replies) is run through the target in one forward pass,
and the target's greedy prediction at each response position becomes that position's label: the token the target
would have written there given the text so far. Optionally the target's top-k probabilities are stored too, for
distillation. A forward costs a fraction of generation, so this yields labels several times faster than
`flashdraft.train.regenerate`, in the same record format (see `flashdraft.train.records`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from ..target import TargetModel
from .config import PipelineConfig
from .prompts import Prompt, encode_prompt
from .records import DEFAULT_RECORDS_PER_SHARD, RunStats, TrainingRecord, run_resumable
from .regenerate import BYTES_PER_TOKEN, BYTES_PER_TOPK_ENTRY, required_stop_token_ids, top_k_of

logger = logging.getLogger(__name__)

HEAD_CHUNK = 256  # positions per pass through the output head: bounds the [positions, vocab] logits in memory


def encode_with_response(
    tokenizer, prompt: Prompt, end_token_id: int | None, max_response_tokens: int
) -> tuple[list[int], int]:
    """(prompt ids + response ids, response start). The response is tokenized on its own, as generation would
    produce it after the prompt, and ends with `end_token_id` unless it was cut at `max_response_tokens`."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    response_ids = tokenizer(prompt.response, add_special_tokens=False)["input_ids"]
    if end_token_id is not None:
        response_ids = response_ids + [end_token_id]
    return prompt_ids + response_ids[:max_response_tokens], len(prompt_ids)


@torch.no_grad()
def label_batch(
    model, sequences: Sequence[tuple[list[int], int]], top_k: int = 0, pad_token_id: int = 0
) -> list[tuple[list[int], tuple[list[list[int]], list[list[float]]] | None]]:
    """One right-padded forward over (ids, response start) pairs. For each: the argmax of the target's logits that
    predict each response position (the logits at the position before it), and optionally their top-k."""
    target = TargetModel(model)
    hidden, _ = target.padded_hidden_states([ids for ids, _ in sequences], None, pad_token_id)  # [b, width, d]
    head = target.lm_head
    results = []
    for row, (ids, start) in enumerate(sequences):
        predicting = hidden[row, start - 1 : len(ids) - 1]  # [response length, d]
        labels, top_ids, top_probs = [], [], []
        for chunk in predicting.split(HEAD_CHUNK):
            logits = head(chunk)  # [chunk, V]
            labels += logits.argmax(dim=-1).tolist()
            if top_k:
                ids_chunk, probs_chunk = top_k_of(logits, top_k)
                top_ids += ids_chunk
                top_probs += probs_chunk
        results.append((labels, (top_ids, top_probs) if top_k else None))
    return results


def label_settings(model, tokenizer, *, max_response_tokens: int, top_k: int, batch_size: int) -> dict:
    """The settings a record folder of `label_responses` is made with (its meta.json)."""
    end_token_id = tokenizer.eos_token_id
    if end_token_id is None:
        end_token_id = required_stop_token_ids(model, tokenizer)[0]
    return {
        "stage": "labels",
        **TargetModel(model).identity(),
        "max_response_tokens": max_response_tokens,
        "top_k": top_k,
        "batch_size": batch_size,
        "end_token_id": end_token_id,
    }


def label_responses(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    output_dir: str | Path,
    *,
    max_response_tokens: int = PipelineConfig.max_new_tokens,  # the defaults of `flashdraft train`
    top_k: int = PipelineConfig.store_top_k,
    batch_size: int = PipelineConfig.data_batch_size,
    records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
    progress: bool = True,
    time_limit: float | None = None,
) -> RunStats:
    """Label the existing responses of `prompts` with the target's greedy predictions (teacher forcing) and append
    the records to `output_dir`. Prompts without a response are skipped (regenerate those instead). Resumable the
    same way as `regenerate`."""
    if max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be at least 1, got {max_response_tokens}")
    with_response = [prompt for prompt in prompts if prompt.response]
    if len(with_response) < len(prompts):
        logger.warning(
            "%d of %d prompts have no response to label and are skipped: regenerate them instead",
            len(prompts) - len(with_response),
            len(prompts),
        )
    if not with_response:
        raise ValueError("none of the prompts has a response to label: use regeneration, or prompts with responses")
    settings = label_settings(model, tokenizer, max_response_tokens=max_response_tokens, top_k=top_k,
                              batch_size=batch_size)
    end_token_id = settings["end_token_id"]
    encoded = [encode_with_response(tokenizer, p, end_token_id, max_response_tokens) for p in with_response]
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_token_id

    def process_batch(batch_number: int, batch: list[int]) -> list[TrainingRecord]:
        labelled = label_batch(model, [encoded[i] for i in batch], top_k, pad_token_id)
        return [
            TrainingRecord(
                id=with_response[i].id,
                source=with_response[i].source,
                input_ids=encoded[i][0],
                response_start=encoded[i][1],
                labels=labels,
                topk_ids=top[0] if top else None,
                topk_probs=top[1] if top else None,
            )
            for i, (labels, top) in zip(batch, labelled)
        ]

    average_length = sum(len(ids) for ids, _ in encoded) / len(encoded)
    bytes_per_record = int(average_length * 2 * BYTES_PER_TOKEN + max_response_tokens * top_k * BYTES_PER_TOPK_ENTRY)
    return run_resumable(
        ids=[prompt.id for prompt in with_response],
        lengths=[len(ids) for ids, _ in encoded],
        folder=output_dir,
        settings=settings,
        process_batch=process_batch,
        batch_size=batch_size,
        bytes_per_record=bytes_per_record,
        description="labelling",
        records_per_shard=records_per_shard,
        progress=progress,
        time_limit=time_limit,
    )
