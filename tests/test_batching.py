"""Continuous batching (`flashdraft.batching`): every sequence of a batch gets exactly the tokens it gets alone,
whatever joins or leaves around it. (Sampling in a batch: tests/test_decoding_sampling.py.)"""

import random

import pytest
import torch

import flashdraft
from flashdraft import TargetModel
from flashdraft.batching import Batch, is_batch
from flashdraft.decoding import generate as generate_alone

from tiny import ARCHITECTURES, greedy_reference, tiny_draft, tiny_target

MASK = 1
STOP = 7
TARGETS = {arch: tiny_target(arch, seed=10 + i, forbid_token=MASK) for i, arch in enumerate(ARCHITECTURES)}
# The same targets without the hook that forbids the mask token: hooks keep a target off the engine, whose cache by
# position is what batches of different lengths run on.
ENGINE_TARGETS = {arch: tiny_target(arch, seed=10 + i) for i, arch in enumerate(ARCHITECTURES)}
DRAFTS = {arch: tiny_draft(t, block_size=8, mask_token_id=MASK) for arch, t in TARGETS.items()}
# (proposals, block size): every kind of round a batch can plan
MODES = [("hybrid", "auto"), ("hybrid", 8), ("dflash", "auto"), ("dflash", 5), ("lookup", "auto"), ("lookup", 6),
         (None, 1)]


def on_engine(arch: str, engine: str) -> TargetModel:
    """The tiny target of `arch` on flashdraft's engine ("flashdraft") or on transformers' forward."""
    return TargetModel(ENGINE_TARGETS[arch] if engine == "flashdraft" else TARGETS[arch], engine=engine)


def random_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts of very different lengths, some repeating themselves (so the lookup proposes)."""
    prompts = []
    for _ in range(count):
        prompt = [rng.randrange(2, 96) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:
            prompt = prompt * 3
        prompts.append(prompt)
    return prompts


@pytest.mark.parametrize("engine", ["flashdraft", "transformers"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("mode", MODES, ids=lambda mode: f"{mode[0]}-{mode[1]}")
def test_every_row_of_a_batch_gets_its_own_greedy_tokens(arch, engine, mode):
    """Rows of different lengths, budgets (0 included) and stop tokens, on the engine (by position) and on
    transformers' forward (row by row): each equals the sequence decoded alone."""
    proposals, block_size = mode
    rng = random.Random(f"{arch} {engine} {mode}")  # a string seeds the same in every process
    target = on_engine(arch, engine)
    draft = DRAFTS[arch] if proposals in ("hybrid", "dflash") else None
    batch = Batch(target, draft, block_size=block_size, proposals=proposals)
    cases = []
    for prompt in random_prompts(rng, 6):
        options = dict(max_new_tokens=rng.choice([0, 1, rng.randint(2, 48), 48]),
                       stop_token_ids=rng.choice([None, [STOP], [STOP, 9]]))
        cases.append((prompt, options, batch.add(prompt, **options)))
    while batch:
        batch.step()
    for prompt, options, sequence in cases:
        alone = generate_alone(target, draft, prompt, block_size=block_size, proposals=proposals, **options)
        assert sequence.result.tokens == alone.tokens
        assert sequence.result.stop_reason == alone.stop_reason
        assert engine == "flashdraft" or MASK not in sequence.result.tokens
    prompt, options, sequence = cases[0]
    assert sequence.result.tokens == greedy_reference(target.model, prompt, options["max_new_tokens"],
                                                      options["stop_token_ids"])


