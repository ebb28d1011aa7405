"""Proposals from the context (`flashdraft.lookup`) and the hybrid proposer (`flashdraft.proposals`): the index, the
acceptance it tracks, the choice it makes each round, and that the loop stays lossless with it."""

import random

import pytest
import torch

import flashdraft
import flashdraft.batching
import flashdraft.decoding as decoding
from flashdraft.adaptive import VerifyCosts, first_probe_size
from flashdraft.lookup import ContextIndex
from flashdraft.proposals import Acceptance, DFlashProposer, HybridProposer, Plan, confidences, expected_tokens
from flashdraft.target import TargetModel

from tiny import ARCHITECTURES, greedy_reference, random_case, tiny_draft, tiny_target

MASK = 1
TARGETS = {arch: tiny_target(arch, seed=20 + i, forbid_token=MASK) for i, arch in enumerate(ARCHITECTURES)}
DRAFTS = {arch: tiny_draft(t, block_size=8, mask_token_id=MASK) for arch, t in TARGETS.items()}
COSTS = VerifyCosts({1: 1.0, 2: 1.3, 4: 1.5, 8: 1.6, 16: 1.8})  # CPU-like, as in test_adaptive
FLAT_COSTS = VerifyCosts({1: 1.0, 16: 1.0})  # every size costs one step: a greedy round keeps all it drafted


# ------------------------------------------------------------------ the index


def test_the_longest_suffix_with_an_earlier_occurrence_gives_the_continuation_of_its_latest_one():
    index = ContextIndex(max_ngram=3)
    index.extend([7, 8, 9, 1, 7, 8, 2, 5, 8])
    assert index.continuation(2) == ([2, 5], 1)  # `8` last followed by 2 (at 6), not 9 (at 2)
    index.extend([9])  # `8 9` occurred once, at 1..2: its 2-gram match beats the 1-gram `9`
    assert index.continuation(3) == ([1, 7, 8], 2)


def test_no_earlier_occurrence_means_no_proposal():
    index = ContextIndex(min_ngram=2)
    index.extend([1, 2, 3, 4, 1])
    assert index.continuation(5) == ([], 0)  # `4 1` is new, and single tokens are not matched


def test_a_continuation_that_reaches_the_end_goes_on_copying_itself():
    index = ContextIndex()
    index.extend([1, 2, 3, 1, 2])
    assert index.continuation(7) == ([3, 1, 2, 3, 1, 2, 3], 2)
    index = ContextIndex()
    index.extend([4, 4])
    assert index.continuation(3) == ([4, 4, 4], 1)


def test_updates_cost_a_constant_per_new_token_whatever_the_context():
    index = ContextIndex(max_ngram=4, min_ngram=1)
    index.extend(random.Random(0).randrange(50) for _ in range(20_000))
    before = len(index.continues_at)
    index.tokens = _NoScan(index.tokens)  # a long context is never iterated over again
    index.extend([3, 1, 4])
    index.continuation(15)
    assert len(index.continues_at) - before <= 3 * 4


class _NoScan(list):
    def __iter__(self):
        raise AssertionError("the whole context was scanned")


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        ContextIndex(max_ngram=2, min_ngram=3)


# ------------------------------------------------------------------ acceptance and the choice


def test_acceptance_counts_what_a_round_tested_from_its_first_position():
    acceptance = Acceptance(6, decay=1.0)
    acceptance.observe(0, 5, 2)  # positions 0, 1 accepted, 2 rejected, 3 and 4 never tested
    assert acceptance.tested == [2.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    assert acceptance.accepted == [1.5, 1.5, 0.5, 0.5, 0.5, 0.5]
    acceptance.observe(2, 5, 4)  # this source proposed from position 2: 2, 3 accepted, 4 rejected
    assert acceptance.tested == [2.0, 2.0, 3.0, 2.0, 2.0, 1.0]
    acceptance.observe(3, 5, 1)  # the round ended before this source's first position: nothing tested
    assert acceptance.tested == [2.0, 2.0, 3.0, 2.0, 2.0, 1.0]


def test_expected_tokens_chain_the_acceptance_rates():
    assert expected_tokens([0.8, 0.5]) == pytest.approx([1.0, 1.8, 2.2])


def test_confidences_are_the_probability_of_each_rows_greedy_token():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, -1.0], [100.0, 0.0, 0.0, 0.0]])
    expected = [0.25, torch.softmax(logits[1], -1).max().item(), 1.0]
    assert confidences(logits) == pytest.approx(expected)
    assert confidences(logits.bfloat16()) == pytest.approx(expected, rel=1e-2)  # a draft in bfloat16


