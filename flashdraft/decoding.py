"""The speculative decoding loop: prefill -> propose -> verify -> accept -> roll back.

`stream()` runs the loop as a generator that yields the tokens of each round; `generate()` consumes it. The
same loop with a block size of 1 is plain autoregressive decoding (no proposals, one target token per round).
One sequence; `flashdraft.batching` decodes several together with the same rules.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .adaptive import BlockSizeController, cached_costs
from .draft import DFlashDraftModel
from .proposals import LOOKUP_BLOCK_SIZE, DFlashProposer, HybridProposer, Proposer
from .rules import PROPOSAL_MODES, tau
from .rules import check_block_size as check_integer_block_size
from .sampling import SamplingParams, accept_greedy, accept_sampled, check_seed, greedy, probabilities, sample
from .target import TargetModel


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
    accepted_by_source: Counter[str] = field(default_factory=Counter)  # accepted proposals: "dflash", "lookup"
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from a kept prefix (batches), not computed

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per target verification."""
        return tau(self.acceptance_lengths)

    @property
    def tokens_by_source(self) -> dict[str, int]:
        """New tokens by origin: the accepted proposals of each source, and the target's own ("target": the
        prefill's token and every round's bonus)."""
        return {"target": len(self.tokens) - sum(self.accepted_by_source.values()), **self.accepted_by_source}

    @property
    def time_to_first_token(self) -> float:
        return self.prefill_seconds

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: the tokens produced by rounds (all but the prefill's) per decode second."""
        decoded = len(self.tokens) - 1
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else 0.0


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
    proposals: str | None = None,
) -> TokenStream:
    """Speculative decoding of `target` with `draft`, yielding the tokens of each round as it finishes.

    Lossless: at temperature 0 the tokens are the target's greedy continuation; above it they follow the
    target's own sampling distribution (temperature, then top-k, then top-p). `block_size`: tokens verified per
    round, the anchor included; "auto" (the default, as in the CLI and the server) = chosen round by round for
    the most tokens per second, never above the draft's own, down to 1 when drafting does not pay
    (`flashdraft.adaptive`); None = always the draft's own; 1 (or no draft) is plain autoregressive decoding.
    `proposals` says what a round verifies (`flashdraft.proposals`): "hybrid" (the default with a draft) = round by
    round, the draft's block, the continuation of the context's latest match of its last tokens (lookup), the one
    then the other, or nothing, whichever is expected to yield the most tokens per second; "dflash" = the draft's
    block alone; "lookup" = the context alone, no draft needed (a draft given is not used). A `Proposer` given as
    `draft` runs as it is. With "hybrid" and "lookup" an integer `block_size` is the largest round, and every round
    proposes all it has (the continuation, then the draft's tokens to fill the block); "auto" chooses.
    `seed` (a 64-bit integer) makes sampling reproducible. A temperature so small that logits / T overflows
    (1e-38, even 5e-324) samples exactly too, which there means the argmax, shared among exact ties
    (`flashdraft.sampling.probabilities`).
    """
    target = target if isinstance(target, TargetModel) else TargetModel(target)
    params = SamplingParams(temperature, top_p, top_k)
    check_seed(seed)  # also when greedy, which does not use it: a seed no generator takes is a mistake either way
    proposer, block_size, controller = _proposer(target, draft, proposals, block_size)
    prompt = checked_prompt(input_ids, target, max_new_tokens)
    generator = new_generator(params, seed, target.device)
    result = GenerationResult()
    rounds = _decode(
        target, proposer, prompt, max_new_tokens, params, frozenset(stop_token_ids or ()), block_size, controller,
        generator, result,
    )
    return TokenStream(rounds, result)


def checked_prompt(input_ids, target: TargetModel, max_new_tokens: int) -> torch.Tensor:
    """The prompt as a [1, P] tensor, checked with the budget against the target's vocabulary and positions."""
    prompt = _prompt_tensor(input_ids, target)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens}")
    limit = target.max_positions
    if limit is not None and prompt.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"maximum of {limit} positions: shorten the prompt or lower max_new_tokens"
        )
    return prompt


