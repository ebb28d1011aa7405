"""Continuous batching: several sequences decoded together, each exactly as it would be alone.

A `Batch` holds sequences of different lengths, each with its own budget, stop tokens, sampling parameters and
generator. `add` queues a prompt at any time; `step` runs a prefill and a round (`prefill`, then `decode`):

1. Prefill: half of the queued sequences (at least one) join those being prefilled, and all are prefilled
   together, in one target forward over every row's next chunk of prompt (`TargetModel.prefill_rows`, rows of
   different lengths in a `RowCache` of their own). A step prefills at most `prefill_tokens` tokens (rows x
   widest chunk), so a long prompt is prefilled in chunks over several steps and never stalls the running rows for
   long. A sequence whose prompt is done gets its first token from the logits after its last prompt token, and its
   row moves into the batch's `RowCache` (one row copied). A prompt that begins like earlier ones (a chat
   template's opening, a system prompt) starts from their shared prefix's K/V (`flashdraft.target`'s
   `PromptPrefixes`): its prefill computes only the rest.
2. Propose: each row's proposer (`HybridProposer`: the lookup, the draft or both) plans its round with the
   target's verify costs measured at this batch size (`flashdraft.adaptive.BatchCosts`); the draft then drafts every
   row whose plan drafts in one pass (`DFlashProposer.logits_rows`; a row's first draft context is its prompt's
   features, all chunks).
3. Verify: one target forward over every row's block [anchor, proposals], each row at its own positions. Blocks
   of different lengths are padded at their end to the longest: a row's padding comes after its real tokens, so
   causal attention keeps it out of their logits, and its K/V lie past what the row keeps.
4. Accept: each row by its own rule (`flashdraft.sampling`: the greedy prefix, or rejection sampling with its own
   generator), with its own bonus token, stop tokens and budget (`flashdraft.decoding.emit_tokens`).
5. Roll back: each row keeps its anchor and accepted proposals (`RowCache.keep`); a finished sequence leaves at
   once (the last row takes its place), so a long answer never holds a short one back.

Greedy rows give the tokens they give alone: exactly with the engine's int8 arithmetic (the default on registry
targets: each row's prefill, chunked or from a kept prefix, and each round get the bits they get alone), up to
float32 rounding of a batched product otherwise (as any block size); sampled rows follow the target's distribution
exactly, as the rules are the single sequence's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .adaptive import BatchCosts
from .decoding import (
    GenerationResult,
    check_block_size,
    checked_prompt,
    emit_tokens,
    new_generator,
    proposal_mode,
    round_rules,
)
from .decoding import (
    generate as generate_one,
)
from .draft import DFlashDraftModel
from .proposals import LOOKUP_BLOCK_SIZE, DFlashProposer, HybridProposer
from .sampling import SamplingParams, check_seed
from .target import PromptPrefixes, TargetModel

# Prompt tokens one step prefills at most (rows x widest chunk), which bounds how long a step's prefill stalls the
# running rows: on this 2-core CPU about a second for SmolLM2-135M (some 2 ms a token), a dozen chat prompts.
DEFAULT_PREFILL_TOKENS = 512
# Prompt positions whose K/V (and features) are kept for prompts that begin the same way: a chat template's opening
# and a few system prompts. For SmolLM2-135M in float32, 58 kB a position (60 MB in all).
DEFAULT_PREFIX_CACHE_TOKENS = 1024


@dataclass(eq=False)  # a sequence is itself: a batch finds it by identity
class BatchSequence:
    """One sequence of a `Batch`: `result` fills in as it decodes (its own statistics: `prefill_seconds` is its
    own prefill, `decode_seconds` runs from its first token to its latest round)."""

    result: GenerationResult = field(default_factory=GenerationResult)
    cancelled: bool = False

    @property
    def finished(self) -> bool:
        return self.cancelled or self.result.stop_reason is not None


@dataclass(eq=False)
class _Row:
    sequence: BatchSequence
    prompt: torch.Tensor  # [1, P]
    max_new_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    proposer: HybridProposer | None
    pending: list[torch.Tensor] = field(default_factory=list)  # verified features its proposer has not read
    anchor: int = 0  # the last emitted token, not yet in the target's cache, at position `start`
    start: int = 0  # while prefilling: the prompt tokens prefilled so far
    prefill_began: float = 0.0
    began: float = 0.0  # when its first token was known

    def __post_init__(self):
        self.pick, self.accept = round_rules(self.params, self.generator)


class Batch:
    """Sequences decoded together (see the module docstring). `target`, `draft`, `block_size` and `proposals` mean
    what they mean for `flashdraft.stream`, for every sequence of the batch; a draft must be a `DFlashDraftModel`
    (a `Proposer` object decodes one sequence at a time, with `stream`). With `block_size="auto"` each row's
    round is planned with the costs measured at the batch's size; "dflash" plans the draft's rounds the same way,
    without the lookup. `prefill_tokens`: the most prompt tokens one step prefills (rows x widest chunk), so that
    a long prompt is prefilled over several steps. `prefix_cache_tokens`: the most prompt positions kept for
    prompts that begin like earlier ones (0: none; `flashdraft.target.PromptPrefixes`)."""

    def __init__(
        self,
        target: PreTrainedModel | TargetModel,
        draft: DFlashDraftModel | None = None,
        *,
        block_size: int | str | None = "auto",
        proposals: str | None = None,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
    ):
        if not isinstance(prefill_tokens, int) or prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be an integer >= 1, got {prefill_tokens!r}")
        if draft is not None and not isinstance(draft, DFlashDraftModel):
            raise ValueError("a batch drafts with a DFlashDraftModel; a proposer object decodes one sequence at a time "
                             "(flashdraft.stream)")
        self.target = target if isinstance(target, TargetModel) else TargetModel(target)
        self.mode = proposal_mode(draft, proposals)
        check_block_size(block_size, has_draft=self.mode is not None)
        self.dflash = DFlashProposer(draft, self.target) if draft is not None and self.mode != "lookup" else None
        native = self.dflash.block_size if self.dflash else LOOKUP_BLOCK_SIZE
        if self.mode == "hybrid":  # the lookup fills rounds longer than the draft's block
            native = max(native, LOOKUP_BLOCK_SIZE)
        if self.mode is None:
            self.max_size = 1
        else:
            self.max_size = native if block_size in ("auto", None) else block_size
        self.costs = None
        if block_size == "auto" and self.max_size > 1:
            self.costs = BatchCosts(self.target, self.dflash or HybridProposer(self.target, None, native), native)
        # The draft drafts at its own block size, or alone at the round's when larger (as `stream` does).
        self.draft_size = 0
        if self.dflash:
            own = self.dflash.block_size
            self.draft_size = own if self.mode == "hybrid" else max(self.max_size, own)
        self.layer_ids = self.dflash.target_layer_ids if self.dflash else None
        self.prefill_tokens = prefill_tokens
        self.cache = self.target.new_row_cache()
        self.draft_cache = self.dflash.new_row_cache() if self.dflash else None
        self.rows: list[_Row] = []  # in the order of the caches' rows
        self.prefill_cache = self.target.new_row_cache()  # the rows being prefilled, in the order of `prefilling`
        self.prefixes = PromptPrefixes(prefix_cache_tokens)
        self.prefilling: list[_Row] = []
        self.waiting: list[_Row] = []

    def __len__(self) -> int:
        """Sequences not finished yet: running, being prefilled and waiting."""
        return len(self.rows) + len(self.prefilling) + len(self.waiting)

    def add(
        self,
        input_ids: torch.Tensor | Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> BatchSequence:
        """Queue a sequence (checked now); it joins at the next `step`. Arguments as in `flashdraft.stream`."""
        params = SamplingParams(temperature, top_p, top_k)
        check_seed(seed)
        prompt = checked_prompt(input_ids, self.target, max_new_tokens)
        proposer = None
        if self.mode is not None and self.max_size > 1:
            proposer = HybridProposer(self.target, self.dflash, self.max_size, lookup=self.mode != "dflash",
                                      full_first_probe=False)
        sequence = BatchSequence()
        self.waiting.append(_Row(sequence, prompt, max_new_tokens, params, frozenset(stop_token_ids or ()),
                                 new_generator(params, seed, self.target.device), proposer))
        return sequence

    def release_rows(self) -> None:
        """With no sequence left, start from empty row caches: the K/V tensors grow to the most rows and positions
        they have held and never shrink, so an idle server would keep a past peak's memory. The kept prompt prefixes
        stay (they are what later prompts are served from)."""
        if len(self) == 0:
            self.cache = self.target.new_row_cache()
            self.draft_cache = self.dflash.new_row_cache() if self.dflash else None
            self.prefill_cache = self.target.new_row_cache()

    def cancel(self, sequence: BatchSequence) -> None:
        """Stop a sequence: it leaves the batch now, running, being prefilled or waiting (its rows are freed)."""
        sequence.cancelled = True
        self._leave_cancelled()

    def step(self) -> list[tuple[BatchSequence, list[int]]]:
        """`prefill`, then `decode`: the tokens each sequence emitted in this step (a sequence that finished has
        left the batch)."""
        return self.prefill() + self.decode()

    def prefill(self) -> list[tuple[BatchSequence, list[int]]]:
        """1. One forward over the next chunk of every sequence being prefilled, half of the queued ones joining
        them (as far as `prefill_tokens` allows). Returns the first token of each sequence whose prompt is done
        (it runs in the next `decode`, unless that token ended it); nothing when none waits."""
        emitted = []
        # Half of the queue joins (at least one): under a burst of requests the first half has its first token
        # after one forward, instead of all of them after one forward twice as long (half the burst's median time
        # to first token, and the prompts still share forwards); the rest join at the next step.
        joining = (len(self.waiting) + 1) // 2
        while joining and len(self.prefilling) < self.prefill_tokens:
            row = self.waiting.pop(0)
            joining -= 1
            if row.max_new_tokens == 0:
                row.sequence.result.stop_reason = "length"
                emitted.append((row.sequence, []))
                continue
            row.prefill_began = time.perf_counter()
            row.start, features = self.prefixes.start_row(row.prompt[0], self.prefill_cache)
            row.sequence.result.cached_prompt_tokens = row.start
            if features is not None and self.layer_ids is not None:
                row.pending.append(features)
            self.prefilling.append(row)
        if not self.prefilling:
            return emitted
        # Every row being prefilled takes a chunk of the same width at most, within the step's budget.
        rows = self.prefilling
        width = min(max(len(row.prompt[0]) - row.start for row in rows), self.prefill_tokens // len(rows))
        chunks = [row.prompt[0, row.start : row.start + width] for row in rows]
        logits, features = self.target.prefill_rows(chunks, [row.start for row in rows], self.prefill_cache,
                                                    self.layer_ids)
        done = []
        for i, (row, chunk) in enumerate(zip(rows, chunks)):
            row.start += len(chunk)
            if features is not None:
                row.pending.append(features[i])
            if row.start == row.prompt.shape[1]:
                done.append(i)
                self.prefixes.remember(row.prompt[0], self.prefill_cache, i, row.pending)
                emitted.append((row.sequence, self._join(row, logits[i], i)))
        for i in reversed(done):  # the highest index first: the last row takes each leaver's place
            self.prefill_cache.remove(i)
            rows[i] = rows[-1]
            rows.pop()
        return emitted

    def decode(self) -> list[tuple[BatchSequence, list[int]]]:
        """2-5. One round over every running sequence: the tokens each emitted (a finished one has left)."""
        return self._round() if self.rows else []

    def _join(self, row: _Row, logits: torch.Tensor, prefill_row: int) -> list[int]:
        """A prefilled row's first token (from `logits`, [1, V]); it joins the running rows unless that ends it."""
        first = row.pick(logits).item()
        if row.proposer is not None:
            row.proposer.observe(row.prompt[0].tolist() + [first])
        result = row.sequence.result
        row.anchor, row.began = first, time.perf_counter()
        result.prefill_seconds = row.began - row.prefill_began
        emitted, going_on = emit_tokens([first], result, row.stop_ids, row.max_new_tokens)
        if going_on:
            self.cache.add_from(self.prefill_cache, prefill_row, row.start)
            if self.draft_cache is not None:
                self.draft_cache.add_row()
            self.rows.append(row)
        return emitted

    def _round(self) -> list[tuple[BatchSequence, list[int]]]:
        rows, device = self.rows, self.target.device
        # 2. Propose: each row plans its round; the draft drafts the rows that asked for it in one pass.
        costs = self.costs.at(len(rows)) if self.costs is not None else None
        plans = []
        for row in rows:
            size = min(self.max_size, row.max_new_tokens - len(row.sequence.result.tokens))
            plan = None
            if row.proposer is not None and size > 1:
                row.proposer.costs = costs
                plan = row.proposer.prepare(_take(row.pending), size, greedy=row.params.greedy)
            plans.append(plan)
        drafting = [i for i, plan in enumerate(plans) if plan is not None and plan.draft]
        draft_logits = dict.fromkeys(range(len(rows)))
        if drafting:
            logits = self.dflash.logits_rows(
                self.draft_cache, drafting, torch.tensor([rows[i].anchor for i in drafting], device=device),
                [rows[i].proposer.take_context() for i in drafting], [rows[i].start for i in drafting],
                self.draft_size, [plans[i].size for i in drafting],
            )
            draft_logits.update(zip(drafting, logits))
        no_proposals = torch.empty(0, dtype=torch.long, device=device)
        no_q = torch.empty(0, self.target.vocab_size, device=device)
        proposed = [
            row.proposer.complete(draft_logits[i], row.params, row.generator) if plans[i] is not None
            else (no_proposals, None if row.params.greedy else no_q)
            for i, row in enumerate(rows)
        ]

        # 3. Verify: one forward over every row's [anchor, proposals], padded at the end to the longest block.
        width = 1 + max(len(proposals) for proposals, _ in proposed)
        anchors = torch.tensor([row.anchor for row in rows], device=device)
        block = anchors[:, None].repeat(1, width)  # [b, width]; the padding repeats the anchor (never seen)
        for i, (proposals, _) in enumerate(proposed):
            block[i, 1 : 1 + len(proposals)] = proposals
        starts = torch.tensor([row.start for row in rows], device=device)
        positions = starts[:, None] + torch.arange(width, device=device)
        logits, features = self.target.forward_rows(block, positions, self.cache, self.layer_ids)

        # 4. Accept: each row by its own rule; one host sync for the whole batch.
        outcomes = []
        for i, (row, (proposals, q)) in enumerate(zip(rows, proposed)):
            accepted, bonus = row.accept(proposals, q, logits[i, : 1 + len(proposals)])
            outcomes.append(torch.cat([accepted.view(1), bonus.view(1), proposals]))
        values = torch.cat(outcomes).tolist()

        # 5. Roll back each row to its accepted tokens; emit; finished rows leave.
        emitted, finished, offset, now = [], [], 0, time.perf_counter()
        for i, (row, (proposals, _)) in enumerate(zip(rows, proposed)):
            num_accepted, bonus = values[offset], values[offset + 1]
            new_tokens = values[offset + 2 : offset + 2 + num_accepted] + [bonus]
            offset += 2 + len(proposals)
            sources = row.proposer.observe(new_tokens) if row.proposer is not None else []
            if features is not None:
                row.pending.append(features[i : i + 1, : num_accepted + 1])
            row.anchor, row.start = bonus, row.start + num_accepted + 1
            result = row.sequence.result
            result.acceptance_lengths.append(num_accepted + 1)
            result.block_sizes.append(1 + len(proposals))
            tokens, going_on = emit_tokens(new_tokens, result, row.stop_ids, row.max_new_tokens)
            result.accepted_by_source.update(sources[: len(tokens)])
            result.decode_seconds = now - row.began
            emitted.append((row.sequence, tokens))
            if not going_on:
                finished.append(i)
        self.cache.keep([row.start for row in rows])
        self._leave(finished)
        return emitted

    def _leave_cancelled(self) -> None:
        """Cancelled sequences leave: running, being prefilled or waiting (the last row takes each one's place)."""
        self._leave([i for i, row in enumerate(self.rows) if row.sequence.cancelled])
        for i in reversed(range(len(self.prefilling))):
            if self.prefilling[i].sequence.cancelled:
                self.prefill_cache.remove(i)
                self.prefilling[i] = self.prefilling[-1]
                self.prefilling.pop()
        self.waiting = [row for row in self.waiting if not row.sequence.cancelled]

    def _leave(self, indices: list[int]) -> None:
        """Rows leave, the highest index first: each time the last row takes the leaver's place, in every cache."""
        for i in sorted(indices, reverse=True):
            self.cache.remove(i)
            if self.draft_cache is not None:
                self.draft_cache.remove_row(i)
            self.rows[i] = self.rows[-1]
            self.rows.pop()