def draft_logits(confidence: list[float], vocab: int = 64) -> torch.Tensor:
    """Logits whose rows give their first token each probability in `confidence` (the rest shared evenly)."""
    rows = []
    for c in confidence:
        rest = (1.0 - c) / (vocab - 1)
        rows.append(torch.tensor([c] + [rest] * (vocab - 1)).log())
    return torch.stack(rows)


def test_a_greedy_round_is_sized_by_the_drafts_confidence_in_each_token():
    proposer = hybrid()
    # Under COSTS (and a 0.1-step draft pass): confident first two tokens, then a likely miss. Three tokens
    # (E = 2.97 for 1.5 steps) beat the whole block (E = 3.17 for 1.7) and two (E = 1.99 for 1.4).
    plan = proposer.confident_plan(Plan(0, 8, True), 0, draft_logits([0.99, 0.99, 0.05, 0.9, 0.9, 0.9, 0.9]))
    assert plan == Plan(0, 3, True)
    assert proposer.confident_plan(Plan(0, 8, True), 0, draft_logits([0.99] * 7)) == Plan(0, 8, True)
    # Nothing the draft believes in: still one of its tokens, whose verdict teaches the running rates.
    assert proposer.confident_plan(Plan(0, 8, True), 0, draft_logits([0.26] * 7)) == Plan(0, 2, True)


def test_a_confident_round_keeps_the_lookup_at_its_running_rates():
    proposer = hybrid()
    set_rates(proposer.lookup_acceptance[3], 0.95)
    assert proposer.confident_plan(Plan(2, 8, True), 3, draft_logits([0.99] * 6)) == Plan(2, 8, True)
    # The draft unsure after the lookup's two tokens: the lookup's part and one of the draft's.
    assert proposer.confident_plan(Plan(2, 8, True), 3, draft_logits([0.05] * 6)) == Plan(2, 4, True)
    assert proposer.confident_plan(Plan(2, 3, True), 3, draft_logits([0.99])) == Plan(2, 3, True)


def test_a_greedy_plan_that_drafts_covers_the_drafts_whole_block_and_the_round_is_sized_after():
    proposer = hybrid(costs=(VerifyCosts({1: 1.0, 2: 1.1, 4: 1.5, 8: 3.0}), 0.1))  # 8 tokens cost 3 steps
    proposer.begin(64)
    set_rates(proposer.draft_acceptance, 0.6)
    assert proposer.plan([], 0, 8) == Plan(0, 4, True)  # by the running rates alone: a shorter round
    assert proposer.prepare(None, 8, greedy=False).size < 8  # sampling: as planned
    assert proposer.prepare(None, 8, greedy=True) == Plan(0, 8, True)
    assert proposer.prepare(None, 5, greedy=True) == Plan(0, 5, True)  # never past the budget
    without_costs = hybrid(costs=None)
    without_costs.begin(64)
    assert without_costs.prepare(None, 8, greedy=True) == Plan(0, 8, True)  # a fixed block size: all of it
    proposer.size_by_confidence = False  # the switch benchmarks compare with: the planned size
    assert proposer.prepare(None, 8, greedy=True) == Plan(0, 4, True)


def test_the_draft_alone_under_auto_is_sized_by_confidence_as_a_batch_runs_it(cpu_like_costs):
    target = TargetModel(TARGETS["llama"])
    proposer, max_size, controller = decoding._proposer(target, DRAFTS["llama"], "dflash", "auto")
    assert isinstance(proposer, HybridProposer) and not proposer.lookup and controller is None and max_size == 8
    prompt = [3, 4, 5, 3, 4]
    result = flashdraft.generate(TARGETS["llama"], DRAFTS["llama"], prompt, max_new_tokens=60, proposals="dflash")
    assert result.tokens == greedy_reference(TARGETS["llama"], prompt, 60)
    assert set(result.tokens_by_source) <= {"target", "dflash"}


def hybrid(with_draft=True, max_size=8, costs=(COSTS, 0.1)):
    target = TargetModel(TARGETS["llama"])
    dflash = DFlashProposer(DRAFTS["llama"], target) if with_draft else None
    proposer = HybridProposer(target, dflash, max_size, costs)
    proposer.draft_observed = True  # past the first probe
    return proposer


def set_rates(acceptance: Acceptance, rate: float) -> None:
    acceptance.accepted = [100 * rate] * len(acceptance.accepted)
    acceptance.tested = [100.0] * len(acceptance.tested)


