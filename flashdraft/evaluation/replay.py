"""Acceptance by replay: the tau a draft gets on the target's greedy answers, without running the decoding loop.

At temperature 0 the loop's output is the target's greedy continuation whatever the draft proposes, and in every
round the draft sees only tokens of that continuation and the target's features of the positions before the
anchor. Given the continuation and the target's features over prompt + continuation (one forward), the rounds can
be replayed with draft forwards alone: accept the longest prefix of the proposals that matches the continuation,
put the next anchor right after it. The acceptance lengths are those of `flashdraft.generate` at the same fixed
block size (up to floating-point differences between one long forward and the loop's cached ones), at a fraction
of its cost: no verification forwards, and answers written in batches. Training evaluates every checkpoint this
way on features computed once; `flashdraft bench --replay` measures tau on many prompts quickly.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..decoding import acceptance_histogram, tau
from ..files import cache_home, write_atomic
from ..proposals import GREEDY, Proposer
from ..rules import check_block_size
from ..sampling import matching_prefix
from ..target import TargetModel


@dataclass
class ReplayText:
    """A prompt and the target's greedy answer to it, with the target's features over both."""

    token_ids: torch.Tensor  # [L] prompt then answer
    prompt_length: int
    features: torch.Tensor  # [1, L, k*d] the draft's feature layers, concatenated

    @property
    def answer_length(self) -> int:
        return self.token_ids.numel() - self.prompt_length


@torch.no_grad()
def replay_text(target: TargetModel, layer_ids: list[int], prompt: Sequence[int], answer: Sequence[int]) -> ReplayText:
    """Features of prompt + answer for the draft's `layer_ids` (one uncached forward)."""
    if not answer:
        raise ValueError("an answer to replay needs at least one token")
    token_ids = torch.tensor([*prompt, *answer], device=target.device)
    positions = torch.arange(token_ids.numel(), device=target.device)[None]
    _, features = target.forward(token_ids[None], positions, target.new_cache(), layer_ids, logits_to_keep=1)
    return ReplayText(token_ids, len(prompt), features)


@torch.no_grad()
def replay(proposer: Proposer, text: ReplayText, block_size: int, draft_size: int | None = None) -> list[int]:
    """Acceptance lengths of the rounds the greedy loop runs on `text` at a fixed `block_size` with
    max_new_tokens = the answer's length (the first token, from the prefill, is not a round). `draft_size`: the
    block the draft runs (anchor and masks), by default the larger of `block_size` and the draft's own, as the
    loop runs it; a smaller one (at least `block_size`) measures what drafting fewer positions costs in accepted
    tokens."""
    check_block_size(block_size)
    if draft_size is None:
        draft_size = max(block_size, proposer.block_size or 0)
    elif draft_size < block_size:
        raise ValueError(f"draft_size {draft_size} cannot be smaller than block_size {block_size}")
    ids, prompt_length = text.token_ids, text.prompt_length
    proposer.begin(ids.numel() + draft_size)
    lengths: list[int] = []
    start, context_start = prompt_length, 0  # the anchor's position; the first position the draft has not seen
    while (emitted := start - prompt_length + 1) < text.answer_length:
        size = min(block_size, text.answer_length - emitted)
        accepted = 0
        if size > 1:
            context = text.features[:, context_start:start]
            proposals, _ = proposer.propose(ids[start : start + 1], context, start, draft_size, size, GREEDY, None)
            accepted = int(matching_prefix(proposals, ids[start + 1 : start + size]))
            context_start = start
        lengths.append(accepted + 1)
        start += accepted + 1
    return lengths


def greedy_answers(
    model, prompts: Sequence[list[int]], max_new_tokens: int, stop_ids: Sequence[int], batch_size: int = 8,
    progress: bool = True,
) -> list[list[int]]:
    """The target's greedy answer to each prompt, decoded in batches of similar length (left-padded). Batching
    can flip a near-tie now and then against one-by-one decoding; the replayed tau is the draft's on these answers."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    target = model if isinstance(model, TargetModel) else TargetModel(model)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    with tqdm(total=len(prompts), desc="target answers", unit="prompt", disable=not progress) as bar:
        for first in range(0, len(order), batch_size):
            batch = order[first : first + batch_size]
            responses = target.generate_batch([prompts[i] for i in batch], max_new_tokens, stop_ids)
            for i, response in zip(batch, responses):
                answers[i] = response
            bar.update(len(batch))
    return answers


def cached_greedy_answers(
    model, prompts: Sequence[list[int]], max_new_tokens: int, stop_ids: Sequence[int], batch_size: int,
    cache_dir: Path | None = None, progress: bool = True,
) -> list[list[int]]:
    """`greedy_answers`, kept in `cache_dir` ($FLASHDRAFT_HOME/answers by default) under a key of the target (name,
    shapes, dtype, device and a checksum of its embeddings), the prompts and the settings: comparing drafts on the
    same prompts writes the answers once."""
    target = model if isinstance(model, TargetModel) else TargetModel(model)
    embeddings = target.embed_tokens.weight.detach()
    key = json.dumps({
        **target.identity(), "dtype": str(embeddings.dtype), "device": embeddings.device.type,
        "checksum": float(embeddings.double().sum()),  # the same name and shape with other weights answer otherwise
        "prompts": [list(p) for p in prompts], "max_new_tokens": max_new_tokens, "stop_ids": list(stop_ids),
        "batch_size": batch_size,
    })
    path = Path(cache_dir or cache_home() / "answers") / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    answers = greedy_answers(model, prompts, max_new_tokens, stop_ids, batch_size, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(answers))  # a killed run leaves no half-written answers behind
    return answers


@dataclass
class ReplaySummary:
    dataset: str
    block_size: int
    prompts: int
    answer_tokens: float  # mean per prompt
    tau: float  # pooled over all rounds of all prompts
    acceptance_histogram: dict[int, int]


def summarize_replay(dataset: str, block_size: int, texts: Sequence[ReplayText],
                     lengths: Sequence[list[int]]) -> ReplaySummary:
    pooled = [length for rounds in lengths for length in rounds]
    return ReplaySummary(dataset, block_size, len(texts), sum(t.answer_length for t in texts) / max(len(texts), 1),
                         tau(pooled), acceptance_histogram(pooled))


def markdown_replay_table(summaries: Sequence[ReplaySummary]) -> str:
    lines = ["| dataset | block size | prompts | answer tokens | tau |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {s.dataset} | {s.block_size} | {s.prompts} | {s.answer_tokens:.1f} | {s.tau:.2f} |"
              for s in summaries]
    return "\n".join(lines)
