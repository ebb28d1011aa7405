"""The adaptive block size: cost interpolation, the choice it makes, probing, and that it stays lossless."""

import os
import random
import time

import pytest

import flashdraft
import flashdraft.decoding as decoding
from flashdraft.adaptive import BlockSizeController, VerifyCosts, cached_costs, measure_verify_costs
from flashdraft.proposals import DFlashProposer
from flashdraft.target import TargetModel

from tiny import OracleProposer, greedy_reference, tiny_draft, tiny_target

# A CPU-like cost curve: a 16-token forward costs 1.8 one-token forwards.
COSTS = VerifyCosts({1: 1.0, 2: 1.3, 4: 1.5, 8: 1.6, 16: 1.8})


def test_verify_costs_interpolate_and_extrapolate():
    assert COSTS(1) == 1.0 and COSTS(16) == 1.8
    assert COSTS(3) == pytest.approx(1.4)
    assert COSTS(12) == pytest.approx(1.7)
    assert COSTS(24) == pytest.approx(2.0)  # the last segment's slope continued


def controller_after(rounds, acceptance, size=16, draft_seconds=0.1, seed=0):
    """A controller that has seen `rounds` full-size rounds where each proposal is accepted with `acceptance`."""
    rng = random.Random(seed)
    controller = BlockSizeController(size, COSTS, draft_seconds)
    for _ in range(rounds):
        accepted = 0
        while accepted < size - 1 and rng.random() < acceptance:
            accepted += 1
        controller.observe(size, accepted)
    return controller


def test_expected_tokens_is_the_chain_of_acceptance_rates():
    controller = BlockSizeController(4, COSTS, 0.1)
    controller.accepted, controller.tested = [0.8, 0.5, 0.5], [1.0, 1.0, 1.0]
    assert controller.expected_tokens(1) == 1.0
    assert controller.expected_tokens(4) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_a_draft_that_is_never_accepted_turns_speculation_off():
    assert controller_after(5, 0.0).best_size() == 1


def test_a_draft_that_is_always_accepted_uses_the_whole_block():
    assert controller_after(20, 1.0).best_size() == 16


def test_a_middling_draft_gets_a_middling_block():
    size = controller_after(200, 0.6).best_size()
    assert 2 <= size <= 8


def test_observe_counts_only_the_positions_a_round_tested():
    controller = BlockSizeController(8, COSTS, 0.1, decay=1.0)
    assert controller.choose() == 8  # nothing observed yet: a full block, which costs under two steps here
    controller.observe(8, 2)  # proposals 1, 2 accepted, 3 rejected, 4..7 never tested
    assert controller.accepted[:4] == [1.5, 1.5, 0.5, 0.5]
    assert controller.tested[:4] == [2.0, 2.0, 2.0, 1.0]
    controller.observe(3, 2)  # a 3-token round accepting both proposals tests positions 1, 2 only
    assert controller.tested[:3] == [3.0, 3.0, 2.0]


def test_the_first_round_is_the_largest_that_costs_at_most_two_steps():
    avx2 = VerifyCosts({1: 1.0, 2: 1.25, 3: 2.0, 4: 2.3, 8: 4.0})  # an AVX2 CPU's, in one-token steps
    assert BlockSizeController(8, avx2, 0.4).choose() == 2
    assert BlockSizeController(8, avx2, 0.0).choose() == 3


def test_probes_come_less_often_while_drafting_does_not_pay():
    controller = controller_after(5, 0.0)
    choices = [controller.choose() for _ in range(32 + 64)]
    assert sum(size > 1 for size in choices) == 2
    assert choices[31] == choices[95] == 6  # after 32, then after 64 more rounds without drafting


def test_a_probe_has_the_size_that_pays_for_a_draft_accepted_half_the_time():
    # Under COSTS a round of b tokens yields 2 - 0.5^(b-1) at the prior: 6 tokens is where more stops paying.
    assert BlockSizeController(16, COSTS, 0.1).probe_size == 6
    cpu = VerifyCosts({1: 9.4, 2: 10.9, 4: 13.7, 8: 24.6, 16: 45.9})  # this CPU's engine, in milliseconds
    assert BlockSizeController(8, cpu, 1.9).probe_size == 3  # 8 tokens cost 2.6 steps here: probe small
    assert BlockSizeController(8, VerifyCosts({1: 1.0, 8: 1.01}), 0.01).probe_size == 8  # nearly free: all of it
    assert BlockSizeController(8, VerifyCosts({1: 1.0, 8: 9.0}), 0.5).probe_size == 2  # at least one proposal