def test_a_reliable_continuation_is_used_whole_and_an_unreliable_one_not_at_all():
    proposer = hybrid()
    set_rates(proposer.draft_acceptance, 0.0)
    set_rates(proposer.lookup_acceptance[3], 0.95)
    set_rates(proposer.lookup_acceptance[1], 0.05)
    assert proposer.plan([5] * 7, 3, 8) == Plan(7, 8, False)
    assert proposer.plan([5] * 3, 3, 8) == Plan(3, 4, False)  # a shorter continuation: a shorter round
    assert proposer.plan([5] * 7, 1, 8) == Plan(0, 1, False)  # a 1-token match is rarely right: plain decoding


def test_the_draft_fills_the_block_after_the_continuation_when_it_pays():
    proposer = hybrid()
    set_rates(proposer.draft_acceptance, 0.9)
    set_rates(proposer.lookup_acceptance[2], 0.95)
    assert proposer.plan([5, 6, 7], 2, 8) == Plan(3, 8, True)
    assert proposer.plan([], 0, 8) == Plan(0, 8, True)  # no continuation: the draft alone


def test_a_draft_that_does_not_pay_is_probed_less_and_less_often():
    proposer = hybrid()
    set_rates(proposer.draft_acceptance, 0.0)
    probes = [i for i in range(32 + 64 + 10) if proposer.plan([], 0, 8).draft]
    assert probes == [31, 95]
    fresh = hybrid()
    set_rates(fresh.draft_acceptance, 0.0)
    fresh.draft_observed = False
    assert fresh.plan([], 0, 8) == Plan(0, 8, True)  # before any observation: the whole block


def test_the_first_probe_is_the_largest_round_that_costs_at_most_two_steps():
    avx2 = VerifyCosts({1: 1.0, 2: 1.25, 3: 2.0, 4: 2.3, 8: 4.0})  # 8 tokens cost 4 steps, a draft pass 0.4
    fresh = hybrid(costs=(avx2, 0.4))
    fresh.draft_observed = False
    set_rates(fresh.draft_acceptance, 0.0)
    assert fresh.plan([], 0, 8) == Plan(0, 2, True)
    assert first_probe_size(avx2, 0.0, 8) == 3  # 2.0 steps exactly
    assert first_probe_size(VerifyCosts({1: 1.0, 2: 2.5}), 0.0, 2) == 2  # none affordable: still a probe of 2


def test_without_costs_every_round_proposes_all_there_is():
    proposer = hybrid(costs=None)
    assert proposer.plan([4, 5], 2, 8) == Plan(2, 8, True)
    assert proposer.plan([4] * 7, 2, 8) == Plan(7, 8, False)  # nothing left for the draft to fill
    assert hybrid(with_draft=False, costs=None).plan([4, 5], 2, 8) == Plan(2, 3, False)


def test_beside_the_lookup_the_draft_proposes_within_its_own_block_only():
    proposer = hybrid(max_size=16)  # a draft trained at blocks of 8, rounds of up to 16
    assert proposer.block_size == 8
    set_rates(proposer.draft_acceptance, 0.9)
    set_rates(proposer.lookup_acceptance[3], 0.99)
    assert proposer.plan([5] * 15, 3, 16) == Plan(15, 16, False)  # the lookup fills the longer round
    set_rates(proposer.lookup_acceptance[3], 0.5)
    assert proposer.plan([], 0, 16) == Plan(0, 8, True)  # the draft: its own block at most
    set_rates(proposer.lookup_acceptance[3], 0.95)
    assert proposer.plan([5, 6, 7], 3, 16) == Plan(3, 8, True)  # the draft's tokens after a short continuation
    without_costs = hybrid(max_size=16, costs=None)
    assert without_costs.plan([4, 5], 2, 16) == Plan(2, 8, True)
    assert without_costs.plan([4] * 9, 2, 16) == Plan(9, 10, False)  # past the draft's block: the lookup alone
    fresh = hybrid(max_size=16)
    fresh.draft_observed = False
    set_rates(fresh.draft_acceptance, 0.0)
    assert fresh.plan([], 0, 16) == Plan(0, 8, True)  # the first probe: the draft's whole block


def test_beside_the_lookup_the_draft_runs_its_own_block(monkeypatch):
    proposer = hybrid(max_size=16, costs=None)
    proposer.begin(64)
    passes = []
    round_logits = DFlashProposer.round_logits
    monkeypatch.setattr(DFlashProposer, "round_logits", lambda self, anchor, context, start, block_size, size=None: (
        passes.append((block_size, size)) or round_logits(self, anchor, context, start, block_size, size)))
    context = torch.randn(1, 5, proposer.dflash.draft.config.hidden_size * len(proposer.target_layer_ids))
    proposer.observe([3, 4, 5, 6, 7, 8])
    proposals, _ = proposer.propose(torch.tensor([9]), context, 5, 16, 16)
    assert passes == [(8, 8)] and len(proposals) == 7
    alone = HybridProposer(proposer.target, proposer.dflash, 16, lookup=False)  # the draft alone: the round's block
    assert alone.block_size == 16


