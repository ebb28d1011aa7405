"""The runner's instruments and schedule on tiny models: the target probe recovers each method's acceptance lengths,
methods interleave prompt by prompt in rotating order, and later turns follow `ar`'s answer."""

import pytest
import torch

import flashdraft
from flashdraft.bench.methods import DecodeSettings, build_methods
from flashdraft.bench.runner import measure, run_benchmark
from flashdraft.engine import unsupported_reason
from flashdraft.evaluation.datasets import Sample
from flashdraft.text import encode_chat

from tiny import tiny_draft, tiny_target, tiny_tokenizer

MASK = 1
ALWAYS = 7  # the token the constant target always produces


def constant_target():
    """A target whose every prediction is token 7. The draft reads its logits through the same head, so it proposes
    7 as well and every proposal is accepted: each round adds a whole block."""
    target = tiny_target("llama", forbid_token=MASK)

    def favour(module, inputs, output):
        output[..., ALWAYS] = 1e4
        return output

    target.get_output_embeddings().register_forward_hook(favour)
    return target


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_probe_counts_whole_blocks_for_every_dflash_method(tokenizer):
    target = constant_target()
    draft = tiny_draft(target, block_size=4, mask_token_id=MASK)
    prompt = torch.tensor([[10, 11, 12, 13, 14]])
    settings = DecodeSettings(max_new_tokens=13, temperature=0.0, stop_token_ids=())  # 1 + 3 rounds of 4
    expected = flashdraft.generate(target, draft, prompt, max_new_tokens=13, block_size=4)
    assert expected.tokens == [ALWAYS] * 13 and expected.acceptance_lengths == [4, 4, 4]
    methods = build_methods(["flashdraft", "reference", "transformers-dflash"], target=target, tokenizer=tokenizer,
                            draft=draft)
    for method in methods:
        tokens, seconds, first_token, lengths = measure(method, target, prompt, settings, seed=0)
        assert tokens == expected.tokens, method.name
        assert lengths == ([1] * 12 if method.name == "ar" else [4, 4, 4]), method.name
        assert 0 < first_token < seconds


@pytest.mark.parametrize("name, block_size, proposals", [("flashdraft", 4, "dflash"),
                                                         ("flashdraft-hybrid", "auto", "hybrid")])
def test_probe_agrees_with_flashdraft_own_statistics(tokenizer, name, block_size, proposals):
    target = tiny_target("qwen3", forbid_token=MASK)
    draft = tiny_draft(target, block_size=4, mask_token_id=MASK)
    [_, method] = build_methods([name], target=target, tokenizer=tokenizer, draft=draft)
    prompt = torch.tensor([[20, 21, 22, 23] * 5])
    settings = DecodeSettings(max_new_tokens=30, temperature=0.0, stop_token_ids=())
    method.generate(prompt, settings, seed=0)  # the warm-up, as the runner's: costs are measured once, here
    tokens, _, _, lengths = measure(method, target, prompt, settings, seed=0)
    result = flashdraft.generate(target, draft, prompt, max_new_tokens=30, block_size=block_size,
                                 proposals=proposals)
    assert tokens == result.tokens
    assert lengths == result.acceptance_lengths
    assert sum(lengths) == len(tokens) - 1  # the prefill gives the first token, every round the rest
    assert method.tokens_by_source == result.tokens_by_source


def test_interleaved_schedule_and_later_turns_follow_ar(tokenizer):
    target = tiny_target("llama", forbid_token=MASK)
    draft = tiny_draft(target, block_size=4, mask_token_id=MASK)
    methods = build_methods(["flashdraft", "prompt-lookup"], target=target, tokenizer=tokenizer, draft=draft)
    datasets = {
        "chat": [Sample("c0", ("w1 w2 w3", "w4 w5")), Sample("c1", ("w6",))],
        "other": [Sample("o0", ("w7 w8",))],
    }
    settings = DecodeSettings(max_new_tokens=8, temperature=0.0, stop_token_ids=(2,))
    records = run_benchmark(methods, target, tokenizer, datasets, settings, seed=0)

    assert [(r.dataset, r.sample_id, r.turn) for r in records[::3]] == [
        ("chat", "c0", 0), ("chat", "c0", 1), ("chat", "c1", 0), ("other", "o0", 0)]
    order = [[r.method for r in records[i : i + 3]] for i in range(0, len(records), 3)]
    assert order == [
        ["ar", "flashdraft-b4", "prompt-lookup"],
        ["flashdraft-b4", "prompt-lookup", "ar"],
        ["prompt-lookup", "ar", "flashdraft-b4"],
        ["ar", "flashdraft-b4", "prompt-lookup"],
    ]
    first_answer = next(r.tokens for r in records if r.method == "ar" and r.sample_id == "c0" and r.turn == 0)
    answer = tokenizer.decode(first_answer, skip_special_tokens=True)
    second_prompt = encode_chat(tokenizer, datasets["chat"][0].messages([answer]), chat_template=True)
    assert {r.prompt_tokens for r in records[3:6]} == {len(second_prompt)}
    by_prompt = {}
    for r in records:
        by_prompt.setdefault((r.sample_id, r.turn), []).append(r.tokens)
    assert all(len({tuple(tokens) for tokens in outputs}) == 1 for outputs in by_prompt.values())  # lossless


def test_runner_needs_ar_first_and_some_prompts(tokenizer):
    target = tiny_target("llama", num_layers=1)
    draft = tiny_draft(target, block_size=4, mask_token_id=MASK)
    methods = build_methods(["flashdraft"], target=target, tokenizer=tokenizer, draft=draft)
    settings = DecodeSettings(4, 0.0, ())
    with pytest.raises(ValueError, match="first method must be 'ar'"):
        run_benchmark(methods[::-1], target, tokenizer, {"d": [Sample("s", ("w1",))]}, settings)
    with pytest.raises(ValueError, match="no prompts"):
        run_benchmark(methods, target, tokenizer, {"d": []}, settings)


def test_flashdraft_methods_are_measured_on_the_engine(tokenizer):
    """No probe hooks on the target while a flashdraft method runs: they would switch the CPU engine off."""
    target = tiny_target("qwen3")
    [ar, plain] = build_methods(["flashdraft-plain"], target=target, tokenizer=tokenizer)
    seen = []

    def generate(*args, original=plain.generate, **kwargs):
        seen.append(unsupported_reason(target))
        return original(*args, **kwargs)

    plain.generate = generate
    prompt = torch.tensor([[20, 21, 22, 23]])
    settings = DecodeSettings(max_new_tokens=12, temperature=0.0, stop_token_ids=())
    tokens, seconds, first_token, lengths = measure(plain, target, prompt, settings, seed=0)
    assert seen == [None]
    assert tokens == measure(ar, target, prompt, settings, seed=0)[0]
    assert lengths == [1] * 11 and 0 < first_token < seconds