def test_costs_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path))
    target = TargetModel(tiny_target())
    proposer = DFlashProposer(tiny_draft(target.model, block_size=8), target)
    costs, draft_seconds = cached_costs(target, proposer, 8)
    assert sorted(costs.seconds) == [1, 2, 3, 4, 6, 8]
    assert all(s > 0 for s in costs.seconds.values()) and draft_seconds > 0
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1
    assert cached_costs(target, proposer, 8) == (costs, draft_seconds)  # read back, not measured again


def test_the_draft_pass_is_timed_as_a_round_runs_it_after_its_context_is_read(monkeypatch):
    """A round's draft pass reads the few features the last round verified, not the whole context: the timed pass
    comes after an untimed one over the context and a one-token target forward, with ROUND_CONTEXT new positions
    right before the anchor; it is priced against the one-token forward."""
    from flashdraft import adaptive

    target = TargetModel(tiny_target())
    proposer = DFlashProposer(tiny_draft(target.model, block_size=8), target)
    calls, clock = [], {"now": 0.0}
    real_propose, real_forward = proposer.propose, target.forward

    def propose(anchor, context, start, block_size, size, params, generator):
        calls.append((context.shape[1], start))
        clock["now"] += context.shape[1]  # a pass's "seconds": the context positions it reads
        return real_propose(anchor, context, start, block_size, size, params, generator)

    def forward(ids, *args, **kwargs):
        if ids.shape[1] <= 8:  # a measured forward, not the context's: 10 "seconds" a token
            calls.append(("forward", ids.shape[1]))
            clock["now"] += 10 * ids.shape[1]
        return real_forward(ids, *args, **kwargs)

    proposer.propose, target.forward = propose, forward
    monkeypatch.setattr(adaptive.time, "perf_counter", lambda: clock["now"])
    costs, seconds = adaptive.measure_round_costs(target, proposer, 8, context_length=40, repeats=3)
    draft_turns = [call for call in calls if call != ("forward", 1) and call[0] != "forward"]
    assert draft_turns == [(40, 40), (adaptive.ROUND_CONTEXT, 40 + adaptive.ROUND_CONTEXT)] * 4
    assert seconds == adaptive.ROUND_CONTEXT  # only the round's pass was timed
    assert costs.seconds == {n: 10 * n for n in (1, 2, 3, 4, 6, 8)}


def test_costs_are_priced_by_their_ratio_to_the_one_token_step_of_the_same_turn(monkeypatch):
    """A turn where the whole machine ran slower moves the step's price, not the ratios: here every work of the
    second turn took three times as long."""
    from flashdraft import adaptive

    turns = {1: [10.0, 30.0, 10.0], 2: [12.0, 36.0, 12.0], 3: [15.0, 45.0, 14.0], 4: [20.0, 60.0, 20.0]}
    monkeypatch.setattr(adaptive, "interleaved_seconds", lambda works, repeats, summary: turns)
    costs, draft = adaptive.measure_round_costs(TargetModel(tiny_target()), None, 4, context_length=8, repeats=3)
    assert costs.seconds == {1: 10.0, 2: 12.0, 3: 15.0, 4: 20.0} and draft == 0.0  # 3: the median of 1.5, 1.5, 1.4


def test_a_measurement_taken_on_a_busy_machine_is_taken_again_once_it_is_quiet(tmp_path, monkeypatch):
    from flashdraft import adaptive, files

    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path))
    target = TargetModel(tiny_target())
    proposer = DFlashProposer(tiny_draft(target.model, block_size=8), target)
    load = {"cores": 1.5}
    measured = []
    real = adaptive.measure_round_costs

    def counted(*args, **kwargs):
        measured.append(load["cores"])
        return real(*args, **kwargs)

    for module in (adaptive, files):
        monkeypatch.setattr(module, "other_processes_cpu", lambda: load["cores"])
    monkeypatch.setattr(adaptive, "measure_round_costs", counted)
    busy = cached_costs(target, proposer, 8)
    assert cached_costs(target, proposer, 8) == busy and measured == [1.5]  # still busy: the busy one serves
    load["cores"] = 0.1
    quiet = cached_costs(target, proposer, 8)
    assert measured == [1.5, 0.1] and sorted(quiet[0].seconds) == sorted(busy[0].seconds)
    load["cores"] = 1.5
    assert cached_costs(target, proposer, 8) == quiet and measured == [1.5, 0.1]  # a quiet one is kept for good