# ------------------------------------------------------------------ in the loop


@pytest.fixture
def cpu_like_costs(monkeypatch):
    """Fixed costs rather than timings of a tiny model on a busy machine: the choices are reproducible."""
    monkeypatch.setattr(decoding, "cached_costs", lambda target, proposer, size: (COSTS, 0.1))


@pytest.mark.parametrize("case", range(60))
def test_hybrid_and_lookup_decoding_equal_the_targets_greedy_output(case, cpu_like_costs):
    rng = random.Random(500 + case)
    arch = ARCHITECTURES[case % 3]
    target = TARGETS[arch]
    prompt, max_new, block_size = random_case(rng)
    if case % 2:  # a prompt that repeats itself, so the lookup has something to copy
        prompt = (prompt[: rng.randint(2, 8)] * 8)[: rng.randint(8, 40)]
    proposals = rng.choice(["hybrid", "lookup"])
    block_size = rng.choice([block_size, "auto", None])
    draft = DRAFTS[arch] if proposals == "hybrid" else None
    result = flashdraft.generate(target, draft, prompt, max_new_tokens=max_new, block_size=block_size,
                                 proposals=proposals)
    assert result.tokens == greedy_reference(target, prompt, max_new)
    assert sum(result.tokens_by_source.values()) == len(result.tokens)
    assert sum(result.acceptance_lengths) + 1 >= len(result.tokens)


def test_lookup_needs_no_draft_and_copies_a_looping_answer(cpu_like_costs):
    target, prompt = TARGETS["llama"], [30, 31, 32, 33]
    reference = greedy_reference(target, prompt, 40)  # random models loop: ... 64 22 52 64 22 52 ...
    result = flashdraft.generate(target, None, prompt, max_new_tokens=40, proposals="lookup")
    assert result.tokens == reference
    assert result.tokens_by_source["lookup"] >= 20 and len(result.acceptance_lengths) <= 15
    assert max(result.block_sizes) <= 16


@pytest.mark.parametrize("batched", [False, True])
def test_lookup_rounds_beside_a_draft_are_not_bounded_by_its_block(batched, cpu_like_costs, monkeypatch):
    monkeypatch.setattr(flashdraft.batching, "BatchCosts", lambda target, proposer, size: FixedBatchCosts())
    target, prompt = TARGETS["llama"], [30, 31, 32, 33]
    reference = greedy_reference(target, prompt, 60)  # loops: the lookup copies it
    if batched:
        batch = flashdraft.Batch(target, DRAFTS["llama"])
        sequence = batch.add(prompt, max_new_tokens=60)
        while len(batch):
            batch.step()
        result = sequence.result
    else:
        result = flashdraft.generate(target, DRAFTS["llama"], prompt, max_new_tokens=60)
    assert result.tokens == reference
    assert max(result.block_sizes) > DRAFTS["llama"].block_size == 8
    assert max(result.block_sizes) <= 16


class FixedBatchCosts:
    def at(self, batch_size):
        return COSTS, 0.1


def test_a_round_verifies_what_was_proposed_which_may_be_less_than_the_block(cpu_like_costs):
    target, prompt = TARGETS["qwen3"], [10, 11, 12]
    reference = greedy_reference(target, prompt, 40)
    result = flashdraft.generate(target, None, prompt, max_new_tokens=40, proposals="lookup", block_size=16)
    assert result.tokens == reference
    assert 1 in result.block_sizes and 16 in result.block_sizes  # no continuation: the anchor alone


def test_tokens_are_counted_per_source_up_to_a_stop_token():
    target, prompt = TARGETS["llama"], [30, 31, 32, 33]
    looping = prompt + greedy_reference(target, prompt, 20)  # ends in ... 64 22 52 64 22 52 64 22
    answer = greedy_reference(target, looping, 10)  # 52 64 22 52 ...: the same sequence, continued
    result = flashdraft.generate(target, DRAFTS["llama"], looping, max_new_tokens=10, block_size=8,
                                 stop_token_ids=[answer[2]])
    assert result.tokens == answer[:3] and result.stop_reason == "stop"
    # The prefill's token, then one round whose lookup block was accepted whole: two of its tokens were emitted.
    assert result.acceptance_lengths == [8] and result.tokens_by_source == {"target": 1, "lookup": 2}


