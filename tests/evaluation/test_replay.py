"""Acceptance by replay: the same rounds as the decoding loop, on the target's greedy answers."""

import json

import pytest
import torch
from bench.tiny_bench import MASK, save_tiny_bench_folders

import flashdraft
from flashdraft.cli import main
from flashdraft.evaluation.replay import greedy_answers, replay, replay_text
from flashdraft.proposals import DFlashProposer
from flashdraft.target import TargetModel

from tiny import OracleProposer, greedy_reference, tiny_draft, tiny_target


class FeatureOracle(OracleProposer):
    """The test oracle, declared to read one target layer so the loop and the replay hand it features."""

    target_layer_ids = [0]
    block_size = None


@pytest.mark.parametrize("block_size", [2, 4, 7])
@pytest.mark.parametrize("wrong_at", [set(), {9, 10, 17, 30, 31, 32}, set(range(0, 60, 3))])
def test_replay_gives_the_loops_acceptance_lengths(block_size, wrong_at):
    target = tiny_target("qwen3", seed=5)
    prompt = [5, 6, 7, 8]
    answer = greedy_reference(target, prompt, 40)
    oracle = FeatureOracle(len(prompt), answer, 96, wrong_at={p + len(prompt) for p in wrong_at})
    looped = flashdraft.generate(target, oracle, prompt, max_new_tokens=40, block_size=block_size)
    assert looped.tokens == answer
    text = replay_text(TargetModel(target), [0], prompt, answer)
    assert replay(oracle, text, block_size) == looped.acceptance_lengths


class RecordingProposer(DFlashProposer):
    def begin(self, max_positions):
        super().begin(max_positions)
        self.calls = []

    def round_logits(self, anchor, context, start, block_size, size=None):
        logits, tokens = super().round_logits(anchor, context, start, block_size, size)
        self.calls.append((start, context.shape[1], anchor.item(), logits))
        return logits, tokens


def test_replay_feeds_a_dflash_draft_what_the_loop_feeds_it():
    target = tiny_target("llama", seed=3, forbid_token=MASK)
    draft = tiny_draft(target, block_size=4, mask_token_id=MASK, seed=1)
    prompt = list(range(10, 30))
    answer = greedy_reference(target, prompt, 24)
    loop_proposer, replay_proposer = (RecordingProposer(draft, TargetModel(target)) for _ in range(2))
    looped = flashdraft.generate(target, loop_proposer, prompt, max_new_tokens=24, block_size=4)
    lengths = replay(replay_proposer, replay_text(TargetModel(target), draft.target_layer_ids, prompt, answer), 4)
    assert lengths == looped.acceptance_lengths
    assert len(loop_proposer.calls) == len(replay_proposer.calls) > 5
    for (start, context, anchor, logits), (start2, context2, anchor2, logits2) in zip(
        loop_proposer.calls, replay_proposer.calls
    ):
        assert (start, context, anchor) == (start2, context2, anchor2)
        torch.testing.assert_close(logits, logits2, atol=1e-4, rtol=0)  # the forbidden mask token: -inf in both


def test_replay_can_run_the_draft_on_a_shorter_block():
    target = tiny_target("llama", seed=3, forbid_token=MASK)
    draft = tiny_draft(target, block_size=8, mask_token_id=MASK, seed=1)
    prompt = list(range(10, 30))
    answer = greedy_reference(target, prompt, 24)
    text = replay_text(TargetModel(target), draft.target_layer_ids, prompt, answer)
    full, short = (RecordingProposer(draft, TargetModel(target)) for _ in range(2))
    assert replay(full, text, 4) == replay(full, text, 4, draft_size=8)  # the default: the draft's own block
    replay(short, text, 4, draft_size=4)
    assert [c[:3] for c in short.calls] == [c[:3] for c in full.calls[: len(short.calls)]]
    # the same anchor and context, but three masks instead of seven: other logits (the block is non-causal)
    assert not torch.allclose(short.calls[0][3], full.calls[0][3])
    with pytest.raises(ValueError, match="draft_size 3 cannot be smaller than block_size 4"):
        replay(short, text, 4, draft_size=3)