def test_measurements_are_marked_only_when_taken_busy(tmp_path, monkeypatch):
    from flashdraft import files

    def never(*args):
        raise AssertionError("the load was read for a measurement taken at rest")

    files.save_measurement(tmp_path / "a.json", {"x": 1}, busy=False)
    monkeypatch.setattr(files, "other_processes_cpu", never)
    assert files.cached_measurement(tmp_path / "a.json") == {"x": 1}
    assert files.cached_measurement(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("[1, 2")
    assert files.cached_measurement(tmp_path / "bad.json") is None
    files.save_measurement(tmp_path / "b.json", {"x": 2}, busy=True)
    monkeypatch.setattr(files, "other_processes_cpu", lambda: 0.9)
    assert files.cached_measurement(tmp_path / "b.json") == {"x": 2}
    monkeypatch.setattr(files, "other_processes_cpu", lambda: 0.2)
    assert files.cached_measurement(tmp_path / "b.json") is None


@pytest.mark.parametrize("niceness", [0, 2, 19])
def test_another_process_at_work_counts_as_busy_unless_it_yields(niceness):
    import subprocess
    import sys

    from flashdraft.files import YIELDING_NICE, _competing_ticks

    # A child starts at this process's niceness and can only raise it (a suite run under `nice` runs them all nicer).
    # Whether it competes is a property of the process, not of how much CPU a busy machine lets it have: the test
    # asks which processes are counted, not how busy the machine looks.
    effective = max(niceness, os.nice(0))
    counts = effective < YIELDING_NICE
    spin = f"import os, time\nos.nice({effective} - os.nice(0))\nend = time.time() + 3\nwhile time.time() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # the child has set its niceness and spins
        assert (spinner.pid in _competing_ticks()) == counts
        assert os.getpid() not in _competing_ticks()
    finally:
        spinner.kill()
        spinner.wait()


def test_other_processes_cpu_is_the_cores_their_ticks_kept_busy(monkeypatch):
    from flashdraft import files as files_module

    snapshots = iter([{1: 10, 2: 5, 4: 9}, {1: 10 + 30, 2: 5, 3: 20}])  # 4 ended, 3 started
    monkeypatch.setattr(files_module, "_competing_ticks", lambda: next(snapshots))
    monkeypatch.setattr(files_module.time, "sleep", lambda seconds: None)
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    assert files_module.other_processes_cpu(0.5) == pytest.approx((30 + 20) / ticks_per_second / 0.5)


def test_measured_sizes_include_the_block_size_itself():
    assert 5 in measure_verify_costs(TargetModel(tiny_target()), 5, context_length=8, repeats=1).seconds


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_auto_block_size_is_lossless(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path))
    target = tiny_target(arch, seed=11)
    draft = tiny_draft(target, block_size=8)
    for prompt in ([4, 5, 6], list(range(10, 40))):
        reference = greedy_reference(target, prompt, 48)
        assert flashdraft.generate(target, draft, prompt, max_new_tokens=48, block_size="auto").tokens == reference


@pytest.fixture
def cpu_like_costs(monkeypatch):
    """The CPU-like cost curve instead of timings of a tiny model on a busy machine: behaviour tests stay exact."""
    monkeypatch.setattr(decoding, "cached_costs", lambda target, proposer, size: (COSTS, 0.1))


def test_auto_with_a_random_draft_falls_back_to_plain_decoding(cpu_like_costs):
    target = tiny_target("llama", seed=2)
    result = flashdraft.generate(target, tiny_draft(target, block_size=8), [3, 4], max_new_tokens=60,
                                 block_size="auto", proposals="dflash")
    assert result.block_sizes[0] >= 2  # the first round drafts; the draft's confidence sizes what is verified
    assert result.block_sizes[-20:].count(1) >= 19  # at most one probe among the last rounds


def test_auto_with_a_perfect_proposer_keeps_whole_blocks(cpu_like_costs):
    target = tiny_target("llama", seed=2)
    reference = greedy_reference(target, [3, 4], 80)
    oracle = OracleProposer(2, reference, 96)
    oracle.block_size = 8
    result = flashdraft.generate(target, oracle, [3, 4], max_new_tokens=80, block_size="auto")
    assert result.tokens == reference
    assert result.block_sizes[:-1] == [8] * (len(result.block_sizes) - 1)


class RecordingProposer(DFlashProposer):
    """A DFlash proposer that notes, for every draft call, where the anchor is and how much context came with it."""

    def begin(self, max_positions):
        super().begin(max_positions)
        self.calls = []

    def round_logits(self, anchor, context, start, *args):
        self.calls.append((start, context.shape[1]))
        return super().round_logits(anchor, context, start, *args)


def test_rounds_without_drafting_still_give_the_draft_their_context(cpu_like_costs):
    target = tiny_target("llama", seed=2)
    proposer = RecordingProposer(tiny_draft(target, block_size=8), TargetModel(target))
    result = flashdraft.generate(target, proposer, [3, 4], max_new_tokens=120, block_size="auto")
    assert result.block_sizes.count(1) > 20 and len(proposer.calls) >= 2  # probes after runs of plain decoding
    seen = 0
    for start, context_length in proposer.calls:  # the contexts tile every position before each anchor
        seen += context_length
        assert seen == start