class RecordingProposer(DFlashProposer):
    """Notes, for every draft pass, where the anchor is and how much context came with it."""

    calls: list = []

    def round_logits(self, anchor, context, start, block_size, size=None):
        RecordingProposer.calls.append((start, context.shape[1]))
        return super().round_logits(anchor, context, start, block_size, size)


def test_rounds_without_the_draft_still_give_it_their_context(cpu_like_costs, monkeypatch):
    monkeypatch.setattr(decoding, "DFlashProposer", RecordingProposer)
    RecordingProposer.calls = []
    target = TARGETS["llama"]
    result = flashdraft.generate(target, DRAFTS["llama"], [3, 4, 5, 3, 4], max_new_tokens=240)
    assert len(RecordingProposer.calls) >= 2 and len(RecordingProposer.calls) < len(result.block_sizes)
    seen = 0
    for start, context_length in RecordingProposer.calls:  # the contexts tile every position before each anchor
        seen += context_length
        assert seen == start


def test_the_lookup_is_scored_in_rounds_that_did_not_use_it():
    proposer = hybrid(max_size=8, costs=(FLAT_COSTS, 0.1))  # the random draft's block kept whole
    proposer.begin(64)
    set_rates(proposer.draft_acceptance, 0.9)  # the draft beats an unproven lookup
    proposer.draft_observed = True
    proposer.observe([1, 2, 3, 1, 2])  # the prompt [1, 2, 3, 1] and the first token, 2: the anchor at position 4
    width = len(proposer.target_layer_ids) * TARGETS["llama"].config.hidden_size
    proposals, _ = proposer.propose(torch.tensor([2]), torch.randn(1, 4, width), 4, 8, 8)
    assert proposer.round[2] == Plan(0, 8, True) and len(proposals) == 7  # the draft's block alone
    before = [count * 0.97 for count in proposer.lookup_acceptance[2].tested]
    assert proposer.observe([3, 1, 9]) == ["dflash", "dflash"]  # two of the draft's tokens accepted, then 9
    tested = [after - decayed for after, decayed in zip(proposer.lookup_acceptance[2].tested, before)]
    # The lookup would have proposed 3 1 2 ... after `1 2`: 3 and 1 right, 2 wrong (the target said 9).
    assert tested[:4] == pytest.approx([1, 1, 1, 0])
    assert proposer.lookup_acceptance[2].rates()[2] < 0.5 < proposer.lookup_acceptance[2].rates()[0]


def test_a_continuation_is_scored_past_a_short_round_once_later_rounds_show_it():
    proposer = hybrid(with_draft=False, max_size=8)
    proposer.begin(64)
    proposer.observe([5, 6, 7, 8, 9, 4, 5, 6])  # the prompt and the first token: `5 6` continues 7 8 9 4 5 6 7
    set_rates(proposer.lookup_acceptance[2], 0.6)
    proposer.prepare(None, 8)
    proposer.round = (proposer.round[0], proposer.round[1], Plan(1, 2, False))  # a short round: one proposal
    continuation = proposer.round[0]
    assert continuation == [7, 8, 9, 4, 5, 6, 7]
    before = list(proposer.lookup_acceptance[2].tested)
    proposer.observe([7, 8])  # its proposal 7 accepted, 8 the target's: positions 0-1 known, nothing scored yet
    assert proposer.lookup_acceptance[2].tested == before and len(proposer.unscored) == 1
    proposer.observe([9, 4, 5, 1])  # later rounds: the continuation held for five tokens, then 1 against 6
    tested = [after - 0.97 * earlier for after, earlier in zip(proposer.lookup_acceptance[2].tested, before)]
    accepted = [after - 0.97 * 60.0 for after in proposer.lookup_acceptance[2].accepted]
    assert tested == pytest.approx([1, 1, 1, 1, 1, 1, 0])  # every position up to the first miss, though the
    assert accepted == pytest.approx([1, 1, 1, 1, 1, 0, 0])  # round that found it verified only two
    assert proposer.unscored == []


def test_unknown_or_impossible_proposals_are_refused():
    target = TARGETS["llama"]
    with pytest.raises(ValueError, match="proposals must be one of"):
        flashdraft.generate(target, DRAFTS["llama"], [1, 2], max_new_tokens=4, proposals="ngram")
    for proposals in ("hybrid", "dflash"):
        with pytest.raises(ValueError, match="needs a draft"):
            flashdraft.generate(target, None, [1, 2], max_new_tokens=4, proposals=proposals)
    with pytest.raises(ValueError, match="needs proposals"):
        flashdraft.generate(target, None, [1, 2], max_new_tokens=4, block_size=4)
