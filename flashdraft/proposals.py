"""The proposers: what the decoding loop verifies after each anchor.

    DFlashProposer  the DFlash draft's block: [anchor, mask, ..., mask] in one non-causal pass
    HybridProposer  each round, whichever of these is expected to yield the most tokens per second:
                        nothing           plain decoding: one token for a one-token target forward
                        lookup, size s    the first s-1 tokens of the context's continuation (`flashdraft.lookup`)
                        draft, size s     the first s-1 tokens of the draft's block, for one draft pass more
                        merge, size s     the whole continuation, then the draft's tokens after it, one pass more
                    Without a draft (`proposals="lookup"`), the first two only.

A round of size s yields E(s) = 1 + a_1 + a_1 a_2 + ... tokens, where a_k is the chance that proposal k is accepted
given that the ones before it were, taken from the source that proposes position k; its cost is the target's
forward over s tokens plus the draft's pass in rounds that run it, both measured once per machine
(`flashdraft.adaptive.cached_costs`). The a_k are tracked per source and position as decayed counts, the lookup's
also per match length n (a longer match predicts better). The lookup is scored on every continuation it found,
used or not, and over its whole length: its proposals are deterministic, so the chance that proposal k would have
been accepted is the chance that the target's token there is the proposed one, and the verified sequence shows
that, for the greedy and the sampled rule alike. A continuation is scored once the sequence has shown its first
miss (or all of it), in later rounds if need be; scoring only what a round verified would leave the positions past
short rounds at their prior for good, and the estimates would keep the rounds short. The draft is scored where its
tokens were verified; while it does not pay, a probe round runs it after 32 rounds without it, then 64, 128, ...
(as `flashdraft.adaptive` does). A greedy round that drafts is sized again once the draft has run, from the
probability the draft gives each of its tokens (`HybridProposer.confident_plan`): the round stops where the draft
stops believing, and goes the whole block where it is sure.

Sampling stays exact: a lookup token is a draw from a one-hot q (`lookup_q`), which the rejection rule accepts with
probability p(token) and otherwise resamples from p without it; the draft's tokens are drawn from its own q. Every
choice a round makes depends only on what was verified before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .adaptive import VerifyCosts, first_probe_size
from .draft import DFlashDraftModel, DraftCache, RowDraftCache
from .engine import DraftEngine
from .lookup import ContextIndex
from .sampling import SamplingParams, greedy, probabilities, sample
from .target import TargetModel

GREEDY = SamplingParams()
SOURCES = ("dflash", "lookup")
LOOKUP_BLOCK_SIZE = 16  # the most tokens a lookup round verifies when there is no draft to take the size from
DECAY = 0.97  # per scored round: acceptance estimates follow the text as it changes
FIRST_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 32, 512
# Among options expected within this share of the best tokens per second, the longest round: the estimates are
# only estimates, a longer round costs next to nothing more where verification is cheap, and it shows more of the
# sources' acceptance.
NEAR_BEST = 0.97


class Proposer(Protocol):
    """What the loop needs from a proposer: up to `size - 1` proposed target token ids after an anchor and, when
    sampling, the distribution q over the target's vocabulary they were drawn from (`draft_tokens` turns logits into
    both). It may propose fewer, none included: the loop verifies what it gets.

    `context` holds the target features of the positions verified since the last call (the prompt on the
    first call), which end right before the anchor at position `start`. `block_size` is the block the draft
    drafts (always its own size, or more): only the first `size - 1` of its proposals are used. `observe` gets the
    tokens that joined the sequence: the prompt and the first new token after the prefill, then each round's
    accepted proposals and bonus token; it returns the source of each accepted proposal of the round, in order.
    """

    target_layer_ids: list[int] | None
    block_size: int | None  # the block size it drafts best at (the draft's training size), if any

    def begin(self, max_positions: int) -> None: ...

    def propose(
        self, anchor: torch.Tensor, context: torch.Tensor | None, start: int, block_size: int, size: int,
        params: SamplingParams, generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # proposals [n <= size - 1], q [n, V] or None when greedy

    def observe(self, tokens: list[int]) -> list[str]: ...


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
        proposals, q = greedy(logits), None
    else:
        q = probabilities(logits, params)
        proposals = sample(q, generator)
    if vocab_ids is not None:  # map drafting-vocabulary columns back to target ids
        proposals = vocab_ids[proposals]
        if q is not None:
            q = q.new_zeros(len(proposals), vocab_size).index_copy_(1, vocab_ids, q)
    return proposals, q


def lookup_q(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n] deterministic proposals -> [n, V] the q they were 'drawn' from: one-hot at each."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()


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
        # The draft's pass on the target's engine where it runs there, else the module with the engine's kernels.
        self.forward = target.draft_forward(draft)
        self.on_engine = isinstance(self.forward, DraftEngine)
        if self.on_engine:
            self.forward.prepare(self.head, target.embed_tokens)
        self.dtype = draft.dtype  # a draft may run in another precision than its target
        self.proposed = False  # whether a round's proposals await `observe`

    def begin(self, max_positions: int) -> None:
        device = self.target.device
        # Verified context K/V only: the block's own K/V are dropped again after every pass.
        self.cache = DraftCache(self.draft.config, max_positions, device=device, dtype=self.dtype)
        self.positions = torch.arange(max_positions, device=device)[None]
        self.mask_ids = torch.full((1, max_positions), self.draft.mask_token_id, device=device)
        self.proposed = False

    @torch.no_grad()
    def logits(self, anchor, context, start, block_size, size=None) -> torch.Tensor:
        """[size - 1, V_draft] logits of the first positions of the block after the anchor (`size` None: all
        block_size - 1). The draft always runs the whole block; the head, a small draft's largest product, only
        the rows a round uses."""
        return self.round_logits(anchor, context, start, block_size, size)[0]

    @torch.no_grad()
    def round_logits(self, anchor, context, start, block_size, size=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logits`, and their greedy proposals (target ids) where the pass computed them too: in one native call
        on the CPU engine (`DraftEngine.block`), else None. What `propose` runs."""
        first_position = start - context.shape[1]
        used = slice(1, size or block_size)  # the anchor's output is dropped
        if self.on_engine and context.dtype == self.dtype:
            whole = self.forward.block([int(anchor), *[self.draft.mask_token_id] * (block_size - 1)], context,
                                       first_position, self.cache, self.head, self.target.embed_tokens, used,
                                       self.vocab_ids)
            if whole is not None:
                self.cache.crop(-block_size)
                return whole
        block = torch.cat([anchor.view(1, 1), self.mask_ids[:, : block_size - 1]], dim=1)  # [1, B]
        dtype = self.dtype
        hidden = self.forward(
            self.target.embed(block).to(dtype), context.to(dtype),
            self.positions[:, first_position : start + block_size], self.cache,
        )
        self.cache.crop(-block_size)  # keep the context, drop the block's own K/V
        return self._logits(hidden[0, used]), None

    @torch.no_grad()
    def propose(self, anchor, context, start, block_size, size=None, params=GREEDY, generator=None):
        """`Proposer.propose`; by default the whole block, greedily."""
        logits, tokens = self.round_logits(anchor, context, start, block_size, size)
        self.proposed = True
        if params.greedy and tokens is not None:
            return tokens, None
        return draft_tokens(logits, self.vocab_ids, params, generator, self.target.vocab_size)

    def observe(self, tokens: list[int]) -> list[str]:
        accepted = len(tokens) - 1 if self.proposed else 0
        self.proposed = False
        return ["dflash"] * accepted

    def new_row_cache(self) -> RowDraftCache:
        """The draft's cache for sequences drafted together (`logits_rows`)."""
        return RowDraftCache(self.draft.config, device=self.target.device, dtype=self.dtype)

    @torch.no_grad()
    def logits_rows(
        self, cache: RowDraftCache, rows: list[int], anchors: torch.Tensor, contexts: list[torch.Tensor],
        starts: list[int], block_size: int, sizes: list[int],
    ) -> list[torch.Tensor]:
        """`logits` for several sequences in one draft pass: the rows `rows` of `cache`, their anchors [b'], new
        contexts ([1, c_r, k*d] each, ending right before the anchor at `starts[r]`) and round sizes. Returns each
        row's [sizes[r] - 1, V_draft] logits."""
        widths = [context.shape[1] for context in contexts]
        width, dtype, device = max(widths), self.dtype, self.target.device
        context = torch.zeros(len(rows), width, contexts[0].shape[-1], dtype=dtype, device=device)
        for i, row_context in enumerate(contexts):  # right-padded: the mask hides the padding
            context[i, : widths[i]] = row_context[0].to(dtype)
        masks = torch.full((len(rows), block_size - 1), self.draft.mask_token_id, device=device)
        block = torch.cat([anchors[:, None], masks], dim=1)  # [b', B]
        first = torch.tensor([start - w for start, w in zip(starts, widths)], device=device)[:, None]
        positions = torch.cat([first + torch.arange(width, device=device),  # the padding's: never seen
                               torch.tensor(starts, device=device)[:, None] + torch.arange(block_size, device=device)],
                              dim=1)  # [b', width + B]
        mask = cache.begin_pass(rows, widths, block_size)
        hidden = self.forward(self.target.embed(block).to(dtype), context, positions, cache, attention_mask=mask)
        cache.end_pass(rows, widths)
        used = torch.cat([hidden[i, 1:size] for i, size in enumerate(sizes)])  # the anchor's output is dropped
        return list(self._logits(used).split([size - 1 for size in sizes]))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, d] final hidden states -> [rows, V_draft] logits through the target's head (its drafting rows)."""
        if self.on_engine:
            return self.forward.logits(hidden, self.head)
        return self.head(hidden.to(self.head.weight.dtype))


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