def test_the_last_rounds_stay_within_the_answer():
    target = tiny_target("llama", seed=3)
    prompt, answer = [3, 4], greedy_reference(target, [3, 4], 9)
    perfect = FeatureOracle(2, answer, 96)
    text = replay_text(TargetModel(target), [0], prompt, answer)
    assert replay(perfect, text, 4) == [4, 4]  # tokens 2-5 and 6-9 after the prefill's first token
    assert replay(perfect, text, 1) == [1] * 8
    assert replay(perfect, replay_text(TargetModel(target), [0], prompt, answer[:1]), 4) == []


def test_batched_greedy_answers_match_one_by_one_decoding():
    target = tiny_target("llama", seed=4)
    prompts = [[5], list(range(10, 30)), [7, 8, 9], list(range(40, 52))]
    answers = greedy_answers(target, prompts, 12, stop_ids=[2], batch_size=3, progress=False)
    assert answers == [greedy_reference(target, p, 12, stop_token_ids=[2]) for p in prompts]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_tiny_bench_folders(tmp_path_factory.mktemp("bench-replay"),
                                   [{"prompt": f"w{i} w{i + 1}"} for i in range(3)])


def test_bench_replay_command(folders, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path / "home"))
    out = folders / "out"
    code = main(["bench", "--replay", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
                 "--datasets", str(folders / "prompts.jsonl"), "--block-sizes", "2", "4", "--max-new-tokens", "8",
                 "--batch-size", "2", "--output-dir", str(out)])
    assert code == 0
    results = json.loads((out / "replay.json").read_text())
    assert [(s["dataset"], s["block_size"], s["prompts"]) for s in results["summaries"]] == [
        ("prompts", 2, 3), ("prompts", 4, 3)]
    for summary in results["summaries"]:
        rounds = [r for r in results["records"] if r["block_size"] == summary["block_size"]]
        pooled = [length for r in rounds for length in r["acceptance_lengths"]]
        assert summary["tau"] == pytest.approx(sum(pooled) / len(pooled))
        # every answer's tokens after the first are covered by its rounds
        assert all(sum(r["acceptance_lengths"]) == len(r["answer"]) - 1 for r in rounds)
    assert "| prompts | 4 | 3 |" in (out / "replay.md").read_text()
    printed = capsys.readouterr().out
    assert "| prompts | 4 | 3 |" in printed
    # the run ends naming both its outputs
    assert printed.splitlines()[-2:] == [f"json: {out / 'replay.json'}", f"markdown: {out / 'replay.md'}"]


@pytest.mark.parametrize("extra, message", [
    (["--methods", "ar"], "drop --methods"),
    (["--block-sizes", "auto"], "fixed block sizes"),
    (["--temperature", "0.5"], "--temperature 0"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_bench_replay_refuses_what_it_cannot_measure(folders, capsys, extra, message):
    code = main(["bench", "--replay", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
                 "--datasets", str(folders / "prompts.jsonl"), "--output-dir", str(folders / "unused"), *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_answers_are_written_once_per_target_prompts_and_settings(tmp_path, monkeypatch):
    import flashdraft.evaluation.replay as replay_module

    target = tiny_target("llama", seed=4)
    calls = []
    real = replay_module.greedy_answers
    monkeypatch.setattr(replay_module, "greedy_answers", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    first = replay_module.cached_greedy_answers(target, [[5, 6], [7]], 6, [2], 2, tmp_path)
    assert replay_module.cached_greedy_answers(target, [[5, 6], [7]], 6, [2], 2, tmp_path) == first
    assert len(calls) == 1
    replay_module.cached_greedy_answers(target, [[5, 6], [7]], 7, [2], 2, tmp_path)  # another length
    replay_module.cached_greedy_answers(tiny_target("llama", seed=5), [[5, 6], [7]], 6, [2], 2, tmp_path)
    assert len(calls) == 3
    assert first == [greedy_reference(target, p, 6, stop_token_ids=[2]) for p in ([5, 6], [7])]