def new_generator(params: SamplingParams, seed: int | None, device: torch.device) -> torch.Generator | None:
    """A sampling run's generator, seeded (`seed`, else a fresh random seed); None when greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else torch.seed())
    return generator


def proposal_mode(draft: DFlashDraftModel | Proposer | None, proposals: str | None) -> str | None:
    """What `proposals` means with this draft: "hybrid", "dflash", "lookup", or None (plain decoding); fails on a
    combination that cannot run."""
    check_proposals(proposals)
    if proposals in ("hybrid", "dflash") and draft is None:
        raise ValueError(f"proposals={proposals!r} needs a draft: pass one, or use proposals='lookup' (no draft)")
    if proposals == "hybrid" and not isinstance(draft, DFlashDraftModel):
        raise ValueError("proposals='hybrid' combines the lookup with a DFlash draft (a DFlashDraftModel); a proposer "
                         "object runs alone: proposals='dflash' or None")
    if proposals is None:
        return "hybrid" if isinstance(draft, DFlashDraftModel) else None if draft is None else "dflash"
    return proposals


def _proposer(
    target: TargetModel, draft: DFlashDraftModel | Proposer | None, proposals: str | None, block_size: int | str | None
) -> tuple[Proposer | None, int, BlockSizeController | None]:
    """What `stream`'s `draft`, `proposals` and `block_size` mean: (the proposer, None for plain decoding; the
    largest round's size; the controller choosing each round's size, for a proposer object alone under "auto")."""
    proposals = proposal_mode(draft, proposals)
    dflash = DFlashProposer(draft, target) if isinstance(draft, DFlashDraftModel) else draft
    if proposals == "dflash":
        check_block_size(block_size, has_draft=True)
        native = getattr(dflash, "block_size", None)
        if block_size == "auto":
            if native is None or native < 2:
                return dflash, 1, None
            costs = cached_costs(target, dflash, native)
            if isinstance(dflash, DFlashProposer):  # as a batch runs it: rounds sized by the draft's confidence
                return HybridProposer(target, dflash, native, costs, lookup=False), native, None
            return dflash, native, BlockSizeController(native, *costs)
        return dflash, block_size if block_size is not None else native or 1, None
    check_block_size(block_size, has_draft=proposals is not None)
    if proposals is None:
        return None, 1, None
    dflash = dflash if proposals == "hybrid" else None
    native = max(dflash.block_size, LOOKUP_BLOCK_SIZE) if dflash else LOOKUP_BLOCK_SIZE
    max_size = native if block_size in ("auto", None) else block_size
    costs = None
    if block_size == "auto":  # the same measurements as the draft alone's controller (the lookup's pass: nothing)
        costs = cached_costs(target, dflash or HybridProposer(target, None, native), native)
    return HybridProposer(target, dflash, max_size, costs), max_size, None


def check_proposals(proposals: str | None) -> None:
    """Fail fast on a proposals mode the loop does not know (None is the default)."""
    if proposals is not None and proposals not in PROPOSAL_MODES:
        raise ValueError(f"proposals must be one of {', '.join(PROPOSAL_MODES)} (or None: the default), "
                         f"got {proposals!r}")


def check_block_size(block_size: int | str | None, *, has_draft: bool) -> None:
    """Fail fast on a block size the loop cannot run: "auto", None (the draft's own) or an integer >= 1, above 1 only
    with something to propose (a draft, or the lookup)."""
    if block_size in ("auto", None):
        return
    check_integer_block_size(block_size, hint=' (or "auto", or None: the draft\'s own)')
    if block_size > 1 and not has_draft:
        raise ValueError(
            f"block_size {block_size} needs proposals: pass a draft, or proposals='lookup', or use block_size=1"
        )


def generate(target, draft, input_ids, **kwargs) -> GenerationResult:
    """`stream()` run to the end; same arguments. Returns the tokens and the statistics. (`flashdraft.generate`
    also takes several prompts: `flashdraft.batching.generate`.)"""
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
    speculating = block_size > 1
    layer_ids = proposer.target_layer_ids if speculating else None
    positions = torch.arange(max_positions, device=target.device)[None]
    cache = target.new_cache()
    # The draft always drafts at its own block size (it drafts worse at others); a round verifies `size` tokens.
    draft_size = max(block_size, getattr(proposer, "block_size", None) or 0)
    if speculating:
        proposer.begin(max_positions + draft_size)
    pick, accept = round_rules(params, generator)  # greedy or sampled, chosen once
    no_proposals = torch.empty(0, dtype=torch.long, device=target.device)
    no_q = None if params.greedy else torch.empty(0, target.vocab_size, device=target.device)

    # 1. Prefill: the prompt's KV cache, its features (the draft's first context) and the first new token.
    began = time.perf_counter()
    logits, features = target.forward(prompt, positions[:, :prompt_length], cache, layer_ids, logits_to_keep=1)
    pending = [features] if features is not None else []  # verified features the draft has not read yet
    anchor = pick(logits[0])  # [1], the last emitted token, not yet in the target's cache, at position `start`
    first = anchor.item()
    if speculating:  # the sequence so far, which the lookup reads
        proposer.observe(prompt[0].tolist() + [first])
    result.prefill_seconds = time.perf_counter() - began
    began, start = time.perf_counter(), prompt_length
    emitted, going_on = emit_tokens([first], result, stop_ids, max_new_tokens)
    yield emitted
    while going_on:
        # 2. Propose: up to size-1 target tokens after the anchor (none when size == 1), never more than the budget
        #    needs; a proposer may propose fewer (a lookup without a match: none), and the round verifies those.
        size = min(controller.choose() if controller else block_size, max_new_tokens - len(result.tokens))
        proposals, q = no_proposals, no_q
        if size > 1:
            proposals, q = proposer.propose(anchor, _take(pending), start, draft_size, size, params, generator)
            size = 1 + len(proposals)

        # 3. Verify: one target forward over [anchor, proposals] at their true positions.
        block = torch.cat([anchor, proposals])[None]  # [1, size]
        logits, features = target.forward(block, positions[:, start : start + size], cache, layer_ids)

        # 4. Accept: the longest valid prefix plus the target's own bonus token; one host sync per round.
        accepted, bonus = accept(proposals, q, logits[0])
        values = torch.cat([accepted.view(1), proposals, bonus.view(1)]).tolist()
        num_accepted = values[0]

        # 5. Roll back: the target's cache keeps the anchor and the accepted proposals; their features join
        #    the draft's pending context (rounds without drafting add theirs too); the bonus is the next anchor. The
        #    proposer sees the round's tokens and says which source proposed each accepted one.
        target.rollback(cache, size - (num_accepted + 1))
        new_tokens = values[1 : 1 + num_accepted] + [values[-1]]
        sources = proposer.observe(new_tokens) if speculating else []
        if features is not None:
            pending.append(features[:, : num_accepted + 1])
        anchor, start = bonus.view(1), start + num_accepted + 1
        result.acceptance_lengths.append(num_accepted + 1)
        result.block_sizes.append(size)
        if controller:
            controller.observe(size, num_accepted)
        emitted, going_on = emit_tokens(new_tokens, result, stop_ids, max_new_tokens)
        result.accepted_by_source.update(sources[: len(emitted)])  # what a stop token cut off was not emitted
        result.decode_seconds = time.perf_counter() - began
        yield emitted


def round_rules(params: SamplingParams, generator: torch.Generator | None):
    """The greedy or the sampled rules: (pick: [1, V] logits -> [1] token; accept: (proposals [B-1], q [B-1, V] or
    None, target logits [B, V]) -> (accepted, bonus) 0-d tensors, see `flashdraft.sampling`)."""
    if params.greedy:
        return greedy, (lambda proposals, q, logits: accept_greedy(proposals, logits))

    def accept(proposals, q, logits):  # the module's accept_sampled, looked up when called
        return accept_sampled(proposals, q, probabilities(logits, params), generator)

    return (lambda logits: sample(probabilities(logits, params), generator)), accept


def _take(pending: list[torch.Tensor]) -> torch.Tensor | None:
    """The pending features joined (None when there are none) and cleared: the draft's cache holds them next."""
    context = torch.cat(pending, dim=1) if len(pending) > 1 else (pending[0] if pending else None)
    pending.clear()
    return context


def emit_tokens(
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
