"""The speculative decoding loop: prefill -> propose -> verify -> accept -> roll back.

`stream()` runs the loop as a generator that yields the tokens of each round; `generate()` consumes it. The
same loop with a block size of 1 is plain autoregressive decoding (no proposals, one target token per round).
Batch size 1.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from .adaptive import BlockSizeController, cached_costs
from .draft import DFlashDraftModel, DraftCache
from .sampling import SamplingParams, accept_greedy, accept_sampled, check_seed, probabilities, sample
from .target import TargetModel


def tau(acceptance_lengths: Sequence[int]) -> float:
    """Mean acceptance length (tokens per target verification); 0.0 when there were no rounds."""
    return sum(acceptance_lengths) / len(acceptance_lengths) if acceptance_lengths else 0.0


def acceptance_histogram(acceptance_lengths: Iterable[int]) -> dict[int, int]:
    """Acceptance length -> number of rounds, by increasing length."""
    return dict(sorted(Counter(acceptance_lengths).items()))


@dataclass
class GenerationResult:
    """What one generation produced and how fast. Filled in as the loop runs."""

    tokens: list[int] = field(default_factory=list)  # new tokens only, prompt excluded
    acceptance_lengths: list[int] = field(default_factory=list)  # per round: accepted proposals + bonus
    block_sizes: list[int] = field(default_factory=list)  # per round: tokens verified (anchor + proposals)
    prefill_seconds: float = 0.0  # prompt forward until the first new token is known
    decode_seconds: float = 0.0  # every round after that
    stop_reason: str | None = None  # "stop" (a stop token), "length" (max_new_tokens), or None while running

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per target verification."""
        return tau(self.acceptance_lengths)

    @property
    def time_to_first_token(self) -> float:
        return self.prefill_seconds

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: the tokens produced by rounds (all but the prefill's) per decode second."""
        decoded = len(self.tokens) - 1
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else 0.0


GREEDY = SamplingParams()


class Proposer(Protocol):
    """What the loop needs from a draft: `size - 1` proposed target token ids after an anchor and, when sampling,
    the distribution q over the target's vocabulary they were drawn from (`draft_tokens` turns logits into both).

    `context` holds the target features of the positions verified since the last call (the prompt on the
    first call), which end right before the anchor at position `start`. `block_size` is the block the draft
    drafts (always its own size, or more): only the first `size - 1` of its proposals are used.
    """

    target_layer_ids: list[int] | None
    block_size: int | None  # the block size it drafts best at (the draft's training size), if any

    def begin(self, max_positions: int) -> None: ...

    def propose(
        self, anchor: torch.Tensor, context: torch.Tensor | None, start: int, block_size: int, size: int,
        params: SamplingParams, generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # proposals [size - 1], q [size - 1, V] or None when greedy


def draft_tokens(
    logits: torch.Tensor,  # [n, V_draft] the draft's logits
    vocab_ids: torch.Tensor | None,  # [V_draft] the target ids of the logits' columns; None: all V
    params: SamplingParams,
    generator: torch.Generator | None,
    vocab_size: int,  # V, the target's vocabulary
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft's logits -> (proposals [n] target ids, q [n, V] or None when greedy): the argmax when greedy, else a
    draw from the logits warped like the target's (the same `probabilities`, so q matches p's shaping)."""
    if params.greedy:
        proposals, q = logits.argmax(dim=-1), None
    else:
        q = probabilities(logits, params)
        proposals = sample(q, generator)
    if vocab_ids is not None:  # map drafting-vocabulary columns back to target ids
        proposals = vocab_ids[proposals]
        if q is not None:
            q = q.new_zeros(len(proposals), vocab_size).index_copy_(1, vocab_ids, q)
    return proposals, q


class DFlashProposer:
    """Drafts a block with a DFlash draft: [anchor, mask, ..., mask] in one non-causal pass."""

    def __init__(self, draft: DFlashDraftModel, target: TargetModel):
        check_compatible(draft, target)
        self.draft = draft
        self.target = target
        self.target_layer_ids = draft.target_layer_ids
        self.vocab_ids = draft.draft_vocab_ids
        self.block_size = draft.block_size
        # Only the rows of the drafting vocabulary, if any: the full head dominates a small draft's cost.
        self.head = target.head_rows(self.vocab_ids)

    def begin(self, max_positions: int) -> None:
        device = self.target.device
        # Verified context K/V only: the block's own K/V are dropped again after every pass.
        self.cache = DraftCache(self.draft.config, max_positions, device=device, dtype=self.draft.dtype)
        self.positions = torch.arange(max_positions, device=device)[None]
        self.mask_ids = torch.full((1, max_positions), self.draft.mask_token_id, device=device)

    @torch.no_grad()
    def logits(self, anchor, context, start, block_size) -> torch.Tensor:
        """[block_size - 1, V_draft] logits of the block after the anchor."""
        block = torch.cat([anchor.view(1, 1), self.mask_ids[:, : block_size - 1]], dim=1)  # [1, B]
        first_position = start - context.shape[1]
        dtype = self.draft.dtype  # a draft may run in another precision than its target
        hidden = self.draft(
            self.target.embed(block).to(dtype), context.to(dtype),
            self.positions[:, first_position : start + block_size], self.cache,
        )
        self.cache.crop(-block_size)  # keep the context, drop the block's own K/V
        return self.head(hidden[:, 1:].to(self.head.weight.dtype))[0]  # the anchor's output is dropped

    @torch.no_grad()
    def propose(self, anchor, context, start, block_size, size=None, params=GREEDY, generator=None):
        """`Proposer.propose`; by default the whole block, greedily."""
        logits = self.logits(anchor, context, start, block_size)[: (size or block_size) - 1]
        return draft_tokens(logits, self.vocab_ids, params, generator, self.target.vocab_size)


def check_compatible(draft: DFlashDraftModel, target: TargetModel) -> None:
    """Fail fast, naming the mismatch, when a draft cannot serve this target."""
    config = draft.config
    if config.hidden_size != target.hidden_size:
        raise ValueError(
            f"draft expects target hidden size {config.hidden_size}, target has {target.hidden_size}: "
            "train or pick a draft for this target"
        )
    if config.num_target_layers != target.num_layers:
        raise ValueError(
            f"draft was made for a target with {config.num_target_layers} layers, target has {target.num_layers}: "
            "train or pick a draft for this target"
        )
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(
            f"draft reads target layers {bad}, but the target has layers 0..{target.num_layers - 1} only"
        )
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise ValueError(
            f"draft mask token id {draft.mask_token_id} is outside the target's vocabulary of {target.vocab_size}"
        )


class TokenStream:
    """Iterate to get the tokens of each round as lists; `result` holds the statistics so far (final once the
    iteration ends). `close()` (or leaving a `with` block) stops generation early."""

    def __init__(self, rounds: Iterator[list[int]], result: GenerationResult):
        self._rounds = rounds
        self.result = result

    def __iter__(self) -> Iterator[list[int]]:
        return self._rounds

    def close(self) -> None:
        self._rounds.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream(
    target: PreTrainedModel | TargetModel,
    draft: DFlashDraftModel | Proposer | None,
    input_ids: torch.Tensor | Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    block_size: int | str | None = "auto",
    seed: int | None = None,
) -> TokenStream:
    """Speculative decoding of `target` with `draft`, yielding the tokens of each round as it finishes.

    Lossless: at temperature 0 the tokens are the target's greedy continuation; above it they follow the
    target's own sampling distribution (temperature, then top-k, then top-p). `block_size`: tokens verified per
    round, the anchor included; "auto" (the default, as in the CLI and the server) = chosen round by round for
    the most tokens per second, never above the draft's own, down to 1 when drafting does not pay
    (`flashdraft.adaptive`); None = always the draft's own; 1 (or no draft) is plain autoregressive decoding.
    `seed` (a 64-bit integer) makes sampling reproducible. A temperature so small that logits / T overflows
    (1e-38, even 5e-324) samples exactly too, which there means the argmax, shared among exact ties
    (`flashdraft.sampling.probabilities`).
    """
    target = target if isinstance(target, TargetModel) else TargetModel(target)
    params = SamplingParams(temperature, top_p, top_k)
    check_seed(seed)  # also when greedy, which does not use it: a seed no generator takes is a mistake either way
    if isinstance(draft, DFlashDraftModel):
        draft = DFlashProposer(draft, target)
    check_block_size(block_size, has_draft=draft is not None)
    native = getattr(draft, "block_size", None) if draft is not None else None
    controller = None
    if block_size == "auto":
        if native is None or native < 2:
            block_size = 1
        else:
            block_size = native
            controller = BlockSizeController(native, *cached_costs(target, draft, native))
    elif block_size is None:
        block_size = native or 1
    prompt = _prompt_tensor(input_ids, target)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens}")
    limit = target.max_positions
    if limit is not None and prompt.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"maximum of {limit} positions: shorten the prompt or lower max_new_tokens"
        )
    generator = None
    if not params.greedy:
        generator = torch.Generator(device=target.device)
        generator.manual_seed(seed if seed is not None else torch.seed())
    result = GenerationResult()
    rounds = _decode(
        target, draft, prompt, max_new_tokens, params, frozenset(stop_token_ids or ()), block_size, controller,
        generator, result,
    )
    return TokenStream(rounds, result)


def check_block_size(block_size: int | str | None, *, has_draft: bool) -> None:
    """Fail fast on a block size the loop cannot run: "auto", None (the draft's own) or an integer >= 1, above 1 only
    with a draft."""
    if block_size in ("auto", None):
        return
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 or \"auto\", got {block_size!r}")
    if block_size > 1 and not has_draft:
        raise ValueError(f"block_size {block_size} needs a draft; pass a draft or use block_size=1")


def generate(target, draft, input_ids, **kwargs) -> GenerationResult:
    """`stream()` run to the end; same arguments. Returns the tokens and the statistics."""
    tokens = stream(target, draft, input_ids, **kwargs)
    for _ in tokens:
        pass
    return tokens.result


def _prompt_tensor(input_ids, target: TargetModel) -> torch.Tensor:
    prompt = torch.as_tensor(input_ids, dtype=torch.long, device=target.device)
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise ValueError(f"input_ids must be one sequence (batch size 1), got shape {list(prompt.shape)}")
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if int(prompt.min()) < 0 or int(prompt.max()) >= target.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {target.vocab_size}), the target's vocabulary")
    return prompt[None]


def _decode(
    target: TargetModel,
    proposer: Proposer | None,
    prompt: torch.Tensor,  # [1, P]
    max_new_tokens: int,
    params: SamplingParams,
    stop_ids: frozenset[int],
    block_size: int,
    controller: BlockSizeController | None,
    generator: torch.Generator | None,
    result: GenerationResult,
) -> Iterator[list[int]]:
    if max_new_tokens == 0:
        result.stop_reason = "length"
        return
    prompt_length = prompt.shape[1]
    max_positions = prompt_length + max_new_tokens
    layer_ids = proposer.target_layer_ids if block_size > 1 else None
    positions = torch.arange(max_positions, device=target.device)[None]
    cache = target.new_cache()
    # The draft always drafts at its own block size (it drafts worse at others); a round verifies `size` tokens.
    draft_size = max(block_size, getattr(proposer, "block_size", None) or 0)
    if block_size > 1:
        proposer.begin(max_positions + draft_size)
    pick, accept = _rules(params, generator)  # greedy or sampled, chosen once
    no_proposals = torch.empty(0, dtype=torch.long, device=target.device)
    no_q = None if params.greedy else torch.empty(0, target.vocab_size, device=target.device)

    # 1. Prefill: the prompt's KV cache, its features (the draft's first context) and the first new token.
    began = time.perf_counter()
    logits, features = target.forward(prompt, positions[:, :prompt_length], cache, layer_ids, logits_to_keep=1)
    pending = [features] if features is not None else []  # verified features the draft has not read yet
    anchor = pick(logits[0])  # [1], the last emitted token, not yet in the target's cache, at position `start`
    result.prefill_seconds = time.perf_counter() - began
    began, start = time.perf_counter(), prompt_length
    emitted, going_on = _emit([anchor.item()], result, stop_ids, max_new_tokens)
    yield emitted
    while going_on:
        # 2. Propose: size-1 target tokens after the anchor (none when size == 1), never more than the budget needs.
        size = min(controller.choose() if controller else block_size, max_new_tokens - len(result.tokens))
        proposals, q = no_proposals, no_q
        if size > 1:
            proposals, q = proposer.propose(anchor, _take(pending), start, draft_size, size, params, generator)

        # 3. Verify: one target forward over [anchor, proposals] at their true positions.
        block = torch.cat([anchor, proposals])[None]  # [1, size]
        logits, features = target.forward(block, positions[:, start : start + size], cache, layer_ids)

        # 4. Accept: the longest valid prefix plus the target's own bonus token; one host sync per round.
        accepted, bonus = accept(proposals, q, logits[0])
        values = torch.cat([accepted.view(1), proposals, bonus.view(1)]).tolist()
        num_accepted = values[0]

        # 5. Roll back: the target's cache keeps the anchor and the accepted proposals; their features join
        #    the draft's pending context (rounds without drafting add theirs too); the bonus is the next anchor.
        target.rollback(cache, size - (num_accepted + 1))
        if features is not None:
            pending.append(features[:, : num_accepted + 1])
        anchor, start = bonus.view(1), start + num_accepted + 1
        result.acceptance_lengths.append(num_accepted + 1)
        result.block_sizes.append(size)
        if controller:
            controller.observe(size, num_accepted)
        emitted, going_on = _emit(values[1 : 1 + num_accepted] + [values[-1]], result, stop_ids, max_new_tokens)
        result.decode_seconds = time.perf_counter() - began
        yield emitted


def _rules(params: SamplingParams, generator: torch.Generator | None):
    """The greedy or the sampled rules: (pick: [1, V] logits -> [1] token; accept: (proposals [B-1], q [B-1, V] or
    None, target logits [B, V]) -> (accepted, bonus) 0-d tensors, see `flashdraft.sampling`)."""
    if params.greedy:
        return (lambda logits: logits.argmax(dim=-1)), (lambda proposals, q, logits: accept_greedy(proposals, logits))

    def accept(proposals, q, logits):  # the module's accept_sampled, looked up when called
        return accept_sampled(proposals, q, probabilities(logits, params), generator)

    return (lambda logits: sample(probabilities(logits, params), generator)), accept


def _take(pending: list[torch.Tensor]) -> torch.Tensor | None:
    """The pending features joined (None when there are none) and cleared: the draft's cache holds them next."""
    context = torch.cat(pending, dim=1) if len(pending) > 1 else (pending[0] if pending else None)
    pending.clear()
    return context


def _emit(
    new_tokens: list[int], result: GenerationResult, stop_ids: frozenset[int], max_new_tokens: int
) -> tuple[list[int], bool]:
    """Append what may be emitted of a round's tokens: up to and including a stop token, within the budget.
    Returns (the emitted tokens, whether generation goes on)."""
    emitted = new_tokens[: max_new_tokens - len(result.tokens)]
    for i, token in enumerate(emitted):
        if token in stop_ids:
            emitted = emitted[: i + 1]
            result.stop_reason = "stop"
            break
    result.tokens.extend(emitted)
    if result.stop_reason is None and len(result.tokens) >= max_new_tokens:
        result.stop_reason = "length"
    return emitted, result.stop_reason is None