def _take(pending: list[torch.Tensor]) -> torch.Tensor | None:
    context = torch.cat(pending, dim=1) if len(pending) > 1 else (pending[0] if pending else None)
    pending.clear()
    return context


def is_batch(input_ids) -> bool:
    """Whether `input_ids` holds several prompts: a list (or tuple) of sequences, or a 2-D tensor of more than one
    row."""
    if isinstance(input_ids, torch.Tensor):
        return input_ids.dim() == 2 and input_ids.shape[0] > 1
    return isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and not isinstance(input_ids[0], int)


def generate(target, draft, input_ids, **kwargs) -> GenerationResult | list[GenerationResult]:
    """`flashdraft.generate`: one prompt (token ids, or a [1, P] tensor) -> its `GenerationResult`, as
    `flashdraft.decoding.generate`; several prompts (a list of token-id lists or 1-D tensors, of any lengths, or a
    [b, P] tensor of equal-length prompts, no padding) -> one `GenerationResult` per prompt, in order, decoded
    together in a `Batch`. Each prompt is decoded with the same arguments as it would be alone, `seed` included.
    Keyword arguments as in `flashdraft.stream`."""
    if not is_batch(input_ids):
        return generate_one(target, draft, input_ids, **kwargs)
    batch_options = {key: kwargs.pop(key) for key in ("block_size", "proposals") if key in kwargs}
    batch = Batch(target, draft, **batch_options)
    sequences = [batch.add(prompt, **kwargs) for prompt in input_ids]
    while batch:
        batch.step()
    return [sequence.result for sequence in sequences]