@pytest.mark.parametrize("engine", ["flashdraft", "transformers"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("mode", [("hybrid", "auto"), ("dflash", 5), (None, 1)], ids=lambda mode: str(mode[0]))
def test_prompts_prefilled_together_in_chunks_give_each_row_its_own_tokens(arch, engine, mode, monkeypatch):
    """Prompts of very different lengths prefilled together under a small budget: each step runs one prefill
    forward over every row being prefilled (rows x widest chunk within the budget), long prompts over several
    steps while others decode; each row equals the sequence decoded alone, and the draft's context follows."""
    proposals, block_size = mode
    rng = random.Random(f"chunks {arch} {engine} {mode}")
    target = on_engine(arch, engine)
    draft = DRAFTS[arch] if proposals else None
    budget = 24
    batch = Batch(target, draft, block_size=block_size, proposals=proposals, prefill_tokens=budget)
    forwards = []
    prefill_rows = target.prefill_rows

    def counted(chunks, starts, cache, layer_ids):
        forwards.append([len(chunk) for chunk in chunks])
        return prefill_rows(chunks, starts, cache, layer_ids)

    monkeypatch.setattr(target, "prefill_rows", counted)
    cases = []
    for step in range(12):
        if step in (0, 1, 5):  # several join at once, others while those decode
            for prompt in random_prompts(rng, 4):
                budget_tokens = rng.randint(1, 30)
                cases.append((prompt, budget_tokens, batch.add(prompt, max_new_tokens=budget_tokens)))
        batch.step()
        if draft is not None:
            assert len(batch.draft_cache.lengths) == len(batch.rows)
        assert len(batch.cache) == len(batch.rows) and len(batch.prefill_cache) == len(batch.prefilling)
    while batch:
        batch.step()
    assert all(len(widths) * max(widths) <= budget for widths in forwards)
    assert max(len(widths) for widths in forwards) >= 4  # prompts joining together share one forward
    assert any(len(prompt) > budget for prompt, _, _ in cases)  # so some prompt took several steps
    for prompt, budget_tokens, sequence in cases:
        alone = generate_alone(target, draft, prompt, max_new_tokens=budget_tokens, block_size=block_size,
                               proposals=proposals)
        assert sequence.result.tokens == alone.tokens


def test_half_of_a_burst_is_prefilled_at_each_step_in_one_forward(monkeypatch):
    """Eight prompts at once: the first four share one prefill forward and have their first token after it (before
    any round), then two, one and one join while the others decode."""
    target = on_engine("llama", "flashdraft")
    batch = Batch(target, DRAFTS["llama"])
    forwards = []
    prefill_rows = target.prefill_rows
    monkeypatch.setattr(target, "prefill_rows", lambda chunks, *rest: forwards.append(len(chunks)) or prefill_rows(
        chunks, *rest))
    sequences = [batch.add([5 + i, 6, 7], max_new_tokens=10) for i in range(8)]
    first = batch.prefill()
    assert [sequence for sequence, tokens in first] == sequences[:4] and all(len(t) == 1 for _, t in first)
    assert all(not sequence.result.acceptance_lengths for sequence in sequences)  # no round yet
    batch.decode()
    while batch.waiting:
        batch.step()
    assert forwards == [4, 2, 1, 1]


def test_a_cancelled_sequence_frees_its_row_and_its_memory():
    """Disconnecting clients, round after round: a cancelled sequence's row leaves at once, whether it was
    running, being prefilled or waiting, and the caches' memory stays what the first round allocated."""
    target, draft = on_engine("qwen3", "flashdraft"), DRAFTS["qwen3"]
    # The draft runs every round; no prefixes kept, so that every round's clients run the same steps.
    batch = Batch(target, draft, block_size=4, proposals="dflash", prefill_tokens=64, prefix_cache_tokens=0)
    rng = random.Random(3)

    def allocated():
        engine_cache = batch.cache.engine_cache
        return (engine_cache.keys.numel(), batch.prefill_cache.engine_cache.keys.numel(),
                batch.draft_cache.keys.numel())

    sizes, prompts = [], random_prompts(rng, 12)
    for _ in range(3):  # the same clients each round: a leak would show as growth
        sequences = [batch.add(prompt, max_new_tokens=100) for prompt in prompts]
        for _ in range(3):
            batch.step()
        assert batch.rows and batch.prefilling  # some run, some are still being prefilled
        for sequence in sequences:
            batch.cancel(sequence)
        batch.cancel(batch.add([5, 6], max_new_tokens=1))  # one still waiting
        assert len(batch) == 0 and len(batch.cache) == 0 and len(batch.prefill_cache) == 0
        assert batch.draft_cache.lengths == []
        assert all(sequence.result.stop_reason is None for sequence in sequences)
        sizes.append(allocated())
    assert sizes[0] == sizes[1] == sizes[2]


def test_an_empty_batch_releases_its_row_caches_and_keeps_its_prefixes():
    """An idle server's batch gives back the K/V tensors its peak left (they never shrink), and then decodes as
    before; while a sequence is in it, nothing is released."""
    target, draft = on_engine("qwen3", "flashdraft"), DRAFTS["qwen3"]
    batch = Batch(target, draft, block_size=4, proposals="dflash")
    prompt = list(range(2, 60))
    first = batch.add(prompt, max_new_tokens=6)
    batch.step()
    caches = (batch.cache, batch.prefill_cache, batch.draft_cache)
    batch.release_rows()  # a sequence still runs: kept
    assert (batch.cache, batch.prefill_cache, batch.draft_cache) == caches
    while not first.finished:
        batch.step()
    prefixes = batch.prefixes
    batch.release_rows()
    assert batch.cache.engine_cache.keys is None and batch.draft_cache.keys is None  # nothing allocated
    assert batch.prefixes is prefixes
    again = batch.add(prompt, max_new_tokens=6)
    while not again.finished:
        batch.step()
    assert again.result.tokens == first.result.tokens


def test_a_row_that_never_drafted_can_take_a_leaver_s_place():
    """Rows join the draft's cache between its passes: the last row, not yet drafted (past the rows the cache
    has allocated), moves into a leaver's place with nothing to copy."""
    target, draft = on_engine("llama", "flashdraft"), DRAFTS["llama"]
    batch = Batch(target, draft, block_size=4, proposals="dflash")
    first = [batch.add([5, 6, 7], max_new_tokens=20), batch.add([8, 9], max_new_tokens=20)]
    while batch.waiting:
        batch.step()  # both rows drafted
    late = batch.add([10, 11, 12], max_new_tokens=20)
    batch.prefill()  # joins, not drafted yet
    assert batch.draft_cache.keys.shape[1] == 2 and batch.draft_cache.lengths[2] == 0
    batch.cancel(first[0])
    assert batch.draft_cache.lengths[0] == 0 and [row.sequence for row in batch.rows] == [late, first[1]]
    while batch:
        batch.step()
    assert late.result.tokens == generate_alone(target, draft, [10, 11, 12], max_new_tokens=20, block_size=4,
                                                proposals="dflash").tokens


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sequences_join_and_leave_between_rounds(arch):
    """Continuous batching: sequences are added while others run, some are cancelled mid-way (their rows freed at
    the next step), a short answer leaves before a long one; every finished one is exact."""
    rng = random.Random(7)
    target, draft = TARGETS[arch], DRAFTS[arch]
    batch = Batch(target, draft)
    live, cancelled, done = [], [], []
    prompts = random_prompts(rng, 14)
    step = 0
    while prompts or batch:
        if prompts and step % 2 == 0:
            for _ in range(rng.randint(1, 3)):
                if prompts:
                    prompt, budget = prompts.pop(), rng.randint(1, 40)
                    live.append((prompt, budget, batch.add(prompt, max_new_tokens=budget)))
        if step == 3:
            victim = live[0][2]
            batch.cancel(victim)
            cancelled.append(victim)
            assert victim not in [row.sequence for row in batch.rows + batch.prefilling + batch.waiting]
        emitted = batch.step()
        assert all(not sequence.cancelled for sequence, _ in emitted)
        assert len(batch.rows) <= 14
        done += [entry for entry in live if entry[2].finished]
        live = [entry for entry in live if not entry[2].finished]
        step += 1
    assert all(sequence.finished for _, _, sequence in done)
    assert cancelled[0].result.stop_reason is None
    for prompt, budget, sequence in done:
        if sequence in cancelled:
            continue
        assert sequence.result.tokens == generate_alone(target, draft, prompt, max_new_tokens=budget).tokens


def test_a_long_answer_does_not_hold_a_short_one_back():
    target = TARGETS["llama"]
    batch = Batch(target, None, proposals="lookup")
    long, short = batch.add([5, 6, 7], max_new_tokens=60), batch.add([8, 9], max_new_tokens=3)
    rounds = 0
    while not short.finished:
        batch.step()
        rounds += 1
    assert rounds <= 3 and not long.finished and len(batch.rows) == 1
    assert short.result.stop_reason == "length" and len(short.result.tokens) == 3


def test_generate_takes_a_list_of_prompts_and_returns_one_result_each():
    target, draft = TARGETS["qwen3"], DRAFTS["qwen3"]
    prompts = [[5, 6, 7, 8], [9], [10, 11, 10, 11, 10, 11]]
    results = flashdraft.generate(target, draft, prompts, max_new_tokens=20, stop_token_ids=[STOP])
    assert isinstance(results, list) and len(results) == 3
    for prompt, result in zip(prompts, results):
        alone = flashdraft.generate(target, draft, prompt, max_new_tokens=20, stop_token_ids=[STOP])
        assert isinstance(alone, flashdraft.GenerationResult)
        assert result.tokens == alone.tokens
        assert result.prefill_seconds > 0 and len(result.acceptance_lengths) >= 1
    # a [b, P] tensor is b prompts of equal length; a [1, P] tensor or a flat list is one
    as_tensor = flashdraft.generate(target, draft, torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=8)
    assert [r.tokens for r in as_tensor] == [r.tokens for r in flashdraft.generate(
        target, draft, [[5, 6, 7], [8, 9, 10]], max_new_tokens=8)]
    assert not is_batch(torch.tensor([[5, 6, 7]])) and not is_batch([5, 6, 7]) and is_batch([[5], [6]])


def test_bad_input_in_a_batch_fails_before_anything_runs():
    target = TARGETS["llama"]
    with pytest.raises(ValueError, match="vocabulary"):
        flashdraft.generate(target, None, [[5, 6], [500]], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        flashdraft.generate(target, None, [[5, 6], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Batch(target).add([5], max_new_tokens=-1)
    with pytest.raises(ValueError, match="one sequence at a time"):
        Batch(target, object())
    with pytest.raises(ValueError, match="needs a draft"):
        Batch(target, None, proposals="hybrid")


def test_a_batch_plans_with_the_costs_measured_at_its_size(monkeypatch):
    """block_size="auto": the rows' proposers get a row's share of the costs of the batch's size each round, the
    batch's costs interpolated between the powers of two measured; at batch size 1, the single sequence's."""
    target, draft = TARGETS["llama"], DRAFTS["llama"]
    batch = Batch(target, draft)
    seen = []
    original = batch.costs.at

    def at(batch_size):
        seen.append(batch_size)
        return original(batch_size)

    monkeypatch.setattr(batch.costs, "at", at)
    for prompt in ([5, 6, 7], [8, 9], [10], [11, 12]):  # too long to finish before the last joins, whatever sizes
        batch.add(prompt, max_new_tokens=64)         # the measured costs choose (at most 16 tokens a round)
    while batch.waiting:  # half of the queue joins at each step
        batch.step()
    assert seen == [2, 3, 4] and all(row.proposer.costs == original(4) for row in batch.rows)
    assert original(1) == batch.costs.single
    whole, (row, draft_seconds) = batch.costs.batch_costs(4), original(4)
    assert row(1) == pytest.approx(whole(1) / 4)
    assert row(3) == pytest.approx(whole(1) / 4 + max(whole(3) - whole(1), 0.0))
    assert draft_seconds == batch.costs.single[1]
    two, three, four = (batch.costs.batch_costs(b) for b in (2, 3, 4))
    for n in three.seconds:
        low, high = sorted((two.seconds[n], four.seconds[n]))
        assert low <= three.seconds[n] <= high


@pytest.mark.parametrize("engine", ["flashdraft", "transformers"])
@pytest.mark.parametrize("mode", [("hybrid", "auto"), (None, 1)], ids=lambda mode: str(mode[0]))
def test_prompts_that_begin_alike_are_prefilled_from_their_shared_prefix(engine, mode, monkeypatch):
    """Once two prompts have shared a prefix (a chat template's opening), a later prompt that begins with it is
    prefilled from its end: the forward computes only the rest, the draft's first context is still the whole
    prompt's features, and every row's tokens equal the sequence decoded alone."""
    from flashdraft.proposals import HybridProposer

    proposals, block_size = mode
    rng = random.Random(f"prefix {engine} {mode}")
    target = on_engine("llama", engine)
    draft = DRAFTS["llama"] if proposals else None
    head = [rng.randrange(2, 96) for _ in range(24)]
    prompts = [head + [rng.randrange(2, 96) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    prompts += [head[:20], head, head + head[:3]]  # shorter than the prefix, the prefix itself, a longer one
    widths, contexts = [], {}
    prefill_rows, prepare = target.prefill_rows, HybridProposer.prepare

    def counted(chunks, starts, cache, layer_ids):
        widths.append([(start, len(chunk)) for chunk, start in zip(chunks, starts)])
        return prefill_rows(chunks, starts, cache, layer_ids)

    def captured(proposer, context, size, greedy=False):
        contexts.setdefault(proposer, context)  # a row's first round: the prompt's features
        return prepare(proposer, context, size, greedy)

    monkeypatch.setattr(target, "prefill_rows", counted)
    monkeypatch.setattr(HybridProposer, "prepare", captured)
    batch = Batch(target, draft, block_size=block_size, proposals=proposals)
    first = [batch.add(prompt, max_new_tokens=12) for prompt in prompts[:2]]
    batch.step()  # one joins per step (half the queue): both are prefilled after two steps
    batch.step()
    assert [s.result.cached_prompt_tokens for s in first] == [0, 0]
    later = [batch.add(prompt, max_new_tokens=12) for prompt in prompts[2:]]
    while batch:
        batch.step()
    first_contexts = list(contexts.values())  # the batch's rows only (decoding alone below calls `prepare` too)
    assert [s.result.cached_prompt_tokens for s in later] == [24, 24, 24, 19, 23, 24]
    assert [start for forward in widths[2:] for start, _ in forward] == [24, 24, 24, 19, 23, 24]
    assert batch.prefixes.tokens == 24 and batch.prefixes.hits == 138
    for prompt, sequence in zip(prompts, first + later):
        alone = generate_alone(target, draft, prompt, max_new_tokens=12, block_size=block_size, proposals=proposals)
        assert sequence.result.tokens == alone.tokens
    if draft is not None:
        layer_ids = DRAFTS["llama"].config.dflash_config["target_layer_ids"]
        whole = {}
        for prompt in prompts:
            _, features = target.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], target.new_cache(),
                                         layer_ids)
            whole[tuple(prompt)] = features
        assert len(first_contexts) == len(prompts)
        for context in first_contexts:
            match = [f for f in whole.values() if f.shape == context.shape and torch.allclose(f, context, atol=1e-5)]
            assert match, "a row's first draft context is not its whole prompt's features"


def test_a_prefix_is_kept_once_shared_and_the_least_recently_used_goes_first():
    from flashdraft.target import PromptPrefixes

    target = on_engine("llama", "flashdraft")
    prefixes = PromptPrefixes(max_tokens=40, min_tokens=4)

    def prefill(prompt):
        cache = target.new_row_cache()
        start, _ = prefixes.start_row(torch.tensor(prompt), cache)
        target.prefill_rows([torch.tensor(prompt[start:])], [start], cache, None)
        prefixes.remember(torch.tensor(prompt), cache, 0, [])
        return start

    a, b = list(range(10, 40)), list(range(50, 70))
    assert prefill(a + [1]) == 0 and prefixes.tokens == 0  # nothing shared yet
    assert prefill(a[:3] + [2]) == 0 and prefixes.tokens == 0  # 3 shared tokens: under min_tokens
    assert prefill(a + [3]) == 0 and prefixes.tokens == 30  # shared with the first: kept
    assert prefill(a + [4, 5]) == 30 and prefixes.tokens == 30
    assert prefill(b + [1]) == 0 and prefill(b + [2]) == 0 and prefixes.tokens == 20  # 30 + 20 > 40: `a` went
    assert prefill(b[:10]) == 9  # a part of a kept prefix serves; the last prompt token is always computed
    assert prefill(b + [2, 6]) == 20  # and shares 21 with `b + [2]`: kept, replacing the 20 tokens it extends
    assert prefixes.tokens == 21 and len(prefixes.kept) == 1
    with pytest.raises(ValueError, match="prefix cache's size"):
        PromptPrefixes(max_tokens=-1)
    nothing = PromptPrefixes(max_tokens=0)
    cache = target.new_row_cache()
    nothing.start_row(torch.tensor(a), cache)
    target.prefill_rows([torch.tensor(a)], [0], cache, None)
    nothing.remember(torch.tensor(a), cache, 0, [])
    nothing.remember(torch.tensor(a), cache, 0, [])
    assert nothing.tokens == 0