class Acceptance:
    """Per block position k (0 = the first proposal after the anchor): decayed counts of proposals tested there and
    accepted given that the ones before them were; one pseudo-round at one half to start."""

    def __init__(self, positions: int, decay: float = DECAY):
        self.accepted = [0.5] * positions
        self.tested = [1.0] * positions
        self.decay = decay

    def rates(self) -> list[float]:
        return [accepted / tested for accepted, tested in zip(self.accepted, self.tested)]

    def observe(self, first: int, last: int, accepted: int) -> None:
        """A round's proposals at positions first..last-1 (this source's) met a verified prefix of `accepted`
        positions: positions up to the first one outside it were tested, those inside it accepted."""
        self.accepted = [count * self.decay for count in self.accepted]
        self.tested = [count * self.decay for count in self.tested]
        for k in range(first, min(last, accepted + 1)):
            self.tested[k] += 1.0
            self.accepted[k] += 1.0 if k < accepted else 0.0


@dataclass(frozen=True)
class Plan:
    """One round: the first `lookup` tokens of the continuation, then the draft's tokens (when `draft`) up to
    `size - 1` proposals in all."""

    lookup: int
    size: int
    draft: bool

    def sources(self) -> list[str]:
        """The source of each proposal, in order."""
        return ["lookup"] * self.lookup + ["dflash"] * (self.size - 1 - self.lookup)


def confidences(logits: torch.Tensor) -> list[float]:
    """[n, V_draft] a draft's logits -> the probability it gives its own greedy token at each row. A trained DFlash
    draft is close to calibrated: a token proposed at confidence c is accepted about c of the time, given the ones
    before it were (BENCHMARKS.md, "Rounds sized by the draft's confidence")."""
    return torch.softmax(logits.float(), -1).amax(-1).tolist()  # 36 us for 7 x 8,192 here; exp-sum took 85


def expected_tokens(rates: list[float]) -> list[float]:
    """E(s) for s = 1..len(rates) + 1: the tokens a round of size s yields given each proposal's acceptance rate."""
    expected, chain = [1.0], 1.0
    for rate in rates:
        chain *= rate
        expected.append(expected[-1] + chain)
    return expected


class HybridProposer:
    """The context's lookup and, when given, the DFlash draft, chosen round by round (see the module docstring).

    With `costs` (the target's verify costs and the draft's pass time) every round takes the option with the most
    expected tokens per second; without, every round proposes all there is: the continuation, then the draft's
    tokens up to the block size (the fixed block size of `block_size=B`). With costs, a greedy round that drafts is
    sized again from the draft's confidence once it has run (`confident_plan`; off with `size_by_confidence`)."""

    size_by_confidence = True  # a class switch, for benchmarks that compare with rounds of the planned size

    def __init__(
        self, target: TargetModel, dflash: DFlashProposer | None, max_size: int,
        costs: tuple[VerifyCosts, float] | None = None, lookup: bool = True, full_first_probe: bool = True,
    ):
        self.target = target
        self.dflash = dflash
        self.max_size = max_size  # the largest round, anchor included
        self.costs = costs  # a batch sets the costs of its size before every round
        self.lookup = lookup  # False: the draft alone (a batch's proposals="dflash")
        # A batch probes the draft first with its best round, not the whole block: a row's block widens every row's.
        self.full_first_probe = full_first_probe
        self.target_layer_ids = dflash.target_layer_ids if dflash else None
        # The block the draft runs: its own size beside the lookup, which fills longer rounds (a draft drafts worse
        # past the block it was trained at); alone, the round's size when that is larger (as the draft alone does).
        self.block_size = None
        if dflash:
            self.block_size = dflash.block_size if lookup else max(max_size, dflash.block_size)
        self.reset()

    def begin(self, max_positions: int) -> None:
        if self.dflash:
            self.dflash.begin(max_positions)
        self.reset()

    def reset(self) -> None:
        """A new sequence: an empty index and fresh estimates (the draft's cache is `begin`'s, or a batch's)."""
        self.index = ContextIndex()
        self.pending: list[torch.Tensor] = []  # verified features the draft has not read yet
        positions = self.max_size - 1
        self.lookup_acceptance = {n: Acceptance(positions) for n in range(1, self.index.max_ngram + 1)}
        self.draft_acceptance = Acceptance(positions)
        self.draft_observed = False
        self.rounds_without_draft, self.probe_interval = 0, FIRST_PROBE_INTERVAL
        self.round: tuple[list[int], int, Plan] | None = None  # this round's continuation, its match length, plan
        self.unscored: list[tuple[list[int], int, list[int]]] = []  # continuations, match lengths, tokens since

    @torch.no_grad()
    def propose(self, anchor, context, start, block_size, size, params=GREEDY, generator=None):
        """`Proposer.propose`: the plan's proposals, from the lookup, the draft or both."""
        plan = self.prepare(context, size, greedy=params.greedy)
        logits = tokens = None
        if plan.draft:  # at the draft's own block (`block_size`), whatever the loop's
            logits, tokens = self.dflash.round_logits(anchor, self.take_context(), start, self.block_size, plan.size)
        return self.complete(logits, params, generator, tokens)

    def prepare(self, context: torch.Tensor | None, size: int, greedy: bool = False) -> Plan:
        """A round's first half: keep the new context, plan the round. When the plan drafts, the caller runs the
        draft on `take_context()` (a batch drafts all its rows in one pass) and hands the logits to `complete`.
        `greedy` with costs: a plan that drafts covers the draft's whole block, and `complete` sizes the round from
        the draft's confidences."""
        if context is not None:
            self.pending.append(context)
        continuation, n = self.index.continuation(size - 1) if self.lookup else ([], 0)
        plan = self.plan(continuation, n, size)
        if greedy and self.costs is not None and plan.draft and self.size_by_confidence:
            plan = Plan(plan.lookup, max(plan.size, min(size, self.block_size)), True)
        self.round = (continuation, n, plan)
        return plan

    def take_context(self) -> torch.Tensor:
        """The verified features the draft has not read yet, joined [1, c, k*d], and cleared."""
        context = torch.cat(self.pending, dim=1) if len(self.pending) > 1 else self.pending[0]
        self.pending.clear()
        return context

    def complete(self, draft_logits: torch.Tensor | None, params: SamplingParams, generator: torch.Generator | None,
                 draft_greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A round's second half: the planned proposals and q, given the draft's [plan.size - 1, V_draft] logits
        when the plan drafts (and their argmax as target ids, where the draft's pass gave it)."""
        continuation, n, plan = self.round
        if plan.draft and params.greedy and self.costs is not None and self.size_by_confidence:
            plan = self.confident_plan(plan, n, draft_logits[plan.lookup : plan.size - 1])
            self.round = (continuation, n, plan)
        vocab_size = self.target.vocab_size
        proposals = torch.tensor(continuation[: plan.lookup], dtype=torch.long, device=self.target.device)
        q = None if params.greedy else lookup_q(proposals, vocab_size)
        if plan.draft and params.greedy and draft_greedy is not None:
            return torch.cat([proposals, draft_greedy[plan.lookup : plan.size - 1]]), None
        if plan.draft:
            logits = draft_logits[plan.lookup : plan.size - 1]
            drafted, draft_q = draft_tokens(logits, self.dflash.vocab_ids, params, generator, vocab_size)
            proposals = torch.cat([proposals, drafted])
            q = None if q is None else torch.cat([q, draft_q])
        return proposals, q

    def confident_plan(self, plan: Plan, n: int, draft_logits: torch.Tensor) -> Plan:
        """A greedy round's size chosen again once the draft has run: the size up to `plan.size` with the most
        expected tokens per second, where the draft's positions count at the draft's own confidence in each token
        (this round's, not the running rates) and the lookup's at its running rates; the draft's pass is spent
        either way, and priced in every option as part of the round's time. The round keeps the planned lookup
        tokens and at least one of the draft's: its verdict keeps the draft's running rates, which decide whether
        to draft at all, up to date."""
        verify, draft_seconds = self.costs
        lookup_rates = self.lookup_acceptance[n].rates()[: plan.lookup] if plan.lookup else []
        expected = expected_tokens(lookup_rates + confidences(draft_logits))
        sizes = range(min(plan.lookup + 2, plan.size), plan.size + 1)
        return Plan(plan.lookup, max(sizes, key=lambda s: expected[s - 1] / (verify(s) + draft_seconds)), True)

    def plan(self, continuation: list[int], n: int, size: int) -> Plan:
        """This round's proposals, given the continuation (matched over n tokens) and the largest size allowed."""
        found = len(continuation)
        draft_size = min(size, self.block_size or 0)  # the largest round with draft tokens in it
        if self.costs is None:
            if found + 1 >= draft_size:
                return Plan(found, found + 1, False)
            return Plan(found, draft_size, True)
        verify, draft_seconds = self.costs
        options = [(1.0 / verify(1), Plan(0, 1, False))]
        lookup_rates = self.lookup_acceptance[n].rates()[:found] if found else []
        for s, expected in enumerate(expected_tokens(lookup_rates)[1:], start=2):
            options.append((expected / verify(s), Plan(s - 1, s, False)))
        if self.dflash is not None:
            draft_rates = self.draft_acceptance.rates()[: draft_size - 1]
            for prefix in {0, found}:  # the draft alone, or after the whole continuation
                expected = expected_tokens(lookup_rates[:prefix] + draft_rates[prefix:])
                for s in range(prefix + 2, draft_size + 1):
                    options.append((expected[s - 1] / (verify(s) + draft_seconds), Plan(prefix, s, True)))
        best = max(value for value, _ in options)
        near_best = [plan for value, plan in options if value >= NEAR_BEST * best]
        plan = max(near_best, key=lambda plan: plan.size)
        if self.dflash is None or plan.draft or draft_size < 2:
            self.rounds_without_draft, self.probe_interval = 0, FIRST_PROBE_INTERVAL
            return plan
        # The draft's estimate only changes in rounds that run it: probe it now and then, less often while it
        # does not pay. Before it was ever observed, over the whole block where that costs at most two steps, else
        # the largest round that does (`first_probe_size`: every position it holds is scored; in a batch, see
        # `full_first_probe`, as later); later, the best round that runs it, which costs little more than the best
        # round.
        self.rounds_without_draft += 1
        if not self.draft_observed and self.full_first_probe:
            return Plan(0, first_probe_size(verify, draft_seconds, draft_size), True)
        if not self.draft_observed:
            self.rounds_without_draft = self.probe_interval
        if self.rounds_without_draft < self.probe_interval:
            return plan
        self.rounds_without_draft = 0
        self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        return max((option for option in options if option[1].draft), key=lambda option: option[0])[1]

    def observe(self, tokens: list[int]) -> list[str]:
        """`Proposer.observe`: the tokens join the index; the round's sources are scored."""
        self.index.extend(tokens)
        if self.round is None:  # the prefill, or a round the loop verified without proposals
            self.score_continuations(tokens)
            return []
        (continuation, n, plan), self.round = self.round, None
        accepted = len(tokens) - 1
        if continuation:  # scored whether used or not, and over its whole length: see the module docstring
            self.unscored.append((continuation, n, []))
        self.score_continuations(tokens)
        if plan.draft:
            self.draft_acceptance.observe(plan.lookup, plan.size - 1, accepted)
            self.draft_observed = True
        return plan.sources()[:accepted]

    def score_continuations(self, tokens: list[int]) -> None:
        """The verified `tokens` extend what follows every continuation not scored yet; those whose first miss (or
        whole length) the sequence now shows are scored."""
        waiting = []
        for continuation, n, since in self.unscored:
            since.extend(tokens)
            compared = min(len(continuation), len(since))
            matched = next((k for k in range(compared) if continuation[k] != since[k]), compared)
            if matched < compared or compared == len(continuation):
                self.lookup_acceptance[n].observe(0, len(continuation), matched)
            else:
                waiting.append((continuation, n, since))
        self.unscored = waiting
